//! Loading cuDNN when a convolution first runs on a GPU (tandem-dylib's search: the system
//! loader, pip's `nvidia-cudnn-cu13` / `-cu12` wheels, `TANDEM_CUDNN_LIBRARY`), and the legacy
//! convolution API tandem calls. Signatures and constants are cuDNN's public C API
//! (cudnn_graph.h, cudnn_ops.h, cudnn_cnn.h of cuDNN 9; the same calls exist in cuDNN 8).
use std::ffi::{c_char, c_int, c_void, CStr};
use std::sync::OnceLock;

use tandem_dylib::{DylibError, Opened, Search};

pub(crate) type Handle = *mut c_void;
pub(crate) type TensorDesc = *mut c_void;
pub(crate) type FilterDesc = *mut c_void;
pub(crate) type ConvDesc = *mut c_void;
pub(crate) type Status = c_int;
pub(crate) type Stream = *mut c_void;

pub(crate) const STATUS_SUCCESS: Status = 0;
pub(crate) const DATA_FLOAT: c_int = 0;
pub(crate) const DATA_HALF: c_int = 2;
pub(crate) const DATA_BFLOAT16: c_int = 9;
pub(crate) const TENSOR_NCHW: c_int = 0;
pub(crate) const CROSS_CORRELATION: c_int = 1;
pub(crate) const DEFAULT_MATH: c_int = 0;
pub(crate) const TENSOR_OP_MATH: c_int = 1;
pub(crate) const FMA_MATH: c_int = 3;
pub(crate) const DETERMINISTIC: c_int = 1;

/// `cudnnConvolution{Fwd,BwdData,BwdFilter}AlgoPerf_t` (the three share one layout).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct AlgoPerf {
    pub algo: c_int,
    pub status: Status,
    pub time: f32,
    pub memory: usize,
    pub determinism: c_int,
    pub math_type: c_int,
    pub reserved: [c_int; 3],
}

/// (handle, x, w, conv, y, requested, *returned, *perf): Find / Get_v7 for forward; the same
/// shape with (w, dy, conv, dx) for backward data and (x, dy, conv, dw) for backward filter.
type FindAlgo = unsafe extern "C" fn(
    Handle,
    *mut c_void,
    *mut c_void,
    ConvDesc,
    *mut c_void,
    c_int,
    *mut c_int,
    *mut AlgoPerf,
) -> Status;
/// (handle, a, b, conv, c, algo, *size): the workspace a direction's algorithm needs.
type WorkspaceSize = unsafe extern "C" fn(
    Handle,
    *mut c_void,
    *mut c_void,
    ConvDesc,
    *mut c_void,
    c_int,
    *mut usize,
) -> Status;
/// (handle, *alpha, aDesc, a, bDesc, b, conv, algo, ws, ws_size, *beta, cDesc, c): forward
/// (x, w -> y), backward data (w, dy -> dx), backward filter (x, dy -> dw).
type Convolve = unsafe extern "C" fn(
    Handle,
    *const c_void,
    *mut c_void,
    *const c_void,
    *mut c_void,
    *const c_void,
    ConvDesc,
    c_int,
    *mut c_void,
    usize,
    *const c_void,
    *mut c_void,
    *mut c_void,
) -> Status;

