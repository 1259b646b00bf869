//! The CPU backend: one forward pass for every architecture that
//! [`crate::arch::ModelConfig`] describes, over a flat mixed batch and a
//! paged KV cache, multi-threaded over a persistent pool.
//!
//! One step runs every token of the batch through each layer together, so the
//! weights stream from memory once per step whatever the mix of prefill
//! chunks and decode tokens. All buffers are sized at construction for
//! `max_batch_tokens`; a step allocates nothing.

use std::ops::Range;
use std::path::Path;
use std::sync::atomic::{AtomicUsize, Ordering};

use half::f16;

use crate::arch::{self, Activation, ModelConfig, Weights};
use crate::executor::{
    BatchLimits, ExecError, Executor, KvDtype, KvSpec, ModelSpec, OutputKind, SeqInput, SeqOutput,
    StepOutputs, validate_batch,
};
use crate::gguf::{GgufError, GgufFile};
use crate::kernels::{self, Acts, Kernel, OutPtr, QMatrix, Resolved};
use crate::pool::{ThreadPool, split_range};
use crate::quant::{BlockQ8A, QK, quantize_row_q8a};
use crate::sampling::{SamplerScratch, sample};

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

/// A KV element type the attention kernels read and write.
#[cfg(target_arch = "x86_64")]
pub trait KvElem: Copy + Send + Sync + Default + 'static + avx2::KvLoad {
    /// Widens to f32.
    fn to_f32(self) -> f32;
    /// Narrows from f32.
    fn from_f32(v: f32) -> Self;
}
/// A KV element type the attention kernels read and write.
#[cfg(not(target_arch = "x86_64"))]
pub trait KvElem: Copy + Send + Sync + Default + 'static {
    /// Widens to f32.
    fn to_f32(self) -> f32;
    /// Narrows from f32.
    fn from_f32(v: f32) -> Self;
}

impl KvElem for f32 {
    #[inline(always)]
    fn to_f32(self) -> f32 {
        self
    }
    #[inline(always)]
    fn from_f32(v: f32) -> Self {
        v
    }
}

impl KvElem for f16 {
    #[inline(always)]
    fn to_f32(self) -> f32 {
        f16::to_f32(self)
    }
    #[inline(always)]
    fn from_f32(v: f32) -> Self {
        f16::from_f32(v)
    }
}

enum KvData {
    F32(Vec<f32>),
    F16(Vec<f16>),
}

/// Paged KV storage. Block-major, so one block's bytes (every layer, K and V)
/// are contiguous for export and import: `[block][layer][k|v][kv_head][slot][dim]`.
struct KvStore {
    data: KvData,
    block_size: usize,
    num_blocks: usize,
    layout: KvLayout,
}

/// Where each (block, layer, K/V, head) run starts.
#[derive(Clone, Copy)]
struct KvLayout {
    block_size: usize,
    n_kv: usize,
    head_dim: usize,
    /// Elements in one block.
    block_elems: usize,
}

impl KvLayout {
    /// Offset of (block, layer, k=0/v=1, head, slot 0).
    #[inline(always)]
    fn offset(&self, block: usize, layer: usize, kv: usize, head: usize) -> usize {
        block * self.block_elems
            + ((layer * 2 + kv) * self.n_kv + head) * self.block_size * self.head_dim
    }
}

impl KvStore {
    fn new(cfg: &ModelConfig, block_size: usize, num_blocks: usize, dtype: KvDtype) -> KvStore {
        let block_elems = cfg.n_layer * 2 * cfg.n_head_kv * block_size * cfg.head_dim;
        let n = block_elems * num_blocks;
        let data = match dtype {
            KvDtype::F32 => KvData::F32(vec![0.0; n]),
            KvDtype::F16 => KvData::F16(vec![f16::ZERO; n]),
        };
        let layout = KvLayout {
            block_size,
            n_kv: cfg.n_head_kv,
            head_dim: cfg.head_dim,
            block_elems,
        };
        KvStore {
            data,
            block_size,
            num_blocks,
            layout,
        }
    }

    fn dtype(&self) -> KvDtype {
        match self.data {
            KvData::F32(_) => KvDtype::F32,
            KvData::F16(_) => KvDtype::F16,
        }
    }

    fn bytes_per_block(&self) -> usize {
        self.layout.block_elems * self.dtype().bytes()
    }

