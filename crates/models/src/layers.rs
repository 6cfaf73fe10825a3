//! The building blocks whose weights may be dense or affine-quantized: [`Linear`],
//! [`Embedding`], and [`RmsNorm`]. They mirror mlx's `nn.Linear` / `nn.QuantizedLinear`,
//! `nn.Embedding` / `nn.QuantizedEmbedding` and `nn.RMSNorm`.
use mlx_core::quant::{self, QuantizedMatrix};
use mlx_core::{Array, Dtype, KernelPolicy, cpu_quant, fast};

use crate::Result;
use crate::config::QuantizationConfig;

/// How weights are turned into module parameters at load time; carried by
/// [`crate::loader::Loader`], which applies it to every tensor it hands out.
#[derive(Debug, Clone, Default)]
pub struct LoadContext {
    /// mlx-lm's quantization block of `config.json`.
    pub quant: QuantizationConfig,
    /// Cast dense weights, biases, norms and quantization scales/biases to this dtype
    /// (`None` keeps the stored dtypes, as mlx-lm does). On the MLX CPU backend f32 is the
    /// fast choice: f16/bf16 have no hardware conversion in the `mlx-cpu` wheel.
    pub dtype: Option<Dtype>,
    /// The CPU kernels the model's layers use ([`KernelPolicy::default`]: as the environment
    /// says). Every [`Linear`], [`Embedding`], [`RmsNorm`] and attention keeps a clone, so
    /// the loaded model runs on these kernels whatever other models in the process use.
    pub kernels: KernelPolicy,
}

/// `y = x @ W^T + b` with `W [out, in]` dense or quantized.
///
/// A quantized weight runs on the fast CPU kernel of [`mlx_core::cpu_quant`] on the CPU
/// backend when it qualifies (4 or 8 bits, float32 activations and scales: the default
/// `--dtype float32`), and on MLX's `quantized_matmul` otherwise (Metal, CUDA, f16/bf16,
/// other bit widths, or a [`KernelPolicy`] with `qmm` off). A dense float32 weight goes to
/// the same kernel for decode steps and verify windows ([`cpu_quant::dense_applies`]) and to
/// MLX's matmul (BLAS) otherwise. Each variant keeps the policy it was loaded with.
#[derive(Debug, Clone)]
pub enum Linear {
    /// Dense weight `[out, in]` and optional bias `[out]`.
    Dense {
        /// `[out, in]`.
        weight: Array,
        /// `[out]`.
        bias: Option<Array>,
        /// The kernels `forward` uses.
        kernels: KernelPolicy,
    },
    /// Quantized weight and optional dense bias `[out]`.
    Quantized {
        /// The packed matrix.
        weight: QuantizedMatrix,
        /// `[out]`.
        bias: Option<Array>,
        /// The kernels `forward` uses.
        kernels: KernelPolicy,
    },
}

impl Linear {
    /// The kernel policy this layer was loaded with.
    pub fn kernels(&self) -> &KernelPolicy {
        match self {
            Linear::Dense { kernels, .. } | Linear::Quantized { kernels, .. } => kernels,
        }
    }

    /// The quantized weight, `None` for a dense one.
    pub fn quantized(&self) -> Option<&QuantizedMatrix> {
        match self {
            Linear::Quantized { weight, .. } => Some(weight),
            Linear::Dense { .. } => None,
        }
    }

    /// The bias `[out]`, if any.
    pub fn bias(&self) -> Option<&Array> {
        match self {
            Linear::Quantized { bias, .. } | Linear::Dense { bias, .. } => bias.as_ref(),
        }
    }

    /// `x [..., in] -> [..., out]`.
    ///
    /// # Errors
    /// [`crate::Error::Mlx`] when `x`'s last axis is not `in`.
    pub fn forward(&self, x: &Array) -> Result<Array> {
        let (y, bias) = match self {
            Linear::Dense { weight, bias: Some(b), kernels } if !cpu_quant::dense_applies(weight, x, kernels) => {
                return Ok(b.addmm(x, &weight.t()?, 1.0, 1.0)?);
            }
            Linear::Dense { weight, bias, kernels } => (cpu_quant::dense_matmul_t_auto(x, weight, kernels)?, bias),
            Linear::Quantized { weight, bias, kernels } => (weight.matmul_t_auto(x, kernels)?, bias),
        };
        Ok(match bias {
            Some(b) => y.add(b)?,
            None => y,
        })
    }
}

/// The weights of `linears` when all of them can go to one node of the CPU kernel
/// (`mlx_core::cpu_quant`) under the first one's [`KernelPolicy`].
enum Fusable<'a> {
    /// All quantized with one spec, kernel on, `x`'s dtype taken.
    Quantized(Vec<&'a QuantizedMatrix>),
    /// All dense, each [`cpu_quant::dense_applies`].
    Dense(Vec<&'a Array>),
}

fn fusable<'a>(linears: &[&'a Linear], x: &Array) -> Option<Fusable<'a>> {
    let kernels = linears.first()?.kernels();
    let quantized: Option<Vec<&QuantizedMatrix>> = linears
        .iter()
        .map(|l| match l {
            Linear::Quantized { weight, .. } => Some(weight),
            Linear::Dense { .. } => None,
        })
        .collect();
    if let Some(mats) = quantized {
        let first = mats.first()?;
        let ok = kernels.uses_qmm() && mats.iter().all(|m| m.spec == first.spec && cpu_quant::supports(m, x.dtype()));
        return ok.then_some(Fusable::Quantized(mats));
    }
    let dense: Vec<&Array> = linears
        .iter()
        .map(|l| match l {
            Linear::Dense { weight, .. } if cpu_quant::dense_applies(weight, x, kernels) => Some(weight),
            _ => None,
        })
        .collect::<Option<_>>()?;
    Some(Fusable::Dense(dense))
}

