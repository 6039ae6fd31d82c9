//! Tables (benches/RESULTS.md, "Parquet and Arrow"): the decode rate of a Parquet chunk (a
//! text column; an int/float column set), a chunk late in a large row group against the first
//! (pages skipped), the decode rate of a chunk of `f32[1024]` vectors and an i64 label (the
//! hub's numeric layout: dictionary-encoded as the device runs' data, and plain as pyarrow
//! writes values too varied for a dictionary), and an Arrow IPC sample's get + copy against
//! the same data as `.npy`.
//!
//! `cargo bench --bench table_read`. The files are written once into `target/table-bench/`
//! (kept, so that `crates/bench/scripts/table_pyarrow.py` times pyarrow's `read_table` on the
//! same files).

use std::hint::black_box;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use arrow_array::types::{Float32Type, Int32Type};
use arrow_array::{
    ArrayRef, FixedSizeListArray, Float32Array, Float64Array, Int64Array, ListArray, RecordBatch,
    StringArray,
};
use criterion::{Criterion, Throughput, criterion_group, criterion_main};
use gpufeed::Dataset;
use gpufeed::source::table::{TableOptions, arrow, parquet};

const ROWS: usize = 1 << 20;
const CHUNK: u64 = 65_536;
const DIM: usize = 64;

fn dir() -> PathBuf {
    let d = Path::new(env!("CARGO_MANIFEST_DIR")).join("target/table-bench");
    std::fs::create_dir_all(&d).unwrap();
    d
}

fn text(i: usize) -> String {
    // 40 to 250 bytes of words from a vocabulary of 4,096, each row its own (as web text: a
    // dictionary does not hold them).
    let mut h = (i as u64).wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    let mut out = format!("{i}");
    for _ in 0..8 + i % 25 {
        h ^= h << 13;
        h ^= h >> 7;
        h ^= h << 17;
        out.push_str(&format!(" w{:x}", h % 4096));
    }
    out
}

/// One row group of ROWS rows (as pyarrow writes up to 1 Mi rows), snappy; with a page index
/// (arrow-rs's default) unless the name says `noindex` (pyarrow's default).
fn write(path: &Path, batch: RecordBatch) {
    use ::parquet::file::properties::{EnabledStatistics, WriterProperties};
    if path.exists() {
        return;
    }
    let noindex = path.to_string_lossy().contains("noindex");
    let props = WriterProperties::builder()
        .set_max_row_group_row_count(Some(ROWS))
        .set_compression(::parquet::basic::Compression::SNAPPY)
        .set_offset_index_disabled(noindex)
        .set_statistics_enabled(if noindex {
            EnabledStatistics::Chunk
        } else {
            EnabledStatistics::Page
        })
        .build();
    let mut w = ::parquet::arrow::ArrowWriter::try_new(
        std::fs::File::create(path).unwrap(),
        batch.schema(),
        Some(props),
    )
    .unwrap();
    w.write(&batch).unwrap();
    w.close().unwrap();
}

fn files() -> Vec<(&'static str, PathBuf)> {
    let d = dir();
    let t: ArrayRef = Arc::new(StringArray::from_iter_values((0..ROWS).map(text)));
    let id: ArrayRef = Arc::new(Int64Array::from_iter_values(0..ROWS as i64));
    let x: ArrayRef = Arc::new(Float32Array::from_iter_values(
        (0..ROWS).map(|i| i as f32 * 0.5),
    ));
    let y: ArrayRef = Arc::new(Float64Array::from_iter_values(
        (0..ROWS).map(|i| i as f64 / 3.0),
    ));
    let tokens: ArrayRef = Arc::new(ListArray::from_iter_primitive::<Int32Type, _, _>(
        (0..ROWS).map(|i| {
            Some(
                (0..i % 16)
                    .map(|k| Some((i + k) as i32))
                    .collect::<Vec<_>>(),
            )
        }),
    ));
    let out = vec![
        ("text", d.join("text.parquet"), vec![("text", t.clone())]),
        (
            "int_float",
            d.join("numbers.parquet"),
            vec![("id", id), ("x", x), ("y", y)],
        ),
        (
            "list",
            d.join("tokens.parquet"),
            vec![("tokens", tokens.clone())],
        ),
        (
            "text_noindex",
            d.join("text_noindex.parquet"),
            vec![("text", t)],
        ),
        (
            "list_noindex",
            d.join("tokens_noindex.parquet"),
            vec![("tokens", tokens)],
        ),
    ];
    out.into_iter()
        .map(|(name, path, cols)| {
            write(&path, RecordBatch::try_from_iter(cols).unwrap());
            (name, path)
        })
        .collect()
}

