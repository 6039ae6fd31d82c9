//! `--read-mode mmap|pread`: how `bench` and `inspect` reach the bytes of a packed file, a
//! `.npy` array or a token file (`--tokens`: a Megatron `.idx` + `.bin`, a flat `train.bin`)
//! (the library's [`ReadMode`]). A mapping is the fastest, but a file truncated
//! while it is mapped kills the process with SIGBUS; `pread` makes that an error naming the
//! file. Sources that are never read through this choice (an ImageFolder's files, read whole;
//! shard directories, which their store maps) refuse the flag rather than ignore it (the
//! library's front door refuses it, naming `--read-mode`).

use gpufeed::format::ReadMode;

/// The values of `--read-mode`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum ReadModeArg {
    /// One shared memory mapping of the file (the default, the fastest): a file truncated
    /// while it is read kills the command with SIGBUS.
    Mmap,
    /// Reads at offsets (pread): a file truncated or changed while it is read is an error
    /// naming it (for network file systems and files that may be rewritten).
    Pread,
}

/// The `--read-mode` flag, shared by `bench` and `inspect`.
#[derive(clap::Args, Debug, Clone, Copy, Default)]
pub struct ReadFlags {
    /// How a packed file, a .npy array or a token file is read: mmap or pread; pread for files
    /// that may be truncated or rewritten while they are read (or live on NFS) [default: mmap].
    #[arg(long, value_enum, value_name = "MODE")]
    pub read_mode: Option<ReadModeArg>,
}

impl ReadFlags {
    /// The library's mode for the flag's value (a mapping when it is not given).
    pub fn mode(&self) -> ReadMode {
        match self.read_mode {
            None | Some(ReadModeArg::Mmap) => ReadMode::Map,
            Some(ReadModeArg::Pread) => ReadMode::Pread,
        }
    }
}
