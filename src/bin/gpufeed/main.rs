//! The `gpufeed` command: pack data sets, inspect packed files, measure the loader.

mod bench;
#[cfg(feature = "cuda")]
mod bench_cuda;
mod images;
mod inspect;
mod pack;

use clap::{Parser, Subcommand};

/// Feeds training loops: pack, inspect and benchmark data sets.
#[derive(Parser)]
#[command(name = "gpufeed", version, about)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Write a packed record file from .npy arrays or raw fixed-size records.
    Pack(pack::Args),
    /// Print the header, schema, record count and sizes of a packed file or a .npy file.
    Inspect(inspect::Args),
    /// Measure the loader end to end (on an embedded default data set unless one is named).
    Bench(bench::Args),
}

fn main() -> std::process::ExitCode {
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Pack(args) => pack::run(args),
        Command::Inspect(args) => inspect::run(args),
        Command::Bench(args) => bench::run(args),
    };
    match result {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("gpufeed: error: {e}");
            std::process::ExitCode::FAILURE
        }
    }
}
