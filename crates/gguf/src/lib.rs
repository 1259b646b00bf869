//! GGUF v2/v3 reader: memory-mapped, tensors as zero-copy byte views.
//!
//! Every count and offset read from the file is checked against the bytes that
//! remain before it is used, so a truncated or hostile file gives a
//! [`GgufError`], never a panic, an out-of-bounds read or a huge allocation.

use std::collections::HashMap;
use std::fs::File;
use std::path::Path;
use std::sync::Arc;

use memmap2::Mmap;

/// "GGUF" read as a little-endian u32.
const GGUF_MAGIC: u32 = 0x4655_4747;
/// Alignment of the tensor data section when `general.alignment` is absent.
const DEFAULT_ALIGNMENT: u64 = 32;
/// Cap on tensor rank: ggml supports at most 4 dimensions.
const MAX_DIMS: u32 = 4;
/// Cap on array nesting in metadata; deeper nesting is refused, not recursed.
const MAX_NESTING: u32 = 2;
/// Cap on metadata array elements in one file. Each becomes a [`Value`] of
/// ~32 bytes, so a file of tiny elements could otherwise ask for 32x its
/// size; real vocabularies hold well under a million tokens and merges.
const MAX_METADATA_ELEMENTS: u64 = 8 << 20;

/// Why a GGUF file could not be read or used.
#[derive(Debug, thiserror::Error)]
pub enum GgufError {
    /// The file could not be opened or mapped.
    #[error("cannot read {path}: {source}")]
    Io {
        /// Path of the file.
        path: String,
        /// The operating-system error.
        source: std::io::Error,
    },
    /// The first four bytes are not "GGUF".
    #[error("not a GGUF file: magic is {0:#010x}, expected 0x46554747 (\"GGUF\")")]
    BadMagic(u32),
    /// A GGUF version this reader does not know.
    #[error("unsupported GGUF version {0} (supported: 2, 3)")]
    BadVersion(u32),
    /// The file ends before a structure that the header promises.
    #[error("truncated GGUF file: {what} needs {need} bytes at offset {offset}, file has {len}")]
    Truncated {
        /// What was being read.
        what: String,
        /// Offset of the read.
        offset: u64,
        /// Bytes it needed.
        need: u64,
        /// Size of the file.
        len: u64,
    },
    /// A structurally invalid header field.
    #[error("invalid GGUF header: {0}")]
    Invalid(String),
    /// A tensor whose element type this runtime does not implement.
    #[error(
        "tensor '{tensor}' has type {ty}, which is not supported (supported: F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q4_K, Q6_K)"
    )]
    UnsupportedType {
        /// Tensor name.
        tensor: String,
        /// The type's name or numeric id.
        ty: String,
    },
    /// A tensor's data lies outside the file.
    #[error("tensor '{tensor}' data [{start}, {end}) lies outside the file ({len} bytes)")]
    TensorOutOfBounds {
        /// Tensor name.
        tensor: String,
        /// First byte.
        start: u64,
        /// One past the last byte.
        end: u64,
        /// Size of the file.
        len: u64,
    },
    /// A required metadata key is absent.
    #[error("missing metadata key '{0}'")]
    MissingKey(String),
    /// A metadata key has the wrong type.
    #[error("metadata key '{key}' has type {found}, expected {expected}")]
    WrongType {
        /// The key.
        key: String,
        /// Type found.
        found: &'static str,
        /// Type expected.
        expected: &'static str,
    },
    /// A required tensor is absent.
    #[error("missing tensor '{0}'")]
    MissingTensor(String),
    /// A tensor has a shape the model does not expect.
    #[error("tensor '{tensor}' has shape {found:?}, expected {expected:?}")]
    BadShape {
        /// Tensor name.
        tensor: String,
        /// Shape found (GGUF order: innermost first).
        found: Vec<u64>,
        /// Shape expected.
        expected: Vec<u64>,
    },
    /// `general.architecture` names a model family this runtime does not run.
    #[error("unsupported architecture '{0}' (supported: llama, mistral)")]
    UnknownArchitecture(String),
}

