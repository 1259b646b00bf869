//! `flotilla node` (one node of a multi-node cluster), `flotilla cluster`
//! (every node of a config as its own process on this machine, for a
//! try-out) and `flotilla certs` (the cluster CA and node certificates).

use std::path::{Path, PathBuf};
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use flotilla_actors::{Clock, EngineOptions, spawn_engine};
use flotilla_cluster::{
    ClusterEngine, Connect, WorkerEnd, WorkerOptions, node_settings, router_options, run_worker,
};
use flotilla_config::{ClusterConfig, ClusterSection, Node, Role};
use flotilla_engine::KvMigration;
use flotilla_gateway::GatewayConfig;
use flotilla_model::Executor;
use flotilla_telemetry::Metrics;
use flotilla_transport::members::JoinPolicy;
use flotilla_transport::quic::{LinkFaults, PeerSpec, QuicOptions, QuicTransport};
use flotilla_transport::tls::{self, TlsMaterial};
use flotilla_transport::{Transport, new_epoch};

use crate::serve::{self, MonotonicClock, ServeArgs, serve_http};

/// `flotilla node` flags: the node's name plus every `serve` flag (engine
/// and model flags apply to engine nodes; the Router listens on its
/// config's `http` address, not on --host/--port).
#[derive(clap::Args, Clone)]
pub struct NodeArgs {
    /// This node's name in the config's [[nodes]] (with --join: its name in
    /// its certificate, not in the config).
    #[arg(long)]
    pub name: String,
    /// Join a running cluster as a node that is not in the config's
    /// [[nodes]]: its role is the one in its certificate (`flotilla certs
    /// issue --node NAME --role worker`); it reports to the Routers named
    /// here (names or QUIC addresses from the config, comma-separated;
    /// `--join` alone: every Router), which place work on it from its first
    /// heartbeat. Needs --listen.
    #[arg(long, value_name = "ROUTER_ADDR", num_args = 0..=1, default_missing_value = "")]
    pub join: Option<String>,
    /// With --join: the UDP socket its QUIC endpoint binds; peers reach it
    /// at the address they see it dial from, so bind an address they can
    /// route to (or 0.0.0.0).
    #[arg(long, value_name = "ADDR")]
    pub listen: Option<std::net::SocketAddr>,
    /// With --join: where it serves /metrics, /health and /ready (TCP).
    #[arg(long, value_name = "ADDR")]
    pub metrics_addr: Option<std::net::SocketAddr>,
    #[command(flatten)]
    pub serve: ServeArgs,
    /// On SIGTERM an engine node drains: it takes no new requests, lets
    /// those it runs finish for up to this many seconds, then leaves (the
    /// Router moves what still runs to other nodes). A second SIGTERM or
    /// Ctrl-C stops it at once.
    #[arg(long, default_value_t = 30)]
    pub drain_grace_s: u64,
    /// Test and benchmark hook: delay every frame this node sends (to the
    /// Router, to peers, to its pipeline stages) by this many ms, as a
    /// longer link would (where the kernel has no netem).
    #[arg(long, default_value_t = 0)]
    pub fault_delay_ms: u64,
    /// Test hook: one frame in this many is delayed four times as long, as
    /// a lost packet's retransmission would be (0 = never).
    #[arg(long, hide = true, default_value_t = 0)]
    pub fault_loss_one_in: u32,
}

/// `flotilla cluster` flags.
#[derive(clap::Args, Clone)]
pub struct ClusterArgs {
    /// Cluster config with [[nodes]].
    #[arg(long, default_value = "cluster-configs/two-workers.toml")]
    pub config: PathBuf,
    /// Flags for every node (model and engine flags), after `--`.
    #[arg(last = true)]
    pub node_args: Vec<String>,
}

