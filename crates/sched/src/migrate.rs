//! KV blocks that outlive or precede a request on this engine: the two
//! halves of disaggregated prefill and decode.
//!
//! Prefill side: a request submitted with [`Scheduler::submit_held`] keeps
//! its lease after it finishes ([`Scheduler::held_kv`] names its blocks for
//! export) until [`Scheduler::release_held`] or its hold deadline.
//!
//! Decode side: [`Scheduler::reserve`] takes fresh blocks for a prompt's KV
//! before the prefill node computes it (until its deadline, or
//! [`Scheduler::cancel_reservation`]); [`Scheduler::start_import`] pins the
//! reservation while the executor writes the blocks;
//! [`Scheduler::submit_imported`] turns it into a request whose prompt is
//! already computed and whose first token is already sampled. It waits for
//! a seat like any request, with its blocks parked on it.
//!
//! Every one of these leases goes back on every path: release, deadline,
//! cancel, a refused import, `fail_all`.

use std::time::Duration;

use flotilla_kv::{AllocError, Lease, Owner};
use flotilla_proto::{EngineRequest, FinishReason, Rejection, RequestId, Sampled, TenantId};

use crate::seq::Seq;
use crate::{SchedEvent, Scheduler};

/// The blocks of a finished request, kept for export.
#[derive(Debug)]
pub(crate) struct HeldKv {
    pub(crate) lease: Lease,
    /// Leading tokens whose KV the blocks hold.
    pub(crate) tokens: usize,
    pub(crate) deadline: Duration,
}

/// Blocks reserved for an import.
#[derive(Debug)]
pub(crate) struct Reservation {
    pub(crate) lease: Lease,
    /// Tokens of KV it will receive.
    pub(crate) tokens: usize,
    /// `None` once the import has started (pinned until it ends).
    pub(crate) deadline: Option<Duration>,
}

impl Scheduler {
    /// Whether `id` names held blocks or a reservation.
    pub(crate) fn kv_id_in_use(&self, id: RequestId) -> bool {
        self.held.contains_key(&id) || self.reservations.contains_key(&id)
    }

    /// Keeps a finished request's lease for export until `now + hold`.
    pub(crate) fn hold(
        &mut self,
        now: Duration,
        id: RequestId,
        lease: Lease,
        tokens: usize,
        hold: Duration,
    ) {
        let deadline = now.saturating_add(hold);
        self.kv_deadlines.insert((deadline, id));
        let prev = self.held.insert(
            id,
            HeldKv {
                lease,
                tokens,
                deadline,
            },
        );
        assert!(prev.is_none(), "{id} held twice");
    }

    /// Gives back held blocks and reservations whose deadline has passed.
    pub(crate) fn expire_kv(&mut self, now: Duration) {
        while let Some(&(deadline, id)) = self.kv_deadlines.first() {
            if deadline > now {
                break;
            }
            self.kv_deadlines.pop_first();
            let lease = match self.held.remove(&id) {
                Some(h) => h.lease,
                None => {
                    self.reservations
                        .remove(&id)
                        .expect("a KV deadline names held blocks or a reservation")
                        .lease
                }
            };
            self.pool.free(lease);
            self.counters.kv_expired += 1;
        }
    }

    /// Gives back every held block and reservation (`fail_all`).
    pub(crate) fn release_all_kv(&mut self) {
        self.kv_deadlines.clear();
        let held = std::mem::take(&mut self.held);
        for (_, h) in held {
            self.pool.free(h.lease);
        }
        let reserved = std::mem::take(&mut self.reservations);
        for (_, r) in reserved {
            self.pool.free(r.lease);
        }
    }

    /// Like [`Scheduler::submit`], but once the request finishes its blocks
    /// stay held for `hold_for` (for [`Scheduler::held_kv`]) instead of
    /// going back. A failed or cancelled request holds nothing.
    pub fn submit_held(
        &mut self,
        now: Duration,
        id: RequestId,
        req: EngineRequest,
        hold_for: Duration,
    ) -> Result<(), Rejection> {
        self.submit(now, id, req)?;
        self.seqs.get_mut(&id).expect("just submitted").hold_for = Some(hold_for);
        Ok(())
    }

    /// The blocks held for a finished request, in block-table order, as
    /// many as its KV fills, and the number of tokens they hold.
    pub fn held_kv(&self, id: RequestId) -> Option<(Vec<u32>, usize)> {
        let h = self.held.get(&id)?;
        let n = self.cfg.blocks_for(h.tokens) as usize;
        Some((h.lease.blocks()[..n].to_vec(), h.tokens))
    }

    /// Gives back the blocks held for `id`; false if none were.
    pub fn release_held(&mut self, id: RequestId) -> bool {
        let Some(h) = self.held.remove(&id) else {
            return false;
        };
        assert!(self.kv_deadlines.remove(&(h.deadline, id)));
        self.pool.free(h.lease);
        true
    }

