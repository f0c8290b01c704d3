//! Hand-made messages and a seeded random source for the integration tests.
#![allow(dead_code)] // each test binary uses a part of it

use std::sync::Arc;

use bytes::Bytes;
use shardflow::{Message, Metadata, SequenceNumber};

/// Record `sequence` of shard `shard` in stream `orders`.
pub fn message(shard: &str, sequence: u64, payload: impl Into<Bytes>) -> Message<Bytes> {
    Message::new(
        Metadata::builder()
            .stream("orders")
            .shard_id(shard)
            .sequence_number(SequenceNumber::new(format!("4959{sequence:020}")).expect("digits"))
            .partition_key(format!("pk-{sequence}"))
            .build(),
        payload.into(),
    )
}

/// How long one wait in a test may take (virtual time under a paused clock).
pub const LIMIT: std::time::Duration = std::time::Duration::from_secs(120);

/// Awaits `fut`, panicking with `what` if it is not done within [`LIMIT`]: a test that
/// waits fails with a message instead of hanging.
pub async fn within<F: std::future::Future>(what: &str, fut: F) -> F::Output {
    match tokio::time::timeout(LIMIT, fut).await {
        Ok(out) => out,
        Err(_) => panic!("{what}: not done within {LIMIT:?}"),
    }
}

/// splitmix64: a tiny seeded generator, so every run draws the same faults.
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Self {
        Rng(seed)
    }

    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// True with probability `p`.
    pub fn chance(&mut self, p: f64) -> bool {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64 <= p
    }

    pub fn below(&mut self, n: u64) -> u64 {
        self.next_u64() % n.max(1)
    }
}

/// What [`two_consumers`] saw.
#[derive(Debug)]
pub struct Report {
    /// Side effects per record (keyed by sequence number).
    pub effects: std::collections::HashMap<String, u32>,
    /// Calls that ran the handler, over both consumers.
    pub handled: u64,
    /// Calls skipped as duplicates, over both consumers.
    pub duplicates: u64,
    /// Calls that failed and were delivered again.
    pub redeliveries: u64,
}

/// Two consumers handle the same `records` messages, in the same order, at the same
/// time, through dedup stacks sharing `store`. Each failed call is delivered again (as
/// the consumer would, from its checkpoint).
pub async fn two_consumers<St>(
    store: St,
    records: u64,
    wait_interval: std::time::Duration,
) -> Report
where
    St: shardflow_middleware::DedupStore + Clone,
{
    use std::collections::HashMap;
    use std::sync::Mutex;
    use std::time::Duration;

    use shardflow_middleware::dedup::{DedupLayer, DedupOutcome};
    use shardflow_middleware::BoxError;
    use tower::{service_fn, Service, ServiceBuilder, ServiceExt};

    let effects: Arc<Mutex<HashMap<String, u32>>> = Arc::default();
    let seen = effects.clone();
    let handler = service_fn(move |msg: Message<Bytes>| {
        let seen = seen.clone();
        async move {
            let sequence = msg.metadata.sequence_number.to_string();
            // Some handlers are slower than others, so the consumers interleave.
            let pause = sequence.bytes().last().map_or(0, |b| u64::from(b % 3));
            tokio::time::sleep(Duration::from_millis(pause)).await;
            *seen.lock().unwrap().entry(sequence).or_default() += 1;
            Ok::<_, BoxError>(())
        }
    });
    let stack = ServiceBuilder::new()
        .layer(
            DedupLayer::new(store)
                .wait_interval(wait_interval)
                .max_wait(Duration::from_secs(30)),
        )
        .service(handler);

    let mut consumers = Vec::new();
    for _ in 0..2 {
        let mut svc = stack.clone();
        consumers.push(tokio::spawn(async move {
            let (mut handled, mut duplicates, mut redeliveries) = (0u64, 0u64, 0u64);
            for sequence in 0..records {
                let msg = message("shardId-000000000001", sequence, Bytes::from_static(b"{}"));
                loop {
                    let ready = svc.ready().await.expect("dedup is always ready");
                    match ready.call(msg.clone()).await {
                        Ok(DedupOutcome::Handled(())) => handled += 1,
                        Ok(DedupOutcome::Duplicate) => duplicates += 1,
                        Err(e) => {
                            redeliveries += 1;
                            assert!(redeliveries < 10_000, "stuck on {sequence}: {e}");
                            continue;
                        }
                    }
                    break;
                }
            }
            (handled, duplicates, redeliveries)
        }));
    }
    let mut report = Report {
        effects: HashMap::new(),
        handled: 0,
        duplicates: 0,
        redeliveries: 0,
    };
    for consumer in consumers {
        let (handled, duplicates, redeliveries) =
            within("a consumer handles every record", consumer)
                .await
                .expect("consumer task");
        report.handled += handled;
        report.duplicates += duplicates;
        report.redeliveries += redeliveries;
    }
    report.effects = effects.lock().unwrap().clone();
    report
}

/// Checks that every one of `records` side effects happened exactly once.
pub fn assert_exactly_once(report: &Report, records: u64) {
    assert_eq!(report.effects.len() as u64, records, "{report:?}");
    let repeated: Vec<_> = report.effects.iter().filter(|(_, n)| **n != 1).collect();
    assert!(
        repeated.is_empty(),
        "side effects not exactly once: {repeated:?}"
    );
    assert_eq!(report.handled, records);
    assert_eq!(report.duplicates, records);
}
