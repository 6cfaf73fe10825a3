//! The decoder-only transformer shared by the llama, qwen2 and qwen3 families, following
//! mlx-lm's `models/llama.py`, `qwen2.py` and `qwen3.py`:
//!
//! ```text
//! h = embed(tokens)                                  [B, L, H]
//! for each layer:
//!     h = h + o_proj(attn(rope(q), rope(k), v))      pre-norm: input_layernorm
//!     h = h + down(silu(gate(x)) * up(x))            pre-norm: post_attention_layernorm
//! logits = lm_head(norm(h))                          [B, L, V]
//! ```
//! qwen2 adds biases to q/k/v; qwen3 applies an RMS norm to each query and key head before
//! rope. Attention is causal over the cache plus the new tokens (`fast::scaled_dot_product_attention`
//! with the causal mask aligned to the end, GQA by head grouping).
use mlx_core::cpu_layer::{self, AttentionIn, AttentionOutMlp, LayerShape};
use mlx_core::fast::Rope;
use mlx_core::{Array, Dtype, KernelPolicy, LayerNodes};
use serde_json::Value;

use crate::blocks::{Activation, Attention, Mlp};
use crate::cache::{LayerCache, ModelCache};
use crate::config::{ModelConfig, config_path};
use crate::gemma::{Gemma, Version as GemmaVersion};
use crate::layers::{Embedding, Linear, RmsNorm};
use crate::loader::Loader;
use crate::{Error, Result};

/// Which family's variations apply.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Family {
    /// Llama / SmolLM2: optional biases per `attention_bias` / `mlp_bias`.
    Llama,
    /// Qwen2 / Qwen2.5: q/k/v biases.
    Qwen2,
    /// Qwen3: per-head q/k RMS norms, no biases.
    Qwen3,
    /// Gemma 3 text (`gemma3_text`; see [`crate::gemma`]): sliding-window and global layers.
    Gemma3,
    /// Gemma 4 text (`gemma4_text`; see [`crate::gemma`]).
    Gemma4,
}

impl Family {
    /// The family of `model_type`.
    ///
    /// # Errors
    /// [`Error::Unsupported`] naming the model type.
    pub fn from_model_type(t: &str) -> Result<Self> {
        match t {
            "llama" => Ok(Family::Llama),
            "qwen2" => Ok(Family::Qwen2),
            "qwen3" => Ok(Family::Qwen3),
            "gemma3_text" | "gemma3" => Ok(Family::Gemma3),
            "gemma4_text" => Ok(Family::Gemma4),
            other => Err(Error::Unsupported(format!(
                "model_type `{other}` (supported: llama, qwen2, qwen3, gemma3_text, gemma4_text)"
            ))),
        }
    }

    /// The tensors a checkpoint of this family may hold that the model does not use, as
    /// [`Loader::finish`] matches them (a name equal to an entry or ending in `.<entry>`):
    /// what mlx-lm's `sanitize` of `models/<model_type>.py` drops regardless of the config
    /// (the precomputed rope table `self_attn.rotary_emb.inv_freq` of HF checkpoints).
    /// Config-dependent drops (a stored `lm_head` with tied embeddings, the keys/values of
    /// Gemma 4's KV-shared layers) are made by the builder. Any other leftover tensor is an
    /// error.
    pub fn ignored_tensors(self) -> &'static [&'static str] {
        match self {
            Family::Llama | Family::Qwen2 | Family::Qwen3 | Family::Gemma3 | Family::Gemma4 => &["rotary_emb.inv_freq"],
        }
    }
}

struct Block {
    attn: Attention,
    mlp: Mlp,
    input_layernorm: RmsNorm,
    post_attention_layernorm: RmsNorm,
}

/// A loaded llama / qwen2 / qwen3 / gemma3 / gemma4 decoder.
pub struct Transformer {
    /// The configuration it was built from.
    pub config: ModelConfig,
    /// The family.
    pub family: Family,
    arch: Arch,
}

/// The layers of one family of decoders (one value per loaded model: its size does not matter).
#[allow(clippy::large_enum_variant)]
enum Arch {
    /// llama / qwen2 / qwen3.
    Decoder { embed: Embedding, blocks: Vec<Block>, norm: RmsNorm, lm_head: Option<Linear>, rope: Rope },
    /// gemma3 / gemma4.
    Gemma(Box<Gemma>),
}

/// One request's window in [`Transformer::forward_batch`].
pub struct BatchPart<'c> {
    /// Its token ids (at least one).
    pub tokens: Vec<u32>,
    /// Its cache, which gains `tokens.len()` positions.
    pub cache: &'c mut ModelCache,
}

