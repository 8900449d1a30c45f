//! Ordered picks: Dynamo's cost at temperature 0 without reading every candidate.
//!
//! A candidate that caches nothing of the prompt and has none of it active costs its load key
//! (the slot tracker's [`crate::slots::KeyParams`] order) plus the prompt's own share, the same
//! for all of them; every other candidate is a *holder*, found by the two walks a pick makes
//! anyway (the prefix index's and the active requests' trie). Neither walk writes an entry per
//! holder: the index's leaves the prompt's *levels* (stretches held alike, each with its
//! holder list, [`crate::index::LevelView`]) and the trie's copies each node's rank list, and a
//! rank's share is looked up in them when the rank is costed. So the pick costs exactly:
//! - the holders of each level, deepest first, unless the level's bound (the least load key,
//!   less the most its holders can be credited and the most a rank left to the walk by load
//!   has active, see the next step) rules the whole level out; a level held by at most an
//!   eighth of the candidates is read holder by holder, each costed unless its own key rules
//!   it out; a larger one is left to the walk by load, which then allows for the credit its
//!   holders may have;
//! - the holders of active blocks likewise, node by node along the prompt's path in the active
//!   requests' trie, deepest first: a node with at most an eighth of the candidates has its
//!   ranks read one by one, a wider one (a system prompt many requests share) is allowed for by
//!   its depth in the walk by load;
//! - the ranks the slot tracker's order yields, least key first, with keys up to the
//!   runner-up's cost less the prompt's share plus those allowances (each one's own bound then
//!   decides whether it is costed); the order reads a group of 16 ranks only when its bound is
//!   the least left, so a walk that stops early reads a few groups however large the fleet;
//!
//! and then applies the scan's own choice ([`CostWeights::choose_two`]) to the costed candidates
//! at most as dear as the runner-up, in candidate order: every candidate tied with the cheapest
//! or with the runner-up is among them, so the choice, its tie-break by requests in flight and
//! the random draw among equals are the full scan's
//! (`kv::tests::ordered::ordered_picks_choose_as_the_scan_does`).
//!
//! Exact ties cost it the most. Every candidate tied with the cheapest must be costed (the
//! random draw among them reads them all). A tie with the runner-up need not be, when the
//! cheapest is alone below it and the sums are exact ([`CostWeights::exact_below`]: dyadic
//! weights such as Dynamo's, power-of-two blocks, loads below 2²⁶ blocks): a candidate's bound
//! (its key, the share, its credit and active share) is then its cost to the last bit, and one
//! that only ties with the runner-up and comes after it in the scan's tie-break (requests in
//! flight, then the earlier candidate) cannot be chosen, so it is passed over uncosted. With
//! weights that round (0.7), a tie within the bounds' slack is costed. A pick that would cost
//! more than an eighth of the candidates stops and leaves the pick to the scan, as does a walk
//! by load that costs 32 candidates (or a 32nd of them) in a row at the runner-up's cost (an
//! idle fleet, equal loads).
//! Reading one rank's cached prefix from the levels is a binary search per level; once a pick
//! has read about as many as writing every holder's run out would cost, it writes them out
//! ([`crate::index::PrefixIndex::materialize`]) and reads each in one step after.
//!
//! Where the shortcut would not be exact or does not apply, the pick reads every candidate as
//! before: another cost model (predicted TTFT reads per-endpoint speeds and engine metrics),
//! temperature above 0 (sampling weighs every cost), bounded loads (they read every candidate's
//! requests), per-candidate bias (a decode leg's transfer cost, adapter terms), scores asked
//! for, data-parallel ranks in the index, or a candidate list the roster cannot map (a
//! data-parallel rank among the candidates, a worker named twice).
//!
//! Which candidate each worker and dense id is comes from the list's roster (`roster.rs`, made
//! once per list).
//!
//! Invariants: the shortcut never consumes randomness before it is sure to answer, so falling
//! back leaves the pick's random draws as they were; a candidate passed over uncosted is
//! dearer than the runner-up, or tied with it and behind it in the scan's tie-break, by a
//! bound that is its cost exactly or less.

