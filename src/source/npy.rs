//! [`NpyArray`]: a `.npy` file read in place (memory-mapped, or with `pread`); row `i` (along the
//! first axis) is sample `i`.
//!
//! Reads format versions 1.0, 2.0 and 3.0. The dtype and shape come from the header; the array
//! must be C-ordered (a Fortran-ordered array of more than one dimension is refused, since its
//! rows are not contiguous), little-endian (or single-byte), of a plain numeric dtype. Object,
//! structured, string and datetime arrays are refused with an error that names the dtype, and
//! so are rows of zero bytes (a shape such as `(2**64 - 1, 0)` would be that many empty
//! samples from a file of a hundred bytes).
//!
//! A `.npy` file holds no checksums. With [`ReadOptions::verify_checksums`], the array takes
//! its own when it is opened (xxh3 of each group of rows, [`NpyArray::CHECKSUM_GROUP_BYTES`] at most)
//! and checks every row it reads against them.

use std::path::{Path, PathBuf};

use crate::error::{Error, Result};
use crate::file::{FileData, FileIdentity, ReadMode, RecordBuf, open_file};
use crate::format::{DType, Field, ReadOptions, Schema, record_checksum};
use crate::source::{Dataset, Description, Format, Sample, Source};

pub(crate) const NPY_MAGIC: &[u8] = b"\x93NUMPY";

/// The longest header read (NumPy's own reader refuses more than 10,000 bytes by default).
const MAX_HEADER_BYTES: usize = 1 << 20;

/// Bytes hashed at a time when the checksums are taken at open.
const CHECKSUM_CHUNK_BYTES: usize = 8 << 20;

/// A `.npy` array read in place: a dataset with one tensor field, `data`.
///
/// By default the file is memory-mapped ([`ReadMode::Map`]) and a sample is a view into the
/// mapping. The mapping is shared with the file: if another process truncates it while it is
/// open (`np.save` to the same path does: it opens the file with `"wb"`), the next read past the
/// new end kills this process with `SIGBUS`; bytes written in place are read as they change.
/// Either guarantee that the file is not written while it is open (write a new file and rename
/// it over the old one, which the open array ignores), or open it with [`ReadMode::Pread`]
/// ([`NpyArray::open_with`]), which reads with `pread`: a truncated file is then an
/// [`Error::FileChanged`]. [`Dataset::check_unchanged`] reports a file replaced, truncated,
/// extended or written since it was opened; the loader calls it at each epoch's start.
///
/// # Verification
///
/// Opened with [`ReadOptions::verify_checksums`], the array hashes its rows once, at open
/// (xxh3, one checksum per group of rows of at most [`NpyArray::CHECKSUM_GROUP_BYTES`], or per row for
/// larger rows), and every read ([`Dataset::get`], [`NpyArray::row`]) hashes the group of the
/// row it reads and compares: a row whose bytes are not those the file held at open (written
/// in place by another process, even within an epoch and with its times put back) is an
/// [`Error::FileChanged`] naming the file and the row, never data. It costs a pass over the
/// whole file at open, 8 bytes of memory per group, and a hash of the group at each read
/// (`benches/RESULTS.md`). With [`ReadMode::Pread`], the group is read into a per-thread
/// buffer and checked there, so the bytes delivered are the bytes checked; with the mapping,
/// a write that lands between the check and the loader's copy out of the mapping is not seen
/// (the next read of the row is refused).
///
/// ```
/// use gpufeed::format::{ReadMode, ReadOptions};
/// use gpufeed::NpyArray;
/// # fn f(path: &std::path::Path) -> gpufeed::Result<()> {
/// let options = ReadOptions { mode: ReadMode::Pread, verify_checksums: true };
/// let labels = NpyArray::open_with(path, "label", options)?;
/// # let _ = labels; Ok(()) }
/// ```
pub struct NpyArray {
    path: PathBuf,
    data: FileData,
    identity: FileIdentity,
    schema: Schema,
    dtype: DType,
    shape: Vec<u64>,
    data_offset: usize,
    row_bytes: usize,
    rows: u64,
    /// With [`ReadOptions::verify_checksums`]: the rows' checksums taken at open.
    sums: Option<RowSums>,
}

