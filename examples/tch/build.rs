//! Link arguments for the binary: libtorch registers its CUDA backend when libtorch_cuda is
//! loaded, and nothing names a symbol of it, so the linker's `--as-needed` would leave it out
//! (libtorch would then see no GPU); and libtorch_cuda's own libraries (cuDNN, NCCL, ...) are
//! resolved at run time, on the GPU machine, not here.
fn main() {
    println!("cargo:rustc-link-arg-bins=-Wl,--no-as-needed,-ltorch_cuda,--as-needed");
    println!("cargo:rustc-link-arg-bins=-Wl,--allow-shlib-undefined");
}
