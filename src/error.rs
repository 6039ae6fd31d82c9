//! The one error type of the crate.
//!
//! Every variant says *what* went wrong and *where*: the file, the record, the sample or the
//! builder setting concerned. Nothing in gpufeed panics on bad input; it returns one of these.
//!
//! Three ways to look at an [`Error`]:
//!
//! - its message ([`Display`](std::fmt::Display)): one line that tells the whole story,
//!   including the message of its cause (`sample 3 (batch 0): data.bin: read: Input/output
//!   error`);
//! - its cause as a value ([`std::error::Error::source`]): the [`std::io::Error`], the
//!   driver's error (`cudarc`'s `DriverError`, feature `cuda`) or, for a sample or a batch that
//!   failed, the inner error (a `Box<Error>`: `downcast_ref::<Box<Error>>()`);
//! - its kind ([`Error::kind`]): an [`ErrorKind`] to match on, which stays the same when a
//!   sample or batch wraps the error.
//!
//! Its [`Debug`](std::fmt::Debug) form (what `fn main() -> gpufeed::Result<()>` prints) is the
//! message followed by each cause the message does not already contain (`caused by: ...`).

use std::error::Error as _;
use std::fmt;
use std::path::{Path, PathBuf};

/// A `Result` with gpufeed's [`Error`].
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Everything that can go wrong in gpufeed.
///
/// Match on [`Error::kind`] to tell classes of failure apart; match on the variants for the
/// details they carry (new variants may come: the enum is `#[non_exhaustive]`).
#[derive(thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// An I/O operation on a file failed.
    #[error("{path}: {op}: {source}")]
    Io {
        /// The file concerned.
        path: PathBuf,
        /// What was being done (`open`, `map`, `write`, `rename`, ...).
        op: &'static str,
        /// The operating system's error.
        source: std::io::Error,
    },

    /// A file is not in the format it claims (or is expected) to be in: bad magic, a truncated
    /// file, a header, footer, schema or table that does not hold together.
    #[error("{path}: malformed {format} file: {what}")]
    Malformed {
        /// The file concerned.
        path: PathBuf,
        /// The format expected (`packed record`, `npy`, ...).
        format: &'static str,
        /// What is wrong, with the offsets or values involved.
        what: String,
    },

    /// A name that is no data set gpufeed reads: nothing by that name, not a regular file or
    /// a directory, an empty file, or a file or directory of no known format. `what` says
    /// which, and what each format is recognised by.
    #[error("{path}: {what}")]
    Unrecognised {
        /// The name concerned.
        path: PathBuf,
        /// What it is, and what gpufeed looked for.
        what: String,
    },

    /// A file was written by a newer major version of the format than this reader knows.
    #[error(
        "{path}: format version {major}.{minor} is newer than this reader supports ({supported}.x); upgrade gpufeed"
    )]
    UnsupportedVersion {
        /// The file concerned.
        path: PathBuf,
        /// The file's major version.
        major: u16,
        /// The file's minor version.
        minor: u16,
        /// The major version this reader supports.
        supported: u16,
    },

    /// One record of a file is malformed (its offsets, its variable-size field table, ...).
    #[error("{path}: record {record}: {what}")]
    BadRecord {
        /// The file concerned.
        path: PathBuf,
        /// The record's index within that file.
        record: u64,
        /// What is wrong.
        what: String,
    },

    /// A record's bytes do not match its stored checksum.
    #[error(
        "{path}: record {record}: checksum mismatch (stored {stored:#018x}, computed {computed:#018x})"
    )]
    ChecksumMismatch {
        /// The file concerned.
        path: PathBuf,
        /// The record's index within that file.
        record: u64,
        /// The checksum stored in the file.
        stored: u64,
        /// The checksum of the bytes read.
        computed: u64,
    },

    /// A file changed on disk after a source opened it: replaced by another file, removed,
    /// truncated, extended or written in place. Found by
    /// [`Dataset::check_unchanged`](crate::source::Dataset::check_unchanged) (at each epoch's
    /// start), by a read that ends early ([`ReadMode::Pread`](crate::source::ReadMode)), or by
    /// [`pack_raw_records`](crate::format::pack_raw_records) for an input that shrank.
    #[error("{path}: the file changed after it was opened: {what}")]
    FileChanged {
        /// The file concerned.
        path: PathBuf,
        /// What changed, with the values at open and now.
        what: String,
    },

    /// A `.npy` array that gpufeed cannot read in place (Fortran order, object dtype, ...).
    #[error("{path}: unsupported .npy array: {what}")]
    UnsupportedNpy {
        /// The file concerned.
        path: PathBuf,
        /// What is unsupported, and why.
        what: String,
    },

    /// A table (Parquet, Arrow) that gpufeed cannot read as it is: a column asked for whose
    /// type cannot be batched (a map, a union, a decimal, a list of strings, ...), Arrow
    /// buffers compressed in the file.
    #[error("{path}: {what}")]
    UnsupportedTable {
        /// The file concerned.
        path: PathBuf,
        /// What cannot be read (naming the column), and what would do instead.
        what: String,
    },

    /// Inputs that must agree do not (shards with different schemas, a labels file of another
    /// length, a field name that does not exist, ...).
    #[error("{what}")]
    Mismatch {
        /// What disagrees with what.
        what: String,
    },

    /// A sample index past the end of a dataset.
    #[error("sample {index} is out of range for a dataset of {len} samples")]
    OutOfRange {
        /// The index asked for.
        index: u64,
        /// The dataset's length.
        len: u64,
    },

    /// A builder or command-line setting that cannot work.
    #[error("invalid setting `{setting}`: {what}")]
    InvalidConfig {
        /// The setting concerned (`batch_size`, `rank`, ...).
        setting: &'static str,
        /// Why it cannot work.
        what: String,
    },

    /// Reading or transforming one sample failed; the batch that holds it fails with this error.
    #[error("sample {index} (batch {batch}): {source}")]
    Sample {
        /// The sample's index in the dataset.
        index: u64,
        /// The batch it belonged to, in this epoch.
        batch: u64,
        /// What went wrong.
        #[source]
        source: Box<Error>,
    },

    /// The batch hook ([`LoaderBuilder::batch_hook`](crate::LoaderBuilder::batch_hook)) failed
    /// on a batch; the loader delivers this error in the batch's place.
    #[error("batch {batch}: {source}")]
    Batch {
        /// The batch's number in this epoch.
        batch: u64,
        /// What went wrong.
        #[source]
        source: Box<Error>,
    },

    /// A [`Schema`](crate::Schema) that cannot work: no fields, a name empty, over-long or
    /// repeated, a tensor with too many dimensions or more than 4 GiB per record.
    #[error("{what}")]
    InvalidSchema {
        /// What is wrong with the fields.
        what: String,
    },

    /// User code (a transform) failed or panicked.
    #[error("{what}")]
    User {
        /// The message of the error or of the panic.
        what: String,
    },

    /// An image could not be decoded or transformed.
    #[error(
        "{source_name}: {what}{}{}",
        RaiseWith(*.setting),
        ColonThen(.source.as_deref())
    )]
    Image {
        /// The file (or packed record) the image came from.
        source_name: String,
        /// What is wrong with it.
        what: String,
        /// The image transform's setting whose limit refused the image (`max_pixels`), when a
        /// limit refused it rather than its bytes being broken: raising the setting lets it
        /// through. The message ends with the builder method that sets it; the command and
        /// the Python package name their flag and argument instead.
        setting: Option<&'static str>,
        /// The decoder's own error, when a decoder said what is wrong (`image`'s
        /// `ImageError`, zune-jpeg's `DecodeErrors`, `turbojpeg::Error`); the message ends
        /// with its message.
        #[source]
        source: Option<Box<dyn std::error::Error + Send + Sync + 'static>>,
    },

    /// A thread gpufeed needs could not be started: the operating system refused it (too many
    /// threads for `ulimit -u`, no memory for its stack). It names the setting that asks for
    /// the thread, the one to lower; it is of [`ErrorKind::Config`], as a setting that cannot
    /// work on this machine.
    #[error("invalid setting `{setting}`: cannot start {thread}: {source}")]
    Spawn {
        /// The setting that asks for the thread (`workers`, `device`, ...).
        setting: &'static str,
        /// The thread, in words (`worker thread 3`, `the copy thread`).
        thread: String,
        /// The operating system's error.
        source: std::io::Error,
    },

    /// The loader was shut down (its threads stopped) while an operation waited on it.
    #[error("the loader has shut down")]
    Shutdown,

    /// No usable GPU: no driver, no device with that ordinal, or the crate was built without
    /// the `cuda` feature.
    #[error("no GPU: {what}")]
    NoGpu {
        /// Why no GPU can be used.
        what: String,
    },

    /// A library gpufeed loads at run time (nvJPEG, for the GPU decode) cannot be loaded: what
    /// was tried, and how to get it.
    #[error("{library} cannot be loaded: {what}")]
    MissingLibrary {
        /// The library.
        library: &'static str,
        /// Where it was looked for, why it did not load, and how to install it.
        what: String,
    },

    /// A CUDA driver call failed; the driver's error is the [`source`](std::error::Error::source).
    #[cfg(feature = "cuda")]
    #[error("CUDA: {op}: {source}")]
    Driver {
        /// The operation that failed.
        op: &'static str,
        /// The driver's error code and message.
        source: cudarc::driver::DriverError,
    },

    /// A CUDA operation failed without a driver error code (the driver returned a null
    /// pointer, the pinned memory could not be mapped, a measurement came out empty, ...).
    /// Failed driver calls are `Error::Driver` (feature `cuda`).
    #[error("CUDA: {op}: {what}")]
    Cuda {
        /// The operation that failed.
        op: &'static str,
        /// What went wrong.
        what: String,
    },

    /// The framework a batch was handed to refused it: candle could not allocate or make a
    /// tensor of a field (feature `candle`); candle's error is the source.
    #[cfg(feature = "candle")]
    #[error("candle: {what}: {source}")]
    Candle {
        /// The field and the step of the hand-off.
        what: String,
        /// candle's error.
        #[source]
        source: Box<candle_core::Error>,
    },

    /// A member of a tar shard breaks WebDataset's rules (no extension, an extension repeated
    /// within one sample, a member type that cannot be read in place, ...).
    #[error("{shard}: member `{member}` (header at byte {offset}): {what}")]
    BadMember {
        /// The shard concerned.
        shard: PathBuf,
        /// The member's name as stored.
        member: String,
        /// Where the member's header starts in the shard.
        offset: u64,
        /// What is wrong.
        what: String,
    },

    /// A sample of a sharded dataset lacks a field of the dataset's schema.
    #[error("{shard}: sample `{key}` has no field `{field}`")]
    MissingField {
        /// The shard concerned.
        shard: PathBuf,
        /// The sample's key (WebDataset's `__key__`) or its index within the shard.
        key: String,
        /// The field it lacks.
        field: String,
    },

    /// A line of a JSON lines file that does not hold the data set's fields: not one JSON
    /// object, a value of another type than its field's, a key missing or a value `null`
    /// without a fill value for it.
    #[error("{path}: line {line}{}: {what}", ColumnOf(.column))]
    BadLine {
        /// The file concerned (the compressed file, for one read decompressed).
        path: PathBuf,
        /// The line's number in the file, from 1, blank lines counted.
        line: u64,
        /// Where in the line, in characters from 1 (as Python's `json` counts), where one
        /// place is at fault.
        column: Option<u64>,
        /// What is wrong.
        what: String,
    },

    /// A shard could not be fetched from object storage, or the local cache could not hold it.
    #[error("{shard}: {kind}: {what}")]
    Remote {
        /// The shard (or index) concerned, as its URL.
        shard: PathBuf,
        /// What kind of failure it is.
        kind: RemoteErrorKind,
        /// The details: the server's answer, the sizes or checksums involved.
        what: String,
    },
}

