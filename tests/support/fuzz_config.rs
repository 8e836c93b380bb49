//! The fuzz runs' one proptest configuration (`scripts/fuzz`), shared by the core's and the
//! indexer's fuzz targets: `FUZZ_CASES` cases (a million unless set), failures kept beside the
//! source so a found case is replayed first.

use proptest::test_runner::{Config, FileFailurePersistence};

pub fn config() -> Config {
    let cases = std::env::var("FUZZ_CASES").ok().and_then(|c| c.parse().ok()).unwrap_or(1_000_000);
    Config {
        cases,
        failure_persistence: Some(Box::new(FileFailurePersistence::WithSource("proptest-regressions"))),
        max_shrink_iters: 2_000,
        ..Config::default()
    }
}
