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
    /// Where this engine is a pipeline group: its stages' model.
    pipe: Option<SimPipe>,
    /// Where it verifies a draft model's guesses: how often each request's
    /// are right.
    acceptance: Option<std::sync::Arc<Acceptance>>,
    /// Fast mode's exact spans: set while multi-step plans must end
    /// after each step ([`SimExecutor::single_steps_when`]).
    single: Option<std::sync::Arc<std::sync::atomic::AtomicBool>>,
}

/// The per-token acceptance of a draft model's guesses for each request
/// (by its sampling seed, which the simulator makes its id): the
/// simulated tokens are random, so whether a guess is right is drawn at
/// the rate of the request's tenant (`[[traffic]] draft_acceptance`).
#[derive(Debug, Default)]
pub struct Acceptance(std::sync::Mutex<std::collections::HashMap<u64, f64>>);

impl Acceptance {
    /// Request `seed`'s guesses are right at `rate`.
    pub fn set(&self, seed: u64, rate: f64) {
        self.0
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert(seed, rate);
    }

    /// Forgets a request that ended.
    pub fn forget(&self, seed: u64) {
        self.0
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .remove(&seed);
    }

    fn of(&self, seed: u64) -> f64 {
        self.0
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .get(&seed)
            .copied()
            .unwrap_or(0.0)
    }
}

/// A pipeline group as the simulator models it (issue 45): each of
/// `stages` stages computes an equal share of the step's layers; stage 0
/// also embeds, samples and bears the step's fixed cost, and is the hub:
/// the hidden rows (`row_bytes` a token) go from it to each later stage
/// and back, one hop each way at the link's latency and bandwidth, as the
/// real group's `PipelineExecutor` sends them. Each stage works on one
/// step at a time, so up to `stages` steps overlap, each on its own stage.
#[derive(Clone, Debug, PartialEq)]
pub struct PipeModel {
    /// Stages of the group (2 and up).
    pub stages: usize,
    /// One hop's latency.
    pub hop_latency: Duration,
    /// A stage link's bytes a second.
    pub link_bytes_per_s: f64,
    /// Bytes one token's hidden row takes on the wire.
    pub row_bytes: usize,
}

impl PipeModel {
    /// One hop of `tokens` hidden rows.
    pub fn hop(&self, tokens: usize) -> Duration {
        self.hop_latency
            + Duration::from_secs_f64((tokens * self.row_bytes) as f64 / self.link_bytes_per_s)
    }
}

/// Which stages of a group are down: shared by the group's executor (each
/// life of its node) and the run's faults. Stage 0 is the node itself,
/// which a crash takes; only later stages are here.
#[derive(Debug)]
pub struct StageHealth {
    down: Vec<std::sync::atomic::AtomicBool>,
    formed: std::sync::atomic::AtomicU64,
}

impl StageHealth {
    /// A group of `stages` stages, all up.
    pub fn new(stages: usize) -> StageHealth {
        StageHealth {
            down: (0..stages)
                .map(|_| std::sync::atomic::AtomicBool::new(false))
                .collect(),
            formed: std::sync::atomic::AtomicU64::new(0),
        }
    }

    /// Times the group formed again after a lost stage (its engine's
    /// recovery found every stage up).
    pub fn formed_again(&self) -> u64 {
        self.formed.load(std::sync::atomic::Ordering::SeqCst)
    }

    /// Stage `stage` goes down (true) or comes back; false where the
    /// group has no such stage.
    pub fn set_down(&self, stage: usize, down: bool) -> bool {
        match self.down.get(stage) {
            Some(d) => {
                d.store(down, std::sync::atomic::Ordering::SeqCst);
                true
            }
            None => false,
        }
    }

    /// The first stage that is down.
    pub fn first_down(&self) -> Option<usize> {
        self.down
            .iter()
            .position(|d| d.load(std::sync::atomic::Ordering::SeqCst))
    }
}

/// The pipelined part of a [`SimExecutor`]: the model, the stages'
/// health, when each stage is next free, and the begun steps (when each
/// one's rows are back on stage 0, and its outputs).
struct SimPipe {
    model: PipeModel,
    health: std::sync::Arc<StageHealth>,
    free: Vec<tokio::time::Instant>,
    /// The head and sampling's time (the step's fixed cost).
    fixed: Duration,
    begun: std::collections::VecDeque<(tokio::time::Instant, Vec<SeqOutput>)>,
}

