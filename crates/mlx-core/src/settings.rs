//! Every run-time setting of mlx-spec, read from the environment once, in this one module.
//!
//! Two kinds of settings:
//! - **Per model: [`KernelPolicy`].** Which of mlx-spec's CPU kernels a model's layers use
//!   (quantized matmul, dense matmul, RMS norm + RoPE, attention) and the instruction-set
//!   cap of the matmul kernel. A policy is a value: chosen at load time, carried by the
//!   loaded model and passed to every dispatching call ([`crate::fast::rms_norm`],
//!   [`crate::cpu_quant::dense_matmul_t_auto`], ...). Two models in one process can run on
//!   different kernels. [`KernelPolicy::default`] is seeded from the environment.
//! - **Per process: [`ProcessSettings`].** What exists once per process: the BLAS behind
//!   MLX's `cblas_sgemm`, its matrix-vector rewrite, the kernels' thread pool (threads and
//!   spin time). They are handed to the C++ side through bridge setters before the first
//!   evaluation ([`apply_process`]); the C++ code reads no environment variable.
//!
//! [`Settings::global`] reads every variable once and records where each value came from
//! ([`Source`]); `mlx-spec info` prints [`Settings::entries`]. The README's table of
//! settings lists the same names. `MLX_SPEC_CACHE` and `MLX_PYTHON` are also read by the
//! `mlx-sys` build script (build time: where the MLX wheel is kept), with the same rule.
use std::fmt;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Once, OnceLock};

use mlx_sys::ffi;

use crate::runtime::{Backend, backend};

/// Where a setting's value came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Source {
    /// The built-in default.
    Default,
    /// The named environment variable.
    Env(&'static str),
    /// Set in code (a builder call, a command-line flag).
    Explicit,
}

impl fmt::Display for Source {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Source::Default => f.write_str("default"),
            Source::Env(name) => write!(f, "env {name}"),
            Source::Explicit => f.write_str("explicit"),
        }
    }
}

/// A value and where it came from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Setting<T> {
    /// The effective value.
    pub value: T,
    /// Where it came from.
    pub source: Source,
}

impl<T> Setting<T> {
    fn default(value: T) -> Self {
        Setting { value, source: Source::Default }
    }
}

/// The instruction sets of the matmul kernel ([`crate::cpu_quant`]), from the portable C++ up.
/// A [`KernelPolicy`] caps the choice; the kernel uses the best one the CPU has under the cap.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Isa {
    /// Portable C++ (any CPU).
    Portable = 0,
    /// AVX2 + FMA.
    Avx2Fma = 1,
    /// AVX-512F.
    Avx512f = 2,
}

impl Isa {
    /// All, from the portable C++ up.
    pub const ALL: [Isa; 3] = [Isa::Portable, Isa::Avx2Fma, Isa::Avx512f];

    /// `portable`, `avx2+fma` or `avx512f`.
    pub fn name(self) -> &'static str {
        match self {
            Isa::Portable => "portable",
            Isa::Avx2Fma => "avx2+fma",
            Isa::Avx512f => "avx512f",
        }
    }

    /// Parses [`Isa::name`] (also `avx2` and `avx512`).
    pub fn parse(s: &str) -> Option<Isa> {
        match s {
            "portable" => Some(Isa::Portable),
            "avx2+fma" | "avx2" => Some(Isa::Avx2Fma),
            "avx512f" | "avx512" => Some(Isa::Avx512f),
            _ => None,
        }
    }
}

impl fmt::Display for Isa {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// How a llama/qwen decoder layer of 4/8-bit weights runs on the CPU backend
/// (`MLX_SPEC_LAYER`; where [`KernelPolicy::uses_layer`]). Every choice gives the same bits.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum LayerNodes {
    /// A node per op (norm, products, RoPE, cache write, attention, adds): `mlx`, `off`, `0`.
    Ops,
    /// Two nodes of [`crate::cpu_layer`] around the KV cache's own write (six nodes a
    /// layer): `split`.
    Split,
    /// One node of [`crate::cpu_layer`] writing a full KV cache itself (the default, `on`);
    /// two around the write for other caches (a rotating window's).
    #[default]
    One,
}

impl LayerNodes {
    /// `on`, `split` or `mlx`.
    pub fn name(self) -> &'static str {
        match self {
            LayerNodes::Ops => "mlx",
            LayerNodes::Split => "split",
            LayerNodes::One => "on",
        }
    }

    /// `on`/`1`/`true`/`yes`, `split`, `mlx`/`off`/`0`/`false`/`no` (any case).
    pub fn parse(s: &str) -> Option<Self> {
        match s.trim().to_ascii_lowercase().as_str() {
            "on" | "1" | "true" | "yes" => Some(LayerNodes::One),
            "split" => Some(LayerNodes::Split),
            "mlx" | "off" | "0" | "false" | "no" => Some(LayerNodes::Ops),
            _ => None,
        }
    }
}

