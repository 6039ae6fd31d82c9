//! `gpufeed bench --plot FILE.svg`: the run's throughput over time as an SVG picture, the
//! loader's rate in each interval of the run beside the plain baseline and the copy ceiling
//! when they were measured (horizontal lines), the epochs marked (vertical lines). Written by
//! hand: a page of SVG needs no plotting crate.

use std::fmt::Write as _;
use std::path::Path;

use gpufeed::Result;
use gpufeed_bench::Timeline;

/// What a picture shows.
pub struct Plot<'a> {
    /// The first line of the picture: what ran.
    pub title: String,
    /// What was delivered when (bytes or images).
    pub timeline: &'a Timeline,
    /// The unit of the timeline's amounts per second: bytes (drawn in GB/s) or images.
    pub bytes: bool,
    /// Rates drawn as horizontal lines, with their labels (the baseline, the ceiling).
    pub lines: Vec<(String, f64)>,
}

const WIDTH: f64 = 960.0;
const HEIGHT: f64 = 480.0;
const LEFT: f64 = 78.0;
const RIGHT: f64 = 24.0;
const TOP: f64 = 64.0;
const BOTTOM: f64 = 56.0;

/// The colours of the reference lines, in turn.
const LINE_COLOURS: [&str; 3] = ["#d9480f", "#2b8a3e", "#862e9c"];

/// The width of the intervals a run of `seconds` is drawn in: a second for runs of half a
/// minute or more, else a round fraction that gives some thirty intervals.
pub fn interval(seconds: f64) -> f64 {
    if seconds >= 30.0 {
        return 1.0;
    }
    let want = (seconds / 30.0).max(1e-3);
    [0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0]
        .into_iter()
        .find(|&w| w >= want)
        .unwrap_or(1.0)
}

