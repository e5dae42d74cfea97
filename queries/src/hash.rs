//! Content digests and the stable-hash trait that feeds cache keys.
//!
//! Only types implementing [`StableHash`] can be fed to a key hasher, so a path, a clock
//! or a `HashMap` iteration order cannot leak into a key by accident.

use std::fmt;
use std::sync::{Arc, Mutex};

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

/// blake3 of a byte stream, its whole 256 KiB blocks hashed on rayon workers while the stream
/// goes on (`io::Write`): the same digest as `blake3::hash` of all the bytes, for a writer
/// (a serialiser) that cannot hash as fast as it writes. A block is a complete subtree of
/// blake3's tree wherever more input follows it (`BLOCK` is a power of two of chunks), so each
/// is hashed as a subtree at its offset (`hazmat`) and the chaining values are merged in the
/// tree's left-balanced shape at the end. A stream of one block or less is hashed in place.
///
/// Full blocks wait in a queue, and each spawned job hashes one of them; at the end the
/// writer hashes those no worker has taken itself, so it never waits for a busy pool (nor
/// deadlocks on a one-thread pool), only for the blocks workers are hashing. Hashed blocks
/// come back for the stream's next ones, so the few blocks in flight stay in the processors'
/// caches (fresh blocks for a whole program, tens of megabytes, made the digest slower than
/// hashing on the serialising thread).
#[derive(Default)]
pub struct TreeHasher {
    block: Vec<u8>,
    /// Blocks handed on so far (block i starts at byte i · `BLOCK`).
    spawned: u64,
    /// The full blocks no worker has taken yet, and where workers send their blocks' chaining
    /// values with the blocks emptied (made with the first full block).
    #[allow(clippy::type_complexity)]
    shared: Option<(Arc<Mutex<Vec<(u64, Vec<u8>)>>>, std::sync::mpsc::Sender<Hashed>, std::sync::mpsc::Receiver<Hashed>)>,
    /// Chaining values known so far, by block.
    cvs: Vec<Option<blake3::hazmat::ChainingValue>>,
    /// The block's length up to which bytes are copied without a look at its capacity.
    room: usize,
}

/// A block's index, its chaining value, and the block emptied.
type Hashed = (u64, blake3::hazmat::ChainingValue, Vec<u8>);

/// Bytes of a `TreeHasher` block: 256 of blake3's chunks.
const BLOCK: usize = 1 << 18;

/// The chaining value of block `index` (`TreeHasher`).
fn block_cv(index: u64, block: &[u8]) -> blake3::hazmat::ChainingValue {
    use blake3::hazmat::HasherExt;
    blake3::Hasher::new().set_input_offset(index * BLOCK as u64).update(block).finalize_non_root()
}

impl TreeHasher {
    /// The full block goes to the queue, with a job to hash one; the stream goes on in a block
    /// a worker gave back, else a new one.
    fn spawn_block(&mut self) {
        let (queue, sender, receiver) = self.shared.get_or_insert_with(|| {
            let (sender, receiver) = std::sync::mpsc::channel();
            (Arc::default(), sender, receiver)
        });
        let next = match receiver.try_recv() {
            Ok((index, cv, mut emptied)) => {
                self.cvs[index as usize] = Some(cv);
                emptied.clear();
                emptied
            }
            Err(_) => Vec::with_capacity(BLOCK),
        };
        let block = std::mem::replace(&mut self.block, next);
        queue.lock().expect("block queue lock").push((self.spawned, block));
        self.cvs.push(None);
        self.spawned += 1;
        let (queue, sender) = (queue.clone(), sender.clone());
        rayon::spawn(move || {
            // None left when the writer has finished first and hashed them itself.
            let Some((index, block)) = queue.lock().expect("block queue lock").pop() else { return };
            // The receiver is gone only when the hasher was dropped unfinished.
            let _ = sender.send((index, block_cv(index, &block), block));
        });
    }

    /// `write_all` past the block's room: the block grows (the first, as it fills: most values
    /// digested are small) or, full, goes to a worker.
    #[cold]
    #[inline(never)]
    fn write_on(&mut self, mut bytes: &[u8]) {
        while !bytes.is_empty() {
            if self.block.len() == BLOCK {
                self.spawn_block();
            } else if self.block.capacity() < BLOCK {
                self.block.reserve_exact((BLOCK / 16).max(self.block.len()).min(BLOCK - self.block.len()));
            }
            self.room = self.block.capacity().min(BLOCK);
            let take = (self.room - self.block.len()).min(bytes.len());
            self.block.extend_from_slice(&bytes[..take]);
            bytes = &bytes[take..];
        }
    }

