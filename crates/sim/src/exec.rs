//! The executor the simulated GpuWorkers run: no forward pass, the cost
//! model's step time, token ids from the run's seeded generator.

use std::time::Duration;

use flotilla_exec::{
    ExecError, Executor, KvSpec, ModelSpec, OutputKind, Sampled, SeqInput, SeqOutput, StepOutputs,
};

use crate::cost::{GpuParams, ModelShape, SeqCost, step_time_masked};
use flotilla_exec::rng::Rng;

/// Bytes a simulated KV block carries when it migrates.
pub const SIM_BLOCK_BYTES: usize = 8;

/// Where each request decoded: per request (its sampling seed, which the
/// simulator makes the request's id), the spans of time each engine spent
/// decoding it. Shared by every engine of a run.
#[derive(Debug, Default)]
pub struct DecodeLog {
    spans: std::sync::Mutex<std::collections::BTreeMap<u64, Vec<DecodeSpan>>>,
}

/// One engine decoding one request, from its first sampled token to its
/// last, with no pause longer than [`DecodeLog::GAP`] between.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct DecodeSpan {
    /// The engine's node.
    pub node: u32,
    /// First decode step, since the run's start.
    pub first: Duration,
    /// Last decode step.
    pub last: Duration,
}

impl DecodeLog {
    /// A pause longer than this starts a new span (a preempted request
    /// that resumes; a request run again after its engine came back).
    pub const GAP: Duration = Duration::from_secs(1);
    /// Shorter than any move: the Router moves a request only after its
    /// node was silent past the down bound (400 ms or more in every
    /// scenario).
    pub const MOVE_GAP: Duration = Duration::from_millis(200);

    fn note(&self, req: u64, node: u32, at: Duration) {
        let mut spans = self.spans.lock().unwrap_or_else(|e| e.into_inner());
        let v = spans.entry(req).or_default();
        // A request that moved away and came back (another engine
        // decoded it since, and this one paused for longer than a move
        // takes) starts a new span here; two engines decoding it in turns,
        // step by step, stay one span each and overlap.
        let moved_back = |s: &DecodeSpan| {
            at > s.last + Self::MOVE_GAP && v.iter().any(|o| o.node != node && o.last > s.last)
        };
        let resume = v
            .iter()
            .rposition(|s| s.node == node)
            .filter(|&i| !moved_back(&v[i]));
        match resume.map(|i| &mut v[i]) {
            Some(s) if at <= s.last + Self::GAP => s.last = at,
            _ => v.push(DecodeSpan {
                node,
                first: at,
                last: at,
            }),
        }
    }

    /// For each time a request's decoding went from one engine to another
    /// (a move), the pause between the last step on the one and the first
    /// on the other: what its client waited, less the network.
    pub fn move_pauses(&self) -> Vec<Duration> {
        let spans = self.spans.lock().unwrap_or_else(|e| e.into_inner());
        let mut out = Vec::new();
        for v in spans.values() {
            let mut by_time: Vec<&DecodeSpan> = v.iter().collect();
            by_time.sort_by_key(|s| s.first);
            for w in by_time.windows(2) {
                if w[0].node != w[1].node && w[1].first > w[0].last {
                    out.push(w[1].first - w[0].last);
                }
            }
        }
        out
    }

    /// Pairs of spans in which two engines decoded one request at the same
    /// time: (request, span, span).
    pub fn overlaps(&self) -> Vec<(u64, DecodeSpan, DecodeSpan)> {
        let spans = self.spans.lock().unwrap_or_else(|e| e.into_inner());
        let mut out = Vec::new();
        for (&req, v) in spans.iter() {
            for (i, a) in v.iter().enumerate() {
                for b in &v[i + 1..] {
                    if a.node != b.node && a.first <= b.last && b.first <= a.last {
                        out.push((req, *a, *b));
                    }
                }
            }
        }
        out
    }
}

/// What a decoding engine reports to its run's [`DecodeLog`].
pub struct DecodeTap {
    /// The shared log.
    pub log: std::sync::Arc<DecodeLog>,
    /// This engine's node.
    pub node: u32,
    /// The run's start on the runtime's clock.
    pub t0: tokio::time::Instant,
}

/// A modelled accelerator running a modelled model.
pub struct SimExecutor {
    gpu: GpuParams,
    shape: ModelShape,
    spec: ModelSpec,
    kv: KvSpec,
    max_batch_tokens: usize,
    rng: Rng,
    last: Option<Duration>,
    costs: Vec<SeqCost>,
    tap: Option<DecodeTap>,
    /// Offload-tier moves since the last step, charged to the next one.
    moves: u32,
}

