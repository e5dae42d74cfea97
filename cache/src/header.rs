//! The 64-byte header in front of every cache file, and reading a file back
//! into a 16-byte-aligned buffer with every check applied.
//!
//! Layout (little-endian, 64 bytes, a multiple of 16 so the payload that
//! follows starts aligned for rkyv):
//!
//! | offset | size | field                                              |
//! |--------|------|----------------------------------------------------|
//! | 0      | 8    | magic `IPUQCACH`                                   |
//! | 8      | 2    | cache format version ([`FORMAT_VERSION`])          |
//! | 10     | 1    | kind: 1 blob, 2 manifest                           |
//! | 11     | 1    | reserved, zero                                     |
//! | 12     | 4    | rkyv version and format flags ([`RKYV_LAYOUT`])    |
//! | 16     | 8    | schema id of the payload (caller's constant)       |
//! | 24     | 8    | payload length in bytes                            |
//! | 32     | 32   | blake3 of the payload                              |
//!
//! The payload follows and nothing comes after it (rkyv's root is at the end
//! of its buffer). This module must not decide what a failed check means: it
//! reports a [`Problem`], and the store turns problems into misses.

use std::fs::File;
use std::io::Read;
use std::path::Path;

use rkyv::util::AlignedVec;

use crate::error::Problem;
use crate::key::{digest_of, Digest};

/// Size of the header; the payload starts at this offset.
pub const HEADER_LEN: usize = 64;

/// The first eight bytes of every cache file.
pub const MAGIC: [u8; 8] = *b"IPUQCACH";

/// Version of this on-disk format. Bump it when the header, the manifest
/// encoding or the directory layout changes; old files then read as clean
/// misses.
pub const FORMAT_VERSION: u16 = 1;

/// rkyv version and format flags of the payloads this build reads and writes:
/// rkyv 0.8, little-endian, aligned primitives, 32-bit offsets (rkyv's
/// defaults, which the workspace does not override). Bump it with any change
/// to the workspace's rkyv version or format features.
pub const RKYV_LAYOUT: u32 = 0x0008_0000 | LITTLE_ENDIAN | ALIGNED | OFFSETS_32;
const LITTLE_ENDIAN: u32 = 0x1;
const ALIGNED: u32 = 0x2;
const OFFSETS_32: u32 = 0x4;

/// What a file holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum Kind {
    /// A content blob under `cas/`.
    Blob = 1,
    /// An action manifest under `ac/`.
    Manifest = 2,
}

/// A decoded header.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Header {
    pub kind: Kind,
    pub schema: u64,
    pub payload_len: u64,
    pub payload_digest: Digest,
}

impl Header {
    /// The header for `payload` of the given kind and schema.
    pub fn for_payload(kind: Kind, schema: u64, payload: &[u8]) -> Header {
        Header {
            kind,
            schema,
            payload_len: payload.len() as u64,
            payload_digest: digest_of(payload),
        }
    }

    /// The 64 header bytes.
    pub fn encode(&self) -> [u8; HEADER_LEN] {
        let mut bytes = [0u8; HEADER_LEN];
        bytes[0..8].copy_from_slice(&MAGIC);
        bytes[8..10].copy_from_slice(&FORMAT_VERSION.to_le_bytes());
        bytes[10] = self.kind as u8;
        bytes[12..16].copy_from_slice(&RKYV_LAYOUT.to_le_bytes());
        bytes[16..24].copy_from_slice(&self.schema.to_le_bytes());
        bytes[24..32].copy_from_slice(&self.payload_len.to_le_bytes());
        bytes[32..64].copy_from_slice(&self.payload_digest);
        bytes
    }

