//! Turning an engine's token ids into the text a client sees: incremental
//! UTF-8-safe decoding, stop strings (held back while they may still match),
//! and per-token log-probability records. Pure logic, no I/O.

use std::sync::Arc;

use flotilla_proto::Sampled;
use flotilla_text::TextSide;

/// OpenAI's stand-in for a log-probability of minus infinity.
const LOGPROB_FLOOR: f32 = -9999.0;

/// One token's log-probability record.
#[derive(Clone, Debug, PartialEq)]
pub struct TokenLogprob {
    /// The token's text (lossy when it is part of a character).
    pub token: String,
    /// The token's exact bytes.
    pub bytes: Vec<u8>,
    /// log p(token).
    pub logprob: f32,
    /// The most likely alternatives: (text, bytes, log p), best first.
    pub top: Vec<(String, Vec<u8>, f32)>,
    /// Characters of completion text before this token.
    pub text_offset: usize,
}

/// What one token (or the end) adds to the response.
#[derive(Debug, Default, PartialEq)]
pub struct Delta {
    /// Text released to the client (may be empty while held back).
    pub text: String,
    /// The token's log-probabilities, when asked for.
    pub logprob: Option<TokenLogprob>,
    /// A stop string matched: the request is over.
    pub stopped: bool,
}

/// Builds the completion text of one request, token by token.
pub struct Assembler {
    text: Arc<TextSide>,
    /// Tokens that end generation: no text, no log-probability record.
    hidden: Vec<u32>,
    stop: Vec<String>,
    logprobs: bool,
    /// Ids decoded so far; `ids[prefix..read]` was emitted last and is kept
    /// as left context so context-dependent decoders stay exact.
    ids: Vec<u32>,
    prefix: usize,
    read: usize,
    /// Decoded text not yet released (it may begin a stop string).
    pending: String,
    /// Characters decoded so far.
    decoded_chars: usize,
    /// Token events seen.
    tokens: u32,
    stopped: bool,
}

impl Assembler {
    /// An assembler; `hidden` are the ids whose text is never shown.
    pub fn new(text: Arc<TextSide>, hidden: Vec<u32>, stop: Vec<String>, logprobs: bool) -> Self {
        Assembler {
            text,
            hidden,
            stop,
            logprobs,
            ids: Vec::new(),
            prefix: 0,
            read: 0,
            pending: String::new(),
            decoded_chars: 0,
            tokens: 0,
            stopped: false,
        }
    }

    /// Token events seen (hidden ones included).
    pub fn tokens(&self) -> u32 {
        self.tokens
    }

    /// Adds one sampled token.
    pub fn push(&mut self, s: &Sampled) -> Delta {
        if self.stopped {
            return Delta {
                stopped: true,
                ..Delta::default()
            };
        }
        self.tokens += 1;
        if self.hidden.contains(&s.token) {
            return Delta::default();
        }
        let logprob = self.logprobs.then(|| self.record(s));
        self.ids.push(s.token);
        let new = self.decode_new(false);
        let mut d = self.release(&new, false);
        d.logprob = logprob;
        d
    }

    /// The end of the request: releases everything still held.
    pub fn finish(&mut self) -> Delta {
        if self.stopped {
            return Delta {
                stopped: true,
                ..Delta::default()
            };
        }
        let new = self.decode_new(true);
        self.release(&new, true)
    }

    fn decode(&self, ids: &[u32]) -> String {
        // The engine only sends ids of this vocabulary; a bad one decodes to nothing.
        self.text.tokenizer.decode(ids, true).unwrap_or_default()
    }

    /// Text that became complete; with `flush`, whatever is left.
    fn decode_new(&mut self, flush: bool) -> String {
        if self.read == self.ids.len() {
            return String::new();
        }
        let before = self.decode(&self.ids[self.prefix..self.read]);
        let after = self.decode(&self.ids[self.prefix..]);
        let complete = after.len() > before.len()
            && !after.ends_with('\u{FFFD}')
            && after.is_char_boundary(before.len())
            && after.starts_with(&before);
        if complete {
            self.prefix = self.read;
            self.read = self.ids.len();
            after[before.len()..].to_owned()
        } else if flush {
            self.prefix = self.ids.len();
            self.read = self.ids.len();
            after
                .strip_prefix(before.as_str())
                .unwrap_or(&after)
                .to_owned()
        } else {
            String::new()
        }
    }

    /// Appends `new` and releases what can no longer be part of a stop string.
    fn release(&mut self, new: &str, all: bool) -> Delta {
        self.decoded_chars += new.chars().count();
        self.pending.push_str(new);
        if let Some(at) = self.earliest_match() {
            self.stopped = true;
            let text = self.pending[..at].to_owned();
            self.pending.clear();
            return Delta {
                text,
                logprob: None,
                stopped: true,
            };
        }
        let keep_from = if all {
            self.pending.len()
        } else {
            self.held_suffix_start()
        };
        let rest = self.pending.split_off(keep_from);
        Delta {
            text: std::mem::replace(&mut self.pending, rest),
            logprob: None,
            stopped: false,
        }
    }

