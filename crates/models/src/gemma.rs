//! The Gemma family decoders, following mlx-lm's `models/gemma3_text.py` (Gemma 3 text)
//! and `models/gemma4_text.py` (Gemma 4 text):
//!
//! ```text
//! h = embed(tokens) * sqrt(H)                        gemma3: sqrt(H) rounded to bf16
//! for each layer (sliding or full attention):
//!     a = attn(input_norm(h))                        q/k RMS norms per head, rope per layer type
//!     h = h + post_attn_norm(a)                      "sandwich" norms
//!     m = down(gelu_tanh(gate(x)) * up(x)),  x = pre_ff_norm(h)
//!     h = h + post_ff_norm(m)
//!     gemma4: + per-layer-input gate (when configured), then h *= layer_scalar
//! logits = lm_head(norm(h))                          gemma4: tanh(logits / c) * c
//! ```
//!
//! - **Gemma 3**: norms scale by `1 + w`; sliding layers are those with
//!   `(i + 1) % sliding_window_pattern != 0` (rope base `rope_local_base_freq`), the rest are
//!   global (rope base `rope_theta`, optional linear `rope_scaling`); queries are scaled by
//!   `query_pre_attn_scalar^-0.5`.
//! - **Gemma 4**: the layer-type schedule `layer_types` (default: `sliding_window_pattern - 1`
//!   sliding then one full), full layers with `global_head_dim` and a proportional partial
//!   rope (`rope_parameters.full_attention.partial_rotary_factor`), plain-weight norms, a
//!   scale-free RMS norm on values, attention scale 1, `attention_k_eq_v` (values are the
//!   keys' projection on full layers, with `num_global_key_value_heads`), KV sharing (the last
//!   `num_kv_shared_layers` layers reuse the keys/values of the last earlier layer of their
//!   type and keep no cache), double-wide MLPs on shared layers, per-layer input embeddings
//!   (`hidden_size_per_layer_input`), `layer_scalar`, `final_logit_softcapping`. The MoE block
//!   (`enable_moe_block`) is not supported.
//!
//! Sliding layers attend to the last `sliding_window` positions (the query included): their
//! caches are [`RotatingKvCache`]s, which roll back multi-token verify windows exactly; with
//! any other cache the window mask is built from the positions.
use mlx_core::fast::{AttentionMask, Rope, rms_norm, scaled_dot_product_attention};
use mlx_core::{Array, Dtype};
use serde_json::Value;

use crate::cache::{KvCache, LayerCache, ModelCache, RotatingKvCache};
use crate::config::{ModelConfig, config_path};
use crate::layers::{Embedding, Linear, LoadContext, RmsNorm};
use crate::weights::Weights;
use crate::{Error, Result};

/// Which Gemma generation.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Version {
    V3,
    V4,
}

/// A Gemma 3 / Gemma 4 text decoder.
pub(crate) struct Gemma {
    embed: Embedding,
    embed_scale: f64,
    layers: Vec<Layer>,
    norm: RmsNorm,
    lm_head: Option<Linear>,
    softcap: Option<f32>,
    window: usize,
    /// For each layer, the layer whose keys/values it uses (itself unless KV-shared).
    kv_source: Vec<usize>,
    /// Layers `>= cached_layers` keep no cache (KV sharing).
    cached_layers: usize,
    per_layer: Option<PerLayerInputs>,
}

struct PerLayerInputs {
    embed: Embedding,
    embed_scale: f64,
    projection: Linear,
    projection_scale: f64,
    projection_norm: RmsNorm,
    width: usize,
}

struct LayerPli {
    gate: Linear,
    projection: Linear,
    norm: RmsNorm,
}

struct Layer {
    sliding: bool,
    q_proj: Linear,
    k_proj: Option<Linear>,
    v_proj: Option<Linear>,
    o_proj: Linear,
    q_norm: RmsNorm,
    k_norm: Option<RmsNorm>,
    /// Gemma 4: scale-free RMS norm on values (with this epsilon).
    v_norm_eps: Option<f32>,
    n_heads: i32,
    n_kv_heads: i32,
    head_dim: i32,
    scale: f32,
    rope: Rope,
    gate_proj: Linear,
    up_proj: Linear,
    down_proj: Linear,
    input_layernorm: RmsNorm,
    post_attention_layernorm: RmsNorm,
    pre_feedforward_layernorm: RmsNorm,
    post_feedforward_layernorm: RmsNorm,
    layer_scalar: Option<Array>,
    pli: Option<LayerPli>,
}

