//! Fetching through an HTTP proxy: how a fleet of nodes pulls one copy of a model through a
//! caching proxy (Dragonfly's dfdaemon, Squid, a corporate proxy) instead of each node going
//! to the origin. modelfs does not cache across nodes itself; it makes sure every source can
//! be pointed at an engine that does (deploy/overlays/dragonfly).
//!
//! Two layers, in this order of precedence:
//! * **Per-scheme flags** (`--proxy-hf`, `--proxy-s3`, `--proxy-gs`, `--proxy-az`,
//!   `--proxy-oci`, or `MODELFS_PROXY_<SCHEME>`): every request of that source goes to this
//!   proxy, whatever the target's scheme (`http://` as an absolute-URI request, `https://`
//!   through `CONNECT`). A flag replaces the environment's proxies for that source. This is
//!   the form to prefer in a cluster: it proxies model bytes and nothing else (a global
//!   `HTTPS_PROXY` would also have to exclude the API server and every other endpoint).
//! * **The environment**, as curl and most HTTP stacks read it: `HTTP_PROXY` for `http://`
//!   targets, `HTTPS_PROXY` for `https://`, `ALL_PROXY` for both (lower-case forms too).
//!   Sources without a flag use it; reqwest reads it when a client is built, so no client
//!   builder of a source may call `no_proxy()` (only clients that talk to the local daemon
//!   do).
//!
//! `NO_PROXY` (or `no_proxy`: comma-separated host names, domain suffixes, IP addresses and
//! CIDR blocks, `*` for all) is honoured by both layers, as curl does with `--proxy`: a host
//! that must never go through the proxy (an in-cluster mirror) is listed once for all.
//!
//! A proxy URL may carry credentials (`http://user:secret@proxy:3128`): they are sent as
//! `Proxy-Authorization` and never shown. A password on the command line shows in `ps` to
//! every user of the node, so it can come from elsewhere: the whole URL from
//! `MODELFS_PROXY_<SCHEME>`, or the password alone from a file (`--proxy-password-file`, a
//! mounted Secret) for every proxy URL that names a user without one
//! ([`ProxyUrl::with_password`]). [`ProxyUrl`]'s `Debug` and `Display` print the URL
//! without credentials. One limit, reqwest's: for a plain `http://` target, a redirect to another
//! host is sent to the proxy without the credentials (reqwest strips the header on a
//! cross-host redirect and does not add it back); `https://` targets (the real hub, the
//! clouds) carry them on every `CONNECT` and are not affected.

use std::fmt;

/// A validated proxy URL (`http://` or `https://`, with a host).
#[derive(Clone, PartialEq, Eq)]
pub struct ProxyUrl(reqwest::Url);

impl ProxyUrl {
    pub fn parse(text: &str) -> Result<Self, String> {
        let url = reqwest::Url::parse(text.trim())
            .map_err(|e| format!("proxy URL {:?}: {e}", redact_unparsed(text)))?;
        let shown = ProxyUrl(url.clone()).to_string();
        if !matches!(url.scheme(), "http" | "https") {
            return Err(format!(
                "proxy URL {shown}: scheme {:?} is not supported (use http:// or https://)",
                url.scheme()
            ));
        }
        if url.host_str().is_none_or(str::is_empty) {
            return Err(format!("proxy URL {shown}: no host"));
        }
        Ok(ProxyUrl(url))
    }

    /// The URL with its credentials, for the HTTP client only (never for logs or status).
    pub fn expose(&self) -> &str {
        self.0.as_str()
    }

    /// Whether the URL names a user but no password (`http://fleet@proxy:3128`).
    pub fn wants_password(&self) -> bool {
        !self.0.username().is_empty() && self.0.password().is_none()
    }

    /// The URL with `password` for its user (the URL must name one).
    pub fn with_password(&self, password: &str) -> Result<Self, String> {
        let mut url = self.0.clone();
        url.set_password(Some(password))
            .map_err(|()| format!("proxy URL {self}: cannot carry a password"))?;
        Ok(ProxyUrl(url))
    }

    /// Routes every request of `builder`'s client through this proxy, except hosts that
    /// `NO_PROXY` lists. Replaces the proxies the client would take from the environment.
    pub fn apply(
        &self,
        builder: reqwest::ClientBuilder,
    ) -> reqwest::Result<reqwest::ClientBuilder> {
        let proxy = reqwest::Proxy::all(self.0.clone())?.no_proxy(reqwest::NoProxy::from_env());
        Ok(builder.proxy(proxy))
    }
}

