//! Throughput of the consumer on the embedded (memory) backend, against a hand-written
//! read loop over the same records: what does the framework cost per record?
//!
//! ```text
//! cargo bench --bench throughput
//! ```
//!
//! Setup: a 4-shard stream holding 400,000 records of 100 bytes (PutRecords in chunks of
//! 500). Then, several times each:
//!
//! * `run`: `Consumer::run(service_fn(..))`, a no-op handler per record that counts it;
//!   timed from `build()` until the handler has seen every record (shutdown timed apart).
//! * `run_batches`: the same with `Consumer::run_batches`, the handler called per batch.
//! * `loop`: GetShardIterator(TRIM_HORIZON) + GetRecords on every shard at once (one
//!   tokio task per shard, like the framework's readers), calling the same no-op
//!   function per record. No leases, no watermark, no messages, no channels.
//!
//! Every mode reads through the same `KinesisApi` of the same `Memory` (so each pays the
//! memory backend's copy of the records), on the same 2-worker multi-thread runtime.
//! The medians are printed, with the per-record framework overhead
//! `(t_framework - t_loop) / records` and the ratio `t_framework / t_loop`.
//!
//! * `run_raw`: `run` with header recognition off (`HeaderFormat::None`); `run` has it
//!   on (the default, `HeaderFormat::Auto`), and none of the records is an envelope.
//! * `detect`: the recognition alone, per record, without a consumer: `Auto.read` and
//!   `None.read` over a mix of payloads that are not envelopes (the bench's 100-byte
//!   records, JSON documents, binary data starting with `0xff`), 20 passes.
//!
//! * `table`: `run` over a DynamoDB table's change stream instead (an embedded table of
//!   4 partitions holding as many items, one put each, so as many INSERT records of
//!   about 300 bytes), against `table_loop`, the hand-written loop over the same stream
//!   (GetRecords of at most 1,000 records, as DynamoDB Streams answers): the table
//!   stream's per-record overhead next to the Kinesis stream's.
//!
//! Environment knobs: `BENCH_ITERS` (default 7), `BENCH_RECORDS` (default 400000),
//! `BENCH_MODE` (`all`, `run`, `run_raw`, `batches`, `loop`, `table`, `detect`: one
//! mode only, e.g. under `perf`; `table` runs `table_loop` too).
//!
//! Without `--bench` among its arguments (`cargo bench` passes it; `cargo test
//! --all-targets` runs this binary without), it makes a smoke run instead: every mode
//! once over 400 records, no warm-up, the knobs ignored. That proves the bench works
//! without costing the test suite the measurement.

mod common;

use common::*;
use std::future::ready;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bytes::Bytes;
use shardflow::kinesis::{KinesisApi, StartingPosition};
use shardflow::{Backend, Batch, Consumer, HeaderFormat, Memory, Message};
use tokio::sync::Notify;

const STREAM: &str = "bench";
const TABLE: &str = "bench-table";
const READ_LIMIT: u32 = 10_000;

/// The "work" every mode does per record: count it (and touch the payload so the
/// compiler cannot drop the access). The same function is called by every mode.
#[inline(never)]
fn handle(data: &Bytes, counter: &AtomicU64) -> u64 {
    std::hint::black_box(data.len());
    counter.fetch_add(1, Ordering::Relaxed) + 1
}

/// Counts handled records and remembers when the last one was handled.
struct Done {
    expected: u64,
    count: AtomicU64,
    at: Mutex<Option<Instant>>,
    notify: Notify,
}

impl Done {
    fn new(expected: u64) -> Arc<Self> {
        Arc::new(Done {
            expected,
            count: AtomicU64::new(0),
            at: Mutex::new(None),
            notify: Notify::new(),
        })
    }

    fn handled(&self, data: &Bytes) {
        if handle(data, &self.count) == self.expected {
            self.finish();
        }
    }

    #[cold]
    fn finish(&self) {
        *self.at.lock().unwrap() = Some(Instant::now());
        // notify_one stores a permit if nobody waits yet.
        self.notify.notify_one();
    }
}

struct Timing {
    handled: Duration,
    shutdown: Duration,
}

