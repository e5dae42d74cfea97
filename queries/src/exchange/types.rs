//! The exchange scheduler's public vocabulary: the request (transfers of one phase), the
//! address-free schedule that is cached on disk, and the errors.
//!
//! These are plain data. They must not hold target constants or table encodings: the schedule
//! refers to transfers by index and word offset so that it can be replayed after storage
//! placement moves the buffers (see `reuse`).

/// One message of a phase: `words` 32-bit words from `source_address` on tile `source`, to the
/// same number of words at each destination's address.
#[derive(Clone, Debug, PartialEq, Eq, rkyv::Archive, rkyv::Serialize, rkyv::Deserialize)]
pub struct Transfer {
    pub source: u32,
    pub source_address: u32,
    pub words: u32,
    pub destinations: Destinations,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, rkyv::Archive, rkyv::Serialize, rkyv::Deserialize)]
pub struct Destination {
    pub tile: u32,
    pub address: u32,
}

/// A transfer's destinations, read as a slice. Most transfers have one, kept inline: a phase
/// request of a quarter million transfers was as many small heap blocks, made and freed again
/// by every stage that builds the request (a tenth of an `ipuq watch` edit's samples).
#[derive(Clone, rkyv::Archive, rkyv::Serialize, rkyv::Deserialize)]
pub enum Destinations {
    One(Destination),
    /// None, or two and more.
    Many(Vec<Destination>),
}

impl Destinations {
    pub fn push(&mut self, d: Destination) {
        match self {
            Destinations::One(first) => *self = Destinations::Many(vec![*first, d]),
            Destinations::Many(v) if v.is_empty() => *self = Destinations::One(d),
            Destinations::Many(v) => v.push(d),
        }
    }
}

impl Default for Destinations {
    fn default() -> Self {
        Destinations::Many(Vec::new())
    }
}

impl std::ops::Deref for Destinations {
    type Target = [Destination];
    fn deref(&self) -> &[Destination] {
        match self {
            Destinations::One(d) => std::slice::from_ref(d),
            Destinations::Many(v) => v,
        }
    }
}

impl std::ops::DerefMut for Destinations {
    fn deref_mut(&mut self) -> &mut [Destination] {
        match self {
            Destinations::One(d) => std::slice::from_mut(d),
            Destinations::Many(v) => v,
        }
    }
}

impl PartialEq for Destinations {
    fn eq(&self, other: &Self) -> bool {
        **self == **other
    }
}

impl Eq for Destinations {}

impl std::fmt::Debug for Destinations {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        (**self).fmt(f)
    }
}

impl From<Vec<Destination>> for Destinations {
    fn from(v: Vec<Destination>) -> Self {
        match v.as_slice() {
            [d] => Destinations::One(*d),
            _ => Destinations::Many(v),
        }
    }
}

impl FromIterator<Destination> for Destinations {
    fn from_iter<I: IntoIterator<Item = Destination>>(iter: I) -> Self {
        let mut iter = iter.into_iter();
        let Some(first) = iter.next() else { return Destinations::Many(Vec::new()) };
        match iter.next() {
            None => Destinations::One(first),
            Some(second) => {
                let mut v = Vec::with_capacity(2 + iter.size_hint().0);
                v.push(first);
                v.push(second);
                v.extend(iter);
                Destinations::Many(v)
            }
        }
    }
}

impl<'a> IntoIterator for &'a Destinations {
    type Item = &'a Destination;
    type IntoIter = std::slice::Iter<'a, Destination>;
    fn into_iter(self) -> Self::IntoIter {
        self.iter()
    }
}

impl<'a> IntoIterator for &'a mut Destinations {
    type Item = &'a mut Destination;
    type IntoIter = std::slice::IterMut<'a, Destination>;
    fn into_iter(self) -> Self::IntoIter {
        self.iter_mut()
    }
}

/// The transfers of one exchange phase; `index` names the phase in logs and tables.
#[derive(Clone, Debug, PartialEq, Eq, rkyv::Archive, rkyv::Serialize, rkyv::Deserialize)]
pub struct PhaseRequest {
    pub index: u32,
    pub transfers: Vec<Transfer>,
    /// Tiles that must not send and receive in the same cycle in this phase (sorted): where
    /// placement cannot keep a tile's sending and receiving buffers in different memory
    /// elements, the schedule keeps the two apart in time instead (`serialize::half_duplex`).
    /// Empty for nearly every phase.
    pub half_duplex: Vec<u32>,
}

