//! The `gpufeed` command: pack data sets, inspect packed files, measure the loader, tokenize
//! text and merge what tokenize wrote in parts.

mod bench;
mod checks;
mod cleanup;
mod images;
mod inspect;
mod merge;
mod messages;
mod open;
mod output;
mod pack;
mod read_mode;
mod tokenize;

use std::io::Write;

use clap::{Parser, Subcommand};
use gpufeed::{Error, Result};

/// Feeds training loops: pack data sets (.npy arrays, raw records, ImageFolder directories of
/// JPEG/PNG images) into packed record files, inspect them, and benchmark the loader.
#[derive(Parser)]
#[command(name = "gpufeed", version, about)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
// Parsed once per run: the size of `bench`'s arguments costs nothing worth a box.
#[allow(clippy::large_enum_variant)]
enum Command {
    /// Write a packed record file from .npy arrays, raw fixed-size records or an ImageFolder
    /// directory (--from npy|raw|imagefolder).
    Pack(pack::Args),
    /// Print the header, schema, record count and sizes of a packed file or a .npy file, the
    /// format, shards, samples and fields of a sharded data set (a directory, a pattern or an
    /// s3:// URL), or the classes and images of an ImageFolder directory.
    Inspect(inspect::Args),
    /// Measure the loader end to end (on an embedded default data set unless one is named),
    /// or the image pipeline (--images DIR|PACKED).
    Bench(Box<bench::Args>),
    /// Tokenize a text field of data sets (Parquet, Arrow, JSON lines, ...) with a
    /// tokenizer.json into Megatron's PREFIX.bin/.idx (or nanoGPT's flat .bin), with the ids
    /// and document boundaries of Megatron's preprocess_data.py --append-eod.
    Tokenize(tokenize::Args),
    /// Join Megatron datasets (PREFIX.bin/.idx; with --format nanogpt, flat .bin files) in
    /// order into one, as Megatron's merge_datasets.py does: the parts of `tokenize --part`
    /// merge into the files of a single run, byte for byte.
    Merge(merge::Args),
}

/// Writes `text` and a newline to standard output. A closed pipe (`gpufeed ... | head -1`)
/// is an error that `main` ends the command on quietly, after the usual cleanup.
pub fn out(text: impl std::fmt::Display) -> Result<()> {
    let mut stdout = std::io::stdout().lock();
    writeln!(stdout, "{text}")
        .and_then(|()| stdout.flush())
        .map_err(|source| Error::Io {
            path: "standard output".into(),
            op: "write",
            source,
        })
}

/// True for the error [`out`] returns when the reader of standard output has gone.
fn is_closed_stdout(e: &Error) -> bool {
    matches!(e, Error::Io { op: "write", source, path }
        if source.kind() == std::io::ErrorKind::BrokenPipe && path.as_os_str() == "standard output")
}

fn main() -> std::process::ExitCode {
    if let Err(e) = cleanup::install() {
        let _ = writeln!(std::io::stderr(), "gpufeed: warning: {e}");
    }
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Pack(args) => pack::run(args),
        Command::Inspect(args) => inspect::run(args),
        Command::Bench(args) => bench::run(*args),
        Command::Tokenize(args) => tokenize::run(args),
        Command::Merge(args) => merge::run(args),
    };
    // A signal is ending the process: what the run returned (an error about a temporary file
    // the cleanup removed under it, say) is the cleanup's doing, not the run's; the signal
    // thread ends the process of its signal once everything is removed.
    if cleanup::dying() {
        cleanup::wait_for_the_signal();
    }
    let code = match result {
        Ok(()) => std::process::ExitCode::SUCCESS,
        // As Unix tools do when the reader stops reading: quietly.
        Err(e) if is_closed_stdout(&e) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            let _ = writeln!(
                std::io::stderr(),
                "gpufeed: error: {}",
                messages::describe(&e)
            );
            std::process::ExitCode::FAILURE
        }
    };
    // A run stopped by Ctrl-C has said what it did: now the signal ends the process.
    if cleanup::interrupted() {
        cleanup::end_interrupted();
    }
    code
}
