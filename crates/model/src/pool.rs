//! A persistent worker pool for the forward pass: threads are started once
//! and woken per parallel region, never spawned per step.
//!
//! A region is short (tens of microseconds for one matrix product at batch
//! 1), so a woken worker spins for a while before it sleeps: a futex wake per
//! region would cost as much as the work. Workers sleep on a condvar after
//! [`SPIN_ROUNDS`] idle rounds, so an idle engine burns no CPU.

use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;

/// Idle spin rounds before a worker sleeps (about a millisecond).
const SPIN_ROUNDS: u32 = 20_000;

type Job = dyn Fn(usize, usize) + Sync;

struct Shared {
    n_threads: usize,
    /// Incremented by `run` to publish a job.
    generation: AtomicUsize,
    /// Workers that finished the current job.
    done: AtomicUsize,
    /// The current job, valid while `run` waits (lifetime erased).
    job: Mutex<Option<JobPtr>>,
    sleep_lock: Mutex<()>,
    wake: Condvar,
    shutdown: AtomicBool,
    panicked: AtomicBool,
}

#[derive(Clone, Copy)]
struct JobPtr(*const Job);
// SAFETY: the pointee is `Sync` and outlives every use: `run` does not return
// until all workers have finished with it.
unsafe impl Send for JobPtr {}

/// A fixed set of threads that run `f(thread_index, n_threads)` together.
pub struct ThreadPool {
    shared: Arc<Shared>,
    handles: Vec<JoinHandle<()>>,
    /// Serialises `run` calls from different threads.
    run_lock: Mutex<()>,
}

impl std::fmt::Debug for ThreadPool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "ThreadPool({} threads)", self.shared.n_threads)
    }
}

impl ThreadPool {
    /// Starts a pool of `n_threads` (the caller's thread counts as one).
    pub fn new(n_threads: usize) -> ThreadPool {
        let n_threads = n_threads.max(1);
        let shared = Arc::new(Shared {
            n_threads,
            generation: AtomicUsize::new(0),
            done: AtomicUsize::new(0),
            job: Mutex::new(None),
            sleep_lock: Mutex::new(()),
            wake: Condvar::new(),
            shutdown: AtomicBool::new(false),
            panicked: AtomicBool::new(false),
        });
        let handles = (1..n_threads)
            .map(|i| {
                let s = shared.clone();
                std::thread::Builder::new()
                    .name(format!("flotilla-cpu-{i}"))
                    .spawn(move || worker(s, i))
                    .expect("cannot start a compute thread")
            })
            .collect();
        ThreadPool {
            shared,
            handles,
            run_lock: Mutex::new(()),
        }
    }

    /// Threads in the pool, the caller included.
    pub fn n_threads(&self) -> usize {
        self.shared.n_threads
    }

