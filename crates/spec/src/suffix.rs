//! Suffix drafting (SuffixDecoding, Oliaro et al., arXiv 2411.04975; the suffix automata of
//! TensorRT-LLM and sglang; SAM-Decoding, arXiv 2411.10666): drafts are copied from the
//! request's own token stream, and optionally from earlier requests' streams, at the
//! **longest** earlier match of the stream's suffix (up to [`MAX_MATCH`] tokens) rather than
//! at the first occurrence of a 1-3-gram ([`crate::ngram`]).
//!
//! The index is a suffix automaton (Blumer et al. 1985) over `prompt ++ emitted`, extended by
//! one token per committed token (amortised O(1)), whose states also carry their occurrence
//! count and latest end position (kept for the states that hold a string of at most
//! `MAX_MATCH + 1` tokens, the only ones a proposal reads). [`propose_naive`] states the rule
//! by direct search; [`SuffixIndex::propose`] returns the same tokens.
//!
//! How many of the proposed tokens a round verifies is the cost-aware policy of
//! [`crate::policy`]: the provider holds the target's cost curve and the acceptance
//! estimates of every request it served; a round drafts the `k*` that maximises the expected
//! tokens per unit of time, `0` (a plain step) when no window beats a plain step.
use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex};

use models::{Sampler, Transformer};

use crate::policy::{AcceptanceModel, CostCurve, CostModel, Origin, SurvivalKey};
use crate::{DraftProvider, DraftSource, Error, Result};

/// The longest match looked for (tokens of the history's suffix).
pub const MAX_MATCH: usize = 64;
/// The most tokens one proposal holds.
pub const MAX_PROPOSAL: usize = 32;
/// Default number of earlier requests' streams kept by a [`SuffixProvider`] (least recently
/// used out).
pub const DEFAULT_STORE_REQUESTS: usize = 16;

/// The most tokens a match of `m` tokens may propose: `min(MAX_PROPOSAL, 2m + 2)` (a longer
/// match earns a longer proposal, after SuffixDecoding's `m * max_spec_factor`).
pub fn proposal_cap(m: usize) -> usize {
    MAX_PROPOSAL.min(2 * m + 2)
}

/// A proposal: where it was copied from and the tokens.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Proposal {
    /// Length of the matched suffix (`1..=MAX_MATCH`).
    pub match_len: usize,
    /// End position of the chosen earlier occurrence (its continuation starts there).
    pub end: usize,
    /// The proposed tokens (at most `n` and at most [`proposal_cap`]`(match_len)`).
    pub tokens: Vec<u32>,
}

/// The reference rule, by direct search (O(len · MAX_MATCH) per call). With `L =
/// history.len()`:
///
/// 1. `m` is the largest length in `1..=min(MAX_MATCH, L - 1)` such that the suffix
///    `history[L-m..]` also ends at some `e < L` (`history[e-m..e] == history[L-m..]`); no
///    such `m`: no proposal.
/// 2. Among those ends `e`, choose `prefer` when it is one (it continues the previous copy);
///    otherwise the continuation token `history[e]` that follows the most ends (frequency),
///    ties to the token whose latest end is latest, and that latest end (recency).
/// 3. Propose `min(n, proposal_cap(m))` tokens copied from `e` on, the copy running on into
///    its own output past `L` (LZ77 style: `x[e + j]` over `x = history ++ proposal`), so a
///    loop repeats.
pub fn propose_naive(history: &[u32], n: usize, prefer: Option<usize>) -> Option<Proposal> {
    let len = history.len();
    let top = MAX_MATCH.min(len.saturating_sub(1));
    for m in (1..=top).rev() {
        let tail = &history[len - m..];
        let ends: Vec<usize> = (m..len).filter(|&e| &history[e - m..e] == tail).collect();
        if ends.is_empty() {
            continue;
        }
        let end = match prefer.filter(|p| ends.contains(p)) {
            Some(p) => p,
            None => {
                let mut best: Option<(usize, usize, usize)> = None; // (count, latest end, token)
                for &e in &ends {
                    let c = history[e];
                    let count = ends.iter().filter(|&&f| history[f] == c).count();
                    let latest = ends.iter().copied().filter(|&f| history[f] == c).max().unwrap_or(e);
                    if best.is_none_or(|(bc, bl, _)| (count, latest) > (bc, bl)) {
                        best = Some((count, latest, c as usize));
                    }
                }
                best.expect("ends is not empty").1
            }
        };
        return Some(Proposal { match_len: m, end, tokens: copy_from(history, end, n.min(proposal_cap(m))) });
    }
    None
}

