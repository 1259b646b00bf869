//! The run's report: built from request outcomes, rendered as a table,
//! saved as JSON, and compared with an earlier report.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::time::Duration;

use serde::{Deserialize, Serialize};

use flotilla_exec::slo::{Metric, Objective};

use crate::request::{ErrorKind, Outcome};
use crate::server::{Sample, ServerSide};
use crate::stats::{Summary, percentile, round_to};

/// The load that was offered: the flags that shape the figures. The API key
/// is deliberately absent.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Flags {
    pub concurrency: usize,
    pub requests: usize,
    pub max_tokens: u32,
    /// Smallest per-request max_tokens when lengths were mixed.
    #[serde(default)]
    pub max_tokens_min: Option<u32>,
    pub prompt_len_min_words: usize,
    pub prompt_len_max_words: usize,
    pub seed: u64,
    pub ignore_eos: bool,
    pub chat: bool,
    pub timeout_s: u64,
    pub duration_s: Option<u64>,
    /// Fraction of requests dropped on purpose (0 in reports that predate it).
    #[serde(default)]
    pub cancel_fraction: f64,
    /// The JSON Schema file every request was constrained to, if any.
    #[serde(default)]
    pub json_schema: Option<String>,
    /// Open loop: requests/s sent at Poisson times whatever the server's
    /// pace (`concurrency` is then the most in flight allowed).
    #[serde(default)]
    pub rate: Option<f64>,
}

/// Everything one run measured. Latencies are in milliseconds; a summary is
/// `null` when no request produced a sample for it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Report {
    /// Free text from `--label`.
    pub label: String,
    pub model: String,
    /// Base URL as given.
    pub server_url: String,
    /// Path the requests went to: `/v1/completions` or `/v1/chat/completions`.
    pub endpoint: String,
    /// What the server's `/v1/models` says about quantisation, or "unknown".
    pub quantisation: String,
    pub flags: Flags,
    /// How prompts were drawn.
    pub prompt_distribution: String,
    pub requests_ok: u64,
    pub requests_failed: u64,
    /// Requests in flight when `--duration-s` ran out: neither ok nor failed.
    pub requests_cancelled: u64,
    /// Failed requests by kind (`http_429`, `timeout`, `connect`, `stream_error`, `empty`).
    pub errors: BTreeMap<String, u64>,
    /// First send to last completion (or to the `--duration-s` cap), seconds.
    pub wall_s: f64,
    /// Output tokens of successful requests.
    pub output_tokens: u64,
    /// Prompt tokens of successful requests, from usage (0 if none was sent).
    pub prompt_tokens: u64,
    /// `output_tokens / wall_s`.
    pub output_tokens_per_s: f64,
    /// `requests_ok / wall_s`.
    pub requests_per_s: f64,
    /// Time to first token.
    pub ttft_ms: Option<Summary>,
    /// Time per output token after the first, per request.
    pub tpot_ms: Option<Summary>,
    /// Inter-token latency: gaps between successive content chunks.
    pub itl_ms: Option<Summary>,
    /// Send to end of stream.
    pub e2e_ms: Option<Summary>,
    /// Draft tokens the server verified and accepted during the run (from
    /// its `/metrics`, Flotilla's speculative decoding); `null` for a
    /// server that does not report them.
    #[serde(default)]
    pub speculation: Option<SpecCounts>,
    /// The server's settings, peak memory and KV use (from its `/config`
    /// and `/metrics`, where it has them).
    #[serde(default)]
    pub server: ServerSide,
    /// Latency distributions for CDF plots.
    #[serde(default)]
    pub cdf: Option<Cdfs>,
    /// The run second by second: tokens received, the server's queues,
    /// batch, KV use and memory.
    #[serde(default)]
    pub timeline: Vec<Sample>,
    /// The run judged against `--slo`, where given.
    #[serde(default)]
    pub slo: Option<SloVerdict>,
}

