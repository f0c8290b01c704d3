//! The worker-wide read-ahead budget (`read_ahead_bytes`): many shards with a
//! backlog never hand out more unacknowledged bytes than the budget, nothing is lost,
//! and a budget smaller than one read still delivers everything (one read at a time).

use std::collections::HashSet;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use futures_util::StreamExt;
use shardflow::kinesis::{KinesisApi, PutOutcome, PutRecord, StreamAdmin};
use shardflow::Memory;
use testkit::*;

/// Writes `count` records of `size` bytes (the value first, zero-padded) spread over
/// the shards by partition key.
async fn produce_sized(memory: &Memory, stream: &str, count: usize, size: usize) {
    let kinesis = memory.streams().clone();
    let records: Vec<PutRecord> = (0..count)
        .map(|v| {
            let mut data = format!("{v:010}").into_bytes();
            data.resize(size, b'.');
            PutRecord {
                data: Bytes::from(data),
                partition_key: format!("pk-{v}"),
                explicit_hash_key: None,
            }
        })
        .collect();
    for chunk in records.chunks(500) {
        let outcomes = kinesis.put_records(stream, chunk).await.unwrap();
        assert!(outcomes
            .iter()
            .all(|o| !matches!(o, PutOutcome::Failed { .. })));
    }
}

fn value(payload: &[u8]) -> usize {
    std::str::from_utf8(&payload[..10])
        .unwrap()
        .parse()
        .unwrap()
}

/// What the handler side saw: payload bytes handed out and not yet acknowledged (now
/// and at most), and every value received.
#[derive(Default)]
struct Seen {
    outstanding: usize,
    max_outstanding: usize,
    values: HashSet<usize>,
    duplicates: usize,
}

/// Consumes `stream` in `stream()` mode, acknowledging each batch `handle_for` after it
/// arrived (a slow handler, so reads outpace it), until `total` records came; returns
/// what was seen.
async fn consume(
    memory: &Memory,
    stream: &str,
    budget: u64,
    max_records_per_read: u32,
    total: usize,
    handle_for: Duration,
) -> Seen {
    let consumer = test_consumer(memory.clone(), stream, &format!("{stream}-g"), "w1")
        .max_records_per_read(max_records_per_read)
        .read_ahead_bytes(budget)
        .build()
        .unwrap();
    let mut batches = consumer.stream();
    let shutdown = batches.shutdown_handle();
    let seen = Arc::new(Mutex::new(Seen::default()));
    let receive = async {
        while seen.lock().unwrap().values.len() < total {
            let batch = batches.next().await.unwrap().unwrap();
            let bytes: usize = batch.messages.iter().map(|m| m.payload.len()).sum();
            {
                let mut s = seen.lock().unwrap();
                s.outstanding += bytes;
                s.max_outstanding = s.max_outstanding.max(s.outstanding);
                for m in &batch.messages {
                    if !s.values.insert(value(&m.payload)) {
                        s.duplicates += 1;
                    }
                }
            }
            let seen = seen.clone();
            tokio::spawn(async move {
                tokio::time::sleep(handle_for).await;
                // Counted out before the ack gives the budget back, so the next batch
                // can never be counted in before this one is counted out.
                seen.lock().unwrap().outstanding -= bytes;
                batch.ack();
            });
        }
    };
    within(WAIT_LIMIT, "every record is delivered", receive).await;
    shutdown.shutdown();
    within(STOP_LIMIT, "the stream ends after shutdown()", async {
        while let Some(batch) = batches.next().await {
            batch.unwrap().ack();
        }
    })
    .await;
    let seen = std::mem::take(&mut *seen.lock().unwrap());
    seen
}

#[tokio::test(start_paused = true)]
async fn many_shards_with_a_backlog_stay_within_the_budget() {
    let memory = Memory::new();
    memory.streams().create_stream("backlog", 40).await.unwrap();
    // 40 shards × about 100 records of 1 KB: 4 MB waiting, 16 times the budget.
    let total = 4_000;
    produce_sized(&memory, "backlog", total, 1_000).await;
    let budget = 256 * 1024;
    let seen = consume(
        &memory,
        "backlog",
        budget,
        25,
        total,
        Duration::from_millis(200),
    )
    .await;
    assert_eq!(seen.values.len(), total, "every record delivered");
    assert_eq!(seen.values, (0..total).collect::<HashSet<_>>());
    assert_eq!(seen.duplicates, 0, "no record delivered twice");
    assert!(
        seen.max_outstanding as u64 <= budget,
        "at most the budget handed out and unacknowledged: {} bytes > {budget}",
        seen.max_outstanding
    );
    // The budget was the limit, not something else: it was nearly used up.
    assert!(
        seen.max_outstanding as u64 > budget / 2,
        "the backlog should fill the budget: {} bytes",
        seen.max_outstanding
    );
}

#[tokio::test(start_paused = true)]
async fn a_budget_smaller_than_one_read_delivers_everything_one_read_at_a_time() {
    let memory = Memory::new();
    memory.streams().create_stream("tiny", 4).await.unwrap();
    let total = 400;
    produce_sized(&memory, "tiny", total, 1_000).await;
    // Each read of up to 50 records of 1 KB is far more than the 1 KiB budget.
    let seen = consume(&memory, "tiny", 1024, 50, total, Duration::from_millis(10)).await;
    assert_eq!(seen.values, (0..total).collect::<HashSet<_>>());
    assert_eq!(seen.duplicates, 0);
    // One read at a time: never two reads handed out and unacknowledged together.
    assert!(
        seen.max_outstanding <= 50 * 1_000,
        "more than one read in flight: {} bytes",
        seen.max_outstanding
    );
}

#[tokio::test(start_paused = true)]
async fn batches_dropped_unacknowledged_give_their_share_back() {
    let memory = Memory::new();
    memory.streams().create_stream("dropped", 1).await.unwrap();
    let total = 100;
    produce_sized(&memory, "dropped", total, 1_000).await;
    // Room for about one read of 2 records: if a dropped batch kept its share, the
    // reader would wait for ever after the first few.
    let consumer = test_consumer(memory.clone(), "dropped", "dropped-g", "w1")
        .max_records_per_read(2)
        .read_ahead_bytes(4 * 1024)
        .build()
        .unwrap();
    let mut batches = consumer.stream();
    let shutdown = batches.shutdown_handle();
    let mut values = HashSet::new();
    within(
        WAIT_LIMIT,
        "every record delivered although each batch was first dropped unacknowledged",
        async {
            while values.len() < total {
                let batch = batches.next().await.unwrap().unwrap();
                let fresh: Vec<usize> = batch
                    .messages
                    .iter()
                    .map(|m| value(&m.payload))
                    .filter(|v| !values.contains(v))
                    .collect();
                if fresh.is_empty() {
                    // Delivered again after its drop: acknowledged this time.
                    batch.ack();
                } else {
                    // A dropped batch is given up (delivered again from the checkpoint)
                    // and gives its share of the budget back.
                    values.extend(fresh);
                    drop(batch);
                }
            }
        },
    )
    .await;
    assert_eq!(values, (0..total).collect::<HashSet<_>>());
    shutdown.shutdown();
    within(STOP_LIMIT, "the stream ends after shutdown()", async {
        while let Some(batch) = batches.next().await {
            drop(batch);
        }
    })
    .await;
}
