//! [`ImageFolder`]: torchvision's `ImageFolder` layout, read file by file; and
//! [`pack_image_folder`], which turns one into a packed record file.
//!
//! `root/<class>/**/<file>.{jpg,jpeg,png}`: class directories sorted by name give labels
//! `0..k` (as torchvision's `find_classes`), files are found recursively and sorted by path
//! within each class (as `make_dataset`), extensions are matched case-insensitively. Opening
//! lists the files once; a sample is read from its file when asked for (never cached), so
//! memory holds the list of names only, shared by every worker thread.
//!
//! A sample has the fields `image` (the file's encoded bytes; codec `jpeg` or `png` when every
//! file has that extension, else `raw`: decoders detect the format from the bytes), `label`
//! (i64) and `path` (utf8, relative to the root: errors downstream name the file).

use std::fs::File;
use std::io::Read;
use std::path::{Path, PathBuf};

use rayon::prelude::*;

use crate::codec;
use crate::error::{Error, Result};
use crate::format::{Codec, DType, Field, PackSummary, RecordWriter, Schema};
use crate::source::{Dataset, Description, Format, Sample, Source};

/// File extensions read as images (compared case-insensitively).
pub const IMAGE_EXTENSIONS: [&str; 3] = ["jpg", "jpeg", "png"];

/// A directory of class subdirectories of JPEG and PNG files, torchvision's `ImageFolder`
/// layout: `root/<class>/**/<file>.{jpg,jpeg,png}`. Class directories sorted by name give
/// labels `0..k`; files are found recursively and sorted by path within each class; a sample
/// (`image`: the encoded bytes, `label`: i64, `path`: utf8 relative to the root) is read from
/// its file when asked for, never cached.
pub struct ImageFolder {
    root: PathBuf,
    classes: Vec<String>,
    /// Relative paths, back to back (UTF-8).
    names: String,
    /// `ends[i]`: where file `i`'s name ends in `names`.
    ends: Vec<usize>,
    labels: Vec<u32>,
    schema: Schema,
}

impl std::fmt::Debug for ImageFolder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ImageFolder")
            .field("root", &self.root)
            .field("classes", &self.classes.len())
            .field("files", &self.ends.len())
            .finish()
    }
}

fn is_image(path: &Path) -> Option<Codec> {
    let ext = path.extension()?.to_str()?.to_ascii_lowercase();
    match ext.as_str() {
        "jpg" | "jpeg" => Some(Codec::Jpeg),
        "png" => Some(Codec::Png),
        _ => None,
    }
}

fn utf8_name(path: &Path) -> Result<&str> {
    path.to_str().ok_or_else(|| Error::Malformed {
        path: path.to_path_buf(),
        format: "image folder",
        what: "the name is not UTF-8".into(),
    })
}

/// Every image file under `dir`, recursively (following links), sorted by path.
fn walk(dir: &Path, out: &mut Vec<PathBuf>) -> Result<()> {
    let mut entries = Vec::new();
    for entry in std::fs::read_dir(dir).map_err(|e| Error::io(dir, "read directory", e))? {
        let entry = entry.map_err(|e| Error::io(dir, "read directory", e))?;
        entries.push(entry.path());
    }
    entries.sort();
    for path in entries {
        if path.is_dir() {
            walk(&path, out)?;
        } else if is_image(&path).is_some() {
            out.push(path);
        }
    }
    Ok(())
}

