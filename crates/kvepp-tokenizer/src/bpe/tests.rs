//! [`super::ByteBpe`] against the `tokenizers` library on the fixture tokenizer (GPT-2 style:
//! `ByteLevel` with its regex) and on variants of it: Split sequences, `ignore_merges`, and the
//! shapes it must decline. DeepSeek's tokenizer is checked the same way in
//! `tests/kv/tokenizer_deepseek.rs`.

use super::{ByteBpe, Matcher, GPT2_SPLIT, PIECE_CACHE_BYTES, PIECE_CACHE_ENTRIES};
use crate::segments::tests::fixture_json;

fn tokenizer(json: &serde_json::Value) -> tokenizers::Tokenizer {
    tokenizers::Tokenizer::from_bytes(json.to_string()).unwrap()
}

fn library_ids(tok: &tokenizers::Tokenizer, text: &str) -> Vec<u32> {
    tok.encode_fast(text, false).unwrap().get_ids().to_vec()
}

/// Text of words, numbers, contractions, whitespace and line-break runs, punctuation runs,
/// Latin-1 and CJK letters, emoji and control bytes; no added token (the fixture's contain `<`).
fn text(rng: &mut fastrand::Rng, pieces: usize) -> String {
    const PIECES: &[&str] = &[
        "The",
        " model",
        " routes",
        " KV",
        " cache",
        "blocks",
        "  ",
        "   ",
        "\n",
        "\n\n",
        "\r\n",
        "\t",
        "  \n ",
        "1234567",
        " 42",
        "3.14",
        "'s",
        "'ll",
        " don't",
        "é",
        "données",
        "日本語",
        "かな",
        "カナ",
        "中文",
        "🙂",
        "👩‍💻",
        "...",
        "?!",
        " --",
        "(x)",
        "{\"a\": 1}",
        "\u{1}",
        "\u{7f}",
        "ÿ",
        "Ā",
        " ",
        "a",
        "re",
        "he",
    ];
    (0..pieces)
        .map(|_| PIECES[rng.usize(..PIECES.len())])
        .collect()
}

/// Every text the same as the library's, first and second time (the cache).
fn assert_same(tok: &tokenizers::Tokenizer, bpe: &ByteBpe, seed: u64, texts: usize) {
    let mut rng = fastrand::Rng::with_seed(seed);
    for i in 0..texts {
        let t = text(&mut rng, 1 + i % 60);
        let want = library_ids(tok, &t);
        assert_eq!(bpe.encode(&t), want, "text {i}: {t:?}");
        assert_eq!(bpe.encode(&t), want, "text {i} again (cached): {t:?}");
    }
}

#[test]
fn equals_the_library_on_the_fixture() {
    let tok = tokenizer(&fixture_json());
    let bpe = ByteBpe::new(&tok).expect("the fixture is byte-level BPE");
    assert_same(&tok, &bpe, 1, 600);
    // Long pieces (past the cache's length limit): a run of spaces, of one letter, of digits.
    for long in [
        " ".repeat(300),
        "a".repeat(257),
        "9".repeat(100),
        "é".repeat(90),
    ] {
        assert!(long.len() > PIECE_CACHE_BYTES);
        assert_eq!(bpe.encode(&long), library_ids(&tok, &long), "{long:?}");
    }
    assert_eq!(bpe.encode(""), Vec::<u32>::new());
}

