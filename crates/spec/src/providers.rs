//! The one drafter factory: which drafter a request uses, with its options and their
//! defaults, parsed once and built into a [`DraftProvider`]. `mlx-spec generate`, the A/B
//! (`examples/ab.rs`, `cargo xtask ab`) and the benchmark (`examples/spec_bench.rs`) all go
//! through it, so they measure the same drafter for the same words.
//!
//! ```text
//! DrafterArgs (flags, all optional)  --DrafterSpec::from_args-->  DrafterSpec  --load-->  LoadedDrafter
//! "suffix" | "ngram" | DIR (A/B arm) --DrafterSpec::parse----->      (checked,        (provider, γ)
//!                                                                     defaults filled)
//! ```
//!
//! **The default** (no drafting flag, [`DrafterArgs::default`]) is the suffix drafter of
//! [`crate::suffix`] under the cost-aware length policy of [`crate::policy`], the same for
//! `mlx-spec generate` and the library; `--draft-kind none` ([`DraftKind::None`]) decodes
//! plainly.
//!
//! A directory is a DeepSpec DSpark / DFlash drafter when its `config.json` parses as a
//! [`drafter::DrafterConfig`], and a two-model drafter (a small model of the target's
//! family, with the target's tokenizer) otherwise.
use std::path::{Path, PathBuf};

use models::tokenizer::Tokenizer;
use models::{LoadOptions, load_model};

use crate::dspark::DSparkProvider;
use crate::error::Context;
use crate::ngram::{DEFAULT_NGRAM_MAX, DEFAULT_NGRAM_MIN, DEFAULT_NUM_DRAFT_TOKENS, DraftSchedule, NgramProvider};
use crate::policy::{CostModel, CurveCache};
use crate::suffix::{DEFAULT_STORE_REQUESTS, MAX_PROPOSAL, SuffixProvider};
use crate::two_model::{self, DraftSampling, TwoModelProvider, check_tokenizers};
use crate::{Acceptance, DraftProvider, Error, Result};

/// The kind of drafter asked for by name (`--draft-kind`): parsed from `suffix`, `ngram`,
/// `model` or `none`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DraftKind {
    /// No drafter: plain decoding.
    None,
    /// Suffix-automaton drafting ([`crate::suffix`]) under the cost-aware length policy: no
    /// weights. The default.
    Suffix,
    /// A drafter with weights in a directory (`--draft-model`): a small model with the
    /// target's tokenizer, or a DSpark drafter checkpoint.
    Model,
    /// Prompt lookup ([`crate::ngram`]): no weights.
    Ngram,
}

impl DraftKind {
    /// The word that names the kind (`none`, `suffix`, `model`, `ngram`), as
    /// [`str::parse`] reads it.
    pub fn as_str(self) -> &'static str {
        match self {
            DraftKind::None => "none",
            DraftKind::Suffix => "suffix",
            DraftKind::Model => "model",
            DraftKind::Ngram => "ngram",
        }
    }
}

impl std::str::FromStr for DraftKind {
    type Err = String;

    /// Parses `suffix`, `ngram`, `model` or `none`.
    fn from_str(s: &str) -> std::result::Result<Self, Self::Err> {
        match s {
            "none" => Ok(DraftKind::None),
            "suffix" => Ok(DraftKind::Suffix),
            "model" => Ok(DraftKind::Model),
            "ngram" => Ok(DraftKind::Ngram),
            _ => Err(format!("unknown drafter kind `{s}`: expected `suffix`, `ngram`, `model` or `none`")),
        }
    }
}

/// How many drafts a round verifies (`--draft-length`): the policy's choice or all of them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DraftLength {
    /// The cost-aware policy of [`crate::policy`] picks `0..=num_draft_tokens` each round.
    Adaptive,
    /// Every token the drafter proposes, up to `num_draft_tokens`.
    Fixed,
}

impl std::str::FromStr for DraftLength {
    type Err = String;

    /// Parses `adaptive` or `fixed`.
    fn from_str(s: &str) -> std::result::Result<Self, Self::Err> {
        match s {
            "adaptive" => Ok(DraftLength::Adaptive),
            "fixed" => Ok(DraftLength::Fixed),
            _ => Err(format!("unknown draft length `{s}`: expected `adaptive` or `fixed`")),
        }
    }
}

