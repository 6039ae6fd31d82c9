//! [`Zip`]: several datasets of one length, presented as one whose fields are theirs together
//! and whose shards are cut wherever any of theirs is (so a two-level shuffle over the zip
//! keeps to every part's shards).

use std::path::Path;

use crate::error::{Error, Result};
use crate::format::{Field, Schema};
use crate::source::{Dataset, NpyArray, Sample};

/// Datasets of the same length side by side: sample `i` of the whole has the fields of sample
/// `i` of every part, in order (the first part's fields, then the second's, ...).
///
/// For arrays kept in separate files, the way NumPy users keep them (`images.npy` and
/// `labels.npy`): no packing, no copy. A zipped sample reads each field from its part
/// ([`Sample::copy_field_into`] copies or `pread`s it straight from there); only
/// [`Sample::bytes`] lays out a whole record, on demand.
///
/// Each part has a label (its file, say) that errors name: parts of different lengths and
/// field names found in two parts are refused, as an [`Error::Mismatch`] naming both parts.
///
/// # Shards
///
/// Parts that are sharded ([`Dataset::shard_sizes`]: a [`shards`](crate::source::shards)
/// dataset, a [`Concat`](crate::Concat)) need not be cut alike: the zip's shards are their
/// common refinement, cut at every boundary of every part's shards (a part that reports none
/// counts as one shard of all its samples). So each shard of the zip lies within one shard of
/// every part, and [`LoaderBuilder::shuffle_blocks`](crate::LoaderBuilder::shuffle_blocks)
/// keeps the locality it gives a single sharded dataset: a window of `w` of the zip's shards
/// reads at most `w` shards of each part, and with a window of one shard every block stays
/// within one shard of every part. A zip none of whose parts has shards has none either
/// (`None`, an undivided dataset). A part whose shards do not hold exactly its samples is
/// refused, as an [`Error::Mismatch`] naming it.
///
/// The rest of [`Dataset`] goes to every part: [`read_ahead`](Dataset::read_ahead) announces
/// the same indices to each (the furthest [`read_ahead_batches`](Dataset::read_ahead_batches)
/// of any part is the zip's), and [`check_unchanged`](Dataset::check_unchanged) checks each
/// part's files. A part that verifies what it reads (a [`RecordFile`](crate::RecordFile)
/// opened with [`verify_checksums`](crate::format::ReadOptions::verify_checksums)) does so
/// under the zip too, since every field of a zipped sample is read by its part.
///
/// ```
/// use gpufeed::source::{NpyArray, Zip};
/// use gpufeed::{DType, Dataset, Loader};
///
/// # fn main() -> gpufeed::Result<()> {
/// let dir = tempfile::tempdir().unwrap();
/// let (images, labels) = (dir.path().join("images.npy"), dir.path().join("labels.npy"));
/// // 10 images of 2x2 u8, 10 u32 labels (NumPy's `np.save` writes the same files).
/// let mut npy = gpufeed::source::npy_header(DType::U8, &[10, 2, 2])?;
/// npy.extend((0..40).map(|i| i as u8));
/// std::fs::write(&images, npy).unwrap();
/// let mut npy = gpufeed::source::npy_header(DType::U32, &[10])?;
/// npy.extend((0..10u32).flat_map(|l| (l % 3).to_le_bytes()));
/// std::fs::write(&labels, npy).unwrap();
///
/// let data = Zip::npy([("image", &images), ("label", &labels)])?;
/// assert_eq!(data.len(), 10);
/// assert_eq!(*data.get(4)?.field_as::<u32>("label")?, [1]);
///
/// let mut loader = Loader::builder(data).batch_size(5).build()?;
/// let batch = loader.next().unwrap()?;
/// assert_eq!(batch.shape("image")?, [5, 2, 2]);
/// assert_eq!(batch.field::<u32>("label")?.len(), 5);
/// # Ok(())
/// # }
/// ```
pub struct Zip<D> {
    parts: Vec<D>,
    labels: Vec<String>,
    schema: Schema,
    /// For each field of `schema`: (part, field of that part).
    fields: Vec<(usize, usize)>,
    len: u64,
    /// The common refinement of the parts' shards; `None` when no part has shards.
    shards: Option<Vec<u64>>,
}

impl<D> std::fmt::Debug for Zip<D> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Zip")
            .field("parts", &self.labels)
            .field("schema", &self.schema.to_string())
            .field("len", &self.len)
            .finish()
    }
}

