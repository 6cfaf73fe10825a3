//! Deterministic tiny test pairs, written into a directory the caller chooses (a temporary
//! one in tests): a Qwen3 target ([`write_tiny_target`]) or a Gemma 4 text target with
//! sliding-window layers ([`write_tiny_gemma4_target`]) in the mlx-lm layout, a matching
//! `Qwen3DSparkModel` / `Gemma4DSparkModel` drafter in DeepSpec's layout
//! ([`write_tiny_dspark`] picks the class from the target), plus an affine quantization of
//! the drafter in the mlx-lm layout. Nothing here is committed: every run regenerates the
//! same bytes from MLX's counter-based random keys.
//!
//! [`write_tiny_pair`] writes the Qwen3 pair the tests share, its target with a byte-level
//! tokenizer and a chat template ([`write_byte_tokenizer`]) so that `mlx-spec generate` and
//! `mlx-spec serve` can run it too (`cargo xtask serve-test` serves it, with the drafter).
//!
//! A pair is built so that the drafter drafts well (acceptance is neither 0 nor 1, and
//! every round shape happens: none accepted, some, all):
//! - the target's decoder layers are weak next to its embeddings (Qwen3: small weights;
//!   Gemma 4: small post-attention / post-feed-forward norm weights, since its sandwich norms
//!   rescale what a layer adds), so its next token is mostly a function of the current
//!   token: the bigram logits `lm_head · (norm.weight ⊙ rms(E[prev]))` (the RMS norm makes
//!   Gemma's embedding scale irrelevant; its soft-capping keeps the argmax);
//! - the drafter's Markov head is exactly that bigram: `W1 = norm.weight ⊙ rms(E)` (`[V, H]`,
//!   so `markov_rank = H`) and `W2 = lm_head` of the target (its embedding when tied), while
//!   its own `lm_head` is small. Its backbone (taps, `fc`, context attention, block) runs in
//!   full but only nudges the logits.
use std::path::{Path, PathBuf};

use mlx_core::io::save_safetensors;
use mlx_core::quant::QuantSpec;
use mlx_core::random::{Key, normal};
use mlx_core::{Array, Dtype, fast};
use serde_json::{Value, json};

use drafter::{Architecture, Result};

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

/// The tiny Gemma 4 target's layers: sliding (window [`GEMMA4_SLIDING_WINDOW`]) and full
/// attention; the last two share the keys/values of earlier layers (KV sharing).
pub const GEMMA4_LAYER_TYPES: [&str; 6] = [
    "sliding_attention",
    "sliding_attention",
    "full_attention",
    "sliding_attention",
    "sliding_attention",
    "full_attention",
];
/// Sliding window of the tiny Gemma 4 target (positions, the query included): short, so a
/// 40-token request wraps the rotating caches several times.
pub const GEMMA4_SLIDING_WINDOW: usize = 8;
/// Tapped layers of the tiny Gemma 4 target (a sliding, a full and a KV-shared layer).
pub const GEMMA4_TAP_LAYERS: [i64; 3] = [1, 2, 4];
const GEMMA4_KV_SHARED: usize = 2;
const GEMMA4_GLOBAL_HEAD_DIM: usize = 32;
const GEMMA4_GLOBAL_KV_HEADS: usize = 1;
const GEMMA4_SOFTCAP: f64 = 30.0;

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
/// [`drafter::Error::Mlx`] / [`drafter::Error::Model`] when a file cannot be written.
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

/// Seed of [`write_tiny_pair`]'s target and drafter.
pub const PAIR_SEED: u64 = 11;
/// Layer gain of [`write_tiny_pair`]'s target (see [`write_tiny_target`]).
pub const PAIR_LAYER_GAIN: f32 = 0.3;
/// The EOS byte of [`write_byte_tokenizer`]: `0x1b` (ESC), a control byte text rarely holds
/// and one that [`write_tiny_pair`]'s target rarely produces: its bigram logits (see the
/// module docs) never rank it above 7th, so greedy outputs run to `max_tokens` (the target's
/// attractors, `0x7f` among them, would stop them after a few tokens).
pub const BYTE_EOS: u8 = 0x1b;
/// [`write_byte_tokenizer`]'s chat template: ChatML (`<|im_start|>role\ncontent<|im_end|>\n`
/// per message, then `<|im_start|>assistant\n` with `add_generation_prompt`). The markers
/// are plain text to the byte-level tokenizer (a byte per token), not special tokens.
pub const BYTE_CHAT_TEMPLATE: &str = "{% for message in messages %}<|im_start|>{{ message.role }}\n\
    {{ message.content }}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}";