/// The drafting options as a command line states them: every field optional, nothing
/// checked yet. The error messages of [`DrafterSpec::from_args`] name the `mlx-spec
/// generate` flag of each field.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct DrafterArgs {
    /// `--draft-model DIR`: a draft model or DSpark drafter directory.
    pub draft_model: Option<PathBuf>,
    /// `--draft-kind`: `Model` needs `draft_model` (and is implied by it); the others refuse
    /// it; unset without `draft_model`: `Suffix`.
    pub draft_kind: Option<DraftKind>,
    /// `--num-draft-tokens`: drafts per round (γ); defaults per drafter (see [`DrafterSpec`]).
    pub num_draft_tokens: Option<usize>,
    /// `--ngram-max`: longest trailing n-gram tried [default: [`DEFAULT_NGRAM_MAX`]].
    pub ngram_max: Option<usize>,
    /// `--ngram-min`: shortest trailing n-gram tried [default: [`DEFAULT_NGRAM_MIN`]].
    pub ngram_min: Option<usize>,
    /// `--ngram-schedule` [default: [`DraftSchedule::default`], the heuristic].
    pub ngram_schedule: Option<DraftSchedule>,
    /// `--confidence-threshold`: DSpark drafters only [default: 0, off].
    pub confidence_threshold: Option<f32>,
    /// `--draft-length`: suffix drafting and draft models only [default: adaptive for
    /// suffix, fixed for a draft model].
    pub draft_length: Option<DraftLength>,
    /// `--acceptance`: only checked here (a rule other than exact match needs a drafter);
    /// the caller passes it on in [`crate::SpecOptions`].
    pub acceptance: Acceptance,
}

/// N-gram (prompt lookup) drafting with its options; [`NgramSpec::default`] holds the
/// defaults every caller shares.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct NgramSpec {
    /// The longest trailing n-gram tried first.
    pub max: usize,
    /// The shortest trailing n-gram tried (`1 <= min <= max`).
    pub min: usize,
    /// Drafts per round (γ).
    pub num_draft_tokens: usize,
    /// How many of the tokens a match offers a round drafts.
    pub schedule: DraftSchedule,
}

impl Default for NgramSpec {
    /// n-grams 3 down to 1, γ 10, the heuristic schedule.
    fn default() -> Self {
        NgramSpec {
            max: DEFAULT_NGRAM_MAX,
            min: DEFAULT_NGRAM_MIN,
            num_draft_tokens: DEFAULT_NUM_DRAFT_TOKENS,
            schedule: DraftSchedule::default(),
        }
    }
}

impl NgramSpec {
    /// The provider these options describe.
    ///
    /// # Errors
    /// [`Error::Invalid`] unless `1 <= min <= max`.
    pub fn provider(&self) -> Result<NgramProvider> {
        Ok(NgramProvider::new(self.max, self.min)?.with_schedule(self.schedule))
    }
}

/// Suffix drafting with its options; [`SuffixSpec::default`] is the default drafter.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SuffixSpec {
    /// The most drafts per round (`K`; the policy chooses `0..=K` each round).
    pub num_draft_tokens: usize,
    /// Whether the cost-aware policy chooses each round's length (otherwise every proposed
    /// token, up to `num_draft_tokens`, is drafted).
    pub adaptive: bool,
    /// Earlier requests' streams kept for drafting (0: none).
    pub store_requests: usize,
}

impl Default for SuffixSpec {
    /// Up to [`MAX_PROPOSAL`] (32) drafts, adaptive, a store of [`DEFAULT_STORE_REQUESTS`].
    fn default() -> Self {
        SuffixSpec { num_draft_tokens: MAX_PROPOSAL, adaptive: true, store_requests: DEFAULT_STORE_REQUESTS }
    }
}

impl SuffixSpec {
    /// The provider these options describe, with `cost` as its cost model.
    pub fn provider(&self, cost: CostModel) -> SuffixProvider {
        let p = SuffixProvider::new(cost).with_store(self.store_requests);
        if self.adaptive { p } else { p.fixed_length() }
    }
}

