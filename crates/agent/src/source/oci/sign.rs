//! OCI request signing, written to Oracle's published specification ("Request Signatures" in
//! the OCI documentation, a profile of draft-cavage-http-signatures-08).
//!
//! * Algorithm `rsa-sha256`: RSASSA-PKCS1-v1_5 with SHA-256 over the *signing string*.
//! * The signing string is one `name: value` line per signed header, joined by `\n`, in the
//!   order of the `headers` parameter. The pseudo-header `(request-target)` is the lowercase
//!   method, a space, and the path with its query string exactly as sent.
//! * Every request signs `date (request-target) host`. A request with a body (POST, PUT) also
//!   signs `x-content-sha256` (base64 SHA-256 of the body), `content-type` and `content-length`.
//! * The header is `Authorization: Signature version="1",keyId="...",algorithm="rsa-sha256",
//!   headers="...",signature="<base64>"`. `keyId` is `<tenancy>/<user>/<fingerprint>` for an
//!   API key, and `ST$<token>` for a session token (instance and resource principals, OKE
//!   workload identity).
//!
//! The service rejects a `date` more than five minutes from its clock. Both the client side
//! ([`SigningKey`]) and the verifier of the development look-alike
//! (`modelfs_devhub::oci`: [`parse_authorization`], [`verify`]) live here, so the two sides share the
//! one signing-string builder and a test drives the look-alike with the official `oci` Python
//! SDK to prove that builder matches the service.

use base64::Engine as _;
use ring::rand::SystemRandom;
use ring::signature::{self, RsaKeyPair};
use sha2::{Digest, Sha256};

const B64: base64::engine::GeneralPurpose = base64::engine::general_purpose::STANDARD;

/// Headers signed on every request.
pub const BASE_HEADERS: [&str; 3] = ["date", "(request-target)", "host"];
/// Additionally signed on requests with a body.
pub const BODY_HEADERS: [&str; 3] = ["x-content-sha256", "content-type", "content-length"];

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum KeyError {
    #[error("the private key is not PEM (expected -----BEGIN PRIVATE KEY----- or -----BEGIN RSA PRIVATE KEY-----)")]
    NotPem,
    #[error(
        "the private key is encrypted; give modelfs an unencrypted key (openssl rsa -in KEY -out \
         KEY.plain)"
    )]
    Encrypted,
    #[error("the private key is not a usable RSA key (2048 to 8192 bits): {0}")]
    Rejected(String),
    #[error("the public key is not a PEM RSA public key")]
    BadPublicKey,
}

/// An RSA private key with the `keyId` it signs for. `Debug` shows the key id only.
pub struct SigningKey {
    key_id: String,
    pair: RsaKeyPair,
}

impl std::fmt::Debug for SigningKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SigningKey")
            .field("key_id", &redacted_key_id(&self.key_id))
            .finish_non_exhaustive()
    }
}

/// A key id safe to log: API-key ids are public (tenancy, user, fingerprint); a session token
/// (`ST$...`) is a credential and is cut off.
pub fn redacted_key_id(key_id: &str) -> String {
    if key_id.starts_with("ST$") {
        "ST$***".into()
    } else {
        key_id.into()
    }
}

/// The DER body of the first PEM block whose label is one of `labels`.
fn pem_block(pem: &str, labels: &[&str]) -> Option<(String, Vec<u8>)> {
    let mut lines = pem.lines().map(str::trim);
    while let Some(line) = lines.next() {
        let Some(label) = line
            .strip_prefix("-----BEGIN ")
            .and_then(|l| l.strip_suffix("-----"))
        else {
            continue;
        };
        if !labels.contains(&label) {
            continue;
        }
        let mut body = String::new();
        for l in lines.by_ref() {
            if l.starts_with("-----END ") {
                return B64
                    .decode(body.as_bytes())
                    .ok()
                    .map(|d| (label.to_string(), d));
            }
            if l.contains(':') {
                // RFC 1421 headers (Proc-Type: 4,ENCRYPTED) of a legacy encrypted key.
                return Some(("ENCRYPTED".into(), Vec::new()));
            }
            body.push_str(l);
        }
        return None;
    }
    None
}

