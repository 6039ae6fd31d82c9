//! A small convolutional network trained with candle on an ImageFolder of JPEGs, fed by gpufeed
//! (RandomResizedCrop(224) + flip + ImageNet normalisation, bf16 on the GPU), or by the loop a
//! candle user would write (decode with `image`, crop, stack, copy), to compare the two.
//!
//! ```text
//! cargo run --release --features candle-cuda --example candle_train -- DIR \
//!     [--feed gpufeed|candle|candle-seq] [--epochs 3] [--batch 128] [--workers N] \
//!     [--decode cpu|gpu|auto] [--dtype bf16|f32] [--lr 0.01] [--steps N] [--make-data N] \
//!     [--json]
//! ```
//!
//! - `DIR` is an ImageFolder (`DIR/<class>/<image>.jpg`); `--make-data N` first writes N
//!   images per class of 10 classes there (synthetic 320x240 JPEGs whose class is a colour
//!   and a stripe direction under noise, so that the loss has something to learn), unless the
//!   folder already holds them.
//! - `--feed gpufeed` (the default): a `DeviceLoader` on candle's own context (the workers
//!   decode, crop and flip to u8, normalised on the GPU; or with `--decode gpu` all of it on the
//!   GPU), each batch handed over with `DeviceBatch::tensor` (one device-to-device copy on
//!   candle's stream). At the middle of the first epoch the loader's state is taken; after
//!   training, a loader resumed from it delivers the very batch the run went on with (printed).
//! - `--feed candle`: per step, the batch's JPEGs decoded, cropped and resized with the `image`
//!   crate by rayon on every core, stacked into one f32 tensor and copied to the GPU;
//!   `--feed candle-seq`: the same on the training thread alone (candle-datasets' batcher).
//!
//! The model: five 3x3 convolutions of stride 2 (32 to 256 channels, ReLU), a global average
//! and a linear layer; weights in f32, the convolutions computed in bf16 (`--dtype`), the loss
//! (cross-entropy) in f32; SGD with momentum, the gradients' norm clipped. Each step reads its
//! loss back (as a loop that prints it), so a step's time is the data's wait plus the GPU's
//! work, and the wait is the time spent getting the batch onto the GPU. Per epoch it prints the
//! mean loss, the accuracy, images/s and the share of the time spent waiting for data; `--json`
//! ends with one line of the figures.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use candle_core::{DType as CandleDType, Device as CandleDevice, Tensor, Var};
use gpufeed::cuda::{Convert, DeviceLoader, DeviceLoaderOptions};
use gpufeed::source::{Dataset, ImageFolder};
use gpufeed::transform::image::{Decode, ImageTransform, Layout, Normalize};
use gpufeed::{BatchStream, DType, Loader, LoaderBuilder};
use rayon::prelude::*;

type Error = Box<dyn std::error::Error + Send + Sync>;
type Result<T> = std::result::Result<T, Error>;

const CLASSES: usize = 10;
/// The gradients' global norm is clipped to this.
const CLIP: f64 = 2.0;
const SIZE: usize = 224;

#[derive(Clone, Copy, PartialEq, Debug)]
enum Feed {
    Gpufeed,
    Candle,
    CandleSeq,
}

struct Args {
    dir: PathBuf,
    feed: Feed,
    epochs: u64,
    batch: usize,
    workers: usize,
    decode: Decode,
    dtype: CandleDType,
    lr: f64,
    steps: Option<usize>,
    make_data: Option<usize>,
    json: bool,
}

/// `flag`'s value `v` as a number, or an error naming the flag.
fn number<T: std::str::FromStr>(flag: &str, v: String) -> std::result::Result<T, String>
where
    T::Err: std::fmt::Display,
{
    v.parse().map_err(|e| format!("{flag}: {e}"))
}

