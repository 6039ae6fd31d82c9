//! A device batch's fields as tch tensors over the batch's own memory (`Tensor::from_blob`),
//! kept alive by a wrapper that owns the batch, and a check on a GPU that libtorch never reads
//! a block gpufeed reused.
//!
//! The check: 1 MiB rows of random bytes (a `.npy`), one device batch in flight, two host
//! buffers, device blocks poisoned before each copy; for each batch, libtorch's stream is kept
//! busy (matrix products), then the batch is wrapped, its rows summed by libtorch (queued behind
//! that work) and, for every fourth batch, copied into libtorch's own memory; the batch drops at
//! once. At the end every row sum and every copied byte is compared with the file, and the copy
//! stage must have reused blocks meanwhile (libtorch's stream is let catch up every third
//! batch). A block reused before libtorch's queued reads shows as poison or another batch's rows.
//!
//! ```text
//! LIBTORCH=<PyTorch 2.11's torch/ folder> cargo build    # docs/FRAMEWORKS.md, "Tested"
//! ```

use std::error::Error;

use gpufeed::cuda::{
    Device, DeviceBatch, DeviceLoader, DeviceLoaderOptions, PinnedBacking, RawStream,
};
use gpufeed::{DType, HostPool, Loader, NpyArray};
use tch::{Kind, Tensor};

/// A device batch's fields as tch tensors over its memory. The tensors drop before the batch
/// (fields drop in declaration order).
pub struct TchBatch {
    tensors: Vec<(String, Tensor)>,
    _batch: DeviceBatch,
}

/// tch's kind for a gpufeed dtype (`None`: tch has none of that width).
fn tch_kind(dtype: DType) -> Option<Kind> {
    Some(match dtype {
        DType::U8 => Kind::Uint8,
        DType::I8 => Kind::Int8,
        DType::I16 => Kind::Int16,
        DType::I32 => Kind::Int,
        DType::I64 => Kind::Int64,
        DType::F16 => Kind::Half,
        DType::BF16 => Kind::BFloat16,
        DType::F32 => Kind::Float,
        DType::F64 => Kind::Double,
        DType::Bool => Kind::Bool,
        _ => return None,
    })
}

impl TchBatch {
    /// Wraps every field of `batch`; libtorch's stream (the legacy default stream) waits for the
    /// batch's copy on the device and is registered, so the block is reused only once libtorch
    /// has run what it queued before the batch drops.
    pub fn new(batch: DeviceBatch) -> gpufeed::Result<TchBatch> {
        batch.wait_on_raw(RawStream::LEGACY)?;
        let device = tch::Device::Cuda(batch.ordinal());
        let mut tensors = Vec::new();
        for field in batch.fields() {
            let kind = tch_kind(field.dtype()).ok_or_else(|| {
                gpufeed::Error::user(format!(
                    "field `{}`: tch has no kind for {}",
                    field.name(),
                    field.dtype()
                ))
            })?;
            let shape: Vec<i64> = field.shape().iter().map(|&d| d as i64).collect();
            // SAFETY: the address holds the field's bytes while `_batch` lives, which outlives
            // `tensors`; libtorch never frees a `from_blob` pointer; every read is enqueued on
            // the legacy stream, which waited for the copy and is registered with the batch.
            let tensor =
                unsafe { Tensor::f_from_blob(field.ptr() as *const u8, &shape, &[], kind, device) }
                    .map_err(gpufeed::Error::user)?;
            tensors.push((field.name().to_owned(), tensor));
        }
        Ok(TchBatch {
            tensors,
            _batch: batch,
        })
    }

    /// Field `name`: the reference cannot outlive the batch.
    pub fn get(&self, name: &str) -> Option<&Tensor> {
        self.tensors.iter().find(|(n, _)| n == name).map(|(_, t)| t)
    }
}

fn main() -> Result<(), Box<dyn Error>> {
    let dev = Device::open(0)?;
    if !tch::Cuda::is_available() {
        return Err("libtorch sees no CUDA device".into());
    }
    let dir = std::env::temp_dir().join(format!("gpufeed-tch-{}", std::process::id()));
    std::fs::create_dir_all(&dir)?;
    let (rows, row, batch) = (96u64, 1usize << 20, 4usize);
    let mut data = vec![0u8; rows as usize * row];
    let mut x = 0x9e37_79b9_7f4a_7c15u64;
    for b in data.iter_mut() {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        *b = (x >> 24) as u8;
    }
    let path = dir.join("rows.npy");
    let mut bytes = gpufeed::source::npy_header(DType::U8, &[rows, row as u64])?;
    bytes.extend_from_slice(&data);
    std::fs::write(&path, bytes)?;
    let block = HostPool::block_size(batch * row) as u64;
    let loader = Loader::builder(NpyArray::open(&path)?)
        .batch_size(batch)
        .shuffle(7)
        .workers(2)
        .prefetch(2)
        .pool_budget(2 * block)
        .prefetch_across_epochs(false)
        .backing(PinnedBacking::new(&dev))
        .build()?;
    let opts = DeviceLoaderOptions::default().depth(1).poison(0xA5);
    let mut dl = DeviceLoader::new(loader, &dev, opts)?;
    let cuda = (Kind::Float, tch::Device::Cuda(0));
    let a = Tensor::randn([2048, 2048], cuda);
    let mut sums: Vec<(Vec<u64>, Tensor)> = Vec::new();
    let mut copies: Vec<(Vec<u64>, Tensor)> = Vec::new();
    for (k, b) in dl.by_ref().enumerate() {
        let b = b?;
        let indices = b.indices().to_vec();
        // libtorch's stream is busy: what follows queues behind it.
        let mut busy = a.shallow_clone();
        for _ in 0..20 {
            busy = busy.matmul(&a).tanh();
        }
        let wrapped = TchBatch::new(b)?;
        let t = wrapped.get(NpyArray::FIELD).ok_or("no data field")?;
        assert_eq!(t.size(), [batch as i64, row as i64]);
        sums.push((indices.clone(), t.sum_dim_intlist(1, false, Kind::Int64)));
        if k % 4 == 0 {
            copies.push((indices, t.copy()));
        }
        drop(wrapped); // the batch drops: its block is reused once libtorch ran the reads above
        drop(busy);
        if k % 3 == 2 {
            tch::Cuda::synchronize(0);
        }
    }
    tch::Cuda::synchronize(0);
    let mut checked = 0;
    for (indices, s) in &sums {
        let got: Vec<i64> = Vec::try_from(s)?;
        for (&i, &g) in indices.iter().zip(&got) {
            let want: i64 = data[i as usize * row..(i as usize + 1) * row]
                .iter()
                .map(|&v| i64::from(v))
                .sum();
            assert_eq!(g, want, "row {i}: libtorch's sum of the batch's bytes");
            checked += 1;
        }
    }
    for (indices, c) in &copies {
        let got: Vec<u8> = Vec::try_from(&c.flatten(0, -1))?;
        for (p, &i) in indices.iter().enumerate() {
            assert!(
                got[p * row..(p + 1) * row] == data[i as usize * row..(i as usize + 1) * row],
                "row {i}: libtorch's copy of the batch's bytes"
            );
        }
    }
    let s = dl.stats();
    assert!(
        s.device_pool.reuses > 0,
        "the copy stage never reused a block, so nothing was tested: {}",
        s.device_pool
    );
    println!(
        "tch hand-off: {} batches, {checked} row sums and {} copied batches equal to the file; device pool: {}",
        sums.len(),
        copies.len(),
        s.device_pool
    );
    std::fs::remove_dir_all(&dir)?;
    Ok(())
}
