//! `mlx-spec train-drafter`: trains a DSpark drafter for a target on this machine, by
//! self-distillation (crate `train`): the target answers a prompt set, a new drafter learns
//! its answers and hidden states with DeepSpec's objective, and the result is a DeepSpec
//! checkpoint that `generate --draft-model` and `quantize-drafter` take.
//!
//! Everything a resume needs lives in the work directory (`--work-dir`, default `OUT.work`):
//! the samples generated so far, the optimizer state and the loss log; running the same
//! command again continues where it stopped.
use std::fs::OpenOptions;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use clap::Args;
use mlx_core::io::model_dir::{write_atomic, write_json};
use models::tokenizer::Tokenizer;
use models::{ModelConfig, load_model};
use spec::prompts::{Prompt, load_prompts};
use spec::providers::{DraftTarget, DrafterSpec, SuffixSpec};
use train::calibrate::calibrate;
use train::distill::{Answering, Sample, TeacherStates, append_sample, generate_samples, read_samples, teacher_states};
use train::init::{DrafterShape, Init, check_shape, drafter_config, frequent_tokens, new_drafter_weights};
use train::run::{Run, RunSettings};

use crate::progress::styled_bar;

/// The default prompt set (`fixtures/prompts/train.jsonl`: 1,000 prompts from DeepSpec's
/// eval sets, chat, math and code, none of those `cargo xtask bench spec` evaluates on).
const DEFAULT_PROMPTS: &str = include_str!("../../../fixtures/prompts/train.jsonl");

/// Arguments of `mlx-spec train-drafter`.
#[derive(Args)]
pub struct TrainDrafterArgs {
    /// The target model directory (mlx-lm layout, llama / qwen2 / qwen3 families) [default: the
    /// default model, SmolLM2-135M-Instruct 4-bit, fetched on first use].
    #[arg(long, visible_alias = "model")]
    target: Option<PathBuf>,
    /// Where the drafter checkpoint goes (DeepSpec format: config.json, bf16 model.safetensors,
    /// plus training.json and loss_curve.png); rewritten at every checkpoint.
    #[arg(long)]
    out: PathBuf,
    /// The run's working directory (samples, optimizer state, loss log) [default: OUT.work].
    #[arg(long)]
    work_dir: Option<PathBuf>,
    /// Prompt set, JSON Lines `{"prompt": "..."}` (`spec::prompts` format) [default: the
    /// built-in set of 1,000 chat, math and code prompts].
    #[arg(long)]
    prompts: Option<PathBuf>,
    /// Prompts the target answers for training (the first ones of the set that are not held
    /// out).
    #[arg(long, default_value_t = 300)]
    num_prompts: usize,
    /// Prompts kept out of training for the held-out evaluation: the last ones of each domain
    /// (the source before `:`), one domain after the other, the same whatever --num-prompts.
    #[arg(long, default_value_t = 16)]
    held_out: usize,
    /// Longest answer the target writes per prompt, tokens.
    #[arg(long, default_value_t = 256)]
    max_new_tokens: usize,
    /// Prompts the target answers at once (continuous batching with the default suffix
    /// drafter; every answer is still plain greedy decoding's). 1: one after the other.
    #[arg(long, default_value_t = 8)]
    max_batch: usize,
    /// Optimizer steps (one sequence each).
    #[arg(long, default_value_t = 2000)]
    steps: u64,
    /// Peak learning rate (warm-up over 4% of the steps, then cosine decay).
    #[arg(long, default_value_t = 1e-3)]
    lr: f64,
    /// Blocks trained per sequence.
    #[arg(long, default_value_t = 64)]
    num_anchors: usize,
    /// Draft layers.
    #[arg(long, default_value_t = 1)]
    layers: usize,
    /// Drafts per block (γ).
    #[arg(long, default_value_t = 7)]
    block_size: usize,
    /// Markov head rank.
    #[arg(long, default_value_t = 64)]
    markov_rank: usize,
    /// Draft from the K most frequent answer tokens only (EAGLE-3's reduced draft vocabulary;
    /// 0 = the whole vocabulary) [default: 8192 for vocabularies over 16,384 tokens, else 0].
    #[arg(long)]
    draft_vocab_size: Option<usize>,
    /// Tapped target layers, comma-separated [default: up to 5 spread from layer 1 to L-3].
    #[arg(long, value_delimiter = ',')]
    tap_layers: Option<Vec<i64>>,
    /// The block filler token [default: the highest special token of the tokenizer that the
    /// chat template does not use and that is neither BOS nor EOS].
    #[arg(long)]
    mask_token_id: Option<u32>,
    /// How the drafter's layers start: `target` (draft layer j copies the target's layer
    /// L - L_d + j, fc passes the last tap through; `train::init::Init`) or `random`
    /// (DeepSpec's initialisation). Only a fresh run uses it; a resume must name the same.
    #[arg(long, default_value = "target")]
    init: Init,
    /// Weight of the cross entropy against the target's own (greedy) tokens in the objective
    /// (DeepSpec's `ce_loss_alpha`).
    #[arg(long, default_value_t = 0.1)]
    ce_loss_alpha: f32,
    /// Weight of the L1 distance to the target's next-token distribution in the objective
    /// (DeepSpec's `l1_loss_alpha`; the confidence head's weight stays 1).
    #[arg(long, default_value_t = 0.9)]
    l1_loss_alpha: f32,
    /// Seed of the initial weights, the sample order and the anchors.
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Checkpoint every this many steps.
    #[arg(long, default_value_t = 200)]
    checkpoint_every: u64,
    /// Stop (with a checkpoint) after this many minutes in all, data generation included.
    #[arg(long)]
    time_limit_minutes: Option<f64>,
}

