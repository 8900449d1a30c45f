//! vLLM's `vllm:lora_requests_info` gauge: which LoRA adapters an engine runs and queues, and how
//! many GPU adapter slots it has.
//!
//! vLLM exposes it as
//! `vllm:lora_requests_info{max_lora="4",running_lora_adapters="a,b",waiting_lora_adapters=""} <t>`:
//! comma-separated adapter names (possibly empty) and the slot count as labels, the sample's value
//! a timestamp. When several samples are on the page the one with the greatest value is current.
//! Invariants: no sample at all is "unknown" (None), never an error; a sample whose labels cannot
//! be read is an error the scraper logs and counts, and it does not replace what was known.

use kvepp_core::affinity::AdapterSlots;

pub(crate) const METRIC: &str = "vllm:lora_requests_info";

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum LoraInfoError {
    #[error("{METRIC} has an unreadable label set: {0}")]
    Labels(String),
    #[error("{METRIC} lacks the label {0}")]
    Missing(&'static str),
    #[error("{METRIC} max_lora={0:?} is not a whole number")]
    MaxLora(String),
}

fn names(list: &str) -> Vec<std::sync::Arc<str>> {
    list.split(',')
        .map(str::trim)
        .filter(|n| !n.is_empty())
        .map(Into::into)
        .collect()
}

/// One sample's adapters.
fn slots(set: &str) -> Result<AdapterSlots, LoraInfoError> {
    let pairs =
        super::exposition::labels(set).ok_or_else(|| LoraInfoError::Labels(set.to_owned()))?;
    let get = |k: &'static str| {
        pairs
            .iter()
            .find(|(n, _)| *n == k)
            .map(|(_, v)| v.as_str())
            .ok_or(LoraInfoError::Missing(k))
    };
    let max = get("max_lora")?;
    Ok(AdapterSlots {
        running: names(get("running_lora_adapters")?),
        waiting: names(get("waiting_lora_adapters")?),
        max_lora: max
            .trim()
            .parse()
            .map_err(|_| LoraInfoError::MaxLora(max.to_owned()))?,
        from_metadata: false,
    })
}

/// The current adapters on a `/metrics` page: Ok(None) when the page has no sample of the gauge.
pub fn parse(page: &str) -> Result<Option<AdapterSlots>, LoraInfoError> {
    let mut best: Option<(f64, &str)> = None;
    for line in page.lines() {
        let Some((set, rest)) = super::exposition::series(line.trim_start(), METRIC) else {
            continue;
        };
        let value = rest
            .split_whitespace()
            .next()
            .and_then(|v| v.parse::<f64>().ok())
            .filter(|v| !v.is_nan())
            .unwrap_or(f64::NEG_INFINITY);
        if best.is_none_or(|(b, _)| value > b) {
            best = Some((value, set));
        }
    }
    best.map(|(_, set)| slots(set)).transpose()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// vLLM's exposition, as its Prometheus client writes it.
    const PAGE: &str = r#"# HELP vllm:lora_requests_info Running stats on lora requests.
# TYPE vllm:lora_requests_info gauge
vllm:lora_requests_info{max_lora="4",running_lora_adapters="sql-lora,chat-lora",waiting_lora_adapters="math"} 1.7644e+09
vllm:num_requests_running{engine="0",model_name="base"} 2.0
"#;

    fn set(names: &[&str]) -> Vec<std::sync::Arc<str>> {
        names.iter().map(|&n| n.into()).collect()
    }

    #[test]
    fn reads_running_waiting_and_slots() {
        let s = parse(PAGE).unwrap().unwrap();
        assert_eq!(s.running, set(&["sql-lora", "chat-lora"]));
        assert_eq!(s.waiting, set(&["math"]));
        assert_eq!(s.max_lora, 4);
    }

    #[test]
    fn empty_lists_are_no_adapters_and_a_missing_metric_is_unknown() {
        let page = "vllm:lora_requests_info{max_lora=\"2\",running_lora_adapters=\"\",waiting_lora_adapters=\"\"} 1.0\n";
        let s = parse(page).unwrap().unwrap();
        assert!(s.running.is_empty() && s.waiting.is_empty());
        assert_eq!(s.max_lora, 2);
        assert_eq!(parse("vllm:num_requests_running 1\n"), Ok(None));
        assert_eq!(parse(""), Ok(None));
    }

    #[test]
    fn the_sample_with_the_greatest_value_is_current() {
        let page = "\
vllm:lora_requests_info{max_lora=\"4\",running_lora_adapters=\"old\",waiting_lora_adapters=\"\"} 1764400000.5
vllm:lora_requests_info{max_lora=\"4\",running_lora_adapters=\"new,\\\"quoted\\\"\",waiting_lora_adapters=\"w\"} 1764400009.25
vllm:lora_requests_info{max_lora=\"4\",running_lora_adapters=\"older\",waiting_lora_adapters=\"\"} 1764300000
";
        let s = parse(page).unwrap().unwrap();
        assert_eq!(s.running, set(&["new", "\"quoted\""]));
        assert_eq!(s.waiting, set(&["w"]));
    }

    #[test]
    fn garbage_is_an_error_not_a_panic() {
        for bad in [
            "vllm:lora_requests_info{max_lora=\"x\",running_lora_adapters=\"\",waiting_lora_adapters=\"\"} 1",
            "vllm:lora_requests_info{running_lora_adapters=\"a\",waiting_lora_adapters=\"\"} 1",
            "vllm:lora_requests_info{max_lora=4,running_lora_adapters=\"a\"} 1",
            "vllm:lora_requests_info{max_lora=\"4\" running_lora_adapters=\"a\"} 1",
        ] {
            assert!(parse(bad).is_err(), "{bad}");
        }
        // Unterminated label sets and values are not samples of the gauge at all.
        assert_eq!(parse("vllm:lora_requests_info{max_lora=\"4"), Ok(None));
        // (The label-set reader itself: `super::exposition`'s tests.)
    }
}
