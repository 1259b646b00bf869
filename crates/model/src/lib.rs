//! Flotilla's model runtime: architectures as data ([`arch`]), the CPU
//! forward pass with quantised kernels, and sampling. The GGUF reader
//! (`flotilla-gguf`), the tokenizers and chat templates (`flotilla-text`),
//! the model download (`flotilla-hub`) and the executor seam
//! (`flotilla-exec`) are crates of their own.

pub mod arch;
pub mod cpu;
pub mod generate;
pub mod kernels;
mod kvcache;
pub mod model;
pub mod pool;
pub mod quality;
pub mod quant;
pub mod sampling;
#[doc(hidden)]
pub mod testutil;

pub use cpu::{CpuConfig, CpuExecutor, LoadError};
/// The executor seam lives in `flotilla-exec`; its paths stay valid here.
pub use flotilla_exec::executor;
pub use flotilla_exec::{
    BatchLimits, ExecError, Executor, KvDtype, KvSpec, ModelSpec, OutputKind, SeqInput, SeqOutput,
    StepOutputs, sample_outputs, validate_batch,
};
/// The GGUF reader; its paths stay valid here.
pub use flotilla_gguf as gguf;
pub use sampling::{Sampled, SamplingParams};
