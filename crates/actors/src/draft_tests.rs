//! The draft model in the GpuWorker, on fake executors whose "model" is a
//! function of the last two tokens: the draft guesses right exactly when
//! the KV it reads is the sequence's own, so every draft accepted shows
//! that the worker never trusted draft KV it had not written for those
//! tokens (a new sequence, a preempted one back in other blocks, a block
//! another sequence's draft wrote since).

use std::sync::Arc;
use std::time::{Duration, Instant};

use flotilla_engine::Engine;
use flotilla_exec::{
    ExecError, Executor, KvDtype, KvSpec, ModelSpec, OutputKind, Sampled, SeqInput, SeqOutput,
    StepOutputs,
};
use flotilla_proto::{EngineEvent, EngineRequest};
use flotilla_sched::{SchedConfig, Speculation};
use flotilla_telemetry::Metrics;

use crate::{Clock, EngineOptions, spawn_engine};

use crate::tests::{BLOCK, slot};

const BLOCKS: usize = 64;

struct TestClock(Instant);

impl Clock for TestClock {
    fn now(&self) -> Duration {
        self.0.elapsed()
    }
}

/// The fake model: the token after `prev, cur`.
fn next(prev: u32, cur: u32) -> u32 {
    (prev * 31 + cur * 17) % 90 + 5
}

/// A fake model over a one-byte-a-position KV cache (the token there). As
/// the target it verifies drafts and takes `step` of modelled time a step
/// plus `per_token` a position; as the draft, `step` a pass.
struct Fake {
    spec: ModelSpec,
    kv: Vec<u8>,
    step: Duration,
    per_token: Duration,
    last: Duration,
    verifies: bool,
    /// As a draft: unsure (log-probability -5) of a guess after tokens
    /// whose sum is a multiple of 4, so some drafts end early.
    unsure: bool,
}

impl Fake {
    fn new(vocab: usize, verifies: bool, step: Duration, per_token: Duration) -> Fake {
        Fake {
            spec: ModelSpec {
                name: "fake".into(),
                arch: "llama".into(),
                n_layer: 1,
                n_embd: 8,
                n_head: 1,
                n_head_kv: 1,
                head_dim: 8,
                vocab,
                ctx_len: 64,
                weight_bytes: 0,
            },
            kv: vec![0; BLOCKS * BLOCK],
            step,
            per_token,
            last: Duration::ZERO,
            verifies,
            unsure: false,
        }
    }
}

impl Executor for Fake {
    fn model_spec(&self) -> &ModelSpec {
        &self.spec
    }

    fn kv_spec(&self) -> KvSpec {
        KvSpec {
            block_size: BLOCK,
            num_blocks: BLOCKS,
            dtype: KvDtype::F32,
            bytes_per_block: BLOCK,
        }
    }

    fn max_batch_tokens(&self) -> usize {
        256
    }

    fn max_draft_tokens(&self) -> usize {
        if self.verifies { 8 } else { 0 }
    }

