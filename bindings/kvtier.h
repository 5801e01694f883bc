/*
 * kvtier.h — the C ABI of libkvtier (src/ffi/ implements it).
 *
 * Conventions
 * - Every function that can fail returns a kvt_status; KVT_OK is 0. On any
 *   other status, kvt_last_error() returns a message that names the argument
 *   or resource at fault, for the calling thread.
 * - Objects are opaque handles created by a *_create / *_open function and
 *   released by the matching *_destroy / *_close function (NULL is accepted
 *   there and ignored). A handle may be used from any thread; calls on one
 *   handle are serialised internally.
 * - Every pointer argument is checked for NULL, every size against what the
 *   call needs. kvtier cannot check that a pointer really addresses as many
 *   elements as its kvt_buf says: that is the caller's promise.
 * - Executors: KVT_EXECUTOR_CPU runs on the host over host memory (the
 *   reference; it completes before the call returns). An ordinal >= 0 is the
 *   CUDA executor on that GPU's primary context (the one PyTorch uses): work
 *   is enqueued on the caller's stream (a raw CUstream; NULL is the legacy
 *   default stream) and every buffer must be device-accessible memory (device
 *   memory, or host memory registered and mapped for the device).
 * - Bad indices inside the data (not the shapes) are refused entry by entry
 *   and reported: with the CPU executor by the call itself
 *   (KVT_BAD_INDICES), with the CUDA executor at the next *_check call.
 * - No Rust panic crosses this boundary: one is reported as
 *   KVT_INTERNAL_ERROR.
 */
#ifndef KVTIER_H
#define KVTIER_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* Bumped whenever a struct or a signature below changes. */
#define KVT_ABI_VERSION 8

typedef int32_t kvt_status;
#define KVT_OK 0
#define KVT_INVALID_ARGUMENT 1  /* an argument was refused before anything ran */
#define KVT_KERNELS_NOT_BUILT 2 /* the library was built without nvcc */
#define KVT_NO_DRIVER 3         /* no usable CUDA driver or GPU */
#define KVT_DRIVER_ERROR 4      /* a CUDA driver call failed */
#define KVT_BAD_INDICES 5       /* entries with bad indices were refused (see the message) */
#define KVT_POOL_ERROR 6        /* the pool refused (full, wrong layout, foreign region, ...) */
#define KVT_IO_ERROR 7          /* an I/O call on a pool device failed */
#define KVT_INTERNAL_ERROR 8    /* a bug in kvtier, caught at the boundary */

#define KVT_EXECUTOR_CPU (-1)

/* A raw CUDA stream (the driver's CUstream). */
typedef struct CUstream_st *kvt_cuda_stream;

/* The ABI version the library was built with (compare with KVT_ABI_VERSION). */
uint32_t kvt_abi_version(void);
/* The library's version, e.g. "0.1.0" (a static string). */
const char *kvt_version(void);
/* The message of the last failed call on this thread ("" if none); valid
 * until the next failed call on this thread. */
const char *kvt_last_error(void);
/* 1 when the CUDA kernels were compiled into the library, 0 otherwise. */
int32_t kvt_kernels_built(void);

/* A buffer: its address and its length in elements of the type the field
 * names (bytes for untyped data). */
typedef struct kvt_buf {
    void *ptr;
    uint64_t len;
} kvt_buf;

/* ---- pool ---------------------------------------------------------------- */

typedef struct kvt_pool kvt_pool;
typedef struct kvt_region kvt_region;

/* Region geometry: tokens_per_region tokens of entry_bytes (a multiple of 8)
 * for each of `layers` layers, layer-first: [layer][token][entry_bytes]. */
typedef struct kvt_layout {
    uint32_t entry_bytes;
    uint32_t layers;
    uint32_t tokens_per_region;
} kvt_layout;

/* How a process creates or attaches to a pool; zero fields take defaults. */
typedef struct kvt_pool_options {
    uint32_t rank;           /* this process's GPU rank (placement: rank r -> device r mod n) */
    uint32_t ranks;          /* ranks in all; 0 = 1 */
    uint32_t clients;        /* client slots of a new pool; 0 = the default */
    uint32_t register_flags; /* cuMemHostRegister flags; 0 = portable | device-mapped */
} kvt_pool_options;

typedef struct kvt_pool_info {
    kvt_layout layout;
    uint32_t num_devices;
    uint32_t num_regions;
    uint32_t free_regions;
    uint32_t _reserved;
    uint64_t region_stride; /* bytes between region bases */
    uint8_t uuid[16];
} kvt_pool_info;

