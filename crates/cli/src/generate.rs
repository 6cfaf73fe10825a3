//! `mlx-spec generate`: plain or speculative generation with mlx_lm's flags.
//!
//! By default it speculates with the suffix drafter under the cost-aware draft-length policy
//! (`spec::suffix`, `spec::policy`: no weights; a round drafts only when the measured cost
//! curve says it pays); `--draft-model DIR` (two-model or DSpark) and `--draft-kind ngram`
//! (prompt lookup) pick other drafters, all through the speculative executor
//! ([`spec::speculative_generate`]), whose output is token for token the plain output;
//! `--draft-kind none` decodes plainly ([`models::generate`]). The drafting flags are
//! resolved and the drafter built by [`spec::providers::DrafterSpec`], the factory the A/B
//! and the benchmarks use too. A prompt longer than two prefill chunks shows a prefill bar
//! on stderr when stderr is a terminal ([`crate::progress::prefill_progress`]), cleared before
//! the first token is printed.
use std::io::{Read, Write};
use std::path::PathBuf;

use anyhow::{Context, Result, bail};
use clap::Args;
use models::tokenizer::{ChatMessage, Tokenizer};
use models::{GenerateParams, Sampler, generate_with_progress, load_model};
use spec::providers::{DraftTarget, DrafterSpec};
use spec::{Acceptance, Request, SpecOptions, SpecStats};

use crate::drafting::{DraftingArgs, target_dir};
use crate::{PrecisionArg, load_options};

#[derive(Args)]
pub(crate) struct GenerateArgs {
    /// Model directory (mlx-lm layout). Default: SmolLM2-135M-Instruct from PyPI.
    #[arg(long)]
    model: Option<PathBuf>,
    /// The prompt; `-` reads it from stdin.
    #[arg(long, short = 'p', default_value = "Hello")]
    prompt: String,
    /// Feed the prompt as-is instead of through the chat template.
    #[arg(long)]
    ignore_chat_template: bool,
    /// System message for the chat template.
    #[arg(long)]
    system_prompt: Option<String>,
    /// Maximum number of tokens to generate.
    #[arg(long, short = 'm', default_value_t = 100, allow_negative_numbers = true)]
    max_tokens: usize,
    /// Sampling temperature (0 = greedy).
    #[arg(long, default_value_t = 0.0, allow_negative_numbers = true)]
    temp: f32,
    /// Nucleus sampling mass in (0, 1] (1.0 = off).
    #[arg(long, default_value_t = 1.0, allow_negative_numbers = true)]
    top_p: f32,
    /// Keep only the k most likely tokens (0 = off).
    #[arg(long, default_value_t = 0, allow_negative_numbers = true)]
    top_k: usize,
    /// Minimum probability relative to the top token, in [0, 1] (0 = off).
    #[arg(long, default_value_t = 0.0, allow_negative_numbers = true)]
    min_p: f32,
    /// Random seed (per-step keys derive from it).
    #[arg(long, default_value_t = 0, allow_negative_numbers = true)]
    seed: u64,
    /// Compute dtype: `float32` (fast on CPU), `float16`, `bfloat16`, or `stored` (as in the
    /// weight files, which is what mlx-lm does). Applies to the draft model too.
    #[arg(long, default_value = "float32")]
    dtype: String,
    #[command(flatten)]
    precision: PrecisionArg,
    #[command(flatten)]
    drafting: DraftingArgs,
    /// Print the statistics as JSON on stderr.
    #[arg(long)]
    stats_json: bool,
}

/// One line for the human summary.
fn describe_human(drafter: &serde_json::Value) -> String {
    match drafter["kind"].as_str() {
        Some("suffix") => format!("suffix ({} length)", drafter["policy"].as_str().unwrap_or("?")),
        Some("ngram") => format!(
            "n-gram {}..{} ({} schedule)",
            drafter["ngram_max"],
            drafter["ngram_min"],
            drafter["schedule"].as_str().unwrap_or("?")
        ),
        Some("dspark") => format!("DSpark drafter {}", drafter["path"].as_str().unwrap_or("?")),
        Some("model") if drafter["policy"].is_string() => {
            format!("draft model {} (cost-aware length)", drafter["path"].as_str().unwrap_or("?"))
        }
        _ => format!("draft model {}", drafter["path"].as_str().unwrap_or("?")),
    }
}

