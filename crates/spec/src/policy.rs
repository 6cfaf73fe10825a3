//! The cost model and the cost-aware draft-length policy.
//!
//! A round with `k` drafts costs one target forward over `1 + k` tokens, `t(1 + k)` in units
//! of a one-token step, and yields on average `1 + s_1 + ... + s_k` tokens, where `s_i` is
//! the chance that drafts `1..=i` are all accepted. The policy ([`choose`]) drafts
//!
//! ```text
//! k* = argmax_{k in 0..=K} (1 + sum_{i<=k} s_i) / (t(1 + k) + drafting_cost(k))
//! ```
//!
//! and `k* = 0` (a plain step) unless some window beats a plain step by [`MIN_GAIN`]
//! (SmartSpec, arXiv 2406.14066; Sequoia's hardware-aware optimiser, arXiv 2402.12374; vLLM's
//! adaptive verification). `t` is measured on the loaded target ([`calibrate`], a few
//! seconds) and cached on disk ([`CurveCache`]); `s_i` is estimated online
//! ([`AcceptanceModel`]) per [`SurvivalKey`] (where the proposal was copied from and how long
//! the match was), from a prior and the outcomes of past proposals.
//!
//! **Non-anticipating.** The length is chosen before the target sees the window, from the
//! proposal's match length and past outcomes only; the drafts are a deterministic function
//! of the history (one-hot `q`), so neither exact-match nor Leviathan/Chen acceptance is
//! biased (the DSpark paper's App. A bias needs a length chosen from later drafts'
//! confidences, which depend on earlier drafted tokens).
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::time::Instant;

use models::generate::ids;
use models::{ModelCache, Transformer};

use crate::error::Context;
use crate::{Result, SpecStats};

/// A window must beat a plain step by this fraction to be drafted (0.02: 2%).
pub const MIN_GAIN: f64 = 0.02;
/// Windows measured by [`calibrate`] (tokens); the curve is interpolated between them.
pub const CALIBRATION_WINDOWS: [usize; 10] = [1, 2, 3, 4, 6, 8, 12, 16, 24, 33];
/// Version of the on-disk curve format and of the calibration method (part of the key).
const CURVE_VERSION: u32 = 2;

/// `t(T)`: the cost of one target forward over `T` tokens (with its LM head), relative to a
/// one-token step (`t(1) = 1`), for `T = 1..=max_window`; beyond, extrapolated linearly from
/// the last two points.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct CostCurve {
    /// `t[T - 1]`, relative (`t[0] == 1`).
    pub t: Vec<f64>,
    /// Wall time of a one-token step, milliseconds (0 for a synthetic curve).
    pub step_ms: f64,
    /// How the curve was obtained: `"measured"`, `"cached"`, `"linear"`, `"given"`.
    pub origin: String,
    /// The cost of a plain step run pipelined (the next step's graph built while this one
    /// computes, as plain decoding runs), relative to `t(1)`; 1 when not measured.
    #[serde(default = "one")]
    pub pipelined: f64,
    /// `Some` while the request decodes in a batch ([`crate::batch`]): the other requests of
    /// the round, which [`choose`] weighs the window with; windows are then never split by
    /// a pipelined plain step ([`split_window_cost`] is 0). Not stored.
    #[serde(skip)]
    pub batch: Option<BatchLoad>,
}

/// The other requests of a batched round as the policy sees one request's window: their
/// rows in the shared forward and the tokens they are expected to emit. With it, [`choose`]
/// maximises the whole batch's tokens per forward, `(tokens + 1 + sum s_i) / t(rows + 1 +
/// k)`: a window's drafts must pay for the time they add to every request's round, so a
/// fuller batch drafts less (the DSpark paper's throughput-aware scheduling, §4.3, with
/// each request choosing in turn given the others).
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct BatchLoad {
    /// Rows (window tokens) of the other requests in the forward.
    pub rows: usize,
    /// Tokens the other requests are expected to emit in the round.
    pub tokens: f64,
}

/// serde's default for [`CostCurve::pipelined`].
fn one() -> f64 {
    1.0
}

impl CostCurve {
    /// `t(T) = 1 + c (T - 1)` for `T = 1..=max_window`.
    pub fn linear(c: f64, max_window: usize) -> Self {
        CostCurve {
            t: (0..max_window.max(1)).map(|i| 1.0 + c * i as f64).collect(),
            step_ms: 0.0,
            origin: "linear".into(),
            pipelined: 1.0,
            batch: None,
        }
    }

    /// A curve from measured wall times `ms[T - 1]` (milliseconds, `T = 1..`), normalised by
    /// `ms[0]`.
    ///
    /// # Errors
    /// [`crate::Error::Invalid`] for an empty list or a non-positive or non-finite time.
    pub fn from_ms(ms: &[f64]) -> Result<Self> {
        if ms.is_empty() || ms.iter().any(|&m| !(m.is_finite() && m > 0.0)) {
            return Err(crate::Error::Invalid(format!("a cost curve needs positive times, got {ms:?}")));
        }
        Ok(CostCurve {
            t: ms.iter().map(|m| m / ms[0]).collect(),
            step_ms: ms[0],
            origin: "given".into(),
            pipelined: 1.0,
            batch: None,
        })
    }

    /// `t(window)` for `window >= 1`.
    pub fn t(&self, window: usize) -> f64 {
        let w = window.max(1);
        match self.t.get(w - 1) {
            Some(&t) => t,
            None => {
                let n = self.t.len();
                let slope = if n >= 2 { self.t[n - 1] - self.t[n - 2] } else { 0.0 };
                self.t[n - 1] + slope.max(0.0) * (w - n) as f64
            }
        }
    }

    /// The curve as `--stats-json` reports it: `{"t": [...], "step_ms", "pipelined",
    /// "origin"}`.
    pub fn describe(&self) -> serde_json::Value {
        serde_json::json!({
            "t": self.t.iter().map(|t| (t * 1000.0).round() / 1000.0).collect::<Vec<_>>(),
            "step_ms": (self.step_ms * 1000.0).round() / 1000.0,
            "pipelined": (self.pipelined * 1000.0).round() / 1000.0,
            "origin": self.origin,
        })
    }

