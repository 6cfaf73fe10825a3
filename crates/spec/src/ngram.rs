//! Prompt lookup decoding (Saxena's "Prompt Lookup Decoding", vLLM's `ngram` proposer, the
//! mlx-bun seed's `ngram-source.ts`): drafts are copied from the request's own token stream.
//! When the trailing k-gram of `prompt ++ emitted` occurred earlier, the tokens that
//! followed its earliest occurrence are proposed. No weights, no cache; lossless like every
//! source, because the target decides every token.
//!
//! How many of those tokens a round proposes is a [`DraftSchedule`]: all of them up to
//! `num_draft_tokens` (`Constant`, the classic rule), or a budget per match length that
//! grows while drafts are accepted and shrinks, down to plain decode steps, while they are
//! rejected (`Heuristic`, after Hugging Face's `num_assistant_tokens_schedule="heuristic"`),
//! so free-form text, where short matches rarely continue, does not pay for long verify
//! windows that are thrown away.
use std::collections::HashMap;

use models::{Sampler, Transformer};

use crate::{DraftProvider, DraftSource, Error, Result};

/// Default longest k-gram tried (Saxena's `max_ngram_size`).
pub const DEFAULT_NGRAM_MAX: usize = 3;
/// Default shortest k-gram tried.
pub const DEFAULT_NGRAM_MIN: usize = 1;
/// Default drafts per round for n-gram drafting (Saxena's `num_pred_tokens`).
pub const DEFAULT_NUM_DRAFT_TOKENS: usize = 10;
/// Under [`DraftSchedule::Heuristic`], a match length whose budget fell to 0 proposes one
/// token again after this many skipped matches (a probe: the text may have turned into
/// something the prompt predicts).
pub const PROBE_AFTER_SKIPS: usize = 8;

/// How many of the tokens a match offers a round proposes. The default, for every caller
/// (`mlx-spec generate`, the A/B, [`NgramProvider::default`]), is `Heuristic`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum DraftSchedule {
    /// Every offered token, up to `num_draft_tokens` (Saxena; vLLM's `ngram` proposer).
    Constant,
    /// A budget per match length `k`, starting at `num_draft_tokens`: `+2` (capped) after a
    /// round that accepted every draft, `max(accepted, budget / 2)` after a rejection
    /// (Hugging Face transformers' heuristic schedule adds 2 / subtracts 1; halving reaches
    /// plain steps within a few rounds of free-form text). A budget of 0 proposes nothing
    /// (a plain decode step) except for one token every [`PROBE_AFTER_SKIPS`] + 1 matches.
    #[default]
    Heuristic,
}

impl DraftSchedule {
    /// The schedule's name as `--ngram-schedule` takes it: `heuristic` or `constant`.
    pub fn name(self) -> &'static str {
        match self {
            DraftSchedule::Constant => "constant",
            DraftSchedule::Heuristic => "heuristic",
        }
    }
}

impl std::str::FromStr for DraftSchedule {
    type Err = String;

    /// Parses `heuristic` or `constant`.
    fn from_str(s: &str) -> std::result::Result<Self, Self::Err> {
        match s {
            "heuristic" => Ok(DraftSchedule::Heuristic),
            "constant" => Ok(DraftSchedule::Constant),
            _ => Err(format!("unknown n-gram schedule `{s}`: expected `heuristic` or `constant`")),
        }
    }
}

/// The reference proposal rule, by a direct scan (O(len · k) per call): for `k` from
/// `min(max, len - 1)` down to `min`, find the earliest `i` with
/// `history[i..i+k] == history[len-k..]` and `i + k < len` (which rules out the trailing
/// k-gram matching itself and guarantees one continuation token); propose
/// `history[i+k .. min(i+k+n, len)]`. Empty when no k-gram matches. [`NgramIndex::propose`]
/// returns the same tokens in O(max - min + n) per call.
pub fn propose_naive(history: &[u32], n: usize, max: usize, min: usize) -> Vec<u32> {
    let len = history.len();
    let top = max.min(len.saturating_sub(1));
    for k in (min.max(1)..=top).rev() {
        let tail = &history[len - k..];
        if let Some(i) = (0..len - k).find(|&i| &history[i..i + k] == tail) {
            return history[i + k..(i + k + n).min(len)].to_vec();
        }
    }
    Vec::new()
}

