//! Token batches on a real GPU: the device loader's batches (narrow integers over PCIe, widened
//! by the copy stage, into device buffers poisoned before each copy) equal the host loader's
//! byte for byte, field by field, over two epochs of packed and concatenated rows from 16-bit
//! and 32-bit sources; states agree and a device loader resumes where the host one stood; a
//! widening the kernel cannot do is refused before any copy.

use std::sync::Arc;

use crate::cuda_common;
use crate::token_common::write_megatron;

use gpufeed::cuda::{DeviceLoaderOptions, Widen};
use gpufeed::format::DType;
use gpufeed::source::tokens::{IndexedTokens, TokenSource};
use gpufeed::tokens::{
    CU_SEQLENS, DOCUMENT_IDS, INPUT_IDS, LABELS, POSITION_IDS, SampleMode, TokenLoader,
    TokenLoaderBuilder,
};
use gpufeed::{BatchStream, ErrorKind};

use cuda_common::{Rng, device};

const FIELDS: [&str; 5] = [INPUT_IDS, LABELS, POSITION_IDS, DOCUMENT_IDS, CU_SEQLENS];

/// A Megatron dataset of `n` documents of random lengths (1 to 700 tokens) whose tokens span
/// the dtype's range (`code` 8: uint16, up to 65,535; 4: int32, up to 2^31 - 1).
fn source(
    dir: &std::path::Path,
    name: &str,
    code: u8,
    n: usize,
    rng: &mut Rng,
) -> Arc<dyn TokenSource> {
    let max = if code == 8 { 1u64 << 16 } else { 1u64 << 31 };
    let docs: Vec<Vec<u32>> = (0..n)
        .map(|_| {
            let len = 1 + rng.next_u64() % 700;
            (0..len).map(|_| (rng.next_u64() % max) as u32).collect()
        })
        .collect();
    let prefix = dir.join(name);
    write_megatron(&prefix, &docs, code);
    Arc::new(IndexedTokens::open(&prefix).unwrap())
}

