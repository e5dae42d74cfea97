//! Provenance of the target's constants: which cost formulas rest on hardware measurement.
//!
//! The target file tags every constant in its comment: `[MEAS]` measured on hardware, `[OFF]`
//! official material (poplibs' cycle estimators, datasheets), `[INF]` an assumption of ipuq.
//! A constant without a tag of its own takes the tag of the comment line above it in the same
//! section (the elementwise block: "Elementwise ops, poplibs … [OFF]"); one with several tags
//! (`[OFF]/[INF]`) takes the weakest. A formula counts as measured only when every constant it
//! reads is `[MEAS]`: the simulator uses this to say how much of a cycle count is assumption.
//!
//! The tags stay in the target file, the single place that states provenance; the canonical
//! text a package embeds has no comments, so a device reads them from its own description.

use std::collections::BTreeMap;

/// How a constant is known, strongest first.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum Tag {
    Measured,
    Official,
    Inferred,
    /// No tag in the file: treated as an assumption.
    Untagged,
}

/// Tags of `section.key` constants, read from a target file's comments.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Provenance {
    tags: BTreeMap<String, Tag>,
}

fn weakest_tag(text: &str) -> Option<Tag> {
    let mut found = None;
    for (label, tag) in [("[MEAS]", Tag::Measured), ("[OFF]", Tag::Official), ("[INF]", Tag::Inferred)] {
        if text.contains(label) {
            found = Some(found.map_or(tag, |f: Tag| f.max(tag)));
        }
    }
    found
}

impl Provenance {
    /// Read the tags from a target file's text (comments included). Never fails: a line it
    /// does not understand is skipped, and a constant it finds no tag for is `Untagged`.
    pub fn from_target_text(text: &str) -> Provenance {
        let mut tags = BTreeMap::new();
        let mut section = String::new();
        let mut inherited: Option<Tag> = None;
        for line in text.lines() {
            let line = line.trim();
            if let Some(name) = line.strip_prefix('[').and_then(|l| l.strip_suffix(']')) {
                section = name.trim().to_string();
                inherited = None;
                continue;
            }
            if let Some(comment) = line.strip_prefix('#') {
                if let Some(tag) = weakest_tag(comment) {
                    inherited = Some(tag);
                }
                continue;
            }
            let Some((key, rest)) = line.split_once('=') else { continue };
            let comment = rest.split_once('#').map(|(_, c)| c).unwrap_or("");
            let tag = weakest_tag(comment).or(inherited).unwrap_or(Tag::Untagged);
            tags.insert(format!("{section}.{}", key.trim()), tag);
        }
        Provenance { tags }
    }

    /// The tag of `section.key` (`Untagged` when the file has no such constant or no tag).
    pub fn tag(&self, key: &str) -> Tag {
        self.tags.get(key).copied().unwrap_or(Tag::Untagged)
    }

    /// Whether a formula reading exactly these constants is hardware-measured.
    pub fn measured(&self, keys: &[&str]) -> bool {
        keys.iter().all(|k| self.tag(k) == Tag::Measured)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::target::fixtures;

    #[test]
    fn the_shipped_targets_tag_gemm_as_measured_and_elementwise_and_exchange_as_not() {
        for text in [fixtures::IPU21, fixtures::SMALL16] {
            let p = Provenance::from_target_text(text);
            assert!(p.measured(&["costs.gemm_base", "costs.gemm_per_row", "costs.gemm_per_block", "costs.kernel_launch"]));
            assert_eq!(p.tag("costs.gemm_transposed_weight_extra_per_block"), Tag::Inferred);
            assert_eq!(p.tag("costs.binary_base"), Tag::Official, "inherited from the elementwise comment");
            assert_eq!(p.tag("exchange.delay_per_column"), Tag::Inferred, "[OFF]/[INF] takes the weaker");
            assert_eq!(p.tag("costs.no_such_constant"), Tag::Untagged);
        }
    }
}
