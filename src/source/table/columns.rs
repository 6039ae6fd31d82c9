//! Columns to fields: the one map, shared by Parquet and Arrow, from a table's Arrow columns
//! to gpufeed's fields, and, for each row of a decoded record batch, where each field's bytes
//! are inside the batch's buffers.
//!
//! The rules:
//!
//! | Arrow type | field |
//! |---|---|
//! | integers, floats (f16 too), bool; dates, times, timestamps, durations (their integers) | a scalar tensor (shape `[]`) |
//! | `FixedSizeList` of those (nested: more dimensions) | a tensor of that shape |
//! | `Utf8`, `LargeUtf8`, `Utf8View` | bytes, `utf8` |
//! | `Binary`, `LargeBinary`, `BinaryView`, `FixedSizeBinary` | bytes, `raw` |
//! | `List`, `LargeList` of integers or floats | ragged bytes of those elements |
//! | `Dictionary` of any of the above (not lists) | as its values |
//! | a struct of `bytes` (binary) and `path` (string): the `datasets` Image feature | an image field named after the struct: the `bytes` child, tagged JPEG or PNG by its first value |
//! | any other struct | one field per child, named `parent.child` |
//!
//! Anything else (maps, unions, decimals, lists of strings or of lists, a list of bools, ...)
//! cannot be batched: such a column is left out of the default selection and listed by
//! `describe()` as not readable; naming it is an error.
//!
//! A row's field is a [`Bytes`] view of the Arrow buffer that holds it (a reference count, no
//! copy): Arrow IPC buffers are views of the file's mapping, Parquet's are the decoded
//! chunk's. Bool columns are bit-packed in Arrow: they are widened to one byte per value once
//! per batch, as are dictionary keys (to `u32`).

use arrow_array::RecordBatch;
use arrow_buffer::{BooleanBuffer, Buffer, NullBuffer, ScalarBuffer};
use arrow_schema::{DataType, Fields, Schema as ArrowSchema};
use bytes::Bytes;

use super::{ColumnSummary, Fill, TableOptions};
use crate::error::{Error, Result};
use crate::format::{Codec, DType, Field, FieldKind, Schema};

/// What a column's Arrow type becomes.
#[derive(Clone, Debug, PartialEq)]
enum Mapped {
    Tensor(DType, Vec<u64>),
    Bytes(Codec),
}

/// One field read from a table: where it is (a top-level column, then children of structs)
/// and what it becomes.
#[derive(Clone, Debug)]
pub(crate) struct FieldPlan {
    /// The top-level column it is read from.
    pub root: usize,
    /// Child indexes below the root (structs).
    path: Vec<usize>,
    /// True for the `datasets` Image feature's `bytes` child (its codec is sniffed).
    pub image: bool,
    /// The value of nulls, as the field's bytes.
    fill: Option<Bytes>,
}

/// The fields read from a table of a given Arrow schema, with the options applied.
#[derive(Clone, Debug)]
pub(crate) struct Plan {
    /// The fields, in the table's column order.
    pub fields: Vec<Field>,
    /// Where each field is read from (parallel to `fields`).
    pub plans: Vec<FieldPlan>,
    /// The top-level columns to decode, ascending (the projection).
    pub roots: Vec<usize>,
    /// Every column (struct children flattened), with its field or why it has none.
    pub columns: Vec<ColumnSummary>,
}

/// The dtype of an Arrow primitive type, for the types that are a tensor's elements.
fn dtype_of(dt: &DataType) -> Option<DType> {
    Some(match dt {
        DataType::Int8 => DType::I8,
        DataType::Int16 => DType::I16,
        DataType::Int32 | DataType::Date32 | DataType::Time32(_) => DType::I32,
        DataType::Int64
        | DataType::Date64
        | DataType::Time64(_)
        | DataType::Timestamp(_, _)
        | DataType::Duration(_) => DType::I64,
        DataType::UInt8 => DType::U8,
        DataType::UInt16 => DType::U16,
        DataType::UInt32 => DType::U32,
        DataType::UInt64 => DType::U64,
        DataType::Float16 => DType::F16,
        DataType::Float32 => DType::F32,
        DataType::Float64 => DType::F64,
        DataType::Boolean => DType::Bool,
        _ => return None,
    })
}

