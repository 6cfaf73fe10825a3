//! From llama.cpp's GGUF conventions to the mlx-lm model directory: architecture
//! hyperparameters (`<arch>.*` metadata), tensor names, llama's Q/K row permutation, and
//! `config.json` / `generation_config.json`.
use std::collections::BTreeMap;

use serde_json::{Value, json};

use crate::{Error, Result};
use mlx_core::io::gguf::{GgufFile, MetaValue, TensorInfo};

/// The architectures the importer maps (`general.architecture`).
pub const ARCHITECTURES: [&str; 3] = ["llama", "qwen2", "gemma3"];

/// What a module is, which decides how it may be stored.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Kind {
    /// `nn.Embedding` (`model.embed_tokens`): quantizable.
    Embedding,
    /// `nn.Linear`: quantizable.
    Linear,
    /// RMSNorm weight: always dense.
    Norm,
}

/// One GGUF tensor mapped to its mlx-lm name.
#[derive(Debug, Clone)]
pub(crate) struct Mapped {
    /// The module path, e.g. `model.layers.0.self_attn.q_proj`.
    pub module: String,
    /// `true` for a `.bias` tensor (always dense), `false` for `.weight`.
    pub bias: bool,
    /// The module kind.
    pub kind: Kind,
    /// llama.cpp's Q/K row permutation to undo: the number of heads of this projection.
    pub unpermute_heads: Option<usize>,
    /// Subtract this from every value: llama.cpp's Gemma converters store RMS norm scales
    /// as `1 + w` (its `norm_shift`), mlx-lm's Gemma 3 norms add the 1 themselves.
    pub shift: f32,
}

impl Mapped {
    /// The full tensor name (`<module>.weight` or `<module>.bias`).
    pub fn name(&self) -> String {
        format!("{}.{}", self.module, if self.bias { "bias" } else { "weight" })
    }
}

/// The hyperparameters of a llama/qwen2 GGUF.
#[derive(Debug, Clone)]
pub(crate) struct Hparams {
    pub arch: String,
    pub n_layers: usize,
    pub hidden: usize,
    pub ff: usize,
    pub n_heads: usize,
    pub n_kv_heads: usize,
    pub head_dim: usize,
    pub eps: f64,
    pub rope_theta: f64,
    pub max_pos: Option<u64>,
    pub rope_scaling: Option<Value>,
    pub vocab: usize,
    pub tied: bool,
    pub attention_bias: bool,
    pub mlp_bias: bool,
    /// Gemma 3: the sliding window of its local layers.
    pub sliding_window: Option<u64>,
}

fn gguf_err(g: &GgufFile, message: impl Into<String>) -> Error {
    Error::Gguf { path: g.path().into(), message: message.into() }
}

fn num(g: &GgufFile, key: &str) -> Result<Option<u64>> {
    match g.get(key) {
        None => Ok(None),
        Some(v) => v.as_u64().map(Some).ok_or_else(|| {
            let what = if matches!(v, MetaValue::Array { .. }) {
                "a per-layer array (not supported)".to_string()
            } else {
                format!("{v:?}")
            };
            gguf_err(g, format!("metadata `{key}` is {what}, expected a non-negative integer"))
        }),
    }
}

fn req(g: &GgufFile, key: &str) -> Result<u64> {
    num(g, key)?.ok_or_else(|| gguf_err(g, format!("metadata `{key}` is missing")))
}

fn float(g: &GgufFile, key: &str) -> Result<Option<f64>> {
    match g.get(key) {
        None => Ok(None),
        Some(v) => {
            v.as_f64().map(Some).ok_or_else(|| gguf_err(g, format!("metadata `{key}` is {v:?}, expected a number")))
        }
    }
}

/// The architecture named by `general.architecture`.
///
/// # Errors
/// [`Error::Gguf`] when it is missing; [`Error::Unsupported`] naming it when it is not one
/// of [`ARCHITECTURES`].
pub(crate) fn architecture(g: &GgufFile) -> Result<String> {
    let arch = g
        .get("general.architecture")
        .and_then(MetaValue::as_str)
        .ok_or_else(|| gguf_err(g, "metadata `general.architecture` is missing or not a string"))?;
    if !ARCHITECTURES.contains(&arch) {
        return Err(Error::Unsupported(format!(
            "{}: GGUF architecture `{arch}` (supported: {})",
            g.path().display(),
            ARCHITECTURES.join(", ")
        )));
    }
    Ok(arch.to_string())
}

