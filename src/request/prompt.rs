//! What of a request's prompt the KV-aware picker can use, borrowed from the body.

use serde_json::value::RawValue;

use super::tokenize::ModelTokenizer;
use super::ParsedBody;
use kvepp_core::Prompt;

/// Prompts at least this large are tokenized off the async worker (`block_in_place`), so one big
/// prompt does not stall the other streams on that thread.
pub const OFFLOAD_TOKENIZE_BYTES: usize = 32 << 10;

#[derive(Debug)]
pub enum PromptInput<'a> {
    /// A completions `prompt` given as token ids (used as is, no tokenizer).
    TokenIds(Vec<u32>),
    /// The raw JSON of a chat request's `messages`.
    Messages(&'a RawValue),
    /// The raw JSON of a completions `prompt` that is not token ids (a string, or a batch).
    Prompt(&'a RawValue),
    /// No prompt in the body.
    Absent,
}

impl<'a> PromptInput<'a> {
    /// The raw JSON text (what approximate prefix hashing reads).
    pub fn raw_bytes(&self) -> Option<&'a [u8]> {
        match self {
            PromptInput::Messages(r) | PromptInput::Prompt(r) => Some(r.get().as_bytes()),
            _ => None,
        }
    }
}

/// Token ids when `prompt` is a flat list of integers, else the raw `messages` or `prompt`
/// (messages win: a chat request's prompt is its conversation).
pub fn prompt_input<'a>(body: &ParsedBody<'a>) -> PromptInput<'a> {
    if let Some(m) = body.messages {
        return PromptInput::Messages(m);
    }
    match body.prompt {
        None => PromptInput::Absent,
        Some(p) if p.get().starts_with('[') => match token_ids(p.get()) {
            Some(ids) => PromptInput::TokenIds(ids),
            None => PromptInput::Prompt(p),
        },
        Some(p) => PromptInput::Prompt(p),
    }
}

/// The ids of a `prompt` that is a JSON array of integers that fit u32 (`raw` is valid JSON: the
/// body parser checked it); None for any other array. Plain arrays of digits are read in one
/// pass over the bytes; anything unusual (signs, exponents, nesting) goes to serde, whose answer
/// it is, so both paths agree by construction.
pub fn token_ids(raw: &str) -> Option<Vec<u32>> {
    fast_token_ids(raw.as_bytes()).or_else(|| serde_json::from_str::<Vec<u32>>(raw).ok())
}

fn fast_token_ids(raw: &[u8]) -> Option<Vec<u32>> {
    let inner = raw.strip_prefix(b"[")?.strip_suffix(b"]")?;
    let mut ids = Vec::with_capacity(inner.len() / 4 + 1);
    // `raw` is valid JSON, so whitespace never splits a number: skip it wherever it is.
    let (mut value, mut digits) = (0u64, 0u32);
    for &b in inner {
        match b {
            b'0'..=b'9' => {
                value = value.wrapping_mul(10).wrapping_add(u64::from(b - b'0'));
                digits += 1;
            }
            b',' => {
                ids.push(id(value, digits)?);
                (value, digits) = (0, 0);
            }
            b' ' | b'\n' | b'\t' | b'\r' => {}
            _ => return None,
        }
    }
    if digits > 0 || !ids.is_empty() {
        ids.push(id(value, digits)?);
    }
    Some(ids)
}

/// One id of `digits` digits: at most 10 of them (no wrap-around above) and within u32.
fn id(value: u64, digits: u32) -> Option<u32> {
    if digits == 0 || digits > 10 {
        return None;
    }
    u32::try_from(value).ok()
}

/// The prompt as the router takes it: token ids as given; tokenized when the served model has a
/// tokenizer; else (or when tokenizing fails) the raw bytes for approximate blocks, kept apart by
/// `scope`. [`Prompt::None`] without a prompt.
pub fn prompt_for_routing<'a>(
    tokenizer: Option<&ModelTokenizer>,
    input: PromptInput<'a>,
    served_model: &str,
    scope: &'a str,
) -> Prompt<'a> {
    let tokens = match (&input, tokenizer) {
        (PromptInput::Absent, _) => return Prompt::None,
        (PromptInput::Messages(raw), Some(t)) => Some(offload(raw.get().len(), || t.chat_ids(raw))),
        (PromptInput::Prompt(raw), Some(t)) => {
            Some(offload(raw.get().len(), || t.completion_ids(raw)))
        }
        (PromptInput::TokenIds(_), _) | (_, None) => None,
    };
    match (tokens, input) {
        (_, PromptInput::TokenIds(ids)) => Prompt::TokenIds(ids),
        (Some(Ok(ids)), _) => Prompt::Tokens(ids),
        (Some(Err(e)), input) => {
            tracing::debug!(model = served_model, error = %e, "tokenization failed; approximate prefix used");
            text(scope, &input)
        }
        (None, input) => text(scope, &input),
    }
}

