//! A small SVG line chart — decode ms/token against context length, one line per cache mode — written
//! directly: the picture needs axes, polylines and a legend, not a plotting stack with font loading.

use std::fmt::Write;

pub struct Series {
    pub name: String,
    /// (x, y) points; x > 0 (the x axis is logarithmic).
    pub points: Vec<(f64, f64)>,
}

const COLORS: &[&str] = &[
    "#d62728", "#1f77b4", "#2ca02c", "#9467bd", "#ff7f0e", "#8c564b", "#17becf",
];

fn esc(s: &str) -> String {
    s.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
}

/// Renders the chart: log2 x axis, log10 y axis (an O(n) and an O(n²) cost both stay readable), a
/// legend at the top left.
pub fn line_chart_svg(title: &str, x_label: &str, y_label: &str, series: &[Series]) -> String {
    let (w, h) = (800.0, 500.0);
    let (l, r, t, b) = (70.0, 20.0, 40.0, 50.0);
    let pts = series.iter().flat_map(|s| s.points.iter());
    let (mut x0, mut x1, mut y0, mut y1) = (f64::MAX, f64::MIN, f64::MAX, f64::MIN);
    for &(x, y) in pts.filter(|p| p.0 > 0.0 && p.1 > 0.0) {
        x0 = x0.min(x);
        x1 = x1.max(x);
        y0 = y0.min(y);
        y1 = y1.max(y);
    }
    if y0 > y1 {
        (y0, y1) = (1.0, 10.0);
    }
    let (y0, y1) = (y0 / 1.5, y1 * 1.5);
    if x0 >= x1 {
        x0 = x0.min(1.0);
        x1 = x0 * 2.0;
    }
    let px = |x: f64| l + (x.log2() - x0.log2()) / (x1.log2() - x0.log2()) * (w - l - r);
    let py = |y: f64| h - b - (y.log10() - y0.log10()) / (y1.log10() - y0.log10()) * (h - t - b);
    let mut s = String::new();
    let _ = write!(
        s,
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" font-family="sans-serif" font-size="12">
<rect width="100%" height="100%" fill="white"/>
<text x="{}" y="22" text-anchor="middle" font-size="15">{}</text>
<line x1="{l}" y1="{}" x2="{}" y2="{}" stroke="black"/>
<line x1="{l}" y1="{t}" x2="{l}" y2="{}" stroke="black"/>
<text x="{}" y="{}" text-anchor="middle">{}</text>
<text x="16" y="{}" text-anchor="middle" transform="rotate(-90 16 {})">{}</text>
"#,
        w / 2.0,
        esc(title),
        h - b,
        w - r,
        h - b,
        h - b,
        (l + w - r) / 2.0,
        h - 12.0,
        esc(x_label),
        (t + h - b) / 2.0,
        (t + h - b) / 2.0,
        esc(y_label)
    );
    // x ticks at the powers of two in range, y ticks at 5 even steps.
    let mut x = 2f64.powi(x0.log2().floor() as i32);
    while x <= x1 * 1.0001 {
        if x >= x0 * 0.9999 {
            let _ = writeln!(
                s,
                r#"<line x1="{0}" y1="{1}" x2="{0}" y2="{2}" stroke="black"/><text x="{0}" y="{3}" text-anchor="middle">{4}</text>"#,
                px(x),
                h - b,
                h - b + 5.0,
                h - b + 18.0,
                x
            );
        }
        x *= 2.0;
    }
    let mut ticks = Vec::new();
    let mut decade = 10f64.powi(y0.log10().floor() as i32);
    while decade <= y1 {
        for m in [1.0, 2.0, 5.0] {
            let y = decade * m;
            if y >= y0 && y <= y1 {
                ticks.push(y);
            }
        }
        decade *= 10.0;
    }
    for y in ticks {
        let _ = writeln!(
            s,
            r##"<line x1="{0}" y1="{1}" x2="{2}" y2="{1}" stroke="#ddd"/><text x="{3}" y="{4}" text-anchor="end">{5}</text>"##,
            l,
            py(y),
            w - r,
            l - 6.0,
            py(y) + 4.0,
            y
        );
    }
    for (i, se) in series.iter().enumerate() {
        let c = COLORS[i % COLORS.len()];
        let path: Vec<String> = se
            .points
            .iter()
            .map(|&(x, y)| format!("{:.1},{:.1}", px(x), py(y)))
            .collect();
        let _ = writeln!(
            s,
            r#"<polyline fill="none" stroke="{c}" stroke-width="2" points="{}"/>"#,
            path.join(" ")
        );
        for &(x, y) in &se.points {
            let _ = writeln!(
                s,
                r#"<circle cx="{:.1}" cy="{:.1}" r="3" fill="{c}"/>"#,
                px(x),
                py(y)
            );
        }
        let ly = t + 10.0 + 18.0 * i as f64;
        let _ = writeln!(
            s,
            r#"<line x1="{}" y1="{ly}" x2="{}" y2="{ly}" stroke="{c}" stroke-width="3"/><text x="{}" y="{}">{}</text>"#,
            l + 12.0,
            l + 36.0,
            l + 42.0,
            ly + 4.0,
            esc(&se.name)
        );
    }
    s.push_str("</svg>\n");
    s
}
