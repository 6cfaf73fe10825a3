//! GGUF import: turns a llama.cpp GGUF file (llama, qwen2 or gemma3 architecture) into a model
//! directory in the mlx-lm layout, so every other command reads one format.
//!
//! [`import_gguf`] is the entry point. The GGUF container is read by mlx-core's Rust reader
//! ([`mlx_core::io::gguf`], re-exported here as [`reader`] and [`blocks`]) one tensor at a
//! time. It decodes F32, F16, BF16, F64, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0 and Q2_K..Q6_K; its
//! dequantization matches gguf-py's and its affine triples for Q4_0/Q4_1/Q8_0 are
//! bit-identical to MLX 0.32's own GGUF loader (both tested). Problems the reader finds in
//! the file are reported as [`Error::Gguf`].
//!
//! # Weight formats
//! - **Dense** (default): every tensor dequantized to f32 and stored as `dtype`
//!   (bf16 unless set).
//! - **Keep** (`keep_quantized`): GGUF blocks that MLX's affine format holds exactly stay
//!   quantized, group size 32: Q4_0/Q4_1/Q4_K -> 4 bits, Q5_0/Q5_1/Q5_K -> 5 bits,
//!   Q8_0 -> 8 bits. Scales and biases are stored as f16 (f32 when `dtype` is f32); for
//!   Q4_0/Q4_1/Q5_0/Q5_1/Q8_0 that is exact, for Q4_K/Q5_K the per-sub-block products
//!   `d * sc` and `dmin * m` are rounded to f16 (exact in f32). Q2_K, Q3_K, Q6_K (16-element
//!   sub-blocks) and float tensors are stored dense.
//! - **Requantize** (`quantize`): weights dequantized, cast to `dtype`, then quantized
//!   with `mlx_core::quant::quantize` (as `mlx_lm.convert -q` does).
//!
//! Norms and biases are always dense; Gemma 3's norm scales, which llama.cpp stores as
//! `1 + w`, are stored as `w` (mlx-lm's `gemma3_text` adds the 1). llama's Q/K rows are un-permuted (llama.cpp's
//! converter permutes them for its interleaved rope; it does not do so for qwen2, whose
//! converter class `Qwen2Model` has no permute step and whose llama.cpp rope is NEOX-style).
mod layout;

/// GGML block types and codecs (mlx-core's [`mlx_core::io::gguf::blocks`]).
pub use mlx_core::io::gguf::blocks;
/// The GGUF container reader (mlx-core's [`mlx_core::io::gguf::reader`]).
pub use mlx_core::io::gguf::reader;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::Instant;

use half::f16;
use mlx_core::io::model_dir::{self, ShardPlan, StagedDir};
use mlx_core::quant::{self, QuantSpec};
use mlx_core::{Array, Dtype};
use serde_json::{Value, json};

pub use layout::ARCHITECTURES;
use layout::{Hparams, Kind, Mapped};
use reader::{GgufFile, TensorInfo};

use crate::{Error, Result};

/// The largest weight file written before splitting into shards (mlx-lm's 5 GiB,
/// [`model_dir::MAX_SHARD_BYTES`]).
pub const DEFAULT_MAX_SHARD_BYTES: u64 = model_dir::MAX_SHARD_BYTES;

/// How [`import_gguf`] stores the weights.
#[derive(Debug, Clone, PartialEq)]
pub struct ImportOptions {
    /// Float dtype of dense tensors (Float32, Float16 or Bfloat16). `None`: bf16, or f16
    /// when `keep_quantized` (the GGUF scales are f16, so nothing is rounded).
    pub dtype: Option<Dtype>,
    /// Requantize every embedding/linear weight with MLX affine quantization. Weights whose
    /// row length is not a multiple of the group size stay dense (`false` in the config).
    /// Takes precedence over `keep_quantized`.
    pub quantize: Option<QuantSpec>,
    /// Keep GGUF blocks that MLX's affine format represents exactly as quantized (see the
    /// module docs); everything else is dense in `dtype`.
    pub keep_quantized: bool,
    /// Replace an existing `out_dir` (only when the import succeeds).
    pub force: bool,
    /// Do not write tokenizer files (for GGUFs without usable tokenizer metadata, or tests).
    pub skip_tokenizer: bool,
    /// Largest weight file in bytes; more weights are split into
    /// `model-0000i-of-0000N.safetensors` shards. A single tensor larger than this gets a
    /// shard of its own.
    pub max_shard_bytes: u64,
}

