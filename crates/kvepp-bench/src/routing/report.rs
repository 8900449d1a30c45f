//! Per-policy statistics of a replay, the Markdown table and the PNG chart.

use std::path::Path;
use std::time::Duration;

use serde::Serialize;

use kvepp_sim::client::Outcome;

/// One replayed request: when it was sent (from the replay start) and what happened.
#[derive(Debug, Clone)]
pub struct Record {
    pub sent: Duration,
    pub outcome: Outcome,
    /// Sent by the second client straight to an engine (load on the fleet, not a result).
    pub direct: bool,
}

/// What one policy achieved on one workload.
#[derive(Debug, Clone, Serialize)]
pub struct PolicyResult {
    pub policy: String,
    pub requests: usize,
    pub failed: usize,
    pub ttft_ms: [f64; 3],
    pub e2e_ms: [f64; 3],
    /// Inter-token latency p50 / p90 / p99 over requests (each its mean step after the first
    /// token: `(e2e − TTFT) / (tokens − 1)`; requests of one token have none).
    pub itl_ms: [f64; 3],
    pub output_tokens_per_s: f64,
    pub hit_ratio: f64,
    pub imbalance: f64,
    /// The TTFT SLO and the share of requests (failed ones included) whose TTFT met it.
    pub slo_ttft_ms: f64,
    pub slo_met: f64,
    /// Requests per second that met the SLO, over the span of the run.
    pub goodput_rps: f64,
    /// One failure message, if any failed.
    pub first_error: Option<String>,
}

/// Nearest-rank percentile of sorted values (0 when empty).
pub fn percentile(sorted: &[f64], p: f64) -> f64 {
    if sorted.is_empty() {
        return 0.0;
    }
    let rank = ((p / 100.0) * sorted.len() as f64).ceil() as usize;
    sorted[rank.clamp(1, sorted.len()) - 1]
}

fn p50_90_99(mut v: Vec<f64>) -> [f64; 3] {
    v.sort_by(f64::total_cmp);
    [
        percentile(&v, 50.0),
        percentile(&v, 90.0),
        percentile(&v, 99.0),
    ]
}

/// Time-averaged ratio of the busiest engine's active requests (sent, not yet finished) to the
/// fewest the busiest engine could have had at that instant (the mean rounded up: requests are
/// whole), sampled every 50 ms over the replay, counting only instants with at least one request
/// active. 1.0 is a perfect spread at any load; at high load it is max/mean. (Plain max/mean
/// cannot reach 1 while fewer requests than engines are active: 2 requests on 2 of 4 engines read
/// 2.0.)
pub fn imbalance(records: &[Record], engines: &[String]) -> f64 {
    let spans: Vec<(f64, f64, usize)> = records
        .iter()
        .filter_map(|r| {
            let e = engines
                .iter()
                .position(|n| Some(n) == r.outcome.engine.as_ref())?;
            let s = r.sent.as_secs_f64();
            Some((s, s + r.outcome.e2e?.as_secs_f64(), e))
        })
        .collect();
    let end = spans.iter().map(|s| s.1).fold(0.0, f64::max);
    let (mut sum, mut n) = (0.0, 0usize);
    let mut active = vec![0u32; engines.len()];
    let mut t = 0.0;
    while t <= end && !engines.is_empty() {
        active.iter_mut().for_each(|a| *a = 0);
        for &(s, e, i) in &spans {
            if s <= t && t < e {
                active[i] += 1;
            }
        }
        let total: u32 = active.iter().sum();
        if total > 0 {
            let best = total.div_ceil(engines.len() as u32);
            let max = active.iter().copied().max().unwrap_or(0);
            sum += f64::from(max) / f64::from(best);
            n += 1;
        }
        t += 0.05;
    }
    if n == 0 {
        1.0
    } else {
        sum / n as f64
    }
}

