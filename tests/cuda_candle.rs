//! Batches handed to candle (feature `candle-cuda`): every dtype and shape arrives as the host
//! batch holds it, and no tensor ever sees a block that gpufeed reused.
//!
//! The use-after-free test holds candle tensors across many later batches while the device pool
//! is kept small (one batch in flight, two host buffers, blocks poisoned before every copy) and
//! candle's stream is held busy, so that every hand-off's copy is still queued when its batch
//! drops and the copy stage wants a block. A block reused before candle's stream passed its
//! copy shows in the tensor as poison or as another batch's bytes.

use crate::cuda_common;

use std::time::Duration;

use candle_core::{DType as CandleDType, Tensor};
use gpufeed::cuda::{DeviceLoader, DeviceLoaderOptions};
use gpufeed::format::{Field, RecordFile, RecordWriter, Schema};
use gpufeed::{DType, ErrorKind, Loader};

use cuda_common::{Rng, check_rows, device, reused_blocks, two_block_loader, write_npy};

/// candle's device 0 and gpufeed's device on its context, or `None` without a GPU.
fn devices() -> Option<(candle_core::Device, gpufeed::cuda::Device)> {
    device()?;
    let candle = candle_core::Device::new_cuda(0).expect("candle opens GPU 0");
    let ours = gpufeed::candle::device_of(&candle).expect("gpufeed's device on candle's context");
    Some((candle, ours))
}

/// The tensor's bytes on the host, in order.
fn bytes_of(t: &Tensor) -> Vec<u8> {
    let flat = t.flatten_all().unwrap();
    match t.dtype() {
        CandleDType::U8 => flat.to_vec1::<u8>().unwrap(),
        CandleDType::I16 => le(flat.to_vec1::<i16>().unwrap(), i16::to_le_bytes),
        CandleDType::U32 => le(flat.to_vec1::<u32>().unwrap(), u32::to_le_bytes),
        CandleDType::I32 => le(flat.to_vec1::<i32>().unwrap(), i32::to_le_bytes),
        CandleDType::I64 => le(flat.to_vec1::<i64>().unwrap(), i64::to_le_bytes),
        CandleDType::F16 => le(flat.to_vec1::<half::f16>().unwrap(), half::f16::to_le_bytes),
        CandleDType::BF16 => le(
            flat.to_vec1::<half::bf16>().unwrap(),
            half::bf16::to_le_bytes,
        ),
        CandleDType::F32 => le(flat.to_vec1::<f32>().unwrap(), f32::to_le_bytes),
        CandleDType::F64 => le(flat.to_vec1::<f64>().unwrap(), f64::to_le_bytes),
        other => panic!("no bytes for {other:?}"),
    }
}

fn le<T: Copy, const N: usize>(v: Vec<T>, f: fn(T) -> [u8; N]) -> Vec<u8> {
    v.into_iter().flat_map(f).collect()
}

/// Tensors of 1 MiB rows kept for the whole epoch, their hand-off copies queued behind 20 ms of
/// work on candle's stream, with one device batch in flight, two host buffers and blocks
/// poisoned before each copy: every element of every tensor equals its rows of the source.
pub fn tensors_held_across_later_batches_keep_every_element() {
    let Some((candle, dev)) = devices() else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let mut rng = Rng::fresh("candle-held");
    let row = 1 << 20;
    let (batch, rows) = (4usize, 96u64);
    let (path, data) = write_npy(dir.path(), "rows.npy", rows, &[row as u64], &mut rng);
    let loader = two_block_loader(&dev, &path, batch, row, rng.next_u64());
    let opts = DeviceLoaderOptions::default().depth(1).poison(0xA5);
    let mut dl = DeviceLoader::new(loader, &dev, opts).unwrap();
    let candle_stream = match &candle {
        candle_core::Device::Cuda(c) => c.cuda_stream(),
        _ => unreachable!(),
    };
    let mut held: Vec<(Vec<u64>, Tensor)> = Vec::new();
    for (k, b) in dl.by_ref().enumerate() {
        let b = b.unwrap();
        // The training step candle is busy with: the hand-off's copy queues behind it.
        dev.spin(&candle_stream, Duration::from_millis(20)).unwrap();
        let t = b.tensor("data", &candle).unwrap();
        assert_eq!(t.dims(), &[batch, row]);
        assert_eq!(t.dtype(), CandleDType::U8);
        held.push((b.indices().to_vec(), t));
        // Let candle catch up now and then, so that the blocks of the batches before are free
        // and the copy stage reuses them while the later hand-offs are still queued.
        if k % 3 == 2 {
            candle_stream.synchronize().unwrap();
        }
        // `b` drops here, its copy into `t` still queued on candle's stream.
    }
    assert_eq!(held.len(), rows as usize / batch);
    for (k, (indices, t)) in held.iter().enumerate() {
        check_rows(&bytes_of(t), indices, &data, row, &format!("batch {k}"));
    }
    reused_blocks(&dl, "tensors held across the epoch");
}

