//! The slot tracker's active prompt blocks: a trie over the hash lists of the active requests,
//! with per-rank request counts on its nodes.
//!
//! What it owns: one path per active request, from the root along the request's hash list; the
//! tracker keeps the node each path ends at and passes it back to [`ActiveTrie::remove`].
//!
//! Invariants:
//! - every node but the root covers a non-empty run `[start, end)` of a hash list that passes
//!   through it (`seq`, shared with the request that created it, never copied per node); a
//!   child's run starts where its parent's ends, and the children of one node start with distinct
//!   hashes (the key of the edge table);
//! - a node's `ids` lists the dense rank ids with requests through it, in id order, and `counts`
//!   beside them how many (never 0), and `total` their sum; a node whose total falls to 0 is
//!   removed at once, so nothing outlives the requests (no leak, whatever the hash lists);
//! - a rank's distinct active blocks are the sum of the lengths of the nodes it is present in:
//!   [`ActiveTrie::insert`] and [`ActiveTrie::remove`] return the change, so the tracker keeps the
//!   count without recounting. For chained sequence hashes (each names its whole prefix, the
//!   contract of the picker and the slot-tracker API) this is the number of distinct hashes;
//! - a node that one child and no request's end hang from is merged into that child when a
//!   removal passes it (`child_xor` names the child when there is one), so paths stay as short as
//!   the live requests' divergence points make them.
//!
//! A booking may split its insertion in two: [`ActiveTrie::plan`] compares its hashes along
//! the path (read-only, so under a shared lock), and [`ActiveTrie::insert_planned`] then counts
//! the request on the planned nodes; every node carries a serial that changes with its run or
//! parent, so a plan that a write made stale is seen, and the insertion goes on from the last
//! planned node that is unchanged, comparing hashes from there.
//!
//! Costs: booking and releasing a request compare hashes along its path (no hashing or table
//! write per block: one table probe per node) and touch one count per node; a walk does the same
//! plus one write per (node, rank) on the path; [`ActiveTrie::walk_path`] copies each node's rank
//! list whole instead (a block copy), for a pick that then looks up few ranks (a binary search
//! per node on the path). A node with many ranks also keeps them as a bit set (`bits`, kept
//! with `ids` on every change: empty, or exactly the ranks in `ids`), which that walk copies
//! instead of a wide node's list: a system prompt half of 4000 ranks share is 63 words, not
//! 2000 ids. The block-by-block index this replaced spent ~22 ns per block on both, under the
//! tracker's write lock.

use std::collections::HashMap;
use std::hash::{Hash, Hasher};
use std::sync::Arc;

use crate::hash::SequenceHash;
use crate::types::KeyedBuild;

const ROOT: u32 = 0;

/// A child of `parent` whose run starts with `first`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Edge {
    parent: u32,
    first: SequenceHash,
}

impl Hash for Edge {
    fn hash<H: Hasher>(&self, h: &mut H) {
        // One word for the keyed table hasher (which mixes it with its key).
        h.write_u64(self.first.0 ^ u64::from(self.parent).wrapping_mul(0x9E37_79B9_7F4A_7C15));
    }
}

#[derive(Debug)]
struct Node {
    parent: u32,
    /// A hash list that passes through this node (positions are absolute in it).
    seq: Arc<[SequenceHash]>,
    start: usize,
    end: usize,
    /// (dense rank id, requests of that rank through this node), in id order, counts ≥ 1.
    ids: Vec<u32>,
    counts: Vec<u32>,
    /// Empty, or (once `ids` has reached [`BITS_FROM`]) the same ranks as a bit set (bit `r % 64`
    /// of word `r / 64`), which a walk of the path copies instead of a wide node's `ids`.
    bits: Vec<u64>,
    /// Requests through this node.
    total: u32,
    children: u32,
    /// XOR of the children's ids: the only child's id when `children == 1`.
    child_xor: u32,
    /// Changes whenever the node's run or parent does, or it is freed (never repeats in one
    /// trie): what an [`InsertPlan`] checks its nodes by.
    serial: u64,
}

