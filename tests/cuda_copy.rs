//! The copy stage on a real GPU: exact bytes, the pinned-buffer fence under stress, epochs,
//! dropping mid-epoch, the copy ceiling. Each test skips without a GPU (see cuda_common).

use crate::cuda_common;
use gpufeed::BatchStream;

use std::time::{Duration, Instant};

use gpufeed::cuda::{DeviceLoader, DeviceLoaderOptions, PinnedBacking, pinned_copy_ceiling};
use gpufeed::{HostPool, Loader, NpyArray};

use cuda_common::{Rng, check_rows, device, reused_blocks, write_npy};

pub fn copied_bytes_equal_the_source_with_poisoned_device_buffers() {
    let Some(dev) = device() else { return };
    let dir = tempfile::tempdir().unwrap();
    let mut rng = Rng::fresh("copy");
    let (path, data) = write_npy(dir.path(), "x.npy", 300, &[3, 517], &mut rng);
    let row = 3 * 517;
    let builder = Loader::builder(NpyArray::open(&path).unwrap())
        .batch_size(32)
        .shuffle(rng.next_u64())
        .workers(2)
        // One epoch only: nothing of the next may be in flight when the pool is checked.
        .prefetch_across_epochs(false);
    let opts = DeviceLoaderOptions::default().depth(3).poison(0xAB);
    let mut dl = DeviceLoader::from_builder(builder, &dev, opts).unwrap();
    let mut seen = vec![0u32; 300];
    let mut batches = 0;
    for b in dl.by_ref() {
        let b = b.unwrap();
        let f = b.field_bytes("data").unwrap();
        assert_eq!(f.shape(), vec![b.len(), 3, 517]);
        // SAFETY: only the address's value is looked at; nothing uses the memory.
        assert_eq!(unsafe { f.ptr() } % 256, 0);
        check_rows(
            &b.field_to_host("data").unwrap(),
            b.indices(),
            &data,
            row,
            "copy",
        );
        for &i in b.indices() {
            seen[i as usize] += 1;
        }
        batches += 1;
    }
    assert_eq!(batches, 10);
    assert!(seen.iter().all(|&n| n == 1), "every sample exactly once");
    let s = reused_blocks(&dl, "ten batches");
    assert_eq!(s.batches, 10);
    assert_eq!(s.h2d_copies, 10);
    assert!(s.h2d_busy > Duration::ZERO);
    assert_eq!(s.loader.as_ref().unwrap().pool.allocated_bytes, 0);
}

pub fn two_pinned_buffers_are_never_reused_under_a_copy_in_flight() {
    let Some(dev) = device() else { return };
    let dir = tempfile::tempdir().unwrap();
    let mut rng = Rng::fresh("stress");
    let row = 1 << 20;
    let rows = 96u64;
    let (path, data) = write_npy(dir.path(), "big.npy", rows, &[row as u64], &mut rng);
    let batch = 16;
    let block = HostPool::block_size(
        Loader::builder(NpyArray::open(&path).unwrap())
            .batch_size(batch)
            .workers(1)
            .build()
            .unwrap()
            .layout()
            .total_bytes(),
    ) as u64;
    let builder = Loader::builder(NpyArray::open(&path).unwrap())
        .batch_size(batch)
        .shuffle(rng.next_u64())
        .workers(4)
        .prefetch(4)
        .pool_budget(2 * block)
        .backing(PinnedBacking::new(&dev));
    let loader = builder.build().unwrap();
    let opts = DeviceLoaderOptions::default().depth(4).poison(0x5A);
    let mut dl = DeviceLoader::new(loader, &dev, opts).unwrap();
    let copy_stream = dev.copy_stream().clone();
    let mut checked = 0;
    for epoch in 0..3u64 {
        if epoch > 0 {
            dl.set_epoch(epoch);
        }
        // Hold the copy stream so that copies queue up while the workers want buffers back.
        dev.spin(&copy_stream, Duration::from_millis(50)).unwrap();
        let mut n = 0;
        for b in dl.by_ref() {
            let b = b.unwrap();
            if n % 2 == 0 {
                dev.spin(&copy_stream, Duration::from_millis(5 + rng.next_u64() % 20))
                    .unwrap();
            }
            check_rows(
                &b.field_to_host("data").unwrap(),
                b.indices(),
                &data,
                row,
                "stress",
            );
            n += 1;
            checked += 1;
        }
        assert_eq!(n, 6, "epoch {epoch}");
    }
    let s = dl.stats();
    eprintln!("{s}");
    let pool = s.loader.unwrap().pool;
    assert!(pool.peak_reserved_bytes <= 2 * block, "{pool}");
    assert!(
        pool.waits > 0,
        "the producer never had to wait: no stress ({pool})"
    );
    assert_eq!(checked, 18);
}