    /// Runs `f(i, n)` on every thread `i` of `n` and returns when all are done.
    pub fn run(&self, f: &(dyn Fn(usize, usize) + Sync)) {
        let n = self.shared.n_threads;
        // A region started from inside a region would wait on itself: run it
        // on this thread alone instead.
        if n == 1 || IN_REGION.get() {
            f(0, 1);
            return;
        }
        IN_REGION.set(true);
        let _reset = ResetRegion;
        let _serial = self.run_lock.lock().unwrap_or_else(|e| e.into_inner());
        // SAFETY: the erased reference is used only until every worker has
        // incremented `done` for this generation, which we wait for below.
        let ptr: *const Job =
            unsafe { std::mem::transmute::<&(dyn Fn(usize, usize) + Sync), &'static Job>(f) };
        *self.shared.job.lock().unwrap_or_else(|e| e.into_inner()) = Some(JobPtr(ptr));
        self.shared.done.store(0, Ordering::Release);
        {
            // Taking the sleep lock orders the generation bump against a
            // worker that is about to sleep, so no wake-up is lost.
            let _g = self
                .shared
                .sleep_lock
                .lock()
                .unwrap_or_else(|e| e.into_inner());
            self.shared.generation.fetch_add(1, Ordering::AcqRel);
        }
        self.shared.wake.notify_all();
        let mine = catch_unwind(AssertUnwindSafe(|| f(0, n)));
        let mut spins = 0u32;
        while self.shared.done.load(Ordering::Acquire) < n - 1 {
            // A worker descheduled by another process would make pure
            // spinning burn our whole time slice: yield after a while.
            spins += 1;
            if spins < 2_000 {
                std::hint::spin_loop();
            } else {
                std::thread::yield_now();
            }
        }
        *self.shared.job.lock().unwrap_or_else(|e| e.into_inner()) = None;
        let worker_panicked = self.shared.panicked.swap(false, Ordering::AcqRel);
        if let Err(p) = mine {
            std::panic::resume_unwind(p);
        }
        if worker_panicked {
            panic!("a compute thread panicked");
        }
    }
}

thread_local! {
    /// Whether this thread is inside a region of some pool.
    static IN_REGION: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// Clears `IN_REGION` when the region ends, panics included.
struct ResetRegion;

impl Drop for ResetRegion {
    fn drop(&mut self) {
        IN_REGION.set(false);
    }
}

fn worker(s: Arc<Shared>, index: usize) {
    IN_REGION.set(true);
    let mut seen = 0usize;
    loop {
        let mut spins = 0u32;
        loop {
            if s.shutdown.load(Ordering::Acquire) {
                return;
            }
            let g = s.generation.load(Ordering::Acquire);
            if g != seen {
                seen = g;
                break;
            }
            spins += 1;
            if spins < SPIN_ROUNDS {
                if spins.is_multiple_of(1024) {
                    std::thread::yield_now();
                } else {
                    std::hint::spin_loop();
                }
            } else {
                let guard = s.sleep_lock.lock().unwrap_or_else(|e| e.into_inner());
                if s.generation.load(Ordering::Acquire) == seen
                    && !s.shutdown.load(Ordering::Acquire)
                {
                    drop(s.wake.wait(guard).unwrap_or_else(|e| e.into_inner()));
                }
                spins = 0;
            }
        }
        let job = *s.job.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(JobPtr(p)) = job {
            // SAFETY: `run` keeps the job alive until `done` reaches n - 1.
            let f = unsafe { &*p };
            if catch_unwind(AssertUnwindSafe(|| f(index, s.n_threads))).is_err() {
                s.panicked.store(true, Ordering::Release);
            }
        }
        s.done.fetch_add(1, Ordering::AcqRel);
    }
}

impl Drop for ThreadPool {
    fn drop(&mut self) {
        self.shared.shutdown.store(true, Ordering::Release);
        {
            let _g = self
                .shared
                .sleep_lock
                .lock()
                .unwrap_or_else(|e| e.into_inner());
        }
        self.shared.wake.notify_all();
        for h in self.handles.drain(..) {
            let _ = h.join();
        }
    }
}

/// Splits `n` items into `parts` contiguous ranges and returns part `i`,
/// rounding boundaries to multiples of `align`.
pub fn split_range(n: usize, parts: usize, i: usize, align: usize) -> std::ops::Range<usize> {
    let units = n.div_ceil(align);
    let start = (units * i / parts * align).min(n);
    let end = (units * (i + 1) / parts * align).min(n);
    start..end
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_thread_runs_every_region() {
        let pool = ThreadPool::new(3);
        let hits = AtomicUsize::new(0);
        for _ in 0..1000 {
            pool.run(&|i, n| {
                assert!(i < n);
                hits.fetch_add(1, Ordering::Relaxed);
            });
        }
        assert_eq!(hits.load(Ordering::Relaxed), 3000);
    }

    #[test]
    fn wakes_after_sleeping() {
        let pool = ThreadPool::new(2);
        let hits = AtomicUsize::new(0);
        pool.run(&|_, _| {
            hits.fetch_add(1, Ordering::Relaxed);
        });
        std::thread::sleep(std::time::Duration::from_millis(50));
        pool.run(&|_, _| {
            hits.fetch_add(1, Ordering::Relaxed);
        });
        assert_eq!(hits.load(Ordering::Relaxed), 4);
    }

    #[test]
    fn nested_regions_run_inline() {
        let pool = ThreadPool::new(2);
        let hits = AtomicUsize::new(0);
        pool.run(&|_, _| {
            pool.run(&|i, n| {
                assert_eq!((i, n), (0, 1));
                hits.fetch_add(1, Ordering::Relaxed);
            });
        });
        assert_eq!(hits.load(Ordering::Relaxed), 2);
    }

    #[test]
    fn split_covers_everything_once() {
        for n in [0, 1, 7, 100, 576] {
            for parts in 1..5 {
                let mut covered = 0;
                let mut last = 0;
                for i in 0..parts {
                    let r = split_range(n, parts, i, 4);
                    assert_eq!(r.start, last);
                    last = r.end;
                    covered += r.len();
                }
                assert_eq!(covered, n);
            }
        }
    }

    #[test]
    #[should_panic(expected = "compute thread panicked")]
    fn worker_panic_reaches_the_caller() {
        let pool = ThreadPool::new(2);
        pool.run(&|i, _| {
            if i == 1 {
                panic!("boom");
            }
        });
    }
}
