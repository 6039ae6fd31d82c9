//! How a WebDataset member or an MDS column becomes a field, by its writer's conventions:
//! [`FieldDecode`], what a user may declare for a field by name
//! ([`ShardOptions::decode`](super::ShardOptions::decode)), and the decoders the tar and MDS
//! readers apply to each sample's bytes.
//!
//! | written as | field | decoded by |
//! |---|---|---|
//! | decimal text (webdataset's `.cls`, `.cls2`, `.index`, `.inx`, `.id`: `str(int)`; MDS `str_int`) | `i64` scalar tensor | Python's `int(bytes)`: ASCII whitespace around, a sign, digits with single `_` between them |
//! | decimal text (MDS `str_float`) | `f64` scalar tensor | Python's `float(bytes)` |
//! | a `.npy` member of one dtype and shape in every sample | tensor of that dtype and shape (the values, in place) | its header (`numpy.lib.format`), checked against the field's |
//! | a `.npy` member of varying shape | bytes (npy): the whole member | [`npy_array`] |
//! | an MDS `ndarray` value, declared a tensor | tensor (the values, in place) | its header, checked against the field's |
//! | text (`.txt`, `.text`, `.transcript`; MDS `str`) | bytes (utf8) | checked to be UTF-8 |
//! | JSON (`.json`, `.jsn`; MDS `json`) | bytes (json) | checked to be UTF-8 (not parsed) |
//! | anything else | bytes as written, with its codec | nothing |
//!
//! A value that does not decode (text that is not an integer, a `.npy` header of another
//! shape than the field's) is an error naming the shard, the sample and the field.

use std::ops::Range;

use crate::format::{Codec, DType, Field};
use crate::source::npy::parse_array_header;

/// How the bytes of a member (WebDataset) or a column (MDS) become a field's value: the
/// readers infer it from the writer's conventions (see the [module](self)), and a user may
/// declare it for a field by name ([`ShardOptions::decode`](super::ShardOptions::decode)).
///
/// Written and parsed (`FromStr`) as `int`, `float`, a codec name (`raw`, `utf8`, `json`,
/// `npy`, `jpeg`, `png`: bytes with that codec), values of one dtype of any count,
/// `list[DTYPE]` (`list[i64]`: bytes of [`Codec::Elements`], a ragged field), or a tensor,
/// `DTYPE[D0,D1,...]` (`f32[3,4]`, `i64[]` for a scalar).
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum FieldDecode {
    /// The bytes as written: a variable-size field with this codec (`utf8` and `json` are
    /// checked to be UTF-8).
    Bytes(Codec),
    /// An integer written as decimal text (`str(int)`): an `i64` scalar.
    Int,
    /// A number written as decimal text (`str(float)`): an `f64` scalar.
    Float,
    /// An array of this dtype and shape in every sample: a tensor field of its values. A
    /// `.npy` member or an MDS `ndarray` value has its header checked against them; other
    /// bytes must be exactly the tensor's size (little-endian values, C order).
    Tensor {
        /// The element type.
        dtype: DType,
        /// The shape (`[]` for a scalar).
        shape: Vec<u64>,
    },
}

impl FieldDecode {
    /// The field named `name` that values decoded this way fill.
    pub fn field(&self, name: &str) -> Field {
        match self {
            FieldDecode::Bytes(codec) => Field::bytes(name, *codec),
            FieldDecode::Int => Field::tensor(name, DType::I64, &[]),
            FieldDecode::Float => Field::tensor(name, DType::F64, &[]),
            FieldDecode::Tensor { dtype, shape } => Field::tensor(name, *dtype, shape),
        }
    }
}

impl std::fmt::Display for FieldDecode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            FieldDecode::Bytes(Codec::Elements(dtype)) => write!(f, "list[{dtype}]"),
            FieldDecode::Bytes(codec) => f.write_str(&codec.name()),
            FieldDecode::Int => f.write_str("int"),
            FieldDecode::Float => f.write_str("float"),
            FieldDecode::Tensor { dtype, shape } => {
                let dims: Vec<String> = shape.iter().map(u64::to_string).collect();
                write!(f, "{dtype}[{}]", dims.join(","))
            }
        }
    }
}

impl std::str::FromStr for FieldDecode {
    type Err = String;

