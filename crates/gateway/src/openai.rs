//! OpenAI request bodies: parsing and validation, before anything reaches an
//! engine.
//!
//! Bodies are read field by field from a `serde_json::Value` rather than
//! through a derived struct, so every refusal names the field (`param`). A
//! field this server does not honour is refused with a 400 naming it, never
//! ignored: [`CHAT_FIELDS`] and [`COMPLETION_FIELDS`] list what each
//! endpoint reads, and docs/API.md lists what each does here. A field set to
//! `null` counts as absent, as OpenAI's API treats it.

use flotilla_exec::{MAX_LOGIT_BIAS, MAX_PENALTY, MAX_TOP_LOGPROBS};
use flotilla_proto::{Constraint, ConstraintCompiler, SamplingParams};
use flotilla_text::TextSide;
use flotilla_text::chat::{ChatError, ChatMessage};
use serde_json::{Map, Value};

use crate::error::ApiError;
use crate::tools::{self, Tools};

/// Most stop strings a request may carry.
pub const STOP_STRINGS_MAX: usize = 16;
/// Longest stop string, bytes: held-back text is matched against every
/// stop string's prefixes, so this bounds the work per token.
pub const STOP_STRING_BYTES_MAX: usize = 1024;
/// Most extra stop token ids a request may carry.
pub const STOP_TOKEN_IDS_MAX: usize = 64;

/// Most `logit_bias` entries a request may carry (each is added to a
/// logit at every step).
pub const LOGIT_BIAS_MAX: usize = 1024;

/// Fields both endpoints read. Those that do not change what is generated
/// (`user`, `metadata`, `store`, `service_tier`, `prompt_cache_key`,
/// `safety_identifier`) are accepted and have no effect here.
const COMMON_FIELDS: &[&str] = &[
    "model",
    "stream",
    "stream_options",
    "max_tokens",
    "temperature",
    "top_p",
    "top_k",
    "seed",
    "stop",
    "stop_token_ids",
    "ignore_eos",
    "speculative",
    "n",
    "presence_penalty",
    "frequency_penalty",
    "logit_bias",
    "logprobs",
    "user",
    "metadata",
    "store",
    "service_tier",
    "prompt_cache_key",
    "safety_identifier",
    "response_format",
    "guided_json",
    "guided_regex",
    "guided_grammar",
];
/// Fields only `/v1/chat/completions` reads (`modalities` `["text"]`:
/// anything else in it is refused).
pub const CHAT_FIELDS: &[&str] = &[
    "messages",
    "max_completion_tokens",
    "top_logprobs",
    "tools",
    "tool_choice",
    "parallel_tool_calls",
    "modalities",
];
/// Fields only `/v1/completions` reads (`best_of` 1, `echo` false, `suffix`
/// empty: anything else is refused).
pub const COMPLETION_FIELDS: &[&str] = &["prompt", "best_of", "echo", "suffix"];

/// Which API a body was sent to.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Endpoint {
    /// `/v1/chat/completions`.
    Chat,
    /// `/v1/completions`.
    Completions,
}

/// What the gateway needs to know about the server to validate a body.
pub struct ParseCtx<'a> {
    /// Tokenizer and chat template.
    pub text: &'a TextSide,
    /// The served model's name.
    pub model_name: &'a str,
    /// Prompt plus completion tokens allowed.
    pub max_model_len: usize,
    /// Seed used when the body has none.
    pub default_seed: u64,
    /// Compiles output constraints to check them (a bad one is a 400).
    pub constraints: Option<&'a dyn ConstraintCompiler>,
}

/// A validated, tokenized request.
#[derive(Clone, Debug, PartialEq)]
pub struct Parsed {
    /// The API it came in on.
    pub endpoint: Endpoint,
    /// Prompt token ids (at least one, all in the vocabulary).
    pub prompt: Vec<u32>,
    /// Completion tokens allowed (at least one; prompt + this fit the model).
    pub max_tokens: u32,
    /// Sampling, log-probabilities and penalties included.
    pub sampling: SamplingParams,
    /// `(token, bias)` from `logit_bias`, ids in the vocabulary, each once.
    pub logit_bias: Vec<(u32, f32)>,
    /// What the output must match (`response_format` and the like, or a
    /// tool call when `tool_choice` requires one).
    pub constraint: Option<Constraint>,
    /// The tools the model was given (chat), when `tool_choice` is not
    /// `none`: its text is parsed for calls.
    pub tools: Option<Tools>,
    /// Stop strings (non-empty each), handled by the gateway.
    pub stop: Vec<String>,
    /// Extra token ids that end the request (vLLM's `stop_token_ids`).
    pub stop_token_ids: Vec<u32>,
    /// Keep going past end-of-sequence tokens.
    pub ignore_eos: bool,
    /// Whether the engine may speculate for this request (a Flotilla
    /// extension, `"speculative": false` opts out; the output is the same).
    pub speculative: bool,
    /// Answer as server-sent events.
    pub stream: bool,
    /// Send a usage chunk at the end of a stream.
    pub include_usage: bool,
}

type Obj = Map<String, Value>;