/// `Consumer::run` with a per-record service.
async fn framework_records(
    memory: &Memory,
    group: &str,
    records: u64,
    headers: HeaderFormat,
    table: bool,
) -> Timing {
    let done = Done::new(records);
    let start = Instant::now();
    let builder = if table {
        Consumer::builder().table_stream(TABLE)
    } else {
        Consumer::builder().stream(STREAM)
    };
    let consumer = builder
        .group(group)
        .backend(memory.clone())
        .idle_read_interval(Duration::from_millis(1))
        .header_format(headers)
        .build()
        .expect("config");
    let d = done.clone();
    let service = tower::service_fn(move |msg: Message| {
        d.handled(&msg.payload);
        ready(Ok::<_, std::convert::Infallible>(()))
    });
    let signal = {
        let done = done.clone();
        async move { done.notify.notified().await }
    };
    consumer.run(service).until(signal).await.expect("consumer");
    let end = Instant::now();
    let handled_at = done.at.lock().unwrap().expect("every record handled");
    Timing {
        handled: handled_at - start,
        shutdown: end - handled_at,
    }
}

/// `Consumer::run_batches` with a per-batch service.
async fn framework_batches(memory: &Memory, group: &str, records: u64) -> Timing {
    let done = Done::new(records);
    let start = Instant::now();
    let consumer = Consumer::builder()
        .stream(STREAM)
        .group(group)
        .backend(memory.clone())
        .idle_read_interval(Duration::from_millis(1))
        .build()
        .expect("config");
    let d = done.clone();
    let service = tower::service_fn(move |batch: Batch| {
        for msg in &batch.messages {
            d.handled(&msg.payload);
        }
        ready(Ok::<_, std::convert::Infallible>(()))
    });
    let signal = {
        let done = done.clone();
        async move { done.notify.notified().await }
    };
    consumer
        .run_batches(service)
        .until(signal)
        .await
        .expect("consumer");
    let end = Instant::now();
    let handled_at = done.at.lock().unwrap().expect("every record handled");
    Timing {
        handled: handled_at - start,
        shutdown: end - handled_at,
    }
}

/// Payloads that are not envelopes, as a consumer meets them: 100-byte records, JSON
/// documents, and binary data starting with `0xff` (which the legacy check looks at).
fn plain_payloads() -> Vec<Bytes> {
    let mut payloads = Vec::new();
    for i in 0..1_000u32 {
        payloads.push(match i % 4 {
            0 | 1 => Bytes::from(vec![b'x'; RECORD_BYTES]),
            2 => Bytes::from(format!(
                r#"{{"id":{i},"customer":"c-{}","total":12.5}}"#,
                i % 97
            )),
            _ => {
                let mut v = vec![0xffu8, (i % 7) as u8 + 1];
                v.extend(i.to_be_bytes().iter().cycle().take(60));
                Bytes::from(v)
            }
        });
    }
    payloads
}

/// Per-record time of `format.read` over `payloads`, `passes` times (the best of 5).
fn detection_ns(check: impl Fn(&Bytes) -> bool, payloads: &[Bytes], passes: usize) -> f64 {
    let mut best = f64::MAX;
    for _ in 0..5 {
        let start = Instant::now();
        for _ in 0..passes {
            for p in payloads {
                std::hint::black_box(check(std::hint::black_box(p)));
            }
        }
        let ns = start.elapsed().as_secs_f64() * 1e9 / (passes * payloads.len()) as f64;
        best = best.min(ns);
    }
    best
}

/// The baseline: read every shard directly, one task per shard.
async fn hand_loop(kinesis: Arc<dyn KinesisApi>, stream: &str, records: u64) -> Duration {
    let done = Done::new(records);
    let start = Instant::now();
    let shards = kinesis.list_shards(stream).await.expect("list shards");
    let tasks: Vec<_> = shards
        .into_iter()
        .map(|shard| {
            let kinesis = kinesis.clone();
            let done = done.clone();
            let stream = stream.to_owned();
            tokio::spawn(async move {
                let mut it = kinesis
                    .shard_iterator(&stream, &shard.shard_id, &StartingPosition::TrimHorizon)
                    .await
                    .expect("iterator");
                loop {
                    let page = kinesis
                        .get_records(&it, READ_LIMIT)
                        .await
                        .expect("get records");
                    if page.records.is_empty() {
                        break; // an open shard read to its tip
                    }
                    for record in &page.records {
                        done.handled(&record.data);
                    }
                    match page.next_iterator {
                        Some(next) => it = next,
                        None => break,
                    }
                }
            })
        })
        .collect();
    for t in tasks {
        t.await.expect("join");
    }
    assert_eq!(
        done.count.load(Ordering::Relaxed),
        records,
        "the loop saw every record"
    );
    start.elapsed()
}