/// A client builder with the proxy of one source: the flag's if given (see [`ProxyUrl::apply`]),
/// else the environment's, which reqwest applies by itself.
pub fn configure(
    proxy: Option<&ProxyUrl>,
    builder: reqwest::ClientBuilder,
) -> reqwest::Result<reqwest::ClientBuilder> {
    match proxy {
        Some(p) => p.apply(builder),
        None => Ok(builder),
    }
}

/// `NO_PROXY` (or `no_proxy`) as set, for clients configured by string (the `object_store`
/// crate's `proxy_excludes` takes the same syntax).
pub fn no_proxy_from_env() -> Option<String> {
    ["NO_PROXY", "no_proxy"]
        .iter()
        .find_map(|v| std::env::var(v).ok())
        .filter(|v| !v.trim().is_empty())
}

/// Without user name and password.
impl fmt::Display for ProxyUrl {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut shown = self.0.clone();
        if !shown.username().is_empty() || shown.password().is_some() {
            let _ = shown.set_username("***");
            let _ = shown.set_password(None);
        }
        f.write_str(shown.as_str())
    }
}

impl fmt::Debug for ProxyUrl {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "ProxyUrl({self})")
    }
}

/// A text that did not parse as a URL, with anything between `://` and `@` hidden.
fn redact_unparsed(text: &str) -> String {
    match (text.find("://"), text.rfind('@')) {
        (Some(start), Some(at)) if at > start => {
            format!("{}***{}", &text[..start + 3], &text[at..])
        }
        _ => text.to_string(),
    }
}

/// The per-scheme proxies of the daemon (`--proxy-<scheme>`); `None` means the environment's.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Proxies {
    pub hf: Option<ProxyUrl>,
    pub s3: Option<ProxyUrl>,
    pub gs: Option<ProxyUrl>,
    pub az: Option<ProxyUrl>,
    pub oci: Option<ProxyUrl>,
}

impl Proxies {
    /// Sets `password` on every proxy URL that names a user without a password; an error if
    /// none does (the file would be silently unused).
    pub fn with_password(self, password: &str) -> Result<Self, String> {
        let mut used = false;
        let mut set = |p: Option<ProxyUrl>| -> Result<Option<ProxyUrl>, String> {
            match p {
                Some(p) if p.wants_password() => {
                    used = true;
                    p.with_password(password).map(Some)
                }
                other => Ok(other),
            }
        };
        let out = Proxies {
            hf: set(self.hf)?,
            s3: set(self.s3)?,
            gs: set(self.gs)?,
            az: set(self.az)?,
            oci: set(self.oci)?,
        };
        if !used {
            return Err("no --proxy-<scheme> URL names a user without a password \
                        (http://user@proxy:port) for the password file"
                .into());
        }
        Ok(out)
    }

    /// The proxy of a `storageUri` scheme (`hf`, `s3`, `gs`, `az`, `oci`).
    pub fn for_scheme(&self, scheme: &str) -> Option<&ProxyUrl> {
        match scheme {
            "hf" => self.hf.as_ref(),
            "s3" => self.s3.as_ref(),
            "gs" => self.gs.as_ref(),
            "az" => self.az.as_ref(),
            "oci" => self.oci.as_ref(),
            _ => None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn credentials_never_show() {
        let p = ProxyUrl::parse("http://alice:s3cret@proxy.local:3128").unwrap();
        assert_eq!(p.expose(), "http://alice:s3cret@proxy.local:3128/");
        for shown in [p.to_string(), format!("{p:?}")] {
            assert!(
                !shown.contains("s3cret") && !shown.contains("alice"),
                "{shown}"
            );
            assert!(shown.contains("proxy.local:3128"), "{shown}");
        }
        let err = ProxyUrl::parse("http://alice:s3cret@[bad").unwrap_err();
        assert!(!err.contains("s3cret"), "{err}");
        let err = ProxyUrl::parse("socks5://alice:s3cret@proxy:1080").unwrap_err();
        assert!(!err.contains("s3cret") && err.contains("socks5"), "{err}");
    }

    #[test]
    fn only_http_proxies_with_a_host() {
        assert!(ProxyUrl::parse("http://127.0.0.1:4001").is_ok());
        assert!(ProxyUrl::parse("https://proxy:443").is_ok());
        assert!(ProxyUrl::parse("127.0.0.1:4001").is_err());
        assert!(ProxyUrl::parse("file:///tmp/x").is_err());
        assert!(ProxyUrl::parse("").is_err());
    }

    #[test]
    fn scheme_lookup() {
        let p = ProxyUrl::parse("http://p:1").unwrap();
        let proxies = Proxies {
            s3: Some(p.clone()),
            ..Proxies::default()
        };
        assert_eq!(proxies.for_scheme("s3"), Some(&p));
        assert_eq!(proxies.for_scheme("hf"), None);
        assert_eq!(proxies.for_scheme("local"), None);
    }
}
