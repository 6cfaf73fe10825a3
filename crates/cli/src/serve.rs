//! `mlx-spec serve`: the OpenAI-compatible server of the `server` crate, with `generate`'s
//! model and drafting flags and mlx_lm.server's names for the rest.
use std::path::PathBuf;

use anyhow::{Context, Result, bail};
use clap::Args;
use server::ServeConfig;

use crate::drafting::{DraftingArgs, target_dir};
use crate::{PrecisionArg, load_options};

#[derive(Args)]
pub(crate) struct ServeArgs {
    /// Model directory (mlx-lm layout). Default: SmolLM2-135M-Instruct from PyPI.
    #[arg(long)]
    model: Option<PathBuf>,
    /// Address to bind.
    #[arg(long, default_value = "127.0.0.1")]
    host: String,
    /// Port to bind (0: any free port; the listening line names it).
    #[arg(long, default_value_t = 8080, allow_negative_numbers = true)]
    port: u16,
    /// Compute dtype: `float32`, `float16`, `bfloat16` or `stored`, as for `generate`.
    #[arg(long, default_value = "float32")]
    dtype: String,
    #[command(flatten)]
    precision: PrecisionArg,
    #[command(flatten)]
    drafting: DraftingArgs,
    /// `max_tokens` of requests that give none.
    #[arg(long, short = 'm', default_value_t = server::config::DEFAULT_MAX_TOKENS, allow_negative_numbers = true)]
    max_tokens: usize,
    /// A chat template replacing the model's: the template text, or a file holding it.
    #[arg(long)]
    chat_template: Option<String>,
    /// Extra chat template variables for every request, a JSON object (for example
    /// '{"enable_thinking": false}'); a request's `chat_template_kwargs` win.
    #[arg(long, default_value = "{}")]
    chat_template_args: String,
    /// Prompt-cache entries (0: no prompt cache).
    #[arg(long, default_value_t = server::config::DEFAULT_PROMPT_CACHE_SIZE, allow_negative_numbers = true)]
    prompt_cache_size: usize,
    /// Prompt-cache byte budget [default: a quarter of the machine's memory].
    #[arg(long, allow_negative_numbers = true)]
    prompt_cache_bytes: Option<usize>,
    /// CORS origins, comma-separated (`*`: any).
    #[arg(long, value_delimiter = ',', default_value = "*")]
    allowed_origins: Vec<String>,
    /// Log filter (`error`, `warn`, `info`, `debug`, `trace`, or a tracing filter such as
    /// `server=debug`) [default: MLX_SPEC_LOG's].
    #[arg(long)]
    pub(crate) log_level: Option<String>,
    /// The model's name in requests and responses [default: the model directory's name].
    #[arg(long)]
    served_model_name: Option<String>,
    /// Require `Authorization: Bearer KEY` on every route but /health.
    #[arg(long)]
    api_key: Option<String>,
    /// Requests that may wait while the batch is full; more are answered 503 with Retry-After.
    #[arg(long, default_value_t = server::config::DEFAULT_MAX_QUEUE, allow_negative_numbers = true)]
    max_queue: usize,
    /// Requests decoding together (continuous batching: one target forward per round over
    /// every request's verify window; each request's output is the one it gets alone); 1
    /// runs one request at a time [default: 4 per core, 4 to 32].
    #[arg(long, allow_negative_numbers = true)]
    max_batch: Option<usize>,
    /// Accept the `x_test_fault` request field (tests only).
    #[arg(long, hide = true)]
    test_faults: bool,
}

pub(crate) fn serve_cmd(a: ServeArgs) -> Result<()> {
    let load = load_options(&a.dtype, a.precision.get())?;
    let drafting = a.drafting.to_library();
    // Refuse bad drafting flags before a model is fetched.
    spec::providers::DrafterSpec::from_args(&drafting)?;
    let chat_template_args = match serde_json::from_str::<serde_json::Value>(&a.chat_template_args) {
        Ok(serde_json::Value::Object(map)) => map,
        _ => bail!("--chat-template-args {}: expected a JSON object", a.chat_template_args),
    };
    let chat_template = a.chat_template.as_deref().map(chat_template).transpose()?;
    if a.max_batch == Some(0) {
        bail!("--max-batch 0: expected at least 1 (1 runs one request at a time)");
    }
    let model_dir = target_dir(a.model.as_deref(), "--model")?;
    let config = ServeConfig {
        host: a.host,
        port: a.port,
        load,
        drafting,
        max_tokens: a.max_tokens,
        chat_template,
        chat_template_args,
        prompt_cache_size: a.prompt_cache_size,
        prompt_cache_bytes: a.prompt_cache_bytes,
        allowed_origins: a.allowed_origins,
        served_model_name: a.served_model_name,
        api_key: a.api_key,
        max_queue: a.max_queue,
        max_batch: a.max_batch.unwrap_or_else(server::config::default_max_batch),
        test_faults: a.test_faults,
        ..ServeConfig::new(model_dir)
    };
    server::run(config)
}

/// `--chat-template`: a file holding the template, or the template text (mlx_lm.server's
/// form); refused when it is neither (a file that does not exist). Whether it compiles is
/// checked where the server loads the tokenizer ([`server::load_tokenizer`]).
fn chat_template(value: &str) -> Result<String> {
    if std::path::Path::new(value).is_file() {
        std::fs::read_to_string(value).with_context(|| format!("reading --chat-template {value}"))
    } else if value.contains("{{") || value.contains("{%") {
        Ok(value.to_string())
    } else {
        bail!("--chat-template {value:?}: no such file, and not a template either (no `{{{{` or `{{%`)");
    }
}
