//! Finding and loading libnccl and the CUDA runtime when a group first needs them.
//!
//! Why not cudarc's `nccl` module: candle 0.11 builds cudarc with `dynamic-linking`, and cudarc
//! refuses `dynamic-loading` beside it, so through cudarc every binary built with `cuda` would
//! need libnccl at start-up (the dynamic loader's one-line error, no hint), and cudarc's own
//! loader panics when a library is missing. Loading the few functions we call ourselves lets a
//! build with `nccl` start anywhere, look where pip and Debian install NCCL (pip's wheel ships
//! only `libnccl.so.2`), and say what to install. Signatures and constants are NCCL's and the
//! CUDA runtime's public C API (nccl.h, cuda_runtime_api.h).
use crate::error::CommError;
use std::ffi::{c_char, c_int, c_uint, c_void, CStr};
use std::sync::OnceLock;
use tandem_dylib::{DylibError, Opened, Search};

pub(crate) type RawComm = *mut c_void;
pub(crate) type RawStream = *mut c_void;
pub(crate) type RawEvent = *mut c_void;

/// `ncclUniqueId`: 128 opaque bytes made by rank 0 and handed to every rank.
#[repr(C)]
#[derive(Clone, Copy)]
pub(crate) struct UniqueId(pub [u8; 128]);

/// `ncclConfig_t` as of NCCL 2.17 (the fields we set); newer NCCLs read `size` bytes of it and
/// keep their defaults for the rest.
#[repr(C)]
pub(crate) struct Config {
    size: usize,
    magic: c_uint,
    version: c_uint,
    pub blocking: c_int,
    cga_cluster_size: c_int,
    min_ctas: c_int,
    max_ctas: c_int,
    net_name: *const c_char,
    split_share: c_int,
}

impl Config {
    /// NCCL_CONFIG_INITIALIZER for the 2.17 layout: every field "undefined" (NCCL's default).
    pub(crate) fn new() -> Config {
        const UNDEF: c_int = c_int::MIN;
        Config {
            size: std::mem::size_of::<Config>(),
            magic: 0xcafe_beef,
            version: 21700,
            blocking: UNDEF,
            cga_cluster_size: UNDEF,
            min_ctas: UNDEF,
            max_ctas: UNDEF,
            net_name: std::ptr::null(),
            split_share: UNDEF,
        }
    }
}

pub(crate) const NCCL_SUCCESS: c_int = 0;
pub(crate) const NCCL_IN_PROGRESS: c_int = 7;
pub(crate) const CUDA_SUCCESS: c_int = 0;
pub(crate) const CUDA_ERROR_NOT_READY: c_int = 600;
const CUDA_STREAM_NON_BLOCKING: c_uint = 1;
const CUDA_EVENT_DISABLE_TIMING: c_uint = 2;

type CommOp = unsafe extern "C" fn(RawComm) -> c_int;
/// ncclAllReduce / ncclReduceScatter (send, recv, count, datatype, op, comm, stream) and
/// ncclBroadcast (send, recv, count, datatype, root, comm, stream).
type Collective = unsafe extern "C" fn(
    *const c_void,
    *mut c_void,
    usize,
    c_int,
    c_int,
    RawComm,
    RawStream,
) -> c_int;

/// The NCCL and CUDA runtime functions tandem calls, resolved once per process.
pub(crate) struct Libraries {
    pub nccl_path: String,
    pub cudart_path: String,
    pub get_version: unsafe extern "C" fn(*mut c_int) -> c_int,
    pub get_unique_id: unsafe extern "C" fn(*mut UniqueId) -> c_int,
    pub comm_init_rank_config:
        unsafe extern "C" fn(*mut RawComm, c_int, UniqueId, c_int, *mut Config) -> c_int,
    pub comm_get_async_error: unsafe extern "C" fn(RawComm, *mut c_int) -> c_int,
    pub comm_abort: CommOp,
    pub all_reduce: Collective,
    pub broadcast: Collective,
    pub all_gather:
        unsafe extern "C" fn(*const c_void, *mut c_void, usize, c_int, RawComm, RawStream) -> c_int,
    pub reduce_scatter: Collective,
    /// ncclReduce (send, recv, count, datatype, op, root, comm, stream).
    pub reduce: unsafe extern "C" fn(
        *const c_void,
        *mut c_void,
        usize,
        c_int,
        c_int,
        c_int,
        RawComm,
        RawStream,
    ) -> c_int,
    /// ncclSend (buffer, count, datatype, peer, comm, stream); ncclRecv alike.
    pub send: unsafe extern "C" fn(*const c_void, usize, c_int, c_int, RawComm, RawStream) -> c_int,
    pub recv: unsafe extern "C" fn(*mut c_void, usize, c_int, c_int, RawComm, RawStream) -> c_int,
    pub group_start: unsafe extern "C" fn() -> c_int,
    pub group_end: unsafe extern "C" fn() -> c_int,
    pub nccl_error_string: unsafe extern "C" fn(c_int) -> *const c_char,
    pub nccl_last_error: unsafe extern "C" fn(RawComm) -> *const c_char,
    pub set_device: unsafe extern "C" fn(c_int) -> c_int,
    pub stream_create: unsafe extern "C" fn(*mut RawStream, c_uint) -> c_int,
    pub stream_destroy: unsafe extern "C" fn(RawStream) -> c_int,
    pub stream_wait_event: unsafe extern "C" fn(RawStream, RawEvent, c_uint) -> c_int,
    pub event_create: unsafe extern "C" fn(*mut RawEvent, c_uint) -> c_int,
    pub event_record: unsafe extern "C" fn(RawEvent, RawStream) -> c_int,
    pub event_query: unsafe extern "C" fn(RawEvent) -> c_int,
    pub event_destroy: unsafe extern "C" fn(RawEvent) -> c_int,
    pub malloc: unsafe extern "C" fn(*mut *mut c_void, usize) -> c_int,
    pub free: unsafe extern "C" fn(*mut c_void) -> c_int,
    pub cuda_error_string: unsafe extern "C" fn(c_int) -> *const c_char,
    // Keeps the symbols above valid for the life of the process.
    _nccl: libloading::Library,
    _cudart: libloading::Library,
}

