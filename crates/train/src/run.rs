//! A DSpark training run over self-distilled samples: the step (teacher states, anchors,
//! forward, loss, gradients, clipping, AdamW), checkpoints, resume and the loss curve.
//!
//! A run's working directory holds everything a resume needs: `run.json` (the settings and
//! the step reached), `optimizer.safetensors` ([`AdamW::save`]), `losses.jsonl` (one line per
//! step). The drafter checkpoint (`--out`) is rewritten atomically at every checkpoint.
use std::collections::BTreeMap;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::time::Instant;

use drafter::training::{TrainingSequence, sample_anchors};
use drafter::{Drafter, DrafterConfig};
use mlx_core::io::model_dir::{write_atomic, write_json};
use mlx_core::{Array, KernelPolicy, autograd};
use models::LoadOptions;
use models::weights::Weights;
use rand::SeedableRng;
use rand::rngs::StdRng;
use rand::seq::SliceRandom;
use serde::{Deserialize, Serialize};

use crate::distill::{Sample, TeacherStates};
use crate::init::write_checkpoint;
use crate::{AdamW, AdamWConfig, DSparkLoss, Error, Result, WarmupCosine, clip_grad_norm};

/// The settings of a run (stored in `run.json`; a resume must use the same ones).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RunSettings {
    /// Optimizer steps (one sequence each).
    pub steps: u64,
    /// Peak learning rate (per unit of the normalized AdamW step).
    pub lr: f64,
    /// Warm-up steps as a fraction of `steps` (DeepSpec: 0.04).
    pub warmup_ratio: f64,
    /// AdamW weight decay (DeepSpec: 0).
    pub weight_decay: f64,
    /// Gradient clipping norm (DeepSpec: 1.0).
    pub max_grad_norm: f64,
    /// Blocks sampled per sequence (DeepSpec: 512 over 4,096-token sequences).
    pub num_anchors: usize,
    /// Seed of the sample order and the anchors (the initial weights take theirs from
    /// [`crate::init::new_drafter_weights`]).
    pub seed: u64,
    /// Write the drafter and the optimizer state every this many steps.
    pub checkpoint_every: u64,
    /// How the drafter's weights started (a run stored before this field: `random`).
    #[serde(default)]
    pub init: crate::init::Init,
    /// Weight of the cross entropy against the target's own tokens in the objective
    /// ([`DSparkLoss::ce_alpha`]; DeepSpec's `ce_loss_alpha`, 0.1; a run stored before this
    /// field: 0.1).
    #[serde(default = "default_ce_alpha")]
    pub ce_loss_alpha: f32,
    /// Weight of the L1 distance to the target's distribution ([`DSparkLoss::l1_alpha`];
    /// DeepSpec's `l1_loss_alpha`, 0.9; a run stored before this field: 0.9).
    #[serde(default = "default_l1_alpha")]
    pub l1_loss_alpha: f32,
}

impl RunSettings {
    /// The objective these settings train with: [`DSparkLoss`] with `ce_loss_alpha` and
    /// `l1_loss_alpha`, DeepSpec's other weights (confidence 1, position decay 4).
    ///
    /// # Errors
    /// [`Error::Config`] naming both weights when one is negative or not finite, or both
    /// are 0.
    pub fn loss(&self) -> Result<DSparkLoss> {
        let (ce, l1) = (self.ce_loss_alpha, self.l1_loss_alpha);
        if [ce, l1].iter().any(|a| !a.is_finite() || *a < 0.0) || (ce == 0.0 && l1 == 0.0) {
            let message =
                format!("ce_loss_alpha {ce} and l1_loss_alpha {l1}: expected finite weights >= 0, not both 0");
            return Err(Error::Config { setting: "loss weights", message });
        }
        Ok(DSparkLoss { ce_alpha: ce, l1_alpha: l1, ..DSparkLoss::default() })
    }
}

fn default_ce_alpha() -> f32 {
    DSparkLoss::default().ce_alpha
}

fn default_l1_alpha() -> f32 {
    DSparkLoss::default().l1_alpha
}

/// What a step reports.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct StepReport {
    /// 1-based step.
    pub step: u64,
    /// The objective.
    pub loss: f64,
    /// Its cross-entropy, L1 and confidence terms.
    pub ce: f64,
    /// L1 distance term.
    pub l1: f64,
    /// Confidence BCE term.
    pub confidence: f64,
    /// Expected acceptance length per block (teacher-forced, [`crate::LossTerms`]).
    pub expected_tau: f64,
    /// Learning rate used.
    pub lr: f64,
    /// Gradient norm before clipping.
    pub grad_norm: f64,
    /// Trained slots (block positions with loss weight) in this step.
    pub slots: usize,
    /// Seconds since the run (or resume) started.
    pub elapsed_s: f64,
}