    /// Stops running request `id` here without ending its stream and
    /// keeps its blocks for export until `now + hold`, as a finished
    /// prefill's ([`Scheduler::held_kv`], [`Scheduler::release_held`]):
    /// the request moves to another node with its KV. Returns every token
    /// it has (prompt, then generated); the blocks hold the KV of all but
    /// the last. Refused (and nothing changes) unless it is decoding: a
    /// request that waits or still computes its prompt has no KV worth
    /// moving. A step in flight may still write the blocks; its sample of
    /// this request is dropped, as a cancelled one's.
    pub fn detach(
        &mut self,
        now: Duration,
        id: RequestId,
        hold: Duration,
    ) -> Result<Vec<u32>, String> {
        let Some(seq) = self.seqs.get(&id) else {
            return Err(format!("{id} does not run here"));
        };
        if !seq.is_running() {
            return Err(format!("{id} waits for a seat: it has no KV here"));
        }
        if seq.generated() == 0 || seq.num_computed + 1 != seq.tokens.len() {
            return Err(format!("{id} is still computing its prompt"));
        }
        let (seq, lease) = self.take_seq(id);
        let lease = lease.expect("a running request holds a lease");
        self.hold(now, id, lease, seq.num_computed, hold);
        self.counters.detached += 1;
        Ok(seq.tokens)
    }

    /// Reserves fresh blocks for `tokens` tokens of `tenant`'s KV until
    /// `now + ttl`. Never preempts: a node without the blocks free now
    /// refuses (`Unavailable`), and the Router goes elsewhere.
    pub fn reserve(
        &mut self,
        now: Duration,
        id: RequestId,
        tenant: TenantId,
        tokens: usize,
        ttl: Duration,
    ) -> Result<(), Rejection> {
        if self.seqs.contains_key(&id) || self.kv_id_in_use(id) {
            return Err(Rejection::Invalid(format!("id {id} is already in use")));
        }
        let Some(t) = self.cfg.tenants.get(tenant.0 as usize) else {
            return Err(Rejection::Invalid(format!("unknown tenant {}", tenant.0)));
        };
        if tokens == 0 {
            return Err(Rejection::Invalid("the prompt is empty".into()));
        }
        if tokens >= self.cfg.max_model_len {
            return Err(Rejection::TooLong {
                prompt_tokens: u32::try_from(tokens).unwrap_or(u32::MAX),
                max_tokens: 1,
                max_model_len: u32::try_from(self.cfg.max_model_len).unwrap_or(u32::MAX),
            });
        }
        let owner = Owner {
            tenant: tenant.0,
            tier: t.tier.0,
        };
        let refused = |e: AllocError, name: &str| match e {
            AllocError::Quota { .. } => Rejection::TenantLimit {
                tenant: name.to_owned(),
                reason: "its KV block quota is in use".into(),
                retry_after_s: 1,
            },
            AllocError::NoBlocks { .. } => Rejection::Unavailable,
        };
        let name = t.name.clone();
        let (mut lease, _) = self
            .pool
            .start(owner, t.prefix_salt, &[], 0)
            .map_err(|e| refused(e, &name))?;
        if let Err(e) = self.pool.grow(&mut lease, tokens) {
            self.pool.free(lease);
            return Err(refused(e, &name));
        }
        let deadline = now.saturating_add(ttl);
        self.kv_deadlines.insert((deadline, id));
        self.reservations.insert(
            id,
            Reservation {
                lease,
                tokens,
                deadline: Some(deadline),
            },
        );
        Ok(())
    }

    /// Every id this engine keeps KV (or a seat) for: requests queued or
    /// running, finished prefills held for export, reservations. Whoever
    /// drives the engine compares it with what it knows of, to find
    /// leases no one will ever give back (orphans).
    pub fn kv_holders(&self) -> Vec<RequestId> {
        let mut ids: Vec<RequestId> = self
            .seqs
            .keys()
            .chain(self.held.keys())
            .chain(self.reservations.keys())
            .copied()
            .collect();
        ids.sort_unstable();
        ids
    }

    /// Gives back whatever `id` holds (its owner is gone): held blocks, a
    /// reservation not being written, or a request (cancelled). False if
    /// it holds nothing, or its reservation is being written now (the
    /// import ends it).
    pub fn drop_orphan(&mut self, now: Duration, id: RequestId) -> bool {
        if self.release_held(id) {
            return true;
        }
        match self.reservations.get(&id) {
            Some(r) if r.deadline.is_none() => return false,
            Some(_) => return self.cancel_reservation(id),
            None => {}
        }
        self.cancel(now, id)
    }

    /// Gives back a reservation not yet imported (or whose import failed);
    /// false if there is none.
    pub fn cancel_reservation(&mut self, id: RequestId) -> bool {
        let Some(r) = self.reservations.remove(&id) else {
            return false;
        };
        if let Some(d) = r.deadline {
            assert!(self.kv_deadlines.remove(&(d, id)));
        }
        self.pool.free(r.lease);
        true
    }

