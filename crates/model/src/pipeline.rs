//! Pipeline parallelism: one model's layers split across processes
//! (usually nodes), a *group* that the Router sees as one engine.
//!
//! Stage 0 runs the engine as any node does (Scheduler, pool, worker) with
//! a [`PipelineExecutor`]: it holds the embedding, the first run of layers,
//! the final norm and the head. Each later stage ([`Stage`]) holds a run of
//! layers and their KV cache, and nothing else. A step: stage 0 checks the
//! batch, embeds it and runs its layers, then hands the rows to stage 1,
//! whose answer goes to stage 2, and so on; the last stage answers with
//! the output rows only, which stage 0 norms, projects and samples (the
//! masks, biases, penalties and drafts of a step never leave it, and a
//! tied head is the embedding stage 0 holds already). Every hop is a
//! round trip from stage 0 ([`StageLink`]), so a stage needs no link but
//! stage 0's and a stage's death is seen at the next hop.
//!
//! Every stage holds the same number of KV blocks: a block id names the
//! same positions everywhere and one pool (stage 0's Scheduler) decides
//! for the group. A block's bytes in a group are its stages' bytes in
//! layer order: the same bytes one node holds for it, so KV migration,
//! the offload tier and prefix caching work on a group unchanged.

use std::ops::Range;
use std::sync::Mutex;

use flotilla_exec::{ExecError, Executor, KvSpec, ModelSpec, OutputKind, SeqInput, StepOutputs};
pub use flotilla_proto::stage::StageLink;
use flotilla_proto::stage::{
    ActDtype, FromStage, STAGE_FRAME_MAX, STAGE_VERSION, StageHello, StageSeq, ToStage,
    decode_from_stage, decode_to_stage, encode, frame_len,
};

use crate::CpuExecutor;
use crate::sampling::SamplingParams;

/// Rows of the residual stream as they travel.
pub fn encode_rows(rows: &[f32], dtype: ActDtype, out: &mut Vec<u8>) {
    out.clear();
    out.reserve(rows.len() * dtype.bytes());
    match dtype {
        ActDtype::F32 => rows
            .iter()
            .for_each(|v| out.extend_from_slice(&v.to_le_bytes())),
        ActDtype::F16 => rows
            .iter()
            .for_each(|v| out.extend_from_slice(&half::f16::from_f32(*v).to_le_bytes())),
    }
}

/// Rows back from their bytes; `bytes` holds exactly `out.len()` values.
fn decode_rows(bytes: &[u8], dtype: ActDtype, out: &mut [f32]) {
    match dtype {
        ActDtype::F32 => {
            for (v, b) in out.iter_mut().zip(bytes.chunks_exact(4)) {
                *v = f32::from_le_bytes([b[0], b[1], b[2], b[3]]);
            }
        }
        ActDtype::F16 => {
            for (v, b) in out.iter_mut().zip(bytes.chunks_exact(2)) {
                *v = half::f16::from_le_bytes([b[0], b[1]]).to_f32();
            }
        }
    }
}

/// What a sequence asks of a step, rebuilt on a stage from its row count
/// (a stage never samples: only the count of output rows matters).
fn rows_kind(rows: u32) -> OutputKind {
    match rows {
        0 => OutputKind::None,
        1 => OutputKind::Logits,
        n => OutputKind::Verify {
            params: SamplingParams::greedy(),
            draft: n as usize - 1,
        },
    }
}

/// Loads the part of the model a hello names: the file's layers (no
/// ends), with its KV cache (block size, element type, block count) and
/// steps of up to its token count.
pub type PartLoader = Box<dyn FnMut(&StageHello) -> Result<CpuExecutor, String> + Send>;

/// A later stage: a part of the model (layers only) answering stage 0's
/// frames. Anything a frame asks that this stage cannot do is refused
/// with the reason, never a panic.
pub struct Stage {
    exec: Option<CpuExecutor>,
    loader: Option<PartLoader>,
    model_bytes: u64,
    model_name: String,
    out: StepOutputs,
    /// Set by an accepted hello: steps before it are refused.
    ready: bool,
}