/// A record file with a field of each dtype candle has (and one it has not): device and host
/// batches become tensors of the same dtype, shape and bytes; a u16 field is refused naming
/// it; a device batch refuses candle's CPU device.
pub fn every_dtype_reaches_candle_as_the_host_batch_holds_it() {
    let Some((candle, dev)) = devices() else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("typed.gfd");
    let fields = [
        ("u8", DType::U8, vec![5u64]),
        ("i16", DType::I16, vec![3]),
        ("u32", DType::U32, vec![2]),
        ("i32", DType::I32, vec![2, 2]),
        ("i64", DType::I64, vec![]),
        ("f16", DType::F16, vec![4]),
        ("bf16", DType::BF16, vec![4]),
        ("f32", DType::F32, vec![2, 3]),
        ("f64", DType::F64, vec![1]),
        ("bool", DType::Bool, vec![3]),
        ("u16", DType::U16, vec![2]),
    ];
    let schema = Schema::new(
        fields
            .iter()
            .map(|(n, d, s)| Field::tensor(*n, *d, s))
            .collect(),
    )
    .unwrap();
    let mut rng = Rng::fresh("candle-dtypes");
    let mut w = RecordWriter::create(&path, schema).unwrap();
    for _ in 0..37 {
        let record: Vec<Vec<u8>> = fields
            .iter()
            .map(|(_, d, s)| {
                let n = s.iter().product::<u64>() as usize;
                let mut b = vec![0u8; n * d.size()];
                rng.fill(&mut b);
                if *d == DType::Bool {
                    b.iter_mut().for_each(|x| *x &= 1);
                }
                // Finite floats, so that a NaN's bits are not compared as values.
                match d {
                    DType::F16 | DType::BF16 => b.chunks_mut(2).for_each(|c| c[1] &= 0x3F),
                    DType::F32 => b.chunks_mut(4).for_each(|c| c[3] &= 0x3F),
                    DType::F64 => b.chunks_mut(8).for_each(|c| c[7] &= 0x3F),
                    _ => {}
                }
                b
            })
            .collect();
        let refs: Vec<&[u8]> = record.iter().map(|r| &r[..]).collect();
        w.append(&refs).unwrap();
    }
    w.finish().unwrap();
    let builder = || {
        Loader::builder(RecordFile::open(&path).unwrap())
            .batch_size(8)
            .shuffle(7)
            .workers(2)
            .shard(0, 1)
    };
    let host: Vec<_> = builder().build().unwrap().map(Result::unwrap).collect();
    let dl =
        DeviceLoader::from_builder(builder(), &dev, DeviceLoaderOptions::default().poison(0x5A))
            .unwrap();
    let mut n = 0;
    for (h, d) in host.iter().zip(dl) {
        let d = d.unwrap();
        assert_eq!(h.indices(), d.indices());
        for (name, dtype, _) in &fields[..fields.len() - 1] {
            let want = h.field_bytes(name).unwrap();
            let shape = h.shape(name).unwrap();
            let on_device = d.tensor(name, &candle).unwrap();
            let on_host = h.tensor(name, &candle_core::Device::Cpu).unwrap();
            let cd = gpufeed::candle::candle_dtype(*dtype, name).unwrap();
            for (t, where_) in [(&on_device, "device"), (&on_host, "host")] {
                assert_eq!(t.dims(), &shape[..], "{name} ({where_})");
                assert_eq!(t.dtype(), cd, "{name} ({where_})");
                assert_eq!(
                    bytes_of(t),
                    want,
                    "{name} ({where_}) of batch {}",
                    h.number()
                );
            }
        }
        let e = d.tensor("u16", &candle).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::Mismatch);
        assert!(e.to_string().contains("`u16`"), "{e}");
        let e = h.tensor("u16", &candle_core::Device::Cpu).unwrap_err();
        assert!(e.to_string().contains("`u16`"), "{e}");
        let e = d.tensor("f32", &candle_core::Device::Cpu).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::Mismatch, "{e}");
        let e = d.tensor("nope", &candle).unwrap_err();
        assert!(e.to_string().contains("nope"), "{e}");
        n += 1;
    }
    assert_eq!(n, host.len());
    assert_eq!(n, 5);
}
