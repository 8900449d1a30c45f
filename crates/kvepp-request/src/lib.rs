//! What a request body says, read in place: a zero-copy scan of an OpenAI-style JSON request body
//! (its `model`, its prompt as token ids, text or `messages`), and the caches that carry what one
//! request's reading found to the next turn of its conversation ([`recent`], [`generations`]).
//! No tokenizer, routing or I/O here: the tokenizer crate (`kvepp-tokenizer`) turns the prompt
//! into token ids, the server turns it into the routing core's facts.
//!
//! The whole body is validated as JSON (so malformed input is rejected before it reaches a model
//! server), but only the top-level `model` value is materialised. The top-level object is walked
//! here. Each member's value is skipped by kvepp's own JSON walk ([`walk`]: strings 64 bytes a
//! step with vector compares, so a chat's dense `\n` escapes stay cheap), which answers only for
//! values it accepts; anything else goes to serde_json (`&RawValue`: validated, borrowed, never
//! built), whose answer and error message it is. A `messages` array comes out of the same pass
//! split into its elements. A `prompt` that is an array of plain integers is read into token ids
//! in the pass that validates it ([`int_array()`]; serde's skip of 100k integers costs more than
//! reading them); anything
//! unusual in such an array (signs, fractions, exponents, values beyond u32) sends it back to
//! serde. With a chunk cache ([`IdChunks`], the request router's), the
//! leading chunks of such an array that an earlier prompt sent are taken from it unread; with
//! recent `messages` arrays ([`KnownArrays`], for a body held as `Bytes`), the leading messages a
//! recent array has too, byte for byte, are taken as its walk found them. The
//! byte span of the `model` value is kept so a target-model rewrite can splice a new value in
//! without touching the rest of the body.
//!
//! Invariants: a body is accepted iff it is one valid JSON object (with a non-empty string
//! `model`), as serde_json accepts it (a differential test checks it on mutated bodies); for
//! duplicate keys the last one wins, as in Python's `json` module that the engines use.

use std::borrow::Cow;
use std::ops::Range;
use std::sync::Arc;

use bytes::Bytes;
use serde_json::value::RawValue;

pub mod generations;
mod id_chunks;
mod int_array;
mod known;
pub mod recent;
mod walk;
pub use id_chunks::{IdChunks, ID_CHUNK_CACHE_IDS};
use int_array::int_array;
use known::ElementKeys;
pub use known::KnownArrays;

/// A body the caller owns, with the cache of recent `messages` arrays its own may be compared
/// with (see [`parse_body_owned`]).
type Owned<'a> = Option<(&'a KnownArrays, &'a Bytes)>;

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

/// A completions `prompt` as the body gives it.
#[derive(Debug)]
pub enum RawPrompt<'a> {
    /// A flat array of integers that fit u32, read while the body was validated.
    Ids(Vec<u32>),
    /// The same, read with a chunk cache ([`IdChunks`]): the ids as the chunks they were found
    /// in, in order.
    IdPieces(Vec<Arc<[u32]>>),
    /// Any other value, raw.
    Json(RawJson<'a>),
}

/// A JSON value's text as the body holds it, validated: the borrowed form of serde's
/// `RawValue`, which a value the walk accepts gets without serde reading it ([`walk`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RawJson<'a>(&'a str);

impl<'a> RawJson<'a> {
    /// The value's JSON text.
    pub fn get(&self) -> &'a str {
        self.0
    }
}

/// A chat request's `messages`, borrowed from the body.
#[derive(Debug)]
pub struct RawMessages<'a> {
    /// The whole value's JSON text.
    pub text: &'a [u8],
    /// Its elements, raw, when it is an array of at most [`MAX_SPLIT_MESSAGES`] (None: another
    /// kind of value, or a longer array), found in the pass that validates it, so a chat
    /// template's input can be built (or found cached) message by message.
    pub items: Option<Vec<RawJson<'a>>>,
    /// The items' cache keys, when the array came from a body kept for the next turn
    /// ([`known::ElementKeys`]): those of messages an earlier turn sent already known. Read
    /// through [`Self::item_key`]; this crate alone sets them.
    keys: Option<ElementKeys>,
}

