//! One accepted request's state inside the scheduler.

use std::time::Duration;

use flotilla_kv::Lease;
use flotilla_proto::{EngineRequest, RequestId, SamplingParams, TierId};

use crate::event::Timings;

/// An accepted request: waiting (no lease) or running (holds a lease).
#[derive(Debug)]
pub(crate) struct Seq {
    pub(crate) id: RequestId,
    /// Tenant index.
    pub(crate) tenant: usize,
    /// Tier index.
    pub(crate) tier: usize,
    /// Every known token: the prompt, then the generated ones. After a
    /// preemption all of them are recomputed, so the next sample lands at
    /// position `tokens.len()` and nothing is emitted twice.
    pub(crate) tokens: Vec<u32>,
    pub(crate) prompt_len: usize,
    pub(crate) max_tokens: usize,
    pub(crate) sampling: SamplingParams,
    /// `(token, bias)` from the request, a token at most once.
    pub(crate) logit_bias: Vec<(u32, f32)>,
    /// Where the generated tokens begin in `tokens` (before `prompt_len`
    /// for a moved request whose prompt carries what it generated before).
    pub(crate) generated_from: usize,
    /// The request's constraint, matched up to the last token (attached by
    /// the Scheduler at submission, see `Scheduler::compile_constraint`),
    /// shared with the mask of the plan in flight.
    pub(crate) constraint: Option<flotilla_exec::SharedConstraint>,
    pub(crate) ignore_eos: bool,
    pub(crate) stop_token_ids: Vec<u32>,
    /// Present exactly while running.
    pub(crate) lease: Option<Lease>,
    /// Leading tokens whose KV the lease holds; always `< tokens.len()`.
    pub(crate) num_computed: usize,
    /// Order of its latest admission (preemption takes the youngest first).
    pub(crate) admit_seq: u64,
    pub(crate) arrival: Duration,
    /// Queue-timeout deadline; only until it is first scheduled, because a
    /// preempted request has already streamed tokens and must not expire.
    pub(crate) deadline: Option<Duration>,
    pub(crate) first_scheduled: Option<Duration>,
    pub(crate) first_token: Option<Duration>,
    /// Prompt tokens served from the prefix cache at first admission.
    pub(crate) cached_tokens: Option<u32>,
    /// Prompt tokens already charged to fair share, so recompute after a
    /// preemption (the engine's choice) is not charged twice.
    pub(crate) prompt_charged: usize,
    /// Keep its blocks this long after it finishes (a prefill whose KV
    /// leaves for a decode node), instead of giving them back.
    pub(crate) hold_for: Option<Duration>,
    /// Blocks holding KV imported from a prefill node, while it waits for a
    /// seat: its first admission takes this lease instead of a new one.
    pub(crate) parked: Option<Lease>,
    /// Speculation for this request: allowed, and how it has gone.
    pub(crate) spec: SpecState,
}

/// One request's speculation: whether it may, when it may draft next, and
/// its totals.
#[derive(Debug, Default)]
pub(crate) struct SpecState {
    /// The request allows it (and nothing in it forbids it: see
    /// `Scheduler::may_speculate`).
    pub(crate) allowed: bool,
    /// No draft before the sequence has this many tokens: after a draft
    /// that was wholly rejected, the next waits `backoff` tokens.
    pub(crate) skip_until: usize,
    /// Tokens to wait after the next wholly rejected draft (doubles each
    /// time, up to a bound; a draft with any token accepted resets it).
    pub(crate) backoff: usize,
    /// Draft tokens verified.
    pub(crate) drafted: u32,
    /// Draft tokens accepted.
    pub(crate) accepted: u32,
    /// A draft model's guesses for this sequence: tokens accepted and
    /// drafts cut short by a rejection (its own acceptance, which decides
    /// its draft length with the engine's as a prior).
    pub(crate) model_accepted: f64,
    pub(crate) model_cut: f64,
}

impl Seq {
    /// What to add to the logits of its next sample: `logit_bias`, minus
    /// `presence_penalty` for every token generated so far and
    /// `frequency_penalty` times its count (OpenAI's definitions; the
    /// prompt does not count, what a moved request generated before does).
    /// In token order, so the sums are the same
    /// wherever it is computed. Empty (no allocation) when there is none.
    pub(crate) fn sample_bias(&self) -> Vec<(u32, f32)> {
        self.bias_after(&[])
    }