/// Checksums of an array's rows, taken at open: `sums[g]` is the xxh3 of rows
/// `g * rows_per_sum ..` (up to `rows_per_sum` of them, fewer for the last group).
struct RowSums {
    rows_per_sum: u64,
    sums: Vec<u64>,
}

impl std::fmt::Debug for NpyArray {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NpyArray")
            .field("path", &self.path)
            .field("dtype", &self.dtype)
            .field("shape", &self.shape)
            .field("mode", &self.data.mode())
            .field("verify_checksums", &self.sums.is_some())
            .finish()
    }
}

/// What a `.npy` header says.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct NpyHeader {
    pub dtype: DType,
    pub shape: Vec<u64>,
    pub data_offset: usize,
}

impl NpyArray {
    /// The name of the one field of an `NpyArray`'s schema.
    pub const FIELD: &'static str = "data";

    /// With [`ReadOptions::verify_checksums`], rows are checksummed in groups of as many rows
    /// as fit in this many bytes (one row, if a row is larger): each read hashes its row's
    /// group, and the checksums kept take at most 8 bytes per 2 KiB of the array.
    pub const CHECKSUM_GROUP_BYTES: usize = 4096;

    /// Maps `path` and parses its header.
    pub fn open(path: impl AsRef<Path>) -> Result<NpyArray> {
        NpyArray::open_with(path, NpyArray::FIELD, ReadMode::Map)
    }

    /// Maps `path`, naming its field `field` (for example `label`).
    pub fn open_as(path: impl AsRef<Path>, field: &str) -> Result<NpyArray> {
        NpyArray::open_with(path, field, ReadMode::Map)
    }

    /// Opens `path` to be read as `options` say, naming its field `field` ([`NpyArray::FIELD`]
    /// unless the array is, say, the labels). `options` is a [`ReadMode`] alone, or
    /// [`ReadOptions`] with [`verify_checksums`](ReadOptions::verify_checksums) (see
    /// [Verification](NpyArray#verification): it reads the whole file here).
    pub fn open_with(
        path: impl AsRef<Path>,
        field: &str,
        options: impl Into<ReadOptions>,
    ) -> Result<NpyArray> {
        let path = path.as_ref();
        let options = options.into();
        let (data, identity) = open_file(path, options.mode)?;
        let len = data.len();
        // The header's length is in its first 12 bytes; read no more than it and the file hold.
        let prefix = data.bytes_at(path, 0, len.min(12) as usize)?;
        let claimed = match prefix.get(6) {
            Some(1) if prefix.len() >= 10 => {
                10 + usize::from(u16::from_le_bytes([prefix[8], prefix[9]]))
            }
            Some(2 | 3) if prefix.len() >= 12 => {
                12 + u32::from_le_bytes([prefix[8], prefix[9], prefix[10], prefix[11]]) as usize
            }
            _ => prefix.len(),
        };
        if claimed > MAX_HEADER_BYTES {
            return Err(Error::UnsupportedNpy {
                path: path.to_path_buf(),
                what: format!(
                    "a header of {claimed} bytes (at most {MAX_HEADER_BYTES} are read; NumPy writes a few hundred)"
                ),
            });
        }
        let head = data.bytes_at(path, 0, (len as usize).min(claimed.max(prefix.len())))?;
        drop(prefix);
        let header = parse_header(&head).map_err(|e| e.at(path))?;
        drop(head);
        let row_shape = header.shape[1..].to_vec();
        let row_elems = row_shape.iter().try_fold(1u64, |a, &d| a.checked_mul(d));
        let row_bytes = row_elems
            .and_then(|n| n.checked_mul(header.dtype.size() as u64))
            .and_then(|n| usize::try_from(n).ok())
            .filter(|&n| n <= u32::MAX as usize)
            .ok_or_else(|| Error::UnsupportedNpy {
                path: path.to_path_buf(),
                what: format!("rows of shape {row_shape:?} are larger than 4 GiB"),
            })?;
        let rows = header.shape[0];
        if row_bytes == 0 && rows > 0 {
            return Err(Error::UnsupportedNpy {
                path: path.to_path_buf(),
                what: format!(
                    "shape {:?}: its {rows} rows of shape {row_shape:?} hold no bytes, so there is nothing to read as samples",
                    header.shape
                ),
            });
        }
        let need = (row_bytes as u64)
            .checked_mul(rows)
            .and_then(|n| n.checked_add(header.data_offset as u64));
        if need.is_none_or(|n| n > len) {
            return Err(Error::Malformed {
                path: path.to_path_buf(),
                format: "npy",
                what: format!(
                    "shape {:?} of {} needs {} bytes after the {}-byte header, the file has {}: it is truncated",
                    header.shape,
                    header.dtype,
                    (row_bytes as u128) * rows as u128,
                    header.data_offset,
                    len.saturating_sub(header.data_offset as u64)
                ),
            });
        }
        let schema = Schema::validated(vec![Field::tensor(field, header.dtype, &row_shape)])
            .map_err(|what| Error::UnsupportedNpy {
                path: path.to_path_buf(),
                what,
            })?;
        let sums = if options.verify_checksums {
            Some(RowSums::take(
                &data,
                path,
                header.data_offset,
                row_bytes,
                rows,
            )?)
        } else {
            None
        };
        Ok(NpyArray {
            path: path.to_path_buf(),
            data,
            identity,
            schema,
            dtype: header.dtype,
            shape: header.shape,
            data_offset: header.data_offset,
            row_bytes,
            rows,
            sums,
        })
    }