use std::sync::Arc;

use super::roster::Maps;
use super::scratch::{PickScratch, Visit};
use super::{KvState, PrefixMode, PromptBlocks, Walked, HINT_APPROX_INDEX, HINT_EVENT_INDEX};
use crate::cost::{CandidateLoad, CostWeights, KvDecision};
use crate::slots::KeyParams;
use crate::Endpoint;

/// What an ordered pick decided: the chosen candidate's index, load, version and cost, and the
/// runner-up.
#[derive(Debug, Clone, Copy)]
pub(super) struct Ordered {
    pub(super) best: usize,
    pub(super) second: Option<usize>,
    pub(super) load: CandidateLoad,
    pub(super) version: u64,
    pub(super) cost: f64,
    /// Candidates it costed (what the tests bound).
    #[cfg_attr(not(test), allow(dead_code))]
    pub(super) costed: usize,
    /// Ranks its walk by load read (what the tests bound).
    #[cfg_attr(not(test), allow(dead_code))]
    pub(super) walk_reads: usize,
}

/// The decision for a chosen candidate with load `c` and cost `cost` (no bounded loads, no
/// TTFT prediction: the scan adds those).
pub(super) fn decision(
    prompt: Option<&PromptBlocks>,
    (w, bs): (&CostWeights, u32),
    c: &CandidateLoad,
    cost: f64,
    load_version: Option<u64>,
) -> KvDecision {
    let isl = prompt.map_or(0, |p| p.isl_tokens);
    KvDecision {
        mode: prompt.map_or(PrefixMode::None, |p| p.mode),
        prompt_blocks: prompt.map_or(0, |p| p.hashes.len() as u64),
        overlap: c.overlap,
        cost,
        effective_prefill_tokens: w.effective_prefill_tokens(isl, bs, c.overlap),
        potential_prefill_tokens: c.potential_prefill_tokens,
        potential_decode_blocks: c.potential_decode_blocks,
        active_requests: c.active_requests,
        load_version,
        load_bounded: false,
        objective_filtered: false,
        ttft: None,
        decode: None,
        objective: None,
    }
}

/// What every step of one ordered pick reads: the walks, the candidates and their roster, the
/// weights and the prompt's share.
struct Pass<'a> {
    walked: &'a Walked,
    candidates: &'a [Arc<Endpoint>],
    maps: &'a Maps,
    w: &'a CostWeights,
    bs: u32,
    share: f64,
    /// [`CostWeights::exact_below`] for this pick, or 0.0 where its prompt or weights make the
    /// sums inexact: below it a bound summed from a rank's key, the share, its credit and its
    /// active share is its cost exactly, so a tie is known without costing the candidate.
    exact: f64,
}

