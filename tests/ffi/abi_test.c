/*
 * Compiled against bindings/kvtier.h and linked to libkvtier by tests/ffi.rs.
 * `layout` prints every struct's size and field offsets (compared with the
 * Rust mirrors); `run` drives the C ABI on the CPU executor and prints one
 * line per check ("ok ..." or "FAIL ...").
 */
#include <kvtier.h>

#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#define FIELD(t, f) printf("%s.%s %zu\n", #t, #f, offsetof(t, f))
#define SIZE(t) printf("sizeof %s %zu\n", #t, sizeof(t))

static void layout(void) {
    SIZE(kvt_buf);
    FIELD(kvt_buf, ptr);
    FIELD(kvt_buf, len);
    SIZE(kvt_layout);
    FIELD(kvt_layout, entry_bytes);
    FIELD(kvt_layout, layers);
    FIELD(kvt_layout, tokens_per_region);
    SIZE(kvt_pool_options);
    FIELD(kvt_pool_options, rank);
    FIELD(kvt_pool_options, ranks);
    FIELD(kvt_pool_options, clients);
    FIELD(kvt_pool_options, register_flags);
    SIZE(kvt_pool_info);
    FIELD(kvt_pool_info, layout);
    FIELD(kvt_pool_info, num_devices);
    FIELD(kvt_pool_info, num_regions);
    FIELD(kvt_pool_info, free_regions);
    FIELD(kvt_pool_info, region_stride);
    FIELD(kvt_pool_info, uuid);
    SIZE(kvt_device_capacity);
    FIELD(kvt_device_capacity, bytes);
    FIELD(kvt_device_capacity, host_dram);
    FIELD(kvt_device_capacity, pinnable);
    FIELD(kvt_device_capacity, movable_bytes);
    SIZE(kvt_region_info);
    FIELD(kvt_region_info, index);
    FIELD(kvt_region_info, device);
    FIELD(kvt_region_info, host_addr);
    FIELD(kvt_region_info, bytes);
    FIELD(kvt_region_info, epoch);
    FIELD(kvt_region_info, joined);
    FIELD(kvt_region_info, joined_elsewhere);
    SIZE(kvt_swap_in_args);
    FIELD(kvt_swap_in_args, top_k_tokens);
    FIELD(kvt_swap_in_args, top_k_stride);
    FIELD(kvt_swap_in_args, device_buffer_tokens);
    FIELD(kvt_swap_in_args, tokens_stride);
    FIELD(kvt_swap_in_args, device_buffer_locs);
    FIELD(kvt_swap_in_args, locs_stride);
    FIELD(kvt_swap_in_args, lru_slots);
    FIELD(kvt_swap_in_args, lru_stride);
    FIELD(kvt_swap_in_args, host_cache_locs);
    FIELD(kvt_swap_in_args, host_stride);
    FIELD(kvt_swap_in_args, kv);
    FIELD(kvt_swap_in_args, top_k_device_locs);
    FIELD(kvt_swap_in_args, out_stride);
    FIELD(kvt_swap_in_args, req_pool_indices);
    FIELD(kvt_swap_in_args, seq_lens);
    FIELD(kvt_swap_in_args, num_real_reqs);
    FIELD(kvt_swap_in_args, miss_src);
    FIELD(kvt_swap_in_args, miss_dst);
    FIELD(kvt_swap_in_args, miss_count);
    FIELD(kvt_swap_in_args, miss_stride);
    FIELD(kvt_swap_in_args, miss_capacity);
    FIELD(kvt_swap_in_args, req_pool_indices_type);
    FIELD(kvt_swap_in_args, seq_lens_type);
    FIELD(kvt_swap_in_args, max_tokens);
    FIELD(kvt_swap_in_args, num_requests);
    FIELD(kvt_swap_in_args, num_top_k);
    FIELD(kvt_swap_in_args, hot_buffer_size);
    FIELD(kvt_swap_in_args, block_tokens);
    FIELD(kvt_swap_in_args, skip_io);
    FIELD(kvt_swap_in_args, layer);
    SIZE(kvt_swap_in_counters);
    FIELD(kvt_swap_in_counters, calls);
    FIELD(kvt_swap_in_counters, rows);
    FIELD(kvt_swap_in_counters, hits);
    FIELD(kvt_swap_in_counters, misses);
    FIELD(kvt_swap_in_counters, bytes);
    FIELD(kvt_swap_in_counters, bad_indices);
    SIZE(kvt_spec_state);
    FIELD(kvt_spec_state, cache_index);
    FIELD(kvt_spec_state, index_rows);
    FIELD(kvt_spec_state, index_stride);
    FIELD(kvt_spec_state, bank_stride);
    FIELD(kvt_spec_state, hash_size);
    FIELD(kvt_spec_state, cache_policy);
    FIELD(kvt_spec_state, policy_rows);
    FIELD(kvt_spec_state, policy_stride);
    FIELD(kvt_spec_state, policy_width);
    FIELD(kvt_spec_state, scratch_locs);
    FIELD(kvt_spec_state, scratch_stride);
    FIELD(kvt_spec_state, scratch_capacity);
    FIELD(kvt_spec_state, scratch_state);
    FIELD(kvt_spec_state, state_rows);
    FIELD(kvt_spec_state, state_stride);
    FIELD(kvt_spec_state, state_width);
    SIZE(kvt_spec_swap_in_args);
    FIELD(kvt_spec_swap_in_args, top_k_tokens);
    FIELD(kvt_spec_swap_in_args, top_k_stride);
    FIELD(kvt_spec_swap_in_args, device_buffer_tokens);
    FIELD(kvt_spec_swap_in_args, tokens_stride);
    FIELD(kvt_spec_swap_in_args, device_buffer_locs);
    FIELD(kvt_spec_swap_in_args, locs_stride);
    FIELD(kvt_spec_swap_in_args, host_cache_locs);
    FIELD(kvt_spec_swap_in_args, host_stride);
    FIELD(kvt_spec_swap_in_args, kv);
    FIELD(kvt_spec_swap_in_args, top_k_device_locs);
    FIELD(kvt_spec_swap_in_args, out_stride);
    FIELD(kvt_spec_swap_in_args, req_pool_indices);
    FIELD(kvt_spec_swap_in_args, seq_lens);
    FIELD(kvt_spec_swap_in_args, num_real_reqs);
    FIELD(kvt_spec_swap_in_args, miss_src);
    FIELD(kvt_spec_swap_in_args, miss_dst);
    FIELD(kvt_spec_swap_in_args, miss_count);
    FIELD(kvt_spec_swap_in_args, miss_stride);
    FIELD(kvt_spec_swap_in_args, miss_capacity);
    FIELD(kvt_spec_swap_in_args, state);
    FIELD(kvt_spec_swap_in_args, req_pool_indices_type);
    FIELD(kvt_spec_swap_in_args, seq_lens_type);
    FIELD(kvt_spec_swap_in_args, max_tokens);
    FIELD(kvt_spec_swap_in_args, num_requests);
    FIELD(kvt_spec_swap_in_args, num_steps);
    FIELD(kvt_spec_swap_in_args, num_top_k);
    FIELD(kvt_spec_swap_in_args, hot_buffer_size);
    FIELD(kvt_spec_swap_in_args, page_size);
    SIZE(kvt_items);
    FIELD(kvt_items, rows_per_page);
    FIELD(kvt_items, value_bytes);
    FIELD(kvt_items, scale_bytes);
    FIELD(kvt_items, page_bytes);
    SIZE(kvt_kv_buffers);
    FIELD(kvt_kv_buffers, items);
    FIELD(kvt_kv_buffers, host_cache);
    FIELD(kvt_kv_buffers, device_buffer);
    FIELD(kvt_kv_buffers, host_cache_v);
    FIELD(kvt_kv_buffers, device_buffer_v);
    SIZE(kvt_planned_copy_args);
    FIELD(kvt_planned_copy_args, miss_src);
    FIELD(kvt_planned_copy_args, miss_dst);
    FIELD(kvt_planned_copy_args, miss_count);
    FIELD(kvt_planned_copy_args, miss_stride);
    FIELD(kvt_planned_copy_args, miss_capacity);
    FIELD(kvt_planned_copy_args, num_real_reqs);
    FIELD(kvt_planned_copy_args, kv);
    FIELD(kvt_planned_copy_args, warps);
    FIELD(kvt_planned_copy_args, skip_io);
    SIZE(kvt_gather_args);
    FIELD(kvt_gather_args, req_slots);
    FIELD(kvt_gather_args, seq_lens);
    FIELD(kvt_gather_args, topk);
    FIELD(kvt_gather_args, k);
    FIELD(kvt_gather_args, topk_stride);
    FIELD(kvt_gather_args, out);
    SIZE(kvt_writeback_args);
    FIELD(kvt_writeback_args, slots);
    FIELD(kvt_writeback_args, tokens);
    FIELD(kvt_writeback_args, src_rows);
    FIELD(kvt_writeback_args, src);
    SIZE(kvt_engram_args);
    FIELD(kvt_engram_args, weights);
    FIELD(kvt_engram_args, scales);
    FIELD(kvt_engram_args, ids);
    FIELD(kvt_engram_args, out);
    FIELD(kvt_engram_args, out_rows);
    FIELD(kvt_engram_args, row_lo);
    FIELD(kvt_engram_args, row_hi);
    FIELD(kvt_engram_args, dim);
    FIELD(kvt_engram_args, block);
    FIELD(kvt_engram_args, ids_type);
}