/// A node with this many ranks starts keeping them as a bit set too (a 16th of the bytes of
/// their ids at the widest, so a walk copies a system prompt's ranks in a few instructions).
const BITS_FROM: usize = if cfg!(test) { 3 } else { 64 };

impl Node {
    /// Counts one more request of `rank`: whether the rank is new to the node.
    fn add_rank(&mut self, rank: u32) -> bool {
        self.total += 1;
        match self.ids.binary_search(&rank) {
            Ok(i) => {
                self.counts[i] += 1;
                false
            }
            Err(i) => {
                self.ids.insert(i, rank);
                self.counts.insert(i, 1);
                if !self.bits.is_empty() {
                    set_bit(&mut self.bits, rank);
                } else if self.ids.len() >= BITS_FROM {
                    for &r in &self.ids {
                        set_bit(&mut self.bits, r);
                    }
                }
                true
            }
        }
    }

    /// Counts one request of `rank` less: whether the rank left the node.
    fn drop_rank(&mut self, rank: u32) -> bool {
        self.total = self.total.saturating_sub(1);
        let Ok(i) = self.ids.binary_search(&rank) else {
            return false;
        };
        self.counts[i] -= 1;
        if self.counts[i] > 0 {
            return false;
        }
        self.ids.remove(i);
        self.counts.remove(i);
        if let Some(w) = self.bits.get_mut(rank as usize / 64) {
            *w &= !(1 << (rank % 64));
        }
        true
    }

    /// Drops the node's ranks (it is freed).
    fn clear_ranks(&mut self) {
        self.ids = Vec::new();
        self.counts = Vec::new();
        self.bits = Vec::new();
    }

    fn run(&self) -> &[SequenceHash] {
        self.seq.get(self.start..self.end).unwrap_or_default()
    }

    fn len(&self) -> u64 {
        (self.end - self.start) as u64
    }

    fn first(&self) -> Option<SequenceHash> {
        self.seq.get(self.start).copied()
    }
}

fn set_bit(bits: &mut Vec<u64>, r: u32) {
    let w = r as usize / 64;
    if bits.len() <= w {
        bits.resize(w + 1, 0);
    }
    bits[w] |= 1 << (r % 64);
}

/// How many leading hashes `a` and `b` share (memcmp-like: 32 at a time, then one by one).
fn common_prefix(a: &[SequenceHash], b: &[SequenceHash]) -> usize {
    const CHUNK: usize = 32;
    let n = a.len().min(b.len());
    let (a, b) = (&a[..n], &b[..n]);
    let mut i = 0;
    while i + CHUNK <= n && a[i..i + CHUNK] == b[i..i + CHUNK] {
        i += CHUNK;
    }
    i + a[i..]
        .iter()
        .zip(&b[i..])
        .take_while(|(x, y)| x == y)
        .count()
}

/// Reusable buffer of `ActiveTrie::walk`: per dense rank id, the walk that last wrote it and
/// how many leading blocks of that walk's prompt the rank has active.
#[derive(Debug, Default)]
pub struct HeldScratch {
    epoch: u64,
    held: Vec<(u64, u64)>,
    /// The dense ids the last walk found holding some of the prompt, and the most any holds.
    touched: Vec<u32>,
    most: u64,
    /// The last walk was [`ActiveTrie::walk_path`]: its nodes with ranks, root first, each
    /// with its ranks' ids copied into `copied` or (a wide one) its bit set into `bits`.
    lazy: bool,
    path: Vec<PathNode>,
    copied: Vec<u32>,
    bits: Vec<u64>,
}

/// A node of the path [`ActiveTrie::walk_path`] walked.
#[derive(Debug, Clone, Copy)]
struct PathNode {
    /// How many leading blocks of the prompt the node reaches.
    held: u64,
    /// How many ranks it has.
    count: u32,
    /// Where its ids are in `copied` (empty for a node copied as a bit set).
    ids: (u32, u32),
    /// Where its bit set is in `bits` (empty for a node whose ids were copied).
    bits: (u32, u32),
}

