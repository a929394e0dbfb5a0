//! The two development binaries as the benchmark scripts run them: command-line arguments in,
//! `listening http://ADDR` on stdout, then the look-alike answers on that address. (The
//! look-alikes' protocols are checked against the real clients by the `modelfs` package's
//! `hf_python` and `oci_python` tests, which serve them in-process.)

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

/// A binary started by a test, killed when dropped.
struct Server {
    child: Child,
    addr: String,
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn start(mut command: Command) -> Server {
    let mut child = command
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .expect("spawn");
    let mut line = String::new();
    BufReader::new(child.stdout.take().unwrap())
        .read_line(&mut line)
        .unwrap();
    let addr = line
        .trim()
        .strip_prefix("listening http://")
        .unwrap_or_else(|| panic!("unexpected output {line:?}"))
        .to_string();
    Server { child, addr }
}

/// `GET path` with extra header lines; the status code and body.
fn get(addr: &str, path: &str, headers: &str) -> (u16, String) {
    let mut stream = TcpStream::connect(addr).unwrap();
    stream
        .set_read_timeout(Some(Duration::from_secs(10)))
        .unwrap();
    write!(
        stream,
        "GET {path} HTTP/1.0\r\nHost: {addr}\r\n{headers}\r\n"
    )
    .unwrap();
    let mut buf = Vec::new();
    stream.read_to_end(&mut buf).unwrap();
    let text = String::from_utf8_lossy(&buf).into_owned();
    let (head, body) = text.split_once("\r\n\r\n").expect("an HTTP answer");
    let code = head.split(' ').nth(1).unwrap().parse().unwrap();
    (code, body.to_string())
}

fn write_files(dir: &Path) {
    std::fs::create_dir_all(dir.join("sub")).unwrap();
    std::fs::write(dir.join("config.json"), b"{\"model_type\": \"llama\"}\n").unwrap();
    std::fs::write(dir.join("sub/weights.bin"), vec![7u8; 4096]).unwrap();
}

#[test]
fn modelfs_hub_serves_the_repositories_of_its_arguments() {
    let dir = tempfile::tempdir().unwrap();
    let repo = dir.path().join("repo");
    write_files(&repo);
    let mut command = Command::new(env!("CARGO_BIN_EXE_modelfs-hub"));
    command
        .arg("--repo")
        .arg(format!("org/model@main,v1={}", repo.display()))
        .args(["--gated", "org/model"])
        .env("MODELFS_HUB_TOKEN", "hf_BinaryTestToken");
    let hub = start(command);

    let path = "/api/models/org/model/revision/v1";
    let (code, _) = get(&hub.addr, path, "");
    assert_eq!(code, 401, "a gated repository needs the token");
    let (code, body) = get(
        &hub.addr,
        path,
        "Authorization: Bearer hf_BinaryTestToken\r\n",
    );
    assert_eq!(code, 200, "{body}");
    let revision: serde_json::Value = serde_json::from_str(&body).unwrap();
    let mut files: Vec<&str> = revision["siblings"]
        .as_array()
        .unwrap()
        .iter()
        .map(|s| s["rfilename"].as_str().unwrap())
        .collect();
    files.sort();
    assert_eq!(files, ["config.json", "sub/weights.bin"]);
}

#[test]
fn modelfs_oci_dev_serves_its_buckets_to_signed_requests_only() {
    let dir = tempfile::tempdir().unwrap();
    let files = dir.path().join("files");
    write_files(&files);
    let private = dir.path().join("key.pem");
    let public = dir.path().join("key.pub.pem");
    let openssl = |args: &[&str]| {
        let status = Command::new("openssl")
            .args(args)
            .stderr(Stdio::null())
            .status()
            .expect("openssl runs");
        assert!(status.success(), "openssl {args:?}");
    };
    openssl(&["genrsa", "-out", private.to_str().unwrap(), "2048"]);
    openssl(&[
        "rsa",
        "-in",
        private.to_str().unwrap(),
        "-pubout",
        "-out",
        public.to_str().unwrap(),
    ]);
    let mut command = Command::new(env!("CARGO_BIN_EXE_modelfs-oci-dev"));
    command
        .arg("--bucket")
        .arg(format!("testns/models/llama={}", files.display()))
        .arg("--key")
        .arg(format!("tenancy/user/fingerprint={}", public.display()));
    let dev = start(command);

    let (code, body) = get(&dev.addr, "/n/testns/b/models/o", "");
    assert_eq!(code, 401, "{body}");
    let refusal: serde_json::Value = serde_json::from_str(&body).unwrap();
    assert_eq!(refusal["code"], "NotAuthenticated", "{body}");
    let (code, body) = get(&dev.addr, "/_oci/stats", "");
    assert_eq!(code, 200, "{body}");
}
