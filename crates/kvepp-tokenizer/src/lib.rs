//! The model's tokenizer: from prompt text to the token ids the engine will see, so our block hashes equal the ones its
//! KV events carry: the model's HuggingFace `tokenizer.json` (tokenizers crate) and, for chat
//! requests, the chat template of its `tokenizer_config.json` rendered with minijinja the way
//! `transformers` renders it (trim_blocks, lstrip_blocks, Python string methods,
//! `raise_exception`, `add_generation_prompt=True`).
//!
//! As vLLM does: a completions prompt is encoded with the tokenizer's special tokens (e.g. BOS); a
//! rendered chat prompt without them (the template writes its own), a segment at a time with the
//! segments between added tokens cached when that is exact for the tokenizer ([`segments`]),
//! and each new segment tokenized by the model's [`SegmentEncoder`]: kvepp's own byte-level BPE
//! ([`bpe`]: the library's ids without its per-call pipeline) where that covers the tokenizer,
//! else the library, chosen once when the tokenizer is loaded.
//!
//! A chat's messages become the template's values one message at a time, and each message's value
//! is kept in a bounded cache keyed by a 128-bit hash of its raw JSON: the same bytes always give
//! the same value, so a conversation's earlier turns (and their long documents) are not decoded
//! again on every turn. The template itself is rendered over the whole conversation every time;
//! the rendered text is then cut at its added tokens only from near where it stops matching one
//! of the model's recent renders ([`segments`]).
//!
//! Every call into the tokenizer is counted with the CPU time its thread spent in it
//! ([`ModelTokenizer::tokenizer_stats`]): what tokenization costs inside the running process,
//! where its tables compete for the CPU caches with everything else the machine does.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

use minijinja::{Environment, Error as JinjaError, ErrorKind, Value};
use serde_json::value::RawValue;

pub use kvepp_request::generations::CacheStats;
use kvepp_request::{RawJson, RawMessages};

pub mod bpe;
pub mod segments;
use kvepp_request::generations::ContentCache;

#[derive(Debug, thiserror::Error)]
pub enum TokenizeError {
    #[error("{path}: {message}")]
    Load { path: PathBuf, message: String },
    #[error("the model has no chat template")]
    NoChatTemplate,
    #[error("chat template: {0}")]
    Template(String),
    #[error("request prompt: {0}")]
    Prompt(String),
    #[error("tokenizer: {0}")]
    Encode(String),
}

/// Token ids the segment cache of one model keeps at most (16 MiB).
pub const SEGMENT_CACHE_IDS: usize = 4 << 20;

/// Raw JSON bytes of messages the message cache of one model keeps at most (their values take
/// about as much), each message weighing [`MESSAGE_OVERHEAD_BYTES`] more than its JSON.
pub const MESSAGE_CACHE_BYTES: usize = 32 << 20;

/// What a cached message weighs beyond its JSON: its key, table slot and the template value's own
/// structure (a map of a few entries), so a flood of short messages stays within the capacity.
pub const MESSAGE_OVERHEAD_BYTES: usize = 256;

/// Room a rendered chat template gets beyond its messages' JSON (role markers, a system prompt
/// of its own); more than that and the buffer grows as any other.
const RENDER_SLACK_BYTES: usize = 4 << 10;

/// A model's tokenizer and chat template.
pub struct ModelTokenizer {
    tokenizer: tokenizers::Tokenizer,
    /// Chat prompts segment by segment (None: not exact for this tokenizer; whole prompts).
    segments: Option<crate::segments::SegmentTokenizer>,
    /// The segments' own byte-level BPE (None: not of a shape it covers; the library's path).
    bpe: Option<crate::bpe::ByteBpe>,
    /// The ids the post-processor puts before and after a completions prompt's own (BOS, ...),
    /// when that is all it does (see [`special_wrap`]); with [`Self::bpe`], a completions prompt
    /// without added tokens in its text is tokenized by it.
    wrap: Option<(Vec<u32>, Vec<u32>)>,
    env: Option<Environment<'static>>,
    /// Raw message JSON hash → the message as a template value, weighed in bytes.
    messages: ContentCache<Value>,
    bos: String,
    eos: String,
    /// Calls into the tokenizer and the thread CPU time they took (ns).
    calls: AtomicU64,
    cpu_nanos: AtomicU64,
}

