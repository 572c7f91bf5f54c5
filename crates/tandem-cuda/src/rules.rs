//! The constants of the optimizer kernels' element rules, laid out as `kernels/optim_rules.cuh`
//! declares them (`repr(C)`). Compiled in every build: the CPU optimizers build them for their
//! tests, which check the rules' host compilation against the CPU steps (tandem-optim).
//! Re-exported at the crate root.

/// `torch.optim.SGD`'s constants for one tensor's step.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct SgdRule {
    pub neg_lr: f32,
    pub wd: f32,
    pub momentum: f32,
    pub keep: f32,
    pub has_wd: i32,
    pub has_keep: i32,
    pub nesterov: i32,
    pub use_buf: i32,
}

/// Adam's and AdamW's constants for one step.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct AdamRule {
    pub coupled_wd: f32,
    pub decay: f32,
    pub one_minus_beta1: f32,
    pub beta2: f32,
    pub one_minus_beta2: f32,
    pub inv_bc2_sqrt: f32,
    pub eps: f32,
    pub neg_step_size: f32,
    pub has_coupled_wd: i32,
    pub has_decay: i32,
}
