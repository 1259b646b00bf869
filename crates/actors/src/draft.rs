//! The draft model of speculative decoding, held by the GpuWorker beside
//! the target: before a step, it replaces the placeholders of the plan's
//! model-drafted items (`PlanItem::model_draft`) with its greedy guesses,
//! one batched pass per draft position over every drafting sequence.
//!
//! Its KV lives in the target's blocks: block `b` of a sequence's table
//! holds the target's KV in the target executor and the draft's in the
//! draft executor (sized to the same blocks, its own bytes per block, both
//! counted in the pool's block size), so admission, preemption, prefix
//! caching, quotas and every give-back path cover both with no accounting
//! of their own. What the draft's half of a block holds is recorded here
//! per block: the tokens written and a hash of the tokens before the block.
//! A sequence's draft KV is trusted only as far as those records match its
//! tokens, so KV the draft never computed (a prefix cached by a sequence
//! that did not draft, blocks moved in from another node or restored from
//! the offload tier, a block another sequence's draft has since written)
//! is computed again from the tokens, never read.

use std::time::Duration;

use flotilla_exec::{Executor, OutputKind, SamplingParams, SeqInput, StepOutputs};
use flotilla_sched::{Plan, PlanItem};

use crate::Clock;

/// One draft pass the worker ran, for the Scheduler's cost fit.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) struct DraftPass {
    /// Positions computed (catch-up tokens included).
    pub tokens: usize,
    /// Sequences in the pass.
    pub rows: usize,
    pub time: Duration,
}

/// What the draft's half of one block holds.
#[derive(Clone, Debug)]
struct Tag {
    /// [`chain`] of every token before the block.
    parent: u64,
    /// The tokens whose draft KV the block holds, from its first position.
    tokens: Vec<u32>,
}

pub(crate) struct DraftModel {
    exec: Box<dyn Executor>,
    out: StepOutputs,
    tags: Vec<Option<Tag>>,
    block_size: usize,
    /// Most positions one pass may hold (the draft executor's batch).
    max_tokens: usize,
    /// Passes since the last step result.
    pub(crate) passes: Vec<DraftPass>,
    /// Modelled time of the passes since the last step, where the draft
    /// executor's time is modelled (the simulator's): the worker sleeps it
    /// with the step's.
    pub(crate) modelled: Duration,
    /// A guess whose probability under the draft is below this is not
    /// proposed, and its sequence drafts no further this step (the item's
    /// draft shrinks; its positions go back to the pool with the step).
    p_min: f32,
    /// Set when the draft executor failed beyond a request's fault: no
    /// more drafts are proposed.
    broken: Option<String>,
}

/// One sequence being drafted for.
struct Row {
    item: usize,
    /// Its known tokens: the history and the item's tokens before the draft.
    full: Vec<u32>,
    /// Positions whose draft KV is written (trusted or computed now).
    done: usize,
    guesses: Vec<u32>,
    /// Of the guesses, those whose draft KV a pass wrote (each pass
    /// computes the guess before the one it samples).
    wrote: usize,
}

impl DraftModel {
    /// A draft executor whose KV cache has the target's blocks (count and
    /// tokens per block).
    pub(crate) fn new(exec: Box<dyn Executor>, max_tokens: usize, p_min: f32) -> DraftModel {
        let spec = exec.kv_spec();
        DraftModel {
            p_min,
            tags: vec![None; spec.num_blocks],
            block_size: spec.block_size.max(1),
            max_tokens: max_tokens.max(1),
            exec,
            out: StepOutputs::default(),
            passes: Vec::new(),
            modelled: Duration::ZERO,
            broken: None,
        }
    }

    /// Blocks whose draft half holds some sequence's KV.
    pub(crate) fn blocks_with_kv(&self) -> usize {
        self.tags.iter().filter(|t| t.is_some()).count()
    }

    /// How many of `full`'s first positions have trustworthy draft KV in
    /// the blocks of `table`.
    pub(crate) fn valid(&self, full: &[u32], table: &[u32]) -> usize {
        let bs = self.block_size;
        let mut h = SEED;
        for (i, chunk) in full.chunks(bs).enumerate() {
            let tag = table
                .get(i)
                .and_then(|&b| self.tags.get(b as usize))
                .and_then(Option::as_ref);
            let Some(tag) = tag.filter(|t| t.parent == h) else {
                return i * bs;
            };
            let same = tag
                .tokens
                .iter()
                .zip(chunk)
                .take_while(|(a, b)| a == b)
                .count();
            if same < chunk.len() {
                return i * bs + same;
            }
            h = chain(h, chunk);
        }
        full.len()
    }