/// A node of a walked path as [`HeldScratch::path_node`] gives it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct PathStep {
    /// How many leading blocks of the prompt the node reaches.
    pub(crate) held: u64,
    /// How many ranks are in it.
    pub(crate) count: usize,
    /// Which of [`HeldScratch::holder`]'s positions list its ranks: all of them when `count`
    /// is at most the walk's `wide`, else none.
    pub(crate) ranks: std::ops::Range<usize>,
}

impl HeldScratch {
    /// Leading blocks of the last walk's prompt that the rank with this dense id has active.
    /// (Always inlined, the path's search kept out of line: the scan reads every candidate
    /// through it.)
    #[inline(always)]
    pub(crate) fn get(&self, id: usize) -> u64 {
        if self.lazy {
            return self.on_path(id);
        }
        match self.held.get(id) {
            Some(&(e, h)) if e == self.epoch => h,
            _ => 0,
        }
    }

    /// [`Self::get`] after a walk of the path: the deepest node on it that the rank is in.
    #[inline(never)]
    fn on_path(&self, id: usize) -> u64 {
        self.deepest_below(id, 0).unwrap_or(0)
    }

    /// [`Self::get`] of a rank that node `k` of the path lists ([`Self::path_node`]): only the
    /// nodes below `k` are searched (each node's ranks are among its parent's).
    #[inline]
    pub(crate) fn get_listed(&self, id: usize, k: usize) -> u64 {
        self.deepest_below(id, k + 1)
            .or_else(|| self.path.get(k).map(|p| p.held))
            .unwrap_or(0)
    }

    /// What the deepest node from path node `from` down that has rank `id` holds.
    #[inline]
    fn deepest_below(&self, id: usize, from: usize) -> Option<u64> {
        let id = u32::try_from(id).ok()?;
        let (word, bit) = (id as usize / 64, id % 64);
        let below = self.path.get(from..)?;
        below.iter().rev().find_map(|p| {
            let hit = if p.bits.1 > p.bits.0 {
                let bits = &self.bits[p.bits.0 as usize..p.bits.1 as usize];
                bits.get(word).is_some_and(|w| w >> bit & 1 == 1)
            } else {
                self.copied[p.ids.0 as usize..p.ids.1 as usize]
                    .binary_search(&id)
                    .is_ok()
            };
            hit.then_some(p.held)
        })
    }

    /// How many dense ids [`Self::holder`] lists: each holder of some of the prompt once, or
    /// after a walk of the path, once per node it is in (but those of wide nodes).
    #[cfg(test)]
    pub(crate) fn holder_count(&self) -> usize {
        if self.lazy {
            self.copied.len()
        } else {
            self.touched.len()
        }
    }

    /// The `k`-th dense id the last walk listed: each holder of some of the prompt once, or
    /// after a walk of the path, once per node it is in (but those of wide nodes).
    pub(crate) fn holder(&self, k: usize) -> Option<u32> {
        if self.lazy {
            self.copied.get(k).copied()
        } else {
            self.touched.get(k).copied()
        }
    }

    /// After a walk of the path ([`ActiveTrie::walk_path`]), its nodes with ranks, root first:
    /// how many (0 after [`ActiveTrie::walk`]).
    pub(crate) fn path_len(&self) -> usize {
        if self.lazy {
            self.path.len()
        } else {
            0
        }
    }

    /// Node `k` of [`Self::path_len`].
    pub(crate) fn path_node(&self, k: usize) -> Option<PathStep> {
        let p = self.path.get(k).filter(|_| self.lazy)?;
        Some(PathStep {
            held: p.held,
            count: p.count as usize,
            ranks: p.ids.0 as usize..p.ids.1 as usize,
        })
    }

