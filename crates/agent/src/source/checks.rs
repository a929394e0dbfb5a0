//! The checksums object stores publish about an object's bytes, as
//! [`ContentCheck`]s the blob writer feeds every byte of a download (see
//! [`RangeSource::content_check`](super::pipeline::RangeSource::content_check)).
//!
//! | check | published by |
//! |---|---|
//! | [`Md5Check`] | S3 (the ETag of a single-part upload without SSE-KMS or SSE-C), Azure `Content-MD5` |
//! | [`Crc32cCheck`] | GCS `crc32c` (every object, composed ones included) |
//! | [`WholeCheck`] | S3 full-object checksums (`x-amz-checksum-*` with `ChecksumMode`: CRC32, CRC32C, CRC64NVME, SHA1, SHA256 of the whole object) |
//! | [`PartsCheck`] | S3 composite checksums (the checksum of the parts' checksums, `<value>-<parts>`) and multipart ETags (the MD5 of the parts' MD5s, `<md5>-<parts>`) |
//! | [`AnyOf`] | an S3 multipart CRC32/CRC32C whose type the store did not say (either a full-object or a composite value) |
//!
//! A [`PartsCheck`] needs the size of every part: S3 answers `HEAD ?partNumber=N` with that
//! part's `Content-Length` (see [`crate::source::objstore`]). The bytes are cut at those sizes,
//! each part hashed on its own, and the concatenated raw digests hashed once more; bytes that
//! do not fill the parts exactly fail the check.
//!
//! The MD5s a listing already gives (GCS `md5Hash`, OCI `md5`/`opc-meta-md5`) are part of the
//! manifest's digest instead ([`FileDigest::Object`](modelfs_core::artifact::FileDigest)).

use base64::Engine as _;
use md5::{Digest as _, Md5};
use modelfs_core::store::blob::ContentCheck;

/// The MD5 of the whole object.
pub struct Md5Check {
    /// What published it, for the error message.
    name: &'static str,
    want: [u8; 16],
    hasher: Md5,
}

impl Md5Check {
    pub fn new(name: &'static str, want: [u8; 16]) -> Self {
        Self {
            name,
            want,
            hasher: Md5::new(),
        }
    }
}

impl ContentCheck for Md5Check {
    fn update(&mut self, bytes: &[u8]) {
        self.hasher.update(bytes);
    }

    fn finish(&mut self) -> Result<(), (String, String)> {
        let got: [u8; 16] = std::mem::take(&mut self.hasher).finalize().into();
        if got == self.want {
            return Ok(());
        }
        Err((
            format!("{} md5:{}", self.name, hex::encode(self.want)),
            format!("md5:{}", hex::encode(got)),
        ))
    }
}

/// The CRC32C (Castagnoli) of the whole object.
pub struct Crc32cCheck {
    name: &'static str,
    want: u32,
    crc: crc_fast::Digest,
}

impl Crc32cCheck {
    pub fn new(name: &'static str, want: u32) -> Self {
        Self {
            name,
            want,
            crc: crc_fast::Digest::new(crc_fast::CrcAlgorithm::Crc32Iscsi),
        }
    }
}

impl ContentCheck for Crc32cCheck {
    fn update(&mut self, bytes: &[u8]) {
        self.crc.update(bytes);
    }

    fn finish(&mut self) -> Result<(), (String, String)> {
        let got = self.crc.finalize() as u32;
        if got == self.want {
            return Ok(());
        }
        Err((
            format!("{} crc32c:{:08x}", self.name, self.want),
            format!("crc32c:{got:08x}"),
        ))
    }
}

/// A base64 MD5 (`Content-MD5`, GCS `md5Hash`).
pub fn md5_from_base64(value: &str) -> Option<[u8; 16]> {
    base64::engine::general_purpose::STANDARD
        .decode(value.trim())
        .ok()?
        .try_into()
        .ok()
}

/// A base64 big-endian CRC32C (GCS `crc32c`, `x-goog-hash: crc32c=`).
pub fn crc32c_from_base64(value: &str) -> Option<u32> {
    let bytes: [u8; 4] = base64::engine::general_purpose::STANDARD
        .decode(value.trim())
        .ok()?
        .try_into()
        .ok()?;
    Some(u32::from_be_bytes(bytes))
}

