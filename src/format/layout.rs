//! The fixed parts of a packed record file: header and footer, byte by byte.
//!
//! `docs/FORMAT.md` is the specification; this module is its one implementation. It encodes and
//! decodes the two 64-byte blocks and checks that the regions they name fit the file. It never
//! touches record data.

use xxhash_rust::xxh3::xxh3_64;

/// The first 8 bytes of every packed record file.
pub const MAGIC: [u8; 8] = *b"GPUFEED\0";
/// The first 8 bytes of the footer, the last 64 bytes of a finished file.
pub const FOOTER_MAGIC: [u8; 8] = *b"GPUFEND\0";
/// The major version this crate writes and reads; a newer major version is refused.
pub const VERSION_MAJOR: u16 = 1;
/// The minor version this crate writes; older readers of the same major version can read it.
pub const VERSION_MINOR: u16 = 0;
/// Size of the header and of the footer.
pub const BLOCK: usize = 64;

/// The header: the first 64 bytes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Header {
    pub major: u16,
    pub minor: u16,
    /// Every record starts at a multiple of this (a power of two, 8 to 4096).
    pub record_align: u32,
    /// Where the first record starts.
    pub data_offset: u64,
}

impl Header {
    pub fn encode(&self) -> [u8; BLOCK] {
        let mut b = [0u8; BLOCK];
        b[0..8].copy_from_slice(&MAGIC);
        b[8..10].copy_from_slice(&self.major.to_le_bytes());
        b[10..12].copy_from_slice(&self.minor.to_le_bytes());
        b[12..16].copy_from_slice(&self.record_align.to_le_bytes());
        b[16..24].copy_from_slice(&self.data_offset.to_le_bytes());
        b
    }

    /// Decodes the header; the version is returned as it is, for the caller to judge.
    pub fn decode(b: &[u8]) -> Result<Header, String> {
        if b.len() < BLOCK {
            return Err(format!(
                "{} bytes is too short for the {BLOCK}-byte header",
                b.len()
            ));
        }
        if b[0..8] != MAGIC {
            return Err(format!(
                "bad magic {:02x?} (expected {:02x?}, \"GPUFEED\\0\")",
                &b[0..8],
                MAGIC
            ));
        }
        Ok(Header {
            major: u16_at(b, 8),
            minor: u16_at(b, 10),
            record_align: u32_at(b, 12),
            data_offset: u64_at(b, 16),
        })
    }
}

/// The footer: the last 64 bytes, written last, so that an unfinished file has none.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Footer {
    pub records: u64,
    pub data_end: u64,
    pub schema_offset: u64,
    pub schema_len: u64,
    pub offsets_offset: u64,
    pub checksums_offset: u64,
}

impl Footer {
    /// Encodes the footer; its last 8 bytes are the xxh3-64 of the header, the schema block and
    /// the footer's first 56 bytes.
    pub fn encode(&self, header: &[u8; BLOCK], schema: &[u8]) -> [u8; BLOCK] {
        let mut b = [0u8; BLOCK];
        b[0..8].copy_from_slice(&FOOTER_MAGIC);
        b[8..16].copy_from_slice(&self.records.to_le_bytes());
        b[16..24].copy_from_slice(&self.data_end.to_le_bytes());
        b[24..32].copy_from_slice(&self.schema_offset.to_le_bytes());
        b[32..40].copy_from_slice(&self.schema_len.to_le_bytes());
        b[40..48].copy_from_slice(&self.offsets_offset.to_le_bytes());
        b[48..56].copy_from_slice(&self.checksums_offset.to_le_bytes());
        let sum = footer_checksum(header, schema, &b[..56]);
        b[56..64].copy_from_slice(&sum.to_le_bytes());
        b
    }

