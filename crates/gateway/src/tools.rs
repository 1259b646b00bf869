//! Tool calling: OpenAI's `tools`, `tool_choice` and `parallel_tool_calls`
//! read and checked, the tools put in the prompt, generation constrained
//! to a call when the request requires one, and the model's calls parsed
//! out of its text (streamed as OpenAI streams them).
//!
//! One wire format for calls, Hermes': `<tool_call>\n{"name": ..., "arguments":
//! {...}}\n</tool_call>`, one block per call. Templates that know it (Qwen
//! 2.5 and 3, Hermes, SmolLM3: [`ChatTemplate::hermes_tools`]) get the tools,
//! the assistant's calls and the `tool` answers in their own context and
//! markup. For every other template the tools and the format are described
//! in the system prompt (the words Qwen's template uses), calls written back
//! as that text and `tool` answers given as user turns in `<tool_response>`
//! tags, so templates that allow only user and assistant turns (Gemma's)
//! still render.
//!
//! `tool_choice`: `none` leaves the tools out and parses nothing; `auto`
//! lets the model choose and parses what it wrote; `required` and a named
//! function constrain generation to call blocks (a grammar over the tools'
//! parameter schemas, objects closed to the properties they name, as
//! `strict` asks and vLLM's xgrammar does by default), one unless
//! `parallel_tool_calls` allows more.
//!
//! [`ChatTemplate::hermes_tools`]: flotilla_text::chat::ChatTemplate::hermes_tools

use flotilla_proto::Constraint;
use flotilla_text::chat::{ChatMessage, python_json};
use serde_json::{Map, Value, json};

use crate::error::ApiError;

/// Most tools a request may list (OpenAI's own limit).
pub const TOOLS_MAX: usize = 128;
/// Longest function name (OpenAI's own limit).
pub const TOOL_NAME_MAX: usize = 64;

const OPEN: &str = "<tool_call>";
const CLOSE: &str = "</tool_call>";

/// One function the model may call.
#[derive(Clone, Debug, PartialEq)]
pub struct Tool {
    /// `function.name`: `[A-Za-z0-9_-]{1,64}`, unique in the request.
    pub name: String,
    /// `function.parameters`: a JSON Schema for the arguments object.
    pub parameters: Value,
}

/// `tool_choice`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ToolChoice {
    /// No call: the tools are left out of the prompt.
    None,
    /// The model decides; what it calls is parsed.
    Auto,
    /// At least one call, constrained.
    Required,
    /// A call of this function, constrained.
    Named(String),
}

/// A request's tools.
#[derive(Clone, Debug, PartialEq)]
pub struct Tools {
    /// The functions, in the request's order.
    pub list: Vec<Tool>,
    /// The request's `tools`, as given (what a template reads).
    pub raw: Value,
    /// `tool_choice` (`auto` when tools are given without one).
    pub choice: ToolChoice,
    /// `parallel_tool_calls` (true unless set false).
    pub parallel: bool,
}

impl Tools {
    /// Whether the model sees the tools and its text is parsed for calls.
    pub fn active(&self) -> bool {
        self.choice != ToolChoice::None && !self.list.is_empty()
    }

    /// The grammar generation must follow, for `required` and a named
    /// function: one call block, or (parallel) blocks separated by a
    /// newline, each `{"name": NAME, "arguments": ARGS}` with ARGS
    /// matching that function's parameters.
    pub fn constraint(&self) -> Option<Constraint> {
        match &self.choice {
            ToolChoice::None | ToolChoice::Auto => None,
            ToolChoice::Required => Some(self.call_grammar(None)),
            ToolChoice::Named(n) => Some(self.call_grammar(Some(n))),
        }
    }

    /// The grammar of calls of every function (`only`: of that one), as
    /// [`Tools::constraint`] describes it, whatever the choice.
    pub fn call_grammar(&self, only: Option<&str>) -> Constraint {
        let mut g = String::new();
        g.push_str(if self.parallel {
            "start: call (\"\\n\" call)*\n"
        } else {
            "start: call\n"
        });
        let fns: Vec<&Tool> = self
            .list
            .iter()
            .filter(|t| only.is_none_or(|n| n == t.name))
            .collect();
        let alts: Vec<String> = (0..fns.len()).map(|i| format!("fn{i}")).collect();
        g.push_str(&format!(
            "call: {} ({}) {}\n",
            lark_literal(&format!("{OPEN}\n")),
            alts.join(" | "),
            lark_literal(&format!("\n{CLOSE}")),
        ));
        for (i, t) in fns.iter().enumerate() {
            // Objects get only the properties their schema names, strict or
            // not (xgrammar's default in vLLM): a small model otherwise
            // invents arguments until max_tokens.
            let mut schema = t.parameters.clone();
            crate::openai::close_objects(&mut schema);
            crate::openai::bound_numbers(&mut schema);
            if let Value::Object(o) = &mut schema {
                o.entry("x-guidance")
                    .or_insert_with(|| json!({"whitespace_flexible": false}));
            }
            g.push_str(&format!(
                "fn{i}: {} %json {} \"}}\"\n",
                lark_literal(&format!("{{\"name\": \"{}\", \"arguments\": ", t.name)),
                schema
            ));
        }
        Constraint::Lark(g)
    }

