//! Flotilla's model runtime: GGUF reader, tokenizer, chat template, the CPU
//! forward pass with quantised kernels, sampling, and the executor trait that
//! every backend implements.

pub mod chat;
pub mod cpu;
pub mod executor;
pub mod generate;
pub mod gguf;
pub mod hub;
pub mod kernels;
pub mod llama;
pub mod model;
pub mod pool;
pub mod quant;
pub mod sampling;
#[doc(hidden)]
pub mod testutil;
pub mod tokenizer;

pub use cpu::{CpuConfig, CpuExecutor, LoadError};
pub use executor::{
    BatchLimits, ExecError, Executor, KvDtype, KvSpec, ModelSpec, OutputKind, SeqInput, SeqOutput,
    StepOutputs, validate_batch,
};
pub use sampling::{Sampled, SamplingParams};
