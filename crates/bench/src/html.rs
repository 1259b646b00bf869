//! The report as one self-contained HTML page: tables of the settings and
//! figures, and SVG plots drawn with `plotters` (latency CDFs, throughput
//! against p99 latency across the levels, tokens/s and queue length over
//! time per tier), inline so the file can be mailed or archived alone.

use std::fmt::Write as _;

use plotters::prelude::*;

use crate::report::Report;
use crate::sweep::{Range, Sweep};

/// Size of each plot, pixels.
const W: u32 = 720;
const H: u32 = 400;

/// One line of a plot: its name and points.
struct Line {
    name: String,
    points: Vec<(f64, f64)>,
}

fn esc(s: &str) -> String {
    s.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
        .replace('"', "&quot;")
}

/// An SVG line plot of `lines` (markers too when `markers`); a note in
/// place of the plot when no line has a point.
fn plot(title: &str, x_label: &str, y_label: &str, lines: &[Line], markers: bool) -> String {
    plot_at(
        title,
        x_label,
        y_label,
        lines,
        markers,
        SeriesLabelPosition::UpperLeft,
    )
}

/// [`plot`] with the legend at `legend`.
fn plot_at(
    title: &str,
    x_label: &str,
    y_label: &str,
    lines: &[Line],
    markers: bool,
    legend: SeriesLabelPosition,
) -> String {
    let pts = lines.iter().flat_map(|l| l.points.iter());
    let (mut x0, mut x1, mut y0, mut y1) = (f64::INFINITY, f64::NEG_INFINITY, 0.0f64, 0.0f64);
    let mut any = false;
    for &(x, y) in pts {
        if !(x.is_finite() && y.is_finite()) {
            continue;
        }
        any = true;
        x0 = x0.min(x);
        x1 = x1.max(x);
        y0 = y0.min(y);
        y1 = y1.max(y);
    }
    if !any {
        return format!("<p class=\"none\">{}: no data in this run.</p>", esc(title));
    }
    if x1 <= x0 {
        x1 = x0 + 1.0;
    }
    if y1 <= y0 {
        y1 = y0 + 1.0;
    }
    let pad = (x1 - x0) * 0.02;
    let (x0, x1, y1) = (x0 - pad, x1 + pad, y1 * 1.05);
    let mut svg = String::new();
    {
        let root = SVGBackend::with_string(&mut svg, (W, H)).into_drawing_area();
        let drawn = (|| -> Result<(), Box<dyn std::error::Error + '_>> {
            root.fill(&WHITE)?;
            let mut chart = ChartBuilder::on(&root)
                .caption(title, ("sans-serif", 18))
                .margin(12)
                .x_label_area_size(40)
                .y_label_area_size(64)
                .build_cartesian_2d(x0..x1, y0..y1)?;
            chart
                .configure_mesh()
                .x_desc(x_label)
                .y_desc(y_label)
                .light_line_style(RGBColor(235, 235, 235))
                .draw()?;
            for (i, l) in lines.iter().enumerate() {
                let color = Palette99::pick(i).to_rgba();
                let style = ShapeStyle::from(&color).stroke_width(2);
                let pts: Vec<(f64, f64)> = l
                    .points
                    .iter()
                    .copied()
                    .filter(|(x, y)| x.is_finite() && y.is_finite())
                    .collect();
                chart
                    .draw_series(LineSeries::new(pts.clone(), style))?
                    .label(l.name.clone())
                    .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 18, y)], style));
                if markers {
                    chart.draw_series(
                        pts.iter()
                            .map(|&p| Circle::new(p, 4, ShapeStyle::from(&color).filled())),
                    )?;
                }
            }
            chart
                .configure_series_labels()
                .background_style(WHITE.mix(0.85))
                .border_style(BLACK)
                .position(legend)
                .draw()?;
            root.present()?;
            Ok(())
        })();
        if let Err(e) = drawn {
            return format!(
                "<p class=\"none\">{}: {}</p>",
                esc(title),
                esc(&e.to_string())
            );
        }
    }
    svg
}

/// The CDF of one latency figure, a line per level (its first run).
fn cdf(sweep: &Sweep, title: &str, pick: fn(&Report) -> Option<&Vec<f64>>) -> String {
    let lines: Vec<Line> = sweep
        .levels
        .iter()
        .filter_map(|l| {
            let q = pick(l.runs.first()?)?;
            Some(Line {
                name: l.name.clone(),
                points: q
                    .iter()
                    .enumerate()
                    .map(|(p, &v)| (v, p as f64 / 100.0))
                    .collect(),
            })
        })
        .collect();
    plot_at(
        title,
        "ms",
        "fraction of requests at or below",
        &lines,
        false,
        SeriesLabelPosition::LowerRight,
    )
}

/// Output tokens per second between successive looks at the server.
fn rate(r: &Report) -> Vec<(f64, f64)> {
    r.timeline
        .windows(2)
        .filter(|w| w[1].t_s > w[0].t_s)
        .map(|w| {
            let dt = w[1].t_s - w[0].t_s;
            let tokens = w[1].output_chunks.saturating_sub(w[0].output_chunks) as f64;
            ((w[0].t_s + w[1].t_s) / 2.0, tokens / dt)
        })
        .collect()
}

