//! The executor trait: the one interface between the GpuWorker actor and a
//! backend (the CPU forward pass here; CUDA and the simulator's cost model
//! later). It speaks of tokens, positions, block ids and sampling only: no
//! CPU-specific type crosses it.

use crate::sampling::{Sampled, SamplingParams};

/// Element type of the paged KV cache. It owns everything that follows
/// from the choice: the bytes of a token's head row (values plus scales),
/// of a block, and the name flags and reports use.
///
/// `Int8` stores each run of [`KvDtype::INT8_GROUP`] values as signed bytes
/// with one f16 scale (`value = scale * q`, `scale = max|x| / 127`), the
/// granularity of llama.cpp's `q8_0`: a head row of 64 values carries two
/// scales, so an outlier channel costs precision only to its 31 neighbours,
/// and the row costs 1.0625 bytes per value (1.88x the blocks of f16 in the
/// same memory). In a block, each (layer, K|V, kv head) run of
/// `block_size` rows holds the values (`[slot][head_dim]` bytes) and then
/// their scales (`[slot][head_dim / 32]` f16).
#[derive(
    Clone,
    Copy,
    Debug,
    Default,
    PartialEq,
    Eq,
    Hash,
    rkyv::Archive,
    rkyv::Serialize,
    rkyv::Deserialize,
)]
pub enum KvDtype {
    /// 32-bit float: exact, twice the memory.
    F32,
    /// IEEE half (the default, as in llama.cpp and vLLM).
    #[default]
    F16,
    /// Signed 8-bit values with an f16 scale per 32 (llama.cpp's `q8_0`).
    Int8,
}

impl KvDtype {
    /// Values that share one scale in [`KvDtype::Int8`].
    pub const INT8_GROUP: usize = 32;

    /// Every dtype, in the order flags list them.
    pub const ALL: [KvDtype; 3] = [KvDtype::F16, KvDtype::F32, KvDtype::Int8];

    /// Bytes of one token's row of `head_dim` values of one head (K or V),
    /// scales included.
    pub fn row_bytes(self, head_dim: usize) -> usize {
        match self {
            KvDtype::F32 => 4 * head_dim,
            KvDtype::F16 => 2 * head_dim,
            KvDtype::Int8 => head_dim + 2 * head_dim.div_ceil(Self::INT8_GROUP),
        }
    }

    /// Bytes of one block: `n_layer` layers of K and V for `n_head_kv`
    /// heads of `block_size` rows.
    pub fn bytes_per_block(
        self,
        n_layer: usize,
        n_head_kv: usize,
        head_dim: usize,
        block_size: usize,
    ) -> usize {
        n_layer * 2 * n_head_kv * block_size * self.row_bytes(head_dim)
    }

    /// Whether a head of `head_dim` values can be stored in this dtype.
    pub fn check_head_dim(self, head_dim: usize) -> Result<(), String> {
        match self {
            KvDtype::Int8 if !head_dim.is_multiple_of(Self::INT8_GROUP) => Err(format!(
                "KV cache dtype int8 needs a head dimension that is a multiple of {} \
                 (this model has {head_dim})",
                Self::INT8_GROUP
            )),
            _ => Ok(()),
        }
    }

    /// The name flags, config files, `/ready` and `/metrics` use.
    pub fn name(self) -> &'static str {
        match self {
            KvDtype::F32 => "f32",
            KvDtype::F16 => "f16",
            KvDtype::Int8 => "int8",
        }
    }

    /// Parses `f32`, `f16` / `auto`, `int8` / `q8_0`.
    pub fn parse(s: &str) -> Result<KvDtype, String> {
        match s {
            "f32" | "float32" => Ok(KvDtype::F32),
            "f16" | "float16" | "auto" => Ok(KvDtype::F16),
            "int8" | "q8_0" | "i8" => Ok(KvDtype::Int8),
            other => Err(format!(
                "unknown KV cache dtype '{other}' (expected f16, f32 or int8)"
            )),
        }
    }
}

