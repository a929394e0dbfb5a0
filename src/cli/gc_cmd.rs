//! `modelfs gc`: show (or, with the daemon stopped, remove) what garbage collection would take.

use std::collections::HashSet;
use std::path::PathBuf;
use std::time::Duration;

use anyhow::{Context, Result};

use modelfs_agent::reconciler::gc::{self, Usage};
use modelfs_agent::reconciler::records::{ModelPhase, Records};
use modelfs_core::artifact::{ArtifactId, Sha256Digest, StoredArtifact};
use modelfs_core::store::{StateDir, StoreId};
use std::sync::Arc;

#[derive(clap::Args, Debug)]
pub struct GcArgs {
    /// State directory of the daemon.
    #[arg(long)]
    state: PathBuf,
    /// Only print what would be removed.
    #[arg(long)]
    dry_run: bool,
    /// Print the plan as JSON.
    #[arg(long)]
    json: bool,
    /// Partial downloads older than this many seconds count as abandoned.
    #[arg(long, default_value_t = 3600)]
    partial_max_age_secs: u64,
}

/// What the records alone say about use. Stores of models still downloading are treated as
/// being fetched into: their partial files are what a restarted daemon resumes.
struct OfflineUsage<'a>(&'a Records, &'a StateDir);

impl Usage for OfflineUsage<'_> {
    fn store_busy(&self, id: &StoreId) -> bool {
        self.fetching_into(id)
    }

    fn fetching_into(&self, id: &StoreId) -> bool {
        self.0
            .stores()
            .get(id)
            .and_then(|s| s.owner.as_ref())
            .is_some_and(|o| {
                self.0
                    .models()
                    .get(o)
                    .is_some_and(|m| m.phase == ModelPhase::Updating)
            })
    }

    fn blobs_in_use(&self, _id: &StoreId) -> HashSet<Sha256Digest> {
        HashSet::new()
    }

    fn artifact(&self, id: &ArtifactId) -> Option<Arc<StoredArtifact>> {
        self.1.load_artifact(id).ok().map(Arc::new)
    }
}

pub fn run(args: GcArgs) -> Result<()> {
    let state =
        StateDir::open(&args.state).with_context(|| format!("opening {}", args.state.display()))?;
    // Removing needs the daemon stopped; a dry run only reads.
    let _lock = if args.dry_run {
        None
    } else {
        Some(super::lock_state(&args.state).context("stop the daemon first, or use --dry-run")?)
    };
    if !args.dry_run && modelfs_mount::server::running(&args.state) {
        anyhow::bail!(
            "a mount server is serving {} (its open files are not in the records): stop it first, or use --dry-run",
            args.state.display()
        );
    }
    let mut records = Records::load(&state.records_path())?;
    let plan = gc::plan(
        &records,
        &state,
        &OfflineUsage(&records, &state),
        Duration::from_secs(args.partial_max_age_secs),
    );
    if args.json {
        println!("{}", serde_json::to_string_pretty(&plan)?);
    } else {
        for id in &plan.stores {
            println!("store           {id}");
        }
        for d in &plan.orphan_store_dirs {
            println!("orphan store    {d}");
        }
        for (s, b) in &plan.blobs {
            println!("blob            {s}/{b}");
        }
        for p in &plan.partials {
            println!("partial         {}", p.display());
        }
        for a in &plan.artifacts {
            println!("artifact record {a}");
        }
        println!(
            "{} {}",
            if args.dry_run {
                "would free"
            } else {
                "freeing"
            },
            super::status_cmd::human_bytes(plan.bytes)
        );
    }
    if args.dry_run {
        return Ok(());
    }
    for id in &plan.stores {
        records.remove_store(id);
    }
    records.save(&state.records_path())?;
    let errors = gc::execute(&state, &plan);
    for e in &errors {
        eprintln!("could not remove {e}");
    }
    anyhow::ensure!(
        errors.is_empty(),
        "{} items could not be removed",
        errors.len()
    );
    Ok(())
}