/// Writes the tiny Qwen3 pair the tests share under `root` (created if needed) and returns
/// `(target, drafter)`: `root/target` ([`write_tiny_target`] with [`PAIR_SEED`] and
/// [`PAIR_LAYER_GAIN`], plus [`write_byte_tokenizer`]'s files, so it is a model directory
/// `mlx-spec generate` and `serve` accept) and `root/dspark` ([`write_tiny_dspark`] of that
/// target, same seed). Deterministic: the same bytes on every call.
///
/// # Errors
/// [`drafter::Error::Mlx`] / [`drafter::Error::Model`] when a directory or file cannot be
/// written.
pub fn write_tiny_pair(root: &Path) -> Result<(PathBuf, PathBuf)> {
    let (t, d) = (root.join("target"), root.join("dspark"));
    for dir in [&t, &d] {
        std::fs::create_dir_all(dir).map_err(|e| models::Error::io(dir, e))?;
    }
    write_tiny_target(&t, PAIR_SEED, PAIR_LAYER_GAIN)?;
    write_byte_tokenizer(&t)?;
    write_tiny_dspark(&d, &t, PAIR_SEED)?;
    Ok((t, d))
}

/// GPT-2's byte-to-symbol map (`bytes_to_unicode`): printable Latin-1 bytes stand for
/// themselves, the other 68 are shifted to U+0100.. in byte order.
fn byte_symbols() -> [char; 256] {
    let printable = |b: u32| (0x21..=0x7e).contains(&b) || (0xa1..=0xac).contains(&b) || (0xae..=0xff).contains(&b);
    let mut out = ['\0'; 256];
    let mut shifted = 0;
    for (b, slot) in out.iter_mut().enumerate() {
        let b = b as u32;
        let c = if printable(b) {
            b
        } else {
            shifted += 1;
            255 + shifted
        };
        *slot = char::from_u32(c).expect("below U+0200");
    }
    out
}

/// Writes a byte-level tokenizer of exactly [`VOCAB`] = 256 tokens into `dir` (which must
/// exist), id `b` being byte `b`, for the tiny targets (which have no tokenizer of their own):
/// - `tokenizer.json`: a `tokenizers` BPE model whose vocabulary is the 256 byte-level
///   symbols (GPT-2's `bytes_to_unicode`) and which has no merges, with the ByteLevel
///   pre-tokenizer and decoder, no normalizer, no post-processor and no added tokens. Any
///   text encodes to its UTF-8 bytes and decodes back; ids that are not valid UTF-8 decode
///   to U+FFFD.
/// - `tokenizer_config.json`: `eos_token` the symbol of [`BYTE_EOS`], no BOS
///   (`add_bos_token` false), and [`BYTE_CHAT_TEMPLATE`] as `chat_template`.
///
/// # Errors
/// [`drafter::Error::Model`] when a file cannot be written.
pub fn write_byte_tokenizer(dir: &Path) -> Result<()> {
    let symbols = byte_symbols();
    let vocab: serde_json::Map<String, Value> =
        symbols.iter().enumerate().map(|(id, c)| (c.to_string(), json!(id))).collect();
    let byte_level = json!({"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": true});
    write_json(
        &dir.join("tokenizer.json"),
        &json!({
            "version": "1.0",
            "truncation": null,
            "padding": null,
            "added_tokens": [],
            "normalizer": null,
            "pre_tokenizer": byte_level,
            "post_processor": null,
            "decoder": byte_level,
            "model": {
                "type": "BPE",
                "dropout": null,
                "unk_token": null,
                "continuing_subword_prefix": null,
                "end_of_word_suffix": null,
                "fuse_unk": false,
                "byte_fallback": false,
                "ignore_merges": false,
                "vocab": vocab,
                "merges": [],
            },
        }),
    )?;
    write_json(
        &dir.join("tokenizer_config.json"),
        &json!({
            "tokenizer_class": "PreTrainedTokenizerFast",
            "eos_token": symbols[BYTE_EOS as usize].to_string(),
            "add_bos_token": false,
            "add_eos_token": false,
            "chat_template": BYTE_CHAT_TEMPLATE,
        }),
    )
}