/// A line per (level, tier) of `pick` over time.
fn per_tier(sweep: &Sweep, pick: fn(&crate::server::TierLoad) -> u64) -> Vec<Line> {
    let mut lines = Vec::new();
    for l in &sweep.levels {
        let Some(r) = l.runs.first() else { continue };
        let tiers: std::collections::BTreeSet<&String> =
            r.timeline.iter().flat_map(|s| s.tiers.keys()).collect();
        for t in tiers {
            let name = if sweep.levels.len() > 1 {
                format!("{}, {t}", l.name)
            } else {
                t.clone()
            };
            lines.push(Line {
                name,
                points: r
                    .timeline
                    .iter()
                    .map(|s| (s.t_s, s.tiers.get(t).map_or(0, pick) as f64))
                    .collect(),
            });
        }
    }
    lines
}

fn opt(v: Option<f64>, d: usize) -> String {
    v.map_or_else(|| "-".into(), |v| format!("{v:.d$}"))
}

/// The whole page.
pub fn page(sweep: &Sweep) -> String {
    let mut h = String::new();
    let first = sweep.levels.iter().find_map(|l| l.runs.first());
    let title = match (&sweep.label, first) {
        (l, _) if !l.is_empty() => format!("flotilla-bench: {l}"),
        (_, Some(r)) if !r.label.is_empty() => format!("flotilla-bench: {}", r.label),
        _ => "flotilla-bench report".to_string(),
    };
    let _ = write!(
        h,
        "<!doctype html><html><head><meta charset=\"utf-8\"><title>{t}</title><style>\
         body{{font-family:sans-serif;margin:2em;max-width:1500px}}\
         table{{border-collapse:collapse;margin:1em 0}}td,th{{border:1px solid #ccc;padding:3px 8px;text-align:right}}\
         th{{background:#f4f4f4}}td:first-child,th:first-child{{text-align:left}}\
         .plots{{display:flex;flex-wrap:wrap;gap:12px}}.none{{color:#888}}</style></head><body>\
         <h1>{t}</h1>",
        t = esc(&title)
    );
    if let Some(r) = first {
        let f = &r.flags;
        let _ = write!(
            h,
            "<p>Server <code>{}</code>{}, model <b>{}</b> (quantisation {}); {} requests per run, \
             max_tokens {}, prompts {}, seed {}.</p>",
            esc(&r.server_url),
            esc(&r.endpoint),
            esc(&r.model),
            esc(&r.quantisation),
            f.requests,
            f.max_tokens,
            esc(&r.prompt_distribution),
            f.seed
        );
        if let Some(serde_json::Value::Object(c)) = &r.server.config {
            h += "<h2>Server settings (its /config)</h2><table>";
            for (k, v) in c {
                let v = match v {
                    serde_json::Value::String(s) => s.clone(),
                    v => v.to_string(),
                };
                let _ = write!(h, "<tr><td>{}</td><td>{}</td></tr>", esc(k), esc(&v));
            }
            h += "</table>";
        }
    }
    h += "<h2>Figures (mean over each level's runs; latencies in ms)</h2><table><tr>\
          <th>level</th><th>runs</th><th>output tok/s</th><th>req/s</th><th>TTFT p50</th>\
          <th>TTFT p99</th><th>TPOT p50</th><th>TPOT p99</th><th>ITL p99</th><th>E2E p99</th>\
          <th>failed</th><th>peak RSS MiB</th><th>KV peak blocks</th></tr>";
    for l in &sweep.levels {
        let failed: u64 = l.runs.iter().map(|r| r.requests_failed).sum();
        let _ = write!(
            h,
            "<tr><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td>\
             <td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td></tr>",
            esc(&l.name),
            l.runs.len(),
            opt(l.mean(|r| Some(r.output_tokens_per_s)), 1),
            opt(l.mean(|r| Some(r.requests_per_s)), 2),
            opt(l.mean(|r| r.ttft_ms.map(|s| s.p50)), 1),
            opt(l.mean(|r| r.ttft_ms.map(|s| s.p99)), 1),
            opt(l.mean(|r| r.tpot_ms.map(|s| s.p50)), 2),
            opt(l.mean(|r| r.tpot_ms.map(|s| s.p99)), 2),
            opt(l.mean(|r| r.itl_ms.map(|s| s.p99)), 2),
            opt(l.mean(|r| r.e2e_ms.map(|s| s.p99)), 1),
            failed,
            opt(
                l.mean(|r| r.server.peak_rss_bytes.map(|b| b as f64 / 1048576.0)),
                0
            ),
            opt(
                l.mean(|r| r.server.kv_used_peak_blocks.map(|b| b as f64)),
                0
            ),
        );
    }
    h += "</table>";
    if sweep.levels.iter().any(|l| l.spread.is_some()) {
        h += "<h2>Stability (mean [min .. max], spread = (max - min) / mean)</h2><table><tr>\
              <th>level</th><th>runs</th><th>output tok/s</th><th>TTFT p99</th><th>TPOT p99</th>\
              <th>E2E p99</th></tr>";
        for l in &sweep.levels {
            if let Some(s) = &l.spread {
                let _ = write!(
                    h,
                    "<tr><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td></tr>",
                    esc(&l.name),
                    s.runs,
                    Range::text(s.output_tokens_per_s),
                    Range::text(s.ttft_p99_ms),
                    Range::text(s.tpot_p99_ms),
                    Range::text(s.e2e_p99_ms)
                );
            }
        }
        h += "</table>";
    }
    h += "<h2>Latency distributions</h2><div class=\"plots\">";
    h += &cdf(sweep, "TTFT CDF", |r| r.cdf.as_ref().map(|c| &c.ttft_ms));
    h += &cdf(sweep, "TPOT CDF", |r| r.cdf.as_ref().map(|c| &c.tpot_ms));
    h += &cdf(sweep, "ITL CDF", |r| r.cdf.as_ref().map(|c| &c.itl_ms));
    h += &cdf(sweep, "E2E CDF", |r| r.cdf.as_ref().map(|c| &c.e2e_ms));
    h += "</div>";
    if sweep.levels.len() > 1 {
        h += "<h2>Throughput against latency across the levels</h2><div class=\"plots\">";
        for (title, pick) in [
            (
                "TPOT p99 against output tok/s",
                (|r: &Report| r.tpot_ms.map(|s| s.p99)) as fn(&Report) -> Option<f64>,
            ),
            ("TTFT p99 against output tok/s", |r: &Report| {
                r.ttft_ms.map(|s| s.p99)
            }),
        ] {
            // A line per server (levels gathered from runs against several
            // servers, e.g. beside a peer), its levels in order.
            let mut lines: Vec<(String, Line)> = Vec::new();
            for l in &sweep.levels {
                let Some(r) = l.runs.first() else { continue };
                let Some(p) = l.mean(|r| Some(r.output_tokens_per_s)).zip(l.mean(pick)) else {
                    continue;
                };
                let key = r.server_url.clone();
                match lines.iter_mut().find(|(k, _)| *k == key) {
                    Some((_, line)) => {
                        line.points.push(p);
                        line.name.push_str(&format!(", {}", l.name));
                    }
                    None => lines.push((
                        key,
                        Line {
                            name: l.name.clone(),
                            points: vec![p],
                        },
                    )),
                }
            }
            let lines: Vec<Line> = lines.into_iter().map(|(_, l)| l).collect();
            h += &plot(title, "output tok/s", "ms", &lines, true);
        }
        h += "</div>";
    }
    h += "<h2>Over time (each level's first run)</h2><div class=\"plots\">";
    let rates: Vec<Line> = sweep
        .levels
        .iter()
        .filter_map(|l| {
            Some(Line {
                name: l.name.clone(),
                points: rate(l.runs.first()?),
            })
        })
        .collect();
    h += &plot("Output tokens/s", "s", "tokens/s", &rates, false);
    h += &plot(
        "Queue length per tier",
        "s",
        "requests waiting",
        &per_tier(sweep, |t| t.queued),
        false,
    );
    h += &plot(
        "Running sequences per tier",
        "s",
        "sequences",
        &per_tier(sweep, |t| t.running),
        false,
    );
    let kv: Vec<Line> = sweep
        .levels
        .iter()
        .filter_map(|l| {
            let r = l.runs.first()?;
            Some(Line {
                name: l.name.clone(),
                points: r
                    .timeline
                    .iter()
                    .filter_map(|s| Some((s.t_s, s.kv_used_blocks? as f64)))
                    .collect(),
            })
        })
        .collect();
    h += &plot("KV blocks in use", "s", "blocks", &kv, false);
    h += "</div></body></html>\n";
    h
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_plot_is_an_svg_with_its_title_labels_and_a_path_per_line() {
        let lines = [
            Line {
                name: "c=1".into(),
                points: vec![(1.0, 0.0), (2.0, 0.5), (4.0, 1.0)],
            },
            Line {
                name: "c=<8>".into(),
                points: vec![(3.0, 0.0), (9.0, 1.0)],
            },
        ];
        let svg = plot("TTFT CDF", "ms", "fraction", &lines, true);
        assert!(svg.starts_with("<svg"), "{}", &svg[..svg.len().min(200)]);
        assert!(svg.contains("\nTTFT CDF\n") && svg.contains("\nms\n"));
        assert!(svg.contains("c=1") && svg.contains("c=&lt;8&gt;"));
        assert!(svg.matches("<polyline").count() >= 2, "a line per series");
        assert!(svg.matches("<circle").count() >= 5, "a marker per point");
        // Nothing to draw: a note, not an empty chart.
        let none = plot("Queue length", "s", "n", &[], false);
        assert!(none.contains("no data"));
    }
}
