//! [`Zip`]: several datasets of one length, presented as one whose fields are theirs together.

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
        Ok(Zip {
            parts,
            labels,
            schema,
            fields,
            len,
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
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::format::DType;

    /// A dataset of `n` samples of one field `name`: `[i; width]` as u16.
    struct Rows {
        schema: Schema,
        n: u64,
        width: usize,
    }

    fn rows(name: &str, n: u64, width: usize) -> Rows {
        Rows {
            schema: Schema::new(vec![Field::tensor(name, DType::U16, &[width as u64])]).unwrap(),
            n,
            width,
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
}
