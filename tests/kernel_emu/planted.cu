// tests/kernel_emu/planted.cu — small kernels with planted bugs of the kinds
// the emulator must catch (warp exchanges with the wrong lanes, a warp vote
// some lanes skip, an update two threads race on), beside correct versions.
// Built into the emulator for tests/kernel_emulation.rs only.
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
        default:
            atomicAdd(p.out, 1u);
    }
}
