//! Convolutions on CUDA through cuDNN: forward, backward data and backward filter, NCHW, f32
//! (TF32 tensor cores allowed, as PyTorch's `torch.backends.cudnn.allow_tf32` default; turn
//! off with `TANDEM_ALLOW_TF32=0`), f16 and bf16 (tensor cores, f32 accumulation), any stride,
//! padding, dilation and group count.
//!
//! Each shape's algorithms are found once per thread and device and cached with their
//! workspace sizes — by timing every algorithm, as `torch.backends.cudnn.benchmark = True`
//! (the default here), or by cuDNN's heuristics with `TANDEM_CUDNN_BENCHMARK=0`, which picks
//! the same algorithms run after run (timing may not, and different algorithms round
//! differently). Only deterministic algorithms are chosen, so one algorithm gives the same
//! bits every time. One workspace per device and thread grows to the largest a plan needs.
mod library;

use std::cell::RefCell;
use std::collections::HashMap;
use std::ffi::{c_int, c_void};

use candle_core::cuda::DeviceId;
use candle_core::{CudaDevice, CudaStorage, DType, Layout, Shape, Tensor};

use crate::batch_norm::Operand;
use crate::device::{alloc, cuda_device, device_of, read, tensor, write, CudaRef};
use crate::Result;
use library::{cudnn, AlgoPerf, ConvDesc, Cudnn, FilterDesc, Handle, TensorDesc};

/// Stride, padding, dilation (the same in both spatial dimensions) and groups.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct ConvSpec {
    pub stride: usize,
    pub padding: usize,
    pub dilation: usize,
    pub groups: usize,
}

/// What loading cuDNN found: its version (`major·10000 + minor·100 + patch` for cuDNN 9) and
/// file. Loads it if it is not yet; needs no GPU.
pub fn library() -> Result<(usize, String)> {
    let l = cudnn()?;
    Ok((l.version, l.path.clone()))
}

/// Whether convolutions should go through cuDNN: not when `TANDEM_CUDNN=0` asks for candle's
/// own CUDA convolution instead.
pub fn enabled() -> bool {
    std::env::var("TANDEM_CUDNN").map_or(true, |v| v != "0")
}

fn benchmark() -> bool {
    std::env::var("TANDEM_CUDNN_BENCHMARK").map_or(true, |v| v != "0")
}

fn allow_tf32() -> bool {
    std::env::var("TANDEM_ALLOW_TF32").map_or(true, |v| v != "0")
}

/// The output dims of a convolution of `x` by `w` (checked).
pub fn output_dims(x: &[usize], w: &[usize], s: ConvSpec) -> Result<[usize; 4]> {
    let (&[n, c, h, wd], &[o, kc, kh, kw]) = (x, w) else {
        candle_core::bail!("conv2d: expected input [N, C, H, W] and weight [O, C/groups, kh, kw], got {x:?} and {w:?}")
    };
    if s.groups == 0 || s.stride == 0 || s.dilation == 0 {
        candle_core::bail!("conv2d: stride, dilation and groups must be >= 1, got {s:?}")
    }
    if kc * s.groups != c || o % s.groups != 0 {
        candle_core::bail!(
            "conv2d: input has {c} channels, weight {w:?} with {} groups expects {}",
            s.groups,
            kc * s.groups
        )
    }
    let out = |size: usize, k: usize| {
        let span = s.dilation * (k - 1) + 1;
        (size + 2 * s.padding).checked_sub(span).map(|v| v / s.stride + 1)
    };
    let (Some(ho), Some(wo)) = (out(h, kh), out(wd, kw)) else {
        candle_core::bail!("conv2d: kernel {kh}x{kw} (dilation {}) is larger than the padded input {h}x{wd} (padding {})", s.dilation, s.padding)
    };
    Ok([n, o, ho, wo])
}

/// One shape's descriptors and the algorithms found for it.
struct Plan {
    x: TensorDesc,
    w: FilterDesc,
    y: TensorDesc,
    conv: ConvDesc,
    forward: Option<(c_int, usize)>,
    backward_data: Option<(c_int, usize)>,
    backward_filter: Option<(c_int, usize)>,
}

type PlanKey = (DeviceId, DType, [usize; 4], [usize; 4], ConvSpec);