/// The arithmetic of the quantized matmul kernel ([`crate::cpu_quant`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Default)]
pub enum Precision {
    /// float32 products and sums: MLX's `quantized_matmul` up to summation order (the
    /// default; every parity golden against mlx-lm holds on it).
    #[default]
    F32 = 0,
    /// Opt-in: each dequantized weight (the f32 value `scale * q + bias`) and each activation
    /// rounded to bfloat16 (round to nearest even, denormals to zero: Intel SDM,
    /// VCVTNEPS2BF16), products summed in float32 by bf16 dot products (`vdpbf16ps`, Intel SDM:
    /// per f32 lane two round-to-nearest FMAs; AVX512_BF16: twice the multiply-adds of an f32
    /// FMA per instruction; on CPUs without it, portable code with the same bits, about 100x
    /// slower: [`KernelPolicy::precision_in_hardware`]). Outputs stay float32. Only
    /// quantized matmuls change; a row's result still does not depend on the number of rows,
    /// so speculation is lossless against this precision's plain decoding. Its distance from
    /// f32 is measured by `cargo xtask precision` (perplexity and top-1 agreement).
    Bf16 = 1,
    /// Opt-in: llama.cpp's arithmetic on MLX's weights. Each block of 32 activations is
    /// quantized to int8 with its own scale (llama.cpp's Q8_0: `d = amax / 127`,
    /// `q = round(x / d)`, ties to even); the weight codes times the int8 activations are exact
    /// integer dot products (`vpdpbusd`, AVX512_VNNI: 64 multiply-adds an instruction, Intel
    /// SDM), scaled by `d * scale` in f32; the bias term `Σ_g bias_g · Σ_{i∈g} x_i` uses the
    /// exact f32 sums of x. On CPUs without AVX512_VNNI, AVX2 (`vpmaddubsw` on the repacked
    /// copy of 4-bit matrices, `vpmaddwd` on MLX's rows otherwise), else portable code, with the same bits
    /// ([`KernelPolicy::precision_in_hardware`]). Outputs stay float32; a row's result does not
    /// depend on the number of rows, so speculation is lossless against this precision's plain
    /// decoding. Its distance from f32 is measured by `mlx-spec perplexity --precision int8
    /// --reference-precision f32`.
    ///
    /// A decoder layer's q/k/v, output and down projections keep f32 activations
    /// ([`Precision::of`]): int8 rounding of their inputs cost SmolLM2-135M most of its
    /// perplexity distance from f32; the gate/up projections and the LM head, most of the
    /// multiply-adds, take int8 ones (`docs/measurements/2026-12-06-int8-fidelity/`).
    Int8 = 2,
}

/// A product of a decoder layer, as [`Precision::of`] tells them apart (mlx-lm's names).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Projection {
    /// The attention's `q_proj`, `k_proj`, `v_proj` (input: the normed residual stream).
    Qkv,
    /// The attention's `o_proj` (input: the heads' attention outputs).
    Out,
    /// The MLP's `down_proj` (input: SwiGLU's products `silu(gate) * up`).
    Down,
    /// Every other product: `gate_proj`, `up_proj`, the LM head, a drafter's own.
    Other,
}

impl Projection {
    /// The projection a linear layer named `name` (its last path component, mlx-lm's name:
    /// `q_proj`, `down_proj`, ...) is; any other name (`gate_proj`, `lm_head`, a drafter's
    /// `fc`) is [`Projection::Other`]. Never fails.
    pub fn of_name(name: &str) -> Projection {
        match name.rsplit('.').next().unwrap_or(name) {
            "q_proj" | "k_proj" | "v_proj" => Projection::Qkv,
            "o_proj" => Projection::Out,
            "down_proj" => Projection::Down,
            _ => Projection::Other,
        }
    }
}

impl Precision {
    /// All, the default first.
    pub const ALL: [Precision; 3] = [Precision::F32, Precision::Bf16, Precision::Int8];

    /// The names [`Precision::parse`] takes, for error messages.
    pub const EXPECTED: &'static str = "f32, bf16 or int8";

    /// `f32`, `bf16` or `int8`.
    pub fn name(self) -> &'static str {
        match self {
            Precision::F32 => "f32",
            Precision::Bf16 => "bf16",
            Precision::Int8 => "int8",
        }
    }

    /// The precision `product` runs in under this one: [`Precision::F32`] for the q/k/v,
    /// output and down projections under [`Precision::Int8`], this precision otherwise (never
    /// fails; outputs stay float32 whichever it gives).
    /// Chosen by measurement, product by product, on SmolLM2-135M 4-bit (`mlx-spec
    /// perplexity --precision int8 --reference-precision f32`, HumanEval: each product's int8
    /// activations alone cost q/k/v 0.53, down 0.35, gate/up 0.31, o 0.16 and the LM head 0.12
    /// of the 1.11% distance of all-int8; with q/k/v, o and down in f32 MT-Bench and GSM8K
    /// lie at 0.37% and 0.28%; `docs/measurements/2026-12-06-int8-fidelity/`). The one place
    /// that decides it: the loader gives each linear layer its policy through it and the
    /// fused layer ([`crate::cpu_layer`]) its three precisions.
    pub fn of(self, product: Projection) -> Precision {
        match (self, product) {
            (Precision::Int8, Projection::Qkv | Projection::Out | Projection::Down) => Precision::F32,
            (p, _) => p,
        }
    }

    /// Parses [`Precision::name`] (case-insensitive, surrounding blanks ignored).
    pub fn parse(s: &str) -> Option<Precision> {
        match s.trim().to_ascii_lowercase().as_str() {
            "f32" | "float32" => Some(Precision::F32),
            "bf16" | "bfloat16" => Some(Precision::Bf16),
            "int8" => Some(Precision::Int8),
            _ => None,
        }
    }
}

