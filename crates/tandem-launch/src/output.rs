//! Carrying a worker's stdout/stderr to where they belong: the launcher's console (whole lines,
//! optionally prefixed `[rank N] ` so ranks never interleave mid-line), a per-rank log file,
//! and, for stderr, a small buffer of the last lines for the failure summary.
//! One thread per stream: a blocking line reader is the simplest thing that keeps lines whole.
use std::collections::VecDeque;
use std::fs::File;
use std::io::{self, BufRead, BufReader, Read, Write};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;

/// The last `cap` lines of a stream.
#[derive(Debug)]
pub(crate) struct TailBuffer {
    lines: VecDeque<String>,
    cap: usize,
}

impl TailBuffer {
    pub(crate) fn new(cap: usize) -> Self {
        TailBuffer { lines: VecDeque::with_capacity(cap.min(64)), cap }
    }

    fn push(&mut self, line: String) {
        if self.cap == 0 {
            return;
        }
        if self.lines.len() == self.cap {
            self.lines.pop_front();
        }
        self.lines.push_back(line);
    }

    pub(crate) fn lines(&self) -> Vec<String> {
        self.lines.iter().cloned().collect()
    }
}

pub(crate) type SharedTail = Arc<Mutex<TailBuffer>>;

/// Which of the launcher's own streams console lines go to.
#[derive(Clone, Copy, Debug)]
pub(crate) enum Console {
    Stdout,
    Stderr,
}

/// Where one worker stream goes.
pub(crate) struct Sinks {
    /// Console stream and the prefix put before each line (empty for none).
    pub console: Option<(Console, Vec<u8>)>,
    pub file: Option<File>,
    pub tail: Option<SharedTail>,
}

fn write_console(console: Console, prefix: &[u8], line: &[u8]) {
    // One write per line under the stream's lock keeps lines of different ranks whole. Errors
    // (a closed pipe) are ignored: a worker must not die because nobody reads the launcher.
    let mut buf = Vec::with_capacity(prefix.len() + line.len() + 1);
    buf.extend_from_slice(prefix);
    buf.extend_from_slice(line);
    if !line.ends_with(b"\n") {
        buf.push(b'\n');
    }
    match console {
        Console::Stdout => {
            let mut out = io::stdout().lock();
            let _ = out.write_all(&buf).and_then(|_| out.flush());
        }
        Console::Stderr => {
            let _ = io::stderr().lock().write_all(&buf);
        }
    }
}

fn pump(reader: impl Read, mut sinks: Sinks) {
    let mut reader = BufReader::with_capacity(64 * 1024, reader);
    let mut line = Vec::new();
    loop {
        line.clear();
        match reader.read_until(b'\n', &mut line) {
            Ok(0) => break,
            Ok(_) => {}
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            Err(_) => break,
        }
        if let Some((console, prefix)) = &sinks.console {
            write_console(*console, prefix, &line);
        }
        if let Some(file) = &mut sinks.file {
            // A full disk must not stop the worker: drop the file and keep the console going.
            if file.write_all(&line).is_err() {
                sinks.file = None;
            }
        }
        if let Some(tail) = &sinks.tail {
            let text = String::from_utf8_lossy(&line).trim_end_matches(['\n', '\r']).to_string();
            if let Ok(mut t) = tail.lock() {
                t.push(text);
            }
        }
    }
    if let Some(mut file) = sinks.file {
        let _ = file.flush();
    }
}

/// Starts a thread that copies `reader` to `sinks` until end of file.
pub(crate) fn spawn_pump(
    name: String,
    reader: impl Read + Send + 'static,
    sinks: Sinks,
) -> io::Result<JoinHandle<()>> {
    std::thread::Builder::new().name(name).spawn(move || pump(reader, sinks))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tail_keeps_last_lines_and_file_gets_everything() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("err.log");
        let tail = Arc::new(Mutex::new(TailBuffer::new(2)));
        let input: &[u8] = b"one\ntwo\nthree\nno newline";
        let sinks = Sinks {
            console: None,
            file: Some(File::create(&path).unwrap()),
            tail: Some(tail.clone()),
        };
        spawn_pump("t".into(), input, sinks).unwrap().join().unwrap();
        assert_eq!(
            tail.lock().unwrap().lines(),
            vec!["three".to_string(), "no newline".to_string()]
        );
        assert_eq!(std::fs::read_to_string(&path).unwrap(), "one\ntwo\nthree\nno newline");
    }
}