/// [`Error::Unsupported`] unless every cache has one layer per decoder layer (`layers`) and
/// every tap is below `layers`.
fn check_layers<'c>(layers: usize, caches: impl IntoIterator<Item = &'c ModelCache>, taps: &[usize]) -> Result<()> {
    if let Some(c) = caches.into_iter().find(|c| c.layers.len() != layers) {
        return Err(Error::Unsupported(format!("a cache of {} layers for a model of {layers}", c.layers.len())));
    }
    if let Some(&bad) = taps.iter().find(|&&t| t >= layers) {
        return Err(Error::Unsupported(format!("tap layer {bad} of a {layers}-layer model")));
    }
    Ok(())
}

/// What a forward pass returns.
pub struct ForwardOutput {
    /// Logits `[B, L, V]` (in the compute dtype).
    pub logits: Array,
    /// Hidden states `[B, L, H]` after each requested decoder layer, in the order asked.
    pub taps: Vec<Array>,
}

fn rope_for(cfg: &ModelConfig, dir: &std::path::Path) -> Result<Rope> {
    let dims = cfg.head_dim() as i32;
    let base = cfg.rope_base();
    let mut rope = Rope { dims, traditional: cfg.rope_traditional, base, scale: 1.0, freqs: None };
    let scaling = cfg.rope_scaling.as_ref().filter(|v| !v.is_null());
    let Some(s) = scaling else { return Ok(rope) };
    let kind = s.get("type").or_else(|| s.get("rope_type")).and_then(Value::as_str).unwrap_or("default");
    let factor = s.get("factor").and_then(Value::as_f64);
    let bad = |m: &str| Error::Config { path: config_path(dir), field: "rope_scaling".into(), message: m.into() };
    match kind {
        "default" => {}
        "linear" => rope.scale = 1.0 / factor.ok_or_else(|| bad("linear scaling needs `factor`"))? as f32,
        "llama3" => {
            // Llama 3.1 frequency smoothing (mlx-lm `Llama3RoPE`).
            let factor = factor.ok_or_else(|| bad("llama3 scaling needs `factor`"))?;
            let low = s.get("low_freq_factor").and_then(Value::as_f64).unwrap_or(1.0);
            let high = s.get("high_freq_factor").and_then(Value::as_f64).unwrap_or(4.0);
            let old = s.get("original_max_position_embeddings").and_then(Value::as_f64).unwrap_or(8192.0);
            let (low_wl, high_wl) = (old / low, old / high);
            let freqs: Vec<f32> = (0..dims / 2)
                .map(|i| {
                    let f = (base as f64).powf(2.0 * i as f64 / dims as f64);
                    let wl = 2.0 * std::f64::consts::PI * f;
                    let f = if wl > low_wl { f * factor } else { f };
                    if wl > high_wl && wl < low_wl {
                        let smooth = (old / wl - low) / (high - low);
                        (f / ((1.0 - smooth) / factor + smooth)) as f32
                    } else {
                        f as f32
                    }
                })
                .collect();
            rope.freqs = Some(Array::from_slice(&freqs, &[dims / 2])?);
        }
        other => {
            return Err(Error::Unsupported(format!("rope_scaling type `{other}` in {}", config_path(dir).display())));
        }
    }
    Ok(rope)
}

