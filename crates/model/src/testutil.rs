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