    /// The most leading blocks of the last walk's prompt any rank has active.
    pub(crate) fn most(&self) -> u64 {
        self.most
    }
}

#[derive(Debug)]
pub(crate) struct ActiveTrie {
    nodes: Vec<Node>,
    free: Vec<u32>,
    edges: HashMap<Edge, u32, KeyedBuild>,
    /// The last serial handed to a node.
    serial: u64,
    /// Plans found stale when applied ([`Self::insert_planned`]; not those of a path too long
    /// to plan).
    stale_plans: u64,
}

impl ActiveTrie {
    pub(crate) fn with_seed(seed: u64) -> Self {
        ActiveTrie {
            nodes: vec![Node {
                parent: ROOT,
                seq: Arc::from(Vec::new()),
                start: 0,
                end: 0,
                ids: Vec::new(),
                counts: Vec::new(),
                bits: Vec::new(),
                total: 0,
                children: 0,
                child_xor: 0,
                serial: 0,
            }],
            free: Vec::new(),
            edges: HashMap::with_hasher(KeyedBuild::with_key(seed)),
            serial: 0,
            stale_plans: 0,
        }
    }

    /// Nodes in use, the root included.
    #[cfg(test)]
    pub(crate) fn node_count(&self) -> usize {
        self.nodes.len() - self.free.len()
    }

    fn next_serial(&mut self) -> u64 {
        self.serial += 1;
        self.serial
    }

    /// Gives node `n` a new serial: its run or parent changed, or it was freed.
    fn restamp(&mut self, n: u32) {
        let serial = self.next_serial();
        self.node_mut(n).serial = serial;
    }

    fn node(&self, id: u32) -> &Node {
        &self.nodes[id as usize]
    }

    fn node_mut(&mut self, id: u32) -> &mut Node {
        &mut self.nodes[id as usize]
    }

    fn alloc(&mut self, mut node: Node) -> u32 {
        node.serial = self.next_serial();
        match self.free.pop() {
            Some(id) => {
                *self.node_mut(id) = node;
                id
            }
            None => {
                self.nodes.push(node);
                (self.nodes.len() - 1) as u32
            }
        }
    }

    /// Adds a request of rank `rank` whose prompt is `seq`: the node its path ends at (for
    /// [`Self::remove`]) and how many blocks are new to the rank.
    pub(crate) fn insert(&mut self, rank: u32, seq: &Arc<[SequenceHash]>) -> (u32, u64) {
        self.insert_from(rank, seq, (ROOT, 0, 0))
    }

    /// [`Self::insert`] from `node`, on `seq`'s path and ending at its block `pos`, with `added`
    /// blocks new to the rank so far (the request already counted on the nodes above).
    fn insert_from(
        &mut self,
        rank: u32,
        seq: &Arc<[SequenceHash]>,
        (mut node, mut pos, mut added): (u32, usize, u64),
    ) -> (u32, u64) {
        while let Some(&first) = seq.get(pos) {
            let edge = Edge {
                parent: node,
                first,
            };
            let Some(&child) = self.edges.get(&edge) else {
                let leaf = self.add_leaf(node, rank, seq, pos);
                return (leaf, added + (seq.len() - pos) as u64);
            };
            let c = self.node(child);
            // ≥ 1: the edge's key is the run's first hash (the floor only guards the loop's
            // progress should that ever not hold).
            let m = common_prefix(c.run(), &seq[pos..]).max(1);
            let child = if (m as u64) < c.len() {
                self.split(node, child, m)
            } else {
                child
            };
            added += self.enter(child, rank);
            pos = self.node(child).end;
            node = child;
        }
        (node, added)
    }

    /// Counts one more request of `rank` through node `n`: the blocks it adds to the rank.
    fn enter(&mut self, n: u32, rank: u32) -> u64 {
        let c = self.node_mut(n);
        if c.add_rank(rank) {
            c.len()
        } else {
            0
        }
    }