impl SimPipe {
    /// Begins a step costing `cost` in all (the fixed part on stage 0 at
    /// its finish) of `tokens` tokens at `now`, in the order the real
    /// group runs it: stage 0's share now (after what stage 0 has begun
    /// or finished before), then each later stage's after a hop there and
    /// before a hop back, each stage one step at a time. Returns when its
    /// rows are back on stage 0.
    fn begin(
        &mut self,
        now: tokio::time::Instant,
        cost: Duration,
        tokens: usize,
    ) -> tokio::time::Instant {
        let s = self.model.stages;
        let share = cost.saturating_sub(self.fixed) / s as u32;
        let hop = self.model.hop(tokens);
        let mut t = now.max(self.free[0]) + share;
        self.free[0] = t;
        for k in 1..s {
            let start = (t + hop).max(self.free[k]);
            self.free[k] = start + share;
            t = start + share + hop;
        }
        t
    }

    /// When the oldest begun step is done: its head and sampling on stage
    /// 0 once its rows are back and stage 0 has done what it began since.
    fn oldest_done(&self) -> Option<tokio::time::Instant> {
        let (back, _) = self.begun.front()?;
        Some((*back).max(self.free[0]) + self.fixed)
    }
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
        SimExecutor::with_stages(gpu, shape, block_size, max_batch_tokens, rng, 1)
    }

    /// [`SimExecutor::new`] for a pipeline group of `stages` stages, each
    /// on its own accelerator with `1 / stages` of the layers: the KV
    /// cache has the blocks that each stage's share of the weights leaves
    /// room for, a block taking `1 / stages` of its bytes on each stage
    /// ([`SimExecutor::pipelined`] makes the steps overlap).
    pub fn with_stages(
        gpu: GpuParams,
        shape: ModelShape,
        block_size: usize,
        max_batch_tokens: usize,
        rng: Rng,
        stages: usize,
    ) -> Result<SimExecutor, String> {
        let stages = stages.max(1) as f64;
        let real_block_bytes = (block_size * shape.kv_bytes_per_token()) as f64 / stages;
        let free = gpu.mem_bytes * 0.9 - shape.weight_bytes() / stages;
        let num_blocks = (free / real_block_bytes).floor();
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
            pipe: None,
            acceptance: None,
            single: None,
        })
    }

    /// Makes room beside this engine's model for a draft model of shape
    /// `draft` on the same accelerator: its weights, and its KV in the
    /// same blocks (a block's bytes are both models'), so the KV cache
    /// has fewer blocks. Its verify steps accept guesses at each request's
    /// rate in `acceptance`.
    pub fn with_draft(
        mut self,
        draft: &ModelShape,
        acceptance: std::sync::Arc<Acceptance>,
    ) -> Result<SimExecutor, String> {
        let block = self.kv.block_size;
        let bytes = (block * (self.shape.kv_bytes_per_token() + draft.kv_bytes_per_token())) as f64;
        let free = self.gpu.mem_bytes * 0.9 - self.shape.weight_bytes() - draft.weight_bytes();
        let num_blocks = (free / bytes).floor();
        if num_blocks < (self.shape.ctx_len / block) as f64 {
            return Err(format!(
                "{} with the draft {} on {}: their weights leave room for {num_blocks} KV \
                 blocks, fewer than one sequence of {} tokens",
                self.shape.name, draft.name, self.gpu.name, self.shape.ctx_len
            ));
        }
        self.kv.num_blocks = num_blocks.min(f64::from(u32::MAX / 2)) as usize;
        self.acceptance = Some(acceptance);
        Ok(self)
    }

    /// The draft model of an engine whose model runs `target` (its KV in
    /// `target`'s blocks): its passes cost what the cost model says for its
    /// shape; its guesses are random tokens (whether one is right is drawn
    /// by the target's verify, [`SimExecutor::with_draft`]).
    pub fn draft_for(
        target: &SimExecutor,
        draft: ModelShape,
        rng: Rng,
    ) -> Result<SimExecutor, String> {
        let mut d = SimExecutor::new(
            target.gpu.clone(),
            ModelShape {
                ctx_len: target.shape.ctx_len,
                ..draft
            },
            target.kv.block_size,
            target.max_batch_tokens,
            rng,
        )?;
        d.kv.num_blocks = target.kv.num_blocks;
        Ok(d)
    }

    /// Ends every multi-step plan after its step in progress while `flag`
    /// is set (fast mode's spans around a scheduled fault, where the
    /// tokens must reach clients step by step as in the exact mode).
    pub fn single_steps_when(
        mut self,
        flag: std::sync::Arc<std::sync::atomic::AtomicBool>,
    ) -> SimExecutor {
        self.single = Some(flag);
        self
    }

    /// Makes this engine a pipeline group of `model.stages` stages whose
    /// health `health` holds (the stages beyond stage 0; a step begun or
    /// ended while one is down fails with [`ExecError::Lost`]).
    pub fn pipelined(
        mut self,
        model: PipeModel,
        health: std::sync::Arc<StageHealth>,
    ) -> SimExecutor {
        let now = tokio::time::Instant::now();
        self.pipe = Some(SimPipe {
            free: vec![now; model.stages],
            model,
            health,
            fixed: Duration::from_secs_f64(self.gpu.overhead_s),
            begun: std::collections::VecDeque::new(),
        });
        self
    }

    /// Checks a step, draws its samples into `out` and returns its
    /// modelled time (the offload moves since the last one included).
    fn run_step(
        &mut self,
        batch: &[SeqInput<'_>],
        out: &mut StepOutputs,
    ) -> Result<Duration, ExecError> {
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
            // A draft model's guess is right at its request's rate.
            let (draft, rate) = match (s.output, &self.acceptance) {
                (OutputKind::Verify { draft, params }, Some(a)) => (draft, a.of(params.seed)),
                _ => (0, 0.0),
            };
            let guesses = &s.tokens[s.tokens.len() - draft..];
            flotilla_exec::sample_outputs(s, &mut o, |d| Sampled {
                token: match guesses.get(d.row) {
                    Some(&g) if rng.chance(rate) => g,
                    _ => rng.range(3, vocab - 1) as u32,
                },
                logprob: 0.0,
                top: Vec::new(),
            });
            out.seqs.push(o);
        }
        let masks = batch.iter().filter(|s| s.allow.is_some()).count();
        let moves = self.simulated_offload_time().unwrap_or_default() * self.moves;
        self.moves = 0;
        Ok(step_time_masked(&self.gpu, &self.shape, &self.costs, masks) + moves)
    }

    /// Refuses a step while a stage of the group is down.
    fn check_stages(&self) -> Result<(), ExecError> {
        match self.pipe.as_ref().and_then(|p| p.health.first_down()) {
            Some(k) => Err(ExecError::Lost(format!(
                "pipeline stage {k} is gone; the group waits for it"
            ))),
            None => Ok(()),
        }
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
        self.last = Some(self.run_step(batch, out)?);
        Ok(())
    }

    fn pipeline_depth(&self) -> usize {
        self.pipe.as_ref().map_or(1, |p| p.model.stages)
    }

    fn begin_step(
        &mut self,
        batch: &[SeqInput<'_>],
        out: &mut StepOutputs,
    ) -> Result<(), ExecError> {
        self.check_stages()?;
        let cost = self.run_step(batch, out)?;
        let tokens = batch.iter().map(|s| s.tokens.len()).sum();
        let Some(p) = self.pipe.as_mut() else {
            self.last = Some(cost);
            return Ok(());
        };
        let back = p.begin(tokio::time::Instant::now(), cost, tokens);
        p.begun.push_back((back, std::mem::take(&mut out.seqs)));
        Ok(())
    }

    fn finish_step(
        &mut self,
        _batch: &[SeqInput<'_>],
        out: &mut StepOutputs,
    ) -> Result<(), ExecError> {
        let lost = self.check_stages();
        let Some(p) = self.pipe.as_mut() else {
            return Err(ExecError::Unsupported("pipelined steps"));
        };
        let Some(done) = p.oldest_done() else {
            return Err(ExecError::Unsupported("a finish with no step begun"));
        };
        // Stage 0 runs the head and sampling.
        p.free[0] = done;
        let Some((_, seqs)) = p.begun.pop_front() else {
            return Err(ExecError::Unsupported("a finish with no step begun"));
        };
        lost?;
        out.seqs = seqs;
        out.vocab = self.shape.vocab;
        Ok(())
    }

    fn simulated_wait(&self) -> Option<Duration> {
        let done = self.pipe.as_ref()?.oldest_done()?;
        Some(done.saturating_duration_since(tokio::time::Instant::now()))
    }

    fn recover(&mut self) -> bool {
        if self.check_stages().is_err() {
            return false;
        }
        match self.pipe.as_mut() {
            Some(p) => {
                p.begun.clear();
                let now = tokio::time::Instant::now();
                p.free.iter_mut().for_each(|f| *f = now);
                p.health
                    .formed
                    .fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                true
            }
            None => false,
        }
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

    fn simulated_single_steps(&self) -> bool {
        self.single
            .as_ref()
            .is_some_and(|f| f.load(std::sync::atomic::Ordering::Relaxed))
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
