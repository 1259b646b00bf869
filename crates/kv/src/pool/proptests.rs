//! A state-machine property test: random operations by several owners on a
//! small pool, with prompts from a tiny alphabet so prefixes (and, with a
//! narrowed hash, hash buckets) collide often. A model tracks every lease's
//! tokens and what each block holds, so a prefix hit that hands out the
//! wrong KV is caught, not just a broken count. With an offload tier, the
//! model performs the pool's block moves on its own copy of every block's
//! and slot's contents, so a spill or restore that moves the wrong bytes
//! (or in the wrong order) shows as a prefix hit holding other KV.

use std::cell::RefCell;
use std::collections::BTreeMap;

use proptest::prelude::*;
use proptest::sample::Index;
use proptest::test_runner::TestRunner;

use super::BlockPool;
use crate::{AllocError, BlockId, BlockMove, Lease, Owner, PoolConfig};

/// Tenants 0..3 may have quotas; tenant 7 and tier 5 are past the tables
/// (no quota, no reservation).
const OWNERS: [Owner; 4] = [
    Owner { tenant: 0, tier: 0 },
    Owner { tenant: 1, tier: 0 },
    Owner { tenant: 2, tier: 1 },
    Owner { tenant: 7, tier: 5 },
];

#[derive(Clone, Debug)]
struct Setup {
    num_blocks: u32,
    block_size: u32,
    quotas: Vec<Option<u32>>,
    reserved: Vec<u32>,
    hash_mask: u64,
    offload_blocks: u32,
}

#[derive(Clone, Debug)]
enum Op {
    /// Start a sequence on a prompt; with `prefill`, also compute and
    /// commit the rest of the prompt, as a scheduler would.
    Start {
        who: usize,
        salt: u64,
        prompt: Vec<u32>,
        max_prefix: usize,
        prefill: bool,
    },
    /// Compute `tokens` more tokens of a sequence (prefill chunk or decode),
    /// copying a shared partial block first.
    Write {
        lease: Index,
        tokens: Vec<u32>,
    },
    Commit {
        lease: Index,
    },
    /// Speculative rollback: the last `n` written tokens (never into a
    /// committed block) were rejected drafts; the lease shrinks to the rest.
    Rollback {
        lease: Index,
        n: usize,
    },
    Fork {
        lease: Index,
        who: usize,
    },
    /// Preemption: the scheduler drops the lease.
    Drop {
        lease: Index,
    },
    Free {
        lease: Index,
    },
    ClearCache,
    /// An unrelated sequence grabs many blocks, evicting cached ones.
    Pressure {
        who: usize,
        blocks: usize,
    },
    /// The owner's measurements say the offload tier pays, or not.
    OffloadPays(bool),
}

fn setup() -> impl Strategy<Value = Setup> {
    (
        6u32..32,
        1u32..4,
        prop::collection::vec(prop::option::of(2u32..24), 3),
        prop::collection::vec(0u32..6, 2),
        prop_oneof![Just(u64::MAX), Just(0xf), Just(0x3)],
        prop_oneof![Just(0u32), 1u32..12],
    )
        .prop_map(
            |(num_blocks, block_size, quotas, reserved, hash_mask, offload_blocks)| Setup {
                // Reservations must leave part of the pool unreserved.
                num_blocks: num_blocks.max(reserved.iter().sum::<u32>() + 2),
                block_size,
                quotas,
                reserved,
                hash_mask,
                offload_blocks,
            },
        )
}

fn tokens(max_len: usize) -> impl Strategy<Value = Vec<u32>> {
    prop::collection::vec(0u32..3, 0..max_len)
}

/// Shared openings ("system prompts") that prompts often begin with.
const OPENINGS: [[u32; 10]; 2] = [
    [0, 1, 2, 0, 1, 2, 0, 1, 2, 0],
    [0, 1, 1, 0, 2, 2, 1, 0, 0, 1],
];

