// Helpers shared by the CLI tests (included with `#[path]`, not a test of its own).
#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::time::{Duration, Instant};

use gpufeed::format::DType;
use gpufeed::source::npy_header;

/// The command under test: the build's own, or `GPUFEED_BIN` (to run these tests against
/// another build, such as the one before a fix).
pub fn bin() -> PathBuf {
    std::env::var_os("GPUFEED_BIN")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_BIN_EXE_gpufeed")))
}

pub fn cmd(args: &[&str]) -> Command {
    let mut c = Command::new(bin());
    c.args(args);
    c
}

pub fn gpufeed(args: &[&str]) -> Output {
    cmd(args).output().unwrap()
}

pub fn s(p: &Path) -> &str {
    p.to_str().unwrap()
}

pub fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

pub fn stdout(o: &Output) -> String {
    String::from_utf8_lossy(&o.stdout).into_owned()
}

pub fn write_npy(path: &Path, dtype: DType, shape: &[u64], data: &[u8]) -> PathBuf {
    let mut b = npy_header(dtype, shape).unwrap();
    b.extend_from_slice(data);
    std::fs::write(path, b).unwrap();
    path.to_path_buf()
}

/// Fails the test (after killing the child) if it runs longer than `limit`: a hang is a bug,
/// but a test must not hang with it.
pub fn wait_with_limit(
    child: &mut std::process::Child,
    limit: Duration,
) -> std::process::ExitStatus {
    let start = Instant::now();
    loop {
        if let Some(status) = child.try_wait().unwrap() {
            return status;
        }
        if start.elapsed() > limit {
            let _ = child.kill();
            let _ = child.wait();
            panic!("the command ran past {limit:?}");
        }
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// Runs a command to its end, killing it after `limit`.
pub fn output_with_limit(mut c: Command, limit: Duration) -> Output {
    use std::io::Read;
    let mut child = c
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let mut out_pipe = child.stdout.take().unwrap();
    let mut err_pipe = child.stderr.take().unwrap();
    let out = std::thread::spawn(move || {
        let mut v = Vec::new();
        let _ = out_pipe.read_to_end(&mut v);
        v
    });
    let err = std::thread::spawn(move || {
        let mut v = Vec::new();
        let _ = err_pipe.read_to_end(&mut v);
        v
    });
    let status = wait_with_limit(&mut child, limit);
    Output {
        status,
        stdout: out.join().unwrap(),
        stderr: err.join().unwrap(),
    }
}

/// Files in `dir` whose names contain `part`.
pub fn files_with(dir: &Path, part: &str) -> Vec<PathBuf> {
    std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.file_name().unwrap().to_string_lossy().contains(part))
        .collect()
}

/// Waits (up to 60 s) until `dir` has a file whose name contains `part`.
pub fn wait_for_file(dir: &Path, part: &str, child: &mut std::process::Child) -> PathBuf {
    let start = Instant::now();
    loop {
        if let Some(p) = files_with(dir, part).into_iter().next() {
            return p;
        }
        if let Some(status) = child.try_wait().unwrap() {
            panic!("the command ended ({status}) before {part} appeared in {dir:?}");
        }
        if start.elapsed() > Duration::from_secs(60) {
            let _ = child.kill();
            panic!("no {part} in {dir:?} after 60 s");
        }
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// Sends `signal` to a child.
pub fn signal(child: &std::process::Child, signal: i32) {
    // SAFETY: kill with the pid of a child this test spawned and has not reaped.
    assert_eq!(unsafe { libc::kill(child.id() as libc::pid_t, signal) }, 0);
}

/// Gives the command the default action for SIGINT, SIGTERM and SIGHUP, as a shell does for a
/// foreground job, whatever this test process inherited (a runner may ignore them).
pub fn default_signals(c: &mut Command) -> &mut Command {
    use std::os::unix::process::CommandExt;
    // SAFETY: runs in the child between fork and exec; signal() is async-signal-safe and
    // touches no memory of the parent.
    unsafe {
        c.pre_exec(|| {
            for sig in [libc::SIGINT, libc::SIGTERM, libc::SIGHUP] {
                libc::signal(sig, libc::SIG_DFL);
            }
            Ok(())
        })
    }
}

/// Bytes the child has read through system calls so far (`rchar` of `/proc/PID/io`), or
/// `None` once it is gone.
pub fn bytes_read(child: &std::process::Child) -> Option<u64> {
    let io = std::fs::read_to_string(format!("/proc/{}/io", child.id())).ok()?;
    io.lines()
        .find_map(|l| l.strip_prefix("rchar:"))
        .and_then(|v| v.trim().parse().ok())
}

/// Waits (up to 60 s) until the child has read `bytes` bytes through system calls.
pub fn wait_for_reads(child: &mut std::process::Child, bytes: u64) {
    let start = Instant::now();
    loop {
        if let Some(status) = child.try_wait().unwrap() {
            panic!("the command ended ({status}) before it read {bytes} bytes");
        }
        if bytes_read(child).is_some_and(|n| n >= bytes) {
            return;
        }
        if start.elapsed() > Duration::from_secs(60) {
            let _ = child.kill();
            panic!("the command read less than {bytes} bytes in 60 s");
        }
        std::thread::sleep(Duration::from_millis(5));
    }
}