/// `count` tokens copied from `history[end..]`, running on into the copy past the end.
fn copy_from(history: &[u32], end: usize, count: usize) -> Vec<u32> {
    let len = history.len();
    let mut out = Vec::with_capacity(count);
    for j in 0..count {
        let i = end + j;
        out.push(if i < len { history[i] } else { out[i - len] });
    }
    out
}

/// States holding a string of at most this many tokens carry exact counts.
const TRACKED: usize = MAX_MATCH + 1;

#[derive(Debug, Clone)]
struct State {
    len: usize,
    link: Option<usize>,
    next: HashMap<u32, usize>,
    /// Occurrences (end positions) of the state's strings; exact while `minlen <= TRACKED`.
    count: usize,
    /// The latest end position (a prefix length); exact while `minlen <= TRACKED`.
    last_end: usize,
    /// A state on this state's suffix-link path at or before the first one with
    /// `len(link) < TRACKED` (a shortcut past long repeated suffixes).
    jump: usize,
}

/// A token history with its suffix automaton (see the module docs), growing one token at a
/// time.
#[derive(Debug, Clone)]
pub struct SuffixIndex {
    tokens: Vec<u32>,
    states: Vec<State>,
    last: usize,
}

impl Default for SuffixIndex {
    fn default() -> Self {
        Self::new()
    }
}

impl SuffixIndex {
    /// An empty index.
    pub fn new() -> Self {
        let root = State { len: 0, link: None, next: HashMap::new(), count: 0, last_end: 0, jump: 0 };
        SuffixIndex { tokens: Vec::new(), states: vec![root], last: 0 }
    }

    /// An index over `tokens`.
    pub fn from_tokens(tokens: &[u32]) -> Self {
        let mut ix = Self::new();
        ix.extend(tokens);
        ix
    }

    /// The history.
    pub fn tokens(&self) -> &[u32] {
        &self.tokens
    }

    fn link_len(&self, v: usize) -> usize {
        self.states[v].link.map_or(0, |l| self.states[l].len)
    }

    /// The first state on `v`'s suffix-link path whose strings start at `TRACKED` tokens or
    /// fewer (`len(link) < TRACKED`); the root qualifies.
    fn tracked_from(&self, v: usize) -> usize {
        let mut u = self.states[v].jump;
        while self.states[u].link.is_some() && self.link_len(u) >= TRACKED {
            u = self.states[self.states[u].link.expect("checked")].jump;
        }
        u
    }

    fn set_jump(&mut self, v: usize) {
        let jump = match self.states[v].link {
            Some(l) if self.states[l].len >= TRACKED => self.tracked_from(l),
            _ => v,
        };
        self.states[v].jump = jump;
    }

    /// Appends one token (amortised O(1) plus at most `TRACKED` count updates).
    pub fn push(&mut self, c: u32) {
        self.tokens.push(c);
        let end = self.tokens.len();
        let cur = self.states.len();
        let cur_len = self.states[self.last].len + 1;
        self.states.push(State { len: cur_len, link: None, next: HashMap::new(), count: 0, last_end: end, jump: cur });
        let mut p = Some(self.last);
        while let Some(pi) = p {
            if self.states[pi].next.contains_key(&c) {
                break;
            }
            self.states[pi].next.insert(c, cur);
            p = self.states[pi].link;
        }
        match p {
            None => self.states[cur].link = Some(0),
            Some(pi) => {
                let q = self.states[pi].next[&c];
                if self.states[pi].len + 1 == self.states[q].len {
                    self.states[cur].link = Some(q);
                } else {
                    let clone = self.states.len();
                    let mut st = self.states[q].clone();
                    st.len = self.states[pi].len + 1;
                    self.states.push(st);
                    let mut pp = Some(pi);
                    while let Some(x) = pp {
                        if self.states[x].next.get(&c) != Some(&q) {
                            break;
                        }
                        self.states[x].next.insert(c, clone);
                        pp = self.states[x].link;
                    }
                    self.states[q].link = Some(clone);
                    self.states[cur].link = Some(clone);
                    self.set_jump(clone);
                    self.set_jump(q);
                }
            }
        }
        self.set_jump(cur);
        self.last = cur;
        // Every state on cur's suffix-link path gains the end position `end`; only the tracked
        // tail of the path (at most TRACKED states, `len(link)` strictly decreasing) is kept.
        let mut u = Some(self.tracked_from(cur));
        while let Some(ui) = u {
            if ui == 0 {
                break;
            }
            let s = &mut self.states[ui];
            s.count += 1;
            s.last_end = end;
            u = s.link;
        }
    }

