//! Prefix pages shared through shared memory (`kvtier::prefix_store`).

use std::ffi::c_char;

use crate::error::{Result, invalid};
use crate::prefix_store::{PrefixStore, SetOutcome};

use super::convert::*;
use super::handles::*;
use super::types::*;

/// The `n` keys packed at `keys` (`len` bytes): each key's bytes and a
/// NUL, back to back.
///
/// # Safety
/// A non-null `keys` must point to `len` readable bytes.
unsafe fn keys_arg<'a>(keys: *const c_char, len: usize, n: usize) -> Result<Vec<&'a [u8]>> {
    if n == 0 {
        return Ok(Vec::new());
    }
    if keys.is_null() {
        return Err(invalid("keys", "is a null pointer"));
    }
    // SAFETY: the caller's contract: `len` bytes.
    let bytes = unsafe { std::slice::from_raw_parts(keys as *const u8, len) };
    let Some(body) = bytes.strip_suffix(&[0]) else {
        return Err(invalid("keys", "does not end with a NUL"));
    };
    let keys: Vec<&[u8]> = body.split(|&b| b == 0).collect();
    if keys.len() != n {
        return Err(invalid(
            "keys",
            format!("holds {} NUL-terminated keys, not {n}", keys.len()),
        ));
    }
    Ok(keys)
}

/// Page `i`'s parts: `parts` addresses and lengths from `ptrs`/`lens`.
///
/// # Safety
/// Non-null `ptrs` and `lens` must each point to `n * parts` u64s.
unsafe fn parts_arg<'a>(
    ptrs: *const u64,
    lens: *const u64,
    n: usize,
    parts: usize,
) -> Result<(&'a [u64], &'a [u64])> {
    if n == 0 {
        return Ok((&[], &[]));
    }
    if parts == 0 || parts > 1 << 20 {
        return Err(invalid(
            "parts_per_page",
            format!("{parts} is not in 1..=2^20"),
        ));
    }
    let total = n
        .checked_mul(parts)
        .ok_or_else(|| invalid("parts_per_page", "times the keys overflows"))?;
    if ptrs.is_null() || lens.is_null() {
        return Err(invalid(
            if ptrs.is_null() { "ptrs" } else { "lens" },
            "is a null pointer",
        ));
    }
    // SAFETY: the caller's contract.
    let (p, l) = unsafe {
        (
            std::slice::from_raw_parts(ptrs, total),
            std::slice::from_raw_parts(lens, total),
        )
    };
    if let Some(i) = p.iter().position(|&a| a == 0) {
        return Err(invalid("ptrs", format!("part {i} is a null pointer")));
    }
    Ok((p, l))
}

/// # Safety
/// Pointers as `kvt_prefix_open` in `bindings/kvtier.h` describes them.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn kvt_prefix_open(
    path: *const c_char,
    namespace: *const c_char,
    page_bytes: u64,
    slots: u64,
    wait_ms: u32,
    out: *mut *mut KvtPrefixStore,
) -> KvtStatus {
    guard(|| {
        // SAFETY: the header's contract for each pointer.
        let (path, namespace) =
            unsafe { (text_arg(path, "path")?, text_arg(namespace, "namespace")?) };
        let wait = std::time::Duration::from_millis(wait_ms as u64);
        // SAFETY: the header's contract for `out`.
        unsafe {
            put(out, || {
                Ok(KvtPrefixStore {
                    tag: KvtPrefixStore::TAG,
                    store: PrefixStore::open_or_create(
                        std::path::Path::new(path),
                        namespace,
                        page_bytes,
                        slots,
                        wait,
                    )?,
                })
            })
        }
    })
}

/// # Safety
/// Pointers as `kvt_prefix_info` in `bindings/kvtier.h` describes them.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn kvt_prefix_info(
    store: *const KvtPrefixStore,
    page_bytes: *mut u64,
    slots: *mut u64,
    file_bytes: *mut u64,
) -> KvtStatus {
    guard(|| {
        // SAFETY: the header's contract.
        let s = unsafe { handle(store, "store")? };
        let info = s.store.info();
        // SAFETY: the header's contract.
        unsafe {
            write_out(page_bytes, "page_bytes", info.page_bytes)?;
            write_out(slots, "slots", info.slots)?;
            write_out(file_bytes, "file_bytes", info.file_bytes)
        }
    })
}

/// # Safety
/// Pointers as `kvt_prefix_hits` in `bindings/kvtier.h` describes them.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn kvt_prefix_hits(
    store: *const KvtPrefixStore,
    keys: *const c_char,
    keys_len: usize,
    n: usize,
    hits: *mut usize,
) -> KvtStatus {
    guard(|| {
        // SAFETY: the header's contract.
        let (s, keys) = unsafe { (handle(store, "store")?, keys_arg(keys, keys_len, n)?) };
        let found = s.store.prefix_len(&keys)?;
        // SAFETY: the header's contract.
        unsafe { write_out(hits, "hits", found) }
    })
}

