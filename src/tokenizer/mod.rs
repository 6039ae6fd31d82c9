//! The user's tokenizer: a Hugging Face `tokenizer.json` (or a directory in the hub's layout)
//! turned into token ids, one document at a time, the same ids as Python's `tokenizers`.
//!
//! ```no_run
//! use gpufeed::tokenizer::Tokenizer;
//!
//! let tokenizer = Tokenizer::open("gpt2/")?; // or "gpt2/tokenizer.json"
//! let mut encoder = tokenizer.encoder(); // one per worker thread
//! let mut ids = Vec::new();
//! for text in ["Hello world", "Grüß Gott"] {
//!     ids.clear();
//!     encoder.encode_into(text, &mut ids)?; // the document's ids, then the EOS
//! }
//! # Ok::<(), gpufeed::Error>(())
//! ```
//!
//! # What a document's ids are
//!
//! By default a document's ids are `Tokenizer.from_file(path).encode(text).ids` of Python's
//! `tokenizers` (its `add_special_tokens=True` default: the post-processor's template, such as
//! Llama 3's BOS before the text), then the EOS (Megatron's `--append-eod`). With
//! [`TokenizerOptions::prepend_bos`] the BOS comes first, unless the template already put it
//! there; the EOS is not appended when the template already ends with it: a document never
//! gets either twice from gpufeed (only if its own text holds one: special tokens written in
//! a document are matched as tokens, as Python does). An empty document is the template and
//! the EOS alone: `[EOS]` for GPT-2, `[BOS, EOS]` for Llama 3.
//!
//! Truncation and padding in a tokenizer.json are not applied: gpufeed never cuts or pads a
//! document (the loader packs rows itself); Python's `encode` would, for such a file.
//!
//! # BOS and EOS
//!
//! Named by [`TokenizerOptions::eos_token`] / [`bos_token`](TokenizerOptions::bos_token) if
//! given, else by the configuration files beside the tokenizer.json (`tokenizer_config.json`,
//! `special_tokens_map.json`, as `transformers` reads them), else found in the tokenizer.json:
//! the BOS is the first token of the post-processor's template before the text (Llama 3's
//! `<|begin_of_text|>`, Mistral's `<s>`), the EOS the last after it; failing that, the first
//! special added token with a well-known name (BOS: `<|begin_of_text|>`, `<s>`, `<bos>`,
//! `<|startoftext|>`; EOS: `<|endoftext|>`, `<|end_of_text|>`, `</s>`, `<eos>`). A named token
//! the vocabulary lacks is an error; so is no EOS at all when the EOS is to be appended.
//!
//! # Two engines
//!
//! A byte-level BPE tokenizer.json of the kinds the fast path knows (GPT-2's and Llama 3's
//! splits; the conditions are in the `fast` module's docs, checked at load) runs on gpufeed's
//! own byte-level BPE, which gives the `tokenizers` crate's ids several times faster; every
//! other file runs on the `tokenizers` crate itself. [`Tokenizer::engine`] says which, and
//! why not the fast path. Both tokenize one document per call on the caller's thread: never
//! the crate's `encode_batch` nor its rayon pool (gpufeed calls its single-document encode on
//! a tokenizer without padding, the only path to its parallel code for one document).
//!
//! # Text, not bytes
//!
//! The API takes `&str`: bytes become text where they are read, and each source says so (Arrow
//! strings are UTF-8 already; a JSON line is decoded by its parser; a field of raw bytes is
//! checked with `std::str::from_utf8`, and invalid UTF-8 is an error naming the document).
//!
//! # Long documents
//!
//! A document is tokenized whole, whatever its length (at most 2 GiB): its ids are exact. The
//! pre-tokenizer splits text into pieces (words, runs of punctuation); a piece of `n` bytes
//! takes O(n log n) time on both engines, and transient memory while it is merged:
//! [`TokenizerMemory::per_long_piece_byte`] per byte (a document of Chinese or of one symbol
//! repeated, with no space or punctuation, is one piece). `benches/RESULTS.md` has the times
//! of a 10 MB piece.

mod fast;
mod hub;
#[doc(hidden)]
pub mod synthetic;