impl Pass<'_> {
    /// Whether candidate `i`, whose load key is `key` and whose cost is at least `bound` (summed
    /// from exact terms, each below [`Self::exact`]), may still be the choice or the runner-up
    /// and so must be costed: false only for a candidate known to be behind the runner-up
    /// ([`Two::behind`]). Without exact sums, every candidate within the bounds is costed.
    fn may_matter(&self, two: &Two, bound: f64, key: f64, i: usize) -> bool {
        if bound < two.cut() || !(key < self.exact && two.cut() < self.exact) {
            return true;
        }
        !two.behind(bound, i as u32, || self.candidates[i].load.in_flight())
    }

    /// The most any rank holding `end` blocks of the prompt can be credited for them.
    fn most_credit(&self, end: u64) -> f64 {
        self.w.prefill_load_scale * self.w.overlap_credit_bound(end)
    }

    /// What candidate `e`'s cached prefix takes off its cost (a read counted as
    /// [`KvState::read_cached`] counts it).
    fn cached_credit(&self, sc: &mut PickScratch, e: &Endpoint) -> f64 {
        KvState::read_cached(self.walked, sc);
        self.walked
            .index
            .as_ref()
            .and_then(|ix| ix.walked(&sc.matching, e.rank(), &e.hints.index[self.walked.hint]))
            .map_or(0.0, |o| {
                self.w.prefill_load_scale * self.w.overlap_credit(o)
            })
    }

    /// More holders than this (a level's, an active node's) are allowed for in the walk by
    /// load rather than read one by one.
    fn wide(&self) -> usize {
        wide(self.candidates.len())
    }

    /// The most leading blocks of the prompt a rank may have active without being read in step
    /// 3: the depth of the deepest wide node on the prompt's path (a rank's share is that of
    /// the deepest node it is in, so one in no narrow node has at most that); without a walk
    /// of the path, the most any rank has.
    fn active_allowance(&self, sc: &PickScratch) -> f64 {
        if sc.held.path_len() == 0 {
            return sc.held.most() as f64;
        }
        let wide = self.wide();
        (0..sc.held.path_len())
            .filter_map(|k| sc.held.path_node(k))
            .filter(|p| p.count > wide)
            .map(|p| p.held as f64)
            .fold(0.0, f64::max)
    }

    /// The `j`-th holder of level `k` of the index walk.
    fn level_rank(&self, sc: &PickScratch, k: usize, j: usize) -> Option<crate::slots::WorkerRank> {
        self.walked.index.as_ref()?.level(&sc.matching, k)?.rank(j)
    }
}

/// A costed candidate as the scan's choice orders it: by cost, then requests in flight, then
/// its index (the runner-up's tie-break, [`CostWeights::choose_two`]).
#[derive(Debug, Clone, Copy, PartialEq, PartialOrd)]
struct Seen {
    cost: f64,
    in_flight: u32,
    i: u32,
}

impl Seen {
    const NONE: Seen = Seen {
        cost: f64::INFINITY,
        in_flight: u32::MAX,
        i: u32::MAX,
    };
}

/// The two least costed candidates in [`Seen`]'s order: their costs are the two least seen
/// (with repeats), and the runner-up's cost bounds what may still matter. When the least is
/// alone at its cost, it is the scan's choice and the second is the scan's runner-up among
/// those costed so far.
#[derive(Debug, Clone, Copy)]
struct Two {
    least: Seen,
    second: Seen,
}

impl Two {
    const NONE: Two = Two {
        least: Seen::NONE,
        second: Seen::NONE,
    };

    fn add(&mut self, s: Seen) {
        if s < self.least {
            self.second = self.least;
            self.least = s;
        } else if s < self.second {
            self.second = s;
        }
    }

    /// The runner-up's cost.
    fn cut(&self) -> f64 {
        self.second.cost
    }

    /// The most a bound summed in another order may be and still not rule its candidate out:
    /// the runner-up's cost and the slack.
    fn reach(&self) -> f64 {
        self.cut() + slack(self.cut())
    }

    /// Whether a candidate costing at least `at.cost` (exactly) cannot be the scan's choice or
    /// runner-up, whatever is costed later: it is dearer than the runner-up, or ties with it
    /// and comes after it in the tie-break while the cheapest is alone below them (so the
    /// random draw among the cheapest does not read it). The runner-up only gets cheaper or
    /// earlier, so the answer stays true.
    ///
    /// The candidate is `(cost, in_flight(), i)`; its requests in flight are read only where
    /// they decide (not when it ties with a runner-up that has none in flight and comes
    /// before it: it is behind however many it has).
    fn behind(&self, cost: f64, i: u32, in_flight: impl FnOnce() -> u32) -> bool {
        if cost > self.second.cost {
            return true;
        }
        if !(self.least.cost < self.second.cost && self.second.cost > 0.0) {
            return false;
        }
        if cost == self.second.cost && self.second.in_flight == 0 && i > self.second.i {
            return true;
        }
        let at = Seen {
            cost,
            in_flight: in_flight(),
            i,
        };
        at > self.second
    }
}

