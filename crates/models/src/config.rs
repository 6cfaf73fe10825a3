//! `config.json` of a model directory (HF / mlx-lm form) and its `quantization` block.
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use mlx_core::quant::QuantSpec;
use serde::Deserialize;
use serde_json::Value;

use crate::{Error, Result};

/// The architecture fields of `config.json` that the llama / qwen2 / qwen3 decoders read.
/// Field names and defaults follow mlx-lm's `ModelArgs` (`mlx_lm/models/{llama,qwen2,qwen3}.py`).
#[derive(Debug, Clone, Deserialize)]
pub struct ModelConfig {
    /// `llama`, `qwen2`, `qwen3`, `gemma3_text` (or `gemma3`) or `gemma4_text`.
    pub model_type: String,
    /// Residual stream width `H`.
    pub hidden_size: usize,
    /// Number of decoder layers.
    pub num_hidden_layers: usize,
    /// MLP inner width.
    pub intermediate_size: usize,
    /// Query heads.
    pub num_attention_heads: usize,
    /// Key/value heads (grouped-query attention); defaults to `num_attention_heads`.
    pub num_key_value_heads: Option<usize>,
    /// Per-head width; defaults to `hidden_size / num_attention_heads`.
    pub head_dim: Option<usize>,
    /// Epsilon of every RMS norm.
    pub rms_norm_eps: f32,
    /// Vocabulary size `V` (rows of the embedding; may exceed the tokenizer's).
    pub vocab_size: usize,
    /// RoPE base; mlx-lm's defaults are 10000 (llama) and 1e6 (qwen2); transformers 5 may
    /// nest it in `rope_parameters`.
    pub rope_theta: Option<f32>,
    /// Rotate adjacent pairs (`true`) or halves (`false`, the HF layout).
    #[serde(default)]
    pub rope_traditional: bool,
    /// `rope_scaling` (`linear` and `llama3` are supported).
    pub rope_scaling: Option<Value>,
    /// transformers 5's nested rope settings.
    pub rope_parameters: Option<Value>,
    /// Whether the LM head reuses the embedding matrix; defaults to `true` as in mlx-lm.
    pub tie_word_embeddings: Option<bool>,
    /// Bias on q/k/v/o projections (llama); qwen2 always has q/k/v biases.
    #[serde(default)]
    pub attention_bias: bool,
    /// Bias on the MLP projections (llama).
    #[serde(default)]
    pub mlp_bias: bool,
    /// Trained context length (used by llama3 rope scaling).
    pub max_position_embeddings: Option<usize>,
    /// End-of-sequence id(s).
    pub eos_token_id: Option<Value>,
    /// mlx-lm's quantization block (see [`QuantizationConfig`]).
    pub quantization: Option<Value>,
    /// The same block under the HF name (used when `quantization` is absent).
    pub quantization_config: Option<Value>,
    /// Every other field of `config.json` (family-specific settings such as Gemma's
    /// `sliding_window`, `layer_types` or `final_logit_softcapping`).
    #[serde(flatten)]
    pub extra: serde_json::Map<String, Value>,
}

impl ModelConfig {
    /// Reads `dir/config.json`.
    ///
    /// # Errors
    /// [`Error::Io`] when it cannot be read; [`Error::Json`] naming the field when a
    /// required field is missing or has the wrong type; [`Error::Config`] naming the field
    /// for a size no decoder can have (zero counts, key/value heads that do not divide the
    /// query heads, a non-positive `rms_norm_eps` or RoPE base).
    pub fn from_dir(dir: &Path) -> Result<Self> {
        let path = dir.join("config.json");
        let text = std::fs::read_to_string(&path).map_err(|e| Error::io(&path, e))?;
        let config: ModelConfig =
            serde_json::from_str(&text).map_err(|e| Error::Json { path: path.clone(), message: e.to_string() })?;
        config.check(&path)?;
        Ok(config)
    }

    /// Refuses sizes no decoder can have (zero widths or counts, key/value heads that do
    /// not divide the query heads, a head width the residual stream cannot hold, a
    /// non-positive or non-finite norm epsilon or RoPE base), naming the field.
    ///
    /// # Errors
    /// [`Error::Config`] naming `path` and the field.
    fn check(&self, path: &Path) -> Result<()> {
        let field = |f: &str, message: String| Error::Config { path: path.into(), field: f.into(), message };
        if let Err(Error::Unsupported(message)) = crate::Family::from_model_type(&self.model_type) {
            return Err(field("model_type", format!("unsupported {message}")));
        }
        for (name, v) in [
            ("hidden_size", self.hidden_size),
            ("num_hidden_layers", self.num_hidden_layers),
            ("intermediate_size", self.intermediate_size),
            ("num_attention_heads", self.num_attention_heads),
            ("vocab_size", self.vocab_size),
        ] {
            if v == 0 {
                return Err(field(name, "must be at least 1, got 0".into()));
            }
        }
        let (heads, kv) = (self.num_attention_heads, self.kv_heads());
        if kv == 0 || heads % kv != 0 {
            return Err(field(
                "num_key_value_heads",
                format!("must divide num_attention_heads ({heads}) and be at least 1, got {kv}"),
            ));
        }
        match self.head_dim {
            Some(0) => return Err(field("head_dim", "must be at least 1, got 0".into())),
            None if self.hidden_size < heads => {
                return Err(field(
                    "num_attention_heads",
                    format!("{heads} heads leave no width of hidden_size {} per head", self.hidden_size),
                ));
            }
            _ => {}
        }
        if !(self.rms_norm_eps.is_finite() && self.rms_norm_eps > 0.0) {
            return Err(field("rms_norm_eps", format!("must be a finite value > 0, got {}", self.rms_norm_eps)));
        }
        let base = self.rope_base();
        if !(base.is_finite() && base > 0.0) {
            return Err(field("rope_theta", format!("must be a finite value > 0, got {base}")));
        }
        Ok(())
    }

