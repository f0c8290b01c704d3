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
//! * `table_run`: `run` over a DynamoDB table's change stream instead (an embedded table
//!   of 4 partitions holding as many items, one put each, so as many INSERT records of
//!   about 300 bytes, each a change record's JSON form with a partition key derived from
//!   the item's keys), against `table_loop`, the hand-written loop over the same stream
//!   (GetRecords of at most 1,000 records, as DynamoDB Streams answers).
//! * `run_1000`: `run` over the Kinesis stream with `max_records_per_read(1000)`: the
//!   Kinesis stream read in pages of a table stream's size, which tells what of the
//!   table's overhead is the smaller pages (a cost per read, spread over 10 times fewer
//!   records) and what is the table source itself.
//! * `table`: the comparison: `loop`, `run`, `run_1000`, `table_loop` and `table_run`,
//!   interleaved in one process; prints each per-record overhead and the table's next to
//!   the Kinesis stream's. In this mode every Kinesis record has a buffer of its own
//!   (`BENCH_OWN_BUFFERS`), as each table record has and as records read from a service
//!   have; in the other modes every record's data is the same shared buffer (as the
//!   section's figures have been taken since the first).
//!
//! "Overhead" is `(t_framework - t_loop) / records`, each against its own loop: what the
//! consumer adds to reading the same records itself (leases, shard discovery, messages,
//! channels, watermark, checkpoints, the per-read work). Both loops pay the memory
//! backend's copy of the records (a table record's larger payload is a shared `Bytes`, its
//! longer partition key a longer `String` to clone), so that cost is not in the overhead.
//!
//! Environment knobs: `BENCH_ITERS` (default 7), `BENCH_RECORDS` (default 400000),
//! `BENCH_MODE` (`all`, `run`, `run_1000`, `run_raw`, `batches`, `loop`, `table`,
//! `table_loop`, `table_run`, `detect`: one mode only, e.g. under `perf` or callgrind;
//! `table` runs the five modes it compares), `BENCH_OWN_BUFFERS` (`true` or `false`:
//! whether every Kinesis record has a buffer of its own; default `true` in mode `table`
//! only).
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
/// The most records a read of a table's stream returns (DynamoDB Streams' limit, which
/// the embedded table's stream applies too): `run_1000` reads the Kinesis stream so.
const TABLE_READ_LIMIT: u32 = 1_000;

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
    read_limit: Option<u32>,
) -> Timing {
    let done = Done::new(records);
    let start = Instant::now();
    let mut builder = if table {
        Consumer::builder().table_stream(TABLE)
    } else {
        Consumer::builder().stream(STREAM)
    };
    if let Some(n) = read_limit {
        builder = builder.max_records_per_read(n);
    }
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

/// The CPU time of every thread of this process so far: the sum of the scheduler's
/// count of each thread's time on a CPU (Linux's `/proc/self/task/*/schedstat`, in ns);
/// `None` where there is no such count.
fn cpu_time() -> Option<Duration> {
    let mut ns = 0u64;
    for task in std::fs::read_dir("/proc/self/task").ok()?.flatten() {
        // A thread may end between the listing and the read: it is skipped.
        if let Ok(text) = std::fs::read_to_string(task.path().join("schedstat")) {
            ns += text.split_whitespace().next()?.parse::<u64>().ok()?;
        }
    }
    Some(Duration::from_nanos(ns))
}

/// `run`'s output, and the CPU time the whole process spent while it ran.
async fn on_cpu<T>(run: impl std::future::Future<Output = T>) -> (T, Option<Duration>) {
    let before = cpu_time();
    let out = run.await;
    let spent = cpu_time()
        .zip(before)
        .map(|(after, before)| after.saturating_sub(before));
    (out, spent)
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
    // `table` compares the table stream with the Kinesis stream in one process, the
    // modes interleaved: it runs `loop`, `run` and `run_1000` too.
    let want = |m: &str| {
        mode == "all"
            || mode == m
            || (mode == "table"
                && matches!(m, "loop" | "run" | "run_1000" | "table_loop" | "table_run"))
    };
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
        // Records read from a service each have a buffer of their own, as the table's
        // records (each its own JSON) do; the Kinesis records of the other modes share
        // one (their figures since the first are taken so). Sharing changes where the
        // time goes (one reference count, hot in cache, instead of one per record), so
        // the table comparison gives every Kinesis record its own buffer too.
        let own_buffers = env_or("BENCH_OWN_BUFFERS", mode == "table");
        if own_buffers {
            fill_with(memory.streams().as_ref(), STREAM, records as usize, |_| {
                Bytes::from(vec![b'x'; RECORD_BYTES])
            })
            .await;
        } else {
            fill(memory.streams().as_ref(), STREAM, records as usize).await;
        }
        println!(
            "throughput: {records} records x {RECORD_BYTES} B on {SHARDS} shards (memory backend, {}), \
             put in {:.2?}; {threads} CPUs, tokio multi-thread runtime; {iters} iterations, medians",
            if own_buffers { "a buffer per record" } else { "one buffer shared by every record" },
            t.elapsed()
        );
        let kinesis = Backend::kinesis(&memory);
        let table_arn = if want("table_loop") || want("table_run") {
            let t = Instant::now();
            let arn = fill_table(&memory, records);
            println!("  table: {records} items put in {:.2?}", t.elapsed());
            Some(arn)
        } else {
            None
        };
        let table_records = |name: String| {
            let memory = memory.clone();
            async move { framework_records(&memory, &name, records, HeaderFormat::Auto, true, None).await }
        };
        let kinesis_records = |name: String, headers: HeaderFormat, read_limit: Option<u32>| {
            let memory = memory.clone();
            async move { framework_records(&memory, &name, records, headers, false, read_limit).await }
        };

        // One untimed warm-up of each mode (allocator, page faults, lazy statics).
        if measure && want("loop") {
            hand_loop(kinesis.clone(), STREAM, records).await;
        }
        if measure && want("run") {
            kinesis_records("warmup-run".into(), HeaderFormat::Auto, None).await;
        }
        if measure && want("run_1000") {
            kinesis_records("warmup-run-1000".into(), HeaderFormat::Auto, Some(TABLE_READ_LIMIT)).await;
        }
        if measure && want("run_raw") {
            kinesis_records("warmup-raw".into(), HeaderFormat::None, None).await;
        }
        if measure && want("batches") {
            framework_batches(&memory, "warmup-batches", records).await;
        }
        if let (true, Some(arn)) = (measure, &table_arn) {
            if want("table_loop") {
                hand_loop(kinesis.clone(), arn, records).await;
            }
            if want("table_run") {
                table_records("warmup-table".into()).await;
            }
        }
        let (mut tlp, mut tab, mut tab_sd) = (vec![], vec![], vec![]);
        // CPU time of each iteration of the compared modes: loop, run, run_1000,
        // table_loop, table.
        let mut cpu: [Vec<Duration>; 5] = Default::default();

        let (mut lp, mut run, mut run_sd, mut bat, mut bat_sd) = (vec![], vec![], vec![], vec![], vec![]);
        let (mut raw, mut raw_sd, mut r1k, mut r1k_sd) = (vec![], vec![], vec![], vec![]);
        for i in 0..iters {
            // Interleaved so that drift on the shared machine hits every mode alike.
            if want("loop") {
                let (t, c) = on_cpu(hand_loop(kinesis.clone(), STREAM, records)).await;
                lp.push(t);
                cpu[0].extend(c);
            }
            if want("run") {
                let (t, c) = on_cpu(kinesis_records(format!("run-{i}"), HeaderFormat::Auto, None)).await;
                cpu[1].extend(c);
                run.push(t.handled);
                run_sd.push(t.shutdown);
            }
            if want("run_1000") {
                let (t, c) =
                    on_cpu(kinesis_records(format!("run-1000-{i}"), HeaderFormat::Auto, Some(TABLE_READ_LIMIT))).await;
                cpu[2].extend(c);
                r1k.push(t.handled);
                r1k_sd.push(t.shutdown);
            }
            if want("run_raw") {
                let t = kinesis_records(format!("raw-{i}"), HeaderFormat::None, None).await;
                raw.push(t.handled);
                raw_sd.push(t.shutdown);
            }
            if want("batches") {
                let t = framework_batches(&memory, &format!("batches-{i}"), records).await;
                bat.push(t.handled);
                bat_sd.push(t.shutdown);
            }
            if let Some(arn) = &table_arn {
                if want("table_loop") {
                    let (t, c) = on_cpu(hand_loop(kinesis.clone(), arn, records)).await;
                    tlp.push(t);
                    cpu[3].extend(c);
                }
                if want("table_run") {
                    let (t, c) = on_cpu(table_records(format!("table-{i}"))).await;
                    cpu[4].extend(c);
                    tab.push(t.handled);
                    tab_sd.push(t.shutdown);
                }
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
        let mut kinesis_overhead = [None, None];
        for (name, times, shutdowns) in [
            ("run", &mut run, &mut run_sd),
            ("run_1000", &mut r1k, &mut r1k_sd),
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
                Some(b) => {
                    let overhead = overhead_ns(records, m, b);
                    match name {
                        "run" => kinesis_overhead[0] = Some(overhead),
                        "run_1000" => kinesis_overhead[1] = Some(overhead),
                        _ => {}
                    }
                    println!(
                        "\n               overhead vs loop: {overhead:+.0} ns/record, ratio {:.2}x  (target: < 1000 ns/record)",
                        m.as_secs_f64() / b.as_secs_f64()
                    )
                }
                None => println!(),
            }
        }
        let table_base = (!tlp.is_empty()).then(|| show("table_loop", &mut tlp));
        if !tab.is_empty() {
            let tm = show("table", &mut tab);
            print!(
                "               graceful shutdown after the last record: {:.1} ms",
                median(&mut tab_sd).as_secs_f64() * 1e3,
            );
            match table_base {
                Some(tb) => println!(
                    "\n               overhead vs table_loop: {:+.0} ns/record, ratio {:.2}x",
                    overhead_ns(records, tm, tb),
                    tm.as_secs_f64() / tb.as_secs_f64()
                ),
                None => println!(),
            }
            if let Some(tb) = table_base {
                let table_overhead = overhead_ns(records, tm, tb);
                for (against, kinesis_overhead) in [
                    ("`run` (reads of up to 10,000)", kinesis_overhead[0]),
                    ("`run_1000` (reads of up to 1,000, as the table's)", kinesis_overhead[1]),
                ] {
                    if let Some(k) = kinesis_overhead {
                        println!(
                            "  table stream vs Kinesis stream {against}, per-record overhead: \
                             {table_overhead:+.0} vs {k:+.0} ns/record ({:+.1} %)  (target: within 10 % of `run`){}",
                            (table_overhead - k) * 100.0 / k,
                            if own_buffers { "" } else { "\n    (not like for like: the Kinesis records share one buffer; BENCH_MODE=table gives each its own)" }
                        );
                    }
                }
            }
        }
        // The same comparison in CPU time (every thread's time on a CPU): on a loaded
        // machine it moves less than the wall clock, which also counts the waits for a CPU.
        let [c_lp, c_run, c_r1k, c_tlp, c_tab] = cpu.each_mut().map(|v| (!v.is_empty()).then(|| median(v)));
        if let (Some(tl), Some(tr)) = (c_tlp, c_tab) {
            let table_cpu = overhead_ns(records, tr, tl);
            println!(
                "  CPU time per record: table_loop {:.0} ns, table {:.0} ns: overhead {table_cpu:+.0} ns/record",
                tl.as_secs_f64() * 1e9 / records as f64,
                tr.as_secs_f64() * 1e9 / records as f64,
            );
            for (name, framework) in [("run", c_run), ("run_1000", c_r1k)] {
                if let (Some(l), Some(f)) = (c_lp, framework) {
                    let k = overhead_ns(records, f, l);
                    println!(
                        "  CPU time per record: loop {:.0} ns, {name} {:.0} ns: overhead {k:+.0} ns/record; \
                         the table's {table_cpu:+.0} is {:+.1} %",
                        l.as_secs_f64() * 1e9 / records as f64,
                        f.as_secs_f64() * 1e9 / records as f64,
                        (table_cpu - k) * 100.0 / k
                    );
                }
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
