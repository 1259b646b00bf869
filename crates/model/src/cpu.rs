//! The CPU backend: one forward pass for every architecture that
//! [`crate::arch::ModelConfig`] describes, over a flat mixed batch and a
//! paged KV cache, multi-threaded over a persistent pool.
//!
//! One step runs every token of the batch through each layer together, so the
//! weights stream from memory once per step whatever the mix of prefill
//! chunks and decode tokens. All buffers are sized at construction for
//! `max_batch_tokens`; a step allocates nothing.

use std::ops::Range;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};

use crate::arch::{self, Activation, ModelConfig, Weights};
use crate::kernels::{self, Acts, Kernel, OutPtr, QMatrix, Resolved};
use crate::kvcache::{KvStore, attend_run, attend_scratch, hadamard, int8_rotations, query_run};
use crate::pool::{ThreadPool, split_range};
use crate::quant::{BlockQ8A, QK, quantize_row_q8a};
use crate::sampling::{SamplerScratch, sample};
use flotilla_exec::executor::{
    BatchLimits, ExecError, Executor, KvDtype, KvSpec, ModelSpec, SeqInput, SeqOutput, StepOutputs,
    sample_outputs, validate_batch,
};
use flotilla_gguf::{GgufError, GgufFile};

#[cfg(target_arch = "x86_64")]
use crate::kernels::avx2;

/// How to build a CPU executor.
#[derive(Clone, Debug)]
pub struct CpuConfig {
    /// Compute threads, the calling thread included.
    pub threads: usize,
    /// Matrix-product implementation.
    pub kernel: Kernel,
    /// Tokens per KV block.
    pub block_size: usize,
    /// Physical KV blocks.
    pub num_blocks: usize,
    /// KV element type.
    pub kv_dtype: KvDtype,
    /// Most tokens in one step.
    pub max_batch_tokens: usize,
    /// Directory of the layout cache (`crate::layout`): matrices are mapped
    /// from it when it holds this model's, and it is written after a load
    /// that converted them. `None`: convert at every load, write nothing.
    pub layout_cache: Option<PathBuf>,
    /// Q4_K and Q6_K weights at the file's size (4.5 and 6.56 bits a
    /// weight) where the kernel reads them so (AVX2, AVX-512 VNNI), instead of
    /// widened to Q4_1 and Q8_0 (5 and 8.5 bits): less memory and fewer
    /// bytes a decoded token reads, more instructions a weight (the faster
    /// choice where decode is bound by memory, the slower where it is
    /// bound by the core; `docs/BENCHMARKS.md`).
    pub compact_k_quants: bool,
    /// Logits for the first this many tokens only (rounded up to a
    /// multiple of 8); 0: the whole vocabulary. For a draft model, whose
    /// guesses need only be likely: a BPE vocabulary's ids come in the
    /// order of its merges, the commonest pieces first, so a head over the
    /// first ids reads a fraction of the bytes and seldom misses the
    /// token the target picks (the target verifies every guess anyway).
    pub head_rows: usize,
}

impl Default for CpuConfig {
    fn default() -> Self {
        CpuConfig {
            threads: std::thread::available_parallelism().map_or(1, |n| n.get()),
            kernel: Kernel::Auto,
            block_size: 16,
            num_blocks: 1024,
            kv_dtype: KvDtype::F16,
            max_batch_tokens: 512,
            layout_cache: None,
            compact_k_quants: false,
            head_rows: 0,
        }
    }
}