impl Default for ImportOptions {
    fn default() -> Self {
        Self {
            dtype: None,
            quantize: None,
            keep_quantized: false,
            force: false,
            skip_tokenizer: false,
            max_shard_bytes: DEFAULT_MAX_SHARD_BYTES,
        }
    }
}

/// A progress event of [`import_gguf`], in this order: one `Reading`, `Converting` for each
/// GGUF tensor (interleaved with `Writing` as shards complete), one `Done`.
#[derive(Debug, Clone, PartialEq)]
#[non_exhaustive]
pub enum ImportProgress {
    /// Parsing the header of `parts` files, `bytes` in total.
    Reading {
        /// Number of files.
        parts: usize,
        /// Their total size in bytes.
        bytes: u64,
    },
    /// Converting tensor `index` (1-based) of `total`; `name` is the output name.
    Converting {
        /// 1-based position.
        index: usize,
        /// Number of GGUF tensors.
        total: usize,
        /// Output tensor name (`model.layers.0.self_attn.q_proj.weight`).
        name: String,
    },
    /// Writing weight file `index` (1-based) of `total`.
    Writing {
        /// File name inside the output directory.
        file: String,
        /// 1-based position.
        index: usize,
        /// Number of weight files.
        total: usize,
    },
    /// Finished: the directory is in place.
    Done {
        /// The output directory.
        out_dir: PathBuf,
        /// Bytes of weights written.
        bytes: u64,
        /// Wall time in seconds.
        seconds: f64,
    },
}

/// What [`import_gguf`] wrote.
#[derive(Debug, Clone, PartialEq)]
pub struct ImportSummary {
    /// The output directory.
    pub out_dir: PathBuf,
    /// `model_type` (`llama` or `qwen2`).
    pub model_type: String,
    /// Number of tensors in the GGUF file.
    pub gguf_tensors: usize,
    /// GGUF tensor count by GGML type name (`Q4_K` -> 120).
    pub gguf_types: BTreeMap<String, usize>,
    /// Number of tensors written (a quantized module counts three).
    pub tensors_written: usize,
    /// Embedding/linear modules stored quantized.
    pub quantized_modules: usize,
    /// Embedding/linear modules stored dense.
    pub dense_modules: usize,
    /// The default spec of `config.json`'s `quantization` block, `None` when unquantized.
    pub quantization: Option<QuantSpec>,
    /// The weight files, in order.
    pub weight_files: Vec<String>,
    /// Bytes of tensor data written (safetensors headers excluded).
    pub weight_bytes: u64,
    /// Logical parameter count (a packed weight counts its unpacked elements; mlx-lm's
    /// `total_parameters`).
    pub total_parameters: u64,
    /// Whether tokenizer files were written.
    pub tokenizer: bool,
    /// Dense float dtype used.
    pub dtype: Dtype,
    /// Wall time in seconds.
    pub seconds: f64,
}

/// How one GGUF tensor is stored.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Store {
    Dense,
    Keep { bits: i32 },
    Requant(QuantSpec),
}

struct Item {
    info: TensorInfo,
    map: Mapped,
    store: Store,
}

impl Item {
    fn rows_cols(&self) -> (usize, usize) {
        let s = &self.info.shape;
        let cols = *s.last().unwrap_or(&1) as usize;
        (self.info.numel() as usize / cols.max(1), cols)
    }

    /// `(name, nbytes)` of each output tensor.
    fn outputs(&self, dtype: Dtype, scale_dtype: Dtype) -> Vec<(String, u64)> {
        let numel = self.info.numel();
        let (rows, cols) = self.rows_cols();
        let m = &self.map.module;
        let (bits, gs, sd) = match self.store {
            Store::Dense => return vec![(self.map.name(), numel * dtype.size() as u64)],
            Store::Keep { bits } => (bits as u64, 32u64, scale_dtype),
            Store::Requant(s) => (s.bits as u64, s.group_size as u64, dtype),
        };
        let groups = (rows * cols) as u64 / gs;
        vec![
            (format!("{m}.biases"), groups * sd.size() as u64),
            (format!("{m}.scales"), groups * sd.size() as u64),
            (format!("{m}.weight"), numel * bits / 8),
        ]
    }
}

fn out_err(path: &Path, message: impl Into<String>) -> Error {
    Error::Gguf { path: path.into(), message: message.into() }
}