/// Rejects sampling values mlx_lm would misbehave on, before anything is fetched or loaded.
fn check_sampling(a: &GenerateArgs) -> Result<()> {
    if !a.temp.is_finite() || a.temp < 0.0 {
        bail!("--temp {}: expected a finite value >= 0 (0 = greedy)", a.temp);
    }
    if !(a.top_p > 0.0 && a.top_p <= 1.0) {
        bail!("--top-p {}: expected a value in (0, 1] (1 = off)", a.top_p);
    }
    if !(0.0..=1.0).contains(&a.min_p) {
        bail!("--min-p {}: expected a value in [0, 1] (0 = off)", a.min_p);
    }
    Ok(())
}

/// The prompt's token ids: through the chat template unless told otherwise.
fn prompt_ids(a: &GenerateArgs, tok: &Tokenizer) -> Result<Vec<u32>> {
    let prompt = if a.prompt == "-" {
        let mut s = String::new();
        std::io::stdin().read_to_string(&mut s).context("reading the prompt from stdin")?;
        s
    } else {
        a.prompt.clone()
    };
    if a.ignore_chat_template {
        return Ok(tok.encode(&prompt, true)?);
    }
    if tok.chat_template().is_none() {
        eprintln!(
            "warning: {} has no chat template (chat_template.jinja, or `chat_template` in tokenizer_config.json): \
             the prompt goes in as plain text (--ignore-chat-template says so and silences this)",
            tok.origin().display()
        );
        if a.system_prompt.is_some() {
            bail!("--system-prompt needs a chat template, and {} has none", tok.origin().display());
        }
        return Ok(tok.encode(&prompt, true)?);
    }
    let mut msgs = Vec::new();
    if let Some(sys) = &a.system_prompt {
        msgs.push(ChatMessage::system(sys.clone()));
    }
    msgs.push(ChatMessage::user(prompt));
    let text = tok.apply_chat_template(&msgs, true)?;
    Ok(tok.encode(&text, false)?)
}

/// Refuses a prompt longer than the model's trained context (`max_position_embeddings`);
/// warns when the generation may run past it.
fn check_context(prompt: usize, max_tokens: usize, context: Option<usize>) -> Result<()> {
    let Some(context) = context else { return Ok(()) };
    if prompt > context {
        bail!(
            "the prompt is {prompt} tokens, longer than the model's context of {context} \
             (max_position_embeddings in config.json)"
        );
    }
    if prompt + max_tokens > context {
        eprintln!(
            "warning: {prompt} prompt tokens + --max-tokens {max_tokens} run past the model's context of {context}; \
             the output after token {} is extrapolation",
            context - prompt
        );
    }
    Ok(())
}

/// A warning when no EOS id can ever be sampled (none, or all past the vocabulary):
/// generation then stops only at `--max-tokens`.
fn eos_warning(eos: &[u32], vocab_size: usize) -> Option<String> {
    let outside: Vec<u32> = eos.iter().copied().filter(|&e| e as usize >= vocab_size).collect();
    if eos.is_empty() {
        Some(
            "warning: the model names no EOS token (eos_token_id in config.json or generation_config.json, \
              eos_token in tokenizer_config.json): generation stops only at --max-tokens"
                .into(),
        )
    } else if outside.len() == eos.len() {
        Some(format!(
            "warning: every EOS id {outside:?} (eos_token_id in config.json / generation_config.json) is outside \
             the vocabulary of {vocab_size}: generation stops only at --max-tokens"
        ))
    } else {
        None
    }
}

/// One warning for a compute dtype that is far slower than float32 on the CPU.
fn warn_slow_dtype(dtype: &str) {
    if mlx_core::backend() == mlx_core::Backend::Cpu && dtype != "float32" {
        eprintln!(
            "warning: --dtype {dtype} on the CPU runs 100x to 1000x slower than float32 (no fast f16/bf16 \
             kernels there: a short prompt can take minutes); drop --dtype to compute in float32"
        );
    }
}

