//! A mutation fuzzer for the two parsers of untrusted bytes: the packed file reader and the
//! `.npy` header parser.
//!
//! Valid files are mutated (bit flips, byte writes, truncations, random `u64`s written into the
//! offset table, checksum table and footer, sometimes with the footer checksum re-sealed so the
//! mutation gets past it), then opened, read record by record and verified. The property is
//! that nothing panics: every call returns either a value that stays inside the file or an
//! `Error`. The number of cases is proptest's default (256) unless `PROPTEST_CASES` says more;
//! `PROPTEST_CASES=200000 cargo test --release --test format_fuzz` is the long run.

use std::path::Path;
use std::sync::OnceLock;

use gpufeed::format::{
    Codec, DType, Field, ReadMode, ReadOptions, RecordFile, RecordWriter, Schema,
};
use gpufeed::source::npy_header;
use gpufeed::{Dataset, NpyArray};
use proptest::prelude::*;

/// Valid packed files to start from: fixed fields, variable fields, and an empty one.
fn seeds() -> &'static [Vec<u8>] {
    static SEEDS: OnceLock<Vec<Vec<u8>>> = OnceLock::new();
    SEEDS.get_or_init(|| {
        let dir = tempfile::tempdir().unwrap();
        let mut out = Vec::new();
        let fixed = Schema::new(vec![
            Field::tensor("data", DType::U8, &[3, 5]),
            Field::tensor("label", DType::F64, &[]),
        ])
        .unwrap();
        let var = Schema::new(vec![
            Field::tensor("label", DType::U16, &[2]),
            Field::bytes("jpeg", Codec::Jpeg),
            Field::bytes("text", Codec::Utf8),
        ])
        .unwrap();
        let p = dir.path().join("f");
        let mut w = RecordWriter::create(&p, fixed.clone()).unwrap();
        for i in 0..9u8 {
            w.append(&[&[i; 15], &f64::from(i).to_le_bytes()]).unwrap();
        }
        w.finish().unwrap();
        out.push(std::fs::read(&p).unwrap());
        let mut w = RecordWriter::create(&p, var).unwrap();
        for i in 0..7u8 {
            w.append(&[&[i; 4], &vec![i; i as usize * 5], b"hi"])
                .unwrap();
        }
        w.finish().unwrap();
        out.push(std::fs::read(&p).unwrap());
        let w = RecordWriter::create(&p, fixed).unwrap();
        w.finish().unwrap();
        out.push(std::fs::read(&p).unwrap());
        out
    })
}

#[derive(Clone, Debug)]
enum Mutation {
    /// Flip one bit at a position (taken modulo the length).
    Flip(usize, u8),
    /// Overwrite one byte.
    Byte(usize, u8),
    /// Cut the file to this length (modulo its length).
    Truncate(usize),
    /// Write a u64 into the tables and footer (the last part of the file), 8-byte aligned or not.
    TailU64 { back: usize, value: u64 },
    /// Write a u64 into one of the footer's fields.
    FooterField { field: usize, value: u64 },
    /// Append bytes.
    Append(Vec<u8>),
    /// Move offset table entry `entry` (modulo the table) by `by` record alignments (8 bytes):
    /// still aligned, often still increasing; what the stride check is for.
    MoveOffset { entry: usize, by: i8 },
}

fn interesting_u64() -> impl Strategy<Value = u64> {
    prop_oneof![
        any::<u64>(),
        0u64..4096,
        Just(u64::MAX),
        Just(u64::MAX - 7),
        Just(1 << 63),
        Just(u32::MAX as u64),
    ]
}

fn mutation() -> impl Strategy<Value = Mutation> {
    prop_oneof![
        (any::<usize>(), 0u8..8).prop_map(|(p, b)| Mutation::Flip(p, b)),
        (any::<usize>(), any::<u8>()).prop_map(|(p, b)| Mutation::Byte(p, b)),
        any::<usize>().prop_map(Mutation::Truncate),
        (0usize..400, interesting_u64())
            .prop_map(|(back, value)| Mutation::TailU64 { back, value }),
        (0usize..7, interesting_u64())
            .prop_map(|(field, value)| Mutation::FooterField { field, value }),
        proptest::collection::vec(any::<u8>(), 1..70).prop_map(Mutation::Append),
        (any::<usize>(), -8i8..8).prop_map(|(entry, by)| Mutation::MoveOffset { entry, by }),
    ]
}

