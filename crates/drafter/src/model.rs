//! The DSpark drafter: loading and the forward pass (`deepspec-port-spec.md` §2;
//! `deepspec/modeling/dspark/{qwen3,gemma4}/modeling.py`, `draft_ops.py`, `markov_head.py`).
//!
//! ```text
//! C  = hidden_norm(fc(F))                       F [1, n, T*H] target taps -> C [1, n, H]
//! per layer i: Kc_i = rope(k_norm(k_proj_i(C))), Vc_i = v_proj_i(C)   appended to the context
//! X  = embed([anchor, mask x (B-1)])            [1, B, H] at positions start .. start+B-1
//! per layer: Q from X only; K, V = [context; block]; attention without a mask
//! h  = norm(X_L)                                [1, B, H]
//! U  = lm_head(h)  (Gemma4: tanh(U/c)*c)        [1, B, V]
//! z_k = U_k + W2 · W1[prev_k], d_k = argmax z_k, prev_0 = anchor, prev_k = d_{k-1}
//! conf_k = sigmoid(w · [h_k; W1[prev_k]] + b)
//! ```
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use mlx_core::fast::Rope;
use mlx_core::{Array, Dtype, concatenate};
use models::blocks::{Activation, Attention, Mlp, proportional_rope};
use models::cache::{KvCache, LayerCache};
use models::config::{ModelConfig, QuantizationConfig};
use models::layers::{Embedding, Linear, LoadContext, RmsNorm};
use models::loader::Loader;
use models::weights::Weights;
use models::{LoadOptions, Sampler};

use crate::config::{Architecture, DrafterConfig};
use crate::walk::HostHeads;
use crate::{Error, Result};

pub(crate) struct Layer {
    /// Gemma4: `k_eq_v` (no `v_proj`) and a weightless norm on V.
    pub(crate) attn: Attention,
    mlp: Mlp,
    pub(crate) input_layernorm: RmsNorm,
    post_attention_layernorm: RmsNorm,
    /// Gemma4 sandwich norms.
    pre_feedforward_layernorm: Option<RmsNorm>,
    post_feedforward_layernorm: Option<RmsNorm>,
    /// Gemma4 `layer_scalar` `[1]`.
    layer_scalar: Option<Array>,
}

/// A loaded DeepSpec drafter (`Qwen3DSparkModel` or `Gemma4DSparkModel`; DFlash when
/// `markov_rank` is 0), dense (bf16 or cast) or affine-quantized in the mlx-lm layout.
///
/// The drafter is stateless; the per-request context K/V live in a [`DraftContext`].
pub struct Drafter {
    config: DrafterConfig,
    dir: PathBuf,
    dtype: Dtype,
    embed: Embedding,
    /// Gemma4: `bf16(sqrt(H))`, the scale of `Gemma4TextScaledWordEmbedding`.
    embed_scale: Option<f32>,
    fc: Linear,
    hidden_norm: RmsNorm,
    layers: Vec<Layer>,
    norm: RmsNorm,
    lm_head: Linear,
    markov_w1: Option<Embedding>,
    markov_w2: Option<Linear>,
    confidence: Option<Linear>,
    /// The reduced draft vocabulary (mlx-spec's extension): target ids of the `K` rows of
    /// `lm_head` / `markov_w2`, as int32 `[K]` and on the host, increasing.
    draft_vocab: Option<(Array, Vec<u32>)>,
    rope: Rope,
    quantized: Vec<String>,
    /// The Markov and confidence heads on the host, for greedy f32 draft calls (built by
    /// [`Drafter::load`]; on the first such call for a drafter built from weights).
    host_heads: OnceLock<HostHeads>,
}

/// The per-request drafter state: for every draft layer, the K (after `k_norm` and RoPE)
/// and V of the context rows ingested so far, `[1, nkv, len, hd]` each. Block rows never
/// persist. `len` is the drafter's `start`: the absolute position of the next anchor.
/// Cloning shares the arrays (a later write to either copy allocates anew), which is how a
/// prompt cache keeps a context for a later request.
#[derive(Clone)]
pub struct DraftContext {
    layers: Vec<KvCache>,
    len: usize,
}

impl DraftContext {
    /// Context rows ingested (positions `0 .. len`).
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether no context has been ingested.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Keeps the first `len` context rows (no-op when `len >= self.len()`), for a request
    /// that shares only that prefix with the one that filled the context.
    pub fn truncate(&mut self, len: usize) {
        let drop = self.len.saturating_sub(len);
        for layer in &mut self.layers {
            layer.trim(drop);
        }
        self.len -= drop;
    }

