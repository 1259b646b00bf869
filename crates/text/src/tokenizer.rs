//! Text <-> token ids.
//!
//! [`Tokenizer`] wraps a Hugging Face [`tokenizers::Tokenizer`] and adds what an
//! inference engine needs on top of it: BOS/EOS ids, whether BOS is prepended,
//! which ids are special (control) tokens, and a streaming detokenizer
//! ([`DecodeStream`]) that never emits half a UTF-8 character.
//!
//! Two sources are supported:
//!
//! * **GGUF metadata** ([`Tokenizer::from_gguf`]): byte-level BPE vocabularies
//!   (`tokenizer.ggml.model = "gpt2"`), rebuilt so that encoding gives the same
//!   ids as llama.cpp, and SentencePiece vocabularies (`"llama"`: Gemma,
//!   Llama 2, Mistral), encoded by [`crate::spm`] as llama.cpp does. WordPiece
//!   (`"bert"`), T5 and RWKV vocabularies are **not** supported and give
//!   [`TokenizerError::Unsupported`].
//! * **A Hugging Face `tokenizer.json`** ([`Tokenizer::from_file`]), any model
//!   type the `tokenizers` crate can load.
//!
//! # How a GGUF vocabulary is rebuilt (llama.cpp parity)
//!
//! * BPE model: vocab `token string -> index`, merges `"a b"` split at the first
//!   space after the first byte (llama.cpp's `find(' ', 1)`), merge rank =
//!   position in the list. No unknown token, no byte fallback.
//! * Pre-tokenizer: the regex sequence llama.cpp uses for the
//!   `tokenizer.ggml.pre` value (see `PRE_TOKENIZERS` in the source), each regex
//!   applied as a `Split(…, Isolated)` — matched and unmatched pieces both kept,
//!   exactly like llama.cpp's `unicode_regex_split` — followed by the GPT-2
//!   byte-to-unicode mapping. A trailing GPT-2 regex is done by `ByteLevel`'s own
//!   regex, and `\p{N}` by `Digits(individual_digits)`, which are the same
//!   splits.
//! * Bytes with no token in the vocabulary are dropped from the output but,
//!   as in llama.cpp, still separate their neighbours during the merges
//!   (placeholder ids past the vocabulary end, filtered out by `encode`).
//! * Tokens whose `token_type` is 3 (control) become *special* added tokens;
//!   tokens of type 4 (user defined) become non-special added tokens. This is
//!   llama.cpp's partitioning: user-defined tokens are always matched as a
//!   whole, control tokens only when `parse_special` is true.
//! * `parse_special = false`: a second copy of the `tokenizers` pipeline is kept
//!   with `set_encode_special_tokens(true)`, which makes the added-vocabulary
//!   pass skip special tokens, so `<|im_start|>` in user text is tokenized as the
//!   plain characters `<`, `|`, `im`, … (user-defined tokens still match, as in
//!   llama.cpp). The copy costs one extra vocabulary in memory (a few MB) and
//!   keeps `encode` lock-free (`&self`).
//!
//! Decoding of byte-level vocabularies does not go through the `tokenizers`
//! decoder: each id maps to its exact bytes (GPT-2 byte table for normal tokens,
//! the raw text for control/user-defined tokens, as llama.cpp's
//! `token_to_piece`), the bytes are concatenated and converted to UTF-8 once.
//! So a character split across several tokens (emoji, CJK) decodes correctly.
//! llama.cpp's optional "clean up spaces" detokenizer pass is not applied:
//! `decode(encode(s)) == s`.

use std::path::{Path, PathBuf};

use tokenizers::decoders::DecoderWrapper;
use tokenizers::models::bpe::{BPE, Merges, Vocab};
use tokenizers::pre_tokenizers::PreTokenizerWrapper;
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::pre_tokenizers::digits::Digits;
use tokenizers::pre_tokenizers::sequence::Sequence;
use tokenizers::pre_tokenizers::split::{Split, SplitPattern};
use tokenizers::{AddedToken, SplitDelimiterBehavior};

use crate::spm::{self, Spm};

/// GGUF `token_type` value of a normal token.
pub const TOKEN_TYPE_NORMAL: i32 = 1;
/// GGUF `token_type` value of a control (special) token such as `<|im_start|>`.
pub const TOKEN_TYPE_CONTROL: i32 = 3;
/// GGUF `token_type` value of a user-defined token (always matched as a whole,
/// decoded as its raw text, not special).
pub const TOKEN_TYPE_USER_DEFINED: i32 = 4;

/// Texts of end-of-generation tokens: stop tokens, and control tokens even
/// where a file types them otherwise (Gemma's `</s>` is user-defined in its
/// GGUF), as llama.cpp does when it loads a vocabulary.
pub const EOG_TEXTS: &[&str] = &[
    "<|eot_id|>",
    "<|im_end|>",
    "<|end|>",
    "<end_of_turn>",
    "<|endoftext|>",
    "</s>",
    "<|eom_id|>",
    "<EOT>",
    "<|end_of_text|>",
];

/// A token's type, with end-of-generation texts made control tokens.
fn effective_type(name: &str, ty: i32) -> i32 {
    if EOG_TEXTS.contains(&name) {
        TOKEN_TYPE_CONTROL
    } else {
        ty
    }
}

/// Vocabulary facts taken from a GGUF file's `tokenizer.ggml.*` keys.
#[derive(Clone, Copy, Debug)]
pub struct GgufVocab<'a> {
    /// `tokenizer.ggml.model`; only `"gpt2"` (byte-level BPE) is supported.
    pub model: &'a str,
    /// `tokenizer.ggml.pre`: which pre-tokenizer regexes to use (`"smollm"`,
    /// `"llama-bpe"`, `"gpt-2"`, `"qwen2"`, `"default"`, …). `None` means the key
    /// is absent; llama.cpp then uses `"default"`, and so do we.
    pub pre: Option<&'a str>,
    /// `tokenizer.ggml.tokens`: token strings, the index is the id.
    pub tokens: &'a [String],
    /// `tokenizer.ggml.merges`: `"left right"` pairs in rank order.
    pub merges: &'a [String],
    /// `tokenizer.ggml.token_type`, one per token (1 normal, 3 control,
    /// 4 user defined, …). `None` means every token is normal.
    pub token_types: Option<&'a [i32]>,
    /// `tokenizer.ggml.bos_token_id`.
    pub bos: Option<u32>,
    /// `tokenizer.ggml.eos_token_id`.
    pub eos: Option<u32>,
    /// `tokenizer.ggml.add_bos_token`: whether [`Tokenizer::encode`] prepends BOS.
    pub add_bos: bool,
    /// `tokenizer.ggml.scores` (SentencePiece merge priorities).
    pub scores: Option<&'a [f32]>,
    /// `tokenizer.ggml.unknown_token_id`.
    pub unk: Option<u32>,
    /// `tokenizer.ggml.add_space_prefix` (SentencePiece; llama.cpp's default is true).
    pub add_space_prefix: bool,
}

