//! Raw bindings to MLX's C++ API: a `cxx` bridge over a small C++ shim (`src/shim.h`).
//!
//! This is the only crate of the workspace with C++ and FFI. Use the safe layer, `mlx-core`,
//! instead of calling these functions directly.
//!
//! - Arrays are `mlx::core::array` itself, held as [`cxx::UniquePtr<MxArray>`]: dropping the
//!   pointer runs the C++ destructor, which releases MLX's reference-counted buffer.
//! - Every function that can throw returns `Result<_, cxx::Exception>`: cxx catches the C++
//!   exception at the boundary and the message (MLX's own, e.g. `[matmul] Last dimension of
//!   first input with shape (2,3) must match ...`) arrives in Rust. Nothing aborts.
//! - Optional or variadic array arguments travel as an [`ffi::ArrayList`] (0 or 1 entries for
//!   an optional one).
//! - Opaque C++ types are `!Send` and `!Sync`: MLX 0.32 keeps one default stream per thread,
//!   and a lazy array built on one thread cannot be evaluated on another.
//!
//! The build script (`build.rs`) finds or downloads `libmlx` and exports its directory to
//! dependents as `DEP_MLX_LIBDIR`; a crate that links an executable (binary, test, bench)
//! puts it in that executable's rpath with a two-line build script
//! (see `crates/mlx-core/build.rs`).
#![allow(missing_docs)] // the bridge items are documented in shim.h

#[cxx::bridge(namespace = "mlxsys")]
pub mod ffi {
    /// Element types, in MLX's order of `mlx::core::Dtype::Val`.
    #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
    #[repr(u8)]
    enum Dtype {
        Bool,
        Uint8,
        Uint16,
        Uint32,
        Uint64,
        Int8,
        Int16,
        Int32,
        Int64,
        Float16,
        Float32,
        Float64,
        Bfloat16,
        Complex64,
    }

    /// One-input elementwise ops.
    #[derive(Debug, Clone, Copy, PartialEq, Eq)]
    #[repr(u8)]
    enum UnaryOp {
        Abs,
        Negative,
        Exp,
        Log,
        Log1p,
        Sqrt,
        Rsqrt,
        Square,
        Reciprocal,
        Sin,
        Cos,
        Tanh,
        Sigmoid,
        Erf,
        Floor,
        Ceil,
        Round,
        Sign,
        LogicalNot,
        IsNan,
        IsInf,
        /// The identity whose gradient is zero (`mx::stop_gradient`).
        StopGradient,
    }

    /// Two-input elementwise ops (with NumPy broadcasting and type promotion).
    #[derive(Debug, Clone, Copy, PartialEq, Eq)]
    #[repr(u8)]
    enum BinaryOp {
        Add,
        Subtract,
        Multiply,
        Divide,
        FloorDivide,
        Remainder,
        Power,
        Maximum,
        Minimum,
        Equal,
        NotEqual,
        Less,
        LessEqual,
        Greater,
        GreaterEqual,
        LogicalAnd,
        LogicalOr,
        LogAddExp,
    }

    /// Reductions; `ArgMax`/`ArgMin` go through `arg_reduce` (one axis).
    #[derive(Debug, Clone, Copy, PartialEq, Eq)]
    #[repr(u8)]
    enum ReduceOp {
        Sum,
        Mean,
        Max,
        Min,
        Prod,
        All,
        Any,
        LogSumExp,
        ArgMax,
        ArgMin,
    }

    /// Cumulative (scan) ops along one axis.
    #[derive(Debug, Clone, Copy, PartialEq, Eq)]
    #[repr(u8)]
    enum ScanOp {
        Sum,
        Prod,
        Max,
        Min,
        LogSumExp,
    }

    /// The arrays returned by `mlx::core::quantize`: packed `w` (uint32), `scales`, and
    /// `biases` (null for modes without biases).
    struct Quantized {
        w: UniquePtr<MxArray>,
        scales: UniquePtr<MxArray>,
        biases: UniquePtr<MxArray>,
    }