    /// `int`, `float`, `raw`, `utf8`, `json`, `npy`, `jpeg`, `png`, `list[DTYPE]`, or
    /// `DTYPE[D0,...]`.
    fn from_str(s: &str) -> Result<FieldDecode, String> {
        let s = s.trim();
        Ok(match s {
            "int" => FieldDecode::Int,
            "float" => FieldDecode::Float,
            "raw" | "bytes" => FieldDecode::Bytes(Codec::Raw),
            "utf8" | "str" | "text" => FieldDecode::Bytes(Codec::Utf8),
            "json" => FieldDecode::Bytes(Codec::Json),
            "npy" => FieldDecode::Bytes(Codec::Npy),
            "jpeg" | "jpg" => FieldDecode::Bytes(Codec::Jpeg),
            "png" => FieldDecode::Bytes(Codec::Png),
            _ => {
                let bad = || {
                    format!(
                        "`{s}` is not a field decoding: int, float, raw, utf8, json, npy, jpeg, png, values such as list[i64], or a tensor such as f32[3,4] or i64[]"
                    )
                };
                if let Some(dtype) = s.strip_prefix("list[").and_then(|t| t.strip_suffix(']')) {
                    let dtype = DType::from_name(dtype.trim()).ok_or_else(bad)?;
                    return Ok(FieldDecode::Bytes(Codec::Elements(dtype)));
                }
                let (dtype, dims) = s
                    .strip_suffix(']')
                    .and_then(|t| t.split_once('['))
                    .ok_or_else(bad)?;
                let dtype = DType::from_name(dtype.trim()).ok_or_else(bad)?;
                let shape = if dims.trim().is_empty() {
                    Vec::new()
                } else {
                    dims.split(',')
                        .map(|d| d.trim().parse::<u64>().ok().filter(|&d| d >= 1))
                        .collect::<Option<Vec<u64>>>()
                        .ok_or_else(bad)?
                };
                FieldDecode::Tensor { dtype, shape }
            }
        })
    }
}

/// A decoded value: bytes of the member or column in place, or eight bytes decoded from it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum Value {
    /// This range of the value's bytes.
    Within(Range<usize>),
    /// These bytes (a little-endian `i64` or `f64`).
    Decoded([u8; 8]),
}

/// What a reader applies to each sample's bytes of one field.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum Decoder {
    /// The bytes as they are.
    Verbatim,
    /// The bytes, checked to be UTF-8.
    Utf8,
    /// Decimal text to an `i64`.
    Int,
    /// Decimal text to an `f64`.
    Float,
    /// A `.npy` member of this dtype and shape: its values.
    NpyTensor { dtype: DType, shape: Vec<u64> },
    /// An MDS `ndarray` value (of this encoding) of this dtype and shape: its values.
    NdArrayTensor {
        encoding: String,
        dtype: DType,
        shape: Vec<u64>,
    },
    /// Raw bytes of exactly this size.
    Sized(usize),
}

impl Decoder {
    /// The decoder of a field declared or inferred as `decode`, for values that are `.npy`
    /// files (`npy`), or MDS `ndarray` values of `encoding`, or neither.
    pub(crate) fn new(decode: &FieldDecode, npy: bool, ndarray: Option<&str>) -> Decoder {
        match decode {
            FieldDecode::Bytes(Codec::Utf8 | Codec::Json) => Decoder::Utf8,
            FieldDecode::Bytes(_) => Decoder::Verbatim,
            FieldDecode::Int => Decoder::Int,
            FieldDecode::Float => Decoder::Float,
            FieldDecode::Tensor { dtype, shape } => match ndarray {
                Some(encoding) => Decoder::NdArrayTensor {
                    encoding: encoding.to_owned(),
                    dtype: *dtype,
                    shape: shape.clone(),
                },
                None if npy => Decoder::NpyTensor {
                    dtype: *dtype,
                    shape: shape.clone(),
                },
                None => Decoder::Sized(decode.field("x").fixed_bytes().unwrap_or(usize::MAX)),
            },
        }
    }

    /// True when a value is handed out as it is, unchecked.
    pub(crate) fn is_verbatim(&self) -> bool {
        matches!(self, Decoder::Verbatim)
    }

