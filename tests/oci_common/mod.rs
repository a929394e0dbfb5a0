//! OKE workload identity fixtures for the `oci://` tests: the OCI look-alike
//! (`modelfs_devhub::oci`) served over TLS as the cluster's proxymux, where the SDKs look for
//! it, `https://$KUBERNETES_SERVICE_HOST:12250`, with a certificate signed by a CA made here
//! (the pod's service account CA), and service account tokens shaped like Kubernetes' (JWTs
//! with `exp`).
//!
//! The port is the SDKs' fixed 12250, so each proxymux takes its own loopback address in
//! 127.0.0.0/8 (not 127.0.0.1), picked at random and bound before the certificate names it.
#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};

use base64::Engine as _;
use modelfs_devhub::oci::{OciDev, RunningOciDev};

use crate::common::sh;
use modelfs_agent::source::oci::sign::rsa_public_key_from_pem;

/// The tenancy and user of the API keys the look-alike accepts.
pub const TENANCY: &str = "ocid1.tenancy.oc1..aaaadevtenancy";
pub const USER: &str = "ocid1.user.oc1..aaaadevuser";

/// The proxymux port the SDKs hard-code.
pub const PROXYMUX_PORT: u16 = 12250;

/// A proxymux look-alike over TLS and the files a pod would have.
pub struct Proxymux {
    /// What `KUBERNETES_SERVICE_HOST` holds in the pod: the address served on.
    pub host: String,
    /// The service account CA (PEM) that signed the proxymux's certificate.
    pub ca_path: PathBuf,
    pub running: RunningOciDev,
}

/// A listener on `127.a.b.c:12250` for some random `a.b.c`.
fn bind_loopback_12250() -> std::net::TcpListener {
    let mut seed = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .subsec_nanos() as u64
        ^ (u64::from(std::process::id()) << 20);
    let mut last = None;
    for _ in 0..64 {
        // xorshift: enough to spread concurrent tests over 127/8.
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        let [a, b, c, ..] = seed.to_le_bytes();
        let host = format!("127.{}.{b}.{}", a.max(1), c.clamp(2, 254));
        match std::net::TcpListener::bind((host.as_str(), PROXYMUX_PORT)) {
            Ok(l) => return l,
            Err(e) => last = Some(e),
        }
    }
    panic!("no loopback address with port {PROXYMUX_PORT} free: {last:?}");
}

/// Serves `server` as the proxymux: a CA and a leaf certificate for the chosen address are
/// made with openssl under `dir`; the CA is written to `dir/ca.crt`.
pub fn start_proxymux(server: &Arc<OciDev>, rt: &tokio::runtime::Runtime, dir: &Path) -> Proxymux {
    std::fs::create_dir_all(dir).unwrap();
    let listener = bind_loopback_12250();
    let host = listener.local_addr().unwrap().ip().to_string();
    let d = dir.display();
    sh(&format!(
        "cd {d} && openssl req -x509 -newkey rsa:2048 -nodes -days 1 -keyout ca.key -out ca.crt \
         -subj '/CN=modelfs test cluster CA' -addext 'basicConstraints=critical,CA:TRUE' \
         -addext 'keyUsage=critical,keyCertSign,cRLSign' 2>/dev/null && \
         openssl req -newkey rsa:2048 -nodes -keyout proxymux.key -out proxymux.csr \
         -subj '/CN=proxymux' 2>/dev/null && \
         printf 'subjectAltName=IP:{host}\\nbasicConstraints=critical,CA:FALSE\\n\
keyUsage=critical,digitalSignature,keyEncipherment\\nextendedKeyUsage=serverAuth\\n\
authorityKeyIdentifier=keyid\\nsubjectKeyIdentifier=hash\\n' > proxymux.ext && \
         openssl x509 -req -in proxymux.csr -CA ca.crt -CAkey ca.key -CAcreateserial -days 1 \
         -extfile proxymux.ext -out proxymux.crt 2>/dev/null"
    ));
    let cert = std::fs::read_to_string(dir.join("proxymux.crt")).unwrap();
    let key = std::fs::read_to_string(dir.join("proxymux.key")).unwrap();
    let running = rt
        .block_on(server.serve_tls(listener, &cert, &key))
        .unwrap();
    Proxymux {
        host,
        ca_path: dir.join("ca.crt"),
        running,
    }
}

/// A service account token as kubelet projects it: a JWT (`exp` `exp_in_secs` from now; `sub`
/// ends with `name`). Its signature is random: only the proxymux look-alike checks it, by
/// comparing the whole token.
pub fn service_account_token(name: &str, exp_in_secs: i64) -> String {
    let b64 = |v: &[u8]| base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(v);
    let now = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_secs() as i64;
    let header = serde_json::json!({"alg": "RS256", "kid": "modelfs-test"});
    let claims = serde_json::json!({
        "aud": ["https://kubernetes.default.svc"],
        "iss": "https://kubernetes.default.svc",
        "sub": format!("system:serviceaccount:ome:{name}"),
        "iat": now,
        "exp": now + exp_in_secs,
    });
    let signature = sh("openssl rand -hex 48");
    format!(
        "{}.{}.{}",
        b64(header.to_string().as_bytes()),
        b64(claims.to_string().as_bytes()),
        b64(signature.trim().as_bytes())
    )
}

/// An API key: private PEM path, public PEM text, fingerprint.
pub struct ApiKey {
    pub private: PathBuf,
    pub public_pem: String,
    pub fingerprint: String,
}

impl ApiKey {
    pub fn generate(dir: &Path, name: &str) -> Self {
        std::fs::create_dir_all(dir).unwrap();
        let private = dir.join(format!("{name}.pem"));
        sh(&format!(
            "openssl genrsa -out {} 2048 2>/dev/null",
            private.display()
        ));
        let public_pem = sh(&format!(
            "openssl rsa -in {} -pubout 2>/dev/null",
            private.display()
        ));
        let fp = sh(&format!(
            "openssl rsa -in {} -pubout -outform DER 2>/dev/null | openssl md5 -c",
            private.display()
        ));
        Self {
            private,
            public_pem,
            fingerprint: fp.trim().rsplit(' ').next().unwrap().to_string(),
        }
    }

    pub fn key_id(&self) -> String {
        format!("{TENANCY}/{USER}/{}", self.fingerprint)
    }

    pub fn private_pem(&self) -> String {
        std::fs::read_to_string(&self.private).unwrap()
    }

    /// The look-alike accepts this key.
    pub fn register(&self, oci: &OciDev) {
        oci.add_key(
            &self.key_id(),
            rsa_public_key_from_pem(&self.public_pem).unwrap(),
        );
    }

    /// An OCI config file (as an operator mounts it into the agent) naming this key.
    pub fn config_file(&self, dir: &Path) -> PathBuf {
        let path = dir.join("oci-config");
        std::fs::write(
            &path,
            format!(
                "[DEFAULT]\nuser={USER}\nfingerprint={}\ntenancy={TENANCY}\nregion=us-ashburn-1\nkey_file={}\n",
                self.fingerprint,
                self.private.display()
            ),
        )
        .unwrap();
        path
    }
}
