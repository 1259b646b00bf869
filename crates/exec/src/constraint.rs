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

    /// The masks of a draft's verify (speculative decoding), one per
    /// position while the draft holds, into `rows`: `rows[0]` is
    /// [`allowed`](Self::allowed) now, `rows[r]` what would be allowed
    /// after `draft[..r]`, for each `r` whose draft tokens are all allowed
    /// in turn (so at most `draft.len() + 1` rows, and none past a draft
    /// token that completes the output or is refused). The matcher is left
    /// as it was. The default gives the first row only (a matcher that
    /// cannot take tokens back verifies no draft: the first sample is the
    /// output).
    fn draft_allowed(&mut self, draft: &[u32], rows: &mut Vec<Vec<u32>>) {
        let _ = draft;
        rows.truncate(1);
        rows.resize_with(1, Vec::new);
        self.allowed(&mut rows[0]);
    }

    /// Tokens the grammar forces next, whatever is sampled (a JSON key, the
    /// punctuation between fields), up to `max`, into `out` (cleared
    /// first): a draft that is accepted whenever its positions are
    /// sampled. The matcher is left as it was. The default knows none.
    fn forced(&mut self, max: usize, out: &mut Vec<u32>) {
        let _ = max;
        out.clear();
    }
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

/// Tokens the matcher `m` forces next (see [`TokenConstraint::forced`]).
pub fn forced(m: &SharedConstraint, max: usize, out: &mut Vec<u32>) {
    lock(m).forced(max, out);
}

/// One sample's mask (or a draft's verify's masks, one per position),
/// computed off the step's critical path: the plan
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
    /// The matcher, and the draft tokens verified after the sample (empty
    /// for a plain sample).
    Pending(SharedConstraint, Vec<u32>),
    /// One mask per position, at least one.
    Ready(Vec<Vec<u32>>),
}

/// The allowed tokens of a [`MaskCell`], a bitmask (see
/// [`TokenConstraint::allowed`]): the first position's, and with
/// [`MaskWords::row`] each verified draft position's.
pub struct MaskWords<'a>(std::sync::MutexGuard<'a, MaskState>);

impl MaskWords<'_> {
    /// The mask of the `r`-th sampled position (0: the first); `None` for a
    /// draft position after a token the grammar refuses or that completes
    /// the output.
    pub fn row(&self, r: usize) -> Option<&[u32]> {
        match &*self.0 {
            MaskState::Ready(w) => w.get(r).map(Vec::as_slice),
            MaskState::Pending(..) => unreachable!("a mask is computed before it is read"),
        }
    }
}