impl SigningKey {
    /// Reads an unencrypted RSA key in PEM: PKCS#8 (`BEGIN PRIVATE KEY`, what `openssl genrsa`
    /// writes today) or PKCS#1 (`BEGIN RSA PRIVATE KEY`, what the OCI console documented).
    pub fn from_pem(key_id: impl Into<String>, pem: &str) -> Result<Self, KeyError> {
        if pem.contains("BEGIN ENCRYPTED PRIVATE KEY") {
            return Err(KeyError::Encrypted);
        }
        let (label, der) =
            pem_block(pem, &["PRIVATE KEY", "RSA PRIVATE KEY"]).ok_or(KeyError::NotPem)?;
        let pair = match label.as_str() {
            "ENCRYPTED" => return Err(KeyError::Encrypted),
            "PRIVATE KEY" => RsaKeyPair::from_pkcs8(&der),
            _ => RsaKeyPair::from_der(&der),
        }
        .map_err(|e| KeyError::Rejected(e.to_string()))?;
        Ok(Self {
            key_id: key_id.into(),
            pair,
        })
    }

    /// A freshly generated RSA-2048 key (public exponent 65537), as the SDKs make the session
    /// key of a token exchange. The `rsa` crate generates it (ring cannot); ring signs with it
    /// like any other key. CPU-bound (tens of milliseconds, occasionally more): call it off the
    /// async runtime.
    pub fn generate(key_id: impl Into<String>) -> Result<Self, KeyError> {
        use rsa::pkcs1::EncodeRsaPrivateKey as _;
        let key = rsa::RsaPrivateKey::new(&mut rsa::rand_core::OsRng, 2048)
            .map_err(|e| KeyError::Rejected(e.to_string()))?;
        // PKCS#1 DER in a zeroized-on-drop document; the rsa key zeroizes itself too.
        let der = key
            .to_pkcs1_der()
            .map_err(|e| KeyError::Rejected(e.to_string()))?;
        let pair =
            RsaKeyPair::from_der(der.as_bytes()).map_err(|e| KeyError::Rejected(e.to_string()))?;
        Ok(Self {
            key_id: key_id.into(),
            pair,
        })
    }

    pub fn key_id(&self) -> &str {
        &self.key_id
    }

    /// Same key, another key id (a session token replaced).
    pub fn with_key_id(self, key_id: impl Into<String>) -> Self {
        Self {
            key_id: key_id.into(),
            pair: self.pair,
        }
    }

    /// The public half as DER SubjectPublicKeyInfo.
    pub fn public_key_spki(&self) -> Vec<u8> {
        spki_from_rsa_public_key(&self.public_key_der())
    }

    /// The public half as DER `RSAPublicKey` (PKCS#1).
    pub fn public_key_der(&self) -> Vec<u8> {
        use ring::signature::KeyPair as _;
        self.pair.public_key().as_ref().to_vec()
    }

    /// The public half as a PEM `PUBLIC KEY` (SubjectPublicKeyInfo), as the auth service takes
    /// a session key.
    pub fn public_key_pem(&self) -> String {
        let spki = spki_from_rsa_public_key(&self.public_key_der());
        let b64 = B64.encode(spki);
        let mut out = String::from("-----BEGIN PUBLIC KEY-----\n");
        for chunk in b64.as_bytes().chunks(64) {
            out.push_str(std::str::from_utf8(chunk).expect("base64 is ASCII"));
            out.push('\n');
        }
        out.push_str("-----END PUBLIC KEY-----\n");
        out
    }

