//! The target description: every machine constant, read from a TOML file (`fixtures/targets/`).
//!
//! Code never holds a machine constant as a literal; it reads it from a [`Target`].
//! The cost formulas built on these constants live in `cost.rs`; the route delay model here.

use serde::{Deserialize, Serialize};

use crate::hash::{Digest, KeyHasher};

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Target {
    pub name: String,
    pub chip: Chip,
    pub memory: Memory,
    pub compute: Compute,
    pub costs: Costs,
    pub exchange: Exchange,
    pub host: Host,
}

#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Chip {
    pub tiles: u32,
    pub columns: u32,
    pub tiles_per_column: u32,
    pub clock_hz: u64,
    pub workers: u32,
}

#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Memory {
    pub base: u32,
    pub size: u32,
    pub interleaved_start: u32,
    pub instruction_fetch_limit: u32,
    pub loader_limit: u32,
    pub element_bytes: u32,
    pub interleaved_element_bytes: u32,
    pub partial_alignment: u32,
    pub data_alignment: u32,
    /// The AMP's 128-bit weight-load path needs weights in interleaved memory at this alignment
    /// (address and row pitch); other weights load 64 bits at a time (the standard-memory cost).
    pub weight_load_alignment: u32,
}

#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Compute {
    pub amp_f16_macs_per_cycle: u32,
    pub amp_f32_macs_per_cycle: u32,
    pub peak_flops_per_cycle: u32,
    pub vector_f16_lanes: u32,
    pub vector_f32_lanes: u32,
}

#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Costs {
    pub gemm_base: u64,
    pub gemm_block: u64,
    pub gemm_per_row: u64,
    pub gemm_per_block: u64,
    pub gemm_standard_weight_extra_per_block: u64,
    pub gemm_transposed_weight_extra_per_block: u64,
    pub reduce_base: u64,
    pub reduce_chunk: u64,
    pub reduce_chunk_base: u64,
    pub reduce_per_partial: u64,
    pub gelu_base: u64,
    pub gelu_chunk: u64,
    pub gelu_per_chunk: u64,
    pub gelu_erf_per_chunk: u64,
    pub kernel_launch: u64,
    pub binary_base: u64,
    pub binary_tail: u64,
    pub float_setup: u64,
    pub unary_base: u64,
    pub unary_exp_base: u64,
    pub unary_tail: u64,
    pub cpl_add_half: u64,
    pub cpl_add_float: u64,
    pub cpl_mul_half: u64,
    pub cpl_mul_float: u64,
    pub cpl_exp_half: u64,
    pub cpl_exp_float: u64,
    pub cpl_max_half: u64,
    pub cpl_max_float: u64,
    pub cpl_divide_half: u64,
    pub cpl_divide_float: u64,
    pub copy_overhead: u64,
    pub copy_standard_bytes_per_cycle: u64,
    pub copy_interleaved_bytes_per_cycle: u64,
    pub copy_word_cycles: u64,
    pub transpose_cycles_per_element: u64,
}

#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Exchange {
    pub send_words_per_cycle: u32,
    pub receive_words_per_cycle: u32,
    pub paired_words_per_cycle: u32,
    pub sync_cycles: u64,
    pub delay_base: u32,
    pub delay_per_column: u32,
    pub delay_per_row_group: u32,
    pub row_group: u32,
    pub delay_turn: u32,
}

#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Host {
    pub link_bytes_per_second: u64,
    pub page_bytes: u64,
}

#[derive(Debug, thiserror::Error)]
pub enum TargetError {
    #[error("target description {origin}: {message}")]
    Parse { origin: String, message: String },
    #[error("target description {origin}: {message}")]
    Invalid { origin: String, message: String },
}

impl Target {
    /// Parse and check a target description; `origin` names the file in errors.
    pub fn from_toml(text: &str, origin: &str) -> Result<Target, TargetError> {
        let target: Target = toml::from_str(text)
            .map_err(|e| TargetError::Parse { origin: origin.to_string(), message: e.to_string().trim().to_string() })?;
        target.check().map_err(|message| TargetError::Invalid { origin: origin.to_string(), message })?;
        Ok(target)
    }