static int failures = 0;

#define CHECK(cond, ...)                  \
    do {                                  \
        if (cond) {                       \
            printf("ok ");                \
        } else {                          \
            printf("FAIL ");              \
            failures++;                   \
        }                                 \
        printf(__VA_ARGS__);              \
        printf(" [%s]\n", kvt_last_error()); \
    } while (0)

#define BUF(p, n) ((kvt_buf){(void *)(p), (uint64_t)(n)})

enum { ITEM = 16 };

/* The worked example: HOT = 4, slots 0..3 hold tokens 1, 4, 2, 5 at device
 * rows 9, 7, 3, 5; the newest token 7 in the reserved slot at row 11; LRU
 * 0, 1, 2, 3; seq_len 8; token t in host row t (filled with t). */
static void swap_in(void) {
    int32_t tokens[5] = {1, 4, 2, 5, 7};
    const int32_t locs[5] = {9, 7, 3, 5, 11};
    int16_t lru[4] = {0, 1, 2, 3};
    int64_t host_locs[8];
    uint8_t host_cache[8 * ITEM];
    uint8_t device_buffer[12 * ITEM];
    for (int t = 0; t < 8; t++) {
        host_locs[t] = t;
        memset(host_cache + t * ITEM, t, ITEM);
    }
    memset(device_buffer, 0xEE, sizeof device_buffer);
    int32_t query[3] = {4, 2, 7};
    int32_t out[3] = {-7, -7, -7};
    int32_t req[1] = {0};
    int64_t seq[1] = {8};

    kvt_swap_in *engine = NULL;
    CHECK(kvt_swap_in_create(KVT_EXECUTOR_CPU, &engine) == KVT_OK && engine, "create a CPU engine");
    kvt_swap_in_args a;
    memset(&a, 0, sizeof a);
    a.top_k_tokens = BUF(query, 3);
    a.top_k_stride = 3;
    a.device_buffer_tokens = BUF(tokens, 5);
    a.tokens_stride = 5;
    a.device_buffer_locs = BUF(locs, 5);
    a.locs_stride = 5;
    a.lru_slots = BUF(lru, 4);
    a.lru_stride = 4;
    a.host_cache_locs = BUF(host_locs, 8);
    a.host_stride = 8;
    a.kv.items = (kvt_items){1, ITEM, 0, 0, ITEM};
    a.kv.host_cache = BUF(host_cache, sizeof host_cache);
    a.kv.device_buffer = BUF(device_buffer, sizeof device_buffer);
    a.top_k_device_locs = BUF(out, 3);
    a.out_stride = 3;
    a.req_pool_indices = BUF(req, 1);
    a.req_pool_indices_type = KVT_INDEX_INT32;
    a.seq_lens = BUF(seq, 1);
    a.seq_lens_type = KVT_INDEX_INT64;
    a.max_tokens = 8;
    a.num_requests = 1;
    a.num_top_k = 3;
    a.hot_buffer_size = 4;

    kvt_status s = kvt_swap_in_run(engine, &a, KVT_SWAP_IN_PLAN_THEN_COPY, NULL);
    CHECK(s == KVT_INVALID_ARGUMENT && strstr(kvt_last_error(), "reserve"),
          "without capacity or a miss plan: invalid argument naming reserve (%d)", s);
    CHECK(kvt_swap_in_reserve(engine, 1, 3) == KVT_OK, "reserve 1 x 3");
    uint32_t mb = 0, mk = 0;
    CHECK(kvt_swap_in_capacity(engine, &mb, &mk) == KVT_OK && mb == 1 && mk == 3, "capacity %u x %u", mb, mk);
    CHECK(kvt_swap_in_limits(&mb, &mk) == KVT_OK && mb == 16384 && mk == 4096, "limits %u, %u", mb, mk);
    CHECK(kvt_swap_in_limits(NULL, &mk) == KVT_INVALID_ARGUMENT, "limits into a null pointer");
    /* A written buffer sharing memory with another is refused before anything runs. */
    kvt_buf saved = a.device_buffer_locs;
    a.device_buffer_locs = BUF(tokens, 5);
    s = kvt_swap_in_run(engine, &a, KVT_SWAP_IN_PLAN_THEN_COPY, NULL);
    CHECK(s == KVT_INVALID_ARGUMENT && strstr(kvt_last_error(), "shares memory with `device_buffer_locs`"),
          "locs aliasing tokens: %s", kvt_last_error());
    a.device_buffer_locs = saved;
    uint32_t fresh = 7;
    CHECK(kvt_swap_in_poll(engine, &fresh) == KVT_OK && fresh == 0, "the CPU executor has nothing to poll");
    CHECK(kvt_swap_in_poll(engine, NULL) == KVT_INVALID_ARGUMENT, "poll into a null pointer");
    s = kvt_swap_in_run(engine, &a, KVT_SWAP_IN_PLAN_THEN_COPY, NULL);
    CHECK(s == KVT_OK && out[0] == 7 && out[1] == 3 && out[2] == 11, "query [4,2,7] -> [%d,%d,%d]", out[0],
          out[1], out[2]);
    CHECK(lru[0] == 0 && lru[1] == 3 && lru[2] == 1 && lru[3] == 2, "LRU [%d,%d,%d,%d]", lru[0], lru[1], lru[2],
          lru[3]);

    /* The second query, recording SGLang's miss plan. */
    int32_t q2[1] = {6};
    int32_t out2[1] = {-7};
    int64_t miss_src[2] = {-1, -1};
    int32_t miss_dst[2] = {-1, -1};
    int32_t miss_count[1] = {-1};
    a.top_k_tokens = BUF(q2, 1);
    a.top_k_stride = 1;
    a.top_k_device_locs = BUF(out2, 1);
    a.out_stride = 1;
    a.num_top_k = 1;
    a.miss_src = BUF(miss_src, 2);
    a.miss_dst = BUF(miss_dst, 2);
    a.miss_count = BUF(miss_count, 1);
    a.miss_stride = 2;
    a.miss_capacity = 2;
    /* (with kvtier's choice of strategy: the same result under every one) */
    s = kvt_swap_in_run(engine, &a, KVT_SWAP_IN_DEFAULT, NULL);
    CHECK(s == KVT_OK && out2[0] == 9 && tokens[0] == 6 && device_buffer[9 * ITEM] == 6, "query [6] -> [%d]",
          out2[0]);
    CHECK(miss_count[0] == 1 && miss_src[0] == 6 && miss_dst[0] == 9, "miss plan %d: %" PRId64 " -> %d",
          miss_count[0], miss_src[0], miss_dst[0]);

    /* Replay that plan into another layer's device buffer (a shared-index layer). */
    uint8_t other_layer[12 * ITEM];
    memset(other_layer, 0xEE, sizeof other_layer);
    kvt_planned_copy_args r;
    memset(&r, 0, sizeof r);
    r.miss_src = BUF(miss_src, 2);
    r.miss_dst = BUF(miss_dst, 2);
    r.miss_count = BUF(miss_count, 1);
    r.miss_stride = 2;
    r.miss_capacity = 2;
    r.kv = a.kv;
    r.kv.device_buffer = BUF(other_layer, sizeof other_layer);
    s = kvt_swap_in_copy_planned(engine, &r, NULL);
    CHECK(s == KVT_OK && other_layer[9 * ITEM] == 6 && other_layer[8 * ITEM] == 0xEE, "replay: row 9 <- host row 6");
    miss_count[0] = 3;
    s = kvt_swap_in_copy_planned(engine, &r, NULL);
    CHECK(s == KVT_BAD_INDICES && strstr(kvt_last_error(), "miss_count"), "a count above the capacity (%d)", s);
    miss_count[0] = 1;
    r.kv.host_cache_v = BUF(host_cache, sizeof host_cache);
    s = kvt_swap_in_copy_planned(engine, &r, NULL);
    CHECK(s == KVT_INVALID_ARGUMENT && strstr(kvt_last_error(), "together"), "a V plane without its device side (%d)",
          s);

    /* Bad input: clear statuses and messages, nothing run. */
    a.miss_dst = BUF(NULL, 0);
    s = kvt_swap_in_run(engine, &a, KVT_SWAP_IN_PLAN_THEN_COPY, NULL);
    CHECK(s == KVT_INVALID_ARGUMENT && strstr(kvt_last_error(), "together"), "a partial miss plan (%d)", s);
    a.miss_src = a.miss_dst = a.miss_count = BUF(NULL, 0);
    s = kvt_swap_in_run(engine, &a, KVT_SWAP_IN_DEFAULT + 1, NULL);
    CHECK(s == KVT_INVALID_ARGUMENT && strstr(kvt_last_error(), "strategy"), "strategy past the last (%d)", s);
    a.seq_lens_type = 3;
    s = kvt_swap_in_run(engine, &a, KVT_SWAP_IN_PLAN_THEN_COPY, NULL);
    CHECK(s == KVT_INVALID_ARGUMENT && strstr(kvt_last_error(), "seq_lens"), "index type 3 (%d)", s);
    a.seq_lens_type = KVT_INDEX_INT64;
    a.kv.host_cache = BUF(NULL, 16);
    s = kvt_swap_in_run(engine, &a, KVT_SWAP_IN_PLAN_THEN_COPY, NULL);
    CHECK(s == KVT_INVALID_ARGUMENT && strstr(kvt_last_error(), "host_cache"), "a null buffer with a length (%d)",
          s);
    a.kv.host_cache = BUF(host_cache, sizeof host_cache);
    a.kv.items.value_bytes = 12;
    s = kvt_swap_in_run(engine, &a, KVT_SWAP_IN_PLAN_THEN_COPY, NULL);
    CHECK(s == KVT_INVALID_ARGUMENT && strstr(kvt_last_error(), "item_size_bytes"), "a 12-byte item (%d)", s);
    a.kv.items.value_bytes = ITEM;
    q2[0] = 8;
    s = kvt_swap_in_run(engine, &a, KVT_SWAP_IN_PLAN_THEN_COPY, NULL);
    CHECK(s == KVT_BAD_INDICES && strstr(kvt_last_error(), "top_k_tokens"), "token 8 of seq_len 8 (%d)", s);
    CHECK(kvt_swap_in_run(engine, NULL, 0, NULL) == KVT_INVALID_ARGUMENT, "null args");
    CHECK(kvt_swap_in_run(NULL, &a, 0, NULL) == KVT_INVALID_ARGUMENT && strstr(kvt_last_error(), "null"),
          "null engine");
    /* the speculative swap-in: its checks answer from C too */
    CHECK(kvt_swap_in_run_spec(engine, NULL, NULL) == KVT_INVALID_ARGUMENT, "spec: null args");
    int32_t nr = 1;
    kvt_spec_swap_in_args sp;
    memset(&sp, 0, sizeof sp);
    sp.num_steps = 2;
    sp.num_top_k = 1024;
    sp.hot_buffer_size = 4096;
    s = kvt_swap_in_run_spec(engine, &sp, NULL);
    CHECK(s == KVT_INVALID_ARGUMENT && strstr(kvt_last_error(), "num_real_reqs"), "spec: no num_real_reqs (%d)", s);
    sp.num_real_reqs = BUF(&nr, 1);
    sp.kv = a.kv;
    sp.req_pool_indices_type = sp.seq_lens_type = KVT_INDEX_INT64;
    sp.num_steps = 5;
    s = kvt_swap_in_run_spec(engine, &sp, NULL);
    CHECK(s == KVT_INVALID_ARGUMENT && strstr(kvt_last_error(), "num_steps"), "spec: 5 steps (%d)", s);
    sp.num_steps = 2;
    sp.state.hash_size = 3;
    s = kvt_swap_in_run_spec(engine, &sp, NULL);
    CHECK(s == KVT_INVALID_ARGUMENT && strstr(kvt_last_error(), "power of two"), "spec: a hash of 3 (%d)", s);
    uint64_t mapped = 0;
    CHECK(kvt_swap_in_map_host(engine, host_cache, &mapped) == KVT_OK && mapped == (uint64_t)(uintptr_t)host_cache,
          "the CPU executor addresses host memory as it is");
    CHECK(kvt_swap_in_map_host(engine, NULL, &mapped) == KVT_INVALID_ARGUMENT, "map a null pointer");
    CHECK(kvt_swap_in_create(-2, &engine) == KVT_INVALID_ARGUMENT, "executor -2");
    kvt_swap_in_destroy(engine);
    kvt_swap_in_destroy(NULL);
}

