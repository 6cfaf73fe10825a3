//! The server through real HTTP on the default model (SmolLM2-135M-Instruct, fetched once and
//! cached): chat and completions, streaming and not, losslessness across drafters, stop
//! strings across tokens, error bodies, auth, health, metrics, the prompt cache,
//! cancellation, overload and faults.
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use serde_json::{Value, json};
use server::ServeConfig;
use server::metrics::sample;

fn model_dir() -> std::path::PathBuf {
    models::default_model::ensure_default_model(&mut |_| {}).expect("the default model (SmolLM2)")
}

fn config() -> ServeConfig {
    ServeConfig { port: 0, test_faults: true, ..ServeConfig::new(model_dir()) }
}

/// Starts a server on its own runtime thread (it outlives any one test's runtime) and waits
/// until its engine is ready; returns its URL.
fn spawn(config: ServeConfig) -> String {
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
        rt.block_on(async move {
            let server = server::start(config).await.expect("server starts");
            let start = Instant::now();
            while server.engine.health() != server::engine::Health::Ready {
                assert!(start.elapsed() < Duration::from_secs(300), "the engine did not become ready");
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            tx.send(server.url()).unwrap();
            std::future::pending::<()>().await;
        });
    });
    rx.recv().expect("the server thread sends its URL")
}

/// The server most tests share (default drafter, faults enabled).
fn shared() -> &'static str {
    static URL: OnceLock<String> = OnceLock::new();
    URL.get_or_init(|| spawn(config()))
}

fn client() -> reqwest::Client {
    reqwest::Client::new()
}

async fn post(url: &str, path: &str, body: Value) -> (u16, Value) {
    let r = client().post(format!("{url}{path}")).json(&body).send().await.unwrap();
    let status = r.status().as_u16();
    (status, r.json().await.unwrap())
}

/// The `data:` payloads of an SSE body, in order (comments skipped).
async fn sse(url: &str, path: &str, body: Value) -> Vec<String> {
    let mut r = client().post(format!("{url}{path}")).json(&body).send().await.unwrap();
    assert_eq!(r.status(), 200);
    assert_eq!(r.headers()["content-type"], "text/event-stream");
    let mut buf = String::new();
    while let Some(chunk) = r.chunk().await.unwrap() {
        buf.push_str(std::str::from_utf8(&chunk).unwrap());
    }
    buf.split("\n\n")
        .filter_map(|event| {
            let lines: Vec<&str> = event.lines().filter_map(|l| l.strip_prefix("data: ")).collect();
            (!lines.is_empty()).then(|| lines.join("\n"))
        })
        .collect()
}

fn chat_body(content: &str, extra: Value) -> Value {
    let mut body = json!({"model": "smollm2-135m-instruct", "messages": [{"role": "user", "content": content}],
                          "max_tokens": 24});
    for (k, v) in extra.as_object().unwrap() {
        body[k] = v.clone();
    }
    body
}

const REPEAT: &str = "Repeat this list exactly: apples, pears, plums, apples, pears, plums, apples, pears, plums.";

