//! Load generator for any OpenAI-compatible server: TTFT, TPOT, throughput, baselines.
//!
//! Drives Flotilla, vLLM-style servers and llama.cpp's `llama-server` alike:
//! a fixed pool of `--concurrency` workers sends exactly `--requests`
//! streaming completions (greedy, `ignore_eos` so each runs to `max_tokens`),
//! times every token as it arrives, and reports throughput and latency
//! percentiles. `--json` saves the report; `--compare` prints new/old ratios
//! against a saved one and flags each figure that moved beyond
//! `--threshold`. Each run also records the server's settings (its
//! `/config`), and samples its `/metrics` (queue and batch per tier, KV
//! use, memory) every `--sample-ms`. `--concurrency 1,4,8` sweeps levels,
//! `--repeat N` runs each level N times and reports the spread, and
//! `--html` writes the whole as one self-contained page with plots.
//!
//! Layout: `sse` (SSE framing) and `request` (one request's timings and error
//! class) are pure state machines; `client` is the tokio/reqwest shell;
//! `report` and `stats` fold outcomes into figures; `server` reads the
//! server's own figures; `sweep` gathers runs; `html` draws them.

mod client;
pub mod html;
pub mod prompt;
mod report;
mod request;
pub mod server;
mod sse;
mod stats;
pub mod sweep;

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, AtomicUsize};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use indicatif::{ProgressBar, ProgressStyle};
use thiserror::Error;
use tokio::task::JoinSet;

pub use report::{
    Cdfs, Flags, Ratio, Report, SloCheck, SloVerdict, SpecCounts, THRESHOLD_DEFAULT, Verdict,
    compare, judge, render, render_with,
};
pub use request::ErrorKind;
pub use stats::{Summary, percentile};
pub use sweep::{Level, Spread, Sweep};

/// Most workers one run may start.
pub const CONCURRENCY_MAX: usize = 4096;
/// Most requests one run may send (their outcomes are kept in memory).
pub const REQUESTS_MAX: usize = 1_000_000;
/// Longest prompt, in words.
pub const PROMPT_WORDS_MAX: usize = 100_000;