/* A pool, a region, a tier: write back one entry, gather it. */
static void tier(void) {
    kvt_layout l = {ITEM, 2, 8};
    uint64_t bytes = 0;
    CHECK(kvt_pool_device_bytes_for(&l, 2, &bytes) == KVT_OK && bytes > 0, "device bytes for 2 regions");
    char spec[64];
    snprintf(spec, sizeof spec, "anon:%" PRIu64, bytes);
    kvt_device_capacity cap;
    CHECK(kvt_device_capacity_get(spec, &cap) == KVT_OK && cap.bytes == bytes && cap.host_dram == 1 && cap.pinnable == 1,
          "capacity of %s", spec);
    CHECK(kvt_device_capacity_get("dax:", &cap) == KVT_INVALID_ARGUMENT, "capacity of a bad device string");
    CHECK(kvt_device_capacity_get(NULL, &cap) == KVT_INVALID_ARGUMENT, "capacity of a null device");
    int32_t gpu_node = 7;
    CHECK(kvt_cuda_numa_node(-1, &gpu_node) == KVT_INVALID_ARGUMENT, "the NUMA node of GPU -1");
    const char *devices[1] = {spec};
    kvt_pool *pool = NULL;
    CHECK(kvt_pool_create(&l, devices, 1, NULL, &pool) == KVT_OK, "create a pool on %s", spec);
    kvt_pool_info info;
    CHECK(kvt_pool_info_get(pool, &info) == KVT_OK && info.num_regions == 2 && info.free_regions == 2 &&
              info.layout.entry_bytes == ITEM,
          "pool info: %u regions", info.num_regions);
    kvt_region *region = NULL;
    CHECK(kvt_region_alloc(pool, 42, &region) == KVT_OK, "allocate a region");
    kvt_region_info ri;
    CHECK(kvt_region_info_get(region, &ri) == KVT_OK && ri.bytes == 2 * 8 * ITEM && ri.host_addr != 0,
          "region %u on device %u, %" PRIu64 " bytes", ri.index, ri.device, ri.bytes);
    kvt_tier *t = NULL;
    CHECK(kvt_tier_create(pool, KVT_EXECUTOR_CPU, 4, &t) == KVT_OK, "create a CPU tier");
    CHECK(kvt_tier_bind_slot(t, 2, region, NULL) == KVT_OK, "bind slot 2");

    uint8_t src[3 * ITEM];
    for (int i = 0; i < 3 * ITEM; i++) src[i] = (uint8_t)(100 + i);
    int32_t slots[1] = {2}, toks[1] = {5};
    int64_t rows[1] = {1};
    kvt_writeback_args w = {BUF(slots, 1), BUF(toks, 1), BUF(rows, 1), BUF(src, sizeof src)};
    CHECK(kvt_tier_writeback_layer(t, 1, &w, NULL) == KVT_OK, "write back row 1 to token 5 of layer 1");
    const uint8_t *region_bytes = (const uint8_t *)(uintptr_t)ri.host_addr;
    CHECK(memcmp(region_bytes + (1 * 8 + 5) * ITEM, src + ITEM, ITEM) == 0, "the pool holds it layer-first");

    int32_t gslots[1] = {2}, gseq[1] = {8}, topk[2] = {5, -1};
    uint8_t gout[2 * ITEM];
    memset(gout, 0xAB, sizeof gout);
    kvt_gather_args g = {BUF(gslots, 1), BUF(gseq, 1), BUF(topk, 2), 2, 2, BUF(gout, sizeof gout)};
    CHECK(kvt_tier_gather(t, 1, &g, NULL) == KVT_OK, "gather layer 1");
    uint8_t zero[ITEM] = {0};
    CHECK(memcmp(gout, src + ITEM, ITEM) == 0 && memcmp(gout + ITEM, zero, ITEM) == 0,
          "gathered the entry, zero-filled the padding");
    CHECK(kvt_tier_check(t, NULL) == KVT_OK, "check");

    CHECK(kvt_tier_gather(t, 2, &g, NULL) == KVT_INVALID_ARGUMENT && strstr(kvt_last_error(), "layer"),
          "layer 2 of 2");
    CHECK(kvt_tier_bind_slot(t, 2, (const kvt_region *)pool, NULL) == KVT_INVALID_ARGUMENT &&
              strstr(kvt_last_error(), "not a kvt_region"),
          "a pool handle passed as a region");
    CHECK(kvt_pool_info_get((const kvt_pool *)t, &info) == KVT_INVALID_ARGUMENT, "a tier handle passed as a pool");
    const char *bad[1] = {"tape:/dev/st0"};
    kvt_pool *p2 = NULL;
    CHECK(kvt_pool_create(&l, bad, 1, NULL, &p2) == KVT_INVALID_ARGUMENT && p2 == NULL &&
              strstr(kvt_last_error(), "device kind"),
          "an unknown device kind");
    CHECK(kvt_pool_create(&l, devices, 1, NULL, NULL) == KVT_INVALID_ARGUMENT, "a null out pointer");
    kvt_layout odd = {12, 1, 1};
    CHECK(kvt_pool_create(&odd, devices, 1, NULL, &p2) == KVT_INVALID_ARGUMENT &&
              strstr(kvt_last_error(), "entry_bytes"),
          "12-byte entries");

    kvt_region *joined = NULL;
    CHECK(ri.epoch > 0 && ri.joined == 0 && ri.joined_elsewhere == 0, "epoch %" PRIu64 ", not joined", ri.epoch);
    CHECK(kvt_region_join(pool, info.uuid, ri.index, ri.epoch, &joined) == KVT_INVALID_ARGUMENT && joined == NULL &&
              strstr(kvt_last_error(), "file: or dax:"),
          "no region of a private device is shared");
    CHECK(kvt_region_join(pool, info.uuid, ri.index, ri.epoch, NULL) == KVT_INVALID_ARGUMENT,
          "join: a null out pointer");
    CHECK(kvt_region_join(pool, NULL, ri.index, ri.epoch, &joined) == KVT_INVALID_ARGUMENT && joined == NULL &&
              strstr(kvt_last_error(), "pool_uuid"),
          "join: a null pool uuid");

    CHECK(kvt_region_publish(region) == KVT_OK, "publish");
    kvt_tier_destroy(t);
    CHECK(kvt_region_free(region) == KVT_OK, "free the region");
    CHECK(kvt_pool_info_get(pool, &info) == KVT_OK && info.free_regions == 2, "both regions free again");
    kvt_pool_close(pool);
    kvt_pool_close(NULL);
    kvt_tier_destroy(NULL);
}