/// The kinds of [`Error::Remote`], for callers that react to some (retry later, fix the keys).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum RemoteErrorKind {
    /// The object does not exist.
    NotFound,
    /// The bucket (or container) does not exist.
    NoSuchBucket,
    /// The server refused the credentials, or they grant no access to the object.
    AccessDenied,
    /// Requests kept failing (server errors, cut connections, time-outs) after every retry.
    Unavailable,
    /// The bytes that arrived do not match the index's checksum (or the object's MD5 ETag),
    /// or the object changed while it was fetched.
    Checksum,
    /// The object in the store is not of the size the index (or the store's listing) says.
    SizeMismatch,
    /// The local cache cannot hold the shard: it is larger than the cache's byte limit, or
    /// the cache's disk is full.
    CacheFull,
    /// The URL or the store's settings cannot work.
    Config,
}

impl std::fmt::Display for RemoteErrorKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            RemoteErrorKind::NotFound => "not found",
            RemoteErrorKind::NoSuchBucket => "no such bucket",
            RemoteErrorKind::AccessDenied => "access denied",
            RemoteErrorKind::Unavailable => "unavailable",
            RemoteErrorKind::Checksum => "checksum mismatch",
            RemoteErrorKind::SizeMismatch => "size mismatch",
            RemoteErrorKind::CacheFull => "cache full",
            RemoteErrorKind::Config => "bad store setting",
        })
    }
}