    /// Hangs a new leaf for `seq[pos..]` (one request of `rank`) from `parent`.
    fn add_leaf(&mut self, parent: u32, rank: u32, seq: &Arc<[SequenceHash]>, pos: usize) -> u32 {
        let leaf = self.alloc(Node {
            parent,
            seq: Arc::clone(seq),
            start: pos,
            end: seq.len(),
            ids: vec![rank],
            counts: vec![1],
            bits: Vec::new(),
            total: 1,
            children: 0,
            child_xor: 0,
            serial: 0,
        });
        if let Some(&first) = seq.get(pos) {
            self.edges.insert(Edge { parent, first }, leaf);
        }
        let p = self.node_mut(parent);
        p.children += 1;
        p.child_xor ^= leaf;
        leaf
    }

    /// Splits `child` (of `parent`) after its first `m` blocks: the top part becomes a new node
    /// (returned) between them; `child` keeps its id (requests end at it) and its bottom part.
    fn split(&mut self, parent: u32, child: u32, m: usize) -> u32 {
        let c = self.node(child);
        let (start, cut) = (c.start, c.start + m);
        let (first, below) = (c.first(), c.seq.get(cut).copied());
        let top = Node {
            parent,
            seq: Arc::clone(&c.seq),
            start,
            end: cut,
            ids: c.ids.clone(),
            counts: c.counts.clone(),
            bits: c.bits.clone(),
            total: c.total,
            children: 1,
            child_xor: child,
            serial: 0,
        };
        let top = self.alloc(top);
        self.restamp(child);
        let c = self.node_mut(child);
        c.start = cut;
        c.parent = top;
        if let Some(first) = first {
            self.edges.insert(Edge { parent, first }, top);
        }
        if let Some(first) = below {
            self.edges.insert(Edge { parent: top, first }, child);
        }
        self.node_mut(parent).child_xor ^= child ^ top;
        top
    }

    /// Removes a request of rank `rank` whose path ends at `end`: how many blocks the rank no
    /// longer has active.
    pub(crate) fn remove(&mut self, rank: u32, end: u32) -> u64 {
        let mut freed = 0;
        let mut n = end;
        while n != ROOT && (n as usize) < self.nodes.len() {
            let node = self.node_mut(n);
            let parent = node.parent;
            if node.drop_rank(rank) {
                freed += node.len();
            }
            if node.total == 0 {
                self.delete(n);
            } else {
                self.merge_into_child(n);
            }
            n = parent;
        }
        freed
    }

    /// Drops a node no request passes through (it has no children then).
    fn delete(&mut self, n: u32) {
        let node = self.node_mut(n);
        let parent = node.parent;
        let first = node.first();
        node.seq = Arc::from(Vec::new());
        node.clear_ranks();
        if let Some(first) = first {
            self.edges.remove(&Edge { parent, first });
        }
        let p = self.node_mut(parent);
        p.children -= 1;
        p.child_xor ^= n;
        self.restamp(n);
        self.free.push(n);
    }

    /// Merges `n` into its only child when every request through `n` goes on into it.
    fn merge_into_child(&mut self, n: u32) {
        let node = self.node(n);
        if n == ROOT || node.children != 1 {
            return;
        }
        let child = node.child_xor;
        let (parent, start, first, total) = (node.parent, node.start, node.first(), node.total);
        let c = self.node(child);
        if c.total != total || c.parent != n {
            return;
        }
        if let Some(below) = c.first() {
            self.edges.remove(&Edge {
                parent: n,
                first: below,
            });
        }
        // The child's list passes through `n`, so it holds `n`'s run at the same positions.
        self.restamp(child);
        self.restamp(n);
        let c = self.node_mut(child);
        c.start = start;
        c.parent = parent;
        if let Some(first) = first {
            self.edges.insert(Edge { parent, first }, child);
        }
        self.node_mut(parent).child_xor ^= n ^ child;
        let node = self.node_mut(n);
        node.seq = Arc::from(Vec::new());
        node.clear_ranks();
        node.children = 0;
        node.child_xor = 0;
        self.free.push(n);
    }