/// Which drafter a request uses, checked and with every default filled in (except those
/// only the loaded weights know: a DSpark drafter's block size).
#[derive(Debug, Clone, PartialEq)]
pub enum DrafterSpec {
    /// No drafter: plain decoding.
    None,
    /// Suffix drafting under the cost-aware policy (the default).
    Suffix(SuffixSpec),
    /// Prompt lookup.
    Ngram(NgramSpec),
    /// A small model with the target's tokenizer drafts (two-model speculative decoding).
    Model {
        /// The model directory (mlx-lm layout).
        dir: PathBuf,
        /// Drafts per round; `None`: [`two_model::DEFAULT_NUM_DRAFT_TOKENS`] (mlx-lm's 3).
        num_draft_tokens: Option<usize>,
        /// How the draft model picks its tokens ([`DraftSampling::Request`] by default).
        sampling: DraftSampling,
        /// Whether the cost-aware policy picks each round's length (up to
        /// `num_draft_tokens`, default [`two_model::DEFAULT_ADAPTIVE_DRAFT_TOKENS`]).
        adaptive: bool,
    },
    /// A DeepSpec DSpark / DFlash drafter checkpoint drafts a block per round.
    DSpark {
        /// The checkpoint directory (bf16 or quantized).
        dir: PathBuf,
        /// Drafts per round; `None`: the drafter's block size.
        num_draft_tokens: Option<usize>,
        /// Cut each block before the first position whose confidence is below this (0 = off).
        confidence_threshold: f32,
        /// Whether the cost-aware policy cuts each block ([`DSparkProvider::with_policy`]).
        adaptive: bool,
    },
}

/// The target a drafter is built for: where it was loaded from and how.
#[derive(Clone, Copy)]
pub struct DraftTarget<'a> {
    /// The target's directory (named in tokenizer mismatch errors).
    pub dir: &'a Path,
    /// The target's tokenizer; a draft model's must match it.
    pub tokenizer: &'a Tokenizer,
    /// The load options of the target, used for drafter weights too (compute dtype).
    pub load: &'a LoadOptions,
}

impl DraftTarget<'_> {
    /// The load options of a drafter: the target's dtype and kernels, with call counters of
    /// its own (the target's [`mlx_core::KernelPolicy::calls`] count only the target).
    pub fn drafter_load(&self) -> LoadOptions {
        LoadOptions { kernels: self.load.kernels.clone().with_new_counters(), ..self.load.clone() }
    }
}

/// A built drafter and its drafts per round.
pub struct LoadedDrafter {
    /// Opens one draft source per request.
    pub provider: Box<dyn DraftProvider>,
    /// Drafts per round (γ), the spec's or the drafter's default.
    pub num_draft_tokens: usize,
}

impl DrafterSpec {
    /// The kind of drafter this spec builds (`model` for a draft model and a DSpark
    /// drafter).
    pub fn kind(&self) -> DraftKind {
        match self {
            DrafterSpec::None => DraftKind::None,
            DrafterSpec::Suffix(_) => DraftKind::Suffix,
            DrafterSpec::Ngram(_) => DraftKind::Ngram,
            DrafterSpec::Model { .. } | DrafterSpec::DSpark { .. } => DraftKind::Model,
        }
    }