/// A ggml element type that this runtime reads.
#[allow(non_camel_case_types)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum GgmlType {
    /// 32-bit float.
    F32,
    /// IEEE half.
    F16,
    /// bfloat16.
    BF16,
    /// 32 x i8 with an f16 scale.
    Q8_0,
    /// 32 x 4-bit with an f16 scale, value = d * (q - 8).
    Q4_0,
    /// 32 x 4-bit with f16 scale and min, value = d * q + m.
    Q4_1,
    /// 32 x 5-bit with an f16 scale, value = d * (q - 16).
    Q5_0,
    /// 256-element super-block of 4-bit values with 6-bit sub-block scales and mins.
    Q4_K,
    /// 256-element super-block of 6-bit values with 8-bit sub-block scales.
    Q6_K,
}

impl GgmlType {
    /// Maps a ggml type id; `None` for types this runtime does not implement.
    pub fn from_id(id: u32) -> Option<GgmlType> {
        Some(match id {
            0 => GgmlType::F32,
            1 => GgmlType::F16,
            2 => GgmlType::Q4_0,
            3 => GgmlType::Q4_1,
            6 => GgmlType::Q5_0,
            8 => GgmlType::Q8_0,
            12 => GgmlType::Q4_K,
            14 => GgmlType::Q6_K,
            30 => GgmlType::BF16,
            _ => return None,
        })
    }

    /// Elements per block.
    pub fn block_elems(self) -> u64 {
        match self {
            GgmlType::F32 | GgmlType::F16 | GgmlType::BF16 => 1,
            GgmlType::Q8_0 | GgmlType::Q4_0 | GgmlType::Q4_1 | GgmlType::Q5_0 => 32,
            GgmlType::Q4_K | GgmlType::Q6_K => 256,
        }
    }

    /// Bytes per block.
    pub fn block_bytes(self) -> u64 {
        match self {
            GgmlType::F32 => 4,
            GgmlType::F16 | GgmlType::BF16 => 2,
            GgmlType::Q8_0 => 34,
            GgmlType::Q4_0 => 18,
            GgmlType::Q4_1 => 20,
            GgmlType::Q5_0 => 22,
            GgmlType::Q4_K => 144,
            GgmlType::Q6_K => 210,
        }
    }

    /// Name as ggml spells it.
    pub fn name(self) -> &'static str {
        match self {
            GgmlType::F32 => "F32",
            GgmlType::F16 => "F16",
            GgmlType::BF16 => "BF16",
            GgmlType::Q8_0 => "Q8_0",
            GgmlType::Q4_0 => "Q4_0",
            GgmlType::Q4_1 => "Q4_1",
            GgmlType::Q5_0 => "Q5_0",
            GgmlType::Q4_K => "Q4_K",
            GgmlType::Q6_K => "Q6_K",
        }
    }
}

/// Names of ggml type ids this runtime does not implement, for error messages.
fn unsupported_type_name(id: u32) -> String {
    let name = match id {
        7 => "Q5_1",
        9 => "Q8_1",
        10 => "Q2_K",
        11 => "Q3_K",
        13 => "Q5_K",
        15 => "Q8_K",
        16..=23 | 29 => "an IQ type",
        24 => "I8",
        25 => "I16",
        26 => "I32",
        27 => "I64",
        28 => "F64",
        _ => "",
    };
    if name.is_empty() {
        format!("unknown type id {id}")
    } else {
        format!("{name} (type id {id})")
    }
}

/// A metadata value.
#[derive(Clone, Debug, PartialEq)]
pub enum Value {
    /// Unsigned integer (u8, u16, u32, u64).
    U64(u64),
    /// Signed integer (i8, i16, i32, i64).
    I64(i64),
    /// Float (f32, f64).
    F64(f64),
    /// Boolean.
    Bool(bool),
    /// UTF-8 string (invalid UTF-8 is replaced).
    Str(String),
    /// Array of values.
    Array(Vec<Value>),
}

impl Value {
    fn type_name(&self) -> &'static str {
        match self {
            Value::U64(_) => "unsigned integer",
            Value::I64(_) => "signed integer",
            Value::F64(_) => "float",
            Value::Bool(_) => "bool",
            Value::Str(_) => "string",
            Value::Array(_) => "array",
        }
    }
}

