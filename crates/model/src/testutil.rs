//! Test support: the default model, fetched once per machine.

use std::path::PathBuf;

/// Path of the model the tests run: `$FLOTILLA_TEST_MODEL`, else the default
/// model from the cache (downloaded on first use).
pub fn model_path() -> PathBuf {
    if let Some(p) = std::env::var_os("FLOTILLA_TEST_MODEL") {
        return PathBuf::from(p);
    }
    crate::hub::ensure_default_model(false)
        .unwrap_or_else(|e| panic!("the tests need the default model: {e}"))
}

/// A small deterministic generator for test data: uniform in [-1, 1).
pub fn rnd(seed: &mut u64) -> f32 {
    *seed = seed
        .wrapping_mul(6364136223846793005)
        .wrapping_add(1442695040888963407);
    ((*seed >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
}
