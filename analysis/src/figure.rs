//! Small-multiple line plots for the report: a 1,000 px wide SVG of panels,
//! each with at most [`MAX_SERIES`] series in colours of the Okabe-Ito
//! colour-blind-safe palette (its yellow left out: too pale on white), each
//! series with its own marker, an optional shaded band (the report's 95%
//! t-interval over traces), tick labels at given values, log axes where
//! asked. Text is SVG `<text>` in the generic `sans-serif` family, laid out
//! without reading any font file, so the SVGs are the same on every machine.

use plotters::coord::ranged1d::{DefaultFormatting, KeyPointHint, Ranged};
use plotters::prelude::*;
use std::path::Path;

pub type PlotResult = Result<(), Box<dyn std::error::Error>>;

/// Most series in one panel (the reference line counted).
pub const MAX_SERIES: usize = 8;
/// Width of every figure, px.
pub const WIDTH: u32 = 1000;

/// Okabe & Ito (2008), "Color Universal Design", without the yellow
/// (#F0E442): black, orange, sky blue, bluish green, blue, vermillion,
/// reddish purple.
pub const PALETTE: [(u8, u8, u8); 7] = [
    (0x00, 0x00, 0x00),
    (0xE6, 0x9F, 0x00),
    (0x56, 0xB4, 0xE9),
    (0x00, 0x9E, 0x73),
    (0x00, 0x72, 0xB2),
    (0xD5, 0x5E, 0x00),
    (0xCC, 0x79, 0xA7),
];
/// Grid lines.
pub const GRID: (u8, u8, u8) = (0xDD, 0xDD, 0xDD);

/// The order series take colours in: the reference (blue) first, then
/// vermillion, orange, bluish green, reddish purple, sky blue, black.
const ORDER: [usize; 7] = [4, 5, 1, 3, 6, 2, 0];

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Marker {
    Circle,
    Square,
    TriangleUp,
    Diamond,
    TriangleDown,
    Cross,
    Plus,
}

const MARKERS: [Marker; 7] = [
    Marker::Circle,
    Marker::Square,
    Marker::TriangleUp,
    Marker::Diamond,
    Marker::TriangleDown,
    Marker::Cross,
    Marker::Plus,
];

/// The style of the `i`-th series of a panel.
pub fn style(i: usize) -> (RGBColor, Marker) {
    let c = PALETTE[ORDER[i % ORDER.len()]];
    (RGBColor(c.0, c.1, c.2), MARKERS[i % MARKERS.len()])
}

#[derive(Clone, Debug, PartialEq)]
pub struct Series {
    pub label: String,
    /// (x, y) of the line.
    pub line: Vec<(f64, f64)>,
    /// (x, low, high) of the band; empty: none.
    pub band: Vec<(f64, f64, f64)>,
    /// Where markers go.
    pub marks: Vec<(f64, f64)>,
}

#[derive(Clone, Debug, PartialEq)]
pub struct Panel {
    pub title: String,
    pub series: Vec<Series>,
    /// A dashed black vertical line at x, with its legend text.
    pub vline: Option<(f64, String)>,
}

#[derive(Clone, Debug, PartialEq)]
pub struct Axis {
    pub desc: String,
    pub log: bool,
    pub range: (f64, f64),
    /// Values labelled on the axis.
    pub ticks: Vec<f64>,
    /// Labels as percentages (0.2 -> 20%).
    pub percent: bool,
}

#[derive(Clone, Debug, PartialEq)]
pub struct Figure {
    pub file: String,
    pub title: String,
    /// What the figure shows, for the report (HTML).
    pub caption: String,
    pub x: Axis,
    pub y: Axis,
    pub panels: Vec<Panel>,
}

/// A tick label: `20%`, `0.05`, `1,024`.
pub fn tick_label(v: f64, percent: bool) -> String {
    if percent {
        return crate::compare::percent(v);
    }
    if v >= 1000.0 && v.fract() == 0.0 {
        let s = format!("{v:.0}");
        let (a, b) = s.split_at(s.len() - 3);
        return format!("{a},{b}");
    }
    if v != 0.0 && v.abs() < 0.001 {
        return format!("{v:.0e}");
    }
    let s = format!("{v:.6}");
    let s = s.trim_end_matches('0').trim_end_matches('.');
    s.to_string()
}

