//! Service-level objectives: a latency percentile bound per tier
//! (`paid:ttft_p99=1s,tpot_p99=60ms`), as `flotilla plan` searches for
//! and `flotilla bench --slo` checks a real server against.

use std::time::Duration;

/// Which latency an objective bounds.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Metric {
    /// Time to first token.
    Ttft,
    /// A request's mean time per output token after the first.
    Tpot,
}

/// One objective: `tier`'s `metric` at percentile `pct` at most `limit`.
#[derive(Clone, Debug, PartialEq)]
pub struct Objective {
    /// The tier's name (empty: every request, whatever its tier).
    pub tier: String,
    /// The latency.
    pub metric: Metric,
    /// The percentile (0 < pct <= 100).
    pub pct: f64,
    /// The bound.
    pub limit: Duration,
}

impl std::fmt::Display for Objective {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let m = match self.metric {
            Metric::Ttft => "ttft",
            Metric::Tpot => "tpot",
        };
        write!(
            f,
            "{}{}{m}_p{}<={}ms",
            self.tier,
            if self.tier.is_empty() { "" } else { ":" },
            self.pct,
            self.limit.as_secs_f64() * 1e3
        )
    }
}

/// Parses `TIER:METRIC_pPCT=VALUE[,METRIC_pPCT=VALUE...]`, e.g.
/// `paid:ttft_p99=1s,tpot_p99=60ms` (values in `s` or `ms`).
pub fn parse_objectives(arg: &str) -> Result<Vec<Objective>, String> {
    let (tier, rest) = arg.split_once(':').ok_or_else(|| {
        format!("--slo '{arg}': expected TIER:METRIC_pN=VALUE, e.g. paid:ttft_p99=1s")
    })?;
    if tier.is_empty() {
        return Err(format!("--slo '{arg}': no tier before ':'"));
    }
    parse_bounds(arg, tier, rest)
}

/// Parses `METRIC_pPCT=VALUE[,...]` for every tier at once (`tier` empty),
/// or `TIER:...` as [`parse_objectives`] does: `flotilla bench --slo`,
/// where one server's requests are judged together.
pub fn parse_any_tier(arg: &str) -> Result<Vec<Objective>, String> {
    match arg.split_once(':') {
        Some(_) => parse_objectives(arg),
        None => parse_bounds(arg, "", arg),
    }
}

fn parse_bounds(arg: &str, tier: &str, rest: &str) -> Result<Vec<Objective>, String> {
    let mut out = Vec::new();
    for part in rest.split(',') {
        let (key, value) = part
            .split_once('=')
            .ok_or_else(|| format!("--slo '{arg}': '{part}' is not METRIC_pN=VALUE"))?;
        let (metric, pct) = key
            .split_once("_p")
            .ok_or_else(|| format!("--slo '{arg}': '{key}' is not ttft_pN or tpot_pN"))?;
        let metric = match metric {
            "ttft" => Metric::Ttft,
            "tpot" => Metric::Tpot,
            other => {
                return Err(format!(
                    "--slo '{arg}': unknown metric '{other}' (ttft, tpot)"
                ));
            }
        };
        let pct: f64 = pct
            .parse()
            .ok()
            .filter(|p: &f64| *p > 0.0 && *p <= 100.0)
            .ok_or_else(|| format!("--slo '{arg}': percentile '{pct}' is not in (0, 100]"))?;
        let limit = parse_duration(value)
            .ok_or_else(|| format!("--slo '{arg}': '{value}' is not a time like 1s or 60ms"))?;
        out.push(Objective {
            tier: tier.to_string(),
            metric,
            pct,
            limit,
        });
    }
    Ok(out)
}

fn parse_duration(v: &str) -> Option<Duration> {
    let (num, scale) = if let Some(n) = v.strip_suffix("ms") {
        (n, 1e-3)
    } else if let Some(n) = v.strip_suffix("us") {
        (n, 1e-6)
    } else if let Some(n) = v.strip_suffix('s') {
        (n, 1.0)
    } else {
        return None;
    };
    let x: f64 = num.parse().ok()?;
    (x.is_finite() && x > 0.0).then(|| Duration::from_secs_f64(x * scale))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn objectives_parse_and_bad_ones_say_why() {
        let o = parse_objectives("paid:ttft_p99=1s,tpot_p99=60ms").unwrap();
        assert_eq!(o.len(), 2);
        assert_eq!(o[0].metric, Metric::Ttft);
        assert_eq!(o[0].limit, Duration::from_secs(1));
        assert_eq!(o[1].metric, Metric::Tpot);
        assert_eq!(o[1].pct, 99.0);
        assert_eq!(o[1].limit, Duration::from_millis(60));
        for (bad, why) in [
            ("ttft_p99=1s", "expected TIER"),
            ("paid:ttft=1s", "not ttft_pN"),
            ("paid:itl_p99=1s", "unknown metric"),
            ("paid:ttft_p0=1s", "percentile"),
            ("paid:ttft_p99=fast", "not a time"),
            ("paid:ttft_p99", "not METRIC_pN=VALUE"),
        ] {
            let e = parse_objectives(bad).unwrap_err();
            assert!(e.contains(why), "{bad}: {e}");
        }
        // Without a tier, for one server's requests all together.
        let any = parse_any_tier("tpot_p50=25ms").unwrap();
        assert_eq!((any[0].tier.as_str(), any[0].pct), ("", 50.0));
        assert_eq!(any[0].to_string(), "tpot_p50<=25ms");
        assert_eq!(parse_any_tier("paid:ttft_p99=1s").unwrap()[0].tier, "paid");
        assert!(
            parse_any_tier("ttft_p99=soon")
                .unwrap_err()
                .contains("not a time")
        );
    }
}