    /// Whether plain steps should run pipelined, given `value`: the expected speed ratio, in
    /// one-token steps, of the round that follows if it is not (the source's unsplit window
    /// for its likely proposal; 1 when it will propose nothing). A pipelined plain step costs
    /// [`CostCurve::pipelined`] and leaves a following window split (`t(1) + t(k)`), so
    /// drafting right after it rarely pays; an unpipelined one costs `t(1)` and leaves the
    /// next round whole. Pipelined while `value * pipelined < 1 + MIN_GAIN`.
    pub fn pipeline_plain_steps(&self, value: f64) -> bool {
        value * self.pipelined < 1.0 + MIN_GAIN
    }
}

/// The policy: the number of drafts `k` in `0..=survival.len()` maximising
/// `(1 + sum_{i<=k} survival[i-1]) / (curve.t(1 + k) + draft_cost(k))` (the first such `k`
/// on ties), and 0 unless that ratio beats the plain step's `1 / (t(1) + draft_cost(0))` by
/// [`MIN_GAIN`]. `survival[i - 1]` is `s_i`; `draft_cost(k)` is the cost of producing `k`
/// drafts in units of a one-token step (0 for lookup drafters).
///
/// In a batch ([`CostCurve::batch`]) the ratio is the batch's:
/// `(tokens + 1 + sum s_i) / (t(rows + 1 + k) + draft_cost(k))` with the other requests'
/// `rows` and expected `tokens` ([`BatchLoad`]).
pub fn choose(curve: &CostCurve, survival: &[f64], draft_cost: impl Fn(usize) -> f64) -> usize {
    let load = curve.batch.unwrap_or_default();
    let plain = (load.tokens + 1.0) / (curve.t(load.rows + 1) + draft_cost(0));
    let (mut best_k, mut best) = (0, plain);
    let mut gain = load.tokens + 1.0;
    for (i, s) in survival.iter().enumerate() {
        let k = i + 1;
        gain += s;
        let r = gain / (curve.t(load.rows + 1 + k) + draft_cost(k));
        if r > best {
            (best_k, best) = (k, r);
        }
    }
    if best >= plain * (1.0 + MIN_GAIN) { best_k } else { 0 }
}

/// The DSpark paper's hardware-aware prefix scheduler (Algorithm 1, §4.3): how many drafts
/// each rated request of a batch verifies. `prefixes[r][j - 1]` is `a_{r,j}`, the chance
/// that request `r`'s drafts `1..=j` are all accepted (non-increasing in `j`); `base` is the
/// rest of the forward (the unrated requests' rows and expected tokens). Starting from every
/// rated request verifying its pending token alone (`B = base.rows + R` rows, `tau =
/// base.tokens + R` expected tokens), positions are added in order of decreasing `a_{r,j}`
/// (ties: lower `r`, then `j`, so each request's positions come in prefix order) while the
/// batch's expected tokens per forward `tau / t(B)` grows; the first position that does not
/// raise it stops the search (the early stop that keeps the lengths a stopping time of the
/// drafts, App. A). Returns the number of drafts of each request.
pub fn schedule_prefixes(curve: &CostCurve, prefixes: &[Vec<f64>], base: BatchLoad) -> Vec<usize> {
    let mut entries: Vec<(f64, usize, usize)> = prefixes
        .iter()
        .enumerate()
        .flat_map(|(r, a)| a.iter().enumerate().filter(|(_, a)| **a > 0.0).map(move |(j, &a)| (a, r, j + 1)))
        .collect();
    entries.sort_by(|x, y| y.0.total_cmp(&x.0).then(x.1.cmp(&y.1)).then(x.2.cmp(&y.2)));
    let mut lengths = vec![0; prefixes.len()];
    let mut best_lengths = lengths.clone();
    let mut rows = base.rows + prefixes.len();
    let mut tau = base.tokens + prefixes.len() as f64;
    let mut best = tau / curve.t(rows);
    for (a, r, j) in entries {
        if j != lengths[r] + 1 {
            // A later position ahead of an earlier one (estimates that increase with j): the
            // prefix order ends the search as the early stop does.
            break;
        }
        lengths[r] = j;
        rows += 1;
        tau += a;
        let throughput = tau / curve.t(rows);
        if throughput > best {
            best = throughput;
            best_lengths.clone_from(&lengths);
        } else {
            break;
        }
    }
    best_lengths
}

/// The stopping rule of drafters that propose one token after another and know, before
/// drawing draft `k + 1`, how likely it is to be accepted (a draft model's own probability,
/// a DSpark drafter's confidence head): with `s_1..s_k` the survival of the drafts kept so
/// far, `next` the conditional acceptance estimate of draft `k + 1` and `later` the average
/// conditional acceptance assumed for the drafts after it (up to `max` drafts in all), keep
/// drafting when [`choose`] over `s_1..s_k, s_k next, s_k next later, ...` picks more than
/// `k` drafts. Every input is known before draft `k + 1` is drawn, so the length is a
/// stopping time of the drafts (SpecDec++, arXiv 2405.19715; the DSpark paper's App. A
/// bias needs a length that looks at later drafts): exact under both acceptance rules.
pub fn keep_drafting(
    curve: &CostCurve,
    survival: &[f64],
    next: f64,
    later: f64,
    max: usize,
    draft_cost: impl Fn(usize) -> f64,
) -> bool {
    let k = survival.len();
    if k >= max {
        return false;
    }
    let mut projected = survival.to_vec();
    let mut s = survival.last().copied().unwrap_or(1.0) * next;
    projected.push(s);
    while projected.len() < max {
        s *= later;
        projected.push(s);
    }
    choose(curve, &projected, draft_cost) > k
}

/// The extra cost of a `k`-draft round that follows a plain step (a round that drafted
/// nothing): the executor queued the next head's one-token forward ahead
/// ([`crate::speculative_generate`]), so the window costs `t(1) + t(k)` instead of
/// `t(1 + k)`. 0 for `k = 0` (the queued forward is the plain step) and when `after_plain`
/// is false. Pass it (plus any drafting cost) as [`choose`]'s `draft_cost`.
pub fn split_window_cost(curve: &CostCurve, k: usize, after_plain: bool) -> f64 {
    if after_plain && k > 0 && curve.batch.is_none() {
        (curve.t(1) + curve.t(k) - curve.t(1 + k)).max(0.0)
    } else {
        0.0
    }
}

