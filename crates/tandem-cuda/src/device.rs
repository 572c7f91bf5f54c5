//! What every kernel wrapper needs: raw device pointers of candle's CUDA storages (kept in use
//! on the device's stream until the launch is queued), fresh outputs, the PTX modules, launch
//! shapes, and tensors made from storages.
use candle_core::backend::BackendStorage;
use candle_core::cuda::cudarc::driver::{
    CudaStream, DevicePtr, DevicePtrMut, LaunchConfig, SyncOnDrop,
};
use candle_core::cuda::CudaStorageSlice;
use candle_core::op::BackpropOp;
use candle_core::{CudaDevice, CudaStorage, DType, Layout, Shape, Storage, StorageRef, Tensor};

use crate::Result;

/// Threads per block of every kernel (kernels/common.cuh's TANDEM_BLOCK).
pub(crate) const BLOCK: u32 = 256;

/// A raw device address of an operand, valid while the guard lives (it orders the storage's
/// use on the stream).
pub(crate) struct Ptr<'a> {
    pub addr: u64,
    pub dtype: DType,
    _sync: SyncOnDrop<'a>,
}

macro_rules! each_slice {
    ($slice:expr, |$s:ident, $size:ident| $body:expr, $what:expr) => {
        each_slice!(@arms $slice, $s, $size, $body, $what;
            F32 f32, F16 half::f16, BF16 half::bf16, F64 f64, U32 u32, I64 i64, I32 i32, U8 u8)
    };
    (@arms $slice:expr, $s:ident, $size:ident, $body:expr, $what:expr; $($v:ident $t:ty),*) => {
        match $slice {
            $(CudaStorageSlice::$v($s) => {
                let $size = std::mem::size_of::<$t>();
                ($body, DType::$v)
            })*
            _ => candle_core::bail!("{}: unsupported dtype on CUDA", $what),
        }
    };
}

/// Start offset (in elements) of a contiguous layout; `what` names the operand in errors.
fn start(l: &Layout, what: &str) -> Result<usize> {
    match l.contiguous_offsets() {
        Some((a, _)) => Ok(a),
        None => candle_core::bail!("{what} is not contiguous"),
    }
}

/// The operand's first element's address, for reading.
pub(crate) fn read<'a>(
    s: &'a CudaStorage,
    l: &Layout,
    stream: &'a CudaStream,
    what: &str,
) -> Result<Ptr<'a>> {
    let a = start(l, what)?;
    let ((addr, sync), dtype) = each_slice!(
        &s.slice,
        |v, size| {
            let (p, g) = v.device_ptr(stream);
            (p + (a * size) as u64, g)
        },
        what
    );
    Ok(Ptr { addr, dtype, _sync: sync })
}

/// The operand's first element's address, for writing.
pub(crate) fn write<'a>(
    s: &'a mut CudaStorage,
    l: &Layout,
    stream: &'a CudaStream,
    what: &str,
) -> Result<Ptr<'a>> {
    let a = start(l, what)?;
    let ((addr, sync), dtype) = each_slice!(
        &mut s.slice,
        |v, size| {
            let (p, g) = v.device_ptr_mut(stream);
            (p + (a * size) as u64, g)
        },
        what
    );
    Ok(Ptr { addr, dtype, _sync: sync })
}

/// A fresh storage of `len` elements, its contents undefined: the kernel writes them all.
pub(crate) fn alloc(dev: &CudaDevice, dtype: DType, len: usize) -> Result<CudaStorage> {
    // SAFETY: the caller's kernel writes every element before anything reads it.
    let slice = unsafe {
        match dtype {
            DType::F32 => CudaStorageSlice::F32(dev.alloc::<f32>(len)?),
            DType::F16 => CudaStorageSlice::F16(dev.alloc::<half::f16>(len)?),
            DType::BF16 => CudaStorageSlice::BF16(dev.alloc::<half::bf16>(len)?),
            DType::F64 => CudaStorageSlice::F64(dev.alloc::<f64>(len)?),
            DType::I32 => CudaStorageSlice::I32(dev.alloc::<i32>(len)?),
            DType::U8 => CudaStorageSlice::U8(dev.alloc::<u8>(len)?),
            other => candle_core::bail!("tandem-cuda: no fresh storage of {other:?}"),
        }
    };
    Ok(CudaStorage { slice, device: dev.clone() })
}

/// `len` zeroed i32 values (a flag, a counter).
pub(crate) fn zeroed_i32(dev: &CudaDevice, len: usize) -> Result<CudaStorage> {
    Ok(CudaStorage {
        slice: CudaStorageSlice::I32(dev.alloc_zeros::<i32>(len)?),
        device: dev.clone(),
    })
}

/// A tensor (outside the autograd graph) over `storage`, contiguous, of `shape`.
pub(crate) fn tensor(storage: CudaStorage, shape: impl Into<Shape>) -> Tensor {
    Tensor::from_storage(Storage::Cuda(storage), shape, BackpropOp::none(), false)
}

/// A read lock on a CUDA tensor's storage and its layout; `what` names it in errors.
pub(crate) struct CudaRef<'a> {
    guard: StorageRef<'a>,
    pub layout: &'a Layout,
}

impl<'a> CudaRef<'a> {
    pub(crate) fn new(t: &'a Tensor, what: &str) -> Result<Self> {
        let (guard, layout) = t.storage_and_layout();
        if !matches!(&*guard, Storage::Cuda(_)) {
            candle_core::bail!("{what}: expected a CUDA tensor, it is on {:?}", t.device())
        }
        if !layout.is_contiguous() {
            candle_core::bail!("{what}: expected a contiguous tensor")
        }
        Ok(CudaRef { guard, layout })
    }

