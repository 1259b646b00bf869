//! Metrics of one node: OpenTelemetry instruments exported in Prometheus
//! text by `opentelemetry-prometheus`. Every latency is a histogram labelled
//! by tier, so p50/p99 per tier come from the buckets.
//!
//! Names follow Prometheus conventions (`flotilla_` prefix, unit last).

pub mod trace;

pub use trace::{EventRec, KeyValue, OtelEnv, ServerSpan, SpanRec, TraceError, Tracing, Value};

use opentelemetry::metrics::{Counter, Gauge, Histogram, Meter, MeterProvider};
use opentelemetry_sdk::metrics::SdkMeterProvider;
use prometheus::{Encoder, TextEncoder};

/// How an accepted or refused request ended, for `flotilla_requests_total`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Terminal {
    /// Generated to a stop or a length limit.
    Finished,
    /// The client went away (or a stop string ended it early at the Router).
    Cancelled,
    /// Refused before queueing (4xx, 429, 503).
    Rejected,
    /// Expired in the queue.
    TimedOut,
    /// Failed inside the engine.
    Error,
    /// Stopped here and moved to another node with its KV (a drain).
    Moved,
}

impl Terminal {
    fn as_str(self) -> &'static str {
        match self {
            Terminal::Finished => "finished",
            Terminal::Cancelled => "cancelled",
            Terminal::Rejected => "rejected",
            Terminal::TimedOut => "timed_out",
            Terminal::Error => "error",
            Terminal::Moved => "moved",
        }
    }
}

/// Per-request phase durations, seconds.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct PhaseTimes {
    /// Arrival to first scheduled.
    pub queue_s: f64,
    /// First scheduled to prompt computed.
    pub prefill_s: f64,
    /// First token to last token.
    pub decode_s: f64,
    /// Arrival to first token.
    pub ttft_s: Option<f64>,
    /// Mean time per output token after the first.
    pub tpot_s: Option<f64>,
}

/// The instruments. Cheap to share (`Arc<Metrics>`); recording is lock-free
/// on the hot path apart from the SDK's own aggregation.
pub struct Metrics {
    registry: prometheus::Registry,
    _provider: Option<SdkMeterProvider>,
    /// False for [`Metrics::disabled`]: every recording returns at once.
    enabled: bool,
    ttft: Histogram<f64>,
    http_ttft: Histogram<f64>,
    tpot: Histogram<f64>,
    queue: Histogram<f64>,
    prefill: Histogram<f64>,
    decode: Histogram<f64>,
    step: Histogram<f64>,
    requests: Counter<u64>,
    rejected: Counter<u64>,
    preemptions: Counter<u64>,
    tokens_in: Counter<u64>,
    tokens_out: Counter<u64>,
    cached_tokens: Counter<u64>,
    draft_tokens: Counter<u64>,
    accepted_tokens: Counter<u64>,
    acceptance: Histogram<f64>,
    kv_blocks: Gauge<u64>,
    routing: Gauge<u64>,
    kv_cache: Gauge<u64>,
    offload_slots: Gauge<u64>,
    offload_moves: Counter<u64>,
    offload_lookups: Counter<u64>,
    queued: Gauge<u64>,
    running: Gauge<u64>,
    step_cost: Gauge<f64>,
    verify_steps: Counter<u64>,
    draft_passes: Counter<u64>,
    draft_pass_tokens: Counter<u64>,
    draft_seconds: Counter<f64>,
    draft_blocks: Gauge<u64>,
    draft_plan: Gauge<f64>,
}

impl std::fmt::Debug for Metrics {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Metrics")
    }
}

/// Why the exporter could not be set up.
#[derive(Debug, thiserror::Error)]
#[error("metrics exporter: {0}")]
pub struct MetricsError(String);

// Latency buckets from 1 ms to 2 min: TPOT lives in the low tens of ms,
// TTFT under load in seconds.
const LATENCY_BUCKETS_S: &[f64] = &[
    0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 1.5,
    2.0, 3.0, 5.0, 7.5, 10.0, 20.0, 30.0, 60.0, 120.0,
];

fn latency(meter: &Meter, name: &'static str, help: &'static str) -> Histogram<f64> {
    meter
        .f64_histogram(name)
        .with_description(help)
        .with_unit("s")
        .with_boundaries(LATENCY_BUCKETS_S.to_vec())
        .build()
}