    /// The cached K and V of draft layer `layer`, `[1, nkv, len, hd]` each (K after
    /// `k_norm` and RoPE; V raw for Qwen3, after the weightless norm for Gemma4), or `None`
    /// while empty or for a layer out of range.
    ///
    /// # Errors
    /// [`Error::Mlx`] if slicing fails.
    pub fn layer_kv(&self, layer: usize) -> Result<Option<(Array, Array)>> {
        let Some(cache) = self.layers.get(layer) else { return Ok(None) };
        let state = cache.state();
        match state.as_slice() {
            [k, v] if self.len > 0 => {
                let n = self.len as i32;
                Ok(Some((k.slice_axis(2, 0, n)?, v.slice_axis(2, 0, n)?)))
            }
            _ => Ok(None),
        }
    }

    /// The arrays holding the state (to evaluate).
    pub fn state(&self) -> Vec<Array> {
        self.layers.iter().flat_map(|c| c.state()).collect()
    }
}

/// The block pass of one draft call.
pub struct BlockOutput {
    /// Block input embeddings `[1, B, H]` (Gemma4: times the embedding scale).
    pub embed: Array,
    /// The block residual stream after each draft layer, `[1, B, H]` each.
    pub layer_outputs: Vec<Array>,
    /// The final-normed block hidden `h` `[1, B, H]`.
    pub hidden: Array,
}

/// One draft call's result.
pub struct Proposal {
    /// The drafts to verify: `all_drafts` truncated before the first position whose
    /// confidence is below the threshold (all of them when the threshold is 0 or there is no
    /// confidence head).
    pub drafts: Vec<u32>,
    /// All `B` drafts of the block (greedy, or drawn by the sampler of
    /// [`Drafter::propose_sampled`]).
    pub all_drafts: Vec<u32>,
    /// The block pass.
    pub block: BlockOutput,
    /// Base logits `U` `[1, B, V]` (compute dtype; Gemma4: soft-capped; `-inf` off a reduced
    /// draft vocabulary).
    pub base_logits: Array,
    /// Markov-corrected logits `z` `[1, B, V]` (equal to `U` for DFlash; `-inf` off a
    /// reduced draft vocabulary).
    pub logits: Array,
    /// Confidence logits per block slot (f32), when the drafter has a confidence head.
    pub confidence_logits: Option<Vec<f32>>,
    /// `sigmoid` of them (divided by the per-position temperatures when the checkpoint has
    /// them): the per-position (not cumulative) confidence.
    pub confidence: Option<Vec<f32>>,
}

impl Drafter {
    /// Loads the drafter in `dir` (`config.json` + `model.safetensors`, or shards). Quantized
    /// modules follow mlx-lm (`<base>.scales` present; `quantization` block in the config);
    /// quantized `embed_tokens` and `markov_head.markov_w1` are gathered then dequantized.
    /// `options.dtype` casts dense weights, norms and scales (`None` keeps bf16).
    ///
    /// # Errors
    /// Those of [`DrafterConfig::from_dir`]; [`Error::Model`] naming the tensor when one is
    /// missing or misshapen; [`Error::Unused`] when the files hold tensors the architecture
    /// does not use.
    pub fn load(dir: &Path, options: &LoadOptions) -> Result<Self> {
        // DeepSpec writes one `model.safetensors`, shards come with an index: mlx-lm's rule
        // (`models::weights::weight_files`), which leaves `cases.safetensors` and the like.
        let d = Self::from_weights(DrafterConfig::from_dir(dir)?, Weights::load(dir)?, options)?;
        // The host copies of the heads that greedy f32 draft calls walk on (walk.rs) are made
        // here, not in the first draft call, whose time the cost-aware policy measures.
        d.host_heads(&Sampler::default())?;
        Ok(d)
    }

