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
    pinned_copy_ceiling_streams(device, bytes, iterations, 1)
}

/// [`pinned_copy_ceiling`] with the copies spread over `streams` streams in turn (each into a
/// device buffer of its own), as a device loader with
/// [`copy_streams`](super::DeviceLoaderOptions::copy_streams) spreads them: from the first
/// copy's start to the last one's end.
pub fn pinned_copy_ceiling_streams(
    device: &Device,
    bytes: usize,
    iterations: usize,
    streams: usize,
) -> Result<f64> {
    if bytes == 0 || iterations == 0 || streams == 0 {
        return Err(Error::config(
            "ceiling",
            "bytes, iterations and streams must be positive",
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
    let pool = DevicePool::new(device);
    let mut lanes = Vec::with_capacity(streams);
    for _ in 0..streams {
        lanes.push((device.new_stream()?, pool.alloc(bytes)?));
    }
    let timed = time_copies(device, &lanes, &host, iterations);
    // Whatever was enqueued reads `host` and writes the device buffers: fence each behind its
    // stream before they drop (`release_on` synchronises the stream if it cannot record).
    let mut fenced = Ok(());
    for (stream, dev) in lanes {
        if let Err(e) = dev.release_on(&stream) {
            fenced = Err(e);
        }
        match EventFence::record(&stream) {
            Ok(fence) => host.release_after(Box::new(fence)),
            Err(_) => {
                let _ = stream.synchronize();
            }
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

/// Enqueues two warm-up copies of `host` on each lane (a stream and its device buffer) and
/// `iterations` timed ones over the lanes in turn, and returns the seconds from the first timed
/// copy's start to the last one's end (it waits for them).
fn time_copies(
    device: &Device,
    lanes: &[(
        std::sync::Arc<cudarc::driver::CudaStream>,
        super::DeviceBuffer,
    )],
    host: &crate::memory::HostBuffer,
    iterations: usize,
) -> Result<f64> {
    let ctx = device.context();
    let timing = Some(cudarc::driver::sys::CUevent_flags::CU_EVENT_DEFAULT);
    let copy = |(stream, dev): &(
        std::sync::Arc<cudarc::driver::CudaStream>,
        super::DeviceBuffer,
    )| {
        // SAFETY: `host` (pinned) and `dev` both hold the copy's bytes; the caller fences both
        // behind everything enqueued on this stream before they drop.
        unsafe {
            cudarc::driver::result::memcpy_htod_async(
                dev.addr(),
                host.as_slice(),
                stream.cu_stream(),
            )
        }
        .map_err(cuda_err("copy to the device (cuMemcpyHtoDAsync)"))
    };
    for lane in lanes {
        copy(lane)?;
        copy(lane)?;
    }
    let first = &lanes[0].0;
    // Every lane starts after the warm-up of all: the start event is recorded on the first
    // stream once the others' warm-ups are done, and the others wait for it.
    for (stream, _) in &lanes[1..] {
        let warm = EventFence::record(stream)?;
        warm.order(first)?;
    }
    let start = ctx.new_event(timing).map_err(cuda_err("create an event"))?;
    start.record(first).map_err(cuda_err("record an event"))?;
    for (stream, _) in &lanes[1..] {
        stream
            .wait(&start)
            .map_err(cuda_err("make a stream wait on an event"))?;
    }
    for k in 0..iterations {
        copy(&lanes[k % lanes.len()])?;
    }
    for (stream, _) in &lanes[1..] {
        let done = EventFence::record(stream)?;
        done.order(first)?;
    }
    let end = ctx.new_event(timing).map_err(cuda_err("create an event"))?;
    end.record(first).map_err(cuda_err("record an event"))?;
    end.synchronize().map_err(cuda_err("wait for an event"))?;
    let ms = start
        .elapsed_ms(&end)
        .map_err(cuda_err("read the events' elapsed time"))?;
    Ok(f64::from(ms) / 1e3)
}