fn parse() -> Result<Args> {
    let mut a = Args {
        dir: PathBuf::new(),
        feed: Feed::Gpufeed,
        epochs: 3,
        batch: 128,
        workers: std::thread::available_parallelism().map_or(2, |n| n.get()),
        decode: Decode::Cpu,
        dtype: CandleDType::BF16,
        lr: 0.01,
        steps: None,
        make_data: None,
        json: false,
    };
    let mut dir = None;
    let mut it = std::env::args().skip(1);
    while let Some(arg) = it.next() {
        let mut value = |name: &str| it.next().ok_or(format!("{name} needs a value"));
        match arg.as_str() {
            "--feed" => {
                a.feed = match value("--feed")?.as_str() {
                    "gpufeed" => Feed::Gpufeed,
                    "candle" => Feed::Candle,
                    "candle-seq" => Feed::CandleSeq,
                    other => Err(format!(
                        "--feed: {other:?} is not gpufeed, candle or candle-seq"
                    ))?,
                }
            }
            "--epochs" => a.epochs = number(&arg, value(&arg)?)?,
            "--batch" => a.batch = number(&arg, value(&arg)?)?,
            "--workers" => a.workers = number(&arg, value(&arg)?)?,
            "--decode" => a.decode = value("--decode")?.parse()?,
            "--dtype" => {
                a.dtype = match value("--dtype")?.as_str() {
                    "bf16" => CandleDType::BF16,
                    "f32" => CandleDType::F32,
                    other => Err(format!("--dtype: {other:?} is not bf16 or f32"))?,
                }
            }
            "--lr" => a.lr = number(&arg, value(&arg)?)?,
            "--steps" => a.steps = Some(number(&arg, value(&arg)?)?),
            "--make-data" => a.make_data = Some(number(&arg, value(&arg)?)?),
            "--json" => a.json = true,
            p if !p.starts_with("--") && dir.is_none() => dir = Some(PathBuf::from(p)),
            other => Err(format!("unknown argument {other:?}"))?,
        }
    }
    a.dir = dir.ok_or("usage: candle_train DIR [--feed gpufeed|candle|candle-seq] ...")?;
    if a.batch == 0 || a.epochs == 0 {
        Err("--batch and --epochs must be at least 1")?;
    }
    Ok(a)
}

fn main() {
    if let Err(e) = run() {
        eprintln!("candle_train: {e}");
        std::process::exit(1);
    }
}

fn run() -> Result<()> {
    let args = parse()?;
    if let Some(per_class) = args.make_data {
        make_data(&args.dir, per_class)?;
    }
    let gpu = match CandleDevice::new_cuda(0) {
        Ok(d) => d,
        Err(e) => Err(format!("no CUDA device for candle: {e}"))?,
    };
    let mut model = Model::new(&gpu)?;
    let mut feed: Box<dyn BatchSource> = match args.feed {
        Feed::Gpufeed => Box::new(GpufeedSource::new(&args, &gpu)?),
        Feed::Candle | Feed::CandleSeq => Box::new(ImageCrateSource::new(&args, &gpu)?),
    };
    println!(
        "{} images in {} classes, batch {}, feed {:?}, {} workers, {:?} compute",
        feed.len(),
        CLASSES,
        args.batch,
        args.feed,
        args.workers,
        args.dtype
    );
    let mut run = Totals::default();
    for epoch in 0..args.epochs {
        feed.start_epoch(epoch)?;
        let mut e = Totals::default();
        let mut correct = 0usize;
        let mut loss_sum = 0.0f64;
        loop {
            if args.steps.is_some_and(|s| e.steps >= s) {
                break;
            }
            let t0 = Instant::now();
            let Some((x, y)) = feed.next_batch(&gpu)? else {
                break;
            };
            let waited = t0.elapsed();
            let (loss, hits) = model.step(&x, &y, args.dtype, args.lr)?;
            let step = t0.elapsed();
            loss_sum += f64::from(loss) * y.dims()[0] as f64;
            correct += hits;
            e.add(y.dims()[0], waited, step);
        }
        feed.end_epoch();
        println!(
            "epoch {epoch}: loss {:.4}, accuracy {:.3}, {} steps, {:.0} img/s, waiting for data {:.1}% of the time",
            loss_sum / e.images.max(1) as f64,
            correct as f64 / e.images.max(1) as f64,
            e.steps,
            e.images_per_sec(),
            100.0 * e.wait_fraction()
        );
        if epoch > 0 || args.epochs == 1 {
            run.merge(&e);
        }
    }
    let resume = feed.check_resume()?;
    if let Some(line) = &resume {
        println!("{line}");
    }
    println!(
        "after the first epoch: {:.0} img/s, waiting for data {:.2}% of the time (longest wait {:.1} ms)",
        run.images_per_sec(),
        100.0 * run.wait_fraction(),
        run.longest_wait.as_secs_f64() * 1e3
    );
    if args.json {
        println!(
            "{}",
            serde_json::json!({
                "feed": format!("{:?}", args.feed).to_lowercase(),
                "workers": args.workers,
                "batch": args.batch,
                "decode": args.decode.to_string(),
                "dtype": format!("{:?}", args.dtype).to_lowercase(),
                "images_per_sec": run.images_per_sec(),
                "wait_fraction": run.wait_fraction(),
                "longest_wait_ms": run.longest_wait.as_secs_f64() * 1e3,
                "steps": run.steps,
                "resume": resume,
            })
        );
    }
    Ok(())
}

