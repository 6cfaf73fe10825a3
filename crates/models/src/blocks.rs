//! The blocks shared by the target decoders (`transformer.rs`, `gemma.rs`) and the DSpark
//! drafters (`drafter::Drafter`): one attention, one gated MLP, one GELU-tanh and one
//! proportional RoPE table. Each takes its projections through the fused CPU paths of
//! [`crate::layers`] ([`forward_many`] for q/k/v, [`swiglu`] for gate/up), which give the
//! same values as the separate projections.
use mlx_core::fast::{AttentionMask, Rope, rms_norm, scaled_dot_product_attention};
use mlx_core::{Array, KernelPolicy};

use crate::Result;
use crate::cache::LayerCache;
use crate::layers::{Linear, RmsNorm, forward_many, swiglu};

/// `0.5 * x * (1 + tanh(sqrt(2 / pi) * (x + 0.044715 * x^3)))`, in `x`'s dtype: mlx's
/// `nn.gelu_approx` (mlx-lm's Gemma MLPs) and PyTorch's `gelu(approximate="tanh")`
/// (`gelu_pytorch_tanh`, the DSpark Gemma 4 drafter).
///
/// # Errors
/// [`crate::Error::Mlx`] if an op fails.
pub fn gelu_tanh(x: &Array) -> Result<Array> {
    let d = x.dtype();
    let s = |v: f64| Array::scalar_as(v, d);
    let cube = x.power(&s(3.0)?)?;
    let inner = x.add(&cube.multiply(&s(0.044715)?)?)?.multiply(&s((2.0 / std::f64::consts::PI).sqrt())?)?;
    let half_x = x.multiply(&s(0.5)?)?;
    Ok(half_x.multiply(&inner.tanh()?.add(&s(1.0)?)?)?)
}

/// A proportional (partial) RoPE over `dims` head dimensions: the first
/// `ceil(floor(dims * partial_rotary_factor) / 2)` pairs rotate with frequency
/// `factor * base^(2j / dims)` (wavelengths, as [`Rope::freqs`] takes them), the other pairs
/// not at all (infinite wavelength). mlx-lm's `ProportionalRoPE` (`models/rope_utils.py`,
/// Gemma 4 full-attention layers) and transformers' `_compute_proportional_rope_parameters`
/// (the DSpark drafters).
///
/// # Errors
/// [`crate::Error::Unsupported`] for `partial_rotary_factor` above 1;
/// [`crate::Error::Mlx`] if the table cannot be built.
pub fn proportional_rope(
    dims: usize,
    base: f64,
    partial_rotary_factor: f64,
    factor: f64,
    traditional: bool,
) -> Result<Rope> {
    let rotated = (dims as f64 * partial_rotary_factor) as usize;
    if rotated > dims {
        return Err(crate::Error::Unsupported(format!("partial_rotary_factor {partial_rotary_factor} > 1")));
    }
    let (f, b) = (factor as f32, base as f32);
    let mut freqs: Vec<f32> = (0..rotated).step_by(2).map(|i| f * b.powf(i as f32 / dims as f32)).collect();
    freqs.extend(std::iter::repeat_n(f32::INFINITY, (dims - rotated) / 2));
    let n = freqs.len() as i32;
    Ok(Rope { dims: dims as i32, traditional, base: b, scale: 1.0, freqs: Some(Array::from_slice(&freqs, &[n])?) })
}

/// Multi-head attention with grouped key/value heads (mlx-lm's `Attention` of
/// `models/llama.py`, `qwen3.py`, `gemma3_text.py`, `gemma4_text.py`; DeepSpec's DSpark
/// attention): `x [B, L, H]` is projected to queries `[B, n_heads, L, head_dim]` and keys and
/// values `[B, n_kv_heads, L, head_dim]`, optionally RMS-normed per head (`q_norm`,
/// `k_norm`, a weightless norm on values), roped, attended and projected back by `o_proj`.
#[derive(Debug, Clone)]
pub struct Attention {
    /// `[n_heads * head_dim, H]`.
    pub q_proj: Linear,
    /// `[n_kv_heads * head_dim, H]`; `None` on a layer that reuses another layer's keys and
    /// values (Gemma 4 KV sharing).
    pub k_proj: Option<Linear>,
    /// `[n_kv_heads * head_dim, H]`; `None` when the values are the keys' projection
    /// (`attention_k_eq_v`) or with no `k_proj`.
    pub v_proj: Option<Linear>,
    /// `[H, n_heads * head_dim]`.
    pub o_proj: Linear,
    /// Per-head query norm `[head_dim]` (qwen3, Gemma, DSpark).
    pub q_norm: Option<RmsNorm>,
    /// Per-head key norm `[head_dim]`.
    pub k_norm: Option<RmsNorm>,
    /// A scale-free RMS norm on values with this epsilon (Gemma 4).
    pub v_norm_eps: Option<f32>,
    /// Query heads.
    pub n_heads: i32,
    /// Key/value heads.
    pub n_kv_heads: i32,
    /// Per-head width.
    pub head_dim: i32,
    /// Softmax scale.
    pub scale: f32,
}

