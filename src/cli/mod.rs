//! The command line: `modelfs serve`, `agent`, `mount-server`, `keeper`, `unmount`, `status`,
//! `probe`, `gc` and `crd`. This is the binary's edge, the only place that uses `anyhow`.

mod crd_cmd;
mod gc_cmd;
mod keeper_cmd;
mod probe_cmd;
mod status_cmd;

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use anyhow::{bail, Context, Result};
use clap::{Parser, Subcommand};

use modelfs_agent::http::HttpState;
use modelfs_agent::metrics::Metrics;
use modelfs_agent::reconciler::{MountSink, Reconciler, ReconcilerConfig};
use modelfs_agent::source::hf::{DownloadTuning, HfConfig};
use modelfs_agent::source::proxy::{Proxies, ProxyUrl};
use modelfs_agent::source::{SourceConfig, Token};
use modelfs_agent::standalone::ModelsDirConfig;
use modelfs_core::store::StateDir;
use modelfs_mount::fuse::{FuseConfig, FuseTransport, PassthroughMode};
use modelfs_mount::vfs::FsCore;

#[derive(Parser, Debug)]
#[command(
    name = "modelfs",
    version,
    about = "Serve ML model files through a read-only FUSE mount"
)]
pub struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Mount and serve models: the mount server, running `modelfs agent` (same arguments) as
    /// its supervised child.
    Serve(Box<ServeArgs>),
    /// The agent alone: reconciler, sources, Kubernetes, HTTP; tells a running mount server
    /// (`--mount-socket`) what to serve. Takes the arguments of `serve`.
    Agent(Box<ServeArgs>),
    /// The mount server alone (Kubernetes runs it apart from the agent): FUSE mount, mapping,
    /// open files; serves its persisted mapping until an agent connects.
    MountServer(MountServerArgs),
    /// Hold each mount's FUSE connection across mount server restarts and upgrades (run it
    /// apart from the mount server; `serve` starts one by itself).
    Keeper(keeper_cmd::KeeperArgs),
    /// End a mount for good: the keeper drops it and its mount server unmounts and exits.
    Unmount(keeper_cmd::UnmountArgs),
    /// Print the models of a running daemon.
    Status(status_cmd::StatusArgs),
    /// Exit non-zero unless the modelfs mount at --mount answers within the timeout (a
    /// liveness probe: an unmounted, aborted or hung mount fails it).
    Probe(probe_cmd::ProbeArgs),
    /// Show (--dry-run) or remove garbage in a state directory while the daemon is stopped.
    Gc(gc_cmd::GcArgs),
    /// Print the BaseModel and ClusterBaseModel CustomResourceDefinitions (for clusters
    /// without OME, which installs its own).
    Crd(crd_cmd::CrdArgs),
}

