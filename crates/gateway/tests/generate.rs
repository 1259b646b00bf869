//! Generation over HTTP: chat and completions, streaming and not, stop
//! strings, log-probabilities, and cancellation on client disconnect.

mod common;

use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use common::*;
use flotilla_config::ClusterConfig;
use flotilla_proto::Constraint;
use flotilla_proto::FinishReason;
use serde_json::{Value, json};

#[tokio::test]
async fn chat_non_streaming_returns_the_decoded_tokens_and_usage() {
    let s = serve(ClusterConfig::open()).await;
    let (st, v) = s.post("/v1/chat/completions", &chat_body(json!({}))).await;
    assert_eq!(st, 200, "{v}");
    assert_eq!(v["object"], "chat.completion");
    assert_eq!(v["model"], MODEL);
    assert_eq!(v["choices"][0]["message"]["role"], "assistant");
    assert_eq!(v["choices"][0]["message"]["content"], SCRIPT);
    assert_eq!(v["choices"][0]["finish_reason"], "length");
    let (req, probe) = s.fake.last();
    let n = script_ids().len() as u64;
    assert_eq!(v["usage"]["prompt_tokens"], req.prompt.len() as u64);
    assert_eq!(v["usage"]["completion_tokens"], n);
    assert_eq!(v["usage"]["total_tokens"], req.prompt.len() as u64 + n);
    // The chat template was applied and max_tokens defaults to the room left.
    let prompt = text().tokenizer.decode(&req.prompt, false).unwrap();
    assert!(
        prompt.contains("<|im_start|>user\nSay hi<|im_end|>"),
        "{prompt}"
    );
    assert!(prompt.ends_with("<|im_start|>assistant\n"), "{prompt}");
    assert_eq!(req.max_tokens as usize, MAX_MODEL_LEN - req.prompt.len());
    assert!(probe.dropped.load(Ordering::SeqCst) && !probe.cancelled.load(Ordering::SeqCst));
}

#[tokio::test]
async fn chat_streaming_sends_role_then_tokens_then_finish_usage_done() {
    let s = serve(ClusterConfig::open()).await;
    let body = chat_body(json!({"stream": true, "stream_options": {"include_usage": true}}));
    let (st, data) = s.post_sse("/v1/chat/completions", &body).await;
    assert_eq!(st, 200);
    let chunks = parse_chunks(&data);
    assert!(
        chunks
            .iter()
            .all(|c| c["object"] == "chat.completion.chunk")
    );
    assert_eq!(chunks[0]["choices"][0]["delta"]["role"], "assistant");
    let content: String = chunks
        .iter()
        .filter_map(|c| c["choices"][0]["delta"]["content"].as_str())
        .collect();
    assert_eq!(content, SCRIPT);
    let n = script_ids().len();
    // role chunk + one per token + finish + usage
    assert_eq!(chunks.len(), n + 3, "{chunks:#?}");
    let fin = &chunks[chunks.len() - 2];
    assert_eq!(fin["choices"][0]["finish_reason"], "length");
    let usage = &chunks[chunks.len() - 1];
    assert_eq!(usage["choices"], json!([]));
    assert_eq!(usage["usage"]["completion_tokens"], n as u64);
    let (req, _) = s.fake.last();
    assert_eq!(usage["usage"]["prompt_tokens"], req.prompt.len() as u64);
}