/// The text of a streamed chat or completion, and the chunks.
fn stream_text(events: &[String]) -> (String, Vec<Value>) {
    assert_eq!(events.last().map(String::as_str), Some("[DONE]"));
    let chunks: Vec<Value> = events[..events.len() - 1].iter().map(|e| serde_json::from_str(e).unwrap()).collect();
    let mut text = String::new();
    for c in &chunks {
        for choice in c["choices"].as_array().unwrap() {
            if let Some(t) = choice["delta"]["content"].as_str().or(choice["text"].as_str()) {
                text.push_str(t);
            }
        }
    }
    (text, chunks)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chat_and_completions_stream_and_not() {
    let url = shared();
    let (status, v) = post(url, "/v1/chat/completions", chat_body("Say hello.", json!({}))).await;
    assert_eq!(status, 200, "{v}");
    assert_eq!(v["object"], "chat.completion");
    assert!(v["id"].as_str().unwrap().starts_with("chatcmpl-"));
    assert_eq!(v["choices"][0]["message"]["role"], "assistant");
    let text = v["choices"][0]["message"]["content"].as_str().unwrap().to_string();
    assert!(!text.is_empty());
    let usage = &v["usage"];
    assert!(usage["prompt_tokens"].as_u64().unwrap() > 5);
    assert_eq!(
        usage["total_tokens"].as_u64().unwrap(),
        usage["prompt_tokens"].as_u64().unwrap() + usage["completion_tokens"].as_u64().unwrap()
    );
    assert!(usage["prompt_tokens_details"]["cached_tokens"].is_u64());
    assert_eq!(v["timings"]["predicted_n"], usage["completion_tokens"]);
    for k in ["prompt_n", "cache_n", "predicted_per_second", "draft_n", "draft_n_accepted", "tau"] {
        assert!(!v["timings"][k].is_null(), "timings.{k}");
    }
    let finish = v["choices"][0]["finish_reason"].as_str().unwrap();
    assert!(finish == "stop" || finish == "length");

    // The same request streamed: same text, one id, the role only first, usage last.
    let body = chat_body("Say hello.", json!({"stream": true, "stream_options": {"include_usage": true}}));
    let events = sse(url, "/v1/chat/completions", body).await;
    let (streamed, chunks) = stream_text(&events);
    assert_eq!(streamed, text);
    let id = &chunks[0]["id"];
    assert!(chunks.iter().all(|c| &c["id"] == id && c["object"] == "chat.completion.chunk"));
    assert_eq!(chunks[0]["choices"][0]["delta"]["role"], "assistant");
    assert!(chunks[1..].iter().all(|c| c["choices"].get(0).is_none_or(|ch| ch["delta"].get("role").is_none())));
    let (usage_chunk, rest) = chunks.split_last().unwrap();
    assert_eq!(usage_chunk["choices"], json!([]));
    assert_eq!(usage_chunk["usage"]["completion_tokens"], v["usage"]["completion_tokens"]);
    assert!(rest.iter().all(|c| c["usage"].is_null() && c.get("usage").is_some()));
    assert_eq!(rest.last().unwrap()["choices"][0]["finish_reason"], finish);

    // Completions, both ways.
    let body = json!({"prompt": "The capital of France is", "max_tokens": 12});
    let (status, v) = post(url, "/v1/completions", body.clone()).await;
    assert_eq!(status, 200, "{v}");
    assert_eq!(v["object"], "text_completion");
    let text = v["choices"][0]["text"].as_str().unwrap().to_string();
    let mut streamed_body = body;
    streamed_body["stream"] = json!(true);
    let events = sse(url, "/v1/completions", streamed_body).await;
    let (streamed, chunks) = stream_text(&events);
    assert_eq!(streamed, text);
    assert!(chunks.iter().all(|c| c["object"] == "text_completion" && c.get("usage").is_none()));

    // Models.
    let v: Value = client().get(format!("{url}/v1/models")).send().await.unwrap().json().await.unwrap();
    assert_eq!(v["data"][0]["id"], "smollm2-135m-instruct");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn drafting_is_lossless_through_http() {
    let url = shared();
    let run = |extra: Value| async move {
        let (status, v) =
            post(url, "/v1/chat/completions", chat_body(REPEAT, json!({"max_tokens": 40}).merge(extra))).await;
        assert_eq!(status, 200, "{v}");
        (v["choices"][0]["message"]["content"].as_str().unwrap().to_string(), v["timings"].clone())
    };
    let (plain, t) = run(json!({"num_draft_tokens": 0})).await;
    assert_eq!(t["draft_n"], 0);
    for extra in [json!({}), json!({"draft_kind": "ngram"}), json!({"draft_kind": "suffix", "num_draft_tokens": 4})] {
        let (text, _) = run(extra.clone()).await;
        assert_eq!(text, plain, "{extra}");
    }
    // Seeded sampling: exact acceptance gives the plain tokens for the same seed.
    let sampled = json!({"temperature": 0.9, "top_p": 0.95, "seed": 11});
    let (plain_sampled, _) = run(sampled.clone().merge(json!({"num_draft_tokens": 0}))).await;
    for kind in ["ngram", "suffix"] {
        let (text, _) = run(sampled.clone().merge(json!({"draft_kind": kind}))).await;
        assert_eq!(text, plain_sampled, "sampled, {kind}");
    }
    let (_, t) = run(json!({"draft_kind": "ngram"})).await;
    assert!(t["draft_n"].as_u64().unwrap() > 0, "n-gram drafting drafted nothing on a repetitive prompt: {t}");
    let events = sse(
        url,
        "/v1/chat/completions",
        chat_body(REPEAT, json!({"max_tokens": 40, "stream": true, "draft_kind": "ngram"})),
    )
    .await;
    assert_eq!(stream_text(&events).0, plain);
}

trait Merge {
    fn merge(self, other: Value) -> Value;
}

impl Merge for Value {
    fn merge(mut self, other: Value) -> Value {
        for (k, v) in other.as_object().unwrap() {
            self[k] = v.clone();
        }
        self
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stop_string_across_tokens_ends_the_text_before_it() {
    let url = shared();
    let body = json!({"prompt": "Once upon a time", "max_tokens": 32, "stream": true, "num_draft_tokens": 0});
    let (full, chunks) = stream_text(&sse(url, "/v1/completions", body).await);
    // Each chunk is one token's text here (no stop strings): pick a stop that spans two.
    let pieces: Vec<String> =
        chunks.iter().filter_map(|c| c["choices"].get(0)?["text"].as_str().map(str::to_string)).collect();
    let mut pos = 0;
    let mut stop = None;
    for w in pieces.windows(2) {
        pos += w[0].len();
        let (a, b) = (&w[0], &w[1]);
        if a.chars().count() >= 2 && b.chars().count() >= 2 && pos > 8 {
            let tail: String = a.chars().rev().take(2).collect::<Vec<_>>().into_iter().rev().collect();
            let head: String = b.chars().take(2).collect();
            let s = format!("{tail}{head}");
            if full.find(&s) == Some(pos - tail.len()) {
                stop = Some((s, pos - tail.len()));
                break;
            }
        }
    }
    let (stop, at) = stop.expect("two long enough pieces");
    let want = &full[..at];
    for draft in [json!(0), json!(null)] {
        let body = json!({"prompt": "Once upon a time", "max_tokens": 32, "stop": [stop.clone(), "\u{1}"],
                          "num_draft_tokens": draft});
        let (status, v) = post(url, "/v1/completions", body.clone()).await;
        assert_eq!(status, 200, "{v}");
        assert_eq!(v["choices"][0]["text"], want, "stop {stop:?}");
        assert_eq!(v["choices"][0]["finish_reason"], "stop");
        let (text, _) = stream_text(&sse(url, "/v1/completions", body.merge(json!({"stream": true}))).await);
        assert_eq!(text, want);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn client_mistakes_are_openai_shaped_400s() {
    let url = shared();
    let cases = [
        (json!({"messages": [{"role": "user", "content": "hi"}], "temperature": "hot"}), Some("temperature")),
        (json!({"messages": [{"role": "user", "content": "hi"}], "max_tokens": -2}), Some("max_tokens")),
        (json!({"messages": [{"role": "user", "content": "hi"}], "model": "gpt-9"}), Some("model")),
        (json!({"messages": "hi"}), Some("messages")),
        (json!({"messages": [{"role": "user", "content": "hi"}], "draft_kind": "model"}), Some("draft_kind")),
        (json!({"messages": [{"role": "user", "content": "x ".repeat(9000)}]}), Some("messages")),
    ];
    for (body, param) in cases {
        let (status, v) = post(url, "/v1/chat/completions", body.clone()).await;
        assert_eq!(status, 400, "{body}: {v}");
        assert_eq!(v["error"]["type"], "invalid_request_error");
        assert!(v["error"]["message"].is_string());
        assert_eq!(v["error"]["param"].as_str(), param, "{v}");
        assert!(v["error"].get("code").is_some());
    }
    // Malformed JSON, without a content type.
    let r = client().post(format!("{url}/v1/completions")).body("{\"prompt\": ").send().await.unwrap();
    assert_eq!(r.status(), 400);
    let v: Value = r.json().await.unwrap();
    assert_eq!(v["error"]["param"], Value::Null);
    let (status, v) = post(url, "/v1/completions", json!({"prompt": [1, 2, 99999999]})).await;
    assert_eq!((status, v["error"]["param"].as_str()), (400, Some("prompt")));
    let r = client().get(format!("{url}/nope")).send().await.unwrap();
    assert_eq!(r.status(), 404);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_injected_error_or_panic_fails_one_request_only() {
    let url = shared();
    for fault in ["error", "panic"] {
        let (status, v) =
            post(url, "/v1/completions", json!({"prompt": "Hi", "max_tokens": 2, "x_test_fault": fault})).await;
        assert_eq!(status, 500, "{v}");
        assert_eq!(v["error"]["type"], "server_error");
        let r = client().get(format!("{url}/health")).send().await.unwrap();
        assert_eq!(r.status(), 200);
        let (status, _) = post(url, "/v1/completions", json!({"prompt": "Hi", "max_tokens": 2})).await;
        assert_eq!(status, 200);
    }
    // In a stream: an error event, then [DONE].
    let events = sse(url, "/v1/completions", json!({"prompt": "Hi", "stream": true, "x_test_fault": "error"})).await;
    assert_eq!(events.last().unwrap(), "[DONE]");
    let err: Value = serde_json::from_str(&events[events.len() - 2]).unwrap();
    assert_eq!(err["error"]["type"], "server_error");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn health_and_metrics() {
    let url = shared();
    let r = client().get(format!("{url}/health")).send().await.unwrap();
    assert_eq!(r.status(), 200);
    assert_eq!(r.json::<Value>().await.unwrap(), json!({"status": "ok"}));
    // CORS: a browser's preflight is answered (any origin by default).
    let r = client()
        .request(reqwest::Method::OPTIONS, format!("{url}/v1/chat/completions"))
        .header("Origin", "http://example.test")
        .header("Access-Control-Request-Method", "POST")
        .header("Access-Control-Request-Headers", "content-type, authorization")
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    assert_eq!(r.headers()["access-control-allow-origin"], "*");
    let (status, _) = post(url, "/v1/completions", json!({"prompt": "Hello", "max_tokens": 4})).await;
    assert_eq!(status, 200);
    let text = client().get(format!("{url}/metrics")).send().await.unwrap().text().await.unwrap();
    assert!(sample(&text, "mlx_spec:generation_tokens_total").unwrap() >= 1.0, "{text}");
    assert!(sample(&text, "mlx_spec:prompt_tokens_total").unwrap() >= 1.0);
    assert!(sample(&text, "mlx_spec:time_to_first_token_seconds_count").unwrap() >= 1.0);
    assert!(sample(&text, "mlx_spec:mlx_active_memory_bytes").unwrap() > 0.0);
    for name in [
        "mlx_spec:num_requests_running",
        "mlx_spec:num_requests_waiting",
        "mlx_spec:prefix_cache_queries_total",
        "mlx_spec:spec_decode_num_draft_tokens_total",
        "mlx_spec:spec_decode_num_accepted_tokens_total",
        "mlx_spec:spec_decode_fallbacks_total",
        "mlx_spec:inter_token_latency_seconds_count",
        "mlx_spec:e2e_request_latency_seconds_count",
        "mlx_spec:request_queue_time_seconds_count",
        "mlx_spec:prompt_cache_bytes",
    ] {
        assert!(sample(&text, name).is_some(), "{name} missing:\n{text}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_api_key_guards_everything_but_health() {
    let url = spawn(ServeConfig { api_key: Some("sekrit".into()), ..config() });
    let get = |path: &'static str, key: Option<&'static str>| {
        let url = url.clone();
        async move {
            let mut r = client().get(format!("{url}{path}"));
            if let Some(k) = key {
                r = r.bearer_auth(k);
            }
            r.send().await.unwrap()
        }
    };
    assert_eq!(get("/health", None).await.status(), 200);
    let r = get("/v1/models", None).await;
    assert_eq!(r.status(), 401);
    assert_eq!(r.json::<Value>().await.unwrap()["error"]["type"], "authentication_error");
    assert_eq!(get("/v1/models", Some("wrong")).await.status(), 401);
    assert_eq!(get("/v1/models", Some("sekrit")).await.status(), 200);
    let r = client().post(format!("{url}/v1/completions")).json(&json!({"prompt": "x"})).send().await.unwrap();
    assert_eq!(r.status(), 401);
}

async fn running(url: &str) -> f64 {
    let text = client().get(format!("{url}/metrics")).send().await.unwrap().text().await.unwrap();
    sample(&text, "mlx_spec:num_requests_running").unwrap()
}

async fn until_idle(url: &str, within: Duration) {
    let start = Instant::now();
    while running(url).await != 0.0 {
        assert!(start.elapsed() < within, "requests still running after {within:?}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Sends `body` to `path` over a raw TCP connection and reads `read` bytes of the answer (0:
/// none); the caller drops the socket to go away.
async fn raw_request(url: &str, path: &str, body: &Value, read: usize) -> tokio::net::TcpStream {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let addr = url.strip_prefix("http://").unwrap();
    let mut socket = tokio::net::TcpStream::connect(addr).await.unwrap();
    let body = body.to_string();
    let head = format!(
        "POST {path} HTTP/1.1\r\nHost: {addr}\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n",
        body.len()
    );
    socket.write_all(head.as_bytes()).await.unwrap();
    socket.write_all(body.as_bytes()).await.unwrap();
    let mut got = 0;
    let mut buf = [0u8; 256];
    while got < read {
        let n = socket.read(&mut buf).await.unwrap();
        assert!(n > 0, "the server closed the connection");
        got += n;
    }
    socket
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_goes_away_cancels_its_request() {
    let url = spawn(config());
    let long = chat_body(
        "Write a very long story about a dragon.",
        json!({"max_tokens": 4000, "stream": true,
                                                                          "num_draft_tokens": 0}),
    );
    // Streaming, in decode: read some chunks, then close the connection.
    let socket = raw_request(&url, "/v1/chat/completions", &long, 1000).await;
    assert_eq!(running(&url).await, 1.0);
    drop(socket);
    until_idle(&url, Duration::from_secs(5)).await;
    // Not streaming (the default drafter): close the connection while it generates.
    let mut body = long.clone();
    body["stream"] = json!(false);
    body["num_draft_tokens"] = json!(null);
    let socket = raw_request(&url, "/v1/chat/completions", &body, 0).await;
    let start = Instant::now();
    while running(&url).await == 0.0 {
        assert!(start.elapsed() < Duration::from_secs(30), "the request never started");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    drop(socket);
    until_idle(&url, Duration::from_secs(5)).await;
    // The next request is served at once.
    let start = Instant::now();
    let (status, _) = post(&url, "/v1/completions", json!({"prompt": "Hi", "max_tokens": 2})).await;
    assert_eq!(status, 200);
    assert!(start.elapsed() < Duration::from_secs(10));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_queue_answers_503_with_retry_after() {
    // Admission holds `--max-batch` running requests and `--max-queue` waiting ones.
    for max_batch in [1, 2] {
        let url = spawn(ServeConfig { max_queue: 1, max_batch, ..config() });
        let body = json!({"prompt": "Count to one hundred:", "max_tokens": 40, "num_draft_tokens": 0});
        let send = || {
            let (url, body) = (url.clone(), body.clone());
            tokio::spawn(
                async move { client().post(format!("{url}/v1/completions")).json(&body).send().await.unwrap() },
            )
        };
        let handles: Vec<_> = (0..max_batch + 2).map(|_| send()).collect();
        let mut statuses = Vec::new();
        for h in handles {
            let r = h.await.unwrap();
            let status = r.status().as_u16();
            if status == 503 {
                assert_eq!(r.headers()["retry-after"], "1");
                let v: Value = r.json().await.unwrap();
                assert_eq!(v["error"]["type"], "overloaded_error");
            }
            statuses.push(status);
        }
        statuses.sort_unstable();
        let mut want = vec![200; max_batch + 1];
        want.push(503);
        assert_eq!(statuses, want, "--max-batch {max_batch}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dead_engine_turns_health_503_and_fails_requests() {
    let url = spawn(config());
    let (status, v) = post(&url, "/v1/completions", json!({"prompt": "Hi", "x_test_fault": "kill_engine"})).await;
    assert_eq!(status, 500, "{v}");
    let r = client().get(format!("{url}/health")).send().await.unwrap();
    assert_eq!(r.status(), 503);
    let (status, v) = post(&url, "/v1/completions", json!({"prompt": "Hi", "max_tokens": 2})).await;
    assert_eq!(status, 503, "{v}");
    assert_eq!(v["error"]["type"], "unavailable_error");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_second_turn_reuses_the_first_turns_prefix() {
    let url = spawn(config());
    let first = chat_body(REPEAT, json!({"max_tokens": 24}));
    let (status, v) = post(&url, "/v1/chat/completions", first).await;
    assert_eq!(status, 200, "{v}");
    assert_eq!(v["usage"]["prompt_tokens_details"]["cached_tokens"], 0);
    let reply = v["choices"][0]["message"]["content"].as_str().unwrap().to_string();
    let second = json!({"messages": [
        {"role": "user", "content": REPEAT},
        {"role": "assistant", "content": reply},
        {"role": "user", "content": "Again, please."},
    ], "max_tokens": 24});
    let (status, warm) = post(&url, "/v1/chat/completions", second.clone()).await;
    assert_eq!(status, 200, "{warm}");
    let cached = warm["usage"]["prompt_tokens_details"]["cached_tokens"].as_u64().unwrap();
    assert!(cached > 10, "cached_tokens {cached}: {warm}");
    assert_eq!(warm["timings"]["cache_n"].as_u64(), Some(cached));
    // A cold run of the same conversation (no prompt cache) gives the same text.
    let cold_url = spawn(ServeConfig { prompt_cache_size: 0, ..config() });
    let (status, cold) = post(&cold_url, "/v1/chat/completions", second).await;
    assert_eq!(status, 200, "{cold}");
    assert_eq!(cold["usage"]["prompt_tokens_details"]["cached_tokens"], 0);
    assert_eq!(cold["choices"][0]["message"]["content"], warm["choices"][0]["message"]["content"]);
    let text = client().get(format!("{url}/metrics")).send().await.unwrap().text().await.unwrap();
    assert!(sample(&text, "mlx_spec:prefix_cache_hits_total").unwrap() >= cached as f64);
    assert!(sample(&text, "mlx_spec:prompt_cache_bytes").unwrap() > 0.0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn logprobs_come_per_token() {
    let url = shared();
    let body = chat_body("Say hello.", json!({"max_tokens": 6, "logprobs": true, "top_logprobs": 2}));
    let (status, v) = post(url, "/v1/chat/completions", body).await;
    assert_eq!(status, 200, "{v}");
    let content = v["choices"][0]["logprobs"]["content"].as_array().unwrap();
    assert_eq!(content.len() as u64, v["usage"]["completion_tokens"].as_u64().unwrap());
    for entry in content {
        assert!(entry["logprob"].as_f64().unwrap() <= 0.0);
        let top = entry["top_logprobs"].as_array().unwrap();
        assert_eq!(top.len(), 2);
        // Greedy: the chosen token is the most likely one.
        assert_eq!(top[0]["token"], entry["token"]);
    }
    let (status, v) =
        post(url, "/v1/completions", json!({"prompt": "Once upon a time", "max_tokens": 4, "logprobs": 1})).await;
    assert_eq!(status, 200, "{v}");
    assert_eq!(v["choices"][0]["logprobs"]["tokens"].as_array().unwrap().len(), 4);
}

#[test]
fn a_chat_template_flag_replaces_the_models_template() {
    let template = "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}";
    let tok = server::load_tokenizer(&model_dir(), Some(template)).unwrap();
    let text = tok.apply_chat_template(&[models::tokenizer::ChatMessage::user("hi")], true).unwrap();
    assert_eq!(text, "<user>hi");
    let plain = server::load_tokenizer(&model_dir(), None).unwrap();
    assert_eq!(plain.encode("hello there", false).unwrap(), tok.encode("hello there", false).unwrap());
}

/// Continuous batching: mixed requests (drafters, greedy and seeded sampling, logprobs)
/// sent together get exactly the completion (text and log-probabilities) each gets alone,
/// and the batch metrics count their shared forwards.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_requests_get_what_they_get_alone() {
    let url = spawn(ServeConfig { max_batch: 4, ..config() });
    let bodies = [
        json!({"prompt": "The capital of France is", "max_tokens": 24, "temperature": 0}),
        json!({"prompt": "def fib(n):\n    if n < 2:\n        return n\n    return fib(n - 1) + fib(n - 2)\n\n# fib again\ndef fib(n):", "max_tokens": 32, "temperature": 0, "draft_kind": "ngram", "logprobs": 2}),
        json!({"prompt": "Once upon a time", "max_tokens": 20, "temperature": 0.8, "seed": 7, "draft_kind": "suffix"}),
        json!({"prompt": "List three colors:", "max_tokens": 16, "temperature": 0, "num_draft_tokens": 0}),
    ];
    let completion = |v: &Value| (v["choices"][0]["text"].clone(), v["choices"][0]["logprobs"].clone());
    let mut alone = Vec::new();
    for b in &bodies {
        let (status, v) = post(&url, "/v1/completions", b.clone()).await;
        assert_eq!(status, 200, "{v}");
        alone.push(completion(&v));
    }
    let handles: Vec<_> = bodies
        .iter()
        .map(|b| {
            let (url, b) = (url.clone(), b.clone());
            tokio::spawn(async move { post(&url, "/v1/completions", b).await })
        })
        .collect();
    for (i, h) in handles.into_iter().enumerate() {
        let (status, v) = h.await.unwrap();
        assert_eq!(status, 200, "{v}");
        assert_eq!(completion(&v), alone[i], "request {i} differs when batched");
    }
    let text = client().get(format!("{url}/metrics")).send().await.unwrap().text().await.unwrap();
    let forwards = sample(&text, "mlx_spec:batch_rows_count").unwrap();
    let rows = sample(&text, "mlx_spec:batch_rows_sum").unwrap();
    assert!(forwards > 0.0 && rows > forwards, "batch rows {rows} over {forwards} forwards");
    assert!(sample(&text, "mlx_spec:batch_size").is_some());
}