    /// Resolves command-line style options into one spec, refusing combinations that would
    /// silently be ignored. Runs before anything is loaded; reads only a drafter
    /// directory's `config.json` (to tell a DSpark checkpoint from a model).
    ///
    /// # Errors
    /// [`Error::Invalid`], naming the flag: `--draft-kind ngram|suffix|none` with
    /// `--draft-model`, `--draft-kind model` without it, n-gram options without
    /// `--draft-kind ngram`, `--num-draft-tokens` or a non-exact `--acceptance` with
    /// `--draft-kind none`,
    /// `--confidence-threshold` without a DSpark drafter, n-gram sizes outside
    /// `1 <= min <= max`, a drafter directory that does not exist or has no config.json.
    pub fn from_args(a: &DrafterArgs) -> Result<DrafterSpec> {
        let kind = match (a.draft_kind, &a.draft_model) {
            (Some(k @ (DraftKind::Ngram | DraftKind::Suffix | DraftKind::None)), Some(dir)) => {
                let word = match k {
                    DraftKind::Ngram => "ngram drafts without weights",
                    DraftKind::Suffix => "suffix drafts without weights",
                    _ => "none decodes plainly",
                };
                return invalid(format!("--draft-kind {word}; drop --draft-model {}", dir.display()));
            }
            (Some(DraftKind::Model), None) => return invalid("--draft-kind model needs --draft-model DIR".into()),
            (Some(DraftKind::None), None) => None,
            (Some(kind), _) => Some(kind),
            (None, Some(_)) => Some(DraftKind::Model),
            (None, None) => Some(DraftKind::Suffix),
        };
        if kind != Some(DraftKind::Ngram)
            && (a.ngram_max.is_some() || a.ngram_min.is_some() || a.ngram_schedule.is_some())
        {
            return invalid("--ngram-max/--ngram-min/--ngram-schedule apply to --draft-kind ngram only".into());
        }
        if kind.is_none() && a.num_draft_tokens.is_some() {
            return invalid("--num-draft-tokens needs a drafter: drop --draft-kind none".into());
        }
        if kind.is_some() && a.num_draft_tokens == Some(0) {
            return invalid("--num-draft-tokens 0 drafts nothing: use --draft-kind none for plain decoding".into());
        }
        if kind != Some(DraftKind::Model) && a.confidence_threshold.is_some() {
            return invalid("--confidence-threshold applies to DSpark drafters (--draft-model DIR) only".into());
        }
        if a.draft_length.is_some() && !matches!(kind, Some(DraftKind::Suffix | DraftKind::Model)) {
            return invalid("--draft-length applies to --draft-kind suffix and --draft-model DIR only".into());
        }
        if kind.is_none() && a.acceptance != Acceptance::ExactMatch {
            return invalid("--acceptance needs a drafter: drop --draft-kind none".into());
        }
        match kind {
            None | Some(DraftKind::None) => Ok(DrafterSpec::None),
            Some(DraftKind::Suffix) => {
                let defaults = SuffixSpec::default();
                Ok(DrafterSpec::Suffix(SuffixSpec {
                    num_draft_tokens: a.num_draft_tokens.unwrap_or(defaults.num_draft_tokens),
                    adaptive: a.draft_length != Some(DraftLength::Fixed),
                    ..defaults
                }))
            }
            Some(DraftKind::Ngram) => {
                let defaults = NgramSpec::default();
                let max = a.ngram_max.unwrap_or(defaults.max);
                let min = a.ngram_min.unwrap_or(defaults.min);
                if min == 0 || min > max {
                    return invalid(format!(
                        "--ngram-min {min} --ngram-max {max}: expected 1 <= ngram-min <= ngram-max"
                    ));
                }
                Ok(DrafterSpec::Ngram(NgramSpec {
                    max,
                    min,
                    num_draft_tokens: a.num_draft_tokens.unwrap_or(defaults.num_draft_tokens),
                    schedule: a.ngram_schedule.unwrap_or(defaults.schedule),
                }))
            }
            Some(DraftKind::Model) => {
                let dir = a.draft_model.clone().expect("kind Model has a directory");
                check_model_dir(&dir, "--draft-model")?;
                if is_dspark_dir(&dir) {
                    let adaptive = a.draft_length == Some(DraftLength::Adaptive);
                    if adaptive && a.confidence_threshold.is_some() {
                        return invalid(
                            "--confidence-threshold cuts blocks at a fixed confidence; --draft-length adaptive \
                             chooses the cut from the cost curve: pass one of them"
                                .into(),
                        );
                    }
                    let confidence_threshold = a.confidence_threshold.unwrap_or(0.0);
                    let num_draft_tokens = a.num_draft_tokens;
                    return Ok(DrafterSpec::DSpark { dir, num_draft_tokens, confidence_threshold, adaptive });
                }
                if a.confidence_threshold.is_some() {
                    return invalid(format!("--confidence-threshold: {} is not a DSpark drafter", dir.display()));
                }
                let sampling = DraftSampling::default();
                let adaptive = a.draft_length == Some(DraftLength::Adaptive);
                Ok(DrafterSpec::Model { dir, num_draft_tokens: a.num_draft_tokens, sampling, adaptive })
            }
        }
    }

    /// One drafter named by a word, as the A/B and the benchmarks take them: `suffix`,
    /// `ngram` (with the defaults of [`SuffixSpec`] / [`NgramSpec`]), `none`, or a directory
    /// (a DSpark drafter or a draft model). The same as [`DrafterSpec::from_args`] with that
    /// `--draft-kind` or `--draft-model DIR` alone.
    ///
    /// # Errors
    /// [`Error::Invalid`] for a word that is none of these.
    pub fn parse(word: &str) -> Result<DrafterSpec> {
        if let Ok(kind @ (DraftKind::Ngram | DraftKind::Suffix | DraftKind::None)) = word.parse::<DraftKind>() {
            return DrafterSpec::from_args(&DrafterArgs { draft_kind: Some(kind), ..DrafterArgs::default() });
        }
        if !Path::new(word).join("config.json").is_file() {
            return invalid(format!(
                "drafter {word}: expected `suffix`, `ngram`, `none` or a model directory with config.json"
            ));
        }
        DrafterSpec::from_args(&DrafterArgs { draft_model: Some(word.into()), ..DrafterArgs::default() })
    }