/// One policy's figures over the requests kvepp routed (a second client's direct requests count
/// only in the imbalance, which is the engines' load).
pub fn summarize(
    policy: &str,
    records: &[Record],
    engines: &[String],
    slo_ttft_ms: f64,
) -> PolicyResult {
    let routed: Vec<&Record> = records.iter().filter(|r| !r.direct).collect();
    let ok: Vec<&Record> = routed
        .iter()
        .copied()
        .filter(|r| r.outcome.error.is_none())
        .collect();
    let ms = |d: Option<Duration>| d.map(|d| d.as_secs_f64() * 1000.0);
    let ttft = p50_90_99(ok.iter().filter_map(|r| ms(r.outcome.ttft)).collect());
    let e2e = p50_90_99(ok.iter().filter_map(|r| ms(r.outcome.e2e)).collect());
    let itl = p50_90_99(
        ok.iter()
            .filter(|r| r.outcome.completion_tokens >= 2)
            .filter_map(|r| {
                let decode = ms(r.outcome.e2e)? - ms(r.outcome.ttft)?;
                Some(decode / (r.outcome.completion_tokens - 1) as f64)
            })
            .collect(),
    );
    let first = ok.iter().map(|r| r.sent).min().unwrap_or_default();
    let last = ok
        .iter()
        .filter_map(|r| Some(r.sent + r.outcome.e2e?))
        .max()
        .unwrap_or_default();
    let span = last.saturating_sub(first).as_secs_f64();
    let out_tokens: u64 = ok.iter().map(|r| r.outcome.completion_tokens).sum();
    let prompt: u64 = ok.iter().map(|r| r.outcome.prompt_tokens).sum();
    let cached: u64 = ok.iter().map(|r| r.outcome.cached_tokens).sum();
    let met = ok
        .iter()
        .filter(|r| ms(r.outcome.ttft).is_some_and(|t| t <= slo_ttft_ms))
        .count();
    PolicyResult {
        policy: policy.to_owned(),
        requests: routed.len(),
        failed: routed.len() - ok.len(),
        ttft_ms: ttft,
        e2e_ms: e2e,
        itl_ms: itl,
        output_tokens_per_s: if span > 0.0 {
            out_tokens as f64 / span
        } else {
            0.0
        },
        hit_ratio: if prompt > 0 {
            cached as f64 / prompt as f64
        } else {
            0.0
        },
        imbalance: imbalance(records, engines),
        slo_ttft_ms,
        slo_met: if routed.is_empty() {
            0.0
        } else {
            met as f64 / routed.len() as f64
        },
        goodput_rps: if span > 0.0 { met as f64 / span } else { 0.0 },
        first_error: routed.iter().find_map(|r| r.outcome.error.clone()),
    }
}

/// One policy's progress line: p90 TTFT, hits, imbalance, SLO, failures.
pub fn line(r: &PolicyResult) -> String {
    format!(
        "{:<26} p90 TTFT {:>8.0} ms  hit {:>5.1}%  imbalance {:.2}  SLO met {:>3.0}%  failed {}{}",
        r.policy,
        r.ttft_ms[1],
        r.hit_ratio * 100.0,
        r.imbalance,
        r.slo_met * 100.0,
        r.failed,
        r.first_error
            .as_deref()
            .map(|e| format!(" (first: {e})"))
            .unwrap_or_default()
    )
}

/// The first line of `requests.csv`: one row per replayed request of every policy on every
/// workload, times in ms (empty where the request failed before that point).
pub const CSV_HEADER: &str =
    "workload,policy,sent_ms,direct,engine,status,ttft_ms,e2e_ms,prompt_tokens,cached_tokens,completion_tokens\n";