/// Time and images of a stretch of steps.
#[derive(Default)]
struct Totals {
    steps: usize,
    images: usize,
    wait: Duration,
    total: Duration,
    longest_wait: Duration,
}

impl Totals {
    fn add(&mut self, images: usize, wait: Duration, step: Duration) {
        self.steps += 1;
        self.images += images;
        self.wait += wait;
        self.total += step;
        self.longest_wait = self.longest_wait.max(wait);
    }

    fn merge(&mut self, o: &Totals) {
        self.steps += o.steps;
        self.images += o.images;
        self.wait += o.wait;
        self.total += o.total;
        self.longest_wait = self.longest_wait.max(o.longest_wait);
    }

    fn images_per_sec(&self) -> f64 {
        self.images as f64 / self.total.as_secs_f64().max(1e-9)
    }

    fn wait_fraction(&self) -> f64 {
        self.wait.as_secs_f64() / self.total.as_secs_f64().max(1e-9)
    }
}

/// Batches of images `[B, 3, 224, 224]` (normalised) and labels `[B]` (i64) on the GPU.
trait BatchSource {
    fn len(&self) -> usize;
    fn start_epoch(&mut self, epoch: u64) -> Result<()>;
    fn next_batch(&mut self, gpu: &CandleDevice) -> Result<Option<(Tensor, Tensor)>>;
    fn end_epoch(&mut self) {}
    /// A line on the resume check, for feeds that can resume.
    fn check_resume(&mut self) -> Result<Option<String>> {
        Ok(None)
    }
}

/// gpufeed: a device loader on candle's context; batches handed over with `tensor`.
struct GpufeedSource {
    builder: Box<dyn Fn() -> Result<LoaderBuilder>>,
    opts: DeviceLoaderOptions,
    loader: DeviceLoader,
    gpufeed_device: gpufeed::cuda::Device,
    len: usize,
    steps: usize,
    /// The state taken mid-epoch and the samples of the batch the run went on with.
    saved: Option<(gpufeed::LoaderState, Vec<u64>)>,
    take_state_at: usize,
}