/// [`Two`] as the loop over a level's holders tests it, worked out once per change of the
/// runner-up: `passed_over` is [`Pass::may_matter`]'s false answer where it needs no more
/// than the bound, the key and the index (the rest go to `may_matter`).
#[derive(Debug, Clone, Copy)]
struct Gate {
    reach: f64,
    /// The runner-up's cost where sums below `exact` are exact (+∞ otherwise: nothing is
    /// passed over).
    cut: f64,
    exact: f64,
    /// The runner-up's index where a tie with it comes after it whatever the candidate has in
    /// flight (the cheapest alone below it, and it has none in flight); else `u32::MAX`.
    tie_i: u32,
}

impl Gate {
    fn of(two: &Two, exact: f64) -> Gate {
        let cut = two.cut();
        let exact_cut = cut < exact;
        let s = two.second;
        let tie = exact_cut && two.least.cost < cut && cut > 0.0 && s.in_flight == 0;
        Gate {
            reach: two.reach(),
            cut: if exact_cut { cut } else { f64::INFINITY },
            exact,
            tie_i: if tie { s.i } else { u32::MAX },
        }
    }

    /// Whether a candidate with key `key`, bound `bound` and index `i` is known to be behind
    /// the runner-up ([`Two::behind`]) from these alone.
    #[inline]
    fn passed_over(&self, bound: f64, key: f64, i: usize) -> bool {
        key < self.exact && (bound > self.cut || (bound == self.cut && i as u32 > self.tie_i))
    }
}

/// A level of the prompt held by at most this many ranks has them costed one by one; a larger
/// one is left to the walk by load (small in tests, so random fleets take both paths).
const ENUMERATE: usize = if cfg!(test) { 2 } else { 32 };

/// More holders than this of `n` candidates are wide (see [`Pass::wide`]).
fn wide(n: usize) -> usize {
    ENUMERATE.max(n / 8)
}

/// Candidates costed or passed over in a row at the runner-up's cost (at least; a 32nd of the
/// candidates if more) after which the walk by load takes it for a plateau of ties and leaves
/// the pick to the scan (which reads them all at less cost each).
const TIE_RUN: usize = 32;

/// The fewest reads of one rank's cached prefix from the levels after which an ordered pick
/// writes every holder's run out (each read is a binary search per level; writing them all out
/// costs about what the walk did before levels).
const MATERIALIZE_AFTER: usize = if cfg!(test) { 3 } else { 48 };

/// Floating-point slack for a bound against a cost computed in another order (far above the
/// rounding of either, far below any difference a block count makes).
fn slack(x: f64) -> f64 {
    1e-9 * x.abs().max(1.0)
}

impl KvState {
    /// Whether a pick with these weights may take the ordered shortcut (the rest is checked by
    /// [`Self::rank_ordered`]).
    pub(super) fn orderable(w: &CostWeights, scores: bool, bias: &[f64]) -> bool {
        w.cost_model == crate::cost::CostModel::Dynamo
            && w.temperature <= 0.0
            && !w.bounds_loads()
            && !scores
            && bias.is_empty()
    }

    /// Costs candidate `i` once (None: its tracker hint missed, or the budget is spent; the
    /// caller falls back).
    #[inline]
    fn cost_once(
        &self,
        cx: &Pass<'_>,
        sc: &mut PickScratch,
        i: usize,
        two: &mut Two,
    ) -> Option<()> {
        if sc.seen[i] == sc.epoch {
            return Some(());
        }
        if sc.visits.len() >= sc.budget {
            return None;
        }
        sc.seen[i] = sc.epoch;
        Self::read_cached(cx.walked, sc);
        let (load, version) = self.load_of(cx.walked, sc, i, &cx.candidates[i])?;
        let cost = cx.w.cost(cx.bs, &load);
        two.add(Seen {
            cost,
            in_flight: cx.candidates[i].load.in_flight(),
            i: i as u32,
        });
        sc.visits.push(Visit {
            i: i as u32,
            cost,
            load,
            version,
        });
        Some(())
    }

