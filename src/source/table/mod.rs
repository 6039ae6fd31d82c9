//! Data sets that are tables, rows of named fields, as the Hugging Face hub and `datasets`
//! ship them: here, JSON lines ([`jsonl`]: `.jsonl`, `.jsonl.gz`, `.jsonl.zst`, and `.json`
//! files of one object per line).

mod files;
pub mod jsonl;

pub use jsonl::{
    JsonLines, JsonLinesFieldSummary, JsonLinesFileSummary, JsonLinesOptions, JsonLinesSummary,
    is_json_lines,
};
