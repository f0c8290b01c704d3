//! Metrics, the health signal and the cost of the defaults, on the memory backend under
//! tokio's paused clock. Each test runs its own current-thread runtime inside a local
//! `metrics` recorder, so tests running in parallel never see each other's series.

use std::future::Future;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use metrics_exporter_prometheus::{PrometheusBuilder, PrometheusHandle};
use shardflow::kinesis::StreamAdmin;
use shardflow::memory::LeaseFaults;
use shardflow::metrics as names;
use shardflow::{Consumer, Memory, Message, Running};

use testkit::{produce, within, Recorder};

/// Runs `test` on a paused current-thread runtime with a recorder of its own.
fn with_metrics<F: Future<Output = ()>>(test: impl FnOnce(PrometheusHandle) -> F) {
    let recorder = PrometheusBuilder::new().build_recorder();
    let handle = recorder.handle();
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .start_paused(true)
        .build()
        .unwrap();
    metrics::with_local_recorder(&recorder, || runtime.block_on(test(handle)));
}

/// One series of a Prometheus text rendering: name, labels, value.
type Series = (String, Vec<(String, String)>, f64);

/// The series of a Prometheus text rendering.
fn series(m: &PrometheusHandle) -> Vec<Series> {
    m.render()
        .lines()
        .filter(|l| !l.starts_with('#') && !l.trim().is_empty())
        .filter_map(|line| {
            let (key, value) = line.rsplit_once(' ')?;
            let (name, labels) = match key.split_once('{') {
                Some((name, rest)) => (name, rest.trim_end_matches('}')),
                None => (key, ""),
            };
            let labels = labels
                .split(',')
                .filter_map(|kv| kv.split_once('='))
                .map(|(k, v)| (k.to_owned(), v.trim_matches('"').to_owned()))
                .collect();
            Some((name.to_owned(), labels, value.parse().ok()?))
        })
        .collect()
}

/// The sum of every series named `name` (histograms and summaries: `name_count`) whose
/// labels include all of `with`.
fn total(m: &PrometheusHandle, name: &str, with: &[(&str, &str)]) -> f64 {
    let count = format!("{name}_count");
    series(m)
        .into_iter()
        .filter(|(n, ..)| *n == name || *n == count)
        .filter(|(_, labels, _)| {
            with.iter()
                .all(|(k, v)| labels.iter().any(|(lk, lv)| lk == k && lv == v))
        })
        .map(|(.., value)| value)
        .sum()
}

/// The distinct values of label `label` on the series named `name`.
fn label_values(m: &PrometheusHandle, name: &str, label: &str) -> Vec<String> {
    let mut values: Vec<String> = series(m)
        .into_iter()
        .filter(|(n, ..)| n == name)
        .flat_map(|(_, labels, _)| labels.into_iter().filter(|(k, _)| k == label))
        .map(|(_, v)| v)
        .collect();
    values.sort();
    values.dedup();
    values
}

/// A worker of group "billing" on stream "orders" at the default configuration, recording
/// what it handles.
fn start_at_defaults(memory: &Memory, seed: u64) -> (Running, Recorder) {
    let recorder = Recorder::default();
    let running = Consumer::builder()
        .stream("orders")
        .group("billing")
        .worker_id("w1")
        .seed(seed)
        .backend(memory.clone())
        .build()
        .unwrap()
        .run(testkit::recording_handler(recorder.clone()))
        .spawn();
    (running, recorder)
}

const LIMIT: Duration = Duration::from_secs(120);