    /// Counts a read of one rank's cached prefix; once the reads from the levels have cost
    /// about what writing every holder's run out does (`sc.materialize_at`), writes them out
    /// (each later read is then one step).
    fn read_cached(walked: &Walked, sc: &mut PickScratch) {
        sc.lazy_reads += 1;
        if sc.lazy_reads == sc.materialize_at {
            if let Some(ix) = &walked.index {
                ix.materialize(&mut sc.matching);
            }
        }
    }

    /// An ordered pick's two walks (the prompt's index, its active requests' trie) and fresh
    /// marks for `n` candidates; None: the index has data-parallel ranks (the scan gathers
    /// those per worker).
    fn walk_for_order(
        &self,
        prompt: Option<&PromptBlocks>,
        n: usize,
        sc: &mut PickScratch,
    ) -> Option<Walked> {
        let (hashes, isl) = prompt.map_or((&[][..], 0), |p| (&p.hashes[..], p.isl_tokens));
        let approximate = prompt.is_some_and(|p| p.mode == PrefixMode::Approximate);
        let ix = if approximate {
            self.approx.index.read()
        } else {
            self.index.read()
        };
        if ix.has_nonzero_dp_ranks() {
            return None;
        }
        if !hashes.is_empty() {
            ix.walk_levels(
                hashes,
                &mut sc.matching,
                self.settings.prefix_closed && !approximate,
            );
        }
        let walked = Walked {
            index: (!hashes.is_empty()).then_some(ix),
            hint: if approximate {
                HINT_APPROX_INDEX
            } else {
                HINT_EVENT_INDEX
            },
            per_worker: false,
            blocks: hashes.len() as u64,
            isl,
            fallback: None,
            speculative: false,
        };
        self.slots.walk_held_path(hashes, &mut sc.held, wide(n));
        sc.visits.clear();
        sc.lazy_reads = 0;
        // A read from the levels costs about as many steps as writing out eight holders.
        let holders: usize = walked.index.as_ref().map_or(0, |ix| {
            (0..ix.level_count(&sc.matching))
                .filter_map(|k| ix.level(&sc.matching, k))
                .map(|l| l.len())
                .sum()
        });
        sc.materialize_at = MATERIALIZE_AFTER.max(holders / 8);
        sc.epoch = sc.epoch.wrapping_add(1);
        if sc.seen.len() != n || sc.epoch == 0 {
            sc.seen.clear();
            sc.seen.resize(n, 0);
            sc.epoch = 1;
        }
        Some(walked)
    }

    /// The ordered pick (see the module documentation); None: it does not apply here, and the
    /// caller scans. `w` must be [`Self::orderable`].
    pub(super) fn rank_ordered(
        &self,
        candidates: &[Arc<Endpoint>],
        (prompt, list): (Option<&PromptBlocks>, Option<u64>),
        (w, bs): (&CostWeights, u32),
        rng: &mut fastrand::Rng,
        sc: &mut PickScratch,
    ) -> Option<Ordered> {
        let n = candidates.len();
        let params = KeyParams {
            prefill_load_scale: w.prefill_load_scale,
            block_size: bs,
            per_request: w.decode_active_request_weight,
        };
        if n < 2 || !self.slots.keyed_by(&params) {
            return None;
        }
        let roster = self.roster(candidates, list)?;
        let maps = roster.get()?.maps.as_ref()?;
        let walked = self.walk_for_order(prompt, n, sc)?;
        let (hashes, isl) = prompt.map_or((&[][..], 0), |p| (&p.hashes[..], p.isl_tokens));
        // Costing a candidate here costs about what the scan spends on one: past an eighth of
        // them (many candidates tied with the runner-up, an idle fleet), the scan is cheaper.
        sc.budget = (n / 8).max(32);
        // What every candidate pays for the prompt when it holds none of it.
        let share = w.prefill_load_scale * (isl as f64 * (1.0 / f64::from(bs.max(1))))
            + hashes.len() as f64;
        let exact = w.exact_below(bs);
        let most_credit = w.prefill_load_scale * w.overlap_credit_bound(hashes.len() as u64);
        let cx = Pass {
            walked: &walked,
            candidates,
            maps,
            w,
            bs,
            share,
            exact: if share < exact && most_credit < exact {
                exact
            } else {
                0.0
            },
        };
        let mut two = Two::NONE;
        // The most a rank not read in step 3 can have active: every bound before the walk by
        // load may use it, since step 3 reads the others against their own share.
        let loose_held = cx.active_allowance(sc);
        let loose_cached = self.cost_levels(&cx, sc, &mut two, loose_held)?;
        self.cost_active(&cx, sc, &mut two)?;
        self.walk_by_load(&cx, sc, &mut two, (loose_cached, loose_held))?;
        drop(walked);
        self.choose_among_visits(candidates, w, two, rng, sc)
    }