impl SimExecutor {
    /// An executor with a KV cache of every byte the weights leave free
    /// (less 10% headroom), in blocks of `block_size` tokens.
    pub fn new(
        gpu: GpuParams,
        shape: ModelShape,
        block_size: usize,
        max_batch_tokens: usize,
        rng: Rng,
    ) -> Result<SimExecutor, String> {
        let real_block_bytes = block_size * shape.kv_bytes_per_token();
        let free = gpu.mem_bytes * 0.9 - shape.weight_bytes();
        let num_blocks = (free / real_block_bytes as f64).floor();
        if num_blocks < (shape.ctx_len / block_size) as f64 {
            return Err(format!(
                "{} on {}: {:.1} GB of weights leave room for {num_blocks} KV blocks, \
                 fewer than one sequence of {} tokens",
                shape.name,
                gpu.name,
                shape.weight_bytes() / 1e9,
                shape.ctx_len
            ));
        }
        let spec = ModelSpec {
            name: shape.name.clone(),
            arch: "llama".into(),
            n_layer: shape.n_layer,
            n_embd: shape.q_width,
            n_head: shape.q_width / shape.head_dim,
            n_head_kv: shape.n_head_kv,
            head_dim: shape.head_dim,
            vocab: shape.vocab,
            ctx_len: shape.ctx_len,
            weight_bytes: shape.weight_bytes() as usize,
        };
        let kv = KvSpec {
            block_size,
            num_blocks: num_blocks.min(f64::from(u32::MAX / 2)) as usize,
            dtype: shape.kv_dtype,
            // A stand-in: migrated blocks carry this many bytes, and the
            // simulated network charges the transfer for the real size
            // (`ModelShape::kv_bytes_per_token` per token).
            bytes_per_block: SIM_BLOCK_BYTES,
        };
        Ok(SimExecutor {
            gpu,
            shape,
            spec,
            kv,
            max_batch_tokens,
            rng,
            last: None,
            costs: Vec::new(),
            moves: 0,
            tap: None,
        })
    }

    /// Reports every decode step's requests to a run's [`DecodeLog`].
    pub fn with_tap(mut self, tap: DecodeTap) -> SimExecutor {
        self.tap = Some(tap);
        self
    }
}

impl Executor for SimExecutor {
    fn model_spec(&self) -> &ModelSpec {
        &self.spec
    }

    fn kv_spec(&self) -> KvSpec {
        self.kv
    }

    fn max_batch_tokens(&self) -> usize {
        self.max_batch_tokens
    }

    fn max_draft_tokens(&self) -> usize {
        self.max_batch_tokens.saturating_sub(1)
    }

