//! Array operations: elementwise math, comparisons, matmul, shape manipulation, indexing,
//! reductions, softmax, scans, sorting. All are lazy (they build graph nodes) and follow
//! MLX's semantics (NumPy broadcasting and type promotion); every method returns
//! [`Error::Mlx`] with MLX's message when MLX rejects the inputs (bad shape, bad axis).
use mlx_sys::ffi::{self, BinaryOp, ReduceOp, ScanOp, UnaryOp};

use crate::array::{list, wrap};
use crate::{Array, Dtype, Error, Result};

macro_rules! unary {
    ($($(#[$doc:meta])* $name:ident => $op:ident;)*) => {$(
        $(#[$doc])*
        ///
        /// # Errors
        /// [`Error::Mlx`] if MLX rejects the input dtype.
        pub fn $name(&self) -> Result<Array> {
            wrap(stringify!($name), ffi::unary(UnaryOp::$op, self.raw()))
        }
    )*};
}

macro_rules! binary {
    ($($(#[$doc:meta])* $name:ident => $op:ident;)*) => {$(
        $(#[$doc])*
        ///
        /// # Errors
        /// [`Error::Mlx`] when the shapes do not broadcast.
        pub fn $name(&self, other: &Array) -> Result<Array> {
            wrap(stringify!($name), ffi::binary(BinaryOp::$op, self.raw(), other.raw()))
        }
    )*};
}

macro_rules! reduce {
    ($($(#[$doc:meta])* $name:ident => $op:ident;)*) => {$(
        $(#[$doc])*
        /// over `axes` (all axes when empty; negative axes count from the end); `keepdims`
        /// keeps reduced axes with size 1.
        ///
        /// # Errors
        /// [`Error::Mlx`] for an out-of-range axis.
        pub fn $name(&self, axes: &[i32], keepdims: bool) -> Result<Array> {
            wrap(stringify!($name), ffi::reduce(ReduceOp::$op, self.raw(), axes, keepdims))
        }
    )*};
}

macro_rules! scan {
    ($($(#[$doc:meta])* $name:ident => $op:ident;)*) => {$(
        $(#[$doc])*
        /// along `axis`; `reverse` scans from the end, `inclusive = false` shifts by one
        /// (the first output is the identity). Shape is unchanged.
        ///
        /// # Errors
        /// [`Error::Mlx`] for an out-of-range axis.
        pub fn $name(&self, axis: i32, reverse: bool, inclusive: bool) -> Result<Array> {
            wrap(stringify!($name), ffi::scan(ScanOp::$op, self.raw(), axis, reverse, inclusive))
        }
    )*};
}

impl Array {
    unary! {
        /// `|x|`.
        abs => Abs;
        /// `-x`.
        negative => Negative;
        /// `e^x`.
        exp => Exp;
        /// Natural logarithm.
        log => Log;
        /// `ln(1 + x)`, accurate near 0.
        log1p => Log1p;
        /// Square root.
        sqrt => Sqrt;
        /// `1 / sqrt(x)`.
        rsqrt => Rsqrt;
        /// `x * x`.
        square => Square;
        /// `1 / x`.
        reciprocal => Reciprocal;
        /// Sine (radians).
        sin => Sin;
        /// Cosine (radians).
        cos => Cos;
        /// Hyperbolic tangent.
        tanh => Tanh;
        /// `1 / (1 + e^-x)`.
        sigmoid => Sigmoid;
        /// The error function.
        erf => Erf;
        /// Round toward -inf.
        floor => Floor;
        /// Round toward +inf.
        ceil => Ceil;
        /// Round half to even.
        round => Round;
        /// -1, 0 or 1.
        sign => Sign;
        /// Boolean not (bool output).
        logical_not => LogicalNot;
        /// Whether each element is NaN (bool output).
        isnan => IsNan;
        /// Whether each element is +-inf (bool output).
        isinf => IsInf;
        /// `x` itself, with a zero gradient: what [`crate::autograd`] does not differentiate
        /// through (`mx.stop_gradient`).
        stop_gradient => StopGradient;
    }

    binary! {
        /// `self + other`.
        add => Add;
        /// `self - other`.
        subtract => Subtract;
        /// `self * other`.
        multiply => Multiply;
        /// `self / other` (true division: integer inputs give a float result).
        divide => Divide;
        /// `floor(self / other)`.
        floor_divide => FloorDivide;
        /// Remainder with the sign of `other` (Python `%`).
        remainder => Remainder;
        /// `self ^ other`.
        power => Power;
        /// Elementwise maximum.
        maximum => Maximum;
        /// Elementwise minimum.
        minimum => Minimum;
        /// `self == other` (bool output).
        equal => Equal;
        /// `self != other` (bool output).
        not_equal => NotEqual;
        /// `self < other` (bool output).
        less => Less;
        /// `self <= other` (bool output).
        less_equal => LessEqual;
        /// `self > other` (bool output).
        greater => Greater;
        /// `self >= other` (bool output).
        greater_equal => GreaterEqual;
        /// Boolean and.
        logical_and => LogicalAnd;
        /// Boolean or.
        logical_or => LogicalOr;
        /// `log(e^self + e^other)`, computed stably.
        logaddexp => LogAddExp;
    }

    reduce! {
        /// Sum
        sum => Sum;
        /// Arithmetic mean
        mean => Mean;
        /// Maximum
        max => Max;
        /// Minimum
        min => Min;
        /// Product
        prod => Prod;
        /// Whether all elements are true
        all => All;
        /// Whether any element is true
        any => Any;
        /// `log(sum(exp(x)))`, computed stably,
        logsumexp => LogSumExp;
    }

    scan! {
        /// Cumulative sum
        cumsum => Sum;
        /// Cumulative product
        cumprod => Prod;
        /// Cumulative maximum
        cummax => Max;
        /// Cumulative minimum
        cummin => Min;
        /// Cumulative log-sum-exp
        logcumsumexp => LogSumExp;
    }

    /// Converts to `dtype` (float to int truncates toward zero).
    ///
    /// # Errors
    /// [`Error::Mlx`] if MLX cannot convert.
    pub fn astype(&self, dtype: Dtype) -> Result<Array> {
        if self.dtype() == dtype {
            return Ok(self.clone());
        }
        wrap("astype", ffi::astype(self.raw(), dtype.to_ffi()))
    }

    /// Matrix product with NumPy `matmul` semantics: `[..., M, K] @ [..., K, N] -> [..., M, N]`,
    /// batch dimensions broadcast; 1-D inputs are treated as vectors. f32 products go to
    /// `cblas_sgemm` on the CPU backend (see [`crate::blas_info`]).
    ///
    /// # Errors
    /// [`Error::Mlx`] when the inner dimensions differ.
    pub fn matmul(&self, other: &Array) -> Result<Array> {
        wrap("matmul", ffi::matmul(self.raw(), other.raw()))
    }

    /// `beta * self + alpha * (a @ b)` in one op (`self` broadcasts to `[..., M, N]`).
    ///
    /// # Errors
    /// [`Error::Mlx`] on mismatched shapes.
    pub fn addmm(&self, a: &Array, b: &Array, alpha: f32, beta: f32) -> Result<Array> {
        wrap("addmm", ffi::addmm(self.raw(), a.raw(), b.raw(), alpha, beta))
    }

    /// Picks `x` where `self` (bool) is true and `y` elsewhere; all three broadcast.
    ///
    /// # Errors
    /// [`Error::Mlx`] when the shapes do not broadcast.
    pub fn where_(&self, x: &Array, y: &Array) -> Result<Array> {
        wrap("where", ffi::where_(self.raw(), x.raw(), y.raw()))
    }

    /// Clamps to `[lo, hi]`; either bound may be omitted.
    ///
    /// # Errors
    /// [`Error::Mlx`] when both bounds are `None` or shapes do not broadcast.
    pub fn clip(&self, lo: Option<&Array>, hi: Option<&Array>) -> Result<Array> {
        wrap("clip", ffi::clip(self.raw(), &list(lo), &list(hi)))
    }

    /// Same data, new shape (one dimension may be -1 and is inferred).
    ///
    /// # Errors
    /// [`Error::Invalid`] for other negative sizes or several -1; [`Error::Mlx`] when the
    /// element counts differ (the message names both shapes).
    pub fn reshape(&self, shape: &[i32]) -> Result<Array> {
        if shape.iter().any(|&d| d < -1) || shape.iter().filter(|&&d| d == -1).count() > 1 {
            return Err(Error::Invalid {
                op: "reshape",
                message: format!(
                    "shape {shape:?} may hold non-negative sizes and at most one -1 (input shape {:?})",
                    self.shape()
                ),
            });
        }
        wrap("reshape", ffi::reshape(self.raw(), shape)).map_err(|e| match e {
            Error::Mlx { op, message } => {
                Error::Mlx { op, message: format!("{message} (input shape {:?})", self.shape()) }
            }
            e => e,
        })
    }

    /// Permutes the axes (`axes[i]` is the input axis that becomes output axis `i`); an empty
    /// `axes` reverses them. Returns a strided view, not a copy.
    ///
    /// # Errors
    /// [`Error::Mlx`] when `axes` is not a permutation.
    pub fn transpose(&self, axes: &[i32]) -> Result<Array> {
        wrap("transpose", ffi::transpose(self.raw(), axes))
    }

    /// The transpose of a matrix: reverses all axes.
    ///
    /// # Errors
    /// Never for valid arrays; kept fallible like every op.
    pub fn t(&self) -> Result<Array> {
        self.transpose(&[])
    }

    /// Exchanges two axes.
    ///
    /// # Errors
    /// [`Error::Mlx`] for an out-of-range axis.
    pub fn swapaxes(&self, axis1: i32, axis2: i32) -> Result<Array> {
        wrap("swapaxes", ffi::swapaxes(self.raw(), axis1, axis2))
    }

    /// Inserts size-1 axes at `axes` (positions in the output).
    ///
    /// # Errors
    /// [`Error::Mlx`] for an out-of-range axis.
    pub fn expand_dims(&self, axes: &[i32]) -> Result<Array> {
        wrap("expand_dims", ffi::expand_dims(self.raw(), axes))
    }

    /// Removes size-1 axes (`axes` empty = all of them).
    ///
    /// # Errors
    /// [`Error::Mlx`] when a named axis does not have size 1.
    pub fn squeeze(&self, axes: &[i32]) -> Result<Array> {
        wrap("squeeze", ffi::squeeze(self.raw(), axes))
    }

    /// Broadcasts to `shape` (a view).
    ///
    /// # Errors
    /// [`Error::Mlx`] when the shapes are incompatible.
    pub fn broadcast_to(&self, shape: &[i32]) -> Result<Array> {
        wrap("broadcast_to", ffi::broadcast_to(self.raw(), shape))
    }

    /// `self[start[0]:stop[0]:strides[0], ...]` over all axes (one entry per axis; bounds are
    /// clamped to the axis as in NumPy; strides are non-zero, negative ones walk backwards).
    ///
    /// # Errors
    /// [`Error::Invalid`] when the vectors do not have one entry per axis or a stride is 0.
    pub fn slice(&self, start: &[i32], stop: &[i32], strides: &[i32]) -> Result<Array> {
        self.check_slice("slice", start, stop, strides)?;
        wrap("slice", ffi::slice(self.raw(), start, stop, strides))
    }

    fn check_slice(&self, op: &'static str, start: &[i32], stop: &[i32], strides: &[i32]) -> Result<()> {
        let n = self.ndim();
        if start.len() != n || stop.len() != n || strides.len() != n {
            return Err(Error::Invalid {
                op,
                message: format!(
                    "start/stop/strides need one entry per axis of shape {:?}, got {}/{}/{}",
                    self.shape(),
                    start.len(),
                    stop.len(),
                    strides.len()
                ),
            });
        }
        if strides.contains(&0) {
            return Err(Error::Invalid { op, message: format!("strides {strides:?} contain 0") });
        }
        Ok(())
    }

    /// Checks that integer `indices` address `-dim .. dim` of `axis` (negative ones count
    /// from the end, as in MLX; MLX's gather does not check, and an out-of-range index reads
    /// or writes outside the buffer). Evaluates `indices`.
    fn check_indices(&self, op: &'static str, indices: &Array, axis: i32) -> Result<()> {
        let dt = indices.dtype();
        if dt.is_float() || matches!(dt, Dtype::Bool | Dtype::Complex64) {
            return Err(Error::Invalid { op, message: format!("indices must be integers, found {dt}") });
        }
        let n = self.dim(axis).map_err(|_| Error::Invalid {
            op,
            message: format!("axis {axis} is out of range for shape {:?}", self.shape()),
        })? as f64;
        if indices.size() == 0 {
            return Ok(());
        }
        let lo = wrap(op, ffi::reduce(ReduceOp::Min, indices.raw(), &[], false))?.item()?;
        let hi = wrap(op, ffi::reduce(ReduceOp::Max, indices.raw(), &[], false))?.item()?;
        if lo < -n || hi >= n {
            let bad = if lo < -n { lo } else { hi };
            return Err(Error::Invalid {
                op,
                message: format!("index {bad} is out of range for axis {axis} of size {n} (shape {:?})", self.shape()),
            });
        }
        Ok(())
    }

    /// `self[.., start..stop, ..]` along one axis (stride 1); negative bounds count from
    /// the end of the axis.
    ///
    /// # Errors
    /// [`Error::Invalid`] for an out-of-range axis.
    pub fn slice_axis(&self, axis: i32, start: i32, stop: i32) -> Result<Array> {
        let shape = self.shape();
        let n = shape.len() as i32;
        let ax = if axis < 0 { axis + n } else { axis };
        if ax < 0 || ax >= n {
            return Err(Error::Invalid {
                op: "slice_axis",
                message: format!("axis {axis} is out of range for shape {shape:?}"),
            });
        }
        let mut lo = vec![0; shape.len()];
        let mut hi = shape.clone();
        let len = shape[ax as usize];
        let fix = |v: i32| if v < 0 { (v + len).max(0) } else { v.min(len) };
        lo[ax as usize] = fix(start);
        hi[ax as usize] = fix(stop);
        self.slice(&lo, &hi, &vec![1; shape.len()])
    }

    /// A copy of `self` with `self[start:stop:strides] = update` (functional update; with a
    /// donated buffer MLX writes in place).
    ///
    /// # Errors
    /// [`Error::Mlx`] when `update` does not broadcast to the slice.
    pub fn slice_update(&self, update: &Array, start: &[i32], stop: &[i32], strides: &[i32]) -> Result<Array> {
        self.check_slice("slice_update", start, stop, strides)?;
        wrap("slice_update", ffi::slice_update(self.raw(), update.raw(), start, stop, strides))
    }

    /// Gathers entries along `axis` at `indices` (any integer dtype, any shape): the axis is
    /// replaced by the shape of `indices` (embedding lookup: `table.take(ids, 0)`).
    ///
    /// Indices must lie in `-dim(axis) .. dim(axis)` (negative ones count from the end); they
    /// are checked (which evaluates `indices`).
    ///
    /// # Errors
    /// [`Error::Invalid`] for an out-of-range axis or index, or non-integer indices.
    pub fn take(&self, indices: &Array, axis: i32) -> Result<Array> {
        self.check_indices("take", indices, axis)?;
        wrap("take", ffi::take(self.raw(), indices.raw(), axis))
    }

    /// `out[..., i, ...] = self[..., indices[..., i, ...], ...]` along `axis` (same rank;
    /// integer indices in `-dim .. dim`, checked, which evaluates `indices`).
    ///
    /// # Errors
    /// [`Error::Invalid`] for an out-of-range or non-integer index; [`Error::Mlx`] when
    /// ranks differ.
    pub fn take_along_axis(&self, indices: &Array, axis: i32) -> Result<Array> {
        self.check_indices("take_along_axis", indices, axis)?;
        wrap("take_along_axis", ffi::take_along_axis(self.raw(), indices.raw(), axis))
    }

    /// The inverse of [`Array::take_along_axis`]: writes `values` at `indices` (integer, in
    /// `-dim .. dim`, checked).
    ///
    /// # Errors
    /// [`Error::Invalid`] for an out-of-range or non-integer index; [`Error::Mlx`] when
    /// shapes do not match.
    pub fn put_along_axis(&self, indices: &Array, values: &Array, axis: i32) -> Result<Array> {
        self.check_indices("put_along_axis", indices, axis)?;
        wrap("put_along_axis", ffi::put_along_axis(self.raw(), indices.raw(), values.raw(), axis))
    }

    /// A row-major contiguous copy (a no-op when already contiguous).
    ///
    /// # Errors
    /// Never for valid arrays.
    pub fn contiguous(&self) -> Result<Array> {
        wrap("contiguous", ffi::contiguous(self.raw()))
    }

    /// Index of the maximum along `axis` (uint32 output).
    ///
    /// # Errors
    /// [`Error::Mlx`] for an out-of-range axis.
    pub fn argmax(&self, axis: i32, keepdims: bool) -> Result<Array> {
        wrap("argmax", ffi::arg_reduce(ReduceOp::ArgMax, self.raw(), axis, keepdims))
    }

    /// Index of the minimum along `axis` (uint32 output).
    ///
    /// # Errors
    /// [`Error::Mlx`] for an out-of-range axis.
    pub fn argmin(&self, axis: i32, keepdims: bool) -> Result<Array> {
        wrap("argmin", ffi::arg_reduce(ReduceOp::ArgMin, self.raw(), axis, keepdims))
    }

    /// `exp(x - logsumexp(x))` over `axes` (all axes when empty, as for the reductions;
    /// pass `&[-1]` for the usual last-axis softmax); `precise` accumulates f16/bf16 input
    /// in f32.
    ///
    /// # Errors
    /// [`Error::Mlx`] for an out-of-range axis.
    pub fn softmax(&self, axes: &[i32], precise: bool) -> Result<Array> {
        let all: Vec<i32> = (0..self.ndim() as i32).collect();
        wrap("softmax", ffi::softmax(self.raw(), if axes.is_empty() { &all } else { axes }, precise))
    }

    /// Sorted copy along `axis` (ascending).
    ///
    /// # Errors
    /// [`Error::Mlx`] for an out-of-range axis.
    pub fn sort(&self, axis: i32) -> Result<Array> {
        wrap("sort", ffi::sort(self.raw(), axis))
    }

    /// Indices that sort along `axis` (ascending, uint32).
    ///
    /// # Errors
    /// [`Error::Mlx`] for an out-of-range axis.
    pub fn argsort(&self, axis: i32) -> Result<Array> {
        wrap("argsort", ffi::argsort(self.raw(), axis))
    }

    /// The `k` largest values along `axis`, in no particular order (MLX semantics); sort
    /// the result if order matters.
    ///
    /// # Errors
    /// [`Error::Mlx`] when `k` exceeds the axis length.
    pub fn topk(&self, k: i32, axis: i32) -> Result<Array> {
        wrap("topk", ffi::topk(self.raw(), k, axis))
    }

    /// Indices that partition along `axis` around the `kth` smallest element (uint32).
    ///
    /// # Errors
    /// [`Error::Mlx`] when `kth` is out of range.
    pub fn argpartition(&self, kth: i32, axis: i32) -> Result<Array> {
        wrap("argpartition", ffi::argpartition(self.raw(), kth, axis))
    }

    /// Zeroes the elements above diagonal `k` of the last two axes.
    ///
    /// # Errors
    /// [`Error::Mlx`] for arrays with fewer than 2 dimensions.
    pub fn tril(&self, k: i32) -> Result<Array> {
        wrap("tril", ffi::tril(self.raw(), k))
    }

    /// Zeroes the elements below diagonal `k` of the last two axes.
    ///
    /// # Errors
    /// [`Error::Mlx`] for arrays with fewer than 2 dimensions.
    pub fn triu(&self, k: i32) -> Result<Array> {
        wrap("triu", ffi::triu(self.raw(), k))
    }

    /// Splits along `axis` at the given indices (`[2, 5]` gives `[..2], [2..5], [5..]`).
    ///
    /// # Errors
    /// [`Error::Mlx`] for an out-of-range axis.
    pub fn split_at(&self, indices: &[i32], axis: i32) -> Result<Vec<Array>> {
        let l = ffi::split_sections(self.raw(), indices, axis).map_err(|e| Error::mlx("split", e))?;
        (0..ffi::list_len(&l)).map(|i| wrap("split", ffi::list_get(&l, i))).collect()
    }
}

/// Joins arrays along an existing `axis`; all other dimensions must agree.
///
/// # Errors
/// [`Error::Mlx`] when shapes disagree or `arrays` is empty.
pub fn concatenate(arrays: &[&Array], axis: i32) -> Result<Array> {
    wrap("concatenate", ffi::concatenate(&list(arrays.iter().copied()), axis))
}

/// Joins same-shaped arrays along a new `axis`.
///
/// # Errors
/// [`Error::Mlx`] when shapes disagree or `arrays` is empty.
pub fn stack(arrays: &[&Array], axis: i32) -> Result<Array> {
    wrap("stack", ffi::stack(&list(arrays.iter().copied()), axis))
}