/// The request formats kvepp reads, each known by its path. All name the model in a top-level
/// `model`; they differ in where the prompt is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Format {
    /// OpenAI completions (`prompt`: text, a batch, or token ids) and chat completions
    /// (`messages`): `/v1/completions`, `/v1/chat/completions`, and any body whose path is not
    /// known.
    OpenAi,
    /// OpenAI Responses (`/v1/responses`): `input` (a string or items) and `instructions`.
    Responses,
    /// Anthropic Messages (`/v1/messages`): `system` and `messages` with content blocks.
    Messages,
    /// vLLM's token-in generation (`/inference/v1/generate`): `token_ids`.
    Generate,
    /// Embeddings (`/v1/embeddings`): `input` (a string, strings, or token ids).
    Embeddings,
}

impl Format {
    /// The format served at `path` (a query string ignored); None for a path kvepp does not know.
    pub fn of_path(path: &str) -> Option<Format> {
        let path = path.split(['?', '#']).next().unwrap_or_default();
        let path = path.strip_suffix('/').unwrap_or(path);
        Some(match path {
            "/v1/completions" | "/v1/chat/completions" => Format::OpenAi,
            "/v1/responses" => Format::Responses,
            "/v1/messages" => Format::Messages,
            "/inference/v1/generate" => Format::Generate,
            "/v1/embeddings" => Format::Embeddings,
            _ => return None,
        })
    }

    /// The name used in logs and metrics.
    pub fn as_str(self) -> &'static str {
        match self {
            Format::OpenAi => "openai",
            Format::Responses => "responses",
            Format::Messages => "anthropic_messages",
            Format::Generate => "vllm_generate",
            Format::Embeddings => "embeddings",
        }
    }

    /// The top-level key whose value is read as [`ParsedBody::prompt`].
    fn prompt_key(self) -> Option<&'static str> {
        match self {
            Format::OpenAi => Some("prompt"),
            Format::Responses | Format::Embeddings => Some("input"),
            Format::Generate => Some("token_ids"),
            Format::Messages => None,
        }
    }

    /// The top-level key whose value is read as [`ParsedBody::system`].
    fn system_key(self) -> Option<&'static str> {
        match self {
            Format::Responses => Some("instructions"),
            Format::Messages => Some("system"),
            _ => None,
        }
    }

    fn has_messages(self) -> bool {
        matches!(self, Format::OpenAi | Format::Messages)
    }
}

/// The parts of a body the EPP needs, borrowed from the body bytes.
#[derive(Debug)]
pub struct ParsedBody<'a> {
    /// The model name, unescaped.
    pub model: Cow<'a, str>,
    /// Byte range of the `model` value (including its quotes) in the body.
    pub model_span: Range<usize>,
    /// `prompt` (completions) and the raw JSON of `messages` (chat).
    pub prompt: Option<RawPrompt<'a>>,
    pub messages: Option<RawMessages<'a>>,
    /// The format's system prompt, raw (Responses `instructions`, Anthropic `system`).
    pub system: Option<RawJson<'a>>,
    /// The cap on output tokens the request gives: `max_completion_tokens`, else `max_tokens`
    /// (Responses: `max_output_tokens`). A value that is not a non-negative integer is left to
    /// the engine to refuse and read as none.
    pub max_output_tokens: Option<u64>,
}

/// Scans `body` and returns the model name and its location.
pub fn parse_body(body: &[u8]) -> Result<ParsedBody<'_>, BodyError> {
    parse_body_with(body, None)
}

/// [`parse_body`], a `prompt` of token ids read through `chunks` (its leading chunks from the
/// cache) when given.
pub fn parse_body_with<'a>(
    body: &'a [u8],
    chunks: Option<&IdChunks>,
) -> Result<ParsedBody<'a>, BodyError> {
    parse(body, chunks, None, Format::OpenAi)
}

