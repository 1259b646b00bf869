//! Unit tests of the pool, one behaviour each.

use super::BlockPool;
use crate::prefix_cache::{Link, block_hash};
use crate::{AllocError, ConfigError, Lease, Owner, PoolConfig, Usage};

fn config(num_blocks: u32, block_size: u32) -> PoolConfig {
    PoolConfig {
        num_blocks,
        block_size,
        tenant_blocks_max: Vec::new(),
        tier_reserved_blocks: Vec::new(),
        offload_blocks: 0,
    }
}

fn pool(num_blocks: u32, block_size: u32) -> BlockPool {
    BlockPool::new(config(num_blocks, block_size)).unwrap()
}

const A: Owner = Owner { tenant: 0, tier: 0 };
const B: Owner = Owner { tenant: 1, tier: 0 };

/// Starts a lease for `prompt`, grows it to the whole prompt and commits it,
/// as a prefill would.
fn prefill(pool: &mut BlockPool, owner: Owner, salt: u64, prompt: &[u32]) -> (Lease, usize) {
    let bs = pool.block_size() as usize;
    let max_prefix = prompt.len().saturating_sub(1) / bs;
    let (mut lease, hit) = pool.start(owner, salt, prompt, max_prefix).unwrap();
    pool.grow(&mut lease, prompt.len()).unwrap();
    pool.commit(&mut lease, salt, prompt);
    pool.check_invariants();
    (lease, hit)
}

#[test]
fn config_is_validated() {
    assert_eq!(
        BlockPool::new(config(0, 4)).unwrap_err(),
        ConfigError::Empty
    );
    assert_eq!(
        BlockPool::new(config(4, 0)).unwrap_err(),
        ConfigError::Empty
    );
    let mut cfg = config(4, 4);
    cfg.tier_reserved_blocks = vec![2, 2];
    assert_eq!(
        BlockPool::new(cfg).unwrap_err(),
        ConfigError::OverReserved {
            reserved: 4,
            total: 4
        }
    );
}

#[test]
fn pool_and_lease_are_send() {
    fn send<T: Send>() {}
    send::<BlockPool>();
    send::<Lease>();
}

#[test]
fn prefix_reused_by_second_sequence_with_same_prompt() {
    let mut pool = pool(16, 4);
    let prompt: Vec<u32> = (0..10).collect();
    let (first, hit) = prefill(&mut pool, A, 0, &prompt);
    assert_eq!(hit, 0);
    assert_eq!(pool.cached_prefix_blocks(0, &prompt), 2);

    let (second, hit) = prefill(&mut pool, B, 0, &prompt);
    assert_eq!(hit, 8, "both full blocks come from the cache");
    assert_eq!(second.blocks()[..2], first.blocks()[..2]);
    assert_ne!(
        second.blocks()[2],
        first.blocks()[2],
        "the partial block is private"
    );
    for &b in &first.blocks()[..2] {
        assert_eq!(pool.ref_count(b), 2);
    }
    assert_eq!(pool.usage().used, 4);

    drop(first);
    assert_eq!(
        pool.usage().used,
        3,
        "the second sequence still holds the prefix"
    );
    pool.free(second);
    assert_eq!(
        pool.usage(),
        Usage {
            total: 16,
            free: 14,
            used: 0,
            cached: 2
        }
    );
    pool.check_invariants();
}

#[test]
fn max_prefix_blocks_caps_the_hit() {
    let mut pool = pool(16, 2);
    let prompt = [1, 2, 3, 4, 5, 6];
    let (first, _) = prefill(&mut pool, A, 0, &prompt);
    let (second, hit) = pool.start(A, 0, &prompt, 1).unwrap();
    assert_eq!((hit, second.blocks()), (2, &first.blocks()[..1]));
    // The full prompt is cached, but the caller must keep a token to compute.
    let (third, hit) = pool.start(A, 0, &prompt, 2).unwrap();
    assert_eq!(hit, 4);
    drop((first, second, third));
    pool.check_invariants();
}

