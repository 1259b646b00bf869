//! The checks every transport makes on the way out and on the way in,
//! shared by QUIC and the simulated network so that a simulation runs the
//! same codec, frame cap and role policy as a real cluster.
//!
//! Out: the sender's role may send the kind, and the frame fits the cap.
//! In: the envelope (magic, version, kind, cap), the sender named in it is
//! the peer it came from, the peer's role may send the kind, and the
//! payload validates (bytecheck) and is of the kind the envelope says.

use flotilla_proto::Role;
use flotilla_proto::wire::{HEADER_LEN, Header, Message, decode_payload, encode_frame};

use crate::{NodeId, SendFailure};

/// Encodes `msg` from node `node` (its `epoch` and `role`) into one frame.
pub fn encode_checked(
    msg: &Message,
    correlation: u64,
    node: NodeId,
    epoch: u64,
    role: Role,
    cap: u32,
) -> Result<Vec<u8>, SendFailure> {
    if !msg.kind().may_send(role) {
        return Err(SendFailure::Forbidden(role));
    }
    encode_frame(msg, correlation, node, epoch, cap).map_err(|e| SendFailure::Encode(e.to_string()))
}

/// Why a received frame was refused.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum FrameRefusal {
    /// The bytes are not a valid frame, or name another sender.
    #[error("invalid frame: {0}")]
    Invalid(String),
    /// The sender's role may not send this kind.
    #[error("{0}")]
    Forbidden(String),
}

/// Checks and decodes one whole frame that came from node `from`, whose
/// role (from its certificate, or the simulated cluster's layout) is `role`.
pub fn accept_frame(
    frame: &[u8],
    cap: u32,
    from: NodeId,
    role: Role,
) -> Result<(Header, Message), FrameRefusal> {
    let head = Header::decode(frame, cap).map_err(|e| FrameRefusal::Invalid(e.to_string()))?;
    if head.sender != from {
        return Err(FrameRefusal::Invalid(format!(
            "envelope names node {} as sender, the frame came from node {from}",
            head.sender
        )));
    }
    if !head.kind.may_send(role) {
        return Err(FrameRefusal::Forbidden(format!(
            "role {role} may not send {:?}",
            head.kind
        )));
    }
    // The envelope is read once: the payload after it must be exactly as
    // long as it says (checked by `decode_payload`).
    let msg = decode_payload(&head, &frame[HEADER_LEN..])
        .map_err(|e| FrameRefusal::Invalid(e.to_string()))?;
    Ok((head, msg))
}

#[cfg(test)]
mod tests {
    use super::*;
    use flotilla_proto::EngineStatus;

    #[test]
    fn what_goes_out_comes_in_and_what_breaks_the_rules_does_not() {
        let hb = Message::Heartbeat(EngineStatus::default());
        let f = encode_checked(&hb, 0, 3, 9, Role::Worker, 4096).unwrap();
        let (h, m) = accept_frame(&f, 4096, 3, Role::Worker).unwrap();
        assert_eq!((h.sender, h.epoch, m), (3, 9, hb.clone()));
        // Another node's name in the envelope.
        assert!(matches!(
            accept_frame(&f, 4096, 4, Role::Worker),
            Err(FrameRefusal::Invalid(_))
        ));
        // A worker may not cancel; a router may not send events.
        let cancel = Message::Cancel {
            req: 1,
            stop_string: false,
            attempt: 0,
        };
        assert_eq!(
            encode_checked(&cancel, 1, 3, 9, Role::Worker, 4096),
            Err(SendFailure::Forbidden(Role::Worker))
        );
        let f = encode_checked(&cancel, 1, 0, 1, Role::Router, 4096).unwrap();
        assert!(matches!(
            accept_frame(&f, 4096, 0, Role::Decode),
            Err(FrameRefusal::Forbidden(_))
        ));
        // Over the cap, either way.
        let big = Message::Ping {
            seq: 1,
            pad: vec![0; 8000],
        };
        assert!(matches!(
            encode_checked(&big, 1, 0, 1, Role::Router, 4096),
            Err(SendFailure::Encode(_))
        ));
        let f = encode_checked(&big, 1, 0, 1, Role::Router, 1 << 20).unwrap();
        assert!(matches!(
            accept_frame(&f, 4096, 0, Role::Router),
            Err(FrameRefusal::Invalid(_))
        ));
        // One byte short or one too many: the envelope's length decides.
        let whole = encode_checked(&hb, 0, 3, 9, Role::Worker, 4096).unwrap();
        let mut long = whole.clone();
        long.push(0);
        for bad in [&whole[..whole.len() - 1], &long[..]] {
            assert!(matches!(
                accept_frame(bad, 4096, 3, Role::Worker),
                Err(FrameRefusal::Invalid(m)) if m.contains("truncated")
            ));
        }
        // Another protocol version.
        let mut old = encode_checked(&hb, 0, 3, 9, Role::Worker, 4096).unwrap();
        old[4] ^= 0xff;
        assert!(matches!(
            accept_frame(&old, 4096, 3, Role::Worker),
            Err(FrameRefusal::Invalid(m)) if m.contains("protocol version")
        ));
    }
}