impl<D: Dataset> Zip<D> {
    /// Zips `parts`, each given with a label that errors name (its file, say). There must be
    /// at least one; all must have the same length, and no field name may appear in two.
    pub fn new<L: Into<String>>(parts: impl IntoIterator<Item = (L, D)>) -> Result<Zip<D>> {
        let (labels, parts): (Vec<String>, Vec<D>) =
            parts.into_iter().map(|(l, d)| (l.into(), d)).unzip();
        let Some(first) = parts.first() else {
            return Err(Error::config("sources", "a zip needs at least one source"));
        };
        let len = first.len();
        for (k, p) in parts.iter().enumerate().skip(1) {
            if p.len() != len {
                return Err(Error::mismatch(format!(
                    "{} has {} samples, {} has {len}: zipped sources must have the same length",
                    labels[k],
                    p.len(),
                    labels[0]
                )));
            }
        }
        let mut all: Vec<Field> = Vec::new();
        let mut fields: Vec<(usize, usize)> = Vec::new();
        for (k, p) in parts.iter().enumerate() {
            for (j, f) in p.schema().fields().iter().enumerate() {
                if let Some(at) = all.iter().position(|g| g.name == f.name) {
                    return Err(Error::mismatch(format!(
                        "field `{}` is in both {} and {}: zipped fields need distinct names",
                        f.name, labels[fields[at].0], labels[k]
                    )));
                }
                all.push(f.clone());
                fields.push((k, j));
            }
        }
        let schema = Schema::new(all)
            .map_err(|e| Error::mismatch(format!("zip of {}: {e}", labels.join(", "))))?;
        let divisions = parts.iter().map(Dataset::shard_sizes).collect::<Vec<_>>();
        for (k, sizes) in divisions.iter().enumerate() {
            let Some(sizes) = sizes else { continue };
            let total = sizes.iter().try_fold(0u64, |t, &n| t.checked_add(n));
            if total != Some(len) {
                let held = total.map_or_else(|| "more than 2^64".to_string(), |t| t.to_string());
                return Err(Error::mismatch(format!(
                    "{}'s {} shards hold {held} samples, but it has {len}: \
                     a zipped source's shards must hold exactly its samples",
                    labels[k],
                    sizes.len()
                )));
            }
        }
        let shards = divisions
            .iter()
            .any(Option::is_some)
            .then(|| common_refinement(len, &divisions));
        Ok(Zip {
            parts,
            labels,
            schema,
            fields,
            len,
            shards,
        })
    }

    /// The parts, in order.
    pub fn parts(&self) -> &[D] {
        &self.parts
    }

    /// The parts' labels, in order.
    pub fn labels(&self) -> &[String] {
        &self.labels
    }
}

/// The common refinement of divisions of `len` samples into shards: the shards cut at every
/// boundary of every division. A division is the sizes of its shards in order, summing to
/// `len` (checked by the caller); `None` is one shard of all `len` samples, which adds no
/// boundary. Shards of no sample add no boundary either, so every shard returned holds at
/// least one sample (none at all when `len` is 0).
fn common_refinement(len: u64, divisions: &[Option<Vec<u64>>]) -> Vec<u64> {
    let mut ends: Vec<u64> = divisions
        .iter()
        .flatten()
        .flat_map(|sizes| {
            sizes.iter().scan(0u64, |end, &n| {
                *end += n;
                Some(*end)
            })
        })
        .filter(|&end| end > 0 && end < len)
        .collect();
    if len > 0 {
        ends.push(len);
    }
    ends.sort_unstable();
    ends.dedup();
    let mut start = 0;
    ends.into_iter()
        .map(|end| {
            let n = end - start;
            start = end;
            n
        })
        .collect()
}

impl Zip<NpyArray> {
    /// Opens each `.npy` file as a field of the given name (memory-mapped, as
    /// [`NpyArray::open_as`] does) and zips them; errors name the files.
    pub fn npy<S, P>(fields: impl IntoIterator<Item = (S, P)>) -> Result<Zip<NpyArray>>
    where
        S: AsRef<str>,
        P: AsRef<Path>,
    {
        let parts = fields
            .into_iter()
            .map(|(name, path)| {
                let path = path.as_ref();
                Ok((
                    path.display().to_string(),
                    NpyArray::open_as(path, name.as_ref())?,
                ))
            })
            .collect::<Result<Vec<_>>>()?;
        Zip::new(parts)
    }
}