    /// How many leading blocks of `hashes` every rank has active, into `scratch` (read it with
    /// [`HeldScratch::get`]); `ranks` bounds the dense rank ids.
    pub(crate) fn walk(&self, hashes: &[SequenceHash], scratch: &mut HeldScratch, ranks: usize) {
        scratch.lazy = false;
        scratch.epoch += 1;
        scratch.touched.clear();
        scratch.most = 0;
        if scratch.held.len() < ranks {
            scratch.held.resize(ranks, (0, 0));
        }
        let epoch = scratch.epoch;
        self.descend(hashes, |_, c, held| {
            // Deeper nodes overwrite: a rank's entry ends at the last node it is present in.
            for &r in &c.ids {
                if let Some(s) = scratch.held.get_mut(r as usize) {
                    if s.0 != epoch {
                        scratch.touched.push(r);
                    }
                    *s = (epoch, held);
                }
            }
            if !c.ids.is_empty() {
                scratch.most = scratch.most.max(held);
            }
        });
    }

    /// Follows `hashes` down from the root, calling `f(id, node, held)` for each node the
    /// prompt enters, `held` being how many of its leading blocks the path to it (and into it)
    /// covers.
    fn descend(&self, hashes: &[SequenceHash], mut f: impl FnMut(u32, &Node, u64)) {
        let mut node = ROOT;
        let mut pos = 0;
        while let Some(&first) = hashes.get(pos) {
            let Some(&child) = self.edges.get(&Edge {
                parent: node,
                first,
            }) else {
                break;
            };
            let c = self.node(child);
            let m = common_prefix(c.run(), &hashes[pos..]);
            f(child, c, (pos + m) as u64);
            if (m as u64) < c.len() {
                break;
            }
            pos = c.end;
            node = child;
        }
    }
}

impl ActiveTrie {
    /// [`Self::walk`] that copies each node's ranks on the path as they are (a block copy
    /// each) instead of writing an entry per rank, for a caller that asks for few ranks:
    /// [`HeldScratch::get`] then searches the copies, deepest first. A node with more than
    /// `wide` ranks that keeps a bit set has that copied instead of its ids.
    pub(crate) fn walk_path(
        &self,
        hashes: &[SequenceHash],
        scratch: &mut HeldScratch,
        wide: usize,
    ) {
        scratch.lazy = true;
        scratch.touched.clear();
        scratch.path.clear();
        scratch.copied.clear();
        scratch.bits.clear();
        scratch.most = 0;
        self.descend(hashes, |_, c, held| {
            if c.ids.is_empty() {
                return;
            }
            let (ids, bits) = (scratch.copied.len() as u32, scratch.bits.len() as u32);
            if c.ids.len() > wide && !c.bits.is_empty() {
                scratch.bits.extend_from_slice(&c.bits);
            } else {
                scratch.copied.extend_from_slice(&c.ids);
            }
            scratch.path.push(PathNode {
                held,
                count: c.ids.len() as u32,
                ids: (ids, scratch.copied.len() as u32),
                bits: (bits, scratch.bits.len() as u32),
            });
            scratch.most = scratch.most.max(held);
        });
    }
}

/// Most nodes an [`InsertPlan`] names (a path branches where live requests part: a system
/// prompt, a tool list, each turn of a conversation others are still in); a longer path is
/// inserted as before, all under the write lock.
const PLAN_STEPS: usize = 16;

/// Where a prompt's path goes through the trie, worked out by [`ActiveTrie::plan`] under a
/// read lock (the hash comparisons along the whole prompt) so that the write lock only counts
/// the request on the nodes it names ([`ActiveTrie::insert_planned`]). Each node is named with
/// its serial; if any has changed since, the plan is stale and the insertion compares hashes
/// again from the last unchanged node.
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct InsertPlan {
    /// The nodes entered, in path order, with their serials.
    steps: [(u32, u64); PLAN_STEPS],
    len: u8,
    /// The last node is split after this many of its blocks (0: it is entered whole).
    split: u32,
    /// A leaf for the rest of the prompt hangs from the path's last node.
    leaf: bool,
    /// The path fitted in `steps`.
    whole: bool,
}