typedef struct kvt_region_info {
    uint32_t index;     /* the region's index in its pool */
    uint32_t device;    /* the device it lives on */
    uint64_t host_addr; /* its first byte in this process */
    uint64_t bytes;     /* layers * tokens_per_region * entry_bytes */
    uint64_t epoch;     /* opaque: (index, epoch) names this allocation of the
                         * region in its pool (no later one has it), as
                         * kvt_region_join takes it with the pool's uuid */
    uint32_t joined;    /* 1: this handle joined a region another process owns */
    uint32_t joined_elsewhere; /* 1: another process (or pool handle) has joined
                                * it and holds it now */
} kvt_region_info;

/* What a device offers a pool, before it is mapped. */
typedef struct kvt_device_capacity {
    uint64_t bytes;     /* the size the device string gives, else the file's
                         * length, the devdax device's size, or for "numa:NODE[+NODE...]"
                         * without a size the node's free memory */
    uint32_t host_dram; /* 1: the bytes are the host's general DRAM (anon, or a
                         * file on tmpfs/ramfs); 0: a devdax device, a NUMA
                         * node's memory, a file on another filesystem */
    uint32_t pinnable;  /* 1: the pages can be pinned for as long as a GPU or
                         * RDMA registration holds them (cudaHostRegister,
                         * ibv_reg_mr); 0: a file on a disk filesystem or
                         * FS-DAX, which Linux refuses to pin long-term */
    uint64_t movable_bytes; /* "numa:" devices: bytes of the nodes' online memory
                             * in ZONE_MOVABLE, whose pages a GPU or RDMA
                             * registration migrates off the node (0 otherwise) */
} kvt_device_capacity;

/* Devices are strings in the CLI's syntax: "anon:SIZE", "file:PATH[:SIZE]",
 * "numa:NODE[+NODE...]:SIZE" (several nodes: pages interleaved over them),
 * "dax:PATH[:SIZE]" (e.g. "numa:2:64GiB", "numa:2+3:128GiB", "dax:/dev/dax0.0").
 * `options` may be NULL (defaults). */
kvt_status kvt_pool_create(const kvt_layout *layout, const char *const *devices, size_t num_devices,
                           const kvt_pool_options *options, kvt_pool **out);
kvt_status kvt_pool_open(const char *const *devices, size_t num_devices, const kvt_pool_options *options,
                         kvt_pool **out);
/* Opens the pool on `devices`, or creates it with `layout` if the first device
 * holds none (the first of several ranks starting together creates it). */
kvt_status kvt_pool_open_or_create(const kvt_layout *layout, const char *const *devices, size_t num_devices,
                                   const kvt_pool_options *options, kvt_pool **out);
/* Bytes a single-device pool needs to hold `regions` regions of `layout`. */
kvt_status kvt_pool_device_bytes_for(const kvt_layout *layout, uint32_t regions, uint64_t *out);
kvt_status kvt_pool_info_get(const kvt_pool *pool, kvt_pool_info *out);
/* Publishes this process's stats for readers of the pool (`kvtier pool status
 * --json` shows them with the client): `json`, a NUL-terminated JSON object of
 * at most 1 MiB, replaces what the process published before. Written to
 * $KVTIER_RUN_DIR (default /dev/shm/kvtier)/<pool uuid>/<pid>.json. */
kvt_status kvt_pool_publish_stats(const kvt_pool *pool, const char *json);
/* ---- tables: large read-only arrays in shared memory, loaded once per host
 * (a file on tmpfs or hugetlbfs, or a devdax device; see the Rust module
 * `kvtier::table`). A loader holds the file's exclusive flock until it is
 * closed; readers a shared one. */
typedef struct kvt_table_loader kvt_table_loader;
typedef struct kvt_table kvt_table;
/* Opens or makes the table `key` of `data_bytes` bytes at `path` for loading,
 * waiting at most `wait_ms` for another process's lock. *out is NULL when the
 * table is loaded already (attach to it instead), else a loader holding the
 * exclusive lock; a loader killed before publishing leaves a table the next
 * loader resumes. */
kvt_status kvt_table_load(const char *path, const char *key, uint64_t data_bytes, uint32_t wait_ms,
                          kvt_table_loader **out);
/* The first byte range [*start, *end) at or after `from` not written yet
 * (*start == *end: none). */
kvt_status kvt_table_loader_next_missing(const kvt_table_loader *loader, uint64_t from, uint64_t *start,
                                         uint64_t *end);