    /// Signs `request`; returns the headers to add (`date`, `authorization` and, for a body,
    /// `x-content-sha256`, `content-type`, `content-length`).
    pub fn sign(&self, request: &RequestToSign<'_>) -> Vec<(&'static str, String)> {
        let mut added: Vec<(&'static str, String)> = vec![("date", request.date.to_string())];
        let mut names: Vec<&str> = BASE_HEADERS.to_vec();
        if let Some((body, content_type)) = request.body {
            added.push(("x-content-sha256", B64.encode(Sha256::digest(body))));
            added.push(("content-type", content_type.to_string()));
            added.push(("content-length", body.len().to_string()));
            names.extend(BODY_HEADERS);
        }
        let target = request_target(request.method, request.path_and_query);
        let lookup = |name: &str| -> Option<String> {
            match name {
                "(request-target)" => Some(target.clone()),
                "host" => Some(request.host.to_string()),
                other => added
                    .iter()
                    .find(|(n, _)| *n == other)
                    .map(|(_, v)| v.clone()),
            }
        };
        let text = signing_string(&names, lookup).expect("every signed header is present");
        let mut sig = vec![0u8; self.pair.public().modulus_len()];
        self.pair
            .sign(
                &signature::RSA_PKCS1_SHA256,
                &SystemRandom::new(),
                text.as_bytes(),
                &mut sig,
            )
            .expect("RSA signing with a valid key does not fail");
        added.push((
            "authorization",
            format!(
                "Signature version=\"1\",keyId=\"{}\",algorithm=\"rsa-sha256\",headers=\"{}\",signature=\"{}\"",
                self.key_id,
                names.join(" "),
                B64.encode(sig)
            ),
        ));
        added
    }
}

/// What a signature covers.
pub struct RequestToSign<'a> {
    pub method: &'a str,
    /// Path and query as sent (already percent-encoded).
    pub path_and_query: &'a str,
    /// The `Host` header: host, plus `:port` when the URL names a non-default port.
    pub host: &'a str,
    /// An HTTP date ([`http_date_now`]).
    pub date: &'a str,
    /// Body and content type, for POST and PUT.
    pub body: Option<(&'a [u8], &'a str)>,
}

pub fn request_target(method: &str, path_and_query: &str) -> String {
    format!("{} {}", method.to_ascii_lowercase(), path_and_query)
}

/// The signing string for `names` (lowercase header names, `(request-target)` included), with
/// `value` giving each header's value; `None` if one is missing.
pub fn signing_string(
    names: &[&str],
    mut value: impl FnMut(&str) -> Option<String>,
) -> Option<String> {
    let mut lines = Vec::with_capacity(names.len());
    for name in names {
        lines.push(format!("{name}: {}", value(name)?));
    }
    Some(lines.join("\n"))
}

/// The current time as an HTTP date (`Tue, 01 Dec 2026 17:00:00 GMT`).
pub fn http_date_now() -> String {
    httpdate::fmt_http_date(std::time::SystemTime::now())
}

/// The `Host` header value for a URL: host, plus the port when it is not the scheme's default.
pub fn host_header(url: &reqwest::Url) -> String {
    let host = url.host_str().unwrap_or_default();
    match url.port() {
        Some(port) => format!("{host}:{port}"),
        None => host.to_string(),
    }
}

/// The parameters of a `Signature` authorization header.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ParsedSignature {
    pub key_id: String,
    pub algorithm: String,
    pub headers: Vec<String>,
    pub signature: Vec<u8>,
}

/// Parses `Signature version="1",keyId="...",...`. `None` for anything malformed.
pub fn parse_authorization(value: &str) -> Option<ParsedSignature> {
    let rest = value.trim().strip_prefix("Signature ")?;
    let mut key_id = None;
    let mut algorithm = None;
    let mut headers = None;
    let mut sig = None;
    // Values are quoted and never contain a quote; commas separate parameters.
    for part in rest.split(',') {
        let (name, quoted) = part.trim().split_once('=')?;
        let v = quoted.strip_prefix('"')?.strip_suffix('"')?.to_string();
        match name {
            "keyId" => key_id = Some(v),
            "algorithm" => algorithm = Some(v),
            "headers" => headers = Some(v),
            "signature" => sig = Some(v),
            "version" => {}
            _ => return None,
        }
    }
    Some(ParsedSignature {
        key_id: key_id?,
        // draft-cavage: a missing headers parameter means `date` alone.
        algorithm: algorithm.unwrap_or_else(|| "rsa-sha256".into()),
        headers: headers
            .unwrap_or_else(|| "date".into())
            .split_whitespace()
            .map(|h| h.to_ascii_lowercase())
            .collect(),
        signature: B64.decode(sig?.as_bytes()).ok()?,
    })
}