#[derive(clap::Args, Debug)]
pub struct ServeArgs {
    /// Where the read-only FUSE mount is created.
    #[arg(long)]
    mount: PathBuf,
    /// Stores and durable records. Default: `.modelfs-<name>` beside the mount directory
    /// (`/raid/models` -> `/raid/.modelfs-models`): on the models root's filesystem, so the
    /// blobs land on the large disk and adopting an old agent's files is a hard link. Never
    /// below the mount.
    #[arg(long)]
    state: Option<PathBuf>,
    /// What the stores may use: a size (`500G`, `2TiB`: decimal or binary units) in all, or a
    /// percentage of the state directory's filesystem (`90%`; of used plus available bytes)
    /// that it may be filled to, by anyone. A fetch that does not fit is not started: the model says
    /// `InsufficientStorage` and starts by itself when space appears.
    #[arg(long, default_value = "90%")]
    disk_budget: modelfs_agent::disk::DiskBudget,
    /// Directory of YAML files with BaseModel / ClusterBaseModel objects. Required in
    /// standalone mode (without --kube).
    #[arg(long, required_unless_present = "kube", conflicts_with = "kube")]
    models: Option<PathBuf>,
    /// Kubernetes mode: watch BaseModels and ClusterBaseModels through the API server
    /// (in-cluster credentials, or $KUBECONFIG) and report status as OME's model agent does.
    #[arg(long, requires = "node_name")]
    kube: bool,
    /// Name of this node (Kubernetes mode).
    #[arg(long, env = "NODE_NAME")]
    node_name: Option<String>,
    /// Namespace of the node status ConfigMaps and of ClusterBaseModels' token Secrets.
    #[arg(long, default_value = "ome")]
    namespace: String,
    /// Kubernetes mode: serve `local://` sources. Off by default, because they let anyone who
    /// may create a BaseModel read files of the node.
    #[arg(long)]
    allow_local_sources: bool,
    /// Kubernetes mode: seconds between node ConfigMap writes that only update download
    /// progress (OME's agent writes every 30 s; each write wakes OME's controllers).
    #[arg(long, default_value_t = modelfs_agent::kubernetes::status_sink::DEFAULT_PROGRESS_INTERVAL.as_secs())]
    progress_interval_secs: u64,
    /// HTTP address for probes, metrics and status. Port 0: one the system picks (see
    /// --listen-addr-file).
    #[arg(long, default_value = "127.0.0.1:8080")]
    listen: SocketAddr,
    /// Once the HTTP endpoint listens, write its address (`IP:PORT` and a newline) to this
    /// file, replacing it whole (a reader sees the previous content or the new one, never a
    /// part). How a supervisor or test learns the port the system picked for `--listen` with
    /// port 0. Under `serve` the agent writes it at each start: with port 0 an agent that was
    /// restarted may listen on another port.
    #[arg(long)]
    listen_addr_file: Option<PathBuf>,
    /// Host directory the mount sits on; absolute `spec.storage.path`s must lie below it.
    /// Defaults to --mount.
    #[arg(long)]
    models_root_dir: Option<PathBuf>,
    /// How file data is served.
    #[arg(long, value_enum, default_value = "auto")]
    passthrough: PassthroughArg,
    /// Seconds a store with no users stays on disk before it is removed.
    #[arg(long, default_value_t = 300)]
    gc_grace_secs: u64,
    /// Directory of the Hugging Face cache view, relative to the mount; empty for no view.
    /// With HF_HUB_CACHE=<mount>/<dir> HF_HUB_OFFLINE=1, Hugging Face libraries resolve the
    /// ids of Ready hf:// models from the mount. No model path may lie in it.
    #[arg(long, default_value = modelfs_mount::vfs::hf_cache::DEFAULT_DIR)]
    hf_cache_dir: String,
    /// Seconds a snapshot stays in the Hugging Face cache view after no model serves it (for
    /// readers that resolved it just before a change).
    #[arg(long, default_value_t = 300)]
    hf_cache_linger_secs: u64,
    /// Seconds between re-resolves of Ready models whose source can change under the same URI
    /// (s3://, gs://, az://, oci:// prefixes; hf:// branches and tags): a changed object or a
    /// moved branch becomes a new artifact, fetched and flipped to per the model's policy.
    /// The `config.json` of a `local://` model outside the models root (read in place, not
    /// served) is parsed again at the same interval.
    /// 0 (the default, as OME's agent): a source is read only when the model object changes.
    #[arg(long, default_value_t = 0)]
    resolve_interval_secs: u64,
    /// Standalone mode: show a model only once every file verified, instead of its listing at
    /// once with each file readable as it verifies.
    #[arg(long)]
    no_serve_while_downloading: bool,
    /// FUSE worker threads (with io_uring: the ring threads, spread over one queue per CPU).
    #[arg(long, default_value_t = FuseConfig::default().threads)]
    fuse_threads: usize,
    /// How long an open of a file that has not verified yet (a model served while it
    /// downloads) waits before it fails with ETIMEDOUT.
    #[arg(long, default_value_t = FuseConfig::default().pending_wait.as_secs())]
    pending_open_timeout_secs: u64,
    /// How FUSE requests reach the daemon: io_uring per-CPU queues when the kernel offers them
    /// (`auto`: Linux >= 6.14 with the fuse module parameter enable_uring=1), or /dev/fuse.
    #[arg(long, value_enum, default_value = "auto")]
    fuse_transport: TransportArg,
    /// The keeper's socket (it holds the FUSE connection while the mount server restarts).
    /// Default: <state>/mount-server/keeper.sock.
    #[arg(long)]
    keeper_socket: Option<PathBuf>,
    /// No keeper: the mount ends with this process.
    #[arg(long)]
    no_keeper: bool,
    /// Node-wide limit on concurrent fetches.
    #[arg(long, default_value_t = modelfs_agent::reconciler::DEFAULT_MAX_CONCURRENT_FETCHES)]
    max_concurrent_fetches: usize,
    /// Log lines as JSON.
    #[arg(long)]
    log_json: bool,
    /// Unix socket between the agent and the mount server (0600; a missing directory is created
    /// 0700, an existing one keeps its mode; anything at the path but a stale socket is refused).
    /// Default: <state>/mount-server/agent.sock.
    #[arg(long)]
    mount_socket: Option<PathBuf>,
    /// Seconds the mount server may be unreachable before the agent stops reporting its
    /// models Ready: they turn Updating (OME schedules no new pods to the node, running pods
    /// stay), and Ready again once a server is back and has confirmed the mapping.
    #[arg(long, default_value_t = modelfs_agent::mount_client::DEFAULT_GRACE.as_secs())]
    mount_server_grace_secs: u64,
    #[command(flatten)]
    hf: HfArgs,
    #[command(flatten)]
    proxy: ProxyArgs,
}

impl ServeArgs {
    /// `--state`, or its default beside the mount directory (absolute either way).
    fn state_dir(&self) -> Result<PathBuf> {
        if let Some(s) = &self.state {
            return absolute(s);
        }
        let mount = absolute(&self.mount)?;
        let mount = mount.components().collect::<PathBuf>();
        modelfs_agent::disk::default_state_dir(&mount).with_context(|| {
            format!(
                "--mount {} has no parent directory to keep the state beside it: give --state",
                mount.display()
            )
        })
    }
}

