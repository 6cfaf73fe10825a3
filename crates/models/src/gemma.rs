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
use mlx_core::fast::{AttentionMask, Rope};
use mlx_core::{Array, Dtype};
use serde_json::Value;

use crate::blocks::{Activation, Attention, Mlp, gelu_tanh, proportional_rope};
use crate::cache::{KvCache, LayerCache, ModelCache, RotatingKvCache};
use crate::config::{ModelConfig, config_path};
use crate::layers::{Embedding, Linear, RmsNorm};
use crate::loader::Loader;
use crate::{Error, Result};

mod config;
pub use config::{GemmaArgs, GemmaConfig, RopeParameters};

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
    /// Gemma 4: a scale-free RMS norm on values; no keys/values on KV-shared layers.
    attn: Attention,
    rope: Rope,
    mlp: Mlp,
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

fn cfg_err(dir: &std::path::Path, field: &str, message: impl Into<String>) -> Error {
    Error::Config { path: config_path(dir), field: field.into(), message: message.into() }
}

/// A Gemma 3 norm: `rms_norm(x, 1 + w)`.
fn one_plus(norm: RmsNorm) -> Result<RmsNorm> {
    let one = Array::scalar_as(1.0, norm.weight.dtype())?;
    Ok(RmsNorm { weight: norm.weight.add(&one)?, ..norm })
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
    /// Builds the decoder (`model_type` `gemma3_text`/`gemma3` or `gemma4_text`), taking
    /// its tensors from `w`.
    pub(crate) fn build(c: &ModelConfig, version: Version, w: &mut Loader) -> Result<Self> {
        let dir = w.dir().to_path_buf();
        let g = GemmaConfig::resolve(c, version, &dir)?;
        let h = g.hidden;
        let mut model = w.pp("model");
        let layers = (0..g.layers)
            .map(|i| {
                let rope = if g.v4 {
                    let hd = if g.sliding[i] { g.head_dim } else { g.global_head_dim };
                    let params = if g.sliding[i] { &g.rope_sliding } else { &g.rope_full };
                    gemma4_rope(params, g.sliding[i], hd, c.rope_traditional, &dir)?
                } else {
                    gemma3_rope(c, &g, g.sliding[i], &dir)?
                };
                Layer::load(&mut model.pp(format_args!("layers.{i}")), &g, i, rope)
            })
            .collect::<Result<Vec<_>>>()?;
        let embed = model.embedding("embed_tokens", c.vocab_size, h)?;
        let per_layer = if g.per_layer_width > 0 { Some(PerLayerInputs::load(&mut model, &g)?) } else { None };
        let final_norm = gemma_norm(&mut model, &g, "norm", h)?;
        // mlx-lm: gemma3 ties when the checkpoint has no lm_head; gemma4 follows the config.
        let tied = if g.v4 { c.tie_word_embeddings.unwrap_or(true) } else { !w.contains("lm_head.weight") };
        let lm_head = if tied {
            w.discard("lm_head");
            None
        } else {
            Some(w.linear("lm_head", c.vocab_size, h, false)?)
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
            softcap: g.softcap,
            window: g.window,
            kv_source: g.kv_source,
            cached_layers: g.cached_layers,
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

fn gemma3_rope(c: &ModelConfig, g: &GemmaConfig, sliding: bool, dir: &std::path::Path) -> Result<Rope> {
    let dims = g.head_dim as i32;
    if sliding {
        return Ok(Rope { dims, traditional: false, base: g.rope_local_base, scale: 1.0, freqs: None });
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

/// The rope of a Gemma 4 layer type from its resolved `rope_parameters` entry.
fn gemma4_rope(
    params: &RopeParameters,
    sliding: bool,
    dims: usize,
    traditional: bool,
    dir: &std::path::Path,
) -> Result<Rope> {
    let key = if sliding { "sliding_attention" } else { "full_attention" };
    let (base, factor, d) = (params.rope_theta, params.factor, dims as i32);
    match params.kind() {
        "default" => Ok(Rope { dims: d, traditional, base: base as f32, scale: 1.0, freqs: None }),
        "linear" => {
            let f = factor.ok_or_else(|| cfg_err(dir, "rope_parameters", "linear scaling needs `factor`"))?;
            Ok(Rope { dims: d, traditional, base: base as f32, scale: (1.0 / f) as f32, freqs: None })
        }
        "proportional" => {
            // mlx-lm ProportionalRoPE: factor * base^(2i/dims) for the rotated pairs, inf
            // (no rotation) for the rest.
            let partial = params.partial_rotary_factor;
            let rotated = (dims as f64 * partial) as usize;
            if rotated > dims {
                return Err(cfg_err(dir, "rope_parameters", format!("partial_rotary_factor {partial} > 1")));
            }
            proportional_rope(dims, base, partial, factor.unwrap_or(1.0), traditional)
        }
        other => Err(Error::Unsupported(format!(
            "rope type `{other}` for gemma4 {key} layers in {}",
            config_path(dir).display()
        ))),
    }
}

/// A Gemma norm `name` of width `dim`: `1 + w` for Gemma 3, `w` for Gemma 4.
fn gemma_norm(w: &mut Loader, g: &GemmaConfig, name: &str, dim: usize) -> Result<RmsNorm> {
    let n = w.norm(name, dim, g.eps)?;
    if g.v4 { Ok(n) } else { one_plus(n) }
}

impl PerLayerInputs {
    /// `embed_tokens_per_layer`, `per_layer_model_projection` and its norm under `w`
    /// (`model`).
    fn load(w: &mut Loader, g: &GemmaConfig) -> Result<Self> {
        let (h, n, ple) = (g.hidden, g.layers, g.per_layer_width);
        Ok(PerLayerInputs {
            embed: w.embedding("embed_tokens_per_layer", g.per_layer_vocab, n * ple)?,
            embed_scale: (ple as f64).sqrt(),
            projection: w.linear("per_layer_model_projection", n * ple, h, false)?,
            projection_scale: (h as f64).powf(-0.5),
            projection_norm: w.norm("per_layer_projection_norm", ple, g.eps)?,
            width: ple,
        })
    }
}

impl Layer {
    /// Decoder layer `i` under `p` (`model.layers.<i>`).
    fn load(p: &mut Loader, g: &GemmaConfig, i: usize, rope: Rope) -> Result<Self> {
        let (h, sliding) = (g.hidden, g.sliding[i]);
        let head_dim = if sliding { g.head_dim } else { g.global_head_dim };
        let use_k_eq_v = g.k_eq_v && !sliding;
        let n_kv = if use_k_eq_v { g.global_kv_heads } else { g.kv_heads };
        let mut a = p.pp("self_attn");
        let (k_proj, v_proj, k_norm) = if i < g.cached_layers {
            let k = a.linear("k_proj", n_kv * head_dim, h, false)?;
            let v = if use_k_eq_v { None } else { Some(a.linear("v_proj", n_kv * head_dim, h, false)?) };
            (Some(k), v, Some(gemma_norm(&mut a, g, "k_norm", head_dim)?))
        } else {
            // KV-shared layers use an earlier layer's keys and values.
            for s in ["k_proj", "v_proj", "k_norm"] {
                a.discard(s);
            }
            (None, None, None)
        };
        let q_proj = a.linear("q_proj", g.heads * head_dim, h, false)?;
        let o_proj = a.linear("o_proj", h, g.heads * head_dim, false)?;
        let q_norm = gemma_norm(&mut a, g, "q_norm", head_dim)?;
        let layer_scalar = if g.v4 { Some(p.param("layer_scalar", &[1])?) } else { None };
        let ple = g.per_layer_width;
        let pli = if ple > 0 {
            Some(LayerPli {
                gate: p.linear("per_layer_input_gate", ple, h, false)?,
                projection: p.linear("per_layer_projection", h, ple, false)?,
                norm: gemma_norm(p, g, "post_per_layer_input_norm", h)?,
            })
        } else {
            None
        };
        let ff = g.mlp_width[i];
        let mut m = p.pp("mlp");
        let (gate_proj, up_proj, down_proj) = (
            m.linear("gate_proj", ff, h, false)?,
            m.linear("up_proj", ff, h, false)?,
            m.linear("down_proj", h, ff, false)?,
        );
        Ok(Layer {
            sliding,
            attn: Attention {
                q_proj,
                k_proj,
                v_proj,
                o_proj,
                q_norm: Some(q_norm),
                k_norm,
                v_norm_eps: g.v4.then_some(g.eps),
                n_heads: g.heads as i32,
                n_kv_heads: n_kv as i32,
                head_dim: head_dim as i32,
                scale: g.query_scale,
            },
            rope,
            mlp: Mlp { gate_proj, up_proj, down_proj, act: Activation::GeluTanh },
            input_layernorm: gemma_norm(p, g, "input_layernorm", h)?,
            post_attention_layernorm: gemma_norm(p, g, "post_attention_layernorm", h)?,
            pre_feedforward_layernorm: gemma_norm(p, g, "pre_feedforward_layernorm", h)?,
            post_feedforward_layernorm: gemma_norm(p, g, "post_feedforward_layernorm", h)?,
            layer_scalar,
            pli,
        })
    }

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
        let m = self.mlp.forward(&self.pre_feedforward_layernorm.forward(&h)?)?;
        let mut h = h.add(&self.post_feedforward_layernorm.forward(&m)?)?;
        if let (Some(p), Some(input)) = (&self.pli, pli) {
            let g = gelu_tanh(&p.gate.forward(&h)?)?.multiply(&input)?;
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
        let l = x.shape()[1];
        let (q, shared) = match reuse {
            Some(sh) => (self.attn.project(x, &self.rope, sh.offset)?.0, sh),
            None => {
                let cache = cache.ok_or_else(|| Error::Unsupported("a gemma layer without keys and a cache".into()))?;
                let offset = cache.offset() as i32;
                let (q, kv) = self.attn.project(x, &self.rope, offset)?;
                let (k, v) =
                    kv.ok_or_else(|| Error::Unsupported("a KV-shared gemma layer without a source layer".into()))?;
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
                (q, Shared { keys: k, values: v, mask, offset })
            }
        };
        let mask = match &shared.mask {
            Some(m) => AttentionMask::Array(m),
            None if l > 1 => AttentionMask::Causal,
            None => AttentionMask::None,
        };
        let o = self.attn.attend(&q, &shared.keys, &shared.values, mask)?;
        Ok((o, shared))
    }
}
