//! The sampler: greedy, seeded reproducibility, and each filter's kept set.
use mlx_core::Array;
use models::Sampler;

fn logits(v: &[f32]) -> Array {
    Array::from_slice(v, &[1, v.len() as i32]).unwrap()
}

fn kept(s: &Sampler, v: &[f32]) -> Vec<usize> {
    let lp = s.logprobs(&logits(v)).unwrap().to_vec::<f32>().unwrap();
    lp.iter().enumerate().filter(|(_, x)| x.is_finite()).map(|(i, _)| i).collect()
}

#[test]
fn greedy_is_argmax() {
    let s = Sampler::default();
    assert!(s.is_greedy());
    assert_eq!(s.sample(&logits(&[0.1, 3.0, -1.0, 2.9]), 0).unwrap(), 1);
    assert_eq!(s.sample(&logits(&[5.0, 3.0]), 7).unwrap(), 0);
}

#[test]
fn seeded_sampling_is_reproducible_per_step() {
    let s = Sampler { temp: 1.0, seed: 42, ..Sampler::default() };
    let l = logits(&[0.0; 64]);
    let a: Vec<u32> = (0..32).map(|step| s.sample(&l, step).unwrap()).collect();
    let b: Vec<u32> = (0..32).map(|step| s.sample(&l, step).unwrap()).collect();
    assert_eq!(a, b, "same seed and step give the same token");
    let distinct: std::collections::BTreeSet<_> = a.iter().collect();
    assert!(distinct.len() > 10, "steps use different keys: {a:?}");
    let other = Sampler { seed: 43, ..s.clone() };
    let c: Vec<u32> = (0..32).map(|step| other.sample(&l, step).unwrap()).collect();
    assert_ne!(a, c);
}

#[test]
fn filters_keep_the_documented_sets() {
    // probabilities ~ [0.5, 0.25, 0.125, 0.0625, 0.0625]
    let v: Vec<f32> = [0.5f32, 0.25, 0.125, 0.0625, 0.0625].iter().map(|p| p.ln()).collect();
    let base = Sampler { temp: 1.0, ..Sampler::default() };
    assert_eq!(kept(&base, &v), vec![0, 1, 2, 3, 4]);
    assert_eq!(kept(&Sampler { top_k: 2, ..base.clone() }, &v), vec![0, 1]);
    assert_eq!(kept(&Sampler { top_p: 0.7, ..base.clone() }, &v), vec![0, 1]);
    assert_eq!(kept(&Sampler { top_p: 0.8, ..base.clone() }, &v), vec![0, 1, 2]);
    assert_eq!(kept(&Sampler { min_p: 0.2, ..base.clone() }, &v), vec![0, 1, 2]);
    assert_eq!(kept(&Sampler { min_p: 0.6, ..base.clone() }, &v), vec![0]);
    // kept log-probabilities are the temperature-scaled log-softmax
    let lp = Sampler { temp: 0.5, ..base.clone() }.logprobs(&logits(&v)).unwrap().to_vec::<f32>().unwrap();
    let z: f32 = v.iter().map(|x| (x / 0.5).exp()).sum();
    for (got, x) in lp.iter().zip(&v) {
        assert!((got - ((x / 0.5) - z.ln())).abs() < 1e-5);
    }
}

#[test]
fn sampled_tokens_follow_the_distribution_and_respect_filters() {
    let v: Vec<f32> = [0.6f32, 0.3, 0.1].iter().map(|p| p.ln()).collect();
    let s = Sampler { temp: 1.0, seed: 7, ..Sampler::default() };
    let l = logits(&v);
    let mut counts = [0usize; 3];
    for step in 0..1500 {
        counts[s.sample(&l, step).unwrap() as usize] += 1;
    }
    let freq: Vec<f64> = counts.iter().map(|&c| c as f64 / 1500.0).collect();
    for (f, p) in freq.iter().zip([0.6, 0.3, 0.1]) {
        assert!((f - p).abs() < 0.05, "{freq:?}");
    }
    let k1 = Sampler { top_k: 1, ..s };
    assert!((0..200).all(|step| k1.sample(&l, step).unwrap() == 0));
}
