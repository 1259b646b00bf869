//! The text side of a model: tokenizers (byte-level BPE and SentencePiece,
//! as llama.cpp encodes them), chat templates, and what a GGUF file says
//! about both. Depends on the GGUF reader only; no forward pass, no network.

pub mod chat;
pub mod spm;
pub mod tokenizer;

use flotilla_gguf::{GgufError, GgufFile};

use crate::chat::{ChatError, ChatTemplate};
use crate::tokenizer::{GgufVocab, Tokenizer, TokenizerError};

/// Why a file's text side could not be read.
#[derive(Debug, thiserror::Error)]
pub enum TextError {
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
    /// The chat template: the file's own, else the architecture's built-in
    /// turn format (see [`TextSide::chat_builtin`]), else none.
    pub chat: Option<ChatTemplate>,
    /// Names the built-in turn format in use when the file has no template
    /// (callers say so once to the user).
    pub chat_builtin: Option<&'static str>,
    /// Tokens that end generation (EOS and end-of-turn markers).
    pub stop_tokens: Vec<u32>,
}

impl TextSide {
    /// Reads the tokenizer, chat template and stop tokens of a GGUF file.
    pub fn from_gguf(g: &GgufFile) -> Result<TextSide, TextError> {
        let tokenizer = tokenizer_from_gguf(g)?;
        let tok_str = |id: Option<u32>| id.and_then(|i| tokenizer.token_str(i)).unwrap_or_default();
        let arch = g.str_opt("general.architecture")?.unwrap_or_default();
        let (src, chat_builtin) = match g.str_opt("tokenizer.chat_template")? {
            Some(src) => (Some(src), None),
            None => match builtin_template(arch) {
                Some((name, src)) => (Some(src), Some(name)),
                None => (None, None),
            },
        };
        let chat = match src {
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
        for &name in tokenizer::EOG_TEXTS {
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
            chat_builtin,
            stop_tokens,
        })
    }
}

/// Gemma's turn format, as its instruction-tuned models' own template
/// writes it: a system message joins the first user turn, the assistant's
/// role is `model`. BOS is left to the tokenizer (`add_bos_token`).
const GEMMA_TEMPLATE: &str = "\
{%- if messages and messages[0]['role'] == 'system' -%}
{%- set first_user_prefix = messages[0]['content'] + '\n\n' -%}
{%- set loop_messages = messages[1:] -%}
{%- else -%}
{%- set first_user_prefix = '' -%}
{%- set loop_messages = messages -%}
{%- endif -%}
{%- for message in loop_messages -%}
{%- set role = 'model' if message['role'] == 'assistant' else message['role'] -%}
{{ '<start_of_turn>' + role + '\n' + (first_user_prefix if loop.first else '') + message['content'] | trim + '<end_of_turn>\n' }}
{%- endfor -%}
{%- if add_generation_prompt -%}{{ '<start_of_turn>model\n' }}{%- endif -%}";

/// The turn format an architecture's models are trained on, for files
/// that carry no `tokenizer.chat_template` (base models): (name, template).
pub fn builtin_template(arch: &str) -> Option<(&'static str, &'static str)> {
    match arch {
        "gemma" | "gemma2" | "gemma3" => Some(("Gemma turns", GEMMA_TEMPLATE)),
        _ => None,
    }
}

/// Builds the tokenizer described by a GGUF file's `tokenizer.ggml.*` keys.
pub fn tokenizer_from_gguf(g: &GgufFile) -> Result<Tokenizer, TextError> {
    let tokens = g.str_array("tokenizer.ggml.tokens")?;
    let merges = match g.get("tokenizer.ggml.merges") {
        Some(_) => g.str_array("tokenizer.ggml.merges")?,
        None => Vec::new(),
    };
    let scores = g.f32_array_opt("tokenizer.ggml.scores")?;
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
        scores: scores.as_deref(),
        unk: g
            .u64_opt("tokenizer.ggml.unknown_token_id")?
            .map(|v| v as u32),
        add_space_prefix: g
            .bool_opt("tokenizer.ggml.add_space_prefix")?
            .unwrap_or(true),
    };
    Ok(Tokenizer::from_gguf(&v)?)
}