impl Stage {
    /// A stage over `exec` (built by [`CpuExecutor::from_gguf_part`]
    /// without the ends), for the model file of `model_bytes` bytes named
    /// `model_name`; a hello for other layers is refused.
    pub fn new(exec: CpuExecutor, model_bytes: u64, model_name: String) -> Stage {
        Stage {
            exec: Some(exec),
            loader: None,
            model_bytes,
            model_name,
            out: StepOutputs::default(),
            ready: false,
        }
    }

    /// A stage that loads the layers stage 0's hello names (and loads
    /// again when a later hello names others), so a stage's layers are
    /// decided in one place: stage 0's.
    pub fn loading(loader: PartLoader, model_bytes: u64, model_name: String) -> Stage {
        Stage {
            exec: None,
            loader: Some(loader),
            model_bytes,
            model_name,
            out: StepOutputs::default(),
            ready: false,
        }
    }

    /// The executor of this stage's layers, once loaded.
    pub fn exec(&self) -> Option<&CpuExecutor> {
        self.exec.as_ref()
    }

    fn loaded(&mut self) -> Result<&mut CpuExecutor, String> {
        self.exec
            .as_mut()
            .ok_or_else(|| "no layers loaded".to_string())
    }

    /// Answers one frame.
    pub fn handle(&mut self, msg: ToStage) -> FromStage {
        match self.answer(msg) {
            Ok(a) => a,
            Err(reason) => FromStage::Refused { reason },
        }
    }

    fn answer(&mut self, msg: ToStage) -> Result<FromStage, String> {
        match msg {
            ToStage::Hello(h) => self.hello(h),
            _ if !self.ready => Err("no hello yet".into()),
            ToStage::Step {
                step,
                seqs,
                dtype,
                rows,
                last,
            } => self.step(step, &seqs, dtype, &rows, last),
            ToStage::CopyBlock { src, dst } => {
                let e = self.loaded()?;
                e.copy_block(src, dst).map_err(|e| e.to_string())?;
                Ok(FromStage::Done)
            }
            ToStage::ReadBlock { block } => {
                let e = self.loaded()?;
                let mut data = vec![0; e.kv_spec().bytes_per_block];
                e.read_block(block, &mut data).map_err(|e| e.to_string())?;
                Ok(FromStage::Block { data })
            }
            ToStage::WriteBlock { block, data } => {
                let e = self.loaded()?;
                e.write_block(block, &data).map_err(|e| e.to_string())?;
                Ok(FromStage::Done)
            }
        }
    }

    fn hello(&mut self, h: StageHello) -> Result<FromStage, String> {
        self.ready = false;
        if h.version != STAGE_VERSION {
            return Err(format!(
                "stage frames version {}, this stage speaks {STAGE_VERSION}",
                h.version
            ));
        }
        if (h.model_bytes, h.model_name.as_str()) != (self.model_bytes, self.model_name.as_str()) {
            return Err(format!(
                "stage 0 runs {} ({} bytes), this stage {} ({} bytes)",
                h.model_name, h.model_bytes, self.model_name, self.model_bytes
            ));
        }
        let want = h.layers.0 as usize..h.layers.1 as usize;
        let fits = |e: &CpuExecutor| {
            let kv = e.kv_spec();
            e.part().layers == want
                && kv.block_size == h.block_size as usize
                && kv.dtype.name() == h.kv_dtype
                && e.max_batch_tokens() >= h.max_batch_tokens as usize
        };
        if !self.exec.as_ref().is_some_and(fits)
            && let Some(load) = &mut self.loader
        {
            // The old part goes first: never two in memory.
            self.exec = None;
            self.exec = Some(load(&h)?);
        }
        let Some(exec) = self.exec.as_mut() else {
            return Err("no layers loaded".into());
        };
        let have = exec.part().layers.clone();
        if have != want {
            return Err(format!(
                "stage 0 expects layers {}..{} here, this stage runs {}..{}",
                want.start, want.end, have.start, have.end
            ));
        }
        let part = exec.part().clone();
        let kv = exec.kv_spec();
        if h.block_size as usize != kv.block_size || h.kv_dtype != kv.dtype.name() {
            return Err(format!(
                "stage 0's KV cache has blocks of {} tokens in {}, this stage's {} in {}",
                h.block_size,
                h.kv_dtype,
                kv.block_size,
                kv.dtype.name()
            ));
        }
        if h.max_batch_tokens as usize > exec.max_batch_tokens() {
            return Err(format!(
                "stage 0 runs steps of up to {} tokens, this stage {}",
                h.max_batch_tokens,
                exec.max_batch_tokens()
            ));
        }
        // The group's pool decides the count; a new hello (stage 0
        // started again) starts from an empty cache.
        exec.set_num_blocks(h.num_blocks as usize)
            .map_err(|e| e.to_string())?;
        self.ready = true;
        Ok(FromStage::Ready {
            layers: (part.layers.start as u32, part.layers.end as u32),
            bytes_per_block: exec.kv_spec().bytes_per_block as u64,
            weight_bytes: exec.model_spec().weight_bytes as u64,
        })
    }