fn prompt() -> impl Strategy<Value = Vec<u32>> {
    (0..OPENINGS.len(), 0usize..=10, tokens(6)).prop_map(|(k, len, tail)| {
        let mut p = OPENINGS[k][..len].to_vec();
        p.extend(tail);
        p
    })
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        5 => (0..OWNERS.len(), 0u64..2, prompt(), 0usize..6, prop::bool::weighted(0.8)).prop_map(
            |(who, salt, prompt, max_prefix, prefill)| Op::Start {
                who,
                salt,
                prompt,
                max_prefix,
                prefill
            }
        ),
        5 => (any::<Index>(), tokens(10)).prop_map(|(lease, tokens)| Op::Write { lease, tokens }),
        3 => any::<Index>().prop_map(|lease| Op::Commit { lease }),
        2 => (any::<Index>(), 1usize..8).prop_map(|(lease, n)| Op::Rollback { lease, n }),
        1 => (any::<Index>(), 0..OWNERS.len()).prop_map(|(lease, who)| Op::Fork { lease, who }),
        3 => any::<Index>().prop_map(|lease| Op::Drop { lease }),
        1 => any::<Index>().prop_map(|lease| Op::Free { lease }),
        1 => Just(Op::ClearCache),
        1 => (0..OWNERS.len(), 1usize..10).prop_map(|(who, blocks)| Op::Pressure { who, blocks }),
        1 => prop::bool::weighted(0.7).prop_map(Op::OffloadPays),
    ]
}

/// How a lease got each entry of its table.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Origin {
    /// Allocated for it (grow or copy-on-write).
    Fresh,
    /// A prefix hit at start.
    Cache,
    /// Inherited from the lease it was forked from.
    Fork,
}

struct Seq {
    lease: Lease,
    salt: u64,
    /// Tokens known so far (prompt, then generated).
    tokens: Vec<u32>,
    /// Leading tokens whose KV is written.
    written: usize,
    /// Leading tokens last committed to the prefix cache (a rollback never
    /// goes below them).
    committed: usize,
    origin: Vec<Origin>,
    /// `Model::clears` when it started.
    epoch: u32,
}

struct Model {
    pool: BlockPool,
    setup: Setup,
    seqs: Vec<Seq>,
    /// What each block's KV is of: the sequence prefix up to the end of the
    /// block's written part. `None` after a fresh allocation.
    contents: Vec<Option<Vec<u32>>>,
    /// The same for the offload tier's slots (what the last spill into
    /// each copied).
    slot_contents: Vec<Option<Vec<u32>>>,
    /// `clear_cache` calls so far.
    clears: u32,
    /// The prefix cache as a Router follows it: the changes taken at each
    /// check applied to the last (a snapshot where the log overflowed).
    follower: std::collections::BTreeSet<u64>,
    stats: Stats,
}

impl Model {
    fn new(setup: Setup) -> Model {
        let cfg = PoolConfig {
            num_blocks: setup.num_blocks,
            block_size: setup.block_size,
            tenant_blocks_max: setup.quotas.clone(),
            tier_reserved_blocks: setup.reserved.clone(),
            offload_blocks: setup.offload_blocks,
        };
        let mut pool = BlockPool::new(cfg).unwrap();
        pool.cache.set_hash_mask(setup.hash_mask);
        Model {
            contents: vec![None; setup.num_blocks as usize],
            slot_contents: vec![None; setup.offload_blocks as usize],
            pool,
            setup,
            seqs: Vec::new(),
            clears: 0,
            follower: Default::default(),
            stats: Stats::default(),
        }
    }

    fn bs(&self) -> usize {
        self.setup.block_size as usize
    }

    /// Performs the pool's block moves on the model's contents, in order,
    /// as the executor's owner would before anything writes a block.
    fn perform_moves(&mut self) {
        for m in self.pool.take_moves() {
            match m {
                BlockMove::Spill { block, slot } => {
                    self.stats.spills += 1;
                    self.slot_contents[slot as usize] = self.contents[block as usize].clone();
                }
                BlockMove::Restore { slot, block } => {
                    self.stats.restores += 1;
                    self.contents[block as usize] = self.slot_contents[slot as usize].clone();
                }
            }
        }
    }