    /// Steps 1 and 2 of an ordered pick: a holder of the deepest level and the least loaded
    /// rank, for a first bound; then the levels of cached blocks, deepest first, unless their
    /// bound (the least key, less the most their holders can be credited and `most_held`, the
    /// most a rank that step 3 does not read may have active) rules them out. A rank that step
    /// 3 reads is checked there against its own share, so it may be skipped here. The holders
    /// of a level of at most an eighth of the candidates are read one by one (costed when their
    /// own key does not rule them out); a larger one's are left to the walk by load, which
    /// allows for the credit they may have: the most of that is returned (None: fall back to
    /// the scan).
    fn cost_levels(
        &self,
        cx: &Pass<'_>,
        sc: &mut PickScratch,
        two: &mut Two,
        most_held: f64,
    ) -> Option<f64> {
        let levels = cx
            .walked
            .index
            .as_ref()
            .map_or(0, |ix| ix.level_count(&sc.matching));
        if let Some(r) = levels.checked_sub(1).and_then(|k| cx.level_rank(sc, k, 0)) {
            if let Some(i) = cx.maps.of_worker(r.worker, cx.candidates) {
                self.cost_once(cx, sc, i, two)?;
            }
        }
        if let Some(id) = self.slots.least_loaded() {
            if let Some(i) = cx.maps.of_dense(id, cx.candidates) {
                self.cost_once(cx, sc, i, two)?;
            }
        }
        let least = self.slots.least_key();
        let mut loose = 0.0f64;
        for k in (0..levels).rev() {
            // The level's view borrows the index, not the scratch (a pick's writes to the
            // scratch leave its levels as they are).
            let Some(view) = cx
                .walked
                .index
                .as_ref()
                .and_then(|ix| ix.level(&sc.matching, k))
            else {
                continue;
            };
            let (end, len) = (view.end(), view.len());
            // What every holder of the level pays for the prompt at the least.
            let below = cx.share - cx.most_credit(end) - most_held;
            if least + below > two.reach() {
                continue;
            }
            if len > cx.wide() {
                loose = loose.max(cx.most_credit(end));
                continue;
            }
            let ix = cx.walked.index.as_ref()?;
            let by_slot = cx
                .maps
                .slot_map((cx.walked.hint, ix.slot_epoch()), || ix.slot_workers());
            let mut keys = self.slots.load_keys();
            let mut gate = Gate::of(two, cx.exact);
            for slot in view.slots() {
                let Some((i, id)) = by_slot.get(slot, || ix.slot_worker(slot)) else {
                    continue;
                };
                let key = keys.key(id);
                let bound = key + below;
                if bound > gate.reach
                    || gate.passed_over(bound, key, i)
                    || !cx.may_matter(two, bound, key, i)
                {
                    continue;
                }
                // Its own bound: a holder not costed yet ends its run in this level (one that
                // runs deeper was costed or ruled out there), so this is its cost but for a
                // tier weighing less than the most.
                // (Looked up only where it may rule the holder out: with nothing active it
                // would still be below the runner-up otherwise.)
                let may_tie = key + below + most_held >= two.cut();
                let own = || key + cx.share - cx.most_credit(end) - sc.held.get(id as usize) as f64;
                if !may_tie || cx.may_matter(two, own(), key, i) {
                    self.cost_once(cx, sc, i, two)?;
                    gate = Gate::of(two, cx.exact);
                }
            }
        }
        Some(loose)
    }