    /// Records that the draft's KV of `written` (a sequence's tokens, the
    /// first `from` of them already recorded) is in `table`'s blocks.
    pub(crate) fn record(&mut self, written: &[u32], table: &[u32], from: usize) {
        let bs = self.block_size;
        let mut h = SEED;
        for (i, chunk) in written.chunks(bs).enumerate() {
            if (i + 1) * bs > from
                && let Some(slot) = table.get(i).and_then(|&b| self.tags.get_mut(b as usize))
            {
                *slot = Some(Tag {
                    parent: h,
                    tokens: chunk.to_vec(),
                });
            }
            h = chain(h, chunk);
        }
    }

    /// Replaces the placeholders of `plan`'s model-drafted items with the
    /// draft's greedy guesses (under each item's bias): first the KV the
    /// draft lacks (in passes of at most `max_tokens` positions), then one
    /// pass per draft position, every sequence still drafting together. A
    /// pass that fails leaves the rest of the placeholders as they are: a
    /// draft is only a guess, which the step verifies.
    pub(crate) fn fill(&mut self, clock: &dyn Clock, plan: &mut Plan) {
        if self.broken.is_some() {
            // Nothing is proposed: the items decode plainly (their
            // positions go back), and the acceptance, which counts each
            // as a cut, soon stops the Scheduler planning drafts.
            for it in plan.items.iter_mut().filter(|it| it.model_draft.is_some()) {
                let at = it.tokens.len() - it.draft;
                it.tokens.truncate(at);
                it.draft = 0;
            }
            return;
        }
        let mut rows: Vec<Row> = Vec::new();
        for (i, it) in plan.items.iter().enumerate() {
            let Some(history) = it.model_draft.as_ref().filter(|_| it.draft > 0) else {
                continue;
            };
            let known = it.tokens.len() - it.draft;
            let mut full = Vec::with_capacity(history.len() + known);
            full.extend_from_slice(history);
            full.extend_from_slice(&it.tokens[..known]);
            if full.is_empty() || full.len() != it.start_pos + known {
                continue;
            }
            // At least the last known token is computed: its logits give
            // the first guess.
            let done = self.valid(&full, &it.block_table).min(full.len() - 1);
            rows.push(Row {
                item: i,
                done,
                full,
                guesses: Vec::new(),
                wrote: 0,
            });
        }
        let trusted: Vec<usize> = rows.iter().map(|r| r.done).collect();
        self.run(clock, plan, &mut rows);
        for (r, from) in rows.iter().zip(trusted) {
            let it = &plan.items[r.item];
            let mut written = r.full[..r.done].to_vec();
            if r.done == r.full.len() {
                written.extend_from_slice(&r.guesses[..r.wrote]);
            }
            self.record(&written, &it.block_table, from);
        }
        let mut guesses: Vec<Option<Vec<u32>>> = vec![None; plan.items.len()];
        for r in rows {
            guesses[r.item] = Some(r.guesses);
        }
        for (it, g) in plan.items.iter_mut().zip(guesses) {
            if it.model_draft.is_none() {
                continue;
            }
            // Only what the draft proposed is verified: a shorter draft
            // (a pass that failed, a guess it was unsure of, an item it
            // could not take) gives its other positions back with the step.
            let g = g.unwrap_or_default();
            let at = it.tokens.len() - it.draft;
            let keep = g.len().min(it.draft);
            it.tokens.truncate(at + keep);
            it.draft = keep;
            it.tokens[at..].copy_from_slice(&g[..keep]);
        }
    }