#[tokio::test]
async fn completions_streaming_and_not() {
    let s = serve(ClusterConfig::open()).await;
    let body = json!({"prompt": "Once upon a time", "max_tokens": 16, "temperature": 0.7,
                      "top_p": 0.9, "top_k": 40, "seed": 7, "ignore_eos": true, "user": "u-1",
                      "presence_penalty": 0.5, "frequency_penalty": -1.5,
                      "logit_bias": {"17": 100, "3": -2.5}});
    let (st, v) = s.post("/v1/completions", &body).await;
    assert_eq!(st, 200, "{v}");
    assert_eq!(v["object"], "text_completion");
    assert_eq!(v["choices"][0]["text"], SCRIPT);
    assert_eq!(v["choices"][0]["finish_reason"], "length");
    assert_eq!(v["choices"][0]["logprobs"], Value::Null);
    let (req, _) = s.fake.last();
    assert_eq!(
        req.prompt,
        text().tokenizer.encode("Once upon a time", true).unwrap()
    );
    assert_eq!(req.max_tokens, 16);
    assert_eq!((req.sampling.temperature, req.sampling.top_p), (0.7, 0.9));
    assert_eq!((req.sampling.top_k, req.sampling.seed), (40, 7));
    assert_eq!(
        (
            req.sampling.presence_penalty,
            req.sampling.frequency_penalty
        ),
        (0.5, -1.5)
    );
    assert_eq!(req.logit_bias, vec![(3, -2.5), (17, 100.0)]);
    assert_eq!(req.constraint, None);
    assert!(req.ignore_eos);

    // Output constraints reach the engine as they were asked for; strict
    // schemas with their objects closed, as OpenAI's strict mode has them.
    let schema = json!({"type": "object", "properties": {"a": {"type": "integer"}}});
    let closed = json!({"type": "object", "properties": {"a": {"type": "integer"}},
                        "additionalProperties": false});
    let nested = json!({"$defs": {"p": {"properties": {"x": {"type": "integer"}}}},
                        "type": "array", "items": {"$ref": "#/$defs/p"}});
    let nested_closed = json!({"$defs": {"p": {"properties": {"x": {"type": "integer"}},
                                               "additionalProperties": false}},
                               "type": "array", "items": {"$ref": "#/$defs/p"}});
    // Numbers' digits bounded, as the gateway passes every schema on.
    let bounded = |mut v: Value| {
        flotilla_gateway::openai::bound_numbers(&mut v);
        v
    };
    let (closed, nested_closed) = (bounded(closed), bounded(nested_closed));
    let plain = bounded(schema.clone());
    assert_eq!(
        plain["properties"]["a"]["maximum"],
        1_000_000_000_000_000i64
    );
    for (extra, want) in [
        (
            json!({"response_format": {"type": "json_schema",
                   "json_schema": {"name": "x", "schema": schema, "strict": true}}}),
            Some(Constraint::JsonSchema(closed.to_string())),
        ),
        (
            json!({"response_format": {"type": "json_schema",
                   "json_schema": {"name": "x", "schema": schema}}}),
            Some(Constraint::JsonSchema(plain.to_string())),
        ),
        (
            json!({"response_format": {"type": "json_schema",
                   "json_schema": {"name": "x", "schema": nested, "strict": true}}}),
            Some(Constraint::JsonSchema(nested_closed.to_string())),
        ),
        (
            json!({"response_format": {"type": "json_object"}}),
            Some(Constraint::JsonObject),
        ),
        (json!({"response_format": {"type": "text"}}), None),
        (
            json!({"guided_json": schema}),
            Some(Constraint::JsonSchema(plain.to_string())),
        ),
        (
            json!({"guided_regex": "[0-9]{3}"}),
            Some(Constraint::Regex("[0-9]{3}".into())),
        ),
        (
            json!({"guided_grammar": "start: \"a\"+"}),
            Some(Constraint::Lark("start: \"a\"+".into())),
        ),
    ] {
        let mut body = json!({"prompt": "x", "max_tokens": 4});
        body.as_object_mut()
            .unwrap()
            .extend(extra.as_object().unwrap().clone());
        let (st, v) = s.post("/v1/completions", &body).await;
        assert_eq!(st, 200, "{v}");
        assert_eq!(s.fake.last().0.constraint, want, "{extra}");
    }

    let body = json!({"prompt": [[1, 2, 3]], "max_tokens": 16, "stream": true});
    let (st, data) = s.post_sse("/v1/completions", &body).await;
    assert_eq!(st, 200);
    let chunks = parse_chunks(&data);
    let text: String = chunks
        .iter()
        .map(|c| c["choices"][0]["text"].as_str().unwrap())
        .collect();
    assert_eq!(text, SCRIPT);
    assert!(chunks.iter().all(|c| c["object"] == "text_completion"));
    assert_eq!(
        chunks.last().unwrap()["choices"][0]["finish_reason"],
        "length"
    );
    assert_eq!(s.fake.last().0.prompt, vec![1, 2, 3]);

    // Requests without a seed get different ones.
    s.post("/v1/completions", &json!({"prompt": "a", "max_tokens": 2}))
        .await;
    let a = s.fake.last().0.sampling.seed;
    s.post("/v1/completions", &json!({"prompt": "a", "max_tokens": 2}))
        .await;
    assert_ne!(a, s.fake.last().0.sampling.seed);
}