#[test]
fn different_salt_never_reuses() {
    let mut pool = pool(16, 4);
    let prompt: Vec<u32> = (0..10).collect();
    let (first, _) = prefill(&mut pool, A, 1, &prompt);
    assert_eq!(pool.cached_prefix_blocks(1, &prompt), 2);
    assert_eq!(pool.cached_prefix_blocks(2, &prompt), 0);
    assert_eq!(pool.cached_prefix_blocks(0, &prompt), 0);
    let (second, hit) = prefill(&mut pool, B, 2, &prompt);
    assert_eq!(hit, 0);
    assert!(second.blocks().iter().all(|b| !first.blocks().contains(b)));
    // Both namespaces now hold the same tokens, in different blocks.
    assert_eq!(pool.cached_prefix_blocks(2, &prompt), 2);
    assert_eq!(pool.cached_prefix_blocks(1, &prompt), 2);
}

#[test]
fn eviction_takes_least_recently_released_first() {
    let mut pool = pool(4, 2);
    let prompts = [[1, 2], [3, 4], [5, 6]];
    let leases: Vec<Lease> = prompts
        .iter()
        .map(|p| prefill(&mut pool, A, 0, p).0)
        .collect();
    let [a, b, c] = <[Lease; 3]>::try_from(leases).unwrap();
    // Released a, c, b: evicted in that order.
    drop(a);
    pool.free(c);
    drop(b);
    assert_eq!(pool.usage().cached, 3);
    // A prefix hit takes c back; released again, it becomes the newest.
    let (c_again, hit) = pool.start(A, 0, &prompts[2], 1).unwrap();
    assert_eq!(hit, 2);
    drop(c_again);

    let (mut big, _) = pool.start(B, 0, &[], 0).unwrap();
    pool.grow(&mut big, 4).unwrap(); // the free block, then a
    assert_eq!(pool.cached_prefix_blocks(0, &prompts[0]), 0);
    assert_eq!(pool.cached_prefix_blocks(0, &prompts[1]), 1);
    assert_eq!(pool.cached_prefix_blocks(0, &prompts[2]), 1);
    pool.grow(&mut big, 6).unwrap(); // then b
    assert_eq!(pool.cached_prefix_blocks(0, &prompts[1]), 0);
    assert_eq!(pool.cached_prefix_blocks(0, &prompts[2]), 1);
    pool.grow(&mut big, 8).unwrap(); // then c
    assert_eq!(pool.cached_prefix_blocks(0, &prompts[2]), 0);
    assert_eq!(pool.usage().used, 4);
    pool.check_invariants();
}

#[test]
fn release_evicts_a_sequence_tail_before_its_head() {
    let mut pool = pool(3, 1);
    let (lease, _) = prefill(&mut pool, A, 0, &[7, 8]);
    drop(lease);
    let (mut other, _) = pool.start(B, 0, &[], 0).unwrap();
    pool.grow(&mut other, 2).unwrap(); // the free block, then the tail [8]
    assert_eq!(pool.cached_prefix_blocks(0, &[7, 8]), 1);
}

#[test]
fn quota_refuses_and_changes_nothing() {
    let mut cfg = config(16, 2);
    cfg.tenant_blocks_max = vec![Some(3)];
    let mut pool = BlockPool::new(cfg).unwrap();
    let (mut lease, _) = pool.start(A, 0, &[], 0).unwrap();
    pool.grow(&mut lease, 6).unwrap();
    assert_eq!(pool.available(A), 0);
    let refused = AllocError::Quota {
        tenant: 0,
        would_hold: 4,
        max: 3,
    };
    assert_eq!(pool.grow(&mut lease, 7), Err(refused.clone()));
    assert_eq!(lease.blocks().len(), 3);
    assert_eq!(
        pool.fork(&lease, A).unwrap_err(),
        AllocError::Quota {
            tenant: 0,
            would_hold: 6,
            max: 3
        }
    );
    // Another tenant (and one past the quota table) has no such limit.
    assert!(pool.fork(&lease, B).is_ok());
    let far = Owner {
        tenant: 99,
        tier: 200,
    };
    assert_eq!(
        pool.available(far),
        13,
        "the fork was dropped: 3 of 16 held"
    );

    // A cached prefix that would push the tenant over its quota fails start.
    pool.commit(&mut lease, 0, &[1, 2, 3, 4, 5, 6]);
    drop(lease);
    let (mut small, _) = pool.start(A, 0, &[], 0).unwrap();
    pool.grow(&mut small, 2).unwrap();
    assert_eq!(
        pool.start(A, 0, &[1, 2, 3, 4, 5, 6, 7], 3).unwrap_err(),
        AllocError::Quota {
            tenant: 0,
            would_hold: 4,
            max: 3
        }
    );
    assert_eq!(pool.tenant_blocks(0), 1);
    pool.check_invariants();
}

