//! A training loop fed by gpufeed on a GPU: each "step" is a kernel of known duration on the
//! consumer's stream, and the loop reports the fraction of time it waited for data.
//!
//! ```text
//! cargo run --release --features cuda --example train_loop_cuda -- [data.npy|train.gfd] \
//!     [--step-ms 5] [--batch 256] [--workers N] [--epochs 1] [--depth N] [--convert bf16]
//! ```
//!
//! Without a path it writes a u8 `.npy` of 4096 images of 224x224x3 in a temporary directory.
//! A packed file works too, such as `gpufeed pack --from npy images.npy -o train.gfd` writes:
//! its field `image`, else `data`, holds the images (u8, HWC for `--convert`).
//! The host keeps one step queued ahead of the GPU (it waits for step k-1 after enqueueing step
//! k, as a loop reading its loss would), so time spent in `next()` is time the GPU could starve.

fn main() -> Result<(), Box<dyn std::error::Error>> {
    real::main()
}

mod real {
    use gpufeed::BatchStream;
    use std::io::Write;
    use std::time::{Duration, Instant};

    use gpufeed::cuda::{Convert, Device, DeviceLoader, DeviceLoaderOptions};
    use gpufeed::transform::image::Layout;
    use gpufeed::{DType, Dataset, Loader, NpyArray};

    struct Args {
        path: Option<String>,
        step_ms: f64,
        batch: usize,
        workers: usize,
        epochs: u64,
        depth: Option<usize>,
        convert: Option<DType>,
    }

    fn parse() -> Result<Args, String> {
        let mut a = Args {
            path: None,
            step_ms: 5.0,
            batch: 256,
            workers: std::thread::available_parallelism()
                .map_or(2, |n| n.get())
                .min(16),
            epochs: 1,
            depth: None,
            convert: None,
        };
        let mut it = std::env::args().skip(1);
        while let Some(arg) = it.next() {
            let mut value = |name: &str| it.next().ok_or(format!("{name} needs a value"));
            match arg.as_str() {
                "--step-ms" => {
                    a.step_ms = value("--step-ms")?
                        .parse()
                        .map_err(|e| format!("--step-ms: {e}"))?
                }
                "--batch" => {
                    a.batch = value("--batch")?
                        .parse()
                        .map_err(|e| format!("--batch: {e}"))?
                }
                "--workers" => {
                    a.workers = value("--workers")?
                        .parse()
                        .map_err(|e| format!("--workers: {e}"))?
                }
                "--epochs" => {
                    a.epochs = value("--epochs")?
                        .parse()
                        .map_err(|e| format!("--epochs: {e}"))?
                }
                "--depth" => {
                    a.depth = Some(
                        value("--depth")?
                            .parse()
                            .map_err(|e| format!("--depth: {e}"))?,
                    )
                }
                "--convert" => {
                    a.convert = Some(
                        DType::from_name(&value("--convert")?)
                            .ok_or("--convert takes f32, f16 or bf16")?,
                    )
                }
                p if !p.starts_with("--") => a.path = Some(p.to_owned()),
                other => return Err(format!("unknown option {other}")),
            }
        }
        Ok(a)
    }

    fn make_dataset(
        dir: &std::path::Path,
    ) -> Result<std::path::PathBuf, Box<dyn std::error::Error>> {
        let shape = [4096u64, 224, 224, 3];
        let path = dir.join("images.npy");
        let mut f = std::io::BufWriter::new(std::fs::File::create(&path)?);
        f.write_all(&gpufeed::source::npy_header(DType::U8, &shape)?)?;
        let row = vec![0u8; 224 * 224 * 3];
        let mut state = 0x1234_5678_9abc_def0u64;
        for _ in 0..shape[0] {
            let mut r = row.clone();
            for b in r.iter_mut() {
                state ^= state << 13;
                state ^= state >> 7;
                state ^= state << 17;
                *b = state as u8;
            }
            f.write_all(&r)?;
        }
        f.flush()?;
        Ok(path)
    }