impl GpufeedSource {
    fn new(args: &Args, gpu: &CandleDevice) -> Result<GpufeedSource> {
        let dir = args.dir.clone();
        let (batch, workers, decode) = (args.batch, args.workers, args.decode);
        let dtype = match args.dtype {
            CandleDType::F32 => DType::F32,
            _ => DType::BF16,
        };
        // Normalised on the GPU either way: the CPU decode's workers write u8 CHW (a quarter
        // of f32's bytes over PCIe) and the copy stage converts it there; the GPU decode writes
        // the normalised dtype itself.
        let cpu = decode == Decode::Cpu;
        let opts = if cpu {
            DeviceLoaderOptions::default().convert(Convert::imagenet("image", Layout::Chw, dtype))
        } else {
            DeviceLoaderOptions::default()
        };
        let builder = move || -> Result<LoaderBuilder> {
            let transform = if cpu {
                ImageTransform::train(SIZE as u32).dtype(DType::U8)
            } else {
                ImageTransform::train(SIZE as u32)
                    .dtype(dtype)
                    .normalize(Normalize::IMAGENET)
            };
            let transform = transform.decode(decode).build()?;
            Ok(Loader::builder(ImageFolder::open(&dir)?)
                .transform(transform)
                .batch_size(batch)
                .shuffle(42)
                .drop_last(true)
                .workers(workers)
                .shard(0, 1))
        };
        // gpufeed's device on candle's context: one context, and the batches' copies ordered
        // before candle's work by events, not by host waits.
        let gpufeed_device = gpufeed::candle::device_of(gpu)?;
        let loader = DeviceLoader::from_builder(builder()?, &gpufeed_device, opts.clone())?;
        let len = loader.batches_per_epoch() as usize * batch;
        let take_state_at = loader.batches_per_epoch() as usize / 2;
        Ok(GpufeedSource {
            builder: Box::new(builder),
            opts,
            loader,
            gpufeed_device,
            len,
            steps: 0,
            saved: None,
            take_state_at,
        })
    }
}

impl BatchSource for GpufeedSource {
    fn len(&self) -> usize {
        self.len
    }

    fn start_epoch(&mut self, epoch: u64) -> Result<()> {
        self.loader.set_epoch(epoch);
        Ok(())
    }

    fn next_batch(&mut self, gpu: &CandleDevice) -> Result<Option<(Tensor, Tensor)>> {
        // Mid-epoch in the first epoch: the state after the steps so far (what a checkpoint
        // saves), and the samples of the batch that comes next, to check the resume with.
        let save =
            self.saved.is_none() && self.loader.epoch() == 0 && self.steps == self.take_state_at;
        let state = save.then(|| self.loader.state());
        let Some(batch) = self.loader.next() else {
            return Ok(None);
        };
        let batch = batch?;
        if let Some(state) = state {
            self.saved = Some((state, batch.indices().to_vec()));
        }
        self.steps += 1;
        let x = batch.tensor("image", gpu)?;
        let y = batch.tensor("label", gpu)?;
        // `batch` drops here: its block is reused once candle's stream has copied it.
        Ok(Some((x, y)))
    }

    fn check_resume(&mut self) -> Result<Option<String>> {
        let Some((state, want)) = self.saved.take() else {
            return Ok(None);
        };
        let json = serde_json::to_string(&state)?;
        let restored: gpufeed::LoaderState = serde_json::from_str(&json)?;
        let builder = (self.builder)()?.resume(restored);
        let mut resumed =
            DeviceLoader::from_builder(builder, &self.gpufeed_device, self.opts.clone())?;
        resumed.set_epoch(state.epoch);
        let got = resumed
            .next()
            .ok_or("the resumed loader delivered nothing")??;
        let same = got.indices() == want.as_slice();
        Ok(Some(format!(
            "resume: a loader built with .resume(state) from the state taken at batch {} of epoch {} ({} bytes of JSON) delivers batch {} with {} the samples of the batch the run went on with",
            self.take_state_at,
            state.epoch,
            json.len(),
            got.number(),
            if same { "exactly" } else { "NOT" }
        )))
    }
}

/// The loop a candle user writes: decode with `image`, RandomResizedCrop + flip by hand,
/// normalise, stack, copy to the GPU; per batch, on the training thread (rayon for `candle`).
struct ImageCrateSource {
    files: Vec<(PathBuf, i64)>,
    order: Vec<usize>,
    at: usize,
    batch: usize,
    parallel: bool,
    epoch: u64,
}