    fn step(
        &mut self,
        step: u64,
        seqs: &[StageSeq],
        dtype: ActDtype,
        rows: &[u8],
        last: bool,
    ) -> Result<FromStage, String> {
        if let Some(s) = seqs
            .iter()
            .find(|s| s.out_rows as usize > s.tokens.len() || s.tokens.is_empty())
        {
            return Err(format!(
                "a sequence of {} tokens asks for {} output rows",
                s.tokens.len(),
                s.out_rows
            ));
        }
        let batch: Vec<SeqInput<'_>> = seqs
            .iter()
            .map(|s| SeqInput {
                tokens: &s.tokens,
                start_pos: s.start_pos as usize,
                block_table: &s.block_table,
                output: rows_kind(s.out_rows),
                bias: &[],
                draft_bias: &[],
                allow: None,
            })
            .collect();
        let exec = self.exec.as_mut().ok_or("no layers loaded")?;
        let d = exec.config().n_embd;
        // Checked before anything is written: a refused step leaves the
        // cache as it was.
        let t: usize = seqs.iter().map(|s| s.tokens.len()).sum();
        if rows.len() != t * d * dtype.bytes() {
            return Err(format!(
                "{} bytes of rows for {t} tokens of width {d} in {}",
                rows.len(),
                dtype.name()
            ));
        }
        let t = exec
            .stage_begin(&batch, &mut self.out)
            .map_err(|e| e.to_string())?;
        decode_rows(rows, dtype, exec.stage_rows_mut());
        exec.stage_layers(&batch);
        let mut out = Vec::new();
        if last {
            let x = exec.stage_rows();
            let mut sel = Vec::with_capacity(exec.stage_out_rows().len() * d);
            for &r in exec.stage_out_rows() {
                sel.extend_from_slice(&x[r as usize * d..(r as usize + 1) * d]);
            }
            encode_rows(&sel, dtype, &mut out);
        } else {
            encode_rows(&exec.stage_rows()[..t * d], dtype, &mut out);
        }
        Ok(FromStage::Rows { step, rows: out })
    }
}

/// A stage in this process, reached through the frames' encoding as a
/// remote one is (tests; one machine's stages without the network).
pub struct InProcess(pub Stage);

impl StageLink for InProcess {
    fn call(&mut self, msg: &ToStage) -> Result<FromStage, String> {
        let f = encode(msg).map_err(|e| e.to_string())?;
        let n = frame_len(f[..4].try_into().expect("4 bytes")).map_err(|e| e.to_string())?;
        let m = decode_to_stage(&f[4..4 + n]).map_err(|e| e.to_string())?;
        let a = encode(&self.0.handle(m)).map_err(|e| e.to_string())?;
        decode_from_stage(&a[4..]).map_err(|e| e.to_string())
    }
}

