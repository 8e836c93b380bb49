//! A filter VM's view of the load table the service publishes. The table is decoded only when its
//! version moves; staleness is judged at read time, so a service that stops publishing makes
//! reports go stale instead of freezing them.

use std::sync::{Arc, Mutex};

use super::table::{LoadSnapshot, LoadTable, LoadView};
use crate::host::Host;
use crate::state::keys;
use crate::state::shared::VersionedReader;

struct Cached {
    reader: VersionedReader<LoadTable>,
    version: Option<u64>,
    snapshot: Arc<LoadSnapshot>,
    valid_until_ms: u64,
}

pub struct SharedLoadView {
    host: Arc<dyn Host>,
    stale_after_ms: u64,
    cached: Mutex<Cached>,
}

impl SharedLoadView {
    /// `recheck_ms`: see [`VersionedReader::rechecked_every`].
    pub fn new(host: Arc<dyn Host>, stale_after_ms: u64, recheck_ms: u64) -> Self {
        Self {
            host,
            stale_after_ms,
            cached: Mutex::new(Cached {
                reader: VersionedReader::new(keys::LOAD_TABLE).rechecked_every(recheck_ms),
                version: None,
                snapshot: Arc::default(),
                valid_until_ms: 0,
            }),
        }
    }
}

impl std::fmt::Debug for SharedLoadView {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SharedLoadView").field("stale_after_ms", &self.stale_after_ms).finish()
    }
}

impl LoadView for SharedLoadView {
    fn snapshot(&self) -> Arc<LoadSnapshot> {
        let Ok(mut cached) = self.cached.lock() else {
            return Arc::default();
        };
        let now = self.host.now_ms();
        let cached = &mut *cached;
        cached.reader.refresh(self.host.as_ref());
        let version = cached.reader.version();
        if version != cached.version || now >= cached.valid_until_ms {
            let (snapshot, valid_until) = match cached.reader.value() {
                Some(t) => t.snapshot_until(now, self.stale_after_ms),
                None => (LoadSnapshot::default(), u64::MAX),
            };
            cached.snapshot = Arc::new(snapshot);
            cached.valid_until_ms = valid_until;
            cached.version = version;
        }
        Arc::clone(&cached.snapshot)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::host::MemoryHost;
    use crate::state::load_monitor::{RankReport, ReportKind, SentCounts};
    use crate::state::shared::publish;
    use crate::testing::test;

    #[test]
    fn reads_the_published_table_and_lets_reports_go_stale() {
        let host = Arc::new(MemoryHost::default());
        let view = SharedLoadView::new(host.clone(), 1000, 0);
        assert!(view.snapshot().get("A").is_none());
        let mut table = LoadTable::default();
        let report = RankReport { running: Some(3), waiting: Some(1), ..RankReport::default() };
        table.record("A", 1, ReportKind::Basic, vec![report], host.now_ms(), SentCounts::default());
        publish(host.as_ref(), keys::LOAD_TABLE, &serde_json::to_vec(&table).unwrap()).unwrap();
        assert_eq!(view.snapshot().get("A").and_then(|l| l.running), Some(3));
        host.advance_ms(1000);
        assert!(view.snapshot().get("A").is_some());
        host.advance_ms(1);
        assert!(view.snapshot().get("A").is_none(), "stale without a new publication");
    }
}