#[test]
fn reservation_keeps_paid_blocks_from_free_tier() {
    let mut cfg = config(10, 1);
    cfg.tier_reserved_blocks = vec![0, 4];
    let mut pool = BlockPool::new(cfg).unwrap();
    let free_tier = Owner { tenant: 0, tier: 0 };
    let paid = Owner { tenant: 1, tier: 1 };
    assert_eq!(pool.available(free_tier), 6);
    assert_eq!(pool.available(paid), 10);

    let (mut free_lease, _) = pool.start(free_tier, 0, &[], 0).unwrap();
    pool.grow(&mut free_lease, 6).unwrap();
    assert_eq!(
        pool.grow(&mut free_lease, 7),
        Err(AllocError::NoBlocks {
            need: 1,
            available: 0
        })
    );
    assert_eq!(pool.available(paid), 4);
    let (mut paid_lease, _) = pool.start(paid, 0, &[], 0).unwrap();
    pool.grow(&mut paid_lease, 4).unwrap();
    assert_eq!(pool.usage().free, 0);

    // Once paid holds its reservation, what it frees is anyone's.
    pool.free(paid_lease);
    assert_eq!(
        pool.available(free_tier),
        0,
        "paid holds none of its 4 again"
    );
    pool.check_invariants();
}

#[test]
fn reservation_shortens_a_prefix_hit_on_unheld_blocks() {
    let mut cfg = config(6, 1);
    cfg.tier_reserved_blocks = vec![0, 3];
    let mut pool = BlockPool::new(cfg).unwrap();
    let free_tier = Owner { tenant: 0, tier: 0 };
    let prompt = [1, 2, 3, 4];
    let (lease, _) = prefill(&mut pool, free_tier, 0, &prompt[..3]);
    drop(lease);
    let (mut hog, _) = pool.start(free_tier, 0, &[], 0).unwrap();
    pool.grow(&mut hog, 1).unwrap(); // 2 free + 3 cached left, 3 reserved
    let (short, hit) = pool.start(free_tier, 0, &prompt, 3).unwrap();
    assert_eq!(
        hit, 2,
        "taking the third cached block would eat the reservation"
    );
    let paid = Owner { tenant: 1, tier: 1 };
    let (_, hit) = pool.start(paid, 0, &prompt, 3).unwrap();
    assert_eq!(hit, 3);
    drop((hog, short));
    pool.check_invariants();
}

#[test]
fn grow_is_all_or_nothing() {
    let mut pool = pool(4, 4);
    let (mut first, _) = pool.start(A, 0, &[], 0).unwrap();
    pool.grow(&mut first, 12).unwrap();
    let (mut second, _) = pool.start(B, 0, &[], 0).unwrap();
    pool.grow(&mut second, 1).unwrap();
    let before = pool.usage();
    assert_eq!(
        pool.grow(&mut second, 9),
        Err(AllocError::NoBlocks {
            need: 2,
            available: 0
        })
    );
    assert_eq!(second.blocks().len(), 1);
    assert_eq!(pool.usage(), before);
    // Growing within capacity takes nothing.
    pool.grow(&mut second, 4).unwrap();
    assert_eq!(pool.usage(), before);
    pool.check_invariants();
}

#[test]
fn dropping_a_lease_gives_its_blocks_back() {
    let mut pool = pool(8, 2);
    let before = pool.usage();
    let (mut lease, _) = pool.start(A, 0, &[1, 2, 3], 1).unwrap();
    pool.grow(&mut lease, 5).unwrap();
    let forked = pool.fork(&lease, B).unwrap();
    assert_eq!(pool.usage().used, 3);
    assert_eq!(pool.tenant_blocks(1), 3);
    drop(lease);
    // Dropped on another thread: returned all the same.
    std::thread::spawn(move || drop(forked)).join().unwrap();
    assert_eq!(pool.usage(), before);
    assert_eq!((pool.tenant_blocks(0), pool.tenant_blocks(1)), (0, 0));
    pool.check_invariants();
}