/// The MD5 an S3 ETag stands for: only a single-part upload's ETag (32 hex digits, no `-N`
/// part count) stored without SSE-KMS or SSE-C encryption is the MD5 of the bytes.
/// `encryption` is `x-amz-server-side-encryption`, `customer_key` whether
/// `x-amz-server-side-encryption-customer-algorithm` was present.
pub fn s3_etag_md5(etag: &str, encryption: Option<&str>, customer_key: bool) -> Option<[u8; 16]> {
    if customer_key || encryption.is_some_and(|e| e.trim().starts_with("aws:kms")) {
        return None;
    }
    let hex_etag = etag.trim().trim_start_matches("W/").trim_matches('"');
    let mut out = [0u8; 16];
    hex::decode_to_slice(hex_etag, &mut out).ok()?;
    Some(out)
}

/// A checksum algorithm a store publishes (S3 `x-amz-checksum-*`, the MD5 of ETags).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Algorithm {
    Md5,
    Crc32,
    Crc32c,
    Crc64Nvme,
    Sha1,
    Sha256,
}

impl Algorithm {
    /// The S3 checksum algorithms, in the order their headers are looked for (an object has
    /// at most one).
    pub const S3: [Algorithm; 5] = [
        Algorithm::Crc64Nvme,
        Algorithm::Crc32c,
        Algorithm::Crc32,
        Algorithm::Sha256,
        Algorithm::Sha1,
    ];

    /// The lower-case name S3 uses (`x-amz-checksum-<name>`) and messages show.
    pub fn name(self) -> &'static str {
        match self {
            Algorithm::Md5 => "md5",
            Algorithm::Crc32 => "crc32",
            Algorithm::Crc32c => "crc32c",
            Algorithm::Crc64Nvme => "crc64nvme",
            Algorithm::Sha1 => "sha1",
            Algorithm::Sha256 => "sha256",
        }
    }

    /// Whether S3 can publish this algorithm's value over a whole multipart object (the CRCs
    /// combine; SHA values of a multipart upload are always composite).
    pub fn has_full_object_form(self) -> bool {
        matches!(
            self,
            Algorithm::Crc32 | Algorithm::Crc32c | Algorithm::Crc64Nvme
        )
    }

    fn hasher(self) -> Hasher {
        let crc = |a, width| Hasher::Crc(crc_fast::Digest::new(a), width);
        match self {
            Algorithm::Md5 => Hasher::Md5(Md5::new()),
            Algorithm::Sha1 => Hasher::Sha1(sha1::Sha1::new()),
            Algorithm::Sha256 => Hasher::Sha256(sha2::Sha256::new()),
            Algorithm::Crc32 => crc(crc_fast::CrcAlgorithm::Crc32IsoHdlc, 4),
            Algorithm::Crc32c => crc(crc_fast::CrcAlgorithm::Crc32Iscsi, 4),
            Algorithm::Crc64Nvme => crc(crc_fast::CrcAlgorithm::Crc64Nvme, 8),
        }
    }

    /// The digest of `bytes` in one go.
    pub fn digest(self, bytes: &[u8]) -> Vec<u8> {
        let mut h = self.hasher();
        h.update(bytes);
        h.finish()
    }
}

/// One running digest of an [`Algorithm`].
enum Hasher {
    Md5(Md5),
    Sha1(sha1::Sha1),
    Sha256(sha2::Sha256),
    /// A CRC and its width in bytes (its value is published big-endian).
    Crc(crc_fast::Digest, usize),
}

impl Hasher {
    fn update(&mut self, bytes: &[u8]) {
        match self {
            Hasher::Md5(h) => h.update(bytes),
            Hasher::Sha1(h) => h.update(bytes),
            Hasher::Sha256(h) => h.update(bytes),
            Hasher::Crc(h, _) => h.update(bytes),
        }
    }

    fn finish(self) -> Vec<u8> {
        match self {
            Hasher::Md5(h) => h.finalize().to_vec(),
            Hasher::Sha1(h) => h.finalize().to_vec(),
            Hasher::Sha256(h) => h.finalize().to_vec(),
            Hasher::Crc(h, width) => h.finalize().to_be_bytes()[8 - width..].to_vec(),
        }
    }
}

