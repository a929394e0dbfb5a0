//! `modelfs-hub`: a Hugging Face-compatible hub on loopback, for tests and benchmarks only
//! (see `modelfs_devhub::hf`). Not shipped to nodes.
//!
//! ```text
//! modelfs-hub --repo org/name[@ref1,ref2]=DIR [--repo ...] [--gated org/name] [--page-size N]
//!             [--cdn 127.0.0.2:0] [--listen 127.0.0.1:0] [--fault JSON ...] [--ignore-range]
//!             [--rate-bytes-per-sec N]
//! ```
//! Prints `listening http://ADDR` on stdout once it serves. The token of a gated repository is
//! read from env `MODELFS_HUB_TOKEN`.
//!
//! Hostile mode: each `--fault` installs a fault rule at start (the JSON of
//! `modelfs_devhub::hf::Fault`, as `POST /_hub/faults` takes), for example a listing whose
//! pagination never ends, a revision request that never answers, or a 5xx whose body never
//! comes; `--ignore-range` makes it a server that ignores `Range`:
//!
//! ```text
//! --fault '{"kind":"endless_pages","count":1000000,"target":"api","path":"/tree/"}'
//! --fault '{"kind":"stall_headers","secs":3600,"count":1000000,"target":"api","path":"org/slow/"}'
//! --fault '{"kind":"status_stalled_body","status":503,"secs":3600,"count":5}'
//! ```

#![forbid(unsafe_code)]

use std::net::SocketAddr;
use std::path::PathBuf;

use anyhow::{bail, Context, Result};
use clap::Parser;
use modelfs_devhub::hf::{files_from_dir, Fault, Hub, HubConfig};

#[derive(Parser)]
#[command(
    name = "modelfs-hub",
    about = "Loopback Hugging Face hub for tests (development only)"
)]
struct Args {
    /// Address to serve on; port 0 picks one.
    #[arg(long, default_value = "127.0.0.1:0")]
    listen: SocketAddr,
    /// Second address for LFS downloads (the hub redirects LFS files there, like its CDN).
    #[arg(long)]
    cdn: Option<SocketAddr>,
    /// `org/name[@ref,ref]=DIR`: a repository whose commit holds the files of DIR; refs
    /// default to `main`. Repeat for several repositories or revisions.
    #[arg(long = "repo", required = true)]
    repos: Vec<String>,
    /// Repositories that need `Authorization: Bearer $MODELFS_HUB_TOKEN`.
    #[arg(long)]
    gated: Vec<String>,
    /// Tree entries per page.
    #[arg(long, default_value_t = HubConfig::default().page_size)]
    page_size: usize,
    /// Files at least this large are LFS files (weights extensions always are).
    #[arg(long, default_value_t = 1 << 20)]
    lfs_threshold: u64,
    /// A fault rule (JSON, as `POST /_hub/faults` takes one): hostile mode. Repeatable.
    #[arg(long = "fault")]
    faults: Vec<String>,
    /// Ignore `Range` headers: every file request gets the whole file (hostile mode).
    #[arg(long)]
    ignore_range: bool,
    /// Send all file bodies together at most this fast, in bytes per second (0: no limit):
    /// a link of fixed bandwidth, for benchmarks.
    #[arg(long, default_value_t = 0)]
    rate_bytes_per_sec: u64,
}

fn main() -> Result<()> {
    let args = Args::parse();
    if !args.listen.ip().is_loopback() || args.cdn.is_some_and(|c| !c.ip().is_loopback()) {
        bail!("modelfs-hub serves on loopback addresses only");
    }
    let hub = Hub::new(HubConfig {
        page_size: args.page_size,
        rate_bytes_per_sec: args.rate_bytes_per_sec,
        ..HubConfig::default()
    });
    for spec in &args.repos {
        let Some((name, dir)) = spec.split_once('=') else {
            bail!("--repo {spec}: expected org/name[@ref]=DIR");
        };
        let (repo, refs) = match name.split_once('@') {
            Some((r, refs)) => (r, refs.split(',').collect::<Vec<_>>()),
            None => (name, vec!["main"]),
        };
        let files = files_from_dir(&PathBuf::from(dir), args.lfs_threshold)
            .with_context(|| format!("reading {dir}"))?;
        let sha = hub.add_commit(repo, &refs, files);
        eprintln!("repo {repo} refs {refs:?} commit {sha}");
    }
    if !args.gated.is_empty() {
        let token = std::env::var("MODELFS_HUB_TOKEN")
            .context("--gated needs the token in env MODELFS_HUB_TOKEN")?;
        for repo in &args.gated {
            hub.set_gated(repo, &token);
        }
    }
    for f in &args.faults {
        let fault: Fault = serde_json::from_str(f).with_context(|| format!("--fault {f}"))?;
        hub.add_fault(fault);
    }
    hub.set_ignore_range(args.ignore_range);
    let runtime = tokio::runtime::Runtime::new()?;
    runtime.block_on(async {
        let running = hub.serve(args.listen, args.cdn).await?;
        println!("listening {}", running.url());
        use std::io::Write;
        std::io::stdout().flush()?;
        tokio::signal::ctrl_c().await?;
        drop(running);
        Ok(())
    })
}
