//! Pipeline groups in the node process: stage 0's executor (its part and
//! its links to the later stages) and a later stage's whole life (a QUIC
//! endpoint answering stage 0 with the layers it is told to run).

use std::ops::Range;
use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use flotilla_config::{ClusterConfig, ClusterSection, Node};
use flotilla_gguf::GgufFile;
use flotilla_model::arch::{ModelConfig, matrix_shapes};
use flotilla_model::pipeline::{PipelineExecutor, Stage, StageLink};
use flotilla_model::{CpuConfig, CpuExecutor, KvDtype};
use flotilla_proto::stage::{ActDtype, StageHello, ToStage};
use flotilla_transport::stage::{QuicStageLink, StageHandler, StageLinkOptions, serve_stage};
use flotilla_transport::tls::TlsMaterial;

use crate::serve::ServeArgs;

/// One later stage as stage 0 dials it.
pub struct StageAt {
    /// Its node name (its certificate's).
    pub name: String,
    /// `host:port` of its QUIC endpoint.
    pub addr: String,
    /// The layers the config gives it, if any.
    pub layers: Option<Range<usize>>,
}

/// What stage 0 needs to form its group.
pub struct PipelinePlan {
    /// The later stages, in order.
    pub stages: Vec<StageAt>,
    /// Stage 0's layers where the config gives them.
    pub head_layers: Option<Range<usize>>,
    /// Stage 0's certificate (the stages accept only it).
    pub tls: Arc<TlsMaterial>,
    /// The links' timeouts and test delay.
    pub link: StageLinkOptions,
    /// How rows travel.
    pub dtype: ActDtype,
    /// How long to keep dialing stages that are not up yet.
    pub wait: Duration,
}

impl PipelinePlan {
    /// The plan of the group whose stage 0 is `node` (None for a node
    /// outside any group or a later stage).
    pub fn for_node(
        cl: &ClusterSection,
        node: &Node,
        delay: Duration,
    ) -> Result<Option<PipelinePlan>> {
        let (Some(group), Some(0)) = (node.pipeline.as_deref(), cl.stage_of(node)) else {
            return Ok(None);
        };
        let stages = cl
            .group(group)
            .into_iter()
            .skip(1)
            .map(|(_, n)| StageAt {
                name: n.name.clone(),
                addr: n.addr.clone(),
                layers: n.layers.clone(),
            })
            .collect();
        let tls = Arc::new(
            TlsMaterial::load(&cl.certs_dir, &node.name)
                .with_context(|| format!("loading node {}'s certificates", node.name))?,
        );
        let dtype = ActDtype::parse(&cl.pipeline_activations).with_context(|| {
            format!(
                "[cluster] pipeline_activations '{}' is f16 or f32",
                cl.pipeline_activations
            )
        })?;
        Ok(Some(PipelinePlan {
            stages,
            head_layers: node.layers.clone(),
            tls,
            link: StageLinkOptions {
                idle_timeout: cl.down_after().max(Duration::from_millis(500)),
                connect_timeout: cl.down_after().max(Duration::from_millis(500)),
                delay,
                ..StageLinkOptions::default()
            },
            dtype,
            wait: Duration::from_secs(120),
        }))
    }
}

/// Multiply-adds a decoded token costs in one layer, and in the head.
fn costs(cfg: &ModelConfig) -> (usize, usize) {
    let layer = matrix_shapes(cfg)
        .iter()
        .filter(|(n, _, _)| n.starts_with("blk.0."))
        .map(|(_, r, c)| r * c)
        .sum();
    (layer, cfg.vocab * cfg.n_embd)
}

/// Layers for `stages` stages of a model, stage 0 (which also runs the
/// head for every decoded token) given fewer so that each stage's
/// multiply-adds a decoded token are as even as whole layers allow.
pub fn split_by_cost(cfg: &ModelConfig, stages: usize) -> Vec<Range<usize>> {
    let n = cfg.n_layer;
    let (layer, head) = costs(cfg);
    let total = (head + n * layer) as f64;
    let share = total / stages as f64;
    // Stage 0: its share less the head, in layers, at least one, leaving
    // one for each later stage.
    let k0 =
        (((share - head as f64) / layer as f64).round().max(1.0) as usize).min(n - (stages - 1));
    let rest = n - k0;
    let mut out = Vec::with_capacity(stages);
    out.push(0..k0);
    let mut start = k0;
    for i in 0..stages - 1 {
        let k = rest / (stages - 1) + usize::from(i < rest % (stages - 1));
        out.push(start..start + k);
        start += k;
    }
    out
}