/// Flags of a benchmark run against an OpenAI-compatible server.
#[derive(clap::Args, Clone, Debug)]
pub struct BenchArgs {
    /// Base URL of the server (plain http), e.g. http://127.0.0.1:8000.
    #[arg(long)]
    pub url: String,
    /// Requests in flight at once (a fixed pool of this many workers); a
    /// list (`1,4,8,16,32`) sweeps the levels one after another.
    #[arg(long, value_delimiter = ',', default_value = "8")]
    pub concurrency: Vec<usize>,
    /// Open loop instead of --concurrency: send requests at this rate,
    /// requests/s, at Poisson times (seeded by --seed) whatever the
    /// server's pace, as users arrive (at most 4096 in flight). A list
    /// (`1,2,4`) sweeps the rates one after another.
    #[arg(long, value_delimiter = ',')]
    pub rate: Vec<f64>,
    /// Judge each run against these objectives, METRIC_pN=VALUE[,...]
    /// (metrics ttft, tpot; values in s or ms), e.g.
    /// `ttft_p99=1s,tpot_p99=60ms`, over every finished request; the report
    /// says whether each held. A run that loses more than --max-lost of its
    /// requests (refused or failed) misses.
    #[arg(long)]
    pub slo: Option<String>,
    /// Requests refused or failed allowed under --slo, as a fraction.
    #[arg(long, default_value_t = 0.01)]
    pub max_lost: f64,
    /// Run each level this many times (a stability check: the report
    /// gives each figure's spread across the runs).
    #[arg(long, default_value_t = 1)]
    pub repeat: usize,
    /// Before each run, send this many requests one at a time and leave
    /// them out of the figures (a server's first requests after it starts
    /// pay for cold caches and lazy set-up).
    #[arg(long, default_value_t = 0)]
    pub warmup: usize,
    /// Requests to send in all.
    #[arg(long, default_value_t = 64)]
    pub requests: usize,
    /// Tokens to generate per request.
    #[arg(long, default_value_t = 128)]
    pub max_tokens: u32,
    /// When set, each request's max_tokens is drawn (seeded, uniform) from
    /// this value to --max-tokens: a mixed-length workload.
    #[arg(long)]
    pub max_tokens_min: Option<u32>,
    /// Sent as `Authorization: Bearer KEY`; never written to the report.
    #[arg(long)]
    pub api_key: Option<String>,
    /// Model name; default: the first id in the server's /v1/models, else "default".
    #[arg(long)]
    pub model: Option<String>,
    /// Shortest prompt, in words (lengths are uniform over min..=max).
    #[arg(long, default_value_t = 16)]
    pub prompt_len_min: usize,
    /// Longest prompt, in words.
    #[arg(long, default_value_t = 256)]
    pub prompt_len_max: usize,
    /// Seed of the prompts and their lengths.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Send `"ignore_eos": true` so every request generates max_tokens tokens.
    #[arg(long, default_value_t = true, action = clap::ArgAction::Set,
          num_args = 0..=1, default_missing_value = "true")]
    pub ignore_eos: bool,
    /// Use /v1/chat/completions instead of /v1/completions.
    #[arg(long)]
    pub chat: bool,
    /// Limit on each request, send to end of stream, in seconds.
    #[arg(long, default_value_t = 300)]
    pub timeout_s: u64,
    /// Limit on the whole run, in seconds; requests still in flight are cancelled.
    #[arg(long)]
    pub duration_s: Option<u64>,
    /// Drop this fraction of requests (seeded) after 1..=8 generated chunks,
    /// as clients that go away do (soak tests of cancellation).
    #[arg(long, default_value_t = 0.0)]
    pub cancel_fraction: f64,
    /// Constrain every request to the JSON Schema in this file
    /// (`response_format` `json_schema`): a structured-output load.
    #[arg(long)]
    pub json_schema: Option<PathBuf>,
    /// Send the next request at once after a 429/503 instead of waiting as
    /// Retry-After asks (at most 2 s), as OpenAI's clients do by default.
    #[arg(long)]
    pub no_backoff: bool,
    /// Write the report as JSON to this file.
    #[arg(long)]
    pub json: Option<PathBuf>,
    /// Compare with a report saved earlier by --json and print new/old
    /// ratios, flagging figures that moved beyond --threshold.
    #[arg(long)]
    pub compare: Option<PathBuf>,
    /// Fraction a figure may move against --compare's baseline before it
    /// is flagged (0.05: 5 %).
    #[arg(long, default_value_t = THRESHOLD_DEFAULT)]
    pub threshold: f64,
    /// Write the report as one self-contained HTML page with plots
    /// (latency CDFs, throughput against latency across the levels,
    /// tokens/s and queue length over time per tier).
    #[arg(long)]
    pub html: Option<PathBuf>,
    /// Look at the server's /metrics this often during a run, ms.
    #[arg(long, default_value_t = 1000)]
    pub sample_ms: u64,
    /// Free text stored in the report, e.g. "flotilla a1b2c3 cpu".
    #[arg(long, default_value = "")]
    pub label: String,
    /// No progress bar.
    #[arg(long)]
    pub quiet: bool,
}