/// A run judged against latency objectives: each held over the finished
/// requests, and no more than `max_lost` of them refused or failed.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SloVerdict {
    /// Every objective held and few enough were lost.
    pub met: bool,
    /// Requests refused or failed (not dropped on purpose) over those that
    /// ended.
    pub lost: f64,
    /// The most that may be.
    pub max_lost: f64,
    /// Each objective.
    pub objectives: Vec<SloCheck>,
}

/// One objective's figure in a run.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SloCheck {
    /// As given, e.g. `ttft_p99<=1000ms`.
    pub objective: String,
    /// Its bound, ms.
    pub limit_ms: f64,
    /// The run's figure (nearest rank), ms; `null` without a sample.
    pub measured_ms: Option<f64>,
    /// Whether it held (a figure without samples does not).
    pub met: bool,
}

/// `outcomes` judged against `objectives` (every tier together: one
/// server's requests) and `max_lost`.
pub fn judge(outcomes: &[Outcome], objectives: &[Objective], max_lost: f64) -> SloVerdict {
    let ended = outcomes
        .iter()
        .filter(|o| !matches!(o, Err(ErrorKind::Dropped)))
        .count();
    let failed = outcomes
        .iter()
        .filter(|o| matches!(o, Err(k) if !matches!(k, ErrorKind::Dropped)))
        .count();
    let lost = if ended == 0 {
        1.0
    } else {
        failed as f64 / ended as f64
    };
    let mut met = lost <= max_lost;
    let checks = objectives
        .iter()
        .map(|o| {
            let mut v: Vec<f64> = outcomes
                .iter()
                .filter_map(|r| r.as_ref().ok())
                .filter_map(|s| match o.metric {
                    Metric::Ttft => Some(s.ttft),
                    Metric::Tpot => s.tpot,
                })
                .map(ms)
                .collect();
            v.sort_by(f64::total_cmp);
            let measured = percentile(&v, o.pct).map(|x| round_to(x, 3));
            let limit_ms = o.limit.as_secs_f64() * 1e3;
            let ok = measured.is_some_and(|x| x <= limit_ms);
            met &= ok;
            SloCheck {
                objective: o.to_string(),
                limit_ms,
                measured_ms: measured,
                met: ok,
            }
        })
        .collect();
    SloVerdict {
        met,
        lost: round_to(lost, 6),
        max_lost,
        objectives: checks,
    }
}

/// Latency distributions as their percentiles 0, 1, ..., 100 (ms, nearest
/// rank): enough to draw each CDF, small at any number of requests.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Cdfs {
    pub ttft_ms: Vec<f64>,
    pub tpot_ms: Vec<f64>,
    pub itl_ms: Vec<f64>,
    pub e2e_ms: Vec<f64>,
}

/// Percentiles 0..=100 of `samples` (sorted in place); empty for none.
fn quantiles(samples: &mut [f64]) -> Vec<f64> {
    samples.sort_by(f64::total_cmp);
    (0..=100)
        .filter_map(|p| percentile(samples, f64::from(p)).map(|v| round_to(v, 3)))
        .collect()
}

/// Speculative decoding over one run.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct SpecCounts {
    /// Draft tokens verified.
    pub drafted: u64,
    /// Of them, accepted.
    pub accepted: u64,
}

impl SpecCounts {
    /// What the server's counters moved by between `before` and `after`.
    pub fn between(before: SpecCounts, after: SpecCounts) -> SpecCounts {
        SpecCounts {
            drafted: after.drafted.saturating_sub(before.drafted),
            accepted: after.accepted.saturating_sub(before.accepted),
        }
    }

    /// Accepted over drafted, when anything was drafted.
    pub fn rate(&self) -> Option<f64> {
        (self.drafted > 0).then(|| self.accepted as f64 / self.drafted as f64)
    }

