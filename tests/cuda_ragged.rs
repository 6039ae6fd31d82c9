//! Ragged fields on a real GPU: values and offsets of every batch checked byte by byte on the
//! device (into device buffers poisoned before each copy), only the bytes in use copied, and
//! a batch over its budget an error that passes through the copy stage.

use crate::cuda_common;

use gpufeed::cuda::{Convert, DeviceLoader, DeviceLoaderOptions, PinnedBacking};
use gpufeed::format::{Codec, DType, Field, Schema};
use gpufeed::transform::image::Layout;
use gpufeed::{Dataset, Error, ErrorKind, Loader, Result, Sample};

use cuda_common::{Rng, device};

/// In memory: `id` (u64), `text` (random bytes of random lengths, some empty), `tokens`
/// (u32 values).
struct Texts {
    records: Vec<Vec<u8>>,
    texts: Vec<Vec<u8>>,
    tokens: Vec<Vec<u32>>,
    schema: Schema,
}

impl Texts {
    fn new(n: u64, rng: &mut Rng) -> Texts {
        let schema = Schema::new(vec![
            Field::tensor("id", DType::U64, &[]),
            Field::bytes("text", Codec::Raw),
            Field::bytes("tokens", Codec::Elements(DType::U32)),
        ])
        .unwrap();
        let (mut records, mut texts, mut tokens) = (Vec::new(), Vec::new(), Vec::new());
        for i in 0..n {
            let len = match rng.next_u64() % 4 {
                0 => 0,
                1 => (rng.next_u64() % 16) as usize,
                _ => (rng.next_u64() % 5000) as usize,
            };
            let mut text = vec![0u8; len];
            rng.fill(&mut text);
            let toks: Vec<u32> = (0..len / 7).map(|_| rng.next_u64() as u32).collect();
            let tok_bytes: Vec<u8> = toks.iter().flat_map(|t| t.to_le_bytes()).collect();
            let mut r = Vec::new();
            schema
                .build_record(&[&i.to_le_bytes(), &text, &tok_bytes], &mut r)
                .unwrap();
            records.push(r);
            texts.push(text);
            tokens.push(toks);
        }
        Texts {
            records,
            texts,
            tokens,
            schema,
        }
    }
}

impl Dataset for Texts {
    fn len(&self) -> u64 {
        self.records.len() as u64
    }
    fn schema(&self) -> &Schema {
        &self.schema
    }
    fn get(&self, index: u64) -> Result<Sample<'_>> {
        Sample::borrowed(&self.records[index as usize], &self.schema)
    }
}

fn offsets_of(bytes: &[u8]) -> Vec<i64> {
    bytes
        .chunks_exact(8)
        .map(|c| i64::from_le_bytes(c.try_into().unwrap()))
        .collect()
}