impl Metrics {
    /// Builds the instruments on a private registry.
    pub fn new() -> Result<Metrics, MetricsError> {
        let registry = prometheus::Registry::new();
        let exporter = opentelemetry_prometheus::exporter()
            .with_registry(registry.clone())
            .without_target_info()
            .scope_info_enabled(false)
            .build()
            .map_err(|e| MetricsError(e.to_string()))?;
        let provider = SdkMeterProvider::builder().with_reader(exporter).build();
        let m = provider.meter("flotilla");
        Ok(Metrics::build(&m, registry, Some(provider)))
    }

    /// Instruments that record nothing, for runs nobody scrapes (the
    /// simulator: a 64-GPU run spent 6% of its time aggregating metrics).
    /// `render` gives an empty page.
    pub fn disabled() -> Metrics {
        let m = opentelemetry::metrics::noop::NoopMeterProvider::new().meter("flotilla");
        let mut metrics = Metrics::build(&m, prometheus::Registry::new(), None);
        metrics.enabled = false;
        metrics
    }

    fn build(
        m: &Meter,
        registry: prometheus::Registry,
        provider: Option<SdkMeterProvider>,
    ) -> Metrics {
        Metrics {
            enabled: true,
            ttft: latency(m, "flotilla_time_to_first_token", "Arrival to first token"),
            http_ttft: latency(
                m,
                "flotilla_http_time_to_first_token",
                "Request received at the HTTP front to its first token's text ready \
                 to send (streamed: sent), by tier (on a Router: across the cluster, \
                 the autoscaling signal)",
            ),
            tpot: latency(
                m,
                "flotilla_time_per_output_token",
                "Mean time per output token after the first",
            ),
            queue: latency(m, "flotilla_queue_time", "Arrival to first scheduled step"),
            prefill: latency(
                m,
                "flotilla_prefill_time",
                "First scheduled step to prompt computed",
            ),
            decode: latency(m, "flotilla_decode_time", "First to last generated token"),
            step: latency(m, "flotilla_step_time", "Duration of one engine step"),
            requests: m
                .u64_counter("flotilla_requests")
                .with_description("Requests by terminal state")
                .build(),
            rejected: m
                .u64_counter("flotilla_rejections")
                .with_description("Requests refused before queueing, by reason")
                .build(),
            preemptions: m
                .u64_counter("flotilla_preemptions")
                .with_description("Sequences preempted for recompute")
                .build(),
            tokens_in: m
                .u64_counter("flotilla_prompt_tokens")
                .with_description("Prompt tokens of finished requests")
                .build(),
            tokens_out: m
                .u64_counter("flotilla_generation_tokens")
                .with_description("Generated tokens, counted as each step delivers them")
                .build(),
            cached_tokens: m
                .u64_counter("flotilla_prefix_cache_hit_tokens")
                .with_description("Prompt tokens served from the prefix cache")
                .build(),
            draft_tokens: m
                .u64_counter("flotilla_spec_draft_tokens")
                .with_description(
                    "Draft tokens verified (speculative decoding), by tier, counted when \
                     their request ends",
                )
                .build(),
            acceptance: m
                .f64_histogram("flotilla_spec_acceptance")
                .with_description(
                    "Per request that drafted: its accepted over drafted tokens, by tier",
                )
                .with_boundaries(vec![0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 1.0])
                .build(),
            accepted_tokens: m
                .u64_counter("flotilla_spec_accepted_tokens")
                .with_description(
                    "Draft tokens accepted (output tokens that cost no step of their own), \
                     by tier; the acceptance rate is this over flotilla_spec_draft_tokens",
                )
                .build(),
            kv_blocks: m
                .u64_gauge("flotilla_kv_blocks")
                .with_description("KV cache blocks by state (used, free, cached)")
                .build(),
            routing: m
                .u64_gauge("flotilla_router_routing")
                .with_description(
                    "A Router's counts since it started: placements, those with a cache candidate, \
                     their prompt blocks, the blocks the chosen node held, prefix snapshots taken",
                )
                .build(),
            offload_slots: m
                .u64_gauge("flotilla_kv_offload_slots")
                .with_description("KV offload tier slots by state (held, free)")
                .build(),
            offload_moves: m
                .u64_counter("flotilla_kv_offload_blocks")
                .with_description(
                    "KV blocks moved by the offload tier (spilled, restored, dropped)",
                )
                .build(),
            offload_lookups: m
                .u64_counter("flotilla_kv_offload_lookups")
                .with_description(
                    "Prefix lookups past the KV cache's hits, by whether the offload tier restored blocks (hit, miss)",
                )
                .build(),
            kv_cache: m
                .u64_gauge("flotilla_kv_cache_blocks")
                .with_description(
                    "Blocks in the KV pool, with their element type and bytes per block",
                )
                .build(),
            queued: m
                .u64_gauge("flotilla_queue_length")
                .with_description("Requests waiting, by tier")
                .build(),
            running: m
                .u64_gauge("flotilla_running_sequences")
                .with_description("Sequences in the running batch, by tier")
                .build(),
            step_cost: m
                .f64_gauge("flotilla_step_cost_seconds")
                .with_description(
                    "What a step costs by the scheduler's fit of the steps run (part: fixed, per_token, per_output); step time targets are sized from it",
                )
                .build(),
            verify_steps: m
                .u64_counter("flotilla_spec_verify_steps")
                .with_description(
                    "Sequences' steps that verified a draft; tokens per verify step are \
                     1 + flotilla_spec_accepted_tokens over this",
                )
                .build(),
            draft_passes: m
                .u64_counter("flotilla_spec_draft_model_passes")
                .with_description("Passes of the draft model (one per draft position, all drafting sequences together)")
                .build(),
            draft_pass_tokens: m
                .u64_counter("flotilla_spec_draft_model_tokens")
                .with_description(
                    "Positions the draft model computed (its guesses' and the KV it caught up on)",
                )
                .build(),
            draft_seconds: m
                .f64_counter("flotilla_spec_draft_model_seconds")
                .with_description("Time the draft model's passes took")
                .build(),
            draft_blocks: m
                .u64_gauge("flotilla_spec_draft_kv_blocks")
                .with_description(
                    "KV blocks whose draft-model half holds some sequence's KV (the draft's KV \
                     shares the model's blocks)",
                )
                .build(),
            draft_plan: m
                .f64_gauge("flotilla_spec_draft_model_plan")
                .with_description(
                    "The draft model's cost sum at the last step (part: acceptance, the measured \
                     per-token acceptance; draft_len, the tokens it drafts; predicted_gain, tokens \
                     per second against no draft)",
                )
                .build(),
            registry,
            _provider: provider,
        }
    }