/// The cuDNN functions tandem calls, resolved once per process.
pub(crate) struct Cudnn {
    pub path: String,
    pub version: usize,
    pub error_string: unsafe extern "C" fn(Status) -> *const c_char,
    pub create: unsafe extern "C" fn(*mut Handle) -> Status,
    pub set_stream: unsafe extern "C" fn(Handle, Stream) -> Status,
    pub create_tensor: unsafe extern "C" fn(*mut TensorDesc) -> Status,
    pub set_tensor_4d:
        unsafe extern "C" fn(TensorDesc, c_int, c_int, c_int, c_int, c_int, c_int) -> Status,
    pub destroy_tensor: unsafe extern "C" fn(TensorDesc) -> Status,
    pub create_filter: unsafe extern "C" fn(*mut FilterDesc) -> Status,
    pub set_filter_4d:
        unsafe extern "C" fn(FilterDesc, c_int, c_int, c_int, c_int, c_int, c_int) -> Status,
    pub destroy_filter: unsafe extern "C" fn(FilterDesc) -> Status,
    pub create_conv: unsafe extern "C" fn(*mut ConvDesc) -> Status,
    pub set_conv_2d: unsafe extern "C" fn(
        ConvDesc,
        c_int,
        c_int,
        c_int,
        c_int,
        c_int,
        c_int,
        c_int,
        c_int,
    ) -> Status,
    pub set_conv_math: unsafe extern "C" fn(ConvDesc, c_int) -> Status,
    pub set_conv_groups: unsafe extern "C" fn(ConvDesc, c_int) -> Status,
    pub destroy_conv: unsafe extern "C" fn(ConvDesc) -> Status,
    pub find_fwd: FindAlgo,
    pub heuristic_fwd: FindAlgo,
    pub ws_fwd: WorkspaceSize,
    pub forward: Convolve,
    pub find_bwd_data: FindAlgo,
    pub heuristic_bwd_data: FindAlgo,
    pub ws_bwd_data: WorkspaceSize,
    pub backward_data: Convolve,
    pub find_bwd_filter: FindAlgo,
    pub heuristic_bwd_filter: FindAlgo,
    pub ws_bwd_filter: WorkspaceSize,
    pub backward_filter: Convolve,
    // Keeps the symbols above (and cuDNN 9's sub-libraries) loaded for the process's life.
    _libraries: Vec<libloading::Library>,
}

// SAFETY: the struct holds function pointers into a library that stays loaded; cuDNN's calls
// are thread-safe given per-thread handles, which conv.rs keeps.
unsafe impl Send for Cudnn {}
// SAFETY: as above; nothing in it is mutated after loading.
unsafe impl Sync for Cudnn {}

const CUDNN: Search = Search {
    what: "cuDNN",
    sonames: &["libcudnn.so.9", "libcudnn.so.8", "libcudnn.so"],
    pip_paths: &["nvidia/cudnn/lib/libcudnn.so.9", "nvidia/cudnn/lib/libcudnn.so.8"],
    env_var: "TANDEM_CUDNN_LIBRARY",
    install: "install cuDNN with `pip install nvidia-cudnn-cu13` (or -cu12, to match your \
              CUDA; PyTorch's CUDA wheels bring it) or NVIDIA's cudnn9 packages, or point \
              TANDEM_CUDNN_LIBRARY at libcudnn.so.9",
};

/// cuDNN 9 splits into sub-libraries that `libcudnn.so.9` opens by name; when it came from a
/// wheel's folder outside the loader's path they are opened first from that folder (a library
/// already loaded answers a later open of its name).
const SUBLIBRARIES: &[&str] = &[
    "libcudnn_graph.so.9",
    "libcudnn_engines_runtime_compiled.so.9",
    "libcudnn_engines_precompiled.so.9",
    "libcudnn_heuristic.so.9",
    "libcudnn_ops.so.9",
    "libcudnn_cnn.so.9",
];

/// The loaded library; the first failure is kept and returned to every later caller.
pub(crate) fn cudnn() -> crate::Result<&'static Cudnn> {
    static LIB: OnceLock<Result<Cudnn, String>> = OnceLock::new();
    match LIB.get_or_init(|| load().map_err(|e| e.to_string())) {
        Ok(l) => Ok(l),
        Err(e) => Err(candle_core::Error::Msg(e.clone())),
    }
}

fn preload_sublibraries(main: &str) -> Vec<libloading::Library> {
    let Some(dir) = std::path::Path::new(main).parent().filter(|d| !d.as_os_str().is_empty())
    else {
        return Vec::new();
    };
    let mut out = Vec::new();
    for name in SUBLIBRARIES {
        let path = dir.join(name);
        if !path.exists() {
            continue;
        }
        use libloading::os::unix::{Library, RTLD_GLOBAL, RTLD_NOW};
        // SAFETY: cuDNN's sub-libraries run no initialisers beyond their own registration.
        match unsafe { Library::open(Some(&path), RTLD_NOW | RTLD_GLOBAL) } {
            Ok(lib) => out.push(lib.into()),
            Err(e) => tracing::debug!("cuDNN: {} did not preload: {e}", path.display()),
        }
    }
    out
}

