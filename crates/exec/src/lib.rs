//! The executor seam: the one interface between the GpuWorker actor and a
//! backend (the CPU forward pass, the CUDA executor, the simulator's cost
//! model), and the sampling types that cross it. No heavy dependency, so
//! that the messages (`proto`) and the pure scheduler (`sched`) build
//! without tokenizers, templates, an HTTP client or archive readers.

pub mod constraint;
pub mod executor;
pub mod offload;
pub mod rate;
pub mod rng;
pub mod sampling;
pub mod slo;

pub use constraint::{
    Constraint, ConstraintCompiler, MaskCell, MaskWords, SharedConstraint, TokenConstraint,
};
pub use executor::{
    BatchLimits, ExecError, Executor, KvDtype, KvSpec, ModelSpec, OutputKind, RowDraw, SeqInput,
    SeqOutput, StepOutputs, sample_outputs, validate_batch,
};
pub use offload::OffloadTier;
pub use sampling::{MAX_LOGIT_BIAS, MAX_PENALTY, MAX_TOP_LOGPROBS, Sampled, SamplingParams};