/// Where one tensor lives in the file.
#[derive(Clone, Debug)]
pub struct TensorInfo {
    /// Tensor name, e.g. `blk.0.attn_q.weight`.
    pub name: String,
    /// Dimensions, innermost first (GGUF order): a matrix is `[cols, rows]`.
    pub dims: Vec<u64>,
    /// Element type.
    pub ty: GgmlType,
    /// Absolute byte offset of the data in the file.
    pub start: usize,
    /// Size of the data in bytes.
    pub len: usize,
}

impl TensorInfo {
    /// Number of elements.
    pub fn elems(&self) -> u64 {
        self.dims.iter().product()
    }
}

/// Which file on disk a [`GgufFile`] was opened from, as it was when
/// mapped: what a cache derived from the file is checked against.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FileIdentity {
    /// The canonical path.
    pub path: std::path::PathBuf,
    /// Length in bytes.
    pub len: u64,
    /// Last modification, nanoseconds since the Unix epoch (0 where the
    /// file system does not say).
    pub mtime_ns: u128,
}

/// An open GGUF file: metadata, tensor directory and the mapped bytes.
pub struct GgufFile {
    map: Arc<Mmap>,
    source: Option<FileIdentity>,
    /// GGUF version (2 or 3).
    pub version: u32,
    metadata: HashMap<String, Value>,
    tensors: Vec<TensorInfo>,
    by_name: HashMap<String, usize>,
}

impl std::fmt::Debug for GgufFile {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GgufFile")
            .field("version", &self.version)
            .field("metadata_keys", &self.metadata.len())
            .field("tensors", &self.tensors.len())
            .finish()
    }
}

impl GgufFile {
    /// Maps and parses the file at `path`.
    pub fn open(path: &Path) -> Result<GgufFile, GgufError> {
        let io = |source| GgufError::Io {
            path: path.display().to_string(),
            source,
        };
        let file = File::open(path).map_err(io)?;
        // SAFETY: the map is read-only and private to this process; if another
        // process truncates the file while it is mapped, reads fault (SIGBUS),
        // which is the documented limit of every mmap-based model loader.
        let map = unsafe { Mmap::map(&file) }.map_err(io)?;
        let meta = file.metadata().map_err(io)?;
        let mut g = Self::parse(Arc::new(map))?;
        g.source = Some(FileIdentity {
            path: std::fs::canonicalize(path).map_err(io)?,
            len: meta.len(),
            mtime_ns: meta
                .modified()
                .ok()
                .and_then(|t| t.duration_since(std::time::UNIX_EPOCH).ok())
                .map_or(0, |d| d.as_nanos()),
        });
        Ok(g)
    }

    /// The file this was opened from (`None` when parsed from a map).
    pub fn source(&self) -> Option<&FileIdentity> {
        self.source.as_ref()
    }

    /// Parses a mapped file.
    pub fn parse(map: Arc<Mmap>) -> Result<GgufFile, GgufError> {
        let (version, metadata, tensors) = parse_bytes(&map)?;
        let by_name = tensors
            .iter()
            .enumerate()
            .map(|(i, t)| (t.name.clone(), i))
            .collect();
        Ok(GgufFile {
            map,
            source: None,
            version,
            metadata,
            tensors,
            by_name,
        })
    }

    /// The mapped file, shared with zero-copy weight views.
    pub fn map(&self) -> &Arc<Mmap> {
        &self.map
    }

    /// All metadata.
    pub fn metadata(&self) -> &HashMap<String, Value> {
        &self.metadata
    }

    /// All tensors, in file order.
    pub fn tensors(&self) -> &[TensorInfo] {
        &self.tensors
    }

    /// A tensor by name.
    pub fn tensor(&self, name: &str) -> Result<&TensorInfo, GgufError> {
        self.by_name
            .get(name)
            .map(|&i| &self.tensors[i])
            .ok_or_else(|| GgufError::MissingTensor(name.to_string()))
    }

    /// Whether a tensor exists.
    pub fn has_tensor(&self, name: &str) -> bool {
        self.by_name.contains_key(name)
    }

