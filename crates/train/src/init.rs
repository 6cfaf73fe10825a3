//! A new DSpark drafter for a target: its shape, its initial weights, and checkpoints in
//! DeepSpec's format (`config.json` + one bf16 `model.safetensors` with flat keys; port spec
//! §1), written atomically.
use std::collections::BTreeMap;
use std::path::Path;

use mlx_core::io::model_dir::{StagedDir, write_json};
use mlx_core::quant::{self, QuantSpec};
use mlx_core::{Array, Dtype, random};
use models::weights::Weights;
use models::{ModelConfig, QuantizationConfig};
use serde_json::{Value, json};

use crate::{Error, Result};

/// The shape of a drafter for a target (the choices `build_draft_config` leaves to a config
/// file in DeepSpec). Attention and MLP sizes are the target's, as DeepSpec copies them.
#[derive(Debug, Clone, PartialEq)]
pub struct DrafterShape {
    /// Draft layers `L_d` (DeepSpec's released drafters: 5; here 1 by default: a cheap drafter
    /// for the small targets a CPU runs).
    pub layers: usize,
    /// Tapped target layers, increasing, each below the target's last layer.
    pub tap_layers: Vec<i64>,
    /// γ: drafts per block (7).
    pub block_size: usize,
    /// Markov rank `r` (DeepSpec: 256 for V = 152k; here 64: `W2` is `[V, r]` and read every
    /// draft step).
    pub markov_rank: usize,
    /// The block filler token: a row of the target's embedding that never occurs in training
    /// sequences.
    pub mask_token_id: u32,
    /// The target ids the drafter drafts from (increasing; EAGLE-3's reduced draft vocabulary,
    /// mlx-spec's extension of the checkpoint format), or `None` for the whole vocabulary.
    /// Where the LM head dominates a drafter's cost (SmolLM2: 49,152 x 576 against 3.5 M
    /// weights per draft layer), 8,192 frequent tokens make a draft call and a training step
    /// several times cheaper.
    pub draft_vocab: Option<Vec<u32>>,
}

impl DrafterShape {
    /// The default shape for `target`: 1 layer, block 7, Markov rank 64, and up to 5 taps
    /// spread from layer 1 to layer `L - 3` as DeepSpec's configs place them (Qwen3-4B, 36
    /// layers: `[1, 9, 17, 25, 33]`; SmolLM2-135M, 30 layers: `[1, 7, 14, 20, 27]`).
    pub fn for_target(target: &ModelConfig, mask_token_id: u32) -> Self {
        DrafterShape {
            layers: 1,
            tap_layers: default_taps(target.num_hidden_layers),
            block_size: 7,
            markov_rank: 64,
            mask_token_id,
            draft_vocab: None,
        }
    }

    /// Rows of the drafter's LM head and Markov `W2`.
    pub fn draft_vocab_len(&self, target: &ModelConfig) -> usize {
        self.draft_vocab.as_ref().map_or(target.vocab_size, Vec::len)
    }
}

/// The `size` tokens that occur most often in the answers of `samples` (ties: lower id first),
/// plus `always` (e.g. EOS), as an increasing list of target ids: a draft vocabulary (EAGLE-3
/// builds its `d2t` map the same way, from token frequencies of the training data).
pub fn frequent_tokens(samples: &[crate::distill::Sample], size: usize, always: &[u32]) -> Vec<u32> {
    let mut counts = std::collections::HashMap::<u32, usize>::new();
    for s in samples {
        for &t in &s.ids[s.prompt_len..] {
            *counts.entry(t).or_default() += 1;
        }
    }
    let mut ranked: Vec<(u32, usize)> = counts.into_iter().collect();
    ranked.sort_by(|a, b| b.1.cmp(&a.1).then(a.0.cmp(&b.0)));
    let mut ids: Vec<u32> = always.to_vec();
    ids.extend(
        ranked.into_iter().map(|(t, _)| t).filter(|t| !always.contains(t)).take(size.saturating_sub(always.len())),
    );
    ids.sort_unstable();
    ids.dedup();
    ids
}

/// Up to 5 increasing layers from 1 to `layers - 3` (fewer for shallow targets; never the last
/// layer, whose output the evaluator cannot tap).
pub fn default_taps(layers: usize) -> Vec<i64> {
    if layers < 6 {
        return (0..layers.saturating_sub(1).clamp(1, 3) as i64).collect();
    }
    let (first, last) = (1.0, (layers - 3) as f64);
    let n = 5.min(layers - 3);
    let mut taps: Vec<i64> =
        (0..n).map(|k| (first + (last - first) * k as f64 / (n - 1) as f64).round() as i64).collect();
    taps.dedup();
    taps
}

