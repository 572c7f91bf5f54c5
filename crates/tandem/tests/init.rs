//! `tandem::init()` joins the group and changes nothing else in the process: malloc tuning is
//! the program's opt-in (`tandem::tune_allocator()`), not a side effect of the library.

#[test]
fn init_leaves_the_allocator_alone_and_tuning_is_an_explicit_opt_in() {
    // A world of one: none of the launcher / Slurm / MPI variables this process may inherit.
    for (k, _) in std::env::vars() {
        let launcher_var = ["RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"]
            .contains(&k.as_str())
            || k.starts_with("SLURM_")
            || k.starts_with("OMPI_COMM_WORLD_")
            || k == "TANDEM_MALLOC";
        if launcher_var {
            // SAFETY: this test binary runs this one test, before any other thread reads the env.
            unsafe { std::env::remove_var(k) };
        }
    }
    let group = tandem::init().expect("a world of one");
    assert_eq!((group.rank(), group.size()), (0, 1));
    assert!(!tandem::allocator_tuned(), "tandem::init() changed the process's malloc settings");

    let applied = tandem::tune_allocator();
    assert_eq!(tandem::allocator_tuned(), applied);
    if cfg!(all(target_os = "linux", target_env = "gnu")) {
        assert!(applied, "glibc refused the malloc settings");
    }
}
