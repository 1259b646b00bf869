//! The Router's picture of which prompt prefixes each worker has cached.
//!
//! The Router cannot see a worker's KV pool, but it knows every prompt it
//! sent there: a prompt's full blocks, hashed in a chain through their
//! parent, are recorded against the worker that ran it (Dynamo's
//! "approximate" KV router does the same). Entries age out first-in,
//! first-out past a cap, as the worker's LRU would evict them; a worker
//! that restarts loses its whole record.

use std::collections::VecDeque;

use rustc_hash::FxHashMap;

/// Hashes of a prompt's full blocks, each chained through its parent, so
/// equal hashes mean equal prefixes (up to 64-bit collisions, which only
/// cost a routing choice here, never correctness).
pub fn block_hashes(prompt: &[u32], block_size: usize, salt: u64) -> Vec<u64> {
    let mut out = Vec::with_capacity(prompt.len() / block_size.max(1));
    let mut parent = salt ^ 0x9e37_79b9_7f4a_7c15;
    for block in prompt.chunks_exact(block_size.max(1)) {
        let mut h = parent;
        for &t in block {
            h = (h ^ t as u64).wrapping_mul(0x0000_0100_0000_01b3);
        }
        // SplitMix64's finaliser spreads the FNV state over all bits.
        h = flotilla_exec::rng::mix64(h);
        out.push(h);
        parent = h;
    }
    out
}

/// Block hashes a worker is believed to hold, with a cap.
#[derive(Debug)]
pub struct PrefixIndex {
    /// Block hash -> the tick it was last recorded (the keys are hashes
    /// already: one multiply hashes them again).
    seen: FxHashMap<u64, u64>,
    order: VecDeque<(u64, u64)>,
    tick: u64,
    cap: usize,
}

impl PrefixIndex {
    /// An empty index that remembers at most `cap` blocks.
    pub fn new(cap: usize) -> PrefixIndex {
        PrefixIndex {
            seen: FxHashMap::default(),
            order: VecDeque::new(),
            tick: 0,
            cap: cap.max(1),
        }
    }

    /// How many leading blocks of `hashes` the worker is believed to hold.
    pub fn matched(&self, hashes: &[u64]) -> usize {
        hashes
            .iter()
            .take_while(|h| self.seen.contains_key(h))
            .count()
    }

    /// Records that the worker now holds these blocks.
    pub fn insert(&mut self, hashes: &[u64]) {
        for &h in hashes {
            self.tick += 1;
            self.seen.insert(h, self.tick);
            self.order.push_back((h, self.tick));
        }
        while self.seen.len() > self.cap {
            let Some((h, t)) = self.order.pop_front() else {
                break;
            };
            // Only the newest record of a hash removes it.
            if self.seen.get(&h) == Some(&t) {
                self.seen.remove(&h);
            }
        }
        // Stale records of refreshed hashes pile up in `order`; drop them
        // when they outnumber live ones, so memory stays O(cap).
        if self.order.len() > 2 * self.cap {
            let seen = &self.seen;
            self.order.retain(|(h, t)| seen.get(h) == Some(t));
        }
    }

    /// Forgets everything (the worker restarted).
    pub fn clear(&mut self) {
        self.seen.clear();
        self.order.clear();
    }

    /// Blocks remembered.
    pub fn len(&self) -> usize {
        self.seen.len()
    }

    /// Whether nothing is remembered.
    pub fn is_empty(&self) -> bool {
        self.seen.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chained_hashes_match_prefixes_only() {
        let a: Vec<u32> = (0..64).collect();
        let mut b = a.clone();
        b[40] = 999;
        let (ha, hb) = (block_hashes(&a, 16, 0), block_hashes(&b, 16, 0));
        assert_eq!(ha.len(), 4);
        assert_eq!(ha[..2], hb[..2]);
        assert_ne!(ha[2], hb[2]);
        assert_ne!(ha[3], hb[3], "a change must propagate down the chain");
        assert_ne!(block_hashes(&a, 16, 1)[0], ha[0], "salt separates tenants");
        assert_eq!(
            block_hashes(&a[..15], 16, 0).len(),
            0,
            "partial blocks are not cached"
        );
    }

    #[test]
    fn index_matches_leading_blocks_and_ages_out() {
        let mut ix = PrefixIndex::new(4);
        let h = block_hashes(&(0..64).collect::<Vec<u32>>(), 16, 0);
        ix.insert(&h[..2]);
        assert_eq!(ix.matched(&h), 2);
        ix.insert(&[1, 2, 3]);
        assert_eq!(ix.len(), 4);
        assert_eq!(
            ix.matched(&h),
            0,
            "the oldest block aged out, so no prefix matches"
        );
        for i in 0..100 {
            ix.insert(&[7, i]);
        }
        assert!(ix.order.len() <= 9, "stale records are compacted");
        ix.clear();
        assert!(ix.is_empty());
    }
}