    fn quota(&self, tenant: u32) -> Option<u32> {
        self.setup.quotas.get(tenant as usize).copied().flatten()
    }

    fn check_quota_error(&mut self, err: &AllocError, owner: Owner) {
        match *err {
            AllocError::Quota {
                tenant,
                would_hold,
                max,
            } => {
                assert_eq!(tenant, owner.tenant);
                assert_eq!(Some(max), self.quota(tenant));
                assert!(would_hold > max);
                assert!(self.pool.tenant_blocks(tenant) < would_hold);
                self.stats.quota_refusals += 1;
            }
            AllocError::NoBlocks { .. } => panic!("{err} where only quota may fail"),
        }
    }

    fn apply(&mut self, op: Op) {
        match op {
            Op::Start {
                who,
                salt,
                prompt,
                max_prefix,
                prefill,
            } => {
                if self.start(OWNERS[who], salt, prompt, max_prefix) && prefill {
                    let i = self.seqs.len() - 1;
                    let s = &self.seqs[i];
                    let rest = s.tokens[s.written..].to_vec();
                    self.write(i, &rest);
                    let s = &mut self.seqs[i];
                    self.pool
                        .commit(&mut s.lease, s.salt, &s.tokens[..s.written]);
                    s.committed = s.written;
                }
            }
            Op::Write { lease, tokens } => {
                if !self.seqs.is_empty() {
                    self.write(lease.index(self.seqs.len()), &tokens);
                }
            }
            Op::Commit { lease } => {
                if !self.seqs.is_empty() {
                    let i = lease.index(self.seqs.len());
                    let s = &mut self.seqs[i];
                    self.pool
                        .commit(&mut s.lease, s.salt, &s.tokens[..s.written]);
                    s.committed = s.committed.max(s.written);
                }
            }
            Op::Rollback { lease, n } => {
                if !self.seqs.is_empty() {
                    self.rollback(lease.index(self.seqs.len()), n);
                }
            }
            Op::Fork { lease, who } => {
                if !self.seqs.is_empty() {
                    self.fork(lease.index(self.seqs.len()), OWNERS[who]);
                }
            }
            Op::Drop { lease } => {
                if !self.seqs.is_empty() {
                    drop(self.seqs.swap_remove(lease.index(self.seqs.len())));
                }
            }
            Op::Free { lease } => {
                if !self.seqs.is_empty() {
                    let s = self.seqs.swap_remove(lease.index(self.seqs.len()));
                    self.pool.free(s.lease);
                }
            }
            Op::ClearCache => {
                self.pool.clear_cache();
                self.clears += 1;
                assert_eq!(self.pool.usage().cached, 0);
                assert_eq!(self.pool.offload_stats().held, 0);
            }
            Op::OffloadPays(pays) => self.pool.set_offload_pays(pays),
            Op::Pressure { who, blocks } => {
                assert!(
                    self.start(OWNERS[who], 0, Vec::new(), 0),
                    "an empty start cannot fail"
                );
                let i = self.seqs.len() - 1;
                self.write(i, &vec![9; blocks * self.bs()]);
            }
        }
    }

