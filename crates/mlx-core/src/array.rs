//! [`Array`]: an RAII handle to an `mlx::core::array`, its construction from host data and
//! its copy back out.
use std::fmt;

use cxx::UniquePtr;
use mlx_sys::ffi;

use crate::{Dtype, Element, Error, Result};

/// A lazily evaluated MLX array.
///
/// - **Ownership**: `Drop` releases this handle; MLX frees the buffer when the last handle
///   (including graph nodes that still need it) is gone. `Clone` is cheap: it shares the
///   buffer and the graph node, it does not copy data.
/// - **Laziness**: ops build a graph; data is computed by [`Array::eval`],
///   [`crate::eval`], or any method that reads data (`to_vec`, `item`).
/// - **Threads**: `Array` is `!Send` and `!Sync`. MLX 0.32 keeps one default stream per
///   thread and cannot evaluate a lazy array on a thread other than the one that built it,
///   so all MLX work of a model happens on one thread (run it as an actor and exchange
///   plain `Vec<f32>` / token ids with other threads).
pub struct Array {
    raw: UniquePtr<ffi::MxArray>,
}

/// Wraps a bridge result, naming the operation in the error.
pub(crate) fn wrap(op: &'static str, r: std::result::Result<UniquePtr<ffi::MxArray>, cxx::Exception>) -> Result<Array> {
    r.map(|raw| Array { raw }).map_err(|e| Error::mlx(op, e))
}

/// An `ArrayList` for the bridge (variadic or optional array arguments).
pub(crate) fn list<'a>(arrays: impl IntoIterator<Item = &'a Array>) -> UniquePtr<ffi::ArrayList> {
    let mut l = ffi::list_new();
    for a in arrays {
        ffi::list_push(l.pin_mut(), a.raw());
    }
    l
}

pub(crate) fn checked_numel(op: &'static str, shape: &[i32]) -> Result<usize> {
    shape.iter().try_fold(1usize, |n, &d| {
        usize::try_from(d).ok().and_then(|d| n.checked_mul(d)).ok_or_else(|| Error::Invalid {
            op,
            message: format!("shape {shape:?} has a negative or overflowing dimension"),
        })
    })
}

impl Array {
    pub(crate) fn raw(&self) -> &ffi::MxArray {
        &self.raw
    }

    pub(crate) fn from_raw(raw: UniquePtr<ffi::MxArray>) -> Array {
        Array { raw }
    }

    /// Copies `data` into a new array of shape `shape` (row-major) and dtype `T::DTYPE`.
    ///
    /// # Errors
    /// [`Error::Shape`] when `data.len()` is not the product of `shape`.
    pub fn from_slice<T: Element>(data: &[T], shape: &[i32]) -> Result<Array> {
        let expected = checked_numel("from_slice", shape)?;
        if expected != data.len() {
            return Err(Error::Shape { op: "from_slice", shape: shape.to_vec(), expected, found: data.len() });
        }
        Self::from_bytes(bytemuck::cast_slice(data), shape, T::DTYPE)
    }

    /// Copies raw little-endian bytes into a new array (e.g. a safetensors payload).
    ///
    /// # Errors
    /// [`Error::Shape`] when `data.len()` is not `prod(shape) * dtype.size()`.
    pub fn from_bytes(data: &[u8], shape: &[i32], dtype: Dtype) -> Result<Array> {
        let n = checked_numel("from_bytes", shape)?;
        let bytes = n.checked_mul(dtype.size()).ok_or_else(|| Error::Invalid {
            op: "from_bytes",
            message: format!("shape {shape:?} of {dtype} overflows the address space"),
        })?;
        if bytes != data.len() {
            return Err(Error::Shape { op: "from_bytes", shape: shape.to_vec(), expected: bytes, found: data.len() });
        }
        wrap("from_bytes", ffi::from_bytes(data, shape, dtype.to_ffi()))
    }

    /// A 0-d f32 array.
    pub fn scalar(value: f32) -> Array {
        Self::full(&[], value as f64, Dtype::Float32).expect("a 0-d f32 array is always valid")
    }

    /// A 0-d array of `dtype` holding `value` (cast from f64). Use it to combine a constant
    /// with an f16/bf16 array without promoting the result to f32.
    ///
    /// # Errors
    /// [`Error::Mlx`] if MLX cannot cast to `dtype`.
    pub fn scalar_as(value: f64, dtype: Dtype) -> Result<Array> {
        Self::full(&[], value, dtype)
    }

    /// An array of `shape` filled with `value`, cast to `dtype`.
    ///
    /// # Errors
    /// [`Error::Mlx`] for a negative dimension.
    pub fn full(shape: &[i32], value: f64, dtype: Dtype) -> Result<Array> {
        wrap("full", ffi::full_f64(shape, value, dtype.to_ffi()))
    }

