//! `mlx-spec serve`: an OpenAI-compatible HTTP server over lossless speculative decoding.
//!
//! - [`config`]: [`ServeConfig`], what the command line resolves to.
//! - [`openai`]: request and response bodies, validation (every client mistake a 400 naming
//!   the field).
//! - [`error`]: [`ApiError`], OpenAI-shaped error bodies.
//! - [`stop`]: stop strings over streamed text (held back while they could still match).
//! - [`engine`]: the engine thread that owns every MLX object, its bounded queue,
//!   per-request event channels, cancellation and health.
//! - [`backend`]: the MLX side of the engine (target, drafters, prompt cache).
//! - [`prompt_cache`]: the LRU prefix cache with an entry count and a byte budget.
//! - [`metrics`]: Prometheus metrics (`mlx_spec:` prefix, vLLM's shapes).
//! - [`routes`]: the endpoints, SSE, auth, CORS.
//!
//! [`start`] binds and serves in the current tokio runtime and returns a [`Server`];
//! [`run`] is the blocking entry point of the command line.
pub mod backend;
pub mod config;
pub mod engine;
pub mod error;
pub mod metrics;
pub mod openai;
pub mod prompt_cache;
pub mod routes;
pub mod stop;

use std::net::SocketAddr;
use std::path::Path;
use std::sync::Arc;

use anyhow::Context;
use models::tokenizer::Tokenizer;
use spec::providers::DrafterSpec;
use tokio::sync::oneshot;

pub use config::ServeConfig;
pub use error::ApiError;

use crate::backend::{LoadSpec, SpecBackend, offered_kinds};
use crate::engine::{EngineHandle, Health};
use crate::metrics::Metrics;
use crate::openai::Limits;
use crate::routes::AppState;

/// A running server.
#[derive(Debug)]
pub struct Server {
    /// The bound address (the real port when started with port 0).
    pub addr: SocketAddr,
    /// The engine (health, metrics).
    pub engine: EngineHandle,
    shutdown: Option<oneshot::Sender<()>>,
    task: tokio::task::JoinHandle<std::io::Result<()>>,
}

impl Server {
    /// `http://HOST:PORT`.
    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// Stops accepting connections, waits for the open ones to finish, then for the engine
    /// thread to drop the model (up to 30 s; [`EngineHandle::finish`]).
    ///
    /// # Errors
    /// The server task failed.
    pub async fn shutdown(mut self) -> anyhow::Result<()> {
        if let Some(tx) = self.shutdown.take() {
            let _ = tx.send(());
        }
        (&mut self.task).await.context("the server task")?.context("serving")?;
        let engine = self.engine;
        if !tokio::task::spawn_blocking(move || engine.finish(std::time::Duration::from_secs(30)))
            .await
            .unwrap_or(false)
        {
            tracing::warn!("the engine thread did not end within 30 s of the shutdown");
        }
        Ok(())
    }
}

/// Loads the tokenizer of `dir`, with `template` (the template text) as its chat template
/// when given (`--chat-template`).
///
/// # Errors
/// The tokenizer does not load; `template` does not compile (refused here, at start, rather
/// than on every request).
pub fn load_tokenizer(dir: &Path, template: Option<&str>) -> anyhow::Result<Tokenizer> {
    let tok = Tokenizer::from_dir(dir).with_context(|| format!("loading the tokenizer of {}", dir.display()))?;
    let Some(t) = template else { return Ok(tok) };
    let tok = tok.with_chat_template(t.to_string(), "--chat-template");
    if let Some(e) = tok.chat_template_error() {
        anyhow::bail!("--chat-template: the template does not compile: {e}");
    }
    Ok(tok)
}

