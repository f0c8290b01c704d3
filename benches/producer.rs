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
//! * `producer`: default settings (500-record batches, 4 calls in flight) but without
//!   the per-shard rate limit, which would set the pace (150 % of 1,000 records/s per
//!   shard): these modes measure the producer's CPU cost.
//! * `ordered`: the same with `ordered_per_key(true)`.
//! * `aggregate`: the same with `aggregate(true)` (KPL aggregation, the KPL's defaults).
//! * `aggregate+rate1000`: aggregation with a rate limit of 1,000 % (10 MiB/s per shard,
//!   above what the CPU packs): what the limiter's bookkeeping costs.
//! * `raw`: the floor: PutRecords of 500 records straight on the `KinesisApi`,
//!   4 calls at once, records prepared in advance; no producer.
//!
//! Environment knobs: `BENCH_ITERS` (default 5), `BENCH_RECORDS` (memory, default
//! 200000), `BENCH_EMULATOR_RECORDS` (default 20000), `BENCH_LIMITED_ITERS` (default 3).
//!
//! **Limits on** (the memory backend with `KinesisLimits::aws()`: 1,000 records and
//! 1 MiB per second per shard): each mode of [`limited_modes`] (a list of producer
//! configurations) with 100-byte records and with 1 KiB records, 1,000 keys, 4 shards,
//! on the real clock (a throughput claim needs wall-clock time). Printed per run:
//! records/s stored in the steady state (answers after the first second, which the
//! shards' one-second burst would flatter), per shard until that shard's last answer
//! and summed (1,000 keys do not spread evenly: the stream-wide rate would count the
//! tail where only the busiest shard still has records), and its fraction of
//! 4 × 1,000 records/s and of 4 × 1 MiB/s; PUT payload units per million records (each stored Kinesis record
//! rounded up to 25 KiB = 25,600 bytes of data plus partition key); entries refused per
//! 1,000 stored; records that finally failed. Then `consumer`: the default producer
//! writes 100-byte records at the limit while a consumer at its default settings reads
//! the same stream in the same process: both rates.
//!
//! **Hot shard** (`hot`, limits on, real clock): one shard gets a backlog of
//! `BENCH_HOT_BACKLOG` records (default 100,000) handed over at once (`send_all`), far
//! more than its budget (1,500 records/s at the default rate limit) lets go; 200 ms
//! later, 20 records for the other shards are sent one after the other. Printed, with
//! and without aggregation: how long each of those took from `send` to its answer
//! (stored), median, maximum and the first's, and whether the backlog was still draining
//! after them.
//! The target: under 100 ms. `BENCH_ONLY=hot` runs this mode alone.
//!
//! Without `--bench` among its arguments (`cargo bench` passes it; `cargo test
//! --all-targets` runs this binary without), it makes a smoke run instead: the memory
//! backend only (never the emulator, even when its endpoint is set), 1,000 records, one
//! warm-up and one timed run per mode, and each limits-on run with 1,000 records (within
//! the shards' burst, so its figures mean nothing), the knobs ignored.

mod common;

use common::*;
use std::future::IntoFuture;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use async_trait::async_trait;
use bytes::Bytes;
use futures_util::stream::{self, StreamExt};
use shardflow::kinesis::{KinesisApi, KinesisError, PutOutcome, PutRecord, StreamAdmin};
use shardflow::memory::KinesisLimits;
use shardflow::{Backend, Consumer, Memory, Message, Producer, ProducerBuilder, ProducerRecord};
use testkit::hooks::{Forward, ForwardKinesis};

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
    Aggregate,
    AggregateRateLimited,
    Raw,
}

