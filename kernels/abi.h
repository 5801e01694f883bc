/*
 * kernels/abi.h — the parameter structs that Rust passes by value to the
 * kvtier kernels, and the device-side error word they report bad indices in.
 *
 * This header is the single definition of the kernel ABI. The Rust side is
 * generated from it by bindgen into bindings/abi.rs (scripts/regen-bindings.sh;
 * `scripts/regen-bindings.sh --check` fails when the checked-in file is stale),
 * and the generated layout assertions make a drifted struct a compile error.
 *
 * Rules for this file: plain C, fixed-width types only, every address a
 * kvt_addr (a 64-bit address the executor can dereference: a device or
 * host-mapped address for the CUDA kernels, a host address for the CPU
 * executor, which interprets the same structs), explicit padding, no
 * pointers-to-pointers.
 */
#ifndef KVTIER_ABI_H
#define KVTIER_ABI_H

/* NVRTC has no C library headers; its fixed-width types are spelled out. */
#ifdef __CUDACC_RTC__
typedef signed char int8_t;
typedef unsigned char uint8_t;
typedef short int16_t;
typedef unsigned short uint16_t;
typedef int int32_t;
typedef unsigned int uint32_t;
typedef long long int64_t;
typedef unsigned long long uint64_t;
typedef unsigned long long uintptr_t;
#define INT32_MIN (-2147483647 - 1)
#define INT32_MAX 2147483647
#else
#include <stdint.h>
#endif

/* Bumped whenever a struct below changes shape or meaning. */
#define KVT_ABI_VERSION 2

/* An address the executor dereferences (device, host-mapped or host). */
typedef uint64_t kvt_addr;

/*
 * Error kinds. Each kind owns one bit of kvt_error_word.flags and one slot of
 * kvt_error_word.first. Positions are reported per kind:
 *   gather kinds:    (batch row << 16) | top-k column
 *   writeback kinds: item index
 */
#define KVT_ERR_GATHER_SLOT 0      /* req_slots[row] is < -1, >= num_slots, or names an unbound slot */
#define KVT_ERR_GATHER_SEQ_LEN 1   /* seq_lens[row] is < 0 or > tokens_per_region */
#define KVT_ERR_GATHER_INDEX 2     /* topk[row][col] is < -1 or >= seq_lens[row] */
#define KVT_ERR_WRITEBACK_SLOT 3   /* item_slots[item] is < -1, >= num_slots, or names an unbound slot */
#define KVT_ERR_WRITEBACK_TOKEN 4  /* item_tokens[item] is < 0 or >= tokens_per_region */
#define KVT_ERR_WRITEBACK_SRC_ROW 5 /* item_src_rows[item] is < 0 or >= src_rows */
/* swap-in kinds: position (batch row << 16) | entry (0 for request-level kinds; the query column
 * for a bad block id; the miss index for a replayed plan entry) */
#define KVT_ERR_SWAP_NUM_REAL 6    /* num_real_reqs[0] is < 0 (taken as 0; above the batch: every row is real) */
#define KVT_ERR_SWAP_REQ 7         /* req_pool_indices[row] is < 0 or >= num_requests */
#define KVT_ERR_SWAP_SEQ_LEN 8     /* seq_lens[row] is < 0 or > max_tokens */
#define KVT_ERR_SWAP_LRU 9         /* lru_slots[req] is not a permutation of [0, hot) */
#define KVT_ERR_SWAP_TOKEN 10      /* top_k_tokens[row][col] is < -1 or >= seq_lens[row] */
#define KVT_ERR_SWAP_HOST_LOC 11   /* host_cache_locs[req][token] is < 0 or >= host_rows */
#define KVT_ERR_SWAP_DEVICE_LOC 12 /* a top-k entry's device row is < 0 or >= device_rows, or no usable slot is left */
#define KVT_ERR_SWAP_SLOT_LOC 13   /* an evictable slot's device row is out of range (column = slot; never loaded into) */
#define KVT_ERR_SWAP_PLAN_COUNT 14 /* a replayed miss plan's count[row] is < 0 or > plan_capacity (the row copies nothing) */
#define KVT_ERR_SWAP_DUP_REQ 15    /* req_pool_indices[row] names a request an earlier row of the batch names (its
                                    * state is that row's to change; two rows would race on it) */
