//! The generic MLX quantizer: turns a model directory (mlx-lm / Hugging Face layout,
//! safetensors weights) into an affine-quantized one in mlx-lm's own format, so that
//! mlx-lm, vllm-metal and this project's `models` crate all load it. A shape rule decides
//! which tensors are quantized ([`eligibility`]) and an optional predicate keeps chosen
//! modules in full precision; the drafter quantization policy is built on that hook.
//!
//! [`quantize_model_dir`] streams: it reads the safetensors headers, plans every output
//! tensor and shard up front, then holds one module in memory at a time (its source bytes,
//! the MLX array, the quantized triple), so peak memory is near the largest tensor plus its
//! output, not the model size. The output is written into a temporary directory beside the
//! destination and renamed into place only when complete.
//!
//! ```no_run
//! use quantize::{QuantizeOptions, quantize_model_dir};
//! # fn main() -> quantize::Result<()> {
//! let options = QuantizeOptions {
//!     bits: 4,
//!     group_size: 64,
//!     // keep the LM head in full precision
//!     predicate: Some(Box::new(|base: &str, _shape: &[usize]| base != "lm_head")),
//!     ..QuantizeOptions::default()
//! };
//! let r = quantize_model_dir("models/dense".as_ref(), "models/q4".as_ref(), &options, &mut |_| {})?;
//! println!("{} modules quantized, {:.3} bits per weight", r.quantized_modules.len(), r.bits_per_weight);
//! # Ok(())
//! # }
//! ```
mod config;
mod error;
mod plan;
mod st;

use std::path::{Path, PathBuf};
use std::time::Instant;

use mlx_core::io::model_dir::{self, ShardPlan};
use mlx_core::quant::{self, QuantSpec};
use mlx_core::{Array, Dtype};
use safetensors::Dtype as StDtype;
use serde_json::Value;

pub use config::SourceQuantization;
pub use error::{Error, Result};
pub use mlx_core::io::model_dir::StagedDir;
pub use plan::{Action, Eligibility, eligibility};

use plan::{Item, Source};
use st::{Planned, ShardFile, SourceFiles, TensorRef, mlx_dtype, st_dtype};

/// The largest weight file written before splitting into shards (mlx-lm's 5 GiB,
/// [`model_dir::MAX_SHARD_BYTES`]).
pub const DEFAULT_MAX_SHARD_BYTES: u64 = model_dir::MAX_SHARD_BYTES;

/// `predicate(base, shape)`: consulted for every shape-eligible module (`base` without
/// `.weight`, e.g. `model.layers.0.mlp.down_proj`; `shape` its logical `[out, in]`);
/// `false` keeps it in full precision and records `"<base>": false` in the config.
pub type Predicate = Box<dyn Fn(&str, &[usize]) -> bool>;

/// What [`quantize_model_dir`] does.
pub struct QuantizeOptions {
    /// Bits per weight: 2, 3, 4, 5, 6 or 8 (mlx_lm.convert's `--q-bits`, default 4).
    pub bits: i32,
    /// Weights per scale/bias group: 32, 64 or 128 (`--q-group-size`, default 64).
    pub group_size: i32,
    /// Quantization mode; only `affine` (`--q-mode`).
    pub mode: String,
    /// Keeps chosen eligible modules in full precision (see [`Predicate`]).
    pub predicate: Option<Predicate>,
    /// Replace an existing destination (only once the new one is complete).
    pub force: bool,
    /// Accept an already quantized source: each quantized module is dequantized with the
    /// source's own spec, then quantized with this one. `false` refuses such a source (the
    /// drafter policy does).
    pub allow_quantized_source: bool,
    /// Largest weight file in bytes before a new shard starts; a single larger tensor gets a
    /// shard of its own.
    pub max_shard_bytes: u64,
}

impl Default for QuantizeOptions {
    fn default() -> Self {
        Self {
            bits: 4,
            group_size: 64,
            mode: "affine".into(),
            predicate: None,
            force: false,
            allow_quantized_source: true,
            max_shard_bytes: DEFAULT_MAX_SHARD_BYTES,
        }
    }
}

