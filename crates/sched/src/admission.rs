//! The one admission point (`submit`), per-tenant rate limits, and `cancel`.

use std::time::Duration;

use flotilla_exec::rate::retry_after_s;
use flotilla_exec::{ConstraintCompiler, MaskCell, TokenConstraint};
use flotilla_proto::{EngineFailure, EngineRequest, FinishReason, Rejection, RequestId};

use crate::Scheduler;
use crate::seq::Seq;

impl Scheduler {
    /// The admission point: queues the request or refuses it at once, changing nothing.
    pub fn submit(
        &mut self,
        now: Duration,
        id: RequestId,
        req: EngineRequest,
    ) -> Result<(), Rejection> {
        let constraint = self
            .check_admission(now, id, &req)
            .and_then(|()| self.compile_constraint(&req, None));
        let constraint = match constraint {
            Ok((c, _)) => c,
            Err(r) => {
                self.counters.rejected += 1;
                return Err(r);
            }
        };
        let tenant = req.tenant.0 as usize;
        let tier = self.accept(now, tenant);
        // A timeout too long to add never expires in practice: saturate.
        let deadline = now.saturating_add(self.cfg.queue_timeout);
        let mut seq = Seq::new(id, tier, req, now, deadline);
        seq.constraint = constraint.map(MaskCell::share);
        self.seqs.insert(id, seq);
        self.waiting[tenant].push_back(id);
        self.deadlines.insert((deadline, id));
        self.tier_queued[tier] += 1;
        self.tenant_live[tenant] += 1;
        self.counters.accepted += 1;
        Ok(())
    }

    /// Lets requests carry an output constraint (`EngineRequest::constraint`),
    /// compiled by `c` for this engine's vocabulary.
    pub fn set_constraints(&mut self, c: std::sync::Arc<dyn ConstraintCompiler>) {
        self.constraints = Some(c);
    }

    /// The matcher of `req`'s constraint, advanced over what it generated
    /// before this engine (a moved request's tail of the prompt, then
    /// `first`, the token a prefill node sampled), and whether those
    /// tokens completed it: `None` without a constraint; refused when this engine cannot compile it, when it
    /// does not compile, or when those tokens break it.
    pub(crate) fn compile_constraint(
        &self,
        req: &EngineRequest,
        first: Option<u32>,
    ) -> Result<(Option<Box<dyn TokenConstraint>>, bool), Rejection> {
        let Some(c) = &req.constraint else {
            return Ok((None, false));
        };
        let Some(compiler) = &self.constraints else {
            return Err(Rejection::Invalid(format!(
                "this engine cannot constrain its output ({}): structured output is off here",
                c.kind()
            )));
        };
        let mut m = compiler
            .compile(c)
            .map_err(|e| Rejection::Invalid(format!("{}: {e}", c.kind())))?;
        let before = req.prompt.len() - (req.generated as usize).min(req.prompt.len());
        let mut done = false;
        for &t in req.prompt[before..].iter().chain(first.as_ref()) {
            done = m.commit(t).map_err(|e| {
                Rejection::Invalid(format!(
                    "{}: the tokens generated before do not match it: {e}",
                    c.kind()
                ))
            })?;
        }
        Ok((Some(m), done))
    }

    /// Books an accepted request of `tenant` against its rate limit and
    /// fair share, before it is queued; returns its tier.
    pub(crate) fn accept(&mut self, now: Duration, tenant: usize) -> usize {
        let tier = usize::from(self.cfg.tenants[tenant].tier.0);
        if let Some(rate) = &mut self.rate[tenant] {
            rate.take(now);
        }
        // A client that was idle rejoins at the active minimum (VTC's lift).
        if self.tenant_live[tenant] == 0 {
            let live = &self.tenant_live;
            self.tenant_vtc.activate(tenant, |j| live[j] > 0);
        }
        if self.tier_queued[tier] + self.tier_running[tier] == 0 {
            let (q, r) = (&self.tier_queued, &self.tier_running);
            self.tier_vtc.activate(tier, |j| q[j] + r[j] > 0);
        }
        tier
    }

