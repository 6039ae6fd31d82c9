//! The image bench (`gpufeed bench --images`): epochs, limits and what it refuses.

use gpufeed::Error;
use gpufeed_bench::{ImageBenchConfig, bench_images};

use crate::image_common;

#[test]
fn image_bench_runs_epochs_and_reports_each() {
    let dir = tempfile::tempdir().unwrap();
    image_common::jpeg_folder(dir.path(), 1, 10, 40, 30);
    let cfg = ImageBenchConfig {
        workers: gpufeed::Setting::Fixed(2),
        batch_size: 4,
        size: 16,
        epochs: 3,
        ..ImageBenchConfig::default()
    };
    let r = bench_images(dir.path(), &cfg).unwrap();
    assert_eq!((r.images, r.epochs, r.kind), (30, 3, "imagefolder"));
    assert_eq!(r.epoch_images_per_sec.len(), 3);
    assert!(r.steady_images_per_sec.is_some_and(|s| s > 0.0));

    // drop_last: 2 whole batches of 4 per epoch; one epoch: no steady figure.
    let one = ImageBenchConfig {
        epochs: 1,
        drop_last: true,
        ..cfg.clone()
    };
    let r = bench_images(dir.path(), &one).unwrap();
    assert_eq!((r.images, r.epoch_images_per_sec.len()), (8, 1));
    assert_eq!(r.steady_images_per_sec, None);

    // The limit counts across epochs and stops at the batch that reaches it.
    let limited = ImageBenchConfig {
        limit: Some(13),
        ..cfg.clone()
    };
    let r = bench_images(dir.path(), &limited).unwrap();
    assert_eq!((r.images, r.epochs), (14, 2));

    let none = ImageBenchConfig { epochs: 0, ..cfg };
    assert!(matches!(
        bench_images(dir.path(), &none),
        Err(Error::InvalidConfig {
            setting: "epochs",
            ..
        })
    ));
}

/// `gpufeed bench --verify` and the image bench refuse what has no checksums.
#[test]
fn the_image_bench_refuses_to_verify_a_folder() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::create_dir_all(dir.path().join("c")).unwrap();
    std::fs::write(dir.path().join("c/a.png"), b"x").unwrap();
    let cfg = ImageBenchConfig {
        verify_checksums: true,
        ..ImageBenchConfig::default()
    };
    let e = bench_images(dir.path(), &cfg).unwrap_err();
    assert!(
        matches!(
            e,
            Error::InvalidConfig {
                setting: "verify_checksums",
                ..
            }
        ),
        "{e}"
    );
}