impl ActiveTrie {
    /// The plan of [`Self::insert`] for `seq` as the trie is now (see [`InsertPlan`]).
    pub(crate) fn plan(&self, seq: &[SequenceHash]) -> InsertPlan {
        let mut p = InsertPlan {
            whole: true,
            ..InsertPlan::default()
        };
        let mut reached = 0;
        self.descend(seq, |id, c, held| {
            match p.steps.get_mut(usize::from(p.len)) {
                Some(step) => {
                    *step = (id, c.serial);
                    p.len += 1;
                }
                None => p.whole = false,
            }
            // A node's run sits at the same positions as the prompt's (both from the root).
            if held < c.end as u64 {
                p.split = (held as usize - c.start).max(1) as u32;
            }
            reached = held;
        });
        p.leaf = (reached as usize) < seq.len();
        p
    }

    /// [`Self::insert`] along `plan` (made by [`Self::plan`] for the same `seq`) when every
    /// node it names is as it was then, without comparing hashes again; else along the nodes
    /// from the root that still are, comparing hashes only from where they end. Either way,
    /// exactly what [`Self::insert`] returns.
    pub(crate) fn insert_planned(
        &mut self,
        rank: u32,
        seq: &Arc<[SequenceHash]>,
        plan: &InsertPlan,
    ) -> (u32, u64) {
        if !plan.whole {
            return self.insert(rank, seq);
        }
        let holds = self.plan_holds(seq, plan);
        self.stale_plans += u64::from(!holds);
        // A stale plan's nodes from the root whose serials still hold, entered whole, are still
        // the prompt's path: the request is counted on them and hashes compared on from there.
        let steps = &plan.steps[..usize::from(plan.len)];
        let (mut node, mut pos, mut added) = (ROOT, 0, 0);
        for (k, &(id, serial)) in steps.iter().enumerate() {
            let split = k + 1 == steps.len() && plan.split > 0;
            if !holds && (split || !self.unchanged(id, serial)) {
                break;
            }
            let child = if split {
                self.split(node, id, plan.split as usize)
            } else {
                id
            };
            added += self.enter(child, rank);
            pos = self.node(child).end;
            node = child;
        }
        if !holds {
            return self.insert_from(rank, seq, (node, pos, added));
        }
        if plan.leaf {
            let leaf = self.add_leaf(node, rank, seq, pos);
            return (leaf, added + (seq.len() - pos) as u64);
        }
        (node, added)
    }

    /// Whether `plan` (whole) still describes `seq`'s path: every node it names has its serial
    /// (so the same run and parent), and the leaf it would add does not exist meanwhile.
    fn plan_holds(&self, seq: &[SequenceHash], plan: &InsertPlan) -> bool {
        let steps = &plan.steps[..usize::from(plan.len)];
        if !steps.iter().all(|&(id, serial)| self.unchanged(id, serial)) {
            return false;
        }
        if !plan.leaf || plan.split > 0 {
            // A split's upper half is new, so no other leaf hangs from it yet.
            return true;
        }
        let (parent, pos) = steps
            .last()
            .map_or((ROOT, 0), |&(id, _)| (id, self.node(id).end));
        seq.get(pos)
            .is_some_and(|&first| !self.edges.contains_key(&Edge { parent, first }))
    }

    /// Whether node `id` still has the serial a plan named it with (same run and parent).
    fn unchanged(&self, id: u32, serial: u64) -> bool {
        self.nodes.get(id as usize).map(|n| n.serial) == Some(serial)
    }

    /// Plans found stale when applied (a write between the plan and the insertion).
    pub(crate) fn stale_plans(&self) -> u64 {
        self.stale_plans
    }
}

#[cfg(test)]
mod tests;
