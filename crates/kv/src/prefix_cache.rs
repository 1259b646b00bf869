//! The prefix cache: which physical block holds the KV of which full block
//! of a token sequence.
//!
//! A block is keyed by a hash of (parent block's hash, salt, its tokens), the
//! first block's parent being a fixed seed, so one lookup per block finds the
//! longest cached prefix. The hash only finds a candidate: each entry keeps
//! its tokens, salt, parent hash and parent registration, and a lookup must
//! match all of them, so a 64-bit collision costs a cache miss, never wrong
//! KV. The parent registration (a never-reused node id) is what makes the
//! chain exact: two parents with colliding hashes still have different ids.

use std::collections::HashMap;
use std::hash::{BuildHasherDefault, Hasher};

use crate::BlockId;

/// Parent hash of a sequence's first block.
const ROOT_HASH: u64 = 0x9e37_79b9_7f4a_7c15;

/// Where a chain of full blocks has got to: the hash and registration of
/// its last block ([`Link::ROOT`] before the first).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Link {
    /// Hash of the last block (the parent hash of the next).
    pub(crate) hash: u64,
    /// Node id of the last block's registration; 0 for the root.
    pub(crate) node: u64,
}

impl Link {
    /// Before the first block.
    pub(crate) const ROOT: Link = Link {
        hash: ROOT_HASH,
        node: 0,
    };
}

/// A registered block.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Entry {
    /// Its key in the map.
    pub(crate) hash: u64,
    /// The chain position it continues.
    pub(crate) parent: Link,
    pub(crate) salt: u64,
    /// Unique for the pool's lifetime (ids are never reused).
    pub(crate) node: u64,
}

/// murmur3's 64-bit finaliser: a fixed bijective mix, so hashes are the same
/// in every run and on every node.
fn fmix64(mut k: u64) -> u64 {
    k ^= k >> 33;
    k = k.wrapping_mul(0xff51_afd7_ed55_8ccd);
    k ^= k >> 33;
    k = k.wrapping_mul(0xc4ce_b9fe_1a85_ec53);
    k ^= k >> 33;
    k
}

/// Hash of one full block given its parent's hash. Deterministic: no random
/// seed, no dependence on std's hasher version.
pub(crate) fn block_hash(parent: u64, salt: u64, tokens: &[u32]) -> u64 {
    let mut h = fmix64(parent ^ 0x2545_f491_4f6c_dd1d);
    h = fmix64(h ^ salt);
    h = fmix64(h ^ tokens.len() as u64);
    // Two tokens per mix: the block length is fixed per pool, so packing
    // cannot make two different blocks feed the same words.
    for pair in tokens.chunks(2) {
        let lo = u64::from(pair[0]);
        let hi = pair.get(1).map_or(0, |&t| u64::from(t) + 1);
        h = fmix64(h ^ lo ^ (hi << 32));
    }
    h
}

/// The cache's index. Block states (used / cached) live in the pool; this
/// only knows which blocks are registered and what they hold.
#[derive(Debug)]
/// A map hasher for keys that are hashes already: it passes them through.
#[derive(Default)]
pub(crate) struct KeyIsHash(u64);

impl Hasher for KeyIsHash {
    fn finish(&self) -> u64 {
        self.0
    }

    fn write(&mut self, bytes: &[u8]) {
        // Only u64 keys are hashed here; any other input still hashes.
        for &b in bytes {
            self.0 = (self.0 ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3);
        }
    }

    fn write_u64(&mut self, v: u64) {
        self.0 = v;
    }
}

pub(crate) struct PrefixCache {
    block_size: usize,
    /// Hash -> the one block registered under it. The keys are block
    /// hashes already: the map uses them as they are (no second hash), so
    /// its layout is the same in every run too.
    map: HashMap<u64, BlockId, BuildHasherDefault<KeyIsHash>>,
    /// By block id.
    entries: Vec<Option<Entry>>,
    /// Tokens of registered blocks, block `b` at `b * block_size..`; grown on
    /// demand to the highest registered block, then never reallocated.
    tokens: Vec<u32>,
    next_node: u64,
    /// All ones outside tests; tests narrow it to force collisions.
    hash_mask: u64,
    /// Registrations (true) and removals (false) since the last
    /// [`PrefixCache::take_changes`], in order; at most `changes_cap`
    /// (past it they are dropped and `changes_lost` says so).
    changes: Vec<(u64, bool)>,
    changes_cap: usize,
    changes_lost: bool,
}

/// What the prefix cache gained and lost since the last look, each hash
/// once with its last change, or (`full`) its whole contents in `stored`
/// when more changed than the log holds.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct PrefixDelta {
    /// `stored` is every hash the cache holds, not a change.
    pub full: bool,
    /// Block hashes registered (and still so at the last change).
    pub stored: Vec<u64>,
    /// Block hashes no longer registered.
    pub removed: Vec<u64>,
}

