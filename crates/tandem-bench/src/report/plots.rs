//! The report's PNGs, drawn with plotters' bitmap backend. Text uses the DejaVu Sans font
//! bundled next to this file (plotters' `ab_glyph` feature), so no system font library
//! (fontconfig/freetype) is needed on the machine that draws them.
use std::collections::BTreeMap;
use std::path::Path;

use anyhow::anyhow;
use plotters::prelude::*;
use plotters::style::text_anchor::{HPos, Pos, VPos};

use super::measure::size_label;
use super::stats::{short, sig, Figure, Summary};
use super::table::Table;

static FONT: &[u8] = include_bytes!("DejaVuSans.ttf");
const FAMILY: &str = "sans-serif";
const SIZE: (u32, u32) = (1100, 650);

pub fn register_font() -> anyhow::Result<()> {
    plotters::style::register_font(FAMILY, FontStyle::Normal, FONT)
        .map_err(|_| anyhow!("the bundled DejaVuSans.ttf is not a font plotters can read"))
}

fn color(contender: &str) -> RGBColor {
    match contender {
        // References: grey.
        c if ["memcpy", "dd", "plain", "fresh memory"].iter().any(|r| c.starts_with(r)) => {
            RGBColor(110, 110, 110)
        }
        c if c.contains("tcp") => RGBColor(31, 119, 180),
        c if c.starts_with("tandem") => RGBColor(44, 160, 44),
        _ => RGBColor(214, 39, 40),
    }
}

/// Measured rows grouped by contender, in first-seen order: (contender, [(x, summary)]).
fn series(t: &Table, x: impl Fn(f64) -> f64) -> Vec<(String, Vec<(f64, Summary)>)> {
    let mut order = Vec::new();
    let mut by: BTreeMap<String, Vec<(f64, Summary)>> = BTreeMap::new();
    for row in &t.rows {
        if let Figure::Measured(s) = &row.figure {
            if !by.contains_key(&row.contender) {
                order.push(row.contender.clone());
            }
            by.entry(row.contender.clone()).or_default().push((x(row.x), s.clone()));
        }
    }
    order
        .into_iter()
        .map(|c| {
            let v = by.remove(&c).unwrap_or_default();
            (c, v)
        })
        .collect()
}

fn err<E: std::fmt::Display>(path: &Path) -> impl Fn(E) -> anyhow::Error + '_ {
    move |e| anyhow!("drawing {}: {e}", path.display())
}

/// Draws the series' legend (labels at `font` px, at `position`) and writes the file.
fn legend_and_save<'a, DB, CT>(
    chart: &mut ChartContext<'a, DB, CT>,
    root: &DrawingArea<DB, plotters::coord::Shift>,
    font: u32,
    position: SeriesLabelPosition,
    path: &Path,
) -> anyhow::Result<()>
where
    DB: DrawingBackend + 'a,
    CT: CoordTranslate,
{
    let e = err(path);
    chart
        .configure_series_labels()
        .label_font((FAMILY, font))
        .background_style(WHITE.mix(0.85))
        .border_style(BLACK)
        .position(position)
        .draw()
        .map_err(&e)?;
    root.present().map_err(&e)
}