/// Stage 0's executor: its own part (the ends and the first layers) and a
/// link to each later stage, dialed until it answers or `plan.wait`
/// passes, each told its layers (the config's, or a split by cost,
/// printed).
pub fn pipeline_executor(
    g: &GgufFile,
    path: &Path,
    cpu: &CpuConfig,
    plan: &PipelinePlan,
) -> Result<PipelineExecutor> {
    let cfg = ModelConfig::from_gguf(g)?;
    let s = plan.stages.len() + 1;
    if s > cfg.n_layer {
        bail!(
            "a pipeline of {s} stages needs {s} layers or more; the model has {}",
            cfg.n_layer
        );
    }
    let layers: Vec<Range<usize>> = match &plan.head_layers {
        Some(h) => std::iter::once(h.clone())
            .chain(plan.stages.iter().map(|s| s.layers.clone().unwrap_or(0..0)))
            .collect(),
        None => split_by_cost(&cfg, s),
    };
    if layers.last().map(|l| l.end) != Some(cfg.n_layer) {
        bail!(
            "the pipeline's stages run layers up to {}, the model has {}: the last stage's layers \
             must end at {}",
            layers.last().map_or(0, |l| l.end),
            cfg.n_layer,
            cfg.n_layer
        );
    }
    let (layer_macs, head_macs) = costs(&cfg);
    let desc: Vec<String> = layers
        .iter()
        .enumerate()
        .map(|(i, l)| {
            let macs = l.len() * layer_macs + if i == 0 { head_macs } else { 0 };
            format!(
                "{}..{} ({:.0} M multiply-adds a token)",
                l.start,
                l.end,
                macs as f64 / 1e6
            )
        })
        .collect();
    eprintln!(
        "flotilla: pipeline of {s} stages, layers {}{}; rows in {}",
        desc.join(", "),
        if plan.head_layers.is_some() {
            " (the config's)"
        } else {
            " (split by cost)"
        },
        plan.dtype.name()
    );
    let head = crate::alloc::loading(|| {
        CpuExecutor::from_gguf_part(g, cpu, Some((layers[0].clone(), true)))
    })
    .context("loading stage 0's layers")?;
    let mut links: Vec<(Box<dyn StageLink>, Range<usize>)> = Vec::new();
    let deadline = Instant::now() + plan.wait;
    for (st, l) in plan.stages.iter().zip(&layers[1..]) {
        let link = loop {
            match QuicStageLink::connect(&st.addr, &st.name, &plan.tls, &plan.link) {
                Ok(link) => break link,
                Err(e) if Instant::now() < deadline => {
                    tracing::info!("waiting for stage {}: {e}", st.name);
                    std::thread::sleep(Duration::from_millis(500));
                }
                Err(e) => bail!(
                    "stage {} did not answer within {:?}: {e}",
                    st.name,
                    plan.wait
                ),
            }
        };
        links.push((Box::new(link), l.clone()));
    }
    let bytes = std::fs::metadata(path)?.len();
    let name = model_name(g);
    let exec = PipelineExecutor::connect(head, links, plan.dtype, bytes, &name)
        .map_err(anyhow::Error::msg)?;
    // A lost stage is dialed again until it answers; the group then forms
    // again (the engine asks every second).
    let stages: Vec<(String, String)> = plan
        .stages
        .iter()
        .map(|s| (s.addr.clone(), s.name.clone()))
        .collect();
    let (tls, opts) = (plan.tls.clone(), plan.link.clone());
    Ok(exec.with_redial(Box::new(move |i| {
        let (addr, name) = &stages[i];
        QuicStageLink::connect(addr, name, &tls, &opts).map(|l| Box::new(l) as Box<dyn StageLink>)
    })))
}