/// The keys, values and mask a layer attended with, for the KV-shared layers after it.
#[derive(Clone)]
struct Shared {
    keys: Array,
    values: Array,
    mask: Option<Array>,
    offset: i32,
}

fn get<'a>(c: &'a ModelConfig, key: &str) -> Option<&'a Value> {
    c.extra.get(key).filter(|v| !v.is_null())
}

fn get_f64(c: &ModelConfig, key: &str) -> Option<f64> {
    get(c, key).and_then(Value::as_f64)
}

fn get_usize(c: &ModelConfig, key: &str) -> Option<usize> {
    get(c, key).and_then(Value::as_u64).map(|v| v as usize)
}

fn cfg_err(dir: &std::path::Path, field: &str, message: impl Into<String>) -> Error {
    Error::Config { path: config_path(dir), field: field.into(), message: message.into() }
}

/// `0.5 * x * (1 + tanh(sqrt(2 / pi) * (x + 0.044715 * x^3)))` (`nn.gelu_approx`).
fn gelu_approx(x: &Array) -> Result<Array> {
    let d = x.dtype();
    let s = |v: f64| Array::scalar_as(v, d);
    let cube = x.power(&s(3.0)?)?;
    let inner = x.add(&cube.multiply(&s(0.044715)?)?)?.multiply(&s((2.0 / std::f64::consts::PI).sqrt())?)?;
    let half_x = x.multiply(&s(0.5)?)?;
    Ok(half_x.multiply(&inner.tanh()?.add(&s(1.0)?)?)?)
}

/// A Gemma 3 norm: `rms_norm(x, 1 + w)`.
fn one_plus(norm: RmsNorm) -> Result<RmsNorm> {
    let one = Array::scalar_as(1.0, norm.weight.dtype())?;
    Ok(RmsNorm { weight: norm.weight.add(&one)?, eps: norm.eps, kernels: norm.kernels })
}

/// The causal window mask `[L, T]` for keys at positions `0..T` in order and queries at
/// `T - L ..T`, `None` when every key is inside every query's causal window.
fn window_mask(l: usize, t: usize, window: usize) -> Result<Option<Array>> {
    let first = t - l;
    if first + l <= window {
        return Ok(None);
    }
    let mut m = vec![0u8; l * t];
    for i in 0..l {
        let q = first + i;
        for k in 0..t {
            m[i * t + k] = (k <= q && k + window > q) as u8;
        }
    }
    Ok(Some(Array::from_bytes(&m, &[l as i32, t as i32], Dtype::Bool)?))
}

