use super::*;
use crate::hash::{local_block_hashes, sequence_hashes};
use xxhash_rust::xxh3::xxh3_64_with_seed;

fn plain(
    tokens: &[u32],
    bs: usize,
    lora: Option<&str>,
) -> (Vec<LocalBlockHash>, Arc<[SequenceHash]>) {
    let l = local_block_hashes(tokens, bs, lora);
    let s = sequence_hashes(&l);
    (l, s.into())
}

/// `old`'s pieces up to token `at` of `conv` (the piece holding `at` cut there, in a new
/// allocation), then the rest of `conv` as one new piece.
fn repiece(old: &[Arc<[u32]>], conv: &[u32], at: usize) -> Vec<Arc<[u32]>> {
    let mut out = Vec::new();
    let mut pos = 0;
    for p in old {
        if pos + p.len() <= at {
            out.push(p.clone());
            pos += p.len();
        } else {
            break;
        }
    }
    if pos < conv.len() {
        out.push(Arc::from(&conv[pos..]));
    }
    out
}

/// Every remembered prompt's hashes are those of its own tokens (what makes reusing them
/// exact).
fn assert_consistent(memo: &PrefixMemo) {
    for set in memo.sets.iter() {
        let set = set.lock();
        for e in set.ways.iter().filter(|e| e.used > 0) {
            let tokens: Vec<u32> = tokens_from(e.parts().as_slice(), 0).take(e.len).collect();
            assert_eq!(tokens.len(), e.len, "an entry holds its length");
            assert_eq!(
                tokens.len(),
                e.locals.len() * e.block_size,
                "full blocks only"
            );
            let lora_free = e.seed == block_seed(None);
            let (l, h) = if lora_free {
                plain(&tokens, e.block_size, None)
            } else {
                plain(&tokens, e.block_size, Some("adapter"))
            };
            assert_eq!(
                (&e.locals, &e.hashes[..]),
                (&l, &h[..]),
                "an entry's hashes are its tokens'"
            );
        }
    }
}

/// Differential test against hashing every prompt from scratch: conversations that grow turn
/// by turn, share a system prompt (or land in an entry that holds another one), edit an early
/// token, switch LoRA or block size, shrink, and prompts too short or too long to remember;
/// each prompt lent or handed over at random.
#[test]
fn memo_hashes_equal_plain_hashes() {
    let memo = PrefixMemo::default();
    let mut rng = fastrand::Rng::with_seed(3);
    // 40 system prompts over 16 entries: prompts with other first blocks meet in an entry.
    let systems: Vec<Vec<u32>> = (0..40)
        .map(|_| (0..40 * 16).map(|_| rng.u32(..50_000)).collect())
        .collect();
    // Each conversation also as the pieces it was assembled from: the system prompt's piece
    // shared by every conversation that has it, each turn's added tokens a piece of its own
    // (as a chat's segments come from the tokenizer's cache), and now and then a piece copied
    // anew (equal tokens in another allocation, as after the cache evicted and re-tokenized
    // it).
    let shared_systems: Vec<Arc<[u32]>> = systems.iter().map(|s| Arc::from(&s[..])).collect();
    let mut conversations: Vec<Vec<u32>> = (0..60)
        .map(|i| systems[i % systems.len()].clone())
        .collect();
    let mut pieces: Vec<Vec<Arc<[u32]>>> = (0..60)
        .map(|i| vec![shared_systems[i % systems.len()].clone()])
        .collect();
    let (mut reused, mut blocks) = (0, 0);
    for step in 0..3_000 {
        let c = rng.usize(..conversations.len());
        let conv = &mut conversations[c];
        match rng.u8(..10) {
            0 => {
                // An early edit: everything after it differs.
                let i = rng.usize(..conv.len());
                conv[i] ^= 1;
                pieces[c] = repiece(&pieces[c], conv, i);
            }
            1 => {
                let n = rng.usize(..conv.len() + 1);
                conv.truncate(n);
                pieces[c] = repiece(&pieces[c], conv, n);
            }
            2 if !pieces[c].is_empty() => {
                let k = rng.usize(..pieces[c].len());
                pieces[c][k] = Arc::from(&pieces[c][k][..]);
            }
            _ => {
                let n = rng.usize(1..300);
                let from = conv.len();
                conv.extend((0..n).map(|_| rng.u32(..50_000)));
                pieces[c].push(Arc::from(&conv[from..]));
            }
        }
        assert_eq!(
            pieces[c]
                .iter()
                .flat_map(|p| p.iter().copied())
                .collect::<Vec<_>>(),
            *conv
        );
        let bs = if step % 50 == 49 { 8 } else { 16 };
        let lora = [None, None, None, Some("adapter")][rng.usize(..4)];
        let want = plain(conv, bs, lora);
        // Lent, handed over (the memo then keeps that very vector) or in pieces: the same
        // hashes.
        let got = match rng.u8(..4) {
            0 => memo.hashes(conv, bs, lora),
            1 => memo.hashes_owned(conv.clone(), bs, lora),
            _ => memo.hashes_shared(pieces[c].clone(), bs, lora),
        };
        blocks += want.0.len() as u64;
        if step % 50 == 0 {
            assert_consistent(&memo);
        }
        assert_eq!(
            got,
            want,
            "step {step}: conversation {c}, {} tokens",
            conv.len()
        );
        reused += usize::from(conv.len() / bs >= MIN_BLOCKS);
    }
    assert!(
        reused > 1_500,
        "{reused} prompts long enough to use the memo"
    );
    let stats = memo.stats();
    assert_eq!(stats.blocks_reused + stats.blocks_hashed, blocks);
    // 60 conversations over 16 entries, in random order: most turns find another
    // conversation in their entry, so reuse is the shared system prompt's at best.
    assert!(stats.blocks_reused > blocks / 10, "{stats:?} of {blocks}");
    // Too long to remember, and block size 0.
    let long: Vec<u32> = (0..max_units::<u32>() as u32 + 100).collect();
    assert_eq!(memo.hashes(&long, 16, None), plain(&long, 16, None));
    assert_eq!(memo.hashes(&long, 16, None), plain(&long, 16, None));
    assert_eq!(memo.hashes(&long, 0, None), (vec![], Arc::from([])));
    let (owned, zero) = (memo.hashes_owned(long.clone(), 16, None), long.clone());
    assert_eq!(owned, plain(&long, 16, None));
    assert_eq!(memo.hashes_owned(zero, 0, None), (vec![], Arc::from([])));
    assert_consistent(&memo);
}