use std::fmt;
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use serde_json::Value;

use crate::error::{Error, Result};
use fast::{FastBpe, Scratch};

pub use fast::Split;

/// The longest document tokenized (bytes of UTF-8): 2 GiB.
pub const MAX_DOCUMENT_BYTES: usize = i32::MAX as usize;

/// Which engine to use; by default the fast path where the tokenizer.json qualifies.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum EngineChoice {
    /// The fast path if the file qualifies, else the `tokenizers` crate.
    #[default]
    Auto,
    /// The fast path, or an error saying why the file does not qualify.
    Fast,
    /// The `tokenizers` crate, even for a file the fast path takes.
    Crate,
}

impl EngineChoice {
    /// The choice a name names: `auto`, `fast` or `crate`.
    pub fn from_name(name: &str) -> Option<EngineChoice> {
        match name {
            "auto" => Some(EngineChoice::Auto),
            "fast" => Some(EngineChoice::Fast),
            "crate" => Some(EngineChoice::Crate),
            _ => None,
        }
    }
}

/// The engine a [`Tokenizer`] runs on: one line for stats and `inspect` (its `Display`).
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum Engine {
    /// gpufeed's byte-level BPE, with the split it recognised.
    FastBpe {
        /// The pre-tokenizer's regex.
        split: Split,
    },
    /// The `tokenizers` crate.
    Crate {
        /// Why not the fast path: what in the tokenizer.json it does not take, or that the
        /// crate was asked for.
        why: String,
    },
}

impl fmt::Display for Engine {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Engine::FastBpe { split } => {
                write!(f, "fast byte-level BPE ({} split)", split.name())
            }
            Engine::Crate { why } => write!(f, "tokenizers crate (not the fast path: {why})"),
        }
    }
}

/// Where a BOS or EOS was found.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum TokenOrigin {
    /// [`TokenizerOptions::eos_token`] or [`TokenizerOptions::bos_token`].
    Option,
    /// A configuration file (`tokenizer_config.json` or `special_tokens_map.json`).
    Config(PathBuf),
    /// The tokenizer.json's post-processor template.
    Template,
    /// A special added token with a well-known name.
    KnownName,
}

impl fmt::Display for TokenOrigin {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            TokenOrigin::Option => f.write_str("named by the caller"),
            TokenOrigin::Config(path) => write!(f, "named by {}", path.display()),
            TokenOrigin::Template => f.write_str("the post-processor's template"),
            TokenOrigin::KnownName => f.write_str("a special added token of that name"),
        }
    }
}

/// A special token: its id, its text and where it was found.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SpecialToken {
    /// The token's id.
    pub id: u32,
    /// The token's text (`<|endoftext|>`).
    pub content: String,
    /// Where it was found.
    pub origin: TokenOrigin,
}

/// An integer type token ids are stored in.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum TokenWidth {
    /// `uint16`: ids up to 65,535.
    U16,
    /// `int32`: ids up to 2,147,483,647.
    I32,
    /// `uint32`: any id.
    U32,
}

impl TokenWidth {
    /// The largest id it holds.
    pub fn max_id(self) -> u64 {
        match self {
            TokenWidth::U16 => u16::MAX as u64,
            TokenWidth::I32 => i32::MAX as u64,
            TokenWidth::U32 => u32::MAX as u64,
        }
    }

    /// Its numpy name (`uint16`, `int32`, `uint32`).
    pub fn name(self) -> &'static str {
        match self {
            TokenWidth::U16 => "uint16",
            TokenWidth::I32 => "int32",
            TokenWidth::U32 => "uint32",
        }
    }

    /// The type Megatron stores the tokens of a vocabulary of `vocab_size` in: `uint16` below
    /// 65,500, else `int32`, as megatron-core's `DType.optimal_dtype(cardinality)`
    /// (megatron/core/datasets/indexed_dataset.py, 0.16.1: `if cardinality is not None and
    /// cardinality < 65500: return numpy.uint16 else: return numpy.int32`), which its
    /// `tools/preprocess_data.py` calls with the tokenizer's vocabulary size.
    pub fn megatron(vocab_size: u64) -> TokenWidth {
        if vocab_size < 65_500 {
            TokenWidth::U16
        } else {
            TokenWidth::I32
        }
    }
}