/// Whether `signature` is a valid `rsa-sha256` signature of `text` by the DER `RSAPublicKey`.
pub fn verify(rsa_public_key_der: &[u8], text: &str, signature_bytes: &[u8]) -> bool {
    signature::UnparsedPublicKey::new(&signature::RSA_PKCS1_2048_8192_SHA256, rsa_public_key_der)
        .verify(text.as_bytes(), signature_bytes)
        .is_ok()
}

/// The DER `RSAPublicKey` inside a PEM `PUBLIC KEY` (SubjectPublicKeyInfo) or `RSA PUBLIC KEY`.
pub fn rsa_public_key_from_pem(pem: &str) -> Result<Vec<u8>, KeyError> {
    let (label, der) =
        pem_block(pem, &["PUBLIC KEY", "RSA PUBLIC KEY"]).ok_or(KeyError::BadPublicKey)?;
    if label == "RSA PUBLIC KEY" {
        return Ok(der);
    }
    rsa_public_key_from_spki(&der)
}

/// The DER `RSAPublicKey` inside a DER SubjectPublicKeyInfo.
pub fn rsa_public_key_from_spki(der: &[u8]) -> Result<Vec<u8>, KeyError> {
    // SubjectPublicKeyInfo ::= SEQUENCE { algorithm SEQUENCE {...}, subjectPublicKey BIT STRING }
    let (tag, spki, _) = der_read(der).ok_or(KeyError::BadPublicKey)?;
    if tag != 0x30 {
        return Err(KeyError::BadPublicKey);
    }
    let (tag, _algorithm, rest) = der_read(spki).ok_or(KeyError::BadPublicKey)?;
    if tag != 0x30 {
        return Err(KeyError::BadPublicKey);
    }
    let (tag, bits, _) = der_read(rest).ok_or(KeyError::BadPublicKey)?;
    match (tag, bits.split_first()) {
        (0x03, Some((0, key))) => Ok(key.to_vec()),
        _ => Err(KeyError::BadPublicKey),
    }
}

/// The modulus size in bits of a DER `RSAPublicKey` (`SEQUENCE { modulus INTEGER, ... }`).
pub fn rsa_modulus_bits(rsa_public_key_der: &[u8]) -> Option<usize> {
    let (tag, key, _) = der_read(rsa_public_key_der)?;
    if tag != 0x30 {
        return None;
    }
    let (tag, modulus, _) = der_read(key)?;
    if tag != 0x02 {
        return None;
    }
    // A leading zero keeps a positive INTEGER positive; it is not part of the number.
    let first = modulus.iter().position(|&b| b != 0)?;
    let significant = &modulus[first..];
    Some(significant.len() * 8 - significant[0].leading_zeros() as usize)
}

/// The DER of the first PEM block labelled `label` (`CERTIFICATE`...).
pub fn pem_der(pem: &str, label: &str) -> Option<Vec<u8>> {
    pem_block(pem, &[label])
        .filter(|(l, _)| l == label)
        .map(|(_, der)| der)
}