/// Errors from building or using a [`Tokenizer`].
#[derive(Debug, thiserror::Error)]
pub enum TokenizerError {
    /// The vocabulary uses a tokenizer model or pre-tokenizer this crate cannot
    /// reproduce. `key` is the metadata key (e.g. `tokenizer.ggml.model`),
    /// `value` the value found, `hint` says what is supported.
    #[error("unsupported {key} = {value:?}: {hint}")]
    Unsupported {
        /// Metadata key whose value is unsupported.
        key: &'static str,
        /// The value found in the file.
        value: String,
        /// What is supported instead.
        hint: &'static str,
    },
    /// The vocabulary metadata is inconsistent (no tokens, `token_type` length
    /// differs from the token count, BOS/EOS id out of range, BOS required but
    /// absent, …).
    #[error("invalid tokenizer vocabulary: {0}")]
    InvalidVocab(String),
    /// A token id outside the vocabulary was given to decode.
    #[error("token id {id} is out of range: the vocabulary has {vocab_size} tokens")]
    UnknownId {
        /// The offending id.
        id: u32,
        /// Number of ids in the vocabulary.
        vocab_size: usize,
    },
    /// A tokenizer file could not be read.
    #[error("cannot read tokenizer file {}: {source}", path.display())]
    Io {
        /// The file that could not be read.
        path: PathBuf,
        /// The underlying I/O error.
        #[source]
        source: std::io::Error,
    },
    /// The `tokenizers` library failed; `context` says what was being done.
    #[error("tokenizer error while {context}: {message}")]
    Library {
        /// What was being done (e.g. "building the BPE model", "encoding").
        context: &'static str,
        /// The library's error message.
        message: String,
    },
}

impl TokenizerError {
    fn lib(context: &'static str) -> impl FnOnce(tokenizers::Error) -> TokenizerError {
        move |e| TokenizerError::Library {
            context,
            message: e.to_string(),
        }
    }
}

// ---------------------------------------------------------------------------
// Pre-tokenizers (regexes from llama.cpp `src/llama-vocab.cpp`)
// ---------------------------------------------------------------------------

/// The GPT-2 split regex, as llama.cpp writes it (`ByteLevel`'s own regex only
/// adds a final `|\s+`, which matches nothing that would not be kept as an
/// unmatched piece anyway).
const RE_GPT2: &str = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)";
/// One digit per piece.
const RE_DIGIT: &str = r"\p{N}";
const RE_LLAMA3: &str = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
const RE_QWEN2: &str = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
// For these two llama.cpp uses std::regex approximations of the upstream
// regexes (which need \p{Lu} etc.); fancy-regex handles the upstream ones.
const RE_GPT4O: &str = r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+";
const RE_TEKKEN: &str = r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+";
const RE_DEEPSEEK3_WORDS: &str = r##"[!"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+| ?[\p{P}\p{S}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"##;
const RE_PORO: &str = r" ?[^(\s|.,!?…。，、।۔،)]+";

/// A pre-tokenizer family: the regexes applied in order, and whether a word
/// that is itself in the vocabulary skips the merges (llama.cpp
/// `ignore_merges`).
struct PreTokenizerSpec {
    names: &'static [&'static str],
    regexes: &'static [&'static str],
    ignore_merges: bool,
}

/// `tokenizer.ggml.pre` values and their llama.cpp pre-tokenizer.
const PRE_TOKENIZERS: &[PreTokenizerSpec] = &[
    PreTokenizerSpec {
        names: &["default"],
        regexes: &[
            r"[\p{P}\$\+<=>\^~\|]+",
            RE_GPT2,
            r"\p{N}+",
            r"[0-9][0-9][0-9]",
        ],
        ignore_merges: false,
    },
    PreTokenizerSpec {
        names: &[
            "llama3",
            "llama-v3",
            "llama-bpe",
            "falcon3",
            "falcon-h1",
            "pixtral",
            "midm-2.0",
            "lfm2",
        ],
        regexes: &[RE_LLAMA3],
        ignore_merges: true,
    },
    PreTokenizerSpec {
        names: &["dbrx", "smaug-bpe", "glm4", "chatglm-bpe"],
        regexes: &[RE_LLAMA3],
        ignore_merges: false,
    },
    PreTokenizerSpec {
        names: &[
            "smollm",
            "starcoder",
            "refact",
            "command-r",
            "codeshell",
            "exaone",
            "minerva-7b",
        ],
        regexes: &[RE_DIGIT, RE_GPT2],
        ignore_merges: false,
    },
    PreTokenizerSpec {
        names: &[
            "gpt2",
            "gpt-2",
            "phi-2",
            "mpt",
            "olmo",
            "jais",
            "jina-es",
            "jina-de",
            "jina-v2-es",
            "jina-v2-de",
            "gigachat",
            "a.x-4.0",
            "mellum",
            "exaone4",
            "trillion",
            "granite-docling",
        ],
        regexes: &[RE_GPT2],
        ignore_merges: false,
    },
    PreTokenizerSpec {
        names: &[
            "qwen2",
            "deepseek-r1-qwen",
            "kormo",
            "megrez",
            "stablelm2",
            "hunyuan",
        ],
        regexes: &[RE_QWEN2],
        ignore_merges: false,
    },
    PreTokenizerSpec {
        names: &["falcon"],
        regexes: &[r"[\p{P}\$\+<=>\^~\|`]+", RE_GPT2, r"[0-9][0-9][0-9]"],
        ignore_merges: false,
    },
    PreTokenizerSpec {
        names: &["deepseek-coder"],
        regexes: &[
            r"[\r\n]",
            r"\s?\p{L}+",
            r"\s?\p{P}+",
            r"[一-龥ࠀ-一가-퟿]+",
            r"\p{N}",
        ],
        ignore_merges: false,
    },
    PreTokenizerSpec {
        names: &["deepseek-v3"],
        regexes: &[r"\p{N}{1,3}", r"[一-龥぀-ゟ゠-ヿ]+", RE_DEEPSEEK3_WORDS],
        ignore_merges: false,
    },
    PreTokenizerSpec {
        names: &["poro-chat", "bloom", "gpt3-finnish"],
        regexes: &[RE_PORO],
        ignore_merges: false,
    },
    PreTokenizerSpec {
        names: &["viking"],
        regexes: &[RE_PORO, RE_DIGIT],
        ignore_merges: false,
    },
    PreTokenizerSpec {
        names: &["gpt-4o", "llama4", "minimax-m2"],
        regexes: &[RE_GPT4O],
        ignore_merges: false,
    },
    PreTokenizerSpec {
        names: &["tekken"],
        regexes: &[RE_TEKKEN],
        ignore_merges: true,
    },
];

fn pre_tokenizer_spec(pre: Option<&str>) -> Result<&'static PreTokenizerSpec, TokenizerError> {
    let name = pre.unwrap_or("default");
    PRE_TOKENIZERS
        .iter()
        .find(|s| s.names.contains(&name))
        .ok_or_else(|| TokenizerError::Unsupported {
            key: "tokenizer.ggml.pre",
            value: name.to_owned(),
            hint: "supported: default, gpt2/gpt-2, smollm/starcoder, llama-bpe/llama3, qwen2, \
                   deepseek-coder, deepseek-v3, falcon, gpt-4o, tekken and their llama.cpp aliases",
        })
}

fn build_pre_tokenizer(spec: &PreTokenizerSpec) -> Result<PreTokenizerWrapper, TokenizerError> {
    let mut steps: Vec<PreTokenizerWrapper> = Vec::new();
    let (split_regexes, last_is_gpt2) = match spec.regexes.split_last() {
        Some((&last, rest)) if last == RE_GPT2 => (rest, true),
        _ => (spec.regexes, false),
    };
    for &re in split_regexes {
        if re == RE_DIGIT {
            steps.push(Digits::new(true).into());
        } else {
            let split = Split::new(
                SplitPattern::Regex(re.to_owned()),
                SplitDelimiterBehavior::Isolated,
                false,
            )
            .map_err(TokenizerError::lib("compiling a pre-tokenizer regex"))?;
            steps.push(split.into());
        }
    }
    // add_prefix_space = false, trim_offsets irrelevant (offsets unused).
    steps.push(ByteLevel::new(false, false, last_is_gpt2).into());
    Ok(if steps.len() == 1 {
        steps.pop().expect("one step")
    } else {
        Sequence::new(steps).into()
    })
}

