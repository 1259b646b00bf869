//! A pipeline group's own link: stage 0 (the node that holds the
//! Scheduler, the embedding, the first layers and the head) and each later
//! stage (a run of the model's layers) exchange these frames over one
//! mutual-TLS QUIC stream, in order, one answer to each request.
//!
//! A step's frame carries what a stage needs of the plan (each sequence's
//! tokens, first position, block table and how many output rows it asks
//! for) and the residual stream's rows after the stage before it; the
//! answer carries the rows after this stage's layers (the output rows only
//! when the next stop is stage 0, which norms, projects and samples them).
//! Block operations keep every stage's KV cache in step with stage 0's
//! pool: a block id means the same slots on every stage.
//!
//! On the wire a frame is its payload's length (`u32`, little-endian)
//! then the payload (an rkyv archive, checked before use): [`encode`],
//! [`decode_to_stage`], [`decode_from_stage`].

use rkyv::rancor;
use rkyv::util::AlignedVec;
use rkyv::{Archive, Deserialize, Serialize};

use crate::wire::WireError;

/// The version of these frames; a peer with another is refused at hello.
pub const STAGE_VERSION: u32 = 1;

/// The largest frame either end accepts: a 4,096-token step of a
/// 8,192-wide model in f32 is 128 MiB; larger steps do not fit a stage.
pub const STAGE_FRAME_MAX: u32 = 256 << 20;

/// How the residual stream's rows travel.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Archive, Serialize, Deserialize)]
pub enum ActDtype {
    /// 4 bytes a value: every stage sees exactly the values one node would
    /// (the group's tokens equal one node's, bit for bit).
    F32,
    /// 2 bytes a value (IEEE half): half the bytes a hop; the rows are
    /// rounded once a hop.
    F16,
}

impl ActDtype {
    /// Bytes of one value.
    pub fn bytes(self) -> usize {
        match self {
            ActDtype::F32 => 4,
            ActDtype::F16 => 2,
        }
    }

    /// `f32` or `f16`.
    pub fn name(self) -> &'static str {
        match self {
            ActDtype::F32 => "f32",
            ActDtype::F16 => "f16",
        }
    }

    /// From its name.
    pub fn parse(s: &str) -> Option<ActDtype> {
        match s {
            "f32" => Some(ActDtype::F32),
            "f16" => Some(ActDtype::F16),
            _ => None,
        }
    }
}

/// What stage 0 says first: which model, which layers it expects of this
/// stage, and the KV cache every stage must hold alike.
#[derive(Clone, Debug, PartialEq, Archive, Serialize, Deserialize)]
pub struct StageHello {
    /// [`STAGE_VERSION`].
    pub version: u32,
    /// The model file's size in bytes and its `general.name` (the stages
    /// must run the same file).
    pub model_bytes: u64,
    /// See `model_bytes`.
    pub model_name: String,
    /// The file's layers this stage must run.
    pub layers: (u32, u32),
    /// Tokens per KV block.
    pub block_size: u32,
    /// KV blocks (the group's one pool's count).
    pub num_blocks: u32,
    /// The KV cache's element type's name.
    pub kv_dtype: String,
    /// The largest step, in tokens.
    pub max_batch_tokens: u32,
}

/// One sequence's part of a step, as a stage needs it.
#[derive(Clone, Debug, Default, PartialEq, Archive, Serialize, Deserialize)]
pub struct StageSeq {
    /// The tokens of this step (a stage checks them as stage 0 did).
    pub tokens: Vec<u32>,
    /// Position of the first.
    pub start_pos: u32,
    /// The sequence's block table.
    pub block_table: Vec<u32>,
    /// Output rows it asks for (the last of its tokens).
    pub out_rows: u32,
}

/// Stage 0 to a stage.
#[derive(Clone, Debug, PartialEq, Archive, Serialize, Deserialize)]
pub enum ToStage {
    /// The first frame on a link.
    Hello(StageHello),
    /// Run this stage's layers over a step's rows.
    Step {
        /// Stage 0's step counter (the answer names it).
        step: u64,
        /// The step's sequences, in order.
        seqs: Vec<StageSeq>,
        /// How `rows` is encoded, and how the answer's must be.
        dtype: ActDtype,
        /// Every token's row (`n_embd` values each), tokens in order.
        rows: Vec<u8>,
        /// Answer with the output rows only (the next stop is stage 0).
        last: bool,
    },
    /// Copy a block's slots to another block.
    CopyBlock {
        /// From.
        src: u32,
        /// To.
        dst: u32,
    },
    /// Send a block's bytes (this stage's layers).
    ReadBlock {
        /// Which.
        block: u32,
    },
    /// Overwrite a block's bytes (this stage's layers).
    WriteBlock {
        /// Which.
        block: u32,
        /// Exactly the stage's bytes of a block.
        data: Vec<u8>,
    },
}

/// A stage's answer.
#[derive(Clone, Debug, PartialEq, Archive, Serialize, Deserialize)]
pub enum FromStage {
    /// Hello accepted: the stage runs these layers and holds this many
    /// bytes of each block, and this many bytes of weights.
    Ready {
        /// The file's layers it runs.
        layers: (u32, u32),
        /// Its bytes of one KV block.
        bytes_per_block: u64,
        /// Its weights' bytes.
        weight_bytes: u64,
    },
    /// A step's rows after this stage's layers.
    Rows {
        /// The step answered.
        step: u64,
        /// The rows (every token's, or the output rows' where `last`).
        rows: Vec<u8>,
    },
    /// A block's bytes.
    Block {
        /// Its bytes on this stage.
        data: Vec<u8>,
    },
    /// A block operation done.
    Done,
    /// Refused, and why (the request changed nothing, or the stage can no
    /// longer be trusted: stage 0 treats both as the group's failure).
    Refused {
        /// Why.
        reason: String,
    },
}

