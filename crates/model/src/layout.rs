//! The layout cache: weight matrices in the layouts the kernels read,
//! written once after the first load of a model and mapped on every later
//! load, so a restart does no conversion and holds the weights once, as
//! pages of one file that every process on the machine shares.
//!
//! One file per (model file, kernel, layout version), named
//! `<stem>.<kernel>.v<version>.<path hash>.layout` in the directory the
//! caller names (serve and the CLI use `<cache>/layouts`). It records the
//! model file's length and modification time and a CRC-32 of its data: a
//! file that does not match (the model changed, another version wrote it,
//! a write was cut short) is rebuilt, never read. Matrices the file holds
//! in a layout the kernels read as they are (Q8_0 for the AVX2 and scalar
//! kernels) stay views of the model file and are not copied here.
//!
//! Format (little-endian): magic `FLOTLAYT`, version (u32), kernel name
//! (u8 length, bytes), model length (u64), model mtime (u128 ns), data CRC
//! (u32), data start (u64), entry count (u32), then per entry: name (u16
//! length, bytes), kind (u8: 1 Q4_1x8, 2 Q8_0, 3 Q8_0x8, 4 Q4Kx8, 5 Q6Kx8), rows, cols,
//! offset from the data start, length (u64 each). Data starts on a page,
//! each matrix on a 64-byte line; the CRC covers the entry table and the
//! data region whole, and an entry whose size does not fit its shape is
//! not used.

use std::collections::HashMap;
use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use flotilla_gguf::FileIdentity;
use memmap2::Mmap;

use crate::kernels::{Bytes, QMatrix, Resolved, WData};

/// Bumped whenever a layout a kernel reads, or this file's format, changes
/// (2: the CRC covers the entry table too; 3: Q4_K and Q6_K at the file's
/// size for the VNNI kernels; 4: those only in `-compact` caches).
pub const LAYOUT_VERSION: u32 = 4;
const MAGIC: &[u8; 8] = b"FLOTLAYT";
const ALIGN: usize = 64;
const PAGE: usize = 4096;

/// Where the cache of `source` for `kernel` lives in `dir`.
pub fn cache_path(dir: &Path, source: &FileIdentity, kernel: Resolved, compact: bool) -> PathBuf {
    let stem = source
        .path
        .file_stem()
        .map_or("model".into(), |s| s.to_string_lossy().into_owned());
    // FNV-1a of the canonical path: two models of one name in different
    // places get different files.
    let h = source
        .path
        .as_os_str()
        .as_encoded_bytes()
        .iter()
        .fold(0xcbf2_9ce4_8422_2325u64, |h, &b| {
            (h ^ b as u64).wrapping_mul(0x100_0000_01b3)
        });
    dir.join(format!(
        "{stem}.{}.v{LAYOUT_VERSION}.{h:016x}.layout",
        kernel_name(kernel, compact)
    ))
}

/// The kernel a cache was written for, and `-compact` where its K-quants
/// are at the file's size (`CpuConfig::compact_k_quants`, for the kernels
/// that read them so: `Resolved::reads_compact_k`).
fn kernel_name(k: Resolved, compact: bool) -> String {
    let compact = if compact && k.reads_compact_k() {
        "-compact"
    } else {
        ""
    };
    format!("{:?}{compact}", k.layout()).to_lowercase()
}

struct Entry {
    kind: u8,
    rows: usize,
    cols: usize,
    start: usize,
    len: usize,
}

/// Bytes of the cache verified before their pages are dropped.
const VERIFY_PIECE: usize = 32 << 20;

/// An open, verified cache file.
pub struct Cached {
    map: Arc<Mmap>,
    entries: HashMap<String, Entry>,
}

impl Cached {
    /// The matrix `name` of `rows x cols` as the cache holds it, a view of
    /// the mapped file; `None` where it holds no such matrix.
    pub fn matrix(&self, name: &str, rows: usize, cols: usize) -> Option<QMatrix> {
        let e = self.entries.get(name)?;
        if (e.rows, e.cols) != (rows, cols) {
            return None;
        }
        let b = Bytes::Mapped {
            map: Arc::clone(&self.map),
            start: e.start,
            len: e.len,
        };
        let data = match e.kind {
            1 => WData::Q4_1x8(b),
            2 => WData::Q8_0(b),
            3 => WData::Q8_0x8(b),
            4 => WData::Q4Kx8(b),
            5 => WData::Q6Kx8(b),
            _ => return None,
        };
        QMatrix::try_new(rows, cols, data)
    }

    /// Matrices held.
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    /// Whether it holds none.
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }
}

/// A little-endian reader over the header that fails rather than panics.
struct Rd<'a>(&'a [u8]);

