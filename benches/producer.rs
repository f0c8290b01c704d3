//! Throughput of the producer: records per second from `Producer::send` until every
//! call was answered, on the embedded (memory) backend and, when
//! `AWS_ENDPOINT_URL_KINESIS` is set, into a Kinesis emulator (kinesalite) over HTTP.
//!
//! ```text
//! cargo bench --bench producer
//! AWS_ENDPOINT_URL_KINESIS=http://127.0.0.1:4567 AWS_REGION=us-east-1 \
//!   AWS_ACCESS_KEY_ID=test AWS_SECRET_ACCESS_KEY=test cargo bench --bench producer
//! ```
//!
//! Setup: a 4-shard stream; records of 100 bytes with 1,000 distinct partition keys;
//! up to 20,000 calls outstanding (`buffer_unordered`), so the producer's bounded
//! buffer, not the caller, sets the pace. Modes, each timed several times (a fresh
//! stream each time on the memory backend), medians printed:
//!
//! * `producer`: default settings (500-record batches, 4 calls in flight).
//! * `ordered`: the same with `ordered_per_key(true)`.
//! * `raw`: the floor: PutRecords of 500 records straight on the `KinesisApi`,
//!   4 calls at once, records prepared in advance; no producer.
//!
//! Environment knobs: `BENCH_ITERS` (default 5), `BENCH_RECORDS` (memory, default
//! 200000), `BENCH_EMULATOR_RECORDS` (default 20000).
//!
//! Without `--bench` among its arguments (`cargo bench` passes it; `cargo test
//! --all-targets` runs this binary without), it makes a smoke run instead: the memory
//! backend only (never the emulator, even when its endpoint is set), 1,000 records, one
//! warm-up and one timed run per mode, the knobs ignored.

mod common;

use common::*;
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use futures_util::stream::{self, StreamExt};
use shardflow::kinesis::{KinesisApi, PutOutcome, PutRecord, StreamAdmin};
use shardflow::{Backend, Memory, Producer, ProducerRecord};

const SHARDS: u32 = 4;
const RECORD_BYTES: usize = 100;
const KEYS: usize = 1_000;
const OUTSTANDING: usize = 20_000;

fn keys() -> Vec<String> {
    (0..KEYS).map(|k| format!("key-{k}")).collect()
}

#[derive(Clone, Copy, PartialEq)]
enum Mode {
    Producer,
    Ordered,
    Raw,
}

impl Mode {
    fn name(self) -> &'static str {
        match self {
            Mode::Producer => "producer",
            Mode::Ordered => "ordered",
            Mode::Raw => "raw",
        }
    }
}

/// Writes `records` records and returns how long it took until all were answered.
async fn run(kinesis: Arc<dyn KinesisApi>, stream: &str, records: usize, mode: Mode) -> Duration {
    let data = Bytes::from(vec![b'x'; RECORD_BYTES]);
    let keys = keys();
    if mode == Mode::Raw {
        let batches: Vec<Vec<PutRecord>> = (0..records)
            .collect::<Vec<_>>()
            .chunks(500)
            .map(|chunk| {
                chunk
                    .iter()
                    .map(|i| PutRecord {
                        data: data.clone(),
                        partition_key: keys[i % KEYS].clone(),
                        explicit_hash_key: None,
                    })
                    .collect()
            })
            .collect();
        let start = Instant::now();
        stream::iter(batches)
            .for_each_concurrent(4, |batch| {
                let kinesis = kinesis.clone();
                async move {
                    let out = kinesis.put_records(stream, &batch).await.expect("put");
                    assert!(out.iter().all(|o| matches!(o, PutOutcome::Stored { .. })));
                }
            })
            .await;
        return start.elapsed();
    }
    let producer = Producer::builder()
        .stream(stream)
        .kinesis(kinesis)
        .ordered_per_key(mode == Mode::Ordered)
        .build()
        .expect("config");
    let start = Instant::now();
    let failed = stream::iter(0..records)
        .map(|i| producer.send(ProducerRecord::new(data.clone(), keys[i % KEYS].clone())))
        .buffer_unordered(OUTSTANDING)
        .filter(|answer| std::future::ready(answer.is_err()))
        .count()
        .await;
    let elapsed = start.elapsed();
    assert_eq!(failed, 0, "records failed");
    producer.close().await;
    elapsed
}

fn report(label: &str, mode: Mode, records: usize, mut times: Vec<Duration>) {
    let m = median(&mut times);
    println!(
        "{label:>8} {:>9}: {records:>7} records in {:>9.2?} = {:>10.0} records/s",
        mode.name(),
        m,
        records as f64 / m.as_secs_f64()
    );
}

fn main() {
    let measure = measuring();
    let (iters, records): (usize, usize) = if measure {
        (env_or("BENCH_ITERS", 5), env_or("BENCH_RECORDS", 200_000))
    } else {
        println!("producer: smoke run (not a measurement: run `cargo bench --bench producer`)");
        (1, 1_000)
    };
    let emulator_records: usize = env_or("BENCH_EMULATOR_RECORDS", 20_000);
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .expect("runtime");
    let threads = std::thread::available_parallelism()
        .map(|n| n.get())
        .unwrap_or(1);
    let modes = [Mode::Raw, Mode::Producer, Mode::Ordered];

    runtime.block_on(async {
        println!(
            "producer: {RECORD_BYTES} B records, {KEYS} partition keys, {SHARDS} shards; \
             {threads} CPUs, tokio multi-thread runtime; {iters} iterations, medians"
        );
        for mode in modes {
            let mut times = Vec::new();
            for i in 0..=iters {
                // A fresh backend each time, so the stream does not grow across runs.
                let memory = Memory::new();
                memory
                    .streams()
                    .create_stream("bench", SHARDS)
                    .await
                    .expect("create");
                let t = run(Backend::kinesis(&memory), "bench", records, mode).await;
                if i > 0 {
                    times.push(t); // the first run warms up
                }
            }
            report("memory", mode, records, times);
        }

        if !measure {
            println!("emulator: skipped in a smoke run");
            return;
        }
        if std::env::var_os("AWS_ENDPOINT_URL_KINESIS").is_none() {
            println!("emulator: skipped (AWS_ENDPOINT_URL_KINESIS not set)");
            return;
        }
        let aws = shardflow::Aws::from_env().await;
        let kinesis = aws.admin().unwrap();
        let stream = format!("bench-producer-{}", std::process::id());
        kinesis
            .create_stream(&stream, SHARDS)
            .await
            .expect("create");
        for mode in modes {
            let mut times = Vec::new();
            for i in 0..=iters {
                let t = run(kinesis.clone(), &stream, emulator_records, mode).await;
                if i > 0 {
                    times.push(t);
                }
            }
            report("emulator", mode, emulator_records, times);
        }
    });
}