    /// Decodes one value, or says what is wrong with it.
    pub(crate) fn decode(&self, bytes: &[u8]) -> Result<Value, String> {
        let all = Value::Within(0..bytes.len());
        match self {
            Decoder::Verbatim => Ok(all),
            Decoder::Utf8 => std::str::from_utf8(bytes)
                .map(|_| all)
                .map_err(|e| format!("not UTF-8 text (at byte {})", e.valid_up_to())),
            Decoder::Int => text_int(bytes).map(|v| Value::Decoded(v.to_le_bytes())),
            Decoder::Float => text_float(bytes).map(|v| Value::Decoded(v.to_le_bytes())),
            Decoder::NpyTensor { dtype, shape } => {
                let (d, s, values) = npy_array(bytes)?;
                same_array((*dtype, shape), (d, &s), "the .npy member")?;
                Ok(Value::Within(values))
            }
            Decoder::NdArrayTensor {
                encoding,
                dtype,
                shape,
            } => {
                let v = decode_ndarray(encoding, bytes).map_err(|e| e.to_string())?;
                same_array((*dtype, shape), (v.dtype, &v.shape), "the ndarray value")?;
                let start = bytes.len() - v.values.len();
                Ok(Value::Within(start..bytes.len()))
            }
            Decoder::Sized(size) => {
                if bytes.len() == *size {
                    Ok(all)
                } else {
                    Err(format!(
                        "{} bytes, the field's tensor is {size}",
                        bytes.len()
                    ))
                }
            }
        }
    }
}

fn same_array(want: (DType, &[u64]), got: (DType, &[u64]), what: &str) -> Result<(), String> {
    if want != got {
        return Err(format!(
            "{what} is {}{:?}, the field is {}{:?} (declare the field as npy bytes, or with its shape, if shapes vary)",
            got.0, got.1, want.0, want.1
        ));
    }
    Ok(())
}

/// A `.npy` file held whole in `bytes` (a member): its dtype, its shape and where its values
/// are. The values must fill the rest of the bytes exactly; the array must be C-ordered,
/// little-endian (or single-byte) and of a plain numeric dtype, as for
/// [`NpyArray`](crate::NpyArray), and may have no dimension (a scalar).
pub fn npy_array(bytes: &[u8]) -> Result<(DType, Vec<u64>, Range<usize>), String> {
    let header =
        parse_array_header(bytes).map_err(|e| format!("not a readable .npy: {}", e.what()))?;
    let values = header
        .shape
        .iter()
        .try_fold(header.dtype.size() as u64, |a, &d| a.checked_mul(d))
        .and_then(|n| n.checked_add(header.data_offset as u64));
    if values != Some(bytes.len() as u64) {
        return Err(format!(
            ".npy of {}{:?}: its header ends at byte {} and its values would end at {}, the member has {} bytes",
            header.dtype,
            header.shape,
            header.data_offset,
            values.map_or("past 2^64".to_string(), |v| v.to_string()),
            bytes.len()
        ));
    }
    Ok((header.dtype, header.shape, header.data_offset..bytes.len()))
}

/// ASCII whitespace as Python's `bytes.strip()` removes it.
fn strip(bytes: &[u8]) -> &[u8] {
    let ws = |c: &u8| matches!(c, b' ' | b'\t' | b'\n' | b'\r' | 0x0b | 0x0c);
    let start = bytes.iter().position(|c| !ws(c)).unwrap_or(bytes.len());
    let end = bytes.iter().rposition(|c| !ws(c)).map_or(start, |e| e + 1);
    &bytes[start..end]
}

/// Digits with single underscores between them (Python's numeric literals), underscores
/// removed; `None` if the text is not that.
fn digits(text: &[u8]) -> Option<Vec<u8>> {
    if text.is_empty() || text[0] == b'_' || text[text.len() - 1] == b'_' {
        return None;
    }
    let mut out = Vec::with_capacity(text.len());
    let mut last_underscore = false;
    for &c in text {
        match c {
            b'0'..=b'9' => {
                out.push(c);
                last_underscore = false;
            }
            b'_' if !last_underscore => last_underscore = true,
            _ => return None,
        }
    }
    Some(out)
}

/// An integer written as Python's `int(bytes)` reads it (base 10): ASCII whitespace around it,
/// an optional sign, digits with single underscores between them.
pub(crate) fn text_int(bytes: &[u8]) -> Result<i64, String> {
    let bad = || {
        format!(
            "`{}` is not an integer written as text",
            super::quoted(bytes)
        )
    };
    let t = strip(bytes);
    let (negative, t) = match t.first() {
        Some(b'-') => (true, &t[1..]),
        Some(b'+') => (false, &t[1..]),
        _ => (false, t),
    };
    let d = digits(t).ok_or_else(bad)?;
    let mut v: i128 = 0;
    for c in d {
        v = v * 10 + i128::from(c - b'0');
        if v > i128::from(i64::MAX) + 1 {
            return Err(format!("`{}` does not fit in an i64", super::quoted(bytes)));
        }
    }
    let v = if negative { -v } else { v };
    i64::try_from(v).map_err(|_| format!("`{}` does not fit in an i64", super::quoted(bytes)))
}