/// Text between added tokens to token ids, no special tokens added: the one job the segment
/// cache asks of a tokenizer for each new segment. Two implementations: the `tokenizers`
/// library's pipeline, and kvepp's own byte-level BPE ([`bpe::ByteBpe`]), which gives the
/// library's ids (tested against it on the fixture and on DeepSeek's tokenizer) at a fraction of
/// its time (`cargo bench --bench tokenize`) where it covers the tokenizer.
pub trait SegmentEncoder: Send + Sync {
    fn encode_segment(&self, text: &str) -> Result<Vec<u32>, TokenizeError>;
}

impl SegmentEncoder for tokenizers::Tokenizer {
    fn encode_segment(&self, text: &str) -> Result<Vec<u32>, TokenizeError> {
        self.encode_fast(text, false)
            .map(|e| e.get_ids().to_vec())
            .map_err(|e| TokenizeError::Encode(e.to_string()))
    }
}

impl SegmentEncoder for bpe::ByteBpe {
    fn encode_segment(&self, text: &str) -> Result<Vec<u32>, TokenizeError> {
        Ok(self.encode(text))
    }
}

/// A model tokenizer's own work so far: calls into the tokenizer and the CPU time their threads
/// spent in them.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct TokenizerStats {
    pub calls: u64,
    pub cpu_nanos: u64,
}

/// This thread's CPU time (ns): the clock only this thread's running advances.
pub fn thread_cpu_nanos() -> u64 {
    let t = rustix::time::clock_gettime(rustix::time::ClockId::ThreadCPUTime);
    u64::try_from(t.tv_sec).unwrap_or(0) * 1_000_000_000 + u64::try_from(t.tv_nsec).unwrap_or(0)
}

impl std::fmt::Debug for ModelTokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ModelTokenizer")
            .field("chat_template", &self.env.is_some())
            .field("bos", &self.bos)
            .finish()
    }
}

/// `"<s>"` or `{"content": "<s>", ...}` (an AddedToken), as tokenizer_config.json writes them.
fn token_text(v: Option<&serde_json::Value>) -> String {
    match v {
        Some(serde_json::Value::String(s)) => s.clone(),
        Some(serde_json::Value::Object(o)) => o
            .get("content")
            .and_then(|c| c.as_str())
            .unwrap_or_default()
            .to_owned(),
        _ => String::new(),
    }
}

impl ModelTokenizer {
    /// Loads `dir/tokenizer.json` and, when present, `dir/tokenizer_config.json`.
    pub fn load(dir: &Path) -> Result<Self, TokenizeError> {
        let tok_path = dir.join("tokenizer.json");
        let tokenizer =
            tokenizers::Tokenizer::from_file(&tok_path).map_err(|e| TokenizeError::Load {
                path: tok_path.clone(),
                message: e.to_string(),
            })?;
        let cfg_path = dir.join("tokenizer_config.json");
        let cfg: serde_json::Value = match std::fs::read(&cfg_path) {
            Ok(bytes) => serde_json::from_slice(&bytes).map_err(|e| TokenizeError::Load {
                path: cfg_path.clone(),
                message: e.to_string(),
            })?,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => serde_json::Value::Null,
            Err(e) => {
                return Err(TokenizeError::Load {
                    path: cfg_path,
                    message: e.to_string(),
                })
            }
        };
        let env = match cfg.get("chat_template").and_then(|t| t.as_str()) {
            Some(t) => Some(
                Self::environment(t.to_owned()).map_err(|e| TokenizeError::Load {
                    path: cfg_path.clone(),
                    message: format!("chat_template: {e}"),
                })?,
            ),
            None => None,
        };
        let segments = crate::segments::SegmentTokenizer::new(&tokenizer, SEGMENT_CACHE_IDS);
        let bpe = segments
            .as_ref()
            .and_then(|_| crate::bpe::ByteBpe::new(&tokenizer));
        let wrap = bpe.as_ref().and_then(|bpe| special_wrap(&tokenizer, bpe));
        Ok(ModelTokenizer {
            segments,
            bpe,
            wrap,
            tokenizer,
            env,
            messages: ContentCache::new(MESSAGE_CACHE_BYTES, MESSAGE_OVERHEAD_BYTES),
            bos: token_text(cfg.get("bos_token")),
            eos: token_text(cfg.get("eos_token")),
            calls: AtomicU64::new(0),
            cpu_nanos: AtomicU64::new(0),
        })
    }

