//! The node-to-node wire format: a fixed 32-byte envelope followed by an
//! rkyv archive of one [`Message`].
//!
//! The envelope is plain little-endian bytes, not rkyv, so that a receiver
//! learns the protocol version, the kind and the length before it touches
//! the payload: a peer speaking another version gets [`WireError::Version`],
//! and a frame longer than the configured cap is refused before anything is
//! allocated for it. The payload is validated with bytecheck
//! (`rkyv::access`) after a copy into an aligned buffer; nothing from a peer
//! is ever read unchecked.
//!
//! ```text
//! offset size field
//!      0    4 magic "FLTL"
//!      4    2 protocol version
//!      6    2 message kind
//!      8    8 correlation id (request id, ping sequence)
//!     16    4 sender node id (index in the cluster config)
//!     20    8 sender epoch (changes when the node restarts)
//!     28    4 payload length, bytes
//! ```

use rkyv::rancor;
use rkyv::util::AlignedVec;
use rkyv::{Archive, Deserialize, Serialize};

use crate::{
    EngineEvent, EngineRequest, EngineStatus, KvDtype, PrefixChanges, Rejection, Role, Sampled,
};

/// First four bytes of every frame.
pub const MAGIC: [u8; 4] = *b"FLTL";
/// The protocol this build speaks; a peer with another one is refused.
pub const PROTOCOL_VERSION: u16 = 18;
/// Bytes of the envelope before the payload.
pub const HEADER_LEN: usize = 32;
/// Smallest frame cap a config may set (a load report must fit).
pub const FRAME_LEN_MIN_BYTES: u32 = 4096;

/// Why a frame was refused.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum WireError {
    /// Fewer bytes than the envelope says.
    #[error("frame truncated: {have} bytes, {need} needed")]
    Truncated {
        /// Bytes present.
        have: usize,
        /// Bytes the envelope requires.
        need: usize,
    },
    /// The first four bytes are not Flotilla's.
    #[error("not a Flotilla frame (bad magic)")]
    Magic,
    /// The peer speaks another protocol version.
    #[error("peer speaks protocol version {theirs}, this node speaks {ours}")]
    Version {
        /// The peer's version.
        theirs: u16,
        /// Ours.
        ours: u16,
    },
    /// A message kind this version does not know.
    #[error("unknown message kind {0}")]
    UnknownKind(u16),
    /// The payload is larger than the frame cap.
    #[error("frame of {len} bytes exceeds the cap of {cap} bytes")]
    TooLarge {
        /// Payload length.
        len: u64,
        /// The configured cap.
        cap: u32,
    },
    /// The payload failed validation.
    #[error("invalid payload: {0}")]
    Invalid(String),
    /// The payload is valid but of another kind than the envelope says.
    #[error("envelope says {header:?}, payload is {payload:?}")]
    KindMismatch {
        /// Kind in the envelope.
        header: Kind,
        /// Kind of the decoded payload.
        payload: Kind,
    },
}

/// Message kinds, as numbered in the envelope.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[repr(u16)]
pub enum Kind {
    /// [`Message::Heartbeat`].
    Heartbeat = 1,
    /// [`Message::Submit`].
    Submit = 2,
    /// [`Message::Admitted`].
    Admitted = 3,
    /// [`Message::Refused`].
    Refused = 4,
    /// [`Message::Events`].
    Events = 5,
    /// [`Message::Cancel`].
    Cancel = 6,
    /// [`Message::Ping`].
    Ping = 7,
    /// [`Message::Pong`].
    Pong = 8,
    /// [`Message::KvBlocks`].
    KvBlocks = 9,
    /// [`Message::Prefill`].
    Prefill = 10,
    /// [`Message::PrefillFailed`].
    PrefillFailed = 11,
    /// [`Message::KvAck`].
    KvAck = 12,
    /// [`Message::PrefillCancel`].
    PrefillCancel = 13,
    /// [`Message::PrefillAbandon`].
    PrefillAbandon = 14,
    /// [`Message::Holding`].
    Holding = 15,
    /// [`Message::Unknown`].
    Unknown = 16,
    /// [`Message::Drain`].
    Drain = 17,
    /// [`Message::Leaving`].
    Leaving = 18,
    /// [`Message::Prefix`].
    Prefix = 19,
    /// [`Message::PrefixResync`].
    PrefixResync = 20,
    /// [`Message::Peer`].
    Peer = 21,
}

