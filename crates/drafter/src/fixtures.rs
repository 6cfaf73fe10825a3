//! Deterministic tiny test pairs: a Qwen3 target in the mlx-lm layout and a matching
//! `Qwen3DSparkModel` drafter in DeepSpec's layout, written into a directory the caller
//! chooses (a temporary one in tests), plus an affine quantization of the drafter in the
//! mlx-lm layout. Nothing here is committed: every run regenerates the same bytes from
//! MLX's counter-based random keys.
//!
//! The pair is built so that the drafter drafts well (acceptance is neither 0 nor 1, and
//! every round shape happens: none accepted, some, all):
//! - the target's decoder layers are weak next to its embeddings, so its next token is
//!   mostly a function of the current token: the bigram logits
//!   `lm_head · (norm.weight ⊙ rms(E[prev]))`;
//! - the drafter's Markov head is exactly that bigram: `W1 = norm.weight ⊙ rms(E)` (`[V, H]`,
//!   so `markov_rank = H`) and `W2 = lm_head` of the target, while its own `lm_head` is small.
//!   Its backbone (taps, `fc`, context attention, block) runs in full but only nudges the
//!   logits.
use std::path::Path;

use mlx_core::io::save_safetensors;
use mlx_core::quant::{QuantSpec, quantize};
use mlx_core::random::{Key, normal};
use mlx_core::{Array, Dtype, fast};
use serde_json::{Value, json};

use crate::Result;

/// The tiny target's dimensions (a Qwen3: per-head q/k norms, untied head).
pub const TARGET_LAYERS: usize = 4;
/// Hidden size of target and drafter.
pub const HIDDEN: usize = 64;
/// Vocabulary of target and drafter.
pub const VOCAB: usize = 256;
/// Tapped target layers.
pub const TAP_LAYERS: [i64; 3] = [0, 1, 2];
/// The drafter's block size γ.
pub const BLOCK_SIZE: usize = 7;
/// The drafter's mask token (the last vocabulary row).
pub const MASK_TOKEN: u32 = 255;

const HEADS: usize = 4;
const KV_HEADS: usize = 2;
const HEAD_DIM: usize = 16;
const INTERMEDIATE: usize = 128;
const DRAFT_LAYERS: usize = 2;
const EPS: f64 = 1e-6;
const ROPE_THETA: f64 = 10000.0;

/// Draws named tensors from consecutive keys of one seed, so a tensor's values depend only
/// on the seed and its place in the fixed drawing order.
struct Draw {
    seed: u64,
    next: u64,
}

impl Draw {
    fn normal(&mut self, shape: &[usize], scale: f32) -> Result<Array> {
        self.next += 1;
        let key = Key::new(self.seed.wrapping_mul(1_000_003).wrapping_add(self.next));
        let s: Vec<i32> = shape.iter().map(|&d| d as i32).collect();
        Ok(normal(&s, Dtype::Float32, 0.0, scale, &key)?)
    }

    /// `N(0, 1/fan_in) * gain` for a `[out, in]` matrix.
    fn linear(&mut self, out: usize, inp: usize, gain: f32) -> Result<Array> {
        self.normal(&[out, inp], gain / (inp as f32).sqrt())
    }

    /// `1 + 0.25 N(0, 1)`: norm weights that are not all ones.
    fn norm(&mut self, dim: usize) -> Result<Array> {
        Ok(self.normal(&[dim], 0.25)?.add(&Array::scalar(1.0))?)
    }
}

fn write_json(path: &Path, v: &Value) -> Result<()> {
    let text = serde_json::to_string_pretty(v).expect("a JSON value serializes");
    std::fs::write(path, text).map_err(|e| models::Error::io(path, e))?;
    Ok(())
}

fn save(path: &Path, tensors: &[(String, Array)], dtype: Dtype) -> Result<()> {
    let cast: Vec<(String, Array)> =
        tensors.iter().map(|(n, a)| Ok((n.clone(), a.astype(dtype)?))).collect::<Result<_>>()?;
    save_safetensors(path, cast.iter().map(|(n, a)| (n.as_str(), a)), [("format", "mlx")])?;
    Ok(())
}

