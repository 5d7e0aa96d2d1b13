//! A kernel call's context, a kernel's creation info, and a node's shape-inference context.

use core::ffi::{c_char, c_void};
use core::marker::PhantomData;
use std::ffi::{CStr, CString};

use ort_sys as sys;

use super::tensor::{elem_size, DType, Tensor};
use super::Api;
use crate::error::{Error, Result};

/// Reads dtype and shape of a value's type-and-shape info, then releases it if `owned`.
///
/// # Safety
/// `info` must be a valid `OrtTensorTypeAndShapeInfo` of this runtime.
unsafe fn read_info(
    api: Api,
    op: &'static str,
    info: *mut sys::OrtTensorTypeAndShapeInfo,
    owned: bool,
) -> Result<(DType, Vec<i64>)> {
    let raw = api.raw();
    let mut ty: i32 = 0;
    let mut rank = 0usize;
    // SAFETY: `info` is valid (caller); the element type is written as a C enum, which is an
    // `int`, so an `i32` receives it without assuming which values our bindings know.
    let s = unsafe { (raw.GetTensorElementType)(info, (&raw mut ty).cast()) };
    let result = api.check(op, "GetTensorElementType", s).and_then(|()| {
        // SAFETY: valid info, `rank` is a valid out pointer.
        api.check(op, "GetDimensionsCount", unsafe { (raw.GetDimensionsCount)(info, &mut rank) })?;
        let mut shape = vec![0i64; rank];
        // SAFETY: `shape` has room for exactly `rank` dimensions.
        api.check(op, "GetDimensions", unsafe { (raw.GetDimensions)(info, shape.as_mut_ptr(), rank) })?;
        Ok((DType::from_raw(ty), shape))
    });
    if owned {
        // SAFETY: we own this info (it came from GetTensorTypeAndShape) and release it once.
        unsafe { (raw.ReleaseTensorTypeAndShapeInfo)(info) };
    }
    result
}

/// Number of elements of a shape; `None` when a dimension is negative (unknown) or the
/// product overflows. A zero dimension makes the count 0 whatever the others are (the
/// order of the dimensions does not matter: found by fuzzing).
pub fn numel(shape: &[i64]) -> Option<usize> {
    if shape.iter().any(|&d| d < 0) {
        return None;
    }
    if shape.contains(&0) {
        return Some(0);
    }
    shape.iter().try_fold(1usize, |n, &d| usize::try_from(d).ok().and_then(|d| n.checked_mul(d)))
}

/// The name [`ShapeInfer::set_output`] gives unknown dimension `dim` of output `output` at
/// its `call`-th call: unique per call, so per node.
fn unknown_dim_name(op: &str, call: u64, output: usize, dim: usize) -> String {
    format!("{op}_{call}_out{output}_dim{dim}")
}

/// The context of one kernel call.
pub struct Context<'a> {
    api: Api,
    op: &'static str,
    ctx: *mut sys::OrtKernelContext,
    _call: PhantomData<&'a mut sys::OrtKernelContext>,
}

