//! Every kernel in `kernels/` compiles to PTX with NVRTC for sm_80 and
//! sm_90 and defines the kernels the executor loads. NVRTC is a compiler
//! library: no GPU is needed. CI installs it (`.ci/run`) and sets
//! FLOTILLA_REQUIRE_NVRTC=1, so there its absence fails the test; elsewhere
//! the test says why it did nothing.

use flotilla_cuda::kernels::{self, CompileError, SOURCES};

fn nvrtc_or_skip() -> bool {
    if kernels::nvrtc_present() {
        return true;
    }
    let required = std::env::var_os("FLOTILLA_REQUIRE_NVRTC").is_some_and(|v| v == "1");
    assert!(
        !required,
        "FLOTILLA_REQUIRE_NVRTC=1 but {}",
        CompileError::NoNvrtc
    );
    eprintln!("SKIPPED: {}", CompileError::NoNvrtc);
    false
}

#[test]
fn every_kernel_compiles_for_sm80_and_sm90() {
    if !nvrtc_or_skip() {
        return;
    }
    let mut compiled = 0;
    for src in SOURCES {
        for arch in ["compute_80", "compute_90"] {
            let ptx = kernels::compile(src, arch).unwrap_or_else(|e| panic!("{e}"));
            let text = ptx.to_src();
            assert!(
                text.contains(&format!(".target sm_{}", &arch[8..])),
                "{} for {arch}: PTX for another target",
                src.file
            );
            compiled += 1;
        }
    }
    assert_eq!(compiled, 2 * SOURCES.len());
}

#[test]
fn every_cu_file_is_built_into_the_executor() {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../kernels");
    let mut on_disk: Vec<String> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| n.ends_with(".cu"))
        .collect();
    on_disk.sort();
    let mut built: Vec<String> = SOURCES.iter().map(|s| s.file.to_string()).collect();
    built.sort();
    assert_eq!(on_disk, built);
    // And every `extern "C"` kernel in them is one the executor names.
    for src in SOURCES {
        for line in src.code.lines() {
            if let Some(rest) = line.split("__global__ void ").nth(1) {
                let name = rest.split('(').next().unwrap().trim();
                assert!(
                    src.kernels.contains(&name),
                    "{}: kernel {name} is not in SOURCES",
                    src.file
                );
            }
        }
    }
}

#[test]
fn a_source_with_an_error_is_refused_with_nvrtc_s_log() {
    if !nvrtc_or_skip() {
        return;
    }
    let bad = kernels::Source {
        file: "broken.cu",
        code: "extern \"C\" __global__ void k(float* x) { x[0] = undefined_name; }",
        kernels: &["k"],
    };
    let e = kernels::compile(&bad, "compute_90").unwrap_err();
    let msg = e.to_string();
    assert!(
        msg.contains("broken.cu") && msg.contains("undefined_name"),
        "{msg}"
    );
    let missing = kernels::Source {
        file: "missing.cu",
        code: "extern \"C\" __global__ void present(float* x) { x[0] = 1.0f; }",
        kernels: &["present", "absent"],
    };
    let e = kernels::compile(&missing, "compute_80").unwrap_err();
    assert!(
        matches!(
            e,
            CompileError::Missing {
                kernel: "absent",
                ..
            }
        ),
        "{e}"
    );
}