impl fmt::Display for Precision {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// Graph nodes each kernel received through one [`KernelPolicy`] (and its clones).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct KernelCalls {
    /// Quantized matmul nodes ([`crate::cpu_quant`], 4/8-bit weights).
    pub qmm: u64,
    /// Dense float32 matmul nodes ([`crate::cpu_quant::dense_matmuls_t`]).
    pub dense: u64,
    /// RMS norm and RoPE nodes ([`crate::cpu_fast`]).
    pub fast: u64,
    /// Attention nodes ([`crate::cpu_attention`]).
    pub sdpa: u64,
}

#[derive(Debug, Default)]
struct Counters {
    qmm: AtomicU64,
    dense: AtomicU64,
    fast: AtomicU64,
    sdpa: AtomicU64,
}

/// The counters of a [`KernelPolicy`]: [`KernelCounters::default`] starts new ones at zero,
/// a clone shares them.
#[derive(Debug, Clone, Default)]
pub struct KernelCounters(Arc<Counters>);

impl KernelCounters {
    /// The nodes counted so far.
    pub fn calls(&self) -> KernelCalls {
        let c = &self.0;
        KernelCalls {
            qmm: c.qmm.load(Ordering::Relaxed),
            dense: c.dense.load(Ordering::Relaxed),
            fast: c.fast.load(Ordering::Relaxed),
            sdpa: c.sdpa.load(Ordering::Relaxed),
        }
    }

    fn count(&self, kernel: Kernel) {
        let c = &self.0;
        match kernel {
            Kernel::Qmm => &c.qmm,
            Kernel::Dense => &c.dense,
            Kernel::Fast => &c.fast,
            Kernel::Sdpa => &c.sdpa,
        }
        .fetch_add(1, Ordering::Relaxed);
    }
}

/// The kernels a model runs on: which of mlx-spec's CPU kernels its layers use, and the
/// instruction-set cap of the matmul kernel. Chosen at load time and carried by the model
/// (`models::LoadContext::kernels`); every dispatching call takes it, so two models in one
/// process may use different kernels.
///
/// A kernel switched on is used only on the CPU backend and for inputs it supports (the
/// `applies` functions of [`crate::cpu_quant`], [`crate::cpu_fast`],
/// [`crate::cpu_attention`]); otherwise MLX's own op runs. A switch off keeps MLX's op
/// (for comparisons).
///
/// A policy counts the graph nodes it sends to each kernel ([`KernelPolicy::calls`]); clones
/// share the counters (a model's layers hold clones of one policy), a new policy
/// ([`KernelPolicy::default`], [`KernelPolicy::all_on`], [`KernelPolicy::mlx`]) starts its own.
#[derive(Debug, Clone)]
pub struct KernelPolicy {
    /// Quantized 4/8-bit matmuls on the CPU kernel (`MLX_SPEC_QMM`).
    pub qmm: bool,
    /// Dense float32 matmuls on the CPU kernel: up to [`crate::cpu_quant::DENSE_MAX_ROWS`]
    /// rows, and longer inputs on AVX-512 (its prompt GEMM; [`crate::cpu_quant::dense_applies`])
    /// (`MLX_SPEC_DENSE`).
    pub dense: bool,
    /// RMS norm and RoPE as single CPU nodes (`MLX_SPEC_FAST`).
    pub fast_norm_rope: bool,
    /// Fused attention for short query windows (`MLX_SPEC_SDPA`).
    pub sdpa: bool,
    /// How a llama/qwen decoder layer runs (`MLX_SPEC_LAYER`; the fused nodes apply where
    /// [`KernelPolicy::uses_layer`]).
    pub layer: LayerNodes,
    /// The best instruction set the matmul kernel may use (`MLX_SPEC_QMM_ISA`).
    pub max_isa: Isa,
    /// The quantized matmul kernel's arithmetic (`MLX_SPEC_PRECISION`).
    pub precision: Precision,
    /// Threads one matmul is split over (clamped to 1..=cores); `None`: the pool's
    /// process-wide count (`MLX_SPEC_QMM_THREADS`, default all cores).
    pub threads: Option<usize>,
    /// The graph nodes sent to each kernel through this policy and its clones.
    pub counters: KernelCounters,
}

impl Default for KernelPolicy {
    /// The policy the environment asks for ([`Settings::global`]): every kernel on unless
    /// its variable says `mlx`, `off` or `0`; new counters.
    fn default() -> Self {
        Settings::global().kernel_policy()
    }
}

impl PartialEq for KernelPolicy {
    /// Same switches and cap (the counters are not compared).
    fn eq(&self, o: &Self) -> bool {
        (self.qmm, self.dense, self.fast_norm_rope, self.sdpa, self.layer, self.max_isa, self.precision, self.threads)
            == (o.qmm, o.dense, o.fast_norm_rope, o.sdpa, o.layer, o.max_isa, o.precision, o.threads)
    }
}

