//! Dense numeric columns of a Parquet chunk: integer and float columns, and fixed-size lists
//! of them, decoded with the parquet crate's column reader straight into one buffer of the
//! rows' values, for the chunks that hold no null.
//!
//! What the hub ships most for numbers is a column of `int64`/`float32`, or of
//! `list_(float32(), N)` (embeddings, features): Parquet stores the list as a repeated leaf
//! with a definition and a repetition level per value. Arrow's reader builds such a column in
//! general: a null mask from the definition levels, the lists' boundaries from the repetition
//! levels, each list's length checked as it goes. When no value is null, the values as the
//! pages decode them are already the rows' bytes, back to back; this path reads them into one
//! buffer and checks the levels in bulk instead (every definition level the maximum, a
//! repetition level of 0 exactly at each row's first value).
//!
//! Whether a column may take this path is decided once at open ([`DenseColumn::new`]: its
//! Arrow type, the Parquet physical type and annotation under it, and its levels); whether a
//! chunk may is checked on the chunk, never assumed: a column chunk whose statistics count a
//! null goes to Arrow's reader at once, and a chunk whose levels show a null or a list of
//! another length is given back to Arrow's reader too ([`DenseColumn::read`] returns `None`),
//! which then reads it (fill values, errors naming the row) as for every other column.

use std::sync::Arc;

use arrow_array::ArrayRef;
use arrow_buffer::Buffer;
use arrow_data::ArrayData;
use arrow_schema::DataType;
use parquet::basic::{ConvertedType, LogicalType, Type as Physical};
use parquet::column::reader::ColumnReaderImpl;
use parquet::data_type::{DoubleType, FloatType, Int32Type, Int64Type};
use parquet::file::metadata::ParquetMetaData;
use parquet::file::reader::ChunkReader;
use parquet::file::serialized_reader::SerializedPageReader;
use parquet::schema::types::{ColumnDescPtr, SchemaDescriptor};

/// Values decoded per call of the column reader: its level buffers stay this small (a few
/// hundred KiB) however large the chunk.
const SLAB_VALUES: usize = 1 << 16;

/// A top-level column that may be read by this path: a number, or a fixed-size list of
/// numbers, stored as one Parquet leaf of a physical type that holds the Arrow values bit for
/// bit.
#[derive(Clone, Debug)]
pub(super) struct DenseColumn {
    /// The Parquet leaf (its index among the file's leaves).
    leaf: usize,
    descr: ColumnDescPtr,
    /// The column's Arrow type (what Arrow's reader would make).
    data_type: DataType,
    /// The list's element type, for a fixed-size list.
    element: Option<DataType>,
    /// Values in a row: 1, or the list's length.
    per_row: usize,
}

/// The Parquet physical type that holds `dt`'s values bit for bit, with the annotations it
/// may carry; `None` for the types Arrow's reader converts (narrow integers, dates in
/// milliseconds, timestamps, half floats, ...).
fn physical_of(dt: &DataType) -> Option<(Physical, Option<(i8, bool)>)> {
    Some(match dt {
        DataType::Int32 => (Physical::INT32, Some((32, true))),
        DataType::UInt32 => (Physical::INT32, Some((32, false))),
        DataType::Int64 => (Physical::INT64, Some((64, true))),
        DataType::UInt64 => (Physical::INT64, Some((64, false))),
        DataType::Float32 => (Physical::FLOAT, None),
        DataType::Float64 => (Physical::DOUBLE, None),
        _ => return None,
    })
}

impl DenseColumn {
    /// The dense reading of top-level column `root` of Arrow type `data_type`, when the
    /// file's Parquet schema stores it so that it can be read that way.
    pub(super) fn new(
        schema: &SchemaDescriptor,
        root: usize,
        data_type: &DataType,
    ) -> Option<DenseColumn> {
        let mut leaves =
            (0..schema.num_columns()).filter(|&j| schema.get_column_root_idx(j) == root);
        let leaf = leaves.next()?;
        if leaves.next().is_some() {
            return None;
        }
        let descr = schema.column(leaf);
        let (element, per_row, rep) = match data_type {
            DataType::FixedSizeList(child, n) => (
                Some(child.data_type().clone()),
                usize::try_from(*n).ok()?,
                1,
            ),
            _ => (None, 1, 0),
        };
        let (physical, integer) = physical_of(element.as_ref().unwrap_or(data_type))?;
        let annotation_fits = match (integer, descr.logical_type_ref()) {
            (Some((bits, signed)), Some(LogicalType::Integer(int))) => {
                int.bit_width == bits && int.is_signed == signed
            }
            (Some((bits, signed)), None) => matches!(
                (descr.converted_type(), bits, signed),
                (ConvertedType::NONE, _, true)
                    | (ConvertedType::INT_32, 32, true)
                    | (ConvertedType::INT_64, 64, true)
                    | (ConvertedType::UINT_32, 32, false)
                    | (ConvertedType::UINT_64, 64, false)
            ),
            (None, None) => true,
            _ => false,
        };
        // A fixed-size list is one repeated level; a number none. Up to one optional level
        // per nesting: the list, its repeated group, its element.
        let levels_fit = descr.max_rep_level() == rep && descr.max_def_level() <= 1 + 2 * rep;
        (descr.physical_type() == physical && annotation_fits && levels_fit && per_row > 0).then(
            || DenseColumn {
                leaf,
                descr,
                data_type: data_type.clone(),
                element,
                per_row,
            },
        )
    }