/// What a [`Tokenizer`] holds in memory, for a loader's budget.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TokenizerMemory {
    /// The model, shared by every encoder (one per `Tokenizer`), in bytes.
    pub model: usize,
    /// What one [`Encoder`] holds at most in steady state (its caches and buffers), in bytes.
    pub per_encoder: usize,
    /// Transient bytes per byte of the longest piece of a document while it is merged (the
    /// fast path gives them back after a piece over 64 KiB; the crate after each document).
    pub per_long_piece_byte: usize,
}

/// How a tokenizer is opened: the special tokens each document gets, and the engine.
#[derive(Clone, Debug)]
pub struct TokenizerOptions {
    eos_token: Option<String>,
    bos_token: Option<String>,
    append_eos: bool,
    prepend_bos: bool,
    add_special_tokens: bool,
    engine: EngineChoice,
}

impl Default for TokenizerOptions {
    fn default() -> Self {
        TokenizerOptions {
            eos_token: None,
            bos_token: None,
            append_eos: true,
            prepend_bos: false,
            add_special_tokens: true,
            engine: EngineChoice::Auto,
        }
    }
}

impl TokenizerOptions {
    /// The defaults: the template as Python's `encode` applies it, then the EOS.
    pub fn new() -> Self {
        Self::default()
    }

    /// The EOS by its text, instead of the one the configuration names.
    pub fn eos_token(mut self, token: impl Into<String>) -> Self {
        self.eos_token = Some(token.into());
        self
    }

    /// The BOS by its text, instead of the one the configuration names.
    pub fn bos_token(mut self, token: impl Into<String>) -> Self {
        self.bos_token = Some(token.into());
        self
    }

    /// Whether each document ends with the EOS (default: yes, Megatron's `--append-eod`).
    pub fn append_eos(mut self, yes: bool) -> Self {
        self.append_eos = yes;
        self
    }

    /// Whether each document starts with the BOS (default: no; a template that puts it there
    /// already, such as Llama 3's, does so with [`add_special_tokens`](Self::add_special_tokens)).
    pub fn prepend_bos(mut self, yes: bool) -> Self {
        self.prepend_bos = yes;
        self
    }

    /// Whether the post-processor's template is applied, as Python's `encode(text,
    /// add_special_tokens=...)` (default: yes, Python's default).
    pub fn add_special_tokens(mut self, yes: bool) -> Self {
        self.add_special_tokens = yes;
        self
    }

    /// The engine (default: the fast path where the file qualifies).
    pub fn engine(mut self, engine: EngineChoice) -> Self {
        self.engine = engine;
        self
    }

    /// Opens `path`: a tokenizer.json, or a directory that holds one (the hub's layout).
    pub fn open(&self, path: impl AsRef<Path>) -> Result<Tokenizer> {
        Tokenizer::open_with(path.as_ref(), self)
    }
}

/// The engine itself.
enum Model {
    Fast(Box<FastBpe>),
    Crate(Box<tokenizers::Tokenizer>),
}

struct Inner {
    path: PathBuf,
    model: Model,
    engine: Engine,
    bos: Option<SpecialToken>,
    eos: Option<SpecialToken>,
    add_special_tokens: bool,
    /// The BOS to put before each document (asked for, and not in the template already).
    prepend: Option<u32>,
    /// The EOS to put after each document (asked for, and not in the template already).
    append: Option<u32>,
    vocab_size: u64,
    memory: TokenizerMemory,
}

/// A tokenizer, loaded once and shared (cheap to clone, `Send` and `Sync`); each thread
/// tokenizes with an [`Encoder`] of its own.
#[derive(Clone)]
pub struct Tokenizer {
    inner: Arc<Inner>,
}

impl fmt::Debug for Tokenizer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Tokenizer")
            .field("path", &self.inner.path)
            .field("engine", &self.inner.engine.to_string())
            .field("vocab_size", &self.inner.vocab_size)
            .field("bos", &self.inner.bos.as_ref().map(|t| t.id))
            .field("eos", &self.inner.eos.as_ref().map(|t| t.id))
            .finish()
    }
}