impl ImageCrateSource {
    fn new(args: &Args, _gpu: &CandleDevice) -> Result<ImageCrateSource> {
        let folder = ImageFolder::open(&args.dir)?;
        let files = (0..folder.len())
            .map(|i| -> Result<(PathBuf, i64)> {
                Ok((folder.path(i)?, i64::from(folder.label(i)?)))
            })
            .collect::<Result<Vec<_>>>()?;
        if args.feed == Feed::Candle && args.workers > 0 {
            // One pool for the run (a second call is refused: ignore it).
            let _ = rayon::ThreadPoolBuilder::new()
                .num_threads(args.workers)
                .build_global();
        }
        Ok(ImageCrateSource {
            order: (0..files.len()).collect(),
            files,
            at: 0,
            batch: args.batch,
            parallel: args.feed == Feed::Candle,
            epoch: 0,
        })
    }
}

impl BatchSource for ImageCrateSource {
    fn len(&self) -> usize {
        self.files.len() / self.batch * self.batch
    }

    fn start_epoch(&mut self, epoch: u64) -> Result<()> {
        self.epoch = epoch;
        self.at = 0;
        let mut rng = SplitMix(0x5eed ^ epoch.wrapping_mul(0x9e37_79b9_7f4a_7c15));
        for i in (1..self.order.len()).rev() {
            let j = (rng.next() % (i as u64 + 1)) as usize;
            self.order.swap(i, j);
        }
        Ok(())
    }

    fn next_batch(&mut self, gpu: &CandleDevice) -> Result<Option<(Tensor, Tensor)>> {
        if self.at + self.batch > self.order.len() {
            return Ok(None);
        }
        let picks: Vec<usize> = self.order[self.at..self.at + self.batch].to_vec();
        self.at += self.batch;
        let epoch = self.epoch;
        let one = |&k: &usize| -> Result<Vec<f32>> {
            load_image(
                &self.files[k].0,
                epoch ^ (k as u64).wrapping_mul(0x2545_f491_4f6c_dd1d),
            )
        };
        let images: Vec<Vec<f32>> = if self.parallel {
            picks.par_iter().map(one).collect::<Result<_>>()?
        } else {
            picks.iter().map(one).collect::<Result<_>>()?
        };
        let labels: Vec<i64> = picks.iter().map(|&k| self.files[k].1).collect();
        let flat: Vec<f32> = images.concat();
        let x = Tensor::from_vec(flat, (self.batch, 3, SIZE, SIZE), &CandleDevice::Cpu)?
            .to_device(gpu)?;
        let y = Tensor::from_vec(labels, self.batch, &CandleDevice::Cpu)?.to_device(gpu)?;
        Ok(Some((x, y)))
    }
}

/// One image as the candle user's loop makes it: decoded, RandomResizedCrop(224) (scale 0.08
/// to 1, ratio 3/4 to 4/3, torchvision's ten tries then the centre), flipped half the time,
/// resized with a triangle filter, normalised with ImageNet's statistics, CHW f32.
fn load_image(path: &Path, seed: u64) -> Result<Vec<f32>> {
    let img = image::open(path)?.to_rgb8();
    let (w, h) = (img.width() as f64, img.height() as f64);
    let mut rng = SplitMix(seed);
    let mut crop = None;
    for _ in 0..10 {
        let area = w * h * (0.08 + 0.92 * rng.unit());
        let ratio =
            ((3.0f64 / 4.0).ln() + ((4.0f64 / 3.0).ln() - (3.0f64 / 4.0).ln()) * rng.unit()).exp();
        let (cw, ch) = ((area * ratio).sqrt().round(), (area / ratio).sqrt().round());
        if cw >= 1.0 && ch >= 1.0 && cw <= w && ch <= h {
            let x = (rng.unit() * (w - cw + 1.0)).floor();
            let y = (rng.unit() * (h - ch + 1.0)).floor();
            crop = Some((x as u32, y as u32, cw as u32, ch as u32));
            break;
        }
    }
    let side = w.min(h);
    let (x, y, cw, ch) = crop.unwrap_or((
        ((w - side) / 2.0) as u32,
        ((h - side) / 2.0) as u32,
        side as u32,
        side as u32,
    ));
    let cropped = image::imageops::crop_imm(&img, x, y, cw, ch).to_image();
    let mut resized = image::imageops::resize(
        &cropped,
        SIZE as u32,
        SIZE as u32,
        image::imageops::FilterType::Triangle,
    );
    if rng.unit() < 0.5 {
        image::imageops::flip_horizontal_in_place(&mut resized);
    }
    let (mean, std) = ([0.485f32, 0.456, 0.406], [0.229f32, 0.224, 0.225]);
    let mut out = vec![0f32; 3 * SIZE * SIZE];
    for (k, p) in resized.pixels().enumerate() {
        for c in 0..3 {
            out[c * SIZE * SIZE + k] = (f32::from(p[c]) / 255.0 - mean[c]) / std[c];
        }
    }
    Ok(out)
}

