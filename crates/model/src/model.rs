//! A loaded model: the executor plus the tokenizer and chat template read
//! from the same GGUF file.

use std::path::Path;

use crate::chat::{ChatError, ChatTemplate};
use crate::cpu::{CpuConfig, CpuExecutor, LoadError};
use crate::gguf::{GgufError, GgufFile};
use crate::tokenizer::{GgufVocab, Tokenizer, TokenizerError};

/// Why a model could not be loaded.
#[derive(Debug, thiserror::Error)]
pub enum ModelError {
    /// The file or its weights.
    #[error(transparent)]
    Load(#[from] LoadError),
    /// The file's metadata.
    #[error(transparent)]
    Gguf(#[from] GgufError),
    /// The vocabulary.
    #[error("tokenizer: {0}")]
    Tokenizer(#[from] TokenizerError),
    /// The chat template.
    #[error("chat template: {0}")]
    Chat(#[from] ChatError),
}

/// The text side of a model: tokenizer, chat template and stop tokens.
pub struct TextSide {
    /// Text <-> token ids.
    pub tokenizer: Tokenizer,
    /// The file's chat template, when it has one.
    pub chat: Option<ChatTemplate>,
    /// Tokens that end generation (EOS and end-of-turn markers).
    pub stop_tokens: Vec<u32>,
}

impl TextSide {
    /// Reads the tokenizer, chat template and stop tokens of a GGUF file.
    pub fn from_gguf(g: &GgufFile) -> Result<TextSide, ModelError> {
        let tokenizer = tokenizer_from_gguf(g)?;
        let tok_str = |id: Option<u32>| id.and_then(|i| tokenizer.token_str(i)).unwrap_or_default();
        let chat = match g.str_opt("tokenizer.chat_template")? {
            Some(src) => Some(ChatTemplate::new(
                src,
                &tok_str(tokenizer.bos()),
                &tok_str(tokenizer.eos()),
            )?),
            None => None,
        };
        let mut stop_tokens: Vec<u32> = tokenizer.eos().into_iter().collect();
        for key in ["tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id"] {
            if let Some(id) = g.u64_opt(key)? {
                stop_tokens.push(id as u32);
            }
        }
        // Chat templates end a turn with a marker of their own; stop there too.
        for name in ["<|im_end|>", "<|eot_id|>", "<end_of_turn>"] {
            if let Some(id) = tokenizer.token_id(name)
                && tokenizer.is_special(id)
                && !stop_tokens.contains(&id)
            {
                stop_tokens.push(id);
            }
        }
        Ok(TextSide {
            tokenizer,
            chat,
            stop_tokens,
        })
    }
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

/// Builds the tokenizer described by a GGUF file's `tokenizer.ggml.*` keys.
pub fn tokenizer_from_gguf(g: &GgufFile) -> Result<Tokenizer, ModelError> {
    let tokens = g.str_array("tokenizer.ggml.tokens")?;
    let merges = match g.get("tokenizer.ggml.merges") {
        Some(_) => g.str_array("tokenizer.ggml.merges")?,
        None => Vec::new(),
    };
    let types: Option<Vec<i32>> = g
        .i64_array_opt("tokenizer.ggml.token_type")?
        .map(|v| v.into_iter().map(|x| x as i32).collect());
    let v = GgufVocab {
        model: g.str("tokenizer.ggml.model")?,
        pre: g.str_opt("tokenizer.ggml.pre")?,
        tokens: &tokens,
        merges: &merges,
        token_types: types.as_deref(),
        bos: g.u64_opt("tokenizer.ggml.bos_token_id")?.map(|v| v as u32),
        eos: g.u64_opt("tokenizer.ggml.eos_token_id")?.map(|v| v as u32),
        add_bos: g.bool_opt("tokenizer.ggml.add_bos_token")?.unwrap_or(false),
    };
    Ok(Tokenizer::from_gguf(&v)?)
}