impl ImageFolder {
    /// Lists `root`'s classes and image files. Fails if there is no class directory, or a
    /// class has no image file (as torchvision does), naming them.
    pub fn open(root: impl AsRef<Path>) -> Result<ImageFolder> {
        let root = root.as_ref();
        let mut class_dirs = Vec::new();
        for entry in std::fs::read_dir(root).map_err(|e| Error::io(root, "read directory", e))? {
            let entry = entry.map_err(|e| Error::io(root, "read directory", e))?;
            let path = entry.path();
            if path.is_dir() {
                class_dirs.push(path);
            }
        }
        class_dirs.sort();
        if class_dirs.is_empty() {
            return Err(Error::Malformed {
                path: root.to_path_buf(),
                format: "image folder",
                what: "no class directory".into(),
            });
        }
        let (mut names, mut ends, mut labels, mut classes) =
            (String::new(), Vec::new(), Vec::new(), Vec::new());
        let mut codecs = std::collections::BTreeSet::new();
        let mut empty = Vec::new();
        let mut files = Vec::new();
        for (label, dir) in class_dirs.iter().enumerate() {
            let class = dir.file_name().map(Path::new).unwrap_or(dir);
            classes.push(utf8_name(class)?.to_owned());
            files.clear();
            walk(dir, &mut files)?;
            if files.is_empty() {
                empty.push(classes[label].clone());
            }
            let label =
                u32::try_from(label).map_err(|_| Error::mismatch("more than 4 billion classes"))?;
            for f in &files {
                let rel = f.strip_prefix(root).unwrap_or(f);
                names.push_str(utf8_name(rel)?);
                ends.push(names.len());
                labels.push(label);
                codecs.insert(is_image(f).map_or(0, Codec::code));
            }
        }
        if !empty.is_empty() {
            return Err(Error::Malformed {
                path: root.to_path_buf(),
                format: "image folder",
                what: format!(
                    "no image file ({}) for the classes {}",
                    IMAGE_EXTENSIONS.join(", "),
                    empty.join(", ")
                ),
            });
        }
        let codec = match codecs.len() {
            1 => codecs.first().map_or(Codec::Raw, |&c| Codec::from_code(c)),
            _ => Codec::Raw,
        };
        let schema = Schema::new(vec![
            Field::bytes("image", codec),
            Field::tensor("label", DType::I64, &[]),
            Field::bytes("path", Codec::Utf8),
        ])?;
        Ok(ImageFolder {
            root: root.to_path_buf(),
            classes,
            names,
            ends,
            labels,
            schema,
        })
    }

    /// The root directory.
    pub fn root(&self) -> &Path {
        &self.root
    }

    /// Class names; class `k` has label `k`.
    pub fn classes(&self) -> &[String] {
        &self.classes
    }

    /// File `i`'s path relative to the root.
    pub fn relative_path(&self, i: u64) -> Result<&str> {
        let len = self.ends.len() as u64;
        let k = usize::try_from(i)
            .ok()
            .filter(|&k| k < self.ends.len())
            .ok_or(Error::OutOfRange { index: i, len })?;
        let start = if k == 0 { 0 } else { self.ends[k - 1] };
        Ok(&self.names[start..self.ends[k]])
    }

    /// File `i`'s full path.
    pub fn path(&self, i: u64) -> Result<PathBuf> {
        Ok(self.root.join(self.relative_path(i)?))
    }

    /// File `i`'s label.
    pub fn label(&self, i: u64) -> Result<u32> {
        self.relative_path(i)?;
        Ok(self.labels[i as usize])
    }

    /// Reads file `i` whole.
    pub fn read(&self, i: u64) -> Result<Vec<u8>> {
        let path = self.path(i)?;
        let mut bytes = Vec::new();
        File::open(&path)
            .and_then(|mut f| f.read_to_end(&mut bytes))
            .map_err(|e| Error::io(&path, "read", e))?;
        Ok(bytes)
    }
}

impl Source for ImageFolder {
    fn format(&self) -> Format {
        Format::ImageFolder
    }

    /// Its classes (the first few named, with their images) and images per class.
    fn describe(&self) -> Result<Description> {
        let mut per_class = vec![0u64; self.classes.len()];
        for &label in &self.labels {
            per_class[label as usize] += 1;
        }
        let (min, max) = (
            per_class.iter().copied().min().unwrap_or(0),
            per_class.iter().copied().max().unwrap_or(0),
        );
        let n = self.labels.len() as u64;
        let mean = n as f64 / self.classes.len().max(1) as f64;
        /// Classes named in the text; the rest are counted.
        const SHOWN: usize = 8;
        let mut shown: Vec<String> = self
            .classes
            .iter()
            .zip(&per_class)
            .take(SHOWN)
            .map(|(c, n)| format!("{c} ({n})"))
            .collect();
        if self.classes.len() > SHOWN {
            shown.push(format!("and {} more", self.classes.len() - SHOWN));
        }
        let codec = match &self.schema.fields()[0].kind {
            crate::format::FieldKind::Bytes { codec } => codec.name(),
            crate::format::FieldKind::Tensor { .. } => "raw".into(),
        };
        Ok(Description::new(
            self.root.display().to_string(),
            Format::ImageFolder,
            n,
            self.schema.clone(),
        )
        .fact(
            "classes",
            "classes",
            self.classes.clone(),
            format!("{} classes: {}", self.classes.len(), shown.join(", ")),
        )
        .fact(
            "images_per_class",
            "images",
            serde_json::json!({"min": min, "mean": mean, "max": max}),
            format!("{min} to {max} per class, mean {mean:.1}"),
        )
        .fact("codec", "codec", codec.clone(), codec))
    }

    /// Reads every image and checks its header, as packing it would.
    fn verify(&self, progress: &mut dyn FnMut(u64, u64)) -> Result<()> {
        let n = self.len();
        for i in 0..n {
            let image = self.read(i)?;
            codec::probe(&image, &self.path(i)?.display().to_string())?;
            progress(i + 1, n);
        }
        Ok(())
    }
}

