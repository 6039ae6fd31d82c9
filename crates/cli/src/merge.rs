//! `gpufeed merge`: joins datasets of tokens (the parts `gpufeed tokenize --part I/N` wrote on
//! N machines) in order into one, byte for byte the files a single run writes.
//!
//! Megatron's datasets are joined as megatron-core's `tools/merge_datasets.py` joins them
//! (`IndexedDatasetBuilder.add_index`): the `.bin`s concatenated; in the `.idx`, the
//! sequences' lengths appended, their pointers those of the sequences back to back (what
//! Megatron's index writer computes), and each part's document index offset by the sequences
//! before it. Parts must share the token dtype and be plain text datasets (no sequence modes);
//! each part's sequences must lie back to back in its `.bin`, filling it, as every builder
//! writes them, since the `.bin`s are copied whole. All of that is checked before anything is
//! written. nanoGPT's flat `.bin`s are concatenated: they say nothing of their dtype.
//!
//! Memory stays bounded whatever the sizes: the indices are read where they are mapped, the
//! `.idx` is written from them in passes, and each `.bin` is copied by the kernel
//! (`std::io::copy` between files). The output is checked as `tokenize` checks its own
//! (`tokenize::checked_outputs`), written to temporaries placed together at the end
//! (`gpufeed::temporary::PlacedTogether`, through the tokenize writer's index writer), and a
//! signal removes the temporaries (`cleanup.rs`).

use std::fs::File;
use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::time::Instant;

use gpufeed::memory::significant;
use gpufeed::source::tokens::{IndexedTokens, TokenSource};
use gpufeed::temporary::PlacedTogether;
use gpufeed::{Error, Result};

use crate::tokenize::checked_outputs;
use crate::tokenize::writer::{Format, IndexCounts, output_paths, write_index};

/// Arguments of `gpufeed merge`.
#[derive(clap::Args)]
pub struct Args {
    /// The datasets to join, in this order: the prefixes `gpufeed tokenize -o` was given
    /// (PREFIX.bin and PREFIX.idx; a name with either extension is taken as its prefix).
    #[arg(required = true, value_name = "PREFIX")]
    parts: Vec<PathBuf>,
    /// The prefix of the files to write: PREFIX.bin and PREFIX.idx (Megatron), or PREFIX.bin
    /// (nanoGPT).
    #[arg(short = 'o', long = "output", value_name = "PREFIX")]
    output: PathBuf,
    /// What the parts are: Megatron datasets (their dtypes checked to match, the indices
    /// joined), or nanoGPT's flat files of tokens (PREFIX.bin, or a name ending in .bin),
    /// concatenated as they are.
    #[arg(long, value_enum, default_value = "megatron")]
    format: Format,
    /// Replace existing output files of this kind (a Megatron dataset, a file of tokens).
    #[arg(long)]
    force: bool,
}

/// Runs `gpufeed merge`.
pub fn run(args: Args) -> Result<()> {
    let start = Instant::now();
    let parts = match args.format {
        Format::Megatron => Parts::Megatron(open_megatron(&args.parts)?),
        Format::Nanogpt => Parts::Flat(flat_files(&args.parts)?),
    };
    let inputs = parts.files();
    let paths = checked_outputs("merge", args.format, &args.output, &inputs, args.force)?;

    let refs: Vec<&Path> = paths.iter().map(PathBuf::as_path).collect();
    let mut files = PlacedTogether::create(&refs)?;
    let bar = crate::messages::progress(inputs.len() as u64, "merging", false);
    let summary = match &parts {
        Parts::Megatron(parts) => {
            for part in parts {
                append(&mut files, part.bin_path(), part.data_len())?;
                part.check_unchanged()?;
                bar.inc(2);
            }
            let counts = merged_counts(parts);
            let (out, path) = files.writer(1);
            write_index(
                out,
                path,
                &counts,
                || merged_lengths(parts),
                merged_ends(parts),
            )?;
            let tokens = parts.iter().map(|p| p.data_len()).sum::<u64>() / counts.item_bytes;
            format!(
                "{} documents, {tokens} tokens of {}",
                counts.documents,
                parts[0].dtype().name()
            )
        }
        Parts::Flat(parts) => {
            let mut bytes = 0;
            for (path, len) in parts {
                append(&mut files, path, *len)?;
                bytes += len;
                bar.inc(1);
            }
            format!("{bytes} bytes of tokens")
        }
    };
    files.place()?;
    bar.finish_and_clear();
    let written: Vec<String> = paths.iter().map(|p| p.display().to_string()).collect();
    crate::out(format_args!(
        "merged {} parts ({summary}) in {} s: {}",
        args.parts.len(),
        significant(start.elapsed().as_secs_f64()),
        written.join(", ")
    ))
}