impl Transformer {
    /// Builds the decoder from `config`, taking its tensors from `w` (the root handle of
    /// the model directory; the caller [`Loader::finish`]es it with
    /// [`Family::ignored_tensors`]).
    ///
    /// # Errors
    /// [`Error::Unsupported`] for another model type; [`Error::Weight`] for a missing or
    /// misshapen tensor; [`Error::Config`] for inconsistent quantization entries.
    pub fn build(config: ModelConfig, w: &mut Loader) -> Result<Self> {
        let family = Family::from_model_type(&config.model_type)?;
        if let Some(version) = match family {
            Family::Gemma3 => Some(GemmaVersion::V3),
            Family::Gemma4 => Some(GemmaVersion::V4),
            _ => None,
        } {
            let gemma = Gemma::build(&config, version, w)?;
            return Ok(Transformer { family, arch: Arch::Gemma(Box::new(gemma)), config });
        }
        let c = &config;
        let (h, hd, nh, nkv, eps) = (c.hidden_size, c.head_dim(), c.num_attention_heads, c.kv_heads(), c.rms_norm_eps);
        let qkv_bias = family == Family::Qwen2 || c.attention_bias;
        let o_bias = family == Family::Llama && c.attention_bias;
        let mlp_bias = family == Family::Llama && c.mlp_bias;
        let mut model = w.pp("model");
        let mut blocks = Vec::new(); // not with_capacity: the count is untrusted until the weights hold its layers
        for i in 0..c.num_hidden_layers {
            let mut p = model.pp(format_args!("layers.{i}"));
            let mut a = p.pp("self_attn");
            let qk_norms = family == Family::Qwen3;
            let attn = Attention {
                q_proj: a.linear("q_proj", nh * hd, h, qkv_bias)?,
                k_proj: Some(a.linear("k_proj", nkv * hd, h, qkv_bias)?),
                v_proj: Some(a.linear("v_proj", nkv * hd, h, qkv_bias)?),
                o_proj: a.linear("o_proj", h, nh * hd, o_bias)?,
                q_norm: if qk_norms { Some(a.norm("q_norm", hd, eps)?) } else { None },
                k_norm: if qk_norms { Some(a.norm("k_norm", hd, eps)?) } else { None },
                v_norm_eps: None,
                n_heads: nh as i32,
                n_kv_heads: nkv as i32,
                head_dim: hd as i32,
                scale: (hd as f32).powf(-0.5),
            };
            let mut m = p.pp("mlp");
            let ff = c.intermediate_size;
            let mlp = Mlp {
                gate_proj: m.linear("gate_proj", ff, h, mlp_bias)?,
                up_proj: m.linear("up_proj", ff, h, mlp_bias)?,
                down_proj: m.linear("down_proj", h, ff, mlp_bias)?,
                act: Activation::Silu,
            };
            blocks.push(Block {
                attn,
                mlp,
                input_layernorm: p.norm("input_layernorm", h, eps)?,
                post_attention_layernorm: p.norm("post_attention_layernorm", h, eps)?,
            });
        }
        let embed = model.embedding("embed_tokens", c.vocab_size, h)?;
        let norm = model.norm("norm", h, eps)?;
        let lm_head = if c.tied_embeddings() {
            // mlx-lm's sanitize drops a stored lm_head when embeddings are tied.
            w.discard("lm_head");
            None
        } else {
            Some(w.linear("lm_head", c.vocab_size, h, false)?)
        };
        let rope = rope_for(c, w.dir())?;
        Ok(Transformer { family, arch: Arch::Decoder { embed, blocks, norm, lm_head, rope }, config })
    }

    /// Number of decoder layers.
    pub fn num_layers(&self) -> usize {
        match &self.arch {
            Arch::Decoder { blocks, .. } => blocks.len(),
            Arch::Gemma(g) => g.num_layers(),
        }
    }

    /// A fresh cache for one request: one [`crate::KvCache`] per layer, and for Gemma's
    /// sliding layers a [`crate::cache::RotatingKvCache`] that rolls back up to
    /// [`crate::cache::RotatingKvCache::DEFAULT_ROLLBACK`] positions exactly (KV-shared
    /// Gemma 4 layers keep no cache, so the cache may have fewer layers than the model).
    pub fn make_cache(&self) -> ModelCache {
        self.make_cache_with_rollback(crate::cache::RotatingKvCache::DEFAULT_ROLLBACK)
    }

    /// [`Transformer::make_cache`] whose rotating (sliding-window) layers can roll back
    /// `rollback >= 1` positions exactly after any write and take verify windows of up to
    /// `rollback + 1` tokens in place (each such layer keeps `sliding_window - 1 + rollback`
    /// rows). Families without sliding layers ignore it.
    pub fn make_cache_with_rollback(&self, rollback: usize) -> ModelCache {
        match &self.arch {
            Arch::Decoder { blocks, .. } => ModelCache::full(blocks.len()),
            Arch::Gemma(g) => g.make_cache(rollback.max(1)),
        }
    }

    /// The final hidden states `[B, L, H]` (after the last norm) plus the taps.
    fn hidden(&self, tokens: &Array, cache: &mut ModelCache, taps: &[usize]) -> Result<(Array, Vec<Array>)> {
        let (embed, blocks, norm, rope) = match &self.arch {
            Arch::Decoder { embed, blocks, norm, rope, .. } => (embed, blocks, norm, rope),
            Arch::Gemma(g) => return g.hidden(tokens, cache, taps),
        };
        check_layers(blocks.len(), [&*cache], taps)?;
        let mut h = embed.forward(tokens)?;
        let mut tapped = vec![None; taps.len()];
        for (i, (block, layer_cache)) in blocks.iter().zip(cache.layers.iter_mut()).enumerate() {
            h = block.forward(&h, layer_cache.as_mut(), rope)?;
            for (slot, _) in taps.iter().enumerate().filter(|(_, t)| **t == i) {
                tapped[slot] = Some(h.clone());
            }
        }
        Ok((norm.forward(&h)?, tapped.into_iter().map(|t| t.expect("every tap is < num_layers")).collect()))
    }

