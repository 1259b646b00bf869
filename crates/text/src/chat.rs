//! Chat templates: turning a list of messages into the prompt text a model
//! was trained on.
//!
//! Templates are the Jinja2 sources shipped with models (GGUF key
//! `tokenizer.chat_template`, or `chat_template` in Hugging Face's
//! `tokenizer_config.json`). They are rendered with [minijinja] set up the way
//! Hugging Face `transformers` sets up Jinja2:
//!
//! * `trim_blocks` and `lstrip_blocks` on, trailing newline dropped;
//! * Python string/dict/list methods (`.strip()`, `.startswith()`, `.items()`,
//!   `.get()`, …) through `minijinja_contrib::pycompat`;
//! * globals `raise_exception(msg)` (the render fails with
//!   [`ChatError::Raised`]) and `strftime_now(fmt)` (current UTC time; `%Y %m
//!   %d %e %H %M %S %y %j %B %b %A %a %%` are supported);
//! * `tojson` as `transformers` defines it (Python's `json.dumps`: `", "`
//!   and `": "` separators, non-ASCII kept, `indent` honoured, no HTML
//!   escaping), so a template's tool list reads as the model saw it in
//!   training;
//! * context variables `messages`, `add_generation_prompt`, `bos_token`,
//!   `eos_token`, and `tools` when the request has tools (OpenAI's list of
//!   `{"type": "function", "function": {...}}`). Messages carry
//!   `tool_calls` (arguments as JSON values, as `transformers` passes them)
//!   and `tool_call_id` when they have them.
//!
//! Not supported: `{% break %}`/`{% continue %}` (minijinja's non-default
//! `loop_controls` feature) and `documents`, which renders as undefined.

use minijinja::{Environment, Error, ErrorKind, Value, context};

/// One chat message.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct ChatMessage {
    /// `"system"`, `"user"`, `"assistant"`, `"tool"`, …
    pub role: String,
    /// The message text.
    pub content: String,
    /// An assistant turn's calls: `[{"id", "type": "function", "function":
    /// {"name", "arguments": <JSON value>}}]`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tool_calls: Option<serde_json::Value>,
    /// A `tool` turn's answer is to this call.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tool_call_id: Option<String>,
}

impl ChatMessage {
    /// A message with the given role and content.
    pub fn new(role: impl Into<String>, content: impl Into<String>) -> ChatMessage {
        ChatMessage {
            role: role.into(),
            content: content.into(),
            tool_calls: None,
            tool_call_id: None,
        }
    }
}

/// Errors from compiling or rendering a chat template.
#[derive(Debug, thiserror::Error)]
pub enum ChatError {
    /// The template source is not valid Jinja (reported by
    /// [`ChatTemplate::new`]); the message names the line.
    #[error("chat template syntax error: {0:#}")]
    Syntax(#[source] minijinja::Error),
    /// Rendering failed (unknown filter, type error, …).
    #[error("chat template rendering failed: {0:#}")]
    Render(#[source] minijinja::Error),
    /// The template itself rejected the input by calling
    /// `raise_exception(message)`, e.g. "Conversation roles must alternate".
    #[error("chat template rejected the messages: {0}")]
    Raised(String),
}

/// Marks errors produced by `raise_exception` so `render` can tell them apart.
const RAISE_MARKER: &str = "\u{0}flotilla-raise\u{0}";
const TEMPLATE_NAME: &str = "chat_template";

/// A compiled chat template. Compile once, render many times (`&self`,
/// thread-safe).
pub struct ChatTemplate {
    env: Environment<'static>,
    bos_token: String,
    eos_token: String,
    /// The template writes tools and reads calls in Hermes' format.
    hermes_tools: bool,
}

impl std::fmt::Debug for ChatTemplate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ChatTemplate")
            .field("bos_token", &self.bos_token)
            .field("eos_token", &self.eos_token)
            .finish_non_exhaustive()
    }
}

