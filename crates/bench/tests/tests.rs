//! gpufeed-bench's tests (the GPU ones are `tests/cuda.rs`).

#[path = "../../../tests/image_common/mod.rs"]
mod image_common;

mod baseline;
mod images;
