//! `mlx-spec quantize`: affine-quantizes a model directory with the generic quantizer
//! (crate `quantize`), with `mlx_lm.convert`'s flag names.
use std::path::PathBuf;

use anyhow::{Context, Result};
use clap::Args;
use indicatif::{ProgressBar, ProgressStyle};
use quantize::{Action, Progress, QuantizeOptions, quantize_model_dir};

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
    let options = QuantizeOptions {
        bits: a.q_bits,
        group_size: a.q_group_size,
        mode: a.q_mode.clone(),
        force: a.force,
        ..QuantizeOptions::default()
    };
    let bar = ProgressBar::new(0);
    bar.set_style(
        ProgressStyle::with_template("{spinner} {msg:48!} [{bar:30}] {pos}/{len} {elapsed}")
            .expect("valid template")
            .progress_chars("=> "),
    );
    let b = bar.clone();
    let mut cb = move |p: Progress| match p {
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
    let r = quantize_model_dir(&a.hf_path, &a.mlx_path, &options, &mut cb)
        .with_context(|| format!("quantizing {} into {}", a.hf_path.display(), a.mlx_path.display()))?;
    bar.finish_and_clear();
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
    Ok(())
}