/* A region on a file device joined through a second pool handle: one copy;
 * the owner's free refused while it is joined, the joiner's leave frees
 * nothing. */
static void shared_region(void) {
    kvt_layout l = {ITEM, 2, 8};
    char path[64], spec[96];
    snprintf(path, sizeof path, "/dev/shm/kvtier-abi-join-%d", (int)getpid());
    snprintf(spec, sizeof spec, "file:%s:8MiB", path);
    const char *devices[1] = {spec};
    kvt_pool *owner = NULL, *peer = NULL;
    CHECK(kvt_pool_create(&l, devices, 1, NULL, &owner) == KVT_OK, "create a pool on %s", spec);
    CHECK(kvt_pool_open(devices, 1, NULL, &peer) == KVT_OK, "open it again");
    kvt_region *region = NULL, *joined = NULL;
    kvt_region_info ri, ji;
    CHECK(kvt_region_alloc(owner, 1, &region) == KVT_OK && kvt_region_info_get(region, &ri) == KVT_OK, "allocate");
    kvt_pool_info info;
    CHECK(kvt_pool_info_get(owner, &info) == KVT_OK, "the owner's pool uuid");
    CHECK(kvt_region_join(peer, info.uuid, ri.index, ri.epoch + 1, &joined) == KVT_POOL_ERROR && joined == NULL &&
              strstr(kvt_last_error(), "is gone"),
          "another allocation's epoch");
    uint8_t other[16];
    memcpy(other, info.uuid, 16);
    other[0] ^= 1;
    CHECK(kvt_region_join(peer, other, ri.index, ri.epoch, &joined) == KVT_INVALID_ARGUMENT && joined == NULL &&
              strstr(kvt_last_error(), "not of this pool"),
          "another pool's ticket");
    CHECK(kvt_region_join(peer, info.uuid, ri.index, ri.epoch, &joined) == KVT_OK &&
              kvt_region_info_get(joined, &ji) == KVT_OK &&
              ji.joined == 1 && ji.index == ri.index && ji.epoch == ri.epoch,
          "join region %u", ri.index);
    ((uint8_t *)(uintptr_t)ji.host_addr)[3] = 0x5A;
    CHECK(((const uint8_t *)(uintptr_t)ri.host_addr)[3] == 0x5A, "one copy, two mappings");
    CHECK(kvt_region_info_get(region, &ri) == KVT_OK && ri.joined_elsewhere == 1, "the owner sees the joiner");
    CHECK(kvt_region_free(joined) == KVT_OK, "the joiner leaves");
    CHECK(kvt_region_info_get(region, &ri) == KVT_OK && ri.joined_elsewhere == 0, "no joiner left");
    CHECK(kvt_pool_info_get(owner, &info) == KVT_OK && info.free_regions == info.num_regions - 1,
          "leaving frees nothing");
    CHECK(kvt_region_join(peer, info.uuid, ri.index, ri.epoch, &joined) == KVT_OK, "join again");
    CHECK(kvt_region_free(region) == KVT_POOL_ERROR && strstr(kvt_last_error(), "still mapped"),
          "the owner's free is refused while joined");
    CHECK(kvt_region_free(joined) == KVT_OK, "the joiner leaves again");
    CHECK(kvt_pool_info_get(peer, &info) == KVT_OK && info.free_regions == info.num_regions,
          "the refused region went with its joiner's leave");
    kvt_pool_close(owner);
    kvt_pool_close(peer);
    unlink(path);
}

