//! The wire's bytes are tied to `PROTOCOL_VERSION`: one sample of every
//! node message (each nested type present, its options filled) is archived
//! and hashed, and the hashes are kept in `tests/fixtures/wire_golden.txt`
//! beside the version they were recorded under. A change to any archived
//! type (a field added, removed, reordered or retyped, in `proto` or in an
//! `exec` type the wire carries) changes a sample's bytes: under the same
//! version that fails, naming the message, since a peer of the old build
//! would misread it. Bump `PROTOCOL_VERSION` (proto/src/wire.rs), then
//! record the new bytes with `FLOTILLA_BLESS_WIRE=1 cargo nextest run -p
//! flotilla-proto --test wire_golden`.

use std::collections::BTreeMap;
use std::path::PathBuf;

use flotilla_proto::wire::{
    Held, JoinedPeer, Kind, KvTransferHeader, Message, PROTOCOL_VERSION, PrefillMsg, ReqEvents,
    Submit, encode_frame,
};
use flotilla_proto::{
    Constraint, EngineEvent, EngineFailure, EngineRequest, EngineStatus, FinishReason, KvUsage,
    NodeStatus, PrefixChanges, Rejection, Role, RoutingStats, Sampled, SamplingParams, TenantId,
    TierStatus, TraceContext, Usage,
};

fn request() -> EngineRequest {
    EngineRequest {
        tenant: TenantId(3),
        prompt: vec![1, 2, 3, 40_000],
        max_tokens: 17,
        sampling: SamplingParams {
            temperature: 0.7,
            top_k: 40,
            top_p: 0.9,
            seed: 11,
            logprobs: true,
            top_logprobs: 2,
            presence_penalty: 0.5,
            frequency_penalty: -0.25,
        },
        logit_bias: vec![(5, -100.0), (9, 2.5)],
        generated: 2,
        constraint: Some(Constraint::JsonSchema("{\"type\":\"object\"}".into())),
        ignore_eos: true,
        stop_token_ids: vec![2, 7],
        speculative: true,
        trace: Some(TraceContext {
            trace_id: [7; 16],
            span_id: [9; 8],
            flags: 1,
            state: "k=v".into(),
        }),
    }
}

fn submit() -> Submit {
    Submit {
        req: 42,
        attempt: 1,
        prefill: Some(2),
        kv_move: true,
        request: request(),
    }
}

fn sampled() -> Sampled {
    Sampled {
        token: 17,
        logprob: -0.5,
        top: vec![(17, -0.5), (3, -1.25)],
    }
}