/// A thread's cuDNN state for one device: the handle (bound to candle's stream), the plans,
/// the workspace.
struct DeviceState {
    handle: Handle,
    plans: HashMap<PlanKey, Plan>,
    workspace: Option<candle_core::cuda::cudarc::driver::CudaSlice<u8>>,
}

thread_local! {
    // cuDNN handles are not to be used from two threads at once: one per thread and device.
    static STATE: RefCell<HashMap<DeviceId, DeviceState>> = RefCell::new(HashMap::new());
}

fn data_type(dtype: DType) -> Result<c_int> {
    match dtype {
        DType::F32 => Ok(library::DATA_FLOAT),
        DType::F16 => Ok(library::DATA_HALF),
        DType::BF16 => Ok(library::DATA_BFLOAT16),
        other => candle_core::bail!("conv2d through cuDNN: f32, f16 or bf16, not {other:?}"),
    }
}

fn to_c(v: usize, what: &str) -> Result<c_int> {
    c_int::try_from(v)
        .map_err(|_| candle_core::Error::Msg(format!("conv2d: {what} {v} is too large for cuDNN")))
}

impl Plan {
    fn new(l: &Cudnn, dtype: DType, x: [usize; 4], w: [usize; 4], s: ConvSpec) -> Result<Plan> {
        let y = output_dims(&x, &w, s)?;
        let ctx = || format!("x {x:?}, w {w:?}, {s:?}");
        let dt = data_type(dtype)?;
        let mut plan = Plan {
            x: std::ptr::null_mut(),
            w: std::ptr::null_mut(),
            y: std::ptr::null_mut(),
            conv: std::ptr::null_mut(),
            forward: None,
            backward_data: None,
            backward_filter: None,
        };
        // SAFETY: each create writes one descriptor handle; each set is given a handle just
        // created and values in range (checked by `to_c`). On an error `plan` is dropped,
        // destroying what was created.
        unsafe {
            l.check("cudnnCreateTensorDescriptor", (l.create_tensor)(&mut plan.x), &ctx)?;
            l.check("cudnnCreateTensorDescriptor", (l.create_tensor)(&mut plan.y), &ctx)?;
            l.check("cudnnCreateFilterDescriptor", (l.create_filter)(&mut plan.w), &ctx)?;
            l.check("cudnnCreateConvolutionDescriptor", (l.create_conv)(&mut plan.conv), &ctx)?;
            let d = |v: [usize; 4]| -> Result<[c_int; 4]> {
                Ok([to_c(v[0], "dim")?, to_c(v[1], "dim")?, to_c(v[2], "dim")?, to_c(v[3], "dim")?])
            };
            let (xd, wd, yd) = (d(x)?, d(w)?, d(y)?);
            let nchw = library::TENSOR_NCHW;
            let rc = (l.set_tensor_4d)(plan.x, nchw, dt, xd[0], xd[1], xd[2], xd[3]);
            l.check("cudnnSetTensor4dDescriptor", rc, &ctx)?;
            let rc = (l.set_tensor_4d)(plan.y, nchw, dt, yd[0], yd[1], yd[2], yd[3]);
            l.check("cudnnSetTensor4dDescriptor", rc, &ctx)?;
            let rc = (l.set_filter_4d)(plan.w, dt, nchw, wd[0], wd[1], wd[2], wd[3]);
            l.check("cudnnSetFilter4dDescriptor", rc, &ctx)?;
            let (p, st, dl) = (
                to_c(s.padding, "padding")?,
                to_c(s.stride, "stride")?,
                to_c(s.dilation, "dilation")?,
            );
            // f32 accumulation for every data type (PyTorch's choice for f16 and bf16).
            let rc = (l.set_conv_2d)(
                plan.conv,
                p,
                p,
                st,
                st,
                dl,
                dl,
                library::CROSS_CORRELATION,
                library::DATA_FLOAT,
            );
            l.check("cudnnSetConvolution2dDescriptor", rc, &ctx)?;
            let math = match dtype {
                DType::F32 if allow_tf32() => library::DEFAULT_MATH,
                DType::F32 => library::FMA_MATH,
                _ => library::TENSOR_OP_MATH,
            };
            l.check("cudnnSetConvolutionMathType", (l.set_conv_math)(plan.conv, math), &ctx)?;
            let rc = (l.set_conv_groups)(plan.conv, to_c(s.groups, "groups")?);
            l.check("cudnnSetConvolutionGroupCount", rc, &ctx)?;
        }
        Ok(plan)
    }
}