/// The datasets to join, opened and checked.
enum Parts {
    /// Megatron's datasets.
    Megatron(Vec<IndexedTokens>),
    /// Flat files of tokens and their sizes.
    Flat(Vec<(PathBuf, u64)>),
}

impl Parts {
    /// Every file that is read.
    fn files(&self) -> Vec<&Path> {
        match self {
            Parts::Megatron(parts) => parts
                .iter()
                .flat_map(|p| [p.idx_path(), p.bin_path()])
                .collect(),
            Parts::Flat(parts) => parts.iter().map(|(p, _)| p.as_path()).collect(),
        }
    }
}

/// Opens the Megatron datasets `names` and checks that they can be joined (see the module
/// docs), naming the part that cannot.
fn open_megatron(names: &[PathBuf]) -> Result<Vec<IndexedTokens>> {
    // The joined index takes its dtype from the first part.
    if names.is_empty() {
        return Err(Error::user("no parts to merge: name them, in order"));
    }
    let mut parts: Vec<IndexedTokens> = Vec::with_capacity(names.len());
    for name in names {
        if IndexedTokens::prefix_of(name).is_none() {
            // No index: name its files as the reader would (a name with either extension is
            // its prefix).
            let prefix = match name.extension() {
                Some(e) if e == "bin" || e == "idx" => name.with_extension(""),
                _ => name.to_path_buf(),
            };
            let files = output_paths(Format::Megatron, &prefix);
            let (bin, idx) = (&files[0], &files[1]);
            if bin.is_file() {
                return Err(Error::user(format!(
                    "{}: no Megatron index ({}) beside it: a .bin alone is a flat file of \
                     tokens (nanoGPT's); merge those with --format nanogpt",
                    bin.display(),
                    idx.display()
                )));
            }
            if !bin.exists() {
                return Err(Error::Io {
                    source: std::io::Error::new(
                        std::io::ErrorKind::NotFound,
                        format!(
                            "the part {} is not there (neither {} nor {}): check its name, and \
                             that it was written",
                            name.display(),
                            idx.display(),
                            bin.display()
                        ),
                    ),
                    path: idx.clone(),
                    op: "open",
                });
            }
        }
        let part = IndexedTokens::open(name)?;
        if part.multimodal() {
            return Err(Error::user(format!(
                "{}: a multimodal dataset (its index holds sequence modes): gpufeed merge joins \
                 datasets of text; use Megatron's tools/merge_datasets.py --multimodal",
                part.name()
            )));
        }
        if let Some(first) = parts.first()
            && first.dtype_code() != part.dtype_code()
        {
            return Err(Error::Mismatch {
                what: format!(
                    "{} stores its tokens as {} (Megatron's dtype code {}), {} as {} (code {}): \
                     the parts of one dataset share a dtype; tokenize them all with the same \
                     tokenizer",
                    part.name(),
                    part.dtype().name(),
                    part.dtype_code(),
                    first.name(),
                    first.dtype().name(),
                    first.dtype_code()
                ),
            });
        }
        check_back_to_back(&part)?;
        parts.push(part);
    }
    Ok(parts)
}

/// Checks that `part`'s sequences lie back to back from the start of its `.bin` and fill it,
/// and that its document index is in order: what copying the `.bin` whole and computing the
/// pointers from the lengths needs.
fn check_back_to_back(part: &IndexedTokens) -> Result<()> {
    let malformed = |what: String| Error::Malformed {
        path: part.idx_path().to_path_buf(),
        format: "Megatron index (.idx)",
        what,
    };
    let item = part.dtype().size() as u64;
    let mut end = 0u64;
    for seq in 0..part.sequences() {
        let (len, at) = part.sequence(seq)?;
        if at != end {
            return Err(malformed(format!(
                "sequence {seq} starts at byte {at}, not where the sequences before it end \
                 ({end}): gpufeed merge copies each .bin whole, so its sequences must lie back \
                 to back, as Megatron's builders write them"
            )));
        }
        end += len * item;
    }
    if end != part.data_len() {
        return Err(malformed(format!(
            "its sequences end at byte {end} of the {}-byte {}: gpufeed merge copies each .bin \
             whole, so its sequences must fill it",
            part.data_len(),
            part.bin_path().display()
        )));
    }
    for doc in 0..part.documents() {
        part.document_sequences(doc)?;
    }
    Ok(())
}

