//! The block pool: block states and ref counts, the registry of live leases,
//! quotas and reservations. The prefix index and the eviction order are its
//! parts ([`crate::prefix_cache`], [`crate::lru`]).

use std::collections::BTreeMap;
use std::fmt;
use std::sync::Arc;

use crate::lease::{ReturnQueue, Returned, drain_returns};
use crate::lru::LruList;
use crate::prefix_cache::{Link, PrefixCache};
use crate::{
    AllocError, BlockId, BlockMove, ConfigError, Lease, OffloadStats, Owner, PoolConfig, Usage,
};

mod invariants;
mod limits;
#[cfg(test)]
mod proptests;
#[cfg(test)]
mod tests;

/// Tiers are `u8`, so per-tier counters are a fixed array.
const TIERS: usize = u8::MAX as usize + 1;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum State {
    Free,
    Used,
    Cached,
}

/// How a block came to have a second holder (checked by
/// `check_invariants`: a block is shared only through these two doors).
const SHARED_PREFIX: u8 = 1;
const SHARED_FORK: u8 = 2;

#[derive(Clone, Copy, Debug)]
struct Block {
    /// Number of live lease-table entries naming this block.
    refs: u32,
    state: State,
    /// `SHARED_*` bits since it last became used.
    shared: u8,
}

/// The pool's copy of a live lease: the source of truth that ref counts and
/// charges are recomputed from.
#[derive(Debug)]
struct Record {
    owner: Owner,
    table: Vec<BlockId>,
    /// Salt of the prefix namespace the lease started in.
    salt: u64,
    /// Leading blocks already registered (or found registered elsewhere):
    /// `commit` resumes here instead of rehashing the whole sequence.
    committed: usize,
    /// Chain position after block `committed - 1`.
    chain: Link,
    /// False once a block could not be registered (or after `clear_cache`):
    /// later blocks would hang off a chain no lookup can reach.
    chain_ok: bool,
}

/// The pool.
pub struct BlockPool {
    block_size: u32,
    tenant_blocks_max: Vec<Option<u32>>,
    tier_reserved_blocks: Vec<u32>,
    blocks: Vec<Block>,
    /// Free blocks; popped from the end, lowest id first at start.
    free: Vec<BlockId>,
    /// Cached blocks, least recently released first.
    lru: LruList,
    used: u32,
    cache: PrefixCache,
    leases: BTreeMap<u64, Record>,
    next_lease_id: u64,
    /// Sum of table lengths by tenant (u64: forks can push it past the pool
    /// size).
    tenant_held: BTreeMap<u32, u64>,
    /// Sum of table lengths by tier.
    tier_held: Vec<u64>,
    returns: ReturnQueue,
    /// Reused by `reclaim` so that it allocates nothing in steady state.
    reclaim_buf: Vec<Returned>,
    /// The offload tier: free slots (popped from the end) and spilled
    /// blocks, least recently spilled first. A spilled block is registered
    /// in the prefix cache under key `blocks.len() + slot`.
    slot_free: Vec<u32>,
    slot_lru: LruList,
    /// Whether spilling and restoring pay (the owner's measured copy cost
    /// against recompute); while false, evicted blocks are dropped and
    /// spilled ones are not restored.
    offload_pays: bool,
    /// Moves decided and not yet taken by the owner, in order.
    moves: Vec<BlockMove>,
    offload: OffloadStats,
}

fn saturate(n: u64) -> u32 {
    u32::try_from(n).unwrap_or(u32::MAX)
}

impl BlockPool {
    /// Builds a pool with every block free.
    pub fn new(cfg: PoolConfig) -> Result<BlockPool, ConfigError> {
        if cfg.num_blocks == 0 || cfg.block_size == 0 {
            return Err(ConfigError::Empty);
        }
        let reserved: u64 = cfg.tier_reserved_blocks.iter().map(|&r| u64::from(r)).sum();
        if reserved >= u64::from(cfg.num_blocks) {
            return Err(ConfigError::OverReserved {
                reserved,
                total: cfg.num_blocks,
            });
        }
        let n = cfg.num_blocks;
        Ok(BlockPool {
            block_size: cfg.block_size,
            tenant_blocks_max: cfg.tenant_blocks_max,
            tier_reserved_blocks: cfg.tier_reserved_blocks,
            blocks: vec![
                Block {
                    refs: 0,
                    state: State::Free,
                    shared: 0,
                };
                n as usize
            ],
            free: (0..n).rev().collect(),
            lru: LruList::new(n),
            used: 0,
            cache: PrefixCache::new(
                n.checked_add(cfg.offload_blocks)
                    .ok_or(ConfigError::Empty)?,
                cfg.block_size,
            ),
            leases: BTreeMap::new(),
            next_lease_id: 0,
            tenant_held: BTreeMap::new(),
            tier_held: vec![0; TIERS],
            returns: Arc::default(),
            reclaim_buf: Vec::new(),
            slot_free: (0..cfg.offload_blocks).rev().collect(),
            slot_lru: LruList::new(cfg.offload_blocks),
            offload_pays: cfg.offload_blocks > 0,
            moves: Vec::new(),
            offload: OffloadStats {
                slots: cfg.offload_blocks,
                ..OffloadStats::default()
            },
        })
    }