/// A request travelling the later stages: a step's rows (each stage's
/// answer becomes the next stage's input), a block operation (for every
/// stage, or one: each answer kept), or a failure passed on in its place.
enum Job {
    Step(ToStage),
    Op {
        msg: ToStage,
        /// Only this later stage (0 is stage 1); None: every one.
        only: Option<usize>,
        answers: Vec<FromStage>,
    },
    Failed {
        op: bool,
        why: String,
    },
}

/// What comes out of the last stage, in the order the jobs went in.
enum Done {
    Step(Result<ToStage, String>),
    Op(Result<Vec<FromStage>, String>),
}

/// One thread per later stage, each calling its link in turn: a step's
/// frame goes from stage 1's thread to stage 2's, so every stage works
/// on a different step at once, and every stage sees every job in the
/// order stage 0 sent them (a block operation never overtakes a step).
struct Relay {
    first: std::sync::mpsc::Sender<Job>,
    done: std::sync::mpsc::Receiver<Done>,
}

type Next = Result<std::sync::mpsc::Sender<Job>, std::sync::mpsc::Sender<Done>>;

fn pass(next: &Next, job: Job) {
    match next {
        Ok(tx) => {
            let _ = tx.send(job);
        }
        Err(done) => {
            let _ = done.send(match job {
                Job::Step(m) => Done::Step(Ok(m)),
                Job::Op { answers, .. } => Done::Op(Ok(answers)),
                Job::Failed { op: true, why } => Done::Op(Err(why)),
                Job::Failed { op: false, why } => Done::Step(Err(why)),
            });
        }
    }
}

fn relay_thread(
    i: usize,
    n: usize,
    mut link: Box<dyn StageLink>,
    from: std::sync::mpsc::Receiver<Job>,
    next: Next,
) {
    let stage = i + 1;
    let mut lost: Option<String> = None;
    while let Ok(job) = from.recv() {
        let job = match job {
            Job::Failed { .. } => job,
            Job::Step(_) | Job::Op { .. } if lost.is_some() => Job::Failed {
                op: matches!(job, Job::Op { .. }),
                why: lost.clone().expect("checked"),
            },
            Job::Op { only: Some(t), .. } if t != i => job,
            Job::Step(mut msg) => {
                let r = match &mut msg {
                    ToStage::Step { step, last, .. } => {
                        *last = i + 1 == n;
                        let step = *step;
                        match link.call(&msg) {
                            Ok(FromStage::Rows { step: s, rows: r }) if s == step => {
                                if let ToStage::Step { rows, .. } = &mut msg {
                                    *rows = r;
                                }
                                Ok(())
                            }
                            Ok(FromStage::Refused { reason }) => {
                                Err(format!("stage {stage} refused step {step}: {reason}"))
                            }
                            Ok(FromStage::Rows { step: s, .. }) => Err(format!(
                                "stage {stage} answered step {step} with step {s}'s rows"
                            )),
                            Ok(o) => Err(format!("stage {stage} answered step {step} with {o:?}")),
                            Err(e) => Err(format!("stage {stage} lost: {e}")),
                        }
                    }
                    _ => Err("a step job without a step".into()),
                };
                match r {
                    Ok(()) => Job::Step(msg),
                    Err(why) => {
                        lost = Some(why.clone());
                        Job::Failed { op: false, why }
                    }
                }
            }
            Job::Op {
                msg,
                only,
                mut answers,
            } => match link.call(&msg) {
                Ok(FromStage::Refused { reason }) => Job::Failed {
                    op: true,
                    why: format!("stage {stage} refused: {reason}"),
                },
                Ok(a) => {
                    answers.push(a);
                    Job::Op { msg, only, answers }
                }
                Err(e) => {
                    let why = format!("stage {stage} lost: {e}");
                    lost = Some(why.clone());
                    Job::Failed { op: true, why }
                }
            },
        };
        pass(&next, job);
    }
}