impl Gemma {
    /// Builds the decoder (`model_type` `gemma3_text`/`gemma3` or `gemma4_text`).
    pub(crate) fn build(c: &ModelConfig, version: Version, weights: &mut Weights, ctx: &LoadContext) -> Result<Self> {
        let dir = weights.dir().to_path_buf();
        let (h, n, eps) = (c.hidden_size, c.num_hidden_layers, c.rms_norm_eps);
        let nh = c.num_attention_heads;
        let hd = c.head_dim.unwrap_or(256);
        let nkv = c.num_key_value_heads.unwrap_or(1);
        let window = get_usize(c, "sliding_window").unwrap_or(512);
        if window == 0 {
            return Err(cfg_err(&dir, "sliding_window", "must be at least 1"));
        }
        let pattern = get_usize(c, "sliding_window_pattern").unwrap_or(if version == Version::V3 { 6 } else { 5 });
        if pattern == 0 {
            return Err(cfg_err(&dir, "sliding_window_pattern", "must be at least 1"));
        }
        let sliding: Vec<bool> = match version {
            Version::V3 => (0..n).map(|i| (i + 1) % pattern != 0).collect(),
            Version::V4 => match get(c, "layer_types") {
                Some(Value::Array(types)) => {
                    if types.len() < n {
                        return Err(cfg_err(&dir, "layer_types", format!("{} entries for {n} layers", types.len())));
                    }
                    types[..n]
                        .iter()
                        .map(|t| match t.as_str() {
                            Some("sliding_attention") => Ok(true),
                            Some("full_attention") => Ok(false),
                            _ => Err(cfg_err(&dir, "layer_types", format!("unknown layer type {t}"))),
                        })
                        .collect::<Result<_>>()?
                }
                Some(_) => return Err(cfg_err(&dir, "layer_types", "expected a list")),
                None => (0..n).map(|i| (i % pattern) != pattern - 1).collect(),
            },
        };
        let v4 = version == Version::V4;
        if v4 && get(c, "enable_moe_block").and_then(Value::as_bool).unwrap_or(false) {
            return Err(Error::Unsupported(format!(
                "{}: gemma4 with `enable_moe_block` (mixture of experts)",
                config_path(&dir).display()
            )));
        }
        let shared = if v4 { get_usize(c, "num_kv_shared_layers").unwrap_or(20) } else { 0 };
        let cached_layers = if shared > 0 && shared < n { n - shared } else { n };
        let mut kv_source: Vec<usize> = (0..n).collect();
        for j in cached_layers..n {
            kv_source[j] = (0..cached_layers).rev().find(|&i| sliding[i] == sliding[j]).ok_or_else(|| {
                cfg_err(&dir, "num_kv_shared_layers", format!("layer {j} has no earlier layer of its type to share"))
            })?;
        }
        let k_eq_v = v4 && get(c, "attention_k_eq_v").and_then(Value::as_bool).unwrap_or(false);
        let global_hd = if v4 { get_usize(c, "global_head_dim").filter(|&d| d > 0).unwrap_or(512) } else { hd };
        let global_kv = get_usize(c, "num_global_key_value_heads");
        let double_wide = v4 && get(c, "use_double_wide_mlp").and_then(Value::as_bool).unwrap_or(true);
        let ple = if v4 { get_usize(c, "hidden_size_per_layer_input").unwrap_or(256) } else { 0 };
        let traditional = c.rope_traditional;

        let norm = |w: &mut Weights, name: &str, dim: usize| -> Result<RmsNorm> {
            let n = RmsNorm::load(w, ctx, name, dim, eps)?;
            if v4 { Ok(n) } else { one_plus(n) }
        };
        let mut layers = Vec::with_capacity(n);
        for (i, &is_sliding) in sliding.iter().enumerate() {
            let p = format!("model.layers.{i}");
            let a = format!("{p}.self_attn");
            let head_dim = if is_sliding { hd } else { global_hd };
            let use_k_eq_v = k_eq_v && !is_sliding;
            let n_kv = if use_k_eq_v { global_kv.unwrap_or(nkv) } else { nkv };
            let has_kv = i < cached_layers;
            let rope = if v4 {
                gemma4_rope(c, is_sliding, head_dim, traditional, &dir)?
            } else {
                gemma3_rope(c, is_sliding, head_dim, &dir)?
            };
            let scale = if v4 { 1.0 } else { (get_f64(c, "query_pre_attn_scalar").unwrap_or(256.0) as f32).powf(-0.5) };
            let lin = |w: &mut Weights, name: &str, out: usize, inp: usize| Linear::load(w, ctx, name, out, inp, false);
            let (k_proj, v_proj, k_norm) = if has_kv {
                let k = lin(weights, &format!("{a}.k_proj"), n_kv * head_dim, h)?;
                let v = if use_k_eq_v { None } else { Some(lin(weights, &format!("{a}.v_proj"), n_kv * head_dim, h)?) };
                (Some(k), v, Some(norm(weights, &format!("{a}.k_norm"), head_dim)?))
            } else {
                for s in ["k_proj", "v_proj", "k_norm"] {
                    for t in ["weight", "scales", "biases"] {
                        weights.take_opt(&format!("{a}.{s}.{t}"));
                    }
                }
                (None, None, None)
            };
            let ff = c.intermediate_size * if double_wide && i >= cached_layers && cached_layers < n { 2 } else { 1 };
            let m = format!("{p}.mlp");
            let layer_scalar =
                if v4 { Some(ctx_cast(ctx, weights.take_shaped(&format!("{p}.layer_scalar"), &[1])?)?) } else { None };
            let pli = if ple > 0 {
                Some(LayerPli {
                    gate: lin(weights, &format!("{p}.per_layer_input_gate"), ple, h)?,
                    projection: lin(weights, &format!("{p}.per_layer_projection"), h, ple)?,
                    norm: norm(weights, &format!("{p}.post_per_layer_input_norm"), h)?,
                })
            } else {
                None
            };
            layers.push(Layer {
                sliding: is_sliding,
                q_proj: lin(weights, &format!("{a}.q_proj"), nh * head_dim, h)?,
                k_proj,
                v_proj,
                o_proj: lin(weights, &format!("{a}.o_proj"), h, nh * head_dim)?,
                q_norm: norm(weights, &format!("{a}.q_norm"), head_dim)?,
                k_norm,
                v_norm_eps: v4.then_some(eps),
                n_heads: nh as i32,
                n_kv_heads: n_kv as i32,
                head_dim: head_dim as i32,
                scale,
                rope,
                gate_proj: lin(weights, &format!("{m}.gate_proj"), ff, h)?,
                up_proj: lin(weights, &format!("{m}.up_proj"), ff, h)?,
                down_proj: lin(weights, &format!("{m}.down_proj"), h, ff)?,
                input_layernorm: norm(weights, &format!("{p}.input_layernorm"), h)?,
                post_attention_layernorm: norm(weights, &format!("{p}.post_attention_layernorm"), h)?,
                pre_feedforward_layernorm: norm(weights, &format!("{p}.pre_feedforward_layernorm"), h)?,
                post_feedforward_layernorm: norm(weights, &format!("{p}.post_feedforward_layernorm"), h)?,
                layer_scalar,
                pli,
            });
        }
        let embed = Embedding::load(weights, ctx, "model.embed_tokens", c.vocab_size, h)?;
        let per_layer = if ple > 0 {
            let vpl = get_usize(c, "vocab_size_per_layer_input").unwrap_or(c.vocab_size);
            Some(PerLayerInputs {
                embed: Embedding::load(weights, ctx, "model.embed_tokens_per_layer", vpl, n * ple)?,
                embed_scale: (ple as f64).sqrt(),
                projection: Linear::load(weights, ctx, "model.per_layer_model_projection", n * ple, h, false)?,
                projection_scale: (h as f64).powf(-0.5),
                projection_norm: RmsNorm::load(weights, ctx, "model.per_layer_projection_norm", ple, eps)?,
                width: ple,
            })
        } else {
            None
        };
        let final_norm = norm(weights, "model.norm", h)?;
        // mlx-lm: gemma3 ties when the checkpoint has no lm_head; gemma4 follows the config.
        let tied = match version {
            Version::V3 => !weights.contains("lm_head.weight"),
            Version::V4 => c.tie_word_embeddings.unwrap_or(true),
        };
        let lm_head = if tied {
            for s in ["weight", "scales", "biases"] {
                weights.take_opt(&format!("lm_head.{s}"));
            }
            None
        } else {
            Some(Linear::load(weights, ctx, "lm_head", c.vocab_size, h, false)?)
        };
        let softcap = if v4 {
            match c.extra.get("final_logit_softcapping") {
                None => Some(30.0),
                Some(Value::Null) => None,
                Some(v) => {
                    Some(v.as_f64().ok_or_else(|| cfg_err(&dir, "final_logit_softcapping", "expected a number"))? as f32)
                }
            }
        } else {
            get_f64(c, "final_logit_softcapping").map(|v| v as f32)
        };
        let embed_scale = match version {
            // mx.array(hidden_size**0.5, mx.bfloat16)
            Version::V3 => half::bf16::from_f64((h as f64).sqrt()).to_f64(),
            Version::V4 => (h as f64).sqrt(),
        };
        Ok(Gemma {
            embed,
            embed_scale,
            layers,
            norm: final_norm,
            lm_head,
            softcap,
            window,
            kv_source,
            cached_layers,
            per_layer,
        })
    }

