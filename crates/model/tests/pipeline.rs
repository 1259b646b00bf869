//! Pipeline stages on the real model: a group of two or three stages
//! (each a part of the model, the later ones reached through the frames'
//! encoding) computes what one executor computes. With rows carried in
//! f32 every logit and every KV byte is the same bit for bit; in f16 the
//! greedy tokens are.

use std::ops::Range;

use flotilla_gguf::GgufFile;
use flotilla_model::pipeline::{InProcess, PipelineExecutor, Stage, StageLink};
use flotilla_model::testutil::{decode_with_drafts, plain_decode};
use flotilla_model::{
    CpuConfig, CpuExecutor, Executor, KvDtype, OutputKind, SamplingParams, SeqInput, StepOutputs,
};
use flotilla_proto::stage::{ActDtype, FromStage, STAGE_VERSION, StageHello, StageSeq, ToStage};

const PROMPT: [u32; 12] = [
    504, 3458, 282, 4649, 314, 7042, 30, 378, 3458, 282, 4649, 314,
];

fn cfg(kv_dtype: KvDtype) -> CpuConfig {
    CpuConfig {
        kv_dtype,
        threads: 2,
        num_blocks: 64,
        max_batch_tokens: 128,
        ..Default::default()
    }
}

fn whole(kv_dtype: KvDtype) -> CpuExecutor {
    CpuExecutor::load(&flotilla_hub::test_model_path(), &cfg(kv_dtype)).expect("load the model")
}

fn name(g: &GgufFile) -> String {
    g.str_opt("general.name")
        .ok()
        .flatten()
        .unwrap_or("")
        .to_string()
}

fn stage(g: &GgufFile, c: &CpuConfig, layers: Range<usize>) -> Stage {
    let bytes = std::fs::metadata(flotilla_hub::test_model_path())
        .unwrap()
        .len();
    let e = CpuExecutor::from_gguf_part(g, c, Some((layers, false))).expect("a stage's part");
    Stage::new(e, bytes, name(g))
}

/// A group whose stages run `cuts` (stage 0 from layer 0 to the first
/// cut, and so on to the model's last layer).
fn group(kv_dtype: KvDtype, cuts: &[usize], dtype: ActDtype) -> PipelineExecutor {
    let path = flotilla_hub::test_model_path();
    let g = GgufFile::open(&path).unwrap();
    let c = cfg(kv_dtype);
    let n = g.u64("llama.block_count").unwrap() as usize;
    let head = CpuExecutor::from_gguf_part(&g, &c, Some((0..cuts[0], true))).unwrap();
    let mut bounds = cuts.to_vec();
    bounds.push(n);
    let stages: Vec<(Box<dyn StageLink>, Range<usize>)> = bounds
        .windows(2)
        .map(|w| {
            // Stages that load the layers stage 0's hello names.
            let (file, c) = (path.clone(), c.clone());
            let loader = Box::new(move |h: &StageHello| {
                let g = GgufFile::open(&file).map_err(|e| e.to_string())?;
                let c = CpuConfig {
                    num_blocks: h.num_blocks as usize,
                    max_batch_tokens: h.max_batch_tokens as usize,
                    block_size: h.block_size as usize,
                    kv_dtype: KvDtype::parse(&h.kv_dtype)?,
                    ..c.clone()
                };
                let layers = h.layers.0 as usize..h.layers.1 as usize;
                CpuExecutor::from_gguf_part(&g, &c, Some((layers, false)))
                    .map_err(|e| e.to_string())
            });
            let bytes = std::fs::metadata(&path).unwrap().len();
            let s = Stage::loading(loader, bytes, name(&g));
            let link: Box<dyn StageLink> = Box::new(InProcess(s));
            (link, w[0]..w[1])
        })
        .collect();
    let bytes = std::fs::metadata(&path).unwrap().len();
    PipelineExecutor::connect(head, stages, dtype, bytes, &name(&g)).expect("the group forms")
}

/// A stage link that answers `after` calls, then is lost.
struct Dies {
    inner: InProcess,
    calls: usize,
    after: usize,
}

impl StageLink for Dies {
    fn call(&mut self, msg: &ToStage) -> Result<FromStage, String> {
        self.calls += 1;
        if self.calls > self.after {
            return Err("connection lost".into());
        }
        self.inner.call(msg)
    }
}