impl Relay {
    fn start(links: Vec<Box<dyn StageLink>>) -> Relay {
        let n = links.len();
        let (done_tx, done) = std::sync::mpsc::channel();
        // Built from the last stage back, each thread sending to the next.
        let mut next: Next = Err(done_tx);
        for (i, link) in links.into_iter().enumerate().rev() {
            let (tx, rx) = std::sync::mpsc::channel();
            let to = std::mem::replace(&mut next, Ok(tx));
            std::thread::Builder::new()
                .name(format!("stage-relay-{}", i + 1))
                .spawn(move || relay_thread(i, n, link, rx, to))
                .expect("a relay thread starts");
        }
        Relay {
            first: next.expect("at least one later stage"),
            done,
        }
    }
}

/// Dials later stage `i` (0 is stage 1) again, for a group that lost one.
pub type Redial = Box<dyn FnMut(usize) -> Result<Box<dyn StageLink>, String> + Send>;

/// Stage 0's executor: its own part (the ends and the first layers) and
/// links to the later stages, in layer order. To the engine it is the
/// whole model's executor, with a pipeline depth of its stage count: it
/// begins a step (its own layers, then the rows on their way) and
/// finishes it later (the head and sampling, once the last stage's rows
/// are back), so while the later stages run one step it runs the next.
pub struct PipelineExecutor {
    head: CpuExecutor,
    relay: Relay,
    layers: Vec<Range<usize>>,
    /// Each later stage's bytes of a block.
    stage_bytes: Vec<usize>,
    spec: ModelSpec,
    kv: KvSpec,
    dtype: ActDtype,
    step: u64,
    /// Steps begun, oldest first.
    begun: std::collections::VecDeque<u64>,
    /// Steps whose rows came back while a block operation waited.
    arrived: Mutex<std::collections::VecDeque<Result<ToStage, String>>>,
    /// Frames to reuse.
    spare: Vec<ToStage>,
    outs: Vec<u32>,
    /// Each later stage's hello, said again when the group forms again.
    hellos: Vec<ToStage>,
    /// How to reach the later stages again, if it can.
    redial: Option<Redial>,
}

impl std::fmt::Debug for PipelineExecutor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PipelineExecutor")
            .field("spec", &self.spec)
            .field("layers", &self.layers)
            .field("dtype", &self.dtype)
            .finish()
    }
}

