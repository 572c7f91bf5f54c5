//! `torch.save` files: reading the zip format (PyTorch >= 1.6) and the legacy format
//! (`_use_new_zipfile_serialization=False`), and writing the zip format so that
//! `torch.load(path, weights_only=True)` returns the same values.
use std::collections::HashMap;
use std::fs::File;
use std::io::{BufWriter, Cursor, Read};
use std::path::Path;
use std::str::FromStr;
use std::sync::Arc;

use crate::error::{CkptError, Result};
use crate::pickle::read::{unpickle, PickleError, StorageRef, Unpickled};
use crate::pickle::write::Pickler;
use crate::value::{StorageData, Value};
use crate::zip_writer::ZipWriter;

/// Where loaded tensors are meant to live, as `torch.load(map_location=...)` takes it.
///
/// tandem-ckpt knows nothing of devices: every tensor it returns is little-endian bytes in host
/// memory (or a file mapping). The location is parsed and validated here and handed back to the
/// caller (see [`LoadOptions`]), whose engine does the actual placement.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum MapLocation {
    #[default]
    Cpu,
    Cuda(usize),
}

impl FromStr for MapLocation {
    type Err = CkptError;
    fn from_str(s: &str) -> Result<Self> {
        match s {
            "cpu" => Ok(MapLocation::Cpu),
            "cuda" => Ok(MapLocation::Cuda(0)),
            _ => s
                .strip_prefix("cuda:")
                .and_then(|n| n.parse().ok())
                .map(MapLocation::Cuda)
                .ok_or_else(|| CkptError::MapLocation(s.to_string())),
        }
    }
}

impl std::fmt::Display for MapLocation {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            MapLocation::Cpu => f.write_str("cpu"),
            MapLocation::Cuda(i) => write!(f, "cuda:{i}"),
        }
    }
}

/// The most a compressed zip entry (metadata: the pickle) may inflate to.
const MAX_INFLATED: u64 = 1 << 30;

/// Files at least this big are memory-mapped when `mmap` is on.
pub const MMAP_THRESHOLD: u64 = 16 << 20;

#[derive(Clone, Debug)]
pub struct LoadOptions {
    /// Recorded and validated only; see [`MapLocation`].
    pub map_location: MapLocation,
    /// Memory-map files of [`MMAP_THRESHOLD`] bytes or more instead of reading them (tensors
    /// then borrow the mapping; the file must not be truncated while they live).
    pub mmap: bool,
    /// Check every zip entry's CRC-32 (a full read of the file); checkpoints resume with it on.
    pub verify_checksums: bool,
    /// Read `collections.OrderedDict`s as [`Value::OrderedDict`] with their `_metadata` (for a
    /// faithful re-save) instead of plain dicts.
    pub keep_ordered_dicts: bool,
}

impl Default for LoadOptions {
    fn default() -> Self {
        LoadOptions {
            map_location: MapLocation::Cpu,
            mmap: true,
            verify_checksums: false,
            keep_ordered_dicts: false,
        }
    }
}

/// Files at least this large that are read whole (not mapped) go into an anonymous mapping
/// advised to use huge pages, read by several threads at once: faulting in a fresh heap buffer
/// 4 KiB at a time, and one thread both faulting and copying, held a full read to ~1 GB/s
/// (0.08x `dd`, which reuses one hot 1 MiB buffer).
const READ_INTO_HUGE_PAGES: u64 = 4 << 20;
/// Each thread reads pieces of this size at their offsets (`pread`).
const READ_PIECE: usize = 8 << 20;

fn read_into_anonymous_map(path: &Path, file: &File, len: usize) -> Result<FileBytes> {
    use std::os::unix::fs::FileExt;
    let mut map = memmap2::MmapMut::map_anon(len).map_err(|e| CkptError::io(path, e))?;
    // Only a hint: without transparent huge pages the read still works, more slowly.
    #[cfg(target_os = "linux")]
    let _ = map.advise(memmap2::Advice::HugePage);
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get()).clamp(1, 8);
    let mut work: Vec<Vec<(u64, &mut [u8])>> = (0..threads).map(|_| Vec::new()).collect();
    for (i, piece) in map.chunks_mut(READ_PIECE).enumerate() {
        work[i % threads].push(((i * READ_PIECE) as u64, piece));
    }
    let result = std::thread::scope(|scope| {
        let handles: Vec<_> = work
            .into_iter()
            .map(|pieces| {
                scope.spawn(move || {
                    pieces.into_iter().try_for_each(|(at, buf)| file.read_exact_at(buf, at))
                })
            })
            .collect();
        handles.into_iter().try_for_each(|h| {
            h.join().unwrap_or_else(|_| Err(std::io::Error::other("a reader thread panicked")))
        })
    });
    result.map_err(|e| CkptError::io(path, e))?;
    let map = map.make_read_only().map_err(|e| CkptError::io(path, e))?;
    Ok(FileBytes::Mapped(Arc::new(map)))
}