fn seq<'a>(tokens: &'a [u32], start: usize, output: OutputKind, table: &'a [u32]) -> SeqInput<'a> {
    SeqInput {
        tokens,
        start_pos: start,
        block_table: table,
        output,
        bias: &[],
        draft_bias: &[],
        allow: None,
    }
}

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|f| f.to_bits()).collect()
}

/// Two sequences through chunked prefill (their chunks in one step beside
/// the other's decode) and decode: every step's logits, from one
/// executor and from the group.
fn mixed_steps(e: &mut dyn Executor) -> Vec<Vec<f32>> {
    let (ta, tb): (Vec<u32>, Vec<u32>) = ((0..8).collect(), (8..16).collect());
    let b: Vec<u32> = PROMPT.iter().rev().copied().collect();
    let mut out = StepOutputs::default();
    let mut logits = Vec::new();
    // Step 1: a's first chunk alone (no output); b's whole prompt.
    e.step(
        &[
            seq(&PROMPT[..7], 0, OutputKind::None, &ta),
            seq(&b, 0, OutputKind::Logits, &tb),
        ],
        &mut out,
    )
    .unwrap();
    logits.push(out.logits.clone());
    // Step 2: a's last chunk, b's decode.
    e.step(
        &[
            seq(&PROMPT[7..], 7, OutputKind::Logits, &ta),
            seq(&[42], b.len(), OutputKind::Logits, &tb),
        ],
        &mut out,
    )
    .unwrap();
    logits.push(out.logits.clone());
    // Step 3: both decode; a verifies a draft of 3 (4 output rows).
    e.step(
        &[
            seq(
                &[7, 8, 9, 10],
                PROMPT.len(),
                OutputKind::Verify {
                    params: SamplingParams::greedy(),
                    draft: 3,
                },
                &ta,
            ),
            seq(&[43], b.len() + 1, OutputKind::Logits, &tb),
        ],
        &mut out,
    )
    .unwrap();
    logits.push(out.logits.clone());
    logits
}

#[test]
fn a_group_in_f32_computes_one_executors_bits() {
    for kv in [KvDtype::F16, KvDtype::Int8] {
        let mut one = whole(kv);
        let reference = mixed_steps(&mut one);
        for cuts in [&[11][..], &[7, 19]] {
            let mut g = group(kv, cuts, ActDtype::F32);
            assert_eq!(g.stage_layers().len(), cuts.len() + 1);
            assert_eq!(g.model_spec().n_layer, one.model_spec().n_layer);
            // A block's bytes in a group are one node's for it: KV moves
            // between a group and a node unchanged.
            assert_eq!(g.kv_spec().bytes_per_block, one.kv_spec().bytes_per_block);
            let got = mixed_steps(&mut g);
            for (i, (a, b)) in got.iter().zip(&reference).enumerate() {
                assert!(!a.is_empty());
                assert_eq!(bits(a), bits(b), "{kv} cuts {cuts:?}: step {i}'s logits");
            }
            let n = one.kv_spec().bytes_per_block;
            let (mut x, mut y) = (vec![0u8; n], vec![1u8; n]);
            for block in [0, 3, 9, 15] {
                one.read_block(block, &mut x).unwrap();
                g.read_block(block, &mut y).unwrap();
                assert!(x == y, "{kv} cuts {cuts:?}: block {block}'s bytes");
            }
            // Written into the group, copied inside it, read back whole.
            let pattern: Vec<u8> = (0..n).map(|i| (i * 7 % 251) as u8).collect();
            g.write_block(20, &pattern).unwrap();
            g.copy_block(20, 21).unwrap();
            g.read_block(21, &mut y).unwrap();
            assert!(y == pattern, "{kv} cuts {cuts:?}: write, copy, read");
        }
    }
}

