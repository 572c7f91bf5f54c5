//! Hostile and broken input: every case must be an error naming the file, never a panic, a
//! hang or an unbounded allocation. Includes a bounded random-mutation loop over the fixtures
//! (the cargo-fuzz target in /fuzz does the same without bounds).
mod common;

use common::fixture;
use tandem_ckpt::pt::load_from_bytes;
use tandem_ckpt::CkptError;

fn load_err(bytes: Vec<u8>) -> CkptError {
    match load_from_bytes("hostile.pt", bytes, true) {
        Ok(v) => panic!("hostile input loaded: {:?}", v.type_name()),
        Err(e) => {
            assert!(e.to_string().contains("hostile.pt"), "error does not name the file: {e}");
            e
        }
    }
}

/// A legacy-format file around `pickle` (magic, protocol 1001, sys_info, the pickle, an empty
/// storage-key list).
fn legacy_with(pickle: &[u8]) -> Vec<u8> {
    let mut f = b"\x80\x02\x8a\x0al\xfc\x9cF\xf9 j\xa8P\x19.".to_vec();
    f.extend_from_slice(b"\x80\x02M\xe9\x03.");
    f.extend_from_slice(b"\x80\x02}q\x00.");
    f.extend_from_slice(pickle);
    f.extend_from_slice(b"\x80\x02].");
    f
}

#[test]
fn truncated_files_fail_cleanly_at_every_length() {
    for name in ["nested.pt", "nested_legacy.pt", "views.pt"] {
        let full = std::fs::read(fixture(name)).unwrap();
        for len in (0..full.len()).step_by(7) {
            let _ = load_err(full[..len].to_vec());
        }
    }
}

#[test]
fn wrong_magic_and_empty_files_are_named() {
    let e = load_err(Vec::new());
    assert!(e.to_string().contains("empty"), "{e}");
    let e = load_err(b"GIF89a not a checkpoint".to_vec());
    assert!(e.to_string().contains("not a torch.save"), "{e}");
}

#[test]
fn corrupt_zip_directory_is_an_error() {
    let mut f = std::fs::read(fixture("nested.pt")).unwrap();
    let eocd = f.windows(4).rposition(|w| w == b"PK\x05\x06").unwrap();
    // Central directory offset pointing past the end of the file.
    f[eocd + 16..eocd + 20].copy_from_slice(&0xfff0_0000u32.to_le_bytes());
    load_err(f);
    let mut f = std::fs::read(fixture("nested.pt")).unwrap();
    let cd = f.windows(4).position(|w| w == b"PK\x01\x02").unwrap();
    f[cd..cd + 200].fill(0xAB);
    load_err(f);
}

#[test]
fn flipped_storage_byte_fails_the_checksum() {
    let mut f = std::fs::read(fixture("all_dtypes.pt")).unwrap();
    // The first occurrence is the local header; its data starts at the next 64-byte boundary.
    let name_end = f.windows(6).position(|w| w == b"data/0").unwrap() + 6;
    let pos = (name_end + 4 + 63) & !63;
    f[pos] ^= 0x40;
    let e = load_err(f);
    assert!(e.to_string().contains("CRC"), "{e}");
}

#[test]
fn huge_length_claims_fail_before_allocating() {
    // BINUNICODE8 claiming 2^62 bytes; BINBYTES claiming 4 GiB; LONG4 claiming 2 GiB.
    for pickle in [
        &b"\x80\x02\x8d\x00\x00\x00\x00\x00\x00\x00\x40."[..],
        &b"\x80\x02B\xff\xff\xff\xff."[..],
        &b"\x80\x02\x8b\x00\x00\x00\x80."[..],
    ] {
        let e = load_err(legacy_with(pickle));
        assert!(e.to_string().contains("bytes left") || e.to_string().contains("truncated"), "{e}");
    }
    // A legacy storage record claiming 2^60 elements.
    // The first storage header follows the storage-key list pickle, which ends in `APPENDS STOP`.
    let mut f = std::fs::read(fixture("nested_legacy.pt")).unwrap();
    let keys_end = f.windows(2).rposition(|w| w == b"e.").unwrap() + 2;
    f[keys_end..keys_end + 8].copy_from_slice(&(1u64 << 60).to_le_bytes());
    let e = load_err(f);
    assert!(e.to_string().contains("more than the file holds"), "{e}");
}

#[test]
fn deep_nesting_is_an_error_not_a_stack_overflow() {
    let n = 200_000;
    let mut p = b"\x80\x02".to_vec();
    p.extend(std::iter::repeat_n(b']', n));
    p.extend(std::iter::repeat_n(b'a', n - 1));
    p.push(b'.');
    let e = load_err(legacy_with(&p));
    assert!(e.to_string().contains("nested deeper"), "{e}");
}