#define KVT_ERR_KINDS 16           /* slots reserved in the error word (room for later kinds) */

/* Value of an empty kvt_error_word.first slot. */
#define KVT_ERR_FIRST_NONE 0xFFFFFFFFFFFFFFFFull

/*
 * The device-side error word. Kernels never dereference an index they have not
 * range-checked; a bad index makes them skip (or zero-fill) the entry and
 * record it here with atomics. The host reads and resets the word at its next
 * sync point. Contents are deterministic whatever the thread schedule:
 *   flags    OR of (1u << kind) over every bad entry
 *   count    number of bad entries (one per refused copy)
 *   first[k] min over bad entries of kind k of (position << 32) | biased value,
 *            biased value = (uint32_t)clamp_to_int32(value) ^ 0x80000000;
 *            KVT_ERR_FIRST_NONE when kind k never occurred.
 */
typedef struct kvt_error_word {
    uint32_t flags;
    uint32_t count;
    uint64_t first[KVT_ERR_KINDS];
} kvt_error_word;

/*
 * Top-k sparse gather, one layer, a whole batch (kernel kvt_gather).
 *
 * For batch row b and column j < k, output row r = b * k + j of `out`
 * (entry_bytes each, rows contiguous) receives
 *   region(slot_bases[req_slots[b]]) + layer_offset + topk[b][j] * entry_bytes
 * A row whose req_slots[b] is -1 is padding: all k outputs are zero-filled and
 * nothing is reported. Otherwise an entry is zero-filled, and reported, when
 * the slot is out of range or unbound (base 0), when seq_lens[b] is outside
 * [0, tokens_per_region], or when topk[b][j] is outside [-1, seq_lens[b]);
 * topk[b][j] == -1 is padding: zero-filled, not reported.
 */
typedef struct kvt_gather_params {
    kvt_addr slot_bases;      /* const uint64_t[num_slots]: region base per slot, 0 = unbound */
    kvt_addr req_slots;       /* const int32_t[batch]: slot of each batch row, -1 = padding row */
    kvt_addr seq_lens;        /* const int32_t[batch]: tokens stored for each row's request */
    kvt_addr topk;            /* const int32_t[batch][topk_stride]: token indices, -1 = padding */
    kvt_addr out;             /* uint8_t[batch][k][entry_bytes], 8-byte aligned */
    kvt_addr error;           /* kvt_error_word* */
    uint64_t layer_offset;    /* byte offset of the layer in a region: layer * tokens_per_region * entry_bytes */
    uint32_t entry_bytes;     /* bytes per KV entry, a multiple of 8 */
    uint32_t tokens_per_region; /* region capacity in tokens */
    uint32_t num_slots;       /* entries in slot_bases */
    uint32_t batch;           /* rows of req_slots, seq_lens and topk; < 65536 */
    uint32_t k;               /* top-k columns read per row; <= 65536 */
    uint32_t topk_stride;     /* elements between consecutive rows of topk, >= k */
    uint32_t flags;           /* KVT_COPY_*: the copy method, i.e. which kernel the launcher runs */
} kvt_gather_params;

/* kvt_gather_params.flags and kvt_writeback_params.flags: the copy method
 * (the bytes moved are the same): kvt_gather, kvt_gather_line_aligned,
 * kvt_gather_merged_runs or kvt_gather_bulk_runs; kvt_writeback,
 * kvt_writeback_line_aligned, kvt_writeback_merged_runs or
 * kvt_writeback_bulk_runs. At most one of the flags is set. */
#define KVT_COPY_LINE_ALIGNED 1u /* passes aligned to 128-byte lines of the host address (warp_copy_entry_lines) */
#define KVT_COPY_MERGED_RUNS 2u  /* a warp takes KVT_COPY_RUN_ROWS consecutive rows and moves each run of them
                                    that is contiguous at both ends as one line-aligned block */
