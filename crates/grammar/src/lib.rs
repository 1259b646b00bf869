//! Constrained decoding through llguidance: [`LlgCompiler`] turns a
//! request's [`Constraint`] (JSON Schema, any JSON object, a regex, a Lark
//! grammar) into a matcher over one vocabulary, and each matcher gives the
//! Scheduler the bitmask of tokens allowed at a sequence's next sample.
//!
//! The vocabulary is the tokenizer's own bytes per id (every GGUF tokenizer
//! Flotilla reads has them); control tokens are marked special so that no
//! text can spell them, and only the model's end-of-sequence token may end
//! a constrained output.

use std::sync::Arc;

use flotilla_exec::{Constraint, ConstraintCompiler, TokenConstraint};
use flotilla_text::tokenizer::Tokenizer;
use llguidance::api::TopLevelGrammar;
use llguidance::toktrie::{ApproximateTokEnv, TokEnv, TokRxInfo, TokTrie};
use llguidance::{Matcher, ParserFactory};
use serde_json::Value;

/// Longest constraint text accepted (a schema, regex or grammar), bytes:
/// compiling is work done before the request is queued.
pub const CONSTRAINT_BYTES_MAX: usize = 64 * 1024;

/// Compiles constraints for one tokenizer. Cheap to share (`Arc`).
pub struct LlgCompiler {
    factory: ParserFactory,
    vocab: usize,
    eos: u32,
}

impl std::fmt::Debug for LlgCompiler {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LlgCompiler")
            .field("vocab", &self.vocab)
            .field("eos", &self.eos)
            .finish_non_exhaustive()
    }
}

impl LlgCompiler {
    /// Over `tok`'s vocabulary, with `eos` the token that ends a
    /// constrained output (the model's end-of-turn or end-of-text token).
    pub fn new(tok: &Tokenizer, eos: u32) -> Result<LlgCompiler, String> {
        let n = tok.vocab_size();
        if eos as usize >= n {
            return Err(format!(
                "end-of-sequence token {eos} is outside the vocabulary of {n}"
            ));
        }
        let words: Vec<Vec<u8>> = (0..n as u32)
            .map(|id| {
                let bytes = tok.token_bytes(id).unwrap_or(&[]);
                if tok.is_special(id) || id == eos || bytes.is_empty() {
                    // Special: no text spells it.
                    let mut w = vec![TokTrie::SPECIAL_TOKEN_MARKER];
                    if bytes.is_empty() {
                        w.extend_from_slice(format!("<[{id}]>").as_bytes());
                    } else {
                        w.extend_from_slice(bytes);
                    }
                    w
                } else {
                    bytes.to_vec()
                }
            })
            .collect();
        let info = TokRxInfo::new(n as u32, eos);
        let trie = TokTrie::from(&info, &words);
        let env: TokEnv = Arc::new(ApproximateTokEnv::new(trie));
        let mut factory = ParserFactory::new_simple(&env).map_err(|e| e.to_string())?;
        factory.quiet();
        Ok(LlgCompiler {
            factory,
            vocab: n,
            eos,
        })
    }

    /// Tokens of the vocabulary.
    pub fn vocab_size(&self) -> usize {
        self.vocab
    }
}

/// The grammar of `c`. JSON output is compact (no free whitespace between
/// tokens, so a small model cannot wander into endless newlines) unless
/// the schema's own `x-guidance` options say otherwise.
fn grammar(c: &Constraint) -> Result<TopLevelGrammar, String> {
    let schema = |mut v: Value| {
        if let Value::Object(o) = &mut v {
            o.entry("x-guidance")
                .or_insert_with(|| serde_json::json!({"whitespace_flexible": false}));
        }
        TopLevelGrammar::from_json_schema(v)
    };
    let text_len = match c {
        Constraint::JsonObject => 0,
        Constraint::JsonSchema(s) | Constraint::Regex(s) | Constraint::Lark(s) => s.len(),
    };
    if text_len > CONSTRAINT_BYTES_MAX {
        return Err(format!(
            "the {} is {text_len} bytes; at most {CONSTRAINT_BYTES_MAX} are accepted",
            c.kind()
        ));
    }
    Ok(match c {
        Constraint::JsonObject => schema(serde_json::json!({"type": "object"})),
        Constraint::JsonSchema(s) => {
            let v: Value =
                serde_json::from_str(s).map_err(|e| format!("the schema is not JSON: {e}"))?;
            if !(v.is_object() || v.is_boolean()) {
                return Err("a JSON Schema must be an object or a boolean".into());
            }
            schema(v)
        }
        Constraint::Regex(r) => TopLevelGrammar::from_regex(r),
        Constraint::Lark(g) => TopLevelGrammar::from_lark(g.clone()),
    })
}

