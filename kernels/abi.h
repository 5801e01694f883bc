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

#include <stdint.h>

/* Bumped whenever a struct below changes shape or meaning. */
#define KVT_ABI_VERSION 1

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
} kvt_gather_params;

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
} kvt_writeback_params;

#endif /* KVTIER_ABI_H */
