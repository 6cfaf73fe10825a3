//! `config.json` of a DeepSpec drafter checkpoint: the target's (text) config deep-copied by
//! DeepSpec's `build_draft_config` plus the drafter fields (`deepspec-port-spec.md` §1.2;
//! `deepspec/modeling/dspark/{qwen3,gemma4}/config.py`).
use std::path::{Path, PathBuf};

use serde::Deserialize;
use serde_json::Value;

use crate::{Error, Result};

/// The two drafter classes DeepSpec ships (`architectures[0]`). DFlash checkpoints use the
/// same strings with `markov_rank` 0 and no confidence head.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Architecture {
    /// `Qwen3DSparkModel`: Qwen3 layers (pre-norm, per-head q/k RMS norms, SiLU MLP).
    Qwen3,
    /// `Gemma4DSparkModel`: Gemma 4 layers (sandwich norms, `k_eq_v`, weightless v norm,
    /// proportional partial RoPE, `layer_scalar`, GELU-tanh, embedding scale, soft-capping).
    Gemma4,
}

impl Architecture {
    /// The `architectures[0]` string.
    pub fn name(self) -> &'static str {
        match self {
            Architecture::Qwen3 => "Qwen3DSparkModel",
            Architecture::Gemma4 => "Gemma4DSparkModel",
        }
    }
}

/// The Markov head variant (`markov_head_type`); only `vanilla` is implemented.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MarkovHeadType {
    /// `z_k = U_k + W2 · W1[prev_k]` (paper Eq. 4-5, `markov_head.py:55-90`).
    Vanilla,
}

/// The raw fields of `config.json` (names as DeepSpec / transformers write them).
#[derive(Debug, Clone, Deserialize)]
pub struct RawConfig {
    /// `["Qwen3DSparkModel"]` or `["Gemma4DSparkModel"]`.
    #[serde(default)]
    pub architectures: Vec<String>,
    /// Inherited `model_type` (`qwen3`, `gemma4_text`).
    pub model_type: Option<String>,
    /// `H`.
    pub hidden_size: Option<usize>,
    /// MLP inner width `I`.
    pub intermediate_size: Option<usize>,
    /// Draft layers `L_d`.
    pub num_hidden_layers: Option<usize>,
    /// Query heads.
    pub num_attention_heads: Option<usize>,
    /// KV heads (Qwen3; Gemma4 without `k_eq_v`).
    pub num_key_value_heads: Option<usize>,
    /// Head dim (Qwen3; Gemma4's drafter uses `global_head_dim` instead).
    pub head_dim: Option<usize>,
    /// Gemma4: the drafter's head dim.
    pub global_head_dim: Option<usize>,
    /// Gemma4: KV heads when `attention_k_eq_v`.
    pub num_global_key_value_heads: Option<usize>,
    /// Gemma4: V is the raw `k_proj` output (no `v_proj`).
    #[serde(default)]
    pub attention_k_eq_v: bool,
    /// RMS norm epsilon.
    pub rms_norm_eps: Option<f32>,
    /// `V`.
    pub vocab_size: Option<usize>,
    /// Top-level RoPE base (older configs).
    pub rope_theta: Option<f64>,
    /// transformers 5's RoPE block (Gemma4 nests `full_attention` in it).
    pub rope_parameters: Option<Value>,
    /// Bias on q/k/v/o.
    #[serde(default)]
    pub attention_bias: bool,
    /// Qwen3's activation name.
    pub hidden_act: Option<String>,
    /// Gemma's activation name.
    pub hidden_activation: Option<String>,
    /// Gemma4: `tanh(z / c) * c` on the base logits.
    pub final_logit_softcapping: Option<f64>,
    /// Gemma4: double-width MLP on KV-shared layers.
    #[serde(default)]
    pub use_double_wide_mlp: bool,
    /// Gemma4: number of KV-shared layers at the end.
    #[serde(default)]
    pub num_kv_shared_layers: usize,
    /// Gemma4: must be 0 (asserted by DeepSpec).
    #[serde(default)]
    pub hidden_size_per_layer_input: usize,
    /// Gemma4: must be false (asserted by DeepSpec).
    #[serde(default)]
    pub enable_moe_block: bool,
    /// The target's decoder layer count.
    pub num_target_layers: Option<usize>,
    /// Tapped target layers (0-based, `-1` = embedding output).
    pub target_layer_ids: Option<Vec<i64>>,
    /// γ.
    pub block_size: Option<usize>,
    /// The mask token id.
    pub mask_token_id: Option<i64>,
    /// Markov rank `r` (0 = DFlash).
    #[serde(default)]
    pub markov_rank: usize,
    /// `vanilla` (`gated`, `rnn` are not implemented).
    pub markov_head_type: Option<String>,
    /// Whether the confidence head exists.
    #[serde(default)]
    pub enable_confidence_head: bool,
    /// Whether the confidence input includes `W1[prev]`.
    pub confidence_head_with_markov: Option<bool>,
    /// mlx-spec's extension: Sequential Temperature Scaling of the confidence head (DSpark
    /// paper §3.2.1), one temperature per block position; the confidence of slot `k` is
    /// `sigmoid(logit_k / T_k)`.
    pub confidence_temperatures: Option<Vec<f64>>,
    /// Legacy exports (`DSparkDraftModel`-style) nest `mask_token_id` and `target_layer_ids` here.
    pub dflash_config: Option<Value>,
    /// mlx-spec's extension (not in DeepSpec): the drafter drafts from `K` target tokens
    /// only (EAGLE-3's reduced draft vocabulary), listed by the int32 tensor
    /// `draft_vocab_ids [K]`; `lm_head` and `markov_head.markov_w2` then have `K` rows.
    pub draft_vocab_size: Option<usize>,
    /// mlx-lm's quantization block, when the checkpoint was quantized.
    pub quantization: Option<Value>,
    /// The same block under the HF name.
    pub quantization_config: Option<Value>,
}