/// Why a run could not start or its report could not be read or written.
/// Failed requests are not errors: they are counted in the report.
#[derive(Debug, Error)]
pub enum BenchError {
    /// A flag is out of range or the URL is not plain http.
    #[error("invalid arguments: {0}")]
    InvalidArgs(String),
    /// The HTTP client could not be built.
    #[error("building the HTTP client: {0}")]
    Client(#[source] reqwest::Error),
    /// A report file could not be read or written.
    #[error("{}: {source}", path.display())]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    /// A report file does not hold a report.
    #[error("{}: not a bench report: {source}", path.display())]
    BadReport {
        path: PathBuf,
        #[source]
        source: serde_json::Error,
    },
    /// The `--json-schema` file cannot be read or is not JSON.
    #[error("--json-schema {0}")]
    Schema(String),
}

impl BenchArgs {
    /// Checks every limit once, before anything is sent.
    pub fn validate(&self) -> Result<(), BenchError> {
        let bad = |m: String| Err(BenchError::InvalidArgs(m));
        match reqwest::Url::parse(&self.url) {
            Ok(u) if u.scheme() == "http" && u.has_host() => {}
            Ok(_) => {
                return bad(format!(
                    "--url {}: only http:// URLs are supported",
                    self.url
                ));
            }
            Err(e) => return bad(format!("--url {}: {e}", self.url)),
        }
        if self.concurrency.is_empty()
            || self
                .concurrency
                .iter()
                .any(|c| !(1..=CONCURRENCY_MAX).contains(c))
        {
            return bad(format!(
                "--concurrency must be one level or a list of levels, each in 1..={CONCURRENCY_MAX}"
            ));
        }
        if self.warmup > 1000 {
            return bad("--warmup must be at most 1000".into());
        }
        if !(1..=100).contains(&self.repeat) {
            return bad("--repeat must be in 1..=100".into());
        }
        if !(0.0..10.0).contains(&self.threshold) {
            return bad("--threshold must be a fraction in 0..10 (0.05 is 5 %)".into());
        }
        if !(50..=60_000).contains(&self.sample_ms) {
            return bad("--sample-ms must be in 50..=60000".into());
        }
        if !(1..=REQUESTS_MAX).contains(&self.requests) {
            return bad(format!("--requests must be in 1..={REQUESTS_MAX}"));
        }
        if self
            .max_tokens_min
            .is_some_and(|m| m == 0 || m > self.max_tokens)
        {
            return bad("--max-tokens-min must be in 1..=--max-tokens".into());
        }
        if self.max_tokens == 0 {
            return bad("--max-tokens must be at least 1".into());
        }
        if self.prompt_len_min == 0
            || self.prompt_len_min > self.prompt_len_max
            || self.prompt_len_max > PROMPT_WORDS_MAX
        {
            return bad(format!(
                "--prompt-len-min/--prompt-len-max must satisfy 1 <= min <= max <= {PROMPT_WORDS_MAX}"
            ));
        }
        if self.timeout_s == 0 {
            return bad("--timeout-s must be at least 1".into());
        }
        if !(0.0..=1.0).contains(&self.cancel_fraction) {
            return bad("--cancel-fraction must be in 0..=1".into());
        }
        if self.duration_s == Some(0) {
            return bad("--duration-s must be at least 1".into());
        }
        if self
            .rate
            .iter()
            .any(|r| !(r.is_finite() && *r > 0.0 && *r <= 1e6))
        {
            return bad(
                "--rate must be one rate or a list, each in (0, 1000000] requests/s".into(),
            );
        }
        if !self.rate.is_empty() && self.concurrency.len() > 1 {
            return bad("sweep --rate or --concurrency, not both".into());
        }
        self.objectives()?;
        if !(0.0..1.0).contains(&self.max_lost) {
            return bad("--max-lost must be a fraction in [0, 1)".into());
        }
        Ok(())
    }

    /// The `--slo` objectives (none without it).
    fn objectives(&self) -> Result<Vec<flotilla_exec::slo::Objective>, BenchError> {
        match &self.slo {
            None => Ok(Vec::new()),
            Some(s) => flotilla_exec::slo::parse_any_tier(s).map_err(BenchError::InvalidArgs),
        }
    }

    /// The loads to run, in order: each rate (open loop, at most the first
    /// --concurrency in flight) or each concurrency.
    fn loads(&self) -> Vec<Load> {
        if self.rate.is_empty() {
            self.concurrency.iter().map(|&c| Load::Closed(c)).collect()
        } else {
            self.rate
                .iter()
                .map(|&r| Load::Open(r, CONCURRENCY_MAX))
                .collect()
        }
    }