/// The file's bytes: a mapping or a buffer read whole. Storages are zero-copy slices of either.
#[derive(Clone)]
pub(crate) enum FileBytes {
    Mapped(Arc<memmap2::Mmap>),
    Read(Arc<Vec<u8>>),
}

impl FileBytes {
    pub(crate) fn open(path: &Path, mmap: bool) -> Result<FileBytes> {
        let file = File::open(path).map_err(|e| CkptError::io(path, e))?;
        let len = file.metadata().map_err(|e| CkptError::io(path, e))?.len();
        if mmap && len >= MMAP_THRESHOLD {
            // SAFETY: the mapping is read-only; tandem writes checkpoints by rename, never in
            // place. A file truncated by another process while mapped would fault, as with
            // torch.load(mmap=True); that is documented on `LoadOptions::mmap`.
            let map = unsafe { memmap2::Mmap::map(&file) }.map_err(|e| CkptError::io(path, e))?;
            return Ok(FileBytes::Mapped(Arc::new(map)));
        }
        if len >= READ_INTO_HUGE_PAGES {
            return read_into_anonymous_map(path, &file, len as usize);
        }
        let mut buf = Vec::with_capacity(len as usize);
        (&file).take(len).read_to_end(&mut buf).map_err(|e| CkptError::io(path, e))?;
        Ok(FileBytes::Read(Arc::new(buf)))
    }

    pub(crate) fn bytes(&self) -> &[u8] {
        match self {
            FileBytes::Mapped(m) => m,
            FileBytes::Read(v) => v,
        }
    }

    /// A storage over `start..start+len` (the caller checked the range).
    pub(crate) fn storage(&self, start: usize, len: usize) -> StorageData {
        match self {
            FileBytes::Mapped(m) => StorageData::from_mmap(m.clone(), start, len),
            FileBytes::Read(v) => StorageData::from_shared(v.clone(), start, len),
        }
    }
}

/// What kind of file a byte prefix is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FileKind {
    TorchZip,
    TorchLegacy,
    Safetensors,
}

impl FileKind {
    /// What the file is, in words (`torch.save zip`).
    pub fn name(self) -> &'static str {
        match self {
            FileKind::TorchZip => "torch.save zip",
            FileKind::TorchLegacy => "torch.save legacy (pre-1.6)",
            FileKind::Safetensors => "safetensors",
        }
    }
}

/// The kind of the file at `path`, by its first bytes (`None`: not one tandem reads).
pub fn detect_file(path: &Path) -> Result<Option<FileKind>> {
    let mut head = [0u8; 64];
    let n =
        File::open(path).and_then(|mut f| f.read(&mut head)).map_err(|e| CkptError::io(path, e))?;
    Ok(detect(&head[..n]))
}

const LEGACY_MAGIC: &[u8] = b"\x80\x02\x8a\x0al\xfc\x9cF\xf9 j\xa8P\x19.";

/// Recognises a file by its first bytes.
pub fn detect(bytes: &[u8]) -> Option<FileKind> {
    if bytes.starts_with(b"PK\x03\x04") || bytes.starts_with(b"PK\x05\x06") {
        return Some(FileKind::TorchZip);
    }
    if bytes.starts_with(LEGACY_MAGIC) {
        return Some(FileKind::TorchLegacy);
    }
    if bytes.len() >= 9 && bytes[8] == b'{' {
        let n = u64::from_le_bytes(bytes[..8].try_into().ok()?);
        if n <= bytes.len() as u64 - 8 {
            return Some(FileKind::Safetensors);
        }
    }
    None
}

fn supported_dtypes() -> String {
    crate::value::ElemType::ALL.iter().map(|d| d.torch_name()).collect::<Vec<_>>().join(", ")
}

fn pickle_error(path: &Path, what: &str, e: PickleError) -> CkptError {
    match e {
        PickleError::Forbidden(global) => CkptError::ForbiddenGlobal { path: path.into(), global },
        PickleError::Unsupported(global) => CkptError::format(
            path,
            format!("{what} uses `{global}`, which tandem does not support (supported: dense tensors of {})", supported_dtypes()),
        ),
        PickleError::Msg(m) => CkptError::format(path, format!("{what}: {m}")),
    }
}

