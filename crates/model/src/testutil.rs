//! Test support: deterministic test data.

/// A small deterministic generator for test data: uniform in [-1, 1).
pub fn rnd(seed: &mut u64) -> f32 {
    *seed = seed
        .wrapping_mul(6364136223846793005)
        .wrapping_add(1442695040888963407);
    ((*seed >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
}