    fn head(&self, h: &Array) -> Result<Array> {
        match &self.arch {
            Arch::Decoder { lm_head: Some(head), .. } => head.forward(h),
            Arch::Decoder { embed, lm_head: None, .. } => embed.as_linear(h),
            Arch::Gemma(g) => g.head(h),
        }
    }

    /// `tokens [B, L]` (int32/uint32 ids) -> logits `[B, L, V]`, appending `L` positions to
    /// `cache`. Lazy: evaluate the result (or part of it) to compute.
    ///
    /// # Errors
    /// [`Error::Mlx`] on shape problems; [`Error::Unsupported`] for a cache of another model.
    pub fn forward(&self, tokens: &Array, cache: &mut ModelCache) -> Result<Array> {
        let (h, _) = self.hidden(tokens, cache, &[])?;
        self.head(&h)
    }

    /// [`Transformer::forward`] that also returns the residual stream after the decoder
    /// layers `taps` (0-based: tap `i` is the output of layer `i`, HF's `hidden_states[i + 1]`),
    /// each `[B, L, H]`. The logits are the same graph as without taps.
    ///
    /// # Errors
    /// As [`Transformer::forward`], and [`Error::Unsupported`] for a tap `>= num_layers`.
    pub fn forward_with_taps(&self, tokens: &Array, cache: &mut ModelCache, taps: &[usize]) -> Result<ForwardOutput> {
        let (h, taps) = self.hidden(tokens, cache, taps)?;
        Ok(ForwardOutput { logits: self.head(&h)?, taps })
    }

    /// The final-normed hidden states `[B, L, H]` (what the LM head reads) and the residual
    /// stream after the decoder layers `taps`, as [`Transformer::forward_with_taps`] computes
    /// them, without the LM head: a drafter's training data (its teacher's last hidden state
    /// and taps).
    ///
    /// # Errors
    /// As [`Transformer::forward_with_taps`].
    pub fn hidden_with_taps(
        &self,
        tokens: &Array,
        cache: &mut ModelCache,
        taps: &[usize],
    ) -> Result<(Array, Vec<Array>)> {
        self.hidden(tokens, cache, taps)
    }

