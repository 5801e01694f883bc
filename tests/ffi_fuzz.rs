//! The C ABI on random and hostile arguments (fixed seeds, a fixed number of
//! cases): every call returns a status, never an internal error (a panic
//! caught at the boundary), and nothing crashes. Buffers point into
//! real allocations at least as long as they claim (the header's contract);
//! everything else is random: layouts, device strings, counts, strides (some
//! past anything real), batch sizes, index values, null pointers.

use std::ffi::{CString, c_char};
use std::ptr::{null, null_mut};

use kvtier::ffi::*;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

mod common;
use common::spec::{SpecCall, SpecCase};

fn device_string(rng: &mut StdRng, dir: &std::path::Path) -> CString {
    let s = match rng.random_range(0..12) {
        0 => format!("anon:{}", rng.random_range(1u64..64 << 20)),
        1 => "anon:4MiB".to_string(),
        2 => format!("numa:{}:4MiB", rng.random_range(0..3)),
        3 => format!("file:{}/f{}:4MiB", dir.display(), rng.random_range(0..4)),
        4 => format!("file:{}/f{}", dir.display(), rng.random_range(0..4)),
        5 => format!("dax:/dev/dax{}.0", rng.random_range(0..3)),
        6 => "anon:0".into(),
        7 => "anon:99999999999999999999".into(),
        8 => "tape:1GiB".into(),
        9 => format!(
            "file:{}/../{}:1MiB",
            dir.display(),
            "x".repeat(rng.random_range(0..300))
        ),
        10 => String::from_utf8_lossy(
            &(0..rng.random_range(0..40))
                .map(|_| rng.random_range(1u8..=255))
                .collect::<Vec<_>>(),
        )
        .into_owned(),
        _ => "numa:0+0:1MiB".into(),
    };
    CString::new(s.replace('\0', "")).unwrap()
}

fn layout(rng: &mut StdRng) -> KvtLayout {
    let pick = |rng: &mut StdRng, small: u32| match rng.random_range(0..4) {
        0 => 0,
        1 => u32::MAX - rng.random_range(0..8),
        _ => rng.random_range(1..small),
    };
    KvtLayout {
        entry_bytes: pick(rng, 1200) & !7 | if rng.random_bool(0.1) { 3 } else { 0 },
        layers: pick(rng, 8),
        tokens_per_region: pick(rng, 64),
    }
}

/// `good` for a shaped case; otherwise a small random value (often wrong) or,
/// one time in eight, one no buffer could span.
fn shaped_or(shaped: bool, good: u64, rng: &mut StdRng) -> u64 {
    if shaped {
        good
    } else if rng.random_bool(0.125) {
        huge(rng)
    } else {
        rng.random_range(0..16)
    }
}

/// A count or stride past anything real: products with it overflow.
fn huge(rng: &mut StdRng) -> u64 {
    [1 << 40, 1 << 62, u64::MAX / 2, u64::MAX][rng.random_range(0..4)]
}

/// `s`, which must not be `KVT_INTERNAL_ERROR`: bad input is refused or
/// reported, never a panic caught at the boundary.
fn not_internal(s: KvtStatus) -> KvtStatus {
    if s == KVT_INTERNAL_ERROR {
        // SAFETY: the thread's last error, a NUL-terminated string.
        let msg = unsafe { std::ffi::CStr::from_ptr(kvt_last_error()) };
        panic!("a call panicked: {}", msg.to_string_lossy());
    }
    s
}