/// Per-source proxies (see `source::proxy`): each replaces HTTP_PROXY / HTTPS_PROXY /
/// ALL_PROXY for its source; NO_PROXY still applies. Credentials in the URL are never logged.
/// The values are parsed after clap, not by a clap value parser: clap quotes a rejected value
/// in its error, and these may hold a password.
#[derive(clap::Args)]
struct ProxyArgs {
    /// Proxy for hf:// downloads (for example a Dragonfly dfdaemon: http://127.0.0.1:4001).
    #[arg(long, env = "MODELFS_PROXY_HF", hide_env_values = true)]
    proxy_hf: Option<String>,
    /// Proxy for s3:// downloads.
    #[arg(long, env = "MODELFS_PROXY_S3", hide_env_values = true)]
    proxy_s3: Option<String>,
    /// Proxy for gs:// downloads.
    #[arg(long, env = "MODELFS_PROXY_GS", hide_env_values = true)]
    proxy_gs: Option<String>,
    /// Proxy for az:// downloads.
    #[arg(long, env = "MODELFS_PROXY_AZ", hide_env_values = true)]
    proxy_az: Option<String>,
    /// Proxy for oci:// downloads.
    #[arg(long, env = "MODELFS_PROXY_OCI", hide_env_values = true)]
    proxy_oci: Option<String>,
    /// A file holding the proxy password (a mounted Secret; one trailing newline is ignored),
    /// for every --proxy-<scheme> URL that names a user without a password
    /// (http://user@proxy:3128): a password on the command line shows in `ps`.
    #[arg(long, env = "MODELFS_PROXY_PASSWORD_FILE")]
    proxy_password_file: Option<PathBuf>,
}

impl ProxyArgs {
    fn proxies(&self) -> Result<Proxies> {
        let parse = |flag: &str, value: &Option<String>| -> Result<Option<ProxyUrl>> {
            value
                .as_deref()
                .map(|v| ProxyUrl::parse(v).map_err(|e| anyhow::anyhow!("--{flag}: {e}")))
                .transpose()
        };
        let proxies = Proxies {
            hf: parse("proxy-hf", &self.proxy_hf)?,
            s3: parse("proxy-s3", &self.proxy_s3)?,
            gs: parse("proxy-gs", &self.proxy_gs)?,
            az: parse("proxy-az", &self.proxy_az)?,
            oci: parse("proxy-oci", &self.proxy_oci)?,
        };
        let Some(path) = &self.proxy_password_file else {
            return Ok(proxies);
        };
        let text = std::fs::read_to_string(path)
            .map_err(|e| anyhow::anyhow!("--proxy-password-file {}: {e}", path.display()))?;
        let password = text
            .strip_suffix('\n')
            .map(|t| t.strip_suffix('\r').unwrap_or(t))
            .unwrap_or(&text);
        if password.is_empty() {
            anyhow::bail!(
                "--proxy-password-file {}: the file is empty",
                path.display()
            );
        }
        proxies
            .with_password(password)
            .map_err(|e| anyhow::anyhow!("--proxy-password-file {}: {e}", path.display()))
    }
}

/// Says which flags are set, never their values (they may hold credentials).
impl std::fmt::Debug for ProxyArgs {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let set = |v: &Option<String>| v.as_ref().map(|_| "<set>");
        f.debug_struct("ProxyArgs")
            .field("proxy_hf", &set(&self.proxy_hf))
            .field("proxy_s3", &set(&self.proxy_s3))
            .field("proxy_gs", &set(&self.proxy_gs))
            .field("proxy_az", &set(&self.proxy_az))
            .field("proxy_oci", &set(&self.proxy_oci))
            .field("proxy_password_file", &self.proxy_password_file)
            .finish()
    }
}

#[derive(clap::Args, Debug)]
pub struct MountServerArgs {
    /// Where the read-only FUSE mount is created.
    #[arg(long)]
    mount: PathBuf,
    /// The state directory shared with the agent (stores; the server's own files go to
    /// <state>/mount-server).
    #[arg(long)]
    state: PathBuf,
    /// Unix socket the agent connects to. Default: <state>/mount-server/agent.sock.
    #[arg(long)]
    mount_socket: Option<PathBuf>,
    /// How file data is served.
    #[arg(long, value_enum, default_value = "auto")]
    passthrough: PassthroughArg,
    /// FUSE worker threads (with io_uring: the ring threads, spread over one queue per CPU).
    #[arg(long, default_value_t = FuseConfig::default().threads)]
    fuse_threads: usize,
    /// How long an open of a file that has not verified yet (a model served while it
    /// downloads) waits before it fails with ETIMEDOUT.
    #[arg(long, default_value_t = FuseConfig::default().pending_wait.as_secs())]
    pending_open_timeout_secs: u64,
    /// How FUSE requests reach the daemon: io_uring per-CPU queues when the kernel offers them
    /// (`auto`: Linux >= 6.14 with the fuse module parameter enable_uring=1), or /dev/fuse.
    #[arg(long, value_enum, default_value = "auto")]
    fuse_transport: TransportArg,
    /// The keeper's socket (it holds the FUSE connection while the mount server restarts).
    /// Default: <state>/mount-server/keeper.sock.
    #[arg(long)]
    keeper_socket: Option<PathBuf>,
    /// No keeper: the mount ends with this process.
    #[arg(long)]
    no_keeper: bool,
    /// Log lines as JSON.
    #[arg(long)]
    log_json: bool,
}