    /// Tokens per block.
    pub fn block_size(&self) -> u32 {
        self.block_size
    }

    /// Starts a sequence's lease with the longest cached prefix of `tokens`
    /// under `salt` (0 = the shared namespace), taking at most
    /// `max_prefix_blocks` full blocks (the caller keeps at least one token
    /// to compute). Returns the lease and the number of tokens whose KV it
    /// already holds (a multiple of the block size). Fails only on quota.
    ///
    /// Taking an unheld cached block uses up a block like an allocation, so
    /// the prefix stops short rather than eat into other tiers'
    /// reservations; that shortens the hit, it never fails.
    ///
    /// Blocks of the prefix found in the offload tier are restored into hot
    /// blocks ([`BlockMove::Restore`]) while restoring pays, and count as
    /// allocations; otherwise the prefix ends at the first of them.
    pub fn start(
        &mut self,
        owner: Owner,
        salt: u64,
        tokens: &[u32],
        max_prefix_blocks: usize,
    ) -> Result<(Lease, usize), AllocError> {
        self.reclaim();
        let bs = self.block_size as usize;
        let n = self.blocks.len() as u32;
        let limit = (tokens.len() / bs).min(max_prefix_blocks);
        let mut unheld_budget = self.physical_available(owner.tier);
        let mut hits = Vec::with_capacity(limit);
        let mut link = Link::ROOT;
        let mut hot_missed = false;
        for block_tokens in tokens.chunks_exact(bs).take(limit) {
            let Some((b, next)) = self.cache.lookup(link, salt, block_tokens) else {
                hot_missed = true;
                break;
            };
            let spilled = b >= n;
            hot_missed |= spilled;
            if spilled && !self.offload_pays {
                break;
            }
            if spilled || self.blocks[b as usize].state == State::Cached {
                if unheld_budget == 0 {
                    break;
                }
                unheld_budget -= 1;
            }
            hits.push(b);
            link = next;
        }
        self.check_quota(owner, hits.len() as u64)?;
        // Hot hits are held first and spilled ones taken out of the tier's
        // LRU order, so the allocations that restore cannot evict them.
        for &b in &hits {
            if b < n {
                self.take_ref(b, SHARED_PREFIX);
            } else {
                self.slot_lru.remove(b - n);
            }
        }
        let mut restored = 0;
        for b in hits.iter_mut().filter(|b| **b >= n) {
            let slot = *b - n;
            let hot = self.alloc();
            self.cache.relocate(*b, hot);
            self.moves.push(BlockMove::Restore { slot, block: hot });
            self.slot_free.push(slot);
            *b = hot;
            restored += 1;
        }
        if self.offload.slots > 0 && hot_missed {
            self.offload.lookups += 1;
            self.offload.hits += u64::from(restored > 0);
            self.offload.restored += restored;
        }
        self.charge(owner, hits.len());
        let prefix_tokens = hits.len() * bs;
        let committed = hits.len();
        let lease = self.new_lease(owner, hits, salt, committed, link, true);
        Ok((lease, prefix_tokens))
    }

    /// Number of leading full blocks of `tokens` the prefix cache holds under
    /// `salt` (for routing and admission estimates; changes nothing).
    pub fn cached_prefix_blocks(&mut self, salt: u64, tokens: &[u32]) -> usize {
        self.reclaim();
        let hot = self.blocks.len() as u32;
        let mut link = Link::ROOT;
        let mut n = 0;
        for block_tokens in tokens.chunks_exact(self.block_size as usize) {
            let Some((b, next)) = self.cache.lookup(link, salt, block_tokens) else {
                break;
            };
            if b >= hot && !self.offload_pays {
                break;
            }
            link = next;
            n += 1;
        }
        n
    }

