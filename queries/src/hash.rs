//! Content digests and the stable-hash trait that feeds cache keys.
//!
//! Only types implementing [`StableHash`] can be fed to a key hasher, so a path, a clock
//! or a `HashMap` iteration order cannot leak into a key by accident.

use std::fmt;

/// A blake3 digest of some content: the identity of a stage output, a package, a target.
#[derive(
    Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Default,
    rkyv::Archive, rkyv::Serialize, rkyv::Deserialize,
)]
pub struct Digest(pub [u8; 32]);

impl Digest {
    pub fn of_bytes(bytes: &[u8]) -> Digest {
        Digest(*blake3::hash(bytes).as_bytes())
    }
    pub fn to_hex(&self) -> String {
        self.0.iter().map(|b| format!("{b:02x}")).collect()
    }
    pub fn short(&self) -> String {
        self.to_hex()[..16].to_string()
    }
}

impl fmt::Debug for Digest {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Digest({})", self.short())
    }
}

impl fmt::Display for Digest {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.to_hex())
    }
}

/// A key hasher with its own blake3 domain ("ipuq <purpose> v<N>").
pub struct KeyHasher(blake3::Hasher);

impl KeyHasher {
    pub fn new(domain: &str) -> KeyHasher {
        KeyHasher(blake3::Hasher::new_derive_key(domain))
    }
    pub fn add<T: StableHash + ?Sized>(&mut self, value: &T) -> &mut Self {
        value.stable_hash(self);
        self
    }
    pub fn bytes(&mut self, bytes: &[u8]) -> &mut Self {
        self.0.update(&(bytes.len() as u64).to_le_bytes());
        self.0.update(bytes);
        self
    }
    pub fn finish(&self) -> Digest {
        Digest(*self.0.finalize().as_bytes())
    }
}

/// Hashing that is the same across processes, machines and thread counts.
pub trait StableHash {
    fn stable_hash(&self, hasher: &mut KeyHasher);
}

macro_rules! stable_hash_int {
    ($($t:ty),*) => {$(
        impl StableHash for $t {
            fn stable_hash(&self, h: &mut KeyHasher) { h.0.update(&self.to_le_bytes()); }
        }
    )*};
}
stable_hash_int!(u8, u16, u32, u64, i32, i64);

impl StableHash for usize {
    fn stable_hash(&self, h: &mut KeyHasher) {
        h.0.update(&(*self as u64).to_le_bytes());
    }
}
impl StableHash for bool {
    fn stable_hash(&self, h: &mut KeyHasher) {
        h.0.update(&[*self as u8]);
    }
}
impl StableHash for f64 {
    fn stable_hash(&self, h: &mut KeyHasher) {
        h.0.update(&self.to_bits().to_le_bytes());
    }
}
impl StableHash for str {
    fn stable_hash(&self, h: &mut KeyHasher) {
        h.bytes(self.as_bytes());
    }
}
impl StableHash for String {
    fn stable_hash(&self, h: &mut KeyHasher) {
        h.bytes(self.as_bytes());
    }
}
impl StableHash for Digest {
    fn stable_hash(&self, h: &mut KeyHasher) {
        h.0.update(&self.0);
    }
}
impl<T: StableHash> StableHash for [T] {
    fn stable_hash(&self, h: &mut KeyHasher) {
        (self.len() as u64).stable_hash(h);
        for item in self {
            item.stable_hash(h);
        }
    }
}
impl<T: StableHash> StableHash for Vec<T> {
    fn stable_hash(&self, h: &mut KeyHasher) {
        self.as_slice().stable_hash(h);
    }
}
impl<T: StableHash> StableHash for Option<T> {
    fn stable_hash(&self, h: &mut KeyHasher) {
        match self {
            None => {
                h.0.update(&[0]);
            }
            Some(v) => {
                h.0.update(&[1]);
                v.stable_hash(h);
            }
        }
    }
}
