//! Downloads go through an HTTP proxy when told to (the way a fleet fetches through a caching
//! proxy such as Dragonfly's dfdaemon): `HTTP_PROXY` from the environment, or `--proxy-hf`,
//! which wins over the environment; `NO_PROXY` sends listed hosts around either. The proxy is
//! the counting loopback proxy of the object-store harness, so the test sees that the model's
//! bytes really went through it.

mod common;
mod objstore_common;

use std::collections::BTreeMap;

use common::hub::*;
use common::*;
use modelfs_devhub::hf::HubFile;
use objstore_common::proxy::Proxy;

const KEY: &str = "clusterbasemodel.llm";

/// A small repository: plain files and two LFS files (one large enough for parallel ranges,
/// which the test hub serves through its CDN address 127.0.0.2).
fn publish(hub: &TestHub) -> (BTreeMap<String, Vec<u8>>, u64) {
    let mut files = BTreeMap::new();
    files.insert("config.json".to_string(), bytes(1, 900));
    files.insert("tokenizer/vocab.txt".to_string(), bytes(2, 12_345));
    files.insert(
        "model-00001-of-00002.safetensors".to_string(),
        bytes(3, 3 << 20),
    );
    files.insert(
        "model-00002-of-00002.safetensors".to_string(),
        bytes(4, 70_001),
    );
    let hub_files = files
        .iter()
        .map(|(p, d)| {
            (
                p.clone(),
                HubFile::memory(d.clone(), p.ends_with(".safetensors")),
            )
        })
        .collect();
    hub.hub().add_commit("org/llm", &["main"], hub_files);
    let size = files.values().map(|d| d.len() as u64).sum();
    (files, size)
}

fn model_yaml() -> String {
    cluster_model("llm", "hf://org/llm", "AlwaysDownload", None)
}

/// Starts a daemon against `hub` with extra flags and environment, waits for the model to be
/// Ready and checks the mount against the repository.
fn fetch(
    hub: &TestHub,
    files: &BTreeMap<String, Vec<u8>>,
    extra: &[&str],
    vars: &[(&str, &str)],
) -> (TestEnv, Daemon) {
    let env = TestEnv::new();
    // hf_flags' 1 s stall watchdog would retry ranges on a busy machine, and the test counts
    // bytes: give it room.
    let mut flags = hf_flags(hub);
    let stall = flags
        .iter()
        .position(|f| f == "--hf-stall-timeout-secs")
        .unwrap();
    flags[stall + 1] = "30".into();
    flags.extend(extra.iter().map(|s| s.to_string()));
    let flags: Vec<&str> = flags.iter().map(String::as_str).collect();
    let d = Daemon::start_with_env(&env, &flags, vars);
    env.write_models("m.yaml", &model_yaml());
    d.wait_model(KEY, "Ready");
    let want: BTreeMap<String, String> = files
        .iter()
        .map(|(p, data)| {
            (
                p.clone(),
                hex::encode(<sha2::Sha256 as sha2::Digest>::digest(data)),
            )
        })
        .collect();
    assert_eq!(files_of(&env.mount.join("llm")), want);
    (env, d)
}

/// Body bytes of successful file downloads (resolve on the hub, redirected LFS files on its
/// CDN address) that went through `proxy`.
fn proxied_file_bytes(proxy: &Proxy) -> u64 {
    proxy
        .requests()
        .iter()
        .filter(|r| matches!(r.status, 200 | 206))
        .filter(|r| r.path.contains("/resolve/") || r.path.starts_with("/cdn/"))
        .map(|r| r.bytes)
        .sum()
}

/// Every request the hub saw went through the proxy, and the model's bytes exactly once.
fn assert_all_through(proxy: &Proxy, hub: &TestHub, size: u64) {
    let stats = hub.hub().stats();
    assert_eq!(stats.bytes_served, size);
    assert_eq!(proxied_file_bytes(proxy), size, "{:#?}", proxy.stats());
    // The hub counts requests that it answered with content (not its redirects to the CDN).
    let answered = proxy
        .requests()
        .iter()
        .filter(|r| !(300..400).contains(&r.status))
        .count() as u64;
    assert_eq!(
        answered,
        stats.api_requests + stats.file_requests,
        "requests that bypassed the proxy: {:#?}",
        proxy.requests()
    );
    let authorities: std::collections::BTreeSet<String> = proxy
        .requests()
        .iter()
        .map(|r| r.authority.split(':').next().unwrap().to_string())
        .collect();
    assert_eq!(
        authorities,
        ["127.0.0.1", "127.0.0.2"].map(String::from).into(),
        "the hub and its CDN host are both reached through the proxy"
    );
}

#[test]
fn hf_model_downloads_through_http_proxy_from_the_environment() {
    let hub = TestHub::start(100);
    let (files, size) = publish(&hub);
    let proxy = Proxy::forward();
    let (_env, _d) = fetch(&hub, &files, &[], &[("HTTP_PROXY", &proxy.url())]);
    assert_all_through(&proxy, &hub, size);
    assert!(
        proxy.requests().iter().any(|r| r.range.is_some()),
        "large files are fetched as ranges through the proxy"
    );
}

