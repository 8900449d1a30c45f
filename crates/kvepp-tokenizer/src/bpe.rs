//! Byte-level BPE for the text between added tokens, without the HuggingFace pipeline's per-call
//! machinery.
//!
//! `tokenizers` runs every call through its general pipeline: the text becomes a
//! `NormalizedString` with an alignment pair per byte, each split makes new ones, the byte-level
//! step rewrites every piece into its 256-letter alphabet, the model builds a `Token` with its own
//! `String` per id, and the result is an `Encoding` with offsets, masks and type ids. For the ids
//! of one chat turn (a few hundred tokens) that is most of the call, and its allocations churn a
//! few hundred KiB that a request's body has just pushed out of the CPU caches. [`ByteBpe`] does
//! the same work on the raw bytes: the same regex splits (each run on each piece of the one
//! before; a word regex whose only look-around is the usual whitespace tail runs on the `regex`
//! crate's automaton with that tail applied by hand, any other on `fancy-regex` as the library
//! runs it), then BPE merges on byte ids, ids straight into the caller's vector; a piece's ids are
//! remembered by its bytes (as the model's own word cache does).
//!
//! It covers what [`super::segments`] covers and is built only from the loaded tokenizer's own
//! serialized parts: no normalizer or one that changes nothing, a pre-tokenizer that is `Split`s
//! (`Isolated` or `Removed`, not inverted) ending in a `ByteLevel` without a prefix space, or a
//! `ByteLevel` alone (with or without its GPT-2 regex), and a BPE model without dropout, subword
//! prefix or suffix, whose vocabulary has all 256 byte letters; any other tokenizer gets None and
//! keeps the library's path.
//!
//! Invariants: for text with no added token in it, [`ByteBpe::encode`] equals the library's
//! `encode(text, false)` ids; the merges follow the model's own order (lowest rank first, leftmost
//! first among equals, an entry whose pair has changed skipped), and a piece the model would take
//! whole (`ignore_merges`) is taken whole. The piece cache holds at most [`PIECE_CACHE_ENTRIES`]
//! pieces of at most [`PIECE_CACHE_BYTES`] bytes and is emptied when full; lookups share a read
//! lock, and a call that computed new pieces takes the write lock once, after its lookups.

use std::collections::{BinaryHeap, HashMap};
use std::hash::{BuildHasherDefault, Hasher};

use parking_lot::RwLock;
use serde_json::Value;

/// Pieces the cache remembers before it is emptied.
pub const PIECE_CACHE_ENTRIES: usize = 16_384;
/// The longest piece the cache remembers, in bytes (longer ones rarely come again).
pub const PIECE_CACHE_BYTES: usize = 64;

/// The GPT-2 pre-tokenizer regex that `ByteLevel` with `use_regex` splits by.
const GPT2_SPLIT: &str =
    r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+";

/// One regex split: pieces are the matches and what lies between them (`keep_matches`), or only
/// what lies between (`Removed`).
struct RegexSplit {
    re: Matcher,
    keep_matches: bool,
}

/// The tail of the GPT-2, Llama 3, Qwen and DeepSeek word regexes: a whitespace run, less its
/// last character when a non-space follows (that character then leads the next word).
const WHITESPACE_TAIL: &str = r"|\s+(?!\S)|\s+";

/// A split's regex: as `fancy-regex` compiles it, or, when its only look-around is
/// [`WHITESPACE_TAIL`], the `regex` crate's automaton for the same pattern with that tail as a
/// plain `\s+` group, and the look-ahead applied to the matches that group makes (see
/// [`Matcher::each_match`]).
enum Matcher {
    Fancy(fancy_regex::Regex),
    Plain {
        re: regex::Regex,
        /// The tail group's index.
        tail: usize,
    },
}

impl Matcher {
    fn new(pattern: &str) -> Option<Self> {
        if let Some(rest) = pattern.strip_suffix(WHITESPACE_TAIL) {
            let plain = format!("(?:{rest})|(?P<kvepp_tail>\\s+)");
            // Only a pattern that never matches empty text (anywhere: assertions too), so each
            // search moves on from the last match's end.
            let nonempty = regex_syntax::parse(&plain)
                .is_ok_and(|hir| hir.properties().minimum_len().is_some_and(|n| n > 0));
            if let Some(re) = nonempty.then(|| regex::Regex::new(&plain).ok()).flatten() {
                if let Some(tail) = re.capture_names().position(|n| n == Some("kvepp_tail")) {
                    return Some(Matcher::Plain { re, tail });
                }
            }
        }
        fancy_regex::Regex::new(pattern).ok().map(Matcher::Fancy)
    }