    /// Appends tokens in order.
    pub fn extend(&mut self, tokens: &[u32]) {
        for &t in tokens {
            self.push(t);
        }
    }

    /// The state of the history's suffix of `min(MAX_MATCH, longest repeated)` tokens, and
    /// that length; `None` when the last token never occurred before.
    fn tail_state(&self) -> Option<(usize, usize)> {
        let v = self.states[self.last].link?;
        let m = self.states[v].len.min(MAX_MATCH);
        if m == 0 {
            return None;
        }
        let mut v = self.tracked_from(v);
        // `v` now has len(link) < TRACKED; at most one step more reaches len(link) < m.
        while self.link_len(v) >= m {
            v = self.states[v].link.expect("a state with a non-empty link length has a link");
        }
        Some((v, m))
    }

    /// The end `e` a match state `v` chooses by frequency, then recency.
    fn frequent_end(&self, v: usize) -> Option<usize> {
        self.states[v]
            .next
            .values()
            .map(|&w| (self.states[w].count, self.states[w].last_end))
            .max()
            .map(|(_, last)| last - 1)
    }

    /// The proposal of [`propose_naive`] for this history, in O(MAX_MATCH + continuations +
    /// n) per call.
    pub fn propose(&self, n: usize, prefer: Option<usize>) -> Option<Proposal> {
        let (v, m) = self.tail_state()?;
        let len = self.tokens.len();
        let continues = |p: usize| p >= m && p < len && self.tokens[p - m..p] == self.tokens[len - m..];
        let end = match prefer.filter(|&p| continues(p)) {
            Some(p) => p,
            None => self.frequent_end(v)?,
        };
        Some(Proposal { match_len: m, end, tokens: copy_from(&self.tokens, end, n.min(proposal_cap(m))) })
    }
}

/// A streaming matcher of one request's history against an earlier request's index: the
/// longest suffix of the history (at most [`MAX_MATCH`]) that occurs anywhere in the earlier
/// stream with a continuation.
#[derive(Debug, Clone)]
struct StoreMatch {
    doc: Arc<SuffixIndex>,
    state: usize,
    len: usize,
}

impl StoreMatch {
    fn new(doc: Arc<SuffixIndex>) -> Self {
        StoreMatch { doc, state: 0, len: 0 }
    }

    fn push(&mut self, c: u32) {
        let st = &self.doc.states;
        let mut v = self.state;
        let mut l = self.len;
        loop {
            if let Some(&w) = st[v].next.get(&c) {
                v = w;
                l += 1;
                break;
            }
            match st[v].link {
                Some(link) => {
                    v = link;
                    l = st[v].len;
                }
                None => {
                    l = 0;
                    break;
                }
            }
        }
        if l > MAX_MATCH {
            l = MAX_MATCH;
            while self.doc.link_len(v) >= l {
                v = st[v].link.expect("checked");
            }
        }
        self.state = v;
        self.len = l;
    }

    /// The proposal from the earlier stream: the match and its frequent, latest continuation.
    fn propose(&self, n: usize) -> Option<Proposal> {
        if self.len == 0 {
            return None;
        }
        let end = self.doc.frequent_end(self.state)?;
        let take = n.min(proposal_cap(self.len));
        let tokens = self.doc.tokens[end..(end + take).min(self.doc.tokens.len())].to_vec();
        Some(Proposal { match_len: self.len, end, tokens })
    }
}

