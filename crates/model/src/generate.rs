//! A small driver that runs whole requests on an executor: the CLI's
//! `generate`, the model benchmarks and the tests use it. Blocks come from a
//! plain free list; the serving engine's KvBlockPool and Scheduler replace
//! it with prefix caching, quotas and tiers.

use crate::sampling::{Sampled, SamplingParams};
use flotilla_exec::executor::{ExecError, Executor, OutputKind, SeqInput, StepOutputs};

/// Why a sequence stopped.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Finish {
    /// It produced an end-of-sequence token.
    Eos,
    /// It reached its token limit.
    Length,
}

/// A request to the driver.
#[derive(Clone, Debug)]
pub struct Request {
    /// Prompt token ids (at least one).
    pub prompt: Vec<u32>,
    /// How to pick tokens.
    pub params: SamplingParams,
    /// Most tokens to generate.
    pub max_new: usize,
    /// Tokens that end the sequence (not emitted as text by callers).
    pub stop_tokens: Vec<u32>,
}

struct Seq {
    req: Request,
    /// Prompt and generated tokens.
    tokens: Vec<u32>,
    /// Tokens whose K/V are in the cache.
    cached: usize,
    blocks: Vec<u32>,
    generated: usize,
    finish: Option<Finish>,
}

/// Runs requests with continuous batching over a free list of blocks.
pub struct Driver<E: Executor> {
    exec: E,
    free: Vec<u32>,
    out: StepOutputs,
}

/// Why the driver could not run a request.
#[derive(Debug, thiserror::Error, PartialEq)]
pub enum DriverError {
    /// The executor refused a step.
    #[error(transparent)]
    Exec(#[from] ExecError),
    /// The request cannot fit in the KV cache even alone.
    #[error("request needs {need} KV blocks, the cache has {have}")]
    TooLong {
        /// Blocks needed.
        need: usize,
        /// Blocks in the cache.
        have: usize,
    },
    /// An empty prompt.
    #[error("empty prompt")]
    EmptyPrompt,
    /// Running sequences hold every block and none can advance (this driver
    /// does not preempt; the serving scheduler does).
    #[error("out of KV blocks: {running} running sequences hold all {blocks} blocks")]
    OutOfBlocks {
        /// Sequences still running.
        running: usize,
        /// Blocks in the cache.
        blocks: usize,
    },
}

impl<E: Executor> Driver<E> {
    /// Wraps an executor; every block starts free.
    pub fn new(exec: E) -> Self {
        let n = exec.kv_spec().num_blocks as u32;
        Driver {
            exec,
            free: (0..n).rev().collect(),
            out: StepOutputs::default(),
        }
    }

    /// The executor.
    pub fn executor(&mut self) -> &mut E {
        &mut self.exec
    }

    /// Free blocks now (all of them between calls: every path gives blocks back).
    pub fn free_blocks(&self) -> usize {
        self.free.len()
    }

    /// Runs all requests to completion, calling `on_token(request, token)`
    /// for each generated token; returns each request's tokens and finish.
    pub fn run(
        &mut self,
        reqs: &[Request],
        mut on_token: impl FnMut(usize, &Sampled),
    ) -> Result<Vec<(Vec<u32>, Finish)>, DriverError> {
        let spec = self.exec.kv_spec();
        let ctx = self.exec.model_spec().ctx_len;
        for r in reqs {
            if r.prompt.is_empty() {
                return Err(DriverError::EmptyPrompt);
            }
            if r.prompt.len() >= ctx {
                return Err(DriverError::Exec(ExecError::ContextOverflow {
                    seq: 0,
                    end: r.prompt.len(),
                    ctx,
                }));
            }
            let len = r.prompt.len().saturating_add(r.max_new).min(ctx);
            let need = len.div_ceil(spec.block_size);
            if need > spec.num_blocks {
                return Err(DriverError::TooLong {
                    need,
                    have: spec.num_blocks,
                });
            }
        }
        let mut seqs: Vec<Seq> = reqs
            .iter()
            .map(|r| Seq {
                tokens: r.prompt.clone(),
                req: r.clone(),
                cached: 0,
                blocks: Vec::new(),
                generated: 0,
                finish: if r.max_new == 0 {
                    Some(Finish::Length)
                } else {
                    None
                },
            })
            .collect();
        let result = self.run_inner(&mut seqs, &mut on_token, ctx);
        // Every path, error included, gives the blocks back.
        for s in &mut seqs {
            self.free.append(&mut s.blocks);
        }
        result?;
        Ok(seqs
            .into_iter()
            .map(|s| {
                (
                    s.tokens[s.req.prompt.len()..].to_vec(),
                    s.finish.unwrap_or(Finish::Length),
                )
            })
            .collect())
    }

    fn run_inner(
        &mut self,
        seqs: &mut [Seq],
        on_token: &mut impl FnMut(usize, &Sampled),
        ctx: usize,
    ) -> Result<(), DriverError> {
        let bs = self.exec.kv_spec().block_size;
        let budget = self.exec.max_batch_tokens();
        let mut plan: Vec<(usize, usize, usize)> = Vec::new(); // (seq, start, len)
        loop {
            plan.clear();
            let mut used = 0;
            // Decodes first, then prefill chunks, under one token budget.
            for pass in 0..2 {
                for (i, s) in seqs.iter_mut().enumerate() {
                    let pending = s.tokens.len() - s.cached;
                    let decoding = pending == 1;
                    if s.finish.is_some()
                        || pending == 0
                        || (pass == 0) != decoding
                        || used >= budget
                    {
                        continue;
                    }
                    let n = pending.min(budget - used);
                    let need = (s.cached + n).div_ceil(bs);
                    if need > s.blocks.len() + self.free.len() {
                        continue; // waits for blocks of finishing sequences
                    }
                    while s.blocks.len() < need {
                        s.blocks.push(self.free.pop().expect("checked above"));
                    }
                    plan.push((i, s.cached, n));
                    used += n;
                }
            }
            if plan.is_empty() {
                if seqs.iter().all(|s| s.finish.is_some()) {
                    return Ok(());
                }
                let running = seqs.iter().filter(|s| s.finish.is_none()).count();
                return Err(DriverError::OutOfBlocks {
                    running,
                    blocks: self.exec.kv_spec().num_blocks,
                });
            }
            let batch: Vec<SeqInput<'_>> = plan
                .iter()
                .map(|&(i, start, n)| {
                    let s = &seqs[i];
                    SeqInput {
                        tokens: &s.tokens[start..start + n],
                        start_pos: start,
                        block_table: &s.blocks,
                        output: if start + n == s.tokens.len() {
                            OutputKind::Sample(s.req.params)
                        } else {
                            OutputKind::None
                        },
                        bias: &[],
                        draft_bias: &[],
                        allow: None,
                    }
                })
                .collect();
            self.exec.step(&batch, &mut self.out)?;
            drop(batch);
            for (j, &(i, _, n)) in plan.iter().enumerate() {
                let s = &mut seqs[i];
                s.cached += n;
                if let Some(sampled) = &self.out.seqs[j].sampled {
                    s.generated += 1;
                    s.tokens.push(sampled.token);
                    on_token(i, sampled);
                    if s.req.stop_tokens.contains(&sampled.token) {
                        s.finish = Some(Finish::Eos);
                    } else if s.generated >= s.req.max_new || s.tokens.len() >= ctx {
                        s.finish = Some(Finish::Length);
                    }
                    if s.finish.is_some() {
                        self.free.append(&mut s.blocks);
                    }
                }
            }
        }
    }
}
