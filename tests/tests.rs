//! The library's integration tests: one binary (ripgrep's `tests/tests.rs` shape) instead of
//! one per file, each linking the whole crate. The GPU tests are `tests/cuda.rs`.

mod image_common;
mod table_common;
mod tar_common;
mod token_common;

mod batch_parts;
mod file_changes;
mod format_errors;
mod format_fuzz;
mod format_roundtrip;
mod format_writer;
mod image_decode;
mod image_fuzz;
mod image_pipeline;
mod jsonl;
mod jsonl_errors;
mod loader;
mod loader_timeout;
mod npy_errors;
mod ragged;
mod read_modes;
mod remote_local;
mod remote_s3;
#[cfg(feature = "s3")]
mod s3_common;
mod shard_compressed;
mod shard_decode;
mod shard_errors;
mod shard_fixtures;
mod shard_fuzz;
mod table_arrow;
mod table_errors;
mod table_parquet;
mod token_checks;
mod token_text;
mod tokens;
mod trace;
mod typed_transforms;
mod verdict;
mod zip_sources;