impl PipelineExecutor {
    /// Stage 0 over `head` (a part with the ends, from layer 0) and the
    /// later stages `stages` (each link with the file's layers it must
    /// run, together covering the rest in order): says hello to each
    /// (model, layers, KV cache) and refuses the group where any stage
    /// differs. `model_bytes` and `model_name` name the file.
    pub fn connect(
        head: CpuExecutor,
        stages: Vec<(Box<dyn StageLink>, Range<usize>)>,
        dtype: ActDtype,
        model_bytes: u64,
        model_name: &str,
    ) -> Result<PipelineExecutor, String> {
        let part = head.part().clone();
        if !part.ends || part.layers.start != 0 {
            return Err("stage 0 holds the ends and the first layers".into());
        }
        if stages.is_empty() {
            return Err("a pipeline has a stage after stage 0".into());
        }
        let mut next = part.layers.end;
        for (_, r) in &stages {
            if r.start != next || r.is_empty() {
                return Err(format!(
                    "the stages' layers must follow each other: {}..{} after layer {next}",
                    r.start, r.end
                ));
            }
            next = r.end;
        }
        if next != part.total {
            return Err(format!(
                "the stages run layers up to {next}, the model has {}",
                part.total
            ));
        }
        // The largest step's rows must fit a frame, with room for its
        // sequences' tokens and block tables.
        let rows =
            head.max_batch_tokens() as u64 * head.config().n_embd as u64 * dtype.bytes() as u64;
        if rows + (rows / 4).max(1 << 20) > STAGE_FRAME_MAX as u64 {
            return Err(format!(
                "a step of {} tokens sends {rows} bytes of rows a hop, more than a frame holds ({STAGE_FRAME_MAX} bytes with room for the step's sequences): lower max_num_batched_tokens",
                head.max_batch_tokens()
            ));
        }
        let kv = head.kv_spec();
        let mut links = Vec::with_capacity(stages.len());
        let mut layers = vec![part.layers.clone()];
        let mut stage_bytes = Vec::with_capacity(stages.len());
        let mut weight_bytes = head.model_spec().weight_bytes;
        let mut bytes_per_block = kv.bytes_per_block;
        let mut hellos = Vec::with_capacity(stages.len());
        for (i, (mut link, l)) in stages.into_iter().enumerate() {
            let hello = ToStage::Hello(StageHello {
                version: STAGE_VERSION,
                model_bytes,
                model_name: model_name.to_string(),
                layers: (l.start as u32, l.end as u32),
                block_size: kv.block_size as u32,
                num_blocks: kv.num_blocks as u32,
                kv_dtype: kv.dtype.name().to_string(),
                max_batch_tokens: head.max_batch_tokens() as u32,
            });
            let n = i + 1;
            match link.call(&hello) {
                Ok(FromStage::Ready {
                    layers: got,
                    bytes_per_block: b,
                    weight_bytes: w,
                }) if got == (l.start as u32, l.end as u32) => {
                    bytes_per_block += b as usize;
                    weight_bytes += w as usize;
                    stage_bytes.push(b as usize);
                    links.push(link);
                    layers.push(l);
                    hellos.push(hello);
                }
                Ok(FromStage::Refused { reason }) => {
                    return Err(format!("stage {n} refused the group: {reason}"));
                }
                Ok(other) => return Err(format!("stage {n} answered hello with {other:?}")),
                Err(e) => return Err(format!("stage {n}: {e}")),
            }
        }
        let mut spec = head.model_spec().clone();
        spec.n_layer = part.total;
        spec.weight_bytes = weight_bytes;
        Ok(PipelineExecutor {
            head,
            relay: Relay::start(links),
            layers,
            stage_bytes,
            spec,
            kv: KvSpec {
                bytes_per_block,
                ..kv
            },
            dtype,
            step: 0,
            begun: std::collections::VecDeque::new(),
            arrived: Mutex::new(std::collections::VecDeque::new()),
            spare: Vec::new(),
            outs: Vec::new(),
            hellos,
            redial: None,
        })
    }

    /// Lets the group form again after losing a stage
    /// ([`Executor::recover`]): `redial` reaches a later stage anew.
    pub fn with_redial(mut self, redial: Redial) -> PipelineExecutor {
        self.redial = Some(redial);
        self
    }

    /// The file's layers of every stage, stage 0's first.
    pub fn stage_layers(&self) -> Vec<Range<usize>> {
        self.layers.clone()
    }

    /// Stage 0's own executor.
    pub fn head(&self) -> &CpuExecutor {
        &self.head
    }

    /// How the rows travel.
    pub fn dtype(&self) -> ActDtype {
        self.dtype
    }

    /// Runs a block operation on every later stage, in order behind every
    /// step already sent (whose rows are kept for their finish), and
    /// returns the stages' answers.
    fn op(&self, msg: ToStage, only: Option<usize>) -> Result<Vec<FromStage>, ExecError> {
        let job = Job::Op {
            msg,
            only,
            answers: Vec::new(),
        };
        if self.relay.first.send(job).is_err() {
            return Err(ExecError::Lost("the stages' relay has stopped".into()));
        }
        loop {
            match self.relay.done.recv() {
                Ok(Done::Op(r)) => return r.map_err(ExecError::Lost),
                Ok(Done::Step(r)) => self
                    .arrived
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .push_back(r),
                Err(_) => return Err(ExecError::Lost("the stages' relay has stopped".into())),
            }
        }
    }

    /// The oldest step's frame back from the last stage.
    fn next_rows(&mut self) -> Result<ToStage, ExecError> {
        if let Some(r) = self
            .arrived
            .get_mut()
            .unwrap_or_else(|e| e.into_inner())
            .pop_front()
        {
            return r.map_err(ExecError::Lost);
        }
        loop {
            match self.relay.done.recv() {
                Ok(Done::Step(r)) => return r.map_err(ExecError::Lost),
                Ok(Done::Op(_)) => continue,
                Err(_) => return Err(ExecError::Lost("the stages' relay has stopped".into())),
            }
        }
    }
}