#[test]
fn equals_the_library_behind_splits_and_with_ignore_merges() {
    let mut json = fixture_json();
    // DeepSeek's shape: digit and CJK splits, a word regex with a look-ahead, then byte level
    // without its own regex; a literal `Removed` split too.
    json["normalizer"] = serde_json::json!({"type": "Sequence", "normalizers": []});
    json["pre_tokenizer"] = serde_json::json!({"type": "Sequence", "pretokenizers": [
        {"type": "Split", "pattern": {"Regex": "\\p{N}{1,3}"}, "behavior": "Isolated", "invert": false},
        {"type": "Split", "pattern": {"Regex": "[一-龥\u{3040}-ゟ゠-ヿ]+"}, "behavior": "Isolated", "invert": false},
        {"type": "Split", "pattern": {"String": "--"}, "behavior": "Removed", "invert": false},
        {"type": "Split", "pattern": {"Regex": "[^\\r\\n\\p{L}\\p{P}\\p{S}]?[\\p{L}\\p{M}]+| ?[\\p{P}\\p{S}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+"}, "behavior": "Isolated", "invert": false},
        {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": false}
    ]});
    let tok = tokenizer(&json);
    let bpe = ByteBpe::new(&tok).expect("Split sequences are covered");
    assert_same(&tok, &bpe, 2, 400);
    // ignore_merges: a piece that is a vocabulary entry is taken whole even where the merges
    // would not reach it ("abc" added as a token with no merge making it).
    json["model"]["ignore_merges"] = true.into();
    let n = json["model"]["vocab"].as_object().unwrap().len();
    json["model"]["vocab"]["abc"] = n.into();
    let tok = tokenizer(&json);
    let bpe = ByteBpe::new(&tok).expect("ignore_merges is covered");
    assert_eq!(bpe.encode("abc"), vec![u32::try_from(n).unwrap()]);
    assert_eq!(bpe.encode(" abc abc"), library_ids(&tok, " abc abc"));
    assert_same(&tok, &bpe, 3, 200);
}

#[test]
fn the_cache_empties_when_full_and_stays_exact() {
    let tok = tokenizer(&fixture_json());
    let bpe = ByteBpe::new(&tok).unwrap();
    let mut rng = fastrand::Rng::with_seed(4);
    let words: Vec<String> = (0..PIECE_CACHE_ENTRIES + 500)
        .map(|_| {
            let len = rng.usize(4..12);
            std::iter::repeat_with(|| rng.lowercase())
                .take(len)
                .collect()
        })
        .collect();
    for (i, w) in words.iter().enumerate() {
        bpe.encode(w);
        assert!(bpe.cache.read().len() <= PIECE_CACHE_ENTRIES, "word {i}");
    }
    assert!(
        bpe.cache.read().len() < PIECE_CACHE_ENTRIES,
        "the cache was emptied once full"
    );
    for w in words.iter().step_by(97) {
        assert_eq!(bpe.encode(w), library_ids(&tok, w), "{w:?}");
    }
}

#[test]
fn declines_what_it_does_not_cover() {
    let base = fixture_json();
    let declined = |edit: &dyn Fn(&mut serde_json::Value)| {
        let mut json = base.clone();
        edit(&mut json);
        ByteBpe::new(&tokenizer(&json)).is_none()
    };
    assert!(!declined(&|_| {}));
    assert!(declined(
        &|j| j["pre_tokenizer"]["add_prefix_space"] = true.into()
    ));
    assert!(declined(
        &|j| j["normalizer"] = serde_json::json!({"type": "Lowercase"})
    ));
    assert!(declined(&|j| j["model"]["dropout"] = 0.1.into()));
    assert!(declined(
        &|j| j["model"]["end_of_word_suffix"] = "</w>".into()
    ));
    assert!(declined(
        &|j| j["pre_tokenizer"] = serde_json::json!({"type": "Sequence", "pretokenizers": [
            {"type": "Split", "pattern": {"Regex": "a"}, "behavior": "MergedWithNext", "invert": false},
            {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": false}
        ]})
    ));
    assert!(declined(
        &|j| j["pre_tokenizer"] = serde_json::json!({"type": "Whitespace"})
    ));
    assert!(declined(&|j| j["truncation"] = serde_json::json!({
        "direction": "Right", "max_length": 8, "strategy": "LongestFirst", "stride": 0
    })));
    // A byte letter missing from the vocabulary: the library would fall back or fail; not here.
    assert!(declined(&|j| {
        j["model"]["vocab"].as_object_mut().unwrap().remove("Ā");
        j["model"]["merges"] = serde_json::json!([]);
    }));
}

/// The word regexes of GPT-2, DeepSeek and Llama 3 run on the plain automaton with the
/// whitespace tail applied by hand, and give `fancy-regex`'s matches exactly: on runs of every
/// kind of whitespace (ASCII, no-break, ideographic, line breaks) before words, digits,
/// punctuation, combining marks, and at the end.
#[test]
fn plain_matcher_equals_fancy_regex() {
    const DEEPSEEK: &str = r##"[!"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+| ?[\p{P}\p{S}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"##;
    const LLAMA3: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
    const PIECES: &[&str] = &[
        " ", "  ", "\t", "\n", "\r\n", "\r", "\u{a0}", "\u{3000}", "\u{2028}", "a", "word", "Été",
        "1", "123456", "!", "?!", "é", "\u{301}", "'s", "'LL", "x", "日本", "🙂", "\u{1}",
    ];
    let mut rng = fastrand::Rng::with_seed(5);
    for pattern in [GPT2_SPLIT, DEEPSEEK, LLAMA3] {
        let plain = Matcher::new(pattern).unwrap();
        assert!(matches!(plain, Matcher::Plain { .. }), "{pattern}");
        let fancy = fancy_regex::Regex::new(pattern).unwrap();
        for i in 0..3000 {
            let text: String = (0..1 + i % 25)
                .map(|_| PIECES[rng.usize(..PIECES.len())])
                .collect();
            let want: Vec<(usize, usize)> = fancy
                .find_iter(&text)
                .map(|m| m.map(|m| (m.start(), m.end())).unwrap())
                .collect();
            let mut got = Vec::new();
            plain.each_match(&text, &mut |s, e| got.push((s, e)));
            assert_eq!(got, want, "{pattern} on {text:?}");
        }
    }
    // A pattern with other look-around stays with fancy-regex, and so does one that can match
    // empty text somewhere (at a word boundary).
    for other in [r"a(?=b)|\s+(?!\S)|\s+", r"\b|x+|\s+(?!\S)|\s+"] {
        assert!(
            matches!(Matcher::new(other), Some(Matcher::Fancy(_))),
            "{other}"
        );
    }
}

/// Threads sharing one encoder, with pieces new to the cache on every call (so lookups, inserts
/// and the emptying of a full cache interleave): every result is still the library's.
#[test]
fn shared_between_threads_it_stays_exact() {
    let tok = tokenizer(&fixture_json());
    let bpe = ByteBpe::new(&tok).unwrap();
    std::thread::scope(|s| {
        for seed in 0..4u64 {
            let (tok, bpe) = (&tok, &bpe);
            s.spawn(move || {
                let mut rng = fastrand::Rng::with_seed(100 + seed);
                for i in 0..400 {
                    let mut t = text(&mut rng, 1 + i % 30);
                    for _ in 0..20 {
                        t.push(' ');
                        let len = rng.usize(3..9);
                        t.extend(std::iter::repeat_with(|| rng.lowercase()).take(len));
                    }
                    assert_eq!(
                        bpe.encode(&t),
                        library_ids(tok, &t),
                        "thread {seed}, text {i}"
                    );
                }
            });
        }
    });
    assert!(bpe.cache.read().len() <= PIECE_CACHE_ENTRIES);
}
