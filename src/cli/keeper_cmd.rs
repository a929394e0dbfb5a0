//! `modelfs keeper` (holds each mount's FUSE connection across mount server restarts, see
//! `modelfs_mount::takeover`) and `modelfs unmount` (the explicit end of a mount).

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::{Context, Result};

/// The keeper's default socket for a state directory.
pub fn default_keeper_socket(state: &Path) -> PathBuf {
    modelfs_mount::server::own_dir(state).join("keeper.sock")
}

#[derive(clap::Args, Debug)]
pub struct KeeperArgs {
    /// Unix socket mount servers deposit their sessions at and take them from.
    #[arg(long)]
    socket: PathBuf,
    /// Exit once no session is held any more (the keeper `modelfs serve` starts by itself).
    #[arg(long)]
    exit_when_empty: bool,
    /// Run in the background: start the keeper as a process of its own session (not a child
    /// of the caller: `modelfs serve` starts it so) and return at once.
    #[arg(long)]
    detach: bool,
    /// Set internally by `--detach`: the background keeper itself.
    #[arg(long, hide = true)]
    new_session: bool,
}

pub fn run_keeper(args: KeeperArgs) -> Result<()> {
    let socket = super::absolute(&args.socket)?;
    if args.detach {
        let mut cmd =
            std::process::Command::new(std::env::current_exe().context("finding the binary")?);
        cmd.arg("keeper")
            .arg("--socket")
            .arg(&socket)
            .arg("--new-session");
        if args.exit_when_empty {
            cmd.arg("--exit-when-empty");
        }
        // This process exits now: the keeper is reparented, a child of nobody who may kill it.
        cmd.spawn().context("starting the keeper")?;
        return Ok(());
    }
    modelfs_mount::takeover::run_keeper(modelfs_mount::takeover::KeeperConfig {
        socket,
        exit_when_empty: args.exit_when_empty,
        detach: args.new_session,
    })
}

/// Starts a detached keeper at `socket` unless one answers there; waits until it does.
pub fn ensure_keeper(socket: &Path) -> Result<()> {
    if modelfs_mount::takeover::keeper_running(socket) {
        return Ok(());
    }
    let log_path = socket.with_extension("log");
    if let Some(dir) = socket.parent() {
        std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    }
    let log = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(&log_path)
        .with_context(|| format!("opening {}", log_path.display()))?;
    let exe = std::env::current_exe().context("finding the modelfs binary")?;
    let status = std::process::Command::new(exe)
        .arg("keeper")
        .arg("--socket")
        .arg(socket)
        .arg("--exit-when-empty")
        .arg("--detach")
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::null())
        .stderr(log)
        .status()
        .context("starting the keeper")?;
    if !status.success() {
        anyhow::bail!(
            "starting the keeper failed ({status}; see {})",
            log_path.display()
        );
    }
    let deadline = Instant::now() + Duration::from_secs(10);
    while Instant::now() < deadline {
        if modelfs_mount::takeover::keeper_running(socket) {
            tracing::info!(socket = %socket.display(), log = %log_path.display(), "started a keeper");
            return Ok(());
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    anyhow::bail!(
        "the keeper did not answer on {} within 10 s (see {})",
        socket.display(),
        log_path.display()
    )
}

#[derive(clap::Args, Debug)]
pub struct UnmountArgs {
    /// The mount to end.
    #[arg(long)]
    mount: PathBuf,
    /// The state directory of its mount server (for the default keeper socket).
    #[arg(long)]
    state: Option<PathBuf>,
    /// The keeper's socket. Default: <state>/mount-server/keeper.sock.
    #[arg(long)]
    keeper_socket: Option<PathBuf>,
}

/// Ends a mount: the keeper drops its copy of the connection and tells the serving mount
/// server to unmount and exit; if nobody serves, the mount is removed here.
pub fn run_unmount(args: UnmountArgs) -> Result<()> {
    let mount = super::absolute(&args.mount)?;
    let keeper = match (&args.keeper_socket, &args.state) {
        (Some(k), _) => Some(super::absolute(k)?),
        (None, Some(state)) => Some(default_keeper_socket(&super::absolute(state)?)),
        (None, None) => None,
    };
    use modelfs_mount::takeover::Released;
    let mut stopping = false;
    if let Some(keeper) = &keeper {
        match modelfs_mount::takeover::release(keeper, &mount) {
            Ok(Released::HolderStopping) => {
                tracing::info!("the keeper released the session; its mount server unmounts");
                stopping = true;
            }
            Ok(Released::Dropped) => tracing::info!("the keeper released the session"),
            Ok(Released::Nothing) => {
                tracing::info!("the keeper held no session for this mount")
            }
            Err(e) => tracing::warn!(error = %e, "the keeper did not answer"),
        }
    }
    // A serving mount server unmounts by itself; wait for it, then remove what is left.
    let deadline = Instant::now() + Duration::from_secs(5);
    while stopping
        && Instant::now() < deadline
        && modelfs_mount::fuse::mount_info_dev(&mount).is_some()
    {
        std::thread::sleep(Duration::from_millis(20));
    }
    let mut removed = 0;
    while modelfs_mount::fuse::mount_info_dev(&mount).is_some() && removed < 16 {
        modelfs_mount::takeover::detach_mount(&mount)
            .with_context(|| format!("unmounting {}", mount.display()))?;
        removed += 1;
    }
    println!("unmounted {}", mount.display());
    Ok(())
}