impl Attention {
    /// The CPU kernels of this layer's attention, norms and RoPE: its output projection's
    /// ([`Linear::kernels`], whose precision is the one [`mlx_core::Precision::of`] gives that
    /// projection, not necessarily the model's).
    pub fn kernels(&self) -> &KernelPolicy {
        self.o_proj.kernels()
    }

    /// Queries `[B, n_heads, L, head_dim]` and, when the layer has its own `k_proj`, keys
    /// and values `[B, n_kv_heads, L, head_dim]` of `x [B, L, H]`, roped from position
    /// `offset` (values are not roped).
    ///
    /// # Errors
    /// [`crate::Error::Mlx`] on shape problems.
    pub fn project(&self, x: &Array, rope: &Rope, offset: i32) -> Result<(Array, Option<(Array, Array)>)> {
        let s = x.shape();
        let (b, l) = (s[0], s[1]);
        let mut linears = vec![&self.q_proj];
        linears.extend(self.k_proj.iter());
        linears.extend(self.v_proj.iter().filter(|_| self.k_proj.is_some()));
        let ys = forward_many(&linears, x)?;
        let q = rope.apply(&self.heads(&ys[0], self.n_heads, self.q_norm.as_ref(), b, l)?, offset, self.kernels())?;
        let kv = match ys.get(1) {
            Some(k_raw) => Some(self.roped_kv(k_raw, ys.get(2), rope, offset, b, l)?),
            None => None,
        };
        Ok((q, kv))
    }

    /// Keys and values `[B, n_kv_heads, L, head_dim]` of `x [B, L, H]` (keys roped from
    /// `offset`), without the queries: the DSpark context rows.
    ///
    /// # Errors
    /// [`crate::Error::Unsupported`] for a layer without `k_proj`; [`crate::Error::Mlx`] on
    /// shape problems.
    pub fn keys_values(&self, x: &Array, rope: &Rope, offset: i32) -> Result<(Array, Array)> {
        let s = x.shape();
        let (b, l) = (s[0], s[1]);
        let k_proj = self
            .k_proj
            .as_ref()
            .ok_or_else(|| crate::Error::Unsupported("an attention layer without k_proj".into()))?;
        let mut linears = vec![k_proj];
        linears.extend(self.v_proj.iter());
        let ys = forward_many(&linears, x)?;
        self.roped_kv(&ys[0], ys.get(1), rope, offset, b, l)
    }

    /// `y [B, L, n * head_dim]` as heads `[B, n, L, head_dim]`, normed per head by `norm`.
    fn heads(&self, y: &Array, n: i32, norm: Option<&RmsNorm>, b: i32, l: i32) -> Result<Array> {
        let y = y.reshape(&[b, l, n, self.head_dim])?;
        let y = match norm {
            Some(nrm) => nrm.forward(&y)?,
            None => y,
        };
        Ok(y.transpose(&[0, 2, 1, 3])?)
    }

    /// Keys (normed, roped) and values (the keys' projection when `v_raw` is `None`; the
    /// scale-free norm when configured) as heads.
    fn roped_kv(
        &self,
        k_raw: &Array,
        v_raw: Option<&Array>,
        rope: &Rope,
        offset: i32,
        b: i32,
        l: i32,
    ) -> Result<(Array, Array)> {
        let k = rope.apply(&self.heads(k_raw, self.n_kv_heads, self.k_norm.as_ref(), b, l)?, offset, self.kernels())?;
        let v = v_raw.unwrap_or(k_raw).reshape(&[b, l, self.n_kv_heads, self.head_dim])?;
        let v = match self.v_norm_eps {
            Some(eps) => rms_norm(&v, None, eps, self.kernels())?,
            None => v,
        };
        Ok((k, v.transpose(&[0, 2, 1, 3])?))
    }

