//! Each process's SM utilization from NVML's process utilization samples
//! (`nvmlDeviceGetProcessUtilization`, nvml-wrapper `Device::process_utilization_stats`).
//!
//! NVML keeps a buffer of samples per GPU and returns those taken after the timestamp asked
//! for, one structure per process and sample, and only for processes that used the GPU in the
//! sample's period (NVML API reference). The poller asks each poll for the samples since the
//! newest it has read: a process's SM use over the poll interval is the mean of its samples
//! (each `smUtil` clamped to 100), and a process without a sample used no SM. That mean counts
//! the periods a process was sampled in, not the ones it was idle in: it is the share a
//! process held while it ran, at most what it used over the whole interval's busy periods.

use std::collections::HashMap;

/// (pid, timestamp in microseconds, SM utilization in percent) samples to each pid's mean SM
/// utilization (whole percent, rounded down), and the newest timestamp among them.
pub fn per_process(
    samples: impl IntoIterator<Item = (u32, u64, u32)>,
) -> (HashMap<u32, u32>, Option<u64>) {
    let mut sums: HashMap<u32, (u64, u64)> = HashMap::new();
    let mut newest: Option<u64> = None;
    for (pid, at, sm) in samples {
        let e = sums.entry(pid).or_default();
        e.0 = e.0.saturating_add(u64::from(sm.min(100)));
        e.1 = e.1.saturating_add(1);
        newest = Some(newest.map_or(at, |n| n.max(at)));
    }
    let per = sums
        .into_iter()
        .map(|(pid, (sum, n))| (pid, u32::try_from(sum / n.max(1)).unwrap_or(100)))
        .collect();
    (per, newest)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_process_gets_the_mean_of_its_samples_and_the_newest_stamp_is_kept() {
        let (per, newest) = per_process([
            (10, 5, 40),
            (10, 9, 60),
            (11, 7, 250),
            (12, 3, 0),
            (10, 8, 51),
        ]);
        assert_eq!(per[&10], 50, "(40 + 60 + 51) / 3, rounded down");
        assert_eq!(per[&11], 100, "clamped");
        assert_eq!(per[&12], 0);
        assert_eq!(newest, Some(9));
        let (per, newest) = per_process([]);
        assert!(per.is_empty() && newest.is_none());
        let (per, _) = per_process((0..10_000).map(|i| (1, u64::MAX - i, u32::MAX)));
        assert_eq!(per[&1], 100, "no overflow");
    }
}