impl Rd<'_> {
    fn take(&mut self, n: usize) -> Result<&[u8], String> {
        if self.0.len() < n {
            return Err("header cut short".into());
        }
        let (a, b) = self.0.split_at(n);
        self.0 = b;
        Ok(a)
    }
    fn u8(&mut self) -> Result<u8, String> {
        Ok(self.take(1)?[0])
    }
    fn u16(&mut self) -> Result<u16, String> {
        Ok(u16::from_le_bytes(self.take(2)?.try_into().unwrap()))
    }
    fn u32(&mut self) -> Result<u32, String> {
        Ok(u32::from_le_bytes(self.take(4)?.try_into().unwrap()))
    }
    fn u64(&mut self) -> Result<u64, String> {
        Ok(u64::from_le_bytes(self.take(8)?.try_into().unwrap()))
    }
    fn u128(&mut self) -> Result<u128, String> {
        Ok(u128::from_le_bytes(self.take(16)?.try_into().unwrap()))
    }
    fn usize(&mut self) -> Result<usize, String> {
        usize::try_from(self.u64()?).map_err(|_| "a size past this machine's".to_string())
    }
}

/// Opens and verifies the cache at `path` for `source` and `kernel`.
/// `Ok(None)`: there is none. `Err(why)`: there is one that must not be
/// used (stale, another version's, corrupt); the caller rebuilds it.
pub fn open(
    path: &Path,
    source: &FileIdentity,
    kernel: Resolved,
    compact: bool,
) -> Result<Option<Cached>, String> {
    let file = match File::open(path) {
        Ok(f) => f,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(e.to_string()),
    };
    // SAFETY: read-only map of a file this process does not write; caches
    // are replaced by rename, never written in place, so a mapped file's
    // bytes do not change under a reader.
    let map = unsafe { Mmap::map(&file) }.map_err(|e| e.to_string())?;
    let mut r = Rd(&map[..]);
    if r.take(8)? != MAGIC {
        return Err("not a layout cache".into());
    }
    let version = r.u32()?;
    if version != LAYOUT_VERSION {
        return Err(format!(
            "layout version {version}, this build's is {LAYOUT_VERSION}"
        ));
    }
    let kn = r.u8()? as usize;
    let k = String::from_utf8_lossy(r.take(kn)?).into_owned();
    if k != kernel_name(kernel, compact) {
        return Err(format!("written for kernel {k}"));
    }
    let (len, mtime) = (r.u64()?, r.u128()?);
    if (len, mtime) != (source.len, source.mtime_ns) {
        return Err("the model file changed since it was written".into());
    }
    let crc = r.u32()?;
    let data_start = r.usize()?;
    let n = r.u32()? as usize;
    if data_start > map.len() {
        return Err("data start past the end".into());
    }
    let table_start = map.len() - r.0.len();
    let data_len = map.len() - data_start;
    let mut entries = HashMap::with_capacity(n);
    for _ in 0..n {
        let nl = r.u16()? as usize;
        let name = String::from_utf8_lossy(r.take(nl)?).into_owned();
        let (kind, rows, cols, off, len) =
            (r.u8()?, r.usize()?, r.usize()?, r.usize()?, r.usize()?);
        if off.checked_add(len).is_none_or(|end| end > data_len) {
            return Err(format!("{name} lies past the end"));
        }
        entries.insert(
            name,
            Entry {
                kind,
                rows,
                cols,
                start: data_start + off,
                len,
            },
        );
    }
    let table_end = map.len() - r.0.len();
    let mut h = crc32fast::Hasher::new();
    h.update(&map[table_start..table_end]);
    // In pieces, each piece's pages dropped once read: verifying never
    // makes the whole file resident (a pipeline stage maps a few of its
    // matrices; anyone's pages come back from the page cache on use).
    let mut at = data_start;
    while at < map.len() {
        let end = (at + VERIFY_PIECE).min(map.len());
        h.update(&map[at..end]);
        #[cfg(unix)]
        // SAFETY: a read-only shared mapping of a file that is replaced by
        // rename, never written in place: dropping its pages loses
        // nothing, a later read fetches them again.
        let _ =
            unsafe { map.unchecked_advise_range(memmap2::UncheckedAdvice::DontNeed, at, end - at) };
        at = end;
    }
    if h.finalize() != crc {
        return Err("checksum mismatch".into());
    }
    Ok(Some(Cached {
        map: Arc::new(map),
        entries,
    }))
}