/// How a published value is shown in messages: hex for MD5 (as ETags are), base64 for the
/// rest (as S3 publishes them).
fn show(algorithm: Algorithm, value: &[u8]) -> String {
    match algorithm {
        Algorithm::Md5 => hex::encode(value),
        _ => base64::engine::general_purpose::STANDARD.encode(value),
    }
}

/// A checksum of the whole object's bytes.
pub struct WholeCheck {
    name: &'static str,
    algorithm: Algorithm,
    want: Vec<u8>,
    hasher: Option<Hasher>,
}

impl WholeCheck {
    pub fn new(name: &'static str, algorithm: Algorithm, want: Vec<u8>) -> Self {
        Self {
            name,
            algorithm,
            want,
            hasher: Some(algorithm.hasher()),
        }
    }
}

impl ContentCheck for WholeCheck {
    fn update(&mut self, bytes: &[u8]) {
        if let Some(h) = &mut self.hasher {
            h.update(bytes);
        }
    }

    fn finish(&mut self) -> Result<(), (String, String)> {
        let a = self.algorithm;
        let got = self.hasher.take().unwrap_or_else(|| a.hasher()).finish();
        if got == self.want {
            return Ok(());
        }
        Err((
            format!("{} {}:{}", self.name, a.name(), show(a, &self.want)),
            format!("{}:{}", a.name(), show(a, &got)),
        ))
    }
}

/// A checksum of the parts' checksums (S3 composite checksums, multipart ETags): the bytes
/// are cut at the parts' sizes, each part digested, and the concatenated digests digested
/// again.
pub struct PartsCheck {
    name: &'static str,
    algorithm: Algorithm,
    want: Vec<u8>,
    sizes: Vec<u64>,
    /// The part being fed and the bytes it still lacks.
    part: usize,
    left: u64,
    hasher: Hasher,
    digests: Vec<u8>,
    /// Bytes arrived after the last part was full.
    overflow: u64,
}

impl PartsCheck {
    /// `sizes`: every part's size, in part order.
    pub fn new(name: &'static str, algorithm: Algorithm, want: Vec<u8>, sizes: Vec<u64>) -> Self {
        let mut check = Self {
            name,
            algorithm,
            want,
            left: sizes.first().copied().unwrap_or(0),
            sizes,
            part: 0,
            hasher: algorithm.hasher(),
            digests: Vec::new(),
            overflow: 0,
        };
        check.close_full_parts();
        check
    }

    /// Closes the current part while it has all its bytes (an empty part closes at once).
    fn close_full_parts(&mut self) {
        while self.part < self.sizes.len() && self.left == 0 {
            let done = std::mem::replace(&mut self.hasher, self.algorithm.hasher());
            self.digests.extend(done.finish());
            self.part += 1;
            self.left = self.sizes.get(self.part).copied().unwrap_or(0);
        }
    }
}

impl ContentCheck for PartsCheck {
    fn update(&mut self, mut bytes: &[u8]) {
        while !bytes.is_empty() {
            if self.part >= self.sizes.len() {
                self.overflow += bytes.len() as u64;
                return;
            }
            let take = (self.left.min(bytes.len() as u64)) as usize;
            self.hasher.update(&bytes[..take]);
            self.left -= take as u64;
            bytes = &bytes[take..];
            self.close_full_parts();
        }
    }

    fn finish(&mut self) -> Result<(), (String, String)> {
        let a = self.algorithm;
        let n = self.sizes.len();
        let want = format!("{} {}:{}-{n}", self.name, a.name(), show(a, &self.want));
        if self.part < n || self.overflow > 0 {
            let total: u64 = self.sizes.iter().sum();
            return Err((
                want,
                format!("bytes that do not fill the {n} parts of {total} bytes"),
            ));
        }
        let got = a.digest(&self.digests);
        if got == self.want {
            return Ok(());
        }
        Err((want, format!("{}:{}-{n}", a.name(), show(a, &got))))
    }
}