    /// `o_proj(attention(q, k, v))` `[B, L, H]` for queries `[B, n_heads, L, head_dim]` and
    /// keys/values `[B, n_kv_heads, T, head_dim]`.
    ///
    /// # Errors
    /// [`crate::Error::Mlx`] on shape problems.
    pub fn attend(&self, q: &Array, k: &Array, v: &Array, mask: AttentionMask) -> Result<Array> {
        let s = q.shape();
        let (b, l) = (s[0], s[2]);
        let o = scaled_dot_product_attention(q, k, v, self.scale, mask, self.kernels())?;
        self.o_proj.forward(&o.transpose(&[0, 2, 1, 3])?.reshape(&[b, l, -1])?)
    }

    /// The attention of `x [B, L, H]` over `cache` plus `x` (appended to `cache` at its
    /// offset): causal when `causal` and `L > 1` (the target decoders), unmasked otherwise
    /// (the DSpark draft block sees the whole context and block). Returns `[B, L, H]`.
    ///
    /// # Errors
    /// [`crate::Error::Unsupported`] for a layer without `k_proj`; [`crate::Error::Mlx`] on
    /// shape problems.
    pub fn forward(&self, x: &Array, cache: &mut dyn LayerCache, rope: &Rope, causal: bool) -> Result<Array> {
        let l = x.shape()[1];
        let (q, kv) = self.project(x, rope, cache.offset() as i32)?;
        let (k, v) = kv.ok_or_else(|| crate::Error::Unsupported("an attention layer without k_proj".into()))?;
        let (k, v) = cache.update_and_fetch(&k, &v)?;
        let mask = if causal && l > 1 { AttentionMask::Causal } else { AttentionMask::None };
        self.attend(&q, &k, &v, mask)
    }