pub fn device_token_batches_are_the_host_ones_widened_on_the_gpu() {
    let Some(dev) = device() else { return };
    let mut rng = Rng::fresh("device tokens");
    let dir = tempfile::tempdir().unwrap();
    let short = source(dir.path(), "short", 8, 300, &mut rng);
    let long = source(dir.path(), "long", 4, 200, &mut rng);
    type Setup = fn(TokenLoaderBuilder) -> TokenLoaderBuilder;
    type Sources = Vec<Arc<dyn TokenSource>>;
    let cases: [(&str, Sources, Setup); 4] = [
        // u16 ids, i32 labels and u16 positions over PCIe, all i64 on the GPU.
        ("packed, 16-bit tokens", vec![short.clone()], |b| {
            b.mode(SampleMode::Packed)
        }),
        // u32 ids (a 32-bit source in the blend), i64 labels, u16 positions.
        (
            "concatenated blend of 16- and 32-bit tokens",
            vec![short.clone(), long.clone()],
            |b| b.mode(SampleMode::Concatenated).mask_document_ends(true),
        ),
        // i32 outputs: u16 ids and positions widened to i32, i32 labels copied as they are.
        ("packed, i32 outputs", vec![short.clone()], |b| {
            b.mode(SampleMode::Packed)
                .input_dtype(DType::I32)
                .label_dtype(DType::I32)
                .position_dtype(DType::I32)
        }),
        // Rows longer than u16 positions: positions cross as i64, ids as u16.
        ("rows of 70,000 tokens", vec![short.clone()], |b| {
            b.pad_id(7)
        }),
    ];
    for (what, sources, setup) in cases {
        let seq_len = if what.starts_with("rows of") {
            70_000
        } else {
            512
        };
        let builder = || {
            let mut b = TokenLoader::builder(seq_len, 6)
                .shuffle(rng_seed(what))
                .shard(1, 2)
                .workers(3);
            for (i, s) in sources.iter().enumerate() {
                b = b.weighted(Arc::clone(s), 1.0 + i as f64);
            }
            setup(b)
        };
        let mut host = builder().build().unwrap();
        let mut gpu = builder()
            .build_device(&dev, DeviceLoaderOptions::default().poison(0xA5))
            .unwrap();
        let dtypes = host.dtypes();
        let expected = [
            dtypes.input_ids,
            dtypes.labels,
            dtypes.position_ids,
            DType::I32,
            DType::I32,
        ];
        let fields = gpu.loader().fields();
        for (name, dtype) in FIELDS.iter().zip(expected) {
            let f = fields.iter().find(|f| f.name == *name).unwrap();
            assert_eq!(f.dtype, dtype, "{what}: device field {name}");
        }
        let mut batches = 0;
        for epoch in 0..2 {
            host.set_epoch(epoch);
            gpu.set_epoch(epoch);
            loop {
                let (h, d) = match (host.next(), gpu.next()) {
                    (Some(h), Some(d)) => (h.unwrap(), d.unwrap()),
                    (None, None) => break,
                    (h, d) => panic!(
                        "{what}: epoch {epoch}: host {} and device {} end apart",
                        h.is_some(),
                        d.is_some()
                    ),
                };
                for name in FIELDS {
                    let on_device = d.field_to_host(name).unwrap();
                    assert!(
                        on_device == h.field_bytes(name).unwrap(),
                        "{what}: epoch {epoch} batch {}: field {name} differs on the device",
                        h.number()
                    );
                }
                assert_eq!(
                    d.tokens(),
                    h.tokens(),
                    "{what}: counts of batch {}",
                    h.number()
                );
                batches += 1;
            }
        }
        assert!(batches >= 2, "{what}: only {batches} batches");
        assert_eq!(gpu.token_stats(), host.token_stats(), "{what}");
        assert_eq!(gpu.state(), host.state(), "{what}");
    }

    // A device loader resumed from a host loader's state mid-epoch, at another world size,
    // goes on with the same batches as the host one resumed so.
    let builder = |rank, world| {
        TokenLoader::builder(256, 8)
            .source(short.clone())
            .mode(SampleMode::Packed)
            .shuffle(5)
            .shard(rank, world)
    };
    let mut first = builder(0, 2).build().unwrap();
    for _ in 0..3 {
        first.next().unwrap().unwrap();
    }
    let state = first.state();
    let host = builder(2, 3).resume(state.clone()).build().unwrap();
    let mut gpu = builder(2, 3)
        .resume(state)
        .build_device(&dev, DeviceLoaderOptions::default().poison(0x5A))
        .unwrap();
    let mut n = 0;
    for h in host {
        let (h, d) = (h.unwrap(), gpu.next().unwrap().unwrap());
        assert_eq!(d.number(), h.number());
        for name in FIELDS {
            assert!(d.field_to_host(name).unwrap() == h.field_bytes(name).unwrap());
        }
        n += 1;
    }
    assert!(gpu.next().is_none());
    assert!(n > 0);
}

/// A seed per case, so that the cases do not share an order.
fn rng_seed(what: &str) -> u64 {
    what.bytes()
        .fold(7u64, |h, b| h.wrapping_mul(31).wrapping_add(u64::from(b)))
}

pub fn widening_refuses_what_it_cannot_widen() {
    let Some(dev) = device() else { return };
    let mut rng = Rng::fresh("widen errors");
    let dir = tempfile::tempdir().unwrap();
    let short = source(dir.path(), "short", 8, 50, &mut rng);
    let builder = || TokenLoader::builder(128, 4).source(short.clone());
    let refused = |b: TokenLoaderBuilder, w: Widen, says: &str| {
        let e = b
            .build_device(&dev, DeviceLoaderOptions::default().widen(w))
            .unwrap_err();
        assert_eq!(e.kind(), ErrorKind::Config, "{e}");
        assert!(e.to_string().contains(says), "{e}");
    };
    // document_ids are i32: not to a float, not to a narrower integer.
    refused(
        builder(),
        Widen::new(DOCUMENT_IDS, DType::F32),
        "cannot widen to f32",
    );
    refused(
        builder(),
        Widen::new(DOCUMENT_IDS, DType::U16),
        "cannot widen to u16",
    );
    // u32 ids do not all fit i32.
    refused(
        builder().input_dtype(DType::U32),
        Widen::new(INPUT_IDS, DType::I32),
        "is u32",
    );
    // The loader widens input_ids itself; a second widening of it is refused.
    refused(
        builder(),
        Widen::new(INPUT_IDS, DType::I64),
        "more than once",
    );
    refused(
        builder(),
        Widen::new("tokens", DType::I64),
        "no batch field `tokens`",
    );
}
