//! Profiling switches, read from `TANDEM_PROFILE` once per process:
//!
//! - `phases`: the training step waits for the device at each phase's end, so the host clock's
//!   split (data, forward, head, backward, optimizer) is the device's (it slows the run: the
//!   host no longer runs ahead of the GPU);
//! - `ops`: also every tandem-cuda kernel and cuDNN call is timed with a pair of CUDA events,
//!   and [`take_op_times`] sums them by name (candle's own kernels are not seen).
use std::collections::BTreeMap;
#[cfg(feature = "cuda")]
use std::sync::Mutex;
use std::sync::OnceLock;

/// What `TANDEM_PROFILE` asks for.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum Profile {
    Off,
    Phases,
    Ops,
}

/// The process's profiling mode (`TANDEM_PROFILE=phases|ops`; anything else is off).
pub fn mode() -> Profile {
    static MODE: OnceLock<Profile> = OnceLock::new();
    *MODE.get_or_init(|| match std::env::var("TANDEM_PROFILE").as_deref() {
        Ok("phases") => Profile::Phases,
        Ok("ops") => Profile::Ops,
        _ => Profile::Off,
    })
}

/// One op's total device time over a run.
#[derive(Clone, Debug, PartialEq)]
pub struct OpTime {
    pub name: String,
    pub calls: u64,
    pub millis: f64,
}

#[cfg(feature = "cuda")]
type EventPair = (
    String,
    candle_core::cuda::cudarc::driver::CudaEvent,
    candle_core::cuda::cudarc::driver::CudaEvent,
);

#[cfg(feature = "cuda")]
fn recorded() -> &'static Mutex<Vec<EventPair>> {
    static RECORDED: OnceLock<Mutex<Vec<EventPair>>> = OnceLock::new();
    RECORDED.get_or_init(|| Mutex::new(Vec::new()))
}

/// Runs `f` (which queues work on `stream`) between two events when profiling ops.
#[cfg(feature = "cuda")]
pub(crate) fn time<R>(
    stream: &candle_core::cuda::cudarc::driver::CudaStream,
    name: &str,
    f: impl FnOnce() -> crate::Result<R>,
) -> crate::Result<R> {
    use candle_core::cuda::cudarc::driver::sys::CUevent_flags;
    use candle_core::cuda::WrapErr;
    if mode() != Profile::Ops {
        return f();
    }
    let start = stream.record_event(Some(CUevent_flags::CU_EVENT_DEFAULT)).w()?;
    let out = f()?;
    let end = stream.record_event(Some(CUevent_flags::CU_EVENT_DEFAULT)).w()?;
    recorded().lock().unwrap_or_else(|p| p.into_inner()).push((name.to_string(), start, end));
    Ok(out)
}

/// `ops` as lines: the total, then each op's time and calls, as `tandem train` prints them.
pub fn op_times_text(ops: &[OpTime]) -> String {
    let total: f64 = ops.iter().map(|o| o.millis).sum();
    let mut text =
        format!("device time by op (rank 0, whole run): {total:.1} ms in {} kinds\n", ops.len());
    for o in ops {
        text += &format!("  {:>10.2} ms {:>7} calls  {}\n", o.millis, o.calls, o.name);
    }
    text
}

/// The ops timed since the last call, summed by name, slowest first (waits for their events).
pub fn take_op_times() -> crate::Result<Vec<OpTime>> {
    #[cfg_attr(not(feature = "cuda"), allow(unused_mut))]
    let mut by_name: BTreeMap<String, (u64, f64)> = BTreeMap::new();
    #[cfg(feature = "cuda")]
    {
        use candle_core::cuda::WrapErr;
        let taken = std::mem::take(&mut *recorded().lock().unwrap_or_else(|p| p.into_inner()));
        for (name, start, end) in taken {
            let ms = start.elapsed_ms(&end).w()? as f64;
            let e = by_name.entry(name).or_default();
            e.0 += 1;
            e.1 += ms;
        }
    }
    let mut out: Vec<OpTime> =
        by_name.into_iter().map(|(name, (calls, millis))| OpTime { name, calls, millis }).collect();
    out.sort_by(|a, b| b.millis.total_cmp(&a.millis));
    Ok(out)
}
