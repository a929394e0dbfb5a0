//! Credentials of `oci://` models: the auth modes of OME's agent (`parameters.auth`, default
//! `InstancePrincipal` as in OME) and where each finds its key.
//!
//! * **`UserPrincipal`** (an API key). In order:
//!   1. The model's Secret (the entry named by `parameters.secretKey`, as for Hugging Face
//!      tokens; `parameters.token` in standalone mode): an OCI config profile (`user=`,
//!      `fingerprint=`, `tenancy=`, optional `region=`) with the private key either inline as a
//!      PEM block in the same entry or named by `key_file=`.
//!   2. The agent's OCI config file, as OME's agent reads it: `OCI_CONFIG_PATH` (default
//!      `~/.oci/config`), profile `PROFILE` (default `DEFAULT`; values of `[DEFAULT]` are
//!      inherited by other profiles, as in the SDKs). `key_file` may start with `~/`; a relative
//!      path is relative to the config file's directory (a Secret mounted as one directory).
//!      `security_token_file=` makes it a session-token profile (`keyId` `ST$<token>`).
//! * **`ResourcePrincipal`**: the OCI SDKs' environment contract, version 2.2:
//!   `OCI_RESOURCE_PRINCIPAL_VERSION=2.2`, `OCI_RESOURCE_PRINCIPAL_RPST` (the token, or the
//!   absolute path of a file holding it), `OCI_RESOURCE_PRINCIPAL_PRIVATE_PEM` (the key, or
//!   its path), `OCI_RESOURCE_PRINCIPAL_REGION`. Files are read again for every resolve, so a
//!   rotated token is picked up. Version 1.1 (a token exchange) is refused with a reason.
//! * **`InstancePrincipal`**: the instance's identity from the instance metadata service
//!   (`GET <md>/identity/cert.pem`, `key.pem`, `intermediate.pem`,
//!   `<md>/instance/canonicalRegionName`, header `Authorization: Bearer Oracle`; `<md>` is
//!   `http://169.254.169.254/opc/v2`, or env `MODELFS_OCI_METADATA_ENDPOINT`), exchanged at the
//!   auth service (`POST https://auth.<region>.oraclecloud.com/v1/x509`, or env
//!   `MODELFS_OCI_AUTH_ENDPOINT`) for a session token: the request carries the leaf and
//!   intermediate certificates and a session public key, and is signed by the leaf key with
//!   `keyId` `<tenancy>/fed-x509-sha256/<SHA-256 of the certificate>` (the tenancy is the
//!   certificate's `OU=opc-tenant:` attribute). As in the SDKs, the session public key is a
//!   freshly generated RSA-2048 key's ([`SigningKey::generate`]); requests then sign with
//!   `ST$<token>` and that key. Checked against the look-alike only, not the real service. The
//!   exchange happens once per resolve and once per fetch (a token lasts 20 minutes; a fetch
//!   that outlives it fails and is retried by the reconciler with a new token).
//! * **`OkeWorkloadIdentity`**: the flow of the SDKs' OKE workload identity signer (a
//!   resource principal session token from the cluster's proxymux). For every exchange a fresh
//!   RSA-2048 session key pair is generated ([`SigningKey::generate`]). Its public half goes,
//!   with the pod's Kubernetes service account token, to
//!   `POST https://$KUBERNETES_SERVICE_HOST:12250/resourcePrincipalSessionTokens`: headers
//!   `Authorization: Bearer <service account token>`, `Content-Type: application/json` and an
//!   `opc-request-id`; body `{"podKey": "<base64 DER SubjectPublicKeyInfo>"}` (the PEM of the
//!   public key without its armour and newlines). TLS is checked against the service account
//!   CA only (no system roots), as the SDKs pass it to their HTTP client. The answer is the
//!   base64 of `{"token": "ST$<token>"}`; requests then sign with `keyId` `ST$<token>` and the
//!   session key. Files: the token from `/var/run/secrets/kubernetes.io/serviceaccount/token`
//!   (env `OCI_KUBERNETES_SERVICE_ACCOUNT_TOKEN_PATH`; the Python SDK takes this path as an
//!   argument), the CA from `.../serviceaccount/ca.crt` (env
//!   `OCI_KUBERNETES_SERVICE_ACCOUNT_CERT_PATH`, the variable the SDKs read). Both are read
//!   again for every exchange (kubelet rotates projected tokens). As the SDKs do, a token
//!   whose JWT `exp` has passed is refused before it is sent. Env
//!   `MODELFS_OKE_PROXYMUX_ENDPOINT` (`https://host:port`) replaces
//!   `https://$KUBERNETES_SERVICE_HOST:12250` (tests; TLS and the CA still apply). The region is
//!   `parameters.region`, else `OCI_RESOURCE_PRINCIPAL_REGION` (full names such as
//!   `us-ashburn-1`; the SDKs' short aliases are not translated). A `403` adds the SDKs' hint
//!   that the cluster must be an enhanced cluster. The exchange happens once per resolve and
//!   once per fetch, as for instance principals (a fetch that outlives the token fails and is
//!   retried with a new one). Differences from the SDKs: no local retry of the exchange (the
//!   pipeline's and the reconciler's retries apply), and the token is not reused across
//!   resolves and fetches.
//!
//! Nothing here logs or reports key material or tokens (service account token, session tokens):
//! errors name files and fields, never values; the `keyId` of an API key (tenancy, user,
//! fingerprint) is public and may appear.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use std::time::Duration;

