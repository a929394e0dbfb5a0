//! `modelfs status`: the models of a running daemon as a table or JSON.

use std::path::{Path, PathBuf};

use anyhow::{Context, Result};

use modelfs_ome::status::StatusDoc;

#[derive(clap::Args, Debug)]
pub struct StatusArgs {
    /// Print the status document as JSON.
    #[arg(long)]
    json: bool,
    /// HTTP address of the daemon.
    #[arg(long, default_value = "127.0.0.1:8080")]
    listen: String,
    /// Read `<state>/status.json` instead of asking the daemon (works while it is down).
    #[arg(long)]
    state: Option<PathBuf>,
}

pub fn run(args: StatusArgs) -> Result<()> {
    let doc: StatusDoc = match &args.state {
        Some(state) => {
            let path = state.join("status.json");
            let bytes =
                std::fs::read(&path).with_context(|| format!("reading {}", path.display()))?;
            serde_json::from_slice(&bytes).with_context(|| format!("parsing {}", path.display()))?
        }
        None => serde_json::from_slice(&fetch(&args.listen, "/v1/models")?)
            .context("parsing the daemon's /v1/models")?,
    };
    if args.json {
        println!("{}", serde_json::to_string_pretty(&doc)?);
    } else {
        print!("{}", table(&doc));
        // The disk line: from the running daemon, or offline from the state it last saved
        // (an older daemon has neither: no line).
        let line = match &args.state {
            Some(state) => offline_disk_line(state),
            None => fetch(&args.listen, "/v1/disk")
                .and_then(|b| {
                    Ok(serde_json::from_slice::<modelfs_agent::disk::DiskState>(
                        &b,
                    )?)
                })
                .ok()
                .map(|disk| disk.summary()),
        };
        if let Some(line) = line {
            println!("{line}");
        }
    }
    Ok(())
}

/// The `disk:` line from the state directory alone: the disk state the daemon last saved
/// there, with the filesystem measured now (its free bytes move without the daemon). `None`
/// when nothing was saved (no budget, an older daemon) or it cannot be read.
fn offline_disk_line(state: &Path) -> Option<String> {
    use modelfs_agent::disk::{DiskState, FsSpace, DISK_FILE};
    let bytes = std::fs::read(state.join(DISK_FILE)).ok()?;
    let saved: DiskState = serde_json::from_slice(&bytes).ok()?;
    let disk = match FsSpace::of(state) {
        Ok(fs) => saved.with_filesystem(fs),
        Err(_) => saved,
    };
    Some(disk.summary())
}

fn fetch(listen: &str, what: &str) -> Result<Vec<u8>> {
    let _ = rustls::crypto::ring::default_provider().install_default();
    let url = format!("http://{listen}{what}");
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    runtime.block_on(async {
        // The daemon is local: never through HTTP_PROXY (set for downloads, not for this).
        let resp = reqwest::Client::builder()
            .no_proxy()
            .build()?
            .get(&url)
            .send()
            .await
            .with_context(|| format!("asking the daemon at {url} (is it running? --state reads the last status from disk)"))?
            .error_for_status()?;
        Ok(resp.bytes().await?.to_vec())
    })
}

pub fn human_bytes(n: u64) -> String {
    const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut v = n as f64;
    let mut unit = 0;
    while v >= 1024.0 && unit < UNITS.len() - 1 {
        v /= 1024.0;
        unit += 1;
    }
    if unit == 0 {
        format!("{n} B")
    } else {
        format!("{v:.1} {}", UNITS[unit])
    }
}

/// The widest STATUS cell; a longer reason is cut there and printed in full below the table.
const STATUS_WIDTH: usize = 60;

