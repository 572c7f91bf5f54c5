//! A minimal zip writer for `.pt` archives: stored (uncompressed) entries whose data starts on a
//! 64-byte boundary (what torch.save does, so `torch.load(mmap=True)` can map storages), zip64
//! records when sizes or offsets pass 4 GiB.
//!
//! Hand-written because the archive is write-once and streamed straight from tensor memory: the
//! CRC is computed before the header, so large storages go to the file with one `write_all` and no
//! data descriptors, and we control the alignment padding exactly. Reading uses the `zip` crate.
use std::io::{self, Write};

pub const ALIGN: u64 = 64;
const U32_MAX: u64 = 0xffff_ffff;
const DOS_DATE_1980_01_01: u16 = 0x21;

struct Entry {
    name: String,
    crc: u32,
    size: u64,
    offset: u64,
}

pub struct ZipWriter<W: Write> {
    out: W,
    pos: u64,
    entries: Vec<Entry>,
}

impl<W: Write> ZipWriter<W> {
    pub fn new(out: W) -> Self {
        ZipWriter { out, pos: 0, entries: Vec::new() }
    }

    fn put(&mut self, b: &[u8]) -> io::Result<()> {
        self.out.write_all(b)?;
        self.pos += b.len() as u64;
        Ok(())
    }

    /// Appends one stored entry holding `data`.
    pub fn add(&mut self, name: &str, data: &[u8]) -> io::Result<()> {
        let crc = crc32fast::hash(data);
        let size = data.len() as u64;
        let offset = self.pos;
        let zip64 = size >= U32_MAX;
        let zip64_len = if zip64 { 20 } else { 0 };
        let base = offset + 30 + name.len() as u64 + zip64_len;
        // The padding lives in an extra field (id "FB", as torch writes it): 4 header bytes + pad.
        let pad = (ALIGN - (base + 4) % ALIGN) % ALIGN;
        let mut h = Vec::with_capacity(30 + name.len() + 100);
        h.extend_from_slice(&0x0403_4b50u32.to_le_bytes());
        h.extend_from_slice(&(if zip64 { 45u16 } else { 20u16 }).to_le_bytes());
        h.extend_from_slice(&0u16.to_le_bytes()); // flags
        h.extend_from_slice(&0u16.to_le_bytes()); // method: stored
        h.extend_from_slice(&0u16.to_le_bytes()); // time
        h.extend_from_slice(&DOS_DATE_1980_01_01.to_le_bytes());
        h.extend_from_slice(&crc.to_le_bytes());
        let small = if zip64 { U32_MAX as u32 } else { size as u32 };
        h.extend_from_slice(&small.to_le_bytes());
        h.extend_from_slice(&small.to_le_bytes());
        h.extend_from_slice(&(name.len() as u16).to_le_bytes());
        h.extend_from_slice(&((zip64_len + 4 + pad) as u16).to_le_bytes());
        h.extend_from_slice(name.as_bytes());
        if zip64 {
            h.extend_from_slice(&1u16.to_le_bytes());
            h.extend_from_slice(&16u16.to_le_bytes());
            h.extend_from_slice(&size.to_le_bytes());
            h.extend_from_slice(&size.to_le_bytes());
        }
        h.extend_from_slice(b"FB");
        h.extend_from_slice(&(pad as u16).to_le_bytes());
        h.resize(h.len() + pad as usize, 0);
        self.put(&h)?;
        debug_assert_eq!(self.pos % ALIGN, 0);
        self.put(data)?;
        self.entries.push(Entry { name: name.to_string(), crc, size, offset });
        Ok(())
    }