/// Writes a tiny Gemma 4 text target (`config.json`, f32 `model.safetensors`, mlx-lm's
/// `gemma4_text` layout) into `dir` (which must exist): 6 layers of
/// [`GEMMA4_LAYER_TYPES`] with a sliding window of [`GEMMA4_SLIDING_WINDOW`], hidden 64,
/// 4 query heads (sliding: 2 KV heads of 16; full: `attention_k_eq_v`, 1 KV head of 32, a
/// proportional rope over a quarter of the pairs), the last 2 layers KV-shared with
/// double-wide MLPs, `layer_scalar`s, logit soft-capping at 30, vocab 256, tied embeddings.
/// `layer_gain` scales the post-attention and post-feed-forward norm weights, i.e. the size
/// of what each layer adds to a residual stream of RMS `sqrt(H)` (the tests use 1.5).
///
/// # Errors
/// [`drafter::Error::Mlx`] / [`drafter::Error::Model`] when a file cannot be written.
pub fn write_tiny_gemma4_target(dir: &Path, seed: u64, layer_gain: f32) -> Result<()> {
    let mut d = Draw { seed: seed ^ 0x006e_44a4, next: 0 };
    let n = GEMMA4_LAYER_TYPES.len();
    let cached = n - GEMMA4_KV_SHARED;
    let mut t: Vec<(String, Array)> = vec![("model.embed_tokens.weight".into(), d.normal(&[VOCAB, HIDDEN], 1.0)?)];
    for (i, kind) in GEMMA4_LAYER_TYPES.iter().enumerate() {
        let (p, a) = (format!("model.layers.{i}"), format!("model.layers.{i}.self_attn"));
        let full = *kind == "full_attention";
        let (hd, kv) = if full { (GEMMA4_GLOBAL_HEAD_DIM, GEMMA4_GLOBAL_KV_HEADS) } else { (HEAD_DIM, KV_HEADS) };
        let ff = if i >= cached { 2 * INTERMEDIATE } else { INTERMEDIATE };
        t.push((format!("{a}.q_proj.weight"), d.linear(HEADS * hd, HIDDEN, 1.0)?));
        t.push((format!("{a}.q_norm.weight"), d.norm(hd)?));
        if i < cached {
            t.push((format!("{a}.k_proj.weight"), d.linear(kv * hd, HIDDEN, 1.0)?));
            t.push((format!("{a}.k_norm.weight"), d.norm(hd)?));
            if !full {
                t.push((format!("{a}.v_proj.weight"), d.linear(kv * hd, HIDDEN, 1.0)?));
            }
        }
        t.push((format!("{a}.o_proj.weight"), d.linear(HIDDEN, HEADS * hd, 1.0)?));
        t.push((format!("{p}.mlp.gate_proj.weight"), d.linear(ff, HIDDEN, 1.0)?));
        t.push((format!("{p}.mlp.up_proj.weight"), d.linear(ff, HIDDEN, 1.0)?));
        t.push((format!("{p}.mlp.down_proj.weight"), d.linear(HIDDEN, ff, 1.0)?));
        t.push((format!("{p}.input_layernorm.weight"), d.norm(HIDDEN)?));
        t.push((format!("{p}.pre_feedforward_layernorm.weight"), d.norm(HIDDEN)?));
        for post in ["post_attention_layernorm", "post_feedforward_layernorm"] {
            t.push((format!("{p}.{post}.weight"), d.norm(HIDDEN)?.multiply(&Array::scalar(layer_gain))?));
        }
        t.push((format!("{p}.layer_scalar"), d.normal(&[1], 0.1)?.add(&Array::scalar(1.0))?));
    }
    t.push(("model.norm.weight".into(), d.norm(HIDDEN)?));
    save(&dir.join("model.safetensors"), &t, Dtype::Float32)?;
    write_json(
        &dir.join("config.json"),
        &json!({
            "model_type": "gemma4_text",
            "architectures": ["Gemma4ForCausalLM"],
            "hidden_size": HIDDEN,
            "intermediate_size": INTERMEDIATE,
            "num_hidden_layers": n,
            "num_attention_heads": HEADS,
            "num_key_value_heads": KV_HEADS,
            "head_dim": HEAD_DIM,
            "global_head_dim": GEMMA4_GLOBAL_HEAD_DIM,
            "num_global_key_value_heads": GEMMA4_GLOBAL_KV_HEADS,
            "attention_k_eq_v": true,
            "layer_types": GEMMA4_LAYER_TYPES,
            "sliding_window": GEMMA4_SLIDING_WINDOW,
            "num_kv_shared_layers": GEMMA4_KV_SHARED,
            "use_double_wide_mlp": true,
            "hidden_size_per_layer_input": 0,
            "final_logit_softcapping": GEMMA4_SOFTCAP,
            "rms_norm_eps": EPS,
            "vocab_size": VOCAB,
            "tie_word_embeddings": true,
            "max_position_embeddings": 4096,
            "rope_parameters": {
                "full_attention": {"partial_rotary_factor": 0.25, "rope_theta": 1_000_000.0, "rope_type": "proportional"},
                "sliding_attention": {"rope_theta": ROPE_THETA, "rope_type": "default"},
            },
        }),
    )
}