fn decode_rates(c: &mut Criterion) {
    let files = files();
    let mut g = c.benchmark_group("parquet_chunk");
    g.sample_size(10);
    for (name, path) in &files {
        // A cache of one chunk: every get of another chunk decodes it.
        let options = TableOptions {
            chunk_rows: Some(CHUNK),
            cache_bytes: Some(0),
            ..TableOptions::default()
        };
        let d = parquet::open(path, &options).unwrap();
        // Decoded bytes of a chunk: the records' bytes, what the samples read.
        let bytes: u64 = (0..CHUNK)
            .map(|i| d.get(i).unwrap().bytes().unwrap().len() as u64)
            .sum();
        g.throughput(Throughput::Elements(CHUNK * 2));
        for (which, chunk) in [("first", 0u64), ("late", ROWS as u64 / CHUNK - 1)] {
            let other = if chunk == 0 { 1 } else { 0 };
            g.bench_function(format!("{name}/{which}"), |b| {
                b.iter(|| {
                    // Alternate with another chunk so that each get decodes.
                    black_box(d.get(other * CHUNK).unwrap().field(0).map(<[u8]>::len));
                    black_box(d.get(chunk * CHUNK).unwrap().field(0).map(<[u8]>::len));
                })
            });
        }
        println!(
            "{name}: {bytes} bytes of records per chunk of {CHUNK} rows, {} bytes uncompressed in the footer per chunk; two chunks per iteration",
            d.describe().files[0].uncompressed_bytes.unwrap() / (ROWS as u64 / CHUNK)
        );
    }
    g.finish();
}

fn ipc_against_npy(c: &mut Criterion) {
    let d = dir();
    let n = 65_536usize;
    let values: Vec<f32> = (0..n * DIM).map(|i| i as f32).collect();
    let ipc = d.join("rows.arrow");
    if !ipc.exists() {
        let list = FixedSizeListArray::from_iter_primitive::<Float32Type, _, _>(
            values
                .chunks(DIM)
                .map(|r| Some(r.iter().copied().map(Some).collect::<Vec<_>>())),
            DIM as i32,
        );
        let batch = RecordBatch::try_from_iter([("x", Arc::new(list) as ArrayRef)]).unwrap();
        let mut w = arrow_ipc::writer::StreamWriter::try_new(
            std::fs::File::create(&ipc).unwrap(),
            &batch.schema(),
        )
        .unwrap();
        for k in 0..8 {
            w.write(&batch.slice(k * n / 8, n / 8)).unwrap();
        }
        w.finish().unwrap();
    }
    let npy = d.join("rows.npy");
    if !npy.exists() {
        let mut b =
            gpufeed::source::npy_header(gpufeed::DType::F32, &[n as u64, DIM as u64]).unwrap();
        b.extend(values.iter().flat_map(|v| v.to_le_bytes()));
        std::fs::write(&npy, b).unwrap();
    }
    let a = arrow::open(&ipc, &TableOptions::default()).unwrap();
    let p = gpufeed::NpyArray::open(&npy).unwrap();
    let mut slot = vec![0u8; DIM * 4];
    let mut g = c.benchmark_group("get_copy");
    g.throughput(Throughput::Bytes((n * DIM * 4) as u64));
    g.sample_size(10);
    for (name, ds) in [
        ("arrow_ipc", &a as &dyn Dataset),
        ("npy", &p as &dyn Dataset),
    ] {
        // The first pass makes the IPC batches' arrays (once per batch); then in place.
        for i in 0..n as u64 {
            ds.get(i).unwrap();
        }
        g.bench_function(name, |b| {
            b.iter(|| {
                for i in 0..n as u64 {
                    ds.get(i).unwrap().copy_field_into(0, &mut slot).unwrap();
                }
                black_box(&slot);
            })
        });
    }
    g.finish();
}

