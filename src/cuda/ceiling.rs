//! The pinned-copy ceiling: what one plain pinned buffer copies to the device per second on
//! this machine, the figure the copy stage is measured against (`gpufeed bench --device N`
//! reports the copy stage as a fraction of it). It synchronises the host: a measurement, not
//! the hot path.

use super::cuda_err;
use super::{Device, DevicePool, EventFence, PinnedBacking};
use crate::error::{Error, Result};
use crate::memory::HostPool;
/// Bytes per second of `iterations` back-to-back `cuMemcpyHtoDAsync` copies of `bytes` bytes
/// from one ordinary pinned buffer into one device buffer, timed with events on a stream of its
/// own after two warm-up copies: the ceiling the copy stage is measured against.
pub fn pinned_copy_ceiling(device: &Device, bytes: usize, iterations: usize) -> Result<f64> {
    if bytes == 0 || iterations == 0 {
        return Err(Error::config(
            "ceiling",
            "bytes and iterations must be positive",
        ));
    }
    device.bind()?;
    let host_pool = HostPool::with_backing(
        PinnedBacking::new(device),
        HostPool::block_size(bytes) as u64,
    );
    let mut host = host_pool.acquire(bytes)?;
    for (i, b) in host.as_mut_slice().iter_mut().enumerate() {
        *b = (i.wrapping_mul(31) >> 3) as u8;
    }
    let dev = DevicePool::new(device).alloc(bytes)?;
    let stream = device.new_stream()?;
    let timed = time_copies(device, &stream, &host, &dev, iterations);
    // Whatever was enqueued reads `host` and writes `dev`: fence both behind it before they
    // drop (`release_on` synchronises the stream if it cannot record).
    let fenced = dev.release_on(&stream);
    match EventFence::record(&stream) {
        Ok(fence) => host.release_after(Box::new(fence)),
        Err(_) => {
            let _ = stream.synchronize();
        }
    }
    let secs = timed?;
    fenced?;
    if secs <= 0.0 {
        return Err(Error::Cuda {
            op: "time the pinned copies",
            what: "the events measured no time".into(),
        });
    }
    Ok((bytes as f64 * iterations as f64) / secs)
}

/// Enqueues two warm-up copies of `host` into `dev` and `iterations` timed ones, and returns the
/// seconds the timed ones took (it waits for them).
fn time_copies(
    device: &Device,
    stream: &std::sync::Arc<cudarc::driver::CudaStream>,
    host: &crate::memory::HostBuffer,
    dev: &super::DeviceBuffer,
    iterations: usize,
) -> Result<f64> {
    let ctx = device.context();
    let timing = Some(cudarc::driver::sys::CUevent_flags::CU_EVENT_DEFAULT);
    let copy = || {
        // SAFETY: `host` (pinned) and `dev` both hold the copy's bytes; the caller fences both
        // behind everything enqueued here before they drop.
        unsafe {
            cudarc::driver::result::memcpy_htod_async(
                dev.addr(),
                host.as_slice(),
                stream.cu_stream(),
            )
        }
        .map_err(cuda_err("copy to the device (cuMemcpyHtoDAsync)"))
    };
    copy()?;
    copy()?;
    let start = ctx.new_event(timing).map_err(cuda_err("create an event"))?;
    let end = ctx.new_event(timing).map_err(cuda_err("create an event"))?;
    start.record(stream).map_err(cuda_err("record an event"))?;
    for _ in 0..iterations {
        copy()?;
    }
    end.record(stream).map_err(cuda_err("record an event"))?;
    stream
        .synchronize()
        .map_err(cuda_err("synchronize a stream"))?;
    let ms = start
        .elapsed_ms(&end)
        .map_err(cuda_err("read the events' elapsed time"))?;
    Ok(f64::from(ms) / 1e3)
}