    fn environment(template: String) -> Result<Environment<'static>, JinjaError> {
        let mut env = Environment::new();
        env.set_trim_blocks(true);
        env.set_lstrip_blocks(true);
        env.set_unknown_method_callback(|state, value, method, args| {
            match untrimmed(value, method, args.is_empty()) {
                Some(same) => Ok(same),
                None => {
                    minijinja_contrib::pycompat::unknown_method_callback(state, value, method, args)
                }
            }
        });
        env.add_filter(
            "trim",
            |state: &minijinja::State, value: Value, chars: Option<std::borrow::Cow<'_, str>>| {
                match untrimmed(&value, "strip", chars.is_none()) {
                    Some(same) => Ok(same),
                    None => Ok(minijinja::filters::trim(
                        minijinja::value::StringInput::new(state, &value)?,
                        chars,
                    )),
                }
            },
        );
        env.add_function(
            "raise_exception",
            |msg: String| -> Result<String, JinjaError> {
                Err(JinjaError::new(ErrorKind::InvalidOperation, msg))
            },
        );
        env.add_template_owned("chat", template)?;
        Ok(env)
    }

    fn encode(&self, text: &str, special: bool) -> Result<Vec<u32>, TokenizeError> {
        self.counted(|| {
            self.tokenizer
                .encode_fast(text, special)
                .map(|e| e.get_ids().to_vec())
                .map_err(|e| TokenizeError::Encode(e.to_string()))
        })
    }

    /// What tokenizes text between added tokens for this model: kvepp's own byte-level BPE where
    /// it covers the tokenizer (decided once, at load), else the library's pipeline.
    fn segment_encoder(&self) -> &dyn SegmentEncoder {
        match &self.bpe {
            Some(bpe) => bpe,
            None => &self.tokenizer,
        }
    }

    /// The ids of text between added tokens (no special tokens added), counted.
    fn encode_segment(&self, text: &str) -> Result<Vec<u32>, TokenizeError> {
        self.counted(|| self.segment_encoder().encode_segment(text))
    }

    /// One call into a tokenizer, counted with its thread's CPU time.
    fn counted<T>(&self, call: impl FnOnce() -> T) -> T {
        let start = thread_cpu_nanos();
        let out = call();
        self.cpu_nanos
            .fetch_add(thread_cpu_nanos().saturating_sub(start), Ordering::Relaxed);
        self.calls.fetch_add(1, Ordering::Relaxed);
        out
    }

    /// Calls into the tokenizer so far and the CPU time they took.
    pub fn tokenizer_stats(&self) -> TokenizerStats {
        TokenizerStats {
            calls: self.calls.load(Ordering::Relaxed),
            cpu_nanos: self.cpu_nanos.load(Ordering::Relaxed),
        }
    }

    /// Token ids of a completions `prompt` string (JSON, as in the body).
    pub fn completion_ids(&self, prompt: &str) -> Result<Vec<u32>, TokenizeError> {
        let text: std::borrow::Cow<'_, str> = serde_json::from_str(prompt)
            .map_err(|e| TokenizeError::Prompt(format!("prompt is not one string: {e}")))?;
        match (&self.wrap, &self.segments) {
            // `wrap` is only there with the own BPE, which `encode_segment` then calls.
            (Some((before, after)), Some(s)) if !s.has_added_token(&text) => {
                let mut ids = before.clone();
                ids.extend(self.encode_segment(&text)?);
                ids.extend_from_slice(after);
                Ok(ids)
            }
            _ => self.encode(&text, true),
        }
    }

    /// The chat template applied to `messages` (JSON, as in the body), with the generation prompt.
    pub fn render_chat(&self, messages: &RawValue) -> Result<String, TokenizeError> {
        self.render_messages(&RawMessages::of(messages))
    }

    /// [`Self::render_chat`] of messages the body scanner has already split.
    pub fn render_messages(&self, messages: &RawMessages<'_>) -> Result<String, TokenizeError> {
        let rendered = self.render_into(messages)?;
        String::from_utf8(rendered).map_err(|e| TokenizeError::Template(e.to_string()))
    }

    /// The chat template applied to `messages`, as UTF-8 bytes in one buffer sized from the
    /// messages' own text (a rendered conversation is about as long as its JSON), so a long
    /// conversation is written once instead of into a string that grows by doubling.
    fn render_into(&self, messages: &RawMessages<'_>) -> Result<Vec<u8>, TokenizeError> {
        let env = self.env.as_ref().ok_or(TokenizeError::NoChatTemplate)?;
        let values = match &messages.items {
            Some(items) => Value::from(
                items
                    .iter()
                    .enumerate()
                    .map(|(k, m)| self.message_value(m, messages.item_key(k)))
                    .collect::<Result<Vec<_>, _>>()?,
            ),
            // Not an array: whatever it is, the template decides what to make of it.
            None => serde_json::from_slice(messages.text)
                .map_err(|e| TokenizeError::Prompt(e.to_string()))?,
        };
        let t = env
            .get_template("chat")
            .map_err(|e| TokenizeError::Template(e.to_string()))?;
        let mut out = Vec::with_capacity(messages.text.len() + RENDER_SLACK_BYTES);
        t.render_captured_to(
            minijinja::context! {
                messages => values,
                add_generation_prompt => true,
                bos_token => &self.bos,
                eos_token => &self.eos,
            },
            &mut out,
        )
        .map_err(|e| TokenizeError::Template(e.to_string()))?;
        Ok(out)
    }

    /// One message as a template value (straight from JSON, no serde_json::Value in between), from
    /// the cache when these bytes were seen recently, under `key` (the body scanner's key of
    /// these bytes: [`RawMessages::item_key`]).
    fn message_value(&self, raw: &RawJson<'_>, key: Option<u128>) -> Result<Value, TokenizeError> {
        let bytes = raw.get().as_bytes();
        let key = key.unwrap_or_else(|| ContentCache::<Value>::key(bytes));
        self.messages.get_or_make_keyed(key, || {
            serde_json::from_str::<Value>(raw.get())
                .map(|v| (v, bytes.len()))
                .map_err(|e| TokenizeError::Prompt(e.to_string()))
        })
    }

    /// The message cache's counters.
    pub fn message_stats(&self) -> CacheStats {
        self.messages.stats()
    }

    /// Token ids of a chat request's `messages`.
    pub fn chat_ids(&self, messages: &RawValue) -> Result<Vec<u32>, TokenizeError> {
        self.messages_ids(&RawMessages::of(messages))
    }

    /// [`Self::chat_ids`] of messages the body scanner has already split.
    pub fn messages_ids(&self, messages: &RawMessages<'_>) -> Result<Vec<u32>, TokenizeError> {
        let rendered = self.render_into(messages)?;
        self.text_ids(rendered_text(&rendered)?)
    }

    /// A chat request's `messages` tokenized as the router takes them: the pieces the ids come
    /// in (each segment's ids as the segment cache holds them, shared, no copy into one array)
    /// when segments are exact for this tokenizer, else the whole rendered prompt's ids.
    pub fn messages_prompt<'a>(
        &self,
        messages: &RawMessages<'_>,
    ) -> Result<kvepp_core::Prompt<'a>, TokenizeError> {
        let rendered = self.render_into(messages)?;
        match &self.segments {
            Some(s) => s
                .encode_rendered(rendered, not_utf8, |seg| self.encode_segment(seg))
                .map(kvepp_core::Prompt::Pieces),
            None => self
                .encode(rendered_text(&rendered)?, false)
                .map(kvepp_core::Prompt::Tokens),
        }
    }

    /// Token ids of rendered text without special tokens added: a segment at a time from the
    /// cache when that is exact for this tokenizer, else whole.
    pub fn text_ids(&self, text: &str) -> Result<Vec<u32>, TokenizeError> {
        match &self.segments {
            Some(s) => s.encode(text, |seg| self.encode_segment(seg)),
            None => self.encode(text, false),
        }
    }

    /// Token ids of rendered text, tokenized whole (what [`Self::text_ids`] must equal).
    pub fn text_ids_whole(&self, text: &str) -> Result<Vec<u32>, TokenizeError> {
        self.encode(text, false)
    }

    /// The ids of `text`, which has no added token in it, as a segment of it is tokenized (the
    /// segments' own BPE where it covers this tokenizer): what the new text of a chat turn costs.
    pub fn segment_ids(&self, text: &str) -> Result<Vec<u32>, TokenizeError> {
        self.encode_segment(text)
    }

    /// Whether segments are tokenized by kvepp's own byte-level BPE ([`bpe`]).
    pub fn own_bpe(&self) -> bool {
        self.bpe.is_some()
    }

    /// Whether completions prompts without added tokens go through that BPE (between the ids the
    /// post-processor adds).
    pub fn own_completions(&self) -> bool {
        // `wrap` is read only when the own BPE is there.
        self.wrap.is_some()
    }

    /// The segment cache's counters (None: this tokenizer tokenizes whole).
    pub fn segment_stats(&self) -> Option<crate::segments::SegmentStats> {
        self.segments.as_ref().map(|s| s.stats())
    }

    /// Chat prompts that resumed from a recent render (hits) and long ones that could not
    /// (misses); None: this tokenizer tokenizes whole.
    pub fn render_stats(&self) -> Option<crate::segments::SegmentStats> {
        self.segments.as_ref().map(|s| s.render_stats())
    }
}