impl Drop for Plan {
    fn drop(&mut self) {
        let Ok(l) = cudnn() else { return };
        // SAFETY: each handle was created by the matching create call (or is null, skipped).
        unsafe {
            if !self.x.is_null() {
                (l.destroy_tensor)(self.x);
            }
            if !self.y.is_null() {
                (l.destroy_tensor)(self.y);
            }
            if !self.w.is_null() {
                (l.destroy_filter)(self.w);
            }
            if !self.conv.is_null() {
                (l.destroy_conv)(self.conv);
            }
        }
    }
}

/// The three directions of a convolution.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Direction {
    Forward,
    BackwardData,
    BackwardFilter,
}

/// Picks the algorithm for `dir` of `plan`: the fastest deterministic one that ran (timed, or
/// cuDNN's heuristic order), and its workspace size.
fn choose(
    l: &Cudnn,
    handle: Handle,
    plan: &Plan,
    dir: Direction,
    ctx: &dyn Fn() -> String,
) -> Result<(c_int, usize)> {
    const REQUESTED: usize = 16;
    let mut perf = [AlgoPerf::default(); REQUESTED];
    let mut returned: c_int = 0;
    let (find, heuristic, ws, a, b, c) = match dir {
        Direction::Forward => (l.find_fwd, l.heuristic_fwd, l.ws_fwd, plan.x, plan.w, plan.y),
        Direction::BackwardData => {
            (l.find_bwd_data, l.heuristic_bwd_data, l.ws_bwd_data, plan.w, plan.y, plan.x)
        }
        Direction::BackwardFilter => {
            (l.find_bwd_filter, l.heuristic_bwd_filter, l.ws_bwd_filter, plan.x, plan.y, plan.w)
        }
    };
    let (f, name) = if benchmark() {
        (find, "cudnnFind*Algorithm")
    } else {
        (heuristic, "cudnnGet*Algorithm_v7")
    };
    // SAFETY: the descriptors are the plan's live ones in the order the call takes for this
    // direction; `perf` has room for REQUESTED results and cuDNN writes `returned` of them.
    let rc = unsafe {
        f(handle, a, b, plan.conv, c, REQUESTED as c_int, &mut returned, perf.as_mut_ptr())
    };
    l.check(name, rc, ctx)?;
    let found = &perf[..(returned.max(0) as usize).min(REQUESTED)];
    let Some(best) = found
        .iter()
        .find(|p| p.status == library::STATUS_SUCCESS && p.determinism == library::DETERMINISTIC)
    else {
        candle_core::bail!(
            "cuDNN has no deterministic {dir:?} algorithm for {} (it offered {found:?})",
            ctx()
        )
    };
    // The heuristic's memory field is its estimate; ask for the exact size.
    let mut size = 0usize;
    // SAFETY: as above, with the chosen algorithm; writes one size.
    let rc = unsafe { ws(handle, a, b, plan.conv, c, best.algo, &mut size) };
    l.check("cudnnGetConvolution*WorkspaceSize", rc, ctx)?;
    tracing::debug!(
        "cuDNN {dir:?} for {}: algorithm {} ({} B workspace, {:.3} ms)",
        ctx(),
        best.algo,
        size,
        best.time
    );
    Ok((best.algo, size))
}

