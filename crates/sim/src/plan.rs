//! Capacity planning (`flotilla plan`): for a workload (a scenario's
//! traffic mix, scaled to each rate tried) and per-tier latency
//! objectives, the highest arrival rate each cluster configuration serves
//! within them, found by running the simulator in fast mode (probe up or
//! down by doubling, then bisect), and the cheapest configuration that
//! serves a target rate.

use flotilla_exec::KvDtype;

use crate::run::{End, Report, SimError, percentile, run};
use crate::scenario::{Arrivals, Scenario, ScenarioError, SimMode};
pub use flotilla_exec::slo::{Metric, Objective, parse_objectives};

/// One cluster shape: how many engine nodes, of which roles, with which
/// engine settings.
#[derive(Clone, Debug, PartialEq)]
pub struct Config {
    /// Mixed engine nodes (0 when disaggregated).
    pub mixed: usize,
    /// Prefill nodes.
    pub prefill: usize,
    /// Decode nodes.
    pub decode: usize,
    /// `[engine] max_num_seqs`.
    pub max_num_seqs: usize,
    /// `[engine] kv_cache_dtype`.
    pub kv_dtype: KvDtype,
}

impl Config {
    /// Engine nodes in all.
    pub fn nodes(&self) -> usize {
        self.mixed + self.prefill + self.decode
    }

    /// A short name: `8 mixed` or `2P6D`, and the settings.
    pub fn label(&self) -> String {
        let roles = if self.mixed > 0 {
            format!("{} mixed", self.mixed)
        } else {
            format!("{}P{}D", self.prefill, self.decode)
        };
        format!(
            "{roles}, max_num_seqs {}, kv {}",
            self.max_num_seqs, self.kv_dtype
        )
    }

    /// `base` with this shape (its traffic and objectives kept).
    pub fn apply(&self, base: &Scenario) -> Result<Scenario, ScenarioError> {
        let mut sc = base.clone();
        sc.topology.engines = self.mixed;
        sc.topology.prefill = self.prefill;
        sc.topology.decode = self.decode;
        sc.topology.joiners = 0;
        sc.engine.max_num_seqs = self.max_num_seqs;
        sc.engine.kv_dtype = self.kv_dtype;
        // The shape's nodes are the ones the faults would name: a plan
        // is made on a healthy cluster.
        sc.faults.clear();
        sc.chaos = None;
        sc.validate()?;
        Ok(sc)
    }
}

/// The configurations to try.
#[derive(Clone, Debug)]
pub struct Space {
    /// Engine node counts.
    pub nodes: Vec<usize>,
    /// Prefill shares of a disaggregated cluster (0: mixed nodes), e.g.
    /// 0.25 for 1P3D.
    pub prefill_shares: Vec<f64>,
    /// `max_num_seqs` values.
    pub max_num_seqs: Vec<usize>,
    /// KV dtypes.
    pub kv_dtypes: Vec<KvDtype>,
}

impl Space {
    /// Every configuration of the space, cheapest first (fewest nodes).
    pub fn configs(&self) -> Vec<Config> {
        let mut out = Vec::new();
        for &n in &self.nodes {
            for &share in &self.prefill_shares {
                let (mixed, prefill, decode) = if share <= 0.0 {
                    (n, 0, 0)
                } else {
                    if n < 2 {
                        continue;
                    }
                    let p = ((n as f64 * share).round() as usize).clamp(1, n - 1);
                    (0, p, n - p)
                };
                for &max_num_seqs in &self.max_num_seqs {
                    for &kv_dtype in &self.kv_dtypes {
                        let c = Config {
                            mixed,
                            prefill,
                            decode,
                            max_num_seqs,
                            kv_dtype,
                        };
                        if !out.contains(&c) {
                            out.push(c);
                        }
                    }
                }
            }
        }
        out
    }
}

/// What a plan is asked.
#[derive(Clone, Debug)]
pub struct PlanOptions {
    /// Every objective must hold.
    pub objectives: Vec<Objective>,
    /// Requests refused or failed, as a fraction of those sent, at most
    /// (a refusal is not a fast answer).
    pub max_lost: f64,
    /// The rate (requests/s) the cluster must serve; the cheapest
    /// configuration that serves it is the answer.
    pub target_rate: Option<f64>,
    /// One engine node's cost (per hour, any unit).
    pub node_cost: f64,
    /// Each rate search stops when its bounds are this close (0.05: 5%).
    pub precision: f64,
    /// The runs' seed.
    pub seed: u64,
    /// Threads (configurations run in parallel).
    pub jobs: usize,
}

