//! Streams set for records larger than 1 MiB (Kinesis' `UpdateMaxRecordSize`, up to
//! 10 MiB), end to end on the embedded backend: a 9 MiB record is produced, consumed
//! byte for byte, dead-lettered into a stream of 1 MiB records (in parts) or of 10 MiB
//! records (whole), read back from the envelope and replayed. Records above a stream's
//! limit are refused with the limit that stream has; a shard's write rate stays 1 MiB
//! per second. Tokio's paused clock.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use rand::{Rng, SeedableRng};
use shardflow::kinesis::{KinesisApi, KinesisError, PutRecord};
use shardflow::memory::KinesisLimits;
use shardflow::producer::{MAX_LARGE_RECORD_BYTES, MAX_RECORD_BYTES};
use shardflow::{Consumer, Memory, Message, ProduceError, Producer, ProducerRecord};
use shardflow_middleware::dead_letter::envelope::{DeadLetterEnvelope, Reassembly};
use shardflow_middleware::{BoxError, ProducerSink, ServiceBuilderExt};
use testkit::within;
use tokio::time::Instant;
use tower::{Service, ServiceExt};

const STREAM: &str = "scans";
const DLQ: &str = "scans-dlq";
const MIB: usize = 1024 * 1024;
const LIMIT: Duration = Duration::from_secs(120);

/// `len` bytes from a fixed seed: every byte matters when compared.
fn payload(len: usize, seed: u64) -> Bytes {
    let mut rng = rand::rngs::SmallRng::seed_from_u64(seed);
    let mut bytes = vec![0u8; len];
    rng.fill(bytes.as_mut_slice());
    Bytes::from(bytes)
}

/// A backend with `STREAM` (2 shards) set for 10 MiB records and `DLQ` (1 shard) set for
/// `dlq_kib` KiB records.
async fn backend(dlq_kib: u32) -> Memory {
    let memory = Memory::new();
    memory.create_stream(STREAM, 2).await.unwrap();
    memory.create_stream(DLQ, 1).await.unwrap();
    memory
        .streams()
        .update_max_record_size(STREAM, 10_240)
        .unwrap();
    memory
        .streams()
        .update_max_record_size(DLQ, dlq_kib)
        .unwrap();
    memory
}

/// Every record of a stream, in shard then sequence order.
fn stored(memory: &Memory, stream: &str) -> Vec<shardflow::kinesis::Record> {
    let mut all = Vec::new();
    for shard in ["shardId-000000000000", "shardId-000000000001"] {
        all.extend(memory.streams().records(stream, shard));
    }
    all
}

