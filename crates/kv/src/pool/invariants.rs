//! The pool's invariants, recomputed from scratch: ref counts and charges
//! from the registry of live leases, states from the free list and the LRU
//! list, and the prefix index against the blocks it names.

use std::collections::BTreeMap;

use super::{BlockPool, State, TIERS};

impl BlockPool {
    /// Checks every invariant and panics with the broken one (tests,
    /// debug assertions).
    pub fn check_invariants(&mut self) {
        self.reclaim();
        let n = self.blocks.len();
        assert_eq!(
            self.free.len() + self.lru.len() as usize + self.used as usize,
            n,
            "invariant free + used + cached == total broken"
        );

        let mut in_free = vec![false; n];
        for &b in &self.free {
            let i = b as usize;
            assert!(i < n, "free list holds block {b}, beyond the pool");
            assert!(!in_free[i], "block {b} is twice in the free list");
            in_free[i] = true;
        }
        let mut in_lru = vec![false; n];
        for b in self.lru.checked_order() {
            in_lru[b as usize] = true;
        }

        // Ref counts and charges as the live tables say they should be.
        let mut holders = vec![0u32; n];
        // Lease id + 1 of the last table that named each block: a block
        // named twice by one table would alias two logical positions.
        let mut last_table = vec![0u64; n];
        let mut tenant_sum: BTreeMap<u32, u64> = BTreeMap::new();
        let mut tier_sum = vec![0u64; TIERS];
        for (&id, rec) in &self.leases {
            for &b in &rec.table {
                let i = b as usize;
                assert!(i < n, "lease {id} holds block {b}, beyond the pool");
                assert_ne!(last_table[i], id + 1, "lease {id} holds block {b} twice");
                last_table[i] = id + 1;
                holders[i] += 1;
            }
            assert!(
                rec.committed <= rec.table.len(),
                "lease {id} committed {} blocks of {}",
                rec.committed,
                rec.table.len()
            );
            if !rec.table.is_empty() {
                *tenant_sum.entry(rec.owner.tenant).or_insert(0) += rec.table.len() as u64;
            }
            tier_sum[usize::from(rec.owner.tier)] += rec.table.len() as u64;
        }

        let mut used = 0u32;
        for (i, blk) in self.blocks.iter().enumerate() {
            let registered = self.cache.is_registered(i as u32);
            let where_ = (in_free[i], in_lru[i]);
            match blk.state {
                State::Free => {
                    assert_eq!(
                        where_,
                        (true, false),
                        "free block {i} not exactly in the free list"
                    );
                    assert!(
                        !registered,
                        "free block {i} is registered in the prefix cache"
                    );
                }
                State::Cached => {
                    assert_eq!(
                        where_,
                        (false, true),
                        "cached block {i} not exactly in the LRU list"
                    );
                    assert!(
                        registered,
                        "cached block {i} is not registered in the prefix cache"
                    );
                }
                State::Used => {
                    assert_eq!(
                        where_,
                        (false, false),
                        "used block {i} is in the free or LRU list"
                    );
                    used += 1;
                }
            }
            assert_eq!(
                blk.refs, holders[i],
                "block {i}: ref count {} but {} live table entries",
                blk.refs, holders[i]
            );
            assert_eq!(
                blk.refs > 0,
                blk.state == State::Used,
                "block {i} is {:?} with ref count {}",
                blk.state,
                blk.refs
            );
            assert!(
                holders[i] <= 1 || blk.shared != 0,
                "block {i} is in {} tables but was shared neither through the prefix cache nor by fork",
                holders[i]
            );
        }
        assert_eq!(
            used, self.used,
            "used count {} but {used} used blocks",
            self.used
        );

        assert_eq!(
            self.tenant_held, tenant_sum,
            "tenant charges differ from live tables"
        );
        assert_eq!(
            self.tier_held, tier_sum,
            "tier charges differ from live tables"
        );
        for (&tenant, &held) in &self.tenant_held {
            if let Some(max) = self.quota(tenant) {
                assert!(
                    held <= u64::from(max),
                    "tenant {tenant} holds {held} blocks, quota {max}"
                );
            }
        }

        // The offload tier: every slot free or holding one registered block.
        let slots = self.offload.slots as usize;
        assert_eq!(
            self.slot_free.len() + self.slot_lru.len() as usize,
            slots,
            "invariant free + spilled == slots broken in the offload tier"
        );
        let mut slot_seen = vec![false; slots];
        for &s in &self.slot_free {
            let i = s as usize;
            assert!(i < slots, "free slot {s} beyond the offload tier");
            assert!(!slot_seen[i], "slot {s} is twice in the free list");
            slot_seen[i] = true;
            assert!(
                !self.cache.is_registered(n as u32 + s),
                "free slot {s} is registered in the prefix cache"
            );
        }
        for s in self.slot_lru.checked_order() {
            let i = s as usize;
            assert!(!slot_seen[i], "slot {s} is both free and spilled");
            slot_seen[i] = true;
            assert!(
                self.cache.is_registered(n as u32 + s),
                "spilled slot {s} is not registered in the prefix cache"
            );
        }

        self.cache.check();
    }
}
