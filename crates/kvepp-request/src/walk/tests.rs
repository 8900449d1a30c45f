use super::*;
use crate::tests::mutate;
use crate::{value_at, Items, MAX_SPLIT_MESSAGES};
use serde_json::value::RawValue;

/// The vector marking equals the byte-by-byte one, on random lanes drawn mostly from the bytes
/// at the classes' edges, for a 64-byte lane and a 16-byte first step.
#[test]
fn vector_specials_agree_with_byte_by_byte() {
    let mut rng = fastrand::Rng::with_seed(3);
    let edges = b"\"\\\x00\x1f\x20\x7f\x80\xff!#[]{}";
    for _ in 0..20_000 {
        let mut lane = [0u8; LANE];
        for c in &mut lane {
            *c = if rng.bool() {
                edges[rng.usize(..edges.len())]
            } else {
                rng.u8(..)
            };
        }
        assert_eq!(specials(&lane), specials_simple(&lane), "{lane:?}");
        let first: [u8; FIRST] = std::array::from_fn(|i| lane[i]);
        assert_eq!(specials16(&first), specials_simple(&first), "{first:?}");
    }
    for first in (0..=255u8).step_by(LANE) {
        let lane = std::array::from_fn(|i| first.wrapping_add(i as u8));
        assert_eq!(specials(&lane), specials_simple(&lane));
    }
}

/// Some JSON whitespace (often none).
fn ws(rng: &mut fastrand::Rng, out: &mut Vec<u8>) {
    if rng.u8(..4) == 0 {
        for _ in 0..rng.usize(1..4) {
            out.push(b" \n\t\r"[rng.usize(..4)]);
        }
    }
}