/// Reads a torch.save (zip or legacy) or safetensors file into a value tree.
pub fn load_with(path: &Path, opts: &LoadOptions) -> Result<Value> {
    let fb = FileBytes::open(path, opts.mmap)?;
    load_file_bytes(path, &fb, opts)
}

/// Writes `value` (no tensors) as one plain pickle, atomically.
pub fn write_plain_pickle(path: &Path, value: &Value) -> Result<()> {
    let (pkl, table) = pickle_value(value)?;
    if !table.storages.is_empty() {
        return Err(CkptError::Unsupported {
            what: "value".into(),
            msg: "a plain pickle cannot hold tensors (save it as a .pt)".into(),
        });
    }
    crate::atomic::write_atomic(path, |f| std::io::Write::write_all(f, &pkl))
}

/// A plain pickle file (one pickle, no storages) as a value tree.
pub fn read_plain_pickle(path: &Path) -> Result<Value> {
    let fb = FileBytes::open(path, false)?;
    let up = unpickle(fb.bytes()).map_err(|e| pickle_error(path, "pickle", e))?;
    up.to_value(&mut |s| Err(format!("a plain pickle references tensor storage `{}`", s.key)))
        .map_err(|m| CkptError::format(path, m))
}

/// Reads an in-memory file image (`name` is only used in error messages).
pub fn load_from_bytes(name: &str, bytes: Vec<u8>, verify_checksums: bool) -> Result<Value> {
    let opts = LoadOptions { verify_checksums, ..LoadOptions::default() };
    load_file_bytes(Path::new(name), &FileBytes::Read(Arc::new(bytes)), &opts)
}

fn load_file_bytes(path: &Path, fb: &FileBytes, opts: &LoadOptions) -> Result<Value> {
    match detect(fb.bytes()) {
        Some(FileKind::TorchZip) => read_zip(path, fb, opts),
        Some(FileKind::TorchLegacy) => read_legacy(path, fb, opts),
        Some(FileKind::Safetensors) => crate::safetensors::from_bytes(path, fb),
        None => {
            let head: Vec<String> = fb.bytes().iter().take(8).map(|b| format!("{b:02x}")).collect();
            let hint = if fb.bytes().is_empty() {
                "the file is empty".to_string()
            } else {
                format!("it starts with {}", head.join(" "))
            };
            Err(CkptError::format(
                path,
                format!("not a torch.save (zip or legacy) or safetensors file: {hint}"),
            ))
        }
    }
}

struct ZipEntry {
    start: usize,
    len: usize,
    crc: u32,
    stored: bool,
    index: usize,
}

