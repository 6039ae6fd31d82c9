//! A training loop on the CPU, using the loader as a user would: epochs, a checkpoint of the
//! loader's state after every step, a simulated crash, and a resume that yields exactly the
//! batches not yet seen.
//!
//! ```text
//! cargo run --release --example train_loop [-- DATASET]
//! ```
//!
//! Without DATASET it writes a small packed file (4,096 records of 32x32x3 u8 and a label) in a
//! temporary directory. DATASET can be any packed file or `.npy` array whose samples have a
//! tensor field `image` (or `data`, as `gpufeed pack --from npy|raw` and `.npy` arrays name it)
//! and, optionally, an integer `label` of any width, such as what
//!
//! ```text
//! gpufeed pack --from npy images.npy --labels labels.npy -o train.gfd
//! ```
//!
//! writes from NumPy's arrays (labels are int64 there).

use gpufeed::BatchStream;
use std::collections::HashSet;
use std::path::PathBuf;

use gpufeed::format::{DType, Field, RecordWriter, Schema};
use gpufeed::{Batch, Error, Loader, LoaderState, Result, source};

const BATCH: usize = 64;
const EPOCHS: u64 = 2;
const CRASH_AT: u64 = 25; // the step after which the "crash" happens, in epoch 1

fn make_dataset(dir: &std::path::Path) -> Result<PathBuf> {
    let path = dir.join("train.gfd");
    let schema = Schema::new(vec![
        Field::tensor("image", DType::U8, &[32, 32, 3]),
        Field::tensor("label", DType::U32, &[]),
    ])?;
    let mut w = RecordWriter::create(&path, schema)?;
    let mut pixels = vec![0u8; 32 * 32 * 3];
    for i in 0..4096u32 {
        pixels
            .iter_mut()
            .enumerate()
            .for_each(|(k, p)| *p = (i as usize * 31 + k) as u8);
        w.append(&[&pixels, &(i % 10).to_le_bytes()])?;
    }
    w.finish()?;
    Ok(path)
}

/// The field of the samples' data: `image` (as this example and `gpufeed pack --from
/// imagefolder` name it) or `data` (as `gpufeed pack --from npy|raw` and `.npy` arrays do).
fn data_field(batch: &Batch) -> Result<&'static str> {
    ["image", "data"]
        .into_iter()
        .find(|name| batch.dtype(name).is_ok())
        .ok_or_else(|| Error::user("the data set has no field `image` or `data`"))
}

/// The batch's labels as i64, whatever integer type they were stored as; none if the data set
/// has no `label` field.
fn labels(batch: &Batch) -> Result<Vec<i64>> {
    let Ok(dtype) = batch.dtype("label") else {
        return Ok(Vec::new());
    };
    Ok(match dtype {
        DType::U8 => batch
            .field::<u8>("label")?
            .iter()
            .map(|&l| l.into())
            .collect(),
        DType::I8 => batch
            .field::<i8>("label")?
            .iter()
            .map(|&l| l.into())
            .collect(),
        DType::U16 => batch
            .field::<u16>("label")?
            .iter()
            .map(|&l| l.into())
            .collect(),
        DType::I16 => batch
            .field::<i16>("label")?
            .iter()
            .map(|&l| l.into())
            .collect(),
        DType::U32 => batch
            .field::<u32>("label")?
            .iter()
            .map(|&l| l.into())
            .collect(),
        DType::I32 => batch
            .field::<i32>("label")?
            .iter()
            .map(|&l| l.into())
            .collect(),
        DType::I64 => batch.field::<i64>("label")?.to_vec(),
        DType::U64 => batch
            .field::<u64>("label")?
            .iter()
            .map(|&l| l as i64)
            .collect(),
        other => {
            return Err(Error::user(format!(
                "labels of {other} are not class indices"
            )));
        }
    })
}

/// One "training step": a mean over the batch's data bytes and a sum of its labels.
fn train_step(batch: &Batch) -> Result<f64> {
    let data = batch.field_bytes(data_field(batch)?)?;
    let labels = labels(batch)?;
    let mean = data.iter().map(|&p| p as f64).sum::<f64>() / data.len().max(1) as f64;
    Ok(mean + labels.iter().map(|&l| l as f64).sum::<f64>() * 1e-9)
}

fn build(path: &std::path::Path, resume: Option<LoaderState>) -> Result<Loader> {
    let mut b = Loader::builder(source::open(path, &Default::default())?)
        .batch_size(BATCH)
        .shuffle(1234)
        .workers(2)
        .prefetch(4)
        .drop_last(true)
        .shard(0, 1);
    if let Some(state) = resume {
        b = b.resume(state);
    }
    b.build()
}

fn main() -> Result<()> {
    let tmp = std::env::temp_dir().join(format!("gpufeed-train-loop-{}", std::process::id()));
    std::fs::create_dir_all(&tmp).map_err(gpufeed::Error::user)?;
    let path = match std::env::args().nth(1) {
        Some(p) => PathBuf::from(p),
        None => make_dataset(&tmp)?,
    };
    let checkpoint = tmp.join("loader-state.json");

    // The first run: epoch 0 in full, then epoch 1 until the crash.
    let mut seen_epoch1 = Vec::new();
    {
        let mut loader = build(&path, None)?;
        for epoch in 0..EPOCHS {
            loader.set_epoch(epoch);
            let mut loss = 0.0;
            while let Some(batch) = loader.next() {
                let batch = batch?;
                loss += train_step(&batch)?;
                if epoch == 1 {
                    seen_epoch1.push(batch.indices().to_vec());
                }
                // Checkpoint after every step, as a training job would with its model.
                let state = serde_json::to_string(&loader.state()).map_err(gpufeed::Error::user)?;
                std::fs::write(&checkpoint, state).map_err(gpufeed::Error::user)?;
                if epoch == 1 && batch.number() + 1 == CRASH_AT {
                    println!("epoch {epoch}: simulated crash after {CRASH_AT} steps");
                    break;
                }
            }
            println!("epoch {epoch}: loss {loss:.3}");
            if epoch == 1 {
                break;
            }
        }
        println!("{}", loader.stats());
    } // the loader and its threads are gone, as after a crash

    // The restart: read the checkpoint and go on where the last delivered batch left off.
    let text = std::fs::read_to_string(&checkpoint).map_err(gpufeed::Error::user)?;
    let state: LoaderState = serde_json::from_str(&text).map_err(gpufeed::Error::user)?;
    println!(
        "resuming at epoch {}, batch {}",
        state.epoch, state.next_batch
    );
    let mut loader = build(&path, Some(state))?;
    let mut resumed = Vec::new();
    for batch in loader.by_ref() {
        let batch = batch?;
        train_step(&batch)?;
        resumed.push(batch.indices().to_vec());
    }

    // Check: the epoch, delivered before and after the crash, is every sample once.
    let mut all: Vec<u64> = seen_epoch1
        .iter()
        .chain(&resumed)
        .flatten()
        .copied()
        .collect();
    let distinct: HashSet<u64> = all.iter().copied().collect();
    all.sort_unstable();
    println!(
        "epoch 1: {} batches before the crash + {} after = {} samples, {} distinct",
        seen_epoch1.len(),
        resumed.len(),
        all.len(),
        distinct.len()
    );
    let expected = loader.batches_per_epoch() as usize * BATCH;
    if all.len() != expected || distinct.len() != all.len() {
        return Err(gpufeed::Error::user(
            "resume did not yield exactly the rest of the epoch",
        ));
    }
    let _ = std::fs::remove_dir_all(&tmp);
    println!("ok: resume yielded exactly the batches not yet delivered");
    Ok(())
}
