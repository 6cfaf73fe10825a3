//! The acceptance A/B: two drafters (arm A, the baseline, and arm B, e.g. its quantized
//! copy) draft for one target over the same prompts at temperature 0 through the shared
//! executor. Drafter numerics move acceptance, never correctness, so the question an A/B
//! answers is whether B keeps A's acceptance (within `max_drop` percentage points) while
//! being faster. Used by `cargo xtask ab`.
//!
//! The arms run interleaved per prompt (A then B), so machine noise hits both alike, and
//! paired per prompt. Both arms are lossless, so their outputs must be identical: a
//! difference is reported as an error, not a measurement.
use models::tokenizer::Tokenizer;
use models::{GenerateParams, Sampler, Transformer};

use crate::prompts::{Prompt, PromptKind};
use crate::{DraftProvider, Error, Result, speculative_generate};

/// What one arm did on one prompt.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct PromptResult {
    /// The prompt's `source` (`"humaneval:4"`).
    pub source: String,
    /// Grounded or free-form.
    pub kind: PromptKind,
    /// Tokens emitted.
    pub emitted: usize,
    /// Verify rounds (target forwards).
    pub rounds: usize,
    /// Draft tokens proposed.
    pub drafted: usize,
    /// Draft tokens accepted.
    pub accepted: usize,
    /// Decode time in ms (prefill excluded).
    pub decode_ms: f64,
}

/// One arm over all prompts.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct ArmReport {
    /// The arm's label (`"A"`, `"B"`).
    pub label: String,
    /// The drafter's name ([`DraftProvider::name`]).
    pub drafter: String,
    /// Per prompt, in prompt order.
    pub prompts: Vec<PromptResult>,
    /// Accepted over drafted, all prompts pooled (0..=1).
    pub acceptance_rate: f64,
    /// Mean accepted + 1 per round (tokens per target forward).
    pub tau: f64,
    /// Emitted tokens over decode seconds.
    pub tokens_per_s: f64,
    /// Per draft position `j` (0-based): drafts proposed there, all prompts pooled.
    pub drafted_by_pos: Vec<usize>,
    /// Per draft position `j`: drafts accepted there.
    pub accepted_by_pos: Vec<usize>,
    /// [`ArmReport::tau`] per domain (a prompt's `source` before `:`, `"gsm8k"`), over that
    /// domain's prompts.
    pub tau_by_domain: std::collections::BTreeMap<String, f64>,
}

impl ArmReport {
    /// `accepted_by_pos[j] / drafted_by_pos[j]` (0 where nothing was drafted).
    pub fn acceptance_by_pos(&self) -> Vec<f64> {
        self.drafted_by_pos
            .iter()
            .zip(&self.accepted_by_pos)
            .map(|(&d, &a)| if d > 0 { a as f64 / d as f64 } else { 0.0 })
            .collect()
    }

    fn new(label: &str, drafter: &str, num_draft_tokens: usize) -> Self {
        ArmReport {
            label: label.into(),
            drafter: drafter.into(),
            prompts: Vec::new(),
            acceptance_rate: 0.0,
            tau: 0.0,
            tokens_per_s: 0.0,
            drafted_by_pos: vec![0; num_draft_tokens],
            accepted_by_pos: vec![0; num_draft_tokens],
            tau_by_domain: Default::default(),
        }
    }

    fn finish(&mut self) {
        let sum = |f: fn(&PromptResult) -> usize| self.prompts.iter().map(f).sum::<usize>();
        let (drafted, accepted, rounds, emitted) =
            (sum(|p| p.drafted), sum(|p| p.accepted), sum(|p| p.rounds), sum(|p| p.emitted));
        let decode_s: f64 = self.prompts.iter().map(|p| p.decode_ms).sum::<f64>() / 1e3;
        self.acceptance_rate = if drafted > 0 { accepted as f64 / drafted as f64 } else { 0.0 };
        self.tau = if rounds > 0 { (accepted + rounds) as f64 / rounds as f64 } else { 0.0 };
        self.tokens_per_s = if decode_s > 0.0 { emitted as f64 / decode_s } else { 0.0 };
        // (accepted, rounds) per domain
        let mut by: std::collections::BTreeMap<String, (usize, usize)> = Default::default();
        for p in &self.prompts {
            let e = by.entry(crate::prompts::domain(&p.source).to_string()).or_default();
            e.0 += p.accepted;
            e.1 += p.rounds;
        }
        self.tau_by_domain = by
            .into_iter()
            .map(|(d, (accepted, rounds))| {
                (d, if rounds > 0 { (accepted + rounds) as f64 / rounds as f64 } else { 0.0 })
            })
            .collect();
    }
}

