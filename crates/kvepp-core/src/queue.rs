//! Flow control's waiting line: requests that found every endpoint saturated wait here until
//! capacity frees.
//!
//! Order of service: the highest priority first; within one priority, flows (the fairness key, e.g.
//! a tenant) take turns one request at a time (round robin); within one flow, first come first
//! served. The queue only orders: it holds whatever the caller stores per request (a waker) and
//! never blocks, sleeps or reads a clock.
//!
//! Invariants:
//! - each priority holds at most `capacity` requests ([`FlowQueue::push`] refuses more; a request
//!   put back with [`FlowQueue::push_front`] is not counted against it, it already had its place);
//! - an id names exactly one waiting request until it is popped or removed;
//! - a flow with no waiting request is forgotten (no growth with the number of flows seen).

use std::cmp::Reverse;
use std::collections::{BTreeMap, HashMap, VecDeque};
use std::sync::Arc;

/// A waiting request's place in the queue.
pub type QueueId = u64;

#[derive(Debug)]
struct Band<T> {
    /// Flows with waiting requests, in turn order.
    turns: VecDeque<Arc<str>>,
    flows: HashMap<Arc<str>, VecDeque<(QueueId, T)>>,
    len: usize,
}

impl<T> Default for Band<T> {
    fn default() -> Self {
        Band {
            turns: VecDeque::new(),
            flows: HashMap::new(),
            len: 0,
        }
    }
}

/// The queue is full for this priority.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("the queue for priority {priority} is full ({capacity} requests waiting)")]
pub struct QueueFull {
    pub priority: i32,
    pub capacity: usize,
}

/// Requests waiting for capacity, by priority, flow and arrival.
#[derive(Debug)]
pub struct FlowQueue<T> {
    bands: BTreeMap<Reverse<i32>, Band<T>>,
    places: HashMap<QueueId, (i32, Arc<str>)>,
    next_id: QueueId,
    capacity: usize,
}

impl<T> FlowQueue<T> {
    /// A queue holding at most `capacity` requests per priority.
    pub fn new(capacity: usize) -> Self {
        FlowQueue {
            bands: BTreeMap::new(),
            places: HashMap::new(),
            next_id: 0,
            capacity,
        }
    }

    /// Requests waiting, all priorities.
    pub fn len(&self) -> usize {
        self.places.len()
    }

    pub fn is_empty(&self) -> bool {
        self.places.is_empty()
    }

    /// Requests waiting at `priority`.
    pub fn len_at(&self, priority: i32) -> usize {
        self.bands.get(&Reverse(priority)).map_or(0, |b| b.len)
    }

