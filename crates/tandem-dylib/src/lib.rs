//! tandem-dylib: opening NVIDIA's shared libraries when a program first needs them, not at
//! start-up, so a `cuda` or `nccl` build starts on machines without them and says what to
//! install when a feature that needs one is used.
//!
//! A library is looked for by the names the system loader knows (`LD_LIBRARY_PATH`, the
//! ld.so cache, the binary's RUNPATH), then where pip's NVIDIA wheels put it inside every
//! Python `site-packages` that may hold them (the active venv or conda env, the interpreter
//! the tests use, the user's, the system's); an environment variable replaces the search with
//! one explicit file. Why not cudarc's loaders: candle builds cudarc with `dynamic-linking`,
//! cudarc refuses `dynamic-loading` beside it, and its loader panics when a library is missing.
//!
//! It knows nothing of what the libraries do: the callers (tandem-comm's NCCL backend,
//! tandem-cuda's cuDNN) resolve their own symbols.
use std::path::{Path, PathBuf};

/// Why a library could not be opened.
#[derive(Debug, thiserror::Error)]
pub enum DylibError {
    /// No candidate loaded; `tried` lists each with the loader's reason.
    #[error("{library} could not be loaded (tried: {tried}); {hint}")]
    NotFound { library: String, tried: String, hint: String },
    /// The library loaded but lacks a symbol the caller needs (a version too old).
    #[error("{path} has no symbol {symbol}: {reason} (too old?)")]
    MissingSymbol { path: String, symbol: String, reason: String },
}

/// Where one library is looked for and what to tell a user who has none.
#[derive(Clone, Copy, Debug)]
pub struct Search {
    /// What the library is, for messages ("NCCL", "cuDNN").
    pub what: &'static str,
    /// Names for the dynamic loader (LD_LIBRARY_PATH, the ld.so cache, the binary's RUNPATH).
    pub sonames: &'static [&'static str],
    /// Paths inside a Python `site-packages` where pip's NVIDIA wheels put the library.
    pub pip_paths: &'static [&'static str],
    /// An explicit file that replaces the whole search.
    pub env_var: &'static str,
    /// What to install, for the error.
    pub install: &'static str,
}

/// A loaded library and the candidate it came from.
pub struct Opened {
    pub library: libloading::Library,
    pub path: String,
}

impl Opened {
    /// The symbol `name` (without the trailing NUL) given the type `T`.
    ///
    /// # Safety
    /// `T` must be the symbol's true type (a function pointer with the C signature from the
    /// library's header); the value stays valid while the library is loaded.
    pub unsafe fn symbol<T: Copy>(&self, name: &str) -> Result<T, DylibError> {
        let c_name = format!("{name}\0");
        // SAFETY: the caller promises `T` is the symbol's type.
        match unsafe { self.library.get::<T>(c_name.as_bytes()) } {
            Ok(sym) => Ok(*sym),
            Err(e) => Err(DylibError::MissingSymbol {
                path: self.path.clone(),
                symbol: name.to_string(),
                reason: e.to_string(),
            }),
        }
    }
}

/// Opens the first candidate of `s` that loads; the error lists every place tried and why each
/// failed.
pub fn open_first(s: &Search) -> Result<Opened, DylibError> {
    let mut tried = Vec::new();
    for candidate in candidates(s) {
        // SAFETY: loading runs the library's initialisers; NVIDIA's libraries' are benign.
        match unsafe { libloading::Library::new(&candidate) } {
            Ok(library) => return Ok(Opened { library, path: candidate }),
            Err(e) => tried.push(format!("{candidate} ({})", dlerror_text(&candidate, &e))),
        }
    }
    Err(DylibError::NotFound {
        library: s.what.to_string(),
        tried: tried.join(", "),
        hint: s.install.to_string(),
    })
}