use base64::Engine as _;

use super::sign::{self, RequestToSign, SigningKey};
use crate::source::pipeline::TransferError as OciError;

const B64: base64::engine::GeneralPurpose = base64::engine::general_purpose::STANDARD;

/// `parameters.auth` values, spelled as OME spells them.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AuthMode {
    UserPrincipal,
    InstancePrincipal,
    ResourcePrincipal,
    OkeWorkloadIdentity,
}

impl AuthMode {
    /// `parameters.auth`; absent or empty is OME's default, `InstancePrincipal`.
    pub fn from_parameter(value: Option<&str>) -> Result<Self, OciError> {
        Ok(match value.map(str::trim).unwrap_or("") {
            "" | "InstancePrincipal" => AuthMode::InstancePrincipal,
            "UserPrincipal" => AuthMode::UserPrincipal,
            "ResourcePrincipal" => AuthMode::ResourcePrincipal,
            "OkeWorkloadIdentity" => AuthMode::OkeWorkloadIdentity,
            other => {
                return Err(OciError::Config {
                    what: "parameters.auth".into(),
                    detail: format!(
                        "unknown auth type {:?}; expected UserPrincipal, InstancePrincipal, \
                         ResourcePrincipal or OkeWorkloadIdentity",
                        other.chars().take(60).collect::<String>()
                    ),
                })
            }
        })
    }

    pub fn as_str(self) -> &'static str {
        match self {
            AuthMode::UserPrincipal => "UserPrincipal",
            AuthMode::InstancePrincipal => "InstancePrincipal",
            AuthMode::ResourcePrincipal => "ResourcePrincipal",
            AuthMode::OkeWorkloadIdentity => "OkeWorkloadIdentity",
        }
    }
}

/// A key to sign with and the region the credentials name (if any).
#[derive(Clone, Debug)]
pub struct Credentials {
    pub key: Arc<SigningKey>,
    pub region: Option<String>,
}

/// Where the agent's own OCI settings come from (env, read once at start).
#[derive(Clone, Debug, Default)]
pub struct AgentOciEnv {
    /// `OCI_CONFIG_PATH`, else `$HOME/.oci/config`.
    pub config_file: Option<PathBuf>,
    /// `PROFILE`, else `DEFAULT`.
    pub profile: String,
    /// The `OCI_RESOURCE_PRINCIPAL_*` variables.
    pub resource_principal: BTreeMap<String, String>,
    /// Base of the instance metadata service's v2 API.
    pub metadata_endpoint: String,
    /// Replaces `https://auth.<region>.oraclecloud.com`.
    pub auth_endpoint: Option<String>,
    /// OKE workload identity: the proxymux's base URL (`None` outside a pod), the service
    /// account token file and the CA bundle that signs the proxymux's certificate.
    pub oke_proxymux: Option<String>,
    pub oke_token_path: PathBuf,
    pub oke_ca_path: PathBuf,
}

/// Where Kubernetes mounts a pod's service account.
const SERVICE_ACCOUNT_DIR: &str = "/var/run/secrets/kubernetes.io/serviceaccount";
/// The proxymux's port on the API server's service address, as the SDKs hard-code it.
pub const OKE_PROXYMUX_PORT: u16 = 12250;

/// The proxymux's base URL: `overridden` (already trimmed), else
/// `https://<kubernetes service host>:12250` (an IPv6 address in brackets).
fn proxymux_base(overridden: Option<String>, service_host: Option<&str>) -> Option<String> {
    if overridden.is_some() {
        return overridden;
    }
    let host = service_host.map(str::trim).filter(|h| !h.is_empty())?;
    Some(if host.contains(':') && !host.starts_with('[') {
        format!("https://[{host}]:{OKE_PROXYMUX_PORT}")
    } else {
        format!("https://{host}:{OKE_PROXYMUX_PORT}")
    })
}

/// The instance metadata service of OCI compute instances.
pub const DEFAULT_METADATA_ENDPOINT: &str = "http://169.254.169.254/opc/v2";