    /// `full(shape, 0, dtype)`.
    ///
    /// # Errors
    /// As [`Array::full`].
    pub fn zeros(shape: &[i32], dtype: Dtype) -> Result<Array> {
        Self::full(shape, 0.0, dtype)
    }

    /// `full(shape, 1, dtype)`.
    ///
    /// # Errors
    /// As [`Array::full`].
    pub fn ones(shape: &[i32], dtype: Dtype) -> Result<Array> {
        Self::full(shape, 1.0, dtype)
    }

    /// `[start, start + step, ...]` up to but excluding `stop`, shape `[ceil((stop-start)/step)]`.
    ///
    /// # Errors
    /// [`Error::Mlx`] when `step` is 0 or the range is empty in the wrong direction.
    pub fn arange(start: f64, stop: f64, step: f64, dtype: Dtype) -> Result<Array> {
        wrap("arange", ffi::arange(start, stop, step, dtype.to_ffi()))
    }

    /// The shape, outermost dimension first.
    pub fn shape(&self) -> Vec<i32> {
        ffi::shape(self.raw())
    }

    /// Number of dimensions.
    pub fn ndim(&self) -> usize {
        self.shape().len()
    }

    /// Number of elements (product of the shape; 1 for a 0-d array).
    pub fn size(&self) -> usize {
        self.shape().iter().map(|&d| d as usize).product()
    }

    /// Size of dimension `axis` (negative counts from the end).
    ///
    /// # Errors
    /// [`Error::Invalid`] when `axis` is out of range.
    pub fn dim(&self, axis: i32) -> Result<i32> {
        let shape = self.shape();
        let n = shape.len() as i32;
        let i = if axis < 0 { axis + n } else { axis };
        shape.get(i as usize).copied().filter(|_| i >= 0).ok_or_else(|| Error::Invalid {
            op: "dim",
            message: format!("axis {axis} is out of range for shape {shape:?}"),
        })
    }

    /// The element type.
    pub fn dtype(&self) -> Dtype {
        Dtype::from_ffi(ffi::dtype(self.raw()))
    }

    /// Bytes of the data (`size * dtype.size()`).
    pub fn nbytes(&self) -> usize {
        ffi::nbytes(self.raw())
    }

    /// Evaluates the graph that produces this array.
    ///
    /// # Errors
    /// [`Error::Mlx`] when evaluation throws (e.g. a lazily loaded file turns out corrupt).
    pub fn eval(&self) -> Result<()> {
        crate::eval(&[self])
    }

    /// Evaluates and copies the data out in row-major order.
    ///
    /// # Errors
    /// [`Error::Dtype`] when the array's dtype is not `T::DTYPE` (convert with
    /// [`Array::astype`] first; nothing is converted implicitly); [`Error::Mlx`] when
    /// evaluation fails.
    pub fn to_vec<T: Element>(&self) -> Result<Vec<T>> {
        let found = self.dtype();
        if found != T::DTYPE {
            return Err(Error::Dtype { op: "to_vec", expected: T::DTYPE, found });
        }
        let mut out = vec![T::zeroed(); self.size()];
        crate::settings::apply_process();
        ffi::copy_to(self.raw(), bytemuck::cast_slice_mut(&mut out)).map_err(|e| Error::mlx("to_vec", e))?;
        Ok(out)
    }

    /// Evaluates a bool array and copies it out.
    ///
    /// # Errors
    /// [`Error::Dtype`] unless the array is `bool`.
    pub fn to_vec_bool(&self) -> Result<Vec<bool>> {
        let found = self.dtype();
        if found != Dtype::Bool {
            return Err(Error::Dtype { op: "to_vec_bool", expected: Dtype::Bool, found });
        }
        Ok(self.astype(Dtype::Uint8)?.to_vec::<u8>()?.into_iter().map(|b| b != 0).collect())
    }

    /// Evaluates and copies the raw bytes out (row-major, the array's own dtype).
    ///
    /// # Errors
    /// [`Error::Mlx`] when evaluation fails.
    pub fn to_bytes(&self) -> Result<Vec<u8>> {
        let mut out = vec![0u8; self.nbytes()];
        crate::settings::apply_process();
        ffi::copy_to(self.raw(), &mut out).map_err(|e| Error::mlx("to_bytes", e))?;
        Ok(out)
    }

    /// The single element of a size-1 array, converted to f64.
    ///
    /// # Errors
    /// [`Error::Mlx`] when the array does not have exactly one element.
    pub fn item(&self) -> Result<f64> {
        crate::settings::apply_process();
        ffi::item_f64(self.raw()).map_err(|e| Error::mlx("item", e))
    }
}

impl Clone for Array {
    /// Shares the buffer and graph node (a reference-count increment, no copy).
    fn clone(&self) -> Self {
        Array { raw: ffi::clone_array(self.raw()) }
    }
}

impl fmt::Debug for Array {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Array({:?}, {})", self.shape(), self.dtype())
    }
}
