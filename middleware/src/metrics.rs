//! The middleware's metrics through the [`metrics`] facade, beside its `tracing`
//! counters (see the crate docs): the series an operator alerts on, recorded into the
//! same recorder as the consumer's [`shardflow::metrics`], so one Prometheus exporter
//! shows both. Without a recorder every call is a no-op.
//!
//! Labels: `stream` (the record's stream) and `reason`; no `shard` and no record data, so
//! the number of series stays with the streams and the three reasons.

/// Counter, labels `stream` and `reason` (`failed_alone`, `too_old`,
/// `attempts_exhausted`): records a dead-letter sink accepted, from the
/// [`dead_letter`](crate::dead_letter) layer and [`bisect`](crate::bisect).
pub const DEAD_LETTERS: &str = "shardflow_dead_letters_total";

/// Counts one record a sink accepted, for `reason` (a dead-letter `Reason`'s `as_str`).
pub(crate) fn dead_lettered(stream: &std::sync::Arc<str>, reason: &'static str) {
    ::metrics::counter!(
        DEAD_LETTERS,
        "stream" => stream.clone(),
        "reason" => reason,
    )
    .increment(1);
}

/// Counter, no labels: writer-schema lookups through a schema registry's cache
/// ([`CachedRegistry`](crate::schema_registry::CachedRegistry)), by the decode layer and
/// the encoder; each is also counted as a hit or a miss. Hit rate:
/// `rate(shardflow_schema_registry_hits_total) / rate(shardflow_schema_registry_lookups_total)`.
pub const SCHEMA_LOOKUPS: &str = "shardflow_schema_registry_lookups_total";

/// Counter, no labels: lookups the cache answered.
pub const SCHEMA_HITS: &str = "shardflow_schema_registry_hits_total";

/// Counter, no labels: lookups that called the registry (answered or failed).
pub const SCHEMA_MISSES: &str = "shardflow_schema_registry_misses_total";