/// Why a CPU executor could not be built.
#[derive(Debug, thiserror::Error)]
pub enum LoadError {
    /// The model file is unreadable or not a supported model.
    #[error(transparent)]
    Gguf(#[from] GgufError),
    /// A configuration value is out of range.
    #[error("invalid CPU executor configuration: {0}")]
    Config(String),
}

/// A buffer shared by the threads of one region, each writing its own
/// disjoint part.
#[derive(Clone, Copy)]
struct Shared<T> {
    ptr: *mut T,
    len: usize,
}
// SAFETY: regions hand each thread a disjoint range (asserted by construction
// of the ranges: split_range or distinct task ids).
unsafe impl<T: Send> Send for Shared<T> {}
// SAFETY: as above.
unsafe impl<T: Send> Sync for Shared<T> {}

impl<T> Shared<T> {
    fn new(v: &mut [T]) -> Self {
        Shared {
            ptr: v.as_mut_ptr(),
            len: v.len(),
        }
    }
    /// # Safety
    /// No other thread may access `r` during the borrow.
    #[allow(clippy::mut_from_ref)]
    unsafe fn slice(&self, r: Range<usize>) -> &mut [T] {
        assert!(r.start <= r.end && r.end <= self.len);
        // SAFETY: in bounds (asserted); exclusivity is the caller's promise.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.add(r.start), r.len()) }
    }
}

/// Step buffers, sized once for `max_batch_tokens`.
struct Scratch {
    x: Vec<f32>,
    xn: Vec<f32>,
    q8: Vec<BlockQ8A>,
    qkv: Vec<f32>,
    att: Vec<f32>,
    tmp: Vec<f32>,
    gu: Vec<f32>,
    tok: Vec<u32>,
    tok_seq: Vec<u32>,
    tok_pos: Vec<usize>,
    /// Attention's runs of the step: (first token row, tokens).
    runs: Vec<(usize, usize)>,
    out_tok: Vec<u32>,
    slots: Vec<usize>,
    /// cos/sin of each token's position, `head_dim / 2` pairs per token,
    /// one table per RoPE base (`[base][token][pair]`).
    rope: Vec<(f32, f32)>,
    /// Per-thread attention buffers.
    /// Per-thread attention buffers, `att_per_thread` floats each.
    att_thread: Vec<f32>,
    att_per_thread: usize,
    sampler: SamplerScratch,
}

/// The CPU backend.
pub struct CpuExecutor {
    cfg: ModelConfig,
    w: Weights,
    spec: ModelSpec,
    kv: KvStore,
    kernel: Resolved,
    pool: ThreadPool,
    max_tokens: usize,
    /// Per RoPE base: `base^(-2i/head_dim) / factor_i` in f64.
    inv_freq: Vec<Vec<f64>>,
    s: Scratch,
    /// Run only these layers, in order, before the final norm and head (a
    /// self-draft's forward pass: exiting early or skipping layers);
    /// `None`: all of them.
    layers: Option<Vec<usize>>,
    /// The int8 cache's rotations (`kvcache::int8_rotations`); `None` for
    /// f32 and f16 caches.
    int8_rot: Option<(usize, usize)>,
    /// What the load did with the layout cache, when one was named.
    load_note: Option<String>,
    /// The head's first rows (`CpuConfig::head_rows`), where it is cut.
    short_head: Option<QMatrix>,
}

/// The weights, from the layout cache in `dir` where it holds this
/// model's for `kernel`, else converted from the file (and the cache then
/// written, and the weights mapped from it). Also says what it did, when
/// a cache was named. A cache that cannot be read or written costs the
/// conversion, never the load.
fn load_weights(
    g: &GgufFile,
    cfg: &ModelConfig,
    kernel: Resolved,
    compact: bool,
    dir: Option<&Path>,
    threads: usize,
) -> Result<(Weights, Option<String>), LoadError> {
    use crate::layout;
    let (Some(dir), Some(src)) = (dir, g.source()) else {
        return Ok((
            Weights::load_with(g, cfg, kernel, compact, None, threads)?,
            None,
        ));
    };
    if kernel == Resolved::Exact {
        // Dequantised f32: nothing a cache would save that a map can hold.
        return Ok((
            Weights::load_with(g, cfg, kernel, compact, None, threads)?,
            None,
        ));
    }
    let path = layout::cache_path(dir, src, kernel, compact);
    if !cfg.part.is_whole() {
        // A stage maps its matrices from the whole model's cache by name
        // where it is there; it writes none (the cache holds whole models).
        let c = layout::open(&path, src, kernel, compact).ok().flatten();
        let w = Weights::load_with(g, cfg, kernel, compact, c.as_ref(), threads)?;
        let note = match c {
            Some(_) => format!(
                "layout cache {}: this stage's matrices mapped",
                path.display()
            ),
            None => format!("layout cache {}: not there; converted", path.display()),
        };
        return Ok((w, Some(note)));
    }
    let stale = match layout::open(&path, src, kernel, compact) {
        Ok(Some(c)) => {
            let w = Weights::load_with(g, cfg, kernel, compact, Some(&c), threads)?;
            let note = format!(
                "layout cache {}: {} matrices mapped",
                path.display(),
                c.len()
            );
            return Ok((w, Some(note)));
        }
        Ok(None) => String::new(),
        Err(why) => format!(" (the one there was not used: {why})"),
    };
    let w = Weights::load_with(g, cfg, kernel, compact, None, threads)?;
    let bytes = match layout::write(&path, src, kernel, compact, &w.matrices()) {
        Ok(bytes) => bytes,
        Err(e) => {
            let note = format!("layout cache {}: not written{stale}: {e}", path.display());
            return Ok((w, Some(note)));
        }
    };
    // The converted copy goes before the cache's pages come in, so the
    // weights are never resident twice.
    drop(w);
    let why = match layout::open(&path, src, kernel, compact) {
        Ok(Some(c)) => {
            let mapped = Weights::load_with(g, cfg, kernel, compact, Some(&c), threads)?;
            let note = format!(
                "layout cache {}: written{stale}, {:.1} MB, {} matrices",
                path.display(),
                bytes as f64 / 1e6,
                c.len()
            );
            return Ok((mapped, Some(note)));
        }
        Ok(None) => "gone".to_string(),
        Err(why) => why,
    };
    // Another process replaced or removed it meanwhile: convert again.
    let note = format!(
        "layout cache {}: written but not read back: {why}",
        path.display()
    );
    Ok((
        Weights::load_with(g, cfg, kernel, compact, None, threads)?,
        Some(note),
    ))
}

impl std::fmt::Debug for CpuExecutor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CpuExecutor")
            .field("spec", &self.spec)
            .field("kernel", &self.kernel)
            .finish()
    }
}

impl CpuExecutor {
    /// Opens a GGUF file and builds an executor for it.
    pub fn load(path: &Path, c: &CpuConfig) -> Result<CpuExecutor, LoadError> {
        let g = GgufFile::open(path)?;
        Self::from_gguf(&g, c)
    }

    /// Builds an executor from an open GGUF file (weights stay mapped).
    pub fn from_gguf(g: &GgufFile, c: &CpuConfig) -> Result<CpuExecutor, LoadError> {
        Self::from_gguf_part(g, c, None)
    }