    /// Rows `start..start + len` of row group `group`, as the Arrow array Arrow's reader
    /// would make of them; `Ok(None)` when the chunk holds a null (or levels of any other
    /// shape), which Arrow's reader then reads; `Err` for a file that cannot be read.
    pub(super) fn read<R: ChunkReader + 'static>(
        &self,
        reader: R,
        meta: &ParquetMetaData,
        group: usize,
        start: u64,
        len: u64,
    ) -> parquet::errors::Result<Option<ArrayRef>> {
        let column = meta.row_group(group).column(self.leaf);
        if column
            .statistics()
            .and_then(|s| s.null_count_opt())
            .is_some_and(|n| n > 0)
        {
            return Ok(None);
        }
        let pages = SerializedPageReader::new(
            Arc::new(reader),
            column,
            usize::try_from(meta.row_group(group).num_rows()).unwrap_or(0),
            meta.page_index()
                .and_then(|i| i.page_locations(group, self.leaf).cloned()),
        )?;
        let (start, len) = (start as usize, len as usize);
        let values = match self.descr.physical_type() {
            Physical::INT32 => self
                .values::<Int32Type>(Box::new(pages), start, len)?
                .map(Buffer::from_vec),
            Physical::INT64 => self
                .values::<Int64Type>(Box::new(pages), start, len)?
                .map(Buffer::from_vec),
            Physical::FLOAT => self
                .values::<FloatType>(Box::new(pages), start, len)?
                .map(Buffer::from_vec),
            Physical::DOUBLE => self
                .values::<DoubleType>(Box::new(pages), start, len)?
                .map(Buffer::from_vec),
            _ => None,
        };
        let Some(values) = values else {
            return Ok(None);
        };
        let array = match &self.element {
            None => ArrayData::builder(self.data_type.clone())
                .len(len)
                .add_buffer(values)
                .build()?,
            Some(element) => {
                let child = ArrayData::builder(element.clone())
                    .len(len * self.per_row)
                    .add_buffer(values)
                    .build()?;
                ArrayData::builder(self.data_type.clone())
                    .len(len)
                    .add_child_data(child)
                    .build()?
            }
        };
        Ok(Some(arrow_array::make_array(array)))
    }

    /// The values of rows `start..start + len` of the column chunk `pages` reads, when every
    /// one is there and each row has `per_row` of them.
    fn values<T: parquet::data_type::DataType>(
        &self,
        pages: Box<dyn parquet::column::page::PageReader>,
        start: usize,
        len: usize,
    ) -> parquet::errors::Result<Option<Vec<T::T>>> {
        let mut reader = ColumnReaderImpl::<T>::new(self.descr.clone(), pages);
        if reader.skip_records(start)? != start {
            return Ok(None);
        }
        let want = len * self.per_row;
        let mut values: Vec<T::T> = Vec::with_capacity(want);
        let slab_rows = (SLAB_VALUES / self.per_row).max(1);
        let (mut def, mut rep) = (Vec::new(), Vec::new());
        let mut rows = 0;
        while rows < len {
            def.clear();
            rep.clear();
            let (records, read, levels) = reader.read_records(
                slab_rows.min(len - rows),
                Some(&mut def),
                Some(&mut rep),
                &mut values,
            )?;
            // Every level a value (no null anywhere: a definition level below the maximum
            // is a null or an empty list, and yields no value), and each record `per_row` of
            // them, a new row exactly at each `per_row`-th value.
            let whole = records > 0
                && read == levels
                && levels == records * self.per_row
                && (self.descr.max_rep_level() == 0
                    || rep
                        .chunks_exact(self.per_row)
                        .all(|r| r[0] == 0 && continues(&r[1..])));
            if !whole {
                return Ok(None);
            }
            rows += records;
        }
        Ok((values.len() == want).then_some(values))
    }
}

