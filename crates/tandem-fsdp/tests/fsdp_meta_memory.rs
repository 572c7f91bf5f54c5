//! A model built on meta is never whole: the bytes alive at once while 4 ranks (threads of
//! this process, so one count holds them all) build a 32 MB model and shard it, against the
//! same model built in a `VarMap` and then sharded. Alone in its program: the count is the
//! process's.
use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicUsize, Ordering::SeqCst};

use candle_core::{DType, Device};
use candle_nn::{VarBuilder, VarMap};
use tandem_fsdp::{Fsdp, FsdpOptions, MetaVarMap, Units};
use tandem_testutil::run_tcp_world;

/// The system allocator, counting the bytes alive and their peak.
struct Counting;

static LIVE: AtomicUsize = AtomicUsize::new(0);
static PEAK: AtomicUsize = AtomicUsize::new(0);

fn grew(by: usize) {
    let now = LIVE.fetch_add(by, SeqCst) + by;
    PEAK.fetch_max(now, SeqCst);
}

// SAFETY: every call is handed to `System` unchanged; only counters are updated beside it.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        // SAFETY: the caller's contract for `alloc`, passed on.
        let p = unsafe { System.alloc(layout) };
        if !p.is_null() {
            grew(layout.size());
        }
        p
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        // SAFETY: as for `alloc`.
        let p = unsafe { System.alloc_zeroed(layout) };
        if !p.is_null() {
            grew(layout.size());
        }
        p
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: `ptr` came from this allocator (that is, from `System`) with `layout`.
        unsafe { System.dealloc(ptr, layout) };
        LIVE.fetch_sub(layout.size(), SeqCst);
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        // SAFETY: as for `dealloc`, and `new_size` as the caller promises.
        let p = unsafe { System.realloc(ptr, layout, new_size) };
        if !p.is_null() {
            LIVE.fetch_sub(layout.size(), SeqCst);
            grew(new_size);
        }
        p
    }
}

#[global_allocator]
static ALLOCATOR: Counting = Counting;

const WORLD: usize = 4;
const DIM: usize = 1024;

/// An embedding of 4096 x 1024 and four 1024 x 1024 linears: 8 Mi floats, 32 MiB.
fn build(vb: VarBuilder) {
    let _ = candle_nn::embedding(4 * DIM, DIM, vb.pp("wte")).unwrap();
    for i in 0..4 {
        let _ = candle_nn::linear_no_bias(DIM, DIM, vb.pp(format!("blocks.{i}"))).unwrap();
    }
}
const MODEL_BYTES: usize = 8 * DIM * DIM * 4;

fn opts() -> FsdpOptions {
    FsdpOptions {
        units: Units::prefixes((0..4).map(|i| format!("blocks.{i}"))),
        ..Default::default()
    }
}

/// The most bytes alive at once while `f` runs, above those alive before it.
fn peak_during(f: impl FnOnce()) -> usize {
    let before = LIVE.load(SeqCst);
    PEAK.store(before, SeqCst);
    f();
    PEAK.load(SeqCst) - before
}

#[test]
fn four_ranks_built_on_meta_hold_about_one_model_between_them() {
    let meta = peak_during(|| {
        let shards = run_tcp_world(WORLD, |pg| {
            let map = MetaVarMap::new(3);
            build(map.var_builder());
            let fsdp = Fsdp::from_meta(&map, &pg, opts()).unwrap();
            fsdp.shards().iter().map(|s| s.var.elem_count()).sum::<usize>()
        });
        assert_eq!(shards.iter().sum::<usize>() * 4, MODEL_BYTES, "the shards cover the model");
    });
    let varmap = peak_during(|| {
        run_tcp_world(WORLD, |pg| {
            let varmap = VarMap::new();
            build(VarBuilder::from_varmap(&varmap, DType::F32, &Device::Cpu));
            Fsdp::from_varmap(&varmap, &pg, opts()).unwrap();
        });
    });
    let mib = |b: usize| b as f64 / (1 << 20) as f64;
    println!(
        "peak bytes alive, 4 ranks, a {:.0} MiB model: built on meta {:.1} MiB, in a VarMap {:.1} MiB",
        mib(MODEL_BYTES),
        mib(meta),
        mib(varmap)
    );
    // Each rank its quarter, plus a parameter's placeholder bytes for a moment and the group.
    assert!(meta < MODEL_BYTES * 3 / 2, "built on meta: {:.1} MiB", mib(meta));
    // The measure sees whole builds: every rank held the whole model there.
    assert!(varmap > WORLD * MODEL_BYTES, "in a VarMap: {:.1} MiB", mib(varmap));
}