    fn block_byte_range(&self, block: u32) -> Result<Range<usize>, ExecError> {
        if block as usize >= self.num_blocks {
            return Err(ExecError::BadBlock {
                block,
                num_blocks: self.num_blocks,
            });
        }
        let b = self.bytes_per_block();
        Ok(block as usize * b..(block as usize + 1) * b)
    }

    fn bytes(&self) -> &[u8] {
        match &self.data {
            KvData::F32(v) => bytemuck_f32(v),
            KvData::F16(v) => bytemuck_f16(v),
        }
    }

    fn bytes_mut(&mut self) -> &mut [u8] {
        match &mut self.data {
            KvData::F32(v) => {
                // SAFETY: f32 has no invalid bit patterns and alignment of u8 is 1.
                unsafe { std::slice::from_raw_parts_mut(v.as_mut_ptr() as *mut u8, v.len() * 4) }
            }
            KvData::F16(v) => {
                // SAFETY: f16 has no invalid bit patterns and alignment of u8 is 1.
                unsafe { std::slice::from_raw_parts_mut(v.as_mut_ptr() as *mut u8, v.len() * 2) }
            }
        }
    }
}

fn bytemuck_f32(v: &[f32]) -> &[u8] {
    // SAFETY: any f32 is 4 initialised bytes; u8 has alignment 1.
    unsafe { std::slice::from_raw_parts(v.as_ptr() as *const u8, v.len() * 4) }
}