/// [`parse_body_with`] of a body held as `Bytes`: a `messages` array's leading elements that a
/// recent array in `arrays` has too, byte for byte, are taken as its walk found them
/// ([`KnownArrays`]), and the array is kept there (the body shared, not copied).
pub fn parse_body_owned<'a>(
    body: &'a Bytes,
    chunks: Option<&IdChunks>,
    arrays: &'a KnownArrays,
) -> Result<ParsedBody<'a>, BodyError> {
    parse(body, chunks, Some((arrays, body)), Format::OpenAi)
}

/// [`parse_body_owned`] of a body in `format`: its prompt read from where the format keeps it.
pub fn parse_body_as<'a>(
    body: &'a Bytes,
    format: Format,
    chunks: Option<&IdChunks>,
    arrays: &'a KnownArrays,
) -> Result<ParsedBody<'a>, BodyError> {
    parse(body, chunks, Some((arrays, body)), format)
}

fn parse<'a>(
    body: &'a [u8],
    chunks: Option<&IdChunks>,
    owned: Owned<'a>,
    format: Format,
) -> Result<ParsedBody<'a>, BodyError> {
    let Fields {
        model,
        prompt,
        messages,
        system,
        max_tokens,
        max_completion_tokens,
    } = scan(body, chunks, owned, format)?;
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
        system,
        max_output_tokens: max_completion_tokens.or(max_tokens),
    })
}

/// The top-level values kvepp reads. Last one wins.
#[derive(Default)]
struct Fields<'a> {
    model: Option<&'a RawValue>,
    prompt: Option<RawPrompt<'a>>,
    messages: Option<RawMessages<'a>>,
    system: Option<RawJson<'a>>,
    /// `max_tokens` (Responses: `max_output_tokens`) and `max_completion_tokens`.
    max_tokens: Option<u64>,
    max_completion_tokens: Option<u64>,
}

fn is_ws(b: u8) -> bool {
    matches!(b, b' ' | b'\t' | b'\n' | b'\r')
}

/// The first non-whitespace position at or after `i`.
fn skip_ws(b: &[u8], mut i: usize) -> usize {
    while b.get(i).is_some_and(|&c| is_ws(c)) {
        i += 1;
    }
    i
}

fn malformed_at(what: &str, at: usize) -> BodyError {
    BodyError::Malformed(format!("{what} at byte {at}"))
}

/// One JSON value of type `T` starting at byte `at` (whitespace first allowed), and the offset
/// just past it.
fn value_at<'a, T: serde::Deserialize<'a>>(
    body: &'a [u8],
    at: usize,
) -> Result<(T, usize), serde_json::Error> {
    let mut values = serde_json::Deserializer::from_slice(&body[at..]).into_iter::<T>();
    match values.next() {
        Some(Ok(v)) => Ok((v, at + values.byte_offset())),
        Some(Err(e)) => Err(e),
        None => Err(serde::de::Error::custom("EOF while parsing a value")),
    }
}

fn malformed(e: &serde_json::Error, at: usize) -> BodyError {
    BodyError::Malformed(format!("{e} (in the value at byte {at})"))
}