    /// The same spec with another [`DraftSampling`] for a draft model (other drafters are
    /// unchanged).
    pub fn with_draft_sampling(mut self, draft_sampling: DraftSampling) -> Self {
        if let DrafterSpec::Model { sampling, .. } = &mut self {
            *sampling = draft_sampling;
        }
        self
    }

    /// The drafter as `mlx-spec generate --stats-json` reports it: `null` without one,
    /// `{"kind": "suffix", "policy": "cost-aware" | "fixed", "store_requests"}`,
    /// `{"kind": "ngram", "ngram_max", "ngram_min", "schedule"}`, or
    /// `{"kind": "model" | "dspark", "path"}`.
    pub fn describe(&self) -> serde_json::Value {
        match self {
            DrafterSpec::None => serde_json::Value::Null,
            DrafterSpec::Suffix(s) => serde_json::json!({
                "kind": "suffix",
                "policy": if s.adaptive { "cost-aware" } else { "fixed" },
                "store_requests": s.store_requests,
            }),
            DrafterSpec::Ngram(n) => serde_json::json!({
                "kind": "ngram", "ngram_max": n.max, "ngram_min": n.min, "schedule": n.schedule.name(),
            }),
            DrafterSpec::Model { dir, adaptive: false, .. } => {
                serde_json::json!({"kind": "model", "path": dir.display().to_string()})
            }
            DrafterSpec::Model { dir, adaptive: true, .. } => {
                serde_json::json!({"kind": "model", "path": dir.display().to_string(), "policy": "cost-aware"})
            }
            DrafterSpec::DSpark { dir, .. } => serde_json::json!({"kind": "dspark", "path": dir.display().to_string()}),
        }
    }

    /// Loads the drafter for `target` (`None` for [`DrafterSpec::None`]). A draft model
    /// samples as the request does (its per-step keys: coupled drafts under exact match,
    /// `q` rows for the rejection rule) unless the spec says otherwise. The suffix drafter's
    /// cost curve is measured on the first request (a few seconds) and cached on disk
    /// ([`CurveCache::for_model`]).
    ///
    /// # Errors
    /// [`Error::Drafter`] / [`Error::Model`] naming the directory when weights or a
    /// tokenizer do not load; [`Error::Incompatible`] for a draft model whose tokenizer is
    /// not the target's, or a DSpark drafter tapping the embedding output.
    pub fn load(&self, target: DraftTarget<'_>) -> Result<Option<LoadedDrafter>> {
        let loaded = match self {
            DrafterSpec::None => return Ok(None),
            DrafterSpec::Suffix(s) => {
                let cost = CostModel::measure(Some(CurveCache::for_model(target.dir, target.load)));
                LoadedDrafter { provider: Box::new(s.provider(cost)), num_draft_tokens: s.num_draft_tokens }
            }
            DrafterSpec::Ngram(n) => {
                LoadedDrafter { provider: Box::new(n.provider()?), num_draft_tokens: n.num_draft_tokens }
            }
            DrafterSpec::DSpark { dir, num_draft_tokens, confidence_threshold, adaptive } => {
                let drafter = drafter::Drafter::load(dir, &target.drafter_load())
                    .context(|| format!("loading DSpark drafter {}", dir.display()))?;
                let num_draft_tokens = num_draft_tokens.unwrap_or(drafter.block_size());
                let mut provider = DSparkProvider::new(drafter, dir.display().to_string())?
                    .with_confidence_threshold(*confidence_threshold);
                if *adaptive {
                    provider =
                        provider.with_policy(CostModel::measure(Some(CurveCache::for_model(target.dir, target.load))));
                }
                LoadedDrafter { provider: Box::new(provider), num_draft_tokens }
            }
            DrafterSpec::Model { dir, num_draft_tokens, sampling, adaptive } => {
                let name = dir.display().to_string();
                let draft_tok = Tokenizer::from_dir(dir).context(|| format!("loading the tokenizer of {name}"))?;
                check_tokenizers(&draft_tok, target.tokenizer, &name, &target.dir.display().to_string())?;
                let model =
                    load_model(dir, &target.drafter_load()).context(|| format!("loading draft model {name}"))?;
                let mut provider = TwoModelProvider::new(model, name).with_sampling(*sampling);
                if *adaptive {
                    let cache = |dir: &Path| CostModel::measure(Some(CurveCache::for_model(dir, target.load)));
                    provider = provider.with_policy(cache(target.dir), cache(dir));
                }
                let default = if *adaptive {
                    two_model::DEFAULT_ADAPTIVE_DRAFT_TOKENS
                } else {
                    two_model::DEFAULT_NUM_DRAFT_TOKENS
                };
                let num_draft_tokens = num_draft_tokens.unwrap_or(default);
                LoadedDrafter { provider: Box::new(provider), num_draft_tokens }
            }
        };
        Ok(Some(loaded))
    }
}