    /// The system-prompt text that describes the tools and the call format
    /// to a model whose template does not (Qwen 2.5's words).
    pub fn system_prompt(&self) -> String {
        let mut s = String::from(
            "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n\
             You are provided with function signatures within <tools></tools> XML tags:\n<tools>",
        );
        if let Value::Array(items) = &self.raw {
            for t in items {
                s.push('\n');
                python_json(t, None, 0, &mut s);
            }
        }
        s.push_str(
            "\n</tools>\n\nFor each function call, return a json object with function name and \
             arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n\
             {\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call>",
        );
        s
    }

    /// The function names, in order.
    pub fn names(&self) -> Vec<String> {
        self.list.iter().map(|t| t.name.clone()).collect()
    }
}

/// `s` as a Lark string literal.
fn lark_literal(s: &str) -> String {
    // JSON's escapes are a subset of what Lark's literals read.
    Value::String(s.to_owned()).to_string()
}

/// Reads `tools`, `tool_choice` and `parallel_tool_calls`; `None` when the
/// request has no tools and no choice that needs them.
pub fn parse(obj: &Map<String, Value>) -> Result<Option<Tools>, ApiError> {
    let opt = |k: &str| obj.get(k).filter(|v| !v.is_null());
    let raw = match opt("tools") {
        None => Value::Array(Vec::new()),
        Some(v @ Value::Array(_)) => v.clone(),
        Some(_) => return Err(type_error("tools", "a list of tools")),
    };
    let items = raw.as_array().map_or(&[][..], Vec::as_slice);
    if items.len() > TOOLS_MAX {
        return Err(ApiError::invalid(
            "tools",
            format!("at most {TOOLS_MAX} tools are allowed, got {}", items.len()),
        ));
    }
    let mut list = Vec::with_capacity(items.len());
    for (i, t) in items.iter().enumerate() {
        let p = format!("tools[{i}]");
        let Value::Object(t) = t else {
            return Err(type_error(&p, "an object"));
        };
        match t.get("type").and_then(Value::as_str) {
            Some("function") => {}
            Some(other) => {
                return Err(ApiError::unsupported(
                    &format!("{p}.type"),
                    format!("tool type '{other}' is not supported; only 'function'"),
                ));
            }
            None => return Err(type_error(&format!("{p}.type"), "\"function\"")),
        }
        let Some(Value::Object(f)) = t.get("function") else {
            return Err(type_error(
                &format!("{p}.function"),
                "an object with a \"name\"",
            ));
        };
        let name = match f.get("name") {
            Some(Value::String(n)) if valid_name(n) => n.clone(),
            Some(Value::String(n)) => {
                return Err(ApiError::invalid(
                    &format!("{p}.function.name"),
                    format!(
                        "function names are 1 to {TOOL_NAME_MAX} of a-z, A-Z, 0-9, '_' and \
                         '-'; got '{n}'"
                    ),
                ));
            }
            _ => return Err(type_error(&format!("{p}.function.name"), "a string")),
        };
        if list.iter().any(|x: &Tool| x.name == name) {
            return Err(ApiError::invalid(
                &format!("{p}.function.name"),
                format!("function '{name}' is listed twice"),
            ));
        }
        if let Some(d) = f.get("description").filter(|d| !d.is_null())
            && !d.is_string()
        {
            return Err(type_error(&format!("{p}.function.description"), "a string"));
        }
        let parameters = match f.get("parameters") {
            None | Some(Value::Null) => json!({"type": "object", "properties": {}}),
            Some(v @ Value::Object(_)) => v.clone(),
            Some(_) => {
                return Err(type_error(
                    &format!("{p}.function.parameters"),
                    "a JSON Schema object",
                ));
            }
        };
        if let Some(s) = f.get("strict").filter(|s| !s.is_null())
            && !s.is_boolean()
        {
            return Err(type_error(&format!("{p}.function.strict"), "a boolean"));
        }
        list.push(Tool { name, parameters });
    }
    let choice = match opt("tool_choice") {
        None if list.is_empty() => ToolChoice::None,
        None => ToolChoice::Auto,
        Some(Value::String(c)) => match c.as_str() {
            "none" => ToolChoice::None,
            "auto" => ToolChoice::Auto,
            "required" => ToolChoice::Required,
            other => {
                return Err(ApiError::invalid(
                    "tool_choice",
                    format!(
                        "tool_choice must be 'none', 'auto', 'required' or {{\"type\": \
                         \"function\", \"function\": {{\"name\": ...}}}}; got '{other}'"
                    ),
                ));
            }
        },
        Some(Value::Object(c)) => {
            let name = match (c.get("type").and_then(Value::as_str), c.get("function")) {
                (Some("function"), Some(Value::Object(f))) => f.get("name").and_then(Value::as_str),
                _ => None,
            };
            let Some(name) = name else {
                return Err(type_error(
                    "tool_choice",
                    "'none', 'auto', 'required' or {\"type\": \"function\", \"function\": \
                     {\"name\": ...}}",
                ));
            };
            if !list.iter().any(|t| t.name == name) {
                return Err(ApiError::invalid(
                    "tool_choice",
                    format!("tool_choice names function '{name}', which is not in tools"),
                ));
            }
            ToolChoice::Named(name.to_owned())
        }
        Some(_) => {
            return Err(type_error(
                "tool_choice",
                "'none', 'auto', 'required' or an object naming a function",
            ));
        }
    };
    if choice == ToolChoice::Required && list.is_empty() {
        return Err(ApiError::invalid(
            "tool_choice",
            "tool_choice 'required' needs at least one tool in tools",
        ));
    }
    let parallel = match opt("parallel_tool_calls") {
        None => true,
        Some(Value::Bool(b)) => *b,
        Some(_) => return Err(type_error("parallel_tool_calls", "a boolean")),
    };
    if list.is_empty() {
        return Ok(None);
    }
    Ok(Some(Tools {
        list,
        raw,
        choice,
        parallel,
    }))
}