/// Runs the command.
pub fn run(a: TrainDrafterArgs) -> Result<()> {
    let started = Instant::now();
    let deadline = a.time_limit_minutes.map(|m| started + Duration::from_secs_f64(m * 60.0));
    let work = a.work_dir.clone().unwrap_or_else(|| {
        let mut name = a.out.file_name().map(|n| n.to_os_string()).unwrap_or_default();
        name.push(".work");
        a.out.with_file_name(name)
    });
    if a.steps == 0 || a.checkpoint_every == 0 || a.num_prompts == 0 || a.max_batch == 0 {
        bail!("--steps, --checkpoint-every, --num-prompts and --max-batch must be positive");
    }

    let target_dir = crate::drafting::target_dir(a.target.as_deref(), "--target")?;
    let config = ModelConfig::from_dir(&target_dir).with_context(|| format!("reading {}", target_dir.display()))?;
    let tok = Tokenizer::from_dir(&target_dir)
        .with_context(|| format!("loading the tokenizer of {}", target_dir.display()))?;
    let options = crate::load_options("float32", None)?;
    let target = load_model(&target_dir, &options).with_context(|| format!("loading {}", target_dir.display()))?;
    if !matches!(target.family, models::Family::Llama | models::Family::Qwen2 | models::Family::Qwen3) {
        bail!(
            "{}: train-drafter trains drafters for llama, qwen2 and qwen3 targets (this is {:?})",
            target_dir.display(),
            target.family
        );
    }
    let mask = match a.mask_token_id {
        Some(m) => m,
        None => default_mask_token(&tok, &config)?,
    };
    let mut shape = DrafterShape {
        layers: a.layers,
        block_size: a.block_size,
        markov_rank: a.markov_rank,
        ..DrafterShape::for_target(&config, mask)
    };
    if let Some(taps) = &a.tap_layers {
        shape.tap_layers = taps.clone();
    }
    check_shape(&config, &shape)?;

    // 1. Data: the target's answers (appended to the work directory as they come).
    let prompts = match &a.prompts {
        Some(p) => load_prompts(p)?,
        None => DEFAULT_PROMPTS
            .lines()
            .filter(|l| !l.trim().is_empty())
            .map(|l| serde_json::from_str::<Prompt>(l).context("the built-in prompt set"))
            .collect::<Result<_>>()?,
    };
    let sources: Vec<&str> = prompts.iter().map(|p| p.source.as_str()).collect();
    let split = spec::prompts::split(&sources, a.num_prompts, a.held_out)
        .with_context(|| format!("--num-prompts {} + --held-out {}", a.num_prompts, a.held_out))?;
    let eos = tok.eos_ids().to_vec();
    let encode = |i: &usize| prompts[*i].ids(&tok).map(|ids| (prompts[*i].source.clone(), ids));
    let train_prompts = split.train.iter().map(encode).collect::<spec::Result<Vec<_>>>()?;
    let held_prompts = split.held_out.iter().map(encode).collect::<spec::Result<Vec<_>>>()?;
    std::fs::create_dir_all(&work).with_context(|| format!("creating the work directory {}", work.display()))?;
    let data_settings = DataSettings {
        target: target_dir.clone(),
        prompts: a.prompts.clone(),
        num_prompts: a.num_prompts,
        held_out: a.held_out,
        split: SPLIT.into(),
        max_new_tokens: a.max_new_tokens,
    };
    check_data_settings(&work, &data_settings)?;
    let drafts = DrafterSpec::Suffix(SuffixSpec::default())
        .load(DraftTarget { dir: &target_dir, tokenizer: &tok, load: &options })?
        .expect("the suffix drafter is a drafter");
    let how = Answering {
        drafts: &*drafts.provider,
        num_draft_tokens: drafts.num_draft_tokens,
        max_batch: a.max_batch,
        deadline,
    };
    let samples = distil(&target, &work.join("samples.jsonl"), &train_prompts, a.max_new_tokens, &eos, &how)?;
    let held = distil(&target, &work.join("held_out.jsonl"), &held_prompts, a.max_new_tokens, &eos, &how)?;
    let tokens: usize = samples.iter().map(Sample::answer_len).sum();
    eprintln!(
        "data: {} samples ({} answer tokens), {} held out, in {:.1} min",
        samples.len(),
        tokens,
        held.len(),
        started.elapsed().as_secs_f64() / 60.0
    );
    if samples.len() < a.num_prompts || held.len() < a.held_out {
        // The time limit ended the data generation: the draft vocabulary and the run need
        // every answer, so nothing is chosen or trained from part of them.
        eprintln!(
            "the time limit ended the data generation after {} of {} answers and {} of {} held-out answers \
             (kept in {}); run the same command again to continue",
            samples.len(),
            a.num_prompts,
            held.len(),
            a.held_out,
            work.display()
        );
        return Ok(());
    }

    // The draft vocabulary: chosen once from the samples, kept in the work directory so that a
    // resume drafts from the same tokens.
    let k = a.draft_vocab_size.unwrap_or(if config.vocab_size > 16_384 { 8192 } else { 0 });
    if k > 0 && k < config.vocab_size {
        let path = work.join("draft_vocab.json");
        let ids: Vec<u32> = if path.exists() {
            serde_json::from_str(&std::fs::read_to_string(&path)?)
                .with_context(|| format!("reading {}", path.display()))?
        } else {
            let ids = frequent_tokens(&samples, k, &eos);
            write_atomic(&path, serde_json::to_string(&ids)?.as_bytes())?;
            ids
        };
        let covered: usize =
            samples.iter().flat_map(|s| &s.ids[s.prompt_len..]).filter(|t| ids.binary_search(t).is_ok()).count();
        eprintln!(
            "draft vocabulary: {} tokens, covering {:.2}% of the answer tokens",
            ids.len(),
            100.0 * covered as f64 / tokens.max(1) as f64
        );
        shape.draft_vocab = Some(ids);
        check_shape(&config, &shape)?;
    }

    // 2. The target's states on every sample (teacher forcing).
    let teacher = teach(&target, &samples, &shape.tap_layers, "teacher states")?;
    let held_teacher = teach(&target, &held, &shape.tap_layers, "held-out states")?;

    // 3. Train (or resume).
    let weights = new_drafter_weights(&target_dir, &config, &shape, a.seed, a.init)?;
    let settings = RunSettings {
        steps: a.steps,
        lr: a.lr,
        warmup_ratio: 0.04,
        weight_decay: 0.0,
        max_grad_norm: 1.0,
        num_anchors: a.num_anchors,
        seed: a.seed,
        checkpoint_every: a.checkpoint_every,
        init: a.init,
        ce_loss_alpha: a.ce_loss_alpha,
        l1_loss_alpha: a.l1_loss_alpha,
    };
    let mut run = Run::open(&work, &a.out, drafter_config(&config, &shape, a.num_anchors), weights, settings)?;
    if run.step() > 0 {
        eprintln!("resuming at step {} of {}", run.step(), a.steps);
    }
    let bar = styled_bar(a.steps, 10, "{elapsed}, ETA {eta}");
    bar.set_message("training");
    bar.set_position(run.step());
    run.train(&samples, &teacher, None, deadline, &mut |r| {
        bar.set_position(r.step);
        bar.set_message(format!("loss {:.3}", r.loss));
        if r.step % 50 == 0 {
            bar.suspend(|| {
                eprintln!(
                    "step {} loss {:.4} (ce {:.3} l1 {:.3} conf {:.3}) expected tau {:.2} lr {:.2e} grad norm {:.2} {:.0} slots/s",
                    r.step,
                    r.loss,
                    r.ce,
                    r.l1,
                    r.confidence,
                    r.expected_tau,
                    r.lr,
                    r.grad_norm,
                    r.slots as f64 * r.step as f64 / r.elapsed_s.max(1e-9)
                )
            });
        }
    })?;
    bar.finish_and_clear();

    // 4. Held-out evaluation (teacher-forced) and the confidence head's calibration: STS fitted
    // on one half of the held-out blocks, judged (and its ECE reported) on the other half, and
    // stored only where it lowered the ECE there.
    if held.is_empty() {
        println!(
            "{} after {} of {} steps, {:.1} min; no held-out prompts (--held-out 0): evaluation and calibration \
             skipped",
            a.out.display(),
            run.step(),
            a.steps,
            started.elapsed().as_secs_f64() / 60.0
        );
        return Ok(());
    }
    let eval = run.evaluate(&held, &held_teacher)?;
    let data = &eval.confidence;
    let b = shape.block_size;
    let cal = calibrate(data, b);
    run.set_confidence_temperatures(&cal.temperatures);
    run.checkpoint()?;
    let fmt = |v: &[f64]| v.iter().map(|r| format!("{r:.3}")).collect::<Vec<_>>().join(", ");
    let prefix = data.prefix_acceptance(b);
    let decoding_tau = data.decoding_tau();
    println!(
        "{} after {} of {} steps, {:.1} min\nheld-out (teacher-forced, {} blocks): loss {:.4}, expected tau {:.2}, \
         greedy tau {:.2} with a block at every position and {:.2} in decoding (rounds replayed where the last \
         ended), greedy prefix acceptance by position [{}]\nconfidence ECE {:.4} -> {:.4} with STS temperatures \
         [{}]: {}",
        a.out.display(),
        run.step(),
        a.steps,
        started.elapsed().as_secs_f64() / 60.0,
        data.accepted.len(),
        eval.loss,
        eval.expected_tau,
        data.greedy_tau(),
        decoding_tau,
        fmt(&prefix),
        cal.before.1,
        cal.after.1,
        fmt(&cal.fitted),
        if cal.stored { "stored" } else { "not stored (no lower ECE than without them), temperatures 1" }
    );
    let by_domain = data.tau_by_domain();
    let per: Vec<String> = by_domain
        .iter()
        .map(|(d, t)| format!("{d} {:.2} / {:.2} ({} blocks)", t.greedy_tau, t.decoding_tau, t.blocks))
        .collect();
    println!("greedy tau by domain (every position / decoding): {}", per.join(", "));
    let report = serde_json::json!({
        "steps": run.step(),
        "minutes": started.elapsed().as_secs_f64() / 60.0,
        "samples": samples.len(),
        "answer_tokens": tokens,
        "held_out": eval,
        "held_out_blocks": data.accepted.len(),
        "greedy_tau": data.greedy_tau(),
        "greedy_prefix_acceptance": prefix,
        "decoding_tau": decoding_tau,
        "tau_by_domain": by_domain,
        "confidence_temperatures": cal.temperatures,
        "sts_fitted_temperatures": cal.fitted,
        "sts_stored": cal.stored,
        "ece_before": cal.before.1,
        "ece_after": cal.after.1,
        "ece_before_by_position": cal.before.0,
        "ece_after_by_position": cal.after.0,
    });
    mlx_core::io::model_dir::write_json(&work.join("held_out_eval.json"), &report)?;
    Ok(())
}

