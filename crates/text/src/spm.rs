//! SentencePiece vocabularies as GGUF stores them (`tokenizer.ggml.model =
//! "llama"`: Gemma, Llama 2, Mistral), encoded the way llama.cpp does, so
//! that ids match `llama-tokenize` on the same file.
//!
//! * Control tokens (type 3) are matched as a whole when special tokens are
//!   parsed; user-defined tokens (type 4, Gemma's `"\n\n"` and space runs)
//!   always. Longer tokens are matched first, over the whole text, then the
//!   shorter ones in what is left (llama.cpp's `tokenizer_st_partition`).
//! * Each remaining piece of text (with a space in front when the vocabulary
//!   asks for a prefix and the piece starts the text or follows a special
//!   token) has its spaces replaced by `▁`, is split into characters, and
//!   adjacent symbols are merged while their concatenation is a token,
//!   highest score first (leftmost on ties).
//! * A symbol that is not a token is split back along the merges that made
//!   it; a character that is not a token becomes its UTF-8 bytes as `<0xNN>`
//!   tokens (byte fallback), or the unknown token when there is none.
//!
//! Decoding maps each id to its bytes (`▁` back to a space, `<0xNN>` to the
//! byte, control and user-defined tokens to their text), which the caller
//! joins into UTF-8, so streaming works as for byte-level vocabularies.

use std::collections::{BinaryHeap, HashMap};

/// GGUF `token_type` of a byte-fallback token `<0xNN>`.
pub const TOKEN_TYPE_BYTE: i32 = 6;

/// The whitespace marker of SentencePiece pieces.
const SPACE: &str = "\u{2581}";

/// A SentencePiece vocabulary ready to encode.
pub struct Spm {
    /// Piece text -> id.
    ids: HashMap<String, u32>,
    scores: Vec<f32>,
    /// Id of the `<0xNN>` token of each byte, when present.
    byte_tokens: [Option<u32>; 256],
    unk: Option<u32>,
    add_space_prefix: bool,
    /// User-defined tokens, longest first: always matched.
    user: Vec<(String, u32)>,
    /// Control and user-defined tokens together, longest first (the order
    /// in which llama.cpp partitions the text when parsing special tokens).
    all_special: Vec<(String, u32)>,
}

/// A piece of the text after special-token partitioning.
enum Fragment<'a> {
    Text(&'a str),
    Token(u32),
}

impl Spm {
    /// Builds the encoder; `types[i]` is the GGUF token type of id `i`.
    pub fn new(
        tokens: &[String],
        scores: &[f32],
        types: &[i32],
        unk: Option<u32>,
        add_space_prefix: bool,
    ) -> Spm {
        let mut ids = HashMap::with_capacity(tokens.len());
        let mut byte_tokens = [None; 256];
        let (mut control, mut user) = (Vec::new(), Vec::new());
        for (i, t) in tokens.iter().enumerate() {
            let id = i as u32;
            // The first id of a duplicated text wins, as in llama.cpp's map.
            ids.entry(t.clone()).or_insert(id);
            match types.get(i).copied().unwrap_or(1) {
                TOKEN_TYPE_BYTE => {
                    if let Some(b) = parse_byte_token(t) {
                        byte_tokens[b as usize].get_or_insert(id);
                    }
                }
                3 if !t.is_empty() => control.push((t.clone(), id)),
                4 if !t.is_empty() => user.push((t.clone(), id)),
                _ => {}
            }
        }
        let mut all_special: Vec<(String, u32)> =
            control.iter().chain(user.iter()).cloned().collect();
        for v in [&mut user, &mut all_special] {
            v.sort_by(|a, b| b.0.len().cmp(&a.0.len()).then(a.1.cmp(&b.1)));
        }
        Spm {
            ids,
            scores: scores.to_vec(),
            byte_tokens,
            unk,
            add_space_prefix,
            user,
            all_special,
        }
    }

    /// The id of a piece's text.
    pub fn token_id(&self, piece: &str) -> Option<u32> {
        self.ids.get(piece).copied()
    }