/// `flotilla certs` subcommands.
#[derive(clap::Subcommand, Clone)]
pub enum CertsCmd {
    /// Create the cluster CA (ca.pem, ca.key) in --dir.
    Init {
        /// Directory for the CA.
        #[arg(long)]
        dir: PathBuf,
    },
    /// Issue a node certificate (NODE.pem, NODE.key) signed by the CA in --dir.
    Issue {
        /// Directory holding the CA.
        #[arg(long)]
        dir: PathBuf,
        /// Node name (as in the config's [[nodes]]).
        #[arg(long)]
        node: String,
        /// router, worker (mixed), prefill or decode.
        #[arg(long)]
        role: String,
        /// Days the certificate is valid (1 to 3650).
        #[arg(long, default_value_t = 365)]
        days: u64,
        /// Replace the node's existing certificate and key (a new key);
        /// restart the node to use them.
        #[arg(long)]
        renew: bool,
    },
}

pub fn certs(cmd: CertsCmd) -> Result<()> {
    match cmd {
        CertsCmd::Init { dir } => {
            tls::init_ca(&dir)?;
            println!("created the cluster CA in {}", dir.display());
        }
        CertsCmd::Issue {
            dir,
            node,
            role,
            days,
            renew,
        } => {
            let role: Role = role.parse().map_err(anyhow::Error::msg)?;
            let validity = Duration::from_secs(days.saturating_mul(86_400));
            let until = tls::issue_for(&dir, &node, role, validity, renew)?;
            let days_left = until
                .duration_since(std::time::SystemTime::now())
                .map_or(0, |d| d.as_secs() / 86_400);
            let serial = tls::node_serial(&dir, &node)?;
            println!(
                "{} {node} ({role}) in {}, serial {serial}, valid for {days_left} more days{}",
                if renew { "renewed" } else { "issued" },
                dir.display(),
                if renew {
                    ": restart the node to use it"
                } else {
                    ""
                }
            );
        }
    }
    Ok(())
}

fn init_logging() {
    let filter = tracing_subscriber::EnvFilter::try_from_env("FLOTILLA_LOG").unwrap_or_else(|_| {
        tracing_subscriber::EnvFilter::new("warn,flotilla_cluster=info,flotilla_transport=info")
    });
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        // Colour only on a terminal: `flotilla cluster` sends each node's
        // stderr to a log file, where escape codes are noise.
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .init();
}

fn load_cluster(path: &Path) -> Result<(ClusterConfig, ClusterSection)> {
    let cfg = ClusterConfig::load(path)?;
    let cl = cfg.cluster.clone().with_context(|| {
        format!(
            "{} has no [[nodes]]: `flotilla node` and `flotilla cluster` need a cluster config \
             (see cluster-configs/two-workers.toml); `flotilla serve` runs one node without one",
            path.display()
        )
    })?;
    Ok((cfg, cl))
}

/// Transport settings from the config's [cluster] table, for node `node`
/// (`me`); `routers`: the Routers it speaks to (a joined node's may be
/// fewer than the config's).
fn quic_options(
    cl: &ClusterSection,
    node: u32,
    me: &Node,
    routers: &[u32],
    faults: LinkFaults,
) -> QuicOptions {
    let hb = Duration::from_millis(cl.heartbeat_interval_ms);
    let router = me.role == Role::Router;
    let joining = cl.node_id(&me.name).is_none();
    QuicOptions {
        node,
        nodes: cl
            .nodes
            .iter()
            .enumerate()
            .map(|(i, n)| PeerSpec {
                name: n.name.clone(),
                role: n.role,
                // A group's later stages run no cluster link: none dials
                // them. Routers say nothing to each other, and a node
                // dials only its own Routers.
                addr: if cl.stage_of(n).is_some_and(|s| s > 0)
                    || (n.role == Role::Router && (router || !routers.contains(&(i as u32))))
                {
                    String::new()
                } else {
                    n.addr.clone()
                },
            })
            .collect(),
        joining: joining.then(|| PeerSpec {
            name: me.name.clone(),
            role: me.role,
            addr: String::new(),
        }),
        join: JoinPolicy {
            accept: cl.allow_join,
            revoked: cl.revocation_list.clone(),
        },
        listen: me.listen,
        bulk_port: me.bulk_port,
        epoch: new_epoch(),
        frame_len_max_bytes: cl.frame_len_max_bytes,
        send_queue_len_max: cl.send_queue_len_max,
        bulk_len_max_bytes: 4 << 30,
        keep_alive: hb,
        idle_timeout: Duration::from_millis(cl.idle_timeout_ms),
        // A dead peer must be noticed within the down-after bound.
        connect_timeout: cl.down_after().max(Duration::from_millis(200)),
        reconnect_backoff_max: Duration::from_millis(cl.reconnect_backoff_max_ms),
        faults,
    }
}