/// The figures of one run at one rate.
#[derive(Clone, Debug, PartialEq)]
pub struct Probe {
    /// Requests per second offered.
    pub rate: f64,
    /// Whether every objective held.
    pub met: bool,
    /// Each objective's measured value, ms (in the order given).
    pub measured_ms: Vec<f64>,
    /// Requests refused or failed, of those sent.
    pub lost: f64,
    /// Output tokens per simulated second.
    pub tokens_per_s: f64,
}

/// One configuration's answer.
#[derive(Clone, Debug)]
pub struct Point {
    /// The configuration.
    pub config: Config,
    /// Its cost (nodes times the node cost).
    pub cost: f64,
    /// The highest rate tried at which every objective held (None: none).
    pub best: Option<Probe>,
    /// Every run, in the order made.
    pub probes: Vec<Probe>,
}

impl Point {
    /// The highest rate it serves within the objectives (0 if none).
    pub fn rate(&self) -> f64 {
        self.best.as_ref().map_or(0.0, |p| p.rate)
    }
}

/// A plan's answer.
#[derive(Clone, Debug)]
pub struct Plan {
    /// Every configuration tried, in the order of the space.
    pub points: Vec<Point>,
    /// The cheapest that serves the target rate (an index into `points`).
    pub winner: Option<usize>,
    /// Simulator runs made.
    pub runs: usize,
}

impl Plan {
    /// The points no other point beats on both cost and rate (cheapest
    /// first).
    pub fn pareto(&self) -> Vec<usize> {
        let mut idx: Vec<usize> = (0..self.points.len())
            .filter(|&i| self.points[i].rate() > 0.0)
            .collect();
        idx.sort_by(|&a, &b| {
            let (pa, pb) = (&self.points[a], &self.points[b]);
            pa.cost
                .total_cmp(&pb.cost)
                .then(pb.rate().total_cmp(&pa.rate()))
        });
        let mut out = Vec::new();
        let mut best = 0.0;
        for i in idx {
            if self.points[i].rate() > best {
                best = self.points[i].rate();
                out.push(i);
            }
        }
        out
    }
}

/// The open-loop arrival rate of `sc`'s traffic, requests/s.
pub fn offered_rate(sc: &Scenario) -> Result<f64, ScenarioError> {
    let mut total = 0.0;
    for t in &sc.traffic {
        total += match t.arrivals {
            Arrivals::Poisson { rate_per_s } => rate_per_s,
            Arrivals::Bursts {
                rate_per_s,
                burst,
                every_s,
            } => rate_per_s + burst as f64 / every_s,
            Arrivals::Trace {
                ref rows,
                speed,
                period_s,
                ..
            } => rows.len() as f64 / period_s * speed,
            Arrivals::Closed { .. } => {
                return Err(ScenarioError::Invalid(format!(
                    "tenant '{}' has closed-loop clients: a plan scales open arrivals \
                     (poisson or bursts), whose rate does not depend on the cluster",
                    t.tenant
                )));
            }
        };
    }
    if total <= 0.0 {
        return Err(ScenarioError::Invalid(
            "the workload offers no requests (every rate is 0)".into(),
        ));
    }
    Ok(total)
}

/// `sc` with every tenant's rate scaled so that the total is `rate`.
pub fn at_rate(sc: &Scenario, rate: f64) -> Result<Scenario, ScenarioError> {
    let k = rate / offered_rate(sc)?;
    let mut out = sc.clone();
    for t in &mut out.traffic {
        t.arrivals = match t.arrivals.clone() {
            Arrivals::Poisson { rate_per_s } => Arrivals::Poisson {
                rate_per_s: rate_per_s * k,
            },
            Arrivals::Bursts {
                rate_per_s,
                burst,
                every_s,
            } => Arrivals::Bursts {
                rate_per_s: rate_per_s * k,
                burst,
                every_s: every_s / k,
            },
            Arrivals::Trace {
                file,
                speed,
                rows,
                period_s,
            } => Arrivals::Trace {
                file,
                speed: speed * k,
                rows,
                period_s,
            },
            a @ Arrivals::Closed { .. } => a,
        };
    }
    Ok(out)
}

