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

/// A sequence's matcher, shared between the Scheduler (which commits the
/// tokens sampled) and the plan in flight (whose mask it computes).
pub type SharedConstraint = std::sync::Arc<std::sync::Mutex<Box<dyn TokenConstraint>>>;

/// One sample's mask, computed off the step's critical path: the plan
/// carries it unfilled, the Scheduler's actor fills it while the executor
/// runs the forward pass ([`MaskCell::compute`]), and the executor reads it
/// only when it samples ([`MaskCell::words`]), computing it then if nobody
/// has. Either way the matcher is asked once, after the token before was
/// committed and before this one is.
#[derive(Debug)]
pub struct MaskCell {
    state: std::sync::Mutex<MaskState>,
}

/// The same cell, not the same words: comparing masks would compute them.
impl PartialEq for MaskCell {
    fn eq(&self, other: &MaskCell) -> bool {
        std::ptr::eq(self, other)
    }
}

#[derive(Debug)]
enum MaskState {
    Pending(SharedConstraint),
    Ready(Vec<u32>),
}

/// The allowed tokens of a [`MaskCell`], a bitmask (see
/// [`TokenConstraint::allowed`]).
pub struct MaskWords<'a>(std::sync::MutexGuard<'a, MaskState>);

impl std::ops::Deref for MaskWords<'_> {
    type Target = [u32];
    fn deref(&self) -> &[u32] {
        match &*self.0 {
            MaskState::Ready(w) => w,
            MaskState::Pending(_) => unreachable!("a mask is computed before it is read"),
        }
    }
}

fn lock<T>(m: &std::sync::Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    // A matcher that panicked mid-call is still the best state there is;
    // its next commit reports any failure.
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

impl MaskCell {
    /// `c` shared by a sequence and the masks of its plans.
    pub fn share(c: Box<dyn TokenConstraint>) -> SharedConstraint {
        std::sync::Arc::new(std::sync::Mutex::new(c))
    }

    /// Commits `token` to a shared matcher (see [`TokenConstraint::commit`]).
    pub fn commit(m: &SharedConstraint, token: u32) -> Result<bool, String> {
        lock(m).commit(token)
    }

    /// A mask still to be computed from `m`'s current state.
    pub fn pending(m: SharedConstraint) -> MaskCell {
        MaskCell {
            state: std::sync::Mutex::new(MaskState::Pending(m)),
        }
    }

    /// Computes the mask unless it is known; true when this call did.
    pub fn compute(&self) -> bool {
        let mut st = lock(&self.state);
        let MaskState::Pending(m) = &*st else {
            return false;
        };
        let mut words = Vec::new();
        lock(m).allowed(&mut words);
        *st = MaskState::Ready(words);
        true
    }

    /// The mask, computed now if it was not yet.
    pub fn words(&self) -> MaskWords<'_> {
        self.compute();
        MaskWords(lock(&self.state))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::{Arc, Mutex};

    /// Allows token `n`, where `n` counts its commits; counts its masks.
    #[derive(Debug)]
    struct Counting(Arc<AtomicUsize>, u32);

    impl TokenConstraint for Counting {
        fn allowed(&mut self, words: &mut Vec<u32>) {
            self.0.fetch_add(1, Ordering::SeqCst);
            words.clear();
            words.resize(self.1 as usize / 32 + 1, 0);
            words[self.1 as usize / 32] = 1 << (self.1 % 32);
        }
        fn commit(&mut self, _token: u32) -> Result<bool, String> {
            self.1 += 1;
            Ok(false)
        }
    }

    #[test]
    fn a_mask_is_computed_once_by_whoever_comes_first() {
        let asked = Arc::new(AtomicUsize::new(0));
        let m: SharedConstraint = Arc::new(Mutex::new(Box::new(Counting(asked.clone(), 0))));
        // Filled ahead (the actor while the step runs): the reader asks nothing.
        let cell = MaskCell::pending(m.clone());
        assert!(cell.compute());
        assert!(!cell.compute());
        assert!(allowed(&cell.words(), 0) && !allowed(&cell.words(), 1));
        assert_eq!(asked.load(Ordering::SeqCst), 1);
        // Not filled ahead: the reader computes it, from the state after
        // the commit.
        lock(&m).commit(0).unwrap();
        let cell = MaskCell::pending(m.clone());
        assert!(allowed(&cell.words(), 1) && !allowed(&cell.words(), 0));
        assert_eq!(asked.load(Ordering::SeqCst), 2);
        assert!(!cell.compute());
    }
}