/// Address-independent schedule: pieces refer to transfers by index and word offset.
#[derive(Clone, Debug, PartialEq, rkyv::Archive, rkyv::Serialize, rkyv::Deserialize)]
pub struct Schedule {
    /// Sorted by (send cycle, transfer, offset). Shared (`Arc`): the memoized schedule of a
    /// pattern is handed to every phase of that pattern, and to each stage that reads it,
    /// without copying its pieces; archived as a plain vector (`Unshare`).
    #[rkyv(with = rkyv::with::Unshare)]
    pub pieces: std::sync::Arc<Vec<Piece>>,
    /// Last receive cycle plus one.
    pub horizon: u32,
    /// See `bound.rs` for exactly what is counted.
    pub endpoint_lower_bound: u32,
    /// A bound above the endpoint bound, with its name ("multicast-clique"), when one applies.
    pub stronger_bound: Option<(String, u32)>,
    pub kind: ScheduleKind,
    /// Horizon of the best construction before the local search.
    pub initial_horizon: u32,
    /// Accepted local-search moves.
    pub neighborhood_improvements: u32,
    /// Whether any piece uses the paired (64-bit supertile) exchange.
    pub paired: bool,
}

impl Schedule {
    /// The best bound known for this phase: the stronger one when present.
    pub fn best_bound(&self) -> u32 {
        self.stronger_bound.as_ref().map_or(self.endpoint_lower_bound, |(_, b)| (*b).max(self.endpoint_lower_bound))
    }

    /// Horizon above the endpoint bound, in percent of the bound.
    pub fn gap_percent(&self) -> f64 {
        if self.endpoint_lower_bound == 0 {
            return 0.0;
        }
        100.0 * (self.horizon as f64 - self.endpoint_lower_bound as f64) / self.endpoint_lower_bound as f64
    }
}

/// `words` words of transfer `transfer` starting at word `offset_words`, sent from cycle
/// `send_cycle` on consecutive cycles; paired pieces move two words per cycle.
#[derive(Clone, Copy, Debug, PartialEq, Eq, rkyv::Archive, rkyv::Serialize, rkyv::Deserialize)]
pub struct Piece {
    pub transfer: u32,
    pub offset_words: u32,
    pub words: u32,
    pub send_cycle: u32,
    pub paired: bool,
}

impl Piece {
    /// Cycles the piece occupies each of its ports.
    pub fn cycles(&self) -> u32 {
        if self.paired {
            self.words / 2
        } else {
            self.words
        }
    }
}

/// Which construction produced a schedule (its `name()` is what the logs print).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, rkyv::Archive, rkyv::Serialize, rkyv::Deserialize)]
pub enum ScheduleKind {
    /// Weighted bipartite edge colouring (Gonzalez–Sahni blocks), then timed with the delays.
    MatchingWaves,
    /// Preemptive greedy that serves the most-loaded ports first; handles multicast and pairs.
    FullDuplex,
    /// A construction improved by the critical-path local search.
    CriticalNeighborhood,
    /// A cached schedule of an identical pattern with new addresses patched in.
    Reused,
    /// The plain fallback: transfers one after another in request order, no preemption.
    Greedy,
}

impl ScheduleKind {
    pub fn name(self) -> &'static str {
        match self {
            ScheduleKind::MatchingWaves => "matching-waves",
            ScheduleKind::FullDuplex => "full-duplex",
            ScheduleKind::CriticalNeighborhood => "critical-neighborhood",
            ScheduleKind::Reused => "reused",
            ScheduleKind::Greedy => "greedy",
        }
    }
}

/// A request the scheduler cannot accept, or a cached schedule that does not fit.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ExchangeError {
    #[error("exchange phase {phase}, transfer {transfer}: {message}")]
    Malformed { phase: u32, transfer: u32, message: String },
    #[error("exchange phase {phase}: cached schedule does not fit this phase: {message}")]
    CachedMismatch { phase: u32, message: String },
    #[error("exchange phase {phase}: {source}")]
    Invalid { phase: u32, source: ValidationError },
}

/// Why a set of exchange tables is wrong; every variant names the tile and cycle concerned.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ValidationError {
    #[error("tile {tile} is outside the chip")]
    TileOutOfRange { tile: u32 },
    #[error("tables are not sorted: {message}")]
    Unsorted { message: String },
    #[error("tile {tile}: {port} port used twice at cycle {cycle}")]
    PortConflict { tile: u32, port: &'static str, cycle: u32 },
    #[error("tile {tile}: receive at cycle {cycle} from tile {source_tile} matches no send at cycle {send_cycle}")]
    UnmatchedReceive { tile: u32, cycle: u32, source_tile: u32, send_cycle: i64 },
    #[error("tile {tile}: send at cycle {cycle} is not received by any tile (word sent for nothing or twice)")]
    UnreceivedSend { tile: u32, cycle: u32 },
    #[error("tile {tile}: {words} words sent, the phase asks for {expected}")]
    SentWords { tile: u32, words: u64, expected: u64 },
    #[error("tile {tile}: address {address:#x} {message}")]
    Coverage { tile: u32, address: u32, message: String },
    #[error("tile {tile}: paired entry at cycle {cycle} {message}")]
    Paired { tile: u32, cycle: u32, message: String },
    #[error("entry of tile {tile} at cycle {cycle} has zero words")]
    Empty { tile: u32, cycle: u32 },
    #[error("tables say horizon {stated}, their last receive ends at {actual}")]
    Horizon { stated: u32, actual: u32 },
}