/// Checks the objectives name tiers of `sc`.
pub fn check(sc: &Scenario, opts: &PlanOptions) -> Result<(), ScenarioError> {
    offered_rate(sc)?;
    if opts.objectives.is_empty() {
        return Err(ScenarioError::Invalid(
            "no objective: give at least one --slo".into(),
        ));
    }
    for o in &opts.objectives {
        if !sc.config.tiers.iter().any(|t| t.name == o.tier) {
            let names: Vec<&str> = sc.config.tiers.iter().map(|t| t.name.as_str()).collect();
            return Err(ScenarioError::Invalid(format!(
                "--slo names tier '{}'; the workload's tiers are {}",
                o.tier,
                names.join(", ")
            )));
        }
    }
    if let Some(why) = sc.fast_refusal() {
        return Err(ScenarioError::Invalid(why));
    }
    Ok(())
}

/// The figures of `report` against the objectives.
pub fn judge(sc: &Scenario, report: &Report, rate: f64, opts: &PlanOptions) -> Probe {
    let sent = report.requests.len().max(1) as f64;
    let lost = report
        .requests
        .iter()
        .filter(|r| matches!(r.end, End::Refused | End::Failed))
        .count() as f64
        / sent;
    let mut met = lost <= opts.max_lost;
    let mut measured_ms = Vec::new();
    for o in &opts.objectives {
        let tier = sc
            .config
            .tiers
            .iter()
            .position(|t| t.name == o.tier)
            .unwrap_or(usize::MAX);
        let mut v: Vec<f64> = report
            .requests
            .iter()
            .filter(|r| r.tier == tier && r.end == End::Finished)
            .filter_map(|r| match o.metric {
                Metric::Ttft => r.ttft,
                Metric::Tpot => r.tpot,
            })
            .map(|d| d.as_secs_f64() * 1e3)
            .collect();
        let x = percentile(&mut v, o.pct);
        met &= x <= o.limit.as_secs_f64() * 1e3;
        measured_ms.push(x);
    }
    Probe {
        rate,
        met,
        measured_ms,
        lost,
        tokens_per_s: report.throughput(),
    }
}

/// One run of `config` at `rate`, judged.
pub fn probe(
    base: &Scenario,
    config: &Config,
    rate: f64,
    opts: &PlanOptions,
) -> Result<Probe, SimError> {
    let mut sc = at_rate(&config.apply(base)?, rate)?;
    sc.sim.mode = SimMode::Fast;
    // A rate beyond the configuration fills its queues: what waits at the
    // end of the arrivals times out after the queue timeout, and what runs
    // must then finish, so the run drains for that long and two minutes
    // more (a run that cannot drain breaks an invariant).
    sc.run.drain_s = sc
        .run
        .drain_s
        .max(sc.engine.queue_timeout.as_secs_f64() + 120.0);
    let report = run(&sc, opts.seed)?;
    Ok(judge(&sc, &report, rate, opts))
}

/// The highest rate `config` serves within the objectives: from `start`,
/// doubling (or halving) until the answer changes, then bisecting until
/// the bounds are `opts.precision` apart.
pub fn search(
    base: &Scenario,
    config: &Config,
    start: f64,
    opts: &PlanOptions,
) -> Result<Point, SimError> {
    let mut probes = Vec::new();
    let try_rate = |r: f64, probes: &mut Vec<Probe>| -> Result<bool, SimError> {
        let p = probe(base, config, r, opts)?;
        let met = p.met;
        probes.push(p);
        Ok(met)
    };
    let (mut lo, mut hi) = (None::<f64>, None::<f64>);
    let mut r = start.max(1e-3);
    for _ in 0..12 {
        if try_rate(r, &mut probes)? {
            lo = Some(r);
            if hi.is_some() {
                break;
            }
            r *= 2.0;
        } else {
            hi = Some(r);
            if lo.is_some() {
                break;
            }
            r /= 2.0;
        }
    }
    if let (Some(mut l), Some(mut h)) = (lo, hi) {
        while h / l > 1.0 + opts.precision {
            let m = (l * h).sqrt();
            if try_rate(m, &mut probes)? {
                l = m;
            } else {
                h = m;
            }
        }
        // Whether it serves the target is asked directly where the
        // bounds straddle it: the answer must not depend on the precision.
        if let Some(t) = opts.target_rate
            && l < t
            && t < h
        {
            try_rate(t, &mut probes)?;
        }
    }
    let best = probes
        .iter()
        .filter(|p| p.met)
        .max_by(|a, b| a.rate.total_cmp(&b.rate))
        .cloned();
    Ok(Point {
        config: config.clone(),
        cost: config.nodes() as f64 * opts.node_cost,
        best,
        probes,
    })
}