#[test]
fn proxy_hf_flag_wins_over_the_environment_and_hides_its_credentials() {
    let hub = TestHub::start(100);
    let (files, size) = publish(&hub);
    let proxy = Proxy::forward();
    // The environment names a port where nothing listens: only the flag's proxy can work.
    let dead_port = DeadPort::bind();
    let dead = dead_port.url();
    let secret = "pr0xy-pa55word";
    let flag = format!("http://fleet:{secret}@{}", proxy.addr);
    let (env, d) = fetch(
        &hub,
        &files,
        &["--proxy-hf", &flag],
        &[("HTTP_PROXY", &dead), ("ALL_PROXY", &dead)],
    );
    assert_all_through(&proxy, &hub, size);
    // fleet:pr0xy-pa55word in Basic form: the credentials reach the proxy with every request
    // to the hub. (Not with the plain-http redirect to its CDN host: reqwest drops
    // Proxy-Authorization on a cross-host redirect; see source::proxy.)
    let basic = "Basic ZmxlZXQ6cHIweHktcGE1NXdvcmQ=";
    assert!(
        proxy
            .requests()
            .iter()
            .filter(|r| r.authority.starts_with("127.0.0.1:"))
            .all(|r| r.proxy_authorization.as_deref() == Some(basic)),
        "{:#?}",
        proxy.requests()
    );
    let log = d.log_text();
    assert!(
        log.contains("per-source proxies"),
        "the proxy in use is logged: {log}"
    );
    assert!(!log.contains(secret), "proxy password in the log");
    let status = std::fs::read_to_string(env.state.join("status.json")).unwrap();
    assert!(!status.contains(secret));
}

/// The proxy password can come from a file (a mounted Secret) instead of the command line,
/// where every user of the node reads it in `ps`: the URL names the user only, the password
/// reaches the proxy, and no process's command line holds it.
#[test]
fn proxy_password_from_a_file_never_shows_in_a_command_line() {
    let hub = TestHub::start(100);
    let (files, size) = publish(&hub);
    let proxy = Proxy::forward();
    let secret = "pr0xy-f1le-secret";
    let dir = tempfile::tempdir().unwrap();
    let password_file = dir.path().join("proxy-password");
    std::fs::write(&password_file, format!("{secret}\n")).unwrap();
    let flag = format!("http://fleet@{}", proxy.addr);
    let (env, d) = fetch(
        &hub,
        &files,
        &[
            "--proxy-hf",
            &flag,
            "--proxy-password-file",
            password_file.to_str().unwrap(),
        ],
        &[],
    );
    assert_all_through(&proxy, &hub, size);
    // fleet:pr0xy-f1le-secret in Basic form, the trailing newline not part of it.
    let basic = "Basic ZmxlZXQ6cHIweHktZjFsZS1zZWNyZXQ=";
    assert!(
        proxy
            .requests()
            .iter()
            .filter(|r| r.authority.starts_with("127.0.0.1:"))
            .all(|r| r.proxy_authorization.as_deref() == Some(basic)),
        "{:#?}",
        proxy.requests()
    );
    let mut seen = 0;
    for entry in std::fs::read_dir("/proc").unwrap().flatten() {
        let Ok(cmdline) = std::fs::read(entry.path().join("cmdline")) else {
            continue;
        };
        let cmdline = String::from_utf8_lossy(&cmdline).replace('\0', " ");
        if cmdline.contains(&flag) {
            seen += 1;
            assert!(!cmdline.contains(secret), "{cmdline}");
        }
    }
    assert!(seen >= 1, "the daemon's command line was found");
    assert!(!d.log_text().contains(secret), "proxy password in the log");
    let status = std::fs::read_to_string(env.state.join("status.json")).unwrap();
    assert!(!status.contains(secret));
}

#[test]
fn no_proxy_sends_listed_hosts_around_the_proxy() {
    let hub = TestHub::start(100);
    let (files, size) = publish(&hub);
    let proxy = Proxy::forward();
    let bypass = "localhost,127.0.0.1,127.0.0.2";

    // Environment proxy.
    let (_e1, d1) = fetch(
        &hub,
        &files,
        &[],
        &[("HTTP_PROXY", &proxy.url()), ("NO_PROXY", bypass)],
    );
    assert_eq!(hub.hub().stats().bytes_served, size);
    assert!(proxy.requests().is_empty(), "{:#?}", proxy.requests());
    drop(d1);

    // The flag's proxy too (lower-case variable, as many tools set it).
    let (_e2, _d2) = fetch(
        &hub,
        &files,
        &["--proxy-hf", &proxy.url()],
        &[("no_proxy", "127.0.0.0/8")],
    );
    assert_eq!(hub.hub().stats().bytes_served, 2 * size);
    assert!(proxy.requests().is_empty(), "{:#?}", proxy.requests());
}

#[test]
fn status_command_talks_to_the_local_daemon_around_the_proxy() {
    let env = TestEnv::new();
    let d = Daemon::start(&env, &[]);
    // HTTP_PROXY set for downloads (a dead port here) must not reroute `modelfs status`.
    let dead_port = DeadPort::bind();
    let dead = dead_port.url();
    let out = std::process::Command::new(BIN)
        .args(["status", "--listen", &d.listen])
        .env("HTTP_PROXY", &dead)
        .env("ALL_PROXY", &dead)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

#[test]
fn a_bad_proxy_flag_stops_the_daemon_with_a_reason_and_no_secret() {
    let env = TestEnv::new();
    let out = std::process::Command::new(BIN)
        .args(["serve", "--mount"])
        .arg(&env.mount)
        .arg("--state")
        .arg(&env.state)
        .arg("--models")
        .arg(&env.models)
        .args(["--proxy-s3", "socks5://fleet:hunter2-secret@127.0.0.1:1080"])
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("--proxy-s3") && err.contains("socks5"),
        "{err}"
    );
    assert!(!err.contains("hunter2-secret"), "{err}");
    assert!(
        !env.state.exists(),
        "nothing is created before the flags are checked"
    );
}