    /// The bias of each verify position after the first of a draft
    /// `guess` (`[r - 1]` for position `r`): [`Seq::sample_bias`] as it
    /// would be once `guess[..r]` were generated too, computed the same way
    /// so the sums are the same. Empty when the bias does not change with
    /// the tokens drawn (no penalties).
    pub(crate) fn draft_bias(&self, guess: &[u32]) -> Vec<Vec<(u32, f32)>> {
        if !self.penalised() {
            return Vec::new();
        }
        (1..=guess.len())
            .map(|r| self.bias_after(&guess[..r]))
            .collect()
    }

    /// Whether presence or frequency penalties apply.
    pub(crate) fn penalised(&self) -> bool {
        self.sampling.presence_penalty != 0.0 || self.sampling.frequency_penalty != 0.0
    }

    /// [`Seq::sample_bias`] with `more` generated after its tokens.
    fn bias_after(&self, more: &[u32]) -> Vec<(u32, f32)> {
        let (presence, frequency) = (
            self.sampling.presence_penalty,
            self.sampling.frequency_penalty,
        );
        let penalties = self.penalised();
        if self.logit_bias.is_empty() && !penalties {
            return Vec::new();
        }
        let mut by_token: std::collections::BTreeMap<u32, f32> =
            self.logit_bias.iter().copied().collect();
        if penalties {
            let mut counts = std::collections::BTreeMap::<u32, u32>::new();
            for &t in self.tokens[self.generated_from..].iter().chain(more) {
                *counts.entry(t).or_default() += 1;
            }
            for (t, n) in counts {
                *by_token.entry(t).or_default() -= presence + frequency * n as f32;
            }
        }
        by_token.into_iter().collect()
    }

    /// A waiting request with its deadline.
    pub(crate) fn new(
        id: RequestId,
        tier: usize,
        req: EngineRequest,
        now: Duration,
        deadline: Duration,
    ) -> Seq {
        let prompt_len = req.prompt.len();
        let mut tokens = req.prompt;
        tokens.reserve(req.max_tokens as usize);
        Seq {
            id,
            tenant: req.tenant.0 as usize,
            tier,
            tokens,
            prompt_len,
            max_tokens: req.max_tokens as usize,
            sampling: req.sampling,
            logit_bias: req.logit_bias,
            generated_from: prompt_len.saturating_sub(req.generated as usize),
            constraint: None,
            ignore_eos: req.ignore_eos,
            stop_token_ids: req.stop_token_ids,
            lease: None,
            num_computed: 0,
            admit_seq: 0,
            arrival: now,
            deadline: Some(deadline),
            first_scheduled: None,
            first_token: None,
            cached_tokens: None,
            prompt_charged: 0,
            hold_for: None,
            parked: None,
            spec: SpecState {
                allowed: req.speculative,
                ..SpecState::default()
            },
        }
    }

    /// Whether it holds a lease (is in the running batch).
    pub(crate) fn is_running(&self) -> bool {
        self.lease.is_some()
    }

    /// Whether several of its tokens can be sampled in a row with nobody
    /// watching between them (a multi-step decode): nothing about its
    /// next sample changes but the position (no constraint to advance, no
    /// penalties to fold in; a plain `logit_bias` stays the same), and only
    /// its length can end it (no stop token to catch, the model's
    /// end-of-sequence tokens ignored or none); and its first token is out:
    /// a prompt whose KV was cached but for its last token computes as a
    /// decode does, but its first token must reach its client after that
    /// one step (its time to first token), not at the end of a plan.
    pub(crate) fn may_multi_step(&self, stop_tokens: &[u32]) -> bool {
        self.generated() > 0
            && self.constraint.is_none()
            && !self.penalised()
            && self.stop_token_ids.is_empty()
            && (self.ignore_eos || stop_tokens.is_empty())
    }

    /// Tokens generated so far.
    pub(crate) fn generated(&self) -> usize {
        self.tokens.len() - self.prompt_len
    }

    /// Tokens still to compute before the next sample.
    pub(crate) fn to_compute(&self) -> usize {
        self.tokens.len() - self.num_computed
    }