/// busbw vs message size, log-log: x is log2(bytes), labelled as sizes.
pub fn allreduce(t: &Table, nproc: usize, path: &Path) -> anyhow::Result<()> {
    let e = err(path);
    let lines = series(t, f64::log2);
    let all: Vec<&Summary> = lines.iter().flat_map(|(_, v)| v.iter().map(|(_, s)| s)).collect();
    let lo = all.iter().map(|s| s.min).filter(|v| *v > 0.0).fold(f64::INFINITY, f64::min);
    let hi = all.iter().map(|s| s.max).fold(0.0, f64::max);
    let (lo, hi) = if lo.is_finite() && hi > 0.0 { (lo / 2.0, hi * 2.0) } else { (1e-4, 10.0) };
    let xs: Vec<f64> = t.rows.iter().map(|r| r.x.log2()).collect();
    let (x0, x1) = (
        xs.iter().copied().fold(f64::INFINITY, f64::min) - 0.5,
        xs.iter().copied().fold(0.0, f64::max) + 0.5,
    );
    let root = BitMapBackend::new(path, SIZE).into_drawing_area();
    root.fill(&WHITE).map_err(&e)?;
    let mut chart = ChartBuilder::on(&root)
        .caption(
            format!("all_reduce busbw, {nproc} ranks (median; bars: min–max of the runs)"),
            (FAMILY, 24),
        )
        .margin(20)
        .x_label_area_size(50)
        .y_label_area_size(80)
        .build_cartesian_2d(x0..x1, (lo..hi).log_scale())
        .map_err(&e)?;
    chart
        .configure_mesh()
        .x_labels(16)
        .x_desc("message size")
        .y_desc("busbw, GB/s (log)")
        .x_label_formatter(&|x| {
            if (x - x.round()).abs() < 1e-6 && x.round() >= 0.0 {
                size_label(2f64.powi(x.round() as i32) as usize)
            } else {
                String::new()
            }
        })
        .y_label_formatter(&|y| short(*y))
        .label_style((FAMILY, 14))
        .draw()
        .map_err(&e)?;
    for (name, pts) in &lines {
        let c = color(name);
        let style = if name.starts_with("memcpy") { c.stroke_width(2) } else { c.stroke_width(3) };
        chart
            .draw_series(LineSeries::new(pts.iter().map(|(x, s)| (*x, s.median)), style))
            .map_err(&e)?
            .label(name.as_str())
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 24, y)], c.stroke_width(3)));
        chart
            .draw_series(pts.iter().map(|(x, s)| Circle::new((*x, s.median), 4, c.filled())))
            .map_err(&e)?;
        chart
            .draw_series(pts.iter().map(|(x, s)| {
                ErrorBar::new_vertical(*x, s.min, s.median, s.max, c.stroke_width(1), 8)
            }))
            .map_err(&e)?;
    }
    legend_and_save(&mut chart, &root, 16, SeriesLabelPosition::UpperLeft, path)
}

/// samples/s vs ranks; the plain single-process reference as a horizontal line.
pub fn ddp(t: &Table, title: &str, path: &Path) -> anyhow::Result<()> {
    let e = err(path);
    let lines = series(t, |x| x);
    let ranks: Vec<f64> = t.rows.iter().map(|r| r.x).filter(|x| *x > 0.0).collect();
    let max_rank = ranks.iter().copied().fold(1.0, f64::max);
    let hi =
        lines.iter().flat_map(|(_, v)| v.iter().map(|(_, s)| s.max)).fold(0.0, f64::max).max(1.0)
            * 1.25;
    let root = BitMapBackend::new(path, SIZE).into_drawing_area();
    root.fill(&WHITE).map_err(&e)?;
    let mut chart = ChartBuilder::on(&root)
        .caption(format!("DDP training throughput, {title} (median; bars: min–max)"), (FAMILY, 24))
        .margin(20)
        .x_label_area_size(50)
        .y_label_area_size(80)
        .build_cartesian_2d(0.5..max_rank + 0.5, 0.0..hi)
        .map_err(&e)?;
    let ranks_for_labels = ranks.clone();
    chart
        .configure_mesh()
        .x_labels(2 * max_rank as usize + 2)
        .x_desc("ranks (processes)")
        .y_desc("samples/s")
        .x_label_formatter(&move |x| {
            if ranks_for_labels.iter().any(|r| (r - x).abs() < 1e-6) {
                format!("{}", x.round())
            } else {
                String::new()
            }
        })
        .y_label_formatter(&|y| format!("{y:.0}"))
        .label_style((FAMILY, 14))
        .draw()
        .map_err(&e)?;
    for (name, pts) in &lines {
        let c = color(name);
        if pts.iter().all(|(x, _)| *x == 0.0) {
            // The reference: one figure, drawn across the whole x range.
            let Some((_, s)) = pts.first() else { continue };
            let m = s.median;
            chart
                .draw_series(LineSeries::new([(0.5, m), (max_rank + 0.5, m)], c.stroke_width(2)))
                .map_err(&e)?
                .label(format!("{name} (reference)"))
                .legend(move |(x, y)| {
                    PathElement::new(vec![(x, y), (x + 24, y)], c.stroke_width(2))
                });
            continue;
        }
        chart
            .draw_series(LineSeries::new(
                pts.iter().map(|(x, s)| (*x, s.median)),
                c.stroke_width(3),
            ))
            .map_err(&e)?
            .label(name.as_str())
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 24, y)], c.stroke_width(3)));
        chart
            .draw_series(pts.iter().map(|(x, s)| Circle::new((*x, s.median), 5, c.filled())))
            .map_err(&e)?;
        chart
            .draw_series(pts.iter().map(|(x, s)| {
                ErrorBar::new_vertical(*x, s.min, s.median, s.max, c.stroke_width(1), 10)
            }))
            .map_err(&e)?;
    }
    legend_and_save(&mut chart, &root, 16, SeriesLabelPosition::UpperRight, path)
}

