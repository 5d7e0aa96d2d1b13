//! Host tensors: a dtype, a shape and little-endian bytes (the layout of safetensors), with
//! typed views ([`Element`]) and the conversions to and from ONNX Runtime values.

use std::fmt;

use ort::memory::Allocator;
use ort::value::{DynTensor, Tensor};

pub use crate::dtype::DType;
use crate::error::{Error, Result};

/// A Rust element type of a [`DType`]: `f32`, `f64`, [`half::f16`], [`half::bf16`], the
/// integers and `bool`.
pub trait Element: ort::value::PrimitiveTensorElementType + Copy + fmt::Debug + 'static {
    /// Its dtype.
    const DTYPE: DType;
    /// The element in little-endian bytes (`bytes.len() == DTYPE.size()`).
    fn read_le(bytes: &[u8]) -> Self;
    /// Appends the element's little-endian bytes to `out`.
    fn write_le(self, out: &mut Vec<u8>);
}

macro_rules! element {
    ($t:ty, $d:ident) => {
        impl Element for $t {
            const DTYPE: DType = DType::$d;
            fn read_le(bytes: &[u8]) -> Self {
                <$t>::from_le_bytes(bytes.try_into().expect("element size"))
            }
            fn write_le(self, out: &mut Vec<u8>) {
                out.extend_from_slice(&self.to_le_bytes());
            }
        }
    };
}
element!(f32, F32);
element!(f64, F64);
element!(half::f16, F16);
element!(half::bf16, BF16);
element!(i64, I64);
element!(i32, I32);
element!(i16, I16);
element!(i8, I8);
element!(u64, U64);
element!(u32, U32);
element!(u16, U16);
element!(u8, U8);

impl Element for bool {
    const DTYPE: DType = DType::Bool;
    fn read_le(bytes: &[u8]) -> Self {
        bytes[0] != 0
    }
    fn write_le(self, out: &mut Vec<u8>) {
        out.push(u8::from(self));
    }
}

/// Runs `$body` with `$T` the [`Element`] type of the [`DType`] `$d`.
macro_rules! with_element {
    ($d:expr, $T:ident => $body:expr) => {
        match $d {
            $crate::dtype::DType::F32 => {
                type $T = f32;
                $body
            }
            $crate::dtype::DType::F64 => {
                type $T = f64;
                $body
            }
            $crate::dtype::DType::F16 => {
                type $T = half::f16;
                $body
            }
            $crate::dtype::DType::BF16 => {
                type $T = half::bf16;
                $body
            }
            $crate::dtype::DType::I64 => {
                type $T = i64;
                $body
            }
            $crate::dtype::DType::I32 => {
                type $T = i32;
                $body
            }
            $crate::dtype::DType::I16 => {
                type $T = i16;
                $body
            }
            $crate::dtype::DType::I8 => {
                type $T = i8;
                $body
            }
            $crate::dtype::DType::U64 => {
                type $T = u64;
                $body
            }
            $crate::dtype::DType::U32 => {
                type $T = u32;
                $body
            }
            $crate::dtype::DType::U16 => {
                type $T = u16;
                $body
            }
            $crate::dtype::DType::U8 => {
                type $T = u8;
                $body
            }
            $crate::dtype::DType::Bool => {
                type $T = bool;
                $body
            }
        }
    };
}
pub(crate) use with_element;

/// A tensor in host memory: dtype, shape and the elements as little-endian bytes in
/// row-major order (safetensors' layout).
#[derive(Debug, Clone, PartialEq)]
pub struct HostTensor {
    dtype: DType,
    shape: Vec<usize>,
    data: Vec<u8>,
}

impl HostTensor {
    /// A tensor of `dtype` and `shape` over `data` (little-endian, row-major). Fails when
    /// `data` does not hold exactly the shape's elements.
    pub fn new(dtype: DType, shape: Vec<usize>, data: Vec<u8>) -> Result<Self> {
        let want = shape.iter().product::<usize>() * dtype.size();
        if data.len() != want {
            return Err(Error::Invalid(format!(
                "HostTensor::new: {dtype} {shape:?} needs {want} bytes, got {}",
                data.len()
            )));
        }
        Ok(Self { dtype, shape, data })
    }

    /// A tensor of `shape` holding `values` (row-major). Fails when their count is not the
    /// shape's.
    pub fn from_vec<T: Element>(shape: Vec<usize>, values: Vec<T>) -> Result<Self> {
        let n: usize = shape.iter().product();
        if values.len() != n {
            return Err(Error::Invalid(format!(
                "HostTensor::from_vec: shape {shape:?} has {n} elements, got {} values",
                values.len()
            )));
        }
        let mut data = Vec::with_capacity(n * T::DTYPE.size());
        for v in values {
            v.write_le(&mut data);
        }
        Ok(Self { dtype: T::DTYPE, shape, data })
    }

    /// A copy of an ndarray array (any layout; stored row-major).
    pub fn from_array<T: Element, D: ndarray::Dimension>(array: ndarray::ArrayView<'_, T, D>) -> Self {
        let mut data = Vec::with_capacity(array.len() * T::DTYPE.size());
        for v in array.iter() {
            v.write_le(&mut data);
        }
        Self { dtype: T::DTYPE, shape: array.shape().to_vec(), data }
    }