fn text<'a>(scope: &'a str, input: &PromptInput<'a>) -> Prompt<'a> {
    match input.raw_bytes() {
        Some(bytes) => Prompt::Text { scope, bytes },
        None => Prompt::None,
    }
}

fn offload<T>(len: usize, f: impl FnOnce() -> T) -> T {
    use tokio::runtime::{Handle, RuntimeFlavor};
    let multi =
        Handle::try_current().is_ok_and(|h| h.runtime_flavor() == RuntimeFlavor::MultiThread);
    if len >= OFFLOAD_TOKENIZE_BYTES && multi {
        tokio::task::block_in_place(f)
    } else {
        f()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::request::parse_body;

    /// (kind, raw text) of the prompt input.
    fn input(body: &str) -> (&'static str, Option<String>) {
        match prompt_input(&parse_body(body.as_bytes()).unwrap()) {
            PromptInput::TokenIds(ids) => ("ids", Some(format!("{ids:?}"))),
            PromptInput::Messages(r) => ("messages", Some(r.get().to_owned())),
            PromptInput::Prompt(r) => ("prompt", Some(r.get().to_owned())),
            PromptInput::Absent => ("absent", None),
        }
    }

    fn some(kind: &'static str, text: &str) -> (&'static str, Option<String>) {
        (kind, Some(text.to_owned()))
    }

    /// The one-pass reader against serde on arrays of every shape a client may send.
    #[test]
    fn token_ids_agree_with_serde() {
        let mut rng = fastrand::Rng::with_seed(5);
        let items = [
            "0",
            "7",
            "42",
            "4294967295",
            "4294967296",
            "99999999999",
            "-1",
            "-0",
            "1.0",
            "1e3",
            "\"5\"",
            "[1]",
            "null",
            "true",
            "123",
        ];
        let ws = ["", " ", "\n", "\t ", "\r\n"];
        for case in 0..5_000 {
            let n = rng.usize(..6);
            let plain = rng.bool();
            let parts: Vec<String> = (0..n)
                .map(|_| {
                    let it = if plain {
                        items[rng.usize(..5)]
                    } else {
                        items[rng.usize(..items.len())]
                    };
                    format!(
                        "{}{it}{}",
                        ws[rng.usize(..ws.len())],
                        ws[rng.usize(..ws.len())]
                    )
                })
                .collect();
            let raw = format!("[{}{}]", parts.join(","), ws[rng.usize(..ws.len())]);
            let want = serde_json::from_str::<Vec<u32>>(&raw).ok();
            assert_eq!(token_ids(&raw), want, "case {case}: {raw}");
        }
        assert_eq!(fast_token_ids(b"[1, 2 ,3]"), Some(vec![1, 2, 3]));
        assert_eq!(fast_token_ids(b"[]"), Some(vec![]));
        assert_eq!(fast_token_ids(b"[-1]"), None, "left to serde");
    }

    #[test]
    fn token_ids_text_and_absent() {
        assert_eq!(
            input(r#"{"model":"m","prompt":[1, 2,3]}"#),
            some("ids", "[1, 2, 3]")
        );
        assert_eq!(
            input(r#"{"model":"m","prompt":"hi \"x\""}"#),
            some("prompt", r#""hi \"x\"""#)
        );
        // A batch of prompts or negative numbers are not one token-id prompt.
        assert_eq!(
            input(r#"{"model":"m","prompt":[[1],[2]]}"#),
            some("prompt", "[[1],[2]]")
        );
        assert_eq!(
            input(r#"{"model":"m","prompt":[-1]}"#),
            some("prompt", "[-1]")
        );
        assert_eq!(
            input(r#"{"messages":[{"role":"user","content":"a"}],"model":"m","prompt":[1]}"#),
            some("messages", r#"[{"role":"user","content":"a"}]"#)
        );
        assert_eq!(input(r#"{"model":"m"}"#), ("absent", None));
    }
}
