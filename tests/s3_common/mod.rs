//! Helpers of the object-store tests: a real S3 server (moto's, from pip) started on
//! localhost for the test, a plain HTTP client to fill its buckets, and a fault-injecting
//! proxy that fails or cuts a set share of the requests it forwards.
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
}

/// A proxy on 127.0.0.1 in front of the server on `upstream`, one request per connection,
/// that answers one request in `every` with a 503 (SlowDown) or cuts its answer after half
/// its body (alternately); which ones is a pure function of the request's number. Stops when
/// dropped.
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
        FaultProxy::start_full(upstream, every, delay, None)
    }

    /// A proxy whose faulty requests (one in `every`) get no answer for `stall`, then a cut
    /// connection: a server that hangs.
    pub fn stalling(upstream: u16, every: u64, stall: Duration) -> FaultProxy {
        FaultProxy::start_full(upstream, every, Duration::ZERO, Some(stall))
    }

    fn start_full(
        upstream: u16,
        every: u64,
        delay: Duration,
        stall: Option<Duration>,
    ) -> FaultProxy {
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
                    let _ = serve(conn, upstream, every, delay, stall, &c);
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
    every: u64,
    delay: Duration,
    stall: Option<Duration>,
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
        let fault = every > 0 && h.is_multiple_of(every);
        let is_head = head[0].starts_with("HEAD ");
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
        let mut answer = String::new();
        for l in &rhead {
            if !l.to_ascii_lowercase().starts_with("connection:") {
                answer.push_str(l);
                answer.push_str("\r\n");
            }
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
