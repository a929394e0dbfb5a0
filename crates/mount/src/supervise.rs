//! `modelfs serve`: the mount server runs the agent as its child and restarts it when it dies.

use std::ffi::OsString;
use std::os::unix::process::{CommandExt, ExitStatusExt};
use std::path::PathBuf;
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// First delay before restarting a dead agent; doubles up to [`MAX_BACKOFF`].
const FIRST_BACKOFF: Duration = Duration::from_millis(200);
const MAX_BACKOFF: Duration = Duration::from_secs(30);
/// An agent that ran this long before dying starts the backoff afresh.
const HEALTHY_RUN: Duration = Duration::from_secs(60);
/// How long a stopping agent may take before it is killed.
const STOP_GRACE: Duration = Duration::from_secs(30);

/// The agent child and its restarts.
pub struct Supervisor {
    stop: Arc<AtomicBool>,
    child: Arc<Mutex<Option<Child>>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

/// Why a child ended, for a person.
pub fn describe(status: ExitStatus) -> String {
    if let Some(sig) = status.signal() {
        let name = match sig {
            1 => "SIGHUP",
            2 => "SIGINT",
            4 => "SIGILL",
            6 => "SIGABRT",
            7 => "SIGBUS",
            8 => "SIGFPE",
            9 => "SIGKILL",
            11 => "SIGSEGV",
            13 => "SIGPIPE",
            15 => "SIGTERM",
            _ => "other",
        };
        format!(
            "killed by signal {sig} ({name}){}",
            if status.core_dumped() {
                ", core dumped"
            } else {
                ""
            }
        )
    } else {
        match status.code() {
            Some(0) => "exited normally".into(),
            Some(c) => format!("exited with status {c}"),
            None => format!("{status}"),
        }
    }
}

impl Supervisor {
    /// Starts `program args...` now and again after each death.
    pub fn start(program: PathBuf, args: Vec<OsString>) -> std::io::Result<Self> {
        let stop = Arc::new(AtomicBool::new(false));
        let child: Arc<Mutex<Option<Child>>> = Arc::new(Mutex::new(None));
        let (thread_stop, thread_child) = (stop.clone(), child.clone());
        // This thread forks the child and lives as long as the supervisor: the child's
        // parent-death signal fires when the forking *thread* ends.
        let thread = std::thread::Builder::new()
            .name("agent-supervisor".into())
            .spawn(move || supervise(program, args, thread_stop, thread_child))?;
        Ok(Self {
            stop,
            child,
            thread: Some(thread),
        })
    }