/// Hugging Face source settings. The default token comes from the environment (`HF_TOKEN`)
/// only, never from a flag, so it does not show in the process list.
#[derive(clap::Args, Debug)]
struct HfArgs {
    /// Hugging Face endpoint [env: HF_ENDPOINT, else ENDPOINT (OME's agent's variable), else
    /// https://huggingface.co].
    #[arg(long, env = "HF_ENDPOINT")]
    hf_endpoint: Option<String>,
    /// Files of one model downloaded at once.
    #[arg(long, default_value_t = DownloadTuning::default().max_files)]
    hf_max_files: usize,
    /// Parallel range requests per large file.
    #[arg(long, default_value_t = DownloadTuning::default().range_streams)]
    hf_range_streams: usize,
    /// Size of one range request, MiB.
    #[arg(long, default_value_t = DownloadTuning::default().chunk_size >> 20)]
    hf_chunk_mib: u64,
    /// Node-wide budget of downloaded range data held in memory before it is written, MiB,
    /// all sources and models together.
    #[arg(long, default_value_t = DownloadTuning::default().buffer_bytes >> 20)]
    hf_download_buffer_mib: u64,
    /// Slowest accepted transfer of a data range, KiB/s (after a grace of the stall timeout);
    /// a slower range is aborted and asked again. 0: no minimum.
    #[arg(long, default_value_t = DownloadTuning::default().min_range_bytes_per_sec >> 10)]
    hf_min_range_kib_per_sec: u64,
    /// Node-wide limit on concurrent HTTP transfers.
    #[arg(long, default_value_t = DownloadTuning::default().max_transfers)]
    hf_max_transfers: usize,
    /// Seconds without response headers or without a body byte before any request to the hub
    /// is aborted and retried.
    #[arg(long, default_value_t = DownloadTuning::default().stall_timeout.as_secs())]
    hf_stall_timeout_secs: u64,
    /// Seconds to establish a connection to the hub.
    #[arg(long, default_value_t = DownloadTuning::default().connect_timeout.as_secs())]
    hf_connect_timeout_secs: u64,
    /// Seconds one metadata request (revision, one listing page) may take altogether.
    #[arg(long, default_value_t = DownloadTuning::default().request_timeout.as_secs())]
    hf_request_timeout_secs: u64,
    /// Pages of one file listing followed before the model fails.
    #[arg(long, default_value_t = DownloadTuning::default().max_listing_pages)]
    hf_max_listing_pages: usize,
    /// Entries (files and directories) of one file listing before the model fails.
    #[arg(long, default_value_t = DownloadTuning::default().max_listing_entries)]
    hf_max_listing_entries: usize,
    /// Attempts per request before the download fails (and is retried later).
    #[arg(long, default_value_t = DownloadTuning::default().max_attempts)]
    hf_max_attempts: u32,
    /// First retry delay, milliseconds (doubles per attempt, jittered).
    #[arg(long, default_value_t = DownloadTuning::default().retry_base.as_millis() as u64)]
    hf_retry_base_ms: u64,
    /// Seconds between download progress log lines.
    #[arg(long, default_value_t = DownloadTuning::default().progress_log_interval.as_secs())]
    hf_progress_log_secs: u64,
}

/// The hub endpoint: `--hf-endpoint`, else `HF_ENDPOINT` (both through clap), else `ENDPOINT`,
/// the variable OME's model agent reads (its configuration binds the key `endpoint` to the
/// environment), else the public hub. `HF_ENDPOINT` wins over `ENDPOINT` because it is the
/// hub clients' own variable and more specific; empty values count as unset, as in OME.
fn hub_endpoint(flag_or_hf_endpoint: Option<&str>, endpoint_env: Option<&str>) -> String {
    [flag_or_hf_endpoint, endpoint_env]
        .into_iter()
        .flatten()
        .map(str::trim)
        .find(|value| !value.is_empty())
        .unwrap_or(modelfs_agent::source::hf::DEFAULT_ENDPOINT)
        .to_owned()
}

