//! A consumer group of real processes: workers of `examples/consumer_group.rs` against
//! the Kinesis and DynamoDB emulators that `scripts/test.sh` starts (skipped when
//! `SHARDFLOW_EMULATORS` is unset).
//!
//! An 8-shard stream and a producer writing continuously (values 0, 1, 2, ... with
//! partition keys `pk-{value % 64}`); four workers; then, one disruption at a time, each
//! followed by waiting until the group is balanced again:
//!
//! 1. SIGKILL one worker (a crash): its shards must be read again by the others;
//! 2. start two more workers, one after the other (scaling out);
//! 3. SIGTERM one worker (graceful: drain, checkpoint, release; exit 0);
//! 4. split one shard, then merge two;
//! 5. a steady-state window, in which DynamoDB requests are counted;
//! 6. the producer stops, every value must be printed, SIGTERM to everyone.
//!
//! Checked at the end: no value lost; per partition key, values first handled in the
//! order they were written (across hand-offs and the reshard); duplicates counted by
//! cause, none after the SIGTERM hand-off; leases balanced (each worker within one of
//! the fair share) after every step; every lease released at the end. Other repeats
//! (after the SIGKILL, or a lease taken from a worker too slow to renew) are counted
//! and shown, not refused: at-least-once allows them.
//!
//! Order across processes comes from the workers' own clock (`--timestamps` adds
//! `ts_us`, taken as each line is written; all workers share the machine's clock): the
//! moment the test reads a line from a pipe says nothing about the order between two
//! workers. Waits re-check their condition every 100 ms with a bounded timeout; a failed
//! wait is recorded and the run goes on, so one run shows every problem.
//!
//! The figures (start-up, time for a new worker to get its fair share, SIGKILL to
//! re-read, SIGTERM hand-off, DynamoDB requests per shard per minute) are written to
//! stderr even when the test passes. Run it alone with
//! `scripts/test.sh --test group_processes`. Worker logs go to
//! `target/tmp/group_processes/<stream>/` (kept when the test fails).

use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};
use std::future::Future;
use std::io::Write;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use shardflow::kinesis::{KinesisApi, PutOutcome, PutRecord, ShardInfo};
use shardflow::lease::{Checkpoint, Lease, LeaseStore};
use shardflow::{Aws, Backend};
use testkit::process::{now_us, Output, Printed, Worker};
use testkit::proxy::{delta, CountingProxy};
use testkit::{build_example, emulators_enabled, open_shards, unique};
use tokio::time::Instant;

const SHARDS: u32 = 8;
const KEYS: u64 = 64;
/// Short leases so fail-over takes seconds: renewal every second (a third).
const LEASE: Duration = Duration::from_secs(3);
/// One lease round.
const TAKE: Duration = Duration::from_secs(1);
/// The producer writes this many values every `PUT_EVERY` (~500 records/s): at most
/// 64 per call, so no key appears twice in a call and retrying the failed entries of
/// a call before the next call keeps every key's write order.
const PUT_VALUES: u64 = 25;
const PUT_EVERY: Duration = Duration::from_millis(50);
/// How long the group may take to settle after a change. Generous: a settle normally
/// takes a few lease rounds, but CI has 2 cores shared by 6 workers and 2 emulators.
const SETTLE_LIMIT: Duration = Duration::from_secs(60);
/// A crashed worker's shards must be read again within this (the figure's target is
/// lease duration + one round; detection can take up to two rounds, plus slack).
const FAILOVER_LIMIT: Duration = Duration::from_secs(10);
/// The steady-state window over which DynamoDB requests are counted.
const STEADY_WINDOW: Duration = Duration::from_secs(10);

fn secs(d: Duration) -> String {
    format!("{:.2} s", d.as_secs_f64())
}

fn us_secs(us: u64) -> String {
    format!("{:.2} s", us as f64 / 1e6)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn consumer_group_of_processes() {
    if !emulators_enabled() {
        return;
    }
    group_of_processes(None).await;
}

/// The same run with every worker reading through enhanced fan-out (`--fan-out`) against
/// kinesis-local: subscriptions change hands as the leases do. Skipped unless
/// `SHARDFLOW_FANOUT_KINESIS_ENDPOINT` is set (`scripts/test.sh` sets it).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn consumer_group_of_processes_with_enhanced_fan_out() {
    let Ok(endpoint) = std::env::var("SHARDFLOW_FANOUT_KINESIS_ENDPOINT") else {
        eprintln!("skipped: SHARDFLOW_FANOUT_KINESIS_ENDPOINT not set (run scripts/test.sh)");
        return;
    };
    group_of_processes(Some(endpoint)).await;
}

