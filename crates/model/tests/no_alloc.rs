//! The step loop allocates nothing once warmed up: a counting global
//! allocator watches prefill chunks, decodes and sampling.

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};

use flotilla_model::{
    CpuConfig, CpuExecutor, Executor, OutputKind, SamplingParams, SeqInput, StepOutputs,
};

struct Counting;
static COUNTING: AtomicBool = AtomicBool::new(false);
static ALLOCS: AtomicUsize = AtomicUsize::new(0);

// SAFETY: forwards to the system allocator; only counts.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, l: Layout) -> *mut u8 {
        if COUNTING.load(Ordering::Relaxed) {
            ALLOCS.fetch_add(1, Ordering::Relaxed);
        }
        unsafe { System.alloc(l) }
    }
    unsafe fn dealloc(&self, p: *mut u8, l: Layout) {
        unsafe { System.dealloc(p, l) }
    }
    unsafe fn realloc(&self, p: *mut u8, l: Layout, n: usize) -> *mut u8 {
        if COUNTING.load(Ordering::Relaxed) {
            ALLOCS.fetch_add(1, Ordering::Relaxed);
        }
        unsafe { System.realloc(p, l, n) }
    }
}

#[global_allocator]
static GLOBAL: Counting = Counting;

#[test]
fn steps_allocate_nothing_after_warm_up() {
    let cfg = CpuConfig {
        threads: 2,
        num_blocks: 32,
        max_batch_tokens: 64,
        ..Default::default()
    };
    let mut e = CpuExecutor::load(&flotilla_hub::test_model_path(), &cfg).unwrap();
    let mut out = StepOutputs::default();
    let a: Vec<u32> = (100..160).collect();
    let (ta, tb) = ([0u32, 1, 2, 3, 4, 5], [10u32, 11, 12, 13]);
    let sampled = SamplingParams {
        temperature: 0.8,
        top_p: 0.9,
        top_k: 0,
        seed: 1,
        ..Default::default()
    };
    let step = |e: &mut CpuExecutor, out: &mut StepOutputs, pos: usize| {
        let batch = [
            SeqInput {
                tokens: &a[pos..pos + 20],
                start_pos: pos,
                block_table: &ta,
                output: OutputKind::Sample(sampled),
                bias: &[],
                draft_bias: &[],
                allow: None,
            },
            SeqInput {
                tokens: &[7],
                start_pos: pos,
                block_table: &tb,
                output: OutputKind::Sample(SamplingParams::greedy()),
                bias: &[],
                draft_bias: &[],
                allow: None,
            },
        ];
        e.step(&batch, out).unwrap();
    };
    step(&mut e, &mut out, 0);
    COUNTING.store(true, Ordering::SeqCst);
    step(&mut e, &mut out, 20);
    step(&mut e, &mut out, 40);
    COUNTING.store(false, Ordering::SeqCst);
    assert!(out.token_of(0).is_some() && out.token_of(1).is_some());
    assert_eq!(ALLOCS.load(Ordering::SeqCst), 0, "the step loop allocated");
}