/// Writes the tiny Qwen3 target (`config.json`, f32 `model.safetensors`) into `dir` (which
/// must exist): 4 layers, hidden 64, 4 query / 2 KV heads of 16, vocab 256, untied head,
/// layer weights scaled by `layer_gain` relative to `N(0, 1/fan_in)` (0.3 in the tests:
/// the bigram path dominates but the layers still flip some tokens).
///
/// # Errors
/// [`crate::Error::Mlx`] / [`crate::Error::Model`] when a file cannot be written.
pub fn write_tiny_target(dir: &Path, seed: u64, layer_gain: f32) -> Result<()> {
    let mut d = Draw { seed, next: 0 };
    let mut t: Vec<(String, Array)> = Vec::new();
    t.push(("model.embed_tokens.weight".into(), d.normal(&[VOCAB, HIDDEN], 1.0)?));
    for i in 0..TARGET_LAYERS {
        let p = format!("model.layers.{i}");
        let a = format!("{p}.self_attn");
        t.push((format!("{a}.q_proj.weight"), d.linear(HEADS * HEAD_DIM, HIDDEN, layer_gain)?));
        t.push((format!("{a}.k_proj.weight"), d.linear(KV_HEADS * HEAD_DIM, HIDDEN, layer_gain)?));
        t.push((format!("{a}.v_proj.weight"), d.linear(KV_HEADS * HEAD_DIM, HIDDEN, layer_gain)?));
        t.push((format!("{a}.o_proj.weight"), d.linear(HIDDEN, HEADS * HEAD_DIM, layer_gain)?));
        t.push((format!("{a}.q_norm.weight"), d.norm(HEAD_DIM)?));
        t.push((format!("{a}.k_norm.weight"), d.norm(HEAD_DIM)?));
        t.push((format!("{p}.mlp.gate_proj.weight"), d.linear(INTERMEDIATE, HIDDEN, layer_gain)?));
        t.push((format!("{p}.mlp.up_proj.weight"), d.linear(INTERMEDIATE, HIDDEN, layer_gain)?));
        t.push((format!("{p}.mlp.down_proj.weight"), d.linear(HIDDEN, INTERMEDIATE, layer_gain)?));
        t.push((format!("{p}.input_layernorm.weight"), d.norm(HIDDEN)?));
        t.push((format!("{p}.post_attention_layernorm.weight"), d.norm(HIDDEN)?));
    }
    t.push(("model.norm.weight".into(), d.norm(HIDDEN)?));
    t.push(("lm_head.weight".into(), d.linear(VOCAB, HIDDEN, 4.0)?));
    save(&dir.join("model.safetensors"), &t, Dtype::Float32)?;
    write_json(
        &dir.join("config.json"),
        &json!({
            "model_type": "qwen3",
            "architectures": ["Qwen3ForCausalLM"],
            "hidden_size": HIDDEN,
            "intermediate_size": INTERMEDIATE,
            "num_hidden_layers": TARGET_LAYERS,
            "num_attention_heads": HEADS,
            "num_key_value_heads": KV_HEADS,
            "head_dim": HEAD_DIM,
            "rms_norm_eps": EPS,
            "vocab_size": VOCAB,
            "rope_theta": ROPE_THETA,
            "tie_word_embeddings": false,
            "max_position_embeddings": 4096,
        }),
    )
}

/// The shape of a generated `Qwen3DSparkModel` drafter.
#[derive(Debug, Clone, PartialEq)]
pub struct DrafterDims {
    /// `H` (also the target's hidden size).
    pub hidden: usize,
    /// MLP inner width.
    pub intermediate: usize,
    /// Query heads.
    pub heads: usize,
    /// KV heads.
    pub kv_heads: usize,
    /// Head dim.
    pub head_dim: usize,
    /// Draft layers.
    pub layers: usize,
    /// `V`.
    pub vocab: usize,
    /// Markov rank `r`.
    pub markov_rank: usize,
    /// Tapped target layers.
    pub tap_layers: Vec<i64>,
    /// The target's layer count.
    pub num_target_layers: usize,
    /// γ.
    pub block_size: usize,
}

impl DrafterDims {
    /// The drafter of the tiny pair: H 64, 2 layers, 4/2 heads of 16, V 256, r 64, taps
    /// [0, 1, 2] of a 4-layer target, block 7.
    pub fn tiny() -> Self {
        DrafterDims {
            hidden: HIDDEN,
            intermediate: INTERMEDIATE,
            heads: HEADS,
            kv_heads: KV_HEADS,
            head_dim: HEAD_DIM,
            layers: DRAFT_LAYERS,
            vocab: VOCAB,
            markov_rank: HIDDEN,
            tap_layers: TAP_LAYERS.to_vec(),
            num_target_layers: TARGET_LAYERS,
            block_size: BLOCK_SIZE,
        }
    }
}