/// A bounded store of earlier requests' streams (`prompt ++ emitted`), least recently used
/// out.
#[derive(Debug, Default)]
struct Store {
    capacity: usize,
    docs: VecDeque<Arc<SuffixIndex>>,
}

impl Store {
    fn add(&mut self, doc: SuffixIndex) {
        if self.capacity == 0 || doc.tokens().len() < 2 {
            return;
        }
        while self.docs.len() >= self.capacity {
            self.docs.pop_front();
        }
        self.docs.push_back(Arc::new(doc));
    }

    /// Marks a document used (moved to the back: evicted last).
    fn touch(&mut self, doc: &Arc<SuffixIndex>) {
        if let Some(i) = self.docs.iter().position(|d| Arc::ptr_eq(d, doc)) {
            let d = self.docs.remove(i).expect("in range");
            self.docs.push_back(d);
        }
    }
}

/// Opens [`SuffixSource`]s. Holds what outlives a request: the cost model of the target, the
/// acceptance estimates of every request served, and the store of earlier streams.
#[derive(Debug)]
pub struct SuffixProvider {
    cost: CostModel,
    acceptance: Arc<Mutex<AcceptanceModel>>,
    store: Arc<Mutex<Store>>,
    adaptive: bool,
}

impl Default for SuffixProvider {
    /// Adaptive length with a cost curve measured on first use (not cached on disk), and a
    /// store of [`DEFAULT_STORE_REQUESTS`] earlier streams.
    fn default() -> Self {
        SuffixProvider::new(CostModel::measure(None))
    }
}

impl SuffixProvider {
    /// A provider whose rounds draft what the cost-aware policy chooses under `cost`.
    pub fn new(cost: CostModel) -> Self {
        SuffixProvider {
            cost,
            acceptance: Arc::new(Mutex::new(AcceptanceModel::default())),
            store: Arc::new(Mutex::new(Store { capacity: DEFAULT_STORE_REQUESTS, docs: VecDeque::new() })),
            adaptive: true,
        }
    }

    /// The same provider keeping at most `requests` earlier streams (0: no cross-request
    /// store).
    pub fn with_store(self, requests: usize) -> Self {
        self.store.lock().expect("store lock").capacity = requests;
        self
    }

    /// The same provider drafting every proposed token (up to the executor's `n`) instead of
    /// the policy's choice (for benchmarks and tests of the match rule alone).
    pub fn fixed_length(mut self) -> Self {
        self.adaptive = false;
        self
    }

    /// The cost curve, measuring it on `target` if this is the first use.
    ///
    /// # Errors
    /// Target forward failures while measuring.
    pub fn cost_curve(&self, target: &Transformer) -> Result<CostCurve> {
        self.cost.curve(target)
    }

    /// The acceptance estimates shared by this provider's sources.
    pub fn acceptance(&self) -> AcceptanceModel {
        self.acceptance.lock().expect("acceptance lock").clone()
    }

    /// The number of earlier streams in the store.
    pub fn stored_requests(&self) -> usize {
        self.store.lock().expect("store lock").docs.len()
    }

    /// A source for one request under `curve` (no target needed: for tests and replays).
    pub fn open_with_curve(&self, curve: Option<CostCurve>) -> SuffixSource {
        let docs: Vec<Arc<SuffixIndex>> = self.store.lock().expect("store lock").docs.iter().cloned().collect();
        let mut source = SuffixSource::fixed();
        source.store_matches = docs.into_iter().map(StoreMatch::new).collect();
        source.store = Some(self.store.clone());
        source.acceptance = self.acceptance.clone();
        source.curve = if self.adaptive { curve } else { None };
        source
    }
}

impl DraftProvider for SuffixProvider {
    fn name(&self) -> &str {
        "suffix"
    }

    fn open<'a>(&'a self, target: &'a Transformer, _sampler: &Sampler) -> Result<Box<dyn DraftSource + 'a>> {
        let curve = if self.adaptive { Some(self.cost.curve(target)?) } else { None };
        Ok(Box::new(self.open_with_curve(curve)))
    }

    fn describe_policy(&self) -> Option<serde_json::Value> {
        let curve = self.cost.current()?;
        Some(serde_json::json!({
            "policy": if self.adaptive { "cost-aware" } else { "fixed" },
            "cost_curve": curve.describe(),
            "survival": self.acceptance.lock().ok()?.describe(),
        }))
    }
}