    /// Whether the start succeeded (the new sequence is last).
    fn start(&mut self, owner: Owner, salt: u64, prompt: Vec<u32>, max_prefix: usize) -> bool {
        let bs = self.bs();
        let max_prefix = max_prefix.min(prompt.len().saturating_sub(1) / bs);
        let cached = self.pool.cached_prefix_blocks(salt, &prompt);
        let started = self.pool.start(owner, salt, &prompt, max_prefix);
        self.perform_moves();
        match started {
            Err(e) => {
                self.check_quota_error(&e, owner);
                false
            }
            Ok((lease, hit)) => {
                let n = lease.blocks().len();
                assert_eq!(hit, n * bs);
                assert!(n <= max_prefix.min(cached));
                self.stats.prefix_hits += u32::from(n > 0);
                self.stats.hits_cut_by_reservation += u32::from(n < max_prefix.min(cached));
                for (i, &b) in lease.blocks().iter().enumerate() {
                    assert!(
                        self.pool.is_registered(b),
                        "prefix block {b} not registered"
                    );
                    assert_eq!(
                        self.contents[b as usize].as_deref(),
                        Some(&prompt[..(i + 1) * bs]),
                        "prefix hit on block {b} holds other KV"
                    );
                }
                self.seqs.push(Seq {
                    lease,
                    salt,
                    tokens: prompt,
                    written: hit,
                    committed: hit,
                    origin: vec![Origin::Cache; n],
                    epoch: self.clears,
                });
                true
            }
        }
    }

    fn write(&mut self, i: usize, more: &[u32]) {
        let bs = self.bs();
        let s = &mut self.seqs[i];
        let target = s.written + more.len();
        if s.tokens.len() < target {
            let extra = target - s.tokens.len();
            s.tokens.extend_from_slice(&more[more.len() - extra..]);
        }
        assert_eq!(s.lease.blocks().len(), s.written.div_ceil(bs));
        if !s.written.is_multiple_of(bs) {
            // The next token lands in the last (partial) block.
            let last = *s.lease.blocks().last().unwrap();
            let private = self.pool.make_last_private(&mut s.lease);
            self.perform_moves();
            let s = &mut self.seqs[i];
            match private {
                Ok(Some((src, dst))) => {
                    assert_eq!(src, last);
                    assert_eq!(*s.lease.blocks().last().unwrap(), dst);
                    *s.origin.last_mut().unwrap() = Origin::Fresh;
                    self.stats.copies += 1;
                    self.contents[dst as usize] = self.contents[src as usize].clone();
                }
                Ok(None) => assert_eq!(self.pool.ref_count(last), 1),
                Err(AllocError::NoBlocks { need: 1, .. }) => return,
                Err(e) => panic!("make_last_private: {e}"),
            }
        }
        let s = &mut self.seqs[i];
        let need = target.div_ceil(bs) - s.lease.blocks().len();
        let owner = s.lease.owner();
        let available = self.pool.available(owner);
        let before = (self.pool.usage(), self.pool.tenant_blocks(owner.tenant));
        let have = s.lease.blocks().len();
        let grown = self.pool.grow(&mut s.lease, target);
        self.perform_moves();
        let s = &mut self.seqs[i];
        match grown {
            Ok(()) => {
                assert!(need as u64 <= u64::from(available), "grew past available()");
                let cached_before = before.0.cached;
                let u = self.pool.usage();
                self.stats.evictions += cached_before.saturating_sub(u.cached);
            }
            Err(e) => {
                assert!(
                    need as u64 > u64::from(available),
                    "grow refused within available()"
                );
                assert_eq!(
                    s.lease.blocks().len(),
                    have,
                    "a failed grow changed the table"
                );
                if let AllocError::NoBlocks {
                    need: n,
                    available: a,
                } = e
                {
                    assert_eq!((n as usize, a), (need, available));
                    self.stats.no_block_refusals += 1;
                } else {
                    self.check_quota_error(&e, owner);
                }
                let after = (self.pool.usage(), self.pool.tenant_blocks(owner.tenant));
                assert_eq!(before, after, "a failed grow changed the pool");
                return;
            }
        }
        let s = &mut self.seqs[i];
        s.origin.resize(s.lease.blocks().len(), Origin::Fresh);
        for &b in &s.lease.blocks()[have..] {
            self.contents[b as usize] = None;
        }
        for j in s.written / bs..target.div_ceil(bs) {
            let b = s.lease.blocks()[j];
            assert_eq!(self.pool.ref_count(b), 1, "writing into shared block {b}");
            self.contents[b as usize] = Some(s.tokens[..target.min((j + 1) * bs)].to_vec());
        }
        s.written = target;
    }

