//! No command writes into or replaces one of its inputs, with `--force` or not: a
//! destination that is, holds or lies inside the source is refused naming both, and the
//! source is left byte for byte (found by a careless-user sweep: `import-gguf P/model.gguf P
//! --force` deleted the GGUF when `P` held a `config.json`; `quantize` and
//! `quantize-drafter` wrote into `SRC/q4`). Also the import flags that did nothing.
use std::path::{Path, PathBuf};
use std::process::Command;

fn fixture(rel: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../fixtures").join(rel)
}

fn mlx_spec(args: &[&str]) -> (Option<i32>, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_mlx-spec")).args(args).env("RUST_BACKTRACE", "0").output().unwrap();
    (out.status.code(), String::from_utf8_lossy(&out.stderr).into_owned())
}

/// Every file under `dir` with its bytes, sorted.
fn snapshot(dir: &Path) -> Vec<(PathBuf, Vec<u8>)> {
    let mut out = Vec::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        for e in std::fs::read_dir(&d).unwrap() {
            let p = e.unwrap().path();
            if p.is_dir() {
                stack.push(p);
            } else {
                out.push((p.clone(), std::fs::read(&p).unwrap()));
            }
        }
    }
    out.sort();
    out
}

fn s(p: &Path) -> &str {
    p.to_str().unwrap()
}

#[test]
fn import_gguf_never_replaces_the_directory_holding_its_gguf() {
    let tmp = tempfile::tempdir().unwrap();
    let p = tmp.path().join("P");
    std::fs::create_dir(&p).unwrap();
    std::fs::copy(fixture("gguf_import/tiny_llama.gguf"), p.join("model.gguf")).unwrap();
    std::fs::write(p.join("config.json"), "{}").unwrap();
    let before = snapshot(&p);
    for force in [&[][..], &["--force"][..]] {
        // (`P/sub` is fine: beside the GGUF, not over it.)
        for dst in [p.clone(), tmp.path().to_path_buf()] {
            let mut args = vec!["import-gguf", s(&p.join("model.gguf")).to_string().leak(), s(&dst)];
            args.extend_from_slice(force);
            let (code, stderr) = mlx_spec(&args);
            assert_eq!(code, Some(1), "{args:?}: {stderr}");
            assert!(stderr.contains("the source") && stderr.contains("model.gguf"), "{args:?}: {stderr}");
        }
    }
    assert_eq!(snapshot(&p), before, "the source directory is untouched");
}

#[test]
fn quantize_and_quantize_drafter_never_write_into_their_source() {
    let tmp = tempfile::tempdir().unwrap();
    let model = tmp.path().join("model");
    let (code, stderr) = mlx_spec(&["import-gguf", s(&fixture("gguf_import/tiny_llama.gguf")), s(&model)]);
    assert_eq!(code, Some(0), "{stderr}");
    let drafter = tmp.path().join("drafter");
    std::fs::create_dir(&drafter).unwrap();
    for f in ["config.json", "model.safetensors"] {
        std::fs::copy(fixture("deepspec/qwen3").join(f), drafter.join(f)).unwrap();
    }
    let (model_before, drafter_before) = (snapshot(&model), snapshot(&drafter));
    for force in [&[][..], &["--force"][..]] {
        for (dst, why) in [(model.join("q4"), "lies inside the source"), (model.clone(), "is the source")] {
            let mut args = vec!["quantize", "--hf-path", s(&model), "--mlx-path", s(&dst).to_string().leak()];
            args.extend_from_slice(force);
            let (code, stderr) = mlx_spec(&args);
            assert!(code == Some(1) && stderr.contains(why), "{args:?}: {stderr}");
        }
        for (dst, why) in [(drafter.join("q4"), "lies inside the source"), (drafter.clone(), "is the source")] {
            let mut args = vec!["quantize-drafter", "--src", s(&drafter), "--out", s(&dst).to_string().leak()];
            args.extend_from_slice(force);
            let (code, stderr) = mlx_spec(&args);
            assert!(code == Some(1) && stderr.contains(why), "{args:?}: {stderr}");
        }
    }
    // A drafter given to `quantize` is pointed to `quantize-drafter` (it would quantize the
    // confidence head too).
    let out = tmp.path().join("q");
    let (code, stderr) = mlx_spec(&["quantize", "--hf-path", s(&drafter), "--mlx-path", s(&out)]);
    assert!(code == Some(1) && stderr.contains("quantize-drafter"), "{stderr}");
    assert!(!out.exists());
    assert_eq!(snapshot(&model), model_before);
    assert_eq!(snapshot(&drafter), drafter_before);
}

#[test]
fn import_flags_that_would_do_nothing_are_refused() {
    let gguf = fixture("gguf_import/tiny_llama.gguf");
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("out");
    let cases: [(&[&str], &str); 3] = [
        (&["--q-bits", "8"], "--quantize"),
        (&["--q-group-size", "32"], "--quantize"),
        (&["-q", "--keep-quantized"], "cannot be used with"),
    ];
    for (flags, expected) in cases {
        let mut args = vec!["import-gguf", s(&gguf), s(&out)];
        args.extend_from_slice(flags);
        let (code, stderr) = mlx_spec(&args);
        assert!(code == Some(2) && stderr.contains(expected), "{flags:?}: {stderr}");
        assert!(!out.exists());
    }
}