/// Whether every level of `levels` is 1 (the row goes on), without a branch per level: a
/// row of a thousand values checks in a few vector instructions.
fn continues(levels: &[i16]) -> bool {
    levels.iter().fold(0, |other, &l| other | (l ^ 1)) == 0
}

#[cfg(test)]
mod tests {
    use super::*;
    use arrow_array::types::{Float32Type, Int32Type as ArrowInt32};
    use arrow_array::{
        Array, DictionaryArray, FixedSizeListArray, Float64Array, Int64Array, RecordBatch,
        StringArray, UInt32Array,
    };
    use bytes::Bytes;
    use parquet::arrow::ArrowWriter;
    use parquet::arrow::arrow_reader::{
        ArrowReaderMetadata, ArrowReaderOptions, ParquetRecordBatchReaderBuilder, RowSelection,
        RowSelector,
    };
    use parquet::file::metadata::PageIndexPolicy;
    use parquet::file::properties::{EnabledStatistics, WriterProperties};

    /// Rows `start..start + n`: `vec` (4 f32) null as a whole at `null_list` rows, with a null
    /// element at `null_item` rows; `id` i64; `half` f64; `u` u32; `word` a dictionary of
    /// strings.
    fn batch(start: usize, n: usize, null_list: &[usize], null_item: &[usize]) -> RecordBatch {
        let rows = start..start + n;
        let vec = FixedSizeListArray::from_iter_primitive::<Float32Type, _, _>(
            rows.clone().map(|r| {
                (!null_list.contains(&r)).then(|| {
                    (0..4).map(move |k| {
                        (!(null_item.contains(&r) && k == 2)).then_some(r as f32 * 0.5 + k as f32)
                    })
                })
            }),
            4,
        );
        let word: DictionaryArray<ArrowInt32> =
            rows.clone().map(|r| ["cat", "dog"][r % 2]).collect();
        RecordBatch::try_from_iter([
            ("vec", Arc::new(vec) as ArrayRef),
            (
                "id",
                Arc::new(Int64Array::from_iter_values(
                    rows.clone().map(|r| r as i64 * 3),
                )),
            ),
            (
                "half",
                Arc::new(Float64Array::from_iter_values(
                    rows.clone().map(|r| r as f64 / 2.0),
                )),
            ),
            (
                "u",
                Arc::new(UInt32Array::from_iter_values(
                    rows.clone().map(|r| u32::MAX - r as u32),
                )),
            ),
            ("word", Arc::new(word) as ArrayRef),
            (
                "text",
                Arc::new(StringArray::from_iter_values(rows.map(|r| format!("r{r}")))),
            ),
        ])
        .unwrap()
    }

    /// The batches written as one file: row groups of 23 rows (the last shorter), pages of
    /// 5, dictionary encoding on; `statistics`: whether the footer counts nulls.
    fn file(batches: &[RecordBatch], statistics: bool) -> (Bytes, ArrowReaderMetadata) {
        let props = WriterProperties::builder()
            .set_max_row_group_row_count(Some(23))
            .set_data_page_row_count_limit(5)
            .set_write_batch_size(5)
            .set_statistics_enabled(if statistics {
                EnabledStatistics::Page
            } else {
                EnabledStatistics::None
            })
            .build();
        let mut out = Vec::new();
        let mut w = ArrowWriter::try_new(&mut out, batches[0].schema(), Some(props)).unwrap();
        for b in batches {
            w.write(b).unwrap();
        }
        w.close().unwrap();
        let bytes = Bytes::from(out);
        let options = ArrowReaderOptions::new().with_offset_index_policy(PageIndexPolicy::Optional);
        let meta = ArrowReaderMetadata::load(&bytes, options).unwrap();
        (bytes, meta)
    }

    /// Arrow's reading of column `root`, rows `start..start + len` of group `group`.
    fn arrow_reads(
        bytes: &Bytes,
        meta: &ArrowReaderMetadata,
        root: usize,
        group: usize,
        start: usize,
        len: usize,
    ) -> ArrayRef {
        let mask = parquet::arrow::ProjectionMask::roots(meta.parquet_schema(), [root]);
        let selection =
            RowSelection::from(vec![RowSelector::skip(start), RowSelector::select(len)]);
        let batches: Vec<RecordBatch> =
            ParquetRecordBatchReaderBuilder::new_with_metadata(bytes.clone(), meta.clone())
                .with_row_groups(vec![group])
                .with_projection(mask)
                .with_row_selection(selection)
                .with_batch_size(len)
                .build()
                .unwrap()
                .collect::<Result<_, _>>()
                .unwrap();
        let b = arrow_select::concat::concat_batches(&batches[0].schema(), &batches).unwrap();
        Arc::clone(b.column(0))
    }