impl KernelPolicy {
    /// The choices that change a model's speed, as one word for cache keys (e.g. a cost
    /// curve's): the four switches, the instruction-set cap, the precision, threads per call, the
    /// process's BLAS, sgemv rewrite and pool threads ([`Settings::global`]), and the
    /// kernels' build ([`mlx_sys::SOURCES_DIGEST`]: a new kernel is measured anew).
    /// Counters are not part of it.
    pub fn key(&self) -> String {
        let p = &Settings::global().process;
        format!(
            "qmm={} dense={} fast={} sdpa={} layer={} isa={} precision={} threads={:?} blas={} gemv={} pool={:?} kernels={}",
            self.qmm,
            self.dense,
            self.fast_norm_rope,
            self.sdpa,
            self.layer.name(),
            self.max_isa,
            self.precision,
            self.threads,
            p.blas.value.as_deref().unwrap_or("auto"),
            p.gemv_routing.value,
            p.threads.value,
            mlx_sys::SOURCES_DIGEST,
        )
    }

    /// Every kernel on, the best instruction set, f32 precision; ignores the environment.
    pub fn all_on() -> Self {
        Self::switches(true)
    }

    /// Every kernel off: MLX's own ops throughout (for comparisons); ignores the environment.
    pub fn mlx() -> Self {
        Self::switches(false)
    }

    fn switches(on: bool) -> Self {
        KernelPolicy {
            qmm: on,
            dense: on,
            fast_norm_rope: on,
            sdpa: on,
            layer: if on { LayerNodes::One } else { LayerNodes::Ops },
            max_isa: Isa::Avx512f,
            precision: Precision::F32,
            threads: None,
            counters: KernelCounters::default(),
        }
    }

    /// This policy with the quantized matmul kernel's arithmetic `precision` (same counters).
    #[must_use]
    pub fn with_precision(mut self, precision: Precision) -> Self {
        self.precision = precision;
        self
    }

    /// This policy with the instruction-set cap `isa` (same counters).
    #[must_use]
    pub fn with_isa(mut self, isa: Isa) -> Self {
        self.max_isa = isa;
        self
    }

    /// This policy with matmuls split over `n` threads (same counters).
    #[must_use]
    pub fn with_threads(mut self, n: usize) -> Self {
        self.threads = Some(n);
        self
    }

    /// The thread count the C++ kernels take: 0 for the pool's count.
    pub(crate) fn threads_arg(&self) -> i32 {
        self.threads.map_or(0, |n| n.clamp(1, i32::MAX as usize) as i32)
    }

    /// This policy with counters of its own, starting at zero.
    #[must_use]
    pub fn with_new_counters(mut self) -> Self {
        self.counters = KernelCounters::default();
        self
    }

    /// The nodes this policy (and its clones) sent to each kernel so far.
    pub fn calls(&self) -> KernelCalls {
        self.counters.calls()
    }

    /// The instruction set the quantized matmul kernel uses under this policy on this CPU
    /// (`avx512f`, `avx2+fma`, `portable`; in bf16 precision `avx512f+avx512bf16 (bf16)` or
    /// `portable (bf16)`; in int8 precision `avx512f+avx512vnni (int8)` or `portable (int8)`).
    pub fn isa(&self) -> String {
        ffi::cpu_qmm_isa(self.max_isa as i32, self.precision as i32)
    }

    /// Whether this policy's precision runs on the instructions it is built for under the
    /// policy's instruction-set cap on this CPU (f32: always; bf16: AVX512_BF16; int8:
    /// AVX512_VNNI); false where it runs the portable code (the same bits, 10-100x slower) and
    /// where the kernel is not used ([`KernelPolicy::uses_qmm`]).
    pub fn precision_in_hardware(&self) -> bool {
        self.uses_qmm() && (self.precision == Precision::F32 || !self.isa().starts_with("portable"))
    }

    /// Whether quantized matmuls go to the CPU kernel: [`KernelPolicy::qmm`] on the CPU backend.
    pub fn uses_qmm(&self) -> bool {
        self.qmm && cpu_backend()
    }

    /// Whether short dense matmuls go to the CPU kernel.
    pub fn uses_dense(&self) -> bool {
        self.dense && cpu_backend()
    }

    /// Whether RMS norm and RoPE go to the CPU nodes.
    pub fn uses_fast_norm_rope(&self) -> bool {
        self.fast_norm_rope && cpu_backend()
    }

    /// Whether short attention windows go to the fused CPU kernel.
    pub fn uses_sdpa(&self) -> bool {
        self.sdpa && cpu_backend()
    }

    /// Whether a decoder layer may run as the fused CPU nodes of [`crate::cpu_layer`]: its
    /// setting not [`LayerNodes::Ops`] and every kernel those nodes are made of (quantized
    /// matmul, norm and RoPE, attention) on, on the CPU backend.
    pub fn uses_layer(&self) -> bool {
        self.layer != LayerNodes::Ops && self.uses_qmm() && self.uses_fast_norm_rope() && self.uses_sdpa()
    }

    /// Whether float32 models on this policy compute each activation row with the same float
    /// operations whatever the number of rows (the quantized and dense matmul kernels and
    /// the fused attention, on the CPU backend): then a request's rows of a batched forward
    /// equal its solo rows bit for bit, and batching never changes a request's tokens.
    /// False on Metal and CUDA and with any of those kernels off (MLX's own kernels may
    /// round a row differently in a larger product).
    pub fn batch_invariant(&self) -> bool {
        self.uses_qmm() && self.uses_dense() && self.uses_sdpa()
    }

    pub(crate) fn count(&self, kernel: Kernel) {
        self.counters.count(kernel);
    }
}