/// Writes a drafter of shape `dims` into `dir`: `embed_tokens` and the Markov tables are
/// given, everything else is drawn from `d`.
fn write_dspark(dir: &Path, dims: &DrafterDims, d: &mut Draw, embed: Array, w1: Array, w2: Array) -> Result<()> {
    let (h, hd, r) = (dims.hidden, dims.head_dim, dims.markov_rank);
    let t_feat = dims.tap_layers.len() * h;
    let mut t: Vec<(String, Array)> = vec![
        ("embed_tokens.weight".into(), embed),
        ("lm_head.weight".into(), d.linear(dims.vocab, h, 0.5)?),
        ("fc.weight".into(), d.linear(h, t_feat, 1.0)?),
        ("hidden_norm.weight".into(), d.norm(h)?),
        ("norm.weight".into(), d.norm(h)?),
    ];
    for i in 0..dims.layers {
        let p = format!("layers.{i}");
        let a = format!("{p}.self_attn");
        t.push((format!("{p}.input_layernorm.weight"), d.norm(h)?));
        t.push((format!("{p}.post_attention_layernorm.weight"), d.norm(h)?));
        t.push((format!("{a}.q_proj.weight"), d.linear(dims.heads * hd, h, 1.0)?));
        t.push((format!("{a}.k_proj.weight"), d.linear(dims.kv_heads * hd, h, 1.0)?));
        t.push((format!("{a}.v_proj.weight"), d.linear(dims.kv_heads * hd, h, 1.0)?));
        t.push((format!("{a}.o_proj.weight"), d.linear(h, dims.heads * hd, 1.0)?));
        t.push((format!("{a}.q_norm.weight"), d.norm(hd)?));
        t.push((format!("{a}.k_norm.weight"), d.norm(hd)?));
        t.push((format!("{p}.mlp.gate_proj.weight"), d.linear(dims.intermediate, h, 1.0)?));
        t.push((format!("{p}.mlp.up_proj.weight"), d.linear(dims.intermediate, h, 1.0)?));
        t.push((format!("{p}.mlp.down_proj.weight"), d.linear(h, dims.intermediate, 1.0)?));
    }
    t.push(("markov_head.markov_w1.weight".into(), w1));
    t.push(("markov_head.markov_w2.weight".into(), w2));
    t.push(("confidence_head.proj.weight".into(), d.normal(&[1, h + r], 1.5 / ((h + r) as f32).sqrt())?));
    t.push(("confidence_head.proj.bias".into(), d.normal(&[1], 0.3)?.add(&Array::scalar(1.0))?));
    save(&dir.join("model.safetensors"), &t, Dtype::Bfloat16)?;
    write_json(
        &dir.join("config.json"),
        &json!({
            "architectures": ["Qwen3DSparkModel"],
            "model_type": "qwen3",
            "dtype": "bfloat16",
            "hidden_size": h,
            "intermediate_size": dims.intermediate,
            "num_hidden_layers": dims.layers,
            "num_attention_heads": dims.heads,
            "num_key_value_heads": dims.kv_heads,
            "head_dim": hd,
            "hidden_act": "silu",
            "attention_bias": false,
            "rms_norm_eps": EPS,
            "vocab_size": dims.vocab,
            "rope_parameters": {"rope_type": "default", "rope_theta": ROPE_THETA},
            "tie_word_embeddings": false,
            "num_target_layers": dims.num_target_layers,
            "target_layer_ids": dims.tap_layers,
            "block_size": dims.block_size,
            "mask_token_id": dims.vocab - 1,
            "num_anchors": 512,
            "markov_rank": r,
            "markov_head_type": "vanilla",
            "enable_confidence_head": true,
            "confidence_head_with_markov": true,
            "layer_types": vec!["full_attention"; dims.layers],
        }),
    )
}

