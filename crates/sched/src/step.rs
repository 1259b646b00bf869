//! Taking a step's results back: tokens appended and emitted, prefixes
//! committed to the cache, sequences finished; or the whole step failed.

use std::time::Duration;

use flotilla_exec::SeqOutput;
use flotilla_proto::{EngineFailure, FinishReason, RequestId};

use crate::{Plan, SchedEvent, Scheduler};

/// Longest wait, in tokens, between drafts of a sequence whose drafts keep
/// failing.
const MAX_BACKOFF: usize = 64;

/// Weight kept by the draft model's old acceptance at each verified draft:
/// the estimate follows the last ~30 drafts (the text being written moves).
const DRAFT_DECAY: f64 = 0.97;

impl Scheduler {
    /// Applies the executor's results of `plan`: `outs[i]` is item `i`'s
    /// output (its sampled token, after the draft tokens it accepted, if
    /// any). Items of requests cancelled since `schedule` are skipped. A
    /// draft's rejected positions are given back: the lease shrinks to the
    /// tokens kept. Of a multi-step plan, `outs[i].accepted` holds the
    /// samples of the steps before the last that ran (the same number for
    /// every item), and the blocks of the steps that did not run go back.
    pub fn complete(&mut self, now: Duration, plan: &Plan, outs: &[SeqOutput]) {
        assert_eq!(outs.len(), plan.items.len(), "one result per plan item");
        self.end_step(plan);
        if plan.is_multi_step() {
            let ran = outs.iter().map(|o| o.accepted.len() + 1).max().unwrap_or(1);
            self.counters.steps += ran.min(plan.steps) as u64 - 1;
        }
        for (item, out) in plan.items.iter().zip(outs) {
            let Some(seq) = self.seqs.get_mut(&item.id) else {
                continue;
            };
            assert!(seq.is_running(), "{} completed while not running", item.id);
            assert_eq!(
                seq.num_computed, item.start_pos,
                "{} completed out of order",
                item.id
            );
            let known = item.tokens.len() - item.draft;
            seq.num_computed += known;
            assert!(seq.num_computed <= seq.tokens.len());
            self.counters.computed_tokens += item.tokens.len() as u64;
            let salt = self.cfg.tenants[seq.tenant].prefix_salt;
            let lease = seq.lease.as_mut().expect("running sequence has a lease");
            // Full blocks enter the prefix cache as soon as they are written.
            self.pool
                .commit(lease, salt, &seq.tokens[..seq.num_computed]);
            if item.sample.is_none() {
                continue;
            }
            assert_eq!(seq.num_computed, seq.tokens.len(), "sampled before the end");
            let guess = &item.tokens[known..];
            let accepted = out.accepted.len();
            if plan.is_multi_step() {
                if accepted >= plan.steps {
                    let failure = EngineFailure::Internal(format!(
                        "the executor ran {} steps of a plan of {}",
                        accepted + 1,
                        plan.steps
                    ));
                    self.fail(now, item.id, failure);
                    continue;
                }
                self.counters.computed_tokens += accepted as u64;
            } else if accepted > guess.len()
                || out.accepted.iter().zip(guess).any(|(s, &g)| s.token != g)
            {
                let failure =
                    EngineFailure::Internal("the executor accepted tokens it was not given".into());
                self.fail(now, item.id, failure);
                continue;
            }
            if out.sampled.is_none() {
                let failure = EngineFailure::Internal("the executor returned no token".into());
                self.fail(now, item.id, failure);
                continue;
            }
            // The draft as planned: the worker proposes fewer where the
            // draft model was unsure of a guess (or failed).
            let planned = item.draft_planned.max(item.draft);
            if planned > 0 && item.model_draft.is_some() {
                // A geometric fit's counts: the tokens accepted, and one
                // cut unless all the planned ones were (a guess the draft
                // did not propose is a pass spent for nothing, as a
                // rejected one is).
                let cut_short = f64::from(u8::from(accepted < planned));
                let (acc, cut) = &mut self.draft_accept;
                *acc = *acc * DRAFT_DECAY + accepted as f64;
                *cut = *cut * DRAFT_DECAY + cut_short;
                seq.spec.model_accepted += accepted as f64;
                seq.spec.model_cut += cut_short;
                self.counters.model_drafts += 1;
            }
            if item.draft > 0 {
                self.counters.verify_items += 1;
                self.counters.drafted_tokens += item.draft as u64;
                self.counters.accepted_tokens += accepted as u64;
                seq.spec.drafted += item.draft as u32;
                seq.spec.accepted += accepted as u32;
                if accepted == 0 {
                    // Wholly rejected: wait before the next draft, longer
                    // each time, so a sequence whose text does not repeat
                    // stops paying for verify positions.
                    seq.spec.backoff = (seq.spec.backoff * 2).clamp(1, MAX_BACKOFF);
                    seq.spec.skip_until = seq.tokens.len() + seq.spec.backoff;
                } else {
                    seq.spec.backoff = 0;
                }
            }
            if !self.take_tokens(now, item.id, out) || (planned == 0 && !plan.is_multi_step()) {
                continue;
            }
            // Still running: the rejected positions' blocks (or the steps'
            // that did not run) go back, and the accepted ones' full blocks
            // enter the prefix cache.
            let seq = self.seqs.get_mut(&item.id).expect("still running");
            let lease = seq.lease.as_mut().expect("running sequence has a lease");
            self.pool.truncate(lease, seq.tokens.len());
            self.pool
                .commit(lease, salt, &seq.tokens[..seq.num_computed]);
        }
    }