    /// Every reason to refuse, client errors first, then limits.
    pub(crate) fn check_admission(
        &self,
        now: Duration,
        id: RequestId,
        req: &EngineRequest,
    ) -> Result<(), Rejection> {
        let invalid = |m: String| Err(Rejection::Invalid(m));
        if self.seqs.contains_key(&id) || self.kv_id_in_use(id) {
            return invalid(format!("request id {id} is already in use"));
        }
        let Some(tenant_cfg) = self.cfg.tenants.get(req.tenant.0 as usize) else {
            return invalid(format!("unknown tenant {}", req.tenant.0));
        };
        if req.prompt.is_empty() {
            return invalid("the prompt is empty".into());
        }
        if req.max_tokens == 0 {
            return invalid("max_tokens must be at least 1".into());
        }
        if let Err(m) = req.sampling.validate() {
            return invalid(m);
        }
        let total = req.prompt.len() as u64 + u64::from(req.max_tokens);
        if total > self.cfg.max_model_len as u64 {
            return Err(Rejection::TooLong {
                prompt_tokens: u32::try_from(req.prompt.len()).unwrap_or(u32::MAX),
                max_tokens: req.max_tokens,
                max_model_len: u32::try_from(self.cfg.max_model_len).unwrap_or(u32::MAX),
            });
        }
        // Certain never to fit, so refuse now instead of failing it later.
        let tenant = req.tenant.0 as usize;
        let need = self.cfg.blocks_for(total as usize - 1);
        let max = self.cfg.max_blocks_for(tenant);
        if need > u64::from(max) {
            let f = EngineFailure::TooLargeForCache {
                need_blocks: u32::try_from(need).unwrap_or(u32::MAX),
                max_blocks: max,
            };
            return invalid(f.to_string());
        }
        let limit = |reason: String, wait: Duration| {
            Err(Rejection::TenantLimit {
                tenant: tenant_cfg.name.clone(),
                reason,
                retry_after_s: retry_after_s(wait),
            })
        };
        let live = self.tenant_live[tenant];
        if tenant_cfg.max_concurrent > 0 && live >= tenant_cfg.max_concurrent {
            let reason = format!(
                "{live} requests in flight, the limit is {}",
                tenant_cfg.max_concurrent
            );
            return limit(reason, Duration::from_secs(1));
        }
        if let Some(rate) = &self.rate[tenant]
            && let Err(wait) = rate.check(now)
        {
            let rpm = tenant_cfg.requests_per_minute.unwrap_or(0);
            return limit(format!("rate limit of {rpm} requests per minute"), wait);
        }
        let tier = usize::from(tenant_cfg.tier.0);
        let tier_cfg = &self.cfg.tiers[tier];
        if self.tier_queued[tier] >= tier_cfg.queue_len_max {
            return Err(Rejection::QueueFull {
                tier: tier_cfg.name.clone(),
                queue_len_max: tier_cfg.queue_len_max,
                retry_after_s: 1,
            });
        }
        Ok(())
    }

    /// The Router ended the request at a stop string: it finishes now with
    /// reason `Stop` (a `Finished` event with its usage and timings; its
    /// blocks go back). False if it had already ended.
    pub fn finish_early(&mut self, now: Duration, id: RequestId) -> bool {
        if !self.seqs.contains_key(&id) {
            return false;
        }
        self.finish(now, id, FinishReason::Stop);
        true
    }

    /// Drops a request wherever it is (queue or batch) and returns its blocks;
    /// emits nothing, the client is gone. False if it is unknown or already ended.
    pub fn cancel(&mut self, _now: Duration, id: RequestId) -> bool {
        if !self.seqs.contains_key(&id) {
            return false;
        }
        self.remove_seq(id);
        self.counters.cancelled += 1;
        true
    }
}