    /// Decodes and checks the fixed fields: magic, format version, kind,
    /// rkyv layout and, unless `schema` is `None` (inspection tools read
    /// every schema), the schema. Length and checksum are checked by
    /// [`read_file`], which knows the file's size and payload.
    pub fn decode(
        bytes: &[u8; HEADER_LEN],
        kind: Kind,
        schema: Option<u64>,
    ) -> Result<Header, Problem> {
        if bytes[0..8] != MAGIC {
            return Err(Problem::BadMagic);
        }
        let version = u16::from_le_bytes([bytes[8], bytes[9]]);
        if version != FORMAT_VERSION {
            return Err(Problem::FormatVersion {
                expected: FORMAT_VERSION,
                found: version,
            });
        }
        if bytes[10] != kind as u8 {
            return Err(Problem::WrongKind {
                expected: kind as u8,
                found: bytes[10],
            });
        }
        if bytes[11] != 0 {
            return Err(Problem::ReservedBits);
        }
        let layout = u32::from_le_bytes(field(bytes, 12));
        if layout != RKYV_LAYOUT {
            return Err(Problem::RkyvLayout {
                expected: RKYV_LAYOUT,
                found: layout,
            });
        }
        let found_schema = u64::from_le_bytes(field(bytes, 16));
        if let Some(expected) = schema.filter(|&expected| expected != found_schema) {
            return Err(Problem::Schema {
                expected,
                found: found_schema,
            });
        }
        Ok(Header {
            kind,
            schema: found_schema,
            payload_len: u64::from_le_bytes(field(bytes, 24)),
            payload_digest: field(bytes, 32),
        })
    }
}

fn field<const N: usize>(bytes: &[u8; HEADER_LEN], offset: usize) -> [u8; N] {
    let mut out = [0u8; N];
    out.copy_from_slice(&bytes[offset..offset + N]);
    out
}

/// Checks a whole cache file held in memory (from a remote cache or an
/// export bundle) exactly as [`read_file`] checks one on disk: header, length
/// and checksum. Returns the header and the payload.
pub(crate) fn parse_bytes(
    bytes: &[u8],
    kind: Kind,
    schema: Option<u64>,
) -> Result<(Header, &[u8]), Problem> {
    let Some((header_bytes, payload)) = bytes.split_first_chunk::<HEADER_LEN>() else {
        return Err(Problem::WrongLength {
            expected: HEADER_LEN as u64,
            found: bytes.len() as u64,
        });
    };
    let header = Header::decode(header_bytes, kind, schema)?;
    if payload.len() as u64 != header.payload_len {
        return Err(Problem::WrongLength {
            expected: (HEADER_LEN as u64).saturating_add(header.payload_len),
            found: bytes.len() as u64,
        });
    }
    if digest_of(payload) != header.payload_digest {
        return Err(Problem::Checksum);
    }
    Ok((header, payload))
}