/// How the prompt set is split into training and held-out prompts (`spec::prompts::split`),
/// recorded in `data.json`.
const SPLIT: &str = "last of each domain";

/// What the samples in a work directory were made from (`data.json`): a resume must not mix
/// answers to other prompts, of another length or of another target into the run.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
struct DataSettings {
    target: PathBuf,
    prompts: Option<PathBuf>,
    num_prompts: usize,
    held_out: usize,
    /// [`SPLIT`]; work directories from before it was recorded held out the prompts right
    /// after the training ones.
    #[serde(default = "sequential_split")]
    split: String,
    max_new_tokens: usize,
}

fn sequential_split() -> String {
    "after the training prompts".into()
}

/// Writes `data.json` in `work` (atomically) on the first run; on a resume, refuses settings
/// that differ from it, naming each flag with the stored and the given value.
fn check_data_settings(work: &Path, now: &DataSettings) -> Result<()> {
    let path = work.join("data.json");
    if !path.exists() {
        return Ok(write_json(&path, now)?);
    }
    let text = std::fs::read_to_string(&path).with_context(|| format!("reading {}", path.display()))?;
    let was: DataSettings = serde_json::from_str(&text).with_context(|| format!("reading {}", path.display()))?;
    let show = |p: &Option<PathBuf>| p.as_ref().map_or("the built-in set".to_string(), |p| p.display().to_string());
    let differences: Vec<String> = [
        ("--target", was.target.display().to_string(), now.target.display().to_string()),
        ("--prompts", show(&was.prompts), show(&now.prompts)),
        ("--num-prompts", was.num_prompts.to_string(), now.num_prompts.to_string()),
        ("--held-out", was.held_out.to_string(), now.held_out.to_string()),
        ("the held-out split", was.split.clone(), now.split.clone()),
        ("--max-new-tokens", was.max_new_tokens.to_string(), now.max_new_tokens.to_string()),
    ]
    .into_iter()
    .filter(|(_, w, n)| w != n)
    .map(|(flag, w, n)| format!("{flag}: {w} -> {n}"))
    .collect();
    if !differences.is_empty() {
        bail!(
            "{} holds the answers of a run with other data settings ({}); pass the same values or another --work-dir",
            work.display(),
            differences.join(", ")
        );
    }
    Ok(())
}

