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
//! * context variables `messages`, `add_generation_prompt`, `bos_token`,
//!   `eos_token`.
//!
//! Not supported: `{% break %}`/`{% continue %}` (minijinja's non-default
//! `loop_controls` feature) and tool-calling variables (`tools`, `documents`),
//! which render as undefined.

use minijinja::{Environment, Error, ErrorKind, Value, context};

/// One chat message.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct ChatMessage {
    /// `"system"`, `"user"`, `"assistant"`, …
    pub role: String,
    /// The message text.
    pub content: String,
}

impl ChatMessage {
    /// A message with the given role and content.
    pub fn new(role: impl Into<String>, content: impl Into<String>) -> ChatMessage {
        ChatMessage {
            role: role.into(),
            content: content.into(),
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
        env.add_template_owned(TEMPLATE_NAME, source.to_owned())
            .map_err(ChatError::Syntax)?;
        Ok(ChatTemplate {
            env,
            bos_token: bos_token.to_owned(),
            eos_token: eos_token.to_owned(),
        })
    }

    /// Render the prompt for `messages`. With `add_generation_prompt`, the
    /// template appends the header that starts the assistant's reply (e.g.
    /// `<|im_start|>assistant\n`).
    pub fn render(
        &self,
        messages: &[ChatMessage],
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
            out.starts_with(r#"[{"content":"x\"y","role":"user"}]"#)
                || out.starts_with(r#"[{"role":"user","content":"x\"y"}]"#),
            "{out}"
        );
        assert!(out.ends_with("|4"), "{out}");
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