    pub fn main() -> Result<(), Box<dyn std::error::Error>> {
        let args = parse()?;
        let device = match Device::from_env() {
            Ok(d) => d,
            Err(e) => {
                eprintln!("train_loop_cuda: {e}");
                std::process::exit(2);
            }
        };
        let tmp = std::env::temp_dir().join(format!("gpufeed-train-{}", std::process::id()));
        let path = match &args.path {
            Some(p) => std::path::PathBuf::from(p),
            None => {
                std::fs::create_dir_all(&tmp)?;
                make_dataset(&tmp)?
            }
        };
        let dataset = gpufeed::source::open(&path, &Default::default())?;
        let field = if dataset.schema().index_of("image").is_some() {
            "image"
        } else {
            NpyArray::FIELD
        };
        let mut opts = DeviceLoaderOptions::default();
        if let Some(depth) = args.depth {
            opts = opts.depth(depth);
        }
        if let Some(dtype) = args.convert {
            opts = opts.convert(Convert::imagenet(field, Layout::Hwc, dtype));
        }
        let builder = Loader::builder(dataset)
            .batch_size(args.batch)
            .shuffle(0)
            .workers(args.workers)
            .drop_last(true);
        let mut dl = DeviceLoader::from_builder(builder, &device, opts)?;
        let stream = device.new_stream()?;
        let step = Duration::from_secs_f64(args.step_ms / 1e3);
        println!(
            "device {} ({}), {} batches/epoch of {}, step {:.2} ms, {} workers, depth {:?}",
            device.ordinal(),
            device.name(),
            dl.batches_per_epoch(),
            args.batch,
            args.step_ms,
            args.workers,
            args.depth
        );
        let t0 = Instant::now();
        let mut steps = 0u64;
        let mut previous: Option<cudarc::driver::CudaEvent> = None;
        let mut after_first: Option<(Duration, Duration)> = None;
        for epoch in 0..args.epochs {
            if epoch > 0 {
                dl.set_epoch(epoch);
            }
            #[allow(clippy::while_let_on_iterator)] // stats() is read inside the loop
            while let Some(batch) = dl.next() {
                let batch = batch?;
                batch.wait_on(&stream)?;
                device.spin(&stream, step)?; // the "training step", reading nothing but standing in
                let done = stream.record_event(None)?;
                if let Some(p) = previous.replace(done) {
                    p.synchronize()?; // like reading the loss of the step before
                }
                steps += 1;
                if steps == 1 {
                    let s = dl.stats();
                    after_first = Some((s.elapsed, s.waited));
                }
                // `batch` drops here: its buffer is reused once `stream` has passed this step.
            }
        }
        stream.synchronize()?;
        let wall = t0.elapsed();
        let s = dl.stats();
        let gpu_busy = steps as f64 * step.as_secs_f64() / wall.as_secs_f64();
        println!("{s}");
        println!(
            "steps {steps} in {:.3}s; GPU busy with steps {:.1}% of the time; waited for data {:.2}% of the time",
            wall.as_secs_f64(),
            100.0 * gpu_busy,
            100.0 * s.wait_fraction()
        );
        if let Some((e1, w1)) = after_first {
            let e = s.elapsed.saturating_sub(e1).as_secs_f64();
            let w = s.waited.saturating_sub(w1).as_secs_f64();
            if e > 0.0 {
                println!(
                    "after the first batch: waited for data {:.2}% of the time",
                    100.0 * w / e
                );
            }
        }
        println!(
            "RESULT wait_fraction={:.4} gpu_busy={:.4} h2d_GBps={:.2} e2e_GBps={:.2}",
            s.wait_fraction(),
            gpu_busy,
            s.h2d_bytes_per_sec() / 1e9,
            s.bytes_per_sec() / 1e9
        );
        drop(dl);
        let _ = std::fs::remove_dir_all(&tmp);
        Ok(())
    }
}