impl std::fmt::Display for KvDtype {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// What a backend runs: the shape facts a scheduler and router need.
#[derive(Clone, Debug, PartialEq)]
pub struct ModelSpec {
    /// Model name for `/v1/models`.
    pub name: String,
    /// Architecture, as the GGUF's `general.architecture` names it
    /// (`llama`, `qwen2`, `gemma3`, ...).
    pub arch: String,
    /// Transformer blocks.
    pub n_layer: usize,
    /// Residual width.
    pub n_embd: usize,
    /// Query heads.
    pub n_head: usize,
    /// KV heads.
    pub n_head_kv: usize,
    /// Head dimension.
    pub head_dim: usize,
    /// Vocabulary size.
    pub vocab: usize,
    /// Longest sequence (prompt + output) in tokens.
    pub ctx_len: usize,
    /// Bytes of weights held by the backend.
    pub weight_bytes: usize,
}

/// Shape of the paged KV cache a backend holds.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct KvSpec {
    /// Tokens per block.
    pub block_size: usize,
    /// Physical blocks.
    pub num_blocks: usize,
    /// Element type.
    pub dtype: KvDtype,
    /// Bytes of one block (all layers, K and V).
    pub bytes_per_block: usize,
}

/// What a sequence wants back from a step.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum OutputKind {
    /// Nothing: a prefill chunk that does not end the prompt.
    None,
    /// The logits of the last position.
    Logits,
    /// A token sampled from the last position's logits.
    Sample(SamplingParams),
    /// Speculative decoding: the last `draft` tokens of the input are a
    /// guess at what comes next, not yet accepted. The backend samples at
    /// each of the last `draft + 1` positions in order, as a plain decode
    /// would (the same draw for the same seed and position), and stops at
    /// the first sample that differs from the draft token it predicts:
    /// the samples that matched are [`SeqOutput::accepted`], the one that
    /// differed (or followed the whole draft) is [`SeqOutput::sampled`].
    /// Because a matching draft token is exactly what the sequence would
    /// have sampled, the output is the same token for token as without the
    /// draft, greedy or not. Each position samples with its own bias
    /// ([`SeqInput::draft_bias`]: penalties over the draft tokens before
    /// it) and its own constraint mask ([`crate::MaskWords::row`]: the
    /// grammar's state after them); a position without a mask is not
    /// sampled, and the sample before it ends the output.
    Verify {
        /// How to sample each position.
        params: SamplingParams,
        /// Draft tokens at the end of the input (at least one, fewer than
        /// the input's tokens).
        draft: usize,
    },
}

impl OutputKind {
    /// Logit rows this output needs: the last `rows()` positions of the input.
    pub fn rows(&self) -> usize {
        match self {
            OutputKind::None => 0,
            OutputKind::Logits | OutputKind::Sample(_) => 1,
            OutputKind::Verify { draft, .. } => draft + 1,
        }
    }

    /// The sampling parameters, if it samples.
    pub fn sampling(&self) -> Option<&SamplingParams> {
        match self {
            OutputKind::Sample(p) | OutputKind::Verify { params: p, .. } => Some(p),
            OutputKind::None | OutputKind::Logits => None,
        }
    }
}

/// One output row's draw: which row of the sequence's output rows (0 is
/// the first of [`OutputKind::rows`]), how, at which position, with what
/// added to the logits and which tokens allowed (`None`: any).
#[derive(Clone, Copy, Debug)]
pub struct RowDraw<'a> {
    /// The row among the sequence's output rows.
    pub row: usize,
    /// How to sample.
    pub params: &'a SamplingParams,
    /// The position sampled (the seed's draw is a function of it).
    pub position: u64,
    /// Added to the row's logits (see [`SeqInput::bias`]).
    pub bias: &'a [(u32, f32)],
    /// The tokens allowed, a bitmask; `None` allows every token.
    pub allow: Option<&'a [u32]>,
}