/// The header of the joined index.
fn merged_counts(parts: &[IndexedTokens]) -> IndexCounts {
    IndexCounts {
        code: parts[0].dtype_code(),
        item_bytes: parts[0].dtype().size() as u64,
        sequences: parts.iter().map(|p| p.sequences()).sum(),
        documents: parts.iter().map(|p| p.documents()).sum(),
    }
}

/// Every part's sequence lengths, in order.
fn merged_lengths(parts: &[IndexedTokens]) -> impl Iterator<Item = Result<i32>> {
    parts.iter().flat_map(|p| {
        // A length was read from an i32 and checked not negative.
        (0..p.sequences()).map(move |s| p.sequence(s).map(|(len, _)| len as i32))
    })
}

/// Every part's document ends, offset by the sequences of the parts before it.
fn merged_ends(parts: &[IndexedTokens]) -> impl Iterator<Item = Result<u64>> {
    let mut before = 0u64;
    parts.iter().flat_map(move |p| {
        let offset = before;
        before += p.sequences();
        (0..p.documents()).map(move |d| p.document_sequences(d).map(|s| offset + s.end))
    })
}

/// The flat files of tokens `names` (`PREFIX.bin`, or a name ending in `.bin`) and their
/// sizes; a Megatron dataset's `.bin` is refused, as joining it alone would drop its index.
fn flat_files(names: &[PathBuf]) -> Result<Vec<(PathBuf, u64)>> {
    names
        .iter()
        .map(|name| {
            let path = flat_file(name);
            if let Some(prefix) = IndexedTokens::prefix_of(&path) {
                return Err(Error::user(format!(
                    "{}: a Megatron dataset (its index {}.idx is beside it): merge Megatron \
                     datasets without --format nanogpt",
                    path.display(),
                    prefix.display()
                )));
            }
            let meta = std::fs::metadata(&path).map_err(|source| Error::Io {
                path: path.clone(),
                op: "open",
                source,
            })?;
            if !meta.is_file() {
                return Err(Error::user(format!(
                    "{}: is {}, not a file of tokens",
                    path.display(),
                    crate::output::kind_of(meta.file_type())
                )));
            }
            Ok((path, meta.len()))
        })
        .collect()
}

/// The `.bin` a part's name stands for: itself if it ends in `.bin`, else `NAME.bin`.
fn flat_file(name: &Path) -> PathBuf {
    if name.extension().is_some_and(|e| e == "bin") {
        return name.to_path_buf();
    }
    output_paths(Format::Nanogpt, name).remove(0)
}

/// Appends the `len` bytes of the file `path` to the output's `.bin`, copied by the kernel
/// where it can (`copy_file_range`), else in large buffers.
fn append(files: &mut PlacedTogether, path: &Path, len: u64) -> Result<()> {
    let (out, dest) = files.writer(0);
    let failed = |source| Error::Io {
        path: dest.to_path_buf(),
        op: "write (its temporary file)",
        source,
    };
    // Nothing is buffered (every byte goes straight to the file), but a flush keeps it so.
    out.flush().map_err(failed)?;
    let input = File::open(path).map_err(|source| Error::Io {
        path: path.to_path_buf(),
        op: "open",
        source,
    })?;
    let copied = std::io::copy(&mut input.take(len), out.get_mut()).map_err(|source| {
        // The error is the read's or the write's: name both files.
        Error::Io {
            path: dest.to_path_buf(),
            op: "copy into (its temporary file)",
            source: std::io::Error::new(
                source.kind(),
                format!("from {}: {source}", path.display()),
            ),
        }
    })?;
    if copied != len {
        return Err(Error::FileChanged {
            path: path.to_path_buf(),
            what: format!("it had {len} bytes when opened, {copied} when copied"),
        });
    }
    Ok(())
}