impl std::fmt::Debug for QuantizeOptions {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("QuantizeOptions")
            .field("bits", &self.bits)
            .field("group_size", &self.group_size)
            .field("mode", &self.mode)
            .field("predicate", &self.predicate.as_ref().map(|_| "Fn(&str, &[usize]) -> bool"))
            .field("force", &self.force)
            .field("allow_quantized_source", &self.allow_quantized_source)
            .field("max_shard_bytes", &self.max_shard_bytes)
            .finish()
    }
}

impl QuantizeOptions {
    /// The validated spec.
    ///
    /// # Errors
    /// [`Error::Options`] for a mode other than `affine` or bits / group size MLX's affine
    /// quantization refuses (the message lists the accepted values).
    pub fn spec(&self) -> Result<QuantSpec> {
        if self.mode != "affine" {
            return Err(Error::Options(format!("quantization mode `{}` is not supported (only affine)", self.mode)));
        }
        QuantSpec::new(self.group_size, self.bits).map_err(|e| Error::Options(e.to_string()))
    }
}

/// A progress event of [`quantize_model_dir`], in this order: one `Loading`, one
/// `Quantizing` per module or pass-through tensor, `Writing` for each file finished, one
/// `Done`.
#[derive(Debug, Clone, PartialEq)]
#[non_exhaustive]
pub enum Progress {
    /// The headers have been read.
    Loading {
        /// Weight files in the source.
        files: usize,
        /// Tensors in them.
        tensors: usize,
        /// Their total data size in bytes.
        bytes: u64,
    },
    /// Converting item `index` (1-based) of `total`.
    Quantizing {
        /// 1-based position.
        index: usize,
        /// Number of items (modules plus pass-through tensors).
        total: usize,
        /// Module base (`model.layers.0.self_attn.q_proj`) or tensor name.
        name: String,
        /// What is done to it.
        action: Action,
    },
    /// A file of the output is complete (shards, index, config, copied files).
    Writing {
        /// File name inside the output directory.
        file: String,
    },
    /// The output directory is in place.
    Done {
        /// The output directory.
        out_dir: PathBuf,
        /// Wall time in seconds.
        seconds: f64,
    },
}

/// What [`quantize_model_dir`] wrote.
#[derive(Debug, Clone, PartialEq)]
pub struct QuantizeResult {
    /// The output directory.
    pub out_dir: PathBuf,
    /// The spec used.
    pub spec: QuantSpec,
    /// Modules written quantized (bases, sorted).
    pub quantized_modules: Vec<String>,
    /// Eligible modules the predicate kept in full precision (`false` entries).
    pub full_precision_modules: Vec<String>,
    /// Modules of an already quantized source that were dequantized and requantized (a
    /// subset of `quantized_modules`, or written dense when not eligible).
    pub requantized_modules: usize,
    /// Tensors copied unchanged (norms, biases, ineligible weights).
    pub passed_through: usize,
    /// Weight files written, in order.
    pub weight_files: Vec<String>,
    /// Bytes of tensor data written (headers excluded).
    pub weight_bytes: u64,
    /// Logical parameter count: a packed weight counts its unpacked elements, scales and
    /// biases of quantized modules count nothing (mlx-lm's `get_total_parameters`).
    pub total_parameters: u64,
    /// `weight_bytes * 8 / total_parameters`, what `mlx_lm.convert` prints.
    pub bits_per_weight: f64,
    /// Bits per weight over the quantized modules only (4.5 for 4-bit, group 64, bf16 scales).
    pub quantized_bits_per_weight: f64,
    /// Non-weight files copied from the source (tokenizer, chat template, generation config).
    pub copied_files: Vec<String>,
    /// Wall time in seconds.
    pub seconds: f64,
}