fn model_name(g: &GgufFile) -> String {
    g.str_opt("general.name")
        .ok()
        .flatten()
        .unwrap_or("")
        .to_string()
}

/// A later stage's process: answers its group's stage 0 on this node's
/// QUIC address with the layers stage 0 names (loaded then, with the KV
/// cache stage 0's hello sizes) until SIGTERM or Ctrl-C.
pub async fn run_stage(
    args: &ServeArgs,
    cfg: &ClusterConfig,
    cl: &ClusterSection,
    node: &Node,
    tls: TlsMaterial,
) -> Result<()> {
    let group = node.pipeline.clone().expect("a stage is in a group");
    let (_, stage0) = cl.group(&group)[0];
    let model = args.model.with_config(&cfg.model)?;
    let path = model.path()?;
    let bytes = std::fs::metadata(&path)?.len();
    let name = model_name(&GgufFile::open(&path)?);
    let base = model.cpu_config(1, 1)?;
    let file = path.clone();
    let loader = Box::new(move |h: &StageHello| -> Result<CpuExecutor, String> {
        let t = Instant::now();
        let g = GgufFile::open(&file).map_err(|e| e.to_string())?;
        let c = CpuConfig {
            num_blocks: h.num_blocks as usize,
            block_size: h.block_size as usize,
            max_batch_tokens: h.max_batch_tokens as usize,
            kv_dtype: KvDtype::parse(&h.kv_dtype)?,
            ..base.clone()
        };
        let layers = h.layers.0 as usize..h.layers.1 as usize;
        let e = crate::alloc::loading(|| {
            CpuExecutor::from_gguf_part(&g, &c, Some((layers.clone(), false)))
        })
        .map_err(|e| e.to_string())?;
        eprintln!(
            "flotilla: stage loaded layers {}..{} ({:.1} MB of weights, KV {} blocks of {} in {}) in {:.2}s",
            layers.start,
            layers.end,
            flotilla_model::Executor::model_spec(&e).weight_bytes as f64 / 1e6,
            h.num_blocks,
            h.block_size,
            h.kv_dtype,
            t.elapsed().as_secs_f64()
        );
        Ok(e)
    });
    let stage = Arc::new(Mutex::new(Stage::loading(loader, bytes, name)));
    let s = stage.clone();
    let handler: StageHandler = Arc::new(Mutex::new(move |m: ToStage| {
        s.lock().unwrap_or_else(|e| e.into_inner()).handle(m)
    }));
    eprintln!(
        "flotilla: node {} is stage {} of pipeline {group} on QUIC {}; stage 0 is {}",
        node.name,
        cl.stage_of(node).unwrap_or(0),
        node.listen,
        stage0.name
    );
    let idle = cl.down_after().max(Duration::from_millis(500));
    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
        .context("installing the SIGTERM handler")?;
    tokio::select! {
        r = serve_stage(node.listen, &tls, stage0.name.clone(), idle, handler) => {
            r.map_err(anyhow::Error::msg)
        }
        _ = term.recv() => Ok(()),
        _ = tokio::signal::ctrl_c() => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_split_by_cost_gives_stage_zero_fewer_layers_for_the_head() {
        let path = flotilla_hub::test_model_path();
        let g = GgufFile::open(&path).unwrap();
        let cfg = ModelConfig::from_gguf(&g).unwrap();
        for s in 2..=4 {
            let split = split_by_cost(&cfg, s);
            assert_eq!(split.len(), s);
            assert_eq!(split[0].start, 0);
            assert_eq!(split.last().unwrap().end, cfg.n_layer);
            for w in split.windows(2) {
                assert_eq!(w[0].end, w[1].start);
                assert!(!w[1].is_empty());
            }
            // The head costs stage 0 layers.
            assert!(split[0].len() < split[1].len(), "{split:?}");
            let (layer, head) = costs(&cfg);
            let cost: Vec<usize> = split
                .iter()
                .enumerate()
                .map(|(i, l)| l.len() * layer + if i == 0 { head } else { 0 })
                .collect();
            let (lo, hi) = (cost.iter().min().unwrap(), cost.iter().max().unwrap());
            assert!(hi - lo <= 2 * layer, "{s} stages: {cost:?}");
        }
    }
}
