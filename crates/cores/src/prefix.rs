//! The Router's picture of which prompt prefixes each worker has cached.
//!
//! Two sources feed it. Each engine node reports its pool's prefix cache
//! by block hash (`Message::Prefix`: the whole on a Router's first contact
//! or after a gap, then the changes once a heartbeat), so the picture is
//! the pool's own, whichever Router placed the requests, and a restarted
//! Router has it again within a heartbeat. Between reports, a prompt the
//! Router sends to a worker is recorded against it at once (Dynamo's
//! "approximate" KV router does only this). The hashes are the pool's
//! ([`flotilla_kv::prefix_hashes`]). Past a cap, entries age out
//! first-in, first-out; a worker that restarts loses its whole record.

use std::collections::VecDeque;

use rustc_hash::FxHashMap;

/// Hashes of a prompt's full blocks, each chained through its parent, as
/// the engines' pools key them, so equal hashes mean equal prefixes (up to
/// 64-bit collisions, which only cost a routing choice here, never
/// correctness).
pub fn block_hashes(prompt: &[u32], block_size: usize, salt: u64) -> Vec<u64> {
    flotilla_kv::prefix_hashes(prompt, block_size, salt)
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

    /// Records that the worker no longer holds these blocks.
    pub fn remove(&mut self, hashes: &[u64]) {
        for h in hashes {
            // Its record in `order` goes stale (its tick no longer matches).
            self.seen.remove(h);
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
        // A block the worker dropped ends the prefix there.
        ix.insert(&h);
        ix.remove(&h[1..2]);
        assert_eq!((ix.matched(&h), ix.len()), (1, 3));
        ix.insert(&h[1..2]);
        assert_eq!(ix.matched(&h), 4);
    }

    #[test]
    fn the_router_hashes_a_prompt_as_the_pool_does() {
        let prompt: Vec<u32> = (0..40).collect();
        assert_eq!(
            block_hashes(&prompt, 16, 3),
            flotilla_kv::prefix_hashes(&prompt, 16, 3)
        );
    }
}