impl AgentOciEnv {
    pub fn from_env() -> Self {
        let config_file = std::env::var_os("OCI_CONFIG_PATH")
            .map(PathBuf::from)
            .or_else(|| std::env::var_os("HOME").map(|h| Path::new(&h).join(".oci/config")));
        let profile = std::env::var("PROFILE")
            .ok()
            .filter(|p| !p.trim().is_empty())
            .unwrap_or_else(|| "DEFAULT".into());
        let resource_principal = std::env::vars()
            .filter(|(k, _)| k.starts_with("OCI_RESOURCE_PRINCIPAL_"))
            .collect();
        let endpoint = |name: &str| {
            std::env::var(name)
                .ok()
                .map(|e| e.trim().trim_end_matches('/').to_string())
                .filter(|e| !e.is_empty())
        };
        let path = |name: &str| {
            std::env::var_os(name)
                .filter(|p| !p.is_empty())
                .map(PathBuf::from)
        };
        Self {
            config_file,
            profile,
            resource_principal,
            metadata_endpoint: endpoint("MODELFS_OCI_METADATA_ENDPOINT")
                .unwrap_or_else(|| DEFAULT_METADATA_ENDPOINT.into()),
            auth_endpoint: endpoint("MODELFS_OCI_AUTH_ENDPOINT"),
            oke_proxymux: proxymux_base(
                endpoint("MODELFS_OKE_PROXYMUX_ENDPOINT"),
                std::env::var("KUBERNETES_SERVICE_HOST").ok().as_deref(),
            ),
            oke_token_path: path("OCI_KUBERNETES_SERVICE_ACCOUNT_TOKEN_PATH")
                .unwrap_or_else(|| Path::new(SERVICE_ACCOUNT_DIR).join("token")),
            oke_ca_path: path("OCI_KUBERNETES_SERVICE_ACCOUNT_CERT_PATH")
                .unwrap_or_else(|| Path::new(SERVICE_ACCOUNT_DIR).join("ca.crt")),
        }
    }
}

fn cred_err(mode: AuthMode, detail: impl Into<String>) -> OciError {
    OciError::Config {
        what: format!("OCI credentials ({})", mode.as_str()),
        detail: detail.into(),
    }
}

/// The credentials of one model: `secret` is the model's Secret entry (or standalone token).
/// Instance principals talk to the metadata and auth services through `http`, each request
/// bounded by `timeout`.
pub async fn credentials(
    mode: AuthMode,
    secret: Option<&str>,
    env: &AgentOciEnv,
    http: &reqwest::Client,
    timeout: Duration,
) -> Result<Credentials, OciError> {
    match mode {
        AuthMode::InstancePrincipal => return instance_principal(env, http, timeout).await,
        AuthMode::OkeWorkloadIdentity => return oke_workload_identity(env, timeout).await,
        AuthMode::UserPrincipal | AuthMode::ResourcePrincipal => {}
    }
    static_credentials(mode, secret, env)
}

/// The modes that need no network.
fn static_credentials(
    mode: AuthMode,
    secret: Option<&str>,
    env: &AgentOciEnv,
) -> Result<Credentials, OciError> {
    match mode {
        AuthMode::UserPrincipal => match secret {
            Some(text) if !text.trim().is_empty() => {
                user_from_text(text, None, "DEFAULT", "the model's Secret")
            }
            _ => {
                let path = env.config_file.as_ref().ok_or_else(|| {
                    cred_err(mode, "no OCI config file: set OCI_CONFIG_PATH or HOME")
                })?;
                let text = std::fs::read_to_string(path).map_err(|e| {
                    cred_err(
                        mode,
                        format!("reading the OCI config file {}: {e}", path.display()),
                    )
                })?;
                user_from_text(
                    &text,
                    path.parent(),
                    &env.profile,
                    &path.display().to_string(),
                )
            }
        },
        AuthMode::ResourcePrincipal => resource_principal(&env.resource_principal),
        AuthMode::InstancePrincipal | AuthMode::OkeWorkloadIdentity => Err(cred_err(
            mode,
            "this mode exchanges a token over the network (credentials(), not static)",
        )),
    }
}

/// A fresh session key pair for a token exchange (generated off the async runtime); its key id
/// is set once the token is known.
async fn session_key(mode: AuthMode) -> Result<SigningKey, OciError> {
    tokio::task::spawn_blocking(|| SigningKey::generate(String::new()))
        .await
        .map_err(|e| cred_err(mode, format!("generating the session key: {e}")))?
        .map_err(|e| cred_err(mode, format!("generating the session key: {e}")))
}

/// One GET of the instance metadata service (its v2 API wants `Authorization: Bearer Oracle`).
async fn metadata_get(
    env: &AgentOciEnv,
    http: &reqwest::Client,
    timeout: Duration,
    path: &str,
) -> Result<String, OciError> {
    let url = format!("{}{path}", env.metadata_endpoint);
    let what = format!("instance principal: instance metadata {url}");
    let request = http
        .get(&url)
        .header(reqwest::header::AUTHORIZATION, "Bearer Oracle")
        .send();
    let resp = tokio::time::timeout(timeout, request)
        .await
        .map_err(|_| OciError::Stalled {
            what: what.clone(),
            secs: timeout.as_secs(),
        })?
        .map_err(|e| super::network(&what, e))?;
    let status = resp.status();
    if !status.is_success() {
        let transient = status.is_server_error() || status.as_u16() == 429;
        let detail = format!("HTTP {}", status.as_u16());
        return Err(if transient {
            OciError::Network { what, detail }
        } else {
            cred_err(AuthMode::InstancePrincipal, format!("{what}: {detail}"))
        });
    }
    tokio::time::timeout(timeout, resp.text())
        .await
        .map_err(|_| OciError::Stalled {
            what: what.clone(),
            secs: timeout.as_secs(),
        })?
        .map_err(|e| super::network(&what, e))
}

