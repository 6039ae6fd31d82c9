//! Element types, codecs, fields and the schema of a record, with the byte layout of one record.
//!
//! A [`Schema`] is shared by every source: a packed file stores one, a `.npy` array has one with a
//! single tensor field, and the loader collates by it. It owns the rule that places fields inside
//! a record (see `docs/FORMAT.md`, "Record"), so that the writer and the reader cannot disagree.

use std::fmt;

use crate::error::{Error, Result};

use serde::{Deserialize, Serialize};

/// The element type of a fixed-size tensor field.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
#[non_exhaustive]
pub enum DType {
    /// Unsigned 8-bit integer.
    U8,
    /// Signed 8-bit integer.
    I8,
    /// Unsigned 16-bit integer.
    U16,
    /// Signed 16-bit integer.
    I16,
    /// Unsigned 32-bit integer.
    U32,
    /// Signed 32-bit integer.
    I32,
    /// Unsigned 64-bit integer.
    U64,
    /// Signed 64-bit integer.
    I64,
    /// IEEE 754 half precision.
    F16,
    /// bfloat16.
    BF16,
    /// IEEE 754 single precision.
    F32,
    /// IEEE 754 double precision.
    F64,
    /// One byte, 0 or 1.
    Bool,
}

impl DType {
    /// Every dtype, in the order of their codes.
    pub const ALL: [DType; 13] = [
        DType::U8,
        DType::I8,
        DType::U16,
        DType::I16,
        DType::U32,
        DType::I32,
        DType::U64,
        DType::I64,
        DType::F16,
        DType::BF16,
        DType::F32,
        DType::F64,
        DType::Bool,
    ];

    /// The size of one element in bytes (also its alignment).
    pub fn size(self) -> usize {
        match self {
            DType::U8 | DType::I8 | DType::Bool => 1,
            DType::U16 | DType::I16 | DType::F16 | DType::BF16 => 2,
            DType::U32 | DType::I32 | DType::F32 => 4,
            DType::U64 | DType::I64 | DType::F64 => 8,
        }
    }

    /// The code stored in a packed file.
    pub fn code(self) -> u8 {
        DType::ALL.iter().position(|&d| d == self).unwrap_or(0) as u8
    }

    /// The dtype of a stored code, if it is one.
    pub fn from_code(code: u8) -> Option<DType> {
        DType::ALL.get(code as usize).copied()
    }

    /// The lowercase name (`u8`, `f32`, `bf16`, ...).
    pub fn name(self) -> &'static str {
        match self {
            DType::U8 => "u8",
            DType::I8 => "i8",
            DType::U16 => "u16",
            DType::I16 => "i16",
            DType::U32 => "u32",
            DType::I32 => "i32",
            DType::U64 => "u64",
            DType::I64 => "i64",
            DType::F16 => "f16",
            DType::BF16 => "bf16",
            DType::F32 => "f32",
            DType::F64 => "f64",
            DType::Bool => "bool",
        }
    }

    /// The dtype of a lowercase name, as [`DType::name`] prints it.
    pub fn from_name(name: &str) -> Option<DType> {
        DType::ALL.iter().copied().find(|d| d.name() == name)
    }
}

impl fmt::Display for DType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// How the bytes of a variable-size field are encoded.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Codec {
    /// Opaque bytes.
    Raw,
    /// UTF-8 text.
    Utf8,
    /// A JPEG image.
    Jpeg,
    /// A PNG image.
    Png,
    /// JSON text (UTF-8).
    Json,
    /// A NumPy `.npy` array (header and values), of any dtype and shape.
    Npy,
    /// Little-endian values of one dtype, back to back: a variable-length array (a document's
    /// tokens, say). The loader batches the field as a ragged field of that dtype (values and
    /// offsets); its length in every record must be a whole number of values. Stored as code
    /// `0x80 + dtype code`.
    Elements(DType),
    /// A codec this version does not know (written by a newer minor version); read as bytes.
    Other(u8),
}

impl Codec {
    /// The code stored in a packed file.
    pub fn code(self) -> u8 {
        match self {
            Codec::Raw => 0,
            Codec::Utf8 => 1,
            Codec::Jpeg => 2,
            Codec::Png => 3,
            Codec::Json => 4,
            Codec::Npy => 5,
            Codec::Elements(dtype) => ELEMENTS_CODE | dtype.code(),
            Codec::Other(c) => c,
        }
    }