    /// Decodes the footer `b` (the last 64 bytes of a `file_len`-byte file) and checks that the
    /// regions it names are laid out in order and inside the file. Its checksum is checked by
    /// [`Footer::check_sum`], once the caller has read the schema block.
    pub fn decode(b: &[u8], file_len: u64, header: &Header) -> Result<Footer, String> {
        if b.len() != BLOCK || file_len < 2 * BLOCK as u64 {
            return Err(format!("{} bytes is not a {BLOCK}-byte footer", b.len()));
        }
        if b[0..8] != FOOTER_MAGIC {
            return Err(
                "no footer: the file is truncated or was not finished by its writer".into(),
            );
        }
        let f = Footer {
            records: u64_at(b, 8),
            data_end: u64_at(b, 16),
            schema_offset: u64_at(b, 24),
            schema_len: u64_at(b, 32),
            offsets_offset: u64_at(b, 40),
            checksums_offset: u64_at(b, 48),
        };
        let footer_at = file_len - BLOCK as u64;
        let schema_end = f
            .schema_offset
            .checked_add(f.schema_len)
            .ok_or("schema region overflows")?;
        let offsets_len = f
            .records
            .checked_add(1)
            .and_then(|n| n.checked_mul(8))
            .ok_or("record count overflows the offset table")?;
        let checks_len = f
            .records
            .checked_mul(8)
            .ok_or("record count overflows the checksum table")?;
        let regions = [
            ("header", 0, BLOCK as u64),
            ("data", header.data_offset, f.data_end),
            ("schema", f.schema_offset, schema_end),
            (
                "offset table",
                f.offsets_offset,
                f.offsets_offset.saturating_add(offsets_len),
            ),
            (
                "checksum table",
                f.checksums_offset,
                f.checksums_offset.saturating_add(checks_len),
            ),
        ];
        let mut prev_end = 0u64;
        let mut prev_name = "start of file";
        for (name, start, end) in regions {
            if start < prev_end || end < start {
                return Err(format!(
                    "{name} region {start}..{end} overlaps or precedes the {prev_name} (which ends at {prev_end})"
                ));
            }
            prev_end = end;
            prev_name = name;
        }
        if prev_end > footer_at {
            return Err(format!(
                "the tables end at byte {prev_end}, past the footer at {footer_at}: the file is truncated"
            ));
        }
        if !f.offsets_offset.is_multiple_of(8) || !f.checksums_offset.is_multiple_of(8) {
            return Err("offset or checksum table is not 8-byte aligned".into());
        }
        Ok(f)
    }

    /// Checks the footer checksum stored in `b` (the footer block) against the header block
    /// and the schema block the footer names.
    pub fn check_sum(b: &[u8], header: &[u8], schema: &[u8]) -> Result<(), String> {
        let header: &[u8; BLOCK] = header.try_into().map_err(|_| "short header")?;
        if b.len() != BLOCK {
            return Err("short footer".into());
        }
        let stored = u64_at(b, 56);
        let computed = footer_checksum(header, schema, &b[..56]);
        if stored != computed {
            return Err(format!(
                "header, schema or footer is corrupt (checksum stored {stored:#018x}, computed {computed:#018x})"
            ));
        }
        Ok(())
    }
}

fn footer_checksum(header: &[u8; BLOCK], schema: &[u8], footer56: &[u8]) -> u64 {
    let mut h = xxhash_rust::xxh3::Xxh3::new();
    h.update(header);
    h.update(schema);
    h.update(footer56);
    h.digest()
}

/// The checksum of one record's bytes (padding included).
pub(crate) fn record_checksum(bytes: &[u8]) -> u64 {
    xxh3_64(bytes)
}

pub(crate) fn u16_at(b: &[u8], at: usize) -> u16 {
    u16::from_le_bytes([b[at], b[at + 1]])
}

pub(crate) fn u32_at(b: &[u8], at: usize) -> u32 {
    let mut x = [0u8; 4];
    x.copy_from_slice(&b[at..at + 4]);
    u32::from_le_bytes(x)
}

pub(crate) fn u64_at(b: &[u8], at: usize) -> u64 {
    let mut x = [0u8; 8];
    x.copy_from_slice(&b[at..at + 8]);
    u64::from_le_bytes(x)
}
