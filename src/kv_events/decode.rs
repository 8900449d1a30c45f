//! Decoding of one vLLM KV-event batch (msgpack) into [`EventBatch`].

use std::fmt;

use serde::de::{self, Deserialize, Deserializer, IgnoredAny, MapAccess, SeqAccess, Visitor};

pub use kvepp_core::index::{EngineBlockHash, Tier};

/// The tier of vLLM's `medium` (absent means GPU). Unknown media count as the slowest tier.
pub(crate) fn tier_from_medium(medium: Option<&str>) -> Tier {
    let Some(m) = medium else { return Tier::Device };
    let is = |names: &[&str]| names.iter().any(|n| m.eq_ignore_ascii_case(n));
    if is(&["GPU", "DEVICE"]) {
        Tier::Device
    } else if is(&["CPU", "CPU_PINNED", "CPU_TIER1"]) {
        Tier::Host
    } else {
        Tier::Disk
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum KvEvent {
    /// Consecutive full blocks stored; `token_ids` holds `block_hashes.len() * block_size` tokens and
    /// `parent` is the engine hash of the block before the first one (None at a sequence start).
    Stored {
        block_hashes: Vec<EngineBlockHash>,
        parent: Option<EngineBlockHash>,
        token_ids: Vec<u32>,
        block_size: u32,
        lora_name: Option<String>,
        tier: Tier,
    },
    Removed {
        block_hashes: Vec<EngineBlockHash>,
        tier: Tier,
    },
    /// Every block of the publishing rank is gone.
    AllCleared,
}

#[derive(Debug, Clone, PartialEq)]
pub struct EventBatch {
    pub ts: f64,
    pub events: Vec<KvEvent>,
    pub data_parallel_rank: Option<u32>,
    /// Events of types this decoder does not know (ignored, counted).
    pub skipped_events: usize,
}

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
#[error("undecodable KV event batch: {0}")]
pub struct DecodeError(pub String);

/// Deepest nesting a batch may have. A real one nests four levels (batch, events, event, hashes);
/// unknown fields are skipped recursively, so without a bound a crafted payload of nested arrays
/// would recurse until the decoding thread's stack overflows (found by the `kv_events` fuzz target).
const MAX_DEPTH: usize = 16;

/// Decodes one payload frame. All or nothing: any malformed event rejects the batch.
pub fn decode_batch(payload: &[u8]) -> Result<EventBatch, DecodeError> {
    let mut rest = payload;
    let mut de = rmp_serde::Deserializer::new(&mut rest);
    de.set_max_depth(MAX_DEPTH);
    let batch = BatchWire::deserialize(&mut de).map_err(|e| DecodeError(e.to_string()))?;
    drop(de);
    if !rest.is_empty() {
        return Err(DecodeError(format!("{} bytes after the batch", rest.len())));
    }
    Ok(batch.0)
}

// ---------------------------------------------------------------- batch

struct BatchWire(EventBatch);

impl<'de> Deserialize<'de> for BatchWire {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        d.deserialize_any(BatchVisitor)
    }
}

struct BatchVisitor;

impl<'de> Visitor<'de> for BatchVisitor {
    type Value = BatchWire;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a batch [ts, events, data_parallel_rank?] or {ts, events, data_parallel_rank}")
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<BatchWire, A::Error> {
        let ts: f64 = seq
            .next_element()?
            .ok_or_else(|| de::Error::invalid_length(0, &self))?;
        let events: EventsWire = seq
            .next_element()?
            .ok_or_else(|| de::Error::invalid_length(1, &self))?;
        let rank: Option<u32> = seq.next_element::<Option<u32>>()?.flatten();
        while seq.next_element::<IgnoredAny>()?.is_some() {}
        Ok(BatchWire(EventBatch {
            ts,
            events: events.events,
            data_parallel_rank: rank,
            skipped_events: events.skipped,
        }))
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<BatchWire, A::Error> {
        let (mut ts, mut events, mut rank) = (None, None, None);
        while let Some(key) = map.next_key::<KeyWire>()? {
            match key.0.as_str() {
                "ts" => ts = Some(map.next_value::<f64>()?),
                "events" => events = Some(map.next_value::<EventsWire>()?),
                "data_parallel_rank" => rank = map.next_value::<Option<u32>>()?,
                _ => {
                    map.next_value::<IgnoredAny>()?;
                }
            }
        }
        let ts = ts.ok_or_else(|| de::Error::missing_field("ts"))?;
        let events = events.ok_or_else(|| de::Error::missing_field("events"))?;
        Ok(BatchWire(EventBatch {
            ts,
            events: events.events,
            data_parallel_rank: rank,
            skipped_events: events.skipped,
        }))
    }
}

/// An object key or event tag, as an owned string (keys are short; events are not per-token).
struct KeyWire(String);

impl<'de> Deserialize<'de> for KeyWire {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        String::deserialize(d).map(KeyWire)
    }
}

struct EventsWire {
    events: Vec<KvEvent>,
    skipped: usize,
}

impl<'de> Deserialize<'de> for EventsWire {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = EventsWire;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a list of events")
            }
            fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<EventsWire, A::Error> {
                // The declared length comes from the wire: never trust it for an allocation.
                let capacity = seq.size_hint().unwrap_or(0).min(1024);
                let mut out = EventsWire {
                    events: Vec::with_capacity(capacity),
                    skipped: 0,
                };
                while let Some(EventWire(ev)) = seq.next_element()? {
                    match ev {
                        Some(ev) => out.events.push(ev),
                        None => out.skipped += 1,
                    }
                }
                Ok(out)
            }
        }
        d.deserialize_seq(V)
    }
}