/// A blocking round trip from stage 0 to one later stage: one frame out,
/// its answer back. An error means the stage is lost (stage 0 treats any
/// stage's failure as the group's).
pub trait StageLink: Send {
    /// Sends `msg` and waits for the answer.
    fn call(&mut self, msg: &ToStage) -> Result<FromStage, String>;
}

/// One frame: the payload's length, then the payload.
pub fn encode<T>(msg: &T) -> Result<Vec<u8>, WireError>
where
    T: for<'a> Serialize<
        rkyv::api::high::HighSerializer<
            AlignedVec,
            rkyv::ser::allocator::ArenaHandle<'a>,
            rancor::Error,
        >,
    >,
{
    let payload =
        rkyv::to_bytes::<rancor::Error>(msg).map_err(|e| WireError::Invalid(e.to_string()))?;
    if payload.len() as u64 > STAGE_FRAME_MAX as u64 {
        return Err(WireError::TooLarge {
            len: payload.len() as u64,
            cap: STAGE_FRAME_MAX,
        });
    }
    let mut out = Vec::with_capacity(4 + payload.len());
    out.extend_from_slice(&(payload.len() as u32).to_le_bytes());
    out.extend_from_slice(&payload);
    Ok(out)
}

/// A frame's payload length from its first four bytes, refused over
/// [`STAGE_FRAME_MAX`].
pub fn frame_len(prefix: [u8; 4]) -> Result<usize, WireError> {
    let len = u32::from_le_bytes(prefix);
    if len > STAGE_FRAME_MAX {
        return Err(WireError::TooLarge {
            len: len as u64,
            cap: STAGE_FRAME_MAX,
        });
    }
    Ok(len as usize)
}

fn aligned(payload: &[u8]) -> AlignedVec<16> {
    let mut a = AlignedVec::<16>::with_capacity(payload.len());
    a.extend_from_slice(payload);
    a
}

/// Checks and decodes a payload stage 0 sent.
pub fn decode_to_stage(payload: &[u8]) -> Result<ToStage, WireError> {
    let a = aligned(payload);
    let archived = rkyv::access::<ArchivedToStage, rancor::Error>(&a)
        .map_err(|e| WireError::Invalid(e.to_string()))?;
    rkyv::deserialize::<ToStage, rancor::Error>(archived)
        .map_err(|e| WireError::Invalid(e.to_string()))
}

/// Checks and decodes a payload a stage sent.
pub fn decode_from_stage(payload: &[u8]) -> Result<FromStage, WireError> {
    let a = aligned(payload);
    let archived = rkyv::access::<ArchivedFromStage, rancor::Error>(&a)
        .map_err(|e| WireError::Invalid(e.to_string()))?;
    rkyv::deserialize::<FromStage, rancor::Error>(archived)
        .map_err(|e| WireError::Invalid(e.to_string()))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn step() -> ToStage {
        ToStage::Step {
            step: 7,
            seqs: vec![StageSeq {
                tokens: vec![1, 2, 3],
                start_pos: 5,
                block_table: vec![9, 4],
                out_rows: 1,
            }],
            dtype: ActDtype::F16,
            rows: (0..96u8).collect(),
            last: true,
        }
    }

    #[test]
    fn frames_round_trip() {
        for m in [
            step(),
            ToStage::CopyBlock { src: 1, dst: 2 },
            ToStage::WriteBlock {
                block: 3,
                data: vec![1; 40],
            },
        ] {
            let f = encode(&m).unwrap();
            let n = frame_len(f[..4].try_into().unwrap()).unwrap();
            assert_eq!(n, f.len() - 4);
            assert_eq!(decode_to_stage(&f[4..]).unwrap(), m);
        }
        let r = FromStage::Rows {
            step: 7,
            rows: vec![5; 64],
        };
        let f = encode(&r).unwrap();
        assert_eq!(decode_from_stage(&f[4..]).unwrap(), r);
    }

    /// Every truncation and every single-byte change of a frame is either
    /// refused or decodes to some frame: never a panic. Most are refused
    /// (the check catches bad lengths and tags).
    #[test]
    fn damaged_frames_are_refused_without_a_panic() {
        let f = encode(&step()).unwrap();
        let payload = &f[4..];
        let mut refused = 0;
        for cut in 0..payload.len() {
            if decode_to_stage(&payload[..cut]).is_err() {
                refused += 1;
            }
        }
        // (Cutting only trailing padding can leave a valid archive.)
        assert!(
            refused + 8 >= payload.len(),
            "truncations are refused: {refused}"
        );
        let mut seed = 0x9E37_79B9_7F4A_7C15u64;
        let mut changed_refused = 0;
        for i in 0..payload.len() {
            for _ in 0..8 {
                seed ^= seed << 13;
                seed ^= seed >> 7;
                seed ^= seed << 17;
                let mut p = payload.to_vec();
                p[i] ^= (seed as u8) | 1;
                if decode_to_stage(&p).is_err() {
                    changed_refused += 1;
                }
                // A reply decoder fed a request frame refuses it or reads
                // some reply: no panic either way.
                let _ = decode_from_stage(&p);
            }
        }
        assert!(changed_refused > 0, "some damaged frames are refused");
        assert!(frame_len((STAGE_FRAME_MAX + 1).to_le_bytes()).is_err());
    }
}