/// The SubjectPublicKeyInfo DER of an X.509 certificate (DER).
pub fn certificate_spki(cert: &[u8]) -> Option<Vec<u8>> {
    let (tag, certificate, _) = der_read(cert)?;
    if tag != 0x30 {
        return None;
    }
    let (tag, tbs, _) = der_read(certificate)?;
    if tag != 0x30 {
        return None;
    }
    let mut rest = tbs;
    // version [0] (optional), serial, signature, issuer, validity, subject, then the key.
    let (tag, _, after) = der_read(rest)?;
    if tag == 0xa0 {
        rest = after;
    }
    for _ in 0..5 {
        rest = der_read(rest)?.2;
    }
    let (tag, _, after) = der_read(rest)?;
    (tag == 0x30).then(|| rest[..rest.len() - after.len()].to_vec())
}

/// The value after `prefix` of a subject attribute string in a certificate (DER), such as the
/// `OU=opc-tenant:<ocid>` of an OCI instance certificate.
pub fn certificate_attribute(cert: &[u8], prefix: &str) -> Option<String> {
    let needle = prefix.as_bytes();
    let at = cert.windows(needle.len()).position(|w| w == needle)?;
    // The string's tag and short-form length precede it.
    let (tag, len) = (*cert.get(at.checked_sub(2)?)?, *cert.get(at - 1)? as usize);
    if !matches!(tag, 0x0c | 0x13 | 0x16) || len >= 0x80 || len < needle.len() {
        return None;
    }
    let value = cert.get(at + needle.len()..at + len)?;
    String::from_utf8(value.to_vec()).ok()
}

/// SHA-256 of a certificate's DER as colon-separated uppercase hex (the `fed-x509-sha256`
/// key id of the instance principal federation).
pub fn certificate_sha256_fingerprint(cert: &[u8]) -> String {
    Sha256::digest(cert)
        .iter()
        .map(|b| format!("{b:02X}"))
        .collect::<Vec<_>>()
        .join(":")
}

/// One DER element: tag, contents, and what follows it.
fn der_read(input: &[u8]) -> Option<(u8, &[u8], &[u8])> {
    let (&tag, rest) = input.split_first()?;
    let (&first, mut rest) = rest.split_first()?;
    let len = if first < 0x80 {
        first as usize
    } else {
        let n = (first & 0x7f) as usize;
        if n == 0 || n > 4 || rest.len() < n {
            return None;
        }
        let len = rest[..n]
            .iter()
            .fold(0usize, |acc, b| (acc << 8) | *b as usize);
        rest = &rest[n..];
        len
    };
    if rest.len() < len {
        return None;
    }
    Some((tag, &rest[..len], &rest[len..]))
}

fn der_len(len: usize) -> Vec<u8> {
    if len < 0x80 {
        return vec![len as u8];
    }
    let bytes: Vec<u8> = len
        .to_be_bytes()
        .into_iter()
        .skip_while(|b| *b == 0)
        .collect();
    let mut out = vec![0x80 | bytes.len() as u8];
    out.extend(bytes);
    out
}

fn der_element(tag: u8, contents: &[u8]) -> Vec<u8> {
    let mut out = vec![tag];
    out.extend(der_len(contents.len()));
    out.extend_from_slice(contents);
    out
}

/// SubjectPublicKeyInfo DER for an `RSAPublicKey` (algorithm rsaEncryption, NULL parameters).
pub fn spki_from_rsa_public_key(rsa_public_key_der: &[u8]) -> Vec<u8> {
    const RSA_ALGORITHM: [u8; 15] = [
        0x30, 0x0d, 0x06, 0x09, 0x2a, 0x86, 0x48, 0x86, 0xf7, 0x0d, 0x01, 0x01, 0x01, 0x05, 0x00,
    ];
    let mut bits = vec![0u8];
    bits.extend_from_slice(rsa_public_key_der);
    let mut body = RSA_ALGORITHM.to_vec();
    body.extend(der_element(0x03, &bits));
    der_element(0x30, &body)
}

