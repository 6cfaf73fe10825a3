//! What one speculative request did: rounds, drafts, acceptance, timing.

/// Statistics of one [`crate::speculative_generate`] request.
///
/// # Definitions
///
/// A *round* is one target forward over the verify window `[pending] ++ drafts` (`d` drafts,
/// `0 <= d <= num_draft_tokens`, and `d <= r` under a `draft_cap` of `r`); after a fallback
/// to plain decoding every plain step whose token was read is a round with `d = 0` (the
/// pipelined step queued ahead of the last one is not counted). Every emitted token is
/// counted exactly once, when it is handed to the caller, as one of:
///
/// - *accepted*: a draft token the target sampled too;
/// - *correction*: the target's token at the first position where it disagreed with a draft;
/// - *bonus*: the target's token at the window's last position (after all `d` drafts were
///   accepted, including `d = 0` rounds, which are exactly one plain decode step).
///
/// EOS is never emitted and never counted. A round cut short (EOS sampled, `max_tokens`
/// reached, the caller's `on_token` returned `false`) counts the tokens emitted up to the
/// cut; the drafts it did not reach stay in `drafted` and not in `accepted`. The executor
/// asks for at most `max_tokens - emitted - 1` drafts, so `max_tokens` never cuts into
/// drafts. The invariants ([`SpecStats::check`]):
///
/// - `drafted == sum(drafted_by_pos)`, `accepted == sum(accepted_by_pos)`, and per block
///   position `accepted_by_pos[j] <= drafted_by_pos[j]`, non-increasing in `j`;
/// - `accepted <= drafted`;
/// - `emitted == accepted + corrections + bonuses`;
/// - `corrections + bonuses <= rounds` (at most one target token closes a round);
/// - `rounds == target_forwards`, `empty_rounds == rounds - drafted_by_pos[0]`;
/// - `tau == (accepted + rounds) / rounds`, the mean over rounds of `accepted + 1`.
#[derive(Debug, Clone, Default, PartialEq, serde::Serialize)]
pub struct SpecStats {
    /// Prompt length in tokens.
    pub prompt_tokens: usize,
    /// Prompt tokens the target cache already held when the request started (a prompt-cache
    /// hit, [`crate::Request::cache`]); the prefill ran over the other
    /// `prompt_tokens - cached_tokens`.
    pub cached_tokens: usize,
    /// The requested maximum drafts per round.
    pub num_draft_tokens: usize,
    /// `Some(r)` when the target cache's exact-rollback reach `r`
    /// ([`models::ModelCache::rollback_reach`]) is below `num_draft_tokens`: every round then
    /// drafted at most `r` tokens (`drafted_by_pos` keeps `num_draft_tokens` slots; those from
    /// `r` on stay 0).
    pub draft_cap: Option<usize>,
    /// Verify rounds (including plain steps after a fallback).
    pub rounds: usize,
    /// Rounds with no drafts (`d = 0`): the source proposed nothing, no budget was left for
    /// drafts, or the request had fallen back to plain decoding.
    pub empty_rounds: usize,
    /// Target forward passes that computed logits, counted one per round (a round that
    /// drafts right after a plain step runs its window as two forwards, the head queued
    /// ahead by the plain step and the drafts, and counts one).
    pub target_forwards: usize,
    /// Rounds without drafts that ran as plain decoding's pipelined step (the next step's
    /// forward queued before this one's token was read; see
    /// [`crate::DraftSource::pipeline_plain_steps`]).
    pub pipelined_steps: usize,
    /// Target prefill forward passes (prompt chunks, plus any re-prefill after a fallback).
    pub prefill_forwards: usize,
    /// Draft tokens proposed (sum of `d` over rounds).
    pub drafted: usize,
    /// Draft tokens accepted and emitted.
    pub accepted: usize,
    /// Tokens handed to the caller (EOS excluded).
    pub emitted: usize,
    /// Emitted target tokens that replaced a rejected draft.
    pub corrections: usize,
    /// Emitted target tokens at the end of a fully accepted window (including `d = 0`).
    pub bonuses: usize,
    /// `accepted / drafted` (0 when nothing was drafted).
    pub acceptance_rate: f64,
    /// Mean acceptance length: the mean over rounds of `accepted + 1` (0 with no rounds).
    pub tau: f64,
    /// `drafted_by_pos[j]`: rounds that drafted a token at block position `j` (0-based).
    pub drafted_by_pos: Vec<usize>,
    /// `accepted_by_pos[j]`: rounds whose draft at block position `j` was accepted.
    pub accepted_by_pos: Vec<usize>,
    /// Wall time of the prefill (target and source), milliseconds.
    pub prefill_ms: f64,
    /// Wall time of the rounds, milliseconds (includes `draft_ms`).
    pub decode_ms: f64,
    /// Wall time spent in the source's `draft` and `commit`, milliseconds.
    pub draft_ms: f64,
    /// `emitted / decode time`, tokens per second (0 when nothing was emitted).
    pub tokens_per_s: f64,
    /// Whether an EOS token ended the request.
    pub stopped_on_eos: bool,
    /// `Some(k)` when, after `k` emitted tokens, the target cache could not roll back exactly
    /// and the request continued as plain decoding from a re-prefilled cache (with the
    /// pipelined step of [`models::generate::decode`]; `decode_ms` includes the re-prefill).
    pub fallback_at: Option<usize>,
    /// MLX peak memory during the request, bytes.
    pub peak_memory_bytes: usize,
    /// Where the rounds' wall time went ([`RoundProfile`]).
    pub profile: RoundProfile,
}

