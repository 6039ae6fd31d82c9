//! Opening devices: no driver is an error, never a panic; a bad ordinal is an error.

use crate::cuda_common;

use gpufeed::Error;
use gpufeed::cuda::{Device, driver_present};

pub fn open_without_a_driver_is_no_gpu_not_a_panic() {
    let result = std::panic::catch_unwind(|| Device::open(0).map(|_| ()));
    let result = result.expect("Device::open panicked");
    if !driver_present() {
        assert!(
            matches!(result, Err(Error::NoGpu { .. })),
            "without a driver: {result:?}"
        );
    }
}

pub fn an_invalid_ordinal_is_an_error() {
    // Runs with or without a GPU: either way it must be a typed error, not a panic.
    let r = std::panic::catch_unwind(|| Device::open(10_000).map(|_| ())).expect("panicked");
    assert!(matches!(r, Err(Error::NoGpu { .. })), "{r:?}");
    if cuda_common::device().is_none() {
        return;
    }
    let err = Device::open(10_000).expect_err("ordinal 10000 opened");
    assert!(err.to_string().contains("10000"), "{err}");
}

pub fn device_opens_with_a_copy_stream_and_kernels() {
    let Some(dev) = cuda_common::device() else {
        return;
    };
    eprintln!(
        "device {} ({}), {} SMs",
        dev.ordinal(),
        dev.name(),
        dev.sm_count()
    );
    let s = dev.new_stream().expect("stream");
    dev.spin(&s, std::time::Duration::from_millis(1))
        .expect("spin");
    s.synchronize().expect("sync");
    // The same ordinal opened twice shares the primary context.
    let again = Device::open(0).expect("open twice");
    assert_eq!(again.ordinal(), dev.ordinal());
}

pub fn a_device_on_the_callers_context_leaves_its_settings_and_copies() {
    if cuda_common::device().is_none() {
        return;
    }
    // The caller's own context, with event tracking turned off as a framework might.
    let ctx = cudarc::driver::CudaContext::new(0).unwrap();
    // SAFETY: this test makes no CudaSlice on the context, whose ordering needs tracking.
    unsafe { ctx.disable_event_tracking() };
    let dev = gpufeed::cuda::Device::from_context(std::sync::Arc::clone(&ctx)).unwrap();
    assert!(
        !ctx.is_event_tracking(),
        "gpufeed changed the caller's context"
    );
    let dir = tempfile::tempdir().unwrap();
    let mut rng = cuda_common::Rng::fresh("from_context");
    let (path, data) = cuda_common::write_npy(dir.path(), "x.npy", 40, &[16], &mut rng);
    let b = gpufeed::Loader::builder(gpufeed::NpyArray::open(&path).unwrap()).batch_size(8);
    let dl = gpufeed::cuda::DeviceLoader::from_builder(
        b,
        &dev,
        gpufeed::cuda::DeviceLoaderOptions::default(),
    )
    .unwrap();
    let mut n = 0;
    for batch in dl {
        let batch = batch.unwrap();
        cuda_common::check_rows(
            &batch.field_to_host("data").unwrap(),
            batch.indices(),
            &data,
            16,
            "from_context",
        );
        n += batch.len();
    }
    assert_eq!(n, 40);
}