impl Hparams {
    /// Reads the hyperparameters and checks them against the tensors present.
    pub fn from_gguf(g: &GgufFile) -> Result<Hparams> {
        let arch = architecture(g)?;
        let k = |s: &str| format!("{arch}.{s}");
        let n_layers = req(g, &k("block_count"))? as usize;
        let hidden = req(g, &k("embedding_length"))? as usize;
        let ff = req(g, &k("feed_forward_length"))? as usize;
        let n_heads = req(g, &k("attention.head_count"))? as usize;
        let n_kv_heads = num(g, &k("attention.head_count_kv"))?.map_or(n_heads, |v| v as usize);
        if n_heads == 0 || n_kv_heads == 0 || !n_heads.is_multiple_of(n_kv_heads) {
            return Err(gguf_err(g, format!("{n_heads} attention heads cannot share {n_kv_heads} KV heads")));
        }
        let head_dim = num(g, &k("attention.key_length"))?.map_or(hidden / n_heads, |v| v as usize);
        if let Some(v) = num(g, &k("attention.value_length"))?
            && v as usize != head_dim
        {
            return Err(Error::Unsupported(format!(
                "{}: value head size {v} differs from key head size {head_dim}",
                g.path().display()
            )));
        }
        if arch == "qwen2" && head_dim * n_heads != hidden {
            return Err(Error::Unsupported(format!(
                "{}: qwen2 with head_dim {head_dim} != hidden {hidden} / heads {n_heads}",
                g.path().display()
            )));
        }
        if let Some(r) = num(g, &k("rope.dimension_count"))?
            && r as usize != head_dim
        {
            return Err(Error::Unsupported(format!(
                "{}: partial rotary embedding ({r} of {head_dim} dimensions)",
                g.path().display()
            )));
        }
        let eps = float(g, &k("attention.layer_norm_rms_epsilon"))?
            .ok_or_else(|| gguf_err(g, format!("metadata `{}` is missing", k("attention.layer_norm_rms_epsilon"))))?;
        let rope_theta = float(g, &k("rope.freq_base"))?.unwrap_or(10000.0);
        let max_pos = num(g, &k("context_length"))?;
        let rope_scaling = rope_scaling(g, &arch)?;
        let embd = g.tensor("token_embd.weight").ok_or_else(|| gguf_err(g, "tensor `token_embd.weight` is missing"))?;
        let vocab = embd.shape.first().copied().unwrap_or(0) as usize;
        let has = |n: &str| g.tensor(n).is_some();
        let attention_bias = arch == "llama" && has("blk.0.attn_q.bias");
        let mlp_bias = arch == "llama" && has("blk.0.ffn_up.bias");
        let sliding_window = num(g, &k("attention.sliding_window"))?;
        Ok(Hparams {
            tied: !has("output.weight"),
            arch,
            n_layers,
            hidden,
            ff,
            n_heads,
            n_kv_heads,
            head_dim,
            eps,
            rope_theta,
            max_pos,
            rope_scaling,
            vocab,
            attention_bias,
            mlp_bias,
            sliding_window,
        })
    }