#[test]
fn greedy_and_sampled_decoding_and_drafts_match_one_executor() {
    let table: Vec<u32> = (0..16).collect();
    let mut one = whole(KvDtype::F16);
    for p in [
        SamplingParams::greedy(),
        SamplingParams {
            temperature: 0.9,
            top_p: 0.95,
            seed: 7,
            logprobs: true,
            ..SamplingParams::greedy()
        },
    ] {
        let reference = plain_decode(&mut one, &PROMPT, p, 32, &table);
        let mut g = group(KvDtype::F16, &[13], ActDtype::F32);
        assert_eq!(
            plain_decode(&mut g, &PROMPT, p, 32, &table),
            reference,
            "{p:?}"
        );
        // Drafts verified by the group (drafted on stage 0) change nothing.
        let (drafted, accepted) =
            decode_with_drafts(&mut g, &PROMPT, p, &reference, (4, 3), &table);
        assert!(
            accepted > 0 && accepted < drafted,
            "{accepted} of {drafted}"
        );
        // Rows in f16 round once a hop, so greedy tokens may part from one
        // node's at a near-tie (on an AVX2-only AMD EPYC they parted at the
        // 29th of 32; on AVX-512 machines not at all): the first 16 are
        // one node's on every machine seen.
        if p.temperature == 0.0 {
            let mut h = group(KvDtype::F16, &[9, 21], ActDtype::F16);
            let got = plain_decode(&mut h, &PROMPT, p, 32, &table);
            assert_eq!(got.len(), reference.len());
            assert_eq!(got[..16], reference[..16], "f16 rows: {got:?}");
        }
    }
}

#[test]
fn self_drafts_run_on_stage_zero_alone() {
    let table: Vec<u32> = (0..16).collect();
    let mut one = whole(KvDtype::F16);
    let mut g = group(KvDtype::F16, &[10], ActDtype::F32);
    let batch = [seq(
        &PROMPT,
        0,
        OutputKind::Sample(SamplingParams::greedy()),
        &table,
    )];
    let (mut a, mut b) = (StepOutputs::default(), StepOutputs::default());
    one.draft_step(&batch, &mut a, 6).unwrap();
    g.draft_step(&batch, &mut b, 6).unwrap();
    assert_eq!(bits(&a.logits), bits(&b.logits), "6 layers, all on stage 0");
    // Deeper than stage 0: the draft is stage 0's 10 layers.
    one.draft_step(&batch, &mut a, 10).unwrap();
    g.draft_step(&batch, &mut b, 25).unwrap();
    assert_eq!(bits(&a.logits), bits(&b.logits));
}

