//! tandem_models against the PyTorch modules they mirror (fixtures/models/make_torch_models.py):
//! torch state dicts load by name, and loss, gradients and BatchNorm statistics match.
use std::collections::HashMap;
use std::path::Path;

use candle_core::{DType, Device, Tensor};
use tandem_models::{Cnn, Mlp};
use tandem_nn::ParamModule;

fn fixture() -> HashMap<String, Tensor> {
    let path = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/models/torch_models.safetensors");
    candle_core::safetensors::load(&path, &Device::Cpu)
        .unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

fn with_prefix(f: &HashMap<String, Tensor>, prefix: &str) -> Vec<(String, Tensor)> {
    let mut v: Vec<_> = f
        .iter()
        .filter_map(|(k, t)| k.strip_prefix(prefix).map(|n| (n.to_string(), t.clone())))
        .collect();
    v.sort_by(|a, b| a.0.cmp(&b.0));
    v
}

fn close(a: &Tensor, b: &Tensor, tol: f32, what: &str) {
    assert_eq!(a.dims(), b.dims(), "{what}");
    let d = (a.to_dtype(DType::F32).unwrap() - b.to_dtype(DType::F32).unwrap())
        .unwrap()
        .abs()
        .unwrap()
        .flatten_all()
        .unwrap()
        .max(0)
        .unwrap();
    let d = d.to_scalar::<f32>().unwrap();
    assert!(d <= tol, "{what}: max abs diff {d}");
}

fn check_grads(m: &impl ParamModule, loss: &Tensor, f: &HashMap<String, Tensor>, prefix: &str) {
    let g = loss.backward().unwrap();
    let names: Vec<String> = m.named_parameters().into_iter().map(|(n, _)| n).collect();
    let mut torch_names: Vec<String> = with_prefix(f, prefix).into_iter().map(|(n, _)| n).collect();
    let mut ours = names.clone();
    ours.sort();
    torch_names.sort();
    assert_eq!(ours, torch_names, "same parameter names as torch's named_parameters()");
    for (n, v) in m.named_parameters() {
        close(
            g.get(v.as_tensor()).unwrap(),
            &f[&format!("{prefix}{n}")],
            1e-5,
            &format!("grad {n}"),
        );
    }
}

#[test]
fn mlp_loads_torch_state_dict_and_matches_loss_and_grads() {
    let f = fixture();
    let m = Mlp::new(&[12, 16, 5], 0, &Device::Cpu).unwrap();
    m.load_named_tensors(with_prefix(&f, "mlp.")).unwrap();
    let loss = m.loss(&f["mlp_x"], &f["mlp_y"].to_dtype(DType::U32).unwrap()).unwrap();
    close(&loss.reshape(1).unwrap(), &f["mlp_loss"], 1e-6, "mlp loss");
    check_grads(&m, &loss, &f, "mlp_grad.");
    // Our state dict goes back under torch's keys and shapes.
    for (k, t) in m.named_tensors() {
        close(&t, &f[&format!("mlp.{k}")], 0.0, &k);
    }
}

#[test]
fn cnn_with_batchnorm_matches_torch_in_train_and_eval_mode() {
    let f = fixture();
    let m = Cnn::new(1, 8, 8, 10, 0, &Device::Cpu).unwrap();
    m.load_named_tensors(with_prefix(&f, "cnn.")).unwrap();
    let loss = m.loss(&f["cnn_x"], &f["cnn_y"].to_dtype(DType::U32).unwrap()).unwrap();
    close(&loss.reshape(1).unwrap(), &f["cnn_loss"], 1e-5, "cnn loss");
    check_grads(&m, &loss, &f, "cnn_grad.");
    let buffers: HashMap<String, Tensor> =
        m.named_buffers().into_iter().map(|(n, v)| (n, v.as_tensor().clone())).collect();
    for (n, t) in with_prefix(&f, "cnn_after.") {
        close(&buffers[&n], &t, 1e-6, &n);
    }
    assert_eq!(
        buffers["bn1.num_batches_tracked"].to_scalar::<i64>().unwrap(),
        f["cnn.bn1.num_batches_tracked"].to_scalar::<i64>().unwrap() + 1
    );
    m.set_training(false);
    close(&m.forward(&f["cnn_x"]).unwrap(), &f["cnn_eval_logits"], 1e-5, "eval logits");
}

#[test]
fn default_init_is_seeded_and_within_pytorch_bounds() {
    let a = Mlp::new(&[784, 64, 10], 5, &Device::Cpu).unwrap();
    let b = Mlp::new(&[784, 64, 10], 5, &Device::Cpu).unwrap();
    let c = Mlp::new(&[784, 64, 10], 6, &Device::Cpu).unwrap();
    let vals = |m: &Mlp, i: usize| {
        m.named_parameters()[i].1.as_tensor().flatten_all().unwrap().to_vec1::<f32>().unwrap()
    };
    assert_eq!(vals(&a, 0), vals(&b, 0));
    assert_ne!(vals(&a, 0), vals(&c, 0));
    // kaiming_uniform(a=sqrt(5)) and the bias rule both give U(-1/sqrt(fan_in), 1/sqrt(fan_in)).
    for (i, fan_in) in [(0, 784f32), (1, 784.), (2, 64.), (3, 64.)] {
        let bound = 1.0 / fan_in.sqrt();
        let v = vals(&a, i);
        let max = v.iter().fold(0f32, |m, x| m.max(x.abs()));
        assert!(max <= bound && max > 0.8 * bound, "param {i}: max |w| {max}, bound {bound}");
        let mean = v.iter().sum::<f32>() / v.len() as f32;
        assert!(mean.abs() < 0.2 * bound, "param {i}: mean {mean}");
    }
    let cnn = Cnn::new(1, 28, 28, 10, 1, &Device::Cpu).unwrap();
    let shapes: Vec<(String, Vec<usize>)> =
        cnn.named_parameters().into_iter().map(|(n, v)| (n, v.dims().to_vec())).collect();
    assert_eq!(shapes[0], ("conv1.weight".to_string(), vec![8, 1, 3, 3]));
    assert_eq!(shapes[6], ("fc.weight".to_string(), vec![10, 16 * 7 * 7]));
}
