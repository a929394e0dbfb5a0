//! `modelfs probe`: exits non-zero when the modelfs mount at a path does not answer or is not
//! there (the mount server's liveness probe; [`modelfs_mount::probe`]).

use std::path::PathBuf;
use std::time::Duration;

use anyhow::{Context, Result};

#[derive(clap::Args, Debug)]
pub struct ProbeArgs {
    /// The mount to probe (the mount server's --mount).
    #[arg(long)]
    mount: PathBuf,
    /// Seconds the mount has to answer.
    #[arg(long, default_value_t = 5)]
    timeout_secs: u64,
}

pub fn run(args: ProbeArgs) -> Result<()> {
    // Made absolute without resolving it: resolving would ask the mount.
    let mount = std::path::absolute(&args.mount)
        .with_context(|| format!("resolving {}", args.mount.display()))?;
    let report =
        modelfs_mount::probe::probe(&mount, Duration::from_secs(args.timeout_secs.max(1)))?;
    println!(
        "ok: {} answered in {} ms{}",
        mount.display(),
        report.elapsed.as_millis(),
        report
            .entry
            .map(|e| format!(" (looked at {e})"))
            .unwrap_or_default()
    );
    Ok(())
}