impl Context<'_> {
    /// Wraps the context of the current call.
    ///
    /// # Safety
    /// `ctx` must be the valid context of a call in progress, used only during it.
    pub unsafe fn new(api: Api, op: &'static str, ctx: *mut sys::OrtKernelContext) -> Self {
        Self { api, op, ctx, _call: PhantomData }
    }

    /// The API table.
    pub fn api(&self) -> Api {
        self.api
    }

    /// The raw context, for [`super::pool::OrtPool`].
    pub(crate) fn raw(&self) -> *mut sys::OrtKernelContext {
        self.ctx
    }

    /// The CUDA execution provider's compute stream for this call (`cudaStream_t`; null on
    /// other providers).
    pub fn gpu_stream(&self) -> Result<*mut core::ffi::c_void> {
        let mut stream: *mut core::ffi::c_void = core::ptr::null_mut();
        // SAFETY: valid context for this call; `stream` is a valid out pointer.
        let s = unsafe { (self.api.raw().KernelContext_GetGPUComputeStream)(self.ctx, &mut stream) };
        self.api.check(self.op, "KernelContext_GetGPUComputeStream", s).map(|()| stream)
    }

    /// The device id of input `index`'s memory (0 for host memory).
    pub fn input_device_id(&self, index: usize) -> Result<u32> {
        let raw = self.api.raw();
        let mut value: *const sys::OrtValue = core::ptr::null();
        // SAFETY: valid context; `value` is a valid out pointer.
        let s = unsafe { (raw.KernelContext_GetInput)(self.ctx, index, &mut value) };
        self.api.check(self.op, "KernelContext_GetInput", s)?;
        // SAFETY: the runtime's input value for this call (or null).
        unsafe { self.device_id_of(value) }
    }

    /// The device id of output `index`'s memory, once allocated with `shape` (asking again
    /// returns the value already made).
    pub fn output_device_id(&self, index: usize, shape: &[i64]) -> Result<u32> {
        let raw = self.api.raw();
        let mut value: *mut sys::OrtValue = core::ptr::null_mut();
        // SAFETY: valid context; `shape` is valid for its length; `value` is an out pointer.
        let s = unsafe { (raw.KernelContext_GetOutput)(self.ctx, index, shape.as_ptr(), shape.len(), &mut value) };
        self.api.check(self.op, "KernelContext_GetOutput", s)?;
        // SAFETY: the runtime's output value for this call (or null).
        unsafe { self.device_id_of(value) }
    }

    /// # Safety
    /// `value` is null or a value of this call.
    unsafe fn device_id_of(&self, value: *const sys::OrtValue) -> Result<u32> {
        let raw = self.api.raw();
        if value.is_null() {
            return Ok(0);
        }
        let mut info: *const sys::OrtMemoryInfo = core::ptr::null();
        let mut id: core::ffi::c_int = 0;
        // SAFETY: the runtime's input value for this call; the memory info it returns is owned
        // by the value and only read here.
        unsafe {
            self.api.check(self.op, "GetTensorMemoryInfo", (raw.GetTensorMemoryInfo)(value, &mut info))?;
            self.api.check(self.op, "MemoryInfoGetId", (raw.MemoryInfoGetId)(info, &mut id))?;
        }
        Ok(u32::try_from(id).unwrap_or(0))
    }

    /// Number of inputs of the node.
    pub fn input_count(&self) -> Result<usize> {
        let mut n = 0;
        // SAFETY: valid context for this call; `n` is a valid out pointer.
        let s = unsafe { (self.api.raw().KernelContext_GetInputCount)(self.ctx, &mut n) };
        self.api.check(self.op, "KernelContext_GetInputCount", s).map(|()| n)
    }

    /// Number of outputs of the node.
    pub fn output_count(&self) -> Result<usize> {
        let mut n = 0;
        // SAFETY: as in `input_count`.
        let s = unsafe { (self.api.raw().KernelContext_GetOutputCount)(self.ctx, &mut n) };
        self.api.check(self.op, "KernelContext_GetOutputCount", s).map(|()| n)
    }

    /// Input `index`, or `None` when an optional input is absent.
    pub fn input(&self, index: usize) -> Result<Option<Tensor>> {
        let raw = self.api.raw();
        let mut value: *const sys::OrtValue = core::ptr::null();
        // SAFETY: valid context; `value` is a valid out pointer.
        let s = unsafe { (raw.KernelContext_GetInput)(self.ctx, index, &mut value) };
        self.api.check(self.op, "KernelContext_GetInput", s)?;
        if value.is_null() {
            return Ok(None);
        }
        // SAFETY: `value` is the runtime's input value for this call.
        unsafe { self.tensor_of(value as *mut sys::OrtValue) }.map(Some)
    }

    /// Allocates (or fetches the caller-bound buffer of) output `index` with `shape`.
    pub fn output(&mut self, index: usize, shape: &[i64]) -> Result<Tensor> {
        self.output_opt(index, shape)?.ok_or_else(|| Error::Runtime {
            op: self.op,
            call: "KernelContext_GetOutput",
            message: format!("no value for output {index}"),
        })
    }

    /// Like [`Context::output`], but `None` for an optional output that the node leaves out
    /// (named ""), for which the runtime gives no value.
    pub fn output_opt(&mut self, index: usize, shape: &[i64]) -> Result<Option<Tensor>> {
        let raw = self.api.raw();
        let mut value: *mut sys::OrtValue = core::ptr::null_mut();
        // SAFETY: valid context; `shape` is valid for its length; `value` is an out pointer.
        let s = unsafe { (raw.KernelContext_GetOutput)(self.ctx, index, shape.as_ptr(), shape.len(), &mut value) };
        self.api.check(self.op, "KernelContext_GetOutput", s)?;
        if value.is_null() {
            return Ok(None);
        }
        // SAFETY: `value` is the runtime's output value for this call.
        unsafe { self.tensor_of(value) }.map(Some)
    }

    /// # Safety
    /// `value` must be a valid tensor value of this call.
    unsafe fn tensor_of(&self, value: *mut sys::OrtValue) -> Result<Tensor> {
        let raw = self.api.raw();
        let mut info: *mut sys::OrtTensorTypeAndShapeInfo = core::ptr::null_mut();
        // SAFETY: valid value (caller); `info` is an out pointer, released by `read_info`.
        let s = unsafe { (raw.GetTensorTypeAndShape)(value, &mut info) };
        self.api.check(self.op, "GetTensorTypeAndShape", s)?;
        // SAFETY: `info` was just returned by the runtime and is ours to release.
        let (dtype, shape) = unsafe { read_info(self.api, self.op, info, true) }?;
        let mut ptr: *mut c_void = core::ptr::null_mut();
        // SAFETY: valid value; `ptr` is an out pointer.
        let s = unsafe { (raw.GetTensorMutableData)(value, &mut ptr) };
        self.api.check(self.op, "GetTensorMutableData", s)?;
        let numel = numel(&shape).ok_or_else(|| Error::Runtime {
            op: self.op,
            call: "GetDimensions",
            message: format!("tensor of shape {shape:?} has no valid element count"),
        })?;
        Ok(Tensor { dtype, shape, numel, ptr, elem_size: elem_size(dtype) })
    }
}