#[tokio::test]
async fn stop_string_truncates_and_cancels_the_engine_request() {
    let s = serve(ClusterConfig::open()).await;
    // Finish far past the stop string, so a cancel is visible.
    let mut ids = script_ids();
    ids.extend(
        text()
            .tokenizer
            .encode(" and more and more and more", false)
            .unwrap(),
    );
    s.fake.set(Mode::Script(ids, FinishReason::Length));

    let (st, v) = s
        .post(
            "/v1/chat/completions",
            &chat_body(json!({"stop": ["zzz", "d. T"]})),
        )
        .await;
    assert_eq!(st, 200, "{v}");
    assert_eq!(v["choices"][0]["message"]["content"], " Hello worl");
    assert_eq!(v["choices"][0]["finish_reason"], "stop");
    assert!(s.fake.last().1.cancelled.load(Ordering::SeqCst));
    assert!(
        s.fake.last().1.stop_string.load(Ordering::SeqCst),
        "a stop-string end must reach the engine as such, not as a disconnect"
    );

    let body = json!({"prompt": "x", "max_tokens": 64, "stop": ".", "stream": true,
                      "stream_options": {"include_usage": true}});
    let (st, data) = s.post_sse("/v1/completions", &body).await;
    assert_eq!(st, 200);
    let chunks = parse_chunks(&data);
    let text: String = chunks
        .iter()
        .filter_map(|c| {
            c["choices"]
                .get(0)
                .map(|ch| ch["text"].as_str().unwrap().to_owned())
        })
        .collect();
    assert_eq!(text, " Hello world");
    assert_eq!(
        chunks[chunks.len() - 2]["choices"][0]["finish_reason"],
        "stop"
    );
    let probe = s.fake.last().1;
    assert!(probe.cancelled.load(Ordering::SeqCst));
    // Usage counts the tokens generated up to the stop.
    let used = chunks.last().unwrap()["usage"]["completion_tokens"]
        .as_u64()
        .unwrap();
    assert!((3..=4).contains(&used), "{used}");
}

#[tokio::test]
async fn logprobs_in_openai_shapes() {
    let s = serve(ClusterConfig::open()).await;
    let n = script_ids().len();
    let (st, v) = s
        .post(
            "/v1/chat/completions",
            &chat_body(json!({"logprobs": true, "top_logprobs": 2})),
        )
        .await;
    assert_eq!(st, 200, "{v}");
    let content = v["choices"][0]["logprobs"]["content"].as_array().unwrap();
    assert_eq!(content.len(), n);
    let joined: String = content
        .iter()
        .map(|t| t["token"].as_str().unwrap())
        .collect();
    assert_eq!(joined, SCRIPT);
    for t in content {
        assert_eq!(t["logprob"], -0.25);
        let bytes: Vec<u8> = serde_json::from_value(t["bytes"].clone()).unwrap();
        assert_eq!(bytes, t["token"].as_str().unwrap().as_bytes());
        let top = t["top_logprobs"].as_array().unwrap();
        assert_eq!(top.len(), 2);
        assert_eq!(top[0]["token"], t["token"]);
        assert_eq!(top[1]["logprob"], -1.5);
        assert!(top[1]["bytes"].is_array());
    }
    let (req, _) = s.fake.last();
    assert!(req.sampling.logprobs && req.sampling.top_logprobs == 2);

    let (st, v) = s
        .post(
            "/v1/completions",
            &json!({"prompt": "hi", "max_tokens": 20, "logprobs": 1}),
        )
        .await;
    assert_eq!(st, 200, "{v}");
    let lp = &v["choices"][0]["logprobs"];
    assert_eq!(lp["tokens"].as_array().unwrap().len(), n);
    assert_eq!(lp["token_logprobs"][0], -0.25);
    let top0 = lp["top_logprobs"][0].as_object().unwrap();
    assert_eq!(top0.len(), 1);
    assert_eq!(top0[lp["tokens"][0].as_str().unwrap()], -0.25);
    assert_eq!(lp["text_offset"][0], 0);
    assert_eq!(
        lp["text_offset"][1],
        lp["tokens"][0].as_str().unwrap().chars().count()
    );

    // Streaming chat carries the logprobs of each token in its chunk.
    let (_, data) = s
        .post_sse(
            "/v1/chat/completions",
            &chat_body(json!({"logprobs": true, "stream": true})),
        )
        .await;
    let chunks = parse_chunks(&data);
    let with_lp = chunks
        .iter()
        .filter(|c| c["choices"][0]["logprobs"]["content"].is_array())
        .count();
    assert_eq!(with_lp, n);
}

