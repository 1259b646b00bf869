//! Mask computation time per token per sequence, over the JSON schemas of
//! `tests/fixtures/json_schemas.json` on the default model's vocabulary:
//!
//!   cargo run --release -p flotilla-grammar --example mask_time [-- --model FILE]
//!
//! Each schema's matcher is driven to completion (or 200 tokens) by the
//! longest allowed token at each step, as a model writing a long value
//! would; every mask is timed. Prints compile time per schema and mask
//! time p50/p99/max over all masks.

use std::path::PathBuf;
use std::time::Instant;

use flotilla_exec::Constraint;
use flotilla_exec::constraint::allowed;
use flotilla_gguf::GgufFile;
use flotilla_text::TextSide;

fn pct(v: &[f64], p: f64) -> f64 {
    v[((v.len() as f64 - 1.0) * p).round() as usize]
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut args = std::env::args().skip(1);
    let mut model = None;
    while let Some(a) = args.next() {
        match a.as_str() {
            "--model" => model = args.next().map(PathBuf::from),
            other => return Err(format!("unknown argument {other}").into()),
        }
    }
    let path = match model {
        Some(p) => p,
        None => flotilla_hub::ensure_default_model(true)?,
    };
    let text = TextSide::from_gguf(&GgufFile::open(&path)?)?;
    let t0 = Instant::now();
    let c = flotilla_grammar::compiler_for(&text)?;
    eprintln!(
        "vocabulary of {} tokens ready in {:.1} ms",
        text.tokenizer.vocab_size(),
        t0.elapsed().as_secs_f64() * 1e3
    );
    let fixture = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../tests/fixtures/json_schemas.json"
    );
    let schemas: Vec<serde_json::Value> = serde_json::from_str(&std::fs::read_to_string(fixture)?)?;
    let n = text.tokenizer.vocab_size() as u32;
    let (mut masks, mut compiles) = (Vec::new(), Vec::new());
    let mut words = Vec::new();
    for s in &schemas {
        let t = Instant::now();
        let mut m = c.compile(&Constraint::JsonSchema(s.to_string()))?;
        compiles.push(t.elapsed().as_secs_f64() * 1e6);
        for _ in 0..200 {
            let t = Instant::now();
            m.allowed(&mut words);
            masks.push(t.elapsed().as_secs_f64() * 1e6);
            let next = (0..n).filter(|&id| allowed(&words, id)).max_by_key(|&id| {
                (
                    text.tokenizer.token_bytes(id).map_or(0, <[u8]>::len),
                    std::cmp::Reverse(id),
                )
            });
            let Some(next) = next else { break };
            if text.stop_tokens.contains(&next) || m.commit(next)? {
                break;
            }
        }
    }
    masks.sort_by(f64::total_cmp);
    compiles.sort_by(f64::total_cmp);
    println!(
        "{} schemas: compile p50 {:.0} us, max {:.0} us; {} masks: p50 {:.1} us, p99 {:.1} us, max {:.1} us",
        schemas.len(),
        pct(&compiles, 0.5),
        compiles.last().copied().unwrap_or(0.0),
        masks.len(),
        pct(&masks, 0.5),
        pct(&masks, 0.99),
        masks.last().copied().unwrap_or(0.0),
    );
    Ok(())
}
