//! Zero-copy scan of an OpenAI-style JSON request body.
//!
//! The whole body is validated as JSON (so malformed input is rejected before it reaches a model
//! server), but only the top-level `model` value is materialised: every other value is skipped with
//! `IgnoredAny`. The byte span of the `model` value is kept so a target-model rewrite can splice a
//! new value in without touching the rest of the body.

use std::borrow::Cow;
use std::fmt;
use std::ops::Range;

use serde::de::{self, DeserializeSeed, IgnoredAny, MapAccess, Visitor};
use serde::Deserializer;
use serde_json::value::RawValue;

/// Why a body cannot be routed. Each maps to a 400 answer with this message.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum BodyError {
    #[error("request body is not valid JSON: {0}")]
    Malformed(String),
    #[error("request body must be a JSON object")]
    NotAnObject,
    #[error("request body has no \"model\" field")]
    MissingModel,
    #[error("\"model\" must be a non-empty string")]
    ModelNotString,
}

/// The parts of a body the EPP needs, borrowed from the body bytes.
#[derive(Debug)]
pub struct ParsedBody<'a> {
    /// The model name, unescaped.
    pub model: Cow<'a, str>,
    /// Byte range of the `model` value (including its quotes) in the body.
    pub model_span: Range<usize>,
    /// The raw JSON of `prompt` (completions) and `messages` (chat), borrowed from the body.
    pub prompt: Option<&'a RawValue>,
    pub messages: Option<&'a RawValue>,
}

/// Scans `body` and returns the model name and its location.
pub fn parse_body(body: &[u8]) -> Result<ParsedBody<'_>, BodyError> {
    let mut de = serde_json::Deserializer::from_slice(body);
    let raw = de
        .deserialize_any(TopLevel)
        .map_err(|e| classify(e, body))?;
    de.end().map_err(|e| BodyError::Malformed(e.to_string()))?;
    let Fields {
        model,
        prompt,
        messages,
    } = raw;
    let raw = model.ok_or(BodyError::MissingModel)?;
    let text = raw.get();
    let start = text.as_ptr() as usize - body.as_ptr() as usize;
    let model_span = start..start + text.len();
    let model: Cow<'_, str> = match serde_json::from_str::<&str>(text) {
        Ok(s) => Cow::Borrowed(s),
        Err(_) => {
            Cow::Owned(serde_json::from_str::<String>(text).map_err(|_| BodyError::ModelNotString)?)
        }
    };
    if model.is_empty() {
        return Err(BodyError::ModelNotString);
    }
    Ok(ParsedBody {
        model,
        model_span,
        prompt,
        messages,
    })
}

fn classify(e: serde_json::Error, body: &[u8]) -> BodyError {
    if e.is_data() && body.iter().find(|b| !b.is_ascii_whitespace()) != Some(&b'{') {
        BodyError::NotAnObject
    } else {
        BodyError::Malformed(e.to_string())
    }
}

/// The top-level values kvepp reads, captured raw (no copy). Last one wins, as in Python's `json`
/// module that the engines use.
#[derive(Default)]
struct Fields<'de> {
    model: Option<&'de RawValue>,
    prompt: Option<&'de RawValue>,
    messages: Option<&'de RawValue>,
}

/// The top level of the body: a map.
struct TopLevel;

impl<'de> Visitor<'de> for TopLevel {
    type Value = Fields<'de>;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a JSON object")
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Self::Value, A::Error> {
        let mut fields = Fields::default();
        while let Some(key) = map.next_key_seed(KeyKind::Other)? {
            let slot = match key {
                KeyKind::Model => &mut fields.model,
                KeyKind::Prompt => &mut fields.prompt,
                KeyKind::Messages => &mut fields.messages,
                KeyKind::Other => {
                    map.next_value::<IgnoredAny>()?;
                    continue;
                }
            };
            *slot = Some(map.next_value::<&'de RawValue>()?);
        }
        Ok(fields)
    }
}

/// Which top-level key this is, read without allocating.
#[derive(Clone, Copy)]
enum KeyKind {
    Model,
    Prompt,
    Messages,
    Other,
}

impl<'de> DeserializeSeed<'de> for KeyKind {
    type Value = KeyKind;
    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<KeyKind, D::Error> {
        d.deserialize_str(self)
    }
}

impl<'de> Visitor<'de> for KeyKind {
    type Value = KeyKind;
    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("an object key")
    }
    fn visit_str<E: de::Error>(self, v: &str) -> Result<KeyKind, E> {
        Ok(match v {
            "model" => KeyKind::Model,
            "prompt" => KeyKind::Prompt,
            "messages" => KeyKind::Messages,
            _ => KeyKind::Other,
        })
    }
}

