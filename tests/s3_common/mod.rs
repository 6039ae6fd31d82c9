//! Helpers of the object-store tests: a real S3 server (moto's, from pip) started on
//! localhost for the test, a plain HTTP client to fill its buckets, and a fault-injecting
//! proxy that fails or cuts a set share of the requests it forwards, or flips bits in and
//! truncates a bounded number of the answers' bodies.
//!
//! Whether a missing moto fails or skips: with `GPUFEED_REQUIRE_S3=1` or `CI` set (as `.ci/run`
//! runs), a test that cannot start the server fails; elsewhere (a developer's `cargo test`) it
//! prints why and skips. The interpreter is `$GPUFEED_MOTO_PYTHON`, else `python3`
//! (`.ci/run` installs moto from python/requirements-s3.txt into target/s3-venv).
#![allow(dead_code)]

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{Shutdown, TcpListener, TcpStream};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

/// True when a missing S3 server must fail the test rather than skip it.
pub fn s3_required() -> bool {
    std::env::var("GPUFEED_REQUIRE_S3").is_ok_and(|v| v == "1")
        || std::env::var("CI").is_ok_and(|v| !v.is_empty() && v != "false" && v != "0")
}

fn python() -> String {
    std::env::var("GPUFEED_MOTO_PYTHON").unwrap_or_else(|_| "python3".into())
}

/// A moto S3 server on 127.0.0.1, stopped (killed) when dropped.
pub struct Moto {
    child: Child,
    pub port: u16,
}

impl Drop for Moto {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Moto {
    /// The server's endpoint URL.
    pub fn endpoint(&self) -> String {
        format!("http://127.0.0.1:{}", self.port)
    }
}

fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("no free port on 127.0.0.1")
}

/// Starts moto's server (`python -m moto.server`), or returns `None` after printing why the
/// test skips (see the module documentation). `auth`: moto checks credentials (any key is
/// refused), for the refused-credentials test.
pub fn moto(auth: bool) -> Option<Moto> {
    let py = python();
    let have = Command::new(&py)
        .args(["-c", "import moto.server, flask, werkzeug"])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success());
    if !have {
        let why = format!(
            "no moto server: `{py} -c 'import moto.server'` failed (pip install -r python/requirements-s3.txt, or set GPUFEED_MOTO_PYTHON)"
        );
        if s3_required() {
            panic!("{why}; GPUFEED_REQUIRE_S3=1 or CI is set, so this fails");
        }
        eprintln!("skipping: {why}");
        return None;
    }
    for _ in 0..5 {
        let port = free_port();
        let mut cmd = Command::new(&py);
        cmd.args([
            "-m",
            "moto.server",
            "-H",
            "127.0.0.1",
            "-p",
            &port.to_string(),
        ])
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null());
        if auth {
            cmd.env("INITIAL_NO_AUTH_ACTION_COUNT", "0");
        }
        let child = cmd.spawn().expect("start moto.server");
        let moto = Moto { child, port };
        let deadline = Instant::now() + Duration::from_secs(60);
        while Instant::now() < deadline {
            if TcpStream::connect(("127.0.0.1", port)).is_ok() {
                return Some(moto);
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        drop(moto);
    }
    panic!("moto.server did not start listening within 60 s");
}

/// An HTTP/1.1 answer: status and body.
pub struct Answer {
    pub status: u16,
    pub body: Vec<u8>,
}