    /// The element type.
    pub fn dtype(&self) -> DType {
        self.dtype
    }

    /// The dimensions.
    pub fn shape(&self) -> &[usize] {
        &self.shape
    }

    /// The number of elements.
    pub fn len(&self) -> usize {
        self.shape.iter().product()
    }

    /// Whether the tensor has no element.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The elements' little-endian bytes, row-major.
    pub fn bytes(&self) -> &[u8] {
        &self.data
    }

    /// The elements as `T` (row-major). [`Error::DType`] when `T` is not the tensor's dtype.
    pub fn to_vec<T: Element>(&self) -> Result<Vec<T>> {
        self.check_dtype::<T>("HostTensor::to_vec")?;
        Ok(self.data.chunks_exact(T::DTYPE.size()).map(<T as Element>::read_le).collect())
    }

    /// The elements as an ndarray array of the tensor's shape. [`Error::DType`] when `T` is
    /// not the tensor's dtype.
    pub fn to_array<T: Element>(&self) -> Result<ndarray::ArrayD<T>> {
        let v = self.to_vec::<T>()?;
        Ok(ndarray::ArrayD::from_shape_vec(ndarray::IxDyn(&self.shape), v)
            .expect("the element count matches the shape"))
    }

    fn check_dtype<T: Element>(&self, what: &str) -> Result<()> {
        if T::DTYPE != self.dtype {
            return Err(Error::DType {
                what: format!("{what}: the requested element type"),
                expected: self.dtype,
                got: T::DTYPE,
            });
        }
        Ok(())
    }

    /// A new ONNX Runtime tensor (allocated by ONNX Runtime's CPU allocator, so it can be
    /// bound as an output) holding a copy of this tensor.
    pub(crate) fn to_ort(&self) -> Result<DynTensor> {
        let shape: Vec<i64> = self.shape.iter().map(|&d| d as i64).collect();
        let mut value = DynTensor::new(&Allocator::default(), self.dtype.to_ort(), shape)?;
        with_element!(self.dtype, T => {
            let (_, dst) = value.try_extract_tensor_mut::<T>()?;
            for (d, s) in dst.iter_mut().zip(self.data.chunks_exact(self.dtype.size())) {
                *d = <T as Element>::read_le(s);
            }
        });
        Ok(value)
    }

    /// An owned ONNX Runtime tensor holding a copy of this tensor (an input value).
    pub(crate) fn to_ort_input(&self) -> Result<DynTensor> {
        let shape: Vec<i64> = self.shape.iter().map(|&d| d as i64).collect();
        with_element!(self.dtype, T => {
            let v: Vec<T> = self.data.chunks_exact(self.dtype.size()).map(<T as Element>::read_le).collect();
            Ok(Tensor::from_array((shape, v))?.upcast())
        })
    }

    /// A copy of an ONNX Runtime tensor of `dtype`.
    pub(crate) fn from_ort(value: &DynTensor, dtype: DType) -> Result<Self> {
        with_element!(dtype, T => {
            let (shape, src) = value.try_extract_tensor::<T>()?;
            let shape: Vec<usize> = shape.iter().map(|&d| d as usize).collect();
            let mut data = Vec::with_capacity(src.len() * dtype.size());
            for v in src {
                v.write_le(&mut data);
            }
            Ok(Self { dtype, shape, data })
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bytes_are_little_endian() {
        let t = HostTensor::from_vec(vec![2], vec![1.0f32, -2.5]).unwrap();
        assert_eq!(t.bytes(), &[0, 0, 0x80, 0x3f, 0, 0, 0x20, 0xc0]);
        assert_eq!(t.to_vec::<f32>().unwrap(), vec![1.0, -2.5]);
        let b = HostTensor::from_vec(vec![3], vec![true, false, true]).unwrap();
        assert_eq!(b.bytes(), &[1, 0, 1]);
        assert_eq!(b.to_vec::<bool>().unwrap(), vec![true, false, true]);
    }

    #[test]
    fn errors_name_the_problem() {
        let e = HostTensor::from_vec(vec![2, 2], vec![1i64, 2, 3]).unwrap_err();
        assert!(e.to_string().contains("shape [2, 2] has 4 elements, got 3"), "{e}");
        let e = HostTensor::new(DType::F64, vec![2], vec![0; 8]).unwrap_err();
        assert!(e.to_string().contains("needs 16 bytes, got 8"), "{e}");
        let t = HostTensor::from_vec(vec![1], vec![1.0f32]).unwrap();
        let e = t.to_vec::<f64>().unwrap_err();
        assert!(e.to_string().contains("expected float32, got float64"), "{e}");
    }

    #[test]
    fn ndarray_round_trip() {
        let a = ndarray::arr2(&[[1i32, 2, 3], [4, 5, 6]]);
        let t = HostTensor::from_array(a.view());
        assert_eq!(t.shape(), &[2, 3]);
        assert_eq!(t.to_array::<i32>().unwrap(), a.into_dyn());
    }
}
