//! `flotilla`: the one binary: `serve`, `bench`, `generate`, `bench-model`,
//! `fetch-model`.

mod alloc;
mod bench;
mod memory;
mod node;
mod plan;
mod serve;
mod stage;
mod transport_bench;

use std::io::Write;
use std::path::PathBuf;
use std::time::Instant;

use anyhow::{Context, Result, bail};
use clap::{Parser, Subcommand};
use flotilla_gguf::GgufFile;
use flotilla_model::arch::ModelConfig;
use flotilla_model::generate::{Driver, Finish, Request};
use flotilla_model::kernels::Kernel;
use flotilla_model::{CpuConfig, CpuExecutor, KvDtype, SamplingParams};
use flotilla_text::TextSide;
use flotilla_text::chat::ChatMessage;

/// mimalloc instead of the system allocator: the engine and the simulator
/// allocate per message and per step (the simulator spent ~21% of its
/// time in glibc's malloc and free).
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

#[derive(Parser)]
#[command(name = "flotilla", version, about = "Flotilla: an LLM serving cluster")]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

/// Options shared by the commands that load a model.
#[derive(clap::Args, Clone)]
struct ModelArgs {
    /// A model by name (smollm2-135m, gemma3-270m, qwen2.5-coder-0.5b,
    /// qwen2.5-coder-1.5b: fetched on first use) or
    /// a GGUF file's path; default: smollm2-135m (SmolLM2-135M-Instruct, Q4_1).
    /// Config: `[model] model`.
    #[arg(long)]
    model: Option<PathBuf>,
    /// Compute threads (default: all cores). Config: `[model] threads`.
    #[arg(long)]
    threads: Option<usize>,
    /// KV cache element type: f16 (default), f32, or int8 (8-bit values
    /// with an f16 scale per 32, as llama.cpp's q8_0: 1.9x the blocks of
    /// f16 in the same memory). Config: `[engine] kv_cache_dtype`.
    #[arg(long)]
    kv_cache_dtype: Option<String>,
    /// Tokens per KV block.
    #[arg(long, default_value_t = 16)]
    block_size: usize,
    /// Matrix kernels: auto (the best this CPU has; the default), amx
    /// (AVX-512 VNNI with AMX tiles for the products of many tokens: the
    /// same results), avx512 (AVX-512 VNNI), avx2, scalar, or exact (f32
    /// reference, slow). Config: `[model] kernel`.
    #[arg(long)]
    kernel: Option<String>,
    /// Where the model runs: cpu (the default), or cuda / cuda:N (an NVIDIA
    /// GPU; f16 or int8 KV cache, sized by --kv-cache-fraction of the device
    /// memory left after the weights). Config: `[model] device`.
    #[arg(long)]
    device: Option<flotilla_cuda::Device>,
    /// Convert the weights at every load and write no layout cache (by
    /// default the CPU backend writes the weights in its kernels' layouts to
    /// <cache>/layouts after the first load and maps them from there after).
    #[arg(long)]
    no_layout_cache: bool,
    /// Keep Q4_K and Q6_K weights at the file's size (AVX2 and AVX-512 VNNI kernels):
    /// less memory and fewer bytes read a decoded token, more instructions
    /// a weight. Faster where decode is bound by memory bandwidth, slower
    /// where the core is the limit; by default they are widened (Q4_1, Q8_0).
    #[arg(long)]
    compact_weights: bool,
}

/// `--model`: a known name (fetched into the cache on first use, with a
/// progress bar and checksum), else a GGUF file's path; none is the default.
fn resolve_model(model: Option<&std::path::Path>) -> Result<PathBuf> {
    use flotilla_hub::{self as hub, KNOWN_MODELS, ModelSource};
    let Some(p) = model else {
        return Ok(hub::ensure_default_model(true)?);
    };
    if let Some(src) = p.to_str().and_then(ModelSource::by_name) {
        return Ok(hub::ensure(&src, &hub::cache_dir()?, true)?);
    }
    if !p.is_file() {
        bail!(
            "--model {}: no such file, and not a known model name ({})",
            p.display(),
            KNOWN_MODELS.join(", ")
        );
    }
    Ok(p.to_path_buf())
}

impl ModelArgs {
    fn path(&self) -> Result<PathBuf> {
        resolve_model(self.model.as_deref())
    }