impl Plot<'_> {
    /// The picture as SVG text.
    pub fn svg(&self) -> String {
        let end = self.timeline.seconds().max(1e-3);
        let width = interval(end);
        let rates = self.timeline.rates(width);
        let scale = if self.bytes { 1e-9 } else { 1.0 };
        let unit = if self.bytes { "GB/s" } else { "images/s" };
        let top = rates
            .iter()
            .copied()
            .chain(self.lines.iter().map(|l| l.1))
            .fold(0.0f64, f64::max)
            * scale;
        let (y_max, y_step) = nice_axis(top);
        let plot_w = WIDTH - LEFT - RIGHT;
        let plot_h = HEIGHT - TOP - BOTTOM;
        let x = |t: f64| LEFT + plot_w * (t / end).clamp(0.0, 1.0);
        let y = |v: f64| TOP + plot_h * (1.0 - (v * scale / y_max).clamp(0.0, 1.0));
        let mut s = String::new();
        let _ = write!(
            s,
            r#"<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{HEIGHT}" viewBox="0 0 {WIDTH} {HEIGHT}" font-family="DejaVu Sans, Helvetica, Arial, sans-serif" font-size="12">"#
        );
        let _ = write!(
            s,
            r##"<rect width="{WIDTH}" height="{HEIGHT}" fill="#ffffff"/><text x="{LEFT}" y="24" font-size="14" font-weight="bold">{}</text><text x="{LEFT}" y="44" fill="#555555">loader throughput per {} interval ({unit}); the run took {} s</text>"##,
            escape(&self.title),
            seconds_label(width),
            short(end),
        );
        // Grid and y axis.
        let mut v = 0.0;
        while v <= y_max * 1.0001 {
            let py = TOP + plot_h * (1.0 - v / y_max);
            let _ = write!(
                s,
                r##"<line x1="{LEFT}" y1="{py:.1}" x2="{:.1}" y2="{py:.1}" stroke="#e9ecef"/><text x="{:.1}" y="{:.1}" text-anchor="end" fill="#333333">{}</text>"##,
                LEFT + plot_w,
                LEFT - 8.0,
                py + 4.0,
                short(v)
            );
            v += y_step;
        }
        let _ = write!(
            s,
            r##"<text transform="translate(18 {:.1}) rotate(-90)" text-anchor="middle" fill="#333333">{unit}</text>"##,
            TOP + plot_h / 2.0
        );
        // X axis ticks.
        let (_, x_step) = nice_axis(end);
        let mut t = 0.0;
        while t <= end * 1.0001 {
            let px = x(t);
            let _ = write!(
                s,
                r##"<line x1="{px:.1}" y1="{:.1}" x2="{px:.1}" y2="{:.1}" stroke="#333333"/><text x="{px:.1}" y="{:.1}" text-anchor="middle" fill="#333333">{}</text>"##,
                TOP + plot_h,
                TOP + plot_h + 5.0,
                TOP + plot_h + 20.0,
                short(t)
            );
            t += x_step;
        }
        let _ = write!(
            s,
            r##"<text x="{:.1}" y="{:.1}" text-anchor="middle" fill="#333333">seconds from the first batch asked for</text>"##,
            LEFT + plot_w / 2.0,
            HEIGHT - 12.0
        );
        // Epochs: dotted lines, labelled above the frame (clear of the lines drawn inside).
        for (k, &at) in self.timeline.epochs.iter().enumerate() {
            let px = x(at);
            let _ = write!(
                s,
                r##"<line x1="{px:.1}" y1="{TOP}" x2="{px:.1}" y2="{:.1}" stroke="#868e96" stroke-dasharray="2 3"/><text x="{:.1}" y="{:.1}" fill="#495057">epoch {k}</text>"##,
                TOP + plot_h,
                px + 4.0,
                TOP - 6.0
            );
        }
        // The loader's rate: a step line over the intervals, filled below.
        if !rates.is_empty() {
            let mut path = format!("M{:.1} {:.1}", x(0.0), y(0.0));
            for (k, &r) in rates.iter().enumerate() {
                let (a, b) = (k as f64 * width, ((k + 1) as f64 * width).min(end));
                let _ = write!(path, " L{:.1} {:.1} L{:.1} {:.1}", x(a), y(r), x(b), y(r));
            }
            let _ = write!(path, " L{:.1} {:.1}", x(end), y(0.0));
            let _ = write!(
                s,
                r##"<path d="{path} Z" fill="#a5d8ff" fill-opacity="0.6" stroke="#1c7ed6" stroke-width="1.5"/>"##
            );
        }
        // Reference lines.
        for (k, (_, rate)) in self.lines.iter().enumerate() {
            let py = y(*rate);
            let colour = LINE_COLOURS[k % LINE_COLOURS.len()];
            let _ = write!(
                s,
                r##"<line x1="{LEFT}" y1="{py:.1}" x2="{:.1}" y2="{py:.1}" stroke="{colour}" stroke-width="2" stroke-dasharray="8 4"/>"##,
                LEFT + plot_w
            );
        }
        // Legend, top right, inside the plot.
        let mut entries = vec![("gpufeed loader".to_owned(), "#1c7ed6", false)];
        for (k, (label, rate)) in self.lines.iter().enumerate() {
            entries.push((
                format!("{label}: {} {unit}", short(rate * scale)),
                LINE_COLOURS[k % LINE_COLOURS.len()],
                true,
            ));
        }
        let legend_w = 300.0;
        let lx = LEFT + plot_w - legend_w - 8.0;
        let _ = write!(
            s,
            r##"<rect x="{lx:.1}" y="{:.1}" width="{legend_w}" height="{:.1}" fill="#ffffff" fill-opacity="0.85" stroke="#ced4da"/>"##,
            TOP + 20.0,
            10.0 + 18.0 * entries.len() as f64
        );
        for (k, (text, colour, dashed)) in entries.iter().enumerate() {
            let ly = TOP + 36.0 + 18.0 * k as f64;
            let dash = if *dashed {
                r#" stroke-dasharray="8 4""#
            } else {
                ""
            };
            let _ = write!(
                s,
                r##"<line x1="{:.1}" y1="{:.1}" x2="{:.1}" y2="{:.1}" stroke="{colour}" stroke-width="2.5"{dash}/><text x="{:.1}" y="{:.1}" fill="#212529">{}</text>"##,
                lx + 10.0,
                ly - 4.0,
                lx + 40.0,
                ly - 4.0,
                lx + 48.0,
                ly,
                escape(text)
            );
        }
        // The plot's frame.
        let _ = write!(
            s,
            r##"<rect x="{LEFT}" y="{TOP}" width="{plot_w:.1}" height="{plot_h:.1}" fill="none" stroke="#333333"/></svg>"##
        );
        s.push('\n');
        s
    }

    /// Writes the picture to `path` (a temporary file beside it, then renamed).
    pub fn write(&self, path: &Path) -> Result<()> {
        gpufeed::temporary::write_replacing(path, "write the plot", |out| {
            std::io::Write::write_all(out, self.svg().as_bytes())
        })
    }
}

