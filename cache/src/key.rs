//! Keys, digests and their hexadecimal spelling.
//!
//! Keys and digests are plain `[u8; 32]` values so that callers can derive
//! them however they like (ipuq uses `blake3::Hasher::new_derive_key` with one
//! domain string per stage). This module only names them, spells them in hex
//! for file names, and hashes payloads. It must not derive stage keys itself:
//! what goes into a key is the caller's business, and the cache stays blind to
//! it.

/// An action key: what a stage's output is looked up by.
///
/// Keys from different stages must come from different derivation domains;
/// the cache also records the stage name in each manifest and treats a
/// mismatch as a miss, so a collision is never a wrong hit.
pub type Key = [u8; 32];

/// A content digest: blake3 of a payload, and the name of its blob.
pub type Digest = [u8; 32];

/// The content digest of `payload` (plain blake3, as Bazel's CAS uses a plain
/// content hash), which is also the blob's file name.
/// blake3's rayon feature is not enabled in the workspace; one core hashes
/// about 3.5 GB/s, far faster than the stages that produce payloads.
pub fn digest_of(payload: &[u8]) -> Digest {
    *blake3::hash(payload).as_bytes()
}

/// Lowercase hexadecimal spelling of a key or digest (64 characters).
pub fn to_hex(bytes: &[u8; 32]) -> String {
    const DIGITS: &[u8; 16] = b"0123456789abcdef";
    let mut text = String::with_capacity(64);
    for byte in bytes {
        text.push(DIGITS[usize::from(byte >> 4)] as char);
        text.push(DIGITS[usize::from(byte & 0x0f)] as char);
    }
    text
}

/// Parses 64 hexadecimal digits (either case) back into a key or digest.
/// Returns `None` for any other length or a non-hex character.
pub fn from_hex(text: &str) -> Option<[u8; 32]> {
    let text = text.as_bytes();
    if text.len() != 64 {
        return None;
    }
    let mut bytes = [0u8; 32];
    for (byte, pair) in bytes.iter_mut().zip(text.chunks_exact(2)) {
        *byte = (hex_value(pair[0])? << 4) | hex_value(pair[1])?;
    }
    Some(bytes)
}

fn hex_value(digit: u8) -> Option<u8> {
    match digit {
        b'0'..=b'9' => Some(digit - b'0'),
        b'a'..=b'f' => Some(digit - b'a' + 10),
        b'A'..=b'F' => Some(digit - b'A' + 10),
        _ => None,
    }
}

/// Splits a hex name into the two-character fan-out directory and the rest,
/// as in `cas/ab/cdef…`. Fan-out keeps directories small on every file system.
pub(crate) fn fan_out(bytes: &[u8; 32]) -> (String, String) {
    let hex = to_hex(bytes);
    let rest = hex[2..].to_owned();
    let mut dir = hex;
    dir.truncate(2);
    (dir, rest)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hex_round_trips_and_rejects_bad_text() {
        let mut bytes = [0u8; 32];
        for (index, byte) in bytes.iter_mut().enumerate() {
            *byte = (index as u8).wrapping_mul(37);
        }
        let text = to_hex(&bytes);
        assert_eq!(text.len(), 64);
        assert_eq!(&text[..4], "0025");
        assert_eq!(from_hex(&text), Some(bytes));
        assert_eq!(from_hex(&text.to_uppercase()), Some(bytes));
        assert_eq!(from_hex(&text[..62]), None);
        let mut bad = text.clone();
        bad.replace_range(10..11, "g");
        assert_eq!(from_hex(&bad), None);
    }

    #[test]
    fn fan_out_splits_after_two_digits() {
        let bytes = [0xab; 32];
        let (dir, rest) = fan_out(&bytes);
        assert_eq!(dir, "ab");
        assert_eq!(rest.len(), 62);
        assert_eq!(format!("{dir}{rest}"), to_hex(&bytes));
    }

    #[test]
    fn digest_is_plain_blake3() {
        assert_eq!(digest_of(b"ipuq"), *blake3::hash(b"ipuq").as_bytes());
        assert_ne!(digest_of(b"ipuq"), digest_of(b"ipuQ"));
    }
}