/// A node that is not in the config (`--join`): its id is its name's,
/// its role its certificate's, its Routers those `join` names (all if
/// empty).
fn joining_node(
    args: &NodeArgs,
    cl: &ClusterSection,
    path: &Path,
    join: &str,
) -> Result<(u32, Node, Vec<u32>)> {
    if let Some(n) = cl.node(&args.name) {
        bail!(
            "{} has a node named '{}' ({}): start it without --join",
            path.display(),
            args.name,
            n.role
        );
    }
    if !cl.allow_join {
        bail!(
            "{} sets [cluster] allow_join = false: nodes cannot join at run time",
            path.display()
        );
    }
    let Some(listen) = args.listen else {
        bail!("--join needs --listen ADDR: the UDP socket this node's QUIC endpoint binds");
    };
    let certs = TlsMaterial::load(&cl.certs_dir, &args.name).with_context(|| {
        format!(
            "loading the certificate of {} from {}: issue one with `flotilla certs issue --dir \
             {} --node {} --role worker` on the machine that holds the cluster CA",
            args.name,
            cl.certs_dir.display(),
            cl.certs_dir.display(),
            args.name
        )
    })?;
    let role = certs.identity()?.role;
    if !matches!(role, Role::Worker | Role::Prefill | Role::Decode) {
        bail!(
            "the certificate of {} is for a {role}: only worker, prefill and decode nodes join \
             at run time (routers are declared in [[nodes]])",
            args.name
        );
    }
    let all: Vec<(u32, &Node)> = cl.routers().collect();
    let routers: Vec<u32> =
        if join.trim().is_empty() {
            all.iter().map(|(i, _)| *i).collect()
        } else {
            join.split(',')
                .map(str::trim)
                .map(|want| {
                    all.iter()
                    .find(|(_, n)| n.name == want || n.addr == want)
                    .map(|(i, _)| *i)
                    .with_context(|| {
                        let known: Vec<String> =
                            all.iter().map(|(_, n)| format!("{} ({})", n.name, n.addr)).collect();
                        format!(
                            "--join {want}: no Router of {} has that name or address (routers: {})",
                            path.display(),
                            known.join(", ")
                        )
                    })
                })
                .collect::<Result<_>>()?
        };
    let node = Node {
        name: args.name.clone(),
        role,
        addr: String::new(),
        listen,
        bulk_port: 0,
        http: None,
        metrics: args.metrics_addr,
        pipeline: None,
        layers: None,
    };
    Ok((flotilla_proto::joined_node_id(&args.name), node, routers))
}