/// The expected speed ratio to plain decoding of a round with `k` drafts:
/// `(1 + sum_{i<=k} s_i) / t(1 + k)`.
pub fn round_ratio(curve: &CostCurve, survival: &[f64], k: usize) -> f64 {
    (1.0 + survival[..k.min(survival.len())].iter().sum::<f64>()) / curve.t(1 + k)
}

/// The best expected ratio of one round over `k in 0..=survival.len()`:
/// `max_k (1 + sum_{i<=k} s_i) / (t(1 + k) + draft_cost(k))` in one-token steps (`k = 0`, a
/// plain step, gives `1 / (t(1) + draft_cost(0))`). What a proposal is worth as a whole
/// window ([`CostCurve::pipeline_plain_steps`]).
pub fn best_round_ratio(curve: &CostCurve, survival: &[f64], draft_cost: impl Fn(usize) -> f64) -> f64 {
    let mut gain = 1.0;
    let mut best = 1.0 / (curve.t(1) + draft_cost(0));
    for (i, s) in survival.iter().enumerate() {
        gain += s;
        best = best.max(gain / (curve.t(i + 2) + draft_cost(i + 1)));
    }
    best
}

/// The speed ratio to plain decoding the cost model predicts for a finished request: plain
/// decoding runs pipelined, [`CostCurve::pipelined`] per token; the request's rounds with `d`
/// drafts cost `t(1 + d)` each (from `stats.drafted_by_pos`; a window split after a
/// pipelined step is charged as one), its pipelined plain steps
/// ([`SpecStats::pipelined_steps`]) `pipelined` each and its other rounds without drafts
/// `t(1)`: nothing outside the target forward costs time. 0 without rounds.
pub fn predicted_ratio(curve: &CostCurve, stats: &SpecStats) -> f64 {
    let by_pos = &stats.drafted_by_pos;
    let mut cost = 0.0;
    let mut rounds_with_drafts = 0;
    for k in 1..=by_pos.len() {
        let exactly = by_pos[k - 1] - by_pos.get(k).copied().unwrap_or(0);
        cost += exactly as f64 * curve.t(1 + k);
        rounds_with_drafts += exactly;
    }
    let plain_rounds = stats.rounds.saturating_sub(rounds_with_drafts);
    let pipelined = stats.pipelined_steps.min(plain_rounds);
    cost += pipelined as f64 * curve.pipelined + (plain_rounds - pipelined) as f64 * curve.t(1);
    if cost > 0.0 { stats.emitted as f64 * curve.pipelined / cost } else { 0.0 }
}

/// Where a proposal was copied from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Origin {
    /// The request's own prompt and output.
    Own,
    /// An earlier request's stream (the cross-request store).
    Store,
    /// A draft model.
    Model,
    /// One draft of a drafter that rates its drafts (a draft model's probability of its
    /// draft, a DSpark confidence head's sigmoid): the bucket is the rating's
    /// ([`SurvivalKey::rated`]).
    Rated,
}

/// What the survival estimates are keyed by: the origin, the match length's bucket (1, 2,
/// 3-4, 5-8, 9-16, 17-32, 33+ tokens) and whether the proposal continues the copy of the
/// previous round (acceptance is bimodal: long inside a copy run, short after an edit).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct SurvivalKey {
    /// Where the proposal came from.
    pub origin: Origin,
    /// Match-length bucket, 0..=6.
    pub bucket: u8,
    /// Whether the proposal continues the previous round's copy.
    pub continues: bool,
}

/// Prior per-token acceptance by match-length bucket.
const PRIOR_MEAN: [f64; 7] = [0.3, 0.4, 0.55, 0.7, 0.8, 0.85, 0.9];
/// Prior strength (pseudo-observations).
const PRIOR_WEIGHT: f64 = 2.0;
/// Observations per (key, position) beyond which old ones are halved (forgetting).
const MAX_WEIGHT: f64 = 256.0;

/// Prior conditional acceptance of a draft by its confidence bucket ([`SurvivalKey::rated`]).
const CONFIDENCE_PRIOR: [f64; 7] = [0.1, 0.35, 0.55, 0.7, 0.8, 0.9, 0.97];
/// Upper edges of the confidence buckets (the last bucket ends at 1).
const CONFIDENCE_EDGES: [f64; 6] = [0.3, 0.5, 0.7, 0.8, 0.9, 0.97];

impl SurvivalKey {
    /// The key of one draft of a drafter that rates its own drafts: `confidence` in [0, 1]
    /// (a draft model's probability of its draft, a DSpark confidence head's sigmoid), in one
    /// of 7 buckets (below 0.3, 0.5, 0.7, 0.8, 0.9, 0.97, and above). The estimates of such a
    /// key calibrate the rating: position 0 holds the chance that a draft of this rating is
    /// accepted when the drafts before it were.
    pub fn rated(confidence: f64) -> Self {
        let bucket = CONFIDENCE_EDGES.iter().position(|&e| confidence < e).unwrap_or(CONFIDENCE_EDGES.len());
        SurvivalKey { origin: Origin::Rated, bucket: bucket as u8, continues: false }
    }

    /// The key of a proposal from `origin` whose match is `match_len` tokens long and that
    /// does not continue the previous copy (see [`SurvivalKey::continuing`]).
    pub fn new(origin: Origin, match_len: usize) -> Self {
        let bucket = match match_len {
            0 | 1 => 0,
            2 => 1,
            3..=4 => 2,
            5..=8 => 3,
            9..=16 => 4,
            17..=32 => 5,
            _ => 6,
        };
        SurvivalKey { origin, bucket, continues: false }
    }

    /// The same key for a proposal that continues (`true`) the previous round's copy or not.
    pub fn continuing(self, continues: bool) -> Self {
        SurvivalKey { continues, ..self }
    }
}

