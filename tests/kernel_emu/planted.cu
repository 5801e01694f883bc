// tests/kernel_emu/planted.cu — small kernels with planted bugs of the kinds
// the emulator must catch (warp exchanges with the wrong lanes, a warp vote
// some lanes skip, an update two threads race on, shared memory read before
// the barrier or __syncwarp that would order it), beside correct versions.
// Built into the emulator for tests/kernel_emulation.rs only.
#include "bulk.cuh"
#include "common.cuh"

struct kvt_planted_params {
    uint32_t* out;  // [blockDim.x] results, or one counter
    uint32_t variant;
};

#define KVT_PLANTED_PREFIX 0        // inclusive sums of the lane numbers (correct)
#define KVT_PLANTED_PREFIX_WRONG 1  // the same with a shuffle reading lane + d: wrong sums
#define KVT_PLANTED_SKIPPED_VOTE 2  // odd lanes skip a full-warp ballot
#define KVT_PLANTED_RACE 3          // every thread adds 1 to out[0] with a plain load and store
#define KVT_PLANTED_ATOMIC 4        // every thread adds 1 to out[0] atomically (correct)
// Shared memory (blockDim.x words): each thread writes its word, then reads
// its neighbour's (the next thread's, in its warp for the warp variants).
#define KVT_PLANTED_SMEM_BARRIER 5  // ordered by __syncthreads (correct)
#define KVT_PLANTED_SMEM_RACE 6     // no barrier: a race
#define KVT_PLANTED_SMEM_SYNCWARP 7 // ordered by __syncwarp within the warp (correct)
#define KVT_PLANTED_SMEM_BALLOT 8   // only a ballot between: votes order no memory, a race
// The error word (out: two kvt_error_word, the word and what a take got):
// every thread but 0 reports four times (kind (tid + i) % 3, position
// 4 tid + i, value -tid) while thread 0 takes the word once, in between.
#define KVT_PLANTED_TAKE 9          // with kvt_error_take's exchanges (correct)
#define KVT_PLANTED_TAKE_NAIVE 10   // read, then reset with plain stores: loses reports
// 16-bit minima (out: one word, two halves): thread t folds 1000 + (t * 37) % 512
// into half t % 2.
#define KVT_PLANTED_MIN16 11        // with atomic_min16 (correct)
#define KVT_PLANTED_MIN16_PLAIN 12  // a plain read, compare and write: loses minima
// The bulk engine (kernels/bulk.cuh), warp 0 of a block of at least 128
// threads: words [0, 48) of out are three 64-byte rows it bulk-loads into a
// stage of shared memory, whose fourth row the lanes zero; one bulk store
// writes the stage to words [128, 192).
#define KVT_PLANTED_BULK 13               // waits, fences and waits again as it must (correct)
#define KVT_PLANTED_BULK_NO_WAIT 14       // stores without waiting for the loads' barrier
#define KVT_PLANTED_BULK_NO_FENCE 15      // the zeros reach the store without the proxy fence
#define KVT_PLANTED_BULK_NO_WAIT_ALL 16   // ends without waiting for its store
#define KVT_PLANTED_BULK_REUSE 17         // writes the stage again before its store has read it
#define KVT_PLANTED_BULK_STORE_FIRST 18   // stores, then waits for the loads' barrier
#define KVT_PLANTED_BULK_PLAIN_REUSE 19   // as 17 with a plain shared store, which the emulator does not track

