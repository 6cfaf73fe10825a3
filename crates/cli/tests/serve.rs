//! `mlx-spec serve` as a process: `--port 0` binds a free port and names it on stderr in the
//! one line tools wait for, `/health` turns 200 once the model is loaded, a completion comes
//! back, bad flags are refused before anything loads, and SIGTERM ends the server.
use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

/// One HTTP/1.1 request with `Connection: close`; returns (status, body).
fn http(addr: &str, method: &str, path: &str, body: &str) -> (u16, String) {
    let mut s = TcpStream::connect(addr).expect("connect");
    s.set_read_timeout(Some(Duration::from_secs(120))).unwrap();
    let req = format!(
        "{method} {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\nContent-Type: application/json\r\n\
         Content-Length: {}\r\n\r\n{body}",
        body.len()
    );
    s.write_all(req.as_bytes()).unwrap();
    let mut out = String::new();
    s.read_to_string(&mut out).unwrap();
    let status = out.split(' ').nth(1).and_then(|c| c.parse().ok()).unwrap_or(0);
    let body = out.split_once("\r\n\r\n").map_or(String::new(), |(_, b)| b.to_string());
    (status, body)
}

#[test]
fn serve_binds_port_zero_and_answers() {
    models::default_model::ensure_default_model(&mut |_| {}).expect("SmolLM2 fixture");
    let mut child = Command::new(env!("CARGO_BIN_EXE_mlx-spec"))
        .args(["serve", "--port", "0", "--served-model-name", "smol"])
        .env_remove("MLX_SPEC_LOG")
        .stderr(Stdio::piped())
        .spawn()
        .expect("run mlx-spec serve");
    let mut lines = BufReader::new(child.stderr.take().unwrap()).lines();
    let addr = loop {
        let line = lines.next().expect("a listening line").unwrap();
        if let Some(url) = line.strip_prefix("mlx-spec serve: listening on http://") {
            break url.to_string();
        }
    };
    assert!(!addr.ends_with(":0"), "{addr}");
    let start = Instant::now();
    while http(&addr, "GET", "/health", "").0 != 200 {
        assert!(start.elapsed() < Duration::from_secs(300), "never ready");
        std::thread::sleep(Duration::from_millis(100));
    }
    let (status, body) =
        http(&addr, "POST", "/v1/completions", r#"{"model": "smol", "prompt": "Once upon a time", "max_tokens": 4}"#);
    assert_eq!(status, 200, "{body}");
    let v: serde_json::Value = serde_json::from_str(&body).unwrap();
    assert_eq!(v["usage"]["completion_tokens"], 4);
    let (status, _) = http(&addr, "POST", "/v1/completions", r#"{"model": "other", "prompt": "x"}"#);
    assert_eq!(status, 400);
    // SIGTERM (Child::kill sends SIGKILL): the server shuts down and exits 0.
    let pid = child.id().to_string();
    Command::new("kill").args(["-TERM", &pid]).status().unwrap();
    let status = child.wait().unwrap();
    assert!(status.success(), "{status:?}");
}

#[test]
fn bad_serve_flags_are_refused_before_loading() {
    let out = Command::new(env!("CARGO_BIN_EXE_mlx-spec"))
        .args(["serve", "--port", "0", "--chat-template-args", "[1]"])
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("--chat-template-args"));
    let out = Command::new(env!("CARGO_BIN_EXE_mlx-spec")).args(["serve", "--draft-kind", "model"]).output().unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("--draft-model"));
    // Each refused naming its flag (before: a warning and a server that started; a missing
    // file taken as the template's text; a syntax error found on every request).
    let cases: [(&[&str], &str); 4] = [
        (&["--log-level", "nonsense=[("], "--log-level"),
        (&["--chat-template", "./missing.jinja"], "no such file, and not a template"),
        (&["--chat-template", "{% for m in messages %}"], "does not compile"),
        (&["--max-queue", "-1"], "'--max-queue <MAX_QUEUE>'"),
    ];
    for (args, expected) in cases {
        let out = Command::new(env!("CARGO_BIN_EXE_mlx-spec")).arg("serve").args(args).output().unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success() && stderr.contains(expected), "{args:?}: {stderr}");
    }
}

#[test]
fn a_model_that_fails_to_load_ends_serve_with_its_message() {
    let dir = tempfile::tempdir().unwrap();
    let fixture = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../fixtures/parity/llama");
    std::fs::copy(fixture.join("config.json"), dir.path().join("config.json")).unwrap();
    let weights = std::fs::read(fixture.join("model.safetensors")).unwrap();
    std::fs::write(dir.path().join("model.safetensors"), &weights[..1000]).unwrap();
    test_support::dspark::write_byte_tokenizer(dir.path()).unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_mlx-spec"))
        .args(["serve", "--port", "0", "--model", dir.path().to_str().unwrap()])
        .env_remove("MLX_SPEC_LOG")
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(stderr.contains("loading the model failed") && stderr.contains("model.safetensors"), "{stderr}");
}