pub fn ragged_fields_reach_the_device_with_every_byte() {
    let Some(dev) = device() else { return };
    let mut rng = Rng::fresh("ragged");
    let data = std::sync::Arc::new(Texts::new(400, &mut rng));
    let (texts, tokens) = (data.texts.clone(), data.tokens.clone());
    for parts in [1, 3] {
        let loader = Loader::builder(std::sync::Arc::clone(&data))
            .batch_size(32)
            .shuffle(rng.next_u64())
            .workers(3)
            .batch_parts(parts)
            .ragged_budget("text", 32 * 5000)
            .backing(PinnedBacking::new(&dev))
            .prefetch_across_epochs(false)
            .build()
            .unwrap();
        let layout = loader.layout().clone();
        let opts = DeviceLoaderOptions::default().depth(3).poison(0xAB);
        let mut dl = DeviceLoader::new(loader, &dev, opts).unwrap();
        let fields = dl.fields();
        assert!(fields[1].ragged && fields[2].ragged && !fields[0].ragged);
        let (mut seen, mut copied) = (vec![0u32; 400], 0u64);
        for b in dl.by_ref() {
            let b = b.unwrap();
            let (mut want_text, mut want_tokens) = (Vec::new(), Vec::new());
            let (mut text_offsets, mut token_offsets) = (vec![0i64], vec![0i64]);
            for &i in b.indices() {
                want_text.extend_from_slice(&texts[i as usize]);
                want_tokens.extend(tokens[i as usize].iter().flat_map(|t| t.to_le_bytes()));
                text_offsets.push(want_text.len() as i64);
                token_offsets.push(want_tokens.len() as i64 / 4);
                seen[i as usize] += 1;
            }
            // Every byte, read back from the device (poisoned before the copy).
            let ids: Vec<u8> = b.indices().iter().flat_map(|i| i.to_le_bytes()).collect();
            assert_eq!(b.field_to_host("id").unwrap(), ids);
            assert_eq!(b.field_to_host("text").unwrap(), want_text, "parts {parts}");
            assert_eq!(
                offsets_of(&b.offsets_to_host("text").unwrap()),
                text_offsets
            );
            assert_eq!(b.field_to_host("tokens").unwrap(), want_tokens);
            assert_eq!(
                offsets_of(&b.offsets_to_host("tokens").unwrap()),
                token_offsets
            );
            // The host's copy of the offsets, and the views' sizes, agree.
            assert_eq!(b.offsets_host("text").unwrap(), text_offsets);
            let (values, offsets) = b.ragged::<u32>("tokens").unwrap();
            assert_eq!(values.shape(), [want_tokens.len() / 4]);
            assert_eq!(values.len(), want_tokens.len() / 4);
            assert_eq!(offsets.shape(), [b.len() + 1]);
            assert_eq!(offsets.dtype(), DType::I64);
            // SAFETY: only the addresses' values are looked at.
            unsafe {
                assert_eq!(values.ptr() % 256, 0);
                assert_eq!(offsets.ptr() % 256, 0);
            }
            // What was copied: the buffer up to the end of the last ragged field's values.
            let last = layout.field_offset(2).unwrap();
            copied += (last + want_tokens.len()) as u64;
        }
        assert!(seen.iter().all(|&n| n == 1), "every sample exactly once");
        let s = dl.stats();
        assert_eq!(s.h2d_bytes, copied, "only the bytes in use are copied");
        assert!(s.h2d_bytes < s.h2d_copies * layout.total_bytes() as u64);
    }
}

pub fn a_ragged_batch_over_its_budget_is_an_error_through_the_copy_stage() {
    let Some(dev) = device() else { return };
    let mut rng = Rng::fresh("ragged budget");
    let data = Texts::new(64, &mut rng);
    let builder = Loader::builder(data)
        .batch_size(16)
        .ragged_budget("text", 100)
        .ragged_budget("tokens", 1 << 20);
    let mut dl = DeviceLoader::from_builder(builder, &dev, DeviceLoaderOptions::default()).unwrap();
    let first = dl.next().unwrap().unwrap_err();
    assert!(matches!(first, Error::Batch { batch: 0, .. }), "{first}");
    assert_eq!(first.kind(), ErrorKind::Config);
    assert!(first.to_string().contains("ragged_budget"), "{first}");
}

pub fn a_conversion_of_a_ragged_field_is_refused() {
    let Some(dev) = device() else { return };
    let mut rng = Rng::fresh("ragged convert");
    let builder = Loader::builder(Texts::new(8, &mut rng))
        .batch_size(4)
        .ragged_budget("text", 1 << 16)
        .ragged_budget("tokens", 1 << 16);
    let opts =
        DeviceLoaderOptions::default().convert(Convert::new("text", Layout::Chw, DType::F16));
    match DeviceLoader::from_builder(builder, &dev, opts) {
        Err(Error::InvalidConfig {
            setting: "convert",
            what,
        }) => assert!(what.contains("`text` is ragged"), "{what}"),
        other => panic!("expected the conversion refused, got {other:?}"),
    }
}
