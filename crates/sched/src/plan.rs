//! Planning one step: running sequences first (decodes, then prefill chunks),
//! then admissions by weighted fair share, under one token budget, with
//! preemption by recompute when KV blocks or seats run out (vLLM v1's shape).

use std::cmp::Reverse;
use std::time::Duration;

use flotilla_exec::{OutputKind, SeqInput};
use flotilla_kv::{AllocError, Lease, Owner};
use flotilla_proto::{EngineFailure, RequestId, SamplingParams, TierId};

use crate::seq::Seq;
use crate::{Batching, SchedEvent, Scheduler};

/// One step's work for the executor: a flat batch, one item per sequence.
#[derive(Clone, Debug, PartialEq)]
pub struct Plan {
    /// Step number; `complete` and `fail_step` check it.
    pub step: u64,
    /// Prefill chunks and decode tokens, each for a different sequence.
    pub items: Vec<PlanItem>,
    /// Decode steps to run back to back (`SchedConfig::decode_steps`),
    /// each step's samples the next one's tokens; 1 for every plan but a
    /// multi-step decode, whose items are all one-token samples with no
    /// draft and leases that cover every step. The worker may stop after
    /// fewer ([`Plan::is_multi_step`]); `complete` takes what ran.
    pub steps: usize,
}

impl Plan {
    /// The masks this step's samples need, to compute while it runs.
    pub fn masks(&self) -> Vec<std::sync::Arc<flotilla_exec::MaskCell>> {
        self.items.iter().filter_map(|i| i.allow.clone()).collect()
    }

    /// Whether it holds several decode steps.
    pub fn is_multi_step(&self) -> bool {
        self.steps > 1
    }

    /// Nothing to run.
    pub fn is_empty(&self) -> bool {
        self.items.is_empty()
    }

    /// Tokens the step computes (at most `max_num_batched_tokens`).
    pub fn num_tokens(&self) -> usize {
        self.items.iter().map(|i| i.tokens.len()).sum()
    }
}

/// One sequence's part of a step: a prefill chunk or one decode token.
#[derive(Clone, Debug, PartialEq)]
pub struct PlanItem {
    /// The request.
    pub id: RequestId,
    /// Tokens to compute (at least one), at positions `start_pos..start_pos + tokens.len()`.
    pub tokens: Vec<u32>,
    /// Position of `tokens[0]`; every earlier position is already in the KV cache.
    pub start_pos: usize,
    /// Physical KV block of each logical block, covering every position of the chunk.
    pub block_table: Vec<u32>,
    /// Sample the next token with these parameters: only when the chunk ends the known tokens.
    pub sample: Option<SamplingParams>,
    /// Added to the logits before that sample: the request's `logit_bias`
    /// with its presence and frequency penalties over the tokens generated
    /// so far folded in, a token at most once, in token order. Empty when
    /// not sampling or when the request has neither.
    pub bias: Vec<(u32, f32)>,
    /// With a draft and penalties, the bias of each verify position after
    /// the first, the draft tokens before it counted as generated
    /// ([`SeqInput::draft_bias`]); empty otherwise.
    pub draft_bias: Vec<Vec<(u32, f32)>>,
    /// The tokens that sample may pick, a bitmask from the request's
    /// constraint (`None`: any; with a draft, one per verify position),
    /// computed while the step runs: by the
    /// Scheduler's actor right after it sends the plan ([`Plan::masks`]),
    /// or by the executor when it samples, whichever comes first.
    pub allow: Option<std::sync::Arc<flotilla_exec::MaskCell>>,
    /// Draft tokens at the end of `tokens` (speculative decoding), verified
    /// by the step ([`OutputKind::Verify`]); 0 for every other item. They
    /// are not the sequence's tokens until the executor accepts them.
    pub draft: usize,
    /// A self-draft: the draft tokens are placeholders, which the
    /// GpuWorker replaces before the step with the model's own greedy
    /// guesses through its first `self_draft` layers
    /// (`Executor::draft_step`, one pass per draft token). 0: the tokens
    /// are the draft (or there is none).
    pub self_draft: usize,
    /// A draft model's draft: the draft tokens are placeholders, which the
    /// GpuWorker replaces before the step with the draft model's greedy
    /// guesses (under the item's `bias`). Holds the sequence's tokens
    /// before `start_pos`: the draft model's KV (in the same blocks, its
    /// own bytes) may lack any of them (a prefix cached by a sequence that
    /// never drafted, KV moved in from another node or the offload tier),
    /// and the worker computes what it lacks first. `None`: no model draft.
    pub model_draft: Option<Vec<u32>>,
    /// The draft tokens as planned: `draft` at first; a model draft the
    /// worker shortened (a guess the draft model was unsure of) keeps the
    /// planned length here, whose positions the step gives back.
    pub draft_planned: usize,
}

impl PlanItem {
    /// The executor's view of this item.
    pub fn seq_input(&self) -> SeqInput<'_> {
        SeqInput {
            tokens: &self.tokens,
            start_pos: self.start_pos,
            block_table: &self.block_table,
            output: match (self.sample, self.draft) {
                (None, _) => OutputKind::None,
                (Some(p), 0) => OutputKind::Sample(p),
                (Some(params), draft) => OutputKind::Verify { params, draft },
            },
            bias: &self.bias,
            draft_bias: &self.draft_bias,
            allow: self.allow.as_deref(),
        }
    }
}