/* Copies `len` bytes to the table's data at `offset`; a chunk counts as
 * written once this loader's writes cover it (in any order and pieces). */
kvt_status kvt_table_loader_write(const kvt_table_loader *loader, uint64_t offset, const void *bytes,
                                  uint64_t len);
/* Publishes the table READY (refused, and the load kept, while bytes are
 * missing); close the loader after it to let readers in. */
kvt_status kvt_table_loader_publish(const kvt_table_loader *loader);
/* Releases the loader and its lock (an unpublished table stays resumable). */
void kvt_table_loader_close(kvt_table_loader *loader);
/* Attaches to the READY table `key` at `path` (a shared lock, waiting at most
 * `wait_ms` for its loader); a table not loaded is KVT_POOL_ERROR saying how
 * far its load got. */
kvt_status kvt_table_attach(const char *path, const char *key, uint32_t wait_ms, kvt_table **out);
/* The table's bytes in this process: valid until kvt_table_close. */
kvt_status kvt_table_data(const kvt_table *table, const void **data, uint64_t *len);
void kvt_table_close(kvt_table *table);
/* The file of `key` in the table directory `dir`, NUL-terminated into `out`
 * (`capacity` bytes); *needed is set to the bytes it takes either way. */
kvt_status kvt_table_store_path(const char *dir, const char *key, char *out, size_t capacity,
                                size_t *needed);
/* Removes the table file at `path`: refused while a reader or loader holds it. */
kvt_status kvt_table_destroy(const char *path);

/* ---- Prefix store --------------------------------------------------------
 * Pages of `page_bytes` under string keys (SGLang's HiCache page hashes) in
 * one file on tmpfs that every process of the host opens: a page
 * one process set is found by every other, and after a restart. The key index
 * is in the file; a killed writer leaves nothing visible; a page being copied
 * out is never evicted; the least recently used page makes room (CLOCK).
 * One host only: hosts sharing a CXL device have no common lock. */
typedef struct kvt_prefix_store kvt_prefix_store;
#define KVT_PREFIX_STORED 0  /* published under its key */
#define KVT_PREFIX_PRESENT 1 /* the key was there (or being written): nothing written */
#define KVT_PREFIX_FULL 2    /* every slot pinned or being written: nothing written */
/* Opens the store at `path`, making it with `slots` slots of `page_bytes` when
 * the file is missing or empty (waiting at most `wait_ms` for another maker).
 * An existing store must have been made for the same namespace `ns` (what its
 * pages hold: model, layout, dtype) and `page_bytes`; its slot count is its
 * own. A file that is not a prefix store is refused, never written. */
kvt_status kvt_prefix_open(const char *path, const char *ns, uint64_t page_bytes, uint64_t slots,
                           uint32_t wait_ms, kvt_prefix_store **out);
kvt_status kvt_prefix_info(const kvt_prefix_store *store, uint64_t *page_bytes, uint64_t *slots,
                           uint64_t *file_bytes);
/* Keys are passed packed: `n` keys of 1 to 200 bytes, each followed by a NUL,
 * back to back in the `keys_len` bytes at `keys`.
 * *hits = how many of the keys, from the first, the store holds. */
kvt_status kvt_prefix_hits(const kvt_prefix_store *store, const char *keys, size_t keys_len, size_t n,
                           size_t *hits);
/* Page i's bytes are laid end to end over parts i*parts_per_page ..
 * (i+1)*parts_per_page - 1 of `ptrs` (addresses) and `lens` (bytes), which must
 * add up to the store's page_bytes. get copies each found page out and sets
 * found[i] to 1 (0: not held; its parts then hold anything); set copies each
 * page in and sets outcome[i] to a KVT_PREFIX_* value. The addresses are the
 * caller's promise: memory of that length, not the store's. */
kvt_status kvt_prefix_get(const kvt_prefix_store *store, const char *keys, size_t keys_len, size_t n,
                          const uint64_t *ptrs, const uint64_t *lens, size_t parts_per_page, uint8_t *found);
kvt_status kvt_prefix_set(const kvt_prefix_store *store, const char *keys, size_t keys_len, size_t n,
                          const uint64_t *ptrs, const uint64_t *lens, size_t parts_per_page, uint8_t *outcome);
/* The first `n` of: pages set, hits, misses, evictions, slots a killed process
 * left and taken back, sets refused as full, pages held now (all processes). */
