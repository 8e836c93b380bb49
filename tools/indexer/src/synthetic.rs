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

/// Prose of `words` words, its own for each `seed`: made-up words from a vocabulary of 20,000
/// drawn with Zipf-like frequencies, with numbers, punctuation and paragraphs — what a first
/// encode meets in a long document, where one sentence repeated would be all cache hits.
pub fn prose(seed: u64, words: usize) -> String {
    const SYLLABLES: [&str; 32] = [
        "ka", "to", "ri", "en", "mo", "la", "an", "ve", "si", "dor", "pre", "fil", "ex", "ium", "ca", "ter", "ol",
        "un", "ba", "sta", "ne", "gri", "pho", "de", "qua", "lis", "mar", "tion", "ou", "zy", "che", "ght",
    ];
    let mut state = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) ^ 0x2545_f491_4f6c_dd1d;
    let mut next = move || {
        // xorshift64*
        state ^= state >> 12;
        state ^= state << 25;
        state ^= state >> 27;
        state.wrapping_mul(0x2545_f491_4f6c_dd1d)
    };
    let mut out = String::with_capacity(words * 7);
    for i in 0..words {
        // A log-uniform rank is Zipf-like: a few words are most of the text.
        let u = (next() >> 11) as f64 / (1u64 << 53) as f64;
        let rank = (20_000f64.powf(u) as u64).max(1);
        let mut r = rank.wrapping_mul(0x9e37_79b9);
        if i > 0 {
            out.push(if i % 97 == 0 { '\n' } else { ' ' });
        }
        if rank % 50 == 7 {
            out.push_str(&(r % 10_000).to_string());
        } else {
            for _ in 0..1 + rank % 3 {
                out.push_str(SYLLABLES[(r % 32) as usize]);
                r /= 32;
            }
        }
        match next() % 16 {
            0 => out.push(','),
            1 => out.push('.'),
            _ => {}
        }
    }
    out
}