    /// Step 3: holders of active blocks, node by node along the prompt's path in the active
    /// requests' trie, deepest first: the ranks of a node with at most an eighth of the
    /// candidates are each costed unless their own key, cached and active share rule them out.
    /// A wider node (a system prompt many requests share) is left to the walk by load, which
    /// allows for its depth ([`Pass::active_allowance`]). None: fall back to the scan.
    fn cost_active(&self, cx: &Pass<'_>, sc: &mut PickScratch, two: &mut Two) -> Option<()> {
        let wide = cx.wide();
        for k in (0..sc.held.path_len()).rev() {
            let Some(node) = sc.held.path_node(k).filter(|p| p.count <= wide) else {
                continue;
            };
            for j in node.ranks {
                let Some(id) = sc.held.holder(j) else {
                    break;
                };
                let Some(i) = cx.maps.of_dense(id, cx.candidates) else {
                    continue;
                };
                let key = self.slots.load_key(id);
                let bound = key + cx.share
                    - cx.cached_credit(sc, &cx.candidates[i])
                    - sc.held.get_listed(id as usize, k) as f64;
                if bound <= two.reach() && cx.may_matter(two, bound, key, i) {
                    self.cost_once(cx, sc, i, two)?;
                }
            }
        }
        Some(())
    }

    /// Step 4: the least loaded, least key first, as long as their keys could beat the
    /// runner-up: every candidate not costed yet pays the whole share of the prompt, less what
    /// the allowances (`loose`: cached, active) leave room for. With an allowance, each one's own
    /// bound decides (a few reads of memory: at worst every candidate is read so, still far
    /// cheaper than costing it). None: fall back to the scan (budget spent, a hint missed, or a
    /// plateau of ties).
    fn walk_by_load(
        &self,
        cx: &Pass<'_>,
        sc: &mut PickScratch,
        two: &mut Two,
        (loose_cached, loose_held): (f64, f64),
    ) -> Option<()> {
        let loose = loose_cached + loose_held;
        let limit = |two: &Two| two.cut() - cx.share + loose + slack(two.cut());
        let mut failed = false;
        // Candidates costed or passed over in a row at exactly the runner-up's cost: a plateau of
        // ties (an idle fleet, equal loads), which the walk would read to its end.
        let mut tied = 0;
        let plateau = TIE_RUN.max(cx.candidates.len() / 32);
        let mut by_load = std::mem::take(&mut sc.by_load);
        sc.walk_reads = 0;
        self.slots
            .visit_by_load(limit(two), &mut by_load, |id, key| {
                sc.walk_reads += 1;
                if let Some(i) = cx.maps.of_dense(id, cx.candidates) {
                    // Its own active share first (one read), then its cached one (from the levels,
                    // or written out once many were read). Without an allowance every holder of
                    // the prompt was costed or ruled out before, so it pays the whole share.
                    let uncached = key + cx.share - sc.held.get(id as usize) as f64;
                    let reach = two.reach();
                    let bound = if loose == 0.0 {
                        Some(uncached)
                    } else if uncached - loose_cached > reach {
                        None
                    } else {
                        Some(uncached - cx.cached_credit(sc, &cx.candidates[i]))
                            .filter(|&b| b <= reach)
                    };
                    if let Some(b) = bound {
                        if cx.may_matter(two, b, key, i) {
                            let before = sc.visits.len();
                            failed |= self.cost_once(cx, sc, i, two).is_none();
                            if sc.visits.len() > before {
                                let tie = sc.visits.last().is_some_and(|v| v.cost == two.cut());
                                tied = if tie { tied + 1 } else { 0 };
                            }
                        } else if b == two.cut() {
                            // A tie passed over counts toward the plateau all the same: reading
                            // every rank of an idle fleet costs more than the scan.
                            tied += 1;
                        }
                        failed |= tied >= plateau;
                    }
                }
                // Once it has failed, nothing more is read.
                if failed {
                    f64::NEG_INFINITY
                } else {
                    limit(two)
                }
            });
        sc.by_load = by_load;
        (!failed).then_some(())
    }