/// A token history with, for every k-gram length in `min..=max`, the position of each
/// k-gram's first occurrence, updated as tokens are appended (the history only grows).
#[derive(Debug, Clone)]
pub struct NgramIndex {
    tokens: Vec<u32>,
    min: usize,
    max: usize,
    /// `first[k - min]`: k-gram -> start of its earliest occurrence.
    first: Vec<HashMap<Box<[u32]>, usize>>,
}

impl NgramIndex {
    /// An empty index for k-grams of lengths `min..=max`.
    ///
    /// # Errors
    /// [`Error::Invalid`] unless `1 <= min <= max`.
    pub fn new(max: usize, min: usize) -> Result<Self> {
        if min == 0 || min > max {
            return Err(Error::Invalid(format!(
                "n-gram lengths need 1 <= ngram_min <= ngram_max, got {min} and {max}"
            )));
        }
        Ok(NgramIndex { tokens: Vec::new(), min, max, first: vec![HashMap::new(); max - min + 1] })
    }

    /// The history.
    pub fn tokens(&self) -> &[u32] {
        &self.tokens
    }

    /// Appends one token, indexing the k-grams that end with it.
    pub fn push(&mut self, token: u32) {
        self.tokens.push(token);
        let len = self.tokens.len();
        for k in self.min..=self.max.min(len) {
            let gram = &self.tokens[len - k..];
            let map = &mut self.first[k - self.min];
            if !map.contains_key(gram) {
                map.insert(gram.into(), len - k);
            }
        }
    }

    /// Appends tokens in order.
    pub fn extend(&mut self, tokens: &[u32]) {
        for &t in tokens {
            self.push(t);
        }
    }

    /// Up to `n` tokens that followed the earliest earlier occurrence of the longest
    /// trailing k-gram (`k` from `max` down to `min`); the same as [`propose_naive`].
    pub fn propose(&self, n: usize) -> Vec<u32> {
        self.propose_match(n).map(|(_, t)| t).unwrap_or_default()
    }

    /// [`NgramIndex::propose`] with the length `k` of the matched k-gram; `None` when no
    /// k-gram matches.
    pub fn propose_match(&self, n: usize) -> Option<(usize, Vec<u32>)> {
        let len = self.tokens.len();
        for k in (self.min..=self.max.min(len.saturating_sub(1))).rev() {
            let tail = &self.tokens[len - k..];
            // The trailing k-gram is indexed, so its first occurrence is at most len - k;
            // anything earlier is a real earlier occurrence with a continuation.
            match self.first[k - self.min].get(tail) {
                Some(&i) if i + k < len => return Some((k, self.tokens[i + k..(i + k + n).min(len)].to_vec())),
                _ => {}
            }
        }
        None
    }
}

/// Opens [`NgramSource`]s; holds only the k-gram bounds and the schedule.
#[derive(Debug, Clone)]
pub struct NgramProvider {
    max: usize,
    min: usize,
    schedule: DraftSchedule,
}

impl NgramProvider {
    /// Prompt lookup with k-grams from `ngram_max` down to `ngram_min`.
    ///
    /// # Errors
    /// [`Error::Invalid`] unless `1 <= ngram_min <= ngram_max`.
    pub fn new(ngram_max: usize, ngram_min: usize) -> Result<Self> {
        NgramIndex::new(ngram_max, ngram_min)?;
        Ok(NgramProvider { max: ngram_max, min: ngram_min, schedule: DraftSchedule::default() })
    }

    /// The same provider with another [`DraftSchedule`] (the default is `Heuristic`).
    pub fn with_schedule(mut self, schedule: DraftSchedule) -> Self {
        self.schedule = schedule;
        self
    }

    /// The schedule of the sources this provider opens.
    pub fn schedule(&self) -> DraftSchedule {
        self.schedule
    }
}

impl Default for NgramProvider {
    /// k-grams [`DEFAULT_NGRAM_MAX`] down to [`DEFAULT_NGRAM_MIN`], [`DraftSchedule::default`].
    fn default() -> Self {
        NgramProvider { max: DEFAULT_NGRAM_MAX, min: DEFAULT_NGRAM_MIN, schedule: DraftSchedule::default() }
    }
}

impl DraftProvider for NgramProvider {
    fn name(&self) -> &str {
        "ngram"
    }

    fn open<'a>(&'a self, _target: &'a Transformer, _sampler: &Sampler) -> Result<Box<dyn DraftSource + 'a>> {
        Ok(Box::new(NgramSource::new(self.max, self.min)?.with_schedule(self.schedule)))
    }
}

