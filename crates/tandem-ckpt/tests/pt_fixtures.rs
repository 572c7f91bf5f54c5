//! Reads torch-made fixtures (zip and legacy format) and compares every value, dtype, shape,
//! stride and offset with what torch itself loaded (tests/fixtures/expected.json).
mod common;

use common::{describe, expected, fixture, normalise};
use tandem_ckpt::{load, load_with, CkptError, ElemType, LoadOptions, Value};

fn check(name: &str, file: &str) {
    let v = load(fixture(file)).unwrap_or_else(|e| panic!("{file}: {e}"));
    let got = normalise(&describe(&v));
    let want = expected(name);
    assert_eq!(got, want, "{file} differs from what torch loaded");
}

#[test]
fn zip_format_matches_torch_for_all_fixtures() {
    for name in ["all_dtypes", "views", "nested"] {
        check(name, &format!("{name}.pt"));
    }
}

#[test]
fn legacy_format_matches_torch_for_all_fixtures() {
    for name in ["all_dtypes", "views", "nested"] {
        check(name, &format!("{name}_legacy.pt"));
    }
}

#[test]
fn every_dtype_is_read_with_its_dtype() {
    let v = load(fixture("all_dtypes.pt")).unwrap();
    let want = [
        ("f64", ElemType::F64),
        ("f32", ElemType::F32),
        ("f16", ElemType::F16),
        ("bf16", ElemType::BF16),
        ("i64", ElemType::I64),
        ("i32", ElemType::I32),
        ("i16", ElemType::I16),
        ("i8", ElemType::I8),
        ("u8", ElemType::U8),
        ("bool", ElemType::Bool),
    ];
    for (k, d) in want {
        assert_eq!(v.get(k).and_then(Value::as_tensor).map(|t| t.dtype), Some(d), "{k}");
    }
    assert_eq!(
        v.get("i64_big").unwrap().as_tensor().unwrap().to_i64_vec(),
        vec![1 << 62, -(1 << 62), 1 << 40]
    );
}

#[test]
fn views_and_tied_weights_share_storage() {
    for file in ["views.pt", "views_legacy.pt"] {
        let v = load(fixture(file)).unwrap();
        let t = |k: &str| v.get(k).unwrap().as_tensor().unwrap().clone();
        assert!(
            t("base").storage.same(&t("transposed").storage),
            "{file}: transpose shares storage"
        );
        assert!(t("base").storage.same(&t("slice").storage), "{file}");
        assert!(t("tied_a").storage.same(&t("tied_b").storage), "{file}: tied weights stay tied");
        assert!(t("tied_a").storage.same(&t("tied_view").storage), "{file}");
        assert!(!t("base").storage.same(&t("tied_a").storage), "{file}");
        assert_eq!(t("slice").storage_offset, 8);
        assert_eq!(t("slice").to_f32_vec(), vec![8., 9., 10., 14., 15., 16.]);
        assert!(t("scalar").shape.is_empty());
        assert_eq!(t("scalar").to_f32_vec(), vec![3.25]);
    }
}

#[test]
fn mmap_and_read_paths_agree() {
    let a = load_with(fixture("nested.pt"), &LoadOptions { mmap: false, ..Default::default() })
        .unwrap();
    let b = load_with(
        fixture("nested.pt"),
        &LoadOptions { verify_checksums: true, ..Default::default() },
    )
    .unwrap();
    assert_eq!(a, b);
}

#[test]
fn pickled_module_is_refused_naming_the_global() {
    let e = load(fixture("whole_module.pt")).unwrap_err();
    match &e {
        CkptError::ForbiddenGlobal { global, .. } => {
            assert!(global.contains("Net") || global.contains("torch.nn"), "{global}")
        }
        other => panic!("expected ForbiddenGlobal, got {other}"),
    }
    assert!(e.to_string().contains("whole_module.pt"), "{e}");
}

#[test]
fn map_location_parses_cpu_and_cuda() {
    use tandem_ckpt::MapLocation;
    assert_eq!("cpu".parse::<MapLocation>().unwrap(), MapLocation::Cpu);
    assert_eq!("cuda:3".parse::<MapLocation>().unwrap(), MapLocation::Cuda(3));
    assert!("tpu:0".parse::<MapLocation>().is_err());
    assert!("cuda:x".parse::<MapLocation>().is_err());
}

#[test]
fn python_values_weights_only_allows_are_read() {
    let v = load(fixture("python_values.pt")).unwrap();
    let p = v.get("param").unwrap().as_tensor().unwrap();
    assert_eq!((p.shape.clone(), p.to_f32_vec()), (vec![2, 2], vec![1.0; 4]));
    assert_eq!(v.get("device"), Some(&Value::Str("cuda:1".into())));
    assert_eq!(v.get("set"), Some(&Value::List(vec![Value::Int(1), Value::Int(2)])));
    assert_eq!(v.get("frozenset"), Some(&Value::List(vec![Value::Int(3)])));
    assert_eq!(v.get("size"), Some(&Value::Tuple(vec![Value::Int(2), Value::Int(3)])));
    assert_eq!(v.get("dtype"), Some(&Value::Str("torch.float16".into())));
    assert_eq!(v.get("bytearray"), Some(&Value::Bytes(b"xy".to_vec())));
    assert!(v.get("nan").and_then(Value::as_float).is_some_and(f64::is_nan));
}

#[test]
fn unsupported_torch_dtype_is_named_not_called_forbidden() {
    let e = load(fixture("complex.pt")).unwrap_err();
    assert!(matches!(e, CkptError::Format { .. }), "{e}");
    let msg = e.to_string();
    assert!(msg.contains("torch.ComplexFloatStorage") && msg.contains("does not support"), "{msg}");
}

/// torch.save of a file named with a 21-character stem: its first central-directory entry is as
/// long as the zip64 end records after the central directory, which the zip crate's archive
/// offset detection took for prepended data ("Invalid Central Directory header").
#[test]
fn a_torch_file_whose_first_directory_entry_is_76_bytes_loads() {
    let v = load_with(fixture("name_of_21_characters.pt"), &LoadOptions::default()).unwrap();
    let w = v.get("w").and_then(|w| w.as_tensor()).expect("tensor w");
    assert_eq!(w.shape, [2, 3]);
    assert_eq!(w.to_f32_vec(), [0.0, 1.0, 2.0, 3.0, 4.0, 5.0]);
}