    fn check(&self) -> Result<(), String> {
        let c = &self.chip;
        if c.tiles == 0 || c.columns * c.tiles_per_column != c.tiles {
            return Err(format!("chip.tiles = {} must equal columns ({}) x tiles_per_column ({})", c.tiles, c.columns, c.tiles_per_column));
        }
        if !c.tiles.is_multiple_of(2) {
            return Err(format!("chip.tiles = {} must be even (tiles pair into supertiles)", c.tiles));
        }
        if c.tiles > 2048 {
            return Err(format!("chip.tiles = {} exceeds 2048 (exchange records hold an 11-bit source tile)", c.tiles));
        }
        let m = &self.memory;
        let end = m.base as u64 + m.size as u64;
        if !(m.base < m.interleaved_start && (m.interleaved_start as u64) < end) {
            return Err("memory.interleaved_start must lie inside [base, base + size)".into());
        }
        if m.loader_limit as u64 > end || m.loader_limit <= m.interleaved_start {
            return Err("memory.loader_limit must lie inside the interleaved region".into());
        }
        if m.data_alignment == 0 || m.partial_alignment == 0 || m.weight_load_alignment == 0 {
            return Err("memory alignments must be positive".into());
        }
        if c.clock_hz == 0 || self.exchange.row_group == 0 || self.costs.gemm_block == 0 || self.costs.reduce_chunk == 0 || self.costs.gelu_chunk == 0 {
            return Err("clock, row_group and cost chunk sizes must be positive".into());
        }
        if self.exchange.send_words_per_cycle != 1 || self.exchange.receive_words_per_cycle != 1 || self.exchange.paired_words_per_cycle != 2 {
            return Err("exchange: ipuq models one word per cycle per port and two for supertile pairs".into());
        }
        Ok(())
    }

    /// Canonical text (no comments, fixed order): what the digest covers and the package embeds.
    pub fn canonical_toml(&self) -> String {
        toml::to_string(self).expect("a target always serialises")
    }

    /// Identity of the machine model: changes whenever any constant changes.
    pub fn digest(&self) -> Digest {
        KeyHasher::new("ipuq target v1").bytes(self.canonical_toml().as_bytes()).finish()
    }

    /// The chip's grid alone (tile count and layout), the rest of `chip` zeroed.
    fn grid(&self) -> Chip {
        Chip { tiles: self.chip.tiles, columns: self.chip.columns, tiles_per_column: self.chip.tiles_per_column, clock_hz: 0, workers: 0 }
    }

    /// What planning and lowering read: every section but the host link (and no name).
    /// Stages get views, not the whole target, so a key over a view's digest is complete by
    /// construction: a constant outside the view reads as zero in that stage.
    pub fn lowering_view(&self) -> Target {
        Target { name: String::new(), host: Host::default(), ..self.clone() }
    }

    /// What finalist selection reads: the lowering view plus the host link rate, which the
    /// host pass (`lower/host.rs`) weighs against exchange copies.
    pub fn selection_view(&self) -> Target {
        Target { name: String::new(), host: Host { link_bytes_per_second: self.host.link_bytes_per_second, page_bytes: 0 }, ..self.clone() }
    }

    /// What exchange scheduling, table lowering and validation read: the grid (tile count,
    /// pairing), the route delays and the port widths; not the sync cost, not memory, costs
    /// or host.
    pub fn exchange_view(&self) -> Target {
        Target {
            name: String::new(),
            chip: self.grid(),
            memory: Memory::default(),
            compute: Compute::default(),
            costs: Costs::default(),
            exchange: Exchange { sync_cycles: 0, ..self.exchange.clone() },
            host: Host::default(),
        }
    }

    /// What placement reads: the grid and the memory constants.
    pub fn memory_view(&self) -> Target {
        Target {
            name: String::new(),
            chip: self.grid(),
            memory: self.memory.clone(),
            compute: Compute::default(),
            costs: Costs::default(),
            exchange: Exchange::default(),
            host: Host::default(),
        }
    }

    /// Digest of a view (`section` names it, so two views never share a digest by accident).
    pub fn view_digest(&self, section: &str) -> Digest {
        KeyHasher::new("ipuq target view v1").add(section).bytes(self.canonical_toml().as_bytes()).finish()
    }

    /// Column and row of a tile on the chip's grid.
    pub fn tile_position(&self, tile: u32) -> (u32, u32) {
        (tile / self.chip.tiles_per_column, tile % self.chip.tiles_per_column)
    }

