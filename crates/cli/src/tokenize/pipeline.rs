//! Documents in order, tokenized on every worker thread, handed over in order: the inputs'
//! rows are cut into chunks of [`CHUNK_DOCUMENTS`] documents, chunk `c` is read and tokenized
//! by worker `c % workers` (each with its own `Encoder`, reading its rows itself), and the
//! caller takes chunk 0, 1, 2, ... from the workers' channels in turn. Each channel holds
//! [`AHEAD`] chunks, so memory is bounded by `workers * (AHEAD + 1)` chunks whatever the
//! corpus's size, and a worker that is ahead waits for the one the writer needs.

use std::ops::Range;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{Receiver, sync_channel};

use gpufeed::source::TextColumn;
use gpufeed::tokenizer::{Encoder, Tokenizer};
use gpufeed::{Error, Result};

use super::writer::Stored;

/// Documents a worker takes at once: enough that handing a chunk over costs nothing next to
/// tokenizing it, few enough that workers share a small corpus.
pub const CHUNK_DOCUMENTS: u64 = 64;

/// Finished chunks a worker may hold before the writer takes them.
const AHEAD: usize = 2;

/// Documents tokenized together, in order.
pub struct Chunk {
    /// Their tokens, stored (little-endian), back to back.
    pub bytes: Vec<u8>,
    /// Each document's token count (0: a document whose text gives no token).
    pub lengths: Vec<u32>,
    /// Bytes of text read.
    pub text_bytes: u64,
}

/// What the workers do with each document.
pub struct Job<'a> {
    /// Where the documents are.
    pub column: &'a TextColumn,
    /// The rows to tokenize.
    pub rows: Range<u64>,
    /// The tokenizer (opened without an EOS of its own: the job appends it).
    pub tokenizer: &'a Tokenizer,
    /// Appended to every document that has tokens, as Megatron's `--append-eod`.
    pub eos: u32,
    /// How the tokens are stored.
    pub stored: Stored,
}

impl Job<'_> {
    fn chunks(&self) -> u64 {
        (self.rows.end - self.rows.start).div_ceil(CHUNK_DOCUMENTS)
    }

    /// Reads and tokenizes chunk `c`.
    fn chunk(&self, c: u64, encoder: &mut Encoder, ids: &mut Vec<u32>) -> Result<Chunk> {
        let first = self.rows.start + c * CHUNK_DOCUMENTS;
        let rows = first..(first + CHUNK_DOCUMENTS).min(self.rows.end);
        let mut chunk = Chunk {
            bytes: Vec::new(),
            lengths: Vec::with_capacity((rows.end - rows.start) as usize),
            text_bytes: 0,
        };
        for row in rows {
            let text = self.column.text(row)?;
            let text = text.as_str();
            ids.clear();
            encoder
                .encode_into(text, ids)
                .map_err(|e| Error::user(format!("document {row} of the inputs: {}", e)))?;
            // Megatron's rule: the EOD after a document that has tokens; none gives an empty
            // document (no sequence), not one of the EOD alone.
            if !ids.is_empty() {
                ids.push(self.eos);
            }
            self.stored.extend(ids, &mut chunk.bytes);
            chunk.lengths.push(ids.len() as u32);
            chunk.text_bytes += text.len() as u64;
        }
        Ok(chunk)
    }
}

/// Runs `job` on `workers` threads, giving each chunk to `take` in order. The first error
/// (a worker's or `take`'s) stops the workers and is returned.
pub fn run(job: &Job<'_>, workers: usize, mut take: impl FnMut(Chunk) -> Result<()>) -> Result<()> {
    let workers = workers.max(1);
    let chunks = job.chunks();
    let stop = AtomicBool::new(false);
    std::thread::scope(|scope| {
        let mut channels: Vec<Receiver<Result<Chunk>>> = Vec::with_capacity(workers);
        for w in 0..workers {
            let (send, receive) = sync_channel(AHEAD);
            channels.push(receive);
            let stop = &stop;
            std::thread::Builder::new()
                .name(format!("gpufeed-tokenize-{w}"))
                .spawn_scoped(scope, move || {
                    let mut encoder = job.tokenizer.encoder();
                    let mut ids = Vec::new();
                    let mut c = w as u64;
                    while c < chunks && !stop.load(Ordering::Relaxed) {
                        let chunk = job.chunk(c, &mut encoder, &mut ids);
                        let failed = chunk.is_err();
                        // The writer gone (it stopped on an error): nothing more to do.
                        if send.send(chunk).is_err() || failed {
                            break;
                        }
                        c += workers as u64;
                    }
                })
                .map_err(|source| Error::Spawn {
                    setting: "workers",
                    thread: "a tokenizing thread".to_owned(),
                    source,
                })?;
        }
        let mut taken = || -> Result<()> {
            for c in 0..chunks {
                let chunk = channels[(c % workers as u64) as usize]
                    .recv()
                    .map_err(|_| Error::user("a tokenizing thread stopped without a result"))??;
                take(chunk)?;
            }
            Ok(())
        };
        let result = taken();
        if result.is_err() {
            stop.store(true, Ordering::Relaxed);
        }
        // Dropped, the channels free the workers waiting to send.
        drop(channels);
        result
    })
}
