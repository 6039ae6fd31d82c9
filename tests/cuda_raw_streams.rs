//! Device batches shared by consumers that name their streams by raw handle (DLPack, PyTorch):
//! `wait_on_raw`, `release_on_raw`, drops on other threads, `next_timeout`, the mask and
//! indices fields, and the pool and context outliving the loader. Each test skips
//! without a GPU (see cuda_common).
//!
//! The technique of `cuda_sound.rs`: hold the consumer's stream busy (here: make it wait on an
//! event recorded behind `Device::spin` on another stream, which works for every kind of raw
//! stream), enqueue a read of the batch behind it, let go of the batch at once on another
//! thread (as a DLPack deleter does), and let the copy stage reuse blocks meanwhile. A block
//! reused before the consumer's stream passed its read shows in the snapshot as another batch's
//! rows.
//!
//! The tests of this file share one lock: they compare `cuda::reserved_bytes` (all pools of the
//! process) before and after.

use crate::cuda_common;
use gpufeed::{BatchStream, Next};

use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use cudarc::driver::{CudaStream, result, sys};
use gpufeed::cuda::{
    Device, DeviceBatch, DeviceLoader, DeviceLoaderOptions, DevicePool, RawStream,
};
use gpufeed::{
    DType, FnTransform, Loader, LoaderBuilder, NpyArray, OutputField, Sample, SampleContext, Slots,
};

use cuda_common::{Rng, check_rows, device, reused_blocks, two_block_loader, write_npy};

fn serial() -> MutexGuard<'static, ()> {
    static LOCK: Mutex<()> = Mutex::new(());
    LOCK.lock().unwrap_or_else(|p| p.into_inner())
}

/// Which raw stream the consumer uses.
#[derive(Clone, Copy, Debug)]
enum Consumer {
    /// A stream of its own (a cudarc stream, named by its handle, as torch's side streams are).
    Own,
    /// The legacy default stream (`1`, torch's default stream).
    Legacy,
    /// The test thread's per-thread default stream (`2`).
    PerThread,
}

const CONSUMERS: [Consumer; 3] = [Consumer::Own, Consumer::Legacy, Consumer::PerThread];

fn raw_of(kind: Consumer, own: &CudaStream) -> RawStream {
    match kind {
        // SAFETY: `own` is a stream of the device's context that the test keeps alive until
        // every batch given it has dropped (the device is synchronised and the batches gone
        // before `own` drops).
        Consumer::Own => unsafe { RawStream::from_raw(own.cu_stream() as usize) },
        Consumer::Legacy => RawStream::LEGACY,
        Consumer::PerThread => RawStream::PER_THREAD,
    }
}

/// Makes `raw` wait, on the device, for `hold` of GPU time spun on `busy` (the host does not
/// wait).
fn hold(dev: &Device, busy: &Arc<CudaStream>, raw: RawStream, hold: Duration) {
    dev.spin(busy, hold).unwrap();
    let event = busy.record_event(None).unwrap();
    dev.bind().unwrap();
    // SAFETY: `raw` is a default stream or a live stream of this context (see `raw_of`); the
    // event is live; a wait touches no memory.
    unsafe {
        result::stream::wait_event(
            raw.handle() as sys::CUstream,
            event.cu_event(),
            sys::CUevent_wait_flags::CU_EVENT_WAIT_DEFAULT,
        )
    }
    .unwrap();
}

/// Enqueues on `raw` a copy of field `name` of `batch` into a new buffer of `pool` (after
/// `wait_on_raw`), and returns the buffer. The caller synchronises the device before reading or
/// dropping it.
fn snapshot(
    dev: &Device,
    pool: &DevicePool,
    batch: &DeviceBatch,
    name: &str,
    raw: RawStream,
) -> gpufeed::cuda::DeviceBuffer {
    let snap = pool
        .alloc(batch.field_bytes(name).unwrap().bytes())
        .unwrap();
    snapshot_into(dev, &snap, batch, name, raw);
    snap
}

