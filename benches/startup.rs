//! Start-up cost of a consumer, the workload of the start-up targets in BENCHMARKS.md: 4 shards,
//! 40,000 records of 100 bytes already in the stream, one worker of a new consumer group
//! with the default configuration.
//!
//! ```text
//! cargo bench --bench startup
//! ```
//!
//! Measured per iteration (a fresh consumer group, so a fresh lease table), from
//! `Consumer::builder()` (the backend already constructed):
//! * time until the first record is handled, and until all 40,000 are;
//! * the process's CPU time (user + system, from `/proc/self/stat`, 10 ms resolution)
//!   over that span — the consumer's CPU, the emulators run in other processes;
//! * lease-store requests until all records are handled, and after the graceful shutdown
//!   (which commits the final checkpoints and releases the leases).
//!
//! Always runs on the memory backend (requests from `memory.table(name).requests()`).
//! When `AWS_ENDPOINT_URL_KINESIS` is set, also runs against those endpoints through
//! `Aws::from_env()` (meant for kinesalite + dynalite; see BENCHMARKS.md), twice:
//! * `cold`: the consumer creates its lease table (dynalite keeps a new table CREATING
//!   for `--createTableMs`, 500 ms by default);
//! * `warm`: the lease table exists, without rows (as for a group deployed before).
//!
//! There, requests are counted twice: by a counting `Backend` wrapper around the lease
//! store (one per `LeaseStore` call) and by an interceptor on the DynamoDB client (one per
//! HTTP attempt: this includes DescribeTable polls, Scan pages and SDK retries).
//!
//! On the emulators it also times the floor: all shards read straight through `KinesisApi`
//! without any lease work, which is as fast as any consumer can get there.
//!
//! Environment knobs: `BENCH_ITERS` (default 5), `BENCH_RECORDS` (default 40000),
//! `BENCH_READ_LIMIT` (sets `max_records_per_read`, default: the consumer's default),
//! `BENCH_IDLE_MS` (sets `idle_read_interval`, default: the consumer's default),
//! `BENCH_LOG` (a tracing filter such as `shardflow=debug`: prints the consumer's timeline),
//! `BENCH_TIMELINE=1` (on the emulators: prints, for the last run of each case, when each
//! lease-store and Kinesis call before the first record was sent and answered),
//! `BENCH_LEADER=coordinator` (on the emulators: the group's leader item in a table of its
//! own beside the lease table, as for a table taken over from a KCL older than 3.5).
//!
//! On the emulators it also prints when the lease table was ready (its `ensure_table`
//! returned) and how long after that the first record was handled.
//!
//! Without `--bench` among its arguments (`cargo bench` passes it; `cargo test
//! --all-targets` runs this binary without), it makes a smoke run instead: the memory
//! backend only (never the emulators, even when their endpoints are set), 400 records,
//! one warm-up and one timed iteration, `BENCH_ITERS` and `BENCH_RECORDS` ignored.

mod common;
use testkit::hooks;

use common::*;
use hooks::{HookedKinesis, HookedStore, Hooks};
use std::collections::BTreeMap;
use std::future::ready;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use async_trait::async_trait;
use shardflow::kinesis::KinesisApi;
use shardflow::lease::{LeaseError, LeaseStore};
use shardflow::{Aws, Backend, Consumer, Memory, Message};
use tokio::sync::Notify;

/// User + system CPU time of this process so far. `/proc` reports it in USER_HZ ticks,
/// which Linux fixes at 100 per second for user space.
fn cpu_time() -> Duration {
    let stat = std::fs::read_to_string("/proc/self/stat").expect("read /proc/self/stat");
    // Fields after the command name (which may contain spaces) start at field 3 (state).
    let rest = &stat[stat.rfind(')').expect("stat format") + 2..];
    let fields: Vec<&str> = rest.split_whitespace().collect();
    let ticks: u64 = fields[11].parse::<u64>().unwrap() + fields[12].parse::<u64>().unwrap();
    Duration::from_millis(ticks * 10)
}