/// The class of an [`Error`], to match on (see [`Error::kind`]).
///
/// Modelled on regex-automata's `MatchErrorKind`: a small `Copy` value that says what kind of
/// failure it was, while the [`Error`] carries the details. New kinds may be added.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum ErrorKind {
    /// An operating-system I/O call failed ([`Error::Io`]).
    Io,
    /// A file or a record is not what its format says: bad magic, truncated, a checksum
    /// mismatch, a tar member or a sample that breaks its format's rules ([`Error::Malformed`],
    /// [`Error::BadRecord`], [`Error::ChecksumMismatch`], [`Error::BadMember`],
    /// [`Error::MissingField`], [`Error::BadLine`]).
    Corrupt,
    /// A file this version of gpufeed cannot read: a newer format version or an `.npy` array
    /// it cannot read in place, a table's column that cannot be batched or buffers compressed
    /// in an Arrow file, or a name of no format it reads ([`Error::UnsupportedVersion`],
    /// [`Error::UnsupportedNpy`], [`Error::UnsupportedTable`], [`Error::Unrecognised`]).
    Unsupported,
    /// A file changed on disk after it was opened ([`Error::FileChanged`]).
    FileChanged,
    /// Inputs that must agree do not, or an index is out of range ([`Error::Mismatch`],
    /// [`Error::OutOfRange`]).
    Mismatch,
    /// A setting or a schema that cannot work ([`Error::InvalidConfig`],
    /// [`Error::InvalidSchema`]), or a thread a setting asks for that could not be started
    /// ([`Error::Spawn`]).
    Config,
    /// An image could not be decoded or transformed ([`Error::Image`]); these are what
    /// `OnBadImage::Skip` skips.
    Image,
    /// User code (a transform, a batch hook) failed or panicked ([`Error::User`]).
    User,
    /// The loader shut down while an operation waited on it ([`Error::Shutdown`]).
    Shutdown,
    /// No usable GPU, or a CUDA call failed ([`Error::NoGpu`], [`Error::Cuda`] and, with the
    /// `cuda` feature, `Error::Driver`).
    Gpu,
    /// A shard could not be fetched from object storage or kept in the local cache
    /// ([`Error::Remote`]; its [`RemoteErrorKind`] says why).
    Remote,
    /// The framework a batch was handed to refused it (candle, feature `candle`:
    /// `Error::Candle`).
    Framework,
}