kvt_status kvt_prefix_counters(const kvt_prefix_store *store, uint64_t *out, size_t n);
/* Evicts every page no reader holds now; *evicted (may be NULL) says how many. */
kvt_status kvt_prefix_clear(const kvt_prefix_store *store, uint64_t *evicted);
void kvt_prefix_close(kvt_prefix_store *store);

/* ---- Engram gather ------------------------------------------------------
 * Rows of fp8 e4m3 values with e8m0 block scales (DeepSeek-V4.1's Engram
 * tables), dequantized to bf16 with SGLang 0.5.23's engram_gather arithmetic:
 * out[i][j] = bf16_rne(f32(e4m3(weights[id - row_lo][j])) * 2^(e - 127)), e the
 * row's scale byte of j's block (0 is 2^-127, 255 is +inf), for an id in
 * [row_lo, row_hi) that the table holds; a +0 row for every other id. An id
 * inside [row_lo, row_hi) but past the table's rows reads nothing, gives a +0
 * row and is reported (the CPU executor: KVT_BAD_INDICES at once, naming the
 * first; the CUDA executor: at kvt_engram_check). NaN values come out as the
 * bf16 NaN 0x7FFF. */
typedef struct kvt_engram kvt_engram;
typedef struct kvt_engram_args {
    kvt_buf weights;   /* uint8 [rows][dim]: e4m3 bytes of global rows row_lo..row_lo + rows; 8-byte aligned */
    kvt_buf scales;    /* uint8 [rows][dim / block]: e8m0 bytes */
    kvt_buf ids;       /* int32 or int64 [n] (ids_type): global row ids */
    kvt_buf out;       /* uint16 [n][dim]: bf16 bits, written; 16-byte aligned */
    kvt_buf out_rows;  /* optional int32 [n] (NULL: row i): id i's row of out. Sorted reads pass the ids
                        * sorted and the permutation that sorted them; an entry outside [0, n) writes
                        * nothing and is reported */
    int64_t row_lo;    /* the rows asked for: [row_lo, row_hi), 0 <= row_lo <= row_hi */
    int64_t row_hi;
    uint32_t dim;      /* values a row: a power of two in 8..=4096 */
    uint32_t block;    /* values a scale byte (DeepSeek-V4.1: 32); divides dim */
    uint32_t ids_type; /* KVT_INDEX_INT32 or KVT_INDEX_INT64 */
} kvt_engram_args;
/* A gatherer on `executor` (KVT_EXECUTOR_CPU or a GPU ordinal). */
kvt_status kvt_engram_create(int32_t executor, kvt_engram **out);
/* Gathers args->ids' rows into args->out: on the CPU executor now (host
 * memory); on a GPU enqueued on `stream` (device memory, or host memory the
 * GPU maps), no host synchronisation, capturable in a CUDA graph. */
kvt_status kvt_engram_gather(const kvt_engram *engram, const kvt_engram_args *args, kvt_cuda_stream stream);
/* The ids past the table that gathers since the last check recorded
 * (KVT_BAD_INDICES naming the first; waits for the GPU). */
kvt_status kvt_engram_check(const kvt_engram *engram);
void kvt_engram_destroy(kvt_engram *engram);

/* The NUMA node GPU `ordinal` is attached to (from its PCI device in sysfs),
 * -1 where the machine does not say; KVT_NO_DRIVER without a GPU. */
kvt_status kvt_cuda_numa_node(int32_t ordinal, int32_t *out);
/* The capacity of one device string (also "numa:NODE" without a size); maps nothing. */
kvt_status kvt_device_capacity_get(const char *device, kvt_device_capacity *out);
/* Detaches; the pool frees the regions this process still holds. Regions and
 * tiers made from it keep it alive until they are released too. */
void kvt_pool_close(kvt_pool *pool);

/* A free region, placed by the pool's per-rank round-robin, owned by this
 * process, tagged with `request` (informational). */
kvt_status kvt_region_alloc(kvt_pool *pool, uint64_t request, kvt_region **out);
/* Maps region `index`, allocation `epoch` (the owner's kvt_region_info.epoch)
 * of the pool `pool_uuid` (16 bytes: the owner's kvt_pool_info.uuid), which
 * another live process allocated and owns (one copy shared by a TP group, say);
 * a uuid other than `pool`'s is refused (region numbers and epochs repeat from
 * pool to pool, also in a pool made again on the same devices). Needs a pool
 * on file: or dax: devices, its processes on one host. While
 * joined, the region is neither reclaimed nor freed by its owner: kvt_region_free
 * of the owner's handle returns KVT_POOL_ERROR saying so and leaves it
 * allocated until the last joiner leaves, which frees it. kvt_region_free of a
 * joined handle leaves the region to its owner (or frees it, as that last
 * joiner). */