impl ChatTemplate {
    /// Compile `source`. `bos_token`/`eos_token` are the token *texts* (e.g.
    /// `"<|im_start|>"`), exposed to the template as `bos_token`/`eos_token`.
    ///
    /// Errors with [`ChatError::Syntax`] if the source does not parse.
    pub fn new(source: &str, bos_token: &str, eos_token: &str) -> Result<ChatTemplate, ChatError> {
        let mut env = Environment::new();
        env.set_trim_blocks(true);
        env.set_lstrip_blocks(true);
        env.set_keep_trailing_newline(false);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function("raise_exception", raise_exception);
        env.add_function("strftime_now", strftime_now);
        env.add_filter("tojson", tojson);
        env.add_template_owned(TEMPLATE_NAME, source.to_owned())
            .map_err(ChatError::Syntax)?;
        Ok(ChatTemplate {
            env,
            bos_token: bos_token.to_owned(),
            eos_token: eos_token.to_owned(),
            hermes_tools: source.contains("tools") && source.contains("<tool_call>"),
        })
    }

    /// Whether the template has its own tool-calling format, Hermes' (Qwen
    /// 2.5 and 3, Hermes, SmolLM3 and others): it lists `tools` in the
    /// prompt, the model answers with `<tool_call>\n{"name": ..., "arguments":
    /// ...}\n</tool_call>`, and `tool` messages come back in its own markup.
    pub fn hermes_tools(&self) -> bool {
        self.hermes_tools
    }

    /// Render the prompt for `messages`. With `add_generation_prompt`, the
    /// template appends the header that starts the assistant's reply (e.g.
    /// `<|im_start|>assistant\n`).
    pub fn render(
        &self,
        messages: &[ChatMessage],
        add_generation_prompt: bool,
    ) -> Result<String, ChatError> {
        self.render_with_tools(messages, None, add_generation_prompt)
    }

    /// [`ChatTemplate::render`] with the request's `tools` (OpenAI's list)
    /// in the template's context.
    pub fn render_with_tools(
        &self,
        messages: &[ChatMessage],
        tools: Option<&serde_json::Value>,
        add_generation_prompt: bool,
    ) -> Result<String, ChatError> {
        let tmpl = self
            .env
            .get_template(TEMPLATE_NAME)
            .map_err(ChatError::Render)?;
        let ctx = context! {
            messages => Value::from_serialize(messages),
            add_generation_prompt => add_generation_prompt,
            bos_token => self.bos_token.as_str(),
            eos_token => self.eos_token.as_str(),
            tools => tools.map(Value::from_serialize),
        };
        tmpl.render(ctx).map_err(|e| match raised_message(&e) {
            Some(msg) => ChatError::Raised(msg),
            None => ChatError::Render(e),
        })
    }
}

/// `raise_exception(msg)`: abort rendering with the template's message.
fn raise_exception(msg: String) -> Result<Value, Error> {
    Err(Error::new(
        ErrorKind::InvalidOperation,
        format!("{RAISE_MARKER}{msg}"),
    ))
}

/// The message of a `raise_exception` error, looking through wrapped errors.
fn raised_message(e: &Error) -> Option<String> {
    let mut cur: Option<&(dyn std::error::Error + 'static)> = Some(e);
    while let Some(err) = cur {
        if let Some(mj) = err.downcast_ref::<Error>()
            && let Some(msg) = mj.detail().and_then(|d| d.strip_prefix(RAISE_MARKER))
        {
            return Some(msg.to_owned());
        }
        cur = err.source();
    }
    None
}

/// `tojson(value, indent=None)` as `transformers` defines it: Python's
/// `json.dumps(value, ensure_ascii=False, indent=indent)`.
fn tojson(value: Value, kwargs: minijinja::value::Kwargs) -> Result<Value, Error> {
    let indent: Option<usize> = kwargs.get("indent")?;
    kwargs.assert_all_used()?;
    let v = serde_json::to_value(&value)
        .map_err(|e| Error::new(ErrorKind::InvalidOperation, format!("tojson: {e}")))?;
    let mut out = String::new();
    python_json(&v, indent, 0, &mut out);
    Ok(Value::from_safe_string(out))
}

/// `v` as Python's `json.dumps` writes it (`", "`/`": "` without indent,
/// `","`/`": "` and newlines with one).
pub fn python_json(v: &serde_json::Value, indent: Option<usize>, level: usize, out: &mut String) {
    use serde_json::Value as J;
    let newline = |out: &mut String, level: usize| {
        if let Some(n) = indent {
            out.push('\n');
            out.extend(std::iter::repeat_n(' ', n * level));
        }
    };
    let sep = if indent.is_some() { "," } else { ", " };
    match v {
        J::Array(items) if !items.is_empty() => {
            out.push('[');
            for (i, x) in items.iter().enumerate() {
                if i > 0 {
                    out.push_str(sep);
                }
                newline(out, level + 1);
                python_json(x, indent, level + 1, out);
            }
            newline(out, level);
            out.push(']');
        }
        J::Object(map) if !map.is_empty() => {
            out.push('{');
            for (i, (k, x)) in map.iter().enumerate() {
                if i > 0 {
                    out.push_str(sep);
                }
                newline(out, level + 1);
                out.push_str(&serde_json::Value::String(k.clone()).to_string());
                out.push_str(": ");
                python_json(x, indent, level + 1, out);
            }
            newline(out, level);
            out.push('}');
        }
        other => out.push_str(&other.to_string()),
    }
}

/// `strftime_now(format)`: the current UTC time formatted with a subset of
/// C `strftime` (unknown directives are kept as written).
fn strftime_now(format: String) -> String {
    let secs = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs() as i64);
    strftime_utc(&format, secs)
}