// ---------------------------------------------------------------- events

/// One event; `None` for an unknown event type.
struct EventWire(Option<KvEvent>);

impl<'de> Deserialize<'de> for EventWire {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        d.deserialize_any(EventVisitor)
    }
}

/// Fields of an event, whichever encoding they came in.
#[derive(Default)]
struct Fields {
    block_hashes: Option<Vec<EngineBlockHash>>,
    parent: Option<EngineBlockHash>,
    token_ids: Option<Vec<u32>>,
    block_size: Option<u32>,
    medium: Option<String>,
    lora_name: Option<String>,
}

impl Fields {
    fn build<E: de::Error>(self, tag: &str) -> Result<Option<KvEvent>, E> {
        let tier = tier_from_medium(self.medium.as_deref());
        match tag {
            "BlockStored" => {
                let block_hashes = self
                    .block_hashes
                    .ok_or_else(|| E::missing_field("block_hashes"))?;
                let token_ids = self
                    .token_ids
                    .ok_or_else(|| E::missing_field("token_ids"))?;
                let block_size = self
                    .block_size
                    .ok_or_else(|| E::missing_field("block_size"))?;
                if block_size == 0 {
                    return Err(E::custom("BlockStored with block_size 0"));
                }
                if token_ids.len() as u64 != block_hashes.len() as u64 * u64::from(block_size) {
                    return Err(E::custom(format!(
                        "BlockStored has {} token ids for {} blocks of {block_size}",
                        token_ids.len(),
                        block_hashes.len()
                    )));
                }
                let lora_name = self.lora_name.filter(|n| !n.is_empty());
                Ok(Some(KvEvent::Stored {
                    block_hashes,
                    parent: self.parent,
                    token_ids,
                    block_size,
                    lora_name,
                    tier,
                }))
            }
            "BlockRemoved" => {
                let block_hashes = self
                    .block_hashes
                    .ok_or_else(|| E::missing_field("block_hashes"))?;
                Ok(Some(KvEvent::Removed { block_hashes, tier }))
            }
            "AllBlocksCleared" => Ok(Some(KvEvent::AllCleared)),
            _ => Ok(None),
        }
    }
}

struct EventVisitor;

impl<'de> Visitor<'de> for EventVisitor {
    type Value = EventWire;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("an event: [\"Tag\", fields…] or {\"type\": \"Tag\", …}")
    }

    /// Legacy tagged array; field order is vLLM's, trailing defaults may be missing.
    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<EventWire, A::Error> {
        let tag: KeyWire = seq
            .next_element()?
            .ok_or_else(|| de::Error::invalid_length(0, &self))?;
        let mut f = Fields::default();
        let missing = |i| de::Error::invalid_length(i, &"the event's required fields");
        match tag.0.as_str() {
            "BlockStored" => {
                f.block_hashes = Some(
                    seq.next_element::<HashesWire>()?
                        .ok_or_else(|| missing(1))?
                        .0,
                );
                f.parent = seq
                    .next_element::<Option<HashWire>>()?
                    .ok_or_else(|| missing(2))?
                    .map(|h| h.0);
                f.token_ids = Some(seq.next_element()?.ok_or_else(|| missing(3))?);
                f.block_size = Some(seq.next_element()?.ok_or_else(|| missing(4))?);
                let _lora_id = seq.next_element::<IgnoredAny>()?;
                f.medium = seq.next_element::<Option<String>>()?.flatten();
                f.lora_name = seq.next_element::<Option<String>>()?.flatten();
            }
            "BlockRemoved" => {
                f.block_hashes = Some(
                    seq.next_element::<HashesWire>()?
                        .ok_or_else(|| missing(1))?
                        .0,
                );
                f.medium = seq.next_element::<Option<String>>()?.flatten();
            }
            _ => {}
        }
        while seq.next_element::<IgnoredAny>()?.is_some() {}
        f.build(&tag.0).map(EventWire)
    }

    /// Newer map form, tagged by `type`, any key order, defaults omitted.
    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<EventWire, A::Error> {
        let mut f = Fields::default();
        let mut tag = None;
        while let Some(key) = map.next_key::<KeyWire>()? {
            match key.0.as_str() {
                "type" => tag = Some(map.next_value::<String>()?),
                "block_hashes" => f.block_hashes = Some(map.next_value::<HashesWire>()?.0),
                "parent_block_hash" => {
                    f.parent = map.next_value::<Option<HashWire>>()?.map(|h| h.0)
                }
                "token_ids" => f.token_ids = Some(map.next_value()?),
                "block_size" => f.block_size = Some(map.next_value()?),
                "medium" => f.medium = map.next_value()?,
                "lora_name" => f.lora_name = map.next_value()?,
                _ => {
                    map.next_value::<IgnoredAny>()?;
                }
            }
        }
        let tag = tag.ok_or_else(|| de::Error::missing_field("type"))?;
        f.build(&tag).map(EventWire)
    }
}