    /// Maps a GGUF tensor name, `None` for a name this architecture does not have.
    pub fn map(&self, name: &str) -> Option<Mapped> {
        let (stem, bias) =
            if let Some(s) = name.strip_suffix(".weight") { (s, false) } else { (name.strip_suffix(".bias")?, true) };
        let gemma = self.arch == "gemma3";
        let shift = if gemma { 1.0 } else { 0.0 };
        let m = |module: String, kind| {
            let shift = if kind == Kind::Norm { shift } else { 0.0 };
            Some(Mapped { module, bias, kind, unpermute_heads: None, shift })
        };
        match stem {
            "token_embd" if !bias => return m("model.embed_tokens".into(), Kind::Embedding),
            "output_norm" if !bias => return m("model.norm".into(), Kind::Norm),
            "output" if !bias => return m("lm_head".into(), Kind::Linear),
            _ => {}
        }
        let rest = stem.strip_prefix("blk.")?;
        let (layer, part) = rest.split_once('.')?;
        if layer.is_empty() || !layer.bytes().all(|b| b.is_ascii_digit()) || (layer.len() > 1 && layer.starts_with('0'))
        {
            return None;
        }
        let layer: usize = layer.parse().ok()?;
        if layer >= self.n_layers {
            return None;
        }
        let p = format!("model.layers.{layer}");
        let (module, kind) = match part {
            "attn_q" => (format!("{p}.self_attn.q_proj"), Kind::Linear),
            "attn_k" => (format!("{p}.self_attn.k_proj"), Kind::Linear),
            "attn_v" => (format!("{p}.self_attn.v_proj"), Kind::Linear),
            "attn_output" => (format!("{p}.self_attn.o_proj"), Kind::Linear),
            "ffn_gate" => (format!("{p}.mlp.gate_proj"), Kind::Linear),
            "ffn_up" => (format!("{p}.mlp.up_proj"), Kind::Linear),
            "ffn_down" => (format!("{p}.mlp.down_proj"), Kind::Linear),
            "attn_norm" => (format!("{p}.input_layernorm"), Kind::Norm),
            "ffn_norm" if gemma => (format!("{p}.pre_feedforward_layernorm"), Kind::Norm),
            "ffn_norm" => (format!("{p}.post_attention_layernorm"), Kind::Norm),
            "post_attention_norm" if gemma => (format!("{p}.post_attention_layernorm"), Kind::Norm),
            "post_ffw_norm" if gemma => (format!("{p}.post_feedforward_layernorm"), Kind::Norm),
            "attn_q_norm" if gemma => (format!("{p}.self_attn.q_norm"), Kind::Norm),
            "attn_k_norm" if gemma => (format!("{p}.self_attn.k_norm"), Kind::Norm),
            _ => return None,
        };
        if bias && kind == Kind::Norm {
            return None;
        }
        let unpermute_heads = match (self.arch.as_str(), part) {
            ("llama", "attn_q") => Some(self.n_heads),
            ("llama", "attn_k") => Some(self.n_kv_heads),
            _ => None,
        };
        Some(Mapped { module, bias, kind, unpermute_heads, shift: if kind == Kind::Norm { shift } else { 0.0 } })
    }

    /// Every GGUF tensor name this model must have, with its expected row-major shape.
    pub fn expected(&self) -> Vec<(String, Vec<u64>)> {
        let (h, ff, v) = (self.hidden as u64, self.ff as u64, self.vocab as u64);
        let (qd, kvd) = ((self.n_heads * self.head_dim) as u64, (self.n_kv_heads * self.head_dim) as u64);
        let mut out = vec![("token_embd.weight".to_string(), vec![v, h]), ("output_norm.weight".into(), vec![h])];
        if !self.tied {
            out.push(("output.weight".into(), vec![v, h]));
        }
        for i in 0..self.n_layers {
            let b = |s: &str| format!("blk.{i}.{s}");
            out.extend([
                (b("attn_norm.weight"), vec![h]),
                (b("ffn_norm.weight"), vec![h]),
                (b("attn_q.weight"), vec![qd, h]),
                (b("attn_k.weight"), vec![kvd, h]),
                (b("attn_v.weight"), vec![kvd, h]),
                (b("attn_output.weight"), vec![h, qd]),
                (b("ffn_gate.weight"), vec![ff, h]),
                (b("ffn_up.weight"), vec![ff, h]),
                (b("ffn_down.weight"), vec![h, ff]),
            ]);
            if self.arch == "gemma3" {
                let hd = self.head_dim as u64;
                out.extend([
                    (b("post_attention_norm.weight"), vec![h]),
                    (b("post_ffw_norm.weight"), vec![h]),
                    (b("attn_q_norm.weight"), vec![hd]),
                    (b("attn_k_norm.weight"), vec![hd]),
                ]);
            }
            if self.arch == "qwen2" || self.attention_bias {
                out.extend([
                    (b("attn_q.bias"), vec![qd]),
                    (b("attn_k.bias"), vec![kvd]),
                    (b("attn_v.bias"), vec![kvd]),
                ]);
            }
            if self.attention_bias {
                out.push((b("attn_output.bias"), vec![h]));
            }
            if self.mlp_bias {
                out.extend([
                    (b("ffn_gate.bias"), vec![ff]),
                    (b("ffn_up.bias"), vec![ff]),
                    (b("ffn_down.bias"), vec![h]),
                ]);
            }
        }
        out
    }