fn valid_name(n: &str) -> bool {
    (1..=TOOL_NAME_MAX).contains(&n.len())
        && n.bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-')
}

fn type_error(param: &str, expected: &str) -> ApiError {
    ApiError::invalid(param, format!("'{param}' must be {expected}"))
}

/// An assistant message's `tool_calls` as templates read them (arguments
/// parsed from their JSON text), and as Hermes' call blocks.
pub fn assistant_calls(v: &Value, param: &str) -> Result<(Value, String), ApiError> {
    let Value::Array(calls) = v else {
        return Err(type_error(param, "a list of tool calls"));
    };
    let mut out = Vec::with_capacity(calls.len());
    let mut text = String::new();
    for (j, c) in calls.iter().enumerate() {
        let p = format!("{param}[{j}]");
        let f = c.get("function").and_then(Value::as_object);
        let name = f.and_then(|f| f.get("name")).and_then(Value::as_str);
        let (Some(f), Some(name)) = (f, name) else {
            return Err(type_error(
                &p,
                "{\"id\", \"type\": \"function\", \"function\": {\"name\", \"arguments\"}}",
            ));
        };
        let arguments = match f.get("arguments") {
            None | Some(Value::Null) => json!({}),
            Some(Value::String(s)) => serde_json::from_str(s).map_err(|e| {
                ApiError::invalid(
                    &format!("{p}.function.arguments"),
                    format!("the arguments are not JSON: {e}"),
                )
            })?,
            Some(v @ Value::Object(_)) => v.clone(),
            Some(_) => {
                return Err(type_error(
                    &format!("{p}.function.arguments"),
                    "a string of JSON",
                ));
            }
        };
        if !text.is_empty() {
            text.push('\n');
        }
        let mut body = Map::new();
        body.insert("name".into(), name.into());
        body.insert("arguments".into(), arguments.clone());
        text.push_str(OPEN);
        text.push('\n');
        python_json(&Value::Object(body), None, 0, &mut text);
        text.push('\n');
        text.push_str(CLOSE);
        out.push(json!({
            "id": c.get("id").and_then(Value::as_str).unwrap_or(""),
            "type": "function",
            "function": {"name": name, "arguments": arguments},
        }));
    }
    Ok((Value::Array(out), text))
}

