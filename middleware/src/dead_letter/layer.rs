//! [`DeadLetterLayer`]: applies [`DeadLetter`] to services, with its sink and policy.

use std::time::Duration;

use tower::Layer;

use super::{DeadLetter, PermanentFailures, DEFAULT_SINK_TIMEOUT};

/// Applies [`DeadLetter`] to services.
#[derive(Clone, Debug)]
pub struct DeadLetterLayer<K, P = PermanentFailures> {
    sink: K,
    policy: P,
    sink_timeout: Duration,
}

impl<K> DeadLetterLayer<K, PermanentFailures> {
    /// Dead-letters permanent failures to `sink`.
    pub fn new(sink: K) -> Self {
        DeadLetterLayer {
            sink,
            policy: PermanentFailures,
            sink_timeout: DEFAULT_SINK_TIMEOUT,
        }
    }
}

impl<K, P> DeadLetterLayer<K, P> {
    /// Uses another policy, e.g. the default one plus your own transient errors:
    ///
    /// ```
    /// # use shardflow_middleware::dead_letter::{DeadLetterLayer, DeadLetterPolicy, PermanentFailures};
    /// # #[derive(Debug)] struct Throttled;
    /// # impl std::fmt::Display for Throttled { fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result { f.write_str("throttled") } }
    /// # impl std::error::Error for Throttled {}
    /// # let sink = ();
    /// let layer = DeadLetterLayer::new(sink).policy(|e: &(dyn std::error::Error + Send + Sync + 'static), h: &_| {
    ///     PermanentFailures.should_dead_letter(e, h) && !e.is::<Throttled>()
    /// });
    /// # let _ = layer;
    /// ```
    pub fn policy<P2>(self, policy: P2) -> DeadLetterLayer<K, P2> {
        DeadLetterLayer {
            sink: self.sink,
            policy,
            sink_timeout: self.sink_timeout,
        }
    }

    /// How long the sink may take to be ready and accept a record
    /// ([`DEFAULT_SINK_TIMEOUT`] unless set; at least 1 ms). Past it the call fails with
    /// a [`DeadLetterError`](super::DeadLetterError) whose [`is_timeout`](super::DeadLetterError::is_timeout) holds,
    /// and the record is delivered again.
    pub fn sink_timeout(mut self, timeout: Duration) -> Self {
        self.sink_timeout = timeout.max(Duration::from_millis(1));
        self
    }
}

impl<S, K: Clone, P: Clone> Layer<S> for DeadLetterLayer<K, P> {
    type Service = DeadLetter<S, K, P>;

    fn layer(&self, inner: S) -> Self::Service {
        DeadLetter {
            inner,
            sink: self.sink.clone(),
            policy: self.policy.clone(),
            sink_timeout: self.sink_timeout,
        }
    }
}