impl Kind {
    /// Every kind, in number order.
    pub const ALL: [Kind; 21] = [
        Kind::Heartbeat,
        Kind::Submit,
        Kind::Admitted,
        Kind::Refused,
        Kind::Events,
        Kind::Cancel,
        Kind::Ping,
        Kind::Pong,
        Kind::KvBlocks,
        Kind::Prefill,
        Kind::PrefillFailed,
        Kind::KvAck,
        Kind::PrefillCancel,
        Kind::PrefillAbandon,
        Kind::Holding,
        Kind::Unknown,
        Kind::Drain,
        Kind::Leaving,
        Kind::Prefix,
        Kind::PrefixResync,
        Kind::Peer,
    ];

    /// The kind numbered `n`, if any.
    pub fn from_u16(n: u16) -> Option<Kind> {
        Kind::ALL.iter().copied().find(|k| *k as u16 == n)
    }

    /// Whether a node of `role` may send this kind. Receivers check it
    /// against the role in the sender's certificate, so a compromised or
    /// misconfigured worker cannot submit work and a router cannot forge
    /// tokens.
    pub fn may_send(self, role: Role) -> bool {
        match self {
            Kind::Heartbeat | Kind::Ping | Kind::Pong => true,
            Kind::Submit
            | Kind::Cancel
            | Kind::PrefillAbandon
            | Kind::Unknown
            | Kind::Drain
            | Kind::PrefixResync
            | Kind::Peer => role == Role::Router,
            Kind::Holding | Kind::Leaving | Kind::Prefix => role.runs_engine(),
            Kind::Admitted | Kind::Refused | Kind::Events => role.runs_engine(),
            Kind::KvBlocks => matches!(role, Role::Prefill | Role::Decode | Role::Worker),
            // A decode node asks a prefill node; a node a request moves to
            // (worker or decode) asks the node it leaves.
            Kind::Prefill | Kind::KvAck | Kind::PrefillCancel => {
                matches!(role, Role::Decode | Role::Worker)
            }
            Kind::PrefillFailed => role.runs_engine(),
        }
    }
}

/// The envelope of one frame.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Header {
    /// What the payload is.
    pub kind: Kind,
    /// Request id or ping sequence; 0 when none.
    pub correlation: u64,
    /// Sender's node id (index in the cluster config).
    pub sender: u32,
    /// Sender's epoch.
    pub epoch: u64,
    /// Payload bytes that follow the envelope.
    pub len: u32,
}

impl Header {
    /// Parses and checks an envelope: magic, version, kind, and `len <= cap`.
    pub fn decode(b: &[u8], cap: u32) -> Result<Header, WireError> {
        if b.len() < HEADER_LEN {
            return Err(WireError::Truncated {
                have: b.len(),
                need: HEADER_LEN,
            });
        }
        if b[0..4] != MAGIC {
            return Err(WireError::Magic);
        }
        let u16_at = |o: usize| u16::from_le_bytes([b[o], b[o + 1]]);
        let u32_at = |o: usize| u32::from_le_bytes(b[o..o + 4].try_into().expect("4 bytes"));
        let u64_at = |o: usize| u64::from_le_bytes(b[o..o + 8].try_into().expect("8 bytes"));
        let version = u16_at(4);
        if version != PROTOCOL_VERSION {
            return Err(WireError::Version {
                theirs: version,
                ours: PROTOCOL_VERSION,
            });
        }
        let kind = Kind::from_u16(u16_at(6)).ok_or(WireError::UnknownKind(u16_at(6)))?;
        let len = u32_at(28);
        if len > cap {
            return Err(WireError::TooLarge {
                len: len as u64,
                cap,
            });
        }
        Ok(Header {
            kind,
            correlation: u64_at(8),
            sender: u32_at(16),
            epoch: u64_at(20),
            len,
        })
    }