kvt_status kvt_region_join(kvt_pool *pool, const uint8_t *pool_uuid, uint32_t index, uint64_t epoch,
                           kvt_region **out);
kvt_status kvt_region_info_get(const kvt_region *region, kvt_region_info *out);
/* Marks the region READY: its bytes are written and other processes may read them. */
kvt_status kvt_region_publish(const kvt_region *region);
/* Returns the region to the pool and destroys the handle (even on failure). */
kvt_status kvt_region_free(kvt_region *region);

/* ---- swap-in (SGLang HiSparse) ------------------------------------------- */

#define KVT_INDEX_INT32 1
#define KVT_INDEX_INT64 2

#define KVT_SWAP_IN_PLAN_THEN_COPY 0        /* plan per request, one copy over every miss */
#define KVT_SWAP_IN_ONE_BLOCK_PER_REQUEST 1 /* SGLang's design, for comparison */
#define KVT_SWAP_IN_FEW_MISS 2              /* warp-vote planner; a request's few misses copied by its own block */
#define KVT_SWAP_IN_COMPACT 3               /* KVT_SWAP_IN_FEW_MISS with state for two blocks an SM */
#define KVT_SWAP_IN_COMPACT_ONE_LAUNCH 4    /* KVT_SWAP_IN_COMPACT copying every miss itself: one launch */
#define KVT_SWAP_IN_FEW_MISS_512 5          /* KVT_SWAP_IN_FEW_MISS in blocks of 512 threads: two blocks an SM */
#define KVT_SWAP_IN_FEW_MISS_ONE_LAUNCH 6   /* KVT_SWAP_IN_FEW_MISS copying every miss itself: one launch */
#define KVT_SWAP_IN_FEW_MISS_512_ONE_LAUNCH 7 /* KVT_SWAP_IN_FEW_MISS_512 copying every miss itself: one launch */
#define KVT_SWAP_IN_DEFAULT 8               /* kvtier's choice for the batch and GPU (SwapInChoice::default_for): on sm_90 FEW_MISS planned by a thread-block cluster a row up to batch 10, FEW_MISS_ONE_LAUNCH with line-aligned copies above; else FEW_MISS */

/* How a row of a KV buffer is addressed: pages of rows_per_page rows (a power
 * of two), page_bytes apart; within a page the rows' values (value_bytes
 * each) come first, then their scales (scale_bytes each, at most 256), then
 * padding. Linear rows of N bytes: {1, N, 0, 0, N}. DeepSeek-V4's C4 cache:
 * {64, 576, 8, 0, 37440}. */
typedef struct kvt_items {
    uint32_t rows_per_page;
    uint32_t value_bytes;         /* a positive multiple of 8 */
    uint32_t scale_bytes;         /* a multiple of 8 */
    uint32_t _reserved;
    uint64_t page_bytes;          /* a multiple of 8 holding both runs */
} kvt_items;

/* The KV rows a swap-in or a replay moves: host row h -> device row d of
 * each plane (MLA: one; MHA: K and V). */
typedef struct kvt_kv_buffers {
    kvt_items items;
    kvt_buf host_cache;           /* bytes: plane 0 (MLA latent, MHA K); host-mapped for CUDA */
    kvt_buf device_buffer;        /* bytes: plane 0 on the device */
    kvt_buf host_cache_v;         /* bytes: plane 1 (MHA V), or ptr NULL for one plane */
    kvt_buf device_buffer_v;      /* bytes: plane 1 on the device, NULL with host_cache_v */
} kvt_kv_buffers;

/* One layer's swap-in for a batch, in SGLang's formats (strides in elements;
 * the semantics are those of kvtier's swap_in module). The batch is the
 * length of req_pool_indices. */
