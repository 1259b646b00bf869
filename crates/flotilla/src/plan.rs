//! `flotilla plan`: the cheapest cluster that serves a workload within its
//! latency objectives, from fast-mode simulations (`flotilla_sim::plan`).

use std::path::PathBuf;

use anyhow::{Context, Result, bail};
use flotilla_model::KvDtype;
use flotilla_sim::plan::{Config, Objective, PlanOptions, Space};

/// Arguments of `flotilla plan`.
#[derive(clap::Args, Debug)]
pub struct PlanArgs {
    /// The workload: a scenario file (simulations/*.toml) whose traffic
    /// mix (tenants, open arrivals, prompt and output lengths), tiers,
    /// model and GPU are planned for; its rates are scaled to each rate
    /// tried, its topology and faults replaced by each configuration's.
    pub workload: PathBuf,
    /// A JSONL trace to replay in place of the workload's arrivals: one
    /// request a line, `{"t": 0.25, "prompt_tokens": 812,
    /// "output_tokens": 140, "tenant": "acme"}` (`t` in seconds; tenants of
    /// the workload), its times scaled to each rate tried and looped to
    /// fill the run.
    #[arg(long)]
    pub trace: Option<PathBuf>,
    /// A tier's objectives, TIER:METRIC_pN=VALUE[,...], e.g.
    /// `paid:ttft_p99=1s,tpot_p99=60ms` (metrics ttft, tpot; values in s or
    /// ms). Repeat for each tier; every one must hold.
    #[arg(long = "slo", required = true)]
    pub slo: Vec<String>,
    /// The rate the cluster must serve, requests/s: the answer is the
    /// cheapest configuration that serves it within the objectives.
    #[arg(long)]
    pub target_rate: Option<f64>,
    /// Most engine nodes: node counts tried are the powers of two up to it,
    /// and it.
    #[arg(long, default_value_t = 8)]
    pub max_nodes: usize,
    /// Node counts to try instead, e.g. `4,8,12`.
    #[arg(long, value_delimiter = ',')]
    pub nodes: Vec<usize>,
    /// One engine node's cost (per hour, any unit).
    #[arg(long, default_value_t = 1.0)]
    pub node_cost: f64,
    /// Shares of prefill nodes to try (0: mixed nodes; 0.25: 1P3D).
    #[arg(long, value_delimiter = ',', default_values_t = [0.0, 0.25])]
    pub prefill_shares: Vec<f64>,
    /// `max_num_seqs` values to try.
    #[arg(long, value_delimiter = ',', default_values_t = [128usize, 256])]
    pub max_num_seqs: Vec<usize>,
    /// KV cache dtypes to try (f16, int8, f32).
    #[arg(long, value_delimiter = ',', default_values_t = ["f16".to_string(), "int8".to_string()])]
    pub kv_dtypes: Vec<String>,
    /// A GPU preset in place of the workload's `[gpu]` (h100, h200, a100,
    /// cpu), or a file `flotilla bench-model --fit` wrote (its `[gpu]`, and
    /// the `[model]` it was fitted with unless --model is given).
    #[arg(long)]
    pub gpu: Option<String>,
    /// A model preset in place of the workload's `[model]`.
    #[arg(long)]
    pub model: Option<String>,
    /// Seconds of arrivals per run in place of the workload's `[run] duration_s`.
    #[arg(long)]
    pub duration_s: Option<f64>,
    /// Refused and failed requests allowed, as a fraction of those sent.
    #[arg(long, default_value_t = 0.01)]
    pub max_lost: f64,
    /// Each rate search stops when its bounds are this close (0.05: 5%).
    #[arg(long, default_value_t = 0.05)]
    pub precision: f64,
    /// The runs' seed.
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
    /// Threads (0: one per core).
    #[arg(long, default_value_t = 0)]
    pub jobs: usize,
    /// Write pareto.csv, plan.html and (with --target-rate) the winner's
    /// cluster config, cluster.toml, here.
    #[arg(long)]
    pub out: Option<PathBuf>,
}

/// The `[gpu]` and `[model]` of a file `bench-model --fit` wrote.
fn fitted(
    path: &str,
) -> Result<(
    flotilla_sim::cost::GpuParams,
    flotilla_sim::cost::ModelShape,
)> {
    #[derive(serde::Deserialize)]
    struct Fitted {
        gpu: flotilla_sim::cost::GpuParams,
        model: flotilla_sim::cost::ModelShape,
    }
    let text = std::fs::read_to_string(path).with_context(|| format!("--gpu {path}"))?;
    let f: Fitted = toml::from_str(&text).with_context(|| {
        format!("--gpu {path}: not a file `flotilla bench-model --fit` wrote ([gpu] and [model])")
    })?;
    Ok((f.gpu, f.model))
}