/// Two prompts that differ only in their first block and meet in one entry: each is hashed as
/// itself, whichever came before (the entry keeps no block of the other's).
#[test]
fn prompts_differing_only_in_their_first_block_do_not_mix() {
    let memo = PrefixMemo::default();
    let entry = |t: &[u32]| (local_block_hashes(&t[..16], 16, None)[0].0 >> 32) as usize % SETS;
    let rest: Vec<u32> = (100..100 + 16 * 40).collect();
    let x: Vec<u32> = (0..16).chain(rest.iter().copied()).collect();
    let y = (1_000u32..)
        .map(|k| {
            (k..k + 16)
                .chain(rest.iter().copied())
                .collect::<Vec<u32>>()
        })
        .find(|y| entry(y) == entry(&x))
        .expect("a first block for the same entry");
    for t in [&x, &y, &x, &y, &y, &x] {
        assert_eq!(memo.hashes(t, 16, None), plain(t, 16, None));
    }
}

/// Picks on several threads at once (entries busy, skipped, updated by whoever holds them):
/// every answer still equals hashing from scratch.
#[test]
fn concurrent_picks_get_exact_hashes() {
    let memo = PrefixMemo::default();
    let system: Vec<u32> = (0..64 * 16).map(|i| i * 7 + 1).collect();
    std::thread::scope(|scope| {
        for t in 0..4u32 {
            let (memo, system) = (&memo, &system);
            scope.spawn(move || {
                let mut rng = fastrand::Rng::with_seed(u64::from(t));
                let mut conv = system.clone();
                for _ in 0..300 {
                    if rng.u8(..8) == 0 {
                        conv.truncate(system.len());
                    }
                    conv.extend((0..rng.usize(1..100)).map(|_| rng.u32(..50_000)));
                    assert_eq!(memo.hashes(&conv, 16, None), plain(&conv, 16, None));
                }
            });
        }
    });
}