/// The messages as a template without a tool format can render them:
/// calls become Hermes' blocks in the assistant's text, `tool` answers
/// become user turns (consecutive ones merged), and the tools' description
/// goes into the system prompt when `tools` is given.
pub fn generic_messages(messages: Vec<ChatMessage>, tools: Option<&Tools>) -> Vec<ChatMessage> {
    let mut out: Vec<ChatMessage> = Vec::with_capacity(messages.len() + 1);
    let mut last_was_tool = false;
    for mut m in messages {
        if m.role == "tool" {
            let block = format!("<tool_response>\n{}\n</tool_response>", m.content);
            match out.last_mut() {
                Some(prev) if last_was_tool => {
                    prev.content.push('\n');
                    prev.content.push_str(&block);
                }
                _ => out.push(ChatMessage::new("user", block)),
            }
            last_was_tool = true;
            continue;
        }
        last_was_tool = false;
        m.tool_call_id = None;
        m.tool_calls = None;
        out.push(m);
    }
    if let Some(t) = tools.filter(|t| t.active()) {
        let desc = t.system_prompt();
        match out.first_mut() {
            Some(sys) if sys.role == "system" => {
                if !sys.content.is_empty() {
                    sys.content.push_str("\n\n");
                }
                sys.content.push_str(&desc);
            }
            _ => out.insert(0, ChatMessage::new("system", desc)),
        }
    }
    out
}

/// A whole response's text outside calls, and its calls, from the
/// parser's events.
#[derive(Debug, Default)]
pub struct Collected {
    /// Text outside any call.
    pub content: String,
    /// `(id, name, arguments)`, in order.
    pub calls: Vec<(String, String, String)>,
}

impl Collected {
    /// Adds `ev`, in order.
    pub fn apply(&mut self, ev: Vec<ToolEvent>) {
        for e in ev {
            match e {
                ToolEvent::Content(t) => self.content.push_str(&t),
                ToolEvent::Start { id, name, .. } => self.calls.push((id, name, String::new())),
                ToolEvent::Args { index, text } => {
                    if let Some(c) = self.calls.get_mut(index) {
                        c.2.push_str(&text);
                    }
                }
            }
        }
    }
}

/// What the parser found in the model's text, in order.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ToolEvent {
    /// Text outside any call.
    Content(String),
    /// A call begins (its arguments follow in [`ToolEvent::Args`]).
    Start {
        /// Place among this response's calls.
        index: usize,
        /// `call_…`, unique per response.
        id: String,
        /// The function.
        name: String,
    },
    /// More of a call's arguments (JSON text; a call's pieces join to it).
    Args {
        /// The call.
        index: usize,
        /// The next piece.
        text: String,
    },
}

/// Where the parser is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum State {
    /// Outside a call.
    Text,
    /// After `<tool_call>`, before the arguments.
    Head,
    /// Inside a call's arguments, streamed as they come.
    Args { depth: u32, in_str: bool, esc: bool },
    /// After the arguments, up to `</tool_call>`.
    Tail,
    /// A call not in the expected shape: held until `</tool_call>`, then
    /// parsed whole (or given back as text).
    Whole,
    /// The one call allowed has been read; the rest is dropped.
    Done,
}

/// Reads Hermes' call blocks out of generated text as it arrives.
///
/// A call whose text starts `{"name": "<a listed function>", "arguments": {`
/// is streamed: its start as soon as the name is read, its arguments piece
/// by piece. One in another shape (keys the other way round, `parameters`
/// for `arguments`, arguments as a string) is held to its end and parsed
/// whole; one that is not a call of a listed function is given back as
/// text. Text that might begin `<tool_call>` is held until it cannot.
#[derive(Debug)]
pub struct ToolCallParser {
    names: Vec<String>,
    id_base: u64,
    one_call: bool,
    buf: String,
    state: State,
    calls: usize,
    /// Whitespace outside calls, held until other text follows (dropped
    /// if a call does, or if the text ends after a call).
    ws: String,
}

impl ToolCallParser {
    /// Over `names` (the request's functions); `id_base` makes the call ids;
    /// with `one_call`, reading ends after the first call.
    pub fn new(names: Vec<String>, id_base: u64, one_call: bool) -> Self {
        ToolCallParser {
            names,
            id_base,
            one_call,
            buf: String::new(),
            state: State::Text,
            calls: 0,
            ws: String::new(),
        }
    }

    /// Calls read so far.
    pub fn calls(&self) -> usize {
        self.calls
    }

    /// The one call allowed has been read: generation may stop.
    pub fn done(&self) -> bool {
        self.state == State::Done
    }

    /// Reads `text`, returning what it completes.
    pub fn push(&mut self, text: &str) -> Vec<ToolEvent> {
        let mut ev = Vec::new();
        if self.state == State::Done {
            return ev;
        }
        self.buf.push_str(text);
        self.advance(&mut ev);
        ev
    }