    /// Maps every tensor and checks the set and the shapes against [`Hparams::expected`].
    ///
    /// # Errors
    /// [`Error::Gguf`] naming the unknown tensors (first), then the missing ones, then a
    /// tensor with the wrong shape.
    pub fn map_all(&self, g: &GgufFile) -> Result<Vec<(TensorInfo, Mapped)>> {
        let unknown: Vec<&str> =
            g.tensors.iter().filter(|t| self.map(&t.name).is_none()).map(|t| t.name.as_str()).collect();
        if !unknown.is_empty() {
            let hint = if unknown.contains(&"rope_freqs.weight") {
                " (`rope_freqs` is llama3-style rope scaling, which the importer does not support)"
            } else {
                ""
            };
            return Err(gguf_err(
                g,
                format!(
                    "unknown tensor{} for architecture `{}`: {}{hint}",
                    if unknown.len() > 1 { "s" } else { "" },
                    self.arch,
                    list(&unknown)
                ),
            ));
        }
        let expected = self.expected();
        let missing: Vec<&str> =
            expected.iter().filter(|(n, _)| g.tensor(n).is_none()).map(|(n, _)| n.as_str()).collect();
        if !missing.is_empty() {
            return Err(gguf_err(
                g,
                format!("missing tensor{}: {}", if missing.len() > 1 { "s" } else { "" }, list(&missing)),
            ));
        }
        let shapes: BTreeMap<&str, &Vec<u64>> = expected.iter().map(|(n, s)| (n.as_str(), s)).collect();
        let mut out = Vec::with_capacity(g.tensors.len());
        for t in &g.tensors {
            let Some(want) = shapes.get(t.name.as_str()) else {
                return Err(gguf_err(g, format!("unexpected tensor `{}` for this configuration", t.name)));
            };
            if &&t.shape != want {
                return Err(gguf_err(
                    g,
                    format!("tensor `{}` has shape {:?}, the metadata implies {:?}", t.name, t.shape, want),
                ));
            }
            out.push((t.clone(), self.map(&t.name).expect("checked above")));
        }
        Ok(out)
    }

    /// `config.json` (HF / mlx-lm form) without the quantization entries; keys sorted.
    pub fn config(&self, g: &GgufFile, torch_dtype: &str) -> BTreeMap<String, Value> {
        let mut c = BTreeMap::new();
        let (cls, mt) = match self.arch.as_str() {
            "qwen2" => ("Qwen2ForCausalLM", "qwen2"),
            "gemma3" => ("Gemma3ForCausalLM", "gemma3_text"),
            _ => ("LlamaForCausalLM", "llama"),
        };
        c.insert("architectures".into(), json!([cls]));
        c.insert("model_type".into(), json!(mt));
        c.insert("hidden_size".into(), json!(self.hidden));
        c.insert("num_hidden_layers".into(), json!(self.n_layers));
        c.insert("intermediate_size".into(), json!(self.ff));
        c.insert("num_attention_heads".into(), json!(self.n_heads));
        c.insert("num_key_value_heads".into(), json!(self.n_kv_heads));
        c.insert("head_dim".into(), json!(self.head_dim));
        c.insert("rms_norm_eps".into(), json!(self.eps));
        c.insert("rope_theta".into(), json!(self.rope_theta));
        c.insert("vocab_size".into(), json!(self.vocab));
        c.insert("tie_word_embeddings".into(), json!(self.tied));
        if self.arch == "gemma3" {
            // llama.cpp's gemma3: every 6th layer is global, local layers use rope base 10000,
            // queries are scaled by head_dim^-0.5 (hidden / heads for the 27B, 62 layers).
            c.insert("hidden_activation".into(), json!("gelu_pytorch_tanh"));
            c.insert("sliding_window".into(), json!(self.sliding_window.unwrap_or(512)));
            c.insert("sliding_window_pattern".into(), json!(6));
            c.insert("rope_local_base_freq".into(), json!(10000.0));
            let scalar = if self.n_layers == 62 { self.hidden / self.n_heads } else { self.head_dim };
            c.insert("query_pre_attn_scalar".into(), json!(scalar));
            c.insert("final_logit_softcapping".into(), Value::Null);
            c.insert("attn_logit_softcapping".into(), Value::Null);
        } else {
            c.insert("hidden_act".into(), json!("silu"));
        }
        c.insert("torch_dtype".into(), json!(torch_dtype));
        c.insert("rope_scaling".into(), self.rope_scaling.clone().unwrap_or(Value::Null));
        if let Some(m) = self.max_pos {
            c.insert("max_position_embeddings".into(), json!(m));
        }
        if self.arch == "llama" {
            c.insert("attention_bias".into(), json!(self.attention_bias));
            c.insert("mlp_bias".into(), json!(self.mlp_bias));
        }
        for (key, field) in
            [("bos_token_id", "bos_token_id"), ("eos_token_id", "eos_token_id"), ("padding_token_id", "pad_token_id")]
        {
            if let Some(v) = g.get(&format!("tokenizer.ggml.{key}")).and_then(MetaValue::as_u64) {
                c.insert(field.into(), json!(v));
            }
        }
        c
    }