/// The DeepSpec `config.json` of a `Qwen3DSparkModel` of `shape` for `target`, trained with
/// `num_anchors` blocks per sequence and step (port spec §1.2: the target's dimensions plus
/// the drafter fields).
pub fn drafter_config(target: &ModelConfig, shape: &DrafterShape, num_anchors: usize) -> Value {
    let mut c = json!({
        "architectures": ["Qwen3DSparkModel"],
        "model_type": "qwen3",
        "dtype": "bfloat16",
        "hidden_size": target.hidden_size,
        "intermediate_size": target.intermediate_size,
        "num_hidden_layers": shape.layers,
        "num_attention_heads": target.num_attention_heads,
        "num_key_value_heads": target.kv_heads(),
        "head_dim": target.head_dim(),
        "attention_bias": false,
        "attention_dropout": 0.0,
        "hidden_act": "silu",
        "rms_norm_eps": target.rms_norm_eps,
        "vocab_size": target.vocab_size,
        "rope_parameters": {"rope_type": "default", "rope_theta": target.rope_base()},
        "max_position_embeddings": target.max_position_embeddings.unwrap_or(8192),
        "tie_word_embeddings": false,
        "num_target_layers": target.num_hidden_layers,
        "target_layer_ids": shape.tap_layers,
        "block_size": shape.block_size,
        "mask_token_id": shape.mask_token_id,
        "num_anchors": num_anchors,
        "markov_rank": shape.markov_rank,
        "markov_head_type": "vanilla",
        "enable_confidence_head": true,
        "confidence_head_with_markov": true,
        "layer_types": vec!["full_attention"; shape.layers],
        "initializer_range": 0.02,
    });
    if let Some(v) = &shape.draft_vocab {
        c["draft_vocab_size"] = json!(v.len());
    }
    c
}

/// Where a new drafter's layers start.
///
/// `mlx-spec train-drafter` starts from the target (`--init target`): on SmolLM2-135M that
/// drafter reached a held-out loss of 2.45 after 400 steps where a drawn one reached 2.56, and
/// greedy tau 2.34 after 3,200 steps where a drawn one reached 2.09, on the same data
/// (`docs/measurements/2026-12-03-night/`). The `Default`
/// stays `Random`: what a run stored before this choice existed started from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Init {
    /// Every trainable weight drawn as [`initial_weights`] draws it (DeepSpec's
    /// `_init_weights`).
    #[default]
    Random,
    /// Draft layer `j` of `L_d` starts as a copy of the target's decoder layer
    /// `L - L_d + j` (attention and MLP projections, both norms; per-head `q_norm` / `k_norm`
    /// when the target has them, else 1), `fc` selects the last tap (identity on its block,
    /// zero on the others) and `hidden_norm` is the input norm of the first copied layer. With
    /// the last tap at layer `L - L_d - 1` (the default taps end at `L - 3`: exactly so for two
    /// draft layers), the first draft layer's context keys and values start as the target
    /// layer's own (up to the per-head norms, which the target may lack). Layer copying as
    /// draft-model initialisation: an mlx-spec choice, not DeepSpec's (DeepSpec draws every
    /// weight); the Markov and confidence heads are drawn as under `Random`. The target's
    /// attention biases (qwen2) are not copied: the drafter has none.
    Target,
}

impl std::str::FromStr for Init {
    type Err = String;

    /// `random` or `target`.
    fn from_str(s: &str) -> std::result::Result<Self, String> {
        match s {
            "random" => Ok(Init::Random),
            "target" => Ok(Init::Target),
            _ => Err(format!("{s:?}: expected random or target")),
        }
    }
}