#define KVT_COPY_BULK_RUNS 4u    /* the groups and runs of KVT_COPY_MERGED_RUNS moved by the bulk-copy
                                    engine (cp.async.bulk, sm_90+) through the warp's shared memory */
/* Rows a warp of the merged-runs kernels takes (consecutive top-k columns of
 * one batch row; consecutive items of one layer): the launcher sizes the grid
 * by groups of this many rows. */
#define KVT_COPY_RUN_ROWS 8u

/*
 * Layer-first writeback (kernel kvt_writeback): for each layer l in
 * [first_layer, first_layer + num_layers) and each item i, copies source row
 * item_src_rows[i] of that layer's device buffer to
 *   region(slot_bases[item_slots[i]]) + l * layer_bytes + item_tokens[i] * entry_bytes
 * The source buffer of layer l is src_layer_bases[l - first_layer] when
 * src_layer_bases is non-zero, else src_base (then num_layers must be 1).
 * item_slots[i] == -1 skips the item silently (padding). An item is skipped and
 * reported when its slot is out of range or unbound, its token is outside
 * [0, tokens_per_region), or its source row is outside [0, src_rows).
 * Two items with the same destination in one launch race: either value lands.
 */
typedef struct kvt_writeback_params {
    kvt_addr slot_bases;      /* const uint64_t[num_slots]: region base per slot, 0 = unbound */
    kvt_addr item_slots;      /* const int32_t[num_items]: destination slot, -1 = skip */
    kvt_addr item_tokens;     /* const int32_t[num_items]: destination token position */
    kvt_addr item_src_rows;   /* const int64_t[num_items]: source row in the layer's buffer */
    kvt_addr src_base;        /* source buffer when src_layer_bases == 0 */
    kvt_addr src_layer_bases; /* const uint64_t[num_layers]: per-layer source buffers, or 0 */
    kvt_addr error;           /* kvt_error_word* */
    uint64_t src_rows;        /* rows in each source buffer */
    uint64_t layer_bytes;     /* tokens_per_region * entry_bytes */
    uint32_t entry_bytes;     /* bytes per KV entry, a multiple of 8 */
    uint32_t tokens_per_region;
    uint32_t num_slots;
    uint32_t num_items;
    uint32_t first_layer;
    uint32_t num_layers;
    uint32_t flags;           /* KVT_COPY_*: the copy method, i.e. which kernel the launcher runs */
} kvt_writeback_params;

/* kvt_swap_in_params.flags */
#define KVT_SWAP_SEQ_LENS_I64 1u    /* seq_lens holds int64_t (else int32_t) */
#define KVT_SWAP_REQ_INDICES_I64 2u /* req_pool_indices holds int64_t (else int32_t) */
#define KVT_SWAP_COPY_IN_PLAN 4u    /* kvt_swap_in_plan copies its own misses (one block per request) */
#define KVT_SWAP_SKIP_IO 8u         /* no KV bytes move (a timing probe): plan, outputs and state only */
#define KVT_SWAP_QUERY_BLOCKS 16u   /* top_k_tokens holds block ids of block_tokens tokens each (MiniMax-M3) */
#define KVT_SWAP_REPLAY 32u         /* kvt_swap_in_copy replays a caller's plan alone (no plan kernel ran) */
#define KVT_SWAP_SKIP_INLINE 64u    /* kvt_swap_in_copy skips rows of at most KVT_SWAP_FEW_MISS_INLINE misses
                                       (kvt_swap_in_few_miss_plan or kvt_swap_in_compact_plan copied them) */
#define KVT_SWAP_COMPACT_PLAN 128u  /* the launcher's choice of kvt_swap_in_compact_plan as the planner (no kernel
                                       reads it: the parameters alone say what to launch) */
#define KVT_SWAP_FEW_MISS_512 256u  /* the launcher's choice of kvt_swap_in_few_miss_512_plan as the planner (with
                                       KVT_SWAP_SKIP_INLINE; no kernel reads it) */
