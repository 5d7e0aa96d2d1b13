//! What the interleaved benchmarks share: medians and the host's load.

/// The median of `v` (the mean of the middle two for an even count).
pub fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    let m = v.len() / 2;
    if v.len() % 2 == 1 {
        v[m]
    } else {
        (v[m - 1] + v[m]) / 2.0
    }
}

/// `/proc/loadavg`'s three averages.
pub fn loadavg() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .unwrap_or_default()
        .split_whitespace()
        .take(3)
        .collect::<Vec<_>>()
        .join(" ")
}

/// Busy and total jiffies of the whole machine (`/proc/stat`).
pub fn cpu_jiffies() -> (u64, u64) {
    let stat = std::fs::read_to_string("/proc/stat").unwrap_or_default();
    let v: Vec<u64> =
        stat.lines().next().unwrap_or("").split_whitespace().skip(1).filter_map(|w| w.parse().ok()).collect();
    let idle = v.get(3).copied().unwrap_or(0) + v.get(4).copied().unwrap_or(0);
    (v.iter().sum::<u64>() - idle, v.iter().sum())
}

/// The share of CPU time the whole machine spent busy between two [`cpu_jiffies`].
pub fn busy_share((busy0, total0): (u64, u64), (busy1, total1): (u64, u64)) -> f64 {
    (busy1 - busy0) as f64 / (total1 - total0).max(1) as f64
}