impl Error {
    /// The class of this error, to match on.
    ///
    /// A sample's or a batch's failure ([`Error::Sample`], [`Error::Batch`]) is of its cause's
    /// kind: a corrupt record read for sample 3 is [`ErrorKind::Corrupt`].
    ///
    /// ```
    /// use gpufeed::{Error, ErrorKind, Schema};
    ///
    /// let e = Schema::new(vec![]).unwrap_err();
    /// assert_eq!(e.kind(), ErrorKind::Config);
    /// let e = Error::Sample { index: 3, batch: 0, source: Box::new(e) };
    /// assert_eq!(e.kind(), ErrorKind::Config);
    /// ```
    pub fn kind(&self) -> ErrorKind {
        match self {
            Error::Io { .. } => ErrorKind::Io,
            Error::Malformed { .. }
            | Error::BadRecord { .. }
            | Error::ChecksumMismatch { .. }
            | Error::BadMember { .. }
            | Error::MissingField { .. }
            | Error::BadLine { .. } => ErrorKind::Corrupt,
            Error::UnsupportedVersion { .. }
            | Error::UnsupportedNpy { .. }
            | Error::UnsupportedTable { .. }
            | Error::Unrecognised { .. } => ErrorKind::Unsupported,
            Error::FileChanged { .. } => ErrorKind::FileChanged,
            Error::Mismatch { .. } | Error::OutOfRange { .. } => ErrorKind::Mismatch,
            Error::InvalidConfig { .. } | Error::InvalidSchema { .. } | Error::Spawn { .. } => {
                ErrorKind::Config
            }
            Error::Sample { source, .. } | Error::Batch { source, .. } => source.kind(),
            Error::User { .. } => ErrorKind::User,
            Error::Image { .. } => ErrorKind::Image,
            Error::Shutdown => ErrorKind::Shutdown,
            Error::NoGpu { .. } | Error::Cuda { .. } | Error::MissingLibrary { .. } => {
                ErrorKind::Gpu
            }
            #[cfg(feature = "cuda")]
            Error::Driver { .. } => ErrorKind::Gpu,
            Error::Remote { .. } => ErrorKind::Remote,
            #[cfg(feature = "candle")]
            Error::Candle { .. } => ErrorKind::Framework,
        }
    }