/// The scenario of the module docs; with `fan_out_endpoint`, Kinesis is that endpoint
/// (for the test and the workers) and the workers read through enhanced fan-out.
async fn group_of_processes(fan_out_endpoint: Option<String>) {
    let started = Instant::now();
    let stream = unique("group");
    let log_dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR"))
        .join("group_processes")
        .join(&stream);
    std::fs::create_dir_all(&log_dir).unwrap();
    let bin = build_example("consumer_group", &log_dir);
    let built = started.elapsed();

    let aws = match &fan_out_endpoint {
        None => Aws::from_env().await,
        Some(endpoint) => {
            let config = aws_config::load_defaults(aws_config::BehaviorVersion::latest()).await;
            let kinesis = aws_sdk_kinesis::Client::from_conf(
                aws_sdk_kinesis::config::Builder::from(&config)
                    .endpoint_url(endpoint)
                    .build(),
            );
            Aws::from_clients(kinesis, aws_sdk_dynamodb::Client::new(&config))
        }
    };
    let kinesis = aws.admin().unwrap();
    let group_name = format!("{stream}-g");
    kinesis.create_stream(&stream, SHARDS).await.unwrap();
    let proxy = std::env::var("AWS_ENDPOINT_URL_DYNAMODB")
        .ok()
        .and_then(|upstream| CountingProxy::start(&upstream));
    let mut g = Group {
        bin,
        stream: stream.clone(),
        group: group_name.clone(),
        dynamodb: proxy.as_ref().map(|p| p.url.clone()),
        fan_out: fan_out_endpoint.map(|endpoint| (format!("{stream}-efo"), endpoint)),
        output: Arc::default(),
        log_dir,
        workers: BTreeMap::new(),
        live: Vec::new(),
        store: aws.lease_store(&group_name),
        problems: Vec::new(),
    };
    let mut fig = Figures::default();
    let producer = Producer::start(kinesis.clone(), &stream);

    // 1. Four workers start together.
    let t = Instant::now();
    let t_us = now_us();
    for id in ["w1", "w2", "w3", "w4"] {
        g.spawn(id);
    }
    g.until_printed("a first record", SETTLE_LIMIT, |p| p.ts_us > t_us)
        .await;
    fig.first_record = g
        .first_print(|p| p.ts_us > t_us)
        .map(|ts| Duration::from_micros(ts - t_us));
    fig.startup_settled = g.until_settled("the start of four workers", t).await;

    // 2. SIGKILL one while it is reading its shards: they are read again once its
    //    leases expired.
    let killed = "w1";
    let dead_shards = g.until_reading(killed).await;
    let t = Instant::now();
    let kill_us = now_us();
    g.worker(killed).kill();
    g.live.retain(|w| w != killed);
    assert!(
        g.worker(killed)
            .wait_exit(Duration::from_secs(10))
            .await
            .is_some(),
        "{killed} did not die"
    );
    fig.sigkill_reread = g
        .reread_after(&dead_shards, killed, kill_us, "again after the SIGKILL")
        .await;
    fig.sigkill_settled = g.until_settled("the SIGKILL", t).await;
    let slowest = fig
        .sigkill_reread
        .iter()
        .map(|(_, us)| *us)
        .max()
        .unwrap_or(0);
    if Duration::from_micros(slowest) > FAILOVER_LIMIT {
        g.problem(format!(
            "a crashed worker's shard was read again only after {} (limit {FAILOVER_LIMIT:?})",
            us_secs(slowest)
        ));
    }

    // 3. Two more workers, one after the other: scaling out step by step, as an
    //    autoscaler does. The second joins a group where every worker already holds the
    //    rounded-up share (2, 2, 2, 2 of 8), so it must still get one lease.
    for id in ["w5", "w6"] {
        let t = Instant::now();
        let t_us = now_us();
        g.spawn(id);
        let share = g.until_fair_share(id, t_us).await.map(|()| t.elapsed());
        let settled = match share {
            Some(_) => g.until_settled(&format!("{id} joining"), t).await,
            None => None, // already reported; the group cannot be balanced without it
        };
        fig.newcomers.push((id.to_owned(), share, settled));
    }

    // 4. SIGTERM one while it is reading its shards: drain, checkpoint, release, exit
    //    0, and no record handled twice.
    let terminated = "w2";
    let handed_over = g.until_reading(terminated).await;
    let term_us = now_us();
    let t = Instant::now();
    g.worker(terminated).terminate();
    g.live.retain(|w| w != terminated);
    let status = g
        .worker(terminated)
        .wait_exit(Duration::from_secs(40))
        .await;
    match status {
        Some(s) if s.success() => fig.sigterm_exit = Some(t.elapsed()),
        other => g.problem(format!(
            "{terminated} after SIGTERM: {other:?} (expected exit 0)"
        )),
    }
    fig.sigterm_reread = g
        .reread_after(&handed_over, terminated, term_us, "after the SIGTERM")
        .await;
    fig.sigterm_settled = g.until_settled("the SIGTERM", t).await;

    // 5. Split the open shard with the most keys between two of them, then merge the
    //    last two open shards. A child is read only after its parents reached SHARD_END.
    let t = Instant::now();
    let open = open_shards(kinesis.as_ref(), &stream).await;
    let (parent, at) = split_point(&open[..open.len() - 2]);
    kinesis.split_shard(&stream, &parent, at).await.unwrap();
    let shards = kinesis.list_shards(&stream).await.unwrap();
    for child in shards.iter().filter(|s| s.parents().contains(&parent)) {
        let id = child.shard_id.clone();
        g.until_printed(&format!("split child {id} read"), SETTLE_LIMIT, |p| {
            *p.shard == id
        })
        .await;
    }
    let open = open_shards(kinesis.as_ref(), &stream).await;
    let (a, b) = (&open[open.len() - 2], &open[open.len() - 1]);
    kinesis
        .merge_shards(&stream, &a.shard_id, &b.shard_id)
        .await
        .unwrap();
    let shards = kinesis.list_shards(&stream).await.unwrap();
    for child in shards.iter().filter(|s| s.parents().contains(&a.shard_id)) {
        let id = child.shard_id.clone();
        g.until_printed(&format!("merged child {id} read"), SETTLE_LIMIT, |p| {
            *p.shard == id
        })
        .await;
    }
    fig.reshard_settled = g.until_settled("the split and merge", t).await;
    // The finished parents' rows stay at SHARD_END while their shards are listed, and
    // are released by their last owners: wait for that too, so the window below sees
    // only the steady work.
    g.until("the finished shards' leases released", SETTLE_LIMIT, |g| {
        let store = g.store.clone();
        async move {
            let rows = store.list().await.ok()?;
            rows.iter()
                .filter(|r| r.checkpoint == Checkpoint::ShardEnd)
                .all(|r| r.owner.is_none())
                .then_some(())
        }
    })
    .await;

    // 6. Steady state: nothing changes; count what the workers ask DynamoDB for. A fixed
    //    window because a rate needs one; the distribution must not move during it.
    let before_rows = g.rows().await;
    if let Some(proxy) = &proxy {
        let before = proxy.counts.snapshot();
        tokio::time::sleep(STEADY_WINDOW).await;
        let after = proxy.counts.snapshot();
        fig.steady = Some((
            delta(&before, &after),
            eligible(&before_rows).len(),
            g.live.len(),
        ));
    } else {
        tokio::time::sleep(STEADY_WINDOW).await;
    }
    let after_rows = g.rows().await;
    if distribution(&before_rows) != distribution(&after_rows) {
        g.problem(format!(
            "leases moved during the steady window: {:?} -> {:?}",
            distribution(&before_rows),
            distribution(&after_rows)
        ));
    }

    // 7. The producer stops; every value written must be printed.
    let total = producer.stop().await;
    g.until(
        "every produced value printed",
        Duration::from_secs(90),
        |g| {
            let done = {
                let printed = g.output.printed();
                let seen: HashSet<u64> = printed.iter().map(|p| p.value).collect();
                (0..total).all(|v| seen.contains(&v))
            };
            async move { done.then_some(()) }
        },
    )
    .await;

    // 8. SIGTERM everyone: each exits 0, every lease is released.
    let t = Instant::now();
    let last: Vec<String> = g.live.clone();
    for id in &last {
        g.worker(id).terminate();
    }
    for id in &last {
        match g.worker(id).wait_exit(Duration::from_secs(40)).await {
            Some(s) if s.success() => {}
            other => g.problem(format!("{id} after SIGTERM: {other:?} (expected exit 0)")),
        }
    }
    fig.final_shutdown = Some(t.elapsed());
    g.live.clear();
    for row in g.rows().await {
        if let Some(owner) = &row.owner {
            g.problem(format!(
                "lease {} still owned by {owner} after shutdown",
                row.key
            ));
        }
    }

    // 9. What was printed.
    let printed = g.output.printed().clone();
    for bad in g.output.bad_lines() {
        g.problem(format!("a stdout line that breaks the interface: {bad}"));
    }
    let analysis = analyse(&printed, total, killed, terminated, term_us);
    if analysis.lost > 0 {
        g.problem(format!(
            "{} of {total} values lost, e.g. {:?}",
            analysis.lost, analysis.lost_examples
        ));
    }
    if !analysis.order_violations.is_empty() {
        g.problem(format!(
            "{} partition-key order violations, e.g. {:?}",
            analysis.order_violations.len(),
            &analysis.order_violations[..analysis.order_violations.len().min(5)]
        ));
    }
    if analysis.dup_after_sigterm > 0 {
        g.problem(format!(
            "{} records handled again after the SIGTERM hand-off, e.g. {:?}",
            analysis.dup_after_sigterm, analysis.dup_examples
        ));
    }
    fig.total = total;
    fig.built = built;
    fig.elapsed = started.elapsed();
    let report = fig.report(&analysis);
    // Straight to the process's stderr: the figures show even when the test passes
    // (libtest captures only `print!`/`eprint!`).
    let _ = std::io::stderr().write_all(report.as_bytes());

    if g.problems.is_empty() {
        let _ = std::fs::remove_dir_all(&g.log_dir);
    }
    assert!(
        g.problems.is_empty(),
        "{} problem(s):\n  {}\nworker logs: {}",
        g.problems.len(),
        g.problems.join("\n  "),
        g.log_dir.display()
    );
}