/// What `tok`'s post-processor does to one sequence with special tokens added, as the ids it puts
/// before and after it, when that is all it does (BOS, `<s>…</s>`, nothing): read from a
/// one-token sequence, then checked against the library's own `encode(text, true)` on a few
/// texts through `bpe`; None otherwise (truncation, padding, or any other outcome).
fn special_wrap(
    tok: &tokenizers::Tokenizer,
    bpe: &crate::bpe::ByteBpe,
) -> Option<(Vec<u32>, Vec<u32>)> {
    const MARK: u32 = u32::MAX - 7;
    let one = tokenizers::Encoding::from_tokens(
        vec![tokenizers::Token::new(MARK, String::new(), (0, 0))],
        0,
    );
    let ids = tok.post_process(one, None, true).ok()?.get_ids().to_vec();
    let at = ids.iter().position(|&id| id == MARK)?;
    if ids.iter().filter(|&&id| id == MARK).count() != 1 {
        return None;
    }
    let (before, after) = (ids[..at].to_vec(), ids[at + 1..].to_vec());
    let agrees = ["", "Hello, world!", " 42 routes\n\n  blocks"]
        .iter()
        .all(|text| {
            let want = tok.encode_fast(*text, true).ok();
            let got: Vec<u32> = [before.as_slice(), &bpe.encode(text), after.as_slice()].concat();
            want.is_some_and(|w| w.get_ids() == got.as_slice())
        });
    agrees.then_some((before, after))
}

