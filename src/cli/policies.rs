//! `kvreplay policies`: list every registered policy with its family, when it
//! acts, its parameters and paper (the listing lives in the registry).

use anyhow::Result;

pub(super) fn cmd_policies() -> Result<()> {
    print!("{}", kvreplay_replay::policies::listing());
    Ok(())
}