    /// The 32 envelope bytes.
    pub fn encode(&self) -> [u8; HEADER_LEN] {
        let mut b = [0u8; HEADER_LEN];
        b[0..4].copy_from_slice(&MAGIC);
        b[4..6].copy_from_slice(&PROTOCOL_VERSION.to_le_bytes());
        b[6..8].copy_from_slice(&(self.kind as u16).to_le_bytes());
        b[8..16].copy_from_slice(&self.correlation.to_le_bytes());
        b[16..20].copy_from_slice(&self.sender.to_le_bytes());
        b[20..28].copy_from_slice(&self.epoch.to_le_bytes());
        b[28..32].copy_from_slice(&self.len.to_le_bytes());
        b
    }
}

/// Encodes one frame (envelope + payload), refusing payloads over `cap`.
pub fn encode_frame(
    msg: &Message,
    correlation: u64,
    sender: u32,
    epoch: u64,
    cap: u32,
) -> Result<Vec<u8>, WireError> {
    let payload =
        rkyv::to_bytes::<rancor::Error>(msg).map_err(|e| WireError::Invalid(e.to_string()))?;
    if payload.len() as u64 > cap as u64 {
        return Err(WireError::TooLarge {
            len: payload.len() as u64,
            cap,
        });
    }
    let header = Header {
        kind: msg.kind(),
        correlation,
        sender,
        epoch,
        len: payload.len() as u32,
    };
    let mut out = Vec::with_capacity(HEADER_LEN + payload.len());
    out.extend_from_slice(&header.encode());
    out.extend_from_slice(&payload);
    Ok(out)
}

/// Validates and decodes the payload that follows `header`. `payload` may
/// sit at any alignment: it is copied into an aligned buffer first (rkyv
/// refuses misaligned input).
pub fn decode_payload(header: &Header, payload: &[u8]) -> Result<Message, WireError> {
    if payload.len() != header.len as usize {
        return Err(WireError::Truncated {
            have: payload.len(),
            need: header.len as usize,
        });
    }
    let mut aligned = AlignedVec::<16>::with_capacity(payload.len());
    aligned.extend_from_slice(payload);
    let archived = rkyv::access::<ArchivedMessage, rancor::Error>(&aligned)
        .map_err(|e| WireError::Invalid(e.to_string()))?;
    let msg: Message = rkyv::deserialize::<Message, rancor::Error>(archived)
        .map_err(|e| WireError::Invalid(e.to_string()))?;
    if msg.kind() != header.kind {
        return Err(WireError::KindMismatch {
            header: header.kind,
            payload: msg.kind(),
        });
    }
    Ok(msg)
}

/// Decodes one whole frame from `b` (envelope and payload, nothing after).
pub fn decode_frame(b: &[u8], cap: u32) -> Result<(Header, Message), WireError> {
    let header = Header::decode(b, cap)?;
    let need = HEADER_LEN + header.len as usize;
    if b.len() != need {
        return Err(WireError::Truncated {
            have: b.len(),
            need,
        });
    }
    let msg = decode_payload(&header, &b[HEADER_LEN..])?;
    Ok((header, msg))
}