// ---------------------------------------------------------------- hashes

struct HashesWire(Vec<EngineBlockHash>);

impl<'de> Deserialize<'de> for HashesWire {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        Vec::<HashWire>::deserialize(d).map(|v| HashesWire(v.into_iter().map(|h| h.0).collect()))
    }
}

/// u64, a negative i64 (same bits), or a binary whose last 8 bytes (big-endian) are the hash.
struct HashWire(EngineBlockHash);

impl<'de> Deserialize<'de> for HashWire {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = HashWire;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a block hash (integer, or binary of at least 8 bytes)")
            }
            fn visit_u64<E: de::Error>(self, v: u64) -> Result<HashWire, E> {
                Ok(HashWire(EngineBlockHash(v)))
            }
            fn visit_i64<E: de::Error>(self, v: i64) -> Result<HashWire, E> {
                Ok(HashWire(EngineBlockHash(v as u64)))
            }
            fn visit_bytes<E: de::Error>(self, v: &[u8]) -> Result<HashWire, E> {
                let tail: [u8; 8] = v
                    .get(v.len().saturating_sub(8)..)
                    .and_then(|t| t.try_into().ok())
                    .ok_or_else(|| E::invalid_length(v.len(), &self))?;
                Ok(HashWire(EngineBlockHash(u64::from_be_bytes(tail))))
            }
        }
        d.deserialize_any(V)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Regression (fuzzing): an unknown trailing element nested 100 000 arrays deep is rejected
    /// with an error, on a small stack, instead of overflowing it.
    #[test]
    fn deep_nesting_is_an_error_not_a_stack_overflow() {
        // [1.5, [], nil, [[[…]]]]: the fourth element is skipped, recursively.
        let mut payload = vec![0x94, 0xcb, 0x3f, 0xf8, 0, 0, 0, 0, 0, 0, 0x90, 0xc0];
        payload.extend(std::iter::repeat_n(0x91, 100_000));
        payload.push(0xc0);
        let decoded = std::thread::Builder::new()
            .stack_size(256 * 1024)
            .spawn(move || decode_batch(&payload))
            .unwrap()
            .join()
            .unwrap();
        let err = decoded.unwrap_err().0;
        assert!(err.contains("depth"), "rejected for its depth: {err}");
    }

    #[test]
    fn media_map_to_tiers() {
        assert_eq!(tier_from_medium(None), Tier::Device);
        for (m, t) in [
            ("GPU", Tier::Device),
            ("gpu", Tier::Device),
            ("CPU", Tier::Host),
            ("cpu_tier1", Tier::Host),
            ("CPU_TIER2", Tier::Disk),
            ("NVME", Tier::Disk),
            ("EXTERNAL", Tier::Disk),
            ("whatever", Tier::Disk),
        ] {
            assert_eq!(tier_from_medium(Some(m)), t, "{m}");
        }
    }

    #[test]
    fn trailing_bytes_reject_the_batch() {
        // [1.5, [["AllBlocksCleared"]]]
        let ok = b"\x92\xcb\x3f\xf8\0\0\0\0\0\0\x91\x91\xb0AllBlocksCleared";
        assert_eq!(decode_batch(ok).unwrap().events, vec![KvEvent::AllCleared]);
        let mut extra = ok.to_vec();
        extra.push(0xc0);
        assert_eq!(
            decode_batch(&extra).unwrap_err(),
            DecodeError("1 bytes after the batch".into())
        );
    }

    #[test]
    fn empty_and_nested_garbage_is_an_error_not_a_panic() {
        for bad in [
            &b""[..],
            b"\x90",
            b"\x91\xcb",
            b"\x92\xcb\x3f\xf8\0\0\0\0\0\0\x91\x91\x91\x91",
            b"\xdd\xff\xff\xff\xff",
        ] {
            assert!(decode_batch(bad).is_err(), "{bad:?}");
        }
    }
}
