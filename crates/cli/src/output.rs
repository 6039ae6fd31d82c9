//! The checks every command that writes a file makes before it reads anything (`pack`,
//! `tokenize`): the file `-o` names is never one of the inputs (same device and inode, through
//! any link), never anything but a regular file, never an existing file without `--force`,
//! never (even with `--force`) a file of a kind the command does not write, and its directory
//! exists and can be written. Temporaries that killed writers to it left are removed first.

use std::io::Write;
use std::path::Path;

use gpufeed::memory::human_bytes;
use gpufeed::{Error, Result};

/// Device and inode: what makes two paths the same file.
pub fn identity(meta: &std::fs::Metadata) -> (u64, u64) {
    use std::os::unix::fs::MetadataExt;
    (meta.dev(), meta.ino())
}

/// What a file that is not a regular file is, in words.
pub fn kind_of(ft: std::fs::FileType) -> &'static str {
    use std::os::unix::fs::FileTypeExt;
    if ft.is_symlink() {
        "a symbolic link"
    } else if ft.is_dir() {
        "a directory"
    } else if ft.is_fifo() {
        "a FIFO (named pipe)"
    } else if ft.is_char_device() {
        "a character device"
    } else if ft.is_block_device() {
        "a block device"
    } else if ft.is_socket() {
        "a socket"
    } else if ft.is_file() {
        "a regular file"
    } else {
        "not a regular file"
    }
}

/// One file a command writes, as the user named it (`-o`, or a name made from it).
pub struct OutputFile<'a> {
    /// The file.
    pub path: &'a Path,
    /// `--force`: an existing file of the command's own kind may be replaced.
    pub replace: bool,
    /// The command, for messages (`pack`, `tokenize`).
    pub command: &'static str,
    /// How `-o` is to be given, for messages: "such as DIR/train.gfd".
    pub example: &'static str,
}

impl OutputFile<'_> {
    /// An error about the output, naming it as `-o`.
    pub fn refuse(&self, what: impl std::fmt::Display) -> Error {
        Error::user(format!("-o {}: {what}", self.path.display()))
    }

    /// Checks the output before anything is read or written (see the module docs). `inputs`
    /// are every file that will be read; `foreign` says what an existing file is when it is
    /// not one the command replaces with `--force` (`None`: it may be replaced), and
    /// `replaces` says what the command replaces, for that message.
    pub fn check(
        &self,
        inputs: &[&Path],
        foreign: impl Fn(&Path) -> Result<Option<String>>,
        replaces: &str,
    ) -> Result<()> {
        if let Some(meta) = self.existing()? {
            for input in inputs {
                if let Ok(m) = std::fs::metadata(input)
                    && identity(&m) == identity(&meta)
                {
                    return Err(self.refuse(format_args!(
                        "is the input {} (the same file{}): writing into it would destroy it; choose another -o",
                        input.display(),
                        if input == &self.path {
                            ""
                        } else {
                            ", through a link"
                        }
                    )));
                }
            }
            if let Some(what) = foreign(self.path)? {
                return Err(self.refuse(format_args!(
                    "exists, and is {what}: {} replaces (with --force) only {replaces}; \
                     if it is to go, remove it yourself, or choose another -o",
                    self.command
                )));
            }
            if !self.replace {
                return Err(self.refuse("exists; pass --force to replace it, or choose another -o"));
            }
        }
        self.check_directory()?;
        self.clear_stale()
    }

    /// The output's metadata if it exists (as a regular file: anything else is refused).
    pub fn existing(&self) -> Result<Option<std::fs::Metadata>> {
        let ends_in_slash = self.path.as_os_str().as_encoded_bytes().ends_with(b"/");
        match std::fs::symlink_metadata(self.path) {
            Ok(meta) if meta.is_file() && !ends_in_slash => Ok(Some(meta)),
            Ok(meta) => {
                let what = kind_of(meta.file_type());
                let advice = if meta.is_dir() {
                    format!("; -o names the file to write, {}", self.example)
                } else {
                    format!(
                        "; gpufeed {} writes a new regular file and replaces nothing else: choose another -o",
                        self.command
                    )
                };
                Err(self.refuse(format_args!("is {what}{advice}")))
            }
            // Absent, or under a path that is not a directory: `check_directory` says which.
            Err(e)
                if matches!(
                    e.kind(),
                    std::io::ErrorKind::NotFound | std::io::ErrorKind::NotADirectory
                ) =>
            {
                if ends_in_slash {
                    return Err(self.refuse("names a directory; -o names the file to write"));
                }
                Ok(None)
            }
            Err(e) => Err(Error::Io {
                path: self.path.to_path_buf(),
                op: "stat",
                source: e,
            }),
        }
    }

    /// The directory the output goes in: it must exist and be writable.
    pub fn check_directory(&self) -> Result<()> {
        let dir = match self.path.parent() {
            Some(d) if !d.as_os_str().is_empty() => d,
            _ => Path::new("."),
        };
        match std::fs::metadata(dir) {
            Ok(m) if m.is_dir() => {}
            Ok(_) => {
                return Err(self.refuse(format_args!("{} is not a directory", dir.display())));
            }
            Err(e) => {
                return Err(self.refuse(format_args!(
                    "its directory {} cannot be used: {e}",
                    dir.display()
                )));
            }
        }
        let c = std::ffi::CString::new(dir.as_os_str().as_encoded_bytes())
            .map_err(|_| self.refuse("the path holds a NUL byte"))?;
        // SAFETY: `c` is a NUL-terminated path that lives across the call; access reads it only.
        if unsafe { libc::access(c.as_ptr(), libc::W_OK | libc::X_OK) } != 0 {
            return Err(self.refuse(format_args!(
                "its directory {} cannot be written: {}",
                dir.display(),
                std::io::Error::last_os_error()
            )));
        }
        Ok(())
    }

    /// Removes the temporaries that killed writers to this output left, and says so.
    pub fn clear_stale(&self) -> Result<()> {
        let removed = gpufeed::format::remove_stale_temporaries(self.path)?;
        if !removed.is_empty() {
            let bytes: u64 = removed.iter().map(|(_, b)| b).sum();
            let _ = writeln!(
                std::io::stderr(),
                "gpufeed {}: removed {} temporary file(s) ({}) that killed runs writing {} left behind",
                self.command,
                removed.len(),
                human_bytes(bytes),
                self.path.display()
            );
        }
        Ok(())
    }
}