    /// The settings of a fused decoder layer (`cpu_layer_in`, `cpu_layer_out`, `cpu_layer`): the norms'
    /// epsilons, the heads, RoPE (`rope_base` used when `rope_has_base`, else the freqs
    /// input), the position of the first row (`offset`), the attention scale, the products'
    /// bits (4, 8; 32 for dense float32 weights), group size, instruction-set cap, precision
    /// and threads, and which optional inputs are present.
    #[derive(Debug, Clone, Copy, PartialEq)]
    struct LayerParams {
        norm_eps: f32,
        qk_norm_eps: f32,
        n_heads: i32,
        n_kv_heads: i32,
        head_dim: i32,
        rope_dims: i32,
        rope_traditional: bool,
        rope_base: f32,
        rope_has_base: bool,
        rope_scale: f32,
        offset: i32,
        scale: f32,
        group_size: i32,
        bits: i32,
        max_isa: i32,
        precision: i32,
        /// The precisions of the q/k/v, output and down projections (`precision`: gate and
        /// up's; mlx-core's `Precision::of`).
        precision_qkv: i32,
        precision_o: i32,
        precision_down: i32,
        threads: i32,
        has_qkv_bias: bool,
        has_qk_norm: bool,
        has_o_bias: bool,
        /// `cpu_layer` only: write the cache buffers in place (nothing else holds them).
        in_place: bool,
    }

    /// What [`vjp`](crate::vjp) returns: the function's outputs and one gradient per primal.
    struct VjpOutputs {
        outputs: UniquePtr<ArrayList>,
        grads: UniquePtr<ArrayList>,
    }

    extern "Rust" {
        type ArrayFn;
        fn call_array_fn(f: &mut ArrayFn, inputs: &ArrayList) -> Result<UniquePtr<ArrayList>>;
    }

