//! Store URLs: which `object_store` client a URL needs, built from the environment's
//! variables, and the key prefix under it.

use std::sync::Arc;

use object_store::ObjectStore;
#[cfg(any(feature = "s3", feature = "gcs", feature = "azure", feature = "http"))]
use object_store::{ClientOptions, RetryConfig};

use super::RemoteOptions;
use crate::error::{Error, RemoteErrorKind, Result};

/// A store and the place under it that a URL names.
pub(crate) struct Target {
    pub store: Arc<dyn ObjectStore>,
    /// Object keys of shards are `prefix + name` (`prefix` empty or ending with `/`).
    pub prefix: String,
    /// The URL, without a trailing `/`.
    pub base: String,
    /// Whether an ETag of 32 hex digits is the MD5 of the object's bytes (S3: for an object
    /// uploaded in one part, not encrypted with SSE-KMS or SSE-C); other stores' ETags are
    /// versions, not hashes.
    pub md5_etags: bool,
}

fn config(url: &str, what: impl Into<String>) -> Error {
    Error::Remote {
        shard: url.into(),
        kind: RemoteErrorKind::Config,
        what: what.into(),
    }
}

#[allow(dead_code)]
fn missing_feature(url: &str, feature: &str) -> Error {
    config(
        url,
        format!(
            "this build of gpufeed has no `{feature}` feature: build it with `--features {feature}`"
        ),
    )
}

/// The client settings every store gets: no retries of its own (the store retries, and
/// counts), the store's time-outs.
#[cfg(any(feature = "s3", feature = "gcs", feature = "azure", feature = "http"))]
fn client(options: &RemoteOptions) -> (ClientOptions, RetryConfig) {
    let client = ClientOptions::new()
        .with_timeout(options.request_timeout)
        .with_connect_timeout(options.connect_timeout)
        .with_pool_max_idle_per_host(options.max_requests.max(1));
    let retry = RetryConfig {
        max_retries: 0,
        ..RetryConfig::default()
    };
    (client, retry)
}

#[cfg(any(feature = "s3", feature = "gcs", feature = "azure", feature = "http"))]
fn built<T: ObjectStore>(url: &str, r: object_store::Result<T>) -> Result<Arc<dyn ObjectStore>> {
    r.map(|s| Arc::new(s) as Arc<dyn ObjectStore>)
        .map_err(|e| config(url, e.to_string()))
}

/// Refuses at once an S3 URL whose credentials could come only from an instance metadata
/// service that is not there (a machine outside EC2 with no `AWS_*` variable set), which the
/// client would otherwise ask at each request and each of its retries, for seconds to
/// minutes, and end with an error that says nothing of the variables. `setting` reads a
/// client setting (the options', else its `AWS_` variable).
#[cfg(feature = "s3")]
fn check_credentials(url: &str, setting: &dyn Fn(&[&str]) -> String) -> Result<()> {
    let given = |names: &[&str]| !setting(names).is_empty();
    let yes = |names: &[&str]| {
        let value = setting(names).to_ascii_lowercase();
        value == "1" || value == "true"
    };
    if given(&["aws_access_key_id", "access_key_id"])
        || given(&["aws_secret_access_key", "secret_access_key"])
        || given(&["aws_web_identity_token_file", "web_identity_token_file"])
        || given(&[
            "aws_container_credentials_relative_uri",
            "container_credentials_relative_uri",
        ])
        || given(&[
            "aws_container_credentials_full_uri",
            "container_credentials_full_uri",
        ])
        || yes(&["aws_skip_signature", "skip_signature"])
    {
        return Ok(());
    }
    let endpoint = setting(&["aws_metadata_endpoint", "metadata_endpoint"]);
    let endpoint = if endpoint.is_empty() {
        "http://169.254.169.254".to_owned()
    } else {
        endpoint
    };
    let host = endpoint
        .split_once("://")
        .map_or(endpoint.as_str(), |(_, rest)| rest)
        .split('/')
        .next()
        .unwrap_or_default();
    let host = if host.contains(':') {
        host.to_owned()
    } else {
        format!("{host}:80")
    };
    let wait = std::time::Duration::from_secs(1);
    // IMDSv2's first request, which object_store sends too: a session token. With the IMDSv1
    // fallback asked for, any answer will do.
    let answer = imds_token_status(&host, wait);
    let fallback = yes(&["aws_imdsv1_fallback", "imdsv1_fallback"]);
    if answer.is_some_and(|status| (200..300).contains(&status) || fallback) {
        return Ok(());
    }
    Err(config(
        url,
        format!(
            "no credentials: no AWS_* variable gives them, and no instance metadata service \
             answered at {endpoint} within {} s as an EC2 instance's does ({}). Set \
             AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (and AWS_SESSION_TOKEN for temporary \
             keys), AWS_REGION to the bucket's region, and for a store other than AWS S3 \
             (MinIO, Ceph, R2, a local server) AWS_ENDPOINT_URL (with AWS_ALLOW_HTTP=true for \
             http://); or AWS_SKIP_SIGNATURE=true for a public bucket",
            wait.as_secs(),
            answer.map_or_else(|| "no answer".to_owned(), |s| format!("HTTP {s}"))
        ),
    ))
}

