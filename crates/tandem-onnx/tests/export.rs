//! The graphs' structure and the errors; outputs against PyTorch and onnxruntime are checked
//! in crates/tandem-cli/tests/onnx_export.rs.
use prost::Message;
use tandem_ckpt::TensorData;
use tandem_onnx::proto::{DimensionValue, ModelProto};
use tandem_onnx::{export, Dim, ModelKind, OnnxError};

fn t(shape: &[usize], seed: f32) -> TensorData {
    let n: usize = shape.iter().product();
    TensorData::from_f32(shape, &(0..n).map(|i| seed + i as f32 * 0.01).collect::<Vec<_>>())
}

fn mlp_state(prefix: &str) -> Vec<(String, TensorData)> {
    vec![
        (format!("{prefix}fc1.weight"), t(&[6, 4], 1.0)),
        (format!("{prefix}fc1.bias"), t(&[6], 2.0)),
        (format!("{prefix}fc2.weight"), t(&[3, 6], 3.0)),
        (format!("{prefix}fc2.bias"), t(&[3], 4.0)),
    ]
}

fn cnn_state(channels: usize, side: usize, classes: usize) -> Vec<(String, TensorData)> {
    let mut s = vec![
        ("conv1.weight".to_string(), t(&[8, channels, 3, 3], 0.0)),
        ("conv1.bias".into(), t(&[8], 0.0)),
        ("bn1.weight".into(), t(&[8], 1.0)),
        ("bn1.bias".into(), t(&[8], 0.0)),
        ("bn1.running_mean".into(), t(&[8], 0.0)),
        ("bn1.running_var".into(), t(&[8], 1.0)),
        ("conv2.weight".into(), t(&[16, 8, 3, 3], 0.0)),
        ("conv2.bias".into(), t(&[16], 0.0)),
        ("fc.weight".into(), t(&[classes, 16 * (side / 4) * (side / 4)], 0.0)),
        ("fc.bias".into(), t(&[classes], 0.0)),
    ];
    s.push(("bn1.num_batches_tracked".into(), TensorData::from_i64(&[], &[3])));
    s
}

fn decoded(arch: ModelKind, state: &[(String, TensorData)]) -> ModelProto {
    let exported = export(arch, state).unwrap();
    ModelProto::decode(tandem_onnx::to_bytes(&exported).as_slice()).unwrap()
}

fn ops(m: &ModelProto) -> Vec<String> {
    m.graph.as_ref().unwrap().node.iter().map(|n| n.op_type.clone()).collect()
}

#[test]
fn mlp_graph_is_gemm_relu_gemm_with_the_weights_bit_exact() {
    let state = mlp_state("module.");
    let m = decoded(ModelKind::Mlp, &state);
    assert_eq!((m.ir_version, m.opset_import[0].version), (8, 17));
    assert_eq!(ops(&m), ["Gemm", "Relu", "Gemm", "Identity"]);
    let g = m.graph.unwrap();
    let dims: Vec<DimensionValue> = g.input[0]
        .r#type
        .as_ref()
        .unwrap()
        .tensor_type
        .as_ref()
        .unwrap()
        .shape
        .as_ref()
        .unwrap()
        .dim
        .iter()
        .map(|d| d.value.clone().unwrap())
        .collect();
    assert_eq!(dims, [DimensionValue::DimParam("batch".into()), DimensionValue::DimValue(4)]);
    assert_eq!(g.output[0].name, "logits");
    // Initializers keep the state-dict names (wrapper removed) and the exact f32 bits.
    for (key, tensor) in &state {
        let name = key.strip_prefix("module.").unwrap();
        let init =
            g.initializer.iter().find(|i| i.name == name).unwrap_or_else(|| panic!("{name}"));
        let values: Vec<f32> =
            init.raw_data.chunks(4).map(|c| f32::from_le_bytes(c.try_into().unwrap())).collect();
        assert_eq!(values, tensor.to_f32_vec(), "{name}");
        assert_eq!(init.dims, tensor.shape.iter().map(|&d| d as i64).collect::<Vec<_>>());
    }
    // Gemm multiplies by W^T, as nn.Linear does.
    let gemm = &g.node[0];
    assert_eq!(gemm.input, ["input", "fc1.weight", "fc1.bias"]);
    assert_eq!((gemm.attribute[0].name.as_str(), gemm.attribute[0].i), ("transB", Some(1)));
}