/// How long a tier's latency budget outlives its work (see
/// `Scheduler::step_protection`).
pub const PROTECT_LINGER: Duration = Duration::from_millis(250);

/// The step being planned: chunks chosen so far and the budget left. Tokens
/// and block tables are copied only at the end, once preemptions are settled.
#[derive(Debug)]
pub(crate) struct Draft {
    /// `(request, start position, tokens, tier charged for prefill tokens)`.
    pub(crate) chunks: Vec<(RequestId, usize, usize, Option<usize>)>,
    /// Draft tokens guessed for some decodes (speculative decoding), whose
    /// positions the leases already cover.
    pub(crate) guesses: Vec<(RequestId, Vec<u32>)>,
    /// Of those, the ones whose tokens are placeholders for a self-draft.
    pub(crate) self_drafted: Vec<RequestId>,
    /// And those whose placeholders the draft model fills.
    pub(crate) model_drafted: Vec<RequestId>,
    pub(crate) budget: usize,
    /// Prefill tokens each tier may still add this step (see
    /// [`Scheduler::prefill_caps`]).
    prefill_left: Vec<usize>,
    /// While a tier with a latency budget has work: the most tokens the
    /// step may hold once less protected tiers' work is added (see
    /// [`Scheduler::step_protection`]).
    protect: Option<usize>,
    /// Per tier: less protected than the tier that set `protect`.
    lower: Vec<bool>,
    /// The step's budget before anything was planned.
    initial: usize,
    /// Under a step time target (`SchedConfig::step_time_max`): the
    /// measured step cost and the target, seconds; prefill chunks and
    /// drafts fill the step only up to it.
    chunk_cap: Option<(crate::CostLine, f64)>,
    /// Prefill tokens a step may take past `chunk_cap`, so prompts advance
    /// even when decodes alone reach it.
    chunk_floor: usize,
    /// Prefill tokens planned so far.
    chunked: usize,
    /// Most sequences this plan takes: all of them with one step in
    /// flight; with several (a pipeline's stages each working on one),
    /// the free sequences' share of the steps still to plan, so the
    /// steps in flight hold even parts of the batch.
    seq_cap: usize,
}

impl Draft {
    fn has(&self, id: RequestId) -> bool {
        self.chunks.iter().any(|c| c.0 == id)
    }

    /// Tokens any chunk of `tier` may take now: the step's budget, and for
    /// a tier below a latency budget what is left of that budget.
    pub(crate) fn room(&self, tier: usize) -> usize {
        match self.protect {
            Some(max) if self.lower[tier] => {
                let planned = self.initial - self.budget;
                self.budget.min(max.saturating_sub(planned))
            }
            _ => self.budget,
        }
    }

    /// Whether `tier` is below this step's latency budget.
    pub(crate) fn is_lower(&self, tier: usize) -> bool {
        self.protect.is_some() && self.lower[tier]
    }

    /// Tokens a prefill chunk of `tier` may take now.
    fn prefill_room(&self, tier: usize) -> usize {
        self.room(tier).min(self.prefill_left[tier])
    }

    /// Seconds the step planned so far costs by `c`: a decode is a token
    /// and an output, a chunk its tokens and (perhaps) one output, a draft
    /// token a token and an output.
    fn planned_secs(&self, c: &crate::CostLine) -> f64 {
        let chunks: f64 = self
            .chunks
            .iter()
            .map(|ch| ch.2 as f64 * c.per_token + c.per_output)
            .sum();
        let drafts: usize = self.guesses.iter().map(|g| g.1.len()).sum();
        c.fixed + chunks + drafts as f64 * c.per_decode()
    }

    /// Tokens a prefill chunk (`prefill`; it may use the per-step floor)
    /// or draft tokens may add under the step time target; unlimited
    /// without one.
    pub(crate) fn chunk_room(&self, prefill: bool) -> usize {
        let Some((c, target)) = &self.chunk_cap else {
            return usize::MAX;
        };
        let left = target - self.planned_secs(c);
        let per = if prefill { c.per_token } else { c.per_decode() };
        // Chunks pay their output once: counted in the left time.
        let left = if prefill { left - c.per_output } else { left };
        let fits = crate::cost::fits(left, per);
        if prefill {
            fits.max(self.chunk_floor.saturating_sub(self.chunked))
        } else {
            fits
        }
    }

    /// Adds a chunk; `prefill_tier` charges it to that tier's prefill cap;
    /// `prefill`: it is not a decode.
    fn push(
        &mut self,
        id: RequestId,
        start: usize,
        len: usize,
        prefill_tier: Option<usize>,
        prefill: bool,
    ) {
        assert!(len > 0 && len <= self.budget && !self.has(id));
        if prefill {
            self.chunked += len;
        }
        if let Some(t) = prefill_tier {
            assert!(
                len <= self.prefill_left[t],
                "prefill cap of tier {t} exceeded"
            );
            self.prefill_left[t] -= len;
        }
        self.budget -= len;
        self.chunks.push((id, start, len, prefill_tier));
    }

