//! The compiler fingerprint: the package version plus a digest of the compiler's own sources,
//! computed at build time by `build.rs`. It enters every stage key (through the database, where
//! tests can replace it) and the package's `compiler` field, so an entry written by one
//! compiler build is a miss for every other build, even at the same version number.

use crate::hash::{Digest, KeyHasher};

/// The package version of this compiler.
pub const VERSION: &str = env!("CARGO_PKG_VERSION");

/// Hex blake3 of this crate's sources, manifest and lock file (see `build.rs`).
pub const SOURCES: &str = env!("IPUQ_COMPILER_SOURCES");

/// The fingerprint of this compiler build: version and sources digest.
pub fn compiler_fingerprint() -> Digest {
    KeyHasher::new("ipuq compiler fingerprint v1").add(VERSION).add(SOURCES).finish()
}

/// What a package's `compiler` field says: "ipuq 0.1.0+<first 16 hex digits of the sources>".
pub fn compiler_id() -> String {
    format!("ipuq {VERSION}+{}", &SOURCES[..16])
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_fingerprint_names_version_and_sources() {
        assert_eq!(SOURCES.len(), 64);
        assert!(SOURCES.bytes().all(|b| b.is_ascii_hexdigit()));
        assert!(compiler_id().starts_with(&format!("ipuq {VERSION}+")));
        assert_ne!(compiler_fingerprint(), KeyHasher::new("ipuq compiler fingerprint v1").add(VERSION).add("").finish());
    }
}