    /// These flags over a config's `[model]` table: a flag given wins.
    fn with_config(&self, m: &flotilla_config::ModelSection) -> Result<ModelArgs> {
        let mut a = self.clone();
        if a.model.is_none() {
            a.model = m.model.as_ref().map(PathBuf::from);
        }
        if a.threads.is_none() {
            a.threads = m.threads;
        }
        if a.kernel.is_none() {
            a.kernel = m.kernel.clone();
        }
        if a.device.is_none()
            && let Some(d) = &m.device
        {
            a.device = Some(
                d.parse()
                    .map_err(|why| anyhow::anyhow!("[model] device: {why}"))?,
            );
        }
        Ok(a)
    }

    /// The device: the flag's or config's, else the CPU.
    fn device(&self) -> flotilla_cuda::Device {
        self.device.unwrap_or(flotilla_cuda::Device::Cpu)
    }

    /// The kernel's name as given, else `auto`.
    fn kernel_name(&self) -> &str {
        self.kernel.as_deref().unwrap_or("auto")
    }

    fn cpu_config(&self, num_blocks: usize, max_batch_tokens: usize) -> Result<CpuConfig> {
        let kernel = Kernel::parse(self.kernel_name()).map_err(anyhow::Error::msg)?;
        let kv_dtype = match &self.kv_cache_dtype {
            Some(d) => {
                KvDtype::parse(d).map_err(|why| anyhow::anyhow!("--kv-cache-dtype: {why}"))?
            }
            None => KvDtype::default(),
        };
        let mut c = CpuConfig {
            kernel,
            kv_dtype,
            block_size: self.block_size,
            num_blocks,
            max_batch_tokens,
            layout_cache: if self.no_layout_cache {
                None
            } else {
                flotilla_hub::cache_dir().ok().map(|d| d.join("layouts"))
            },
            compact_k_quants: self.compact_weights,
            ..Default::default()
        };
        if let Some(t) = self.threads {
            if t == 0 {
                bail!("--threads must be at least 1");
            }
            c.threads = t;
        }
        Ok(c)
    }
}

#[derive(Subcommand)]
enum Cmd {
    /// Generate text from a prompt; only the generated text goes to stdout.
    Generate {
        /// The prompt.
        #[arg(long)]
        prompt: String,
        /// Apply the model's chat template to the prompt as a user message.
        #[arg(long)]
        chat: bool,
        /// System message (with --chat).
        #[arg(long)]
        system: Option<String>,
        /// Most tokens to generate.
        #[arg(long, default_value_t = 128)]
        max_tokens: usize,
        /// Sampling temperature; 0 is greedy.
        #[arg(long, default_value_t = 0.0)]
        temperature: f32,
        /// Nucleus sampling threshold.
        #[arg(long, default_value_t = 1.0)]
        top_p: f32,
        /// Keep only the k most likely tokens (0: off).
        #[arg(long, default_value_t = 0)]
        top_k: u32,
        /// Random seed.
        #[arg(long, default_value_t = 0)]
        seed: u64,
        /// Keep generating past end-of-sequence tokens.
        #[arg(long)]
        ignore_eos: bool,
        #[command(flatten)]
        model: ModelArgs,
    },
    /// Serve the model over an OpenAI-compatible HTTP API (one node, all roles).
    Serve(serve::ServeArgs),
    /// Load-test any OpenAI-compatible server with streaming requests.
    Bench(flotilla_bench::BenchArgs),
    /// Gather reports saved by `bench --json` (one per server setting, for
    /// a sweep over a server flag) into one report: a table, and with
    /// --html a page with plots.
    BenchReport {
        /// Saved reports (single runs or sweeps), one level each, in order.
        reports: Vec<PathBuf>,
        /// Write the HTML page here.
        #[arg(long)]
        html: Option<PathBuf>,
        /// Write the gathered sweep as JSON here.
        #[arg(long)]
        json: Option<PathBuf>,
    },
    /// Benchmark the CPU backend (pp512, tg128, batched decode) beside llama.cpp.
    BenchModel(bench::BenchArgs),
    /// Measure how an int8 (or f32) KV cache changes the model's next-token
    /// distributions against f16, beside llama.cpp's on the same text.
    BenchKvQuality(bench::KvQualityArgs),
    /// Compare the model's next-token distributions with llama.cpp's on the
    /// same tokens (KL, top-1 agreement), beside llama.cpp's own q8_0 KV figure.
    BenchLogits(bench::LogitsArgs),
    /// Download a model into the cache (if needed) and print its path.
    FetchModel {
        /// smollm2-135m (the default) or gemma3-270m.
        #[arg(long)]
        model: Option<PathBuf>,
    },
    /// Run one node of a multi-node cluster (router or engine), named in --config.
    #[command(
        mut_arg("host", |a| a.hide(true)),
        mut_arg("port", |a| a.hide(true)),
        mut_arg("no_auth", |a| a.hide(true))
    )]
    Node(node::NodeArgs),
    /// Run every node of a cluster config as its own process on this machine.
    Cluster(node::ClusterArgs),
    /// Measure the QUIC transport between two nodes on loopback.
    BenchTransport(transport_bench::TransportBenchArgs),
    /// Create the cluster CA and node certificates.
    #[command(subcommand)]
    Certs(node::CertsCmd),
    /// Find the cheapest cluster that serves a workload within its latency
    /// objectives, from fast-mode simulations.
    Plan(plan::PlanArgs),
    /// Run a cluster scenario (simulations/*.toml) as a deterministic
    /// simulation: the real actors under a simulated clock, network and GPUs.
    Simulate {
        /// The scenario file.
        scenario: std::path::PathBuf,
        /// The run's seed: the same scenario and seed replay byte for byte.
        #[arg(long, default_value_t = 1)]
        seed: u64,
        /// Run this many seeds, from --seed up (a swarm: every failing
        /// seed is listed with the first invariant it broke).
        #[arg(long, default_value_t = 1)]
        seeds: u64,
        /// Threads for a swarm (0: one per core).
        #[arg(long, default_value_t = 0)]
        jobs: usize,
        /// In a swarm, print a line for every passing seed too.
        #[arg(long)]
        verbose: bool,
        /// Fast mode (as `[sim] mode = "fast"`): the same actors make the
        /// same decisions, steady decode runs as one plan between them, and
        /// every request's outcome, TTFT, TPOT and finish equal the exact
        /// mode's; refused, with the reason, for a scenario it cannot honour.
        #[arg(long)]
        fast: bool,
        /// Run the seed both ways, exact and fast, and compare them request
        /// by request (the worst request of each figure); exit status 1 if
        /// fast mode strays beyond 1%.
        #[arg(long, conflicts_with = "seeds")]
        compare: bool,
    },
}