    /// Encodes `text` (without BOS) into `out`.
    pub fn encode(&self, text: &str, parse_special: bool, out: &mut Vec<u32>) {
        // No text, no fragment: not even the space prefix (as llama.cpp).
        if text.is_empty() {
            return;
        }
        let specials = if parse_special {
            &self.all_special
        } else {
            &self.user
        };
        let mut frags = vec![Fragment::Text(text)];
        for (s, id) in specials {
            if !text.contains(s.as_str()) {
                continue;
            }
            let mut next = Vec::with_capacity(frags.len() + 2);
            for f in frags {
                match f {
                    Fragment::Text(t) if t.contains(s.as_str()) => {
                        let mut rest = t;
                        while let Some(at) = rest.find(s.as_str()) {
                            if at > 0 {
                                next.push(Fragment::Text(&rest[..at]));
                            }
                            next.push(Fragment::Token(*id));
                            rest = &rest[at + s.len()..];
                        }
                        if !rest.is_empty() {
                            next.push(Fragment::Text(rest));
                        }
                    }
                    other => next.push(other),
                }
            }
            frags = next;
        }
        let mut prev_special = true;
        for f in frags {
            match f {
                Fragment::Token(id) => {
                    out.push(id);
                    prev_special = true;
                }
                Fragment::Text(t) => {
                    let mut s = String::with_capacity(t.len() + 3);
                    if self.add_space_prefix && prev_special {
                        s.push(' ');
                    }
                    s.push_str(t);
                    self.encode_piece(&s.replace(' ', SPACE), out);
                    prev_special = false;
                }
            }
        }
    }

    /// The bigram merges of one piece of text (spaces already escaped).
    fn encode_piece(&self, text: &str, out: &mut Vec<u32>) {
        if text.is_empty() {
            return;
        }
        // Symbols: byte ranges of the text, in a doubly linked list.
        let mut sym: Vec<Symbol> = Vec::with_capacity(text.len());
        for (i, (at, c)) in text.char_indices().enumerate() {
            sym.push(Symbol {
                start: at,
                len: c.len_utf8(),
                prev: i as isize - 1,
                next: i as isize + 1,
            });
        }
        if let Some(last) = sym.last_mut() {
            last.next = -1;
        }
        let mut heap = BinaryHeap::new();
        let mut rev: HashMap<String, (usize, usize)> = HashMap::new();
        for i in 1..sym.len() {
            self.try_bigram(text, &sym, i - 1, i, &mut heap, &mut rev);
        }
        while let Some(b) = heap.pop() {
            let (l, r) = (b.left, b.right);
            // Stale: one side was merged away or changed length since.
            if sym[l].len == 0 || sym[r].len == 0 || sym[l].len + sym[r].len != b.size {
                continue;
            }
            sym[l].len += sym[r].len;
            sym[r].len = 0;
            sym[l].next = sym[r].next;
            if sym[r].next >= 0 {
                let n = sym[r].next as usize;
                sym[n].prev = l as isize;
            }
            if sym[l].prev >= 0 {
                self.try_bigram(text, &sym, sym[l].prev as usize, l, &mut heap, &mut rev);
            }
            if sym[l].next >= 0 {
                self.try_bigram(text, &sym, l, sym[l].next as usize, &mut heap, &mut rev);
            }
        }
        let mut i = 0isize;
        while i >= 0 {
            let s = &sym[i as usize];
            self.resegment(&text[s.start..s.start + s.len], &rev, out);
            i = s.next;
        }
    }

    fn try_bigram(
        &self,
        text: &str,
        sym: &[Symbol],
        l: usize,
        r: usize,
        heap: &mut BinaryHeap<Bigram>,
        rev: &mut HashMap<String, (usize, usize)>,
    ) {
        let piece = &text[sym[l].start..sym[r].start + sym[r].len];
        let Some(&id) = self.ids.get(piece) else {
            return;
        };
        heap.push(Bigram {
            left: l,
            right: r,
            score: self.scores.get(id as usize).copied().unwrap_or(0.0),
            size: piece.len(),
        });
        rev.insert(piece.to_string(), (sym[l].len, sym[r].len));
    }

    fn resegment(&self, piece: &str, rev: &HashMap<String, (usize, usize)>, out: &mut Vec<u32>) {
        if let Some(&id) = self.ids.get(piece) {
            out.push(id);
            return;
        }
        if let Some(&(a, _)) = rev.get(piece) {
            self.resegment(&piece[..a], rev, out);
            self.resegment(&piece[a..], rev, out);
            return;
        }
        for b in piece.bytes() {
            if let Some(id) = self.byte_tokens[b as usize].or(self.unk) {
                out.push(id);
            }
        }
    }
}

#[derive(Clone, Copy)]
struct Symbol {
    start: usize,
    len: usize,
    prev: isize,
    next: isize,
}

/// A candidate merge; the heap pops the highest score, then the leftmost.
struct Bigram {
    left: usize,
    right: usize,
    score: f32,
    size: usize,
}