/// What a kernel may read when it is created: its node's attributes.
pub struct KernelInfo<'a> {
    api: Api,
    op: &'static str,
    info: *const sys::OrtKernelInfo,
    _node: PhantomData<&'a sys::OrtKernelInfo>,
}

impl KernelInfo<'_> {
    /// # Safety
    /// `info` must be valid for the duration of kernel creation, and so must this value.
    pub unsafe fn new(api: Api, op: &'static str, info: *const sys::OrtKernelInfo) -> Self {
        Self { api, op, info, _node: PhantomData }
    }

    /// Whether the node has attribute `name` of some type other than `except` (`"float"`,
    /// `"int"`, `"string"` or `"ints"`), and which.
    ///
    /// The runtime's scalar getters check the attribute's type, its list getters do not:
    /// they succeed for any attribute the node has and return that type's list, empty when
    /// the attribute is of another type. So a non-empty list tells its type, a tensor is
    /// asked for directly, and anything else that exists (an empty list, a list of strings,
    /// a graph) is "a list, tensor or graph" - except for a list-of-ints reader, for which an
    /// empty list of any type reads as an empty list of ints.
    fn present_as_other(&self, name: &CString, except: &str) -> Option<&'static str> {
        let raw = self.api.raw();
        let ok = |s: sys::OrtStatusPtr| self.api.check(self.op, "KernelInfoGetAttribute", s).is_ok();
        let (mut f, mut i, mut size) = (0f32, 0i64, 0usize);
        // SAFETY: valid info and name; each out pointer is valid; with a null buffer the
        // string getter only reports the size.
        let scalar = unsafe {
            if except != "float" && ok((raw.KernelInfoGetAttribute_float)(self.info, name.as_ptr(), &mut f)) {
                Some("a float")
            } else if except != "int" && ok((raw.KernelInfoGetAttribute_int64)(self.info, name.as_ptr(), &mut i)) {
                Some("an int")
            } else if except != "string"
                && ok((raw.KernelInfoGetAttribute_string)(self.info, name.as_ptr(), core::ptr::null_mut(), &mut size))
            {
                Some("a string")
            } else {
                None
            }
        };
        if scalar.is_some() {
            return scalar;
        }
        if self.is_tensor(name) {
            return Some("a tensor");
        }
        let (mut floats, mut ints) = (0usize, 0usize);
        // SAFETY: valid info and name; with a null buffer the array getters only report the
        // number of elements.
        let exists = unsafe {
            ok((raw.KernelInfoGetAttributeArray_float)(self.info, name.as_ptr(), core::ptr::null_mut(), &mut floats))
                && ok((raw.KernelInfoGetAttributeArray_int64)(
                    self.info,
                    name.as_ptr(),
                    core::ptr::null_mut(),
                    &mut ints,
                ))
        };
        match (exists, except) {
            (false, _) => None,
            (true, _) if floats > 0 => Some("a list of floats"),
            (true, "ints") => None,
            (true, _) if ints > 0 => Some("a list of ints"),
            (true, _) => Some("a list, tensor or graph"),
        }
    }

    /// Whether attribute `name` is a tensor (the runtime unpacks it to tell).
    fn is_tensor(&self, name: &CString) -> bool {
        let raw = self.api.raw();
        let mut allocator: *mut sys::OrtAllocator = core::ptr::null_mut();
        // SAFETY: a valid out pointer; the default allocator is owned by the runtime.
        let s = unsafe { (raw.GetAllocatorWithDefaultOptions)(&mut allocator) };
        if self.api.check(self.op, "GetAllocatorWithDefaultOptions", s).is_err() || allocator.is_null() {
            return false;
        }
        let mut value: *mut sys::OrtValue = core::ptr::null_mut();
        // SAFETY: valid info, name and allocator; `value` is an out pointer that we release.
        let s = unsafe { (raw.KernelInfoGetAttribute_tensor)(self.info, name.as_ptr(), allocator, &mut value) };
        let found = self.api.check(self.op, "KernelInfoGetAttribute_tensor", s).is_ok();
        if !value.is_null() {
            // SAFETY: the runtime created this value for us; it is released once.
            unsafe { (raw.ReleaseValue)(value) };
        }
        found
    }

    fn wrong_type(&self, name: &'static str, expected: &str, got: &str) -> Error {
        Error::Attribute { op: self.op, name, what: format!("expected {expected} attribute, got {got} attribute") }
    }

    /// Float attribute `name`, or `default` when the node does not set it; an attribute of
    /// another type is an error (the runtime itself does not check custom ops' attributes).
    pub fn f32_or(&self, name: &'static str, default: f32) -> Result<f32> {
        self.f32_opt(name).map(|v| v.unwrap_or(default))
    }

    /// Float attribute `name`, `None` when absent.
    pub fn f32_opt(&self, name: &'static str) -> Result<Option<f32>> {
        let cname = CString::new(name).expect("attribute names have no NUL");
        let mut v = 0f32;
        // SAFETY: valid info and name; `v` is a valid out pointer.
        let s = unsafe { (self.api.raw().KernelInfoGetAttribute_float)(self.info, cname.as_ptr(), &mut v) };
        if self.api.check(self.op, "KernelInfoGetAttribute_float", s).is_ok() {
            return Ok(Some(v));
        }
        match self.present_as_other(&cname, "float") {
            Some(got) => Err(self.wrong_type(name, "a float", got)),
            None => Ok(None),
        }
    }

    /// Int attribute `name`, `None` when absent.
    pub fn i64_opt(&self, name: &'static str) -> Result<Option<i64>> {
        let cname = CString::new(name).expect("attribute names have no NUL");
        let mut v = 0i64;
        // SAFETY: valid info and name; `v` is a valid out pointer.
        let s = unsafe { (self.api.raw().KernelInfoGetAttribute_int64)(self.info, cname.as_ptr(), &mut v) };
        if self.api.check(self.op, "KernelInfoGetAttribute_int64", s).is_ok() {
            return Ok(Some(v));
        }
        match self.present_as_other(&cname, "int") {
            Some(got) => Err(self.wrong_type(name, "an int", got)),
            None => Ok(None),
        }
    }
}

