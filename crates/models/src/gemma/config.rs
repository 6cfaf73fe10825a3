//! The Gemma 3 / Gemma 4 fields of `config.json` beyond [`ModelConfig`], typed, with every
//! default in one place (mlx-lm's `ModelArgs` of `models/gemma3_text.py` and
//! `models/gemma4_text.py`), and the per-layer schedule they imply.
use std::path::Path;

use serde::de::DeserializeOwned;
use serde::{Deserialize, Deserializer};
use serde_json::Value;

use crate::config::{ModelConfig, config_path};
use crate::{Error, Result};

use super::Version;

/// The Gemma-specific fields of `config.json` as written (read from [`ModelConfig::extra`];
/// a `null` counts as absent, except for `final_logit_softcapping`). Fields whose default
/// depends on the generation are `Option`s, resolved per generation into [`GemmaConfig`].
#[derive(Debug, Clone, Deserialize)]
pub struct GemmaArgs {
    /// Positions a sliding layer attends to (the query included); default 512.
    #[serde(default = "default_sliding_window")]
    pub sliding_window: usize,
    /// One global layer every this many (gemma3: 6; gemma4 without `layer_types`: 5).
    pub sliding_window_pattern: Option<usize>,
    /// Gemma 4: `sliding_attention` / `full_attention` per layer.
    pub layer_types: Option<Vec<String>>,
    /// Gemma 4 mixture-of-experts block (not supported); default `false`.
    #[serde(default)]
    pub enable_moe_block: bool,
    /// Gemma 4: the last layers that reuse earlier keys/values; default 20.
    pub num_kv_shared_layers: Option<usize>,
    /// Gemma 4: values are the keys' projection on full layers; default `false`.
    #[serde(default)]
    pub attention_k_eq_v: bool,
    /// Gemma 4: head width of full layers; default (and for 0) 512.
    pub global_head_dim: Option<usize>,
    /// Gemma 4: key/value heads of full layers with `attention_k_eq_v`; default
    /// `num_key_value_heads`.
    pub num_global_key_value_heads: Option<usize>,
    /// Gemma 4: KV-shared layers have twice the MLP width; default `true`.
    #[serde(default = "yes")]
    pub use_double_wide_mlp: bool,
    /// Gemma 4: per-layer input width (0 = none); default 256.
    pub hidden_size_per_layer_input: Option<usize>,
    /// Gemma 4: rows of the per-layer embedding; default `vocab_size`.
    pub vocab_size_per_layer_input: Option<usize>,
    /// Gemma 3: queries are scaled by `query_pre_attn_scalar^-0.5`; default 256.
    #[serde(default = "default_query_pre_attn_scalar")]
    pub query_pre_attn_scalar: f64,
    /// `tanh(logits / c) * c`: absent (outer `None`), `null` (`Some(None)`) or a number.
    /// Gemma 4 defaults to 30 when absent; Gemma 3 to none.
    #[serde(default, deserialize_with = "present")]
    pub final_logit_softcapping: Option<Option<f64>>,
    /// Gemma 3: rope base of sliding layers; default 10000.
    #[serde(default = "default_rope_local_base_freq")]
    pub rope_local_base_freq: f64,
}

/// One entry of Gemma 4's `rope_parameters` (`sliding_attention` or `full_attention`), as
/// written; a field that is absent (or `null`) takes the default below. With no
/// `rope_parameters` at all, sliding layers get `default` rope with base 10000 and full
/// layers `proportional` rope with base 1e6 and `partial_rotary_factor` 0.25 (mlx-lm).
#[derive(Debug, Clone, Deserialize)]
pub struct RopeParameters {
    /// The rope base; default 10000.
    #[serde(default = "default_rope_local_base_freq")]
    pub rope_theta: f64,
    /// `default`, `linear` or `proportional` under the key `rope_type`.
    pub rope_type: Option<String>,
    /// The same under the key `type` (which wins when both are given).
    #[serde(rename = "type")]
    pub type_key: Option<String>,
    /// `linear`: positions are divided by it; `proportional`: frequencies are multiplied by it
    /// (default 1).
    pub factor: Option<f64>,
    /// `proportional`: the fraction of each head that rotates; default 1.
    #[serde(default = "one")]
    pub partial_rotary_factor: f64,
}

impl RopeParameters {
    /// The rope type (`type`, else `rope_type`, else `default`).
    pub fn kind(&self) -> &str {
        self.type_key.as_deref().or(self.rope_type.as_deref()).unwrap_or("default")
    }

