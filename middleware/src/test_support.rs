//! Hand-made messages for the unit tests, and the runner of their property tests.

use bytes::Bytes;
use shardflow::{Message, Metadata};

/// Metadata of record `sequence` in shard `shardId-000000000000` of stream `orders`.
pub(crate) fn metadata(sequence: u64) -> Metadata {
    Metadata::builder()
        .stream("orders")
        .shard_id("shardId-000000000000")
        .sequence_number(sequence)
        .partition_key(format!("pk-{sequence}"))
        .build()
}

/// A message with the given sequence number and payload.
pub(crate) fn message(sequence: u64, payload: &[u8]) -> Message<Bytes> {
    Message::new(metadata(sequence), Bytes::copy_from_slice(payload))
}

/// Runs the property `check` over `cases` cases drawn from `strategy` (the environment
/// variable `cases_var` sets another count) with the fixed seed `seed`, each case on a
/// fresh runtime with a paused clock; panics with the shrunk failing case.
pub(crate) fn run_property<S, F, Fut>(cases_var: &str, seed: u8, strategy: S, check: F)
where
    S: proptest::strategy::Strategy,
    F: Fn(S::Value) -> Fut,
    Fut: std::future::Future<Output = Result<(), proptest::test_runner::TestCaseError>>,
{
    use proptest::test_runner::{Config, RngAlgorithm, TestCaseError, TestRng, TestRunner};
    let cases = std::env::var(cases_var)
        .ok()
        .and_then(|n| n.parse().ok())
        .unwrap_or(300);
    let config = Config {
        cases,
        failure_persistence: None,
        ..Config::default()
    };
    let rng = TestRng::from_seed(RngAlgorithm::ChaCha, &[seed; 32]);
    let mut runner = TestRunner::new_with_rng(config, rng);
    runner
        .run(&strategy, |value| {
            let runtime = tokio::runtime::Builder::new_current_thread()
                .enable_time()
                .start_paused(true)
                .build()
                .map_err(|e| TestCaseError::fail(e.to_string()))?;
            runtime.block_on(check(value))
        })
        .unwrap();
}