/// One sample per message kind (the name it is recorded under first).
fn samples() -> Vec<(&'static str, Message)> {
    let status = EngineStatus {
        ready: true,
        steps: 9,
        running: 2,
        tiers: vec![TierStatus {
            name: "paid".into(),
            queued: 1,
            running: 2,
        }],
        kv: KvUsage {
            total: 64,
            free: 30,
            used: 34,
            cached: 5,
            ..KvUsage::default()
        },
        preemptions: 1,
        orphans: 0,
        draining: false,
        nodes: vec![NodeStatus {
            name: "worker-1".into(),
            up: true,
            epoch: 3,
            ..NodeStatus::default()
        }],
        routing: RoutingStats {
            placements: 10,
            cache_candidate: 9,
            prompt_blocks: 40,
            matched_blocks: 30,
            prefix_snapshots: 2,
        },
    };
    let held = vec![Held {
        req: 5,
        for_decode: Some(1),
        attempt: 0,
    }];
    vec![
        ("Heartbeat", Message::Heartbeat(status)),
        ("Submit", Message::Submit(submit())),
        ("Admitted", Message::Admitted { req: 42 }),
        (
            "Refused",
            Message::Refused {
                req: 42,
                rejection: Rejection::TenantLimit {
                    tenant: "t".into(),
                    reason: "rate".into(),
                    retry_after_s: 3,
                },
            },
        ),
        (
            "Events",
            Message::Events(vec![ReqEvents {
                req: 42,
                attempt: 1,
                first: 4,
                events: vec![
                    EngineEvent::Token(sampled()),
                    EngineEvent::Finished {
                        reason: FinishReason::Length,
                        usage: Usage {
                            prompt_tokens: 4,
                            completion_tokens: 17,
                            cached_tokens: 2,
                        },
                    },
                    EngineEvent::Failed(EngineFailure::KvTransfer("lost".into())),
                ],
            }]),
        ),
        (
            "Cancel",
            Message::Cancel {
                req: 42,
                stop_string: true,
                attempt: 1,
            },
        ),
        (
            "Ping",
            Message::Ping {
                seq: 1,
                pad: vec![1, 2],
            },
        ),
        (
            "Pong",
            Message::Pong {
                seq: 1,
                pad: vec![1, 2],
            },
        ),
        (
            "KvBlocks",
            Message::KvBlocks(KvTransferHeader {
                router: 0,
                req: 42,
                epoch: 2,
                model: "m".into(),
                block_size: 16,
                dtype: flotilla_proto::KvDtype::Int8,
                layout: 1,
                layer_start: 0,
                layer_end: 30,
                token_count: 33,
                block_count: 3,
                bytes: 4096,
                checksum: 0xDEAD_BEEF,
                first: sampled(),
            }),
        ),
        (
            "Prefill",
            Message::Prefill(PrefillMsg {
                router: 0,
                submit: submit(),
                priority: 2,
            }),
        ),
        (
            "PrefillFailed",
            Message::PrefillFailed {
                router: 0,
                req: 42,
                reason: "no".into(),
            },
        ),
        (
            "KvAck",
            Message::KvAck {
                router: 0,
                req: 42,
                ok: true,
            },
        ),
        (
            "PrefillCancel",
            Message::PrefillCancel {
                router: 0,
                req: 42,
                attempt: 1,
            },
        ),
        (
            "PrefillAbandon",
            Message::PrefillAbandon {
                decode: 1,
                decode_epoch: 4,
                req: 42,
            },
        ),
        ("Holding", Message::Holding { held: held.clone() }),
        ("Unknown", Message::Unknown { held }),
        ("Drain", Message::Drain { grace_ms: 30_000 }),
        ("Leaving", Message::Leaving),
        (
            "Prefix",
            Message::Prefix {
                seq: 3,
                changes: PrefixChanges {
                    full: true,
                    stored: vec![1, 2, u64::MAX],
                    removed: vec![9],
                },
            },
        ),
        ("PrefixResync", Message::PrefixResync),
        (
            "Peer",
            Message::Peer(JoinedPeer {
                node: flotilla_proto::joined_node_id("worker-9"),
                name: "worker-9".into(),
                role: Role::Worker,
                addr: "10.0.0.9:7400".into(),
            }),
        ),
    ]
}

/// FNV-1a over the bytes (no dependency; collisions do not matter here).
fn fnv(b: &[u8]) -> u64 {
    b.iter().fold(0xcbf2_9ce4_8422_2325, |h, &x| {
        (h ^ u64::from(x)).wrapping_mul(0x0000_0100_0000_01b3)
    })
}

fn golden_path() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/wire_golden.txt")
}

/// The current archive hashes, by message name.
fn current() -> BTreeMap<String, String> {
    let s = samples();
    let kinds: Vec<Kind> = s.iter().map(|(_, m)| m.kind()).collect();
    assert_eq!(
        kinds,
        Kind::ALL,
        "one sample of every message kind, in kind order"
    );
    s.into_iter()
        .map(|(name, m)| {
            assert_eq!(format!("{:?}", m.kind()), name, "sample named by its kind");
            // Header fields fixed; only the payload's layout can move.
            let frame = encode_frame(&m, 7, 1, 2, u32::MAX).unwrap();
            (
                name.to_string(),
                format!("{:016x} {}", fnv(&frame), frame.len()),
            )
        })
        .collect()
}

