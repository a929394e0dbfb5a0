//! `modelfs crd`: print (or write) the CustomResourceDefinitions of BaseModel and
//! ClusterBaseModel, generated from the manifest types ([`modelfs_ome::crd`]).

use std::io::Write;
use std::path::PathBuf;

use anyhow::{Context, Result};

use modelfs_ome::crd;

#[derive(clap::Args, Debug)]
pub struct CrdArgs {
    /// Write one file per CRD (`ome.io_<plural>.yaml`) into this directory instead of printing
    /// both to stdout.
    #[arg(long)]
    output_dir: Option<PathBuf>,
}

pub fn run(args: CrdArgs) -> Result<()> {
    match args.output_dir {
        Some(dir) => {
            for path in crd::write_files(&dir)? {
                eprintln!("wrote {}", path.display());
            }
        }
        None => {
            let stream = crd::render_all()?;
            std::io::stdout()
                .lock()
                .write_all(stream.as_bytes())
                .context("writing to stdout")?;
        }
    }
    Ok(())
}
