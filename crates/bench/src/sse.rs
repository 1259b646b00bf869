//! Incremental Server-Sent Events framing: bytes in, `data` payloads out.
//!
//! Pure: no I/O and no clock, so split-chunk cases are plain unit tests.
//! Lines end in `\n` or `\r\n` (every OpenAI-compatible server we drive uses
//! one of these; a lone `\r` terminator is not recognised). Comment lines
//! (`:`) and fields other than `data` are skipped; several `data` lines in one
//! event are joined with `\n`, as the SSE spec says.

use thiserror::Error;

/// Most bytes one event may buffer (its pending line plus its data). One
/// streamed token is a few hundred bytes; this stops a server that never
/// ends a line from growing the buffer without limit.
pub const EVENT_BYTES_MAX: usize = 1 << 20;

/// One dispatched event.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SseEvent<'a> {
    /// The event's data field (a JSON chunk from an OpenAI-style server).
    Data(&'a str),
    /// `data: [DONE]`: the server's end-of-stream marker.
    Done,
}

/// Why the byte stream is not valid SSE.
#[derive(Debug, Error, PartialEq, Eq)]
pub enum SseError {
    /// A line was not UTF-8.
    #[error("SSE line is not UTF-8")]
    Utf8,
    /// An event grew past [`EVENT_BYTES_MAX`] without being dispatched.
    #[error("SSE event longer than {EVENT_BYTES_MAX} bytes")]
    EventTooLong,
}

/// Incremental SSE parser. Feed bytes as they arrive, then drain events.
#[derive(Debug, Default)]
pub struct SseParser {
    /// Received bytes; `buf[pos..]` is not yet consumed.
    buf: Vec<u8>,
    pos: usize,
    /// Data of the event being built; reused across events.
    data: String,
    has_data: bool,
    /// `data` belongs to an event already handed out.
    dispatched: bool,
}

impl SseParser {
    /// A parser with no buffered bytes.
    pub fn new() -> Self {
        Self::default()
    }

    /// Appends bytes from the stream (any split, even mid-line or mid-UTF-8).
    pub fn feed(&mut self, bytes: &[u8]) -> Result<(), SseError> {
        self.clear_dispatched();
        if self.pos > 0 {
            self.buf.drain(..self.pos);
            self.pos = 0;
        }
        self.buf.extend_from_slice(bytes);
        if self.buf.len() > EVENT_BYTES_MAX {
            // Complete lines still dispatch events: only the unterminated tail
            // counts against the cap.
            let tail = self
                .buf
                .iter()
                .rposition(|&b| b == b'\n')
                .map_or(0, |i| i + 1);
            if self.buf.len() - tail > EVENT_BYTES_MAX {
                return Err(SseError::EventTooLong);
            }
        }
        Ok(())
    }