/// The per-request n-gram source. Its history is `prompt ++ emitted` whenever it drafts:
/// `prefill` stores `prompt[..n-1]`, `draft` appends the feed, `commit` appends the accepted
/// drafts except an all-accept round's last one, which the executor re-feeds with the bonus.
#[derive(Debug, Clone)]
pub struct NgramSource {
    index: NgramIndex,
    prompt_len: usize,
    last_drafts: Vec<u32>,
    schedule: DraftSchedule,
    /// Heuristic schedule, per match length `k - min`: the draft budget (`None` until the
    /// first draft call sets it to `n`) and the matches skipped since it fell to 0.
    budget: Vec<(Option<usize>, usize)>,
    /// Match length of the last proposal, and the `n` it was drafted under.
    last_match: Option<(usize, usize)>,
}

impl NgramSource {
    /// A source with k-grams from `ngram_max` down to `ngram_min`.
    ///
    /// # Errors
    /// [`Error::Invalid`] unless `1 <= ngram_min <= ngram_max`.
    pub fn new(ngram_max: usize, ngram_min: usize) -> Result<Self> {
        Ok(NgramSource {
            index: NgramIndex::new(ngram_max, ngram_min)?,
            prompt_len: 0,
            last_drafts: Vec::new(),
            schedule: DraftSchedule::default(),
            budget: vec![(None, 0); ngram_max - ngram_min + 1],
            last_match: None,
        })
    }

    /// The same source with another [`DraftSchedule`] (the default is `Heuristic`).
    pub fn with_schedule(mut self, schedule: DraftSchedule) -> Self {
        self.schedule = schedule;
        self
    }

    /// Cuts a proposal from a `k`-gram match to the heuristic budget of `k` (see
    /// [`DraftSchedule::Heuristic`]).
    fn apply_budget(&mut self, k: usize, n: usize, mut drafts: Vec<u32>) -> Vec<u32> {
        let (budget, skipped) = &mut self.budget[k - self.index.min];
        let b = budget.get_or_insert(n);
        if *b == 0 {
            *skipped += 1;
            if *skipped <= PROBE_AFTER_SKIPS {
                return Vec::new();
            }
            *skipped = 0;
            *b = 1;
        }
        drafts.truncate((*b).min(n));
        drafts
    }

    /// The reconstructed `prompt ++ emitted` stream (ends at the pending token after `draft`).
    pub fn history(&self) -> &[u32] {
        self.index.tokens()
    }

    fn contract(&self, message: String) -> Error {
        Error::Contract { source_name: self.name().to_string(), message }
    }
}

impl DraftSource for NgramSource {
    fn name(&self) -> &str {
        "ngram"
    }

    fn prefill(&mut self, prompt: &[u32], _taps: Option<&[mlx_core::Array]>) -> Result<()> {
        let Some((_, head)) = prompt.split_last() else {
            return Err(Error::Invalid("an empty prompt".into()));
        };
        self.index = NgramIndex::new(self.index.max, self.index.min)?;
        self.index.extend(head);
        self.prompt_len = prompt.len();
        self.last_drafts.clear();
        self.budget.iter_mut().for_each(|b| *b = (None, 0));
        self.last_match = None;
        Ok(())
    }

    fn draft(&mut self, feed: &[u32], n: usize, step: usize) -> Result<Vec<u32>> {
        if feed.is_empty() {
            return Err(self.contract(format!("empty feed at step {step}")));
        }
        self.index.extend(feed);
        let len = self.index.tokens().len();
        if len != self.prompt_len + step {
            return Err(self.contract(format!(
                "history holds {len} tokens at step {step}, expected prompt {} + {step}",
                self.prompt_len
            )));
        }
        self.last_match = None;
        self.last_drafts = match (self.index.propose_match(n), self.schedule) {
            (None, _) => Vec::new(),
            (Some((_, drafts)), DraftSchedule::Constant) => drafts,
            (Some((k, drafts)), DraftSchedule::Heuristic) => {
                let drafts = self.apply_budget(k, n, drafts);
                self.last_match = (!drafts.is_empty()).then_some((k, n));
                drafts
            }
        };
        Ok(self.last_drafts.clone())
    }