/// Whether `dir` holds a DeepSpec DSpark / DFlash drafter: its config parses as a
/// [`drafter::DrafterConfig`] (any other model directory is a two-model drafter).
pub fn is_dspark_dir(dir: &Path) -> bool {
    drafter::DrafterConfig::from_dir(dir).is_ok()
}

/// Checks that `dir`, given as `flag` (`--model`, `--draft-model`), is a directory holding a
/// config.json.
///
/// # Errors
/// [`Error::Invalid`]: `"{flag} DIR: not a model directory (does not exist | not a
/// directory | no config.json)"`.
pub fn check_model_dir(dir: &Path, flag: &str) -> Result<()> {
    if !dir.is_dir() {
        let why = if dir.exists() { "not a directory" } else { "does not exist" };
        return invalid(format!("{flag} {}: not a model directory ({why})", dir.display()));
    }
    if !dir.join("config.json").is_file() {
        return invalid(format!("{flag} {}: not a model directory (no config.json)", dir.display()));
    }
    Ok(())
}

fn invalid<T>(message: String) -> Result<T> {
    Err(Error::Invalid(message))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ngram_args() -> DrafterArgs {
        DrafterArgs { draft_kind: Some(DraftKind::Ngram), ..DrafterArgs::default() }
    }

    #[test]
    fn the_cli_and_the_ab_name_the_same_ngram_drafter() {
        let cli = DrafterSpec::from_args(&ngram_args()).unwrap();
        let ab = DrafterSpec::parse("ngram").unwrap();
        assert_eq!(cli, ab);
        assert_eq!(cli, DrafterSpec::Ngram(NgramSpec::default()));
        let DrafterSpec::Ngram(n) = cli else { unreachable!() };
        assert_eq!(n.schedule, DraftSchedule::Heuristic);
        assert_eq!(n.provider().unwrap().schedule(), DraftSchedule::Heuristic);
        assert_eq!(NgramProvider::default().schedule(), n.schedule);
        assert_eq!(
            ab.describe(),
            serde_json::json!({"kind": "ngram", "ngram_max": 3, "ngram_min": 1, "schedule": "heuristic"})
        );
    }

    #[test]
    fn ignored_flags_are_refused_by_name() {
        let cases: [(DrafterArgs, &str); 8] = [
            (DrafterArgs { ngram_max: Some(2), ..DrafterArgs::default() }, "--draft-kind ngram only"),
            (DrafterArgs { ngram_schedule: Some(DraftSchedule::Constant), ..DrafterArgs::default() }, "--ngram-max"),
            (
                DrafterArgs { num_draft_tokens: Some(4), draft_kind: Some(DraftKind::None), ..DrafterArgs::default() },
                "--num-draft-tokens needs a drafter",
            ),
            (DrafterArgs { draft_kind: Some(DraftKind::Model), ..DrafterArgs::default() }, "needs --draft-model"),
            (DrafterArgs { draft_model: Some("/x".into()), ..ngram_args() }, "drop --draft-model /x"),
            (
                DrafterArgs {
                    draft_model: Some("/x".into()),
                    draft_kind: Some(DraftKind::None),
                    ..DrafterArgs::default()
                },
                "none decodes plainly",
            ),
            (DrafterArgs { confidence_threshold: Some(0.5), ..ngram_args() }, "--confidence-threshold applies"),
            (
                DrafterArgs {
                    acceptance: Acceptance::Rejection,
                    draft_kind: Some(DraftKind::None),
                    ..DrafterArgs::default()
                },
                "--acceptance needs",
            ),
        ];
        for (args, expected) in cases {
            let e = DrafterSpec::from_args(&args).unwrap_err().to_string();
            assert!(e.contains(expected), "{args:?}: {e}");
        }
        let bad = DrafterArgs { ngram_min: Some(3), ngram_max: Some(2), ..ngram_args() };
        let e = DrafterSpec::from_args(&bad).unwrap_err().to_string();
        assert!(e.contains("expected 1 <= ngram-min <= ngram-max"), "{e}");
        let missing = DrafterArgs { draft_model: Some("/nonexistent/draft".into()), ..DrafterArgs::default() };
        let e = DrafterSpec::from_args(&missing).unwrap_err().to_string();
        assert!(e.contains("--draft-model /nonexistent/draft: not a model directory (does not exist)"), "{e}");
        assert!(DrafterSpec::parse("/nonexistent/draft").unwrap_err().to_string().contains("expected `suffix`"));
        let none = DrafterArgs { draft_kind: Some(DraftKind::None), ..DrafterArgs::default() };
        assert_eq!(DrafterSpec::from_args(&none).unwrap(), DrafterSpec::None);
    }

    /// The library's default is the CLI's: no flag gives the adaptive suffix drafter, the
    /// same as `--draft-kind suffix` and the word `suffix`.
    #[test]
    fn the_default_is_the_adaptive_suffix_drafter() {
        let default = DrafterSpec::from_args(&DrafterArgs::default()).unwrap();
        assert_eq!(default, DrafterSpec::Suffix(SuffixSpec::default()));
        assert_eq!(DrafterSpec::parse("suffix").unwrap(), default);
        assert_eq!(DrafterSpec::parse("none").unwrap(), DrafterSpec::None);
        assert!(SuffixSpec::default().adaptive);
        assert_eq!(SuffixSpec::default().num_draft_tokens, 32);
        let eight = DrafterArgs { num_draft_tokens: Some(8), ..DrafterArgs::default() };
        assert_eq!(
            DrafterSpec::from_args(&eight).unwrap(),
            DrafterSpec::Suffix(SuffixSpec { num_draft_tokens: 8, ..SuffixSpec::default() })
        );
        assert_eq!(
            default.describe(),
            serde_json::json!({"kind": "suffix", "policy": "cost-aware", "store_requests": 16})
        );
        assert_eq!("suffix".parse::<DraftKind>(), Ok(DraftKind::Suffix));
        assert_eq!("none".parse::<DraftKind>(), Ok(DraftKind::None));
    }

    #[test]
    fn ngram_options_and_words_parse() {
        let args = DrafterArgs {
            num_draft_tokens: Some(4),
            ngram_max: Some(5),
            ngram_min: Some(2),
            ngram_schedule: Some("constant".parse().unwrap()),
            ..ngram_args()
        };
        let want = NgramSpec { max: 5, min: 2, num_draft_tokens: 4, schedule: DraftSchedule::Constant };
        assert_eq!(DrafterSpec::from_args(&args).unwrap(), DrafterSpec::Ngram(want));
        assert_eq!("ngram".parse::<DraftKind>(), Ok(DraftKind::Ngram));
        assert_eq!("model".parse::<DraftKind>(), Ok(DraftKind::Model));
        assert!("ngrams".parse::<DraftKind>().is_err());
        assert!("fast".parse::<DraftSchedule>().is_err());
        assert_eq!("adaptive".parse::<DraftLength>(), Ok(DraftLength::Adaptive));
        assert!("slow".parse::<DraftLength>().is_err());
        let fixed = DrafterArgs { draft_length: Some(DraftLength::Fixed), ..DrafterArgs::default() };
        assert_eq!(
            DrafterSpec::from_args(&fixed).unwrap(),
            DrafterSpec::Suffix(SuffixSpec { adaptive: false, ..SuffixSpec::default() })
        );
        let e = DrafterSpec::from_args(&DrafterArgs { draft_length: Some(DraftLength::Fixed), ..ngram_args() });
        assert!(e.unwrap_err().to_string().contains("--draft-length applies"));
    }
}