    /// Builds the drafter of `config` from `weights` (DeepSpec's tensor names), as
    /// [`Drafter::load`] does from its files: how a training step makes a drafter from the
    /// parameters [`mlx_core::autograd`] traces.
    ///
    /// # Errors
    /// As [`Drafter::load`].
    pub fn from_weights(config: DrafterConfig, mut weights: Weights, options: &LoadOptions) -> Result<Self> {
        let dir = weights.dir().to_path_buf();
        let dir = dir.as_path();
        let cfg_path = config.path.clone();
        let quant = if config.raw.quantization.is_some() || config.raw.quantization_config.is_some() {
            QuantizationConfig::from_config(&ModelConfig::from_dir(dir)?, &cfg_path)?
        } else {
            QuantizationConfig::default()
        };
        let ctx = LoadContext { quant, dtype: options.dtype, kernels: options.kernels.clone() };
        let quantized: Vec<String> =
            weights.unused().iter().filter_map(|n| n.strip_suffix(".scales").map(str::to_string)).collect();
        let mut w = Loader::new(&mut weights, &ctx);
        let c = &config;
        let (h, nh, nkv, hd, eps) = (c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim, c.rms_norm_eps);
        let gemma = c.architecture == Architecture::Gemma4;
        let bias = c.attention_bias;
        let mut layers = Vec::new(); // the count is untrusted until the weights hold its layers
        for i in 0..c.num_layers {
            let mut p = w.pp(format_args!("layers.{i}"));
            let mut a = p.pp("self_attn");
            let attn = Attention {
                q_proj: a.linear("q_proj", nh * hd, h, bias)?,
                k_proj: Some(a.linear("k_proj", nkv * hd, h, bias)?),
                v_proj: if c.k_eq_v { None } else { Some(a.linear("v_proj", nkv * hd, h, bias)?) },
                o_proj: a.linear("o_proj", h, nh * hd, bias)?,
                q_norm: Some(norm_as(gemma, a.norm("q_norm", hd, eps)?)),
                k_norm: Some(norm_as(gemma, a.norm("k_norm", hd, eps)?)),
                v_norm_eps: gemma.then_some(eps),
                n_heads: nh as i32,
                n_kv_heads: nkv as i32,
                head_dim: hd as i32,
                scale: if gemma { 1.0 } else { (hd as f32).powf(-0.5) },
            };
            let iw = c.mlp_width(i);
            let mut m = p.pp("mlp");
            let (gate_proj, up_proj, down_proj) = (
                m.linear("gate_proj", iw, h, false)?,
                m.linear("up_proj", iw, h, false)?,
                m.linear("down_proj", h, iw, false)?,
            );
            let act = if gemma { Activation::GeluTanh } else { Activation::Silu };
            layers.push(Layer {
                attn,
                mlp: Mlp { gate_proj, up_proj, down_proj, act },
                input_layernorm: norm_as(gemma, p.norm("input_layernorm", h, eps)?),
                post_attention_layernorm: norm_as(gemma, p.norm("post_attention_layernorm", h, eps)?),
                pre_feedforward_layernorm: if gemma {
                    Some(norm_as(gemma, p.norm("pre_feedforward_layernorm", h, eps)?))
                } else {
                    None
                },
                post_feedforward_layernorm: if gemma {
                    Some(norm_as(gemma, p.norm("post_feedforward_layernorm", h, eps)?))
                } else {
                    None
                },
                layer_scalar: if gemma { Some(p.param("layer_scalar", &[1])?) } else { None },
            });
        }
        let (v, r) = (c.vocab_size, c.markov_rank);
        let embed = w.embedding("embed_tokens", v, h)?;
        let fc = w.linear("fc", h, c.feature_width(), false).map_err(|e| match e {
            models::Error::Weight { path, name, message } => models::Error::Weight {
                path,
                name,
                message: format!(
                    "{message} (config.json: its input is the {} tapped layers of target_layer_ids {:?} \
                     x hidden_size {h})",
                    c.target_layer_ids.len(),
                    c.target_layer_ids
                ),
            },
            e => e,
        })?;
        let hidden_norm = norm_as(gemma, w.norm("hidden_norm", h, eps)?);
        let norm = norm_as(gemma, w.norm("norm", h, eps)?);
        let k = c.draft_vocab();
        let lm_head = w.linear("lm_head", k, h, false)?;
        let draft_vocab = match c.draft_vocab_size {
            Some(k) => {
                let ids = w.param("draft_vocab_ids", &[k as i32])?.astype(Dtype::Int32)?;
                let host: Vec<u32> = ids.to_vec::<i32>()?.into_iter().map(|t| t as u32).collect();
                if host.windows(2).any(|p| p[0] >= p[1]) || host.last().is_some_and(|&t| t as usize >= v) {
                    return Err(Error::Invalid(format!(
                        "{}: draft_vocab_ids must be increasing target ids below vocab_size {v}",
                        dir.display()
                    )));
                }
                Some((ids, host))
            }
            None => None,
        };
        let (markov_w1, markov_w2) = if r > 0 {
            let mut mh = w.pp("markov_head");
            (Some(mh.embedding("markov_w1", v, r)?), Some(mh.linear("markov_w2", k, r, false)?))
        } else {
            (None, None)
        };
        let confidence = if c.confidence_head {
            let inp = if c.confidence_with_markov { h + r } else { h };
            Some(w.linear("confidence_head.proj", 1, inp, true)?)
        } else {
            None
        };
        // DeepSpec checkpoints hold exactly the drafter's tensors: nothing may be left over.
        w.finish(&[]).map_err(|e| match e {
            models::Error::Unused { path, names } => Error::Unused { path, names },
            e => Error::Model(e),
        })?;
        let rope = if c.partial_rotary_factor < 1.0 {
            // Proportional RoPE (transformers `_compute_proportional_rope_parameters`): the
            // first pairs rotate with inv_freq θ^(-2j/hd), the others not at all.
            proportional_rope(hd, c.rope_theta, c.partial_rotary_factor, 1.0, false)?
        } else {
            Rope { dims: hd as i32, traditional: false, base: c.rope_theta as f32, scale: 1.0, freqs: None }
        };
        let embed_scale = gemma.then(|| half::bf16::from_f32((h as f32).sqrt()).to_f32());
        let dtype = hidden_norm.weight.dtype();
        Ok(Drafter {
            config,
            dir: dir.into(),
            dtype,
            embed,
            embed_scale,
            fc,
            hidden_norm,
            layers,
            norm,
            lm_head,
            markov_w1,
            markov_w2,
            confidence,
            draft_vocab,
            rope,
            quantized,
            host_heads: OnceLock::new(),
        })
    }