/// (recorded version, hashes by name) of the golden file.
fn recorded(text: &str) -> (u16, BTreeMap<String, String>) {
    let mut version = None;
    let mut map = BTreeMap::new();
    for line in text.lines().map(str::trim).filter(|l| !l.is_empty()) {
        if let Some(v) = line.strip_prefix("# PROTOCOL_VERSION ") {
            version = Some(v.trim().parse().expect("a version number"));
        } else if !line.starts_with('#') {
            let (name, rest) = line.split_once(' ').expect("`name hash len`");
            map.insert(name.to_string(), rest.to_string());
        }
    }
    (version.expect("a `# PROTOCOL_VERSION N` line"), map)
}

fn render(map: &BTreeMap<String, String>) -> String {
    let mut out = format!(
        "# PROTOCOL_VERSION {PROTOCOL_VERSION}\n# FNV-1a of one sample frame of each message, and its length.\n\
         # Written by `FLOTILLA_BLESS_WIRE=1 cargo nextest run -p flotilla-proto --test wire_golden`\n\
         # after a PROTOCOL_VERSION bump; see crates/proto/tests/wire_golden.rs.\n"
    );
    for (k, v) in map {
        out.push_str(&format!("{k} {v}\n"));
    }
    out
}

/// What is wrong with the recorded bytes against the current ones; empty
/// when they agree.
fn problems(
    rec_version: u16,
    rec: &BTreeMap<String, String>,
    now: &BTreeMap<String, String>,
) -> Vec<String> {
    if rec_version != PROTOCOL_VERSION {
        return vec![format!(
            "PROTOCOL_VERSION is {PROTOCOL_VERSION} but the golden bytes were recorded under \
             {rec_version}: record the new version's with FLOTILLA_BLESS_WIRE=1"
        )];
    }
    let mut out = Vec::new();
    for (name, h) in now {
        match rec.get(name) {
            Some(r) if r == h => {}
            Some(r) => out.push(format!(
                "Message::{name}'s bytes changed (recorded {r}, now {h}) without a \
                 PROTOCOL_VERSION bump (still {PROTOCOL_VERSION}): a peer of the old build \
                 would misread it; bump the version in proto/src/wire.rs, then record with \
                 FLOTILLA_BLESS_WIRE=1"
            )),
            None => out.push(format!("Message::{name} has no recorded bytes")),
        }
    }
    for name in rec.keys().filter(|k| !now.contains_key(*k)) {
        out.push(format!("Message::{name} is recorded but no longer exists"));
    }
    out
}

#[test]
fn wire_bytes_change_only_with_a_protocol_version_bump() {
    let now = current();
    if std::env::var_os("FLOTILLA_BLESS_WIRE").is_some_and(|v| v == "1") {
        std::fs::write(golden_path(), render(&now)).unwrap();
        eprintln!(
            "recorded {} messages under version {PROTOCOL_VERSION}",
            now.len()
        );
        return;
    }
    let text = std::fs::read_to_string(golden_path()).expect("tests/fixtures/wire_golden.txt");
    let (v, rec) = recorded(&text);
    let p = problems(v, &rec, &now);
    assert!(p.is_empty(), "{}", p.join("\n"));
}

#[test]
fn a_changed_message_is_named_and_a_bump_asks_for_new_bytes() {
    let now = current();
    let mut rec = now.clone();
    rec.insert("Submit".into(), "0000000000000000 1".into());
    let p = problems(PROTOCOL_VERSION, &rec, &now);
    assert_eq!(p.len(), 1, "{p:?}");
    assert!(p[0].starts_with("Message::Submit's bytes changed"), "{p:?}");
    let p = problems(PROTOCOL_VERSION - 1, &now, &now);
    assert!(p[0].contains("recorded under"), "{p:?}");
    // The samples themselves are deterministic.
    assert_eq!(current(), now);
    let (v, back) = recorded(&render(&now));
    assert_eq!((v, back), (PROTOCOL_VERSION, now));
}
