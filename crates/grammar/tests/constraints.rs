//! The llguidance-backed compiler over the default model's real
//! vocabulary: masks let through exactly what the constraint allows,
//! commits track it to completion, and bad constraints are refused with a
//! message.

use flotilla_exec::Constraint;
use flotilla_exec::constraint::allowed;
use flotilla_gguf::GgufFile;
use flotilla_text::TextSide;

/// An object of a name and an age, nothing else.
const NAME_AGE: &str = r#"{"type":"object","properties":{"name":{"type":"string"},"age":{"type":"integer"}},"required":["name","age"],"additionalProperties":false}"#;

fn text() -> TextSide {
    let g = GgufFile::open(&flotilla_hub::test_model_path()).unwrap();
    TextSide::from_gguf(&g).unwrap()
}

/// Greedily spells `want` with the longest allowed token at each step
/// (as a model that wants this text would), committing each; returns the
/// tokens and whether the constraint said it was complete after the last.
fn spell(c: &mut dyn flotilla_exec::TokenConstraint, t: &TextSide, want: &str) -> (Vec<u32>, bool) {
    let mut rest = want.as_bytes();
    let mut toks = Vec::new();
    let mut words = Vec::new();
    let mut done = false;
    while !rest.is_empty() {
        c.allowed(&mut words);
        let best = (0..t.tokenizer.vocab_size() as u32)
            .filter(|&id| allowed(&words, id))
            .filter_map(|id| {
                let b = t.tokenizer.token_bytes(id)?;
                (!b.is_empty() && rest.starts_with(b)).then_some((b.len(), id))
            })
            .max()
            .unwrap_or_else(|| {
                panic!(
                    "no allowed token spells {:?}",
                    String::from_utf8_lossy(rest)
                )
            });
        rest = &rest[best.0..];
        toks.push(best.1);
        done = c.commit(best.1).unwrap();
    }
    (toks, done)
}

#[test]
fn a_regex_allows_only_its_language_and_ends_when_complete() {
    let t = text();
    let c = flotilla_grammar::compiler_for(&t).unwrap();
    let mut m = c.compile(&Constraint::Regex("[0-9]{3}".into())).unwrap();
    let mut words = Vec::new();
    m.allowed(&mut words);
    let n = t.tokenizer.vocab_size() as u32;
    let ok: Vec<u32> = (0..n).filter(|&id| allowed(&words, id)).collect();
    assert!(!ok.is_empty());
    for &id in &ok {
        let b = t.tokenizer.token_bytes(id).unwrap();
        assert!(
            !b.is_empty() && b.len() <= 3 && b.iter().all(u8::is_ascii_digit),
            "token {id} {:?} allowed",
            String::from_utf8_lossy(b)
        );
    }
    let (_, done) = spell(m.as_mut(), &t, "123");
    assert!(done, "three digits complete the regex");
}