    pub(crate) fn storage(&self) -> Result<&CudaStorage> {
        match &*self.guard {
            Storage::Cuda(s) => Ok(s),
            _ => candle_core::bail!("tandem-cuda: a CUDA tensor changed device"),
        }
    }
}

/// The CUDA device of a tensor.
pub(crate) fn cuda_device(t: &Tensor, what: &str) -> Result<CudaDevice> {
    match t.device() {
        candle_core::Device::Cuda(d) => Ok(d.clone()),
        other => candle_core::bail!("{what}: expected a CUDA tensor, it is on {other:?}"),
    }
}

/// The device of a storage (for the wrappers that take storages).
pub(crate) fn device_of(s: &CudaStorage) -> CudaDevice {
    s.device().clone()
}

/// `_f32`, `_f16` or `_bf16`, the kernels' dtype suffix.
pub(crate) fn suffix(dtype: DType, what: &str) -> Result<&'static str> {
    match dtype {
        DType::F32 => Ok("f32"),
        DType::F16 => Ok("f16"),
        DType::BF16 => Ok("bf16"),
        other => candle_core::bail!("{what}: CUDA kernels take f32, f16 or bf16, not {other:?}"),
    }
}

/// A kernel of one of the PTX modules (loaded once per device) and the device's stream.
pub(crate) struct Kernel {
    func: candle_core::cuda::cudarc::driver::CudaFunction,
    stream: std::sync::Arc<CudaStream>,
    pub name: String,
}

impl Kernel {
    pub(crate) fn builder(&self) -> candle_core::cuda::cudarc::driver::LaunchArgs<'_> {
        self.stream.launch_builder(&self.func)
    }

    pub(crate) fn stream(&self) -> &CudaStream {
        &self.stream
    }
}

/// `name` of `module` on `dev`.
pub(crate) fn function(dev: &CudaDevice, module: &Module, name: &str) -> Result<Kernel> {
    let func = dev.get_or_load_custom_func(name, module.name, module.ptx)?;
    Ok(Kernel {
        func: func.into_cuda_function(),
        stream: dev.cuda_stream(),
        name: name.to_string(),
    })
}

/// A PTX module built from kernels/NAME.cu.
pub(crate) struct Module {
    name: &'static str,
    ptx: &'static str,
}

macro_rules! ptx_module {
    ($const:ident, $name:literal) => {
        pub(crate) const $const: Module = Module {
            name: concat!("tandem_", $name),
            ptx: include_str!(concat!(env!("OUT_DIR"), "/", $name, ".ptx")),
        };
    };
}
ptx_module!(BATCH_NORM, "batch_norm");
ptx_module!(PRELU, "prelu");
ptx_module!(OPTIM, "optim");
ptx_module!(REDUCE, "reduce");
ptx_module!(ROWS, "rows");

/// Grid-stride launch over `n` elements: enough blocks to fill a large GPU, no more.
pub(crate) fn elementwise(n: usize) -> LaunchConfig {
    let blocks = n.div_ceil(BLOCK as usize).clamp(1, 132 * 32) as u32;
    LaunchConfig { grid_dim: (blocks, 1, 1), block_dim: (BLOCK, 1, 1), shared_mem_bytes: 0 }
}

/// One block per row (or channel, or slot) of `rows`.
pub(crate) fn per_row(rows: usize) -> Result<LaunchConfig> {
    let rows = u32::try_from(rows.max(1))
        .map_err(|_| candle_core::Error::Msg(format!("{rows} rows exceed a CUDA grid")))?;
    Ok(LaunchConfig { grid_dim: (rows, 1, 1), block_dim: (BLOCK, 1, 1), shared_mem_bytes: 0 })
}

/// Two-stage per-channel sums over `m` values per channel: (chunks, chunk length) so that the
/// grid (chunks × channels) has a few blocks per multiprocessor, each with at least a block's
/// worth of values.
pub(crate) fn chunking(m: usize, channels: usize) -> (usize, usize) {
    let target_blocks: usize = 132 * 8;
    let per_channel = target_blocks.div_ceil(channels.max(1)).max(1);
    let min_len = BLOCK as usize * 4;
    let chunks = per_channel.min(m.div_ceil(min_len)).clamp(1, 1024);
    (chunks, m.div_ceil(chunks).max(1))
}

/// The grid of a two-stage sum: (chunks, channels).
pub(crate) fn chunked(chunks: usize, channels: usize) -> Result<LaunchConfig> {
    let c = u32::try_from(channels).ok().filter(|&c| c <= 65_535).ok_or_else(|| {
        candle_core::Error::Msg(format!("{channels} channels exceed a CUDA grid"))
    })?;
    Ok(LaunchConfig {
        grid_dim: (chunks as u32, c.max(1), 1),
        block_dim: (BLOCK, 1, 1),
        shared_mem_bytes: 0,
    })
}

/// Launches `func` with `cfg` and the arguments (values; pointers as `u64` addresses, 0 for
/// null), in the kernel's C order.
///
/// It expands to an unsafe launch, so a call sits in an `unsafe` block whose SAFETY comment
/// says why the arguments match the kernel's C signature and every pointer addresses as many
/// elements as the kernel reads or writes.
macro_rules! launch {
    ($func:expr, $cfg:expr; $($arg:expr),* $(,)?) => {{
        use candle_core::cuda::cudarc::driver::PushKernelArg;
        use candle_core::cuda::WrapErr;
        let func = $func;
        let mut builder = func.builder();
        $(
            let arg = $arg;
            builder.arg(&arg);
        )*
        crate::profile::time(func.stream(), &func.name, || builder.launch($cfg).w().map(|_| ()))
    }};
}
pub(crate) use launch;