#[derive(Serialize, Deserialize)]
struct RunState {
    settings: RunSettings,
    step: u64,
    /// The drafter's config at the start (without calibration); absent in runs of older
    /// builds.
    #[serde(default)]
    drafter: Option<serde_json::Value>,
}

/// The keys whose values differ between the JSON objects `a` and `b`, except those in
/// `ignore`, as `key: a -> b`.
fn config_changes(a: &serde_json::Value, b: &serde_json::Value, ignore: &[&str]) -> Vec<String> {
    let (Some(a), Some(b)) = (a.as_object(), b.as_object()) else { return vec![format!("{a} -> {b}")] };
    let keys: std::collections::BTreeSet<&String> = a.keys().chain(b.keys()).collect();
    keys.into_iter()
        .filter(|k| !ignore.contains(&k.as_str()) && a.get(*k) != b.get(*k))
        .map(|k| {
            let show = |v: Option<&serde_json::Value>| v.map_or("(none)".to_string(), |v| v.to_string());
            format!("{k}: {} -> {}", show(a.get(k)), show(b.get(k)))
        })
        .collect()
}

/// The fields of two settings that differ, as `name: a -> b`.
fn settings_changes(a: &RunSettings, b: &RunSettings) -> Vec<String> {
    match (serde_json::to_value(a), serde_json::to_value(b)) {
        (Ok(a), Ok(b)) => config_changes(&a, &b, &[]),
        _ => vec![format!("{a:?} -> {b:?}")],
    }
}

/// A run: the drafter's config, its frozen and trainable weights, the optimizer, the data.
pub struct Run {
    dir: PathBuf,
    out: PathBuf,
    config_json: serde_json::Value,
    config: DrafterConfig,
    frozen: BTreeMap<String, Array>,
    names: Vec<String>,
    params: Vec<Array>,
    opt: AdamW,
    schedule: WarmupCosine,
    settings: RunSettings,
    loss: DSparkLoss,
    step: u64,
}

/// Weights that are not trained: the target's embedding and LM head (DeepSpec freezes both)
/// and the draft vocabulary's ids.
const FROZEN: [&str; 3] = ["embed_tokens.weight", "lm_head.weight", "draft_vocab_ids"];

