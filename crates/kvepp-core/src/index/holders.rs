//! How the index stores a block's holders: one rank inline in the table's value word, two or more
//! in a spilled list; and what a walk compares of them (identities, fingerprints).
//!
//! Invariants: a packed word is never 0 (a holder has a non-zero reference count); the spill
//! marker is never a real rank slot; a spilled list is in slot order (the index keeps it so);
//! a fingerprint does not depend on the holders' order.

use super::Tier;

/// One rank's hold on one block: its slot and a reference count per tier.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Holder {
    pub(super) rank: u16,
    pub(super) refs: [u16; 3],
}

impl Holder {
    pub(super) fn new(rank: u16, tier: Tier) -> Self {
        let mut refs = [0; 3];
        refs[tier.idx()] = 1;
        Holder { rank, refs }
    }
    pub(super) fn is_empty(&self) -> bool {
        self.refs == [0; 3]
    }
}

#[derive(Debug, Clone, Copy)]
pub(super) enum Holders {
    One(Holder),
    /// Index into `spill`: two or more holders.
    Spill(u32),
}

/// The holders of one block, borrowed from the index.
#[derive(Clone, Copy)]
pub(super) enum HolderList<'a> {
    One(Holder),
    Many(&'a [Holder]),
}

impl HolderList<'_> {
    pub(super) fn as_slice(&self) -> &[Holder] {
        match self {
            HolderList::One(h) => std::slice::from_ref(h),
            HolderList::Many(l) => l,
        }
    }
}

/// Where slot `s` is in a spilled list (kept in slot order): Ok its position, Err where it
/// would go.
pub(super) fn find(list: &[Holder], s: u16) -> Result<usize, usize> {
    list.binary_search_by_key(&s, |h| h.rank)
}

/// What a walk reads of one holder: its rank and the fastest tier it holds the block in (3:
/// device, 2: host, 1: only slower). Holders with equal identities extend the same runs.
pub(super) fn holder_ident(h: &Holder) -> u64 {
    let level = if h.refs[0] > 0 {
        3
    } else if h.refs[1] > 0 {
        2
    } else {
        1
    };
    u64::from(h.rank) | level << 16
}

/// An order-independent digest of a holder list (its holders' [`holder_ident`]s): the walks of
/// [`super::PrefixIndex::find_matches`] treat blocks with equal digests (and list lengths) as held alike.
pub(super) fn fingerprint(list: &[Holder]) -> u64 {
    list.iter().fold(list.len() as u64, |fp, h| {
        let x = holder_ident(h) ^ 0x9E37_79B9_7F4A_7C15;
        let m = u128::from(x) * 0xBF58_476D_1CE4_E5B9_u128;
        fp.wrapping_add((m as u64) ^ ((m >> 64) as u64))
    })
}

/// The rank slot that marks a spilled holder word (never a real slot).
const SPILL: u16 = u16::MAX;

impl Holders {
    /// The table's value word: never 0 (a holder has a non-zero reference count).
    pub(super) fn pack(self) -> u64 {
        match self {
            Holders::One(h) => {
                u64::from(h.rank)
                    | u64::from(h.refs[0]) << 16
                    | u64::from(h.refs[1]) << 32
                    | u64::from(h.refs[2]) << 48
            }
            Holders::Spill(i) => u64::from(SPILL) | u64::from(i) << 16,
        }
    }

    pub(super) fn unpack(v: u64) -> Self {
        let rank = v as u16;
        if rank == SPILL {
            Holders::Spill((v >> 16) as u32)
        } else {
            Holders::One(Holder {
                rank,
                refs: [(v >> 16) as u16, (v >> 32) as u16, (v >> 48) as u16],
            })
        }
    }
}
