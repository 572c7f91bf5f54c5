//! For test binaries built with `harness = false` whose `main` is also the entry point of the
//! child processes they start (a child is recognised by an environment variable before any
//! test runs). That replaces "child entry points" written as `#[test]` functions, which pass by
//! doing nothing in a normal run. Output and filters are libtest's (libtest-mimic), and a test
//! that cannot run here is reported as ignored with `skipped: <reason>`, never as passed.
use std::process::ExitCode;

use libtest_mimic::{Arguments, Trial};

pub struct Test {
    name: &'static str,
    run: fn(),
    skip: Option<String>,
}

impl Test {
    pub fn new(name: &'static str, run: fn()) -> Test {
        Test { name, run, skip: None }
    }

    pub fn name(&self) -> &'static str {
        self.name
    }

    /// Not run (reported as ignored) when `reason` is `Some`.
    pub fn skip_if(mut self, reason: Option<String>) -> Test {
        self.skip = reason;
        self
    }
}

/// `tests![a, b, c]`: the test functions `a`, `b`, `c`, named as they are spelled.
#[macro_export]
macro_rules! tests {
    ($($f:ident),* $(,)?) => {
        vec![$($crate::harness::Test::new(stringify!($f), $f)),*]
    };
}

/// The skip reason for tests that need something this machine may lack (`why`), unless the
/// environment variable `require` is set (CI sets it): then the tests run anyway and fail,
/// saying why, instead of being skipped.
pub fn skip_unless_required(why: Option<String>, require: &str) -> Option<String> {
    match (why, std::env::var_os(require)) {
        (Some(reason), Some(_)) => {
            eprintln!("{require} is set but: {reason}");
            None
        }
        (why, _) => why,
    }
}

/// Why `mpirun` (OpenMPI) cannot be used here, if so.
pub fn mpirun_missing() -> Option<String> {
    match std::process::Command::new("mpirun").arg("--version").output() {
        Ok(o) if o.status.success() => None,
        _ => Some("no mpirun on PATH (Debian: apt install openmpi-bin libopenmpi-dev)".into()),
    }
}

/// Runs `tests` with libtest's command-line arguments; a panic fails its test.
pub fn main(tests: Vec<Test>) -> ExitCode {
    run(tests, Arguments::from_args())
}

/// Like [`main`], one test at a time unless `--test-threads` says otherwise: for tests that
/// time how fast something fails and start many processes each, which would otherwise
/// compete for the cores.
pub fn main_serial(tests: Vec<Test>) -> ExitCode {
    let mut args = Arguments::from_args();
    args.test_threads.get_or_insert(1);
    run(tests, args)
}

fn run(tests: Vec<Test>, args: Arguments) -> ExitCode {
    let trials = tests
        .into_iter()
        .map(|t| {
            if let Some(reason) = &t.skip {
                println!("skipped: {}: {reason}", t.name);
            }
            let run = t.run;
            Trial::test(t.name, move || {
                run();
                Ok(())
            })
            .with_ignored_flag(t.skip.is_some())
        })
        .collect();
    libtest_mimic::run(&args, trials).exit_code()
}
