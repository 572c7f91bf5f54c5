//! `tandem train`'s console: the run's events as rank 0 shows them — an indicatif bar on a
//! terminal (plain lines otherwise) with each epoch's line on stdout, and every other event's
//! line on stderr.
use std::io::IsTerminal;

use tandem::train::events::{Event, Logger};

/// Rank 0's bar and lines (the trainer reports world events on rank 0 only; a member joining a
/// live job reports its own).
#[derive(Default)]
pub struct Console {
    bar: Option<indicatif::ProgressBar>,
}

impl Console {
    pub fn new() -> Self {
        Console::default()
    }

    /// A bar over `total` steps at `done`, drawn on stdout (under the self-launch only rank
    /// 0's stdout reaches the terminal as is), or none when stdout is not a terminal.
    fn start_bar(&mut self, total: u64, done: u64) {
        if let Some(old) = self.bar.take() {
            old.finish_and_clear();
        }
        if !std::io::stdout().is_terminal() {
            return;
        }
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
        self.bar = Some(bar);
    }
}

impl Logger for Console {
    fn log(&mut self, event: &Event) -> std::io::Result<()> {
        match event {
            Event::Started { total, done } => self.start_bar(*total, *done),
            Event::Step(s) => {
                if let Some(bar) = &self.bar {
                    bar.set_position(s.global_step);
                    bar.set_message(format!("loss {:.4}", s.epoch_loss));
                }
            }
            Event::Finished(_) => {
                if let Some(bar) = self.bar.take() {
                    bar.finish_and_clear();
                }
            }
            Event::EpochEnded { .. } => {
                let Some(line) = event.line() else { return Ok(()) };
                match &self.bar {
                    Some(bar) => bar.println(line),
                    None => println!("{line}"),
                }
            }
            _ => {
                if let Some(line) = event.line() {
                    match &self.bar {
                        Some(bar) => bar.suspend(|| eprintln!("{line}")),
                        None => eprintln!("{line}"),
                    }
                }
            }
        }
        Ok(())
    }
}