/// Online estimates of the per-position conditional acceptance `a_j` (the chance draft `j`
/// is accepted given drafts `< j` were), Beta-smoothed around a prior per match-length
/// bucket, with `s_i = a_1 ... a_i`. Fed by [`AcceptanceModel::observe`] with every
/// proposal's outcome, drafted or not (the tokens emitted after a proposal tell whether each
/// of its tokens would have been accepted: under exact match a draft is accepted exactly when
/// it equals the emitted token; under the rejection rule with one-hot `q` too, and an
/// undrafted token equals the target's sample with the same probability `p(x)`).
#[derive(Debug, Clone, Default)]
pub struct AcceptanceModel {
    /// (accepted, trials) per key and position.
    counts: HashMap<SurvivalKey, Vec<(f64, f64)>>,
}

impl AcceptanceModel {
    /// Records whether draft position `j` (0-based) of a `key` proposal was accepted, all
    /// earlier positions having been.
    pub fn observe(&mut self, key: SurvivalKey, j: usize, accepted: bool) {
        let v = self.counts.entry(key).or_default();
        if v.len() <= j {
            v.resize(j + 1, (0.0, 0.0));
        }
        let (a, n) = &mut v[j];
        if *n >= MAX_WEIGHT {
            *a *= 0.5;
            *n *= 0.5;
        }
        *a += f64::from(u8::from(accepted));
        *n += 1.0;
    }

    /// The conditional acceptance estimate at position `j`.
    pub fn conditional(&self, key: SurvivalKey, j: usize) -> f64 {
        let bucket = usize::from(key.bucket).min(PRIOR_MEAN.len() - 1);
        let prior = match (key.origin, key.continues) {
            (Origin::Rated, _) => CONFIDENCE_PRIOR[bucket],
            // A continuing copy starts from a more confident prior.
            (_, true) => 0.5 + 0.5 * PRIOR_MEAN[bucket],
            (_, false) => PRIOR_MEAN[bucket],
        };
        self.conditional_around(key, j, prior)
    }

    /// The acceptance estimate of a draft at position `j` rated `rating` by its drafter
    /// ([`SurvivalKey::rated`]), its bucket smoothed around `base`'s estimate at `j` (the
    /// drafter's average acceptance there).
    pub fn rated(&self, rating: f64, base: SurvivalKey, j: usize) -> f64 {
        self.conditional_around(SurvivalKey::rated(rating), 0, self.conditional(base, j))
    }

    /// The conditional acceptance estimate at position `j`, smoothed around `prior` instead
    /// of the key's own: a rated draft's bucket starts from the drafter's average acceptance
    /// at that position (a pessimistic prior would stop the drafts that would teach it).
    pub fn conditional_around(&self, key: SurvivalKey, j: usize, prior: f64) -> f64 {
        let (a, n) = self.counts.get(&key).and_then(|v| v.get(j)).copied().unwrap_or((0.0, 0.0));
        (a + PRIOR_WEIGHT * prior) / (n + PRIOR_WEIGHT)
    }

    /// `s_1..=s_k` for a `key` proposal.
    pub fn survival(&self, key: SurvivalKey, k: usize) -> Vec<f64> {
        let mut s = 1.0;
        (0..k)
            .map(|j| {
                s *= self.conditional(key, j);
                s
            })
            .collect()
    }

    /// The estimates as JSON: per key (`"own/1"`, `"store/9-16"`, `"own/5-8/copy"` for a
    /// continuing copy), `s_1..s_8` and the number of first-position observations.
    pub fn describe(&self) -> serde_json::Value {
        const NAMES: [&str; 7] = ["1", "2", "3-4", "5-8", "9-16", "17-32", "33+"];
        let mut keys: Vec<_> = self.counts.keys().copied().collect();
        keys.sort();
        let map: serde_json::Map<String, serde_json::Value> = keys
            .into_iter()
            .map(|k| {
                let origin = match k.origin {
                    Origin::Own => "own",
                    Origin::Store => "store",
                    Origin::Model => "model",
                    Origin::Rated => "rated",
                };
                let s: Vec<f64> = self.survival(k, 8).iter().map(|s| (s * 1000.0).round() / 1000.0).collect();
                let n = self.counts[&k].first().map_or(0.0, |c| c.1);
                const CONFIDENCE: [&str; 7] = ["<0.3", "<0.5", "<0.7", "<0.8", "<0.9", "<0.97", ">=0.97"];
                let name = match (k.origin, k.continues) {
                    (Origin::Rated, _) => format!("rated/{}", CONFIDENCE[usize::from(k.bucket)]),
                    (_, true) => format!("{origin}/{}/copy", NAMES[usize::from(k.bucket)]),
                    (_, false) => format!("{origin}/{}", NAMES[usize::from(k.bucket)]),
                };
                (name, serde_json::json!({"s": s, "observed": n}))
            })
            .collect();
        serde_json::Value::Object(map)
    }
}

/// Where a measured curve is cached on disk and the key it must match.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CurveCache {
    /// The JSON file.
    pub path: PathBuf,
    /// The full key (also stored in the file, checked on load).
    pub key: String,
}

impl CurveCache {
    /// The cache entry for the model in `dir` loaded with `load` (compute dtype and kernel
    /// policy, [`mlx_core::KernelPolicy::key`]), on this machine: under `models::fetch::cache_dir()/cost-curves/`, keyed by the curve
    /// version, the model's `config.json` and weight files (names, sizes, modification
    /// times), the dtype, the MLX version, backend and device, the kernel settings and the
    /// CPU model.
    pub fn for_model(dir: &Path, load: &models::LoadOptions) -> Self {
        let (dtype, kernels) = (load.dtype, load.kernels.key());
        let info = mlx_core::info();
        let key = format!(
            "v{CURVE_VERSION}|weights={}|dtype={dtype:?}|mlx={}|backend={}|device={}|kernels={kernels}|cpu={}",
            weights_fingerprint(dir),
            info.mlx_version,
            info.backend,
            info.device,
            cpu_model()
        );
        let path = models::fetch::cache_dir().join("cost-curves").join(format!("{:016x}.json", fnv1a(key.as_bytes())));
        CurveCache { path, key }
    }