#[test]
fn fork_shares_and_make_last_private_copies() {
    let mut pool = pool(8, 4);
    let (mut parent, _) = pool.start(A, 0, &[], 0).unwrap();
    pool.grow(&mut parent, 6).unwrap();
    let mut child = pool.fork(&parent, B).unwrap();
    assert_eq!(child.blocks(), parent.blocks());
    assert_eq!(child.owner(), B);
    assert_eq!(child.capacity_tokens(), 8);
    assert_eq!((pool.tenant_blocks(0), pool.tenant_blocks(1)), (2, 2));
    assert_eq!(pool.usage().used, 2);
    pool.check_invariants();

    let last = parent.blocks()[1];
    let (src, dst) = pool.make_last_private(&mut child).unwrap().unwrap();
    assert_eq!(src, last);
    assert_eq!(child.blocks(), &[parent.blocks()[0], dst]);
    assert_eq!((pool.ref_count(src), pool.ref_count(dst)), (1, 1));
    assert_eq!(pool.make_last_private(&mut parent), Ok(None), "now private");
    assert_eq!(pool.make_last_private(&mut child), Ok(None));
    assert_eq!(pool.tenant_blocks(1), 2, "copy-on-write keeps the charge");
    assert_eq!(pool.usage().used, 3);
    pool.check_invariants();
}

#[test]
fn make_last_private_fails_cleanly_when_full() {
    let mut pool = pool(2, 1);
    let (mut parent, _) = pool.start(A, 0, &[], 0).unwrap();
    pool.grow(&mut parent, 2).unwrap();
    let mut child = pool.fork(&parent, A).unwrap();
    assert_eq!(
        pool.make_last_private(&mut child),
        Err(AllocError::NoBlocks {
            need: 1,
            available: 0
        })
    );
    assert_eq!(child.blocks(), parent.blocks());
    pool.check_invariants();
}

#[test]
fn commit_is_idempotent() {
    let mut pool = pool(8, 2);
    let prompt = [1, 2, 3, 4, 5];
    let (mut lease, _) = prefill(&mut pool, A, 0, &prompt);
    pool.commit(&mut lease, 0, &prompt);
    pool.commit(&mut lease, 0, &prompt[..2]);
    assert_eq!(pool.cache.len(), 2);
    drop(lease);
    assert_eq!(pool.usage().cached, 2);
    pool.check_invariants();
}

#[test]
fn duplicate_contents_stay_unregistered() {
    let mut pool = pool(8, 2);
    let prompt = [1, 2, 3, 4];
    // Two sequences prefill the same prompt before either commits.
    let (mut a, _) = pool.start(A, 0, &prompt, 1).unwrap();
    let (mut b, _) = pool.start(B, 0, &prompt, 1).unwrap();
    pool.grow(&mut a, 4).unwrap();
    pool.grow(&mut b, 4).unwrap();
    pool.commit(&mut a, 0, &prompt);
    pool.commit(&mut b, 0, &prompt);
    assert!(b.blocks().iter().all(|&x| !pool.is_registered(x)));
    drop((a, b));
    assert_eq!(pool.usage().cached, 2);
    assert_eq!(pool.usage().free, 6);
    pool.check_invariants();
}

/// Tokens `(x, x2)` whose one-block prompts land in the same hash bucket
/// under `mask`, and a `c` whose block after `x` lands in another.
fn colliding_parents(mask: u64) -> (u32, u32, u32) {
    let h = |t: u32| block_hash(Link::ROOT.hash, 0, &[t]) & mask;
    let x = 0;
    let x2 = (1..).find(|&t| h(t) == h(x)).unwrap();
    let c = (0..)
        .find(|&t| block_hash(h(x), 0, &[t]) & mask != h(x))
        .unwrap();
    (x, x2, c)
}

#[test]
fn colliding_hashes_never_share_blocks() {
    let mut pool = pool(8, 2);
    // Every block hashes alike: only the stored tokens tell them apart.
    pool.cache.set_hash_mask(0);
    let (first, _) = prefill(&mut pool, A, 0, &[1, 2, 3, 4, 5]);
    let (second, hit) = prefill(&mut pool, A, 0, &[1, 3, 3, 4, 5]);
    assert_eq!(hit, 0);
    assert!(second.blocks().iter().all(|b| !first.blocks().contains(b)));
    let (third, hit) = prefill(&mut pool, A, 0, &[1, 2, 9]);
    assert_eq!(hit, 2);
    assert_eq!(third.blocks()[0], first.blocks()[0]);
    pool.check_invariants();
}