// ---------------------------------------------------------------------------------------
// Counting lease-store calls: a Backend wrapper.

const OPS: [&str; 15] = [
    "ensure_table",
    "list",
    "get",
    "create",
    "take",
    "renew",
    "checkpoint",
    "release",
    "request_handoff",
    "withdraw_handoff",
    "delete",
    "request_reset",
    "reset",
    "claim_for_stream",
    "record_children",
];

/// Lease-store calls per operation (indexes into `OPS`), when the lease table was
/// last ready (its `ensure_table` returned), and (`BENCH_TIMELINE=1`) the timeline of
/// every lease-store and Kinesis call: when each was sent and answered.
#[derive(Default)]
struct CallCounts(
    [AtomicU64; OPS.len()],
    Mutex<Option<Instant>>,
    Mutex<Vec<(Instant, &'static str, &'static str)>>,
);

/// The calls kept for the timeline of one run (the first ones are those before the
/// first record; the rest is the backlog being read).
const TIMELINE_CAP: usize = 400;

fn timeline_on() -> bool {
    std::env::var("BENCH_TIMELINE").is_ok_and(|v| v == "1")
}

impl CallCounts {
    fn bump(&self, op: usize) {
        self.0[op].fetch_add(1, Ordering::Relaxed);
    }
    fn total(&self) -> u64 {
        self.0.iter().map(|c| c.load(Ordering::Relaxed)).sum()
    }
    fn reset(&self) {
        self.0.iter().for_each(|c| c.store(0, Ordering::Relaxed));
        *self.1.lock().unwrap() = None;
        self.2.lock().unwrap().clear();
    }
    fn mark(&self, what: &'static str, op: &'static str) {
        let mut timeline = self.2.lock().unwrap();
        if timeline.len() < TIMELINE_CAP {
            timeline.push((Instant::now(), what, op));
        }
    }
    /// Prints the calls made before the first record was handled, as offsets from
    /// the start of the run.
    fn print_timeline(&self, start: Instant, first: Instant) {
        let ms = |t: Instant| t.saturating_duration_since(start).as_secs_f64() * 1e3;
        println!("    timeline of the last run (ms from Consumer::builder()):");
        for (at, what, op) in self
            .2
            .lock()
            .unwrap()
            .iter()
            .filter(|(at, ..)| *at <= first)
        {
            println!("      {:>7.1}  {what:<8} {op}", ms(*at));
        }
        println!("      {:>7.1}  first record handled", ms(first));
    }
    fn table_ready(&self) -> Option<Instant> {
        *self.1.lock().unwrap()
    }
    fn breakdown(&self) -> String {
        OPS.iter()
            .zip(&self.0)
            .map(|(op, c)| (op, c.load(Ordering::Relaxed)))
            .filter(|(_, n)| *n > 0)
            .map(|(op, n)| format!("{op} {n}"))
            .collect::<Vec<_>>()
            .join(", ")
    }
}

/// A backend whose lease stores count every call; Kinesis calls are only timed (for the
/// timeline).
struct CountingBackend {
    inner: Arc<dyn Backend>,
    calls: Arc<CallCounts>,
}

impl Backend for CountingBackend {
    fn kinesis(&self) -> Arc<dyn KinesisApi> {
        Arc::new(HookedKinesis {
            inner: self.inner.kinesis(),
            hooks: self.calls.clone(),
        })
    }

    fn lease_store(&self, table: &str) -> Arc<dyn LeaseStore> {
        Arc::new(HookedStore {
            inner: self.inner.lease_store(table),
            hooks: self.calls.clone(),
        })
    }
}

#[async_trait]
impl Hooks for CallCounts {
    async fn before_lease(&self, op: &'static str, _: Option<&str>) -> Result<(), LeaseError> {
        if let Some(i) = OPS.iter().position(|o| *o == op) {
            self.bump(i);
        }
        if timeline_on() {
            self.mark("sent", op);
        }
        Ok(())
    }