    /// The codec of a stored code.
    pub fn from_code(code: u8) -> Codec {
        match code {
            0 => Codec::Raw,
            1 => Codec::Utf8,
            2 => Codec::Jpeg,
            3 => Codec::Png,
            4 => Codec::Json,
            5 => Codec::Npy,
            c => match DType::from_code(c.wrapping_sub(ELEMENTS_CODE)) {
                Some(dtype) if c >= ELEMENTS_CODE => Codec::Elements(dtype),
                _ => Codec::Other(c),
            },
        }
    }

    /// The lowercase name (`raw`, `jpeg`, ...).
    pub fn name(self) -> String {
        match self {
            Codec::Raw => "raw".into(),
            Codec::Utf8 => "utf8".into(),
            Codec::Jpeg => "jpeg".into(),
            Codec::Png => "png".into(),
            Codec::Json => "json".into(),
            Codec::Npy => "npy".into(),
            Codec::Elements(dtype) => format!("{dtype} values"),
            Codec::Other(c) => format!("codec#{c}"),
        }
    }

    /// The element type of the field's values when it is batched: `u8` for every codec but
    /// [`Codec::Elements`], whose dtype it is.
    pub fn element_dtype(self) -> DType {
        match self {
            Codec::Elements(dtype) => dtype,
            _ => DType::U8,
        }
    }
}

/// The first code of [`Codec::Elements`]: `0x80 + dtype code`.
const ELEMENTS_CODE: u8 = 0x80;

/// What a field holds.
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "lowercase")]
pub enum FieldKind {
    /// A fixed-size tensor: the same dtype and shape in every record, stored inline and aligned
    /// to its element size.
    Tensor {
        /// Element type.
        dtype: DType,
        /// Shape of one sample (empty for a scalar).
        shape: Vec<u64>,
    },
    /// Variable-size bytes with a codec tag.
    Bytes {
        /// How the bytes are encoded.
        codec: Codec,
    },
}

/// One named field of a record.
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct Field {
    /// The field's name, unique within its schema.
    pub name: String,
    /// What it holds.
    #[serde(flatten)]
    pub kind: FieldKind,
}

impl Field {
    /// A fixed-size tensor field.
    pub fn tensor(name: impl Into<String>, dtype: DType, shape: &[u64]) -> Field {
        Field {
            name: name.into(),
            kind: FieldKind::Tensor {
                dtype,
                shape: shape.to_vec(),
            },
        }
    }

    /// A variable-size bytes field.
    pub fn bytes(name: impl Into<String>, codec: Codec) -> Field {
        Field {
            name: name.into(),
            kind: FieldKind::Bytes { codec },
        }
    }

    /// The byte size of a tensor field (`None` for a bytes field or one too large to address).
    pub fn fixed_bytes(&self) -> Option<usize> {
        match &self.kind {
            FieldKind::Tensor { dtype, shape } => shape
                .iter()
                .try_fold(dtype.size() as u64, |acc, &d| acc.checked_mul(d))
                .and_then(|n| usize::try_from(n).ok()),
            FieldKind::Bytes { .. } => None,
        }
    }
}

/// Where one field lives inside a record.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Slot {
    /// A tensor at `offset..offset + len` from the record's start.
    Fixed { offset: usize, len: usize },
    /// The `k`-th variable-size field.
    Var { k: usize },
}

/// The named fields of a record and where each one lives in the record's bytes.
///
/// Layout of one record (see `docs/FORMAT.md`): tensor fields in schema order, each aligned to
/// its element size; then, if there are bytes fields, a table of their lengths (`u32` each,
/// aligned to 4); then their bytes, back to back, in schema order.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Schema {
    fields: Vec<Field>,
    slots: Vec<Slot>,
    fixed_end: usize,
    var_table: usize,
    var_count: usize,
}