/// The field a column of type `dt` becomes, or why it cannot be batched.
fn map_type(dt: &DataType) -> std::result::Result<Mapped, String> {
    if let Some(d) = dtype_of(dt) {
        return Ok(Mapped::Tensor(d, Vec::new()));
    }
    match dt {
        DataType::FixedSizeList(child, n) => match map_type(child.data_type())? {
            Mapped::Tensor(d, mut shape) => {
                let n = u64::try_from(*n).map_err(|_| format!("a list of {n} values"))?;
                shape.insert(0, n);
                Ok(Mapped::Tensor(d, shape))
            }
            Mapped::Bytes(_) => Err(format!(
                "a fixed-size list of {} (only lists of numbers make tensors)",
                child.data_type()
            )),
        },
        DataType::Utf8 | DataType::LargeUtf8 | DataType::Utf8View => Ok(Mapped::Bytes(Codec::Utf8)),
        DataType::Binary
        | DataType::LargeBinary
        | DataType::BinaryView
        | DataType::FixedSizeBinary(_) => Ok(Mapped::Bytes(Codec::Raw)),
        DataType::List(child) | DataType::LargeList(child) => match dtype_of(child.data_type()) {
            Some(DType::Bool) => {
                Err("a list of bools (bit-packed, no ragged field holds them)".into())
            }
            Some(d) => Ok(Mapped::Bytes(Codec::Elements(d))),
            None => Err(format!(
                "a list of {} (only lists of numbers make ragged fields)",
                child.data_type()
            )),
        },
        DataType::Dictionary(_, values) => match map_type(values)? {
            Mapped::Tensor(d, shape) if shape.is_empty() => Ok(Mapped::Tensor(d, shape)),
            Mapped::Bytes(c @ (Codec::Utf8 | Codec::Raw)) => Ok(Mapped::Bytes(c)),
            _ => Err(format!("a dictionary of {values}")),
        },
        DataType::Null => Err("a column of nulls only".into()),
        DataType::Decimal32(..)
        | DataType::Decimal64(..)
        | DataType::Decimal128(..)
        | DataType::Decimal256(..) => Err("a decimal (no tensor dtype holds it)".into()),
        other => Err(format!("{other} cannot be batched")),
    }
}

/// The index of the `bytes` child when `children` are the `datasets` Image feature's
/// (`bytes`: binary, `path`: string).
fn image_bytes_child(children: &Fields) -> Option<usize> {
    if children.len() != 2 {
        return None;
    }
    let bytes = children.iter().position(|c| {
        c.name() == "bytes"
            && matches!(
                c.data_type(),
                DataType::Binary | DataType::LargeBinary | DataType::BinaryView
            )
    })?;
    children
        .iter()
        .any(|c| {
            c.name() == "path"
                && matches!(
                    c.data_type(),
                    DataType::Utf8 | DataType::LargeUtf8 | DataType::Utf8View
                )
        })
        .then_some(bytes)
}

/// A field's schema text, as `describe()` shows it.
pub(crate) fn field_text(field: &Field) -> String {
    match &field.kind {
        FieldKind::Tensor { dtype, shape } if shape.is_empty() => format!("{dtype}"),
        FieldKind::Tensor { dtype, shape } => format!("{dtype}{shape:?}"),
        FieldKind::Bytes { codec } => format!("{} bytes", codec.name()),
    }
}