    /// Calls `each` with every match's byte range in `text`, in order, as `fancy-regex`'s
    /// iterator gives them (which ends at a match that gives up: its backtracking limit).
    ///
    /// The plain automaton's matches are leftmost-first, as backtracking's are, so they are the
    /// same as the look-ahead pattern's except where the tail alternative matched: there `\s+`
    /// took the whole run, and `\s+(?!\S)` (tried first) takes the run less its last
    /// character when a non-space follows and the run has two or more (with one, it fails and
    /// the plain `\s+` takes that one). The group is read only for whitespace matches.
    fn each_match(&self, text: &str, each: &mut dyn FnMut(usize, usize)) {
        match self {
            Matcher::Fancy(re) => {
                for m in re.find_iter(text) {
                    let Ok(m) = m else { break };
                    each(m.start(), m.end());
                }
            }
            Matcher::Plain { re, tail } => {
                // Allocated at the first whitespace match only (most pieces have none).
                let mut locs = None;
                let mut at = 0;
                // Not `find_iter`: a shortened match's next search starts where it now ends.
                while let Some(m) = re.find_at(text, at) {
                    let (start, mut end) = (m.start(), m.end());
                    let run = m.as_str();
                    if run.chars().all(char::is_whitespace) {
                        let locs = locs.get_or_insert_with(|| re.capture_locations());
                        re.captures_read_at(locs, text, start);
                        let from_tail = locs.get(*tail).is_some();
                        let before_word = text[end..]
                            .chars()
                            .next()
                            .is_some_and(|c| !c.is_whitespace());
                        let last = run.chars().next_back().map_or(0, char::len_utf8);
                        if from_tail && before_word && run.len() > last {
                            end -= last;
                        }
                    }
                    each(start, end);
                    // Never empty (`Matcher::new` checked), so this moves on.
                    at = end;
                }
            }
        }
    }
}

/// Hashes a merge pair's packed ids (the table's keys are fixed by the tokenizer file, so a
/// multiplicative hash cannot be flooded by a prompt).
#[derive(Default)]
struct PairHasher(u64);

impl Hasher for PairHasher {
    fn finish(&self) -> u64 {
        self.0
    }
    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 = (self.0.rotate_left(8) ^ u64::from(b)).wrapping_mul(0x9E37_79B9_7F4A_7C15);
        }
    }
    fn write_u64(&mut self, v: u64) {
        self.0 = (v ^ (v >> 29)).wrapping_mul(0x9E37_79B9_7F4A_7C15);
    }
}

type PairMap = HashMap<u64, (u32, u32), BuildHasherDefault<PairHasher>>;

/// A piece's bytes and its ids.
type Piece = (PieceBytes, Box<[u32]>);
/// A piece's bytes (a cache key).
type PieceBytes = Box<[u8]>;

/// A byte-level BPE tokenizer for text without added tokens (see the module doc).
pub struct ByteBpe {
    splits: Vec<RegexSplit>,
    byte_ids: [u32; 256],
    /// (left id, right id) packed → (rank, merged id).
    merges: PairMap,
    /// `ignore_merges`: pieces that are one token, by their bytes.
    whole: Option<HashMap<Box<[u8]>, u32>>,
    cache: RwLock<HashMap<PieceBytes, Box<[u32]>>>,
}

impl std::fmt::Debug for ByteBpe {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ByteBpe")
            .field("splits", &self.splits.len())
            .field("merges", &self.merges.len())
            .field("ignore_merges", &self.whole.is_some())
            .finish()
    }
}

/// GPT-2's byte letters: the printable Latin-1 bytes stand for themselves, the other 68 for
/// U+0100 onwards, in byte order.
fn byte_letters() -> [char; 256] {
    let printable = |b: u8| matches!(b, b'!'..=b'~' | 0xA1..=0xAC | 0xAE..=0xFF);
    let mut letters = ['\0'; 256];
    let mut next = 256u32;
    for b in 0..=255u8 {
        letters[usize::from(b)] = if printable(b) {
            char::from(b)
        } else {
            let c = char::from_u32(next).unwrap_or('\0');
            next += 1;
            c
        };
    }
    letters
}

/// A vocabulary entry's bytes (None: a letter outside the byte alphabet, so no piece is it).
fn entry_bytes(token: &str, byte_of: &HashMap<char, u8>) -> Option<Vec<u8>> {
    token.chars().map(|c| byte_of.get(&c).copied()).collect()
}

fn pack(left: u32, right: u32) -> u64 {
    (u64::from(left) << 32) | u64::from(right)
}