/// Writes the cache of `mats` (their owned quantised data; others are
/// left out) to `path`, through a temporary file renamed into place.
pub fn write(
    path: &Path,
    source: &FileIdentity,
    kernel: Resolved,
    compact: bool,
    mats: &[(String, &QMatrix)],
) -> std::io::Result<usize> {
    let held: Vec<(&str, u8, &QMatrix, &[u8])> = mats
        .iter()
        .filter_map(|(name, m)| {
            let (kind, b) = match &m.data {
                WData::Q4_1x8(b @ Bytes::Owned(_)) => (1, b),
                WData::Q8_0(b @ Bytes::Owned(_)) => (2, b),
                WData::Q8_0x8(b @ Bytes::Owned(_)) => (3, b),
                WData::Q4Kx8(b @ Bytes::Owned(_)) => (4, b),
                WData::Q6Kx8(b @ Bytes::Owned(_)) => (5, b),
                _ => return None,
            };
            Some((name.as_str(), kind, *m, b.as_slice()))
        })
        .collect();
    let mut offs = Vec::with_capacity(held.len());
    let mut end = 0usize;
    for (_, _, _, b) in &held {
        offs.push(end);
        end = (end + b.len()).next_multiple_of(ALIGN);
    }
    let mut entries = Vec::new();
    for ((name, kind, m, b), off) in held.iter().zip(&offs) {
        entries.extend_from_slice(&(name.len() as u16).to_le_bytes());
        entries.extend_from_slice(name.as_bytes());
        entries.push(*kind);
        for v in [m.rows, m.cols, *off, b.len()] {
            entries.extend_from_slice(&(v as u64).to_le_bytes());
        }
    }
    let kn = kernel_name(kernel, compact);
    let fixed = 8 + 4 + 1 + kn.len() + 8 + 16 + 4 + 8 + 4;
    let data_start = (fixed + entries.len()).next_multiple_of(PAGE);
    // The CRC of the entry table and of the data region as it will lie in
    // the file, padding included.
    let mut crc = crc32fast::Hasher::new();
    crc.update(&entries);
    let zeros = [0u8; ALIGN];
    let mut at = 0;
    for ((_, _, _, b), &off) in held.iter().zip(&offs) {
        crc.update(&zeros[..off - at]);
        crc.update(b);
        at = off + b.len();
    }
    crc.update(&zeros[..end - at]);
    let crc = crc.finalize();

    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir)?;
    }
    let tmp = path.with_extension(format!("layout.tmp{}", std::process::id()));
    let result = (|| {
        let mut w = BufWriter::with_capacity(1 << 20, File::create(&tmp)?);
        w.write_all(MAGIC)?;
        w.write_all(&LAYOUT_VERSION.to_le_bytes())?;
        w.write_all(&[kn.len() as u8])?;
        w.write_all(kn.as_bytes())?;
        w.write_all(&source.len.to_le_bytes())?;
        w.write_all(&source.mtime_ns.to_le_bytes())?;
        w.write_all(&crc.to_le_bytes())?;
        w.write_all(&(data_start as u64).to_le_bytes())?;
        w.write_all(&(held.len() as u32).to_le_bytes())?;
        w.write_all(&entries)?;
        w.write_all(&vec![0u8; data_start - fixed - entries.len()])?;
        let mut at = 0;
        for ((_, _, _, b), &off) in held.iter().zip(&offs) {
            w.write_all(&zeros[..off - at])?;
            w.write_all(b)?;
            at = off + b.len();
        }
        w.write_all(&zeros[..end - at])?;
        // Not synced: a file cut short by a crash fails its CRC and is
        // rebuilt, and a sync would cost the first load seconds.
        w.into_inner().map_err(|e| e.into_error())?;
        std::fs::rename(&tmp, path)
    })();
    if result.is_err() {
        let _ = std::fs::remove_file(&tmp);
    } else {
        remove_other_versions(path);
    }
    result.map(|()| data_start + end)
}

/// Removes the caches of the same model and kernel that another layout
/// version wrote beside `path` (a build that changed a layout leaves no
/// gigabyte-sized file behind).
fn remove_other_versions(path: &Path) {
    let (Some(dir), Some(name)) = (path.parent(), path.file_name().and_then(|n| n.to_str())) else {
        return;
    };
    let tag = format!(".v{LAYOUT_VERSION}.");
    let Some(at) = name.find(&tag) else { return };
    let (prefix, suffix) = (&name[..at + 2], &name[at + tag.len() - 1..]);
    let Ok(listing) = std::fs::read_dir(dir) else {
        return;
    };
    for e in listing.flatten() {
        let other = e.file_name();
        let Some(other) = other.to_str() else {
            continue;
        };
        let version = other
            .strip_prefix(prefix)
            .and_then(|rest| rest.strip_suffix(suffix));
        if other != name
            && version.is_some_and(|v| !v.is_empty() && v.bytes().all(|c| c.is_ascii_digit()))
        {
            let _ = std::fs::remove_file(e.path());
        }
    }
}
