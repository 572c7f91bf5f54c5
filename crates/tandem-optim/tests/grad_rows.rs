//! `set_grad_rows`: a step whose gradient holds only some rows (PartialFC's sampled head) is
//! the step of the dense gradient with zeros elsewhere, bit for bit — momentum, weight decay,
//! dampening and Nesterov still move every row — for SGD (in place, row by row) and Adam
//! (densified); bad rows are refused naming the parameter.
use candle_core::backprop::GradStore;
use candle_core::{Device, Tensor, Var};
use tandem_optim::{AdamWConfig, SgdConfig, TorchAdamW, TorchOptimizer, TorchSgd};

// Over two of the row-sparse step's parallel blocks (256 rows each).
const ROWS: usize = 700;
const COLS: usize = 3;

fn weight() -> Var {
    let data: Vec<f32> = (0..ROWS * COLS).map(|i| (i as f32 * 0.37).sin()).collect();
    Var::from_tensor(&Tensor::from_vec(data, (ROWS, COLS), &Device::Cpu).unwrap()).unwrap()
}

/// Step `s`'s gradient rows: a different subset every step (row 0 never, row 6 always).
fn sampled(s: usize) -> (Vec<u32>, Tensor) {
    let rows: Vec<u32> =
        (1..ROWS as u32).filter(|&r| !(r as usize + s).is_multiple_of(3) || r == 6).collect();
    let data: Vec<f32> =
        (0..rows.len() * COLS).map(|i| ((i + 13 * s) as f32 * 0.71).cos() - 0.2).collect();
    let n = rows.len();
    (rows, Tensor::from_vec(data, (n, COLS), &Device::Cpu).unwrap())
}

fn grads_of(var: &Var, g: Tensor) -> GradStore {
    // A GradStore holding `g` for `var`: the gradient of sum(var * g).
    let mut store = (var.as_tensor() * g.detach()).unwrap().sum_all().unwrap().backward().unwrap();
    let got = store.remove(var.as_tensor()).unwrap();
    store.insert(var.as_tensor(), got);
    store
}

fn bits(v: &Var) -> Vec<u32> {
    v.flatten_all().unwrap().to_vec1::<f32>().unwrap().iter().map(|x| x.to_bits()).collect()
}

/// Four steps both ways; the weights and the optimizer state must be identical.
fn same_as_dense(make: &dyn Fn(Var) -> Box<dyn TorchOptimizer>) {
    let (sparse_w, dense_w) = (weight(), weight());
    let (mut sparse, mut dense) = (make(sparse_w.clone()), make(dense_w.clone()));
    for s in 0..4 {
        let (rows, g) = sampled(s);
        let ids = Tensor::from_vec(rows.clone(), rows.len(), &Device::Cpu).unwrap();
        let full = Tensor::zeros((ROWS, COLS), candle_core::DType::F32, &Device::Cpu)
            .unwrap()
            .index_add(&ids, &g, 0)
            .unwrap();
        dense.step(&grads_of(&dense_w, full)).unwrap();
        sparse.set_grad_rows(0, rows).unwrap();
        // The GradStore holds the rows alone under the parameter.
        let mut store = grads_of(&sparse_w, sparse_w.as_tensor().zeros_like().unwrap());
        store.insert(sparse_w.as_tensor(), g);
        sparse.step(&store).unwrap();
        assert_eq!(bits(&sparse_w), bits(&dense_w), "weights after step {s}");
    }
    assert_eq!(sparse.state_dict().unwrap(), dense.state_dict().unwrap());
}

#[test]
fn sgd_row_steps_equal_dense_steps_bit_for_bit() {
    for (momentum, wd, dampening, nesterov) in [
        (0.9, 5e-4, 0.0, false),
        (0.9, 0.0, 0.0, false),
        (0.0, 5e-4, 0.0, false),
        (0.8, 1e-2, 0.1, false),
        (0.9, 1e-3, 0.0, true),
    ] {
        let cfg = SgdConfig { lr: 0.1, momentum, weight_decay: wd, dampening, nesterov };
        same_as_dense(&|w| Box::new(TorchSgd::new(vec![w], cfg.clone()).unwrap()));
    }
}

#[test]
fn adamw_row_steps_equal_dense_steps_bit_for_bit() {
    let cfg = AdamWConfig { lr: 1e-2, weight_decay: 0.1, ..Default::default() };
    same_as_dense(&|w| Box::new(TorchAdamW::new(vec![w], cfg.clone()).unwrap()));
}

#[test]
fn bad_rows_are_refused_naming_the_parameter() {
    let w = weight();
    let mut opt =
        TorchSgd::new(vec![w.clone()], SgdConfig { lr: 0.1, ..Default::default() }).unwrap();
    for bad in [vec![3, 2], vec![1, 1], vec![ROWS as u32]] {
        let e = opt.set_grad_rows(0, bad.clone()).unwrap_err().to_string();
        assert!(e.contains("ascend"), "{bad:?}: {e}");
    }
    assert!(opt.set_grad_rows(1, vec![0]).is_err(), "no parameter 1");
    // Rows announced, a gradient of another row count: named.
    opt.set_grad_rows(0, vec![1, 2]).unwrap();
    let mut store = grads_of(&w, w.as_tensor().zeros_like().unwrap());
    store.insert(
        w.as_tensor(),
        Tensor::zeros((3, COLS), candle_core::DType::F32, &Device::Cpu).unwrap(),
    );
    let e = opt.step(&store).unwrap_err().to_string();
    assert!(e.contains("[3, 3]") && e.contains("[2, 3]"), "{e}");
    // The announcement is used once: the next dense step is a plain step.
    let store =
        grads_of(&w, Tensor::ones((ROWS, COLS), candle_core::DType::F32, &Device::Cpu).unwrap());
    opt.step(&store).unwrap();
}