impl HfArgs {
    fn config(&self) -> HfConfig {
        let defaults = DownloadTuning::default();
        HfConfig {
            endpoint: hub_endpoint(
                self.hf_endpoint.as_deref(),
                std::env::var("ENDPOINT").ok().as_deref(),
            ),
            default_token: std::env::var("HF_TOKEN")
                .ok()
                .filter(|t| !t.trim().is_empty())
                .map(|t| Token::new(t.trim())),
            tuning: DownloadTuning {
                max_files: self.hf_max_files.max(1),
                range_streams: self.hf_range_streams.max(1),
                chunk_size: self.hf_chunk_mib.max(1) << 20,
                buffer_bytes: self.hf_download_buffer_mib.max(1) << 20,
                min_range_bytes_per_sec: self.hf_min_range_kib_per_sec << 10,
                max_transfers: self.hf_max_transfers.max(1),
                stall_timeout: Duration::from_secs(self.hf_stall_timeout_secs.max(1)),
                connect_timeout: Duration::from_secs(self.hf_connect_timeout_secs.max(1)),
                request_timeout: Duration::from_secs(self.hf_request_timeout_secs.max(1)),
                max_listing_pages: self.hf_max_listing_pages.max(1),
                max_listing_entries: self.hf_max_listing_entries.max(1),
                max_attempts: self.hf_max_attempts.max(1),
                retry_base: Duration::from_millis(self.hf_retry_base_ms),
                progress_log_interval: Duration::from_secs(self.hf_progress_log_secs.max(1)),
                ..defaults
            },
            proxy: None,
        }
    }
}

/// How long `serve` waits at exit for blocking work that ignored cancellation.
const BLOCKING_WORK_GRACE: Duration = Duration::from_secs(2);

/// `--passthrough`: the mount crate's [`PassthroughMode`], mapped here so that crate needs no
/// command-line parser.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum PassthroughArg {
    /// Use passthrough when the kernel grants it, read-through otherwise (per file).
    Auto,
    /// Refuse to mount without kernel passthrough support.
    Always,
    /// Always serve reads from the daemon.
    Never,
}

impl From<PassthroughArg> for PassthroughMode {
    fn from(arg: PassthroughArg) -> Self {
        match arg {
            PassthroughArg::Auto => PassthroughMode::Auto,
            PassthroughArg::Always => PassthroughMode::Always,
            PassthroughArg::Never => PassthroughMode::Never,
        }
    }
}

/// `--fuse-transport`: the mount crate's [`FuseTransport`], mapped here.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum TransportArg {
    /// FUSE over io_uring when the kernel offers it (the `fuse` module parameter
    /// `enable_uring`, Linux >= 6.14) and io_uring works here; `/dev/fuse` otherwise.
    Auto,
    /// Refuse to mount without FUSE over io_uring.
    Uring,
    /// Always `/dev/fuse`.
    Dev,
}

impl From<TransportArg> for FuseTransport {
    fn from(arg: TransportArg) -> Self {
        match arg {
            TransportArg::Auto => FuseTransport::Auto,
            TransportArg::Uring => FuseTransport::Uring,
            TransportArg::Dev => FuseTransport::Dev,
        }
    }
}

pub fn main() -> Result<()> {
    let cli = Cli::parse();
    match cli.command {
        Command::Serve(args) => {
            init_tracing(args.log_json);
            // Bad flags stop `serve` before anything is mounted, rather than an agent that
            // fails at start and is restarted forever.
            args.proxy.proxies()?;
            // A taken --listen address would let the mount come up and its agent fail at
            // start, restarted forever: refuse it now, with the reason.
            std::net::TcpListener::bind(args.listen).with_context(|| {
                format!(
                    "--listen {}: cannot listen there (another modelfs, or another program, \
                     holds it; pick a free address)",
                    args.listen
                )
            })?;
            let state = args.state_dir()?;
            let socket = socket_path(&state, args.mount_socket.as_deref())?;
            let mut agent_args: Vec<std::ffi::OsString> = std::env::args_os().skip(1).collect();
            match agent_args.iter().position(|a| a == "serve") {
                Some(i) => agent_args[i] = "agent".into(),
                None => bail!("cannot find the serve subcommand in the arguments"),
            }
            if args.mount_socket.is_none() {
                agent_args.push("--mount-socket".into());
                agent_args.push(socket.clone().into());
            }
            run_mount_server(
                MountServerArgs {
                    mount: args.mount.clone(),
                    state,
                    mount_socket: Some(socket),
                    passthrough: args.passthrough,
                    fuse_threads: args.fuse_threads,
                    pending_open_timeout_secs: args.pending_open_timeout_secs,
                    fuse_transport: args.fuse_transport,
                    keeper_socket: args.keeper_socket.clone(),
                    no_keeper: args.no_keeper,
                    log_json: args.log_json,
                },
                Some(agent_args),
            )
        }
        Command::MountServer(args) => {
            init_tracing(args.log_json);
            run_mount_server(args, None)
        }
        Command::Agent(args) => {
            init_tracing(args.log_json);
            modelfs_mount::supervise::exit_with_supervisor()?;
            let runtime = tokio::runtime::Builder::new_multi_thread()
                .enable_all()
                .thread_name("modelfs")
                .build()?;
            let result = runtime.block_on(agent(*args));
            // Work on the blocking pool (local imports) can sit in a read the kernel does not
            // end (a hung network filesystem): the mount is gone and the records are saved by
            // now, so give it a moment and exit without it. Dropping the runtime would wait
            // for it forever.
            runtime.shutdown_timeout(BLOCKING_WORK_GRACE);
            result
        }
        Command::Keeper(args) => {
            init_tracing(false);
            keeper_cmd::run_keeper(args)
        }
        Command::Unmount(args) => {
            init_tracing(false);
            keeper_cmd::run_unmount(args)
        }
        Command::Status(args) => status_cmd::run(args),
        Command::Probe(args) => probe_cmd::run(args),
        Command::Gc(args) => gc_cmd::run(args),
        Command::Crd(args) => crd_cmd::run(args),
    }
}