/// Reads a whole cache file, checks its header against the expected kind and
/// schema (any schema if `None`), its length against the header, and its payload against the
/// header's blake3. Returns the header and the payload in a 16-byte-aligned
/// buffer, ready for `rkyv::access`.
pub fn read_file(
    path: &Path,
    kind: Kind,
    schema: Option<u64>,
) -> Result<(Header, AlignedVec<16>), Problem> {
    let mut file = match File::open(path) {
        Ok(file) => file,
        Err(error) if error.kind() == std::io::ErrorKind::NotFound => return Err(Problem::Missing),
        Err(error) => return Err(Problem::Unreadable(error.to_string())),
    };
    let file_len = file
        .metadata()
        .map_err(|error| Problem::Unreadable(error.to_string()))?
        .len();
    if file_len < HEADER_LEN as u64 {
        return Err(Problem::WrongLength {
            expected: HEADER_LEN as u64,
            found: file_len,
        });
    }
    let mut header_bytes = [0u8; HEADER_LEN];
    file.read_exact(&mut header_bytes)
        .map_err(|error| Problem::Unreadable(error.to_string()))?;
    let header = Header::decode(&header_bytes, kind, schema)?;
    let expected_len = (HEADER_LEN as u64).saturating_add(header.payload_len);
    if file_len != expected_len {
        return Err(Problem::WrongLength {
            expected: expected_len,
            found: file_len,
        });
    }
    // The length is bounded by the file's real size, so a corrupt length
    // field cannot make us allocate more than the file holds.
    let payload_len = usize::try_from(header.payload_len).map_err(|_| Problem::WrongLength {
        expected: expected_len,
        found: file_len,
    })?;
    let mut payload = AlignedVec::<16>::with_capacity(payload_len);
    payload.resize(payload_len, 0);
    file.read_exact(payload.as_mut_slice())
        .map_err(|error| Problem::Unreadable(error.to_string()))?;
    if digest_of(payload.as_slice()) != header.payload_digest {
        return Err(Problem::Checksum);
    }
    Ok((header, payload))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn write(dir: &Path, name: &str, bytes: &[u8]) -> std::path::PathBuf {
        let path = dir.join(name);
        std::fs::write(&path, bytes).expect("write test file");
        path
    }

    fn file_bytes(kind: Kind, schema: u64, payload: &[u8]) -> Vec<u8> {
        let mut bytes = Header::for_payload(kind, schema, payload).encode().to_vec();
        bytes.extend_from_slice(payload);
        bytes
    }

    #[test]
    fn header_is_a_multiple_of_sixteen_and_round_trips() {
        assert_eq!(HEADER_LEN % 16, 0);
        let header = Header::for_payload(Kind::Blob, 7, b"payload");
        let decoded = Header::decode(&header.encode(), Kind::Blob, Some(7)).expect("decodes");
        assert_eq!(decoded, header);
    }

    #[test]
    fn read_file_returns_an_aligned_payload() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = write(
            dir.path(),
            "good",
            &file_bytes(Kind::Blob, 3, b"hello, tiles"),
        );
        let (header, payload) = read_file(&path, Kind::Blob, Some(3)).expect("reads");
        assert_eq!(payload.as_slice(), b"hello, tiles");
        assert_eq!(payload.as_ptr() as usize % 16, 0);
        assert_eq!(header.payload_len, 12);
    }

    #[test]
    fn every_check_reports_its_problem() {
        let dir = tempfile::tempdir().expect("tempdir");
        let good = file_bytes(Kind::Manifest, 3, b"0123456789");
        let check = |name: &str, bytes: &[u8], kind: Kind, schema: u64| {
            read_file(&write(dir.path(), name, bytes), kind, Some(schema)).map(|_| ())
        };
        assert_eq!(check("ok", &good, Kind::Manifest, 3), Ok(()));
        assert_eq!(
            read_file(&dir.path().join("absent"), Kind::Blob, Some(3)).map(|_| ()),
            Err(Problem::Missing)
        );
        assert!(matches!(
            check("short", &good[..20], Kind::Manifest, 3),
            Err(Problem::WrongLength { .. })
        ));
        assert!(matches!(
            check("trunc", &good[..70], Kind::Manifest, 3),
            Err(Problem::WrongLength { .. })
        ));
        let mut long = good.clone();
        long.push(0);
        assert!(matches!(
            check("long", &long, Kind::Manifest, 3),
            Err(Problem::WrongLength { .. })
        ));
        assert!(matches!(
            check("kind", &good, Kind::Blob, 3),
            Err(Problem::WrongKind { .. })
        ));
        assert!(matches!(
            check("schema", &good, Kind::Manifest, 4),
            Err(Problem::Schema { .. })
        ));
        let any = read_file(&dir.path().join("schema"), Kind::Manifest, None).expect("any schema");
        assert_eq!(any.0.schema, 3);
        let mut magic = good.clone();
        magic[0] ^= 1;
        assert_eq!(
            check("magic", &magic, Kind::Manifest, 3),
            Err(Problem::BadMagic)
        );
        let mut version = good.clone();
        version[8] = version[8].wrapping_add(1);
        assert!(matches!(
            check("version", &version, Kind::Manifest, 3),
            Err(Problem::FormatVersion { .. })
        ));
        let mut layout = good.clone();
        layout[12] ^= 0x80;
        assert!(matches!(
            check("layout", &layout, Kind::Manifest, 3),
            Err(Problem::RkyvLayout { .. })
        ));
        let mut flipped = good.clone();
        flipped[HEADER_LEN + 4] ^= 0x10;
        assert_eq!(
            check("flipped", &flipped, Kind::Manifest, 3),
            Err(Problem::Checksum)
        );
    }
}