fn read_zip(path: &Path, fb: &FileBytes, opts: &LoadOptions) -> Result<Value> {
    let verify = opts.verify_checksums;
    let bytes = fb.bytes();
    let zerr =
        |e: zip::result::ZipError| CkptError::format(path, format!("broken zip archive: {e}"));
    // torch.save archives start at byte 0. The zip crate's default detection of data prepended
    // to an archive assumes the central directory ends where its end record starts, which the
    // zip64 end records torch writes in between break: when the first central-directory entry
    // is exactly as long as them (76 bytes: a file stem of 21 characters), it takes the second
    // entry for the first and misreads every offset.
    let config = zip::read::Config { archive_offset: zip::read::ArchiveOffset::Known(0) };
    let mut archive = zip::ZipArchive::with_config(config, Cursor::new(bytes)).map_err(zerr)?;
    let mut entries: HashMap<String, ZipEntry> = HashMap::new();
    for i in 0..archive.len() {
        let f = archive.by_index_raw(i).map_err(zerr)?;
        let name = f.name().map_err(zerr)?.to_string();
        let start = f.data_start().ok_or_else(|| {
            CkptError::format(path, format!("zip entry {name} has no data offset"))
        })?;
        let len = f.compressed_size();
        let end = start.checked_add(len).filter(|&e| e <= bytes.len() as u64).ok_or_else(|| {
            CkptError::format(path, format!("zip entry {name} ({len} bytes at {start}) runs past the end of the file ({} bytes): truncated?", bytes.len()))
        })?;
        let stored = f.compression() == zip::CompressionMethod::Stored;
        if stored && f.size() != len {
            return Err(CkptError::format(
                path,
                format!("zip entry {name}: stored size {len} != size {}", f.size()),
            ));
        }
        let _ = end;
        entries.insert(
            name,
            ZipEntry { start: start as usize, len: len as usize, crc: f.crc32(), stored, index: i },
        );
    }
    let pkl_name = entries
        .keys()
        .filter(|n| n.ends_with("/data.pkl") && n.matches('/').count() == 1)
        .min()
        .cloned()
        .ok_or_else(|| {
            CkptError::format(path, "zip archive has no <name>/data.pkl: not a torch.save file")
        })?;
    let prefix = &pkl_name[..pkl_name.len() - "data.pkl".len()];

    // Reads an entry: zero-copy when stored, decompressed (bounded) otherwise.
    let mut entry_bytes = |name: &str| -> Result<Option<std::borrow::Cow<'_, [u8]>>> {
        let Some(e) = entries.get(name) else { return Ok(None) };
        let raw = &bytes[e.start..e.start + e.len];
        if e.stored {
            if verify && crc32fast::hash(raw) != e.crc {
                return Err(CkptError::format(
                    path,
                    format!("zip entry {name} fails its CRC-32 check: file is corrupt"),
                ));
            }
            return Ok(Some(std::borrow::Cow::Borrowed(raw)));
        }
        let mut f = archive.by_index(e.index).map_err(zerr)?;
        let size = f.size();
        // Deflate expands at most ~1032x; a larger claim is a zip bomb. Only metadata is ever
        // compressed (data.pkl, byteorder, version: storages never are), so there is an
        // absolute cap too.
        if size > (e.len as u64).saturating_mul(1032).saturating_add(1024) {
            return Err(CkptError::format(
                path,
                format!("zip entry {name} claims {size} bytes from {} compressed", e.len),
            ));
        }
        if size > MAX_INFLATED {
            return Err(CkptError::format(
                path,
                format!(
                    "zip entry {name} inflates to {size} bytes; compressed metadata of more than \
                     {MAX_INFLATED} bytes is refused"
                ),
            ));
        }
        let mut out = Vec::with_capacity(size as usize);
        f.by_ref()
            .take(size)
            .read_to_end(&mut out)
            .map_err(|e| CkptError::format(path, format!("zip entry {name}: {e}")))?;
        Ok(Some(std::borrow::Cow::Owned(out)))
    };

    if let Some(order) = entry_bytes(&format!("{prefix}byteorder"))? {
        if order.as_ref() != b"little" {
            return Err(CkptError::format(
                path,
                format!(
                    "byteorder is `{}`; only little-endian files are supported",
                    String::from_utf8_lossy(&order)
                ),
            ));
        }
    }
    let pkl = entry_bytes(&pkl_name)?
        .ok_or_else(|| CkptError::format(path, "data.pkl vanished"))?
        .into_owned();
    let mut up = unpickle(&pkl).map_err(|e| pickle_error(path, &pkl_name, e))?;
    up.keep_ordered = opts.keep_ordered_dicts;

    let mut cache: HashMap<String, StorageData> = HashMap::new();
    let mut resolve = |s: &StorageRef| -> std::result::Result<StorageData, String> {
        if let Some(st) = cache.get(&s.key) {
            return Ok(st.clone());
        }
        let name = format!("{prefix}data/{}", s.key);
        let e = entries.get(&name).ok_or_else(|| format!("storage record {name} is missing"))?;
        let need = s.numel.checked_mul(s.dtype.size() as u64).ok_or("storage size overflows")?;
        if (e.len as u64) < need {
            return Err(format!(
                "storage record {name} has {} bytes, the pickle needs {need}",
                e.len
            ));
        }
        if !e.stored {
            return Err(format!(
                "storage record {name} is compressed; torch.save never compresses storages"
            ));
        }
        let raw = &bytes[e.start..e.start + e.len];
        if verify && crc32fast::hash(raw) != e.crc {
            return Err(format!("storage record {name} fails its CRC-32 check: file is corrupt"));
        }
        let st = fb.storage(e.start, need as usize);
        cache.insert(s.key.clone(), st.clone());
        Ok(st)
    };
    let value = up.to_value(&mut resolve).map_err(|m| CkptError::format(path, m))?;
    if verify {
        // Records nobody referenced still belong to the file's integrity.
        for (name, e) in &entries {
            if e.stored && crc32fast::hash(&bytes[e.start..e.start + e.len]) != e.crc {
                return Err(CkptError::format(
                    path,
                    format!("zip entry {name} fails its CRC-32 check: file is corrupt"),
                ));
            }
        }
    }
    Ok(value)
}

