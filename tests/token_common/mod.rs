//! Helpers shared by the token tests of both test binaries (the library's and the GPU's).
#![allow(dead_code)]

use std::path::Path;

/// Writes `docs` as `prefix.bin` + `prefix.idx`, one sequence per document, as
/// `IndexedDatasetBuilder.add_document` and `finalize` do (`code`: 8 uint16, 4 int32).
pub fn write_megatron(prefix: &Path, docs: &[Vec<u32>], code: u8) {
    let item: usize = if code == 8 { 2 } else { 4 };
    let mut bin = Vec::new();
    for d in docs {
        for &t in d {
            if item == 2 {
                bin.extend((t as u16).to_le_bytes());
            } else {
                bin.extend((t as i32).to_le_bytes());
            }
        }
    }
    let mut idx = b"MMIDIDX\x00\x00".to_vec();
    idx.extend(1u64.to_le_bytes());
    idx.push(code);
    idx.extend((docs.len() as u64).to_le_bytes());
    idx.extend((docs.len() as u64 + 1).to_le_bytes());
    for d in docs {
        idx.extend((d.len() as i32).to_le_bytes());
    }
    let mut ptr = 0i64;
    for d in docs {
        idx.extend(ptr.to_le_bytes());
        ptr += (d.len() * item) as i64;
    }
    for i in 0..=docs.len() as i64 {
        idx.extend(i.to_le_bytes());
    }
    std::fs::write(prefix.with_extension("bin"), bin).unwrap();
    std::fs::write(prefix.with_extension("idx"), idx).unwrap();
}