    async fn before_kinesis(
        &self,
        op: &'static str,
    ) -> Result<(), shardflow::kinesis::KinesisError> {
        if timeline_on() {
            self.mark("sent", op);
        }
        Ok(())
    }

    async fn after_kinesis(&self, op: &'static str) {
        if timeline_on() {
            self.mark("answered", op);
        }
    }

    async fn after_lease(
        &self,
        op: &'static str,
        _: Option<&str>,
        _: Option<&shardflow::lease::Lease>,
    ) {
        if op == "ensure_table" {
            *self.1.lock().unwrap() = Some(Instant::now());
        }
        if timeline_on() {
            self.mark("answered", op);
        }
    }
}

mod http_count {
    use super::*;
    use aws_sdk_dynamodb::config::interceptors::BeforeTransmitInterceptorContextRef;
    use aws_sdk_dynamodb::config::{ConfigBag, Intercept, RuntimeComponents};
    use aws_sdk_dynamodb::error::BoxError;

    /// DynamoDB requests per operation (`X-Amz-Target`, e.g. `UpdateItem`).
    #[derive(Debug, Default, Clone)]
    pub struct HttpCounts(pub Arc<Mutex<BTreeMap<String, u64>>>);

    impl HttpCounts {
        pub fn total(&self) -> u64 {
            self.0.lock().unwrap().values().sum()
        }
        pub fn reset(&self) {
            self.0.lock().unwrap().clear();
        }
        pub fn breakdown(&self) -> String {
            self.0
                .lock()
                .unwrap()
                .iter()
                .map(|(op, n)| format!("{op} {n}"))
                .collect::<Vec<_>>()
                .join(", ")
        }
    }

    impl Intercept for HttpCounts {
        fn name(&self) -> &'static str {
            "HttpCounts"
        }

        fn read_before_transmit(
            &self,
            context: &BeforeTransmitInterceptorContextRef<'_>,
            _: &RuntimeComponents,
            _: &mut ConfigBag,
        ) -> Result<(), BoxError> {
            let op = context
                .request()
                .headers()
                .get("x-amz-target")
                .and_then(|t| t.rsplit('.').next())
                .unwrap_or("?")
                .to_owned();
            *self.0.lock().unwrap().entry(op).or_default() += 1;
            Ok(())
        }
    }
}
use http_count::HttpCounts;

// ---------------------------------------------------------------------------------------

struct Progress {
    expected: u64,
    count: AtomicU64,
    first: Mutex<Option<Instant>>,
    all: Mutex<Option<Instant>>,
    cpu_at_all: Mutex<Option<Duration>>,
    done: Notify,
}

impl Progress {
    fn handled(&self) {
        let n = self.count.fetch_add(1, Ordering::Relaxed) + 1;
        if n == 1 {
            *self.first.lock().unwrap() = Some(Instant::now());
        }
        if n == self.expected {
            *self.all.lock().unwrap() = Some(Instant::now());
            *self.cpu_at_all.lock().unwrap() = Some(cpu_time());
            self.done.notify_one();
        }
    }
}

struct Sample {
    /// When the run started (`Consumer::builder()`) and its first record was handled.
    start: Instant,
    first_at: Instant,
    first: Duration,
    /// From the start to the lease table being ready (its `ensure_table` returned),
    /// where the backend reports it.
    table_ready: Option<Duration>,
    all: Duration,
    cpu: Duration,
    shutdown: Duration,
    requests_at_all: u64,
    requests_after_shutdown: u64,
}