    /// The file's path.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The element type.
    pub fn dtype(&self) -> DType {
        self.dtype
    }

    /// The whole array's shape; `shape()[0]` is the number of samples.
    pub fn shape(&self) -> &[u64] {
        &self.shape
    }

    /// Bytes in one row (one sample).
    pub fn row_bytes(&self) -> usize {
        self.row_bytes
    }

    /// Where the data starts in the file (the header's length).
    pub fn data_offset(&self) -> usize {
        self.data_offset
    }

    /// How the file is read.
    pub fn read_mode(&self) -> ReadMode {
        self.data.mode()
    }

    /// The options the array was opened with.
    pub fn read_options(&self) -> ReadOptions {
        ReadOptions {
            mode: self.data.mode(),
            verify_checksums: self.sums.is_some(),
        }
    }

    /// The bytes of row `i`, borrowed from the mapping (checked first, if the array was opened
    /// with [`ReadOptions::verify_checksums`]). An array opened with [`ReadMode::Pread`] has no
    /// mapping to borrow from: [`Error::InvalidConfig`]; use [`Dataset::get`].
    pub fn row(&self, i: u64) -> Result<&[u8]> {
        let start = self.row_start(i)?;
        match &self.data {
            FileData::Map(map) => {
                if let Some(sums) = &self.sums {
                    let group = sums.group_of(i, self.rows, self.data_offset, self.row_bytes);
                    sums.check(&self.path, i, &group, &map[group.bytes.clone()])?;
                }
                Ok(&map[start..start + self.row_bytes])
            }
            FileData::Pread { .. } => Err(Error::config(
                "mode",
                format!(
                    "row borrows from the mapping, and {} was opened with ReadMode::Pread: use get",
                    self.path.display()
                ),
            )),
        }
    }

    fn row_start(&self, i: u64) -> Result<usize> {
        if i >= self.rows {
            return Err(Error::OutOfRange {
                index: i,
                len: self.rows,
            });
        }
        // rows * row_bytes + data_offset <= the file's length (checked at open).
        Ok(self.data_offset + i as usize * self.row_bytes)
    }

    /// The file's bytes (a mapping, or the file to read at offsets), for readers of the whole
    /// array in place (a 1-D array of tokens).
    pub(crate) fn file_data(&self) -> &FileData {
        &self.data
    }

    /// Checks that the path still names the file opened, with the same size, modification
    /// time and status-change time; see [`Dataset::check_unchanged`].
    pub fn check_unchanged(&self) -> Result<()> {
        self.identity.check(&self.path)
    }

