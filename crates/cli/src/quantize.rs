//! `mlx-spec quantize`: affine-quantizes a model directory with the generic quantizer
//! (crate `quantize`), with `mlx_lm.convert`'s flag names; `mlx-spec quantize-drafter`:
//! the same for DeepSpec drafter checkpoints under the drafter policy
//! ([`drafter::quant::quantize_drafter_dir`]).
use std::path::PathBuf;

use anyhow::{Context, Result, bail};
use clap::Args;
use indicatif::ProgressBar;
use quantize::{Action, Progress, QuantizeOptions, QuantizeResult, quantize_model_dir};

/// Arguments of `mlx-spec quantize` (`mlx_lm.convert -q` names; `--model`/`--out` also work).
#[derive(Args)]
pub struct QuantizeArgs {
    /// Source model directory (config.json + safetensors), dense or already quantized.
    #[arg(long = "hf-path", visible_alias = "model", value_name = "SRC")]
    hf_path: PathBuf,
    /// Destination directory; must not exist unless --force.
    #[arg(long = "mlx-path", visible_alias = "out", value_name = "DST")]
    mlx_path: PathBuf,
    /// Quantize (accepted for mlx_lm.convert compatibility; this command always quantizes).
    #[arg(short = 'q', long)]
    quantize: bool,
    /// Bits per weight: 2, 3, 4, 5, 6 or 8.
    #[arg(long, default_value_t = 4)]
    q_bits: i32,
    /// Weights per scale/bias group: 32, 64 or 128.
    #[arg(long, default_value_t = 64)]
    q_group_size: i32,
    /// Quantization mode (only `affine`).
    #[arg(long, default_value = "affine")]
    q_mode: String,
    /// Replace an existing destination (once the new one is complete).
    #[arg(long)]
    force: bool,
}

/// Runs the command: a progress bar on stderr, a summary line at the end.
pub fn run(a: QuantizeArgs) -> Result<()> {
    let _ = a.quantize;
    // The mirror of quantize-drafter refusing a model: a drafter quantized as a model would
    // have its confidence head quantized too.
    if drafter::DrafterConfig::from_dir(&a.hf_path).is_ok() {
        bail!(
            "{} is a DeepSpec drafter: quantize it with `mlx-spec quantize-drafter --src {0} --out DST`, which \
             keeps its confidence head dense and checks that it loads",
            a.hf_path.display()
        );
    }
    let options = QuantizeOptions {
        bits: a.q_bits,
        group_size: a.q_group_size,
        mode: a.q_mode.clone(),
        force: a.force,
        ..QuantizeOptions::default()
    };
    let (bar, mut cb) = progress_bar();
    let r = quantize_model_dir(&a.hf_path, &a.mlx_path, &options, &mut cb)
        .with_context(|| format!("quantizing {} into {}", a.hf_path.display(), a.mlx_path.display()))?;
    bar.finish_and_clear();
    summary(&r);
    Ok(())
}

/// Arguments of `mlx-spec quantize-drafter`.
#[derive(Args)]
pub struct QuantizeDrafterArgs {
    /// DeepSpec drafter checkpoint (bf16; `architectures[0]` `Qwen3DSparkModel` or
    /// `Gemma4DSparkModel`).
    #[arg(long, visible_alias = "model", value_name = "SRC")]
    src: PathBuf,
    /// Destination directory; must not exist unless --force.
    #[arg(long, visible_alias = "mlx-path", value_name = "DST")]
    out: PathBuf,
    /// Bits per weight: 4 or 8.
    #[arg(long, default_value_t = 4)]
    bits: i32,
    /// Weights per scale/bias group: 32 or 64.
    #[arg(long, default_value_t = 64)]
    group_size: i32,
    /// Replace an existing destination (once the new one is complete and loads).
    #[arg(long)]
    force: bool,
}

/// Runs `quantize-drafter`: a progress bar, then the summary and the load smoke's result.
pub fn run_drafter(a: QuantizeDrafterArgs) -> Result<()> {
    let (bar, mut cb) = progress_bar();
    let r = drafter::quant::quantize_drafter_dir(&a.src, &a.out, a.bits, a.group_size, a.force, &mut cb)
        .with_context(|| format!("quantizing drafter {} into {}", a.src.display(), a.out.display()))?;
    bar.finish_and_clear();
    summary(&r.quantize);
    eprintln!(
        "load smoke: context projection of a zero row -> {:?}; {} modules load quantized",
        r.smoke.projection_shape,
        r.smoke.quantized_modules.len()
    );
    Ok(())
}

/// A progress bar on stderr fed by the quantizer's events.
fn progress_bar() -> (ProgressBar, impl FnMut(Progress)) {
    let bar = crate::progress::styled_bar(0, 48, "{elapsed}");
    let b = bar.clone();
    let cb = move |p: Progress| match p {
        Progress::Loading { files, tensors, bytes } => {
            b.set_message(format!("loading: {tensors} tensors in {files} file(s), {} MB", bytes >> 20))
        }
        Progress::Quantizing { index, total, name, action } => {
            b.set_length(total as u64);
            b.set_position(index as u64);
            let verb = match action {
                Action::Quantize => "quantizing",
                Action::FullPrecision => "keeping",
                _ => "copying",
            };
            b.set_message(format!("{verb} {name}"));
        }
        Progress::Writing { file } => b.set_message(format!("writing {file}")),
        Progress::Done { .. } => b.finish_with_message("done"),
        _ => {}
    };
    (bar, cb)
}

/// The one-line summary of a quantizer run.
fn summary(r: &QuantizeResult) {
    eprintln!(
        "{}: {} modules quantized ({}-bit, group {}), {} kept in full precision, {} tensors copied; \
         {:.3} bits per weight ({:.3} over quantized modules); {:.1} MB in {} file(s), {:.1} s",
        r.out_dir.display(),
        r.quantized_modules.len(),
        r.spec.bits,
        r.spec.group_size,
        r.full_precision_modules.len(),
        r.passed_through,
        r.bits_per_weight,
        r.quantized_bits_per_weight,
        r.weight_bytes as f64 / 1e6,
        r.weight_files.len(),
        r.seconds
    );
}