/// Quantizes the model directory `src` into `dst`.
///
/// `src` holds `config.json` and safetensors weights (`model.safetensors.index.json`'s
/// shards, else the `model*.safetensors` files: [`mlx_core::io::model_dir::weight_files`]).
/// Every tensor named `<base>.weight` that is 2-D
/// with its last dimension divisible by the group size ([`eligibility`]) and that the
/// predicate accepts is quantized with `mlx.core.quantize`'s affine mode into
/// `<base>.weight` (uint32 `[out, in * bits / 32]`), `<base>.scales` and `<base>.biases`
/// (`[out, in / group_size]`, the weight's float dtype); every other tensor is copied byte
/// for byte. A source module that is already quantized (`<base>.scales` present) is
/// dequantized with the source config's spec first, then treated like a dense one (refused
/// when `allow_quantized_source` is off).
///
/// Writes into `dst`: `model.safetensors`, or `model-0000i-of-0000N.safetensors` shards of
/// at most `max_shard_bytes` (mlx-lm's `make_shards` rule) plus
/// `model.safetensors.index.json`, metadata
/// `{"format": "mlx"}`; `config.json` = the source config with `quantization` and
/// `quantization_config` (group size, bits, mode, an entry per quantized module, `false`
/// per predicate-excluded module); the tokenizer, chat template, generation config and
/// `*.py` files of `src`. `progress` receives [`Progress`] events. The output is written
/// into a [`StagedDir`] beside `dst` and renamed into place when complete
/// ([`quantize_to_staging`] stops before that rename).
///
/// # Errors
/// [`Error::Options`] for unsupported bits / group size / mode or a refused quantized source;
/// [`Error::Destination`] when `dst` exists (without `force`), is `src`, or cannot be created;
/// [`Error::Config`] for a missing or malformed `config.json` or index; [`Error::Safetensors`]
/// for a malformed weight file; [`Error::Tensor`] for a tensor that cannot be converted (an
/// unsupported dtype, an inconsistent quantized module); [`Error::Mlx`] when MLX fails on a
/// tensor; [`Error::Io`] for file system failures. On any error nothing is left at `dst` (an
/// existing one replaced with `force` is kept) and no temporary directory remains.
pub fn quantize_model_dir(
    src: &Path,
    dst: &Path,
    options: &QuantizeOptions,
    progress: &mut dyn FnMut(Progress),
) -> Result<QuantizeResult> {
    let t0 = Instant::now();
    let (staged, mut result) = quantize_to_staging(src, dst, options, progress)?;
    staged.commit(options.force).map_err(destination_err)?;
    result.seconds = t0.elapsed().as_secs_f64();
    progress(Progress::Done { out_dir: dst.into(), seconds: result.seconds });
    Ok(result)
}

/// [`quantize_model_dir`] up to, not including, the rename into place: returns the complete
/// staging directory (to check before [`StagedDir::commit`], as `quantize-drafter` does)
/// and the report, whose `out_dir` is `dst`. No `Done` event is sent. Dropping the
/// [`StagedDir`] removes it.
///
/// # Errors
/// As [`quantize_model_dir`].
pub fn quantize_to_staging(
    src: &Path,
    dst: &Path,
    options: &QuantizeOptions,
    progress: &mut dyn FnMut(Progress),
) -> Result<(StagedDir, QuantizeResult)> {
    let t0 = Instant::now();
    let spec = options.spec()?;
    check_destination(src, dst, options.force)?;

    // Source: config, weight files, headers.
    let config_path = src.join("config.json");
    let source_config = read_config(src, &config_path)?;
    let source_quant = SourceQuantization::from_config(&Value::Object(source_config.clone()), &config_path)?;
    let paths = weight_files(src)?;
    let mut files = SourceFiles::open(&paths)?;
    let source_bytes: u64 = files.tensors.values().map(|t| t.len).sum();
    progress(Progress::Loading { files: paths.len(), tensors: files.tensors.len(), bytes: source_bytes });

    let predicate = options.predicate.as_deref().map(|p| p as &dyn Fn(&str, &[usize]) -> bool);
    let items = plan::plan(&files.tensors, &paths, &config_path, &source_quant, spec, predicate)?;
    let requantized = items
        .iter()
        .filter(|it| matches!(it, Item::Module { source, .. } if matches!(**source, Source::Quantized { .. })))
        .count();
    if requantized > 0 && !options.allow_quantized_source {
        return Err(Error::Options(format!(
            "{} is already quantized ({requantized} quantized modules); quantize a full-precision checkpoint instead",
            src.display()
        )));
    }

    // Output plan: every tensor, sorted by name, in mlx-lm's shards.
    let mut outputs: Vec<Planned> = items.iter().flat_map(|it| outputs_of(it, spec)).collect();
    outputs.sort_by(|a, b| a.name.cmp(&b.name));
    let shards = ShardPlan::new(outputs.iter().map(|p| (p.name.as_str(), p.nbytes())), options.max_shard_bytes);
    if shards.is_empty() {
        return Err(Error::Config { path: src.into(), message: "the weight files hold no tensors".into() });
    }

    let staged = StagedDir::create(dst, "quantizing").map_err(destination_err)?;
    let total_parameters = total_parameters(&items);
    let mut write = |dir: &Path| -> Result<(Tally, Vec<String>)> {
        let tally = write_shards(&mut files, &items, spec, &outputs, &shards, dir, progress)?;
        // Index, config, copied files.
        if shards.len() > 1 {
            shards.write_index(dir, total_parameters).map_err(Error::file)?;
            progress(Progress::Writing { file: model_dir::INDEX_FILE.into() });
        }
        let block = config::quantization_block(spec, &tally.quantized, &tally.full_precision);
        config::write_json(&dir.join("config.json"), &config::output_config(&source_config, block))?;
        progress(Progress::Writing { file: "config.json".into() });
        let copied_files = model_dir::copy_aux_files(src, dir).map_err(Error::file)?;
        for f in &copied_files {
            progress(Progress::Writing { file: f.clone() });
        }
        Ok((tally, copied_files))
    };
    // Errors name the destination's files, not the staging directory's.
    let (tally, copied_files) = write(staged.path()).map_err(|e| e.with_paths(&|p| staged.shown(p)))?;
    drop(files);
    let weight_bytes = shards.total_bytes();

    let (q_bits, q_params) = quantized_bits_and_params(&items, spec);
    let result = QuantizeResult {
        out_dir: dst.into(),
        spec,
        quantized_modules: tally.quantized,
        full_precision_modules: tally.full_precision,
        requantized_modules: requantized,
        passed_through: tally.passed_through,
        weight_files: shards.file_names(),
        weight_bytes,
        total_parameters,
        bits_per_weight: if total_parameters > 0 { weight_bytes as f64 * 8.0 / total_parameters as f64 } else { 0.0 },
        quantized_bits_per_weight: if q_params > 0.0 { q_bits / q_params } else { 0.0 },
        copied_files,
        seconds: t0.elapsed().as_secs_f64(),
    };
    Ok((staged, result))
}

