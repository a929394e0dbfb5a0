//! `modelfs-oci-dev`: an OCI Object Storage look-alike on loopback, for tests and benchmarks
//! only (see `modelfs_devhub::oci`). Not shipped to nodes.
//!
//! ```text
//! modelfs-oci-dev --bucket NS/BUCKET[/PREFIX]=DIR [--bucket ...] --key KEYID=PUBLIC.pem [--key ...]
//!                 [--page-size N] [--multipart-threshold BYTES] [--listen 127.0.0.1:0]
//!                 [--fault JSON ...]
//! ```
//! Every file below DIR becomes object `PREFIX/<relative path>`. `--key` accepts signatures by
//! `KEYID` (`<tenancy>/<user>/<fingerprint>`) made with the private half of the PEM public key.
//! Prints `listening http://ADDR` on stdout once it serves. Faults are the hub look-alike's
//! JSON rules (`POST /_oci/faults` takes a list); `GET /_oci/stats` reports counters.

#![forbid(unsafe_code)]

use std::net::SocketAddr;
use std::path::PathBuf;

use anyhow::{bail, Context, Result};
use clap::Parser;
use modelfs_agent::source::oci::sign::rsa_public_key_from_pem;
use modelfs_devhub::hf::Fault;
use modelfs_devhub::oci::{OciDev, OciDevConfig};

#[derive(Parser)]
#[command(
    name = "modelfs-oci-dev",
    about = "Loopback OCI Object Storage look-alike for tests (development only)"
)]
struct Args {
    /// Address to serve on; port 0 picks one.
    #[arg(long, default_value = "127.0.0.1:0")]
    listen: SocketAddr,
    /// `NS/BUCKET[/PREFIX]=DIR`: the files of DIR as objects. Repeatable.
    #[arg(long = "bucket")]
    buckets: Vec<String>,
    /// `KEYID=PUBLIC.pem`: an API key whose signatures are accepted. Repeatable.
    #[arg(long = "key", required = true)]
    keys: Vec<String>,
    /// Objects per listing page.
    #[arg(long, default_value_t = OciDevConfig::default().page_size)]
    page_size: usize,
    /// Files at least this large are served as multipart uploads (with `opc-meta-md5`).
    #[arg(long)]
    multipart_threshold: Option<u64>,
    /// A fault rule (JSON): hostile mode. Repeatable.
    #[arg(long = "fault")]
    faults: Vec<String>,
}

fn main() -> Result<()> {
    let args = Args::parse();
    if !args.listen.ip().is_loopback() {
        bail!("modelfs-oci-dev serves on loopback addresses only");
    }
    let server = OciDev::new(OciDevConfig {
        page_size: args.page_size,
        ..OciDevConfig::default()
    });
    for spec in &args.buckets {
        let Some((target, dir)) = spec.split_once('=') else {
            bail!("--bucket {spec}: expected NS/BUCKET[/PREFIX]=DIR");
        };
        let mut parts = target.splitn(3, '/');
        let (Some(ns), Some(bucket)) = (parts.next(), parts.next()) else {
            bail!("--bucket {spec}: expected NS/BUCKET[/PREFIX]=DIR");
        };
        let prefix = parts.next().unwrap_or("");
        server.create_bucket(ns, bucket);
        let n = server
            .put_dir(
                ns,
                bucket,
                prefix,
                &PathBuf::from(dir),
                args.multipart_threshold,
            )
            .with_context(|| format!("reading {dir}"))?;
        eprintln!("bucket {ns}/{bucket}: {n} objects under {prefix:?}");
    }
    for spec in &args.keys {
        let Some((key_id, path)) = spec.rsplit_once('=') else {
            bail!("--key {spec}: expected KEYID=PUBLIC.pem");
        };
        let pem = std::fs::read_to_string(path).with_context(|| format!("reading {path}"))?;
        let der = rsa_public_key_from_pem(&pem).with_context(|| format!("--key {path}"))?;
        server.add_key(key_id, der);
    }
    for f in &args.faults {
        let fault: Fault = serde_json::from_str(f).with_context(|| format!("--fault {f}"))?;
        server.add_fault(fault);
    }
    let runtime = tokio::runtime::Runtime::new()?;
    runtime.block_on(async {
        let running = server.serve(args.listen).await?;
        println!("listening {}", running.url());
        use std::io::Write;
        std::io::stdout().flush()?;
        tokio::signal::ctrl_c().await?;
        drop(running);
        Ok(())
    })
}
