//! The wall clock the library reads where it needs the time of day: the host's clock by
//! default; a simulation or a test gives its own, so a run replays exactly.

use std::sync::Arc;
use std::time::SystemTime;

/// The wall clock a worker reads where it needs the time of day (see
/// [`ConsumerBuilder::wall_clock`](crate::consumer::ConsumerBuilder::wall_clock)).
#[derive(Clone)]
pub(crate) struct WallClock(Arc<dyn Fn() -> SystemTime + Send + Sync>);

impl WallClock {
    /// A clock that reads `clock`.
    pub(crate) fn new(clock: impl Fn() -> SystemTime + Send + Sync + 'static) -> Self {
        WallClock(Arc::new(clock))
    }

    /// The time of day now, on this worker's clock.
    pub(crate) fn now(&self) -> SystemTime {
        (self.0)()
    }
}

impl Default for WallClock {
    fn default() -> Self {
        WallClock(Arc::new(SystemTime::now))
    }
}

impl std::fmt::Debug for WallClock {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("<wall clock>")
    }
}
