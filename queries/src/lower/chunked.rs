//! [`Chunked`]: a vector kept in shared chunks of `1 << BITS` elements, each copied on its
//! first write, so that the lowered prefixes of the plan beam (`build::Partial`), copied once
//! per extension, share what their extensions leave alone: a copy costs one pointer per chunk
//! (not the whole prefix, whose buffers grow with every layer), and a write copies only the
//! chunk it lands in.

use std::ops::{Index, IndexMut};
use std::sync::Arc;

#[derive(Clone, Debug)]
pub struct Chunked<T, const BITS: u32> {
    chunks: Vec<Arc<Vec<T>>>,
    len: usize,
}

impl<T, const BITS: u32> Default for Chunked<T, BITS> {
    fn default() -> Self {
        Chunked { chunks: Vec::new(), len: 0 }
    }
}

impl<T: Clone, const BITS: u32> Chunked<T, BITS> {
    const CHUNK: usize = 1 << BITS;

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    pub fn push(&mut self, value: T) {
        if self.len.is_multiple_of(Self::CHUNK) {
            self.chunks.push(Arc::new(Vec::with_capacity(Self::CHUNK)));
        }
        let last = self.chunks.last_mut().expect("a chunk with room");
        if Arc::strong_count(last) > 1 || Arc::weak_count(last) > 0 {
            // Shared with the prefix this one extends: copied with room for the whole chunk.
            let mut own = Vec::with_capacity(Self::CHUNK);
            own.extend_from_slice(last);
            *last = Arc::new(own);
        }
        Arc::get_mut(last).expect("an unshared chunk").push(value);
        self.len += 1;
    }

    pub fn get(&self, i: usize) -> Option<&T> {
        (i < self.len).then(|| &self.chunks[i >> BITS][i & (Self::CHUNK - 1)])
    }

    pub fn last(&self) -> Option<&T> {
        self.len.checked_sub(1).and_then(|i| self.get(i))
    }

    pub fn last_mut(&mut self) -> Option<&mut T> {
        let i = self.len.checked_sub(1)?;
        Some(&mut self[i])
    }

    pub fn iter(&self) -> impl DoubleEndedIterator<Item = &T> + Clone + '_ {
        self.chunks.iter().flat_map(|c| c.iter())
    }

    /// The elements as one vector (chunks no other vector shares are moved, not copied).
    pub fn into_vec(self) -> Vec<T> {
        let mut out = Vec::with_capacity(self.len);
        for chunk in self.chunks {
            match Arc::try_unwrap(chunk) {
                Ok(own) => out.extend(own),
                Err(shared) => out.extend_from_slice(&shared),
            }
        }
        out
    }
}

impl<T: Clone, const BITS: u32> FromIterator<T> for Chunked<T, BITS> {
    fn from_iter<I: IntoIterator<Item = T>>(items: I) -> Self {
        let mut out = Chunked::default();
        for item in items {
            out.push(item);
        }
        out
    }
}

impl<T: Clone, const BITS: u32> Index<usize> for Chunked<T, BITS> {
    type Output = T;

    fn index(&self, i: usize) -> &T {
        assert!(i < self.len, "index {i} out of {} elements", self.len);
        &self.chunks[i >> BITS][i & (Self::CHUNK - 1)]
    }
}

impl<T: Clone, const BITS: u32> IndexMut<usize> for Chunked<T, BITS> {
    /// The element, its chunk copied first when another vector shares it.
    fn index_mut(&mut self, i: usize) -> &mut T {
        assert!(i < self.len, "index {i} out of {} elements", self.len);
        &mut Arc::make_mut(&mut self.chunks[i >> BITS])[i & (Self::CHUNK - 1)]
    }
}

#[cfg(test)]
mod tests {
    use super::Chunked;

    /// A copy and its original diverge element by element, as two vectors would; unchanged
    /// chunks stay shared.
    #[test]
    fn copies_behave_as_vectors() {
        let mut a: Chunked<u32, 2> = (0..10).collect();
        let mut b = a.clone();
        b[1] = 100;
        b.push(10);
        a.push(20);
        *a.last_mut().unwrap() += 1;
        assert_eq!(a.clone().into_vec(), (0..10).chain([21]).collect::<Vec<_>>());
        assert_eq!(b.iter().copied().collect::<Vec<_>>(), [0, 100, 2, 3, 4, 5, 6, 7, 8, 9, 10]);
        assert_eq!((a.len(), b.len(), a[9], b.get(11), a.last()), (11, 11, 9, None, Some(&21)));
        assert!(std::sync::Arc::ptr_eq(&a.chunks[1], &b.chunks[1]));
        assert!(!std::sync::Arc::ptr_eq(&a.chunks[0], &b.chunks[0]));
    }
}