/// Everything one node says to another.
#[derive(Archive, Serialize, Deserialize, Clone, Debug, PartialEq)]
pub enum Message {
    /// "I am alive", with the sender's engine status (all zero from a
    /// router): the Router routes by it and shows it in `/ready`.
    Heartbeat(EngineStatus),
    /// Router -> engine: run this request (correlation = request id).
    Submit(Submit),
    /// Engine -> router: the request was queued.
    Admitted {
        /// Router's request id.
        req: u64,
    },
    /// Engine -> router: the request was refused at admission.
    Refused {
        /// Router's request id.
        req: u64,
        /// Why.
        rejection: Rejection,
    },
    /// Engine -> router: every event of one step for this router's requests.
    Events(Vec<ReqEvents>),
    /// Router -> engine: the client went away (or a stop string ended it).
    Cancel {
        /// Router's request id.
        req: u64,
        /// The Router ended it at a stop string: finish, not cancel.
        stop_string: bool,
        /// Cancels this placement and earlier ones, not a later re-run
        /// (`u32::MAX`: whatever runs).
        attempt: u32,
    },
    /// Latency probe (benchmarks and tests); answered by `Pong`.
    Ping {
        /// Sequence number.
        seq: u64,
        /// Padding to a chosen size.
        pad: Vec<u8>,
    },
    /// Answer to `Ping`.
    Pong {
        /// The ping's sequence number.
        seq: u64,
        /// The ping's padding, echoed.
        pad: Vec<u8>,
    },
    /// Prefill -> decode: header of a KV block transfer; the raw block
    /// bytes follow on the same stream.
    KvBlocks(KvTransferHeader),
    /// Decode -> prefill: compute this request's prompt, sample its first
    /// token and send the KV here (the blocks are reserved).
    Prefill(PrefillMsg),
    /// Prefill -> decode: the prefill will not come (refused, failed).
    PrefillFailed {
        /// The Router the request came from.
        router: u32,
        /// Router's request id.
        req: u64,
        /// Why, for the client.
        reason: String,
    },
    /// Decode -> prefill: the transfer was imported (`ok`) or discarded;
    /// either way the prefill side gives its blocks back.
    KvAck {
        /// The Router the request came from.
        router: u32,
        /// Router's request id.
        req: u64,
        /// Imported and verified.
        ok: bool,
    },
    /// Decode -> prefill: the request is over (client gone, reservation
    /// expired); drop it and its blocks wherever it is.
    PrefillCancel {
        /// The Router the request came from.
        router: u32,
        /// Router's request id.
        req: u64,
        /// The placement it was asked for, and earlier ones.
        attempt: u32,
    },
    /// Router -> prefill: the decode node that asked for this prefill is
    /// lost (dead, restarted, or cut off past the down bound), so no ack
    /// or cancel will ever come from it: drop the prefill and give its
    /// blocks back now rather than at the hold deadline.
    PrefillAbandon {
        /// The lost decode node.
        decode: u32,
        /// That decode node's epoch when it asked (a later life of the
        /// same node may ask again for the same request).
        decode_epoch: u64,
        /// Router's request id.
        req: u64,
    },
    /// Engine node -> Router: the Router's requests this node has held
    /// KV (or a seat) for since at least one reconcile period ago. The
    /// Router answers with the ones it no longer has here.
    Holding {
        /// What it holds, and for whom.
        held: Vec<Held>,
    },
    /// Router -> engine node: of a `Holding` list, the requests the Router
    /// does not have on that node (it ended or moved them). Named twice in
    /// a row, a request is an orphan there and its lease goes back.
    Unknown {
        /// Entries of the `Holding` list the Router does not run there.
        held: Vec<Held>,
    },
    /// Router -> engine node: drain (as on SIGTERM): take no new work,
    /// finish what runs within `grace_ms`, then leave.
    Drain {
        /// How long running requests may take to finish here, ms; what
        /// still runs then moves to other nodes.
        grace_ms: u64,
    },
    /// Engine node -> its Routers: this life ends now (drained, or its
    /// drain deadline passed). Whatever of yours still runs here, move it;
    /// place nothing here until a new life is heard.
    Leaving,
    /// Engine node -> each Router: its prefix cache's changes (or, `full`,
    /// its contents), numbered per Router from 1 so that a Router that
    /// misses one sees the gap and asks for the whole again.
    Prefix {
        /// 1 + the number of the last one sent to this Router in this
        /// life of the node.
        seq: u64,
        /// The changes.
        changes: PrefixChanges,
    },
    /// Router -> engine node: send your prefix cache's contents (a gap in
    /// the `Prefix` numbers, or a Router that has none of this life).
    PrefixResync,
    /// Router -> engine node: where a node that joined at run time (one
    /// not in the config file) is reached, sent just before a message that
    /// names it (a `Submit` whose `prefill` it is), so the receiver can dial
    /// it: a joined node's address is known only to those it dialed.
    Peer(JoinedPeer),
}