    /// Builds a pipeline stage's executor: only the file's layers
    /// `part.0` (weights and KV cache), and the embedding, final norm and
    /// head only where `part.1` (the stage that embeds and samples); the
    /// whole model where `part` is `None`. A stage maps the layout cache
    /// where the whole model's is there and never writes one.
    pub fn from_gguf_part(
        g: &GgufFile,
        c: &CpuConfig,
        part: Option<(Range<usize>, bool)>,
    ) -> Result<CpuExecutor, LoadError> {
        if c.block_size == 0 || c.block_size > 1024 {
            return Err(LoadError::Config(format!(
                "block size {} must be in 1..=1024",
                c.block_size
            )));
        }
        if c.num_blocks == 0 || c.num_blocks > u32::MAX as usize {
            return Err(LoadError::Config(format!(
                "number of KV blocks {} must be positive",
                c.num_blocks
            )));
        }
        if c.max_batch_tokens == 0 || c.threads == 0 || c.threads > 1024 {
            return Err(LoadError::Config(
                "max_batch_tokens and threads must be positive".into(),
            ));
        }
        let mut cfg = ModelConfig::from_gguf(g)?;
        if let Some((layers, ends)) = part {
            cfg = cfg.part(layers, ends).map_err(LoadError::Config)?;
        }
        if cfg.n_embd % QK != 0 || cfg.n_ff % QK != 0 || cfg.q_dim() % QK != 0 {
            return Err(LoadError::Config(format!(
                "model widths {}, {} and {} must be multiples of 32 for 8-bit activations",
                cfg.n_embd,
                cfg.n_ff,
                cfg.q_dim()
            )));
        }
        let (w, load_note) = load_weights(
            g,
            &cfg,
            c.kernel.resolve(),
            c.compact_k_quants,
            c.layout_cache.as_deref(),
            c.threads,
        )?;
        let name = g
            .str_opt("general.name")
            .ok()
            .flatten()
            .map(|s| s.to_string())
            .unwrap_or_else(|| cfg.arch.clone());
        let spec = ModelSpec {
            name,
            arch: cfg.arch.clone(),
            n_layer: cfg.n_layer,
            n_embd: cfg.n_embd,
            n_head: cfg.n_head,
            n_head_kv: cfg.n_head_kv,
            head_dim: cfg.head_dim,
            vocab: cfg.vocab,
            ctx_len: cfg.ctx_len,
            weight_bytes: w.bytes(),
        };
        let kv = KvStore::new(&cfg, c.block_size, c.num_blocks, c.kv_dtype)
            .map_err(LoadError::Config)?;
        let t = c.max_batch_tokens;
        let (d, qd, kvd, ff) = (cfg.n_embd, cfg.q_dim(), cfg.kv_dim(), cfg.n_ff);
        let wide = d.max(ff);
        let group = cfg.n_head / cfg.n_head_kv;
        // Rounded up and padded by a cache line (16 floats) so that no two
        // threads ever write the same line: shared lines cost more than the work.
        // Beside attention's own scratch, a run's query rows and outputs.
        let att_per_thread = (attend_scratch(group, cfg.head_dim, c.block_size)
            + 2 * query_run(group) * group * cfg.head_dim)
            .next_multiple_of(16)
            + 16;
        let s = Scratch {
            x: vec![0.0; t * d],
            xn: vec![0.0; t * wide],
            q8: vec![BlockQ8A::default(); t * wide.max(qd) / QK],
            qkv: vec![0.0; t * (qd + 2 * kvd)],
            att: vec![0.0; t * qd],
            tmp: vec![0.0; t * d],
            gu: vec![0.0; t * 2 * ff],
            tok: Vec::with_capacity(t),
            tok_seq: Vec::with_capacity(t),
            tok_pos: Vec::with_capacity(t),
            runs: Vec::with_capacity(t),
            out_tok: Vec::with_capacity(t),
            slots: Vec::with_capacity(t),
            rope: vec![(0.0, 0.0); cfg.rope_bases.len() * t * cfg.head_dim / 2],
            att_thread: vec![0.0; c.threads * att_per_thread],
            att_per_thread,
            sampler: SamplerScratch::with_capacity(cfg.vocab),
        };
        let inv_freq = cfg
            .rope_bases
            .iter()
            .map(|&b| arch::inv_freq(b, cfg.head_dim, w.rope_factors.as_deref()))
            .collect();
        let int8_rot = match c.kv_dtype {
            KvDtype::Int8 => int8_rotations(cfg.head_dim),
            _ => None,
        };
        let short_head = match c.head_rows {
            0 => None,
            n if n.next_multiple_of(8) >= cfg.vocab => None,
            n => Some(w.head().first_rows(n.next_multiple_of(8)).ok_or_else(|| {
                LoadError::Config(format!("the head cannot be cut to its first {n} rows"))
            })?),
        };
        Ok(CpuExecutor {
            kernel: c.kernel.resolve(),
            pool: ThreadPool::new(c.threads),
            max_tokens: t,
            inv_freq,
            cfg,
            w,
            spec,
            kv,
            s,
            layers: None,
            int8_rot,
            load_note,
            short_head,
        })
    }

    /// Makes every later step run only the first `layers` layers, then the
    /// final norm and head: the forward pass of a self-draft that exits
    /// early (its logits predict the next token from a shallower model).
    /// Layers past it neither run nor write KV. `None` restores the whole
    /// model. For measuring what such a draft would be worth
    /// (`tests/speculation.rs`); the engine never sets it.
    pub fn set_exit_layer(&mut self, layers: Option<usize>) {
        self.set_layers(layers.map(|l| (0..l.min(self.cfg.n_layer)).collect()));
    }

    /// Makes every later step run only `layers` (in the order given, each
    /// below the model's count), then the final norm and head: a
    /// self-draft that skips layers. Skipped layers neither run nor write
    /// KV. `None` restores the whole model. For measuring
    /// (`tests/speculation.rs`); the engine never sets it.
    pub fn set_layers(&mut self, layers: Option<Vec<usize>>) {
        let n = self.cfg.n_layer;
        self.layers = layers.map(|v| v.into_iter().filter(|&l| l < n).collect());
    }

    /// The model's hyper-parameters.
    pub fn config(&self) -> &ModelConfig {
        &self.cfg
    }

    /// The kernel in use.
    pub fn kernel(&self) -> Resolved {
        self.kernel
    }

    /// Compute threads.
    pub fn threads(&self) -> usize {
        self.pool.n_threads()
    }

    /// Multiply-adds of the layers' matrices for one token (what a prompt
    /// token costs besides attention; the output head runs only where
    /// logits are asked for).
    pub fn matmul_macs_per_token(&self) -> usize {
        self.w
            .matrices()
            .iter()
            .filter(|(name, _)| name.starts_with("blk."))
            .map(|(_, m)| m.rows * m.cols)
            .sum()
    }