/// The last full proposal of a round and the history length when it was made, to score it
/// against the tokens that followed (drafted or not).
#[derive(Debug, Clone)]
struct Shadow {
    key: SurvivalKey,
    tokens: Vec<u32>,
    at: usize,
}

/// The per-request suffix source. Its history is `prompt ++ emitted` whenever it drafts
/// (the re-feed rule of [`crate::source`], as [`crate::ngram::NgramSource`]); when the
/// request ends (the source is dropped) the history joins the provider's store.
#[derive(Debug)]
pub struct SuffixSource {
    index: SuffixIndex,
    prompt_len: usize,
    last_drafts: Vec<u32>,
    shadow: Option<Shadow>,
    /// The end the last proposal copied from and the history length then: the copy
    /// pointer is `end + (len_now - len_then)`.
    copy: Option<(usize, usize)>,
    store_matches: Vec<StoreMatch>,
    store: Option<Arc<Mutex<Store>>>,
    acceptance: Arc<Mutex<AcceptanceModel>>,
    curve: Option<CostCurve>,
    /// Whether the last `draft` call proposed nothing and the executor pipelined the plain
    /// step (it then queued the next head ahead: a window costs `t(1) + t(k)`).
    after_plain: bool,
    /// Under the policy: the recent rounds' value of an unsplit window (a moving average of
    /// the best expected ratio [`crate::policy::round_ratio`] of each round's proposal, 1
    /// for a round without one), for [`DraftSource::pipeline_plain_steps`].
    value: f64,
}

/// Weight of the newest round in [`SuffixSource`]'s moving average of window values.
const VALUE_WEIGHT: f64 = 0.2;

impl SuffixSource {
    /// A stand-alone source drafting every proposed token (no policy, no store).
    pub fn fixed() -> Self {
        SuffixSource {
            index: SuffixIndex::new(),
            prompt_len: 0,
            last_drafts: Vec::new(),
            shadow: None,
            copy: None,
            store_matches: Vec::new(),
            store: None,
            acceptance: Arc::new(Mutex::new(AcceptanceModel::default())),
            curve: None,
            after_plain: false,
            value: 1.0,
        }
    }

    /// The reconstructed `prompt ++ emitted` stream (ends at the pending token after `draft`).
    pub fn history(&self) -> &[u32] {
        self.index.tokens()
    }

    fn contract(&self, message: String) -> Error {
        Error::Contract { source_name: "suffix".to_string(), message }
    }

    fn push(&mut self, t: u32) {
        self.index.push(t);
        for m in &mut self.store_matches {
            m.push(t);
        }
    }

    /// Scores the last proposal against the tokens emitted since (accepted drafts, the
    /// correction or bonus, and tokens it proposed but the round did not verify).
    fn score_shadow(&mut self) {
        let Some(shadow) = self.shadow.take() else { return };
        let seen = &self.index.tokens()[shadow.at..];
        let mut acc = self.acceptance.lock().expect("acceptance lock");
        for (j, (&p, &t)) in shadow.tokens.iter().zip(seen).enumerate() {
            acc.observe(shadow.key, j, p == t);
            if p != t {
                break;
            }
        }
    }

    /// The best proposal over the own history and the store: the longest match; the own
    /// history on ties. The flag tells whether it continues the previous round's copy.
    fn best_proposal(&mut self, n: usize) -> Option<(Origin, Proposal, bool)> {
        let len = self.index.tokens().len();
        let prefer = self.copy.map(|(end, then)| end + (len - then));
        let own = self.index.propose(n, prefer);
        let mut best = own.map(|p| (Origin::Own, p, None));
        for (i, m) in self.store_matches.iter().enumerate() {
            if best.as_ref().is_some_and(|(_, b, _)| b.match_len >= m.len) {
                continue;
            }
            if let Some(p) = m.propose(n) {
                best = Some((Origin::Store, p, Some(i)));
            }
        }
        let (origin, p, doc) = best?;
        let continues = doc.is_none() && prefer == Some(p.end);
        match doc {
            None => self.copy = Some((p.end, len)),
            Some(i) => {
                self.copy = None;
                if let Some(store) = &self.store {
                    store.lock().expect("store lock").touch(&self.store_matches[i].doc);
                }
            }
        }
        Some((origin, p, continues))
    }
}