/// The hashes under which a pool registers `tokens`' full blocks for a
/// tenant of prefix salt `salt`, first block first: what a Router computes
/// for a prompt to find a worker's cached prefix in the hashes the pool
/// reports ([`crate::BlockPool::take_prefix_changes`]).
pub fn prefix_hashes(tokens: &[u32], block_size: usize, salt: u64) -> Vec<u64> {
    let bs = block_size.max(1);
    let mut out = Vec::with_capacity(tokens.len() / bs);
    let mut parent = ROOT_HASH;
    for block in tokens.chunks_exact(bs) {
        parent = block_hash(parent, salt, block);
        out.push(parent);
    }
    out
}

impl PrefixCache {
    /// An empty cache over `num_blocks` blocks of `block_size` tokens.
    pub(crate) fn new(num_blocks: u32, block_size: u32) -> PrefixCache {
        PrefixCache {
            block_size: block_size as usize,
            map: HashMap::default(),
            entries: vec![None; num_blocks as usize],
            tokens: Vec::new(),
            next_node: 1,
            hash_mask: u64::MAX,
            changes: Vec::new(),
            // Each block is registered and removed at most once between
            // looks unless it is churned: twice the pool, and some.
            changes_cap: 2 * num_blocks as usize + 1024,
            changes_lost: false,
        }
    }

    fn log(&mut self, hash: u64, stored: bool) {
        if self.changes.len() >= self.changes_cap {
            self.changes.clear();
            self.changes_lost = true;
        }
        if !self.changes_lost {
            self.changes.push((hash, stored));
        }
    }

    /// The changes since the last call (each hash's last), or the whole
    /// contents when the log overflowed; the log starts again empty.
    pub(crate) fn take_changes(&mut self) -> PrefixDelta {
        if std::mem::take(&mut self.changes_lost) {
            self.changes.clear();
            return PrefixDelta {
                full: true,
                stored: self.hashes(),
                removed: Vec::new(),
            };
        }
        let mut last: HashMap<u64, bool, BuildHasherDefault<KeyIsHash>> = HashMap::default();
        let mut order = Vec::with_capacity(self.changes.len());
        for &(h, stored) in &self.changes {
            if last.insert(h, stored).is_none() {
                order.push(h);
            }
        }
        self.changes.clear();
        let mut d = PrefixDelta::default();
        for h in order {
            if last[&h] {
                d.stored.push(h);
            } else {
                d.removed.push(h);
            }
        }
        d
    }

    /// Every registered hash, ascending.
    pub(crate) fn hashes(&self) -> Vec<u64> {
        let mut all: Vec<u64> = self.map.keys().copied().collect();
        all.sort_unstable();
        all
    }

    /// Narrows every hash to `mask`, so tests can make collisions common.
    #[cfg(test)]
    pub(crate) fn set_hash_mask(&mut self, mask: u64) {
        assert!(self.map.is_empty(), "set the hash mask before registering");
        self.hash_mask = mask;
    }

    /// Hash of a block continuing `parent`.
    pub(crate) fn hash(&self, parent: Link, salt: u64, tokens: &[u32]) -> u64 {
        debug_assert_eq!(tokens.len(), self.block_size);
        block_hash(parent.hash, salt, tokens) & self.hash_mask
    }

    /// The registered block holding exactly this block after `parent`, and
    /// the chain position after it.
    pub(crate) fn lookup(
        &self,
        parent: Link,
        salt: u64,
        tokens: &[u32],
    ) -> Option<(BlockId, Link)> {
        let b = *self.map.get(&self.hash(parent, salt, tokens))?;
        self.matches(b, parent, salt, tokens)
            .then(|| (b, self.link(b)))
    }

    /// Whether `b` is registered as exactly this block after `parent`.
    pub(crate) fn matches(&self, b: BlockId, parent: Link, salt: u64, tokens: &[u32]) -> bool {
        match self.entries[b as usize] {
            Some(e) => e.parent == parent && e.salt == salt && self.tokens_of(b) == tokens,
            None => false,
        }
    }

    /// The chain position after registered block `b`.
    pub(crate) fn link(&self, b: BlockId) -> Link {
        let e = self.entries[b as usize].expect("link of an unregistered block");
        Link {
            hash: e.hash,
            node: e.node,
        }
    }

    /// The block registered under `hash`, if any.
    pub(crate) fn holder(&self, hash: u64) -> Option<BlockId> {
        self.map.get(&hash).copied()
    }

    /// Whether `b` is registered.
    pub(crate) fn is_registered(&self, b: BlockId) -> bool {
        self.entries[b as usize].is_some()
    }

    /// Registered blocks.
    pub(crate) fn len(&self) -> usize {
        self.map.len()
    }