fn main() {
    if let Err(e) = run() {
        eprintln!("error: {e:#}");
        std::process::exit(1);
    }
}

fn run() -> Result<()> {
    match Cli::parse().cmd {
        Cmd::Generate {
            prompt,
            chat,
            system,
            max_tokens,
            temperature,
            top_p,
            top_k,
            seed,
            ignore_eos,
            model,
        } => {
            let params = SamplingParams {
                temperature,
                top_p,
                top_k,
                seed,
                ..Default::default()
            };
            params.validate().map_err(anyhow::Error::msg)?;
            generate(
                &model, &prompt, chat, system, max_tokens, params, ignore_eos,
            )
        }
        Cmd::Serve(args) => serve::run(args),
        Cmd::Bench(args) => load_test(&args),
        Cmd::BenchReport {
            reports,
            html,
            json,
        } => {
            flotilla_bench::report_main(&reports, html.as_deref(), json.as_deref())?;
            Ok(())
        }
        Cmd::BenchModel(args) => bench::run(&args),
        Cmd::BenchKvQuality(args) => bench::run_kv_quality(&args),
        Cmd::BenchLogits(args) => bench::run_logits(&args),
        Cmd::Node(args) => node::run(args),
        Cmd::Cluster(args) => node::cluster(args),
        Cmd::Certs(cmd) => node::certs(cmd),
        Cmd::BenchTransport(args) => transport_bench::run(&args),
        Cmd::Simulate {
            scenario,
            seed,
            seeds,
            jobs,
            verbose,
            fast,
            compare,
        } => simulate(&scenario, seed, seeds, jobs, verbose, fast, compare),
        Cmd::Plan(args) => plan::run(&args),
        Cmd::FetchModel { model } => {
            println!("{}", resolve_model(model.as_deref())?.display());
            Ok(())
        }
    }
}

/// Log times in the paused clock of a simulation (ms since the process
/// started; each seed's runtime starts its clock there).
struct SimTime(tokio::time::Instant);

impl tracing_subscriber::fmt::time::FormatTime for SimTime {
    fn format_time(&self, w: &mut tracing_subscriber::fmt::format::Writer<'_>) -> std::fmt::Result {
        let t = tokio::time::Instant::now().saturating_duration_since(self.0);
        write!(w, "{:>10.3}ms", t.as_secs_f64() * 1e3)
    }
}