    /// Says that a tensor's bytes will not be read again (they were copied
    /// into another layout), so their pages leave the process's resident
    /// set; a later read would fetch them from the file again.
    pub fn release(&self, t: &TensorInfo) {
        #[cfg(unix)]
        // SAFETY: the map is a read-only shared mapping of a file: dropping
        // its pages loses nothing, a later access reads the file again.
        let _ = unsafe {
            self.map
                .unchecked_advise_range(memmap2::UncheckedAdvice::DontNeed, t.start, t.len)
        };
        #[cfg(not(unix))]
        let _ = t;
    }

    /// The bytes of a tensor (bounds were checked at parse time).
    pub fn tensor_bytes(&self, t: &TensorInfo) -> &[u8] {
        &self.map[t.start..t.start + t.len]
    }

    /// A metadata value by key.
    pub fn get(&self, key: &str) -> Option<&Value> {
        self.metadata.get(key)
    }

    /// A required unsigned integer (signed values >= 0 are accepted).
    pub fn u64(&self, key: &str) -> Result<u64, GgufError> {
        match self.get(key) {
            Some(Value::U64(v)) => Ok(*v),
            Some(Value::I64(v)) if *v >= 0 => Ok(*v as u64),
            Some(v) => Err(wrong(key, v, "unsigned integer")),
            None => Err(GgufError::MissingKey(key.to_string())),
        }
    }

    /// An optional unsigned integer.
    pub fn u64_opt(&self, key: &str) -> Result<Option<u64>, GgufError> {
        match self.get(key) {
            None => Ok(None),
            Some(_) => self.u64(key).map(Some),
        }
    }

    /// An optional float (integers are accepted).
    pub fn f64_opt(&self, key: &str) -> Result<Option<f64>, GgufError> {
        match self.get(key) {
            None => Ok(None),
            Some(Value::F64(v)) => Ok(Some(*v)),
            Some(Value::U64(v)) => Ok(Some(*v as f64)),
            Some(Value::I64(v)) => Ok(Some(*v as f64)),
            Some(v) => Err(wrong(key, v, "float")),
        }
    }

    /// An optional bool.
    pub fn bool_opt(&self, key: &str) -> Result<Option<bool>, GgufError> {
        match self.get(key) {
            None => Ok(None),
            Some(Value::Bool(v)) => Ok(Some(*v)),
            Some(v) => Err(wrong(key, v, "bool")),
        }
    }

    /// A required string.
    pub fn str(&self, key: &str) -> Result<&str, GgufError> {
        match self.get(key) {
            Some(Value::Str(s)) => Ok(s),
            Some(v) => Err(wrong(key, v, "string")),
            None => Err(GgufError::MissingKey(key.to_string())),
        }
    }

    /// An optional string.
    pub fn str_opt(&self, key: &str) -> Result<Option<&str>, GgufError> {
        match self.get(key) {
            None => Ok(None),
            Some(_) => self.str(key).map(Some),
        }
    }

    /// A required array of strings.
    pub fn str_array(&self, key: &str) -> Result<Vec<String>, GgufError> {
        match self.get(key) {
            Some(Value::Array(items)) => items
                .iter()
                .map(|v| match v {
                    Value::Str(s) => Ok(s.clone()),
                    other => Err(wrong(key, other, "array of strings")),
                })
                .collect(),
            Some(v) => Err(wrong(key, v, "array of strings")),
            None => Err(GgufError::MissingKey(key.to_string())),
        }
    }

    /// An optional array of integers.
    pub fn i64_array_opt(&self, key: &str) -> Result<Option<Vec<i64>>, GgufError> {
        match self.get(key) {
            None => Ok(None),
            Some(Value::Array(items)) => items
                .iter()
                .map(|v| match v {
                    Value::I64(x) => Ok(*x),
                    Value::U64(x) => i64::try_from(*x).map_err(|_| wrong(key, v, "array of i64")),
                    other => Err(wrong(key, other, "array of integers")),
                })
                .collect::<Result<Vec<_>, _>>()
                .map(Some),
            Some(v) => Err(wrong(key, v, "array of integers")),
        }
    }
}

impl GgufFile {
    /// An optional array of floats.
    pub fn f32_array_opt(&self, key: &str) -> Result<Option<Vec<f32>>, GgufError> {
        match self.get(key) {
            None => Ok(None),
            Some(Value::Array(items)) => items
                .iter()
                .map(|v| match v {
                    Value::F64(x) => Ok(*x as f32),
                    other => Err(wrong(key, other, "array of floats")),
                })
                .collect::<Result<Vec<_>, _>>()
                .map(Some),
            Some(v) => Err(wrong(key, v, "array of floats")),
        }
    }
}