/// The loaded libraries; the first failure is kept and returned to every later caller.
pub(crate) fn libraries() -> Result<&'static Libraries, CommError> {
    static LIBS: OnceLock<Result<Libraries, CommError>> = OnceLock::new();
    match LIBS.get_or_init(load) {
        Ok(l) => Ok(l),
        Err(CommError::Library { library, tried, hint }) => Err(CommError::Library {
            library: library.clone(),
            tried: tried.clone(),
            hint: hint.clone(),
        }),
        Err(other) => Err(CommError::Internal { op: "load NCCL", reason: other.to_string() }),
    }
}

/// What was loaded: NCCL's version and the files NCCL and the CUDA runtime came from.
#[derive(Clone, Debug)]
pub struct NcclLibraryInfo {
    /// `major * 10000 + minor * 100 + patch` (2.32.3 → 23203).
    pub version: u32,
    pub nccl: String,
    pub cudart: String,
}

impl NcclLibraryInfo {
    /// "2.32.3".
    pub fn version_string(&self) -> String {
        let v = self.version;
        format!("{}.{}.{}", v / 10000, v / 100 % 100, v % 100)
    }
}

/// Loads NCCL and the CUDA runtime (once per process) and says which; needs no GPU.
pub fn nccl_library() -> Result<NcclLibraryInfo, CommError> {
    let l = libraries()?;
    let mut v = 0;
    // SAFETY: ncclGetVersion writes one int.
    check_nccl(l, "ncclGetVersion", unsafe { (l.get_version)(&mut v) })?;
    Ok(NcclLibraryInfo {
        version: v as u32,
        nccl: l.nccl_path.clone(),
        cudart: l.cudart_path.clone(),
    })
}

fn load() -> Result<Libraries, CommError> {
    let nccl = open_first(&NCCL)?;
    let cudart = open_first(&CUDART)?;
    // SAFETY: each symbol is looked up by its C name and given its C signature from the
    // headers; the libraries stay loaded in the returned struct.
    unsafe {
        macro_rules! sym {
            ($lib:expr, $name:literal) => {
                $lib.symbol($name).map_err(dylib_error)?
            };
        }
        Ok(Libraries {
            get_version: sym!(nccl, "ncclGetVersion"),
            get_unique_id: sym!(nccl, "ncclGetUniqueId"),
            comm_init_rank_config: sym!(nccl, "ncclCommInitRankConfig"),
            comm_get_async_error: sym!(nccl, "ncclCommGetAsyncError"),
            comm_abort: sym!(nccl, "ncclCommAbort"),
            all_reduce: sym!(nccl, "ncclAllReduce"),
            broadcast: sym!(nccl, "ncclBroadcast"),
            all_gather: sym!(nccl, "ncclAllGather"),
            reduce_scatter: sym!(nccl, "ncclReduceScatter"),
            reduce: sym!(nccl, "ncclReduce"),
            send: sym!(nccl, "ncclSend"),
            recv: sym!(nccl, "ncclRecv"),
            group_start: sym!(nccl, "ncclGroupStart"),
            group_end: sym!(nccl, "ncclGroupEnd"),
            nccl_error_string: sym!(nccl, "ncclGetErrorString"),
            nccl_last_error: sym!(nccl, "ncclGetLastError"),
            set_device: sym!(cudart, "cudaSetDevice"),
            stream_create: sym!(cudart, "cudaStreamCreateWithFlags"),
            stream_destroy: sym!(cudart, "cudaStreamDestroy"),
            stream_wait_event: sym!(cudart, "cudaStreamWaitEvent"),
            event_create: sym!(cudart, "cudaEventCreateWithFlags"),
            event_record: sym!(cudart, "cudaEventRecord"),
            event_query: sym!(cudart, "cudaEventQuery"),
            event_destroy: sym!(cudart, "cudaEventDestroy"),
            malloc: sym!(cudart, "cudaMalloc"),
            free: sym!(cudart, "cudaFree"),
            cuda_error_string: sym!(cudart, "cudaGetErrorString"),
            nccl_path: nccl.path,
            cudart_path: cudart.path,
            _nccl: nccl.library,
            _cudart: cudart.library,
        })
    }
}

