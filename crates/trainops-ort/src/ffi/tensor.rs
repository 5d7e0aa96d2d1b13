//! Tensors as a kernel sees them: element type, shape and a raw buffer, turned into slices
//! only after their type, alignment and aliasing have been checked.

use core::ffi::c_void;
use core::ops::Range;

/// ONNX tensor element types (`TensorProto.DataType`), read from the runtime as integers so
/// that a type newer than our bindings is an ordinary value, not undefined behaviour.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DType {
    /// float (1)
    Float,
    /// uint8 (2)
    Uint8,
    /// int32 (6)
    Int32,
    /// int64 (7)
    Int64,
    /// bool (9)
    Bool,
    /// float16 (10)
    Float16,
    /// double (11)
    Double,
    /// uint32 (12)
    Uint32,
    /// bfloat16 (16)
    BFloat16,
    /// Any other ONNX element type, by its number.
    Other(i32),
}

impl DType {
    /// From `ONNXTensorElementDataType`'s integer value.
    pub fn from_raw(v: i32) -> Self {
        match v {
            1 => Self::Float,
            2 => Self::Uint8,
            6 => Self::Int32,
            7 => Self::Int64,
            9 => Self::Bool,
            10 => Self::Float16,
            11 => Self::Double,
            12 => Self::Uint32,
            16 => Self::BFloat16,
            other => Self::Other(other),
        }
    }

    /// ONNX's `TensorProto.DataType` number.
    pub fn raw(self) -> i32 {
        match self {
            Self::Float => 1,
            Self::Uint8 => 2,
            Self::Int32 => 6,
            Self::Int64 => 7,
            Self::Bool => 9,
            Self::Float16 => 10,
            Self::Double => 11,
            Self::Uint32 => 12,
            Self::BFloat16 => 16,
            Self::Other(v) => v,
        }
    }

    /// The name ONNX Runtime uses in its messages, e.g. `tensor(float)`.
    pub fn name(self) -> String {
        const NAMES: [&str; 24] = [
            "undefined",
            "float",
            "uint8",
            "int8",
            "uint16",
            "int16",
            "int32",
            "int64",
            "string",
            "bool",
            "float16",
            "double",
            "uint32",
            "uint64",
            "complex64",
            "complex128",
            "bfloat16",
            "float8e4m3fn",
            "float8e4m3fnuz",
            "float8e5m2",
            "float8e5m2fnuz",
            "uint4",
            "int4",
            "float4e2m1",
        ];
        match usize::try_from(self.raw()).ok().and_then(|i| NAMES.get(i)) {
            Some(n) => format!("tensor({n})"),
            None => format!("tensor(type {})", self.raw()),
        }
    }

    /// The corresponding `ONNXTensorElementDataType`.
    pub fn to_sys(self) -> ort_sys::ONNXTensorElementDataType {
        use ort_sys::ONNXTensorElementDataType::*;
        match self {
            Self::Float => ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT,
            Self::Uint8 => ONNX_TENSOR_ELEMENT_DATA_TYPE_UINT8,
            Self::Int32 => ONNX_TENSOR_ELEMENT_DATA_TYPE_INT32,
            Self::Int64 => ONNX_TENSOR_ELEMENT_DATA_TYPE_INT64,
            Self::Bool => ONNX_TENSOR_ELEMENT_DATA_TYPE_BOOL,
            Self::Float16 => ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT16,
            Self::Double => ONNX_TENSOR_ELEMENT_DATA_TYPE_DOUBLE,
            Self::Uint32 => ONNX_TENSOR_ELEMENT_DATA_TYPE_UINT32,
            Self::BFloat16 => ONNX_TENSOR_ELEMENT_DATA_TYPE_BFLOAT16,
            Self::Other(_) => ONNX_TENSOR_ELEMENT_DATA_TYPE_UNDEFINED,
        }
    }
}

/// A Rust type that is the in-memory form of an ONNX element type.
pub trait TensorElem: Copy + Send + Sync + 'static {
    /// Its ONNX type.
    const DTYPE: DType;
}
impl TensorElem for f32 {
    const DTYPE: DType = DType::Float;
}
impl TensorElem for u8 {
    const DTYPE: DType = DType::Uint8;
}
impl TensorElem for f64 {
    const DTYPE: DType = DType::Double;
}
impl TensorElem for i64 {
    const DTYPE: DType = DType::Int64;
}
impl TensorElem for u32 {
    const DTYPE: DType = DType::Uint32;
}
impl TensorElem for bool {
    const DTYPE: DType = DType::Bool;
}
impl TensorElem for half::f16 {
    const DTYPE: DType = DType::Float16;
}
impl TensorElem for half::bf16 {
    const DTYPE: DType = DType::BFloat16;
}