#[test]
fn stages_refuse_what_does_not_fit_and_a_bad_step_changes_nothing() {
    let path = flotilla_hub::test_model_path();
    let g = GgufFile::open(&path).unwrap();
    let c = cfg(KvDtype::F16);
    let bytes = std::fs::metadata(&path).unwrap().len();
    let head = || CpuExecutor::from_gguf_part(&g, &c, Some((0..10, true))).unwrap();
    // The stage runs other layers than stage 0 expects.
    let link: Box<dyn StageLink> = Box::new(InProcess(stage(&g, &c, 12..30)));
    let e = PipelineExecutor::connect(
        head(),
        vec![(link, 10..30)],
        ActDtype::F32,
        bytes,
        &name(&g),
    )
    .unwrap_err();
    assert!(e.contains("stage 1 refused") && e.contains("12..30"), "{e}");
    // Layers left out, and another model file.
    let link: Box<dyn StageLink> = Box::new(InProcess(stage(&g, &c, 10..20)));
    let e = PipelineExecutor::connect(
        head(),
        vec![(link, 10..20)],
        ActDtype::F32,
        bytes,
        &name(&g),
    )
    .unwrap_err();
    assert!(e.contains("up to 20"), "{e}");
    let link: Box<dyn StageLink> = Box::new(InProcess(stage(&g, &c, 10..30)));
    let e = PipelineExecutor::connect(head(), vec![(link, 10..30)], ActDtype::F32, bytes + 1, "x")
        .unwrap_err();
    assert!(e.contains("runs x"), "{e}");
    // A stage answers nothing before hello, and refuses bad steps.
    let mut s = stage(&g, &c, 10..30);
    let d = s.exec().unwrap().config().n_embd;
    let step = |rows: usize, out_rows: u32, table: Vec<u32>| ToStage::Step {
        step: 1,
        seqs: vec![StageSeq {
            tokens: vec![1, 2, 3],
            start_pos: 0,
            block_table: table,
            out_rows,
        }],
        dtype: ActDtype::F32,
        rows: vec![0; rows],
        last: true,
    };
    let refused = |a: FromStage, what: &str| match a {
        FromStage::Refused { reason } => assert!(reason.contains(what), "{reason}"),
        o => panic!("answered {o:?}"),
    };
    refused(s.handle(step(3 * d * 4, 1, vec![0])), "no hello");
    let mut link = InProcess(s);
    let hello = ToStage::Hello(StageHello {
        version: STAGE_VERSION,
        model_bytes: bytes,
        model_name: name(&g),
        layers: (10, 30),
        block_size: 16,
        num_blocks: 64,
        kv_dtype: "f16".into(),
        max_batch_tokens: 128,
    });
    let mut other = hello.clone();
    if let ToStage::Hello(h) = &mut other {
        h.block_size = 32;
    }
    refused(link.call(&other).unwrap(), "blocks of 32");
    assert!(matches!(
        link.call(&hello).unwrap(),
        FromStage::Ready { .. }
    ));
    let n = link.0.exec().unwrap().kv_spec().bytes_per_block;
    let before = {
        let mut b = vec![0u8; n];
        link.0.exec().unwrap().read_block(0, &mut b).unwrap();
        b
    };
    refused(
        link.call(&step(3 * d * 4 - 1, 1, vec![0])).unwrap(),
        "bytes of rows",
    );
    refused(
        link.call(&step(3 * d * 4, 4, vec![0])).unwrap(),
        "output rows",
    );
    refused(link.call(&step(3 * d * 4, 1, vec![64])).unwrap(), "block");
    refused(link.call(&step(3 * d * 4, 1, vec![])).unwrap(), "block");
    refused(
        link.call(&ToStage::WriteBlock {
            block: 0,
            data: vec![1; n - 1],
        })
        .unwrap(),
        "bytes",
    );
    refused(link.call(&ToStage::ReadBlock { block: 64 }).unwrap(), "64");
    let mut after = vec![1u8; n];
    link.0.exec().unwrap().read_block(0, &mut after).unwrap();
    assert!(before == after, "refused frames wrote nothing");
    // A good step is answered with the output row only.
    match link.call(&step(3 * d * 4, 1, vec![0])).unwrap() {
        FromStage::Rows { step: 1, rows } => assert_eq!(rows.len(), d * 4),
        o => panic!("answered {o:?}"),
    }
}

/// A stage that stops answering fails the step with a backend error
/// (the engine then stops the group), and so does one that answers
/// with the wrong step.
#[test]
fn a_lost_stage_fails_the_step() {
    let path = flotilla_hub::test_model_path();
    let g = GgufFile::open(&path).unwrap();
    let c = cfg(KvDtype::F16);
    let bytes = std::fs::metadata(&path).unwrap().len();
    let head = CpuExecutor::from_gguf_part(&g, &c, Some((0..10, true))).unwrap();
    let link = Dies {
        inner: InProcess(stage(&g, &c, 10..30)),
        calls: 0,
        after: 2,
    };
    let mut e = PipelineExecutor::connect(
        head,
        vec![(Box::new(link), 10..30)],
        ActDtype::F16,
        bytes,
        &name(&g),
    )
    .unwrap();
    let table: Vec<u32> = (0..4).collect();
    let mut out = StepOutputs::default();
    let p = OutputKind::Sample(SamplingParams::greedy());
    e.step(&[seq(&PROMPT, 0, p, &table)], &mut out).unwrap();
    let err = e
        .step(&[seq(&[5], PROMPT.len(), p, &table)], &mut out)
        .unwrap_err();
    assert!(
        matches!(&err, flotilla_model::ExecError::Lost(m) if m.contains("stage 1 lost")),
        "{err:?}"
    );
}

