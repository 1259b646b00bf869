//! Taking a step's results back: tokens appended and emitted, prefixes
//! committed to the cache, sequences finished; or the whole step failed.

use std::time::Duration;

use flotilla_proto::{EngineFailure, FinishReason, Sampled};

use crate::{Plan, SchedEvent, Scheduler};

impl Scheduler {
    /// Applies the executor's results of `plan`: `sampled[i]` is item `i`'s
    /// token (`None` for items that did not sample). Items of requests
    /// cancelled since `schedule` are skipped.
    pub fn complete(&mut self, now: Duration, plan: &Plan, sampled: &[Option<Sampled>]) {
        assert_eq!(sampled.len(), plan.items.len(), "one result per plan item");
        self.end_step(plan);
        for (item, out) in plan.items.iter().zip(sampled) {
            let Some(seq) = self.seqs.get_mut(&item.id) else {
                continue;
            };
            assert!(seq.is_running(), "{} completed while not running", item.id);
            assert_eq!(
                seq.num_computed, item.start_pos,
                "{} completed out of order",
                item.id
            );
            seq.num_computed += item.tokens.len();
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
            let Some(token) = out else {
                let failure = EngineFailure::Internal("the executor returned no token".into());
                self.fail(now, item.id, failure);
                continue;
            };
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
                    self.fail(now, item.id, failure);
                    continue;
                }
            };
            seq.tokens.push(token.token);
            seq.first_token.get_or_insert(now);
            let stop = complete
                || seq.stop_token_ids.contains(&token.token)
                || (!seq.ignore_eos && self.cfg.stop_tokens.contains(&token.token));
            let length =
                seq.generated() >= seq.max_tokens || seq.tokens.len() >= self.cfg.max_model_len;
            let (tier, tenant) = (seq.tier, seq.tenant);
            self.charge(tier, tenant, 1);
            self.events.push(SchedEvent::Token {
                id: item.id,
                token: token.clone(),
            });
            if stop {
                self.finish(now, item.id, FinishReason::Stop);
            } else if length {
                self.finish(now, item.id, FinishReason::Length);
            }
        }
    }

    /// The executor refused `plan`: every request in it fails with
    /// `EngineFailure::Internal(error)` and gives its blocks back.
    pub fn fail_step(&mut self, now: Duration, plan: &Plan, error: &str) {
        self.end_step(plan);
        for item in &plan.items {
            if self.seqs.contains_key(&item.id) {
                self.fail(now, item.id, EngineFailure::Internal(error.to_owned()));
            }
        }
    }

    /// Checks that `plan` is the step in flight and clears it.
    fn end_step(&mut self, plan: &Plan) {
        if plan.items.is_empty() {
            return;
        }
        assert_eq!(
            self.in_flight,
            Some(plan.step),
            "results for a step that is not in flight"
        );
        self.in_flight = None;
    }
}
