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
pub mod layout;
pub mod pipeline;
pub mod pool;
pub mod quality;
pub mod quant;
pub mod sampling;
#[doc(hidden)]
pub mod testutil;

pub use cpu::{CpuConfig, CpuExecutor, LoadError};
pub use flotilla_exec::{
    BatchLimits, ExecError, Executor, KvDtype, KvSpec, ModelSpec, OutputKind, SeqInput, SeqOutput,
    StepOutputs, sample_outputs, validate_batch,
};
pub use kvcache::{hadamard, hadamard_scale, int8_rotations};
pub use sampling::{Sampled, SamplingParams};