/// The bytes of `fill` for `field`, or why it does not fit.
fn fill_bytes(fill: &Fill, field: &Field) -> std::result::Result<Bytes, String> {
    match (&field.kind, fill) {
        (FieldKind::Tensor { dtype, .. }, Fill::Bytes(_)) => {
            Err(format!("the field is {dtype}: give a number"))
        }
        (FieldKind::Tensor { dtype, shape }, _) => {
            let one = scalar_bytes(*dtype, fill)?;
            let n: u64 = shape.iter().product();
            let n = usize::try_from(n).map_err(|_| "the tensor is too large".to_owned())?;
            Ok(Bytes::from(one.repeat(n)))
        }
        (FieldKind::Bytes { codec }, Fill::Bytes(b)) => match codec {
            Codec::Elements(d) if !b.len().is_multiple_of(d.size()) => Err(format!(
                "{} bytes is not a whole number of {d} elements",
                b.len()
            )),
            _ => Ok(Bytes::from(b.clone())),
        },
        (FieldKind::Bytes { codec }, _) => Err(format!(
            "the field is {} bytes: give bytes (an empty value is b\"\")",
            codec.name()
        )),
    }
}

/// One value of `dtype` holding `fill`, little-endian.
fn scalar_bytes(dtype: DType, fill: &Fill) -> std::result::Result<Vec<u8>, String> {
    let out_of_range = || format!("{fill:?} does not fit {dtype}");
    let int = |v: &Fill| match v {
        Fill::Int(i) => Ok(*i),
        _ => Err(format!("the field is {dtype}: give an integer")),
    };
    let float = |v: &Fill| match v {
        Fill::Int(i) => *i as f64,
        Fill::Float(f) => *f,
        Fill::Bytes(_) => f64::NAN,
    };
    Ok(match dtype {
        DType::U8 => vec![u8::try_from(int(fill)?).map_err(|_| out_of_range())?],
        DType::I8 => i8::try_from(int(fill)?)
            .map_err(|_| out_of_range())?
            .to_le_bytes()
            .to_vec(),
        DType::U16 => u16::try_from(int(fill)?)
            .map_err(|_| out_of_range())?
            .to_le_bytes()
            .to_vec(),
        DType::I16 => i16::try_from(int(fill)?)
            .map_err(|_| out_of_range())?
            .to_le_bytes()
            .to_vec(),
        DType::U32 => u32::try_from(int(fill)?)
            .map_err(|_| out_of_range())?
            .to_le_bytes()
            .to_vec(),
        DType::I32 => i32::try_from(int(fill)?)
            .map_err(|_| out_of_range())?
            .to_le_bytes()
            .to_vec(),
        DType::U64 => u64::try_from(int(fill)?)
            .map_err(|_| out_of_range())?
            .to_le_bytes()
            .to_vec(),
        DType::I64 => int(fill)?.to_le_bytes().to_vec(),
        DType::Bool => match int(fill)? {
            0 => vec![0],
            1 => vec![1],
            _ => return Err(out_of_range()),
        },
        DType::F16 => half::f16::from_f64(float(fill)).to_le_bytes().to_vec(),
        DType::BF16 => half::bf16::from_f64(float(fill)).to_le_bytes().to_vec(),
        DType::F32 => (float(fill) as f32).to_le_bytes().to_vec(),
        DType::F64 => float(fill).to_le_bytes().to_vec(),
    })
}