impl Schema {
    /// A schema of these fields; names must be unique and non-empty, tensor sizes addressable.
    ///
    /// Fails with [`Error::InvalidSchema`] (of [`ErrorKind::Config`](crate::ErrorKind::Config))
    /// when they are not.
    pub fn new(fields: Vec<Field>) -> Result<Schema> {
        Schema::validated(fields).map_err(|what| Error::InvalidSchema { what })
    }

    /// [`Schema::new`], failing with what is wrong (for readers that name the file concerned).
    pub(crate) fn validated(fields: Vec<Field>) -> std::result::Result<Schema, String> {
        if fields.is_empty() {
            return Err("a schema needs at least one field".into());
        }
        let mut slots = Vec::with_capacity(fields.len());
        let mut cursor = 0usize;
        let mut var_count = 0;
        for (i, f) in fields.iter().enumerate() {
            if f.name.is_empty() || f.name.len() > u16::MAX as usize {
                return Err(format!("field {i} has an empty or over-long name"));
            }
            if fields[..i].iter().any(|g| g.name == f.name) {
                return Err(format!("field name `{}` appears twice", f.name));
            }
            match &f.kind {
                FieldKind::Tensor { dtype, shape } => {
                    if shape.len() > 16 {
                        return Err(format!(
                            "field `{}` has {} dimensions (at most 16)",
                            f.name,
                            shape.len()
                        ));
                    }
                    let len = f
                        .fixed_bytes()
                        .filter(|&n| n <= u32::MAX as usize)
                        .ok_or_else(|| {
                            format!("field `{}` is larger than 4 GiB per record", f.name)
                        })?;
                    let offset = align_up(cursor, dtype.size());
                    cursor = offset + len;
                    slots.push(Slot::Fixed { offset, len });
                }
                FieldKind::Bytes { .. } => {
                    slots.push(Slot::Var { k: var_count });
                    var_count += 1;
                }
            }
        }
        let var_table = align_up(cursor, 4);
        Ok(Schema {
            fields,
            slots,
            fixed_end: cursor,
            var_table,
            var_count,
        })
    }

    /// The fields, in order.
    pub fn fields(&self) -> &[Field] {
        &self.fields
    }

    /// The position of the field called `name`.
    pub fn index_of(&self, name: &str) -> Option<usize> {
        self.fields.iter().position(|f| f.name == name)
    }

    /// True when every field is a fixed-size tensor, so every record has the same size.
    pub fn is_fixed(&self) -> bool {
        self.var_count == 0
    }

    /// The number of variable-size fields.
    pub fn var_count(&self) -> usize {
        self.var_count
    }

    /// The smallest record this schema allows: tensors plus the table of variable-size lengths.
    pub fn min_record_bytes(&self) -> usize {
        if self.var_count == 0 {
            self.fixed_end
        } else {
            self.var_table + 4 * self.var_count
        }
    }

    /// The size of a record whose variable-size fields have these lengths.
    pub fn record_bytes(&self, var_lens: impl IntoIterator<Item = usize>) -> usize {
        self.min_record_bytes() + var_lens.into_iter().sum::<usize>()
    }

    /// Byte offset of the variable-size length table within a record.
    pub fn var_table_offset(&self) -> usize {
        self.var_table
    }

    /// The range of field `k`'s tensor bytes in a record, or `None` for a bytes field.
    pub fn fixed_range(&self, k: usize) -> Option<std::ops::Range<usize>> {
        match self.slots.get(k)? {
            Slot::Fixed { offset, len } => Some(*offset..*offset + *len),
            Slot::Var { .. } => None,
        }
    }

    /// Checks that `record` is long enough for this schema and for the lengths in its
    /// variable-size table; returns where the variable bytes end.
    ///
    /// Fails with [`Error::Mismatch`] when it is not.
    pub fn check_record(&self, record: &[u8]) -> Result<usize> {
        self.record_end(record).map_err(Error::mismatch)
    }

    /// [`Schema::check_record`], failing with what is wrong (for readers that name the file and
    /// record concerned).
    pub(crate) fn record_end(&self, record: &[u8]) -> std::result::Result<usize, String> {
        let min = self.min_record_bytes();
        if record.len() < min {
            return Err(format!(
                "{} bytes is shorter than the schema's {min}-byte minimum",
                record.len()
            ));
        }
        let mut end = min as u64;
        for k in 0..self.var_count {
            end += u64::from(self.var_len(record, k));
        }
        if end > record.len() as u64 {
            return Err(format!(
                "variable-size fields claim {end} bytes but the record has {}",
                record.len()
            ));
        }
        Ok(end as usize)
    }