/// The workers, their output, the lease table, and the problems found so far (the run
/// goes on after a soft failure so one run shows every problem).
struct Group {
    bin: PathBuf,
    stream: String,
    group: String,
    dynamodb: Option<String>,
    /// Enhanced fan-out: the stream consumer's name and the Kinesis endpoint.
    fan_out: Option<(String, String)>,
    output: Arc<Output>,
    log_dir: PathBuf,
    workers: BTreeMap<String, Worker>,
    live: Vec<String>,
    store: Arc<dyn LeaseStore>,
    problems: Vec<String>,
}

impl Group {
    fn spawn(&mut self, id: &str) {
        let ms = |d: Duration| d.as_millis().to_string();
        let args: Vec<String> = [
            "--stream",
            &self.stream,
            "--group",
            &self.group,
            "--worker",
            id,
            "--create-stream",
            &SHARDS.to_string(),
            "--lease-duration-ms",
            &ms(LEASE),
            "--take-interval-ms",
            &ms(TAKE),
            "--idle-read-interval-ms",
            "100",
            "--checkpoint-interval-ms",
            "500",
            "--shutdown-timeout-ms",
            "10000",
            "--timestamps",
        ]
        .iter()
        .map(|s| s.to_string())
        .collect();
        let mut env = Vec::new();
        if let Some(url) = &self.dynamodb {
            env.push(("AWS_ENDPOINT_URL_DYNAMODB", url.clone()));
        }
        let mut args = args;
        if let Some((name, endpoint)) = &self.fan_out {
            args.extend(["--fan-out".to_owned(), name.clone()]);
            env.push(("AWS_ENDPOINT_URL_KINESIS", endpoint.clone()));
        }
        if std::env::var_os("RUST_LOG").is_none() {
            env.push(("RUST_LOG", "warn,shardflow=info,consumer_group=info".into()));
        }
        let worker = Worker::spawn(
            &self.bin,
            id,
            &args,
            &env,
            self.log_dir.join(format!("{id}.log")),
            self.output.clone(),
        );
        self.workers.insert(id.to_owned(), worker);
        self.live.push(id.to_owned());
    }