/// An error of mlx-core's GGUF reader in this crate's terms: a problem with the file
/// ([`mlx_core::Error::File`]) is an [`Error::Gguf`] naming it.
fn reader_err(e: mlx_core::Error) -> Error {
    match e {
        mlx_core::Error::File { path, message } => Error::Gguf { path, message },
        e => Error::Mlx(e),
    }
}

/// Imports a GGUF model into `out_dir` in the mlx-lm layout.
///
/// `parts` is one GGUF file, or the parts of one GGUF file split byte-wise (in order; they
/// are read as their concatenation, without a copy). The architecture is chosen by
/// `general.architecture`: `llama`, `qwen2` or `gemma3` (written as `gemma3_text`).
///
/// Writes into `out_dir`:
/// - `model.safetensors`, or `model-0000i-of-0000N.safetensors` shards of at most
///   `options.max_shard_bytes` each, metadata `{"format": "mlx"}`; tensors named as mlx-lm
///   names them (`model.embed_tokens.weight`, `model.layers.N.self_attn.q_proj.weight`, ...,
///   `lm_head.weight` when the GGUF has `output.weight`), quantized modules as
///   `<module>.weight` (uint32 `[rows, cols * bits / 32]`), `<module>.scales` and
///   `<module>.biases` (`[rows, cols / group_size]`);
/// - `model.safetensors.index.json` (`metadata.total_size`, `metadata.total_parameters`,
///   `weight_map`), as mlx-lm writes it, also for a single file;
/// - `config.json` in HF / mlx-lm form; when anything is quantized, `quantization` and
///   `quantization_config` with the most common spec as default and per-module entries for
///   modules that differ (`{"group_size", "bits", "mode": "affine"}`) or stay dense (`false`);
/// - `generation_config.json` (bos, eos ids, pad);
/// - `tokenizer.json` and `tokenizer_config.json` from
///   [`crate::tokenizer::tokenizer_files_from_gguf`], unless `options.skip_tokenizer`.
///
/// Everything is written into a hidden temporary directory beside `out_dir` (missing
/// parent directories are created; [`mlx_core::io::model_dir::StagedDir`]) and renamed
/// into place only when complete; shards follow mlx-lm's `make_shards` rule
/// ([`mlx_core::io::model_dir::ShardPlan`]). On any
/// error nothing is left behind: no `out_dir`, no temporary directory, no parent directory
/// this call created. `progress` receives [`ImportProgress`] events.
///
/// All arrays are built on the calling thread (MLX arrays are thread-bound).
///
/// # Errors
/// - [`Error::Mlx`] ([`mlx_core::Error::File`] naming `out_dir`) when `out_dir` is, holds
///   or lies inside a part ([`mlx_core::io::model_dir::check_apart`]), with `force` or not;
/// - [`Error::Gguf`] naming the file when `out_dir` exists and `options.force` is off (or
///   it is not a directory), for every problem [`GgufFile::open`] reports (not GGUF,
///   truncated, parts out of order, unknown tensor type id, a part that cannot be read),
///   a missing or malformed
///   hyperparameter, unknown tensor names (all listed), missing tensors, a shape that does
///   not match the metadata, or a tensor holding NaN/Inf (corrupt data, or parts of
///   another file);
/// - [`Error::Unsupported`] for an architecture other than llama/qwen2, a known but
///   unsupported tensor type (IQ*, TQ*, ...), partial rotary, an unsupported rope
///   scaling, or invalid options (no parts, a non-float `dtype`, a zero shard size);
/// - [`Error::Io`] when a part does not exist (or its size cannot be read);
///   [`Error::Mlx`] when MLX fails to build, quantize or save an array, or
///   ([`mlx_core::Error::File`], naming it) when an output file, the staging directory or
///   a missing parent cannot be created or the rename into place fails; any error of the
///   tokenizer builder.
pub fn import_gguf(
    parts: &[PathBuf],
    out_dir: &Path,
    options: &ImportOptions,
    progress: &mut dyn FnMut(ImportProgress),
) -> Result<ImportSummary> {
    let t0 = Instant::now();
    let (dtype, scale_dtype, quantize) = check_options(options)?;
    for part in parts {
        mlx_core::io::model_dir::check_apart(part, out_dir)?;
    }
    check_out_dir(out_dir, options.force)?;

    if parts.is_empty() {
        return Err(Error::Unsupported("reading a GGUF file from an empty list of parts".into()));
    }
    let mut bytes = 0u64;
    for p in parts {
        bytes += std::fs::metadata(p).map_err(|e| Error::io(p, e))?.len();
    }
    progress(ImportProgress::Reading { parts: parts.len(), bytes });
    let g = open_gguf(parts)?;
    let hp = Hparams::from_gguf(&g)?;
    let items = plan_items(hp.map_all(&g)?, quantize, options.keep_quantized);
    let quant_config = quantization_block(&items);
    let tokenizer =
        if options.skip_tokenizer { None } else { Some(crate::tokenizer::tokenizer_files_from_gguf(&g.to_mlx()?)?) };

    // Shards over the sorted output names, with mlx-lm's rule.
    let mut outputs: Vec<(String, u64)> = items.iter().flat_map(|it| it.outputs(dtype, scale_dtype)).collect();
    outputs.sort();
    let shards = ShardPlan::new(outputs, options.max_shard_bytes);

    let staged = StagedDir::create(out_dir, "importing")?;
    let total_parameters: u64 = items.iter().map(|it| it.info.numel()).sum();
    let mut write = |dir: &Path| -> Result<_> {
        let written = write_shards(&g, &items, &shards, dir, dtype, scale_dtype, progress)?;
        shards.write_index(dir, total_parameters)?;
        let mut config = hp.config(&g, torch_dtype(dtype));
        if let Some(q) = &quant_config {
            config.insert("quantization".into(), q.clone());
            config.insert("quantization_config".into(), q.clone());
        }
        write_json(&dir.join("config.json"), &Value::Object(config.into_iter().collect()))?;
        write_json(
            &dir.join("generation_config.json"),
            &Value::Object(hp.generation_config(&g).into_iter().collect()),
        )?;
        if let Some(t) = &tokenizer {
            write_text(&dir.join("tokenizer.json"), &t.tokenizer_json)?;
            write_text(&dir.join("tokenizer_config.json"), &t.tokenizer_config_json)?;
        }
        Ok(written)
    };
    // Errors name the destination's files, not the staging directory's.
    let written = write(staged.path()).map_err(|e| e.with_paths(&|p| staged.shown(p)))?;
    staged.commit(options.force)?;

    let quantized_modules =
        items.iter().filter(|it| matches!(it.store, Store::Keep { .. } | Store::Requant(_))).count();
    let modules = items.iter().filter(|it| !it.map.bias && it.map.kind != Kind::Norm).count();
    let weight_bytes = shards.total_bytes();
    let seconds = t0.elapsed().as_secs_f64();
    progress(ImportProgress::Done { out_dir: out_dir.to_path_buf(), bytes: weight_bytes, seconds });
    Ok(ImportSummary {
        out_dir: out_dir.to_path_buf(),
        model_type: hp.arch.clone(),
        gguf_tensors: g.tensors.len(),
        gguf_types: gguf_types(&g),
        tensors_written: written,
        quantized_modules,
        dense_modules: modules - quantized_modules,
        quantization: quant_config
            .as_ref()
            .and_then(|q| QuantSpec::new(q["group_size"].as_i64()? as i32, q["bits"].as_i64()? as i32).ok()),
        weight_files: shards.file_names(),
        weight_bytes,
        total_parameters,
        tokenizer: tokenizer.is_some(),
        dtype,
        seconds,
    })
}