/// Walks the top-level object.
fn scan<'a>(
    body: &'a [u8],
    chunks: Option<&IdChunks>,
    owned: Owned<'a>,
    format: Format,
) -> Result<Fields<'a>, BodyError> {
    let mut i = skip_ws(body, 0);
    match body.get(i) {
        Some(b'{') => i += 1,
        // Another kind of value: valid JSON is not an object; anything else is malformed.
        _ => {
            return Err(
                match serde_json::from_slice::<serde::de::IgnoredAny>(body) {
                    Ok(_) => BodyError::NotAnObject,
                    Err(e) => BodyError::Malformed(e.to_string()),
                },
            )
        }
    }
    let mut fields = Fields::default();
    i = skip_ws(body, i);
    if body.get(i) == Some(&b'}') {
        i += 1;
    } else {
        loop {
            i = skip_ws(body, i);
            if body.get(i) != Some(&b'"') {
                return Err(malformed_at("expected a string key", i));
            }
            let (key, after): (Cow<'_, str>, usize) = match value_at::<&str>(body, i) {
                Ok((k, n)) => (Cow::Borrowed(k), n),
                // Escapes in the key: decoded (rare).
                Err(_) => {
                    let (k, n) = value_at::<String>(body, i).map_err(|e| malformed(&e, i))?;
                    (Cow::Owned(k), n)
                }
            };
            i = skip_ws(body, after);
            if body.get(i) != Some(&b':') {
                return Err(malformed_at("expected `:`", i));
            }
            i = skip_ws(body, i + 1);
            match &*key {
                k if Some(k) == format.prompt_key() => {
                    let ids = (body.get(i) == Some(&b'[')).then(|| match chunks {
                        Some(c) => c.read(&body[i..]),
                        None => int_array(&body[i..]).map(|(v, n)| (RawPrompt::Ids(v), n)),
                    });
                    if let Some(Some((ids, n))) = ids {
                        fields.prompt = Some(ids);
                        i += n;
                    } else {
                        let (v, n) = raw_text_at(body, i)?;
                        fields.prompt = Some(RawPrompt::Json(v));
                        i = n;
                    }
                }
                "model" => (fields.model, i) = raw_at(body, i).map(|(v, n)| (Some(v), n))?,
                "messages" if format.has_messages() => {
                    (fields.messages, i) = messages_at(body, i, owned).map(|(v, n)| (Some(v), n))?
                }
                k if Some(k) == format.system_key() => {
                    let (v, n) = raw_text_at(body, i)?;
                    fields.system = Some(v);
                    i = n;
                }
                "max_tokens" | "max_output_tokens" | "max_completion_tokens" => {
                    let (v, n) = raw_text_at(body, i)?;
                    let cap = v.0.parse::<u64>().ok();
                    if &*key == "max_completion_tokens" {
                        fields.max_completion_tokens = cap;
                    } else {
                        fields.max_tokens = cap;
                    }
                    i = n;
                }
                _ => i = raw_text_at(body, i)?.1,
            }
            i = skip_ws(body, i);
            match body.get(i) {
                Some(b',') => i += 1,
                Some(b'}') => {
                    i += 1;
                    break;
                }
                Some(_) => return Err(malformed_at("expected `,` or `}`", i)),
                None => return Err(malformed_at("EOF while parsing an object", i)),
            }
        }
    }
    let end = skip_ws(body, i);
    if end != body.len() {
        return Err(malformed_at("trailing characters", end));
    }
    Ok(fields)
}

fn raw_at(body: &[u8], at: usize) -> Result<(&RawValue, usize), BodyError> {
    value_at::<&RawValue>(body, at).map_err(|e| malformed(&e, at))
}

/// The value at `at` as [`raw_at`] reads it: without serde when the walk can tell; serde for the
/// rest (and for every error).
fn raw_text_at(body: &[u8], at: usize) -> Result<(RawJson<'_>, usize), BodyError> {
    let walked =
        walk::skip_value(body, at).and_then(|end| Some((walk::utf8(&body[at..end])?, end)));
    match walked {
        Some((text, end)) => Ok((RawJson(text), end)),
        None => raw_at(body, at).map(|(v, end)| (RawJson(v.get()), end)),
    }
}

/// A `messages` array with more elements than this is not split (its elements are not kept: a
/// body of millions of tiny elements would cost ~50 ns each to keep); the tokenizer then decodes it
/// whole, as it would any value that is not an array.
pub const MAX_SPLIT_MESSAGES: usize = 16_384;

/// The elements of an array, raw, up to [`MAX_SPLIT_MESSAGES`] (None beyond: the rest is only
/// validated).
struct Items<'a>(Option<Vec<&'a RawValue>>);