/// An embedded table of 4 partitions with `records` items, one put each: as many
/// INSERT records in its stream. The stream's ARN.
fn fill_table(memory: &Memory, records: u64) -> String {
    #[derive(serde::Serialize)]
    struct Item {
        id: String,
        body: String,
    }
    let table = memory
        .tables()
        .create(TABLE, "id")
        .partitions(4)
        .build()
        .expect("table");
    let body = "x".repeat(RECORD_BYTES);
    for i in 0..records {
        table
            .put(&Item {
                id: format!("item-{i}"),
                body: body.clone(),
            })
            .expect("put");
    }
    table.stream_arn()
}

fn rate(records: u64, d: Duration) -> f64 {
    records as f64 / d.as_secs_f64()
}

fn overhead_ns(records: u64, framework: Duration, baseline: Duration) -> f64 {
    (framework.as_secs_f64() - baseline.as_secs_f64()) * 1e9 / records as f64
}

fn main() {
    let measure = measuring();
    let (iters, records, mode): (usize, u64, String) = if measure {
        (
            env_or("BENCH_ITERS", 7),
            env_or("BENCH_RECORDS", 400_000),
            env_or("BENCH_MODE", "all".to_string()),
        )
    } else {
        println!("throughput: smoke run (not a measurement: run `cargo bench --bench throughput`)");
        (1, 400, "all".to_string())
    };
    let want = |m: &str| mode == "all" || mode == m;
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .expect("runtime");
    let threads = std::thread::available_parallelism()
        .map(|n| n.get())
        .unwrap_or(1);

    runtime.block_on(async {
        let memory = Memory::new();
        let t = Instant::now();
        fill(memory.streams().as_ref(), STREAM, records as usize).await;
        println!(
            "throughput: {records} records x {RECORD_BYTES} B on {SHARDS} shards (memory backend), \
             put in {:.2?}; {threads} CPUs, tokio multi-thread runtime; {iters} iterations, medians",
            t.elapsed()
        );
        let kinesis = Backend::kinesis(&memory);
        let table_arn = if want("table") {
            let t = Instant::now();
            let arn = fill_table(&memory, records);
            println!("  table: {records} items put in {:.2?}", t.elapsed());
            Some(arn)
        } else {
            None
        };

        // One untimed warm-up of each mode (allocator, page faults, lazy statics).
        if measure && want("loop") {
            hand_loop(kinesis.clone(), STREAM, records).await;
        }
        if measure && want("run") {
            framework_records(&memory, "warmup-run", records, HeaderFormat::Auto, false).await;
        }
        if measure && want("run_raw") {
            framework_records(&memory, "warmup-raw", records, HeaderFormat::None, false).await;
        }
        if measure && want("batches") {
            framework_batches(&memory, "warmup-batches", records).await;
        }
        if let (true, Some(arn)) = (measure, &table_arn) {
            hand_loop(kinesis.clone(), arn, records).await;
            framework_records(&memory, "warmup-table", records, HeaderFormat::Auto, true).await;
        }
        let (mut tlp, mut tab, mut tab_sd) = (vec![], vec![], vec![]);

        let (mut lp, mut run, mut run_sd, mut bat, mut bat_sd) = (vec![], vec![], vec![], vec![], vec![]);
        let (mut raw, mut raw_sd) = (vec![], vec![]);
        for i in 0..iters {
            // Interleaved so that drift on the shared machine hits every mode alike.
            if want("loop") {
                lp.push(hand_loop(kinesis.clone(), STREAM, records).await);
            }
            if want("run") {
                let t = framework_records(&memory, &format!("run-{i}"), records, HeaderFormat::Auto, false).await;
                run.push(t.handled);
                run_sd.push(t.shutdown);
            }
            if want("run_raw") {
                let t = framework_records(&memory, &format!("raw-{i}"), records, HeaderFormat::None, false).await;
                raw.push(t.handled);
                raw_sd.push(t.shutdown);
            }
            if want("batches") {
                let t = framework_batches(&memory, &format!("batches-{i}"), records).await;
                bat.push(t.handled);
                bat_sd.push(t.shutdown);
            }
            if let Some(arn) = &table_arn {
                tlp.push(hand_loop(kinesis.clone(), arn, records).await);
                let t = framework_records(&memory, &format!("table-{i}"), records, HeaderFormat::Auto, true).await;
                tab.push(t.handled);
                tab_sd.push(t.shutdown);
            }
        }
        let show = |name: &str, all: &mut Vec<Duration>| {
            let all_ms: Vec<String> = all.iter().map(|d| format!("{:.0}", d.as_secs_f64() * 1e3)).collect();
            let m = median(all);
            println!(
                "  {name:<12} median {:>8.1} ms  {:>10.0} records/s   (runs, ms: {})",
                m.as_secs_f64() * 1e3,
                rate(records, m),
                all_ms.join(" ")
            );
            m
        };
        let base = (!lp.is_empty()).then(|| show("loop", &mut lp));
        for (name, times, shutdowns) in [
            ("run", &mut run, &mut run_sd),
            ("run_raw", &mut raw, &mut raw_sd),
            ("run_batches", &mut bat, &mut bat_sd),
        ] {
            if times.is_empty() {
                continue;
            }
            let m = show(name, times);
            let sd = median(shutdowns);
            print!("               graceful shutdown after the last record: {:.1} ms", sd.as_secs_f64() * 1e3);
            match base {
                Some(b) => println!(
                    "\n               overhead vs loop: {:+.0} ns/record, ratio {:.2}x  (target: < 1000 ns/record)",
                    overhead_ns(records, m, b),
                    m.as_secs_f64() / b.as_secs_f64()
                ),
                None => println!(),
            }
        }
        if !tab.is_empty() {
            let tb = show("table_loop", &mut tlp);
            let tm = show("table", &mut tab);
            let table_overhead = overhead_ns(records, tm, tb);
            println!(
                "               graceful shutdown after the last record: {:.1} ms\n               \
                 overhead vs table_loop: {table_overhead:+.0} ns/record, ratio {:.2}x",
                median(&mut tab_sd).as_secs_f64() * 1e3,
                tm.as_secs_f64() / tb.as_secs_f64()
            );
            if let (false, Some(b)) = (run.is_empty(), base) {
                let kinesis_overhead = overhead_ns(records, median(&mut run), b);
                println!(
                    "  table stream vs Kinesis stream, per-record overhead: {table_overhead:+.0} vs \
                     {kinesis_overhead:+.0} ns/record ({:+.1} %)  (target: within 10 %)",
                    (table_overhead - kinesis_overhead) * 100.0 / kinesis_overhead
                );
            }
        }
        if !run.is_empty() && !raw.is_empty() {
            println!(
                "  header recognition in `run` (Auto vs None, no envelopes): {:+.0} ns/record",
                overhead_ns(records, median(&mut run), median(&mut raw))
            );
        }
    });
    if want("detect") {
        let payloads = plain_payloads();
        let passes = if measure { 20 } else { 1 };
        let read = |format: HeaderFormat| move |p: &Bytes| format.read(p).is_some();
        let auto = detection_ns(read(HeaderFormat::Auto), &payloads, passes);
        let none = detection_ns(read(HeaderFormat::None), &payloads, passes);
        let both = detection_ns(read(HeaderFormat::SpringJsonAndLegacy), &payloads, passes);
        // What a producer that embeds headers checks on each record without headers.
        let producer = detection_ns(
            shardflow::headers::spring::may_be_taken_for_a_frame,
            &payloads,
            passes,
        );
        println!(
            "  detect       Auto {auto:.1} ns/record, None {none:.1} ns/record: {:+.1} ns/record \
             over {} payloads that are not envelopes x {passes} passes, best of 5  (target: < 50 ns/record)",
            auto - none,
            payloads.len()
        );
        println!(
            "  detect       SpringJsonAndLegacy {both:.1} ns/record ({:+.1}); the producer's \
             look-alike check {producer:.1} ns/record ({:+.1})",
            both - none,
            producer - none
        );
    }
}