/// The table: key, status (with percent and ETA while downloading), policy, parent, the model
/// as its config describes it (architecture and parameter count, `config?` when the config was
/// missing or unparseable), path, size.
pub fn table(doc: &StatusDoc) -> String {
    let mut rows = vec![[
        "KEY".to_string(),
        "STATUS".into(),
        "POLICY".into(),
        "PARENT".into(),
        "MODEL".into(),
        "PATH".into(),
        "SIZE ON DISK".into(),
    ]];
    let mut reasons = Vec::new();
    for (key, e) in doc {
        let mut status = e.status.clone();
        if let Some(p) = &e.progress {
            if p.total_bytes > 0 {
                let pct = p.completed_bytes as f64 * 100.0 / p.total_bytes as f64;
                status = format!("{status} {pct:.0}%");
                if let Some(eta) = p
                    .total_bytes
                    .saturating_sub(p.completed_bytes)
                    .checked_div(p.speed_bytes_per_sec)
                {
                    status = format!("{status} eta {eta}s");
                }
            }
        }
        if let Some(r) = &e.reason {
            let full = format!("{status}: {r}");
            if full.chars().count() > STATUS_WIDTH {
                // A long reason would widen the whole column: the table shows its start and
                // the full text follows the table.
                let cut: String = full.chars().take(STATUS_WIDTH - 3).collect();
                status = format!("{cut}...");
                reasons.push(format!("{key}: {r}"));
            } else {
                status = full;
            }
        }
        let parent = match e.parent() {
            Some(p) if p == key => "(self)".to_string(),
            Some(p) => p.to_string(),
            None => "-".into(),
        };
        rows.push([
            key.clone(),
            status,
            if e.policy.is_empty() {
                "-".into()
            } else {
                e.policy.clone()
            },
            parent,
            model_column(e),
            if e.path.is_empty() {
                "-".into()
            } else {
                e.path.clone()
            },
            human_bytes(e.bytes_on_disk),
        ]);
    }
    let widths: Vec<usize> = (0..7)
        .map(|c| rows.iter().map(|r| r[c].len()).max().unwrap_or(0))
        .collect();
    let mut out = String::new();
    for r in rows {
        let line: Vec<String> = r
            .iter()
            .enumerate()
            .map(|(i, cell)| {
                if i == 6 {
                    cell.clone()
                } else {
                    format!("{cell:<w$}", w = widths[i])
                }
            })
            .collect();
        out.push_str(line.join("  ").trim_end());
        out.push('\n');
    }
    if !reasons.is_empty() {
        out.push('\n');
        for r in reasons {
            out.push_str(&r);
            out.push('\n');
        }
    }
    out
}

/// The MODEL cell, with the TensorRT-LLM shape the files were chosen for, if any.
fn model_column(e: &modelfs_ome::status::ModelStatus) -> String {
    let model = described_model(e);
    match &e.shape {
        Some(shape) if model == "-" => format!("shape {shape}"),
        Some(shape) => format!("{model} (shape {shape})"),
        None => model,
    }
}