fn wrong(key: &str, v: &Value, expected: &'static str) -> GgufError {
    GgufError::WrongType {
        key: key.to_string(),
        found: v.type_name(),
        expected,
    }
}

/// Bounds-checked little-endian cursor over the file bytes.
struct Cursor<'a> {
    buf: &'a [u8],
    pos: usize,
    /// Metadata array elements still allowed.
    elements_left: u64,
}

impl<'a> Cursor<'a> {
    fn take(&mut self, n: u64, what: &str) -> Result<&'a [u8], GgufError> {
        let remaining = (self.buf.len() - self.pos) as u64;
        if n > remaining {
            return Err(GgufError::Truncated {
                what: what.to_string(),
                offset: self.pos as u64,
                need: n,
                len: self.buf.len() as u64,
            });
        }
        let n = n as usize;
        let s = &self.buf[self.pos..self.pos + n];
        self.pos += n;
        Ok(s)
    }

    fn remaining(&self) -> u64 {
        (self.buf.len() - self.pos) as u64
    }

    fn u8(&mut self, what: &str) -> Result<u8, GgufError> {
        Ok(self.take(1, what)?[0])
    }

    fn u16(&mut self, what: &str) -> Result<u16, GgufError> {
        let b = self.take(2, what)?;
        Ok(u16::from_le_bytes([b[0], b[1]]))
    }

    fn u32(&mut self, what: &str) -> Result<u32, GgufError> {
        let b = self.take(4, what)?;
        Ok(u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
    }

    fn u64(&mut self, what: &str) -> Result<u64, GgufError> {
        let b = self.take(8, what)?;
        let mut a = [0u8; 8];
        a.copy_from_slice(b);
        Ok(u64::from_le_bytes(a))
    }

    fn string(&mut self, what: &str) -> Result<String, GgufError> {
        let len = self.u64(what)?;
        let bytes = self.take(len, what)?;
        Ok(String::from_utf8_lossy(bytes).into_owned())
    }

    fn value(&mut self, ty: u32, key: &str, depth: u32) -> Result<Value, GgufError> {
        Ok(match ty {
            0 => Value::U64(self.u8(key)? as u64),
            1 => Value::I64(self.u8(key)? as i8 as i64),
            2 => Value::U64(self.u16(key)? as u64),
            3 => Value::I64(self.u16(key)? as i16 as i64),
            4 => Value::U64(self.u32(key)? as u64),
            5 => Value::I64(self.u32(key)? as i32 as i64),
            6 => Value::F64(f32::from_bits(self.u32(key)?) as f64),
            7 => match self.u8(key)? {
                0 => Value::Bool(false),
                1 => Value::Bool(true),
                b => return Err(GgufError::Invalid(format!("key '{key}': bool byte {b}"))),
            },
            8 => Value::Str(self.string(key)?),
            9 => {
                if depth >= MAX_NESTING {
                    return Err(GgufError::Invalid(format!(
                        "key '{key}': arrays nested too deep"
                    )));
                }
                let elem_ty = self.u32(key)?;
                let count = self.u64(key)?;
                // Every element takes at least one byte, so a count above the
                // remaining bytes is a lie: refuse it before allocating.
                let min_size = match elem_ty {
                    0 | 1 | 7 => 1,
                    2 | 3 => 2,
                    4..=6 => 4,
                    8 | 10 | 11 | 12 => 8,
                    9 => 12,
                    t => {
                        return Err(GgufError::Invalid(format!(
                            "key '{key}': array of unknown type {t}"
                        )));
                    }
                };
                if count.saturating_mul(min_size) > self.remaining() {
                    return Err(GgufError::Truncated {
                        what: format!("array '{key}' of {count} elements"),
                        offset: self.pos as u64,
                        need: count.saturating_mul(min_size),
                        len: self.buf.len() as u64,
                    });
                }
                if count > self.elements_left {
                    return Err(GgufError::Invalid(format!(
                        "key '{key}': {count} array elements exceed the metadata cap of {MAX_METADATA_ELEMENTS}"
                    )));
                }
                self.elements_left -= count;
                let mut items = Vec::with_capacity(count as usize);
                for _ in 0..count {
                    items.push(self.value(elem_ty, key, depth + 1)?);
                }
                Value::Array(items)
            }
            10 => Value::U64(self.u64(key)?),
            11 => Value::I64(self.u64(key)? as i64),
            12 => Value::F64(f64::from_bits(self.u64(key)?)),
            t => {
                return Err(GgufError::Invalid(format!(
                    "key '{key}': unknown value type {t}"
                )));
            }
        })
    }
}