/// A kernel counted by [`KernelPolicy::calls`].
#[derive(Debug, Clone, Copy)]
pub(crate) enum Kernel {
    Qmm,
    Dense,
    Fast,
    Sdpa,
}

/// Whether MLX runs on the CPU backend (checked once).
fn cpu_backend() -> bool {
    static CPU: OnceLock<bool> = OnceLock::new();
    *CPU.get_or_init(|| backend() == Backend::Cpu)
}

/// Settings that exist once per process (one BLAS interposer, one thread pool).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ProcessSettings {
    /// The CBLAS behind MLX's f32 matmuls: `openblas`, `reference` or a library path
    /// (`MLX_SPEC_BLAS`); `None`: OpenBLAS when present, else the reference.
    pub blas: Setting<Option<String>>,
    /// Rewrite one-row / one-column sgemm calls as sgemv (`MLX_SPEC_GEMV`).
    pub gemv_routing: Setting<bool>,
    /// Threads of the CPU kernels' pool (`MLX_SPEC_QMM_THREADS`); `None`: all cores.
    pub threads: Setting<Option<usize>>,
    /// Microseconds the pool's idle workers spin after a quantized matmul before sleeping
    /// (`MLX_SPEC_POOL_SPIN_US`).
    pub pool_spin_us: Setting<u32>,
}

/// Every run-time setting, with where each value came from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Settings {
    /// `MLX_SPEC_QMM`.
    pub qmm: Setting<bool>,
    /// `MLX_SPEC_DENSE`.
    pub dense: Setting<bool>,
    /// `MLX_SPEC_FAST`.
    pub fast_norm_rope: Setting<bool>,
    /// `MLX_SPEC_SDPA`.
    pub sdpa: Setting<bool>,
    /// `MLX_SPEC_LAYER`.
    pub layer: Setting<LayerNodes>,
    /// `MLX_SPEC_QMM_ISA`.
    pub max_isa: Setting<Isa>,
    /// `MLX_SPEC_PRECISION`.
    pub precision: Setting<Precision>,
    /// The per-process settings.
    pub process: ProcessSettings,
    /// The `tracing` filter of the CLI (`MLX_SPEC_LOG`, e.g. `debug` or `spec=debug`);
    /// empty: errors only.
    pub log: Setting<String>,
    /// The mlx-spec cache directory (`MLX_SPEC_CACHE`, else `$XDG_CACHE_HOME/mlx-spec`, else
    /// `$HOME/.cache/mlx-spec`, else `mlx-spec-cache` in the temp directory).
    pub cache_dir: Setting<PathBuf>,
    /// The Python that runs pip for fetched wheels (`MLX_PYTHON`, default `python3`).
    pub python: Setting<String>,
    /// One line per variable whose value did not parse and was replaced by the default
    /// (`MLX_SPEC_QMM_ISA=avx9: expected portable, avx2+fma or avx512f; using avx512f`); the
    /// CLI prints them as warnings.
    pub invalid: Vec<String>,
}

/// One row of [`Settings::entries`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Entry {
    /// The environment variable.
    pub name: &'static str,
    /// The effective value, as text.
    pub value: String,
    /// Where it came from.
    pub source: Source,
    /// What it changes.
    pub about: &'static str,
}

/// A switch: on for `on`, `1`, `true` or `yes`; off for `mlx`, `off`, `0`, `false` or `no`;
/// anything else keeps the default (on) and is reported in `invalid`.
fn switch(lookup: &dyn Fn(&str) -> Option<String>, name: &'static str, invalid: &mut Vec<String>) -> Setting<bool> {
    match lookup(name).map(|v| (v.trim().to_ascii_lowercase(), v)) {
        None => Setting::default(true),
        Some((w, _)) if matches!(w.as_str(), "on" | "1" | "true" | "yes") => {
            Setting { value: true, source: Source::Env(name) }
        }
        Some((w, _)) if matches!(w.as_str(), "mlx" | "off" | "0" | "false" | "no") => {
            Setting { value: false, source: Source::Env(name) }
        }
        Some((_, v)) => {
            invalid.push(format!("{name}={v}: expected on or off (mlx, 0); using on"));
            Setting::default(true)
        }
    }
}