/// A node that joined at run time, as the Routers know it.
#[derive(Archive, Serialize, Deserialize, Clone, Debug, PartialEq, Eq)]
pub struct JoinedPeer {
    /// Its node id ([`crate::joined_node_id`] of its name).
    pub node: u32,
    /// Its name, the one in its certificate.
    pub name: String,
    /// Its role, the one in its certificate.
    pub role: Role,
    /// Where its QUIC endpoint was seen (`ip:port`).
    pub addr: String,
}

/// One lease an engine node holds for a Router's request.
#[derive(Archive, Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub struct Held {
    /// Router's request id.
    pub req: u64,
    /// `None`: the request runs (or is being imported) on this node.
    /// `Some(d)`: this prefill node keeps its KV for decode node `d`.
    pub for_decode: Option<u32>,
    /// The placement held (`Submit::attempt`): the Router's answer about
    /// it never ends a later placement of the same request there.
    pub attempt: u32,
}

impl Message {
    /// This message's kind.
    pub fn kind(&self) -> Kind {
        match self {
            Message::Heartbeat(_) => Kind::Heartbeat,
            Message::Submit(_) => Kind::Submit,
            Message::Admitted { .. } => Kind::Admitted,
            Message::Refused { .. } => Kind::Refused,
            Message::Events(_) => Kind::Events,
            Message::Cancel { .. } => Kind::Cancel,
            Message::Ping { .. } => Kind::Ping,
            Message::Pong { .. } => Kind::Pong,
            Message::KvBlocks(_) => Kind::KvBlocks,
            Message::Prefill(_) => Kind::Prefill,
            Message::PrefillFailed { .. } => Kind::PrefillFailed,
            Message::KvAck { .. } => Kind::KvAck,
            Message::PrefillCancel { .. } => Kind::PrefillCancel,
            Message::PrefillAbandon { .. } => Kind::PrefillAbandon,
            Message::Holding { .. } => Kind::Holding,
            Message::Unknown { .. } => Kind::Unknown,
            Message::Drain { .. } => Kind::Drain,
            Message::Leaving => Kind::Leaving,
            Message::Prefix { .. } => Kind::Prefix,
            Message::PrefixResync => Kind::PrefixResync,
            Message::Peer(_) => Kind::Peer,
        }
    }
}

/// A request as it crosses to an engine node: the engine's own request
/// type, with the Router's id and placement.
#[derive(Archive, Serialize, Deserialize, Clone, Debug, PartialEq)]
pub struct Submit {
    /// Router's request id (unique per router epoch).
    pub req: u64,
    /// Which placement of the request this is (0, then one more per
    /// re-run): a node tells a re-run placed on it again from a duplicate,
    /// and a late `Cancel` of an earlier placement from one of this.
    pub attempt: u32,
    /// Node that computes the prompt (disaggregated serving); `None`: the
    /// receiving node runs the whole request.
    pub prefill: Option<u32>,
    /// A move by KV migration: `prefill` is the node the request runs on
    /// now (it is leaving), which holds the KV of every token of
    /// `request.prompt` but the last. The receiving node reserves blocks
    /// for them, asks that node for them, and continues from the last
    /// prompt token, which its client already has; if the KV does not
    /// come, the Router runs the request again whole.
    pub kv_move: bool,
    /// The request. The engine's admission validates it as it validates
    /// any request (a tenant outside the config is refused by the node).
    pub request: EngineRequest,
}

/// A prefill asked of a prefill node by the decode node that will continue it.
#[derive(Archive, Serialize, Deserialize, Clone, Debug, PartialEq)]
pub struct PrefillMsg {
    /// The Router the request came from.
    pub router: u32,
    /// The request (`prefill` is `None`; `max_tokens` is the client's).
    pub submit: Submit,
    /// Priority of the tenant's tier: transfers of higher ones go first.
    pub priority: u8,
}

/// One request's events of one engine step (or a few, coalesced): the
/// engine's own events, tokens first, then at most one terminal event.
#[derive(Archive, Serialize, Deserialize, Clone, Debug, PartialEq)]
pub struct ReqEvents {
    /// Router's request id.
    pub req: u64,
    /// The placement these events are of (`Submit::attempt`): events of
    /// an earlier placement are not the current one's.
    pub attempt: u32,
    /// Index of `events[0]` in the request's stream: the Router drops the
    /// tokens it already has (a duplicate) and holds a batch that comes
    /// before the one ahead of it (a reorder) until the gap fills.
    pub first: u32,
    /// Tokens in order, then possibly the end (`Finished` or `Failed`).
    pub events: Vec<EngineEvent>,
}