impl PartialEq for Bigram {
    fn eq(&self, o: &Self) -> bool {
        self.cmp(o) == std::cmp::Ordering::Equal
    }
}
impl Eq for Bigram {}
impl PartialOrd for Bigram {
    fn partial_cmp(&self, o: &Self) -> Option<std::cmp::Ordering> {
        Some(self.cmp(o))
    }
}
impl Ord for Bigram {
    fn cmp(&self, o: &Self) -> std::cmp::Ordering {
        self.score
            .total_cmp(&o.score)
            .then_with(|| o.left.cmp(&self.left))
    }
}

/// `<0xNN>` -> the byte.
pub fn parse_byte_token(t: &str) -> Option<u8> {
    let hex = t.strip_prefix("<0x")?.strip_suffix('>')?;
    if hex.len() != 2 {
        return None;
    }
    u8::from_str_radix(hex, 16).ok()
}

/// The bytes a token stands for in decoded text.
pub fn piece_bytes(token: &str, token_type: i32) -> Vec<u8> {
    match token_type {
        TOKEN_TYPE_BYTE => parse_byte_token(token).map_or_else(Vec::new, |b| vec![b]),
        3 | 4 => token.as_bytes().to_vec(),
        // Unknown: llama.cpp writes U+2585 for it.
        2 => "\u{2585}".as_bytes().to_vec(),
        _ => token.replace(SPACE, " ").into_bytes(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn vocab() -> (Vec<String>, Vec<f32>, Vec<i32>) {
        let mut toks: Vec<(String, f32, i32)> = vec![
            ("<unk>".into(), 0.0, 2),
            ("<s>".into(), 0.0, 3),
            ("<turn>".into(), 0.0, 3),
            ("\n\n".into(), 0.0, 4),
        ];
        for b in 0..=255u32 {
            toks.push((format!("<0x{b:02X}>"), 0.0, 6));
        }
        for (t, s) in [
            ("▁", -1.0),
            ("h", -2.0),
            ("e", -2.0),
            ("l", -2.0),
            ("o", -2.0),
            ("he", -1.0),
            ("ll", -1.1),
            ("llo", -1.2),
            ("hello", -1.3),
            ("▁hello", -1.4),
            ("el", -2.0),
            ("\n", -2.0),
        ] {
            toks.push((t.into(), s, 1));
        }
        (
            toks.iter().map(|t| t.0.clone()).collect(),
            toks.iter().map(|t| t.1).collect(),
            toks.iter().map(|t| t.2).collect(),
        )
    }

    fn id(toks: &[String], t: &str) -> u32 {
        toks.iter().position(|x| x == t).unwrap() as u32
    }

    #[test]
    fn merges_by_score_and_falls_back_to_bytes() {
        let (t, s, ty) = vocab();
        let spm = Spm::new(&t, &s, &ty, Some(0), false);
        let mut out = Vec::new();
        spm.encode(" hello", true, &mut out);
        assert_eq!(out, vec![id(&t, "▁hello")]);
        out.clear();
        // "he" (-1.0) and "ll" (-1.1) outrank "el" (-2.0), which they consume.
        spm.encode("hell", true, &mut out);
        assert_eq!(out, vec![id(&t, "he"), id(&t, "ll")]);
        out.clear();
        // "é" is not a token: its two UTF-8 bytes.
        spm.encode("é", true, &mut out);
        assert_eq!(out, vec![id(&t, "<0xC3>"), id(&t, "<0xA9>")]);
    }

    #[test]
    fn special_tokens_are_partitioned() {
        let (t, s, ty) = vocab();
        let spm = Spm::new(&t, &s, &ty, Some(0), false);
        let mut out = Vec::new();
        spm.encode("<turn>h\n\nh", true, &mut out);
        assert_eq!(
            out,
            vec![id(&t, "<turn>"), id(&t, "h"), id(&t, "\n\n"), id(&t, "h")]
        );
        out.clear();
        // Without parsing, control text is text; user-defined still matches.
        spm.encode("<turn>\n\n", false, &mut out);
        assert!(!out.contains(&id(&t, "<turn>")));
        assert_eq!(*out.last().unwrap(), id(&t, "\n\n"));
        // A space prefix only when asked for, and after a special token.
        let spm = Spm::new(&t, &s, &ty, Some(0), true);
        out.clear();
        spm.encode("hello<turn>hello", true, &mut out);
        assert_eq!(
            out,
            vec![id(&t, "▁hello"), id(&t, "<turn>"), id(&t, "▁hello")]
        );
    }

    #[test]
    fn pieces_decode_to_bytes() {
        assert_eq!(piece_bytes("▁hello", 1), b" hello");
        assert_eq!(piece_bytes("<0x0A>", 6), b"\n");
        assert_eq!(piece_bytes("<start_of_turn>", 3), b"<start_of_turn>");
        assert_eq!(parse_byte_token("<0xZZ>"), None);
    }
}
