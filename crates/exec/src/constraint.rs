//! Constrained decoding at the seam: what a request's output must match
//! (OpenAI's `response_format`, a regex or Lark grammar), and the two
//! traits through which the Scheduler keeps one matcher per sequence
//! without depending on the grammar engine (`flotilla-grammar` implements
//! them with llguidance). The executor sees only the result: a bitmask of
//! the tokens allowed at a sequence's next sample (`SeqInput::allow`).

/// What a request's output must match. It crosses nodes inside the
/// request (rkyv); a node that takes the request over rebuilds the matcher
/// from it and the tokens generated so far.
#[derive(Clone, Debug, PartialEq, rkyv::Archive, rkyv::Serialize, rkyv::Deserialize)]
pub enum Constraint {
    /// Any JSON object (`response_format: {"type": "json_object"}`).
    JsonObject,
    /// A JSON value valid under this JSON Schema (its text).
    JsonSchema(String),
    /// Text matching this regular expression, whole.
    Regex(String),
    /// Text in this grammar (Lark syntax, llguidance's dialect).
    Lark(String),
}

impl Constraint {
    /// Short name for errors and metrics.
    pub fn kind(&self) -> &'static str {
        match self {
            Constraint::JsonObject => "json_object",
            Constraint::JsonSchema(_) => "json_schema",
            Constraint::Regex(_) => "regex",
            Constraint::Lark(_) => "grammar",
        }
    }
}

/// Compiles constraints for one vocabulary; shared by every sequence of an
/// engine.
pub trait ConstraintCompiler: Send + Sync + std::fmt::Debug {
    /// A fresh matcher, or why the constraint is unusable (a bad schema,
    /// regex or grammar), in words for the client.
    fn compile(&self, c: &Constraint) -> Result<Box<dyn TokenConstraint>, String>;
}

/// One sequence's matcher: which tokens may come next, and the tokens that
/// came.
pub trait TokenConstraint: Send + std::fmt::Debug {
    /// Writes the tokens allowed next as a bitmask into `words` (token `t`
    /// is bit `t % 32` of `words[t / 32]`; at least `vocab.div_ceil(32)`
    /// words; tokens past the end are not allowed). Once the output is
    /// complete only end-of-sequence is allowed. An internal failure allows
    /// only end-of-sequence and is returned by the next [`commit`](Self::commit).
    fn allowed(&mut self, words: &mut Vec<u32>);
    /// Takes the token sampled. `Ok(true)`: the output is complete and the
    /// sequence should end; `Err`: the matcher failed (the request fails).
    fn commit(&mut self, token: u32) -> Result<bool, String>;
}

/// Whether `token` is allowed by the bitmask `words`.
pub fn allowed(words: &[u32], token: u32) -> bool {
    words
        .get(token as usize / 32)
        .is_some_and(|w| w >> (token % 32) & 1 == 1)
}