    /// Key/value head count.
    pub fn kv_heads(&self) -> usize {
        self.num_key_value_heads.unwrap_or(self.num_attention_heads)
    }

    /// Per-head width.
    pub fn head_dim(&self) -> usize {
        self.head_dim.unwrap_or(self.hidden_size / self.num_attention_heads)
    }

    /// RoPE base with mlx-lm's per-family default.
    pub fn rope_base(&self) -> f32 {
        let nested = self.rope_parameters.as_ref().and_then(|p| p.get("rope_theta")).and_then(Value::as_f64);
        self.rope_theta.or(nested.map(|v| v as f32)).unwrap_or(if self.model_type == "llama" { 10000.0 } else { 1e6 })
    }

    /// Whether the LM head is the embedding (mlx-lm's default: yes).
    pub fn tied_embeddings(&self) -> bool {
        self.tie_word_embeddings.unwrap_or(true)
    }

    /// End-of-sequence ids from `eos_token_id` (an int or a list).
    pub fn eos_ids(&self) -> Vec<u32> {
        ids_from_value(self.eos_token_id.as_ref())
    }
}

/// Token ids from a JSON int or list of ints (`eos_token_id` in config files).
pub fn ids_from_value(v: Option<&Value>) -> Vec<u32> {
    match v {
        Some(Value::Number(n)) => n.as_u64().map(|n| vec![n as u32]).unwrap_or_default(),
        Some(Value::Array(a)) => a.iter().filter_map(Value::as_u64).map(|n| n as u32).collect(),
        _ => Vec::new(),
    }
}

/// mlx-lm's `quantization` block: a default spec plus per-module entries, each either a spec
/// object or `false` (the module stays dense).
///
/// ```json
/// {"group_size": 64, "bits": 4, "mode": "affine",
///  "model.embed_tokens": {"group_size": 32, "bits": 8}, "lm_head": false}
/// ```
#[derive(Debug, Clone, Default, PartialEq)]
pub struct QuantizationConfig {
    /// The default spec, for modules without their own entry.
    pub default: Option<QuantSpec>,
    /// Per-module entries: `Some(spec)` or `None` for `false`.
    pub modules: BTreeMap<String, Option<QuantSpec>>,
}

impl QuantizationConfig {
    /// Parses the block of `config`, `quantization` first, else `quantization_config`.
    ///
    /// # Errors
    /// [`Error::Config`] naming the entry when a spec is malformed, uses a mode other than
    /// `affine`, or has unsupported bits / group size.
    pub fn from_config(cfg: &ModelConfig, path: &Path) -> Result<Self> {
        let Some(block) = cfg.quantization.as_ref().or(cfg.quantization_config.as_ref()) else {
            return Ok(Self::default());
        };
        let Value::Object(map) = block else {
            return Err(Error::Config {
                path: path.into(),
                field: "quantization".into(),
                message: "expected an object".into(),
            });
        };
        let mut out = Self::default();
        if map.contains_key("bits") || map.contains_key("group_size") {
            out.default = Some(spec_from(block, path, "quantization")?);
        }
        for (k, v) in map {
            match v {
                Value::Bool(false) => {
                    out.modules.insert(k.clone(), None);
                }
                Value::Object(_) => {
                    out.modules.insert(k.clone(), Some(spec_from(v, path, &format!("quantization.{k}"))?));
                }
                _ => {}
            }
        }
        Ok(out)
    }

    /// The spec of module `base` (e.g. `model.layers.0.self_attn.q_proj`): its own entry,
    /// else the default. `None` = dense.
    pub fn spec_for(&self, base: &str) -> Option<QuantSpec> {
        match self.modules.get(base) {
            Some(entry) => *entry,
            None => self.default,
        }
    }
}

fn spec_from(v: &Value, path: &Path, field: &str) -> Result<QuantSpec> {
    let err = |message: String| Error::Config { path: path.into(), field: field.into(), message };
    if let Some(mode) = v.get("mode").and_then(Value::as_str)
        && mode != "affine"
    {
        return Err(err(format!("mode `{mode}` is not supported (only affine)")));
    }
    let gs = v.get("group_size").and_then(Value::as_i64).unwrap_or(64) as i32;
    let bits = v.get("bits").and_then(Value::as_i64).ok_or_else(|| err("missing integer `bits`".into()))? as i32;
    QuantSpec::new(gs, bits).map_err(|e| err(e.to_string()))
}

/// The path of `config.json` in `dir` (for error messages).
pub(crate) fn config_path(dir: &Path) -> PathBuf {
    dir.join("config.json")
}