    /// Writes the central directory and returns the inner writer.
    pub fn finish(mut self) -> io::Result<W> {
        let cd_start = self.pos;
        let entries = std::mem::take(&mut self.entries);
        for e in &entries {
            let big_size = e.size >= U32_MAX;
            let big_off = e.offset >= U32_MAX;
            let mut extra = Vec::new();
            if big_size {
                extra.extend_from_slice(&e.size.to_le_bytes());
                extra.extend_from_slice(&e.size.to_le_bytes());
            }
            if big_off {
                extra.extend_from_slice(&e.offset.to_le_bytes());
            }
            let mut h = Vec::with_capacity(46 + e.name.len() + 32);
            h.extend_from_slice(&0x0201_4b50u32.to_le_bytes());
            h.extend_from_slice(&45u16.to_le_bytes()); // made by
            h.extend_from_slice(&(if big_size || big_off { 45u16 } else { 20u16 }).to_le_bytes());
            h.extend_from_slice(&0u16.to_le_bytes());
            h.extend_from_slice(&0u16.to_le_bytes());
            h.extend_from_slice(&0u16.to_le_bytes());
            h.extend_from_slice(&DOS_DATE_1980_01_01.to_le_bytes());
            h.extend_from_slice(&e.crc.to_le_bytes());
            let small = if big_size { U32_MAX as u32 } else { e.size as u32 };
            h.extend_from_slice(&small.to_le_bytes());
            h.extend_from_slice(&small.to_le_bytes());
            h.extend_from_slice(&(e.name.len() as u16).to_le_bytes());
            let extra_len = if extra.is_empty() { 0 } else { 4 + extra.len() };
            h.extend_from_slice(&(extra_len as u16).to_le_bytes());
            h.extend_from_slice(&0u16.to_le_bytes()); // comment
            h.extend_from_slice(&0u16.to_le_bytes()); // disk
            h.extend_from_slice(&0u16.to_le_bytes()); // internal attrs
            h.extend_from_slice(&0u32.to_le_bytes()); // external attrs
            let off = if big_off { U32_MAX as u32 } else { e.offset as u32 };
            h.extend_from_slice(&off.to_le_bytes());
            h.extend_from_slice(e.name.as_bytes());
            if !extra.is_empty() {
                h.extend_from_slice(&1u16.to_le_bytes());
                h.extend_from_slice(&(extra.len() as u16).to_le_bytes());
                h.extend_from_slice(&extra);
            }
            self.put(&h)?;
        }
        let cd_size = self.pos - cd_start;
        let n = entries.len() as u64;
        let zip64 = cd_start >= U32_MAX || n >= 0xffff;
        if zip64 {
            let eocd64 = self.pos;
            let mut h = Vec::new();
            h.extend_from_slice(&0x0606_4b50u32.to_le_bytes());
            h.extend_from_slice(&44u64.to_le_bytes());
            h.extend_from_slice(&45u16.to_le_bytes());
            h.extend_from_slice(&45u16.to_le_bytes());
            h.extend_from_slice(&0u32.to_le_bytes());
            h.extend_from_slice(&0u32.to_le_bytes());
            h.extend_from_slice(&n.to_le_bytes());
            h.extend_from_slice(&n.to_le_bytes());
            h.extend_from_slice(&cd_size.to_le_bytes());
            h.extend_from_slice(&cd_start.to_le_bytes());
            h.extend_from_slice(&0x0706_4b50u32.to_le_bytes());
            h.extend_from_slice(&0u32.to_le_bytes());
            h.extend_from_slice(&eocd64.to_le_bytes());
            h.extend_from_slice(&1u32.to_le_bytes());
            self.put(&h)?;
        }
        let mut h = Vec::new();
        h.extend_from_slice(&0x0605_4b50u32.to_le_bytes());
        h.extend_from_slice(&0u16.to_le_bytes());
        h.extend_from_slice(&0u16.to_le_bytes());
        let n16 = if zip64 { 0xffff } else { n as u16 };
        h.extend_from_slice(&n16.to_le_bytes());
        h.extend_from_slice(&n16.to_le_bytes());
        h.extend_from_slice(&(cd_size.min(U32_MAX) as u32).to_le_bytes());
        h.extend_from_slice(&(if zip64 { U32_MAX as u32 } else { cd_start as u32 }).to_le_bytes());
        h.extend_from_slice(&0u16.to_le_bytes());
        self.put(&h)?;
        self.out.flush()?;
        Ok(self.out)
    }
}
