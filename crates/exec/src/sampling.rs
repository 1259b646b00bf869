//! What a step asks of sampling and what it returns: the parameters of one
//! sequence's draw and the token drawn. The sampler itself (greedy,
//! temperature, top-k, top-p; randomness a function of seed and position)
//! lives with the forward pass.

/// How to pick the next token of one sequence. It crosses nodes as it is
/// (rkyv), inside the request.
#[derive(Clone, Copy, Debug, PartialEq, rkyv::Archive, rkyv::Serialize, rkyv::Deserialize)]
pub struct SamplingParams {
    /// 0 means greedy (argmax); otherwise logits are divided by it.
    pub temperature: f32,
    /// Keep only the k most likely tokens; 0 disables.
    pub top_k: u32,
    /// Keep the smallest set of tokens whose probability reaches p; 1 disables.
    pub top_p: f32,
    /// Seed of this sequence's draws.
    pub seed: u64,
    /// Return the log-probability of the chosen token.
    pub logprobs: bool,
    /// Also return this many most likely alternatives (0..=20).
    pub top_logprobs: u32,
    /// Subtracted once from the logit of every token already generated
    /// (OpenAI's `presence_penalty`, -2..=2; 0 is off).
    pub presence_penalty: f32,
    /// Subtracted from a token's logit once per time it was generated
    /// (OpenAI's `frequency_penalty`, -2..=2; 0 is off).
    pub frequency_penalty: f32,
}

impl Default for SamplingParams {
    fn default() -> Self {
        SamplingParams {
            temperature: 0.0,
            top_k: 0,
            top_p: 1.0,
            seed: 0,
            logprobs: false,
            top_logprobs: 0,
            presence_penalty: 0.0,
            frequency_penalty: 0.0,
        }
    }
}

/// Largest |presence_penalty| and |frequency_penalty| accepted, as OpenAI's
/// API allows.
pub const MAX_PENALTY: f32 = 2.0;
/// Largest |logit_bias| value.
pub const MAX_LOGIT_BIAS: f32 = 100.0;

/// Largest `top_logprobs` accepted, as OpenAI's API allows.
pub const MAX_TOP_LOGPROBS: u32 = 20;

impl SamplingParams {
    /// Greedy decoding.
    pub fn greedy() -> Self {
        Self::default()
    }

    /// Checks ranges; the message names the parameter.
    pub fn validate(&self) -> Result<(), String> {
        if !self.temperature.is_finite() || self.temperature < 0.0 {
            return Err(format!(
                "temperature must be a finite number >= 0, got {}",
                self.temperature
            ));
        }
        if !(self.top_p > 0.0 && self.top_p <= 1.0) {
            return Err(format!("top_p must be in (0, 1], got {}", self.top_p));
        }
        for (name, v) in [
            ("presence_penalty", self.presence_penalty),
            ("frequency_penalty", self.frequency_penalty),
        ] {
            if !(v.is_finite() && v.abs() <= MAX_PENALTY) {
                return Err(format!("{name} must be in [-2, 2], got {v}"));
            }
        }
        if self.top_logprobs > MAX_TOP_LOGPROBS {
            return Err(format!(
                "top_logprobs must be at most {MAX_TOP_LOGPROBS}, got {}",
                self.top_logprobs
            ));
        }
        Ok(())
    }
}

/// The token picked for one sequence, with its log-probabilities. It
/// crosses nodes as it is (rkyv), inside event batches.
#[derive(Clone, Debug, PartialEq, rkyv::Archive, rkyv::Serialize, rkyv::Deserialize)]
pub struct Sampled {
    /// Token id.
    pub token: u32,
    /// log p(token) under the model's (temperature 1) distribution; NaN unless requested.
    pub logprob: f32,
    /// The most likely tokens and their log-probabilities, best first.
    pub top: Vec<(u32, f32)>,
}