    /// Fixed delivery delay (cycles) of a word sent from `source` to `destination`:
    /// the route model documented in the target file.
    pub fn delay(&self, source: u32, destination: u32) -> u32 {
        let x = &self.exchange;
        let (cs, rs) = self.tile_position(source);
        let (cd, rd) = self.tile_position(destination);
        let half = self.chip.columns / 2;
        let turn = if (cs < half) != (cd < half) { x.delay_turn } else { 0 };
        x.delay_base
            + x.delay_per_column * cs.abs_diff(cd)
            + x.delay_per_row_group * (rs / x.row_group).abs_diff(rd / x.row_group)
            + turn
    }

    /// Smallest and largest delay over all pairs (for bounds and reports).
    pub fn delay_range(&self) -> (u32, u32) {
        let x = &self.exchange;
        let max_rows = (self.chip.tiles_per_column - 1) / x.row_group;
        let turn = if self.chip.columns > 1 { x.delay_turn } else { 0 };
        (x.delay_base, x.delay_base + x.delay_per_column * (self.chip.columns - 1) + x.delay_per_row_group * max_rows + turn)
    }

    /// Supertile partner of a tile (tiles 2k and 2k+1 pair).
    pub fn partner(&self, tile: u32) -> u32 {
        tile ^ 1
    }

    pub fn peak_tflops(&self) -> f64 {
        self.chip.tiles as f64 * self.compute.peak_flops_per_cycle as f64 * self.chip.clock_hz as f64 / 1e12
    }
}

/// The fixtures shipped with ipuq, for tests and the default command line.
pub mod fixtures {
    pub const IPU21: &str = include_str!("../../fixtures/targets/ipu21.toml");
    pub const SMALL16: &str = include_str!("../../fixtures/targets/small16.toml");
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fixtures_parse_and_differ() {
        let big = Target::from_toml(fixtures::IPU21, "ipu21.toml").unwrap();
        let small = Target::from_toml(fixtures::SMALL16, "small16.toml").unwrap();
        assert_eq!(big.chip.tiles, 1472);
        assert_eq!(small.chip.tiles, 16);
        assert_ne!(big.digest(), small.digest());
        assert!((big.peak_tflops() - 282.624).abs() < 1e-9);
    }

    #[test]
    fn delays_are_symmetric_and_within_range() {
        let t = Target::from_toml(fixtures::IPU21, "ipu21.toml").unwrap();
        let (lo, hi) = t.delay_range();
        for (a, b) in [(0, 1471), (5, 700), (91, 92), (0, 0)] {
            let d = t.delay(a, b);
            assert_eq!(d, t.delay(b, a));
            assert!(lo <= d && d <= hi, "{d} outside [{lo}, {hi}]");
        }
        assert_eq!(t.delay(0, 1471), hi);
    }

    #[test]
    fn views_change_only_with_their_sections() {
        let base = Target::from_toml(fixtures::SMALL16, "small16.toml").unwrap();
        let edit = |from: &str, to: &str| {
            assert!(fixtures::SMALL16.contains(from), "{from}");
            Target::from_toml(&fixtures::SMALL16.replacen(from, to, 1), "edited.toml").unwrap()
        };
        let views = |t: &Target| [t.lowering_view().view_digest("lowering"), t.exchange_view().view_digest("exchange"), t.memory_view().view_digest("memory")];
        let b = views(&base);
        // Runtime only: no compile view moves.
        let host = edit("link_bytes_per_second = ", "link_bytes_per_second = 1");
        assert_eq!(views(&host), b);
        assert_ne!(host.digest(), base.digest());
        // A cost constant: lowering only.
        let cost = views(&edit("gelu_base = ", "gelu_base = 1"));
        assert_ne!(cost[0], b[0]);
        assert_eq!(cost[1..], b[1..]);
        // A delay: lowering (its exchange estimate) and scheduling, not placement.
        let delay = views(&edit("delay_base = 12", "delay_base = 30"));
        assert_ne!(delay[0], b[0]);
        assert_ne!(delay[1], b[1]);
        assert_eq!(delay[2], b[2]);
    }

    #[test]
    fn unknown_field_is_named() {
        let text = fixtures::SMALL16.replace("workers = 6", "workers = 6\nwarp_drive = 1");
        let err = Target::from_toml(&text, "bad.toml").unwrap_err().to_string();
        assert!(err.contains("bad.toml") && err.contains("warp_drive"), "{err}");
    }
}