    /// mlx-lm's parameters for a layer type when `config.json` has no `rope_parameters`.
    fn absent(sliding: bool) -> Self {
        let (rope_theta, kind, partial_rotary_factor) =
            if sliding { (10000.0, "default", 1.0) } else { (1_000_000.0, "proportional", 0.25) };
        RopeParameters { rope_theta, rope_type: Some(kind.into()), type_key: None, factor: None, partial_rotary_factor }
    }

    /// The entry `key` of `rope_parameters` (`c.rope_parameters`; an absent entry takes the
    /// per-field defaults).
    fn read(c: &ModelConfig, sliding: bool, path: &Path) -> Result<Self> {
        let key = if sliding { "sliding_attention" } else { "full_attention" };
        let Some(p) = c.rope_parameters.as_ref() else { return Ok(Self::absent(sliding)) };
        let fields = match p.get(key) {
            None | Some(Value::Null) => serde_json::Map::new(),
            Some(Value::Object(m)) => m.clone(),
            Some(other) => {
                return Err(Error::Config {
                    path: path.into(),
                    field: format!("rope_parameters.{key}"),
                    message: format!("expected an object, found {other}"),
                });
            }
        };
        typed(&fields, &[], path).map_err(|e| match e {
            Error::Config { path, field, message } => {
                Error::Config { path, field: format!("rope_parameters.{key}.{field}"), message }
            }
            e => e,
        })
    }
}

fn one() -> f64 {
    1.0
}
fn default_sliding_window() -> usize {
    512
}
fn yes() -> bool {
    true
}
fn default_query_pre_attn_scalar() -> f64 {
    256.0
}
fn default_rope_local_base_freq() -> f64 {
    10000.0
}

/// A field that is present, even as `null` (`Some(None)`).
fn present<'de, D: Deserializer<'de>>(d: D) -> std::result::Result<Option<Option<f64>>, D::Error> {
    Option::<f64>::deserialize(d).map(Some)
}

/// `T` from the fields of `extra` (nulls dropped except for `keep_null`); a bad value is an
/// [`Error::Config`] naming `path` and the field.
fn typed<T: DeserializeOwned>(extra: &serde_json::Map<String, Value>, keep_null: &[&str], path: &Path) -> Result<T> {
    let fields: serde_json::Map<String, Value> = extra
        .iter()
        .filter(|(k, v)| !v.is_null() || keep_null.contains(&k.as_str()))
        .map(|(k, v)| (k.clone(), v.clone()))
        .collect();
    serde_json::from_value(Value::Object(fields.clone())).map_err(|e| {
        // Every field has a default, so the field that fails on its own is the bad one.
        let field = fields
            .iter()
            .find(|(k, v)| {
                let one = serde_json::Map::from_iter([((*k).clone(), (*v).clone())]);
                serde_json::from_value::<T>(Value::Object(one)).is_err()
            })
            .map_or_else(String::new, |(k, _)| k.clone());
        Error::Config { path: path.into(), field, message: e.to_string() }
    })
}

/// A Gemma decoder's settings with every default resolved and checked: widths, the
/// sliding/global schedule and the KV sharing.
#[derive(Debug, Clone)]
pub struct GemmaConfig {
    /// Gemma 4 (else Gemma 3).
    pub v4: bool,
    /// `H`.
    pub hidden: usize,
    /// Decoder layers.
    pub layers: usize,
    /// Epsilon of every RMS norm.
    pub eps: f32,
    /// Query heads.
    pub heads: usize,
    /// Head width of sliding layers (`head_dim`, default 256).
    pub head_dim: usize,
    /// Key/value heads (`num_key_value_heads`, default 1).
    pub kv_heads: usize,
    /// Head width of full layers (Gemma 3: `head_dim`).
    pub global_head_dim: usize,
    /// Key/value heads of full layers with `k_eq_v`.
    pub global_kv_heads: usize,
    /// Values are the keys' projection on full layers (Gemma 4).
    pub k_eq_v: bool,
    /// The sliding window.
    pub window: usize,
    /// Per layer: sliding (else global).
    pub sliding: Vec<bool>,
    /// Layers `>= cached_layers` keep no cache (KV sharing).
    pub cached_layers: usize,
    /// Per layer: the layer whose keys/values it uses (itself unless KV-shared).
    pub kv_source: Vec<usize>,
    /// MLP width per layer (`intermediate_size`, doubled on KV-shared Gemma 4 layers).
    pub mlp_width: Vec<usize>,
    /// Per-layer input width (0: none).
    pub per_layer_width: usize,
    /// Rows of the per-layer embedding.
    pub per_layer_vocab: usize,
    /// Attention scale (Gemma 3: `query_pre_attn_scalar^-0.5`; Gemma 4: 1).
    pub query_scale: f32,
    /// Final logit soft cap.
    pub softcap: Option<f32>,
    /// Gemma 3: rope base of sliding layers.
    pub rope_local_base: f32,
    /// Gemma 4: rope of sliding layers (`rope_parameters.sliding_attention`; Gemma 3 reads
    /// `rope_local_base_freq`, `rope_theta` and `rope_scaling` instead and keeps mlx-lm's
    /// Gemma 4 defaults here).
    pub rope_sliding: RopeParameters,
    /// Gemma 4: rope of full layers (`rope_parameters.full_attention`).
    pub rope_full: RopeParameters,
}

