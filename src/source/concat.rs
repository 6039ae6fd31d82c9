//! [`Concat`]: several datasets of one schema, presented as one (shards).

use crate::error::{Error, Result};
use crate::format::Schema;
use crate::source::{Dataset, Description, Format, Sample, Source};

/// Datasets of one schema, one after another: sample `i` of the whole is found by a binary
/// search over the parts' cumulative lengths (O(log parts), no per-sample table).
pub struct Concat<D> {
    parts: Vec<D>,
    /// `ends[k]` = samples in parts `0..=k`.
    ends: Vec<u64>,
}

impl<D: Dataset> Concat<D> {
    /// Concatenates `parts`; their schemas must be equal, and there must be at least one.
    pub fn new(parts: Vec<D>) -> Result<Concat<D>> {
        let Some(first) = parts.first() else {
            return Err(Error::config(
                "sources",
                "a concatenation needs at least one source",
            ));
        };
        for (k, p) in parts.iter().enumerate().skip(1) {
            if p.schema() != first.schema() {
                return Err(Error::mismatch(format!(
                    "source {k} has schema [{}], source 0 has [{}]",
                    p.schema(),
                    first.schema()
                )));
            }
        }
        let mut total = 0u64;
        let ends = parts
            .iter()
            .map(|p| {
                total += p.len();
                total
            })
            .collect();
        Ok(Concat { parts, ends })
    }

    /// The parts, in order.
    pub fn parts(&self) -> &[D] {
        &self.parts
    }
}

impl<D: Dataset> Dataset for Concat<D> {
    fn len(&self) -> u64 {
        self.ends.last().copied().unwrap_or(0)
    }

    fn schema(&self) -> &Schema {
        self.parts[0].schema()
    }

    fn get(&self, index: u64) -> Result<Sample<'_>> {
        let k = self.ends.partition_point(|&end| end <= index);
        let Some(part) = self.parts.get(k) else {
            return Err(Error::OutOfRange {
                index,
                len: self.len(),
            });
        };
        let start = if k == 0 { 0 } else { self.ends[k - 1] };
        part.get(index - start)
    }

    /// Each part is a shard.
    fn shard_sizes(&self) -> Option<Vec<u64>> {
        Some(self.parts.iter().map(|p| p.len()).collect())
    }

    fn read_ahead_batches(&self) -> usize {
        self.parts
            .iter()
            .map(|p| p.read_ahead_batches())
            .max()
            .unwrap_or(0)
    }

    /// Each run of indices that falls in one part goes to that part, in order.
    fn read_ahead(&self, indices: &[u64]) {
        let mut run: Vec<u64> = Vec::new();
        let mut current = None;
        for &index in indices {
            let k = self.ends.partition_point(|&end| end <= index);
            if current != Some(k) {
                if let Some(part) = current.and_then(|c| self.parts.get(c)) {
                    part.read_ahead(&run);
                }
                run.clear();
                current = Some(k);
            }
            let start = if k == 0 { 0 } else { self.ends[k - 1] };
            run.push(index - start);
        }
        if let Some(part) = current.and_then(|c| self.parts.get(c)) {
            part.read_ahead(&run);
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

impl<D: Source> Source for Concat<D> {
    fn format(&self) -> Format {
        Format::Concat
    }

    /// The parts: how many, each one's format and samples.
    fn describe(&self) -> Result<Description> {
        let parts: Vec<String> = self
            .parts
            .iter()
            .map(|p| format!("{} ({} samples)", p.format().title(), p.len()))
            .collect();
        Ok(
            Description::new("", Format::Concat, self.len(), self.schema().clone()).fact(
                "parts",
                "parts",
                parts.len(),
                parts.join("\n"),
            ),
        )
    }

    /// Every part, in order; progress counts samples.
    fn verify(&self, progress: &mut dyn FnMut(u64, u64)) -> Result<()> {
        let total = self.len();
        let mut before = 0;
        for p in &self.parts {
            p.verify(&mut |done, of| {
                progress(before + done * p.len() / of.max(1), total);
            })?;
            before += p.len();
        }
        Ok(())
    }
}
