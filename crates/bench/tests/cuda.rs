//! The device benches on a GPU (feature `cuda`), under the GPU tests' harness: ignored, not
//! passed, without a GPU; failed with `GPUFEED_REQUIRE_GPU=1` and no GPU.

#[path = "../../../tests/cuda_common/mod.rs"]
mod cuda_common;
#[path = "../../../tests/image_common/mod.rs"]
mod image_common;

mod device {
    use gpufeed::format::DType;
    use gpufeed::transform::image::Decode;
    use gpufeed_bench::{ImageBenchConfig, bench_images_device};

    use crate::cuda_common::device;
    use crate::image_common;

    pub fn device_image_bench_counts_every_image() {
        let Some(device) = device() else { return };
        let dir = tempfile::tempdir().unwrap();
        image_common::jpeg_folder(dir.path(), 2, 5, 64, 48);
        let cfg = ImageBenchConfig {
            workers: gpufeed::Setting::Fixed(2),
            batch_size: 4,
            size: 24,
            dtype: DType::F16,
            epochs: 2,
            ..ImageBenchConfig::default()
        };
        let r = bench_images_device(dir.path(), &cfg, &device).unwrap();
        assert_eq!((r.images, r.epochs, r.skipped), (20, 2, 0));
        assert!(r.device.is_some() && r.steady_images_per_sec.is_some());
    }

    pub fn device_image_bench_decodes_on_the_gpu_with_stage_figures_per_epoch() {
        let Some(device) = device() else { return };
        let dir = tempfile::tempdir().unwrap();
        image_common::jpeg_folder(dir.path(), 2, 5, 64, 48);
        let cfg = ImageBenchConfig {
            workers: gpufeed::Setting::Fixed(2),
            batch_size: 4,
            size: 24,
            dtype: DType::F16,
            epochs: 2,
            decode: Decode::Gpu,
            cpu_share: Some(0.0),
            ..ImageBenchConfig::default()
        };
        let r = bench_images_device(dir.path(), &cfg, &device).unwrap();
        assert_eq!((r.images, r.epochs, r.skipped, r.decode), (20, 2, 0, "gpu"));
        let d = r.decode_report.as_ref().expect("the GPU decode's report");
        let c = &d.counts;
        assert_eq!(
            c.hardware + c.gpu,
            20,
            "every JPEG to nvJPEG at a CPU share of 0: {d:?}"
        );
        // The loader's figures when made and at each epoch's end (the command's epoch_details).
        let samples: Vec<u64> = r.device_stats.iter().map(|s| s.samples).collect();
        assert_eq!(samples, [0, 10, 20]);
    }
}

fn main() -> std::process::ExitCode {
    cuda_common::run_gpu_tests(gpu_tests![device: [
        device_image_bench_counts_every_image,
        device_image_bench_decodes_on_the_gpu_with_stage_figures_per_epoch,
    ]])
}