/// The shape of a generated `Qwen3DSparkModel` / `Gemma4DSparkModel` drafter.
#[derive(Debug, Clone, PartialEq)]
pub struct DrafterDims {
    /// The drafter class.
    pub architecture: Architecture,
    /// Gemma4 `attention_k_eq_v` (no `v_proj`); ignored for Qwen3.
    pub k_eq_v: bool,
    /// `H` (also the target's hidden size).
    pub hidden: usize,
    /// MLP inner width.
    pub intermediate: usize,
    /// Query heads.
    pub heads: usize,
    /// KV heads.
    pub kv_heads: usize,
    /// Head dim (Gemma4: written as `global_head_dim`, the one its drafter uses).
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
            architecture: Architecture::Qwen3,
            k_eq_v: false,
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

    /// The drafter of the tiny Gemma 4 pair: as [`DrafterDims::tiny`] but a
    /// `Gemma4DSparkModel` with `k_eq_v`, 1 KV head of 32, taps [`GEMMA4_TAP_LAYERS`] of the
    /// 6-layer target.
    pub fn tiny_gemma4() -> Self {
        DrafterDims {
            architecture: Architecture::Gemma4,
            k_eq_v: true,
            kv_heads: GEMMA4_GLOBAL_KV_HEADS,
            head_dim: GEMMA4_GLOBAL_HEAD_DIM,
            tap_layers: GEMMA4_TAP_LAYERS.to_vec(),
            num_target_layers: GEMMA4_LAYER_TYPES.len(),
            ..DrafterDims::tiny()
        }
    }
}