typedef struct kvt_swap_in_args {
    kvt_buf top_k_tokens;         /* int32 [batch][top_k_stride]: num_top_k tokens (or blocks), -1 padding */
    uint64_t top_k_stride;
    kvt_buf device_buffer_tokens; /* int32 [num_requests][tokens_stride], the hot LRU slots */
    uint64_t tokens_stride;
    kvt_buf device_buffer_locs;   /* int32 [num_requests][locs_stride], slots 0..=hot */
    uint64_t locs_stride;
    kvt_buf lru_slots;            /* int16 [num_requests][lru_stride], hot entries */
    uint64_t lru_stride;
    kvt_buf host_cache_locs;      /* int64 [num_requests][host_stride], max_tokens entries */
    uint64_t host_stride;
    kvt_kv_buffers kv;
    kvt_buf top_k_device_locs;    /* int32 [batch][out_stride], written: num_top_k * max(block_tokens, 1) columns */
    uint64_t out_stride;
    kvt_buf req_pool_indices;     /* [batch], of req_pool_indices_type */
    kvt_buf seq_lens;             /* [batch], of seq_lens_type */
    kvt_buf num_real_reqs;        /* int32 [1] on the executor's side, or ptr NULL: all rows real */
    kvt_buf miss_src;             /* optional (ptr NULL): int64 [batch][miss_stride], host row per miss */
    kvt_buf miss_dst;             /* int32 [batch][miss_stride], device row per miss */
    kvt_buf miss_count;           /* int32 [batch], misses per row */
    uint64_t miss_stride;
    uint64_t miss_capacity;       /* misses a plan row holds (its columns); at least the entries per row */
    uint32_t req_pool_indices_type; /* KVT_INDEX_INT32 or KVT_INDEX_INT64 */
    uint32_t seq_lens_type;         /* KVT_INDEX_INT32 or KVT_INDEX_INT64 */
    uint32_t max_tokens;
    uint32_t num_requests;
    uint32_t num_top_k;
    uint32_t hot_buffer_size;
    uint32_t block_tokens;          /* 0: top_k_tokens holds tokens; else block ids of this many tokens */
    uint32_t skip_io;               /* nonzero: outputs, state and miss plan only, no KV bytes */
    int32_t layer;                  /* the layer whose counters the call adds to (kvt_swap_in_enable_counters),
                                     * -1: none; ignored by an engine that counts nothing */
} kvt_swap_in_args;

/* A recorded miss plan to replay (SGLang's copy_cache_planned_mla): rows below
 * num_real_reqs copy miss_count[r] host rows miss_src[r][m] to device rows
 * miss_dst[r][m] of each plane; every count and row is checked. */
typedef struct kvt_planned_copy_args {
    kvt_buf miss_src;             /* int64 [rows][miss_stride] */
    kvt_buf miss_dst;             /* int32 [rows][miss_stride] */
    kvt_buf miss_count;           /* int32 [rows]: the plan's rows */
    uint64_t miss_stride;
    uint64_t miss_capacity;       /* misses a row holds; larger counts are refused */
    kvt_buf num_real_reqs;        /* int32 [1] on the executor's side, or ptr NULL: every row */
    kvt_kv_buffers kv;
    uint32_t warps;               /* most warps the CUDA replay uses; 0: as many as the plan needs */
    uint32_t skip_io;             /* nonzero: walk nothing, move nothing (a timing probe) */
} kvt_planned_copy_args;

/* SGLang's HiSparseSpecState for one layer, read and written as SGLang lays
 * it out (strides in elements). */
typedef struct kvt_spec_state {
    kvt_buf cache_index;          /* int64 [index_rows][2][hash_size]: two hash banks of slot << 32 | token */
    uint64_t index_rows;
    uint64_t index_stride;        /* between requests */
    uint64_t bank_stride;         /* between a request's two banks */
    uint64_t hash_size;           /* entries per bank, a power of two */
    kvt_buf cache_policy;         /* int32 [policy_rows][policy_stride]: row 0 packed CLOCKs, row 1 + rid epochs */
    uint64_t policy_rows;
    uint64_t policy_stride;
    uint64_t policy_width;        /* columns: at least max(hot_buffer_size, num_requests) */
    kvt_buf scratch_locs;         /* int32 [num_requests][scratch_stride]: scratch device rows */
    uint64_t scratch_stride;
    uint64_t scratch_capacity;    /* scratch rows per request (the columns) */
    kvt_buf scratch_state;        /* int32 [state_rows][state_stride], 8-byte aligned: counters, miss tables */
    uint64_t state_rows;
    uint64_t state_stride;        /* even: rows are read as int64 pairs */
    uint64_t state_width;         /* columns: at least max(4 * num_requests, 5 * steps * top_k) */
} kvt_spec_state;

/* One layer's speculative swap-in (SGLang's
 * load_cache_to_device_buffer_spec_mla, MTP/EAGLE verify); the semantics are
 * those of kvtier's swap_in::spec module. The batch is the length of
 * req_pool_indices. */