/// Starts the server in the current tokio runtime: loads the tokenizer, starts the engine
/// thread (which loads the model; requests queue meanwhile and `/health` answers 503),
/// binds `host:port` and serves.
///
/// # Errors
/// Invalid drafting options, a tokenizer that does not load, an address that cannot be
/// bound.
pub async fn start(config: ServeConfig) -> anyhow::Result<Server> {
    let drafting = DrafterSpec::from_args(&config.drafting)?;
    let (dir, template) = (config.model_dir.clone(), config.chat_template.clone());
    let tokenizer = Arc::new(
        tokio::task::spawn_blocking(move || load_tokenizer(&dir, template.as_deref())).await.context("tokenizer")??,
    );
    let context = models::ModelConfig::from_dir(&config.model_dir).ok().and_then(|c| c.max_position_embeddings);
    let metrics = Arc::new(Metrics::new());
    let load = LoadSpec {
        model_dir: config.model_dir.clone(),
        load: config.load.clone(),
        drafting: config.drafting.clone(),
        prompt_cache_size: config.prompt_cache_size,
        prompt_cache_bytes: config.cache_bytes(),
        max_batch: config.max_batch,
    };
    let tok = tokenizer.clone();
    let engine =
        EngineHandle::start(move || SpecBackend::load(&load, &tok), config.max_queue, config.max_batch, metrics)
            .context("starting the engine thread")?;
    let listener = tokio::net::TcpListener::bind((config.host.as_str(), config.port))
        .await
        .with_context(|| format!("binding {}:{}", config.host, config.port))?;
    let addr = listener.local_addr()?;
    let state = Arc::new(AppState {
        engine: engine.clone(),
        tokenizer,
        limits: Limits {
            served_model_name: config.model_name(),
            default_max_tokens: config.max_tokens,
            test_faults: config.test_faults,
        },
        template_args: config.chat_template_args.clone(),
        api_key: config.api_key.clone(),
        context,
        kinds: offered_kinds(&drafting),
        allowed_origins: config.allowed_origins.clone(),
        created: std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_secs()),
    });
    let (tx, rx) = oneshot::channel();
    let app = routes::router(state);
    let task = tokio::spawn(async move {
        axum::serve(listener, app)
            .with_graceful_shutdown(async {
                let _ = rx.await;
            })
            .await
    });
    Ok(Server { addr, engine, shutdown: Some(tx), task })
}

/// The command line's entry point: starts the server, prints
/// `mlx-spec serve: listening on http://HOST:PORT` on stderr once the socket is bound, and
/// serves until SIGINT or SIGTERM, or until the model fails to load (then it returns the
/// engine's message as the error).
///
/// # Errors
/// As [`start`]; the model's load failure (with the engine's message).
pub fn run(config: ServeConfig) -> anyhow::Result<()> {
    let runtime = tokio::runtime::Builder::new_multi_thread().enable_all().build().context("the tokio runtime")?;
    runtime.block_on(async move {
        let server = start(config).await?;
        eprintln!("mlx-spec serve: listening on {}", server.url());
        // A model that fails to load ends the command (as mlx_lm.server and vLLM do); an
        // engine that dies later keeps answering /health with why.
        let failed = tokio::select! {
            () = shutdown_signal() => None,
            why = load_failure(&server.engine) => Some(why),
        };
        eprintln!("mlx-spec serve: shutting down");
        server.shutdown().await?;
        match failed {
            Some(why) => Err(anyhow::anyhow!("{why}")),
            None => Ok(()),
        }
    })
}

/// Resolves with the engine's message when the model fails to load; pends forever once it
/// is ready.
async fn load_failure(engine: &EngineHandle) -> String {
    loop {
        match engine.health() {
            Health::Loading => tokio::time::sleep(std::time::Duration::from_millis(50)).await,
            Health::Ready => std::future::pending::<()>().await,
            Health::Dead(why) => return why,
        }
    }
}

async fn shutdown_signal() {
    let ctrl_c = async {
        let _ = tokio::signal::ctrl_c().await;
    };
    #[cfg(unix)]
    let term = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(_) => std::future::pending().await,
        }
    };
    #[cfg(not(unix))]
    let term = std::future::pending::<()>();
    tokio::select! {
        () = ctrl_c => {},
        () = term => {},
    }
}