/// A validated drafter configuration: everything the forward pass reads.
#[derive(Debug, Clone)]
pub struct DrafterConfig {
    /// The `config.json` it came from.
    pub path: PathBuf,
    /// The class.
    pub architecture: Architecture,
    /// `H`.
    pub hidden_size: usize,
    /// MLP inner width (before any double-wide factor).
    pub intermediate_size: usize,
    /// `L_d`.
    pub num_layers: usize,
    /// Query heads `nh`.
    pub num_heads: usize,
    /// KV heads `nkv` actually used by the drafter.
    pub num_kv_heads: usize,
    /// Head dim `hd` actually used (`global_head_dim` for Gemma4).
    pub head_dim: usize,
    /// Gemma4 `attention_k_eq_v`: V = raw `k_proj` output, no `v_proj`.
    pub k_eq_v: bool,
    /// RMS norm epsilon.
    pub rms_norm_eps: f32,
    /// `V`.
    pub vocab_size: usize,
    /// RoPE base θ.
    pub rope_theta: f64,
    /// Fraction of rotated frequency pairs (1.0 for Qwen3; Gemma4's proportional RoPE: 0.25).
    pub partial_rotary_factor: f64,
    /// Bias on q/k/v/o.
    pub attention_bias: bool,
    /// Gemma4 logit soft-cap `c` (`None` = off).
    pub final_logit_softcapping: Option<f32>,
    /// Gemma4 double-wide MLP settings (`use_double_wide_mlp`, `num_kv_shared_layers`).
    pub double_wide: (bool, usize),
    /// The target's decoder layer count the drafter was trained for.
    pub num_target_layers: usize,
    /// Tapped target layers, in feature order (`-1` = embedding output).
    pub target_layer_ids: Vec<i64>,
    /// γ: drafts per block.
    pub block_size: usize,
    /// Block filler token.
    pub mask_token_id: u32,
    /// `r` (0 = DFlash: no Markov head).
    pub markov_rank: usize,
    /// Whether a confidence head is present.
    pub confidence_head: bool,
    /// Whether its input is `[h; W1[prev]]` (else `h`).
    pub confidence_with_markov: bool,
    /// Per-position temperatures of the confidence head (`confidence_temperatures`, fitted by
    /// Sequential Temperature Scaling), or `None` (all 1).
    pub confidence_temperatures: Option<Vec<f64>>,
    /// `K` when the drafter drafts from a reduced vocabulary of `K` target tokens
    /// (`draft_vocab_size`, mlx-spec's extension of the format), else `None` (all `V`).
    pub draft_vocab_size: Option<usize>,
    /// The raw fields (for the quantization block and anything else).
    pub raw: RawConfig,
}