/// The weights of a new drafter of `shape` for the target in `target_dir`: the frozen
/// `embed_tokens` and `lm_head` (the target's input embedding and LM head, f32, dequantized
/// when stored quantized; the embedding when tied), the final `norm` initialised to the
/// target's final norm (so that `lm_head(norm(x))` starts on the target's logit scale), and
/// the rest from [`initial_weights`], overwritten by the target's layers under
/// [`Init::Target`]. Every tensor is f32: matrices `[out, in]` as the target stores them,
/// `fc.weight` `[H, taps * H]`, norms `[H]` (per-head norms `[head_dim]`).
///
/// # Errors
/// [`Error::Model`] when the target's files lack those tensors or are malformed;
/// [`Error::Config`] (`layers`) under [`Init::Target`] when the drafter has more layers than
/// the target.
pub fn new_drafter_weights(
    target_dir: &Path,
    target: &ModelConfig,
    shape: &DrafterShape,
    seed: u64,
    init: Init,
) -> Result<BTreeMap<String, Array>> {
    let config_path = target_dir.join("config.json");
    let quant = QuantizationConfig::from_config(target, &config_path)?;
    let mut weights = Weights::load(target_dir)?;
    let has_qk_norms = weights.contains("model.layers.0.self_attn.q_norm.weight");
    let mut dense = |base: &str| -> Result<Array> {
        let w = weights.take(&format!("{base}.weight"))?;
        let w = match (quant.spec_for(base), weights.take_opt(&format!("{base}.scales"))) {
            (Some(spec), Some(scales)) => {
                let biases = weights.take(&format!("{base}.biases"))?;
                quant::dequantize(&w, &scales, &biases, QuantSpec::new(spec.group_size, spec.bits)?)?
            }
            _ => w,
        };
        Ok(w.astype(Dtype::Float32)?)
    };
    let embed = dense("model.embed_tokens")?;
    let head = if target.tied_embeddings() { embed.clone() } else { dense("lm_head")? };
    let final_norm = dense("model.norm")?;
    let mut t = initial_weights(target, shape, seed)?;
    if init == Init::Target {
        let first = target.num_hidden_layers.checked_sub(shape.layers).ok_or_else(|| Error::Config {
            setting: "layers",
            message: format!(
                "{} draft layers cannot start as copies of a {}-layer target's last layers",
                shape.layers, target.num_hidden_layers
            ),
        })?;
        for j in 0..shape.layers {
            let (d, s) = (format!("layers.{j}"), format!("model.layers.{}", first + j));
            for m in [
                "self_attn.q_proj",
                "self_attn.k_proj",
                "self_attn.v_proj",
                "self_attn.o_proj",
                "mlp.gate_proj",
                "mlp.up_proj",
                "mlp.down_proj",
                "input_layernorm",
                "post_attention_layernorm",
            ] {
                t.insert(format!("{d}.{m}.weight"), dense(&format!("{s}.{m}"))?);
            }
            for m in ["self_attn.q_norm", "self_attn.k_norm"].iter().filter(|_| has_qk_norms) {
                t.insert(format!("{d}.{m}.weight"), dense(&format!("{s}.{m}"))?);
            }
        }
        let (h, width) = (target.hidden_size, shape.tap_layers.len() * target.hidden_size);
        let mut select_last = vec![0f32; h * width];
        for r in 0..h {
            select_last[r * width + width - h + r] = 1.0;
        }
        let select_last = Array::from_slice(&select_last, &[h as i32, width as i32])?;
        t.insert("fc.weight".into(), select_last);
        let first_norm = t["layers.0.input_layernorm.weight"].clone();
        t.insert("hidden_norm.weight".into(), first_norm);
    }
    let head = match &shape.draft_vocab {
        Some(ids) => {
            let ids: Vec<i32> = ids.iter().map(|&i| i as i32).collect();
            let ids = Array::from_slice(&ids, &[ids.len() as i32])?;
            t.insert("draft_vocab_ids".into(), ids.clone());
            head.take(&ids, 0)?
        }
        None => head,
    };
    t.insert("embed_tokens.weight".into(), embed);
    t.insert("lm_head.weight".into(), head);
    t.insert("norm.weight".into(), final_norm);
    Ok(t)
}

