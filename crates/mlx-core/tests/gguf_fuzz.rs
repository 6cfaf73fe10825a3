//! Corrupted GGUF files must make `Gguf::load` return an error (or, where the damage is
//! harmless, a result), never crash: MLX's C gguflib, which the loader used before, segfaulted
//! on many of these. A segfault or abort kills this test binary, which fails the test; a
//! panic is caught per file and reported with the mutation that caused it.
//!
//! Every mutation is derived from a fixed seed, so a failure reproduces exactly.
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::path::{Path, PathBuf};

use mlx_core::io::Gguf;

fn fixture(rel: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../fixtures").join(rel)
}

/// SplitMix64: a small deterministic generator.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }

    fn bytes(&mut self, n: usize) -> Vec<u8> {
        (0..n).map(|_| self.next() as u8).collect()
    }
}

/// Loads each `(description, bytes)` from a file and tallies the outcomes; panics (caught)
/// are collected and reported together.
struct Harness {
    dir: tempfile::TempDir,
    ok: usize,
    err: usize,
    panicked: Vec<String>,
}

impl Harness {
    fn new() -> Harness {
        Harness { dir: tempfile::tempdir().unwrap(), ok: 0, err: 0, panicked: Vec::new() }
    }

    fn load(&mut self, what: &str, bytes: &[u8]) {
        let p = self.dir.path().join("fuzz.gguf");
        std::fs::write(&p, bytes).unwrap();
        match catch_unwind(AssertUnwindSafe(|| Gguf::load(&p).map(|g| g.tensors.len()))) {
            Ok(Ok(_)) => self.ok += 1,
            Ok(Err(e)) => {
                let msg = e.to_string();
                assert!(msg.contains("fuzz.gguf"), "{what}: the error does not name the file: {msg}");
                self.err += 1;
            }
            Err(_) => self.panicked.push(what.to_string()),
        }
    }

    fn finish(self, name: &str) -> (usize, usize) {
        eprintln!("{name}: {} loaded, {} refused", self.ok, self.err);
        assert!(self.panicked.is_empty(), "{name}: Gguf::load panicked on: {:#?}", self.panicked);
        (self.ok, self.err)
    }
}

#[test]
fn flipped_header_bytes_never_crash() {
    let orig = std::fs::read(fixture("gguf/tiny.gguf")).unwrap();
    assert!(Gguf::load(fixture("gguf/tiny.gguf")).is_ok());
    let span = orig.len().min(1024);
    let mut rng = Rng(0x6767_7566);
    let mut h = Harness::new();
    for i in 0..500 {
        let mut data = orig.clone();
        let n = 1 + rng.below(4);
        let mut what = format!("variant {i}:");
        for _ in 0..n {
            let at = rng.below(span);
            let v = rng.next() as u8;
            what.push_str(&format!(" [{at}]={v:#04x}"));
            data[at] = v;
        }
        h.load(&what, &data);
    }
    let (_, err) = h.finish("flipped bytes");
    assert!(err > 100, "most header corruptions are detected: only {err} were");
}

#[test]
fn extreme_header_fields_never_crash() {
    // Every 4-byte-aligned position of the header overwritten with values that stress
    // counts, lengths, dimensions, type ids and offsets.
    let orig = std::fs::read(fixture("gguf/tiny.gguf")).unwrap();
    let span = orig.len().min(1024);
    let mut h = Harness::new();
    let values: [&[u8]; 5] = [
        &u64::MAX.to_le_bytes(),
        &(u64::MAX / 2 + 1).to_le_bytes(),
        &u32::MAX.to_le_bytes(),
        &0x8000_0000u32.to_le_bytes(),
        &0u64.to_le_bytes(),
    ];
    for at in (4..span).step_by(4) {
        for (k, v) in values.iter().enumerate() {
            let mut data = orig.clone();
            let end = (at + v.len()).min(data.len());
            data[at..end].copy_from_slice(&v[..end - at]);
            h.load(&format!("value {k} at byte {at}"), &data);
        }
    }
    h.finish("extreme fields");
}

#[test]
fn truncations_never_crash() {
    let orig = std::fs::read(fixture("gguf/tiny.gguf")).unwrap();
    let mut h = Harness::new();
    for cut in (0..orig.len()).step_by(37) {
        h.load(&format!("cut at {cut}"), &orig[..cut]);
    }
    let (ok, _) = h.finish("truncations");
    assert_eq!(ok, 0, "every truncation of tiny.gguf loses part of a tensor");
}

#[test]
fn magic_then_random_bytes_never_crash() {
    let mut rng = Rng(0x4747_5546);
    let mut h = Harness::new();
    for i in 0..200 {
        let len = rng.below(2048);
        // Half of them with a valid version, so parsing goes on into the counts.
        let mut data = b"GGUF".to_vec();
        if i % 2 == 1 {
            data.extend_from_slice(&3u32.to_le_bytes());
        }
        data.extend(rng.bytes(len));
        h.load(&format!("magic + {len} random bytes (seed step {i})"), &data);
    }
    // Small counts, random everything else: exercises the metadata and tensor-info parsers.
    for i in 0..200 {
        let mut data = b"GGUF".to_vec();
        data.extend_from_slice(&3u32.to_le_bytes());
        data.extend_from_slice(&(rng.below(4) as u64).to_le_bytes());
        data.extend_from_slice(&(rng.below(4) as u64).to_le_bytes());
        let len = rng.below(1024);
        data.extend(rng.bytes(len));
        h.load(&format!("small counts + {len} random bytes (step {i})"), &data);
    }
    h.finish("magic + random");
}
