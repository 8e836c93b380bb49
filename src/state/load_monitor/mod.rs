//! Engine-reported load and router-local request accounting (design §6). The service parses the
//! engines' reports into a [`LoadTable`] and publishes it; policies read it through [`LoadView`],
//! and count dispatches through [`InflightTable`].

mod batching;
mod fleet;
mod inflight;
mod poller;
mod reports;
mod shared_inflight;
mod shared_view;
mod speed;
mod table;
mod unanswered;

pub use batching::{Batching, Pair};
pub use fleet::{EngineFit, Prior};
pub use inflight::{FirstByte, InflightGuard, InflightTable, LocalLoad, MemoryInflight, PrefillWork};
pub use poller::{LoadPoller, ReportEndpoint};
pub use reports::{parse_get_load, parse_prometheus, parse_v1_loads, RankReport, ReportError, ReportKind};
pub use shared_inflight::{SharedInflight, SYNC_MS};
pub use shared_view::SharedLoadView;
pub use speed::{Late, Sample, Speed, SpeedFit};
pub use table::{EngineLoad, LoadSnapshot, LoadTable, LoadView, SentCounts, StaticLoad};
pub use unanswered::{Waited, Waiting};
