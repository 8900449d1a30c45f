//! What of a request's prompt the KV-aware picker can use, borrowed from the body.

use serde_json::value::RawValue;

use super::ParsedBody;

#[derive(Debug, PartialEq, Eq)]
pub enum PromptInput<'a> {
    /// A completions `prompt` given as token ids (used as is, no tokenizer).
    TokenIds(Vec<u32>),
    /// The raw JSON of `messages` (chat) or `prompt` (completions text).
    Text(&'a [u8]),
    /// No prompt in the body.
    Absent,
}

/// Token ids when `prompt` is a flat list of integers, else the raw bytes of `messages` or
/// `prompt` (messages win: a chat request's prompt is its conversation).
pub fn prompt_input<'a>(body: &ParsedBody<'a>) -> PromptInput<'a> {
    fn raw(v: &RawValue) -> &[u8] {
        v.get().as_bytes()
    }
    if let Some(m) = body.messages {
        return PromptInput::Text(raw(m));
    }
    match body.prompt {
        None => PromptInput::Absent,
        Some(p) if p.get().starts_with('[') => match serde_json::from_str::<Vec<u32>>(p.get()) {
            Ok(ids) => PromptInput::TokenIds(ids),
            Err(_) => PromptInput::Text(raw(p)),
        },
        Some(p) => PromptInput::Text(raw(p)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::request::parse_body;

    fn input(body: &str) -> PromptInput<'_> {
        prompt_input(&parse_body(body.as_bytes()).unwrap())
    }

    #[test]
    fn token_ids_text_and_absent() {
        assert_eq!(
            input(r#"{"model":"m","prompt":[1, 2,3]}"#),
            PromptInput::TokenIds(vec![1, 2, 3])
        );
        assert_eq!(
            input(r#"{"model":"m","prompt":"hi \"x\""}"#),
            PromptInput::Text(br#""hi \"x\"""#)
        );
        // A batch of prompts or negative numbers are not one token-id prompt.
        assert_eq!(
            input(r#"{"model":"m","prompt":[[1],[2]]}"#),
            PromptInput::Text(b"[[1],[2]]")
        );
        assert_eq!(
            input(r#"{"model":"m","prompt":[-1]}"#),
            PromptInput::Text(b"[-1]")
        );
        assert_eq!(
            input(r#"{"messages":[{"role":"user","content":"a"}],"model":"m","prompt":[1]}"#),
            PromptInput::Text(br#"[{"role":"user","content":"a"}]"#)
        );
        assert_eq!(input(r#"{"model":"m"}"#), PromptInput::Absent);
    }
}