    fn var_len(&self, record: &[u8], k: usize) -> u32 {
        let at = self.var_table + 4 * k;
        let mut b = [0u8; 4];
        b.copy_from_slice(&record[at..at + 4]);
        u32::from_le_bytes(b)
    }

    /// The bytes of field `k` in `record`, which [`Schema::check_record`] accepted.
    ///
    /// Returns `None` when `k` is not a field of this schema.
    pub(crate) fn field_in<'a>(&self, record: &'a [u8], k: usize) -> Option<&'a [u8]> {
        match *self.slots.get(k)? {
            Slot::Fixed { offset, len } => record.get(offset..offset + len),
            Slot::Var { k } => {
                let mut start = self.min_record_bytes();
                for j in 0..k {
                    start += self.var_len(record, j) as usize;
                }
                let len = self.var_len(record, k) as usize;
                record.get(start..start + len)
            }
        }
    }

    /// Lays out one record from one value per field (in schema order) into `out` (cleared
    /// first), without padding: tensors at their offsets, the length table, the bytes.
    ///
    /// Fails with [`Error::Mismatch`] when the values do not fit the fields.
    pub fn build_record(&self, values: &[&[u8]], out: &mut Vec<u8>) -> Result<()> {
        self.lay_out(values, out).map_err(Error::mismatch)
    }

    fn lay_out(&self, values: &[&[u8]], out: &mut Vec<u8>) -> std::result::Result<(), String> {
        if values.len() != self.fields.len() {
            return Err(format!(
                "{} values for {} fields",
                values.len(),
                self.fields.len()
            ));
        }
        out.clear();
        out.resize(self.min_record_bytes(), 0);
        let mut k = 0;
        for (i, (field, value)) in self.fields.iter().zip(values).enumerate() {
            match self.slots[i] {
                Slot::Fixed { offset, len } => {
                    if value.len() != len {
                        return Err(format!(
                            "field `{}` has {} bytes, its schema says {len}",
                            field.name,
                            value.len()
                        ));
                    }
                    out[offset..offset + len].copy_from_slice(value);
                }
                Slot::Var { .. } => {
                    let len = u32::try_from(value.len()).map_err(|_| {
                        format!(
                            "field `{}` has {} bytes (at most 4 GiB)",
                            field.name,
                            value.len()
                        )
                    })?;
                    let at = self.var_table + 4 * k;
                    out[at..at + 4].copy_from_slice(&len.to_le_bytes());
                    k += 1;
                }
            }
        }
        for (i, value) in values.iter().enumerate() {
            if let Slot::Var { .. } = self.slots[i] {
                out.extend_from_slice(value);
            }
        }
        Ok(())
    }

    /// Encodes the schema as stored in a packed file (`docs/FORMAT.md`, "Schema block").
    pub(crate) fn encode(&self) -> Vec<u8> {
        let mut out = Vec::new();
        out.extend_from_slice(&(self.fields.len() as u32).to_le_bytes());
        for f in &self.fields {
            out.extend_from_slice(&(f.name.len() as u16).to_le_bytes());
            out.extend_from_slice(f.name.as_bytes());
            match &f.kind {
                FieldKind::Tensor { dtype, shape } => {
                    out.push(0);
                    out.push(dtype.code());
                    out.push(shape.len() as u8);
                    for d in shape {
                        out.extend_from_slice(&d.to_le_bytes());
                    }
                }
                FieldKind::Bytes { codec } => {
                    out.push(1);
                    out.push(codec.code());
                }
            }
        }
        out
    }

    /// Decodes a stored schema block; the error says what is wrong and at which byte.
    pub(crate) fn decode(bytes: &[u8]) -> std::result::Result<Schema, String> {
        let mut r = ByteReader { bytes, at: 0 };
        let count = r.u32()? as usize;
        if count == 0 || count > 65_536 {
            return Err(format!("schema declares {count} fields"));
        }
        let mut fields = Vec::with_capacity(count.min(1024));
        for i in 0..count {
            let name_len = r.u16()? as usize;
            let name = std::str::from_utf8(r.take(name_len)?)
                .map_err(|_| format!("field {i}: name is not UTF-8"))?
                .to_owned();
            let kind = match r.u8()? {
                0 => {
                    let code = r.u8()?;
                    let dtype = DType::from_code(code)
                        .ok_or_else(|| format!("field `{name}`: unknown dtype code {code}"))?;
                    let ndim = r.u8()? as usize;
                    let mut shape = Vec::with_capacity(ndim);
                    for _ in 0..ndim {
                        shape.push(r.u64()?);
                    }
                    FieldKind::Tensor { dtype, shape }
                }
                1 => FieldKind::Bytes {
                    codec: Codec::from_code(r.u8()?),
                },
                k => return Err(format!("field `{name}`: unknown field kind {k}")),
            };
            fields.push(Field { name, kind });
        }
        if r.at != bytes.len() {
            return Err(format!(
                "{} trailing bytes after the last field",
                bytes.len() - r.at
            ));
        }
        Schema::validated(fields)
    }
}