impl Executor for PipelineExecutor {
    fn model_spec(&self) -> &ModelSpec {
        &self.spec
    }

    fn kv_spec(&self) -> KvSpec {
        self.kv
    }

    fn max_batch_tokens(&self) -> usize {
        self.head.max_batch_tokens()
    }

    fn max_draft_tokens(&self) -> usize {
        self.head.max_draft_tokens()
    }

    /// One step in flight for each stage.
    fn pipeline_depth(&self) -> usize {
        self.layers.len()
    }

    /// Dials every later stage again and says hello (each starts from an
    /// empty cache, and the group's blocks hold nothing): the group runs
    /// again once every stage answers as before.
    fn recover(&mut self) -> bool {
        let Some(redial) = &mut self.redial else {
            return false;
        };
        let mut links = Vec::with_capacity(self.hellos.len());
        for (i, hello) in self.hellos.iter().enumerate() {
            let Ok(mut link) = redial(i) else {
                return false;
            };
            match link.call(hello) {
                Ok(FromStage::Ready {
                    layers,
                    bytes_per_block,
                    ..
                }) if (layers.0 as usize..layers.1 as usize) == self.layers[i + 1]
                    && bytes_per_block as usize == self.stage_bytes[i] =>
                {
                    links.push(link)
                }
                _ => return false,
            }
        }
        // The old relay's threads end with its channel.
        self.relay = Relay::start(links);
        self.begun.clear();
        self.arrived
            .get_mut()
            .unwrap_or_else(|e| e.into_inner())
            .clear();
        true
    }

    /// Drafts run on stage 0 alone: the first `layers` layers where stage
    /// 0 holds them, else all of stage 0's (a shallower draft; the
    /// verified tokens are the same either way).
    fn can_self_draft(&self) -> bool {
        true
    }

