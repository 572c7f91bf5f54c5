//! `tandem bench face-scale`: the face recipe's cost as its head and its world grow, on both
//! sides (tandem and the PyTorch peer, arcface_torch's PartialFC v2), one run per point:
//!
//! * **the largest head** each side trains on this machine with `--bisect-ranks` ranks: a
//!   geometric bisection over the class count between `--lo` (must train) and `--hi`, each probe
//!   a run of `--steps` steps; a probe fails when the run does not finish (how it ended is kept:
//!   the kernel's OOM killer, an allocation error);
//! * **scaling**: samples/s and the largest rank's peak memory for every rank count in
//!   `--ranks` and class count in `--classes` plus tandem's largest head.
//!
//! Everything goes to one JSON file (`--out`), which `tandem bench report` turns into tables
//! and plots without rerunning it (a full run takes an hour on a 2-core machine).
use std::path::{Path, PathBuf};

use anyhow::{bail, Context};
use serde::{Deserialize, Serialize};

use crate::face::{FaceRun, Outcome};

#[derive(clap::Args)]
pub struct Args {
    #[arg(long, default_value = "iresnet18", value_parser = ["iresnet18", "iresnet34", "iresnet50", "iresnet100"])]
    model: String,
    #[arg(long, default_value_t = 64)]
    width: usize,
    #[arg(long, default_value_t = 512)]
    embedding: usize,
    #[arg(long, default_value_t = 0.1)]
    sample_rate: f64,
    /// Images per rank per step.
    #[arg(long, default_value_t = 8)]
    batch: usize,
    /// Optimizer steps per run (the first is warm-up in both sides' samples/s).
    #[arg(long, default_value_t = 4)]
    steps: u64,
    /// Rank counts of the scaling runs (comma-separated).
    #[arg(long, default_value = "1,2,4", value_delimiter = ',')]
    ranks: Vec<usize>,
    /// Class counts of the scaling runs (tandem's largest head is added).
    #[arg(long, default_value = "100000,1000000", value_delimiter = ',')]
    classes: Vec<usize>,
    /// Ranks of the largest-head search.
    #[arg(long, default_value_t = 2)]
    bisect_ranks: usize,
    /// A class count both sides train (the search's lower end).
    #[arg(long, default_value_t = 1_000_000)]
    lo: usize,
    /// A class count above what either side trains (the search's upper end).
    #[arg(long, default_value_t = 32_000_000)]
    hi: usize,
    /// Stop the search when hi / lo is below 1 + this.
    #[arg(long, default_value_t = 0.1)]
    resolution: f64,
    /// Skip the search (scaling runs only, at the given class counts).
    #[arg(long)]
    no_search: bool,
    /// Where the results go.
    #[arg(long, default_value = "docs/face_scale.json")]
    out: PathBuf,
    #[arg(long)]
    dir: Option<PathBuf>,
    #[arg(long)]
    python: Option<PathBuf>,
}

/// One run of one side.
#[derive(Serialize, Deserialize, Clone, Debug)]
pub struct Point {
    pub side: String,
    pub ranks: usize,
    pub classes: usize,
    /// None: the run failed (see `failure`).
    pub samples_per_s: Option<f64>,
    pub peak_rss_bytes: Option<f64>,
    pub failure: Option<String>,
}

/// A side's largest head: the largest class count that trained and the smallest that did not.
#[derive(Serialize, Deserialize, Clone, Debug)]
pub struct Largest {
    pub side: String,
    pub ranks: usize,
    pub trains: usize,
    pub fails: usize,
    /// How the run at `fails` ended.
    pub failure: String,
    /// Every probe, in order.
    pub probes: Vec<Point>,
}

#[derive(Serialize, Deserialize, Clone, Debug)]
pub struct Results {
    pub date: String,
    pub git_commit: String,
    pub recipe: String,
    pub memory: String,
    pub largest: Vec<Largest>,
    pub scaling: Vec<Point>,
}

pub const SIDES: [&str; 2] = ["tandem", "PyTorch"];

fn point(side: &str, ranks: usize, classes: usize, o: Outcome) -> Point {
    match o {
        Outcome::Ran(s) => Point {
            side: side.into(),
            ranks,
            classes,
            samples_per_s: Some(s.samples_per_s),
            peak_rss_bytes: Some(s.peak_rss),
            failure: None,
        },
        Outcome::Failed(why) => Point {
            side: side.into(),
            ranks,
            classes,
            samples_per_s: None,
            peak_rss_bytes: None,
            failure: Some(why),
        },
    }
}

fn run_side(recipe: &FaceRun, side: &str, dir: &Path) -> anyhow::Result<Point> {
    let out = dir.join(format!("run-{}-{}", recipe.nproc, recipe.classes));
    let outcome = if side == "tandem" { recipe.tandem(&out)? } else { recipe.pytorch()? };
    std::fs::remove_dir_all(&out).ok();
    let p = point(side, recipe.nproc, recipe.classes, outcome);
    match (&p.samples_per_s, &p.failure) {
        (Some(s), _) => eprintln!(
            "  {side} {} ranks {} classes: {s:.2} samples/s, peak {:.2} GiB",
            p.ranks,
            p.classes,
            p.peak_rss_bytes.unwrap_or(0.0) / (1u64 << 30) as f64
        ),
        (None, Some(why)) => {
            eprintln!("  {side} {} ranks {} classes: failed: {why}", p.ranks, p.classes)
        }
        _ => {}
    }
    Ok(p)
}

