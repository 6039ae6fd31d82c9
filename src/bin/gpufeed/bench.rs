//! `gpufeed bench` (to be written).

/// Arguments of `gpufeed bench`.
#[derive(clap::Args)]
pub struct Args {}

pub fn run(_args: Args) -> gpufeed::Result<()> {
    Err(gpufeed::Error::user("gpufeed bench is not written yet"))
}
