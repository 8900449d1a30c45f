//! What of a request's prompt the KV-aware picker can use, borrowed from the body.

use kvepp_core::Prompt;
use kvepp_request::{RawJson, RawMessages, RawPrompt};
use kvepp_tokenizer::ModelTokenizer;

/// Prompts at least this large are tokenized off the async worker (`block_in_place`), so one big
/// prompt does not stall the other streams on that thread.
pub(crate) const OFFLOAD_TOKENIZE_BYTES: usize = 32 << 10;

#[derive(Debug)]
pub enum PromptInput<'a> {
    /// A completions `prompt` given as token ids (used as is, no tokenizer).
    TokenIds(Vec<u32>),
    /// The same, as the chunks the body's reading found them in ([`kvepp_request::IdChunks`]).
    TokenIdPieces(Vec<std::sync::Arc<[u32]>>),
    /// The raw JSON of a chat request's `messages`.
    Messages(RawMessages<'a>),
    /// The raw JSON of a completions `prompt` that is not token ids (a string, or a batch).
    Prompt(RawJson<'a>),
    /// No prompt in the body.
    Absent,
}

impl<'a> PromptInput<'a> {
    /// The raw JSON text (what approximate prefix hashing reads).
    pub(crate) fn raw_bytes(&self) -> Option<&'a [u8]> {
        match self {
            PromptInput::Messages(m) => Some(m.text),
            PromptInput::Prompt(r) => Some(r.get().as_bytes()),
            _ => None,
        }
    }
}

/// Token ids when `prompt` is a flat list of integers, else the raw `messages` or `prompt`
/// (messages win: a chat request's prompt is its conversation). Takes the body's prompt (its ids
/// move, no copy).
pub fn prompt_input<'a>(
    messages: Option<RawMessages<'a>>,
    prompt: Option<RawPrompt<'a>>,
) -> PromptInput<'a> {
    if let Some(m) = messages {
        return PromptInput::Messages(m);
    }
    match prompt {
        None => PromptInput::Absent,
        Some(RawPrompt::Ids(ids)) => PromptInput::TokenIds(ids),
        Some(RawPrompt::IdPieces(pieces)) => PromptInput::TokenIdPieces(pieces),
        Some(RawPrompt::Json(p)) if p.get().starts_with('[') => match token_ids(p.get()) {
            Some(ids) => PromptInput::TokenIds(ids),
            None => PromptInput::Prompt(p),
        },
        Some(RawPrompt::Json(p)) => PromptInput::Prompt(p),
    }
}

/// The ids of a `prompt` array the body scanner did not read as plain integers (e.g. `-0`, which
/// serde takes for 0): serde's answer; None for any array that is not u32s.
fn token_ids(raw: &str) -> Option<Vec<u32>> {
    serde_json::from_str::<Vec<u32>>(raw).ok()
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
        (PromptInput::Messages(m), Some(t)) => Some(offload(m.text.len(), || t.messages_prompt(m))),
        (PromptInput::Prompt(raw), Some(t)) => Some(offload(raw.get().len(), || {
            t.completion_ids(raw.get()).map(Prompt::Tokens)
        })),
        (PromptInput::TokenIds(_) | PromptInput::TokenIdPieces(_), _) | (_, None) => None,
    };
    match (tokens, input) {
        (_, PromptInput::TokenIds(ids)) => Prompt::TokenIds(ids),
        (_, PromptInput::TokenIdPieces(pieces)) => Prompt::TokenIdPieces(pieces),
        (Some(Ok(p)), _) => p,
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
    use kvepp_request::parse_body;
    use kvepp_request::{parse_body_with, IdChunks};

    /// (kind, raw text) of the prompt input.
    fn input(body: &str) -> (&'static str, Option<String>) {
        let parsed = parse_body(body.as_bytes()).unwrap();
        match prompt_input(parsed.messages, parsed.prompt) {
            PromptInput::TokenIds(ids) => ("ids", Some(format!("{ids:?}"))),
            PromptInput::TokenIdPieces(p) => ("ids", Some(format!("{:?}", p.concat()))),
            PromptInput::Messages(m) => (
                "messages",
                Some(String::from_utf8_lossy(m.text).into_owned()),
            ),
            PromptInput::Prompt(r) => ("prompt", Some(r.get().to_owned())),
            PromptInput::Absent => ("absent", None),
        }
    }

    fn some(kind: &'static str, text: &str) -> (&'static str, Option<String>) {
        (kind, Some(text.to_owned()))
    }

    /// The body scanner's one-pass reading of ids (with serde behind it for anything unusual)
    /// against serde alone, on arrays of every shape a client may send.
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
        let mut ids_seen = 0;
        let chunks = IdChunks::new(1 << 12);
        for case in 0..5_000 {
            let n = rng.usize(..12);
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
            let body = format!(r#"{{"model":"m","prompt":{raw},"n":1}}"#);
            // Every other body through one chunk cache (chunks of ~8 bytes here).
            let parsed =
                parse_body_with(body.as_bytes(), (case % 2 == 1).then_some(&chunks)).unwrap();
            let got = match prompt_input(parsed.messages, parsed.prompt) {
                PromptInput::TokenIds(ids) => Some(ids),
                PromptInput::TokenIdPieces(p) => Some(p.concat()),
                PromptInput::Prompt(p) => {
                    assert_eq!(p.get(), raw.trim_end(), "case {case}");
                    None
                }
                other => panic!("case {case}: {other:?}"),
            };
            ids_seen += usize::from(got.is_some());
            assert_eq!(got, want, "case {case}: {raw}");
        }
        assert!(ids_seen > 1000, "{ids_seen}");
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