impl<'de> serde::Deserialize<'de> for Items<'de> {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct Visit;
        impl<'de> serde::de::Visitor<'de> for Visit {
            type Value = Items<'de>;
            fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("an array")
            }
            fn visit_seq<A: serde::de::SeqAccess<'de>>(
                self,
                mut seq: A,
            ) -> Result<Items<'de>, A::Error> {
                let mut items = Vec::new();
                while let Some(item) = seq.next_element::<&RawValue>()? {
                    if items.len() == MAX_SPLIT_MESSAGES {
                        while seq.next_element::<serde::de::IgnoredAny>()?.is_some() {}
                        return Ok(Items(None));
                    }
                    items.push(item);
                }
                Ok(Items(Some(items)))
            }
        }
        d.deserialize_seq(Visit)
    }
}

impl<'a> RawMessages<'a> {
    /// The message cache key of item `i` (the key of its JSON text:
    /// [`generations::ContentCache::key`]): kept from the turn that sent the same message
    /// when the array resumed from a kept one, else computed now (and kept for the next turn
    /// when the array is kept). None when there is no item `i`.
    pub fn item_key(&self, i: usize) -> Option<u128> {
        let text = self.items.as_ref()?.get(i)?.get().as_bytes();
        let key = || generations::ContentCache::<()>::key(text);
        Some(match self.keys.as_ref().and_then(|k| k.get(i)) {
            Some(slot) => *slot.get_or_init(key),
            None => key(),
        })
    }

    /// A `messages` value given on its own (already valid JSON), split as the body scanner splits
    /// it.
    pub fn of(messages: &'a RawValue) -> Self {
        let text = messages.get().as_bytes();
        match messages_at(text, 0, None) {
            Ok((m, _)) => m,
            // Unreachable for valid JSON; whole, as any value that is not an array.
            Err(_) => RawMessages {
                text,
                items: None,
                keys: None,
            },
        }
    }
}