fn simulate(
    path: &std::path::Path,
    seed: u64,
    seeds: u64,
    jobs: usize,
    verbose: bool,
    fast: bool,
    compare: bool,
) -> Result<()> {
    let mut sc = flotilla_sim::Scenario::load(path)?;
    if fast {
        sc.sim.mode = flotilla_sim::SimMode::Fast;
    }
    if sc.sim.mode == flotilla_sim::SimMode::Fast
        && let Some(why) = sc.fast_refusal()
    {
        bail!("{}: {why}", path.display());
    }
    // Replaying a seed with FLOTILLA_LOG=debug shows what the actors did.
    if let Ok(filter) = tracing_subscriber::EnvFilter::try_from_env("FLOTILLA_LOG") {
        tracing_subscriber::fmt()
            .with_env_filter(filter)
            .with_writer(std::io::stderr)
            // Colour only on a terminal: `flotilla cluster` sends each node's
            // stderr to a log file, where escape codes are noise.
            .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
            .with_timer(SimTime(tokio::time::Instant::now()))
            .init();
    }
    if seeds == 0 {
        bail!("--seeds must be at least 1");
    }
    if compare {
        let c = flotilla_sim::compare(&sc, seed)?;
        println!("{} seed {seed}, exact against fast", path.display());
        println!("{}", c.exact);
        println!("{c}");
        if !c.equal() {
            bail!("fast mode strays from the exact mode (above)");
        }
        return Ok(());
    }
    if seeds == 1 {
        let t0 = std::time::Instant::now();
        let report = flotilla_sim::run(&sc, seed)?;
        let wall = t0.elapsed().as_secs_f64();
        let mode = match sc.sim.mode {
            flotilla_sim::SimMode::Fast => ", fast mode",
            flotilla_sim::SimMode::Exact => "",
        };
        println!("{} seed {seed}{mode}", path.display());
        println!("{report}");
        for (a, b) in &report.exact_spans {
            println!("fast mode ran step by step from {a:.1} s to {b:.1} s (a fault)");
        }
        println!(
            "wall {wall:.2} s for {:.1} simulated s ({:.0}x), {:.0} trace events/s",
            report.sim_s,
            report.sim_s / wall.max(1e-9),
            report.events as f64 / wall.max(1e-9)
        );
        return Ok(());
    }
    let jobs = match jobs {
        0 => std::thread::available_parallelism().map_or(1, usize::from),
        n => n,
    };
    let last = seed.saturating_add(seeds - 1);
    println!(
        "{}: seeds {seed}..={last} on {jobs} threads",
        path.display()
    );
    let t0 = std::time::Instant::now();
    let done = std::sync::atomic::AtomicU64::new(0);
    let swarm = flotilla_sim::swarm(&sc, seed, seeds, jobs, &|r| {
        let n = done.fetch_add(1, std::sync::atomic::Ordering::Relaxed) + 1;
        match &r.result {
            Err(e) => println!("FAIL seed {}: {e}", r.seed),
            Ok(rep) if verbose => println!(
                "ok   seed {}: {:.1} output tok/s, {} events, hash {:016x}, {:.2} s",
                r.seed,
                rep.throughput(),
                rep.events,
                rep.trace_hash,
                r.wall_s
            ),
            Ok(_) => {}
        }
        if n.is_multiple_of(100) {
            eprintln!("{n}/{seeds} seeds run");
        }
    });
    let wall = t0.elapsed().as_secs_f64();
    let failed: Vec<u64> = swarm.failures().map(|r| r.seed).collect();
    println!(
        "{} seeds, {} failing{}; wall {wall:.1} s for {:.0} simulated s ({:.0}x over {jobs} threads)",
        seeds,
        failed.len(),
        if failed.is_empty() {
            String::new()
        } else {
            format!(
                ": {}",
                failed
                    .iter()
                    .map(u64::to_string)
                    .collect::<Vec<_>>()
                    .join(" ")
            )
        },
        swarm.sim_s(),
        swarm.sim_s() / wall.max(1e-9)
    );
    let t = swarm.totals();
    println!(
        "requests over the passing seeds: {} sent, {} finished, {} refused, {} failed, {} cancelled; \
         {} streams moved ({} with their KV, the rest recomputed); {} P/D requests found \
         their decode node short of KV blocks",
        t.sent, t.finished, t.refused, t.failed, t.cancelled, t.moved, t.moved_by_kv, t.kv_short
    );
    if !t.move_pauses_ms.is_empty() {
        let mut p = t.move_pauses_ms;
        p.sort_by(f64::total_cmp);
        let at = |q: f64| p[((p.len() - 1) as f64 * q).round() as usize];
        println!(
            "move pauses (last token on one engine to the first on the next): {} moves, \
             p50 {:.0} ms, p99 {:.0} ms, max {:.0} ms",
            p.len(),
            at(0.5),
            at(0.99),
            at(1.0)
        );
    }
    if !failed.is_empty() {
        bail!(
            "{} of {seeds} seeds broke an invariant; replay one with --seed N (FLOTILLA_LOG=debug shows the actors)",
            failed.len()
        );
    }
    Ok(())
}