fn init_tracing(json: bool) {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    use std::io::IsTerminal;
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_ansi(std::io::stderr().is_terminal())
        .with_writer(std::io::stderr);
    if json {
        builder.json().init();
    } else {
        builder.init();
    }
}

/// One daemon per state directory: a second one would corrupt the records.
fn lock_state(state: &Path) -> Result<std::fs::File> {
    use std::os::unix::fs::OpenOptionsExt;
    let path = state.join("lock");
    // Root's alone whatever the umask: another user holding the lock would stop the daemon.
    let file = std::fs::OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .mode(0o600)
        .open(&path)
        .with_context(|| format!("opening {}", path.display()))?;
    // An exclusive flock(2), held as long as the file stays open.
    if let Err(e) = file.try_lock() {
        if let std::fs::TryLockError::Error(e) = e {
            return Err(e).with_context(|| format!("locking {}", path.display()));
        }
        bail!(
            "another modelfs daemon is using the state directory {}",
            state.display()
        );
    }
    Ok(file)
}

/// The socket path: the flag, or the default below the state directory (made absolute: the
/// agent child may run elsewhere).
fn socket_path(state: &Path, flag: Option<&Path>) -> Result<PathBuf> {
    match flag {
        Some(p) => absolute(p),
        None => Ok(modelfs_mount::server::default_socket(&absolute(state)?)),
    }
}

/// The mount server, alone or (`serve`) with the agent as its supervised child, until
/// SIGTERM/SIGINT: then the agent is stopped and the mount removed.
fn run_mount_server(args: MountServerArgs, agent: Option<Vec<std::ffi::OsString>>) -> Result<()> {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    let socket = socket_path(&args.state, args.mount_socket.as_deref())?;
    let keeper = if args.no_keeper {
        None
    } else {
        let path = match &args.keeper_socket {
            Some(p) => absolute(p)?,
            None => keeper_cmd::default_keeper_socket(&absolute(&args.state)?),
        };
        // Standalone, the mount server starts its own keeper; on Kubernetes the keeper is a
        // DaemonSet of its own, which the server waits for (it deposits once it is there).
        if agent.is_some() {
            keeper_cmd::ensure_keeper(&path)?;
        }
        Some(path)
    };
    // With a keeper, io_uring loses no request across a restart only on rings the keeper makes
    // and polls (`modelfs_mount::takeover`, "io_uring"): `auto` takes the ring only if the
    // keeper makes them, else serves over /dev/fuse; `uring` falls back to rings of its own.
    let transport = FuseTransport::from(args.fuse_transport);
    // A successor maps the ring's buffers again, at the same address (the kernel reads an
    // answer where the entry was registered), and the keeper makes and polls the rings.
    let ring_takeover = keeper.is_some();
    let ring_keeper = keeper.clone();
    let config = modelfs_mount::server::ServerConfig {
        mount: absolute(&args.mount)?,
        state: absolute(&args.state)?,
        keeper,
        socket,
        fuse: FuseConfig {
            passthrough: args.passthrough.into(),
            threads: args.fuse_threads,
            transport,
            ring_takeover,
            ring_keeper,
            pending_wait: Duration::from_secs(args.pending_open_timeout_secs),
            ..FuseConfig::default()
        },
    };
    let server = modelfs_mount::server::MountServer::start(
        config,
        Arc::new(modelfs_mount::metrics::FuseMetrics::new()),
    )?;
    let supervisor = match agent {
        Some(agent_args) => Some(
            modelfs_mount::supervise::Supervisor::start(
                std::env::current_exe().context("finding the modelfs binary")?,
                agent_args,
            )
            .context("starting the agent")?,
        ),
        None => None,
    };
    let signal = runtime.block_on(wait_for_signal())?;
    if let Some(s) = supervisor {
        s.stop();
    }
    match signal {
        // Ctrl-C of a foreground server: the end of the mount.
        StopSignal::Interrupt => {
            tracing::info!("interrupted: unmounting");
            server.shutdown().context("unmounting")?;
        }
        // A service manager's or Kubernetes' stop: a restart or an upgrade follows.
        StopSignal::Terminate => {
            server.hand_on().context("handing the mount on")?;
        }
    }
    tracing::info!("stopped");
    Ok(())
}

enum StopSignal {
    Interrupt,
    Terminate,
}

/// How long a restarted agent waits for the previous one to release the state directory.
const STATE_LOCK_WAIT: Duration = Duration::from_secs(30);