/// The samples of `prompts` already in `path`, plus the target's answers to the others
/// (appended to `path` as they finish), in prompt order; stops generating at `how.deadline`.
fn distil(
    target: &models::Transformer,
    path: &Path,
    prompts: &[(String, Vec<u32>)],
    max_new: usize,
    eos: &[u32],
    how: &Answering<'_>,
) -> Result<Vec<Sample>> {
    let have = if path.exists() { read_samples(path)? } else { Vec::new() };
    let missing: Vec<(String, Vec<u32>)> =
        prompts.iter().filter(|(s, _)| !have.iter().any(|h| &h.source == s)).cloned().collect();
    let mut file = OpenOptions::new()
        .create(true)
        .append(true)
        .open(path)
        .with_context(|| format!("opening {}", path.display()))?;
    let bar = styled_bar(prompts.len() as u64, 10, "{elapsed}, ETA {eta}");
    bar.set_message(path.file_stem().and_then(|s| s.to_str()).unwrap_or("samples").to_string());
    bar.set_position((prompts.len() - missing.len()) as u64);
    let fresh = generate_samples(target, &missing, max_new, eos, how, &mut |s| {
        bar.inc(1);
        append_sample(&mut file, path, s)
    })?;
    bar.finish_and_clear();
    let all: Vec<Sample> = have.into_iter().chain(fresh).collect();
    Ok(prompts.iter().filter_map(|(s, _)| all.iter().find(|x| &x.source == s).cloned()).collect())
}