pub(crate) const NCCL: Search = Search {
    what: "NCCL",
    sonames: &["libnccl.so.2", "libnccl.so"],
    pip_paths: &["nvidia/nccl/lib/libnccl.so.2"],
    env_var: "TANDEM_NCCL_LIBRARY",
    install: "install NCCL with `pip install nvidia-nccl-cu13` (or -cu12, to match your CUDA) or \
              `apt install libnccl2`, or point TANDEM_NCCL_LIBRARY at libnccl.so.2",
};

const CUDART: Search = Search {
    what: "the CUDA runtime",
    sonames: &["libcudart.so.13", "libcudart.so.12", "libcudart.so"],
    pip_paths: &["nvidia/cu13/lib/libcudart.so.13", "nvidia/cuda_runtime/lib/libcudart.so.12"],
    env_var: "TANDEM_CUDART_LIBRARY",
    install: "install it with `pip install nvidia-cuda-runtime` or the CUDA toolkit, or point \
              TANDEM_CUDART_LIBRARY at libcudart.so",
};

/// Opens the first candidate of `s` that loads (tandem-dylib's search), as a [`CommError`].
fn open_first(s: &Search) -> Result<Opened, CommError> {
    tandem_dylib::open_first(s).map_err(dylib_error)
}

fn dylib_error(e: DylibError) -> CommError {
    match e {
        DylibError::NotFound { library, tried, hint } => {
            CommError::Library { library, tried, hint }
        }
        DylibError::MissingSymbol { path, symbol, reason } => CommError::Library {
            library: path,
            tried: String::new(),
            hint: format!("it has no symbol {symbol}: {reason} (too old?)"),
        },
    }
}

/// An NCCL status as an error naming the call and NCCL's own words.
pub(crate) fn check_nccl(l: &Libraries, call: &'static str, rc: c_int) -> Result<(), CommError> {
    if rc == NCCL_SUCCESS || rc == NCCL_IN_PROGRESS {
        return Ok(());
    }
    Err(CommError::Nccl { op: call, reason: nccl_reason(l, rc, std::ptr::null_mut()) })
}

pub(crate) fn nccl_reason(l: &Libraries, rc: c_int, comm: RawComm) -> String {
    // SAFETY: both return static, NUL-terminated strings (or null).
    let base = c_text(unsafe { (l.nccl_error_string)(rc) }).unwrap_or_default();
    // SAFETY: as above.
    match c_text(unsafe { (l.nccl_last_error)(comm) }).filter(|s| !s.is_empty()) {
        Some(last) => format!("NCCL error {rc} ({base}): {last}"),
        None => format!("NCCL error {rc} ({base})"),
    }
}

/// A CUDA runtime status as an error naming the call and CUDA's own words.
pub(crate) fn check_cuda(l: &Libraries, call: &'static str, rc: c_int) -> Result<(), CommError> {
    if rc == CUDA_SUCCESS {
        return Ok(());
    }
    // SAFETY: cudaGetErrorString returns a static string.
    let p = unsafe { (l.cuda_error_string)(rc) };
    let text = c_text(p).unwrap_or_default();
    Err(CommError::Nccl { op: call, reason: format!("CUDA error {rc}: {text}") })
}

/// A static C string from a library (None for null).
fn c_text(p: *const c_char) -> Option<String> {
    // SAFETY: the libraries return static, NUL-terminated strings or null.
    (!p.is_null()).then(|| unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned())
}

impl Libraries {
    pub(crate) fn new_stream(&self) -> Result<RawStream, CommError> {
        let create = self.stream_create;
        // SAFETY: writes one stream handle.
        self.create("cudaStreamCreateWithFlags", |out| unsafe {
            create(out, CUDA_STREAM_NON_BLOCKING)
        })
    }

    pub(crate) fn new_event(&self) -> Result<RawEvent, CommError> {
        let create = self.event_create;
        // SAFETY: writes one event handle.
        self.create("cudaEventCreateWithFlags", |out| unsafe {
            create(out, CUDA_EVENT_DISABLE_TIMING)
        })
    }

    /// A CUDA object made by a `create(&mut handle)` call.
    pub(crate) fn create(
        &self,
        call: &'static str,
        create: impl FnOnce(*mut *mut c_void) -> c_int,
    ) -> Result<*mut c_void, CommError> {
        let mut handle = std::ptr::null_mut();
        check_cuda(self, call, create(&mut handle))?;
        Ok(handle)
    }
}