#define KVT_SWAP_COPY_LINES 512u    /* the launcher's choice of the copy method KVT_COPY_LINE_ALIGNED: of
                                       kvt_swap_in_copy_line_aligned as the copy kernel and, with
                                       KVT_SWAP_COPY_IN_PLAN, of the few-miss planners' _lines_plan builds
                                       (no kernel reads it) */
#define KVT_SWAP_COPY_BULK 1024u    /* the launcher's choice of the copy method KVT_COPY_BULK_RUNS: of
                                       kvt_swap_in_copy_bulk as the copy kernel (set with
                                       KVT_SWAP_COPY_LINES, which the planners' own copies take; no kernel
                                       reads it) */
#define KVT_SWAP_FIXED_SHAPE 2048u  /* the launcher's choice of the 1024-thread few-miss planner's
                                       fixed-shape builds, kvt_swap_in_few_miss_k2048_h{4096,8192}_plan,
                                       for rows of 2048 entries over 4096 or 8192 slots (no kernel
                                       reads it) */
#define KVT_SWAP_CLUSTER_COPY 4096u /* with KVT_SWAP_SKIP_INLINE: the launcher's choice of
                                       kvt_swap_in_few_miss_cluster_plan in clusters of
                                       KVT_SWAP_CLUSTER blocks a row (sm_90 and later), no copy kernel
                                       (no kernel reads it) */
#define KVT_SWAP_CLUSTER_PLAN 8192u /* with KVT_SWAP_SKIP_INLINE: the launcher's choice of
                                       kvt_swap_in_split_plan in clusters of KVT_SWAP_CLUSTER blocks a row
                                       (sm_90 and later), each block planning a share of the row and
                                       copying its misses, no copy kernel (no kernel reads it) */
#define KVT_SWAP_CLUSTER 8u          /* blocks a row of kvt_swap_in_few_miss_cluster_plan and
                                       kvt_swap_in_split_plan: the portable
                                       maximum cluster size (an H100 also takes 16 as a non-portable
                                       one) */

/* Largest number of resolved top-k entries per row (top_k * block_tokens) and
 * largest hot buffer a swap-in accepts. */
#define KVT_SWAP_MAX_TOP_K 4096
#define KVT_SWAP_MAX_HOT 16384
/* Threads per kvt_swap_in_plan block. */
#define KVT_SWAP_PLAN_THREADS 512
/* Threads per kvt_swap_in_few_miss_plan block, and the most misses such a
 * block copies itself (one per warp: one pass of its warps). */
#define KVT_SWAP_FEW_MISS_THREADS 1024
#define KVT_SWAP_FEW_MISS_INLINE 32
/* Threads per kvt_swap_in_few_miss_512_plan block (two blocks an SM where its
 * shared memory allows), and the most entries a row of it resolves. */
#define KVT_SWAP_FEW_MISS_512_THREADS 512
#define KVT_SWAP_FEW_MISS_512_MAX_ENTRIES 2048
/* Threads per kvt_swap_in_compact_plan block (two blocks an SM where its
 * shared memory allows), and the most entries a row of it resolves. */
#define KVT_SWAP_COMPACT_THREADS 1024
#define KVT_SWAP_COMPACT_MAX_ENTRIES 2048
/* Largest scale piece of an item layout: one 8-byte word per lane of a warp. */
#define KVT_ITEM_MAX_SCALE_BYTES 256

/*
 * How row r of a KV buffer is addressed (src/layout.rs, ItemLayout). Rows are
 * grouped in pages of (1 << page_shift) rows, page_bytes apart. Within a page
 * the rows' value pieces come first, value_bytes each, then their scale
 * pieces, scale_bytes each (none when scale_bytes is 0):
 *   value of r  = base + (r >> page_shift) * page_bytes + (r & mask) * value_bytes
 *   scale of r  = base + (r >> page_shift) * page_bytes + (value_bytes << page_shift)
 *                      + (r & mask) * scale_bytes
 * A linear buffer of item_bytes rows is page_shift 0, page_bytes = value_bytes
 * = item_bytes, scale_bytes 0. DeepSeek-V4's page-padded C4 cache is
 * page_shift 6, value_bytes 576, scale_bytes 8, page_bytes 37440.
 */