fn strftime_utc(format: &str, unix_secs: i64) -> String {
    const MONTHS: [&str; 12] = [
        "January",
        "February",
        "March",
        "April",
        "May",
        "June",
        "July",
        "August",
        "September",
        "October",
        "November",
        "December",
    ];
    const DAYS: [&str; 7] = [
        "Monday",
        "Tuesday",
        "Wednesday",
        "Thursday",
        "Friday",
        "Saturday",
        "Sunday",
    ];
    let days = unix_secs.div_euclid(86_400);
    let tod = unix_secs.rem_euclid(86_400);
    let (year, month, day) = civil_from_days(days);
    // 1970-01-01 was a Thursday (index 3 with Monday = 0).
    let weekday = (days + 3).rem_euclid(7) as usize;
    let yday = days - days_from_civil(year, 1, 1) + 1;
    let (h, m, s) = (tod / 3600, tod / 60 % 60, tod % 60);

    let mut out = String::with_capacity(format.len() + 16);
    let mut chars = format.chars();
    while let Some(c) = chars.next() {
        if c != '%' {
            out.push(c);
            continue;
        }
        match chars.next() {
            Some('Y') => out.push_str(&year.to_string()),
            Some('y') => out.push_str(&format!("{:02}", year.rem_euclid(100))),
            Some('m') => out.push_str(&format!("{month:02}")),
            Some('d') => out.push_str(&format!("{day:02}")),
            Some('e') => out.push_str(&format!("{day:2}")),
            Some('j') => out.push_str(&format!("{yday:03}")),
            Some('H') => out.push_str(&format!("{h:02}")),
            Some('M') => out.push_str(&format!("{m:02}")),
            Some('S') => out.push_str(&format!("{s:02}")),
            Some('B') => out.push_str(MONTHS[month as usize - 1]),
            Some('b') | Some('h') => out.push_str(&MONTHS[month as usize - 1][..3]),
            Some('A') => out.push_str(DAYS[weekday]),
            Some('a') => out.push_str(&DAYS[weekday][..3]),
            Some('%') => out.push('%'),
            Some(other) => {
                out.push('%');
                out.push(other);
            }
            None => out.push('%'),
        }
    }
    out
}

/// Days since 1970-01-01 -> (year, month 1-12, day 1-31), proleptic Gregorian.
fn civil_from_days(z: i64) -> (i64, u32, u32) {
    let z = z + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let y = yoe + era * 400;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = (doy - (153 * mp + 2) / 5 + 1) as u32;
    let m = if mp < 10 { mp + 3 } else { mp - 9 } as u32;
    (if m <= 2 { y + 1 } else { y }, m, d)
}

/// (year, month, day) -> days since 1970-01-01.
fn days_from_civil(y: i64, m: u32, d: u32) -> i64 {
    let y = if m <= 2 { y - 1 } else { y };
    let era = y.div_euclid(400);
    let yoe = y.rem_euclid(400);
    let m = m as i64;
    let doy = (153 * (if m > 2 { m - 3 } else { m + 9 }) + 2) / 5 + d as i64 - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    era * 146_097 + doe - 719_468
}

#[cfg(test)]
mod tests {
    use super::*;