async fn instance_principal(
    env: &AgentOciEnv,
    http: &reqwest::Client,
    timeout: Duration,
) -> Result<Credentials, OciError> {
    let mode = AuthMode::InstancePrincipal;
    let cert_pem = metadata_get(env, http, timeout, "/identity/cert.pem").await?;
    let key_pem = metadata_get(env, http, timeout, "/identity/key.pem").await?;
    let intermediate_pem = metadata_get(env, http, timeout, "/identity/intermediate.pem").await?;
    let region = metadata_get(env, http, timeout, "/instance/canonicalRegionName")
        .await?
        .trim()
        .to_string();
    if region.is_empty()
        || !region
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || c == '-')
    {
        return Err(cred_err(mode, "the metadata service gave no valid region"));
    }
    let cert = sign::pem_der(&cert_pem, "CERTIFICATE")
        .ok_or_else(|| cred_err(mode, "the instance certificate is not PEM"))?;
    let intermediate = sign::pem_der(&intermediate_pem, "CERTIFICATE")
        .ok_or_else(|| cred_err(mode, "the intermediate certificate is not PEM"))?;
    let tenancy = sign::certificate_attribute(&cert, "opc-tenant:")
        .or_else(|| sign::certificate_attribute(&cert, "opc-identity:"))
        .ok_or_else(|| {
            cred_err(
                mode,
                "the instance certificate names no tenancy (OU=opc-tenant:)",
            )
        })?;
    let fingerprint = sign::certificate_sha256_fingerprint(&cert);
    let leaf = SigningKey::from_pem(format!("{tenancy}/fed-x509-sha256/{fingerprint}"), &key_pem)
        .map_err(|e| cred_err(mode, format!("the instance key: {e}")))?;
    let session = session_key(mode).await?;
    let body = serde_json::json!({
        "certificate": B64.encode(&cert),
        "publicKey": B64.encode(session.public_key_spki()),
        "intermediateCertificates": [B64.encode(&intermediate)],
        "purpose": "DEFAULT",
        "fingerprintAlgorithm": "SHA256",
    })
    .to_string();
    let base = env
        .auth_endpoint
        .clone()
        .unwrap_or_else(|| format!("https://auth.{region}.oraclecloud.com"));
    let url = reqwest::Url::parse(&format!("{base}/v1/x509"))
        .map_err(|e| cred_err(mode, format!("auth endpoint {base}: {e}")))?;
    let what = format!("instance principal: token exchange at {base}");
    let headers = leaf.sign(&RequestToSign {
        method: "POST",
        path_and_query: url.path(),
        host: &sign::host_header(&url),
        date: &sign::http_date_now(),
        body: Some((body.as_bytes(), "application/json")),
    });
    let mut request = http.post(url.clone()).body(body);
    for (name, value) in headers {
        request = request.header(name, value);
    }
    let (status, text) = send_for_text(&what, request, timeout).await?;
    if !(200..300).contains(&status) {
        return Err(service_error(what, status, &text, ""));
    }
    let json: serde_json::Value = serde_json::from_str(&text).unwrap_or_default();
    let token = json
        .get("token")
        .and_then(|t| t.as_str())
        .filter(|t| !t.is_empty() && t.chars().all(|c| c.is_ascii_graphic()))
        .ok_or_else(|| OciError::Protocol {
            what: what.clone(),
            detail: "no token in the answer".into(),
        })?;
    Ok(Credentials {
        key: Arc::new(session.with_key_id(format!("ST${token}"))),
        region: Some(region),
    })
}

/// Sends a token exchange and reads its answer as text, each step within `timeout`. Returns
/// the status and the body.
async fn send_for_text(
    what: &str,
    request: reqwest::RequestBuilder,
    timeout: Duration,
) -> Result<(u16, String), OciError> {
    let stalled = || OciError::Stalled {
        what: what.to_string(),
        secs: timeout.as_secs(),
    };
    let resp = tokio::time::timeout(timeout, request.send())
        .await
        .map_err(|_| stalled())?
        .map_err(|e| super::network(what, e))?;
    let status = resp.status().as_u16();
    let text = tokio::time::timeout(timeout, resp.text())
        .await
        .map_err(|_| stalled())?
        .map_err(|e| super::network(what, e))?;
    Ok((status, text))
}

/// A refused token exchange: the service's error JSON (`code`, `message`; control characters
/// dropped, at most 300 characters each) when there is one, else `fallback` as the message. Any
/// other body is not repeated (it could echo what was sent).
fn service_error(what: String, status: u16, text: &str, fallback: &str) -> OciError {
    let json: serde_json::Value = serde_json::from_str(text).unwrap_or_default();
    let field = |k: &str| {
        json.get(k).and_then(|v| v.as_str()).map(|s| {
            s.chars()
                .filter(|c| !c.is_control())
                .take(300)
                .collect::<String>()
        })
    };
    OciError::Status {
        what,
        status,
        code: field("code"),
        message: field("message").unwrap_or_else(|| fallback.to_string()),
        retry_after: None,
    }
}

