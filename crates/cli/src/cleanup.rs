//! What the command removes when it stops early: the temporary files of unfinished packed-file
//! writers (the library keeps their list) and the command's own temporary directories (the
//! data set `bench` generates), on every exit path: errors and panics drop a [`TempDir`], and
//! SIGINT, SIGTERM and SIGHUP are caught by a thread that removes everything, then lets the
//! signal end the process as it would have (exit status 128 + signal for the shell).
//!
//! While a run holds a [`ReportOnInterrupt`] (`bench`, once it measures), the first SIGINT
//! (Ctrl-C) does not end the process: it sets the flag [`interrupted`] reads, the run stops at
//! its next batch and prints what it measured, and `main` then removes everything and ends the
//! process of the signal ([`end_interrupted`]). A second Ctrl-C, or SIGTERM or SIGHUP, ends it
//! at once, as above.
//!
//! The cleanup runs on the signal thread while the command's other threads still run, until
//! the process ends: a writer may be placing the file just removed, or about to start another.
//! So the cleanup stops every writer first ([`gpufeed::temporary::stop_writers`]: no temporary
//! file or directory is made after it), and the error a writer then meets (its temporary gone)
//! is never reported: once the process is dying ([`dying`]), `main` prints no error and waits
//! for the signal to end it ([`wait_for_the_signal`]), so that an interrupted command always
//! ends of its signal, with nothing left behind.
//!
//! SIGXFSZ (a write past the file-size limit, `ulimit -f`) is caught too, so that the write
//! fails with "File too large" instead of killing the process: the writer's error path then
//! removes its temporary and the command says which file it could not write. SIGKILL cannot be
//! caught: what it leaves, `gpufeed pack` removes before it next writes to the same output.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

use gpufeed::{Error, Result};
use signal_hook::consts::{SIGHUP, SIGINT, SIGTERM, SIGXFSZ};

/// Set by a SIGINT that came while a run reports on one ([`ReportOnInterrupt`]).
static INTERRUPTED: AtomicBool = AtomicBool::new(false);
/// True while a [`ReportOnInterrupt`] lives.
static REPORTING: AtomicBool = AtomicBool::new(false);
/// Set once the process is ending of a signal ([`die_of`]), before anything is removed.
static DYING: AtomicBool = AtomicBool::new(false);

/// The command's temporary directories that exist now.
static DIRS: Mutex<Vec<PathBuf>> = Mutex::new(Vec::new());

fn dirs() -> std::sync::MutexGuard<'static, Vec<PathBuf>> {
    DIRS.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// Removes every temporary file and directory this process made and has not removed yet, and
/// stops its writers from making more.
fn remove_everything() {
    gpufeed::temporary::stop_writers();
    for dir in dirs().drain(..) {
        let _ = std::fs::remove_dir_all(dir);
    }
}

/// Installs the signal handling described in the module docs. Call it first thing.
pub fn install() -> Result<()> {
    let fail = |e: std::io::Error| Error::user(format!("cannot install signal handlers: {e}"));
    // A caught SIGXFSZ makes the write that exceeds the limit fail with EFBIG.
    signal_hook::flag::register(SIGXFSZ, std::sync::Arc::new(AtomicBool::new(false)))
        .map_err(fail)?;
    // A signal ignored when the command started stays ignored (`nohup` ignores SIGHUP, a
    // shell ignores SIGINT for the background jobs of a script), as POSIX tools do.
    let caught: Vec<i32> = [SIGINT, SIGTERM, SIGHUP]
        .into_iter()
        .filter(|&s| !ignored(s))
        .collect();
    let mut signals = signal_hook::iterator::Signals::new(caught).map_err(fail)?;
    std::thread::Builder::new()
        .name("gpufeed-signals".into())
        .spawn(move || {
            for signal in signals.forever() {
                if signal == SIGINT
                    && REPORTING.load(Ordering::SeqCst)
                    && !INTERRUPTED.swap(true, Ordering::SeqCst)
                {
                    let _ = writeln!(
                        std::io::stderr(),
                        "gpufeed: interrupted: reporting what ran (Ctrl-C again to stop at once)"
                    );
                    continue;
                }
                die_of(signal);
            }
        })
        .map_err(fail)?;
    Ok(())
}