/// Parses and validates one request body.
pub fn parse(endpoint: Endpoint, body: &[u8], ctx: &ParseCtx<'_>) -> Result<Parsed, ApiError> {
    let text = std::str::from_utf8(body)
        .map_err(|e| ApiError::invalid_body(format!("the request body is not valid UTF-8: {e}")))?;
    let value: Value = serde_json::from_str(text)
        .map_err(|e| ApiError::invalid_body(format!("the request body is not valid JSON: {e}")))?;
    let Value::Object(obj) = value else {
        return Err(ApiError::invalid_body(
            "the request body must be a JSON object",
        ));
    };

    if let Some(model) = opt_str(&obj, "model")?
        && model != ctx.model_name
    {
        return Err(ApiError::ModelNotFound {
            requested: model.to_owned(),
            served: ctx.model_name.to_owned(),
        });
    }
    if let Some(n) = opt_int(&obj, "n")?
        && n != 1
    {
        return Err(ApiError::unsupported(
            "n",
            format!("only n = 1 is supported, got {n}"),
        ));
    }
    if let Some(b) = opt_int(&obj, "best_of")?
        && b != 1
    {
        return Err(ApiError::unsupported(
            "best_of",
            "only best_of = 1 is supported",
        ));
    }
    if opt_bool(&obj, "echo")? == Some(true) {
        return Err(ApiError::unsupported("echo", "echo is not supported"));
    }
    unhonoured(endpoint, &obj)?;
    let penalty = |p: &str| -> Result<f32, ApiError> {
        let x = opt_f64(&obj, p)?.unwrap_or(0.0);
        if x.is_nan() || x.abs() > f64::from(MAX_PENALTY) {
            return Err(ApiError::invalid(
                p,
                format!("{p} must be in [-2, 2], got {x}"),
            ));
        }
        Ok(x as f32)
    };
    let (presence_penalty, frequency_penalty) =
        (penalty("presence_penalty")?, penalty("frequency_penalty")?);
    let logit_bias = logit_bias(&obj, ctx.text)?;
    let mut constraint = constraint(&obj)?;
    let tools = match endpoint {
        Endpoint::Chat => tools::parse(&obj)?.filter(Tools::active),
        Endpoint::Completions => None,
    };
    if let Some(t) = &tools {
        // The tools' grammar is compiled even when nothing requires a call,
        // so a bad parameter schema is a 400 whatever the choice.
        let call = t.call_grammar(None);
        if let Some(compiler) = ctx.constraints {
            compiler
                .compile(&call)
                .map_err(|e| ApiError::invalid("tools", format!("a function's parameters: {e}")))?;
        }
        if let Some(c) = t.constraint() {
            if let Some((param, _)) = &constraint {
                return Err(ApiError::invalid(
                    "tool_choice",
                    format!(
                        "this tool_choice requires a function call, and {param} asks for \
                         other output: send one or the other"
                    ),
                ));
            }
            constraint = Some(("tool_choice", c));
        }
    }
    if let (Some((param, c)), Some(compiler)) = (&constraint, ctx.constraints)
        && *param != "tool_choice"
    {
        compiler
            .compile(c)
            .map_err(|e| ApiError::invalid(param, format!("{}: {e}", c.kind())))?;
    }
    let constraint = constraint.map(|(_, c)| c);

    let (sampling_logprobs, top_logprobs) = logprobs(endpoint, &obj)?;
    let temperature = opt_f64(&obj, "temperature")?.unwrap_or(1.0);
    if !(0.0..=2.0).contains(&temperature) {
        return Err(ApiError::invalid(
            "temperature",
            format!("temperature must be in [0, 2], got {temperature}"),
        ));
    }
    let top_p = opt_f64(&obj, "top_p")?.unwrap_or(1.0);
    if !(top_p > 0.0 && top_p <= 1.0) {
        return Err(ApiError::invalid(
            "top_p",
            format!("top_p must be in (0, 1], got {top_p}"),
        ));
    }
    let top_k = match opt_int(&obj, "top_k")? {
        None | Some(-1) | Some(0) => 0,
        Some(k) if k > 0 && k <= i64::from(u32::MAX) => k as u32,
        Some(k) => {
            return Err(ApiError::invalid(
                "top_k",
                format!("top_k must be -1 or 0 (off) or a positive integer, got {k}"),
            ));
        }
    };
    let seed = match obj.get("seed") {
        None | Some(Value::Null) => ctx.default_seed,
        Some(v) => match (v.as_u64(), v.as_i64()) {
            (Some(u), _) => u,
            (None, Some(i)) => i as u64,
            _ => return Err(type_error("seed", "an integer")),
        },
    };
    let sampling = SamplingParams {
        temperature: temperature as f32,
        top_k,
        top_p: top_p as f32,
        seed,
        logprobs: sampling_logprobs,
        top_logprobs,
        presence_penalty,
        frequency_penalty,
    };

    let stop = stop_strings(&obj)?;
    let stop_token_ids = match opt(&obj, "stop_token_ids") {
        None => Vec::new(),
        Some(v) => {
            let ids = token_ids(v, "stop_token_ids", ctx.text)?;
            if ids.len() > STOP_TOKEN_IDS_MAX {
                return Err(ApiError::invalid(
                    "stop_token_ids",
                    format!("at most {STOP_TOKEN_IDS_MAX} stop_token_ids are allowed"),
                ));
            }
            ids
        }
    };
    let ignore_eos = opt_bool(&obj, "ignore_eos")?.unwrap_or(false);
    let speculative = opt_bool(&obj, "speculative")?.unwrap_or(true);
    let stream = opt_bool(&obj, "stream")?.unwrap_or(false);
    let include_usage = match opt(&obj, "stream_options") {
        None => false,
        Some(Value::Object(so)) => opt_bool(so, "include_usage")
            .map_err(|_| type_error("stream_options.include_usage", "a boolean"))?
            .unwrap_or(false),
        Some(_) => return Err(type_error("stream_options", "an object")),
    };

    let (prompt, prompt_param) = match endpoint {
        Endpoint::Chat => (chat_prompt(&obj, ctx.text, tools.as_ref())?, "messages"),
        Endpoint::Completions => (completion_prompt(&obj, ctx.text)?, "prompt"),
    };
    if prompt.is_empty() {
        return Err(ApiError::invalid(
            prompt_param,
            "the prompt is empty after tokenization",
        ));
    }

    let requested = match endpoint {
        Endpoint::Chat => match opt_int(&obj, "max_completion_tokens")? {
            Some(m) => Some(("max_completion_tokens", m)),
            None => opt_int(&obj, "max_tokens")?.map(|m| ("max_tokens", m)),
        },
        Endpoint::Completions => opt_int(&obj, "max_tokens")?.map(|m| ("max_tokens", m)),
    };
    let max_tokens = context_check(prompt.len(), requested, ctx.max_model_len, prompt_param)?;

    Ok(Parsed {
        endpoint,
        prompt,
        max_tokens,
        sampling,
        logit_bias,
        constraint,
        tools,
        stop,
        stop_token_ids,
        ignore_eos,
        speculative,
        stream,
        include_usage,
    })
}