// ---------------------------------------------------------------------------
// GPT-2 byte <-> unicode table
// ---------------------------------------------------------------------------

/// Size of the code point range used by the GPT-2 byte table (max is U+0143).
const BYTE_TABLE_LEN: usize = 324;

/// Code point -> byte for GPT-2's `bytes_to_unicode`; -1 where no byte maps.
const CHAR_TO_BYTE: [i16; BYTE_TABLE_LEN] = build_char_to_byte();

const fn build_char_to_byte() -> [i16; BYTE_TABLE_LEN] {
    let mut table = [-1i16; BYTE_TABLE_LEN];
    let mut next = 256usize;
    let mut b = 0usize;
    while b < 256 {
        let printable =
            (b >= 0x21 && b <= 0x7E) || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE && b <= 0xFF);
        if printable {
            table[b] = b as i16;
        } else {
            table[next] = b as i16;
            next += 1;
        }
        b += 1;
    }
    table
}

/// The GPT-2 byte-level character standing for byte `b`.
fn byte_level_char(b: u8) -> char {
    let cp = CHAR_TO_BYTE
        .iter()
        .position(|&x| x == i16::from(b))
        .expect("every byte has a character");
    char::from_u32(cp as u32).expect("code point below 0x144")
}

/// Append the bytes a byte-level token string stands for. Characters outside
/// the GPT-2 table (which a well-formed byte-level vocabulary never has) are
/// kept as their own UTF-8.
fn push_byte_level_bytes(token: &str, out: &mut Vec<u8>) {
    for c in token.chars() {
        let cp = c as usize;
        match CHAR_TO_BYTE.get(cp) {
            Some(&b) if b >= 0 => out.push(b as u8),
            _ => {
                let mut buf = [0u8; 4];
                out.extend_from_slice(c.encode_utf8(&mut buf).as_bytes());
            }
        }
    }
}

// ---------------------------------------------------------------------------
// Tokenizer
// ---------------------------------------------------------------------------

/// How ids are turned back into text.
/// How text becomes ids.
enum Encoder {
    /// Byte-level BPE from GGUF, or a `tokenizer.json`, through `tokenizers`.
    Library {
        /// Pipeline that recognises special tokens in text (`parse_special = true`).
        with_special: Box<tokenizers::Tokenizer>,
        /// Same pipeline with special-token matching off (`parse_special = false`).
        plain: Box<tokenizers::Tokenizer>,
    },
    /// A SentencePiece vocabulary from GGUF.
    Spm {
        spm: Box<Spm>,
        /// Token strings by id.
        names: Vec<String>,
    },
}

enum Detok {
    /// Byte-level vocabulary: the exact bytes of every id.
    Bytes(Vec<Box<[u8]>>),
    /// Anything else: the `tokenizers` decoder (Metaspace, WordPiece, …).
    Library,
}

/// A tokenizer: encodes text to ids and decodes ids to text.
///
/// Cheap to share: all methods take `&self` and it is `Send + Sync`.
pub struct Tokenizer {
    enc: Encoder,
    bos: Option<u32>,
    eos: Option<u32>,
    add_bos: bool,
    vocab_size: usize,
    /// `special[id]`: control token (skipped by `skip_special`).
    special: Vec<bool>,
    detok: Detok,
}

impl std::fmt::Debug for Tokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tokenizer")
            .field("vocab_size", &self.vocab_size)
            .field("bos", &self.bos)
            .field("eos", &self.eos)
            .field("add_bos", &self.add_bos)
            .field("byte_level", &matches!(self.detok, Detok::Bytes(_)))
            .finish_non_exhaustive()
    }
}

impl Tokenizer {
    /// Build a tokenizer from GGUF vocabulary metadata, matching llama.cpp's
    /// tokenization (see the module docs for the recipe).
    ///
    /// Errors: [`TokenizerError::Unsupported`] for a `model` other than `"gpt2"`
    /// or an unknown `pre`; [`TokenizerError::InvalidVocab`] for inconsistent
    /// metadata.
    pub fn from_gguf(v: &GgufVocab) -> Result<Tokenizer, TokenizerError> {
        match v.model {
            "gpt2" => {}
            "llama" => return Self::from_gguf_spm(v),
            _ => {
                return Err(TokenizerError::Unsupported {
                    key: "tokenizer.ggml.model",
                    value: v.model.to_owned(),
                    hint: "supported: \"gpt2\" (byte-level BPE) and \"llama\" (SentencePiece); \
                           WordPiece (\"bert\"), \"t5\" and \"rwkv\" are not",
                });
            }
        }
        let spec = pre_tokenizer_spec(v.pre)?;
        let n = v.tokens.len();
        if n == 0 {
            return Err(TokenizerError::InvalidVocab(
                "tokenizer.ggml.tokens is empty".into(),
            ));
        }
        if n > u32::MAX as usize {
            return Err(TokenizerError::InvalidVocab(format!(
                "{n} tokens do not fit in u32 ids"
            )));
        }
        if let Some(tt) = v.token_types
            && tt.len() != n
        {
            return Err(TokenizerError::InvalidVocab(format!(
                "tokenizer.ggml.token_type has {} entries but there are {n} tokens",
                tt.len()
            )));
        }
        let token_type = |i: usize| {
            effective_type(
                &v.tokens[i],
                v.token_types.map_or(TOKEN_TYPE_NORMAL, |tt| tt[i]),
            )
        };

        // Token strings; empty ones are renamed as llama.cpp does.
        let names: Vec<String> = v
            .tokens
            .iter()
            .enumerate()
            .map(|(i, t)| {
                if t.is_empty() {
                    format!("[EMPTY_{i}]")
                } else {
                    t.clone()
                }
            })
            .collect();
        let mut vocab: Vocab = names
            .iter()
            .enumerate()
            .map(|(i, t)| (t.clone(), i as u32))
            .collect();
        // Bytes with no token of their own (SmolLM2 lacks 21, e.g. 0x04 and
        // 0xFF) get placeholder ids past the end of the vocabulary, which
        // `encode` removes. llama.cpp likewise keeps such a byte as a symbol
        // during the merges and drops it at the end; the `tokenizers` BPE
        // would drop it *before* merging and so merge its neighbours across
        // it ("!\x04!" would become "!!" instead of "!", "!").
        let mut next_placeholder = n as u32;
        for b in 0..=255u8 {
            let c = byte_level_char(b).to_string();
            if !vocab.contains_key(&c) {
                vocab.insert(c, next_placeholder);
                next_placeholder += 1;
            }
        }

        // Merges: split at the first space after the first byte; skip
        // malformed ones, duplicates (the first rank wins, as in llama.cpp) and
        // ones whose parts or result are not in the vocabulary (the BPE model
        // cannot represent them; relative ranks of the others are unchanged).
        let mut seen = std::collections::HashSet::new();
        let mut merges: Merges = Vec::with_capacity(v.merges.len());
        let real = |t: &str| vocab.get(t).is_some_and(|&id| (id as usize) < n);
        for m in v.merges {
            // Byte search: a space byte is never inside a multi-byte character.
            let Some(pos) = m.bytes().skip(1).position(|b| b == b' ').map(|p| p + 1) else {
                continue;
            };
            let (a, b) = (&m[..pos], &m[pos + 1..]);
            if a.is_empty() || b.is_empty() {
                continue;
            }
            if !real(a) || !real(b) || !real(&format!("{a}{b}")) {
                continue;
            }
            if seen.insert((a.to_owned(), b.to_owned())) {
                merges.push((a.to_owned(), b.to_owned()));
            }
        }

        let bpe = BPE::builder()
            .vocab_and_merges(vocab, merges)
            .ignore_merges(spec.ignore_merges)
            .build()
            .map_err(TokenizerError::lib("building the BPE model"))?;
        let mut tk = tokenizers::Tokenizer::new(bpe);
        tk.with_pre_tokenizer(Some(build_pre_tokenizer(spec)?));
        tk.with_decoder(Some(DecoderWrapper::ByteLevel(ByteLevel::default())));

        let mut special = vec![false; n];
        let mut special_tokens = Vec::new();
        let mut user_tokens = Vec::new();
        let mut pieces: Vec<Box<[u8]>> = Vec::with_capacity(n);
        for (i, name) in names.iter().enumerate() {
            match token_type(i) {
                TOKEN_TYPE_CONTROL => {
                    special[i] = true;
                    special_tokens.push(AddedToken::from(name.clone(), true));
                    pieces.push(name.as_bytes().into());
                }
                TOKEN_TYPE_USER_DEFINED => {
                    user_tokens.push(AddedToken::from(name.clone(), false));
                    pieces.push(name.as_bytes().into());
                }
                _ => {
                    let mut bytes = Vec::with_capacity(name.len());
                    push_byte_level_bytes(name, &mut bytes);
                    pieces.push(bytes.into_boxed_slice());
                }
            }
        }
        // Adding tokens that already are in the vocabulary keeps their ids.
        tk.add_special_tokens(&special_tokens);
        tk.add_tokens(&user_tokens);

        let mut tok = Self::assemble(tk, n, special, Detok::Bytes(pieces));
        tok.set_special_ids(v.bos, v.eos, v.add_bos)?;
        Ok(tok)
    }