impl Plan {
    /// The fields of a table of schema `arrow` (the file `path`, for errors) as `options`
    /// select them.
    pub(crate) fn new(
        arrow: &ArrowSchema,
        options: &TableOptions,
        path: &std::path::Path,
    ) -> Result<Plan> {
        let mut all: Vec<(Field, FieldPlan)> = Vec::new();
        let mut columns = Vec::new();
        for (root, f) in arrow.fields().iter().enumerate() {
            walk(
                f.name().clone(),
                f.data_type(),
                root,
                Vec::new(),
                &mut all,
                &mut columns,
            );
        }
        let chosen: Vec<usize> = match &options.columns {
            None => (0..all.len()).collect(),
            Some(names) => {
                let mut chosen = Vec::with_capacity(names.len());
                for name in names {
                    if let Some(k) = all.iter().position(|(f, _)| &f.name == name) {
                        if !chosen.contains(&k) {
                            chosen.push(k);
                        }
                        continue;
                    }
                    if let Some(c) = columns.iter().find(|c| &c.name == name) {
                        return Err(Error::UnsupportedTable {
                            path: path.to_path_buf(),
                            what: format!(
                                "column `{name}` cannot be read: its type is {}: {}",
                                c.arrow_type,
                                c.unreadable.as_deref().unwrap_or("it cannot be batched")
                            ),
                        });
                    }
                    let names: Vec<&str> = all.iter().map(|(f, _)| f.name.as_str()).collect();
                    return Err(Error::config(
                        "fields",
                        format!(
                            "{}: no column `{name}` (its columns: {})",
                            path.display(),
                            names.join(", ")
                        ),
                    ));
                }
                chosen.sort_unstable();
                chosen
            }
        };
        for c in columns.iter_mut() {
            c.skipped = c.field.is_none() || !chosen.iter().any(|&j| all[j].0.name == c.name);
        }
        let mut fields = Vec::with_capacity(chosen.len());
        let mut plans = Vec::with_capacity(chosen.len());
        for k in chosen {
            let (field, mut plan) = all[k].clone();
            if let Some(fill) = options.fill.get(&field.name) {
                plan.fill = Some(fill_bytes(fill, &field).map_err(|what| {
                    Error::config(
                        "fill",
                        format!("the fill value of `{}`: {what}", field.name),
                    )
                })?);
            }
            fields.push(field);
            plans.push(plan);
        }
        for name in options.fill.keys() {
            if !fields.iter().any(|f| &f.name == name) {
                return Err(Error::config(
                    "fill",
                    format!("`{name}` is not a field read from {}", path.display()),
                ));
            }
        }
        if fields.is_empty() {
            return Err(Error::mismatch(format!(
                "{}: no column can be read (its columns: {})",
                path.display(),
                columns
                    .iter()
                    .map(|c| format!("{} ({})", c.name, c.arrow_type))
                    .collect::<Vec<_>>()
                    .join(", ")
            )));
        }
        let mut roots: Vec<usize> = plans.iter().map(|p| p.root).collect();
        roots.sort_unstable();
        roots.dedup();
        Ok(Plan {
            fields,
            plans,
            roots,
            columns,
        })
    }

    /// The gpufeed schema of the fields read.
    pub(crate) fn schema(&self, path: &std::path::Path) -> Result<Schema> {
        Schema::new(self.fields.clone()).map_err(|e| {
            Error::mismatch(format!(
                "{}: its columns make no valid schema: {e}",
                path.display()
            ))
        })
    }

    /// Tags image field `k` with the codec of `first`, its first value (JPEG or PNG by magic;
    /// raw bytes otherwise).
    pub(crate) fn sniff_image(&mut self, k: usize, first: &[u8]) {
        let codec = match crate::codec::ImageKind::detect(first) {
            Some(crate::codec::ImageKind::Jpeg) => Codec::Jpeg,
            Some(crate::codec::ImageKind::Png) => Codec::Png,
            _ => return,
        };
        self.fields[k].kind = FieldKind::Bytes { codec };
        let name = self.fields[k].name.clone();
        if let Some(c) = self.columns.iter_mut().find(|c| c.name == name) {
            c.field = Some(field_text(&self.fields[k]));
        }
    }
}

/// Adds the fields of column `name` of type `dt` (struct children flattened) to `all`, and
/// its summaries to `columns`.
fn walk(
    name: String,
    dt: &DataType,
    root: usize,
    path: Vec<usize>,
    all: &mut Vec<(Field, FieldPlan)>,
    columns: &mut Vec<ColumnSummary>,
) {
    if let DataType::Struct(children) = dt {
        if let Some(bytes) = image_bytes_child(children) {
            let field = Field::bytes(name.clone(), Codec::Raw);
            columns.push(ColumnSummary {
                name,
                arrow_type: dt.to_string(),
                field: Some(field_text(&field)),
                unreadable: None,
                skipped: false,
            });
            let mut path = path;
            path.push(bytes);
            all.push((
                field,
                FieldPlan {
                    root,
                    path,
                    image: true,
                    fill: None,
                },
            ));
            return;
        }
        for (i, c) in children.iter().enumerate() {
            let mut p = path.clone();
            p.push(i);
            walk(
                format!("{name}.{}", c.name()),
                c.data_type(),
                root,
                p,
                all,
                columns,
            );
        }
        return;
    }
    match map_type(dt) {
        Ok(m) => {
            let field = match m {
                Mapped::Tensor(d, shape) => Field::tensor(name.clone(), d, &shape),
                Mapped::Bytes(c) => Field::bytes(name.clone(), c),
            };
            columns.push(ColumnSummary {
                name,
                arrow_type: dt.to_string(),
                field: Some(field_text(&field)),
                unreadable: None,
                skipped: false,
            });
            all.push((
                field,
                FieldPlan {
                    root,
                    path,
                    image: false,
                    fill: None,
                },
            ));
        }
        Err(why) => columns.push(ColumnSummary {
            name,
            arrow_type: dt.to_string(),
            field: None,
            unreadable: Some(why),
            skipped: true,
        }),
    }
}