/* A table loaded, resumed after a loader closed mid-way, published, attached
 * and destroyed through the C ABI; bad arguments refused. */
static void tables(void) {
    char dir[256], path[512];
    snprintf(dir, sizeof dir, "/tmp/kvtier-abi-tables-%d", (int)getpid());
    mkdir(dir, 0700);
    size_t needed = 0;
    CHECK(kvt_table_store_path(dir, "k", path, 4, &needed) == KVT_INVALID_ARGUMENT && needed > 4,
          "a short buffer is refused and the size said (%zu)", needed);
    CHECK(kvt_table_store_path(dir, "k", path, sizeof path, &needed) == KVT_OK &&
              strncmp(path, dir, strlen(dir)) == 0,
          "store path %s", path);
    uint64_t n = (5u << 20) + 3; /* 3 chunks of 2 MiB */
    uint8_t *bytes = malloc(n);
    for (uint64_t i = 0; i < n; ++i) bytes[i] = (uint8_t)(i * 7);
    kvt_table_loader *l = NULL;
    CHECK(kvt_table_load(path, "k", n, 0, &l) == KVT_OK && l != NULL, "a new table is a loader");
    CHECK(kvt_table_loader_write(l, 0, bytes, 2u << 20) == KVT_OK, "the first chunk written");
    CHECK(kvt_table_loader_publish(l) == KVT_POOL_ERROR, "publishing with bytes missing is refused");
    kvt_table_loader_close(l); /* as a loader that stops */
    kvt_table *t = NULL;
    CHECK(kvt_table_attach(path, "k", 0, &t) == KVT_POOL_ERROR && t == NULL, "an unfinished table is not served");
    CHECK(kvt_table_load(path, "k", n, 0, &l) == KVT_OK && l != NULL, "the next loader resumes");
    uint64_t a = 0, b = 0;
    CHECK(kvt_table_loader_next_missing(l, 0, &a, &b) == KVT_OK && a == (2u << 20) && b == n,
          "missing [%" PRIu64 ", %" PRIu64 ")", a, b);
    CHECK(kvt_table_loader_write(l, a, bytes + a, b - a) == KVT_OK, "the rest written");
    CHECK(kvt_table_loader_write(l, n - 1, bytes, 2) == KVT_INVALID_ARGUMENT, "a write past the end is refused");
    CHECK(kvt_table_loader_publish(l) == KVT_OK, "published");
    CHECK(kvt_table_loader_publish(l) == KVT_INVALID_ARGUMENT, "published once only");
    kvt_table_loader_close(l);
    CHECK(kvt_table_load(path, "k", n, 0, &l) == KVT_OK && l == NULL, "loaded already: no loader");
    CHECK(kvt_table_attach(path, "other", 0, &t) == KVT_POOL_ERROR, "another key does not attach");
    CHECK(kvt_table_attach(path, "k", 0, &t) == KVT_OK && t != NULL, "attached");
    const void *data = NULL;
    uint64_t len = 0;
    CHECK(kvt_table_data(t, &data, &len) == KVT_OK && len == n && memcmp(data, bytes, n) == 0,
          "every byte as written");
    CHECK(kvt_table_destroy(path) == KVT_POOL_ERROR, "not destroyed under a reader");
    CHECK(kvt_table_data((const kvt_table *)l, &data, &len) == KVT_INVALID_ARGUMENT, "a null handle is refused");
    kvt_table_close(t);
    CHECK(kvt_table_destroy(path) == KVT_OK, "destroyed");
    CHECK(kvt_table_load(NULL, "k", n, 0, &l) == KVT_INVALID_ARGUMENT, "a null path is refused");
    CHECK(kvt_table_load(path, "", n, 0, &l) == KVT_INVALID_ARGUMENT, "an empty key is refused");
    kvt_table_close(NULL);
    kvt_table_loader_close(NULL);
    free(bytes);
    rmdir(dir);
}