    /// A SentencePiece vocabulary (`tokenizer.ggml.model = "llama"`), encoded
    /// as llama.cpp does (see [`crate::spm`]).
    fn from_gguf_spm(v: &GgufVocab) -> Result<Tokenizer, TokenizerError> {
        let n = v.tokens.len();
        if n == 0 || n > u32::MAX as usize {
            return Err(TokenizerError::InvalidVocab(format!(
                "a vocabulary of {n} tokens"
            )));
        }
        let types: Vec<i32> = match v.token_types {
            Some(tt) if tt.len() == n => v
                .tokens
                .iter()
                .zip(tt)
                .map(|(t, &ty)| effective_type(t, ty))
                .collect(),
            Some(tt) => {
                return Err(TokenizerError::InvalidVocab(format!(
                    "tokenizer.ggml.token_type has {} entries but there are {n} tokens",
                    tt.len()
                )));
            }
            None => v
                .tokens
                .iter()
                .map(|t| effective_type(t, TOKEN_TYPE_NORMAL))
                .collect(),
        };
        let scores: Vec<f32> = match v.scores {
            Some(sc) if sc.len() == n => sc.to_vec(),
            Some(sc) => {
                return Err(TokenizerError::InvalidVocab(format!(
                    "tokenizer.ggml.scores has {} entries but there are {n} tokens",
                    sc.len()
                )));
            }
            None => {
                return Err(TokenizerError::InvalidVocab(
                    "a SentencePiece vocabulary needs tokenizer.ggml.scores".into(),
                ));
            }
        };
        if let Some(u) = v.unk
            && u as usize >= n
        {
            return Err(TokenizerError::InvalidVocab(format!(
                "unknown-token id {u} is out of range"
            )));
        }
        let spm = Spm::new(v.tokens, &scores, &types, v.unk, v.add_space_prefix);
        let special = types.iter().map(|&t| t == TOKEN_TYPE_CONTROL).collect();
        let pieces = v
            .tokens
            .iter()
            .zip(&types)
            .map(|(t, &ty)| spm::piece_bytes(t, ty).into_boxed_slice())
            .collect();
        let mut tok = Tokenizer {
            enc: Encoder::Spm {
                spm: Box::new(spm),
                names: v.tokens.to_vec(),
            },
            bos: None,
            eos: None,
            add_bos: false,
            vocab_size: n,
            special,
            detok: Detok::Bytes(pieces),
        };
        tok.set_special_ids(v.bos, v.eos, v.add_bos)?;
        Ok(tok)
    }

    /// Load a Hugging Face `tokenizer.json`.
    ///
    /// BOS/EOS and whether BOS is prepended come from a `tokenizer_config.json`
    /// next to the file when there is one (`bos_token`, `eos_token`,
    /// `add_bos_token`); otherwise BOS is whatever the file's post-processor
    /// prepends (if anything) and EOS is unknown. Use
    /// [`Tokenizer::with_special_ids`] to set them explicitly.
    pub fn from_file(tokenizer_json: &Path) -> Result<Tokenizer, TokenizerError> {
        let text =
            std::fs::read_to_string(tokenizer_json).map_err(|source| TokenizerError::Io {
                path: tokenizer_json.to_owned(),
                source,
            })?;
        let tk: tokenizers::Tokenizer = text
            .parse()
            .map_err(TokenizerError::lib("parsing tokenizer.json"))?;

        let vocab_size = tk.get_vocab_size(true);
        let added = tk.get_added_tokens_decoder();
        let max_id = added.keys().copied().max().map_or(0, |m| m as usize + 1);
        let vocab_size = vocab_size.max(max_id);
        let mut special = vec![false; vocab_size];
        for (&id, t) in &added {
            if t.special {
                special[id as usize] = true;
            }
        }
        let byte_level = matches!(tk.get_decoder(), Some(DecoderWrapper::ByteLevel(_)));
        let detok = if byte_level {
            let pieces = (0..vocab_size as u32)
                .map(|id| {
                    if let Some(t) = added.get(&id) {
                        t.content.as_bytes().into()
                    } else if let Some(s) = tk.id_to_token(id) {
                        let mut bytes = Vec::with_capacity(s.len());
                        push_byte_level_bytes(&s, &mut bytes);
                        bytes.into_boxed_slice()
                    } else {
                        Box::default()
                    }
                })
                .collect();
            Detok::Bytes(pieces)
        } else {
            Detok::Library
        };

        // BOS / EOS.
        let config = tokenizer_json
            .parent()
            .map(|d| d.join("tokenizer_config.json"))
            .and_then(|p| std::fs::read_to_string(p).ok())
            .and_then(|s| serde_json::from_str::<serde_json::Value>(&s).ok());
        let token_field = |key: &str| -> Option<u32> {
            let v = config.as_ref()?.get(key)?;
            let s = v.as_str().or_else(|| v.get("content")?.as_str())?;
            tk.token_to_id(s)
        };
        let cfg_bos = token_field("bos_token");
        let cfg_eos = token_field("eos_token");
        let cfg_add_bos = config
            .as_ref()
            .and_then(|c| c.get("add_bos_token"))
            .and_then(|v| v.as_bool());
        // What the post-processor prepends, if anything.
        let probe_bos = {
            let with = tk.encode_fast("a", true).ok();
            let without = tk.encode_fast("a", false).ok();
            match (with, without) {
                (Some(w), Some(wo))
                    if w.get_ids().len() > wo.get_ids().len()
                        && w.get_ids().first() != wo.get_ids().first() =>
                {
                    w.get_ids().first().copied()
                }
                _ => None,
            }
        };
        let bos = cfg_bos.or(probe_bos);
        let add_bos = bos.is_some() && cfg_add_bos.unwrap_or(probe_bos.is_some());

        let mut tok = Self::assemble(tk, vocab_size, special, detok);
        tok.set_special_ids(bos, cfg_eos, add_bos)?;
        Ok(tok)
    }