    fn step(&mut self, batch: &[SeqInput<'_>], out: &mut StepOutputs) -> Result<(), ExecError> {
        out.seqs.clear();
        let mut tokens = 0;
        for s in batch {
            let table = s.block_table;
            for (i, &t) in s.tokens.iter().enumerate() {
                self.kv[slot(table, s.start_pos + i)] = t as u8;
            }
            tokens += s.tokens.len();
            let (kv, unsure) = (&self.kv, self.unsure);
            let mut o = SeqOutput::default();
            flotilla_exec::sample_outputs(s, &mut o, |d| {
                // The input of this row: the token before the sampled one.
                let draft = match s.output {
                    OutputKind::Verify { draft, .. } => draft,
                    _ => 0,
                };
                let at = s.start_pos + s.tokens.len() - draft - 1 + d.row;
                let prev = if at == 0 {
                    0
                } else {
                    u32::from(kv[slot(table, at - 1)])
                };
                let cur = u32::from(kv[slot(table, at)]);
                Sampled {
                    token: next(prev, cur),
                    logprob: if unsure && (prev + cur) % 4 == 0 {
                        -5.0
                    } else {
                        0.0
                    },
                    top: Vec::new(),
                }
            });
            out.seqs.push(o);
        }
        self.last = self.step + self.per_token * tokens as u32;
        Ok(())
    }

    fn simulated_step_time(&self) -> Option<Duration> {
        Some(self.last)
    }

    fn copy_block(&mut self, _src: u32, _dst: u32) -> Result<(), ExecError> {
        Ok(())
    }

    fn read_block(&self, block: u32, out: &mut [u8]) -> Result<(), ExecError> {
        let s = block as usize * BLOCK;
        out.copy_from_slice(&self.kv[s..s + BLOCK]);
        Ok(())
    }

    fn write_block(&mut self, block: u32, data: &[u8]) -> Result<(), ExecError> {
        let s = block as usize * BLOCK;
        self.kv[s..s + BLOCK].copy_from_slice(data);
        Ok(())
    }
}

fn sched(num_blocks: u32, seats: usize) -> SchedConfig {
    SchedConfig {
        num_blocks,
        max_num_seqs: seats,
        speculation: Speculation::draft_model(4),
        ..crate::tests::r_sched()
    }
}

fn request(first: u32, max_tokens: u32) -> EngineRequest {
    EngineRequest {
        prompt: (first..first + 6).collect(),
        ..crate::tests::prompt_of(max_tokens)
    }
}

/// The fake model's own continuation of `prompt`.
fn expected(prompt: &[u32], n: usize) -> Vec<u32> {
    let mut all = prompt.to_vec();
    for _ in 0..n {
        let k = all.len();
        all.push(next(all[k - 2], all[k - 1]));
    }
    all.split_off(prompt.len())
}

fn counter(text: &str, name: &str) -> f64 {
    text.lines()
        .filter(|l| l.starts_with(name))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
#[allow(
    clippy::disallowed_methods,
    reason = "the actors run on real timers here, so the clock is the real one"
)]
async fn a_draft_model_guesses_from_its_own_kv_only_and_every_block_comes_back() {
    let ms = Duration::from_millis;
    // A step reads the weights (20 ms) and each position adds 1 ms; a
    // draft pass costs 1 ms: the cost sum drafts the most it may.
    let target = Fake::new(100, true, ms(20), ms(1));
    let draft = Fake {
        unsure: true,
        ..Fake::new(100, false, ms(1), Duration::ZERO)
    };
    let metrics = Arc::new(Metrics::new().unwrap());
    let broken = Arc::new(std::sync::Mutex::new(None::<String>));
    let seen = broken.clone();
    // 12 blocks of 4 tokens for three sequences of up to 36 tokens:
    // they preempt one another.
    let engine = spawn_engine(
        Box::new(target),
        EngineOptions {
            sched: sched(12, 3),
            // Every scheduler invariant (each lease's blocks among them)
            // after every message.
            check_invariants: Some(Arc::new(move |what| {
                seen.lock().unwrap().get_or_insert(what);
            })),
            constraints: None,
            offload_path: None,
            tracing: None,
            draft: Some(Box::new(draft)),
        },
        Arc::new(TestClock(Instant::now())),
        metrics.clone(),
    )
    .await
    .unwrap();
    let mut streams = Vec::new();
    for (first, n) in [(11, 30), (21, 30), (31, 30), (41, 40)] {
        let req = request(first, n);
        let prompt = req.prompt.clone();
        streams.push((prompt, n, engine.submit(req).await.unwrap()));
    }
    // The last one is cancelled after a few tokens.
    let (_, _, mut cancelled) = streams.pop().unwrap();
    for (prompt, n, mut rs) in streams {
        let mut got = Vec::new();
        loop {
            match tokio::time::timeout(Duration::from_secs(20), rs.recv()).await {
                Ok(Some(EngineEvent::Token(t))) => got.push(t.token),
                Ok(Some(EngineEvent::Finished { .. })) => break,
                other => panic!("{other:?}"),
            }
        }
        assert_eq!(
            got,
            expected(&prompt, n as usize),
            "a draft changed the text"
        );
    }
    let mut seen = 0;
    while let Ok(Some(EngineEvent::Token(_))) =
        tokio::time::timeout(Duration::from_secs(20), cancelled.recv()).await
    {
        seen += 1;
        if seen == 3 {
            break;
        }
    }
    drop(cancelled);
    let text = metrics.render();
    let drafted = counter(&text, "flotilla_spec_draft_tokens_total");
    let accepted = counter(&text, "flotilla_spec_accepted_tokens_total");
    let passes = counter(&text, "flotilla_spec_draft_model_passes_total");
    let preempted = counter(&text, "flotilla_preemptions_total");
    assert!(preempted > 0.0, "no sequence was preempted:\n{text}");
    assert!(drafted > 0.0 && passes > 0.0, "no draft:\n{text}");
    assert_eq!(
        accepted, drafted,
        "a guess from KV the draft had not written for these tokens"
    );
    // Every block, the draft's half with it, comes back.
    let waited = tokio::time::timeout(Duration::from_secs(10), async {
        while engine.status().await.kv.used != 0 {
            tokio::time::sleep(ms(10)).await;
        }
    });
    assert!(waited.await.is_ok(), "blocks still held");
    assert_eq!(*broken.lock().unwrap(), None, "a scheduler invariant broke");
    // Some drafts ended early where the draft was unsure: fewer proposed
    // than planned, and their positions went back.
    let verified = counter(&text, "flotilla_spec_verify_steps_total");
    assert!(
        drafted < 4.0 * verified,
        "{drafted} drafted in {verified} verify steps"
    );
    engine.stop();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[allow(
    clippy::disallowed_methods,
    reason = "the actors run on real timers here, so the clock is the real one"
)]
async fn a_draft_model_of_another_vocabulary_is_refused_with_both_sizes() {
    let ms = Duration::from_millis;
    let err = spawn_engine(
        Box::new(Fake::new(100, true, ms(1), ms(1))),
        EngineOptions {
            sched: sched(12, 3),
            check_invariants: None,
            constraints: None,
            offload_path: None,
            tracing: None,
            draft: Some(Box::new(Fake::new(120, false, ms(1), ms(1)))),
        },
        Arc::new(TestClock(Instant::now())),
        Arc::new(Metrics::new().unwrap()),
    )
    .await
    .expect_err("refused");
    let why = err.to_string();
    assert!(
        why.contains("120 tokens") && why.contains("100 tokens"),
        "{why}"
    );
}

/// The records of what each block's draft half holds: trusted as far as
/// they match the sequence's tokens in its own table's blocks, and no
/// further.
#[test]
fn draft_kv_is_trusted_only_as_far_as_the_records_match() {
    let fake = Fake::new(100, false, Duration::ZERO, Duration::ZERO);
    let mut d = crate::draft::DraftModel::new(Box::new(fake), 256, 0.0);
    let toks: Vec<u32> = (10..30).collect();
    let table = [3, 7, 1, 9, 4, 5];
    assert_eq!(d.valid(&toks, &table), 0, "nothing written yet");
    d.record(&toks[..10], &table, 0);
    assert_eq!(d.valid(&toks, &table), 10);
    assert_eq!(d.valid(&toks[..6], &table), 6);
    // The same tokens in other blocks (a preempted sequence back): none.
    assert_eq!(d.valid(&toks, &[8, 7, 1, 9, 4]), 0);
    // Another sequence sharing the first two blocks (a cached prefix),
    // then its own: the shared blocks.
    let mut other = toks[..8].to_vec();
    other.extend([99, 98]);
    assert_eq!(d.valid(&other, &[3, 7, 2, 6]), 8);
    // A token that differs: up to it.
    let mut diff = toks.clone();
    diff[9] = 77;
    assert_eq!(d.valid(&diff, &table), 9);
    // Block 7 written since by a sequence with another first block: the
    // same tokens after another prefix are not this sequence's KV.
    let mut foreign = vec![50, 51, 52, 53];
    foreign.extend_from_slice(&toks[4..8]);
    d.record(&foreign, &[0, 7], 4);
    assert_eq!(d.valid(&toks, &table), 4);
    // Written again for this sequence: trusted again, as far as written.
    d.record(&toks[..14], &table, 4);
    assert_eq!(d.valid(&toks, &table), 14);
}
