//! The two allocator profiles, seen in this process's resident memory: after
//! `tune_allocator` a freed 40 MiB block stays in the process for reuse; after
//! `release_freed_memory` it goes back to the system. Alone in its program: the settings and
//! the count are the process's.

/// Resident bytes of this process.
fn rss() -> u64 {
    let statm = std::fs::read_to_string("/proc/self/statm").unwrap();
    let pages: u64 = statm.split_whitespace().nth(1).unwrap().parse().unwrap();
    pages * 4096
}

/// Resident bytes gained from before a 40 MiB block was filled to after it was freed.
fn kept_after_freeing_40_mib() -> i64 {
    let before = rss();
    let block = vec![1u8; 40 << 20];
    std::hint::black_box(&block);
    drop(block);
    rss() as i64 - before as i64
}

#[test]
fn replicated_training_keeps_freed_blocks_and_sharded_training_returns_them() {
    if !cfg!(all(target_os = "linux", target_env = "gnu"))
        || std::env::var("TANDEM_MALLOC").is_ok_and(|v| v == "system")
    {
        eprintln!("skipped: the profiles are glibc's malloc settings (or TANDEM_MALLOC=system)");
        return;
    }
    const MIB: i64 = 1 << 20;
    assert!(tandem_nn::tune_allocator());
    let kept = kept_after_freeing_40_mib();
    assert!(kept > 32 * MIB, "tune_allocator: {} MiB of the block stayed", kept / MIB);
    assert!(tandem_nn::release_freed_memory());
    let _ = kept_after_freeing_40_mib(); // (gives back what the first block left too)
    let kept = kept_after_freeing_40_mib();
    assert!(kept < 8 * MIB, "release_freed_memory: {} MiB of the block stayed", kept / MIB);
}