impl Settings {
    /// The settings of this process: the environment, read on the first call.
    pub fn global() -> &'static Settings {
        static GLOBAL: OnceLock<Settings> = OnceLock::new();
        GLOBAL.get_or_init(|| Settings::from_lookup(|name| std::env::var(name).ok()))
    }

    /// The settings `lookup` (a variable name to its value) describes; [`Settings::global`]
    /// passes the environment. Values that do not parse keep the default.
    pub fn from_lookup(lookup: impl Fn(&str) -> Option<String>) -> Settings {
        let lookup = |name: &str| lookup(name).filter(|v| !v.is_empty());
        let env = |name: &'static str| lookup(name).map(|v| (v, Source::Env(name)));
        let invalid = std::cell::RefCell::new(Vec::new());
        let refuse = |name: &str, value: &str, expected: &str, default: &str| {
            invalid.borrow_mut().push(format!("{name}={value}: expected {expected}; using {default}"));
        };
        let parsed = |name: &'static str, default: &str| {
            let v = lookup(name)?;
            let n = v.trim().parse::<u64>().ok();
            if n.is_none() {
                refuse(name, &v, "a whole number", default);
            }
            n
        };
        let max_isa = match lookup("MLX_SPEC_QMM_ISA").map(|v| (Isa::parse(&v), v)) {
            Some((Some(isa), _)) => Setting { value: isa, source: Source::Env("MLX_SPEC_QMM_ISA") },
            Some((None, v)) => {
                refuse("MLX_SPEC_QMM_ISA", &v, "portable, avx2+fma or avx512f", "avx512f");
                Setting::default(Isa::Avx512f)
            }
            None => Setting::default(Isa::Avx512f),
        };
        let layer = match lookup("MLX_SPEC_LAYER").map(|v| (LayerNodes::parse(&v), v)) {
            Some((Some(l), _)) => Setting { value: l, source: Source::Env("MLX_SPEC_LAYER") },
            Some((None, v)) => {
                refuse("MLX_SPEC_LAYER", &v, "on, split or off (mlx, 0)", "on");
                Setting::default(LayerNodes::One)
            }
            None => Setting::default(LayerNodes::One),
        };
        let precision = match lookup("MLX_SPEC_PRECISION").map(|v| (Precision::parse(&v), v)) {
            Some((Some(p), _)) => Setting { value: p, source: Source::Env("MLX_SPEC_PRECISION") },
            Some((None, v)) => {
                refuse("MLX_SPEC_PRECISION", &v, Precision::EXPECTED, "f32");
                Setting::default(Precision::F32)
            }
            None => Setting::default(Precision::F32),
        };
        let threads = match parsed("MLX_SPEC_QMM_THREADS", "one per core").filter(|&n| {
            if n == 0 {
                refuse("MLX_SPEC_QMM_THREADS", "0", "at least 1", "one per core");
            }
            n > 0
        }) {
            Some(n) => Setting { value: Some(n as usize), source: Source::Env("MLX_SPEC_QMM_THREADS") },
            None => Setting::default(None),
        };
        let pool_spin_us = match parsed("MLX_SPEC_POOL_SPIN_US", "5000") {
            Some(us) => Setting {
                value: us.min(u64::from(i32::MAX as u32)) as u32,
                source: Source::Env("MLX_SPEC_POOL_SPIN_US"),
            },
            None => Setting::default(5000),
        };
        let blas = match env("MLX_SPEC_BLAS") {
            Some((v, source)) => Setting { value: Some(v), source },
            None => Setting::default(None),
        };
        let log = match env("MLX_SPEC_LOG") {
            Some((value, source)) => Setting { value, source },
            None => Setting::default(String::new()),
        };
        let cache_dir = if let Some((d, source)) = env("MLX_SPEC_CACHE") {
            Setting { value: PathBuf::from(d), source }
        } else if let Some((d, source)) = env("XDG_CACHE_HOME") {
            Setting { value: PathBuf::from(d).join("mlx-spec"), source }
        } else if let Some((h, source)) = env("HOME") {
            Setting { value: PathBuf::from(h).join(".cache/mlx-spec"), source }
        } else {
            Setting::default(std::env::temp_dir().join("mlx-spec-cache"))
        };
        let python = match env("MLX_PYTHON") {
            Some((value, source)) => Setting { value, source },
            None => Setting::default("python3".into()),
        };
        let mut invalid = invalid.into_inner();
        let qmm = switch(&lookup, "MLX_SPEC_QMM", &mut invalid);
        let dense = switch(&lookup, "MLX_SPEC_DENSE", &mut invalid);
        let fast_norm_rope = switch(&lookup, "MLX_SPEC_FAST", &mut invalid);
        let sdpa = switch(&lookup, "MLX_SPEC_SDPA", &mut invalid);
        let gemv_routing = switch(&lookup, "MLX_SPEC_GEMV", &mut invalid);
        Settings {
            qmm,
            dense,
            fast_norm_rope,
            sdpa,
            layer,
            max_isa,
            precision,
            process: ProcessSettings { blas, gemv_routing, threads, pool_spin_us },
            log,
            cache_dir,
            python,
            invalid,
        }
    }

    /// A new [`KernelPolicy`] with these switches and cap (and counters of its own).
    pub fn kernel_policy(&self) -> KernelPolicy {
        KernelPolicy {
            qmm: self.qmm.value,
            dense: self.dense.value,
            fast_norm_rope: self.fast_norm_rope.value,
            sdpa: self.sdpa.value,
            layer: self.layer.value,
            max_isa: self.max_isa.value,
            precision: self.precision.value,
            threads: None,
            counters: KernelCounters::default(),
        }
    }

    /// Every setting as `(variable, value, source, what it changes)`, in the README's order.
    pub fn entries(&self) -> Vec<Entry> {
        let on = |b: bool| if b { "on" } else { "mlx" }.to_string();
        let p = &self.process;
        vec![
            Entry {
                name: "MLX_SPEC_QMM",
                value: on(self.qmm.value),
                source: self.qmm.source,
                about: "4/8-bit quantized matmuls on mlx-spec's CPU kernel (`mlx`: MLX's quantized_matmul)",
            },
            Entry {
                name: "MLX_SPEC_DENSE",
                value: on(self.dense.value),
                source: self.dense.source,
                about: "f32 matmuls on the CPU kernel, prompt chunks too on AVX-512 (`mlx`: MLX's matmul, BLAS)",
            },
            Entry {
                name: "MLX_SPEC_FAST",
                value: on(self.fast_norm_rope.value),
                source: self.fast_norm_rope.source,
                about: "RMS norm and RoPE as one CPU node each (`mlx`: MLX's reference graphs)",
            },
            Entry {
                name: "MLX_SPEC_SDPA",
                value: on(self.sdpa.value),
                source: self.sdpa.source,
                about: "fused attention for up to 32 query rows (`mlx`: MLX's attention)",
            },
            Entry {
                name: "MLX_SPEC_LAYER",
                value: self.layer.value.name().to_string(),
                source: self.layer.source,
                about: "a llama/qwen decoder layer of 4/8-bit weights as one CPU node writing the KV cache, same bits as op by op (`split`: two nodes around the cache's write; `mlx`: a node per op)",
            },
            Entry {
                name: "MLX_SPEC_QMM_ISA",
                value: self.max_isa.value.to_string(),
                source: self.max_isa.source,
                about: "instruction-set cap of the matmul kernel: portable, avx2+fma, avx512f",
            },
            Entry {
                name: "MLX_SPEC_PRECISION",
                value: self.precision.value.to_string(),
                source: self.precision.source,
                about: "quantized matmul arithmetic: f32 (MLX's results) or bf16 (opt-in, faster windows and prefill)",
            },
            Entry {
                name: "MLX_SPEC_QMM_THREADS",
                value: p.threads.value.map_or_else(|| "all cores".into(), |n| n.to_string()),
                source: p.threads.source,
                about: "threads of the CPU kernels' pool (process-wide)",
            },
            Entry {
                name: "MLX_SPEC_POOL_SPIN_US",
                value: p.pool_spin_us.value.to_string(),
                source: p.pool_spin_us.source,
                about: "microseconds idle pool workers spin after a quantized matmul before sleeping",
            },
            Entry {
                name: "MLX_SPEC_BLAS",
                value: p.blas.value.clone().unwrap_or_else(|| "auto".into()),
                source: p.blas.source,
                about: "BLAS for f32 matmuls: openblas, reference or a library path (auto: OpenBLAS if present)",
            },
            Entry {
                name: "MLX_SPEC_GEMV",
                value: if p.gemv_routing.value { "on" } else { "off" }.into(),
                source: p.gemv_routing.source,
                about: "one-row/one-column sgemm calls rewritten as sgemv (`off` or `0`: plain sgemm)",
            },
            Entry {
                name: "MLX_SPEC_LOG",
                value: if self.log.value.is_empty() { "error".into() } else { self.log.value.clone() },
                source: self.log.source,
                about: "tracing filter of the CLI's log on stderr (e.g. `debug`, `models=debug`)",
            },
            Entry {
                name: "MLX_SPEC_CACHE",
                value: self.cache_dir.value.display().to_string(),
                source: self.cache_dir.source,
                about: "cache directory (MLX wheel at build time, fetched models and GGUF files)",
            },
            Entry {
                name: "MLX_PYTHON",
                value: self.python.value.clone(),
                source: self.python.source,
                about: "Python that runs pip for fetched wheels (also the build script's)",
            },
        ]
    }
}