    /// An [`Error::Io`] for `path`.
    pub(crate) fn io(path: &Path, op: &'static str, source: std::io::Error) -> Error {
        Error::Io {
            path: path.to_path_buf(),
            op,
            source,
        }
    }

    /// An [`Error::InvalidConfig`].
    pub(crate) fn config(setting: &'static str, what: impl Into<String>) -> Error {
        Error::InvalidConfig {
            setting,
            what: what.into(),
        }
    }

    /// An [`Error::Spawn`]: `thread`, which `setting` asks for, could not be started.
    pub(crate) fn spawn(
        setting: &'static str,
        thread: impl Into<String>,
        source: std::io::Error,
    ) -> Error {
        Error::Spawn {
            setting,
            thread: thread.into(),
            source,
        }
    }

    /// An [`Error::Mismatch`].
    pub(crate) fn mismatch(what: impl Into<String>) -> Error {
        Error::Mismatch { what: what.into() }
    }

    /// A user-code error: wraps any error type with its message.
    pub fn user(what: impl std::fmt::Display) -> Error {
        Error::User {
            what: what.to_string(),
        }
    }
}

/// The advice that ends an [`Error::Image`] refused by a limit: the builder method that raises
/// it; nothing for an image that is broken.
struct RaiseWith(Option<&'static str>);

impl fmt::Display for RaiseWith {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.0 {
            Some(setting) => write!(f, "; raise it with ImageTransformBuilder::{setting}"),
            None => Ok(()),
        }
    }
}

/// `, column N`, or nothing without a column ([`Error::BadLine`]).
struct ColumnOf<'a>(&'a Option<u64>);

impl fmt::Display for ColumnOf<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.0 {
            Some(c) => write!(f, ", column {c}"),
            None => Ok(()),
        }
    }
}

/// `: ` and a cause's message, or nothing without a cause: the end of a message whose cause is
/// optional ([`Error::Image`]).
struct ColonThen<'a>(Option<&'a (dyn std::error::Error + Send + Sync + 'static)>);

impl fmt::Display for ColonThen<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.0 {
            Some(cause) => write!(f, ": {cause}"),
            None => Ok(()),
        }
    }
}

