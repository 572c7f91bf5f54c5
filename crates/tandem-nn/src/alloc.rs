//! Keeps freed tensor memory in the process for reuse (glibc malloc settings).
//!
//! candle allocates a fresh buffer for every op's result and frees it when the step's graph
//! is dropped. With glibc's defaults, blocks of a few MiB are handed back to the kernel on free
//! (mmap threshold, heap trimming), so every training step page-faults and zero-fills tens of
//! MiB again: on the bench MLP (784-1024-1024-10, batch 64, one thread) that was ~45% of the
//! step (19.3 ms vs 10.3 ms). Raising the mmap threshold and the trim threshold makes glibc
//! keep and reuse those blocks, as PyTorch's caching allocators do for their tensors. The
//! cost is that freed memory stays in the process (up to the trim threshold) instead of going
//! back to the system. Other allocators (musl, a custom `#[global_allocator]`) are left alone.
//!
//! Sharded training wants the opposite: a rank's peak memory is the point of FSDP, and its
//! large buffers (a unit's gathered parameters and full gradients, the reduce-scatters' inputs
//! and outputs: hundreds of MiB for ViT-L's head) change size and place every step, so a heap
//! that keeps them grows with holes. [`release_freed_memory`] maps blocks of 16 MiB and more
//! (unmapped on free) and returns a free heap top above glibc's 128 KiB default: ViT-L under
//! `Fsdp` on 2 ranks peaked at 2.58–2.64 GiB per rank instead of 3.15–3.36 (`tandem bench
//! fsdp`, docs/fsdp.md). Mapping from 8 MiB saved little more and made a step 15% slower
//! (every block page-faulted afresh).
use std::sync::OnceLock;

/// Blocks below this come from the heap and are reused after free.
const MMAP_THRESHOLD: i32 = 256 << 20;
/// glibc's largest accepted mmap threshold on 64-bit builds that cap it (HEAP_MAX_SIZE / 2).
const MMAP_THRESHOLD_CAPPED: i32 = 32 << 20;
/// Free memory at the top of the heap is returned to the system only above this.
const TRIM_THRESHOLD: i32 = 1 << 30;
/// [`release_freed_memory`]'s: blocks from here up are mapped, and unmapped when freed.
const SHARDED_MMAP_THRESHOLD: i32 = 16 << 20;
/// [`release_freed_memory`]'s heap trim threshold (glibc's default).
const SHARDED_TRIM_THRESHOLD: i32 = 128 << 10;

static APPLIED: OnceLock<bool> = OnceLock::new();

/// Applies the settings once per process (later calls return the first answer). Returns
/// whether they are in effect: false off glibc, or when `TANDEM_MALLOC=system` asks to keep
/// the allocator's defaults. An opt-in for programs: the `tandem` binary calls it at start,
/// `tandem::init()` does not (a library should not change its host's allocator unasked).
pub fn tune_allocator() -> bool {
    *APPLIED.get_or_init(|| {
        if std::env::var("TANDEM_MALLOC").is_ok_and(|v| v == "system") {
            return false;
        }
        apply()
    })
}

/// For sharded training (FSDP): large blocks (16 MiB and more) are mapped and given back when
/// freed, and a free heap top above 128 KiB is returned, so a rank's memory follows what it
/// holds instead of the most it ever held (see the module docs). Call it at the start of a
/// program that trains with `Fsdp` (`tandem train --fsdp` does), after or instead of
/// [`tune_allocator`]. Returns whether the settings are in effect: false off glibc, or when
/// `TANDEM_MALLOC=system` asks to keep the allocator's defaults.
pub fn release_freed_memory() -> bool {
    if std::env::var("TANDEM_MALLOC").is_ok_and(|v| v == "system") {
        return false;
    }
    apply_sharded()
}

/// Whether [`tune_allocator`] has been called in this process and its settings are in effect.
pub fn allocator_tuned() -> bool {
    APPLIED.get().copied().unwrap_or(false)
}

#[cfg(all(target_os = "linux", target_env = "gnu"))]
fn apply() -> bool {
    // SAFETY: mallopt only changes allocator parameters; it is safe to call at any time.
    unsafe {
        let mmap = libc::mallopt(libc::M_MMAP_THRESHOLD, MMAP_THRESHOLD) == 1
            || libc::mallopt(libc::M_MMAP_THRESHOLD, MMAP_THRESHOLD_CAPPED) == 1;
        let trim = libc::mallopt(libc::M_TRIM_THRESHOLD, TRIM_THRESHOLD) == 1;
        mmap && trim
    }
}

#[cfg(not(all(target_os = "linux", target_env = "gnu")))]
fn apply() -> bool {
    false
}

#[cfg(all(target_os = "linux", target_env = "gnu"))]
fn apply_sharded() -> bool {
    // SAFETY: mallopt only changes allocator parameters; it is safe to call at any time.
    unsafe {
        libc::mallopt(libc::M_MMAP_THRESHOLD, SHARDED_MMAP_THRESHOLD) == 1
            && libc::mallopt(libc::M_TRIM_THRESHOLD, SHARDED_TRIM_THRESHOLD) == 1
    }
}

#[cfg(not(all(target_os = "linux", target_env = "gnu")))]
fn apply_sharded() -> bool {
    false
}

#[cfg(test)]
mod tests {
    #[test]
    fn settings_apply_on_glibc_and_repeat_calls_agree() {
        let first = super::tune_allocator();
        assert_eq!(super::tune_allocator(), first);
        if cfg!(all(target_os = "linux", target_env = "gnu"))
            && std::env::var("TANDEM_MALLOC").is_err()
        {
            assert!(first, "glibc refused the malloc settings");
        }
    }
}