/// 1-2-5 values covering `lo..=hi` (positive), for a log axis.
pub fn log_ticks(lo: f64, hi: f64) -> Vec<f64> {
    let mut v = Vec::new();
    let mut e = lo.log10().floor() as i32 - 1;
    while 10f64.powi(e) <= hi * 10.0 && v.len() < 60 {
        for m in [1.0, 2.0, 5.0] {
            let x: f64 = format!("{:.3e}", m * 10f64.powi(e)).parse().unwrap();
            if x >= lo * (1.0 - 1e-9) && x <= hi * (1.0 + 1e-9) {
                v.push(x);
            }
        }
        e += 1;
    }
    if v.len() > 9 {
        // decades only
        v.retain(|x| (x.log10() - x.log10().round()).abs() < 1e-9);
    }
    v
}

/// About five round values covering `lo..=hi`, for a linear axis.
pub fn linear_ticks(lo: f64, hi: f64) -> Vec<f64> {
    let span = (hi - lo).max(1e-12);
    let raw = span / 5.0;
    let p = 10f64.powf(raw.log10().floor());
    let step = [1.0, 2.0, 2.5, 5.0, 10.0]
        .iter()
        .map(|m| m * p)
        .find(|s| span / s <= 6.0)
        .unwrap_or(10.0 * p);
    let mut v = Vec::new();
    let mut x = (lo / step).ceil() * step;
    while x <= hi + step * 1e-9 {
        v.push(if x.abs() < step * 1e-9 { 0.0 } else { x });
        x += step;
    }
    v
}

/// A linear coordinate whose ticks are exactly the given values.
struct Keyed {
    lo: f64,
    hi: f64,
    keys: Vec<f64>,
}

impl Ranged for Keyed {
    type FormatOption = DefaultFormatting;
    type ValueType = f64;
    fn map(&self, v: &f64, limit: (i32, i32)) -> i32 {
        let t = (v - self.lo) / (self.hi - self.lo).max(1e-300);
        limit.0 + (t * (limit.1 - limit.0) as f64).round() as i32
    }
    fn key_points<H: KeyPointHint>(&self, hint: H) -> Vec<f64> {
        if hint.weight().allow_light_points() || hint.max_num_points() == 0 {
            Vec::new()
        } else {
            self.keys.clone()
        }
    }
    fn range(&self) -> std::ops::Range<f64> {
        self.lo..self.hi
    }
}

impl Axis {
    fn keyed(&self) -> Keyed {
        Keyed {
            lo: self.t(self.range.0),
            hi: self.t(self.range.1),
            keys: self.ticks.iter().map(|&v| self.t(v)).collect(),
        }
    }
    fn t(&self, v: f64) -> f64 {
        if self.log {
            v.max(self.range.0).log10()
        } else {
            v
        }
    }
    /// `v` clamped into the axis (zeros on a log axis sit on its lower edge).
    fn c(&self, v: f64) -> f64 {
        self.t(v.clamp(self.range.0, self.range.1))
    }
    fn inv(&self, v: f64) -> f64 {
        if self.log {
            10f64.powf(v)
        } else {
            v
        }
    }
}