/// The top of an axis from 0 that holds `max`, and its tick step: 1, 2 or 5 times a power of
/// ten, about five ticks.
fn nice_axis(max: f64) -> (f64, f64) {
    if !(max.is_finite() && max > 0.0) {
        return (1.0, 0.2);
    }
    let raw = max / 5.0;
    let power = 10f64.powf(raw.log10().floor());
    let step = [1.0, 2.0, 5.0, 10.0]
        .into_iter()
        .map(|m| m * power)
        .find(|&s| s >= raw)
        .unwrap_or(10.0 * power);
    ((max / step - 1e-9).ceil().max(1.0) * step, step)
}

/// A number with at most three significant digits, no trailing zeros (`12.5`, `0.25`, `3`).
fn short(v: f64) -> String {
    if v == 0.0 {
        return "0".to_owned();
    }
    let digits = (2 - v.abs().log10().floor() as i32).clamp(0, 6) as usize;
    let text = format!("{v:.digits$}");
    if text.contains('.') {
        text.trim_end_matches('0').trim_end_matches('.').to_owned()
    } else {
        text
    }
}

/// An interval's width in words (`1 s`, `100 ms`).
fn seconds_label(width: f64) -> String {
    if width >= 1.0 {
        format!("{} s", short(width))
    } else {
        format!("{} ms", short(width * 1e3))
    }
}

/// `text` safe inside SVG text.
fn escape(text: &str) -> String {
    text.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
}

#[cfg(test)]
mod tests {
    use super::{Plot, interval, nice_axis, short};
    use gpufeed_bench::Timeline;

    #[test]
    fn axes_are_round() {
        assert_eq!(nice_axis(23.0), (25.0, 5.0));
        assert_eq!(nice_axis(0.8), (0.8, 0.2));
        assert_eq!(nice_axis(100.0), (100.0, 20.0));
        assert_eq!(short(12.5), "12.5");
        assert_eq!(short(0.25), "0.25");
        assert_eq!(short(3.0), "3");
        assert_eq!(short(1234.0), "1234");
        assert_eq!(interval(120.0), 1.0);
        assert_eq!(interval(3.0), 0.1);
        assert_eq!(interval(0.9), 0.05);
    }

    #[test]
    fn a_plot_has_the_loader_the_lines_and_the_epochs() {
        let mut t = Timeline::default();
        for e in 0..3 {
            t.epoch(e as f64);
            for k in 1..=10 {
                t.batch(e as f64 + k as f64 * 0.1, 1e9);
            }
        }
        let plot = Plot {
            title: "gpufeed bench: a <test> & more".to_owned(),
            timeline: &t,
            bytes: true,
            lines: vec![("plain gather".to_owned(), 8e9)],
        };
        let svg = plot.svg();
        assert!(svg.starts_with("<svg ") && svg.trim_end().ends_with("</svg>"));
        assert!(svg.contains("a &lt;test&gt; &amp; more"));
        assert!(svg.contains("plain gather: 8 GB/s"));
        for e in 0..3 {
            assert!(svg.contains(&format!(">epoch {e}<")), "epoch {e}");
        }
        assert!(svg.contains("<path d=\"M"), "the loader's rate");
    }
}