/// The `tokenizers` crate's error about `path`, as gpufeed's.
fn crate_error(path: &Path, what: String) -> Error {
    Error::Malformed {
        path: path.to_path_buf(),
        format: "tokenizer.json",
        what,
    }
}

/// The crate's tokenizer of a tokenizer.json's text (its errors and panics as gpufeed's error).
fn load_crate(text: &str, path: &Path) -> Result<tokenizers::Tokenizer> {
    match catch_unwind(|| text.parse::<tokenizers::Tokenizer>()) {
        Ok(Ok(t)) => Ok(t),
        Ok(Err(e)) => Err(crate_error(
            path,
            format!("the tokenizers library cannot load it: {e}"),
        )),
        Err(panic) => Err(crate_error(
            path,
            format!(
                "the tokenizers library failed loading it: {}",
                panic_message(panic.as_ref())
            ),
        )),
    }
}

/// The crate's encoding of one document (its error or panic as a message).
fn crate_encode(
    t: &tokenizers::Tokenizer,
    text: &str,
    add_special_tokens: bool,
) -> std::result::Result<tokenizers::Encoding, String> {
    match catch_unwind(AssertUnwindSafe(|| t.encode_fast(text, add_special_tokens))) {
        Ok(Ok(encoding)) => Ok(encoding),
        Ok(Err(e)) => Err(e.to_string()),
        Err(panic) => Err(panic_message(panic.as_ref())),
    }
}

/// A panic's message.
fn panic_message(payload: &(dyn std::any::Any + Send)) -> String {
    payload
        .downcast_ref::<&str>()
        .map(|s| s.to_string())
        .or_else(|| payload.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "a panic".into())
}

/// Special added tokens' texts that name a BOS, most likely first.
const KNOWN_BOS: [&str; 4] = ["<|begin_of_text|>", "<s>", "<bos>", "<|startoftext|>"];

/// Special added tokens' texts that name an EOS, most likely first.
const KNOWN_EOS: [&str; 4] = ["<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>"];

/// The model's bytes per byte of tokenizer.json on the crate, measured: loading GPT-2's
/// (3.6 MB) and a Llama-3-style one (16.9 MB) grew the process by about 2.5 times the file.
const CRATE_BYTES_PER_JSON_BYTE: usize = 3;

/// What one thread's cache of the crate's BPE may hold: up to 10,000 pieces of fewer than 256
/// bytes (its `DEFAULT_CACHE_CAPACITY`, `MAX_LENGTH`), each a `String` and a `Word` of 32-byte
/// symbols; pieces average a few bytes, so 10,000 of them at 400 bytes each.
const CRATE_CACHE_BYTES: usize = 10_000 * 400;

/// The crate's transient bytes per byte of a piece (its alignments, a 32-byte symbol per
/// byte, a heap entry, the Encoding's offsets and strings), measured on a 10 MB piece.
const CRATE_BYTES_PER_PIECE_BYTE: usize = 200;

/// Finds a tokenizer's special tokens (BOS, EOS) by the rules of the module's docs.
struct Lookup<'a> {
    crate_tokenizer: &'a tokenizers::Tokenizer,
    json: &'a Value,
    path: &'a Path,
}