async fn agent(args: ServeArgs) -> Result<()> {
    let _ = rustls::crypto::ring::default_provider().install_default();
    // Bad flags fail before anything is created or mounted.
    let proxies = args.proxy.proxies()?;
    if proxies != Proxies::default() {
        // Display of a ProxyUrl hides its credentials.
        let shown = |p: &Option<ProxyUrl>| p.as_ref().map(ToString::to_string);
        tracing::info!(
            hf = ?shown(&proxies.hf),
            s3 = ?shown(&proxies.s3),
            gs = ?shown(&proxies.gs),
            az = ?shown(&proxies.az),
            oci = ?shown(&proxies.oci),
            "per-source proxies (NO_PROXY applies)"
        );
    }
    let state_dir = args.state_dir()?;
    std::fs::create_dir_all(&state_dir)
        .with_context(|| format!("creating state directory {}", state_dir.display()))?;
    // A restarted agent may start while the previous one is still exiting.
    let lock_deadline = std::time::Instant::now() + STATE_LOCK_WAIT;
    let _lock = loop {
        match lock_state(&state_dir) {
            Ok(lock) => break lock,
            Err(e) if std::time::Instant::now() >= lock_deadline => return Err(e),
            Err(_) => tokio::time::sleep(Duration::from_millis(100)).await,
        }
    };
    let state = StateDir::open(&state_dir)
        .with_context(|| format!("opening state directory {}", state_dir.display()))?;
    let mount_dir = absolute(&args.mount)?;
    let models_root_dir = match &args.models_root_dir {
        Some(d) => absolute(d)?,
        None => mount_dir.clone(),
    };

    // The mount server holds the mount; it hands over the directory underneath it, opened
    // before mounting: files an old agent left there are adopted through this handle instead
    // of being hidden (see `adopt`).
    let metrics = Arc::new(Metrics::new());
    let core = Arc::new(FsCore::new());
    let socket = socket_path(&state_dir, args.mount_socket.as_deref())?;
    let (connect_core, connect_metrics) = (core.clone(), metrics.clone());
    let grace = Duration::from_secs(args.mount_server_grace_secs);
    let (mount, welcome, mount_dev) = tokio::task::spawn_blocking(move || {
        modelfs_agent::mount_client::RemoteMount::connect(
            connect_core,
            connect_metrics,
            &socket,
            grace,
        )
    })
    .await
    .context("connecting to the mount server")??;
    let under_mount = Arc::new(modelfs_agent::adopt::UnderMount::from_fd(
        welcome.under,
        &mount_dir,
        &models_root_dir,
    ));
    // Kubernetes mounts the state directory and the models root as two volumes of one disk:
    // adoption links through the mount server's mount of both (see `UnderMount::link_root_for`).
    let state = match under_mount.link_root_for(&state_dir) {
        Ok(Some(dir)) => state.with_link_root(dir),
        Ok(None) => state,
        Err(e) => {
            tracing::warn!(error = %e, "cannot tell whether the state directory is reachable through the models root's mount");
            state
        }
    };
    let mounted = Arc::new(AtomicBool::new(true));
    let health = Arc::new(modelfs_agent::http::HealthChecks {
        state_dir: state_dir.clone(),
        mount_dir: mount_dir.clone(),
        mount_dev,
    });

    let hf_config = HfConfig {
        proxy: proxies.hf.clone(),
        ..args.hf.config()
    };
    let sources = SourceConfig::new(hf_config)
        .context("configuring sources")?
        .with_under_mount(under_mount)
        .with_proxies(proxies);
    let reconciler_config = ReconcilerConfig {
        models_root_dir: models_root_dir.clone(),
        gc_grace: Duration::from_secs(args.gc_grace_secs),
        max_concurrent_fetches: args.max_concurrent_fetches,
        hf_cache_dir: hf_cache_dir(&args.hf_cache_dir)?,
        hf_cache_linger: Duration::from_secs(args.hf_cache_linger_secs),
        resolve_interval: (args.resolve_interval_secs > 0)
            .then(|| Duration::from_secs(args.resolve_interval_secs)),
        // Standalone: a model is served while it downloads (SPEC section 13). In Kubernetes
        // mode `Ready` keeps OME's meaning.
        serve_while_downloading: !args.kube && !args.no_serve_while_downloading,
        disk_budget: Some(args.disk_budget),
        ..ReconcilerConfig::new(sources)
    };
    let sink: Arc<dyn MountSink> = mount;
    let reconciler = Reconciler::start(reconciler_config, state, core, Some(sink), metrics.clone())
        .context("loading records")?;

    let producer = if args.kube {
        let node_name = args
            .node_name
            .clone()
            .filter(|name| !name.is_empty())
            .context("--kube needs --node-name or NODE_NAME")?;
        let client = ::kube::Client::try_default()
            .await
            .context("connecting to the Kubernetes API server")?;
        tracing::info!(node = %node_name, namespace = %args.namespace, "Kubernetes mode");
        Producer::Kube {
            _tasks: modelfs_agent::kubernetes::start(
                client,
                modelfs_agent::kubernetes::KubeConfig {
                    node_name,
                    namespace: args.namespace.clone(),
                    models_root_dir,
                    allow_local_sources: args.allow_local_sources,
                    progress_interval: Duration::from_secs(args.progress_interval_secs),
                    written_file: Some(state_dir.join("kube-written.json")),
                },
                reconciler.clone(),
            ),
        }
    } else {
        let models = args.models.clone().context("--models is required")?;
        Producer::Standalone {
            _watcher: modelfs_agent::standalone::watch(
                ModelsDirConfig {
                    dir: models.clone(),
                    models_root_dir,
                    debounce: Duration::from_millis(200),
                    rescan: Duration::from_secs(10),
                },
                reconciler.clone(),
                metrics.clone(),
            )
            .with_context(|| format!("watching {}", models.display()))?,
        }
    };

    let listener = tokio::net::TcpListener::bind(args.listen)
        .await
        .with_context(|| format!("listening on {}", args.listen))?;
    let bound = listener
        .local_addr()
        .with_context(|| format!("the address bound for {}", args.listen))?;
    if let Some(file) = &args.listen_addr_file {
        write_listen_addr(file, bound)?;
    }
    tracing::info!(listen = %bound, "http endpoint up");
    let (stop_http, http_stopped) = tokio::sync::oneshot::channel::<()>();
    let http = tokio::spawn(modelfs_agent::http::serve(
        listener,
        HttpState {
            metrics,
            reconciler: reconciler.clone(),
            mounted: mounted.clone(),
            health,
        },
        async move {
            let _ = http_stopped.await;
        },
    ));

    tokio::select! {
        signal = wait_for_signal() => { signal?; }
        // Nothing decides any more: end, so that the agent is restarted (by the mount server
        // under `serve`, by Kubernetes otherwise). The mount and what it serves stay.
        reason = reconciler.died() => {
            drop(producer);
            anyhow::bail!("the reconciler died: {reason}");
        }
    }
    tracing::info!("shutting down");
    drop(producer);
    reconciler.shutdown().await;
    mounted.store(false, Ordering::Relaxed);
    let _ = stop_http.send(());
    let _ = http.await;
    // The mount stays: it belongs to the mount server.
    tracing::info!("stopped");
    Ok(())
}