/// The message, then each cause the lines before do not already contain, as `anyhow` prints
/// an error: what `fn main() -> gpufeed::Result<()>` shows when it returns an error.
///
/// ```text
/// sample 7 (batch 1): data.bin: read: Input/output error (os error 5)
/// ```
///
/// The alternate form (`{:#?}`) is a struct: kind, message and cause.
impl fmt::Debug for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if f.alternate() {
            return f
                .debug_struct("Error")
                .field("kind", &self.kind())
                .field("message", &self.to_string())
                .field("source", &self.source())
                .finish();
        }
        let mut shown = self.to_string();
        f.write_str(&shown)?;
        let mut cause = self.source();
        while let Some(e) = cause {
            let text = e.to_string();
            if !shown.contains(&text) {
                write!(f, "\ncaused by: {text}")?;
                shown.push('\n');
                shown.push_str(&text);
            }
            cause = e.source();
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An error with a cause of its own, as a library below an `io::Error` may return.
    #[derive(Debug, thiserror::Error)]
    #[error("the volume is read-only")]
    struct ReadOnly(#[source] Inner);

    #[derive(Debug, thiserror::Error)]
    #[error("mounted with `ro`")]
    struct Inner;

    #[test]
    fn debug_prints_the_message_not_a_struct() {
        let e = Error::Sample {
            index: 7,
            batch: 1,
            source: Box::new(Error::io(
                Path::new("data.bin"),
                "read",
                std::io::Error::from_raw_os_error(libc::EIO),
            )),
        };
        let debug = format!("{e:?}");
        assert_eq!(debug, e.to_string());
        assert!(
            debug.starts_with("sample 7 (batch 1): data.bin: read: "),
            "{debug}"
        );
        assert!(!debug.contains("Sample {"), "{debug}");
    }

    #[test]
    fn debug_prints_each_cause_the_message_lacks() {
        let e = Error::io(
            Path::new("out.bin"),
            "write",
            std::io::Error::other(ReadOnly(Inner)),
        );
        assert_eq!(
            format!("{e:?}"),
            "out.bin: write: the volume is read-only\ncaused by: mounted with `ro`"
        );
        // The chain is there as values too.
        let io = e
            .source()
            .unwrap()
            .downcast_ref::<std::io::Error>()
            .unwrap();
        assert_eq!(io.kind(), std::io::ErrorKind::Other);
    }

    #[test]
    fn alternate_debug_is_a_struct() {
        let e = Error::Shutdown;
        let debug = format!("{e:#?}");
        assert!(debug.contains("kind: Shutdown"), "{debug}");
        assert!(debug.contains("the loader has shut down"), "{debug}");
    }

    #[test]
    fn batch_and_sample_errors_keep_their_cause_and_its_kind() {
        let inner = Error::ChecksumMismatch {
            path: "a.bin".into(),
            record: 3,
            stored: 1,
            computed: 2,
        };
        let e = Error::Batch {
            batch: 4,
            source: Box::new(Error::Sample {
                index: 3,
                batch: 4,
                source: Box::new(inner),
            }),
        };
        assert_eq!(e.kind(), ErrorKind::Corrupt);
        // The source is the boxed inner error itself (thiserror hands out the `Box`).
        let sample = e.source().unwrap().downcast_ref::<Box<Error>>().unwrap();
        assert!(matches!(**sample, Error::Sample { index: 3, .. }));
        let record = sample
            .source()
            .unwrap()
            .downcast_ref::<Box<Error>>()
            .unwrap();
        assert!(matches!(
            **record,
            Error::ChecksumMismatch { record: 3, .. }
        ));
        assert!(
            e.to_string()
                .starts_with("batch 4: sample 3 (batch 4): a.bin: record 3")
        );
    }

    #[test]
    fn every_kind_is_derived_from_its_variant() {
        let p = PathBuf::from("f");
        let cases = [
            (
                Error::io(&p, "open", std::io::Error::other("x")),
                ErrorKind::Io,
            ),
            (
                Error::Malformed {
                    path: p.clone(),
                    format: "npy",
                    what: "x".into(),
                },
                ErrorKind::Corrupt,
            ),
            (
                Error::UnsupportedNpy {
                    path: p.clone(),
                    what: "x".into(),
                },
                ErrorKind::Unsupported,
            ),
            (
                Error::UnsupportedTable {
                    path: p.clone(),
                    what: "x".into(),
                },
                ErrorKind::Unsupported,
            ),
            (
                Error::FileChanged {
                    path: p.clone(),
                    what: "x".into(),
                },
                ErrorKind::FileChanged,
            ),
            (Error::OutOfRange { index: 9, len: 1 }, ErrorKind::Mismatch),
            (Error::config("batch_size", "x"), ErrorKind::Config),
            (Error::InvalidSchema { what: "x".into() }, ErrorKind::Config),
            (Error::user("x"), ErrorKind::User),
            (
                Error::Image {
                    source_name: "a.jpg".into(),
                    what: "x".into(),
                    setting: None,
                    source: None,
                },
                ErrorKind::Image,
            ),
            (
                Error::spawn("workers", "worker thread 0", std::io::Error::other("x")),
                ErrorKind::Config,
            ),
            (Error::Shutdown, ErrorKind::Shutdown),
            (Error::NoGpu { what: "x".into() }, ErrorKind::Gpu),
        ];
        for (e, kind) in cases {
            assert_eq!(e.kind(), kind, "{e}");
        }
    }

    #[test]
    fn an_image_error_keeps_the_decoders_error_as_its_source() {
        let e = Error::Image {
            source_name: "a.png".into(),
            what: "corrupt PNG".into(),
            setting: None,
            source: Some(Box::new(ReadOnly(Inner))),
        };
        assert_eq!(e.kind(), ErrorKind::Image);
        assert_eq!(e.to_string(), "a.png: corrupt PNG: the volume is read-only");
        let cause = e.source().unwrap().downcast_ref::<ReadOnly>().unwrap();
        assert!(cause.source().unwrap().is::<Inner>());
        // The decoder's message is in the line already; its own cause is not.
        assert_eq!(
            format!("{e:?}"),
            "a.png: corrupt PNG: the volume is read-only\ncaused by: mounted with `ro`"
        );
        let plain = Error::Image {
            source_name: "b.png".into(),
            what: "empty file: no image data".into(),
            setting: None,
            source: None,
        };
        assert_eq!(plain.to_string(), "b.png: empty file: no image data");
        assert!(plain.source().is_none());
    }

    #[test]
    fn an_image_refused_by_a_limit_names_the_setting_that_raises_it() {
        let e = Error::Image {
            source_name: "big.jpg".into(),
            what: "too many pixels".into(),
            setting: Some("max_pixels"),
            source: None,
        };
        assert_eq!(
            e.to_string(),
            "big.jpg: too many pixels; raise it with ImageTransformBuilder::max_pixels"
        );
    }

    #[test]
    fn a_thread_that_cannot_start_keeps_the_os_error_and_names_the_setting() {
        let e = Error::spawn(
            "workers",
            "worker thread 3",
            std::io::Error::from_raw_os_error(libc::EAGAIN),
        );
        assert_eq!(e.kind(), ErrorKind::Config);
        let text = e.to_string();
        assert!(
            text.starts_with("invalid setting `workers`: cannot start worker thread 3: "),
            "{text}"
        );
        let io = e
            .source()
            .unwrap()
            .downcast_ref::<std::io::Error>()
            .unwrap();
        assert_eq!(io.raw_os_error(), Some(libc::EAGAIN));
        assert_eq!(format!("{e:?}"), text);
    }

    #[cfg(feature = "cuda")]
    #[test]
    fn a_driver_error_stays_the_source() {
        use cudarc::driver::{DriverError, sys::CUresult};
        let e = Error::Driver {
            op: "allocate",
            source: DriverError(CUresult::CUDA_ERROR_OUT_OF_MEMORY),
        };
        assert_eq!(e.kind(), ErrorKind::Gpu);
        let driver = e.source().unwrap().downcast_ref::<DriverError>().unwrap();
        assert_eq!(driver.0, CUresult::CUDA_ERROR_OUT_OF_MEMORY);
        // cudarc's message needs the driver library (formatting panics without it).
        if crate::cuda::driver_present() {
            assert!(e.to_string().starts_with("CUDA: allocate: "), "{e}");
        }
    }
}