impl DraftSource for SuffixSource {
    fn name(&self) -> &str {
        "suffix"
    }

    fn prefill(&mut self, prompt: &[u32], _taps: Option<&[mlx_core::Array]>) -> Result<()> {
        let Some((_, head)) = prompt.split_last() else {
            return Err(Error::Invalid("an empty prompt".into()));
        };
        self.index = SuffixIndex::new();
        for m in &mut self.store_matches {
            *m = StoreMatch::new(m.doc.clone());
        }
        for &t in head {
            self.push(t);
        }
        self.prompt_len = prompt.len();
        self.last_drafts.clear();
        self.shadow = None;
        self.copy = None;
        self.after_plain = false;
        self.value = 1.0;
        Ok(())
    }

    fn draft(&mut self, feed: &[u32], n: usize, step: usize) -> Result<Vec<u32>> {
        if feed.is_empty() {
            return Err(self.contract(format!("empty feed at step {step}")));
        }
        for &t in feed {
            self.push(t);
        }
        let len = self.index.tokens().len();
        if len != self.prompt_len + step {
            return Err(self.contract(format!(
                "history holds {len} tokens at step {step}, expected prompt {} + {step}",
                self.prompt_len
            )));
        }
        self.score_shadow();
        let proposal = self.best_proposal(if self.curve.is_some() { MAX_PROPOSAL } else { n });
        let mut value = 1.0;
        self.last_drafts = match proposal {
            None => Vec::new(),
            Some((origin, p, continues)) => {
                let key = SurvivalKey::new(origin, p.match_len).continuing(continues);
                let k = match &self.curve {
                    None => p.tokens.len().min(n),
                    Some(curve) => {
                        let survival =
                            self.acceptance.lock().expect("acceptance lock").survival(key, p.tokens.len().min(n));
                        value = crate::policy::best_round_ratio(curve, &survival, |_| 0.0);
                        let split = self.after_plain;
                        crate::policy::choose(curve, &survival, |k| crate::policy::split_window_cost(curve, k, split))
                    }
                };
                let drafts = p.tokens[..k].to_vec();
                self.shadow = Some(Shadow { key, tokens: p.tokens, at: len });
                drafts
            }
        };
        self.value += VALUE_WEIGHT * (value - self.value);
        self.after_plain = self.last_drafts.is_empty() && self.pipeline_plain_steps();
        Ok(self.last_drafts.clone())
    }

    /// Without the policy, always; under it, while the recent rounds' proposals would not
    /// be worth an unsplit window ([`crate::policy::CostCurve::pipeline_plain_steps`]).
    fn set_batch(&mut self, batch: Option<crate::policy::BatchLoad>) {
        if let Some(curve) = &mut self.curve {
            curve.batch = batch;
        }
        if batch.is_some() {
            self.after_plain = false;
        }
    }

    fn pipeline_plain_steps(&self) -> bool {
        self.curve.as_ref().is_none_or(|c| c.pipeline_plain_steps(self.value))
    }

    fn commit(&mut self, drafted: usize, accepted: usize, _taps: Option<&[mlx_core::Array]>) -> Result<()> {
        if drafted != self.last_drafts.len() || accepted > drafted {
            return Err(self
                .contract(format!("commit({drafted}, {accepted}) after drafting {} tokens", self.last_drafts.len())));
        }
        let keep = accepted.min(drafted.saturating_sub(1));
        let drafts = std::mem::take(&mut self.last_drafts);
        for &t in &drafts[..keep] {
            self.push(t);
        }
        Ok(())
    }
}