    fn draft_step(
        &mut self,
        batch: &[SeqInput<'_>],
        out: &mut StepOutputs,
        layers: usize,
    ) -> Result<(), ExecError> {
        let own = self.head.part().layers.len();
        self.head.set_exit_layer(Some(layers.clamp(1, own)));
        let r = self
            .head
            .stage_begin(batch, out)
            .map(|_| self.head.stage_layers(batch))
            .and_then(|_| self.head.stage_finish(batch, out));
        self.head.set_exit_layer(None);
        r
    }

    fn step(&mut self, batch: &[SeqInput<'_>], out: &mut StepOutputs) -> Result<(), ExecError> {
        self.begin_step(batch, out)?;
        self.finish_step(batch, out)
    }

    fn begin_step(
        &mut self,
        batch: &[SeqInput<'_>],
        out: &mut StepOutputs,
    ) -> Result<(), ExecError> {
        self.head.stage_begin(batch, out)?;
        self.head.stage_layers(batch);
        self.step += 1;
        let (mut seqs, mut rows) = match self.spare.pop() {
            Some(ToStage::Step { seqs, rows, .. }) => (seqs, rows),
            _ => (Vec::new(), Vec::new()),
        };
        seqs.resize_with(batch.len(), StageSeq::default);
        for (s, q) in seqs.iter_mut().zip(batch) {
            s.tokens.clear();
            s.tokens.extend_from_slice(q.tokens);
            s.start_pos = q.start_pos as u32;
            s.block_table.clear();
            s.block_table.extend_from_slice(q.block_table);
            s.out_rows = q.output.rows() as u32;
        }
        encode_rows(self.head.stage_rows(), self.dtype, &mut rows);
        let msg = ToStage::Step {
            step: self.step,
            seqs,
            dtype: self.dtype,
            rows,
            last: false,
        };
        if self.relay.first.send(Job::Step(msg)).is_err() {
            return Err(ExecError::Lost("the stages' relay has stopped".into()));
        }
        self.begun.push_back(self.step);
        Ok(())
    }

    fn finish_step(
        &mut self,
        batch: &[SeqInput<'_>],
        out: &mut StepOutputs,
    ) -> Result<(), ExecError> {
        let Some(step) = self.begun.pop_front() else {
            return Err(ExecError::Unsupported("no step begun"));
        };
        let msg = self.next_rows()?;
        let ToStage::Step {
            step: got, rows, ..
        } = &msg
        else {
            return Err(ExecError::Lost("the relay returned no step".into()));
        };
        if *got != step {
            return Err(ExecError::Lost(format!(
                "step {got}'s rows came back for step {step}"
            )));
        }
        // Lay the step out again (another may have begun since), put the
        // last stage's output rows into the residual stream, and sample.
        self.head.stage_resume(batch, out);
        let d = self.spec.n_embd;
        self.outs.clear();
        self.outs.extend_from_slice(self.head.stage_out_rows());
        let width = d * self.dtype.bytes();
        if rows.len() != self.outs.len() * width {
            return Err(ExecError::Lost(format!(
                "the last stage sent {} bytes for {} output rows",
                rows.len(),
                self.outs.len()
            )));
        }
        let x = self.head.stage_rows_mut();
        for (j, &r) in self.outs.iter().enumerate() {
            let r = r as usize;
            decode_rows(
                &rows[j * width..(j + 1) * width],
                self.dtype,
                &mut x[r * d..(r + 1) * d],
            );
        }
        self.spare.push(msg);
        self.head.stage_finish(batch, out)
    }

    fn copy_block(&mut self, src: u32, dst: u32) -> Result<(), ExecError> {
        self.head.copy_block(src, dst)?;
        for (i, a) in self
            .op(ToStage::CopyBlock { src, dst }, None)?
            .into_iter()
            .enumerate()
        {
            if a != FromStage::Done {
                return Err(ExecError::Lost(format!(
                    "stage {} answered a copy with {a:?}",
                    i + 1
                )));
            }
        }
        Ok(())
    }

    fn read_block(&self, block: u32, out: &mut [u8]) -> Result<(), ExecError> {
        if out.len() != self.kv.bytes_per_block {
            return Err(ExecError::BadBlockBytes {
                got: out.len(),
                expected: self.kv.bytes_per_block,
            });
        }
        let own = self.head.kv_spec().bytes_per_block;
        self.head.read_block(block, &mut out[..own])?;
        let mut at = own;
        for (i, a) in self
            .op(ToStage::ReadBlock { block }, None)?
            .into_iter()
            .enumerate()
        {
            match a {
                FromStage::Block { data } if data.len() == self.stage_bytes[i] => {
                    out[at..at + data.len()].copy_from_slice(&data);
                    at += data.len();
                }
                o => {
                    return Err(ExecError::Lost(format!(
                        "stage {} answered a read with {o:?}",
                        i + 1
                    )));
                }
            }
        }
        Ok(())
    }

    fn write_block(&mut self, block: u32, data: &[u8]) -> Result<(), ExecError> {
        if data.len() != self.kv.bytes_per_block {
            return Err(ExecError::BadBlockBytes {
                got: data.len(),
                expected: self.kv.bytes_per_block,
            });
        }
        let own = self.head.kv_spec().bytes_per_block;
        self.head.write_block(block, &data[..own])?;
        // Each stage's share, one stage at a time (a frame holds one
        // block's bytes for one stage).
        let mut at = own;
        for (i, &b) in self.stage_bytes.clone().iter().enumerate() {
            let part = data[at..at + b].to_vec();
            at += b;
            let answers = self.op(ToStage::WriteBlock { block, data: part }, Some(i))?;
            match answers.first() {
                Some(FromStage::Done) => {}
                o => {
                    return Err(ExecError::Lost(format!(
                        "stage {} answered a write with {o:?}",
                        i + 1
                    )));
                }
            }
        }
        Ok(())
    }
}