fn load() -> Result<Cudnn, DylibError> {
    let Opened { library, path } = tandem_dylib::open_first(&CUDNN)?;
    let sublibraries = preload_sublibraries(&path);
    let lib = Opened { library, path };
    // SAFETY: each symbol is looked up by its C name and given its C signature from cuDNN's
    // headers; the library stays loaded in the returned struct.
    unsafe {
        let version: unsafe extern "C" fn() -> usize = lib.symbol("cudnnGetVersion")?;
        let cudnn = Cudnn {
            version: version(),
            error_string: lib.symbol("cudnnGetErrorString")?,
            create: lib.symbol("cudnnCreate")?,
            set_stream: lib.symbol("cudnnSetStream")?,
            create_tensor: lib.symbol("cudnnCreateTensorDescriptor")?,
            set_tensor_4d: lib.symbol("cudnnSetTensor4dDescriptor")?,
            destroy_tensor: lib.symbol("cudnnDestroyTensorDescriptor")?,
            create_filter: lib.symbol("cudnnCreateFilterDescriptor")?,
            set_filter_4d: lib.symbol("cudnnSetFilter4dDescriptor")?,
            destroy_filter: lib.symbol("cudnnDestroyFilterDescriptor")?,
            create_conv: lib.symbol("cudnnCreateConvolutionDescriptor")?,
            set_conv_2d: lib.symbol("cudnnSetConvolution2dDescriptor")?,
            set_conv_math: lib.symbol("cudnnSetConvolutionMathType")?,
            set_conv_groups: lib.symbol("cudnnSetConvolutionGroupCount")?,
            destroy_conv: lib.symbol("cudnnDestroyConvolutionDescriptor")?,
            find_fwd: lib.symbol("cudnnFindConvolutionForwardAlgorithm")?,
            heuristic_fwd: lib.symbol("cudnnGetConvolutionForwardAlgorithm_v7")?,
            ws_fwd: lib.symbol("cudnnGetConvolutionForwardWorkspaceSize")?,
            forward: lib.symbol("cudnnConvolutionForward")?,
            find_bwd_data: lib.symbol("cudnnFindConvolutionBackwardDataAlgorithm")?,
            heuristic_bwd_data: lib.symbol("cudnnGetConvolutionBackwardDataAlgorithm_v7")?,
            ws_bwd_data: lib.symbol("cudnnGetConvolutionBackwardDataWorkspaceSize")?,
            backward_data: lib.symbol("cudnnConvolutionBackwardData")?,
            find_bwd_filter: lib.symbol("cudnnFindConvolutionBackwardFilterAlgorithm")?,
            heuristic_bwd_filter: lib.symbol("cudnnGetConvolutionBackwardFilterAlgorithm_v7")?,
            ws_bwd_filter: lib.symbol("cudnnGetConvolutionBackwardFilterWorkspaceSize")?,
            backward_filter: lib.symbol("cudnnConvolutionBackwardFilter")?,
            path: lib.path,
            _libraries: {
                let mut all = sublibraries;
                all.push(lib.library);
                all
            },
        };
        Ok(cudnn)
    }
}

impl Cudnn {
    /// A cuDNN status as an error naming the call, cuDNN's words and `context`.
    pub(crate) fn check(
        &self,
        call: &str,
        rc: Status,
        context: &dyn Fn() -> String,
    ) -> crate::Result<()> {
        if rc == STATUS_SUCCESS {
            return Ok(());
        }
        // SAFETY: cudnnGetErrorString returns a static, NUL-terminated string (or null).
        let p = unsafe { (self.error_string)(rc) };
        let words = if p.is_null() {
            String::new()
        } else {
            // SAFETY: non-null and NUL-terminated (above).
            unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned()
        };
        candle_core::bail!("cuDNN {call} failed: {words} (status {rc}) for {}", context())
    }
}