/// The dense dtype, the scale dtype of kept GGUF blocks and the requantization spec of
/// `options`.
fn check_options(options: &ImportOptions) -> Result<(Dtype, Dtype, Option<QuantSpec>)> {
    let dtype = options.dtype.unwrap_or(if options.keep_quantized && options.quantize.is_none() {
        Dtype::Float16
    } else {
        Dtype::Bfloat16
    });
    if !matches!(dtype, Dtype::Float32 | Dtype::Float16 | Dtype::Bfloat16) {
        return Err(Error::Unsupported(format!("import dtype {dtype} (use float32, float16 or bfloat16)")));
    }
    if options.max_shard_bytes == 0 {
        return Err(Error::Unsupported("a maximum shard size of 0 bytes".into()));
    }
    let quantize = options.quantize.map(|s| QuantSpec::new(s.group_size, s.bits)).transpose()?;
    let scale_dtype = if dtype == Dtype::Float32 { Dtype::Float32 } else { Dtype::Float16 };
    Ok((dtype, scale_dtype, quantize))
}

/// Refuses an existing `out_dir` unless `force`, and even then one that is not a model
/// directory (no `config.json`) and not empty.
fn check_out_dir(out_dir: &Path, force: bool) -> Result<()> {
    if out_dir.exists() && (!force || !out_dir.is_dir()) {
        let why = if out_dir.is_dir() {
            "already exists (--force replaces a model directory)"
        } else {
            "exists and is not a directory"
        };
        return Err(out_err(out_dir, format!("output directory {why}")));
    }
    // `force` replaces a model directory, never an unrelated one that happens to be named.
    if out_dir.is_dir() && !out_dir.join("config.json").is_file() {
        let empty = std::fs::read_dir(out_dir).map(|mut d| d.next().is_none()).unwrap_or(false);
        if !empty {
            return Err(out_err(
                out_dir,
                "output directory exists and is not a model directory (no config.json); refusing to replace it",
            ));
        }
    }
    if out_dir.file_name().and_then(|n| n.to_str()).is_none() {
        return Err(out_err(out_dir, "output directory needs a UTF-8 final path component"));
    }
    Ok(())
}

