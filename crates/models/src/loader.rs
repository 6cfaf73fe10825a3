//! A scoped, strict weight loader: a prefix handle over [`Weights`] in the spirit of
//! candle's `VarBuilder` (`vb.pp("self_attn")`), with mlx-lm's strict-by-default policy
//! (`load_model(strict=True)` after each model's `sanitize`).
//!
//! ```text
//! let mut root = Loader::new(&mut weights, &ctx);
//! let mut attn = root.pp("model.layers.0").pp("self_attn");
//! let q = attn.linear("q_proj", n_heads * head_dim, hidden, false)?;  // model.layers.0.self_attn.q_proj
//! ...
//! root.finish(family_ignore_list)?;   // a tensor nothing took is an error naming it
//! ```
//!
//! Every tensor goes through one place: shapes are checked against what the architecture
//! expects, and floating-point parameters (dense weights, biases, norms, quantization
//! scales/biases) are cast to [`LoadContext::dtype`]. A missing tensor, a wrong shape or a
//! tensor no module took is an [`Error::Weight`] / [`Error::Unused`] naming it.
use std::fmt::Display;
use std::path::Path;

use mlx_core::quant::{QuantSpec, QuantizedMatrix};
use mlx_core::{Array, Dtype, Projection};

use crate::layers::{Embedding, EmbeddingTable, Linear, LoadContext, RmsNorm};
use crate::weights::Weights;
use crate::{Error, Result};

/// The tensors that make up one (possibly quantized) module: `<base>.weight` and, when
/// quantized, `<base>.scales` and `<base>.biases`, and an optional `<base>.bias`.
const MODULE_TENSORS: [&str; 4] = ["weight", "scales", "biases", "bias"];

/// A handle on the weights of one model directory at a name prefix (`""` at the root).
/// Child handles ([`Loader::pp`]) borrow the parent, so tensors are taken from one store.
#[derive(Debug)]
pub struct Loader<'a> {
    weights: &'a mut Weights,
    ctx: &'a LoadContext,
    prefix: String,
}

impl<'a> Loader<'a> {
    /// A root handle over `weights`, turning tensors into parameters as `ctx` says.
    pub fn new(weights: &'a mut Weights, ctx: &'a LoadContext) -> Self {
        Loader { weights, ctx, prefix: String::new() }
    }

