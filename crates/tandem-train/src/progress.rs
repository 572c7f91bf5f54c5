//! Rank 0's progress display for the training loops.
use std::io::IsTerminal;

/// Rank 0's progress: an indicatif bar on a terminal, plain lines otherwise; silent elsewhere.
pub struct Progress {
    bar: Option<indicatif::ProgressBar>,
    enabled: bool,
}

impl Progress {
    pub fn new(enabled: bool, total: u64, done: u64) -> Self {
        // Drawn on stdout: under the self-launch only rank 0's stdout reaches the terminal as is.
        let bar = (enabled && std::io::stdout().is_terminal()).then(|| {
            let bar = indicatif::ProgressBar::with_draw_target(
                Some(total),
                indicatif::ProgressDrawTarget::stdout(),
            );
            bar.set_style(
                indicatif::ProgressStyle::with_template(
                    "{bar:40} {pos}/{len} steps  {msg}  [{elapsed_precise} < {eta_precise}]",
                )
                .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar()),
            );
            bar.set_position(done);
            bar
        });
        Progress { bar, enabled }
    }

    pub fn step(&self, step: u64, loss: f64) {
        if let Some(bar) = &self.bar {
            bar.set_position(step);
            bar.set_message(format!("loss {loss:.4}"));
        }
    }

    pub fn line(&self, text: &str) {
        if !self.enabled {
            return;
        }
        match &self.bar {
            Some(bar) => bar.println(text),
            None => println!("{text}"),
        }
    }

    pub fn finish(&self) {
        if let Some(bar) = &self.bar {
            bar.finish_and_clear();
        }
    }
}