/// dlerror's words for one candidate, without the candidate's name it repeats.
fn dlerror_text(candidate: &str, e: &libloading::Error) -> String {
    use std::error::Error;
    let text = e.source().map_or_else(|| e.to_string(), |s| s.to_string());
    text.strip_prefix(candidate).map_or(text.clone(), |t| t.trim_start_matches(": ").to_string())
}

/// Every place `s` is looked for, in order.
pub fn candidates(s: &Search) -> Vec<String> {
    if let Some(p) = std::env::var_os(s.env_var) {
        return vec![p.to_string_lossy().into_owned()];
    }
    let mut out: Vec<String> = s.sonames.iter().map(|n| n.to_string()).collect();
    for sp in site_packages() {
        for rel in s.pip_paths {
            let p = sp.join(rel);
            if !out.iter().any(|o| Path::new(o) == p) {
                out.push(p.to_string_lossy().into_owned());
            }
        }
    }
    out
}

/// Python `site-packages` directories where pip may have put NVIDIA's wheels: the active venv
/// or conda env, the interpreter the tests use (TANDEM_PYTHON), the user's, the system's.
pub fn site_packages() -> Vec<PathBuf> {
    let mut roots: Vec<PathBuf> = Vec::new();
    for var in ["VIRTUAL_ENV", "CONDA_PREFIX"] {
        if let Some(v) = std::env::var_os(var) {
            roots.push(PathBuf::from(v));
        }
    }
    if let Some(py) = std::env::var_os("TANDEM_PYTHON") {
        // <venv>/bin/python -> <venv>
        if let Some(root) = Path::new(&py).parent().and_then(Path::parent) {
            roots.push(root.to_path_buf());
        }
    }
    if let Some(home) = std::env::var_os("HOME") {
        roots.push(Path::new(&home).join(".local"));
    }
    roots.extend(["/usr/local", "/usr"].map(PathBuf::from));
    let mut out = Vec::new();
    for root in roots {
        let Ok(entries) = std::fs::read_dir(root.join("lib")) else { continue };
        let mut pythons: Vec<PathBuf> = entries
            .flatten()
            .filter(|e| e.file_name().to_string_lossy().starts_with("python3"))
            .map(|e| e.path())
            .collect();
        pythons.sort();
        for py in pythons {
            for sub in ["site-packages", "dist-packages"] {
                let sp = py.join(sub);
                if sp.is_dir() && !out.contains(&sp) {
                    out.push(sp);
                }
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_missing_library_names_every_place_tried_and_what_to_install() {
        let s = Search {
            what: "NCCL",
            sonames: &["libtandem-no-such-nccl.so.2"],
            pip_paths: &["nvidia/no-such/libnccl.so.2"],
            env_var: "TANDEM_TEST_NO_SUCH_VAR",
            install: "install it with `pip install nvidia-nccl-cu13`, or point \
                      TANDEM_NCCL_LIBRARY at libnccl.so.2",
        };
        let Err(err) = open_first(&s) else {
            panic!("a library that does not exist must not load")
        };
        let msg = err.to_string();
        assert!(msg.contains("libtandem-no-such-nccl.so.2"), "{msg}");
        assert!(msg.contains("pip install nvidia-nccl-cu13"), "{msg}");
        assert!(msg.contains("TANDEM_NCCL_LIBRARY"), "{msg}");
    }

    #[test]
    fn an_explicit_path_replaces_the_search() {
        let s = Search {
            what: "cuDNN",
            sonames: &["libcudnn.so.9"],
            pip_paths: &["nvidia/cudnn/lib/libcudnn.so.9"],
            env_var: "TANDEM_TEST_DYLIB_EXPLICIT",
            install: "",
        };
        std::env::set_var("TANDEM_TEST_DYLIB_EXPLICIT", "/nowhere/libcudnn.so.9");
        assert_eq!(candidates(&s), ["/nowhere/libcudnn.so.9"]);
        std::env::remove_var("TANDEM_TEST_DYLIB_EXPLICIT");
        assert_eq!(candidates(&s)[0], "libcudnn.so.9");
    }
}