/// Refuses every field `endpoint` does not read, and every value of a read
/// field that asks for something this server does not do (other
/// modalities, a suffix), naming the field.
fn unhonoured(endpoint: Endpoint, obj: &Obj) -> Result<(), ApiError> {
    let own = match endpoint {
        Endpoint::Chat => CHAT_FIELDS,
        Endpoint::Completions => COMPLETION_FIELDS,
    };
    if let Some(k) = obj
        .keys()
        .find(|k| !COMMON_FIELDS.contains(&k.as_str()) && !own.contains(&k.as_str()))
    {
        let elsewhere = match endpoint {
            Endpoint::Chat if COMPLETION_FIELDS.contains(&k.as_str()) => {
                " (it belongs to /v1/completions)"
            }
            Endpoint::Completions if CHAT_FIELDS.contains(&k.as_str()) => {
                " (it belongs to /v1/chat/completions)"
            }
            _ => "",
        };
        return Err(ApiError::unsupported(
            k,
            format!("Unrecognized request argument supplied: {k}{elsewhere}"),
        ));
    }
    match opt(obj, "modalities") {
        None => {}
        Some(Value::Array(m)) if m.iter().all(|v| v.as_str() == Some("text")) => {}
        Some(_) => {
            return Err(ApiError::unsupported(
                "modalities",
                "only the 'text' modality is supported",
            ));
        }
    }
    match opt(obj, "suffix") {
        None => {}
        Some(Value::String(s)) if s.is_empty() => {}
        Some(_) => return Err(ApiError::unsupported("suffix", "suffix is not supported")),
    }
    if let Some(t) = opt(obj, "service_tier")
        && !matches!(t.as_str(), Some("auto" | "default"))
    {
        return Err(ApiError::unsupported(
            "service_tier",
            "service_tier may only be 'auto' or 'default': a request's tier comes from its API key",
        ));
    }
    Ok(())
}