/// The side's largest trainable head by geometric bisection between `lo` and `hi`.
fn search(
    base: &FaceRun,
    side: &str,
    args: &Args,
    dir: &Path,
    python: &Path,
) -> anyhow::Result<Largest> {
    let (mut lo, mut hi) = (args.lo, args.hi);
    let mut probes = Vec::new();
    let mut at = |classes: usize| -> anyhow::Result<Point> {
        let r = with_size(base, python, args.bisect_ranks, classes)?.prepare(dir, 64)?;
        let p = run_side(&r, side, dir)?;
        std::fs::remove_file(&r.init).ok();
        probes.push(p.clone());
        Ok(p)
    };
    let first = at(lo)?;
    if let Some(why) = first.failure {
        bail!("{side} does not train the search's lower end ({lo} classes): {why}");
    }
    let top = at(hi)?;
    let Some(mut failure) = top.failure else {
        bail!("{side} trains the search's upper end ({hi} classes): raise --hi")
    };
    while (hi as f64) / (lo as f64) > 1.0 + args.resolution {
        // The geometric middle, rounded to a thousand classes.
        let mid = (((lo as f64) * (hi as f64)).sqrt() / 1000.0).round() as usize * 1000;
        if mid <= lo || mid >= hi {
            break;
        }
        let p = at(mid)?;
        match p.failure {
            None => lo = mid,
            Some(why) => {
                hi = mid;
                failure = why;
            }
        }
    }
    Ok(Largest {
        side: side.into(),
        ranks: args.bisect_ranks,
        trains: lo,
        fails: hi,
        failure,
        probes,
    })
}

fn with_size(
    base: &FaceRun,
    python: &Path,
    ranks: usize,
    classes: usize,
) -> anyhow::Result<FaceRun> {
    Ok(FaceRun {
        nproc: ranks,
        classes,
        model: base.model.clone(),
        width: base.width,
        embedding: base.embedding,
        sample_rate: base.sample_rate,
        batch: base.batch,
        steps: base.steps,
        torch_workers: 0,
        // A head of millions of classes checkpoints to tens of GiB: the runs measure training.
        checkpoints: false,
        ..FaceRun::new(python)?
    })
}

pub fn main(args: Args) -> anyhow::Result<i32> {
    if args.ranks.is_empty() || args.ranks.contains(&0) || args.lo == 0 || args.hi <= args.lo {
        bail!("--ranks must be at least 1 each, and 0 < --lo < --hi");
    }
    let python = crate::ckpt::find_python(args.python.clone()).context(
        "no Python with torch for the PyTorch side (--python, $TANDEM_PYTHON or ./.venv-torch)",
    )?;
    let results = crate::in_scratch_dir(args.dir.as_deref(), "bench-face-scale", |dir| {
        measure(&args, &python, dir)
    })?;
    let text = serde_json::to_string_pretty(&results)?;
    if let Some(parent) = args.out.parent() {
        std::fs::create_dir_all(parent).ok();
    }
    std::fs::write(&args.out, text).with_context(|| format!("writing {}", args.out.display()))?;
    print!("{}", render(&results));
    eprintln!("written to {}", args.out.display());
    Ok(0)
}

fn measure(args: &Args, python: &Path, dir: &Path) -> anyhow::Result<Results> {
    let base = FaceRun {
        model: args.model.clone(),
        width: args.width,
        embedding: args.embedding,
        sample_rate: args.sample_rate,
        batch: args.batch,
        steps: args.steps,
        ..FaceRun::new(python)?
    };
    let mut largest = Vec::new();
    if !args.no_search {
        for side in SIDES {
            eprintln!("largest head, {side}, {} ranks:", args.bisect_ranks);
            largest.push(search(&base, side, args, dir, python)?);
        }
    }
    let mut classes = args.classes.clone();
    if let Some(l) = largest.iter().find(|l| l.side == "tandem") {
        classes.push(l.trains);
    }
    let mut scaling = Vec::new();
    for &c in &classes {
        for &ranks in &args.ranks {
            let r = with_size(&base, python, ranks, c)?.prepare(dir, 64)?;
            eprintln!("scaling: {ranks} ranks, {c} classes:");
            for side in SIDES {
                scaling.push(run_side(&r, side, dir)?);
            }
            std::fs::remove_file(&r.init).ok();
        }
    }
    let machine = crate::report::machine::Machine::probe(&crate::report::repo_root());
    Ok(Results {
        date: machine.date_utc,
        git_commit: machine.git_commit,
        recipe: format!(
            "{} width {} embedding {}, 112x112, batch {} per rank, PartialFC sample rate {}, {} steps per run",
            args.model, args.width, args.embedding, args.batch, args.sample_rate, args.steps
        ),
        memory: machine.memory,
        largest,
        scaling,
    })
}