    /// [`Dataset::get`] with [`ReadOptions::verify_checksums`]: the row's group checked, then
    /// the row (apart from `get`, so that the unverified path stays as small as it was).
    #[inline(never)]
    fn get_verified(&self, index: u64, sums: &RowSums) -> Result<Sample<'_>> {
        let start = self.row_start(index)?;
        if let FileData::Map(_) = &self.data {
            return Ok(Sample::new(self.row(index)?, &self.schema));
        }
        // The group is read once, checked, and the row delivered from what was checked.
        let group = sums.group_of(index, self.rows, self.data_offset, self.row_bytes);
        let bytes = group.bytes.clone();
        let mut buf = RecordBuf::with_len(bytes.len());
        self.data
            .read_at(&self.path, bytes.start as u64, buf.as_mut_slice())?;
        sums.check(&self.path, index, &group, buf.as_slice())?;
        if bytes.len() == self.row_bytes {
            return Ok(Sample::read(buf, &self.schema));
        }
        let mut row = RecordBuf::with_len(self.row_bytes);
        let at = start - bytes.start;
        row.as_mut_slice()
            .copy_from_slice(&buf.as_slice()[at..at + self.row_bytes]);
        Ok(Sample::read(row, &self.schema))
    }
}

impl Dataset for NpyArray {
    fn len(&self) -> u64 {
        self.rows
    }

    fn schema(&self) -> &Schema {
        &self.schema
    }

    fn get(&self, index: u64) -> Result<Sample<'_>> {
        if let Some(sums) = &self.sums {
            return self.get_verified(index, sums);
        }
        let start = self.row_start(index)?;
        match &self.data {
            FileData::Map(map) => Ok(Sample::new(
                &map[start..start + self.row_bytes],
                &self.schema,
            )),
            FileData::Pread { file, len } => Ok(Sample::unread(
                file,
                &self.path,
                *len,
                start as u64,
                self.row_bytes,
                &self.schema,
            )),
        }
    }

    fn check_unchanged(&self) -> Result<()> {
        NpyArray::check_unchanged(self)
    }

    /// The file's size and a sample of its bytes (header included).
    fn fingerprint(&self) -> Result<Option<u64>> {
        self.data.fingerprint(&self.path).map(Some)
    }
}

impl Source for NpyArray {
    fn format(&self) -> Format {
        Format::Npy
    }

    /// The array's dtype, shape, header and sizes.
    fn describe(&self) -> Result<Description> {
        let file_bytes = std::fs::metadata(&self.path)
            .map_err(|e| Error::io(&self.path, "look at", e))?
            .len();
        let data_bytes = self.rows * self.row_bytes as u64;
        Ok(Description::new(
            self.path.display().to_string(),
            Format::Npy,
            self.rows,
            self.schema.clone(),
        )
        .fact(
            "dtype",
            "array",
            self.dtype().name(),
            format!(
                "{} {:?} (C order), {}-byte header",
                self.dtype(),
                self.shape(),
                self.data_offset()
            ),
        )
        .fact("shape", "", self.shape().to_vec(), "")
        .count("file_bytes", "file bytes", file_bytes)
        .count("header_bytes", "", self.data_offset() as u64)
        .count("data_bytes", "data bytes", data_bytes)
        .fact(
            "record_bytes",
            "record bytes",
            serde_json::json!({
                "min": self.row_bytes, "mean": self.row_bytes, "max": self.row_bytes, "exact": true,
            }),
            format!("{} each", self.row_bytes),
        ))
    }

    /// A `.npy` array has no checksums: its header and size were checked at open, and a row
    /// holds no structure to check. With checksums taken at open
    /// ([`ReadOptions::verify_checksums`]), every row is read and checked against them.
    fn verify(&self, progress: &mut dyn FnMut(u64, u64)) -> Result<()> {
        if self.sums.is_some() {
            for i in 0..self.rows {
                self.get(i)?.bytes()?;
                progress(i + 1, self.rows);
            }
        }
        progress(self.rows, self.rows);
        Ok(())
    }
}