/// The splits a serialized pre-tokenizer makes before its byte-level step (None: not a shape
/// this covers).
fn splits_of(pre: &Value) -> Option<Vec<RegexSplit>> {
    let byte_level = |p: &Value| -> Option<Option<RegexSplit>> {
        if p["type"] != "ByteLevel" || p["add_prefix_space"] != false {
            return None;
        }
        Some(match p["use_regex"].as_bool() {
            Some(false) => None,
            _ => Some(RegexSplit {
                re: Matcher::new(GPT2_SPLIT)?,
                keep_matches: true,
            }),
        })
    };
    let split = |p: &Value| -> Option<RegexSplit> {
        if p["type"] != "Split" || p["invert"] != false {
            return None;
        }
        let keep_matches = match p["behavior"].as_str()? {
            "Isolated" => true,
            "Removed" => false,
            _ => return None,
        };
        let pattern = match (
            p["pattern"]["Regex"].as_str(),
            p["pattern"]["String"].as_str(),
        ) {
            (Some(re), None) => re.to_owned(),
            (None, Some(s)) => fancy_regex::escape(s).into_owned(),
            _ => return None,
        };
        Some(RegexSplit {
            re: Matcher::new(&pattern)?,
            keep_matches,
        })
    };
    match pre["type"].as_str()? {
        "ByteLevel" => Some(byte_level(pre)?.into_iter().collect()),
        "Sequence" => {
            let (last, before) = pre["pretokenizers"].as_array()?.split_last()?;
            let mut splits: Vec<RegexSplit> = before.iter().map(split).collect::<Option<_>>()?;
            splits.extend(byte_level(last)?);
            Some(splits)
        }
        _ => None,
    }
}

/// The model's merge table from its serialized merges, ranks in order (a later duplicate
/// overwrites, as the model's own table does).
fn merges_of(model: &Value, vocab: &serde_json::Map<String, Value>) -> Option<PairMap> {
    let id = |t: &str| vocab.get(t)?.as_u64().and_then(|v| u32::try_from(v).ok());
    let list = model["merges"].as_array()?;
    let mut merges = PairMap::with_capacity_and_hasher(list.len(), Default::default());
    for (rank, m) in list.iter().enumerate() {
        let (a, b) = match m {
            Value::Array(pair) => (pair.first()?.as_str()?, pair.get(1)?.as_str()?),
            Value::String(s) => s.split_once(' ')?,
            _ => return None,
        };
        let merged = id(&format!("{a}{b}"))?;
        merges.insert(pack(id(a)?, id(b)?), (u32::try_from(rank).ok()?, merged));
    }
    Some(merges)
}

impl ByteBpe {
    /// The byte-level BPE of `tok` when it is of the shape this covers (see the module doc).
    pub fn new(tok: &tokenizers::Tokenizer) -> Option<Self> {
        if let Some(n) = tok.get_normalizer() {
            if !crate::segments::normalizes_nothing(&serde_json::to_value(n).ok()?) {
                return None;
            }
        }
        if tok.get_truncation().is_some() || tok.get_padding().is_some() {
            return None;
        }
        let splits = splits_of(&serde_json::to_value(tok.get_pre_tokenizer()?).ok()?)?;
        let model = serde_json::to_value(tok.get_model()).ok()?;
        let plain = |k: &str| model[k].is_null() || model[k] == "";
        if model["type"] != "BPE"
            || !(model["dropout"].is_null() || model["dropout"] == 0.0)
            || !plain("continuing_subword_prefix")
            || !plain("end_of_word_suffix")
        {
            return None;
        }
        let vocab = model["vocab"].as_object()?;
        let letters = byte_letters();
        let mut byte_ids = [0u32; 256];
        for (b, slot) in byte_ids.iter_mut().enumerate() {
            let id = vocab.get(letters[b].to_string().as_str())?.as_u64()?;
            *slot = u32::try_from(id).ok()?;
        }
        let merges = merges_of(&model, vocab)?;
        let whole = if model["ignore_merges"] == true {
            let byte_of: HashMap<char, u8> =
                (0..=255u8).map(|b| (letters[usize::from(b)], b)).collect();
            let mut whole = HashMap::with_capacity(vocab.len());
            for (token, id) in vocab {
                if let (Some(bytes), Some(id)) = (entry_bytes(token, &byte_of), id.as_u64()) {
                    whole.insert(bytes.into_boxed_slice(), u32::try_from(id).ok()?);
                }
            }
            Some(whole)
        } else {
            None
        };
        Some(ByteBpe {
            splits,
            byte_ids,
            merges,
            whole,
            cache: RwLock::new(HashMap::with_capacity(PIECE_CACHE_ENTRIES)),
        })
    }