    fn commit(&mut self, drafted: usize, accepted: usize, _taps: Option<&[mlx_core::Array]>) -> Result<()> {
        if drafted != self.last_drafts.len() || accepted > drafted {
            return Err(self
                .contract(format!("commit({drafted}, {accepted}) after drafting {} tokens", self.last_drafts.len())));
        }
        let keep = accepted.min(drafted.saturating_sub(1));
        let drafts = std::mem::take(&mut self.last_drafts);
        self.index.extend(&drafts[..keep]);
        if let Some((k, n)) = self.last_match.take() {
            let (budget, _) = &mut self.budget[k - self.index.min];
            let b = budget.unwrap_or(n);
            *budget = Some(if accepted == drafted { (b + 2).min(n) } else { accepted.max(b / 2) });
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    #[test]
    fn rule_examples() {
        // Longest k first: the trailing 3-gram [1, 2, 3] occurred at 0 and 4; the earliest wins.
        let h = [1, 2, 3, 9, 1, 2, 3, 8, 1, 2, 3];
        assert_eq!(propose_naive(&h, 10, 3, 1), vec![9, 1, 2, 3, 8, 1, 2, 3]);
        assert_eq!(propose_naive(&h, 2, 3, 1), vec![9, 1]);
        // No self match: a history that is only its trailing k-gram proposes nothing.
        assert_eq!(propose_naive(&[5, 6, 7], 4, 3, 1), Vec::<u32>::new());
        // Shorter k when the longer one is new: [4, 7] unseen, [7] seen at 1.
        assert_eq!(propose_naive(&[0, 7, 3, 4, 7], 3, 3, 1), vec![3, 4, 7]);
        // min bounds the search.
        assert_eq!(propose_naive(&[0, 7, 3, 4, 7], 3, 3, 2), Vec::<u32>::new());
        // Overlapping occurrence: [a a a a] -> trailing [a a a] at 0, continuation [a].
        assert_eq!(propose_naive(&[4, 4, 4, 4], 5, 3, 1), vec![4]);
        let mut ix = NgramIndex::new(3, 1).unwrap();
        ix.extend(&h);
        assert_eq!(ix.propose(10), propose_naive(&h, 10, 3, 1));
        assert!(NgramIndex::new(2, 3).is_err());
        assert!(NgramIndex::new(2, 0).is_err());
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: 256, failure_persistence: None, ..ProptestConfig::default() })]

        /// The incremental index proposes exactly what the naive scan proposes, after every
        /// appended token, on histories over small alphabets (many repeats).
        #[test]
        fn index_equals_naive(
            alphabet in 1u32..6,
            raw in proptest::collection::vec(0u32..1000, 0..120),
            max in 1usize..6,
            span in 0usize..6,
            n in 0usize..12,
        ) {
            let min = max.saturating_sub(span).max(1);
            let history: Vec<u32> = raw.iter().map(|t| t % alphabet).collect();
            let mut ix = NgramIndex::new(max, min).unwrap();
            for (i, &t) in history.iter().enumerate() {
                ix.push(t);
                prop_assert_eq!(ix.propose(n), propose_naive(&history[..=i], n, max, min), "prefix {}", i + 1);
            }
        }