    /// Byte offset in `pending` of the first complete stop string.
    fn earliest_match(&self) -> Option<usize> {
        self.stop
            .iter()
            .filter_map(|s| self.pending.find(s.as_str()))
            .min()
    }

    /// Start of the longest suffix of `pending` that begins some stop string.
    fn held_suffix_start(&self) -> usize {
        self.pending
            .char_indices()
            .map(|(i, _)| i)
            .find(|&i| {
                let tail = &self.pending[i..];
                self.stop.iter().any(|s| s.starts_with(tail))
            })
            .unwrap_or(self.pending.len())
    }

    fn record(&self, s: &Sampled) -> TokenLogprob {
        let (token, bytes) = self.token_text(s.token);
        TokenLogprob {
            token,
            bytes,
            logprob: finite(s.logprob),
            top: s
                .top
                .iter()
                .map(|&(id, lp)| {
                    let (t, b) = self.token_text(id);
                    (t, b, finite(lp))
                })
                .collect(),
            // Text of ids still in the decoder (a split character) counts later.
            text_offset: self.decoded_chars,
        }
    }

    /// A token's text and exact bytes.
    fn token_text(&self, id: u32) -> (String, Vec<u8>) {
        let tok = &self.text.tokenizer;
        let text = tok.decode(&[id], false).unwrap_or_default();
        if !text.contains('\u{FFFD}') {
            let bytes = text.as_bytes().to_vec();
            return (text, bytes);
        }
        // Part of a character: the tokenizer knows the raw bytes.
        let bytes = tok
            .token_bytes(id)
            .map_or_else(|| text.as_bytes().to_vec(), <[u8]>::to_vec);
        (text, bytes)
    }
}

fn finite(lp: f32) -> f32 {
    if lp.is_finite() { lp } else { LOGPROB_FLOOR }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::OnceLock;

    fn text() -> Arc<TextSide> {
        static T: OnceLock<Arc<TextSide>> = OnceLock::new();
        T.get_or_init(|| {
            let path = flotilla_hub::test_model_path();
            let g = flotilla_gguf::GgufFile::open(&path).unwrap();
            Arc::new(TextSide::from_gguf(&g).unwrap())
        })
        .clone()
    }

    fn tok(id: u32) -> Sampled {
        Sampled {
            token: id,
            logprob: -1.0,
            top: vec![(id, -1.0)],
        }
    }

    /// Pushes the tokens of `s`, then finishes: (deltas, stopped at).
    fn run(s: &str, stop: &[&str]) -> (Vec<String>, Option<usize>) {
        let t = text();
        let ids = t.tokenizer.encode(s, false).unwrap();
        let stop = stop.iter().map(|x| x.to_string()).collect();
        let mut a = Assembler::new(t, vec![2], stop, false);
        let mut out = Vec::new();
        for (i, &id) in ids.iter().enumerate() {
            let d = a.push(&tok(id));
            out.push(d.text);
            if d.stopped {
                return (out, Some(i));
            }
        }
        out.push(a.finish().text);
        (out, None)
    }

    #[test]
    fn text_is_released_whole_and_in_order() {
        let s = " Hello wörld 🙂👍🏽 中文 end";
        let (deltas, stopped) = run(s, &[]);
        assert_eq!(stopped, None);
        assert_eq!(deltas.concat(), s);
        assert!(deltas.iter().all(|d| !d.contains('\u{FFFD}')), "{deltas:?}");
    }

    #[test]
    fn stop_strings_are_held_back_then_cut() {
        let (deltas, stopped) = run(" Hello world. The end", &["world."]);
        assert!(stopped.is_some());
        assert_eq!(deltas.concat(), " Hello ");
        // " world" could begin the stop string: it was never released.
        assert!(deltas.iter().all(|d| !d.contains("world")), "{deltas:?}");
        // A partial match that never completes is released at the end.
        let (deltas, stopped) = run(" Hello world", &["world!"]);
        assert_eq!((deltas.concat().as_str(), stopped), (" Hello world", None));
        assert_eq!(deltas.last().unwrap(), "world");
    }

    #[test]
    fn hidden_tokens_count_but_show_nothing() {
        let mut a = Assembler::new(text(), vec![2], Vec::new(), true);
        let d = a.push(&tok(2));
        assert_eq!(d, Delta::default());
        assert_eq!(a.tokens(), 1);
        let d = a.push(&tok(text().tokenizer.encode(" hi", false).unwrap()[0]));
        let lp = d.logprob.unwrap();
        assert_eq!(
            (lp.token.as_str(), lp.bytes.as_slice()),
            (" hi", &b" hi"[..])
        );
        assert_eq!(lp.top.len(), 1);
    }

    #[test]
    fn token_bytes_come_from_the_tokenizer() {
        let t = text();
        let world = t.tokenizer.token_id("Ġworld").unwrap();
        assert_eq!(t.tokenizer.token_bytes(world).unwrap(), b" world");
        let nl = t.tokenizer.token_id("Ċ").unwrap();
        assert_eq!(t.tokenizer.token_bytes(nl).unwrap(), b"\n");
    }
}