typedef struct kvt_item_layout {
    uint64_t page_bytes;   /* a multiple of 8, >= (value_bytes + scale_bytes) << page_shift */
    uint32_t page_shift;   /* log2 of rows per page, <= 16 */
    uint32_t value_bytes;  /* a positive multiple of 8 */
    uint32_t scale_bytes;  /* a multiple of 8, <= KVT_ITEM_MAX_SCALE_BYTES */
    uint32_t _reserved;
} kvt_item_layout;

/*
 * LRU device-buffer swap-in with page-table update, one layer, a whole batch
 * (SGLang HiSparse semantics; the contract is in src/swap_in/mod.rs).
 *
 * Per request state, row `req` of each array (req = req_pool_indices[row]):
 *   device_buffer_tokens[req][0..hot)   token cached in each LRU slot, -1 empty
 *   device_buffer_locs[req][0..=hot]    device row of each slot (slot hot = newest token)
 *   lru_slots[req][0..hot)              permutation of the LRU slots, index 0 = LRU
 *   host_cache_locs[req][0..max_tokens) host row of each token position
 *
 * The query of batch row b is top_k columns of top_k_tokens: token positions,
 * or with KVT_SWAP_QUERY_BLOCKS block ids, column j standing for the tokens
 * j * block_tokens .. of block top_k_tokens[b][j]. Either way a row resolves
 * `entries` = top_k * block_tokens entries, and top_k_device_locs gets one
 * column per entry.
 *
 * The KV rows are one or two planes (MLA: the latent; MHA: K and V, which
 * move together), host_cache[p] -> device_buffer[p], addressed with `items`.
 *
 * Two kernels share these parameters. kvt_swap_in_plan (one block per batch
 * row) finds hits, assigns misses to evicted slots, writes top_k_device_locs,
 * device_buffer_tokens and lru_slots, and records each row's misses in the
 * miss plan (plan_src/plan_dst rows of plan_stride elements, plan_count; the
 * same format as SGLang's miss_src/miss_dst/miss_count, so the plan is either
 * kvtier's scratch or the caller's). Then kvt_swap_in_copy moves every planned
 * miss of rows below num_real_reqs, a warp per miss over one wide grid: host
 * row plan_src -> device row plan_dst of every plane. With KVT_SWAP_COPY_IN_PLAN
 * the plan kernel copies its own misses instead (the one-block-per-request
 * design, kept as a baseline); with KVT_SWAP_SKIP_IO nothing is copied.
 * kvt_swap_in_few_miss_plan is a second planner for the same contract (one
 * block of KVT_SWAP_FEW_MISS_THREADS per row, warp votes instead of block
 * scans): a row of at most KVT_SWAP_FEW_MISS_INLINE misses is copied by its
 * own block, and the copy kernel that follows, with KVT_SWAP_SKIP_INLINE,
 * moves only the other rows' misses (kvt_swap_in_few_miss_512_plan, with
 * KVT_SWAP_FEW_MISS_512, is the same planner in blocks of
 * KVT_SWAP_FEW_MISS_512_THREADS). kvt_swap_in_compact_plan is a third
 * (KVT_SWAP_COMPACT_PLAN; the same contract and block size, state small enough
 * for two blocks an SM): it copies a row's misses itself when they are at
 * most KVT_SWAP_FEW_MISS_INLINE (the copy kernel follows with
 * KVT_SWAP_SKIP_INLINE), or every miss with KVT_SWAP_COPY_IN_PLAN (one launch,
 * no copy kernel). With
 * KVT_SWAP_REPLAY kvt_swap_in_copy runs alone on a caller's plan (SGLang's
 * copy_cache_planned_mla): only the plan, num_real_reqs, the KV planes and
 * the error word are read.
 */