impl std::ops::Deref for MaskWords<'_> {
    type Target = [u32];
    fn deref(&self) -> &[u32] {
        self.row(0).expect("a computed mask has a first row")
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
        MaskCell::pending_draft(m, Vec::new())
    }

    /// The masks of a verify of `draft` still to be computed from `m`'s
    /// current state (see [`TokenConstraint::draft_allowed`]).
    pub fn pending_draft(m: SharedConstraint, draft: Vec<u32>) -> MaskCell {
        MaskCell {
            state: std::sync::Mutex::new(MaskState::Pending(m, draft)),
        }
    }

    /// Computes the mask unless it is known; true when this call did.
    pub fn compute(&self) -> bool {
        let mut st = lock(&self.state);
        let MaskState::Pending(m, draft) = &*st else {
            return false;
        };
        let mut rows = vec![Vec::new()];
        if draft.is_empty() {
            lock(m).allowed(&mut rows[0]);
        } else {
            lock(m).draft_allowed(draft, &mut rows);
            if rows.is_empty() {
                // A matcher that gave nothing allows nothing.
                rows.push(Vec::new());
            }
            rows.truncate(draft.len() + 1);
        }
        *st = MaskState::Ready(rows);
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
    use crate::{
        OutputKind, RowDraw, Sampled, SamplingParams, SeqInput, SeqOutput, sample_outputs,
    };
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
        // A draft's masks from a matcher that cannot take tokens back: the
        // first row only.
        let cell = MaskCell::pending_draft(m.clone(), vec![2, 3]);
        let w = cell.words();
        assert!(allowed(w.row(0).unwrap(), 1));
        assert!(w.row(1).is_none());
    }

    /// Allows exactly the token after the last one taken (starting at 0),
    /// and can take tokens back; completes after token `end`.
    #[derive(Debug)]
    struct Ladder {
        taken: Vec<u32>,
        end: u32,
    }

    impl Ladder {
        fn next(&self) -> u32 {
            self.taken.last().map_or(0, |t| t + 1)
        }
    }

    impl TokenConstraint for Ladder {
        fn allowed(&mut self, words: &mut Vec<u32>) {
            words.clear();
            words.resize(2, 0);
            let t = self.next();
            words[t as usize / 32] |= 1 << (t % 32);
        }
        fn commit(&mut self, token: u32) -> Result<bool, String> {
            if token != self.next() {
                return Err(format!("{token} refused"));
            }
            self.taken.push(token);
            Ok(token == self.end)
        }
        fn draft_allowed(&mut self, draft: &[u32], rows: &mut Vec<Vec<u32>>) {
            rows.clear();
            let before = self.taken.len();
            for r in 0..=draft.len() {
                let mut w = Vec::new();
                self.allowed(&mut w);
                rows.push(w);
                if r == draft.len() || !allowed(&rows[r], draft[r]) {
                    break;
                }
                if self.commit(draft[r]) != Ok(false) {
                    break;
                }
            }
            self.taken.truncate(before);
        }
    }

    fn verify<'a>(
        tokens: &'a [u32],
        draft: usize,
        bias: &'a [(u32, f32)],
        draft_bias: &'a [Vec<(u32, f32)>],
        allow: Option<&'a MaskCell>,
    ) -> SeqInput<'a> {
        SeqInput {
            tokens,
            start_pos: 10,
            block_table: &[0],
            output: OutputKind::Verify {
                params: SamplingParams::default(),
                draft,
            },
            bias,
            draft_bias,
            allow,
        }
    }

    /// Draws the smallest allowed token, plus the row's bias on token 0
    /// rounded (so a bias can change the draw); records what it saw.
    /// What a draw saw: row, position, bias.
    type Seen = (usize, u64, Vec<(u32, f32)>);

    fn draw(seen: &mut Vec<Seen>) -> impl FnMut(RowDraw<'_>) -> Sampled {
        move |d| {
            seen.push((d.row, d.position, d.bias.to_vec()));
            let token = match d.allow {
                Some(w) => (0..64).find(|&t| allowed(w, t)).unwrap_or(63),
                None => d.bias.first().map_or(0, |b| b.1 as u32),
            };
            Sampled {
                token,
                logprob: 0.0,
                top: Vec::new(),
            }
        }
    }

    #[test]
    fn a_verify_samples_each_row_with_its_own_mask_and_bias() {
        let m: SharedConstraint = Arc::new(Mutex::new(Box::new(Ladder {
            taken: vec![0, 1],
            end: 40,
        })));
        // The grammar wants 2, 3, 4, ...; the draft guesses 2, 3, 9, 5.
        let cell = MaskCell::pending_draft(m.clone(), vec![2, 3, 9, 5]);
        assert!(cell.compute());
        {
            let w = cell.words();
            // Rows for "nothing", "2", "2 3"; none after the refused 9.
            assert!(allowed(w.row(0).unwrap(), 2));
            assert!(allowed(w.row(1).unwrap(), 3));
            assert!(allowed(w.row(2).unwrap(), 4));
            assert!(w.row(3).is_none());
        }
        // The matcher is as it was.
        assert_eq!(MaskCell::commit(&m, 2), Ok(false));
        let tokens = [1, 2, 3, 9, 5];
        let q = verify(&tokens, 4, &[], &[], Some(&cell));
        let mut o = SeqOutput::default();
        let mut seen = Vec::new();
        sample_outputs(&q, &mut o, draw(&mut seen));
        let got: Vec<u32> = o.tokens().map(|s| s.token).collect();
        // 2 and 3 accepted, then 4 (the grammar's) where the draft said 9.
        assert_eq!(got, vec![2, 3, 4]);
        assert_eq!(o.accepted.len(), 2);
        assert_eq!(
            seen.iter().map(|s| (s.0, s.1)).collect::<Vec<_>>(),
            vec![(0, 11), (1, 12), (2, 13)]
        );

        // A draft that completes the output: no row after its last token,
        // so that token, accepted, is the sample.
        let m: SharedConstraint = Arc::new(Mutex::new(Box::new(Ladder {
            taken: vec![0],
            end: 1,
        })));
        let cell = MaskCell::pending_draft(m, vec![1, 2]);
        let tokens = [0, 1, 2];
        let q = verify(&tokens, 2, &[], &[], Some(&cell));
        let mut o = SeqOutput::default();
        sample_outputs(&q, &mut o, draw(&mut Vec::new()));
        assert!(o.accepted.is_empty());
        assert_eq!(o.sampled.as_ref().map(|s| s.token), Some(1));

        // Per-row biases: row r draws the token its own bias names.
        let bias = [(0, 7.0)];
        let rows = [vec![(0, 8.0)], vec![(0, 5.0)]];
        let tokens = [1, 7, 8];
        let q = verify(&tokens, 2, &bias, &rows, None);
        let mut o = SeqOutput::default();
        let mut seen = Vec::new();
        sample_outputs(&q, &mut o, draw(&mut seen));
        assert_eq!(
            o.tokens().map(|s| s.token).collect::<Vec<_>>(),
            vec![7, 8, 5]
        );
        assert_eq!(seen[2].2, vec![(0, 5.0)]);
        // Without per-row biases every row takes the first's.
        let q = verify(&tokens, 2, &bias, &[], None);
        let mut o = SeqOutput::default();
        sample_outputs(&q, &mut o, draw(&mut Vec::new()));
        assert_eq!(o.tokens().map(|s| s.token).collect::<Vec<_>>(), vec![7, 7]);
    }
}