/// The OCI API-key fingerprint of a public key: MD5 of its SubjectPublicKeyInfo DER, as
/// colon-separated lowercase hex (what the console shows and `keyId` carries).
pub fn fingerprint(rsa_public_key_der: &[u8]) -> String {
    use md5::Md5;
    let digest = Md5::digest(spki_from_rsa_public_key(rsa_public_key_der));
    digest
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect::<Vec<_>>()
        .join(":")
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    /// A fresh 2048-bit key from `openssl genrsa` (PKCS#8 PEM), or `None` without openssl.
    pub(crate) fn generated_key_pem(dir: &std::path::Path, name: &str, pkcs1: bool) -> String {
        let path = dir.join(name);
        let mut cmd = std::process::Command::new("openssl");
        cmd.args(["genrsa", "-out"]).arg(&path);
        if pkcs1 {
            cmd.arg("-traditional");
        }
        cmd.arg("2048");
        let out = cmd.output().expect("openssl runs");
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        std::fs::read_to_string(path).unwrap()
    }

    #[test]
    fn signs_what_the_specification_names_and_verifies() {
        let dir = tempfile::tempdir().unwrap();
        for pkcs1 in [false, true] {
            let pem = generated_key_pem(dir.path(), "k.pem", pkcs1);
            assert_eq!(pem.contains("BEGIN RSA PRIVATE KEY"), pkcs1);
            let key =
                SigningKey::from_pem("ocid1.tenancy.oc1..t/ocid1.user.oc1..u/aa:bb", &pem).unwrap();
            let date = "Thu, 05 Jan 2014 21:31:40 GMT";
            let headers = key.sign(&RequestToSign {
                method: "GET",
                path_and_query: "/n/ns/b/bkt/o?prefix=m%2F&fields=name%2Csize%2Cmd5",
                host: "objectstorage.us-ashburn-1.oraclecloud.com",
                date,
                body: None,
            });
            let auth = &headers
                .iter()
                .find(|(n, _)| *n == "authorization")
                .unwrap()
                .1;
            let parsed = parse_authorization(auth).unwrap();
            assert_eq!(
                parsed.key_id,
                "ocid1.tenancy.oc1..t/ocid1.user.oc1..u/aa:bb"
            );
            assert_eq!(parsed.headers, ["date", "(request-target)", "host"]);
            let text = "date: Thu, 05 Jan 2014 21:31:40 GMT\n\
                        (request-target): get /n/ns/b/bkt/o?prefix=m%2F&fields=name%2Csize%2Cmd5\n\
                        host: objectstorage.us-ashburn-1.oraclecloud.com";
            let public = key.public_key_der();
            assert!(verify(&public, text, &parsed.signature));
            assert!(!verify(
                &public,
                &text.replace("get ", "head "),
                &parsed.signature
            ));
            // The PEM public key round-trips through SubjectPublicKeyInfo.
            assert_eq!(
                rsa_public_key_from_pem(&key.public_key_pem()).unwrap(),
                public
            );
        }
    }

    #[test]
    fn body_requests_sign_the_body_digest() {
        let dir = tempfile::tempdir().unwrap();
        let key =
            SigningKey::from_pem("k", &generated_key_pem(dir.path(), "k.pem", false)).unwrap();
        let body = br#"{"a":1}"#;
        let headers = key.sign(&RequestToSign {
            method: "POST",
            path_and_query: "/v1/x509",
            host: "auth.example",
            date: "d",
            body: Some((body, "application/json")),
        });
        let get = |n: &str| headers.iter().find(|(h, _)| *h == n).unwrap().1.clone();
        assert_eq!(get("content-length"), "7");
        assert_eq!(get("x-content-sha256"), B64.encode(Sha256::digest(body)));
        let parsed = parse_authorization(&get("authorization")).unwrap();
        assert_eq!(
            parsed.headers,
            [
                "date",
                "(request-target)",
                "host",
                "x-content-sha256",
                "content-type",
                "content-length"
            ]
        );
    }

    #[test]
    fn generated_session_keys_are_fresh_2048_bit_keys_that_sign() {
        let a = SigningKey::generate("ST$a").unwrap();
        let b = SigningKey::generate("ST$b").unwrap();
        assert_ne!(
            a.public_key_der(),
            b.public_key_der(),
            "a new key each time"
        );
        assert_eq!(a.pair.public().modulus_len(), 256, "RSA-2048");
        assert_eq!(rsa_modulus_bits(&a.public_key_der()), Some(2048));
        // The SubjectPublicKeyInfo round-trips to the key that verifies its signatures.
        let spki = a.public_key_spki();
        assert_eq!(rsa_public_key_from_spki(&spki).unwrap(), a.public_key_der());
        let headers = a.sign(&RequestToSign {
            method: "GET",
            path_and_query: "/n/ns/b/b/o",
            host: "objectstorage.us-ashburn-1.oraclecloud.com",
            date: "Tue, 01 Dec 2026 17:00:00 GMT",
            body: None,
        });
        let auth = &headers
            .iter()
            .find(|(n, _)| *n == "authorization")
            .unwrap()
            .1;
        let parsed = parse_authorization(auth).unwrap();
        assert_eq!(parsed.key_id, "ST$a");
        let text = "date: Tue, 01 Dec 2026 17:00:00 GMT\n(request-target): get /n/ns/b/b/o\n\
                    host: objectstorage.us-ashburn-1.oraclecloud.com";
        assert!(verify(&a.public_key_der(), text, &parsed.signature));
        assert!(!verify(&b.public_key_der(), text, &parsed.signature));
    }

    #[test]
    fn fingerprint_matches_openssl() {
        let dir = tempfile::tempdir().unwrap();
        let pem = generated_key_pem(dir.path(), "k.pem", false);
        let key = SigningKey::from_pem("k", &pem).unwrap();
        let out = std::process::Command::new("sh")
            .arg("-c")
            .arg(format!(
                "openssl rsa -in {} -pubout -outform DER 2>/dev/null | openssl md5 -c",
                dir.path().join("k.pem").display()
            ))
            .output()
            .unwrap();
        let text = String::from_utf8(out.stdout).unwrap();
        let expected = text.rsplit(' ').next().unwrap().trim();
        assert_eq!(fingerprint(&key.public_key_der()), expected);
    }

    #[test]
    fn unusable_keys_are_refused_with_a_reason() {
        assert_eq!(
            SigningKey::from_pem("k", "hello").unwrap_err(),
            KeyError::NotPem
        );
        let legacy = "-----BEGIN RSA PRIVATE KEY-----\nProc-Type: 4,ENCRYPTED\nDEK-Info: AES\n\nabc\n-----END RSA PRIVATE KEY-----\n";
        assert_eq!(
            SigningKey::from_pem("k", legacy).unwrap_err(),
            KeyError::Encrypted
        );
        let pkcs8 =
            "-----BEGIN ENCRYPTED PRIVATE KEY-----\nabc\n-----END ENCRYPTED PRIVATE KEY-----\n";
        assert_eq!(
            SigningKey::from_pem("k", pkcs8).unwrap_err(),
            KeyError::Encrypted
        );
        let junk = "-----BEGIN PRIVATE KEY-----\nAAAA\n-----END PRIVATE KEY-----\n";
        assert!(matches!(
            SigningKey::from_pem("k", junk),
            Err(KeyError::Rejected(_))
        ));
        assert!(format!(
            "{:?}",
            SigningKey::from_pem(
                "ST$secret",
                &generated_key_pem(tempfile::tempdir().unwrap().path(), "k", false)
            )
            .unwrap()
        )
        .contains("ST$***"));
    }

    #[test]
    fn authorization_parsing_rejects_garbage() {
        assert!(parse_authorization("Bearer x").is_none());
        assert!(parse_authorization("Signature keyId=x").is_none());
        assert!(parse_authorization("Signature keyId=\"a\",signature=\"!!\"").is_none());
        let p = parse_authorization("Signature keyId=\"a\",signature=\"AAAA\"").unwrap();
        assert_eq!(p.headers, ["date"]);
    }
}
