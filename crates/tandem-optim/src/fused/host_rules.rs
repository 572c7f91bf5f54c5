//! The CUDA optimizer kernels' element rules (tandem-cuda's `kernels/optim_rules.cuh`), compiled
//! for the host by a plain C++ compiler (`host/optim_rules.cpp`, `-ffp-contract=off`), against
//! the CPU steps they twin, bit for bit: CI checks the kernels' arithmetic without a GPU. The
//! compiler is `$CXX`, else `c++`.
use std::io::Write;
use std::path::Path;
use std::process::{Command, Stdio};

use candle_core::{Device, Tensor, Var};

use super::adam::{running_max, update_moments, update_param, AdamStep};
use super::sgd::{step, Kernel};
use crate::adam::{AdamConfig, AdamHyper};
use crate::sgd::SgdConfig;

/// The host check's executable, in a directory removed with it.
struct Program {
    dir: tempfile::TempDir,
}

impl Program {
    fn compile() -> Self {
        let cuda = Path::new(env!("CARGO_MANIFEST_DIR")).join("../tandem-cuda");
        let dir = tempfile::tempdir().unwrap();
        let cxx = std::env::var_os("CXX").unwrap_or_else(|| "c++".into());
        let out = Command::new(&cxx)
            .args(["-O2", "-std=c++17", "-ffp-contract=off", "-I"])
            .arg(cuda.join("kernels"))
            .arg(cuda.join("host/optim_rules.cpp"))
            .arg("-o")
            .arg(dir.path().join("optim_rules"))
            .output()
            .unwrap_or_else(|e| panic!("running the C++ compiler {cxx:?}: {e}"));
        assert!(
            out.status.success(),
            "compiling host/optim_rules.cpp: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        Program { dir }
    }

    /// The answer to `request`: one row of float bits per element.
    fn ask(&self, request: &str) -> Vec<Vec<u32>> {
        let mut child = Command::new(self.dir.path().join("optim_rules"))
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("running the host check");
        child.stdin.take().unwrap().write_all(request.as_bytes()).unwrap();
        let out = child.wait_with_output().unwrap();
        assert!(out.status.success(), "host check: {}", String::from_utf8_lossy(&out.stderr));
        String::from_utf8(out.stdout)
            .unwrap()
            .lines()
            .map(|l| l.split_whitespace().map(|h| u32::from_str_radix(h, 16).unwrap()).collect())
            .collect()
    }
}

fn hex(x: f32) -> String {
    format!("{:08x}", x.to_bits())
}

/// Values of every sign and size (xorshift), some exactly zero.
fn values(seed: u64, n: usize, scale: f32) -> Vec<f32> {
    let mut s = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..n)
        .map(|i| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            if i % 61 == 0 {
                return 0.0;
            }
            let unit = (s >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0;
            unit * scale * [1.0, 1e-3, 30.0][i % 3]
        })
        .collect()
}

fn vec_of(t: &Tensor) -> Vec<f32> {
    t.flatten_all().unwrap().to_vec1().unwrap()
}

fn assert_bits(what: &str, cpu: &[f32], host: impl Iterator<Item = u32>) {
    let differ: Vec<usize> =
        host.zip(cpu).enumerate().filter(|(_, (h, c))| *h != c.to_bits()).map(|(i, _)| i).collect();
    assert!(
        differ.is_empty(),
        "{what}: {} elements differ, first at {:?}",
        differ.len(),
        differ.first()
    );
}

const N: usize = 301;

