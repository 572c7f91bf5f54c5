//! PyTorch's distributed checkpoints against real torch (skipped without torch unless
//! TANDEM_REQUIRE_TORCH=1): a directory `dcp.save` wrote on 2 and 3 gloo ranks (a replicated
//! state dict and a row-sharded DTensor) reads in tandem bit for bit, whole and by rows; a
//! directory tandem writes is read by `dcp.load` in one torch process bit for bit.
mod common;

use std::path::Path;
use std::process::Command;
use std::time::Duration;

use common::fixture;
use tandem_ckpt::dcp;
use tandem_ckpt::{load, Value};
use tandem_testutil::{output_with_deadline, torch_python};

fn peer(python: &Path, args: &[&str]) {
    let out = output_with_deadline(
        Command::new(python).arg(fixture("dcp_peer.py")).args(args),
        Duration::from_secs(180),
    );
    assert!(
        out.status.success() && String::from_utf8_lossy(&out.stdout).contains("OK"),
        "dcp_peer.py {args:?} failed:\n{}\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

/// Every tensor bit for bit (and every other value equal), as nested dicts and lists. DCP
/// keeps dict keys as strings (an optimizer state's `0` comes back as "0").
fn assert_same(got: &Value, want: &Value, path: &str) {
    let name = |k: &Value| k.as_str().map(str::to_string).or(k.as_int().map(|i| i.to_string()));
    match (got, want) {
        (Value::Tensor(a), Value::Tensor(b)) => {
            assert_eq!((a.dtype, &a.shape), (b.dtype, &b.shape), "{path}");
            assert_eq!(a.contiguous_bytes(), b.contiguous_bytes(), "{path}: bits differ");
        }
        (a, b) if b.as_dict().is_some() => {
            let a = a.as_dict().unwrap_or_else(|| panic!("{path}: not a dict"));
            let b = b.as_dict().unwrap();
            assert_eq!(a.len(), b.len(), "{path}: keys differ");
            for (k, v) in b {
                let key = name(k).unwrap();
                let other = a.iter().find(|(ka, _)| name(ka).as_ref() == Some(&key));
                let other = other.unwrap_or_else(|| panic!("{path}.{key} missing")).1.clone();
                assert_same(&other, v, &format!("{path}.{key}"));
            }
        }
        (Value::List(a), Value::List(b)) => {
            assert_eq!(a.len(), b.len(), "{path}");
            for (i, (x, y)) in a.iter().zip(b).enumerate() {
                assert_same(x, y, &format!("{path}[{i}]"));
            }
        }
        (a, b) => assert_eq!(a, b, "{path}"),
    }
}

#[test]
fn torch_dcp_directories_read_bit_for_bit_whole_and_by_rows() {
    let Some(python) = torch_python() else { return };
    for world in [2, 3] {
        let dir = tempfile::tempdir().unwrap();
        let (ck, reference) = (dir.path().join("ck"), dir.path().join("ref.pt"));
        peer(
            &python,
            &["save", ck.to_str().unwrap(), reference.to_str().unwrap(), &world.to_string()],
        );
        assert!(dcp::is_dcp_dir(&ck));
        let want = load(&reference).unwrap();
        let got = dcp::load(&ck).unwrap();
        assert_same(&got, &want, "");
        // The sharded weight was written as one chunk per rank; read rows across the cut.
        let md = dcp::read_metadata(&ck).unwrap();
        let Some(dcp::Item::Tensor { chunks, .. }) = md.item("sharded.w") else {
            panic!("no sharded.w")
        };
        assert_eq!(chunks.len(), world, "one chunk per rank");
        let rows = dcp::load_rows(&ck, &md, "sharded.w", 3..8).unwrap();
        let whole =
            want.get("sharded").and_then(|s| s.get("w")).and_then(Value::as_tensor).unwrap();
        assert_eq!(rows.to_f32_vec(), whole.to_f32_vec()[3 * 6..8 * 6], "rows 3..8");
    }
}

#[test]
fn torch_dcp_load_reads_what_tandem_writes_bit_for_bit() {
    let Some(python) = torch_python() else { return };
    let dir = tempfile::tempdir().unwrap();
    let (ck, reference) = (dir.path().join("ck"), dir.path().join("ref.pt"));
    peer(&python, &["save", ck.to_str().unwrap(), reference.to_str().unwrap(), "2"]);
    let value = load(&reference).unwrap();
    let ours = dir.path().join("ours");
    dcp::save(&ours, &value).unwrap();
    peer(&python, &["load", ours.to_str().unwrap(), reference.to_str().unwrap()]);
    // And torch's own directory loads in torch (the peer's check itself).
    peer(&python, &["load", ck.to_str().unwrap(), reference.to_str().unwrap()]);
}

/// torch writes on 2 ranks; 3 tandem ranks each read their third of every row-split tensor
/// (only the chunks they overlap) and write it as their own file, rank 0 the rest and the
/// metadata; one torch process loads the result bit for bit.
#[test]
fn torch_2_ranks_to_tandem_3_ranks_to_torch_1_rank() {
    let Some(python) = torch_python() else { return };
    let dir = tempfile::tempdir().unwrap();
    let (ck, reference) = (dir.path().join("ck"), dir.path().join("ref.pt"));
    peer(&python, &["save", ck.to_str().unwrap(), reference.to_str().unwrap(), "2"]);
    let md = dcp::read_metadata(&ck).unwrap();
    let whole = dcp::load(&ck).unwrap();
    let ours = dir.path().join("ours");
    let world = 3;
    let mut pieces = Vec::new();
    for rank in 0..world {
        let mut parts = Vec::new();
        for (fqn, item) in &md.items {
            let path = md.paths.iter().find(|(k, _)| k == fqn).map(|(_, p)| p.clone()).unwrap();
            match item {
                dcp::Item::Tensor { size, .. } if size.first().is_some_and(|&d| d >= world) => {
                    // This rank's rows, as tandem's sharded checkpoints split them.
                    let d = size[0];
                    let (start, end) = (d * rank / world, d * (rank + 1) / world);
                    let rows = dcp::load_rows(&ck, &md, fqn, start..end).unwrap();
                    let part = dcp::Part::Rows { size: size.clone(), row_offset: start, rows };
                    parts.push((path, part));
                }
                _ if rank == 0 => {
                    let mut v = &whole;
                    for p in &path {
                        v = match p {
                            dcp::PathPart::Key(k) => v.get(k).unwrap(),
                            dcp::PathPart::Index(i) => &v.as_list().unwrap()[*i as usize],
                        };
                    }
                    parts.push((path, dcp::Part::Whole(v.clone())));
                }
                _ => {}
            }
        }
        pieces.extend(dcp::write_rank(&ours, rank, &parts).unwrap());
    }
    dcp::write_metadata(&ours, pieces).unwrap();
    let md = dcp::read_metadata(&ours).unwrap();
    let Some(dcp::Item::Tensor { chunks, .. }) = md.item("sharded.w") else { panic!("sharded.w") };
    assert_eq!(chunks.len(), world, "one chunk per tandem rank");
    peer(&python, &["load", ours.to_str().unwrap(), reference.to_str().unwrap()]);
}