/// One horizontal bar per row (saves, then loads), each labelled with its figure and ratio.
pub fn ckpt(t: &Table, path: &Path) -> anyhow::Result<()> {
    let e = err(path);
    let n = t.rows.len().max(1);
    let measured = || {
        t.rows.iter().filter_map(|r| match &r.figure {
            Figure::Measured(s) => Some(s),
            _ => None,
        })
    };
    // Log scale: lazy (mmap) loads land orders of magnitude above disk-bound saves.
    let hi = measured().map(|s| s.max).fold(0.0, f64::max).max(1e-3);
    let lo = measured().map(|s| s.min).filter(|v| *v > 0.0).fold(hi, f64::min) / 3.0;
    let root = BitMapBackend::new(path, SIZE).into_drawing_area();
    root.fill(&WHITE).map_err(&e)?;
    let mut chart = ChartBuilder::on(&root)
        .caption("checkpoint save / load throughput (median; bars: min–max)", (FAMILY, 24))
        .margin(20)
        .x_label_area_size(50)
        .y_label_area_size(10)
        .build_cartesian_2d((lo..hi * 300.0).log_scale(), -0.6..(n as f64 - 0.4))
        .map_err(&e)?;
    chart
        .configure_mesh()
        .disable_y_mesh()
        .y_labels(0)
        .x_desc("GB/s (1e9 B/s, log scale)")
        .x_label_formatter(&|x| short(*x))
        .label_style((FAMILY, 14))
        .draw()
        .map_err(&e)?;
    let label = TextStyle::from((FAMILY, 15).into_font()).pos(Pos::new(HPos::Left, VPos::Center));
    for (i, row) in t.rows.iter().enumerate() {
        let y = (n - 1 - i) as f64;
        let c = color(&row.contender);
        let name = format!("{}: {}", row.case, row.contender);
        match &row.figure {
            Figure::Measured(s) => {
                chart
                    .draw_series([Rectangle::new(
                        [(lo, y - 0.32), (s.median, y + 0.32)],
                        c.mix(0.8).filled(),
                    )])
                    .map_err(&e)?;
                chart
                    .draw_series([ErrorBar::new_horizontal(
                        y,
                        s.min,
                        s.median,
                        s.max,
                        BLACK.stroke_width(1),
                        8,
                    )])
                    .map_err(&e)?;
                let ratio =
                    row.over_reference().map(|r| format!(", {r:.2}× dd")).unwrap_or_default();
                chart
                    .draw_series([Text::new(
                        format!("{name}  {} GB/s{ratio}", sig(s.median)),
                        (s.max * 1.15, y),
                        label.clone(),
                    )])
                    .map_err(&e)?;
            }
            Figure::Missing(why) => {
                chart
                    .draw_series([Text::new(
                        format!("{name}  ({why})"),
                        (lo * 1.15, y),
                        label.clone(),
                    )])
                    .map_err(&e)?;
            }
        }
    }
    root.present().map_err(&e)?;
    Ok(())
}