    /// The cached curve, when the file exists and holds this key.
    pub fn load(&self) -> Option<CostCurve> {
        let text = std::fs::read_to_string(&self.path).ok()?;
        let v: serde_json::Value = serde_json::from_str(&text).ok()?;
        if v["key"].as_str() != Some(self.key.as_str()) {
            return None;
        }
        let mut curve: CostCurve = serde_json::from_value(v["curve"].clone()).ok()?;
        curve.origin = "cached".into();
        Some(curve)
    }

    /// Writes `curve` (best effort: a read-only cache only costs a re-measurement).
    pub fn store(&self, curve: &CostCurve) {
        let v = serde_json::json!({"key": self.key, "curve": curve});
        if let Some(parent) = self.path.parent() {
            let _ = std::fs::create_dir_all(parent);
        }
        let _ = mlx_core::io::model_dir::write_atomic(&self.path, v.to_string().as_bytes());
    }
}

/// `config.json` and weight files of `dir` as `name:size:mtime` (seconds), sorted.
fn weights_fingerprint(dir: &Path) -> String {
    let mut parts: Vec<String> = std::fs::read_dir(dir)
        .map(|it| {
            it.filter_map(|e| e.ok())
                .filter_map(|e| {
                    let name = e.file_name().to_string_lossy().into_owned();
                    if !(name == "config.json" || name.ends_with(".safetensors") || name.ends_with(".gguf")) {
                        return None;
                    }
                    let meta = e.metadata().ok()?;
                    let mtime = meta
                        .modified()
                        .ok()
                        .and_then(|t| t.duration_since(std::time::UNIX_EPOCH).ok())
                        .map_or(0, |d| d.as_secs());
                    Some(format!("{name}:{}:{mtime}", meta.len()))
                })
                .collect()
        })
        .unwrap_or_default();
    parts.sort();
    let canonical = dir.canonicalize().unwrap_or_else(|_| dir.to_path_buf());
    format!("{}[{}]", canonical.display(), parts.join(","))
}

/// The CPU model name (`/proc/cpuinfo`), or `unknown`.
fn cpu_model() -> String {
    std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("model name") || l.starts_with("Model"))
                .and_then(|l| l.split(':').nth(1))
                .map(|m| m.trim().to_string())
        })
        .unwrap_or_else(|| "unknown".into())
}

/// FNV-1a, 64-bit: a hash that is stable across Rust versions (file names).
fn fnv1a(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325u64, |h, &b| (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3))
}

/// Measures `t(T)` of `target` for `T = 1..=33` (the windows of [`CALIBRATION_WINDOWS`],
/// interpolated linearly between them, capped at the cache's rollback reach + 1): after a
/// warm-up, `reps` timed forwards per window (with the LM head over every position, as a
/// verify round) on a 32-token dummy context, each rolled back; the median per window.
///
/// # Errors
/// Target forward failures.
pub fn calibrate(target: &Transformer, reps: usize) -> Result<CostCurve> {
    let reach = target.make_cache().rollback_reach().unwrap_or(usize::MAX);
    let windows: Vec<usize> = CALIBRATION_WINDOWS.iter().copied().filter(|&w| w <= reach.saturating_add(1)).collect();
    let mut timer = WindowTimer::new(target)?;
    for &w in &[1, 8, 1] {
        timer.time(w)?;
    }
    let mut samples: Vec<Vec<f64>> = vec![Vec::new(); windows.len()];
    for _ in 0..reps.max(1) {
        for (i, &w) in windows.iter().enumerate() {
            samples[i].push(timer.time(w)?);
        }
    }
    let medians: Vec<f64> = samples
        .iter_mut()
        .map(|s| {
            s.sort_by(f64::total_cmp);
            s[s.len() / 2]
        })
        .collect();
    let last = *windows.last().expect("window 1 is always measured");
    let mut ms = Vec::with_capacity(last);
    for t in 1..=last {
        let i = windows.iter().position(|&w| w >= t).expect("t <= last");
        ms.push(if windows[i] == t {
            medians[i]
        } else {
            let (w0, w1) = (windows[i - 1] as f64, windows[i] as f64);
            medians[i - 1] + (medians[i] - medians[i - 1]) * (t as f64 - w0) / (w1 - w0)
        });
    }
    // A window is never cheaper than a shorter one (timing noise).
    for i in 1..ms.len() {
        ms[i] = ms[i].max(ms[i - 1]);
    }
    let mut curve = CostCurve::from_ms(&ms)?;
    curve.origin = "measured".into();
    curve.pipelined = (pipelined_step_ms(target, &timer.ctx[..32], reps)? / curve.step_ms).min(1.0);
    Ok(curve)
}

/// Times target forwards of `w` dummy tokens after a 32-token dummy context, each rolled back
/// (the cache rebuilt where it cannot be).
struct WindowTimer<'a> {
    target: &'a Transformer,
    ctx: Vec<u32>,
    cache: ModelCache,
}

impl<'a> WindowTimer<'a> {
    fn new(target: &'a Transformer) -> Result<Self> {
        let vocab = target.config.vocab_size.max(2) as u32;
        let ctx: Vec<u32> = (0..96u32).map(|i| (i * 7919 + 11) % vocab).collect();
        let mut timer = WindowTimer { target, ctx, cache: target.make_cache() };
        timer.fresh()?;
        Ok(timer)
    }

    fn fresh(&mut self) -> Result<()> {
        let what = || "calibrating the target's cost curve".to_string();
        self.cache = self.target.make_cache();
        self.target.prefill(&ids(&self.ctx[..32]).context(what)?, &mut self.cache).context(what)
    }

    /// Wall milliseconds of one forward of `w` tokens (with the LM head over all of them).
    fn time(&mut self, w: usize) -> Result<f64> {
        let what = || "calibrating the target's cost curve".to_string();
        let tokens = ids(&self.ctx[32..32 + w]).context(what)?;
        let t = Instant::now();
        let logits = self.target.forward(&tokens, &mut self.cache).context(what)?;
        logits.eval().context(what)?;
        let ms = t.elapsed().as_secs_f64() * 1e3;
        if !(self.cache.can_trim(w) && self.cache.trim(w) == w) {
            self.fresh()?;
        }
        Ok(ms)
    }
}