impl Run {
    /// Starts a run in `dir` (created) for the drafter `config_json` with `weights` (frozen
    /// `embed_tokens` / `lm_head` and the trainable rest), or resumes the one there when
    /// `dir/run.json` exists with the same settings (its optimizer state replaces `weights`'
    /// trainable values). The drafter checkpoint goes to `out`.
    ///
    /// # Errors
    /// [`Error::State`] when `dir` holds a run with other settings (both named) or cannot be
    /// created; [`Error::Drafter`] for a config the drafter refuses; [`Error::Config`] (before
    /// anything is created) for loss weights [`RunSettings::loss`] refuses.
    pub fn open(
        dir: &Path,
        out: &Path,
        config_json: serde_json::Value,
        mut weights: BTreeMap<String, Array>,
        settings: RunSettings,
    ) -> Result<Self> {
        let loss = settings.loss()?;
        std::fs::create_dir_all(dir).map_err(|e| Error::State { path: dir.into(), message: e.to_string() })?;
        let raw = serde_json::from_value(config_json.clone())
            .map_err(|e| Error::Config { setting: "drafter config", message: e.to_string() })?;
        let config = DrafterConfig::from_raw(raw, dir.join("config.json"))?;
        let frozen: BTreeMap<String, Array> =
            FROZEN.iter().filter_map(|n| weights.remove(*n).map(|a| (n.to_string(), a))).collect();
        let (names, params): (Vec<String>, Vec<Array>) = weights.into_iter().unzip();
        let warmup = (settings.warmup_ratio * settings.steps as f64).round() as u64;
        let schedule = WarmupCosine::new(settings.lr, settings.steps, warmup, 0.0)?;
        let adam = AdamWConfig { weight_decay: settings.weight_decay, ..AdamWConfig::default() };
        let state_path = dir.join("run.json");
        let (opt, step) = if state_path.exists() {
            let text = std::fs::read_to_string(&state_path)
                .map_err(|e| Error::State { path: state_path.clone(), message: e.to_string() })?;
            let state: RunState = serde_json::from_str(&text)
                .map_err(|e| Error::State { path: state_path.clone(), message: e.to_string() })?;
            if state.settings != settings {
                let message = format!(
                    "a run with other settings is here ({}, stored -> asked); resume it with the stored ones or \
                     use another --work-dir",
                    settings_changes(&state.settings, &settings).join(", ")
                );
                return Err(Error::State { path: state_path, message });
            }
            // the temperatures are fitted after training; the anchors per step are a setting,
            // compared above (runs before it was recorded in the config say 512)
            let ignore = ["confidence_temperatures", "num_anchors"];
            let changes = state.drafter.as_ref().map(|d| config_changes(d, &config_json, &ignore)).unwrap_or_default();
            if !changes.is_empty() {
                let message = format!(
                    "the run here trains another drafter ({}, stored -> asked): resume it with the same --layers, \
                     --block-size, --markov-rank, --tap-layers, --mask-token-id and draft vocabulary, or use another \
                     --work-dir",
                    changes.join(", ")
                );
                return Err(Error::State { path: state_path, message });
            }
            let opt = AdamW::load(&dir.join("optimizer.safetensors"), &names, &params)?;
            if opt.steps_taken() != state.step {
                let message = format!("run.json says step {}, the optimizer state {}", state.step, opt.steps_taken());
                return Err(Error::State { path: state_path, message });
            }
            (opt, state.step)
        } else {
            (AdamW::new(adam, &names, &params)?, 0)
        };
        let params = opt.params()?;
        // Steps logged after the last checkpoint of an interrupted session are redone.
        let log = dir.join("losses.jsonl");
        let kept = read_reports(&log, step)?;
        let text: String = kept.iter().map(|r| serde_json::to_string(r).expect("a report serializes") + "\n").collect();
        write_atomic(&log, text.as_bytes()).map_err(|e| Error::State { path: log.clone(), message: e.to_string() })?;
        Ok(Run {
            dir: dir.into(),
            out: out.into(),
            config_json,
            config,
            frozen,
            names,
            params,
            opt,
            schedule,
            loss,
            settings,
            step,
        })
    }

    /// The reports of the steps so far (`losses.jsonl`, earlier sessions included).
    ///
    /// # Errors
    /// [`Error::State`] when the log cannot be read or a line is malformed.
    pub fn reports(&self) -> Result<Vec<StepReport>> {
        read_reports(&self.dir.join("losses.jsonl"), self.step)
    }

    /// Sets the checkpoint's `confidence_temperatures` (Sequential Temperature Scaling; see
    /// [`crate::calibrate`]) for the checkpoints written from now on.
    pub fn set_confidence_temperatures(&mut self, temps: &[f64]) {
        self.config_json["confidence_temperatures"] = serde_json::json!(temps);
    }

    /// Steps done so far (after a resume, those of the earlier sessions).
    pub fn step(&self) -> u64 {
        self.step
    }

    /// The settings.
    pub fn settings(&self) -> &RunSettings {
        &self.settings
    }

    /// The drafter with the current weights (f32, MLX's kernels: differentiable).
    ///
    /// # Errors
    /// [`Error::Drafter`] when it cannot be built.
    pub fn drafter(&self) -> Result<Drafter> {
        build(&self.config, &self.dir, &self.frozen, &self.names, &self.params)
    }

