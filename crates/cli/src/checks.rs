//! Settings checked against the machine before anything is allocated or started, so that an
//! impossible `--batch-size`, `--prefetch` or `--workers` fails at once with the flag's name
//! instead of aborting on a huge allocation or starting thousands of threads.

use gpufeed::memory::human_bytes;
use gpufeed::{Error, Result};

/// The most worker threads the command starts.
pub const MAX_WORKERS: usize = 1024;
/// The most batches the command puts in flight.
pub const MAX_PREFETCH: usize = 65_536;

fn flag(flag: &'static str, what: String) -> Error {
    Error::InvalidConfig {
        setting: flag,
        what,
    }
}

/// Memory this process can still allocate, in bytes: the kernel's estimate of available memory
/// (`MemAvailable`), lowered to what the cgroup (a container's limit) has left. `None` where
/// neither can be read.
pub fn available_memory() -> Option<u64> {
    let meminfo = std::fs::read_to_string("/proc/meminfo").ok();
    let available = meminfo.as_deref().and_then(|m| {
        m.lines()
            .find_map(|l| l.strip_prefix("MemAvailable:"))
            .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
            .map(|kb| kb * 1024)
    });
    let read = |p: &str| -> Option<u64> { std::fs::read_to_string(p).ok()?.trim().parse().ok() };
    let cgroup = match (
        read("/sys/fs/cgroup/memory.max"),
        read("/sys/fs/cgroup/memory.current"),
    ) {
        (Some(max), Some(current)) => Some(max.saturating_sub(current)),
        _ => None,
    };
    match (available, cgroup) {
        (Some(a), Some(c)) => Some(a.min(c)),
        (a, c) => a.or(c),
    }
}

/// The loader settings of a bench, before defaults.
pub struct LoaderSizes {
    /// Samples in one batch: `--batch-size`, or fewer when the data set has fewer (what the
    /// loader sizes its buffers for).
    pub batch_size: usize,
    /// Batches in an epoch (for this rank): the default prefetch is no more.
    pub batches: u64,
    /// `--workers`, or its default.
    pub workers: usize,
    /// `--prefetch` as given.
    pub prefetch: Option<usize>,
    /// `--batch-parts` as given.
    pub parts: Option<usize>,
    /// Bytes of one sample in a batch.
    pub sample_bytes: u64,
}

impl LoaderSizes {
    /// Checks the counts, then that a batch, and the batch pool (`prefetch + 2` batches),
    /// fit in the memory available now. Returns the prefetch and the batch parts to use.
    pub fn check(&self) -> Result<(usize, usize)> {
        let parts = match self.parts {
            Some(0) => {
                return Err(flag(
                    "--batch-parts",
                    "a batch is made in at least one part".into(),
                ));
            }
            Some(p) => p.min(self.batch_size.max(1)),
            None => gpufeed::loader::default_parts(
                self.workers,
                self.sample_bytes.saturating_mul(self.batch_size as u64),
            ),
        };
        let prefetch = self.check_prefetch(parts)?;
        Ok((prefetch, parts))
    }

    fn check_prefetch(&self, parts: usize) -> Result<usize> {
        if self.batch_size == 0 {
            return Err(flag("--batch-size", "must be at least 1".into()));
        }
        let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
        if self.workers == 0 {
            return Err(flag(
                "--workers",
                "at least one worker thread is needed".into(),
            ));
        }
        if self.workers > MAX_WORKERS {
            return Err(flag(
                "--workers",
                format!(
                    "{} is more threads than gpufeed starts (at most {MAX_WORKERS}; this machine has {cores} cores)",
                    self.workers
                ),
            ));
        }
        let (prefetch, prefetch_flag) = match self.prefetch {
            Some(p) => (p, "--prefetch"),
            None => (
                gpufeed::loader::default_prefetch(
                    self.workers,
                    self.sample_bytes.saturating_mul(self.batch_size as u64),
                    parts,
                    self.batches,
                ),
                "--prefetch (by default about 64 MiB of batches, --workers + 2 at least; \
                 for batches in parts, 2 + twice --workers / --batch-parts; at most an epoch's batches)",
            ),
        };
        if prefetch == 0 {
            return Err(flag(
                "--prefetch",
                "at least one batch must be in flight".into(),
            ));
        }
        if prefetch > MAX_PREFETCH {
            return Err(flag(
                prefetch_flag,
                format!(
                    "{prefetch} batches in flight is more than gpufeed allows ({MAX_PREFETCH})"
                ),
            ));
        }
        let Some(memory) = available_memory() else {
            return Ok(prefetch);
        };
        let batch = (self.batch_size as u64).checked_mul(self.sample_bytes);
        if batch.is_none_or(|b| b > memory) {
            return Err(flag(
                "--batch-size",
                format!(
                    "one batch of {} samples of {} needs {}, more than the {} of memory available",
                    self.batch_size,
                    human_bytes(self.sample_bytes),
                    batch.map_or_else(|| "more than 16 EiB".to_owned(), human_bytes),
                    human_bytes(memory)
                ),
            ));
        }
        let batch = batch.unwrap_or(u64::MAX);
        let pool = (prefetch as u64 + 2).checked_mul(batch);
        if pool.is_none_or(|p| p > memory) {
            return Err(flag(
                prefetch_flag,
                format!(
                    "{prefetch} batches in flight and 2 held make a batch pool of {}, more than the {} of memory available \
                     (batches of {}): lower --prefetch or --batch-size",
                    pool.map_or_else(|| "more than 16 EiB".to_owned(), human_bytes),
                    human_bytes(memory),
                    human_bytes(batch)
                ),
            ));
        }
        Ok(prefetch)
    }
}

/// Refuses a file a bench is to write (`--trace`, `--plot`) that would destroy something:
/// one of the files it reads (`inputs`, also through a link), a path that exists and is not a
/// regular file, a file in a directory that does not exist. `ends` is the file name's
/// required ending, if any (`.svg`).
pub fn check_output(
    setting: &'static str,
    path: &std::path::Path,
    inputs: &[&std::path::Path],
    ends: Option<&str>,
) -> Result<()> {
    use std::os::unix::fs::MetadataExt;
    let refuse = |what: String| flag(setting, format!("{}: {what}", path.display()));
    if let Some(ending) = ends
        && !path
            .to_string_lossy()
            .to_ascii_lowercase()
            .ends_with(ending)
    {
        return Err(refuse(format!(
            "names the file to write, ending in {ending} (an SVG picture; for a PNG, convert it: \
             rsvg-convert FILE.svg -o FILE.png)"
        )));
    }
    // The data set first, through a link too: the worst thing the file could be.
    if let Ok(meta) = std::fs::metadata(path) {
        for input in inputs {
            if let Ok(m) = std::fs::metadata(input)
                && (m.dev(), m.ino()) == (meta.dev(), meta.ino())
            {
                return Err(refuse(format!(
                    "is the data set {} that the bench reads: writing it would destroy it",
                    input.display()
                )));
            }
        }
    }
    if let Ok(meta) = std::fs::symlink_metadata(path)
        && !meta.is_file()
    {
        return Err(refuse(
            "exists and is not a regular file: gpufeed writes a new file and replaces nothing else"
                .to_owned(),
        ));
    }
    let parent = path
        .parent()
        .filter(|p| !p.as_os_str().is_empty())
        .unwrap_or(std::path::Path::new("."));
    if !parent.is_dir() {
        return Err(refuse(format!(
            "its directory {} does not exist",
            parent.display()
        )));
    }
    Ok(())
}
