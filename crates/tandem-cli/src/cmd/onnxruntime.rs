//! Any ONNX face model through ONNX Runtime (`tandem eval ijb --runtime onnxruntime`): the graph
//! runs as it was written, so models tandem did not export (insightface's model zoo, a team's
//! own `torch.onnx.export`) are evaluated as they are. ONNX Runtime is loaded at run time, as
//! NCCL is (the `ort` crate's `load-dynamic`: nothing downloaded or linked at build time), from
//! `ORT_DYLIB_PATH`, else from the `onnxruntime` pip package of `TANDEM_PYTHON` or `python3`.
use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{bail, Context};
use ort::session::Session;
use ort::value::Tensor;

/// An ONNX model's session: `[N, 3, H, W]` float images in, `[N, D]` embeddings out.
pub struct OrtEmbedder {
    session: Session,
    shown: String,
}

impl OrtEmbedder {
    /// Loads ONNX Runtime and the model at `path`.
    pub fn open(path: &Path) -> anyhow::Result<Self> {
        let library = library()?;
        let shown = path.display().to_string();
        let env = ort::init_from(&library)
            .with_context(|| format!("loading ONNX Runtime from {}", library.display()))?
            .with_name("tandem")
            .build()
            .context("starting ONNX Runtime")?;
        let session = Session::builder(&env)
            .and_then(|mut b| b.commit_from_file(path))
            .with_context(|| format!("{shown}: loading the model into ONNX Runtime"))?;
        if session.inputs().len() != 1 || session.outputs().is_empty() {
            bail!(
                "{shown}: a face model has one input (images) and an output (embeddings); this \
                 one has {} input(s) and {} output(s)",
                session.inputs().len(),
                session.outputs().len()
            );
        }
        Ok(OrtEmbedder { session, shown })
    }

    /// The embeddings of `n` images `x` (`[n, 3, side, side]` row-major): `n` rows of the
    /// returned width.
    pub fn embed(
        &mut self,
        x: Vec<f32>,
        n: usize,
        side: usize,
    ) -> anyhow::Result<(Vec<f32>, usize)> {
        let input = Tensor::from_array(([n, 3, side, side], x))
            .with_context(|| format!("{}: the input batch", self.shown))?;
        let outputs = self
            .session
            .run(ort::inputs![input])
            .with_context(|| format!("{}: running the model", self.shown))?;
        let (shape, data) = outputs[0]
            .try_extract_tensor::<f32>()
            .with_context(|| format!("{}: its first output is not a float tensor", self.shown))?;
        let width = match **shape {
            [rows, width] if rows as usize == n && width > 0 => width as usize,
            _ => {
                bail!("{}: output of shape {:?} for {n} images, not [{n}, D]", self.shown, &**shape)
            }
        };
        Ok((data.to_vec(), width))
    }
}

/// The ONNX Runtime library: `ORT_DYLIB_PATH`, else the one pip's `onnxruntime` installs,
/// asked of `TANDEM_PYTHON` then `python3`. The error says where it looked.
fn library() -> anyhow::Result<PathBuf> {
    if let Some(path) = std::env::var_os("ORT_DYLIB_PATH") {
        let path = PathBuf::from(path);
        if !path.is_file() {
            bail!("ORT_DYLIB_PATH={}: no such file", path.display());
        }
        return Ok(path);
    }
    let ask = "import glob, os, onnxruntime; \
               d = os.path.join(os.path.dirname(onnxruntime.__file__), 'capi'); \
               print(sorted(glob.glob(os.path.join(d, 'libonnxruntime.so*')))[-1])";
    let mut pythons: Vec<PathBuf> =
        std::env::var_os("TANDEM_PYTHON").map(PathBuf::from).into_iter().collect();
    pythons.push(PathBuf::from("python3"));
    for python in &pythons {
        let Ok(out) = Command::new(python).args(["-c", ask]).output() else { continue };
        let found = PathBuf::from(String::from_utf8_lossy(&out.stdout).trim());
        if out.status.success() && found.is_file() {
            return Ok(found);
        }
    }
    bail!(
        "ONNX Runtime was not found: ORT_DYLIB_PATH is not set and no Python among {pythons:?} \
         has the onnxruntime package (pip install onnxruntime, or set ORT_DYLIB_PATH to \
         libonnxruntime.so)"
    )
}