/// Hands [`Settings::global`]'s [`ProcessSettings`] to the C++ side (BLAS, sgemv routing,
/// pool threads and spin), once per process. mlx-core calls it before every evaluation, so
/// it runs before the first `cblas_sgemm`; later calls return at once.
pub fn apply_process() {
    static APPLIED: Once = Once::new();
    APPLIED.call_once(|| {
        let p = &Settings::global().process;
        if let Some(n) = p.threads.value {
            ffi::cpu_qmm_set_threads(n.min(i32::MAX as usize) as i32);
        }
        ffi::cpu_pool_set_spin_us(p.pool_spin_us.value.min(i32::MAX as u32) as i32);
        if !p.gemv_routing.value {
            ffi::blas_set_gemv_routing(false);
        }
        if let Some(want) = &p.blas.value
            && mlx_sys::HAS_BLAS_SWITCH
            && !ffi::blas_select(want)
        {
            eprintln!(
                "mlx-spec: MLX_SPEC_BLAS={want}: cannot load a cblas_sgemm from it; using the reference BLAS \
                 (expected openblas, reference, or the path of a CBLAS library)"
            );
            ffi::blas_select("reference");
        }
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    fn from(pairs: &[(&str, &str)]) -> Settings {
        let pairs: Vec<(String, String)> = pairs.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect();
        Settings::from_lookup(move |name| pairs.iter().find(|(k, _)| k == name).map(|(_, v)| v.clone()))
    }

    #[test]
    fn int8_keeps_f32_activations_for_qkv_o_and_down_only() {
        for (name, projection) in [
            ("model.layers.3.self_attn.q_proj", Projection::Qkv),
            ("k_proj", Projection::Qkv),
            ("v_proj", Projection::Qkv),
            ("model.layers.0.mlp.down_proj", Projection::Down),
            ("o_proj", Projection::Out),
            ("gate_proj", Projection::Other),
            ("up_proj", Projection::Other),
            ("lm_head", Projection::Other),
            ("fc", Projection::Other),
        ] {
            assert_eq!(Projection::of_name(name), projection, "{name}");
        }
        for p in Precision::ALL {
            let wide = if p == Precision::Int8 { Precision::F32 } else { p };
            for wide_input in [Projection::Qkv, Projection::Out, Projection::Down] {
                assert_eq!(p.of(wide_input), wide);
            }
            assert_eq!(p.of(Projection::Other), p);
        }
    }

    #[test]
    fn defaults_without_variables() {
        let s = from(&[]);
        assert!(
            s.qmm.value && s.dense.value && s.fast_norm_rope.value && s.sdpa.value && s.layer.value == LayerNodes::One
        );
        assert_eq!(s.max_isa, Setting { value: Isa::Avx512f, source: Source::Default });
        assert_eq!(s.process.pool_spin_us.value, 5000);
        assert_eq!(s.process.threads.value, None);
        assert!(s.process.gemv_routing.value);
        assert_eq!(s.python.value, "python3");
        assert!(s.entries().iter().all(|e| e.source == Source::Default));
        assert_eq!(s.entries().len(), 14);
        assert_eq!(s.precision.value, Precision::F32);
    }

    #[test]
    fn variables_and_their_sources() {
        let s = from(&[
            ("MLX_SPEC_QMM", "mlx"),
            ("MLX_SPEC_SDPA", "0"),
            ("MLX_SPEC_FAST", "on"),
            ("MLX_SPEC_QMM_ISA", "avx2"),
            ("MLX_SPEC_PRECISION", " BF16"),
            ("MLX_SPEC_QMM_THREADS", "3"),
            ("MLX_SPEC_POOL_SPIN_US", "100"),
            ("MLX_SPEC_GEMV", "off"),
            ("MLX_SPEC_CACHE", "/c"),
            ("XDG_CACHE_HOME", "/x"),
        ]);
        assert_eq!(s.qmm, Setting { value: false, source: Source::Env("MLX_SPEC_QMM") });
        assert!(!s.sdpa.value && s.fast_norm_rope.value && s.dense.value);
        assert_eq!(s.dense.source, Source::Default);
        assert_eq!(s.max_isa.value, Isa::Avx2Fma);
        assert_eq!(s.process.threads.value, Some(3));
        assert_eq!(s.process.pool_spin_us.value, 100);
        assert!(!s.process.gemv_routing.value);
        assert_eq!(s.cache_dir, Setting { value: PathBuf::from("/c"), source: Source::Env("MLX_SPEC_CACHE") });
        let p = s.kernel_policy();
        assert!(!p.qmm && p.dense && p.fast_norm_rope && !p.sdpa && p.max_isa == Isa::Avx2Fma);
        assert_eq!(s.precision, Setting { value: Precision::Bf16, source: Source::Env("MLX_SPEC_PRECISION") });
        assert_eq!(p.precision, Precision::Bf16);
        assert!(p.key().contains("precision=bf16"), "{}", p.key());
        let xdg = from(&[("XDG_CACHE_HOME", "/x"), ("HOME", "/h")]);
        assert_eq!(xdg.cache_dir.value, PathBuf::from("/x/mlx-spec"));
        assert_eq!(from(&[("HOME", "/h")]).cache_dir.value, PathBuf::from("/h/.cache/mlx-spec"));
    }

    #[test]
    fn values_that_do_not_parse_are_named_and_keep_the_default() {
        let s = from(&[
            ("MLX_SPEC_QMM_ISA", "avx9"),
            ("MLX_SPEC_POOL_SPIN_US", "abc"),
            ("MLX_SPEC_QMM_THREADS", "3"),
            ("MLX_SPEC_PRECISION", "int4"),
        ]);
        assert_eq!(s.max_isa, Setting { value: Isa::Avx512f, source: Source::Default });
        assert_eq!(s.precision, Setting { value: Precision::F32, source: Source::Default });
        assert_eq!(s.process.pool_spin_us.value, 5000);
        assert_eq!(
            s.invalid,
            [
                "MLX_SPEC_QMM_ISA=avx9: expected portable, avx2+fma or avx512f; using avx512f",
                "MLX_SPEC_PRECISION=int4: expected f32, bf16 or int8; using f32",
                "MLX_SPEC_POOL_SPIN_US=abc: expected a whole number; using 5000",
            ]
        );
        assert!(from(&[]).invalid.is_empty());
        let s = from(&[("MLX_SPEC_QMM", "false"), ("MLX_SPEC_SDPA", "maybe"), ("MLX_SPEC_QMM_THREADS", "0")]);
        assert!(!s.qmm.value && s.sdpa.value && s.process.threads.value.is_none());
        assert_eq!(
            s.invalid,
            [
                "MLX_SPEC_QMM_THREADS=0: expected at least 1; using one per core",
                "MLX_SPEC_SDPA=maybe: expected on or off (mlx, 0); using on",
            ]
        );
    }

    #[test]
    fn clones_share_counters_new_policies_do_not() {
        let a = KernelPolicy::all_on();
        let b = a.clone();
        a.count(Kernel::Qmm);
        b.count(Kernel::Sdpa);
        assert_eq!(a.calls(), KernelCalls { qmm: 1, sdpa: 1, ..KernelCalls::default() });
        assert_eq!(b.clone().with_new_counters().calls(), KernelCalls::default());
        assert_eq!(a, b);
        assert_ne!(a, KernelPolicy::mlx());
    }
}