/// [`snapshot`] into a buffer allocated beforehand.
fn snapshot_into(
    dev: &Device,
    snap: &gpufeed::cuda::DeviceBuffer,
    batch: &DeviceBatch,
    name: &str,
    raw: RawStream,
) {
    batch.wait_on_raw(raw).unwrap();
    let field = batch.field_bytes(name).unwrap();
    assert!(snap.len() >= field.bytes());
    dev.bind().unwrap();
    // SAFETY: both ranges are `field.bytes()` bytes of live device memory: the field of
    // `batch`, whose buffer is reused only once `raw` has passed this copy (it is registered,
    // and the batch drops after this call), and the snapshot, which the caller keeps until the
    // device is synchronised. `raw` is valid (see `raw_of`).
    unsafe {
        result::memcpy_dtod_async(
            snap.ptr(),
            field.ptr(),
            field.bytes(),
            raw.handle() as sys::CUstream,
        )
    }
    .unwrap();
}

/// Reads a snapshot back (the device must be synchronised).
fn read(snap: &gpufeed::cuda::DeviceBuffer, stream: &Arc<CudaStream>) -> Vec<u8> {
    let mut out = vec![0u8; snap.len()];
    snap.download_sync(stream, 0, &mut out).unwrap();
    out
}

/// True when no context is current on the calling thread.
fn no_context() -> bool {
    result::ctx::get_current().unwrap().is_none()
}

/// A thread that drops the batches it is given, as a DLPack deleter does, and checks that each
/// drop leaves its thread without a current context.
fn dropper() -> (
    crossbeam_channel::Sender<Arc<DeviceBatch>>,
    std::thread::JoinHandle<()>,
) {
    let (tx, rx) = crossbeam_channel::bounded::<Arc<DeviceBatch>>(0);
    let thread = std::thread::spawn(move || {
        for batch in rx {
            drop(batch);
            assert!(no_context(), "a batch's drop left a context current");
        }
    });
    (tx, thread)
}

/// The slow consumer, for each kind of raw stream: every batch is read on the consumer's raw
/// stream behind a hold, and dropped at once on another thread, while the copy stage (one
/// pinned host block ahead, depth 1) reuses device blocks.
///
/// Against a drop that did not fence the raw streams registered with `wait_on_raw` (the block
/// returns behind the copy's fence alone), the copy stage reuses the block while the queued
/// read still waits behind the hold, and the snapshot holds a later batch's rows.
pub fn a_block_is_reused_only_after_the_raw_consumer_stream_passed_its_read() {
    let Some(dev) = device() else { return };
    let _serial = serial();
    for kind in CONSUMERS {
        let dir = tempfile::tempdir().unwrap();
        let mut rng = Rng::fresh(&format!("raw consumer {kind:?}"));
        let (row, batch, rows) = (1usize << 20, 4usize, 64u64);
        let (path, data) = write_npy(dir.path(), "rows.npy", rows, &[row as u64], &mut rng);
        let loader = two_block_loader(&dev, &path, batch, row, rng.next_u64());
        let mut dl =
            DeviceLoader::new(loader, &dev, DeviceLoaderOptions::default().depth(1)).unwrap();
        let busy = dev.new_stream().unwrap();
        let own = dev.new_stream().unwrap();
        let raw = raw_of(kind, &own);
        let snaps = DevicePool::new(&dev);
        let (tx, thread) = dropper();
        let mut snapshots = Vec::new();
        for (k, b) in dl.by_ref().enumerate() {
            let b = Arc::new(b.unwrap());
            hold(&dev, &busy, raw, Duration::from_millis(20));
            let snap = snapshot(&dev, &snaps, &b, "data", raw);
            snapshots.push((b.indices().to_vec(), snap));
            tx.send(b).unwrap(); // dropped now on the other thread, long before `raw` reads it
            if k % 3 == 2 {
                // Let the backlog drain now and then, so that the copy stage reuses blocks.
                dev.synchronize().unwrap();
            }
        }
        drop(tx);
        thread.join().unwrap();
        dev.synchronize().unwrap();
        assert_eq!(snapshots.len(), rows as usize / batch);
        for (k, (indices, snap)) in snapshots.iter().enumerate() {
            let got = read(snap, &own);
            check_rows(&got, indices, &data, row, &format!("{kind:?}, batch {k}"));
        }
        let s = reused_blocks(&dl, &format!("{kind:?}"));
        assert_eq!(s.device_leaked, 0);
        assert_eq!(s.device_pool.allocated_bytes, 0, "every batch was returned");
    }
}