/// What the output must match: OpenAI's `response_format` (`text`,
/// `json_object`, `json_schema` with its `schema`), or one of vLLM's
/// extensions `guided_json` (a schema), `guided_regex`, `guided_grammar`
/// (Lark). At most one. The engine compiles it and refuses a bad one.
fn constraint(obj: &Obj) -> Result<Option<(&'static str, Constraint)>, ApiError> {
    let mut found: Vec<(&'static str, Constraint)> = Vec::new();
    if let Some(rf) = opt(obj, "response_format") {
        let Value::Object(rf) = rf else {
            return Err(type_error("response_format", "an object with a \"type\""));
        };
        match rf.get("type").and_then(Value::as_str) {
            Some("text") => {}
            Some("json_object") => found.push(("response_format", Constraint::JsonObject)),
            Some("json_schema") => {
                let Some(Value::Object(js)) = rf.get("json_schema") else {
                    return Err(type_error(
                        "response_format.json_schema",
                        "an object with a \"name\" and a \"schema\"",
                    ));
                };
                let strict = js.get("strict").and_then(Value::as_bool) == Some(true);
                let schema = match js.get("schema") {
                    None | Some(Value::Null) => Value::Object(Map::new()),
                    Some(v @ (Value::Object(_) | Value::Bool(_))) => {
                        let mut v = v.clone();
                        if strict {
                            close_objects(&mut v);
                        }
                        bound_numbers(&mut v);
                        v
                    }
                    Some(_) => {
                        return Err(type_error(
                            "response_format.json_schema.schema",
                            "a JSON Schema object",
                        ));
                    }
                };
                found.push((
                    "response_format",
                    Constraint::JsonSchema(schema.to_string()),
                ));
            }
            Some(t) => {
                return Err(ApiError::invalid(
                    "response_format",
                    format!(
                        "unknown response_format type '{t}': use text, json_object or json_schema"
                    ),
                ));
            }
            None => return Err(type_error("response_format", "an object with a \"type\"")),
        }
    }
    match opt(obj, "guided_json") {
        None => {}
        // A schema that is not JSON goes as it came: compiling refuses it.
        Some(Value::String(s)) => {
            let schema = match serde_json::from_str::<Value>(s) {
                Ok(mut v) => {
                    bound_numbers(&mut v);
                    v.to_string()
                }
                Err(_) => s.clone(),
            };
            found.push(("guided_json", Constraint::JsonSchema(schema)))
        }
        Some(v @ (Value::Object(_) | Value::Bool(_))) => {
            let mut v = v.clone();
            bound_numbers(&mut v);
            found.push(("guided_json", Constraint::JsonSchema(v.to_string())))
        }
        Some(_) => return Err(type_error("guided_json", "a JSON Schema")),
    }
    for (key, make) in [
        (
            "guided_regex",
            Constraint::Regex as fn(String) -> Constraint,
        ),
        ("guided_grammar", Constraint::Lark),
    ] {
        match opt(obj, key) {
            None => {}
            Some(Value::String(s)) if !s.is_empty() => found.push((key, make(s.clone()))),
            Some(_) => return Err(type_error(key, "a non-empty string")),
        }
    }
    if found.len() > 1 {
        return Err(ApiError::invalid(
            found[1].0,
            format!(
                "only one output constraint per request: both {} and {} were given",
                found[0].0, found[1].0
            ),
        ));
    }
    Ok(found.pop())
}

/// Largest magnitude a number or integer without bounds of its own may be
/// generated with: 16 digits before the point.
pub const NUMBER_MAGNITUDE_MAX: f64 = 1e15;
/// Most digits after the point a number without a `multipleOf` of its own
/// may be generated with.
pub const FRACTION_DIGITS_MAX: u32 = 6;

/// Bounds the digits of every number and integer in `schema` that does not
/// bound them itself, so a model cannot loop in a number's digits until
/// `max_tokens` ("1000.0000..." is within every bound and every grammar
/// that allows any number): magnitudes to [`NUMBER_MAGNITUDE_MAX`] where
/// no `minimum`/`maximum` says otherwise, fractions to
/// [`FRACTION_DIGITS_MAX`] digits (a decimal `multipleOf`) where no
/// `multipleOf` does. Every value still valid under the tightened schema
/// is valid under the original. Literal values (`const`, `enum`,
/// `default`, `examples`) are left alone.
pub fn bound_numbers(schema: &mut Value) {
    match schema {
        Value::Array(items) => items.iter_mut().for_each(bound_numbers),
        Value::Object(o) => {
            let types: Vec<&str> = match o.get("type") {
                Some(Value::String(t)) => vec![t.as_str()],
                Some(Value::Array(ts)) => ts.iter().filter_map(Value::as_str).collect(),
                _ => Vec::new(),
            };
            let (number, integer) = (types.contains(&"number"), types.contains(&"integer"));
            if number || integer {
                // Integers' bounds as integers, so they read as such.
                let bound = |x: f64| {
                    if integer {
                        Value::from(x as i64)
                    } else {
                        Value::from(x)
                    }
                };
                if !o.contains_key("minimum") && !o.contains_key("exclusiveMinimum") {
                    o.insert("minimum".into(), bound(-NUMBER_MAGNITUDE_MAX));
                }
                if !o.contains_key("maximum") && !o.contains_key("exclusiveMaximum") {
                    o.insert("maximum".into(), bound(NUMBER_MAGNITUDE_MAX));
                }
                if number && !integer && !o.contains_key("multipleOf") {
                    let step = 10f64.powi(-(FRACTION_DIGITS_MAX as i32));
                    o.insert("multipleOf".into(), Value::from(step));
                }
            }
            for (k, v) in o.iter_mut() {
                if !matches!(k.as_str(), "const" | "enum" | "default" | "examples") {
                    bound_numbers(v);
                }
            }
        }
        _ => {}
    }
}

/// OpenAI's strict mode: an object schema that does not say otherwise
/// admits no properties beyond those it names (`additionalProperties:
/// false`, which OpenAI requires of strict schemas), through properties,
/// items, definitions and combinators.
pub(crate) fn close_objects(v: &mut Value) {
    let Value::Object(o) = v else { return };
    let is_object =
        o.get("type").and_then(Value::as_str) == Some("object") || o.contains_key("properties");
    if is_object && !o.contains_key("additionalProperties") {
        o.insert("additionalProperties".into(), Value::Bool(false));
    }
    for key in ["properties", "$defs", "definitions", "patternProperties"] {
        if let Some(Value::Object(m)) = o.get_mut(key) {
            m.values_mut().for_each(close_objects);
        }
    }
    for key in ["items", "additionalProperties", "not", "if", "then", "else"] {
        if let Some(x) = o.get_mut(key) {
            close_objects(x);
        }
    }
    for key in ["anyOf", "oneOf", "allOf", "prefixItems"] {
        if let Some(Value::Array(a)) = o.get_mut(key) {
            a.iter_mut().for_each(close_objects);
        }
    }
}

/// `logit_bias`: an object of token ids (as strings, OpenAI's shape) to
/// biases in [-100, 100], ids in the vocabulary.
fn logit_bias(obj: &Obj, text: &TextSide) -> Result<Vec<(u32, f32)>, ApiError> {
    let map = match opt(obj, "logit_bias") {
        None => return Ok(Vec::new()),
        Some(Value::Object(m)) => m,
        Some(_) => return Err(type_error("logit_bias", "an object of token ids to biases")),
    };
    if map.len() > LOGIT_BIAS_MAX {
        return Err(ApiError::invalid(
            "logit_bias",
            format!(
                "logit_bias may hold at most {LOGIT_BIAS_MAX} tokens, got {}",
                map.len()
            ),
        ));
    }
    let vocab = text.tokenizer.vocab_size() as u64;
    let mut out = Vec::with_capacity(map.len());
    for (k, v) in map {
        let id = match k.parse::<u64>() {
            Ok(id) if id < vocab => id as u32,
            Ok(id) => {
                return Err(ApiError::invalid(
                    "logit_bias",
                    format!("token id {id} is out of range: the vocabulary has {vocab} tokens"),
                ));
            }
            Err(_) => {
                return Err(ApiError::invalid(
                    "logit_bias",
                    format!("logit_bias keys must be token ids (integers as strings), got '{k}'"),
                ));
            }
        };
        let b = match v.as_f64() {
            Some(b) if b.abs() <= f64::from(MAX_LOGIT_BIAS) => b as f32,
            _ => {
                return Err(ApiError::invalid(
                    "logit_bias",
                    format!("the bias of token {id} must be a number in [-100, 100], got {v}"),
                ));
            }
        };
        out.push((id, b));
    }
    // "7" and "07" name one token: refuse the repeat rather than add twice.
    out.sort_by_key(|&(id, _)| id);
    if let Some(w) = out.windows(2).find(|w| w[0].0 == w[1].0) {
        return Err(ApiError::invalid(
            "logit_bias",
            format!("token id {} appears twice in logit_bias", w[0].0),
        ));
    }
    Ok(out)
}

/// Checks that prompt plus completion fit, and picks the completion budget.
fn context_check(
    prompt_len: usize,
    requested: Option<(&str, i64)>,
    max_model_len: usize,
    place: &'static str,
) -> Result<u32, ApiError> {
    let max_tokens = match requested {
        Some((param, m)) if m < 1 => {
            return Err(ApiError::invalid(
                param,
                format!("{param} must be at least 1, got {m}"),
            ));
        }
        Some((_, m)) => m as u64,
        None => {
            if prompt_len >= max_model_len {
                return Err(ApiError::ContextLength {
                    message: format!(
                        "This model's maximum context length is {max_model_len} tokens. However, \
                         your {place} resulted in {prompt_len} tokens, leaving no room for a \
                         completion. Please reduce the length of the {place}."
                    ),
                    param: place,
                });
            }
            (max_model_len - prompt_len) as u64
        }
    };
    let total = prompt_len as u64 + max_tokens;
    if total > max_model_len as u64 {
        return Err(ApiError::ContextLength {
            message: format!(
                "This model's maximum context length is {max_model_len} tokens. However, you \
                 requested {total} tokens ({prompt_len} in the {place}, {max_tokens} in the \
                 completion). Please reduce the length of the {place} or completion."
            ),
            param: place,
        });
    }
    u32::try_from(max_tokens).map_err(|_| {
        ApiError::invalid(
            "max_tokens",
            format!("max_tokens {max_tokens} is too large"),
        )
    })
}

/// `logprobs` / `top_logprobs` in each API's own shape.
fn logprobs(endpoint: Endpoint, obj: &Obj) -> Result<(bool, u32), ApiError> {
    let range = |param: &str, n: i64| -> Result<u32, ApiError> {
        if (0..=i64::from(MAX_TOP_LOGPROBS)).contains(&n) {
            Ok(n as u32)
        } else {
            Err(ApiError::invalid(
                param,
                format!("{param} must be in 0..={MAX_TOP_LOGPROBS}, got {n}"),
            ))
        }
    };
    match endpoint {
        Endpoint::Chat => {
            let on = opt_bool(obj, "logprobs")?.unwrap_or(false);
            let top = match opt_int(obj, "top_logprobs")? {
                None => 0,
                Some(n) => range("top_logprobs", n)?,
            };
            if top > 0 && !on {
                return Err(ApiError::invalid(
                    "top_logprobs",
                    "top_logprobs requires logprobs to be true",
                ));
            }
            Ok((on, top))
        }
        Endpoint::Completions => match opt_int(obj, "logprobs")? {
            None => Ok((false, 0)),
            Some(n) => Ok((true, range("logprobs", n)?)),
        },
    }
}

fn stop_strings(obj: &Obj) -> Result<Vec<String>, ApiError> {
    let list = match opt(obj, "stop") {
        None => return Ok(Vec::new()),
        Some(Value::String(s)) => vec![s.clone()],
        Some(Value::Array(items)) => {
            if items.len() > STOP_STRINGS_MAX {
                return Err(ApiError::invalid(
                    "stop",
                    format!(
                        "at most {STOP_STRINGS_MAX} stop strings are allowed, got {}",
                        items.len()
                    ),
                ));
            }
            items
                .iter()
                .map(|v| v.as_str().map(str::to_owned))
                .collect::<Option<Vec<_>>>()
                .ok_or_else(|| type_error("stop", "a string or a list of strings"))?
        }
        Some(_) => return Err(type_error("stop", "a string or a list of strings")),
    };
    if list.iter().any(String::is_empty) {
        return Err(ApiError::invalid("stop", "stop strings must not be empty"));
    }
    if let Some(long) = list.iter().find(|s| s.len() > STOP_STRING_BYTES_MAX) {
        return Err(ApiError::invalid(
            "stop",
            format!(
                "stop strings may be at most {STOP_STRING_BYTES_MAX} bytes long, got {}",
                long.len()
            ),
        ));
    }
    Ok(list)
}

fn chat_prompt(obj: &Obj, text: &TextSide, tools: Option<&Tools>) -> Result<Vec<u32>, ApiError> {
    let Some(Value::Array(items)) = opt(obj, "messages") else {
        return Err(match opt(obj, "messages") {
            None => ApiError::invalid("messages", "'messages' is required"),
            Some(_) => type_error("messages", "a list of messages"),
        });
    };
    if items.is_empty() {
        return Err(ApiError::invalid(
            "messages",
            "'messages' must not be empty",
        ));
    }
    let Some(template) = &text.chat else {
        return Err(ApiError::invalid_body(
            "this model has no chat template; use /v1/completions",
        ));
    };
    let hermes = template.hermes_tools();
    let mut messages = Vec::with_capacity(items.len());
    for (i, m) in items.iter().enumerate() {
        let param = format!("messages[{i}]");
        let Value::Object(m) = m else {
            return Err(type_error(&param, "an object"));
        };
        let role = match m.get("role") {
            Some(Value::String(r))
                if matches!(r.as_str(), "system" | "user" | "assistant" | "tool") =>
            {
                r.clone()
            }
            // OpenAI's newer name for the system role.
            Some(Value::String(r)) if r == "developer" => "system".to_owned(),
            Some(Value::String(r)) => {
                return Err(ApiError::invalid(
                    &format!("{param}.role"),
                    format!("unknown role '{r}': use system, developer, user, assistant or tool"),
                ));
            }
            _ => return Err(type_error(&format!("{param}.role"), "a string")),
        };
        let mut content = match m.get("content") {
            Some(Value::String(s)) => s.clone(),
            Some(Value::Array(parts)) => text_parts(parts, &param)?,
            None | Some(Value::Null) if role == "assistant" => String::new(),
            _ => {
                return Err(type_error(
                    &format!("{param}.content"),
                    "a string or a list of text parts",
                ));
            }
        };
        let mut tool_calls = None;
        if let Some(calls) = m.get("tool_calls").filter(|v| !v.is_null()) {
            if role != "assistant" {
                return Err(ApiError::invalid(
                    &format!("{param}.tool_calls"),
                    "only assistant messages carry tool_calls",
                ));
            }
            let (calls, blocks) = tools::assistant_calls(calls, &format!("{param}.tool_calls"))?;
            if hermes {
                tool_calls = Some(calls);
            } else {
                // The template has no place for calls: they are its text.
                if !content.is_empty() {
                    content.push('\n');
                }
                content.push_str(&blocks);
            }
        }
        let tool_call_id = if role == "tool" {
            match m.get("tool_call_id") {
                Some(Value::String(id)) => Some(id.clone()),
                _ => {
                    return Err(type_error(
                        &format!("{param}.tool_call_id"),
                        "a string (the id of the call this answers)",
                    ));
                }
            }
        } else {
            None
        };
        messages.push(ChatMessage {
            role,
            content,
            tool_calls,
            tool_call_id,
        });
    }
    let (messages, tools_value) = if hermes {
        (messages, tools.map(|t| &t.raw))
    } else {
        (tools::generic_messages(messages, tools), None)
    };
    let rendered = template
        .render_with_tools(&messages, tools_value, true)
        .map_err(|e| match e {
            ChatError::Raised(msg) => ApiError::invalid("messages", msg),
            other => ApiError::invalid("messages", other.to_string()),
        })?;
    // The template writes the model's own control tokens; they must become ids.
    text.tokenizer
        .encode(&rendered, true)
        .map_err(|e| ApiError::invalid("messages", format!("cannot tokenize the messages: {e}")))
}

fn text_parts(parts: &[Value], param: &str) -> Result<String, ApiError> {
    let mut out = String::new();
    for (j, p) in parts.iter().enumerate() {
        let pp = format!("{param}.content[{j}]");
        match (p.get("type").and_then(Value::as_str), p.get("text")) {
            (Some("text"), Some(Value::String(t))) => out.push_str(t),
            (Some("text"), _) => return Err(type_error(&format!("{pp}.text"), "a string")),
            (Some(other), _) => {
                return Err(ApiError::unsupported(
                    &format!("{pp}.type"),
                    format!("content part type '{other}' is not supported; only 'text'"),
                ));
            }
            (None, _) => return Err(type_error(&pp, "an object with \"type\": \"text\"")),
        }
    }
    Ok(out)
}

fn completion_prompt(obj: &Obj, text: &TextSide) -> Result<Vec<u32>, ApiError> {
    let encode = |s: &str| -> Result<Vec<u32>, ApiError> {
        if s.is_empty() {
            return Err(ApiError::invalid("prompt", "'prompt' must not be empty"));
        }
        text.tokenizer
            .encode(s, true)
            .map_err(|e| ApiError::invalid("prompt", format!("cannot tokenize the prompt: {e}")))
    };
    let shape = || {
        type_error(
            "prompt",
            "a string, a list of one string, or a list of token ids",
        )
    };
    match opt(obj, "prompt") {
        None => Err(ApiError::invalid("prompt", "'prompt' is required")),
        Some(Value::String(s)) => encode(s),
        Some(Value::Array(items)) => match items.as_slice() {
            [] => Err(ApiError::invalid("prompt", "'prompt' must not be empty")),
            [Value::String(s)] => encode(s),
            [Value::Array(ids)] => token_ids_list(ids, "prompt", text),
            [Value::Number(_), ..] => token_ids_list(items, "prompt", text),
            [Value::String(_) | Value::Array(_), _, ..] => Err(ApiError::unsupported(
                "prompt",
                "batched prompts are not supported: send one prompt per request",
            )),
            _ => Err(shape()),
        },
        Some(_) => Err(shape()),
    }
}

fn token_ids(v: &Value, param: &str, text: &TextSide) -> Result<Vec<u32>, ApiError> {
    match v {
        Value::Array(items) => token_ids_list(items, param, text),
        _ => Err(type_error(param, "a list of token ids")),
    }
}

fn token_ids_list(items: &[Value], param: &str, text: &TextSide) -> Result<Vec<u32>, ApiError> {
    let vocab = text.tokenizer.vocab_size() as u64;
    items
        .iter()
        .map(|v| match v.as_u64() {
            Some(id) if id < vocab => Ok(id as u32),
            Some(id) => Err(ApiError::invalid(
                param,
                format!("token id {id} is out of range: the vocabulary has {vocab} tokens"),
            )),
            None => Err(ApiError::invalid(
                param,
                format!("token ids must be integers in 0..{vocab}, got {v}"),
            )),
        })
        .collect()
}

fn type_error(param: &str, expected: &str) -> ApiError {
    ApiError::invalid(param, format!("'{param}' must be {expected}"))
}

/// A field, with `null` counted as absent.
fn opt<'a>(obj: &'a Obj, key: &str) -> Option<&'a Value> {
    obj.get(key).filter(|v| !v.is_null())
}