extern "C" __global__ void kvt_planted(const kvt_planted_params p) {
    using namespace kvt;
    const uint32_t tid = threadIdx.x, lane = tid % KVT_WARP;
    switch (p.variant) {
        case KVT_PLANTED_PREFIX:
            st(p.out + tid, warp_inclusive_sum(lane, lane));
            break;
        case KVT_PLANTED_PREFIX_WRONG: {
            uint32_t v = lane;
            for (uint32_t d = 1; d < KVT_WARP; d <<= 1) {
                const uint32_t n = __shfl_sync(kFullWarp, v, (lane + d) % KVT_WARP);
                if (lane >= d) v += n;
            }
            st(p.out + tid, v);
            break;
        }
        case KVT_PLANTED_SKIPPED_VOTE: {
            uint32_t v = 0;
            if (lane % 2 == 0) v = warp_ballot(true);
            st(p.out + tid, v);
            break;
        }
        case KVT_PLANTED_RACE: {
            const uint32_t x = ld(p.out);
            st(p.out, x + 1);
            break;
        }
        case KVT_PLANTED_SMEM_BARRIER:
        case KVT_PLANTED_SMEM_RACE:
        case KVT_PLANTED_SMEM_SYNCWARP:
        case KVT_PLANTED_SMEM_BALLOT: {
            volatile uint32_t* words = reinterpret_cast<volatile uint32_t*>(kvt_dynamic_smem);
            words[tid] = tid * 3 + 1;
            uint32_t next = (tid + 1) % blockDim.x;
            if (p.variant == KVT_PLANTED_SMEM_BARRIER) __syncthreads();
            if (p.variant == KVT_PLANTED_SMEM_SYNCWARP || p.variant == KVT_PLANTED_SMEM_BALLOT) {
                next = tid - lane + (lane + 1) % KVT_WARP;
                if (p.variant == KVT_PLANTED_SMEM_SYNCWARP) __syncwarp();
                else (void)warp_ballot(true);
            }
            st(p.out + tid, words[next]);
            break;
        }
        case KVT_PLANTED_TAKE:
        case KVT_PLANTED_TAKE_NAIVE: {
            kvt_error_word* word = reinterpret_cast<kvt_error_word*>(p.out);
            kvt_error_word* taken = word + 1;
            if (tid != 0) {
                for (uint32_t i = 0; i < 4; ++i) report(word, (tid + i) % 3, 4 * tid + i, -(int64_t)tid);
            } else if (p.variant == KVT_PLANTED_TAKE) {
                kvt_error_take(kvt_error_take_params{(kvt_addr)(uintptr_t)word, (kvt_addr)(uintptr_t)taken});
            } else {
                st(&taken->flags, ld(&word->flags));
                st(&taken->count, ld(&word->count));
                for (uint32_t k = 0; k < KVT_ERR_KINDS; ++k) st(&taken->first[k], ld(&word->first[k]));
                st(&word->flags, 0u);
                st(&word->count, 0u);
                for (uint32_t k = 0; k < KVT_ERR_KINDS; ++k) st(&word->first[k], (uint64_t)KVT_ERR_FIRST_NONE);
            }
            break;
        }
        case KVT_PLANTED_MIN16:
        case KVT_PLANTED_MIN16_PLAIN: {
            uint16_t* half = reinterpret_cast<uint16_t*>(p.out) + tid % 2;
            const uint16_t v = (uint16_t)(1000 + (tid * 37) % 512);
            if (p.variant == KVT_PLANTED_MIN16) {
                atomic_min16(half, v);
            } else if (v < ld(half)) {
                st(half, v);
            }
            break;
        }
        case KVT_PLANTED_BULK:
        case KVT_PLANTED_BULK_NO_WAIT:
        case KVT_PLANTED_BULK_NO_FENCE:
        case KVT_PLANTED_BULK_NO_WAIT_ALL:
        case KVT_PLANTED_BULK_REUSE:
        case KVT_PLANTED_BULK_STORE_FIRST:
        case KVT_PLANTED_BULK_PLAIN_REUSE: {
            if (tid >= KVT_WARP) break;
            uint64_t* bar = reinterpret_cast<uint64_t*>(kvt_dynamic_smem);
            char* stage = reinterpret_cast<char*>(kvt_dynamic_smem) + 16;
            if (lane == 0) {
                bulk::barrier_init(bar, 1);
                bulk::fence_barrier_init();
            }
            __syncwarp();
            if (lane < 4) bulk::st_shared16(stage + 192 + 16 * lane, make_uint4(0, 0, 0, 0));
            if (p.variant != KVT_PLANTED_BULK_NO_FENCE) bulk::fence_async_shared();
            __syncwarp();
            if (lane == 0) {
                bulk::arrive_expect_bytes(bar, 192);
                for (uint32_t r = 0; r < 3; ++r) bulk::load(stage + 64 * r, p.out + 16 * r, 64, bar);
                const bool first = p.variant == KVT_PLANTED_BULK_STORE_FIRST;
                if (p.variant != KVT_PLANTED_BULK_NO_WAIT && !first) bulk::wait(bar, 0);
                bulk::store(p.out + 128, stage, 256);
                bulk::commit();
                if (first) bulk::wait(bar, 0);
            }
            __syncwarp();
            if (p.variant == KVT_PLANTED_BULK_REUSE && lane < 4)
                bulk::st_shared16(stage + 16 * lane, make_uint4(7, 7, 7, 7));
            if (p.variant == KVT_PLANTED_BULK_PLAIN_REUSE && lane < 4)
                reinterpret_cast<volatile uint32_t*>(stage)[4 * lane] = 7;
            if (lane == 0 && p.variant != KVT_PLANTED_BULK_NO_WAIT_ALL) bulk::wait_all();
            break;
        }
        default:
            atomicAdd(p.out, 1u);
    }
}

