//! Device memory on a real GPU: no block is reused or freed under work that still uses it,
//! whichever safe call enqueued that work. Each test skips without a GPU (see
//! cuda_common) and says how it fails against the code before the fix.
//!
//! The common technique: hold a stream busy with `Device::spin`, enqueue work that uses a block
//! behind the spin, let go of the block on the host at once, and give the memory a new owner
//! that fills it on another, idle stream. If the pool reused the block without waiting for the
//! queued work, that work runs after the new owner's bytes landed and overwrites (or reads) them.

use crate::cuda_common;

use std::time::Duration;

use cudarc::driver::CudaSlice;
use gpufeed::cuda::{Convert, Converter, DeviceLoader, DeviceLoaderOptions, DevicePool};
use gpufeed::transform::image::Layout;
use gpufeed::{
    DType, FnTransform, HostPool, Loader, LoaderBuilder, NpyArray, OutputField, Sample,
    SampleContext, Slots,
};

use cuda_common::{Rng, check_rows, device, reused_blocks, two_block_loader, write_npy};

/// Long enough that everything the host does meanwhile (allocations, uploads of a few MiB)
/// is done before the queued work runs.
const HOLD: Duration = Duration::from_millis(500);

/// Bytes of `want` that differ in `got`.
fn differing(got: &[u8], want: &[u8]) -> usize {
    assert_eq!(got.len(), want.len());
    got.iter().zip(want).filter(|(a, b)| a != b).count()
}

/// The reported repro: `fill_async` on a busy stream, drop, `alloc` the same size, upload.
///
/// Before the fix `fill_async` recorded no fence: the dropped block went straight back to the
/// free list, `alloc` handed the same block to the new owner, the upload landed, and then the
/// memset (queued behind the spin) overwrote every byte with 0xEE.
pub fn a_dropped_buffer_is_not_reused_under_its_fill() {
    let Some(dev) = device() else { return };
    let mut rng = Rng::fresh("fill-drop-alloc");
    let pool = DevicePool::new(&dev);
    let busy = dev.new_stream().unwrap();
    let idle = dev.new_stream().unwrap();
    let bytes = 8 << 20;
    let mut data = vec![0u8; bytes];
    rng.fill(&mut data);

    let mut old = pool.alloc(bytes).unwrap();
    dev.spin(&busy, HOLD).unwrap();
    old.fill_async(&busy, 0, bytes, 0xEE).unwrap();
    drop(old);
    let mut new = pool.alloc(bytes).unwrap();
    new.upload_sync(&idle, 0, &data).unwrap();
    eprintln!("after the new owner's upload: {}", pool.stats());
    busy.synchronize().unwrap(); // the memset has run now
    let mut back = vec![0u8; bytes];
    new.download_sync(&idle, 0, &mut back).unwrap();
    assert_eq!(
        differing(&back, &data),
        0,
        "the old owner's memset overwrote the new owner's bytes"
    );
    drop(new);
    let s = pool.stats();
    eprintln!("at the end: {s}");
    assert_eq!(s.allocated_bytes, 0);
}

/// A converter launch on a busy stream, then both buffers dropped and their sizes allocated
/// again by new owners that fill them at once.
///
/// Before the fix `Converter::launch` recorded no fence: the new owners got the same blocks, and
/// the kernel (queued behind the spin) then read the new input owner's bytes and wrote f32s over
/// the new output owner's bytes.
pub fn a_converter_launch_keeps_its_buffers_until_it_ran() {
    let Some(dev) = device() else { return };
    let mut rng = Rng::fresh("convert-drop-alloc");
    let pool = DevicePool::new(&dev);
    let busy = dev.new_stream().unwrap();
    let idle = dev.new_stream().unwrap();
    let (n, c, h, w) = (8usize, 3usize, 128usize, 128usize);
    let conv = Converter::new(
        &dev,
        Convert::new("img", Layout::Hwc, DType::F32),
        &[h, w, c],
    )
    .unwrap();
    let (in_bytes, out_bytes) = (conv.input_bytes(n), conv.output_bytes(n));
    let mut input = vec![0u8; in_bytes];
    rng.fill(&mut input);
    let mut src = pool.alloc(in_bytes).unwrap();
    src.upload_sync(&idle, 0, &input).unwrap();
    let dst = pool.alloc(out_bytes).unwrap();

    dev.spin(&busy, HOLD).unwrap();
    conv.launch(&busy, &src, 0, &dst, 0, n).unwrap();
    drop((src, dst));
    let (mut want_a, mut want_b) = (vec![0u8; in_bytes], vec![0u8; out_bytes]);
    rng.fill(&mut want_a);
    rng.fill(&mut want_b);
    let mut a = pool.alloc(in_bytes).unwrap();
    a.upload_sync(&idle, 0, &want_a).unwrap();
    let mut b = pool.alloc(out_bytes).unwrap();
    b.upload_sync(&idle, 0, &want_b).unwrap();
    eprintln!("after the new owners' uploads: {}", pool.stats());
    // The converter's coefficients go too while the kernel is queued: its drop must neither
    // free them under the kernel nor fail.
    drop(conv);
    busy.synchronize().unwrap(); // the kernel has run now
    let (mut got_a, mut got_b) = (vec![0u8; in_bytes], vec![0u8; out_bytes]);
    a.download_sync(&idle, 0, &mut got_a).unwrap();
    b.download_sync(&idle, 0, &mut got_b).unwrap();
    assert_eq!(differing(&got_a, &want_a), 0, "input owner's bytes changed");
    assert_eq!(
        differing(&got_b, &want_b),
        0,
        "the old launch wrote over the new output owner's bytes"
    );
}

