//! [`DType`]: the element types of the artifacts and their names in the manifest (numpy),
//! safetensors and ONNX Runtime.

use std::fmt;

use ort::value::TensorElementType;

/// An element type of the artifacts (the manifest's numpy names, safetensors' codes).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum DType {
    /// `float32` (`F32`)
    F32,
    /// `float64` (`F64`)
    F64,
    /// `float16` (`F16`)
    F16,
    /// `bfloat16` (`BF16`)
    BF16,
    /// `int64` (`I64`)
    I64,
    /// `int32` (`I32`)
    I32,
    /// `int16` (`I16`)
    I16,
    /// `int8` (`I8`)
    I8,
    /// `uint64` (`U64`)
    U64,
    /// `uint32` (`U32`)
    U32,
    /// `uint16` (`U16`)
    U16,
    /// `uint8` (`U8`)
    U8,
    /// `bool` (`BOOL`, one byte: 0 or 1)
    Bool,
}

const ALL: [DType; 13] = [
    DType::F32,
    DType::F64,
    DType::F16,
    DType::BF16,
    DType::I64,
    DType::I32,
    DType::I16,
    DType::I8,
    DType::U64,
    DType::U32,
    DType::U16,
    DType::U8,
    DType::Bool,
];

impl DType {
    /// The numpy name the manifest uses (`"float32"`, `"bool"`, ...).
    pub fn numpy_name(self) -> &'static str {
        match self {
            DType::F32 => "float32",
            DType::F64 => "float64",
            DType::F16 => "float16",
            DType::BF16 => "bfloat16",
            DType::I64 => "int64",
            DType::I32 => "int32",
            DType::I16 => "int16",
            DType::I8 => "int8",
            DType::U64 => "uint64",
            DType::U32 => "uint32",
            DType::U16 => "uint16",
            DType::U8 => "uint8",
            DType::Bool => "bool",
        }
    }

    /// The dtype of a numpy name (`"float32"`, ...); `None` for a name this crate does not
    /// handle.
    pub fn from_numpy_name(name: &str) -> Option<DType> {
        ALL.into_iter().find(|d| d.numpy_name() == name)
    }

    /// Bytes per element.
    pub fn size(self) -> usize {
        match self {
            DType::F64 | DType::I64 | DType::U64 => 8,
            DType::F32 | DType::I32 | DType::U32 => 4,
            DType::F16 | DType::BF16 | DType::I16 | DType::U16 => 2,
            DType::I8 | DType::U8 | DType::Bool => 1,
        }
    }

    pub(crate) fn to_safetensors(self) -> safetensors::Dtype {
        use safetensors::Dtype as S;
        match self {
            DType::F32 => S::F32,
            DType::F64 => S::F64,
            DType::F16 => S::F16,
            DType::BF16 => S::BF16,
            DType::I64 => S::I64,
            DType::I32 => S::I32,
            DType::I16 => S::I16,
            DType::I8 => S::I8,
            DType::U64 => S::U64,
            DType::U32 => S::U32,
            DType::U16 => S::U16,
            DType::U8 => S::U8,
            DType::Bool => S::BOOL,
        }
    }

    pub(crate) fn from_safetensors(d: safetensors::Dtype) -> Option<DType> {
        ALL.into_iter().find(|x| x.to_safetensors() == d)
    }

    pub(crate) fn to_ort(self) -> TensorElementType {
        use TensorElementType as T;
        match self {
            DType::F32 => T::Float32,
            DType::F64 => T::Float64,
            DType::F16 => T::Float16,
            DType::BF16 => T::Bfloat16,
            DType::I64 => T::Int64,
            DType::I32 => T::Int32,
            DType::I16 => T::Int16,
            DType::I8 => T::Int8,
            DType::U64 => T::Uint64,
            DType::U32 => T::Uint32,
            DType::U16 => T::Uint16,
            DType::U8 => T::Uint8,
            DType::Bool => T::Bool,
        }
    }

    pub(crate) fn from_ort(t: TensorElementType) -> Option<DType> {
        ALL.into_iter().find(|x| x.to_ort() == t)
    }
}

impl fmt::Display for DType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.numpy_name())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_round_trip() {
        for d in ALL {
            assert_eq!(DType::from_numpy_name(d.numpy_name()), Some(d));
            assert_eq!(DType::from_safetensors(d.to_safetensors()), Some(d));
            assert_eq!(DType::from_ort(d.to_ort()), Some(d));
        }
        assert_eq!(DType::from_numpy_name("complex64"), None);
    }
}