/// `wait_on_raw` orders the consumer's stream after a copy that has not run yet: the copy
/// stream is held busy before the loader starts, so every copy (and the poison fill before it)
/// waits; the consumer's read, enqueued at once on an idle stream, must still see the batch.
///
/// Against a `wait_on_raw` that only registered the stream (no `cuStreamWaitEvent`), the
/// snapshot reads the fresh buffer's old contents.
pub fn wait_on_raw_orders_the_consumer_after_a_copy_still_queued() {
    let Some(dev) = device() else { return };
    let _serial = serial();
    for kind in CONSUMERS {
        let dir = tempfile::tempdir().unwrap();
        let mut rng = Rng::fresh(&format!("wait_on_raw {kind:?}"));
        let (path, data) = write_npy(dir.path(), "rows.npy", 40, &[4096], &mut rng);
        let own = dev.new_stream().unwrap();
        let raw = raw_of(kind, &own);
        // Allocated before the copy stream is held, so that nothing the host does later can
        // wait for the device.
        let snaps = DevicePool::new(&dev);
        let mut free: Vec<_> = (0..5).map(|_| snaps.alloc(8 * 4096).unwrap()).collect();
        dev.spin(dev.copy_stream(), Duration::from_millis(300))
            .unwrap();
        let builder = Loader::builder(NpyArray::open(&path).unwrap())
            .batch_size(8)
            .workers(2)
            .prefetch_across_epochs(false);
        let opts = DeviceLoaderOptions::default().depth(2).poison(0xA5);
        let mut dl = DeviceLoader::from_builder(builder, &dev, opts).unwrap();
        let mut snapshots = Vec::new();
        for b in dl.by_ref() {
            let b = b.unwrap();
            let snap = free.pop().unwrap();
            snapshot_into(&dev, &snap, &b, "data", raw);
            snapshots.push((b.indices().to_vec(), snap));
        }
        assert_eq!(snapshots.len(), 5, "40 rows in batches of 8");
        dev.synchronize().unwrap();
        for (k, (indices, snap)) in snapshots.iter().enumerate() {
            let got = read(snap, &own);
            check_rows(
                &got[..indices.len() * 4096],
                indices,
                &data,
                4096,
                &format!("{kind:?}, batch {k}"),
            );
        }
    }
}

/// Calls made on a thread that is not gpufeed's leave its current context as they found it:
/// here a fresh thread with none. cudarc binds its context and leaves it bound; on a Python
/// thread that would change which device the CUDA runtime, and so PyTorch, takes as current.
pub fn foreign_threads_keep_their_current_context() {
    if device().is_none() {
        return;
    }
    let _serial = serial();
    let dir = tempfile::tempdir().unwrap();
    let mut rng = Rng::fresh("context");
    let (path, data) = write_npy(dir.path(), "rows.npy", 64, &[256], &mut rng);
    std::thread::spawn(move || {
        assert!(no_context());
        let dev = Device::open(0).unwrap();
        assert!(no_context(), "Device::open");
        let builder = Loader::builder(NpyArray::open(&path).unwrap())
            .batch_size(16)
            .workers(2);
        let mut dl =
            DeviceLoader::from_builder(builder, &dev, DeviceLoaderOptions::default()).unwrap();
        assert!(no_context(), "DeviceLoader::new");
        let b = Arc::new(dl.next().unwrap().unwrap());
        b.wait_on_raw(RawStream::LEGACY).unwrap();
        assert!(no_context(), "wait_on_raw");
        check_rows(
            &b.field_to_host("data").unwrap(),
            b.indices(),
            &data,
            256,
            "context",
        );
        assert!(no_context(), "field_to_host");
        let _ = dl.stats();
        assert!(no_context(), "stats");
        drop(b);
        assert!(no_context(), "a batch's drop");
        drop(dl);
        assert!(no_context(), "the loader's drop");
    })
    .join()
    .unwrap();
}

/// A transform that sleeps before each sample: batches come slower than a short timeout.
fn slow_copy(ms: u64) -> impl gpufeed::SampleTransform {
    FnTransform::new(
        vec![OutputField::new("data", DType::U8, &[64])],
        move |s: Sample<'_>, _: &SampleContext, slots: &mut Slots<'_>| {
            std::thread::sleep(Duration::from_millis(ms));
            slots.field(0)?.copy_from_slice(s.field(0).unwrap_or(&[]));
            Ok(())
        },
    )
}