impl RowSums {
    /// Hashes the `rows` rows of `row_bytes` bytes at `data_offset` of `data` (a pass over them).
    fn take(
        data: &FileData,
        path: &Path,
        data_offset: usize,
        row_bytes: usize,
        rows: u64,
    ) -> Result<RowSums> {
        let rows_per_sum = (NpyArray::CHECKSUM_GROUP_BYTES / row_bytes).max(1) as u64;
        let group_bytes = rows_per_sum as usize * row_bytes;
        let groups = rows.div_ceil(rows_per_sum);
        let mut sums = Vec::new();
        // At most 8 bytes per 2 KiB of a file that exists, but a failure to allocate is still
        // an error, not an abort.
        usize::try_from(groups)
            .ok()
            .and_then(|n| sums.try_reserve_exact(n).ok())
            .ok_or_else(|| {
                Error::io(
                    path,
                    "verify",
                    std::io::Error::other(format!(
                        "no memory for the checksums of {groups} groups of rows"
                    )),
                )
            })?;
        // Whole groups at a time, so that each chunk splits into groups.
        let chunk_rows = (CHECKSUM_CHUNK_BYTES / group_bytes).max(1) as u64 * rows_per_sum;
        let mut buf = Vec::new();
        let mut first = 0u64;
        while first < rows {
            let n = chunk_rows.min(rows - first);
            // rows * row_bytes + data_offset <= the file's length (checked at open).
            let at = data_offset + first as usize * row_bytes;
            let len = n as usize * row_bytes;
            let bytes = match data {
                FileData::Map(map) => &map[at..at + len],
                FileData::Pread { .. } => {
                    buf.resize(len, 0);
                    data.read_at(path, at as u64, &mut buf)?;
                    &buf[..]
                }
            };
            sums.extend(bytes.chunks(group_bytes).map(record_checksum));
            first += n;
        }
        Ok(RowSums { rows_per_sum, sums })
    }

    /// The group that holds row `i` (`i < rows`): its rows, and their bytes in the file.
    fn group_of(&self, i: u64, rows: u64, data_offset: usize, row_bytes: usize) -> RowGroup {
        let first = i / self.rows_per_sum * self.rows_per_sum;
        let end = (first + self.rows_per_sum).min(rows);
        RowGroup {
            rows: first..end,
            bytes: data_offset + first as usize * row_bytes..data_offset + end as usize * row_bytes,
        }
    }

    /// Compares `bytes`, those of `group`, which holds row `i`, with its checksum at open.
    fn check(&self, path: &Path, i: u64, group: &RowGroup, bytes: &[u8]) -> Result<()> {
        let was = self.sums[(group.rows.start / self.rows_per_sum) as usize];
        let now = record_checksum(bytes);
        if now == was {
            return Ok(());
        }
        let (rows, at) = (&group.rows, &group.bytes);
        let what = if rows.end - rows.start == 1 {
            format!("its bytes {}..{}", at.start, at.end)
        } else {
            format!(
                "rows {}..{} (bytes {}..{}, checked together)",
                rows.start, rows.end, at.start, at.end
            )
        };
        Err(Error::FileChanged {
            path: path.to_path_buf(),
            what: format!(
                "row {i} is not what the file held when the array was opened: the xxh3 of {what} \
                 was {was:#018x} then and is {now:#018x} now, so the file was written in place \
                 while open; to change data under a running job, write a new file and rename it \
                 over the old one"
            ),
        })
    }
}

/// A group of rows checked together: its rows, and their bytes in the file.
struct RowGroup {
    rows: std::ops::Range<u64>,
    bytes: std::ops::Range<usize>,
}

/// A header fault, before the path is known.
#[derive(Debug)]
pub(crate) enum HeaderError {
    Malformed(String),
    Unsupported(String),
}

impl HeaderError {
    /// What is wrong, for a message that names the file or member itself.
    pub(crate) fn what(self) -> String {
        match self {
            HeaderError::Malformed(what) | HeaderError::Unsupported(what) => what,
        }
    }

    fn at(self, path: &Path) -> Error {
        match self {
            HeaderError::Malformed(what) => Error::Malformed {
                path: path.to_path_buf(),
                format: "npy",
                what,
            },
            HeaderError::Unsupported(what) => Error::UnsupportedNpy {
                path: path.to_path_buf(),
                what,
            },
        }
    }
}

/// Parses the header of a `.npy` file (its first bytes) whose rows are samples: an array of
/// at least one dimension.
pub(crate) fn parse_header(b: &[u8]) -> Result<NpyHeader, HeaderError> {
    let header = parse_array_header(b)?;
    if header.shape.is_empty() {
        return Err(HeaderError::Unsupported(
            "a 0-dimensional array has no rows to use as samples".into(),
        ));
    }
    Ok(header)
}