/// A body with its `model` value replaced, as three borrowed/owned parts that are written out in
/// order. Nothing but the model value changes.
#[derive(Debug)]
pub struct Rewrite<'a> {
    pub head: &'a [u8],
    pub model_json: String,
    pub tail: &'a [u8],
}

impl<'a> Rewrite<'a> {
    pub fn new(body: &'a [u8], model_span: Range<usize>, new_model: &str) -> Self {
        // Serialising a &str cannot fail.
        let model_json = serde_json::to_string(new_model).unwrap_or_default();
        Rewrite {
            head: &body[..model_span.start],
            model_json,
            tail: &body[model_span.end..],
        }
    }

    pub fn len(&self) -> usize {
        self.head.len() + self.model_json.len() + self.tail.len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The rewritten body in one buffer (one copy).
    pub fn to_vec(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(self.len());
        out.extend_from_slice(self.head);
        out.extend_from_slice(self.model_json.as_bytes());
        out.extend_from_slice(self.tail);
        out
    }

    /// The rewritten body cut into chunks of at most `max` bytes, copying each byte once.
    pub fn chunks(&self, max: usize) -> Vec<Vec<u8>> {
        chunk_parts(&[self.head, self.model_json.as_bytes(), self.tail], max)
    }
}

/// Concatenates `parts` into chunks of at most `max` bytes (at least 1), copying each byte once.
fn chunk_parts(parts: &[&[u8]], max: usize) -> Vec<Vec<u8>> {
    let max = max.max(1);
    let total: usize = parts.iter().map(|p| p.len()).sum();
    let mut out = Vec::with_capacity(total.div_ceil(max));
    let mut cur = Vec::with_capacity(max.min(total));
    for part in parts {
        let mut rest = *part;
        while !rest.is_empty() {
            let take = (max - cur.len()).min(rest.len());
            cur.extend_from_slice(&rest[..take]);
            rest = &rest[take..];
            if cur.len() == max {
                out.push(std::mem::replace(&mut cur, Vec::with_capacity(max)));
            }
        }
    }
    if !cur.is_empty() {
        out.push(cur);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn finds_model_and_span() {
        let body = br#"{"prompt":"hi","model":"llama","max_tokens":3}"#;
        let p = parse_body(body).unwrap();
        assert_eq!(p.model, "llama");
        assert_eq!(&body[p.model_span.clone()], br#""llama""#);
        assert!(matches!(p.model, Cow::Borrowed(_)));
    }

    #[test]
    fn whitespace_and_nested_model_keys() {
        let body = b" {\n \"messages\": [{\"model\": \"inner\"}], \"model\" :  \"outer\"\n}\n ";
        let p = parse_body(body).unwrap();
        assert_eq!(p.model, "outer");
        assert_eq!(&body[p.model_span.clone()], b"\"outer\"");
    }

    #[test]
    fn escaped_model_and_escaped_key() {
        let body = br#"{"mod\u0065l":"a\"b\u00e9"}"#;
        let p = parse_body(body).unwrap();
        assert_eq!(p.model, "a\"b\u{e9}");
        assert_eq!(&body[p.model_span.clone()], br#""a\"b\u00e9""#);
    }

    #[test]
    fn last_duplicate_model_wins() {
        let p = parse_body(br#"{"model":"a","model":"b"}"#).unwrap();
        assert_eq!(p.model, "b");
    }

    #[test]
    fn errors() {
        assert_eq!(
            parse_body(b"{\"prompt\":1}").unwrap_err(),
            BodyError::MissingModel
        );
        assert_eq!(
            parse_body(b"{\"model\":7}").unwrap_err(),
            BodyError::ModelNotString
        );
        assert_eq!(
            parse_body(b"{\"model\":\"\"}").unwrap_err(),
            BodyError::ModelNotString
        );
        assert_eq!(
            parse_body(b"{\"model\":null}").unwrap_err(),
            BodyError::ModelNotString
        );
        assert_eq!(parse_body(b"[1,2]").unwrap_err(), BodyError::NotAnObject);
        assert_eq!(
            parse_body(b"\"model\"").unwrap_err(),
            BodyError::NotAnObject
        );
        for bad in [
            &b""[..],
            b"{",
            b"{\"model\":\"a\"",
            b"{\"model\":\"a\"} x",
            b"{\"model\":\"a\",}",
            b"\xff\xfe",
        ] {
            assert!(
                matches!(parse_body(bad), Err(BodyError::Malformed(_))),
                "{:?}",
                String::from_utf8_lossy(bad)
            );
        }
        // Invalid JSON after the model is still rejected: the whole body is validated.
        assert!(matches!(
            parse_body(b"{\"model\":\"a\",\"x\":[1,}"),
            Err(BodyError::Malformed(_))
        ));
        // Deep nesting is skipped iteratively: no stack overflow, and unbalanced nesting is an error.
        let deep = format!(
            "{{\"model\":\"a\",\"x\":{}{}}}",
            "[".repeat(100_000),
            "]".repeat(100_000)
        );
        assert_eq!(parse_body(deep.as_bytes()).unwrap().model, "a");
        let unbalanced = format!(
            "{{\"model\":\"a\",\"x\":{}{}}}",
            "[".repeat(100_000),
            "]".repeat(99_999)
        );
        assert!(matches!(
            parse_body(unbalanced.as_bytes()),
            Err(BodyError::Malformed(_))
        ));
    }

    #[test]
    fn huge_body() {
        let prompt = "word ".repeat(2_000_000);
        let body = format!("{{\"prompt\":\"{prompt}\",\"model\":\"m\"}}");
        let p = parse_body(body.as_bytes()).unwrap();
        assert_eq!(p.model, "m");
    }

    #[test]
    fn rewrite_changes_only_the_model() {
        let body = br#"{"model" : "base", "prompt":"x"}"#;
        let p = parse_body(body).unwrap();
        let rw = Rewrite::new(body, p.model_span, "lora-\"1\"");
        let out = rw.to_vec();
        assert_eq!(out, br#"{"model" : "lora-\"1\"", "prompt":"x"}"#);
        assert_eq!(rw.len(), out.len());
        assert_eq!(parse_body(&out).unwrap().model, "lora-\"1\"");
        assert_eq!(rw.chunks(4).concat(), out);
        assert!(rw.chunks(4).iter().all(|c| c.len() <= 4 && !c.is_empty()));
    }

    /// Differential test against the simple reference (a full `serde_json::Value` parse): on many
    /// mutated bodies the scanner accepts exactly what the reference accepts, finds the same model,
    /// and a rewrite changes nothing else.
    #[test]
    fn agrees_with_a_full_parse_on_mutated_bodies() {
        let seeds: [&[u8]; 4] = [
            br#"{"model":"m","prompt":"hi \"there\" \u00e9","max_tokens":3,"stream":true}"#,
            br#"{"messages":[{"role":"user","content":"a"}],"model":"meta-llama/Llama-3.1-8B","n":[1,2.5e3,null,false]}"#,
            br#" { "model" : "x" , "model" : "y" , "nested" : { "model" : "z" } } "#,
            br#"{"model":"\ud83d\ude00 emoji","temperature":0.7}"#,
        ];
        let mut rng = fastrand::Rng::with_seed(7);
        let (mut accepted, mut rejected) = (0, 0);
        for _ in 0..20_000 {
            let mut b = seeds[rng.usize(..seeds.len())].to_vec();
            for _ in 0..rng.usize(0..3) {
                let i = rng.usize(..b.len());
                match rng.u8(..3) {
                    0 => b[i] = b"{}[]\",:0a \\"[rng.usize(..11)],
                    1 => {
                        b.remove(i);
                    }
                    _ => b.insert(i, b"\"m,}1"[rng.usize(..5)]),
                }
            }
            let reference = serde_json::from_slice::<serde_json::Value>(&b)
                .ok()
                .filter(|v| v.is_object())
                .and_then(|v| {
                    v.get("model")
                        .and_then(|m| m.as_str())
                        .filter(|m| !m.is_empty())
                        .map(str::to_owned)
                });
            match (parse_body(&b), reference) {
                (Ok(p), Some(model)) => {
                    assert_eq!(p.model, model, "{}", String::from_utf8_lossy(&b));
                    let out = Rewrite::new(&b, p.model_span.clone(), "rewritten").to_vec();
                    let mut before: serde_json::Value = serde_json::from_slice(&b).unwrap();
                    let mut after: serde_json::Value = serde_json::from_slice(&out).unwrap();
                    assert_eq!(after["model"], "rewritten");
                    before.as_object_mut().unwrap().remove("model");
                    after.as_object_mut().unwrap().remove("model");
                    assert_eq!(before, after, "the rewrite changed more than the model");
                    accepted += 1;
                }
                (Err(_), None) => rejected += 1,
                (got, want) => panic!(
                    "scanner {got:?} vs reference {want:?} on {}",
                    String::from_utf8_lossy(&b)
                ),
            }
        }
        assert!(
            accepted > 1000 && rejected > 1000,
            "{accepted} accepted, {rejected} rejected"
        );
    }

    #[test]
    fn chunking() {
        assert!(chunk_parts(&[b"", b""], 3).is_empty());
        assert_eq!(
            chunk_parts(&[b"ab", b"cde", b"f"], 3),
            vec![b"abc".to_vec(), b"def".to_vec()]
        );
        assert_eq!(chunk_parts(&[b"abcdefg"], 3).len(), 3);
    }
}