/// Where the wall time of a request's rounds went, milliseconds summed over rounds. The
/// phases do not overlap; `decode_ms` minus their sum is the executor's own bookkeeping.
/// A plain step (a round with no drafts, run pipelined) is one phase, `plain_ms`: its graph
/// building overlaps the previous step's forward, so it cannot be split.
#[derive(Debug, Clone, Default, PartialEq, serde::Serialize)]
pub struct RoundProfile {
    /// The source's `draft` calls.
    pub draft_ms: f64,
    /// Building the verify window's graph (the target's `forward` call, before evaluation).
    pub build_ms: f64,
    /// Evaluating the window (the target forward, its LM head and the window's samples).
    pub forward_ms: f64,
    /// The accept walk: reading the window's tokens (and, under the rejection rule or with
    /// logprobs, the rows), emitting them.
    pub walk_ms: f64,
    /// Trimming the target cache over the rejected drafts.
    pub rollback_ms: f64,
    /// The source's `commit` calls.
    pub commit_ms: f64,
    /// Plain steps (rounds without drafts), whole.
    pub plain_ms: f64,
}

impl RoundProfile {
    /// The phases as `(name, milliseconds)`, in round order.
    pub fn phases(&self) -> [(&'static str, f64); 7] {
        [
            ("draft", self.draft_ms),
            ("build", self.build_ms),
            ("forward", self.forward_ms),
            ("walk", self.walk_ms),
            ("rollback", self.rollback_ms),
            ("commit", self.commit_ms),
            ("plain", self.plain_ms),
        ]
    }
}

impl SpecStats {
    pub(crate) fn new(prompt_tokens: usize, num_draft_tokens: usize) -> Self {
        SpecStats {
            prompt_tokens,
            num_draft_tokens,
            drafted_by_pos: vec![0; num_draft_tokens],
            accepted_by_pos: vec![0; num_draft_tokens],
            ..Default::default()
        }
    }

    /// Computes the derived rates (`acceptance_rate`, `tau`, `tokens_per_s`).
    pub(crate) fn finish(&mut self) {
        self.acceptance_rate = if self.drafted > 0 { self.accepted as f64 / self.drafted as f64 } else { 0.0 };
        self.tau = if self.rounds > 0 { (self.accepted + self.rounds) as f64 / self.rounds as f64 } else { 0.0 };
        self.tokens_per_s =
            if self.emitted > 0 && self.decode_ms > 0.0 { self.emitted as f64 / (self.decode_ms / 1e3) } else { 0.0 };
    }

    /// Checks the invariants listed on [`SpecStats`].
    ///
    /// # Errors
    /// A message naming the first invariant that does not hold, with the numbers.
    pub fn check(&self) -> std::result::Result<(), String> {
        let sum = |v: &[usize]| v.iter().sum::<usize>();
        let fail = |what: &str| Err(format!("{what}: {self:?}"));
        if self.drafted != sum(&self.drafted_by_pos) {
            return fail("drafted != sum(drafted_by_pos)");
        }
        if self.accepted != sum(&self.accepted_by_pos) {
            return fail("accepted != sum(accepted_by_pos)");
        }
        if self.drafted_by_pos.len() != self.accepted_by_pos.len() {
            return fail("drafted_by_pos and accepted_by_pos differ in length");
        }
        for j in 0..self.drafted_by_pos.len() {
            if self.accepted_by_pos[j] > self.drafted_by_pos[j] {
                return fail(&format!("accepted_by_pos[{j}] > drafted_by_pos[{j}]"));
            }
            if j > 0 && self.accepted_by_pos[j] > self.accepted_by_pos[j - 1] {
                return fail(&format!("accepted_by_pos[{j}] > accepted_by_pos[{}]", j - 1));
            }
            if j > 0 && self.drafted_by_pos[j] > self.drafted_by_pos[j - 1] {
                return fail(&format!("drafted_by_pos[{j}] > drafted_by_pos[{}]", j - 1));
            }
        }
        if self.accepted > self.drafted {
            return fail("accepted > drafted");
        }
        if self.emitted != self.accepted + self.corrections + self.bonuses {
            return fail("emitted != accepted + corrections + bonuses");
        }
        if self.corrections + self.bonuses > self.rounds {
            return fail("corrections + bonuses > rounds");
        }
        if self.rounds != self.target_forwards {
            return fail("rounds != target_forwards");
        }
        let first = self.drafted_by_pos.first().copied().unwrap_or(0);
        if self.empty_rounds + first != self.rounds {
            return fail("empty_rounds != rounds - drafted_by_pos[0]");
        }
        let tau = if self.rounds > 0 { (self.accepted + self.rounds) as f64 / self.rounds as f64 } else { 0.0 };
        if (self.tau - tau).abs() > 1e-12 {
            return fail("tau != (accepted + rounds) / rounds");
        }
        Ok(())
    }
}