/// Runs `f(library, handle, plan, algorithm, workspace address, workspace size)` for one
/// direction of the convolution of shape (`x`, `w`, `spec`) on `dev`, finding the algorithm
/// and growing the workspace first if needed.
fn with_plan<R>(
    dev: &CudaDevice,
    dtype: DType,
    (x, w, spec): ([usize; 4], [usize; 4], ConvSpec),
    dir: Direction,
    f: impl FnOnce(&Cudnn, Handle, &Plan, c_int, u64, usize) -> Result<R>,
) -> Result<R> {
    let l = cudnn()?;
    let ctx = || format!("x {x:?}, w {w:?}, {spec:?}, {dtype:?}");
    let ordinal = dev.id();
    STATE.with(|state| {
        let mut state = state.borrow_mut();
        let st = match state.entry(ordinal) {
            std::collections::hash_map::Entry::Occupied(e) => e.into_mut(),
            std::collections::hash_map::Entry::Vacant(e) => {
                let mut handle: Handle = std::ptr::null_mut();
                // SAFETY: writes one handle.
                l.check("cudnnCreate", unsafe { (l.create)(&mut handle) }, &ctx)?;
                e.insert(DeviceState { handle, plans: HashMap::new(), workspace: None })
            }
        };
        let stream = dev.cuda_stream();
        // SAFETY: a live handle and candle's stream for this device (a CUstream is a
        // cudaStream_t); every call below runs on that stream, ordered with candle's kernels.
        let rc = unsafe { (l.set_stream)(st.handle, stream.cu_stream() as *mut c_void) };
        l.check("cudnnSetStream", rc, &ctx)?;
        let key = (ordinal, dtype, x, w, spec);
        let plan = match st.plans.entry(key) {
            std::collections::hash_map::Entry::Occupied(e) => e.into_mut(),
            std::collections::hash_map::Entry::Vacant(e) => {
                e.insert(Plan::new(l, dtype, x, w, spec)?)
            }
        };
        let slot = match dir {
            Direction::Forward => plan.forward,
            Direction::BackwardData => plan.backward_data,
            Direction::BackwardFilter => plan.backward_filter,
        };
        let (algo, size) = match slot {
            Some(found) => found,
            None => {
                let found = choose(l, st.handle, plan, dir, &ctx)?;
                match dir {
                    Direction::Forward => plan.forward = Some(found),
                    Direction::BackwardData => plan.backward_data = Some(found),
                    Direction::BackwardFilter => plan.backward_filter = Some(found),
                }
                found
            }
        };
        if st.workspace.as_ref().is_none_or(|ws| ws.len() < size) {
            // SAFETY: a workspace is scratch cuDNN writes before reading.
            st.workspace = Some(unsafe { dev.alloc::<u8>(size.max(1)) }?);
        }
        let Some(ws) = st.workspace.as_mut() else {
            candle_core::bail!("cuDNN: no workspace for {}", ctx())
        };
        use candle_core::cuda::cudarc::driver::DevicePtrMut;
        let (ws_addr, _sync) = ws.device_ptr_mut(&stream);
        let Some(plan) = st.plans.get(&key) else {
            candle_core::bail!("cuDNN: no plan for {}", ctx())
        };
        let name = match dir {
            Direction::Forward => "cudnn conv forward",
            Direction::BackwardData => "cudnn conv backward data",
            Direction::BackwardFilter => "cudnn conv backward filter",
        };
        let name = format!("{name} {:?}", (x, w, spec.stride));
        crate::profile::time(&stream, &name, || f(l, st.handle, plan, algo, ws_addr, size))
    })
}

fn dims4(dims: &[usize], what: &str) -> Result<[usize; 4]> {
    match dims {
        &[a, b, c, d] => Ok([a, b, c, d]),
        _ => candle_core::bail!("conv2d: {what} must be 4-d, got {dims:?}"),
    }
}

const ONE: f32 = 1.0;
const ZERO: f32 = 0.0;

/// Runs one direction of the convolution of shape (`x`, `w`, `spec`) on `dev` in `dtype`:
/// reads the operands at `a` and `b` (forward: x, w; backward data: w, dy; backward filter:
/// x, dy) and writes a fresh output of `out_len` elements (y, dx or dw). The callers keep
/// `a` and `b` in use (their guards alive) until this returns.
fn convolve(
    dev: &CudaDevice,
    dtype: DType,
    shape: ([usize; 4], [usize; 4], ConvSpec),
    dir: Direction,
    (a, b): (u64, u64),
    out_len: usize,
) -> Result<CudaStorage> {
    let stream = dev.cuda_stream();
    let mut out = alloc(dev, dtype, out_len)?;
    {
        let op = write(&mut out, &Layout::contiguous(out_len), &stream, "conv2d output")?;
        with_plan(dev, dtype, shape, dir, |l, h, plan, algo, ws, size| {
            let (call, name, descs) = match dir {
                Direction::Forward => {
                    (l.forward, "cudnnConvolutionForward", (plan.x, plan.w, plan.y))
                }
                Direction::BackwardData => {
                    (l.backward_data, "cudnnConvolutionBackwardData", (plan.w, plan.y, plan.x))
                }
                Direction::BackwardFilter => {
                    (l.backward_filter, "cudnnConvolutionBackwardFilter", (plan.x, plan.y, plan.w))
                }
            };
            // SAFETY: the plan's descriptors describe the two operands and the output in the
            // order this direction takes them (their dims and dtype); the addresses point at
            // them and at a workspace of `size` bytes; alpha and beta are f32, as the f32
            // accumulation of every data type takes.
            let rc = unsafe {
                call(
                    h,
                    (&ONE as *const f32).cast(),
                    descs.0,
                    a as *const c_void,
                    descs.1,
                    b as *const c_void,
                    plan.conv,
                    algo,
                    ws as *mut c_void,
                    size,
                    (&ZERO as *const f32).cast(),
                    descs.2,
                    op.addr as *mut c_void,
                )
            };
            let (x, w, spec) = shape;
            l.check(name, rc, &|| format!("x {x:?}, w {w:?}, {spec:?}"))
        })?;
    }
    Ok(out)
}