/// Two pinned host blocks and a fast copy stage against a slow consumer: every batch is read on
/// a consumer stream behind a spin, long after the host dropped it, through cudarc's own copy
/// (`memcpy_dtod` takes the field view as a `DevicePtr`). Three batches in four are read on the
/// stream registered with `wait_on`, whose fence the batch's drop records; every fourth on a
/// stream the batch never heard of, which the view synchronises after the read.
///
/// Against the old code a consumer could only read through `DeviceField::ptr`, a raw address
/// that nothing tied to the batch: a read on an unregistered stream saw the next batches' bytes,
/// since the block was reused as soon as the batch dropped. Here, if either half of the view's
/// rule were lost (the drop's fence on registered streams, or the synchronisation of others),
/// the copy stage would reuse the block under the queued read, and a snapshot would hold
/// another batch's rows.
pub fn a_slow_consumer_stream_never_sees_a_batch_overwritten() {
    let Some(dev) = device() else { return };
    let dir = tempfile::tempdir().unwrap();
    let mut rng = Rng::fresh("slow-consumer");
    let row = 1 << 20;
    let (batch, rows) = (4usize, 64u64);
    let (path, data) = write_npy(dir.path(), "rows.npy", rows, &[row as u64], &mut rng);
    let block = HostPool::block_size(batch * row) as u64;
    let loader = two_block_loader(&dev, &path, batch, row, rng.next_u64());
    let opts = DeviceLoaderOptions::default().depth(1);
    let mut dl = DeviceLoader::new(loader, &dev, opts).unwrap();
    let consumer = dev.new_stream().unwrap();
    let stranger = dev.new_stream().unwrap();
    let step = Duration::from_millis(20);
    let mut snapshots: Vec<(Vec<u64>, CudaSlice<u8>)> = Vec::new();
    for (k, b) in dl.by_ref().enumerate() {
        let b = b.unwrap();
        let bytes = b.field_bytes("data").unwrap().bytes();
        let reader = if k % 4 == 3 {
            &stranger
        } else {
            b.wait_on(&consumer).unwrap();
            &consumer
        };
        dev.spin(reader, step).unwrap(); // the slow training step
        let mut snap = reader.alloc_zeros::<u8>(bytes).unwrap();
        reader
            .memcpy_dtod(&b.field_bytes("data").unwrap(), &mut snap)
            .unwrap();
        snapshots.push((b.indices().to_vec(), snap));
        // Let the backlog drain now and then, so that the copy stage reuses blocks (it needs a
        // block while the consumer is still behind).
        if k % 3 == 2 {
            consumer.synchronize().unwrap();
        }
        // `b` drops here, long before `reader` reaches the copy (for the registered stream).
    }
    consumer.synchronize().unwrap();
    stranger.synchronize().unwrap();
    assert_eq!(snapshots.len(), (rows as usize) / batch);
    for (k, (indices, snap)) in snapshots.iter().enumerate() {
        let got = consumer.clone_dtoh(snap).unwrap();
        check_rows(&got, indices, &data, row, &format!("batch {k}"));
    }
    let s = reused_blocks(&dl, "a slow consumer stream");
    let host_pool = s.loader.unwrap().pool;
    assert!(host_pool.peak_reserved_bytes <= 2 * block, "{host_pool}");
}

