//! A request's own latency objectives, from its headers (llm-d's convention): `x-slo-ttft-ms`
//! (time to first token) and `x-slo-tpot-ms` (time per output token), each a positive number of
//! milliseconds. A request that states them is placed only where they are predicted to be met
//! while such an endpoint exists; with flow control on, one that none can meet waits while an idle
//! endpoint would, and is refused (429 sheddable, 503 others) otherwise.
//!
//! Invariant: a header that is present but not a positive, finite number of at most
//! [`MAX_MS`] is an error the request is answered with (400), never silently ignored.

/// The TTFT objective header.
pub(crate) const TTFT_HEADER: &str = "x-slo-ttft-ms";
/// The TPOT objective header.
pub(crate) const TPOT_HEADER: &str = "x-slo-tpot-ms";
/// The largest objective accepted, in ms (flow control's longest wait).
pub(crate) const MAX_MS: f64 = 600_000.0;

/// What a request's headers ask of its latency.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub(crate) struct Objectives {
    pub(crate) ttft_ms: Option<f64>,
    pub(crate) tpot_ms: Option<f64>,
}

impl Objectives {
    /// Reads header `key` with `value` if it is one of the objective headers. `Ok(false)`: not
    /// one; `Err`: one, with a value that is not a valid objective (the message says why).
    pub(crate) fn read(&mut self, key: &str, value: Option<&str>) -> Result<bool, String> {
        let slot = match key {
            TTFT_HEADER => &mut self.ttft_ms,
            TPOT_HEADER => &mut self.tpot_ms,
            _ => return Ok(false),
        };
        let ms = value
            .map(str::trim)
            .and_then(|v| v.parse::<f64>().ok())
            .filter(|ms| ms.is_finite() && *ms > 0.0 && *ms <= MAX_MS)
            .ok_or_else(|| {
                format!(
                    "header {key} must be a positive number of milliseconds, at most {MAX_MS}; got {:?}",
                    value.unwrap_or("(not UTF-8)")
                )
            })?;
        *slot = Some(ms);
        Ok(true)
    }

    /// What is left of the TTFT objective after `waited_ms`, the tighter of the request's and
    /// `configured` (flow control's, already less the wait).
    pub(crate) fn ttft_budget_ms(&self, waited_ms: f64, configured: Option<f64>) -> Option<f64> {
        let own = self.ttft_ms.map(|ms| ms - waited_ms);
        match (own, configured) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn objectives_are_positive_milliseconds_and_anything_else_is_an_error() {
        let mut o = Objectives::default();
        assert_eq!(o.read("x-other", Some("5")), Ok(false));
        assert_eq!(o.read(TTFT_HEADER, Some("250")), Ok(true));
        assert_eq!(o.read(TPOT_HEADER, Some(" 12.5 ")), Ok(true));
        assert_eq!((o.ttft_ms, o.tpot_ms), (Some(250.0), Some(12.5)));
        for bad in ["0", "-3", "abc", "", "NaN", "inf", "600001"] {
            let e = Objectives::default()
                .read(TPOT_HEADER, Some(bad))
                .unwrap_err();
            assert!(
                e.contains(TPOT_HEADER) && e.contains("positive"),
                "{bad}: {e}"
            );
        }
        assert!(Objectives::default().read(TTFT_HEADER, None).is_err());
    }

    #[test]
    fn the_ttft_budget_is_the_tighter_objective_less_the_wait() {
        let o = Objectives {
            ttft_ms: Some(500.0),
            tpot_ms: None,
        };
        assert_eq!(o.ttft_budget_ms(100.0, None), Some(400.0));
        assert_eq!(o.ttft_budget_ms(100.0, Some(300.0)), Some(300.0));
        assert_eq!(o.ttft_budget_ms(100.0, Some(900.0)), Some(400.0));
        assert_eq!(
            Objectives::default().ttft_budget_ms(1.0, Some(7.0)),
            Some(7.0)
        );
        assert_eq!(Objectives::default().ttft_budget_ms(1.0, None), None);
    }
}