/// How far a cached curve's one-token step time may be from a fresh one before the curve is
/// measured again: a curve measured while the machine was loaded (a perplexity run beside
/// it gave t(1) = 69.6 ms where a quiet machine takes 7, and a cost model under which
/// drafting almost never paid) is not reused on a machine that runs at another pace.
pub const STALE_STEP_RATIO: f64 = 1.5;

/// Whether a cached curve with one-token step `cached_ms` no longer describes a machine
/// whose step now takes `now_ms` ([`STALE_STEP_RATIO`] either way; a curve without a
/// measured step time is never stale).
pub fn stale(cached_ms: f64, now_ms: f64) -> bool {
    cached_ms > 0.0 && now_ms > 0.0 && (now_ms / cached_ms > STALE_STEP_RATIO || cached_ms / now_ms > STALE_STEP_RATIO)
}

/// The median wall time of a one-token step of `target` over `reps` steps after a warm-up,
/// milliseconds.
fn step_ms(target: &Transformer, reps: usize) -> Result<f64> {
    let mut timer = WindowTimer::new(target)?;
    timer.time(1)?;
    let mut times = (0..reps.max(1)).map(|_| timer.time(1)).collect::<Result<Vec<f64>>>()?;
    times.sort_by(f64::total_cmp);
    Ok(times[times.len() / 2])
}

/// The wall time of one plain step run pipelined ([`models::generate::decode`], greedy),
/// milliseconds: the median over `reps` runs of 16 steps after `ctx`, per step.
fn pipelined_step_ms(target: &Transformer, ctx: &[u32], reps: usize) -> Result<f64> {
    let what = || "calibrating the pipelined plain step".to_string();
    const STEPS: usize = 16;
    let params = models::GenerateParams { max_tokens: STEPS, sampler: models::Sampler::default(), eos: Vec::new() };
    let (&last, head) = ctx.split_last().expect("a calibration context");
    let mut times = Vec::with_capacity(reps.max(1));
    for _ in 0..reps.max(1) {
        let mut cache = target.make_cache();
        target.prefill(&ids(head).context(what)?, &mut cache).context(what)?;
        let mut first = None;
        let mut read = 0;
        models::generate::decode(target, &mut cache, last, 0, &params, |_| {
            read += 1;
            if read == 1 {
                first = Some(Instant::now());
            }
            true
        })
        .context(what)?;
        // From the first token read to the last: `STEPS - 1` steps at the pipeline's pace.
        let first = first.expect("decode read a token");
        times.push(first.elapsed().as_secs_f64() * 1e3 / (STEPS - 1) as f64);
    }
    times.sort_by(f64::total_cmp);
    Ok(times[times.len() / 2])
}

/// Where a provider's cost curve comes from: given, or measured on first use (and cached on
/// disk when a [`CurveCache`] is set).
#[derive(Debug)]
pub struct CostModel {
    fixed: Option<CostCurve>,
    cache: Option<CurveCache>,
    measured: Mutex<Option<CostCurve>>,
}

impl CostModel {
    /// Always `curve`.
    pub fn fixed(curve: CostCurve) -> Self {
        CostModel { fixed: Some(curve), cache: None, measured: Mutex::new(None) }
    }

    /// Measured with [`calibrate`] on first use; read from and written to `cache` when set.
    pub fn measure(cache: Option<CurveCache>) -> Self {
        CostModel { fixed: None, cache, measured: Mutex::new(None) }
    }

    /// The curve, measuring it on `target` (or reading the disk cache) the first time.
    ///
    /// # Errors
    /// Target forward failures while measuring.
    pub fn curve(&self, target: &Transformer) -> Result<CostCurve> {
        if let Some(c) = &self.fixed {
            return Ok(c.clone());
        }
        let mut slot = self.measured.lock().expect("cost model lock");
        if let Some(c) = slot.as_ref() {
            return Ok(c.clone());
        }
        let cached = match self.cache.as_ref().and_then(CurveCache::load) {
            Some(c) => {
                let now = step_ms(target, 5)?;
                if stale(c.step_ms, now) {
                    tracing::info!(
                        target: "spec::policy",
                        "the cached cost curve was measured at {:.2} ms per step, the target now takes {now:.2}: \
                         measuring it again",
                        c.step_ms
                    );
                    None
                } else {
                    Some(c)
                }
            }
            None => None,
        };
        let curve = match cached {
            Some(c) => c,
            None => {
                tracing::info!(target: "spec::policy", "measuring the target's verify cost curve (first use)");
                let c = calibrate(target, 3)?;
                tracing::info!(target: "spec::policy", "cost curve t(T): {}", c.describe());
                if let Some(cache) = &self.cache {
                    cache.store(&c);
                }
                c
            }
        };
        *slot = Some(curve.clone());
        Ok(curve)
    }