/// Writes a drafter of shape `dims` into `dir`: `embed_tokens` and the Markov tables are
/// given, everything else is drawn from `d`.
fn write_dspark(dir: &Path, dims: &DrafterDims, d: &mut Draw, embed: Array, w1: Array, w2: Array) -> Result<()> {
    let (h, hd, r) = (dims.hidden, dims.head_dim, dims.markov_rank);
    let gemma = dims.architecture == Architecture::Gemma4;
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
        if !(gemma && dims.k_eq_v) {
            t.push((format!("{a}.v_proj.weight"), d.linear(dims.kv_heads * hd, h, 1.0)?));
        }
        t.push((format!("{a}.o_proj.weight"), d.linear(h, dims.heads * hd, 1.0)?));
        t.push((format!("{a}.q_norm.weight"), d.norm(hd)?));
        t.push((format!("{a}.k_norm.weight"), d.norm(hd)?));
        t.push((format!("{p}.mlp.gate_proj.weight"), d.linear(dims.intermediate, h, 1.0)?));
        t.push((format!("{p}.mlp.up_proj.weight"), d.linear(dims.intermediate, h, 1.0)?));
        t.push((format!("{p}.mlp.down_proj.weight"), d.linear(h, dims.intermediate, 1.0)?));
        if gemma {
            t.push((format!("{p}.pre_feedforward_layernorm.weight"), d.norm(h)?));
            t.push((format!("{p}.post_feedforward_layernorm.weight"), d.norm(h)?));
            t.push((format!("{p}.layer_scalar"), d.normal(&[1], 0.1)?.add(&Array::scalar(1.0))?));
        }
    }
    t.push(("markov_head.markov_w1.weight".into(), w1));
    t.push(("markov_head.markov_w2.weight".into(), w2));
    t.push(("confidence_head.proj.weight".into(), d.normal(&[1, h + r], 1.5 / ((h + r) as f32).sqrt())?));
    t.push(("confidence_head.proj.bias".into(), d.normal(&[1], 0.3)?.add(&Array::scalar(1.0))?));
    save(&dir.join("model.safetensors"), &t, Dtype::Bfloat16)?;
    let mut config = json!({
        "architectures": [dims.architecture.name()],
        "dtype": "bfloat16",
        "hidden_size": h,
        "intermediate_size": dims.intermediate,
        "num_hidden_layers": dims.layers,
        "num_attention_heads": dims.heads,
        "num_key_value_heads": dims.kv_heads,
        "head_dim": hd,
        "attention_bias": false,
        "rms_norm_eps": EPS,
        "vocab_size": dims.vocab,
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
    });
    let extra = if gemma {
        // As DeepSpec's `build_draft_config` copies a Gemma 4 text config: the drafter's
        // layers use the full-attention head dim, KV heads and proportional rope.
        json!({
            "model_type": "gemma4_text",
            "hidden_activation": "gelu_pytorch_tanh",
            "head_dim": HEAD_DIM,
            "global_head_dim": hd,
            "num_global_key_value_heads": dims.kv_heads,
            "attention_k_eq_v": dims.k_eq_v,
            "final_logit_softcapping": GEMMA4_SOFTCAP,
            "hidden_size_per_layer_input": 0,
            "num_kv_shared_layers": 0,
            "use_double_wide_mlp": false,
            "enable_moe_block": false,
            "rope_parameters": {
                "full_attention": {"partial_rotary_factor": 0.25, "rope_theta": 1_000_000.0, "rope_type": "proportional"},
                "sliding_attention": {"rope_theta": ROPE_THETA, "rope_type": "default"},
            },
        })
    } else {
        json!({
            "model_type": "qwen3",
            "hidden_act": "silu",
            "rope_parameters": {"rope_type": "default", "rope_theta": ROPE_THETA},
        })
    };
    let (Value::Object(c), Value::Object(e)) = (&mut config, extra) else { unreachable!("both are JSON objects") };
    c.extend(e);
    write_json(&dir.join("config.json"), &config)
}

/// Writes a DSpark drafter for the tiny target in `target_dir` (made by [`write_tiny_target`]
/// or [`write_tiny_gemma4_target`]) into `dir` (which must exist), in DeepSpec's layout
/// (`config.json` with the drafter fields, one bf16 `model.safetensors` with flat keys): a
/// `Qwen3DSparkModel` of [`DrafterDims::tiny`] for the Qwen3 target, a `Gemma4DSparkModel` of
/// [`DrafterDims::tiny_gemma4`] for the Gemma 4 one; mask 255, a vanilla Markov head of rank
/// 64 holding the target's bigram logits (see the module docs), and a confidence head on
/// `[h; W1[prev]]`. `embed_tokens` is the target's, as DeepSpec ships it.
///
/// # Errors
/// [`drafter::Error::Mlx`] / [`drafter::Error::Model`] when the target cannot be read or a file
/// cannot be written.
pub fn write_tiny_dspark(dir: &Path, target_dir: &Path, seed: u64) -> Result<()> {
    let target = mlx_core::io::load_safetensors(target_dir.join("model.safetensors"))?;
    let embed = target.get("model.embed_tokens.weight")?.clone();
    let final_norm = target.get("model.norm.weight")?.clone();
    let (dims, target_head) = match target.get("lm_head.weight") {
        Ok(head) => (DrafterDims::tiny(), head.clone()),
        Err(_) => (DrafterDims::tiny_gemma4(), embed.clone()),
    };
    let mut d = Draw { seed: seed ^ 0x5eed_d5a4, next: 0 };
    // W1[prev] = norm.weight ⊙ rms(E[prev]), W2 = the target's head: W2 · W1[prev] is the
    // target's logits for a residual stream equal to (a multiple of) the embedding of prev.
    let w1 = fast::rms_norm(&embed, Some(&final_norm), EPS as f32, &mlx_core::KernelPolicy::default())?;
    write_dspark(dir, &dims, &mut d, embed, w1, target_head)
}