/// Where the values of one column of a batch are.
#[derive(Debug)]
enum View {
    /// Row `r` is `values[r * width..][..width]`.
    Fixed { values: Bytes, width: usize },
    /// Row `r` is `values[offsets[r] * elem..offsets[r + 1] * elem]`.
    Var32 {
        values: Bytes,
        offsets: ScalarBuffer<i32>,
        elem: usize,
    },
    /// As `Var32`, with 64-bit offsets.
    Var64 {
        values: Bytes,
        offsets: ScalarBuffer<i64>,
        elem: usize,
    },
    /// Arrow's string and binary views: 16 bytes a row, inline up to 12 bytes, else a
    /// buffer, an offset and a length.
    Views {
        views: ScalarBuffer<u128>,
        inline: Bytes,
        data: Vec<Bytes>,
    },
    /// Row `r` is row `keys[r]` of `values`.
    Dict { keys: Vec<u32>, values: Box<View> },
}

/// One field's column of a decoded batch.
#[derive(Debug)]
struct Column {
    view: View,
    nulls: Option<NullBuffer>,
    fill: Option<Bytes>,
}

/// The fields' columns of one decoded record batch: each row's fields as views of its
/// buffers.
#[derive(Debug)]
pub(crate) struct Columns {
    cols: Vec<Column>,
    rows: usize,
}

/// Why a row's field could not be given.
#[derive(Debug)]
pub(crate) enum RowFault {
    /// The value is null and the field has no fill value.
    Null(usize),
    /// The column's offsets point outside its values (a corrupt file).
    Corrupt(usize),
}

/// `buf` as `Bytes`: a view of `base` when `buf` lies inside it (a mapped file), else the
/// buffer itself, kept alive by the `Bytes`.
fn to_bytes(buf: &Buffer, base: Option<&Bytes>) -> Bytes {
    if let Some(base) = base {
        let b = base.as_ptr() as usize;
        let p = buf.as_ptr() as usize;
        if p >= b && p + buf.len() <= b + base.len() {
            return base.slice(p - b..p - b + buf.len());
        }
    }
    Bytes::from_owner(buf.clone())
}

/// `len` bytes at `at` of `b`, or why not.
fn sub(b: Bytes, at: usize, len: usize) -> std::result::Result<Bytes, String> {
    match at.checked_add(len) {
        Some(end) if end <= b.len() => Ok(b.slice(at..end)),
        _ => Err(format!(
            "a buffer of {} bytes is shorter than its {len} values at {at}",
            b.len()
        )),
    }
}

fn buffer(data: &arrow_data::ArrayData, i: usize) -> std::result::Result<&Buffer, String> {
    data.buffers()
        .get(i)
        .ok_or_else(|| format!("buffer {i} is missing"))
}

fn child(
    data: &arrow_data::ArrayData,
    i: usize,
) -> std::result::Result<&arrow_data::ArrayData, String> {
    data.child_data()
        .get(i)
        .ok_or_else(|| format!("child {i} is missing"))
}

