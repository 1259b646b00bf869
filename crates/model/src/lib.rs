//! Flotilla's model runtime: GGUF reader, tokenizer, chat template, the CPU
//! forward pass with quantised kernels, sampling, and the executor trait that
//! every backend implements.

pub mod arch;
pub mod chat;
pub mod cpu;
pub mod generate;
pub mod gguf;
pub mod hub;
pub mod kernels;
pub mod model;
pub mod pool;
pub mod quant;
pub mod sampling;
pub mod spm;
#[doc(hidden)]
pub mod testutil;
pub mod tokenizer;

pub use cpu::{CpuConfig, CpuExecutor, LoadError};
/// The executor seam lives in `flotilla-exec`; its paths stay valid here.
pub use flotilla_exec::executor;
pub use flotilla_exec::{
    BatchLimits, ExecError, Executor, KvDtype, KvSpec, ModelSpec, OutputKind, SeqInput, SeqOutput,
    StepOutputs, validate_batch,
};
pub use sampling::{Sampled, SamplingParams};
