//! Eviction order of cached blocks: an intrusive doubly linked list over
//! block ids, O(1) to append, to unlink any block (a prefix hit takes a
//! cached block back) and to pop the least recently released one.

use crate::BlockId;

/// End of the list. Never a block id: ids are below `num_blocks <= u32::MAX`.
const NIL: BlockId = BlockId::MAX;

/// The list. Links live in arrays indexed by block id, so nothing is
/// allocated after construction.
#[derive(Debug)]
pub(crate) struct LruList {
    prev: Vec<BlockId>,
    next: Vec<BlockId>,
    linked: Vec<bool>,
    /// Least recently released: evicted first.
    head: BlockId,
    /// Most recently released.
    tail: BlockId,
    len: u32,
}

impl LruList {
    /// An empty list over `num_blocks` block ids.
    pub(crate) fn new(num_blocks: u32) -> LruList {
        let n = num_blocks as usize;
        LruList {
            prev: vec![NIL; n],
            next: vec![NIL; n],
            linked: vec![false; n],
            head: NIL,
            tail: NIL,
            len: 0,
        }
    }

    /// Blocks in the list.
    pub(crate) fn len(&self) -> u32 {
        self.len
    }

    /// Appends `b` as the most recently released block.
    pub(crate) fn push_back(&mut self, b: BlockId) {
        let i = b as usize;
        assert!(!self.linked[i], "block {b} is already in the LRU list");
        self.linked[i] = true;
        self.prev[i] = self.tail;
        self.next[i] = NIL;
        if self.tail == NIL {
            self.head = b;
        } else {
            self.next[self.tail as usize] = b;
        }
        self.tail = b;
        self.len += 1;
    }

    /// Unlinks `b` wherever it is.
    pub(crate) fn remove(&mut self, b: BlockId) {
        let i = b as usize;
        assert!(self.linked[i], "block {b} is not in the LRU list");
        let (p, n) = (self.prev[i], self.next[i]);
        if p == NIL {
            self.head = n;
        } else {
            self.next[p as usize] = n;
        }
        if n == NIL {
            self.tail = p;
        } else {
            self.prev[n as usize] = p;
        }
        self.prev[i] = NIL;
        self.next[i] = NIL;
        self.linked[i] = false;
        self.len -= 1;
    }

    /// Unlinks and returns the least recently released block.
    pub(crate) fn pop_front(&mut self) -> Option<BlockId> {
        let b = self.head;
        if b == NIL {
            return None;
        }
        self.remove(b);
        Some(b)
    }

    /// The blocks oldest first, after checking that forward and backward
    /// links, membership flags and the length agree (panics otherwise).
    pub(crate) fn checked_order(&self) -> Vec<BlockId> {
        let mut order = Vec::with_capacity(self.len as usize);
        let mut prev = NIL;
        let mut b = self.head;
        while b != NIL {
            assert!(
                order.len() < self.len as usize,
                "LRU list: longer than its length {} (a cycle?)",
                self.len
            );
            assert!(
                self.linked[b as usize],
                "LRU list: block {b} linked but not marked"
            );
            assert_eq!(
                self.prev[b as usize], prev,
                "LRU list: bad back link at block {b}"
            );
            order.push(b);
            prev = b;
            b = self.next[b as usize];
        }
        assert_eq!(self.tail, prev, "LRU list: tail is not the last block");
        assert_eq!(
            order.len(),
            self.len as usize,
            "LRU list: length differs from its links"
        );
        let marked = self.linked.iter().filter(|&&l| l).count();
        assert_eq!(marked, order.len(), "LRU list: marked blocks not linked");
        order
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn order_push_remove_pop() {
        let mut l = LruList::new(5);
        for b in [3, 1, 4, 0] {
            l.push_back(b);
        }
        l.remove(1);
        assert_eq!(l.checked_order(), vec![3, 4, 0]);
        l.remove(0);
        l.push_back(2);
        assert_eq!(l.pop_front(), Some(3));
        assert_eq!(l.checked_order(), vec![4, 2]);
        assert_eq!(l.pop_front(), Some(4));
        assert_eq!(l.pop_front(), Some(2));
        assert_eq!(l.pop_front(), None);
        assert_eq!(l.checked_order(), Vec::<BlockId>::new());
    }
}