/// The offsets of rows `off..=off + len` of a 32- or 64-bit offset buffer, checked for size
/// (the element type's alignment is Arrow's, checked when the array was made).
fn offsets<T: arrow_buffer::ArrowNativeType>(
    buf: &Buffer,
    off: usize,
    len: usize,
) -> std::result::Result<ScalarBuffer<T>, String> {
    let need = (off + len + 1) * std::mem::size_of::<T>();
    if buf.len() < need || !(buf.as_ptr() as usize).is_multiple_of(std::mem::align_of::<T>()) {
        return Err(format!(
            "an offset buffer of {} bytes for {} rows",
            buf.len(),
            len
        ));
    }
    Ok(ScalarBuffer::new(buf.clone(), off, len + 1))
}

/// The view of `data` (whose type `map_type` accepted).
fn view_of(
    data: &arrow_data::ArrayData,
    base: Option<&Bytes>,
) -> std::result::Result<View, String> {
    let (off, len) = (data.offset(), data.len());
    let dt = data.data_type();
    if *dt == DataType::Boolean {
        let bits = buffer(data, 0)?;
        if bits.len() * 8 < off + len {
            return Err("a bool buffer shorter than its rows".into());
        }
        let b = BooleanBuffer::new(bits.clone(), off, len);
        let values: Vec<u8> = b.iter().map(u8::from).collect();
        return Ok(View::Fixed {
            values: Bytes::from(values),
            width: 1,
        });
    }
    if let Some(width) = dt.primitive_width()
        && dtype_of(dt).is_some()
    {
        let values = sub(to_bytes(buffer(data, 0)?, base), off * width, len * width)?;
        return Ok(View::Fixed { values, width });
    }
    match dt {
        DataType::FixedSizeBinary(w) => {
            let w = usize::try_from(*w).map_err(|_| "a negative width".to_owned())?;
            let values = sub(to_bytes(buffer(data, 0)?, base), off * w, len * w)?;
            Ok(View::Fixed { values, width: w })
        }
        DataType::FixedSizeList(_, n) => {
            let n = usize::try_from(*n).map_err(|_| "a negative list size".to_owned())?;
            let c = child(data, 0)?;
            if c.len() < (off + len) * n {
                return Err("a fixed-size list shorter than its rows".into());
            }
            let c = c.slice(off * n, len * n);
            // A null row holds `n` null values in Parquet's reading (and may in any writer's):
            // those are the row's, which its null mask covers; a null value in a row that is
            // there cannot be batched.
            if let Some(values) = c.nulls().filter(|v| v.null_count() > 0) {
                let row_null = |r: usize| data.nulls().is_some_and(|rows| rows.is_null(r));
                if (0..len * n).any(|i| values.is_null(i) && !row_null(i / n)) {
                    return Err(
                        "a null inside a fixed-size list (only whole rows can be null)".into(),
                    );
                }
            }
            match view_of(&c, base)? {
                View::Fixed { values, width } => Ok(View::Fixed {
                    values,
                    width: width * n,
                }),
                _ => Err("a fixed-size list of variable-size values".into()),
            }
        }
        DataType::Utf8 | DataType::Binary => Ok(View::Var32 {
            offsets: offsets::<i32>(buffer(data, 0)?, off, len)?,
            values: to_bytes(buffer(data, 1)?, base),
            elem: 1,
        }),
        DataType::LargeUtf8 | DataType::LargeBinary => Ok(View::Var64 {
            offsets: offsets::<i64>(buffer(data, 0)?, off, len)?,
            values: to_bytes(buffer(data, 1)?, base),
            elem: 1,
        }),
        DataType::Utf8View | DataType::BinaryView => {
            let v = buffer(data, 0)?;
            if v.len() < (off + len) * 16 || !(v.as_ptr() as usize).is_multiple_of(16) {
                return Err("a view buffer shorter than its rows".into());
            }
            Ok(View::Views {
                views: ScalarBuffer::new(v.clone(), off, len),
                inline: sub(to_bytes(v, base), off * 16, len * 16)?,
                data: data.buffers()[1..]
                    .iter()
                    .map(|b| to_bytes(b, base))
                    .collect(),
            })
        }
        DataType::List(_) | DataType::LargeList(_) => {
            let c = child(data, 0)?;
            if c.null_count() > 0 {
                return Err("a null inside a list (only whole rows can be null)".into());
            }
            let View::Fixed { values, width } = view_of(c, base)? else {
                return Err("a list of variable-size values".into());
            };
            if matches!(dt, DataType::List(_)) {
                Ok(View::Var32 {
                    offsets: offsets::<i32>(buffer(data, 0)?, off, len)?,
                    values,
                    elem: width,
                })
            } else {
                Ok(View::Var64 {
                    offsets: offsets::<i64>(buffer(data, 0)?, off, len)?,
                    values,
                    elem: width,
                })
            }
        }
        DataType::Dictionary(kt, _) => {
            let values = child(data, 0)?;
            if values.null_count() > 0 {
                return Err("a dictionary with a null among its values".into());
            }
            let keys = dictionary_keys(kt, buffer(data, 0)?, off, len)?;
            let n = values.len();
            for (r, &k) in keys.iter().enumerate() {
                if k as usize >= n && !data.is_null(r) {
                    return Err(format!(
                        "row {r}'s dictionary key {k} is past the dictionary's {n} values"
                    ));
                }
            }
            Ok(View::Dict {
                keys,
                values: Box::new(view_of(values, base)?),
            })
        }
        other => Err(format!("{other} cannot be batched")),
    }
}

