//! The report's unit of result: a row per (case, contender) holding the repeated runs' summary,
//! the in-run reference it is divided by, and the PyTorch figure it is compared with.
use super::stats::Figure;

pub struct Row {
    /// Position on the plot's x axis (message bytes, ranks, bar index).
    pub x: f64,
    /// What was measured: "1 MiB", "2 ranks", "save".
    pub case: String,
    pub contender: String,
    pub figure: Figure,
    /// Median of this case's reference (memcpy, plain training, dd), measured in the same run.
    pub reference: Option<f64>,
    /// Median of PyTorch's figure on the same case, for the "x PyTorch" column.
    pub torch: Option<f64>,
}

impl Row {
    pub fn over_reference(&self) -> Option<f64> {
        Some(self.figure.median()? / self.reference?)
    }
    pub fn over_torch(&self) -> Option<f64> {
        Some(self.figure.median()? / self.torch?)
    }
}

pub struct Table {
    pub unit: &'static str,
    pub reference_name: &'static str,
    pub rows: Vec<Row>,
}

impl Table {
    pub fn find(&self, case: &str, contender: &str) -> Option<&Row> {
        self.rows.iter().find(|r| r.case == case && r.contender == contender)
    }
}