    /// SmolLM2-135M-Instruct's `tokenizer.chat_template` (from its GGUF).
    const SMOLLM2_TEMPLATE: &str = "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}";

    fn check_smollm2(t: &ChatTemplate) {
        let msgs = [ChatMessage::new("user", "What is 2+2?")];
        assert_eq!(
            t.render(&msgs, true).unwrap(),
            "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n\
             <|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n"
        );
        assert_eq!(
            t.render(&msgs, false).unwrap(),
            "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n\
             <|im_start|>user\nWhat is 2+2?<|im_end|>\n"
        );
        let msgs = [
            ChatMessage::new("system", "Be brief."),
            ChatMessage::new("user", "Hi"),
            ChatMessage::new("assistant", "Hello!"),
            ChatMessage::new("user", "Bye"),
        ];
        assert_eq!(
            t.render(&msgs, true).unwrap(),
            "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n\
             <|im_start|>assistant\nHello!<|im_end|>\n<|im_start|>user\nBye<|im_end|>\n\
             <|im_start|>assistant\n"
        );
    }

    #[test]
    fn smollm2_template() {
        let t = ChatTemplate::new(SMOLLM2_TEMPLATE, "<|im_start|>", "<|im_end|>").unwrap();
        check_smollm2(&t);
    }

    #[test]
    fn smollm2_template_from_gguf() {
        let Some(v) = crate::tokenizer::tests::load_test_vocab() else {
            return;
        };
        let src = v
            .chat_template
            .expect("the GGUF has tokenizer.chat_template");
        let bos = &v.tokens[v.bos.unwrap() as usize];
        let eos = &v.tokens[v.eos.unwrap() as usize];
        let t = ChatTemplate::new(&src, bos, eos).unwrap();
        check_smollm2(&t);
    }

    #[test]
    fn template_is_send_and_sync() {
        fn assert_send_sync<T: Send + Sync>() {}
        assert_send_sync::<ChatTemplate>();
    }

    #[test]
    fn syntax_error_is_an_error() {
        for bad in [
            "{% for m in messages %}",
            "{{ messages[0 }}",
            "{% if %}x{% endif %}",
            "{{ }}",
        ] {
            let err = ChatTemplate::new(bad, "", "").unwrap_err();
            assert!(matches!(err, ChatError::Syntax(_)), "{bad}: {err}");
            assert!(err.to_string().contains("syntax error"), "{err}");
        }
    }

    #[test]
    fn raise_exception_and_render_errors() {
        let src = "{% for m in messages %}{% if (m['role'] == 'user') != (loop.index0 % 2 == 0) %}\
                   {{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}\
                   {% endif %}{{ m['content'] }}{% endfor %}";
        let t = ChatTemplate::new(src, "", "").unwrap();
        assert_eq!(
            t.render(&[ChatMessage::new("user", "a")], false).unwrap(),
            "a"
        );
        let err = t
            .render(
                &[ChatMessage::new("user", "a"), ChatMessage::new("user", "b")],
                false,
            )
            .unwrap_err();
        match err {
            ChatError::Raised(msg) => assert!(msg.starts_with("Conversation roles must alternate")),
            other => panic!("expected Raised, got {other}"),
        }
        let t = ChatTemplate::new("{{ messages | no_such_filter }}", "", "");
        // minijinja may resolve filters at compile or render time; either way an error.
        match t {
            Err(e) => assert!(matches!(e, ChatError::Syntax(_))),
            Ok(t) => assert!(matches!(t.render(&[], false), Err(ChatError::Render(_)))),
        }
    }

