//! The paged KV block pool of one engine: fixed-size blocks with ref counts,
//! per-sequence block tables held in leases, a prefix cache of full blocks
//! keyed by a hash chained through the parent block (salted per tenant where
//! tenants must not share), LRU eviction of unreferenced cached blocks,
//! per-tenant quotas and per-tier reservations.
//!
//! Pure logic: no I/O, no clock, no randomness. The executor owns the bytes;
//! this crate only decides which physical block holds what.
//!
//! Every block is in exactly one of three states:
//! - free: no holder, no cached prefix;
//! - used: held by one or more leases (ref count = number of leases whose
//!   table contains it);
//! - cached: no holder, but its contents are a registered full prefix block
//!   that a later sequence may reuse; evicted LRU when free blocks run out.
//!
//! `free + used + cached == total` holds after every call.
//!
//! A pool may have a second tier of `offload_blocks` slots (host memory or
//! a file beside the hot blocks): a cached block evicted from the hot tier
//! is spilled to a slot, keeping its prefix registration, and a later
//! prefix hit on it is restored into a hot block. The tier has its own LRU
//! order and drops its least recently spilled block when full. Every slot
//! is free or holds exactly one registered block (`free + spilled ==
//! slots`); a block is in one tier at a time. The pool only decides: the
//! bytes move when the executor performs [`BlockMove`]s, which the pool
//! hands out in the order it made them ([`BlockPool::take_moves`]); the
//! owner of the executor performs them, in that order, before anything else
//! touches those blocks.
//!
//! A dropped [`Lease`] cannot reach the pool, so it queues its blocks on a
//! channel the pool shares with it; every `&mut self` method of
//! [`BlockPool`] reclaims that queue before doing anything else.

mod lease;
mod lru;
mod pool;
mod prefix_cache;

pub use lease::Lease;
pub use pool::BlockPool;
pub use prefix_cache::{PrefixDelta, prefix_hashes};

/// A physical block index, as the executor's block tables use it.
pub type BlockId = u32;

/// A block's bytes moving between the hot tier and the offload tier.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum BlockMove {
    /// Hot block `block` is copied to offload slot `slot` (before the hot
    /// block is reused).
    Spill {
        /// Hot block.
        block: BlockId,
        /// Offload slot.
        slot: u32,
    },
    /// Offload slot `slot` is copied into hot block `block` (before a step
    /// reads it).
    Restore {
        /// Offload slot.
        slot: u32,
        /// Hot block.
        block: BlockId,
    },
}

/// The offload tier's size and what it has done since the pool was built.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct OffloadStats {
    /// Slots in the tier (0: no tier).
    pub slots: u32,
    /// Slots holding a spilled block.
    pub held: u32,
    /// Blocks spilled from the hot tier.
    pub spilled: u64,
    /// Blocks restored into the hot tier on a prefix hit.
    pub restored: u64,
    /// Spilled blocks dropped to make room (least recently spilled first),
    /// or replaced by a hot copy of the same contents.
    pub dropped: u64,
    /// Prefix lookups that went past the hot tier's hits into the tier
    /// (the hot tier missed while the prompt had more full blocks).
    pub lookups: u64,
    /// Of those, the lookups that restored at least one block.
    pub hits: u64,
}

/// Who holds a lease: charged against the tenant's quota; the tier decides
/// which reservations it may use.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Owner {
    /// Tenant index.
    pub tenant: u32,
    /// Tier index.
    pub tier: u8,
}

/// Pool sizes and limits, validated by [`BlockPool::new`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PoolConfig {
    /// Blocks in the pool (> 0).
    pub num_blocks: u32,
    /// Tokens per block (> 0).
    pub block_size: u32,
    /// Max blocks each tenant may hold at once, by tenant index; `None` or a
    /// missing entry means no quota.
    pub tenant_blocks_max: Vec<Option<u32>>,
    /// Blocks kept for each tier, by tier index: other tiers cannot take the
    /// last blocks a tier has reserved and not yet used. Sum < num_blocks.
    pub tier_reserved_blocks: Vec<u32>,
    /// Slots of the offload tier (0: none).
    pub offload_blocks: u32,
}

/// Why a pool could not be built.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum ConfigError {
    /// Zero blocks or zero block size.
    #[error("the KV pool needs at least one block of at least one token")]
    Empty,
    /// Reservations leave nothing for anyone else.
    #[error(
        "tier reservations ({reserved} blocks) must leave part of the {total}-block pool unreserved"
    )]
    OverReserved {
        /// Sum of reservations.
        reserved: u64,
        /// Blocks in the pool.
        total: u32,
    },
}

/// Why blocks could not be allocated. Nothing changed.
#[derive(Debug, thiserror::Error, PartialEq, Eq, Clone)]
pub enum AllocError {
    /// Not enough free or evictable blocks (after reservations of other tiers).
    #[error("need {need} KV blocks, {available} available")]
    NoBlocks {
        /// Blocks asked for.
        need: u32,
        /// Blocks this owner could get now.
        available: u32,
    },
    /// The tenant would exceed its quota.
    #[error("tenant {tenant} would hold {would_hold} KV blocks, its quota is {max}")]
    Quota {
        /// Tenant index.
        tenant: u32,
        /// Blocks it would hold.
        would_hold: u32,
        /// Its quota.
        max: u32,
    },
}

/// Occupancy in blocks.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Usage {
    /// Blocks in the pool.
    pub total: u32,
    /// Unheld, uncached.
    pub free: u32,
    /// Held by at least one lease.
    pub used: u32,
    /// Unheld, holding a cached prefix block.
    pub cached: u32,
}