typedef struct kvt_swap_in_params {
    kvt_addr top_k_tokens;         /* const int32_t[batch][top_k_stride] */
    kvt_addr device_buffer_tokens; /* int32_t[num_requests][tokens_stride] */
    kvt_addr device_buffer_locs;   /* const int32_t[num_requests][locs_stride] */
    kvt_addr lru_slots;            /* int16_t[num_requests][lru_stride] */
    kvt_addr host_cache_locs;      /* const int64_t[num_requests][host_stride] */
    kvt_addr top_k_device_locs;    /* int32_t[batch][out_stride] */
    kvt_addr req_pool_indices;     /* const int32_t or int64_t [batch] */
    kvt_addr seq_lens;             /* const int32_t or int64_t [batch] */
    kvt_addr num_real_reqs;        /* const int32_t[1] on the device, or 0 for "batch" */
    kvt_addr host_cache[2];        /* host_rows rows per plane (host-mapped); plane 1 may be 0 */
    kvt_addr device_buffer[2];     /* device_rows rows per plane; 0 where host_cache is 0 */
    kvt_addr plan_src;             /* int64_t[batch][plan_stride]: host row per miss */
    kvt_addr plan_dst;             /* int32_t[batch][plan_stride]: device row per miss */
    kvt_addr plan_count;           /* int32_t[batch]: misses per row */
    kvt_addr error;                /* kvt_error_word* */
    kvt_addr counters;             /* kvt_swap_counters* of the call's layer, or 0 (nothing counted) */
    kvt_item_layout items;         /* the row layout of both ends of every plane */
    uint64_t host_rows;
    uint64_t device_rows;
    uint64_t top_k_stride;         /* elements between rows of top_k_tokens */
    uint64_t tokens_stride;        /* elements between rows of device_buffer_tokens */
    uint64_t locs_stride;          /* elements between rows of device_buffer_locs */
    uint64_t lru_stride;           /* elements between rows of lru_slots */
    uint64_t host_stride;          /* elements between rows of host_cache_locs */
    uint64_t out_stride;           /* elements between rows of top_k_device_locs */
    uint64_t plan_stride;          /* elements between rows of plan_src/plan_dst */
    uint32_t batch;                /* rows of top_k_tokens (of the plan, for a replay); < 65536 */
    uint32_t top_k;                /* query columns per row */
    uint32_t block_tokens;         /* tokens per query column: 1 unless KVT_SWAP_QUERY_BLOCKS */
    uint32_t entries;              /* top_k * block_tokens, <= hot and <= KVT_SWAP_MAX_TOP_K */
    uint32_t hot;                  /* LRU slots per request, <= KVT_SWAP_MAX_HOT: the hot_buffer_size of SGLang, the shim, the C ABI and SwapInArgs, named short where every kernel reads it */
    uint32_t num_requests;         /* rows of the per-request state arrays */
    uint32_t max_tokens;           /* valid columns of host_cache_locs */
    uint32_t plan_capacity;        /* misses a plan row holds (<= plan_stride); counts above it are refused */
    uint32_t flags;                /* KVT_SWAP_* */
    uint32_t miss_bytes;           /* bytes one miss moves, every plane (what `counters` adds per miss) */
} kvt_swap_in_params;

/*
 * What the swap-ins of one layer did, accumulated on the device with atomics
 * (no host sync) when kvt_swap_in_params.counters is set; a replay
 * (KVT_SWAP_REPLAY) counts nothing. Per call: `calls` += 1 and `rows` += the
 * rows below num_real_reqs (block 0). Per long row the planner resolves:
 * `hits` += the LRU slots whose token the query names, `misses` += the misses
 * loaded into evicted slots (the row's plan count), `bytes` += misses *
 * miss_bytes unless KVT_SWAP_SKIP_IO. Short rows (seq_len <= hot) add
 * neither: their tokens always live in the buffer. `bad` += one per entry the
 * call reports in the error word (its `count`).
 */
typedef struct kvt_swap_counters {
    uint64_t calls;
    uint64_t rows;
    uint64_t hits;
    uint64_t misses;
    uint64_t bytes;
    uint64_t bad;
    uint64_t _reserved[2];
} kvt_swap_counters;

