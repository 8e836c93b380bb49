//! What the indexer's benchmark programs (`indexer-bench`, `indexer-compare`) share: synthetic
//! documents, percentiles, resident memory.

/// Document `d`'s tokens, its own throughout; with `shared`, the first 1,024 are common to groups
/// of 8 documents (a system prompt several engines hold).
pub fn doc_tokens(d: u32, len: u32, shared: bool) -> Vec<u32> {
    (0..len)
        .map(|i| if shared && i < 1024 { (d / 8) * 7919 + i } else { d.wrapping_mul(104_729).wrapping_add(i) })
        .collect()
}

/// The `p` quantile (0..=1) of `xs`, nearest rank; 0 when empty.
pub fn percentile(mut xs: Vec<f64>, p: f64) -> f64 {
    xs.sort_by(|a, b| a.total_cmp(b));
    xs.get(((xs.len() as f64 - 1.0) * p).round() as usize).copied().unwrap_or(0.0)
}

/// Resident memory of process `pid` (`self` for this one), in MiB.
pub fn rss_mib(pid: &str) -> Option<f64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    let kb: f64 = status.lines().find(|l| l.starts_with("VmRSS:"))?.split_whitespace().nth(1)?.parse().ok()?;
    Some(kb / 1024.0)
}