/// The results as markdown: the largest heads, then the scaling table.
pub fn render(r: &Results) -> String {
    let gib = |b: f64| b / (1u64 << 30) as f64;
    let mut s = format!(
        "Face recipe at scale ({}), measured {} at {} on a machine with {} of memory by `tandem bench face-scale`.\n\n",
        r.recipe, r.date, r.git_commit, r.memory
    );
    if !r.largest.is_empty() {
        s += "| largest head | ranks | trains | fails at | how the larger run failed |\n|---|--:|--:|--:|---|\n";
        for l in &r.largest {
            s += &format!(
                "| {} | {} | {} | {} | {} |\n",
                l.side,
                l.ranks,
                l.trains,
                l.fails,
                l.failure.replace('|', "/")
            );
        }
        let get = |side: &str| r.largest.iter().find(|l| l.side == side).map(|l| l.trains as f64);
        if let (Some(t), Some(p)) = (get("tandem"), get("PyTorch")) {
            s += &format!("\ntandem / PyTorch largest head: {:.2}x\n", t / p);
        }
        s += "\n";
    }
    s += "| classes | ranks | tandem samples/s | PyTorch samples/s | × PyTorch | tandem peak GiB/rank | PyTorch peak GiB/rank | × PyTorch |\n|--:|--:|--:|--:|--:|--:|--:|--:|\n";
    let mut keys: Vec<(usize, usize)> = r.scaling.iter().map(|p| (p.classes, p.ranks)).collect();
    keys.dedup();
    for (classes, ranks) in keys {
        let get = |side: &str| {
            r.scaling.iter().find(|p| p.side == side && p.classes == classes && p.ranks == ranks)
        };
        let (t, p) = (get("tandem"), get("PyTorch"));
        let sps = |p: Option<&Point>| match p {
            Some(Point { samples_per_s: Some(v), .. }) => format!("{v:.3}"),
            _ => "fails".into(),
        };
        let mem = |p: Option<&Point>| match p {
            Some(Point { peak_rss_bytes: Some(v), .. }) => format!("{:.2}", gib(*v)),
            _ => "–".into(),
        };
        let ratio = |a: Option<f64>, b: Option<f64>| match (a, b) {
            (Some(a), Some(b)) if b > 0.0 => format!("{:.2}", a / b),
            _ => "–".into(),
        };
        let (ts, ps) = (t.and_then(|p| p.samples_per_s), p.and_then(|p| p.samples_per_s));
        let (tm, pm) = (t.and_then(|p| p.peak_rss_bytes), p.and_then(|p| p.peak_rss_bytes));
        s += &format!(
            "| {classes} | {ranks} | {} | {} | {} | {} | {} | {} |\n",
            sps(t),
            sps(p),
            ratio(ts, ps),
            mem(t),
            mem(p),
            ratio(tm, pm)
        );
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    fn p(side: &str, ranks: usize, classes: usize, sps: Option<f64>, gib: Option<f64>) -> Point {
        Point {
            side: side.into(),
            ranks,
            classes,
            samples_per_s: sps,
            peak_rss_bytes: gib.map(|g| g * (1u64 << 30) as f64),
            failure: sps.is_none().then(|| "exit status 137".into()),
        }
    }

    /// The table's ratios are tandem / PyTorch of the printed figures; a failed run reads
    /// "fails" with no ratio; the largest heads' ratio is of the class counts that trained.
    #[test]
    fn the_table_shows_ratios_and_failures() {
        let r = Results {
            date: "d".into(),
            git_commit: "c".into(),
            recipe: "r".into(),
            memory: "23.5 GiB".into(),
            largest: vec![
                Largest {
                    side: "tandem".into(),
                    ranks: 2,
                    trains: 4_000_000,
                    fails: 4_400_000,
                    failure: "oom | x".into(),
                    probes: vec![],
                },
                Largest {
                    side: "PyTorch".into(),
                    ranks: 2,
                    trains: 2_000_000,
                    fails: 2_200_000,
                    failure: "oom".into(),
                    probes: vec![],
                },
            ],
            scaling: vec![
                p("tandem", 2, 100_000, Some(3.0), Some(2.0)),
                p("PyTorch", 2, 100_000, Some(2.0), Some(4.0)),
                p("tandem", 2, 4_000_000, Some(1.0), Some(10.0)),
                p("PyTorch", 2, 4_000_000, None, None),
            ],
        };
        let md = render(&r);
        assert!(md.contains("| tandem | 2 | 4000000 | 4400000 | oom / x |"), "{md}");
        assert!(md.contains("largest head: 2.00x"), "{md}");
        assert!(md.contains("| 100000 | 2 | 3.000 | 2.000 | 1.50 | 2.00 | 4.00 | 0.50 |"), "{md}");
        assert!(md.contains("| 4000000 | 2 | 1.000 | fails | – | 10.00 | – | – |"), "{md}");
    }
}
