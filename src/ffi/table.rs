//! Read-mostly tables in the pool (`kvtier table`).

use std::ffi::{c_char, c_void};
use std::sync::Mutex;

use crate::error::{Error, Result, invalid};

use super::convert::*;
use super::handles::*;
use super::types::*;

/// # Safety
/// Pointers as `kvt_table_load` in `bindings/kvtier.h` describes them.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn kvt_table_load(
    path: *const c_char,
    key: *const c_char,
    data_bytes: u64,
    wait_ms: u32,
    out: *mut *mut KvtTableLoader,
) -> KvtStatus {
    guard(|| {
        // SAFETY: the header's contract for each pointer.
        let (path, key) = unsafe { (text_arg(path, "path")?, text_arg(key, "key")?) };
        if out.is_null() {
            return Err(invalid("out", "is a null pointer"));
        }
        let wait = std::time::Duration::from_millis(wait_ms as u64);
        let handle = match crate::table::load(std::path::Path::new(path), key, data_bytes, wait)? {
            crate::table::Load::Ready => std::ptr::null_mut(),
            crate::table::Load::Filling(l) => into_raw(KvtTableLoader {
                tag: KvtTableLoader::TAG,
                loader: Mutex::new(Some(l)),
            }),
        };
        // SAFETY: checked non-null above.
        unsafe { out.write(handle) };
        Ok(())
    })
}

pub(super) fn with_loader<R>(
    l: &KvtTableLoader,
    f: impl FnOnce(&mut crate::table::TableLoader) -> Result<R>,
) -> Result<R> {
    match lock(&l.loader).as_mut() {
        Some(t) => f(t),
        None => Err(invalid("loader", "was published already")),
    }
}

/// # Safety
/// Pointers as `kvt_table_loader_next_missing` in `bindings/kvtier.h`
/// describes them.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn kvt_table_loader_next_missing(
    loader: *const KvtTableLoader,
    from: u64,
    start: *mut u64,
    end: *mut u64,
) -> KvtStatus {
    guard(|| {
        // SAFETY: the header's contract.
        let l = unsafe { handle(loader, "loader")? };
        let r = with_loader(l, |t| {
            Ok(t.missing()
                .into_iter()
                .find(|r| r.end > from)
                .map(|r| r.start.max(from)..r.end))
        })?;
        let (a, b) = r.map_or((0, 0), |r| (r.start, r.end));
        // SAFETY: the header's contract.
        unsafe {
            write_out(start, "start", a)?;
            write_out(end, "end", b)
        }
    })
}

/// # Safety
/// Pointers as `kvt_table_loader_write` in `bindings/kvtier.h` describes them.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn kvt_table_loader_write(
    loader: *const KvtTableLoader,
    offset: u64,
    bytes: *const c_void,
    len: u64,
) -> KvtStatus {
    guard(|| {
        // SAFETY: the header's contract.
        let l = unsafe { handle(loader, "loader")? };
        if len > 0 && bytes.is_null() {
            return Err(invalid("bytes", "is a null pointer"));
        }
        let len = usize::try_from(len).map_err(|_| invalid("len", "larger than memory"))?;
        let data: &[u8] = if len == 0 {
            &[]
        } else {
            // SAFETY: `len` readable bytes at `bytes`, per the header.
            unsafe { std::slice::from_raw_parts(bytes as *const u8, len) }
        };
        with_loader(l, |t| t.write(offset, data))
    })
}

/// # Safety
/// `loader` as `kvt_table_loader_publish` in `bindings/kvtier.h` describes it.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn kvt_table_loader_publish(loader: *const KvtTableLoader) -> KvtStatus {
    guard(|| {
        // SAFETY: the header's contract.
        let l = unsafe { handle(loader, "loader")? };
        let mut slot = lock(&l.loader);
        let Some(t) = slot.as_ref() else {
            return Err(invalid("loader", "was published already"));
        };
        if !t.missing().is_empty() {
            // refused without giving up the load: write the rest and retry
            let bytes: u64 = t.missing().iter().map(|r| r.end - r.start).sum();
            return Err(Error::Pool(format!(
                "the table cannot be published: {bytes} B of it not written yet"
            )));
        }
        slot.take().expect("checked above").publish()
    })
}

/// # Safety
/// `loader` is null or a live `kvt_table_loader`; not used afterwards.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn kvt_table_loader_close(loader: *mut KvtTableLoader) {
    // SAFETY: the header's contract.
    unsafe { release(loader, "loader") }
}

/// # Safety
/// Pointers as `kvt_table_attach` in `bindings/kvtier.h` describes them.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn kvt_table_attach(
    path: *const c_char,
    key: *const c_char,
    wait_ms: u32,
    out: *mut *mut KvtTable,
) -> KvtStatus {
    guard(|| {
        // SAFETY: the header's contract for each pointer.
        let (path, key) = unsafe { (text_arg(path, "path")?, text_arg(key, "key")?) };
        let wait = std::time::Duration::from_millis(wait_ms as u64);
        // SAFETY: the header's contract.
        unsafe {
            put(out, || {
                Ok(KvtTable {
                    tag: KvtTable::TAG,
                    table: crate::table::Table::attach(std::path::Path::new(path), key, wait)?,
                })
            })
        }
    })
}

/// # Safety
/// Pointers as `kvt_table_data` in `bindings/kvtier.h` describes them.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn kvt_table_data(
    table: *const KvtTable,
    data: *mut *const c_void,
    len: *mut u64,
) -> KvtStatus {
    guard(|| {
        // SAFETY: the header's contract.
        let t = unsafe { handle(table, "table")? };
        let d = t.table.data();
        // SAFETY: the header's contract.
        unsafe {
            write_out(data, "data", d.as_ptr() as *const c_void)?;
            write_out(len, "len", d.len() as u64)
        }
    })
}

/// # Safety
/// `table` is null or a live `kvt_table`; not used afterwards.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn kvt_table_close(table: *mut KvtTable) {
    // SAFETY: the header's contract.
    unsafe { release(table, "table") }
}

/// # Safety
/// Pointers as `kvt_table_store_path` in `bindings/kvtier.h` describes them.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn kvt_table_store_path(
    dir: *const c_char,
    key: *const c_char,
    out: *mut c_char,
    capacity: usize,
    needed: *mut usize,
) -> KvtStatus {
    guard(|| {
        // SAFETY: the header's contract for each pointer.
        let (dir, key) = unsafe { (text_arg(dir, "dir")?, text_arg(key, "key")?) };
        let path = crate::table::TableStore::new(dir).path_of(key);
        let bytes = path.as_os_str().as_encoded_bytes();
        // SAFETY: the header's contract.
        unsafe { write_out(needed, "needed", bytes.len() + 1)? };
        if capacity < bytes.len() + 1 {
            return Err(invalid(
                "capacity",
                format!("{capacity} bytes; the path needs {}", bytes.len() + 1),
            ));
        }
        if out.is_null() {
            return Err(invalid("out", "is a null pointer"));
        }
        // SAFETY: `capacity` writable bytes at `out`, per the header.
        unsafe {
            std::ptr::copy_nonoverlapping(bytes.as_ptr(), out as *mut u8, bytes.len());
            *out.add(bytes.len()) = 0;
        }
        Ok(())
    })
}

/// # Safety
/// `path` as `kvt_table_destroy` in `bindings/kvtier.h` describes it.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn kvt_table_destroy(path: *const c_char) -> KvtStatus {
    guard(|| {
        // SAFETY: the header's contract.
        let path = unsafe { text_arg(path, "path")? };
        crate::table::destroy(std::path::Path::new(path))
    })
}
