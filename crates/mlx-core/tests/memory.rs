//! RAII: dropping arrays returns MLX's active memory to its baseline. One test per binary,
//! because active memory is process-wide and tests in one binary run concurrently.
use mlx_core::{Array, Dtype, memory};

#[test]
fn dropping_arrays_returns_active_memory_to_baseline() {
    let warm = Array::ones(&[16], Dtype::Float32).unwrap();
    warm.eval().unwrap();
    drop(warm);
    let baseline = memory::active();
    let mut peak_seen = 0;
    for round in 0..20 {
        let a = Array::ones(&[1024, 1024], Dtype::Float32).unwrap(); // 4 MiB
        let b = a.multiply(&Array::scalar(2.0)).unwrap();
        let c = b.clone(); // shares the buffer
        let d = c.matmul(&a).unwrap().sum(&[], false).unwrap();
        d.eval().unwrap();
        peak_seen = peak_seen.max(memory::active());
        assert!(memory::active() >= baseline + (8 << 20), "round {round}: arrays are live");
        drop((a, b, c, d));
        assert_eq!(memory::active(), baseline, "round {round}: memory not released");
    }
    assert!(peak_seen >= baseline + (8 << 20));
    // A clone keeps the buffer alive after the original is dropped.
    let a = Array::ones(&[256, 1024], Dtype::Float32).unwrap();
    a.eval().unwrap();
    let held = memory::active();
    let c = a.clone();
    drop(a);
    assert_eq!(memory::active(), held);
    assert_eq!(c.sum(&[], false).unwrap().item().unwrap(), 256.0 * 1024.0);
    drop(c);
    assert_eq!(memory::active(), baseline);
    memory::clear_cache();
    assert_eq!(memory::cache(), 0);
}