impl ReqEvents {
    /// The tokens, in order (those before the first terminal event: a
    /// peer's batch that goes on after its end is cut there).
    pub fn tokens(&self) -> impl Iterator<Item = &Sampled> {
        self.events.iter().map_while(|e| match e {
            EngineEvent::Token(s) => Some(s),
            _ => None,
        })
    }

    /// Number of tokens (as [`ReqEvents::tokens`] counts them).
    pub fn token_count(&self) -> usize {
        self.tokens().count()
    }

    /// The terminal event, if the request ended in this batch.
    pub fn end(&self) -> Option<&EngineEvent> {
        self.events
            .iter()
            .find(|e| !matches!(e, EngineEvent::Token(_)))
    }

    /// Takes the batch apart: its tokens and its end.
    pub fn into_parts(self) -> (Vec<Sampled>, Option<EngineEvent>) {
        let mut tokens = Vec::with_capacity(self.events.len());
        for e in self.events {
            match e {
                EngineEvent::Token(s) => tokens.push(s),
                end => return (tokens, Some(end)),
            }
        }
        (tokens, None)
    }
}

/// Header of one KV block transfer (disaggregated prefill/decode): the raw
/// block bytes follow it on the transfer's own stream.
#[derive(Archive, Serialize, Deserialize, Clone, Debug, PartialEq)]
pub struct KvTransferHeader {
    /// The Router the request came from.
    pub router: u32,
    /// Router's request id.
    pub req: u64,
    /// The sending node's epoch.
    pub epoch: u64,
    /// Served model name; the receiver refuses another model.
    pub model: String,
    /// Tokens per block.
    pub block_size: u32,
    /// Element type of the cache (int8 blocks carry their scales).
    pub dtype: KvDtype,
    /// Memory layout version of a block.
    pub layout: u8,
    /// First layer carried.
    pub layer_start: u16,
    /// One past the last layer carried.
    pub layer_end: u16,
    /// Tokens whose KV is carried.
    pub token_count: u32,
    /// Blocks carried.
    pub block_count: u32,
    /// Raw bytes that follow.
    pub bytes: u64,
    /// Checksum of the raw bytes (CRC-32/IEEE, as `crc32fast` computes it).
    pub checksum: u64,
    /// The first token, sampled by the prefill side.
    pub first: Sampled,
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{
        Constraint, EngineFailure, FinishReason, KvUsage, SamplingParams, TenantId, TierStatus,
        Usage,
    };

    const CAP: u32 = 1 << 20;