/// Appends one [`CSV_HEADER`] row per record.
pub fn csv_rows(out: &mut String, workload: &str, policy: &str, records: &[Record]) {
    use std::fmt::Write;
    let ms = |d: Option<Duration>| d.map(|d| format!("{:.1}", d.as_secs_f64() * 1000.0));
    for r in records {
        let o = &r.outcome;
        // Engine names are the simulator's (`sim-engine-N`): no commas or quotes to escape.
        let _ = writeln!(
            out,
            "{workload},{policy},{:.1},{},{},{},{},{},{},{},{}",
            r.sent.as_secs_f64() * 1000.0,
            r.direct,
            o.engine.as_deref().unwrap_or(""),
            o.status,
            ms(o.ttft).unwrap_or_default(),
            ms(o.e2e).unwrap_or_default(),
            o.prompt_tokens,
            o.cached_tokens,
            o.completion_tokens,
        );
    }
}

/// What the workload allows of prefix-cache hits: with an infinite cache, and with the fleet's
/// KV capacity as one LRU cache ([`kvepp_sim::workload::hit_ceiling_with_capacity`]).
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize)]
pub struct Ceilings {
    pub infinite: f64,
    pub capacity: f64,
    /// The fleet's KV blocks (engines × blocks per engine).
    pub capacity_blocks: u64,
}

fn share(part: f64, of: f64) -> String {
    if of > 0.0 {
        format!("{:.0}%", 100.0 * part / of)
    } else {
        "-".into()
    }
}

/// The reference placements every policy's figures are read against, when they ran: the
/// TTFT-greedy clairvoyant and the completion-time clairvoyant.
pub const REFERENCES: [&str; 2] = ["clairvoyant", "clairvoyant-completion"];

/// What `r` reaches of the best reference result among `refs` on each figure, in percent: hit
/// ratio (its own over the highest reference's), then TTFT p50, p90, e2e p50, p90 and ITL p90
/// (the lowest reference's over its own). 100%: as good as the best reference; above: better.
pub fn of_best_reference(r: &PolicyResult, refs: &[&PolicyResult]) -> [Option<f64>; 6] {
    let ratio = |a: f64, b: f64| (a > 0.0 && b > 0.0).then(|| 100.0 * a / b);
    let best = |f: fn(&PolicyResult) -> f64, higher: bool| {
        let values = refs.iter().map(|c| f(c)).filter(|v| *v > 0.0);
        if higher {
            values.fold(None, |m: Option<f64>, v| Some(m.map_or(v, |m| m.max(v))))
        } else {
            values.fold(None, |m: Option<f64>, v| Some(m.map_or(v, |m| m.min(v))))
        }
    };
    let lower = |f: fn(&PolicyResult) -> f64| best(f, false).and_then(|b| ratio(b, f(r)));
    [
        best(|c| c.hit_ratio, true).and_then(|b| ratio(r.hit_ratio, b)),
        lower(|c| c.ttft_ms[0]),
        lower(|c| c.ttft_ms[1]),
        lower(|c| c.e2e_ms[0]),
        lower(|c| c.e2e_ms[1]),
        lower(|c| c.itl_ms[1]),
    ]
}