/// The HTTP status with which the instance metadata service at `host` (`address:port`)
/// answers IMDSv2's request for a session token within `wait`, if it answers.
#[cfg(feature = "s3")]
fn imds_token_status(host: &str, wait: std::time::Duration) -> Option<u16> {
    use std::io::{Read, Write};
    let address = std::net::ToSocketAddrs::to_socket_addrs(host)
        .ok()?
        .next()?;
    let mut stream = std::net::TcpStream::connect_timeout(&address, wait).ok()?;
    stream.set_read_timeout(Some(wait)).ok()?;
    stream.set_write_timeout(Some(wait)).ok()?;
    let request = format!(
        "PUT /latest/api/token HTTP/1.1\r\nHost: {host}\r\n\
         X-aws-ec2-metadata-token-ttl-seconds: 60\r\nContent-Length: 0\r\n\
         Connection: close\r\n\r\n"
    );
    stream.write_all(request.as_bytes()).ok()?;
    let mut head = [0u8; 12];
    stream.read_exact(&mut head).ok()?;
    // `HTTP/1.1 200`
    std::str::from_utf8(&head[9..12]).ok()?.parse().ok()
}

/// Parses `url` and builds its store (no request is sent to the store; an S3 URL without
/// credentials asks the instance metadata service whether it is there).
#[cfg_attr(
    not(any(feature = "s3", feature = "gcs", feature = "azure", feature = "http")),
    allow(unreachable_code, unused_variables)
)]
pub(crate) fn parse(url: &str, options: &RemoteOptions) -> Result<Target> {
    let _ = options;
    let base = url.trim_end_matches('/').to_owned();
    let Some((scheme, rest)) = base.split_once("://") else {
        return Err(config(url, "not a URL (scheme://...)"));
    };
    let scheme = scheme.to_ascii_lowercase();
    let (bucket, path) = rest.split_once('/').unwrap_or((rest, ""));
    let prefix = if path.is_empty() {
        String::new()
    } else {
        format!("{}/", path.trim_matches('/'))
    };
    let store: Arc<dyn ObjectStore> = match scheme.as_str() {
        "file" => {
            // file:///abs/path: `bucket` is the host, empty.
            if !bucket.is_empty() && bucket != "localhost" {
                return Err(config(url, "a file URL names a local path: file:///path"));
            }
            let root = std::path::PathBuf::from(format!("/{}", path.trim_matches('/')));
            let store = object_store::local::LocalFileSystem::new_with_prefix(&root)
                .map_err(|e| config(url, e.to_string()))?;
            return Ok(Target {
                store: Arc::new(store),
                prefix: String::new(),
                base,
                md5_etags: false,
            });
        }
        "s3" | "s3a" => {
            if bucket.is_empty() {
                return Err(config(url, "no bucket: s3://bucket/prefix"));
            }
            #[cfg(feature = "s3")]
            {
                use object_store::aws::{AmazonS3Builder, AmazonS3ConfigKey};
                let (client, retry) = client(options);
                // The client options replace those `from_env` read: AWS_ALLOW_HTTP again.
                let setting = |names: &[&str]| {
                    options
                        .settings
                        .iter()
                        .rev()
                        .find(|(k, _)| names.contains(&k.to_ascii_lowercase().as_str()))
                        .map(|(_, v)| v.clone())
                        .or_else(|| {
                            names
                                .iter()
                                .find_map(|n| std::env::var(n.to_ascii_uppercase()).ok())
                        })
                        .unwrap_or_default()
                };
                let allow_http = matches!(
                    setting(&["aws_allow_http"]).to_ascii_lowercase().as_str(),
                    "1" | "true" | "yes"
                );
                let endpoint = setting(&["aws_endpoint_url", "aws_endpoint"]);
                if endpoint.starts_with("http://") && !allow_http {
                    return Err(config(
                        url,
                        format!(
                            "the endpoint {endpoint} is plain HTTP: set AWS_ALLOW_HTTP=true to allow it"
                        ),
                    ));
                }
                check_credentials(url, &setting)?;
                let mut builder = AmazonS3Builder::from_env().with_bucket_name(bucket);
                for (k, v) in &options.settings {
                    let key: AmazonS3ConfigKey = k
                        .parse()
                        .map_err(|e: object_store::Error| config(url, e.to_string()))?;
                    builder = builder.with_config(key, v);
                }
                let builder = builder
                    .with_client_options(client.with_allow_http(allow_http))
                    .with_retry(retry);
                built(url, builder.build())?
            }
            #[cfg(not(feature = "s3"))]
            return Err(missing_feature(url, "s3"));
        }
        "gs" => {
            #[cfg(feature = "gcs")]
            {
                let (client, retry) = client(options);
                use object_store::gcp::{GoogleCloudStorageBuilder, GoogleConfigKey};
                let mut builder = GoogleCloudStorageBuilder::from_env().with_bucket_name(bucket);
                for (k, v) in &options.settings {
                    let key: GoogleConfigKey = k
                        .parse()
                        .map_err(|e: object_store::Error| config(url, e.to_string()))?;
                    builder = builder.with_config(key, v);
                }
                let builder = builder.with_client_options(client).with_retry(retry);
                built(url, builder.build())?
            }
            #[cfg(not(feature = "gcs"))]
            return Err(missing_feature(url, "gcs"));
        }
        "az" | "azure" => {
            #[cfg(feature = "azure")]
            {
                let (client, retry) = client(options);
                use object_store::azure::{AzureConfigKey, MicrosoftAzureBuilder};
                let mut builder = MicrosoftAzureBuilder::from_env().with_container_name(bucket);
                for (k, v) in &options.settings {
                    let key: AzureConfigKey = k
                        .parse()
                        .map_err(|e: object_store::Error| config(url, e.to_string()))?;
                    builder = builder.with_config(key, v);
                }
                let builder = builder.with_client_options(client).with_retry(retry);
                built(url, builder.build())?
            }
            #[cfg(not(feature = "azure"))]
            return Err(missing_feature(url, "azure"));
        }
        "http" | "https" => {
            #[cfg(feature = "http")]
            {
                let (client, retry) = client(options);
                let builder = object_store::http::HttpBuilder::new()
                    .with_url(format!("{scheme}://{bucket}"))
                    .with_client_options(client.with_allow_http(scheme == "http"))
                    .with_retry(retry);
                built(url, builder.build())?
            }
            #[cfg(not(feature = "http"))]
            return Err(missing_feature(url, "http"));
        }
        other => {
            return Err(config(
                url,
                format!("unknown scheme `{other}`: s3://, gs://, az://, http(s):// or file://"),
            ));
        }
    };
    Ok(Target {
        store,
        prefix,
        base,
        md5_etags: matches!(scheme.as_str(), "s3" | "s3a"),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn urls_are_told_from_paths() {
        use crate::source::shards::is_store_url;
        assert!(is_store_url("s3://bucket/prefix"));
        assert!(is_store_url("file:///tmp/x"));
        assert!(!is_store_url("/tmp/x"));
        assert!(!is_store_url("shards-{000..009}.tar"));
        assert!(!is_store_url("a/b://c"));
    }

    #[test]
    fn bad_urls_are_config_errors() {
        let o = RemoteOptions::default();
        for url in ["nope://x/y", "s3:///prefix", "file://host/x"] {
            match parse(url, &o) {
                Err(Error::Remote {
                    kind: RemoteErrorKind::Config,
                    ..
                }) => {}
                Err(e) => panic!("{url}: {e}"),
                Ok(_) => panic!("{url}: accepted"),
            }
        }
    }
}