    /// Decoder layers.
    pub(crate) fn num_layers(&self) -> usize {
        self.layers.len()
    }

    /// One cache per layer that keeps one: rotating for sliding layers (`rollback`
    /// positions of exact rollback), full for global layers.
    pub(crate) fn make_cache(&self, rollback: usize) -> ModelCache {
        let layers = self.layers[..self.cached_layers]
            .iter()
            .map(|l| {
                if l.sliding {
                    Box::new(RotatingKvCache::new(self.window, rollback)) as Box<dyn LayerCache>
                } else {
                    Box::new(KvCache::new()) as Box<dyn LayerCache>
                }
            })
            .collect();
        ModelCache { layers }
    }

    /// Final hidden states `[B, L, H]` (after the last norm) and the taps.
    pub(crate) fn hidden(&self, tokens: &Array, cache: &mut ModelCache, taps: &[usize]) -> Result<(Array, Vec<Array>)> {
        if cache.layers.len() != self.cached_layers {
            return Err(Error::Unsupported(format!(
                "a cache of {} layers for a gemma model that caches {} of its {} layers",
                cache.layers.len(),
                self.cached_layers,
                self.layers.len()
            )));
        }
        if let Some(&bad) = taps.iter().find(|&&t| t >= self.layers.len()) {
            return Err(Error::Unsupported(format!("tap layer {bad} of a {}-layer model", self.layers.len())));
        }
        let x = self.embed.forward(tokens)?;
        let mut h = x.multiply(&Array::scalar_as(self.embed_scale, x.dtype())?)?;
        let per_layer = match &self.per_layer {
            Some(p) => Some(self.per_layer_inputs(p, tokens, &h)?),
            None => None,
        };
        let mut shared: Vec<Option<Shared>> = vec![None; self.layers.len()];
        let mut masks: [Option<Option<Array>>; 2] = [None, None];
        let mut tapped = vec![None; taps.len()];
        for (i, layer) in self.layers.iter().enumerate() {
            let src = self.kv_source[i];
            let cache = if i < self.cached_layers { cache.layers.get_mut(i) } else { None };
            let pli = match &per_layer {
                Some(p) => Some(p.slice_axis(2, i as i32, i as i32 + 1)?.squeeze(&[2])?),
                None => None,
            };
            let reuse = if src != i { shared[src].clone() } else { None };
            let (out, kv) = layer.forward(&h, cache, reuse, &mut masks[layer.sliding as usize], self.window, pli)?;
            h = out;
            shared[i] = Some(kv);
            for (slot, _) in taps.iter().enumerate().filter(|(_, t)| **t == i) {
                tapped[slot] = Some(h.clone());
            }
        }
        Ok((self.norm.forward(&h)?, tapped.into_iter().map(|t| t.expect("every tap is < num_layers")).collect()))
    }

