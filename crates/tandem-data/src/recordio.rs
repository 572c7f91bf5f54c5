//! MXNet's indexed RecordIO (dmlc-core's format), as insightface ships face datasets
//! (`train.rec` + `train.idx`), and the `IRHeader` each image record starts with.
//!
//! A record on disk: the magic word `0xced7230a`, a length word whose top 3 bits are the
//! continuation flag (0 whole record, 1 first part, 2 middle, 3 last) and low 29 bits the part's
//! length, the part's bytes, zero padding to 4 bytes. A writer splits a record wherever the magic
//! word appears at a 4-byte-aligned position of the payload and drops that word; a reader puts
//! it back between parts. The `.idx` file has one `key\toffset` line per record.
//!
//! `IRHeader` (`<IfQQ`, 24 bytes): flag, label, id, id2; when `flag > 0`, `flag` more float32
//! labels follow and `label` is ignored. Then the payload (an encoded image).
//!
//! Written here: no maintained crate reads this format.
use std::collections::HashMap;
use std::fs::File;
use std::io::Write;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

use crate::DataError;

/// dmlc-core's record magic word.
pub const MAGIC: u32 = 0xced7_230a;
/// Bytes of `IRHeader` (`<IfQQ`).
pub const IR_HEADER_LEN: usize = 24;
/// Largest part length a length word can hold (29 bits).
const MAX_PART: usize = (1 << 29) - 1;
/// Largest record this reader assembles (bad length words must not allocate the machine).
const MAX_RECORD: usize = 1 << 30;

fn malformed(path: &Path, reason: String) -> DataError {
    DataError::Malformed { path: path.to_path_buf(), reason }
}

fn io(path: &Path) -> impl FnOnce(std::io::Error) -> DataError + '_ {
    move |source| DataError::Io { path: path.to_path_buf(), source }
}

/// A record file opened through its index: records read by key, concurrently.
pub struct IndexedRecordReader {
    rec: PathBuf,
    file: File,
    len: u64,
    keys: Vec<u64>,
    offsets: HashMap<u64, u64>,
}

impl IndexedRecordReader {
    /// Opens `rec` with the index `idx` (`key\toffset` lines). A bad line is an error naming the
    /// index file and the line.
    pub fn open(idx: &Path, rec: &Path) -> Result<Self, DataError> {
        let text = std::fs::read_to_string(idx).map_err(io(idx))?;
        let file = File::open(rec).map_err(io(rec))?;
        let len = file.metadata().map_err(io(rec))?.len();
        let mut keys = Vec::new();
        let mut offsets = HashMap::new();
        for (n, line) in text.lines().enumerate().filter(|(_, l)| !l.trim().is_empty()) {
            let mut fields = line.split('\t');
            let parse = |f: Option<&str>| f.and_then(|v| v.trim().parse::<u64>().ok());
            let (Some(key), Some(offset)) = (parse(fields.next()), parse(fields.next())) else {
                return Err(malformed(
                    idx,
                    format!("line {}: expected `key<TAB>offset`, got {line:?}", n + 1),
                ));
            };
            if offset >= len {
                return Err(malformed(
                    idx,
                    format!(
                        "line {}: offset {offset} of key {key} is past the end of {} ({len} bytes)",
                        n + 1,
                        rec.display()
                    ),
                ));
            }
            if offsets.insert(key, offset).is_some() {
                return Err(malformed(idx, format!("line {}: key {key} appears twice", n + 1)));
            }
            keys.push(key);
        }
        Ok(IndexedRecordReader { rec: rec.to_path_buf(), file, len, keys, offsets })
    }

    /// The keys in index order.
    pub fn keys(&self) -> &[u64] {
        &self.keys
    }

    /// Whether the index holds `key`.
    pub fn contains(&self, key: u64) -> bool {
        self.offsets.contains_key(&key)
    }

    /// The record file's path.
    pub fn path(&self) -> &Path {
        &self.rec
    }

    /// The record stored under `key`, its parts joined.
    pub fn read(&self, key: u64) -> Result<Vec<u8>, DataError> {
        let Some(&offset) = self.offsets.get(&key) else {
            return Err(malformed(&self.rec, format!("no record with key {key} in the index")));
        };
        self.read_at(offset).map_err(|e| match e {
            DataError::Malformed { path, reason } => {
                DataError::Malformed { path, reason: format!("record {key}: {reason}") }
            }
            other => other,
        })
    }