/// Sends one request (`Connection: close`) to 127.0.0.1:`port` and reads the whole answer.
/// Unsigned: moto accepts it unless it checks credentials.
pub fn http(port: u16, method: &str, path: &str, body: &[u8]) -> Answer {
    let mut s = TcpStream::connect(("127.0.0.1", port)).expect("connect");
    let head = format!(
        "{method} {path} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
        body.len()
    );
    s.write_all(head.as_bytes()).unwrap();
    s.write_all(body).unwrap();
    let mut r = BufReader::new(s);
    let mut status_line = String::new();
    r.read_line(&mut status_line).unwrap();
    let status = status_line
        .split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .unwrap_or(0);
    let mut len = None;
    loop {
        let mut line = String::new();
        r.read_line(&mut line).unwrap();
        if line == "\r\n" || line.is_empty() {
            break;
        }
        if let Some((k, v)) = line.split_once(':')
            && k.eq_ignore_ascii_case("content-length")
        {
            len = v.trim().parse::<usize>().ok();
        }
    }
    let mut body = Vec::new();
    match len {
        Some(n) if method != "HEAD" => {
            body.resize(n, 0);
            r.read_exact(&mut body).unwrap();
        }
        Some(_) => {}
        None => {
            r.read_to_end(&mut body).unwrap();
        }
    }
    Answer { status, body }
}

/// Creates `bucket` on the server.
pub fn create_bucket(port: u16, bucket: &str) {
    let a = http(port, "PUT", &format!("/{bucket}"), b"");
    assert!(
        a.status == 200,
        "create bucket {bucket}: {} {}",
        a.status,
        String::from_utf8_lossy(&a.body)
    );
}

/// Puts object `key` into `bucket`.
pub fn put(port: u16, bucket: &str, key: &str, data: &[u8]) {
    let a = http(port, "PUT", &format!("/{bucket}/{key}"), data);
    assert!(
        a.status == 200,
        "put {key}: {} {}",
        a.status,
        String::from_utf8_lossy(&a.body)
    );
}

/// Puts every file of `dir` as `prefix/NAME` into `bucket`.
pub fn put_dir(port: u16, bucket: &str, prefix: &str, dir: &std::path::Path) {
    for e in std::fs::read_dir(dir).unwrap() {
        let e = e.unwrap();
        let name = e.file_name().into_string().unwrap();
        let data = std::fs::read(e.path()).unwrap();
        put(port, bucket, &format!("{prefix}/{name}"), &data);
    }
}

/// What the proxy did.
#[derive(Default)]
pub struct ProxyCounts {
    /// Requests forwarded or failed.
    pub requests: AtomicU64,
    /// Requests answered 503 without reaching the server.
    pub failed: AtomicU64,
    /// Answers cut mid-body.
    pub cut: AtomicU64,
    /// Requests held without an answer past the client's time-out (with `stall`).
    pub stalled: AtomicU64,
    /// Answers whose body had one bit flipped (with [`FaultProxy::corrupting`]).
    pub flipped: AtomicU64,
    /// Answers whose body was cut to half, its `Content-Length` changed to match, so that
    /// the answer looks whole (with [`FaultProxy::corrupting`]).
    pub truncated: AtomicU64,
}

/// What a [`FaultProxy`] does to the requests it picks.
#[derive(Clone, Copy)]
enum Faults {
    /// One request in `every` answered 503 or cut mid-body (`stall`: held, then cut).
    Fail { every: u64, stall: Option<Duration> },
    /// One answer in `every` to a GET of an object, with a body, gets one bit of its body
    /// flipped or its body truncated (alternately), at most `limit` times in all.
    Corrupt { every: u64, limit: u64 },
}