/// The `messages` value at `at` (no whitespace first): an array is read as a list of raw values
/// (by the walk, else by serde), so its elements come out of the pass that validates it.
fn messages_at<'a>(
    body: &'a [u8],
    at: usize,
    owned: Owned<'a>,
) -> Result<(RawMessages<'a>, usize), BodyError> {
    if body.get(at) == Some(&b'[') {
        // The key slots come with the walk's split of a body the caller owns (`body` itself),
        // one per element; serde's fallback has none.
        let (split, keys) = match owned {
            Some((arrays, bytes)) => match arrays.split(bytes, at, MAX_SPLIT_MESSAGES) {
                Some((split, keys)) => (walk::split_items(split), keys),
                None => (None, None),
            },
            None => (walk::split_array(body, at, MAX_SPLIT_MESSAGES), None),
        };
        let ((items, end), keys) = match split {
            Some(split) => (split, keys),
            None => {
                let (Items(items), end) =
                    value_at::<Items<'_>>(body, at).map_err(|e| malformed(&e, at))?;
                let texts = items.map(|items| items.iter().map(|r| RawJson(r.get())).collect());
                ((texts, end), None)
            }
        };
        let messages = RawMessages {
            text: &body[at..end],
            items,
            keys,
        };
        return Ok((messages, end));
    }
    let (raw, end) = raw_at(body, at)?;
    let messages = RawMessages {
        text: raw.get().as_bytes(),
        items: None,
        keys: None,
    };
    Ok((messages, end))
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

    /// One mutation of `b` at or past byte `from` (the body scanners' differential tests): a
    /// byte replaced by one of `replace`, a byte removed, one of `insert` inserted, or the rest
    /// cut. Nothing when `b` has no byte there.
    pub(super) fn mutate(
        rng: &mut fastrand::Rng,
        b: &mut Vec<u8>,
        from: usize,
        replace: &[u8],
        insert: &[u8],
    ) {
        if b.len() <= from {
            return;
        }
        let i = rng.usize(from..b.len());
        match rng.u8(..4) {
            0 => b[i] = replace[rng.usize(..replace.len())],
            1 => {
                b.remove(i);
            }
            2 => b.insert(i, insert[rng.usize(..insert.len())]),
            _ => b.truncate(i),
        }
    }

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

    /// Arrays up to the cap are split; longer ones are not (their elements are not kept) but are
    /// validated all the same.
    #[test]
    fn message_arrays_are_split_up_to_the_cap() {
        let body = |n: usize, tail: &str| {
            format!(
                r#"{{"model":"m","messages":[{}{tail}]}}"#,
                vec![r#"{"role":"user","content":"x"}"#; n].join(",")
            )
        };
        let at_cap = body(MAX_SPLIT_MESSAGES, "");
        let p = parse_body(at_cap.as_bytes()).unwrap();
        let m = p.messages.unwrap();
        assert_eq!(m.items.map(|i| i.len()), Some(MAX_SPLIT_MESSAGES));
        let over = body(MAX_SPLIT_MESSAGES + 1, "");
        let p = parse_body(over.as_bytes()).unwrap();
        let m = p.messages.unwrap();
        assert!(m.items.is_none());
        assert!(m.text.starts_with(b"[{") && m.text.ends_with(b"}]"));
        assert!(matches!(
            parse_body(body(MAX_SPLIT_MESSAGES + 5, ",}").as_bytes()),
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
    fn the_output_cap_is_max_completion_tokens_else_max_tokens() {
        let cap = |b: &str| parse_body(b.as_bytes()).unwrap().max_output_tokens;
        assert_eq!(cap(r#"{"model":"m","prompt":"x"}"#), None);
        assert_eq!(cap(r#"{"model":"m","max_tokens":64}"#), Some(64));
        assert_eq!(cap(r#"{"model":"m","max_output_tokens":32}"#), Some(32));
        // The newer name wins, in either order.
        let both = r#"{"model":"m","max_completion_tokens":16,"max_tokens":64}"#;
        assert_eq!(cap(both), Some(16));
        assert_eq!(
            cap(r#"{"max_tokens":64,"model":"m","max_completion_tokens":8}"#),
            Some(8)
        );
        // Not a count: left to the engine, read as none.
        assert_eq!(cap(r#"{"model":"m","max_tokens":-1}"#), None);
        assert_eq!(cap(r#"{"model":"m","max_tokens":"many"}"#), None);
        assert_eq!(cap(r#"{"model":"m","max_tokens":null}"#), None);
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
    /// prompt and messages (and the same message elements), and a rewrite changes nothing else.
    #[test]
    fn agrees_with_a_full_parse_on_mutated_bodies() {
        let seeds: [&[u8]; 8] = [
            br#"{"model":"m","prompt":"hi \"there\" \u00e9","max_tokens":3,"stream":true}"#,
            // Plain strings longer than the walk's first 16-byte step of a string.
            r#"{"model":"m","prompt":"The quick brown fox jumps over the lazy dog, é 漢字 🦀 and on","suffix":"a second plain string, again over thirty-two bytes"}"#.as_bytes(),
            br#"{"model":"m","messages":[ {"role":"system","content":"x"} ,{"role":"user","content":"\"y\""},[1],"z" ] }"#,
            br#"{"model":"m","prompt":[101, 2023,0 ,19,4294967295],"max_tokens":3}"#,
            br#"{"prompt":[7,8,9],"model":"m","prompt":[1,20,300]}"#,
            br#"{"messages":[{"role":"user","content":"a"}],"model":"meta-llama/Llama-3.1-8B","n":[1,2.5e3,null,false]}"#,
            br#" { "model" : "x" , "model" : "y" , "nested" : { "model" : "z" } } "#,
            br#"{"model":"\ud83d\ude00 emoji","temperature":0.7}"#,
        ];
        let mut rng = fastrand::Rng::with_seed(7);
        let (mut accepted, mut rejected, mut ids_read, mut messages_split) = (0, 0, 0, 0);
        // Every other body reads its token ids through one chunk cache (chunks of ~8 bytes here).
        let chunks = IdChunks::new(1 << 12);
        for case in 0..20_000 {
            let mut b = seeds[rng.usize(..seeds.len())].to_vec();
            for _ in 0..rng.usize(0..3) {
                let i = rng.usize(..b.len());
                match rng.u8(..3) {
                    0 => b[i] = b"{}[]\",:0a \\\x01\x80"[rng.usize(..13)],
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
            let parsed = parse_body_with(&b, (case % 2 == 1).then_some(&chunks));
            match (parsed, reference) {
                (Ok(p), Some(model)) => {
                    assert_eq!(p.model, model, "{}", String::from_utf8_lossy(&b));
                    let want_prompt =
                        serde_json::from_slice::<serde_json::Value>(&b).unwrap()["prompt"].clone();
                    match &p.prompt {
                        Some(RawPrompt::Ids(ids)) => {
                            let want: Vec<u32> = serde_json::from_value(want_prompt).unwrap();
                            assert_eq!(ids, &want, "{}", String::from_utf8_lossy(&b));
                            ids_read += 1;
                        }
                        Some(RawPrompt::IdPieces(pieces)) => {
                            let want: Vec<u32> = serde_json::from_value(want_prompt).unwrap();
                            assert_eq!(pieces.concat(), want, "{}", String::from_utf8_lossy(&b));
                            ids_read += 1;
                        }
                        Some(RawPrompt::Json(raw)) => {
                            let got: serde_json::Value = serde_json::from_str(raw.get()).unwrap();
                            assert_eq!(got, want_prompt);
                        }
                        None => assert!(want_prompt.is_null()),
                    }
                    let want_messages = serde_json::from_slice::<serde_json::Value>(&b).unwrap()
                        ["messages"]
                        .clone();
                    match &p.messages {
                        Some(m) => {
                            let text: serde_json::Value = serde_json::from_slice(m.text).unwrap();
                            assert_eq!(text, want_messages);
                            let items = m.items.as_ref().map(|items| {
                                items
                                    .iter()
                                    .map(|i| serde_json::from_str(i.get()).unwrap())
                                    .collect::<Vec<serde_json::Value>>()
                            });
                            assert_eq!(items.as_ref(), want_messages.as_array());
                            messages_split += usize::from(items.is_some_and(|i| i.len() > 1));
                        }
                        None => assert!(want_messages.is_null()),
                    }
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
            accepted > 1000 && rejected > 1000 && ids_read > 300 && messages_split > 300,
            "{accepted} accepted, {rejected} rejected, {ids_read} token-id prompts read, \
             {messages_split} message arrays split"
        );
    }

    #[test]
    fn integer_arrays_read_in_one_pass() {
        assert_eq!(int_array(b"[1, 2 ,3] tail"), Some((vec![1, 2, 3], 9)));
        assert_eq!(int_array(b"[ ]"), Some((vec![], 3)));
        assert_eq!(
            int_array(b"[0,4294967295]"),
            Some((vec![0, 4_294_967_295], 14))
        );
        for unusual in [
            &b"[-1]"[..],
            b"[4294967296]",
            b"[01]",
            b"[1.5]",
            b"[1e3]",
            b"[1,]",
            b"[1 2]",
            b"[\"1\"]",
            b"[1",
            b"[",
        ] {
            assert_eq!(
                int_array(unusual),
                None,
                "{}",
                String::from_utf8_lossy(unusual)
            );
        }
        // Left to serde, which decides: `-0` is 0 there; `[01]` is not JSON.
        let p = parse_body(br#"{"model":"m","prompt":[-0]}"#).unwrap();
        assert!(matches!(p.prompt, Some(RawPrompt::Json(r)) if r.get() == "[-0]"));
        assert!(matches!(
            parse_body(br#"{"model":"m","prompt":[01]}"#),
            Err(BodyError::Malformed(_))
        ));
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
