//! A running indexer's view for a replica that starts after it (`sgl-indexer --peer URL`,
//! `GET /v1/snapshot`): every engine rank's pages, oldest first, with the sequence number of the
//! last batch it applied, so the new replica repairs from there by the engine's replay instead of
//! waiting for each engine to publish again. msgpack through serde: compact, and decoded by the
//! same well-kept crate that reads the engines' events.

use serde::{Deserialize, Serialize};

use crate::events::Medium;
use crate::index::{Chain, ExportedPage};

/// Changes whenever the layout below does: a replica refuses a snapshot of another layout.
pub const VERSION: u32 = 1;

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Snapshot {
    pub version: u32,
    /// Keys are chained per `block_tokens`: a replica configured otherwise keys differently.
    pub block_tokens: u32,
    pub ranks: Vec<RankView>,
}

/// One engine rank: current to batch `seq` of its publisher.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RankView {
    pub worker: String,
    pub rank: u32,
    pub seq: u64,
    pub pages: Vec<PageView>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PageView {
    pub hash: u64,
    pub medium: u8,
    pub chain: u64,
    pub filled: u32,
    pub completes: Vec<u64>,
}

impl From<ExportedPage> for PageView {
    fn from(p: ExportedPage) -> Self {
        let (chain, filled) = p.after.parts();
        PageView { hash: p.hash, medium: p.medium as u8, chain, filled, completes: p.completes }
    }
}

impl From<PageView> for ExportedPage {
    fn from(p: PageView) -> Self {
        let medium = Medium::ALL.get(usize::from(p.medium)).copied().unwrap_or(Medium::Gpu);
        ExportedPage { hash: p.hash, medium, after: Chain::from_parts(p.chain, p.filled), completes: p.completes }
    }
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SnapshotError {
    #[error("not a snapshot: {0}")]
    Decode(String),
    #[error("a snapshot of layout {0}; this indexer reads {VERSION}")]
    Version(u32),
    #[error("the peer keys {0}-token blocks; this indexer {1}")]
    BlockTokens(u32, u32),
}

impl Snapshot {
    pub fn encode(&self) -> Vec<u8> {
        rmp_serde::to_vec(self).unwrap_or_default()
    }

    pub fn decode(bytes: &[u8], block_tokens: u32) -> Result<Self, SnapshotError> {
        let s: Snapshot = rmp_serde::from_slice(bytes).map_err(|e| SnapshotError::Decode(e.to_string()))?;
        if s.version != VERSION {
            return Err(SnapshotError::Version(s.version));
        }
        if s.block_tokens != block_tokens {
            return Err(SnapshotError::BlockTokens(s.block_tokens, block_tokens));
        }
        Ok(s)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_snapshot_round_trips_and_refuses_another_layout_or_block_size() {
        let page = ExportedPage {
            hash: u64::MAX - 3,
            medium: Medium::CpuPinned,
            after: Chain::from_parts(42, 3),
            completes: vec![7, 8],
        };
        let s = Snapshot {
            version: VERSION,
            block_tokens: 16,
            ranks: vec![RankView { worker: "A".into(), rank: 1, seq: 9, pages: vec![page.clone().into()] }],
        };
        let bytes = s.encode();
        let back = Snapshot::decode(&bytes, 16).unwrap();
        assert_eq!(back, s);
        assert_eq!(ExportedPage::from(back.ranks[0].pages[0].clone()), page);
        assert_eq!(Snapshot::decode(&bytes, 4), Err(SnapshotError::BlockTokens(16, 4)));
        let other = Snapshot { version: VERSION + 1, ..s };
        assert_eq!(Snapshot::decode(&other.encode(), 16), Err(SnapshotError::Version(VERSION + 1)));
        assert!(matches!(Snapshot::decode(b"\xc1garbage", 16), Err(SnapshotError::Decode(_))));
    }
}