/// Searches every configuration of `space` (on `opts.jobs` threads), each
/// from a start scaled from the workload's own rate and node count, and
/// picks the cheapest that serves `opts.target_rate`. `progress` hears of
/// each configuration as it is done.
pub fn plan(
    base: &Scenario,
    space: &Space,
    opts: &PlanOptions,
    progress: &(dyn Fn(&Point) + Sync),
) -> Result<Plan, SimError> {
    check(base, opts)?;
    let configs = space.configs();
    if configs.is_empty() {
        return Err(SimError::Scenario(ScenarioError::Invalid(
            "the search space is empty".into(),
        )));
    }
    let per_node = offered_rate(base)? / base.engine_nodes().max(1) as f64;
    let next = std::sync::atomic::AtomicUsize::new(0);
    let results: std::sync::Mutex<Vec<Option<Result<Point, SimError>>>> =
        std::sync::Mutex::new((0..configs.len()).map(|_| None).collect());
    std::thread::scope(|s| {
        for _ in 0..opts.jobs.max(1).min(configs.len()) {
            s.spawn(|| {
                loop {
                    let i = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                    let Some(c) = configs.get(i) else {
                        break;
                    };
                    let start = per_node * c.nodes() as f64;
                    let r = search(base, c, start, opts);
                    if let Ok(p) = &r {
                        progress(p);
                    }
                    results.lock().unwrap_or_else(|e| e.into_inner())[i] = Some(r);
                }
            });
        }
    });
    let mut points = Vec::new();
    for r in results.into_inner().unwrap_or_else(|e| e.into_inner()) {
        points.push(r.expect("every configuration was searched")?);
    }
    let runs = points.iter().map(|p| p.probes.len()).sum();
    let winner = opts.target_rate.and_then(|target| {
        (0..points.len())
            .filter(|&i| points[i].rate() >= target)
            .min_by(|&a, &b| {
                points[a]
                    .cost
                    .total_cmp(&points[b].cost)
                    .then(points[b].rate().total_cmp(&points[a].rate()))
            })
    });
    Ok(Plan {
        points,
        winner,
        runs,
    })
}

/// The Pareto CSV: every configuration, its cost, its highest rate within
/// the objectives and the measured objectives there.
pub fn csv(plan: &Plan, opts: &PlanOptions) -> String {
    let mut out = String::from(
        "mixed,prefill,decode,max_num_seqs,kv_dtype,cost,rate_per_s,tokens_per_s,lost,pareto,winner",
    );
    for o in &opts.objectives {
        out.push_str(&format!(",{o}"));
    }
    out.push('\n');
    let front = plan.pareto();
    for (i, p) in plan.points.iter().enumerate() {
        let c = &p.config;
        let (tps, lost) = p
            .best
            .as_ref()
            .map_or((0.0, 0.0), |b| (b.tokens_per_s, b.lost));
        out.push_str(&format!(
            "{},{},{},{},{},{},{:.3},{:.1},{:.4},{},{}",
            c.mixed,
            c.prefill,
            c.decode,
            c.max_num_seqs,
            c.kv_dtype,
            p.cost,
            p.rate(),
            tps,
            lost,
            front.contains(&i),
            plan.winner == Some(i)
        ));
        for k in 0..opts.objectives.len() {
            let v = p.best.as_ref().and_then(|b| b.measured_ms.get(k).copied());
            match v {
                Some(v) => out.push_str(&format!(",{v:.2}")),
                None => out.push(','),
            }
        }
        out.push('\n');
    }
    out
}