/// Passes when any of its checks passes: a value that is one of two forms the store did not
/// tell apart.
pub struct AnyOf(pub Vec<Box<dyn ContentCheck>>);

impl ContentCheck for AnyOf {
    fn update(&mut self, bytes: &[u8]) {
        for c in &mut self.0 {
            c.update(bytes);
        }
    }

    fn finish(&mut self) -> Result<(), (String, String)> {
        let mut wants = Vec::new();
        let mut gots = Vec::new();
        for c in &mut self.0 {
            match c.finish() {
                Ok(()) => return Ok(()),
                Err((w, g)) => {
                    wants.push(w);
                    gots.push(g);
                }
            }
        }
        Err((wants.join(" or "), gots.join(" / ")))
    }
}

/// Whether a published S3 checksum is over the whole object or over its parts.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ChecksumKind {
    Full,
    Composite,
    /// A multipart CRC without `x-amz-checksum-type` or a `-N` suffix: either.
    Unknown,
}

/// An S3 checksum from the headers of a `HEAD` with `x-amz-checksum-mode: ENABLED`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct S3Checksum {
    pub algorithm: Algorithm,
    pub value: Vec<u8>,
    pub kind: ChecksumKind,
}

/// The part count of a multipart ETag (`"<hex>-<N>"`) and its hex value.
pub fn s3_multipart_etag(etag: &str) -> Option<([u8; 16], u32)> {
    let bare = etag.trim().trim_start_matches("W/").trim_matches('"');
    let (hex_part, count) = bare.split_once('-')?;
    let count: u32 = count.parse().ok().filter(|n| *n > 0)?;
    let mut out = [0u8; 16];
    hex::decode_to_slice(hex_part, &mut out).ok()?;
    Some((out, count))
}

