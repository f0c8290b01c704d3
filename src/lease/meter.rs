//! A held shard's recent throughput, measured where its records are read and written to
//! its lease row at each renewal (`throughputKBps`, as the KCL 3 does).
//!
//! The reader adds each page's bytes and records; each renewal takes the rates over
//! the interval since the previous one and folds them into an exponentially weighted
//! moving average with weight [`ALPHA`] for the newest interval (the KCL 3's choice):
//! an interval's weight halves at every later renewal, so the figure follows a change
//! within two or three renewal intervals and one quiet or busy interval moves it by half.

use std::sync::Mutex;

use tokio::time::Instant;

/// The weight of the newest renewal interval in the moving average (the KCL 3's
/// `LeaseStatsRecorder` uses 0.5 too).
pub(crate) const ALPHA: f64 = 0.5;

/// The shortest interval a rate is taken over: a renewal sooner after the previous one
/// (the first renewals of a lease are spread over the renew interval, some a few
/// milliseconds after the take) leaves the interval open until a later one, so one
/// page read just before does not look like a burst.
pub(crate) const MIN_WINDOW: std::time::Duration = std::time::Duration::from_secs(1);

/// Bytes in a KiB, the unit of `throughputKBps` (the KCL 3 divides by 1,024).
pub(crate) const BYTES_PER_KIB: f64 = 1024.0;

/// One shard's smoothed rates.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub(crate) struct Rates {
    /// Record data bytes per second.
    pub bytes_per_second: f64,
    /// Records per second.
    pub records_per_second: f64,
}

impl Rates {
    /// The bytes per second in KiB/s, as `throughputKBps` stores it.
    pub(crate) fn kbps(&self) -> f64 {
        self.bytes_per_second / BYTES_PER_KIB
    }
}

/// Counts since the last sample and the moving average so far.
#[derive(Debug)]
struct State {
    bytes: u64,
    records: u64,
    /// Whether anything was read (a page, even empty) since the meter started: until
    /// then there is no measurement, and the row keeps what it carries.
    read: bool,
    since: Instant,
    average: Option<Rates>,
}

/// The meter of one held lease.
#[derive(Debug)]
pub(crate) struct ThroughputMeter {
    state: Mutex<State>,
}

impl ThroughputMeter {
    /// A meter that starts counting at `now`.
    pub(crate) fn new(now: Instant) -> Self {
        ThroughputMeter {
            state: Mutex::new(State {
                bytes: 0,
                records: 0,
                read: false,
                since: now,
                average: None,
            }),
        }
    }

    /// Adds one page read from the shard: `records` records of `bytes` data bytes in all.
    pub(crate) fn add(&self, bytes: u64, records: u64) {
        let mut state = self.state.lock().unwrap_or_else(|p| p.into_inner());
        state.bytes = state.bytes.saturating_add(bytes);
        state.records = state.records.saturating_add(records);
        state.read = true;
    }

    /// Closes the interval at `now`: folds its rates into the average and returns the
    /// average, or `None` while nothing was read yet. An interval shorter than
    /// [`MIN_WINDOW`] stays open: the average is returned as it was (`None` at first).
    pub(crate) fn sample(&self, now: Instant) -> Option<Rates> {
        let mut state = self.state.lock().unwrap_or_else(|p| p.into_inner());
        if !state.read {
            state.since = now;
            return None;
        }
        let window = now.saturating_duration_since(state.since);
        let seconds = window.as_secs_f64();
        if window >= MIN_WINDOW {
            let latest = Rates {
                bytes_per_second: state.bytes as f64 / seconds,
                records_per_second: state.records as f64 / seconds,
            };
            state.average = Some(match state.average {
                None => latest,
                Some(old) => Rates {
                    bytes_per_second: ALPHA * latest.bytes_per_second
                        + (1.0 - ALPHA) * old.bytes_per_second,
                    records_per_second: ALPHA * latest.records_per_second
                        + (1.0 - ALPHA) * old.records_per_second,
                },
            });
            state.bytes = 0;
            state.records = 0;
            state.since = now;
        }
        state.average
    }

    /// The average as of the last sample, if any.
    pub(crate) fn latest(&self) -> Option<Rates> {
        self.state.lock().unwrap_or_else(|p| p.into_inner()).average
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn nothing_read_is_no_measurement() {
        let start = Instant::now();
        let meter = ThroughputMeter::new(start);
        assert_eq!(meter.sample(start + Duration::from_secs(3)), None);
    }

    #[test]
    fn the_average_follows_the_rate_halving_the_old_weight_each_interval() {
        let start = Instant::now();
        let meter = ThroughputMeter::new(start);
        let second = Duration::from_secs(1);
        meter.add(10 * 1024, 10);
        let first = meter.sample(start + second).unwrap();
        assert_eq!(first.kbps(), 10.0);
        assert_eq!(first.records_per_second, 10.0);
        // A quiet interval: half-way down.
        assert_eq!(meter.sample(start + 2 * second).unwrap().kbps(), 5.0);
        // Busy again over two seconds at 20 KiB/s.
        meter.add(40 * 1024, 4);
        let busy = meter.sample(start + 4 * second).unwrap();
        assert_eq!(busy.kbps(), 12.5);
        assert_eq!(busy.records_per_second, 0.5 * 2.0 + 0.5 * 5.0);
        assert_eq!(meter.latest(), Some(busy));
        // Less than the shortest window: unchanged, and the interval stays open.
        meter.add(1024, 1);
        assert_eq!(meter.sample(start + 4 * second + second / 2), Some(busy));
        let on = meter.sample(start + 5 * second).unwrap();
        assert_eq!(on.kbps(), 0.5 * 1.0 + 0.5 * 12.5);
        // A first page just before the first renewal is no burst: no figure yet.
        let meter = ThroughputMeter::new(start);
        meter.add(64 * 1024, 1);
        assert_eq!(meter.sample(start + second / 10), None);
        assert_eq!(meter.sample(start + second).unwrap().kbps(), 64.0);
    }
}