    /// Phase times of one request that produced tokens.
    pub fn record_phases(&self, tier: &str, t: &PhaseTimes) {
        if !self.enabled {
            return;
        }
        let a = [KeyValue::new("tier", tier.to_string())];
        self.queue.record(t.queue_s, &a);
        self.prefill.record(t.prefill_s, &a);
        self.decode.record(t.decode_s, &a);
        if let Some(v) = t.ttft_s {
            self.ttft.record(v, &a);
        }
        if let Some(v) = t.tpot_s {
            self.tpot.record(v, &a);
        }
    }

    /// A request's first token left the HTTP front this long after the
    /// request came in.
    pub fn http_ttft(&self, tier: &str, seconds: f64) {
        if !self.enabled {
            return;
        }
        self.http_ttft
            .record(seconds, &[KeyValue::new("tier", tier.to_string())]);
    }

    /// One request reached a terminal state.
    pub fn request_ended(&self, tier: &str, state: Terminal) {
        if !self.enabled {
            return;
        }
        self.requests.add(
            1,
            &[
                KeyValue::new("tier", tier.to_string()),
                KeyValue::new("state", state.as_str()),
            ],
        );
    }

    /// One request refused before queueing; `kind` says why ("invalid",
    /// "unauthorized", "too_large", "tenant_limit", "queue_full", "unavailable").
    pub fn request_rejected(&self, tier: &str, kind: &str) {
        if !self.enabled {
            return;
        }
        self.request_ended(tier, Terminal::Rejected);
        self.rejected.add(
            1,
            &[
                KeyValue::new("tier", tier.to_string()),
                KeyValue::new("reason", kind.to_string()),
            ],
        );
    }

    /// Token counts of one request.
    pub fn tokens(&self, tier: &str, prompt: u64, generated: u64, cached: u64) {
        if !self.enabled {
            return;
        }
        let a = [KeyValue::new("tier", tier.to_string())];
        self.tokens_in.add(prompt, &a);
        self.tokens_out.add(generated, &a);
        self.cached_tokens.add(cached, &a);
    }

    /// Draft tokens verified for one request and how many were accepted.
    pub fn speculation(&self, tier: &str, drafted: u64, accepted: u64) {
        if !self.enabled || drafted == 0 {
            return;
        }
        let a = [KeyValue::new("tier", tier.to_string())];
        self.draft_tokens.add(drafted, &a);
        self.accepted_tokens.add(accepted, &a);
        self.acceptance.record(accepted as f64 / drafted as f64, &a);
    }

    /// Sequences' steps that verified a draft.
    pub fn verify_steps(&self, n: u64) {
        if self.enabled && n > 0 {
            self.verify_steps.add(n, &[]);
        }
    }