/// Parses the header of a `.npy` file (its first bytes) of any shape, a 0-dimensional one (a
/// scalar) included: one value, such as a WebDataset member.
pub(crate) fn parse_array_header(b: &[u8]) -> Result<NpyHeader, HeaderError> {
    use HeaderError::{Malformed, Unsupported};
    if b.is_empty() {
        return Err(Malformed("the file is empty".into()));
    }
    if b.len() < 10 || !b.starts_with(NPY_MAGIC) {
        return Err(Malformed("no .npy magic (\\x93NUMPY) at the start".into()));
    }
    let (major, minor) = (b[6], b[7]);
    let (len, at) = match major {
        1 => (u16::from_le_bytes([b[8], b[9]]) as usize, 10usize),
        2 | 3 if b.len() >= 12 => (u32::from_le_bytes([b[8], b[9], b[10], b[11]]) as usize, 12),
        2 | 3 => return Err(Malformed("truncated header".into())),
        _ => {
            return Err(Unsupported(format!(
                "format version {major}.{minor} (1.0 to 3.0 are read)"
            )));
        }
    };
    let end = at
        .checked_add(len)
        .filter(|&e| e <= b.len())
        .ok_or_else(|| Malformed(format!("header claims {len} bytes, the file ends first")))?;
    let text =
        std::str::from_utf8(&b[at..end]).map_err(|_| Malformed("header is not text".into()))?;
    let dict = match PyValue::parse(text).map_err(|e| Malformed(format!("header {text:?}: {e}")))? {
        PyValue::Dict(d) => d,
        _ => return Err(Malformed(format!("header {text:?} is not a dict"))),
    };
    let get = |key: &str| {
        dict.iter()
            .find(|(k, _)| k == key)
            .map(|(_, v)| v)
            .ok_or_else(|| Malformed(format!("header has no '{key}'")))
    };
    let descr = match get("descr")? {
        PyValue::Str(s) => s.as_str(),
        other => return Err(Unsupported(format!("structured dtype {other:?}"))),
    };
    let dtype = parse_descr(descr)?;
    let fortran = match get("fortran_order")? {
        PyValue::Bool(f) => *f,
        other => return Err(Malformed(format!("fortran_order is {other:?}"))),
    };
    let shape = match get("shape")? {
        PyValue::Tuple(items) => items
            .iter()
            .map(|v| match v {
                PyValue::Int(n) => Ok(*n),
                other => Err(Malformed(format!(
                    "shape entry {other:?} is not a whole number"
                ))),
            })
            .collect::<Result<Vec<u64>, _>>()?,
        other => return Err(Malformed(format!("shape is {other:?}, not a tuple"))),
    };
    if fortran && shape.iter().filter(|&&d| d != 1).count() > 1 {
        return Err(Unsupported(format!(
            "Fortran-ordered array of shape {shape:?}: rows are not contiguous; save it with np.ascontiguousarray"
        )));
    }
    Ok(NpyHeader {
        dtype,
        shape,
        data_offset: end,
    })
}

fn parse_descr(descr: &str) -> Result<DType, HeaderError> {
    use HeaderError::Unsupported;
    let (order, code) = match descr.chars().next() {
        Some(c @ ('<' | '>' | '|' | '=')) => (c, &descr[1..]),
        _ => ('=', descr),
    };
    let dtype = match code {
        "u1" => DType::U8,
        "i1" => DType::I8,
        "b1" => DType::Bool,
        "u2" => DType::U16,
        "i2" => DType::I16,
        "f2" => DType::F16,
        "u4" => DType::U32,
        "i4" => DType::I32,
        "f4" => DType::F32,
        "u8" => DType::U64,
        "i8" => DType::I64,
        "f8" => DType::F64,
        _ => {
            return Err(Unsupported(format!(
                "dtype '{descr}' (object, string, complex, datetime and structured arrays are not numeric tensors)"
            )));
        }
    };
    let big = order == '>' || (order == '=' && cfg!(target_endian = "big"));
    if big && dtype.size() > 1 {
        return Err(Unsupported(format!(
            "big-endian dtype '{descr}'; convert with arr.astype(arr.dtype.newbyteorder('<'))"
        )));
    }
    Ok(dtype)
}