    /// Registers `b` under `hash` (which must be `self.hash(parent, salt,
    /// tokens)` and free) and returns the chain position after it.
    pub(crate) fn register(
        &mut self,
        b: BlockId,
        parent: Link,
        salt: u64,
        hash: u64,
        tokens: &[u32],
    ) -> Link {
        let i = b as usize;
        assert!(self.entries[i].is_none(), "block {b} registered twice");
        // The caller computed it from these tokens (`check` verifies every
        // entry's hash against its tokens).
        debug_assert_eq!(
            hash,
            self.hash(parent, salt, tokens),
            "block {b}: hash of other contents"
        );
        let bs = self.block_size;
        if self.tokens.len() < (i + 1) * bs {
            self.tokens.resize((i + 1) * bs, 0);
        }
        self.tokens[i * bs..(i + 1) * bs].copy_from_slice(tokens);
        let node = self.next_node;
        self.next_node += 1;
        self.entries[i] = Some(Entry {
            hash,
            parent,
            salt,
            node,
        });
        let prev = self.map.insert(hash, b);
        assert!(prev.is_none(), "hash {hash:#x} registered for two blocks");
        self.log(hash, true);
        Link { hash, node }
    }

    /// Moves `from`'s registration (entry, tokens, hash slot) to `to`,
    /// which must be unregistered: the block's bytes moved between tiers.
    /// Its chain position (hash, node) is unchanged, so the blocks after it
    /// still find it.
    pub(crate) fn relocate(&mut self, from: BlockId, to: BlockId) {
        let e = self.entries[from as usize]
            .take()
            .unwrap_or_else(|| panic!("block {from} relocated but not registered"));
        assert!(
            self.entries[to as usize].is_none(),
            "block {from} relocated onto registered {to}"
        );
        let bs = self.block_size;
        let (f, t) = (from as usize, to as usize);
        if self.tokens.len() < (t + 1) * bs {
            self.tokens.resize((t + 1) * bs, 0);
        }
        self.tokens.copy_within(f * bs..(f + 1) * bs, t * bs);
        self.entries[t] = Some(e);
        let prev = self.map.insert(e.hash, to);
        assert_eq!(
            prev,
            Some(from),
            "hash map entry of block {from} points elsewhere"
        );
    }

    /// Removes `b`'s registration.
    pub(crate) fn unregister(&mut self, b: BlockId) {
        let e = self.entries[b as usize]
            .take()
            .unwrap_or_else(|| panic!("block {b} unregistered but not registered"));
        let removed = self.map.remove(&e.hash);
        assert_eq!(
            removed,
            Some(b),
            "hash map entry of block {b} points elsewhere"
        );
        self.log(e.hash, false);
    }

    /// Registered blocks, ascending (deterministic order for callers that
    /// unregister them all).
    pub(crate) fn registered_blocks(&self) -> Vec<BlockId> {
        (0..self.entries.len() as u32)
            .filter(|&b| self.is_registered(b))
            .collect()
    }

    /// Panics unless the map and the entries describe the same registrations
    /// and every entry's hash is the hash of what it stores.
    pub(crate) fn check(&self) {
        let mut registered = 0;
        for (i, e) in self.entries.iter().enumerate() {
            let Some(e) = e else { continue };
            let b = i as BlockId;
            registered += 1;
            assert_eq!(
                self.map.get(&e.hash),
                Some(&b),
                "prefix cache: block {b} registered but its hash maps elsewhere"
            );
            assert_eq!(
                e.hash,
                self.hash(e.parent, e.salt, self.tokens_of(b)),
                "prefix cache: block {b} stored under a hash of other contents"
            );
            assert!(
                e.node > e.parent.node && e.node < self.next_node,
                "prefix cache: block {b} has node {} after parent {}",
                e.node,
                e.parent.node
            );
        }
        assert_eq!(
            registered,
            self.map.len(),
            "prefix cache: the hash map holds blocks with no entry"
        );
    }

    fn tokens_of(&self, b: BlockId) -> &[u32] {
        let bs = self.block_size;
        let i = b as usize;
        &self.tokens[i * bs..(i + 1) * bs]
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hash_is_pinned() {
        // Fixed across runs, builds and nodes: a change here invalidates
        // every cross-node routing decision made on these hashes.
        assert_eq!(block_hash(Link::ROOT.hash, 0, &[1, 2, 3, 4]), PINNED);
        assert_ne!(block_hash(Link::ROOT.hash, 1, &[1, 2, 3, 4]), PINNED);
        assert_ne!(block_hash(Link::ROOT.hash, 0, &[1, 2, 4, 3]), PINNED);
        assert_ne!(block_hash(Link::ROOT.hash, 0, &[0, 2, 3, 4]), PINNED);
        // An odd-length block must not equal its zero-padded sibling.
        assert_ne!(block_hash(1, 0, &[5]), block_hash(1, 0, &[5, 0]));
    }

    const PINNED: u64 = 0xd482f7770f6b0bdc;
}