    /// Replace BOS, EOS and whether `encode` prepends BOS.
    ///
    /// Errors if an id is out of range or `add_bos` is set without a BOS id.
    pub fn with_special_ids(
        mut self,
        bos: Option<u32>,
        eos: Option<u32>,
        add_bos: bool,
    ) -> Result<Tokenizer, TokenizerError> {
        self.set_special_ids(bos, eos, add_bos)?;
        Ok(self)
    }

    fn assemble(
        with_special: tokenizers::Tokenizer,
        vocab_size: usize,
        special: Vec<bool>,
        detok: Detok,
    ) -> Tokenizer {
        let mut plain = with_special.clone();
        plain.set_encode_special_tokens(true);
        Tokenizer {
            enc: Encoder::Library {
                with_special: Box::new(with_special),
                plain: Box::new(plain),
            },
            bos: None,
            eos: None,
            add_bos: false,
            vocab_size,
            special,
            detok,
        }
    }

    fn set_special_ids(
        &mut self,
        bos: Option<u32>,
        eos: Option<u32>,
        add_bos: bool,
    ) -> Result<(), TokenizerError> {
        for (what, id) in [("BOS", bos), ("EOS", eos)] {
            if let Some(id) = id
                && id as usize >= self.vocab_size
            {
                return Err(TokenizerError::InvalidVocab(format!(
                    "{what} id {id} is out of range: the vocabulary has {} tokens",
                    self.vocab_size
                )));
            }
        }
        if add_bos && bos.is_none() {
            return Err(TokenizerError::InvalidVocab(
                "add_bos_token is set but there is no BOS token id".into(),
            ));
        }
        self.bos = bos;
        self.eos = eos;
        self.add_bos = add_bos;
        Ok(())
    }

    /// Encode text to ids. Prepends BOS only when the vocabulary says so
    /// ([`Tokenizer::add_bos`]).
    ///
    /// With `parse_special`, special-token text such as `<|im_start|>` becomes
    /// its single id; without it, that text is tokenized like any other text
    /// (use this for untrusted user content).
    pub fn encode(&self, text: &str, parse_special: bool) -> Result<Vec<u32>, TokenizerError> {
        let tk = match &self.enc {
            Encoder::Library { with_special, .. } if parse_special => with_special,
            Encoder::Library { plain, .. } => plain,
            Encoder::Spm { spm, .. } => {
                let mut out = Vec::with_capacity(text.len() / 3 + 2);
                if self.add_bos
                    && let Some(bos) = self.bos
                {
                    out.push(bos);
                }
                spm.encode(text, parse_special, &mut out);
                return Ok(out);
            }
        };
        let enc = tk
            .encode_fast(text, false)
            .map_err(TokenizerError::lib("encoding text"))?;
        let ids = enc.get_ids();
        let mut out = Vec::with_capacity(ids.len() + 1);
        if self.add_bos
            && let Some(bos) = self.bos
        {
            out.push(bos);
        }
        // Drop placeholder ids of bytes that have no token (see `from_gguf`).
        out.extend(
            ids.iter()
                .copied()
                .filter(|&id| (id as usize) < self.vocab_size),
        );
        Ok(out)
    }

    /// Decode ids to text. Special (control) tokens are written as their text
    /// unless `skip_special`. Bytes that do not form valid UTF-8 become U+FFFD.
    pub fn decode(&self, ids: &[u32], skip_special: bool) -> Result<String, TokenizerError> {
        self.check_ids(ids)?;
        match &self.detok {
            Detok::Bytes(pieces) => {
                let mut bytes = Vec::new();
                for &id in ids {
                    if skip_special && self.special[id as usize] {
                        continue;
                    }
                    bytes.extend_from_slice(&pieces[id as usize]);
                }
                Ok(match String::from_utf8(bytes) {
                    Ok(s) => s,
                    Err(e) => String::from_utf8_lossy(e.as_bytes()).into_owned(),
                })
            }
            Detok::Library => match &self.enc {
                Encoder::Library { with_special, .. } => with_special
                    .decode(ids, skip_special)
                    .map_err(TokenizerError::lib("decoding ids")),
                Encoder::Spm { .. } => unreachable!("SentencePiece vocabularies decode by bytes"),
            },
        }
    }

    fn check_ids(&self, ids: &[u32]) -> Result<(), TokenizerError> {
        match ids.iter().find(|&&id| id as usize >= self.vocab_size) {
            Some(&id) => Err(TokenizerError::UnknownId {
                id,
                vocab_size: self.vocab_size,
            }),
            None => Ok(()),
        }
    }

    /// Number of ids (including added tokens).
    pub fn vocab_size(&self) -> usize {
        self.vocab_size
    }

    /// Beginning-of-sequence id, if the vocabulary has one.
    pub fn bos(&self) -> Option<u32> {
        self.bos
    }

    /// End-of-sequence id, if known.
    pub fn eos(&self) -> Option<u32> {
        self.eos
    }

    /// Whether [`Tokenizer::encode`] prepends BOS.
    pub fn add_bos(&self) -> bool {
        self.add_bos
    }

    /// The raw vocabulary string of an id (byte-level form, e.g. `"Ġworld"`),
    /// or `None` if the id is out of range.
    pub fn token_str(&self, id: u32) -> Option<String> {
        if id as usize >= self.vocab_size {
            return None;
        }
        match &self.enc {
            Encoder::Library { with_special, .. } => with_special.id_to_token(id),
            Encoder::Spm { names, .. } => names.get(id as usize).cloned(),
        }
    }

    /// The exact bytes an id stands for in decoded text (a byte-fallback
    /// token's one byte, a byte-level token's bytes), when the vocabulary
    /// decodes by bytes; `None` for a `tokenizer.json` decoder or a bad id.
    pub fn token_bytes(&self, id: u32) -> Option<&[u8]> {
        match &self.detok {
            Detok::Bytes(pieces) => pieces.get(id as usize).map(|p| &p[..]),
            Detok::Library => None,
        }
    }

    /// The id of a vocabulary string (e.g. `"<|im_end|>"`), if present.
    pub fn token_id(&self, token: &str) -> Option<u32> {
        match &self.enc {
            Encoder::Library { with_special, .. } => with_special.token_to_id(token),
            Encoder::Spm { spm, .. } => spm.token_id(token),
        }
        .filter(|&id| (id as usize) < self.vocab_size)
    }

    /// Whether an id is a special (control) token such as `<|im_end|>`.
    pub fn is_special(&self, id: u32) -> bool {
        self.special.get(id as usize).copied().unwrap_or(false)
    }

    /// A streaming detokenizer: push ids one at a time, get text as soon as it
    /// is complete UTF-8.
    pub fn stream(&self, skip_special: bool) -> DecodeStream<'_> {
        DecodeStream {
            tok: self,
            skip_special,
            pending: Vec::new(),
            ids: Vec::new(),
            prefix: 0,
            read: 0,
        }
    }
}