fn draw_marker<X, Y>(
    chart: &mut ChartContext<SVGBackend, Cartesian2d<X, Y>>,
    m: Marker,
    pts: &[(f64, f64)],
    c: RGBColor,
) -> PlotResult
where
    X: Ranged<ValueType = f64>,
    Y: Ranged<ValueType = f64>,
{
    let f = c.filled();
    let s = c.stroke_width(2);
    let p = pts.iter().copied();
    match m {
        Marker::Circle => {
            chart.draw_series(p.map(|q| Circle::new(q, 4, f)))?;
        }
        Marker::Square => {
            chart.draw_series(
                p.map(|q| EmptyElement::at(q) + Rectangle::new([(-4, -4), (4, 4)], f)),
            )?;
        }
        Marker::TriangleUp => {
            chart.draw_series(
                p.map(|q| EmptyElement::at(q) + Polygon::new(vec![(0, -5), (5, 4), (-5, 4)], f)),
            )?;
        }
        Marker::TriangleDown => {
            chart.draw_series(
                p.map(|q| EmptyElement::at(q) + Polygon::new(vec![(0, 5), (5, -4), (-5, -4)], f)),
            )?;
        }
        Marker::Diamond => {
            chart.draw_series(p.map(|q| {
                EmptyElement::at(q) + Polygon::new(vec![(0, -5), (5, 0), (0, 5), (-5, 0)], f)
            }))?;
        }
        Marker::Cross => {
            chart.draw_series(p.map(|q| {
                EmptyElement::at(q)
                    + PathElement::new(vec![(-4, -4), (4, 4)], s)
                    + PathElement::new(vec![(-4, 4), (4, -4)], s)
            }))?;
        }
        Marker::Plus => {
            chart.draw_series(p.map(|q| {
                EmptyElement::at(q)
                    + PathElement::new(vec![(-5, 0), (5, 0)], s)
                    + PathElement::new(vec![(0, -5), (0, 5)], s)
            }))?;
        }
    }
    Ok(())
}

fn legend_marker<DB: DrawingBackend>(
    area: &DrawingArea<DB, plotters::coord::Shift>,
    m: Marker,
    q: (i32, i32),
    c: RGBColor,
) -> Result<(), DrawingAreaErrorKind<DB::ErrorType>> {
    let (f, s) = (c.filled(), c.stroke_width(2));
    let e = EmptyElement::at(q);
    match m {
        Marker::Circle => area.draw(&(e + Circle::new((0, 0), 4, f))),
        Marker::Square => area.draw(&(e + Rectangle::new([(-4, -4), (4, 4)], f))),
        Marker::TriangleUp => area.draw(&(e + Polygon::new(vec![(0, -5), (5, 4), (-5, 4)], f))),
        Marker::TriangleDown => area.draw(&(e + Polygon::new(vec![(0, 5), (5, -4), (-5, -4)], f))),
        Marker::Diamond => {
            area.draw(&(e + Polygon::new(vec![(0, -5), (5, 0), (0, 5), (-5, 0)], f)))
        }
        Marker::Cross => area.draw(
            &(e + PathElement::new(vec![(-4, -4), (4, 4)], s)
                + PathElement::new(vec![(-4, 4), (4, -4)], s)),
        ),
        Marker::Plus => area.draw(
            &(e + PathElement::new(vec![(-5, 0), (5, 0)], s)
                + PathElement::new(vec![(0, -5), (0, 5)], s)),
        ),
    }
}