    fn endpoint(&self) -> &'static str {
        if self.chat {
            "/v1/chat/completions"
        } else {
            "/v1/completions"
        }
    }

    /// Whether the run is a sweep (several levels or repeats) rather than
    /// one report.
    pub fn is_sweep(&self) -> bool {
        self.loads().len() > 1 || self.repeat > 1
    }

    fn flags(&self, load: Load) -> Flags {
        Flags {
            concurrency: load.in_flight(),
            rate: load.rate(),
            requests: self.requests,
            max_tokens: self.max_tokens,
            max_tokens_min: self.max_tokens_min,
            prompt_len_min_words: self.prompt_len_min,
            prompt_len_max_words: self.prompt_len_max,
            seed: self.seed,
            ignore_eos: self.ignore_eos,
            chat: self.chat,
            timeout_s: self.timeout_s,
            duration_s: self.duration_s,
            cancel_fraction: self.cancel_fraction,
            json_schema: self.json_schema.as_ref().map(|p| p.display().to_string()),
        }
    }
}

fn progress_bar(total: usize, quiet: bool) -> ProgressBar {
    if quiet {
        return ProgressBar::hidden();
    }
    // Draws to stderr, and draws nothing when stderr is not a terminal.
    let pb = ProgressBar::new(total as u64);
    if let Ok(style) =
        ProgressStyle::with_template("{elapsed_precise} [{bar:40}] {pos}/{len} requests, {msg}")
    {
        pb.set_style(style.progress_chars("=> "));
    }
    pb.set_message("ok 0, failed 0");
    pb
}

/// How requests are sent.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Load {
    /// A fixed pool of this many workers, each sending its next request
    /// when its last ends.
    Closed(usize),
    /// Requests/s at Poisson times, at most this many in flight.
    Open(f64, usize),
}

impl Load {
    fn in_flight(self) -> usize {
        match self {
            Load::Closed(c) | Load::Open(_, c) => c,
        }
    }

    fn rate(self) -> Option<f64> {
        match self {
            Load::Closed(_) => None,
            Load::Open(r, _) => Some(r),
        }
    }

    fn name(self) -> String {
        match self {
            Load::Closed(c) => format!("concurrency {c}"),
            Load::Open(r, _) => format!("rate {r} req/s"),
        }
    }
}

/// Runs the benchmark at the first level (`--rate` or `--concurrency`):
/// exactly `--requests` requests (fewer if `--duration-s` runs out).
pub async fn run(args: &BenchArgs) -> Result<Report, BenchError> {
    args.validate()?;
    run_level(args, args.loads()[0]).await
}