    /// The digest of every byte written.
    pub fn finalize(self) -> Digest {
        let Some((queue, _, receiver)) = &self.shared else {
            return Digest::of_bytes(&self.block);
        };
        // The last block (never empty: a full block is handed on only when more bytes follow).
        let last = block_cv(self.spawned, &self.block);
        let mut cvs = self.cvs;
        // Blocks no worker took, hashed here; then those being hashed, waited for.
        let left: Vec<(u64, Vec<u8>)> = std::mem::take(&mut *queue.lock().expect("block queue lock"));
        for (index, block) in left {
            cvs[index as usize] = Some(block_cv(index, &block));
        }
        while cvs.iter().any(Option::is_none) {
            let (index, cv, _) = receiver.recv().expect("the hasher holds a sender");
            cvs[index as usize] = Some(cv);
        }
        let mut cvs: Vec<blake3::hazmat::ChainingValue> = cvs.into_iter().map(|cv| cv.expect("every block hashed")).collect();
        cvs.push(last);
        let len = self.spawned * BLOCK as u64 + self.block.len() as u64;
        Digest(*merge_root(&cvs, len).as_bytes())
    }
}

/// The root of blocks' chaining values covering `len` bytes (more than one block).
fn merge_root(cvs: &[blake3::hazmat::ChainingValue], len: u64) -> blake3::Hash {
    let (blocks, left) = left_subtree(len);
    blake3::hazmat::merge_subtrees_root(&merge(&cvs[..blocks], left), &merge(&cvs[blocks..], len - left), blake3::hazmat::Mode::Hash)
}

/// The chaining value of the subtree of blocks `cvs` covering `len` bytes.
fn merge(cvs: &[blake3::hazmat::ChainingValue], len: u64) -> blake3::hazmat::ChainingValue {
    if cvs.len() == 1 {
        return cvs[0];
    }
    let (blocks, left) = left_subtree(len);
    blake3::hazmat::merge_subtrees_non_root(&merge(&cvs[..blocks], left), &merge(&cvs[blocks..], len - left), blake3::hazmat::Mode::Hash)
}

/// The left subtree of a tree over `len` bytes (more than one block): its blocks and bytes. It
/// ends at a multiple of blocks (`BLOCK` is a power of two).
fn left_subtree(len: u64) -> (usize, u64) {
    let left = blake3::hazmat::left_subtree_len(len);
    ((left / BLOCK as u64) as usize, left)
}

impl std::io::Write for TreeHasher {
    #[inline]
    fn write(&mut self, bytes: &[u8]) -> std::io::Result<usize> {
        self.write_all(bytes)?;
        Ok(bytes.len())
    }

    /// A serialiser writes a few bytes at a time: those that fit the block's room are copied
    /// with one comparison (most of `digest_of`'s cost on the serialising thread).
    #[inline]
    fn write_all(&mut self, bytes: &[u8]) -> std::io::Result<()> {
        if self.block.len() + bytes.len() <= self.room {
            self.block.extend_from_slice(bytes);
        } else {
            self.write_on(bytes);
        }
        Ok(())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The tree hasher gives blake3's digest of the bytes written, at and around block
    /// boundaries, whatever the writes' sizes, on any pool (one thread included).
    #[test]
    fn tree_digests_are_blake3_of_the_bytes_written() {
        use std::io::Write;
        let bytes: Vec<u8> = (0..(5 * BLOCK + 3000) as u64).map(|i| ((i * 2654435761) >> 13) as u8).collect();
        let one = rayon::ThreadPoolBuilder::new().num_threads(1).build().unwrap();
        for len in [0, 1, 1024, 1025, BLOCK - 1, BLOCK, BLOCK + 1, 2 * BLOCK, 2 * BLOCK + 1, 3 * BLOCK + 17, 4 * BLOCK, 5 * BLOCK + 3000] {
            let input = &bytes[..len];
            for piece in [7usize, 4096, BLOCK + 5] {
                let hash = || {
                    let mut h = TreeHasher::default();
                    for part in input.chunks(piece) {
                        h.write_all(part).unwrap();
                    }
                    h.finalize()
                };
                assert_eq!(hash(), Digest::of_bytes(input), "{len} bytes in writes of {piece}");
                assert_eq!(one.install(hash), Digest::of_bytes(input), "{len} bytes in writes of {piece}, one thread");
            }
        }
    }

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