/// A SplitMix64 generator (the crop's and the shuffle's draws).
struct SplitMix(u64);

impl SplitMix {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    fn unit(&mut self) -> f64 {
        (self.next() >> 11) as f64 / (1u64 << 53) as f64
    }

    /// A standard normal draw (Box-Muller).
    fn normal(&mut self) -> f64 {
        let u = self.unit().max(f64::MIN_POSITIVE);
        (-2.0 * u.ln()).sqrt() * (2.0 * std::f64::consts::PI * self.unit()).cos()
    }
}

/// A convolution of stride 2 and its weights (f32, Kaiming-initialised).
struct Conv {
    w: Var,
    b: Var,
}

/// Five convolutions of stride 2 (224 to 7), a global average, a linear layer.
struct Model {
    convs: Vec<Conv>,
    fc_w: Var,
    fc_b: Var,
    /// SGD's momentum, one per parameter.
    momentum: Vec<Tensor>,
}

impl Model {
    fn new(gpu: &CandleDevice) -> Result<Model> {
        let widths = [3usize, 32, 64, 128, 256, 256];
        let mut convs = Vec::new();
        for pair in widths.windows(2) {
            let (cin, cout) = (pair[0], pair[1]);
            let std = (2.0 / (cin * 9) as f64).sqrt();
            convs.push(Conv {
                w: Var::randn(0f32, std as f32, (cout, cin, 3, 3), gpu)?,
                b: Var::zeros(cout, CandleDType::F32, gpu)?,
            });
        }
        let fc_w = Var::randn(0f32, (1.0 / 256f64).sqrt() as f32, (CLASSES, 256), gpu)?;
        let fc_b = Var::zeros(CLASSES, CandleDType::F32, gpu)?;
        let mut m = Model {
            convs,
            fc_w,
            fc_b,
            momentum: Vec::new(),
        };
        m.momentum = m
            .params()
            .iter()
            .map(|v| v.as_tensor().zeros_like())
            .collect::<candle_core::Result<_>>()?;
        Ok(m)
    }

    fn params(&self) -> Vec<&Var> {
        let mut p: Vec<&Var> = self.convs.iter().flat_map(|c| [&c.w, &c.b]).collect();
        p.extend([&self.fc_w, &self.fc_b]);
        p
    }

    fn forward(&self, x: &Tensor, dtype: CandleDType) -> candle_core::Result<Tensor> {
        let mut h = x.to_dtype(dtype)?;
        for c in &self.convs {
            let w = c.w.as_tensor().to_dtype(dtype)?;
            let b = c.b.as_tensor().to_dtype(dtype)?.reshape((1, (), 1, 1))?;
            h = h.conv2d(&w, 1, 2, 1, 1)?.broadcast_add(&b)?.relu()?;
        }
        let pooled = h.mean((2, 3))?.to_dtype(CandleDType::F32)?;
        pooled
            .matmul(&self.fc_w.as_tensor().t()?)?
            .broadcast_add(self.fc_b.as_tensor())
    }