/// What `kvt_prefix_get` and `kvt_prefix_set` share: their arguments
/// checked, then `page(key, parts)` for each key (each part's address made
/// a pointer by `ptr`), its byte written to `out[i]` (`out` named `out_name`
/// in errors).
///
/// # Safety
/// Pointers as `kvt_prefix_get` in `bindings/kvtier.h` describes them.
#[allow(clippy::too_many_arguments)]
unsafe fn each_page<P>(
    store: *const KvtPrefixStore,
    keys: *const c_char,
    keys_len: usize,
    n: usize,
    ptrs: *const u64,
    lens: *const u64,
    parts_per_page: usize,
    out: *mut u8,
    out_name: &'static str,
    ptr: fn(u64) -> P,
    page: impl Fn(&PrefixStore, &[u8], &[(P, usize)]) -> Result<u8>,
) -> KvtStatus {
    guard(|| {
        // SAFETY: the header's contract.
        let (s, keys, (ptrs, lens)) = unsafe {
            (
                handle(store, "store")?,
                keys_arg(keys, keys_len, n)?,
                parts_arg(ptrs, lens, n, parts_per_page)?,
            )
        };
        if n > 0 && out.is_null() {
            return Err(invalid(out_name, "is a null pointer"));
        }
        let mut parts = Vec::with_capacity(parts_per_page);
        for (i, key) in keys.iter().enumerate() {
            parts.clear();
            let at = i * parts_per_page;
            for j in at..at + parts_per_page {
                parts.push((ptr(ptrs[j]), size(lens[j], "lens")?));
            }
            let byte = page(&s.store, key, &parts)?;
            // SAFETY: the header's contract: `out` holds `n` bytes.
            unsafe { out.add(i).write(byte) };
        }
        Ok(())
    })
}

/// # Safety
/// Pointers as `kvt_prefix_get` in `bindings/kvtier.h` describes them.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn kvt_prefix_get(
    store: *const KvtPrefixStore,
    keys: *const c_char,
    keys_len: usize,
    n: usize,
    ptrs: *const u64,
    lens: *const u64,
    parts_per_page: usize,
    found: *mut u8,
) -> KvtStatus {
    // SAFETY: the header's contract, which each_page's is.
    unsafe {
        each_page(
            store,
            keys,
            keys_len,
            n,
            ptrs,
            lens,
            parts_per_page,
            found,
            "found",
            |p| p as *mut u8,
            // SAFETY: the header's contract: each part is writable memory
            // of its length.
            |s, key, parts| Ok(s.get_into(key, parts)? as u8),
        )
    }
}

/// # Safety
/// Pointers as `kvt_prefix_set` in `bindings/kvtier.h` describes them.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn kvt_prefix_set(
    store: *const KvtPrefixStore,
    keys: *const c_char,
    keys_len: usize,
    n: usize,
    ptrs: *const u64,
    lens: *const u64,
    parts_per_page: usize,
    outcome: *mut u8,
) -> KvtStatus {
    // SAFETY: the header's contract, which each_page's is.
    unsafe {
        each_page(
            store,
            keys,
            keys_len,
            n,
            ptrs,
            lens,
            parts_per_page,
            outcome,
            "outcome",
            |p| p as *const u8,
            |s, key, parts| {
                // SAFETY: the header's contract: each part is readable
                // memory of its length.
                Ok(match s.set_from(key, parts)? {
                    SetOutcome::Stored => KVT_PREFIX_STORED,
                    SetOutcome::Present => KVT_PREFIX_PRESENT,
                    SetOutcome::Full => KVT_PREFIX_FULL,
                })
            },
        )
    }
}

/// # Safety
/// Pointers as `kvt_prefix_counters` in `bindings/kvtier.h` describes them.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn kvt_prefix_counters(
    store: *const KvtPrefixStore,
    out: *mut u64,
    n: usize,
) -> KvtStatus {
    guard(|| {
        // SAFETY: the header's contract.
        let s = unsafe { handle(store, "store")? };
        let st = s.store.stats();
        let all = [
            st.sets,
            st.hits,
            st.misses,
            st.evictions,
            st.reclaimed,
            st.full,
            s.store.published(),
        ];
        if n > 0 && out.is_null() {
            return Err(invalid("out", "is a null pointer"));
        }
        for (i, v) in all.iter().take(n).enumerate() {
            // SAFETY: the header's contract: `out` holds `n` u64s.
            unsafe { out.add(i).write(*v) };
        }
        Ok(())
    })
}

/// # Safety
/// Pointers as `kvt_prefix_clear` in `bindings/kvtier.h` describes them.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn kvt_prefix_clear(
    store: *const KvtPrefixStore,
    evicted: *mut u64,
) -> KvtStatus {
    guard(|| {
        // SAFETY: the header's contract.
        let s = unsafe { handle(store, "store")? };
        let n = s.store.clear()?;
        if !evicted.is_null() {
            // SAFETY: the header's contract.
            unsafe { evicted.write(n) };
        }
        Ok(())
    })
}

/// # Safety
/// `store` is null or a live `kvt_prefix_store`; not used afterwards.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn kvt_prefix_close(store: *mut KvtPrefixStore) {
    // SAFETY: the header's contract.
    unsafe { release(store, "store") }
}