    /// Drops a preempted sequence's chunk and gives its tokens back.
    fn remove(&mut self, id: RequestId) {
        if let Some(i) = self.chunks.iter().position(|c| c.0 == id) {
            let (_, _, len, tier) = self.chunks.remove(i);
            self.budget += len;
            if let Some(t) = tier {
                self.prefill_left[t] += len;
            }
        }
    }
}

/// What became of one admission attempt.
enum Admit {
    Admitted,
    /// No seat for this tier now (seats go by share through preemption); try other tiers.
    NoSeat,
    /// Not enough KV blocks for it now (or not without taking held ones).
    NoBlocks,
    /// The tenant is at its KV quota; try its tier's other tenants.
    TenantBlocked,
    /// It can never fit and was failed.
    Failed,
}

/// KV blocks kept this step for a queue head that could not get enough:
/// later admissions may not lower what `owner` could take below `available`.
#[derive(Clone, Copy, Debug)]
struct Hold {
    owner: Owner,
    available: u32,
}

impl Scheduler {
    /// Plans the next step (first failing queued requests past their deadline);
    /// at most [`Scheduler::set_depth`] plans are in flight (one by
    /// default), over disjoint sequences: `complete` or `fail_step` one
    /// before planning past that.
    pub fn schedule(&mut self, now: Duration) -> Plan {
        assert!(
            self.in_flight.len() < self.depth,
            "schedule called while steps {:?} are in flight (at most {})",
            self.in_flight,
            self.depth
        );
        self.expire(now);
        let (protect, lower) = self.step_protection(now);
        let chunk_cap = match (self.cfg.batching, self.cfg.step_time_max) {
            (Batching::Continuous, Some(t)) => self.step_cost.line().map(|c| (c, t.as_secs_f64())),
            _ => None,
        };
        let mut draft = Draft {
            chunks: Vec::with_capacity(self.cfg.max_num_seqs),
            guesses: Vec::new(),
            self_drafted: Vec::new(),
            model_drafted: Vec::new(),
            budget: self.cfg.max_num_batched_tokens,
            prefill_left: self.prefill_caps(),
            protect,
            lower,
            initial: self.cfg.max_num_batched_tokens,
            chunk_cap,
            chunk_floor: self.cfg.block_size as usize,
            chunked: 0,
            seq_cap: self.seq_cap(),
        };
        self.schedule_running(&mut draft);
        let admit = match self.cfg.batching {
            Batching::Continuous => true,
            // A static batch takes no joins until every member has left.
            Batching::Static => self.running.is_empty(),
        };
        if admit {
            self.admit_waiting(now, &mut draft);
        }
        // Last: a draft takes only what no decode, prompt or admission wanted.
        self.add_drafts(&mut draft);
        let steps = self.decode_steps(&draft);
        self.finalize(draft, steps)
    }

    /// Sequences the next plan may take (see `Draft::seq_cap`).
    fn seq_cap(&self) -> usize {
        if self.depth <= 1 {
            return usize::MAX;
        }
        // (A sequence cancelled in flight is in `busy` until its step ends,
        // no longer in `running`.)
        let free = self
            .running
            .iter()
            .filter(|id| !self.busy.contains(id))
            .count();
        let queued: usize = self.tier_queued.iter().sum();
        let slots = self.depth - self.in_flight.len();
        (free + queued).div_ceil(slots).max(1)
    }

    /// How many decode steps the plan may hold (`SchedConfig::decode_steps`):
    /// more than one only when the steps after the first would be the same
    /// batch with nothing decided between them: every running sequence
    /// decodes, nothing waits, no draft, every sequence can sample several
    /// tokens unwatched ([`Seq::may_multi_step`]), none reaches its length
    /// before the last step (so each one's last token ends a plan), and the
    /// pool's free blocks cover every step (a multi-step plan never evicts
    /// a cached prefix or preempts). The leases are grown here.
    fn decode_steps(&mut self, draft: &Draft) -> usize {
        let max = self.cfg.decode_steps;
        // A draft may come at any step while speculation is on.
        if max <= 1
            || self.depth > 1
            || self.cfg.speculation.max_draft > 0
            || self.cfg.batching != Batching::Continuous
            || !draft.guesses.is_empty()
            || draft.chunks.len() != self.running.len()
            || self.tier_queued.iter().any(|&q| q > 0)
        {
            return 1;
        }
        let mut steps = max;
        let bs = self.cfg.block_size as usize;
        for &(id, start, len, _) in &draft.chunks {
            let seq = &self.seqs[&id];
            if len != 1
                || start + 1 != seq.tokens.len()
                || !seq.may_multi_step(&self.cfg.stop_tokens)
            {
                return 1;
            }
            steps = steps
                .min(seq.max_tokens.saturating_sub(seq.generated()))
                .min(self.cfg.max_model_len.saturating_sub(seq.tokens.len()));
            if steps <= 1 {
                return 1;
            }
        }
        // As many steps as the free blocks cover.
        let free = self.pool.usage().free as usize;
        let need = |steps: usize| -> usize {
            draft
                .chunks
                .iter()
                .map(|&(id, start, _, _)| {
                    let have = self.seqs[&id]
                        .lease
                        .as_ref()
                        .map_or(0, |l| l.blocks().len());
                    (start + steps).div_ceil(bs).saturating_sub(have)
                })
                .sum()
        };
        while steps > 1 && need(steps) > free {
            steps -= 1;
        }
        if steps <= 1 {
            return 1;
        }
        for (n, &(id, start, _, _)) in draft.chunks.iter().enumerate() {
            let seq = self.seqs.get_mut(&id).expect("planned sequence exists");
            let lease = seq.lease.as_mut().expect("planned sequence is running");
            // Quota and other tiers' reservations still apply.
            if self.pool.grow(lease, start + steps).is_err() {
                for &(id, start, _, _) in &draft.chunks[..n] {
                    let seq = self.seqs.get_mut(&id).expect("planned sequence exists");
                    let lease = seq.lease.as_mut().expect("planned sequence is running");
                    self.pool.truncate(lease, start + 1);
                }
                return 1;
            }
        }
        steps
    }