type Parsed = (u32, HashMap<String, Value>, Vec<TensorInfo>);

/// Parses header, metadata and tensor directory from raw bytes.
pub fn parse_bytes(buf: &[u8]) -> Result<Parsed, GgufError> {
    let mut c = Cursor {
        buf,
        pos: 0,
        elements_left: MAX_METADATA_ELEMENTS,
    };
    let magic = c.u32("magic")?;
    if magic != GGUF_MAGIC {
        return Err(GgufError::BadMagic(magic));
    }
    let version = c.u32("version")?;
    if !(2..=3).contains(&version) {
        return Err(GgufError::BadVersion(version));
    }
    let n_tensors = c.u64("tensor count")?;
    let n_kv = c.u64("metadata count")?;
    // Each key-value takes at least 12 bytes and each tensor info at least 24.
    if n_kv.saturating_mul(12) > c.remaining() || n_tensors.saturating_mul(24) > c.remaining() {
        return Err(GgufError::Invalid(format!(
            "header claims {n_kv} metadata entries and {n_tensors} tensors, more than a {}-byte file can hold",
            buf.len()
        )));
    }
    let mut metadata = HashMap::with_capacity(n_kv as usize);
    for _ in 0..n_kv {
        let key = c.string("metadata key")?;
        let ty = c.u32(&key)?;
        let v = c.value(ty, &key, 0)?;
        if metadata.insert(key.clone(), v).is_some() {
            return Err(GgufError::Invalid(format!(
                "duplicate metadata key '{key}'"
            )));
        }
    }
    let alignment = match metadata.get("general.alignment") {
        None => DEFAULT_ALIGNMENT,
        Some(Value::U64(a)) if *a > 0 && a.is_power_of_two() && *a <= 1 << 20 => *a,
        Some(v) => {
            return Err(GgufError::Invalid(format!(
                "general.alignment {v:?} is not a power of two"
            )));
        }
    };

    struct Raw {
        name: String,
        dims: Vec<u64>,
        ty: u32,
        offset: u64,
    }
    let mut raws = Vec::with_capacity(n_tensors as usize);
    for _ in 0..n_tensors {
        let name = c.string("tensor name")?;
        let n_dims = c.u32(&name)?;
        if n_dims == 0 || n_dims > MAX_DIMS {
            return Err(GgufError::Invalid(format!(
                "tensor '{name}' has {n_dims} dimensions (1..=4 allowed)"
            )));
        }
        let mut dims = Vec::with_capacity(n_dims as usize);
        for _ in 0..n_dims {
            dims.push(c.u64(&name)?);
        }
        let ty = c.u32(&name)?;
        let offset = c.u64(&name)?;
        raws.push(Raw {
            name,
            dims,
            ty,
            offset,
        });
    }
    let data_start = (c.pos as u64).div_ceil(alignment) * alignment;
    let file_len = buf.len() as u64;
    let mut tensors = Vec::with_capacity(raws.len());
    let mut seen = std::collections::HashSet::new();
    for r in raws {
        if !seen.insert(r.name.clone()) {
            return Err(GgufError::Invalid(format!("duplicate tensor '{}'", r.name)));
        }
        let ty = GgmlType::from_id(r.ty).ok_or_else(|| GgufError::UnsupportedType {
            tensor: r.name.clone(),
            ty: unsupported_type_name(r.ty),
        })?;
        let elems = r
            .dims
            .iter()
            .try_fold(1u64, |acc, &d| acc.checked_mul(d))
            .ok_or_else(|| {
                GgufError::Invalid(format!("tensor '{}' dims {:?} overflow", r.name, r.dims))
            })?;
        if r.dims[0] % ty.block_elems() != 0 {
            return Err(GgufError::Invalid(format!(
                "tensor '{}' row length {} is not a multiple of the {} block size {}",
                r.name,
                r.dims[0],
                ty.name(),
                ty.block_elems()
            )));
        }
        let len = (elems / ty.block_elems())
            .checked_mul(ty.block_bytes())
            .ok_or_else(|| GgufError::Invalid(format!("tensor '{}' size overflows", r.name)))?;
        if r.offset % alignment != 0 {
            return Err(GgufError::Invalid(format!(
                "tensor '{}' offset {} is not aligned to {alignment}",
                r.name, r.offset
            )));
        }
        let start = data_start.checked_add(r.offset);
        let end = start.and_then(|s| s.checked_add(len));
        match (start, end) {
            (Some(start), Some(end)) if end <= file_len => tensors.push(TensorInfo {
                name: r.name,
                dims: r.dims,
                ty,
                start: start as usize,
                len: len as usize,
            }),
            _ => {
                return Err(GgufError::TensorOutOfBounds {
                    tensor: r.name,
                    start: data_start.saturating_add(r.offset),
                    end: data_start.saturating_add(r.offset).saturating_add(len),
                    len: file_len,
                });
            }
        }
    }
    Ok((version, metadata, tensors))
}

