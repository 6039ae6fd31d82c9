//! `gpufeed pack` (to be written).

/// Arguments of `gpufeed pack`.
#[derive(clap::Args)]
pub struct Args {}

pub fn run(_args: Args) -> gpufeed::Result<()> {
    Err(gpufeed::Error::user("gpufeed pack is not written yet"))
}