    /// Most KV positions it can ever need: the last generated token is never fed back.
    pub(crate) fn max_kv_tokens(&self) -> usize {
        self.prompt_len + self.max_tokens - 1
    }

    /// Its timings if it ended at `now`.
    pub(crate) fn timings(&self, now: Duration) -> Timings {
        let output_tokens = self.generated() as u32;
        let queue = self
            .first_scheduled
            .unwrap_or(now)
            .saturating_sub(self.arrival);
        let prefill = match (self.first_scheduled, self.first_token) {
            (Some(s), Some(f)) => f.saturating_sub(s),
            (Some(s), None) => now.saturating_sub(s),
            (None, _) => Duration::ZERO,
        };
        let decode = self
            .first_token
            .map_or(Duration::ZERO, |f| now.saturating_sub(f));
        Timings {
            tier: TierId(self.tier as u8),
            queue,
            ttft: self.first_token.map(|f| f.saturating_sub(self.arrival)),
            prefill,
            decode,
            tpot: (output_tokens > 1).then(|| decode / (output_tokens - 1)),
            prompt_tokens: self.prompt_len as u32,
            output_tokens,
            drafted: self.spec.drafted,
            accepted: self.spec.accepted,
        }
    }
}

#[cfg(test)]
mod tests {
    use flotilla_proto::TenantId;

    use super::*;

    fn seq(prompt: Vec<u32>, generated: u32, bias: Vec<(u32, f32)>, pres: f32, freq: f32) -> Seq {
        let req = EngineRequest {
            tenant: TenantId(0),
            prompt,
            max_tokens: 8,
            sampling: SamplingParams {
                presence_penalty: pres,
                frequency_penalty: freq,
                ..SamplingParams::greedy()
            },
            logit_bias: bias,
            generated,
            constraint: None,
            ignore_eos: false,
            stop_token_ids: Vec::new(),
            speculative: true,
            trace: None,
        };
        Seq::new(RequestId(1), 0, req, Duration::ZERO, Duration::from_secs(1))
    }

    #[test]
    fn sample_bias_folds_penalties_over_generated_tokens_into_logit_bias() {
        // Neither: nothing to add.
        assert!(
            seq(vec![1, 2, 3], 0, vec![], 0.0, 0.0)
                .sample_bias()
                .is_empty()
        );
        // logit_bias alone, before anything is generated.
        let mut s = seq(vec![5, 5, 9], 0, vec![(9, 3.0), (2, -1.0)], 0.5, 0.25);
        assert_eq!(s.sample_bias(), vec![(2, -1.0), (9, 3.0)]);
        // Generated 9, 4, 9: 9 pays presence once and frequency twice on top
        // of its bias; 4 once each; prompt tokens (5) pay nothing.
        s.tokens.extend([9, 4, 9]);
        assert_eq!(
            s.sample_bias(),
            vec![(2, -1.0), (4, -0.75), (9, 3.0 - 0.5 - 0.5)]
        );
        // A moved request: the last two prompt tokens were generated before.
        let mut m = seq(vec![5, 5, 7, 7], 2, vec![], 1.0, 0.0);
        assert_eq!(m.sample_bias(), vec![(7, -1.0)]);
        m.tokens.push(5);
        assert_eq!(m.sample_bias(), vec![(5, -1.0), (7, -1.0)]);
    }

    #[test]
    fn a_draft_s_bias_is_the_sample_bias_once_its_tokens_are_generated() {
        // 0.1 and 0.7 do not add exactly: each row is computed as the
        // plain sample bias would be, not by adding to the row before.
        let s = seq(vec![1, 2, 3], 2, vec![(5, 1.5), (9, -2.0)], 0.1, 0.7);
        let guess = [5, 7, 5, 2];
        let rows = s.draft_bias(&guess);
        assert_eq!(rows.len(), guess.len());
        for r in 1..=guess.len() {
            let mut after = seq(vec![1, 2, 3], 2, vec![(5, 1.5), (9, -2.0)], 0.1, 0.7);
            after.tokens.extend_from_slice(&guess[..r]);
            assert_eq!(rows[r - 1], after.sample_bias(), "row {r}");
        }
        // No penalties: every row takes the first's bias.
        let s = seq(vec![1, 2, 3], 2, vec![(5, 1.5)], 0.0, 0.0);
        assert!(s.draft_bias(&guess).is_empty());
    }
}