    /// The validated configuration.
    pub fn config(&self) -> &DrafterConfig {
        &self.config
    }

    /// The directory it was loaded from.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// The compute dtype (that of the dense norms: bf16 as stored, or the load dtype).
    pub fn dtype(&self) -> Dtype {
        self.dtype
    }

    /// `H`.
    pub fn hidden_size(&self) -> usize {
        self.config.hidden_size
    }

    /// γ: drafts per call.
    pub fn block_size(&self) -> usize {
        self.config.block_size
    }

    /// The tapped target layers, in feature order (`-1` = the embedding output).
    pub fn target_layer_ids(&self) -> &[i64] {
        &self.config.target_layer_ids
    }

    /// Module bases stored quantized (`<base>.scales` present), sorted.
    pub fn quantized_modules(&self) -> &[String] {
        &self.quantized
    }

    /// Checks that this drafter was trained for a target shaped like `target`:
    /// `num_target_layers` equals its layer count, the hidden sizes agree (the taps feed
    /// `fc`, `[H, T*H]`), and the vocabularies agree (drafts are target ids).
    ///
    /// # Errors
    /// [`Error::Incompatible`] naming the drafter, `target_name`, the field, and both values.
    pub fn check_target(&self, target: &ModelConfig, target_name: &str) -> Result<()> {
        let c = &self.config;
        let fail = |message: String| {
            Err(Error::Incompatible {
                drafter: self.dir.display().to_string(),
                target: target_name.to_string(),
                message,
            })
        };
        if c.num_target_layers != target.num_hidden_layers {
            return fail(format!(
                "the drafter has num_target_layers {}, the target has num_hidden_layers {}",
                c.num_target_layers, target.num_hidden_layers
            ));
        }
        if c.hidden_size != target.hidden_size {
            return fail(format!(
                "the drafter has hidden_size {} (fc takes {} tap features), the target has hidden_size {}",
                c.hidden_size,
                c.feature_width(),
                target.hidden_size
            ));
        }
        if c.vocab_size != target.vocab_size {
            return fail(format!(
                "the drafter has vocab_size {}, the target has vocab_size {}",
                c.vocab_size, target.vocab_size
            ));
        }
        Ok(())
    }

    /// A fresh, empty per-request context.
    pub fn new_context(&self) -> DraftContext {
        DraftContext { layers: (0..self.layers.len()).map(|_| KvCache::new()).collect(), len: 0 }
    }