    /// The totals in a Prometheus text exposition (every tier summed);
    /// `None` when it has no such series.
    pub fn from_metrics(text: &str) -> Option<SpecCounts> {
        let (mut drafted, mut accepted, mut seen) = (0u64, 0u64, false);
        for line in text.lines() {
            let total = |name: &str| -> Option<u64> {
                let rest = line.strip_prefix(name)?;
                if !(rest.starts_with('{') || rest.starts_with(' ')) {
                    return None;
                }
                let v: f64 = rest.rsplit(' ').next()?.parse().ok()?;
                Some(v as u64)
            };
            if let Some(v) = total("flotilla_spec_draft_tokens_total") {
                drafted += v;
                seen = true;
            } else if let Some(v) = total("flotilla_spec_accepted_tokens_total") {
                accepted += v;
                seen = true;
            }
        }
        seen.then_some(SpecCounts { drafted, accepted })
    }
}

/// What a run knows before any request is sent.
#[derive(Debug, Clone)]
pub(crate) struct RunMeta {
    pub label: String,
    pub model: String,
    pub server_url: String,
    pub endpoint: String,
    pub quantisation: String,
    pub flags: Flags,
    pub prompt_distribution: String,
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

impl Report {
    /// Folds the outcomes of finished requests into figures.
    pub(crate) fn build(
        meta: RunMeta,
        outcomes: &[Outcome],
        cancelled: u64,
        wall: Duration,
    ) -> Self {
        let mut errors = BTreeMap::new();
        let (mut ttft, mut tpot, mut itl, mut e2e) =
            (Vec::new(), Vec::new(), Vec::new(), Vec::new());
        let (mut ok, mut output_tokens, mut prompt_tokens) = (0u64, 0u64, 0u64);
        for o in outcomes {
            match o {
                Ok(s) => {
                    ok += 1;
                    output_tokens += s.output_tokens;
                    prompt_tokens += s.prompt_tokens.unwrap_or(0);
                    ttft.push(ms(s.ttft));
                    e2e.push(ms(s.e2e));
                    tpot.extend(s.tpot.map(ms));
                    itl.extend(s.itl.iter().copied().map(ms));
                }
                Err(kind) => *errors.entry(kind.key()).or_insert(0) += 1,
            }
        }
        let failed = outcomes.len() as u64 - ok;
        assert_eq!(errors.values().sum::<u64>(), failed);
        // Rounded like the latency figures, so the JSON parses back exactly.
        let wall_s = round_to(wall.as_secs_f64(), 6);
        let per_s = |n: u64| {
            if wall_s > 0.0 {
                round_to(n as f64 / wall_s, 4)
            } else {
                0.0
            }
        };
        Self {
            label: meta.label,
            model: meta.model,
            server_url: meta.server_url,
            endpoint: meta.endpoint,
            quantisation: meta.quantisation,
            flags: meta.flags,
            prompt_distribution: meta.prompt_distribution,
            requests_ok: ok,
            requests_failed: failed,
            requests_cancelled: cancelled,
            errors,
            wall_s,
            output_tokens,
            prompt_tokens,
            output_tokens_per_s: per_s(output_tokens),
            requests_per_s: per_s(ok),
            ttft_ms: Summary::of(&mut ttft),
            tpot_ms: Summary::of(&mut tpot),
            itl_ms: Summary::of(&mut itl),
            e2e_ms: Summary::of(&mut e2e),
            cdf: (ok > 0).then(|| Cdfs {
                ttft_ms: quantiles(&mut ttft),
                tpot_ms: quantiles(&mut tpot),
                itl_ms: quantiles(&mut itl),
                e2e_ms: quantiles(&mut e2e),
            }),
            speculation: None,
            server: ServerSide::default(),
            timeline: Vec::new(),
            slo: None,
        }
    }
}

/// One figure of a comparison with a baseline.
#[derive(Debug, Clone, PartialEq)]
pub struct Ratio {
    /// Figure name as printed, e.g. "TTFT p50 ms".
    pub figure: &'static str,
    pub new: Option<f64>,
    pub old: Option<f64>,
    /// `new / old`; `None` when either is missing or `old` is zero.
    pub ratio: Option<f64>,
    /// Higher is better (throughput), else lower is (latency, memory).
    pub higher_is_better: bool,
}

/// How a figure moved against its baseline.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Verdict {
    /// Within the threshold.
    Same,
    /// Better by more than the threshold.
    Better,
    /// Worse by more than the threshold: a regression.
    Worse,
}

