//! From prompt text to the token ids the engine will see, so our block hashes equal the ones its
//! KV events carry: the model's HuggingFace `tokenizer.json` (tokenizers crate) and, for chat
//! requests, the chat template of its `tokenizer_config.json` rendered with minijinja the way
//! `transformers` renders it (trim_blocks, lstrip_blocks, Python string methods,
//! `raise_exception`, `add_generation_prompt=True`).
//!
//! As vLLM does: a completions prompt is encoded with the tokenizer's special tokens (e.g. BOS); a
//! rendered chat prompt without them (the template writes its own), a segment at a time with the
//! segments between added tokens cached when that is exact for the tokenizer ([`super::segments`]).

use std::path::{Path, PathBuf};

use minijinja::{Environment, Error as JinjaError, ErrorKind};
use serde_json::value::RawValue;

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

/// A model's tokenizer and chat template.
pub struct ModelTokenizer {
    tokenizer: tokenizers::Tokenizer,
    /// Chat prompts segment by segment (None: not exact for this tokenizer; whole prompts).
    segments: Option<super::segments::SegmentTokenizer>,
    env: Option<Environment<'static>>,
    bos: String,
    eos: String,
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
        let segments = super::segments::SegmentTokenizer::new(&tokenizer, SEGMENT_CACHE_IDS);
        Ok(ModelTokenizer {
            segments,
            tokenizer,
            env,
            bos: token_text(cfg.get("bos_token")),
            eos: token_text(cfg.get("eos_token")),
        })
    }

    fn environment(template: String) -> Result<Environment<'static>, JinjaError> {
        let mut env = Environment::new();
        env.set_trim_blocks(true);
        env.set_lstrip_blocks(true);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
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
        self.tokenizer
            .encode_fast(text, special)
            .map(|e| e.get_ids().to_vec())
            .map_err(|e| TokenizeError::Encode(e.to_string()))
    }

    /// Token ids of a completions `prompt` string (JSON, as in the body).
    pub fn completion_ids(&self, prompt: &RawValue) -> Result<Vec<u32>, TokenizeError> {
        let text: std::borrow::Cow<'_, str> = serde_json::from_str(prompt.get())
            .map_err(|e| TokenizeError::Prompt(format!("prompt is not one string: {e}")))?;
        self.encode(&text, true)
    }

    /// The chat template applied to `messages` (JSON, as in the body), with the generation prompt.
    pub fn render_chat(&self, messages: &RawValue) -> Result<String, TokenizeError> {
        let env = self.env.as_ref().ok_or(TokenizeError::NoChatTemplate)?;
        // Straight into the template's values (no serde_json::Value in between to convert).
        let messages: minijinja::Value = serde_json::from_str(messages.get())
            .map_err(|e| TokenizeError::Prompt(e.to_string()))?;
        let t = env
            .get_template("chat")
            .map_err(|e| TokenizeError::Template(e.to_string()))?;
        t.render(minijinja::context! {
            messages => messages,
            add_generation_prompt => true,
            bos_token => &self.bos,
            eos_token => &self.eos,
        })
        .map_err(|e| TokenizeError::Template(e.to_string()))
    }

    /// Token ids of a chat request's `messages`.
    pub fn chat_ids(&self, messages: &RawValue) -> Result<Vec<u32>, TokenizeError> {
        let text = self.render_chat(messages)?;
        self.text_ids(&text)
    }

    /// Token ids of rendered text without special tokens added: a segment at a time from the
    /// cache when that is exact for this tokenizer, else whole.
    pub fn text_ids(&self, text: &str) -> Result<Vec<u32>, TokenizeError> {
        match &self.segments {
            Some(s) => s.encode(text, |seg| self.encode(seg, false)),
            None => self.encode(text, false),
        }
    }

    /// Token ids of rendered text, tokenized whole (what [`Self::text_ids`] must equal).
    pub fn text_ids_whole(&self, text: &str) -> Result<Vec<u32>, TokenizeError> {
        self.encode(text, false)
    }

    /// The segment cache's counters (None: this tokenizer tokenizes whole).
    pub fn segment_stats(&self) -> Option<super::segments::SegmentStats> {
        self.segments.as_ref().map(|s| s.stats())
    }
}