#[tokio::test(start_paused = true)]
async fn a_9_mib_record_is_produced_consumed_dead_lettered_and_replayed_byte_exact() {
    // A dead-letter stream of 1 MiB records takes the envelope in parts, one of 10 MiB
    // records whole.
    for (dlq_kib, parts) in [(1_024, 10), (10_240, 1)] {
        let memory = backend(dlq_kib).await;
        let big = payload(9 * MIB, 7);
        let producer = Producer::builder()
            .stream(STREAM)
            .backend(memory.clone())
            .build()
            .unwrap();
        let stored_at = within(LIMIT, "the 9 MiB record stored", async {
            producer
                .send(ProducerRecord::new(big.clone(), "scan-1"))
                .await
        })
        .await
        .expect("a stream set for 10 MiB takes a 9 MiB record");
        for i in 0..3 {
            within(LIMIT, "a small record stored", async {
                producer
                    .send(ProducerRecord::new(format!("small-{i}"), format!("k{i}")))
                    .await
            })
            .await
            .unwrap();
        }
        let in_stream = memory.streams().records(STREAM, &stored_at.shard_id);
        let record = in_stream
            .iter()
            .find(|r| r.sequence_number == stored_at.sequence_number)
            .expect("the record is where its answer says");
        assert!(record.data == big, "stored byte for byte");

        // Consumed: the handler sees the 9 MiB payload whole, fails it, and the
        // dead-letter layer writes it to the dead-letter stream.
        let seen: Arc<Mutex<Vec<Bytes>>> = Arc::default();
        let handler = {
            let seen = seen.clone();
            tower::ServiceBuilder::new()
                .dead_letter(ProducerSink::new(producer.for_stream(DLQ).unwrap()))
                .service_fn(move |msg: Message| {
                    let large = msg.payload.len() > MAX_RECORD_BYTES;
                    seen.lock().unwrap().push(msg.payload.clone());
                    async move {
                        if large {
                            Err::<(), BoxError>("the scan does not parse".into())
                        } else {
                            Ok(())
                        }
                    }
                })
        };
        let consumer = Consumer::builder()
            .stream(STREAM)
            .group("scanner")
            .backend(memory.clone())
            .build()
            .unwrap();
        let running = consumer.run(handler).spawn();
        within(
            LIMIT,
            "every record handled or dead-lettered",
            memory.wait_caught_up(STREAM, "scanner"),
        )
        .await;
        running.shutdown().await.unwrap();
        let seen = seen.lock().unwrap().clone();
        assert_eq!(seen.len(), 4, "each record handled once");
        assert_eq!(
            seen.iter().filter(|p| **p == big).count(),
            1,
            "the 9 MiB payload reached the handler byte for byte"
        );

        // The dead letter: as many records as the dead-letter stream's limit needs, each
        // within it, put back together byte for byte.
        let letters = stored(&memory, DLQ);
        assert_eq!(
            letters.len(),
            parts,
            "dead-letter records ({dlq_kib} KiB stream)"
        );
        let mut reassembly = Reassembly::new();
        let mut complete = Vec::new();
        for r in &letters {
            assert!(r.data.len() + r.partition_key.len() <= dlq_kib as usize * 1024);
            assert_eq!(r.partition_key, "scan-1");
            let part = DeadLetterEnvelope::from_bytes(&r.data).unwrap();
            complete.extend(reassembly.push(part));
        }
        assert_eq!(complete.len(), 1, "one dead letter, complete");
        let letter = complete.remove(0);
        assert!(letter.payload == big, "the envelope keeps every byte");
        assert_eq!(
            (letter.stream.as_str(), letter.partition_key.as_str()),
            (STREAM, "scan-1")
        );
        assert_eq!(letter.sequence_number, stored_at.sequence_number.as_str());

        // Replayed as `dlq replay` does: the payload under its original key, back into
        // the stream it came from.
        let replayed = within(LIMIT, "the replay stored", async {
            producer
                .send(ProducerRecord::new(
                    letter.payload.clone(),
                    letter.partition_key.clone(),
                ))
                .await
        })
        .await
        .unwrap();
        let again = memory.streams().records(STREAM, &replayed.shard_id);
        let again = again
            .iter()
            .find(|r| r.sequence_number == replayed.sequence_number)
            .unwrap();
        assert!(again.data == big && again.partition_key == "scan-1");
        producer.close().await;
    }
}

#[tokio::test(start_paused = true)]
async fn records_above_the_streams_limit_are_refused_with_that_limit() {
    let memory = backend(1_024).await;
    memory.create_stream("plain", 1).await.unwrap();
    let build = |stream: &str| {
        Producer::builder()
            .stream(stream)
            .backend(memory.clone())
            .build()
            .unwrap()
    };
    let too_large = |size: usize, limit: usize| Err(ProduceError::TooLarge { size, limit });
    let key = "k";
    let record = |size: usize| ProducerRecord::new(payload(size - key.len(), 1), key);

    // The stream set for 10 MiB: read from the stream, at the limit stored, above refused.
    let large = build(STREAM);
    assert_eq!(large.max_record_size().await, Ok(MAX_LARGE_RECORD_BYTES));
    let over = MAX_LARGE_RECORD_BYTES + 1;
    assert_eq!(
        large.send(record(over)).await,
        too_large(over, MAX_LARGE_RECORD_BYTES)
    );
    assert!(large.send(record(MAX_LARGE_RECORD_BYTES)).await.is_ok());

    // A stream at the default: 1 MiB, through `send` and through the tower `call` of a
    // producer that has not read the limit yet.
    let over = MAX_RECORD_BYTES + 1;
    let plain = build("plain");
    assert_eq!(
        plain.send(record(over)).await,
        too_large(over, MAX_RECORD_BYTES)
    );
    let mut fresh = build("plain");
    let answer = fresh.ready().await.unwrap().call(record(over)).await;
    assert_eq!(answer, too_large(over, MAX_RECORD_BYTES));
    assert!(plain.send(record(MAX_RECORD_BYTES)).await.is_ok());

    // A limit set on the builder is the one checked, without reading the stream's.
    let two_mib = Producer::builder()
        .stream(STREAM)
        .backend(memory.clone())
        .max_record_size(2 * MIB)
        .build()
        .unwrap();
    assert_eq!(
        two_mib.send(record(3 * MIB)).await,
        too_large(3 * MIB, 2 * MIB)
    );
    assert!(two_mib.send(record(2 * MIB)).await.is_ok());

    // `send_all` refuses the large one and sends none after it.
    let answers = plain.send_all([record(10), record(over), record(10)]).await;
    assert!(answers[0].is_ok());
    assert_eq!(answers[1], too_large(over, MAX_RECORD_BYTES));
    assert!(matches!(answers[2], Err(ProduceError::AfterFailure(_))));
    for p in [large, plain, fresh, two_mib] {
        p.close().await;
    }
}