    /// One forward over the windows of several requests, each with its own cache: for every
    /// part, logits `[1, L_i, V]` (and the hidden states after `taps`, `[1, L_i, H]` each)
    /// equal to those of [`Transformer::forward_with_taps`] of `part.tokens` on `part.cache`
    /// alone, bit for bit on the CPU kernels; each cache gains its `L_i` positions. The
    /// llama/qwen decoders run the rows of all parts through every row-wise op (embedding,
    /// norms, projections, MLP, LM head) at once and attend per part
    /// ([`crate::blocks::Attention::forward_batch`]); parts are grouped so that no group holds
    /// more rows than [`Transformer::batch_row_cap`] (products leave the row-invariant kernels
    /// beyond [`mlx_core::cpu_quant::WINDOW_MAX_ROWS`] rows, dense ones beyond
    /// [`mlx_core::cpu_quant::DENSE_MAX_ROWS`]), a part longer than the cap
    /// forming a group of its own. Gemma runs its parts one after another. Lazy.
    ///
    /// # Errors
    /// As [`Transformer::forward_with_taps`], and [`Error::Unsupported`] for an empty part.
    pub fn forward_batch(&self, parts: &mut [BatchPart<'_>], taps: &[usize]) -> Result<Vec<ForwardOutput>> {
        if let Some(i) = parts.iter().position(|p| p.tokens.is_empty()) {
            return Err(Error::Unsupported(format!("part {i} of a batched forward has no tokens")));
        }
        let (embed, blocks, norm, rope) = match &self.arch {
            Arch::Decoder { embed, blocks, norm, rope, .. } => (embed, blocks, norm, rope),
            Arch::Gemma(_) => {
                return parts
                    .iter_mut()
                    .map(|p| self.forward_with_taps(&crate::generate::ids(&p.tokens)?, p.cache, taps))
                    .collect();
            }
        };
        check_layers(blocks.len(), parts.iter().map(|p| &*p.cache), taps)?;
        let cap = self.batch_row_cap();
        let mut outputs = Vec::with_capacity(parts.len());
        let mut rest = parts;
        while !rest.is_empty() {
            let mut n = 1;
            let mut rows = rest[0].tokens.len();
            while n < rest.len() && rows + rest[n].tokens.len() <= cap {
                rows += rest[n].tokens.len();
                n += 1;
            }
            let (group, tail) = rest.split_at_mut(n);
            rest = tail;
            let lens: Vec<i32> = group.iter().map(|p| p.tokens.len() as i32).collect();
            let all: Vec<u32> = group.iter().flat_map(|p| p.tokens.iter().copied()).collect();
            let mut h = embed.forward(&crate::generate::ids(&all)?)?;
            let mut tapped = vec![None; taps.len()];
            for (i, block) in blocks.iter().enumerate() {
                let mut caches: Vec<&mut (dyn LayerCache + 'static)> =
                    group.iter_mut().map(|p| p.cache.layers[i].as_mut()).collect();
                let x = block.input_layernorm.forward(&h)?;
                h = h.add(&block.attn.forward_batch(&x, &mut caches, &lens, rope)?)?;
                h = h.add(&block.mlp.forward(&block.post_attention_layernorm.forward(&h)?)?)?;
                for (slot, _) in taps.iter().enumerate().filter(|(_, t)| **t == i) {
                    tapped[slot] = Some(h.clone());
                }
            }
            let logits = self.head(&norm.forward(&h)?)?;
            let mut start = 0;
            for l in lens {
                let rows = |a: &Array| a.slice_axis(1, start, start + l);
                let taps = tapped
                    .iter()
                    .map(|t| rows(t.as_ref().expect("every tap is < num_layers")))
                    .collect::<mlx_core::Result<_>>()?;
                outputs.push(ForwardOutput { logits: rows(&logits)?, taps });
                start += l;
            }
        }
        Ok(outputs)
    }

    /// The most rows [`Transformer::forward_batch`] puts in one forward: the row counts up to
    /// which the CPU kernels give every row its one-row bits,
    /// [`mlx_core::cpu_quant::WINDOW_MAX_ROWS`] when every projection is quantized,
    /// [`mlx_core::cpu_quant::DENSE_MAX_ROWS`] when any is dense; unbounded for Gemma (its
    /// parts run one after another).
    pub fn batch_row_cap(&self) -> usize {
        let Arch::Decoder { blocks, lm_head, embed, .. } = &self.arch else { return usize::MAX };
        let dense = |l: &Linear| matches!(l, Linear::Dense { .. });
        let dense_head = match lm_head {
            Some(head) => dense(head),
            None => matches!(embed.table, crate::layers::EmbeddingTable::Dense(_)),
        };
        let any_dense = dense_head
            || blocks.iter().any(|b| {
                let (a, m) = (&b.attn, &b.mlp);
                [Some(&a.q_proj), a.k_proj.as_ref(), a.v_proj.as_ref(), Some(&a.o_proj)]
                    .into_iter()
                    .flatten()
                    .chain([&m.gate_proj, &m.up_proj, &m.down_proj])
                    .any(dense)
            });
        if any_dense { mlx_core::cpu_quant::DENSE_MAX_ROWS } else { mlx_core::cpu_quant::WINDOW_MAX_ROWS }
    }

    /// Runs `tokens [B, L]` through the layers to fill `cache` without computing logits
    /// (the LM head over a long prompt is skipped), and evaluates the cache.
    ///
    /// # Errors
    /// As [`Transformer::forward`].
    pub fn prefill(&self, tokens: &Array, cache: &mut ModelCache) -> Result<()> {
        self.hidden(tokens, cache, &[])?;
        let state = cache.state();
        mlx_core::eval(&state.iter().collect::<Vec<_>>())?;
        Ok(())
    }
}

impl Block {
    /// `x [B, L, H]` through the layer, appending `L` positions to `cache`: where the fused
    /// nodes of [`mlx_core::cpu_layer`] apply (same values, fewer nodes), as one node writing
    /// a full cache ([`cpu_layer::layer`]) or two around another cache's write, else op by op.
    fn forward(&self, x: &Array, cache: &mut dyn LayerCache, rope: &Rope) -> Result<Array> {
        let fused = (x.dtype() == Dtype::Float32 && x.ndim() == 3).then(|| self.fused_weights(rope)).flatten();
        if let Some((w_in, w_out, shape, policy)) = fused {
            if let Some(full) = cache.as_full().filter(|_| policy.layer == LayerNodes::One) {
                let xs = x.shape();
                let rows = [xs[0], shape.n_kv_heads, xs[1], shape.head_dim];
                let y = full.write_with(&rows, &rows, Dtype::Float32, |keys, values, offset, in_place| {
                    let offset = offset as i32;
                    Ok(cpu_layer::layer(x, keys, values, offset, in_place, &w_in, &w_out, &shape, rope, policy)?)
                })?;
                if let Some(y) = y {
                    return Ok(y);
                }
            }
            let (q, k, v) = cpu_layer::layer_in(x, &w_in, &shape, rope, cache.offset() as i32, policy)?;
            let (keys, values) = cache.update_and_fetch(&k, &v)?;
            return Ok(cpu_layer::layer_out(x, &q, &keys, &values, &w_out, &shape, policy)?);
        }
        let r = self.attn.forward(&self.input_layernorm.forward(x)?, cache, rope, true)?;
        let h = x.add(&r)?;
        let r = self.mlp.forward(&self.post_attention_layernorm.forward(&h)?)?;
        Ok(h.add(&r)?)
    }

    /// This block's weights as [`mlx_core::cpu_layer`] takes them, when it does under the
    /// block's kernel policy ([`mlx_core::cpu_layer::applies`]): every projection quantized in
    /// one spec, float32 norms, biases and RoPE frequencies, one epsilon for the two block
    /// norms and one for the q/k norms, no MLP biases, SwiGLU. With them the model's policy:
    /// the gate projection's (the q/k/v, output and down projections hold the precision
    /// `Precision::of` gives them; the node derives those from the model's again).
    fn fused_weights(&self, rope: &Rope) -> Option<(AttentionIn<'_>, AttentionOutMlp<'_>, LayerShape, &KernelPolicy)> {
        let (a, m) = (&self.attn, &self.mlp);
        let policy = m.gate_proj.kernels();
        let (quantized, bias) = (Linear::quantized, Linear::bias);
        let (k_proj, v_proj) = (a.k_proj.as_ref()?, a.v_proj.as_ref()?);
        let qkv = [quantized(&a.q_proj)?, quantized(k_proj)?, quantized(v_proj)?];
        let mlp = [quantized(&m.gate_proj)?, quantized(&m.up_proj)?, quantized(&m.down_proj)?];
        let o = quantized(&a.o_proj)?;
        let qkv_bias = match (bias(&a.q_proj), bias(k_proj), bias(v_proj)) {
            (Some(q), Some(k), Some(v)) => Some([q, k, v]),
            (None, None, None) => None,
            _ => return None,
        };
        let qk_norms = match (&a.q_norm, &a.k_norm) {
            (Some(q), Some(k)) if q.eps == k.eps => Some([&q.weight, &k.weight]),
            (None, None) => None,
            _ => return None,
        };
        let (in_norm, post_norm) = (&self.input_layernorm, &self.post_attention_layernorm);
        let mut vectors = [&in_norm.weight, &post_norm.weight]
            .into_iter()
            .chain(qkv_bias.iter().flatten().copied())
            .chain(qk_norms.iter().flatten().copied())
            .chain(bias(&a.o_proj))
            .chain(rope.freqs.as_ref());
        let fits = cpu_layer::applies(&[o, qkv[0], qkv[1], qkv[2], mlp[0], mlp[1], mlp[2]], policy)
            && m.act == Activation::Silu
            && a.v_norm_eps.is_none()
            && post_norm.eps == in_norm.eps
            && [&m.gate_proj, &m.up_proj, &m.down_proj].iter().all(|l| l.bias().is_none())
            && vectors.all(|v| v.dtype() == Dtype::Float32);
        if !fits {
            return None;
        }
        let shape = LayerShape {
            n_heads: a.n_heads,
            n_kv_heads: a.n_kv_heads,
            head_dim: a.head_dim,
            scale: a.scale,
            norm_eps: in_norm.eps,
            qk_norm_eps: a.q_norm.as_ref().map_or(0.0, |n| n.eps),
        };
        let w_in = AttentionIn { norm: &in_norm.weight, qkv, qkv_bias, qk_norms };
        let w_out = AttentionOutMlp { o, o_bias: bias(&a.o_proj), norm: &post_norm.weight, mlp };
        Some((w_in, w_out, shape, policy))
    }
}
