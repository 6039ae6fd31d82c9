//! The hub's layout of a tokenizer: where its `tokenizer.json` is, and which tokens its
//! configuration names as BOS and EOS, read as `transformers` reads them.
//!
//! A path is a `tokenizer.json` (any name) or a directory that holds one. Either way, the
//! configuration files beside it are read when they are there: `tokenizer_config.json`, whose
//! `bos_token` and `eos_token` are a string or an object with `content` (an `AddedToken` as
//! `transformers` writes it), and `special_tokens_map.json`, whose values override them when
//! `tokenizer_config.json` has no `added_tokens_decoder` (transformers 5's rule; transformers
//! 4 let them override always: the two differ only where the two files disagree).

use std::io::Read;
use std::path::{Path, PathBuf};

use serde_json::Value;

use crate::error::{Error, Result};

/// The largest tokenizer.json read (the largest on the hub are tens of MB).
const MAX_TOKENIZER_BYTES: u64 = 1 << 30;

/// The largest configuration file read.
const MAX_CONFIG_BYTES: u64 = 256 << 20;

/// Where a tokenizer's files are.
pub(crate) struct Located {
    /// The tokenizer.json.
    pub json: PathBuf,
    /// The directory of its configuration files.
    pub dir: PathBuf,
}

/// A special token that a configuration file names.
pub(crate) struct Named {
    /// The token's text.
    pub token: String,
    /// The file that names it.
    pub file: PathBuf,
}

/// The BOS and EOS the configuration files name.
#[derive(Default)]
pub(crate) struct Configured {
    pub bos: Option<Named>,
    pub eos: Option<Named>,
}

/// The tokenizer.json that `path` names: the file itself, or `tokenizer.json` in a directory.
pub(crate) fn locate(path: &Path) -> Result<Located> {
    let meta = std::fs::metadata(path).map_err(|e| Error::io(path, "open", e))?;
    if !meta.is_dir() {
        let dir = match path.parent() {
            Some(p) if !p.as_os_str().is_empty() => p.to_path_buf(),
            _ => PathBuf::from("."),
        };
        return Ok(Located {
            json: path.to_path_buf(),
            dir,
        });
    }
    let json = path.join("tokenizer.json");
    if json.exists() {
        return Ok(Located {
            json,
            dir: path.to_path_buf(),
        });
    }
    let has = |name: &str| path.join(name).exists();
    let hint = if has("tokenizer.model") {
        " (it has a SentencePiece tokenizer.model: `transformers` writes the tokenizer.json \
         of it with AutoTokenizer.from_pretrained(dir).save_pretrained(dir))"
    } else if has("vocab.json") || has("merges.txt") {
        " (it has vocab.json/merges.txt, the older form: `transformers` writes the \
         tokenizer.json of it with AutoTokenizer.from_pretrained(dir).save_pretrained(dir))"
    } else {
        ""
    };
    Err(Error::config(
        "tokenizer",
        format!(
            "{} is a directory without a tokenizer.json{hint}; give a tokenizer.json or a \
             directory in the Hugging Face hub's layout (tokenizer.json beside \
             tokenizer_config.json)",
            path.display()
        ),
    ))
}

/// The bytes of a regular file of at most `limit` bytes (a FIFO or a device would block or
/// never end: refused before it is opened).
pub(crate) fn read_file(path: &Path, what: &'static str, limit: u64) -> Result<Vec<u8>> {
    let meta = std::fs::metadata(path).map_err(|e| Error::io(path, "open", e))?;
    if !meta.is_file() {
        return Err(Error::Malformed {
            path: path.to_path_buf(),
            format: what,
            what: "not a regular file".into(),
        });
    }
    if meta.len() > limit {
        return Err(Error::Malformed {
            path: path.to_path_buf(),
            format: what,
            what: format!(
                "{} bytes, more than any {what} file (at most {limit} bytes are read)",
                meta.len()
            ),
        });
    }
    let mut bytes = Vec::with_capacity(meta.len() as usize);
    std::fs::File::open(path)
        .and_then(|f| f.take(limit + 1).read_to_end(&mut bytes))
        .map_err(|e| Error::io(path, "read", e))?;
    Ok(bytes)
}

/// A tokenizer.json's text.
pub(crate) fn read_tokenizer_json(path: &Path) -> Result<String> {
    let bytes = read_file(path, "tokenizer.json", MAX_TOKENIZER_BYTES)?;
    String::from_utf8(bytes).map_err(|e| Error::Malformed {
        path: path.to_path_buf(),
        format: "tokenizer.json",
        what: format!(
            "not UTF-8 text (byte {}): not a tokenizer.json",
            e.utf8_error().valid_up_to()
        ),
    })
}

/// A JSON configuration file, or `None` when there is none.
fn read_config(path: &Path, name: &'static str) -> Result<Option<Value>> {
    if !path.exists() {
        return Ok(None);
    }
    let bytes = read_file(path, name, MAX_CONFIG_BYTES)?;
    let value: Value = serde_json::from_slice(&bytes).map_err(|e| Error::Malformed {
        path: path.to_path_buf(),
        format: name,
        what: format!("not JSON: {e}"),
    })?;
    if !value.is_object() {
        return Err(Error::Malformed {
            path: path.to_path_buf(),
            format: name,
            what: "not a JSON object".into(),
        });
    }
    Ok(Some(value))
}

/// A special token's value as `transformers` reads it: a string, or an object (`AddedToken`)
/// whose `content` is the token; `null` names none.
fn token_value(v: &Value, file: &Path, name: &'static str, key: &str) -> Result<Option<Named>> {
    let token = match v {
        Value::Null => return Ok(None),
        Value::String(s) => s.clone(),
        Value::Object(o) => match o.get("content") {
            Some(Value::String(s)) => s.clone(),
            _ => {
                return Err(Error::Malformed {
                    path: file.to_path_buf(),
                    format: name,
                    what: format!("`{key}` is an object without a string `content`"),
                });
            }
        },
        _ => {
            return Err(Error::Malformed {
                path: file.to_path_buf(),
                format: name,
                what: format!(
                    "`{key}` is neither a string nor an object with `content` (a token's text)"
                ),
            });
        }
    };
    Ok(Some(Named {
        token,
        file: file.to_path_buf(),
    }))
}

/// The BOS and EOS that the configuration files in `dir` name.
pub(crate) fn configured(dir: &Path) -> Result<Configured> {
    const CONFIG: &str = "tokenizer_config.json";
    const MAP: &str = "special_tokens_map.json";
    let config_path = dir.join(CONFIG);
    let map_path = dir.join(MAP);
    let config = read_config(&config_path, CONFIG)?;
    let map = read_config(&map_path, MAP)?;
    // transformers 5 merges special_tokens_map.json in only for a configuration without
    // `added_tokens_decoder` (its "legacy" path), and then its values win.
    let map_wins = config
        .as_ref()
        .is_none_or(|c| c.get("added_tokens_decoder").is_none());
    let mut out = Configured::default();
    for (key, slot) in [("bos_token", &mut out.bos), ("eos_token", &mut out.eos)] {
        if let Some(v) = config.as_ref().and_then(|c| c.get(key)) {
            *slot = token_value(v, &config_path, CONFIG, key)?;
        }
        if map_wins && let Some(v) = map.as_ref().and_then(|m| m.get(key)) {
            *slot = token_value(v, &map_path, MAP, key)?;
        }
    }
    Ok(out)
}