    unsafe extern "C++" {
        include!("mlx-sys/src/shim.h");

        #[namespace = "mlx::core"]
        #[cxx_name = "array"]
        type MxArray;
        type ArrayList;
        type ArrayMap;

        fn list_new() -> UniquePtr<ArrayList>;
        fn list_push(l: Pin<&mut ArrayList>, a: &MxArray);
        fn list_len(l: &ArrayList) -> usize;
        fn list_get(l: &ArrayList, i: usize) -> Result<UniquePtr<MxArray>>;
        fn map_new() -> UniquePtr<ArrayMap>;
        fn map_insert(m: Pin<&mut ArrayMap>, name: &str, a: &MxArray);
        fn map_set_metadata(m: Pin<&mut ArrayMap>, key: &str, value: &str);
        fn map_keys(m: &ArrayMap) -> Vec<String>;
        fn map_get(m: &ArrayMap, name: &str) -> Result<UniquePtr<MxArray>>;
        fn map_metadata_keys(m: &ArrayMap) -> Vec<String>;
        fn map_metadata_get(m: &ArrayMap, key: &str) -> Result<String>;

        fn from_bytes(data: &[u8], shape: &[i32], dtype: Dtype) -> Result<UniquePtr<MxArray>>;
        fn full_f64(shape: &[i32], value: f64, dtype: Dtype) -> Result<UniquePtr<MxArray>>;
        fn arange(start: f64, stop: f64, step: f64, dtype: Dtype) -> Result<UniquePtr<MxArray>>;
        fn clone_array(a: &MxArray) -> UniquePtr<MxArray>;
        fn shape(a: &MxArray) -> Vec<i32>;
        fn dtype(a: &MxArray) -> Dtype;
        fn nbytes(a: &MxArray) -> usize;
        fn copy_to(a: &MxArray, out: &mut [u8]) -> Result<()>;
        fn item_f64(a: &MxArray) -> Result<f64>;

        fn unary(op: UnaryOp, a: &MxArray) -> Result<UniquePtr<MxArray>>;
        fn binary(op: BinaryOp, a: &MxArray, b: &MxArray) -> Result<UniquePtr<MxArray>>;
        fn astype(a: &MxArray, dtype: Dtype) -> Result<UniquePtr<MxArray>>;
        fn where_(cond: &MxArray, x: &MxArray, y: &MxArray) -> Result<UniquePtr<MxArray>>;
        fn clip(a: &MxArray, lo: &ArrayList, hi: &ArrayList) -> Result<UniquePtr<MxArray>>;
        fn matmul(a: &MxArray, b: &MxArray) -> Result<UniquePtr<MxArray>>;
        fn addmm(c: &MxArray, a: &MxArray, b: &MxArray, alpha: f32, beta: f32) -> Result<UniquePtr<MxArray>>;
        fn reshape(a: &MxArray, shape: &[i32]) -> Result<UniquePtr<MxArray>>;
        fn transpose(a: &MxArray, axes: &[i32]) -> Result<UniquePtr<MxArray>>;
        fn swapaxes(a: &MxArray, axis1: i32, axis2: i32) -> Result<UniquePtr<MxArray>>;
        fn expand_dims(a: &MxArray, axes: &[i32]) -> Result<UniquePtr<MxArray>>;
        fn squeeze(a: &MxArray, axes: &[i32]) -> Result<UniquePtr<MxArray>>;
        fn broadcast_to(a: &MxArray, shape: &[i32]) -> Result<UniquePtr<MxArray>>;
        fn slice(a: &MxArray, start: &[i32], stop: &[i32], strides: &[i32]) -> Result<UniquePtr<MxArray>>;
        fn slice_update(
            src: &MxArray,
            update: &MxArray,
            start: &[i32],
            stop: &[i32],
            strides: &[i32],
        ) -> Result<UniquePtr<MxArray>>;
        fn concatenate(arrays: &ArrayList, axis: i32) -> Result<UniquePtr<MxArray>>;
        fn stack(arrays: &ArrayList, axis: i32) -> Result<UniquePtr<MxArray>>;
        fn split_sections(a: &MxArray, indices: &[i32], axis: i32) -> Result<UniquePtr<ArrayList>>;
        fn take(a: &MxArray, indices: &MxArray, axis: i32) -> Result<UniquePtr<MxArray>>;
        fn take_along_axis(a: &MxArray, indices: &MxArray, axis: i32) -> Result<UniquePtr<MxArray>>;
        fn put_along_axis(a: &MxArray, indices: &MxArray, values: &MxArray, axis: i32) -> Result<UniquePtr<MxArray>>;
        fn contiguous(a: &MxArray) -> Result<UniquePtr<MxArray>>;
        fn reduce(op: ReduceOp, a: &MxArray, axes: &[i32], keepdims: bool) -> Result<UniquePtr<MxArray>>;
        fn arg_reduce(op: ReduceOp, a: &MxArray, axis: i32, keepdims: bool) -> Result<UniquePtr<MxArray>>;
        fn softmax(a: &MxArray, axes: &[i32], precise: bool) -> Result<UniquePtr<MxArray>>;
        fn scan(op: ScanOp, a: &MxArray, axis: i32, reverse: bool, inclusive: bool) -> Result<UniquePtr<MxArray>>;
        fn sort(a: &MxArray, axis: i32) -> Result<UniquePtr<MxArray>>;
        fn argsort(a: &MxArray, axis: i32) -> Result<UniquePtr<MxArray>>;
        fn topk(a: &MxArray, k: i32, axis: i32) -> Result<UniquePtr<MxArray>>;
        fn argpartition(a: &MxArray, kth: i32, axis: i32) -> Result<UniquePtr<MxArray>>;
        fn tril(a: &MxArray, k: i32) -> Result<UniquePtr<MxArray>>;
        fn triu(a: &MxArray, k: i32) -> Result<UniquePtr<MxArray>>;

        fn rms_norm(x: &MxArray, weight: &ArrayList, eps: f32) -> Result<UniquePtr<MxArray>>;
        fn layer_norm(x: &MxArray, weight: &ArrayList, bias: &ArrayList, eps: f32) -> Result<UniquePtr<MxArray>>;
        #[allow(clippy::too_many_arguments)]
        fn rope(
            x: &MxArray,
            dims: i32,
            traditional: bool,
            base: f32,
            has_base: bool,
            scale: f32,
            offset: i32,
            freqs: &ArrayList,
        ) -> Result<UniquePtr<MxArray>>;
        fn sdpa(
            q: &MxArray,
            k: &MxArray,
            v: &MxArray,
            scale: f32,
            mask_mode: &str,
            mask: &ArrayList,
        ) -> Result<UniquePtr<MxArray>>;

        fn quantize(w: &MxArray, group_size: i32, bits: i32, mode: &str) -> Result<Quantized>;
        fn dequantize(
            w: &MxArray,
            scales: &MxArray,
            biases: &ArrayList,
            group_size: i32,
            bits: i32,
            mode: &str,
        ) -> Result<UniquePtr<MxArray>>;
        #[allow(clippy::too_many_arguments)]
        fn quantized_matmul(
            x: &MxArray,
            w: &MxArray,
            scales: &MxArray,
            biases: &ArrayList,
            transpose: bool,
            group_size: i32,
            bits: i32,
            mode: &str,
        ) -> Result<UniquePtr<MxArray>>;

        fn random_key(seed: u64) -> Result<UniquePtr<MxArray>>;
        fn random_split(key: &MxArray, num: i32) -> Result<UniquePtr<MxArray>>;
        fn random_uniform(
            low: &MxArray,
            high: &MxArray,
            shape: &[i32],
            dtype: Dtype,
            key: &MxArray,
        ) -> Result<UniquePtr<MxArray>>;
        fn random_normal(
            shape: &[i32],
            dtype: Dtype,
            loc: f32,
            scale: f32,
            key: &MxArray,
        ) -> Result<UniquePtr<MxArray>>;
        fn random_categorical(logits: &MxArray, axis: i32, key: &MxArray) -> Result<UniquePtr<MxArray>>;

        #[cxx_name = "vjp"]
        fn vjp_raw(f: &mut ArrayFn, primals: &ArrayList, cotangents: &ArrayList) -> Result<VjpOutputs>;

        fn eval(arrays: &ArrayList) -> Result<()>;
        fn async_eval(arrays: &ArrayList) -> Result<()>;
        fn active_memory() -> usize;
        fn peak_memory() -> usize;
        fn cache_memory() -> usize;
        fn reset_peak_memory();
        fn clear_cache();
        fn set_cache_limit(limit: usize) -> usize;

        fn load_safetensors(path: &str) -> Result<UniquePtr<ArrayMap>>;
        fn save_safetensors(path: &str, m: &ArrayMap) -> Result<()>;

        fn version() -> String;
        fn default_device() -> String;
        fn gpu_available() -> bool;
        fn metal_available() -> bool;
        fn cuda_available() -> bool;
        fn blas_info() -> String;
        fn blas_select(which: &str) -> bool;
        fn blas_sgemm_calls() -> u64;

        #[allow(clippy::too_many_arguments)]
        fn cpu_quantized_matmul(
            x: &MxArray,
            w: &MxArray,
            scales: &MxArray,
            biases: &MxArray,
            group_size: i32,
            bits: i32,
            max_isa: i32,
            precision: i32,
            threads: i32,
        ) -> Result<UniquePtr<MxArray>>;
        #[allow(clippy::too_many_arguments)]
        fn cpu_quantized_matmuls(
            x: &MxArray,
            mats: &ArrayList,
            group_size: i32,
            bits: i32,
            swiglu: bool,
            max_isa: i32,
            precision: i32,
            threads: i32,
        ) -> Result<UniquePtr<ArrayList>>;
        fn cpu_dense_matmuls(
            x: &MxArray,
            weights: &ArrayList,
            swiglu: bool,
            max_isa: i32,
            threads: i32,
        ) -> Result<UniquePtr<ArrayList>>;
        fn cpu_qmm_isa(max_isa: i32, precision: i32) -> String;
        fn cpu_qmm_calls() -> u64;
        fn cpu_qmm_threads() -> i32;
        fn cpu_qmm_set_threads(n: i32);
        fn cpu_pool_spin_us() -> i32;
        fn cpu_pool_set_spin_us(us: i32);
        fn cpu_attention(q: &MxArray, k: &MxArray, v: &MxArray, scale: f32, causal: bool)
        -> Result<UniquePtr<MxArray>>;
        fn cpu_attention_calls() -> u64;
        fn cpu_rms_norm(x: &MxArray, weight: &ArrayList, eps: f32) -> Result<UniquePtr<MxArray>>;
        #[allow(clippy::too_many_arguments)]
        fn cpu_rope(
            x: &MxArray,
            dims: i32,
            traditional: bool,
            base: f32,
            has_base: bool,
            scale: f32,
            offset: i32,
            freqs: &ArrayList,
            positions: &ArrayList,
        ) -> Result<UniquePtr<MxArray>>;
        fn cpu_fast_calls() -> u64;
        fn cpu_layer_in(
            x: &MxArray,
            norm: &MxArray,
            qkv: &ArrayList,
            qkv_bias: &ArrayList,
            qk_norms: &ArrayList,
            freqs: &ArrayList,
            p: &LayerParams,
        ) -> Result<UniquePtr<ArrayList>>;
        #[allow(clippy::too_many_arguments)]
        fn cpu_layer_out(
            x: &MxArray,
            q: &MxArray,
            keys: &MxArray,
            values: &MxArray,
            o: &ArrayList,
            o_bias: &ArrayList,
            norm: &MxArray,
            mlp: &ArrayList,
            p: &LayerParams,
        ) -> Result<UniquePtr<MxArray>>;
        #[allow(clippy::too_many_arguments)]
        fn cpu_layer(
            x: &MxArray,
            keys: &MxArray,
            values: &MxArray,
            norm: &MxArray,
            qkv: &ArrayList,
            qkv_bias: &ArrayList,
            qk_norms: &ArrayList,
            freqs: &ArrayList,
            o: &ArrayList,
            o_bias: &ArrayList,
            post_norm: &MxArray,
            mlp: &ArrayList,
            p: &LayerParams,
        ) -> Result<UniquePtr<ArrayList>>;
        fn cpu_layer_calls() -> u64;
        fn blas_gemv_calls() -> u64;
        fn blas_set_gemv_routing(on: bool) -> bool;
    }
}