/* Threads per kvt_spec_swap_in block, and its dynamic shared memory. */
#define KVT_SPEC_THREADS 512
#define KVT_SPEC_SMEM_BYTES 48

/*
 * The speculative swap-in (MTP/EAGLE verify) of one layer, a whole batch, on
 * SGLang's HiSparseSpecState (kernel kvt_spec_swap_in, one block per batch
 * row; the contract is in src/swap_in/spec/mod.rs). A row holds steps * top_k
 * occurrences, step-major; step s of row b sees seq_lens[b * steps + s]
 * tokens. Per request rid:
 *   device_buffer_tokens[rid][0..hot + page)  token of each hot slot, then of each extra-page slot
 *   device_buffer_locs[rid][0..hot + page)    device row of each of those slots
 *   cache_index + rid * index_stride          hash bank 0 (hash_size int64: slot << 32 | token),
 *                                             bank 1 at + bank_stride
 *   cache_policy row 0, column rid            the packed CLOCK (epoch, cursor)
 *   cache_policy row 1 + rid                  the reference epoch of each hot slot
 *   scratch_locs[rid][0..scratch_capacity)    scratch device rows
 *   scratch_state row 0                       counters: [rid] last unique misses, [R + rid] and
 *                                             [2R + rid] zero between calls, [3R + rid] scratch
 *                                             epoch | hash-degraded flag (R = num_requests)
 *   scratch_state row 1 + rid                 the call's miss table: steps * top_k int64 cells
 *                                             epoch << 32 | token, as many epoch << 32 | value,
 *                                             then one int32 per miss (its cell, flags)
 * Rows are policy_stride / state_stride elements apart. The KV rows are one
 * plane, host_cache -> device_buffer, addressed with `items`. The copies the
 * call makes are recorded in plan_src/plan_dst/plan_count when plan_count is
 * not 0 (SGLang's miss-plan format).
 */
typedef struct kvt_spec_swap_in_params {
    kvt_addr top_k_tokens;         /* const int32_t[batch][top_k_stride] */
    kvt_addr device_buffer_tokens; /* int32_t[num_requests][tokens_stride] */
    kvt_addr device_buffer_locs;   /* int32_t[num_requests][locs_stride] */
    kvt_addr host_cache_locs;      /* const int64_t[num_requests][host_stride] */
    kvt_addr top_k_device_locs;    /* int32_t[batch][out_stride] */
    kvt_addr req_pool_indices;     /* const int32_t or int64_t [batch] */
    kvt_addr seq_lens;             /* const int32_t or int64_t [batch * steps] */
    kvt_addr num_real_reqs;        /* const int32_t[1] */
    kvt_addr cache_index;          /* int64_t, see above */
    kvt_addr cache_policy;         /* int32_t, see above */
    kvt_addr scratch_locs;         /* int32_t[num_requests][scratch_stride] */
    kvt_addr scratch_state;        /* int32_t, 8-byte aligned rows, see above */
    kvt_addr host_cache;           /* host_rows rows (host-mapped) */
    kvt_addr device_buffer;        /* device_rows rows */
    kvt_addr plan_src;             /* int64_t[batch][plan_stride], or 0 */
    kvt_addr plan_dst;             /* int32_t[batch][plan_stride], or 0 */
    kvt_addr plan_count;           /* int32_t[batch], or 0: no plan */
    kvt_addr error;                /* kvt_error_word* */
    kvt_item_layout items;
    uint64_t host_rows;
    uint64_t device_rows;
    uint64_t top_k_stride;
    uint64_t tokens_stride;
    uint64_t locs_stride;
    uint64_t host_stride;
    uint64_t out_stride;
    uint64_t plan_stride;
    uint64_t index_stride;
    uint64_t bank_stride;
    uint64_t hash_size;            /* a power of two */
    uint64_t policy_stride;
    uint64_t scratch_stride;
    uint64_t scratch_capacity;
    uint64_t state_stride;         /* even */
    uint32_t batch;
    uint32_t steps;                /* 2..4 */
    uint32_t top_k;                /* steps * top_k <= 8192 */
    uint32_t hot;                  /* 2..32768 */
    uint32_t page;                 /* extra-page slots after the hot ones */
    uint32_t num_requests;
    uint32_t max_tokens;           /* valid columns of host_cache_locs */
    uint32_t flags;                /* KVT_SWAP_SEQ_LENS_I64, KVT_SWAP_REQ_INDICES_I64 */
} kvt_spec_swap_in_params;

