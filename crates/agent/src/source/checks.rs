//! The checksums object stores publish about an object's bytes, as
//! [`ContentCheck`]s the blob writer feeds every byte of a download (see
//! [`RangeSource::content_check`](super::pipeline::RangeSource::content_check)).
//!
//! | check | published by |
//! |---|---|
//! | [`Md5Check`] | S3 (the ETag of a single-part upload without SSE-KMS or SSE-C), Azure `Content-MD5` |
//! | [`Crc32cCheck`] | GCS `crc32c` (every object, composed ones included) |
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
}