/// What [`write_shards`] converted, by kind (module lists sorted).
struct Tally {
    quantized: Vec<String>,
    full_precision: Vec<String>,
    passed_through: usize,
}

/// Creates every shard file of `shards` in `dir` (headers from `outputs`), converts the
/// items one at a time into their places and closes each shard as it completes.
fn write_shards(
    files: &mut SourceFiles,
    items: &[Item],
    spec: QuantSpec,
    outputs: &[Planned],
    shards: &ShardPlan,
    dir: &Path,
    progress: &mut dyn FnMut(Progress),
) -> Result<Tally> {
    let mut planned: Vec<Vec<Planned>> = vec![Vec::new(); shards.len()];
    for p in outputs {
        planned[shards.shard_of(&p.name).expect("planned")].push(p.clone());
    }
    let mut writers: Vec<Option<ShardFile>> = Vec::with_capacity(shards.len());
    for (i, planned) in planned.iter().enumerate() {
        writers.push(Some(ShardFile::create(&dir.join(shards.file_name(i)), planned, &[("format", "mlx")])?));
    }
    let mut pending: Vec<usize> = planned.iter().map(Vec::len).collect();

    let total = items.len();
    let mut tally = Tally { quantized: Vec::new(), full_precision: Vec::new(), passed_through: 0 };
    for (k, it) in items.iter().enumerate() {
        progress(Progress::Quantizing { index: k + 1, total, name: it.label().into(), action: it.action() });
        let written = convert(files, it, spec, shards, &mut writers)?;
        match it {
            Item::Pass(_) => tally.passed_through += 1,
            Item::Module { base, action: Action::Quantize, .. } => tally.quantized.push(base.clone()),
            Item::Module { base, action: Action::FullPrecision, .. } => tally.full_precision.push(base.clone()),
            Item::Module { .. } => {}
        }
        for name in written {
            let s = shards.shard_of(&name).expect("planned");
            pending[s] -= 1;
            if pending[s] == 0 {
                writers[s].take().expect("finished once").finish()?;
                progress(Progress::Writing { file: shards.file_name(s) });
            }
        }
        mlx_core::memory::clear_cache();
    }
    tally.quantized.sort();
    tally.full_precision.sort();
    Ok(tally)
}