/// A function of arrays that MLX's autograd calls back (see [`vjp`]); erases the borrowed
/// closure's lifetime for the duration of one [`vjp`] call, which is the only place it is made.
pub struct ArrayFn {
    f: *mut (dyn FnMut(&ffi::ArrayList) -> Result<cxx::UniquePtr<ffi::ArrayList>, String> + 'static),
}

/// A closure over arrays as [`vjp`] takes it: the inputs as an [`ffi::ArrayList`], the outputs
/// as a new one, or an error message.
pub type ArrayClosure<'a> = dyn FnMut(&ffi::ArrayList) -> Result<cxx::UniquePtr<ffi::ArrayList>, String> + 'a;

/// The message of [`vjp`]'s error when the differentiated closure panicked.
pub const VJP_PANICKED: &str = "the differentiated function panicked";

fn call_array_fn(f: &mut ArrayFn, inputs: &ffi::ArrayList) -> Result<cxx::UniquePtr<ffi::ArrayList>, String> {
    // SAFETY: `f.f` was made from a `&mut` closure in `vjp`, which outlives this call: the C++
    // side calls back only while `vjp_raw` runs and keeps no reference after it returns.
    let f = unsafe { &mut *f.f };
    // A panic must not unwind into C++ (cxx would abort): it becomes the call's error.
    std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| f(inputs)))
        .unwrap_or_else(|_| Err(VJP_PANICKED.to_string()))
}