impl Lookup<'_> {
    /// The token `asked` for (the option `setting`), else the one `named` by a configuration
    /// file, else the template's, else the first of the `known` names that is a special added
    /// token; ids as the crate gives them.
    fn special(
        &self,
        asked: &Option<String>,
        named: Option<hub::Named>,
        setting: &'static str,
        from_template: Option<u32>,
        known: &[&str],
    ) -> Result<Option<SpecialToken>> {
        let id_of = |token: &str| self.crate_tokenizer.token_to_id(token);
        if let Some(token) = asked {
            let Some(id) = id_of(token) else {
                return Err(Error::config(
                    setting,
                    format!("`{token}` is not a token of {}", self.path.display()),
                ));
            };
            return Ok(Some(SpecialToken {
                id,
                content: token.clone(),
                origin: TokenOrigin::Option,
            }));
        }
        if let Some(named) = named {
            let Some(id) = id_of(&named.token) else {
                return Err(Error::mismatch(format!(
                    "{}: {setting} `{}` is not a token of {}; name one that is ({setting})",
                    named.file.display(),
                    named.token,
                    self.path.display()
                )));
            };
            return Ok(Some(SpecialToken {
                id,
                content: named.token,
                origin: TokenOrigin::Config(named.file),
            }));
        }
        if let Some(id) = from_template {
            return Ok(Some(SpecialToken {
                id,
                content: self.crate_tokenizer.id_to_token(id).unwrap_or_default(),
                origin: TokenOrigin::Template,
            }));
        }
        let specials: Vec<&str> = self.json["added_tokens"]
            .as_array()
            .into_iter()
            .flatten()
            .filter(|t| t["special"] == true)
            .filter_map(|t| t["content"].as_str())
            .collect();
        Ok(known
            .iter()
            .filter(|name| specials.contains(name))
            .find_map(|name| {
                Some(SpecialToken {
                    id: id_of(name)?,
                    content: name.to_string(),
                    origin: TokenOrigin::KnownName,
                })
            }))
    }
}

impl Tokenizer {
    /// Opens `path` (a tokenizer.json, or a directory that holds one) with the default
    /// options: Python's `encode` ids, then the EOS.
    pub fn open(path: impl AsRef<Path>) -> Result<Tokenizer> {
        Tokenizer::open_with(path.as_ref(), &TokenizerOptions::default())
    }