    fn samples() -> Vec<Message> {
        let req = EngineRequest {
            tenant: TenantId(3),
            prompt: vec![1, 2, 3, 49151],
            max_tokens: 17,
            sampling: SamplingParams {
                temperature: 0.7,
                top_k: 40,
                top_p: 0.9,
                seed: 99,
                logprobs: true,
                top_logprobs: 2,
                presence_penalty: 0.5,
                frequency_penalty: -1.25,
            },
            logit_bias: vec![(7, -100.0), (49151, 3.5)],
            generated: 2,
            constraint: Some(Constraint::JsonSchema(r#"{"type":"object"}"#.into())),
            ignore_eos: true,
            stop_token_ids: vec![2],
            speculative: true,
            trace: Some(crate::TraceContext {
                trace_id: [0xab; 16],
                span_id: [7; 8],
                flags: 1,
                state: "vendor=x".into(),
            }),
        };
        vec![
            Message::Heartbeat(EngineStatus {
                ready: true,
                steps: 5,
                running: 2,
                tiers: vec![TierStatus {
                    name: "paid".into(),
                    queued: 1,
                    running: 2,
                }],
                kv: KvUsage {
                    total: 100,
                    free: 90,
                    used: 8,
                    cached: 2,
                    held: 3,
                    reserved: 1,
                    dtype: Default::default(),
                    offload: Default::default(),
                },
                preemptions: 1,
                orphans: 0,
                draining: true,
                nodes: vec![],
                routing: Default::default(),
            }),
            Message::Submit(Submit {
                req: 7,
                attempt: 0,
                prefill: Some(2),
                kv_move: true,
                request: req.clone(),
            }),
            Message::Admitted { req: 7 },
            Message::Refused {
                req: 8,
                rejection: Rejection::QueueFull {
                    tier: "free".into(),
                    queue_len_max: 32,
                    retry_after_s: 2,
                },
            },
            Message::Events(vec![ReqEvents {
                req: 7,
                attempt: 0,
                first: 3,
                events: vec![
                    EngineEvent::Token(Sampled {
                        token: 42,
                        logprob: -0.5,
                        top: vec![(42, -0.5), (43, -1.5)],
                    }),
                    EngineEvent::Finished {
                        reason: FinishReason::Length,
                        usage: Usage {
                            prompt_tokens: 4,
                            completion_tokens: 1,
                            cached_tokens: 0,
                        },
                    },
                ],
            }]),
            Message::Cancel {
                req: 7,
                stop_string: true,
                attempt: 1,
            },
            Message::Ping {
                seq: 1,
                pad: vec![9; 100],
            },
            Message::Pong {
                seq: 1,
                pad: vec![],
            },
            Message::KvBlocks(KvTransferHeader {
                router: 0,
                req: 7,
                epoch: 3,
                model: "m".into(),
                block_size: 16,
                dtype: KvDtype::Int8,
                layout: 1,
                layer_start: 0,
                layer_end: 30,
                token_count: 20,
                block_count: 2,
                bytes: 737_280,
                checksum: 0xdead_beef,
                first: Sampled {
                    token: 5,
                    logprob: -0.5,
                    top: vec![],
                },
            }),
            Message::Prefill(PrefillMsg {
                router: 0,
                submit: Submit {
                    req: 9,
                    attempt: 2,
                    prefill: None,
                    kv_move: false,
                    request: req.clone(),
                },
                priority: 2,
            }),
            Message::PrefillFailed {
                router: 0,
                req: 9,
                reason: "full".into(),
            },
            Message::KvAck {
                router: 0,
                req: 9,
                ok: true,
            },
            Message::PrefillCancel {
                router: 0,
                req: 9,
                attempt: 0,
            },
            Message::PrefillAbandon {
                decode: 3,
                decode_epoch: 7,
                req: 9,
            },
            Message::Holding {
                held: vec![
                    Held {
                        req: 1,
                        for_decode: None,
                        attempt: 2,
                    },
                    Held {
                        req: 5,
                        for_decode: Some(3),
                        attempt: 0,
                    },
                ],
            },
            Message::Unknown {
                held: vec![Held {
                    req: 5,
                    for_decode: Some(3),
                    attempt: 0,
                }],
            },
            Message::Drain { grace_ms: 30_000 },
            Message::Leaving,
            Message::Prefix {
                seq: 3,
                changes: PrefixChanges {
                    full: false,
                    stored: vec![1, u64::MAX],
                    removed: vec![7],
                },
            },
            Message::PrefixResync,
            Message::Peer(JoinedPeer {
                node: crate::joined_node_id("worker-9"),
                name: "worker-9".into(),
                role: Role::Worker,
                addr: "10.0.0.9:7400".into(),
            }),
        ]
    }

    #[test]
    fn every_message_round_trips_with_its_envelope() {
        for (i, m) in samples().into_iter().enumerate() {
            let f = encode_frame(&m, i as u64, 2, 77, CAP).unwrap();
            let (h, back) = decode_frame(&f, CAP).unwrap();
            assert_eq!(back, m);
            assert_eq!(h.kind, m.kind());
            assert_eq!((h.correlation, h.sender, h.epoch), (i as u64, 2, 77));
        }
        let req = match &samples()[1] {
            Message::Submit(s) => s.request.clone(),
            _ => unreachable!(),
        };
        assert_eq!(req.prompt, vec![1, 2, 3, 49151]);
        assert_eq!(req.sampling.top_k, 40);
    }

    #[test]
    fn an_event_batch_splits_into_tokens_and_its_end() {
        let tok = |t| {
            EngineEvent::Token(Sampled {
                token: t,
                logprob: f32::NAN,
                top: vec![],
            })
        };
        let end = EngineEvent::Failed(EngineFailure::Internal("x".into()));
        let b = ReqEvents {
            req: 1,
            attempt: 0,
            first: 0,
            // A peer that goes on after the end: cut there.
            events: vec![tok(1), tok(2), end.clone(), tok(3)],
        };
        assert_eq!(b.token_count(), 2);
        assert_eq!(b.end(), Some(&end));
        let (tokens, e) = b.into_parts();
        assert_eq!(tokens.iter().map(|s| s.token).collect::<Vec<_>>(), [1, 2]);
        assert_eq!(e, Some(end));
        let open = ReqEvents {
            req: 1,
            attempt: 0,
            first: 0,
            events: vec![tok(1)],
        };
        assert_eq!(open.end(), None);
        assert_eq!(open.into_parts().1, None);
    }

    #[test]
    fn misaligned_payload_decodes() {
        let f = encode_frame(&samples()[4], 1, 1, 1, CAP).unwrap();
        let mut shifted = vec![0u8; 1];
        shifted.extend_from_slice(&f);
        let (h, m) = decode_frame(&shifted[1..], CAP).unwrap();
        assert_eq!(h.kind, Kind::Events);
        assert_eq!(m, samples()[4]);
    }

    #[test]
    fn other_version_is_refused_by_name() {
        let mut f = encode_frame(&samples()[0], 0, 0, 0, CAP).unwrap();
        f[4..6].copy_from_slice(&1u16.to_le_bytes());
        let e = decode_frame(&f, CAP).unwrap_err();
        assert_eq!(
            e,
            WireError::Version {
                theirs: 1,
                ours: PROTOCOL_VERSION
            }
        );
        assert!(e.to_string().contains("protocol version 1"));
    }

    #[test]
    fn refusals_before_payload() {
        let f = encode_frame(&samples()[6], 0, 0, 0, CAP).unwrap();
        assert!(matches!(
            decode_frame(&f, 64),
            Err(WireError::TooLarge { cap: 64, .. })
        ));
        assert!(matches!(
            encode_frame(&samples()[6], 0, 0, 0, 64),
            Err(WireError::TooLarge { .. })
        ));
        let mut bad = f.clone();
        bad[0] = b'X';
        assert_eq!(decode_frame(&bad, CAP), Err(WireError::Magic));
        let mut unk = f.clone();
        unk[6..8].copy_from_slice(&999u16.to_le_bytes());
        assert_eq!(decode_frame(&unk, CAP), Err(WireError::UnknownKind(999)));
        assert!(matches!(
            decode_frame(&f[..f.len() - 1], CAP),
            Err(WireError::Truncated { .. })
        ));
        let mut lie = f.clone();
        lie[6..8].copy_from_slice(&(Kind::Pong as u16).to_le_bytes());
        assert!(matches!(
            decode_frame(&lie, CAP),
            Err(WireError::KindMismatch {
                header: Kind::Pong,
                payload: Kind::Ping
            })
        ));
    }

    #[test]
    fn role_policy() {
        assert!(Kind::Submit.may_send(Role::Router));
        assert!(!Kind::Submit.may_send(Role::Worker));
        assert!(!Kind::Events.may_send(Role::Router));
        assert!(Kind::Events.may_send(Role::Decode));
        assert!(!Kind::KvBlocks.may_send(Role::Router));
        // A node a drained one's request moves to asks it for the KV; a
        // prefill node never asks anyone, a Router never answers a move.
        assert!(Kind::Prefill.may_send(Role::Worker));
        assert!(!Kind::Prefill.may_send(Role::Prefill));
        assert!(Kind::PrefillFailed.may_send(Role::Worker));
        assert!(!Kind::PrefillFailed.may_send(Role::Router));
        for r in Role::ALL {
            assert!(Kind::Heartbeat.may_send(r));
        }
    }
}
