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
///
/// The digest is blake3's of the bytes fed, in order. Values are a few bytes each (a key over
/// a phase feeds one integer at a time): they are gathered in a buffer and handed to blake3
/// a buffer at a time, which gives the same digest (blake3 hashes the byte stream, however
/// it is cut) for a fraction of the per-call cost. A key that outgrows the small buffer on
/// the stack (a digest of a whole phase's transfers, megabytes of them) is gathered in a
/// larger one on the heap: blake3 hashes only whole chunks of one `update` side by side
/// (16 at a time with AVX-512), so 2 KiB updates went through its one-block-at-a-time path
/// (measured: 6 % of a four-block MLP edit's CPU in `compress_in_place`).
pub struct KeyHasher {
    hasher: blake3::Hasher,
    buffer: [u8; KEY_BUFFER],
    filled: usize,
    /// The bytes gathered once they outgrew `buffer` (empty, unallocated, until then).
    spill: Vec<u8>,
}

/// Bytes a `KeyHasher` gathers on the stack before it spills (two of blake3's 1 KiB chunks).
const KEY_BUFFER: usize = 2048;

/// Bytes a spilled `KeyHasher` gathers before it hands them to blake3 (64 chunks).
const SPILL_BUFFER: usize = 64 * 1024;

impl KeyHasher {
    pub fn new(domain: &str) -> KeyHasher {
        KeyHasher { hasher: blake3::Hasher::new_derive_key(domain), buffer: [0; KEY_BUFFER], filled: 0, spill: Vec::new() }
    }
    pub fn add<T: StableHash + ?Sized>(&mut self, value: &T) -> &mut Self {
        value.stable_hash(self);
        self
    }
    pub fn bytes(&mut self, bytes: &[u8]) -> &mut Self {
        self.update(&(bytes.len() as u64).to_le_bytes());
        self.update(bytes);
        self
    }
    pub fn finish(&self) -> Digest {
        let mut hasher = self.hasher.clone();
        hasher.update(&self.spill);
        hasher.update(&self.buffer[..self.filled]);
        Digest(*hasher.finalize().as_bytes())
    }
    /// Feed `bytes` (buffered; see the type's docs).
    #[inline]
    fn update(&mut self, bytes: &[u8]) {
        if self.filled + bytes.len() <= KEY_BUFFER {
            self.buffer[self.filled..self.filled + bytes.len()].copy_from_slice(bytes);
            self.filled += bytes.len();
            return;
        }
        // The stack buffer is full: its bytes go to the heap buffer, ahead of these.
        spill(&mut self.hasher, &mut self.spill, &self.buffer[..self.filled]);
        self.filled = 0;
        if bytes.len() > KEY_BUFFER {
            spill(&mut self.hasher, &mut self.spill, bytes);
        } else {
            self.buffer[..bytes.len()].copy_from_slice(bytes);
            self.filled = bytes.len();
        }
    }
}

/// `bytes` appended to a key's heap buffer (allocated on first use), which goes to blake3
/// whenever it would outgrow `SPILL_BUFFER`.
#[cold]
#[inline(never)]
fn spill(hasher: &mut blake3::Hasher, spilled: &mut Vec<u8>, bytes: &[u8]) {
    if spilled.capacity() == 0 {
        spilled.reserve_exact(SPILL_BUFFER);
    }
    if spilled.len() + bytes.len() > SPILL_BUFFER {
        hasher.update(spilled);
        spilled.clear();
    }
    if bytes.len() > SPILL_BUFFER {
        hasher.update(bytes);
    } else {
        spilled.extend_from_slice(bytes);
    }
}

/// Hashing that is the same across processes, machines and thread counts.
pub trait StableHash {
    fn stable_hash(&self, hasher: &mut KeyHasher);
}

macro_rules! stable_hash_int {
    ($($t:ty),*) => {$(
        impl StableHash for $t {
            fn stable_hash(&self, h: &mut KeyHasher) { h.update(&self.to_le_bytes()); }
        }
    )*};
}
stable_hash_int!(u8, u16, u32, u64, i32, i64);

impl StableHash for usize {
    fn stable_hash(&self, h: &mut KeyHasher) {
        h.update(&(*self as u64).to_le_bytes());
    }
}
impl StableHash for bool {
    fn stable_hash(&self, h: &mut KeyHasher) {
        h.update(&[*self as u8]);
    }
}
impl StableHash for f64 {
    fn stable_hash(&self, h: &mut KeyHasher) {
        h.update(&self.to_bits().to_le_bytes());
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
        h.update(&self.0);
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
                h.update(&[0]);
            }
            Some(v) => {
                h.update(&[1]);
                v.stable_hash(h);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The buffered hasher gives blake3's digest of the bytes fed, across buffer boundaries,
    /// with values larger than the buffer, and when finished twice.
    #[test]
    fn key_digests_are_blake3_of_the_bytes_fed_however_buffered() {
        let big: Vec<u8> = (0..5000u32).map(|i| (i * 7 % 251) as u8).collect();
        for count in [0u32, 1, 511, 512, 513, 3000, 20_000, 70_000] {
            let mut h = KeyHasher::new("ipuq hash test v1");
            let mut plain = blake3::Hasher::new_derive_key("ipuq hash test v1");
            for i in 0..count {
                h.add(&i).add(&(i % 3 == 0));
                plain.update(&i.to_le_bytes());
                plain.update(&[(i % 3 == 0) as u8]);
                if i % 997 == 5 {
                    h.bytes(&big[..(i as usize * 13) % big.len()]);
                    let part = &big[..(i as usize * 13) % big.len()];
                    plain.update(&(part.len() as u64).to_le_bytes());
                    plain.update(part);
                }
            }
            h.bytes(&big);
            plain.update(&(big.len() as u64).to_le_bytes());
            plain.update(&big);
            // Larger than the heap buffer too.
            let huge: Vec<u8> = big.iter().cycle().take(150_000 + count as usize).copied().collect();
            h.bytes(&huge);
            plain.update(&(huge.len() as u64).to_le_bytes());
            plain.update(&huge);
            h.add(&count);
            plain.update(&count.to_le_bytes());
            let expected = Digest(*plain.finalize().as_bytes());
            assert_eq!(h.finish(), expected, "{count} values");
            assert_eq!(h.finish(), expected, "{count} values, finished again");
        }
        assert_ne!(KeyHasher::new("ipuq hash test v1").add(&1u32).finish(), KeyHasher::new("ipuq hash test v1").add(&2u32).finish());
    }
}
