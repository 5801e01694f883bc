//! Borrowed buffers that say where they live.
//!
//! The per-layer API takes the same argument types for both executors: a
//! [`Buf`] (read) or [`BufMut`] (written) is an address, a length in elements
//! and a [`Location`]. Host slices make host buffers safely; device buffers
//! come from [`crate::DeviceBuffer`] or, for memory an engine owns (a torch
//! tensor's `data_ptr()`), from the `unsafe` raw constructors.

use std::marker::PhantomData;

use crate::error::{Result, invalid};

/// Where a buffer's address is valid.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Location {
    /// Host memory, read and written by the CPU executor.
    Host,
    /// Memory a CUDA kernel can address: device memory, or host memory
    /// registered and mapped for the device.
    Device,
}

/// A read-only buffer of `len` elements of `T`.
#[derive(Clone, Copy, Debug)]
pub struct Buf<'a, T> {
    addr: u64,
    len: usize,
    loc: Location,
    _borrow: PhantomData<&'a [T]>,
}

impl<'a, T> Buf<'a, T> {
    /// A host buffer borrowed from a slice.
    pub fn host(slice: &'a [T]) -> Self {
        Buf {
            addr: slice.as_ptr() as u64,
            len: slice.len(),
            loc: Location::Host,
            _borrow: PhantomData,
        }
    }

    /// A device buffer at a raw CUDA device address.
    ///
    /// # Safety
    /// `addr` must be valid device-accessible memory (in the context of the
    /// CUDA executor it is used with) holding `len` elements of `T`, properly
    /// aligned, and it must stay valid and unwritten by others for `'a`, up to
    /// the completion of the work enqueued with it.
    pub unsafe fn device(addr: u64, len: usize) -> Self {
        Buf {
            addr,
            len,
            loc: Location::Device,
            _borrow: PhantomData,
        }
    }

    /// A buffer at a raw address that lives at `loc` (the C ABI's buffers).
    ///
    /// # Safety
    /// For [`Location::Device`], as for [`Buf::device`]; for
    /// [`Location::Host`], `addr` must point to `len` initialised, aligned
    /// elements of `T` in this process, valid and unwritten by others for `'a`.
    pub unsafe fn from_raw(addr: u64, len: usize, loc: Location) -> Self {
        Buf {
            addr,
            len,
            loc,
            _borrow: PhantomData,
        }
    }

    /// Address of element 0.
    pub fn addr(&self) -> u64 {
        self.addr
    }

    /// Length in elements.
    pub fn len(&self) -> usize {
        self.len
    }

    /// True when the buffer has no elements.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Where the buffer lives.
    pub fn location(&self) -> Location {
        self.loc
    }

    /// Checks it as argument `arg` of a call on `want` memory that reads
    /// `min_len` elements: location, element alignment, length.
    pub(crate) fn check(&self, arg: &'static str, want: Location, min_len: usize) -> Result<()> {
        self.check_aligned(arg, want, align_of::<T>() as u64, min_len)
    }

    /// [`Buf::check`] with a wider alignment than the element's (a kernel's
    /// vector loads).
    pub(crate) fn check_aligned(
        &self,
        arg: &'static str,
        want: Location,
        align: u64,
        min_len: usize,
    ) -> Result<()> {
        check_buf(arg, self.addr, self.len, self.loc, want, align, min_len)
    }
}

impl<'a, T> From<&'a [T]> for Buf<'a, T> {
    fn from(slice: &'a [T]) -> Self {
        Buf::host(slice)
    }
}

impl<'a, T> From<&'a Vec<T>> for Buf<'a, T> {
    fn from(v: &'a Vec<T>) -> Self {
        Buf::host(v)
    }
}

/// A writable buffer of `len` elements of `T`.
#[derive(Debug)]
pub struct BufMut<'a, T> {
    addr: u64,
    len: usize,
    loc: Location,
    _borrow: PhantomData<&'a mut [T]>,
}

impl<'a, T> BufMut<'a, T> {
    /// A host buffer borrowed from a mutable slice.
    pub fn host(slice: &'a mut [T]) -> Self {
        BufMut {
            addr: slice.as_mut_ptr() as u64,
            len: slice.len(),
            loc: Location::Host,
            _borrow: PhantomData,
        }
    }

    /// A writable device buffer at a raw CUDA device address.
    ///
    /// # Safety
    /// As for [`Buf::device`], and nothing else may read or write the memory
    /// until the work enqueued with it has completed.
    pub unsafe fn device(addr: u64, len: usize) -> Self {
        BufMut {
            addr,
            len,
            loc: Location::Device,
            _borrow: PhantomData,
        }
    }

    /// A writable buffer at a raw address that lives at `loc`.
    ///
    /// # Safety
    /// As for [`Buf::from_raw`], and nothing else may read or write the
    /// memory for `'a` (for device memory: until the enqueued work completes).
    pub unsafe fn from_raw(addr: u64, len: usize, loc: Location) -> Self {
        BufMut {
            addr,
            len,
            loc,
            _borrow: PhantomData,
        }
    }

    /// Address of element 0.
    pub fn addr(&self) -> u64 {
        self.addr
    }

    /// Length in elements.
    pub fn len(&self) -> usize {
        self.len
    }

    /// True when the buffer has no elements.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Where the buffer lives.
    pub fn location(&self) -> Location {
        self.loc
    }

    /// As [`Buf::check`], for a buffer the call writes.
    pub(crate) fn check(&self, arg: &'static str, want: Location, min_len: usize) -> Result<()> {
        self.as_buf().check(arg, want, min_len)
    }

    /// As [`Buf::check_aligned`], for a buffer the call writes.
    pub(crate) fn check_aligned(
        &self,
        arg: &'static str,
        want: Location,
        align: u64,
        min_len: usize,
    ) -> Result<()> {
        self.as_buf().check_aligned(arg, want, align, min_len)
    }

    /// The same memory, read-only.
    pub fn as_buf(&self) -> Buf<'_, T> {
        Buf {
            addr: self.addr,
            len: self.len,
            loc: self.loc,
            _borrow: PhantomData,
        }
    }
}

impl<'a, T> From<&'a mut [T]> for BufMut<'a, T> {
    fn from(slice: &'a mut [T]) -> Self {
        BufMut::host(slice)
    }
}

impl<'a, T> From<&'a mut Vec<T>> for BufMut<'a, T> {
    fn from(v: &'a mut Vec<T>) -> Self {
        BufMut::host(v)
    }
}

/// Checks one argument buffer of a call: where it lives, that its address is
/// aligned to `align` bytes, and that it holds at least `min_len` elements.
pub(crate) fn check_buf(
    arg: &'static str,
    addr: u64,
    len: usize,
    loc: Location,
    want: Location,
    align: u64,
    min_len: usize,
) -> Result<()> {
    if loc != want {
        let hint = match want {
            Location::Host => "the CPU executor reads host memory: pass a host slice",
            Location::Device => {
                "the CUDA executor reads device memory: pass a DeviceBuffer or a device pointer"
            }
        };
        return Err(invalid(arg, format!("is {loc:?} memory; {hint}")));
    }
    if min_len == 0 {
        // Nothing is read or written: an empty slice's dangling address is fine.
        return Ok(());
    }
    if addr == 0 {
        return Err(invalid(arg, "is a null pointer"));
    }
    if !addr.is_multiple_of(align) {
        return Err(invalid(
            arg,
            format!("address {addr:#x} is not {align}-byte aligned"),
        ));
    }
    if len < min_len {
        return Err(invalid(
            arg,
            format!("holds {len} elements; this call needs at least {min_len}"),
        ));
    }
    Ok(())
}