    /// Appends one item's tokens (accepted draft tokens, then its sample)
    /// to its sequence, emitting each, until one ends it; false if it ended.
    fn take_tokens(&mut self, now: Duration, id: RequestId, out: &SeqOutput) -> bool {
        for (j, token) in out.tokens().enumerate() {
            let seq = self.seqs.get_mut(&id).expect("running sequence");
            if j > 0 {
                // The token before was an accepted draft token: its KV was
                // written by this step.
                seq.num_computed += 1;
            }
            // The constraint takes the token first: a matcher that fails
            // fails the request before the token is sent.
            let complete = match seq
                .constraint
                .as_ref()
                .map(|c| flotilla_exec::MaskCell::commit(c, token.token))
            {
                None | Some(Ok(false)) => false,
                Some(Ok(true)) => true,
                Some(Err(e)) => {
                    let failure = EngineFailure::Internal(format!("the output constraint: {e}"));
                    self.fail(now, id, failure);
                    return false;
                }
            };
            seq.tokens.push(token.token);
            seq.first_token.get_or_insert(now);
            let stop = complete
                || seq.stop_token_ids.contains(&token.token)
                || (!seq.ignore_eos && self.cfg.stop_tokens.contains(&token.token));
            let length =
                seq.generated() >= seq.max_tokens || seq.tokens.len() >= self.cfg.max_model_len;
            if stop || length {
                // The KV this step wrote past its first position (a
                // multi-step plan's later steps, accepted draft tokens)
                // enters the prefix cache before the blocks go back, as
                // it would have one step at a time.
                let salt = self.cfg.tenants[seq.tenant].prefix_salt;
                if let Some(lease) = seq.lease.as_mut() {
                    self.pool
                        .commit(lease, salt, &seq.tokens[..seq.num_computed]);
                }
            }
            let (tier, tenant) = (seq.tier, seq.tenant);
            self.charge(tier, tenant, 1);
            self.events.push(SchedEvent::Token {
                id,
                token: token.clone(),
            });
            if stop {
                self.finish(now, id, FinishReason::Stop);
                return false;
            } else if length {
                self.finish(now, id, FinishReason::Length);
                return false;
            }
        }
        true
    }

    /// The executor refused `plan`: every request in it fails with
    /// `EngineFailure::Internal(error)` and gives its blocks back.
    pub fn fail_step(&mut self, now: Duration, plan: &Plan, error: &str) {
        self.fail_step_with(now, plan, EngineFailure::Internal(error.to_owned()));
    }

    /// [`Scheduler::fail_step`] with `failure` for each of its requests
    /// (`EngineFailure::EngineLost` when the executor can run no more:
    /// the Router moves them).
    pub fn fail_step_with(&mut self, now: Duration, plan: &Plan, failure: EngineFailure) {
        self.end_step(plan);
        for item in &plan.items {
            if self.seqs.contains_key(&item.id) {
                self.fail(now, item.id, failure.clone());
            }
        }
    }

    /// Checks that `plan` is the oldest step in flight (steps end in the
    /// order they were planned) and clears it and its sequences.
    fn end_step(&mut self, plan: &Plan) {
        if plan.items.is_empty() {
            return;
        }
        assert_eq!(
            self.in_flight.first(),
            Some(&plan.step),
            "results for a step that is not the oldest in flight"
        );
        self.in_flight.remove(0);
        self.multi_step = None;
        for it in &plan.items {
            self.busy.remove(&it.id);
        }
    }
}