    fn worker(&self, id: &str) -> &Worker {
        &self.workers[id]
    }

    fn problem(&mut self, problem: String) {
        eprintln!("PROBLEM: {problem}");
        self.problems.push(problem);
    }

    /// The lease table (read directly, not through the counting proxy).
    async fn rows(&self) -> Vec<Lease> {
        for _ in 0..50 {
            match self.store.list().await {
                Ok(rows) => return rows,
                Err(e) => {
                    eprintln!("listing leases: {e}; retrying");
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
            }
        }
        panic!("the lease table cannot be read");
    }

    /// Re-checks `check` until it holds, at most `limit`; records a problem and returns
    /// `None` on timeout. Re-checked every 100 ms: the lease table cannot be watched,
    /// and checking on every printed line (hundreds per second) would cost more than
    /// the workers.
    async fn until<T, F, Fut>(&mut self, what: &str, limit: Duration, mut check: F) -> Option<T>
    where
        F: FnMut(&Group) -> Fut,
        Fut: Future<Output = Option<T>>,
    {
        let deadline = Instant::now() + limit;
        loop {
            // A check that hangs (an emulator that stopped answering) counts as not yet.
            let left = deadline.saturating_duration_since(Instant::now());
            let checked = tokio::time::timeout(left.max(TAKE), check(self)).await;
            if let Ok(Some(t)) = checked {
                return Some(t);
            }
            if Instant::now() >= deadline {
                let rows = self.rows().await;
                let exited: Vec<String> = self
                    .workers
                    .values()
                    .filter_map(|w| w.exited().map(|s| format!("{}: {s}", w.id)))
                    .collect();
                self.problem(format!(
                    "timed out after {limit:?} waiting for {what}; leases {:?}; live {:?}; exited {exited:?}",
                    distribution(&rows),
                    self.live
                ));
                return None;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// Waits until some printed record satisfies `pred`.
    async fn until_printed(
        &mut self,
        what: &str,
        limit: Duration,
        pred: impl Fn(&Printed) -> bool,
    ) -> bool {
        let pred = &pred;
        self.until(what, limit, |g| {
            let found = g.output.printed().iter().any(pred);
            async move { found.then_some(()) }
        })
        .await
        .is_some()
    }

    /// Waits until each of `shards` is read by a worker other than `gone` after
    /// `since_us`; returns how long after `since_us` each was first read.
    async fn reread_after(
        &mut self,
        shards: &[String],
        gone: &str,
        since_us: u64,
        event: &str,
    ) -> Vec<(String, u64)> {
        let mut reread = Vec::new();
        for shard in shards {
            let by_other =
                |p: &Printed| &*p.shard == shard && &*p.worker != gone && p.ts_us > since_us;
            if self
                .until_printed(&format!("{shard} read {event}"), SETTLE_LIMIT, by_other)
                .await
            {
                if let Some(first) = self.first_print(by_other) {
                    reread.push((shard.clone(), first - since_us));
                }
            }
        }
        reread
    }

    /// The earliest handling time (`ts_us`) among the records satisfying `pred`.
    fn first_print(&self, pred: impl Fn(&Printed) -> bool) -> Option<u64> {
        self.output
            .printed()
            .iter()
            .filter(|p| pred(p))
            .map(|p| p.ts_us)
            .min()
    }

    /// Waits until every open lease is held by a live worker, each within one of the
    /// fair share, with no hand-off pending; returns the time since `since`.
    async fn until_settled(&mut self, after: &str, since: Instant) -> Option<Duration> {
        self.until(
            &format!("balanced leases after {after}"),
            SETTLE_LIMIT,
            |g| {
                let store = g.store.clone();
                let live = g.live.clone();
                async move {
                    let rows = store.list().await.ok()?;
                    settled(&rows, &live).then_some(())
                }
            },
        )
        .await
        .map(|()| since.elapsed())
    }

    /// Waits until `id` has printed records of every lease it holds, handled after
    /// this call (a lease just handed over is started at the next round); returns them.
    async fn until_reading(&mut self, id: &str) -> Vec<String> {
        let since_us = now_us();
        let id = id.to_owned();
        let found = self
            .until(&format!("{id} reading all its shards"), SETTLE_LIMIT, |g| {
                let store = g.store.clone();
                let output = g.output.clone();
                let id = id.clone();
                async move {
                    let rows = store.list().await.ok()?;
                    let mine = owned_by(&rows, &id);
                    let printed = output.printed();
                    let read = |shard: &String| {
                        printed
                            .iter()
                            .any(|p| *p.worker == *id && *p.shard == **shard && p.ts_us > since_us)
                    };
                    (!mine.is_empty() && mine.iter().all(read)).then_some(mine)
                }
            })
            .await;
        found.unwrap_or_default()
    }

    /// Waits until `id` holds at least the lower fair share (⌊open / live⌋) of leases and
    /// has printed records of that many of them since `since_us`.
    async fn until_fair_share(&mut self, id: &str, since_us: u64) -> Option<()> {
        let id = id.to_owned();
        self.until(
            &format!("{id} to hold and read its fair share"),
            SETTLE_LIMIT,
            |g| {
                let store = g.store.clone();
                let output = g.output.clone();
                let live = g.live.len();
                let id = id.clone();
                async move {
                    let rows = store.list().await.ok()?;
                    let share = eligible(&rows).len() / live;
                    let mine: BTreeSet<String> = owned_by(&rows, &id).into_iter().collect();
                    let read: BTreeSet<String> = output
                        .printed()
                        .iter()
                        .filter(|p| *p.worker == *id && p.ts_us > since_us)
                        .filter(|p| mine.contains(&*p.shard))
                        .map(|p| p.shard.to_string())
                        .collect();
                    (share > 0 && read.len() >= share).then_some(())
                }
            },
        )
        .await
    }
}

impl Drop for Group {
    fn drop(&mut self) {
        // The link to the example binary would keep a 250 MB file alive once cargo
        // replaces it; the logs are what a failure needs.
        let _ = std::fs::remove_file(&self.bin);
        if std::thread::panicking() || !self.problems.is_empty() {
            for w in self.workers.values() {
                eprintln!("--- {} (last log lines) ---\n{}", w.id, w.log_tail(30));
            }
            eprintln!("worker logs: {}", self.log_dir.display());
        }
    }
}

/// Leases that can be worked on: not finished, and every parent finished (or gone).
fn eligible(rows: &[Lease]) -> Vec<&Lease> {
    let by_key: HashMap<&str, &Lease> = rows.iter().map(|r| (r.key.as_str(), r)).collect();
    rows.iter()
        .filter(|r| r.checkpoint != Checkpoint::ShardEnd)
        .filter(|r| {
            r.parents.iter().all(|p| {
                by_key
                    .get(p.as_str())
                    .is_none_or(|p| p.checkpoint == Checkpoint::ShardEnd)
            })
        })
        .collect()
}

fn owned_by(rows: &[Lease], worker: &str) -> Vec<String> {
    eligible(rows)
        .into_iter()
        .filter(|r| r.owner.as_deref().map(shardflow::lease::worker_of) == Some(worker))
        .map(|r| r.key.clone())
        .collect()
}

/// Open leases per owner ("-" for none), for messages and steadiness.
fn distribution(rows: &[Lease]) -> BTreeMap<String, Vec<String>> {
    let mut by_owner: BTreeMap<String, Vec<String>> = BTreeMap::new();
    for r in eligible(rows) {
        let owner = r.owner.clone().unwrap_or_else(|| "-".into());
        let mut lease = r.key.trim_start_matches("shardId-").to_owned();
        if let Some(to) = &r.pending_owner {
            lease = format!("{lease}->{to}");
        }
        by_owner.entry(owner).or_default().push(lease);
    }
    by_owner
}

/// Every open lease held by a live worker, each live worker holding ⌊n/w⌋ or ⌈n/w⌉ of
/// the n open leases, and no hand-off pending.
fn settled(rows: &[Lease], live: &[String]) -> bool {
    let open = eligible(rows);
    if live.is_empty() || open.is_empty() {
        return false;
    }
    let (lo, hi) = (open.len() / live.len(), open.len().div_ceil(live.len()));
    let mut count: HashMap<&str, usize> = live.iter().map(|w| (w.as_str(), 0)).collect();
    for r in &open {
        if r.pending_owner.is_some() {
            return false;
        }
        match r
            .owner
            .as_deref()
            .and_then(|o| count.get_mut(shardflow::lease::worker_of(o)))
        {
            Some(n) => *n += 1,
            None => return false,
        }
    }
    count.values().all(|n| (lo..=hi).contains(n))
}

/// The hash key Kinesis gives a partition key: MD5 as a 128-bit big-endian number.
fn hash_key(pk: &str) -> u128 {
    u128::from_be_bytes(md5::compute(pk.as_bytes()).0)
}

/// The shard (among `candidates`) holding the most of the producer's keys, and a split
/// point with keys on both sides, so both children get records.
fn split_point(candidates: &[ShardInfo]) -> (String, u128) {
    let keys: Vec<u128> = (0..KEYS).map(|k| hash_key(&format!("pk-{k}"))).collect();
    let (shard, mut inside) = candidates
        .iter()
        .map(|s| {
            let inside: Vec<u128> = keys
                .iter()
                .copied()
                .filter(|h| (s.starting_hash_key..=s.ending_hash_key).contains(h))
                .collect();
            (s, inside)
        })
        .max_by_key(|(_, inside)| inside.len())
        .expect("a shard to split");
    assert!(inside.len() >= 2, "no shard holds two keys");
    inside.sort();
    (shard.shard_id.clone(), inside[inside.len() / 2])
}

/// Writes values 0, 1, 2, ... with partition keys `pk-{value % 64}` until stopped.
struct Producer {
    stop: Arc<AtomicBool>,
    produced: Arc<AtomicU64>,
    task: tokio::task::JoinHandle<()>,
}

impl Producer {
    fn start(kinesis: Arc<dyn KinesisApi>, stream: &str) -> Producer {
        let stop = Arc::new(AtomicBool::new(false));
        let produced = Arc::new(AtomicU64::new(0));
        let stream = stream.to_owned();
        let task = tokio::spawn({
            let (stop, produced) = (stop.clone(), produced.clone());
            async move {
                let mut tick = tokio::time::interval(PUT_EVERY);
                tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
                let mut next = 0u64;
                while !stop.load(Ordering::SeqCst) {
                    tick.tick().await;
                    put_all(kinesis.as_ref(), &stream, next..next + PUT_VALUES).await;
                    next += PUT_VALUES;
                    produced.store(next, Ordering::SeqCst);
                }
            }
        });
        Producer {
            stop,
            produced,
            task,
        }
    }

    /// Stops writing; returns how many values were written (0..n).
    async fn stop(self) -> u64 {
        self.stop.store(true, Ordering::SeqCst);
        let stopped = tokio::time::timeout(Duration::from_secs(60), self.task).await;
        stopped
            .expect("the producer stops within a minute")
            .expect("the producer failed");
        self.produced.load(Ordering::SeqCst)
    }
}

/// Stores every value of `values` (at most 64: each key once), retrying only the
/// entries that failed, before returning.
async fn put_all(kinesis: &dyn KinesisApi, stream: &str, values: std::ops::Range<u64>) {
    assert!(values.end - values.start <= KEYS);
    let mut pending: Vec<PutRecord> = values
        .map(|v| PutRecord {
            data: Bytes::from(v.to_string()),
            partition_key: format!("pk-{}", v % KEYS),
            explicit_hash_key: None,
        })
        .collect();
    for _ in 0..200 {
        match kinesis.put_records(stream, &pending).await {
            Ok(outcomes) => {
                pending = pending
                    .into_iter()
                    .zip(outcomes)
                    .filter(|(_, o)| matches!(o, PutOutcome::Failed { .. }))
                    .map(|(r, _)| r)
                    .collect();
                if pending.is_empty() {
                    return;
                }
            }
            Err(e) => eprintln!("put_records: {e}; retrying"),
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    panic!("could not write every record");
}

#[derive(Default)]
struct Analysis {
    prints: usize,
    distinct: usize,
    lost: usize,
    lost_examples: Vec<u64>,
    order_violations: Vec<String>,
    /// Extra prints of a value whose previous print was by the SIGKILLed worker.
    dup_after_sigkill: usize,
    /// Extra prints after the SIGTERM whose previous print was by the terminated worker.
    dup_after_sigterm: usize,
    /// Every other extra print (rebalancing, reshard, a lease taken from a slow worker).
    dup_other: usize,
    dup_examples: Vec<String>,
    other_examples: Vec<String>,
}

fn analyse(
    printed: &[Printed],
    total: u64,
    killed: &str,
    terminated: &str,
    term_us: u64,
) -> Analysis {
    let mut a = Analysis {
        prints: printed.len(),
        ..Analysis::default()
    };
    let mut in_order: Vec<&Printed> = printed.iter().collect();
    in_order.sort_by(|x, y| (x.ts_us, &x.worker).cmp(&(y.ts_us, &y.worker)));

    // Lost: written but never printed.
    let seen: HashSet<u64> = printed.iter().map(|p| p.value).collect();
    a.distinct = seen.len();
    let lost: Vec<u64> = (0..total).filter(|v| !seen.contains(v)).collect();
    a.lost = lost.len();
    a.lost_examples = lost.into_iter().take(5).collect();

    // Order: per key, values must be handled for the first time in increasing order
    // (the producer wrote each key's values in increasing order). Repeats are skipped.
    let mut first_seen = HashSet::new();
    let mut last_by_key: HashMap<&str, &Printed> = HashMap::new();
    for p in &in_order {
        if p.pk != format!("pk-{}", p.value % KEYS) {
            a.order_violations
                .push(format!("value {} printed with key {}", p.value, p.pk));
        }
        if !first_seen.insert(p.value) {
            continue;
        }
        if let Some(prev) = last_by_key.get(p.pk.as_str()) {
            if prev.value > p.value {
                a.order_violations.push(format!(
                    "{}: {} ({} on {}) before {} ({} on {})",
                    p.pk, prev.value, prev.worker, prev.shard, p.value, p.worker, p.shard
                ));
            }
        }
        last_by_key.insert(&p.pk, p);
    }

    // Duplicates, by the cause of each repeat: who printed the value just before.
    let mut by_value: HashMap<u64, Vec<&Printed>> = HashMap::new();
    for p in &in_order {
        by_value.entry(p.value).or_default().push(p);
    }
    for prints in by_value.values().filter(|v| v.len() > 1) {
        for pair in prints.windows(2) {
            let (prev, cur) = (pair[0], pair[1]);
            if &*prev.worker == killed {
                a.dup_after_sigkill += 1;
            } else if &*prev.worker == terminated && cur.ts_us >= term_us {
                a.dup_after_sigterm += 1;
                if a.dup_examples.len() < 5 {
                    a.dup_examples.push(format!(
                        "{} on {}: {} then {} {} later",
                        cur.value,
                        cur.shard,
                        prev.worker,
                        cur.worker,
                        us_secs(cur.ts_us - prev.ts_us)
                    ));
                }
            } else {
                a.dup_other += 1;
                if a.other_examples.len() < 5 {
                    a.other_examples.push(format!(
                        "{} on {}: {} then {} {} later",
                        cur.value,
                        cur.shard,
                        prev.worker,
                        cur.worker,
                        us_secs(cur.ts_us - prev.ts_us)
                    ));
                }
            }
        }
    }
    a
}

#[derive(Default)]
struct Figures {
    built: Duration,
    elapsed: Duration,
    total: u64,
    first_record: Option<Duration>,
    startup_settled: Option<Duration>,
    sigkill_reread: Vec<(String, u64)>,
    sigkill_settled: Option<Duration>,
    /// (worker, time to hold and read its fair share, time until the group settled)
    newcomers: Vec<(String, Option<Duration>, Option<Duration>)>,
    sigterm_exit: Option<Duration>,
    sigterm_reread: Vec<(String, u64)>,
    sigterm_settled: Option<Duration>,
    reshard_settled: Option<Duration>,
    final_shutdown: Option<Duration>,
    /// Requests by operation during the steady window, the open shards, the workers.
    steady: Option<(BTreeMap<String, u64>, usize, usize)>,
}

impl Figures {
    fn report(&self, a: &Analysis) -> String {
        let opt = |d: Option<Duration>| d.map_or("-".to_owned(), secs);
        let max_us = |v: &[(String, u64)]| v.iter().map(|(_, us)| *us).max();
        let mut r = String::new();
        let mut line = |s: String| {
            r.push_str("group_processes: ");
            r.push_str(&s);
            r.push('\n');
        };
        line(format!(
            "{} s in all ({} building the example); {} values written, {} lines printed",
            self.elapsed.as_secs(),
            secs(self.built),
            self.total,
            a.prints
        ));
        line(format!(
            "lost {} | distinct {} | repeats: {} after the SIGKILL, {} after the SIGTERM, {} other | key-order violations {}",
            a.lost,
            a.distinct,
            a.dup_after_sigkill,
            a.dup_after_sigterm,
            a.dup_other,
            a.order_violations.len()
        ));
        if !a.other_examples.is_empty() {
            line(format!("other repeats, e.g. {:?}", a.other_examples));
        }
        line(format!(
            "4 workers start: first record {}, balanced {}",
            opt(self.first_record),
            opt(self.startup_settled)
        ));
        line(format!(
            "SIGKILL -> its shards read again: max {} (target: lease {} + one round {} = {}), per shard {:?}; balanced {}",
            max_us(&self.sigkill_reread).map_or("-".into(), us_secs),
            secs(LEASE),
            secs(TAKE),
            secs(LEASE + TAKE),
            self.sigkill_reread
                .iter()
                .map(|(s, us)| format!("{}: {}", s.trim_start_matches("shardId-"), us_secs(*us)))
                .collect::<Vec<_>>(),
            opt(self.sigkill_settled)
        ));
        for (id, share, settled) in &self.newcomers {
            line(format!(
                "new worker {id}: holds and reads its fair share after {} (from spawn), group balanced after {}",
                opt(*share),
                opt(*settled)
            ));
        }
        line(format!(
            "SIGTERM: exit 0 after {}; its shards read again after max {}; balanced {}",
            opt(self.sigterm_exit),
            max_us(&self.sigterm_reread).map_or("-".into(), us_secs),
            opt(self.sigterm_settled)
        ));
        line(format!(
            "split + merge: children read and leases balanced {} after the split started; final SIGTERM of all: {}",
            opt(self.reshard_settled),
            opt(self.final_shutdown)
        ));
        if let Some((ops, shards, workers)) = &self.steady {
            let total: u64 = ops.values().sum();
            let per_min = 60.0 / STEADY_WINDOW.as_secs_f64();
            let per_shard = |n: u64| n as f64 * per_min / *shards as f64;
            line(format!(
                "steady state ({workers} workers, {shards} open shards, lease {}, round {}, checkpoint 500 ms): {:.0} DynamoDB requests per shard per minute ({})",
                secs(LEASE),
                secs(TAKE),
                per_shard(total),
                ops.iter()
                    .map(|(op, n)| format!("{op} {:.0}", per_shard(*n)))
                    .collect::<Vec<_>>()
                    .join(", ")
            ));
        }
        r
    }
}

/// `--metrics-addr`: a worker serves Prometheus text while records flow, and the series
/// agree with what it printed (records handled per shard, leases held, reads made, the
/// health gauges).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_serves_its_metrics_while_records_flow() {
    if !emulators_enabled() {
        return;
    }
    let stream = unique("metrics");
    let log_dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR"))
        .join("group_processes")
        .join(&stream);
    std::fs::create_dir_all(&log_dir).unwrap();
    let bin = build_example("consumer_group", &log_dir);
    let aws = Aws::from_env().await;
    aws.admin()
        .unwrap()
        .create_stream(&stream, 2)
        .await
        .unwrap();
    put_all(aws.kinesis().as_ref(), &stream, 0..60).await;
    // A free port: bound, then released for the worker.
    let addr = std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .unwrap();
    let args: Vec<String> = [
        "--stream",
        &stream,
        "--group",
        &format!("{stream}-g"),
        "--worker",
        "w1",
        "--metrics-addr",
        &addr.to_string(),
        "--timestamps",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    let output = Arc::new(Output::default());
    let worker = Worker::spawn(
        &bin,
        "w1",
        &args,
        &[],
        log_dir.join("w1.log"),
        output.clone(),
    );
    let limit = Duration::from_secs(60);
    let waited = tokio::time::timeout(limit, async {
        while output.printed().len() < 60 {
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    })
    .await;
    assert!(
        waited.is_ok(),
        "60 records printed: {}",
        worker.log_tail(20)
    );
    // More records flow while the endpoint is scraped: the counters only grow.
    put_all(aws.kinesis().as_ref(), &stream, 60..120).await;
    let scrape = || async {
        let mut conn = tokio::net::TcpStream::connect(addr).await?;
        tokio::io::AsyncWriteExt::write_all(
            &mut conn,
            b"GET /metrics HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n",
        )
        .await?;
        let mut body = String::new();
        tokio::io::AsyncReadExt::read_to_string(&mut conn, &mut body).await?;
        Ok::<_, std::io::Error>(body)
    };
    let value = |text: &str, name: &str, with: &str| -> f64 {
        text.lines()
            .filter(|l| l.starts_with(&format!("{name}{{")) || l.starts_with(&format!("{name} ")))
            .filter(|l| l.contains(with))
            .filter_map(|l| l.rsplit_once(' ')?.1.parse::<f64>().ok())
            .sum()
    };
    let mut text = String::new();
    let scraped = tokio::time::timeout(limit, async {
        loop {
            text = scrape().await.unwrap_or_default();
            // The handled count trails the printed lines by at most the batches in
            // flight, and the health gauges are set once a second.
            if value(&text, "shardflow_records_handled_total", "") >= 120.0
                && value(&text, "consumer_group_ready", "") == 1.0
            {
                return;
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    })
    .await;
    worker.terminate();
    let exit = worker.wait_exit(limit).await;
    assert!(scraped.is_ok(), "series never complete:\n{text}");
    assert!(text.contains("HTTP/1.1 200"), "{text}");
    let printed = output.printed().len() as f64;
    let handled = value(&text, "shardflow_records_handled_total", "");
    assert!(
        (120.0..=printed).contains(&handled),
        "handled {handled}, printed {printed}"
    );
    for shard in ["shardId-000000000000", "shardId-000000000001"] {
        let with = format!("shard=\"{shard}\"");
        assert!(
            value(&text, "shardflow_records_handled_total", &with) > 0.0,
            "{text}"
        );
        assert!(
            text.lines()
                .any(|l| l.starts_with("shardflow_millis_behind_latest{") && l.contains(&with)),
            "lag of {shard}: {text}"
        );
    }
    assert_eq!(value(&text, "shardflow_leases_held", ""), 2.0, "{text}");
    assert_eq!(
        value(&text, "shardflow_lease_events_total", "event=\"taken\""),
        2.0
    );
    assert!(value(&text, "shardflow_requests_total", "op=\"GetRecords\"") >= 2.0);
    assert!(value(&text, "shardflow_requests_total", "service=\"dynamodb\"") >= 4.0);
    assert_eq!(value(&text, "consumer_group_live", ""), 1.0);
    assert!(
        value(&text, "shardflow_handler_duration_seconds_count", "") >= 120.0,
        "{text}"
    );
    assert!(exit.is_some_and(|s| s.success()), "{}", worker.log_tail(20));
    eprintln!(
        "{}",
        text.lines()
            .filter(|l| l.starts_with("shardflow_") || l.starts_with("consumer_group_"))
            .collect::<Vec<_>>()
            .join("\n")
    );
}
