//! What handing a device batch to candle costs: the device-to-device copy of
//! `DeviceBatch::tensor` against the same hand-off without the copy (what a zero-copy hand-off
//! would still pay: candle's allocation of the tensor's storage and the stream's wait), per
//! batch, on the same loader.
//!
//! ```text
//! cargo run --release --features candle-cuda --example candle_handoff -- [--batch 128] [--batches 200] [--keep-pool]
//! ```
//!
//! candle allocates from the device's default stream-ordered pool (`cuMemAllocAsync`), whose
//! release threshold is 0: at every synchronisation (a step that reads its loss back) the pool
//! gives its free memory back to the driver, and the next allocation maps it again.
//! `--keep-pool` sets that threshold to the maximum first (what a training binary can do once at
//! start-up), to measure what that mapping costs the hand-off.
//!
//! The batches are 224 x 224 x 3 u8 images normalised to f16 CHW on the GPU (38.5 MB a batch
//! of 128, the training example's size), from a `.npy` written first. For each batch, on
//! candle's stream: wait for the batch, an event, the hand-off, an event; the device time
//! between the events is the copy's, the host time the call's. Prints medians and the copy's
//! rate.

use std::time::Instant;

use candle_core::Device as CandleDevice;
use candle_core::cuda::CudaDevice;
use gpufeed::cuda::{Convert, DeviceLoader, DeviceLoaderOptions};
use gpufeed::transform::image::Layout;
use gpufeed::{BatchStream, DType, Loader, NpyArray};

type Result<T> = std::result::Result<T, Box<dyn std::error::Error + Send + Sync>>;

fn main() {
    if let Err(e) = run() {
        eprintln!("candle_handoff: {e}");
        std::process::exit(1);
    }
}

fn arg(name: &str, default: usize) -> Result<usize> {
    let args: Vec<String> = std::env::args().collect();
    match args.iter().position(|a| a == name) {
        Some(k) => Ok(args
            .get(k + 1)
            .ok_or(format!("{name} needs a value"))?
            .parse()
            .map_err(|e| format!("{name}: {e}"))?),
        None => Ok(default),
    }
}

fn median(v: &mut [f64]) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn run() -> Result<()> {
    let batch = arg("--batch", 128)?;
    let batches = arg("--batches", 200)?.max(2);
    let candle = CandleDevice::new_cuda(0)?;
    let CandleDevice::Cuda(cuda) = &candle else {
        return Err("candle's device 0 is not a CUDA device".into());
    };
    let device = gpufeed::candle::device_of(&candle)?;
    let keep_pool = std::env::args().any(|a| a == "--keep-pool");
    if keep_pool {
        keep_default_pool(cuda)?;
    }
    let dir = tempfile::tempdir()?;
    let path = dir.path().join("images.npy");
    let rows = (batch * 8) as u64;
    let mut bytes = gpufeed::source::npy_header(DType::U8, &[rows, 224, 224, 3])?;
    bytes.extend((0..rows as usize * 224 * 224 * 3).map(|k| ((k * 2_654_435_761) >> 13) as u8));
    std::fs::write(&path, bytes)?;
    let builder = Loader::builder(NpyArray::open(&path)?)
        .batch_size(batch)
        .shuffle(1)
        .shard(0, 1);
    let opts = DeviceLoaderOptions::default().convert(Convert::imagenet(
        NpyArray::FIELD,
        Layout::Hwc,
        DType::F16,
    ));
    let mut loader = DeviceLoader::from_builder(builder, &device, opts)?;
    let stream = cuda.cuda_stream();
    let (mut copy_host, mut copy_device, mut bare_host, mut bare_device) =
        (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    let (mut field_bytes, mut epoch) = (0, 0);
    for k in 0..batches {
        let b = match loader.next() {
            Some(b) => b?,
            None => {
                epoch += 1;
                loader.set_epoch(epoch);
                continue;
            }
        };
        let field = b.field_bytes(NpyArray::FIELD)?;
        field_bytes = field.bytes();
        b.wait_on(&stream)?;
        let start =
            stream.record_event(Some(cudarc::driver::sys::CUevent_flags::CU_EVENT_DEFAULT))?;
        let t0 = Instant::now();
        let (host, tensor) = if k % 2 == 0 {
            let t = b.tensor(NpyArray::FIELD, &candle)?;
            (&mut copy_host, Some(t))
        } else {
            // The hand-off without its copy: the storage candle allocates, on the same stream.
            // SAFETY: never read; dropped (freed on the stream) below.
            let s = unsafe { cuda_alloc(cuda, field.len() / 2)? };
            drop(s);
            (&mut bare_host, None)
        };
        host.push(t0.elapsed().as_secs_f64() * 1e6);
        let end =
            stream.record_event(Some(cudarc::driver::sys::CUevent_flags::CU_EVENT_DEFAULT))?;
        end.synchronize()?;
        let us = f64::from(start.elapsed_ms(&end)?) * 1e3;
        if tensor.is_some() {
            copy_device.push(us);
        } else {
            bare_device.push(us);
        }
    }
    let (ch, cd, bh, bd) = (
        median(&mut copy_host),
        median(&mut copy_device),
        median(&mut bare_host),
        median(&mut bare_device),
    );
    println!(
        "{} batches of {batch} ({:.1} MB a batch, f16{}): copy hand-off {ch:.1} us host, {cd:.1} us device ({:.0} GB/s moved); without the copy {bh:.1} us host, {bd:.1} us device; the copy costs {:.1} us of device time a batch",
        copy_host.len() + bare_host.len(),
        field_bytes as f64 / 1e6,
        if keep_pool { ", pool kept" } else { "" },
        2.0 * field_bytes as f64 / (cd * 1e-6) / 1e9,
        cd - bd
    );
    println!(
        "{}",
        serde_json::json!({
            "batch": batch, "field_bytes": field_bytes, "keep_pool": keep_pool,
            "copy_host_us": ch, "copy_device_us": cd,
            "bare_host_us": bh, "bare_device_us": bd,
        })
    );
    Ok(())
}

/// candle's allocation of `len` f16 on its stream (as `DeviceBatch::tensor` makes).
///
/// # Safety
///
/// The memory is uninitialised: not to be read.
unsafe fn cuda_alloc(
    cuda: &CudaDevice,
    len: usize,
) -> Result<cudarc::driver::CudaSlice<half::f16>> {
    // SAFETY: as the caller's contract says.
    Ok(unsafe { cuda.alloc::<half::f16>(len) }?)
}

/// Sets the release threshold of the default memory pool of candle's device to the maximum, so
/// that memory freed into it stays mapped across synchronisations.
fn keep_default_pool(cuda: &CudaDevice) -> Result<()> {
    use cudarc::driver::sys;
    let ctx = cuda.cuda_stream().context().clone();
    ctx.bind_to_thread()?;
    let mut pool = std::ptr::null_mut();
    // SAFETY: a live device of a context bound to this thread; one handle written.
    unsafe { sys::cuDeviceGetDefaultMemPool(&mut pool, ctx.cu_device()) }.result()?;
    let mut threshold = u64::MAX;
    // SAFETY: the pool just read; the attribute takes a u64 by pointer, read during the call.
    unsafe {
        sys::cuMemPoolSetAttribute(
            pool,
            sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_RELEASE_THRESHOLD,
            (&mut threshold as *mut u64).cast(),
        )
    }
    .result()?;
    Ok(())
}
