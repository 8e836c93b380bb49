//! Data-parallel ranks (spec §7): an engine started with `--dp-size N` serves each request on one
//! rank, and its prefix lives on the rank that served it. SGLang takes the rank in the body
//! (`routed_dp_rank`); the filter names the rank with the longest match the indexer reported,
//! ties and no match to the rank its `/v1/loads` report shows least loaded. Without a match and
//! without a fresh report it names none, and the engine balances its ranks itself.

use serde_json::json;

use super::body_edit::Member;

use crate::state::load_monitor::EngineLoad;

/// The body field SGLang reads (0.5.23; `data_parallel_rank` is its deprecated alias).
pub const ROUTED_DP_RANK: &str = "routed_dp_rank";

/// The rank a request goes to on an engine of `dp_size` ranks; `matched` is what the indexer
/// said each rank holds, `load` the engine's fresh report. `None` for a one-rank engine.
pub fn choose_rank(dp_size: u32, matched: &[(u32, u64)], load: Option<&EngineLoad>) -> Option<u32> {
    if dp_size <= 1 {
        return None;
    }
    let best = matched.iter().filter(|(r, _)| *r < dp_size).map(|(_, t)| *t).max().unwrap_or(0);
    let candidates: Vec<u32> = if best > 0 {
        matched.iter().filter(|(r, t)| *r < dp_size && *t == best).map(|(r, _)| *r).collect()
    } else {
        (0..dp_size).collect()
    };
    let rank_load = |r: u32| load.and_then(|l| l.rank_loads.get(r as usize).copied());
    let known = load.is_some_and(|l| l.rank_loads.len() == dp_size as usize);
    if best == 0 && !known {
        return None;
    }
    candidates.into_iter().min_by_key(|r| (rank_load(*r).unwrap_or(u64::MAX), *r))
}

/// The body member that names the rank (a client's own value is overwritten).
pub fn rank_member(rank: u32) -> Member {
    Member::new(ROUTED_DP_RANK, &json!(rank))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::{native_load, test};

    fn loads(per_rank: &[u64]) -> EngineLoad {
        EngineLoad { rank_loads: per_rank.to_vec(), ..native_load(per_rank.iter().sum(), 0) }
    }

    #[test]
    fn the_rank_holding_the_longest_prefix_wins_and_load_breaks_ties() {
        assert_eq!(choose_rank(1, &[(0, 500)], Some(&loads(&[3]))), None, "one rank: nothing to name");
        assert_eq!(choose_rank(2, &[(0, 100), (1, 500)], Some(&loads(&[0, 9]))), Some(1), "the holder, busier or not");
        assert_eq!(choose_rank(4, &[(1, 500), (3, 500)], Some(&loads(&[0, 7, 0, 2]))), Some(3), "tie: less loaded");
        assert_eq!(choose_rank(2, &[(1, 500)], None), Some(1), "a match needs no report");
        assert_eq!(choose_rank(2, &[(5, 500)], Some(&loads(&[4, 1]))), Some(1), "a rank the engine lacks is ignored");
    }

    #[test]
    fn without_a_match_the_least_loaded_rank_or_none_without_a_report() {
        assert_eq!(choose_rank(3, &[], Some(&loads(&[5, 2, 2]))), Some(1), "least loaded, then lowest");
        assert_eq!(choose_rank(2, &[], None), None, "the engine balances itself");
        assert_eq!(choose_rank(2, &[], Some(&loads(&[1]))), None, "a report missing a rank is no report");
    }

    #[test]
    fn the_rank_is_written_into_the_body_over_the_clients() {
        let body = br#"{"model": "m", "routed_dp_rank": 7}"#;
        let edited = super::super::body_edit::with_members(body, &[rank_member(1)]).unwrap();
        let v: serde_json::Value = serde_json::from_slice(&edited).unwrap();
        assert_eq!((v["routed_dp_rank"].as_u64(), v["model"].as_str()), (Some(1), Some("m")));
    }
}