    /// (priority, waiting) for every priority with waiting requests, highest first.
    pub fn lengths(&self) -> impl Iterator<Item = (i32, usize)> + '_ {
        self.bands.iter().map(|(Reverse(p), b)| (*p, b.len))
    }

    /// A new bound per priority: requests already waiting beyond it stay (they leave as usual);
    /// new ones are refused until their priority is below it.
    pub fn set_capacity(&mut self, capacity: usize) {
        self.capacity = capacity;
    }

    /// Queues `item` at the back of `flow` at `priority`; its id, or the item back when that
    /// priority is full.
    pub fn push(&mut self, priority: i32, flow: &str, item: T) -> Result<QueueId, (QueueFull, T)> {
        if self.len_at(priority) >= self.capacity {
            let full = QueueFull {
                priority,
                capacity: self.capacity,
            };
            return Err((full, item));
        }
        let id = self.next_id;
        self.next_id += 1;
        self.insert(id, priority, flow, item, false);
        Ok(id)
    }

    /// Puts a popped request back at the head of its flow, keeping its id (it was served but
    /// could not be placed after all). Not bounded by the capacity.
    pub fn push_front(&mut self, id: QueueId, priority: i32, flow: &str, item: T) {
        self.insert(id, priority, flow, item, true);
    }

    fn insert(&mut self, id: QueueId, priority: i32, flow: &str, item: T, front: bool) {
        let band = self.bands.entry(Reverse(priority)).or_default();
        let key: Arc<str> = match band.flows.get_key_value(flow) {
            Some((k, _)) => k.clone(),
            None => Arc::from(flow),
        };
        let waiting = band.flows.entry(key.clone()).or_default();
        if waiting.is_empty() {
            // A flow coming back (or a request put back) takes its turn first when put back.
            if front {
                band.turns.push_front(key.clone());
            } else {
                band.turns.push_back(key.clone());
            }
        }
        if front {
            waiting.push_front((id, item));
        } else {
            waiting.push_back((id, item));
        }
        band.len += 1;
        self.places.insert(id, (priority, key));
    }

    /// The next request to serve: (id, priority, flow, item).
    pub fn pop(&mut self) -> Option<(QueueId, i32, Arc<str>, T)> {
        let (&Reverse(priority), band) = self.bands.iter_mut().next()?;
        let flow = band.turns.pop_front()?;
        let waiting = band.flows.get_mut(&flow)?;
        let (id, item) = waiting.pop_front()?;
        if waiting.is_empty() {
            band.flows.remove(&flow);
        } else {
            band.turns.push_back(flow.clone());
        }
        band.len -= 1;
        if band.len == 0 {
            self.bands.remove(&Reverse(priority));
        }
        self.places.remove(&id);
        Some((id, priority, flow, item))
    }

    /// Takes request `id` out of the queue (its client left, or it waited too long).
    pub fn remove(&mut self, id: QueueId) -> Option<T> {
        let (priority, flow) = self.places.remove(&id)?;
        let band = self.bands.get_mut(&Reverse(priority))?;
        let waiting = band.flows.get_mut(&flow)?;
        let at = waiting.iter().position(|(i, _)| *i == id)?;
        let (_, item) = waiting.remove(at)?;
        if waiting.is_empty() {
            band.flows.remove(&flow);
            band.turns.retain(|f| *f != flow);
        }
        band.len -= 1;
        if band.len == 0 {
            self.bands.remove(&Reverse(priority));
        }
        Some(item)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn drain(q: &mut FlowQueue<&'static str>) -> Vec<&'static str> {
        std::iter::from_fn(|| q.pop().map(|(_, _, _, v)| v)).collect()
    }

    #[test]
    fn higher_priority_first_then_arrival() {
        let mut q = FlowQueue::new(10);
        q.push(0, "", "std-1").unwrap();
        q.push(-1, "", "shed-1").unwrap();
        q.push(5, "", "crit-1").unwrap();
        q.push(0, "", "std-2").unwrap();
        q.push(5, "", "crit-2").unwrap();
        assert_eq!(q.len(), 5);
        assert_eq!(
            q.lengths().collect::<Vec<_>>(),
            vec![(5, 2), (0, 2), (-1, 1)]
        );
        assert_eq!(
            drain(&mut q),
            vec!["crit-1", "crit-2", "std-1", "std-2", "shed-1"]
        );
        assert!(q.is_empty());
        assert_eq!(q.lengths().count(), 0, "empty bands are dropped");
    }

    #[test]
    fn flows_take_turns_within_a_priority() {
        let mut q = FlowQueue::new(10);
        for v in ["a1", "a2", "a3"] {
            q.push(0, "tenant-a", v).unwrap();
        }
        q.push(0, "tenant-b", "b1").unwrap();
        q.push(0, "tenant-b", "b2").unwrap();
        q.push(0, "tenant-c", "c1").unwrap();
        assert_eq!(drain(&mut q), vec!["a1", "b1", "c1", "a2", "b2", "a3"]);
    }

    #[test]
    fn capacity_is_per_priority() {
        let mut q = FlowQueue::new(2);
        q.push(-1, "", "x").unwrap();
        q.push(-1, "", "y").unwrap();
        let (full, back) = q.push(-1, "", "z").unwrap_err();
        assert_eq!(back, "z");
        assert_eq!(
            full,
            QueueFull {
                priority: -1,
                capacity: 2
            }
        );
        assert!(q.push(0, "", "other priority").is_ok());
        // A popped request put back does not need a free place.
        let (id, p, flow, v) = q.pop().unwrap();
        assert_eq!(v, "other priority");
        q.push(0, "", "fills it").unwrap();
        q.push(0, "", "full now").unwrap();
        q.push_front(id, p, &flow, v);
        assert_eq!(q.len_at(0), 3);
        assert_eq!(q.pop().unwrap().3, "other priority", "put back at the head");
    }

    #[test]
    fn removed_requests_are_gone_and_flows_forgotten() {
        let mut q = FlowQueue::new(10);
        let a = q.push(0, "a", "a1").unwrap();
        let b = q.push(0, "b", "b1").unwrap();
        q.push(0, "a", "a2").unwrap();
        assert_eq!(q.remove(b), Some("b1"));
        assert_eq!(q.remove(b), None, "an id names one request once");
        assert_eq!(q.remove(a), Some("a1"));
        assert_eq!(q.len(), 1);
        assert_eq!(drain(&mut q), vec!["a2"]);
        assert!(q.bands.is_empty() && q.places.is_empty());
    }

    /// Random operations against a plain reference: same lengths, every id popped or removed once.
    #[test]
    fn random_operations_keep_the_counts() {
        let mut rng = fastrand::Rng::with_seed(11);
        let mut q = FlowQueue::new(8);
        let mut live: Vec<(QueueId, i32)> = Vec::new();
        for step in 0..5000u32 {
            match rng.u8(..3) {
                0 | 1 => {
                    let p = rng.i32(-2..3);
                    let flow = ["a", "b", "c"][rng.usize(..3)];
                    let full = live.iter().filter(|(_, q)| *q == p).count() >= 8;
                    match q.push(p, flow, step) {
                        Ok(id) => {
                            assert!(!full);
                            live.push((id, p));
                        }
                        Err(_) => assert!(full),
                    }
                }
                _ if rng.bool() => {
                    if let Some((id, p, _, _)) = q.pop() {
                        let top = live.iter().map(|(_, p)| *p).max();
                        assert_eq!(Some(p), top, "highest priority first");
                        live.retain(|(i, _)| *i != id);
                    } else {
                        assert!(live.is_empty());
                    }
                }
                _ => {
                    if !live.is_empty() {
                        let (id, _) = live.swap_remove(rng.usize(..live.len()));
                        assert!(q.remove(id).is_some());
                    }
                }
            }
            assert_eq!(q.len(), live.len());
            for p in -2..3 {
                assert_eq!(q.len_at(p), live.iter().filter(|(_, q)| *q == p).count());
            }
        }
    }
}