    /// The context projection (paper Eq. 2): `C = hidden_norm(fc(F))`, `F [.., T*H]` the
    /// target taps concatenated in `target_layer_ids` order (any float dtype; cast to the
    /// compute dtype) -> `[.., H]`. The quantized `fc` goes through `quantized_matmul`.
    ///
    /// # Errors
    /// [`Error::Invalid`] when the last axis is not `T*H`.
    pub fn project_context(&self, features: &Array) -> Result<Array> {
        let width = self.config.feature_width() as i32;
        if features.shape().last() != Some(&width) {
            return Err(Error::Invalid(format!(
                "context features of shape {:?}; the drafter's fc takes {width} = {} taps x {} hidden",
                features.shape(),
                self.config.target_layer_ids.len(),
                self.config.hidden_size
            )));
        }
        let x = features.astype(self.dtype)?;
        Ok(self.hidden_norm.forward(&self.fc.forward(&x)?)?)
    }

    /// Concatenates per-tap hidden states (`[1, n, H]` each, in `target_layer_ids` order)
    /// along the feature axis into `[1, n, T*H]`.
    ///
    /// # Errors
    /// [`Error::Invalid`] when the count differs from the number of tap layers.
    pub fn concat_taps(&self, taps: &[Array]) -> Result<Array> {
        let t = self.config.target_layer_ids.len();
        if taps.len() != t {
            return Err(Error::Invalid(format!("{} tap arrays for a drafter with {t} tap layers", taps.len())));
        }
        Ok(concatenate(&taps.iter().collect::<Vec<_>>(), -1)?)
    }

    /// Appends `n` context rows: `features [1, n, T*H]` (or `[n, T*H]`) are the target taps at
    /// absolute positions `ctx.len() .. ctx.len() + n`. Each layer's K (after `k_norm` and
    /// RoPE) and V of `C = project_context(features)` join the context. Lazy.
    ///
    /// # Errors
    /// As [`Drafter::project_context`].
    pub fn ingest(&self, ctx: &mut DraftContext, features: &Array) -> Result<()> {
        let f = if features.ndim() == 2 { features.expand_dims(&[0])? } else { features.clone() };
        let n = f.shape()[1] as usize;
        if n == 0 {
            return Ok(());
        }
        let c = self.project_context(&f)?;
        let offset = ctx.len as i32;
        for (layer, cache) in self.layers.iter().zip(ctx.layers.iter_mut()) {
            let (k, v) = layer.attn.keys_values(&c, &self.rope, offset)?;
            cache.update_and_fetch(&k, &v)?;
        }
        ctx.len += n;
        Ok(())
    }

    /// Token ids embedded, `[len, H]` in the compute dtype (Gemma4: times `bf16(sqrt(H))`).
    ///
    /// # Errors
    /// MLX failures (ids are not checked against the vocabulary here).
    pub(crate) fn embed_ids(&self, ids: &[u32]) -> Result<Array> {
        let ids: Vec<i32> = ids.iter().map(|&t| t as i32).collect();
        let x = self.embed.forward(&Array::from_slice(&ids, &[ids.len() as i32])?)?.astype(self.dtype)?;
        Ok(match self.embed_scale {
            Some(s) => x.multiply(&Array::scalar_as(s as f64, self.dtype)?)?,
            None => x,
        })
    }

    pub(crate) fn layers(&self) -> &[Layer] {
        &self.layers
    }

    pub(crate) fn final_norm(&self, x: &Array) -> Result<Array> {
        Ok(self.norm.forward(x)?)
    }

    pub(crate) fn markov_w2(&self) -> Option<&Linear> {
        self.markov_w2.as_ref()
    }

    pub(crate) fn confidence_head(&self) -> Option<&Linear> {
        self.confidence.as_ref()
    }

    pub(crate) fn rope(&self) -> &Rope {
        &self.rope
    }

    /// The block input `[anchor, mask x (B-1)]` embedded, `[1, B, H]` (Gemma4: times
    /// `bf16(sqrt(H))`).
    ///
    /// # Errors
    /// [`Error::Invalid`] for an anchor outside the vocabulary.
    pub fn embed_block(&self, anchor: u32) -> Result<Array> {
        let b = self.config.block_size;
        if anchor as usize >= self.config.vocab_size {
            return Err(Error::Invalid(format!(
                "anchor {anchor} is outside the vocabulary of {}",
                self.config.vocab_size
            )));
        }
        let mut ids = vec![self.config.mask_token_id; b];
        ids[0] = anchor;
        Ok(self.embed_ids(&ids)?.expand_dims(&[0])?)
    }

