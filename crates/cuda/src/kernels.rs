//! The CUDA sources in `kernels/`, built into the binary and compiled at
//! run time with NVRTC for the device's compute capability.

use cudarc::nvrtc::{CompileOptions, Ptx};

/// One source file and the `extern "C"` kernels it must define.
#[derive(Clone, Copy, Debug)]
pub struct Source {
    /// File name under `kernels/`.
    pub file: &'static str,
    /// Its text.
    pub code: &'static str,
    /// Kernel names the executor loads from it.
    pub kernels: &'static [&'static str],
}

/// Every kernel source the executor uses.
pub const SOURCES: &[Source] = &[
    Source {
        file: "norm.cu",
        code: include_str!("../../../kernels/norm.cu"),
        kernels: &["rms_norm_residual"],
    },
    Source {
        file: "rope.cu",
        code: include_str!("../../../kernels/rope.cu"),
        kernels: &["rope_qk"],
    },
    Source {
        file: "kv.cu",
        code: include_str!("../../../kernels/kv.cu"),
        kernels: &["kv_append", "kv_append_q8", "copy_block", "hadamard_rows"],
    },
    Source {
        file: "attention.cu",
        code: include_str!("../../../kernels/attention.cu"),
        kernels: &["paged_attention", "paged_attention_q8"],
    },
    Source {
        file: "ffn.cu",
        code: include_str!("../../../kernels/ffn.cu"),
        kernels: &[
            "swiglu",
            "geglu",
            "embed",
            "f32_to_f16",
            "add_rows",
            "gather_rows",
        ],
    },
    Source {
        file: "dequant.cu",
        code: include_str!("../../../kernels/dequant.cu"),
        kernels: &[
            "dequant_q8_0",
            "dequant_q4_0",
            "dequant_q4_1",
            "bf16_to_f16",
        ],
    },
    Source {
        file: "sample.cu",
        code: include_str!("../../../kernels/sample.cu"),
        kernels: &["argmax_rows"],
    },
];

/// Whether NVRTC (`libnvrtc.so`) can be loaded. cudarc panics on first use
/// of a library it cannot find, so every entry point checks this first.
pub fn nvrtc_present() -> bool {
    // SAFETY: only tries to dlopen the library by its usual names.
    unsafe { cudarc::nvrtc::sys::is_culib_present() }
}

/// Why a source did not compile.
#[derive(Debug, thiserror::Error)]
pub enum CompileError {
    /// NVRTC is not installed.
    #[error(
        "NVRTC (libnvrtc.so.12) was not found: install the CUDA toolkit or \
         `pip install nvidia-cuda-nvrtc-cu12` and add its lib directory to LD_LIBRARY_PATH"
    )]
    NoNvrtc,
    /// NVRTC refused the source.
    #[error("kernels/{file} does not compile for {arch}: {log}")]
    Source {
        /// The file.
        file: &'static str,
        /// Target, e.g. `compute_90`.
        arch: &'static str,
        /// NVRTC's log.
        log: String,
    },
    /// The PTX lacks a kernel the executor loads.
    #[error("kernels/{file} compiled for {arch} has no kernel {kernel}")]
    Missing {
        /// The file.
        file: &'static str,
        /// Target.
        arch: &'static str,
        /// The kernel.
        kernel: &'static str,
    },
}

/// `compute_XY` for a compute capability, as NVRTC names it.
pub fn arch_name(major: i32, minor: i32) -> Option<&'static str> {
    Some(match (major, minor) {
        (7, 0) => "compute_70",
        (7, 5) => "compute_75",
        (8, 0) => "compute_80",
        (8, 6) => "compute_86",
        (8, 7) => "compute_87",
        (8, 9) => "compute_89",
        (9, 0) => "compute_90",
        (10, 0) => "compute_100",
        (12, 0) => "compute_120",
        _ => return None,
    })
}

/// Compiles one source for `arch` and checks that every kernel it must
/// define is in the PTX.
pub fn compile(src: &Source, arch: &'static str) -> Result<Ptx, CompileError> {
    if !nvrtc_present() {
        return Err(CompileError::NoNvrtc);
    }
    let opts = CompileOptions {
        arch: Some(arch),
        name: Some(src.file.to_string()),
        ..Default::default()
    };
    let ptx = cudarc::nvrtc::compile_ptx_with_opts(src.code, opts).map_err(|e| {
        let log = match e {
            cudarc::nvrtc::CompileError::CompileError { log, .. } => {
                log.to_string_lossy().into_owned()
            }
            other => other.to_string(),
        };
        CompileError::Source {
            file: src.file,
            arch,
            log,
        }
    })?;
    let text = ptx.to_src();
    for &kernel in src.kernels {
        let entry = format!(".entry {kernel}(");
        if !text.contains(&entry) {
            return Err(CompileError::Missing {
                file: src.file,
                arch,
                kernel,
            });
        }
    }
    Ok(ptx)
}