/// `next_timeout` as `Loader::next_timeout`: a timeout moves nothing. Polled with short
/// timeouts, across `set_epoch` and a resume, a device loader yields the same batches and the
/// same states as one iterated plainly.
pub fn next_timeout_moves_nothing() {
    let Some(dev) = device() else { return };
    let _serial = serial();
    let dir = tempfile::tempdir().unwrap();
    let mut rng = Rng::fresh("next_timeout");
    let (path, data) = write_npy(dir.path(), "rows.npy", 90, &[64], &mut rng);
    let seed = rng.next_u64();
    let builder = |ms: u64| -> LoaderBuilder {
        Loader::builder(NpyArray::open(&path).unwrap())
            .transform(slow_copy(ms))
            .batch_size(8)
            .shuffle(seed)
            .workers(2)
    };
    let opts = || DeviceLoaderOptions::default().depth(2);
    let mut plain = DeviceLoader::from_builder(builder(0), &dev, opts()).unwrap();
    let mut want = Vec::new();
    for epoch in 0..2 {
        plain.set_epoch(epoch);
        for b in plain.by_ref() {
            let b = b.unwrap();
            want.push((b.epoch(), b.number(), b.indices().to_vec()));
        }
    }
    assert_eq!(want.len(), 2 * 12);

    let mut polled = DeviceLoader::from_builder(builder(1), &dev, opts()).unwrap();
    let mut got = Vec::new();
    let mut pending = 0;
    let mut state_mid = None;
    for epoch in 0..2 {
        polled.set_epoch(epoch);
        let mut in_epoch = 0;
        loop {
            match polled.next_timeout(Duration::from_micros(200)) {
                Next::Pending => {
                    pending += 1;
                    assert_eq!(polled.state().next_batch, in_epoch);
                }
                Next::Ready(b) => {
                    let b = b.unwrap();
                    check_rows(
                        &b.field_to_host("data").unwrap(),
                        b.indices(),
                        &data,
                        64,
                        "next_timeout",
                    );
                    got.push((b.epoch(), b.number(), b.indices().to_vec()));
                    in_epoch += 1;
                    assert_eq!(polled.state().next_batch, in_epoch);
                    if got.len() == 17 {
                        state_mid = Some(polled.state());
                    }
                }
                Next::EndOfEpoch => break,
            }
        }
        assert!(matches!(
            polled.next_timeout(Duration::ZERO),
            Next::EndOfEpoch
        ));
    }
    assert!(pending > 0, "no timeout happened, so nothing was tested");
    assert_eq!(got, want);

    // Resumed from the middle of epoch 1, polled: the rest of epoch 1.
    let state = state_mid.unwrap();
    let mut resumed =
        DeviceLoader::from_builder(builder(1).resume(state.clone()), &dev, opts()).unwrap();
    resumed.set_epoch(state.epoch);
    let mut rest = Vec::new();
    loop {
        match resumed.next_timeout(Duration::from_micros(100)) {
            Next::Pending => {}
            Next::Ready(b) => {
                let b = b.unwrap();
                rest.push((b.epoch(), b.number(), b.indices().to_vec()));
            }
            Next::EndOfEpoch => break,
        }
    }
    assert_eq!(rest, want[17..]);
}