#[test]
fn pool_calls_return_a_status_on_any_input() {
    let dir = std::env::temp_dir().join(format!("kvtier-ffi-fuzz-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let mut rng = StdRng::seed_from_u64(0xabc);
    for _ in 0..1500 {
        let devices: Vec<CString> = (0..rng.random_range(0..4))
            .map(|_| device_string(&mut rng, &dir))
            .collect();
        let mut ptrs: Vec<*const c_char> = devices.iter().map(|d| d.as_ptr()).collect();
        if rng.random_bool(0.05) && !ptrs.is_empty() {
            ptrs[0] = null();
        }
        let n = if rng.random_bool(0.05) {
            ptrs.len() + 20
        } else {
            ptrs.len()
        }
        .min(ptrs.len());
        let l = layout(&mut rng);
        let opts = KvtPoolOptions {
            rank: rng.random_range(0..4),
            ranks: rng.random_range(0..4),
            clients: if rng.random_bool(0.2) {
                rng.random()
            } else {
                rng.random_range(0..8)
            },
            register_flags: 0,
        };
        let opts_ptr = if rng.random_bool(0.3) {
            null()
        } else {
            &opts as *const _
        };
        let devs = if rng.random_bool(0.05) {
            null()
        } else {
            ptrs.as_ptr()
        };
        let mut pool: *mut KvtPool = null_mut();
        // SAFETY: every pointer is null or valid for what it claims.
        let s = not_internal(unsafe {
            match rng.random_range(0..3) {
                0 => kvt_pool_create(&l, devs, n, opts_ptr, &mut pool),
                1 => kvt_pool_open(devs, n, opts_ptr, &mut pool),
                _ => kvt_pool_open_or_create(&l, devs, n, opts_ptr, &mut pool),
            }
        });
        assert_eq!(s == KVT_OK, !pool.is_null());
        let mut bytes = 0u64;
        let mut cap = KvtDeviceCapacity {
            bytes: 0,
            host_dram: 0,
            pinnable: 0,
            movable_bytes: 0,
        };
        // SAFETY: as above.
        unsafe {
            not_internal(kvt_pool_device_bytes_for(&l, rng.random(), &mut bytes));
            if let Some(d) = devices.first() {
                not_internal(kvt_device_capacity_get(d.as_ptr(), &mut cap));
            }
            if !pool.is_null() {
                let mut info: KvtPoolInfo = std::mem::zeroed();
                not_internal(kvt_pool_info_get(pool, &mut info));
                let mut region: *mut KvtRegion = null_mut();
                if not_internal(kvt_region_alloc(pool, rng.random(), &mut region)) == KVT_OK {
                    let mut ri: KvtRegionInfo = std::mem::zeroed();
                    not_internal(kvt_region_info_get(region, &mut ri));
                    not_internal(kvt_region_publish(region));
                    not_internal(kvt_region_free(region));
                }
                kvt_pool_close(pool);
            }
        }
    }
    let _ = std::fs::remove_dir_all(dir);
}

#[test]
fn swap_in_calls_return_a_status_on_any_input() {
    let mut rng = StdRng::seed_from_u64(0xdef);
    let mut engine: *mut KvtSwapIn = null_mut();
    // SAFETY: an out pointer to a local.
    assert_eq!(
        unsafe { kvt_swap_in_create(KVT_EXECUTOR_CPU, &mut engine) },
        KVT_OK
    );
    // SAFETY: a live engine.
    assert_eq!(unsafe { kvt_swap_in_reserve(engine, 8, 64) }, KVT_OK);
    // SAFETY: a live engine.
    assert_eq!(unsafe { kvt_swap_in_enable_counters(engine, 4) }, KVT_OK);
    let value = |rng: &mut StdRng| -> i64 {
        match rng.random_range(0..8) {
            0 => -rng.random_range(1..100),
            1 => rng.random_range(0..1 << 40),
            _ => rng.random_range(0..24),
        }
    };
    let (mut ran, mut reported, mut refused) = (0, 0, 0);
    for _ in 0..3000 {
        // Half the cases are shaped to pass the argument checks, so that the
        // policy and the copies run on hostile values; the rest are random.
        let shaped = rng.random_bool(0.5);
        let batch = rng.random_range(0..5usize);
        let k = if shaped {
            rng.random_range(1..6u32)
        } else {
            rng.random_range(0..10)
        };
        let hot = if shaped {
            k + rng.random_range(0..4)
        } else {
            rng.random_range(0..12)
        };
        let requests = if shaped {
            rng.random_range(1..5u32)
        } else {
            rng.random_range(0..6)
        };
        let max_tokens = if shaped {
            rng.random_range(1..20u32)
        } else {
            rng.random_range(0..30)
        };
        let cells = 200;
        let fill32 =
            |rng: &mut StdRng| -> Vec<i32> { (0..cells).map(|_| value(rng) as i32).collect() };
        let (mut topk, mut tokens, mut locs, mut out, mut dst) = (
            fill32(&mut rng),
            fill32(&mut rng),
            fill32(&mut rng),
            fill32(&mut rng),
            fill32(&mut rng),
        );
        let mut lru: Vec<i16> = (0..cells).map(|_| value(&mut rng) as i16).collect();
        let mut host_locs: Vec<i64> = (0..cells).map(|_| value(&mut rng)).collect();
        let mut src: Vec<i64> = (0..cells).map(|_| value(&mut rng)).collect();
        let mut req: Vec<i64> = (0..batch).map(|_| value(&mut rng)).collect();
        let mut seq: Vec<i32> = (0..batch).map(|_| value(&mut rng) as i32).collect();
        let mut cnt: Vec<i32> = (0..batch.max(1)).map(|_| value(&mut rng) as i32).collect();
        let mut nr = vec![value(&mut rng) as i32];
        let item = if shaped {
            16
        } else {
            [8u32, 16, 64, 0, 7][rng.random_range(0..5)]
        };
        let mut host = vec![0u8; rng.random_range(0..2048)];
        let mut dev = vec![0u8; rng.random_range(0..2048)];
        let items = KvtItems {
            rows_per_page: if shaped || rng.random_bool(0.9) {
                1
            } else {
                rng.random_range(0..70)
            },
            value_bytes: item,
            scale_bytes: if shaped || rng.random_bool(0.9) {
                0
            } else {
                rng.random_range(0..16)
            },
            _reserved: 0,
            page_bytes: if shaped || rng.random_bool(0.9) {
                item as u64
            } else {
                rng.random_range(0..4096)
            },
        };
        let mut brng = StdRng::seed_from_u64(rng.random());
        let mut b = |mem_ptr: *mut std::ffi::c_void, mem_len: usize| -> KvtBuf {
            if shaped || brng.random_bool(0.8) {
                KvtBuf {
                    ptr: mem_ptr,
                    len: mem_len as u64,
                }
            } else if brng.random_bool(0.1) {
                KvtBuf {
                    ptr: null_mut(),
                    len: brng.random_range(0..4),
                }
            } else {
                KvtBuf {
                    ptr: mem_ptr,
                    len: brng.random_range(0..=mem_len) as u64,
                }
            }
        };
        macro_rules! b {
            ($v:expr) => {
                b($v.as_mut_ptr() as *mut std::ffi::c_void, $v.len())
            };
        }
        let empty = KvtBuf {
            ptr: null_mut(),
            len: 0,
        };
        let planned = rng.random_bool(0.3);
        let (ts, tok_s, loc_s, lru_s, host_s, out_s) = if shaped {
            (
                k as u64,
                hot as u64,
                hot as u64 + 1,
                hot as u64,
                max_tokens as u64,
                k as u64,
            )
        } else {
            let mut r = || shaped_or(false, 0, &mut rng);
            (r(), r(), r(), r(), r(), r())
        };
        let mut a = KvtSwapInArgs {
            top_k_tokens: b!(topk),
            top_k_stride: ts,
            device_buffer_tokens: b!(tokens),
            tokens_stride: tok_s,
            device_buffer_locs: b!(locs),
            locs_stride: loc_s,
            lru_slots: b!(lru),
            lru_stride: lru_s,
            host_cache_locs: b!(host_locs),
            host_stride: host_s,
            kv: KvtKvBuffers {
                items,
                host_cache: b!(host),
                device_buffer: b!(dev),
                host_cache_v: empty,
                device_buffer_v: empty,
            },
            top_k_device_locs: b!(out),
            out_stride: out_s,
            req_pool_indices: b!(req),
            seq_lens: b!(seq),
            num_real_reqs: if planned || rng.random_bool(0.5) {
                b!(nr)
            } else {
                empty
            },
            miss_src: if planned { b!(src) } else { empty },
            miss_dst: if planned { b!(dst) } else { empty },
            miss_count: if planned { b!(cnt) } else { empty },
            miss_stride: shaped_or(shaped, k as u64, &mut rng),
            miss_capacity: shaped_or(shaped, k as u64, &mut rng),
            req_pool_indices_type: if shaped {
                KVT_INDEX_INT64
            } else {
                rng.random_range(0..4)
            },
            seq_lens_type: KVT_INDEX_INT32,
            max_tokens,
            num_requests: requests,
            num_top_k: k,
            hot_buffer_size: hot,
            block_tokens: if shaped { 0 } else { rng.random_range(0..3) },
            skip_io: rng.random_range(0..2),
            // -1 (not counted), counted layers, and past them or below -1
            layer: if shaped { -1 } else { rng.random_range(-3..7) },
        };
        if shaped && rng.random_bool(0.2) {
            // One stride or count of an otherwise sound call past anything real.
            let fields = [
                &mut a.top_k_stride,
                &mut a.tokens_stride,
                &mut a.locs_stride,
                &mut a.lru_stride,
                &mut a.host_stride,
                &mut a.out_stride,
                &mut a.miss_stride,
                &mut a.miss_capacity,
            ];
            let i = rng.random_range(0..fields.len());
            *fields.into_iter().nth(i).unwrap() = huge(&mut rng);
        }
        // SAFETY: every buffer points into an allocation at least as long
        // as it claims; the engine is live.
        match not_internal(unsafe { kvt_swap_in_run(engine, &a, 0, null_mut()) }) {
            KVT_OK => ran += 1,
            KVT_BAD_INDICES => reported += 1,
            _ => refused += 1,
        }
        let p = KvtPlannedCopyArgs {
            miss_src: b!(src),
            miss_dst: b!(dst),
            miss_count: b!(cnt),
            miss_stride: shaped_or(shaped, k as u64, &mut rng),
            miss_capacity: shaped_or(shaped, k as u64, &mut rng),
            num_real_reqs: b!(nr),
            kv: KvtKvBuffers {
                items,
                host_cache: b!(host),
                device_buffer: b!(dev),
                host_cache_v: empty,
                device_buffer_v: empty,
            },
            warps: rng.random_range(0..64),
            skip_io: 0,
        };
        // SAFETY: as above.
        not_internal(unsafe { kvt_swap_in_copy_planned(engine, &p, null_mut()) });
    }
    eprintln!("{ran} ran, {reported} reported bad indices, {refused} refused");
    assert!(
        ran > 0 && reported > 0 && refused > 0,
        "{ran} ran, {reported} reported, {refused} refused"
    );
    // SAFETY: a live engine, not used afterwards.
    unsafe { kvt_swap_in_destroy(engine) };
}

/// The C arguments of `call` over `c` (what `SpecCase::args` is in Rust).
fn spec_c_args(c: &mut SpecCase, call: &mut SpecCall) -> KvtSpecSwapInArgs {
    fn b<T>(v: &mut [T]) -> KvtBuf {
        KvtBuf {
            ptr: v.as_mut_ptr() as *mut std::ffi::c_void,
            len: v.len() as u64,
        }
    }
    let empty = KvtBuf {
        ptr: null_mut(),
        len: 0,
    };
    let (slots, t) = ((c.hot + c.page) as u64, (c.steps * c.k) as u64);
    let item = 8 * c.words as u32;
    let bytes = |v: &mut Vec<u64>| KvtBuf {
        ptr: v.as_mut_ptr() as *mut std::ffi::c_void,
        len: 8 * v.len() as u64,
    };
    let (src, dst, count) = match call.plan.as_mut() {
        Some((src, dst, count)) => (b(src), b(dst), b(count)),
        None => (empty, empty, empty),
    };
    KvtSpecSwapInArgs {
        top_k_tokens: b(&mut call.topk),
        top_k_stride: t,
        device_buffer_tokens: b(&mut c.tokens),
        tokens_stride: slots,
        device_buffer_locs: b(&mut c.locs),
        locs_stride: slots,
        host_cache_locs: b(&mut c.host_locs),
        host_stride: c.seq_len as u64,
        kv: KvtKvBuffers {
            items: KvtItems {
                rows_per_page: 1,
                value_bytes: item,
                scale_bytes: 0,
                _reserved: 0,
                page_bytes: item as u64,
            },
            host_cache: bytes(&mut c.host),
            device_buffer: bytes(&mut c.device),
            host_cache_v: empty,
            device_buffer_v: empty,
        },
        top_k_device_locs: b(&mut call.out),
        out_stride: t,
        req_pool_indices: b(&mut call.req),
        seq_lens: b(&mut call.seq),
        num_real_reqs: b(&mut call.num_real),
        miss_src: src,
        miss_dst: dst,
        miss_count: count,
        miss_stride: t,
        miss_capacity: t,
        state: KvtSpecState {
            cache_index: b(&mut c.cache_index),
            index_rows: c.reqs as u64,
            index_stride: 2 * c.hash_size as u64,
            bank_stride: c.hash_size as u64,
            hash_size: c.hash_size as u64,
            cache_policy: b(&mut c.cache_policy),
            policy_rows: c.reqs as u64 + 1,
            policy_stride: c.hot as u64,
            policy_width: c.hot as u64,
            scratch_locs: b(&mut c.scratch_locs),
            scratch_stride: c.scratch as u64,
            scratch_capacity: c.scratch as u64,
            scratch_state: b(&mut c.scratch_state),
            state_rows: c.reqs as u64 + 1,
            state_stride: c.state_width as u64,
            state_width: c.state_width as u64,
        },
        req_pool_indices_type: KVT_INDEX_INT64,
        seq_lens_type: KVT_INDEX_INT32,
        max_tokens: c.seq_len as u32,
        num_requests: c.reqs as u32,
        num_steps: c.steps as u32,
        num_top_k: c.k as u32,
        hot_buffer_size: c.hot as u32,
        page_size: c.page as u32,
    }
}

#[test]
fn spec_calls_return_a_status_on_any_input() {
    let mut rng = StdRng::seed_from_u64(0x5bec);
    let mut engine: *mut KvtSwapIn = null_mut();
    // SAFETY: an out pointer to a local.
    assert_eq!(
        unsafe { kvt_swap_in_create(KVT_EXECUTOR_CPU, &mut engine) },
        KVT_OK
    );
    let (reqs, hot, page, scratch, seq_len, steps, k) = (3, 1024, 8, 1024, 4096, 2, 1024);
    let pristine = SpecCase::new(reqs, hot, page, scratch, seq_len, 1, steps, k);
    let (mut ran, mut reported, mut refused) = (0, 0, 0);
    for _ in 0..1000 {
        let mut c = pristine.clone();
        // Half the calls hostile in their values: tokens out of range, a few
        // state cells rewritten.
        let hostile = rng.random_bool(0.5);
        let batch = rng.random_range(1..=2usize);
        let tokens = if hostile {
            -2..seq_len as i32 + 64
        } else {
            -1..seq_len as i32
        };
        let topk = (0..batch * steps * k)
            .map(|_| rng.random_range(tokens.clone()))
            .collect();
        let mut call = SpecCall::new(topk, batch, steps, seq_len as i32, rng.random_bool(0.3));
        for _ in 0..if hostile { rng.random_range(0..4) } else { 0 } {
            let v = rng.random_range(-3..1 << 20);
            match rng.random_range(0..6) {
                0 => *pick(&mut c.cache_index, &mut rng) = (v as i64) << rng.random_range(0..33),
                1 => *pick(&mut c.cache_policy, &mut rng) = v,
                2 => *pick(&mut c.scratch_locs, &mut rng) = v,
                3 => *pick(&mut c.scratch_state, &mut rng) = v,
                4 => *pick(&mut c.locs, &mut rng) = v,
                _ => *pick(&mut call.seq, &mut rng) = v,
            }
        }
        let mut a = spec_c_args(&mut c, &mut call);
        // Up to three fields of the call hostile: a count or stride (small,
        // off by one, or past anything real), a buffer shorter than it
        // should be or null.
        for _ in 0..rng.random_range(0..=3) {
            let st = &mut a.state;
            let u64s = [
                &mut a.top_k_stride,
                &mut a.tokens_stride,
                &mut a.locs_stride,
                &mut a.host_stride,
                &mut a.out_stride,
                &mut a.miss_stride,
                &mut a.miss_capacity,
                &mut a.kv.items.page_bytes,
                &mut st.index_rows,
                &mut st.index_stride,
                &mut st.bank_stride,
                &mut st.hash_size,
                &mut st.policy_rows,
                &mut st.policy_stride,
                &mut st.policy_width,
                &mut st.scratch_stride,
                &mut st.scratch_capacity,
                &mut st.state_rows,
                &mut st.state_stride,
                &mut st.state_width,
            ];
            let u32s = [
                &mut a.req_pool_indices_type,
                &mut a.seq_lens_type,
                &mut a.max_tokens,
                &mut a.num_requests,
                &mut a.num_steps,
                &mut a.num_top_k,
                &mut a.hot_buffer_size,
                &mut a.page_size,
                &mut a.kv.items.rows_per_page,
                &mut a.kv.items.value_bytes,
                &mut a.kv.items.scale_bytes,
            ];
            let bufs = [
                &mut a.top_k_tokens,
                &mut a.device_buffer_tokens,
                &mut a.device_buffer_locs,
                &mut a.host_cache_locs,
                &mut a.kv.host_cache,
                &mut a.kv.device_buffer,
                &mut a.top_k_device_locs,
                &mut a.req_pool_indices,
                &mut a.seq_lens,
                &mut a.num_real_reqs,
                &mut a.miss_src,
                &mut a.miss_dst,
                &mut a.miss_count,
                &mut st.cache_index,
                &mut st.cache_policy,
                &mut st.scratch_locs,
                &mut st.scratch_state,
            ];
            match rng.random_range(0..3) {
                0 => {
                    let f = u64s.into_iter().nth(rng.random_range(0..20)).unwrap();
                    *f = match rng.random_range(0..4) {
                        0 => huge(&mut rng),
                        1 => f.wrapping_add(1),
                        2 => f.wrapping_sub(1),
                        _ => rng.random_range(0..16),
                    };
                }
                1 => {
                    let f = u32s.into_iter().nth(rng.random_range(0..11)).unwrap();
                    *f = match rng.random_range(0..4) {
                        0 => u32::MAX >> rng.random_range(0..8),
                        1 => f.wrapping_add(1),
                        2 => f.wrapping_sub(1),
                        _ => rng.random_range(0..16),
                    };
                }
                _ => {
                    // Never longer than the allocation behind it (the
                    // header's contract): shorter, or null.
                    let f = bufs.into_iter().nth(rng.random_range(0..17)).unwrap();
                    if rng.random_bool(0.2) {
                        f.ptr = null_mut();
                    }
                    f.len = rng.random_range(0..=f.len);
                }
            }
        }
        // SAFETY: every buffer points into an allocation at least as long
        // as it claims; the engine is live.
        match not_internal(unsafe { kvt_swap_in_run_spec(engine, &a, null_mut()) }) {
            KVT_OK => ran += 1,
            KVT_BAD_INDICES => reported += 1,
            _ => refused += 1,
        }
    }
    eprintln!("{ran} ran, {reported} reported bad indices, {refused} refused");
    assert!(
        ran > 0 && reported > 0 && refused > 0,
        "{ran} ran, {reported} reported, {refused} refused"
    );
    // SAFETY: a live engine, not used afterwards.
    unsafe { kvt_swap_in_destroy(engine) };
}

fn pick<'a, T>(v: &'a mut [T], rng: &mut StdRng) -> &'a mut T {
    let i = rng.random_range(0..v.len());
    &mut v[i]
}
