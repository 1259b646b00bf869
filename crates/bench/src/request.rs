//! One streamed request as a state machine: decoded SSE events and their
//! arrival times in, a timing sample or a classified error out.
//!
//! Pure: times are offsets from the moment the request was sent, passed in
//! by the caller, so every rule here is tested without a socket or a clock.

use std::borrow::Cow;
use std::fmt;
use std::time::Duration;

use serde::Deserialize;
use serde::de::IgnoredAny;

/// Why a request did not count as a success. Classified once, here; the
/// report keys errors by [`ErrorKind::key`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ErrorKind {
    /// The server answered with a non-success HTTP status.
    Http(u16),
    /// The request did not complete within `--timeout-s`.
    Timeout,
    /// No response headers came back: connection refused, reset or DNS failure.
    Connect,
    /// The body was not a valid stream: bad SSE or JSON, an in-stream error
    /// object, or a stream cut before `[DONE]` or a finish reason.
    Stream,
    /// The stream ended properly but carried no generated text.
    Empty,
    /// Dropped on purpose mid-stream by `--cancel-fraction` (not a server fault).
    Dropped,
}

impl ErrorKind {
    /// The report's key for this kind: `http_429`, `timeout`, `connect`,
    /// `stream_error` or `empty`.
    pub fn key(&self) -> String {
        self.to_string()
    }
}

impl fmt::Display for ErrorKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ErrorKind::Http(code) => write!(f, "http_{code}"),
            ErrorKind::Timeout => f.write_str("timeout"),
            ErrorKind::Connect => f.write_str("connect"),
            ErrorKind::Stream => f.write_str("stream_error"),
            ErrorKind::Empty => f.write_str("empty"),
            ErrorKind::Dropped => f.write_str("dropped"),
        }
    }
}

/// Timings of one successful request.
#[derive(Debug, Clone, PartialEq)]
pub struct Sample {
    /// Send to first chunk with generated text.
    pub ttft: Duration,
    /// Send to end of stream.
    pub e2e: Duration,
    /// Mean time per output token after the first; `None` below 2 tokens.
    pub tpot: Option<Duration>,
    /// Gaps between successive content chunks.
    pub itl: Vec<Duration>,
    /// `usage.completion_tokens`, or the number of content chunks without usage.
    pub output_tokens: u64,
    /// `usage.prompt_tokens` when the server sent usage.
    pub prompt_tokens: Option<u64>,
}

/// The result of one request.
pub type Outcome = Result<Sample, ErrorKind>;

/// One `data:` chunk of an OpenAI-style completion or chat completion stream.
/// Strings borrow from the event where they can, so a token costs no copy.
#[derive(Deserialize)]
struct Chunk<'a> {
    #[serde(default, borrow)]
    choices: Vec<Choice<'a>>,
    #[serde(default)]
    usage: Option<Usage>,
    #[serde(default)]
    error: Option<IgnoredAny>,
}

#[derive(Deserialize)]
struct Choice<'a> {
    #[serde(default, borrow)]
    text: Option<Cow<'a, str>>,
    #[serde(default, borrow)]
    delta: Option<Delta<'a>>,
    #[serde(default, borrow)]
    finish_reason: Option<Cow<'a, str>>,
}

/// Reasoning models stream their thinking as `reasoning_content` (vLLM,
/// llama-server) or `reasoning`: those are generated tokens too, and
/// ignoring them would count the whole thinking phase as TTFT.
#[derive(Deserialize)]
struct Delta<'a> {
    #[serde(default, borrow)]
    content: Option<Cow<'a, str>>,
    #[serde(default, borrow)]
    reasoning_content: Option<Cow<'a, str>>,
    #[serde(default, borrow)]
    reasoning: Option<Cow<'a, str>>,
}

#[derive(Deserialize)]
struct Usage {
    #[serde(default)]
    prompt_tokens: Option<u64>,
    #[serde(default)]
    completion_tokens: Option<u64>,
}

fn non_empty(s: &Option<Cow<'_, str>>) -> bool {
    s.as_deref().is_some_and(|s| !s.is_empty())
}

/// Timing state of one request in flight.
#[derive(Debug)]
pub struct Trace {
    first: Option<Duration>,
    last: Option<Duration>,
    content_chunks: u64,
    itl: Vec<Duration>,
    prompt_tokens: Option<u64>,
    completion_tokens: Option<u64>,
    finished: bool,
    done: bool,
}

impl Trace {
    /// A trace expecting about `tokens_hint` tokens (sizes the ITL buffer once).
    pub fn new(tokens_hint: usize) -> Self {
        Self {
            first: None,
            last: None,
            content_chunks: 0,
            itl: Vec::with_capacity(tokens_hint),
            prompt_tokens: None,
            completion_tokens: None,
            finished: false,
            done: false,
        }
    }

    /// Whether `data: [DONE]` has been seen; later bytes are ignored.
    pub fn is_done(&self) -> bool {
        self.done
    }

    /// Content chunks (generated-text arrivals) seen so far.
    pub fn content_chunks(&self) -> u64 {
        self.content_chunks
    }

    /// Records `data: [DONE]`.
    pub fn on_done(&mut self) {
        self.done = true;
    }