/// The mask and indices fields hold what the host batches say: an evaluation loader of rank 2
/// of 3 over 101 samples (33 samples and one padding slot), batches of 8, device buffers
/// poisoned before every copy.
pub fn mask_and_indices_fields_match_the_host_batches() {
    let Some(dev) = device() else { return };
    let _serial = serial();
    let dir = tempfile::tempdir().unwrap();
    let mut rng = Rng::fresh("mask and indices");
    let (path, data) = write_npy(dir.path(), "rows.npy", 101, &[40], &mut rng);
    let builder = || -> LoaderBuilder {
        Loader::builder(NpyArray::open(&path).unwrap())
            .batch_size(8)
            .evaluation(true)
            .shard(2, 3)
            .workers(2)
    };
    let host: Vec<(Vec<bool>, Vec<u64>)> = builder()
        .build()
        .unwrap()
        .map(|b| {
            let b = b.unwrap();
            (b.mask(), b.indices().to_vec())
        })
        .collect();
    assert!(
        host.iter().any(|(m, _)| m.contains(&false)),
        "no padding slot, so the mask is not tested"
    );
    let opts = DeviceLoaderOptions::default()
        .poison(0x5A)
        .mask("__mask__")
        .indices("__index__");
    let mut dl = DeviceLoader::from_builder(builder(), &dev, opts).unwrap();
    let names: Vec<String> = dl.fields().into_iter().map(|f| f.name).collect();
    assert_eq!(names, ["data", "__mask__", "__index__"]);
    let mut seen = Vec::new();
    for b in dl.by_ref() {
        let b = b.unwrap();
        let mask = b.field_bytes("__mask__").unwrap();
        assert_eq!((mask.dtype(), mask.shape()), (DType::Bool, vec![b.len()]));
        let index = b.field::<i64>("__index__").unwrap();
        assert_eq!(index.shape(), vec![b.len()]);
        let mask: Vec<bool> = b
            .field_to_host("__mask__")
            .unwrap()
            .iter()
            .map(|&x| {
                assert!(x <= 1, "a mask byte of {x:#x}");
                x == 1
            })
            .collect();
        let indices: Vec<u64> = b
            .field_to_host("__index__")
            .unwrap()
            .chunks_exact(8)
            .map(|c| i64::from_le_bytes(c.try_into().unwrap()) as u64)
            .collect();
        assert_eq!(indices, b.indices());
        assert_eq!(mask, b.mask());
        check_rows(
            &b.field_to_host("data").unwrap(),
            b.indices(),
            &data,
            40,
            "mask",
        );
        seen.push((mask, indices));
    }
    assert_eq!(seen, host);
    // A name that clashes with a field is refused, naming the setting.
    let clash =
        DeviceLoader::from_builder(builder(), &dev, DeviceLoaderOptions::default().mask("data"));
    match clash {
        Err(gpufeed::Error::InvalidConfig { setting, .. }) => assert_eq!(setting, "mask"),
        other => panic!("expected a config error, got {other:?}"),
    }
}

/// A batch kept after its loader is gone stays valid and exact; its drop, on another thread,
/// returns the pool's memory (on the release thread); many loaders leave no device memory
/// behind once `settle` returns.
pub fn batches_outlive_their_loader_and_many_loaders_leave_no_memory() {
    let Some(dev) = device() else { return };
    let _serial = serial();
    gpufeed::cuda::settle();
    let before = gpufeed::cuda::reserved_bytes();
    let dir = tempfile::tempdir().unwrap();
    let mut rng = Rng::fresh("outlive");
    let (path, data) = write_npy(dir.path(), "rows.npy", 256, &[1000], &mut rng);
    let own = dev.new_stream().unwrap();
    // SAFETY: `own` lives until the end of the test, after every batch has dropped.
    let raw = unsafe { RawStream::from_raw(own.cu_stream() as usize) };
    let snaps = DevicePool::new(&dev);
    let busy = dev.new_stream().unwrap();
    for round in 0..20u64 {
        let builder = Loader::builder(NpyArray::open(&path).unwrap())
            .batch_size(32)
            .shuffle(round)
            .workers(2);
        let opts = DeviceLoaderOptions::default().depth(2).indices("i");
        let mut dl = DeviceLoader::from_builder(builder, &dev, opts).unwrap();
        let kept = Arc::new(dl.next().unwrap().unwrap());
        let _ = dl.next(); // another batch in hand, dropped with the loader mid-epoch
        drop(dl);
        // The loader is gone; the batch still reads, on a held stream.
        hold(&dev, &busy, raw, Duration::from_millis(5));
        let snap = snapshot(&dev, &snaps, &kept, "data", raw);
        let indices = kept.indices().to_vec();
        let (tx, thread) = dropper();
        tx.send(kept).unwrap();
        drop(tx);
        thread.join().unwrap();
        dev.synchronize().unwrap();
        check_rows(&read(&snap, &own), &indices, &data, 1000, "outlive");
    }
    drop(snaps);
    gpufeed::cuda::settle();
    assert_eq!(
        gpufeed::cuda::reserved_bytes(),
        before,
        "device memory left behind by 20 loaders"
    );
    assert_eq!(gpufeed::cuda::leaked_buffers(), 0);
}