impl DrafterConfig {
    /// Reads and validates `dir/config.json`.
    ///
    /// # Errors
    /// [`Error::Unsupported`] for an architecture other than `Qwen3DSparkModel` /
    /// `Gemma4DSparkModel`, a non-vanilla Markov head, an MoE block or per-layer inputs;
    /// [`Error::Config`] naming the field when one is missing or out of range.
    pub fn from_dir(dir: &Path) -> Result<Self> {
        let path = dir.join("config.json");
        let text = std::fs::read_to_string(&path).map_err(|e| models::Error::io(&path, e))?;
        let raw: RawConfig = serde_json::from_str(&text)
            .map_err(|e| models::Error::Json { path: path.clone(), message: e.to_string() })?;
        Self::from_raw(raw, path)
    }

    /// Validates parsed fields (`path` is used in error messages).
    ///
    /// # Errors
    /// As [`DrafterConfig::from_dir`].
    pub fn from_raw(raw: RawConfig, path: PathBuf) -> Result<Self> {
        let field = |f: &str, message: String| Error::Config { path: path.clone(), field: f.into(), message };
        let unsupported = |message: String| Error::Unsupported { path: path.clone(), message };
        let architecture = match raw.architectures.first().map(String::as_str) {
            Some("Qwen3DSparkModel") => Architecture::Qwen3,
            Some("Gemma4DSparkModel") => Architecture::Gemma4,
            other => {
                let found = other.map_or("missing".to_string(), |a| format!("`{a}`"));
                return Err(unsupported(format!(
                    "architectures[0] is {found}; a DeepSpec drafter has `Qwen3DSparkModel` or `Gemma4DSparkModel`"
                )));
            }
        };
        let req = |v: Option<usize>, f: &str| v.ok_or_else(|| field(f, "missing (expected a positive integer)".into()));
        let hidden_size = req(raw.hidden_size, "hidden_size")?;
        let num_heads = req(raw.num_attention_heads, "num_attention_heads")?;
        let (head_dim, num_kv_heads) = match architecture {
            Architecture::Qwen3 => {
                (raw.head_dim.unwrap_or(hidden_size / num_heads.max(1)), raw.num_key_value_heads.unwrap_or(num_heads))
            }
            Architecture::Gemma4 => {
                let hd = req(raw.global_head_dim.or(raw.head_dim), "global_head_dim")?;
                let kv = if raw.attention_k_eq_v {
                    req(raw.num_global_key_value_heads.or(raw.num_key_value_heads), "num_global_key_value_heads")?
                } else {
                    raw.num_key_value_heads.unwrap_or(num_heads)
                };
                (hd, kv)
            }
        };
        if num_kv_heads == 0 || num_heads % num_kv_heads != 0 {
            return Err(field(
                "num_key_value_heads",
                format!("{num_kv_heads} KV heads do not divide {num_heads} query heads"),
            ));
        }
        if architecture == Architecture::Gemma4 {
            if raw.hidden_size_per_layer_input != 0 {
                return Err(unsupported(format!(
                    "hidden_size_per_layer_input {} (DeepSpec drafters have 0)",
                    raw.hidden_size_per_layer_input
                )));
            }
            if raw.enable_moe_block {
                return Err(unsupported("enable_moe_block true (DeepSpec drafters have no MoE block)".into()));
            }
        }
        let (rope_theta, partial_rotary_factor) =
            rope_settings(&raw, architecture).map_err(|m| field("rope_parameters", m))?;
        let act = match architecture {
            Architecture::Qwen3 => raw.hidden_act.clone().unwrap_or_else(|| "silu".into()),
            Architecture::Gemma4 => raw.hidden_activation.clone().unwrap_or_else(|| "gelu_pytorch_tanh".into()),
        };
        let expected_act = match architecture {
            Architecture::Qwen3 => "silu",
            Architecture::Gemma4 => "gelu_pytorch_tanh",
        };
        if act != expected_act && !(architecture == Architecture::Gemma4 && act == "gelu_tanh") {
            return Err(unsupported(format!(
                "activation `{act}` for {} (expected `{expected_act}`)",
                architecture.name()
            )));
        }
        let legacy = |k: &str| raw.dflash_config.as_ref().and_then(|d| d.get(k)).cloned();
        let target_layer_ids = match (&raw.target_layer_ids, legacy("target_layer_ids")) {
            (Some(v), _) => v.clone(),
            (None, Some(v)) => serde_json::from_value(v)
                .map_err(|e| field("dflash_config.target_layer_ids", format!("expected a list of integers: {e}")))?,
            (None, None) => return Err(field("target_layer_ids", "missing".into())),
        };
        let mask = match (raw.mask_token_id, legacy("mask_token_id").and_then(|v| v.as_i64())) {
            (Some(m), _) | (None, Some(m)) => m,
            (None, None) => return Err(field("mask_token_id", "missing".into())),
        };
        let vocab_size = req(raw.vocab_size, "vocab_size")?;
        if mask < 0 || mask as usize >= vocab_size {
            return Err(field("mask_token_id", format!("{mask} is outside the vocabulary of {vocab_size}")));
        }
        let num_target_layers = req(raw.num_target_layers, "num_target_layers")?;
        if target_layer_ids.is_empty() {
            return Err(field("target_layer_ids", "empty".into()));
        }
        for w in target_layer_ids.windows(2) {
            if w[0] >= w[1] {
                return Err(field("target_layer_ids", format!("{target_layer_ids:?} is not strictly increasing")));
            }
        }
        if let Some(&bad) = target_layer_ids.iter().find(|&&l| l < -1 || l >= num_target_layers as i64) {
            return Err(field(
                "target_layer_ids",
                format!("layer {bad} is outside -1..{num_target_layers} (num_target_layers {num_target_layers})"),
            ));
        }
        let block_size = req(raw.block_size, "block_size")?;
        if block_size == 0 {
            return Err(field("block_size", "0 (expected at least 1)".into()));
        }
        if raw.markov_rank > 0 {
            let kind = raw.markov_head_type.as_deref().unwrap_or("vanilla");
            if kind != "vanilla" {
                return Err(unsupported(format!("markov_head_type `{kind}` (only `vanilla` is implemented)")));
            }
        }
        let rms_norm_eps = raw.rms_norm_eps.unwrap_or(1e-6);
        Ok(DrafterConfig {
            path: path.clone(),
            architecture,
            hidden_size,
            intermediate_size: req(raw.intermediate_size, "intermediate_size")?,
            num_layers: req(raw.num_hidden_layers, "num_hidden_layers")?,
            num_heads,
            num_kv_heads,
            head_dim,
            k_eq_v: architecture == Architecture::Gemma4 && raw.attention_k_eq_v,
            rms_norm_eps,
            vocab_size,
            rope_theta,
            partial_rotary_factor,
            attention_bias: raw.attention_bias,
            final_logit_softcapping: match architecture {
                Architecture::Gemma4 => raw.final_logit_softcapping.map(|c| c as f32),
                Architecture::Qwen3 => None,
            },
            double_wide: (raw.use_double_wide_mlp, raw.num_kv_shared_layers),
            num_target_layers,
            target_layer_ids,
            block_size,
            mask_token_id: mask as u32,
            markov_rank: raw.markov_rank,
            confidence_head: raw.enable_confidence_head,
            confidence_with_markov: raw.enable_confidence_head
                && raw.markov_rank > 0
                && raw.confidence_head_with_markov.unwrap_or(true),
            confidence_temperatures: match &raw.confidence_temperatures {
                Some(t) if t.len() != block_size || t.iter().any(|&x| !(x.is_finite() && x > 0.0)) => {
                    return Err(field(
                        "confidence_temperatures",
                        format!("{t:?}: expected {block_size} positive temperatures (one per block position)"),
                    ));
                }
                t => t.clone(),
            },
            draft_vocab_size: match raw.draft_vocab_size {
                Some(k) if k == 0 || k > vocab_size => {
                    return Err(field("draft_vocab_size", format!("{k}: expected 1 ..= vocab_size ({vocab_size})")));
                }
                k => k,
            },
            raw,
        })
    }

