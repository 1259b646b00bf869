//! What the server says about itself during a run: its settings
//! (`GET /config`) and, sampled from its Prometheus `/metrics`, its queue
//! and batch per tier, KV use and memory. Parsing is pure (tests); a server
//! without these endpoints (llama-server, vLLM) gives `None`s, never an
//! error.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

/// Queue and batch of one tier at one look.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
pub struct TierLoad {
    /// Requests waiting.
    pub queued: u64,
    /// Sequences in the running batch.
    pub running: u64,
}

/// One look during the run.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Sample {
    /// Seconds since the run started.
    pub t_s: f64,
    /// Content chunks (tokens, for servers that send one per token) the
    /// client had received by then, all requests together.
    pub output_chunks: u64,
    /// Per tier (Flotilla's `flotilla_queue_length` and
    /// `flotilla_running_sequences`); empty for other servers.
    #[serde(default)]
    pub tiers: BTreeMap<String, TierLoad>,
    /// KV blocks in use.
    #[serde(default)]
    pub kv_used_blocks: Option<u64>,
    /// The server's resident memory, bytes.
    #[serde(default)]
    pub rss_bytes: Option<u64>,
}

/// The server's own figures over the run.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct ServerSide {
    /// `GET /config` as the server answered it (model, quantization, KV
    /// dtype, engine settings); `None` if it has no such endpoint.
    #[serde(default)]
    pub config: Option<serde_json::Value>,
    /// Peak resident memory of the server process since it started
    /// (`process_resident_memory_max_bytes`), else the largest sampled.
    #[serde(default)]
    pub peak_rss_bytes: Option<u64>,
    /// Most KV blocks in use at any look.
    #[serde(default)]
    pub kv_used_peak_blocks: Option<u64>,
    /// KV blocks in the pool.
    #[serde(default)]
    pub kv_total_blocks: Option<u64>,
}

/// The value of each series of `name` in a Prometheus text page, with its
/// labels as text (`tier="paid"`); a series without labels has "".
pub(crate) fn series<'a>(text: &'a str, name: &str) -> Vec<(&'a str, f64)> {
    let mut out = Vec::new();
    for line in text.lines() {
        let Some(rest) = line.strip_prefix(name) else {
            continue;
        };
        let (labels, value) = if let Some(r) = rest.strip_prefix('{') {
            let Some((labels, v)) = r.split_once('}') else {
                continue;
            };
            (labels, v)
        } else if rest.starts_with(' ') {
            ("", rest)
        } else {
            continue;
        };
        if let Some(v) = value
            .split_whitespace()
            .next()
            .and_then(|v| v.parse::<f64>().ok())
        {
            out.push((labels, v));
        }
    }
    out
}

/// The value of `key` in a label set (`a="x",b="y"`).
pub(crate) fn label<'a>(labels: &'a str, key: &str) -> Option<&'a str> {
    labels.split(',').find_map(|kv| {
        let (k, v) = kv.split_once('=')?;
        (k.trim() == key).then(|| v.trim().trim_matches('"'))
    })
}

/// One look at a `/metrics` page, at `t_s` with `output_chunks` received.
pub(crate) fn sample(text: &str, t_s: f64, output_chunks: u64) -> Sample {
    let mut tiers: BTreeMap<String, TierLoad> = BTreeMap::new();
    for (labels, v) in series(text, "flotilla_queue_length") {
        if let Some(t) = label(labels, "tier") {
            tiers.entry(t.to_owned()).or_default().queued = v as u64;
        }
    }
    for (labels, v) in series(text, "flotilla_running_sequences") {
        if let Some(t) = label(labels, "tier") {
            tiers.entry(t.to_owned()).or_default().running = v as u64;
        }
    }
    let kv_used_blocks = series(text, "flotilla_kv_blocks")
        .into_iter()
        .find(|(l, _)| label(l, "state") == Some("used"))
        .map(|(_, v)| v as u64);
    let rss_bytes = series(text, "process_resident_memory_bytes")
        .first()
        .map(|&(_, v)| v as u64);
    Sample {
        t_s,
        output_chunks,
        tiers,
        kv_used_blocks,
        rss_bytes,
    }
}

/// The server's figures from its last `/metrics` page and the samples.
pub(crate) fn summarise(
    config: Option<serde_json::Value>,
    last_page: Option<&str>,
    samples: &[Sample],
) -> ServerSide {
    let peak_page = last_page.and_then(|p| {
        series(p, "process_resident_memory_max_bytes")
            .first()
            .map(|&(_, v)| v as u64)
    });
    let peak_sampled = samples.iter().filter_map(|s| s.rss_bytes).max();
    let kv_total_blocks = last_page.and_then(|p| {
        let s = series(p, "flotilla_kv_cache_blocks");
        (!s.is_empty()).then(|| {
            s.iter()
                .fold(0u64, |acc, &(_, v)| acc.saturating_add(v as u64))
        })
    });
    ServerSide {
        config,
        peak_rss_bytes: peak_page.or(peak_sampled),
        kv_used_peak_blocks: samples.iter().filter_map(|s| s.kv_used_blocks).max(),
        kv_total_blocks,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const PAGE: &str = "# HELP flotilla_queue_length Requests waiting, by tier\n\
        # TYPE flotilla_queue_length gauge\n\
        flotilla_queue_length{otel_scope_name=\"flotilla\",tier=\"free\"} 7\n\
        flotilla_queue_length{otel_scope_name=\"flotilla\",tier=\"paid\"} 1\n\
        flotilla_queue_length_extra{tier=\"paid\"} 99\n\
        flotilla_running_sequences{tier=\"paid\"} 4\n\
        flotilla_kv_blocks{state=\"free\"} 90\n\
        flotilla_kv_blocks{state=\"used\"} 10\n\
        flotilla_kv_cache_blocks{bytes_per_block=\"368640\",dtype=\"f16\"} 100\n\
        process_resident_memory_bytes 2.5e8\n\
        process_resident_memory_max_bytes 300000000\n";

    #[test]
    fn a_metrics_page_gives_each_tiers_load_kv_and_memory() {
        let s = sample(PAGE, 1.5, 42);
        assert_eq!(s.t_s, 1.5);
        assert_eq!(s.output_chunks, 42);
        assert_eq!(
            s.tiers["free"],
            TierLoad {
                queued: 7,
                running: 0
            }
        );
        assert_eq!(
            s.tiers["paid"],
            TierLoad {
                queued: 1,
                running: 4
            }
        );
        assert_eq!(s.kv_used_blocks, Some(10));
        assert_eq!(s.rss_bytes, Some(250_000_000));
        let mut later = s.clone();
        later.kv_used_blocks = Some(30);
        let side = summarise(None, Some(PAGE), &[s, later]);
        assert_eq!(side.peak_rss_bytes, Some(300_000_000));
        assert_eq!(side.kv_used_peak_blocks, Some(30));
        assert_eq!(side.kv_total_blocks, Some(100));
    }

    #[test]
    fn another_servers_page_gives_nothing_and_no_error() {
        let s = sample(
            "llamacpp:prompt_tokens_total 10\nnot a metric line\n",
            0.0,
            0,
        );
        assert!(s.tiers.is_empty());
        assert_eq!((s.kv_used_blocks, s.rss_bytes), (None, None));
        let side = summarise(None, None, &[s]);
        assert_eq!(side, ServerSide::default());
    }
}