#[test]
fn metrics_count_records_checkpoints_leases_and_requests() {
    with_metrics(|m| async move {
        let memory = Memory::new();
        memory.streams().create_stream("orders", 2).await.unwrap();
        produce(memory.streams().as_ref(), "orders", 0..500).await;
        let bytes: usize = (0..500).map(|v: usize| v.to_string().len()).sum();
        let (running, recorder) = start_at_defaults(&memory, 3);
        recorder.wait_for(500, LIMIT).await;
        assert_eq!(total(&m, names::LEASES_HELD, &[("group", "billing")]), 2.0);
        assert_eq!(
            total(&m, names::LEASE_EVENTS, &[("event", "taken")]),
            2.0,
            "two unowned leases taken"
        );
        let shards = label_values(&m, names::MILLIS_BEHIND_LATEST, "shard");
        assert_eq!(shards.len(), 2, "lag per shard: {shards:?}");
        within(LIMIT, "shutdown", running.shutdown()).await.unwrap();

        let handled = total(&m, names::RECORDS_HANDLED, &[("stream", "orders")]);
        assert_eq!(handled, 500.0);
        assert_eq!(label_values(&m, names::RECORDS_HANDLED, "shard"), shards);
        assert_eq!(total(&m, names::BYTES_HANDLED, &[]), bytes as f64);
        assert_eq!(
            total(&m, names::HANDLER_DURATION, &[]),
            500.0,
            "one sample per handler call"
        );
        assert!(total(&m, names::BATCH_RECORDS, &[]) >= 2.0);
        assert_eq!(total(&m, names::RECORDS_IN_FLIGHT, &[]), 0.0);
        assert_eq!(total(&m, names::LEASES_HELD, &[]), 0.0, "released");
        assert_eq!(total(&m, names::HANDLER_ERRORS, &[]), 0.0);
        // The last checkpoint of each shard is written at shutdown at the latest.
        let ok = total(&m, names::CHECKPOINT_WRITES, &[("outcome", "ok")]);
        assert!((2.0..=6.0).contains(&ok), "checkpoint writes: {ok}");
        assert_eq!(total(&m, names::CHECKPOINT_DURATION, &[]), ok);
        assert!(total(&m, names::REQUESTS, &[("op", "GetRecords")]) >= 2.0);
        assert_eq!(
            total(&m, names::REQUESTS, &[("service", "dynamodb")]),
            memory.table("billing").requests() as f64,
            "every lease store call counted"
        );
    });
}

#[test]
fn handler_errors_and_restarts_are_counted() {
    with_metrics(|m| async move {
        let memory = Memory::new();
        memory.streams().create_stream("orders", 1).await.unwrap();
        produce(memory.streams().as_ref(), "orders", 0..50).await;
        let recorder = Recorder::default();
        let failed = Arc::new(AtomicBool::new(false));
        let handler = {
            let (recorder, failed) = (recorder.clone(), failed.clone());
            tower::service_fn(move |msg: Message| {
                let fail = &msg.payload[..] == b"20" && !failed.swap(true, Ordering::SeqCst);
                if !fail {
                    recorder.record(&msg);
                }
                async move {
                    if fail {
                        Err("the first attempt at 20 fails")
                    } else {
                        Ok(())
                    }
                }
            })
        };
        let consumer = testkit::test_consumer(memory.clone(), "orders", "billing", "w1")
            .build()
            .unwrap();
        let running = consumer.run(handler).spawn();
        recorder.wait_for(50, LIMIT).await;
        within(LIMIT, "shutdown", running.shutdown()).await.unwrap();
        assert_eq!(
            total(&m, names::HANDLER_ERRORS, &[("group", "billing")]),
            1.0
        );
        assert_eq!(total(&m, names::HANDLER_RETRIES, &[]), 1.0);
        assert_eq!(total(&m, names::HANDLER_DURATION, &[]), 51.0);
    });
}