    /// Every column that may be dense, every chunk of 7 rows (chunks start inside pages):
    /// the dense reading where the chunk has no null, equal to Arrow's value for value and
    /// type for type; `None` where it has one (with `statistics`, where its row group has
    /// one: the footer says so before any page is read). Returns (chunks read densely, given
    /// back).
    fn check(
        bytes: &Bytes,
        meta: &ArrowReaderMetadata,
        nulls_at: &[usize],
        statistics: bool,
    ) -> (usize, usize) {
        let schema = meta.parquet_schema();
        let dense: Vec<(usize, DenseColumn)> = (0..meta.schema().fields().len())
            .filter_map(|r| {
                Some((
                    r,
                    DenseColumn::new(schema, r, meta.schema().field(r).data_type())?,
                ))
            })
            .collect();
        let names: Vec<&str> = dense
            .iter()
            .map(|(r, _)| meta.schema().field(*r).name().as_str())
            .collect();
        assert_eq!(
            names,
            ["vec", "id", "half", "u"],
            "the strings are not dense"
        );
        let (mut taken, mut given_back) = (0, 0);
        let mut first = 0;
        for (g, rg) in meta.metadata().row_groups().iter().enumerate() {
            let rows = rg.num_rows() as usize;
            for start in (0..rows).step_by(7) {
                let len = 7.min(rows - start);
                for (root, d) in &dense {
                    let got = d
                        .read(bytes.clone(), meta.metadata(), g, start as u64, len as u64)
                        .unwrap();
                    let seen = if statistics {
                        first..first + rows
                    } else {
                        first + start..first + start + len
                    };
                    let has_null = *root == 0 && nulls_at.iter().any(|n| seen.contains(n));
                    match got {
                        Some(a) => {
                            assert!(
                                !has_null,
                                "group {g} rows {start}+{len}: a null read densely"
                            );
                            let want = arrow_reads(bytes, meta, *root, g, start, len);
                            assert_eq!(a.data_type(), want.data_type());
                            assert_eq!(a.to_data(), want.to_data(), "group {g} rows {start}+{len}");
                            taken += 1;
                        }
                        None => {
                            assert!(has_null, "group {g} rows {start}+{len} of column {root}");
                            given_back += 1;
                        }
                    }
                }
            }
            first += rows;
        }
        (taken, given_back)
    }

    #[test]
    fn chunks_without_nulls_read_densely_as_arrow_reads_them_and_others_are_given_back() {
        // 100 rows: groups of 23, 23, 23, 23, 8; a whole list null at 30, an element null
        // at 61 and 62.
        let batches = [batch(0, 57, &[30], &[]), batch(57, 43, &[], &[61, 62])];
        for statistics in [true, false] {
            let (bytes, meta) = file(&batches, statistics);
            let sizes: Vec<i64> = meta
                .metadata()
                .row_groups()
                .iter()
                .map(|g| g.num_rows())
                .collect();
            assert_eq!(sizes, [23, 23, 23, 23, 8]);
            let (taken, given_back) = check(&bytes, &meta, &[30, 61, 62], statistics);
            // 4 groups of 4 chunks and one of 2, 4 columns; 2 chunks of `vec` hold a null,
            // 2 of its row groups (of 4 chunks each).
            let back = if statistics { 8 } else { 2 };
            assert_eq!(
                (taken, given_back),
                (18 * 4 - back, back),
                "statistics: {statistics}"
            );
        }
    }

    #[test]
    fn types_arrow_converts_are_not_dense() {
        let schema = arrow_schema::Schema::new(vec![
            arrow_schema::Field::new("small", DataType::Int16, false),
            arrow_schema::Field::new("day", DataType::Date64, false),
            arrow_schema::Field::new("half", DataType::Float16, false),
            arrow_schema::Field::new(
                "when",
                DataType::Timestamp(arrow_schema::TimeUnit::Millisecond, None),
                false,
            ),
        ]);
        let descr = parquet::arrow::ArrowSchemaConverter::new()
            .convert(&schema)
            .unwrap();
        for (r, f) in schema.fields().iter().enumerate() {
            assert!(
                DenseColumn::new(&descr, r, f.data_type()).is_none(),
                "{}",
                f.name()
            );
        }
    }
}