    /// Records one `data:` payload that arrived `at` after send.
    pub fn on_data(&mut self, at: Duration, data: &str) -> Result<(), ErrorKind> {
        debug_assert!(!self.done, "data after [DONE]");
        let chunk: Chunk<'_> = serde_json::from_str(data).map_err(|_| ErrorKind::Stream)?;
        if chunk.error.is_some() {
            return Err(ErrorKind::Stream);
        }
        if let Some(u) = chunk.usage {
            // Some servers repeat cumulative usage on every chunk: the last wins.
            self.prompt_tokens = u.prompt_tokens.or(self.prompt_tokens);
            self.completion_tokens = u.completion_tokens.or(self.completion_tokens);
        }
        let Some(choice) = chunk.choices.first() else {
            return Ok(());
        };
        if choice.finish_reason.is_some() {
            self.finished = true;
        }
        let has_text = non_empty(&choice.text)
            || choice.delta.as_ref().is_some_and(|d| {
                non_empty(&d.content) || non_empty(&d.reasoning_content) || non_empty(&d.reasoning)
            });
        if has_text {
            match self.last {
                None => self.first = Some(at),
                Some(prev) => self.itl.push(at.saturating_sub(prev)),
            }
            self.last = Some(at);
            self.content_chunks += 1;
        }
        Ok(())
    }

    /// Closes the trace when the body ended `e2e` after send.
    pub fn finish(self, e2e: Duration) -> Outcome {
        // A stream that stops without [DONE] counts as cut unless a choice
        // already said why it finished (some servers omit [DONE]).
        if !self.done && !self.finished {
            return Err(ErrorKind::Stream);
        }
        let (Some(first), Some(last)) = (self.first, self.last) else {
            return Err(ErrorKind::Empty);
        };
        assert!(first <= last && self.content_chunks >= 1);
        let output_tokens = self.completion_tokens.unwrap_or(self.content_chunks);
        let tpot = (output_tokens >= 2).then(|| {
            let ns = (last - first).as_nanos() / u128::from(output_tokens - 1);
            Duration::from_nanos(u64::try_from(ns).unwrap_or(u64::MAX))
        });
        Ok(Sample {
            ttft: first,
            e2e,
            tpot,
            itl: self.itl,
            output_tokens,
            prompt_tokens: self.prompt_tokens,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ms(n: u64) -> Duration {
        Duration::from_millis(n)
    }

    #[test]
    fn completion_stream_with_usage() {
        let mut t = Trace::new(4);
        t.on_data(ms(10), r#"{"choices":[{"text":"a","finish_reason":null}]}"#)
            .unwrap();
        t.on_data(ms(12), r#"{"choices":[{"text":"b c"}]}"#)
            .unwrap();
        t.on_data(
            ms(16),
            r#"{"choices":[{"text":"d","finish_reason":"length"}]}"#,
        )
        .unwrap();
        t.on_data(
            ms(17),
            r#"{"choices":[],"usage":{"prompt_tokens":9,"completion_tokens":4}}"#,
        )
        .unwrap();
        t.on_done();
        let s = t.finish(ms(18)).unwrap();
        assert_eq!(s.ttft, ms(10));
        assert_eq!(s.e2e, ms(18));
        assert_eq!(s.output_tokens, 4);
        assert_eq!(s.prompt_tokens, Some(9));
        assert_eq!(s.tpot, Some(ms(2)));
        assert_eq!(s.itl, [ms(2), ms(4)]);
    }

    #[test]
    fn chat_stream_without_usage_counts_chunks() {
        let mut t = Trace::new(4);
        t.on_data(
            ms(5),
            r#"{"choices":[{"delta":{"role":"assistant","content":""}}]}"#,
        )
        .unwrap();
        t.on_data(ms(9), r#"{"choices":[{"delta":{"content":"Hi"}}]}"#)
            .unwrap();
        t.on_data(ms(11), r#"{"choices":[{"delta":{"content":"\u00e9\n"}}]}"#)
            .unwrap();
        t.on_data(
            ms(15),
            r#"{"choices":[{"delta":{"reasoning_content":"x"}}]}"#,
        )
        .unwrap();
        t.on_data(
            ms(16),
            r#"{"choices":[{"delta":{},"finish_reason":"stop"}]}"#,
        )
        .unwrap();
        t.on_done();
        let s = t.finish(ms(16)).unwrap();
        assert_eq!(s.ttft, ms(9), "the empty role chunk is not the first token");
        assert_eq!(s.output_tokens, 3);
        assert_eq!(s.tpot, Some(ms(3)));
        assert_eq!(s.prompt_tokens, None);
    }

    #[test]
    fn errors_are_classified() {
        let mut t = Trace::new(0);
        assert_eq!(t.on_data(ms(1), "{not json"), Err(ErrorKind::Stream));
        assert_eq!(
            t.on_data(ms(1), r#"{"error":{"message":"boom"}}"#),
            Err(ErrorKind::Stream)
        );

        let mut t = Trace::new(0);
        t.on_data(ms(1), r#"{"choices":[{"text":"a"}]}"#).unwrap();
        assert_eq!(t.finish(ms(2)), Err(ErrorKind::Stream), "cut before [DONE]");

        let mut t = Trace::new(0);
        t.on_done();
        assert_eq!(t.finish(ms(2)), Err(ErrorKind::Empty));

        let mut t = Trace::new(0);
        t.on_data(
            ms(1),
            r#"{"choices":[{"text":"a","finish_reason":"length"}]}"#,
        )
        .unwrap();
        let s = t.finish(ms(2)).unwrap();
        assert_eq!(
            (s.output_tokens, s.tpot),
            (1, None),
            "finish reason without [DONE] is fine"
        );
    }

    #[test]
    fn error_keys() {
        assert_eq!(ErrorKind::Http(429).key(), "http_429");
        assert_eq!(ErrorKind::Timeout.key(), "timeout");
        assert_eq!(ErrorKind::Connect.key(), "connect");
        assert_eq!(ErrorKind::Stream.key(), "stream_error");
        assert_eq!(ErrorKind::Empty.key(), "empty");
    }
}