impl KernelInfo<'_> {
    /// List-of-ints attribute `name`, `None` when absent.
    pub fn i64s_opt(&self, name: &'static str) -> Result<Option<Vec<i64>>> {
        let cname = CString::new(name).expect("attribute names have no NUL");
        let raw = self.api.raw();
        let mut size = 0usize;
        // SAFETY: valid info and name; with a null buffer the runtime only reports the size.
        let s = unsafe {
            (raw.KernelInfoGetAttributeArray_int64)(self.info, cname.as_ptr(), core::ptr::null_mut(), &mut size)
        };
        if self.api.check(self.op, "KernelInfoGetAttributeArray_int64", s).is_err() {
            return Ok(None); // the list getters succeed for every attribute that exists
        }
        if let Some(got) = self.present_as_other(&cname, "ints") {
            return Err(self.wrong_type(name, "a list of ints", got));
        }
        let mut values = vec![0i64; size];
        // SAFETY: `values` has room for the `size` elements the runtime reported.
        let s = unsafe {
            (raw.KernelInfoGetAttributeArray_int64)(self.info, cname.as_ptr(), values.as_mut_ptr(), &mut size)
        };
        self.api.check(self.op, "KernelInfoGetAttributeArray_int64", s)?;
        values.truncate(size);
        Ok(Some(values))
    }

    /// String attribute `name`, `None` when absent; an attribute of another type, or one
    /// that is not UTF-8, is an error.
    pub fn string_opt(&self, name: &'static str) -> Result<Option<String>> {
        let cname = CString::new(name).expect("attribute names have no NUL");
        let raw = self.api.raw();
        let mut size = 0usize;
        // SAFETY: valid info and name; with a null buffer the runtime only reports the size
        // (the string's length plus its NUL terminator).
        let s = unsafe {
            (raw.KernelInfoGetAttribute_string)(self.info, cname.as_ptr(), core::ptr::null_mut::<c_char>(), &mut size)
        };
        if self.api.check(self.op, "KernelInfoGetAttribute_string", s).is_err() {
            return match self.present_as_other(&cname, "string") {
                Some(got) => Err(self.wrong_type(name, "a string", got)),
                None => Ok(None),
            };
        }
        let mut buf = vec![0u8; size.max(1)];
        size = buf.len();
        // SAFETY: `buf` has room for the `size` bytes (NUL included) the runtime reported.
        let s = unsafe {
            (raw.KernelInfoGetAttribute_string)(self.info, cname.as_ptr(), buf.as_mut_ptr().cast(), &mut size)
        };
        self.api.check(self.op, "KernelInfoGetAttribute_string", s)?;
        // `size` counts the terminating NUL; an ONNX string attribute may hold other NULs.
        buf.truncate(size.saturating_sub(1));
        String::from_utf8(buf).map(Some).map_err(|e| Error::Attribute {
            op: self.op,
            name,
            what: format!("expected a UTF-8 string, got bytes {:?}", e.as_bytes()),
        })
    }
}