/// Streaming detokenizer: feed token ids one at a time; yields text only when
/// it is complete UTF-8 (a character split across tokens is never emitted half).
///
/// For byte-level vocabularies the undecoded tail is at most 3 bytes. For
/// other vocabularies (e.g. a SentencePiece `tokenizer.json`) the text of the
/// ids since the last emission is re-decoded and the new suffix emitted once it
/// no longer ends in U+FFFD, so context-dependent decoders (leading-space
/// stripping) give the same text as a one-shot [`Tokenizer::decode`].
pub struct DecodeStream<'a> {
    tok: &'a Tokenizer,
    skip_special: bool,
    /// Byte-level mode: bytes not yet emitted (an incomplete UTF-8 tail).
    pending: Vec<u8>,
    /// Library mode: ids seen; `ids[prefix..read]` were already emitted and
    /// serve as left context.
    ids: Vec<u32>,
    prefix: usize,
    read: usize,
}

impl std::fmt::Debug for DecodeStream<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DecodeStream")
            .field("skip_special", &self.skip_special)
            .field("pending", &self.pending)
            .finish_non_exhaustive()
    }
}

impl DecodeStream<'_> {
    /// Add one id. Returns the text that became complete, if any.
    pub fn push(&mut self, id: u32) -> Result<Option<String>, TokenizerError> {
        self.tok.check_ids(&[id])?;
        match &self.tok.detok {
            Detok::Bytes(pieces) => {
                if self.skip_special && self.tok.special[id as usize] {
                    return Ok(None);
                }
                self.pending.extend_from_slice(&pieces[id as usize]);
                Ok(take_complete_utf8(&mut self.pending))
            }
            Detok::Library => {
                self.ids.push(id);
                let before = self
                    .tok
                    .decode(&self.ids[self.prefix..self.read], self.skip_special)?;
                let after = self
                    .tok
                    .decode(&self.ids[self.prefix..], self.skip_special)?;
                if after.len() > before.len()
                    && !after.ends_with('\u{FFFD}')
                    && after.is_char_boundary(before.len())
                    && after.starts_with(&before)
                {
                    let new = after[before.len()..].to_owned();
                    self.prefix = self.read;
                    self.read = self.ids.len();
                    Ok(Some(new))
                } else {
                    Ok(None)
                }
            }
        }
    }

    /// Emit whatever is left (an incomplete character becomes U+FFFD) and
    /// reset the stream.
    pub fn flush(&mut self) -> Result<Option<String>, TokenizerError> {
        match &self.tok.detok {
            Detok::Bytes(_) => {
                if self.pending.is_empty() {
                    return Ok(None);
                }
                let s = String::from_utf8_lossy(&self.pending).into_owned();
                self.pending.clear();
                Ok(Some(s))
            }
            Detok::Library => {
                if self.read == self.ids.len() {
                    self.ids.clear();
                    self.prefix = 0;
                    self.read = 0;
                    return Ok(None);
                }
                let before = self
                    .tok
                    .decode(&self.ids[self.prefix..self.read], self.skip_special)?;
                let after = self
                    .tok
                    .decode(&self.ids[self.prefix..], self.skip_special)?;
                self.ids.clear();
                self.prefix = 0;
                self.read = 0;
                let new = match after.strip_prefix(before.as_str()) {
                    Some(rest) => rest.to_owned(),
                    None => after,
                };
                Ok((!new.is_empty()).then_some(new))
            }
        }
    }
}