#[test]
fn sgd_kernel_rules_equal_the_cpu_step_bit_for_bit() {
    let configs = [
        (0.0, 0.0, 0.0, false),
        (0.0, 5e-4, 0.0, false),
        (0.9, 5e-4, 0.0, false),
        (0.9, 0.0, 0.0, false),
        (0.9, 5e-4, 0.0, true),
        (0.9, 0.0, 0.0, true),
        (0.9, 0.0, 0.1, false),
        (0.9, 5e-4, 0.3, false),
    ];
    let program = Program::compile();
    for (c, &(momentum, weight_decay, dampening, nesterov)) in configs.iter().enumerate() {
        let cfg = SgdConfig { lr: 0.1, momentum, weight_decay, dampening, nesterov };
        let var = Var::from_vec(values(c as u64, N, 1.0), N, &Device::Cpu).unwrap();
        let mut buf: Option<Tensor> = None;
        for s in 0..3 {
            let what = format!("SGD {cfg:?}, step {}", s + 1);
            let g = values(100 + s, N, 0.5);
            let (p0, b0) = (vec_of(var.as_tensor()), buf.as_ref().map(vec_of));
            let k = Kernel::new(&cfg).rule();
            let mut req = format!(
                "sgd {} {} {} {} {} {} {} {} {} {N}\n",
                hex(k.neg_lr),
                hex(k.wd),
                hex(k.momentum),
                hex(k.keep),
                k.has_wd,
                k.has_keep,
                k.nesterov,
                k.use_buf,
                b0.is_none() as i32
            );
            for i in 0..N {
                let b = b0.as_ref().map_or(0.0, |b| b[i]);
                req += &format!("{} {} {}\n", hex(p0[i]), hex(g[i]), hex(b));
            }
            let host = program.ask(&req);
            let grad = Tensor::from_vec(g, N, &Device::Cpu).unwrap();
            buf = step(&cfg, &var, &grad, buf).unwrap();
            assert_bits(
                &format!("{what}: parameter"),
                &vec_of(var.as_tensor()),
                host.iter().map(|r| r[0]),
            );
            if let Some(b) = &buf {
                assert_bits(
                    &format!("{what}: momentum buffer"),
                    &vec_of(b),
                    host.iter().map(|r| r[1]),
                );
            }
        }
    }
}

#[test]
fn adam_kernel_rules_equal_the_cpu_step_bit_for_bit() {
    let program = Program::compile();
    for (c, &(weight_decay, decoupled, amsgrad)) in [
        (0.0, false, false),
        (1e-2, false, false),
        (1e-2, true, false),
        (5e-2, true, true),
        (1e-2, false, true),
    ]
    .iter()
    .enumerate()
    {
        let cfg = AdamConfig { lr: 1e-3, weight_decay, amsgrad, ..Default::default() };
        let h = AdamHyper { cfg: cfg.clone(), decoupled };
        let var = Var::from_vec(values(c as u64 + 10, N, 1.0), N, &Device::Cpu).unwrap();
        let zeros = || Tensor::zeros(N, candle_core::DType::F32, &Device::Cpu).unwrap();
        let (m, v, mx) = (zeros(), zeros(), zeros());
        for s in 1..=3u64 {
            let what = format!("Adam{} {cfg:?}, step {s}", if decoupled { "W" } else { "" });
            let g = values(200 + s, N, 0.5);
            let (p0, m0, v0, mx0) = (vec_of(var.as_tensor()), vec_of(&m), vec_of(&v), vec_of(&mx));
            let k = AdamStep::new(&h, s as f64);
            let r = k.rule();
            let mut req = format!(
                "adam {} {} {} {} {} {} {} {} {} {} {} {N}\n",
                hex(r.coupled_wd),
                hex(r.decay),
                hex(r.one_minus_beta1),
                hex(r.beta2),
                hex(r.one_minus_beta2),
                hex(r.inv_bc2_sqrt),
                hex(r.eps),
                hex(r.neg_step_size),
                r.has_coupled_wd,
                r.has_decay,
                amsgrad as i32
            );
            for i in 0..N {
                req += &format!(
                    "{} {} {} {} {}\n",
                    hex(p0[i]),
                    hex(g[i]),
                    hex(m0[i]),
                    hex(v0[i]),
                    hex(mx0[i])
                );
            }
            let host = program.ask(&req);
            let grad = Tensor::from_vec(g, N, &Device::Cpu).unwrap();
            update_moments(k, &var, &grad, &m, &v).unwrap();
            if amsgrad {
                running_max(&mx, &v).unwrap();
            }
            update_param(k, &var, &m, if amsgrad { &mx } else { &v }).unwrap();
            assert_bits(
                &format!("{what}: parameter"),
                &vec_of(var.as_tensor()),
                host.iter().map(|r| r[0]),
            );
            assert_bits(&format!("{what}: exp_avg"), &vec_of(&m), host.iter().map(|r| r[1]));
            assert_bits(&format!("{what}: exp_avg_sq"), &vec_of(&v), host.iter().map(|r| r[2]));
            assert_bits(
                &format!("{what}: max_exp_avg_sq"),
                &vec_of(&mx),
                host.iter().map(|r| r[3]),
            );
        }
    }
}