/// Initial trainable weights of a drafter of `shape` (`config` from [`drafter_config`]), as
/// transformers' `_init_weights` draws them for DeepSpec's drafters: linear and embedding
/// weights `N(0, 0.02)`, biases 0, norm weights 1. Names are DeepSpec's.
///
/// # Errors
/// [`Error::Mlx`] when drawing fails.
pub fn initial_weights(target: &ModelConfig, shape: &DrafterShape, seed: u64) -> Result<BTreeMap<String, Array>> {
    let (h, i, v, r) = (target.hidden_size, target.intermediate_size, target.vocab_size, shape.markov_rank);
    let k = shape.draft_vocab_len(target);
    let (nh, nkv, hd) = (target.num_attention_heads, target.kv_heads(), target.head_dim());
    let mut next = 0u64;
    let mut t = BTreeMap::new();
    let mut normal = |name: String, rows: usize, cols: usize| -> Result<()> {
        next += 1; // one key per tensor, in a fixed order
        let key = random::Key::new(seed.wrapping_mul(0x9e37_79b9_7f4a_7c15).wrapping_add(next));
        let a = random::normal(&[rows as i32, cols as i32], Dtype::Float32, 0.0, 0.02, &key)?;
        t.insert(name, a);
        Ok(())
    };
    normal("fc.weight".into(), h, shape.tap_layers.len() * h)?;
    for l in 0..shape.layers {
        let a = format!("layers.{l}.self_attn");
        normal(format!("{a}.q_proj.weight"), nh * hd, h)?;
        normal(format!("{a}.k_proj.weight"), nkv * hd, h)?;
        normal(format!("{a}.v_proj.weight"), nkv * hd, h)?;
        normal(format!("{a}.o_proj.weight"), h, nh * hd)?;
        let m = format!("layers.{l}.mlp");
        normal(format!("{m}.gate_proj.weight"), i, h)?;
        normal(format!("{m}.up_proj.weight"), i, h)?;
        normal(format!("{m}.down_proj.weight"), h, i)?;
    }
    normal("markov_head.markov_w1.weight".into(), v, r)?;
    normal("markov_head.markov_w2.weight".into(), k, r)?;
    normal("confidence_head.proj.weight".into(), 1, h + r)?;
    let ones = |n: usize| Array::ones(&[n as i32], Dtype::Float32);
    t.insert("confidence_head.proj.bias".into(), Array::zeros(&[1], Dtype::Float32)?);
    t.insert("hidden_norm.weight".into(), ones(h)?);
    t.insert("norm.weight".into(), ones(h)?);
    for l in 0..shape.layers {
        t.insert(format!("layers.{l}.input_layernorm.weight"), ones(h)?);
        t.insert(format!("layers.{l}.post_attention_layernorm.weight"), ones(h)?);
        t.insert(format!("layers.{l}.self_attn.q_norm.weight"), ones(hd)?);
        t.insert(format!("layers.{l}.self_attn.k_norm.weight"), ones(hd)?);
    }
    mlx_core::eval(&t.values().collect::<Vec<_>>())?;
    Ok(t)
}

/// Writes a drafter checkpoint into `dir` in DeepSpec's format: `config` as `config.json` and
/// `tensors` (floating-point ones cast to bf16) in one `model.safetensors`, plus whatever `extra` writes into the
/// directory it is given (a loss curve, a summary), all built in a staging directory beside
/// `dir` and renamed into place (replacing an older `dir`).
///
/// # Errors
/// [`Error::Mlx`] naming the file when it cannot be written; `extra`'s errors.
pub fn write_checkpoint(
    dir: &Path,
    config: &Value,
    tensors: &BTreeMap<String, Array>,
    extra: &dyn Fn(&Path) -> Result<()>,
) -> Result<()> {
    let staged = StagedDir::create(dir, "writing")?;
    let cast: Vec<(&str, Array)> = tensors
        .iter()
        .map(|(k, a)| Ok((k.as_str(), if a.dtype().is_float() { a.astype(Dtype::Bfloat16)? } else { a.clone() })))
        .collect::<Result<_>>()?;
    let result = write_json(&staged.path().join("config.json"), config).and_then(|_| {
        mlx_core::io::save_safetensors(
            staged.path().join("model.safetensors"),
            cast.iter().map(|(k, a)| (*k, a)),
            [("format", "pt")],
        )
    });
    result.map_err(|e| e.with_paths(&|p| staged.shown(p)))?;
    extra(staged.path())?;
    staged.commit(true)?;
    Ok(())
}

/// Checks that `shape` fits `target`: taps inside its decoder layers and increasing, the mask
/// token inside the vocabulary, a non-empty drafter.
///
/// # Errors
/// [`Error::Config`] naming the setting.
pub fn check_shape(target: &ModelConfig, shape: &DrafterShape) -> Result<()> {
    let bad = |setting, message: String| Err(Error::Config { setting, message });
    let layers = target.num_hidden_layers as i64;
    if shape.tap_layers.is_empty()
        || shape.tap_layers.windows(2).any(|w| w[0] >= w[1])
        || shape.tap_layers.iter().any(|&t| t < 0 || t >= layers)
    {
        return bad("tap_layers", format!("{:?}: expected increasing layers in 0..{layers}", shape.tap_layers));
    }
    if shape.mask_token_id as usize >= target.vocab_size {
        return bad(
            "mask_token_id",
            format!("{} is outside the vocabulary of {}", shape.mask_token_id, target.vocab_size),
        );
    }
    if let Some(ids) = &shape.draft_vocab
        && (ids.is_empty()
            || ids.windows(2).any(|w| w[0] >= w[1])
            || ids.iter().any(|&t| t as usize >= target.vocab_size))
    {
        return bad(
            "draft_vocab",
            format!("{} ids: expected increasing target ids below {}", ids.len(), target.vocab_size),
        );
    }
    if shape.layers == 0 || shape.block_size == 0 || shape.markov_rank == 0 {
        return bad(
            "shape",
            format!(
                "layers {}, block size {} and markov rank {} must be positive",
                shape.layers, shape.block_size, shape.markov_rank
            ),
        );
    }
    Ok(())
}