/// Builds GGUF bytes; used by tests and fuzzing to make valid and broken files.
#[doc(hidden)]
pub mod writer {
    /// A metadata value to write.
    pub enum W<'a> {
        /// u32 value.
        U32(u32),
        /// f32 value.
        F32(f32),
        /// String value.
        Str(&'a str),
        /// Array of strings.
        StrArray(&'a [&'a str]),
    }

    /// Serialises a GGUF v3 file with the given metadata and tensors (name, dims, type id, data).
    pub fn build(meta: &[(&str, W<'_>)], tensors: &[(&str, &[u64], u32, &[u8])]) -> Vec<u8> {
        let mut b = Vec::new();
        let s = |b: &mut Vec<u8>, x: &str| {
            b.extend_from_slice(&(x.len() as u64).to_le_bytes());
            b.extend_from_slice(x.as_bytes());
        };
        b.extend_from_slice(&super::GGUF_MAGIC.to_le_bytes());
        b.extend_from_slice(&3u32.to_le_bytes());
        b.extend_from_slice(&(tensors.len() as u64).to_le_bytes());
        b.extend_from_slice(&(meta.len() as u64).to_le_bytes());
        for (k, v) in meta {
            s(&mut b, k);
            match v {
                W::U32(x) => {
                    b.extend_from_slice(&4u32.to_le_bytes());
                    b.extend_from_slice(&x.to_le_bytes());
                }
                W::F32(x) => {
                    b.extend_from_slice(&6u32.to_le_bytes());
                    b.extend_from_slice(&x.to_le_bytes());
                }
                W::Str(x) => {
                    b.extend_from_slice(&8u32.to_le_bytes());
                    s(&mut b, x);
                }
                W::StrArray(xs) => {
                    b.extend_from_slice(&9u32.to_le_bytes());
                    b.extend_from_slice(&8u32.to_le_bytes());
                    b.extend_from_slice(&(xs.len() as u64).to_le_bytes());
                    for x in xs.iter() {
                        s(&mut b, x);
                    }
                }
            }
        }
        let mut offset = 0u64;
        let mut offsets = Vec::new();
        for (name, dims, ty, data) in tensors {
            s(&mut b, name);
            b.extend_from_slice(&(dims.len() as u32).to_le_bytes());
            for d in dims.iter() {
                b.extend_from_slice(&d.to_le_bytes());
            }
            b.extend_from_slice(&ty.to_le_bytes());
            b.extend_from_slice(&offset.to_le_bytes());
            offsets.push(offset);
            offset += (data.len() as u64).div_ceil(32) * 32;
        }
        while b.len() % 32 != 0 {
            b.push(0);
        }
        let base = b.len();
        for ((_, _, _, data), off) in tensors.iter().zip(offsets) {
            b.resize(base + off as usize, 0);
            b.extend_from_slice(data);
        }
        b
    }
}

#[cfg(test)]
mod tests {
    use super::writer::{W, build};
    use super::*;
    use proptest::prelude::*;

    fn sample() -> Vec<u8> {
        let data: Vec<u8> = (0..64u32).flat_map(|i| (i as f32).to_le_bytes()).collect();
        build(
            &[
                ("general.architecture", W::Str("llama")),
                ("llama.block_count", W::U32(1)),
                ("v", W::F32(0.5)),
            ],
            &[("a", &[16, 4], 0, &data), ("b", &[32], 0, &data[..128])],
        )
    }

    #[test]
    fn parses_a_valid_file() {
        let buf = sample();
        let (v, meta, tensors) = parse_bytes(&buf).unwrap();
        assert_eq!(v, 3);
        assert_eq!(meta["general.architecture"], Value::Str("llama".into()));
        assert_eq!(meta["llama.block_count"], Value::U64(1));
        assert_eq!(tensors.len(), 2);
        assert_eq!(tensors[0].dims, vec![16, 4]);
        assert_eq!(tensors[0].len, 256);
        let a = &buf[tensors[0].start..tensors[0].start + 4];
        assert_eq!(a, 0f32.to_le_bytes());
        let b = &buf[tensors[1].start + 4..tensors[1].start + 8];
        assert_eq!(b, 1f32.to_le_bytes());
    }

    #[test]
    fn wrong_magic_is_refused() {
        let mut buf = sample();
        buf[0] = b'X';
        assert!(matches!(parse_bytes(&buf), Err(GgufError::BadMagic(_))));
    }

    #[test]
    fn every_truncation_is_an_error() {
        let buf = sample();
        let (_, _, tensors) = parse_bytes(&buf).unwrap();
        let data_end = tensors.iter().map(|t| t.start + t.len).max().unwrap();
        for n in 0..data_end {
            assert!(parse_bytes(&buf[..n]).is_err(), "truncated at {n} parsed");
        }
    }

    #[test]
    fn unsupported_type_names_tensor_and_type() {
        let data = [0u8; 24];
        let buf = build(&[], &[("blk.0.attn_q.weight", &[32], 7, &data)]);
        let err = parse_bytes(&buf).unwrap_err().to_string();
        assert!(
            err.contains("blk.0.attn_q.weight") && err.contains("Q5_1"),
            "{err}"
        );
    }

    #[test]
    fn tensor_out_of_bounds_is_refused() {
        let mut buf = sample();
        // Shrink the file so that tensor b's data is cut.
        buf.truncate(buf.len() - 1);
        let err = parse_bytes(&buf).unwrap_err();
        assert!(
            matches!(err, GgufError::TensorOutOfBounds { ref tensor, .. } if tensor == "b"),
            "{err}"
        );
    }

    #[test]
    fn huge_counts_do_not_allocate() {
        let mut buf = sample();
        // metadata count at bytes 16..24
        buf[16..24].copy_from_slice(&u64::MAX.to_le_bytes());
        assert!(parse_bytes(&buf).is_err());
        let mut buf = sample();
        buf[8..16].copy_from_slice(&(1u64 << 40).to_le_bytes());
        assert!(parse_bytes(&buf).is_err());
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: 2000, .. ProptestConfig::default() })]
        /// Random byte mutations of a valid file never panic; when the result
        /// parses, every tensor view lies inside the buffer.
        #[test]
        fn mutated_headers_never_panic(muts in prop::collection::vec((0usize..400, any::<u8>()), 1..8), cut in 0usize..600) {
            let mut buf = sample();
            for (i, b) in muts {
                if i < buf.len() { buf[i] = b; }
            }
            let cut = cut.min(buf.len());
            let buf = &buf[..buf.len() - cut / 4];
            if let Ok((_, _, tensors)) = parse_bytes(buf) {
                for t in tensors {
                    prop_assert!(t.start + t.len <= buf.len());
                }
            }
        }

        /// Random bytes after a valid magic and version never panic.
        #[test]
        fn random_bodies_never_panic(body in prop::collection::vec(any::<u8>(), 0..512)) {
            let mut buf = Vec::new();
            buf.extend_from_slice(&GGUF_MAGIC.to_le_bytes());
            buf.extend_from_slice(&3u32.to_le_bytes());
            buf.extend_from_slice(&body);
            let _ = parse_bytes(&buf);
        }
    }
}