fn opt_str<'a>(obj: &'a Obj, key: &str) -> Result<Option<&'a str>, ApiError> {
    match opt(obj, key) {
        None => Ok(None),
        Some(Value::String(s)) => Ok(Some(s)),
        Some(_) => Err(type_error(key, "a string")),
    }
}

fn opt_bool(obj: &Obj, key: &str) -> Result<Option<bool>, ApiError> {
    match opt(obj, key) {
        None => Ok(None),
        Some(Value::Bool(b)) => Ok(Some(*b)),
        Some(_) => Err(type_error(key, "a boolean")),
    }
}

fn opt_f64(obj: &Obj, key: &str) -> Result<Option<f64>, ApiError> {
    match opt(obj, key) {
        None => Ok(None),
        Some(v) => v
            .as_f64()
            .map(Some)
            .ok_or_else(|| type_error(key, "a number")),
    }
}

/// An integer field; huge positive values saturate (they fail range checks).
fn opt_int(obj: &Obj, key: &str) -> Result<Option<i64>, ApiError> {
    match opt(obj, key) {
        None => Ok(None),
        Some(v) => match (v.as_i64(), v.as_u64()) {
            (Some(i), _) => Ok(Some(i)),
            (None, Some(_)) => Ok(Some(i64::MAX)),
            _ => Err(type_error(key, "an integer")),
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::OnceLock;

    fn text() -> &'static TextSide {
        static T: OnceLock<TextSide> = OnceLock::new();
        T.get_or_init(|| {
            let path = flotilla_hub::test_model_path();
            TextSide::from_gguf(&flotilla_gguf::GgufFile::open(&path).unwrap()).unwrap()
        })
    }

    fn p(endpoint: Endpoint, body: serde_json::Value) -> Result<Parsed, ApiError> {
        let ctx = ParseCtx {
            text: text(),
            model_name: "m",
            max_model_len: 100,
            default_seed: 99,
            constraints: None,
        };
        parse(endpoint, body.to_string().as_bytes(), &ctx)
    }

    #[test]
    fn nulls_are_absent_and_extensions_apply() {
        let r = p(
            Endpoint::Completions,
            serde_json::json!({"prompt": ["hi"], "max_tokens": null, "top_k": -1,
                               "seed": -1, "stop": "x", "stop_token_ids": [5]}),
        )
        .unwrap();
        assert_eq!(r.max_tokens as usize, 100 - r.prompt.len());
        assert_eq!((r.sampling.top_k, r.sampling.seed), (0, u64::MAX));
        assert_eq!((r.stop, r.stop_token_ids), (vec!["x".to_string()], vec![5]));
        let r = p(Endpoint::Completions, serde_json::json!({"prompt": "hi"})).unwrap();
        assert_eq!((r.sampling.seed, r.sampling.temperature), (99, 1.0));
    }

    #[test]
    fn chat_prefers_max_completion_tokens_and_reads_text_parts() {
        let body = serde_json::json!({
            "messages": [{"role": "system", "content": [{"type": "text", "text": "be brief"}]},
                         {"role": "user", "content": "hi"}],
            "max_tokens": 50, "max_completion_tokens": 3, "logprobs": true, "top_logprobs": 4,
        });
        let r = p(Endpoint::Chat, body).unwrap();
        assert_eq!(r.max_tokens, 3);
        assert!(r.sampling.logprobs && r.sampling.top_logprobs == 4);
        let prompt = text().tokenizer.decode(&r.prompt, false).unwrap();
        assert!(prompt.contains("be brief"), "{prompt}");
    }

    #[test]
    fn a_hermes_template_gets_the_tools_calls_and_answers_in_its_own_markup() {
        let path = flotilla_hub::test_model_path();
        let mut t = TextSide::from_gguf(&flotilla_gguf::GgufFile::open(&path).unwrap()).unwrap();
        let src = include_str!("../../../tests/fixtures/chat_templates/qwen2_5.jinja");
        t.chat = Some(flotilla_text::chat::ChatTemplate::new(src, "", "<|im_end|>").unwrap());
        let ctx = ParseCtx {
            text: &t,
            model_name: "m",
            max_model_len: 4096,
            default_seed: 1,
            constraints: None,
        };
        let body = serde_json::json!({
            "messages": [
                {"role": "user", "content": "Weather in Paris?"},
                {"role": "assistant", "content": null, "tool_calls": [{"id": "call_1",
                 "type": "function", "function": {"name": "get_weather",
                 "arguments": "{\"city\":\"Paris\"}"}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": "21 C"}],
            "tools": [{"type": "function", "function": {"name": "get_weather",
                "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}],
        });
        let r = parse(Endpoint::Chat, body.to_string().as_bytes(), &ctx).unwrap();
        let prompt = t.tokenizer.decode(&r.prompt, false).unwrap();
        for want in [
            "<tools>\n{\"type\": \"function\", \"function\": {\"name\": \"get_weather\"",
            "<|im_start|>assistant\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": \
             {\"city\": \"Paris\"}}\n</tool_call><|im_end|>",
            "<|im_start|>user\n<tool_response>\n21 C\n</tool_response><|im_end|>",
        ] {
            assert!(prompt.contains(want), "{want:?} not in {prompt}");
        }
        // The template's own system prompt, not the generic one.
        assert!(!prompt.contains("# Tools\n\nYou may call") || prompt.contains("You are Qwen"));
        assert_eq!(r.tools.unwrap().choice, crate::tools::ToolChoice::Auto);
    }

    #[test]
    fn numbers_get_bounds_only_where_they_have_none() {
        let mut v = serde_json::json!({"type": "object", "properties": {
            "a": {"type": ["number", "null"]},
            "b": {"type": "integer", "minimum": 0},
            "c": {"type": "number", "exclusiveMaximum": 1, "multipleOf": 0.25},
            "d": {"const": {"type": "number"}, "enum": [{"type": "integer"}]},
            "e": {"type": "array", "items": {"type": "integer"}}}});
        bound_numbers(&mut v);
        let p = &v["properties"];
        assert_eq!(p["a"]["minimum"], -1e15);
        assert_eq!(p["a"]["multipleOf"], 1e-6);
        assert_eq!(p["b"]["minimum"], 0);
        assert_eq!(p["b"]["maximum"], 1_000_000_000_000_000i64);
        assert!(p["b"].get("multipleOf").is_none());
        assert_eq!(p["c"]["multipleOf"], 0.25);
        assert!(p["c"].get("maximum").is_none() && p["c"]["minimum"] == -1e15);
        assert_eq!(p["d"]["const"], serde_json::json!({"type": "number"}));
        assert_eq!(p["d"]["enum"], serde_json::json!([{"type": "integer"}]));
        assert_eq!(p["e"]["items"]["maximum"], 1_000_000_000_000_000i64);
    }

    #[test]
    fn stop_strings_are_capped_in_length() {
        let ok = "x".repeat(STOP_STRING_BYTES_MAX);
        let r = p(
            Endpoint::Completions,
            serde_json::json!({"prompt": "a", "stop": [ok.clone()]}),
        )
        .unwrap();
        assert_eq!(r.stop, [ok]);
        let long = "x".repeat(STOP_STRING_BYTES_MAX + 1);
        let e = p(
            Endpoint::Completions,
            serde_json::json!({"prompt": "a", "stop": ["y", long]}),
        )
        .unwrap_err();
        assert!(e.to_string().contains("at most 1024 bytes"), "{e}");
        assert_eq!(e.class().status, axum::http::StatusCode::BAD_REQUEST);
        assert_eq!(e.body()["error"]["param"], "stop");
    }

    #[test]
    fn completion_logprobs_is_a_count() {
        let r = p(
            Endpoint::Completions,
            serde_json::json!({"prompt": "a", "logprobs": 0}),
        )
        .unwrap();
        assert!(r.sampling.logprobs && r.sampling.top_logprobs == 0);
        let e = p(
            Endpoint::Completions,
            serde_json::json!({"prompt": "a", "logprobs": true}),
        );
        assert!(e.is_err());
    }
}