impl GemmaConfig {
    /// Reads and resolves the Gemma fields of `c` (from `dir/config.json`).
    ///
    /// # Errors
    /// [`Error::Config`] naming `config.json` and the field for a bad value (a wrong type,
    /// a zero window or pattern, a `layer_types` list too short or with an unknown type, KV
    /// sharing without an earlier layer of the type); [`Error::Unsupported`] for
    /// `enable_moe_block`.
    pub(crate) fn resolve(c: &ModelConfig, version: Version, dir: &Path) -> Result<Self> {
        let path = config_path(dir);
        let a: GemmaArgs = typed(&c.extra, &["final_logit_softcapping"], &path)?;
        let err = |field: &str, message: String| Error::Config { path: path.clone(), field: field.into(), message };
        let v4 = version == Version::V4;
        let n = c.num_hidden_layers;
        if a.sliding_window == 0 {
            return Err(err("sliding_window", "must be at least 1".into()));
        }
        let pattern = a.sliding_window_pattern.unwrap_or(if v4 { 5 } else { 6 });
        if pattern == 0 {
            return Err(err("sliding_window_pattern", "must be at least 1".into()));
        }
        let sliding: Vec<bool> = match (version, &a.layer_types) {
            (Version::V3, _) => (0..n).map(|i| (i + 1) % pattern != 0).collect(),
            (Version::V4, Some(types)) => {
                if types.len() < n {
                    return Err(err("layer_types", format!("{} entries for {n} layers", types.len())));
                }
                types[..n]
                    .iter()
                    .map(|t| match t.as_str() {
                        "sliding_attention" => Ok(true),
                        "full_attention" => Ok(false),
                        _ => Err(err("layer_types", format!("unknown layer type \"{t}\""))),
                    })
                    .collect::<Result<_>>()?
            }
            (Version::V4, None) => (0..n).map(|i| (i % pattern) != pattern - 1).collect(),
        };
        if v4 && a.enable_moe_block {
            return Err(Error::Unsupported(format!(
                "{}: gemma4 with `enable_moe_block` (mixture of experts)",
                path.display()
            )));
        }
        let shared = if v4 { a.num_kv_shared_layers.unwrap_or(20) } else { 0 };
        let cached_layers = if shared > 0 && shared < n { n - shared } else { n };
        let mut kv_source: Vec<usize> = (0..n).collect();
        for j in cached_layers..n {
            kv_source[j] = (0..cached_layers).rev().find(|&i| sliding[i] == sliding[j]).ok_or_else(|| {
                err("num_kv_shared_layers", format!("layer {j} has no earlier layer of its type to share"))
            })?;
        }
        let head_dim = c.head_dim.unwrap_or(256);
        let kv_heads = c.num_key_value_heads.unwrap_or(1);
        let double_wide = v4 && a.use_double_wide_mlp && cached_layers < n;
        let mlp_width =
            (0..n).map(|i| c.intermediate_size * if double_wide && i >= cached_layers { 2 } else { 1 }).collect();
        let softcap = match (version, a.final_logit_softcapping) {
            (Version::V4, None) => Some(30.0),
            (_, Some(Some(cap))) => Some(cap as f32),
            _ => None,
        };
        Ok(GemmaConfig {
            v4,
            hidden: c.hidden_size,
            layers: n,
            eps: c.rms_norm_eps,
            heads: c.num_attention_heads,
            head_dim,
            kv_heads,
            global_head_dim: if v4 { a.global_head_dim.filter(|&d| d > 0).unwrap_or(512) } else { head_dim },
            global_kv_heads: a.num_global_key_value_heads.unwrap_or(kv_heads),
            k_eq_v: v4 && a.attention_k_eq_v,
            window: a.sliding_window,
            sliding,
            cached_layers,
            kv_source,
            mlp_width,
            per_layer_width: if v4 { a.hidden_size_per_layer_input.unwrap_or(256) } else { 0 },
            per_layer_vocab: a.vocab_size_per_layer_input.unwrap_or(c.vocab_size),
            query_scale: if v4 { 1.0 } else { (a.query_pre_attn_scalar as f32).powf(-0.5) },
            softcap,
            rope_local_base: a.rope_local_base_freq as f32,
            rope_sliding: if v4 { RopeParameters::read(c, true, &path)? } else { RopeParameters::absent(true) },
            rope_full: if v4 { RopeParameters::read(c, false, &path)? } else { RopeParameters::absent(false) },
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config(extra: Value) -> ModelConfig {
        let mut v = serde_json::json!({
            "model_type": "gemma3_text", "hidden_size": 8, "num_hidden_layers": 6,
            "intermediate_size": 16, "num_attention_heads": 2, "rms_norm_eps": 1e-6, "vocab_size": 32,
        });
        v.as_object_mut().unwrap().extend(extra.as_object().unwrap().clone());
        serde_json::from_value(v).unwrap()
    }

    #[test]
    fn defaults_per_generation() {
        let dir = Path::new("/m");
        let g3 = GemmaConfig::resolve(&config(serde_json::json!({})), Version::V3, dir).unwrap();
        assert_eq!((g3.window, g3.head_dim, g3.kv_heads, g3.softcap), (512, 256, 1, None));
        assert_eq!(g3.sliding, [true, true, true, true, true, false]);
        assert_eq!(g3.query_scale, 256f32.powf(-0.5));
        let g4 =
            GemmaConfig::resolve(&config(serde_json::json!({"num_kv_shared_layers": 1})), Version::V4, dir).unwrap();
        assert_eq!((g4.global_head_dim, g4.per_layer_width, g4.softcap, g4.query_scale), (512, 256, Some(30.0), 1.0));
        assert_eq!(g4.sliding, [true, true, true, true, false, true]);
        assert_eq!((g4.cached_layers, &g4.kv_source[4..], &g4.mlp_width[4..]), (5, &[4, 3][..], &[16, 32][..]));
        let null_cap = config(serde_json::json!({"final_logit_softcapping": null, "sliding_window": null}));
        let g4 = GemmaConfig::resolve(&null_cap, Version::V4, dir).unwrap();
        assert_eq!((g4.softcap, g4.window), (None, 512));
        assert_eq!(
            (g4.rope_full.kind(), g4.rope_full.partial_rotary_factor, g4.rope_full.rope_theta),
            ("proportional", 0.25, 1e6)
        );
        let partial =
            config(serde_json::json!({"rope_parameters": {"full_attention": {"type": "linear", "factor": 2.0}}}));
        let g4 = GemmaConfig::resolve(&partial, Version::V4, dir).unwrap();
        assert_eq!((g4.rope_full.kind(), g4.rope_full.factor, g4.rope_full.rope_theta), ("linear", Some(2.0), 10000.0));
        assert_eq!((g4.rope_sliding.kind(), g4.rope_sliding.partial_rotary_factor), ("default", 1.0));
    }

    #[test]
    fn a_bad_value_names_config_json_and_the_field() {
        let dir = Path::new("/m");
        for (extra, field) in [
            (serde_json::json!({"sliding_window": "wide"}), "sliding_window"),
            (serde_json::json!({"sliding_window": 0}), "sliding_window"),
            (serde_json::json!({"layer_types": "all"}), "layer_types"),
            (serde_json::json!({"layer_types": ["full_attention"]}), "layer_types"),
            (serde_json::json!({"final_logit_softcapping": "big"}), "final_logit_softcapping"),
            (
                serde_json::json!({"rope_parameters": {"full_attention": {"rope_theta": "big"}}}),
                "rope_parameters.full_attention.rope_theta",
            ),
        ] {
            let e = GemmaConfig::resolve(&config(extra.clone()), Version::V4, dir).expect_err("refused");
            match &e {
                Error::Config { path, field: f, .. } => {
                    assert_eq!((path.as_path(), f.as_str()), (Path::new("/m/config.json"), field), "{extra}: {e}")
                }
                other => panic!("{extra}: {other}"),
            }
        }
    }
}