/// An HTML page with the plan: cost against rate (the Pareto front drawn),
/// and the table.
pub fn html(plan: &Plan, opts: &PlanOptions, title: &str) -> String {
    let (w, h, pad) = (720.0, 420.0, 56.0);
    let max_cost = plan.points.iter().map(|p| p.cost).fold(1e-9, f64::max);
    let max_rate = plan.points.iter().map(Point::rate).fold(1e-9, f64::max);
    let x = |c: f64| pad + (w - 2.0 * pad) * c / max_cost;
    let y = |r: f64| h - pad - (h - 2.0 * pad) * r / max_rate;
    let mut svg = format!(
        "<svg xmlns='http://www.w3.org/2000/svg' width='{w}' height='{h}' font-family='sans-serif' font-size='12'>\
         <line x1='{pad}' y1='{}' x2='{}' y2='{}' stroke='#333'/>\
         <line x1='{pad}' y1='{pad}' x2='{pad}' y2='{}' stroke='#333'/>\
         <text x='{}' y='{}' text-anchor='middle'>cost (nodes x {})</text>\
         <text x='14' y='{}' transform='rotate(-90 14 {})' text-anchor='middle'>highest rate within the objectives (req/s)</text>\
         <text x='{pad}' y='{}' text-anchor='middle'>0</text>\
         <text x='{}' y='{}' text-anchor='middle'>{max_cost:.0}</text>\
         <text x='{}' y='{}' text-anchor='end'>{max_rate:.1}</text>",
        h - pad,
        w - pad,
        h - pad,
        h - pad,
        w / 2.0,
        h - 16.0,
        opts.node_cost,
        h / 2.0,
        h / 2.0,
        h - pad + 16.0,
        w - pad,
        h - pad + 16.0,
        pad - 6.0,
        pad + 4.0,
    );
    let front = plan.pareto();
    let line: Vec<String> = front
        .iter()
        .map(|&i| {
            let p = &plan.points[i];
            format!("{:.1},{:.1}", x(p.cost), y(p.rate()))
        })
        .collect();
    if line.len() > 1 {
        svg.push_str(&format!(
            "<polyline points='{}' fill='none' stroke='#1f77b4' stroke-width='2'/>",
            line.join(" ")
        ));
    }
    if let Some(t) = opts.target_rate {
        svg.push_str(&format!(
            "<line x1='{pad}' y1='{:.1}' x2='{}' y2='{:.1}' stroke='#d62728' stroke-dasharray='4 4'/>\
             <text x='{}' y='{:.1}' fill='#d62728' text-anchor='end'>target {t:.1} req/s</text>",
            y(t),
            w - pad,
            y(t),
            w - pad,
            y(t) - 4.0
        ));
    }
    for (i, p) in plan.points.iter().enumerate() {
        let colour = if plan.winner == Some(i) {
            "#d62728"
        } else if front.contains(&i) {
            "#1f77b4"
        } else {
            "#999"
        };
        svg.push_str(&format!(
            "<circle cx='{:.1}' cy='{:.1}' r='5' fill='{colour}'><title>{}: {:.2} req/s</title></circle>",
            x(p.cost),
            y(p.rate()),
            escape(&p.config.label()),
            p.rate()
        ));
    }
    svg.push_str("</svg>");
    let mut rows = String::new();
    for (i, p) in plan.points.iter().enumerate() {
        let figures: Vec<String> = p
            .best
            .as_ref()
            .map(|b| b.measured_ms.iter().map(|v| format!("{v:.1}")).collect())
            .unwrap_or_default();
        rows.push_str(&format!(
            "<tr{}><td>{}</td><td>{:.1}</td><td>{:.2}</td><td>{}</td><td>{}</td></tr>",
            if plan.winner == Some(i) {
                " style='font-weight:bold'"
            } else {
                ""
            },
            escape(&p.config.label()),
            p.cost,
            p.rate(),
            figures.join(" / "),
            p.probes.len()
        ));
    }
    let objectives: Vec<String> = opts
        .objectives
        .iter()
        .map(|o| escape(&o.to_string()))
        .collect();
    format!(
        "<!doctype html><html><head><meta charset='utf-8'><title>{t}</title></head><body>\
         <h1>{t}</h1><p>Objectives: {}. Highest rate each configuration serves within them \
         (fast-mode simulations, seed {}); the winner is red, the Pareto front blue.</p>{svg}\
         <table border='1' cellpadding='4'><tr><th>configuration</th><th>cost</th>\
         <th>rate (req/s)</th><th>measured (ms, in the objectives' order)</th><th>runs</th></tr>{rows}</table>\
         </body></html>\n",
        objectives.join(", "),
        opts.seed,
        t = escape(title),
    )
}

fn escape(s: &str) -> String {
    s.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
}