    /// The text has ended: returns what was held.
    pub fn finish(&mut self) -> Vec<ToolEvent> {
        let mut ev = Vec::new();
        let rest = std::mem::take(&mut self.buf);
        match self.state {
            // After a call, held text that could only begin another (a
            // `<tool` cut short by max_tokens) is not content.
            State::Text if self.calls > 0 && OPEN.starts_with(&rest) => {}
            State::Text => {
                self.text(&mut ev, rest);
                if self.calls == 0 {
                    content(&mut ev, std::mem::take(&mut self.ws));
                }
            }
            State::Head | State::Whole => {
                // Cut short: a complete object still counts as a call; an
                // incomplete one after other calls is dropped, and before
                // any is given back as text.
                if !self.whole_call(&mut ev, rest.trim()) && self.calls == 0 {
                    content(&mut ev, format!("{OPEN}{rest}"));
                }
            }
            State::Args { .. } => {
                if !rest.is_empty() {
                    self.args(&mut ev, rest);
                }
            }
            State::Tail | State::Done => {}
        }
        ev
    }

    /// Text outside calls: trailing whitespace is held until something
    /// other than a call follows.
    fn text(&mut self, ev: &mut Vec<ToolEvent>, text: String) {
        let body = text.trim_end();
        if body.is_empty() {
            self.ws.push_str(&text);
        } else {
            content(ev, std::mem::take(&mut self.ws));
            content(ev, body.to_owned());
            self.ws.push_str(&text[body.len()..]);
        }
    }

    fn id(&self, index: usize) -> String {
        format!("call_{:016x}{index:02}", self.id_base)
    }

    fn start(&mut self, ev: &mut Vec<ToolEvent>, name: String) {
        let index = self.calls;
        self.calls += 1;
        ev.push(ToolEvent::Start {
            index,
            id: self.id(index),
            name,
        });
    }

    fn args(&self, ev: &mut Vec<ToolEvent>, text: String) {
        let index = self.calls - 1;
        match ev.last_mut() {
            Some(ToolEvent::Args { index: i, text: t }) if *i == index => t.push_str(&text),
            _ => ev.push(ToolEvent::Args { index, text }),
        }
    }

    fn call_ended(&mut self) {
        self.state = if self.one_call {
            State::Done
        } else {
            State::Text
        };
        if self.one_call {
            self.buf.clear();
        }
    }

    fn advance(&mut self, ev: &mut Vec<ToolEvent>) {
        loop {
            match self.state {
                State::Done => return,
                State::Text => match self.buf.find(OPEN) {
                    Some(i) => {
                        let mut before: String = self.buf.drain(..i + OPEN.len()).collect();
                        before.truncate(i);
                        self.text(ev, before);
                        self.ws.clear();
                        self.state = State::Head;
                    }
                    None => {
                        let keep = partial_suffix(&self.buf, OPEN);
                        let out: String = self.buf.drain(..self.buf.len() - keep).collect();
                        self.text(ev, out);
                        return;
                    }
                },
                State::Head => match head(&self.buf) {
                    Head::More => return,
                    Head::No => self.state = State::Whole,
                    Head::Yes { name, len } => {
                        if self.names.contains(&name) {
                            self.buf.drain(..len);
                            self.start(ev, name);
                            self.state = State::Args {
                                depth: 0,
                                in_str: false,
                                esc: false,
                            };
                        } else {
                            self.state = State::Whole;
                        }
                    }
                },
                State::Args {
                    mut depth,
                    mut in_str,
                    mut esc,
                } => {
                    let mut end = None;
                    for (i, c) in self.buf.char_indices() {
                        if in_str {
                            match (esc, c) {
                                (true, _) => esc = false,
                                (false, '\\') => esc = true,
                                (false, '"') => in_str = false,
                                _ => {}
                            }
                            continue;
                        }
                        match c {
                            '"' => in_str = true,
                            '{' | '[' => depth += 1,
                            '}' | ']' => {
                                depth = depth.saturating_sub(1);
                                if depth == 0 {
                                    end = Some(i + 1);
                                    break;
                                }
                            }
                            _ => {}
                        }
                    }
                    match end {
                        Some(e) => {
                            let piece: String = self.buf.drain(..e).collect();
                            self.args(ev, piece);
                            self.state = State::Tail;
                        }
                        None => {
                            let piece = std::mem::take(&mut self.buf);
                            if !piece.is_empty() {
                                self.args(ev, piece);
                            }
                            self.state = State::Args { depth, in_str, esc };
                            return;
                        }
                    }
                }
                State::Tail => match self.buf.find(CLOSE) {
                    Some(i) => {
                        self.buf.drain(..i + CLOSE.len());
                        self.call_ended();
                    }
                    None => {
                        // Only the closing brace and the tag belong here.
                        let keep = partial_suffix(&self.buf, CLOSE);
                        self.buf.drain(..self.buf.len() - keep);
                        return;
                    }
                },
                State::Whole => match self.buf.find(CLOSE) {
                    Some(i) => {
                        let block: String = self.buf.drain(..i + CLOSE.len()).collect();
                        let body = &block[..i];
                        if self.whole_call(ev, body.trim()) {
                            self.call_ended();
                        } else {
                            content(ev, format!("{OPEN}{block}"));
                            self.state = State::Text;
                        }
                    }
                    None => return,
                },
            }
        }
    }