    /// Runs the draft block for `anchor` at absolute positions `ctx.len() .. ctx.len() + B`
    /// over the cached context (no mask: every slot sees the whole context and every slot).
    /// The context is unchanged afterwards (block K/V are dropped). Lazy.
    ///
    /// # Errors
    /// [`Error::Invalid`] for an anchor outside the vocabulary; MLX failures.
    pub fn forward_block(&self, ctx: &mut DraftContext, anchor: u32) -> Result<BlockOutput> {
        let embed = self.embed_block(anchor)?;
        let b = self.config.block_size;
        let offset = ctx.len as i32;
        let mut x = embed.clone();
        let mut layer_outputs = Vec::with_capacity(self.layers.len());
        for (layer, cache) in self.layers.iter().zip(ctx.layers.iter_mut()) {
            x = layer.forward(&x, cache, self, offset)?;
            if cache.trim(b) != b {
                return Err(Error::Invalid(format!("the draft context could not drop the {b} block rows")));
            }
            layer_outputs.push(x.clone());
        }
        let hidden = self.norm.forward(&x)?;
        Ok(BlockOutput { embed, layer_outputs, hidden })
    }

    /// Base logits `U = lm_head(h)` (Gemma4: `tanh(U / c) * c`), `h [.., H]` -> `[.., K]`, over
    /// the draft vocabulary (`K = V` without a reduced one; see [`Drafter::to_target_vocab`]).
    ///
    /// # Errors
    /// MLX failures.
    pub fn base_logits(&self, hidden: &Array) -> Result<Array> {
        let u = self.lm_head.forward(hidden)?;
        Ok(match self.config.final_logit_softcapping {
            Some(cap) => {
                let c = Array::scalar_as(cap as f64, u.dtype())?;
                u.divide(&c)?.tanh()?.multiply(&c)?
            }
            None => u,
        })
    }

    /// Logits over the draft vocabulary `[.., K]` as logits over the target's `[.., V]`:
    /// unchanged without a reduced vocabulary, else scattered to the target ids of the `K`
    /// rows with `-inf` elsewhere (the drafter never drafts those tokens).
    ///
    /// # Errors
    /// MLX failures.
    pub fn to_target_vocab(&self, logits: &Array) -> Result<Array> {
        let Some((ids, _)) = &self.draft_vocab else { return Ok(logits.clone()) };
        let shape = logits.shape();
        let mut full_shape = shape.clone();
        *full_shape.last_mut().expect("logits have a vocabulary axis") = self.config.vocab_size as i32;
        let full = Array::full(&full_shape, f64::NEG_INFINITY, logits.dtype())?;
        let mut idx_shape = vec![1; shape.len()];
        *idx_shape.last_mut().expect("non-empty") = ids.size() as i32;
        let idx = ids.reshape(&idx_shape)?.broadcast_to(&shape)?;
        Ok(full.put_along_axis(&idx, logits, -1)?)
    }

    /// The target ids of the draft vocabulary's rows, when the drafter has a reduced one.
    pub fn draft_vocab_ids(&self) -> Option<&[u32]> {
        self.draft_vocab.as_ref().map(|(_, ids)| ids.as_slice())
    }

    /// `W1[tokens]` `[len, r]` (gathered, then dequantized when quantized), or `None` for
    /// DFlash.
    ///
    /// # Errors
    /// [`Error::Invalid`] for an id outside the vocabulary.
    pub fn markov_embed(&self, tokens: &[u32]) -> Result<Option<Array>> {
        let Some(w1) = &self.markov_w1 else { return Ok(None) };
        let ids: Vec<i32> = tokens.iter().map(|&t| t as i32).collect();
        Ok(Some(w1.forward(&Array::from_slice(&ids, &[ids.len() as i32])?)?.astype(self.dtype)?))
    }

    /// One greedy draft call: [`Drafter::propose_sampled`] with a greedy sampler.
    ///
    /// # Errors
    /// As [`Drafter::propose_sampled`].
    pub fn propose(&self, ctx: &mut DraftContext, anchor: u32, confidence_threshold: f32) -> Result<Proposal> {
        self.propose_sampled(ctx, anchor, confidence_threshold, &Sampler::default(), 0)
    }