/// Steps begun before the ones before them finish (the engine keeps one
/// in flight per stage) give each step's own results, and a block read
/// while a step is in flight sees the cache as the steps sent so far
/// left it.
#[test]
fn overlapping_steps_give_each_its_own_results() {
    let (ta, tb): (Vec<u32>, Vec<u32>) = ((0..4).collect(), (4..8).collect());
    let b_prompt: Vec<u32> = PROMPT.iter().rev().copied().collect();
    let lg = OutputKind::Logits;
    let (x, y) = ([11u32], [12u32]);
    let a1 = vec![seq(&PROMPT, 0, lg, &ta)];
    let b1 = vec![seq(&b_prompt, 0, lg, &tb)];
    let a2 = vec![seq(&x, PROMPT.len(), lg, &ta)];
    let b2 = vec![seq(&y, b_prompt.len(), lg, &tb)];
    let mut one = whole(KvDtype::F16);
    let mut reference = Vec::new();
    let mut out = StepOutputs::default();
    for b in [&a1, &b1, &a2, &b2] {
        one.step(b, &mut out).unwrap();
        reference.push(bits(&out.logits));
    }
    let n = one.kv_spec().bytes_per_block;
    let mut want = vec![0u8; n];
    one.read_block(4, &mut want).unwrap();
    for cuts in [&[9][..], &[6, 18]] {
        let mut g = group(KvDtype::F16, cuts, ActDtype::F32);
        assert_eq!(g.pipeline_depth(), cuts.len() + 1);
        let (mut scratch, mut o) = (StepOutputs::default(), StepOutputs::default());
        let mut got = Vec::new();
        g.begin_step(&a1, &mut scratch).unwrap();
        g.begin_step(&b1, &mut scratch).unwrap();
        g.finish_step(&a1, &mut o).unwrap();
        got.push(bits(&o.logits));
        g.begin_step(&a2, &mut scratch).unwrap();
        g.finish_step(&b1, &mut o).unwrap();
        got.push(bits(&o.logits));
        g.begin_step(&b2, &mut scratch).unwrap();
        // B's first block, read while a2 and b2 are in flight: b1 wrote
        // it, b2's token is in it too (sent before the read).
        let mut have = vec![1u8; n];
        g.read_block(4, &mut have).unwrap();
        g.finish_step(&a2, &mut o).unwrap();
        got.push(bits(&o.logits));
        g.finish_step(&b2, &mut o).unwrap();
        got.push(bits(&o.logits));
        assert_eq!(got, reference, "cuts {cuts:?}");
        assert!(have == want, "cuts {cuts:?}: the block read in flight");
    }
}

/// A group that lost a stage forms again once the stage answers: every
/// block's contents are gone, and a new sequence decodes as one node.
#[test]
fn a_group_recovers_when_its_stage_answers_again() {
    let path = flotilla_hub::test_model_path();
    let g = GgufFile::open(&path).unwrap();
    let c = cfg(KvDtype::F16);
    let bytes = std::fs::metadata(&path).unwrap().len();
    let head = CpuExecutor::from_gguf_part(&g, &c, Some((0..10, true))).unwrap();
    let link = Dies {
        inner: InProcess(stage(&g, &c, 10..30)),
        calls: 0,
        after: 2,
    };
    let mut e = PipelineExecutor::connect(
        head,
        vec![(Box::new(link), 10..30)],
        ActDtype::F32,
        bytes,
        &name(&g),
    )
    .unwrap();
    assert!(!e.recover(), "no way to dial again: no recovery");
    let (p2, c2) = (path.clone(), c.clone());
    let dials = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let d = dials.clone();
    let mut e = e.with_redial(Box::new(move |_| {
        // The first dial finds the stage still down.
        if d.fetch_add(1, std::sync::atomic::Ordering::SeqCst) == 0 {
            return Err("connection refused".into());
        }
        let g = GgufFile::open(&p2).map_err(|e| e.to_string())?;
        let s = stage(&g, &c2, 10..30);
        Ok(Box::new(InProcess(s)) as Box<dyn StageLink>)
    }));
    let table: Vec<u32> = (0..8).collect();
    let p = SamplingParams::greedy();
    let mut out = StepOutputs::default();
    e.step(&[seq(&PROMPT, 0, OutputKind::Sample(p), &table)], &mut out)
        .unwrap();
    assert!(
        e.step(
            &[seq(&[5], PROMPT.len(), OutputKind::Sample(p), &table)],
            &mut out
        )
        .is_err()
    );
    assert!(!e.recover(), "the stage is not back yet");
    assert!(e.recover(), "the stage is back");
    let mut one = whole(KvDtype::F16);
    let reference = plain_decode(&mut one, &PROMPT, p, 16, &table);
    assert_eq!(plain_decode(&mut e, &PROMPT, p, 16, &table), reference);
    assert_eq!(dials.load(std::sync::atomic::Ordering::SeqCst), 2);
}