/// One input or output tensor of a kernel call.
#[derive(Debug, Clone)]
pub struct Tensor {
    /// Element type.
    pub dtype: DType,
    /// Dimensions, as the runtime reports them.
    pub shape: Vec<i64>,
    /// Number of elements.
    pub numel: usize,
    pub(crate) ptr: *mut c_void,
    pub(crate) elem_size: usize,
}

impl Tensor {
    /// Dimensions as `usize` (the runtime never reports a negative one for a real tensor).
    pub fn dims(&self) -> Vec<usize> {
        self.shape.iter().map(|&d| usize::try_from(d).unwrap_or(0)).collect()
    }

    /// The buffer's address range in bytes; empty for a zero-element tensor.
    pub fn bytes(&self) -> Range<usize> {
        let start = self.ptr as usize;
        start..start + self.numel * self.elem_size
    }

    /// True when the buffer can be viewed as `T` (type and alignment).
    fn viewable<T: TensorElem>(&self) -> bool {
        T::DTYPE == self.dtype
            && (self.numel == 0 || (!self.ptr.is_null() && (self.ptr as usize).is_multiple_of(align_of::<T>())))
    }

    /// The elements, read-only. Panics when `T` is not the tensor's type or the buffer is
    /// misaligned (callers check both first and report an error).
    ///
    /// # Safety
    /// No mutable reference to any part of this buffer may exist while the slice lives.
    pub unsafe fn slice<'a, T: TensorElem>(&self) -> &'a [T] {
        assert!(self.viewable::<T>(), "tensor viewed as the wrong type or misaligned");
        if self.numel == 0 {
            return &[];
        }
        // SAFETY: the runtime's buffer holds `numel` elements of `T` (type checked above),
        // aligned and non-null; the caller guarantees nothing mutates it meanwhile.
        unsafe { core::slice::from_raw_parts(self.ptr as *const T, self.numel) }
    }

    /// The elements, writable. Panics as [`Tensor::slice`] does.
    ///
    /// # Safety
    /// No other reference to any part of this buffer may exist while the slice lives.
    #[allow(clippy::mut_from_ref)]
    pub unsafe fn slice_mut<'a, T: TensorElem>(&self) -> &'a mut [T] {
        assert!(self.viewable::<T>(), "tensor viewed as the wrong type or misaligned");
        if self.numel == 0 {
            return &mut [];
        }
        // SAFETY: as in `slice`, and the caller guarantees this is the only reference.
        unsafe { core::slice::from_raw_parts_mut(self.ptr as *mut T, self.numel) }
    }

    /// The value of a one-element bool tensor, read as a byte (any non-zero byte is true, so
    /// a caller's buffer can never hold an invalid `bool`); `None` for other tensors.
    pub fn read_bool(&self) -> Option<bool> {
        if self.dtype != DType::Bool || self.numel != 1 || self.ptr.is_null() {
            return None;
        }
        // SAFETY: a one-element bool tensor holds one readable byte at `ptr`.
        Some(unsafe { (self.ptr as *const u8).read() } != 0)
    }

    /// True when the buffer is aligned for its element type.
    pub fn aligned(&self) -> bool {
        self.numel == 0 || (!self.ptr.is_null() && (self.ptr as usize).is_multiple_of(self.elem_size.max(1)))
    }
}

/// Size in bytes of one element, for the types trainops reads or writes.
pub fn elem_size(d: DType) -> usize {
    match d {
        DType::Bool | DType::Uint8 => 1,
        DType::Float16 | DType::BFloat16 => 2,
        DType::Float | DType::Int32 | DType::Uint32 => 4,
        DType::Int64 | DType::Double => 8,
        DType::Other(_) => 1,
    }
}

/// A copy of the tensor's elements, as a boxed `Vec` of its element type, for the types the
/// ops compute on; `None` for other types.
///
/// # Safety
/// No mutable reference to any part of the tensor's buffer may exist during the call.
pub unsafe fn snapshot(t: &Tensor) -> Option<Box<dyn std::any::Any>> {
    Some(match t.dtype {
        // SAFETY: the type is checked by `slice`; the caller excludes writers.
        DType::Float => Box::new(unsafe { t.slice::<f32>() }.to_vec()),
        // SAFETY: as above.
        DType::Double => Box::new(unsafe { t.slice::<f64>() }.to_vec()),
        // SAFETY: as above.
        DType::Float16 => Box::new(unsafe { t.slice::<half::f16>() }.to_vec()),
        // SAFETY: as above.
        DType::Uint8 => Box::new(unsafe { t.slice::<u8>() }.to_vec()),
        // SAFETY: as above.
        DType::BFloat16 => Box::new(unsafe { t.slice::<half::bf16>() }.to_vec()),
        _ => return None,
    })
}