#[test]
fn cnn_input_shape_comes_from_the_weights() {
    let exported = export(ModelKind::Cnn, &cnn_state(3, 12, 7)).unwrap();
    let batch = Dim::Named("batch");
    assert_eq!(exported.input, [batch, Dim::Fixed(3), Dim::Fixed(12), Dim::Fixed(12)]);
    assert_eq!(exported.classes, 7);
    let m = decoded(ModelKind::Cnn, &cnn_state(1, 8, 10));
    assert_eq!(
        ops(&m),
        [
            "Conv",
            "BatchNormalization",
            "Relu",
            "MaxPool",
            "Conv",
            "Relu",
            "MaxPool",
            "Flatten",
            "Gemm",
            "Identity"
        ]
    );
    // num_batches_tracked is state but not an input of inference.
    assert!(m.graph.unwrap().initializer.iter().all(|i| !i.name.contains("num_batches")));
}

#[test]
fn errors_name_the_key_and_the_model() {
    // No fc1: not an MLP state dict.
    let e = export(ModelKind::Mlp, &cnn_state(1, 8, 10)).err().unwrap();
    assert!(matches!(&e, OnnxError::MissingKey { key, .. } if key == "fc1.weight"), "{e}");
    assert!(e.to_string().contains("mlp") && e.to_string().contains("conv1.weight"), "{e}");

    // An extra layer the graph would not use.
    let mut extra = mlp_state("");
    extra.push(("head.weight".into(), t(&[2, 3], 0.0)));
    let e = export(ModelKind::Mlp, &extra).err().unwrap();
    assert!(matches!(&e, OnnxError::UnexpectedKeys { keys, .. } if keys == "head.weight"), "{e}");

    // fc2 does not take fc1's 6 outputs.
    let mut bad = mlp_state("");
    bad[2].1 = t(&[3, 5], 0.0);
    let e = export(ModelKind::Mlp, &bad).err().unwrap();
    assert!(e.to_string().contains("`fc2.weight` has shape [3, 5], expected [_, 6]"), "{e}");

    // A Cnn whose fc in-features are not 16 * (H/4)^2 for a square image.
    let mut odd = cnn_state(1, 8, 10);
    odd[8].1 = t(&[10, 50], 0.0);
    let e = export(ModelKind::Cnn, &odd).err().unwrap();
    assert!(e.to_string().contains("fc.weight"), "{e}");

    // Integer weights.
    let mut ints = mlp_state("");
    ints[1].1 = TensorData::from_i64(&[6], &[0; 6]);
    let e = export(ModelKind::Mlp, &ints).err().unwrap();
    assert!(matches!(e, OnnxError::NotFloat { .. }), "{e}");

    assert!("vgg".parse::<ModelKind>().unwrap_err().to_string().contains("unknown model `vgg`"));
}

#[test]
fn resnet18_takes_every_key_of_a_torchvision_layout() {
    let w = 2;
    let mut state = vec![("conv1.weight".to_string(), t(&[w, 3, 3, 3], 0.0))];
    let bn = |state: &mut Vec<(String, TensorData)>, p: &str, c: usize| {
        for part in ["weight", "bias", "running_mean", "running_var"] {
            state.push((format!("{p}.{part}"), t(&[c], 1.0)));
        }
        state.push((format!("{p}.num_batches_tracked"), TensorData::from_i64(&[], &[1])));
    };
    bn(&mut state, "bn1", w);
    let mut cin = w;
    for (stage, mult) in [1, 2, 4, 8].into_iter().enumerate() {
        let cout = w * mult;
        for block in 0..2 {
            let p = format!("layer{}.{block}", stage + 1);
            let bin = if block == 0 { cin } else { cout };
            state.push((format!("{p}.conv1.weight"), t(&[cout, bin, 3, 3], 0.0)));
            bn(&mut state, &format!("{p}.bn1"), cout);
            state.push((format!("{p}.conv2.weight"), t(&[cout, cout, 3, 3], 0.0)));
            bn(&mut state, &format!("{p}.bn2"), cout);
            if block == 0 && stage > 0 {
                state.push((format!("{p}.downsample.0.weight"), t(&[cout, bin, 1, 1], 0.0)));
                bn(&mut state, &format!("{p}.downsample.1"), cout);
            }
        }
        cin = cout;
    }
    state.push(("fc.weight".into(), t(&[10, cin], 0.0)));
    state.push(("fc.bias".into(), t(&[10], 0.0)));
    let m = decoded(ModelKind::ResNet18, &state);
    let ops = ops(&m);
    let count = |op: &str| ops.iter().filter(|o| *o == op).count();
    // 20 convolutions (1 + 16 + 3 shortcuts), 20 BatchNorms, 8 residual adds.
    assert_eq!((count("Conv"), count("BatchNormalization"), count("Add")), (20, 20, 8));
    assert_eq!(m.graph.unwrap().initializer.len(), 62 + 2 * 20);

    // Without layer1.1's second conv: named.
    let missing: Vec<_> =
        state.iter().filter(|(k, _)| k != "layer1.1.conv2.weight").cloned().collect();
    let e = export(ModelKind::ResNet18, &missing).err().unwrap();
    assert!(e.to_string().contains("layer1.1.conv2.weight"), "{e}");
}