    /// `[B, L, N, P]` per-layer inputs (mlx-lm `_get_per_layer_inputs` +
    /// `_project_per_layer_inputs`).
    fn per_layer_inputs(&self, p: &PerLayerInputs, tokens: &Array, h: &Array) -> Result<Array> {
        let n = self.layers.len() as i32;
        let (b, l) = (h.shape()[0], h.shape()[1]);
        let e = p.embed.forward(tokens)?;
        let e = e.multiply(&Array::scalar_as(p.embed_scale, e.dtype())?)?.reshape(&[b, l, n, p.width as i32])?;
        let proj = p.projection.forward(h)?;
        let proj = proj.multiply(&Array::scalar_as(p.projection_scale, proj.dtype())?)?;
        let proj = p.projection_norm.forward(&proj.reshape(&[b, l, n, p.width as i32])?)?;
        let sum = proj.add(&e)?;
        Ok(sum.multiply(&Array::scalar_as(2f64.powf(-0.5), sum.dtype())?)?)
    }

    /// Logits `[B, L, V]` of final hidden states.
    pub(crate) fn head(&self, h: &Array) -> Result<Array> {
        let logits = match &self.lm_head {
            Some(head) => head.forward(h)?,
            None => self.embed.as_linear(h)?,
        };
        match self.softcap {
            Some(c) => {
                let c = Array::scalar_as(c as f64, logits.dtype())?;
                Ok(logits.divide(&c)?.tanh()?.multiply(&c)?)
            }
            None => Ok(logits),
        }
    }
}