/*
 * Taking the error word (kernel kvt_error_take, one block of 32 threads,
 * lane 0 working): moves every field of *word into *out and leaves *word
 * clear, field by field with atomic exchanges, so a report that kernels on
 * other streams make meanwhile is never lost: each of its three updates
 * (flags, count, first[kind]) lands either in *out or in *word, for the next
 * take. Reads and writes nothing else.
 */
typedef struct kvt_error_take_params {
    kvt_addr word;                 /* kvt_error_word*: taken and cleared */
    kvt_addr out;                  /* kvt_error_word*: receives what was taken */
} kvt_error_take_params;

/*
 * Engram row gather (kernel kvt_engram_gather): DeepSeek-V4.1's Engram
 * lookup, and any table of fp8 e4m3 rows with e8m0 block scales. The table
 * holds global rows [row_lo, row_lo + rows): row r's dim e4m3 bytes at
 * weights + (r - row_lo) * dim, its dim / block e8m0 bytes at
 * scales + (r - row_lo) * (dim / block). For each i in [0, n), id = ids[i]
 * (int32, or int64 with ids_int64) and row_end = min(row_hi, row_lo + rows):
 *   row_lo <= id < row_end:  out[i][j] = bf16_rne(f32(e4m3(w[j])) * 2^(e - 127))
 *                            for j in [0, dim), e = the scale byte of j's block;
 *                            e == 0 is 2^-127 (no flush), e == 255 +inf;
 *                            e4m3 0x7F/0xFF (NaN) and NaN products give the
 *                            canonical bf16 NaN 0x7FFF; -0 stays -0;
 *   otherwise:               out[i][j] = +0 (0x0000), nothing read; an id in
 *                            [row_end, row_hi) (inside the range asked for but
 *                            past the table) is also reported
 *                            (KVT_ERR_GATHER_INDEX, position i, or
 *                            out_rows[i] with out_rows, value id).
 * With out_rows, id i's row is written to out[out_rows[i]] instead of
 * out[i]: sorted reads (SGLang's sort_ids) pass the ids sorted and, as
 * out_rows, the permutation that sorted them (a device sort's indices), so
 * the table is read in address order and every row still lands in its
 * place, with no host synchronisation. out_rows must be a permutation of
 * [0, n); an entry outside [0, n) writes nothing for its id and is reported
 * (KVT_ERR_GATHER_SLOT, position i, value out_rows[i]); rows no entry
 * names are left as they were.
 */
typedef struct kvt_engram_gather_params {
    kvt_addr weights;              /* const uint8_t[rows][dim], e4m3; 8-byte aligned */
    kvt_addr scales;               /* const uint8_t[rows][dim / block], e8m0 */
    kvt_addr ids;                  /* const int32_t or int64_t [n] */
    kvt_addr out;                  /* uint16_t[n][dim], bf16 bits; 16-byte aligned */
    kvt_addr out_rows;             /* const int32_t[n]: id i's row of out (0: row i) */
    kvt_addr error;                /* kvt_error_word* */
    int64_t row_lo;                /* first global row the table holds */
    int64_t row_hi;                /* end of the global rows asked for (SGLang's default 2^62) */
    uint64_t rows;                 /* rows the table holds */
    uint32_t n;                    /* ids; < 2^31 */
    uint32_t dim;                  /* a power of two, >= 8, <= 4096 */
    uint32_t block;                /* values per scale byte, divides dim */
    uint32_t ids_int64;            /* ids are int64 (else int32) */
} kvt_engram_gather_params;

#endif /* KVTIER_ABI_H */