    /// One draft call: [`Drafter::forward_block`], base logits, the sequential Markov walk
    /// (`z_k = U_k + W2 W1[prev_k]`, `d_k` drawn from `z_k` by `sampler` with the key of
    /// generation step `step + k`: `argmax z_k`, first maximum on ties, for a greedy
    /// sampler), the confidence head on `[h_k; W1[prev_k]]` with
    /// `prev = [anchor, d_0 .. d_{B-2}]`, and truncation before the first slot whose
    /// confidence is below `confidence_threshold` (`<= 0` keeps all `B`; so does a drafter
    /// without confidence head). DFlash (`markov_rank` 0) draws every `d_k` from `U_k`
    /// independently (the argmax of all rows at once when greedy). Drawing slot `k` with
    /// the key the target's sampler uses at that step couples drafter and target
    /// (`models::Sampler::sample`'s Gumbel-max draw): under exact-match acceptance a drafter
    /// whose filtered distribution equals the target's always matches. The truncation looks
    /// only at slots up to the one it cuts, so the choice of length does not anticipate later
    /// draws (DSpark paper, App. A).
    ///
    /// # Errors
    /// [`Error::Invalid`] for an anchor outside the vocabulary; MLX failures.
    pub fn propose_sampled(
        &self,
        ctx: &mut DraftContext,
        anchor: u32,
        confidence_threshold: f32,
        sampler: &Sampler,
        step: usize,
    ) -> Result<Proposal> {
        let block = self.forward_block(ctx, anchor)?;
        let b = self.config.block_size as i32;
        let u_draft = self.base_logits(&block.hidden)?;
        let u = self.to_target_vocab(&u_draft)?;
        if let Some(heads) = self.host_heads(sampler)? {
            // One evaluation, then the walk and the confidence head on the host (walk.rs).
            let ud = u_draft.astype(Dtype::Float32)?.reshape(&[b, -1])?;
            let h = block.hidden.astype(Dtype::Float32)?.reshape(&[b, -1])?;
            mlx_core::eval(&[&ud, &h])?;
            let walk = heads.greedy(&ud.to_vec::<f32>()?, &h.to_vec::<f32>()?, anchor, self.draft_vocab_ids());
            let z = Array::from_slice(&walk.logits, &[1, b, ud.shape()[1]])?.astype(self.dtype)?;
            let z = self.to_target_vocab(&z)?;
            return self.proposal(walk.drafts, block, u, z, walk.confidence_logits, confidence_threshold);
        }
        let (z, drafts) = match &self.markov_w2 {
            Some(w2) => {
                let mut prev = anchor;
                let mut rows = Vec::with_capacity(b as usize);
                let mut drafts = Vec::with_capacity(b as usize);
                for k in 0..b {
                    let w1 = self.markov_embed(&[prev])?.expect("markov_w1 exists with markov_w2");
                    let zk = u_draft.slice_axis(1, k, k + 1)?.squeeze(&[1])?.add(&w2.forward(&w1)?)?;
                    let d = match self.draft_vocab_ids() {
                        // Greedy over a reduced vocabulary: the argmax of the K draft rows, as a
                        // target id (the ids increase, so the first maximum is the one the
                        // target-vocabulary argmax finds), without building the V-wide row.
                        Some(ids) if sampler.is_greedy() => {
                            ids[zk.argmax(-1, false)?.astype(Dtype::Uint32)?.reshape(&[-1])?.to_vec::<u32>()?[0]
                                as usize]
                        }
                        _ => sampler.sample(&self.to_target_vocab(&zk)?, step + k as usize)?,
                    };
                    drafts.push(d);
                    rows.push(zk);
                    prev = d;
                }
                // over the target vocabulary, built only if read (lazy)
                let z = mlx_core::stack(&rows.iter().collect::<Vec<_>>(), 1)?.reshape(&[1, b, -1])?;
                (self.to_target_vocab(&z)?, drafts)
            }
            None if sampler.is_greedy() => {
                let d = u.argmax(-1, false)?.astype(Dtype::Uint32)?.reshape(&[-1])?.to_vec::<u32>()?;
                (u.clone(), d)
            }
            None => {
                let d = (0..b)
                    .map(|k| sampler.sample(&u.slice_axis(1, k, k + 1)?, step + k as usize).map_err(Error::from))
                    .collect::<Result<Vec<u32>>>()?;
                (u.clone(), d)
            }
        };
        let confidence_logits = match &self.confidence {
            Some(head) => {
                let h = block.hidden.reshape(&[b, -1])?;
                let feats = if self.config.confidence_with_markov {
                    let prevs: Vec<u32> =
                        std::iter::once(anchor).chain(drafts[..b as usize - 1].iter().copied()).collect();
                    let w1 = self.markov_embed(&prevs)?.expect("confidence_with_markov implies a Markov head");
                    concatenate(&[&h, &w1], -1)?
                } else {
                    h
                };
                Some(head.forward(&feats)?.astype(Dtype::Float32)?.reshape(&[-1])?.to_vec::<f32>()?)
            }
            None => None,
        };
        self.proposal(drafts, block, u, z, confidence_logits, confidence_threshold)
    }