/// Opens the parts as one GGUF file, logging the reader's warnings and refusing tensor
/// types it cannot decode.
fn open_gguf(parts: &[PathBuf]) -> Result<GgufFile> {
    let g = GgufFile::open(parts).map_err(reader_err)?;
    for w in &g.warnings {
        tracing::warn!(path = %g.path().display(), "{w}");
    }
    if let Some(t) = g.tensors.iter().find(|t| !t.ty.is_supported()) {
        return Err(Error::Unsupported(format!(
            "{}: tensor `{}` has type {}, which the importer cannot decode (supported: {})",
            g.path().display(),
            t.name,
            t.ty,
            blocks::GgmlType::SUPPORTED.iter().map(|t| t.name()).collect::<Vec<_>>().join(", ")
        )));
    }
    Ok(g)
}

/// GGUF tensor count by GGML type name.
fn gguf_types(g: &GgufFile) -> BTreeMap<String, usize> {
    let mut types = BTreeMap::new();
    for t in &g.tensors {
        *types.entry(t.ty.name()).or_insert(0) += 1;
    }
    types
}

/// How each tensor is stored, in output-name order.
fn plan_items(mapped: Vec<(TensorInfo, Mapped)>, quantize: Option<QuantSpec>, keep_quantized: bool) -> Vec<Item> {
    let mut items: Vec<Item> = mapped
        .into_iter()
        .map(|(info, map)| {
            let cols = *info.shape.last().unwrap_or(&1) as i32;
            let matrix = !map.bias && map.kind != Kind::Norm && info.shape.len() == 2;
            let store = match (quantize, matrix) {
                (_, false) => Store::Dense,
                (Some(s), true) if cols % s.group_size == 0 => Store::Requant(s),
                (Some(_), true) => Store::Dense,
                (None, true) if keep_quantized && blocks::affine_compatible(info.ty) => {
                    Store::Keep { bits: bits_of(info.ty) }
                }
                (None, true) => Store::Dense,
            };
            Item { info, map, store }
        })
        .collect();
    items.sort_by_key(|it| it.map.name());
    items
}

/// Converts every item on the calling thread and writes each shard of `shards` into `dir`
/// as soon as all its tensors are converted; returns the number of tensors written.
fn write_shards(
    g: &GgufFile,
    items: &[Item],
    shards: &ShardPlan,
    dir: &Path,
    dtype: Dtype,
    scale_dtype: Dtype,
    progress: &mut dyn FnMut(ImportProgress),
) -> Result<usize> {
    let n_shards = shards.len();
    let mut pending: Vec<usize> = (0..n_shards).map(|i| shards.tensors(i).len()).collect();
    let mut buffers: Vec<Vec<(String, Array)>> = vec![Vec::new(); n_shards];
    let mut written = 0usize;
    let total = items.len();
    for (k, it) in items.iter().enumerate() {
        progress(ImportProgress::Converting { index: k + 1, total, name: it.map.name() });
        for (name, array) in convert(g, it, dtype, scale_dtype)? {
            let s = shards.shard_of(&name).expect("planned");
            buffers[s].push((name, array));
            pending[s] -= 1;
            if pending[s] == 0 {
                let file = shards.file_name(s);
                progress(ImportProgress::Writing { file: file.clone(), index: s + 1, total: n_shards });
                let tensors = std::mem::take(&mut buffers[s]);
                written += tensors.len();
                mlx_core::io::save_safetensors(
                    dir.join(&file),
                    tensors.iter().map(|(n, a)| (n.as_str(), a)),
                    [("format", "mlx")],
                )?;
            }
        }
    }
    debug_assert!(pending.iter().all(|&p| p == 0));
    Ok(written)
}