    /// Pins a reservation for the executor to write: it no longer expires.
    /// Returns its blocks and the tokens it holds. The import ends with
    /// [`Scheduler::submit_imported`] or [`Scheduler::cancel_reservation`].
    pub fn start_import(&mut self, id: RequestId) -> Result<(Vec<u32>, usize), String> {
        let Some(r) = self.reservations.get_mut(&id) else {
            return Err(format!("no reservation {id} (it expired or was cancelled)"));
        };
        let Some(d) = r.deadline.take() else {
            return Err(format!("reservation {id} is already being imported"));
        };
        assert!(self.kv_deadlines.remove(&(d, id)));
        Ok((r.lease.blocks().to_vec(), r.tokens))
    }

    /// [`Scheduler::start_import`] for a transfer of `bytes` bytes of KV
    /// for `tokens` tokens, checked against the reservation first (its
    /// token count, and `bytes_per_block` for each of its blocks). A
    /// transfer that does not fit gives the reservation back. Returns the
    /// blocks to write.
    pub fn start_import_sized(
        &mut self,
        id: RequestId,
        tokens: u32,
        bytes: u64,
        bytes_per_block: u64,
    ) -> Result<Vec<u32>, String> {
        let Some(r) = self.reservations.get(&id) else {
            return Err(format!("no reservation {id} (it expired or was cancelled)"));
        };
        let expected = r.lease.blocks().len() as u64 * bytes_per_block;
        if r.deadline.is_some() && (r.tokens != tokens as usize || bytes != expected) {
            let why = format!(
                "{bytes} bytes of KV for {tokens} tokens; the reservation holds {} tokens in \
                 {expected} bytes",
                r.tokens
            );
            self.cancel_reservation(id);
            return Err(why);
        }
        self.start_import(id).map(|(blocks, _)| blocks)
    }

    /// Turns an imported reservation into a request with the same id: its
    /// prompt's KV is in the reservation's blocks and `first` was sampled
    /// after it. Emits `Token(first)` now; the request then waits for a seat
    /// (ahead of its tenant's queue) and decodes from there. It ends at once
    /// if `first` stops it. Refused requests give the reservation back.
    pub fn submit_imported(
        &mut self,
        now: Duration,
        id: RequestId,
        req: EngineRequest,
        first: Sampled,
    ) -> Result<(), Rejection> {
        let Some(r) = self.reservations.remove(&id) else {
            return Err(Rejection::Invalid(format!(
                "no reservation {id} (it expired or was cancelled)"
            )));
        };
        if let Some(d) = r.deadline {
            assert!(self.kv_deadlines.remove(&(d, id)));
        }
        let refuse = |s: &mut Self, lease: Lease, why: Rejection| {
            s.pool.free(lease);
            s.counters.rejected += 1;
            Err(why)
        };
        if req.prompt.len() != r.tokens {
            let why = format!(
                "the prompt has {} tokens, the reservation holds {}",
                req.prompt.len(),
                r.tokens
            );
            return refuse(self, r.lease, Rejection::Invalid(why));
        }
        if r.lease.owner().tenant != req.tenant.0 {
            let why = format!("the reservation is not tenant {}'s", req.tenant.0);
            return refuse(self, r.lease, Rejection::Invalid(why));
        }
        match self.check_admission(now, id, &req) {
            // The blocks are already taken: it does not wait in the queue
            // as a new request would.
            Ok(()) | Err(Rejection::QueueFull { .. }) => {}
            Err(why) => return refuse(self, r.lease, why),
        }
        let (constraint, complete) = match self.compile_constraint(&req, Some(first.token)) {
            Ok(c) => c,
            Err(why) => return refuse(self, r.lease, why),
        };
        let tenant = req.tenant.0 as usize;
        let tier = self.accept(now, tenant);
        let mut seq = Seq::new(id, tier, req, now, now);
        seq.constraint = constraint.map(flotilla_exec::MaskCell::share);
        seq.deadline = None;
        seq.tokens.push(first.token);
        seq.first_scheduled = Some(now);
        seq.first_token = Some(now);
        seq.cached_tokens = Some(0);
        // This engine never computed the prompt: nothing to charge for it.
        seq.prompt_charged = seq.prompt_len;
        seq.parked = Some(r.lease);
        let stop = complete
            || seq.stop_token_ids.contains(&first.token)
            || (!seq.ignore_eos && self.cfg.stop_tokens.contains(&first.token));
        let length =
            seq.generated() >= seq.max_tokens || seq.tokens.len() >= self.cfg.max_model_len;
        self.seqs.insert(id, seq);
        self.waiting[tenant].push_front(id);
        self.tier_queued[tier] += 1;
        self.tenant_live[tenant] += 1;
        self.counters.accepted += 1;
        self.charge(tier, tenant, 1);
        self.events.push(SchedEvent::Token { id, token: first });
        if stop {
            self.finish(now, id, FinishReason::Stop);
        } else if length {
            self.finish(now, id, FinishReason::Length);
        }
        Ok(())
    }
}
