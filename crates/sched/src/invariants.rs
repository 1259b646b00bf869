//! Every invariant of the scheduler, checked in one place (tests, simulation).

use std::collections::BTreeSet;

use crate::Scheduler;

impl Scheduler {
    /// Checks the KV pool's accounting, free + leased + cached = total,
    /// from its three separate structures (free list, lease count, LRU):
    /// cheap enough for every step of a large pool; panics if broken.
    pub fn check_kv_accounting(&mut self) {
        let u = self.pool.usage();
        assert_eq!(
            u.free as u64 + u.used as u64 + u.cached as u64,
            u.total as u64,
            "KV accounting: free {} + leased {} + cached {} != total {}",
            u.free,
            u.used,
            u.cached,
            u.total
        );
    }

    /// Checks every invariant (the pool's too) and panics with the broken one.
    pub fn check_invariants(&mut self) {
        self.pool.check_invariants();
        let ntiers = self.cfg.tiers.len();
        let ntenants = self.cfg.tenants.len();
        assert!(
            self.running.len() <= self.cfg.max_num_seqs,
            "too many running"
        );

        // The running batch: distinct, in admission order, all leased.
        let mut last_admit = None;
        for id in &self.running {
            let seq = self.seqs.get(id).expect("running id is a live request");
            assert!(seq.is_running(), "{id} in the batch without a lease");
            assert!(
                last_admit < Some(seq.admit_seq),
                "batch out of admission order"
            );
            last_admit = Some(seq.admit_seq);
        }

        // The queues: distinct, each waiting request in its own tenant's queue.
        let mut queued = BTreeSet::new();
        for (tenant, q) in self.waiting.iter().enumerate() {
            for id in q {
                let seq = self.seqs.get(id).expect("queued id is a live request");
                assert_eq!(seq.tenant, tenant, "{id} in another tenant's queue");
                assert!(!seq.is_running(), "{id} queued while running");
                assert!(queued.insert(*id), "{id} queued twice");
            }
        }

        let mut tier_queued = vec![0; ntiers];
        let mut tier_running = vec![0; ntiers];
        let mut tenant_live = vec![0u32; ntenants];
        let mut tenant_blocks = vec![0u64; ntenants];
        let mut deadlines = 0;
        for (id, seq) in &self.seqs {
            assert_eq!(seq.id, *id);
            assert_eq!(usize::from(self.cfg.tenants[seq.tenant].tier.0), seq.tier);
            assert!(
                seq.num_computed < seq.tokens.len(),
                "{id} has nothing to compute"
            );
            assert!(seq.generated() < seq.max_tokens, "{id} outlived max_tokens");
            assert!(
                seq.tokens.len() < self.cfg.max_model_len,
                "{id} outlived the model length"
            );
            assert!(seq.prompt_charged <= seq.prompt_len);
            assert_eq!(
                seq.deadline.is_some(),
                seq.first_scheduled.is_none(),
                "{id}: a deadline exactly until first scheduled"
            );
            if let Some(d) = seq.deadline {
                assert!(
                    self.deadlines.contains(&(d, *id)),
                    "{id} deadline not indexed"
                );
                deadlines += 1;
            }
            tenant_live[seq.tenant] += 1;
            match &seq.lease {
                Some(lease) => {
                    tier_running[seq.tier] += 1;
                    assert_eq!(lease.owner(), Self::owner_of(seq));
                    assert!(
                        lease.capacity_tokens() >= seq.num_computed,
                        "{id} KV beyond its lease"
                    );
                    let max_blocks = self.cfg.blocks_for(seq.max_kv_tokens());
                    assert!(
                        lease.blocks().len() as u64 <= max_blocks,
                        "{id} holds too many blocks"
                    );
                    tenant_blocks[seq.tenant] += lease.blocks().len() as u64;
                }
                None => {
                    tier_queued[seq.tier] += 1;
                    assert_eq!(seq.num_computed, 0, "{id} waiting with computed tokens");
                    assert!(queued.contains(id), "{id} neither queued nor running");
                }
            }
            if let Some(parked) = &seq.parked {
                assert!(!seq.is_running(), "{id} running with a parked lease");
                assert!(seq.hold_for.is_none(), "{id} both imported and held");
                assert_eq!(parked.owner(), Self::owner_of(seq));
                assert!(
                    parked.capacity_tokens() >= seq.prompt_len,
                    "{id} parked lease too small for its prompt"
                );
                tenant_blocks[seq.tenant] += parked.blocks().len() as u64;
            }
        }
        // Held blocks and reservations: owned leases, each with its deadline indexed.
        let mut kv_deadlines = 0;
        for (id, h) in &self.held {
            assert!(!self.seqs.contains_key(id), "{id} held while live");
            assert!(
                h.lease.capacity_tokens() >= h.tokens,
                "{id} held KV beyond its lease"
            );
            assert!(
                self.kv_deadlines.contains(&(h.deadline, *id)),
                "{id} hold deadline"
            );
            kv_deadlines += 1;
            tenant_blocks[h.lease.owner().tenant as usize] += h.lease.blocks().len() as u64;
        }
        for (id, r) in &self.reservations {
            assert!(!self.seqs.contains_key(id) && !self.held.contains_key(id));
            assert!(
                r.lease.capacity_tokens() >= r.tokens,
                "{id} reservation too small"
            );
            if let Some(d) = r.deadline {
                assert!(
                    self.kv_deadlines.contains(&(d, *id)),
                    "{id} reservation deadline"
                );
                kv_deadlines += 1;
            }
            tenant_blocks[r.lease.owner().tenant as usize] += r.lease.blocks().len() as u64;
        }
        assert_eq!(kv_deadlines, self.kv_deadlines.len(), "stale KV deadlines");
        assert_eq!(tier_queued, self.tier_queued, "tier queue counts");
        assert_eq!(tier_running, self.tier_running, "tier running counts");
        assert_eq!(tenant_live, self.tenant_live, "tenant live counts");
        assert_eq!(queued.len(), tier_queued.iter().sum::<usize>());
        assert_eq!(deadlines, self.deadlines.len(), "stale deadlines");
        for (t, &held) in tenant_blocks.iter().enumerate() {
            assert_eq!(
                u64::from(self.pool.tenant_blocks(t as u32)),
                held,
                "tenant {t} blocks"
            );
        }
        let used = self.pool.usage().used;
        assert!(
            u64::from(used) <= tenant_blocks.iter().sum::<u64>(),
            "blocks held by no lease"
        );
        if tenant_blocks.iter().all(|&b| b == 0) {
            assert_eq!(used, 0, "blocks used with no lease");
        }
    }
}