    /// Grows `lease` to hold at least `num_tokens` tokens, all or nothing:
    /// free blocks first, then LRU eviction of cached blocks.
    pub fn grow(&mut self, lease: &mut Lease, num_tokens: usize) -> Result<(), AllocError> {
        self.reclaim();
        self.assert_issued(lease);
        let want = num_tokens.div_ceil(self.block_size as usize);
        let have = lease.blocks.len();
        if want <= have {
            return Ok(());
        }
        let need = (want - have) as u64;
        let owner = lease.owner;
        self.check_quota(owner, need)?;
        if need > u64::from(self.physical_available(owner.tier)) {
            return Err(AllocError::NoBlocks {
                need: saturate(need),
                available: self.available_now(owner),
            });
        }
        // Checked above: every allocation below succeeds.
        for _ in 0..need {
            let b = self.alloc();
            lease.blocks.push(b);
        }
        let rec = self.record_mut(lease.id);
        rec.table.extend_from_slice(&lease.blocks[have..]);
        debug_assert_eq!(rec.table, lease.blocks);
        self.charge(owner, want - have);
        Ok(())
    }

    /// Shrinks `lease` to the blocks that hold its first `num_tokens`
    /// tokens, giving the rest back: the positions of rejected draft tokens
    /// (speculative decoding) whose KV was written but is not kept. Blocks
    /// already registered in the prefix cache stay (they hold committed
    /// tokens, never rejected ones). Returns the blocks given back.
    pub fn truncate(&mut self, lease: &mut Lease, num_tokens: usize) -> usize {
        self.reclaim();
        self.assert_issued(lease);
        let want = num_tokens.div_ceil(self.block_size as usize);
        let rec = self.record_mut(lease.id);
        let keep = want.max(rec.committed);
        if keep >= lease.blocks.len() {
            return 0;
        }
        rec.table.truncate(keep);
        let n = lease.blocks.len() - keep;
        // Last block first, as `release` does.
        while lease.blocks.len() > keep {
            let b = lease.blocks.pop().expect("longer than keep");
            self.unref(b);
        }
        self.uncharge(lease.owner, n);
        n
    }

    /// Blocks `owner` could get now (free + evictable, less other tiers'
    /// unused reservations, capped by its quota headroom).
    pub fn available(&mut self, owner: Owner) -> u32 {
        self.reclaim();
        self.available_now(owner)
    }

    /// Registers the lease's full blocks in the prefix cache. `tokens` are
    /// the sequence's tokens whose KV has been written (the first
    /// `tokens.len() / block_size` blocks are full). Idempotent; a block
    /// whose hash is already cached by another block stays unregistered.
    ///
    /// Blocks after one that cannot be registered (its hash slot held by a
    /// different, referenced block: a collision) stay unregistered too, as
    /// do all blocks of a lease whose `salt` differs from its `start` salt
    /// or that was live across [`BlockPool::clear_cache`].
    pub fn commit(&mut self, lease: &mut Lease, salt: u64, tokens: &[u32]) {
        self.reclaim();
        self.assert_issued(lease);
        let bs = self.block_size as usize;
        let rec = self.record_mut(lease.id);
        let full = (tokens.len() / bs).min(rec.table.len());
        if !rec.chain_ok || rec.committed >= full {
            return;
        }
        if salt != rec.salt {
            rec.chain_ok = false;
            return;
        }
        let (mut committed, mut chain) = (rec.committed, rec.chain);
        let mut chain_ok = true;
        while committed < full {
            let block_tokens = &tokens[committed * bs..(committed + 1) * bs];
            match self.commit_block(lease.blocks[committed], chain, salt, block_tokens) {
                Some(next) => chain = next,
                None => {
                    chain_ok = false;
                    break;
                }
            }
            committed += 1;
        }
        let rec = self.record_mut(lease.id);
        (rec.committed, rec.chain, rec.chain_ok) = (committed, chain, chain_ok);
    }

