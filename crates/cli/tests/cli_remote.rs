//! `gpufeed bench` and `gpufeed inspect` of an `s3://` URL, with the endpoint and keys in the
//! usual AWS variables, against a moto server (tests/s3_common).
#![cfg(feature = "s3")]

use crate::cli_common;
use crate::s3_common;

use cli_common::{cmd, s, stderr, stdout, write_npy};
use gpufeed::format::DType;
use serde_json::Value;

fn with_aws(c: &mut std::process::Command, endpoint: &str, cache: &std::path::Path) {
    c.env("AWS_ENDPOINT_URL", endpoint)
        .env("AWS_ACCESS_KEY_ID", "testing")
        .env("AWS_SECRET_ACCESS_KEY", "testing")
        .env("AWS_REGION", "us-east-1")
        .env("AWS_ALLOW_HTTP", "true")
        .env("GPUFEED_CACHE_DIR", cache);
}

#[test]
fn bench_and_inspect_read_an_s3_url() {
    let Some(server) = s3_common::moto(false) else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let data: Vec<u8> = (0..600u32)
        .flat_map(|i| std::iter::repeat_n(i as u8, 2000))
        .collect();
    let x = write_npy(&dir.path().join("x.npy"), DType::U8, &[600, 2000], &data);
    let out = dir.path().join("shards");
    let o = cmd(&[
        "pack",
        "--from",
        "npy",
        s(&x),
        "--shard-size",
        "200KiB",
        "-o",
        s(&out),
    ])
    .output()
    .unwrap();
    assert!(o.status.success(), "{}", stderr(&o));
    s3_common::create_bucket(server.port, "cli");
    s3_common::put_dir(server.port, "cli", "train", &out);
    let shards = std::fs::read_dir(&out).unwrap().count() as u64 - 1;

    let cache = dir.path().join("cache");
    let mut c = cmd(&["inspect", "s3://cli/train", "--json"]);
    with_aws(&mut c, &server.endpoint(), &cache);
    let o = c.output().unwrap();
    assert!(o.status.success(), "{}", stderr(&o));
    let v: Value = serde_json::from_str(&stdout(&o)).unwrap();
    assert_eq!(v["format"], "packed shards");
    assert_eq!(v["samples"], 600);
    assert_eq!(v["shards"], shards);

    let mut c = cmd(&[
        "bench",
        "s3://cli/train",
        "--json",
        "--epochs",
        "2",
        "--batch-size",
        "32",
        "--workers",
        "2",
        "--shuffle-window",
        "2",
        "--shuffle-block",
        "8",
    ]);
    with_aws(&mut c, &server.endpoint(), &cache);
    let o = c.output().unwrap();
    assert!(o.status.success(), "{}", stderr(&o));
    let v: Value = serde_json::from_str(&stdout(&o)).unwrap();
    assert_eq!(v["samples"], 1200);
    assert_eq!(v["store"]["cache_misses"], shards, "{}", v["store"]);
    assert_eq!(v["store"]["retries"], 0);

    // Text: the store's line. A second run finds every shard in the cache.
    let mut c = cmd(&["bench", "s3://cli/train", "--epochs", "1"]);
    with_aws(&mut c, &server.endpoint(), &cache);
    let o = c.output().unwrap();
    assert!(o.status.success(), "{}", stderr(&o));
    let text = stdout(&o);
    assert!(text.contains(&format!("{shards} hits, 0 misses")), "{text}");

    // No such bucket: a typed error naming it.
    let mut c = cmd(&["inspect", "s3://nowhere/train"]);
    with_aws(&mut c, &server.endpoint(), &cache);
    let o = c.output().unwrap();
    assert!(!o.status.success());
    assert!(stderr(&o).contains("s3://nowhere/train"), "{}", stderr(&o));
    assert!(stderr(&o).contains("no such bucket"), "{}", stderr(&o));
}

#[test]
fn an_s3_url_without_credentials_or_metadata_service_names_the_variables_to_set() {
    // No AWS_* variable, and an instance metadata service where none answers (a closed port
    // of this machine): the client would ask it at each request and retry, for minutes.
    let dir = tempfile::tempdir().unwrap();
    let mut c = cmd(&["inspect", "s3://some-bucket/train"]);
    for (k, _) in std::env::vars() {
        if k.starts_with("AWS_") {
            c.env_remove(k);
        }
    }
    c.env("AWS_METADATA_ENDPOINT", "http://127.0.0.1:9")
        .env("GPUFEED_CACHE_DIR", dir.path());
    let o = c.output().unwrap();
    assert!(!o.status.success());
    let e = stderr(&o);
    assert!(
        e.contains("s3://some-bucket/train") && e.contains("no credentials"),
        "{e}"
    );
    for name in [
        "AWS_ACCESS_KEY_ID",
        "AWS_SECRET_ACCESS_KEY",
        "AWS_REGION",
        "AWS_ENDPOINT_URL",
    ] {
        assert!(e.contains(name), "{name} not in: {e}");
    }
    assert!(
        e.contains("http://127.0.0.1:9") && e.contains("no answer"),
        "{e}"
    );

    // A server there that is not a metadata service (a proxy's error page): the same.
    let server = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let endpoint = format!("http://{}", server.local_addr().unwrap());
    let answer = std::thread::spawn(move || {
        use std::io::{Read, Write};
        let (mut stream, _) = server.accept().unwrap();
        let mut request = [0u8; 1024];
        let _ = stream.read(&mut request).unwrap();
        stream
            .write_all(b"HTTP/1.1 403 Forbidden\r\nContent-Length: 0\r\n\r\n")
            .unwrap();
    });
    c.env("AWS_METADATA_ENDPOINT", &endpoint);
    let o = c.output().unwrap();
    answer.join().unwrap();
    assert!(!o.status.success());
    let e = stderr(&o);
    assert!(
        e.contains("no credentials") && e.contains("HTTP 403"),
        "{e}"
    );
    assert!(
        e.contains("AWS_ACCESS_KEY_ID") && e.contains(&endpoint),
        "{e}"
    );
}