/// One consumer of a new group over `backend`; `requests` reads the lease-store count.
async fn consume(
    stream: &str,
    group: &str,
    backend: impl Backend,
    records: u64,
    requests: impl Fn() -> u64,
    table_ready: impl Fn() -> Option<Instant>,
) -> Sample {
    let progress = Arc::new(Progress {
        expected: records,
        count: AtomicU64::new(0),
        first: Mutex::new(None),
        all: Mutex::new(None),
        cpu_at_all: Mutex::new(None),
        done: Notify::new(),
    });
    let p = progress.clone();
    let service = tower::service_fn(move |_msg: Message| {
        p.handled();
        ready(Ok::<_, std::convert::Infallible>(()))
    });
    let requests_before = requests();
    let cpu_start = cpu_time();
    let start = Instant::now();
    let mut builder = Consumer::builder()
        .stream(stream)
        .group(group)
        .backend(backend);
    if let Ok(n) = std::env::var("BENCH_READ_LIMIT") {
        builder = builder.max_records_per_read(n.parse().expect("BENCH_READ_LIMIT"));
    }
    if let Ok(ms) = std::env::var("BENCH_IDLE_MS") {
        builder =
            builder.idle_read_interval(Duration::from_millis(ms.parse().expect("BENCH_IDLE_MS")));
    }
    let consumer = builder.build().expect("config");
    let handle = consumer.shutdown_handle();
    let run = tokio::spawn(async move { consumer.run(service).await });
    let limit = Duration::from_secs(300);
    if tokio::time::timeout(limit, progress.done.notified())
        .await
        .is_err()
    {
        panic!(
            "only {} of {records} records handled after {limit:?}",
            progress.count.load(Ordering::Relaxed)
        );
    }
    let requests_at_all = requests() - requests_before;
    let handled_all = progress.all.lock().unwrap().unwrap();
    handle.shutdown();
    run.await.expect("join").expect("consumer");
    let shutdown = handled_all.elapsed();
    let first = progress.first.lock().unwrap().unwrap();
    let cpu_at_all = progress.cpu_at_all.lock().unwrap().unwrap();
    Sample {
        start,
        first_at: first,
        first: first - start,
        table_ready: table_ready().map(|t| t - start),
        all: handled_all - start,
        cpu: cpu_at_all - cpu_start,
        shutdown,
        requests_at_all,
        requests_after_shutdown: requests() - requests_before,
    }
}

/// The floor under any consumer: every shard read at once straight through `KinesisApi`
/// (GetShardIterator at TRIM_HORIZON, then GetRecords until an empty page), no leases.
/// Returns (time to the first record, time to all records).
async fn direct_reads(
    kinesis: Arc<dyn KinesisApi>,
    stream: &str,
    records: u64,
    limit: u32,
) -> (Duration, Duration) {
    let count = Arc::new(AtomicU64::new(0));
    let first = Arc::new(Mutex::new(None::<Instant>));
    let start = Instant::now();
    let shards = kinesis.list_shards(stream).await.expect("list shards");
    let tasks: Vec<_> = shards
        .into_iter()
        .map(|shard| {
            let (kinesis, count, first, stream) = (
                kinesis.clone(),
                count.clone(),
                first.clone(),
                stream.to_owned(),
            );
            tokio::spawn(async move {
                let from = shardflow::kinesis::StartingPosition::TrimHorizon;
                let mut it = kinesis
                    .shard_iterator(&stream, &shard.shard_id, &from)
                    .await
                    .expect("iterator");
                loop {
                    let page = kinesis.get_records(&it, limit).await.expect("get records");
                    if page.records.is_empty() {
                        return;
                    }
                    first.lock().unwrap().get_or_insert_with(Instant::now);
                    count.fetch_add(page.records.len() as u64, Ordering::Relaxed);
                    match page.next_iterator {
                        Some(next) => it = next,
                        None => return,
                    }
                }
            })
        })
        .collect();
    for t in tasks {
        t.await.expect("join");
    }
    assert_eq!(count.load(Ordering::Relaxed), records);
    let first = first.lock().unwrap().unwrap();
    (first - start, start.elapsed())
}

/// GetRecords limit: the consumer's default (10,000) unless `BENCH_READ_LIMIT` is set.
fn read_limit() -> u32 {
    env_or("BENCH_READ_LIMIT", 10_000)
}

fn median_by<T: Copy + PartialOrd>(samples: &[Sample], f: impl Fn(&Sample) -> T) -> T {
    let mut v: Vec<T> = samples.iter().map(f).collect();
    v.sort_by(|a, b| a.partial_cmp(b).unwrap());
    v[v.len() / 2]
}