    /// SIGTERM to the agent, wait for it (SIGKILL after a grace period), no restart.
    pub fn stop(mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
        let _ = &self.child;
    }
}

fn spawn(program: &PathBuf, args: &[OsString]) -> std::io::Result<Child> {
    let mut cmd = Command::new(program);
    // Its own process group: a terminal's Ctrl-C reaches `serve` only, which stops the agent
    // itself (instead of seeing it die and restarting it).
    cmd.args(args).stdin(Stdio::null()).process_group(0);
    // The agent must not outlive a mount server that dies without clean-up (SIGKILL): the next
    // one starts its own agent. The agent arranges that itself at start (no code may run
    // between fork and exec without `unsafe`); see `exit_with_supervisor`.
    cmd.env(SUPERVISOR_PID_ENV, std::process::id().to_string());
    for (name, value) in AGENT_MALLOC_ENV {
        if std::env::var_os(name).is_none() {
            cmd.env(name, value);
        }
    }
    cmd.spawn()
}

/// glibc malloc settings for the agent, unless the environment already sets them (the
/// Kubernetes manifests set them in the containers; see BENCHMARKS.md, "Memory of the mount
/// server and the agent"). The agent's runtime runs dozens of threads while it imports (the
/// blocking pool's copies and hashes); glibc gives threads up to 8 arenas per core, each
/// keeping its freed memory, so two arenas hold less resident memory for the same heap.
/// A fixed mmap threshold keeps allocations of 128 KiB and more (whole-state JSON documents,
/// read buffers) out of the heap, so freeing them returns them to the system instead of
/// leaving a peak resident. glibc reads both when the process starts, so they can only be
/// given through the environment.
pub const AGENT_MALLOC_ENV: [(&str, &str); 2] = [
    ("MALLOC_ARENA_MAX", "2"),
    ("MALLOC_MMAP_THRESHOLD_", "131072"),
];

/// Set by the mount server for the agent it supervises: the supervisor's pid.
pub const SUPERVISOR_PID_ENV: &str = "MODELFS_SUPERVISOR_PID";

/// In a supervised agent: be killed when the supervisor dies, and exit at once if it already
/// has (it died between the spawn and this call, so the death signal was never armed for it).
pub fn exit_with_supervisor() -> std::io::Result<()> {
    let Some(pid) = std::env::var(SUPERVISOR_PID_ENV)
        .ok()
        .and_then(|v| v.parse::<i32>().ok())
    else {
        return Ok(());
    };
    rustix::process::set_parent_process_death_signal(Some(rustix::process::Signal::KILL))?;
    let parent = rustix::process::getppid().map(rustix::process::Pid::as_raw_nonzero);
    if parent.map(|p| p.get()) != Some(pid) {
        return Err(std::io::Error::other(format!(
            "the mount server (pid {pid}) that started this agent is gone"
        )));
    }
    Ok(())
}

fn supervise(
    program: PathBuf,
    args: Vec<OsString>,
    stop: Arc<AtomicBool>,
    slot: Arc<Mutex<Option<Child>>>,
) {
    let mut backoff = FIRST_BACKOFF;
    while !stop.load(Ordering::Relaxed) {
        let started = Instant::now();
        let child = match spawn(&program, &args) {
            Ok(c) => c,
            Err(e) => {
                tracing::error!(error = %e, program = %program.display(), "starting the agent failed");
                wait_or_stop(&stop, backoff);
                backoff = (backoff * 2).min(MAX_BACKOFF);
                continue;
            }
        };
        tracing::info!(pid = child.id(), "agent started");
        *slot.lock().expect("child slot") = Some(child);
        let status = loop {
            let mut guard = slot.lock().expect("child slot");
            let child = guard.as_mut().expect("child");
            if stop.load(Ordering::Relaxed) {
                break stop_child(child);
            }
            match child.try_wait() {
                Ok(Some(status)) => break Some(status),
                Ok(None) => {}
                Err(e) => {
                    tracing::error!(error = %e, "waiting for the agent");
                    break None;
                }
            }
            drop(guard);
            std::thread::sleep(Duration::from_millis(50));
        };
        slot.lock().expect("child slot").take();
        let ran = started.elapsed();
        let reason = status.map(describe).unwrap_or_else(|| "unknown".into());
        if stop.load(Ordering::Relaxed) {
            tracing::info!(%reason, "agent stopped");
            return;
        }
        if ran >= HEALTHY_RUN {
            backoff = FIRST_BACKOFF;
        }
        tracing::warn!(%reason, ran_secs = ran.as_secs_f64(), restart_in_ms = backoff.as_millis() as u64, "agent died; restarting it");
        wait_or_stop(&stop, backoff);
        backoff = (backoff * 2).min(MAX_BACKOFF);
    }
}

fn stop_child(child: &mut Child) -> Option<ExitStatus> {
    let pid = rustix::process::Pid::from_raw(child.id() as i32);
    if let Some(pid) = pid {
        let _ = rustix::process::kill_process(pid, rustix::process::Signal::TERM);
    }
    let deadline = Instant::now() + STOP_GRACE;
    while Instant::now() < deadline {
        if let Ok(Some(status)) = child.try_wait() {
            return Some(status);
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    tracing::warn!("agent did not stop in time; killing it");
    let _ = child.kill();
    child.wait().ok()
}

fn wait_or_stop(stop: &AtomicBool, delay: Duration) {
    let until = Instant::now() + delay;
    while Instant::now() < until && !stop.load(Ordering::Relaxed) {
        std::thread::sleep(Duration::from_millis(20).min(delay));
    }
}