/// The `exp` claim (seconds since the epoch) of a JWT, if `token` is one and has it. Only the
/// payload is decoded; nothing is verified (the proxymux does that).
fn jwt_expiry(token: &str) -> Option<u64> {
    let payload = token.split('.').nth(1)?;
    let json = base64::engine::general_purpose::URL_SAFE_NO_PAD
        .decode(payload.trim_end_matches('='))
        .ok()?;
    let claims: serde_json::Value = serde_json::from_slice(&json).ok()?;
    let exp = claims.get("exp")?;
    exp.as_u64().or_else(|| exp.as_f64().map(|f| f as u64))
}

/// A file of the pod's service account, read for one exchange; the error names the file.
fn service_account_file(what: &str, path: &Path) -> Result<Vec<u8>, OciError> {
    std::fs::read(path).map_err(|e| {
        cred_err(
            AuthMode::OkeWorkloadIdentity,
            format!("reading the service account {what} {}: {e}", path.display()),
        )
    })
}

/// A request id for the exchange (`opc-request-id`), as the SDKs send one.
fn opc_request_id() -> String {
    (0..32)
        .map(|_| char::from(b"0123456789ABCDEF"[fastrand::usize(..16)]))
        .collect()
}

async fn oke_workload_identity(
    env: &AgentOciEnv,
    timeout: Duration,
) -> Result<Credentials, OciError> {
    let mode = AuthMode::OkeWorkloadIdentity;
    let base = env.oke_proxymux.clone().ok_or_else(|| {
        cred_err(
            mode,
            "KUBERNETES_SERVICE_HOST is not set: OKE workload identity works in a pod of an \
             enhanced OKE cluster (the proxymux is at $KUBERNETES_SERVICE_HOST:12250)",
        )
    })?;
    if !base.starts_with("https://") {
        return Err(cred_err(
            mode,
            format!(
                "the proxymux endpoint {base} is not https:// (the service account token is \
                 only sent over TLS)"
            ),
        ));
    }
    let token_path = &env.oke_token_path;
    let sa_token = String::from_utf8(service_account_file("token", token_path)?)
        .map_err(|_| cred_err(mode, format!("{} is not UTF-8", token_path.display())))?;
    let sa_token = sa_token.trim();
    if sa_token.is_empty() {
        return Err(cred_err(
            mode,
            format!(
                "the service account token {} is empty",
                token_path.display()
            ),
        ));
    }
    if sa_token.chars().any(|c| !c.is_ascii_graphic()) {
        return Err(cred_err(
            mode,
            format!(
                "the service account token {} holds characters a header cannot carry",
                token_path.display()
            ),
        ));
    }
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap_or_default()
        .as_secs();
    if let Some(exp) = jwt_expiry(sa_token).filter(|&exp| exp <= now) {
        return Err(cred_err(
            mode,
            format!(
                "the service account token {} expired {}s ago (JWT exp {exp})",
                token_path.display(),
                now - exp
            ),
        ));
    }
    let ca = service_account_file("CA", &env.oke_ca_path)?;
    let roots = reqwest::Certificate::from_pem_bundle(&ca)
        .ok()
        .filter(|certs| !certs.is_empty())
        .ok_or_else(|| {
            cred_err(
                mode,
                format!(
                    "the service account CA {} holds no PEM certificate",
                    env.oke_ca_path.display()
                ),
            )
        })?;
    let _ = rustls::crypto::ring::default_provider().install_default();
    let http = reqwest::Client::builder()
        .tls_certs_only(roots)
        .connect_timeout(timeout)
        .build()
        .map_err(|e| cred_err(mode, format!("the proxymux client: {e}")))?;

    let session = session_key(mode).await?;
    let body = serde_json::json!({ "podKey": B64.encode(session.public_key_spki()) }).to_string();
    let what = format!("OKE workload identity: token exchange at {base}");
    let request = http
        .post(format!("{base}/resourcePrincipalSessionTokens"))
        .bearer_auth(sa_token)
        .header(reqwest::header::CONTENT_TYPE, "application/json")
        .header("opc-request-id", opc_request_id())
        .body(body);
    let (status, text) = send_for_text(&what, request, timeout).await?;
    if !(200..300).contains(&status) {
        let mut err = service_error(
            what,
            status,
            &text,
            "the proxymux refused the service account token",
        );
        if let OciError::Status { message, .. } = &mut err {
            if status == 403 {
                message.push_str(" (OKE workload identity needs an enhanced cluster)");
            }
        }
        return Err(err);
    }
    // base64 of {"token": "ST$<token>"}; the SDKs drop the three-character prefix.
    let token = B64
        .decode(text.trim())
        .ok()
        .and_then(|json| serde_json::from_slice::<serde_json::Value>(&json).ok())
        .and_then(|v| v.get("token")?.as_str().map(str::to_string))
        .ok_or_else(|| OciError::Protocol {
            what: what.clone(),
            detail: "the answer is not the base64 of {\"token\": ...}".into(),
        })?;
    let token = token.strip_prefix("ST$").unwrap_or(&token);
    if token.is_empty() || !token.chars().all(|c| c.is_ascii_graphic()) {
        return Err(OciError::Protocol {
            what,
            detail: "the session token is empty or not printable ASCII".into(),
        });
    }
    let region = env
        .resource_principal
        .get("OCI_RESOURCE_PRINCIPAL_REGION")
        .map(|r| r.trim().to_string())
        .filter(|r| !r.is_empty());
    Ok(Credentials {
        key: Arc::new(session.with_key_id(format!("ST${token}"))),
        region,
    })
}