pub fn run(args: NodeArgs) -> Result<()> {
    init_logging();
    let Some(path) = args.serve.config.clone() else {
        bail!("flotilla node needs --config: a cluster config with [[nodes]]");
    };
    if args.serve.no_auth {
        bail!("--no-auth is for `flotilla serve`; a cluster takes its tenants from --config");
    }
    if args.serve.host.is_some() || args.serve.port.is_some() {
        bail!(
            "--host and --port are for `flotilla serve`; a node listens where its [[nodes]] \
             table says (addr or listen for QUIC, http on the router, metrics on an engine node)"
        );
    }
    let (cfg, cl) = load_cluster(&path)?;
    let (id, node, routers) = match &args.join {
        Some(join) => joining_node(&args, &cl, &path, join)?,
        None => {
            if args.listen.is_some() || args.metrics_addr.is_some() {
                bail!(
                    "--listen and --metrics-addr are for a node that joins (--join); a node of \
                     the config listens where its [[nodes]] table says"
                );
            }
            let Some(id) = cl.node_id(&args.name) else {
                let names: Vec<&str> = cl.nodes.iter().map(|n| n.name.as_str()).collect();
                bail!(
                    "{} has no node named '{}' (nodes: {}); a node that is not in the config \
                     joins with --join",
                    path.display(),
                    args.name,
                    names.join(", ")
                );
            };
            (
                id,
                cl.nodes[id as usize].clone(),
                cl.routers().map(|(i, _)| i).collect::<Vec<u32>>(),
            )
        }
    };
    let certs = TlsMaterial::load(&cl.certs_dir, &node.name).with_context(|| {
        format!(
            "loading the certificates of node {} from {}: create them with `flotilla certs init \
             --dir {dir}` and `flotilla certs issue --dir {dir} --node {} --role {}` \
             (`flotilla cluster` does this for a local try-out)",
            node.name,
            cl.certs_dir.display(),
            node.name,
            node.role,
            dir = cl.certs_dir.display(),
        )
    })?;
    let faults = LinkFaults {
        delay: Duration::from_millis(args.fault_delay_ms),
        loss_one_in: args.fault_loss_one_in,
    };
    let clock: Arc<dyn Clock> = Arc::new(MonotonicClock(Instant::now()));
    let tracing = serve::tracing_from(&args.serve, &cfg, &node.name, clock.as_ref())?;
    let tracing_end = tracing.clone();
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?;
    let plan = crate::stage::PipelinePlan::for_node(&cl, &node, faults.delay)?;
    let later_stage = cl.stage_of(&node).is_some_and(|s| s > 0);
    let ran = rt.block_on(async move {
        if later_stage {
            crate::stage::run_stage(&args.serve, &cfg, &cl, &node, certs).await
        } else if node.role == Role::Router {
            let f = serve::front(&args.serve)?;
            let quic = quic_options(&cl, id, &node, &routers, faults);
            let epoch = quic.epoch;
            let block_size = cfg.engine.block_size.unwrap_or(args.serve.model.block_size);
            let (connect, _quic) = connect_quic(quic, certs, node.listen);
            let engine = ClusterEngine::start(
                connect,
                router_options(
                    &cfg,
                    &cl,
                    cl.engines()
                        .map(|(i, n)| (i, n.name.clone(), n.role))
                        .collect(),
                    block_size,
                ),
            )
            .await
            .map_err(anyhow::Error::msg)?;
            let workers: Vec<&str> = cl.engines().map(|(_, n)| n.name.as_str()).collect();
            let what = format!(
                "router {} on QUIC {} epoch {epoch}; workers: {}; API keys from {}",
                node.name,
                node.listen,
                workers.join(", "),
                path.display()
            );
            let http = node.http.expect("a validated router has http");
            let gw =
                GatewayConfig {
                    model_name: f.model_name.clone(),
                    max_model_len: f.max_model_len,
                    body_limit_bytes: args.serve.max_body_bytes,
                    cluster: Arc::new(f.cluster),
                    constraints: Some(flotilla_grammar::compiler_for(&f.text).map_err(|e| {
                        anyhow::anyhow!("structured output over this tokenizer: {e}")
                    })?),
                    tracing: tracing.clone(),
                    limits_share: cl.router_share(&node.name).unwrap_or((0, 1)),
                    server_info: serde_json::json!({
                        "server": "flotilla",
                        "version": env!("CARGO_PKG_VERSION"),
                        "role": "router",
                        "routers": cl.routers().map(|(_, n)| n.name.clone()).collect::<Vec<_>>(),
                        "model": f.model_name,
                        "max_model_len": f.max_model_len,
                        "nodes": cl.engines().map(|(_, n)| serde_json::json!({
                            "name": n.name, "role": n.role.to_string(),
                        })).collect::<Vec<_>>(),
                    }),
                };
            let metrics = Arc::new(Metrics::new()?);
            serve_http(Arc::new(engine), f.text, metrics, gw, http, &what).await
        } else {
            let r = serve::resolve_with(&args.serve, plan.as_ref(), node.role != Role::Prefill)?;
            let metrics = Arc::new(Metrics::new()?);
            let text = Arc::new(r.text);
            let scrape = node.metrics.map(|addr| {
                let mut info = r.server_info.clone();
                info["role"] = serde_json::json!(node.role.to_string());
                info["node"] = serde_json::json!(node.name);
                let gw = GatewayConfig {
                    server_info: info,
                    ..GatewayConfig::new(r.model_name.clone(), r.max_model_len, r.cluster.clone())
                };
                (addr, gw, text.clone(), metrics.clone())
            });
            let blocks = r.sched.num_blocks;
            let dtype = r.exec.kv_spec().dtype;
            let exec: Box<dyn Executor> = r.exec;
            let constraints = flotilla_grammar::compiler_for(&text)
                .map_err(|e| anyhow::anyhow!("structured output over this tokenizer: {e}"))?;
            let engine = spawn_engine(
                exec,
                EngineOptions {
                    sched: r.sched,
                    check_invariants: None,
                    constraints: Some(constraints),
                    offload_path: r.offload_path.clone(),
                    tracing: tracing.clone(),
                    draft: r.draft,
                },
                clock,
                metrics,
            )
            .await
            .context("starting the engine")?;
            let engine = Arc::new(engine);
            // The node's own /metrics, /health and /ready, where it has an
            // address for them (the Router's page shows the cluster's view).
            let mut scrape_at = String::new();
            if let Some((addr, gw, text, metrics)) = scrape {
                let app = flotilla_gateway::observability_router(
                    engine.clone() as Arc<dyn flotilla_engine::Engine>,
                    text,
                    metrics,
                    gw,
                );
                let listener = tokio::net::TcpListener::bind(addr)
                    .await
                    .with_context(|| format!("node {}: cannot listen on metrics {addr}", node.name))?;
                scrape_at = format!("; metrics at http://{}/metrics", listener.local_addr()?);
                tokio::spawn(async move {
                    if let Err(e) = axum::serve(listener, app).await {
                        tracing::warn!("the metrics address stopped: {e}");
                    }
                });
            }
            let quic = quic_options(&cl, id, &node, &routers, faults);
            eprintln!(
                "flotilla: node {} ({}) on QUIC {} epoch {}; KV cache {blocks} {dtype} blocks{scrape_at}",
                node.name, node.role, node.listen, quic.epoch
            );
            let settings = node_settings(&cfg, &cl, routers, node.role, &r.model_name);
            // Every role moves KV: prefill and decode nodes for P/D, and
            // any node a drained one's requests move to (or from).
            let kv: Option<Arc<dyn KvMigration>> = Some(engine.clone() as _);
            let (drain_tx, drain_rx) = tokio::sync::watch::channel(None);
            let opts = WorkerOptions {
                drain: Some(drain_rx),
                tracing: tracing.clone(),
                ..WorkerOptions::new(settings)
            };
            let mut term =
                tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
                    .context("installing the SIGTERM handler")?;
            let grace = Duration::from_secs(args.drain_grace_s);
            let (connect, quic) = connect_quic(quic, certs, node.listen);
            let worker = run_worker(connect, engine.clone(), kv, opts);
            tokio::pin!(worker);
            let mut draining = false;
            loop {
                tokio::select! {
                    end = &mut worker => {
                        let end = end.map_err(anyhow::Error::msg)?;
                        if end == WorkerEnd::Left {
                            // The Leaving frame is queued: give it a moment
                            // to go out (if it is lost, the Router notices
                            // the silence within its down bound).
                            tokio::time::sleep(Duration::from_millis(200)).await;
                            eprintln!("flotilla: node {} drained; exiting", node.name);
                        }
                        break;
                    }
                    _ = term.recv() => {
                        if draining {
                            break;
                        }
                        draining = true;
                        eprintln!(
                            "flotilla: node {} draining (SIGTERM): no new requests; leaving when \
                             idle or in {} s (SIGTERM again to stop now)",
                            node.name,
                            grace.as_secs()
                        );
                        let _ = drain_tx.send(Some(grace));
                    }
                    _ = tokio::signal::ctrl_c() => break,
                }
            }
            if let Some(t) = quic.get() {
                t.close();
            }
            engine.stop();
            Ok(())
        }
    });
    if let Some(t) = tracing_end {
        t.shutdown();
    }
    ran
}