/// A string's text with every kind of content: long plain runs, dense escapes, `\u` escapes
/// (surrogates too), multi-byte UTF-8.
fn string(rng: &mut fastrand::Rng, out: &mut Vec<u8>) {
    out.push(b'"');
    for _ in 0..rng.usize(..40) {
        match rng.u8(..10) {
            0 => out.extend_from_slice(br#"\n"#),
            1 => out.extend_from_slice(
                [
                    &br#"\""#[..],
                    br"\\",
                    br"\/",
                    br"\b",
                    br"\f",
                    br"\r",
                    br"\t",
                ][rng.usize(..7)],
            ),
            2 => out.extend_from_slice(format!("\\u{:04x}", rng.u16(..)).as_bytes()),
            3 => out.extend_from_slice(format!("\\u{:04X}", rng.u16(0xD800..0xE000)).as_bytes()),
            4 => out.extend_from_slice("é€😀".as_bytes()),
            5 => out.extend(std::iter::repeat_n(b'x', rng.usize(..70))),
            _ => out.extend_from_slice(b"kv cache "),
        }
    }
    out.push(b'"');
}

fn number(rng: &mut fastrand::Rng, out: &mut Vec<u8>) {
    let n = [
        "0",
        "-0",
        "7",
        "-12",
        "1.5",
        "0.25",
        "-0.0e0",
        "3e10",
        "2E-3",
        "4e+2",
        "123456789012345678901234567890",
    ][rng.usize(..11)];
    out.extend_from_slice(n.as_bytes());
}

/// A random JSON value nested at most `depth` more levels.
fn value_text(rng: &mut fastrand::Rng, out: &mut Vec<u8>, depth: usize) {
    let kind = if depth == 0 { rng.u8(..4) } else { rng.u8(..7) };
    match kind {
        0 => string(rng, out),
        1 => number(rng, out),
        2 => out.extend_from_slice([&b"true"[..], b"false", b"null"][rng.usize(..3)]),
        3 => string(rng, out),
        4 | 5 => list(rng, out, *b"{}", |rng, out| {
            string(rng, out);
            ws(rng, out);
            out.push(b':');
            ws(rng, out);
            value_text(rng, out, depth - 1);
        }),
        _ => list(rng, out, *b"[]", |rng, out| value_text(rng, out, depth - 1)),
    }
}

/// A container: `open`, up to four entries made by `entry`, separated by commas, and `close`,
/// with some whitespace around them.
fn list(
    rng: &mut fastrand::Rng,
    out: &mut Vec<u8>,
    [open, close]: [u8; 2],
    mut entry: impl FnMut(&mut fastrand::Rng, &mut Vec<u8>),
) {
    out.push(open);
    ws(rng, out);
    for i in 0..rng.usize(..5) {
        if i > 0 {
            out.push(b',');
            ws(rng, out);
        }
        entry(rng, out);
        ws(rng, out);
    }
    out.push(close);
}

/// Bytes JSON treats specially, for mutations.
const ODD: &[u8] = b"\"\\,:[]{}0-.eE+ \n\x01\x1f\x7f\x80\xc3\xffu";

/// The walk against serde on generated JSON, half of it mutated: where the walk answers, serde
/// accepts the same bytes as one value ending there (after the UTF-8 check the caller makes),
/// with the same elements for an array; and it answers for every generated value within its
/// depth (so serde is left only what the walk cannot tell).
#[test]
fn the_walk_agrees_with_serde() {
    let mut rng = fastrand::Rng::with_seed(21);
    let (mut answered, mut refused_valid, mut arrays) = (0, 0, 0);
    for case in 0..20_000 {
        let mut b = Vec::new();
        if case % 5 == 0 {
            // An array, as `messages` is.
            b.push(b'[');
            for i in 0..rng.usize(..6) {
                if i > 0 {
                    b.push(b',');
                }
                ws(&mut rng, &mut b);
                value_text(&mut rng, &mut b, 3);
                ws(&mut rng, &mut b);
            }
            b.push(b']');
        } else {
            value_text(&mut rng, &mut b, 4);
        }
        // What follows the value in a body.
        b.extend_from_slice([&b""[..], b",", b" }", b"]"][rng.usize(..4)]);
        let mutated = case % 2 == 1;
        if mutated {
            for _ in 0..rng.usize(1..3) {
                mutate(&mut rng, &mut b, 0, ODD, ODD);
            }
        }
        let serde_end = value_at::<&RawValue>(&b, 0).ok().map(|(_, end)| end);
        match skip_value(&b, 0) {
            Some(end) if utf8(&b[..end]).is_some() => {
                answered += 1;
                assert_eq!(Some(end), serde_end, "{}", String::from_utf8_lossy(&b));
            }
            _ if !mutated => refused_valid += 1,
            _ => {}
        }
        if b.first() == Some(&b'[') {
            let want = value_at::<Items<'_>>(&b, 0)
                .ok()
                .map(|(Items(items), end)| {
                    (
                        items.map(|i| i.iter().map(|r| r.get()).collect::<Vec<_>>()),
                        end,
                    )
                });
            if let Some((items, end)) = split_array(&b, 0, MAX_SPLIT_MESSAGES) {
                arrays += 1;
                let items = items.map(|i| i.iter().map(|r| r.get()).collect::<Vec<_>>());
                assert_eq!(Some((items, end)), want, "{}", String::from_utf8_lossy(&b));
            }
        }
    }
    assert_eq!(refused_valid, 0);
    assert!(
        answered > 12_000 && arrays > 2_000,
        "{answered} answered, {arrays} arrays"
    );
}

/// Past [`MAX_DEPTH`] levels the walk leaves the value to serde; up to it, it answers.
#[test]
fn deep_nesting_is_left_to_serde() {
    let nested = |n: usize| format!("{}1{}", "[".repeat(n), "]".repeat(n)).into_bytes();
    let at_limit = nested(MAX_DEPTH);
    assert_eq!(skip_value(&at_limit, 0), Some(at_limit.len()));
    assert_eq!(skip_value(&nested(MAX_DEPTH + 1), 0), None);
    assert_eq!(skip_value(&nested(100_000), 0), None);
}

/// An array longer than the cap is validated but not split, as serde's reading does.
#[test]
fn arrays_past_the_cap_are_not_split() {
    let b = br#"[{"a":1}, "b" ,[2]] "#;
    let two = split_array(b, 0, 2);
    assert_eq!(
        two.map(|(items, end)| (items.is_none(), end)),
        Some((true, 19))
    );
    let three = split_array(b, 0, 3).and_then(|(items, _)| items);
    let texts: Vec<&str> = three.iter().flatten().map(|r| r.get()).collect();
    assert_eq!(texts, [r#"{"a":1}"#, r#""b""#, "[2]"]);
}

/// Strings around the lanes' boundaries, of every byte class: plain ASCII, multi-byte UTF-8,
/// escapes, control characters, stray continuation bytes, a missing closing quote. The walk
/// (with the caller's UTF-8 check) reads exactly what serde reads, and leaves serde only what
/// serde rejects.
#[test]
fn strings_of_every_kind_agree_with_serde() {
    let pieces: [&[u8]; 12] = [
        b"a",
        b"quick brown fox ",
        "é".as_bytes(),
        "漢字".as_bytes(),
        "🦀".as_bytes(),
        b"\\n",
        b"\\\"",
        b"\\u00e9",
        b"\x01",
        b"\x1f",
        b"\x7f",
        b"\x80",
    ];
    let mut rng = fastrand::Rng::with_seed(38);
    let (mut read, mut cases) = (0, 0);
    for _ in 0..20_000 {
        let mut body = b"  ".to_vec();
        let at = body.len();
        body.push(b'"');
        let target = rng.usize(0..6 * LANE + 5);
        // Mostly plain text; now and then a piece of another class.
        while body.len() < at + 1 + target {
            let p = if rng.u8(..) < 245 {
                pieces[rng.usize(0..2)]
            } else {
                pieces[rng.usize(..pieces.len())]
            };
            body.extend_from_slice(p);
        }
        if rng.u8(..) < 250 {
            body.push(b'"');
        }
        body.extend_from_slice(b" , 1");
        cases += 1;
        let ours = skip_value(&body, at).and_then(|end| Some((utf8(&body[at..end])?, end)));
        let theirs = value_at::<&RawValue>(&body, at)
            .ok()
            .map(|(v, end)| (v.get().to_owned(), end));
        match ours {
            Some((text, end)) => {
                read += 1;
                assert_eq!(theirs, Some((text.to_owned(), end)), "{body:?}");
            }
            None => assert_eq!(theirs, None, "{body:?}"),
        }
    }
    assert!(
        read * 4 > cases && cases - read > 1_000,
        "{read} of {cases} read"
    );
}

#[test]
fn only_a_value_is_read() {
    assert_eq!(skip_value(b"[\"a\"]", 0), Some(5));
    assert_eq!(skip_value(b"\"a\"", 1), None);
    assert_eq!(skip_value(b"\"\"", 0), Some(2));
    assert_eq!(skip_value(b"x\"ab\"y", 1), Some(5));
    assert_eq!(skip_value(b"\"ab", 0), None);
    assert_eq!(skip_value(b"", 0), None);
}

/// The SIMD UTF-8 check answers as the standard library's, on text of every length around its
/// vectors' sizes with valid and broken sequences anywhere.
#[test]
fn utf8_agrees_with_the_standard_check() {
    let mut rng = fastrand::Rng::with_seed(9);
    let pieces: [&[u8]; 9] = [
        b"plain ascii text ",
        "é".as_bytes(),
        "漢字".as_bytes(),
        "🦀".as_bytes(),
        b"\x80",
        b"\xc3",
        b"\xed\xa0\x80",
        b"\xf4\x90\x80\x80",
        b"\xff",
    ];
    let (mut valid, mut cases) = (0, 0);
    for _ in 0..20_000 {
        let mut b = Vec::new();
        while b.len() < rng.usize(..300) {
            let p = if rng.u8(..8) == 0 {
                pieces[rng.usize(..pieces.len())]
            } else {
                pieces[rng.usize(..4)]
            };
            b.extend_from_slice(p);
        }
        let want = std::str::from_utf8(&b).ok();
        assert_eq!(utf8(&b), want, "{b:?}");
        valid += usize::from(want.is_some());
        cases += 1;
    }
    assert!(
        valid * 5 > cases && valid * 5 < cases * 4,
        "{valid} of {cases} valid"
    );
}
