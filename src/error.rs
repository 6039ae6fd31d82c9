//! The one error type of the crate.
//!
//! Every variant says *what* went wrong and *where*: the file, the record, the sample or the
//! builder setting concerned. Nothing in gpufeed panics on bad input; it returns one of these.

use std::path::{Path, PathBuf};

/// A `Result` with gpufeed's [`Error`].
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Everything that can go wrong in gpufeed.
#[derive(Debug, thiserror::Error)]
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

    /// A `.npy` array that gpufeed cannot read in place (Fortran order, object dtype, ...).
    #[error("{path}: unsupported .npy array: {what}")]
    UnsupportedNpy {
        /// The file concerned.
        path: PathBuf,
        /// What is unsupported, and why.
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

    /// User code (a transform) failed or panicked.
    #[error("{what}")]
    User {
        /// The message of the error or of the panic.
        what: String,
    },

    /// An image could not be decoded or transformed.
    #[error("{source_name}: {what}")]
    Image {
        /// The file (or packed record) the image came from.
        source_name: String,
        /// What is wrong with it.
        what: String,
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

    /// A CUDA driver call failed.
    #[error("CUDA: {op}: {what}")]
    Cuda {
        /// The operation that failed.
        op: &'static str,
        /// The driver's message.
        what: String,
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
    /// The bytes that arrived do not match the index's checksum or size.
    Checksum,
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
            RemoteErrorKind::CacheFull => "cache full",
            RemoteErrorKind::Config => "bad store setting",
        })
    }
}

impl Error {
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
