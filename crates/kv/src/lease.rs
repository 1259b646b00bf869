//! A sequence's block table as a value: not `Clone`, and dropping it hands
//! its blocks back to the pool that issued it.

use std::fmt;
use std::sync::{Arc, Mutex, PoisonError};

use crate::{BlockId, Owner};

/// A lease given back by `Drop`, waiting for the pool's next call.
#[derive(Debug)]
pub(crate) struct Returned {
    /// The lease's id in the pool's registry.
    pub(crate) id: u64,
    /// Its table when dropped, checked against the registry's copy.
    pub(crate) blocks: Vec<BlockId>,
}

/// The channel from dropped leases back to their pool. A mutex rather than
/// an mpsc channel so that both ends stay `Send + Sync` and the pool can be
/// moved into an actor while leases live on other threads.
pub(crate) type ReturnQueue = Arc<Mutex<Vec<Returned>>>;

/// Moves every queued return into `into` (appending), holding the lock only
/// for the swap.
pub(crate) fn drain_returns(queue: &ReturnQueue, into: &mut Vec<Returned>) {
    // A panic while the lock was held cannot leave the Vec half-written
    // (push is the only mutation), so a poisoned queue is still sound.
    let mut pending = queue.lock().unwrap_or_else(PoisonError::into_inner);
    into.append(&mut pending);
}

/// One sequence's block table. Not `Clone`: dropping it gives its blocks
/// back (the pool reclaims them at its next call); [`crate::BlockPool::fork`]
/// is the only way to share blocks.
pub struct Lease {
    /// Key of this lease in the pool's registry.
    pub(crate) id: u64,
    pub(crate) owner: Owner,
    /// Physical blocks, logical order; mirrors the registry's copy.
    pub(crate) blocks: Vec<BlockId>,
    /// Tokens per block, for `capacity_tokens`.
    pub(crate) block_size: u32,
    /// Shared with the issuing pool; also identifies that pool.
    pub(crate) returns: ReturnQueue,
    /// False once `BlockPool::free` took the blocks, so `Drop` does nothing.
    pub(crate) live: bool,
}

impl Lease {
    pub(crate) fn new(
        id: u64,
        owner: Owner,
        blocks: Vec<BlockId>,
        block_size: u32,
        returns: ReturnQueue,
    ) -> Lease {
        Lease {
            id,
            owner,
            blocks,
            block_size,
            returns,
            live: true,
        }
    }

    /// Physical blocks, logical order.
    pub fn blocks(&self) -> &[BlockId] {
        &self.blocks
    }

    /// Who holds it.
    pub fn owner(&self) -> Owner {
        self.owner
    }

    /// Tokens the table can hold (`blocks().len() * block_size`).
    pub fn capacity_tokens(&self) -> usize {
        self.blocks.len() * self.block_size as usize
    }

    /// Marks the lease returned and hands over its table (for
    /// `BlockPool::free`, which releases the blocks itself).
    pub(crate) fn take_blocks(&mut self) -> Vec<BlockId> {
        assert!(self.live, "lease {} returned twice", self.id);
        self.live = false;
        std::mem::take(&mut self.blocks)
    }
}

impl Drop for Lease {
    fn drop(&mut self) {
        if !self.live {
            return;
        }
        self.live = false;
        let returned = Returned {
            id: self.id,
            blocks: std::mem::take(&mut self.blocks),
        };
        // Never panic in drop: a poisoned queue is still sound (see
        // `drain_returns`). If the pool is gone the Arc keeps the queue alive
        // and the return is simply never read.
        self.returns
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .push(returned);
    }
}

// Hand-written so that logging a lease does not lock or print the shared
// return queue.
impl fmt::Debug for Lease {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Lease")
            .field("id", &self.id)
            .field("owner", &self.owner)
            .field("blocks", &self.blocks)
            .finish()
    }
}