/// A node's shape-inference context (at model load).
pub struct ShapeInfer<'a> {
    api: Api,
    op: &'static str,
    ctx: *mut sys::OrtShapeInferContext,
    outputs: usize,
    _node: PhantomData<&'a mut sys::OrtShapeInferContext>,
}

impl ShapeInfer<'_> {
    /// `outputs`: how many outputs the node surely has (its op's required ones; the runtime
    /// checks that much before inference). Only those are ever set: the C API cannot tell how
    /// many more a node has, and ONNX Runtime 1.17 aborts the process (an unchecked vector
    /// index) when an output the node lacks is given a shape.
    ///
    /// # Safety
    /// `ctx` must be valid for the duration of the inference call, and so must this value.
    pub unsafe fn new(api: Api, op: &'static str, ctx: *mut sys::OrtShapeInferContext, outputs: usize) -> Self {
        Self { api, op, ctx, outputs, _node: PhantomData }
    }

    /// Number of inputs of the node.
    pub fn input_count(&self) -> Result<usize> {
        let mut n = 0;
        // SAFETY: valid context; `n` is a valid out pointer.
        let s = unsafe { (self.api.raw().ShapeInferContext_GetInputCount)(self.ctx, &mut n) };
        self.api.check(self.op, "ShapeInferContext_GetInputCount", s).map(|()| n)
    }

    /// Input `index`'s element type and shape as far as they are known (`-1` for an unknown
    /// dimension), or `None` when the runtime knows nothing of it.
    pub fn input(&self, index: usize) -> Option<(DType, Vec<i64>)> {
        let info = self.input_info(index)?;
        // SAFETY: `info` belongs to the context (not released here) and is valid now.
        unsafe { read_info(self.api, self.op, info, false) }.ok()
    }

    fn input_info(&self, index: usize) -> Option<*mut sys::OrtTensorTypeAndShapeInfo> {
        let mut info: *mut sys::OrtTensorTypeAndShapeInfo = core::ptr::null_mut();
        // SAFETY: valid context; the returned info is owned by the context.
        let s = unsafe { (self.api.raw().ShapeInferContext_GetInputTypeShape)(self.ctx, index, &mut info) };
        (self.api.check(self.op, "ShapeInferContext_GetInputTypeShape", s).is_ok() && !info.is_null()).then_some(info)
    }

    /// The node's attribute `name` read as `kind` into `buf` (`len` bytes); the number of
    /// bytes the value has, or `None` when the node has no such attribute.
    fn read_attr(&self, name: &CStr, kind: sys::OrtOpAttrType, buf: *mut c_void, len: usize) -> Option<usize> {
        let raw = self.api.raw();
        let mut attr: *const sys::OrtOpAttr = core::ptr::null();
        // SAFETY: valid context and NUL-terminated name; `attr` is an out pointer to an
        // attribute owned by the node.
        let s = unsafe { (raw.ShapeInferContext_GetAttribute)(self.ctx, name.as_ptr(), &mut attr) };
        if self.api.check(self.op, "ShapeInferContext_GetAttribute", s).is_err() || attr.is_null() {
            return None;
        }
        let mut size = 0usize;
        // SAFETY: `attr` is valid; `buf` has room for `len` bytes (or is null with len 0,
        // when the runtime only reports the size, with an error status that is released).
        let s = unsafe { (raw.ReadOpAttr)(attr, kind, buf, len, &mut size) };
        let ok = self.api.check(self.op, "ReadOpAttr", s).is_ok();
        (ok || len == 0).then_some(size)
    }

    /// Int attribute `name` of the node, `None` when absent (or not an int).
    pub fn attr_i64(&self, name: &CStr) -> Option<i64> {
        let mut v = 0i64;
        let size = self.read_attr(name, sys::OrtOpAttrType::ORT_OP_ATTR_INT, (&raw mut v).cast(), size_of::<i64>())?;
        (size == size_of::<i64>()).then_some(v)
    }

    /// String attribute `name` of the node, `None` when absent (or not a UTF-8 string).
    pub fn attr_string(&self, name: &CStr) -> Option<String> {
        let bytes = self.read_attr(name, sys::OrtOpAttrType::ORT_OP_ATTR_STRING, core::ptr::null_mut(), 0)?;
        let mut v = vec![0u8; bytes];
        if !v.is_empty() {
            let got = self.read_attr(name, sys::OrtOpAttrType::ORT_OP_ATTR_STRING, v.as_mut_ptr().cast(), bytes)?;
            if got != bytes {
                return None;
            }
        }
        String::from_utf8(v).ok()
    }

    /// List-of-ints attribute `name` of the node, `None` when absent (or not such a list).
    pub fn attr_i64s(&self, name: &CStr) -> Option<Vec<i64>> {
        let bytes = self.read_attr(name, sys::OrtOpAttrType::ORT_OP_ATTR_INTS, core::ptr::null_mut(), 0)?;
        let mut v = vec![0i64; bytes / size_of::<i64>()];
        if v.is_empty() {
            return Some(v);
        }
        let got = self.read_attr(name, sys::OrtOpAttrType::ORT_OP_ATTR_INTS, v.as_mut_ptr().cast(), bytes)?;
        (got == bytes).then_some(v)
    }

    /// Gives output `output` element type `dtype` and dimensions `dims` (each `None` for
    /// unknown); does nothing for an output the node may lack, or when `dims` is `None` (no
    /// dimension known: the C API can only declare a shape, and a shape of no dimensions is
    /// a scalar's, so the output's type and shape are left to the runtime: the type from
    /// the op's signature, the shape unknown).
    ///
    /// An unknown dimension gets a name of its own, unique in the process (`{op}_{n}_out
    /// {output}_dim{i}`, `n` one more at every call): ONNX Runtime's memory planner takes
    /// two outputs whose dimensions have the same name for one size and may reuse one's
    /// buffer for the other ("Shape mismatch attempting to re-use buffer"), so a name per op
    /// would tie two nodes' different sizes together. The C API cannot leave a dimension
    /// unnamed: an unnamed unknown is written as the value -1, which the planner also
    /// compares as equal.
    pub fn set_output(&mut self, output: usize, dtype: DType, dims: Option<&[Option<i64>]>) -> Result<()> {
        match dims {
            Some(dims) => self.declare(output, dtype, dims),
            None => Ok(()),
        }
    }

    /// Gives output `output` element type `dtype` where nothing else can (an op whose output
    /// type an attribute picks, PhiloxUniform's `dtype`) and no dimension is known. The C API
    /// declares a type only with a shape, and a shape of no dimensions, which ONNX Runtime
    /// reads as rank 0: its memory planner never reuses a buffer for a rank-0 output, but a
    /// standard op reading the output infers from that rank. Use [`ShapeInfer::set_output`]
    /// wherever the type comes from the signature.
    pub fn set_output_type(&mut self, output: usize, dtype: DType) -> Result<()> {
        self.declare(output, dtype, &[])
    }

    fn declare(&mut self, output: usize, dtype: DType, dims: &[Option<i64>]) -> Result<()> {
        static CALLS: core::sync::atomic::AtomicU64 = core::sync::atomic::AtomicU64::new(0);
        if output >= self.outputs {
            return Ok(());
        }
        let raw = self.api.raw();
        let mut info: *mut sys::OrtTensorTypeAndShapeInfo = core::ptr::null_mut();
        // SAFETY: `info` is an out pointer; the info is released below, once.
        let s = unsafe { (raw.CreateTensorTypeAndShapeInfo)(&mut info) };
        self.api.check(self.op, "CreateTensorTypeAndShapeInfo", s)?;
        let call = CALLS.fetch_add(1, core::sync::atomic::Ordering::Relaxed);
        let names: Vec<CString> = (0..dims.len())
            .map(|i| CString::new(unknown_dim_name(self.op, call, output, i)).expect("no NUL"))
            .collect();
        let result = (|| {
            // SAFETY: `info` was just created.
            let s = unsafe { (raw.SetTensorElementType)(info, dtype.to_sys()) };
            self.api.check(self.op, "SetTensorElementType", s)?;
            let values: Vec<i64> = dims.iter().map(|d| d.unwrap_or(-1)).collect();
            // SAFETY: `values` holds `len` dimensions.
            let s = unsafe { (raw.SetDimensions)(info, values.as_ptr(), values.len()) };
            self.api.check(self.op, "SetDimensions", s)?;
            let mut params: Vec<*const c_char> =
                dims.iter().zip(&names).map(|(d, n)| if d.is_some() { c"".as_ptr() } else { n.as_ptr() }).collect();
            // SAFETY: one NUL-terminated name per dimension, alive during the call (the
            // runtime copies them).
            let s = unsafe { (raw.SetSymbolicDimensions)(info, params.as_mut_ptr(), params.len()) };
            self.api.check(self.op, "SetSymbolicDimensions", s)?;
            // SAFETY: valid context and info, only read by the runtime.
            let s = unsafe { (raw.ShapeInferContext_SetOutputTypeShape)(self.ctx, output, info) };
            self.api.check(self.op, "ShapeInferContext_SetOutputTypeShape", s)
        })();
        // SAFETY: created above, released once.
        unsafe { (raw.ReleaseTensorTypeAndShapeInfo)(info) };
        result
    }

    /// Gives output `output` the shape of input `input` (symbolic dimensions included); does
    /// nothing for an output the node may lack (see [`ShapeInfer::new`]) or for an input of
    /// no dimensions (unknown or scalar: the runtime does not tell them apart).
    pub fn output_like_input(&mut self, output: usize, input: usize) -> Result<()> {
        if output >= self.outputs {
            return Ok(());
        }
        let Some(info) = self.input_info(input) else { return Ok(()) };
        // ONNX Runtime hands an input whose shape it does not know to this context as a
        // shape of no dimensions (1.17 to 1.32 alike), the same as a scalar's: passed on, it
        // would make the output a scalar, and a node reading it (a Gemm after a loss
        // gradient) fails its own inference. Such an input leaves the output to the runtime.
        // SAFETY: `info` belongs to the context (not released here) and is valid now.
        let read = unsafe { read_info(self.api, self.op, info, false) }.ok();
        if read.as_ref().is_some_and(|(_, dims)| dims.is_empty()) {
            return Ok(());
        }
        // An unknown dimension with no name comes as the value -1 (onnxruntime 1.17 hands
        // such inputs to the context: a recomputed MatMul's output in a LoRA step). Copied,
        // the -1 is a size: a MatMul reading the output found it "incompatible" with the
        // real one. Such an output is declared afresh, each unknown dimension named.
        if let Some((dtype, dims)) = read {
            // SAFETY: as above; `info` has `dims.len()` dimensions.
            if unsafe { self.has_unnamed_unknown(info, dims.len()) } {
                let known: Vec<Option<i64>> = dims.iter().map(|&d| (d >= 0).then_some(d)).collect();
                return self.declare(output, dtype, &known);
            }
        }
        // SAFETY: valid context; `info` is valid and only read by the runtime.
        let s = unsafe { (self.api.raw().ShapeInferContext_SetOutputTypeShape)(self.ctx, output, info) };
        self.api.check(self.op, "ShapeInferContext_SetOutputTypeShape", s)
    }

    /// True when a dimension of `info` (of `rank` dimensions) is unknown and unnamed.
    ///
    /// # Safety
    /// `info` must be a valid tensor type-and-shape info of `rank` dimensions.
    unsafe fn has_unnamed_unknown(&self, info: *const sys::OrtTensorTypeAndShapeInfo, rank: usize) -> bool {
        let raw = self.api.raw();
        let mut dims = vec![0i64; rank];
        let mut names: Vec<*const c_char> = vec![core::ptr::null(); rank];
        // SAFETY: valid info (caller); both buffers hold `rank` entries; the names stay
        // owned by the info and are read before this returns.
        let ok = self
            .api
            .check(self.op, "GetDimensions", unsafe { (raw.GetDimensions)(info, dims.as_mut_ptr(), rank) })
            .and_then(|()| {
                // SAFETY: as above.
                let s = unsafe { (raw.GetSymbolicDimensions)(info, names.as_mut_ptr(), rank) };
                self.api.check(self.op, "GetSymbolicDimensions", s)
            })
            .is_ok();
        ok && dims.iter().zip(&names).any(|(&d, &n)| {
            // SAFETY: a non-null name is a NUL-terminated string the info owns.
            d < 0 && (n.is_null() || unsafe { core::ffi::CStr::from_ptr(n) }.is_empty())
        })
    }
}
