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

/// Parses `url` and builds its store (no request is sent).
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