impl Dataset for ImageFolder {
    fn len(&self) -> u64 {
        self.ends.len() as u64
    }

    fn schema(&self) -> &Schema {
        &self.schema
    }

    /// Reads the file into a record laid out by the schema (one read, into its final place).
    fn get(&self, index: u64) -> Result<Sample<'_>> {
        let rel = self.relative_path(index)?;
        let label = i64::from(self.labels[index as usize]).to_le_bytes();
        let path = self.root.join(rel);
        let mut file = File::open(&path).map_err(|e| Error::io(&path, "open", e))?;
        let size = file.metadata().map_or(0, |m| m.len() as usize);
        // Lay out [label, length table] with an empty image, then read the file after it and
        // patch the image's length; the path goes last.
        let mut record = Vec::with_capacity(self.schema.min_record_bytes() + size + rel.len());
        self.schema.build_record(&[&[], &label, &[]], &mut record)?;
        let start = record.len();
        file.read_to_end(&mut record)
            .map_err(|e| Error::io(&path, "read", e))?;
        let n = u32::try_from(record.len() - start).map_err(|_| Error::Image {
            source_name: path.display().to_string(),
            what: "larger than 4 GiB".into(),
            setting: None,
            source: None,
        })?;
        let table = self.schema.var_table_offset();
        record[table..table + 4].copy_from_slice(&n.to_le_bytes());
        record[table + 4..table + 8].copy_from_slice(&(rel.len() as u32).to_le_bytes());
        record.extend_from_slice(rel.as_bytes());
        Sample::owned(record, &self.schema)
    }

    /// The classes, the files' relative paths and their labels, as listed at open (held in
    /// memory: no file is read).
    fn fingerprint(&self) -> Result<Option<u64>> {
        let mut hash = xxhash_rust::xxh3::Xxh3::new();
        for c in &self.classes {
            hash.update(c.as_bytes());
            hash.update(&[0]);
        }
        hash.update(self.names.as_bytes());
        for (end, label) in self.ends.iter().zip(&self.labels) {
            hash.update(&(*end as u64).to_le_bytes());
            hash.update(&label.to_le_bytes());
        }
        Ok(Some(hash.digest()))
    }
}

/// The schema of a packed image folder: `image` (encoded bytes), `label` (i64), `size` (u32
/// `[height, width]`), `path` (utf8, relative to the folder's root).
pub fn packed_image_schema(codec: Codec) -> Result<Schema> {
    let fields = vec![
        Field::bytes("image", codec),
        Field::tensor("label", DType::I64, &[]),
        Field::tensor("size", DType::U32, &[2]),
        Field::bytes("path", Codec::Utf8),
    ];
    Schema::new(fields)
}

/// Writes `folder` into a packed record file at `out` (atomically), in the folder's order:
/// encoded bytes as they are, label, `[height, width]` read from each image's header, and the
/// relative path. Files are read and probed in parallel (rayon), in chunks, and written in
/// order; `progress` is called with the number of records written so far. A file that cannot
/// be read or whose header is not a valid JPEG/PNG fails the pack with an error naming it.
pub fn pack_image_folder(
    folder: &ImageFolder,
    out: impl AsRef<Path>,
    mut progress: impl FnMut(u64),
) -> Result<PackSummary> {
    let codec = match folder.schema.fields()[0].kind {
        crate::format::FieldKind::Bytes { codec } => codec,
        _ => Codec::Raw,
    };
    let mut writer = RecordWriter::create(out, packed_image_schema(codec)?)?;
    let n = folder.len();
    let chunk = 512u64;
    let mut start = 0;
    while start < n {
        let end = (start + chunk).min(n);
        let items = (start..end)
            .into_par_iter()
            .map(|i| {
                let bytes = folder.read(i)?;
                let name = folder.path(i)?.display().to_string();
                let (w, h) = codec::probe(&bytes, &name)?;
                Ok((bytes, [h, w]))
            })
            .collect::<Result<Vec<_>>>()?;
        for (k, (bytes, size)) in items.iter().enumerate() {
            let i = start + k as u64;
            let label = i64::from(folder.label(i)?).to_le_bytes();
            let mut size_bytes = [0u8; 8];
            size_bytes[..4].copy_from_slice(&size[0].to_le_bytes());
            size_bytes[4..].copy_from_slice(&size[1].to_le_bytes());
            let rel = folder.relative_path(i)?;
            writer.append(&[bytes, &label, &size_bytes, rel.as_bytes()])?;
        }
        start = end;
        progress(start);
    }
    writer.finish()
}