/// A task that is aborted when this is dropped (a run that ends by a panic
/// or is itself dropped leaves nothing polling the server).
struct AbortOnDrop(tokio::task::JoinHandle<()>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// Every level of `--concurrency`, each `--repeat` times, in order.
pub async fn run_sweep(args: &BenchArgs) -> Result<Sweep, BenchError> {
    args.validate()?;
    let mut levels = Vec::new();
    for load in args.loads() {
        let mut runs = Vec::new();
        for i in 0..args.repeat {
            if !args.quiet && args.is_sweep() {
                eprintln!(
                    "flotilla-bench: {}, run {} of {}",
                    load.name(),
                    i + 1,
                    args.repeat
                );
            }
            runs.push(run_level(args, load).await?);
        }
        levels.push(Level::new(load.name(), runs));
    }
    Ok(Sweep {
        label: args.label.clone(),
        levels,
    })
}

/// One run at `load`.
async fn run_level(args: &BenchArgs, load: Load) -> Result<Report, BenchError> {
    let base = args.url.trim_end_matches('/');
    let objectives = args.objectives()?;
    let timeout = Duration::from_secs(args.timeout_s);
    // No proxy: a benchmark measures the server, not a proxy picked up from
    // the environment.
    // A fresh connection per request: a server that closes an idle
    // keep-alive connection (llama-server does) would otherwise fail the next
    // POST on it, which is not retried; a loopback connect costs ~0.1 ms.
    let client = reqwest::Client::builder()
        .no_proxy()
        .tcp_nodelay(true)
        .pool_max_idle_per_host(0)
        .build()
        .map_err(BenchError::Client)?;
    let server = client::discover(
        &client,
        base,
        args.api_key.as_deref(),
        args.model.as_deref(),
        timeout,
    )
    .await;
    let meta = report::RunMeta {
        label: args.label.clone(),
        model: server.id.clone(),
        server_url: args.url.clone(),
        endpoint: args.endpoint().to_owned(),
        quantisation: server.quantisation,
        flags: args.flags(load),
        prompt_distribution: prompt::describe(args.prompt_len_min, args.prompt_len_max),
    };
    let json_schema = match &args.json_schema {
        None => None,
        Some(p) => {
            let text = std::fs::read_to_string(p)
                .map_err(|e| BenchError::Schema(format!("{}: {e}", p.display())))?;
            let v: serde_json::Value = serde_json::from_str(&text)
                .map_err(|e| BenchError::Schema(format!("{}: not JSON: {e}", p.display())))?;
            Some(v)
        }
    };
    let pool = Arc::new(client::Pool {
        client,
        endpoint_url: format!("{base}{}", args.endpoint()),
        api_key: args.api_key.clone(),
        model: server.id,
        chat: args.chat,
        max_tokens: args.max_tokens,
        max_tokens_min: args.max_tokens_min.unwrap_or(args.max_tokens),
        ignore_eos: args.ignore_eos,
        seed: args.seed,
        words_min: args.prompt_len_min,
        words_max: args.prompt_len_max,
        timeout,
        cancel_fraction: args.cancel_fraction,
        json_schema,
        // An open loop's next request does not wait for this one's answer.
        backoff: !args.no_backoff && matches!(load, Load::Closed(_)),
        requests: args.requests,
        next: AtomicUsize::new(0),
        outcomes: Mutex::new(Vec::with_capacity(args.requests.min(1 << 16))),
        chunks: AtomicU64::new(0),
        ok: AtomicU64::new(0),
        failed: AtomicU64::new(0),
        progress: progress_bar(args.requests, args.quiet),
    });

    let key = args.api_key.as_deref();
    // Warm-up requests: other prompts than the run's (indices past it), one
    // at a time, not counted.
    for i in 0..args.warmup {
        let _ = pool.one((args.requests + i) as u64).await;
    }
    pool.chunks.store(0, std::sync::atomic::Ordering::Relaxed);
    let config = client::server_config(&pool.client, base, key).await;
    let spec_before = client::spec_counts(&pool.client, base, key).await;
    let start = Instant::now();
    // The server's own figures, looked at every --sample-ms while the run lasts.
    let samples: Arc<Mutex<Vec<server::Sample>>> = Arc::default();
    let mut sampler = AbortOnDrop({
        let (pool, samples) = (Arc::clone(&pool), Arc::clone(&samples));
        let (base, key) = (base.to_owned(), args.api_key.clone());
        let every = Duration::from_millis(args.sample_ms);
        tokio::spawn(async move {
            loop {
                if let Some(page) = client::metrics_page(&pool.client, &base, key.as_deref()).await
                {
                    let chunks = pool.chunks.load(std::sync::atomic::Ordering::Relaxed);
                    let s = server::sample(&page, start.elapsed().as_secs_f64(), chunks);
                    samples.lock().unwrap_or_else(|e| e.into_inner()).push(s);
                }
                tokio::time::sleep(every).await;
            }
        })
    });
    // A JoinSet aborts its tasks when shut down or dropped: nothing outlives the run.
    let mut set = JoinSet::new();
    match load {
        Load::Closed(concurrency) => {
            for _ in 0..concurrency.min(args.requests) {
                let pool = Arc::clone(&pool);
                set.spawn(async move { pool.worker().await });
            }
        }
        Load::Open(rate, cap) => {
            let pool = Arc::clone(&pool);
            let seed = args.seed;
            set.spawn(async move { pool.open_loop(rate, cap, seed).await });
        }
    }
    let all_done = async {
        while let Some(joined) = set.join_next().await {
            if let Err(e) = joined
                && e.is_panic()
            {
                std::panic::resume_unwind(e.into_panic());
            }
        }
    };
    match args.duration_s {
        Some(d) => {
            let _capped = tokio::time::timeout(Duration::from_secs(d), all_done).await;
        }
        None => all_done.await,
    }
    let wall = start.elapsed();
    sampler.0.abort();
    let _ = (&mut sampler.0).await;
    set.shutdown().await;
    pool.progress.finish_and_clear();
    let last_page = client::metrics_page(&pool.client, base, key).await;
    let mut timeline = std::mem::take(&mut *samples.lock().unwrap_or_else(|e| e.into_inner()));
    if let Some(page) = &last_page {
        let chunks = pool.chunks.load(std::sync::atomic::Ordering::Relaxed);
        timeline.push(server::sample(page, wall.as_secs_f64(), chunks));
    }

    let outcomes = std::mem::take(&mut *pool.outcomes.lock().unwrap_or_else(|e| e.into_inner()));
    let started = pool.started();
    assert!(outcomes.len() <= started && started <= args.requests);
    let cancelled = (started - outcomes.len()) as u64;
    let mut report = Report::build(meta, &outcomes, cancelled, wall);
    // Counted when each request ends: every one has.
    let spec_after = last_page
        .as_deref()
        .and_then(report::SpecCounts::from_metrics);
    report.speculation = spec_before
        .zip(spec_after)
        .map(|(b, a)| report::SpecCounts::between(b, a));
    report.server = server::summarise(config, last_page.as_deref(), &timeline);
    report.timeline = timeline;
    if args.slo.is_some() {
        report.slo = Some(report::judge(&outcomes, &objectives, args.max_lost));
    }
    Ok(report)
}

/// Prints the report as a table to stdout, with new/old ratios against
/// `baseline` when given.
pub fn print_report(r: &Report, baseline: Option<&Report>) {
    print!("{}", render(r, baseline));
}

/// Reads a report saved by [`save_report`] (or `--json`).
pub fn load_report(path: &Path) -> Result<Report, BenchError> {
    let text = std::fs::read_to_string(path).map_err(|source| BenchError::Io {
        path: path.into(),
        source,
    })?;
    serde_json::from_str(&text).map_err(|source| BenchError::BadReport {
        path: path.into(),
        source,
    })
}

/// Reads a baseline for `--compare`: a saved report, or every run of a
/// saved sweep.
pub fn load_baseline(path: &Path) -> Result<Vec<Report>, BenchError> {
    match load_report(path) {
        Ok(r) => Ok(vec![r]),
        Err(BenchError::BadReport { .. }) => {
            let text = std::fs::read_to_string(path).map_err(|source| BenchError::Io {
                path: path.into(),
                source,
            })?;
            let s: Sweep = serde_json::from_str(&text).map_err(|source| BenchError::BadReport {
                path: path.into(),
                source,
            })?;
            Ok(s.levels.into_iter().flat_map(|l| l.runs).collect())
        }
        Err(e) => Err(e),
    }
}

/// Writes `r` to `path` as pretty JSON.
pub fn save_report(path: &Path, r: &Report) -> Result<(), BenchError> {
    // Serialising plain data to a string cannot fail.
    let text = serde_json::to_string_pretty(r).unwrap_or_default();
    std::fs::write(path, text + "\n").map_err(|source| BenchError::Io {
        path: path.into(),
        source,
    })
}

/// What the `bench` command does: loads `--compare` first (so a bad path
/// fails before the run), runs every level, prints each run's table (with
/// the baseline's ratios) and a sweep's summary, and writes `--json` (one
/// report, or the sweep) and `--html`.
pub async fn run_and_report(args: &BenchArgs) -> Result<Sweep, BenchError> {
    args.validate()?;
    let baseline = args
        .compare
        .as_deref()
        .map(load_baseline)
        .transpose()?
        .unwrap_or_default();
    let sweep = run_sweep(args).await?;
    for level in &sweep.levels {
        for r in &level.runs {
            // A sweep's baseline: its run at the same concurrency, if any.
            let old = baseline
                .iter()
                .find(|b| b.flags.concurrency == r.flags.concurrency)
                .or(baseline.first());
            print!("{}", render_with(r, old, args.threshold));
        }
    }
    if args.is_sweep() {
        print!("{}", sweep.render());
    }
    if let Some(path) = &args.json {
        if args.is_sweep() {
            write_json(path, &sweep)?;
        } else {
            save_report(path, &sweep.levels[0].runs[0])?;
        }
    }
    if let Some(path) = &args.html {
        write_text(path, &html::page(&sweep))?;
    }
    Ok(sweep)
}

fn write_text(path: &Path, text: &str) -> Result<(), BenchError> {
    std::fs::write(path, text).map_err(|source| BenchError::Io {
        path: path.into(),
        source,
    })
}

fn write_json<T: serde::Serialize>(path: &Path, v: &T) -> Result<(), BenchError> {
    // Serialising plain data to a string cannot fail.
    let text = serde_json::to_string_pretty(v).unwrap_or_default();
    write_text(path, &(text + "\n"))
}

/// Reads saved reports (single runs or sweeps) and gathers them into one
/// sweep, a level per file in the order given, named by each report's
/// label (else its file name): how a sweep over a server flag is put
/// together from runs against differently started servers.
pub fn gather(paths: &[PathBuf]) -> Result<Sweep, BenchError> {
    let mut levels = Vec::new();
    for p in paths {
        let text = std::fs::read_to_string(p).map_err(|source| BenchError::Io {
            path: p.clone(),
            source,
        })?;
        if let Ok(mut s) = serde_json::from_str::<Sweep>(&text) {
            // One level repeated (a run of `--repeat N`): named by its label.
            if let [one] = &mut s.levels[..]
                && !s.label.is_empty()
            {
                one.name = s.label.clone();
            }
            levels.extend(s.levels);
            continue;
        }
        let r: Report = serde_json::from_str(&text).map_err(|source| BenchError::BadReport {
            path: p.clone(),
            source,
        })?;
        let name = if r.label.is_empty() {
            p.file_stem()
                .map_or_else(String::new, |s| s.to_string_lossy().into_owned())
        } else {
            r.label.clone()
        };
        levels.push(Level::new(name, vec![r]));
    }
    Ok(Sweep {
        label: String::new(),
        levels,
    })
}

/// `flotilla bench-report`: gathers saved reports into one sweep, prints
/// its summary and writes `--html` / `--json`.
pub fn report_main(
    paths: &[PathBuf],
    html_out: Option<&Path>,
    json_out: Option<&Path>,
) -> Result<Sweep, BenchError> {
    if paths.is_empty() {
        return Err(BenchError::InvalidArgs(
            "name at least one report saved by `flotilla bench --json`".into(),
        ));
    }
    let sweep = gather(paths)?;
    print!("{}", sweep.render());
    if let Some(p) = html_out {
        write_text(p, &html::page(&sweep))?;
    }
    if let Some(p) = json_out {
        write_json(p, &sweep)?;
    }
    Ok(sweep)
}

/// Entry point of `flotilla bench`: [`run_and_report`] without the report.
/// (The binary wraps the error: `Ok(rt.block_on(flotilla_bench::main(args))?)`.)
pub async fn main(args: &BenchArgs) -> Result<(), BenchError> {
    run_and_report(args).await.map(|_| ())
}