    /// The record starting at byte `offset`.
    pub fn read_at(&self, mut offset: u64) -> Result<Vec<u8>, DataError> {
        let mut out = Vec::new();
        loop {
            let mut head = [0u8; 8];
            if offset + 8 > self.len {
                return Err(malformed(
                    &self.rec,
                    format!("byte offset {offset}: truncated record header"),
                ));
            }
            self.file.read_exact_at(&mut head, offset).map_err(io(&self.rec))?;
            let magic = u32::from_le_bytes(head[..4].try_into().expect("4 bytes"));
            if magic != MAGIC {
                return Err(malformed(
                    &self.rec,
                    format!("byte offset {offset}: magic {magic:#010x}, expected {MAGIC:#010x}"),
                ));
            }
            let word = u32::from_le_bytes(head[4..].try_into().expect("4 bytes"));
            let (cflag, len) = (word >> 29, (word & ((1 << 29) - 1)) as usize);
            if offset + 8 + len as u64 > self.len {
                return Err(malformed(
                    &self.rec,
                    format!("byte offset {offset}: a {len}-byte record part runs past the end of the file ({} bytes)", self.len),
                ));
            }
            if out.len() + len > MAX_RECORD {
                return Err(malformed(
                    &self.rec,
                    format!("byte offset {offset}: record larger than {MAX_RECORD} bytes"),
                ));
            }
            let start = out.len();
            out.resize(start + len, 0);
            self.file.read_exact_at(&mut out[start..], offset + 8).map_err(io(&self.rec))?;
            offset += 8 + len.div_ceil(4) as u64 * 4;
            match cflag {
                0 | 3 => return Ok(out),
                1 | 2 => out.extend_from_slice(&MAGIC.to_le_bytes()),
                other => {
                    return Err(malformed(
                        &self.rec,
                        format!("byte offset {offset}: continuation flag {other}"),
                    ))
                }
            }
        }
    }
}

/// Writes a `.rec` and its `.idx` as MXNet's `MXIndexedRecordIO` does.
pub struct IndexedRecordWriter {
    rec: File,
    idx: File,
    pos: u64,
}

impl IndexedRecordWriter {
    pub fn create(idx: &Path, rec: &Path) -> Result<Self, DataError> {
        Ok(IndexedRecordWriter {
            rec: File::create(rec).map_err(io(rec))?,
            idx: File::create(idx).map_err(io(idx))?,
            pos: 0,
        })
    }

    /// Appends `record` under `key`.
    pub fn write(&mut self, key: u64, record: &[u8]) -> std::io::Result<()> {
        writeln!(self.idx, "{key}\t{}", self.pos)?;
        let encoded = encode_record(record)?;
        self.rec.write_all(&encoded)?;
        self.pos += encoded.len() as u64;
        Ok(())
    }

    pub fn finish(mut self) -> std::io::Result<()> {
        self.rec.flush()?;
        self.idx.flush()?;
        self.rec.sync_all()?;
        self.idx.sync_all()
    }
}

/// One record's bytes on disk: split at aligned magic words, each part with its header, padded.
pub fn encode_record(record: &[u8]) -> std::io::Result<Vec<u8>> {
    if record.len() > MAX_PART {
        return Err(std::io::Error::other(format!(
            "a {}-byte record is larger than RecordIO's {MAX_PART}-byte parts",
            record.len()
        )));
    }
    let magic = MAGIC.to_le_bytes();
    let mut out = Vec::with_capacity(record.len() + 16);
    let mut part_start = 0;
    let part = |out: &mut Vec<u8>, flag: u32, bytes: &[u8]| {
        out.extend_from_slice(&magic);
        out.extend_from_slice(&((flag << 29) | bytes.len() as u32).to_le_bytes());
        out.extend_from_slice(bytes);
        out.resize(out.len().div_ceil(4) * 4, 0);
    };
    let aligned_end = record.len() / 4 * 4;
    for i in (0..aligned_end).step_by(4) {
        if record[i..i + 4] == magic {
            part(&mut out, if part_start == 0 { 1 } else { 2 }, &record[part_start..i]);
            part_start = i + 4;
        }
    }
    part(&mut out, if part_start == 0 { 0 } else { 3 }, &record[part_start..]);
    Ok(out)
}

/// An image record's header.
#[derive(Debug, Clone, PartialEq)]
pub struct IrHeader {
    /// The scalar label (`flag == 0`) or the first of `labels`.
    pub label: f32,
    /// The `flag` labels that follow the header when `flag > 0`.
    pub labels: Vec<f32>,
    pub id: u64,
    pub id2: u64,
}

impl IrHeader {
    /// A header with one scalar label.
    pub fn scalar(label: f32, id: u64) -> Self {
        IrHeader { label, labels: Vec::new(), id, id2: 0 }
    }

    /// A header with a label vector (`flag = labels.len()`).
    pub fn vector(labels: Vec<f32>, id: u64) -> Self {
        IrHeader { label: labels.first().copied().unwrap_or(0.0), labels, id, id2: 0 }
    }

    /// `mx.recordio.pack(header, payload)`.
    pub fn pack(&self, payload: &[u8]) -> Vec<u8> {
        let mut out = Vec::with_capacity(IR_HEADER_LEN + 4 * self.labels.len() + payload.len());
        out.extend_from_slice(&(self.labels.len() as u32).to_le_bytes());
        let scalar = if self.labels.is_empty() { self.label } else { 0.0 };
        out.extend_from_slice(&scalar.to_le_bytes());
        out.extend_from_slice(&self.id.to_le_bytes());
        out.extend_from_slice(&self.id2.to_le_bytes());
        for l in &self.labels {
            out.extend_from_slice(&l.to_le_bytes());
        }
        out.extend_from_slice(payload);
        out
    }