        /// Driving the source with the executor's protocol keeps its history equal to
        /// prompt ++ emitted: random accept counts, re-feed after all-accept rounds.
        #[test]
        fn history_is_prompt_plus_emitted(
            prompt in proptest::collection::vec(0u32..4, 1..30),
            rounds in proptest::collection::vec((0usize..8, 0usize..9, 0u32..4), 1..30),
            heuristic in any::<bool>(),
        ) {
            let schedule = if heuristic { DraftSchedule::Heuristic } else { DraftSchedule::Constant };
            let mut src = NgramSource::new(3, 1).unwrap().with_schedule(schedule);
            let driven = crate::source::drive_protocol(&mut src, |s| s.history().to_vec(), &prompt, &rounds);
            prop_assert!(driven.is_ok(), "{:?}", driven);
        }
    }

    /// The heuristic budget of one match length: halves to 0 while every draft is rejected,
    /// then skips [`PROBE_AFTER_SKIPS`] matches and probes with one token; grows by 2 up to
    /// `n` while all are accepted; a partial acceptance keeps at least what was accepted.
    /// One executor round on a history of one repeated token (every round matches and is
    /// offered `n` = 10 tokens): drafts, accepts all or none, commits, and sets the next feed
    /// and step as the executor does. Returns the number of drafts.
    fn drive(src: &mut NgramSource, step: &mut usize, feed: &mut Vec<u32>, accept_all: bool) -> usize {
        let d = src.draft(feed, 10, *step).unwrap().len();
        let a = if accept_all { d } else { 0 };
        src.commit(d, a, None).unwrap();
        (*feed, *step) = if d > 0 && a == d { (vec![5, 5], *step + d + 1) } else { (vec![5], *step + a + 1) };
        d
    }

    /// The heuristic budget of one match length: halves to 0 while every draft is rejected,
    /// then skips [`PROBE_AFTER_SKIPS`] matches and probes with one token; grows by 2 up to
    /// `n` while all are accepted; a partial acceptance keeps at least what was accepted.
    #[test]
    fn heuristic_schedule() {
        let fresh = || {
            let mut src = NgramSource::new(3, 1).unwrap().with_schedule(DraftSchedule::Heuristic);
            src.prefill(&[5; 40], None).unwrap();
            (src, 0, vec![5])
        };
        let (mut src, mut step, mut feed) = fresh();
        let lens: Vec<usize> = (0..14).map(|_| drive(&mut src, &mut step, &mut feed, false)).collect();
        // 10, 5, 2, 1, then 0 for 8 skipped matches, then a 1-token probe, rejected: 0 again.
        assert_eq!(lens, vec![10, 5, 2, 1, 0, 0, 0, 0, 0, 0, 0, 0, 1, 0]);
        // Recovery: an accepted probe grows the budget by 2 per all-accept round (drafting
        // rounds only).
        let (mut src, mut step, mut feed) = fresh();
        let mut lens = Vec::new();
        for accept_all in [false, false, false, false, true, true, true, true, true, true] {
            lens.push(loop {
                match drive(&mut src, &mut step, &mut feed, accept_all) {
                    0 => continue,
                    d => break d,
                }
            });
        }
        assert_eq!(lens, vec![10, 5, 2, 1, 1, 3, 5, 7, 9, 10]);
        // A partial acceptance keeps max(accepted, budget / 2).
        let (mut src, _, _) = fresh();
        assert_eq!(src.draft(&[5], 10, 0).unwrap().len(), 10);
        src.commit(10, 8, None).unwrap();
        assert_eq!(src.draft(&[5], 10, 9).unwrap().len(), 8);
        // The constant schedule always proposes what the match offers.
        let mut src = NgramSource::new(3, 1).unwrap().with_schedule(DraftSchedule::Constant);
        src.prefill(&[5; 40], None).unwrap();
        let (mut step, mut feed) = (0, vec![5]);
        assert!((0..6).all(|_| drive(&mut src, &mut step, &mut feed, false) == 10));
    }

    #[test]
    fn contract_errors() {
        let mut src = NgramSource::new(3, 1).unwrap();
        src.prefill(&[1, 2, 3], None).unwrap();
        assert!(matches!(src.draft(&[], 3, 0), Err(Error::Contract { .. })));
        let mut src = NgramSource::new(3, 1).unwrap();
        src.prefill(&[1, 2, 1, 2], None).unwrap();
        // Step 1 is wrong: nothing was emitted yet.
        assert!(matches!(src.draft(&[2], 3, 1), Err(Error::Contract { .. })));
        let mut src = NgramSource::new(3, 1).unwrap();
        src.prefill(&[1, 2, 1, 2], None).unwrap();
        let d = src.draft(&[2], 3, 0).unwrap();
        assert_eq!(d, vec![1, 2]);
        assert!(matches!(src.commit(3, 0, None), Err(Error::Contract { .. })));
    }

    #[test]
    fn fast_on_long_histories() {
        // 30k tokens over a 50-token alphabet with a repeated block: per-token push plus a
        // proposal at every step must stay far below the naive scan's cost.
        let mut x = 0x2545_f491_4f6c_dd1du64;
        let mut next = || {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            (x % 50) as u32
        };
        let block: Vec<u32> = (0..500).map(|_| next()).collect();
        let mut ix = NgramIndex::new(3, 1).unwrap();
        let t = std::time::Instant::now();
        let mut proposed = 0;
        for i in 0..30_000 {
            ix.push(if i % 3000 < 500 { block[i % 500] } else { next() });
            proposed += ix.propose(10).len();
        }
        assert!(proposed > 0);
        let dt = t.elapsed();
        assert!(dt.as_secs_f64() < 5.0, "30k pushes + proposals took {dt:?}");
    }
}