fn ctx_cast(ctx: &LoadContext, a: Array) -> Result<Array> {
    Ok(match ctx.dtype {
        Some(d) if a.dtype().is_float() && a.dtype() != d => a.astype(d)?,
        _ => a,
    })
}

fn gemma3_rope(c: &ModelConfig, sliding: bool, dims: usize, dir: &std::path::Path) -> Result<Rope> {
    let dims = dims as i32;
    if sliding {
        let base = get_f64(c, "rope_local_base_freq").unwrap_or(10000.0) as f32;
        return Ok(Rope { dims, traditional: false, base, scale: 1.0, freqs: None });
    }
    let base = c.rope_theta.unwrap_or(1_000_000.0);
    let mut rope = Rope { dims, traditional: false, base, scale: 1.0, freqs: None };
    if let Some(s) = c.rope_scaling.as_ref().filter(|v| !v.is_null()) {
        let kind = s.get("type").or_else(|| s.get("rope_type")).and_then(Value::as_str).unwrap_or("default");
        match kind {
            "default" => {}
            "linear" => {
                let f = s
                    .get("factor")
                    .and_then(Value::as_f64)
                    .ok_or_else(|| cfg_err(dir, "rope_scaling", "linear scaling needs `factor`"))?;
                rope.scale = (1.0 / f) as f32;
            }
            other => {
                return Err(Error::Unsupported(format!(
                    "rope_scaling type `{other}` for gemma3 in {}",
                    config_path(dir).display()
                )));
            }
        }
    }
    Ok(rope)
}

fn gemma4_rope(c: &ModelConfig, sliding: bool, dims: usize, traditional: bool, dir: &std::path::Path) -> Result<Rope> {
    let key = if sliding { "sliding_attention" } else { "full_attention" };
    let default = if sliding {
        serde_json::json!({"partial_rotary_factor": 1.0, "rope_theta": 10000.0, "rope_type": "default"})
    } else {
        serde_json::json!({"partial_rotary_factor": 0.25, "rope_theta": 1000000.0, "rope_type": "proportional"})
    };
    let params = match c.rope_parameters.as_ref() {
        Some(p) => p.get(key).cloned().unwrap_or(Value::Object(Default::default())),
        None => default,
    };
    let base = params.get("rope_theta").and_then(Value::as_f64).unwrap_or(10000.0);
    let kind = params.get("type").or_else(|| params.get("rope_type")).and_then(Value::as_str).unwrap_or("default");
    let factor = params.get("factor").and_then(Value::as_f64);
    let d = dims as i32;
    match kind {
        "default" => Ok(Rope { dims: d, traditional, base: base as f32, scale: 1.0, freqs: None }),
        "linear" => {
            let f = factor.ok_or_else(|| cfg_err(dir, "rope_parameters", "linear scaling needs `factor`"))?;
            Ok(Rope { dims: d, traditional, base: base as f32, scale: (1.0 / f) as f32, freqs: None })
        }
        "proportional" => {
            // mlx-lm ProportionalRoPE: factor * base^(2i/dims) for the rotated pairs, inf
            // (no rotation) for the rest.
            let partial = params.get("partial_rotary_factor").and_then(Value::as_f64).unwrap_or(1.0);
            let rotated = (dims as f64 * partial) as usize;
            if rotated > dims {
                return Err(cfg_err(dir, "rope_parameters", format!("partial_rotary_factor {partial} > 1")));
            }
            let f = factor.unwrap_or(1.0) as f32;
            let mut freqs: Vec<f32> = (0..rotated)
                .step_by(2)
                .map(|i| {
                    let e = i as f32 / dims as f32;
                    f * (base as f32).powf(e)
                })
                .collect();
            freqs.extend(std::iter::repeat_n(f32::INFINITY, (dims - rotated) / 2));
            let n = freqs.len() as i32;
            Ok(Rope {
                dims: d,
                traditional,
                base: base as f32,
                scale: 1.0,
                freqs: Some(Array::from_slice(&freqs, &[n])?),
            })
        }
        other => Err(Error::Unsupported(format!(
            "rope type `{other}` for gemma4 {key} layers in {}",
            config_path(dir).display()
        ))),
    }
}