    /// A whole call block's body: `{"name", "arguments" | "parameters"}`
    /// of a listed function, arguments an object or a string of one.
    fn whole_call(&mut self, ev: &mut Vec<ToolEvent>, body: &str) -> bool {
        let Ok(Value::Object(o)) = serde_json::from_str::<Value>(body) else {
            return false;
        };
        let Some(name) = o.get("name").and_then(Value::as_str) else {
            return false;
        };
        if !self.names.iter().any(|n| n == name) {
            return false;
        }
        let args = match o.get("arguments").or_else(|| o.get("parameters")) {
            None | Some(Value::Null) => "{}".to_owned(),
            Some(v @ Value::Object(_)) => v.to_string(),
            Some(Value::String(s))
                if matches!(serde_json::from_str::<Value>(s), Ok(Value::Object(_))) =>
            {
                s.clone()
            }
            Some(_) => return false,
        };
        self.start(ev, name.to_owned());
        self.args(ev, args);
        true
    }
}

fn content(ev: &mut Vec<ToolEvent>, text: String) {
    if text.is_empty() {
        return;
    }
    match ev.last_mut() {
        Some(ToolEvent::Content(t)) => t.push_str(&text),
        _ => ev.push(ToolEvent::Content(text)),
    }
}

/// Length of the longest suffix of `s` that is a proper prefix of `tag`.
fn partial_suffix(s: &str, tag: &str) -> usize {
    (1..tag.len().min(s.len() + 1))
        .rev()
        .find(|&n| s.is_char_boundary(s.len() - n) && tag.starts_with(&s[s.len() - n..]))
        .unwrap_or(0)
}

enum Head {
    /// Not yet known.
    More,
    /// Not the streamed shape.
    No,
    /// `{"name": NAME, "arguments": ` read, `len` bytes, arguments next
    /// (an object).
    Yes { name: String, len: usize },
}

