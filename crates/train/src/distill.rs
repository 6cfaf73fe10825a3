//! Self-distillation data: the target answers a prompt set with its own greedy decoding, and
//! its hidden states on those sequences are the drafter's teacher signal (what DeepSpec's
//! `scripts/data/generate_train_data.py` and `prepare_target_cache.py` make with SGLang and
//! the target on GPUs; here the target is mlx-spec's own).
use std::cell::RefCell;
use std::collections::HashMap;
use std::io::Write;
use std::path::Path;
use std::rc::Rc;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Instant;

use mlx_core::{Array, Dtype};
use models::{GenerateParams, Transformer};
use serde::{Deserialize, Serialize};
use spec::batch::{Batch, BatchRequest};
use spec::{DraftProvider, Emitted, Finish, SpecOptions};

use crate::{Error, Result};

/// One training sequence: a prompt (chat-templated) and the target's answer to it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Sample {
    /// Where the prompt came from (`"gsm8k:17"`).
    pub source: String,
    /// Prompt then answer token ids.
    pub ids: Vec<u32>,
    /// How many of `ids` are the prompt (not trained on).
    pub prompt_len: usize,
}

impl Sample {
    /// `false` on the prompt, `true` on the answer (DeepSpec's `loss_mask`).
    pub fn loss_mask(&self) -> Vec<bool> {
        (0..self.ids.len()).map(|i| i >= self.prompt_len).collect()
    }

    /// Answer tokens.
    pub fn answer_len(&self) -> usize {
        self.ids.len() - self.prompt_len
    }
}

/// How the target answers the prompts: several at once, each sped up by a drafter. Every
/// answer is still plain greedy decoding's, token for token: a batched round computes a
/// request's rows with the same bits as that request alone, and exact-match acceptance keeps
/// only the target's own tokens (`spec::batch`'s batch invariance).
pub struct Answering<'p> {
    /// Opens the draft source of each request (`train-drafter` uses the default suffix
    /// drafter).
    pub drafts: &'p dyn DraftProvider,
    /// The most drafts per round (γ; 0: plain decoding steps).
    pub num_draft_tokens: usize,
    /// Requests decoding together (1: one after the other).
    pub max_batch: usize,
    /// When to stop: requests still running then are cancelled and give no sample.
    pub deadline: Option<Instant>,
}

/// A request's tokens, shared with its `on_token` callback.
type Answer = Rc<RefCell<Vec<u32>>>;

/// The target's greedy answer (up to `max_new_tokens`, stopping at any of `eos`, which is not
/// kept) to each prompt of `prompts` (token ids), decoded as `how` says; `on_sample` is called
/// with each [`Sample`] as it finishes (answers finish out of prompt order). Returns the
/// samples in prompt order; prompts not answered by `how.deadline` have none.
///
/// # Errors
/// [`Error::Spec`] when a request or a batched round fails; `on_sample`'s errors.
pub fn generate_samples(
    target: &Transformer,
    prompts: &[(String, Vec<u32>)],
    max_new_tokens: usize,
    eos: &[u32],
    how: &Answering<'_>,
    on_sample: &mut dyn FnMut(&Sample) -> Result<()>,
) -> Result<Vec<Sample>> {
    let params = GenerateParams { max_tokens: max_new_tokens, sampler: models::Sampler::default(), eos: eos.to_vec() };
    let cancel = Arc::new(AtomicBool::new(false));
    let mut batch = Batch::new(target);
    // Request id -> (prompt index, its tokens so far).
    let mut running: HashMap<u64, (usize, Answer)> = HashMap::new();
    let mut answered: Vec<Option<Sample>> = vec![None; prompts.len()];
    let mut next = 0;
    loop {
        if how.deadline.is_some_and(|d| Instant::now() >= d) {
            cancel.store(true, Ordering::Relaxed);
        }
        while !cancel.load(Ordering::Relaxed) && batch.len() < how.max_batch.max(1) && next < prompts.len() {
            let tokens = Rc::new(RefCell::new(Vec::new()));
            let sink = Rc::clone(&tokens);
            let request = BatchRequest {
                prompt: prompts[next].1.clone(),
                params: params.clone(),
                options: SpecOptions::from(how.num_draft_tokens),
                cache: target.make_cache(),
                draft_state: None,
                logprobs: None,
                cancel: Some(Arc::clone(&cancel)),
            };
            let on_token = Box::new(move |e: &Emitted| {
                sink.borrow_mut().push(e.token);
                true
            });
            let id = batch.add(how.drafts.open(target, &params.sampler)?, request, on_token)?;
            running.insert(id, (next, tokens));
            next += 1;
        }
        if batch.is_empty() {
            break;
        }
        for done in batch.step() {
            let (i, tokens) = running.remove(&done.id).expect("every request in the batch is running");
            if done.result?.finish == Finish::Cancelled {
                continue;
            }
            let (source, prompt) = &prompts[i];
            let ids = prompt.iter().copied().chain(tokens.take()).collect();
            let sample = Sample { source: source.clone(), ids, prompt_len: prompt.len() };
            on_sample(&sample)?;
            answered[i] = Some(sample);
        }
    }
    Ok(answered.into_iter().flatten().collect())
}