pub fn dropping_the_loader_mid_epoch_stops_promptly() {
    let Some(dev) = device() else { return };
    let dir = tempfile::tempdir().unwrap();
    let mut rng = Rng::fresh("drop");
    let row = 256 << 10;
    let (path, data) = write_npy(dir.path(), "d.npy", 200, &[row as u64], &mut rng);
    let builder = Loader::builder(NpyArray::open(&path).unwrap())
        .batch_size(8)
        .workers(3);
    let mut dl = DeviceLoader::from_builder(builder, &dev, DeviceLoaderOptions::default()).unwrap();
    let kept = dl.next().unwrap().unwrap();
    for _ in 0..2 {
        dl.next().unwrap().unwrap();
    }
    dev.spin(dev.copy_stream(), Duration::from_millis(200))
        .unwrap();
    let t = Instant::now();
    drop(dl);
    let took = t.elapsed();
    eprintln!("drop took {took:?}");
    assert!(took < Duration::from_secs(5), "drop took {took:?}");
    // A batch kept past its loader stays valid.
    check_rows(
        &kept.field_to_host("data").unwrap(),
        kept.indices(),
        &data,
        row,
        "kept",
    );
}

pub fn consumer_stream_waits_and_buffers_are_recycled_behind_it() {
    let Some(dev) = device() else { return };
    let dir = tempfile::tempdir().unwrap();
    let mut rng = Rng::fresh("recycle");
    let (path, _) = write_npy(dir.path(), "r.npy", 64, &[4096], &mut rng);
    let builder = Loader::builder(NpyArray::open(&path).unwrap())
        .batch_size(4)
        .workers(2);
    let mut dl = DeviceLoader::from_builder(builder, &dev, DeviceLoaderOptions::default()).unwrap();
    let stream = dev.new_stream().unwrap();
    for b in dl.by_ref() {
        let b = b.unwrap();
        b.wait_on(&stream).unwrap();
        // A long step on the consumer stream: the buffer must not be reused before it ends.
        dev.spin(&stream, Duration::from_millis(2)).unwrap();
    }
    stream.synchronize().unwrap();
    let s = dl.stats();
    eprintln!("{s}");
    assert_eq!(s.batches, 16);
    // Buffers are reused, but never more than the batches that can be outstanding at once.
    assert!(s.device_pool.allocations <= 16);
    assert_eq!(s.device_pool.allocated_bytes, 0);
}

pub fn pinned_copy_ceiling_is_measured() {
    let Some(dev) = device() else { return };
    for mib in [1usize, 16, 64] {
        let bps = pinned_copy_ceiling(&dev, mib << 20, 50).unwrap();
        eprintln!(
            "pinned H2D ceiling, {mib} MiB copies: {:.1} GB/s",
            bps / 1e9
        );
        assert!(bps > 1e9, "{bps}");
    }
}

/// Batches made in parts by 4 workers (in pinned buffers made ahead), held 5 at a time by the
/// consumer: every byte is the source's, every sample arrives once per epoch, and no held
/// batch is overwritten by a later copy.
pub fn batches_made_in_parts_reach_the_device_with_exact_bytes() {
    let Some(dev) = device() else { return };
    let dir = tempfile::tempdir().unwrap();
    let mut rng = Rng::fresh("parts");
    let (path, data) = write_npy(dir.path(), "x.npy", 600, &[1021], &mut rng);
    let row = 1021;
    let builder = Loader::builder(NpyArray::open(&path).unwrap())
        .batch_size(24)
        .shuffle(rng.next_u64())
        .workers(4)
        .batch_parts(4)
        .prefetch_across_epochs(false);
    let opts = DeviceLoaderOptions::default().depth(4).poison(0x5A);
    let mut dl = DeviceLoader::from_builder(builder, &dev, opts).unwrap();
    let check = |b: &gpufeed::cuda::DeviceBatch, seen: &mut [u32]| {
        check_rows(
            &b.field_to_host("data").unwrap(),
            b.indices(),
            &data,
            row,
            "parts",
        );
        for &i in b.indices() {
            seen[i as usize] += 1;
        }
    };
    for epoch in 0..2 {
        dl.set_epoch(epoch);
        let mut seen = vec![0u32; 600];
        let mut held = Vec::new();
        let mut batches = 0;
        for b in dl.by_ref() {
            held.push(b.unwrap());
            batches += 1;
            if held.len() == 5 {
                for b in held.drain(..) {
                    check(&b, &mut seen);
                }
            }
        }
        for b in held.drain(..) {
            check(&b, &mut seen);
        }
        assert_eq!(batches, 25);
        assert!(seen.iter().all(|&n| n == 1), "every sample exactly once");
    }
    let s = dl.stats();
    assert_eq!(s.h2d_copies, 50);
    let pool = &s.loader.as_ref().unwrap().pool;
    // Two batches in flight per part-set (2 * ceil(4 / 4) + 2 = 4) and two held: 6 at most.
    assert!(pool.allocations <= 6, "{pool}");
}
