//! ipuq's content-addressed on-disk cache: an action cache (stage key →
//! output digest) over a content store (digest → bytes), as in Bazel.
//!
//! ```text
//! <root>/cas/ab/cdef…        blobs, named by blake3 of their payload
//! <root>/ac/ab/cdef…         manifests, named by key: stage, key, digest, size
//! <root>/ac/ab/cdef….used    last-used stamps (explicit mtime, for LRU)
//! <root>/tmp/                files being published
//! <root>/gc.lock             shared by publishing builds, exclusive for gc
//! <root>/remote-stats        running totals of the remote tier (bookkeeping)
//! ```
//!
//! Behind the local directory, an optional remote tier (`remote/`) shares
//! entries through a server in the Bazel HTTP cache layout or Redis, and
//! `bundle.rs` exports entries into one file and imports them elsewhere.
//! Both move the same manifest files and payloads, and check them as a read
//! from disk does before anything is stored.
//!
//! Every file is a 64-byte header (magic, format version, rkyv layout,
//! schema, payload length, blake3 of the payload) followed by the payload,
//! which [`Cache::get`] returns in a 16-byte-aligned buffer ready for
//! `rkyv::access`. See `store.rs` for the layout's reasons, `gc.rs` for
//! eviction, and `header.rs` for the header.
//!
//! Architecture Invariant: the crate knows bytes and digests only. It does not
//! know about IPUs, stages' meanings or salsa, does not derive keys (callers
//! use `blake3::Hasher::new_derive_key` with a domain per stage), and does not
//! deserialise payloads.
//!
//! Architecture Invariant: the cache can never fail or corrupt a build. A
//! missing, short, stale or damaged entry is a miss (logged with `tracing`
//! when it is damage); an unwritable directory or full disk is an error the
//! caller turns into a warning ([`Cache::open_or_warn`],
//! [`Cache::put_or_warn`]). Files are published atomically and never modified
//! in place.
//!
//! Architecture Invariant: nothing written depends on time, paths or the
//! process, except the stamps, which are never read back as content.
//!
//! ```
//! use ipuq_cache::{Cache, CacheOptions};
//! # let directory = tempfile::tempdir().unwrap();
//! let cache = Cache::open(directory.path(), CacheOptions::default()).unwrap();
//! let key = *blake3::Hasher::new_derive_key("ipuq plan v1").update(b"inputs").finalize().as_bytes();
//! assert!(cache.get("plan", &key, 1).is_none());
//! let digest = cache.put("plan", &key, 1, b"payload").unwrap();
//! assert_eq!(cache.get("plan", &key, 1).unwrap().as_slice(), b"payload");
//! assert_eq!(digest, ipuq_cache::digest_of(b"payload"));
//! assert_eq!(cache.counters()["plan"].hits, 1);
//! ```

mod bundle;
mod error;
mod gc;
mod header;
mod inspect;
mod key;
mod manifest;
mod publish;
pub mod remote;
mod session;
mod store;

pub use bundle::{BundleError, ExportReport, ImportReport};
pub use error::{CacheError, Problem};
pub use gc::GcReport;
pub use header::{FORMAT_VERSION, HEADER_LEN, RKYV_LAYOUT};
pub use inspect::{human_bytes, CacheStats, DamagedFile, StageStats, VerifyReport};
pub use key::{digest_of, from_hex, to_hex, Digest, Key};
pub use manifest::MAX_STAGE_LEN;
pub use rkyv::util::AlignedVec;
pub use session::StageCounters;
pub use remote::{Remote, RemoteCounters, RemoteError, RemoteOptions};
pub use store::{Cache, CacheOptions, BLOB_SCHEMA};
