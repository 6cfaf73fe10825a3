//! `config.json`: reading the source's quantization block (mlx-lm's `quantization`, or
//! `quantization_config`) and writing the output's.
use std::collections::BTreeMap;
use std::path::Path;

use mlx_core::quant::QuantSpec;
use serde_json::{Map, Value, json};

use crate::{Error, Result};

/// The quantization block of a source `config.json`: a default spec and per-module entries
/// (`None` for `false`). Empty for an unquantized source.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct SourceQuantization {
    /// The spec of modules without an entry.
    pub default: Option<QuantSpec>,
    /// Per-module entries: a spec, or `None` for `"<base>": false`.
    pub modules: BTreeMap<String, Option<QuantSpec>>,
}

impl SourceQuantization {
    /// Parses `config`'s `quantization` block, else `quantization_config` (mlx-lm's order).
    ///
    /// # Errors
    /// [`Error::Config`] naming `path` and the field when the block is not an object, uses
    /// a mode other than affine, has unsupported bits / group size, or is a Hugging Face
    /// `quant_method` block (GPTQ, AWQ, ...) rather than MLX's.
    pub fn from_config(config: &Value, path: &Path) -> Result<Self> {
        let (field, block) = match (config.get("quantization"), config.get("quantization_config")) {
            (Some(b), _) => ("quantization", b),
            (None, Some(b)) => ("quantization_config", b),
            (None, None) => return Ok(Self::default()),
        };
        let err = |field: &str, message: String| Error::Config {
            path: path.into(),
            message: format!("field `{field}`: {message}"),
        };
        let Value::Object(map) = block else {
            return Err(err(field, format!("expected an object, found {block}")));
        };
        if let Some(m) = map.get("quant_method")
            && !map.contains_key("bits")
        {
            return Err(err(
                field,
                format!(
                    "quant_method {m} is not MLX affine quantization; only MLX-quantized sources can be requantized"
                ),
            ));
        }
        let mut out = Self::default();
        if map.contains_key("bits") || map.contains_key("group_size") {
            out.default = Some(spec_from(block).map_err(|m| err(field, m))?);
        }
        for (k, v) in map {
            match v {
                Value::Bool(false) => {
                    out.modules.insert(k.clone(), None);
                }
                Value::Object(_) => {
                    let spec = spec_from(v).map_err(|m| err(&format!("{field}.{k}"), m))?;
                    out.modules.insert(k.clone(), Some(spec));
                }
                _ => {}
            }
        }
        Ok(out)
    }

    /// The spec of module `base`: its own entry, else the default; `None` = not quantized.
    pub fn spec_for(&self, base: &str) -> Option<QuantSpec> {
        match self.modules.get(base) {
            Some(entry) => *entry,
            None => self.default,
        }
    }
}

fn spec_from(v: &Value) -> std::result::Result<QuantSpec, String> {
    if let Some(mode) = v.get("mode").and_then(Value::as_str)
        && mode != "affine"
    {
        return Err(format!("mode `{mode}` is not supported (only affine)"));
    }
    let gs = v.get("group_size").and_then(Value::as_i64).unwrap_or(64) as i32;
    let bits = v.get("bits").and_then(Value::as_i64).ok_or("missing integer `bits`")? as i32;
    QuantSpec::new(gs, bits).map_err(|e| e.to_string())
}

/// The output block: `{"group_size", "bits", "mode"}`, then one entry per quantized module
/// (`{"group_size", "bits", "mode"}`) and `"<base>": false` for modules the predicate kept in
/// full precision.
pub(crate) fn quantization_block(spec: QuantSpec, quantized: &[String], full_precision: &[String]) -> Value {
    let entry = json!({"group_size": spec.group_size, "bits": spec.bits, "mode": "affine"});
    let mut q = Map::new();
    q.insert("group_size".into(), json!(spec.group_size));
    q.insert("bits".into(), json!(spec.bits));
    q.insert("mode".into(), json!("affine"));
    let mut modules: Vec<(&String, Value)> = quantized.iter().map(|b| (b, entry.clone())).collect();
    modules.extend(full_precision.iter().map(|b| (b, json!(false))));
    modules.sort_by(|a, b| a.0.cmp(b.0));
    for (b, v) in modules {
        q.insert(b.clone(), v);
    }
    Value::Object(q)
}

/// The output `config.json`: the source config with `quantization` and
/// `quantization_config` set to `block`, keys sorted as mlx-lm's `save_config` writes them.
pub(crate) fn output_config(source: &Map<String, Value>, block: Value) -> Value {
    let mut entries: Vec<(String, Value)> = source
        .iter()
        .filter(|(k, _)| !matches!(k.as_str(), "quantization" | "quantization_config"))
        .map(|(k, v)| (k.clone(), v.clone()))
        .collect();
    entries.push(("quantization".into(), block.clone()));
    entries.push(("quantization_config".into(), block));
    entries.sort_by(|a, b| a.0.cmp(&b.0));
    Value::Object(entries.into_iter().collect())
}

/// JSON with 4-space indentation and a trailing newline (mlx-lm's `json.dump(indent=4)`).
pub(crate) fn write_json(path: &Path, v: &Value) -> Result<()> {
    mlx_core::io::model_dir::write_json(path, v).map_err(Error::file)
}