    /// The draft model's passes of one step, and the blocks holding its KV.
    pub fn draft_model(&self, passes: u64, tokens: u64, seconds: f64, blocks: Option<usize>) {
        if !self.enabled {
            return;
        }
        self.draft_passes.add(passes, &[]);
        self.draft_pass_tokens.add(tokens, &[]);
        self.draft_seconds.add(seconds, &[]);
        if let Some(b) = blocks {
            self.draft_blocks.record(b as u64, &[]);
        }
    }

    /// The draft model's cost sum: acceptance, draft length, predicted gain.
    pub fn draft_prediction(&self, acceptance: f64, draft_len: u64, gain: f64) {
        if !self.enabled {
            return;
        }
        for (part, v) in [
            ("acceptance", acceptance),
            ("draft_len", draft_len as f64),
            ("predicted_gain", gain),
        ] {
            self.draft_plan.record(v, &[KeyValue::new("part", part)]);
        }
    }

    /// One sequence preempted.
    pub fn preempted(&self, tier: &str) {
        if !self.enabled {
            return;
        }
        self.preemptions
            .add(1, &[KeyValue::new("tier", tier.to_string())]);
    }

    /// Duration of one engine step.
    pub fn step_time(&self, seconds: f64) {
        if !self.enabled {
            return;
        }
        self.step.record(seconds, &[]);
    }

    /// The scheduler's fitted step cost: seconds fixed, per token and per
    /// output (a token whose logits are computed).
    pub fn step_cost(&self, fixed: f64, per_token: f64, per_output: f64) {
        if !self.enabled {
            return;
        }
        self.step_cost
            .record(fixed, &[KeyValue::new("part", "fixed")]);
        self.step_cost
            .record(per_token, &[KeyValue::new("part", "per_token")]);
        self.step_cost
            .record(per_output, &[KeyValue::new("part", "per_output")]);
    }

    /// KV occupancy now.
    pub fn kv(&self, used: u64, free: u64, cached: u64) {
        if !self.enabled {
            return;
        }
        self.kv_blocks
            .record(used, &[KeyValue::new("state", "used")]);
        self.kv_blocks
            .record(free, &[KeyValue::new("state", "free")]);
        self.kv_blocks
            .record(cached, &[KeyValue::new("state", "cached")]);
    }

    /// A Router's placements since it started and how its prefix index
    /// served them (cumulative; a rate over them is the hit rate).
    pub fn routing(&self, r: &flotilla_proto::RoutingStats) {
        if !self.enabled {
            return;
        }
        for (count, v) in [
            ("placements", r.placements),
            ("cache_candidate", r.cache_candidate),
            ("prompt_blocks", r.prompt_blocks),
            ("matched_blocks", r.matched_blocks),
            ("prefix_snapshots", r.prefix_snapshots),
        ] {
            self.routing.record(v, &[KeyValue::new("count", count)]);
        }
    }

    /// The KV pool's shape: its blocks, their element type (`f16`,
    /// `int8`, ...) and size.
    pub fn kv_cache(&self, dtype: &'static str, blocks: u64, bytes_per_block: u64) {
        if !self.enabled {
            return;
        }
        self.kv_cache.record(
            blocks,
            &[
                KeyValue::new("dtype", dtype),
                KeyValue::new("bytes_per_block", bytes_per_block as i64),
            ],
        );
    }

    /// Queue length and running sequences of one tier now.
    pub fn tier_load(&self, tier: &str, queued: u64, running: u64) {
        if !self.enabled {
            return;
        }
        let a = [KeyValue::new("tier", tier.to_string())];
        self.queued.record(queued, &a);
        self.running.record(running, &a);
    }

    /// The KV offload tier: slots `[held, free]`, blocks moved since the
    /// last call `[spilled, restored, dropped]`, lookups since the last
    /// call `[hit, miss]`.
    pub fn kv_offload(&self, slots: [u32; 2], moved: [u64; 3], lookups: [u64; 2]) {
        if !self.enabled {
            return;
        }
        for (n, state) in slots.into_iter().zip(["held", "free"]) {
            self.offload_slots
                .record(u64::from(n), &[KeyValue::new("state", state)]);
        }
        for (n, kind) in moved.into_iter().zip(["spilled", "restored", "dropped"]) {
            self.offload_moves.add(n, &[KeyValue::new("move", kind)]);
        }
        for (n, result) in lookups.into_iter().zip(["hit", "miss"]) {
            self.offload_lookups
                .add(n, &[KeyValue::new("result", result)]);
        }
    }