pub(crate) fn generate_cmd(a: GenerateArgs) -> Result<()> {
    let load = load_options(&a.dtype, a.precision.get())?;
    check_sampling(&a)?;
    if a.max_tokens == 0 {
        bail!("--max-tokens 0: nothing to generate (expected at least 1)");
    }
    warn_slow_dtype(&a.dtype);
    let drafting = DrafterSpec::from_args(&a.drafting.to_library())?;
    let dir = target_dir(a.model.as_deref(), "--model")?;
    let model = load_model(&dir, &load).with_context(|| format!("loading {}", dir.display()))?;
    let tok = Tokenizer::from_dir(&dir)?;
    let drafter = drafting.load(DraftTarget { dir: &dir, tokenizer: &tok, load: &load })?;
    if let Some(warning) =
        drafter.as_ref().and_then(|d| draft_cap_warning(d.num_draft_tokens, model.make_cache().rollback_reach()))
    {
        eprintln!("{warning}");
    }
    let ids = prompt_ids(&a, &tok)?;
    check_context(ids.len(), a.max_tokens, model.config.max_position_embeddings)?;
    let sampler = Sampler { temp: a.temp, top_p: a.top_p, top_k: a.top_k, min_p: a.min_p, seed: a.seed };
    let params = GenerateParams { max_tokens: a.max_tokens, sampler, eos: tok.eos_ids().to_vec() };
    if let Some(w) = eos_warning(&params.eos, model.config.vocab_size) {
        eprintln!("{w}");
    }

    // A bar on a terminal for a long prompt, cleared by the prefill's last report.
    let mut bar_progress = crate::progress::prefill_progress(ids.len());
    let mut no_progress = |_: usize, _: usize| {};
    let mut decoder = tok.stream_decoder(true);
    let mut out = std::io::stdout().lock();
    let mut failed: Option<anyhow::Error> = None;
    let mut on_token = |t| {
        let written = decoder.push(t).map_err(anyhow::Error::from).and_then(|text| {
            out.write_all(text.as_bytes())?;
            out.flush()?;
            Ok(())
        });
        match written {
            Ok(()) => true,
            Err(e) => {
                failed = Some(e);
                false
            }
        }
    };
    let report = match &drafter {
        None => {
            let progress: &mut dyn FnMut(usize, usize) = match &mut bar_progress {
                Some(cb) => cb,
                None => &mut no_progress,
            };
            Report::Plain(generate_with_progress(&model, &ids, &params, progress, &mut on_token)?)
        }
        Some(drafter) => {
            let options = SpecOptions { num_draft_tokens: drafter.num_draft_tokens, acceptance: a.drafting.acceptance };
            let mut source = drafter.provider.open(&model, &params.sampler)?;
            // `speculative_generate` with the prefill progress: `run` on a fresh cache.
            let request = Request {
                progress: bar_progress.as_mut().map(|cb| cb as &mut dyn FnMut(usize, usize)),
                ..Request::new(&ids, &params, options, model.make_cache())
            };
            let stats = spec::run(&model, source.as_mut(), request, |e| on_token(e.token))?.stats;
            drop(source);
            Report::Spec {
                drafter: drafting.describe(),
                acceptance: options.acceptance,
                policy: drafter.provider.describe_policy(),
                stats: Box::new(stats),
            }
        }
    };
    let finished = match failed {
        Some(e) => Err(e),
        None => decoder.finish().map_err(anyhow::Error::from).and_then(|tail| Ok(writeln!(out, "{tail}")?)),
    };
    if let Err(e) = finished {
        // The reader went away (`| head`): stop quietly, as command-line tools do.
        if e.downcast_ref::<std::io::Error>().is_some_and(|io| io.kind() == std::io::ErrorKind::BrokenPipe) {
            return Ok(());
        }
        return Err(e);
    }
    report.print(a.stats_json, load.kernels.precision.name())
}

/// The speed ratio to plain decoding the policy's cost curve predicts for `stats`.
fn predicted(policy: &serde_json::Value, stats: &SpecStats) -> Option<f64> {
    let curve: spec::policy::CostCurve = serde_json::from_value(policy["cost_curve"].clone()).ok()?;
    Some((spec::policy::predicted_ratio(&curve, stats) * 1000.0).round() / 1000.0)
}

/// The warning for `n` drafts per round on a target cache of exact-rollback reach `reach`
/// (`None`: unbounded): the executor caps every round at the reach.
fn draft_cap_warning(n: usize, reach: Option<usize>) -> Option<String> {
    let reach = reach.filter(|&r| r < n)?;
    Some(format!(
        "warning: {n} draft tokens per round is more than this target's sliding-window KV cache can roll \
         back exactly ({reach} positions); every round drafts at most {reach}"
    ))
}