/// Output bits and logical parameters of the quantized modules.
fn quantized_bits_and_params(items: &[Item], spec: QuantSpec) -> (f64, f64) {
    let q_bits: f64 = items
        .iter()
        .filter(|it| it.action() == Action::Quantize)
        .flat_map(|it| outputs_of(it, spec))
        .map(|p| p.nbytes() as f64 * 8.0)
        .sum();
    let q_params: f64 = items
        .iter()
        .filter_map(|it| match it {
            Item::Module { shape, action: Action::Quantize, .. } => Some(shape.iter().product::<usize>() as f64),
            _ => None,
        })
        .sum();
    (q_bits, q_params)
}

/// A staging / rename failure of [`model_dir`] as an [`Error::Destination`].
fn destination_err(e: mlx_core::Error) -> Error {
    match e {
        mlx_core::Error::File { path, message } => Error::Destination { path, message },
        other => Error::Destination { path: PathBuf::new(), message: other.to_string() },
    }
}

/// Refuses a destination that is, holds or lies inside the source, and an existing one
/// unless `force` (and then only a model directory or an empty one).
fn check_destination(src: &Path, dst: &Path, force: bool) -> Result<()> {
    model_dir::check_apart(src, dst).map_err(destination_err)?;
    if std::fs::symlink_metadata(dst).is_ok() {
        if !force {
            let message = "already exists; pass --force to replace it".into();
            return Err(Error::Destination { path: dst.into(), message });
        }
        model_dir::check_replaceable(dst).map_err(destination_err)?;
    }
    Ok(())
}

fn read_config(src: &Path, path: &Path) -> Result<serde_json::Map<String, Value>> {
    if !src.is_dir() {
        let why = if src.exists() { "not a directory" } else { "no such directory" };
        return Err(Error::Config { path: src.into(), message: format!("not a model directory ({why})") });
    }
    let text = std::fs::read_to_string(path).map_err(|e| Error::Config {
        path: path.into(),
        message: format!("cannot read the model config ({e}); a model directory needs config.json"),
    })?;
    match serde_json::from_str(&text) {
        Ok(Value::Object(m)) => Ok(m),
        Ok(other) => {
            Err(Error::Config { path: path.into(), message: format!("expected a JSON object, found {other}") })
        }
        Err(e) => Err(Error::Config { path: path.into(), message: format!("not valid JSON: {e}") }),
    }
}

/// The weight files of `src` ([`model_dir::weight_files`]: the index's shards, else
/// `model*.safetensors`), problems reported as [`Error::Config`].
fn weight_files(src: &Path) -> Result<Vec<PathBuf>> {
    model_dir::weight_files(src).map_err(|e| match e {
        mlx_core::Error::File { path, message } => Error::Config { path, message },
        other => Error::Config { path: src.into(), message: other.to_string() },
    })
}

/// The tensors an item writes, with their dtypes and shapes.
fn outputs_of(it: &Item, spec: QuantSpec) -> Vec<Planned> {
    match it {
        Item::Pass(t) => vec![Planned { name: t.name.clone(), dtype: t.dtype, shape: t.shape.clone() }],
        Item::Module { base, source, shape, action } => {
            let float = match source.as_ref() {
                Source::Dense(t) => t.dtype,
                Source::Quantized { scales, .. } => scales.dtype,
            };
            if *action != Action::Quantize {
                return vec![Planned { name: format!("{base}.weight"), dtype: float, shape: shape.clone() }];
            }
            let (rows, cols) = (shape[0], shape[1]);
            let groups = vec![rows, cols / spec.group_size as usize];
            vec![
                Planned { name: format!("{base}.biases"), dtype: float, shape: groups.clone() },
                Planned { name: format!("{base}.scales"), dtype: float, shape: groups },
                Planned {
                    name: format!("{base}.weight"),
                    dtype: StDtype::U32,
                    shape: vec![rows, cols * spec.bits as usize / 32],
                },
            ]
        }
    }
}

/// mlx-lm's `get_total_parameters` over the output.
fn total_parameters(items: &[Item]) -> u64 {
    items
        .iter()
        .map(|it| match it {
            Item::Pass(t) => t.shape.iter().map(|&d| d as u64).product::<u64>(),
            Item::Module { shape, .. } => shape.iter().map(|&d| d as u64).product::<u64>(),
        })
        .sum()
}