impl<D: Dataset> Dataset for Zip<D> {
    fn len(&self) -> u64 {
        self.len
    }

    fn schema(&self) -> &Schema {
        &self.schema
    }

    fn get(&self, index: u64) -> Result<Sample<'_>> {
        if index >= self.len {
            return Err(Error::OutOfRange {
                index,
                len: self.len,
            });
        }
        let parts = self
            .parts
            .iter()
            .map(|p| p.get(index))
            .collect::<Result<Vec<_>>>()?;
        Ok(Sample::zipped(parts, &self.fields, &self.schema))
    }

    /// The common refinement of the parts' shards (see [`Zip`]): `None` when no part has
    /// shards.
    fn shard_sizes(&self) -> Option<Vec<u64>> {
        self.shards.clone()
    }

    fn read_ahead_batches(&self) -> usize {
        self.parts
            .iter()
            .map(|p| p.read_ahead_batches())
            .max()
            .unwrap_or(0)
    }

    fn read_ahead(&self, indices: &[u64]) {
        for p in &self.parts {
            p.read_ahead(indices);
        }
    }

    /// Checks every part, in order; the first change found is the error.
    fn check_unchanged(&self) -> Result<()> {
        self.parts.iter().try_for_each(Dataset::check_unchanged)
    }

    /// The parts' fingerprints, in order (`None` if a part has none).
    fn fingerprint(&self) -> Result<Option<u64>> {
        super::combined_fingerprint(&self.parts)
    }

    fn held_bytes(&self) -> u64 {
        self.parts.iter().map(Dataset::held_bytes).sum()
    }
}

#[cfg(test)]
mod tests {
    use std::path::PathBuf;
    use std::sync::Mutex;

    use proptest::prelude::*;

    use super::*;
    use crate::format::DType;

    /// A dataset of `n` samples of one field `name`: `[i; width]` as u16. It reports the
    /// shards `shards` and read-ahead depth `ahead`, records the indices announced to it, and
    /// fails `check_unchanged` naming `changed` when set.
    struct Rows {
        schema: Schema,
        n: u64,
        width: usize,
        shards: Option<Vec<u64>>,
        ahead: usize,
        heard: Mutex<Vec<u64>>,
        changed: Option<PathBuf>,
    }

    fn rows(name: &str, n: u64, width: usize) -> Rows {
        Rows {
            schema: Schema::new(vec![Field::tensor(name, DType::U16, &[width as u64])]).unwrap(),
            n,
            width,
            shards: None,
            ahead: 0,
            heard: Mutex::new(Vec::new()),
            changed: None,
        }
    }

    /// `rows(name, sum of shards, 1)` in shards of these sizes.
    fn sharded(name: &str, shards: &[u64]) -> Rows {
        Rows {
            shards: Some(shards.to_vec()),
            ..rows(name, shards.iter().sum(), 1)
        }
    }