impl Layer {
    /// One decoder layer; `mask` memoizes the mask of this layer type for the forward.
    fn forward(
        &self,
        x: &Array,
        cache: Option<&mut Box<dyn LayerCache>>,
        reuse: Option<Shared>,
        mask: &mut Option<Option<Array>>,
        window: usize,
        pli: Option<Array>,
    ) -> Result<(Array, Shared)> {
        let (a, kv) = self.attention(&self.input_layernorm.forward(x)?, cache, reuse, mask, window)?;
        let h = x.add(&self.post_attention_layernorm.forward(&a)?)?;
        let y = self.pre_feedforward_layernorm.forward(&h)?;
        let m = self
            .down_proj
            .forward(&gelu_approx(&self.gate_proj.forward(&y)?)?.multiply(&self.up_proj.forward(&y)?)?)?;
        let mut h = h.add(&self.post_feedforward_layernorm.forward(&m)?)?;
        if let (Some(p), Some(input)) = (&self.pli, pli) {
            let g = gelu_approx(&p.gate.forward(&h)?)?.multiply(&input)?;
            h = h.add(&p.norm.forward(&p.projection.forward(&g)?)?)?;
        }
        if let Some(s) = &self.layer_scalar {
            h = h.multiply(s)?;
        }
        Ok((h, kv))
    }

    fn attention(
        &self,
        x: &Array,
        cache: Option<&mut Box<dyn LayerCache>>,
        reuse: Option<Shared>,
        mask_memo: &mut Option<Option<Array>>,
        window: usize,
    ) -> Result<(Array, Shared)> {
        let s = x.shape();
        let (b, l) = (s[0], s[1]);
        let split = |y: Array, n: i32| y.reshape(&[b, l, n, self.head_dim]);
        let q = self.q_norm.forward(&split(self.q_proj.forward(x)?, self.n_heads)?)?.transpose(&[0, 2, 1, 3])?;
        let shared = match reuse {
            Some(sh) => sh,
            None => {
                let cache = cache.ok_or_else(|| Error::Unsupported("a gemma layer without keys and a cache".into()))?;
                let (Some(k_proj), Some(k_norm)) = (&self.k_proj, &self.k_norm) else {
                    return Err(Error::Unsupported("a KV-shared gemma layer without a source layer".into()));
                };
                let k_raw = split(k_proj.forward(x)?, self.n_kv_heads)?;
                let v_raw = match &self.v_proj {
                    Some(v) => split(v.forward(x)?, self.n_kv_heads)?,
                    None => k_raw.clone(),
                };
                let offset = cache.offset() as i32;
                let k = k_norm.forward(&k_raw)?.transpose(&[0, 2, 1, 3])?;
                let k = self.rope.apply(&k, offset, self.o_proj.kernels())?;
                let v = match self.v_norm_eps {
                    Some(eps) => rms_norm(&v_raw, None, eps, self.o_proj.kernels())?,
                    None => v_raw,
                };
                let v = v.transpose(&[0, 2, 1, 3])?;
                let (k, v) = cache.update_and_fetch(&k, &v)?;
                let mask = match mask_memo {
                    Some(m) => m.clone(),
                    None => {
                        let t = k.shape()[2] as usize;
                        let m = match cache.attention_mask()? {
                            Some(m) => Some(m),
                            None if self.sliding => window_mask(l as usize, t, window)?,
                            None => None,
                        };
                        *mask_memo = Some(m.clone());
                        m
                    }
                };
                Shared { keys: k, values: v, mask, offset }
            }
        };
        let q = self.rope.apply(&q, shared.offset, self.o_proj.kernels())?;
        let mask = match &shared.mask {
            Some(m) => AttentionMask::Array(m),
            None if l > 1 => AttentionMask::Causal,
            None => AttentionMask::None,
        };
        let o =
            scaled_dot_product_attention(&q, &shared.keys, &shared.values, self.scale, mask, self.o_proj.kernels())?;
        let o = self.o_proj.forward(&o.transpose(&[0, 2, 1, 3])?.reshape(&[b, l, -1])?)?;
        Ok((o, shared))
    }
}