    /// The passes of [`DraftModel::fill`].
    fn run(&mut self, clock: &dyn Clock, plan: &Plan, rows: &mut [Row]) {
        // Catch-up: while the rows' missing positions exceed one pass,
        // compute all but each row's last known token, without logits.
        loop {
            let total: usize = rows.iter().map(|r| r.full.len() - r.done).sum();
            if total <= self.max_tokens {
                break;
            }
            let mut budget = self.max_tokens;
            let mut took = Vec::new();
            for (n, r) in rows.iter().enumerate() {
                let n_tok = (r.full.len() - r.done - 1).min(budget);
                if n_tok > 0 {
                    took.push((n, n_tok));
                    budget -= n_tok;
                }
            }
            if took.is_empty() {
                // More rows than a pass holds: the passes below refuse it.
                break;
            }
            let inputs: Vec<SeqInput<'_>> = took
                .iter()
                .map(|&(n, n_tok)| {
                    let r = &rows[n];
                    SeqInput {
                        tokens: &r.full[r.done..r.done + n_tok],
                        start_pos: r.done,
                        block_table: &plan.items[r.item].block_table,
                        output: OutputKind::None,
                        bias: &[],
                        draft_bias: &[],
                        allow: None,
                    }
                })
                .collect();
            if !self.pass(clock, &inputs) {
                return;
            }
            for (n, n_tok) in took {
                rows[n].done += n_tok;
            }
        }
        // Greedy, with the guess's log-probability (its confidence).
        let greedy = SamplingParams {
            logprobs: true,
            ..SamplingParams::greedy()
        };
        let floor = self.p_min.ln();
        let longest = rows
            .iter()
            .map(|r| plan.items[r.item].draft)
            .max()
            .unwrap_or(0);
        for j in 0..longest {
            let live: Vec<usize> = (0..rows.len())
                .filter(|&n| plan.items[rows[n].item].draft > j && rows[n].guesses.len() == j)
                .collect();
            if live.is_empty() {
                return;
            }
            let inputs: Vec<SeqInput<'_>> = live
                .iter()
                .map(|&n| {
                    let r = &rows[n];
                    let it: &PlanItem = &plan.items[r.item];
                    let (tokens, start_pos) = if j == 0 {
                        (&r.full[r.done..], r.done)
                    } else {
                        (&r.guesses[j - 1..j], r.full.len() + j - 1)
                    };
                    SeqInput {
                        tokens,
                        start_pos,
                        block_table: &it.block_table,
                        output: OutputKind::Sample(greedy),
                        bias: &it.bias,
                        draft_bias: &[],
                        allow: None,
                    }
                })
                .collect();
            if !self.pass(clock, &inputs) {
                return;
            }
            for (k, &n) in live.iter().enumerate() {
                let r = &mut rows[n];
                if j == 0 {
                    r.done = r.full.len();
                } else {
                    r.wrote = j;
                }
                // An unsure guess is not proposed: the row stops here (a
                // guess without a log-probability, NaN, is proposed).
                if let Some(t) = self.out.seqs.get(k).and_then(|o| o.sampled.as_ref())
                    && t.logprob.partial_cmp(&floor) != Some(std::cmp::Ordering::Less)
                {
                    r.guesses.push(t.token);
                }
            }
        }
    }

    /// One pass of the draft executor, timed; false if it failed.
    fn pass(&mut self, clock: &dyn Clock, inputs: &[SeqInput<'_>]) -> bool {
        let t0 = clock.now();
        let (exec, out) = (&mut self.exec, &mut self.out);
        let mut run =
            || std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| exec.step(inputs, out)));
        let r = if crate::on_multi_thread_runtime() {
            tokio::task::block_in_place(run)
        } else {
            run()
        };
        let modelled = exec.simulated_step_time();
        let time = modelled.unwrap_or_else(|| clock.now().saturating_sub(t0));
        if let (Some(m), Ok(Ok(()))) = (modelled, &r) {
            self.modelled += m;
        }
        match r {
            Ok(Ok(())) => {
                self.passes.push(DraftPass {
                    tokens: inputs.iter().map(|i| i.tokens.len()).sum(),
                    rows: inputs.len(),
                    time,
                });
                true
            }
            Ok(Err(e @ flotilla_exec::ExecError::Backend(_)))
            | Ok(Err(e @ flotilla_exec::ExecError::Lost(_))) => {
                tracing::error!(error = %e, "the draft model failed; no more model drafts");
                self.broken = Some(e.to_string());
                false
            }
            Ok(Err(e)) => {
                tracing::debug!(error = %e, "a draft pass failed; the placeholders stay");
                false
            }
            Err(_) => {
                tracing::error!("the draft model panicked; no more model drafts");
                self.broken = Some("the draft model panicked".into());
                false
            }
        }
    }
}

const SEED: u64 = 0x9e37_79b9_7f4a_7c15;

/// `h` extended by `tokens` (a hash chain over a sequence's blocks).
fn chain(h: u64, tokens: &[u32]) -> u64 {
    tokens.iter().fold(h, |h, &t| {
        (h.rotate_left(5) ^ u64::from(t)).wrapping_mul(0x517c_c1b7_2722_0a95)
    }) ^ tokens.len() as u64
}