/* Pages set and found through the C ABI (keys packed, a page over two parts);
 * bad arguments refused. */
static void prefix_store(void) {
    char path[256];
    snprintf(path, sizeof path, "/tmp/kvtier-abi-prefix-%d", (int)getpid());
    unlink(path);
    enum { PAGE = 8192 };
    kvt_prefix_store *s = NULL;
    CHECK(kvt_prefix_open(path, "ns", PAGE, 4, 0, &s) == KVT_OK && s != NULL, "a new prefix store");
    uint64_t page = 0, slots = 0, size = 0;
    CHECK(kvt_prefix_info(s, &page, &slots, &size) == KVT_OK && page == PAGE && slots == 4 && size > 4 * PAGE,
          "info %" PRIu64 " x %" PRIu64, slots, page);
    static uint8_t a[PAGE], b[PAGE], out[PAGE];
    for (int i = 0; i < PAGE; ++i) a[i] = (uint8_t)i, b[i] = (uint8_t)(i * 3);
    const char keys[] = "k0\0k1\0";
    uint64_t ptrs[4] = {(uint64_t)(uintptr_t)a, (uint64_t)(uintptr_t)(a + 100), (uint64_t)(uintptr_t)b,
                        (uint64_t)(uintptr_t)(b + 100)};
    uint64_t lens[4] = {100, PAGE - 100, 100, PAGE - 100};
    uint8_t outcome[2] = {9, 9}, found[2] = {9, 9};
    CHECK(kvt_prefix_set(s, keys, sizeof keys - 1, 2, ptrs, lens, 2, outcome) == KVT_OK &&
              outcome[0] == KVT_PREFIX_STORED && outcome[1] == KVT_PREFIX_STORED,
          "two pages stored (%u %u)", outcome[0], outcome[1]);
    size_t hits = 9;
    const char probe[] = "k0\0k9\0k1\0";
    CHECK(kvt_prefix_hits(s, probe, sizeof probe - 1, 3, &hits) == KVT_OK && hits == 1, "the prefix held: %zu", hits);
    uint64_t optr[2] = {(uint64_t)(uintptr_t)out, (uint64_t)(uintptr_t)(out + 4096)};
    uint64_t olen[2] = {4096, PAGE - 4096};
    CHECK(kvt_prefix_get(s, "k1\0k9\0", 6, 2, (uint64_t[]){optr[0], optr[1], optr[0], optr[1]},
                         (uint64_t[]){olen[0], olen[1], olen[0], olen[1]}, 2, found) == KVT_OK &&
              found[0] == 1 && found[1] == 0,
          "k1 found, k9 not");
    CHECK(kvt_prefix_get(s, "k1\0", 3, 1, optr, olen, 2, found) == KVT_OK && memcmp(out, b, PAGE) == 0,
          "k1's bytes");
    CHECK(kvt_prefix_set(s, "k1\0", 3, 1, ptrs, lens, 2, outcome) == KVT_OK && outcome[0] == KVT_PREFIX_PRESENT,
          "a key held already is present");
    CHECK(kvt_prefix_hits(s, "k0k1", 4, 2, &hits) == KVT_INVALID_ARGUMENT, "keys without their NULs");
    CHECK(kvt_prefix_hits(s, "k0\0", 3, 2, &hits) == KVT_INVALID_ARGUMENT && strstr(kvt_last_error(), "not 2"),
          "fewer keys than said");
    CHECK(kvt_prefix_hits(s, "\0", 1, 1, &hits) == KVT_INVALID_ARGUMENT, "an empty key");
    CHECK(kvt_prefix_hits(s, NULL, 3, 1, &hits) == KVT_INVALID_ARGUMENT, "null keys");
    CHECK(kvt_prefix_get(s, "k1\0", 3, 1, optr, (uint64_t[]){4096, 4095}, 2, found) == KVT_INVALID_ARGUMENT &&
              strstr(kvt_last_error(), "add up to"),
          "parts one byte short of a page");
    CHECK(kvt_prefix_get(s, "k1\0", 3, 1, (uint64_t[]){0, optr[1]}, olen, 2, found) == KVT_INVALID_ARGUMENT,
          "a null part");
    CHECK(kvt_prefix_get(s, "k1\0", 3, 1, optr, olen, 0, found) == KVT_INVALID_ARGUMENT, "zero parts a page");
    CHECK(kvt_prefix_set(s, "k1\0", 3, 1, ptrs, lens, 2, NULL) == KVT_INVALID_ARGUMENT, "a null outcome");
    uint64_t counters[7] = {0};
    CHECK(kvt_prefix_counters(s, counters, 7) == KVT_OK && counters[0] == 2 && counters[6] == 2,
          "counters: %" PRIu64 " sets, %" PRIu64 " pages", counters[0], counters[6]);
    kvt_prefix_store *t = NULL;
    CHECK(kvt_prefix_open(path, "other", PAGE, 4, 0, &t) == KVT_POOL_ERROR && t == NULL &&
              strstr(kvt_last_error(), "holds pages of `ns`"),
          "another namespace is refused");
    CHECK(kvt_prefix_hits((const kvt_prefix_store *)&page, "k0\0", 3, 1, &hits) == KVT_INVALID_ARGUMENT,
          "a foreign handle is refused");
    uint64_t evicted = 0;
    CHECK(kvt_prefix_clear(s, &evicted) == KVT_OK && evicted == 2, "cleared %" PRIu64, evicted);
    kvt_prefix_close(s);
    kvt_prefix_close(NULL);
    unlink(path);
}