/// A number written as Python's `float(bytes)` reads it: ASCII whitespace around it, a sign,
/// digits (with single underscores between them), a fraction, an exponent, `inf`,
/// `infinity` or `nan` in any case.
pub(crate) fn text_float(bytes: &[u8]) -> Result<f64, String> {
    let bad = || format!("`{}` is not a number written as text", super::quoted(bytes));
    let t = std::str::from_utf8(strip(bytes)).map_err(|_| bad())?;
    let body = t.trim_start_matches(['+', '-']);
    if body.len() + 1 < t.len() {
        return Err(bad());
    }
    let lower = body.to_ascii_lowercase();
    if matches!(lower.as_str(), "inf" | "infinity" | "nan") {
        return t.to_ascii_lowercase().parse::<f64>().map_err(|_| bad());
    }
    // Underscores only between digits, as Python's literals allow.
    let b = t.as_bytes();
    for (i, &c) in b.iter().enumerate() {
        if c == b'_'
            && !(i > 0 && b[i - 1].is_ascii_digit() && b.get(i + 1).is_some_and(u8::is_ascii_digit))
        {
            return Err(bad());
        }
        if !(c.is_ascii_digit() || matches!(c, b'_' | b'.' | b'e' | b'E' | b'+' | b'-')) {
            return Err(bad());
        }
    }
    t.replace('_', "").parse::<f64>().map_err(|_| bad())
}

/// The dtype of a NumPy dtype name as MDS encodings spell it (`uint8`, `float32`, ...).
pub(super) fn numpy_dtype(name: &str) -> Option<DType> {
    Some(match name {
        "uint8" => DType::U8,
        "int8" => DType::I8,
        "uint16" => DType::U16,
        "int16" => DType::I16,
        "float16" => DType::F16,
        "uint32" => DType::U32,
        "int32" => DType::I32,
        "float32" => DType::F32,
        "uint64" => DType::U64,
        "int64" => DType::I64,
        "float64" => DType::F64,
        _ => return None,
    })
}

/// A variable-size MDS `ndarray` value, decoded in place: its dtype, its shape and its values'
/// bytes (C order, little-endian).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NdArrayView<'a> {
    /// The element type.
    pub dtype: DType,
    /// The shape.
    pub shape: Vec<u64>,
    /// The values.
    pub values: &'a [u8],
}

/// Decodes a value of a column encoded `ndarray` or `ndarray:DTYPE` (streaming's `NDArray`:
/// `[dtype code: 1 byte, if not in the encoding] [ndim << 2 | shape dtype: 1 byte]
/// [shape: ndim uints] [values]`).
///
/// Bytes that do not hold such a value fail with
/// [`Error::Mismatch`](crate::error::Error::Mismatch).
pub fn decode_ndarray<'a>(
    encoding: &str,
    bytes: &'a [u8],
) -> crate::error::Result<NdArrayView<'a>> {
    ndarray_view(encoding, bytes).map_err(crate::error::Error::mismatch)
}