// Thread-block clusters (kvt::cluster_sync, kernels/common.cuh), a grid of
// clusters of blockDim.x-thread blocks: thread t of block b writes
// 7 b + t + 1 to out[b * blockDim.x + t], then reads the same thread's word
// of the next block of its cluster (by rank, wrapping) into
// out[(gridDim.x + b) * blockDim.x + t]; thread 0 of each block writes
// 100 * rank + cluster size to out[2 * gridDim.x * blockDim.x + b].
#define KVT_PLANTED_CLUSTER_SYNC 20       // a cluster barrier between (correct)
#define KVT_PLANTED_CLUSTER_NO_SYNC 21    // none: a race between the blocks
#define KVT_PLANTED_CLUSTER_DIVERGENT 22  // the last rank's blocks end before the barrier
// The same exchange through distributed shared memory (kvt::cluster_map):
// each thread writes its word of its block's shared memory, and reads the
// next block's word through the mapping.
#define KVT_PLANTED_DSMEM 23              // a cluster barrier before the read, another before exiting (correct)
#define KVT_PLANTED_DSMEM_NO_SYNC 24      // no barrier before the read: a race between the blocks
#define KVT_PLANTED_DSMEM_EXIT 25         // rank 0 exits after the first barrier: the others read a block gone

extern "C" __global__ void kvt_planted_cluster(const kvt_planted_params p) {
    using namespace kvt;
    const uint32_t t = threadIdx.x, b = blockIdx.x, n = blockDim.x;
    const uint32_t rank = cluster_rank(), size = cluster_size();
    const uint32_t next = b - rank + (rank + 1) % size;
    st(p.out + b * n + t, 7 * b + t + 1);
    if (t == 0) st(p.out + 2 * gridDim.x * n + b, 100 * rank + size);
    if (p.variant >= KVT_PLANTED_DSMEM) {
        uint32_t* mine = reinterpret_cast<uint32_t*>(kvt_dynamic_smem) + t;
        *mine = 7 * b + t + 1;
        if (p.variant != KVT_PLANTED_DSMEM_NO_SYNC) cluster_sync();
        if (p.variant == KVT_PLANTED_DSMEM_EXIT && rank == 0) return;
        st(p.out + (gridDim.x + b) * n + t, *cluster_map(mine, (rank + 1) % size));
        if (p.variant != KVT_PLANTED_DSMEM_EXIT) cluster_sync();
        return;
    }
    if (p.variant == KVT_PLANTED_CLUSTER_DIVERGENT && rank == size - 1) return;
    if (p.variant != KVT_PLANTED_CLUSTER_NO_SYNC) cluster_sync();
    st(p.out + (gridDim.x + b) * n + t, ld(p.out + next * n + t));
}