/// The subset of Python literals a `.npy` header uses.
#[derive(Debug, Clone, PartialEq)]
enum PyValue {
    Str(String),
    Int(u64),
    Bool(bool),
    Tuple(Vec<PyValue>),
    List(Vec<PyValue>),
    Dict(Vec<(String, PyValue)>),
}

impl PyValue {
    fn parse(text: &str) -> Result<PyValue, String> {
        let mut p = PyParser {
            s: text.as_bytes(),
            at: 0,
            depth: 0,
        };
        let v = p.value()?;
        p.ws();
        if p.at != p.s.len() {
            return Err(format!("unexpected text at byte {}", p.at));
        }
        Ok(v)
    }
}

struct PyParser<'a> {
    s: &'a [u8],
    at: usize,
    depth: usize,
}

impl PyParser<'_> {
    fn ws(&mut self) {
        while self.at < self.s.len() && self.s[self.at].is_ascii_whitespace() {
            self.at += 1;
        }
    }

    fn peek(&mut self) -> Option<u8> {
        self.ws();
        self.s.get(self.at).copied()
    }

    fn value(&mut self) -> Result<PyValue, String> {
        self.depth += 1;
        if self.depth > 32 {
            return Err("nested too deeply".into());
        }
        let v = match self.peek() {
            Some(q @ (b'\'' | b'"')) => {
                self.at += 1;
                let start = self.at;
                while self.at < self.s.len() && self.s[self.at] != q {
                    self.at += 1;
                }
                if self.at == self.s.len() {
                    return Err("unterminated string".into());
                }
                let s = String::from_utf8_lossy(&self.s[start..self.at]).into_owned();
                self.at += 1;
                PyValue::Str(s)
            }
            Some(b'0'..=b'9') => {
                let start = self.at;
                while self.at < self.s.len() && self.s[self.at].is_ascii_digit() {
                    self.at += 1;
                }
                // `3L` in headers written by Python 2.
                if self.s.get(self.at) == Some(&b'L') {
                    self.at += 1;
                }
                let digits = std::str::from_utf8(&self.s[start..self.at])
                    .unwrap_or("")
                    .trim_end_matches('L');
                PyValue::Int(
                    digits
                        .parse()
                        .map_err(|_| format!("number {digits} is out of range"))?,
                )
            }
            Some(b'T') if self.s[self.at..].starts_with(b"True") => {
                self.at += 4;
                PyValue::Bool(true)
            }
            Some(b'F') if self.s[self.at..].starts_with(b"False") => {
                self.at += 5;
                PyValue::Bool(false)
            }
            Some(open @ (b'(' | b'[' | b'{')) => {
                self.at += 1;
                let close = match open {
                    b'(' => b')',
                    b'[' => b']',
                    _ => b'}',
                };
                let mut items = Vec::new();
                let mut entries = Vec::new();
                loop {
                    if self.peek() == Some(close) {
                        self.at += 1;
                        break;
                    }
                    let v = self.value()?;
                    if open == b'{' {
                        let PyValue::Str(k) = v else {
                            return Err("dict key is not a string".into());
                        };
                        if self.peek() != Some(b':') {
                            return Err(format!("expected ':' at byte {}", self.at));
                        }
                        self.at += 1;
                        entries.push((k, self.value()?));
                    } else {
                        items.push(v);
                    }
                    match self.peek() {
                        Some(b',') => self.at += 1,
                        Some(c) if c == close => {}
                        _ => return Err(format!("expected ',' at byte {}", self.at)),
                    }
                }
                match open {
                    b'(' => PyValue::Tuple(items),
                    b'[' => PyValue::List(items),
                    _ => PyValue::Dict(entries),
                }
            }
            _ => return Err(format!("unexpected text at byte {}", self.at)),
        };
        self.depth -= 1;
        Ok(v)
    }
}