fn apply(b: &mut Vec<u8>, m: &Mutation) {
    if b.is_empty() {
        return;
    }
    let n = b.len();
    match m {
        Mutation::Flip(p, bit) => b[p % n] ^= 1 << bit,
        Mutation::Byte(p, v) => b[p % n] = *v,
        Mutation::Truncate(len) => b.truncate(len % n),
        Mutation::TailU64 { back, value } => {
            if n >= back + 8 {
                let at = n - back - 8;
                b[at..at + 8].copy_from_slice(&value.to_le_bytes());
            }
        }
        Mutation::FooterField { field, value } => {
            if n >= 64 {
                let at = n - 64 + 8 + 8 * field;
                b[at..at + 8].copy_from_slice(&value.to_le_bytes());
            }
        }
        Mutation::Append(extra) => b.extend_from_slice(extra),
        Mutation::MoveOffset { entry, by } => {
            if n < 128 {
                return;
            }
            let u = |b: &[u8], at: usize| u64::from_le_bytes(b[at..at + 8].try_into().unwrap());
            let (records, table) = (u(b, n - 56), u(b, n - 24));
            let Some(at) = records
                .checked_add(1)
                .map(|entries| table.wrapping_add((*entry as u64 % entries).wrapping_mul(8)))
                .and_then(|at| usize::try_from(at).ok())
                .filter(|&at| at.checked_add(8).is_some_and(|end| end <= n))
            else {
                return;
            };
            let moved = u(b, at).wrapping_add_signed(8 * i64::from(*by));
            b[at..at + 8].copy_from_slice(&moved.to_le_bytes());
        }
    }
}

/// Recomputes the footer checksum, if the footer names a schema range inside the file.
fn reseal(b: &mut [u8]) {
    if b.len() < 128 {
        return;
    }
    let f = b.len() - 64;
    let u = |at: usize| u64::from_le_bytes(b[at..at + 8].try_into().unwrap());
    let (so, sl) = (u(f + 24), u(f + 32));
    let Some(end) = so.checked_add(sl).filter(|&e| e <= b.len() as u64) else {
        return;
    };
    let mut h = xxhash_rust::xxh3::Xxh3::new();
    h.update(&b[..64]);
    h.update(&b[so as usize..end as usize]);
    h.update(&b[f..f + 56]);
    let sum = h.digest();
    b[f + 56..f + 64].copy_from_slice(&sum.to_le_bytes());
}

/// What one read gave: the bytes of every field, or the error's message.
type Outcome = Result<Vec<Vec<u8>>, String>;

/// Everything a packed file says, read every way there is: open, every record (`get` and its
/// fields, `copy_field_into` for fixed-size fields, `get_bytes`, `verify_record`), `verify`.
/// Panics only on a reader bug; returns the outcomes, to compare between read modes.
fn exercise_packed_with(path: &Path, len: usize, options: ReadOptions) -> Vec<Outcome> {
    let f = match RecordFile::open_with(path, options) {
        Ok(f) => f,
        Err(e) => return vec![Err(e.to_string())],
    };
    assert!(f.file_bytes() == len as u64);
    assert!(f.check_unchanged().is_ok());
    let n = f.len();
    let fields = f.schema().fields().len();
    let idx = (0..n.min(64)).chain([n.saturating_sub(1), n, n + 1, u64::MAX]);
    let mut out = Vec::new();
    for i in idx {
        out.push(match f.get(i) {
            Ok(s) => {
                assert!(s.len() as u64 <= f.data_bytes());
                if let Some(stride) = f.stride() {
                    assert_eq!(s.len() as u64, stride, "record {i} is not one stride");
                }
                let mut got = vec![s.bytes().unwrap().to_vec()];
                for k in 0..=fields {
                    if let Some(v) = s.field(k) {
                        assert!(v.len() <= s.len());
                        if f.schema().is_fixed() {
                            let mut slot = vec![0u8; v.len()];
                            f.get(i).unwrap().copy_field_into(k, &mut slot).unwrap();
                            assert_eq!(slot, v);
                        }
                        got.push(v.to_vec());
                    }
                }
                Ok(got)
            }
            Err(e) => Err(e.to_string()),
        });
        out.push(match f.get_bytes(i) {
            Ok(b) => {
                assert!(b.len() as u64 <= f.data_bytes());
                Ok(vec![b.to_vec()])
            }
            Err(e) => Err(e.to_string()),
        });
        out.push(
            f.verify_record(i)
                .map(|()| Vec::new())
                .map_err(|e| e.to_string()),
        );
    }
    out.push(
        f.verify(|_| {})
            .map(|()| Vec::new())
            .map_err(|e| e.to_string()),
    );
    let _ = format!("{f:?} {}", f.schema());
    out
}

