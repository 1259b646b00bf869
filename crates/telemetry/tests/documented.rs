//! Every metric the exporter writes is listed in docs/METRICS.md, every
//! metric named there exists, and the Grafana dashboard under
//! deploy/grafana queries only metrics that exist: a renamed metric fails
//! here, not on an operator's empty panel.

use std::collections::BTreeSet;

use flotilla_telemetry::{Metrics, PhaseTimes, Terminal};

/// The page after one recording of every kind.
fn page() -> String {
    let m = Metrics::new().unwrap();
    m.record_phases(
        "paid",
        &PhaseTimes {
            queue_s: 0.1,
            prefill_s: 0.2,
            decode_s: 1.0,
            ttft_s: Some(0.3),
            tpot_s: Some(0.02),
        },
    );
    m.http_ttft("paid", 0.3);
    m.request_ended("paid", Terminal::Finished);
    m.request_rejected("free", "queue_full");
    m.tokens("paid", 10, 20, 5);
    m.speculation("paid", 8, 6);
    m.preempted("free");
    m.step_time(0.01);
    m.step_cost(0.004, 0.0009, 0.0002);
    m.kv(1, 2, 3);
    m.routing(&flotilla_proto::RoutingStats::default());
    m.kv_cache("f16", 100, 4096);
    m.tier_load("paid", 1, 2);
    m.kv_offload([1, 2], [1, 2, 3], [4, 5]);
    m.render()
}

/// Metric families (`# TYPE` lines) and sample names of a page.
fn names(page: &str) -> (BTreeSet<String>, BTreeSet<String>) {
    let families = page
        .lines()
        .filter_map(|l| l.strip_prefix("# TYPE "))
        .filter_map(|l| l.split(' ').next())
        .map(str::to_string)
        .collect();
    let samples = page
        .lines()
        .filter(|l| !l.starts_with('#') && !l.is_empty())
        .filter_map(|l| l.split(['{', ' ']).next())
        .map(str::to_string)
        .collect();
    (families, samples)
}

/// Metric-like words (`flotilla_...`, `process_...`) in `text`.
fn mentioned(text: &str) -> BTreeSet<String> {
    text.split(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
        .filter(|w| w.starts_with("flotilla_") || w.starts_with("process_"))
        .map(str::to_string)
        .collect()
}

fn repo_file(path: &str) -> String {
    let p = format!("{}/../../{path}", env!("CARGO_MANIFEST_DIR"));
    std::fs::read_to_string(&p).unwrap_or_else(|e| panic!("{p}: {e}"))
}

#[test]
fn every_metric_is_documented_and_every_documented_metric_exists() {
    let (families, samples) = names(&page());
    assert!(families.len() >= 20, "{families:?}");
    let doc = repo_file("docs/METRICS.md");
    for f in &families {
        assert!(
            doc.contains(&format!("`{f}`")),
            "docs/METRICS.md does not list `{f}`"
        );
    }
    for m in mentioned(&doc) {
        assert!(
            families.contains(&m) || samples.contains(&m),
            "docs/METRICS.md names {m}, which no node exports"
        );
    }
}

#[test]
fn the_dashboard_queries_only_metrics_that_exist() {
    let (families, samples) = names(&page());
    let text = repo_file("deploy/grafana/flotilla.json");
    let dash: serde_json::Value = serde_json::from_str(&text).unwrap();
    let panels = dash["panels"].as_array().unwrap();
    assert!(panels.len() >= 8);
    let mut queried = BTreeSet::new();
    for p in panels {
        for t in p["targets"].as_array().unwrap() {
            let expr = t["expr"].as_str().unwrap();
            let m = mentioned(expr);
            assert!(!m.is_empty(), "{expr}");
            queried.extend(m);
        }
    }
    for m in &queried {
        assert!(
            samples.contains(m) || families.contains(m),
            "the dashboard queries {m}, which no node exports"
        );
    }
    // The panels the issue names: TTFT and TPOT by tier, queue, KV use,
    // preemptions, step time.
    for want in [
        "flotilla_time_to_first_token_seconds_bucket",
        "flotilla_time_per_output_token_seconds_bucket",
        "flotilla_queue_length",
        "flotilla_kv_blocks",
        "flotilla_preemptions_total",
        "flotilla_step_time_seconds_bucket",
    ] {
        assert!(queried.contains(want), "no panel reads {want}");
    }
}