    /// The next complete event in the buffered bytes, or `None` when more
    /// bytes are needed.
    pub fn next_event(&mut self) -> Result<Option<SseEvent<'_>>, SseError> {
        self.clear_dispatched();
        loop {
            let rest = &self.buf[self.pos..];
            let Some(nl) = rest.iter().position(|&b| b == b'\n') else {
                return Ok(None);
            };
            let line_end = self.pos + nl;
            let line_start = self.pos;
            self.pos = line_end + 1;
            if self.take_line(line_start, line_end)? {
                return Ok(Some(self.dispatch()));
            }
        }
    }

    /// At end of stream: the event left pending when the last line had no
    /// blank line after it (or no newline at all), if any.
    pub fn finish(&mut self) -> Result<Option<SseEvent<'_>>, SseError> {
        self.clear_dispatched();
        if self.pos < self.buf.len() {
            let (start, end) = (self.pos, self.buf.len());
            self.pos = end;
            self.take_line(start, end)?;
        }
        if self.has_data {
            return Ok(Some(self.dispatch()));
        }
        Ok(None)
    }

    /// Applies the line `buf[start..end]` (without its `\n`); returns true
    /// when it is the blank line that dispatches a pending event.
    fn take_line(&mut self, start: usize, end: usize) -> Result<bool, SseError> {
        let mut line = &self.buf[start..end];
        if let Some(stripped) = line.strip_suffix(b"\r") {
            line = stripped;
        }
        if line.is_empty() {
            return Ok(self.has_data);
        }
        if line[0] == b':' {
            return Ok(false);
        }
        let (field, value) = match line.iter().position(|&b| b == b':') {
            Some(c) => {
                let v = &line[c + 1..];
                (&line[..c], v.strip_prefix(b" ").unwrap_or(v))
            }
            None => (line, &line[line.len()..]),
        };
        if field != b"data" {
            return Ok(false);
        }
        let value = std::str::from_utf8(value).map_err(|_| SseError::Utf8)?;
        if self.has_data {
            self.data.push('\n');
        }
        self.data.push_str(value);
        self.has_data = true;
        if self.data.len() > EVENT_BYTES_MAX {
            return Err(SseError::EventTooLong);
        }
        Ok(false)
    }

    fn dispatch(&mut self) -> SseEvent<'_> {
        debug_assert!(self.has_data);
        self.has_data = false;
        // The data stays readable through the returned borrow; the next call
        // clears it before building another event.
        self.dispatched = true;
        if self.data == "[DONE]" {
            SseEvent::Done
        } else {
            SseEvent::Data(&self.data)
        }
    }

    fn clear_dispatched(&mut self) {
        if self.dispatched {
            self.data.clear();
            self.dispatched = false;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Events from feeding `chunks` one by one, `[DONE]` as "[DONE]".
    fn events(chunks: &[&[u8]]) -> Vec<String> {
        let mut p = SseParser::new();
        let mut out = Vec::new();
        let mut push = |e: SseEvent<'_>| match e {
            SseEvent::Data(d) => out.push(d.to_owned()),
            SseEvent::Done => out.push("[DONE]".to_owned()),
        };
        for c in chunks {
            p.feed(c).unwrap();
            while let Some(e) = p.next_event().unwrap() {
                push(e);
            }
        }
        while let Some(e) = p.finish().unwrap() {
            push(e);
        }
        out
    }

    const STREAM: &[u8] = b"data: {\"a\":1}\n\ndata: {\"b\":\"\xc3\xa9\"}\r\n\r\ndata: [DONE]\n\n";

    #[test]
    fn whole_stream() {
        assert_eq!(
            events(&[STREAM]),
            ["{\"a\":1}", "{\"b\":\"\u{e9}\"}", "[DONE]"]
        );
    }

    #[test]
    fn every_split_point_gives_the_same_events() {
        let whole = events(&[STREAM]);
        for i in 0..=STREAM.len() {
            for j in i..=STREAM.len() {
                let got = events(&[&STREAM[..i], &STREAM[i..j], &STREAM[j..]]);
                assert_eq!(got, whole, "split at {i}, {j}");
            }
        }
        let bytes: Vec<&[u8]> = STREAM.chunks(1).collect();
        assert_eq!(events(&bytes), whole);
    }

    #[test]
    fn comments_other_fields_and_blank_lines_are_skipped() {
        let s =
            b": keep-alive\n\n\nevent: message\nid: 7\ndata:{\"x\":2}\n\n:ping\n\ndata: [DONE]\n\n";
        assert_eq!(events(&[s]), ["{\"x\":2}", "[DONE]"]);
    }

    #[test]
    fn multi_line_data_is_joined() {
        assert_eq!(events(&[b"data: a\ndata: b\n\n"]), ["a\nb"]);
    }

    #[test]
    fn usage_only_final_chunk_then_done() {
        let s = b"data: {\"choices\":[{\"text\":\"hi\"}]}\n\n\
                  data: {\"choices\":[],\"usage\":{\"completion_tokens\":1}}\n\n\
                  data: [DONE]\n\n";
        let got = events(&[s]);
        assert_eq!(got.len(), 3);
        assert!(got[1].contains("usage"));
        assert_eq!(got[2], "[DONE]");
    }

    #[test]
    fn unterminated_last_event_is_flushed_at_finish() {
        assert_eq!(events(&[b"data: {}\n\ndata: tail"]), ["{}", "tail"]);
        assert_eq!(events(&[b"data: [DONE]"]), ["[DONE]"]);
    }

    #[test]
    fn oversized_line_is_rejected() {
        let mut p = SseParser::new();
        let big = vec![b'x'; EVENT_BYTES_MAX + 1];
        assert_eq!(p.feed(&big), Err(SseError::EventTooLong));
    }

    #[test]
    fn invalid_utf8_is_an_error() {
        let mut p = SseParser::new();
        p.feed(b"data: \xff\n\n").unwrap();
        assert_eq!(p.next_event(), Err(SseError::Utf8));
    }
}