    /// Prefill tokens each tier may add to one step. While a more protected
    /// tier has work (running or waiting), a less protected tier's prompts
    /// get only its weighted share of the step budget: a step full of free
    /// prompts would otherwise make a paid request wait a long step before
    /// its own prefill, and share that step too (paid TTFT under a free
    /// flood). Decodes are never capped; without higher-tier work, or in
    /// static mode, nothing is.
    fn prefill_caps(&self) -> Vec<usize> {
        let ntiers = self.cfg.tiers.len();
        let budget = self.cfg.max_num_batched_tokens;
        if self.cfg.batching == Batching::Static {
            return vec![usize::MAX; ntiers];
        }
        let active = self.active_tiers();
        let top = (0..ntiers)
            .filter(|&t| active[t])
            .map(|t| self.cfg.tiers[t].priority)
            .max();
        let weights: u64 = (0..ntiers)
            .filter(|&t| active[t])
            .map(|t| u64::from(self.cfg.tiers[t].weight))
            .sum();
        (0..ntiers)
            .map(|t| match top {
                Some(p) if active[t] && self.cfg.tiers[t].priority < p => {
                    let share =
                        budget as u64 * u64::from(self.cfg.tiers[t].weight) / weights.max(1);
                    (share as usize).max(1)
                }
                _ => usize::MAX,
            })
            .collect()
    }

    /// Tiers with work (running or waiting), by index.
    fn active_tiers(&self) -> Vec<bool> {
        let mut active = vec![false; self.cfg.tiers.len()];
        for id in &self.running {
            active[self.seqs[id].tier] = true;
        }
        for (n, q) in self.waiting.iter().enumerate() {
            if !q.is_empty() {
                active[usize::from(self.cfg.tenants[n].tier.0)] = true;
            }
        }
        active
    }

    /// The latency budget of this step: when the most protected tiers with
    /// work have `step_tokens_max` (the smallest, if several share the top
    /// priority), the step holds at most that many tokens once less
    /// protected tiers' work is added; and which tiers those are.
    /// A budget lingers for [`PROTECT_LINGER`] after the protected tier's
    /// work ends: a client's next request (or a stream's next turn) then
    /// finds a short step in flight, not a full one of lower-tier prompts.
    fn step_protection(&mut self, now: Duration) -> (Option<usize>, Vec<bool>) {
        let (max, lower) = self.step_protection_now();
        if let Some(m) = max {
            self.protect_linger = Some((now + PROTECT_LINGER, m, lower.clone()));
            return (Some(m), lower);
        }
        match &self.protect_linger {
            Some((until, m, l)) if now < *until => (Some(*m), l.clone()),
            _ => {
                self.protect_linger = None;
                (None, lower)
            }
        }
    }

    fn step_protection_now(&self) -> (Option<usize>, Vec<bool>) {
        let ntiers = self.cfg.tiers.len();
        let no = (None, vec![false; ntiers]);
        if self.cfg.batching == Batching::Static
            || self
                .cfg
                .tiers
                .iter()
                .all(|t| t.step_tokens_max.is_none() && t.step_time_max.is_none())
        {
            return no;
        }
        let active = self.active_tiers();
        let Some(top) = (0..ntiers)
            .filter(|&t| active[t])
            .map(|t| self.cfg.tiers[t].priority)
            .max()
        else {
            return no;
        };
        let max = (0..ntiers)
            .filter(|&t| active[t] && self.cfg.tiers[t].priority == top)
            .filter_map(|t| self.tier_step_max(t))
            .min();
        let lower = (0..ntiers)
            .map(|t| self.cfg.tiers[t].priority < top)
            .collect::<Vec<_>>();
        match max {
            Some(m) if lower.iter().any(|&l| l) => (Some(m), lower),
            _ => no,
        }
    }