/// Writes a `.npy` (version 1.0) header for a C-ordered little-endian array; used by tests,
/// benches and the command to make data sets. NumPy has no bf16, so that dtype is refused.
pub fn npy_header(dtype: DType, shape: &[u64]) -> Result<Vec<u8>> {
    let descr = match dtype {
        DType::U8 => "|u1",
        DType::I8 => "|i1",
        DType::Bool => "|b1",
        DType::U16 => "<u2",
        DType::I16 => "<i2",
        DType::F16 => "<f2",
        DType::U32 => "<u4",
        DType::I32 => "<i4",
        DType::F32 => "<f4",
        DType::U64 => "<u8",
        DType::I64 => "<i8",
        DType::F64 => "<f8",
        DType::BF16 => {
            return Err(Error::config(
                "dtype",
                "NumPy has no bf16 dtype to write a .npy header for",
            ));
        }
    };
    let dims: Vec<String> = shape.iter().map(|d| d.to_string()).collect();
    let shape = if dims.len() == 1 {
        format!("({},)", dims[0])
    } else {
        format!("({})", dims.join(", "))
    };
    let mut dict = format!("{{'descr': '{descr}', 'fortran_order': False, 'shape': {shape}, }}");
    let total = 10 + dict.len() + 1;
    dict.push_str(&" ".repeat(total.next_multiple_of(64) - total));
    dict.push('\n');
    let mut out = Vec::with_capacity(10 + dict.len());
    out.extend_from_slice(NPY_MAGIC);
    out.extend_from_slice(&[1, 0]);
    out.extend_from_slice(&(dict.len() as u16).to_le_bytes());
    out.extend_from_slice(dict.as_bytes());
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_what_numpy_writes() {
        let h = npy_header(DType::F32, &[10, 3, 4]).unwrap();
        assert_eq!(h.len() % 64, 0);
        let p = parse_header(&h).unwrap();
        assert_eq!(p.dtype, DType::F32);
        assert_eq!(p.shape, vec![10, 3, 4]);
        assert_eq!(p.data_offset, h.len());
        let one = parse_header(&npy_header(DType::U8, &[7]).unwrap()).unwrap();
        assert_eq!(one.shape, vec![7]);
    }

    #[test]
    fn parses_numpy_text_verbatim() {
        let text = "{'descr': '<i8', 'fortran_order': False, 'shape': (5,), }";
        let mut b = b"\x93NUMPY\x01\x00".to_vec();
        b.extend_from_slice(&(text.len() as u16).to_le_bytes());
        b.extend_from_slice(text.as_bytes());
        let p = parse_header(&b).unwrap();
        assert_eq!((p.dtype, p.shape), (DType::I64, vec![5]));
    }

    fn header_with(text: &str) -> Vec<u8> {
        let mut b = b"\x93NUMPY\x01\x00".to_vec();
        b.extend_from_slice(&(text.len() as u16).to_le_bytes());
        b.extend_from_slice(text.as_bytes());
        b
    }

    #[test]
    fn refuses_what_cannot_be_read_in_place() {
        let cases = [
            "{'descr': '|O', 'fortran_order': False, 'shape': (5,), }",
            "{'descr': '<U3', 'fortran_order': False, 'shape': (5,), }",
            "{'descr': '>f4', 'fortran_order': False, 'shape': (5,), }",
            "{'descr': [('a', '<f4')], 'fortran_order': False, 'shape': (5,), }",
            "{'descr': '<f4', 'fortran_order': True, 'shape': (5, 3), }",
            "{'descr': '<f4', 'fortran_order': False, 'shape': (), }",
        ];
        for c in cases {
            assert!(
                matches!(
                    parse_header(&header_with(c)),
                    Err(HeaderError::Unsupported(_))
                ),
                "{c}"
            );
        }
        // A Fortran-ordered vector is the same bytes as a C-ordered one.
        assert!(
            parse_header(&header_with(
                "{'descr': '<f4', 'fortran_order': True, 'shape': (5,), }"
            ))
            .is_ok()
        );
    }

    #[test]
    fn malformed_headers_are_errors() {
        for c in [
            "{'descr': '<f4', 'shape': (5,), }",
            "{'descr': '<f4', 'fortran_order': False, 'shape': (5,",
            "not a dict",
            "{'descr': '<f4', 'fortran_order': 1, 'shape': (5,), }",
            "{'descr': '<f4', 'fortran_order': False, 'shape': (99999999999999999999999,), }",
        ] {
            assert!(
                matches!(
                    parse_header(&header_with(c)),
                    Err(HeaderError::Malformed(_))
                ),
                "{c}"
            );
        }
        assert!(parse_header(b"").is_err());
        assert!(parse_header(b"\x93NUMPY\x01\x00\xff\x00{").is_err());
    }
}
