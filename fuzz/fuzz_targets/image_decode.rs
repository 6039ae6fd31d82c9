//! cargo-fuzz target: any bytes as an encoded image: probed, decoded to RGB8, and run through
//! the train (RandomResizedCrop + flip, u8; and with a 4096-pixel `max_pixels`) and eval
//! (Resize + CenterCrop, f16 normalised) transforms.
//!
//! `cargo +nightly fuzz run image_decode corpus/image_decode`. Every call must return a value
//! or an `Error::Image`, never panic. Seed the corpus with small JPEGs and PNGs.

#![no_main]

use std::sync::OnceLock;

use gpufeed::Error;
use gpufeed::codec::{DecodeLimits, decode_rgb8, probe};
use gpufeed::format::DType;
use gpufeed::transform::SampleContext;
use gpufeed::transform::image::{ImageTransform, Normalize};
use libfuzzer_sys::fuzz_target;

fn transforms() -> &'static [ImageTransform] {
    static T: OnceLock<Vec<ImageTransform>> = OnceLock::new();
    T.get_or_init(|| {
        let train = ImageTransform::train(16).build();
        let eval = ImageTransform::eval(16)
            .dtype(DType::F16)
            .normalize(Normalize::IMAGENET)
            .build();
        // A small pixel limit, so that inputs reach the limit's refusal too.
        let small = ImageTransform::train(8).max_pixels(4096).build();
        [train, eval, small].into_iter().flatten().collect()
    })
}

fn image_error_or_ok<T>(r: gpufeed::Result<T>) {
    if let Err(e) = r {
        assert!(matches!(e, Error::Image { .. }), "not an image error: {e}");
    }
}

fuzz_target!(|data: &[u8]| {
    let name = "fuzz.img";
    image_error_or_ok(probe(data, name));
    let (mut out, mut scratch) = (Vec::new(), Vec::new());
    if let Ok(d) = decode_rgb8(data, name, &DecodeLimits::default(), &mut out, &mut scratch) {
        assert_eq!(out.len(), d.width as usize * d.height as usize * 3);
    }
    for (k, t) in transforms().iter().enumerate() {
        let mut slot = vec![0u8; t.image_output().sample_bytes()];
        let ctx = SampleContext {
            index: k as u64,
            position: 0,
            batch: 0,
            epoch: 0,
            seed: 1,
        };
        image_error_or_ok(t.apply_image(data, name, &ctx, &mut slot));
    }
});