    /// The ids of `text` (no added token in it, no special tokens added).
    pub fn encode(&self, text: &str) -> Vec<u32> {
        let mut out = Vec::with_capacity(text.len() / 3 + 1);
        let mut learned: Vec<Piece> = Vec::new();
        {
            let cache = self.cache.read();
            self.pieces(text, 0, &mut |piece| {
                let bytes = piece.as_bytes();
                if let Some(id) = self.whole.as_ref().and_then(|w| w.get(bytes)) {
                    out.push(*id);
                } else if let Some(ids) = cache.get(bytes) {
                    out.extend_from_slice(ids);
                } else {
                    let start = out.len();
                    self.merge(bytes, &mut out);
                    if bytes.len() <= PIECE_CACHE_BYTES {
                        learned.push((bytes.into(), out[start..].into()));
                    }
                }
            });
        }
        if !learned.is_empty() {
            let mut cache = self.cache.write();
            for (piece, ids) in learned {
                if cache.len() >= PIECE_CACHE_ENTRIES {
                    cache.clear();
                }
                cache.insert(piece, ids);
            }
        }
        out
    }

    /// Calls `each` with the pieces of `text` after split `level` and those after it, in order
    /// (empty pieces dropped). A regex that gives up (its backtracking limit) ends its matches
    /// there and the rest is one piece, as the library's iterator does.
    fn pieces(&self, text: &str, level: usize, each: &mut dyn FnMut(&str)) {
        let Some(split) = self.splits.get(level) else {
            if !text.is_empty() {
                each(text);
            }
            return;
        };
        let mut at = 0;
        split.re.each_match(text, &mut |start, end| {
            if at < start {
                self.pieces(&text[at..start], level + 1, each);
            }
            if split.keep_matches && start < end {
                self.pieces(&text[start..end], level + 1, each);
            }
            at = end;
        });
        if at < text.len() {
            self.pieces(&text[at..], level + 1, each);
        }
    }

    /// BPE merges over `piece`'s byte ids, appended to `out`: the lowest rank first, the
    /// leftmost among equal ranks, an entry whose pair has changed since it was queued skipped.
    fn merge(&self, piece: &[u8], out: &mut Vec<u32>) {
        #[derive(Clone, Copy)]
        struct Symbol {
            id: u32,
            prev: usize,
            next: usize,
            gone: bool,
        }
        const NONE: usize = usize::MAX;
        let n = piece.len();
        let mut symbols: Vec<Symbol> = piece
            .iter()
            .enumerate()
            .map(|(i, &b)| Symbol {
                id: self.byte_ids[usize::from(b)],
                prev: i.checked_sub(1).unwrap_or(NONE),
                next: if i + 1 < n { i + 1 } else { NONE },
                gone: false,
            })
            .collect();
        // (Reverse rank, reverse position, merged id): the heap's top is the lowest rank, then
        // the leftmost.
        let mut queue: BinaryHeap<(std::cmp::Reverse<(u32, usize)>, u32)> = symbols
            .windows(2)
            .enumerate()
            .filter_map(|(pos, w)| {
                let &(rank, id) = self.merges.get(&pack(w[0].id, w[1].id))?;
                Some((std::cmp::Reverse((rank, pos)), id))
            })
            .collect();
        while let Some((std::cmp::Reverse((_, pos)), merged)) = queue.pop() {
            let left = symbols[pos];
            if left.gone || left.next == NONE {
                continue;
            }
            let right = symbols[left.next];
            if self.merges.get(&pack(left.id, right.id)).map(|m| m.1) != Some(merged) {
                continue;
            }
            symbols[pos].id = merged;
            symbols[pos].next = right.next;
            symbols[left.next].gone = true;
            if right.next != NONE {
                symbols[right.next].prev = pos;
            }
            let cur = symbols[pos];
            if cur.prev != NONE {
                if let Some(&(rank, id)) = self.merges.get(&pack(symbols[cur.prev].id, cur.id)) {
                    queue.push((std::cmp::Reverse((rank, cur.prev)), id));
                }
            }
            if cur.next != NONE {
                if let Some(&(rank, id)) = self.merges.get(&pack(cur.id, symbols[cur.next].id)) {
                    queue.push((std::cmp::Reverse((rank, pos)), id));
                }
            }
        }
        out.extend(symbols.iter().filter(|s| !s.gone).map(|s| s.id));
    }
}

#[cfg(test)]
mod tests;