    fn open_with(path: &Path, options: &TokenizerOptions) -> Result<Tokenizer> {
        let located = hub::locate(path)?;
        let json_path = located.json;
        let text = hub::read_tokenizer_json(&json_path)?;
        let json: Value = serde_json::from_str(&text).map_err(|e| Error::Malformed {
            path: json_path.clone(),
            format: "tokenizer.json",
            what: format!("not JSON: {e}"),
        })?;
        if !json.get("model").is_some_and(Value::is_object) {
            return Err(Error::Malformed {
                path: json_path,
                format: "tokenizer.json",
                what: "no `model`: not a Hugging Face tokenizers file (give the \
                       tokenizer.json, not tokenizer_config.json or another file)"
                    .into(),
            });
        }
        // The crate reads every file, the fast path's too: a file it refuses is refused, and
        // its vocabulary and special tokens are the ones looked up below either way.
        let crate_tokenizer = load_crate(&text, &json_path)?;
        let mut crate_tokenizer = crate_tokenizer;
        // Documents are never cut or padded (and without padding, encoding one document
        // never reaches the crate's parallel code). Unsetting truncation cannot fail.
        let _ = crate_tokenizer.with_truncation(None);
        crate_tokenizer.with_padding(None);

        let vocab_size = crate_tokenizer
            .get_vocab(true)
            .values()
            .map(|&id| id as u64 + 1)
            .max()
            .unwrap_or(0);

        let fast = match options.engine {
            EngineChoice::Crate => Err("the crate was asked for".to_string()),
            EngineChoice::Auto | EngineChoice::Fast => {
                FastBpe::from_json(&json, &|text| crate_tokenizer.token_to_id(text))
            }
        };
        if let (Err(why), EngineChoice::Fast) = (&fast, options.engine) {
            return Err(Error::config(
                "engine",
                format!(
                    "{} does not qualify for the fast byte-level BPE path: {why}; leave the \
                     engine to gpufeed (auto) to run it on the tokenizers crate",
                    json_path.display()
                ),
            ));
        }

        // The template's ids around a document: from the tokenizer.json where it says them,
        // else by encoding an empty text.
        let template = fast::template_affixes(&json["post_processor"], false).ok();
        let around_empty = match &template {
            Some((prefix, suffix)) => [prefix.as_slice(), suffix].concat(),
            None => crate_encode(&crate_tokenizer, "", true)
                .map(|e| e.get_ids().to_vec())
                .unwrap_or_default(),
        };
        let configured = hub::configured(&located.dir)?;
        let lookup = Lookup {
            crate_tokenizer: &crate_tokenizer,
            json: &json,
            path: &json_path,
        };
        let template_bos = template.as_ref().and_then(|(p, _)| p.first().copied());
        let template_eos = template.as_ref().and_then(|(_, s)| s.last().copied());
        let bos = lookup.special(
            &options.bos_token,
            configured.bos,
            "bos_token",
            template_bos,
            &KNOWN_BOS,
        )?;
        let eos = lookup.special(
            &options.eos_token,
            configured.eos,
            "eos_token",
            template_eos,
            &KNOWN_EOS,
        )?;

        let template_ids: &[u32] = if options.add_special_tokens {
            &around_empty
        } else {
            &[]
        };
        let prepend = match (&bos, options.prepend_bos) {
            (_, false) => None,
            (Some(b), true) => (template_ids.first() != Some(&b.id)).then_some(b.id),
            (None, true) => {
                return Err(Error::config(
                    "bos_token",
                    format!(
                        "{}: no BOS to put before each document: no bos_token in its \
                         tokenizer_config.json or special_tokens_map.json, none in its \
                         post-processor, no special token named {}; name one (bos_token) or \
                         put none (prepend_bos)",
                        json_path.display(),
                        KNOWN_BOS.join(", ")
                    ),
                ));
            }
        };
        let append = match (&eos, options.append_eos) {
            (_, false) => None,
            (Some(e), true) => (template_ids.last() != Some(&e.id)).then_some(e.id),
            (None, true) => {
                return Err(Error::config(
                    "eos_token",
                    format!(
                        "{}: no EOS to put after each document: no eos_token in its \
                         tokenizer_config.json or special_tokens_map.json, none in its \
                         post-processor, no special token named {}; name one (eos_token) or \
                         put none (append_eos)",
                        json_path.display(),
                        KNOWN_EOS.join(", ")
                    ),
                ));
            }
        };

        let (model, engine, memory) = match fast {
            Ok(f) => {
                let split = f.split();
                let memory = TokenizerMemory {
                    model: f.bytes(),
                    per_encoder: fast::CACHE_BYTES + (64 << 10) * fast::LONG_BYTES_PER_BYTE,
                    per_long_piece_byte: fast::LONG_BYTES_PER_BYTE,
                };
                (Model::Fast(Box::new(f)), Engine::FastBpe { split }, memory)
            }
            Err(why) => {
                let memory = TokenizerMemory {
                    model: text.len() * CRATE_BYTES_PER_JSON_BYTE,
                    per_encoder: CRATE_CACHE_BYTES,
                    per_long_piece_byte: CRATE_BYTES_PER_PIECE_BYTE,
                };
                (
                    Model::Crate(Box::new(crate_tokenizer)),
                    Engine::Crate { why },
                    memory,
                )
            }
        };
        Ok(Tokenizer {
            inner: Arc::new(Inner {
                path: json_path,
                model,
                engine,
                bos,
                eos,
                add_special_tokens: options.add_special_tokens,
                prepend,
                append,
                vocab_size,
                memory,
            }),
        })
    }

    /// The tokenizer.json read.
    pub fn path(&self) -> &Path {
        &self.inner.path
    }

    /// The engine it runs on, and why not the fast path (one line: its `Display`).
    pub fn engine(&self) -> &Engine {
        &self.inner.engine
    }

    /// The BOS, if one was named or found (put before each document only when asked:
    /// [`TokenizerOptions::prepend_bos`]).
    pub fn bos(&self) -> Option<&SpecialToken> {
        self.inner.bos.as_ref()
    }

    /// The EOS, if one was named or found.
    pub fn eos(&self) -> Option<&SpecialToken> {
        self.inner.eos.as_ref()
    }

    /// Whether the post-processor's template is applied (Python's `add_special_tokens`).
    pub fn adds_special_tokens(&self) -> bool {
        self.inner.add_special_tokens
    }

    /// The id gpufeed puts before each document, if any (the BOS when asked for and not in
    /// the template already).
    pub fn prepended(&self) -> Option<u32> {
        self.inner.prepend
    }