    /// One SGD step on `x`, `y`: the batch's mean loss and its correct predictions.
    fn step(
        &mut self,
        x: &Tensor,
        y: &Tensor,
        dtype: CandleDType,
        lr: f64,
    ) -> Result<(f32, usize)> {
        let logits = self.forward(x, dtype)?;
        let shifted = logits.broadcast_sub(&logits.max_keepdim(1)?)?;
        let log_probs = shifted.broadcast_sub(&shifted.exp()?.sum_keepdim(1)?.log()?)?;
        let loss = log_probs.gather(&y.unsqueeze(1)?, 1)?.neg()?.mean_all()?;
        let grads = loss.backward()?;
        let params: Vec<Var> = self.params().into_iter().cloned().collect();
        // The gradients' global norm clipped to CLIP (on the device: no host round trip), which
        // keeps a network without normalisation layers from diverging in bf16.
        let mut squares = Vec::new();
        for p in &params {
            if let Some(g) = grads.get(p.as_tensor()) {
                squares.push(g.sqr()?.sum_all()?);
            }
        }
        let norm = Tensor::stack(&squares, 0)?.sum_all()?.sqrt()?;
        let scale = norm.affine(1.0 / CLIP, 1e-6)?.maximum(1.0)?.recip()?;
        for (p, m) in params.iter().zip(self.momentum.iter_mut()) {
            let Some(g) = grads.get(p.as_tensor()) else {
                continue;
            };
            let g = g.broadcast_mul(&scale)?;
            *m = ((&*m * 0.9)? + g)?;
            p.set(&(p.as_tensor() - (&*m * lr)?)?)?;
        }
        let hits = logits
            .argmax(1)?
            .to_dtype(CandleDType::I64)?
            .eq(y)?
            .to_dtype(CandleDType::F32)?
            .sum_all()?;
        // The loop reads its loss back, as one that prints it: the step ends when the GPU has.
        Ok((loss.to_scalar::<f32>()?, hits.to_scalar::<f32>()? as usize))
    }
}

/// Writes `per_class` JPEGs of 320x240 for each of the 10 classes under `dir`, unless there.
/// Class `c` is a hue and a stripe direction; each image draws both around its class's (the
/// neighbouring classes' hues overlap), its brightness and stripe width, and adds noise.
fn make_data(dir: &Path, per_class: usize) -> Result<()> {
    let done = (0..CLASSES).all(|c| {
        std::fs::read_dir(dir.join(format!("class_{c}"))).is_ok_and(|d| d.count() >= per_class)
    });
    if done {
        return Ok(());
    }
    let (w, h) = (320u32, 240u32);
    let tau = 2.0 * std::f64::consts::PI;
    (0..CLASSES * per_class)
        .into_par_iter()
        .try_for_each(|k| -> Result<()> {
            let (c, i) = (k % CLASSES, k / CLASSES);
            let mut rng = SplitMix(k as u64 * 7919 + 1);
            let hue = c as f64 / CLASSES as f64 + 0.06 * rng.normal();
            let angle = std::f64::consts::PI * ((3 * c) % 5) as f64 / 5.0 + 0.2 * rng.normal();
            let (dx, dy) = (angle.cos(), angle.sin());
            let period = 10.0 + 20.0 * rng.unit();
            let (phase, light) = (tau * rng.unit(), 0.6 + 0.4 * rng.unit());
            let base =
                [0.0, 1.0 / 3.0, 2.0 / 3.0].map(|o| light * (0.5 + 0.4 * (tau * (hue + o)).cos()));
            let mut px = Vec::with_capacity((w * h * 3) as usize);
            for y in 0..h {
                for x in 0..w {
                    let s = ((x as f64 * dx + y as f64 * dy) / period * tau + phase).sin();
                    for b in base {
                        let v = 255.0 * (b * (0.8 + 0.2 * s)) + 90.0 * (rng.unit() - 0.5);
                        px.push(v.clamp(0.0, 255.0) as u8);
                    }
                }
            }
            let mut jpeg = Vec::new();
            image::codecs::jpeg::JpegEncoder::new_with_quality(&mut jpeg, 90).encode(
                &px,
                w,
                h,
                image::ExtendedColorType::Rgb8,
            )?;
            let class_dir = dir.join(format!("class_{c}"));
            std::fs::create_dir_all(&class_dir)?;
            std::fs::write(class_dir.join(format!("{i:05}.jpg")), jpeg)?;
            Ok(())
        })?;
    println!(
        "wrote {} JPEGs of {w}x{h} under {}",
        CLASSES * per_class,
        dir.display()
    );
    Ok(())
}