    /// The curve if it is known already (given, or measured by an earlier request).
    pub fn current(&self) -> Option<CostCurve> {
        self.fixed.clone().or_else(|| self.measured.lock().ok()?.clone())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn brute(curve: &CostCurve, s: &[f64]) -> usize {
        let ratios: Vec<f64> = (0..=s.len()).map(|k| round_ratio(curve, s, k)).collect();
        let best = (0..ratios.len()).fold(0, |b, k| if ratios[k] > ratios[b] { k } else { b });
        if ratios[best] >= ratios[0] * (1.0 + MIN_GAIN) { best } else { 0 }
    }

    #[test]
    fn a_cached_curve_is_stale_when_the_step_time_moved() {
        assert!(!stale(7.0, 7.0) && !stale(7.0, 9.5) && !stale(7.0, 5.0));
        assert!(stale(69.6, 7.0) && stale(7.0, 11.0));
        assert!(!stale(0.0, 7.0), "a synthetic curve has no step time to compare");
    }

    #[test]
    fn returns_the_argmax_for_a_curve_and_survivals() {
        let curve = CostCurve::linear(0.2, 33);
        // 90% per token: the research note's table puts the best window at 6-7 drafts.
        let s: Vec<f64> = (1..=32).map(|i| 0.9f64.powi(i)).collect();
        let k = choose(&curve, &s, |_| 0.0);
        assert!((6..=7).contains(&k), "k* = {k}");
        assert_eq!(k, brute(&curve, &s));
        // 99%: long windows.
        let s: Vec<f64> = (1..=32).map(|i| 0.99f64.powi(i)).collect();
        assert!(choose(&curve, &s, |_| 0.0) >= 20);
        // A concave measured curve: t(2) = 1.5 then flat-ish growth.
        let curve = CostCurve::from_ms(&[10.0, 15.0, 16.0, 17.0, 18.0, 19.0]).unwrap();
        let s = [0.6, 0.5, 0.45, 0.4, 0.1];
        assert_eq!(choose(&curve, &s, |_| 0.0), brute(&curve, &s));
        assert_eq!(choose(&curve, &s, |_| 0.0), 4);
        // A drafting cost per token shortens the window.
        let curve = CostCurve::linear(0.2, 33);
        // After a plain step the window costs t(1) + t(k): a 30%-survival first draft that
        // pays at t(2) = 1.2 does not pay at t(1) + t(1) = 2.
        assert_eq!(choose(&curve, &[0.3], |k| split_window_cost(&curve, k, false)), 1);
        assert_eq!(choose(&curve, &[0.3], |k| split_window_cost(&curve, k, true)), 0);
        assert!((split_window_cost(&curve, 4, true) - (1.0 + 1.6 - 1.8)).abs() < 1e-12);
        let s: Vec<f64> = (1..=32).map(|i| 0.9f64.powi(i)).collect();
        assert!(choose(&curve, &s, |k| 0.3 * k as f64) < 6);
    }

    #[test]
    fn returns_zero_when_nothing_beats_a_plain_step() {
        let curve = CostCurve::linear(0.2, 33);
        assert_eq!(choose(&curve, &[0.15, 0.05, 0.01], |_| 0.0), 0);
        assert_eq!(choose(&curve, &[], |_| 0.0), 0);
        // Just above break-even but below the minimum gain.
        assert_eq!(choose(&curve, &[0.21], |_| 0.0), 0);
        assert_eq!(choose(&curve, &[0.3], |_| 0.0), 1);
    }

    #[test]
    fn adapts_as_acceptances_arrive() {
        let curve = CostCurve::linear(0.2, 33);
        let key = SurvivalKey::new(Origin::Own, 3);
        let mut m = AcceptanceModel::default();
        let prior = choose(&curve, &m.survival(key, 32), |_| 0.0);
        assert!(prior > 0, "the prior of a 3-token match drafts");
        // Every proposal rejected at its first token: plain steps.
        for _ in 0..20 {
            m.observe(key, 0, false);
        }
        assert_eq!(choose(&curve, &m.survival(key, 32), |_| 0.0), 0);
        // Then long copy runs: long windows.
        for _ in 0..300 {
            for j in 0..32 {
                m.observe(key, j, true);
            }
        }
        assert!(choose(&curve, &m.survival(key, 32), |_| 0.0) >= 16);
        // Other keys keep their prior.
        assert_eq!(choose(&curve, &m.survival(SurvivalKey::new(Origin::Store, 3), 32), |_| 0.0), prior);
        assert!(m.describe()["own/3-4"]["observed"].as_f64().unwrap() > 0.0);
    }

    #[test]
    fn keep_drafting_is_the_argmax_over_the_projected_survivals() {
        let curve = CostCurve::linear(0.2, 33);
        // A confident next draft after confident ones: go on; a doubtful one: stop.
        assert!(keep_drafting(&curve, &[0.9, 0.81], 0.9, 0.9, 16, |_| 0.0));
        assert!(!keep_drafting(&curve, &[0.9, 0.81], 0.05, 0.9, 16, |_| 0.0));
        // Nothing drafted yet: the plain step's minimum gain applies.
        assert!(!keep_drafting(&curve, &[], 0.21, 0.0, 16, |_| 0.0));
        assert!(keep_drafting(&curve, &[], 0.5, 0.5, 16, |_| 0.0));
        // At the cap, never.
        assert!(!keep_drafting(&curve, &[0.9; 4], 1.0, 1.0, 4, |_| 0.0));
        // The best round's ratio is the maximum of `round_ratio` (k = 0 included).
        let s = [0.9, 0.81, 0.05];
        let best = (0..=3).map(|k| round_ratio(&curve, &s, k)).fold(0.0, f64::max);
        assert!((best_round_ratio(&curve, &s, |_| 0.0) - best).abs() < 1e-12);
        assert_eq!(best_round_ratio(&curve, &[0.01], |_| 0.0), 1.0);
        // A drafting cost per token stops earlier.
        assert!(keep_drafting(&curve, &[0.7], 0.6, 0.6, 16, |_| 0.0));
        assert!(!keep_drafting(&curve, &[0.7], 0.6, 0.6, 16, |k| 0.5 * k as f64));
        // The same decision as `choose` on the projected vector.
        for next in [0.1, 0.3, 0.5, 0.7, 0.9] {
            let s = [0.8, 0.6];
            let mut projected = s.to_vec();
            let mut last = 0.6 * next;
            projected.push(last);
            while projected.len() < 10 {
                last *= 0.7;
                projected.push(last);
            }
            assert_eq!(keep_drafting(&curve, &s, next, 0.7, 10, |_| 0.0), choose(&curve, &projected, |_| 0.0) > 2);
        }
    }

    #[test]
    fn rated_keys_learn_their_bucket() {
        assert_eq!(SurvivalKey::rated(0.1).bucket, 0);
        assert_eq!(SurvivalKey::rated(0.85).bucket, 4);
        assert_eq!(SurvivalKey::rated(1.0).bucket, 6);
        let mut m = AcceptanceModel::default();
        let (low, high) = (SurvivalKey::rated(0.2), SurvivalKey::rated(0.99));
        assert!(m.conditional(low, 0) < m.conditional(high, 0), "the prior orders the buckets");
        // A head that is confidently wrong is recalibrated by what it observes.
        for _ in 0..50 {
            m.observe(high, 0, false);
            m.observe(low, 0, true);
        }
        assert!(m.conditional(high, 0) < 0.1 && m.conditional(low, 0) > 0.9);
        assert!(m.describe()["rated/>=0.97"]["observed"].as_f64().unwrap() > 0.0);
    }

    #[test]
    fn curves_interpolate_predict_and_round_trip() {
        let c = CostCurve::from_ms(&[10.0, 12.0, 14.0]).unwrap();
        assert_eq!(c.t(1), 1.0);
        assert!((c.t(5) - 1.8).abs() < 1e-12, "{}", c.t(5));
        assert!(CostCurve::from_ms(&[]).is_err());
        assert!(CostCurve::from_ms(&[1.0, 0.0]).is_err());
        // Predicted ratio: 2 rounds of 2 drafts, all accepted (6 tokens), 1 plain round.
        let stats = SpecStats {
            rounds: 3,
            emitted: 7,
            drafted_by_pos: vec![2, 2, 0],
            accepted_by_pos: vec![2, 2, 0],
            ..SpecStats::default()
        };
        let lin = CostCurve::linear(0.5, 4);
        assert!((predicted_ratio(&lin, &stats) - 7.0 / (2.0 * 2.0 + 1.0)).abs() < 1e-12);
        // Plain decoding pipelined at 0.9 of a step, and the plain round was pipelined too.
        let piped = CostCurve { pipelined: 0.9, ..lin.clone() };
        let stats = SpecStats { pipelined_steps: 1, ..stats };
        assert!((predicted_ratio(&piped, &stats) - 7.0 * 0.9 / (2.0 * 2.0 + 0.9)).abs() < 1e-12);
        // Plain steps stay pipelined unless the next round is worth more than the pipeline.
        assert!(piped.pipeline_plain_steps(1.0) && piped.pipeline_plain_steps(1.1));
        assert!(!piped.pipeline_plain_steps(1.2));
        assert!(lin.pipeline_plain_steps(1.01) && !lin.pipeline_plain_steps(1.05));
        let dir = tempfile::tempdir().unwrap();
        let cache = CurveCache { path: dir.path().join("x/c.json"), key: "k1".into() };
        assert_eq!(cache.load(), None);
        cache.store(&c);
        let back = cache.load().unwrap();
        assert_eq!((back.t.clone(), back.origin.as_str()), (c.t.clone(), "cached"));
        let other = CurveCache { key: "k2".into(), ..cache };
        assert_eq!(other.load(), None, "another key misses");
        let key = CurveCache::for_model(dir.path(), &models::LoadOptions::default()).key;
        assert!(key.contains("kernels=") && key.contains("cpu=") && key.contains("backend="), "{key}");
    }

    #[test]
    fn a_fuller_batch_drafts_less() {
        // A SmolLM2-like curve: t(1 + k) = 1 + 0.2 k; drafts accepted with 0.7 each.
        let survival: Vec<f64> = (1..=8).map(|i| 0.7f64.powi(i)).collect();
        let alone = CostCurve::linear(0.2, 120);
        let k_alone = choose(&alone, &survival, |_| 0.0);
        assert!(k_alone >= 3, "{k_alone}");
        // In a batch with no one else, the same choice (only the split cost disappears).
        let empty = CostCurve { batch: Some(BatchLoad::default()), ..alone.clone() };
        assert_eq!(choose(&empty, &survival, |_| 0.0), k_alone);
        assert_eq!(split_window_cost(&empty, 3, true), 0.0);
        assert!(split_window_cost(&alone, 3, true) > 0.0);
        let mut last = k_alone;
        for others in [1, 3, 7, 15, 31] {
            let load = BatchLoad { rows: others, tokens: others as f64 };
            let k = choose(&CostCurve { batch: Some(load), ..alone.clone() }, &survival, |_| 0.0);
            assert!(k <= last, "{others} others: {k} drafts after {last}");
            last = k;
        }
        assert_eq!(last, 0, "31 other rows: the rows of drafts cost more than they bring");
        // The batch's ratio: with 3 others at 1 token per row, one draft at s = 0.7 gives
        // (3 + 1 + 0.7) / t(5) = 4.7 / 1.8 > 4 / 1.6.
        let three = CostCurve { batch: Some(BatchLoad { rows: 3, tokens: 3.0 }), ..alone.clone() };
        assert!(choose(&three, &[0.7], |_| 0.0) == 1);
        assert!(choose(&three, &[0.4], |_| 0.0) == 0, "(4 + 0.4) / 1.8 < 4 / 1.6");
    }

    #[test]
    fn the_prefix_scheduler_adds_the_likeliest_positions_while_throughput_grows() {
        let curve = CostCurve::linear(0.2, 120);
        // Two requests: r0 confident (0.9, 0.8, 0.3), r1 not (0.5, 0.1).
        let prefixes = vec![vec![0.9, 0.72, 0.216], vec![0.5, 0.05]];
        // Alone in the forward: tau / t(B) from 2 / 1.2; add 0.9 (2.9 / 1.4), 0.72 (3.62 / 1.6),
        // 0.5 (4.12 / 1.8 = 2.29 > 2.26), then 0.216 (4.336 / 2.0 = 2.17): stop.
        assert_eq!(schedule_prefixes(&curve, &prefixes, BatchLoad::default()), vec![2, 1]);
        // With 10 other rows expecting 10 tokens, a position must bring more than 0.2 times
        // the batch's tokens per forward (about 3.8): 0.9 does, 0.72 does not.
        let busy = BatchLoad { rows: 10, tokens: 10.0 };
        assert_eq!(schedule_prefixes(&curve, &prefixes, busy), vec![1, 0]);
        // A flat (memory-bound) curve takes every position with a positive estimate.
        let flat = CostCurve::linear(0.0, 120);
        assert_eq!(schedule_prefixes(&flat, &prefixes, BatchLoad::default()), vec![3, 2]);
        // A steep curve takes none.
        let steep = CostCurve::linear(1.0, 120);
        assert_eq!(schedule_prefixes(&steep, &prefixes, BatchLoad::default()), vec![0, 0]);
        // Early stop: once a position does not pay, later (smaller) ones are not tried.
        assert_eq!(schedule_prefixes(&curve, &[vec![0.1, 0.09]], BatchLoad::default()), vec![0]);
        assert!(schedule_prefixes(&curve, &[], BatchLoad::default()).is_empty());
    }
}