    /// A second lease sharing all of `lease`'s blocks (ref counts +1), for
    /// parallel sampling. The caller must copy-on-write a shared partial
    /// block before either lease writes into it ([`BlockPool::make_last_private`]).
    ///
    /// Charged to `owner`'s quota; takes no free block, so reservations do
    /// not apply.
    pub fn fork(&mut self, lease: &Lease, owner: Owner) -> Result<Lease, AllocError> {
        self.reclaim();
        self.assert_issued(lease);
        self.check_quota(owner, lease.blocks.len() as u64)?;
        for &b in &lease.blocks {
            self.take_ref(b, SHARED_FORK);
        }
        self.charge(owner, lease.blocks.len());
        let rec = self.record_mut(lease.id);
        let (salt, committed, chain, chain_ok) = (rec.salt, rec.committed, rec.chain, rec.chain_ok);
        Ok(self.new_lease(
            owner,
            lease.blocks.clone(),
            salt,
            committed,
            chain,
            chain_ok,
        ))
    }

    /// If the lease's last block is shared, replaces it with a fresh block
    /// and returns `(src, dst)` for the executor to copy.
    ///
    /// The table keeps its length, so the tenant's quota charge is unchanged
    /// and this never fails on quota; it takes one block, so it can fail with
    /// [`AllocError::NoBlocks`] (reservations apply).
    pub fn make_last_private(
        &mut self,
        lease: &mut Lease,
    ) -> Result<Option<(BlockId, BlockId)>, AllocError> {
        self.reclaim();
        self.assert_issued(lease);
        let Some(&src) = lease.blocks.last() else {
            return Ok(None);
        };
        if self.blocks[src as usize].refs == 1 {
            return Ok(None);
        }
        if self.physical_available(lease.owner.tier) == 0 {
            return Err(AllocError::NoBlocks {
                need: 1,
                available: self.available_now(lease.owner),
            });
        }
        let dst = self.alloc();
        // Ref count was >= 2: src stays used by its other holders.
        self.unref(src);
        let last = lease.blocks.len() - 1;
        lease.blocks[last] = dst;
        self.record_mut(lease.id).table[last] = dst;
        Ok(Some((src, dst)))
    }

    /// Gives a lease's blocks back now (dropping it does the same at the
    /// next call).
    pub fn free(&mut self, mut lease: Lease) {
        self.reclaim();
        self.assert_issued(&lease);
        let id = lease.id;
        let blocks = lease.take_blocks();
        self.release(id, &blocks);
    }

    /// Drops every cached (unheld) block, e.g. after the weights change.
    ///
    /// Also unregisters held blocks (they become free, not cached, when
    /// released) and stops live leases from registering more: KV computed
    /// before the call is never offered to a later sequence.
    pub fn clear_cache(&mut self) {
        self.reclaim();
        while let Some(b) = self.lru.pop_front() {
            self.cache.unregister(b);
            let blk = &mut self.blocks[b as usize];
            assert_eq!(
                blk.state,
                State::Cached,
                "block {b} in the LRU list but not cached"
            );
            blk.state = State::Free;
            self.free.push(b);
        }
        while let Some(slot) = self.slot_lru.pop_front() {
            self.drop_spilled(slot);
        }
        for b in self.cache.registered_blocks() {
            self.cache.unregister(b);
        }
        for rec in self.leases.values_mut() {
            rec.chain_ok = false;
        }
    }

    /// What the prefix cache registered and dropped since the last call
    /// (each block hash once, with its last change; blocks moved between
    /// tiers keep theirs), or its whole contents (`full`) when more changed
    /// than the log holds: the stream a Router's prefix index follows.
    pub fn take_prefix_changes(&mut self) -> crate::PrefixDelta {
        self.reclaim();
        self.cache.take_changes()
    }

    /// Every block hash the prefix cache holds (either tier), ascending:
    /// a Router's starting point. Leaves the change log alone.
    pub fn prefix_snapshot(&mut self) -> Vec<u64> {
        self.reclaim();
        self.cache.hashes()
    }

    /// Occupancy now.
    pub fn usage(&mut self) -> Usage {
        self.reclaim();
        Usage {
            total: self.blocks.len() as u32,
            free: self.free.len() as u32,
            used: self.used,
            cached: self.lru.len(),
        }
    }

    /// The offload tier's occupancy and counters.
    pub fn offload_stats(&mut self) -> OffloadStats {
        self.reclaim();
        OffloadStats {
            held: self.slot_lru.len(),
            ..self.offload
        }
    }