#[test]
fn a_child_of_a_colliding_parent_is_not_reused() {
    let mask = 0xf;
    let (x, x2, c) = colliding_parents(mask);
    let mut pool = pool(8, 1);
    pool.cache.set_hash_mask(mask);
    let (first, _) = prefill(&mut pool, A, 0, &[x, c]);
    drop(first);
    // [x2] takes x's hash slot (x is unheld); [x, c]'s child entry remains,
    // its parent hash equal to x2's.
    let (second, _) = prefill(&mut pool, A, 0, &[x2]);
    assert_eq!(pool.usage().cached, 1);
    let (third, hit) = pool.start(B, 0, &[x2, c, 0], 2).unwrap();
    assert_eq!(hit, 1, "c was computed after x, not x2");
    assert_eq!(third.blocks(), second.blocks());
    pool.check_invariants();
}

#[test]
fn clear_cache_forgets_held_and_unheld_prefixes() {
    let mut pool = pool(8, 2);
    let (kept, _) = prefill(&mut pool, A, 0, &[1, 2, 3, 4]);
    let (gone, _) = prefill(&mut pool, A, 0, &[5, 6, 7, 8]);
    drop(gone);
    assert_eq!(pool.usage().cached, 2);
    pool.clear_cache();
    assert_eq!(pool.usage().cached, 0);
    assert_eq!(pool.cached_prefix_blocks(0, &[1, 2, 3, 4]), 0);
    drop(kept);
    assert_eq!(
        pool.usage().free,
        8,
        "held blocks come back free, not cached"
    );
    pool.check_invariants();
}

#[test]
#[should_panic(expected = "issued by another pool")]
fn a_lease_from_another_pool_is_refused() {
    let mut one = pool(4, 1);
    let mut other = pool(4, 1);
    let (lease, _) = one.start(A, 0, &[], 0).unwrap();
    other.free(lease);
}

fn offload_pool(num_blocks: u32, block_size: u32, slots: u32) -> BlockPool {
    BlockPool::new(PoolConfig {
        offload_blocks: slots,
        ..config(num_blocks, block_size)
    })
    .unwrap()
}

#[test]
fn an_evicted_prefix_is_spilled_and_restored_on_its_next_hit() {
    use crate::BlockMove;
    let mut pool = offload_pool(4, 2, 4);
    let chat = [1, 2, 3, 4, 5];
    let (first, _) = prefill(&mut pool, A, 0, &chat);
    let held = first.blocks().to_vec();
    drop(first);
    assert!(
        pool.take_moves().is_empty(),
        "nothing moves while blocks are free"
    );
    // Another sequence takes the whole hot tier: the two cached blocks of
    // the chat are evicted into the tier, the tail first.
    let (other, _) = prefill(&mut pool, B, 0, &[9, 9, 9, 9, 9, 9, 9, 9]);
    let spilled = pool.take_moves();
    assert_eq!(
        spilled,
        vec![
            BlockMove::Spill {
                block: held[1],
                slot: 0
            },
            BlockMove::Spill {
                block: held[0],
                slot: 1
            },
        ]
    );
    assert_eq!(pool.usage().cached, 0);
    assert_eq!(pool.offload_stats().held, 2);
    drop(other);
    // The next turn finds both blocks in the tier and restores them.
    assert_eq!(pool.cached_prefix_blocks(0, &chat), 2);
    let (lease, hit) = pool.start(A, 0, &chat, 2).unwrap();
    assert_eq!(hit, 4);
    let moves = pool.take_moves();
    let restored: Vec<(u32, u32)> = moves
        .iter()
        .filter_map(|m| match *m {
            BlockMove::Restore { slot, block } => Some((slot, block)),
            BlockMove::Spill { .. } => None,
        })
        .collect();
    assert_eq!(restored.len(), 2);
    assert_eq!(
        restored[0].0, 1,
        "the first block comes from the slot it went to"
    );
    assert_eq!(restored[1].0, 0);
    assert_eq!(lease.blocks(), &[restored[0].1, restored[1].1]);
    let stats = pool.offload_stats();
    assert_eq!((stats.spilled, stats.restored, stats.held), (4, 2, 2));
    // Three starts went past the hot tier's hits (the chat's first turn,
    // the other sequence, the second turn); one of them restored.
    assert_eq!((stats.lookups, stats.hits), (3, 1));
    pool.check_invariants();
}