    /// Trains until step `until` (at most `settings.steps`; `None`: all of them) or until
    /// `deadline`, calling `report` after each step; checkpoints every `checkpoint_every`
    /// steps and when it stops after steps the last checkpoint does not hold. `teacher[i]` holds the target's states on `samples[i]`.
    ///
    /// # Errors
    /// [`Error::Config`] for no samples (or a teacher state count that differs); those of the
    /// step, the checkpoint and the loss log.
    pub fn train(
        &mut self,
        samples: &[Sample],
        teacher: &[TeacherStates],
        until: Option<u64>,
        deadline: Option<Instant>,
        report: &mut dyn FnMut(&StepReport),
    ) -> Result<()> {
        let until = until.unwrap_or(u64::MAX).min(self.settings.steps);
        let start = Instant::now();
        let seed = self.settings.seed;
        // The sample order of an epoch, drawn once per epoch from the seed (so a resume
        // continues the same order).
        let order = |epoch: u64| {
            let mut idx: Vec<usize> = (0..samples.len()).collect();
            idx.shuffle(&mut StdRng::seed_from_u64(seed ^ epoch.wrapping_mul(0x2545_f491_4f6c_dd1d)));
            idx
        };
        if samples.is_empty() || samples.len() != teacher.len() {
            let message =
                format!("{} samples and {} teacher states; training needs samples", samples.len(), teacher.len());
            return Err(Error::Config { setting: "samples", message });
        }
        let n = samples.len() as u64;
        let mut epoch = (self.step / n, order(self.step / n));
        let usable: Vec<usize> = (0..samples.len()).filter(|&i| samples[i].answer_len() >= 2).collect();
        if usable.is_empty() {
            return Err(Error::Config {
                setting: "samples",
                message: "no sample has an answer of 2 tokens or more".into(),
            });
        }
        let mut log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(self.dir.join("losses.jsonl"))
            .map_err(|e| Error::State { path: self.dir.join("losses.jsonl"), message: e.to_string() })?;
        let mut checkpointed = self.step;
        while self.step < until {
            if deadline.is_some_and(|d| Instant::now() >= d) {
                break;
            }
            if epoch.0 != self.step / n {
                epoch = (self.step / n, order(self.step / n));
            }
            let pick = epoch.1[(self.step % n) as usize];
            let i = if samples[pick].answer_len() >= 2 { pick } else { usable[pick % usable.len()] };
            let r = self.one_step(&samples[i], &teacher[i], start)?;
            let line = serde_json::to_string(&r).expect("a report serializes");
            writeln!(log, "{line}")
                .map_err(|e| Error::State { path: self.dir.join("losses.jsonl"), message: e.to_string() })?;
            report(&r);
            if self.step.is_multiple_of(self.settings.checkpoint_every) {
                self.checkpoint()?;
                checkpointed = self.step;
            }
        }
        if checkpointed != self.step {
            self.checkpoint()?;
        }
        Ok(())
    }

    fn one_step(&mut self, sample: &Sample, teacher: &TeacherStates, start: Instant) -> Result<StepReport> {
        let mask = sample.loss_mask();
        let mut rng = StdRng::seed_from_u64(self.settings.seed.wrapping_add(self.step.wrapping_mul(0x9e37_79b9)));
        let anchors = sample_anchors(&mask, self.settings.num_anchors, &mut rng);
        let seq = TrainingSequence {
            input_ids: &sample.ids,
            taps: &teacher.taps,
            target_hidden: &teacher.hidden,
            loss_mask: &mask,
        };
        let mut terms = None;
        let (loss, grads) = autograd::value_and_grad(
            |p| -> Result<Array> {
                let d = build(&self.config, &self.dir, &self.frozen, &self.names, p)?;
                let t = self.loss.terms(&d.training_forward(&seq, &anchors)?)?;
                let total = t.total.clone();
                terms = Some(t);
                Ok(total)
            },
            &self.params,
        )?;
        let t = terms.expect("the loss ran");
        let (grads, grad_norm) = clip_grad_norm(&grads, self.settings.max_grad_norm)?;
        let lr = self.schedule.lr(self.step);
        self.params = self.opt.step(&grads, lr)?;
        self.step += 1;
        let item = |a: &Array| a.item().map_err(Error::from);
        mlx_core::eval(&[&loss, &t.ce, &t.l1, &t.confidence, &t.expected_tau])?;
        Ok(StepReport {
            step: self.step,
            loss: item(&loss)?,
            ce: item(&t.ce)?,
            l1: item(&t.l1)?,
            confidence: item(&t.confidence)?,
            expected_tau: item(&t.expected_tau)?,
            lr,
            grad_norm,
            slots: anchors.len() * self.config.block_size,
            elapsed_s: start.elapsed().as_secs_f64(),
        })
    }