    /// Everything in Prometheus text exposition format.
    pub fn render(&self) -> String {
        let mut out = Vec::new();
        // Encoding in-memory families into a Vec cannot fail but for a
        // malformed family, which the exporter does not produce.
        if let Err(e) = TextEncoder::new().encode(&self.registry.gather(), &mut out) {
            return format!("# metrics encoding failed: {e}\n");
        }
        let mut page = String::from_utf8(out).unwrap_or_default();
        if self.enabled {
            page.push_str(&process_memory());
        }
        page
    }
}

/// The process's resident memory now and at its peak, in the names
/// Prometheus's process collectors use (Linux: `/proc/self/status`);
/// empty elsewhere.
fn process_memory() -> String {
    let Ok(status) = std::fs::read_to_string("/proc/self/status") else {
        return String::new();
    };
    let kib = |key: &str| -> Option<u64> {
        let line = status.lines().find(|l| l.starts_with(key))?;
        line[key.len()..].split_whitespace().next()?.parse().ok()
    };
    let mut s = String::new();
    for (key, name, help) in [
        (
            "VmRSS:",
            "process_resident_memory_bytes",
            "Resident memory size in bytes.",
        ),
        (
            "VmHWM:",
            "process_resident_memory_max_bytes",
            "Peak resident memory size in bytes since the process started.",
        ),
    ] {
        if let Some(v) = kib(key) {
            s += &format!(
                "# HELP {name} {help}\n# TYPE {name} gauge\n{name} {}\n",
                v * 1024
            );
        }
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn disabled_metrics_record_nothing() {
        let m = Metrics::disabled();
        m.request_ended("paid", Terminal::Finished);
        m.step_time(0.01);
        m.kv(1, 2, 3);
        let page = m.render();
        assert!(!page.contains("flotilla_"), "{page}");
        // The same calls on live metrics do show.
        let live = Metrics::new().unwrap();
        live.request_ended("paid", Terminal::Finished);
        live.step_time(0.01);
        live.step_cost(0.004, 0.0009, 0.0002);
        let page = live.render();
        assert!(page.contains("flotilla_step_time"));
        assert!(
            page.contains("flotilla_step_cost_seconds{part=\"per_token\""),
            "{page}"
        );
        // Linux: the process's memory, now and at its peak.
        let rss = |name: &str| -> u64 {
            let line = page
                .lines()
                .find(|l| l.starts_with(&format!("{name} ")))
                .unwrap_or_else(|| panic!("{name} in {page}"));
            line.rsplit(' ').next().unwrap().parse().unwrap()
        };
        let (now, peak) = (
            rss("process_resident_memory_bytes"),
            rss("process_resident_memory_max_bytes"),
        );
        assert!(now > 1 << 20 && now <= peak, "{now} {peak}");
    }

    #[test]
    fn renders_histograms_by_tier_and_counters_by_state() {
        let m = Metrics::new().unwrap();
        m.record_phases(
            "paid",
            &PhaseTimes {
                queue_s: 0.01,
                prefill_s: 0.2,
                decode_s: 1.0,
                ttft_s: Some(0.25),
                tpot_s: Some(0.03),
            },
        );
        m.request_ended("paid", Terminal::Finished);
        m.request_rejected("free", "queue_full");
        m.kv(3, 10, 2);
        m.tokens("paid", 12, 5, 4);
        m.speculation("paid", 8, 6);
        // A request that drafted nothing adds no acceptance sample.
        m.speculation("paid", 0, 0);
        let text = m.render();
        for want in [
            "flotilla_time_to_first_token_seconds_bucket{tier=\"paid\",le=\"0.3\"} 1",
            "flotilla_time_per_output_token_seconds_count{tier=\"paid\"} 1",
            "flotilla_requests_total{state=\"finished\",tier=\"paid\"} 1",
            "flotilla_requests_total{state=\"rejected\",tier=\"free\"} 1",
            "flotilla_rejections_total{reason=\"queue_full\",tier=\"free\"} 1",
            "flotilla_kv_blocks{state=\"free\"} 10",
            "flotilla_generation_tokens_total{tier=\"paid\"} 5",
            "flotilla_spec_draft_tokens_total{tier=\"paid\"} 8",
            "flotilla_spec_accepted_tokens_total{tier=\"paid\"} 6",
            "flotilla_spec_acceptance_bucket{tier=\"paid\",le=\"0.7\"} 0",
            "flotilla_spec_acceptance_bucket{tier=\"paid\",le=\"0.8\"} 1",
            "flotilla_spec_acceptance_count{tier=\"paid\"} 1",
        ] {
            assert!(text.contains(want), "missing {want} in\n{text}");
        }
        assert!(
            !text.contains(
                "flotilla_time_to_first_token_seconds_bucket{tier=\"paid\",le=\"0.2\"} 1"
            )
        );
    }
}