    /// Un-writes the last `n` tokens of sequence `i` (not below what it
    /// committed, nor into a block another lease shares): the pool gives
    /// back exactly the blocks past the rest, and nothing else moves.
    fn rollback(&mut self, i: usize, n: usize) {
        let bs = self.bs();
        let s = &mut self.seqs[i];
        let floor = s.committed.max(s.written.saturating_sub(n));
        // A rollback only ever follows the step that wrote those positions
        // into the sequence's own fresh blocks.
        let first = floor / bs;
        if s.lease.blocks()[first.min(s.lease.blocks().len())..]
            .iter()
            .zip(&s.origin[first.min(s.origin.len())..])
            .any(|(&b, &o)| o != Origin::Fresh || self.pool.ref_count(b) != 1)
        {
            return;
        }
        let before = s.lease.blocks().len();
        let owner = s.lease.owner();
        let (usage, held) = (self.pool.usage(), self.pool.tenant_blocks(owner.tenant));
        let gone = self.pool.truncate(&mut s.lease, floor);
        let s = &mut self.seqs[i];
        assert_eq!(s.lease.blocks().len(), floor.div_ceil(bs));
        assert_eq!(gone, before - s.lease.blocks().len());
        assert_eq!(self.pool.tenant_blocks(owner.tenant), held - gone as u32);
        assert_eq!(self.pool.usage().used, usage.used - gone as u32);
        s.written = floor;
        s.tokens.truncate(floor);
        s.origin.truncate(s.lease.blocks().len());
        self.stats.rollbacks += u32::from(gone > 0);
    }

    fn fork(&mut self, i: usize, owner: Owner) {
        let s = &self.seqs[i];
        match self.pool.fork(&s.lease, owner) {
            Err(e) => self.check_quota_error(&e, owner),
            Ok(lease) => {
                assert_eq!(lease.blocks(), s.lease.blocks());
                self.stats.forks += 1;
                let seq = Seq {
                    origin: vec![Origin::Fork; lease.blocks().len()],
                    lease,
                    salt: s.salt,
                    tokens: s.tokens.clone(),
                    written: s.written,
                    committed: s.committed,
                    epoch: s.epoch,
                };
                self.seqs.push(seq);
            }
        }
    }