/// Legacy format: five pickles back to back (magic number, protocol version, sys info, the
/// value, the storage keys), then each storage as `<i64 numel><bytes>` in key order.
fn read_legacy(path: &Path, fb: &FileBytes, opts: &LoadOptions) -> Result<Value> {
    let bytes = fb.bytes();
    let mut pos = LEGACY_MAGIC.len();
    let next = |what: &str, pos: &mut usize| -> Result<Unpickled> {
        let up = unpickle(&bytes[*pos..]).map_err(|e| pickle_error(path, what, e))?;
        *pos += up.consumed;
        Ok(up)
    };
    let plain = |up: &Unpickled, what: &str| -> Result<Value> {
        up.to_value(&mut |_| Err("unexpected storage".into()))
            .map_err(|m| CkptError::format(path, format!("{what}: {m}")))
    };
    let version = plain(&next("protocol version", &mut pos)?, "protocol version")?;
    if version.as_int() != Some(1001) {
        return Err(CkptError::format(
            path,
            format!("legacy protocol version {version:?}, expected 1001"),
        ));
    }
    let sys_info = plain(&next("sys_info", &mut pos)?, "sys_info")?;
    if sys_info.get("little_endian").and_then(Value::as_bool) == Some(false) {
        return Err(CkptError::format(
            path,
            "saved on a big-endian machine; only little-endian files are supported",
        ));
    }
    let mut main = next("data pickle", &mut pos)?;
    main.keep_ordered = opts.keep_ordered_dicts;
    let keys = plain(&next("storage keys", &mut pos)?, "storage keys")?;
    let keys =
        keys.as_list().ok_or_else(|| CkptError::format(path, "storage key list is not a list"))?;
    let mut dtype_of: HashMap<&str, crate::value::ElemType> = HashMap::new();
    for s in main.storages() {
        dtype_of.insert(&s.key, s.dtype);
    }
    let mut storages: HashMap<String, StorageData> = HashMap::new();
    for k in keys {
        let k = k.as_str().ok_or_else(|| CkptError::format(path, "storage key is not a str"))?;
        let dtype = *dtype_of.get(k).ok_or_else(|| {
            CkptError::format(path, format!("storage {k} is listed but never used"))
        })?;
        let header = bytes
            .get(pos..pos + 8)
            .ok_or_else(|| CkptError::format(path, format!("truncated before storage {k}")))?;
        let numel = u64::from_le_bytes(header.try_into().expect("8 bytes"));
        pos += 8;
        let len = numel
            .checked_mul(dtype.size() as u64)
            .filter(|&l| l <= (bytes.len() - pos) as u64)
            .ok_or_else(|| {
                CkptError::format(
                    path,
                    format!(
                        "storage {k} claims {numel} elements, more than the file holds: truncated?"
                    ),
                )
            })?;
        storages.insert(k.to_string(), fb.storage(pos, len as usize));
        pos += len as usize;
    }
    let mut resolve = |s: &StorageRef| -> std::result::Result<StorageData, String> {
        storages.get(&s.key).cloned().ok_or_else(|| format!("storage {} has no data", s.key))
    };
    main.to_value(&mut resolve).map_err(|m| CkptError::format(path, m))
}

/// The pickle of a value tree and the storages it references (errors in the value show here,
/// before any file is created).
fn pickle_value(value: &Value) -> Result<(Vec<u8>, crate::pickle::write::StorageTable)> {
    let mut p = Pickler::new();
    p.value(value, 0).map_err(|msg| CkptError::Unsupported { what: "value".into(), msg })?;
    Ok(p.finish())
}

fn write_archive<W: std::io::Write>(
    pkl: &[u8],
    table: &crate::pickle::write::StorageTable,
    out: W,
) -> std::io::Result<W> {
    let mut z = ZipWriter::new(out);
    z.add("archive/data.pkl", pkl)?;
    z.add("archive/.format_version", b"1")?;
    z.add("archive/.storage_alignment", b"64")?;
    z.add("archive/byteorder", b"little")?;
    for (i, (_, st)) in table.storages.iter().enumerate() {
        z.add(&format!("archive/data/{i}"), st.bytes())?;
    }
    z.add("archive/version", b"3\n")?;
    z.finish()
}

/// Serialises a value tree as a torch.save zip archive into `out`.
pub(crate) fn write_pt<W: std::io::Write>(value: &Value, out: W) -> Result<W> {
    let (pkl, table) = pickle_value(value)?;
    write_archive(&pkl, &table, out).map_err(|e| CkptError::io("<archive>", e))
}

/// Writes `value` to `path` atomically as a torch.save zip archive.
pub fn save(path: &Path, value: &Value) -> Result<()> {
    let (pkl, table) = pickle_value(value)?;
    crate::atomic::write_atomic(path, |f| {
        write_archive(&pkl, &table, BufWriter::with_capacity(1 << 20, f)).map(|_| ())
    })
}