    /// The scan's choice over the costed candidates at most as dear as the runner-up.
    fn choose_among_visits(
        &self,
        candidates: &[Arc<Endpoint>],
        w: &CostWeights,
        two: Two,
        rng: &mut fastrand::Rng,
        sc: &mut PickScratch,
    ) -> Option<Ordered> {
        if sc.visits.len() < 2 {
            return None;
        }
        let costed = sc.visits.len();
        let cut = two.cut();
        sc.visits.retain(|v| v.cost <= cut);
        sc.visits.sort_unstable_by_key(|v| v.i);
        sc.close.clear();
        sc.close.extend(sc.visits.iter().map(|v| v.cost));
        let in_flight = |j: usize| candidates[sc.visits[j].i as usize].load.in_flight();
        let booked_at = |j: usize| candidates[sc.visits[j].i as usize].load.booked_at();
        let (best, second) = w.choose_two(&sc.close, in_flight, booked_at, rng);
        let b = sc.visits[best];
        Some(Ordered {
            best: b.i as usize,
            second: second.map(|j| sc.visits[j].i as usize),
            load: b.load,
            version: b.version,
            cost: b.cost,
            costed,
            walk_reads: sc.walk_reads,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Over every small runner-up pair and candidate: `Two::behind`, reading in-flight counts
    /// only where they decide, answers as the whole order does, and `Gate::passed_over` passes
    /// over only candidates that are behind.
    #[test]
    fn the_gate_and_the_lazy_tie_break_agree_with_the_whole_order() {
        let seen = |cost: f64, in_flight: u32, i: u32| Seen { cost, in_flight, i };
        let mut grid = Vec::new();
        for cost in [0.0, 1.0, 2.0, 3.0] {
            for in_flight in 0..3 {
                for i in 0..4 {
                    grid.push(seen(cost, in_flight, i));
                }
            }
        }
        let (mut checked, mut passed) = (0, 0);
        for (a, b) in grid.iter().flat_map(|a| grid.iter().map(move |b| (a, b))) {
            let mut two = Two::NONE;
            two.add(*a);
            two.add(*b);
            let gate = Gate::of(&two, 1e9);
            for at in &grid {
                let whole = at.cost > two.second.cost
                    || (two.least.cost < two.second.cost
                        && two.second.cost > 0.0
                        && *at > two.second);
                assert_eq!(
                    two.behind(at.cost, at.i, || at.in_flight),
                    whole,
                    "{two:?} {at:?}"
                );
                if gate.passed_over(at.cost, 0.0, at.i as usize) {
                    assert!(whole, "passed over but not behind: {two:?} {at:?}");
                    passed += 1;
                }
                checked += 1;
            }
        }
        assert!(passed > 0 && passed < checked);
        // Without exact sums nothing is passed over.
        let mut two = Two::NONE;
        two.add(seen(1.0, 0, 0));
        two.add(seen(2.0, 0, 1));
        assert!(Gate::of(&two, 1e9).passed_over(2.0, 0.0, 3));
        assert!(!Gate::of(&two, 0.0).passed_over(2.0, 0.0, 3));
        assert!(!Gate::of(&two, 1e9).passed_over(2.0, 2e9, 3));
    }
}