    /// Everything that must hold between operations.
    fn check(&mut self) {
        assert!(!self.pool.has_moves(), "a move was left unperformed");
        self.pool.check_invariants();
        let o = self.pool.offload_stats();
        assert_eq!(o.slots, self.setup.offload_blocks);
        assert!(o.held <= o.slots);
        assert_eq!(u64::from(o.held), o.spilled - o.restored - o.dropped);
        let u = self.pool.usage();
        assert_eq!(u.total, self.setup.num_blocks);
        assert_eq!(u.free + u.used + u.cached, u.total);
        // Following the change stream gives the cache's contents.
        let d = self.pool.take_prefix_changes();
        if d.full {
            self.follower = d.stored.iter().copied().collect();
        } else {
            assert!(
                d.stored.iter().all(|h| !d.removed.contains(h)),
                "a hash both stored and removed in one delta"
            );
            for h in &d.removed {
                self.follower.remove(h);
            }
            self.follower.extend(d.stored.iter().copied());
        }
        let snapshot: std::collections::BTreeSet<u64> =
            self.pool.prefix_snapshot().into_iter().collect();
        assert_eq!(self.follower, snapshot, "the change stream lost the cache");

        let mut holders: BTreeMap<BlockId, Vec<Origin>> = BTreeMap::new();
        let mut tenant_sum: BTreeMap<u32, u32> = BTreeMap::new();
        // Blocks some lease took from the cache since the last clear_cache.
        let mut hit_this_epoch: Vec<BlockId> = Vec::new();
        for s in &self.seqs {
            for (&b, &o) in s.lease.blocks().iter().zip(&s.origin) {
                holders.entry(b).or_default().push(o);
                if o == Origin::Cache && s.epoch == self.clears {
                    hit_this_epoch.push(b);
                }
            }
            *tenant_sum.entry(s.lease.owner().tenant).or_default() += s.lease.blocks().len() as u32;
        }
        assert_eq!(u.used as usize, holders.len());
        for (&b, origins) in &holders {
            assert_eq!(self.pool.ref_count(b) as usize, origins.len(), "block {b}");
            if origins.len() > 1 {
                let fresh = origins.iter().filter(|&&o| o == Origin::Fresh).count();
                assert!(fresh <= 1, "block {b} allocated fresh to two leases");
                // Only clear_cache unregisters a held block.
                assert!(
                    self.pool.is_registered(b)
                        || origins.contains(&Origin::Fork)
                        || (self.clears > 0 && origins.contains(&Origin::Cache)),
                    "block {b} shared but neither a prefix block nor forked"
                );
            }
        }
        for b in hit_this_epoch {
            assert!(
                self.pool.is_registered(b),
                "held prefix block {b} unregistered"
            );
        }
        for tenant in OWNERS.map(|o| o.tenant) {
            let held = self.pool.tenant_blocks(tenant);
            assert_eq!(held, tenant_sum.get(&tenant).copied().unwrap_or(0));
            if let Some(max) = self.quota(tenant) {
                assert!(held <= max, "tenant {tenant} holds {held}, quota {max}");
            }
        }
    }
}

/// How often the interesting paths ran, over all cases: a property that
/// never reached eviction or copy-on-write would pass vacuously.
#[derive(Debug, Default)]
struct Stats {
    prefix_hits: u32,
    hits_cut_by_reservation: u32,
    evictions: u32,
    copies: u32,
    forks: u32,
    quota_refusals: u32,
    no_block_refusals: u32,
    rollbacks: u32,
    spills: u32,
    restores: u32,
}

#[test]
fn random_operations_keep_every_invariant() {
    let config = ProptestConfig {
        cases: 2000,
        ..ProptestConfig::with_source_file(file!())
    };
    let stats = RefCell::new(Stats::default());
    let strategy = (setup(), prop::collection::vec(op(), 1..80));
    let result = TestRunner::new(config).run(&strategy, |(setup, ops)| {
        let mut model = Model::new(setup);
        for op in ops {
            model.apply(op);
            model.check();
        }
        model.seqs.clear();
        let u = model.pool.usage();
        prop_assert_eq!(u.used, 0);
        prop_assert_eq!(u.free + u.cached, u.total);
        for tenant in OWNERS.map(|o| o.tenant) {
            prop_assert_eq!(model.pool.tenant_blocks(tenant), 0);
        }
        model.pool.check_invariants();
        let mut all = stats.borrow_mut();
        let s = &model.stats;
        all.prefix_hits += s.prefix_hits;
        all.hits_cut_by_reservation += s.hits_cut_by_reservation;
        all.evictions += s.evictions;
        all.copies += s.copies;
        all.forks += s.forks;
        all.quota_refusals += s.quota_refusals;
        all.no_block_refusals += s.no_block_refusals;
        all.rollbacks += s.rollbacks;
        all.spills += s.spills;
        all.restores += s.restores;
        Ok(())
    });
    if let Err(e) = result {
        panic!("{e}");
    }
    let s = stats.into_inner();
    let reached = [
        s.prefix_hits,
        s.hits_cut_by_reservation,
        s.evictions,
        s.copies,
        s.forks,
        s.quota_refusals,
        s.no_block_refusals,
        s.rollbacks,
        s.spills,
        s.restores,
    ];
    eprintln!("{s:?}");
    assert!(
        reached.iter().all(|&n| n > 0),
        "a path was never exercised: {s:?}"
    );
}