/// Appends `sample` to the JSON Lines file `file` (one sample per line).
///
/// # Errors
/// [`Error::State`] naming the file when it cannot be written.
pub fn append_sample(file: &mut std::fs::File, path: &Path, sample: &Sample) -> Result<()> {
    let line = serde_json::to_string(sample).expect("a sample serializes");
    writeln!(file, "{line}")
        .and_then(|_| file.flush())
        .map_err(|e| Error::State { path: path.into(), message: e.to_string() })
}

/// Reads samples written by [`append_sample`]; a last line cut short (an interrupted write) is
/// dropped, any other bad line is an error.
///
/// # Errors
/// [`Error::State`] naming the file and line.
pub fn read_samples(path: &Path) -> Result<Vec<Sample>> {
    let text = std::fs::read_to_string(path).map_err(|e| Error::State { path: path.into(), message: e.to_string() })?;
    let lines: Vec<&str> = text.lines().filter(|l| !l.trim().is_empty()).collect();
    let mut out = Vec::with_capacity(lines.len());
    for (i, line) in lines.iter().enumerate() {
        match serde_json::from_str::<Sample>(line) {
            Ok(s) if s.prompt_len <= s.ids.len() => out.push(s),
            Err(_) if i + 1 == lines.len() && !text.ends_with('\n') => break,
            Ok(_) => {
                let message = format!("line {}: prompt_len exceeds the sequence", i + 1);
                return Err(Error::State { path: path.into(), message });
            }
            Err(e) => return Err(Error::State { path: path.into(), message: format!("line {}: {e}", i + 1) }),
        }
    }
    Ok(out)
}

/// The target's states on one sequence, the teacher signal of a training step.
pub struct TeacherStates {
    /// The taps `[L, T*H]` f32 (the outputs of the tapped decoder layers, concatenated in
    /// `target_layer_ids` order; `-1` is the embedding output).
    pub taps: Array,
    /// The final-normed last hidden states `[L, H]` f32.
    pub hidden: Array,
}

/// Runs the target over `ids` (teacher forcing, one forward, evaluated) and returns its
/// [`TeacherStates`] for the drafter's tap layers `tap_layers`.
///
/// # Errors
/// [`Error::Config`] for a tap layer outside the target's decoder layers (the embedding output,
/// `-1`, is not offered for training); [`Error::Model`] when the forward fails.
pub fn teacher_states(target: &Transformer, ids: &[u32], tap_layers: &[i64]) -> Result<TeacherStates> {
    let layers = target.num_layers() as i64;
    if let Some(&bad) = tap_layers.iter().find(|&&t| t < 0 || t >= layers) {
        let message = format!("tap layer {bad} is outside the target's decoder layers 0..{}", layers - 1);
        return Err(Error::Config { setting: "target_layer_ids", message });
    }
    let taps: Vec<usize> = tap_layers.iter().map(|&t| t as usize).collect();
    let tokens = models::generate::ids(ids)?;
    let mut cache = target.make_cache();
    let (hidden, tapped) = target.hidden_with_taps(&tokens, &mut cache, &taps)?;
    let taps = mlx_core::concatenate(&tapped.iter().collect::<Vec<_>>(), -1)?.squeeze(&[0])?.astype(Dtype::Float32)?;
    let hidden = hidden.squeeze(&[0])?.astype(Dtype::Float32)?;
    mlx_core::eval(&[&taps, &hidden])?;
    Ok(TeacherStates { taps, hidden })
}
