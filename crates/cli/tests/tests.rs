//! The command's tests: they run the built `gpufeed` (`CARGO_BIN_EXE_gpufeed`, or the binary
//! named by `GPUFEED_BIN`, as on the GPU machine), in one test binary.

mod cli_common;
#[path = "../../../tests/image_common/mod.rs"]
mod image_common;
#[path = "../../../tests/table_common/mod.rs"]
mod table_common;
#[path = "../../../tests/token_common/mod.rs"]
mod token_common;

mod cli_bench;
mod cli_merge;
mod cli_pack_inspect;
mod cli_pack_safety;
mod cli_remote;
mod cli_shards;
mod cli_tables;
mod cli_tokenize;
mod cli_tokens;
#[cfg(feature = "s3")]
#[path = "../../../tests/s3_common/mod.rs"]
mod s3_common;