/// Rows of the vector files: 128 MiB of `f32[1024]`, one row group (pyarrow writes up to
/// 1 Mi rows a group).
const VECTOR_ROWS: usize = 32_768;
const VECTOR_DIM: usize = 1024;

/// A file of `VECTOR_ROWS` rows of an `x` column of `f32[VECTOR_DIM]` (a nullable fixed-size
/// list of nullable floats, as pyarrow and arrow-rs write `list_(float32(), 1024)`) and an i64
/// `label`, snappy. `dictionary`: arrow-rs's default encoding over values of few distinct
/// floats (what `hub_tables numbers` writes for the device runs); else plain over varied
/// values (what pyarrow falls back to once a dictionary page outgrows 1 MiB).
fn vectors(path: &Path, dictionary: bool) {
    use ::parquet::file::properties::WriterProperties;
    if path.exists() {
        return;
    }
    let props = WriterProperties::builder()
        .set_max_row_group_row_count(Some(VECTOR_ROWS))
        .set_compression(::parquet::basic::Compression::SNAPPY)
        .set_dictionary_enabled(dictionary)
        .build();
    let mut w = None;
    let step = 4096;
    for start in (0..VECTOR_ROWS).step_by(step) {
        let rows = start..start + step;
        let x = FixedSizeListArray::from_iter_primitive::<Float32Type, _, _>(
            rows.clone().map(|r| {
                Some((0..VECTOR_DIM).map(move |k| {
                    Some(if dictionary {
                        ((r * 31 + k * 7) % 4093) as f32 * 0.25
                    } else {
                        (r * VECTOR_DIM + k) as f32 * 0.37
                    })
                }))
            }),
            VECTOR_DIM as i32,
        );
        let label = Int64Array::from_iter_values(rows.map(|r| (r % 1000) as i64));
        let batch = RecordBatch::try_from_iter([
            ("x", Arc::new(x) as ArrayRef),
            ("label", Arc::new(label) as ArrayRef),
        ])
        .unwrap();
        w.get_or_insert_with(|| {
            ::parquet::arrow::ArrowWriter::try_new(
                std::fs::File::create(path).unwrap(),
                batch.schema(),
                Some(props.clone()),
            )
            .unwrap()
        })
        .write(&batch)
        .unwrap();
    }
    w.unwrap().close().unwrap();
}

/// The decode of one chunk of vectors (the default chunk: about 4 MiB decoded), in bytes of
/// rows a second on one core: the first chunk of the row group and a late one.
fn vector_decode(c: &mut Criterion) {
    let d = dir();
    let mut g = c.benchmark_group("parquet_vectors");
    g.sample_size(10);
    for (name, dictionary) in [("dictionary", true), ("plain", false)] {
        let path = d.join(format!("vectors_{name}.parquet"));
        vectors(&path, dictionary);
        // A cache of one chunk: every get of another chunk decodes it.
        let options = TableOptions {
            cache_bytes: Some(0),
            ..TableOptions::default()
        };
        let ds = parquet::open(&path, &options).unwrap();
        let chunks: Vec<u64> = ds.chunks().map(|(.., rows)| rows).collect();
        let rows = chunks[0];
        let row_bytes = (VECTOR_DIM * 4 + 8) as u64;
        g.throughput(Throughput::Bytes(rows * row_bytes));
        let late: u64 = chunks[..chunks.len() - 1].iter().sum();
        for (which, first_row) in [("first", 0u64), ("late", late)] {
            let mut flip = false;
            g.bench_function(format!("{name}/{which}"), |b| {
                b.iter(|| {
                    // Alternate with another chunk so that each get decodes one chunk.
                    flip = !flip;
                    let row = if flip { first_row } else { rows };
                    black_box(ds.get(row).unwrap().field(0).map(<[u8]>::len));
                })
            });
        }
        println!(
            "vectors_{name}: {} chunks of {rows} rows ({} bytes of rows each)",
            chunks.len(),
            rows * row_bytes
        );
    }
    g.finish();
}

criterion_group!(benches, decode_rates, vector_decode, ipc_against_npy);
criterion_main!(benches);
