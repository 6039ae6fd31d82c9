//! The image commands' bodies, for `gpufeed pack --from imagefolder DIR -o OUT` and
//! `gpufeed bench --images DIR|PACKED`: the command's argument parsing calls these.

use std::path::Path;

use gpufeed::format::PackSummary;
use gpufeed::source::{Dataset, ImageFolder, pack_image_folder};
use gpufeed_bench::{ImageBenchConfig, ImageBenchReport, bench_images as run};

/// Packs the ImageFolder at `dir` into the packed record file `out` (fields `image`, `label`,
/// `size` = `[height, width]`, `path`), with a progress bar on stderr when `progress` is set.
/// Returns what was written and the bytes of the image files read.
pub fn pack_imagefolder(
    dir: &Path,
    out: &Path,
    progress: bool,
) -> gpufeed::Result<(PackSummary, u64)> {
    let folder = ImageFolder::open(dir)?;
    let bar = if progress {
        indicatif::ProgressBar::new(folder.len())
    } else {
        indicatif::ProgressBar::hidden()
    };
    bar.set_style(
        indicatif::ProgressStyle::with_template(
            "{msg} {wide_bar} {pos}/{len} images [{elapsed_precise} < {eta_precise}]",
        )
        .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar()),
    );
    bar.set_message(format!("packing {} classes", folder.classes().len()));
    let summary = pack_image_folder(&folder, out, |n| bar.set_position(n))?;
    bar.finish_and_clear();
    // The packed file holds each image's bytes whole: their sum is what was read.
    let packed = gpufeed::RecordFile::open(&summary.path)?;
    let image = packed.schema().index_of("image").unwrap_or(0);
    let mut input = 0u64;
    for i in 0..packed.len() {
        input += packed.get(i)?.try_field(image)?.len() as u64;
    }
    Ok((summary, input))
}

/// Runs decode + RandomResizedCrop + flip through the loader over `path` (an ImageFolder
/// directory or a packed file of images) and reports images/s, per epoch and in all.
pub fn bench_images(path: &Path, cfg: &ImageBenchConfig) -> gpufeed::Result<ImageBenchReport> {
    run(path, cfg)
}
