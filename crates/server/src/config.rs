//! The server's settings: what `mlx-spec serve`'s flags resolve to (the command line lives in
//! the `mlx-spec` crate, which shares its model and drafting flags with `generate`).
use std::path::PathBuf;
use std::time::Duration;

use models::LoadOptions;
use spec::providers::DrafterArgs;

/// The default `--max-tokens` (mlx_lm.server's).
pub const DEFAULT_MAX_TOKENS: usize = 512;
/// The default `--prompt-cache-size` (entries; mlx_lm.server's).
pub const DEFAULT_PROMPT_CACHE_SIZE: usize = 10;
/// The default `--max-queue`: requests waiting while the batch is full.
pub const DEFAULT_MAX_QUEUE: usize = 64;
/// The largest request body accepted, bytes (long prompts).
pub const BODY_LIMIT: usize = 64 << 20;
/// How often an idle SSE stream gets a `:` comment (keep-alive). Short, because a write is
/// how the server learns that a streaming client went away during a long prefill (nothing
/// else is written then): the cancel then reaches the engine before its next prefill chunk.
pub const KEEP_ALIVE: Duration = Duration::from_millis(500);

/// Everything `mlx-spec serve` needs, resolved (the model directory exists).
#[derive(Debug, Clone)]
pub struct ServeConfig {
    /// Address to bind (`--host`, default 127.0.0.1).
    pub host: String,
    /// Port to bind (`--port`, default 8080; 0 = any free port).
    pub port: u16,
    /// The target's model directory.
    pub model_dir: PathBuf,
    /// How the target (and drafter weights) load (`--dtype`; float32 by default, as for
    /// `generate`: the fast choice on the CPU backend).
    pub load: LoadOptions,
    /// The server's drafter, as `generate`'s flags give it.
    pub drafting: DrafterArgs,
    /// `max_tokens` of requests that give none (`--max-tokens`).
    pub max_tokens: usize,
    /// A chat template replacing the tokenizer's (`--chat-template`: the template text).
    pub chat_template: Option<String>,
    /// Extra chat template variables for every request (`--chat-template-args`, a JSON
    /// object); a request's `chat_template_kwargs` win.
    pub chat_template_args: serde_json::Map<String, serde_json::Value>,
    /// Prompt-cache entries (`--prompt-cache-size`; 0 = no prompt cache).
    pub prompt_cache_size: usize,
    /// Prompt-cache byte budget (`--prompt-cache-bytes`); `None`: [`default_cache_bytes`].
    pub prompt_cache_bytes: Option<usize>,
    /// CORS origins (`--allowed-origins`, `*` = any).
    pub allowed_origins: Vec<String>,
    /// The model's name in requests and responses (`--served-model-name`; default: the
    /// model directory's name).
    pub served_model_name: Option<String>,
    /// The Bearer key every request but `/health` must carry (`--api-key`).
    pub api_key: Option<String>,
    /// Requests that may wait while `max_batch` run (`--max-queue`); more get 503.
    pub max_queue: usize,
    /// Requests decoding together (`--max-batch`, continuous batching; 1: one at a time).
    /// Default [`default_max_batch`].
    pub max_batch: usize,
    /// Accept the `x_test_fault` request field (hidden `--test-faults`).
    pub test_faults: bool,
}

impl ServeConfig {
    /// Defaults for `model_dir` (what the flags give when only `--model` is set).
    pub fn new(model_dir: PathBuf) -> Self {
        ServeConfig {
            host: "127.0.0.1".into(),
            port: 8080,
            model_dir,
            load: LoadOptions { dtype: Some(mlx_core::Dtype::Float32), ..LoadOptions::default() },
            drafting: DrafterArgs::default(),
            max_tokens: DEFAULT_MAX_TOKENS,
            chat_template: None,
            chat_template_args: serde_json::Map::new(),
            prompt_cache_size: DEFAULT_PROMPT_CACHE_SIZE,
            prompt_cache_bytes: None,
            allowed_origins: vec!["*".into()],
            served_model_name: None,
            api_key: None,
            max_queue: DEFAULT_MAX_QUEUE,
            max_batch: default_max_batch(),
            test_faults: false,
        }
    }

    /// The served model name: `served_model_name`, or the model directory's last component.
    pub fn model_name(&self) -> String {
        self.served_model_name.clone().unwrap_or_else(|| {
            self.model_dir.file_name().map_or_else(|| "default".into(), |n| n.to_string_lossy().into_owned())
        })
    }

    /// The prompt cache's byte budget.
    pub fn cache_bytes(&self) -> usize {
        self.prompt_cache_bytes.unwrap_or_else(default_cache_bytes)
    }
}

/// The default `--max-batch`: 4 requests per core, between 4 and 32 (8 on two cores). On the
/// CPU a one-token step reads every weight for one row; the rows of 8 requests cost a few
/// times one row (`cargo xtask bench serve`).
pub fn default_max_batch() -> usize {
    let cores = std::thread::available_parallelism().map_or(2, |n| n.get());
    (4 * cores).clamp(4, 32)
}

/// The default prompt-cache byte budget: a quarter of the machine's memory (`/proc/meminfo`),
/// or 2 GiB where that cannot be read.
pub fn default_cache_bytes() -> usize {
    let total = std::fs::read_to_string("/proc/meminfo").ok().and_then(|s| {
        let line = s.lines().find(|l| l.starts_with("MemTotal:"))?;
        let kib: usize = line.split_whitespace().nth(1)?.parse().ok()?;
        Some(kib * 1024)
    });
    total.map_or(2 << 30, |t| t / 4)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_and_budgets() {
        let c = ServeConfig::new("/models/SmolLM2-135M".into());
        assert_eq!(c.model_name(), "SmolLM2-135M");
        assert!(c.cache_bytes() > 0);
        let c = ServeConfig { served_model_name: Some("m".into()), prompt_cache_bytes: Some(5), ..c };
        assert_eq!((c.model_name().as_str(), c.cache_bytes()), ("m", 5));
    }
}