/// A cluster config for `config`: the workload's `[engine]`, tiers,
/// tenants and `[cluster]` tables from `scenario_text` (a scenario file's
/// text), the engine settings the plan chose, and a `[[nodes]]` entry per
/// node at a placeholder address (`10.0.0.N:7400`) to replace with the
/// machines' own.
pub fn cluster_config(scenario_text: &str, config: &Config) -> Result<String, String> {
    let doc: toml::Table = toml::from_str(scenario_text).map_err(|e| e.to_string())?;
    let mut out = toml::Table::new();
    for key in ["cluster", "tiers", "tenants"] {
        if let Some(v) = doc.get(key) {
            out.insert(key.into(), v.clone());
        }
    }
    // A served tenant needs keys: a placeholder each, to replace.
    if let Some(toml::Value::Array(tenants)) = out.get_mut("tenants") {
        for t in tenants.iter_mut().filter_map(|t| t.as_table_mut()) {
            if !t.contains_key("api_keys") {
                let name = t.get("name").and_then(|n| n.as_str()).unwrap_or("tenant");
                let key = toml::Value::String(format!("sk-{name}-replace-me"));
                t.insert("api_keys".into(), toml::Value::Array(vec![key]));
            }
        }
    }
    let mut engine = doc
        .get("engine")
        .and_then(|v| v.as_table())
        .cloned()
        .unwrap_or_default();
    engine.insert(
        "max_num_seqs".into(),
        toml::Value::Integer(config.max_num_seqs as i64),
    );
    engine.insert(
        "kv_cache_dtype".into(),
        toml::Value::String(config.kv_dtype.name().into()),
    );
    // A simulator knob, not an engine node's.
    engine.remove("decode_steps");
    out.insert("engine".into(), toml::Value::Table(engine));
    let mut nodes = Vec::new();
    let node = |name: String, role: &str, i: usize| {
        let mut t = toml::Table::new();
        t.insert("name".into(), toml::Value::String(name));
        t.insert("role".into(), toml::Value::String(role.into()));
        t.insert(
            "addr".into(),
            toml::Value::String(format!("10.0.0.{}:7400", i + 1)),
        );
        t
    };
    let mut router = node("router".into(), "router", 0);
    router.insert("http".into(), toml::Value::String("0.0.0.0:8000".into()));
    nodes.push(toml::Value::Table(router));
    let roles = std::iter::repeat_n(("worker", "worker"), config.mixed)
        .chain(std::iter::repeat_n(("prefill", "prefill"), config.prefill))
        .chain(std::iter::repeat_n(("decode", "decode"), config.decode));
    let mut count = std::collections::BTreeMap::<&str, usize>::new();
    for (i, (prefix, role)) in roles.enumerate() {
        let k = count.entry(prefix).or_default();
        *k += 1;
        nodes.push(toml::Value::Table(node(
            format!("{prefix}-{k}"),
            role,
            i + 1,
        )));
    }
    out.insert("nodes".into(), toml::Value::Array(nodes));
    let body = toml::to_string(&out).map_err(|e| e.to_string())?;
    Ok(format!(
        "# Written by `flotilla plan`: {}.\n# Replace each node's addr (10.0.0.N \
         placeholders) with the machine's own, and each tenant's\n# api_keys \
         (sk-...-replace-me placeholders) with keys of your own.\n{body}",
        config.label()
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_space_lists_each_shape_once_and_splits_keep_both_roles() {
        let s = Space {
            nodes: vec![1, 2, 8],
            prefill_shares: vec![0.0, 0.25],
            max_num_seqs: vec![64],
            kv_dtypes: vec![KvDtype::F16],
        };
        let c = s.configs();
        let labels: Vec<String> = c.iter().map(Config::label).collect();
        assert_eq!(
            labels,
            [
                "1 mixed, max_num_seqs 64, kv f16",
                "2 mixed, max_num_seqs 64, kv f16",
                "1P1D, max_num_seqs 64, kv f16",
                "8 mixed, max_num_seqs 64, kv f16",
                "2P6D, max_num_seqs 64, kv f16",
            ]
        );
    }

    #[test]
    fn the_pareto_front_keeps_only_points_no_other_beats() {
        let point = |nodes: usize, rate: f64| Point {
            config: Config {
                mixed: nodes,
                prefill: 0,
                decode: 0,
                max_num_seqs: 64,
                kv_dtype: KvDtype::F16,
            },
            cost: nodes as f64,
            best: Some(Probe {
                rate,
                met: true,
                measured_ms: vec![],
                lost: 0.0,
                tokens_per_s: 0.0,
            }),
            probes: vec![],
        };
        let plan = Plan {
            points: vec![
                point(2, 10.0),
                point(2, 12.0),
                point(4, 11.0),
                point(4, 25.0),
            ],
            winner: None,
            runs: 0,
        };
        assert_eq!(plan.pareto(), vec![1, 3]);
    }
}