fn bits_of(ty: blocks::GgmlType) -> i32 {
    use blocks::GgmlType as T;
    match ty {
        T::Q8_0 => 8,
        T::Q5_0 | T::Q5_1 | T::Q5_K => 5,
        _ => 4,
    }
}

fn torch_dtype(d: Dtype) -> &'static str {
    match d {
        Dtype::Float32 => "float32",
        Dtype::Float16 => "float16",
        _ => "bfloat16",
    }
}

/// The `quantization` block: the most common spec (ties: more bits) as default, other
/// specs per module, `false` for dense embedding/linear modules. `None` when nothing is
/// quantized.
fn quantization_block(items: &[Item]) -> Option<Value> {
    let spec = |it: &Item| match it.store {
        Store::Keep { bits } => Some((32, bits)),
        Store::Requant(s) => Some((s.group_size, s.bits)),
        Store::Dense => None,
    };
    let modules: Vec<&Item> = items.iter().filter(|it| !it.map.bias && it.map.kind != Kind::Norm).collect();
    let mut counts: BTreeMap<(i32, i32), usize> = BTreeMap::new();
    for it in &modules {
        if let Some(s) = spec(it) {
            *counts.entry(s).or_insert(0) += 1;
        }
    }
    let (&(gs, bits), _) = counts.iter().max_by_key(|((_, b), n)| (**n, *b))?;
    let mut q = serde_json::Map::new();
    q.insert("group_size".into(), json!(gs));
    q.insert("bits".into(), json!(bits));
    q.insert("mode".into(), json!("affine"));
    for it in modules {
        match spec(it) {
            Some(s) if s == (gs, bits) => {}
            Some((g, b)) => {
                q.insert(it.map.module.clone(), json!({"group_size": g, "bits": b, "mode": "affine"}));
            }
            None => {
                q.insert(it.map.module.clone(), json!(false));
            }
        }
    }
    Some(Value::Object(q))
}

/// Undoes llama.cpp's Q/K permutation on whole rows: `rows = n_head * head_dim`, each row
/// `row_len` elements; output row `h*hd + a*hd/2 + b` is input row `h*hd + 2b + a`.
fn unpermute_rows<T: Copy>(v: &[T], rows: usize, n_head: usize) -> Option<Vec<T>> {
    if n_head == 0
        || !rows.is_multiple_of(n_head)
        || !(rows / n_head).is_multiple_of(2)
        || !v.len().is_multiple_of(rows.max(1))
    {
        return None;
    }
    let (hd, len) = (rows / n_head, v.len() / rows);
    let mut out = Vec::with_capacity(v.len());
    for h in 0..n_head {
        for a in 0..2 {
            for b in 0..hd / 2 {
                let src = h * hd + 2 * b + a;
                out.extend_from_slice(&v[src * len..(src + 1) * len]);
            }
        }
    }
    Some(out)
}

fn shape_i32(path: &Path, name: &str, dims: &[usize]) -> Result<Vec<i32>> {
    dims.iter()
        .map(|&d| i32::try_from(d).map_err(|_| out_err(path, format!("tensor `{name}`: dimension {d} is too large"))))
        .collect()
}