/// A proxy on 127.0.0.1 in front of the server on `upstream`, one request per connection,
/// that answers one request in `every` with a 503 (SlowDown) or cuts its answer after half
/// its body (alternately), or (`corrupting`) changes the bytes of some answers; which ones is
/// a pure function of the request's number. Stops when dropped.
pub struct FaultProxy {
    pub port: u16,
    pub counts: Arc<ProxyCounts>,
    stop: Arc<AtomicBool>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Drop for FaultProxy {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        let _ = TcpStream::connect(("127.0.0.1", self.port));
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

impl FaultProxy {
    pub fn start(upstream: u16, every: u64) -> FaultProxy {
        FaultProxy::start_with(upstream, every, Duration::ZERO)
    }

    /// As [`FaultProxy::start`], each answer held back `delay` first (a slow server).
    pub fn start_with(upstream: u16, every: u64, delay: Duration) -> FaultProxy {
        FaultProxy::start_full(upstream, Faults::Fail { every, stall: None }, delay)
    }

    /// A proxy whose faulty requests (one in `every`) get no answer for `stall`, then a cut
    /// connection: a server that hangs.
    pub fn stalling(upstream: u16, every: u64, stall: Duration) -> FaultProxy {
        let faults = Faults::Fail {
            every,
            stall: Some(stall),
        };
        FaultProxy::start_full(upstream, faults, Duration::ZERO)
    }

    /// A proxy that corrupts bytes in transit without the answer looking faulty: of the
    /// answers to GETs of an object that have a body (not listings, not HEADs), one in
    /// `every` gets one bit of its body flipped (same length) or its body cut to half with a
    /// `Content-Length` that says so (alternately), at most `limit` answers in all.
    pub fn corrupting(upstream: u16, every: u64, limit: u64) -> FaultProxy {
        FaultProxy::start_full(upstream, Faults::Corrupt { every, limit }, Duration::ZERO)
    }

    fn start_full(upstream: u16, faults: Faults, delay: Duration) -> FaultProxy {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let port = listener.local_addr().unwrap().port();
        let counts = Arc::new(ProxyCounts::default());
        let stop = Arc::new(AtomicBool::new(false));
        let (c, s) = (Arc::clone(&counts), Arc::clone(&stop));
        let thread = std::thread::spawn(move || {
            for conn in listener.incoming() {
                if s.load(Ordering::Relaxed) {
                    break;
                }
                let Ok(conn) = conn else { continue };
                let c = Arc::clone(&c);
                std::thread::spawn(move || {
                    let _ = serve(conn, upstream, faults, delay, &c);
                });
            }
        });
        FaultProxy {
            port,
            counts,
            stop,
            thread: Some(thread),
        }
    }

    pub fn endpoint(&self) -> String {
        format!("http://127.0.0.1:{}", self.port)
    }
}

/// Reads an HTTP message head (through the blank line) from `r`.
fn read_head(r: &mut impl BufRead) -> std::io::Result<Option<Vec<String>>> {
    let mut lines = Vec::new();
    loop {
        let mut line = String::new();
        if r.read_line(&mut line)? == 0 {
            return Ok(if lines.is_empty() { None } else { Some(lines) });
        }
        if line == "\r\n" {
            return Ok(Some(lines));
        }
        lines.push(line.trim_end().to_owned());
    }
}

fn content_length(head: &[String]) -> Option<usize> {
    head.iter().skip(1).find_map(|l| {
        let (k, v) = l.split_once(':')?;
        k.eq_ignore_ascii_case("content-length")
            .then(|| v.trim().parse().ok())
            .flatten()
    })
}

/// Forwards the one request of a client connection (answers say `Connection: close`) on a
/// connection of its own to the server.
fn serve(
    conn: TcpStream,
    upstream: u16,
    faults: Faults,
    delay: Duration,
    counts: &ProxyCounts,
) -> std::io::Result<()> {
    let mut client_r = BufReader::new(conn.try_clone()?);
    let mut client_w = conn;
    {
        let Some(head) = read_head(&mut client_r)? else {
            return Ok(());
        };
        std::thread::sleep(delay);
        let mut body = vec![0u8; content_length(&head).unwrap_or(0)];
        client_r.read_exact(&mut body)?;
        let n = counts.requests.fetch_add(1, Ordering::Relaxed);
        // Which requests fail: a mix of the number, so the faults spread over every kind.
        let h = n.wrapping_mul(0x9e37_79b9_7f4a_7c15).rotate_left(17);
        let (every, stall, corrupt) = match faults {
            Faults::Fail { every, stall } => (every, stall, None),
            Faults::Corrupt { every, limit } => (every, None, Some(limit)),
        };
        let picked = every > 0 && h.is_multiple_of(every);
        let fault = picked && corrupt.is_none();
        let is_head = head[0].starts_with("HEAD ");
        // A GET of an object: its path has a key after the bucket, and no listing query.
        let target = head[0].split_whitespace().nth(1).unwrap_or("");
        let of_object = head[0].starts_with("GET ")
            && target.trim_start_matches('/').contains('/')
            && !target.contains("list-type");
        if fault && let Some(stall) = stall {
            counts.stalled.fetch_add(1, Ordering::Relaxed);
            std::thread::sleep(stall);
            let _ = client_w.shutdown(Shutdown::Both);
            return Ok(());
        }
        if fault && (is_head || (h / every).is_multiple_of(2)) {
            counts.failed.fetch_add(1, Ordering::Relaxed);
            let xml = b"<?xml version=\"1.0\" encoding=\"UTF-8\"?><Error><Code>SlowDown</Code><Message>injected</Message></Error>";
            write!(
                client_w,
                "HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/xml\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
                xml.len()
            )?;
            client_w.write_all(xml)?;
            client_w.flush()?;
            let _ = client_w.shutdown(Shutdown::Both);
            return Ok(());
        }
        // To the server, as is but for the connection.
        let mut up = TcpStream::connect(("127.0.0.1", upstream))?;
        let mut out = String::new();
        out.push_str(&head[0]);
        out.push_str("\r\n");
        for l in head.iter().skip(1) {
            if !l.to_ascii_lowercase().starts_with("connection:") {
                out.push_str(l);
                out.push_str("\r\n");
            }
        }
        out.push_str("Connection: close\r\n\r\n");
        up.write_all(out.as_bytes())?;
        up.write_all(&body)?;
        let mut up_r = BufReader::new(up);
        let Some(rhead) = read_head(&mut up_r)? else {
            return Ok(());
        };
        let mut rbody = Vec::new();
        if !is_head {
            match content_length(&rhead) {
                Some(n) => {
                    rbody.resize(n, 0);
                    up_r.read_exact(&mut rbody)?;
                }
                None => {
                    up_r.read_to_end(&mut rbody)?;
                }
            }
        }
        let ok = rhead[0]
            .split_whitespace()
            .nth(1)
            .is_some_and(|c| c.starts_with('2'));
        let corrupted = picked
            && ok
            && of_object
            && rbody.len() >= 2
            && corrupt.is_some_and(|limit| {
                let done = counts.flipped.load(Ordering::Relaxed)
                    + counts.truncated.load(Ordering::Relaxed);
                done < limit
            });
        let truncate = corrupted && (h / every).is_multiple_of(2);
        if corrupted && truncate {
            counts.truncated.fetch_add(1, Ordering::Relaxed);
            rbody.truncate(rbody.len() / 2);
        } else if corrupted {
            counts.flipped.fetch_add(1, Ordering::Relaxed);
            let at = (h as usize / 7) % rbody.len();
            rbody[at] ^= 1 << (h % 8);
        }
        let mut answer = String::new();
        for l in &rhead {
            let lower = l.to_ascii_lowercase();
            if lower.starts_with("connection:") {
                continue;
            }
            if truncate && lower.starts_with("content-length:") {
                answer.push_str(&format!("Content-Length: {}\r\n", rbody.len()));
                continue;
            }
            answer.push_str(l);
            answer.push_str("\r\n");
        }
        answer.push_str("Connection: close\r\n\r\n");
        client_w.write_all(answer.as_bytes())?;
        if fault && rbody.len() >= 2 {
            counts.cut.fetch_add(1, Ordering::Relaxed);
            client_w.write_all(&rbody[..rbody.len() / 2])?;
            client_w.flush()?;
            let _ = client_w.shutdown(Shutdown::Both);
            return Ok(());
        }
        client_w.write_all(&rbody)?;
        client_w.flush()?;
        let _ = client_w.shutdown(Shutdown::Both);
        Ok(())
    }
}