/// What a face-scale plot shows on its y axis.
#[derive(Clone, Copy)]
pub enum FaceScaleAxis {
    SamplesPerS,
    PeakGiB,
}

/// `tandem bench face-scale`'s runs: x = ranks, one line per side and class count (tandem
/// green, PyTorch red; thicker for more classes); failed runs are left out of their line.
pub fn face_scale(
    r: &crate::face_scale::Results,
    axis: FaceScaleAxis,
    path: &Path,
) -> anyhow::Result<()> {
    let e = err(path);
    let value = |p: &crate::face_scale::Point| match axis {
        FaceScaleAxis::SamplesPerS => p.samples_per_s,
        FaceScaleAxis::PeakGiB => p.peak_rss_bytes.map(|b| b / (1u64 << 30) as f64),
    };
    let mut classes: Vec<usize> = r.scaling.iter().map(|p| p.classes).collect();
    classes.sort_unstable();
    classes.dedup();
    let max_rank = r.scaling.iter().map(|p| p.ranks).max().unwrap_or(1) as f64;
    let hi = r.scaling.iter().filter_map(value).fold(0.0, f64::max).max(1e-3) * 1.25;
    let (caption, y_desc) = match axis {
        FaceScaleAxis::SamplesPerS => ("Face recipe samples/s by ranks and head size", "samples/s"),
        FaceScaleAxis::PeakGiB => {
            ("Face recipe peak memory of the largest rank", "peak resident memory per rank (GiB)")
        }
    };
    let root = BitMapBackend::new(path, SIZE).into_drawing_area();
    root.fill(&WHITE).map_err(&e)?;
    let mut chart = ChartBuilder::on(&root)
        .caption(caption, (FAMILY, 24))
        .margin(20)
        .x_label_area_size(50)
        .y_label_area_size(80)
        .build_cartesian_2d(0.5..max_rank + 0.5, 0.0..hi)
        .map_err(&e)?;
    chart
        .configure_mesh()
        .x_labels(max_rank as usize + 1)
        .x_desc("ranks (processes; 2 cores: 4 ranks oversubscribe)")
        .y_desc(y_desc)
        .x_label_formatter(&|x| {
            if (x - x.round()).abs() < 1e-6 && *x >= 1.0 {
                format!("{}", x.round())
            } else {
                String::new()
            }
        })
        .y_label_formatter(&|y| format!("{y:.1}"))
        .label_style((FAMILY, 14))
        .draw()
        .map_err(&e)?;
    for side in crate::face_scale::SIDES {
        for (i, &c) in classes.iter().enumerate() {
            let pts: Vec<(f64, f64)> = r
                .scaling
                .iter()
                .filter(|p| p.side == side && p.classes == c)
                .filter_map(|p| value(p).map(|v| (p.ranks as f64, v)))
                .collect();
            if pts.is_empty() {
                continue;
            }
            let base = color(if side == "tandem" { "tandem" } else { "torch" });
            let width = 1 + i as u32 * 2;
            let shade = base.mix(1.0 - 0.2 * (classes.len() - 1 - i) as f64);
            chart
                .draw_series(LineSeries::new(pts.clone(), shade.stroke_width(width)))
                .map_err(&e)?
                .label(format!("{side}, {c} classes"))
                .legend(move |(x, y)| {
                    PathElement::new(vec![(x, y), (x + 24, y)], shade.stroke_width(width))
                });
            chart
                .draw_series(pts.iter().map(|&(x, y)| Circle::new((x, y), 4, shade.filled())))
                .map_err(&e)?;
        }
    }
    legend_and_save(&mut chart, &root, 14, SeriesLabelPosition::UpperRight, path)
}