#[tokio::test]
async fn client_disconnect_drops_the_request_stream() {
    let s = serve(ClusterConfig::open()).await;
    s.fake.set(Mode::Hang(script_ids()[..2].to_vec()));

    let mut r = s
        .http
        .post(format!("{}/v1/chat/completions", s.base))
        .json(&chat_body(json!({"stream": true})))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status().as_u16(), 200);
    let first = r.chunk().await.unwrap().unwrap();
    assert!(first.starts_with(b"data: "));
    let probe = s.fake.last().1;
    tokio::time::sleep(Duration::from_millis(50)).await;
    assert!(
        !probe.dropped.load(Ordering::SeqCst),
        "dropped while the client listens"
    );
    drop(r);
    assert!(
        wait_dropped(&probe).await,
        "streaming: the engine never saw the cancel"
    );
    assert!(probe.cancelled.load(Ordering::SeqCst));

    // Not streaming: the client gives up while it waits for the body.
    let http = s.http.clone();
    let url = format!("{}/v1/completions", s.base);
    let call = tokio::spawn(async move {
        http.post(url)
            .json(&json!({"prompt": "hi", "max_tokens": 8}))
            .send()
            .await
    });
    let t0 = Instant::now();
    while s.fake.count() < 2 && t0.elapsed() < Duration::from_secs(5) {
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let probe = s.fake.last().1;
    tokio::time::sleep(Duration::from_millis(50)).await;
    call.abort();
    assert!(
        wait_dropped(&probe).await,
        "non-streaming: the engine never saw the cancel"
    );
}