/* Two rows of a table (dim 32, one scale byte a row) gathered on the CPU
 * executor: values by hand, an id past the table reported, bad shapes refused. */
static void engram(void) {
    kvt_engram *e = NULL;
    CHECK(kvt_engram_create(KVT_EXECUTOR_CPU, &e) == KVT_OK && e != NULL, "an Engram gatherer");
    static uint8_t w[2][32] __attribute__((aligned(16)));
    uint8_t s[2] = {127, 128}; /* scale 1, then 2 */
    for (int j = 0; j < 32; ++j) {
        w[0][j] = 0x38; /* e4m3 1.0 */
        w[1][j] = 0xB8; /* -1.0 */
    }
    int32_t ids[4] = {1, 0, 7, 2}; /* 7: outside [0, 4), 2: inside but past the table */
    static uint16_t out[4][32] __attribute__((aligned(16)));
    memset(out, 0xAB, sizeof out);
    kvt_engram_args a = {
        {w, sizeof w}, {s, sizeof s}, {ids, 4}, {out, 4 * 32}, {NULL, 0}, 0, 4, 32, 32, KVT_INDEX_INT32,
    };
    CHECK(kvt_engram_gather(e, &a, NULL) == KVT_BAD_INDICES && strstr(kvt_last_error(), "ids"),
          "the id past the table is reported: %s", kvt_last_error());
    CHECK(out[0][0] == 0xC000 && out[0][31] == 0xC000 && out[1][0] == 0x3F80 && out[2][5] == 0 &&
              out[3][5] == 0,
          "rows -2, 1, +0, +0: %04x %04x %04x %04x", out[0][0], out[1][0], out[2][5], out[3][5]);
    a.row_hi = 2;
    memset(out, 0xAB, sizeof out);
    CHECK(kvt_engram_gather(e, &a, NULL) == KVT_OK && out[0][0] == 0xC000 && out[3][0] == 0,
          "every id outside [0, 2) is a +0 row");
    CHECK(kvt_engram_check(e) == KVT_OK, "nothing left to report");
    /* sorted reads: ids 0, 1 read in that order, written to rows 3 and 0 */
    int32_t sorted[4] = {0, 1, 9, 9}, rows_of[4] = {3, 0, 1, 4};
    a.ids.ptr = sorted;
    a.out_rows.ptr = rows_of;
    a.out_rows.len = 4;
    memset(out, 0xAB, sizeof out);
    CHECK(kvt_engram_gather(e, &a, NULL) == KVT_BAD_INDICES && strstr(kvt_last_error(), "out_rows[3] = 4"),
          "an out row outside [0, n) is reported: %s", kvt_last_error());
    CHECK(out[3][0] == 0x3F80 && out[0][0] == 0xC000 && out[1][0] == 0 && out[2][0] == 0xABAB,
          "rows placed by out_rows, row 2 untouched: %04x %04x %04x %04x", out[0][0], out[1][0], out[2][0],
          out[3][0]);
    a.ids.ptr = ids;
    a.out_rows.ptr = NULL;
    a.out_rows.len = 0;
    a.dim = 24;
    CHECK(kvt_engram_gather(e, &a, NULL) == KVT_INVALID_ARGUMENT && strstr(kvt_last_error(), "dim"),
          "dim 24 is refused");
    a.dim = 32;
    a.out.len = 4 * 32 - 1;
    CHECK(kvt_engram_gather(e, &a, NULL) == KVT_INVALID_ARGUMENT && strstr(kvt_last_error(), "out"),
          "a short output is refused");
    a.out.len = 4 * 32;
    a.ids_type = 9;
    CHECK(kvt_engram_gather(e, &a, NULL) == KVT_INVALID_ARGUMENT, "an unknown index type is refused");
    CHECK(kvt_engram_gather(NULL, &a, NULL) == KVT_INVALID_ARGUMENT, "a null gatherer is refused");
    kvt_engram_destroy(e);
    kvt_engram_destroy(NULL);
}

int main(int argc, char **argv) {
    if (argc > 1 && strcmp(argv[1], "layout") == 0) {
        layout();
        return 0;
    }
    CHECK(kvt_abi_version() == KVT_ABI_VERSION, "ABI version %u", kvt_abi_version());
    CHECK(strlen(kvt_version()) > 0, "version %s", kvt_version());
    swap_in();
    tier();
    shared_region();
    tables();
    prefix_store();
    engram();
    printf("failures %d\n", failures);
    return failures == 0 ? 0 : 1;
}