/// The Markdown table of one workload's results, with ratios against the first policy and, when
/// they ran, against the best of the reference placements ([`REFERENCES`]).
pub fn markdown(title: &str, ceilings: Ceilings, results: &[PolicyResult]) -> String {
    let mut s = format!(
        "### {title}\n\nPrefix-cache hit ceiling of the workload: {:.1}% with an infinite cache, \
         {:.1}% with the fleet's {} KV blocks as one LRU cache (the capacity ceiling)\n\n\
         | policy | requests (failed) | TTFT p50 / p90 / p99 ms | e2e p50 / p90 / p99 ms | ITL p50 / p90 ms | output tok/s | hit ratio (of ceiling / of capacity ceiling) | imbalance | TTFT ≤ {:.0} ms | goodput req/s | p90 TTFT vs {} | of best reference: hit / TTFT p50 / p90 / e2e p50 / p90 / ITL p90 |\n\
         |---|---|---|---|---|---|---|---|---|---|---|---|\n",
        ceilings.infinite * 100.0,
        ceilings.capacity * 100.0,
        ceilings.capacity_blocks,
        results.first().map_or(0.0, |r| r.slo_ttft_ms),
        results.first().map_or("-", |r| r.policy.as_str()),
    );
    let base = results.first().map_or(0.0, |r| r.ttft_ms[1]);
    let refs: Vec<&PolicyResult> = results
        .iter()
        .filter(|r| REFERENCES.contains(&r.policy.as_str()))
        .collect();
    for r in results {
        let pct = |v: &Option<f64>| v.map_or("-".into(), |v| format!("{v:.0}%"));
        let of_ref = if refs.is_empty() {
            "-".into()
        } else {
            let cells: Vec<String> = of_best_reference(r, &refs).iter().map(pct).collect();
            cells.join(" / ")
        };
        let vs = if r.ttft_ms[1] > 0.0 {
            format!("{:.1}× lower", base / r.ttft_ms[1])
        } else {
            "-".into()
        };
        let of = format!(
            " ({} / {})",
            share(r.hit_ratio, ceilings.infinite),
            share(r.hit_ratio, ceilings.capacity)
        );
        s += &format!(
            "| {} | {} ({}) | {:.0} / {:.0} / {:.0} | {:.0} / {:.0} / {:.0} | {:.1} / {:.1} | {:.0} | {:.1}%{} | {:.2} | {:.0}% | {:.2} | {} | {} |\n",
            r.policy,
            r.requests,
            r.failed,
            r.ttft_ms[0],
            r.ttft_ms[1],
            r.ttft_ms[2],
            r.e2e_ms[0],
            r.e2e_ms[1],
            r.e2e_ms[2],
            r.itl_ms[0],
            r.itl_ms[1],
            r.output_tokens_per_s,
            r.hit_ratio * 100.0,
            of,
            r.imbalance,
            r.slo_met * 100.0,
            r.goodput_rps,
            vs,
            of_ref
        );
    }
    s
}