    /// A tier's latency budget in tokens: its `step_tokens_max`, and what
    /// its `step_time_max` allows by the measured step cost, the smaller.
    fn tier_step_max(&self, t: usize) -> Option<usize> {
        let tier = &self.cfg.tiers[t];
        let timed = tier
            .step_time_max
            .and_then(|d| self.step_cost.tokens_within(d));
        match (tier.step_tokens_max, timed) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        }
    }

    /// Whether a sequence's prefill counts against its tier's cap: a prompt
    /// not yet answered does; a preempted sequence recomputing what it had
    /// does not, or a higher tier's growth could preempt it again before it
    /// caught up, every time (starvation).
    fn prefill_capped(seq: &Seq) -> bool {
        seq.tokens.len() == seq.prompt_len
    }

    /// Gives every running sequence its next chunk, decodes before prefill
    /// chunks so a long prompt never costs a decode its step (bounded TPOT).
    /// Under a latency budget ([`Scheduler::step_protection`]) the protected
    /// tiers' sequences go first, then the less protected ones from a
    /// rotating start, so that when only some of them fit each gets its turn.
    fn schedule_running(&mut self, draft: &mut Draft) {
        let mut ids = std::mem::take(&mut self.scratch);
        let groups: &[Option<bool>] = if draft.protect.is_some() {
            &[Some(false), Some(true)]
        } else {
            &[None]
        };
        for &group in groups {
            let mut served = 0;
            for decode_pass in [true, false] {
                ids.clear();
                ids.extend(self.running.iter().copied().filter(|id| {
                    group.is_none_or(|lower| draft.lower[self.seqs[id].tier] == lower)
                }));
                if group == Some(true) && !ids.is_empty() {
                    let k = self.lower_cursor % ids.len();
                    ids.rotate_left(k);
                }
                for &id in &ids {
                    if draft.budget == 0 || draft.chunks.len() >= draft.seq_cap {
                        break;
                    }
                    let seq = &self.seqs[&id];
                    // Preempted earlier in this pass, already planned, or
                    // in a step in flight.
                    if !seq.is_running() || draft.has(id) || self.busy.contains(&id) {
                        continue;
                    }
                    let n = seq.to_compute();
                    if decode_pass != (n == 1) {
                        continue;
                    }
                    let start = seq.num_computed;
                    let capped = (!decode_pass && Self::prefill_capped(seq)).then_some(seq.tier);
                    let room = capped.map_or(draft.room(seq.tier), |t| draft.prefill_room(t));
                    let room = if decode_pass {
                        room
                    } else {
                        room.min(draft.chunk_room(true))
                    };
                    let chunk = n.min(room);
                    if chunk == 0 {
                        continue;
                    }
                    if self.grow_running(id, start + chunk, draft) {
                        draft.push(id, start, chunk, capped, !decode_pass);
                        if decode_pass {
                            served += 1;
                        }
                    }
                }
            }
            if group == Some(true) {
                self.lower_cursor = self.lower_cursor.wrapping_add(served);
            }
        }
        self.scratch = ids;
    }

    /// Grows a running sequence's lease to `tokens`, preempting the lowest
    /// tier's youngest sequences (never a more protected tier) until it fits;
    /// false if it was the one preempted.
    fn grow_running(&mut self, id: RequestId, tokens: usize, draft: &mut Draft) -> bool {
        loop {
            let seq = self.seqs.get_mut(&id).expect("running sequence");
            let lease = seq.lease.as_mut().expect("running sequence has a lease");
            let same_tenant_only = match self.pool.grow(lease, tokens) {
                Ok(()) => return true,
                Err(AllocError::NoBlocks { .. }) => false,
                // Only the tenant's own sequences give back quota.
                Err(AllocError::Quota { .. }) => true,
            };
            let victim = self.victim_for_running(id, same_tenant_only);
            self.preempt(victim, draft);
            if victim == id {
                return false;
            }
        }
    }

    /// Lowest priority first, youngest first, never above `needy`'s priority;
    /// `needy` itself qualifies, so there is always one.
    fn victim_for_running(&self, needy: RequestId, same_tenant_only: bool) -> RequestId {
        let n = &self.seqs[&needy];
        let prio = self.cfg.tiers[n.tier].priority;
        let victim = self
            .running
            .iter()
            .filter(|id| !self.busy.contains(id))
            .map(|id| &self.seqs[id])
            .filter(|s| self.cfg.tiers[s.tier].priority <= prio)
            .filter(|s| !same_tenant_only || s.tenant == n.tenant)
            .min_by_key(|s| (self.cfg.tiers[s.tier].priority, Reverse(s.admit_seq)));
        victim.expect("the needy sequence is its own candidate").id
    }

    /// For a waiting request of `tier`: a running sequence of a strictly less
    /// protected tier that holds more than its weighted share of seats (so
    /// that tier keeps its share and never starves); lowest priority, youngest first.
    fn victim_for_admission(&self, tier: usize) -> Option<RequestId> {
        let prio = self.cfg.tiers[tier].priority;
        let demand_weight: u64 = (0..self.cfg.tiers.len())
            .filter(|&t| self.tier_queued[t] + self.tier_running[t] > 0)
            .map(|t| u64::from(self.cfg.tiers[t].weight))
            .sum();
        let seats = self.cfg.max_num_seqs as u64;
        let over_share = |t: usize| {
            self.tier_running[t] as u64 * demand_weight
                > seats * u64::from(self.cfg.tiers[t].weight)
        };
        self.running
            .iter()
            .filter(|id| !self.busy.contains(id))
            .map(|id| &self.seqs[id])
            .filter(|s| self.cfg.tiers[s.tier].priority < prio && over_share(s.tier))
            .min_by_key(|s| (self.cfg.tiers[s.tier].priority, Reverse(s.admit_seq)))
            .map(|s| s.id)
    }

    /// At most the blocks `victim_for_admission(tier)` could free, however
    /// often it is called: every lease of a less protected tier (a shared
    /// block frees less, a tier at its share is never picked).
    fn reclaimable_for_admission(&self, tier: usize) -> u64 {
        let prio = self.cfg.tiers[tier].priority;
        self.running
            .iter()
            .filter(|id| !self.busy.contains(id))
            .map(|id| &self.seqs[id])
            .filter(|s| self.cfg.tiers[s.tier].priority < prio)
            .filter_map(|s| s.lease.as_ref())
            .map(|l| l.blocks().len() as u64)
            .sum()
    }

    /// Recompute preemption: the lease goes back, every known token stays, and
    /// the request returns to the front of its tenant's queue.
    fn preempt(&mut self, id: RequestId, draft: &mut Draft) {
        let seq = self
            .seqs
            .get_mut(&id)
            .expect("preempting an unknown request");
        let lease = seq
            .lease
            .take()
            .expect("preempting a sequence that is not running");
        self.pool.free(lease);
        seq.num_computed = 0;
        let (tier, tenant) = (seq.tier, seq.tenant);
        let pos = self.running.iter().position(|&r| r == id);
        self.running
            .remove(pos.expect("running sequence in the batch"));
        self.tier_running[tier] -= 1;
        self.tier_queued[tier] += 1;
        self.waiting[tenant].push_front(id);
        draft.remove(id);
        self.counters.preemptions += 1;
        self.events.push(SchedEvent::Preempted {
            id,
            tier: TierId(tier as u8),
        });
    }

    /// Admits waiting requests by weighted fair share while seats, budget and blocks last.
    ///
    /// The first head picked that cannot get its KV blocks holds them: later
    /// heads this step are admitted only if they leave it as many as it could
    /// take now. Otherwise, under steady load at KV capacity, other tiers take
    /// every block as it frees and a head needing several (a preempted
    /// request recomputing, which has no deadline) never gets back in.
    fn admit_waiting(&mut self, now: Duration, draft: &mut Draft) {
        let continuous = self.cfg.batching == Batching::Continuous;
        let mut tier_blocked = vec![false; self.cfg.tiers.len()];
        let mut tenant_blocked = vec![false; self.cfg.tenants.len()];
        let mut hold: Option<Hold> = None;
        loop {
            if continuous && (draft.budget == 0 || draft.chunks.len() >= draft.seq_cap) {
                break;
            }
            if !continuous && self.running.len() >= self.cfg.max_num_seqs {
                break;
            }
            let Some(tier) = self.pick_tier(&tier_blocked, &tenant_blocked) else {
                break;
            };
            let tenant = self
                .pick_tenant(tier, &tenant_blocked)
                .expect("pick_tier picks only tiers with a tenant waiting");
            let id = *self.waiting[tenant]
                .front()
                .expect("tenant has a request waiting");
            match self.try_admit(now, id, hold, draft) {
                Admit::Admitted | Admit::Failed => {}
                Admit::NoSeat => tier_blocked[tier] = true,
                Admit::NoBlocks => {
                    tier_blocked[tier] = true;
                    // A static batch frees nothing until it drains, and then
                    // the preferred head goes first anyway: nothing to hold.
                    if continuous && hold.is_none() {
                        let owner = Self::owner_of(&self.seqs[&id]);
                        let available = self.pool.available(owner);
                        hold = Some(Hold { owner, available });
                    }
                }
                Admit::TenantBlocked => tenant_blocked[tenant] = true,
            }
        }
    }

    /// The unblocked tier with the least service per weight; ties go to the
    /// more protected tier, then the lower index.
    fn pick_tier(&self, tier_blocked: &[bool], tenant_blocked: &[bool]) -> Option<usize> {
        let has_waiting = |t: usize| {
            self.tier_tenants[t]
                .iter()
                .any(|&n| !tenant_blocked[n] && !self.waiting[n].is_empty())
        };
        let tiers = (0..self.cfg.tiers.len()).filter(|&t| !tier_blocked[t] && has_waiting(t));
        self.tier_vtc
            .pick(tiers, |t| (Reverse(self.cfg.tiers[t].priority), t))
    }

    /// The unblocked tenant of `tier` with a waiting request and the smallest VTC counter.
    fn pick_tenant(&self, tier: usize, tenant_blocked: &[bool]) -> Option<usize> {
        let tenants = self.tier_tenants[tier]
            .iter()
            .copied()
            .filter(|&n| !tenant_blocked[n] && !self.waiting[n].is_empty());
        self.tenant_vtc.pick(tenants, |n| n)
    }

    /// Tries to move the head of a tenant's queue into the batch: a lease
    /// reusing its cached prefix, blocks for its first chunk, a seat. A
    /// running sequence is preempted for the seat only once the blocks are
    /// secured, so no victim loses its KV for an admission that then fails.
    fn try_admit(
        &mut self,
        now: Duration,
        id: RequestId,
        hold: Option<Hold>,
        draft: &mut Draft,
    ) -> Admit {
        let continuous = self.cfg.batching == Batching::Continuous;
        let (tier, tenant) = (self.seqs[&id].tier, self.seqs[&id].tenant);
        let capped = Self::prefill_capped(&self.seqs[&id]).then_some(tier);
        let room = capped
            .map_or(draft.room(tier), |t| draft.prefill_room(t))
            .min(draft.chunk_room(true));
        if continuous && room == 0 {
            // The tier's prefill share of this step is spent.
            return Admit::NoSeat;
        }
        let seat_free = |s: &Self| s.running.len() < s.cfg.max_num_seqs;
        // A static batch preempts nobody; a continuous one only by seat share.
        let can_seat = seat_free(self) || (continuous && self.victim_for_admission(tier).is_some());
        if !can_seat {
            return Admit::NoSeat;
        }
        let seq = self.seqs.get_mut(&id).expect("admitting a live request");
        let owner = Self::owner_of(seq);
        let salt = self.cfg.tenants[tenant].prefix_salt;
        let bs = self.cfg.block_size as usize;
        let known = seq.tokens.len();
        // Imported KV: its blocks already hold the prompt.
        let parked = seq.parked.take();
        let imported = parked.is_some();
        let (mut lease, cached) = match parked {
            Some(lease) => (lease, seq.prompt_len),
            None => {
                // Keep at least one token to compute: the step that computes it samples.
                let max_prefix_blocks = (known - 1) / bs;
                match self.pool.start(owner, salt, &seq.tokens, max_prefix_blocks) {
                    Ok(started) => started,
                    Err(AllocError::Quota { .. }) => return Admit::TenantBlocked,
                    Err(AllocError::NoBlocks { .. }) => return Admit::NoBlocks,
                }
            }
        };
        debug_assert!(cached < known && (imported || cached.is_multiple_of(bs)));
        let chunk = (known - cached).min(room);
        // A static batch is admitted once, so it takes blocks for every known
        // token now rather than discover at its second chunk that they are gone.
        let target = if continuous { cached + chunk } else { known };
        // Preempting for blocks is worth it only if the victims can free enough;
        // while blocks are held for another head, it waits its turn instead.
        let mut may_preempt = None;
        loop {
            let err = match self.pool.grow(&mut lease, target) {
                Ok(()) => break,
                Err(e) => e,
            };
            let victim = match err {
                AllocError::NoBlocks { need, available } if continuous && hold.is_none() => {
                    let worth = *may_preempt.get_or_insert_with(|| {
                        u64::from(available) + self.reclaimable_for_admission(tier)
                            >= u64::from(need)
                    });
                    worth.then(|| self.victim_for_admission(tier)).flatten()
                }
                _ => None,
            };
            if let Some(v) = victim {
                self.preempt(v, draft);
                continue;
            }
            let available = self.pool.available(owner);
            self.put_back(id, lease, imported);
            // With nothing else of its kind holding blocks, waiting cannot
            // help: fail it rather than stall its queue forever. Blocks
            // reserved for an import or held for an export come back (as
            // a sequence that runs and ends, or at their deadline), so
            // they count as holders too.
            let kv_of = |owner: Option<Owner>| {
                let mine = |l: &Lease| owner.is_none_or(|o| l.owner() == o);
                self.held.values().any(|h| mine(&h.lease))
                    || self.reservations.values().any(|r| mine(&r.lease))
            };
            let alone = match err {
                AllocError::NoBlocks { .. } => self.running.is_empty() && !kv_of(None),
                AllocError::Quota { .. } => {
                    !self.running.iter().any(|r| self.seqs[r].tenant == tenant)
                        && !kv_of(Some(owner))
                }
            };
            if alone {
                let failure = EngineFailure::TooLargeForCache {
                    need_blocks: self.cfg.blocks_for(target) as u32,
                    max_blocks: available,
                };
                self.fail(now, id, failure);
                return Admit::Failed;
            }
            return match err {
                AllocError::NoBlocks { .. } => Admit::NoBlocks,
                AllocError::Quota { .. } => Admit::TenantBlocked,
            };
        }
        if let Some(h) = hold
            && self.pool.available(h.owner) < h.available
        {
            self.put_back(id, lease, imported);
            return Admit::NoBlocks;
        }
        if !seat_free(self) {
            // Nothing was preempted for blocks (that frees a seat), so the
            // victim found above is still there.
            let Some(v) = self.victim_for_admission(tier) else {
                self.put_back(id, lease, imported);
                return Admit::NoSeat;
            };
            self.preempt(v, draft);
        }
        self.admit(now, id, lease, cached, imported);
        if chunk > 0 {
            draft.push(id, cached, chunk, capped, true);
        }
        Admit::Admitted
    }

    /// A lease an admission could not use: an imported one stays parked on
    /// its request, a new one goes back to the pool.
    fn put_back(&mut self, id: RequestId, lease: flotilla_kv::Lease, imported: bool) {
        if imported {
            let seq = self.seqs.get_mut(&id).expect("admitting a live request");
            seq.parked = Some(lease);
        } else {
            self.pool.free(lease);
        }
    }

    /// Moves a request from its queue into the running batch with `lease`
    /// holding its first `cached` tokens (from the prefix cache, or
    /// `imported` from a prefill node).
    fn admit(
        &mut self,
        now: Duration,
        id: RequestId,
        lease: flotilla_kv::Lease,
        cached: usize,
        imported: bool,
    ) {
        let seq = self
            .seqs
            .get_mut(&id)
            .expect("admitting an unknown request");
        assert!(seq.lease.is_none() && seq.num_computed == 0);
        let front = self.waiting[seq.tenant].pop_front();
        assert_eq!(
            front,
            Some(id),
            "only the head of a tenant's queue is admitted"
        );
        seq.lease = Some(lease);
        seq.num_computed = cached;
        seq.admit_seq = self.admissions;
        self.admissions += 1;
        if seq.first_scheduled.is_none() {
            seq.first_scheduled = Some(now);
            seq.cached_tokens = Some(cached as u32);
            seq.prompt_charged = cached;
        }
        if let Some(d) = seq.deadline.take() {
            assert!(self.deadlines.remove(&(d, id)), "deadline not indexed");
        }
        // Charged at admission, as VTC does, so one step's admissions already
        // see each other; a recomputed prompt is not charged again.
        let charge = seq.prompt_len.saturating_sub(seq.prompt_charged) as u64;
        seq.prompt_charged = seq.prompt_len;
        let (tier, tenant) = (seq.tier, seq.tenant);
        self.charge(tier, tenant, charge);
        self.tier_queued[tier] -= 1;
        self.tier_running[tier] += 1;
        self.running.push(id);
        if !imported {
            self.counters.cached_tokens += cached as u64;
        }
    }

    /// Charges served tokens to the tier's and the tenant's fair-share counters.
    pub(crate) fn charge(&mut self, tier: usize, tenant: usize, tokens: u64) {
        self.tier_vtc.charge(tier, tokens);
        self.tenant_vtc.charge(tenant, tokens);
    }

    /// Copies tokens and block tables into the plan and marks it in flight.
    fn finalize(&mut self, mut draft: Draft, steps: usize) -> Plan {
        let step = self.next_step;
        assert!(draft.chunks.len() <= self.cfg.max_num_seqs);
        let mut total = 0;
        let items: Vec<PlanItem> = draft
            .chunks
            .iter()
            .map(|&(id, start, len, _)| {
                let seq = self.seqs.get_mut(&id).expect("planned sequence exists");
                let lease = seq.lease.as_ref().expect("planned sequence is running");
                assert_eq!(start, seq.num_computed);
                assert!(len > 0 && start + len <= seq.tokens.len());
                let guess = match draft.guesses.iter().position(|g| g.0 == id) {
                    Some(i) => std::mem::take(&mut draft.guesses[i].1),
                    None => Vec::new(),
                };
                assert!(
                    lease.capacity_tokens() >= start + len + guess.len() + steps - 1,
                    "lease too small for chunk"
                );
                total += len + guess.len();
                let samples = start + len == seq.tokens.len();
                assert!(guess.is_empty() || samples, "a draft after a prefill chunk");
                let mut tokens = Vec::with_capacity(len + guess.len());
                tokens.extend_from_slice(&seq.tokens[start..start + len]);
                tokens.extend_from_slice(&guess);
                let block_table = lease.blocks().to_vec();
                let (bias, allow) = if samples {
                    // Not computed here: see PlanItem::allow.
                    let allow = seq.constraint.as_ref().map(|c| {
                        let cell = flotilla_exec::MaskCell::pending_draft(c.clone(), guess.clone());
                        std::sync::Arc::new(cell)
                    });
                    (seq.sample_bias(), allow)
                } else {
                    (Vec::new(), None)
                };
                let draft_bias = seq.draft_bias(&guess);
                PlanItem {
                    id,
                    tokens,
                    start_pos: start,
                    block_table,
                    sample: samples.then_some(seq.sampling),
                    bias,
                    draft_bias,
                    allow,
                    self_draft: if draft.self_drafted.contains(&id) {
                        self.cfg.speculation.self_layers
                    } else {
                        0
                    },
                    draft: guess.len(),
                    draft_planned: guess.len(),
                    model_draft: draft
                        .model_drafted
                        .contains(&id)
                        .then(|| seq.tokens[..start].to_vec()),
                }
            })
            .collect();
        assert!(total <= self.cfg.max_num_batched_tokens);
        if !items.is_empty() {
            self.next_step += 1;
            self.in_flight.push(step);
            self.busy.extend(items.iter().map(|it| it.id));
            self.multi_step = (steps > 1).then_some(steps);
            self.counters.steps += 1;
        }
        Plan { step, items, steps }
    }
}