/// Writes a drafter of shape `dims` with random weights into `dir` (which must exist), as
/// DeepSpec's goldens initialise theirs (embedding `0.5 N(0, 1)`, `W1` `N(0, 1)`, `W2`
/// `0.8 N(0, 1) / sqrt(r)`); for benchmarks and load tests at other sizes. Mask token
/// `V - 1`.
///
/// # Errors
/// [`drafter::Error::Mlx`] / [`drafter::Error::Model`] when a file cannot be written.
pub fn write_random_dspark(dir: &Path, dims: &DrafterDims, seed: u64) -> Result<()> {
    let mut d = Draw { seed, next: 0 };
    let embed = d.normal(&[dims.vocab, dims.hidden], 0.5)?;
    let w1 = d.normal(&[dims.vocab, dims.markov_rank], 1.0)?;
    let w2 = d.normal(&[dims.vocab, dims.markov_rank], 0.8 / (dims.markov_rank as f32).sqrt())?;
    write_dspark(dir, dims, &mut d, embed, w1, w2)
}

/// Quantizes the drafter in `src` into `dst` with the product's drafter policy
/// ([`drafter::quant::quantize_drafter_dir`]: everything eligible but `confidence_head.*`,
/// atomic write, load smoke), replacing `dst` if it exists. Returns the quantized module
/// bases, sorted.
///
/// # Errors
/// Those of [`drafter::quant::quantize_drafter_dir`].
pub fn quantize_drafter_for_tests(src: &Path, dst: &Path, spec: QuantSpec) -> Result<Vec<String>> {
    let r = drafter::quant::quantize_drafter_dir(src, dst, spec.bits, spec.group_size, true, &mut |_| {})?;
    let mut bases = r.quantize.quantized_modules;
    bases.sort();
    Ok(bases)
}

#[cfg(test)]
mod tests {
    use super::*;
    use models::tokenizer::{ChatMessage, Tokenizer};

    #[test]
    fn the_byte_tokenizer_loads_and_round_trips() {
        let dir = tempfile::tempdir().unwrap();
        write_byte_tokenizer(dir.path()).unwrap();
        let tok = Tokenizer::from_dir(dir.path()).unwrap();
        assert_eq!(tok.vocab_size(), VOCAB);
        assert_eq!(tok.eos_ids(), &[u32::from(BYTE_EOS)]);
        assert!(!tok.adds_bos());
        for text in ["", "hello world", "  two  spaces\nand a line", "héllo → 世界 🦀", "<|im_start|>"] {
            let ids = tok.encode(text, true).unwrap();
            let bytes: Vec<u32> = text.bytes().map(u32::from).collect();
            assert_eq!(ids, bytes, "{text:?}: one id per byte, the byte's value");
            assert_eq!(tok.decode(&ids, false).unwrap(), text);
        }
        let all: Vec<u32> = (0..=255).collect();
        for id in &all {
            assert_eq!(tok.token_to_id(&tok.id_to_token(*id).unwrap()), Some(*id));
        }
        let rendered =
            tok.apply_chat_template(&[ChatMessage::system("Be brief."), ChatMessage::user("Hi!")], true).unwrap();
        assert_eq!(
            rendered,
            "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi!<|im_end|>\n<|im_start|>assistant\n"
        );
    }
}