/// Dictionary keys of type `kt` as `u32` (a negative key becomes `u32::MAX`: out of range).
fn dictionary_keys(
    kt: &DataType,
    buf: &Buffer,
    off: usize,
    len: usize,
) -> std::result::Result<Vec<u32>, String> {
    fn widen<T: arrow_buffer::ArrowNativeType>(
        buf: &Buffer,
        off: usize,
        len: usize,
        f: impl Fn(T) -> u32,
    ) -> std::result::Result<Vec<u32>, String> {
        let size = std::mem::size_of::<T>();
        if buf.len() < (off + len) * size || !(buf.as_ptr() as usize).is_multiple_of(size) {
            return Err("a key buffer shorter than its rows".into());
        }
        let keys = ScalarBuffer::<T>::new(buf.clone(), off, len);
        Ok(keys.iter().map(|&k| f(k)).collect())
    }
    let clamp = |k: i64| u32::try_from(k).unwrap_or(u32::MAX);
    match kt {
        DataType::Int8 => widen::<i8>(buf, off, len, |k| clamp(k.into())),
        DataType::Int16 => widen::<i16>(buf, off, len, |k| clamp(k.into())),
        DataType::Int32 => widen::<i32>(buf, off, len, |k| clamp(k.into())),
        DataType::Int64 => widen::<i64>(buf, off, len, clamp),
        DataType::UInt8 => widen::<u8>(buf, off, len, u32::from),
        DataType::UInt16 => widen::<u16>(buf, off, len, u32::from),
        DataType::UInt32 => widen::<u32>(buf, off, len, |k| k),
        DataType::UInt64 => widen::<u64>(buf, off, len, |k| u32::try_from(k).unwrap_or(u32::MAX)),
        other => Err(format!("dictionary keys of type {other}")),
    }
}

impl View {
    /// Row `r`'s bytes; `None` when the buffers do not hold them (a corrupt file).
    fn value(&self, r: usize) -> Option<Bytes> {
        match self {
            View::Fixed { values, width } => {
                let at = r.checked_mul(*width)?;
                (at + width <= values.len()).then(|| values.slice(at..at + width))
            }
            View::Var32 {
                values,
                offsets,
                elem,
            } => {
                let a = usize::try_from(*offsets.get(r)?).ok()? * elem;
                let b = usize::try_from(*offsets.get(r + 1)?).ok()? * elem;
                (a <= b && b <= values.len()).then(|| values.slice(a..b))
            }
            View::Var64 {
                values,
                offsets,
                elem,
            } => {
                let a = usize::try_from(*offsets.get(r)?).ok()?.checked_mul(*elem)?;
                let b = usize::try_from(*offsets.get(r + 1)?)
                    .ok()?
                    .checked_mul(*elem)?;
                (a <= b && b <= values.len()).then(|| values.slice(a..b))
            }
            View::Views {
                views,
                inline,
                data,
            } => {
                let v = *views.get(r)?;
                let len = v as u32 as usize;
                if len <= 12 {
                    let at = r * 16 + 4;
                    (at + len <= inline.len()).then(|| inline.slice(at..at + len))
                } else {
                    let buf = data.get((v >> 64) as u32 as usize)?;
                    let at = (v >> 96) as u32 as usize;
                    (at + len <= buf.len()).then(|| buf.slice(at..at + len))
                }
            }
            View::Dict { keys, values } => values.value(*keys.get(r)? as usize),
        }
    }
}

