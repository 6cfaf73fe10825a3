//! The loss curve of a run as a PNG (plotters).
use std::path::Path;

use plotters::prelude::*;

use crate::run::StepReport;
use crate::{Error, Result};

/// Draws the objective per step (light) and its moving average over 1% of the steps (dark),
/// with the expected acceptance length on a second panel, into `path` (PNG, 900 x 600). Axis
/// labels need a TrueType font (DejaVu Sans from the system); without one the curves are
/// drawn without text.
///
/// # Errors
/// [`Error::State`] naming `path` when it cannot be drawn or written.
pub fn loss_curve(reports: &[StepReport], path: &Path) -> Result<()> {
    draw(reports, path, font_registered()).map_err(|e| Error::State { path: path.into(), message: e.to_string() })
}

fn font_registered() -> bool {
    static REGISTERED: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *REGISTERED.get_or_init(|| {
        let font = ["/usr/share/fonts/truetype/dejavu/DejaVuSans.ttf", "/usr/share/fonts/TTF/DejaVuSans.ttf"]
            .iter()
            .find_map(|p| std::fs::read(p).ok());
        match font {
            Some(bytes) => {
                let bytes: &'static [u8] = Box::leak(bytes.into_boxed_slice());
                plotters::style::register_font("sans-serif", FontStyle::Normal, bytes).is_ok()
            }
            None => false,
        }
    })
}

fn smooth(ys: &[f64]) -> Vec<f64> {
    let w = (ys.len() / 100).max(1);
    (0..ys.len())
        .map(|i| {
            let lo = i.saturating_sub(w - 1);
            ys[lo..=i].iter().sum::<f64>() / (i - lo + 1) as f64
        })
        .collect()
}

fn draw(reports: &[StepReport], path: &Path, labels: bool) -> std::result::Result<(), Box<dyn std::error::Error>> {
    let root = BitMapBackend::new(path, (900, 600)).into_drawing_area();
    root.fill(&WHITE)?;
    let (top, bottom) = root.split_vertically(360);
    let steps = reports.last().map_or(1, |r| r.step).max(1) as f64;
    for (area, what, values) in [
        (&top, "loss", reports.iter().map(|r| r.loss).collect::<Vec<_>>()),
        (&bottom, "expected tau", reports.iter().map(|r| r.expected_tau).collect::<Vec<_>>()),
    ] {
        let hi = values.iter().cloned().fold(f64::MIN, f64::max).max(1e-6) * 1.05;
        let lo = values.iter().cloned().fold(f64::MAX, f64::min).min(0.0);
        let mut b = ChartBuilder::on(area);
        b.margin(15).x_label_area_size(35).y_label_area_size(50);
        let mut chart = b.build_cartesian_2d(0f64..steps, lo..hi)?;
        if labels {
            chart.configure_mesh().x_desc("step").y_desc(what).draw()?;
        } else {
            chart.configure_mesh().x_labels(0).y_labels(0).draw()?;
        }
        let xs: Vec<f64> = reports.iter().map(|r| r.step as f64).collect();
        chart.draw_series(LineSeries::new(xs.iter().cloned().zip(values.iter().cloned()), RGBColor(170, 190, 230)))?;
        chart.draw_series(LineSeries::new(xs.iter().cloned().zip(smooth(&values)), BLUE.stroke_width(2)))?;
    }
    root.present()?;
    Ok(())
}