/// The A/B outcome.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct AbReport {
    /// Drafts per round (γ) of both arms.
    pub num_draft_tokens: usize,
    /// Tokens generated per prompt (at most).
    pub max_tokens: usize,
    /// The baseline arm.
    pub a: ArmReport,
    /// The candidate arm.
    pub b: ArmReport,
    /// `100 * (a.acceptance_rate - b.acceptance_rate)`: percentage points lost by B.
    pub acceptance_drop_points: f64,
    /// Mean over prompts of B's minus A's per-prompt acceptance rate, in points (paired).
    pub paired_mean_diff_points: f64,
    /// `b.tokens_per_s / a.tokens_per_s`.
    pub speed_ratio: f64,
    /// The largest drop the verdict allows, in points.
    pub max_drop_points: f64,
    /// PASS when the drop is at most `max_drop_points` and B is faster.
    pub pass: bool,
}

impl AbReport {
    /// `"PASS"` or `"FAIL"` with the reason.
    pub fn verdict(&self) -> String {
        let drop_ok = self.acceptance_drop_points <= self.max_drop_points;
        let faster = self.speed_ratio > 1.0;
        match (drop_ok, faster) {
            (true, true) => "PASS".into(),
            (false, _) => format!(
                "FAIL: acceptance dropped {:.2} points (> {:.2})",
                self.acceptance_drop_points, self.max_drop_points
            ),
            (true, false) => format!("FAIL: B is not faster ({:.3}x A)", self.speed_ratio),
        }
    }
}

/// Runs the A/B: for each prompt, arm A then arm B, greedy, `max_tokens` tokens, at most
/// `num_draft_tokens` drafts per round; `on_prompt` sees each prompt's pair of results as
/// it completes (for progress output).
///
/// # Errors
/// Model, tokenizer and drafter errors; [`Error::Invalid`] when the arms' outputs differ
/// on a prompt (a losslessness bug in one of them) or `prompts` is empty.
#[allow(clippy::too_many_arguments)]
pub fn run_ab(
    target: &Transformer,
    tok: &Tokenizer,
    prompts: &[Prompt],
    a: &dyn DraftProvider,
    b: &dyn DraftProvider,
    num_draft_tokens: usize,
    max_tokens: usize,
    max_drop_points: f64,
    mut on_prompt: impl FnMut(&PromptResult, &PromptResult),
) -> Result<AbReport> {
    if prompts.is_empty() {
        return Err(Error::Invalid("an A/B needs at least one prompt".into()));
    }
    let params = GenerateParams { max_tokens, sampler: Sampler::default(), eos: tok.eos_ids().to_vec() };
    let mut arms = [ArmReport::new("A", a.name(), num_draft_tokens), ArmReport::new("B", b.name(), num_draft_tokens)];
    for p in prompts {
        let ids = p.ids(tok)?;
        let mut outputs = Vec::with_capacity(2);
        for (arm, provider) in arms.iter_mut().zip([a, b]) {
            let mut source = provider.open(target, &params.sampler)?;
            let mut out = Vec::new();
            let stats = speculative_generate(target, source.as_mut(), &ids, &params, num_draft_tokens, |t| {
                out.push(t);
                true
            })?;
            for j in 0..num_draft_tokens {
                arm.drafted_by_pos[j] += stats.drafted_by_pos[j];
                arm.accepted_by_pos[j] += stats.accepted_by_pos[j];
            }
            arm.prompts.push(PromptResult {
                source: p.source.clone(),
                kind: p.kind,
                emitted: stats.emitted,
                rounds: stats.rounds,
                drafted: stats.drafted,
                accepted: stats.accepted,
                decode_ms: stats.decode_ms,
            });
            outputs.push(out);
        }
        if outputs[0] != outputs[1] {
            return Err(Error::Invalid(format!(
                "prompt {}: arm A ({}) and arm B ({}) produced different greedy outputs; speculative decoding must \
                 not change them:\nA {:?}\nB {:?}",
                p.source,
                a.name(),
                b.name(),
                outputs[0],
                outputs[1]
            )));
        }
        on_prompt(arms[0].prompts.last().expect("pushed"), arms[1].prompts.last().expect("pushed"));
    }
    for arm in &mut arms {
        arm.finish();
    }
    let [a, b] = arms;
    let rate = |p: &PromptResult| if p.drafted > 0 { p.accepted as f64 / p.drafted as f64 } else { 0.0 };
    let paired = a.prompts.iter().zip(&b.prompts).map(|(x, y)| rate(y) - rate(x)).sum::<f64>() / prompts.len() as f64;
    let acceptance_drop_points = 100.0 * (a.acceptance_rate - b.acceptance_rate);
    let speed_ratio = if a.tokens_per_s > 0.0 { b.tokens_per_s / a.tokens_per_s } else { 0.0 };
    let pass = acceptance_drop_points <= max_drop_points && speed_ratio > 1.0;
    Ok(AbReport {
        num_draft_tokens,
        max_tokens,
        a,
        b,
        acceptance_drop_points,
        paired_mean_diff_points: 100.0 * paired,
        speed_ratio,
        max_drop_points,
        pass,
    })
}
