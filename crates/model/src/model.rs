//! A loaded model: the executor plus the tokenizer and chat template read
//! from the same GGUF file.

use std::path::Path;

use flotilla_text::{TextError, TextSide};

use crate::cpu::{CpuConfig, CpuExecutor, LoadError};
use crate::gguf::{GgufError, GgufFile};

/// Why a model could not be loaded.
#[derive(Debug, thiserror::Error)]
pub enum ModelError {
    /// The file or its weights.
    #[error(transparent)]
    Load(#[from] LoadError),
    /// The file's metadata.
    #[error(transparent)]
    Gguf(#[from] GgufError),
    /// The tokenizer or chat template.
    #[error(transparent)]
    Text(#[from] TextError),
}

/// Everything needed to turn text into tokens, run them and turn tokens back into text.
pub struct Model {
    /// The forward pass.
    pub exec: CpuExecutor,
    /// Tokenizer, template, stop tokens.
    pub text: TextSide,
}

impl Model {
    /// Loads a GGUF model file.
    pub fn load(path: &Path, cfg: &CpuConfig) -> Result<Model, ModelError> {
        let g = GgufFile::open(path)?;
        Ok(Model {
            exec: CpuExecutor::from_gguf(&g, cfg)?,
            text: TextSide::from_gguf(&g)?,
        })
    }
}