impl ConstraintCompiler for LlgCompiler {
    fn compile(&self, c: &Constraint) -> Result<Box<dyn TokenConstraint>, String> {
        let parser = self
            .factory
            .create_parser(grammar(c)?)
            .map_err(|e| e.to_string())?;
        let m = Matcher::new(Ok(parser));
        if let Some(e) = m.get_error() {
            return Err(e);
        }
        Ok(Box::new(LlgConstraint {
            m,
            eos: self.eos,
            failed: None,
        }))
    }
}

/// One sequence's matcher.
struct LlgConstraint {
    m: Matcher,
    eos: u32,
    /// A failure met while computing a mask, returned by the next commit.
    failed: Option<String>,
}

impl std::fmt::Debug for LlgConstraint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LlgConstraint")
            .field("stopped", &self.m.is_stopped())
            .field("failed", &self.failed)
            .finish_non_exhaustive()
    }
}

impl TokenConstraint for LlgConstraint {
    fn allowed(&mut self, words: &mut Vec<u32>) {
        words.clear();
        match self.m.compute_mask_or_eos() {
            Ok(v) => words.extend_from_slice(v.as_slice()),
            Err(e) => {
                self.failed.get_or_insert(e.to_string());
                let eos = self.eos as usize;
                words.resize(eos / 32 + 1, 0);
                words[eos / 32] = 1 << (eos % 32);
            }
        }
    }

    fn commit(&mut self, token: u32) -> Result<bool, String> {
        if let Some(e) = self.failed.take() {
            return Err(e);
        }
        if self.m.is_stopped() {
            // Only end-of-sequence was allowed; whatever ended it, done.
            return Ok(true);
        }
        self.m.consume_token(token).map_err(|e| e.to_string())?;
        Ok(self.m.is_stopped())
    }

    /// Takes the draft tokens in turn while each is allowed, a mask per
    /// position, then takes them back (llguidance's rollback). A failure
    /// met at a draft position (an internal error of the matcher, which
    /// leaves it failed) fails the request at its next commit, as it would
    /// have had those tokens been sampled.
    fn draft_allowed(&mut self, draft: &[u32], rows: &mut Vec<Vec<u32>>) {
        rows.clear();
        let mut taken = 0;
        loop {
            let mut words = Vec::new();
            self.allowed(&mut words);
            let next = draft.get(taken).copied();
            let go = next.is_some_and(|t| flotilla_exec::constraint::allowed(&words, t))
                && self.failed.is_none()
                && !self.m.is_stopped();
            rows.push(words);
            let Some(t) = next.filter(|_| go) else {
                break;
            };
            if let Err(e) = self.m.consume_token(t) {
                self.failed.get_or_insert(e.to_string());
                break;
            }
            taken += 1;
            if self.m.is_stopped() {
                // The draft completes the output: nothing is sampled after it.
                break;
            }
        }
        if taken > 0
            && let Err(e) = self.m.rollback(taken)
        {
            self.failed.get_or_insert(e.to_string());
        }
    }

    fn forced(&mut self, max: usize, out: &mut Vec<u32>) {
        out.clear();
        if max == 0 || self.failed.is_some() || self.m.is_stopped() {
            return;
        }
        // The forced bytes, spelled with the longest tokens (the model
        // usually spells them so; a draft need not be right, only likely).
        let bytes = self.m.compute_ff_bytes();
        if bytes.is_empty() {
            return;
        }
        if let Ok(env) = self.m.tok_env() {
            let toks = env.tok_trie().greedy_tokenize(&bytes);
            out.extend(toks.into_iter().take(max));
        }
    }
}

/// The compiler for a model's text side: constrained outputs end with the
/// tokenizer's end-of-sequence token when it is one of the model's stop
/// tokens, else with the first stop token.
pub fn compiler_for(text: &flotilla_text::TextSide) -> Result<Arc<dyn ConstraintCompiler>, String> {
    let eos = text
        .tokenizer
        .eos()
        .filter(|e| text.stop_tokens.contains(e))
        .or_else(|| text.stop_tokens.first().copied())
        .ok_or("the model has no stop token to end a constrained output")?;
    Ok(Arc::new(LlgCompiler::new(&text.tokenizer, eos)?))
}
