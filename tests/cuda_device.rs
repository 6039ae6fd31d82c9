//! Opening devices: no driver is an error, never a panic; a bad ordinal is an error.
#![cfg(feature = "cuda")]

mod cuda_common;

use gpufeed::Error;
use gpufeed::cuda::{Device, driver_present};

#[test]
fn open_without_a_driver_is_no_gpu_not_a_panic() {
    let result = std::panic::catch_unwind(|| Device::open(0).map(|_| ()));
    let result = result.expect("Device::open panicked");
    if !driver_present() {
        assert!(
            matches!(result, Err(Error::NoGpu { .. })),
            "without a driver: {result:?}"
        );
    }
}

#[test]
fn an_invalid_ordinal_is_an_error() {
    // Runs with or without a GPU: either way it must be a typed error, not a panic.
    let r = std::panic::catch_unwind(|| Device::open(10_000).map(|_| ())).expect("panicked");
    assert!(matches!(r, Err(Error::NoGpu { .. })), "{r:?}");
    if cuda_common::device().is_none() {
        return;
    }
    let err = Device::open(10_000).expect_err("ordinal 10000 opened");
    assert!(err.to_string().contains("10000"), "{err}");
}

#[test]
fn device_opens_with_a_copy_stream_and_kernels() {
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