/// What makes a node's QUIC transport when its actor starts (its arrivals
/// go to the actor), and where the transport is kept once made (to close
/// it at exit).
fn connect_quic(
    opts: QuicOptions,
    certs: TlsMaterial,
    listen: std::net::SocketAddr,
) -> (Connect, Arc<OnceLock<Arc<QuicTransport>>>) {
    let made = Arc::new(OnceLock::new());
    let keep = made.clone();
    let connect: Connect = Box::new(move |sink| {
        let t = QuicTransport::start(opts, &certs, sink)
            .map_err(|e| format!("starting QUIC on {listen}: {e}"))?;
        let _ = keep.set(t.clone());
        Ok(t as Arc<dyn Transport>)
    });
    (connect, made)
}

/// Creates the CA and any missing node certificates for a local try-out.
fn ensure_certs(cl: &ClusterSection) -> Result<()> {
    let dir = &cl.certs_dir;
    if !dir.join("ca.pem").exists() {
        tls::init_ca(dir)?;
        eprintln!("flotilla: created a cluster CA in {}", dir.display());
    }
    for n in &cl.nodes {
        if !tls::has_node(dir, &n.name) {
            tls::issue(dir, &n.name, n.role)?;
        }
    }
    Ok(())
}

pub fn cluster(args: ClusterArgs) -> Result<()> {
    let (_, cl) = load_cluster(&args.config)?;
    ensure_certs(&cl)?;
    let exe = std::env::current_exe().context("finding this binary")?;
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    rt.block_on(async move {
        let mut children = Vec::new();
        // Engine nodes first: the Router's first requests find them loading.
        let mut order: Vec<_> = cl.nodes.iter().collect();
        order.sort_by_key(|n| n.role == Role::Router);
        for n in order {
            let child = tokio::process::Command::new(&exe)
                .arg("node")
                .arg("--config")
                .arg(&args.config)
                .arg("--name")
                .arg(&n.name)
                .args(&args.node_args)
                .kill_on_drop(true)
                .spawn()
                .with_context(|| format!("starting node {}", n.name))?;
            eprintln!(
                "flotilla: started node {} ({}) as process {}",
                n.name,
                n.role,
                child.id().unwrap_or(0)
            );
            children.push((n.name.clone(), child));
        }
        let (name_tx, mut name_rx) = tokio::sync::mpsc::unbounded_channel();
        for (name, mut child) in children {
            let tx = name_tx.clone();
            tokio::spawn(async move {
                let status = child.wait().await;
                let _ = tx.send((name, status));
            });
        }
        // A node that exits is reported and the rest keep running (the
        // Router routes around it), so a try-out can show fail-over; a
        // restarted node is the user's to start (`flotilla node ...`).
        let mut running = cl.nodes.len();
        // SIGTERM (kill, systemd) as well as Ctrl-C: either way the nodes
        // are killed with us (`kill_on_drop`), never left running.
        let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
            .context("installing the SIGTERM handler")?;
        loop {
            tokio::select! {
                _ = tokio::signal::ctrl_c() => {
                    eprintln!("flotilla: stopping the cluster");
                    return Ok(());
                }
                _ = term.recv() => {
                    eprintln!("flotilla: stopping the cluster (SIGTERM)");
                    return Ok(());
                }
                Some((name, status)) = name_rx.recv() => {
                    running -= 1;
                    eprintln!("flotilla: node {name} exited ({status:?}); {running} still running");
                    if running == 0 {
                        bail!("every node exited");
                    }
                }
            }
        }
    })
}
