//! Fuzzes the frame decoder with random and mutated frames: it must never
//! panic, and the memory it allocates for one frame is bounded by a small
//! multiple of the frame's length (which the envelope caps before anything
//! is allocated). Seeded, so a failure replays; `FLOTILLA_FUZZ_ITERS` runs
//! it longer than CI does.

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicUsize, Ordering};

use flotilla_proto::wire::{
    KvTransferHeader, Message, ReqEvents, Submit, decode_frame, encode_frame,
};
use flotilla_proto::{
    EngineEvent, EngineFailure, EngineRequest, EngineStatus, FinishReason, Rejection, Sampled,
    SamplingParams, TenantId, TierStatus, Usage,
};

/// Counts live bytes and the peak since the last reset, for this test binary.
struct Counting;
static LIVE: AtomicUsize = AtomicUsize::new(0);
static PEAK: AtomicUsize = AtomicUsize::new(0);

unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, l: Layout) -> *mut u8 {
        let now = LIVE.fetch_add(l.size(), Ordering::Relaxed) + l.size();
        PEAK.fetch_max(now, Ordering::Relaxed);
        // SAFETY: forwarding the caller's layout to the system allocator.
        unsafe { System.alloc(l) }
    }
    unsafe fn dealloc(&self, p: *mut u8, l: Layout) {
        LIVE.fetch_sub(l.size(), Ordering::Relaxed);
        // SAFETY: `p` came from `alloc` above with this layout.
        unsafe { System.dealloc(p, l) }
    }
}

#[global_allocator]
static A: Counting = Counting;

const CAP: u32 = 64 * 1024;

/// The project's seeded stream.
use flotilla_exec::rng::SplitMix64 as Rng;

fn seeds(r: &mut Rng) -> Vec<Message> {
    let n = r.below(40) as usize;
    vec![
        Message::Heartbeat(EngineStatus {
            ready: true,
            tiers: (0..n % 4)
                .map(|i| TierStatus {
                    name: format!("tier{i}"),
                    queued: i,
                    running: 1,
                })
                .collect(),
            ..EngineStatus::default()
        }),
        Message::Submit(Submit {
            req: r.next_u64(),
            attempt: 1,
            prefill: Some(2),
            kv_move: false,
            request: EngineRequest {
                tenant: TenantId(1),
                prompt: (0..n as u32 * 10).collect(),
                max_tokens: 5,
                sampling: SamplingParams {
                    temperature: 0.5,
                    seed: 3,
                    ..SamplingParams::default()
                },
                logit_bias: Vec::new(),
                generated: 0,
                constraint: None,
                ignore_eos: false,
                stop_token_ids: vec![2],
                speculative: true,
                trace: None,
            },
        }),
        Message::Refused {
            req: 1,
            rejection: Rejection::TenantLimit {
                tenant: "t".repeat(n),
                reason: "r".into(),
                retry_after_s: 1,
            },
        },
        Message::Events(
            (0..n)
                .map(|i| ReqEvents {
                    req: i as u64,
                    attempt: i as u32 % 2,
                    first: i as u32,
                    events: (0..i % 3)
                        .map(|t| {
                            EngineEvent::Token(Sampled {
                                token: t as u32,
                                logprob: -1.0,
                                top: vec![(1, -2.0); i % 2],
                            })
                        })
                        .chain(match i % 3 {
                            0 => None,
                            1 => Some(EngineEvent::Failed(EngineFailure::Internal("x".repeat(i)))),
                            _ => Some(EngineEvent::Finished {
                                reason: FinishReason::Stop,
                                usage: Usage {
                                    prompt_tokens: 1,
                                    completion_tokens: 2,
                                    cached_tokens: 0,
                                },
                            }),
                        })
                        .collect(),
                })
                .collect(),
        ),
        Message::Cancel {
            req: 3,
            stop_string: false,
            attempt: 0,
        },
        Message::Ping {
            seq: 1,
            pad: vec![7; n * 31],
        },
        Message::KvBlocks(KvTransferHeader {
            router: 0,
            req: 1,
            epoch: 2,
            model: "model".into(),
            block_size: 16,
            dtype: flotilla_proto::KvDtype::F16,
            layout: 1,
            layer_start: 0,
            layer_end: 30,
            token_count: 3,
            block_count: 1,
            bytes: 10,
            checksum: 11,
            first: Sampled {
                token: 1,
                logprob: 0.0,
                top: vec![],
            },
        }),
    ]
}

fn mutate(r: &mut Rng, f: &mut Vec<u8>) {
    for _ in 0..1 + r.below(8) {
        if f.is_empty() {
            f.push(r.next_u64() as u8);
        }
        match r.below(5) {
            0 | 1 => {
                // Flip bytes of the payload mostly, sometimes of the envelope.
                let i = r.below(f.len() as u64) as usize;
                f[i] = r.next_u64() as u8;
            }
            2 => {
                let i = r.below(f.len() as u64) as usize;
                f.truncate(i);
            }
            3 => {
                // A plausible-looking length or offset: a large little-endian u32.
                if f.len() >= 4 {
                    let i = r.below(f.len() as u64 - 3) as usize;
                    f[i..i + 4].copy_from_slice(&(r.next_u64() as u32 | 0x8000_0000).to_le_bytes());
                }
            }
            _ => {
                for _ in 0..r.below(16) {
                    f.push(r.next_u64() as u8);
                }
            }
        }
    }
}

#[test]
fn random_and_mutated_frames_never_panic_and_stay_bounded() {
    let iters: u64 = std::env::var("FLOTILLA_FUZZ_ITERS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(20_000);
    let seed = 0x5eed_u64;
    let mut r = Rng(seed);
    let (mut ok, mut refused, mut worst) = (0u64, 0u64, 0f64);
    for i in 0..iters {
        let mut frame = if r.below(10) == 0 {
            // Pure noise, sometimes behind a valid-looking envelope.
            let mut f: Vec<u8> = (0..r.below(256)).map(|_| r.next_u64() as u8).collect();
            if r.below(2) == 0 && f.len() >= 32 {
                f[0..4].copy_from_slice(b"FLTL");
                f[4..6].copy_from_slice(&1u16.to_le_bytes());
            }
            f
        } else {
            let msgs = seeds(&mut r);
            let m = &msgs[r.below(msgs.len() as u64) as usize];
            encode_frame(m, i, 1, 1, CAP).expect("seed frames fit the cap")
        };
        if r.below(8) != 0 {
            mutate(&mut r, &mut frame);
        }
        let before = LIVE.load(Ordering::Relaxed);
        PEAK.store(before, Ordering::Relaxed);
        let res = decode_frame(&frame, CAP);
        let grew = PEAK.load(Ordering::Relaxed) - before;
        let bound = 4 * frame.len() + 1024;
        assert!(
            grew <= bound,
            "seed {seed:#x} iteration {i}: decoding a {}-byte frame allocated {grew} bytes \
             (bound {bound})",
            frame.len()
        );
        worst = worst.max(grew as f64 / frame.len().max(1) as f64);
        match res {
            Ok(_) => ok += 1,
            Err(_) => refused += 1,
        }
    }
    eprintln!(
        "fuzz: {iters} frames, {ok} decoded, {refused} refused, worst allocation {worst:.2} x frame length"
    );
    // The generator must exercise both outcomes, or it is testing nothing.
    assert!(ok > iters / 20, "too few frames decoded: {ok}");
    assert!(refused > iters / 4, "too few frames refused: {refused}");
}