/// Samples one sequence's output rows in order: `sample_at` draws each
/// ([`RowDraw`]). A plain sample draws once; a draft is accepted while
/// each draw equals the draft token at its position
/// ([`OutputKind::Verify`]), each row with its own bias and mask. Reads
/// the constraint's masks (computing them if nobody has yet).
pub fn sample_outputs(
    q: &SeqInput<'_>,
    o: &mut SeqOutput,
    mut sample_at: impl FnMut(RowDraw<'_>) -> Sampled,
) {
    let end = q.start_pos + q.tokens.len();
    let Some(params) = q.output.sampling() else {
        return;
    };
    let masks = q.allow.map(|m| m.words());
    let draft = match q.output {
        OutputKind::Verify { draft, .. } => draft,
        _ => 0,
    };
    let first = end - draft;
    let guesses = &q.tokens[q.tokens.len() - draft..];
    for row in 0..=draft {
        let allow = match &masks {
            None => None,
            Some(m) => match m.row(row) {
                Some(w) => Some(w),
                None => {
                    // The grammar's state after the draft so far is not
                    // known: the sample before is the output's last.
                    o.sampled = o.accepted.pop();
                    break;
                }
            },
        };
        let bias = match row {
            0 => q.bias,
            r => q.draft_bias.get(r - 1).map_or(q.bias, Vec::as_slice),
        };
        let s = sample_at(RowDraw {
            row,
            params,
            position: (first + row) as u64,
            bias,
            allow,
        });
        if guesses.get(row) == Some(&s.token) {
            o.accepted.push(s);
        } else {
            o.sampled = Some(s);
            break;
        }
    }
}

/// One sequence's part of a flat batch: a prefill chunk or one decode token.
#[derive(Clone, Copy, Debug)]
pub struct SeqInput<'a> {
    /// Tokens to run, at positions `start_pos..start_pos + tokens.len()`.
    pub tokens: &'a [u32],
    /// Position of `tokens[0]`; positions before it are already in the cache.
    pub start_pos: usize,
    /// Physical block of each logical block of the sequence, covering at
    /// least `start_pos + tokens.len()` positions; blocks may be in any order.
    pub block_table: &'a [u32],
    /// What to return.
    pub output: OutputKind,
    /// Added to the sampled position's logits before sampling (and before
    /// its log-probabilities): `(token, amount)` pairs in token order, a
    /// token at most once (the request's `logit_bias` with its penalties folded in; see
    /// `flotilla_sched`). Empty for nearly every sequence; ignored unless
    /// `output` samples. For a verify, the first row's.
    pub bias: &'a [(u32, f32)],
    /// A verify's bias for rows `1..=draft` (`draft_bias[r - 1]` for row
    /// `r`: the penalties folded in over the draft tokens before it too);
    /// empty when every row takes [`SeqInput::bias`].
    pub draft_bias: &'a [Vec<(u32, f32)>],
    /// The tokens allowed at that sample, a bitmask (see
    /// [`crate::TokenConstraint::allowed`]): a constrained request's grammar
    /// state, possibly still being computed while the forward pass runs
    /// (read it with [`crate::MaskCell::words`] when sampling, not before).
    /// `None` allows every token.
    pub allow: Option<&'a crate::MaskCell>,
}

/// One sequence's result of a step.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct SeqOutput {
    /// Row of [`StepOutputs::logits`] holding this sequence's logits: set
    /// for a sequence that asked for logits, and for one that sampled
    /// unless the backend picked a greedy token on its device without
    /// reading the logits back.
    pub logits_row: Option<usize>,
    /// The sampled token (after [`SeqOutput::accepted`], if any).
    pub sampled: Option<Sampled>,
    /// Draft tokens accepted, in order ([`OutputKind::Verify`]): each is
    /// the sample drawn at its position, which equalled the draft.
    pub accepted: Vec<Sampled>,
}

impl SeqOutput {
    /// Tokens this sequence gained: the accepted draft, then the sample.
    pub fn tokens(&self) -> impl Iterator<Item = &Sampled> {
        self.accepted.iter().chain(&self.sampled)
    }
}

/// Results of one step, reused across steps to avoid allocation.
#[derive(Debug, Default)]
pub struct StepOutputs {
    /// Vocabulary size (row length of `logits`).
    pub vocab: usize,
    /// Logit rows of the sequences that asked for them (or sampled).
    pub logits: Vec<f32>,
    /// One entry per input sequence, in input order.
    pub seqs: Vec<SeqOutput>,
}

impl StepOutputs {
    /// The logits row of sequence `i`, if it asked for logits or a sample.
    pub fn logits_of(&self, i: usize) -> Option<&[f32]> {
        let r = self.seqs.get(i)?.logits_row?;
        self.logits.get(r * self.vocab..(r + 1) * self.vocab)
    }

    /// The sampled token of sequence `i`.
    pub fn token_of(&self, i: usize) -> Option<u32> {
        self.seqs.get(i)?.sampled.as_ref().map(|s| s.token)
    }
}