    /// `mx.recordio.unpack(record)`: the header and the payload after it.
    pub fn unpack(record: &[u8]) -> Result<(IrHeader, &[u8]), String> {
        if record.len() < IR_HEADER_LEN {
            return Err(format!(
                "{} bytes, shorter than the {IR_HEADER_LEN}-byte IRHeader",
                record.len()
            ));
        }
        let u32_at = |i: usize| u32::from_le_bytes(record[i..i + 4].try_into().expect("4 bytes"));
        let u64_at = |i: usize| u64::from_le_bytes(record[i..i + 8].try_into().expect("8 bytes"));
        let flag = u32_at(0) as usize;
        let label = f32::from_bits(u32_at(4));
        let (id, id2) = (u64_at(8), u64_at(16));
        let labels_end = IR_HEADER_LEN + 4 * flag;
        if record.len() < labels_end {
            return Err(format!(
                "IRHeader flag {flag} promises {flag} labels; the record has {} bytes",
                record.len()
            ));
        }
        let labels: Vec<f32> =
            (0..flag).map(|i| f32::from_bits(u32_at(IR_HEADER_LEN + 4 * i))).collect();
        let label = labels.first().copied().unwrap_or(label);
        Ok((IrHeader { label, labels, id, id2 }, &record[labels_end..]))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn records_with_magic_words_inside_round_trip() {
        let dir = tempfile::tempdir().unwrap();
        let (idx, rec) = (dir.path().join("t.idx"), dir.path().join("t.rec"));
        let magic = MAGIC.to_le_bytes();
        let mut tricky = vec![1u8, 2, 3, 4];
        tricky.extend_from_slice(&magic); // aligned: split here
        tricky.extend_from_slice(&[9, 9]);
        tricky.extend_from_slice(&magic); // unaligned (offset 10): kept as data
        tricky.extend_from_slice(&[7, 7]);
        tricky.extend_from_slice(&magic); // aligned again (offset 16)
        let records = [vec![], vec![5u8; 7], tricky.clone(), magic.to_vec()];
        let mut w = IndexedRecordWriter::create(&idx, &rec).unwrap();
        for (k, r) in records.iter().enumerate() {
            w.write(k as u64 * 10, r).unwrap();
        }
        w.finish().unwrap();
        let r = IndexedRecordReader::open(&idx, &rec).unwrap();
        assert_eq!(r.keys(), [0, 10, 20, 30]);
        for (k, expect) in records.iter().enumerate() {
            assert_eq!(&r.read(k as u64 * 10).unwrap(), expect, "record {k}");
        }
        let encoded = encode_record(&tricky).unwrap();
        assert_eq!(encoded.len() % 4, 0);
        let flags: Vec<u32> = [0usize, 12, 28]
            .iter()
            .map(|&o| u32::from_le_bytes(encoded[o + 4..o + 8].try_into().unwrap()) >> 29)
            .collect();
        assert_eq!(flags, [1, 2, 3], "first, middle and last parts");
    }

    #[test]
    fn headers_pack_and_unpack_like_mxnet() {
        let h = IrHeader::scalar(7.0, 3);
        let packed = h.pack(b"img");
        assert_eq!(packed.len(), 24 + 3);
        assert_eq!(IrHeader::unpack(&packed).unwrap(), (h, &b"img"[..]));
        let v = IrHeader::vector(vec![11.0, 15.0], 0);
        let packed = v.pack(b"");
        assert_eq!(&packed[..4], &2u32.to_le_bytes());
        assert_eq!(IrHeader::unpack(&packed).unwrap().0.labels, [11.0, 15.0]);
        let e = IrHeader::unpack(&packed[..30]).unwrap_err();
        assert!(e.contains("flag 2"), "{e}");
    }

    #[test]
    fn damaged_files_name_the_file_and_offset() {
        let dir = tempfile::tempdir().unwrap();
        let (idx, rec) = (dir.path().join("t.idx"), dir.path().join("t.rec"));
        let mut w = IndexedRecordWriter::create(&idx, &rec).unwrap();
        w.write(0, &[1u8; 40]).unwrap();
        w.write(1, &[2u8; 40]).unwrap();
        w.finish().unwrap();
        let mut bytes = std::fs::read(&rec).unwrap();
        bytes[48] ^= 0xff; // the second record's magic
        std::fs::write(&rec, &bytes).unwrap();
        let r = IndexedRecordReader::open(&idx, &rec).unwrap();
        let e = r.read(1).unwrap_err().to_string();
        assert!(
            e.contains("t.rec") && e.contains("record 1") && e.contains("byte offset 48"),
            "{e}"
        );
        std::fs::write(&rec, &bytes[..60]).unwrap();
        let e = IndexedRecordReader::open(&idx, &rec).unwrap().read(0).unwrap();
        assert_eq!(e, [1u8; 40], "the first record is intact");
        std::fs::write(&idx, "0\t0\n1\tzero\n").unwrap();
        let e = IndexedRecordReader::open(&idx, &rec).err().unwrap().to_string();
        assert!(e.contains("t.idx") && e.contains("line 2"), "{e}");
    }
}