fn report(label: &str, samples: &[Sample]) {
    let ms = |d: Duration| d.as_secs_f64() * 1e3;
    println!(
        "  {label}: {} iterations (medians; per-run values in brackets)",
        samples.len()
    );
    let runs = |f: &dyn Fn(&Sample) -> String| samples.iter().map(f).collect::<Vec<_>>().join(" ");
    println!(
        "    first record      {:>8.1} ms   target <= 500 ms    [{}]",
        ms(median_by(samples, |s| s.first)),
        runs(&|s| format!("{:.0}", ms(s.first)))
    );
    if samples.iter().all(|s| s.table_ready.is_some()) {
        let ready = |s: &Sample| s.table_ready.unwrap_or_default();
        let after = |s: &Sample| ms(s.first) - ms(ready(s));
        println!(
            "    lease table ready {:>8.1} ms; first record after it {:>6.1} ms   target <= 100 ms   [{}]",
            ms(median_by(samples, ready)),
            median_by(samples, after),
            runs(&|s| format!("{:.0}", after(s)))
        );
    }
    println!(
        "    all records       {:>8.1} ms   target <= 1500 ms   [{}]",
        ms(median_by(samples, |s| s.all)),
        runs(&|s| format!("{:.0}", ms(s.all)))
    );
    println!(
        "    consumer CPU      {:>8.0} ms   target <= 250 ms    [{}]",
        ms(median_by(samples, |s| s.cpu)),
        runs(&|s| format!("{:.0}", ms(s.cpu)))
    );
    println!(
        "    lease requests    {:>8}      target <= 40        [{}] until all handled; {} incl. shutdown",
        median_by(samples, |s| s.requests_at_all),
        runs(&|s| s.requests_at_all.to_string()),
        median_by(samples, |s| s.requests_after_shutdown),
    );
    println!(
        "    graceful shutdown {:>8.1} ms",
        ms(median_by(samples, |s| s.shutdown))
    );
}

async fn memory_backend(iters: usize, records: u64) {
    let memory = Memory::new();
    fill(memory.streams().as_ref(), "startup", records as usize).await;
    let mut samples = Vec::new();
    for i in 0..=iters {
        let group = format!("startup-memory-{i}");
        let table = memory.table(&group);
        let s = consume(
            "startup",
            &group,
            memory.clone(),
            records,
            || table.requests(),
            || None,
        )
        .await;
        if i > 0 {
            samples.push(s); // iteration 0 warms up
        }
    }
    report("memory backend (default config)", &samples);
}