#[tokio::test(start_paused = true)]
async fn the_embedded_stream_refuses_what_kinesis_refuses() {
    let memory = backend(1_024).await;
    let kinesis = memory.streams();
    let put = |size: usize| PutRecord {
        data: payload(size - 1, 2),
        partition_key: "k".into(),
        explicit_hash_key: None,
    };
    let invalid = |r: Result<_, KinesisError>| matches!(r, Err(KinesisError::Invalid(_)));
    // The dead-letter stream is at 1 MiB: a larger record is refused, the whole call.
    assert!(invalid(
        kinesis
            .put_records(DLQ, &[put(10), put(MAX_RECORD_BYTES + 1)])
            .await
    ));
    assert!(memory
        .streams()
        .records(DLQ, "shardId-000000000000")
        .is_empty());
    assert_eq!(
        kinesis.max_record_size(DLQ).await.unwrap(),
        MAX_RECORD_BYTES
    );
    // The large stream takes 10 MiB in a call, not one byte more, and 500 records.
    assert_eq!(
        kinesis.max_record_size(STREAM).await.unwrap(),
        MAX_LARGE_RECORD_BYTES
    );
    assert!(kinesis
        .put_records(STREAM, &[put(MAX_LARGE_RECORD_BYTES)])
        .await
        .is_ok());
    assert!(invalid(
        kinesis
            .put_records(STREAM, &[put(MAX_LARGE_RECORD_BYTES - 10), put(11)])
            .await
    ));
    assert!(invalid(
        kinesis.put_records(STREAM, &vec![put(10); 501]).await
    ));
    // UpdateMaxRecordSize's range is 1,024..=10,240 KiB.
    for kib in [1_023, 10_241] {
        assert!(matches!(
            kinesis.update_max_record_size(STREAM, kib),
            Err(KinesisError::Invalid(_))
        ));
    }
    assert!(matches!(
        kinesis.update_max_record_size("missing", 2_048),
        Err(KinesisError::NotFound(_))
    ));
}

#[tokio::test(start_paused = true)]
async fn a_large_record_uses_up_its_shards_write_rate_for_as_long_as_it_takes() {
    // Kinesis' write limits on: a 9 MiB record is a burst the shard pays back at 1 MiB
    // per second before it takes the next record (the producer's budget waits with it).
    let memory = Memory::builder().limits(KinesisLimits::aws()).build();
    memory.create_stream(STREAM, 1).await.unwrap();
    memory
        .streams()
        .update_max_record_size(STREAM, 10_240)
        .unwrap();
    let producer = Producer::builder()
        .stream(STREAM)
        .backend(memory.clone())
        .build()
        .unwrap();
    let start = Instant::now();
    within(LIMIT, "the 9 MiB record", async {
        producer
            .send(ProducerRecord::new(payload(9 * MIB, 3), "k"))
            .await
    })
    .await
    .unwrap();
    assert!(
        start.elapsed() < Duration::from_secs(1),
        "a full shard takes it at once"
    );
    let after = Instant::now();
    within(LIMIT, "the next record", async {
        producer.send(ProducerRecord::new("next", "k")).await
    })
    .await
    .unwrap();
    let waited = after.elapsed();
    assert!(
        waited >= Duration::from_secs(8),
        "the shard took the next record after {waited:?}: faster than 1 MiB per second"
    );
    assert!(waited < Duration::from_secs(30), "{waited:?}");
    producer.close().await;
}
