//! A crate that uses gpufeed's device path and cudarc as candle does, in one build.

/// Opens GPU 0 through gpufeed on a context made by cudarc, as a candle program would share
/// its context.
pub fn open_shared() -> gpufeed::Result<gpufeed::cuda::Device> {
    let ctx = cudarc::driver::CudaContext::new(0).map_err(gpufeed::Error::user)?;
    gpufeed::cuda::Device::from_context(ctx)
}