impl fmt::Display for Schema {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (i, field) in self.fields.iter().enumerate() {
            if i > 0 {
                f.write_str(", ")?;
            }
            match &field.kind {
                FieldKind::Tensor { dtype, shape } => {
                    write!(f, "{}: {dtype}{shape:?}", field.name)?
                }
                FieldKind::Bytes { codec } => write!(f, "{}: bytes({})", field.name, codec.name())?,
            }
        }
        Ok(())
    }
}

/// Rounds `n` up to a multiple of `align` (a power of two).
pub(crate) fn align_up(n: usize, align: usize) -> usize {
    n.div_ceil(align) * align
}

/// A cursor over untrusted bytes whose reads fail instead of running past the end.
struct ByteReader<'a> {
    bytes: &'a [u8],
    at: usize,
}

impl<'a> ByteReader<'a> {
    fn take(&mut self, n: usize) -> std::result::Result<&'a [u8], String> {
        let end = self
            .at
            .checked_add(n)
            .filter(|&e| e <= self.bytes.len())
            .ok_or_else(|| {
                format!(
                    "schema ends at byte {} while reading {n} more bytes",
                    self.bytes.len()
                )
            })?;
        let out = &self.bytes[self.at..end];
        self.at = end;
        Ok(out)
    }

    fn u8(&mut self) -> std::result::Result<u8, String> {
        Ok(self.take(1)?[0])
    }

    fn u16(&mut self) -> std::result::Result<u16, String> {
        let mut b = [0; 2];
        b.copy_from_slice(self.take(2)?);
        Ok(u16::from_le_bytes(b))
    }

    fn u32(&mut self) -> std::result::Result<u32, String> {
        let mut b = [0; 4];
        b.copy_from_slice(self.take(4)?);
        Ok(u32::from_le_bytes(b))
    }

    fn u64(&mut self) -> std::result::Result<u64, String> {
        let mut b = [0; 8];
        b.copy_from_slice(self.take(8)?);
        Ok(u64::from_le_bytes(b))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn mixed() -> Schema {
        Schema::new(vec![
            Field::tensor("label", DType::U8, &[]),
            Field::bytes("jpeg", Codec::Jpeg),
            Field::tensor("box", DType::F32, &[4]),
            Field::bytes("caption", Codec::Utf8),
        ])
        .unwrap()
    }

    #[test]
    fn tensors_are_aligned_to_their_element_size() {
        let s = mixed();
        assert_eq!(s.fixed_range(0), Some(0..1));
        assert_eq!(s.fixed_range(2), Some(4..20));
        assert_eq!(s.fixed_range(1), None);
        assert_eq!(s.var_table_offset(), 20);
        assert_eq!(s.min_record_bytes(), 28);
    }

    #[test]
    fn encode_decode_round_trip() {
        let s = mixed();
        assert_eq!(Schema::decode(&s.encode()).unwrap(), s);
    }

    #[test]
    fn decode_rejects_truncation_at_every_length() {
        let enc = mixed().encode();
        for n in 0..enc.len() {
            assert!(Schema::decode(&enc[..n]).is_err(), "accepted {n} bytes");
        }
    }

    #[test]
    fn duplicate_and_empty_names_are_rejected() {
        assert!(
            Schema::new(vec![
                Field::tensor("a", DType::U8, &[]),
                Field::bytes("a", Codec::Raw)
            ])
            .is_err()
        );
        assert!(Schema::new(vec![Field::tensor("", DType::U8, &[])]).is_err());
        assert!(Schema::new(vec![]).is_err());
    }

    #[test]
    fn schema_errors_are_typed_config_errors() {
        let e = Schema::new(vec![
            Field::tensor("a", DType::U8, &[]),
            Field::bytes("a", Codec::Raw),
        ])
        .unwrap_err();
        assert!(matches!(e, Error::InvalidSchema { .. }), "{e:?}");
        assert_eq!(e.kind(), crate::ErrorKind::Config);
        assert_eq!(e.to_string(), "field name `a` appears twice");
        let s = mixed();
        let e = s.build_record(&[&[9]], &mut Vec::new()).unwrap_err();
        assert!(matches!(e, Error::Mismatch { .. }), "{e:?}");
        let e = s.check_record(&[0; 3]).unwrap_err();
        assert_eq!(e.kind(), crate::ErrorKind::Mismatch);
    }

    #[test]
    fn var_fields_are_found_after_the_length_table() {
        let s = mixed();
        let mut rec = vec![0u8; 28];
        rec[20..24].copy_from_slice(&3u32.to_le_bytes());
        rec[24..28].copy_from_slice(&2u32.to_le_bytes());
        rec.extend_from_slice(b"abcde");
        assert_eq!(s.check_record(&rec).unwrap(), 33);
        assert_eq!(s.field_in(&rec, 1), Some(&b"abc"[..]));
        assert_eq!(s.field_in(&rec, 3), Some(&b"de"[..]));
        rec.truncate(32);
        assert!(s.check_record(&rec).is_err());
    }

    #[test]
    fn built_records_read_back() {
        let s = mixed();
        let mut rec = Vec::new();
        s.build_record(&[&[9], b"jpegbytes", &[1u8; 16], b"hi"], &mut rec)
            .unwrap();
        assert_eq!(s.check_record(&rec).unwrap(), rec.len());
        assert_eq!(s.field_in(&rec, 0), Some(&[9u8][..]));
        assert_eq!(s.field_in(&rec, 1), Some(&b"jpegbytes"[..]));
        assert_eq!(s.field_in(&rec, 3), Some(&b"hi"[..]));
        assert!(
            s.build_record(&[&[9, 9], b"", &[1u8; 16], b""], &mut rec)
                .is_err()
        );
    }

    #[test]
    fn codec_codes_round_trip_and_leave_unknown_codes_alone() {
        let named = [
            Codec::Raw,
            Codec::Utf8,
            Codec::Jpeg,
            Codec::Png,
            Codec::Json,
            Codec::Npy,
        ];
        for codec in named.into_iter().chain(DType::ALL.map(Codec::Elements)) {
            assert_eq!(Codec::from_code(codec.code()), codec, "{}", codec.name());
        }
        assert_eq!(Codec::Elements(DType::U16).code(), 0x82);
        assert_eq!(Codec::Elements(DType::U16).element_dtype(), DType::U16);
        assert_eq!(Codec::Utf8.element_dtype(), DType::U8);
        // Codes no version gave a meaning stay `Other`, before and after the dtypes' range.
        for c in [6u8, 0x7f, 0x80 + DType::ALL.len() as u8, 0xff] {
            assert_eq!(Codec::from_code(c), Codec::Other(c));
        }
        let s = Schema::new(vec![Field::bytes("tokens", Codec::Elements(DType::U32))]).unwrap();
        assert_eq!(Schema::decode(&s.encode()).unwrap(), s);
        assert_eq!(s.to_string(), "tokens: bytes(u32 values)");
    }

    #[test]
    fn dtype_codes_and_names_round_trip() {
        for d in DType::ALL {
            assert_eq!(DType::from_code(d.code()), Some(d));
            assert_eq!(DType::from_name(d.name()), Some(d));
        }
    }
}