/// Removes everything, then ends the process of `signal`, as without a handler, so that the
/// caller sees it (or with exit status 128 + `signal` where that fails).
fn die_of(signal: i32) -> ! {
    DYING.store(true, Ordering::SeqCst);
    remove_everything();
    let _ = signal_hook::low_level::emulate_default_handler(signal);
    std::process::exit(128 + signal);
}

/// While it lives, the first Ctrl-C asks the run to stop and report instead of ending the
/// process (see the module docs): the run checks [`interrupted`] between batches.
pub struct ReportOnInterrupt(());

impl ReportOnInterrupt {
    /// Starts reporting on Ctrl-C.
    pub fn start() -> ReportOnInterrupt {
        REPORTING.store(true, Ordering::SeqCst);
        ReportOnInterrupt(())
    }
}

impl Drop for ReportOnInterrupt {
    fn drop(&mut self) {
        REPORTING.store(false, Ordering::SeqCst);
    }
}

/// True once a Ctrl-C has asked the run to stop and report.
pub fn interrupted() -> bool {
    INTERRUPTED.load(Ordering::SeqCst)
}

/// The flag behind [`interrupted`], for harnesses that stop on it.
pub fn interrupt_flag() -> &'static AtomicBool {
    &INTERRUPTED
}

/// For `main`, once a run stopped by Ctrl-C has reported: removes everything and ends the
/// process of SIGINT (exit status 130 in the shell).
pub fn end_interrupted() -> ! {
    die_of(SIGINT)
}

/// True once a signal is ending the process: its cleanup has started (or is done), and what
/// the command's work returns now (an error about a file the cleanup removed) is not to be
/// reported.
pub fn dying() -> bool {
    DYING.load(Ordering::SeqCst)
}

/// For `main`, once [`dying`]: waits for the signal thread to end the process of its signal
/// (which it does once it has removed everything), instead of ending it with another status
/// or an error that is only the cleanup's doing.
pub fn wait_for_the_signal() -> ! {
    loop {
        std::thread::park();
    }
}

/// True if `signal`'s disposition is "ignore" (inherited from the parent).
fn ignored(signal: i32) -> bool {
    // SAFETY: sigaction with a null new action only reads the current one into `old`, a
    // zeroed sigaction that lives across the call.
    unsafe {
        let mut old: libc::sigaction = std::mem::zeroed();
        libc::sigaction(signal, std::ptr::null(), &mut old) == 0
            && old.sa_sigaction == libc::SIG_IGN
    }
}

/// A directory of the command's own under the system's temporary directory, created
/// exclusively under a unique name, removed (with its contents) on drop or on a signal.
pub struct TempDir {
    path: PathBuf,
}

impl TempDir {
    /// Creates `$TMPDIR/gpufeed-PURPOSE-PID-N`.
    pub fn new(purpose: &str) -> Result<TempDir> {
        static COUNTER: AtomicU64 = AtomicU64::new(0);
        let base = std::env::temp_dir();
        let mut last = None;
        for _ in 0..64 {
            let n = COUNTER.fetch_add(1, Ordering::Relaxed);
            let path = base.join(format!("gpufeed-{purpose}-{}-{n}", std::process::id()));
            // The list stays locked while the directory is made, so that a signal's cleanup,
            // which waits for it, never misses the directory (nor removes another's), and none
            // is made once it has run.
            let mut list = dirs();
            if dying() {
                return Err(Error::Io {
                    path,
                    op: "create directory",
                    source: std::io::Error::new(
                        std::io::ErrorKind::Interrupted,
                        "the process is ending on a signal",
                    ),
                });
            }
            match std::fs::create_dir(&path) {
                Ok(()) => {
                    list.push(path.clone());
                    return Ok(TempDir { path });
                }
                Err(e) => {
                    if e.kind() != std::io::ErrorKind::AlreadyExists {
                        return Err(Error::Io {
                            path,
                            op: "create directory",
                            source: e,
                        });
                    }
                    last = Some((path, e));
                }
            }
        }
        let (path, source) = last.unwrap_or_else(|| {
            (
                base.clone(),
                std::io::Error::from(std::io::ErrorKind::AlreadyExists),
            )
        });
        Err(Error::Io {
            path,
            op: "create directory (64 names taken)",
            source,
        })
    }

    /// The directory.
    pub fn path(&self) -> &Path {
        &self.path
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.path);
        dirs().retain(|p| p != &self.path);
    }
}