typedef struct kvt_spec_swap_in_args {
    kvt_buf top_k_tokens;         /* int32 [batch][top_k_stride]: num_steps * num_top_k tokens, step-major */
    uint64_t top_k_stride;
    kvt_buf device_buffer_tokens; /* int32 [num_requests][tokens_stride]: hot slots, then the extra page */
    uint64_t tokens_stride;
    kvt_buf device_buffer_locs;   /* int32 [num_requests][locs_stride], written (rotated with scratch rows) */
    uint64_t locs_stride;
    kvt_buf host_cache_locs;      /* int64 [num_requests][host_stride], max_tokens entries */
    uint64_t host_stride;
    kvt_kv_buffers kv;            /* one plane */
    kvt_buf top_k_device_locs;    /* int32 [batch][out_stride], written: num_steps * num_top_k columns */
    uint64_t out_stride;
    kvt_buf req_pool_indices;     /* [batch], of req_pool_indices_type */
    kvt_buf seq_lens;             /* [batch * num_steps], of seq_lens_type */
    kvt_buf num_real_reqs;        /* int32 [1] (required) */
    kvt_buf miss_src;             /* optional (ptr NULL): int64 [batch][miss_stride], host row per copy */
    kvt_buf miss_dst;             /* int32 [batch][miss_stride], device row per copy */
    kvt_buf miss_count;           /* int32 [batch], copies per row */
    uint64_t miss_stride;
    uint64_t miss_capacity;       /* at least num_steps * num_top_k */
    kvt_spec_state state;
    uint32_t req_pool_indices_type; /* KVT_INDEX_INT32 or KVT_INDEX_INT64 */
    uint32_t seq_lens_type;         /* KVT_INDEX_INT32 or KVT_INDEX_INT64 */
    uint32_t max_tokens;
    uint32_t num_requests;
    uint32_t num_steps;             /* 2 to 4 */
    uint32_t num_top_k;             /* at least 1024; num_steps * num_top_k at most 8192 */
    uint32_t hot_buffer_size;
    uint32_t page_size;             /* extra-page slots after the hot buffer */
} kvt_spec_swap_in_args;

typedef struct kvt_swap_in kvt_swap_in;

/* A swap-in engine on `executor` (KVT_EXECUTOR_CPU or a GPU ordinal). */
kvt_status kvt_swap_in_create(int32_t executor, kvt_swap_in **out);
/* Grows the capacity (never shrinks) for swap-ins without a caller's miss
 * plan: set-up work, not inside a CUDA graph capture. */
kvt_status kvt_swap_in_reserve(kvt_swap_in *engine, uint32_t max_batch, uint32_t max_top_k);
kvt_status kvt_swap_in_capacity(const kvt_swap_in *engine, uint32_t *max_batch, uint32_t *max_top_k);
/* What any swap-in accepts: at most `max_hot` LRU slots per request (SGLang's
 * device_buffer_size) and `max_entries` resolved top-k entries per row. */
kvt_status kvt_swap_in_limits(uint32_t *max_hot, uint32_t *max_entries);
/* One layer's swap-in with `strategy` (KVT_SWAP_IN_*), on `stream`: no
 * allocation, no host synchronisation (CUDA-graph capturable). */
kvt_status kvt_swap_in_run(const kvt_swap_in *engine, const kvt_swap_in_args *args, uint32_t strategy,
                           kvt_cuda_stream stream);
/* Replays a miss plan on `stream` (CUDA-graph capturable as kvt_swap_in_run). */
kvt_status kvt_swap_in_copy_planned(const kvt_swap_in *engine, const kvt_planned_copy_args *args,
                                    kvt_cuda_stream stream);
/* One layer's speculative swap-in on `stream` (CPU: bad indices reported at
 * once; CUDA: at kvt_swap_in_check): no allocation, no host synchronisation.
 * The CUDA kernel has run under host emulation only, not yet on a GPU. */
kvt_status kvt_swap_in_run_spec(const kvt_swap_in *engine, const kvt_spec_swap_in_args *args,
                                kvt_cuda_stream stream);
/* The address the engine's kernels use for host memory at `host`: itself for
 * the CPU executor; for the CUDA executor the mapped device address of pinned
 * or registered memory (KVT_INVALID_ARGUMENT for memory that is neither), e.g.
 * for host_cache. */
kvt_status kvt_swap_in_map_host(const kvt_swap_in *engine, const void *host, uint64_t *out);
/* Waits for the device, then reports (and clears) the bad indices recorded
 * since the last check. */