/// Runs `flotilla plan`.
pub fn run(args: &PlanArgs) -> Result<()> {
    let text = std::fs::read_to_string(&args.workload)
        .with_context(|| format!("reading {}", args.workload.display()))?;
    let mut sc = flotilla_sim::Scenario::load(&args.workload)?;
    if let Some(g) = &args.gpu {
        if g.ends_with(".toml") || std::path::Path::new(g).is_file() {
            let (gpu, model) = fitted(g)?;
            println!("--gpu {g}: {} (fitted with model {})", gpu.name, model.name);
            sc.gpu = flotilla_sim::scenario::Named::Gpu(gpu);
            if args.model.is_none() {
                sc.model = flotilla_sim::scenario::Named::Model(model);
            }
        } else {
            sc.gpu = flotilla_sim::scenario::Named::Preset {
                preset: g.clone(),
                set: Default::default(),
            };
        }
    }
    if let Some(m) = &args.model {
        sc.model = flotilla_sim::scenario::Named::Preset {
            preset: m.clone(),
            set: Default::default(),
        };
    }
    if let Some(d) = args.duration_s {
        if !(d.is_finite() && d > 0.0) {
            bail!("--duration-s {d} must be a positive number of seconds");
        }
        sc.run.duration_s = d;
    }
    if let Some(t) = &args.trace {
        sc.replay(t)?;
        println!(
            "replaying {} ({:.2} req/s as recorded)",
            t.display(),
            flotilla_sim::plan::offered_rate(&sc)?
        );
    }
    sc.validate()?;
    let mut objectives: Vec<Objective> = Vec::new();
    for s in &args.slo {
        objectives.extend(flotilla_sim::plan::parse_objectives(s).map_err(anyhow::Error::msg)?);
    }
    if let Some(t) = args.target_rate
        && !(t.is_finite() && t > 0.0)
    {
        bail!("--target-rate {t} must be a positive number of requests a second");
    }
    if !(args.node_cost.is_finite() && args.node_cost > 0.0) {
        bail!("--node-cost {} must be positive", args.node_cost);
    }
    if !(args.precision > 0.0 && args.precision < 1.0) {
        bail!("--precision {} must be in (0, 1)", args.precision);
    }
    if !(0.0..1.0).contains(&args.max_lost) {
        bail!("--max-lost {} must be in [0, 1)", args.max_lost);
    }
    let nodes = if args.nodes.is_empty() {
        if args.max_nodes == 0 {
            bail!("--max-nodes must be at least 1");
        }
        let mut v: Vec<usize> = std::iter::successors(Some(1usize), |n| n.checked_mul(2))
            .take_while(|&n| n <= args.max_nodes)
            .collect();
        if v.last() != Some(&args.max_nodes) {
            v.push(args.max_nodes);
        }
        v
    } else {
        if args.nodes.contains(&0) {
            bail!("--nodes: a cluster needs at least one engine node");
        }
        args.nodes.clone()
    };
    for s in &args.prefill_shares {
        if !(0.0..1.0).contains(s) {
            bail!("--prefill-shares: {s} is not in [0, 1)");
        }
    }
    let kv_dtypes = args
        .kv_dtypes
        .iter()
        .map(|d| KvDtype::parse(d).map_err(|e| anyhow::anyhow!("--kv-dtypes: {e}")))
        .collect::<Result<Vec<_>>>()?;
    let space = Space {
        nodes,
        prefill_shares: args.prefill_shares.clone(),
        max_num_seqs: args.max_num_seqs.clone(),
        kv_dtypes,
    };
    let jobs = match args.jobs {
        0 => std::thread::available_parallelism().map_or(1, usize::from),
        n => n,
    };
    let opts = PlanOptions {
        objectives,
        max_lost: args.max_lost,
        target_rate: args.target_rate,
        node_cost: args.node_cost,
        precision: args.precision,
        seed: args.seed,
        jobs,
    };
    let configs = space.configs();
    println!(
        "{}: {} configurations, {:.0} s of arrivals per run, fast mode, {jobs} threads; objectives: {}",
        args.workload.display(),
        configs.len(),
        sc.run.duration_s,
        opts.objectives
            .iter()
            .map(ToString::to_string)
            .collect::<Vec<_>>()
            .join(", ")
    );
    let t0 = std::time::Instant::now();
    let plan = flotilla_sim::plan::plan(&sc, &space, &opts, &|p| {
        println!(
            "  {:<42} cost {:>6.1}  {:>9.2} req/s  ({} runs)",
            p.config.label(),
            p.cost,
            p.rate(),
            p.probes.len()
        );
    })?;
    let wall = t0.elapsed().as_secs_f64();
    println!(
        "{} configurations, {} simulations, {wall:.1} s wall",
        plan.points.len(),
        plan.runs
    );
    println!("Pareto front (cost, highest rate within the objectives):");
    for i in plan.pareto() {
        let p = &plan.points[i];
        println!(
            "  {:<42} cost {:>6.1}  {:>9.2} req/s",
            p.config.label(),
            p.cost,
            p.rate()
        );
    }
    let winner: Option<&Config> = plan.winner.map(|i| &plan.points[i].config);
    match (args.target_rate, plan.winner) {
        (Some(t), Some(i)) => {
            let p = &plan.points[i];
            println!(
                "cheapest for {t:.2} req/s: {} (cost {:.1}), serves up to {:.2} req/s within the objectives",
                p.config.label(),
                p.cost,
                p.rate()
            );
        }
        (Some(t), None) => println!(
            "no configuration tried serves {t:.2} req/s within the objectives: raise --max-nodes \
             or relax an objective"
        ),
        (None, _) => {}
    }
    if let Some(dir) = &args.out {
        std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
        let csv = dir.join("pareto.csv");
        std::fs::write(&csv, flotilla_sim::plan::csv(&plan, &opts))?;
        let html = dir.join("plan.html");
        let title = format!("flotilla plan: {}", args.workload.display());
        std::fs::write(&html, flotilla_sim::plan::html(&plan, &opts, &title))?;
        println!("wrote {} and {}", csv.display(), html.display());
        if let Some(c) = winner {
            let cfg = flotilla_sim::plan::cluster_config(&text, c).map_err(anyhow::Error::msg)?;
            // What it wrote must be a config `flotilla cluster` reads.
            flotilla_config::ClusterConfig::parse(&cfg, "the planned config")
                .map_err(|e| anyhow::anyhow!("the planned config does not parse: {e}"))?;
            let path = dir.join("cluster.toml");
            std::fs::write(&path, cfg)?;
            println!("wrote {}", path.display());
        }
    }
    Ok(())
}