fn ndarray_view<'a>(
    encoding: &str,
    bytes: &'a [u8],
) -> std::result::Result<NdArrayView<'a>, String> {
    let fixed = match encoding.strip_prefix("ndarray") {
        Some("") => None,
        Some(rest) => match rest.strip_prefix(':') {
            Some(d) if !d.contains(':') => {
                Some(numpy_dtype(d).ok_or_else(|| format!("unknown dtype `{d}`"))?)
            }
            _ => {
                return Err(format!(
                    "`{encoding}` is not a variable-size ndarray encoding"
                ));
            }
        },
        None => return Err(format!("`{encoding}` is not an ndarray encoding")),
    };
    let mut at = 0usize;
    let byte = |at: usize| bytes.get(at).copied().ok_or("truncated ndarray header");
    let dtype = match fixed {
        Some(d) => d,
        None => {
            let code = byte(at)?;
            at += 1;
            match code {
                8 => DType::U8,
                9 => DType::I8,
                16 => DType::U16,
                17 => DType::I16,
                18 => DType::F16,
                32 => DType::U32,
                33 => DType::I32,
                34 => DType::F32,
                64 => DType::U64,
                65 => DType::I64,
                66 => DType::F64,
                c => return Err(format!("unknown ndarray dtype code {c}")),
            }
        }
    };
    let b = byte(at)?;
    at += 1;
    let ndim = (b >> 2) as usize;
    let width = 1usize << (b & 3);
    let mut shape = Vec::with_capacity(ndim);
    for _ in 0..ndim {
        let d = bytes.get(at..at + width).ok_or("truncated ndarray shape")?;
        let mut v = [0u8; 8];
        v[..width].copy_from_slice(d);
        shape.push(u64::from_le_bytes(v));
        at += width;
    }
    let values = &bytes[at..];
    let want = shape
        .iter()
        .try_fold(dtype.size() as u64, |a, &d| a.checked_mul(d));
    if want != Some(values.len() as u64) {
        return Err(format!(
            "shape {shape:?} of {dtype} needs {want:?} bytes, the value has {}",
            values.len()
        ));
    }
    Ok(NdArrayView {
        dtype,
        shape,
        values,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn integers_read_as_python_int_reads_them() {
        for (text, want) in [
            ("7", 7),
            (" -12\n", -12),
            ("+3", 3),
            ("007", 7),
            ("1_000", 1000),
            ("9223372036854775807", i64::MAX),
            ("-9223372036854775808", i64::MIN),
        ] {
            assert_eq!(text_int(text.as_bytes()), Ok(want), "{text:?}");
        }
        for text in [
            "",
            " ",
            "1.5",
            "0x10",
            "_1",
            "1_",
            "1__0",
            "--1",
            "9223372036854775808",
            "1 2",
            "٣",
        ] {
            assert!(text_int(text.as_bytes()).is_err(), "{text:?} was read");
        }
    }

    #[test]
    fn floats_read_as_python_float_reads_them() {
        for (text, want) in [
            ("1.5", 1.5),
            (" -2e3 ", -2000.0),
            (".5", 0.5),
            ("5.", 5.0),
            ("1_000.25", 1000.25),
            ("Infinity", f64::INFINITY),
            ("-inf", f64::NEG_INFINITY),
        ] {
            assert_eq!(text_float(text.as_bytes()), Ok(want), "{text:?}");
        }
        assert!(text_float(b"NaN").unwrap().is_nan());
        for text in ["", "1._5", "_1", "1,5", "--1", "0x1p3", "abc"] {
            assert!(text_float(text.as_bytes()).is_err(), "{text:?} was read");
        }
    }

    #[test]
    fn decodings_parse_and_print() {
        for text in [
            "int",
            "float",
            "raw",
            "utf8",
            "json",
            "npy",
            "jpeg",
            "png",
            "f32[3,4]",
            "i64[]",
            "list[u16]",
        ] {
            let d: FieldDecode = text.parse().unwrap();
            assert_eq!(d.to_string(), text);
        }
        assert_eq!(
            "u16[2048]".parse::<FieldDecode>().unwrap().field("t"),
            Field::tensor("t", DType::U16, &[2048])
        );
        assert_eq!(
            "list[i64]".parse::<FieldDecode>().unwrap().field("t"),
            Field::bytes("t", Codec::Elements(DType::I64))
        );
        for text in [
            "", "f32[3", "q8[1]", "f32[0]", "f32[a]", "pickle", "list[]", "list[q8]",
        ] {
            assert!(text.parse::<FieldDecode>().is_err(), "{text:?} parsed");
        }
    }

    #[test]
    fn npy_members_give_their_values_in_place() {
        let mut b = crate::source::npy_header(DType::I16, &[2, 3]).unwrap();
        let header = b.len();
        b.extend((0..6i16).flat_map(i16::to_le_bytes));
        let (dtype, shape, values) = npy_array(&b).unwrap();
        assert_eq!(
            (dtype, shape, values),
            (DType::I16, vec![2, 3], header..header + 12)
        );
        let d = Decoder::NpyTensor {
            dtype: DType::I16,
            shape: vec![2, 3],
        };
        assert_eq!(d.decode(&b), Ok(Value::Within(header..header + 12)));
        // Another shape, a short member, a long one.
        let other = Decoder::NpyTensor {
            dtype: DType::I16,
            shape: vec![3, 2],
        };
        assert!(other.decode(&b).unwrap_err().contains("i16[2, 3]"));
        assert!(npy_array(&b[..b.len() - 1]).is_err());
        b.push(0);
        assert!(npy_array(&b).is_err());
    }
}