    fn step(&mut self, batch: &[SeqInput<'_>], out: &mut StepOutputs) -> Result<(), ExecError> {
        let tokens: usize = batch.iter().map(|s| s.tokens.len()).sum();
        if tokens > self.max_batch_tokens {
            return Err(ExecError::BatchTooLarge {
                tokens,
                max: self.max_batch_tokens,
            });
        }
        self.costs.clear();
        out.seqs.clear();
        out.vocab = self.shape.vocab;
        for (i, s) in batch.iter().enumerate() {
            if s.tokens.is_empty() {
                return Err(ExecError::Empty(i));
            }
            let end = s.start_pos + s.tokens.len();
            if end > self.shape.ctx_len {
                return Err(ExecError::ContextOverflow {
                    seq: i,
                    end,
                    ctx: self.shape.ctx_len,
                });
            }
            self.costs.push(SeqCost {
                start_pos: s.start_pos,
                tokens: s.tokens.len(),
            });
            let decode = match s.output {
                OutputKind::Sample(p) if s.tokens.len() == 1 => Some(p),
                OutputKind::Verify { params, .. } => Some(params),
                _ => None,
            };
            if let (Some(tap), Some(p)) = (&self.tap, decode) {
                let at = tokio::time::Instant::now().saturating_duration_since(tap.t0);
                tap.log.note(p.seed, tap.node, at);
            }
            // Ids 0..3 are the usual specials: never drawn, so a request
            // ends by its length. A draft is verified like any other (its
            // positions are charged above); a random draw seldom equals it.
            let mut o = SeqOutput::default();
            let (rng, vocab) = (&mut self.rng, self.shape.vocab as u64);
            flotilla_exec::sample_outputs(s, &mut o, |_| Sampled {
                token: rng.range(3, vocab - 1) as u32,
                logprob: 0.0,
                top: Vec::new(),
            });
            out.seqs.push(o);
        }
        let masks = batch.iter().filter(|s| s.allow.is_some()).count();
        let moves = self.simulated_offload_time().unwrap_or_default() * self.moves;
        self.moves = 0;
        self.last = Some(step_time_masked(&self.gpu, &self.shape, &self.costs, masks) + moves);
        Ok(())
    }

    fn copy_block(&mut self, _src: u32, _dst: u32) -> Result<(), ExecError> {
        Ok(())
    }

    fn read_block(&self, _block: u32, _out: &mut [u8]) -> Result<(), ExecError> {
        Ok(())
    }

    fn write_block(&mut self, _block: u32, _data: &[u8]) -> Result<(), ExecError> {
        Ok(())
    }

    fn simulated_step_time(&self) -> Option<Duration> {
        self.last
    }

    // The tier holds no bytes here: a move costs the block's real size
    // over the host link, charged to the next step (the worker performs
    // moves just before it).
    fn spill_block(&mut self, _block: u32, _dst: &mut [u8]) -> Result<(), ExecError> {
        self.moves += 1;
        Ok(())
    }

    fn restore_block(&mut self, _src: &[u8], _block: u32) -> Result<(), ExecError> {
        self.moves += 1;
        Ok(())
    }

    fn offload_bytes_per_block(&self) -> usize {
        0
    }

    fn simulated_offload_time(&self) -> Option<Duration> {
        let bytes = (self.kv.block_size * self.shape.kv_bytes_per_token()) as f64;
        Some(Duration::from_secs_f64(bytes / self.gpu.host_link_bw))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ms(v: u64) -> Duration {
        Duration::from_millis(v)
    }

    /// A verify item is charged for every position, and yields at most its
    /// draft plus one token.
    #[test]
    fn verify_positions_are_charged() {
        let mut e = SimExecutor::new(
            GpuParams::preset("h100").unwrap(),
            crate::cost::ModelShape::preset("llama3-8b").unwrap(),
            16,
            4096,
            Rng::new(3),
        )
        .unwrap();
        let table: Vec<u32> = (0..8).collect();
        let tokens = [5u32, 6, 7, 8, 9, 10, 11, 12, 13];
        let mut time = |draft: usize| {
            let p = flotilla_exec::SamplingParams::greedy();
            let output = match draft {
                0 => OutputKind::Sample(p),
                draft => OutputKind::Verify { params: p, draft },
            };
            // 32 sequences at 1,000 tokens of context: the step is no longer
            // only the weights' read.
            let batch: Vec<SeqInput<'_>> = (0..32)
                .map(|_| SeqInput {
                    tokens: &tokens[..=draft],
                    start_pos: 100,
                    block_table: &table,
                    output,
                    bias: &[],
                    draft_bias: &[],
                    allow: None,
                })
                .collect();
            let mut out = StepOutputs::default();
            e.step(&batch, &mut out).unwrap();
            for o in &out.seqs {
                assert!(o.sampled.is_some() && o.accepted.len() <= draft);
            }
            e.simulated_step_time().unwrap()
        };
        let (plain, verify) = (time(0), time(8));
        assert!(verify > plain, "{verify:?} <= {plain:?}");
    }

    #[test]
    fn the_decode_log_finds_a_request_decoding_on_two_engines_at_once() {
        let log = DecodeLog::default();
        // Request 1: engine 1, then (after it stopped) engine 2: sequential.
        for t in [0, 10, 20] {
            log.note(1, 1, ms(t));
        }
        for t in [500, 510] {
            log.note(1, 2, ms(t));
        }
        // Request 2: engines 1 and 3 interleaved.
        for t in [100, 110, 120] {
            log.note(2, 1, ms(t));
            log.note(2, 3, ms(t + 5));
        }
        // Request 3: one engine, a pause longer than GAP splits its spans
        // but never makes an overlap.
        log.note(3, 1, ms(0));
        log.note(3, 1, ms(5000));
        // Request 4: moved from engine 1 to 2, then back to 1 (within
        // GAP): three spans in turn, no overlap.
        for t in [0, 10, 20] {
            log.note(4, 1, ms(t));
        }
        for t in [450, 460] {
            log.note(4, 2, ms(t));
        }
        for t in [900, 910] {
            log.note(4, 1, ms(t));
        }
        let o = log.overlaps();
        assert_eq!(o.len(), 1, "{o:?}");
        let (req, a, b) = o[0];
        assert_eq!(req, 2);
        assert_eq!((a.node, a.first, a.last), (1, ms(100), ms(120)));
        assert_eq!((b.node, b.first, b.last), (3, ms(105), ms(125)));
    }
}

/// Constraints as the simulator has them: its tokens are drawn at random,
/// so every matcher allows every token and never completes (a constrained
/// request ends by its length, as any other); what a constraint costs is
/// its masks' time in the cost model (`GpuParams::mask_us`).
#[derive(Debug)]
pub struct SimConstraints {
    /// Tokens of the model's vocabulary.
    pub vocab: usize,
}

#[derive(Debug)]
struct AnyToken(usize);

impl flotilla_exec::ConstraintCompiler for SimConstraints {
    fn compile(
        &self,
        _c: &flotilla_exec::Constraint,
    ) -> Result<Box<dyn flotilla_exec::TokenConstraint>, String> {
        Ok(Box::new(AnyToken(self.vocab)))
    }
}

impl flotilla_exec::TokenConstraint for AnyToken {
    fn allowed(&mut self, words: &mut Vec<u32>) {
        words.clear();
        words.resize(self.0.div_ceil(32), u32::MAX);
    }

    fn commit(&mut self, _token: u32) -> Result<bool, String> {
        Ok(false)
    }
}
