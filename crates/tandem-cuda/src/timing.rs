//! Honest phase times on a GPU. Kernels run asynchronously: a host clock read after queueing a
//! phase's work measures the queueing, and the GPU time shows up in whichever later phase
//! waits. A [`PhaseClock`] records a CUDA event at each phase boundary on the device's stream
//! and reads the elapsed times once, at the end of the step (one wait per step); on the CPU, or
//! in a build without `cuda`, it reads the host clock, which is honest there.
use std::time::Instant;

use candle_core::Device;

/// Boundaries of a step's phases: [`PhaseClock::mark`] at each, then [`PhaseClock::finish`]
/// returns the seconds between consecutive marks.
pub struct PhaseClock {
    marks: Vec<Mark>,
    device: Device,
}

enum Mark {
    Host(Instant),
    #[cfg(feature = "cuda")]
    Event(candle_core::cuda::cudarc::driver::CudaEvent),
}

impl PhaseClock {
    /// A clock for work on `device`, started now.
    pub fn start(device: &Device) -> crate::Result<Self> {
        let mut clock = PhaseClock { marks: Vec::new(), device: device.clone() };
        clock.mark()?;
        Ok(clock)
    }

    /// Marks the end of a phase (and the start of the next).
    pub fn mark(&mut self) -> crate::Result<()> {
        let mark = match &self.device {
            #[cfg(feature = "cuda")]
            Device::Cuda(d) => {
                use candle_core::cuda::cudarc::driver::sys::CUevent_flags;
                use candle_core::cuda::WrapErr;
                let event =
                    d.cuda_stream().record_event(Some(CUevent_flags::CU_EVENT_DEFAULT)).w()?;
                Mark::Event(event)
            }
            _ => Mark::Host(Instant::now()),
        };
        self.marks.push(mark);
        Ok(())
    }

    /// Seconds between consecutive marks (waits for the device's work up to the last mark).
    pub fn finish(self) -> crate::Result<Vec<f64>> {
        let mut out = Vec::with_capacity(self.marks.len().saturating_sub(1));
        for pair in self.marks.windows(2) {
            let secs = match (&pair[0], &pair[1]) {
                (Mark::Host(a), Mark::Host(b)) => b.duration_since(*a).as_secs_f64(),
                #[cfg(feature = "cuda")]
                (Mark::Event(a), Mark::Event(b)) => {
                    use candle_core::cuda::WrapErr;
                    a.elapsed_ms(b).w()? as f64 / 1e3
                }
                #[cfg(feature = "cuda")]
                _ => candle_core::bail!("PhaseClock: marks of two kinds"),
            };
            out.push(secs);
        }
        Ok(out)
    }
}

/// Waits until `device` has finished the work queued on it (nothing on the CPU).
pub fn synchronize(device: &Device) -> crate::Result<()> {
    device.synchronize()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn host_phases_add_up_to_the_whole() {
        let whole = Instant::now();
        let mut clock = PhaseClock::start(&Device::Cpu).unwrap();
        std::thread::sleep(std::time::Duration::from_millis(5));
        clock.mark().unwrap();
        std::thread::sleep(std::time::Duration::from_millis(10));
        clock.mark().unwrap();
        let phases = clock.finish().unwrap();
        let total = whole.elapsed().as_secs_f64();
        assert_eq!(phases.len(), 2);
        assert!(phases[0] >= 0.005 && phases[1] >= 0.010, "{phases:?}");
        assert!(phases.iter().sum::<f64>() <= total + 1e-6, "{phases:?} > {total}");
    }
}