kvt_status kvt_swap_in_check(const kvt_swap_in *engine);
/* Without waiting for anything: KVT_BAD_INDICES (the report in kvt_last_error,
 * counting every entry since the last check) when a snapshot of the error
 * word taken at the previous poll holds entries no poll reported yet, their
 * number in *new_entries; else KVT_OK and 0 (also while the snapshot is still
 * being copied, and always for the CPU executor, which reports at once). The
 * copy runs on a stream of the engine's own. Once per step, not while a CUDA
 * graph is being captured. */
kvt_status kvt_swap_in_poll(const kvt_swap_in *engine, uint32_t *new_entries);

/* What one layer's swap-ins did since counting began (see the library's
 * swap_in module): calls, rows below num_real_reqs, LRU slots hit and misses
 * loaded by the long rows, the bytes those misses moved (none with skip_io),
 * and the entries refused as bad indices. Speculative swap-ins and plan
 * replays are not counted. */
typedef struct kvt_swap_in_counters {
    uint64_t calls;
    uint64_t rows;
    uint64_t hits;
    uint64_t misses;
    uint64_t bytes;
    uint64_t bad_indices;
} kvt_swap_in_counters;

/* Starts counting the swap-ins of `layers` layers (1 to 4096), zeroed, on the
 * engine's executor (the kernels add with atomics: no host sync); set-up work,
 * not inside a CUDA graph capture. Again with at most as many layers: kept;
 * with more: KVT_INVALID_ARGUMENT. */
kvt_status kvt_swap_in_enable_counters(kvt_swap_in *engine, uint32_t layers);
/* Every counted layer's counters into out[0 .. min(capacity, *layers)) and
 * their number in *layers (0 while nothing is counted). With capacity 0 only
 * *layers is set (the layers counted), and nothing is read or polled.
 * wait != 0: once the
 * swap-ins launched before the call have finished (the CUDA executor waits
 * for the device). wait == 0: without waiting: as a copy the previous such
 * call started found them, on a stream of the engine's own (*layers 0 on the
 * first call and while it is in flight); once per step at most, not while a
 * CUDA graph is being captured. `out` may be NULL when `capacity` is 0. */
kvt_status kvt_swap_in_read_counters(const kvt_swap_in *engine, uint32_t wait, kvt_swap_in_counters *out,
                                     uint32_t capacity, uint32_t *layers);
void kvt_swap_in_destroy(kvt_swap_in *engine);

/* ---- tier: the per-layer API over a pool --------------------------------- */

typedef struct kvt_tier kvt_tier;

typedef struct kvt_gather_args {
    kvt_buf req_slots; /* int32 [batch]: slot of each row's request, -1 padding row */
    kvt_buf seq_lens;  /* int32 [batch] */
    kvt_buf topk;      /* int32 [batch][topk_stride], -1 padding */
    uint32_t k;
    uint32_t topk_stride;
    kvt_buf out;       /* bytes: [batch][k][entry_bytes], 8-byte aligned, written */
} kvt_gather_args;

typedef struct kvt_writeback_args {
    kvt_buf slots;    /* int32 [n]: destination slot, -1 skips the item */
    kvt_buf tokens;   /* int32 [n]: destination token */
    kvt_buf src_rows; /* int64 [n]: row of src */
    kvt_buf src;      /* bytes: the layer's KV buffer, rows of entry_bytes */
} kvt_writeback_args;

kvt_status kvt_tier_create(kvt_pool *pool, int32_t executor, uint32_t num_slots, kvt_tier **out);
/* Binds `slot` to `region` (stream-ordered for the CUDA executor). */
kvt_status kvt_tier_bind_slot(kvt_tier *tier, uint32_t slot, const kvt_region *region, kvt_cuda_stream stream);
kvt_status kvt_tier_unbind_slot(kvt_tier *tier, uint32_t slot, kvt_cuda_stream stream);
kvt_status kvt_tier_gather(const kvt_tier *tier, uint32_t layer, const kvt_gather_args *args,
                           kvt_cuda_stream stream);
kvt_status kvt_tier_writeback_layer(const kvt_tier *tier, uint32_t layer, const kvt_writeback_args *args,
                                    kvt_cuda_stream stream);
kvt_status kvt_tier_enable_swap_in(kvt_tier *tier, uint32_t max_batch, uint32_t max_top_k);
kvt_status kvt_tier_swap_in(const kvt_tier *tier, const kvt_swap_in_args *args, kvt_cuda_stream stream);
kvt_status kvt_tier_check(const kvt_tier *tier, kvt_cuda_stream stream);
void kvt_tier_destroy(kvt_tier *tier);

#ifdef __cplusplus
}
#endif

#endif /* KVTIER_H */