    /// Writes the drafter checkpoint (`out`, atomically, with `training.json`: the settings,
    /// the step and the last loss, and `loss_curve.png`), the optimizer state and `run.json`.
    ///
    /// # Errors
    /// [`Error::Mlx`] / [`Error::State`] naming the file that could not be written.
    pub fn checkpoint(&self) -> Result<()> {
        let mut tensors = self.frozen.clone();
        tensors.extend(self.names.iter().cloned().zip(self.params.iter().cloned()));
        let reports = self.reports()?;
        let extra = |dir: &Path| -> Result<()> {
            let summary = serde_json::json!({
                "settings": self.settings,
                "step": self.step,
                "last": reports.last(),
                "trainer": "mlx-spec train-drafter",
            });
            let path = dir.join("training.json");
            std::fs::write(&path, serde_json::to_string_pretty(&summary).expect("the summary serializes"))
                .map_err(|e| Error::State { path, message: e.to_string() })?;
            if reports.len() >= 2 {
                crate::plot::loss_curve(&reports, &dir.join("loss_curve.png"))?;
            }
            Ok(())
        };
        write_checkpoint(&self.out, &self.config_json, &tensors, &extra)?;
        self.opt.save(&self.dir.join("optimizer.safetensors"))?;
        let mut drafter = self.config_json.clone();
        if let Some(o) = drafter.as_object_mut() {
            o.remove("confidence_temperatures");
        }
        let state = RunState { settings: self.settings.clone(), step: self.step, drafter: Some(drafter) };
        let path = self.dir.join("run.json");
        write_json(&path, &state).map_err(|e| Error::State { path, message: e.to_string() })
    }

    /// Teacher-forced evaluation on `samples` (all anchors of each, no gradient): the mean
    /// objective and expected acceptance length, the acceptance rate per position (DeepSpec's
    /// `accept_rate@k`), and the confidence data of every block (for greedy tau and STS).
    ///
    /// # Errors
    /// Those of the forward.
    pub fn evaluate(&self, samples: &[Sample], teacher: &[TeacherStates]) -> Result<Evaluation> {
        let d = self.drafter()?;
        let (mut sum, mut n) = (Evaluation::default(), 0.0);
        for (s, t) in samples.iter().zip(teacher) {
            let mask = s.loss_mask();
            let anchors = drafter::training::anchor_candidates(&mask);
            if anchors.is_empty() {
                continue;
            }
            let seq = TrainingSequence { input_ids: &s.ids, taps: &t.taps, target_hidden: &t.hidden, loss_mask: &mask };
            let out = d.training_forward(&seq, &anchors)?;
            let terms = self.loss.terms(&out)?;
            if self.config.confidence_head {
                sum.confidence.add(&out, &s.source, &anchors)?;
            }
            sum.loss += terms.total.item()?;
            sum.expected_tau += terms.expected_tau.item()?;
            let rates = terms.accept_rate.to_vec::<f32>()?;
            sum.accept_rate.resize(rates.len(), 0.0);
            for (a, r) in sum.accept_rate.iter_mut().zip(rates) {
                *a += f64::from(r);
            }
            n += 1.0;
        }
        if n > 0.0 {
            sum.loss /= n;
            sum.expected_tau /= n;
            sum.accept_rate.iter_mut().for_each(|a| *a /= n);
        }
        Ok(sum)
    }
}

/// A teacher-forced evaluation (see [`Run::evaluate`]).
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct Evaluation {
    /// Mean objective.
    pub loss: f64,
    /// Mean expected acceptance length per block, bonus included.
    pub expected_tau: f64,
    /// Mean `c*` per block position.
    pub accept_rate: Vec<f64>,
    /// Per block, the confidence logits and greedy acceptances (empty without a confidence
    /// head).
    #[serde(skip)]
    pub confidence: crate::calibrate::ConfidenceData,
}

/// The reports in the log `path` up to step `upto` (none when it does not exist).
fn read_reports(path: &Path, upto: u64) -> Result<Vec<StepReport>> {
    let text = match std::fs::read_to_string(path) {
        Ok(t) => t,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(e) => return Err(Error::State { path: path.into(), message: e.to_string() }),
    };
    let mut out = Vec::new();
    for (i, line) in text.lines().enumerate().filter(|(_, l)| !l.trim().is_empty()) {
        match serde_json::from_str::<StepReport>(line) {
            Ok(r) if r.step <= upto => out.push(r),
            Ok(_) => {}
            // a line cut short by an interruption
            Err(_) if i + 1 == text.lines().count() => {}
            Err(e) => return Err(Error::State { path: path.into(), message: format!("line {}: {e}", i + 1) }),
        }
    }
    Ok(out)
}

fn build(
    config: &DrafterConfig,
    dir: &Path,
    frozen: &BTreeMap<String, Array>,
    names: &[String],
    params: &[Array],
) -> Result<Drafter> {
    let mut tensors = frozen.clone();
    tensors.extend(names.iter().cloned().zip(params.iter().cloned()));
    let options = LoadOptions { dtype: Some(mlx_core::Dtype::Float32), kernels: KernelPolicy::mlx() };
    Ok(Drafter::from_weights(config.clone(), Weights::from_tensors(dir, tensors), &options)?)
}
