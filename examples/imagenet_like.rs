//! From a folder of JPEGs to normalised f16 batches, the ImageNet way.
//!
//! `cargo run --release --example imagenet_like [DIR]`: DIR is an ImageFolder
//! (`DIR/<class>/<image>.jpg`); without one, a small folder of synthetic 500x375 JPEGs is
//! written to a temporary directory first. The example then
//!
//! 1. opens the folder (sorted class names give labels 0..k),
//! 2. packs it into one packed record file (what `gpufeed pack --from imagefolder` does),
//! 3. trains-style loads it: RandomResizedCrop(224) + flip, batches of 32 on every core,
//!    f16 CHW normalised with ImageNet's mean/std, and prints what it got.
//!
//! With the `cuda` feature and a GPU (`cargo run --release --features cuda --example
//! imagenet_like`), step 3 ends on the device: the workers write u8 CHW into pinned batch
//! buffers (half the bytes of f16), the copy thread moves each batch to GPU 0 and normalises
//! it there to f16, and the loop receives device batches. Without a GPU it says so and
//! normalises on the host.

use std::path::PathBuf;

use gpufeed::format::{DType, RecordFile};
use gpufeed::source::{Dataset, ImageFolder, pack_image_folder};
use gpufeed::transform::image::{ImageTransform, Normalize, OnBadImage};
use gpufeed::{Loader, Result};
use image::ImageEncoder;

fn synthesise(root: &std::path::Path, classes: usize, per_class: usize) -> Result<()> {
    let (w, h) = (500u32, 375u32);
    for c in 0..classes {
        let dir = root.join(format!("class_{c}"));
        std::fs::create_dir_all(&dir).map_err(gpufeed::Error::user)?;
        for i in 0..per_class {
            let px: Vec<u8> = (0..w * h * 3)
                .map(|k| {
                    let (x, y, ch) = ((k / 3) % w, (k / 3) / w, k % 3);
                    ((x * (c as u32 + 1) + y * (i as u32 + 2) + ch * 60) % 256) as u8
                })
                .collect();
            let mut jpeg = Vec::new();
            image::codecs::jpeg::JpegEncoder::new_with_quality(&mut jpeg, 90)
                .write_image(&px, w, h, image::ExtendedColorType::Rgb8)
                .map_err(gpufeed::Error::user)?;
            std::fs::write(dir.join(format!("{i:04}.jpg")), jpeg).map_err(gpufeed::Error::user)?;
        }
    }
    Ok(())
}

fn main() -> Result<()> {
    let tmp = tempfile::tempdir().map_err(gpufeed::Error::user)?;
    let dir = match std::env::args().nth(1) {
        Some(d) => PathBuf::from(d),
        None => {
            let d = tmp.path().join("jpegs");
            synthesise(&d, 4, 40)?;
            println!("wrote 160 synthetic JPEGs under {}", d.display());
            d
        }
    };
    let folder = ImageFolder::open(&dir)?;
    println!(
        "{}: {} images in {} classes ({:?}...)",
        dir.display(),
        folder.len(),
        folder.classes().len(),
        &folder.classes()[..folder.classes().len().min(3)]
    );

    let packed = tmp.path().join("train.gfd");
    let summary = pack_image_folder(&folder, &packed, |_| {})?;
    println!(
        "packed {} records, {} bytes",
        summary.records, summary.file_bytes
    );

    #[cfg(feature = "cuda")]
    match gpufeed::cuda::Device::open(0) {
        Ok(device) => return on_device(&packed, &device),
        Err(e) => println!("{e}: normalising on the host instead"),
    }

    let transform = ImageTransform::train(224)
        .dtype(DType::F16)
        .normalize(Normalize::IMAGENET)
        .on_bad_image(OnBadImage::Skip)
        .build()?;
    let image_stats = transform.stats();
    let loader = Loader::builder(RecordFile::open(&packed)?)
        .transform(transform)
        .batch_size(32)
        .shuffle(42)
        .drop_last(true)
        .shard(0, 1)
        .build()?;
    let mut loader = loader;
    for batch in loader.by_ref() {
        let batch = batch?;
        let images = batch.field::<u16>("image")?; // f16 bits, [32, 3, 224, 224]
        let labels = batch.field::<i64>("label")?;
        let first = half::f16::from_bits(images[0]).to_f32();
        println!(
            "batch {}: {} images, labels {:?}..., first value {first:.3}",
            batch.number(),
            batch.len(),
            &labels[..4]
        );
    }
    let s = loader.stats();
    println!(
        "{:.0} images/s, {} bad images skipped",
        s.samples_per_sec(),
        image_stats.skipped()
    );
    Ok(())
}

/// Step 3 on the GPU: u8 CHW batches copied to `device` and normalised to f16 there.
#[cfg(feature = "cuda")]
fn on_device(packed: &std::path::Path, device: &gpufeed::cuda::Device) -> Result<()> {
    use gpufeed::cuda::{Convert, DeviceLoader, DeviceLoaderOptions};
    use gpufeed::transform::image::Layout;

    let transform = ImageTransform::train(224) // u8, CHW
        .on_bad_image(OnBadImage::Skip)
        .build()?;
    let image_stats = transform.stats();
    let builder = Loader::builder(RecordFile::open(packed)?)
        .transform(transform)
        .batch_size(32)
        .shuffle(42)
        .drop_last(true)
        .shard(0, 1);
    let normalise = Convert::imagenet("image", Layout::Chw, DType::F16);
    let opts = DeviceLoaderOptions::default().convert(normalise);
    let mut feed = DeviceLoader::from_builder(builder, device, opts)?;
    // The training step's stream: it waits for each batch's copy and conversion on the GPU,
    // never on the host.
    let step = device.new_stream()?;
    for batch in feed.by_ref() {
        let batch = batch?;
        batch.wait_on(&step)?;
        let image = batch.field::<u16>("image")?; // f16 bits, a view borrowing `batch`
        println!(
            "batch {}: {:?} {:?}, {} elements on the device",
            batch.number(),
            image.dtype(),
            image.shape(),
            image.len()
        );
    }
    step.synchronize().map_err(|e| gpufeed::Error::Cuda {
        op: "synchronize the step stream",
        what: e.to_string(),
    })?;
    let s = feed.stats();
    println!(
        "on {}: {:.0} images/s, {} bad images skipped",
        device.name(),
        s.samples as f64 / s.elapsed.as_secs_f64().max(1e-9),
        image_stats.skipped()
    );
    Ok(())
}