/// Reads, decodes, un-permutes and stores one tensor: `(name, array)` pairs.
fn convert(g: &GgufFile, it: &Item, dtype: Dtype, scale_dtype: Dtype) -> Result<Vec<(String, Array)>> {
    let info = &it.info;
    let raw = g.read(info).map_err(reader_err)?;
    let (rows, cols) = it.rows_cols();
    let at = g.path_at(info.offset).to_path_buf();
    let bad = |m: String| out_err(&at, format!("tensor `{}` ({}): {m}", info.name, info.ty));
    let permute = |what: &str, n: usize| bad(format!("cannot undo the Q/K permutation of {what} with {n} heads"));
    let non_finite =
        || bad("holds NaN or Inf values (a corrupt file, or parts of a split file in the wrong order?)".into());
    let m = &it.map.module;
    match it.store {
        Store::Keep { .. } => {
            let a = blocks::to_affine(info.ty, &raw, rows, cols)
                .map_err(|e| bad(e.to_string()))?
                .expect("planned as affine");
            let (mut w, mut s, mut b) = (a.weight, a.scales, a.biases);
            if let Some(n) = it.map.unpermute_heads {
                w = unpermute_rows(&w, rows, n).ok_or_else(|| permute("the weight", n))?;
                s = unpermute_rows(&s, rows, n).ok_or_else(|| permute("the scales", n))?;
                b = unpermute_rows(&b, rows, n).ok_or_else(|| permute("the biases", n))?;
            }
            let wshape = shape_i32(&at, &info.name, &[rows, cols * a.bits as usize / 32])?;
            let gshape = shape_i32(&at, &info.name, &[rows, cols / a.group_size as usize])?;
            let to_array = |v: &[f32]| -> Result<Array> {
                if scale_dtype == Dtype::Float16 {
                    let h: Vec<f16> = v.iter().map(|&x| f16::from_f32(x)).collect();
                    if h.iter().any(|x| !x.is_finite()) {
                        return Err(non_finite());
                    }
                    Ok(Array::from_slice(&h, &gshape)?)
                } else {
                    if v.iter().any(|x| !x.is_finite()) {
                        return Err(non_finite());
                    }
                    Ok(Array::from_slice(v, &gshape)?)
                }
            };
            Ok(vec![
                (format!("{m}.biases"), to_array(&b)?),
                (format!("{m}.scales"), to_array(&s)?),
                (format!("{m}.weight"), Array::from_slice(&w, &wshape)?),
            ])
        }
        Store::Dense | Store::Requant(_) => {
            let mut v = blocks::dequantize(info.ty, &raw).map_err(|e| bad(e.to_string()))?;
            drop(raw);
            if v.iter().any(|x| !x.is_finite()) {
                return Err(non_finite());
            }
            if let Some(n) = it.map.unpermute_heads {
                v = unpermute_rows(&v, rows, n).ok_or_else(|| permute("the rows", n))?;
            }
            if it.map.shift != 0.0 {
                v.iter_mut().for_each(|x| *x -= it.map.shift);
            }
            let dims: Vec<usize> = info.shape.iter().map(|&d| d as usize).collect();
            let a = Array::from_slice(&v, &shape_i32(&at, &info.name, &dims)?)?;
            drop(v);
            let a = if dtype == Dtype::Float32 { a } else { a.astype(dtype)? };
            match it.store {
                Store::Requant(spec) => {
                    let q = quant::quantize(&a, spec)?;
                    mlx_core::eval(&[&q.weight, &q.scales, &q.biases])?;
                    Ok(vec![
                        (format!("{m}.biases"), q.biases),
                        (format!("{m}.scales"), q.scales),
                        (format!("{m}.weight"), q.weight),
                    ])
                }
                _ => {
                    a.eval()?;
                    Ok(vec![(it.map.name(), a)])
                }
            }
        }
    }
}

fn write_text(path: &Path, text: &str) -> Result<()> {
    std::fs::write(path, text).map_err(|e| Error::io(path, e))
}

/// JSON with 4-space indentation and a trailing newline (mlx-lm's `json.dump(indent=4)`).
fn write_json(path: &Path, v: &Value) -> Result<()> {
    Ok(mlx_core::io::model_dir::write_json(path, v)?)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unpermute_inverts_llama_cpp_permute() {
        // llama.cpp: w.reshape(n_head, 2, rows / n_head / 2, rest).swapaxes(1, 2).reshape(w.shape)
        let (n_head, hd, len) = (3usize, 4usize, 2usize);
        let rows = n_head * hd;
        let orig: Vec<usize> = (0..rows * len).collect();
        let mut permuted = vec![0; orig.len()];
        for h in 0..n_head {
            for i in 0..hd / 2 {
                for j in 0..2 {
                    // permuted[h, i, j] = orig[h, j, i] with dims (n_head, hd/2, 2) vs (n_head, 2, hd/2)
                    let dst = h * hd + i * 2 + j;
                    let src = h * hd + j * (hd / 2) + i;
                    permuted[dst * len..(dst + 1) * len].copy_from_slice(&orig[src * len..(src + 1) * len]);
                }
            }
        }
        assert_eq!(unpermute_rows(&permuted, rows, n_head).unwrap(), orig);
        assert!(unpermute_rows(&orig, rows, 5).is_none());
    }
}