/// Matches `ws { ws "name" ws : ws STRING ws , ws "arguments" ws : ws {`
/// at the start of `s`.
fn head(s: &str) -> Head {
    let b = s.as_bytes();
    let mut i = 0;
    let ws = |i: &mut usize| {
        while *i < b.len() && b[*i].is_ascii_whitespace() {
            *i += 1;
        }
    };
    // A literal: Some(true) matched, Some(false) mismatched, None short.
    let lit = |i: &mut usize, l: &str| -> Option<bool> {
        let rest = &b[*i..];
        let n = l.len().min(rest.len());
        if rest[..n] != l.as_bytes()[..n] {
            return Some(false);
        }
        if n < l.len() {
            return None;
        }
        *i += n;
        Some(true)
    };
    macro_rules! expect {
        ($l:expr) => {
            ws(&mut i);
            match lit(&mut i, $l) {
                Some(true) => {}
                Some(false) => return Head::No,
                None => return Head::More,
            }
        };
    }
    expect!("{");
    expect!("\"name\"");
    expect!(":");
    ws(&mut i);
    if i >= b.len() {
        return Head::More;
    }
    if b[i] != b'"' {
        return Head::No;
    }
    let start = i;
    i += 1;
    let mut esc = false;
    loop {
        if i >= b.len() {
            return Head::More;
        }
        match (esc, b[i]) {
            (true, _) => esc = false,
            (false, b'\\') => esc = true,
            (false, b'"') => break,
            _ => {}
        }
        i += 1;
    }
    i += 1;
    let Ok(name) = serde_json::from_str::<String>(&s[start..i]) else {
        return Head::No;
    };
    expect!(",");
    expect!("\"arguments\"");
    expect!(":");
    ws(&mut i);
    if i >= b.len() {
        return Head::More;
    }
    if b[i] != b'{' {
        return Head::No;
    }
    Head::Yes { name, len: i }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tools(v: Value) -> Result<Option<Tools>, ApiError> {
        let Value::Object(o) = v else { unreachable!() };
        parse(&o)
    }

    fn weather() -> Value {
        json!([{"type": "function", "function": {"name": "get_weather",
            "description": "Weather in a city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                           "required": ["city"]}}},
               {"type": "function", "function": {"name": "get_time"}}])
    }

    /// Runs the parser over `text` cut into pieces of `step` bytes (on char
    /// boundaries), joining what it returns.
    fn run(text: &str, step: usize, one: bool) -> (String, Vec<(String, String, String)>) {
        let names = vec!["get_weather".to_string(), "get_time".to_string()];
        let mut p = ToolCallParser::new(names, 7, one);
        let mut ev = Vec::new();
        let mut i = 0;
        while i < text.len() {
            let mut j = (i + step).min(text.len());
            while !text.is_char_boundary(j) {
                j += 1;
            }
            ev.extend(p.push(&text[i..j]));
            i = j;
        }
        ev.extend(p.finish());
        // Calls start in order, and arguments follow their own call's start.
        let mut started = 0;
        for e in &ev {
            match e {
                ToolEvent::Start { index, .. } => {
                    assert_eq!(*index, started);
                    started += 1;
                }
                ToolEvent::Args { index, .. } => assert!(*index < started),
                ToolEvent::Content(_) => {}
            }
        }
        let mut out = Collected::default();
        out.apply(ev);
        (out.content, out.calls)
    }

    #[test]
    fn calls_stream_out_of_text_at_any_cut() {
        let text = "Let me check. <tool_call>\n{\"name\": \"get_weather\", \"arguments\": \
                    {\"city\": \"Pa}ris\\\"\", \"n\": [1, {\"x\": 2}]}}\n</tool_call>\n\
                    <tool_call>\n{\"name\": \"get_time\", \"arguments\": {}}\n</tool_call> é<tool";
        for step in 1..12 {
            let (content, calls) = run(text, step, false);
            // The trailing `<tool` could only begin another call: dropped.
            assert_eq!(content, "Let me check. é", "step {step}");
            assert_eq!(calls.len(), 2, "step {step}");
            assert_eq!(calls[0].0, "call_000000000000000700");
            assert_eq!(calls[0].1, "get_weather");
            assert_eq!(
                calls[0].2,
                "{\"city\": \"Pa}ris\\\"\", \"n\": [1, {\"x\": 2}]}"
            );
            assert_eq!(
                (calls[1].1.as_str(), calls[1].2.as_str()),
                ("get_time", "{}")
            );
            assert_ne!(calls[0].0, calls[1].0);
        }
    }

    #[test]
    fn other_shapes_are_parsed_whole_or_given_back() {
        // Keys the other way round, and `parameters`: parsed whole.
        let text = "<tool_call>{\"arguments\": {\"city\": \"Oslo\"}, \"name\": \"get_weather\"}\
                    </tool_call><tool_call>{\"name\": \"get_time\", \"parameters\": \"{}\"}</tool_call>";
        for step in [1, 5, 400] {
            let (content, calls) = run(text, step, false);
            assert_eq!(content, "");
            assert_eq!(calls[0].1, "get_weather");
            assert_eq!(calls[0].2, "{\"city\":\"Oslo\"}");
            assert_eq!(
                (calls[1].1.as_str(), calls[1].2.as_str()),
                ("get_time", "{}")
            );
        }
        // Not a listed function, not JSON: text.
        for bad in [
            "<tool_call>{\"name\": \"rm_rf\", \"arguments\": {}}</tool_call>",
            "<tool_call>not json</tool_call>",
        ] {
            let (content, calls) = run(bad, 3, false);
            assert_eq!((content.as_str(), calls.len()), (bad, 0));
        }
        // Cut short before the arguments: what was held comes back as text;
        // after a call, the start of another cut short is dropped.
        let (content, calls) = run("<tool_call>\n{\"name\": \"get_we", 2, false);
        assert_eq!(
            (content.as_str(), calls.len()),
            ("<tool_call>\n{\"name\": \"get_we", 0)
        );
        let one = "<tool_call>{\"name\": \"get_time\", \"arguments\": {}}</tool_call>\n";
        for cut in ["<tool", "<tool_call>\n{\"name\": \"get_we"] {
            let (content, calls) = run(&format!("{one}{cut}"), 3, false);
            assert_eq!((content.as_str(), calls.len()), ("", 1), "{cut}");
        }
        // Cut short inside the arguments: the call stands, arguments partial.
        let (_, calls) = run(
            "<tool_call>{\"name\": \"get_time\", \"arguments\": {\"a",
            4,
            false,
        );
        assert_eq!(calls[0].2, "{\"a");
    }

    #[test]
    fn one_call_ends_reading() {
        let text = "<tool_call>{\"name\": \"get_time\", \"arguments\": {}}</tool_call>\n\
                    <tool_call>{\"name\": \"get_time\", \"arguments\": {}}</tool_call>after";
        let (content, calls) = run(text, 3, true);
        assert_eq!((content.as_str(), calls.len()), ("", 1));
    }

    #[test]
    fn tools_and_choices_are_checked() {
        let t = tools(json!({"tools": weather()})).unwrap().unwrap();
        assert_eq!(t.choice, ToolChoice::Auto);
        assert!(t.parallel && t.active() && t.constraint().is_none());
        assert_eq!(t.list[1].parameters["type"], "object");
        let t = tools(json!({"tools": weather(), "tool_choice": "none"}))
            .unwrap()
            .unwrap();
        assert!(!t.active());
        assert!(tools(json!({"tool_choice": "auto"})).unwrap().is_none());
        let named = json!({"type": "function", "function": {"name": "get_time"}});
        let t =
            tools(json!({"tools": weather(), "tool_choice": named, "parallel_tool_calls": false}))
                .unwrap()
                .unwrap();
        assert_eq!(t.choice, ToolChoice::Named("get_time".into()));
        let Some(Constraint::Lark(g)) = t.constraint() else {
            panic!()
        };
        assert!(
            g.starts_with("start: call\n") && !g.contains("get_weather"),
            "{g}"
        );
        let t = tools(json!({"tools": weather(), "tool_choice": "required"}))
            .unwrap()
            .unwrap();
        let Some(Constraint::Lark(g)) = t.constraint() else {
            panic!()
        };
        assert!(
            g.contains("get_weather") && g.contains("get_time") && g.contains("(\"\\n\" call)*")
        );

        let bad = |v: Value, param: &str| {
            let e = tools(v).unwrap_err();
            assert_eq!(e.body()["error"]["param"], param, "{e}");
        };
        bad(json!({"tools": {}}), "tools");
        bad(
            json!({"tools": [{"type": "code_interpreter"}]}),
            "tools[0].type",
        );
        bad(
            json!({"tools": [{"type": "function"}]}),
            "tools[0].function",
        );
        bad(
            json!({"tools": [{"type": "function", "function": {"name": "a b"}}]}),
            "tools[0].function.name",
        );
        bad(
            json!({"tools": [{"type": "function", "function": {"name": "f", "parameters": 3}}]}),
            "tools[0].function.parameters",
        );
        let twice = json!([{"type": "function", "function": {"name": "f"}},
                           {"type": "function", "function": {"name": "f"}}]);
        bad(json!({"tools": twice}), "tools[1].function.name");
        bad(json!({"tool_choice": "required"}), "tool_choice");
        bad(
            json!({"tools": weather(), "tool_choice": "always"}),
            "tool_choice",
        );
        bad(
            json!({"tools": weather(), "tool_choice": {"type": "function", "function": {"name": "nope"}}}),
            "tool_choice",
        );
        bad(
            json!({"tools": weather(), "parallel_tool_calls": 1}),
            "parallel_tool_calls",
        );
    }

    #[test]
    fn generic_messages_fold_tools_into_the_system_prompt_and_user_turns() {
        let t = tools(json!({"tools": weather()})).unwrap().unwrap();
        let (calls, text) = assistant_calls(
            &json!([{"id": "call_1", "type": "function",
                     "function": {"name": "get_weather", "arguments": "{\"city\":\"Paris\"}"}}]),
            "messages[1].tool_calls",
        )
        .unwrap();
        assert_eq!(calls[0]["function"]["arguments"]["city"], "Paris");
        assert_eq!(
            text,
            "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>"
        );
        let mut a = ChatMessage::new("assistant", text.clone());
        a.tool_calls = Some(calls);
        let msgs = vec![
            ChatMessage::new("user", "Weather?"),
            a,
            ChatMessage::new("tool", "21C"),
            ChatMessage::new("tool", "sunny"),
        ];
        let out = generic_messages(msgs, Some(&t));
        let roles: Vec<&str> = out.iter().map(|m| m.role.as_str()).collect();
        assert_eq!(roles, ["system", "user", "assistant", "user"]);
        assert!(out[0].content.contains("\"name\": \"get_weather\""));
        assert_eq!(out[2].content, text);
        assert_eq!(
            out[3].content,
            "<tool_response>\n21C\n</tool_response>\n<tool_response>\nsunny\n</tool_response>"
        );
        let e = assistant_calls(
            &json!([{"function": {"name": "f", "arguments": "{"}}]),
            "messages[1].tool_calls",
        )
        .unwrap_err();
        assert_eq!(
            e.body()["error"]["param"],
            "messages[1].tool_calls[0].function.arguments"
        );
    }
}