    /// [`Attention::forward`] of several requests at once: `x [1, R, H]` holds their rows one
    /// after another (`lens[i]` rows of request `i`, `R = sum(lens)`), `caches[i]` is request
    /// `i`'s cache. The projections run once over all `R` rows (each weight row read once for
    /// every request); queries, keys and values are then split by request, roped from that
    /// request's offset, appended to its cache and attended causally over it alone, and the
    /// outputs are concatenated back to `[1, R, H]` for the output projection. Every step is
    /// row-wise or per request, so a request's rows equal its own [`Attention::forward`]'s
    /// whenever the projections' kernels are row-invariant (the CPU kernels of
    /// [`mlx_core::cpu_quant`]).
    ///
    /// # Errors
    /// As [`Attention::forward`]; [`crate::Error::Unsupported`] when `lens` and `caches`
    /// differ in length.
    pub fn forward_batch(
        &self,
        x: &Array,
        caches: &mut [&mut (dyn LayerCache + 'static)],
        lens: &[i32],
        rope: &Rope,
    ) -> Result<Array> {
        if caches.len() != lens.len() {
            return Err(crate::Error::Unsupported(format!("{} caches for {} requests", caches.len(), lens.len())));
        }
        let k_proj = self
            .k_proj
            .as_ref()
            .ok_or_else(|| crate::Error::Unsupported("an attention layer without k_proj".into()))?;
        let mut linears = vec![&self.q_proj, k_proj];
        linears.extend(self.v_proj.iter());
        let ys = forward_many(&linears, x)?;
        if let Some(o) = self.attend_batch_roped_once(&ys, caches, lens, rope)? {
            return self.o_proj.forward(&o);
        }
        let mut outs = Vec::with_capacity(lens.len());
        let mut start = 0;
        for (cache, &l) in caches.iter_mut().zip(lens) {
            let rows = |y: &Array| y.slice_axis(1, start, start + l);
            let offset = cache.offset() as i32;
            let q = rope.apply(
                &self.heads(&rows(&ys[0])?, self.n_heads, self.q_norm.as_ref(), 1, l)?,
                offset,
                self.kernels(),
            )?;
            let v_raw = ys.get(2).map(rows).transpose()?;
            let (k, v) = self.roped_kv(&rows(&ys[1])?, v_raw.as_ref(), rope, offset, 1, l)?;
            let (k, v) = cache.update_and_fetch(&k, &v)?;
            let mask = if l > 1 { AttentionMask::Causal } else { AttentionMask::None };
            let o = scaled_dot_product_attention(&q, &k, &v, self.scale, mask, self.kernels())?;
            outs.push(o.transpose(&[0, 2, 1, 3])?.reshape(&[1, l, -1])?);
            start += l;
        }
        let o = mlx_core::concatenate(&outs.iter().collect::<Vec<_>>(), 1)?;
        self.o_proj.forward(&o)
    }

    /// The fast path of [`Attention::forward_batch`] where RoPE runs as the CPU node: queries
    /// and keys of all requests as heads at once (`[1, n, R, head_dim]`), roped in one node
    /// each with every row at its request's position ([`Rope::apply_at`]); then per request
    /// only the cache write and the attention over its rows. The attention outputs
    /// `[1, R, n_heads * head_dim]`; `None` when the RoPE node does not apply.
    fn attend_batch_roped_once(
        &self,
        ys: &[Array],
        caches: &mut [&mut (dyn LayerCache + 'static)],
        lens: &[i32],
        rope: &Rope,
    ) -> Result<Option<Array>> {
        let r: i32 = lens.iter().sum();
        let positions: Vec<i32> = caches
            .iter()
            .zip(lens)
            .flat_map(|(c, &l)| {
                let offset = c.offset() as i32;
                offset..offset + l
            })
            .collect();
        let positions = Array::from_slice(&positions, &[r])?;
        let q = self.heads(&ys[0], self.n_heads, self.q_norm.as_ref(), 1, r)?;
        let Some(q) = rope.apply_at(&q, &positions, self.kernels())? else { return Ok(None) };
        let k = self.heads(&ys[1], self.n_kv_heads, self.k_norm.as_ref(), 1, r)?;
        let Some(k) = rope.apply_at(&k, &positions, self.kernels())? else { return Ok(None) };
        let v = ys.get(2).unwrap_or(&ys[1]).reshape(&[1, r, self.n_kv_heads, self.head_dim])?;
        let v = match self.v_norm_eps {
            Some(eps) => rms_norm(&v, None, eps, self.kernels())?,
            None => v,
        };
        let v = v.transpose(&[0, 2, 1, 3])?;
        let mut outs = Vec::with_capacity(lens.len());
        let mut start = 0;
        for (cache, &l) in caches.iter_mut().zip(lens) {
            let rows = |a: &Array| a.slice_axis(2, start, start + l);
            let (k, v) = cache.update_and_fetch(&rows(&k)?, &rows(&v)?)?;
            let mask = if l > 1 { AttentionMask::Causal } else { AttentionMask::None };
            outs.push(scaled_dot_product_attention(&rows(&q)?, &k, &v, self.scale, mask, self.kernels())?);
            start += l;
        }
        let o = mlx_core::concatenate(&outs.iter().collect::<Vec<_>>(), 2)?;
        Ok(Some(o.transpose(&[0, 2, 1, 3])?.reshape(&[1, r, -1])?))
    }
}

/// The activation of a gated MLP.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Activation {
    /// `silu(gate) * up` (llama, qwen, the DSpark Qwen3 drafter), on the fused
    /// [`swiglu`] path.
    Silu,
    /// `gelu_tanh(gate) * up` (Gemma, the DSpark Gemma 4 drafter).
    GeluTanh,
}

/// The gated MLP `down(act(gate(x)) * up(x))`, `x [..., H] -> [..., H]` through width `I`
/// (mlx-lm's `MLP` of `models/llama.py` and `gemma3_text.py`).
#[derive(Debug, Clone)]
pub struct Mlp {
    /// `[I, H]`.
    pub gate_proj: Linear,
    /// `[I, H]`.
    pub up_proj: Linear,
    /// `[H, I]`.
    pub down_proj: Linear,
    /// The gate's activation.
    pub act: Activation,
}

impl Mlp {
    /// `x [..., H] -> [..., H]`.
    ///
    /// # Errors
    /// [`crate::Error::Mlx`] when `x`'s last axis is not `H`.
    pub fn forward(&self, x: &Array) -> Result<Array> {
        let inner = match self.act {
            Activation::Silu => swiglu(&self.gate_proj, &self.up_proj, x)?,
            Activation::GeluTanh => gelu_tanh(&self.gate_proj.forward(x)?)?.multiply(&self.up_proj.forward(x)?)?,
        };
        self.down_proj.forward(&inner)
    }
}