fn teach(target: &models::Transformer, samples: &[Sample], taps: &[i64], what: &str) -> Result<Vec<TeacherStates>> {
    let bar = styled_bar(samples.len() as u64, 14, "{elapsed}");
    bar.set_message(what.to_string());
    let out = samples
        .iter()
        .map(|s| {
            bar.inc(1);
            teacher_states(target, &s.ids, taps)
        })
        .collect::<train::Result<Vec<_>>>()?;
    bar.finish_and_clear();
    Ok(out)
}

/// The highest id among the tokenizer's special-looking tokens (`<...>`, no spaces) below
/// 1,024 that the chat template never writes and that are not BOS or EOS: a row of the
/// embedding that training sequences do not contain.
fn default_mask_token(tok: &Tokenizer, config: &ModelConfig) -> Result<u32> {
    let template = tok.chat_template().unwrap_or("");
    let taken: Vec<u32> = tok.eos_ids().iter().copied().chain(tok.bos_id()).collect();
    (0..config.vocab_size.min(1024) as u32)
        .rev()
        .find(|&id| {
            tok.id_to_token(id).is_some_and(|t| {
                t.len() > 2 && t.starts_with('<') && t.ends_with('>') && !t.contains(' ') && !template.contains(&t)
            }) && !taken.contains(&id)
        })
        .ok_or_else(|| anyhow::anyhow!("no unused special token found for the block filler: pass --mask-token-id"))
}