/// Profiles of an OCI config file (INI: `[NAME]` sections of `key=value`; `#` comments).
fn parse_config(text: &str) -> BTreeMap<String, BTreeMap<String, String>> {
    let mut profiles: BTreeMap<String, BTreeMap<String, String>> = BTreeMap::new();
    let mut current = "DEFAULT".to_string();
    for line in text.lines() {
        let line = line.trim();
        if line.is_empty() || line.starts_with('#') || line.starts_with(';') {
            continue;
        }
        if line.starts_with("-----BEGIN ") {
            break; // an inline PEM key follows the profile
        }
        if let Some(name) = line.strip_prefix('[').and_then(|l| l.strip_suffix(']')) {
            current = name.trim().to_string();
            profiles.entry(current.clone()).or_default();
            continue;
        }
        if let Some((k, v)) = line.split_once('=') {
            profiles
                .entry(current.clone())
                .or_default()
                .insert(k.trim().to_string(), v.trim().to_string());
        }
    }
    profiles
}

fn expand_path(value: &str, base: Option<&Path>) -> PathBuf {
    if let Some(rest) = value.strip_prefix("~/") {
        if let Some(home) = std::env::var_os("HOME") {
            return Path::new(&home).join(rest);
        }
    }
    let p = PathBuf::from(value);
    match base {
        Some(b) if p.is_relative() => b.join(p),
        _ => p,
    }
}

fn user_from_text(
    text: &str,
    base: Option<&Path>,
    profile: &str,
    origin: &str,
) -> Result<Credentials, OciError> {
    let mode = AuthMode::UserPrincipal;
    let profiles = parse_config(text);
    let mut values = profiles.get("DEFAULT").cloned().unwrap_or_default();
    match profiles.get(profile) {
        Some(p) => values.extend(p.clone()),
        None if profile != "DEFAULT" => {
            return Err(cred_err(
                mode,
                format!("{origin} has no profile [{profile}]"),
            ))
        }
        None => {}
    }
    let get = |k: &str| values.get(k).filter(|v| !v.is_empty()).cloned();
    let key_id = match get("security_token_file") {
        Some(file) => {
            let path = expand_path(&file, base);
            let token = std::fs::read_to_string(&path).map_err(|e| {
                cred_err(
                    mode,
                    format!("reading security_token_file {}: {e}", path.display()),
                )
            })?;
            format!("ST${}", token.trim())
        }
        None => {
            let mut missing = Vec::new();
            let mut field = |k: &'static str| {
                get(k).unwrap_or_else(|| {
                    missing.push(k);
                    String::new()
                })
            };
            let (tenancy, user, fingerprint) =
                (field("tenancy"), field("user"), field("fingerprint"));
            if !missing.is_empty() {
                return Err(cred_err(
                    mode,
                    format!("{origin} [{profile}] lacks {}", missing.join(", ")),
                ));
            }
            format!("{tenancy}/{user}/{fingerprint}")
        }
    };
    let pem = if text.contains("-----BEGIN ") {
        text.to_string()
    } else {
        let key_file = get("key_file").ok_or_else(|| {
            cred_err(
                mode,
                format!("{origin} [{profile}] has no key_file and no inline PEM key"),
            )
        })?;
        let path = expand_path(&key_file, base);
        std::fs::read_to_string(&path)
            .map_err(|e| cred_err(mode, format!("reading key_file {}: {e}", path.display())))?
    };
    let key = SigningKey::from_pem(key_id, &pem)
        .map_err(|e| cred_err(mode, format!("{origin} [{profile}]: {e}")))?;
    Ok(Credentials {
        key: Arc::new(key),
        region: get("region"),
    })
}

/// A value that is either the material itself or the absolute path of a file holding it.
fn value_or_file(name: &str, value: &str) -> Result<String, OciError> {
    if value.starts_with('/') {
        std::fs::read_to_string(value)
            .map(|s| s.trim().to_string())
            .map_err(|e| {
                cred_err(
                    AuthMode::ResourcePrincipal,
                    format!("reading {name} ({value}): {e}"),
                )
            })
    } else {
        Ok(value.trim().to_string())
    }
}

