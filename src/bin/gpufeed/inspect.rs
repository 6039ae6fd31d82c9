//! `gpufeed inspect` (to be written).

/// Arguments of `gpufeed inspect`.
#[derive(clap::Args)]
pub struct Args {}

pub fn run(_args: Args) -> gpufeed::Result<()> {
    Err(gpufeed::Error::user("gpufeed inspect is not written yet"))
}