/// Polls `cond` every 100 ms of (paused) time for at most `limit`.
async fn eventually(limit: Duration, what: &str, mut cond: impl FnMut() -> bool) {
    within(limit, what, async {
        while !cond() {
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    })
    .await
}

#[test]
fn health_says_when_shards_fail_and_when_the_lease_table_is_out_of_reach() {
    with_metrics(|_| async move {
        let memory = Memory::new();
        memory.streams().create_stream("orders", 2).await.unwrap();
        produce(memory.streams().as_ref(), "orders", 0..20).await;
        let recorder = Recorder::default();
        let broken = Arc::new(AtomicBool::new(true));
        let handler = {
            let (recorder, broken) = (recorder.clone(), broken.clone());
            tower::service_fn(move |msg: Message| {
                let fail = broken.load(Ordering::SeqCst);
                if !fail {
                    recorder.record(&msg);
                }
                async move {
                    if fail {
                        Err("downstream is down")
                    } else {
                        Ok::<_, &str>(())
                    }
                }
            })
        };
        let consumer = testkit::test_consumer(memory.clone(), "orders", "billing", "w1")
            .build()
            .unwrap();
        let running = consumer.run(handler).spawn();
        eventually(LIMIT, "both shards failing", || {
            let h = running.health();
            h.shards.len() == 2 && h.shards.iter().all(|s| s.failing())
        })
        .await;
        let health = running.health();
        assert!(health.is_live(), "{health:?}");
        assert!(!health.is_ready(), "{health:?}");
        assert_eq!(
            health.shards[0].last_error.as_deref(),
            Some("downstream is down")
        );

        broken.store(false, Ordering::SeqCst);
        recorder.wait_for(20, LIMIT).await;
        eventually(LIMIT, "ready again", || running.health().is_ready()).await;
        assert!(running
            .health()
            .shards
            .iter()
            .all(|s| s.failures_in_a_row == 0));

        // The lease table stops answering: within a lease duration the worker is no
        // longer live (its leases are about to expire), and says so.
        memory.table("billing").set_faults(LeaseFaults {
            throttle: 1.0,
            ..LeaseFaults::default()
        });
        eventually(LIMIT, "not live", || !running.health().is_live()).await;
        let health = running.health();
        assert!(!health.is_ready());
        assert!(health.lease_table_ok_ago >= Some(health.lease_duration));
        memory.table("billing").set_faults(LeaseFaults::default());
        drop(running);
    });
}

/// What one worker costs over ten minutes at the default configuration, on four shards:
/// (GetRecords per shard per second, checkpoint writes per shard per minute).
async fn cost_at_defaults(m: &PrometheusHandle, busy: bool) -> (f64, f64) {
    const SHARDS: u32 = 4;
    let memory = Memory::new();
    memory
        .streams()
        .create_stream("orders", SHARDS)
        .await
        .unwrap();
    let (running, recorder) = start_at_defaults(&memory, 11);
    // Start-up: every shard leased and read once.
    eventually(LIMIT, "every shard leased", || {
        running.health().shards.len() == SHARDS as usize
    })
    .await;
    let reads_before = total(m, names::REQUESTS, &[("op", "GetRecords")]);
    let writes_before = total(m, names::CHECKPOINT_WRITES, &[]);
    let minutes = 10u64;
    let mut written = 0;
    for _ in 0..minutes * 60 * 10 {
        if busy {
            // 100 records per second over the four shards.
            produce(memory.streams().as_ref(), "orders", written..written + 10).await;
            written += 10;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    recorder.wait_for(written, LIMIT).await;
    let reads = total(m, names::REQUESTS, &[("op", "GetRecords")]) - reads_before;
    let writes = total(m, names::CHECKPOINT_WRITES, &[]) - writes_before;
    drop(running);
    let seconds = (minutes * 60) as f64;
    (
        reads / SHARDS as f64 / seconds,
        writes / SHARDS as f64 / minutes as f64,
    )
}

#[test]
fn an_idle_shard_writes_no_checkpoints_and_is_read_once_a_second() {
    with_metrics(|m| async move {
        let (reads, writes) = cost_at_defaults(&m, false).await;
        assert_eq!(writes, 0.0, "checkpoint writes per shard per minute");
        assert!(
            (0.9..=1.01).contains(&reads),
            "GetRecords per shard per second: {reads}"
        );
    });
}

#[test]
fn a_busy_shard_writes_a_checkpoint_at_most_every_five_seconds() {
    with_metrics(|m| async move {
        let (reads, writes) = cost_at_defaults(&m, true).await;
        assert!(
            (10.0..=12.1).contains(&writes),
            "checkpoint writes per shard per minute: {writes}"
        );
        assert!(reads <= 1.01, "GetRecords per shard per second: {reads}");
    });
}

/// Refuses every checkpoint write while `refuse` is set (renewals and takes go through,
/// so the worker keeps its lease and only stops committing).
struct RefusedCheckpoints {
    refuse: Arc<AtomicBool>,
}

#[async_trait::async_trait]
impl testkit::hooks::Hooks for RefusedCheckpoints {
    async fn before_lease(
        &self,
        op: &'static str,
        _: Option<&str>,
    ) -> Result<(), shardflow::lease::LeaseError> {
        if op == "checkpoint" && self.refuse.load(Ordering::SeqCst) {
            return Err(shardflow::lease::LeaseError::Other(
                "checkpoint writes refused".to_owned().into(),
            ));
        }
        Ok(())
    }
}

/// The checkpoint age the worker reports for the stream's shards (the oldest).
fn checkpoint_age(m: &PrometheusHandle) -> Option<f64> {
    series(m)
        .into_iter()
        .filter(|(n, ..)| n == names::CHECKPOINT_AGE)
        .map(|(.., v)| v)
        .reduce(f64::max)
}

/// The checkpoint age an operator alerts on: an idle shard (nothing to commit for ten
/// minutes) reports a current checkpoint, not ten minutes; a worker whose checkpoint
/// writes fail while it handles records reports an age that keeps growing, which falls
/// back once a write lands; a shard no longer read reports 0.
#[test]
fn checkpoint_age_ignores_idle_shards_and_grows_while_commits_fail() {
    with_metrics(|m| async move {
        let memory = Memory::new();
        memory.streams().create_stream("orders", 1).await.unwrap();
        let refuse = Arc::new(AtomicBool::new(false));
        let recorder = Recorder::default();
        let hooked = testkit::hooks::Hooked::new(
            memory.clone(),
            RefusedCheckpoints {
                refuse: refuse.clone(),
            },
        );
        // The defaults: a checkpoint at most every 5 s.
        let running = Consumer::builder()
            .stream("orders")
            .group("billing")
            .worker_id("w1")
            .seed(5)
            .backend(hooked)
            .build()
            .unwrap()
            .run(testkit::recording_handler(recorder.clone()))
            .spawn();
        let interval = 5.0;
        eventually(LIMIT, "the shard leased", || {
            running.health().shards.len() == 1
        })
        .await;
        produce(memory.streams().as_ref(), "orders", 0..10).await;
        recorder.wait_for(10, LIMIT).await;

        // Ten idle minutes: nothing to commit, so the checkpoint is current.
        tokio::time::sleep(Duration::from_secs(600)).await;
        let idle = checkpoint_age(&m).expect("a checkpoint age per shard");
        assert!(idle <= interval, "idle shard's checkpoint age: {idle} s");

        // Records handled, every write refused: the age grows past the interval.
        refuse.store(true, Ordering::SeqCst);
        produce(memory.streams().as_ref(), "orders", 10..20).await;
        recorder.wait_for(20, LIMIT).await;
        tokio::time::sleep(Duration::from_secs(60)).await;
        let stale = checkpoint_age(&m).unwrap();
        assert!(
            (60.0 - interval..=60.0 + 2.0 * interval).contains(&stale),
            "checkpoint age while writes fail: {stale} s"
        );
        assert!(total(&m, names::CHECKPOINT_WRITES, &[("outcome", "error")]) >= 1.0);

        // Writes land again: the age falls back within an interval or two.
        refuse.store(false, Ordering::SeqCst);
        eventually(Duration::from_secs(30), "a current checkpoint", || {
            checkpoint_age(&m).is_some_and(|age| age <= interval)
        })
        .await;

        within(LIMIT, "shutdown", running.shutdown()).await.unwrap();
        assert_eq!(checkpoint_age(&m), Some(0.0), "no age for a shard not read");
        // The row keeps the time of its last checkpoint write.
        let rows = memory.table("billing").rows();
        assert!(
            rows.iter().all(|r| r.checkpointed_at.is_some()),
            "checkpointedAt on every row: {rows:?}"
        );
    });
}

// The Grafana dashboard (docs/grafana/shardflow.json) queries only names the code records
// and docs/metrics.md documents.

/// PromQL words that are not metric names: aggregation modifiers, set operators and the
/// like (functions are recognised by the `(` after them).
const PROMQL_WORDS: &[&str] = &[
    "by",
    "without",
    "on",
    "ignoring",
    "group_left",
    "group_right",
    "and",
    "or",
    "unless",
    "bool",
    "offset",
    "inf",
    "nan",
];

/// The metric names a PromQL expression selects: every identifier outside label
/// matchers (`{...}`), ranges (`[...]`), strings and label lists (`by (...)`), that is
/// neither a function (followed by `(`), a PromQL word nor a `$variable`.
fn promql_metric_names(expr: &str) -> Vec<String> {
    let chars: Vec<char> = expr.chars().collect();
    let mut names = Vec::new();
    let mut i = 0;
    // Set after a modifier whose parenthesised list holds label names.
    let mut labels_follow = false;
    while i < chars.len() {
        let c = chars[i];
        let skip_to = |close: char, from: usize| {
            let mut j = from + 1;
            while j < chars.len() && chars[j] != close {
                j += 1;
            }
            j + 1
        };
        match c {
            '{' => i = skip_to('}', i),
            '[' => i = skip_to(']', i),
            '"' | '\'' | '`' => i = skip_to(c, i),
            '(' if labels_follow => {
                labels_follow = false;
                i = skip_to(')', i);
            }
            '$' => {
                i += 1;
                while i < chars.len() && (chars[i].is_alphanumeric() || chars[i] == '_') {
                    i += 1;
                }
            }
            c if c.is_ascii_alphabetic() || c == '_' || c == ':' => {
                let start = i;
                while i < chars.len()
                    && (chars[i].is_ascii_alphanumeric() || chars[i] == '_' || chars[i] == ':')
                {
                    i += 1;
                }
                let word: String = chars[start..i].iter().collect();
                let rest: String = chars[i..].iter().collect();
                let rest = rest.trim_start();
                // A function or an aggregation (`sum(`, `sum by (..) (`) is no name.
                let applied = rest.starts_with('(')
                    || ["by", "without"].iter().any(|m| {
                        rest.strip_prefix(m)
                            .is_some_and(|r| r.trim_start().starts_with('('))
                    });
                let lower = word.to_ascii_lowercase();
                // Only a list right after the modifier holds label names.
                labels_follow = false;
                if [
                    "by",
                    "without",
                    "on",
                    "ignoring",
                    "group_left",
                    "group_right",
                ]
                .contains(&lower.as_str())
                {
                    labels_follow = true;
                } else if !applied && !PROMQL_WORDS.contains(&lower.as_str()) {
                    names.push(word);
                }
            }
            c if c.is_ascii_digit() || c == '.' => {
                // A number (or a duration such as `5m`): not a name.
                while i < chars.len() && (chars[i].is_ascii_alphanumeric() || chars[i] == '.') {
                    i += 1;
                }
            }
            _ => i += 1,
        }
    }
    names
}

/// Every PromQL expression of a dashboard: the `expr` of each panel's targets (rows
/// included) and each query variable's query.
fn dashboard_queries(dashboard: &serde_json::Value) -> Vec<String> {
    fn walk(value: &serde_json::Value, out: &mut Vec<String>) {
        match value {
            serde_json::Value::Object(map) => {
                for (key, v) in map {
                    match (key.as_str(), v) {
                        ("expr", serde_json::Value::String(e)) => out.push(e.clone()),
                        ("query", serde_json::Value::String(q)) if q.contains('(') => {
                            // A variable's `label_values(metric, label)`: the metric.
                            let inner = q
                                .strip_prefix("label_values(")
                                .and_then(|q| q.rsplit_once(','))
                                .map_or(q.as_str(), |(m, _)| m);
                            out.push(inner.to_owned());
                        }
                        _ => walk(v, out),
                    }
                }
            }
            serde_json::Value::Array(items) => items.iter().for_each(|v| walk(v, out)),
            _ => {}
        }
    }
    let mut out = Vec::new();
    walk(dashboard, &mut out);
    out
}

/// The metric names the code records: every `pub const NAME: &str = "..."` of the two
/// modules where all names live (`shardflow::metrics`, `shardflow_middleware::metrics`).
fn recorded_names() -> Vec<String> {
    let root = env!("CARGO_MANIFEST_DIR");
    let mut names = Vec::new();
    for file in ["src/metrics.rs", "middleware/src/metrics.rs"] {
        let source = std::fs::read_to_string(format!("{root}/{file}")).unwrap();
        for line in source.lines() {
            let line = line.trim();
            if let Some(rest) = line.strip_prefix("pub const ") {
                if let Some((_, value)) = rest.split_once(": &str = \"") {
                    names.push(value.trim_end_matches("\";").to_owned());
                }
            }
        }
    }
    names
}

/// The names a dashboard queries that the code does not record or docs/metrics.md does
/// not document (in its table, as `` `name` ``), each with what is missing. A histogram's
/// `_sum`, `_count` and `_bucket` series count as the histogram.
fn unknown_metrics(dashboard: &serde_json::Value, recorded: &[String], doc: &str) -> Vec<String> {
    let mut unknown = Vec::new();
    for query in dashboard_queries(dashboard) {
        for name in promql_metric_names(&query) {
            let base = ["_bucket", "_sum", "_count"]
                .iter()
                .find_map(|suffix| {
                    name.strip_suffix(suffix)
                        .filter(|b| recorded.iter().any(|r| r == b))
                })
                .unwrap_or(&name)
                .to_owned();
            if !recorded.contains(&base) {
                unknown.push(format!("{name}: not recorded by the code"));
            } else if !doc.contains(&format!("| `{base}` |")) {
                unknown.push(format!("{name}: not documented in docs/metrics.md"));
            }
        }
    }
    unknown.sort();
    unknown.dedup();
    unknown
}

fn dashboard() -> serde_json::Value {
    let path = format!("{}/docs/grafana/shardflow.json", env!("CARGO_MANIFEST_DIR"));
    serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap()
}

fn metrics_doc() -> String {
    std::fs::read_to_string(format!("{}/docs/metrics.md", env!("CARGO_MANIFEST_DIR"))).unwrap()
}

#[test]
fn promql_names_are_told_from_functions_labels_and_variables() {
    assert_eq!(
        promql_metric_names(
            r#"sum by (stream, shard) (rate(shardflow_records_handled_total{stream=~"$stream", group="a b"}[$__rate_interval] offset 5m)) / on (shard) group_left max(up) > bool 0.5"#
        ),
        ["shardflow_records_handled_total", "up"]
    );
    assert_eq!(
        promql_metric_names("histogram_quantile(0.99, sum by (le) (rate(x_bucket[5m])))"),
        ["x_bucket"]
    );
    assert!(promql_metric_names("vector(1) * 2e3").is_empty());
}

#[test]
fn every_metric_the_dashboard_queries_is_recorded_and_documented() {
    let recorded = recorded_names();
    // The parser found the names of both modules.
    assert!(recorded.iter().any(|n| n == names::CHECKPOINT_AGE));
    assert!(recorded
        .iter()
        .any(|n| n == shardflow_middleware::metrics::DEAD_LETTERS));
    let dashboard = dashboard();
    let queried: Vec<String> = dashboard_queries(&dashboard)
        .iter()
        .flat_map(|q| promql_metric_names(q))
        .collect();
    // What operators were promised on the dashboard.
    for promised in [
        names::MILLIS_BEHIND_LATEST,
        names::CHECKPOINT_AGE,
        names::SHARD_THROUGHPUT_BYTES,
        names::WORKER_LOAD_BYTES,
        names::BALANCE_IMBALANCE_RATIO,
        names::SHARDS_STUCK,
        names::HANDLER_ERRORS,
        names::LEADER_UNKNOWN,
        shardflow_middleware::metrics::DEAD_LETTERS,
    ] {
        assert!(
            queried.iter().any(|q| q == promised),
            "{promised} is not on the dashboard"
        );
    }
    assert_eq!(
        unknown_metrics(&dashboard, &recorded, &metrics_doc()),
        Vec::<String>::new()
    );
}

#[test]
fn a_dashboard_query_of_an_unknown_metric_is_reported() {
    let mut dashboard = dashboard();
    let first = &mut dashboard["panels"][1]["targets"][0]["expr"];
    let expr = first.as_str().unwrap().to_owned();
    assert!(expr.contains("shardflow_millis_behind_latest"), "{expr}");
    *first = expr
        .replace(
            "shardflow_millis_behind_latest",
            "shardflow_milis_behind_latest",
        )
        .into();
    let doc = metrics_doc().replace("| `shardflow_leader_unknown` |", "| leader unknown |");
    assert_eq!(
        unknown_metrics(&dashboard, &recorded_names(), &doc),
        [
            "shardflow_leader_unknown: not documented in docs/metrics.md",
            "shardflow_milis_behind_latest: not recorded by the code",
        ]
    );
}
