//! A common view of the arrays a call takes: numpy arrays (read from the
//! array object itself, no Python calls) and torch tensors (through torch's
//! DLPack C exchange table, no Python call; from the DLPack capsule
//! `to_dlpack` makes where torch has no table, one call; through their
//! methods where it has neither). Anything else is refused.

use numpy::npyffi::flags::{NPY_ARRAY_C_CONTIGUOUS, NPY_ARRAY_WRITEABLE};
use numpy::{PyArrayDescrMethods, PyUntypedArray, PyUntypedArrayMethods};
use std::ffi::{c_int, c_void};
use std::sync::atomic::{AtomicPtr, AtomicU8, AtomicU64, Ordering};

use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::PyTuple;

use crate::refuse;

/// The element types the checks name; every other is `Other`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DType {
    I16,
    I32,
    I64,
    U8,
    /// numpy's uint16 (bf16 bits), torch's uint16.
    U16,
    /// torch's bfloat16.
    BF16,
    Other,
}

impl DType {
    pub fn name(self) -> &'static str {
        match self {
            DType::I16 => "int16",
            DType::I32 => "int32",
            DType::I64 => "int64",
            DType::U8 => "uint8",
            DType::U16 => "uint16",
            DType::BF16 => "bfloat16",
            DType::Other => "other",
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Device {
    Cpu,
    Cuda(i32),
}

impl Device {
    pub fn describe(self) -> String {
        match self {
            Device::Cpu => "cpu".into(),
            Device::Cuda(i) => format!("cuda:{i}"),
        }
    }
}

/// What a call needs to know of one argument. Shapes and strides beyond
/// the first two axes only enter `numel`, `span` and `contiguous`.
pub struct View<'a, 'py> {
    pub name: &'static str,
    pub obj: &'a Bound<'py, PyAny>,
    pub ptr: u64,
    pub ndim: usize,
    pub shape: [usize; 2],
    /// Elements between neighbours along the first two axes.
    pub strides: [usize; 2],
    pub numel: usize,
    /// Elements from the first to one past the last addressed one.
    pub span: usize,
    pub itemsize: usize,
    pub dtype: DType,
    pub device: Device,
    pub writable: bool,
    pub contiguous: bool,
}

impl<'a, 'py> View<'a, 'py> {
    /// A view of no axes yet (they are added one by one), writable, not
    /// contiguous until said otherwise.
    fn new(
        name: &'static str,
        obj: &'a Bound<'py, PyAny>,
        ptr: u64,
        ndim: usize,
        itemsize: usize,
        dtype: DType,
        device: Device,
    ) -> Self {
        View {
            name,
            obj,
            ptr,
            ndim,
            shape: [0; 2],
            strides: [0; 2],
            numel: 1,
            span: 1,
            itemsize,
            dtype,
            device,
            writable: true,
            contiguous: false,
        }
    }

    pub fn nbytes(&self) -> usize {
        self.numel * self.itemsize
    }

    /// The dtype's own name, for messages (numpy's `dtype.name`, torch's
    /// dtype without its `torch.` prefix).
    pub fn dtype_name(&self) -> String {
        if self.dtype != DType::Other {
            return self.dtype.name().into();
        }
        let dtype = match self.obj.getattr("dtype") {
            Ok(d) => d,
            Err(_) => return "?".into(),
        };
        let name = dtype
            .getattr("name")
            .and_then(|n| n.extract::<String>())
            .or_else(|_| dtype.str().map(|s| s.to_string()));
        name.unwrap_or_else(|_| "?".into())
            .trim_start_matches("torch.")
            .into()
    }

    pub fn shape_list(&self) -> String {
        match self.obj.getattr("shape").and_then(|s| s.str()) {
            Ok(s) => {
                let s = s.to_string();
                // "(4, 2)" / "torch.Size([4, 2])" -> "[4, 2]"
                let inner = s
                    .trim_start_matches("torch.Size(")
                    .trim_end_matches(')')
                    .trim_start_matches(['(', '['])
                    .trim_end_matches([']', ')'])
                    .trim_end_matches(',');
                format!("[{inner}]")
            }
            Err(_) => "?".into(),
        }
    }
}

/// The view of `obj` (argument `name`).
pub fn view<'a, 'py>(obj: &'a Bound<'py, PyAny>, name: &'static str) -> PyResult<View<'a, 'py>> {
    if let Ok(arr) = obj.cast::<PyUntypedArray>() {
        return numpy_view(obj, arr, name);
    }
    if let Some(tensor) = torch_tensor_type(obj.py())?
        && obj.is_instance(tensor.bind(obj.py()))?
    {
        return torch_view(obj, name, tensor.bind(obj.py()));
    }
    let type_name = obj
        .get_type()
        .name()
        .map(|n| n.to_string())
        .unwrap_or_default();
    Err(refuse(format!(
        "`{name}` is a {type_name}; pass a numpy array or a torch tensor"
    )))
}

fn numpy_view<'a, 'py>(
    obj: &'a Bound<'py, PyAny>,
    arr: &Bound<'py, PyUntypedArray>,
    name: &'static str,
) -> PyResult<View<'a, 'py>> {
    let descr = arr.dtype();
    if descr.has_object() {
        return Err(refuse(format!(
            "`{name}` holds Python objects (dtype {}); kvtier takes arrays of plain numbers",
            descr.str()?
        )));
    }
    if descr.is_native_byteorder() == Some(false) {
        return Err(refuse(format!(
            "`{name}` is {}, not in the machine's byte order",
            descr.getattr("str")?
        )));
    }
    let item = descr.itemsize();
    let dtype = match (descr.kind(), item) {
        (b'i', 2) => DType::I16,
        (b'i', 4) => DType::I32,
        (b'i', 8) => DType::I64,
        (b'u', 1) => DType::U8,
        (b'u', 2) => DType::U16,
        _ => DType::Other,
    };
    // SAFETY: `arr` is a live numpy array; its header fields are read as
    // numpy's C API defines them, while the GIL is held.
    let (data, nd, dims, strides, flags) = unsafe {
        let raw = &*arr.as_array_ptr();
        let nd = raw.nd as usize;
        (
            raw.data as u64,
            nd,
            std::slice::from_raw_parts(raw.dimensions, nd),
            std::slice::from_raw_parts(raw.strides, nd),
            raw.flags,
        )
    };
    let mut v = View::new(name, obj, data, nd, item, dtype, Device::Cpu);
    v.writable = flags & NPY_ARRAY_WRITEABLE != 0;
    v.contiguous = flags & NPY_ARRAY_C_CONTIGUOUS != 0;
    for (axis, (&n, &s)) in dims.iter().zip(strides).enumerate() {
        if item == 0 || s < 0 || !(s as usize).is_multiple_of(item) {
            let all: Vec<isize> = strides.to_vec();
            return Err(refuse(format!(
                "`{name}` has strides {} bytes, not non-negative multiples of {item}",
                tuple_text(&all)
            )));
        }
        add_axis(&mut v, axis, n as usize, s as usize / item);
    }
    finish(&mut v);
    Ok(v)
}

/// How plain torch tensors are read ([`TensorReader`]): the fastest this
/// torch offers unless a test asks for another.
static READER: AtomicU8 = AtomicU8::new(TensorReader::Auto as u8);

/// The ways a plain `torch.Tensor` can be read, fastest first.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u8)]
pub enum TensorReader {
    /// The exchange table where torch has one, else `to_dlpack`.
    Auto = 0,
    /// `torch.utils.dlpack.to_dlpack`: one Python call a tensor.
    ToDlpack = 1,
    /// The tensor's methods: eight Python calls a tensor.
    Methods = 2,
}

impl TensorReader {
    pub fn of_name(name: &str) -> Option<TensorReader> {
        match name {
            "auto" => Some(TensorReader::Auto),
            "to_dlpack" => Some(TensorReader::ToDlpack),
            "methods" => Some(TensorReader::Methods),
            _ => None,
        }
    }

    pub fn set(self) {
        READER.store(self as u8, Ordering::Relaxed);
    }

    fn current() -> TensorReader {
        match READER.load(Ordering::Relaxed) {
            1 => TensorReader::ToDlpack,
            2 => TensorReader::Methods,
            _ => TensorReader::Auto,
        }
    }
}

/// What a plain torch tensor is read through now: "exchange" (torch's C
/// exchange table), "to_dlpack" or "methods".
pub fn tensor_reader_in_use(py: Python<'_>) -> PyResult<&'static str> {
    Ok(match TensorReader::current() {
        TensorReader::Methods => "methods",
        TensorReader::ToDlpack => "to_dlpack",
        TensorReader::Auto => match torch_tensor_type(py)? {
            Some(t)
                if exchange_api(t.bind(py))
                    .and_then(|a| a.dltensor_from_py_object_no_sync)
                    .is_some() =>
            {
                "exchange"
            }
            _ => "to_dlpack",
        },
    })
}

/// A torch tensor's view. Reading it through its methods takes eight Python
/// calls a tensor (about 2.2 us on this project's CI machine, 13 tensors a
/// swap-in); its DLPack capsule (`torch.utils.dlpack.to_dlpack`) holds the
/// same facts and costs one (0.2-0.8 us); torch's DLPack C exchange table
/// (`torch.Tensor.__dlpack_c_exchange_api__`, the one tvm-ffi and so
/// SGLang's kernels read tensors through) fills them in with no Python call
/// and no allocation. Subclasses of torch.Tensor take the method path: they
/// may report other facts than their storage's (a subclass overriding
/// `device`, say). So does a tensor DLPack does not export (torch raises: a
/// meta tensor), or one on a device other than the CPU or CUDA, with the
/// method path's messages.
fn torch_view<'a, 'py>(
    obj: &'a Bound<'py, PyAny>,
    name: &'static str,
    tensor: &Bound<'py, PyAny>,
) -> PyResult<View<'a, 'py>> {
    if obj.get_type().is(tensor) {
        let read = match TensorReader::current() {
            TensorReader::Auto => {
                match exchange_api(tensor).and_then(|a| a.dltensor_from_py_object_no_sync) {
                    Some(f) => exchange_view(obj, name, f)?,
                    None => dlpack_view(obj, name)?,
                }
            }
            TensorReader::ToDlpack => dlpack_view(obj, name)?,
            TensorReader::Methods => None,
        };
        if let Some(v) = read {
            return Ok(v);
        }
    }
    torch_view_by_methods(obj, name)
}

// DLPack's C structs (dlpack.h: DLManagedTensor, the "dltensor" capsule's
// pointer, which torch's `to_dlpack` has made since DLPack 0.2; the
// exchange table of DLPack 1.x).
#[repr(C)]
struct DlDevice {
    device_type: i32,
    device_id: i32,
}
#[repr(C)]
struct DlDataType {
    code: u8,
    bits: u8,
    lanes: u16,
}
#[repr(C)]
struct DlTensor {
    data: *mut c_void,
    device: DlDevice,
    ndim: i32,
    dtype: DlDataType,
    shape: *const i64,
    strides: *const i64,
    byte_offset: u64,
}
#[repr(C)]
struct DlPackVersion {
    major: u32,
    minor: u32,
}
#[repr(C)]
struct ExchangeHeader {
    version: DlPackVersion,
    prev_api: *const ExchangeHeader,
}
/// DLPack 1.x's `DLPackExchangeAPI`: a table a framework keeps for the
/// process's lifetime. Fills a caller's DLTensor with no allocation, valid
/// until control returns to Python.
type FromPyObjectFn = unsafe extern "C" fn(*mut c_void, *mut DlTensor) -> c_int;
/// Writes the framework's current stream of a device (torch's current CUDA stream).
type CurrentStreamFn = unsafe extern "C" fn(c_int, i32, *mut *mut c_void) -> c_int;
#[repr(C)]
struct ExchangeApi {
    header: ExchangeHeader,
    managed_tensor_allocator: *const c_void,
    managed_tensor_from_py_object_no_sync: *const c_void,
    managed_tensor_to_py_object_no_sync: *const c_void,
    dltensor_from_py_object_no_sync: Option<FromPyObjectFn>,
    current_work_stream: Option<CurrentStreamFn>,
}
const DL_CPU: i32 = 1;
const DL_CUDA: i32 = 2;
const DL_INT: u8 = 0;
const DL_UINT: u8 = 1;
const DL_BFLOAT: u8 = 4;

/// The calls of the extension module so far ([`new_call`]), and the call
/// in which torch was last found to have no exchange table.
static CALLS: AtomicU64 = AtomicU64::new(0);
static NO_TABLE_IN_CALL: AtomicU64 = AtomicU64::new(u64::MAX);

/// Marks the start of a call of the extension module: torch's exchange
/// table, where it has none, is looked for again once per call, not once a
/// tensor (a failed attribute lookup costs what `to_dlpack` saves).
pub fn new_call() {
    CALLS.fetch_add(1, Ordering::Relaxed);
}

/// torch's exchange table, read from `torch.Tensor.__dlpack_c_exchange_api__`
/// (a "dlpack_exchange_api" capsule: torch's own from 2.10 on, or the one
/// tvm-ffi installs on older torch) and kept once found; None where there is
/// none (looked for again in the next call: tvm-ffi may install one later),
/// or where its DLPack major version is not 1 (none of its chain is).
fn exchange_api(tensor: &Bound<'_, PyAny>) -> Option<&'static ExchangeApi> {
    static API: AtomicPtr<ExchangeApi> = AtomicPtr::new(std::ptr::null_mut());
    let p = API.load(Ordering::Acquire);
    if !p.is_null() {
        // SAFETY: stored below from a table the framework keeps for the
        // process's lifetime.
        return Some(unsafe { &*p });
    }
    let call = CALLS.load(Ordering::Relaxed);
    if NO_TABLE_IN_CALL.load(Ordering::Relaxed) == call {
        return None;
    }
    let no_table = || {
        NO_TABLE_IN_CALL.store(call, Ordering::Relaxed);
        None
    };
    let Ok(capsule) = tensor.getattr(pyo3::intern!(tensor.py(), "__dlpack_c_exchange_api__"))
    else {
        return no_table();
    };
    // SAFETY: a "dlpack_exchange_api" capsule holds a DLPackExchangeAPI
    // pointer that stays valid for the process's lifetime (dlpack.h);
    // headers are walked through their prev_api chain until major 1.
    unsafe {
        let mut h =
            pyo3::ffi::PyCapsule_GetPointer(capsule.as_ptr(), c"dlpack_exchange_api".as_ptr())
                as *const ExchangeHeader;
        if h.is_null() {
            pyo3::ffi::PyErr_Clear();
            return no_table();
        }
        while !h.is_null() && (*h).version.major != 1 {
            h = (*h).prev_api;
        }
        if h.is_null() {
            return no_table();
        }
        API.store(h as *mut ExchangeApi, Ordering::Release);
        Some(&*(h as *const ExchangeApi))
    }
}

/// A plain tensor's view through the exchange table; None where torch
/// refuses it (the method path then gives the message).
fn exchange_view<'a, 'py>(
    obj: &'a Bound<'py, PyAny>,
    name: &'static str,
    from_py_object: FromPyObjectFn,
) -> PyResult<Option<View<'a, 'py>>> {
    let mut t = DlTensor {
        data: std::ptr::null_mut(),
        device: DlDevice {
            device_type: 0,
            device_id: 0,
        },
        ndim: 0,
        dtype: DlDataType {
            code: 0,
            bits: 0,
            lanes: 0,
        },
        shape: std::ptr::null(),
        strides: std::ptr::null(),
        byte_offset: 0,
    };
    // SAFETY: `obj` is a live torch.Tensor, the type the table was read
    // from; the function fills `t`, whose shape and strides stay valid
    // until control returns to Python: they are read into the view before.
    unsafe {
        if from_py_object(obj.as_ptr().cast(), &mut t) != 0 {
            pyo3::ffi::PyErr_Clear();
            return Ok(None);
        }
        view_of_dltensor(obj, name, &t)
    }
}

/// torch's current stream on CUDA device `gpu` through the exchange table,
/// None where torch has none or plain tensors are read another way (the
/// calls then look the stream up as they did before the table).
pub fn exchange_current_stream(py: Python<'_>, gpu: i32) -> PyResult<Option<usize>> {
    if TensorReader::current() != TensorReader::Auto {
        return Ok(None);
    }
    let Some(tensor) = torch_tensor_type(py)? else {
        return Ok(None);
    };
    let Some(f) = exchange_api(tensor.bind(py)).and_then(|a| a.current_work_stream) else {
        return Ok(None);
    };
    let mut stream: *mut c_void = std::ptr::null_mut();
    // SAFETY: the table's function, with the GIL held; it writes one pointer.
    if unsafe { f(DL_CUDA, gpu, &mut stream) } != 0 {
        return Err(PyErr::fetch(py));
    }
    Ok(Some(stream as usize))
}

fn dlpack_view<'a, 'py>(
    obj: &'a Bound<'py, PyAny>,
    name: &'static str,
) -> PyResult<Option<View<'a, 'py>>> {
    static TO_DLPACK: PyOnceLock<Py<PyAny>> = PyOnceLock::new();
    let py = obj.py();
    let to_dlpack = TO_DLPACK.get_or_try_init(py, || -> PyResult<_> {
        Ok(py
            .import("torch.utils.dlpack")?
            .getattr("to_dlpack")?
            .unbind())
    })?;
    let Ok(capsule) = to_dlpack.bind(py).call1((obj,)) else {
        return Ok(None); // (the method path gives the message)
    };
    // SAFETY: torch's to_dlpack returns a "dltensor" capsule holding a
    // DLManagedTensor, whose DLTensor comes first and whose shape and
    // strides arrays hold ndim values; all stay valid while the capsule
    // (which owns a reference to the tensor) lives, that is through this
    // block. Dropping the capsule unconsumed calls its deleter.
    unsafe {
        let p = pyo3::ffi::PyCapsule_GetPointer(capsule.as_ptr(), c"dltensor".as_ptr())
            as *const DlTensor;
        if p.is_null() {
            pyo3::ffi::PyErr_Clear();
            return Ok(None);
        }
        view_of_dltensor(obj, name, &*p)
    }
}

/// The view a DLTensor describes; None for what only the method path
/// describes right (a device other than the CPU or CUDA, sub-byte types, a
/// tensor without strides).
///
/// # Safety
/// `t`'s shape and strides arrays hold `t.ndim` values (or are null where
/// said), readable for this call.
unsafe fn view_of_dltensor<'a, 'py>(
    obj: &'a Bound<'py, PyAny>,
    name: &'static str,
    t: &DlTensor,
) -> PyResult<Option<View<'a, 'py>>> {
    let device = match t.device.device_type {
        DL_CPU => Device::Cpu,
        DL_CUDA => Device::Cuda(t.device.device_id),
        _ => return Ok(None),
    };
    if !t.dtype.bits.is_multiple_of(8) {
        return Ok(None); // (packed sub-byte types: torch's element_size says)
    }
    let nd = t.ndim.max(0) as usize;
    let dtype = match (t.dtype.code, t.dtype.bits, t.dtype.lanes) {
        (DL_INT, 16, 1) => DType::I16,
        (DL_INT, 32, 1) => DType::I32,
        (DL_INT, 64, 1) => DType::I64,
        (DL_UINT, 8, 1) => DType::U8,
        (DL_BFLOAT, 16, 1) => DType::BF16,
        _ => DType::Other,
    };
    let item = (t.dtype.bits as usize / 8) * t.dtype.lanes as usize;
    let ptr = (t.data as u64).wrapping_add(t.byte_offset);
    if nd > 0 && (t.shape.is_null() || t.strides.is_null()) {
        return Ok(None); // (a compact tensor without strides: not torch's)
    }
    // SAFETY: the caller's promise: ndim values each, non-null (above).
    let (dims, strides): (&[i64], &[i64]) = if nd == 0 {
        (&[], &[])
    } else {
        unsafe {
            (
                std::slice::from_raw_parts(t.shape, nd),
                std::slice::from_raw_parts(t.strides, nd),
            )
        }
    };
    let mut v = View::new(name, obj, ptr, nd, item, dtype, device);
    v.contiguous = c_contiguous(dims, strides);
    for (axis, (&n, &s)) in dims.iter().zip(strides).enumerate() {
        if s < 0 {
            return Err(refuse(format!("`{name}` has a negative stride")));
        }
        add_axis(&mut v, axis, n.max(0) as usize, s as usize);
    }
    finish(&mut v);
    Ok(Some(v))
}

/// torch's `is_contiguous()` from a shape and strides in elements: every
/// axis longer than one at the stride of the row-major layout; an empty
/// tensor is contiguous.
fn c_contiguous(dims: &[i64], strides: &[i64]) -> bool {
    if dims.contains(&0) {
        return true;
    }
    let mut expected = 1i64;
    for (&n, &s) in dims.iter().zip(strides).rev() {
        if n != 1 {
            if s != expected {
                return false;
            }
            expected = expected.saturating_mul(n);
        }
    }
    true
}

fn torch_view_by_methods<'a, 'py>(
    obj: &'a Bound<'py, PyAny>,
    name: &'static str,
) -> PyResult<View<'a, 'py>> {
    let py = obj.py();
    let device = if obj.getattr(pyo3::intern!(py, "is_cuda"))?.is_truthy()? {
        Device::Cuda(
            obj.call_method0(pyo3::intern!(py, "get_device"))?
                .extract()?,
        )
    } else if obj.getattr(pyo3::intern!(py, "is_cpu"))?.is_truthy()? {
        Device::Cpu
    } else {
        return Err(refuse(format!(
            "`{name}` is on device {}; kvtier takes CPU or CUDA tensors",
            obj.getattr("device")?.str()?
        )));
    };
    let item: usize = obj
        .call_method0(pyo3::intern!(py, "element_size"))?
        .extract()?;
    let dtype_obj = obj.getattr(pyo3::intern!(py, "dtype"))?;
    let dtype = torch_dtype(&dtype_obj)?;
    let shape = obj.getattr(pyo3::intern!(py, "shape"))?;
    let shape = shape.cast::<PyTuple>()?;
    let strides = obj.call_method0(pyo3::intern!(py, "stride"))?;
    let strides = strides.cast::<PyTuple>()?;
    let ptr = obj.call_method0(pyo3::intern!(py, "data_ptr"))?.extract()?;
    let mut v = View::new(name, obj, ptr, shape.len(), item, dtype, device);
    v.contiguous = obj
        .call_method0(pyo3::intern!(py, "is_contiguous"))?
        .is_truthy()?;
    for (axis, (n, s)) in shape.iter().zip(strides.iter()).enumerate() {
        let n: usize = n.extract()?;
        let s: isize = s.extract()?;
        if s < 0 {
            return Err(refuse(format!("`{name}` has a negative stride")));
        }
        add_axis(&mut v, axis, n, s as usize);
    }
    finish(&mut v);
    Ok(v)
}

fn add_axis(v: &mut View<'_, '_>, axis: usize, n: usize, stride: usize) {
    if axis < 2 {
        v.shape[axis] = n;
        v.strides[axis] = stride;
    }
    v.numel = v.numel.saturating_mul(n);
    v.span = v
        .span
        .saturating_add(n.saturating_sub(1).saturating_mul(stride));
}

fn finish(v: &mut View<'_, '_>) {
    if v.numel == 0 {
        v.span = 0;
    }
}

fn tuple_text(s: &[isize]) -> String {
    match s {
        [one] => format!("({one},)"),
        _ => format!(
            "({})",
            s.iter()
                .map(|x| x.to_string())
                .collect::<Vec<_>>()
                .join(", ")
        ),
    }
}

/// torch.Tensor, once torch has been imported (None before).
fn torch_tensor_type(py: Python<'_>) -> PyResult<Option<&'static Py<PyAny>>> {
    static TENSOR: PyOnceLock<Py<PyAny>> = PyOnceLock::new();
    if let Some(t) = TENSOR.get(py) {
        return Ok(Some(t));
    }
    let modules = py.import("sys")?.getattr("modules")?;
    let Ok(torch) = modules.get_item("torch") else {
        return Ok(None);
    };
    let tensor = torch.getattr("Tensor")?.unbind();
    Ok(Some(TENSOR.get_or_init(py, || tensor)))
}

/// The torch dtypes the checks name, by identity.
fn torch_dtype(d: &Bound<'_, PyAny>) -> PyResult<DType> {
    static DTYPES: PyOnceLock<[(Py<PyAny>, DType); 5]> = PyOnceLock::new();
    let py = d.py();
    let table = DTYPES.get_or_try_init(py, || -> PyResult<_> {
        let torch = py.import("torch")?;
        let get = |n: &str| torch.getattr(n).map(|x| x.unbind());
        Ok([
            (get("int16")?, DType::I16),
            (get("int32")?, DType::I32),
            (get("int64")?, DType::I64),
            (get("uint8")?, DType::U8),
            (get("bfloat16")?, DType::BF16),
        ])
    })?;
    Ok(table
        .iter()
        .find(|(t, _)| t.bind(py).is(d))
        .map(|(_, k)| *k)
        .unwrap_or(DType::Other))
}