fn described_model(e: &modelfs_ome::status::ModelStatus) -> String {
    let c = &e.config;
    if c.has_derived() {
        let arch = if c.model_architecture.is_empty() {
            c.model_type.as_str()
        } else {
            c.model_architecture.as_str()
        };
        format!("{arch} {}", c.model_parameter_size)
            .trim()
            .to_string()
    } else if e.config_warning.is_some() {
        "config?".into()
    } else {
        "-".into()
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use modelfs_ome::status::ModelStatus;

    use super::*;

    /// Offline, the disk line is the one the daemon prints, from the state it saved, with the
    /// filesystem's numbers measured now instead of the saved ones.
    #[test]
    fn the_offline_disk_line_is_the_saved_state_with_the_filesystem_now() {
        use modelfs_agent::disk::{DiskState, FsSpace, DISK_FILE};
        const MIB: u64 = 1 << 20;
        let dir = tempfile::tempdir().unwrap();
        // Nothing saved (no budget, an older daemon): no line.
        assert_eq!(offline_disk_line(dir.path()), None);
        std::fs::write(dir.path().join(DISK_FILE), b"{not json").unwrap();
        assert_eq!(offline_disk_line(dir.path()), None);

        let saved = DiskState {
            state_dir: dir.path().display().to_string(),
            budget: "1073741824".into(),
            budget_bytes: 1024 * MIB,
            // A filesystem that is not this one: the line must not show it.
            filesystem: FsSpace {
                size: 7 << 40,
                available: 3 << 40,
                used: 4 << 40,
            },
            stores_bytes: 256 * MIB,
            reserved_bytes: 64 * MIB,
            releasable_bytes: 32 * MIB,
            committed_bytes: 0,
            free_bytes: 768 * MIB,
            shortfall_bytes: 5 * MIB,
        };
        std::fs::write(
            dir.path().join(DISK_FILE),
            serde_json::to_vec_pretty(&saved).unwrap(),
        )
        .unwrap();
        let line = offline_disk_line(dir.path()).unwrap();
        let fs = FsSpace::of(dir.path()).unwrap();
        let h = modelfs_agent::reconciler::decide::space::human_bytes;
        // A byte budget leaves what it leaves, as long as the filesystem has it.
        let free = (768 * MIB).min(fs.available);
        assert_eq!(
            line,
            format!(
                "disk: {} free under the budget (1073741824 = 1 GiB); stores use 256 MiB, 64 MiB of it reserved, 32 MiB releasable; filesystem {} available of {}; a refused fetch lacks 5 MiB",
                h(free),
                h(fs.available),
                h(fs.size)
            )
        );
        assert!(!line.contains("7 TiB"), "{line}");
        // The same line a running daemon gives for the same state.
        let live = DiskState {
            filesystem: fs,
            free_bytes: free,
            ..saved.clone()
        };
        assert_eq!(line, live.summary());

        // A share of the filesystem: the budget in bytes follows the filesystem now.
        let share = DiskState {
            budget: "100%".into(),
            ..saved
        };
        std::fs::write(
            dir.path().join(DISK_FILE),
            serde_json::to_vec_pretty(&share).unwrap(),
        )
        .unwrap();
        let line = offline_disk_line(dir.path()).unwrap();
        let fs = FsSpace::of(dir.path()).unwrap();
        assert!(
            line.contains(&format!("(100% = {})", h(fs.usable()))),
            "{line}"
        );
    }

    /// A TensorRT-LLM model's shape is shown in the MODEL column, after what its config
    /// describes (or alone when nothing is derived).
    #[test]
    fn the_shape_is_shown_beside_the_model() {
        let mut doc = StatusDoc::new();
        let mut described = ModelStatus {
            status: "Ready".into(),
            shape: Some("H100".into()),
            ..Default::default()
        };
        described.config.model_architecture = "LlamaForCausalLM".into();
        described.config.model_parameter_size = "8B".into();
        described.config.model_format = Some(modelfs_ome::modelconfig::NameVersion {
            name: "safetensors".into(),
            version: None,
        });
        doc.insert("clusterbasemodel.described".into(), Arc::new(described));
        doc.insert(
            "clusterbasemodel.engines".into(),
            Arc::new(ModelStatus {
                status: "Ready".into(),
                shape: Some("A100-80G".into()),
                ..Default::default()
            }),
        );
        let out = table(&doc);
        let row = |key: &str| {
            out.lines()
                .find(|l| l.starts_with(key))
                .unwrap_or_else(|| panic!("{out}"))
                .to_owned()
        };
        assert!(
            row("clusterbasemodel.described").contains("LlamaForCausalLM 8B (shape H100)"),
            "{out}"
        );
        assert!(
            row("clusterbasemodel.engines").contains("  shape A100-80G  "),
            "{out}"
        );
    }

    #[test]
    fn a_long_reason_is_cut_in_the_table_and_printed_whole_below_it() {
        let reason = format!("source directory /data/{} does not exist", "x".repeat(150));
        let mut doc = StatusDoc::new();
        doc.insert(
            "clusterbasemodel.broken".into(),
            Arc::new(ModelStatus {
                status: "Failed".into(),
                reason: Some(reason.clone()),
                ..Default::default()
            }),
        );
        doc.insert(
            "clusterbasemodel.ok".into(),
            Arc::new(ModelStatus {
                status: "Ready".into(),
                policy: "ReuseIfExists".into(),
                ..Default::default()
            }),
        );
        let out = table(&doc);
        let lines: Vec<&str> = out.lines().collect();
        // Header and two rows, a blank line, then the whole reason.
        assert_eq!(lines.len(), 5, "{out}");
        for row in &lines[..3] {
            assert!(row.len() < 140, "a row as wide as its reason: {row}");
        }
        assert!(lines[1].contains("Failed: source directory"), "{out}");
        assert!(lines[1].contains("..."), "{out}");
        assert_eq!(lines[4], format!("clusterbasemodel.broken: {reason}"));
        // No policy is shown as none, not as a default.
        assert!(lines[1].contains("  -  "), "{out}");
        assert!(lines[2].contains("ReuseIfExists"), "{out}");
    }
}