fn load_test(args: &flotilla_bench::BenchArgs) -> Result<()> {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?;
    Ok(rt.block_on(flotilla_bench::main(args))?)
}

fn generate(
    args: &ModelArgs,
    prompt: &str,
    chat: bool,
    system: Option<String>,
    max_tokens: usize,
    params: SamplingParams,
    ignore_eos: bool,
) -> Result<()> {
    let path = args.path()?;
    let t0 = Instant::now();
    let g = GgufFile::open(&path)?;
    let text_side = TextSide::from_gguf(&g).context("loading the tokenizer")?;
    let ctx = ModelConfig::from_gguf(&g)?.ctx_len;
    let text = if chat {
        if let Some(name) = text_side.chat_builtin {
            eprintln!(
                "note: the model has no chat template; --chat uses the built-in {name} format"
            );
        }
        let tpl = text_side
            .chat
            .as_ref()
            .context("the model has no chat template (tokenizer.chat_template); drop --chat")?;
        let mut msgs = Vec::new();
        if let Some(s) = system {
            msgs.push(ChatMessage::new("system", s));
        }
        msgs.push(ChatMessage::new("user", prompt));
        tpl.render(&msgs, true)?
    } else {
        prompt.to_string()
    };
    // Special tokens are recognised only in the rendered template, never in raw user text.
    let ids = text_side.tokenizer.encode(&text, chat)?;
    if ids.is_empty() {
        bail!("the prompt is empty after tokenization");
    }
    if ids.len() >= ctx {
        bail!(
            "the prompt has {} tokens; the model's context is {ctx}",
            ids.len()
        );
    }
    if args.device() != flotilla_cuda::Device::Cpu {
        bail!(
            "generate runs on the CPU; --device {} applies to serve and node",
            args.device()
        );
    }
    let max_new = max_tokens.min(ctx - ids.len());
    // A KV cache sized for this request, a step budget for its prompt.
    let blocks = (ids.len() + max_new).div_ceil(args.block_size.max(1));
    let cpu = args.cpu_config(blocks, ids.len().clamp(1, 512))?;
    let exec = alloc::loading(|| CpuExecutor::from_gguf(&g, &cpu)).context("loading the model")?;
    let load = t0.elapsed();
    if let Some(note) = exec.load_note() {
        eprintln!("{note}");
    }
    let TextSide {
        tokenizer,
        stop_tokens,
        ..
    } = text_side;
    let stop = if ignore_eos { Vec::new() } else { stop_tokens };
    let mut driver = Driver::new(exec);
    let mut stream = tokenizer.stream(true);
    let stdout = std::io::stdout();
    let mut out = stdout.lock();
    let t1 = Instant::now();
    let mut first: Option<std::time::Duration> = None;
    let mut n = 0usize;
    let mut write_err = None;
    let req = Request {
        prompt: ids.clone(),
        params,
        max_new,
        stop_tokens: stop.clone(),
    };
    let res = driver.run(&[req], |_, s| {
        first.get_or_insert_with(|| t1.elapsed());
        n += 1;
        if stop.contains(&s.token) {
            return;
        }
        match stream.push(s.token) {
            Ok(Some(piece)) => {
                if let Err(e) = out.write_all(piece.as_bytes()).and_then(|_| out.flush()) {
                    write_err.get_or_insert(e);
                }
            }
            Ok(None) => {}
            Err(e) => eprintln!("warning: cannot decode token {}: {e}", s.token),
        }
    })?;
    if let Ok(Some(rest)) = stream.flush() {
        out.write_all(rest.as_bytes())?;
    }
    writeln!(out)?;
    if let Some(e) = write_err {
        return Err(e).context("writing to stdout");
    }
    let total = t1.elapsed();
    let ttft = first.unwrap_or(total);
    let decode_tps = if n > 1 {
        (n - 1) as f64 / (total - ttft).as_secs_f64()
    } else {
        0.0
    };
    let reason = match res[0].1 {
        Finish::Eos => "end of sequence",
        Finish::Length => "length",
    };
    eprintln!(
        "[{} prompt tokens, {n} generated ({reason}); load {:.2}s, prompt {:.0} ms ({:.0} tok/s), decode {:.1} tok/s, {} threads]",
        ids.len(),
        load.as_secs_f64(),
        ttft.as_secs_f64() * 1e3,
        ids.len() as f64 / ttft.as_secs_f64(),
        decode_tps,
        driver.executor().threads(),
    );
    Ok(())
}