impl Mode {
    fn name(self) -> &'static str {
        match self {
            Mode::Producer => "producer",
            Mode::Ordered => "ordered",
            Mode::Aggregate => "aggregate",
            Mode::AggregateRateLimited => "aggregate+rate1000",
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
    let builder = Producer::builder()
        .stream(stream)
        .kinesis(kinesis)
        .ordered_per_key(mode == Mode::Ordered)
        .aggregate(matches!(mode, Mode::Aggregate | Mode::AggregateRateLimited));
    let builder = if mode == Mode::AggregateRateLimited {
        builder.rate_limit(1000)
    } else {
        builder.no_rate_limit()
    };
    let producer = builder.build().expect("config");
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

/// A producer configuration measured with Kinesis' limits on.
struct LimitedMode {
    name: &'static str,
    /// User records per run, by record size: a few seconds at the rate the mode reaches.
    records: fn(usize) -> usize,
    /// The settings on top of the stream and backend.
    configure: fn(ProducerBuilder) -> ProducerBuilder,
}

/// The producer configurations measured with limits on: one line per mode.
fn limited_modes() -> Vec<LimitedMode> {
    vec![
        LimitedMode {
            name: "producer",
            records: |_| 20_000,
            configure: |b| b,
        },
        LimitedMode {
            name: "no_rate_limit",
            records: |_| 20_000,
            configure: |b| b.no_rate_limit(),
        },
        LimitedMode {
            name: "rate_limit(100)",
            records: |_| 20_000,
            configure: |b| b.rate_limit(100),
        },
        LimitedMode {
            name: "aggregate",
            records: |bytes| if bytes <= 100 { 200_000 } else { 30_000 },
            configure: |b| b.aggregate(true),
        },
        LimitedMode {
            name: "aggregate+no_limit",
            records: |bytes| if bytes <= 100 { 200_000 } else { 30_000 },
            configure: |b| b.aggregate(true).no_rate_limit(),
        },
        LimitedMode {
            name: "aggregate+rate100",
            records: |bytes| if bytes <= 100 { 200_000 } else { 30_000 },
            configure: |b| b.aggregate(true).rate_limit(100),
        },
    ]
}

/// Record sizes of the limits-on runs.
const LIMITED_SIZES: [usize; 2] = [100, 1024];
/// Kinesis' write limits per shard.
const SHARD_RECORDS_PER_SECOND: f64 = 1_000.0;
const SHARD_BYTES_PER_SECOND: f64 = 1024.0 * 1024.0;
/// The PUT payload unit AWS bills: "25 KB", taken as 25 KiB as Kinesis' other limits are.
const PUT_UNIT_BYTES: u64 = 25 * 1024;
/// Answers within this long of the start are left out of steady-state rates: a shard's
/// budget starts with one second's quota.
const BURST: Duration = Duration::from_secs(1);

/// A [`KinesisApi`] that counts what PutRecords stored and refused.
struct Metered {
    inner: Arc<dyn KinesisApi>,
    stored: AtomicU64,
    refused: AtomicU64,
    stored_bytes: AtomicU64,
    put_units: AtomicU64,
}

impl Metered {
    fn new(inner: Arc<dyn KinesisApi>) -> Arc<Forward<Self>> {
        Arc::new(Forward(Metered {
            inner,
            stored: AtomicU64::new(0),
            refused: AtomicU64::new(0),
            stored_bytes: AtomicU64::new(0),
            put_units: AtomicU64::new(0),
        }))
    }
}

#[async_trait]
impl ForwardKinesis for Metered {
    fn inner(&self) -> &dyn KinesisApi {
        self.inner.as_ref()
    }
    async fn put_records(
        &self,
        stream: &str,
        records: &[PutRecord],
    ) -> Result<Vec<PutOutcome>, KinesisError> {
        let outcomes = self.inner.put_records(stream, records).await?;
        for (r, o) in records.iter().zip(&outcomes) {
            if matches!(o, PutOutcome::Stored { .. }) {
                let bytes = (r.data.len() + r.partition_key.len()) as u64;
                self.stored.fetch_add(1, Ordering::Relaxed);
                self.stored_bytes.fetch_add(bytes, Ordering::Relaxed);
                self.put_units
                    .fetch_add(bytes.div_ceil(PUT_UNIT_BYTES), Ordering::Relaxed);
            } else {
                self.refused.fetch_add(1, Ordering::Relaxed);
            }
        }
        Ok(outcomes)
    }
}

/// Records per second stored in the steady state: per shard, the answers after the
/// burst until that shard's last one, summed over the shards.
fn steady_rate_per_shard(answers: &[(Duration, String)]) -> f64 {
    let mut by_shard: std::collections::BTreeMap<&str, Vec<Duration>> = Default::default();
    for (t, shard) in answers {
        by_shard.entry(shard).or_default().push(*t);
    }
    by_shard.values_mut().map(|times| steady_rate(times)).sum()
}

/// Records per second among `times` (since the start, in any order) after the burst;
/// the whole run's rate when nothing came after it (a smoke run).
fn steady_rate(times: &mut [Duration]) -> f64 {
    times.sort_unstable();
    let Some(&last) = times.last() else {
        return 0.0;
    };
    let after = times.iter().filter(|t| **t > BURST).count();
    if after < 2 {
        return times.len() as f64 / last.as_secs_f64().max(1e-9);
    }
    after as f64 / (last - BURST).as_secs_f64()
}

/// What one limits-on run measured.
struct LimitedRun {
    /// Records/s stored per shard in the steady state, summed.
    rate: f64,
    /// Records/s stored in the steady state until the run's last answer.
    stream_rate: f64,
    bytes_per_record: f64,
    put_units_per_million: f64,
    refused_per_1000: f64,
    failed: usize,
}

/// A fresh 4-shard stream on a memory backend with AWS' limits.
async fn limited_memory() -> Memory {
    let memory = Memory::builder().limits(KinesisLimits::aws()).build();
    memory
        .streams()
        .create_stream("bench", SHARDS)
        .await
        .expect("create");
    memory
}

/// Sends `records` records of `bytes` through `producer`; each stored record's answer
/// time since the start and shard, and how many calls failed.
async fn send_all(
    producer: &Producer,
    records: usize,
    bytes: usize,
) -> (Vec<(Duration, String)>, usize) {
    let data = Bytes::from(vec![b'x'; bytes]);
    let keys = keys();
    let start = Instant::now();
    let answers: Vec<(Duration, Option<String>)> = stream::iter(0..records)
        .map(|i| {
            let send = producer.send(ProducerRecord::new(data.clone(), keys[i % KEYS].clone()));
            async move {
                let shard = send.await.ok().map(|stored| stored.shard_id);
                (start.elapsed(), shard)
            }
        })
        .buffer_unordered(OUTSTANDING)
        .collect()
        .await;
    let failed = answers.iter().filter(|(_, shard)| shard.is_none()).count();
    let stored = answers
        .into_iter()
        .filter_map(|(t, shard)| Some((t, shard?)))
        .collect();
    (stored, failed)
}

async fn limited_run(mode: &LimitedMode, records: usize, bytes: usize) -> LimitedRun {
    let memory = limited_memory().await;
    let metered = Metered::new(Backend::kinesis(&memory));
    let producer = (mode.configure)(Producer::builder().stream("bench").kinesis(metered.clone()))
        .build()
        .expect("config");
    let (answers, failed) = send_all(&producer, records, bytes).await;
    producer.close().await;
    let stored = metered.stored.load(Ordering::Relaxed) as f64;
    let user = (records - failed).max(1) as f64;
    LimitedRun {
        rate: steady_rate_per_shard(&answers),
        stream_rate: steady_rate(&mut answers.iter().map(|(t, _)| *t).collect::<Vec<_>>()),
        bytes_per_record: metered.stored_bytes.load(Ordering::Relaxed) as f64 / user,
        put_units_per_million: metered.put_units.load(Ordering::Relaxed) as f64 * 1e6 / user,
        refused_per_1000: metered.refused.load(Ordering::Relaxed) as f64 * 1000.0 / stored.max(1.0),
        failed,
    }
}

fn report_limited(name: &str, bytes: usize, records: usize, mut runs: Vec<LimitedRun>) {
    runs.sort_by(|a, b| a.rate.total_cmp(&b.rate));
    let (low, high) = (runs[0].rate, runs[runs.len() - 1].rate);
    let m = &runs[runs.len() / 2];
    let shards = SHARDS as f64;
    println!(
        "{:>18} {bytes:>5} B: {records:>6} records, {:>7.0} records/s stored (runs {low:.0}-{high:.0}; \
         stream-wide {:.0}) = {:>5.1} % of the record limit, {:>5.1} % of the byte limit; \
         {:>9.0} PUT units per million records; {:>6.1} refused per 1,000 stored; {} failed",
        name,
        m.rate,
        m.stream_rate,
        100.0 * m.rate / (shards * SHARD_RECORDS_PER_SECOND),
        100.0 * m.rate * m.bytes_per_record / (shards * SHARD_BYTES_PER_SECOND),
        m.put_units_per_million,
        m.refused_per_1000,
        m.failed,
    );
}

/// The default producer writes `records` 100-byte records at the limit while a consumer
/// at its default settings reads them: (records/s written, records/s handled), each in
/// the steady state, and how long after the last record was stored the last was handled.
async fn producer_and_consumer(records: usize) -> (f64, f64, Duration) {
    let memory = limited_memory().await;
    let handled = Arc::new(Mutex::new(Vec::with_capacity(records)));
    let all_handled = Arc::new(tokio::sync::Notify::new());
    let start = Instant::now();
    let consumer = Consumer::builder()
        .stream("bench")
        .group("bench")
        .backend(memory.clone())
        .build()
        .expect("config");
    let service = {
        let handled = handled.clone();
        let all_handled = all_handled.clone();
        tower::service_fn(move |_msg: Message| {
            let mut h = handled.lock().unwrap();
            h.push(start.elapsed());
            if h.len() == records {
                all_handled.notify_one();
            }
            std::future::ready(Ok::<_, std::convert::Infallible>(()))
        })
    };
    let running = tokio::spawn(
        consumer
            .run(service)
            .until(async move { all_handled.notified().await })
            .into_future(),
    );
    let producer = Producer::builder()
        .stream("bench")
        .backend(memory.clone())
        .build()
        .expect("config");
    let (written, failed) = send_all(&producer, records, RECORD_BYTES).await;
    assert_eq!(failed, 0, "records failed");
    let mut written: Vec<Duration> = written.into_iter().map(|(t, _)| t).collect();
    producer.close().await;
    tokio::time::timeout(Duration::from_secs(120), running)
        .await
        .expect("the consumer handles every record within 2 minutes")
        .expect("consumer task")
        .expect("consumer");
    let mut handled = handled.lock().unwrap().clone();
    let (written_rate, handled_rate) = (steady_rate(&mut written), steady_rate(&mut handled));
    let lag = match (handled.last(), written.last()) {
        (Some(h), Some(w)) => h.saturating_sub(*w),
        _ => Duration::ZERO,
    };
    (written_rate, handled_rate, lag)
}

/// A backlog for one shard, then records for the others one by one: how long each of
/// those took to be stored (in sending order), and whether the backlog was still draining after
/// the last.
async fn hot_shard(backlog: usize, aggregate: bool) -> (Vec<Duration>, bool) {
    let memory = limited_memory().await;
    let producer = Producer::builder()
        .stream("bench")
        .backend(memory.clone())
        .aggregate(aggregate)
        .build()
        .expect("config");
    let data = Bytes::from(vec![b'x'; RECORD_BYTES]);
    // The first shard's range starts at 0, the others' above 2^128 / 4 apart.
    let quarter = u128::MAX / u128::from(SHARDS);
    let records: Vec<_> = (0..backlog)
        .map(|i| ProducerRecord::new(data.clone(), format!("hot-{i}")).with_explicit_hash_key("0"))
        .collect();
    let hot = {
        let producer = producer.clone();
        tokio::spawn(async move { producer.send_all(records).await })
    };
    tokio::time::sleep(Duration::from_millis(200)).await;
    let mut waits = Vec::new();
    for i in 0..20u128 {
        let shard = 1 + i % (u128::from(SHARDS) - 1);
        let record = ProducerRecord::new(data.clone(), format!("idle-{i}"))
            .with_explicit_hash_key((quarter * shard + 1 + i).to_string());
        let start = Instant::now();
        producer.send(record).await.expect("stored");
        waits.push(start.elapsed());
    }
    let draining = !hot.is_finished();
    // The backlog drains at the shard's rate: not worth waiting for here.
    hot.abort();
    (waits, draining)
}

/// Runs [`hot_shard`] without and with aggregation and prints the figures.
async fn hot_shard_report(backlog: usize) {
    for aggregate in [false, true] {
        let (mut waits, draining) = hot_shard(backlog, aggregate).await;
        let first = waits[0];
        waits.sort();

        println!(
            "{:>16} {RECORD_BYTES:>5} B: a backlog of {backlog} records for one shard \
             ({}aggregated, {}); 20 records for the other shards stored in {:.1?} \
             (median), {:.1?} (max), the first in {:.1?}",
            "hot",
            if aggregate { "" } else { "not " },
            if draining {
                "still draining after them"
            } else {
                "drained before them"
            },
            waits[waits.len() / 2],
            waits[waits.len() - 1],
            first,
        );
    }
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
    let modes = [
        Mode::Raw,
        Mode::Producer,
        Mode::Ordered,
        Mode::Aggregate,
        Mode::AggregateRateLimited,
    ];

    let only_hot = std::env::var("BENCH_ONLY").is_ok_and(|only| only == "hot");
    runtime.block_on(async {
        if only_hot {
            let backlog = env_or("BENCH_HOT_BACKLOG", 100_000);
            hot_shard_report(if measure { backlog } else { 1_000 }).await;
            return;
        }
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

        let limited_iters: usize = if measure {
            env_or("BENCH_LIMITED_ITERS", 3)
        } else {
            1
        };
        println!(
            "limits on (KinesisLimits::aws(), real clock): {KEYS} partition keys, {SHARDS} \
             shards; {limited_iters} runs each, median"
        );
        for mode in limited_modes() {
            for bytes in LIMITED_SIZES {
                let records = if measure {
                    (mode.records)(bytes)
                } else {
                    1_000
                };
                let mut runs = Vec::new();
                for _ in 0..limited_iters {
                    runs.push(limited_run(&mode, records, bytes).await);
                }
                report_limited(mode.name, bytes, records, runs);
            }
        }
        let backlog = if measure {
            env_or("BENCH_HOT_BACKLOG", 100_000)
        } else {
            1_000
        };
        hot_shard_report(backlog).await;
        let records = if measure { 20_000 } else { 1_000 };
        let (written, handled, lag) = producer_and_consumer(records).await;
        println!(
            "{:>16} {RECORD_BYTES:>5} B: {records:>6} records, {written:>7.0} records/s written, \
             {handled:>7.0} records/s handled by a consumer at its default settings, the last \
             {lag:.2?} after the last was stored",
            "consumer"
        );

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