/// The statistics of one request, printed after the text.
enum Report {
    Plain(models::GenerationStats),
    Spec {
        drafter: serde_json::Value,
        acceptance: Acceptance,
        policy: Option<serde_json::Value>,
        stats: Box<SpecStats>,
    },
}

impl Report {
    /// Prints the statistics: as mlx_lm does, or with `json` as one JSON object on stderr
    /// (the run's statistics plus `precision`, the quantized matmuls' arithmetic, and for
    /// speculative runs the drafter, acceptance rule and policy).
    fn print(&self, json: bool, precision: &str) -> Result<()> {
        match self {
            Report::Plain(stats) if json => {
                let mut v = serde_json::to_value(stats)?;
                v["precision"] = serde_json::json!(precision);
                eprintln!("{v}");
            }
            Report::Plain(stats) => {
                eprintln!("==========");
                eprintln!("Prompt: {} tokens, {:.3} tokens-per-sec", stats.prompt_tokens, stats.prompt_tps);
                eprintln!("Generation: {} tokens, {:.3} tokens-per-sec", stats.generation_tokens, stats.generation_tps);
                eprintln!("Peak memory: {:.3} GB", stats.peak_memory_bytes as f64 / 1e9);
            }
            Report::Spec { drafter, acceptance, policy, stats } if json => {
                let mut v = serde_json::to_value(stats)?;
                v["precision"] = serde_json::json!(precision);
                v["drafter"] = drafter.clone();
                v["acceptance"] = serde_json::to_value(acceptance)?;
                if let Some(policy) = policy {
                    v["policy"] = policy.clone();
                    if let Some(curve) = predicted(policy, stats) {
                        v["predicted_ratio"] = serde_json::json!(curve);
                    }
                }
                eprintln!("{v}");
            }
            Report::Spec { drafter, stats, policy, .. } => {
                let prompt_tps =
                    if stats.prefill_ms > 0.0 { stats.prompt_tokens as f64 / (stats.prefill_ms / 1e3) } else { 0.0 };
                eprintln!("==========");
                eprintln!("Prompt: {} tokens, {:.3} tokens-per-sec", stats.prompt_tokens, prompt_tps);
                eprintln!("Generation: {} tokens, {:.3} tokens-per-sec", stats.emitted, stats.tokens_per_s);
                let cap = stats.draft_cap.map_or(String::new(), |r| format!(" (capped at {r})"));
                eprintln!(
                    "Speculative: {}, {} draft tokens{cap}: {} rounds, {}/{} drafts accepted ({:.1}%), tau {:.2}",
                    describe_human(drafter),
                    stats.num_draft_tokens,
                    stats.rounds,
                    stats.accepted,
                    stats.drafted,
                    100.0 * stats.acceptance_rate,
                    stats.tau
                );
                if let Some(r) = policy.as_ref().and_then(|p| predicted(p, stats)) {
                    eprintln!("Cost model: {r:.2}x plain predicted from the measured t(T) and these rounds");
                }
                if let Some(k) = stats.fallback_at {
                    eprintln!("Fell back to plain decoding after {k} tokens (the target cache could not roll back)");
                }
                eprintln!("Peak memory: {:.3} GB", stats.peak_memory_bytes as f64 / 1e9);
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::{draft_cap_warning, eos_warning};

    #[test]
    fn the_draft_cap_warning_names_the_reach_only_when_it_caps() {
        assert_eq!(draft_cap_warning(64, None), None);
        assert_eq!(draft_cap_warning(32, Some(32)), None);
        let w = draft_cap_warning(64, Some(32)).unwrap();
        assert!(w.starts_with("warning: 64 draft tokens") && w.contains("(32 positions)"), "{w}");
    }

    #[test]
    fn eos_ids_that_cannot_be_sampled_are_said() {
        assert_eq!(eos_warning(&[2], 32), None);
        assert_eq!(eos_warning(&[2, 999], 32), None, "one reachable EOS is enough");
        let w = eos_warning(&[999], 32).unwrap();
        assert!(w.contains("[999]") && w.contains("vocabulary of 32") && w.contains("eos_token_id"), "{w}");
        assert!(eos_warning(&[], 32).unwrap().contains("no EOS token"));
    }
}