fn bytemuck_f16(v: &[f16]) -> &[u8] {
    // SAFETY: any f16 is 2 initialised bytes; u8 has alignment 1.
    unsafe { std::slice::from_raw_parts(v.as_ptr() as *const u8, v.len() * 2) }
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
        let cfg = ModelConfig::from_gguf(g)?;
        if cfg.n_embd % QK != 0 || cfg.n_ff % QK != 0 || cfg.q_dim() % QK != 0 {
            return Err(LoadError::Config(format!(
                "model widths {}, {} and {} must be multiples of 32 for 8-bit activations",
                cfg.n_embd,
                cfg.n_ff,
                cfg.q_dim()
            )));
        }
        let w = Weights::load(g, &cfg, c.kernel.resolve())?;
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
        let kv_elems = (cfg.n_layer * 2 * cfg.kv_dim())
            .checked_mul(c.block_size)
            .and_then(|e| e.checked_mul(c.num_blocks))
            .filter(|e| {
                e.checked_mul(c.kv_dtype.bytes())
                    .is_some_and(|b| b <= isize::MAX as usize)
            });
        if kv_elems.is_none() {
            return Err(LoadError::Config(format!(
                "a KV cache of {} blocks of {} tokens does not fit in memory",
                c.num_blocks, c.block_size
            )));
        }
        let kv = KvStore::new(&cfg, c.block_size, c.num_blocks, c.kv_dtype);
        let t = c.max_batch_tokens;
        let (d, qd, kvd, ff) = (cfg.n_embd, cfg.q_dim(), cfg.kv_dim(), cfg.n_ff);
        let wide = d.max(ff);
        let group = cfg.n_head / cfg.n_head_kv;
        // Rounded up and padded by a cache line (16 floats) so that no two
        // threads ever write the same line: shared lines cost more than the work.
        let att_per_thread = (group * (cfg.head_dim + 2 + c.block_size.next_multiple_of(8)))
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
        })
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

    fn forward(&mut self, batch: &[SeqInput<'_>], out: &mut StepOutputs) {
        let (d, hd) = (self.cfg.n_embd, self.cfg.head_dim);
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
            if !matches!(q.output, OutputKind::None) {
                o.logits_row = Some(s.out_tok.len());
                s.out_tok.push((s.tok.len() - 1) as u32);
            }
            out.seqs.push(o);
        }
        let t_all = s.tok.len();
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
        // Embedding lookup.
        {
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
        for l in 0..self.cfg.n_layer {
            self.attention_block(l, batch, t_all);
            self.ffn_block(l, t_all);
        }
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
        let vocab = self.cfg.vocab;
        out.logits.resize(n_out * vocab, 0.0);
        let acts = quantize_acts(self.kernel, &s.xn[..n_out * d], d, &mut s.q8, &self.pool);
        matmul(
            &self.pool,
            self.kernel,
            &[(self.w.head(), OutPtr::new(&mut out.logits, vocab, 0))],
            &acts,
        );
        for (i, q) in batch.iter().enumerate() {
            if let OutputKind::Sample(p) = &q.output {
                let row = out.seqs[i]
                    .logits_row
                    .expect("sampled sequences have a logits row");
                let logits = &out.logits[row * vocab..(row + 1) * vocab];
                let position = (q.start_pos + q.tokens.len()) as u64;
                out.seqs[i].sampled = Some(sample(logits, p, position, &mut s.sampler));
            }
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
            let kv = self.kv.layout;
            let kv_ptr = KvPtr::new(&mut self.kv.data);
            let n_kv = self.cfg.n_head_kv;
            let bs = kv.block_size;
            let kernel = self.kernel;
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
                    let seq = &batch[tok_seq[t] as usize];
                    let pos = tok_pos[t];
                    let block = seq.block_table[pos / bs] as usize;
                    let slot = pos % bs;
                    for h in 0..n_kv {
                        let k = &row[qd + h * hd..qd + (h + 1) * hd];
                        let v = &row[qd + kvd + h * hd..qd + kvd + (h + 1) * hd];
                        let ko = kv.offset(block, l, 0, h) + slot * hd;
                        let vo = kv.offset(block, l, 1, h) + slot * hd;
                        // SAFETY: slots are distinct across the batch
                        // (check_distinct_slots), so no two threads write one.
                        unsafe {
                            kv_ptr.store(kernel, ko, k);
                            kv_ptr.store(kernel, vo, v);
                        }
                    }
                }
            });
        }
        // Attention, one task per (token, kv head).
        {
            let n_kv = self.cfg.n_head_kv;
            let group = self.cfg.n_head / n_kv;
            let tasks = t_all * n_kv;
            let next = AtomicUsize::new(0);
            let att = Shared::new(&mut s.att[..t_all * qd]);
            let per = s.att_per_thread;
            let scratch = Shared::new(&mut s.att_thread);
            let (qkv, tok_seq, tok_pos) = (&s.qkv, &s.tok_seq, &s.tok_pos);
            let (kv, kv_data) = (self.kv.layout, &self.kv.data);
            let kernel = self.kernel;
            let scale = self.cfg.attn_scale;
            let window = spec.window;
            self.pool.run(&|ti, _| {
                // SAFETY: thread ti alone uses its slice of the scratch buffer.
                let buf = unsafe { scratch.slice(ti * per..(ti + 1) * per) };
                loop {
                    let task = next.fetch_add(1, Ordering::Relaxed);
                    if task >= tasks {
                        break;
                    }
                    let (t, kh) = (task / n_kv, task % n_kv);
                    let seq = &batch[tok_seq[t] as usize];
                    let pos = tok_pos[t];
                    let q = &qkv[t * qkv_w + kh * group * hd..t * qkv_w + (kh + 1) * group * hd];
                    // SAFETY: the heads of (t, kh) are written by this task only.
                    let o = unsafe {
                        att.slice(t * qd + kh * group * hd..t * qd + (kh + 1) * group * hd)
                    };
                    match kv_data {
                        KvData::F32(data) => attend(
                            kernel,
                            data,
                            &kv,
                            l,
                            kh,
                            seq.block_table,
                            pos,
                            window,
                            q,
                            o,
                            group,
                            scale,
                            buf,
                        ),
                        KvData::F16(data) => attend(
                            kernel,
                            data,
                            &kv,
                            l,
                            kh,
                            seq.block_table,
                            pos,
                            window,
                            q,
                            o,
                            group,
                            scale,
                            buf,
                        ),
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

/// Raw pointer to the KV elements, for the store region.
#[derive(Clone, Copy)]
enum KvPtr {
    F32(Shared<f32>),
    F16(Shared<f16>),
}

impl KvPtr {
    fn new(d: &mut KvData) -> KvPtr {
        match d {
            KvData::F32(v) => KvPtr::F32(Shared::new(v)),
            KvData::F16(v) => KvPtr::F16(Shared::new(v)),
        }
    }

    /// # Safety
    /// No other thread may touch `[off, off + src.len())` meanwhile.
    unsafe fn store(&self, kernel: Resolved, off: usize, src: &[f32]) {
        match self {
            KvPtr::F32(p) => store_kv(kernel, unsafe { p.slice(off..off + src.len()) }, src),
            KvPtr::F16(p) => store_kv(kernel, unsafe { p.slice(off..off + src.len()) }, src),
        }
    }
}

fn store_kv<T: KvElem>(kernel: Resolved, dst: &mut [T], src: &[f32]) {
    #[cfg(target_arch = "x86_64")]
    if kernel.avx2() {
        // SAFETY: AVX2 resolved only when present; lengths equal, multiple of 8.
        unsafe { avx2::store_kv(dst, src) };
        return;
    }
    let _ = kernel;
    for (d, &s) in dst.iter_mut().zip(src) {
        *d = T::from_f32(s);
    }
}

/// Attention of the `group` query heads that share KV head `kh`, for one
/// token at `pos`, over positions `0..=pos` through the block table:
/// online softmax, one KV block at a time, no score matrix.
#[allow(clippy::too_many_arguments)]
fn attend<T: KvElem>(
    kernel: Resolved,
    data: &[T],
    kv: &KvLayout,
    layer: usize,
    kh: usize,
    table: &[u32],
    pos: usize,
    window: Option<usize>,
    q: &[f32],
    out: &mut [f32],
    group: usize,
    scale: f32,
    buf: &mut [f32],
) {
    let hd = kv.head_dim;
    let bs = kv.block_size;
    let (acc, rest) = buf.split_at_mut(group * hd);
    // One row of scores per query head (the SIMD path fills them together).
    let (scores, rest) = rest.split_at_mut(group * bs.next_multiple_of(8));
    let (mx, rest) = rest.split_at_mut(group);
    let sum = &mut rest[..group];
    acc.fill(0.0);
    mx.fill(f32::NEG_INFINITY);
    sum.fill(0.0);
    let n_blocks = pos / bs + 1;
    // A sliding window reads only the blocks that hold its positions.
    let first = window.map_or(0, |w| (pos + 1).saturating_sub(w));
    for (bi, &block) in table[..n_blocks].iter().enumerate().skip(first / bs) {
        let end = if bi + 1 == n_blocks { pos % bs + 1 } else { bs };
        let start = if bi == first / bs { first % bs } else { 0 };
        let n = end - start;
        let kb = kv.offset(block as usize, layer, 0, kh) + start * hd;
        let vb = kv.offset(block as usize, layer, 1, kh) + start * hd;
        let kblk = &data[kb..kb + n * hd];
        let vblk = &data[vb..vb + n * hd];
        #[cfg(target_arch = "x86_64")]
        if kernel.avx2() {
            // SAFETY: AVX2 resolved only when present; slices sized above.
            unsafe { avx2::attend_block(q, kblk, vblk, n, hd, scale, scores, mx, sum, acc) };
            continue;
        }
        for g in 0..group {
            let qg = &q[g * hd..(g + 1) * hd];
            let mut bmax = f32::NEG_INFINITY;
            for j in 0..n {
                let sc = dot_kv(kernel, qg, &kblk[j * hd..(j + 1) * hd]) * scale;
                scores[j] = sc;
                bmax = bmax.max(sc);
            }
            let m_new = mx[g].max(bmax);
            let corr = (mx[g] - m_new).exp();
            mx[g] = m_new;
            let a = &mut acc[g * hd..(g + 1) * hd];
            let mut l = sum[g] * corr;
            for j in 0..n {
                let p = (scores[j] - m_new).exp();
                l += p;
                axpy_kv(
                    kernel,
                    a,
                    if j == 0 { corr } else { 1.0 },
                    p,
                    &vblk[j * hd..(j + 1) * hd],
                );
            }
            sum[g] = l;
        }
    }
    for g in 0..group {
        let inv = 1.0 / sum[g];
        for (o, a) in out[g * hd..(g + 1) * hd]
            .iter_mut()
            .zip(&acc[g * hd..(g + 1) * hd])
        {
            *o = a * inv;
        }
    }
}

#[inline(always)]
fn dot_kv<T: KvElem>(kernel: Resolved, q: &[f32], k: &[T]) -> f32 {
    #[cfg(target_arch = "x86_64")]
    if kernel.avx2() {
        // SAFETY: AVX2 resolved only when present; head_dim % 8 == 0 checked at load.
        return unsafe { avx2::dot_kv(q, k) };
    }
    let _ = kernel;
    let mut s = 0f32;
    for (a, b) in q.iter().zip(k) {
        s += a * b.to_f32();
    }
    s
}

#[inline(always)]
fn axpy_kv<T: KvElem>(kernel: Resolved, acc: &mut [f32], scale: f32, p: f32, v: &[T]) {
    #[cfg(target_arch = "x86_64")]
    if kernel.avx2() {
        // SAFETY: as in dot_kv.
        unsafe { avx2::scale_axpy_kv(acc, scale, p, v) };
        return;
    }
    let _ = kernel;
    for (a, b) in acc.iter_mut().zip(v) {
        *a = *a * scale + p * b.to_f32();
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

    fn step(&mut self, batch: &[SeqInput<'_>], out: &mut StepOutputs) -> Result<(), ExecError> {
        let limits = BatchLimits {
            vocab: self.cfg.vocab,
            ctx_len: self.cfg.ctx_len,
            block_size: self.kv.block_size,
            num_blocks: self.kv.num_blocks,
            max_tokens: self.max_tokens,
        };
        validate_batch(batch, &limits, &mut self.s.slots)?;
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

    /// The SIMD attention (eight scores per hadd tree, vector exp) agrees with
    /// the scalar one, and both with a naive softmax over exactly the window's
    /// positions, over shuffled blocks, partial last blocks, GQA groups and
    /// sliding windows that start inside a block, at its edge and at 0.
    #[test]
    fn simd_attention_matches_scalar() {
        if !kernels::has_avx2() {
            return;
        }
        let (bs, hd, n_kv, layers) = (16, 64, 2, 2);
        let num_blocks = 8;
        let layout = KvLayout {
            block_size: bs,
            n_kv,
            head_dim: hd,
            block_elems: layers * 2 * n_kv * bs * hd,
        };
        let mut s = 5;
        let data: Vec<f16> = (0..num_blocks * layout.block_elems)
            .map(|_| f16::from_f32(rnd(&mut s) * 2.0))
            .collect();
        let table = [5u32, 2, 7, 0];
        // Groups of 1, 3, 5 and 8 query heads per KV head: the SIMD path
        // takes them in chunks of up to four.
        for group in [1usize, 3, 5, 8] {
            let q: Vec<f32> = (0..group * hd).map(|_| rnd(&mut s) * 3.0).collect();
            let mut buf = vec![0f32; group * (hd + 2 + bs)];
            for window in [None, Some(1), Some(5), Some(16), Some(20)] {
                for pos in [0usize, 7, 15, 16, 33, 63] {
                    let mut a = vec![0f32; group * hd];
                    let mut b = vec![0f32; group * hd];
                    for (kernel, out) in [(Resolved::Scalar, &mut a), (Resolved::Avx2, &mut b)] {
                        attend(
                            kernel, &data, &layout, 1, 1, &table, pos, window, &q, out, group,
                            0.125, &mut buf,
                        );
                    }
                    // Naive: softmax over exactly the positions inside the window.
                    let lo = window.map_or(0, |w| (pos + 1).saturating_sub(w));
                    for g in 0..group {
                        let qg = &q[g * hd..(g + 1) * hd];
                        let at = |p: usize, kv: usize| {
                            let o = layout.offset(table[p / bs] as usize, 1, kv, 1) + (p % bs) * hd;
                            &data[o..o + hd]
                        };
                        let sc: Vec<f64> = (lo..=pos)
                            .map(|p| {
                                let k = at(p, 0);
                                (0..hd).map(|i| (qg[i] * k[i].to_f32()) as f64).sum::<f64>() * 0.125
                            })
                            .collect();
                        let m = sc.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                        let z: f64 = sc.iter().map(|v| (v - m).exp()).sum();
                        for i in 0..hd {
                            let want: f64 = (lo..=pos)
                                .zip(&sc)
                                .map(|(p, v)| (v - m).exp() / z * at(p, 1)[i].to_f32() as f64)
                                .sum();
                            let got = a[g * hd + i] as f64;
                            assert!(
                                (got - want).abs() < 1e-4 * (1.0 + want.abs()),
                                "group {group} window {window:?} pos {pos}: {got} vs {want}"
                            );
                        }
                    }
                    for (x, y) in a.iter().zip(&b) {
                        assert!(
                            (x - y).abs() < 1e-5 * (1.0 + x.abs()),
                            "window {window:?} pos {pos}: {x} vs {y}"
                        );
                    }
                }
            }
        }
    }

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
    }
}
