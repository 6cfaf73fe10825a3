//! Element types of MLX arrays and the Rust types that carry them on the host.
use std::fmt;

use half::{bf16, f16};
use mlx_sys::ffi;

/// The element type of an [`crate::Array`], one to one with `mlx::core::Dtype`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Dtype {
    /// 1 byte, `true`/`false`.
    Bool,
    /// 1-byte unsigned integer.
    Uint8,
    /// 2-byte unsigned integer.
    Uint16,
    /// 4-byte unsigned integer (packed quantized weights, `argmax` indices, PRNG keys `[2]`).
    Uint32,
    /// 8-byte unsigned integer.
    Uint64,
    /// 1-byte signed integer.
    Int8,
    /// 2-byte signed integer.
    Int16,
    /// 4-byte signed integer (the default integer dtype).
    Int32,
    /// 8-byte signed integer.
    Int64,
    /// IEEE half precision; host type [`half::f16`].
    Float16,
    /// IEEE single precision (the fast dtype on the CPU backend).
    Float32,
    /// IEEE double precision (CPU backend only).
    Float64,
    /// bfloat16; host type [`half::bf16`].
    Bfloat16,
    /// Two f32 (real, imaginary).
    Complex64,
}

impl Dtype {
    /// Size of one element in bytes.
    pub fn size(self) -> usize {
        match self {
            Dtype::Bool | Dtype::Uint8 | Dtype::Int8 => 1,
            Dtype::Uint16 | Dtype::Int16 | Dtype::Float16 | Dtype::Bfloat16 => 2,
            Dtype::Uint32 | Dtype::Int32 | Dtype::Float32 => 4,
            Dtype::Uint64 | Dtype::Int64 | Dtype::Float64 | Dtype::Complex64 => 8,
        }
    }

    /// Whether this is a floating point type (f16, bf16, f32, f64).
    pub fn is_float(self) -> bool {
        matches!(self, Dtype::Float16 | Dtype::Bfloat16 | Dtype::Float32 | Dtype::Float64)
    }

    /// MLX's (and safetensors') lower-case name: `float32`, `bfloat16`, `uint32`, ...
    pub fn name(self) -> &'static str {
        match self {
            Dtype::Bool => "bool",
            Dtype::Uint8 => "uint8",
            Dtype::Uint16 => "uint16",
            Dtype::Uint32 => "uint32",
            Dtype::Uint64 => "uint64",
            Dtype::Int8 => "int8",
            Dtype::Int16 => "int16",
            Dtype::Int32 => "int32",
            Dtype::Int64 => "int64",
            Dtype::Float16 => "float16",
            Dtype::Float32 => "float32",
            Dtype::Float64 => "float64",
            Dtype::Bfloat16 => "bfloat16",
            Dtype::Complex64 => "complex64",
        }
    }

    /// Parses [`Dtype::name`] (also accepts `f32`, `f16`, `bf16`).
    ///
    /// # Errors
    /// [`crate::Error::Invalid`] for an unknown name.
    pub fn from_name(name: &str) -> crate::Result<Self> {
        const ALL: [Dtype; 14] = [
            Dtype::Bool,
            Dtype::Uint8,
            Dtype::Uint16,
            Dtype::Uint32,
            Dtype::Uint64,
            Dtype::Int8,
            Dtype::Int16,
            Dtype::Int32,
            Dtype::Int64,
            Dtype::Float16,
            Dtype::Float32,
            Dtype::Float64,
            Dtype::Bfloat16,
            Dtype::Complex64,
        ];
        let alias = match name {
            "f32" => "float32",
            "f16" => "float16",
            "bf16" => "bfloat16",
            "f64" => "float64",
            other => other,
        };
        ALL.into_iter()
            .find(|d| d.name() == alias)
            .ok_or_else(|| crate::Error::Invalid { op: "Dtype::from_name", message: format!("unknown dtype `{name}`") })
    }

    pub(crate) fn to_ffi(self) -> ffi::Dtype {
        match self {
            Dtype::Bool => ffi::Dtype::Bool,
            Dtype::Uint8 => ffi::Dtype::Uint8,
            Dtype::Uint16 => ffi::Dtype::Uint16,
            Dtype::Uint32 => ffi::Dtype::Uint32,
            Dtype::Uint64 => ffi::Dtype::Uint64,
            Dtype::Int8 => ffi::Dtype::Int8,
            Dtype::Int16 => ffi::Dtype::Int16,
            Dtype::Int32 => ffi::Dtype::Int32,
            Dtype::Int64 => ffi::Dtype::Int64,
            Dtype::Float16 => ffi::Dtype::Float16,
            Dtype::Float32 => ffi::Dtype::Float32,
            Dtype::Float64 => ffi::Dtype::Float64,
            Dtype::Bfloat16 => ffi::Dtype::Bfloat16,
            Dtype::Complex64 => ffi::Dtype::Complex64,
        }
    }

    pub(crate) fn from_ffi(d: ffi::Dtype) -> Self {
        match d {
            ffi::Dtype::Bool => Dtype::Bool,
            ffi::Dtype::Uint8 => Dtype::Uint8,
            ffi::Dtype::Uint16 => Dtype::Uint16,
            ffi::Dtype::Uint32 => Dtype::Uint32,
            ffi::Dtype::Uint64 => Dtype::Uint64,
            ffi::Dtype::Int8 => Dtype::Int8,
            ffi::Dtype::Int16 => Dtype::Int16,
            ffi::Dtype::Int32 => Dtype::Int32,
            ffi::Dtype::Int64 => Dtype::Int64,
            ffi::Dtype::Float16 => Dtype::Float16,
            ffi::Dtype::Float64 => Dtype::Float64,
            ffi::Dtype::Bfloat16 => Dtype::Bfloat16,
            ffi::Dtype::Complex64 => Dtype::Complex64,
            _ => Dtype::Float32,
        }
    }
}

impl fmt::Display for Dtype {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// A Rust type that can be copied into and out of an [`crate::Array`] byte for byte.
///
/// Implemented for the integer types, `f32`, `f64`, [`half::f16`] and [`half::bf16`]. Bool
/// arrays are read with [`crate::Array::to_vec_bool`].
pub trait Element: bytemuck::Pod {
    /// The array dtype with this element layout.
    const DTYPE: Dtype;
}

macro_rules! element {
    ($($t:ty => $d:ident),* $(,)?) => { $(impl Element for $t { const DTYPE: Dtype = Dtype::$d; })* };
}
element!(u8 => Uint8, u16 => Uint16, u32 => Uint32, u64 => Uint64, i8 => Int8, i16 => Int16,
    i32 => Int32, i64 => Int64, f16 => Float16, bf16 => Bfloat16, f32 => Float32, f64 => Float64);