/// `y = conv(x, w)` (what a custom op's `cuda_fwd` returns).
pub fn forward(x: Operand<'_>, w: Operand<'_>, spec: ConvSpec) -> Result<(CudaStorage, Shape)> {
    let (xd, wd) = (dims4(x.1.dims(), "input")?, dims4(w.1.dims(), "weight")?);
    let yd = output_dims(&xd, &wd, spec)?;
    let dev = device_of(x.0);
    let stream = dev.cuda_stream();
    let xp = read(x.0, x.1, &stream, "conv2d input")?;
    let wp = read(w.0, w.1, &stream, "conv2d weight")?;
    if xp.dtype != wp.dtype {
        candle_core::bail!("conv2d: input is {:?}, weight {:?}", xp.dtype, wp.dtype)
    }
    let len = yd.iter().product();
    let shape = (xd, wd, spec);
    let y = convolve(&dev, xp.dtype, shape, Direction::Forward, (xp.addr, wp.addr), len)?;
    Ok((y, Shape::from(yd.to_vec())))
}

/// The input's gradient: `gx = conv_transpose(gy, w)` of the forward of shape `x_dims`.
pub fn backward_data(gy: &Tensor, w: &Tensor, x_dims: &[usize], spec: ConvSpec) -> Result<Tensor> {
    let (xd, wd) = (dims4(x_dims, "input")?, dims4(w.dims(), "weight")?);
    let dev = cuda_device(gy, "conv2d backward")?;
    let stream = dev.cuda_stream();
    let (gy, w) = (gy.contiguous()?, w.contiguous()?);
    let (gr, wr) =
        (CudaRef::new(&gy, "conv2d output gradient")?, CudaRef::new(&w, "conv2d weight")?);
    let gp = read(gr.storage()?, gr.layout, &stream, "conv2d output gradient")?;
    let wp = read(wr.storage()?, wr.layout, &stream, "conv2d weight")?;
    let len = xd.iter().product();
    let shape = (xd, wd, spec);
    let gx = convolve(&dev, gp.dtype, shape, Direction::BackwardData, (wp.addr, gp.addr), len)?;
    Ok(tensor(gx, xd.to_vec()))
}

/// The weight's gradient of the forward of weight shape `w_dims`.
pub fn backward_filter(
    x: &Tensor,
    gy: &Tensor,
    w_dims: &[usize],
    spec: ConvSpec,
) -> Result<Tensor> {
    let (xd, wd) = (dims4(x.dims(), "input")?, dims4(w_dims, "weight")?);
    let dev = cuda_device(x, "conv2d backward")?;
    let stream = dev.cuda_stream();
    let (gy, x) = (gy.contiguous()?, x.contiguous()?);
    let (xr, gr) =
        (CudaRef::new(&x, "conv2d input")?, CudaRef::new(&gy, "conv2d output gradient")?);
    let xp = read(xr.storage()?, xr.layout, &stream, "conv2d input")?;
    let gp = read(gr.storage()?, gr.layout, &stream, "conv2d output gradient")?;
    let len = wd.iter().product();
    let shape = (xd, wd, spec);
    let gw = convolve(&dev, gp.dtype, shape, Direction::BackwardFilter, (xp.addr, gp.addr), len)?;
    Ok(tensor(gw, wd.to_vec()))
}