/// The rendered template's bytes as text (one vectorised UTF-8 check: the template writes only
/// strings, so this fails only if minijinja broke that).
fn rendered_text(rendered: &[u8]) -> Result<&str, TokenizeError> {
    simdutf8::basic::from_utf8(rendered).map_err(|_| not_utf8())
}

fn not_utf8() -> TokenizeError {
    TokenizeError::Template("the rendered template is not UTF-8".into())
}

/// A string that `.strip()`, `.lstrip()`, `.rstrip()` or `| trim` without arguments leaves as it
/// is (`bare`: no arguments given): the value itself, where Python-compatible methods and the
/// builtin filter would copy it (a long document, on every turn). None: let them do their work.
fn untrimmed(value: &Value, method: &str, bare: bool) -> Option<Value> {
    let s = value.as_str().filter(|_| bare)?;
    let trimmed = match method {
        "strip" => s.trim(),
        "lstrip" => s.trim_start(),
        "rstrip" => s.trim_end(),
        _ => return None,
    };
    (trimmed.len() == s.len()).then(|| value.clone())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fixture() -> ModelTokenizer {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/tokenizer");
        ModelTokenizer::load(&dir).expect("fixture tokenizer")
    }

    /// A completions prompt without added tokens goes through the own BPE between the
    /// post-processor's ids (the fixture's `<s>`, id 0, before), and equals the library's
    /// `encode(text, true)`; one with an added token's text in it keeps the library's path.
    #[test]
    fn completion_prompts_through_the_own_bpe_equal_the_library() {
        let tok = fixture();
        assert_eq!(tok.wrap, Some((vec![0], vec![])));
        let mut rng = fastrand::Rng::with_seed(6);
        const WORDS: &[&str] = &[
            " the", " KV", "cache", "\n", "  ", "42", "é", "日本", "<s>", "'s",
        ];
        for i in 0..300 {
            let text: String = (0..1 + i % 40)
                .map(|_| WORDS[rng.usize(..WORDS.len())])
                .collect();
            let want = tok.tokenizer.encode_fast(text.as_str(), true).unwrap();
            let prompt = serde_json::to_string(&text).unwrap();
            assert_eq!(
                tok.completion_ids(&prompt).unwrap(),
                want.get_ids(),
                "{text:?}"
            );
        }
    }

    /// The simple reference: the whole `messages` decoded at once, nothing cached.
    fn render_whole(t: &ModelTokenizer, raw: &RawValue) -> String {
        let messages: Value = serde_json::from_str(raw.get()).expect("json");
        let env = t.env.as_ref().expect("template");
        env.get_template("chat")
            .expect("chat")
            .render(minijinja::context! {
                messages => messages,
                add_generation_prompt => true,
                bos_token => &t.bos,
                eos_token => &t.eos,
            })
            .expect("render")
    }

    /// Conversations growing turn by turn (long and short messages, escapes, non-ASCII, and now
    /// and then an earlier message edited at its end or repeated under another role): rendering message by message with the cache
    /// gives exactly the whole-value rendering, and later turns reuse earlier messages.
    #[test]
    fn messages_rendered_one_by_one_with_the_cache_equal_the_whole_rendering() {
        let t = fixture();
        let mut rng = fastrand::Rng::with_seed(11);
        const WORDS: &[&str] = &[
            "the",
            " cache",
            "\n",
            "\"quoted\"",
            " é",
            " 中文",
            "\t",
            "\\",
            " KV",
        ];
        let mut text = |words: usize| -> String {
            (0..words)
                .map(|_| WORDS[rng.usize(..WORDS.len())])
                .collect()
        };
        let mut renders = 0;
        for _ in 0..10 {
            let mut messages = vec![serde_json::json!({"role": "system", "content": text(200)})];
            for turn in 0..8 {
                let role = if turn % 2 == 0 { "user" } else { "assistant" };
                let words = [5, 40, 150][turn % 3];
                messages.push(serde_json::json!({"role": role, "content": text(words)}));
                if turn == 5 {
                    // An earlier message edited at its end, and one repeated under another role:
                    // bytes that differ only near their end, so new values.
                    let edited = format!("{}!", messages[0]["content"].as_str().unwrap_or(""));
                    messages[0]["content"] = edited.into();
                    let repeated = messages[0]["content"].clone();
                    messages.push(serde_json::json!({"role": "user", "content": repeated}));
                }
                let raw =
                    RawValue::from_string(serde_json::Value::from(messages.clone()).to_string())
                        .expect("raw");
                assert_eq!(t.render_chat(&raw).expect("render"), render_whole(&t, &raw));
                renders += 1;
            }
        }
        let s = t.message_stats();
        assert_eq!(renders, 80);
        assert!(
            s.hits > 2 * s.misses,
            "earlier turns come from the cache: {s:?}"
        );
    }

    /// `.strip()`, `.lstrip()`, `.rstrip()` and `| trim` answer as minijinja's own filter and the
    /// Python-compatible methods do, on strings with and without whitespace to strip, with
    /// arguments, on safe strings and on other kinds of values.
    #[test]
    fn strip_and_trim_without_copies_answer_as_before() {
        let template = "{% for v in values %}[{{ v.strip() }}|{{ v.lstrip() }}|{{ v.rstrip() }}|\
            {{ v | trim }}|{{ v.strip('x') }}|{{ v | trim('x') }}|{{ (v | trim) is safe }}]{% endfor %}\
            {{ (safe | trim) is safe }}{{ safe.strip() }}{{ 7 | trim }}{{ none | trim }}";
        let ours = ModelTokenizer::environment(template.to_owned()).expect("template");
        let mut reference = Environment::new();
        reference.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        reference
            .add_template_owned("chat", template.to_owned())
            .expect("template");
        let ctx = minijinja::context! {
            values => ["plain", "  padded\n", "xx", "\tlead", "trail \u{3000}", "", "x in x"],
            safe => Value::from_safe_string("<b>ok</b> ".to_owned()),
        };
        let render =
            |env: &Environment<'_>| env.get_template("chat").unwrap().render(&ctx).unwrap();
        let want = render(&reference);
        assert!(want.contains("[padded|padded\n|  padded|padded|"), "{want}");
        assert_eq!(render(&ours), want);
        // Undefined stays an error either way (strict or not, as the reference says).
        let undefined = "{{ missing | trim }}";
        let ours = ModelTokenizer::environment(undefined.to_owned()).expect("template");
        let mut reference = Environment::new();
        reference
            .add_template_owned("chat", undefined.to_owned())
            .expect("template");
        let render = |env: &Environment<'_>| env.get_template("chat").unwrap().render(()).ok();
        assert_eq!(render(&ours), render(&reference));
    }
}