async fn emulators(iters: usize, records: u64) {
    let endpoint = std::env::var("AWS_ENDPOINT_URL_KINESIS").unwrap_or_default();
    let t = Instant::now();
    let aws = Aws::from_env().await;
    let from_env = t.elapsed();
    let http = HttpCounts::default();
    let dynamodb = aws_sdk_dynamodb::Client::from_conf(
        aws.dynamodb_client()
            .config()
            .to_builder()
            .interceptor(http.clone())
            .build(),
    );
    // `BENCH_LEADER=coordinator`: the leader item in a table of its own beside the lease
    // table, as a table taken over from a KCL older than 3.5 keeps it (and as every
    // group kept it before the lease table held it).
    let placement = match std::env::var("BENCH_LEADER").as_deref() {
        Ok("coordinator") => shardflow::lease::dynamo::LeaderPlacement::CoordinatorTable,
        _ => shardflow::lease::dynamo::LeaderPlacement::Auto,
    };
    let aws =
        Aws::from_clients(aws.kinesis_client().clone(), dynamodb).with_leader_placement(placement);
    println!("  leader item placement: {placement:?}");
    let calls = Arc::new(CallCounts::default());
    let inner: Arc<dyn Backend> = Arc::new(aws.clone());
    let run_id = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs();
    let stream = format!("startup-{run_id}");
    let t = Instant::now();
    fill(aws.admin().unwrap().as_ref(), &stream, records as usize).await;
    println!(
        "emulators ({endpoint}, DynamoDB {}): Aws::from_env {:.1} ms; stream {stream} filled in {:.1} s",
        std::env::var("AWS_ENDPOINT_URL_DYNAMODB").unwrap_or_default(),
        from_env.as_secs_f64() * 1e3,
        t.elapsed().as_secs_f64()
    );
    let mut floor = Vec::new();
    for _ in 0..iters {
        floor.push(direct_reads(aws.kinesis(), &stream, records, read_limit()).await);
    }
    floor.sort();
    let (f, a) = floor[floor.len() / 2];
    println!(
        "  floor, direct GetShardIterator + GetRecords on all shards at once (no leases): \
         first record {:.1} ms, all records {:.1} ms (median of {iters}, sorted by first record)",
        f.as_secs_f64() * 1e3,
        a.as_secs_f64() * 1e3
    );
    for warm in [false, true] {
        let mut samples = Vec::new();
        let mut last = (String::new(), String::new());
        for i in 0..=iters {
            let group = format!(
                "startup-{run_id}-{}-{i}",
                if warm { "warm" } else { "cold" }
            );
            if warm {
                aws.lease_store(&group)
                    .ensure_table()
                    .await
                    .expect("create the lease table");
            }
            calls.reset();
            http.reset();
            let c = calls.clone();
            let s = consume(
                &stream,
                &group,
                CountingBackend {
                    inner: inner.clone(),
                    calls: calls.clone(),
                },
                records,
                move || c.total(),
                || calls.table_ready(),
            )
            .await;
            if timeline_on() && i == iters {
                calls.print_timeline(s.start, s.first_at);
            }
            last = (
                calls.breakdown(),
                format!("{} requests: {}", http.total(), http.breakdown()),
            );
            if i > 0 {
                samples.push(s);
            }
        }
        report(
            if warm {
                "emulators, lease table exists (warm)"
            } else {
                "emulators, consumer creates the lease table (cold)"
            },
            &samples,
        );
        println!("    last run, lease-store calls incl. shutdown: {}", last.0);
        println!("    last run, DynamoDB HTTP incl. shutdown:     {}", last.1);
    }
}

fn main() {
    let measure = measuring();
    let (iters, records): (usize, u64) = if measure {
        (env_or("BENCH_ITERS", 5), env_or("BENCH_RECORDS", 40_000))
    } else {
        println!("startup: smoke run (not a measurement: run `cargo bench --bench startup`)");
        (1, 400)
    };
    if let Ok(filter) = std::env::var("BENCH_LOG") {
        // A timeline of the consumer's own logs, e.g. BENCH_LOG=shardflow=debug.
        tracing_subscriber::fmt()
            .with_env_filter(tracing_subscriber::EnvFilter::new(filter))
            .with_timer(tracing_subscriber::fmt::time::uptime())
            .with_ansi(false)
            .init();
    }
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .expect("runtime");
    let threads = std::thread::available_parallelism()
        .map(|n| n.get())
        .unwrap_or(1);
    println!(
        "startup: {records} records x {RECORD_BYTES} B on {SHARDS} shards already in the stream; \
         one worker, new group, default config; {threads} CPUs; 1 warm-up + {iters} iterations{}",
        ["BENCH_READ_LIMIT", "BENCH_IDLE_MS"]
            .iter()
            .filter_map(|k| std::env::var(k).ok().map(|v| format!("; {k}={v}")))
            .collect::<String>()
    );
    runtime.block_on(async {
        memory_backend(iters, records).await;
        if !measure {
            println!("emulators: skipped in a smoke run");
        } else if std::env::var_os("AWS_ENDPOINT_URL_KINESIS").is_some() {
            emulators(iters, records).await;
        } else {
            println!("emulators: skipped (set AWS_ENDPOINT_URL_KINESIS, see BENCHMARKS.md)");
        }
    });
}