/// Four conversations taking turns behind one long system prompt each keep their own history:
/// after their first turns, every turn hashes only its new blocks (and the first).
#[test]
fn interleaved_conversations_keep_their_own_history() {
    let memo = PrefixMemo::default();
    let system: Vec<u32> = (0..100 * 16).map(|i| i * 3 + 7).collect();
    let mut conversations: Vec<Vec<u32>> = vec![system.clone(); WAYS];
    let mut rng = fastrand::Rng::with_seed(9);
    for round in 0..10 {
        for conv in conversations.iter_mut() {
            conv.extend((0..16 * 5).map(|_| rng.u32(..50_000)));
            let before = memo.stats();
            assert_eq!(memo.hashes(conv, 16, None), plain(conv, 16, None));
            assert_consistent(&memo);
            let after = memo.stats();
            if round > 0 {
                assert_eq!(
                    after.blocks_hashed - before.blocks_hashed,
                    1 + 5,
                    "round {round}: only the first block and the 5 new ones hashed"
                );
            }
        }
    }
}

#[test]
fn common_tokens_reads_pieces_and_runs() {
    let a: Vec<u32> = (0..10_000).collect();
    let mut b = a.clone();
    let n = |x: &[&[u32]], y: &[&[u32]]| common_tokens(x, y, usize::MAX);
    assert_eq!(n(&[&a], &[&b]), 10_000);
    assert_eq!(n(&[&a], &[&b[..1_000]]), 1_000);
    assert_eq!(common_tokens(&[&a], &[&b], 4_321), 4_321);
    // The same tokens cut into other pieces.
    assert_eq!(
        n(
            &[&a[..3], &a[3..5_000], &a[5_000..]],
            &[&b[..4_999], &b[4_999..]]
        ),
        10_000
    );
    b[5_000] = 0;
    assert_eq!(n(&[&a], &[&b]), 5_000);
    assert_eq!(n(&[&a[..7], &a[7..]], &[&b[..2_000], &b[2_000..]]), 5_000);
    b[0] = 1;
    assert_eq!(n(&[&a], &[&b]), 0);
    assert_eq!(n(&[&a], &[]), 0);
    assert_eq!(n(&[&[], &a], &[&a[..0], &a[..10]]), 10);
}

/// The memo is used: the second turn of a conversation copies the first turn's hashes (seen
/// through an entry that holds the second turn afterwards).
#[test]
fn a_next_turn_is_remembered_in_place() {
    let memo = PrefixMemo::default();
    let turn1: Vec<u32> = (0..64 * 16).collect();
    let mut turn2 = turn1.clone();
    turn2.extend(5_000..5_000 + 16 * 8);
    memo.hashes(&turn1, 16, None);
    memo.hashes(&turn2, 16, None);
    let held: Vec<usize> = memo
        .sets
        .iter()
        .flat_map(|s| {
            let s = s.lock();
            s.ways.iter().map(|e| e.len).collect::<Vec<_>>()
        })
        .collect();
    assert_eq!(held.iter().sum::<usize>(), turn2.len(), "{held:?}");
    // The second turn copied the first turn's 64 blocks but its first (hashed to find the
    // entry), and hashed its first block and its 8 new ones.
    assert_eq!(
        memo.stats(),
        MemoStats {
            blocks_reused: 63,
            blocks_hashed: 64 + 9
        }
    );
}

/// Approximate blocks from scratch: xxh3 of each full `bs`-byte block under `seed`, chained.
fn plain_text(text: &[u8], bs: usize, seed: u64) -> (Vec<LocalBlockHash>, Arc<[SequenceHash]>) {
    let l: Vec<LocalBlockHash> = text
        .chunks_exact(bs)
        .map(|b| LocalBlockHash(xxh3_64_with_seed(b, seed)))
        .collect();
    let s = sequence_hashes(&l);
    (l, s.into())
}