/// Where the desired state comes from; dropping it stops it.
/// `--listen-addr-file`: `addr` and a newline, written beside `file` and renamed over it.
fn write_listen_addr(file: &Path, addr: SocketAddr) -> Result<()> {
    let name = file
        .file_name()
        .with_context(|| format!("--listen-addr-file {}: not a file name", file.display()))?;
    let mut tmp_name = std::ffi::OsString::from(".");
    tmp_name.push(name);
    tmp_name.push(".tmp");
    let tmp = file.with_file_name(tmp_name);
    std::fs::write(&tmp, format!("{addr}\n"))
        .and_then(|()| std::fs::rename(&tmp, file))
        .with_context(|| format!("writing --listen-addr-file {}", file.display()))
}

enum Producer {
    Standalone {
        _watcher: modelfs_agent::standalone::ModelsDirWatcher,
    },
    Kube {
        _tasks: modelfs_agent::kubernetes::KubeTasks,
    },
}

pub(crate) fn absolute(p: &Path) -> Result<PathBuf> {
    if p.is_absolute() {
        Ok(p.to_path_buf())
    } else {
        Ok(std::env::current_dir()?.join(p))
    }
}

async fn wait_for_signal() -> Result<StopSignal> {
    use tokio::signal::unix::{signal, SignalKind};
    let mut term = signal(SignalKind::terminate())?;
    let mut int = signal(SignalKind::interrupt())?;
    Ok(tokio::select! {
        _ = term.recv() => StopSignal::Terminate,
        _ = int.recv() => StopSignal::Interrupt,
    })
}

/// `--hf-cache-dir`: a relative path below the mount, or empty for no view.
fn hf_cache_dir(arg: &str) -> Result<Option<modelfs_ome::MountPath>> {
    if arg.is_empty() {
        return Ok(None);
    }
    modelfs_ome::MountPath::from_relative(arg)
        .map(Some)
        .with_context(|| format!("--hf-cache-dir {arg:?} must be a relative path below the mount"))
}

#[cfg(test)]
mod tests {
    use super::hub_endpoint;

    /// `--hf-endpoint`/`HF_ENDPOINT` first, then OME's `ENDPOINT`, then the public hub; empty
    /// values are skipped.
    #[test]
    fn hub_endpoint_order() {
        let cases = [
            (Some("http://a"), Some("http://b"), "http://a"),
            (None, Some("http://b"), "http://b"),
            (Some(""), Some("http://b"), "http://b"),
            (Some("  "), Some(" http://b "), "http://b"),
            (None, Some(""), modelfs_agent::source::hf::DEFAULT_ENDPOINT),
            (None, None, modelfs_agent::source::hf::DEFAULT_ENDPOINT),
        ];
        for (hf_endpoint, endpoint, expected) in cases {
            assert_eq!(
                hub_endpoint(hf_endpoint, endpoint),
                expected,
                "HF_ENDPOINT {hf_endpoint:?}, ENDPOINT {endpoint:?}"
            );
        }
    }
}