/// Fields of odd sizes (1000 bytes, 8 bytes, 37 bytes per sample: padding between them, a
/// short last batch), copied into device buffers poisoned with 0xA5 before every copy, read on
/// slow consumer streams after the host dropped each batch, and compared byte for byte with the
/// same batches made on the host.
///
/// A byte the copy did not write, or a block poisoned again for a later batch before the
/// consumer read it, shows as 0xA5 (or as another batch's bytes). Against the old code this
/// failed the same way as the slow-consumer test for reads on streams the batch did not know.
pub fn poisoned_device_batches_hold_every_byte_of_the_host_batches() {
    let Some(dev) = device() else { return };
    let dir = tempfile::tempdir().unwrap();
    let mut rng = Rng::fresh("poison");
    let (rows, row) = (101u64, 1000usize);
    let (path, _) = write_npy(dir.path(), "odd.npy", rows, &[row as u64], &mut rng);
    let seed = rng.next_u64();
    let builder = || -> LoaderBuilder {
        Loader::builder(NpyArray::open(&path).unwrap())
            .transform(odd_fields(row))
            .batch_size(7)
            .shuffle(seed)
            .workers(3)
            .shard(0, 1)
            .prefetch_across_epochs(false)
    };
    let host: Vec<_> = builder()
        .build()
        .unwrap()
        .map(|b| {
            let b = b.unwrap();
            ["x", "index", "tail"].map(|f| b.field_bytes(f).unwrap().to_vec())
        })
        .collect();
    let opts = DeviceLoaderOptions::default().depth(3).poison(0xA5);
    let mut dl = DeviceLoader::from_builder(builder(), &dev, opts).unwrap();
    let consumer = dev.new_stream().unwrap();
    let stranger = dev.new_stream().unwrap();
    let mut snapshots: Vec<[CudaSlice<u8>; 3]> = Vec::new();
    for (k, b) in dl.by_ref().enumerate() {
        let b = b.unwrap();
        let reader = if k % 3 == 1 {
            &stranger
        } else {
            b.wait_on(&consumer).unwrap();
            &consumer
        };
        dev.spin(reader, Duration::from_millis(10)).unwrap();
        let snaps = ["x", "index", "tail"].map(|name| {
            let field = b.field_bytes(name).unwrap();
            let mut snap = reader.alloc_zeros::<u8>(field.bytes()).unwrap();
            reader.memcpy_dtod(&field, &mut snap).unwrap();
            snap
        });
        snapshots.push(snaps);
    }
    consumer.synchronize().unwrap();
    stranger.synchronize().unwrap();
    assert_eq!(snapshots.len(), host.len());
    assert_eq!(host.len(), 15); // 101 samples in batches of 7, the last of 3
    for (k, (snaps, want)) in snapshots.iter().zip(&host).enumerate() {
        for ((snap, want), name) in snaps.iter().zip(want).zip(["x", "index", "tail"]) {
            let got = consumer.clone_dtoh(snap).unwrap();
            assert_eq!(got.len(), want.len(), "batch {k}, field {name}: size");
            if let Some(i) = got.iter().zip(want).position(|(a, b)| a != b) {
                panic!(
                    "batch {k}, field {name}: byte {i} is {:#x}, the host batch has {:#x}",
                    got[i], want[i]
                );
            }
        }
    }
    reused_blocks(&dl, "poisoned device batches");
}

/// Three fields of sizes that are not multiples of 256: the row, its dataset index, and 37
/// bytes derived from both.
fn odd_fields(row: usize) -> impl gpufeed::SampleTransform {
    FnTransform::new(
        vec![
            OutputField::new("x", DType::U8, &[row]),
            OutputField::new("index", DType::U64, &[]),
            OutputField::new("tail", DType::U8, &[37]),
        ],
        move |s: Sample<'_>, ctx: &SampleContext, slots: &mut Slots<'_>| {
            let bytes = s.field(0).unwrap_or(&[]);
            slots.field(0)?.copy_from_slice(bytes);
            slots.field(1)?.copy_from_slice(&ctx.index.to_le_bytes());
            for (i, b) in slots.field(2)?.iter_mut().enumerate() {
                *b = bytes[i * 13 % bytes.len().max(1)] ^ (ctx.index as u8);
            }
            Ok(())
        },
    )
}

/// `Device::context()` keeps cudarc's event tracking on: a `CudaSlice` made on it orders itself
/// across streams. The old code turned tracking off on the context it handed out, so that a
/// user's `CudaSlice` there could be read (or freed) under a write still queued on another
/// stream: the read below then saw zeros.
pub fn the_device_context_keeps_event_tracking() {
    let Some(dev) = device() else { return };
    assert!(dev.context().is_event_tracking());
    let (a, b) = (dev.new_stream().unwrap(), dev.new_stream().unwrap());
    let n = 1 << 20;
    let ones = a.clone_htod(&vec![1u8; n]).unwrap();
    let mut slice = a.alloc_zeros::<u8>(n).unwrap();
    a.synchronize().unwrap();
    // A device-to-device write queued behind a spin on `a` (the host does not wait for it),
    // then a read on `b`: with tracking, `b` waits for the write's event.
    dev.spin(&a, Duration::from_millis(200)).unwrap();
    a.memcpy_dtod(&ones, &mut slice).unwrap();
    let got = b.clone_dtoh(&slice).unwrap();
    assert!(
        got.iter().all(|&x| x == 1),
        "the read on another stream did not wait for the write"
    );
}