    /// The handle for the sub-module `name` (`pp("self_attn")` under `model.layers.0` is
    /// `model.layers.0.self_attn`); `name` may hold dots or be a layer index.
    pub fn pp(&mut self, name: impl Display) -> Loader<'_> {
        let prefix = self.path(&name.to_string());
        Loader { weights: self.weights, ctx: self.ctx, prefix }
    }

    /// The full tensor name of `name` under this prefix.
    pub fn path(&self, name: &str) -> String {
        match (self.prefix.is_empty(), name.is_empty()) {
            (true, _) => name.to_string(),
            (false, true) => self.prefix.clone(),
            (false, false) => format!("{}.{name}", self.prefix),
        }
    }

    /// How tensors become parameters (quantization entries, dtype).
    pub fn ctx(&self) -> &LoadContext {
        self.ctx
    }

    /// The model directory (for error messages).
    pub fn dir(&self) -> &Path {
        self.weights.dir()
    }

    /// Whether the tensor `name` (under this prefix) is present and not yet taken.
    pub fn contains(&self, name: &str) -> bool {
        self.weights.contains(&self.path(name))
    }

    /// Drops the tensors of module `name` (`.weight`, `.scales`, `.biases`, `.bias`) if
    /// present: what mlx-lm's `sanitize` removes depending on the config (a stored `lm_head`
    /// with tied embeddings, the keys/values of Gemma 4's KV-shared layers).
    pub fn discard(&mut self, name: &str) {
        let base = self.path(name);
        for t in MODULE_TENSORS {
            self.weights.take_opt(&format!("{base}.{t}"));
        }
    }

    /// The tensor `name` of shape `shape`, cast to the load dtype when it is floating point.
    ///
    /// # Errors
    /// [`Error::Weight`] naming the tensor when it is missing or has another shape;
    /// [`Error::Mlx`] if the cast fails.
    pub fn param(&mut self, name: &str, shape: &[i32]) -> Result<Array> {
        let a = self.weights.take_shaped(&self.path(name), shape)?;
        self.cast(a)
    }

    /// The linear layer `name` (`y = x W^T + b`, `W [out, in]`): dense `<name>.weight`, or
    /// quantized when `<name>.scales` exists (mlx-lm's rule; bits and group size inferred from
    /// the shapes and checked against the config's `quantization` entry); `<name>.bias`
    /// `[out]` when `bias`. Its kernels: the context's, in the precision
    /// [`mlx_core::Precision::of`] gives its [`Projection`] (named by `name`).
    ///
    /// # Errors
    /// [`Error::Weight`] naming the tensor when one is missing or misshapen, or when the
    /// packed shapes disagree with the config's bits/group size.
    pub fn linear(&mut self, name: &str, out: usize, inp: usize, bias: bool) -> Result<Linear> {
        let base = self.path(name);
        let b = if bias { Some(self.param(&format!("{name}.bias"), &[out as i32])?) } else { None };
        let policy = &self.ctx.kernels;
        let kernels = policy.clone().with_precision(policy.precision.of(Projection::of_name(name)));
        if let Some(q) = self.quantized(&base, out, inp)? {
            return Ok(Linear::Quantized { weight: q, bias: b, kernels });
        }
        let weight = self.param(&format!("{name}.weight"), &[out as i32, inp as i32])?;
        Ok(Linear::Dense { weight, bias: b, kernels })
    }

    /// The embedding table `name` of shape `[vocab, hidden]`, dense or quantized.
    ///
    /// # Errors
    /// As [`Loader::linear`].
    pub fn embedding(&mut self, name: &str, vocab: usize, hidden: usize) -> Result<Embedding> {
        let base = self.path(name);
        if let Some(q) = self.quantized(&base, vocab, hidden)? {
            return Ok(Embedding { table: EmbeddingTable::Quantized(q), kernels: self.ctx.kernels.clone() });
        }
        let table = EmbeddingTable::Dense(self.param(&format!("{name}.weight"), &[vocab as i32, hidden as i32])?);
        Ok(Embedding { table, kernels: self.ctx.kernels.clone() })
    }

    /// The RMS norm `name` (`<name>.weight` `[dim]`) with epsilon `eps`.
    ///
    /// # Errors
    /// [`Error::Weight`] naming the tensor when it is missing or misshapen.
    pub fn norm(&mut self, name: &str, dim: usize, eps: f32) -> Result<RmsNorm> {
        Ok(RmsNorm {
            weight: self.param(&format!("{name}.weight"), &[dim as i32])?,
            eps,
            kernels: self.ctx.kernels.clone(),
            weight_in_f32: false,
        })
    }

    /// Ends loading: every tensor left in the store must match `ignore`, the family's list
    /// of tensors the architecture does not use (mlx-lm's `sanitize`: an entry matches a
    /// name equal to it or ending in `.<entry>`, e.g. `rotary_emb.inv_freq`). Ignored
    /// tensors are dropped.
    ///
    /// # Errors
    /// [`Error::Unused`] naming the directory and every leftover tensor.
    pub fn finish(self, ignore: &[&str]) -> Result<()> {
        let leftover: Vec<String> = self
            .weights
            .unused()
            .into_iter()
            .filter(|name| !ignore.iter().any(|i| name == i || name.ends_with(&format!(".{i}"))))
            .map(str::to_string)
            .collect();
        if !leftover.is_empty() {
            return Err(Error::Unused { path: self.weights.dir().into(), names: leftover });
        }
        let ignored: Vec<String> = self.weights.unused().into_iter().map(str::to_string).collect();
        if !ignored.is_empty() {
            tracing::debug!(dir = %self.weights.dir().display(), ?ignored, "tensors ignored by the family's list");
        }
        for name in ignored {
            self.weights.take_opt(&name);
        }
        Ok(())
    }

    /// `a` cast to [`LoadContext::dtype`] when both are floating point and differ.
    fn cast(&self, a: Array) -> Result<Array> {
        Ok(match self.ctx.dtype {
            Some(d) if a.dtype().is_float() && a.dtype() != d => a.astype(d)?,
            _ => a,
        })
    }

    /// The quantized matrix `base` if `<base>.scales` exists (mlx-lm's rule), with bits and
    /// group size inferred from the shapes for a `[out, in]` matrix and checked against the
    /// config entry.
    fn quantized(&mut self, base: &str, out: usize, inp: usize) -> Result<Option<QuantizedMatrix>> {
        let scales_name = format!("{base}.scales");
        let weight_name = format!("{base}.weight");
        if !self.weights.contains(&scales_name) {
            // A packed weight without its scales is a damaged quantized checkpoint, not a
            // dense matrix of the wrong shape.
            let packed = self.weights.get(&weight_name).is_some_and(|w| w.dtype() == Dtype::Uint32);
            if packed && self.ctx.quant.spec_for(base).is_some() {
                return Err(Error::Weight {
                    path: self.weights.dir().into(),
                    name: scales_name,
                    message: format!(
                        "missing from the weight files: `{weight_name}` is packed uint32 (config.json's \
                         quantization block quantizes it), so its scales and biases must be there too"
                    ),
                });
            }
            return Ok(None);
        }
        let weight = self.weights.take(&weight_name)?;
        let scales = self.weights.take(&scales_name)?;
        let scales = self.cast(scales)?;
        let biases = self.weights.take(&format!("{base}.biases"))?;
        let biases = self.cast(biases)?;
        let bad =
            |message: String| Error::Weight { path: self.weights.dir().into(), name: weight_name.clone(), message };
        let (ws, ss) = (weight.shape(), scales.shape());
        // With the config's bits and group size, the shapes give the matrix the weights
        // really hold: a mismatch is a wrong size in config.json, not a strange quantization.
        if let (Some(cfg), [wo, wi], [so, si]) = (self.ctx.quant.spec_for(base), ws.as_slice(), ss.as_slice()) {
            let held = (*wo as usize, *wi as usize * 32 / cfg.bits as usize);
            if held != (out, inp) && wo == so && held.1 == *si as usize * cfg.group_size as usize {
                return Err(bad(format!(
                    "the weights hold a [{}, {}] matrix ({}-bit, group {}: packed {ws:?}, scales {ss:?}), \
                     but config.json's sizes make it [{out}, {inp}]: check hidden_size, intermediate_size, \
                     num_attention_heads, num_key_value_heads, head_dim and vocab_size",
                    held.0, held.1, cfg.bits, cfg.group_size
                )));
            }
        }
        if ws.len() != 2 || ss.len() != 2 || ws[0] as usize != out || ss[0] as usize != out || ss[1] == 0 {
            return Err(bad(format!("quantized [{out}, {inp}] matrix has packed shape {ws:?} and scales {ss:?}")));
        }
        if weight.dtype() != Dtype::Uint32 {
            return Err(bad(format!("packed weight has dtype {:?}, expected uint32", weight.dtype())));
        }
        let bits = (ws[1] as usize * 32) / inp;
        let group_size = inp / ss[1] as usize;
        if bits * inp != ws[1] as usize * 32 || group_size * ss[1] as usize != inp {
            return Err(bad(format!(
                "packed shape {ws:?} / scales {ss:?} do not divide a [{out}, {inp}] matrix into whole bits and groups"
            )));
        }
        let inferred = QuantSpec::new(group_size as i32, bits as i32)
            .map_err(|e| bad(format!("packed shape {ws:?} / scales {ss:?} imply {e}")))?;
        if let Some(cfg) = self.ctx.quant.spec_for(base)
            && cfg != inferred
        {
            return Err(bad(format!(
                "config says bits {} group {}, the tensor shapes say bits {bits} group {group_size}",
                cfg.bits, cfg.group_size
            )));
        }
        if biases.shape() != ss {
            return Err(bad(format!("biases {:?} differ from scales {ss:?}", biases.shape())));
        }
        Ok(Some(QuantizedMatrix { weight, scales, biases, spec: inferred }))
    }
}