/// The text memo against hashing from scratch: documents sent again with another ending,
/// conversations that grow, early edits, truncations, other seeds (models) and block sizes, texts
/// too short or too long to remember; and every remembered text's hashes are its own.
#[test]
fn text_memo_hashes_equal_plain_text_hashes() {
    let memo = PrefixMemo::<u8>::default();
    let mut rng = fastrand::Rng::with_seed(11);
    let word = |rng: &mut fastrand::Rng| -> &'static [u8] {
        [
            &b"kv "[..],
            b"cache\n",
            b"\"quoted\" ",
            b"\\u00e9 ",
            b"routing. ",
            b"\xc3\xa9",
        ][rng.usize(..6)]
    };
    let documents: Vec<Vec<u8>> = (0..6)
        .map(|_| (0..2_000).flat_map(|_| word(&mut rng).to_vec()).collect())
        .collect();
    let mut texts: Vec<Vec<u8>> = (0..24).map(|i| documents[i % 6].clone()).collect();
    let (mut blocks, mut reused_prompts) = (0u64, 0);
    for step in 0..1_500 {
        let c = rng.usize(..texts.len());
        let text = &mut texts[c];
        match rng.u8(..10) {
            0 => {
                let i = rng.usize(..text.len());
                text[i] ^= 1;
            }
            1 => text.truncate(rng.usize(..text.len() + 1)),
            2 => *text = documents[rng.usize(..6)].clone(),
            _ => {
                for _ in 0..rng.usize(1..200) {
                    text.extend_from_slice(word(&mut rng));
                }
            }
        }
        let bs = [64, 64, 64, 16, 100][step % 5];
        let seed = [7, 7, 7, 99][rng.usize(..4)];
        let want = plain_text(text, bs, seed);
        blocks += want.0.len() as u64;
        reused_prompts += usize::from(text.len() / bs >= MIN_BLOCKS);
        assert_eq!(
            memo.text_hashes(text, bs, seed),
            want,
            "step {step}, text {c}"
        );
        if step % 100 == 0 {
            for set in memo.sets.iter() {
                let set = set.lock();
                for e in set.ways.iter().filter(|e| e.used > 0) {
                    let text: Vec<u8> = tokens_from(e.parts().as_slice(), 0).take(e.len).collect();
                    assert_eq!(text.len(), e.len);
                    assert!(e.pieces.len() <= MAX_PIECES);
                    for p in &e.pieces {
                        assert!(
                            p.end * 2 >= p.data.len(),
                            "a piece uses half its allocation"
                        );
                    }
                    let own = plain_text(&text, e.block_size, e.seed);
                    assert_eq!((&e.locals, &e.hashes[..]), (&own.0, &own.1[..]));
                }
            }
        }
    }
    assert!(reused_prompts > 1_000, "{reused_prompts} texts long enough");
    let stats = memo.stats();
    assert_eq!(stats.blocks_reused + stats.blocks_hashed, blocks);
    // 24 texts over 16 entries in random order, and a block size or seed that differs from the
    // entry's a third of the time: reuse is mostly a document's.
    assert!(stats.blocks_reused > blocks / 10, "{stats:?} of {blocks}");
    // Too long to remember (hashed all the same), and block size 0.
    let long: Vec<u8> = (0..max_units::<u8>() + 100)
        .map(|i| (i % 251) as u8)
        .collect();
    for _ in 0..2 {
        assert_eq!(memo.text_hashes(&long, 64, 7), plain_text(&long, 64, 7));
    }
    assert_eq!(memo.text_hashes(&long, 0, 7), (vec![], Arc::from([])));
}

/// Sixteen requests over one long document that differ only in their last few hundred bytes (a
/// shared document, a question after it): once one of them is remembered, each hashes its first
/// block and the blocks past the document only.
#[test]
fn a_shared_document_is_hashed_once() {
    let memo = PrefixMemo::<u8>::default();
    let document = b"The quick brown fox jumps over the lazy dog. ".repeat(2_000);
    let doc_blocks = (document.len() / 64) as u64;
    for i in 0..16 {
        let mut text = document.clone();
        text.extend_from_slice(format!("question {i}: ").as_bytes());
        text.extend_from_slice(&b"why? ".repeat(i + 40));
        let before = memo.stats();
        assert_eq!(memo.text_hashes(&text, 64, 5), plain_text(&text, 64, 5));
        let hashed = memo.stats().blocks_hashed - before.blocks_hashed;
        if i > 0 {
            let past = (text.len() / 64) as u64 - doc_blocks;
            assert!(
                hashed <= past + 2,
                "request {i}: {hashed} blocks hashed, {past} past the document"
            );
        }
    }
    // Not copied either: every remembered request keeps the document in the first request's
    // memory, and only its own ending in a piece of its own.
    let mut firsts = Vec::new();
    for set in memo.sets.iter() {
        for e in set.lock().ways.iter().filter(|e| e.used > 0) {
            firsts.push(e.pieces[0].data.as_ptr());
            let own: usize = e.pieces[1..].iter().map(|p| p.end).sum();
            assert!(own < 64 * 8, "{own} bytes of its own");
        }
    }
    assert_eq!(firsts.len(), WAYS, "the document's set is full");
    firsts.dedup();
    assert_eq!(firsts.len(), 1, "one allocation holds the document");
}