impl Columns {
    /// The columns of `plan`'s fields in `batch`, which holds the plan's `roots` in order
    /// (the projection). `base`: the mapping the batch's buffers point into, if any. Errors
    /// say which field and what is wrong (the caller names the file).
    pub(crate) fn new(
        batch: &RecordBatch,
        plan: &Plan,
        base: Option<&Bytes>,
    ) -> std::result::Result<Columns, (usize, String)> {
        let mut cols = Vec::with_capacity(plan.plans.len());
        for (k, p) in plan.plans.iter().enumerate() {
            let at = plan
                .roots
                .binary_search(&p.root)
                .map_err(|_| (k, "its column was not decoded".to_owned()))?;
            let array = batch
                .columns()
                .get(at)
                .ok_or_else(|| (k, "its column is missing from the batch".to_owned()))?;
            let mut data = array.to_data();
            let mut nulls = data.nulls().cloned();
            for &i in &p.path {
                let c = child(&data, i).map_err(|e| (k, e))?;
                if c.len() < data.offset() + data.len() {
                    return Err((k, "a struct's child is shorter than the struct".into()));
                }
                let c = c.slice(data.offset(), data.len());
                nulls = NullBuffer::union(nulls.as_ref(), c.nulls());
                data = c;
            }
            let view = view_of(&data, base).map_err(|e| (k, e))?;
            cols.push(Column {
                view,
                nulls: nulls.filter(|n| n.null_count() > 0),
                fill: p.fill.clone(),
            });
        }
        Ok(Columns {
            cols,
            rows: batch.num_rows(),
        })
    }

    /// Row `r`'s fields, in the plan's order.
    pub(crate) fn row(&self, r: usize) -> std::result::Result<Vec<Bytes>, RowFault> {
        let mut out = Vec::with_capacity(self.cols.len());
        for (k, c) in self.cols.iter().enumerate() {
            if let Some(n) = &c.nulls
                && n.is_null(r)
            {
                match &c.fill {
                    Some(f) => {
                        out.push(f.clone());
                        continue;
                    }
                    None => return Err(RowFault::Null(k)),
                }
            }
            out.push(c.view.value(r).ok_or(RowFault::Corrupt(k))?);
        }
        Ok(out)
    }

    /// Field `k`'s first value that is not null, if any.
    pub(crate) fn first_value(&self, k: usize) -> Option<Bytes> {
        let c = self.cols.get(k)?;
        (0..self.rows)
            .find(|&r| c.nulls.as_ref().is_none_or(|n| n.is_valid(r)))
            .and_then(|r| c.view.value(r))
    }
}

/// The error for a row that cannot be given: `row` is the row within `path`, `global` the
/// data set's row.
pub(crate) fn row_error(
    fault: RowFault,
    plan: &Plan,
    path: &std::path::Path,
    row: u64,
    global: u64,
) -> Error {
    match fault {
        RowFault::Null(k) => Error::BadRecord {
            path: path.to_path_buf(),
            record: row,
            what: format!(
                "column `{}` is null (row {global} of the data set): give it a fill value \
                 (`fill=`, `--fill {}=VALUE`) or leave the column out",
                plan.fields[k].name, plan.fields[k].name
            ),
        },
        RowFault::Corrupt(k) => Error::BadRecord {
            path: path.to_path_buf(),
            record: row,
            what: format!(
                "column `{}`: its offsets point outside its values (row {global} of the data \
                 set): the file is corrupt",
                plan.fields[k].name
            ),
        },
    }
}