/// Reads a (possibly broken) packed file with and without checksums, mapped and with `pread`:
/// the two modes must give the same bytes and the same errors.
fn exercise_packed(path: &Path, len: usize) {
    for verify_checksums in [false, true] {
        let [map, pread] = [ReadMode::Map, ReadMode::Pread].map(|mode| {
            exercise_packed_with(
                path,
                len,
                ReadOptions {
                    mode,
                    verify_checksums,
                },
            )
        });
        assert_eq!(map, pread, "the read modes disagree");
    }
    if let Ok(d) = gpufeed::source::open(path, &Default::default()) {
        let _ = d.get(0);
    }
}

fn exercise_npy(path: &Path) {
    let outcomes = [ReadMode::Map, ReadMode::Pread].map(|mode| {
        let a = match NpyArray::open_with(path, "data", mode) {
            Ok(a) => a,
            Err(e) => return vec![Err(e.to_string())],
        };
        let n = a.len();
        let mut out: Vec<Outcome> = Vec::new();
        for i in (0..n.min(16)).chain([n.saturating_sub(1), n, u64::MAX]) {
            out.push(match a.get(i) {
                Ok(s) => {
                    assert!(a.row_bytes() > 0);
                    assert_eq!(s.len(), a.row_bytes());
                    let v = s.field(0).unwrap().to_vec();
                    assert_eq!(v.len(), a.row_bytes());
                    let mut slot = vec![0u8; v.len()];
                    a.get(i).unwrap().copy_field_into(0, &mut slot).unwrap();
                    assert_eq!(slot, v);
                    Ok(vec![v])
                }
                Err(e) => Err(e.to_string()),
            });
        }
        out
    });
    assert_eq!(outcomes[0], outcomes[1], "the read modes disagree");
    if let Ok(d) = gpufeed::source::open(path, &Default::default()) {
        let _ = d.get(0);
    }
}

proptest! {
    #[test]
    fn mutated_packed_files_never_panic(
        seed in 0usize..3,
        mutations in proptest::collection::vec(mutation(), 1..5),
        reseal_after in any::<bool>(),
    ) {
        let mut b = seeds()[seed].clone();
        for m in &mutations {
            apply(&mut b, m);
        }
        if reseal_after {
            reseal(&mut b);
        }
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("m.gfd");
        std::fs::write(&path, &b).unwrap();
        exercise_packed(&path, b.len());
    }

    #[test]
    fn mutated_npy_files_never_panic(
        dtype in proptest::sample::select(vec![DType::U8, DType::F32, DType::I64, DType::Bool, DType::U16]),
        shape in proptest::collection::vec(0u64..6, 1..4),
        edits in proptest::collection::vec((any::<usize>(), any::<u8>()), 0..4),
        cut in proptest::option::of(any::<usize>()),
        text in proptest::option::of("[{}()\\[\\]'\":,<|>a-zA-Z0-9_ .]{0,80}"),
    ) {
        let mut b = npy_header(dtype, &shape).unwrap();
        let rows: u64 = shape.iter().product::<u64>() * dtype.size() as u64;
        b.extend(std::iter::repeat_n(0xabu8, rows as usize));
        if let Some(t) = text {
            // Replace the header dictionary with arbitrary literal-ish text.
            let mut h = b"\x93NUMPY\x01\x00".to_vec();
            h.extend_from_slice(&(t.len() as u16).to_le_bytes());
            h.extend_from_slice(t.as_bytes());
            h.extend_from_slice(&[0u8; 32]);
            b = h;
        }
        let n = b.len();
        for (p, v) in edits {
            b[p % n] = v;
        }
        if let Some(c) = cut {
            b.truncate(c % (n + 1));
        }
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("m.npy");
        std::fs::write(&path, &b).unwrap();
        exercise_npy(&path);
    }
}

#[test]
fn seeds_are_valid() {
    let dir = tempfile::tempdir().unwrap();
    for (k, s) in seeds().iter().enumerate() {
        let p = dir.path().join(format!("{k}"));
        std::fs::write(&p, s).unwrap();
        let f = RecordFile::open(&p).unwrap();
        f.verify(|_| {}).unwrap();
    }
}