    impl Dataset for Rows {
        fn len(&self) -> u64 {
            self.n
        }
        fn schema(&self) -> &Schema {
            &self.schema
        }
        fn get(&self, i: u64) -> Result<Sample<'_>> {
            let b: Vec<u8> = (0..self.width)
                .flat_map(|_| (i as u16).to_le_bytes())
                .collect();
            Sample::owned(b, &self.schema)
        }
        fn shard_sizes(&self) -> Option<Vec<u64>> {
            self.shards.clone()
        }
        fn read_ahead_batches(&self) -> usize {
            self.ahead
        }
        fn read_ahead(&self, indices: &[u64]) {
            self.heard.lock().unwrap().extend_from_slice(indices);
        }
        fn check_unchanged(&self) -> Result<()> {
            match &self.changed {
                None => Ok(()),
                Some(path) => Err(Error::FileChanged {
                    path: path.clone(),
                    what: "replaced".into(),
                }),
            }
        }
    }

    fn zip_shards(parts: Vec<Rows>) -> Option<Vec<u64>> {
        let labelled = parts
            .into_iter()
            .enumerate()
            .map(|(k, p)| (format!("{k}"), p));
        Zip::new(labelled).unwrap().shard_sizes()
    }

    #[test]
    fn a_zipped_sample_has_every_part_s_fields() {
        let z = Zip::new([("a.npy", rows("a", 5, 3)), ("b.npy", rows("b", 5, 1))]).unwrap();
        assert_eq!(z.len(), 5);
        let names: Vec<&str> = z
            .schema()
            .fields()
            .iter()
            .map(|f| f.name.as_str())
            .collect();
        assert_eq!(names, ["a", "b"]);
        let s = z.get(4).unwrap();
        assert_eq!(*s.field_as::<u16>("a").unwrap(), [4, 4, 4]);
        assert_eq!(s.field(1).unwrap(), 4u16.to_le_bytes());
        let mut slot = [0u8; 2];
        s.copy_field_into(1, &mut slot).unwrap();
        assert_eq!(slot, 4u16.to_le_bytes());
        // The whole record, laid out as the zipped schema says.
        assert_eq!(s.len(), 8);
        assert_eq!(s.bytes().unwrap(), [4, 0, 4, 0, 4, 0, 4, 0]);
        assert!(matches!(
            z.get(5),
            Err(Error::OutOfRange { index: 5, len: 5 })
        ));
    }

    #[test]
    fn different_lengths_and_repeated_names_are_refused_naming_the_parts() {
        let e = Zip::new([
            ("images.npy", rows("a", 5, 3)),
            ("labels.npy", rows("b", 4, 1)),
        ])
        .unwrap_err();
        assert!(matches!(e, Error::Mismatch { .. }), "{e}");
        let msg = e.to_string();
        for want in ["labels.npy has 4 samples", "images.npy has 5"] {
            assert!(msg.contains(want), "`{want}` not in: {msg}");
        }
        let e = Zip::new([
            ("one.npy", rows("data", 5, 3)),
            ("two.npy", rows("data", 5, 1)),
        ])
        .unwrap_err();
        assert!(matches!(e, Error::Mismatch { .. }), "{e}");
        assert!(
            e.to_string()
                .contains("`data` is in both one.npy and two.npy"),
            "{e}"
        );
        let none: [(&str, Rows); 0] = [];
        assert!(matches!(Zip::new(none), Err(Error::InvalidConfig { .. })));
    }

    #[test]
    fn shards_are_cut_at_every_part_s_boundaries() {
        // Boundaries 0 3 5 10 and 0 4 5 8 10: together 0 3 4 5 8 10.
        let got = zip_shards(vec![sharded("a", &[3, 2, 5]), sharded("b", &[4, 1, 3, 2])]);
        assert_eq!(got, Some(vec![3, 1, 1, 3, 2]));
        // Three parts, in any order, give the same shards.
        let parts = || {
            vec![
                sharded("a", &[6, 6]),
                sharded("b", &[4, 4, 4]),
                sharded("c", &[1, 11]),
            ]
        };
        assert_eq!(zip_shards(parts()), Some(vec![1, 3, 2, 2, 4]));
        let mut reversed = parts();
        reversed.reverse();
        assert_eq!(zip_shards(reversed), Some(vec![1, 3, 2, 2, 4]));
    }

    #[test]
    fn a_part_without_shards_is_one_shard_of_everything() {
        let got = zip_shards(vec![rows("image", 10, 3), sharded("label", &[4, 6])]);
        assert_eq!(got, Some(vec![4, 6]));
        let got = zip_shards(vec![sharded("image", &[7, 3]), rows("label", 10, 1)]);
        assert_eq!(got, Some(vec![7, 3]));
        // No part has shards: neither has the zip.
        assert_eq!(
            zip_shards(vec![rows("image", 10, 3), rows("label", 10, 1)]),
            None
        );
    }

    #[test]
    fn parts_cut_alike_keep_their_shards_and_empty_shards_vanish() {
        let got = zip_shards(vec![sharded("a", &[5, 2, 9]), sharded("b", &[5, 2, 9])]);
        assert_eq!(got, Some(vec![5, 2, 9]));
        let got = zip_shards(vec![
            sharded("a", &[0, 5, 0, 0, 11]),
            sharded("b", &[5, 11, 0]),
        ]);
        assert_eq!(got, Some(vec![5, 11]));
        // Nothing to cut: a sharded part of no sample gives a zip of no shard.
        assert_eq!(
            zip_shards(vec![sharded("a", &[0, 0]), rows("b", 0, 1)]),
            Some(vec![])
        );
    }

    #[test]
    fn a_part_whose_shards_do_not_hold_its_samples_is_refused_naming_it() {
        let bad = Rows {
            shards: Some(vec![4, 5]),
            ..rows("label", 10, 1)
        };
        let e = Zip::new([("images.npy", rows("image", 10, 2)), ("labels/", bad)]).unwrap_err();
        assert!(matches!(e, Error::Mismatch { .. }), "{e}");
        assert!(
            e.to_string()
                .contains("labels/'s 2 shards hold 9 samples, but it has 10"),
            "{e}"
        );
        let huge = Rows {
            shards: Some(vec![u64::MAX, 2]),
            ..rows("label", 10, 1)
        };
        let e = Zip::new([("images.npy", rows("image", 10, 2)), ("labels/", huge)]).unwrap_err();
        assert!(e.to_string().contains("more than 2^64"), "{e}");
    }

    #[test]
    fn read_ahead_goes_to_every_part_as_far_as_the_furthest_asks() {
        let (mut a, mut b) = (rows("a", 10, 1), rows("b", 10, 1));
        a.ahead = 2;
        b.ahead = 5;
        let z = Zip::new([("a", a), ("b", b), ("c", rows("c", 10, 1))]).unwrap();
        assert_eq!(z.read_ahead_batches(), 5);
        z.read_ahead(&[7, 2, 9]);
        z.read_ahead(&[0]);
        for p in z.parts() {
            assert_eq!(*p.heard.lock().unwrap(), [7, 2, 9, 0]);
        }
    }

    #[test]
    fn check_unchanged_checks_every_part_and_names_the_first_changed() {
        let z = Zip::new([("a", rows("a", 3, 1)), ("b", rows("b", 3, 1))]).unwrap();
        z.check_unchanged().unwrap();
        let (mut b, mut c) = (rows("b", 3, 1), rows("c", 3, 1));
        b.changed = Some(PathBuf::from("b.npy"));
        c.changed = Some(PathBuf::from("c.npy"));
        let z = Zip::new([("a", rows("a", 3, 1)), ("b", b), ("c", c)]).unwrap();
        match z.check_unchanged() {
            Err(Error::FileChanged { path, .. }) => assert_eq!(path, Path::new("b.npy")),
            other => panic!("expected b.npy changed, got {other:?}"),
        }
    }

    /// A division of `len` samples into shards, from cut points in `[0, len]` (repeats and
    /// the ends included, so shards of no sample occur), or `None`.
    fn division(len: u64) -> impl Strategy<Value = Option<Vec<u64>>> {
        proptest::option::of(proptest::collection::vec(0..=len, 0..8)).prop_map(move |cuts| {
            cuts.map(|mut cuts| {
                cuts.sort_unstable();
                let mut start = 0;
                let mut sizes: Vec<u64> = cuts
                    .into_iter()
                    .map(|c| {
                        let n = c - start;
                        start = c;
                        n
                    })
                    .collect();
                sizes.push(len - start);
                sizes
            })
        })
    }

    fn ends(sizes: &[u64]) -> Vec<u64> {
        std::iter::once(0)
            .chain(sizes.iter().scan(0, |end, &n| {
                *end += n;
                Some(*end)
            }))
            .collect()
    }

    proptest! {
        // Cheap cases, but few under Miri (`.ci/run` runs this module's tests there).
        #![proptest_config(ProptestConfig::with_cases(if cfg!(miri) { 4 } else { 256 }))]

        /// The zip's shards are disjoint, cover every sample once, and are cut at every
        /// boundary of every part and nowhere else: each lies within one shard of every part.
        #[test]
        fn the_refinement_partitions_the_samples_at_every_part_s_boundaries(
            divisions in (0u64..60).prop_flat_map(|len| {
                (Just(len), proptest::collection::vec(division(len), 1..5))
            }),
        ) {
            let (len, divisions) = divisions;
            let parts: Vec<Rows> = divisions
                .iter()
                .enumerate()
                .map(|(k, d)| Rows { shards: d.clone(), ..rows(&format!("f{k}"), len, 1) })
                .collect();
            let got = zip_shards(parts);
            prop_assert_eq!(got.is_some(), divisions.iter().any(Option::is_some));
            let Some(got) = got else { return Ok(()) };
            // Non-empty shards, one after another from 0 to len: disjoint and complete.
            prop_assert!(got.iter().all(|&n| n > 0), "{:?}", got);
            let zip_ends = ends(&got);
            prop_assert_eq!(zip_ends.last().copied(), Some(len));
            // Every part's boundary is a boundary of the zip ...
            let mut part_ends: Vec<u64> = vec![0, len];
            for d in divisions.iter().flatten() {
                part_ends.extend(ends(d));
            }
            part_ends.sort_unstable();
            part_ends.dedup();
            // ... and the zip has no other (the coarsest such division).
            prop_assert_eq!(zip_ends, part_ends);
        }
    }
}