/// `[l.forward(x) for l in linears]`, as one graph node when `fusable` (a layer's q/k/v
/// projections on the CPU backend; biases are added after). Same shapes and values as
/// calling [`Linear::forward`] on each. The fused node follows the first linear's policy.
///
/// # Errors
/// [`crate::Error::Mlx`] when `x`'s last axis is not the linears' `in`.
pub fn forward_many(linears: &[&Linear], x: &Array) -> Result<Vec<Array>> {
    let ys = match fusable(linears, x) {
        Some(Fusable::Quantized(mats)) => cpu_quant::quantized_matmuls_t(x, &mats, linears[0].kernels())?,
        Some(Fusable::Dense(weights)) => cpu_quant::dense_matmuls_t(x, &weights, linears[0].kernels())?,
        None => return linears.iter().map(|l| l.forward(x)).collect(),
    };
    ys.into_iter()
        .zip(linears)
        .map(|(y, l)| match l {
            Linear::Quantized { bias: Some(b), .. } | Linear::Dense { bias: Some(b), .. } => Ok(y.add(b)?),
            _ => Ok(y),
        })
        .collect()
}

/// The SwiGLU of a llama-style MLP, `silu(gate(x)) * up(x)` (`nn.silu(gate) * up` in mlx-lm),
/// `x [..., H] -> [..., I]`: one graph node when `gate` and `up` are bias-free matrices the
/// CPU kernel takes (quantized, or dense for short inputs), else the five separate ops.
///
/// # Errors
/// [`crate::Error::Mlx`] when `x`'s last axis is not `H`.
pub fn swiglu(gate: &Linear, up: &Linear, x: &Array) -> Result<Array> {
    let no_bias = |l: &Linear| matches!(l, Linear::Quantized { bias: None, .. } | Linear::Dense { bias: None, .. });
    if no_bias(gate) && no_bias(up) {
        match fusable(&[gate, up], x) {
            Some(Fusable::Quantized(m)) => return Ok(cpu_quant::swiglu_t(x, m[0], m[1], gate.kernels())?),
            Some(Fusable::Dense(w)) => return Ok(cpu_quant::dense_swiglu_t(x, w[0], w[1], gate.kernels())?),
            None => {}
        }
    }
    let g = gate.forward(x)?;
    Ok(g.multiply(&g.sigmoid()?)?.multiply(&up.forward(x)?)?)
}

/// Token embedding table `[V, H]`, dense or quantized; also usable as the tied LM head.
#[derive(Debug, Clone)]
pub struct Embedding {
    /// The table.
    pub table: EmbeddingTable,
    /// The kernels of the tied LM head ([`Embedding::as_linear`]).
    pub kernels: KernelPolicy,
}

/// The weights of an [`Embedding`].
#[derive(Debug, Clone)]
pub enum EmbeddingTable {
    /// `[V, H]`.
    Dense(Array),
    /// Packed `[V, H]`; rows are gathered, then dequantized (as `nn.QuantizedEmbedding`).
    Quantized(QuantizedMatrix),
}

impl Embedding {
    /// `ids [...]` (integer) -> `[..., H]`.
    ///
    /// # Errors
    /// [`crate::Error::Mlx`] for non-integer ids.
    pub fn forward(&self, ids: &Array) -> Result<Array> {
        Ok(match &self.table {
            EmbeddingTable::Dense(w) => w.take(ids, 0)?,
            EmbeddingTable::Quantized(q) => {
                let rows = |a: &Array| a.take(ids, 0);
                quant::dequantize(&rows(&q.weight)?, &rows(&q.scales)?, &rows(&q.biases)?, q.spec)?
            }
        })
    }

    /// The tied LM head: `x [..., H] -> logits [..., V]` (`x @ E^T`).
    ///
    /// # Errors
    /// [`crate::Error::Mlx`] when `x`'s last axis is not `H`.
    pub fn as_linear(&self, x: &Array) -> Result<Array> {
        Ok(match &self.table {
            EmbeddingTable::Dense(w) => cpu_quant::dense_matmul_t_auto(x, w, &self.kernels)?,
            EmbeddingTable::Quantized(q) => q.matmul_t_auto(x, &self.kernels)?,
        })
    }
}

/// RMS norm with a learned scale `[H]` (`nn.RMSNorm`, `mx.fast.rms_norm`).
#[derive(Debug, Clone)]
pub struct RmsNorm {
    /// `[H]`.
    pub weight: Array,
    /// Added to the mean square.
    pub eps: f32,
    /// The kernels `forward` uses.
    pub kernels: KernelPolicy,
    /// Scale by the weight in f32 and cast afterwards (transformers' `Gemma4RMSNorm`), instead
    /// of casting the normalized input to its dtype first and scaling in that dtype
    /// (`mx.fast.rms_norm`, `Qwen3RMSNorm`). The same for f32 inputs.
    pub weight_in_f32: bool,
}

impl RmsNorm {
    /// `x [..., H] -> [..., H]`.
    ///
    /// # Errors
    /// [`crate::Error::Mlx`] when the last axis is not `H`.
    pub fn forward(&self, x: &Array) -> Result<Array> {
        if self.weight_in_f32 && x.dtype() != Dtype::Float32 {
            let (xf, wf) = (x.astype(Dtype::Float32)?, self.weight.astype(Dtype::Float32)?);
            return Ok(fast::rms_norm(&xf, Some(&wf), self.eps, &self.kernels)?.astype(x.dtype())?);
        }
        Ok(fast::rms_norm(x, Some(&self.weight), self.eps, &self.kernels)?)
    }
}