/// `mlx::core::vjp` over a Rust closure: evaluates `f` at `primals` (traced, lazily) and
/// returns its outputs with the vector-Jacobian products of `cotangents` (one per output, of
/// that output's shape) with respect to each primal. An `Err` returned by `f` becomes this
/// call's `Err` with the same message.
pub fn vjp(
    f: &mut ArrayClosure<'_>,
    primals: &ffi::ArrayList,
    cotangents: &ffi::ArrayList,
) -> Result<ffi::VjpOutputs, cxx::Exception> {
    let short: *mut ArrayClosure<'_> = f;
    // SAFETY: only the lifetime is changed; the pointer is used by `call_array_fn` while
    // `vjp_raw` runs, during which `f` is borrowed mutably here.
    let erased: *mut ArrayClosure<'static> = unsafe { std::mem::transmute(short) };
    let mut holder = ArrayFn { f: erased };
    ffi::vjp_raw(&mut holder, primals, cotangents)
}

/// Whether this build has the runtime BLAS switch (Linux wheels with a bundled reference
/// CBLAS; see `src/blas.cc`). `false` on macOS, where libmlx uses Accelerate.
pub const HAS_BLAS_SWITCH: bool = matches!(env!("MLX_SYS_BLAS_SWITCH").as_bytes(), b"1");

/// A digest of this crate's C++ kernel and bridge sources (FNV-1a 64, hex), computed by the
/// build script: changes with every change to the kernels, for caches of measured speeds.
pub const SOURCES_DIGEST: &str = env!("MLX_SYS_SOURCES_DIGEST");

/// The MLX installation this crate was built against (the directory holding `include/` and
/// `lib/`), as chosen by the build script.
pub const MLX_ROOT: &str = env!("MLX_SYS_ROOT");