/// Why a step or a block operation was refused. A refused step changes
/// nothing but the KV slots of the positions it was asked to write.
#[derive(Debug, thiserror::Error, PartialEq)]
pub enum ExecError {
    /// The batch has no tokens or a sequence has none.
    #[error("empty batch or empty sequence {0}")]
    Empty(usize),
    /// More tokens than the backend's per-step budget.
    #[error("batch of {tokens} tokens exceeds the step budget of {max}")]
    BatchTooLarge {
        /// Tokens asked for.
        tokens: usize,
        /// Budget.
        max: usize,
    },
    /// A sequence runs past the model's context.
    #[error("sequence {seq} reaches position {end}, beyond the context of {ctx}")]
    ContextOverflow {
        /// Index in the batch.
        seq: usize,
        /// One past the last position.
        end: usize,
        /// Context length.
        ctx: usize,
    },
    /// A token id outside the vocabulary.
    #[error("sequence {seq}: token id {token} is outside the vocabulary of {vocab}")]
    BadToken {
        /// Index in the batch.
        seq: usize,
        /// The token.
        token: u32,
        /// Vocabulary size.
        vocab: usize,
    },
    /// A block table too short for the positions or naming a missing block.
    #[error("sequence {seq}: block table {reason}")]
    BadBlockTable {
        /// Index in the batch.
        seq: usize,
        /// What is wrong.
        reason: String,
    },
    /// A block id outside the cache.
    #[error("block {block} does not exist (cache has {num_blocks})")]
    BadBlock {
        /// The block.
        block: u32,
        /// Blocks in the cache.
        num_blocks: usize,
    },
    /// A byte buffer of the wrong size for a block.
    #[error("block buffer has {got} bytes, expected {expected}")]
    BadBlockBytes {
        /// Bytes given.
        got: usize,
        /// Bytes of one block.
        expected: usize,
    },
    /// Invalid sampling parameters.
    #[error("sequence {seq}: {reason}")]
    BadSampling {
        /// Index in the batch.
        seq: usize,
        /// What is wrong.
        reason: String,
    },
    /// More sequences than the backend's per-step budget.
    #[error("batch of {seqs} sequences exceeds the step budget of {max}")]
    TooManySequences {
        /// Sequences asked for.
        seqs: usize,
        /// Budget.
        max: usize,
    },
    /// The device failed (a driver or library error); the backend's state
    /// can no longer be trusted.
    #[error("{0}")]
    Backend(String),
    /// A part of the backend is gone (a pipeline group's stage): as
    /// `Backend`, but no request caused it, so the step's requests may run
    /// elsewhere.
    #[error("{0}")]
    Lost(String),
    /// The backend does not do what was asked (its state is unchanged).
    #[error("this backend has no {0}")]
    Unsupported(&'static str),
}

/// What a backend accepts in one step.
#[derive(Clone, Copy, Debug)]
pub struct BatchLimits {
    /// Vocabulary size: token ids below it.
    pub vocab: usize,
    /// Longest sequence.
    pub ctx_len: usize,
    /// Tokens per KV block.
    pub block_size: usize,
    /// Physical KV blocks.
    pub num_blocks: usize,
    /// Most tokens in one step.
    pub max_tokens: usize,
}

/// Checks a batch against a backend's limits before anything runs: not
/// empty, every sequence within the context, known token ids, block
/// tables long enough and naming real blocks, valid sampling, the token
/// budget, and no two positions writing one KV slot (`slots` is scratch).
/// Returns the batch's token count.
pub fn validate_batch(
    batch: &[SeqInput<'_>],
    lim: &BatchLimits,
    slots: &mut Vec<usize>,
) -> Result<usize, ExecError> {
    if batch.is_empty() {
        return Err(ExecError::Empty(0));
    }
    let bs = lim.block_size;
    let mut total = 0usize;
    for (i, s) in batch.iter().enumerate() {
        if s.tokens.is_empty() {
            return Err(ExecError::Empty(i));
        }
        total += s.tokens.len();
        let end = s.start_pos.saturating_add(s.tokens.len());
        if end > lim.ctx_len {
            return Err(ExecError::ContextOverflow {
                seq: i,
                end,
                ctx: lim.ctx_len,
            });
        }
        if let Some(&tok) = s.tokens.iter().find(|&&t| t as usize >= lim.vocab) {
            return Err(ExecError::BadToken {
                seq: i,
                token: tok,
                vocab: lim.vocab,
            });
        }
        let need = end.div_ceil(bs);
        if s.block_table.len() < need {
            return Err(ExecError::BadBlockTable {
                seq: i,
                reason: format!(
                    "has {} blocks, positions up to {end} need {need}",
                    s.block_table.len()
                ),
            });
        }
        if let Some(&b) = s.block_table[..need]
            .iter()
            .find(|&&b| b as usize >= lim.num_blocks)
        {
            return Err(ExecError::BadBlockTable {
                seq: i,
                reason: format!("names block {b}, cache has {}", lim.num_blocks),
            });
        }
        if let Some(p) = s.output.sampling() {
            p.validate()
                .map_err(|reason| ExecError::BadSampling { seq: i, reason })?;
        }
        if let OutputKind::Verify { draft, .. } = s.output {
            let reason = if draft == 0 || draft >= s.tokens.len() {
                Some(format!(
                    "a draft of {draft} tokens in an input of {}: it needs at least one, \
                     after at least one accepted token",
                    s.tokens.len()
                ))
            } else if !s.draft_bias.is_empty() && s.draft_bias.len() != draft {
                Some(format!(
                    "a draft of {draft} tokens with {} rows of bias",
                    s.draft_bias.len()
                ))
            } else {
                None
            };
            if let Some(reason) = reason {
                return Err(ExecError::BadSampling { seq: i, reason });
            }
        }
    }
    if total > lim.max_tokens {
        return Err(ExecError::BatchTooLarge {
            tokens: total,
            max: lim.max_tokens,
        });
    }
    check_distinct_slots(batch, lim.block_size, slots)?;
    Ok(total)
}

/// Refuses a batch in which two positions would write the same KV slot:
/// the writers of one step would race on it.
fn check_distinct_slots(
    batch: &[SeqInput<'_>],
    bs: usize,
    slots: &mut Vec<usize>,
) -> Result<(), ExecError> {
    slots.clear();
    for s in batch {
        for p in s.start_pos..s.start_pos + s.tokens.len() {
            slots.push(s.block_table[p / bs] as usize * bs + p % bs);
        }
    }
    slots.sort_unstable();
    if let Some(w) = slots.windows(2).find(|w| w[0] == w[1]) {
        let seq = batch
            .iter()
            .position(|s| {
                (s.start_pos..s.start_pos + s.tokens.len())
                    .any(|p| s.block_table[p / bs] as usize * bs + p % bs == w[0])
            })
            .unwrap_or(0);
        return Err(ExecError::BadBlockTable {
            seq,
            reason: format!(
                "writes KV slot {} of block {} that another position of this step also writes",
                w[0] % bs,
                w[0] / bs
            ),
        });
    }
    Ok(())
}

/// A model backend that runs flat mixed batches over a paged KV cache.
pub trait Executor: Send {
    /// What model this backend runs.
    fn model_spec(&self) -> &ModelSpec;
    /// The KV cache it holds.
    fn kv_spec(&self) -> KvSpec;
    /// Most tokens one step may carry.
    fn max_batch_tokens(&self) -> usize;
    /// Runs one step: writes K/V of every input position into its block and
    /// returns logits or samples for the sequences that ask.
    fn step(&mut self, batch: &[SeqInput<'_>], out: &mut StepOutputs) -> Result<(), ExecError>;
    /// Copies one block's contents to another (prefix-cache copy-on-write).
    fn copy_block(&mut self, src: u32, dst: u32) -> Result<(), ExecError>;
    /// Reads one block's raw bytes (KV export for migration).
    fn read_block(&self, block: u32, out: &mut [u8]) -> Result<(), ExecError>;
    /// Overwrites one block's raw bytes (KV import for migration).
    fn write_block(&mut self, block: u32, data: &[u8]) -> Result<(), ExecError>;
    /// Copies hot block `block` into an offload slot's bytes (`dst`, of
    /// [`Executor::offload_bytes_per_block`] bytes). By default the block's
    /// raw bytes, as [`Executor::read_block`] gives them.
    fn spill_block(&mut self, block: u32, dst: &mut [u8]) -> Result<(), ExecError> {
        self.read_block(block, dst)
    }
    /// Copies an offload slot's bytes back into hot block `block`.
    fn restore_block(&mut self, src: &[u8], block: u32) -> Result<(), ExecError> {
        self.write_block(block, src)
    }
    /// Keeps an offload tier of `slots` blocks itself, where this backend
    /// has a better place for it than the worker's host buffer (a GPU:
    /// page-locked host memory, moved by asynchronous copies on the step's
    /// stream, so they are ordered with the steps that write and read
    /// those blocks and the host does not wait). `false`: it keeps none;
    /// the worker holds the bytes and moves them with `spill_block` and
    /// `restore_block`.
    fn attach_offload(&mut self, slots: u32) -> Result<bool, ExecError> {
        let _ = slots;
        Ok(false)
    }
    /// Copies hot block `block` to slot `slot` of this backend's own tier
    /// (after `attach_offload` kept one).
    fn spill_to_slot(&mut self, block: u32, slot: u32) -> Result<(), ExecError> {
        let _ = (block, slot);
        Err(ExecError::Backend(
            "this backend keeps no offload tier".into(),
        ))
    }
    /// Copies slot `slot` of this backend's own tier into hot block `block`.
    fn restore_from_slot(&mut self, slot: u32, block: u32) -> Result<(), ExecError> {
        let _ = (slot, block);
        Err(ExecError::Backend(
            "this backend keeps no offload tier".into(),
        ))
    }
    /// Bytes of one offload slot: a block's bytes, or 0 for a backend that
    /// moves none (the simulator models the copy's time instead).
    fn offload_bytes_per_block(&self) -> usize {
        self.kv_spec().bytes_per_block
    }
    /// Modelled time of one block's move between tiers, for a backend whose
    /// time is modelled (the simulator, which adds it to its next step);
    /// `None`: the move's own wall time is its time.
    fn simulated_offload_time(&self) -> Option<std::time::Duration> {
        None
    }
    /// Most draft tokens one sequence may carry for verification
    /// ([`OutputKind::Verify`]); 0: this backend verifies no drafts, and the
    /// engine does not speculate on it.
    fn max_draft_tokens(&self) -> usize {
        0
    }
    /// Whether [`Executor::draft_step`] works here (a self-draft).
    fn can_self_draft(&self) -> bool {
        false
    }
    /// A step through only the first `layers` layers of the model, then
    /// its final norm and head: a self-draft's forward pass (speculative
    /// decoding's guess from the model's own shallower part). It writes
    /// those layers' KV at its positions, which the verify step then
    /// writes again whole; nothing else changes. Backends that cannot
    /// ([`Executor::can_self_draft`] false) refuse it.
    fn draft_step(
        &mut self,
        batch: &[SeqInput<'_>],
        out: &mut StepOutputs,
        layers: usize,
    ) -> Result<(), ExecError> {
        let _ = (batch, out, layers);
        Err(ExecError::Unsupported("self-draft"))
    }
    /// How long the last step took on the hardware this backend models,
    /// for a backend that computes no real forward pass (the simulator's
    /// cost model): the GpuWorker waits that long on the runtime's clock
    /// before it reports the step. `None` (every real backend): the step's
    /// own wall time is its time.
    fn simulated_step_time(&self) -> Option<std::time::Duration> {
        None
    }
    /// For a modelled pipelined backend (the simulator's groups): how long
    /// until its oldest begun step is done on the hardware it models; the
    /// GpuWorker waits that long on the runtime's clock before it calls
    /// [`Executor::finish_step`]. `None` (every real backend): the finish
    /// itself waits for the step.
    fn simulated_wait(&self) -> Option<std::time::Duration> {
        None
    }
    /// For a modelled backend: whether a multi-step plan must end after
    /// the step in progress now, as if the Scheduler had cut it (the
    /// simulator's fast mode runs step by step around a scheduled fault,
    /// where a client must see each step's tokens when the exact mode
    /// would). False for every real backend.
    fn simulated_single_steps(&self) -> bool {
        false
    }
    /// Tries to make a backend that failed with `ExecError::Lost` usable
    /// again (a pipeline group whose lost stage is back): true when it can
    /// run steps again, every KV block's contents lost; false when it
    /// cannot (yet). Every single-device backend: false.
    fn recover(&mut self) -> bool {
        false
    }
    /// Steps this executor works on at once: a pipeline group's stages
    /// each work on a different step, so the engine keeps this many in
    /// flight over disjoint sequences ([`Executor::begin_step`]). 1 (every
    /// single-device backend): one step at a time, through `step`.
    fn pipeline_depth(&self) -> usize {
        1
    }
    /// Starts a step and returns once its part here is done and the rest
    /// is under way (`out` is scratch); [`Executor::finish_step`] ends it.
    /// Begun steps end in the order they began, each finished with the
    /// batch it began with. Only called where [`Executor::pipeline_depth`]
    /// is above 1; a refused begin leaves nothing in flight.
    fn begin_step(
        &mut self,
        batch: &[SeqInput<'_>],
        out: &mut StepOutputs,
    ) -> Result<(), ExecError> {
        self.step(batch, out)
    }
    /// Ends the oldest begun step (`batch` as it began), with its outputs
    /// in `out`.
    fn finish_step(
        &mut self,
        batch: &[SeqInput<'_>],
        out: &mut StepOutputs,
    ) -> Result<(), ExecError> {
        let _ = (batch, out);
        Err(ExecError::Unsupported("pipelined steps"))
    }
}