/// Draw `fig` to `path` as SVG.
pub fn draw(fig: &Figure, path: &Path) -> PlotResult {
    let n = fig.panels.len().max(1);
    let cols = if n >= 2 { 2 } else { 1 };
    let rows = n.div_ceil(cols);
    let legend_cols = if cols == 2 { 2 } else { 3 };
    let legend_rows = fig
        .panels
        .iter()
        .map(|p| (p.series.len() + usize::from(p.vline.is_some())).div_ceil(legend_cols))
        .max()
        .unwrap_or(0);
    let chart_h = 330u32;
    let panel_h = chart_h + 12 + 20 * legend_rows as u32;
    let height = 40 + panel_h * rows as u32;
    let root = SVGBackend::new(path, (WIDTH, height)).into_drawing_area();
    root.fill(&WHITE)?;
    let body = root.titled(&fig.title, ("sans-serif", 24))?;
    let areas = body.split_evenly((rows, cols));
    let (xa, ya) = (&fig.x, &fig.y);
    let grid = RGBColor(GRID.0, GRID.1, GRID.2);
    for (panel, area) in fig.panels.iter().zip(areas.iter()) {
        let (top, legend) = area.split_vertically(chart_h);
        let mut chart = ChartBuilder::on(&top)
            .caption(&panel.title, ("sans-serif", 19))
            .margin(8)
            .margin_right(16)
            .x_label_area_size(46)
            .y_label_area_size(64)
            .build_cartesian_2d(xa.keyed(), ya.keyed())?;
        chart
            .configure_mesh()
            .bold_line_style(grid)
            .light_line_style(WHITE)
            .axis_style(BLACK)
            .label_style(("sans-serif", 15))
            .axis_desc_style(("sans-serif", 16))
            .x_label_formatter(&|v| tick_label(xa.inv(*v), xa.percent))
            .y_label_formatter(&|v| tick_label(ya.inv(*v), ya.percent))
            .x_desc(&xa.desc)
            .y_desc(&ya.desc)
            .draw()?;
        for (i, s) in panel.series.iter().enumerate() {
            let (c, _) = style(i);
            if !s.band.is_empty() {
                let mut poly: Vec<(f64, f64)> =
                    s.band.iter().map(|b| (xa.c(b.0), ya.c(b.2))).collect();
                poly.extend(s.band.iter().rev().map(|b| (xa.c(b.0), ya.c(b.1))));
                chart.draw_series(std::iter::once(Polygon::new(poly, c.mix(0.15).filled())))?;
            }
        }
        for (i, s) in panel.series.iter().enumerate() {
            let (c, m) = style(i);
            let line: Vec<(f64, f64)> = s.line.iter().map(|p| (xa.c(p.0), ya.c(p.1))).collect();
            chart.draw_series(LineSeries::new(line, c.stroke_width(2)))?;
            let marks: Vec<(f64, f64)> = s.marks.iter().map(|p| (xa.c(p.0), ya.c(p.1))).collect();
            draw_marker(&mut chart, m, &marks, c)?;
        }
        if let Some((x, _)) = &panel.vline {
            let x = xa.c(*x);
            chart.draw_series(DashedLineSeries::new(
                [(x, ya.t(ya.range.0)), (x, ya.t(ya.range.1))],
                6,
                4,
                BLACK.stroke_width(1),
            ))?;
        }
        // the legend, under the panel: line, marker, label
        let w = area.dim_in_pixel().0 as i32;
        let col_w = (w - 70) / legend_cols as i32;
        let entries = panel.series.len() + usize::from(panel.vline.is_some());
        for k in 0..entries {
            let (x0, y0) = (
                64 + col_w * (k % legend_cols) as i32,
                10 + 20 * (k / legend_cols) as i32,
            );
            let text = if k < panel.series.len() {
                let (c, m) = style(k);
                legend.draw(&PathElement::new(
                    vec![(x0, y0), (x0 + 26, y0)],
                    c.stroke_width(2),
                ))?;
                legend_marker(&legend, m, (x0 + 13, y0), c)?;
                panel.series[k].label.clone()
            } else {
                legend.draw(&PathElement::new(
                    vec![(x0, y0), (x0 + 8, y0)],
                    BLACK.stroke_width(1),
                ))?;
                legend.draw(&PathElement::new(
                    vec![(x0 + 14, y0), (x0 + 22, y0)],
                    BLACK.stroke_width(1),
                ))?;
                panel.vline.as_ref().unwrap().1.clone()
            };
            legend.draw(&Text::new(
                text,
                (x0 + 32, y0 - 7),
                ("sans-serif", 16).into_font().color(&BLACK),
            ))?;
        }
    }
    root.present()?;
    Ok(())
}

/// Write a PNG beside each SVG with `rsvg-convert` (2,000 px wide) where it
/// is installed; without it, or if it fails, nothing (the SVGs are the
/// figures). Rendered to a temporary name and renamed, so an interrupted
/// render leaves no partial PNG.
pub fn png(svg: &Path) {
    let png = svg.with_extension("png");
    let tmp = svg.with_extension("png.partial");
    let ok = std::process::Command::new("rsvg-convert")
        .args(["-w", "2000", "-b", "white", "-o"])
        .arg(&tmp)
        .arg(svg)
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .status()
        .is_ok_and(|s| s.success());
    if !ok || std::fs::rename(&tmp, &png).is_err() {
        let _ = std::fs::remove_file(&tmp);
        let _ = std::fs::remove_file(&png);
    }
}