/// Remove and return the longest prefix of `buf` that is finished UTF-8.
/// Invalid sequences (that no later byte can complete) become U+FFFD, exactly
/// as `String::from_utf8_lossy` would; only an incomplete trailing character
/// (at most 3 bytes) is kept in `buf`.
fn take_complete_utf8(buf: &mut Vec<u8>) -> Option<String> {
    let mut out = String::new();
    let mut start = 0;
    loop {
        match std::str::from_utf8(&buf[start..]) {
            Ok(s) => {
                out.push_str(s);
                start = buf.len();
                break;
            }
            Err(e) => {
                let valid = e.valid_up_to();
                out.push_str(
                    std::str::from_utf8(&buf[start..start + valid]).expect("valid prefix"),
                );
                start += valid;
                match e.error_len() {
                    Some(n) => {
                        out.push('\u{FFFD}');
                        start += n;
                    }
                    None => break, // incomplete tail: wait for more bytes
                }
            }
        }
    }
    buf.drain(..start);
    (!out.is_empty()).then_some(out)
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    /// Owned GGUF vocabulary for tests (what [`GgufVocab`] borrows from).
    pub(crate) struct TestVocab {
        pub model: String,
        pub pre: Option<String>,
        pub tokens: Vec<String>,
        pub merges: Vec<String>,
        pub token_types: Option<Vec<i32>>,
        pub bos: Option<u32>,
        pub eos: Option<u32>,
        pub add_bos: bool,
        pub chat_template: Option<String>,
    }

    impl TestVocab {
        pub fn as_vocab(&self) -> GgufVocab<'_> {
            GgufVocab {
                model: &self.model,
                pre: self.pre.as_deref(),
                tokens: &self.tokens,
                merges: &self.merges,
                token_types: self.token_types.as_deref(),
                bos: self.bos,
                eos: self.eos,
                add_bos: self.add_bos,
                scores: None,
                unk: None,
                add_space_prefix: false,
            }
        }
    }

    /// The default model's vocabulary, read with the crate's GGUF reader.
    /// Always `Some`: the model is fetched if absent, and a failure fails the test.
    pub(crate) fn load_test_vocab() -> Option<TestVocab> {
        let g = flotilla_gguf::GgufFile::open(&flotilla_hub::test_model_path())
            .expect("open the default model");
        let id = |k: &str| g.u64_opt(k).unwrap().map(|v| v as u32);
        Some(TestVocab {
            model: g.str("tokenizer.ggml.model").unwrap().to_owned(),
            pre: g.str_opt("tokenizer.ggml.pre").unwrap().map(str::to_owned),
            tokens: g.str_array("tokenizer.ggml.tokens").unwrap(),
            merges: g.str_array("tokenizer.ggml.merges").unwrap(),
            token_types: g
                .i64_array_opt("tokenizer.ggml.token_type")
                .unwrap()
                .map(|v| v.into_iter().map(|x| x as i32).collect()),
            bos: id("tokenizer.ggml.bos_token_id"),
            eos: id("tokenizer.ggml.eos_token_id"),
            add_bos: g
                .bool_opt("tokenizer.ggml.add_bos_token")
                .unwrap()
                .unwrap_or(false),
            chat_template: g
                .str_opt("tokenizer.chat_template")
                .unwrap()
                .map(str::to_owned),
        })
    }

    fn smollm() -> Option<Tokenizer> {
        let v = load_test_vocab()?;
        Some(Tokenizer::from_gguf(&v.as_vocab()).expect("build SmolLM2 tokenizer"))
    }

    /// One fixture case. `parse_special` defaults to true, llama-tokenize's
    /// default (it has `--no-parse-special` to turn it off).
    #[derive(serde::Deserialize)]
    struct Case {
        text: String,
        ids: Vec<u32>,
        #[serde(default = "default_parse_special")]
        parse_special: bool,
    }

    fn default_parse_special() -> bool {
        true
    }

    /// llama.cpp `llama-tokenize` output for SmolLM2, or `None` if the fixture
    /// is not there.
    fn fixture_cases() -> Option<Vec<Case>> {
        let path = concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../../tests/fixtures/tokenizer_cases.json"
        );
        let text = std::fs::read_to_string(path).unwrap_or_else(|e| panic!("fixture {path}: {e}"));
        Some(serde_json::from_str(&text).expect("fixture JSON"))
    }

    #[test]
    fn smollm_matches_llama_cpp_fixture() {
        let (Some(tok), Some(cases)) = (smollm(), fixture_cases()) else {
            return;
        };
        assert!(!cases.is_empty());
        let mut failures = Vec::new();
        for c in &cases {
            let got = tok.encode(&c.text, c.parse_special).unwrap();
            if got != c.ids {
                failures.push(format!("{:?}: expected {:?}, got {:?}", c.text, c.ids, got));
            }
        }
        assert!(
            failures.is_empty(),
            "{} of {} cases differ:\n{}",
            failures.len(),
            cases.len(),
            failures.join("\n")
        );
    }

    #[test]
    fn smollm_fixture_round_trips() {
        let (Some(tok), Some(cases)) = (smollm(), fixture_cases()) else {
            return;
        };
        for c in &cases {
            let ids = tok.encode(&c.text, c.parse_special).unwrap();
            assert_eq!(tok.decode(&ids, false).unwrap(), c.text);
            assert_eq!(tok.decode(&c.ids, false).unwrap(), c.text);
        }
    }

    #[test]
    fn smollm_known_ids() {
        let Some(tok) = smollm() else { return };
        assert_eq!(tok.vocab_size(), 49152);
        assert_eq!(tok.bos(), Some(1));
        assert_eq!(tok.eos(), Some(2));
        assert!(!tok.add_bos());
        // From llama.cpp: "Hello world! 123" -> Hello, Ġworld, !, Ġ, 1, 2, 3.
        assert_eq!(
            tok.encode("Hello world! 123", false).unwrap(),
            [19556, 905, 17, 216, 33, 34, 35]
        );
        assert_eq!(
            tok.encode("Hello, we can use", false).unwrap(),
            [19556, 28, 392, 416, 722]
        );
        assert_eq!(
            tok.encode("  multiple   spaces", false).unwrap(),
            [216, 2701, 256, 5600]
        );
        assert_eq!(
            tok.encode("Café déjà vu.", false).unwrap(),
            [51, 1939, 2756, 32564, 90, 16739, 386, 101, 30]
        );
        assert_eq!(tok.encode("\n", false).unwrap(), [198]);
        // Bytes without a token are dropped but still block merges (llama.cpp).
        assert_eq!(tok.encode("!\x04!", false).unwrap(), [17, 17]);
        assert_eq!(tok.encode("..\x04..", false).unwrap(), [950, 950]);
        assert_eq!(tok.encode("\x04", false).unwrap(), Vec::<u32>::new());
        assert_eq!(tok.encode("12345", false).unwrap().len(), 5);
        assert_eq!(tok.encode("", true).unwrap(), Vec::<u32>::new());
        assert_eq!(tok.token_str(905).as_deref(), Some("Ġworld"));
        assert_eq!(tok.token_str(49152), None);
    }

    #[test]
    fn smollm_special_tokens() {
        let Some(tok) = smollm() else { return };
        assert_eq!(tok.encode("<|im_start|>", true).unwrap(), [1]);
        assert!(tok.is_special(1) && tok.is_special(2) && !tok.is_special(905));
        let plain = tok.encode("<|im_start|>", false).unwrap();
        assert!(
            plain.len() > 1,
            "special text must be plain text without parse_special: {plain:?}"
        );
        assert!(!plain.iter().any(|&id| tok.is_special(id)));
        assert_eq!(tok.decode(&plain, false).unwrap(), "<|im_start|>");

        let ids = tok
            .encode("<|im_start|>user\nHi<|im_end|>\n", true)
            .unwrap();
        assert_eq!(ids[0], 1);
        assert!(ids.contains(&2));
        assert_eq!(
            tok.decode(&ids, false).unwrap(),
            "<|im_start|>user\nHi<|im_end|>\n"
        );
        assert_eq!(tok.decode(&ids, true).unwrap(), "user\nHi\n");

        let mut s = tok.stream(true);
        let mut out = String::new();
        for &id in &ids {
            if let Some(t) = s.push(id).unwrap() {
                out.push_str(&t);
            }
        }
        assert_eq!(out, "user\nHi\n");
        assert!(matches!(
            tok.decode(&[49152], false),
            Err(TokenizerError::UnknownId { id: 49152, .. })
        ));
    }

    const HARD_STRINGS: &[&str] = &[
        "Hello, world!",
        "emoji: 😀👍🏽 family 👨‍👩‍👧‍👦 flags 🇫🇷🇯🇵",
        "中文分词测试，日本語のテキスト、한국어 문장。",
        "mixed 12345 and ١٢٣ digits, tabs\tand\r\nnewlines\n\n\n",
        "   leading and trailing spaces   ",
        "Ünïcödé àçcénts — “quotes” ‘single’ … ellipsis",
        "code: fn main() { println!(\"{}\", x); } // comment",
        "I'm sure they've said it's what we'd do, you'll see, she's CAN'T",
        "𝔘𝔫𝔦𝔠𝔬𝔡𝔢 math 𝛼𝛽𝛾 and \u{200b}zero width",
    ];

    fn stream_all(tok: &Tokenizer, ids: &[u32], skip: bool) -> (String, Vec<String>) {
        let mut s = tok.stream(skip);
        let mut chunks = Vec::new();
        for &id in ids {
            if let Some(t) = s.push(id).unwrap() {
                chunks.push(t);
            }
        }
        if let Some(t) = s.flush().unwrap() {
            chunks.push(t);
        }
        (chunks.concat(), chunks)
    }

    #[test]
    fn smollm_round_trip_and_streaming() {
        let Some(tok) = smollm() else { return };
        let mut texts: Vec<String> = HARD_STRINGS.iter().map(|s| s.to_string()).collect();
        if let Some(cases) = fixture_cases() {
            texts.extend(cases.into_iter().map(|c| c.text));
        }
        for text in &texts {
            let ids = tok.encode(text, false).unwrap();
            assert_eq!(&tok.decode(&ids, false).unwrap(), text);
            let (joined, chunks) = stream_all(&tok, &ids, false);
            assert_eq!(&joined, text);
            for c in &chunks {
                assert!(
                    !c.contains('\u{FFFD}'),
                    "chunk {c:?} of {text:?} has U+FFFD"
                );
            }
        }
        // An emoji really is split across byte-level tokens here.
        let ids = tok.encode("😀", false).unwrap();
        assert!(ids.len() > 1, "expected a multi-token emoji, got {ids:?}");
        let mut s = tok.stream(false);
        assert_eq!(s.push(ids[0]).unwrap(), None);
    }

    // ---- tests that need no model file: a tiny synthetic byte-level vocab ----

    /// 256 byte tokens, a few merges, two control tokens and one user-defined.
    fn tiny() -> TestVocab {
        let mut tokens: Vec<String> = vec!["<|bos|>".into(), "<|eos|>".into()];
        let mut types = vec![3, 3];
        for b in 0..=255u8 {
            tokens.push(byte_level_char(b).to_string());
            types.push(1);
        }
        let merges: Vec<String> = vec![
            "h e".into(),
            "l l".into(),
            "he ll".into(),
            "hell o".into(),
            "Ġ w".into(),
        ];
        for m in &merges {
            tokens.push(m.replace(' ', ""));
            types.push(1);
        }
        tokens.push("<tool>".into());
        types.push(4);
        TestVocab {
            model: "gpt2".into(),
            pre: Some("smollm".into()),
            tokens,
            merges,
            token_types: Some(types),
            bos: Some(0),
            eos: Some(1),
            add_bos: true,
            chat_template: None,
        }
    }

    #[test]
    fn tiny_vocab_encode_decode() {
        let v = tiny();
        let tok = Tokenizer::from_gguf(&v.as_vocab()).unwrap();
        let id = |s: &str| v.tokens.iter().position(|t| t == s).unwrap() as u32;
        let ids = tok.encode("hello w42", false).unwrap();
        assert_eq!(ids, [0, id("hello"), id("Ġw"), id("4"), id("2")]);
        assert_eq!(tok.decode(&ids, false).unwrap(), "<|bos|>hello w42");
        assert_eq!(tok.decode(&ids, true).unwrap(), "hello w42");
        // Special tokens: one id with parse_special, plain text without.
        assert_eq!(tok.encode("<|eos|>", true).unwrap(), [0, 1]);
        let plain = tok.encode("<|eos|>", false).unwrap();
        assert_eq!(plain.len(), 1 + "<|eos|>".len());
        // User-defined tokens match either way, and are not special.
        assert_eq!(tok.encode("<tool>", false).unwrap(), [0, id("<tool>")]);
        assert!(!tok.is_special(id("<tool>")));
        assert_eq!(tok.decode(&[id("<tool>")], true).unwrap(), "<tool>");
        // Every byte round-trips, including a 4-byte character split in 4 ids.
        for text in HARD_STRINGS {
            let ids = tok.encode(text, false).unwrap();
            assert_eq!(&tok.decode(&ids[1..], false).unwrap(), text);
            let (joined, chunks) = stream_all(&tok, &ids[1..], false);
            assert_eq!(&joined, text);
            assert!(chunks.iter().all(|c| !c.contains('\u{FFFD}')));
        }
    }

    #[test]
    fn tiny_vocab_stream_holds_partial_chars() {
        let v = tiny();
        let tok = Tokenizer::from_gguf(&v.as_vocab()).unwrap();
        let ids = tok.encode("a😀b", false).unwrap(); // BOS, a, 4 bytes, b
        assert_eq!(ids.len(), 7);
        let mut s = tok.stream(true);
        assert_eq!(s.push(ids[0]).unwrap(), None); // BOS skipped
        assert_eq!(s.push(ids[1]).unwrap().as_deref(), Some("a"));
        assert_eq!(s.push(ids[2]).unwrap(), None);
        assert_eq!(s.push(ids[3]).unwrap(), None);
        assert_eq!(s.push(ids[4]).unwrap(), None);
        assert_eq!(s.push(ids[5]).unwrap().as_deref(), Some("😀"));
        assert_eq!(s.push(ids[6]).unwrap().as_deref(), Some("b"));
        assert_eq!(s.flush().unwrap(), None);
        // A dangling partial character is flushed lossily.
        assert_eq!(s.push(ids[2]).unwrap(), None);
        assert_eq!(s.flush().unwrap().as_deref(), Some("\u{FFFD}"));
        // An invalid byte followed by text: same result as one-shot decode.
        let stray = ids[5]; // a continuation byte on its own
        let seq = [stray, ids[1]];
        let (joined, _) = stream_all(&tok, &seq, false);
        assert_eq!(joined, tok.decode(&seq, false).unwrap());
        assert_eq!(joined, "\u{FFFD}a");
        assert!(matches!(
            s.push(9999),
            Err(TokenizerError::UnknownId { .. })
        ));
    }

    #[test]
    fn tokenizer_is_send_and_sync() {
        fn assert_send_sync<T: Send + Sync>() {}
        assert_send_sync::<Tokenizer>();
        assert_send_sync::<DecodeStream<'static>>();
    }

    #[test]
    fn unsupported_and_invalid_vocabs() {
        let mut v = tiny();
        v.model = "bert".into();
        let err = Tokenizer::from_gguf(&v.as_vocab()).unwrap_err();
        assert!(matches!(err, TokenizerError::Unsupported { .. }));
        assert!(err.to_string().contains("\"bert\""), "{err}");

        let mut v = tiny();
        v.pre = Some("no-such-pre".into());
        let err = Tokenizer::from_gguf(&v.as_vocab()).unwrap_err();
        assert!(err.to_string().contains("\"no-such-pre\""), "{err}");

        let mut v = tiny();
        v.bos = Some(100_000);
        assert!(matches!(
            Tokenizer::from_gguf(&v.as_vocab()),
            Err(TokenizerError::InvalidVocab(_))
        ));

        let mut v = tiny();
        v.bos = None;
        assert!(matches!(
            Tokenizer::from_gguf(&v.as_vocab()),
            Err(TokenizerError::InvalidVocab(_))
        ));

        let mut v = tiny();
        v.token_types.as_mut().unwrap().pop();
        assert!(matches!(
            Tokenizer::from_gguf(&v.as_vocab()),
            Err(TokenizerError::InvalidVocab(_))
        ));

        let err = Tokenizer::from_file(Path::new("/nonexistent/tokenizer.json")).unwrap_err();
        assert!(matches!(err, TokenizerError::Io { .. }), "{err}");
    }

    #[test]
    fn every_supported_pre_tokenizer_builds() {
        for spec in PRE_TOKENIZERS {
            for &name in spec.names {
                let mut v = tiny();
                v.pre = Some(name.to_owned());
                let tok = Tokenizer::from_gguf(&v.as_vocab())
                    .unwrap_or_else(|e| panic!("pre {name}: {e}"));
                for text in HARD_STRINGS {
                    let ids = tok
                        .encode(text, false)
                        .unwrap_or_else(|e| panic!("pre {name}: {e}"));
                    assert_eq!(&tok.decode(&ids[1..], false).unwrap(), text, "pre {name}");
                }
            }
        }
        let mut v = tiny();
        v.pre = None; // absent -> llama.cpp "default"
        Tokenizer::from_gguf(&v.as_vocab()).unwrap();
    }

    #[test]
    fn from_file_round_trip() {
        // Serialize the tiny GGUF tokenizer to tokenizer.json and load it back.
        let v = tiny();
        let tok = Tokenizer::from_gguf(&v.as_vocab()).unwrap();
        let dir = std::env::temp_dir().join(format!("flotilla-tok-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("tokenizer.json");
        let Encoder::Library { with_special, .. } = &tok.enc else {
            panic!("a byte-level vocabulary goes through the library");
        };
        with_special.save(&path, false).unwrap();
        std::fs::write(
            dir.join("tokenizer_config.json"),
            r#"{"bos_token": "<|bos|>", "eos_token": {"content": "<|eos|>"}, "add_bos_token": false}"#,
        )
        .unwrap();
        let loaded = Tokenizer::from_file(&path).unwrap();
        assert_eq!(loaded.bos(), Some(0));
        assert_eq!(loaded.eos(), Some(1));
        assert!(!loaded.add_bos());
        assert!(loaded.is_special(1));
        for text in HARD_STRINGS {
            let a = tok.encode(text, true).unwrap();
            let b = loaded.encode(text, true).unwrap();
            assert_eq!(&a[1..], &b[..]);
            assert_eq!(&loaded.decode(&b, false).unwrap(), text);
            assert_eq!(&stream_all(&loaded, &b, false).0, text);
        }
        std::fs::remove_dir_all(&dir).ok();
    }
}
