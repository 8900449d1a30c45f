//! The conversation of an OpenAI Responses or Anthropic Messages body as OpenAI chat `messages`,
//! so the prompt goes through the same chat template (or, without a tokenizer, the same
//! approximate blocks) as a chat completion: the engines turn these formats into chat messages
//! before their template too, so the blocks kvepp hashes are the ones their prefix caches hold.
//!
//! What becomes what:
//! - the system prompt (Responses `instructions`, Anthropic `system`: a string or text blocks)
//!   is a first `system` message;
//! - Anthropic `messages` keep their roles; content blocks become their text, joined;
//! - Responses `input`: a string is one `user` message; items with a `role` keep it (their
//!   `input_text` / `output_text` parts joined), other items (tool calls and their outputs) are
//!   kept as their JSON text in a `user` message, so they still shape the prefix;
//! - a block that carries no text (an image, a tool use) is kept as its JSON text.
//!
//! Invariant: the result depends only on the body's values, never on its formatting, so two
//! turns of a conversation share the messages' leading bytes exactly as they share messages.

use kvepp_request::{Format, RawJson, RawMessages, RawPrompt};
use serde_json::{json, Value};

/// The chat `messages` JSON of a body in `format` (Responses or Messages); None for the other
/// formats, or when the body's conversation is not what the format defines (it is then routed
/// on its raw bytes).
pub(crate) fn chat_messages(
    format: Format,
    system: Option<RawJson<'_>>,
    messages: Option<&RawMessages<'_>>,
    input: Option<&RawPrompt<'_>>,
) -> Option<String> {
    let mut out = Vec::new();
    if let Some(s) = system {
        let v: Value = serde_json::from_str(s.get()).ok()?;
        out.push(json!({"role": "system", "content": text_of(&v)}));
    }
    match format {
        Format::Messages => {
            let v: Value = serde_json::from_slice(messages?.text).ok()?;
            for m in v.as_array()? {
                out.push(json!({"role": m.get("role")?.as_str()?, "content": text_of(m.get("content")?)}));
            }
        }
        Format::Responses => {
            let Some(RawPrompt::Json(raw)) = input else {
                return None;
            };
            match serde_json::from_str::<Value>(raw.get()).ok()? {
                Value::String(s) => out.push(json!({"role": "user", "content": s})),
                Value::Array(items) => {
                    for item in &items {
                        match (
                            item.get("role").and_then(Value::as_str),
                            item.get("content"),
                        ) {
                            (Some(role), Some(c)) => {
                                out.push(json!({"role": role, "content": text_of(c)}))
                            }
                            _ => out.push(json!({"role": "user", "content": item.to_string()})),
                        }
                    }
                }
                _ => return None,
            }
        }
        _ => return None,
    }
    serde_json::to_string(&out).ok()
}

/// The text of a content value: a string as it is; an array of blocks as their texts joined
/// (a block without text as its JSON); anything else as its JSON.
fn text_of(v: &Value) -> String {
    match v {
        Value::String(s) => s.clone(),
        Value::Array(blocks) => blocks
            .iter()
            .map(|b| match b.get("text").and_then(Value::as_str) {
                Some(t) => t.to_owned(),
                None => b.to_string(),
            })
            .collect(),
        other => other.to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use bytes::Bytes;
    use kvepp_request::{parse_body_as, KnownArrays};

    fn normalized(format: Format, body: &str) -> Option<Value> {
        let body = Bytes::from(body.to_owned());
        let arrays = KnownArrays::default();
        let p = parse_body_as(&body, format, None, &arrays).unwrap();
        chat_messages(format, p.system, p.messages.as_ref(), p.prompt.as_ref())
            .map(|s| serde_json::from_str(&s).unwrap())
    }

    #[test]
    fn anthropic_messages_with_system_and_blocks() {
        let v = normalized(
            Format::Messages,
            r#"{"model":"m","max_tokens":5,"system":[{"type":"text","text":"Be brief."}],
               "messages":[{"role":"user","content":[{"type":"text","text":"Hi "},{"type":"text","text":"there"}]},
                           {"role":"assistant","content":"Hello"}]}"#,
        )
        .unwrap();
        assert_eq!(
            v,
            json!([{"role":"system","content":"Be brief."},
                   {"role":"user","content":"Hi there"},
                   {"role":"assistant","content":"Hello"}])
        );
        // Formatting does not matter: the same values give the same messages.
        let spaced = normalized(
            Format::Messages,
            r#"{ "messages" : [ {"content":"Hello", "role":"user"} ], "model" : "m" }"#,
        );
        let tight = normalized(
            Format::Messages,
            r#"{"model":"m","messages":[{"role":"user","content":"Hello"}]}"#,
        );
        assert_eq!(spaced, tight);
    }

    #[test]
    fn responses_input_as_a_string_or_items() {
        let v = normalized(
            Format::Responses,
            r#"{"model":"m","instructions":"Answer in French.","input":"Bonjour?"}"#,
        )
        .unwrap();
        assert_eq!(
            v,
            json!([{"role":"system","content":"Answer in French."},{"role":"user","content":"Bonjour?"}])
        );
        let v = normalized(
            Format::Responses,
            r#"{"model":"m","input":[{"type":"message","role":"user","content":[{"type":"input_text","text":"2+2?"}]},
                                   {"type":"function_call_output","call_id":"c1","output":"4"}]}"#,
        )
        .unwrap();
        assert_eq!(v[0], json!({"role":"user","content":"2+2?"}));
        assert_eq!(v[1]["role"], "user");
        assert!(v[1]["content"]
            .as_str()
            .unwrap()
            .contains("function_call_output"));
        // Not what the format defines: routed on its raw bytes instead.
        assert!(normalized(Format::Responses, r#"{"model":"m","input":7}"#).is_none());
        assert!(normalized(
            Format::Messages,
            r#"{"model":"m","messages":{"role":"user"}}"#
        )
        .is_none());
    }
}