fn resource_principal(env: &BTreeMap<String, String>) -> Result<Credentials, OciError> {
    let mode = AuthMode::ResourcePrincipal;
    let get = |k: &str| env.get(k).filter(|v| !v.trim().is_empty());
    let version = get("OCI_RESOURCE_PRINCIPAL_VERSION").ok_or_else(|| {
        cred_err(
            mode,
            "OCI_RESOURCE_PRINCIPAL_VERSION is not set in the agent's environment",
        )
    })?;
    if version.trim() != "2.2" {
        return Err(cred_err(
            mode,
            format!("OCI_RESOURCE_PRINCIPAL_VERSION {version:?} is not supported (only 2.2)"),
        ));
    }
    let need = |k: &str| {
        get(k)
            .cloned()
            .ok_or_else(|| cred_err(mode, format!("{k} is not set in the agent's environment")))
    };
    let token = value_or_file(
        "OCI_RESOURCE_PRINCIPAL_RPST",
        &need("OCI_RESOURCE_PRINCIPAL_RPST")?,
    )?;
    let pem = value_or_file(
        "OCI_RESOURCE_PRINCIPAL_PRIVATE_PEM",
        &need("OCI_RESOURCE_PRINCIPAL_PRIVATE_PEM")?,
    )?;
    if get("OCI_RESOURCE_PRINCIPAL_PRIVATE_PEM_PASSPHRASE").is_some() {
        return Err(cred_err(
            mode,
            "an encrypted resource principal key (OCI_RESOURCE_PRINCIPAL_PRIVATE_PEM_PASSPHRASE) \
             is not supported",
        ));
    }
    let key = SigningKey::from_pem(format!("ST${token}"), &pem)
        .map_err(|e| cred_err(mode, format!("OCI_RESOURCE_PRINCIPAL_PRIVATE_PEM: {e}")))?;
    Ok(Credentials {
        key: Arc::new(key),
        region: get("OCI_RESOURCE_PRINCIPAL_REGION").cloned(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::source::oci::sign::tests::generated_key_pem;

    #[test]
    fn user_principal_from_a_config_file_with_profiles() {
        let dir = tempfile::tempdir().unwrap();
        generated_key_pem(dir.path(), "key.pem", false);
        let config = "[DEFAULT]\ntenancy=ocid1.tenancy.oc1..t\nregion=us-ashburn-1\n\
                      [OTHER]\nuser=ocid1.user.oc1..u\nfingerprint=aa:bb\nkey_file=key.pem\n";
        std::fs::write(dir.path().join("config"), config).unwrap();
        let env = AgentOciEnv {
            config_file: Some(dir.path().join("config")),
            profile: "OTHER".into(),
            ..Default::default()
        };
        let c = static_credentials(AuthMode::UserPrincipal, None, &env).unwrap();
        assert_eq!(
            c.key.key_id(),
            "ocid1.tenancy.oc1..t/ocid1.user.oc1..u/aa:bb"
        );
        assert_eq!(c.region.as_deref(), Some("us-ashburn-1"));
        // DEFAULT lacks user and fingerprint: named, no values shown.
        let env = AgentOciEnv {
            profile: "DEFAULT".into(),
            ..env
        };
        let e = static_credentials(AuthMode::UserPrincipal, None, &env)
            .unwrap_err()
            .to_string();
        assert!(e.contains("lacks user, fingerprint"), "{e}");
        let env = AgentOciEnv {
            profile: "NOPE".into(),
            ..env
        };
        assert!(static_credentials(AuthMode::UserPrincipal, None, &env)
            .unwrap_err()
            .to_string()
            .contains("no profile [NOPE]"));
    }

    #[test]
    fn user_principal_from_a_secret_with_the_key_inline() {
        let dir = tempfile::tempdir().unwrap();
        let pem = generated_key_pem(dir.path(), "key.pem", true);
        let secret = format!("[DEFAULT]\nuser=u\nfingerprint=f\ntenancy=t\n{pem}");
        let c = static_credentials(
            AuthMode::UserPrincipal,
            Some(&secret),
            &AgentOciEnv::default(),
        )
        .unwrap();
        assert_eq!(c.key.key_id(), "t/u/f");
        let broken = secret.replace("MII", "XXX");
        let e = static_credentials(
            AuthMode::UserPrincipal,
            Some(&broken),
            &AgentOciEnv::default(),
        )
        .unwrap_err()
        .to_string();
        assert!(!e.contains("XXX"), "no key material in errors: {e}");
    }

    #[test]
    fn resource_principal_from_env_values_or_files() {
        let dir = tempfile::tempdir().unwrap();
        let pem = generated_key_pem(dir.path(), "rp.pem", false);
        std::fs::write(dir.path().join("rpst"), "tok123\n").unwrap();
        let mut env = BTreeMap::new();
        env.insert(
            "OCI_RESOURCE_PRINCIPAL_VERSION".to_string(),
            "2.2".to_string(),
        );
        env.insert(
            "OCI_RESOURCE_PRINCIPAL_RPST".to_string(),
            dir.path().join("rpst").display().to_string(),
        );
        env.insert("OCI_RESOURCE_PRINCIPAL_PRIVATE_PEM".to_string(), pem);
        env.insert(
            "OCI_RESOURCE_PRINCIPAL_REGION".to_string(),
            "eu-frankfurt-1".to_string(),
        );
        let agent = AgentOciEnv {
            resource_principal: env.clone(),
            ..Default::default()
        };
        let c = static_credentials(AuthMode::ResourcePrincipal, None, &agent).unwrap();
        assert_eq!(c.key.key_id(), "ST$tok123");
        assert_eq!(c.region.as_deref(), Some("eu-frankfurt-1"));
        assert!(!format!("{:?}", c.key).contains("tok123"));
        env.insert(
            "OCI_RESOURCE_PRINCIPAL_VERSION".to_string(),
            "1.1".to_string(),
        );
        let agent = AgentOciEnv {
            resource_principal: env,
            ..Default::default()
        };
        assert!(static_credentials(AuthMode::ResourcePrincipal, None, &agent).is_err());
    }

    #[test]
    fn auth_parameter_as_ome_spells_it() {
        assert_eq!(
            AuthMode::from_parameter(None).unwrap(),
            AuthMode::InstancePrincipal
        );
        assert_eq!(
            AuthMode::from_parameter(Some("UserPrincipal")).unwrap(),
            AuthMode::UserPrincipal
        );
        assert!(AuthMode::from_parameter(Some("user_principal")).is_err());
        assert_eq!(
            AuthMode::from_parameter(Some("OkeWorkloadIdentity")).unwrap(),
            AuthMode::OkeWorkloadIdentity
        );
    }

    #[test]
    fn the_proxymux_is_the_api_servers_address_on_port_12250() {
        assert_eq!(
            proxymux_base(None, Some("10.96.0.1")).as_deref(),
            Some("https://10.96.0.1:12250")
        );
        assert_eq!(
            proxymux_base(None, Some(" fd00::1 ")).as_deref(),
            Some("https://[fd00::1]:12250")
        );
        assert_eq!(
            proxymux_base(Some("https://127.0.0.1:4443".into()), Some("10.96.0.1")).as_deref(),
            Some("https://127.0.0.1:4443"),
            "the test override wins"
        );
        assert_eq!(proxymux_base(None, Some("")), None);
        assert_eq!(proxymux_base(None, None), None);
    }

    #[test]
    fn jwt_expiry_reads_the_payload_only() {
        let b64 = |s: &str| base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(s);
        let jwt = format!(
            "{}.{}.sig",
            b64("{\"alg\":\"RS256\"}"),
            b64("{\"exp\":1700000000}")
        );
        assert_eq!(jwt_expiry(&jwt), Some(1_700_000_000));
        let no_exp = format!("{}.{}.sig", b64("{}"), b64("{\"sub\":\"x\"}"));
        assert_eq!(jwt_expiry(&no_exp), None);
        assert_eq!(jwt_expiry("opaque-token"), None);
    }

    fn oke_env(dir: &Path) -> AgentOciEnv {
        AgentOciEnv {
            oke_proxymux: Some("https://127.0.0.1:1".into()),
            oke_token_path: dir.join("token"),
            oke_ca_path: dir.join("ca.crt"),
            ..Default::default()
        }
    }

    async fn oke_error(env: &AgentOciEnv) -> String {
        credentials(
            AuthMode::OkeWorkloadIdentity,
            None,
            env,
            &reqwest::Client::builder().build().unwrap(),
            Duration::from_secs(5),
        )
        .await
        .unwrap_err()
        .to_string()
    }

    #[tokio::test]
    async fn oke_workload_identity_errors_name_files_and_never_the_token() {
        let _ = rustls::crypto::ring::default_provider().install_default();
        let dir = tempfile::tempdir().unwrap();
        // Outside a pod.
        let e = oke_error(&AgentOciEnv::default()).await;
        assert!(e.contains("KUBERNETES_SERVICE_HOST is not set"), "{e}");
        // The token is only sent over TLS.
        let env = AgentOciEnv {
            oke_proxymux: Some("http://127.0.0.1:1".into()),
            ..oke_env(dir.path())
        };
        assert!(oke_error(&env).await.contains("not https://"));
        // No token file.
        let env = oke_env(dir.path());
        let e = oke_error(&env).await;
        assert!(e.contains("reading the service account token"), "{e}");
        assert!(
            e.contains(&dir.path().join("token").display().to_string()),
            "{e}"
        );
        // An expired token is refused before it is sent; its text is not shown.
        let b64 = |s: &str| base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(s);
        let expired = format!("{}.{}.SECRETSIG", b64("{}"), b64("{\"exp\":1000}"));
        std::fs::write(dir.path().join("token"), &expired).unwrap();
        let e = oke_error(&env).await;
        assert!(e.contains("expired") && e.contains("exp 1000"), "{e}");
        assert!(!e.contains("SECRETSIG") && !e.contains(&expired), "{e}");
        // A valid token, no CA; then a CA file without a certificate.
        let fresh = format!("{}.{}.SECRETSIG", b64("{}"), b64("{\"exp\":99999999999}"));
        std::fs::write(dir.path().join("token"), &fresh).unwrap();
        let e = oke_error(&env).await;
        assert!(
            e.contains("reading the service account CA")
                && e.contains(&dir.path().join("ca.crt").display().to_string()),
            "{e}"
        );
        std::fs::write(dir.path().join("ca.crt"), "not a certificate\n").unwrap();
        let e = oke_error(&env).await;
        assert!(e.contains("holds no PEM certificate"), "{e}");
        assert!(!e.contains("SECRETSIG"), "{e}");
    }
}
