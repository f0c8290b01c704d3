//! A held shard's recent throughput, measured where its records are read and written to
//! its lease row at each renewal (`throughputKBps`, as the KCL 3 does).
//!
//! The reader adds each page's bytes and records; each renewal takes the rates over
//! the interval since the previous one and folds them into an exponentially weighted
//! moving average with a time constant of [`TIME_CONSTANT`] (30 s): an interval of
//! `dt` seconds weighs `1 - e^(-dt/30)` (about 10 % for the default renew interval of
//! 3.3 s), so a change shows half-way after about 21 s and in full (95 %) after 90 s,
//! and the count noise of a few records per interval is smoothed out. (The KCL 3
//! halves the old value at every renewal; a shorter memory made the plan chase that
//! noise in the scale bench.) The average is bias-corrected: a meter's history weighs
//! only the time it covers, so while a meter is young its figure is the rate over
//! everything it measured, not its first short interval's rate (a page or two read
//! right after the take) kept as if it were the whole past; a figure taken over from
//! the lease row counts as a full history.

use std::sync::Mutex;

use tokio::time::Instant;

/// The time constant of the moving average: an interval's weight decays by `1/e` over
/// this much time.
pub(crate) const TIME_CONSTANT: std::time::Duration = std::time::Duration::from_secs(30);

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
    read_bytes: u64,
    read_records: u64,
    /// Whether anything was read (a page, even empty) since the meter started: until
    /// then there is no measurement, and the row keeps what it carries.
    read: bool,
    since: Instant,
    /// The moving average of the bytes per second, seeded with the row's figure.
    bytes: Option<f64>,
    /// The moving average of the records per second.
    records: Option<f64>,
    /// How much of a full history [`State::bytes`] stands for: `1 - e^(-t/30 s)` after
    /// `t` seconds measured here, 1 for a figure taken over from the row.
    bytes_weight: f64,
    /// The same for [`State::records`] (the row carries no record rate).
    records_weight: f64,
}

/// The meter of one held lease.
#[derive(Debug)]
pub(crate) struct ThroughputMeter {
    state: Mutex<State>,
}

impl ThroughputMeter {
    /// A meter that starts counting at `now`, from the figure the lease row carries
    /// (`throughputKBps`, the previous owner's measurement), if any: a lease that
    /// changes hands keeps its smoothed figure instead of starting over from the new
    /// owner's first, short interval.
    pub(crate) fn new(now: Instant, row_kbps: Option<f64>) -> Self {
        ThroughputMeter {
            state: Mutex::new(State {
                read_bytes: 0,
                read_records: 0,
                read: false,
                since: now,
                bytes: row_kbps.map(|k| k * BYTES_PER_KIB),
                records: None,
                bytes_weight: if row_kbps.is_some() { 1.0 } else { 0.0 },
                records_weight: 0.0,
            }),
        }
    }

    /// Adds one page read from the shard: `records` records of `bytes` data bytes in all.
    pub(crate) fn add(&self, bytes: u64, records: u64) {
        let mut state = self.state.lock().unwrap_or_else(|p| p.into_inner());
        state.read_bytes = state.read_bytes.saturating_add(bytes);
        state.read_records = state.read_records.saturating_add(records);
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
        if window >= MIN_WINDOW {
            let seconds = window.as_secs_f64();
            let alpha = 1.0 - (-seconds / TIME_CONSTANT.as_secs_f64()).exp();
            // The history so far weighs what it covers: its weight decays as the
            // interval's is added (a bias-corrected moving average), so the first
            // short interval of a meter is not taken for the whole past.
            let fold = |old: Option<f64>, weight: &mut f64, latest: f64| {
                let kept = (1.0 - alpha) * *weight;
                *weight = alpha + kept;
                match old {
                    Some(old) => (alpha * latest + kept * old) / *weight,
                    None => latest,
                }
            };
            let latest_bytes = state.read_bytes as f64 / seconds;
            let latest_records = state.read_records as f64 / seconds;
            let (old_bytes, old_records) = (state.bytes, state.records);
            state.bytes = Some(fold(old_bytes, &mut state.bytes_weight, latest_bytes));
            state.records = Some(fold(old_records, &mut state.records_weight, latest_records));
            state.read_bytes = 0;
            state.read_records = 0;
            state.since = now;
        }
        current(&state)
    }

    /// The average as of the last sample, if any.
    pub(crate) fn latest(&self) -> Option<Rates> {
        current(&self.state.lock().unwrap_or_else(|p| p.into_inner()))
    }
}

/// The averages once both were measured.
fn current(state: &State) -> Option<Rates> {
    Some(Rates {
        bytes_per_second: state.bytes?,
        records_per_second: state.records?,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn nothing_read_is_no_measurement() {
        let start = Instant::now();
        let meter = ThroughputMeter::new(start, None);
        assert_eq!(meter.sample(start + Duration::from_secs(3)), None);
    }

    fn close(a: f64, b: f64) -> bool {
        (a - b).abs() < 1e-6
    }

    #[test]
    fn the_average_follows_the_rate_with_its_time_constant() {
        let start = Instant::now();
        let meter = ThroughputMeter::new(start, None);
        let second = Duration::from_secs(1);
        meter.add(30 * 1024, 30);
        let first = meter.sample(start + 3 * second).unwrap();
        assert_eq!(first.kbps(), 10.0);
        assert_eq!(first.records_per_second, 10.0);
        // A quiet interval as long: about half-way down (the later interval weighs a
        // little more, e^(1/10) times), not 10 % down as if the first 3 s had been the
        // whole past.
        let quiet = meter.sample(start + 6 * second).unwrap();
        let e = (-3.0 / TIME_CONSTANT.as_secs_f64()).exp();
        assert!(close(quiet.kbps(), 10.0 * e / (1.0 + e)), "{quiet:?}");
        assert!(
            close(quiet.records_per_second, 10.0 * e / (1.0 + e)),
            "{quiet:?}"
        );
        assert_eq!(meter.latest(), Some(quiet));
        // A figure taken over from the row stands for a full history: a quiet interval
        // of 30 ln 2 s brings it half-way down.
        let half = TIME_CONSTANT.mul_f64(std::f64::consts::LN_2);
        let taken = ThroughputMeter::new(start, Some(10.0));
        taken.add(0, 0);
        assert!(close(taken.sample(start + half).unwrap().kbps(), 5.0));
        // Less than the shortest window: unchanged, and the interval stays open.
        let at = start + 6 * second;
        meter.add(1024, 1);
        assert_eq!(meter.sample(at + second / 2), Some(quiet));
        // A first page just before the first renewal is no burst: no figure yet.
        let meter = ThroughputMeter::new(start, None);
        meter.add(64 * 1024, 1);
        assert_eq!(meter.sample(start + second / 10), None);
        assert_eq!(meter.sample(start + second).unwrap().kbps(), 64.0);
        // A lease taken over goes on from the row's figure: a first second with one
        // big record moves it by the first interval's small weight only.
        let meter = ThroughputMeter::new(start, Some(10.0));
        meter.add(64 * 1024, 1);
        let taken = meter.sample(start + second).unwrap();
        let alpha = 1.0 - (-1.0 / TIME_CONSTANT.as_secs_f64()).exp();
        assert!(
            close(taken.kbps(), alpha * 64.0 + (1.0 - alpha) * 10.0),
            "{taken:?}"
        );
    }
}