    /// Whether moving blocks through the offload tier pays (the owner's
    /// measured copy cost of a block below its recompute cost). While it
    /// does not, evicted blocks are dropped as without a tier and spilled
    /// ones are treated as misses (they stay until the tier drops them).
    pub fn set_offload_pays(&mut self, pays: bool) {
        self.offload_pays = pays && self.offload.slots > 0;
    }

    /// Whether the offload tier is in use now.
    pub fn offload_pays(&self) -> bool {
        self.offload_pays
    }

    /// The block moves decided since the last call, in the order they must
    /// run: the caller performs them before any step or block write that
    /// follows this call.
    pub fn take_moves(&mut self) -> Vec<BlockMove> {
        std::mem::take(&mut self.moves)
    }

    /// Whether moves are waiting to be taken.
    pub fn has_moves(&self) -> bool {
        !self.moves.is_empty()
    }

    /// Blocks a tenant holds now (a block shared by two of its leases
    /// counts twice).
    pub fn tenant_blocks(&mut self, tenant: u32) -> u32 {
        self.reclaim();
        saturate(self.tenant_held.get(&tenant).copied().unwrap_or(0))
    }

    /// Processes leases dropped since the last call.
    fn reclaim(&mut self) {
        drain_returns(&self.returns, &mut self.reclaim_buf);
        if self.reclaim_buf.is_empty() {
            return;
        }
        let mut buf = std::mem::take(&mut self.reclaim_buf);
        for r in buf.drain(..) {
            self.release(r.id, &r.blocks);
        }
        self.reclaim_buf = buf;
    }

    /// Ends lease `id`, whose own table was `blocks`.
    fn release(&mut self, id: u64, blocks: &[BlockId]) {
        let rec = self
            .leases
            .remove(&id)
            .unwrap_or_else(|| panic!("lease {id} returned but not live in this pool"));
        assert_eq!(
            rec.table, blocks,
            "lease {id}: its table differs from the pool's record"
        );
        // Last block first, so a sequence's tail (the part least likely to be
        // shared) is evicted before its head.
        for &b in rec.table.iter().rev() {
            self.unref(b);
        }
        self.uncharge(rec.owner, rec.table.len());
    }

    fn new_lease(
        &mut self,
        owner: Owner,
        table: Vec<BlockId>,
        salt: u64,
        committed: usize,
        chain: Link,
        chain_ok: bool,
    ) -> Lease {
        let id = self.next_lease_id;
        self.next_lease_id += 1;
        let rec = Record {
            owner,
            table: table.clone(),
            salt,
            committed,
            chain,
            chain_ok,
        };
        self.leases.insert(id, rec);
        Lease::new(id, owner, table, self.block_size, Arc::clone(&self.returns))
    }

    fn record_mut(&mut self, id: u64) -> &mut Record {
        self.leases
            .get_mut(&id)
            .unwrap_or_else(|| panic!("lease {id} is not live in this pool"))
    }

    /// A lease from another pool would corrupt both: refuse it loudly.
    fn assert_issued(&self, lease: &Lease) {
        assert!(
            Arc::ptr_eq(&lease.returns, &self.returns),
            "lease {} was issued by another pool",
            lease.id
        );
        assert!(lease.live, "lease {} already returned", lease.id);
    }

    /// Registers block `b` as the block after `chain`, or finds the block
    /// that already holds it; returns the chain position after it, or `None`
    /// when the chain cannot continue.
    fn commit_block(&mut self, b: BlockId, chain: Link, salt: u64, tokens: &[u32]) -> Option<Link> {
        let hash = self.cache.hash(chain, salt, tokens);
        if let Some(holder) = self.cache.holder(hash) {
            if self.cache.matches(holder, chain, salt, tokens) {
                // `b` itself (already registered, e.g. by a fork sibling) or
                // another block with the same contents: `b` stays as it is.
                return Some(self.cache.link(holder));
            }
            // Same hash, other contents: a collision, or an entry whose parent
            // was evicted and re-registered. An unheld one (cached or
            // spilled) is worth less than ours; a held one stays, and our
            // chain ends here.
            let hot = self.blocks.len() as u32;
            if holder >= hot {
                self.slot_lru.remove(holder - hot);
                self.drop_spilled(holder - hot);
            } else if self.blocks[holder as usize].state != State::Cached {
                return None;
            } else {
                self.uncache(holder);
            }
        }
        if self.cache.is_registered(b) {
            // Already the prefix block of other contents: two commits
            // disagree about a shared block.
            return None;
        }
        Some(self.cache.register(b, chain, salt, hash, tokens))
    }