    /// The proposal of a draft call: per-position confidences `sigmoid(logit_k / T_k)` (f32;
    /// `T_k` the checkpoint's `confidence_temperatures`, else 1) and the drafts truncated
    /// before the first one below `confidence_threshold` (none when it is `<= 0`).
    fn proposal(
        &self,
        drafts: Vec<u32>,
        block: BlockOutput,
        base_logits: Array,
        logits: Array,
        confidence_logits: Option<Vec<f32>>,
        confidence_threshold: f32,
    ) -> Result<Proposal> {
        let temps = self.config.confidence_temperatures.as_deref().unwrap_or(&[]);
        let confidence: Option<Vec<f32>> = confidence_logits.as_ref().map(|l| {
            l.iter()
                .enumerate()
                .map(|(k, &x)| 1.0 / (1.0 + (-(x / temps.get(k).map_or(1.0, |&t| t as f32))).exp()))
                .collect()
        });
        let keep = match (&confidence, confidence_threshold > 0.0) {
            (Some(c), true) => c.iter().position(|&p| p < confidence_threshold).unwrap_or(drafts.len()),
            _ => drafts.len(),
        };
        Ok(Proposal {
            drafts: drafts[..keep].to_vec(),
            all_drafts: drafts,
            block,
            base_logits,
            logits,
            confidence_logits,
            confidence,
        })
    }

    /// The host copies of the Markov and confidence heads (built on first use) when a draft
    /// call can walk on the host: greedy, a Markov head, f32 compute (walk.rs).
    fn host_heads(&self, sampler: &Sampler) -> Result<Option<&HostHeads>> {
        let (Some(w1), Some(w2)) = (&self.markov_w1, &self.markov_w2) else { return Ok(None) };
        if !sampler.is_greedy() || self.dtype != Dtype::Float32 {
            return Ok(None);
        }
        if let Some(h) = self.host_heads.get() {
            return Ok(Some(h));
        }
        let heads = HostHeads::new(w1, w2, self.confidence.as_ref())?;
        Ok(Some(self.host_heads.get_or_init(|| heads)))
    }
}

/// A Gemma4 drafter's norm scales by its weight in f32 before casting (transformers'
/// `Gemma4RMSNorm`, which DeepSpec's Gemma4 drafter uses); Qwen3's casts first
/// (`Qwen3RMSNorm`, as `mx.fast.rms_norm`).
fn norm_as(gemma: bool, norm: RmsNorm) -> RmsNorm {
    RmsNorm { weight_in_f32: gemma, ..norm }
}

impl Layer {
    fn forward(&self, x: &Array, cache: &mut KvCache, d: &Drafter, offset: i32) -> Result<Array> {
        debug_assert_eq!(cache.offset() as i32, offset);
        let o = self.attn.forward(&self.input_layernorm.forward(x)?, cache, &d.rope, false)?;
        self.residual_and_mlp(x, &o)
    }

    /// The rest of the layer after attention: `x` the layer input, `o` the attention output
    /// (Qwen3: residual, norm, MLP, residual; Gemma4: sandwich norms and `layer_scalar`).
    pub(crate) fn residual_and_mlp(&self, x: &Array, o: &Array) -> Result<Array> {
        match (&self.pre_feedforward_layernorm, &self.post_feedforward_layernorm) {
            (Some(pre), Some(post)) => {
                let h = x.add(&self.post_attention_layernorm.forward(o)?)?;
                let h = h.add(&post.forward(&self.mlp.forward(&pre.forward(&h)?)?)?)?;
                Ok(match &self.layer_scalar {
                    Some(s) => h.multiply(s)?,
                    None => h,
                })
            }
            _ => {
                let h = x.add(o)?;
                Ok(h.add(&self.mlp.forward(&self.post_attention_layernorm.forward(&h)?)?)?)
            }
        }
    }
}