    /// The id gpufeed puts after each document, if any (the EOS unless turned off or in the
    /// template already).
    pub fn appended(&self) -> Option<u32> {
        self.inner.append
    }

    /// One more than the largest id (the model's and the added tokens'): the rows an embedding
    /// needs, and what the token type must hold. Equal to `len(tokenizer)` in `transformers`
    /// unless the ids have gaps.
    pub fn vocab_size(&self) -> u64 {
        self.inner.vocab_size
    }

    /// The type Megatron stores this vocabulary's tokens in ([`TokenWidth::megatron`]).
    pub fn megatron_width(&self) -> TokenWidth {
        TokenWidth::megatron(self.inner.vocab_size)
    }

    /// An error unless every id fits `width`; `setting` names what chose it (`token_dtype`).
    pub fn check_width(&self, width: TokenWidth, setting: &'static str) -> Result<()> {
        let largest = self.inner.vocab_size.saturating_sub(1);
        if largest <= width.max_id() {
            return Ok(());
        }
        Err(Error::config(
            setting,
            format!(
                "{} has ids up to {largest}, which {} cannot hold (at most {}); store them in \
                 a wider type",
                self.inner.path.display(),
                width.name(),
                width.max_id()
            ),
        ))
    }

    /// What it holds in memory, for a loader's budget.
    pub fn memory(&self) -> TokenizerMemory {
        self.inner.memory
    }

    /// A new encoder: one per thread, kept for all its documents.
    pub fn encoder(&self) -> Encoder {
        Encoder {
            tokenizer: self.clone(),
            scratch: Scratch::default(),
        }
    }
}

/// Tokenizes documents one at a time on the calling thread: one per worker thread, each with
/// its own buffers and cache (the [`Tokenizer`]'s model is shared).
pub struct Encoder {
    tokenizer: Tokenizer,
    scratch: Scratch,
}

impl fmt::Debug for Encoder {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Encoder")
            .field("tokenizer", &self.tokenizer.inner.path)
            .field("bytes", &self.bytes())
            .finish()
    }
}

impl Encoder {
    /// Appends one document's ids to `out` (BOS, the text's ids, EOS, as the options say) and
    /// returns how many it appended. `out` is the caller's: cleared by the caller when it
    /// wants, reused across documents, so the fast path allocates nothing per document once
    /// its buffers have grown.
    pub fn encode_into(&mut self, text: &str, out: &mut Vec<u32>) -> Result<usize> {
        let inner = &*self.tokenizer.inner;
        if text.len() > MAX_DOCUMENT_BYTES {
            return Err(Error::mismatch(format!(
                "a document of {} bytes is longer than the {MAX_DOCUMENT_BYTES} bytes gpufeed \
                 tokenizes at once ({})",
                text.len(),
                inner.path.display()
            )));
        }
        let start = out.len();
        if let Some(bos) = inner.prepend {
            out.push(bos);
        }
        match &inner.model {
            Model::Fast(f) => f.encode_into(text, inner.add_special_tokens, &mut self.scratch, out),
            Model::Crate(t) => match crate_encode(t, text, inner.add_special_tokens) {
                Ok(encoding) => out.extend_from_slice(encoding.get_ids()),
                Err(what) => {
                    out.truncate(start);
                    return Err(crate_error(
                        &inner.path,
                        format!("the tokenizers library failed on a document: {what}"),
                    ));
                }
            },
        }
        if let Some(eos) = inner.append {
            out.push(eos);
        }
        Ok(out.len() - start)
    }

    /// One document's ids in a new vector.
    pub fn encode(&mut self, text: &str) -> Result<Vec<u32>> {
        let mut out = Vec::with_capacity(text.len() / 3 + 4);
        self.encode_into(text, &mut out)?;
        Ok(out)
    }

    /// The tokenizer it encodes with.
    pub fn tokenizer(&self) -> &Tokenizer {
        &self.tokenizer
    }

    /// Bytes this encoder holds now (the fast path's buffers and cache; the crate keeps its
    /// cache per thread, counted in [`TokenizerMemory::per_encoder`] only).
    pub fn bytes(&self) -> usize {
        self.scratch.bytes()
    }
}

#[cfg(test)]
mod tests;