    /// `generation_config.json`: bos, the end-of-generation ids (`eos`, `eot`, `eom`,
    /// deduplicated; a single id as a number, several as a list) and pad.
    pub fn generation_config(&self, g: &GgufFile) -> BTreeMap<String, Value> {
        let id = |k: &str| g.get(&format!("tokenizer.ggml.{k}")).and_then(MetaValue::as_u64);
        let mut c = BTreeMap::new();
        if let Some(b) = id("bos_token_id") {
            c.insert("bos_token_id".into(), json!(b));
        }
        let mut eos: Vec<u64> = Vec::new();
        for k in ["eos_token_id", "eot_token_id", "eom_token_id"] {
            if let Some(v) = id(k)
                && !eos.contains(&v)
            {
                eos.push(v);
            }
        }
        // Gemma ends a chat turn with `<end_of_turn>` (HF's generation_config lists it).
        if self.arch == "gemma3"
            && let Some(MetaValue::Array { items, .. }) = g.get("tokenizer.ggml.tokens")
            && let Some(i) = items.iter().position(|t| t.as_str() == Some("<end_of_turn>"))
            && !eos.contains(&(i as u64))
        {
            eos.push(i as u64);
        }
        match eos.len() {
            0 => {}
            1 => {
                c.insert("eos_token_id".into(), json!(eos[0]));
            }
            _ => {
                c.insert("eos_token_id".into(), json!(eos));
            }
        }
        if let Some(p) = id("padding_token_id") {
            c.insert("pad_token_id".into(), json!(p));
        }
        c
    }
}

fn list(names: &[&str]) -> String {
    const SHOW: usize = 8;
    let mut s = names.iter().take(SHOW).map(|n| format!("`{n}`")).collect::<Vec<_>>().join(", ");
    if names.len() > SHOW {
        s.push_str(&format!(" and {} more", names.len() - SHOW));
    }
    s
}

fn rope_scaling(g: &GgufFile, arch: &str) -> Result<Option<Value>> {
    let k = |s: &str| format!("{arch}.{s}");
    let ty = g.get(&k("rope.scaling.type")).and_then(MetaValue::as_str);
    let factor = float(g, &k("rope.scaling.factor"))?.or(float(g, &k("rope.scale_linear"))?);
    match (ty, factor) {
        (None | Some("none"), None) => Ok(None),
        (Some("none"), Some(_)) => Ok(None),
        (None | Some("linear"), Some(f)) => Ok((f != 1.0).then(|| json!({"type": "linear", "factor": f}))),
        (Some("yarn"), Some(f)) => {
            let orig = num(g, &k("rope.scaling.original_context_length"))?.ok_or_else(|| {
                gguf_err(g, format!("yarn rope scaling without `{}`", k("rope.scaling.original_context_length")))
            })?;
            Ok(Some(json!({"type": "yarn", "factor": f, "original_max_position_embeddings": orig})))
        }
        (Some(t), _) => Err(Error::Unsupported(format!(
            "{}: rope scaling `{t}`{} (supported: linear, yarn)",
            g.path().display(),
            if factor.is_none() { " without a factor" } else { "" }
        ))),
    }
}
