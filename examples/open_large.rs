//! Opens a packed file of 100M records and reads its first and last record: O(1) in the data size.
//!
//! ```text
//! cargo run --release --example open_large -- [PATH] [--keep]
//! ```
//!
//! Writes `PATH` (default: `$TMPDIR/gpufeed-open-large.gfd`) if it is missing: 100,000,000
//! records of one `u32` label, about 2.4 GB. Then times `RecordFile::open`, `get(0)` and
//! `get(99_999_999)` (several times: the first open pays for page faults, later ones show the
//! warm cost), and deletes the file unless `--keep` is given.

use std::path::PathBuf;
use std::time::Instant;

use gpufeed::format::{DType, Field, RecordFile, RecordWriter, Schema};

const RECORDS: u64 = 100_000_000;

fn main() -> gpufeed::Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let keep = args.iter().any(|a| a == "--keep");
    let path = args
        .iter()
        .find(|a| !a.starts_with("--"))
        .map(PathBuf::from)
        .unwrap_or_else(|| std::env::temp_dir().join("gpufeed-open-large.gfd"));
    if !path.exists() {
        let t = Instant::now();
        let schema = Schema::new(vec![Field::tensor("label", DType::U32, &[])])?;
        let mut w = RecordWriter::create(&path, schema)?;
        for i in 0..RECORDS {
            w.append(&[&(i as u32).to_le_bytes()])?;
        }
        let s = w.finish()?;
        println!(
            "wrote {} records, {} bytes, in {:.1} s",
            s.records,
            s.file_bytes,
            t.elapsed().as_secs_f64()
        );
    }
    for round in 0..3 {
        let t = Instant::now();
        let f = RecordFile::open(&path)?;
        let opened = t.elapsed();
        let first = f.get(0)?.field(0).map(<[u8]>::to_vec);
        let t_first = t.elapsed();
        let last = f.get(RECORDS - 1)?.field(0).map(<[u8]>::to_vec);
        let t_last = t.elapsed();
        assert_eq!(first, Some(0u32.to_le_bytes().to_vec()));
        assert_eq!(last, Some(((RECORDS - 1) as u32).to_le_bytes().to_vec()));
        println!(
            "round {round}: {} records, {} bytes: open {:.1} us, open+get(0) {:.1} us, +get({}) {:.1} us",
            f.len(),
            f.file_bytes(),
            opened.as_secs_f64() * 1e6,
            t_first.as_secs_f64() * 1e6,
            RECORDS - 1,
            t_last.as_secs_f64() * 1e6,
        );
    }
    if !keep {
        std::fs::remove_file(&path).map_err(|e| gpufeed::Error::Io {
            path: path.clone(),
            op: "remove",
            source: e,
        })?;
    }
    Ok(())
}
