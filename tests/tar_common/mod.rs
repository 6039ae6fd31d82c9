// A tar writer for the tests and benches that build shards (included with `#[path]`, not a
// test of its own; also by `src/source/shards/tar.rs`'s unit tests and `benches/shard_read.rs`).
#![allow(dead_code)]

/// A tar archive's block.
const BLOCK: usize = 512;

/// A tar archive built in memory, for the members of a shard a test wants (or wants to
/// corrupt). Writes ustar headers (pax `path` records for names over 100 bytes).
#[derive(Default)]
pub struct TarBuilder {
    out: Vec<u8>,
}

impl TarBuilder {
    /// An empty archive.
    pub fn new() -> TarBuilder {
        TarBuilder::default()
    }

    fn header(name: &[u8], size: u64, typ: u8) -> [u8; 512] {
        let mut h = [0u8; 512];
        let n = name.len().min(100);
        h[..n].copy_from_slice(&name[..n]);
        h[100..107].copy_from_slice(b"0000644");
        h[108..115].copy_from_slice(b"0000000");
        h[116..123].copy_from_slice(b"0000000");
        let size = format!("{size:011o}");
        h[124..135].copy_from_slice(size.as_bytes());
        h[136..147].copy_from_slice(b"00000000000");
        h[156] = typ;
        h[257..263].copy_from_slice(b"ustar\0");
        h[263..265].copy_from_slice(b"00");
        h[148..156].copy_from_slice(b"        ");
        let sum: u32 = h.iter().map(|&b| u32::from(b)).sum();
        let sum = format!("{sum:06o}\0 ");
        h[148..156].copy_from_slice(sum.as_bytes());
        h
    }

    fn put(&mut self, data: &[u8]) {
        self.out.extend_from_slice(data);
        let pad = (BLOCK - data.len() % BLOCK) % BLOCK;
        self.out.extend(std::iter::repeat_n(0u8, pad));
    }

    /// Appends a member of type `typ` (`b'0'` for a file, `b'5'` for a directory).
    pub fn entry(&mut self, name: &str, typ: u8, data: &[u8]) -> &mut TarBuilder {
        if name.len() > 100 {
            let mut rec = format!(" path={name}\n");
            let mut len = rec.len();
            loop {
                let total = len + len.to_string().len();
                if total.to_string().len() == len.to_string().len() {
                    len = total;
                    break;
                }
                len += 1;
            }
            rec = format!("{len}{rec}");
            let h = TarBuilder::header(b"././@PaxHeader", rec.len() as u64, b'x');
            self.out.extend_from_slice(&h);
            self.put(rec.as_bytes());
        }
        let h = TarBuilder::header(name.as_bytes(), data.len() as u64, typ);
        self.out.extend_from_slice(&h);
        self.put(data);
        self
    }

    /// Appends a regular file.
    pub fn file(&mut self, name: &str, data: &[u8]) -> &mut TarBuilder {
        self.entry(name, b'0', data)
    }

    /// The archive, closed with two zero blocks.
    pub fn finish(&mut self) -> Vec<u8> {
        let mut out = std::mem::take(&mut self.out);
        out.extend(std::iter::repeat_n(0u8, 1024));
        out
    }
}