/// Writes a `Qwen3DSparkModel` drafter for the target in `target_dir` into `dir` (which
/// must exist), in DeepSpec's layout (`config.json` with the drafter fields, one bf16
/// `model.safetensors` with flat keys): [`DrafterDims::tiny`], mask 255, a vanilla Markov
/// head of rank 64 holding the target's bigram logits (see the module docs), and a
/// confidence head on `[h; W1[prev]]`. `embed_tokens` is the target's, as DeepSpec ships it.
///
/// # Errors
/// [`crate::Error::Mlx`] / [`crate::Error::Model`] when the target cannot be read or a file
/// cannot be written.
pub fn write_tiny_dspark(dir: &Path, target_dir: &Path, seed: u64) -> Result<()> {
    let target = mlx_core::io::load_safetensors(target_dir.join("model.safetensors"))?;
    let embed = target.get("model.embed_tokens.weight")?.clone();
    let final_norm = target.get("model.norm.weight")?.clone();
    let target_head = target.get("lm_head.weight")?.clone();
    let mut d = Draw { seed: seed ^ 0x5eed_d5a4, next: 0 };
    // W1[prev] = norm.weight ⊙ rms(E[prev]), W2 = the target's head: W2 · W1[prev] is the
    // target's logits for a residual stream equal to the embedding of prev.
    let w1 = fast::rms_norm(&embed, Some(&final_norm), EPS as f32)?;
    write_dspark(dir, &DrafterDims::tiny(), &mut d, embed, w1, target_head)
}

/// Writes a drafter of shape `dims` with random weights into `dir` (which must exist), as
/// DeepSpec's goldens initialise theirs (embedding `0.5 N(0, 1)`, `W1` `N(0, 1)`, `W2`
/// `0.8 N(0, 1) / sqrt(r)`); for benchmarks and load tests at other sizes. Mask token
/// `V - 1`.
///
/// # Errors
/// [`crate::Error::Mlx`] / [`crate::Error::Model`] when a file cannot be written.
pub fn write_random_dspark(dir: &Path, dims: &DrafterDims, seed: u64) -> Result<()> {
    let mut d = Draw { seed, next: 0 };
    let embed = d.normal(&[dims.vocab, dims.hidden], 0.5)?;
    let w1 = d.normal(&[dims.vocab, dims.markov_rank], 1.0)?;
    let w2 = d.normal(&[dims.vocab, dims.markov_rank], 0.8 / (dims.markov_rank as f32).sqrt())?;
    write_dspark(dir, dims, &mut d, embed, w1, w2)
}

/// Writes an affine-quantized copy of the drafter `src` into `dst` (which must exist), in
/// the mlx-lm layout: every 2-D `<base>.weight` whose last axis is a multiple of
/// `spec.group_size`, except `confidence_head.*`, becomes `<base>.weight` (uint32) +
/// `.scales` + `.biases` (`mlx.core.quantize`); the config gains
/// `"quantization": {"group_size", "bits", "mode": "affine", "confidence_head.proj": false}`.
/// Returns the quantized bases, sorted. This is the drafter policy of the issue in its
/// simplest form, for tests; the product's quantizer lives in its own crate.
///
/// # Errors
/// [`crate::Error::Mlx`] / [`crate::Error::Model`] on unreadable input or unwritable output.
pub fn quantize_drafter_for_tests(src: &Path, dst: &Path, spec: QuantSpec) -> Result<Vec<String>> {
    let st = mlx_core::io::load_safetensors(src.join("model.safetensors"))?;
    let mut out: Vec<(String, Array)> = Vec::new();
    let mut bases = Vec::new();
    for (name, a) in &st.tensors {
        let base = name.strip_suffix(".weight");
        let eligible =
            base.is_some_and(crate::quant::quantize_predicate) && a.ndim() == 2 && a.shape()[1] % spec.group_size == 0;
        match base {
            Some(b) if eligible => {
                let q = quantize(a, spec)?;
                out.push((format!("{b}.weight"), q.weight));
                out.push((format!("{b}.scales"), q.scales));
                out.push((format!("{b}.biases"), q.biases));
                bases.push(b.to_string());
            }
            _ => out.push((name.clone(), a.clone())),
        }
    }
    save_safetensors(dst.join("model.safetensors"), out.iter().map(|(n, a)| (n.as_str(), a)), [("format", "mlx")])?;
    let cfg_path = src.join("config.json");
    let text = std::fs::read_to_string(&cfg_path).map_err(|e| models::Error::io(&cfg_path, e))?;
    let mut cfg: Value = serde_json::from_str(&text)
        .map_err(|e| models::Error::Json { path: cfg_path.clone(), message: e.to_string() })?;
    cfg["quantization"] = json!({
        "group_size": spec.group_size,
        "bits": spec.bits,
        "mode": "affine",
        "confidence_head.proj": false,
    });
    write_json(&dst.join("config.json"), &cfg)?;
    bases.sort();
    Ok(bases)
}
