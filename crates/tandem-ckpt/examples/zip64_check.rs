//! Writes a `.pt` whose storage is larger than 4 GiB (zip64 sizes and offsets), from a sparse
//! memory-mapped file so it needs no RAM, then reads it back. Check the torch side with:
//!   python -c "import torch,sys; d=torch.load(sys.argv[1],mmap=True,weights_only=True); \
//!              print(d['big'].shape, d['big'][-3:].tolist(), d['small'].tolist())" OUT
//! Usage: cargo run --release -p tandem-ckpt --example zip64_check -- OUT.pt
use std::sync::Arc;

use tandem_ckpt::{ElemType, StorageData, TensorData, Value};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let out = std::env::args().nth(1).ok_or("usage: zip64_check OUT.pt")?;
    let len: usize = (4usize << 30) + 4096 + 3;
    let src = format!("{out}.src");
    let f = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(true)
        .open(&src)?;
    f.set_len(len as u64)?;
    {
        use std::os::unix::fs::FileExt;
        f.write_all_at(&[7, 8, 9], (len - 3) as u64)?;
    }
    // SAFETY: the source file is private to this run and not modified while mapped.
    let map = Arc::new(unsafe { memmap2::Mmap::map(&f)? });
    let big = TensorData {
        dtype: ElemType::U8,
        shape: vec![len],
        stride: vec![1],
        storage_offset: 0,
        storage: StorageData::from_mmap(map, 0, len),
    };
    // A second tensor after the big one: its local header offset is past 4 GiB.
    let small = TensorData::from_f32(&[3], &[1.5, 2.5, 3.5]);
    let v = Value::dict_from([("big", Value::Tensor(big)), ("small", Value::Tensor(small))]);
    let t = std::time::Instant::now();
    tandem_ckpt::save(&out, &v)?;
    eprintln!("saved {out} in {:.1}s", t.elapsed().as_secs_f64());
    std::fs::remove_file(&src)?;
    let back = tandem_ckpt::load_with(
        &out,
        &tandem_ckpt::LoadOptions { verify_checksums: true, ..Default::default() },
    )?;
    let b = back.get("big").and_then(Value::as_tensor).ok_or("no big")?;
    let s = back.get("small").and_then(Value::as_tensor).ok_or("no small")?;
    assert_eq!(b.shape, vec![len]);
    assert_eq!(&b.storage.bytes()[len - 3..], &[7, 8, 9]);
    assert_eq!(s.to_f32_vec(), vec![1.5, 2.5, 3.5]);
    println!("tandem reads it back (CRC verified): big {:?}, small {:?}", b.shape, s.to_f32_vec());
    Ok(())
}