fn shape_i32(paths: &[PathBuf], t: &TensorRef, shape: &[usize]) -> Result<Vec<i32>> {
    shape
        .iter()
        .map(|&d| {
            i32::try_from(d).map_err(|_| Error::Tensor {
                path: paths[t.file].clone(),
                tensor: t.name.clone(),
                message: format!("dimension {d} of shape {shape:?} is too large for MLX"),
            })
        })
        .collect()
}

fn load(files: &mut SourceFiles, t: &TensorRef) -> Result<Array> {
    let bytes = files.read(t)?;
    let dtype: Dtype = mlx_dtype(t.dtype).expect("planned tensors have MLX dtypes");
    let shape = shape_i32(&files.paths, t, &t.shape)?;
    Array::from_bytes(&bytes, &shape, dtype).map_err(|e| mlx_err(files, t, e))
}

fn mlx_err(files: &SourceFiles, t: &TensorRef, source: mlx_core::Error) -> Error {
    Error::Mlx { path: files.paths[t.file].clone(), tensor: t.name.clone(), source }
}

/// Converts one item and writes its outputs; returns the names written.
fn convert(
    files: &mut SourceFiles,
    it: &Item,
    spec: QuantSpec,
    shards: &ShardPlan,
    writers: &mut [Option<ShardFile>],
) -> Result<Vec<String>> {
    match it {
        Item::Pass(t) => {
            let w = writer(writers, shards, &t.name);
            let off = w.offset_of(&t.name).expect("planned");
            files.copy_to(t, w, off)?;
            w.mark(&t.name);
            Ok(vec![t.name.clone()])
        }
        Item::Module { base, source, action, .. } => {
            let wname = format!("{base}.weight");
            // The full-precision matrix (dense source: no MLX round trip when only copied).
            let (dense, first) = match source.as_ref() {
                Source::Dense(t) if *action != Action::Quantize => {
                    let w = writer(writers, shards, &wname);
                    let off = w.offset_of(&wname).expect("planned");
                    files.copy_to(t, w, off)?;
                    w.mark(&wname);
                    return Ok(vec![wname]);
                }
                Source::Dense(t) => (load(files, t)?, t),
                Source::Quantized { weight, scales, biases, spec: src_spec } => {
                    let (w, s, b) = (load(files, weight)?, load(files, scales)?, load(files, biases)?);
                    let d = quant::dequantize(&w, &s, &b, *src_spec).map_err(|e| mlx_err(files, weight, e))?;
                    (d, weight)
                }
            };
            let to_bytes = |a: &Array| a.to_bytes().map_err(|e| mlx_err(files, first, e));
            if *action != Action::Quantize {
                let bytes = to_bytes(&dense)?;
                writer(writers, shards, &wname).write_tensor(&wname, &bytes)?;
                return Ok(vec![wname]);
            }
            let q = quant::quantize(&dense, spec).map_err(|e| mlx_err(files, first, e))?;
            mlx_core::eval(&[&q.weight, &q.scales, &q.biases]).map_err(|e| mlx_err(files, first, e))?;
            drop(dense);
            let mut names = Vec::with_capacity(3);
            for (suffix, a) in [("biases", &q.biases), ("scales", &q.scales), ("weight", &q.weight)] {
                let name = format!("{base}.{suffix}");
                if st_dtype(a.dtype()) != planned_dtype(suffix, first, source) {
                    return Err(Error::Tensor {
                        path: files.paths[first.file].clone(),
                        tensor: name,
                        message: format!("MLX produced {:?}, planned otherwise", a.dtype()),
                    });
                }
                let bytes = to_bytes(a)?;
                writer(writers, shards, &name).write_tensor(&name, &bytes)?;
                names.push(name);
            }
            Ok(names)
        }
    }
}

fn writer<'a>(writers: &'a mut [Option<ShardFile>], shards: &ShardPlan, name: &str) -> &'a mut ShardFile {
    writers[shards.shard_of(name).expect("planned")]
        .as_mut()
        .expect("a shard stays open until all its tensors are written")
}

fn planned_dtype(suffix: &str, first: &TensorRef, source: &Source) -> StDtype {
    match (suffix, source) {
        ("weight", _) => StDtype::U32,
        (_, Source::Quantized { scales, .. }) => scales.dtype,
        _ => first.dtype,
    }
}