#[test]
fn a_tier_that_does_not_pay_drops_evictions_and_misses_spilled_blocks() {
    let mut pool = offload_pool(3, 2, 4);
    let chat = [1, 2, 3, 4, 5];
    drop(prefill(&mut pool, A, 0, &chat).0);
    drop(prefill(&mut pool, B, 0, &[7, 7, 7, 7, 7, 7]).0);
    assert_eq!(pool.offload_stats().held, 2);
    pool.take_moves();
    pool.set_offload_pays(false);
    assert!(!pool.offload_pays());
    assert_eq!(pool.cached_prefix_blocks(0, &chat), 0);
    let (lease, hit) = pool.start(A, 0, &chat, 2).unwrap();
    assert_eq!(
        hit, 0,
        "a spilled block is a miss while restoring does not pay"
    );
    drop(lease);
    drop(prefill(&mut pool, B, 0, &[8, 8, 8, 8, 8, 8]).0);
    assert!(
        pool.take_moves().is_empty(),
        "no spill while it does not pay"
    );
    assert_eq!(pool.offload_stats().spilled, 2);
    pool.check_invariants();
}

#[test]
fn a_full_tier_drops_its_least_recently_spilled_block() {
    use crate::BlockMove;
    let mut pool = offload_pool(2, 2, 2);
    for t in 0..4u32 {
        drop(prefill(&mut pool, A, 0, &[t, t, 0]).0);
    }
    // Blocks of t = 0, 1, 2 were spilled in turn; t = 0's was dropped for 2's.
    let stats = pool.offload_stats();
    assert_eq!((stats.spilled, stats.dropped, stats.held), (3, 1, 2));
    assert_eq!(pool.cached_prefix_blocks(0, &[0, 0, 0]), 0);
    assert_eq!(pool.cached_prefix_blocks(0, &[1, 1, 0]), 1);
    assert_eq!(pool.cached_prefix_blocks(0, &[2, 2, 0]), 1);
    assert_eq!(pool.cached_prefix_blocks(0, &[3, 3, 0]), 1, "hot");
    let moves = pool.take_moves();
    assert_eq!(moves.last(), Some(&BlockMove::Spill { block: 0, slot: 0 }));
    pool.check_invariants();
}

#[test]
fn prefix_changes_name_the_hashes_a_router_computes() {
    let mut p = pool(8, 4);
    let prompt: Vec<u32> = (0..10).collect();
    let (lease, _) = prefill(&mut p, A, 7, &prompt);
    let want = crate::prefix_hashes(&prompt, 4, 7);
    assert_eq!(want.len(), 2, "two full blocks");
    let d = p.take_prefix_changes();
    assert!(!d.full);
    assert_eq!(
        (d.stored.clone(), d.removed.clone()),
        (want.clone(), vec![])
    );
    assert_eq!(p.take_prefix_changes(), Default::default(), "taken once");
    let mut sorted = want.clone();
    sorted.sort_unstable();
    assert_eq!(p.prefix_snapshot(), sorted);
    // Another salt names other blocks.
    assert_ne!(crate::prefix_hashes(&prompt, 4, 8), want);
    drop(lease);
    p.clear_cache();
    let d = p.take_prefix_changes();
    assert_eq!((d.stored.len(), d.removed.len()), (0, 2));
    // Registered and dropped between looks: only the last change shows.
    let (lease, _) = prefill(&mut p, A, 7, &prompt);
    drop(lease);
    p.clear_cache();
    let d = p.take_prefix_changes();
    assert_eq!((d.stored.len(), d.removed.len(), d.full), (0, 2, false));
}

#[test]
fn an_overflowed_change_log_gives_the_whole_cache() {
    let mut p = pool(4, 2);
    // Churn far past the log's cap (2 x 4 blocks + 1024 entries).
    for i in 0..600u32 {
        let prompt = [i, i + 1, i + 2];
        let (lease, _) = prefill(&mut p, A, 0, &prompt);
        drop(lease);
        p.clear_cache();
    }
    let prompt = [1u32, 2, 3, 4, 5];
    let (_lease, _) = prefill(&mut p, A, 0, &prompt);
    let d = p.take_prefix_changes();
    assert!(d.full, "the log overflowed: a snapshot instead");
    assert_eq!(d.stored, p.prefix_snapshot());
    assert_eq!(d.stored.len(), 2);
    assert!(!p.take_prefix_changes().full, "then deltas again");
}
