//! The layout cache (`flotilla_model::layout`): written by the first load,
//! mapped by the next, rebuilt when it no longer fits the model file, and
//! never a reason for a load to fail or a logit to change.

mod common;

use std::path::{Path, PathBuf};

use flotilla_model::kernels::Kernel;
use flotilla_model::{CpuConfig, CpuExecutor};

fn config(cache: Option<PathBuf>) -> CpuConfig {
    CpuConfig {
        threads: 2,
        num_blocks: 8,
        max_batch_tokens: 64,
        kernel: Kernel::Auto,
        layout_cache: cache,
        ..Default::default()
    }
}

/// Loads `model` and returns the load's note and the logits of a prompt.
fn run(model: &Path, cache: Option<PathBuf>) -> (Option<String>, Vec<f32>) {
    let mut e = CpuExecutor::load(model, &config(cache)).unwrap();
    let ids: Vec<u32> = (0..20).map(|i| 100 + 31 * i).collect();
    let logits = common::step_logits(&mut e, &ids, 0, &[0, 1]);
    (e.load_note().map(str::to_string), logits)
}

fn the_file(dir: &Path) -> PathBuf {
    let files: Vec<PathBuf> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|x| x == "layout"))
        .collect();
    assert_eq!(files.len(), 1, "{files:?}");
    files[0].clone()
}

#[test]
fn the_first_load_writes_the_cache_and_the_next_maps_it_with_the_same_logits() {
    let tmp = tempfile::tempdir().unwrap();
    // A copy of the model of our own, so its time stamp can be changed.
    let model = tmp.path().join("model.gguf");
    std::fs::copy(flotilla_hub::test_model_path(), &model).unwrap();
    let cache = tmp.path().join("layouts");
    let (none, want) = run(&model, None);
    assert!(none.is_none());

    let (note, got) = run(&model, Some(cache.clone()));
    let note = note.unwrap();
    assert!(note.contains(": written"), "{note}");
    assert_eq!(got, want, "logits after writing the cache");
    let file = the_file(&cache);
    let written = std::fs::metadata(&file).unwrap().modified().unwrap();

    let (note, got) = run(&model, Some(cache.clone()));
    let note = note.unwrap();
    assert!(note.contains("matrices mapped"), "{note}");
    assert_eq!(got, want, "logits from the mapped cache");
    assert_eq!(
        std::fs::metadata(&file).unwrap().modified().unwrap(),
        written
    );

    // A byte of the data changed: the checksum refuses it, the load rebuilds it.
    let mut bytes = std::fs::read(&file).unwrap();
    let at = bytes.len() - 1000;
    bytes[at] ^= 0x40;
    std::fs::write(&file, &bytes).unwrap();
    let (note, got) = run(&model, Some(cache.clone()));
    let note = note.unwrap();
    assert!(
        note.contains("checksum mismatch") && note.contains("written"),
        "{note}"
    );
    assert_eq!(got, want);
    assert!(
        run(&model, Some(cache.clone()))
            .0
            .unwrap()
            .contains("mapped")
    );

    // The entry table changed (one matrix's name is now another's): the
    // checksum covers it too.
    let mut bytes = std::fs::read(&file).unwrap();
    let name = b"blk.0.attn_q.weight";
    let at = bytes[..4096]
        .windows(name.len())
        .position(|w| w == name)
        .expect("the table names blk.0.attn_q.weight");
    bytes[at + 11] = b'k';
    std::fs::write(&file, &bytes).unwrap();
    let (note, got) = run(&model, Some(cache.clone()));
    let note = note.unwrap();
    assert!(
        note.contains("checksum mismatch") && note.contains("written"),
        "{note}"
    );
    assert_eq!(got, want);

    // Another layout version's file is not read.
    let mut bytes = std::fs::read(&file).unwrap();
    bytes[8] = bytes[8].wrapping_add(1);
    std::fs::write(&file, &bytes).unwrap();
    let note = run(&model, Some(cache.clone())).0.unwrap();
    assert!(note.contains("layout version"), "{note}");

    // An older layout version's cache of this model and kernel is removed
    // when the new one is written; another model's is not.
    let name = file.file_name().unwrap().to_str().unwrap().to_string();
    let current = format!(".v{}.", flotilla_model::layout::LAYOUT_VERSION);
    let old = cache.join(name.replace(&current, ".v1."));
    let other = cache.join(name.replace("model.", "other-model."));
    assert_ne!(old, file);
    std::fs::write(&old, b"an old layout").unwrap();
    std::fs::write(&other, b"another model's layout").unwrap();

    // The model file changed (its time stamp): rebuilt, not trusted.
    let f = std::fs::File::options().write(true).open(&model).unwrap();
    f.set_modified(std::time::SystemTime::now() + std::time::Duration::from_secs(60))
        .unwrap();
    drop(f);
    let (note, got) = run(&model, Some(cache.clone()));
    let note = note.unwrap();
    assert!(
        note.contains("model file changed") && note.contains("written"),
        "{note}"
    );
    assert_eq!(got, want);
    assert!(!old.exists(), "the older version's cache is removed");
    assert!(other.exists(), "another model's cache stays");
    std::fs::remove_file(&other).unwrap();
    assert_eq!(the_file(&cache), file, "one file per model and kernel");
}

/// A cache directory that cannot be written costs the conversion, not the
/// load, and says so.
#[test]
fn a_cache_that_cannot_be_written_is_a_note_not_a_failure() {
    let tmp = tempfile::tempdir().unwrap();
    // A plain file where the directory would be: nothing can go under it.
    let blocked = tmp.path().join("not-a-dir");
    std::fs::write(&blocked, b"x").unwrap();
    let model = flotilla_hub::test_model_path();
    let (_, want) = run(&model, None);
    let (note, got) = run(&model, Some(blocked.join("layouts")));
    let note = note.unwrap();
    assert!(note.contains("not written"), "{note}");
    assert_eq!(got, want);
}