    /// Checks a batch as every step does (tokens, positions, block
    /// tables, slots, the step's size).
    fn check(&mut self, batch: &[SeqInput<'_>]) -> Result<(), ExecError> {
        let limits = BatchLimits {
            vocab: self.cfg.vocab,
            ctx_len: self.cfg.ctx_len,
            block_size: self.kv.block_size,
            num_blocks: self.kv.num_blocks,
            max_tokens: self.max_tokens,
        };
        validate_batch(batch, &limits, &mut self.s.slots)?;
        Ok(())
    }

    /// Replaces the KV cache by an empty one of `num_blocks` blocks (same
    /// block size and element type): a pipeline stage takes its group's
    /// count from stage 0.
    pub fn set_num_blocks(&mut self, num_blocks: usize) -> Result<(), LoadError> {
        if num_blocks == 0 || num_blocks > u32::MAX as usize {
            return Err(LoadError::Config(format!(
                "number of KV blocks {num_blocks} must be positive"
            )));
        }
        // A new store, the old one gone first (never both in memory): its
        // pages are the system's zero pages until written, where filling
        // the old one with zeros would make every page resident.
        let dtype = self.kv.dtype();
        self.kv =
            KvStore::new(&self.cfg, self.kv.block_size, 1, dtype).map_err(LoadError::Config)?;
        self.kv = KvStore::new(&self.cfg, self.kv.block_size, num_blocks, dtype)
            .map_err(LoadError::Config)?;
        Ok(())
    }

    /// The part of the model this executor holds (the whole model unless
    /// built by [`CpuExecutor::from_gguf_part`]).
    pub fn part(&self) -> &crate::arch::Part {
        &self.cfg.part
    }

    /// A pipeline stage's step, first call: checks `batch` as
    /// [`Executor::step`] does and lays out its rows; where this part
    /// holds the ends, embeds the tokens. Returns the step's token rows.
    /// A stage without the ends then takes the rows the stage before it
    /// computed ([`CpuExecutor::stage_rows_mut`]).
    pub fn stage_begin(
        &mut self,
        batch: &[SeqInput<'_>],
        out: &mut StepOutputs,
    ) -> Result<usize, ExecError> {
        self.check(batch)?;
        self.prepare(batch, out);
        if self.cfg.part.ends {
            self.embed();
        }
        Ok(self.s.tok.len())
    }

    /// Lays out a step begun before (checked then) again, without
    /// embedding: a pipeline's stage 0 finishing a step after beginning
    /// others.
    pub fn stage_resume(&mut self, batch: &[SeqInput<'_>], out: &mut StepOutputs) {
        self.prepare(batch, out);
    }

    /// The residual stream of the step begun: one row of `n_embd` a token.
    pub fn stage_rows(&self) -> &[f32] {
        &self.s.x[..self.s.tok.len() * self.cfg.n_embd]
    }

    /// The residual stream of the step begun, to write.
    pub fn stage_rows_mut(&mut self) -> &mut [f32] {
        let n = self.s.tok.len() * self.cfg.n_embd;
        &mut self.s.x[..n]
    }

    /// The token rows whose logits the step begun asks for, in order.
    pub fn stage_out_rows(&self) -> &[u32] {
        &self.s.out_tok
    }

    /// Runs this part's layers over the step begun (writing their KV).
    pub fn stage_layers(&mut self, batch: &[SeqInput<'_>]) {
        self.run_layers(batch);
    }

    /// Ends the step begun on the part holding the ends: final norm, head
    /// and sampling over the output rows of the residual stream (which the
    /// last stage's rows were written back into).
    pub fn stage_finish(
        &mut self,
        batch: &[SeqInput<'_>],
        out: &mut StepOutputs,
    ) -> Result<(), ExecError> {
        if !self.cfg.part.ends {
            return Err(ExecError::Unsupported("this stage holds no head"));
        }
        self.head(batch, out);
        Ok(())
    }

    /// What the load did with the layout cache (`CpuConfig::layout_cache`):
    /// mapped it, wrote it, or why it could not.
    pub fn load_note(&self) -> Option<&str> {
        self.load_note.as_deref()
    }

    fn forward(&mut self, batch: &[SeqInput<'_>], out: &mut StepOutputs) {
        self.prepare(batch, out);
        self.embed();
        self.run_layers(batch);
        self.head(batch, out);
    }

    /// Lays out a step: its token rows (sequence, position), the rows
    /// whose logits it asks for, and RoPE's tables for its positions.
    fn prepare(&mut self, batch: &[SeqInput<'_>], out: &mut StepOutputs) {
        let hd = self.cfg.head_dim;
        let s = &mut self.s;
        s.tok.clear();
        s.tok_seq.clear();
        s.tok_pos.clear();
        s.out_tok.clear();
        out.seqs.clear();
        out.vocab = self.cfg.vocab;
        for (i, q) in batch.iter().enumerate() {
            for (j, &t) in q.tokens.iter().enumerate() {
                s.tok.push(t);
                s.tok_seq.push(i as u32);
                s.tok_pos.push(q.start_pos + j);
            }
            let mut o = SeqOutput::default();
            let rows = q.output.rows();
            if rows > 0 {
                o.logits_row = Some(s.out_tok.len());
                let end = s.tok.len() as u32;
                s.out_tok.extend(end - rows as u32..end);
            }
            out.seqs.push(o);
        }
        let half = hd / 2;
        for (b, inv_freq) in self.inv_freq.iter().enumerate() {
            let table = &mut s.rope[b * self.max_tokens * half..];
            for (t, &pos) in s.tok_pos.iter().enumerate() {
                for (i, f) in inv_freq.iter().enumerate() {
                    let (sin, cos) = (pos as f64 * f).sin_cos();
                    table[t * half + i] = (cos as f32, sin as f32);
                }
            }
        }
    }

    /// The step's token rows from the embedding.
    fn embed(&mut self) {
        let d = self.cfg.n_embd;
        let s = &mut self.s;
        let t_all = s.tok.len();
        let x = Shared::new(&mut s.x[..t_all * d]);
        let (tok, emb) = (&s.tok, &self.w.tok_embd);
        let scale = self.cfg.embd_scale;
        par_tokens(&self.pool, t_all, &|r: Range<usize>| {
            for t in r {
                // SAFETY: token rows are disjoint across threads.
                let row = unsafe { x.slice(t * d..(t + 1) * d) };
                emb.dequantize_row(tok[t] as usize, row);
                if scale != 1.0 {
                    row.iter_mut().for_each(|v| *v *= scale);
                }
            }
        });
    }

    /// Every layer this executor runs, over the step's rows.
    fn run_layers(&mut self, batch: &[SeqInput<'_>]) {
        let t_all = self.s.tok.len();
        let n = self.layers.as_ref().map_or(self.cfg.n_layer, Vec::len);
        for i in 0..n {
            let l = self.layers.as_ref().map_or(i, |v| v[i]);
            self.attention_block(l, batch, t_all);
            self.ffn_block(l, t_all);
        }
    }

    /// Final norm, head and sampling for the rows that ask for them.
    fn head(&mut self, batch: &[SeqInput<'_>], out: &mut StepOutputs) {
        let d = self.cfg.n_embd;
        // Output head for the positions that need logits.
        let n_out = self.s.out_tok.len();
        if n_out == 0 {
            return;
        }
        let s = &mut self.s;
        for (j, &t) in s.out_tok.iter().enumerate() {
            let t = t as usize;
            rms_norm(
                &s.x[t * d..(t + 1) * d],
                &self.w.output_norm,
                self.cfg.rms_eps,
                &mut s.xn[j * d..(j + 1) * d],
            );
        }
        let head = self.short_head.as_ref().unwrap_or(self.w.head());
        let vocab = head.rows;
        out.vocab = vocab;
        out.logits.resize(n_out * vocab, 0.0);
        let acts = quantize_acts(self.kernel, &s.xn[..n_out * d], d, &mut s.q8, &self.pool);
        matmul(
            &self.pool,
            self.kernel,
            &[(head, OutPtr::new(&mut out.logits, vocab, 0))],
            &acts,
        );
        for (i, q) in batch.iter().enumerate() {
            if q.output.sampling().is_none() {
                continue;
            }
            let first = out.seqs[i]
                .logits_row
                .expect("sampled sequences have a logits row");
            // The masks are read only now, inside: they may have been
            // computed while the forward pass ran.
            let logits = &out.logits;
            let sampler = &mut s.sampler;
            sample_outputs(q, &mut out.seqs[i], |d| {
                let row = first + d.row;
                sample(
                    &logits[row * vocab..(row + 1) * vocab],
                    d.params,
                    d.bias,
                    d.allow,
                    d.position,
                    sampler,
                )
            });
        }
    }

    fn attention_block(&mut self, l: usize, batch: &[SeqInput<'_>], t_all: usize) {
        let (d, qd, kvd, hd) = (
            self.cfg.n_embd,
            self.cfg.q_dim(),
            self.cfg.kv_dim(),
            self.cfg.head_dim,
        );
        let qkv_w = qd + 2 * kvd;
        let layer = &self.w.layers[l];
        let spec = self.cfg.layers[l];
        let s = &mut self.s;
        norm_rows(
            &self.pool,
            &s.x[..t_all * d],
            &layer.attn_norm,
            self.cfg.rms_eps,
            &mut s.xn[..t_all * d],
        );
        // Q, K, V in one region.
        {
            let acts = quantize_acts(self.kernel, &s.xn[..t_all * d], d, &mut s.q8, &self.pool);
            let qkv = &mut s.qkv[..t_all * qkv_w];
            let base = OutPtr::new(qkv, qkv_w, 0);
            let o = |off| OutPtr { off, ..base };
            let outs = [
                (&layer.wq, o(0)),
                (&layer.wk, o(qd)),
                (&layer.wv, o(qd + kvd)),
            ];
            matmul(&self.pool, self.kernel, &outs, &acts);
        }
        // Biases, QK-norm and RoPE on Q and K, then K and V into their cache slots.
        {
            let qkv = Shared::new(&mut s.qkv[..t_all * qkv_w]);
            let half = hd / 2;
            let rope = &s.rope[spec.rope * self.max_tokens * half..];
            let (tok_seq, tok_pos) = (&s.tok_seq, &s.tok_pos);
            let (style, eps) = (self.cfg.rope_style, self.cfg.rms_eps);
            let kv_w = self.kv.writer();
            let n_kv = self.cfg.n_head_kv;
            let bs = self.kv.block_size;
            let kernel = self.kernel;
            let rot = self.int8_rot;
            par_tokens(&self.pool, t_all, &|r: Range<usize>| {
                let mut normed = [0f32; 1024];
                for t in r {
                    // SAFETY: disjoint token rows.
                    let row = unsafe { qkv.slice(t * qkv_w..(t + 1) * qkv_w) };
                    if let Some(b) = &layer.bias {
                        add_residual(&mut row[..qd], &b.q);
                        add_residual(&mut row[qd..qd + kvd], &b.k);
                        add_residual(&mut row[qd + kvd..], &b.v);
                    }
                    if let Some((qn, kn)) = &layer.qk_norm {
                        for (i, h) in row[..qd + kvd].chunks_exact_mut(hd).enumerate() {
                            let w = if i < qd / hd { qn } else { kn };
                            rms_norm(h, w, eps, &mut normed[..hd]);
                            h.copy_from_slice(&normed[..hd]);
                        }
                    }
                    let cs = &rope[t * half..(t + 1) * half];
                    for h in row[..qd + kvd].chunks_exact_mut(hd) {
                        for (i, &(c, sn)) in cs.iter().enumerate() {
                            let (ia, ib) = arch::rope_pair(style, hd, i);
                            let (a, b) = (h[ia], h[ib]);
                            h[ia] = a * c - b * sn;
                            h[ib] = a * sn + b * c;
                        }
                    }
                    // An int8 cache stores keys and values rotated (see
                    // int8_rotations); the query turns with the keys.
                    if let Some((rk, rv)) = rot {
                        hadamard(&mut row[..qd + kvd], rk);
                        hadamard(&mut row[qd + kvd..], rv);
                    }
                    let seq = &batch[tok_seq[t] as usize];
                    let pos = tok_pos[t];
                    let block = seq.block_table[pos / bs] as usize;
                    let slot = pos % bs;
                    for h in 0..n_kv {
                        let k = &row[qd + h * hd..qd + (h + 1) * hd];
                        let v = &row[qd + kvd + h * hd..qd + kvd + (h + 1) * hd];
                        // SAFETY: slots are distinct across the batch
                        // (check_distinct_slots), so no two threads write
                        // one; the store outlives the region.
                        unsafe {
                            kv_w.store(kernel, block, l, 0, h, slot, k);
                            kv_w.store(kernel, block, l, 1, h, slot, v);
                        }
                    }
                }
            });
        }
        // Attention, one task per (run, kv head): a run is up to
        // `query_run(group)` consecutive tokens of one sequence (a prompt
        // chunk's), which read each KV block once between them; a decode
        // is a run of one.
        {
            let n_kv = self.cfg.n_head_kv;
            let group = self.cfg.n_head / n_kv;
            let max_run = query_run(group);
            let runs = &mut s.runs;
            runs.clear();
            for t in 0..t_all {
                match runs.last_mut() {
                    Some((t0, n))
                        if *n < max_run
                            && s.tok_seq[*t0] == s.tok_seq[t]
                            && s.tok_pos[*t0] + *n == s.tok_pos[t] =>
                    {
                        *n += 1
                    }
                    _ => runs.push((t, 1)),
                }
            }
            let runs = &s.runs;
            let tasks = runs.len() * n_kv;
            let next = AtomicUsize::new(0);
            let att = Shared::new(&mut s.att[..t_all * qd]);
            let per = s.att_per_thread;
            let scratch = Shared::new(&mut s.att_thread);
            let (qkv, tok_seq, tok_pos) = (&s.qkv, &s.tok_seq, &s.tok_pos);
            let store = &self.kv;
            let kernel = self.kernel;
            let scale = self.cfg.attn_scale;
            let window = spec.window;
            let rot = self.int8_rot;
            self.pool.run(&|ti, _| {
                // SAFETY: thread ti alone uses its slice of the scratch buffer.
                let buf = unsafe { scratch.slice(ti * per..(ti + 1) * per) };
                loop {
                    let task = next.fetch_add(1, Ordering::Relaxed);
                    if task >= tasks {
                        break;
                    }
                    let ((t0, nq), kh) = (runs[task / n_kv], task % n_kv);
                    let seq = &batch[tok_seq[t0] as usize];
                    let rows = group * hd;
                    let (qr, rest) = buf.split_at_mut(nq * rows);
                    let (or, work) = rest.split_at_mut(nq * rows);
                    for (i, q) in qr.chunks_exact_mut(rows).enumerate() {
                        let at = (t0 + i) * qkv_w + kh * rows;
                        q.copy_from_slice(&qkv[at..at + rows]);
                    }
                    attend_run(
                        kernel,
                        store,
                        l,
                        kh,
                        seq.block_table,
                        tok_pos[t0],
                        nq,
                        window,
                        qr,
                        or,
                        group,
                        scale,
                        work,
                    );
                    if let Some((_, rv)) = rot {
                        hadamard(&mut or[..nq * rows], rv);
                    }
                    for (i, o) in or.chunks_exact(rows).enumerate() {
                        let at = (t0 + i) * qd + kh * rows;
                        // SAFETY: the heads of (t, kh) are written by this task only.
                        unsafe { att.slice(at..at + rows).copy_from_slice(o) };
                    }
                }
            });
        }
        // Output projection, post-norm, residual add.
        {
            let acts = quantize_acts(self.kernel, &s.att[..t_all * qd], qd, &mut s.q8, &self.pool);
            matmul(
                &self.pool,
                self.kernel,
                &[(&layer.wo, OutPtr::new(&mut s.tmp[..t_all * d], d, 0))],
                &acts,
            );
            residual(
                &self.pool,
                &mut s.x[..t_all * d],
                &s.tmp[..t_all * d],
                layer.post_attn_norm.as_deref(),
                self.cfg.rms_eps,
                &mut s.xn[..t_all * d],
            );
        }
    }

    fn ffn_block(&mut self, l: usize, t_all: usize) {
        let (d, ff) = (self.cfg.n_embd, self.cfg.n_ff);
        let layer = &self.w.layers[l];
        let s = &mut self.s;
        norm_rows(
            &self.pool,
            &s.x[..t_all * d],
            &layer.ffn_norm,
            self.cfg.rms_eps,
            &mut s.xn[..t_all * d],
        );
        {
            let acts = quantize_acts(self.kernel, &s.xn[..t_all * d], d, &mut s.q8, &self.pool);
            let gu = &mut s.gu[..t_all * 2 * ff];
            let base = OutPtr::new(gu, 2 * ff, 0);
            let outs = [
                (&layer.w_gate, base),
                (&layer.w_up, OutPtr { off: ff, ..base }),
            ];
            matmul(&self.pool, self.kernel, &outs, &acts);
        }
        {
            let h = Shared::new(&mut s.xn[..t_all * ff]);
            let gu = &s.gu;
            let act = self.cfg.act;
            let kernel = self.kernel;
            par_tokens(&self.pool, t_all, &|r: Range<usize>| {
                for t in r {
                    // SAFETY: disjoint token rows.
                    let h = unsafe { h.slice(t * ff..(t + 1) * ff) };
                    let (g, u) = gu[t * 2 * ff..(t + 1) * 2 * ff].split_at(ff);
                    #[cfg(target_arch = "x86_64")]
                    if kernel.avx2() {
                        // SAFETY: AVX2 resolved only when present; n_ff % 32 == 0.
                        unsafe { avx2::gated_act(g, u, h, act == Activation::GeluTanh) };
                        continue;
                    }
                    let _ = kernel;
                    match act {
                        Activation::Silu => {
                            for ((h, &g), &u) in h.iter_mut().zip(g).zip(u) {
                                *h = g / (1.0 + (-g).exp()) * u;
                            }
                        }
                        Activation::GeluTanh => {
                            for ((h, &g), &u) in h.iter_mut().zip(g).zip(u) {
                                *h = gelu_tanh(g) * u;
                            }
                        }
                    }
                }
            });
            let acts = quantize_acts(self.kernel, &s.xn[..t_all * ff], ff, &mut s.q8, &self.pool);
            matmul(
                &self.pool,
                self.kernel,
                &[(&layer.w_down, OutPtr::new(&mut s.tmp[..t_all * d], d, 0))],
                &acts,
            );
            residual(
                &self.pool,
                &mut s.x[..t_all * d],
                &s.tmp[..t_all * d],
                layer.post_ffn_norm.as_deref(),
                self.cfg.rms_eps,
                &mut s.xn[..t_all * d],
            );
        }
    }
}

/// RMSNorm: `out = x / sqrt(mean(x^2) + eps) * w`.
pub fn rms_norm(x: &[f32], w: &[f32], eps: f32, out: &mut [f32]) {
    let ss: f64 = x.iter().map(|&v| (v as f64) * (v as f64)).sum();
    let inv = (1.0 / (ss / x.len() as f64 + eps as f64).sqrt()) as f32;
    for ((o, &v), &g) in out.iter_mut().zip(x).zip(w) {
        *o = v * inv * g;
    }
}

/// RMSNorm of every row of `x` (rows of `w.len()` features) into `out`, in parallel.
fn norm_rows(pool: &ThreadPool, x: &[f32], w: &[f32], eps: f32, out: &mut [f32]) {
    let d = w.len();
    assert_eq!(x.len(), out.len());
    let o = Shared::new(out);
    par_tokens(pool, x.len() / d, &|r: Range<usize>| {
        for t in r {
            // SAFETY: token rows are disjoint across threads.
            rms_norm(&x[t * d..(t + 1) * d], w, eps, unsafe {
                o.slice(t * d..(t + 1) * d)
            });
        }
    });
}

/// The residual connection, `x += y`, or `x += rmsnorm(y) * w` when the
/// block norms its output (`out` is scratch of `x`'s size).
fn residual(
    pool: &ThreadPool,
    x: &mut [f32],
    y: &[f32],
    post_norm: Option<&[f32]>,
    eps: f32,
    out: &mut [f32],
) {
    match post_norm {
        Some(w) => {
            norm_rows(pool, y, w, eps, out);
            add_residual(x, out);
        }
        None => add_residual(x, y),
    }
}

/// GELU with the tanh approximation, as Gemma's GeGLU uses it.
#[inline(always)]
pub fn gelu_tanh(x: f32) -> f32 {
    const SQRT_2_OVER_PI: f32 = 0.797_884_6;
    0.5 * x * (1.0 + (SQRT_2_OVER_PI * x * (1.0 + 0.044_715 * x * x)).tanh())
}

/// The residual connection: `x += y`.
fn add_residual(x: &mut [f32], y: &[f32]) {
    for (a, b) in x.iter_mut().zip(y) {
        *a += *b;
    }
}

/// Runs `f` over token ranges: inline for a few tokens, else on the pool.
fn par_tokens(pool: &ThreadPool, n: usize, f: &(dyn Fn(Range<usize>) + Sync)) {
    if n < 4 || pool.n_threads() == 1 {
        f(0..n);
    } else {
        pool.run(&|i, parts| f(split_range(n, parts, i, 1)));
    }
}

/// Quantises `t` rows of width `k` into `q8` (unless the kernel is exact).
fn quantize_acts<'a>(
    kernel: Resolved,
    f: &'a [f32],
    k: usize,
    q8: &'a mut [BlockQ8A],
    pool: &ThreadPool,
) -> Acts<'a> {
    let t = f.len() / k;
    let nb = k / QK;
    if kernel != Resolved::Exact {
        let q = Shared::new(&mut q8[..t * nb]);
        par_tokens(pool, t, &|r: Range<usize>| {
            for i in r {
                // SAFETY: disjoint token rows.
                quantize_row_q8a(&f[i * k..(i + 1) * k], unsafe {
                    q.slice(i * nb..(i + 1) * nb)
                });
            }
        });
    }
    Acts {
        t,
        k,
        f,
        q: &q8[..t * nb],
    }
}

/// Runs several products with the same input in one region, splitting their
/// concatenated rows across the threads.
fn matmul(pool: &ThreadPool, kernel: Resolved, outs: &[(&QMatrix, OutPtr)], x: &Acts<'_>) {
    let total: usize = outs.iter().map(|(w, _)| w.rows).sum();
    pool.run(&|i, n| {
        let mine = split_range(total, n, i, 8);
        let mut base = 0;
        for (w, o) in outs {
            let r = mine.start.max(base)..mine.end.min(base + w.rows);
            if r.start < r.end {
                kernels::matmul_rows(kernel, w, x, r.start - base..r.end - base, *o);
            }
            base += w.rows;
        }
    });
}

impl Executor for CpuExecutor {
    fn model_spec(&self) -> &ModelSpec {
        &self.spec
    }

    fn kv_spec(&self) -> KvSpec {
        KvSpec {
            block_size: self.kv.block_size,
            num_blocks: self.kv.num_blocks,
            dtype: self.kv.dtype(),
            bytes_per_block: self.kv.bytes_per_block(),
        }
    }

    fn max_batch_tokens(&self) -> usize {
        self.max_tokens
    }

    /// Every output row is a row of the step's activations: a draft only
    /// has to fit the step.
    fn max_draft_tokens(&self) -> usize {
        self.max_tokens.saturating_sub(1)
    }

    fn can_self_draft(&self) -> bool {
        true
    }

    fn draft_step(
        &mut self,
        batch: &[SeqInput<'_>],
        out: &mut StepOutputs,
        layers: usize,
    ) -> Result<(), ExecError> {
        let whole = self.layers.take();
        self.set_exit_layer(Some(layers.max(1)));
        let r = self.step(batch, out);
        self.layers = whole;
        r
    }

    fn step(&mut self, batch: &[SeqInput<'_>], out: &mut StepOutputs) -> Result<(), ExecError> {
        if !self.cfg.part.is_whole() {
            return Err(ExecError::Unsupported(
                "a pipeline stage's part of the model runs only inside its pipeline",
            ));
        }
        self.check(batch)?;
        self.forward(batch, out);
        Ok(())
    }

    fn copy_block(&mut self, src: u32, dst: u32) -> Result<(), ExecError> {
        let a = self.kv.block_byte_range(src)?;
        let b = self.kv.block_byte_range(dst)?;
        self.kv.bytes_mut().copy_within(a, b.start);
        Ok(())
    }

    fn read_block(&self, block: u32, out: &mut [u8]) -> Result<(), ExecError> {
        let r = self.kv.block_byte_range(block)?;
        if out.len() != r.len() {
            return Err(ExecError::BadBlockBytes {
                got: out.len(),
                expected: r.len(),
            });
        }
        out.copy_from_slice(&self.kv.bytes()[r]);
        Ok(())
    }

    fn write_block(&mut self, block: u32, data: &[u8]) -> Result<(), ExecError> {
        let r = self.kv.block_byte_range(block)?;
        if data.len() != r.len() {
            return Err(ExecError::BadBlockBytes {
                got: data.len(),
                expected: r.len(),
            });
        }
        self.kv.bytes_mut()[r].copy_from_slice(data);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    use crate::testutil::rnd;

    /// The SIMD gated activations equal the scalar SiLU and tanh-GELU.
    #[cfg(target_arch = "x86_64")]
    #[test]
    fn simd_gated_activations_match_scalar() {
        if !kernels::has_avx2() {
            return;
        }
        let mut s = 9;
        let g: Vec<f32> = (0..256)
            .map(|i| {
                if i < 8 {
                    [0.0, -0.0, 1e-6, -1e-6, 50.0, -50.0, 200.0, -200.0][i]
                } else {
                    rnd(&mut s) * 12.0
                }
            })
            .collect();
        let u: Vec<f32> = (0..256).map(|_| rnd(&mut s) * 3.0).collect();
        let mut h = vec![0f32; 256];
        for gelu in [false, true] {
            unsafe { avx2::gated_act(&g, &u, &mut h, gelu) };
            for i in 0..256 {
                let act = if gelu {
                    gelu_tanh(g[i])
                } else {
                    g[i] / (1.0 + (-g[i]).exp())
                };
                let want = act * u[i];
                assert!(
                    (h[i] - want).abs() <= 1e-6 * (1.0 + want.abs()),
                    "gelu {gelu}: x {} u {}: {} vs {want}",
                    g[i],
                    u[i],
                    h[i]
                );
            }
        }
    }

    #[cfg(target_arch = "x86_64")]
    #[test]
    fn vector_exp_is_accurate() {
        if !kernels::has_avx2() {
            return;
        }
        use std::arch::x86_64::*;
        let xs: Vec<f32> = (-2000..=800).map(|i| i as f32 * 0.11).collect();
        for c in xs.chunks_exact(8) {
            let mut out = [0f32; 8];
            // SAFETY: AVX2 checked above; c has 8 elements.
            unsafe { _mm256_storeu_ps(out.as_mut_ptr(), avx2::exp8(_mm256_loadu_ps(c.as_ptr()))) };
            for (x, y) in c.iter().zip(out) {
                let want = x.exp();
                if *x < -87.0 {
                    assert_eq!(y, 0.0);
                } else {
                    assert!(
                        (y - want).abs() <= 1e-6 * want,
                        "exp({x}) = {y}, want {want}"
                    );
                }
            }
        }
        // The 16-lane one gives the 8-lane one's bits (the AVX-512 and AVX2
        // softmax steps agree), -inf included.
        if !kernels::has_avx512_vnni() {
            return;
        }
        let mut xs = [f32::NEG_INFINITY, -87.5, 88.5, 0.0]
            .into_iter()
            .chain(xs)
            .collect::<Vec<_>>();
        xs.truncate(xs.len() / 16 * 16);
        for c in xs.chunks_exact(16) {
            let (mut a, mut b) = ([0f32; 16], [0f32; 16]);
            // SAFETY: AVX-512 checked above; c has 16 elements.
            unsafe {
                _mm512_storeu_ps(
                    a.as_mut_ptr(),
                    kernels::avx512::exp16(_mm512_loadu_ps(c.as_ptr())),
                );
                for h in 0..2 {
                    let v = avx2::exp8(_mm256_loadu_ps(c.as_ptr().add(8 * h)));
                    _mm256_storeu_ps(b.as_mut_ptr().add(8 * h), v);
                }
            }
            assert_eq!(a.map(f32::to_bits), b.map(f32::to_bits), "{c:?}");
        }
    }
}