impl Drop for SuffixSource {
    fn drop(&mut self) {
        if let Some(store) = self.store.take()
            && let Ok(mut store) = store.lock()
        {
            store.add(std::mem::take(&mut self.index));
        }
    }
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    #[test]
    fn rule_examples() {
        // Longest match: [1, 2, 3] ends at 3 and 7; 9 and 8 follow once each, the latest wins.
        let h = [1, 2, 3, 9, 1, 2, 3, 8, 1, 2, 3];
        let p = propose_naive(&h, 10, None).unwrap();
        assert_eq!((p.match_len, p.end), (3, 7));
        assert_eq!(p.tokens, vec![8, 1, 2, 3, 8, 1, 2, 3]);
        // The copy pointer wins over recency.
        assert_eq!(propose_naive(&h, 2, Some(3)).unwrap().tokens, vec![9, 1]);
        // Frequency: after [5], 6 follows twice and 7 once (latest): 6.
        let h = [5, 6, 1, 5, 6, 2, 5, 7, 3, 5];
        assert_eq!(propose_naive(&h, 1, None).unwrap().tokens, vec![6]);
        // A loop runs on into its own copy.
        assert_eq!(propose_naive(&[4, 4, 4, 4], 5, None).unwrap().tokens, vec![4, 4, 4, 4, 4]);
        assert_eq!(propose_naive(&[1, 2, 1, 2], 5, None).unwrap().tokens, vec![1, 2, 1, 2, 1]);
        // Nothing earlier.
        assert_eq!(propose_naive(&[5, 6, 7], 4, None), None);
        let ix = SuffixIndex::from_tokens(&[1, 2, 3, 9, 1, 2, 3, 8, 1, 2, 3]);
        assert_eq!(ix.propose(10, None), propose_naive(ix.tokens(), 10, None));
        assert_eq!(proposal_cap(1), 4);
        assert_eq!(proposal_cap(40), MAX_PROPOSAL);
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: 256, failure_persistence: None, ..ProptestConfig::default() })]

        /// The automaton proposes exactly what the naive search proposes, after every appended
        /// token, on histories over small alphabets (many repeats, long matches), with and
        /// without a copy pointer.
        #[test]
        fn index_equals_naive(
            alphabet in 1u32..5,
            raw in proptest::collection::vec(0u32..1000, 0..160),
            n in 0usize..40,
            prefer_back in 0usize..8,
        ) {
            let history: Vec<u32> = raw.iter().map(|t| t % alphabet).collect();
            let mut ix = SuffixIndex::new();
            for (i, &t) in history.iter().enumerate() {
                ix.push(t);
                let h = &history[..=i];
                let prefer = h.len().checked_sub(prefer_back + 1);
                prop_assert_eq!(ix.propose(n, prefer), propose_naive(h, n, prefer), "prefix {}", i + 1);
            }
        }

        /// Long repeated runs (matches past MAX_MATCH) still agree with the naive search.
        #[test]
        fn long_runs_equal_naive(
            block in proptest::collection::vec(0u32..3, 1..12),
            repeats in 1usize..20,
            noise in proptest::collection::vec(0u32..3, 0..20),
        ) {
            let mut history: Vec<u32> = Vec::new();
            for _ in 0..repeats {
                history.extend(&block);
            }
            history.extend(&noise);
            history.extend(block.iter().cycle().take(90));
            let mut ix = SuffixIndex::new();
            for (i, &t) in history.iter().enumerate() {
                ix.push(t);
                prop_assert_eq!(ix.propose(40, None), propose_naive(&history[..=i], 40, None), "prefix {}", i + 1);
            }
        }

        /// Driving the source with the executor's protocol keeps its history equal to
        /// prompt ++ emitted: random accept counts, re-feed after all-accept rounds.
        #[test]
        fn history_is_prompt_plus_emitted(
            prompt in proptest::collection::vec(0u32..4, 1..30),
            rounds in proptest::collection::vec((0usize..8, 0usize..9, 0u32..4), 1..30),
            adaptive in any::<bool>(),
        ) {
            let provider = SuffixProvider::new(CostModel::fixed(CostCurve::linear(0.2, 33)));
            let mut src = if adaptive { provider.open_with_curve(Some(CostCurve::linear(0.2, 33))) } else { SuffixSource::fixed() };
            let driven = crate::source::drive_protocol(&mut src, |s| s.history().to_vec(), &prompt, &rounds);
            prop_assert!(driven.is_ok(), "{:?}", driven);
        }
    }

    /// Inside a copy run the policy drafts long windows, and its estimates are kept apart
    /// for proposals that continue the previous round's copy.
    #[test]
    fn the_policy_learns_copy_runs() {
        let provider = SuffixProvider::new(CostModel::fixed(CostCurve::linear(0.2, 33))).with_store(0);
        let block: Vec<u32> = (10..60).collect();
        let mut prompt = block.clone();
        prompt.extend(&block[..5]);
        let mut src = provider.open_with_curve(Some(CostCurve::linear(0.2, 33)));
        src.prefill(&prompt, None).unwrap();
        // The target copies the block: every draft is accepted.
        let (mut feed, mut step, mut lens) = (vec![block[4]], 0, Vec::new());
        for _ in 0..6 {
            let drafts = src.draft(&feed, 32, step).unwrap();
            let d = drafts.len();
            lens.push(d);
            let at = prompt.len() + step;
            let next = block[(at - 50 + d) % 50];
            src.commit(d, d, None).unwrap();
            feed = if d > 0 { vec![drafts[d - 1], next] } else { vec![next] };
            step += d + 1;
        }
        assert!(lens[0] > 0 && lens.last() > lens.first(), "windows grow inside a copy run: {lens:?}");
        let described = provider.acceptance().describe().to_string();
        assert!(described.contains("/copy"), "{described}");
    }

    #[test]
    fn contract_errors() {
        let mut src = SuffixSource::fixed();
        src.prefill(&[1, 2, 3], None).unwrap();
        assert!(matches!(src.draft(&[], 3, 0), Err(Error::Contract { .. })));
        let mut src = SuffixSource::fixed();
        src.prefill(&[1, 2, 1, 2], None).unwrap();
        assert!(matches!(src.draft(&[2], 3, 1), Err(Error::Contract { .. })));
        let mut src = SuffixSource::fixed();
        src.prefill(&[1, 2, 1, 2], None).unwrap();
        assert_eq!(src.draft(&[2], 3, 0).unwrap(), vec![1, 2, 1]);
        assert!(matches!(src.commit(2, 0, None), Err(Error::Contract { .. })));
        assert!(src.commit(3, 4, None).is_err());
    }

    /// A later request drafts from an earlier one's stream; the store keeps the latest
    /// `capacity` streams.
    #[test]
    fn the_store_lets_a_later_request_copy_an_earlier_one() {
        let provider = SuffixProvider::new(CostModel::fixed(CostCurve::linear(0.2, 33))).fixed_length().with_store(2);
        let answer: Vec<u32> = (100..140).collect();
        {
            let mut first = provider.open_with_curve(None);
            let mut prompt = vec![1, 2, 3];
            prompt.extend(&answer);
            first.prefill(&prompt, None).unwrap();
            first.draft(&[*prompt.last().unwrap()], 4, 0).unwrap();
        }
        assert_eq!(provider.stored_requests(), 1);
        let mut second = provider.open_with_curve(None);
        // The new prompt quotes the start of the answer: the store continues it.
        let prompt = [7, 8, 100, 101, 102, 103];
        second.prefill(&prompt, None).unwrap();
        assert_eq!(second.draft(&[103], 8, 0).unwrap(), vec![104, 105, 106, 107, 108, 109, 110, 111]);
        drop(second);
        for _ in 0..3 {
            drop(provider.open_with_curve(None));
        }
        // Empty sources are not stored; two real ones are at most two.
        assert_eq!(provider.stored_requests(), 2);
    }

    #[test]
    fn fast_on_long_histories() {
        let mut x = 0x2545_f491_4f6c_dd1du64;
        let mut next = || {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            (x % 50) as u32
        };
        let block: Vec<u32> = (0..500).map(|_| next()).collect();
        let mut ix = SuffixIndex::new();
        let t = std::time::Instant::now();
        let mut proposed = 0;
        for i in 0..30_000 {
            // Copy runs, free text and a long run of one token.
            let tok = match i % 3000 {
                r if r < 500 => block[r],
                r if r < 700 => 7,
                _ => next(),
            };
            ix.push(tok);
            proposed += ix.propose(32, None).map_or(0, |p| p.tokens.len());
        }
        assert!(proposed > 0);
        let dt = t.elapsed();
        assert!(dt.as_secs_f64() < 5.0, "30k pushes + proposals took {dt:?}");
    }
}