/// A PNG with, per workload, p90 TTFT (log scale) and hit ratio per policy.
pub fn chart(path: &Path, workloads: &[(String, Vec<PolicyResult>)]) -> Result<(), String> {
    use plotters::prelude::*;
    let rows = workloads.len().max(1) as u32;
    let root = BitMapBackend::new(path, (1200, 420 * rows)).into_drawing_area();
    root.fill(&WHITE).map_err(|e| e.to_string())?;
    let colors = [
        RGBColor(160, 160, 160),
        RGBColor(90, 140, 200),
        RGBColor(240, 160, 60),
        RGBColor(60, 170, 90),
    ];
    for ((title, results), row) in workloads.iter().zip(root.split_evenly((rows as usize, 1))) {
        let halves = row.split_evenly((1, 2));
        let n = results.len();
        let max_ttft = results.iter().map(|r| r.ttft_ms[1]).fold(1.0, f64::max) * 2.0;
        let min_ttft = results
            .iter()
            .map(|r| r.ttft_ms[1])
            .filter(|v| *v > 0.0)
            .fold(max_ttft, f64::min)
            / 2.0;
        let mut left = ChartBuilder::on(&halves[0])
            .caption(format!("{title}: p90 TTFT (ms, log)"), ("sans-serif", 20))
            .margin(12)
            .x_label_area_size(40)
            .y_label_area_size(60)
            .build_cartesian_2d(
                (0..n).into_segmented(),
                (min_ttft.max(0.1)..max_ttft).log_scale(),
            )
            .map_err(|e| e.to_string())?;
        let label = |i: &SegmentValue<usize>| match i {
            SegmentValue::CenterOf(i) | SegmentValue::Exact(i) => results
                .get(*i)
                .map(|r| r.policy.clone())
                .unwrap_or_default(),
            SegmentValue::Last => String::new(),
        };
        left.configure_mesh()
            .disable_x_mesh()
            .x_label_formatter(&label)
            .draw()
            .map_err(|e| e.to_string())?;
        left.draw_series(results.iter().enumerate().map(|(i, r)| {
            let c = colors[i % colors.len()];
            Rectangle::new(
                [
                    (SegmentValue::Exact(i), min_ttft.max(0.1)),
                    (
                        SegmentValue::Exact(i + 1),
                        r.ttft_ms[1].max(min_ttft.max(0.1)),
                    ),
                ],
                c.filled(),
            )
        }))
        .map_err(|e| e.to_string())?;
        let mut right = ChartBuilder::on(&halves[1])
            .caption(
                format!("{title}: prefix-cache hit ratio (%)"),
                ("sans-serif", 20),
            )
            .margin(12)
            .x_label_area_size(40)
            .y_label_area_size(60)
            .build_cartesian_2d((0..n).into_segmented(), 0.0..100.0)
            .map_err(|e| e.to_string())?;
        right
            .configure_mesh()
            .disable_x_mesh()
            .x_label_formatter(&label)
            .draw()
            .map_err(|e| e.to_string())?;
        right
            .draw_series(results.iter().enumerate().map(|(i, r)| {
                let c = colors[i % colors.len()];
                Rectangle::new(
                    [
                        (SegmentValue::Exact(i), 0.0),
                        (SegmentValue::Exact(i + 1), r.hit_ratio * 100.0),
                    ],
                    c.filled(),
                )
            }))
            .map_err(|e| e.to_string())?;
    }
    root.present().map_err(|e| e.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rec(sent_ms: u64, e2e_ms: u64, engine: &str) -> Record {
        Record {
            sent: Duration::from_millis(sent_ms),
            outcome: Outcome {
                status: 200,
                engine: Some(engine.into()),
                ttft: Some(Duration::from_millis(e2e_ms / 2)),
                e2e: Some(Duration::from_millis(e2e_ms)),
                prompt_tokens: 100,
                cached_tokens: 50,
                completion_tokens: 10,
                ..Outcome::default()
            },
            direct: false,
        }
    }

    #[test]
    fn percentiles_hit_ratio_and_imbalance() {
        let v: Vec<f64> = (1..=100).map(f64::from).collect();
        assert_eq!(
            (
                percentile(&v, 50.0),
                percentile(&v, 90.0),
                percentile(&v, 99.0)
            ),
            (50.0, 90.0, 99.0)
        );
        let engines = vec!["a".to_string(), "b".to_string()];
        // Balanced: one request on each engine at all times.
        let even = [rec(0, 1000, "a"), rec(0, 1000, "b")];
        assert!((imbalance(&even, &engines) - 1.0).abs() < 1e-9);
        // Everything on one engine: 2 where 1 was possible.
        let skewed = [rec(0, 1000, "a"), rec(0, 1000, "a")];
        assert!((imbalance(&skewed, &engines) - 2.0).abs() < 1e-9);
        // Fewer requests than engines, spread: perfect (plain max/mean would read 2).
        let four: Vec<String> = ["a", "b", "c", "d"].map(String::from).to_vec();
        let spread = [rec(0, 1000, "a"), rec(0, 1000, "c")];
        assert!((imbalance(&spread, &four) - 1.0).abs() < 1e-9);
        // Three requests on 4 engines, two of them together: 2 where 1 was possible.
        let paired = [rec(0, 1000, "a"), rec(0, 1000, "a"), rec(0, 1000, "b")];
        assert!((imbalance(&paired, &four) - 2.0).abs() < 1e-9);
        let mut failed = rec(0, 10, "a");
        failed.outcome.error = Some("HTTP 503".into());
        let mut direct = rec(0, 1000, "b");
        direct.direct = true;
        let r = summarize(
            "x",
            &[rec(0, 1000, "a"), rec(0, 3000, "b"), failed, direct],
            &engines,
            1000.0,
        );
        assert_eq!((r.requests, r.failed), (3, 1));
        // TTFTs 500 and 1500 ms: one of three met a 1 s SLO, over a 3 s span.
        assert!((r.slo_met - 1.0 / 3.0).abs() < 1e-9);
        assert!((r.goodput_rps - 1.0 / 3.0).abs() < 1e-9);
        assert_eq!(r.e2e_ms[2], 3000.0);
        assert!((r.hit_ratio - 0.5).abs() < 1e-9);
        assert!((r.output_tokens_per_s - 20.0 / 3.0).abs() < 1e-6);
        let ceilings = Ceilings {
            infinite: 0.5,
            capacity: 0.625,
            capacity_blocks: 64,
        };
        let table = markdown("w", ceilings, &[r.clone(), r]);
        assert!(table.contains("| x | 3 (1) |"), "{table}");
        assert!(
            table.contains("TTFT ≤ 1000 ms") && table.contains("| 33% | 0.33 |"),
            "{table}"
        );
        assert!(table.contains("50.0% (100% / 80%)"), "{table}");
        assert!(
            table.contains("62.5% with the fleet's 64 KV blocks"),
            "{table}"
        );
    }

    #[test]
    fn every_policy_reads_against_the_best_reference_on_each_figure() {
        let engines = vec!["a".to_string()];
        let mut worse = summarize("kv", &[rec(0, 2000, "a")], &engines, 1000.0);
        // The TTFT reference wins the first token, the completion reference the completion.
        let mut first = summarize(REFERENCES[0], &[rec(0, 1600, "a")], &engines, 1000.0);
        first.ttft_ms = [500.0; 3];
        let completion = summarize(REFERENCES[1], &[rec(0, 1000, "a")], &engines, 1000.0);
        first.hit_ratio = 0.8;
        worse.hit_ratio = 0.6;
        assert_eq!(worse.itl_ms[1], 1000.0 / 9.0, "(e2e − TTFT) / (tokens − 1)");
        let [hit, p50, p90, e50, e90, itl] = of_best_reference(&worse, &[&first, &completion]);
        assert_eq!((hit, p50, p90), (Some(75.0), Some(50.0), Some(50.0)));
        assert_eq!((e50, e90), (Some(50.0), Some(50.0)));
        assert!(itl.is_some_and(|v| (v - 50.0).abs() < 1e-9), "{itl:?}");
        let ceilings = Ceilings {
            infinite: 1.0,
            capacity: 1.0,
            capacity_blocks: 1,
        };
        let table = markdown("w", ceilings, &[worse.clone(), first.clone(), completion]);
        assert!(
            table.contains("| 75% / 50% / 50% / 50% / 50% / 50% |"),
            "{table}"
        );
        assert!(
            table.contains("| 100% / 100% / 100% / 62% / 62% / 62% |"),
            "{table}"
        );
        // Without a reference the column says so.
        let alone = markdown("w", ceilings, &[worse]);
        assert!(alone.trim_end().ends_with("| - |"), "{alone}");
    }

    #[test]
    fn requests_csv_has_one_row_per_record_under_its_header() {
        let mut failed = rec(5, 0, "a");
        failed.outcome = Outcome {
            status: 503,
            error: Some("HTTP 503".into()),
            ..Outcome::default()
        };
        let mut csv = String::from(CSV_HEADER);
        csv_rows(
            &mut csv,
            "shared-prefix",
            "precise-kv",
            &[rec(0, 1000, "a"), failed],
        );
        let lines: Vec<&str> = csv.lines().collect();
        let columns = CSV_HEADER.trim_end().split(',').count();
        assert_eq!(lines.len(), 3, "{csv}");
        assert!(
            lines.iter().all(|l| l.split(',').count() == columns),
            "{csv}"
        );
        assert_eq!(
            lines[1],
            "shared-prefix,precise-kv,0.0,false,a,200,500.0,1000.0,100,50,10"
        );
        assert_eq!(lines[2], "shared-prefix,precise-kv,5.0,false,,503,,,0,0,0");
    }
}