fn weather_tools() -> Value {
    json!([{"type": "function", "function": {"name": "get_weather",
        "description": "Current weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                       "required": ["city"]}}},
           {"type": "function", "function": {"name": "get_time"}}])
}

#[tokio::test]
async fn tool_calls_in_openai_shapes_streamed_and_not() {
    let s = serve(ClusterConfig::open()).await;
    let said = "Checking.\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \
                \"Paris\"}}\n</tool_call>\n<tool_call>\n{\"name\": \"get_time\", \"arguments\": \
                {}}\n</tool_call>";
    let ids = text().tokenizer.encode(said, false).unwrap();
    s.fake.set(Mode::Script(ids.clone(), FinishReason::Stop));
    let body = chat_body(json!({"tools": weather_tools()}));
    let (st, v) = s.post("/v1/chat/completions", &body).await;
    assert_eq!(st, 200, "{v}");
    let choice = &v["choices"][0];
    assert_eq!(choice["finish_reason"], "tool_calls", "{v}");
    assert_eq!(choice["message"]["content"], "Checking.");
    let calls = choice["message"]["tool_calls"].as_array().unwrap();
    assert_eq!(calls.len(), 2, "{v}");
    assert_eq!(calls[0]["type"], "function");
    assert_eq!(calls[0]["function"]["name"], "get_weather");
    assert_eq!(calls[0]["function"]["arguments"], "{\"city\": \"Paris\"}");
    assert_eq!(calls[1]["function"]["name"], "get_time");
    assert!(calls[0]["id"].as_str().unwrap().starts_with("call_"));
    assert_ne!(calls[0]["id"], calls[1]["id"]);
    assert_eq!(v["usage"]["completion_tokens"], ids.len() as u64);
    // auto: nothing constrains the model; a template without a tool format
    // gets the tools and the format in its system prompt.
    let (req, _) = s.fake.last();
    assert_eq!(req.constraint, None);
    let prompt = text().tokenizer.decode(&req.prompt, false).unwrap();
    assert!(
        prompt.starts_with("<|im_start|>system\n# Tools\n") && prompt.contains("\"get_weather\""),
        "{prompt}"
    );

    // Streamed: a start chunk per call (id, name, empty arguments), then
    // argument pieces that join to the arguments.
    let mut sbody = body.clone();
    sbody["stream"] = json!(true);
    let (st, data) = s.post_sse("/v1/chat/completions", &sbody).await;
    assert_eq!(st, 200);
    let chunks = parse_chunks(&data);
    let mut content = String::new();
    let mut streamed: Vec<(String, String, String)> = Vec::new();
    for c in &chunks {
        let d = &c["choices"][0]["delta"];
        content.push_str(d["content"].as_str().unwrap_or(""));
        for tc in d["tool_calls"].as_array().into_iter().flatten() {
            let i = tc["index"].as_u64().unwrap() as usize;
            if let Some(id) = tc["id"].as_str() {
                assert_eq!(i, streamed.len());
                assert_eq!(tc["function"]["arguments"], "");
                let name = tc["function"]["name"].as_str().unwrap().to_owned();
                streamed.push((id.to_owned(), name, String::new()));
            } else {
                assert!(tc.get("id").is_none() && tc["function"].get("name").is_none());
                streamed[i]
                    .2
                    .push_str(tc["function"]["arguments"].as_str().unwrap());
            }
        }
    }
    assert_eq!(content, "Checking.");
    let want: Vec<(String, String, String)> = calls
        .iter()
        .map(|c| {
            let f = &c["function"];
            let s = |v: &Value| v.as_str().unwrap().to_owned();
            (s(&c["id"]), s(&f["name"]), s(&f["arguments"]))
        })
        .collect();
    let names_args = |v: &[(String, String, String)]| -> Vec<(String, String)> {
        v.iter().map(|(_, n, a)| (n.clone(), a.clone())).collect()
    };
    assert_eq!(names_args(&streamed), names_args(&want));
    // Argument pieces arrive as tokens do, not in one piece at the end.
    let pieces = chunks
        .iter()
        .filter(|c| c["choices"][0]["delta"]["tool_calls"][0]["function"]["arguments"] != "")
        .filter(|c| !c["choices"][0]["delta"]["tool_calls"].is_null())
        .count();
    assert!(pieces > 4, "{pieces} argument chunks");
    let fin = &chunks[chunks.len() - 1];
    assert_eq!(fin["choices"][0]["finish_reason"], "tool_calls");

    // parallel_tool_calls false: the request ends after the first call.
    let mut one = body.clone();
    one["parallel_tool_calls"] = json!(false);
    let (st, v) = s.post("/v1/chat/completions", &one).await;
    assert_eq!(st, 200, "{v}");
    assert_eq!(
        v["choices"][0]["message"]["tool_calls"]
            .as_array()
            .unwrap()
            .len(),
        1
    );
    assert!(s.fake.last().1.stop_string.load(Ordering::SeqCst));

    // A call of a function that was not listed stays text.
    let rogue = "<tool_call>\n{\"name\": \"rm\", \"arguments\": {}}\n</tool_call>";
    s.fake.set(Mode::Script(
        text().tokenizer.encode(rogue, false).unwrap(),
        FinishReason::Stop,
    ));
    let (_, v) = s.post("/v1/chat/completions", &body).await;
    assert_eq!(v["choices"][0]["message"]["content"], rogue);
    assert!(v["choices"][0]["message"].get("tool_calls").is_none());
    assert_eq!(v["choices"][0]["finish_reason"], "stop");

    // required and a named function constrain generation to call blocks;
    // none leaves the tools out.
    for (choice, grammar) in [
        (json!("required"), Some("get_time")),
        (
            json!({"type": "function", "function": {"name": "get_weather"}}),
            None,
        ),
        (json!("none"), None),
    ] {
        let mut b = body.clone();
        b["tool_choice"] = choice.clone();
        let (st, v) = s.post("/v1/chat/completions", &b).await;
        assert_eq!(st, 200, "{v}");
        let (req, _) = s.fake.last();
        let prompt = text().tokenizer.decode(&req.prompt, false).unwrap();
        match (&req.constraint, choice.as_str()) {
            (None, Some("none")) => assert!(!prompt.contains("# Tools"), "{prompt}"),
            (Some(Constraint::Lark(g)), _) => {
                assert!(
                    g.contains("get_weather") && prompt.contains("# Tools"),
                    "{g}"
                );
                assert_eq!(grammar.is_some_and(|n| g.contains(n)), grammar.is_some());
                if grammar.is_none() {
                    assert!(!g.contains("get_time"), "{g}");
                }
            }
            other => panic!("{choice}: {other:?}"),
        }
    }

    // The next turn: the assistant's calls and the tool's answers render
    // in the prompt (as text and user turns for this template).
    let turn = json!({"messages": [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": null, "tool_calls": [{"id": "call_1",
         "type": "function", "function": {"name": "get_weather",
         "arguments": "{\"city\":\"Paris\"}"}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "21 C, sunny"}],
        "max_tokens": 8});
    let (st, v) = s.post("/v1/chat/completions", &turn).await;
    assert_eq!(st, 200, "{v}");
    let prompt = text()
        .tokenizer
        .decode(&s.fake.last().0.prompt, false)
        .unwrap();
    assert!(
        prompt.contains(
            "<|im_start|>assistant\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": \
             {\"city\": \"Paris\"}}\n</tool_call><|im_end|>\n<|im_start|>user\n<tool_response>\n\
             21 C, sunny\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
        ),
        "{prompt}"
    );
}