    #[test]
    fn hf_style_features() {
        // trim_blocks/lstrip_blocks, python methods, bos/eos, tojson, strftime_now.
        let src = "{{ bos_token }}\n{% for m in messages %}\n    {% if m.role == 'system' %}\n[SYS]{{ m.content.strip() | upper }}\n    {% else %}\n{{ m.role.title() }}: {{ m.content }}{{ eos_token }}\n    {% endif %}\n{% endfor %}\n{% if add_generation_prompt %}Assistant:{% endif %}\n";
        let t = ChatTemplate::new(src, "<s>", "</s>").unwrap();
        let out = t
            .render(
                &[
                    ChatMessage::new("system", "  be kind "),
                    ChatMessage::new("user", "hi"),
                ],
                true,
            )
            .unwrap();
        assert_eq!(out, "<s>\n[SYS]BE KIND\nUser: hi</s>\nAssistant:");

        let t = ChatTemplate::new(
            "{{ messages | tojson }}|{{ strftime_now('%Y') | length }}",
            "",
            "",
        )
        .unwrap();
        let out = t
            .render(&[ChatMessage::new("user", "x\"y")], false)
            .unwrap();
        assert!(
            out.starts_with(r#"[{"role": "user", "content": "x\"y"}]"#),
            "{out}"
        );
        assert!(out.ends_with("|4"), "{out}");
    }

    #[test]
    fn tojson_writes_as_python_json_dumps() {
        let t = ChatTemplate::new(
            "{{ x | tojson }}|{{ x | tojson(indent=2) }}|{{ [] | tojson }}",
            "",
            "",
        )
        .unwrap();
        let tmpl = t.env.get_template(TEMPLATE_NAME).unwrap();
        let x = serde_json::json!({"b": [1, 2.5, "é<&>"], "a": {}, "c": null});
        let out = tmpl
            .render(context! { x => Value::from_serialize(&x) })
            .unwrap();
        assert_eq!(
            out,
            "{\"b\": [1, 2.5, \"é<&>\"], \"a\": {}, \"c\": null}|\
             {\n  \"b\": [\n    1,\n    2.5,\n    \"é<&>\"\n  ],\n  \"a\": {},\n  \"c\": null\n}|[]"
        );
    }

    /// Qwen 2.5's template: Hermes' tool format.
    const QWEN25_TEMPLATE: &str =
        include_str!("../../../tests/fixtures/chat_templates/qwen2_5.jinja");

    #[test]
    fn hermes_template_renders_tools_calls_and_answers() {
        let t = ChatTemplate::new(QWEN25_TEMPLATE, "", "<|im_end|>").unwrap();
        assert!(t.hermes_tools());
        assert!(
            !ChatTemplate::new(SMOLLM2_TEMPLATE, "", "")
                .unwrap()
                .hermes_tools()
        );
        let tools = serde_json::json!([{"type": "function", "function": {
            "name": "get_weather", "parameters": {"type": "object",
            "properties": {"city": {"type": "string"}}}}}]);
        let mut call = ChatMessage::new("assistant", "");
        call.tool_calls = Some(serde_json::json!([{"id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]));
        let mut answer = ChatMessage::new("tool", "{\"c\": 21}");
        answer.tool_call_id = Some("call_1".into());
        let msgs = [ChatMessage::new("user", "Weather in Paris?"), call, answer];
        let out = t.render_with_tools(&msgs, Some(&tools), true).unwrap();
        assert!(
            out.contains(
                "<tools>\n{\"type\": \"function\", \"function\": {\"name\": \"get_weather\", \
                 \"parameters\": {\"type\": \"object\", \"properties\": {\"city\": \
                 {\"type\": \"string\"}}}}}\n</tools>"
            ),
            "{out}"
        );
        assert!(
            out.ends_with(
                "<|im_start|>user\nWeather in Paris?<|im_end|>\n<|im_start|>assistant\n\
                 <tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n\
                 </tool_call><|im_end|>\n<|im_start|>user\n<tool_response>\n{\"c\": 21}\n\
                 </tool_response><|im_end|>\n<|im_start|>assistant\n"
            ),
            "{out}"
        );
        // Without tools the template's plain system prompt is used.
        let out = t.render(&msgs[..1], true).unwrap();
        assert!(
            !out.contains("<tools>") && out.contains("You are Qwen"),
            "{out}"
        );
    }

    #[test]
    fn strftime_formats() {
        // 2024-07-26 13:05:09 UTC was a Friday, day 208 of a leap year.
        let t = 1_721_999_109;
        assert_eq!(strftime_utc("%Y-%m-%d %H:%M:%S", t), "2024-07-26 13:05:09");
        assert_eq!(
            strftime_utc("%d %b %Y, %A %a %B %j %y %e %% %Q", t),
            "26 Jul 2024, Friday Fri July 208 24 26 % %Q"
        );
        assert_eq!(strftime_utc("%Y-%m-%d", 0), "1970-01-01");
        assert_eq!(strftime_utc("%Y-%m-%d %a", 951_782_400), "2000-02-29 Tue");
    }
}