/// The checksum S3 published (`x-amz-checksum-<algorithm>`, with `x-amz-checksum-type`),
/// read with `header`. `multipart`: the object is a multipart upload (its ETag has a part
/// count), which decides what a value without a stated type is. Returns the checksum and the
/// part count a composite value carries (`<base64>-<N>`).
pub fn s3_checksum<'a>(
    header: impl Fn(&str) -> Option<&'a str>,
    multipart: bool,
) -> Option<(S3Checksum, Option<u32>)> {
    let (algorithm, raw) = Algorithm::S3
        .iter()
        .find_map(|a| header(&format!("x-amz-checksum-{}", a.name())).map(|v| (*a, v.trim())))?;
    let (b64, parts) = match raw.rsplit_once('-') {
        Some((v, n)) => (v, Some(n.parse::<u32>().ok().filter(|n| *n > 0)?)),
        None => (raw, None),
    };
    let value = base64::engine::general_purpose::STANDARD.decode(b64).ok()?;
    let width = algorithm.digest(b"").len();
    if value.len() != width {
        return None;
    }
    let stated = header("x-amz-checksum-type").map(|t| t.trim().to_ascii_uppercase());
    let kind = match stated.as_deref() {
        Some("COMPOSITE") => ChecksumKind::Composite,
        Some("FULL_OBJECT") => ChecksumKind::Full,
        _ if parts.is_some() => ChecksumKind::Composite,
        _ if !multipart => ChecksumKind::Full,
        _ if !algorithm.has_full_object_form() => ChecksumKind::Composite,
        _ if algorithm == Algorithm::Crc64Nvme => ChecksumKind::Full,
        _ => ChecksumKind::Unknown,
    };
    Some((
        S3Checksum {
            algorithm,
            value,
            kind,
        },
        parts,
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run(mut check: impl ContentCheck, data: &[u8]) -> Result<(), (String, String)> {
        for piece in data.chunks(7) {
            check.update(piece);
        }
        check.finish()
    }

    #[test]
    fn checks_match_only_the_published_bytes() {
        let data = b"The quick brown fox jumps over the lazy dog";
        let md5: [u8; 16] = Md5::digest(data).into();
        assert!(run(Md5Check::new("Content-MD5", md5), data).is_ok());
        let (want, got) = run(Md5Check::new("Content-MD5", md5), b"other bytes").unwrap_err();
        assert!(want.contains(&hex::encode(md5)) && want.contains("Content-MD5"));
        assert!(got.starts_with("md5:"));
        // The CRC32C test vector of RFC 3720 (32 bytes of zeros) and a text one.
        assert!(run(Crc32cCheck::new("crc32c", 0x8a91_36aa), &[0u8; 32]).is_ok());
        assert!(run(Crc32cCheck::new("crc32c", 0x2262_0404), data).is_ok());
        assert!(run(Crc32cCheck::new("crc32c", 0x2262_0404), b"Tha quick").is_err());
    }

    #[test]
    fn published_values_parse() {
        assert_eq!(crc32c_from_base64("AAAAAA=="), Some(0));
        assert_eq!(crc32c_from_base64("yZRlqg=="), Some(0xc994_65aa));
        assert_eq!(crc32c_from_base64("not base64"), None);
        assert_eq!(
            md5_from_base64("1B2M2Y8AsgTpgAmY7PhCfg==").map(hex::encode),
            Some("d41d8cd98f00b204e9800998ecf8427e".into())
        );
        let etag = "\"d41d8cd98f00b204e9800998ecf8427e\"";
        assert!(s3_etag_md5(etag, None, false).is_some());
        assert!(s3_etag_md5(etag, Some("AES256"), false).is_some());
        assert_eq!(s3_etag_md5(etag, Some("aws:kms"), false), None);
        assert_eq!(s3_etag_md5(etag, Some("aws:kms:dsse"), false), None);
        assert_eq!(s3_etag_md5(etag, None, true), None);
        assert_eq!(
            s3_etag_md5("\"d41d8cd98f00b204e9800998ecf8427e-3\"", None, false),
            None
        );
    }

    #[test]
    fn algorithms_match_their_published_test_vectors() {
        let data = b"123456789";
        // The check values of each CRC's catalogue entry, and the digests of "abc".
        assert_eq!(Algorithm::Crc32.digest(data), 0xcbf4_3926u32.to_be_bytes());
        assert_eq!(Algorithm::Crc32c.digest(data), 0xe306_9283u32.to_be_bytes());
        assert_eq!(
            Algorithm::Crc64Nvme.digest(data),
            0xae8b_1486_0a79_9888u64.to_be_bytes()
        );
        assert_eq!(
            hex::encode(Algorithm::Sha1.digest(b"abc")),
            "a9993e364706816aba3e25717850c26c9cd0d89d"
        );
        assert_eq!(
            hex::encode(Algorithm::Md5.digest(b"abc")),
            "900150983cd24fb0d6963f7d28e17f72"
        );
    }

    /// The reference: each part digested, the digests concatenated and digested again.
    fn composite(a: Algorithm, data: &[u8], sizes: &[u64]) -> Vec<u8> {
        let mut at = 0usize;
        let mut all = Vec::new();
        for s in sizes {
            all.extend(a.digest(&data[at..at + *s as usize]));
            at += *s as usize;
        }
        a.digest(&all)
    }

    #[test]
    fn parts_checks_cut_the_bytes_at_the_part_sizes() {
        let data: Vec<u8> = (0..1000u32).map(|i| (i * 7 % 251) as u8).collect();
        let sizes = vec![400, 400, 200];
        for a in [Algorithm::Md5, Algorithm::Crc32, Algorithm::Sha256] {
            let want = composite(a, &data, &sizes);
            assert!(run(PartsCheck::new("t", a, want.clone(), sizes.clone()), &data).is_ok());
            // Other part sizes with the same total give another value.
            let other = PartsCheck::new("t", a, want.clone(), vec![500, 300, 200]);
            assert!(run(other, &data).is_err(), "{a:?}");
            // A byte changed in the last part.
            let mut bad = data.clone();
            bad[950] ^= 1;
            let (w, g) =
                run(PartsCheck::new("t", a, want.clone(), sizes.clone()), &bad).unwrap_err();
            assert!(w.contains("-3") && g.ends_with("-3"), "{w} / {g}");
            // Too few or too many bytes.
            let short = run(
                PartsCheck::new("t", a, want.clone(), sizes.clone()),
                &data[..999],
            );
            assert!(short.unwrap_err().1.contains("do not fill"));
            let mut long = data.clone();
            long.push(0);
            let long = run(PartsCheck::new("t", a, want, sizes.clone()), &long);
            assert!(long.unwrap_err().1.contains("do not fill"));
        }
        let whole = Algorithm::Crc32.digest(&data);
        assert!(run(WholeCheck::new("t", Algorithm::Crc32, whole.clone()), &data).is_ok());
        assert!(run(
            WholeCheck::new("t", Algorithm::Crc32, whole.clone()),
            &data[1..]
        )
        .is_err());
        // Either form passes AnyOf; neither fails it with both values named.
        let either = |want_whole: Vec<u8>| {
            AnyOf(vec![
                Box::new(WholeCheck::new("t", Algorithm::Crc32, want_whole)),
                Box::new(PartsCheck::new(
                    "t",
                    Algorithm::Crc32,
                    composite(Algorithm::Crc32, &data, &sizes),
                    sizes.clone(),
                )),
            ])
        };
        assert!(run(either(whole), &data).is_ok());
        assert!(run(either(vec![0; 4]), &data).is_ok());
        let (w, _) = run(either(vec![0; 4]), &data[..999]).unwrap_err();
        assert!(w.contains(" or "), "{w}");
    }

    #[test]
    fn s3_checksum_headers_parse_with_their_kind() {
        let headers = |pairs: &'static [(&'static str, &'static str)]| {
            move |n: &str| pairs.iter().find(|(k, _)| *k == n).map(|(_, v)| *v)
        };
        let crc = base64::engine::general_purpose::STANDARD.encode([1u8, 2, 3, 4]);
        let crc: &'static str = Box::leak(crc.into_boxed_str());
        let suffixed: &'static str = Box::leak(format!("{crc}-3").into_boxed_str());
        let pairs: &'static [(&str, &str)] =
            Box::leak(vec![("x-amz-checksum-crc32", crc)].into_boxed_slice());
        let (c, parts) = s3_checksum(headers(pairs), false).unwrap();
        assert_eq!(
            (c.algorithm, c.kind, parts),
            (Algorithm::Crc32, ChecksumKind::Full, None)
        );
        assert_eq!(c.value, vec![1, 2, 3, 4]);
        assert_eq!(
            s3_checksum(headers(pairs), true).unwrap().0.kind,
            ChecksumKind::Unknown
        );
        let pairs: &'static [(&str, &str)] =
            Box::leak(vec![("x-amz-checksum-crc32c", suffixed)].into_boxed_slice());
        let (c, parts) = s3_checksum(headers(pairs), true).unwrap();
        assert_eq!((c.kind, parts), (ChecksumKind::Composite, Some(3)));
        let pairs: &'static [(&str, &str)] = Box::leak(
            vec![
                ("x-amz-checksum-crc32", crc),
                ("x-amz-checksum-type", "FULL_OBJECT"),
            ]
            .into_boxed_slice(),
        );
        assert_eq!(
            s3_checksum(headers(pairs), true).unwrap().0.kind,
            ChecksumKind::Full
        );
        // A SHA of a multipart upload is always composite; a wrong width is no checksum.
        let pairs: &'static [(&str, &str)] =
            Box::leak(vec![("x-amz-checksum-sha256", crc)].into_boxed_slice());
        assert_eq!(s3_checksum(headers(pairs), true), None);
        let sha = base64::engine::general_purpose::STANDARD.encode([7u8; 32]);
        let sha: &'static str = Box::leak(sha.into_boxed_str());
        let pairs: &'static [(&str, &str)] =
            Box::leak(vec![("x-amz-checksum-sha256", sha)].into_boxed_slice());
        assert_eq!(
            s3_checksum(headers(pairs), true).unwrap().0.kind,
            ChecksumKind::Composite
        );
        assert_eq!(s3_checksum(headers(&[]), true), None);
        assert_eq!(
            s3_multipart_etag("\"d41d8cd98f00b204e9800998ecf8427e-3\""),
            Some((md5_from_base64("1B2M2Y8AsgTpgAmY7PhCfg==").unwrap(), 3))
        );
        assert_eq!(
            s3_multipart_etag("\"d41d8cd98f00b204e9800998ecf8427e\""),
            None
        );
    }
}