    /// MLP width of draft layer `i` (Gemma4 doubles it on KV-shared layers when
    /// `use_double_wide_mlp`, transformers `Gemma4TextMLP`).
    pub fn mlp_width(&self, i: usize) -> usize {
        let (double, shared) = self.double_wide;
        let first_shared = self.num_layers.saturating_sub(shared);
        if double && first_shared > 0 && i >= first_shared {
            self.intermediate_size * 2
        } else {
            self.intermediate_size
        }
    }

    /// Rows of `lm_head` and `markov_w2`: the draft vocabulary's size (`V` without one).
    pub fn draft_vocab(&self) -> usize {
        self.draft_vocab_size.unwrap_or(self.vocab_size)
    }

    /// Width of the concatenated tap features, `T * H`.
    pub fn feature_width(&self) -> usize {
        self.target_layer_ids.len() * self.hidden_size
    }
}

/// RoPE base and rotated fraction: Qwen3 reads `rope_parameters.rope_theta` (or the top
/// level); Gemma4 reads `rope_parameters.full_attention` and ignores the stray top-level
/// keys transformers adds.
fn rope_settings(raw: &RawConfig, arch: Architecture) -> std::result::Result<(f64, f64), String> {
    let params = raw.rope_parameters.as_ref();
    match arch {
        Architecture::Qwen3 => {
            let kind = params.and_then(|p| p.get("rope_type")).and_then(Value::as_str).unwrap_or("default");
            if kind != "default" {
                return Err(format!("rope_type `{kind}` (only `default` is implemented for Qwen3 drafters)"));
            }
            let nested = params.and_then(|p| p.get("rope_theta")).and_then(Value::as_f64);
            Ok((nested.or(raw.rope_theta).unwrap_or(1e6), 1.0))
        }
        Architecture::Gemma4 => {
            let full = params.and_then(|p| p.get("full_attention"));
            let kind = full.and_then(|p| p.get("rope_type")).and_then(Value::as_str).unwrap_or("proportional");
            let theta = full.and_then(|p| p.get("rope_theta")).and_then(Value::as_f64).unwrap_or(1e6);
            match kind {
                "proportional" => {
                    let f = full.and_then(|p| p.get("partial_rotary_factor")).and_then(Value::as_f64).unwrap_or(0.25);
                    if !(f > 0.0 && f <= 1.0) {
                        return Err(format!("full_attention.partial_rotary_factor {f} is outside (0, 1]"));
                    }
                    Ok((theta, f))
                }
                "default" => Ok((theta, 1.0)),
                other => Err(format!("full_attention.rope_type `{other}` (expected `proportional` or `default`)")),
            }
        }
    }
}