    /// A cached block becomes free.
    fn uncache(&mut self, b: BlockId) {
        self.lru.remove(b);
        self.cache.unregister(b);
        let blk = &mut self.blocks[b as usize];
        assert_eq!(
            blk.state,
            State::Cached,
            "block {b} uncached while {:?}",
            blk.state
        );
        blk.state = State::Free;
        self.free.push(b);
    }

    /// A cached block leaves the hot tier: spilled to an offload slot
    /// (keeping its registration) while that pays, else unregistered.
    fn evict(&mut self, b: BlockId) {
        let slot = if self.offload_pays {
            self.slot_free.pop().or_else(|| {
                let oldest = self.slot_lru.pop_front()?;
                self.drop_spilled(oldest);
                self.slot_free.pop()
            })
        } else {
            None
        };
        match slot {
            Some(slot) => {
                self.cache.relocate(b, self.blocks.len() as u32 + slot);
                self.slot_lru.push_back(slot);
                self.moves.push(BlockMove::Spill { block: b, slot });
                self.offload.spilled += 1;
            }
            None => self.cache.unregister(b),
        }
    }

    /// A spilled block (already out of the tier's LRU order) is dropped:
    /// its slot becomes free.
    fn drop_spilled(&mut self, slot: u32) {
        self.cache.unregister(self.blocks.len() as u32 + slot);
        self.slot_free.push(slot);
        self.offload.dropped += 1;
    }

    /// Takes a free block, else evicts the least recently used cached one.
    /// The caller has checked that one is available.
    fn alloc(&mut self) -> BlockId {
        let (b, from) = match self.free.pop() {
            Some(b) => (b, State::Free),
            None => {
                let b = self
                    .lru
                    .pop_front()
                    .expect("alloc: caller checked that a block is available");
                self.evict(b);
                (b, State::Cached)
            }
        };
        let blk = &mut self.blocks[b as usize];
        assert!(
            blk.state == from && blk.refs == 0,
            "alloc: block {b} is {:?} with ref count {}, expected {from:?} and 0",
            blk.state,
            blk.refs
        );
        *blk = Block {
            refs: 1,
            state: State::Used,
            shared: 0,
        };
        self.used += 1;
        b
    }

    /// One more holder of a used or cached block.
    fn take_ref(&mut self, b: BlockId, how: u8) {
        let blk = &mut self.blocks[b as usize];
        match blk.state {
            State::Used => assert!(blk.refs > 0, "used block {b} with ref count 0"),
            State::Cached => {
                assert_eq!(blk.refs, 0, "cached block {b} with ref count {}", blk.refs);
                self.lru.remove(b);
                blk.state = State::Used;
                self.used += 1;
            }
            State::Free => panic!("block {b} shared while free"),
        }
        blk.refs = blk.refs.checked_add(1).expect("ref count overflow");
        if blk.refs > 1 {
            blk.shared |= how;
        }
    }

    /// One holder fewer; at zero the block becomes cached if registered,
    /// else free.
    fn unref(&mut self, b: BlockId) {
        let blk = &mut self.blocks[b as usize];
        assert!(
            blk.state == State::Used && blk.refs > 0,
            "block {b} released while {:?} with ref count {}",
            blk.state,
            blk.refs
        );
        blk.refs -= 1;
        if blk.refs > 0 {
            return;
        }
        blk.shared = 0;
        self.used -= 1;
        if self.cache.is_registered(b) {
            blk.state = State::Cached;
            self.lru.push_back(b);
        } else {
            blk.state = State::Free;
            self.free.push(b);
        }
    }

    /// Ref count of `b` (tests).
    #[cfg(test)]
    fn ref_count(&self, b: BlockId) -> u32 {
        self.blocks[b as usize].refs
    }

    /// Whether `b` is registered in the prefix cache (tests).
    #[cfg(test)]
    fn is_registered(&self, b: BlockId) -> bool {
        self.cache.is_registered(b)
    }
}

// Hand-written: the derived form would print every block and table.
impl fmt::Debug for BlockPool {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("BlockPool")
            .field("total", &self.blocks.len())
            .field("block_size", &self.block_size)
            .field("free", &self.free.len())
            .field("used", &self.used)
            .field("cached", &self.lru.len())
            .field("registered", &self.cache.len())
            .field("leases", &self.leases.len())
            .finish()
    }
}