#[test]
fn exponential_sharing_hits_the_value_budget() {
    // x = []; 64 times: x = (x, x)  ->  2^64 leaves when expanded into a tree.
    let mut p = b"\x80\x02]".to_vec();
    for _ in 0..64 {
        p.extend_from_slice(b"2\x86"); // DUP, TUPLE2
    }
    p.push(b'.');
    let e = load_err(legacy_with(&p));
    assert!(e.to_string().contains("too many values"), "{e}");
}

#[test]
fn a_memoized_byte_string_repeated_hits_the_byte_budget() {
    // One 1 MiB byte string, memoized, then referenced 50,000 times from a list: a 100 KB
    // pickle that would expand to 50 GB of values.
    let mut p = b"\x80\x02B".to_vec();
    p.extend_from_slice(&(1u32 << 20).to_le_bytes());
    p.extend(std::iter::repeat_n(0xABu8, 1 << 20));
    p.extend_from_slice(b"q\x00](");
    for _ in 0..50_000 {
        p.extend_from_slice(b"h\x00");
    }
    p.extend_from_slice(b"e.");
    let e = load_err(legacy_with(&p));
    assert!(e.to_string().contains("too many bytes"), "{e}");
}

#[test]
fn forbidden_globals_are_named() {
    for (module, name) in [
        ("os", "system"),
        ("builtins", "eval"),
        ("__main__", "Net"),
        ("torch.nn.modules.linear", "Linear"),
    ] {
        let p = format!("\x63{module}\n{name}\n.");
        let mut pk = b"\x80\x02".to_vec();
        pk.extend_from_slice(p.as_bytes());
        match load_err(legacy_with(&pk)) {
            CkptError::ForbiddenGlobal { global, .. } => {
                assert_eq!(global, format!("{module}.{name}"))
            }
            other => panic!("{other}"),
        }
    }
}

#[test]
fn tensor_view_outside_its_storage_is_rejected() {
    // views.pt, with the "slice" tensor's storage offset (BININT1 8) bumped far past the end.
    let f = std::fs::read(fixture("views_legacy.pt")).unwrap();
    let v = tandem_ckpt::load(fixture("views_legacy.pt")).unwrap();
    assert_eq!(v.get("slice").unwrap().as_tensor().unwrap().storage_offset, 8);
    let mut hit = false;
    // The offset follows the persistent id: BINPERSID 'Q' then BININT1 'K' 0x08.
    for i in 0..f.len() - 2 {
        if f[i] == b'Q' && f[i + 1] == b'K' && f[i + 2] == 8 {
            let mut g = f.clone();
            g[i + 1] = b'M'; // BININT2 0x0008 -> 0xff08 with the next byte
            g.insert(i + 3, 0xff);
            let e = load_err(g);
            assert!(e.to_string().contains("storage has"), "{e}");
            hit = true;
        }
    }
    assert!(hit, "fixture layout changed");
}

/// xorshift64*: a deterministic byte source for the mutation loop.
struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }
}

#[test]
fn random_mutations_of_fixtures_never_panic() {
    let seeds: Vec<Vec<u8>> =
        ["nested.pt", "nested_legacy.pt", "views.pt", "views_legacy.pt", "all_dtypes_legacy.pt"]
            .iter()
            .map(|n| std::fs::read(fixture(n)).unwrap())
            .collect();
    let mut rng = Rng(0x9e37_79b9_7f4a_7c15);
    let iters: usize =
        std::env::var("TANDEM_MUTATION_ITERS").ok().and_then(|s| s.parse().ok()).unwrap_or(3000);
    for _ in 0..iters {
        let mut f = seeds[(rng.next() % seeds.len() as u64) as usize].clone();
        for _ in 0..1 + rng.next() % 8 {
            let i = (rng.next() % f.len() as u64) as usize;
            match rng.next() % 4 {
                0 => f[i] = rng.next() as u8,
                1 => f[i] ^= 1 << (rng.next() % 8),
                2 => {
                    let v = [0u8, 0xff, 0x7f, 0x80][(rng.next() % 4) as usize];
                    f[i] = v
                }
                _ => f.truncate(i.max(1)),
            }
        }
        // Either outcome is fine; a panic fails the test.
        let _ = load_from_bytes("mutant.pt", f.clone(), false);
        let _ = load_from_bytes("mutant.pt", f, true);
    }
}

#[test]
fn saving_a_view_outside_its_storage_is_an_error() {
    let base = tandem_ckpt::TensorData::from_f32(&[4], &[1., 2., 3., 4.]);
    let bad =
        tandem_ckpt::TensorData { shape: vec![3], stride: vec![2], storage_offset: 0, ..base };
    let v = tandem_ckpt::Value::dict_from([("w", tandem_ckpt::Value::Tensor(bad))]);
    let dir = tempfile::tempdir().unwrap();
    let e = tandem_ckpt::save(dir.path().join("a.pt"), &v).unwrap_err();
    assert!(e.to_string().contains("storage has 16"), "{e}");
    assert!(tandem_ckpt::safetensors::save(&dir.path().join("a.safetensors"), &v).is_err());
    // Nothing was left behind: no target, no temp file.
    assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 0);
}
