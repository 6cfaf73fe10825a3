//! Kernel choices are values carried by a loaded model, not process-wide switches: two models
//! loaded in one process with different [`KernelPolicy`]s each run on their own kernels, at
//! the same time, on two threads, with no lock. Each policy's counters show which kernels
//! its model's graphs used; the logits of both agree to rounding.
use std::path::PathBuf;

use mlx_core::settings::KernelCalls;
use mlx_core::{Dtype, KernelPolicy};
use models::generate::ids;
use models::{LoadOptions, load_model};

fn case_dir(name: &str) -> PathBuf {
    std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../fixtures/parity").join(name)
}

const TOKENS: [u32; 9] = [3, 17, 42, 5, 99, 23, 7, 64, 12];

/// Loads fixture `name` with `kernels` on this thread, runs a 5-token prompt and a 4-token
/// window, and returns the window's logits and the policy's counts.
fn run(name: &str, kernels: KernelPolicy) -> (Vec<f32>, KernelCalls) {
    let options = LoadOptions { dtype: Some(Dtype::Float32), kernels };
    let model = load_model(&case_dir(name), &options).unwrap();
    let mut cache = model.make_cache();
    model.forward(&ids(&TOKENS[..5]).unwrap(), &mut cache).unwrap().eval().unwrap();
    let logits = model.forward(&ids(&TOKENS[5..]).unwrap(), &mut cache).unwrap().to_vec::<f32>().unwrap();
    (logits, options.kernels.calls())
}

/// Two copies of `name`, one on mlx-spec's CPU kernels and one on MLX's own ops, on two
/// threads at once.
fn side_by_side(name: &str) -> ((Vec<f32>, KernelCalls), (Vec<f32>, KernelCalls)) {
    let name_a = name.to_string();
    let ours = std::thread::spawn(move || run(&name_a, KernelPolicy::all_on()));
    let name_b = name.to_string();
    let mlx = std::thread::spawn(move || run(&name_b, KernelPolicy::mlx()));
    (ours.join().unwrap(), mlx.join().unwrap())
}

fn max_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter().zip(b).map(|(x, y)| (x - y).abs()).fold(0.0, f32::max)
}

#[test]
fn two_quantized_models_with_different_policies_use_their_own_kernels() {
    let ((ours, on), (mlx, off)) = side_by_side("llama_q4");
    if mlx_core::backend() == mlx_core::Backend::Cpu {
        assert!(on.qmm > 0, "the 4-bit model on mlx-spec's kernels used the quantized kernel: {on:?}");
        assert!(on.sdpa > 0, "... and the fused attention: {on:?}");
        assert!(on.fast > 0, "... and the one-node RMS norm / RoPE: {on:?}");
    }
    assert_eq!(off, KernelCalls::default(), "the model on MLX's ops used none of mlx-spec's kernels");
    let d = max_diff(&ours, &mlx);
    assert!(d <= 1e-4, "the two models' logits differ by {d}");
}

#[test]
fn two_dense_models_with_different_policies_use_their_own_kernels() {
    let ((ours, on), (mlx, off)) = side_by_side("llama");
    if mlx_core::backend() == mlx_core::Backend::Cpu {
        assert!(on.dense > 0 && on.sdpa > 0 && on.fast > 0, "{on:?}");
        assert_eq!(on.qmm, 0, "a dense model has no quantized products: {on:?}");
    }
    assert_eq!(off, KernelCalls::default());
    let d = max_diff(&ours, &mlx);
    assert!(d <= 1e-4, "the two models' logits differ by {d}");
}

/// A model keeps the policy it was loaded with: a second policy built later (another
/// model's) neither changes its kernels nor shares its counters.
#[test]
fn a_policy_is_per_model() {
    let on = KernelPolicy::all_on();
    let options = LoadOptions { dtype: Some(Dtype::Float32), kernels: on.clone() };
    let model = load_model(&case_dir("llama_q4"), &options).unwrap();
    let other = KernelPolicy { qmm: false, ..KernelPolicy::mlx() };
    let _other_model =
        load_model(&case_dir("llama_q4"), &LoadOptions { dtype: Some(Dtype::Float32), kernels: other.clone() })
            .unwrap();
    model.forward(&ids(&TOKENS[..3]).unwrap(), &mut model.make_cache()).unwrap().eval().unwrap();
    assert_eq!(other.calls(), KernelCalls::default());
    if mlx_core::backend() == mlx_core::Backend::Cpu {
        assert!(on.calls().qmm > 0, "the clone given to the loader shares the caller's counters");
    }
}