#[test]
fn a_json_schema_is_followed_to_the_end_and_only_eos_may_follow() {
    let t = text();
    let c = flotilla_grammar::compiler_for(&t).unwrap();
    let schema = NAME_AGE;
    let mut m = c.compile(&Constraint::JsonSchema(schema.into())).unwrap();
    // A property the schema does not have is not allowed to start.
    let mut words = Vec::new();
    m.allowed(&mut words);
    let (_, done) = spell(m.as_mut(), &t, r#"{"name":"Ada","age":36}"#);
    assert!(done, "the closing brace completes the object");
    let mut m = c.compile(&Constraint::JsonSchema(schema.into())).unwrap();
    let (toks, done) = spell(m.as_mut(), &t, r#"{"name":"Ada","#);
    assert!(!done && !toks.is_empty());
    m.allowed(&mut words);
    let eos = t.stop_tokens[0];
    assert!(!allowed(&words, eos), "an unfinished object cannot end");
    let bad = (0..t.tokenizer.vocab_size() as u32)
        .find(|&id| t.tokenizer.token_bytes(id) == Some(b"}".as_slice()))
        .unwrap();
    assert!(!allowed(&words, bad), "'}}' before the required age");
    assert!(
        m.commit(bad).is_err(),
        "a token outside the mask is an error"
    );
}

#[test]
fn bad_constraints_are_refused_with_a_message() {
    let t = text();
    let c = flotilla_grammar::compiler_for(&t).unwrap();
    for (bad, says) in [
        (Constraint::JsonSchema("{not json".into()), "not JSON"),
        (Constraint::JsonSchema("3".into()), "object or a boolean"),
        (
            Constraint::JsonSchema(r#"{"type":"no-such-type"}"#.into()),
            "",
        ),
        (Constraint::Regex("(unclosed".into()), ""),
        (Constraint::Lark("start: undefined_rule".into()), ""),
        (
            Constraint::JsonSchema(format!("\"{}\"", "x".repeat(70_000))),
            "at most",
        ),
    ] {
        let e = c
            .compile(&bad)
            .err()
            .unwrap_or_else(|| panic!("{bad:?} compiled"));
        assert!(!e.is_empty() && e.contains(says), "{bad:?}: {e}");
    }
    // JSON object mode compiles.
    assert!(c.compile(&Constraint::JsonObject).is_ok());
}

#[test]
fn a_required_tool_call_follows_a_listed_function_and_its_parameters() {
    let t = text();
    let c = flotilla_grammar::compiler_for(&t).unwrap();
    let body = serde_json::json!({
        "tools": [{"type": "function", "function": {"name": "get_weather",
            "parameters": {"type": "object", "properties": {
                "city": {"type": "string"}, "unit": {"enum": ["C", "F"]}},
                "required": ["city", "unit"]}}},
            {"type": "function", "function": {"name": "get_time"}}],
        "tool_choice": "required", "parallel_tool_calls": true});
    let tools = flotilla_gateway::tools::parse(body.as_object().unwrap())
        .unwrap()
        .unwrap();
    let grammar = tools.constraint().unwrap();
    let call = "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": \
                {\"city\":\"Oslo\",\"unit\":\"C\"}}\n</tool_call>";
    let mut m = c.compile(&grammar).unwrap();
    let (_, done) = spell(m.as_mut(), &t, call);
    assert!(!done, "parallel calls: another may follow");
    // End-of-sequence may end it now, or a second call follow.
    let eos = t.tokenizer.eos().unwrap();
    let mut words = Vec::new();
    m.allowed(&mut words);
    assert!(allowed(&words, eos));
    let (_, done) = spell(
        m.as_mut(),
        &t,
        "\n<tool_call>\n{\"name\": \"get_time\", \"arguments\": {}}\n</tool_call>",
    );
    assert!(!done);
    assert!(
        m.commit(eos).unwrap(),
        "end-of-sequence completes the calls"
    );

    // One call only: complete at its closing tag.
    let mut one = tools.clone();
    one.parallel = false;
    let mut m = c.compile(&one.constraint().unwrap()).unwrap();
    let (_, done) = spell(m.as_mut(), &t, call);
    assert!(done, "a single call is complete at </tool_call>");

    // Neither a function that is not listed, nor an argument the schema
    // does not allow, nor text before the call may be written.
    for (prefix, bad) in [
        ("<tool_call>\n{\"name\": \"get_", "date"),
        (
            "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\":\"Oslo\",\"unit\":\"",
            "K",
        ),
        ("", "Sure"),
    ] {
        let mut m = c.compile(&grammar).unwrap();
        spell(m.as_mut(), &t, prefix);
        m.allowed(&mut words);
        let n = t.tokenizer.vocab_size() as u32;
        let spelt = (0..n).filter(|&id| allowed(&words, id)).any(|id| {
            t.tokenizer
                .token_bytes(id)
                .is_some_and(|b| !b.is_empty() && bad.as_bytes().starts_with(b))
        });
        assert!(!spelt, "{bad:?} may not follow {prefix:?}");
    }
}

/// A token the constraint allows next that begins with a digit.
fn digit_allowed(c: &mut dyn flotilla_exec::TokenConstraint, t: &TextSide) -> Option<u32> {
    let mut words = Vec::new();
    c.allowed(&mut words);
    (0..t.tokenizer.vocab_size() as u32)
        .filter(|&id| allowed(&words, id))
        .find(|&id| {
            t.tokenizer
                .token_bytes(id)
                .and_then(|b| b.first())
                .is_some_and(u8::is_ascii_digit)
        })
}

#[test]
fn numbers_without_bounds_of_their_own_have_bounded_digits() {
    // (flotilla_gateway::openai::bound_numbers, compiled here by llguidance)
    let t = text();
    let c = flotilla_grammar::compiler_for(&t).unwrap();
    let mut schema = serde_json::json!({"type": "object", "properties": {
        "x": {"type": "number"}, "n": {"type": "integer"},
        "m": {"type": "number", "multipleOf": 0.5}},
        "required": ["x", "n", "m"], "additionalProperties": false});
    // As the gateway passes every schema on.
    flotilla_gateway::openai::bound_numbers(&mut schema);
    let schema = schema.to_string();
    let fresh = || c.compile(&Constraint::JsonSchema(schema.clone())).unwrap();
    let (_, done) = spell(fresh().as_mut(), &t, r#"{"x":-1000.125,"n":42,"m":2.5}"#);
    assert!(done);
    // Six digits after the point, then no seventh.
    let mut m = fresh();
    spell(m.as_mut(), &t, r#"{"x":1000.000000"#);
    let digit = digit_allowed(m.as_mut(), &t);
    assert_eq!(digit, None, "a seventh fraction digit is allowed");
    // Sixteen digits before the point at most.
    let mut m = fresh();
    spell(m.as_mut(), &t, r#"{"x":1,"n":1000000000000000"#);
    let digit = digit_allowed(m.as_mut(), &t);
    assert_eq!(digit, None, "an integer of 16 digits may grow");
    // A schema's own multipleOf and bounds are its own.
    let (_, done) = spell(fresh().as_mut(), &t, r#"{"x":0.5,"n":-7,"m":1.5}"#);
    assert!(done);
}

#[test]
fn a_draft_s_masks_follow_the_draft_and_leave_the_matcher_as_it_was() {
    let t = text();
    let c = flotilla_grammar::compiler_for(&t).unwrap();
    let schema = NAME_AGE;
    // The tokens of a whole valid output, spelled on a scratch matcher.
    let mut scratch = c.compile(&Constraint::JsonSchema(schema.into())).unwrap();
    let (toks, done) = spell(scratch.as_mut(), &t, r#"{"name":"Ada","age":36}"#);
    assert!(done);
    let mut m = c.compile(&Constraint::JsonSchema(schema.into())).unwrap();
    for &tok in &toks[..2] {
        assert_eq!(m.commit(tok), Ok(false));
    }
    // Each row is the mask a matcher that took the draft so far gives.
    let draft = &toks[2..6];
    let mut rows = Vec::new();
    m.draft_allowed(draft, &mut rows);
    assert_eq!(rows.len(), draft.len() + 1);
    let mut follow = c.compile(&Constraint::JsonSchema(schema.into())).unwrap();
    for &tok in &toks[..2] {
        follow.commit(tok).unwrap();
    }
    let mut words = Vec::new();
    for (r, row) in rows.iter().enumerate() {
        follow.allowed(&mut words);
        assert_eq!(row, &words, "row {r}");
        if r < draft.len() {
            follow.commit(draft[r]).unwrap();
        }
    }
    // A refused token ends the rows: one the second row does not allow.
    let refused = (0..t.tokenizer.vocab_size() as u32)
        .find(|&id| !allowed(&rows[1], id))
        .unwrap();
    m.draft_allowed(&[toks[2], refused, toks[4]], &mut rows);
    assert_eq!(
        rows.len(),
        2,
        "rows for the start and after the first token only"
    );
    // The matcher is where it was: the rest of the output still completes it.
    for &tok in &toks[2..toks.len() - 1] {
        assert_eq!(m.commit(tok), Ok(false));
    }
    // A draft that completes the output has no row after its last token.
    let last = *toks.last().unwrap();
    m.draft_allowed(&[last, last], &mut rows);
    assert_eq!(rows.len(), 1);
    assert_eq!(m.commit(last), Ok(true));
}

#[test]
fn a_grammar_s_forced_tokens_are_drafted_and_the_matcher_is_unchanged() {
    let t = text();
    let c = flotilla_grammar::compiler_for(&t).unwrap();
    // After `{"name":"Ada",` the schema forces `"age":`.
    let schema = NAME_AGE;
    let mut m = c.compile(&Constraint::JsonSchema(schema.into())).unwrap();
    let (_, done) = spell(m.as_mut(), &t, r#"{"name":"Ada","#);
    assert!(!done);
    let mut forced = Vec::new();
    m.forced(16, &mut forced);
    let text: Vec<u8> = forced
        .iter()
        .flat_map(|&id| t.tokenizer.token_bytes(id).unwrap().to_vec())
        .collect();
    assert!(
        String::from_utf8_lossy(&text).starts_with("\"age"),
        "forced {:?}",
        String::from_utf8_lossy(&text)
    );
    // At most `max`; and the matcher still takes the forced tokens.
    let mut one = Vec::new();
    m.forced(1, &mut one);
    assert_eq!(one, forced[..1]);
    for &tok in &forced {
        assert_eq!(m.commit(tok), Ok(false));
    }
    // Inside a free string nothing is forced.
    let mut m = c.compile(&Constraint::JsonSchema(schema.into())).unwrap();
    spell(m.as_mut(), &t, r#"{"name":"A"#);
    m.forced(16, &mut forced);
    assert!(forced.is_empty(), "forced {forced:?}");
}