impl Ratio {
    /// Whether it moved beyond `threshold` (a fraction: 0.05 is 5 %), and
    /// which way; `None` without a ratio.
    pub fn verdict(&self, threshold: f64) -> Option<Verdict> {
        let r = self.ratio?;
        let up = r > 1.0 + threshold;
        let down = r < 1.0 - threshold;
        Some(match (up, down, self.higher_is_better) {
            (false, false, _) => Verdict::Same,
            (true, _, true) | (_, true, false) => Verdict::Better,
            _ => Verdict::Worse,
        })
    }
}

/// New/old ratios of the headline figures.
pub fn compare(new: &Report, old: &Report) -> Vec<Ratio> {
    type Pick = fn(&Report) -> Option<f64>;
    let figures: [(&'static str, Pick); 12] = [
        ("output tok/s", |r| Some(r.output_tokens_per_s)),
        ("req/s", |r| Some(r.requests_per_s)),
        ("peak RSS MiB", |r| {
            r.server
                .peak_rss_bytes
                .map(|b| b as f64 / (1u64 << 20) as f64)
        }),
        ("KV peak blocks", |r| {
            r.server.kv_used_peak_blocks.map(|b| b as f64)
        }),
        ("TTFT p50 ms", |r| r.ttft_ms.map(|s| s.p50)),
        ("TTFT p99 ms", |r| r.ttft_ms.map(|s| s.p99)),
        ("TPOT p50 ms", |r| r.tpot_ms.map(|s| s.p50)),
        ("TPOT p99 ms", |r| r.tpot_ms.map(|s| s.p99)),
        ("ITL p50 ms", |r| r.itl_ms.map(|s| s.p50)),
        ("ITL p99 ms", |r| r.itl_ms.map(|s| s.p99)),
        ("E2E p50 ms", |r| r.e2e_ms.map(|s| s.p50)),
        ("E2E p99 ms", |r| r.e2e_ms.map(|s| s.p99)),
    ];
    figures
        .iter()
        .map(|&(figure, pick)| {
            let (n, o) = (pick(new), pick(old));
            let ratio = match (n, o) {
                (Some(n), Some(o)) if o != 0.0 => Some(n / o),
                _ => None,
            };
            Ratio {
                figure,
                new: n,
                old: o,
                ratio,
                higher_is_better: matches!(figure, "output tok/s" | "req/s"),
            }
        })
        .collect()
}

/// The settings in which `old` differs from `new`, as "name old -> new".
fn differences(new: &Report, old: &Report) -> Vec<String> {
    let (n, o) = (&new.flags, &old.flags);
    let mut out = Vec::new();
    let mut diff = |name: &str, a: String, b: String| {
        if a != b {
            out.push(format!("{name} {b} -> {a}"));
        }
    };
    diff("model", new.model.clone(), old.model.clone());
    diff(
        "concurrency",
        n.concurrency.to_string(),
        o.concurrency.to_string(),
    );
    diff("requests", n.requests.to_string(), o.requests.to_string());
    diff(
        "max_tokens",
        n.max_tokens.to_string(),
        o.max_tokens.to_string(),
    );
    diff(
        "prompt words",
        format!("{}..={}", n.prompt_len_min_words, n.prompt_len_max_words),
        format!("{}..={}", o.prompt_len_min_words, o.prompt_len_max_words),
    );
    diff("seed", n.seed.to_string(), o.seed.to_string());
    diff(
        "ignore_eos",
        n.ignore_eos.to_string(),
        o.ignore_eos.to_string(),
    );
    diff("chat", n.chat.to_string(), o.chat.to_string());
    out
}

fn opt(v: Option<f64>) -> String {
    v.map_or_else(|| "-".to_owned(), |v| format!("{v:.2}"))
}

/// Default of `--threshold`: a figure that moved more than this fraction
/// against the baseline is flagged.
pub const THRESHOLD_DEFAULT: f64 = 0.05;

/// The human-readable report, with a comparison section when `baseline` is
/// given (figures that moved beyond 5 % flagged).
pub fn render(r: &Report, baseline: Option<&Report>) -> String {
    render_with(r, baseline, THRESHOLD_DEFAULT)
}

/// One line of the server's settings from its `/config`.
fn settings_line(c: &serde_json::Value) -> String {
    let keys = [
        "quantization",
        "kv_cache_dtype",
        "kv_cache_blocks",
        "block_size",
        "max_num_seqs",
        "max_num_batched_tokens",
        "max_model_len",
        "speculative",
        "device",
        "threads",
    ];
    keys.iter()
        .filter_map(|k| {
            let v = c.get(*k)?;
            Some(match v {
                serde_json::Value::String(s) => format!("{k} {s}"),
                v => format!("{k} {v}"),
            })
        })
        .collect::<Vec<_>>()
        .join(", ")
}

/// [`render`] with figures flagged past `threshold` (a fraction).
pub fn render_with(r: &Report, baseline: Option<&Report>, threshold: f64) -> String {
    let f = &r.flags;
    let mut s = String::new();
    // Writing to a String cannot fail.
    let _ = writeln!(
        s,
        "flotilla-bench{}",
        if r.label.is_empty() {
            String::new()
        } else {
            format!(": {}", r.label)
        }
    );
    let _ = writeln!(s, "  server      {}{}", r.server_url, r.endpoint);
    let _ = writeln!(
        s,
        "  model       {} (quantisation: {})",
        r.model, r.quantisation
    );
    let _ = writeln!(
        s,
        "  load        {} requests, {}, max_tokens {}, ignore_eos {}, seed {}, timeout {} s{}",
        f.requests,
        f.rate.map_or_else(
            || format!("concurrency {}", f.concurrency),
            |r| format!(
                "open loop at {r} req/s (Poisson, at most {} in flight)",
                f.concurrency
            )
        ),
        f.max_tokens_min.map_or_else(
            || f.max_tokens.to_string(),
            |m| format!("{m}..={}", f.max_tokens)
        ),
        f.ignore_eos,
        f.seed,
        f.timeout_s,
        f.duration_s
            .map_or_else(String::new, |d| format!(", duration cap {d} s")),
    );
    let _ = writeln!(s, "  prompts     {}", r.prompt_distribution);
    if let Some(c) = &r.server.config {
        let _ = writeln!(s, "  settings    {}", settings_line(c));
    }
    let sv = &r.server;
    if sv.peak_rss_bytes.is_some() || sv.kv_used_peak_blocks.is_some() {
        let _ = writeln!(
            s,
            "  server      peak RSS {}, KV peak {} of {} blocks",
            sv.peak_rss_bytes.map_or_else(
                || "-".into(),
                |b| format!("{:.0} MiB", b as f64 / 1048576.0)
            ),
            sv.kv_used_peak_blocks
                .map_or_else(|| "-".into(), |b| b.to_string()),
            sv.kv_total_blocks
                .map_or_else(|| "-".into(), |b| b.to_string()),
        );
    }
    let errors: Vec<String> = r.errors.iter().map(|(k, v)| format!("{k} {v}")).collect();
    let _ = writeln!(
        s,
        "  requests    ok {}, failed {}{}, cancelled {}",
        r.requests_ok,
        r.requests_failed,
        if errors.is_empty() {
            String::new()
        } else {
            format!(" ({})", errors.join(", "))
        },
        r.requests_cancelled,
    );
    let _ = writeln!(s, "  wall        {:.3} s", r.wall_s);
    let _ = writeln!(
        s,
        "  throughput  {:.2} output tok/s, {:.3} req/s ({} output tokens, {} prompt tokens by usage)",
        r.output_tokens_per_s, r.requests_per_s, r.output_tokens, r.prompt_tokens,
    );
    if let Some(c) = r.speculation {
        let _ = writeln!(
            s,
            "  speculation {} drafted, {} accepted ({})",
            c.drafted,
            c.accepted,
            c.rate().map_or_else(
                || "nothing drafted".into(),
                |r| format!("{:.1}%", 100.0 * r)
            ),
        );
    }
    let _ = writeln!(s);
    let _ = writeln!(
        s,
        "  {:<8}{:>10}{:>10}{:>10}{:>10}{:>10}{:>9}",
        "ms", "mean", "p50", "p90", "p99", "max", "n"
    );
    for (name, sum) in [
        ("TTFT", r.ttft_ms),
        ("TPOT", r.tpot_ms),
        ("ITL", r.itl_ms),
        ("E2E", r.e2e_ms),
    ] {
        match sum {
            Some(x) => {
                let _ = writeln!(
                    s,
                    "  {name:<8}{:>10.2}{:>10.2}{:>10.2}{:>10.2}{:>10.2}{:>9}",
                    x.mean, x.p50, x.p90, x.p99, x.max, x.count
                );
            }
            None => {
                let _ = writeln!(s, "  {name:<8}{:>10}", "-");
            }
        }
    }
    if let Some(v) = &r.slo {
        let _ = writeln!(s);
        let _ = writeln!(
            s,
            "  SLO         {}: lost {:.2}% (at most {:.2}%){}",
            if v.met { "met" } else { "missed" },
            v.lost * 100.0,
            v.max_lost * 100.0,
            v.objectives
                .iter()
                .map(|c| format!(
                    "; {} {} ({})",
                    c.objective,
                    if c.met { "held" } else { "missed" },
                    c.measured_ms
                        .map_or_else(|| "no sample".into(), |x| format!("{x:.1} ms"))
                ))
                .collect::<String>()
        );
    }
    if let Some(old) = baseline {
        let _ = writeln!(s);
        let _ = writeln!(
            s,
            "  vs baseline{} (new/old: above 1 is better for throughput, below 1 for latency)",
            if old.label.is_empty() {
                String::new()
            } else {
                format!(" '{}'", old.label)
            },
        );
        let _ = writeln!(
            s,
            "  {:<15}{:>12}{:>12}{:>10}  beyond {:.0} %",
            "figure",
            "new",
            "old",
            "new/old",
            threshold * 100.0
        );
        let mut worse = 0;
        for c in compare(r, old) {
            let ratio = c
                .ratio
                .map_or_else(|| "-".to_owned(), |x| format!("{x:.3}"));
            let flag = match c.verdict(threshold) {
                Some(Verdict::Worse) => {
                    worse += 1;
                    "WORSE"
                }
                Some(Verdict::Better) => "better",
                _ => "",
            };
            let _ = writeln!(
                s,
                "  {:<15}{:>12}{:>12}{:>10}  {flag}",
                c.figure,
                opt(c.new),
                opt(c.old),
                ratio
            );
        }
        let _ = writeln!(
            s,
            "  {worse} figure(s) worse than the baseline by more than {:.0} %",
            threshold * 100.0
        );
        let diffs = differences(r, old);
        if !diffs.is_empty() {
            let _ = writeln!(
                s,
                "  note: the baseline ran a different load: {}",
                diffs.join(", ")
            );
        }
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::request::{ErrorKind, Sample};

    fn meta() -> RunMeta {
        RunMeta {
            label: "test".into(),
            model: "m".into(),
            server_url: "http://127.0.0.1:1".into(),
            endpoint: "/v1/completions".into(),
            quantisation: "unknown".into(),
            flags: Flags {
                concurrency: 2,
                requests: 4,
                max_tokens: 3,
                max_tokens_min: None,
                prompt_len_min_words: 1,
                prompt_len_max_words: 2,
                seed: 0,
                ignore_eos: true,
                chat: false,
                timeout_s: 5,
                duration_s: None,
                cancel_fraction: 0.0,
                json_schema: None,
                rate: None,
            },
            prompt_distribution: "uniform".into(),
        }
    }

    fn sample(ttft_ms: u64) -> Sample {
        let d = Duration::from_millis;
        Sample {
            ttft: d(ttft_ms),
            e2e: d(ttft_ms + 4),
            tpot: Some(d(2)),
            itl: vec![d(2), d(2)],
            output_tokens: 3,
            prompt_tokens: Some(5),
        }
    }

    fn report() -> Report {
        let outcomes = [
            Ok(sample(10)),
            Ok(sample(30)),
            Err(ErrorKind::Http(429)),
            Err(ErrorKind::Timeout),
        ];
        Report::build(meta(), &outcomes, 0, Duration::from_secs(2))
    }

    #[test]
    fn speculation_counts_come_from_the_servers_metrics() {
        let text = "# HELP flotilla_spec_draft_tokens_total Draft tokens\n\
            flotilla_spec_draft_tokens_total{tier=\"paid\"} 40\n\
            flotilla_spec_draft_tokens_total{tier=\"free\"} 2\n\
            flotilla_spec_accepted_tokens_total{tier=\"paid\"} 30\n\
            flotilla_spec_draft_tokens_total_extra 999\n";
        let after = SpecCounts::from_metrics(text).unwrap();
        assert_eq!(
            after,
            SpecCounts {
                drafted: 42,
                accepted: 30
            }
        );
        let before = SpecCounts {
            drafted: 2,
            accepted: 0,
        };
        let run = SpecCounts::between(before, after);
        assert_eq!(run.rate(), Some(0.75));
        // A server without the series (llama-server): no figure at all.
        assert_eq!(SpecCounts::from_metrics("llamacpp:tokens 5\n"), None);
        let mut r = report();
        r.speculation = Some(run);
        assert!(render(&r, None).contains("speculation 40 drafted, 30 accepted (75.0%)"));
    }

    #[test]
    fn build_counts_and_rates() {
        let r = report();
        assert_eq!(
            (r.requests_ok, r.requests_failed, r.requests_cancelled),
            (2, 2, 0)
        );
        assert_eq!(r.errors["http_429"], 1);
        assert_eq!(r.errors["timeout"], 1);
        assert_eq!((r.output_tokens, r.prompt_tokens), (6, 10));
        assert_eq!(r.output_tokens_per_s, 3.0);
        assert_eq!(r.requests_per_s, 1.0);
        let ttft = r.ttft_ms.unwrap();
        assert_eq!((ttft.p50, ttft.p99, ttft.count), (10.0, 30.0, 2));
        assert_eq!(r.itl_ms.unwrap().count, 4);
    }

    #[test]
    fn json_round_trip() {
        let r = report();
        let json = serde_json::to_string_pretty(&r).unwrap();
        let back: Report = serde_json::from_str(&json).unwrap();
        assert_eq!(back, r);
        let v: serde_json::Value = serde_json::from_str(&json).unwrap();
        for key in [
            "model",
            "server_url",
            "flags",
            "quantisation",
            "label",
            "output_tokens_per_s",
            "ttft_ms",
        ] {
            assert!(v.get(key).is_some(), "missing {key}");
        }
        // An all-failed run has no latency figures and still round-trips.
        let empty = Report::build(meta(), &[Err(ErrorKind::Connect)], 0, Duration::ZERO);
        let back: Report = serde_json::from_str(&serde_json::to_string(&empty).unwrap()).unwrap();
        assert_eq!(back, empty);
        assert_eq!(back.ttft_ms, None);
    }

    #[test]
    fn compare_gives_new_over_old() {
        let old = report();
        let mut new = old.clone();
        new.output_tokens_per_s *= 2.0;
        new.flags.concurrency = 8;
        let c = compare(&new, &old);
        assert_eq!(c[0].figure, "output tok/s");
        assert_eq!(c[0].ratio, Some(2.0));
        let ttft = c.iter().find(|r| r.figure == "TTFT p50 ms").unwrap();
        assert_eq!(ttft.ratio, Some(1.0));
        // No server figures in either: no ratio, no flag.
        let rss = c.iter().find(|r| r.figure == "peak RSS MiB").unwrap();
        assert_eq!((rss.ratio, rss.verdict(0.05)), (None, None));
        let text = render(&new, Some(&old));
        assert!(text.contains("vs baseline"));
        assert!(text.contains("concurrency 2 -> 8"));
        assert!(text.contains("2.000"));
    }
}
