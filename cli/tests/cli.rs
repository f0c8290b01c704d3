//! The `shardflow` binary against the emulators (`scripts/test.sh` starts them and sets
//! the AWS endpoints): every subcommand, its output, its exit code and its effect on the
//! lease table and the streams.
use std::collections::BTreeMap;
use std::process::{Command, Stdio};
use std::time::{Duration, SystemTime};

use bytes::Bytes;
use serde_json::Value;
use shardflow::aggregation::Aggregator;
use shardflow::headers::HeaderFormat;
use shardflow::kinesis::{KinesisApi, PutRecord, StartingPosition};
use shardflow::lease::{Checkpoint, LeaseError, LeaseStore};
use shardflow::producer::Producer;
use shardflow::{Aws, Backend, Headers, Metadata};
use shardflow_middleware::dead_letter::{DeadLetterRecord, ProducerSink};
use shardflow_middleware::DeadLetterEnvelope;
use testkit::*;
use tower::ServiceExt;

/// How long one run of the binary may take before the test fails (and kills it).
const RUN_LIMIT: Duration = Duration::from_secs(120);
/// How long a test waits for records.
const LIMIT: Duration = Duration::from_secs(120);

/// What a run of the binary printed, and its exit code.
struct Out {
    code: i32,
    stdout: String,
    stderr: String,
}

impl Out {
    fn json(&self) -> Value {
        serde_json::from_str(&self.stdout)
            .unwrap_or_else(|e| panic!("not JSON ({e}): {}\nstderr: {}", self.stdout, self.stderr))
    }
}

/// Runs `shardflow ARGS` (the AWS settings come from the environment), bounded.
async fn run(args: &[&str]) -> Out {
    run_with(args, &[]).await
}

/// Runs `shardflow ARGS` with `env` set on top of the test's environment, bounded.
async fn run_with(args: &[&str], env: &[(&str, &str)]) -> Out {
    let mut child = tokio::process::Command::from({
        let mut c = Command::new(env!("CARGO_BIN_EXE_shardflow"));
        c.args(args)
            .envs(env.iter().copied())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .stdin(Stdio::null());
        c
    })
    .kill_on_drop(true)
    .spawn()
    .expect("start the binary");
    let (mut so, mut se) = (child.stdout.take().unwrap(), child.stderr.take().unwrap());
    let output = async {
        use tokio::io::AsyncReadExt;
        let (mut out, mut err) = (String::new(), String::new());
        let (a, b) = tokio::join!(so.read_to_string(&mut out), se.read_to_string(&mut err));
        a.unwrap();
        b.unwrap();
        let status = child.wait().await.unwrap();
        (status, out, err)
    };
    let (status, stdout, stderr) = within(RUN_LIMIT, &format!("shardflow {args:?}"), output).await;
    Out {
        code: status.code().unwrap_or(-1),
        stdout,
        stderr,
    }
}

/// `group describe --json --count` of the group `selection` names, asked again (each
/// answer samples for 1.5 s) until nothing is behind, at most 20 times; the answer.
async fn described_caught_up(selection: &[&str]) -> Value {
    let mut described = Value::Null;
    for _ in 0..20 {
        let mut args = vec!["group", "describe"];
        args.extend_from_slice(selection);
        args.extend(["--json", "--count", "--sample-ms", "1500"]);
        let out = run(&args).await;
        assert_eq!(out.code, 0, "{}", out.stderr);
        described = out.json();
        if described["records_behind"] == 0 {
            break;
        }
    }
    assert_eq!(described["records_behind"], 0, "{described}");
    described
}

/// The group's checkpoints once every row holds a record position: what the running
/// group handled is committed.
async fn committed_checkpoints(store: &dyn LeaseStore) -> BTreeMap<String, Checkpoint> {
    within(LIMIT, "the handled records checkpointed", async {
        loop {
            let now = checkpoints(&store.list().await.unwrap());
            if now.values().all(|c| matches!(c, Checkpoint::At(_))) {
                return now;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    })
    .await
}

fn group_consumer(aws: &Aws, stream: &str, group: &str) -> shardflow::Consumer {
    test_consumer(aws.clone(), stream, group, "w1")
        .build()
        .unwrap()
}

/// Every user record of a stream (all shards, oldest first), with its arrival time.
async fn read_all(kinesis: &dyn KinesisApi, stream: &str) -> Vec<(String, String, SystemTime)> {
    let mut out = Vec::new();
    for shard in kinesis.list_shards(stream).await.unwrap() {
        let mut it = kinesis
            .shard_iterator(stream, &shard.shard_id, &StartingPosition::TrimHorizon)
            .await
            .unwrap();
        loop {
            let page = kinesis.get_records(&it, 10_000).await.unwrap();
            let empty = page.records.is_empty();
            for r in page.records {
                let data = String::from_utf8(r.data.to_vec()).unwrap();
                out.push((data, r.partition_key, r.approximate_arrival.unwrap()));
            }
            match page.next_iterator {
                Some(next) if !empty => it = next,
                _ => break,
            }
        }
    }
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn describe_shows_owners_checkpoints_and_lag() {
    if !emulators_enabled() {
        return;
    }
    let aws = Aws::from_env().await;
    let kinesis = aws.admin().unwrap();
    let (stream, group) = (unique("cli-describe"), unique("cli-describe-g"));
    kinesis.create_stream(&stream, 2).await.unwrap();
    produce(kinesis.as_ref(), &stream, 0..40).await;
    let recorder = Recorder::default();
    let running = start(group_consumer(&aws, &stream, &group), &recorder);
    recorder.wait_for(40, LIMIT).await;

    // While the group runs: both shards owned by w1, renewed, nothing behind once the
    // checkpoints caught up.
    let described = described_caught_up(&["--stream", &stream, "--group", &group]).await;
    let shards = described["shards"].as_array().unwrap();
    assert_eq!(shards.len(), 2);
    for s in shards {
        assert_eq!(s["state"], "open");
        assert!(s["owner"].as_str().unwrap().starts_with("w1#"), "{s}");
        assert_eq!(s["renewing"], true, "{s}");
        assert_eq!(s["millis_behind_latest"], 0, "{s}");
        // Every record handled and committed: a checkpoint written moments ago, at the
        // shard's tip.
        let written = s["checkpointed_at_ms"].as_u64().expect("checkpointedAt");
        assert!(written > 1_700_000_000_000, "{s}");
        let age = s["checkpoint_age_ms"].as_u64().expect("age");
        assert!(age < LIMIT.as_millis() as u64, "{s}");
        assert_eq!(s["checkpoint_at_tip"], true, "{s}");
    }
    assert_eq!(described["workers"]["w1"], 2);
    running.stop().await;

    // Stopped, with 10 records written since: no owners, 10 records behind.
    produce(kinesis.as_ref(), &stream, 40..50).await;
    let out = run(&[
        "group",
        "describe",
        "--stream",
        &stream,
        "--group",
        &group,
        "--json",
        "--count",
        "--sample-ms",
        "0",
    ])
    .await;
    assert_eq!(out.code, 0, "{}", out.stderr);
    let described = out.json();
    assert_eq!(described["records_behind"], 10, "{described}");
    assert_eq!(described["workers"], serde_json::json!({}));
    // The shards that got new records have records after their checkpoint.
    let behind: Vec<&Value> = described["shards"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|s| s["records_behind"] != 0)
        .collect();
    assert!(!behind.is_empty(), "{described}");
    for s in behind {
        assert_eq!(s["checkpoint_at_tip"], false, "{s}");
        assert!(s["checkpoint_age_ms"].is_u64(), "{s}");
    }
    // The table for people names every shard and the summary.
    let out = run(&[
        "group",
        "describe",
        "--stream",
        &stream,
        "--group",
        &group,
        "--count",
        "--sample-ms",
        "0",
    ])
    .await;
    assert_eq!(out.code, 0, "{}", out.stderr);
    for s in shards {
        assert!(
            out.stdout.contains(s["shard"].as_str().unwrap()),
            "{}",
            out.stdout
        );
    }
    assert!(out.stdout.contains("ckpt age"), "{}", out.stdout);
    assert!(out.stdout.contains("2 shards, 0 workers"), "{}", out.stdout);
    assert!(out.stdout.contains("10 records behind"), "{}", out.stdout);
    // A group without a table is an error (exit 1), a bad option a usage error (2).
    let out = run(&[
        "group",
        "describe",
        "--stream",
        &stream,
        "--group",
        "no-such-group-table",
        "--sample-ms",
        "0",
    ])
    .await;
    assert_eq!(out.code, 1, "{}", out.stdout);
    assert!(out.stderr.contains("no-such-group-table"), "{}", out.stderr);
    let out = run(&["group", "describe", "--stream", &stream]).await;
    assert_eq!(out.code, 2, "{}", out.stderr);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reset_to_a_timestamp_while_the_group_runs() {
    if !emulators_enabled() {
        return;
    }
    let aws = Aws::from_env().await;
    let kinesis = aws.admin().unwrap();
    let (stream, group) = (unique("cli-reset"), unique("cli-reset-g"));
    kinesis.create_stream(&stream, 2).await.unwrap();
    produce(kinesis.as_ref(), &stream, 0..30).await;
    let recorder = Recorder::default();
    let running = start(group_consumer(&aws, &stream, &group), &recorder);
    recorder.wait_for(30, LIMIT).await;
    produce(kinesis.as_ref(), &stream, 30..60).await;
    recorder.wait_for(60, LIMIT).await;

    // The reset point: the earliest arrival of the second batch. Every record that
    // arrived at or after it must come again, none before it.
    let arrivals: BTreeMap<usize, SystemTime> = read_all(kinesis.as_ref(), &stream)
        .await
        .into_iter()
        .map(|(v, _, at)| (v.parse().unwrap(), at))
        .collect();
    let at = (30..60).map(|v| arrivals[&v]).min().unwrap();
    let at_ms = at
        .duration_since(SystemTime::UNIX_EPOCH)
        .unwrap()
        .as_millis()
        .to_string();
    let again: Vec<usize> = (0..60).filter(|v| arrivals[v] >= at).collect();
    assert!(
        again.len() < 60,
        "some records arrived before the reset point"
    );

    // The plan changes nothing (exit 3). Compared once the group committed what it
    // handled (the group keeps running and would move the checkpoints meanwhile).
    let store = aws.lease_store(&group);
    let before = committed_checkpoints(store.as_ref()).await;
    let out = run(&[
        "group",
        "reset",
        "--stream",
        &stream,
        "--group",
        &group,
        "--to",
        "timestamp",
        &at_ms,
    ])
    .await;
    assert_eq!(out.code, 3, "{}\n{}", out.stdout, out.stderr);
    assert!(out.stdout.contains("plan only"), "{}", out.stdout);
    assert_eq!(checkpoints(&store.list().await.unwrap()), before);

    // With --yes, while the group runs: each owner applies it.
    let out = run(&[
        "group",
        "reset",
        "--stream",
        &stream,
        "--group",
        &group,
        "--to",
        "timestamp",
        &at_ms,
        "--yes",
        "--json",
    ])
    .await;
    assert_eq!(out.code, 0, "{}", out.stderr);
    let done = out.json();
    for shard in done["reset"].as_array().unwrap() {
        assert_eq!(shard["how"], "requested from the owner", "{shard}");
    }
    recorder.wait_for(60 + again.len(), LIMIT).await;
    // A sentinel per shard: a shard is read in order, so once they arrived, whatever the
    // reset delivers again has been delivered.
    let shards = open_shards(kinesis.as_ref(), &stream).await;
    let sentinels = produce_sentinels(kinesis.as_ref(), &stream, &shards, 1000).await;
    recorder.wait_for_values(&sentinels, LIMIT).await;
    running.stop().await;
    let mut seen: BTreeMap<usize, usize> = BTreeMap::new();
    for h in recorder.snapshot() {
        *seen.entry(h.value).or_default() += 1;
    }
    for v in 0..60 {
        let expected = if again.contains(&v) { 2 } else { 1 };
        assert_eq!(
            seen[&v], expected,
            "value {v} (arrived {:?}, reset to {at:?})",
            arrivals[&v]
        );
    }
    for row in store.list().await.unwrap() {
        assert_eq!(row.reset_to, None, "{row:?}");
        assert!(matches!(row.checkpoint, Checkpoint::At(_)), "{row:?}");
        assert_eq!(row.owner, None, "{row:?}");
    }
    // The group stopped: the rows are unowned and changed at once.
    let out = run(&[
        "group",
        "reset",
        "--stream",
        &stream,
        "--group",
        &group,
        "--to",
        "trim-horizon",
        "--yes",
        "--json",
    ])
    .await;
    assert_eq!(out.code, 0, "{}", out.stderr);
    for shard in out.json()["reset"].as_array().unwrap() {
        assert_eq!(shard["how"], "applied", "{shard}");
    }
    for row in store.list().await.unwrap() {
        assert_eq!(row.checkpoint, Checkpoint::TrimHorizon, "{row:?}");
    }
    // A usage error: an unknown position.
    let out = run(&[
        "group",
        "reset",
        "--stream",
        &stream,
        "--group",
        &group,
        "--to",
        "yesterday",
    ])
    .await;
    assert_eq!(out.code, 2, "{}", out.stderr);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tail_splits_aggregates_and_follows_a_split() {
    if !emulators_enabled() {
        return;
    }
    let aws = Aws::from_env().await;
    let kinesis = aws.admin().unwrap();
    let stream = unique("cli-tail");
    kinesis.create_stream(&stream, 1).await.unwrap();
    produce(kinesis.as_ref(), &stream, 0..5).await;
    let mut aggregator = Aggregator::new();
    for v in 5..8 {
        let put = PutRecord {
            data: Bytes::from(v.to_string()),
            partition_key: format!("pk-{v}"),
            explicit_hash_key: None,
        };
        assert!(aggregator.add(put).unwrap().is_none());
    }
    kinesis
        .put_records(&stream, &[aggregator.flush().unwrap()])
        .await
        .unwrap();
    let parent = kinesis.list_shards(&stream).await.unwrap()[0].clone();
    kinesis
        .split_shard(&stream, &parent.shard_id, u128::MAX / 2)
        .await
        .unwrap();
    wait_until_active(kinesis.as_ref(), &stream).await;
    produce(kinesis.as_ref(), &stream, 8..20).await;

    let out = run(&[
        "stream",
        "tail",
        &stream,
        "--from",
        "trim-horizon",
        "--format",
        "json",
        "--limit",
        "20",
    ])
    .await;
    assert_eq!(out.code, 0, "{}", out.stderr);
    let lines: Vec<Value> = out
        .stdout
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    let mut values: Vec<usize> = lines
        .iter()
        .map(|l| l["data"].as_str().unwrap().parse().unwrap())
        .collect();
    values.sort();
    assert_eq!(values, (0..20).collect::<Vec<_>>());
    let aggregated: Vec<&Value> = lines.iter().filter(|l| l["aggregated"] == true).collect();
    assert_eq!(aggregated.len(), 3);
    assert_eq!(aggregated[2]["sub_sequence"], 2);
    assert_eq!(aggregated[1]["partition_key"], "pk-6");
    let children = lines
        .iter()
        .filter(|l| l["shard"] != parent.shard_id.as_str())
        .count();
    assert_eq!(
        children, 12,
        "the records after the split come from the children"
    );
    // Text and hex: one line per record with its metadata.
    let out = run(&[
        "stream",
        "tail",
        &stream,
        "--from",
        "trim-horizon",
        "--limit",
        "2",
        "--shard",
        &parent.shard_id,
    ])
    .await;
    assert_eq!(out.code, 0, "{}", out.stderr);
    assert_eq!(out.stdout.lines().count(), 2);
    assert!(
        out.stdout
            .lines()
            .all(|l| l.starts_with(parent.shard_id.as_str())),
        "{}",
        out.stdout
    );
    let out = run(&[
        "stream",
        "tail",
        &stream,
        "--from",
        "trim-horizon",
        "--limit",
        "1",
        "--format",
        "hex",
    ])
    .await;
    assert!(
        out.stdout.trim_end().ends_with(" 30"),
        "0 is 0x30: {}",
        out.stdout
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dlq_replay_republishes_with_the_original_partition_keys() {
    if !emulators_enabled() {
        return;
    }
    let aws = Aws::from_env().await;
    let kinesis = aws.admin().unwrap();
    let (orders, dlq) = (unique("cli-orders"), unique("cli-dlq"));
    kinesis.create_stream(&orders, 1).await.unwrap();
    kinesis.create_stream(&dlq, 1).await.unwrap();
    // Three dead letters through the default sink (a producer writes envelopes), and a
    // record that is not one.
    let producer = Producer::builder()
        .stream(&dlq)
        .backend(aws.clone())
        .build()
        .unwrap();
    for v in 0..3 {
        let record = DeadLetterRecord {
            metadata: Metadata::builder()
                .stream(orders.as_str())
                .partition_key(format!("customer-{v}"))
                .sequence_number(100u64 + v)
                .build(),
            payload: Bytes::from(format!("order-{v}")),
            error: "charge refused".into(),
            attempts: Some(3),
            headers: Headers::new(),
        };
        ProducerSink::new(producer.clone())
            .oneshot(record)
            .await
            .unwrap();
    }
    // The largest record Kinesis accepts: its dead letter takes two records.
    let big_key = "customer-big";
    let big = "b".repeat(shardflow::producer::MAX_RECORD_BYTES - big_key.len());
    let record = DeadLetterRecord {
        metadata: Metadata::builder()
            .stream(orders.as_str())
            .partition_key(big_key)
            .sequence_number(200u64)
            .build(),
        payload: Bytes::from(big.clone()),
        error: "too big to charge".into(),
        attempts: Some(3),
        headers: Headers::new(),
    };
    ProducerSink::new(producer.clone())
        .oneshot(record)
        .await
        .unwrap();
    producer.close().await;
    kinesis
        .put_records(
            &dlq,
            &[PutRecord {
                data: Bytes::from_static(b"not an envelope"),
                partition_key: "x".into(),
                explicit_hash_key: None,
            }],
        )
        .await
        .unwrap();

    // Tail shows them decoded.
    let out = run(&[
        "stream",
        "tail",
        &dlq,
        "--from",
        "trim-horizon",
        "--limit",
        "6",
    ])
    .await;
    assert_eq!(out.code, 0, "{}", out.stderr);
    assert_eq!(
        out.stdout.matches("dead-letter from").count(),
        3,
        "{}",
        out.stdout
    );
    for part in ["dead-letter part 1/2 from", "dead-letter part 2/2 from"] {
        assert_eq!(out.stdout.matches(part).count(), 1, "{part}");
    }
    assert!(
        out.stdout.contains("error=\"charge refused\": order-1"),
        "{}",
        out.stdout
    );

    let out = run(&["dlq", "replay", "--from", &dlq, "--to", &orders]).await;
    assert_eq!(out.code, 3, "{}", out.stderr);
    assert!(
        out.stdout.contains("would re-publish 4 dead letters"),
        "{}",
        out.stdout
    );
    assert!(
        read_all(kinesis.as_ref(), &orders).await.is_empty(),
        "the plan writes nothing"
    );

    let out = run(&[
        "dlq", "replay", "--from", &dlq, "--to", &orders, "--yes", "--json",
    ])
    .await;
    assert_eq!(out.code, 0, "{}", out.stderr);
    let summary = out.json();
    assert_eq!(
        (
            summary["published"].clone(),
            summary["not_envelopes"].clone(),
            summary["incomplete"].clone()
        ),
        (4.into(), 1.into(), 0.into())
    );
    let mut replayed: Vec<(String, String)> = read_all(kinesis.as_ref(), &orders)
        .await
        .into_iter()
        .map(|(data, key, _)| (data, key))
        .collect();
    replayed.sort();
    let mut expected: Vec<(String, String)> = (0..3)
        .map(|v| (format!("order-{v}"), format!("customer-{v}")))
        .collect();
    expected.push((big, big_key.to_owned()));
    expected.sort();
    assert!(replayed == expected, "the payloads and keys, byte-exact");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn delete_refuses_a_running_group_and_deletes_a_stopped_ones_table() {
    if !emulators_enabled() {
        return;
    }
    let aws = Aws::from_env().await;
    let kinesis = aws.admin().unwrap();
    let (stream, group) = (unique("cli-delete"), unique("cli-delete-g"));
    kinesis.create_stream(&stream, 1).await.unwrap();
    produce(kinesis.as_ref(), &stream, 0..5).await;
    let recorder = Recorder::default();
    let running = start(group_consumer(&aws, &stream, &group), &recorder);
    recorder.wait_for(5, LIMIT).await;
    let out = run(&[
        "group",
        "delete",
        "--stream",
        &stream,
        "--group",
        &group,
        "--yes",
        "--sample-ms",
        "1500",
    ])
    .await;
    assert_eq!(out.code, 1, "{}", out.stdout);
    assert!(out.stderr.contains("live"), "{}", out.stderr);
    running.stop().await;
    let store = aws.lease_store(&group);
    assert_eq!(
        store.list().await.unwrap().len(),
        1,
        "the refused delete kept the table"
    );

    let out = run(&[
        "group",
        "delete",
        "--stream",
        &stream,
        "--group",
        &group,
        "--sample-ms",
        "0",
    ])
    .await;
    assert_eq!(out.code, 3, "{}", out.stderr);
    assert_eq!(
        store.list().await.unwrap().len(),
        1,
        "the plan deleted nothing"
    );
    let out = run(&[
        "group",
        "delete",
        "--stream",
        &stream,
        "--group",
        &group,
        "--yes",
        "--sample-ms",
        "1500",
    ])
    .await;
    assert_eq!(out.code, 0, "{}", out.stderr);
    assert!(matches!(
        store.list().await,
        Err(LeaseError::TableMissing { .. })
    ));
    // The coordinator-state table beside it (the leader item) is gone too.
    let coordination = store
        .coordinator_state()
        .expect("a coordinator-state table");
    assert!(matches!(
        coordination.get(shardflow::lease::LEADER_KEY).await,
        Err(LeaseError::TableMissing { .. })
    ));
}

/// A KCL 3.5 single-table application's table: its leader, a worker's metrics and its
/// finished table migration beside one lease (`tests/fixtures/kcl/`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn describe_lists_kcl35_rows_apart_and_delete_leaves_them() {
    use aws_sdk_dynamodb::types::AttributeValue;
    use testkit::kcl::kcl_fixture;
    if !emulators_enabled() {
        return;
    }
    let aws = Aws::from_env().await;
    let kinesis = aws.admin().unwrap();
    let (stream, table) = (unique("cli-kcl35"), unique("cli-kcl35-app"));
    kinesis.create_stream(&stream, 1).await.unwrap();
    wait_until_active(kinesis.as_ref(), &stream).await;
    let shard = open_shards(kinesis.as_ref(), &stream).await.remove(0);
    aws.lease_store(&table).ensure_table().await.unwrap();
    let entities = [
        kcl_fixture("kcl35_leader.json"),
        kcl_fixture("kcl35_worker_metrics.json"),
        kcl_fixture("kcl35_table_migration_complete.json"),
    ];
    let mut lease = kcl_fixture("kcl35_lease.json");
    lease.insert("leaseKey".into(), AttributeValue::S(shard.shard_id.clone()));
    lease.remove("leaseOwner");
    lease.insert(
        "checkpoint".into(),
        AttributeValue::S("TRIM_HORIZON".into()),
    );
    for row in entities.iter().chain([&lease]) {
        aws.dynamodb_client()
            .put_item()
            .table_name(&table)
            .set_item(Some(row.clone()))
            .send()
            .await
            .unwrap();
    }
    let group = ["--stream", stream.as_str(), "--table", table.as_str()];
    let args = |cmd: &[&'static str], extra: &[&'static str]| -> Vec<String> {
        cmd.iter()
            .chain(group.iter())
            .chain(extra.iter())
            .map(|s| s.to_string())
            .collect()
    };
    let run_args = |a: Vec<String>| async move {
        let a: Vec<&str> = a.iter().map(String::as_str).collect();
        run(&a).await
    };

    let out = run_args(args(
        &["--json", "group", "describe"],
        &["--sample-ms", "0"],
    ))
    .await;
    assert_eq!(out.code, 0, "{}", out.stderr);
    let described = out.json();
    assert_eq!(
        described["shards"].as_array().unwrap().len(),
        1,
        "{described}"
    );
    assert_eq!(described["shards"][0]["shard"], shard.shard_id.as_str());
    assert_eq!(described["shards_unreadable"], 0, "{described}");
    assert_eq!(
        described["other_rows_summary"],
        serde_json::json!([
            "KCL leader (worker-2)",
            "KCL worker metrics (1 row)",
            "KCL table migration: TABLE_MIGRATION_STATUS_COMPLETE"
        ]),
        "{described}"
    );
    assert_eq!(described["kcl_migration_in_progress"], Value::Null);
    let out = run_args(args(&["group", "describe"], &["--sample-ms", "0"])).await;
    assert_eq!(out.code, 0, "{}", out.stderr);
    assert!(
        out.stdout
            .contains("rows that are not leases (left alone): KCL leader (worker-2)"),
        "{}",
        out.stdout
    );

    // The plan says what stays; --yes deletes the lease row only.
    let out = run_args(args(&["group", "delete"], &["--sample-ms", "0"])).await;
    assert_eq!(out.code, 3, "{}", out.stderr);
    assert!(
        out.stdout.contains("leave the table with 3 rows that are not the group's: KCL leader (worker-2), KCL worker metrics (1 row), KCL table migration: TABLE_MIGRATION_STATUS_COMPLETE"),
        "{}",
        out.stdout
    );
    let out = run_args(args(&["group", "delete"], &["--sample-ms", "0", "--yes"])).await;
    assert_eq!(out.code, 0, "{}", out.stderr);
    let left = aws
        .dynamodb_client()
        .scan()
        .table_name(&table)
        .consistent_read(true)
        .send()
        .await
        .unwrap()
        .items
        .unwrap_or_default();
    assert_eq!(left.len(), entities.len(), "{left:?}");
    for entity in &entities {
        assert!(
            left.iter()
                .any(|row| row.get("leaseKey") == entity.get("leaseKey")
                    && row.get("entityType") == entity.get("entityType")
                    && row.len() == entity.len()),
            "{entity:?} not left: {left:?}"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tail_follows_new_records_and_stops_cleanly_on_ctrl_c() {
    if !emulators_enabled() {
        return;
    }
    use tokio::io::{AsyncBufReadExt, BufReader};
    let aws = Aws::from_env().await;
    let kinesis = aws.admin().unwrap();
    let stream = unique("cli-follow");
    kinesis.create_stream(&stream, 1).await.unwrap();
    let mut child = tokio::process::Command::new(env!("CARGO_BIN_EXE_shardflow"))
        .args(["stream", "tail", &stream, "--from", "trim-horizon"])
        .stdout(Stdio::piped())
        .stdin(Stdio::null())
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
    // Records written after tail started reach it; its signal handler is installed
    // before its first read, so the line proves it is in place.
    produce(kinesis.as_ref(), &stream, 0..1).await;
    let first = within(RUN_LIMIT, "the first line", lines.next_line())
        .await
        .unwrap()
        .unwrap();
    assert!(first.ends_with(" 0"), "{first}");
    let pid = child.id().unwrap().to_string();
    let status = Command::new("kill").args(["-INT", &pid]).status().unwrap();
    assert!(status.success());
    let status = within(RUN_LIMIT, "tail stops on SIGINT", child.wait())
        .await
        .unwrap();
    assert_eq!(
        status.code(),
        Some(0),
        "a clean stop, not killed by the signal"
    );
}

/// Resetting one finished shard resets its descendants too (they must wait for it and
/// be read after it again): to the same time, or from their start after a reset to a
/// sequence number of the finished shard. Shown in the plan, applied with --yes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn resetting_a_finished_shard_resets_its_descendants() {
    use shardflow::lease::Lease;
    use shardflow::{Position, SequenceNumber};
    if !emulators_enabled() {
        return;
    }
    let aws = Aws::from_env().await;
    let (stream, group) = (unique("cli-reset-tree"), unique("cli-reset-tree-g"));
    // The stream exists (a sequence reset of a stream that does not is refused); the
    // rows' shards are no longer in it, so their sequence numbers cannot be checked.
    aws.admin()
        .unwrap()
        .create_stream(&stream, 1)
        .await
        .unwrap();
    let store = aws.lease_store(&group);
    store.ensure_table().await.unwrap();
    // A finished parent, a finished child of it, a grandchild being read, and an
    // unrelated open shard.
    let at = |n: u64| Checkpoint::At(Position::new(SequenceNumber::from(n), 0));
    let rows = [
        ("p", vec![], Checkpoint::ShardEnd),
        ("c", vec!["p"], Checkpoint::ShardEnd),
        ("g", vec!["c"], at(70)),
        ("other", vec![], at(5)),
    ];
    for (key, parents, checkpoint) in rows {
        let mut lease = Lease::new(
            key.to_owned(),
            parents.into_iter().map(str::to_owned).collect(),
            checkpoint,
        );
        lease.stream = Some(stream.clone());
        assert!(store.create(&lease).await.unwrap());
    }
    let reset = |to: &'static str| {
        let (stream, group) = (stream.clone(), group.clone());
        async move {
            let out = run(&[
                "group", "reset", "--stream", &stream, "--group", &group, "--to", "sequence", to,
                "--shard", "p", "--json",
            ])
            .await;
            assert_eq!(out.code, 3, "{}\n{}", out.stdout, out.stderr);
            let plan: BTreeMap<String, String> = out.json()["plan"]
                .as_array()
                .unwrap()
                .iter()
                .map(|p| {
                    (
                        p["shard"].as_str().unwrap().to_owned(),
                        p["to"].as_str().unwrap().to_owned(),
                    )
                })
                .collect();
            plan
        }
    };
    let plan = reset("41").await;
    assert_eq!(
        plan.keys().map(String::as_str).collect::<Vec<_>>(),
        ["c", "g", "p"],
        "the finished shard and its descendants, nothing else: {plan:?}"
    );
    assert_ne!(plan["p"], plan["c"], "{plan:?}");
    assert_eq!(
        plan["c"], plan["g"],
        "descendants from their start: {plan:?}"
    );

    let out = run(&[
        "group", "reset", "--stream", &stream, "--group", &group, "--to", "sequence", "41",
        "--shard", "p", "--yes",
    ])
    .await;
    assert_eq!(out.code, 0, "{}\n{}", out.stdout, out.stderr);
    let after = checkpoints(&store.list().await.unwrap());
    assert_eq!(after["p"], at(41));
    assert_eq!(after["c"], Checkpoint::TrimHorizon);
    assert_eq!(after["g"], Checkpoint::TrimHorizon);
    assert_eq!(after["other"], at(5), "an unrelated shard is left alone");
}

/// A multi-stream table written by a running multi-stream consumer: `describe` shows
/// each row's stream and shard and the lag per stream; `reset` refuses a shard id that
/// both streams have, and with `--stream` moves only that stream's row, whose running
/// owner applies it (that stream's records come again, the other's do not).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn multi_stream_tables_are_described_and_reset_per_stream() {
    if !emulators_enabled() {
        return;
    }
    let aws = Aws::from_env().await;
    let kinesis = aws.admin().unwrap();
    let (orders, refunds, group) = (unique("cli-ms-a"), unique("cli-ms-b"), unique("cli-ms-g"));
    kinesis.create_stream(&orders, 2).await.unwrap();
    kinesis.create_stream(&refunds, 1).await.unwrap();
    produce(kinesis.as_ref(), &orders, 0..20).await;
    produce(kinesis.as_ref(), &refunds, 100..110).await;
    let recorder = Recorder::default();
    let consumer = test_timings(
        shardflow::Consumer::builder()
            .streams([orders.as_str(), refunds.as_str()])
            .group(&group)
            .worker_id("w1")
            .backend(aws.clone()),
    )
    .build()
    .unwrap();
    let running = start(consumer, &recorder);
    recorder.wait_for(30, LIMIT).await;

    // Every row with its stream, every stream with its lag.
    let described = described_caught_up(&["--group", &group]).await;
    assert_eq!(described["multi_stream"], true, "{described}");
    let shards = described["shards"].as_array().unwrap();
    let of = |stream: &str| {
        shards
            .iter()
            .filter(|s| s["stream"] == stream)
            .map(|s| s["shard"].as_str().unwrap().to_owned())
            .collect::<Vec<_>>()
    };
    assert_eq!(of(&orders).len(), 2, "{described}");
    assert_eq!(of(&refunds), ["shardId-000000000000"], "{described}");
    for s in shards {
        assert_eq!(s["state"], "open", "{s}");
        assert!(s["owner"].as_str().unwrap().starts_with("w1#"), "{s}");
        assert_eq!(s["renewing"], true, "{s}");
        let key = s["lease_key"].as_str().unwrap();
        assert!(
            key.ends_with(&format!(":{}", s["shard"].as_str().unwrap()))
                && key.contains(&format!(":{}:", s["stream"].as_str().unwrap())),
            "{s}"
        );
    }
    let streams: BTreeMap<String, (u64, u64)> = described["streams"]
        .as_array()
        .unwrap()
        .iter()
        .map(|s| {
            (
                s["stream"].as_str().unwrap().to_owned(),
                (
                    s["shards"].as_u64().unwrap(),
                    s["records_behind"].as_u64().unwrap(),
                ),
            )
        })
        .collect();
    assert_eq!(streams[&orders], (2, 0), "{described}");
    assert_eq!(streams[&refunds], (1, 0), "{described}");
    // One stream's rows; and the table for people names streams and the lag of each.
    let out = run(&[
        "group",
        "describe",
        "--group",
        &group,
        "--stream",
        &refunds,
        "--json",
        "--sample-ms",
        "0",
    ])
    .await;
    assert_eq!(out.code, 0, "{}", out.stderr);
    let only = out.json();
    let only = only["shards"].as_array().unwrap();
    assert_eq!(only.len(), 1, "{only:?}");
    assert_eq!(only[0]["stream"], refunds.as_str());
    let out = run(&["group", "describe", "--group", &group, "--sample-ms", "0"]).await;
    assert_eq!(out.code, 0, "{}", out.stderr);
    assert!(out.stdout.contains("2 streams, 3 shards"), "{}", out.stdout);
    for stream in [&orders, &refunds] {
        assert!(
            out.stdout.contains(&format!(":{stream}:")),
            "a lag line per stream: {}",
            out.stdout
        );
    }

    // The handled records are checkpointed (compared below: the reset leaves orders).
    let store = aws.lease_store(&group);
    let before = committed_checkpoints(store.as_ref()).await;
    // shardId-000000000000 is in both streams: refused (a usage error), nothing changed.
    let out = run(&[
        "group",
        "reset",
        "--group",
        &group,
        "--to",
        "trim-horizon",
        "--shard",
        "shardId-000000000000",
        "--yes",
    ])
    .await;
    assert_eq!(out.code, 2, "{}\n{}", out.stdout, out.stderr);
    assert!(out.stderr.contains("several streams"), "{}", out.stderr);
    assert!(out.stderr.contains(&refunds), "{}", out.stderr);
    // Without a stream or shards on a multi-stream table: refused too.
    let out = run(&["group", "reset", "--group", &group, "--to", "trim-horizon"]).await;
    assert_eq!(out.code, 2, "{}\n{}", out.stdout, out.stderr);
    assert_eq!(checkpoints(&store.list().await.unwrap()), before);

    // With --stream: the refunds row only, requested from its running owner.
    let out = run(&[
        "group",
        "reset",
        "--group",
        &group,
        "--stream",
        &refunds,
        "--shard",
        "shardId-000000000000",
        "--to",
        "trim-horizon",
        "--yes",
        "--json",
    ])
    .await;
    assert_eq!(out.code, 0, "{}\n{}", out.stdout, out.stderr);
    let done = out.json();
    let done = done["reset"].as_array().unwrap();
    assert_eq!(done.len(), 1, "{done:?}");
    assert_eq!(done[0]["stream"], refunds.as_str());
    assert_eq!(done[0]["how"], "requested from the owner", "{done:?}");
    let refunds_key = done[0]["lease_key"].as_str().unwrap().to_owned();
    // The owner applies it: refunds' 10 records come again.
    recorder.wait_for(40, LIMIT).await;
    let after = checkpoints(&store.list().await.unwrap());
    for (key, checkpoint) in &before {
        if key != &refunds_key {
            assert_eq!(&after[key], checkpoint, "{key}: another stream's row moved");
        }
    }
    // Sentinels: once they arrived, whatever the reset delivers again has come.
    let mut sentinels = Vec::new();
    for (stream, first) in [(&orders, 1000), (&refunds, 2000)] {
        let shards = open_shards(kinesis.as_ref(), stream).await;
        sentinels.extend(produce_sentinels(kinesis.as_ref(), stream, &shards, first).await);
    }
    recorder.wait_for_values(&sentinels, LIMIT).await;
    running.stop().await;
    let mut seen: BTreeMap<usize, usize> = BTreeMap::new();
    for h in recorder.snapshot() {
        *seen.entry(h.value).or_default() += 1;
    }
    for v in 0..20 {
        assert_eq!(seen[&v], 1, "orders value {v} delivered again");
    }
    for v in 100..110 {
        assert_eq!(seen[&v], 2, "refunds value {v} not delivered again");
    }
    let row = store.get(&refunds_key).await.unwrap().unwrap();
    assert_eq!(row.reset_to, None, "{row:?}");
    assert!(matches!(row.checkpoint, Checkpoint::At(_)), "{row:?}");
}

/// `describe` shows each shard's measured throughput (`throughputKBps`, as the owners'
/// renewals write it) and each worker's load, the sum over the shards it owns, in the
/// JSON and in the table; a shard without a figure shows none and adds nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn describe_shows_throughput_per_shard_and_load_per_worker() {
    if !emulators_enabled() {
        return;
    }
    use aws_sdk_dynamodb::types::AttributeValue;
    let aws = Aws::from_env().await;
    let kinesis = aws.admin().unwrap();
    let (stream, group) = (unique("cli-load"), unique("cli-load-g"));
    kinesis.create_stream(&stream, 4).await.unwrap();
    produce(kinesis.as_ref(), &stream, 0..20).await;
    let recorder = Recorder::default();
    let running = start(group_consumer(&aws, &stream, &group), &recorder);
    recorder.wait_for(20, LIMIT).await;
    running.stop().await;
    // The figures of a fleet of two workers, written as their renewals would: `wa` owns
    // two shards (12.5 and 7.5 KiB/s), `wb` one measured shard (3.5 KiB/s) and one not
    // measured yet.
    let mut keys: Vec<String> = aws
        .lease_store(&group)
        .list()
        .await
        .unwrap()
        .into_iter()
        .map(|r| r.key)
        .collect();
    keys.sort();
    assert_eq!(keys.len(), 4);
    let figures = [
        ("wa#n1", Some("12.5")),
        ("wa#n1", Some("7.5")),
        ("wb#n2", Some("3.5")),
        ("wb#n2", None),
    ];
    for (key, (owner, kbps)) in keys.iter().zip(figures) {
        let mut update = aws
            .dynamodb_client()
            .update_item()
            .table_name(&group)
            .key("leaseKey", AttributeValue::S(key.clone()))
            .expression_attribute_values(":o", AttributeValue::S(owner.into()));
        update = match kbps {
            Some(k) => update
                .update_expression("SET leaseOwner = :o, throughputKBps = :t")
                .expression_attribute_values(":t", AttributeValue::N(k.into())),
            None => update.update_expression("SET leaseOwner = :o REMOVE throughputKBps"),
        };
        update.send().await.unwrap();
    }
    let args = [
        "group",
        "describe",
        "--stream",
        &stream,
        "--group",
        &group,
        "--sample-ms",
        "0",
    ];
    let out = run(&[&args[..], &["--json"]].concat()).await;
    assert_eq!(out.code, 0, "{}", out.stderr);
    let described = out.json();
    let per_shard: BTreeMap<String, Value> = described["shards"]
        .as_array()
        .unwrap()
        .iter()
        .map(|s| {
            (
                s["shard"].as_str().unwrap().to_owned(),
                s["throughput_kbps"].clone(),
            )
        })
        .collect();
    let expected: BTreeMap<String, Value> = keys
        .iter()
        .zip([
            serde_json::json!(12.5),
            serde_json::json!(7.5),
            serde_json::json!(3.5),
            Value::Null,
        ])
        .map(|(k, v)| (k.clone(), v))
        .collect();
    assert_eq!(per_shard, expected, "{described}");
    assert_eq!(
        described["worker_throughput_kbps"],
        serde_json::json!({"wa": 20.0, "wb": 3.5}),
        "{described}"
    );
    assert_eq!(
        described["workers"],
        serde_json::json!({"wa": 2, "wb": 2}),
        "{described}"
    );
    // The table: each worker's count and load, each shard's figure (one decimal).
    let out = run(&args).await;
    assert_eq!(out.code, 0, "{}", out.stderr);
    assert!(
        out.stdout.contains("wa: 2 (20.0 KiB/s)") && out.stdout.contains("wb: 2 (3.5 KiB/s)"),
        "{}",
        out.stdout
    );
    for figure in ["12.5", "7.5", "3.5"] {
        assert!(out.stdout.contains(figure), "{figure}: {}", out.stdout);
    }
}

/// A lease row with a malformed attribute is described with the state `unreadable` and
/// why, and nothing tries to read its lag.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn describe_shows_a_row_that_does_not_parse_as_unreadable() {
    if !emulators_enabled() {
        return;
    }
    use aws_sdk_dynamodb::types::AttributeValue;
    let aws = Aws::from_env().await;
    let kinesis = aws.admin().unwrap();
    let (stream, group) = (unique("cli-unreadable"), unique("cli-unreadable-g"));
    kinesis.create_stream(&stream, 2).await.unwrap();
    produce(kinesis.as_ref(), &stream, 0..10).await;
    let recorder = Recorder::default();
    let running = start(group_consumer(&aws, &stream, &group), &recorder);
    recorder.wait_for(10, LIMIT).await;
    running.stop().await;
    let rows = aws.lease_store(&group).list().await.unwrap();
    let broken = rows[0].key.clone();
    aws.dynamodb_client()
        .update_item()
        .table_name(&group)
        .key("leaseKey", AttributeValue::S(broken.clone()))
        .update_expression("SET leaseCounter = :s")
        .expression_attribute_values(":s", AttributeValue::S("seven".into()))
        .send()
        .await
        .unwrap();
    let out = run(&[
        "group",
        "describe",
        "--stream",
        &stream,
        "--group",
        &group,
        "--json",
        "--sample-ms",
        "0",
    ])
    .await;
    // A shard that cannot be read: everything printed, and exit code 1.
    assert_eq!(out.code, 1, "{}", out.stderr);
    let described = out.json();
    assert_eq!(described["shards_unreadable"], 1, "{described}");
    let shards = described["shards"].as_array().unwrap();
    assert_eq!(shards.len(), 2, "{described}");
    for s in shards {
        if s["shard"] == broken.as_str() {
            assert_eq!(s["state"], "unreadable", "{s}");
            assert!(
                s["unreadable"].as_str().unwrap().contains("leaseCounter"),
                "{s}"
            );
        } else {
            assert_eq!(s["state"], "open", "{s}");
            assert_eq!(s["unreadable"], Value::Null, "{s}");
        }
    }
    let out = run(&[
        "group",
        "describe",
        "--stream",
        &stream,
        "--group",
        &group,
        "--sample-ms",
        "0",
    ])
    .await;
    assert_eq!(out.code, 1, "{}", out.stderr);
    assert!(out.stdout.contains("unreadable"), "{}", out.stdout);
    assert!(out.stdout.contains("1 unreadable"), "{}", out.stdout);
    assert!(
        out.stderr.contains("1 shard cannot be read"),
        "{}",
        out.stderr
    );
}

/// A Kinesis endpoint in front of the emulator that refuses (HTTP 400,
/// `ValidationException`) every PutRecords call whose body holds `refused` and forwards
/// everything else, one request at a time per connection.
mod refusing {
    use std::io::{Read, Write};
    use std::net::{TcpListener, TcpStream};

    /// Starts the proxy; returns its URL.
    pub fn start(upstream: &str, refused: String) -> String {
        let upstream = upstream
            .strip_prefix("http://")
            .expect("a plain HTTP endpoint")
            .trim_end_matches('/')
            .to_owned();
        let listener = TcpListener::bind("127.0.0.1:0").expect("bind");
        let url = format!("http://{}", listener.local_addr().expect("address"));
        // A plain thread with blocking I/O: it lives until the test process ends.
        std::thread::spawn(move || {
            for client in listener.incoming().flatten() {
                let (upstream, refused) = (upstream.clone(), refused.clone());
                std::thread::spawn(move || {
                    if let Ok(server) = TcpStream::connect(&upstream) {
                        serve(client, server, refused.as_bytes());
                    }
                });
            }
        });
        url
    }

    /// One HTTP/1.1 message (head and Content-Length body) from `from`, or `None` when
    /// the connection ended.
    fn message(from: &mut TcpStream, buffer: &mut Vec<u8>) -> Option<Vec<u8>> {
        let mut chunk = [0u8; 64 * 1024];
        let head_end = loop {
            if let Some(at) = buffer.windows(4).position(|w| w == b"\r\n\r\n") {
                break at + 4;
            }
            match from.read(&mut chunk) {
                Ok(0) | Err(_) => return None,
                Ok(n) => buffer.extend_from_slice(&chunk[..n]),
            }
        };
        let head = String::from_utf8_lossy(&buffer[..head_end]).to_lowercase();
        let length: usize = head
            .lines()
            .find_map(|line| line.strip_prefix("content-length:"))
            .and_then(|v| v.trim().parse().ok())
            .unwrap_or(0);
        while buffer.len() < head_end + length {
            match from.read(&mut chunk) {
                Ok(0) | Err(_) => return None,
                Ok(n) => buffer.extend_from_slice(&chunk[..n]),
            }
        }
        Some(buffer.drain(..head_end + length).collect())
    }

    fn serve(mut client: TcpStream, mut server: TcpStream, refused: &[u8]) {
        let (mut from_client, mut from_server) = (Vec::new(), Vec::new());
        while let Some(request) = message(&mut client, &mut from_client) {
            let put_records = String::from_utf8_lossy(&request)
                .to_lowercase()
                .contains("kinesis_20131202.putrecords");
            let response = if put_records && request.windows(refused.len()).any(|w| w == refused) {
                let body = r#"{"__type":"ValidationException","message":"refused by the test"}"#;
                format!(
                    "HTTP/1.1 400 Bad Request\r\ncontent-type: application/x-amz-json-1.1\r\ncontent-length: {}\r\n\r\n{body}",
                    body.len()
                )
                .into_bytes()
            } else {
                if server.write_all(&request).is_err() {
                    return;
                }
                match message(&mut server, &mut from_server) {
                    Some(response) => response,
                    None => return,
                }
            };
            if client.write_all(&response).is_err() {
                return;
            }
        }
    }
}

/// Writes dead letters of `(partition key, payload)` to `dlq`, in this order, as the
/// dead-letter layer's default sink does.
async fn write_dead_letters(aws: &Aws, dlq: &str, origin: &str, letters: &[(String, String)]) {
    let producer = Producer::builder()
        .stream(dlq)
        .backend(aws.clone())
        .build()
        .unwrap();
    for (n, (key, payload)) in letters.iter().enumerate() {
        let record = DeadLetterRecord {
            metadata: Metadata::builder()
                .stream(origin)
                .partition_key(key.as_str())
                .sequence_number(1000u64 + n as u64)
                .build(),
            payload: Bytes::from(payload.clone()),
            error: "refused".into(),
            attempts: Some(1),
            headers: Headers::new(),
        };
        // One at a time: the dead-letter stream keeps this order.
        ProducerSink::new(producer.clone())
            .oneshot(record)
            .await
            .unwrap();
    }
    producer.close().await;
}

/// Per partition key, the payloads of `stream` in stream order.
async fn payloads_by_key(kinesis: &dyn KinesisApi, stream: &str) -> BTreeMap<String, Vec<String>> {
    let mut by_key: BTreeMap<String, Vec<String>> = BTreeMap::new();
    for (data, key, _) in read_all(kinesis, stream).await {
        by_key.entry(key).or_default().push(data);
    }
    by_key
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dlq_replay_stopped_by_a_refused_write_continues_on_rerun_in_key_order() {
    if !emulators_enabled() {
        return;
    }
    let aws = Aws::from_env().await;
    let kinesis = aws.admin().unwrap();
    let (orders, dlq) = (unique("cli-orders"), unique("cli-dlq"));
    kinesis.create_stream(&orders, 1).await.unwrap();
    kinesis.create_stream(&dlq, 1).await.unwrap();
    // Three keys, four dead letters each, interleaved; payloads of 9 bytes, so each is
    // exactly 12 characters of base64 in a PutRecords body.
    let mut letters = Vec::new();
    for i in 0..4 {
        for k in ["a", "b", "c"] {
            letters.push((format!("customer-{k}"), format!("order-{k}-{i}")));
        }
    }
    write_dead_letters(&aws, &dlq, &orders, &letters).await;
    let expected: BTreeMap<String, Vec<String>> = ["a", "b", "c"]
        .iter()
        .map(|k| {
            let payloads = (0..4).map(|i| format!("order-{k}-{i}")).collect();
            (format!("customer-{k}"), payloads)
        })
        .collect();

    // Kinesis refuses every write of b's second dead letter.
    let upstream = std::env::var("AWS_ENDPOINT_URL_KINESIS").unwrap();
    let proxy = refusing::start(&upstream, "b3JkZXItYi0x".into()); // base64("order-b-1")
    let replay = [
        "dlq", "replay", "--from", &dlq, "--to", &orders, "--yes", "--json",
    ];
    let out = run_with(&replay, &[("AWS_ENDPOINT_URL_KINESIS", proxy.as_str())]).await;
    assert_eq!(out.code, 1, "{}\n{}", out.stdout, out.stderr);
    assert!(out.stderr.contains("a write failed"), "{}", out.stderr);
    let first = payloads_by_key(kinesis.as_ref(), &orders).await;
    let b = first.get("customer-b").cloned().unwrap_or_default();
    assert!(
        !b.iter().any(|p| p == "order-b-2" || p == "order-b-3"),
        "nothing after the refused dead letter of its key: {b:?}"
    );
    for (key, payloads) in &first {
        assert!(
            expected[key].starts_with(payloads),
            "{key}: in order, no duplicate: {payloads:?}"
        );
    }
    let written_first: usize = first.values().map(Vec::len).sum();

    // The same command again, Kinesis accepting everything: it continues.
    let out = run(&replay).await;
    assert_eq!(out.code, 0, "{}", out.stderr);
    let summary = out.json();
    assert_eq!(summary["replayed_before"], written_first, "{summary}");
    assert_eq!(summary["published"], 12 - written_first, "{summary}");
    assert_eq!(
        payloads_by_key(kinesis.as_ref(), &orders).await,
        expected,
        "every dead letter once, in per-key order"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dlq_replay_with_a_limit_twice_publishes_no_duplicate() {
    if !emulators_enabled() {
        return;
    }
    let aws = Aws::from_env().await;
    let kinesis = aws.admin().unwrap();
    let (orders, dlq) = (unique("cli-orders"), unique("cli-dlq"));
    kinesis.create_stream(&orders, 1).await.unwrap();
    kinesis.create_stream(&dlq, 2).await.unwrap();
    let letters: Vec<(String, String)> = (0..5)
        .map(|i| (format!("customer-{}", i % 2), format!("order-{i}")))
        .collect();
    write_dead_letters(&aws, &dlq, &orders, &letters).await;
    let limited = [
        "dlq", "replay", "--from", &dlq, "--to", &orders, "--limit", "3", "--yes", "--json",
    ];
    let mut published = Vec::new();
    for _ in 0..3 {
        let out = run(&limited).await;
        assert_eq!(out.code, 0, "{}", out.stderr);
        published.push(out.json()["published"].as_u64().unwrap());
    }
    assert_eq!(published, [3, 2, 0]);
    let mut expected: BTreeMap<String, Vec<String>> = BTreeMap::new();
    for (key, payload) in letters {
        expected.entry(key).or_default().push(payload);
    }
    assert_eq!(
        payloads_by_key(kinesis.as_ref(), &orders).await,
        expected,
        "each dead letter once, in per-key order"
    );
    // --restart forgets the progress: everything again.
    let mut again = limited.to_vec();
    again.retain(|a| *a != "--limit" && *a != "3");
    again.push("--restart");
    let out = run(&again).await;
    assert_eq!(out.code, 0, "{}", out.stderr);
    assert_eq!(out.json()["published"], 5);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dlq_replay_writes_the_headers_back_and_tail_shows_them() {
    if !emulators_enabled() {
        return;
    }
    let aws = Aws::from_env().await;
    let kinesis = aws.admin().unwrap();
    let (orders, dlq) = (unique("cli-orders"), unique("cli-dlq"));
    kinesis.create_stream(&orders, 1).await.unwrap();
    kinesis.create_stream(&dlq, 1).await.unwrap();
    let headers: Headers = [
        ("contentType", "application/json"),
        (
            "traceparent",
            "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",
        ),
    ]
    .into_iter()
    .collect();
    let producer = Producer::builder()
        .stream(&dlq)
        .backend(aws.clone())
        .build()
        .unwrap();
    let record = DeadLetterRecord {
        metadata: Metadata::builder()
            .stream(orders.as_str())
            .partition_key("customer-1")
            .sequence_number(7u64)
            .build(),
        payload: Bytes::from_static(b"{\"id\":1}"),
        error: "refused".into(),
        attempts: None,
        headers: headers.clone(),
    };
    ProducerSink::new(producer.clone())
        .oneshot(record)
        .await
        .unwrap();
    producer.close().await;

    let out = run(&[
        "stream",
        "tail",
        &dlq,
        "--from",
        "trim-horizon",
        "--limit",
        "1",
    ])
    .await;
    assert_eq!(out.code, 0, "{}", out.stderr);
    assert!(
        out.stdout.contains(r#"headers={"contentType":"application/json","traceparent":"00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"}: {"id":1}"#),
        "{}",
        out.stdout
    );

    let out = run(&["dlq", "replay", "--from", &dlq, "--to", &orders, "--yes"]).await;
    assert_eq!(out.code, 0, "{}", out.stderr);
    let mut it = kinesis
        .shard_iterator(
            &orders,
            &kinesis.list_shards(&orders).await.unwrap()[0].shard_id,
            &StartingPosition::TrimHorizon,
        )
        .await
        .unwrap();
    let records = loop {
        let page = kinesis.get_records(&it, 100).await.unwrap();
        if !page.records.is_empty() {
            break page.records;
        }
        it = page.next_iterator.unwrap();
    };
    assert_eq!(records.len(), 1);
    let (read_headers, payload) = HeaderFormat::Auto
        .read(&records[0].data)
        .expect("the replayed record carries its headers");
    assert_eq!(read_headers, headers);
    assert_eq!(&payload[..], b"{\"id\":1}");

    // Tail shows the headers of the Spring-framed record too.
    let out = run(&[
        "stream",
        "tail",
        &orders,
        "--from",
        "trim-horizon",
        "--limit",
        "1",
    ])
    .await;
    assert_eq!(out.code, 0, "{}", out.stderr);
    assert!(
        out.stdout
            .contains(r#"headers={"contentType":"application/json","#),
        "{}",
        out.stdout
    );
}

/// Writes dead letters of `(partition key, payload)` to `dlq` as envelopes, 500 per
/// PutRecords call, in this order (a quicker way to many dead letters than the sink).
async fn put_dead_letters(
    kinesis: &dyn KinesisApi,
    dlq: &str,
    origin: &str,
    letters: &[(String, String)],
) {
    let records: Vec<PutRecord> = letters
        .iter()
        .enumerate()
        .flat_map(|(n, (key, payload))| {
            let record = DeadLetterRecord {
                metadata: Metadata::builder()
                    .stream(origin)
                    .partition_key(key.as_str())
                    .sequence_number(1000u64 + n as u64)
                    .build(),
                payload: Bytes::from(payload.clone()),
                error: "refused".into(),
                attempts: Some(1),
                headers: Headers::new(),
            };
            DeadLetterEnvelope::from_record(&record)
                .to_records()
                .unwrap()
                .into_iter()
                .map(|data| PutRecord {
                    data,
                    partition_key: key.clone(),
                    explicit_hash_key: None,
                })
                .collect::<Vec<_>>()
        })
        .collect();
    for chunk in records.chunks(500) {
        let outcomes = kinesis.put_records(dlq, chunk).await.unwrap();
        assert!(
            outcomes
                .iter()
                .all(|o| matches!(o, shardflow::kinesis::PutOutcome::Stored { .. })),
            "{outcomes:?}"
        );
    }
}

/// Payloads per partition key, in order.
type ByKey = BTreeMap<String, Vec<String>>;

/// `n` dead letters over `keys` partition keys (`order-<n>`), and per key the payloads
/// in order.
fn many_letters(n: usize, keys: usize) -> (Vec<(String, String)>, ByKey) {
    let letters: Vec<(String, String)> = (0..n)
        .map(|i| (format!("customer-{}", i % keys), format!("order-{i}")))
        .collect();
    let mut expected: BTreeMap<String, Vec<String>> = BTreeMap::new();
    for (key, payload) in &letters {
        expected
            .entry(key.clone())
            .or_default()
            .push(payload.clone());
    }
    (letters, expected)
}

/// Checks that what `got` holds per key, first occurrences only, is `expected` (or,
/// unless `complete`, a prefix of it): nothing lost, nothing out of per-key order.
/// Returns how many records are repeats.
fn repeats_in_key_order(
    got: &BTreeMap<String, Vec<String>>,
    expected: &BTreeMap<String, Vec<String>>,
    complete: bool,
) -> usize {
    let mut repeats = 0;
    for (key, payloads) in got {
        let mut seen = std::collections::BTreeSet::new();
        let firsts: Vec<String> = payloads
            .iter()
            .filter(|p| seen.insert(p.as_str()))
            .cloned()
            .collect();
        repeats += payloads.len() - firsts.len();
        let want = expected.get(key).cloned().unwrap_or_default();
        if complete {
            assert_eq!(firsts, want, "{key}: every dead letter, in order");
        } else {
            assert!(want.starts_with(&firsts), "{key}: in order: {firsts:?}");
        }
    }
    if complete {
        assert_eq!(
            got.keys().collect::<Vec<_>>(),
            expected.keys().collect::<Vec<_>>()
        );
    }
    repeats
}

/// Starts `shardflow ARGS`, signals it `after` (SIGKILL when `kill`, else SIGINT as
/// ctrl-c does) unless it ended, and returns what it printed and its exit code (-1 when
/// the signal ended it).
async fn run_signalled(args: &[&str], after: Duration, kill: bool) -> Out {
    run_signalled_once(args, std::future::ready(()), after, kill).await
}

/// Like [`run_signalled`], `after` counted from when `start` completes.
async fn run_signalled_once(
    args: &[&str],
    start: impl std::future::Future<Output = ()>,
    after: Duration,
    kill: bool,
) -> Out {
    let mut child = tokio::process::Command::new(env!("CARGO_BIN_EXE_shardflow"))
        .args(args)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .stdin(Stdio::null())
        .kill_on_drop(true)
        .spawn()
        .expect("start the binary");
    let pid = child.id().expect("running").to_string();
    let (mut so, mut se) = (child.stdout.take().unwrap(), child.stderr.take().unwrap());
    let output = async {
        use tokio::io::AsyncReadExt;
        let (mut out, mut err) = (String::new(), String::new());
        let signal = async {
            start.await;
            tokio::time::sleep(after).await;
            // Not reaped before the output ends: the pid is still this child's.
            if kill {
                let _ = Command::new("kill").args(["-KILL", &pid]).status();
            } else {
                let _ = Command::new("kill").args(["-INT", &pid]).status();
            }
        };
        let read = async {
            let (a, b) = tokio::join!(so.read_to_string(&mut out), se.read_to_string(&mut err));
            a.unwrap();
            b.unwrap();
        };
        tokio::select! {
            _ = read => {}
            _ = async { signal.await; std::future::pending::<()>().await } => {}
        }
        let status = child.wait().await.unwrap();
        (status, out, err)
    };
    let (status, stdout, stderr) = within(RUN_LIMIT, &format!("shardflow {args:?}"), output).await;
    Out {
        code: status.code().unwrap_or(-1),
        stdout,
        stderr,
    }
}

/// The most dead letters a crashed replay may have published without recording them:
/// a progress write's worth plus the writes in flight (docs/cli.md).
const CRASH_REPEATS: usize = 100;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dlq_replays_started_together_publish_each_dead_letter_once() {
    if !emulators_enabled() {
        return;
    }
    let aws = Aws::from_env().await;
    let kinesis = aws.admin().unwrap();
    let (orders, dlq) = (unique("cli-orders"), unique("cli-dlq"));
    kinesis.create_stream(&orders, 1).await.unwrap();
    kinesis.create_stream(&dlq, 1).await.unwrap();
    let (letters, expected) = many_letters(300, 10);
    put_dead_letters(kinesis.as_ref(), &dlq, &orders, &letters).await;
    let replay = ["dlq", "replay", "--from", &dlq, "--to", &orders, "--yes"];
    let (a, b) = tokio::join!(run(&replay), run(&replay));
    let codes = [a.code, b.code];
    assert!(
        codes.contains(&0),
        "one of them replays: {codes:?}\n{}\n{}",
        a.stderr,
        b.stderr
    );
    for out in [&a, &b] {
        if out.code != 0 {
            assert_eq!(out.code, 1, "{}", out.stderr);
            assert!(
                out.stderr.contains("holds its progress item") && out.stderr.contains(" until "),
                "says who holds it and until when: {}",
                out.stderr
            );
        }
    }
    let got = payloads_by_key(kinesis.as_ref(), &orders).await;
    assert_eq!(
        repeats_in_key_order(&got, &expected, true),
        0,
        "each dead letter once"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dlq_replay_is_refused_while_a_crashed_run_holds_its_claim_then_takes_it_over() {
    if !emulators_enabled() {
        return;
    }
    let aws = Aws::from_env().await;
    let kinesis = aws.admin().unwrap();
    let (orders, dlq) = (unique("cli-orders"), unique("cli-dlq"));
    kinesis.create_stream(&orders, 1).await.unwrap();
    kinesis.create_stream(&dlq, 1).await.unwrap();
    let (letters, expected) = many_letters(3000, 2);
    put_dead_letters(kinesis.as_ref(), &dlq, &orders, &letters).await;
    // Long enough for the second run to read the dead-letter stream on a busy machine.
    let claim_ms = 10_000u64;
    let claim = claim_ms.to_string();
    let replay = [
        "dlq",
        "replay",
        "--from",
        &dlq,
        "--to",
        &orders,
        "--yes",
        "--claim-ms",
        &claim,
    ];
    // A run killed once it has published something: it holds the claim.
    let first = tokio::spawn({
        let replay: Vec<String> = replay.iter().map(|s| s.to_string()).collect();
        async move {
            let args: Vec<&str> = replay.iter().map(String::as_str).collect();
            run_signalled(&args, Duration::from_secs(60), true).await
        }
    });
    let started = within(LIMIT, "the first run publishing", async {
        loop {
            if !read_all(kinesis.as_ref(), &orders).await.is_empty() {
                break;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    });
    started.await;
    first.abort(); // kill_on_drop: SIGKILL, a crash
    let _ = first.await;
    let killed_at = std::time::Instant::now();
    let written = read_all(kinesis.as_ref(), &orders).await.len();
    assert!(written < letters.len(), "killed before the end: {written}");

    let out = run(&replay).await;
    assert_eq!(out.code, 1, "{}\n{}", out.stdout, out.stderr);
    assert!(
        out.stderr.contains("holds its progress item") && out.stderr.contains(" until "),
        "{}",
        out.stderr
    );
    assert!(out.stderr.contains('#'), "names the holder: {}", out.stderr);
    assert_eq!(
        read_all(kinesis.as_ref(), &orders).await.len(),
        written,
        "the refused run wrote nothing"
    );
    // Once the crashed run's claim expired, the same command takes it over and ends the
    // replay.
    tokio::time::sleep(Duration::from_millis(claim_ms + 200).saturating_sub(killed_at.elapsed()))
        .await;
    let out = run(&replay).await;
    assert_eq!(out.code, 0, "{}\n{}", out.stdout, out.stderr);
    let got = payloads_by_key(kinesis.as_ref(), &orders).await;
    let repeats = repeats_in_key_order(&got, &expected, true);
    assert!(
        repeats <= CRASH_REPEATS,
        "{repeats} published again after the crash"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dlq_replays_interrupted_or_killed_at_random_points_publish_each_dead_letter_once() {
    use rand::{Rng, SeedableRng};
    if !emulators_enabled() {
        return;
    }
    let aws = Aws::from_env().await;
    let kinesis = aws.admin().unwrap();
    let (orders, dlq) = (unique("cli-orders"), unique("cli-dlq"));
    kinesis.create_stream(&orders, 1).await.unwrap();
    kinesis.create_stream(&dlq, 1).await.unwrap();
    let (letters, expected) = many_letters(2000, 40);
    put_dead_letters(kinesis.as_ref(), &dlq, &orders, &letters).await;
    let claim_ms = 1500u64;
    let claim = claim_ms.to_string();
    let replay = [
        "dlq",
        "replay",
        "--from",
        &dlq,
        "--to",
        &orders,
        "--yes",
        "--json",
        "--claim-ms",
        &claim,
    ];
    let mut rng = rand::rngs::SmallRng::seed_from_u64(33);
    let mut repeats = 0usize;
    let mut per_kill = Vec::new();
    // The last run was killed (its claim must expire first); a killed run's unrecorded
    // writes are still to be published again (by the next run that publishes).
    let (mut killed, mut owed) = (false, false);
    let mut finished = false;
    for round in 0..20 {
        let kill = rng.gen_ratio(1, 3);
        // Most signals come while the run publishes (counted from its first new
        // record), the others at any point from its start.
        let publishing = rng.gen_ratio(3, 4);
        let after = if publishing {
            Duration::from_millis(rng.gen_range(0..800))
        } else {
            Duration::from_millis(rng.gen_range(50..1500))
        };
        if killed {
            // The crashed run's claim lasts claim_ms after its last renewal.
            tokio::time::sleep(Duration::from_millis(claim_ms + 100)).await;
        }
        let before = read_all(kinesis.as_ref(), &orders).await.len();
        let grew = async {
            while publishing && read_all(kinesis.as_ref(), &orders).await.len() <= before {
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        };
        let out = run_signalled_once(&replay, grew, after, kill).await;
        match (kill, out.code) {
            (_, 0) => {}
            (false, 130) => {
                let summary = out.json();
                assert_eq!(summary["interrupted"], true, "{summary}");
            }
            (true, -1) => {}
            (_, code) => panic!(
                "round {round}: {} after {after:?} ended with {code}\n{}\n{}",
                if kill { "SIGKILL" } else { "SIGINT" },
                out.stdout,
                out.stderr
            ),
        }
        let got = payloads_by_key(kinesis.as_ref(), &orders).await;
        let written: usize = got.values().map(Vec::len).sum();
        let now = repeats_in_key_order(&got, &expected, false);
        if now > repeats {
            // What a killed run had written but not recorded, published again by the
            // next run that publishes; an interrupted run leaves nothing to publish
            // again.
            assert!(owed, "round {round}: {} published again", now - repeats);
            assert!(
                now - repeats <= CRASH_REPEATS,
                "round {round}: {} published again",
                now - repeats
            );
            per_kill.push(now - repeats);
        }
        killed = out.code == -1;
        if killed {
            owed = true;
        } else if written > before {
            owed = false;
        }
        repeats = now;
        finished = out.code == 0;
        eprintln!(
            "round {round}: kill={kill} publishing={publishing} after={after:?} code={} written={written} repeats={repeats}",
            out.code
        );
    }
    if !finished || killed {
        if killed {
            tokio::time::sleep(Duration::from_millis(claim_ms + 100)).await;
        }
        let out = run(&replay).await;
        assert_eq!(out.code, 0, "{}", out.stderr);
    }
    let got = payloads_by_key(kinesis.as_ref(), &orders).await;
    let total = repeats_in_key_order(&got, &expected, true);
    assert!(total <= (per_kill.len() + 1) * CRASH_REPEATS, "{total}");
    eprintln!("published again after each kill: {per_kill:?}");
}

/// The first record's sequence number of `shard`.
async fn first_sequence(kinesis: &dyn KinesisApi, stream: &str, shard: &str) -> String {
    let mut it = kinesis
        .shard_iterator(stream, shard, &StartingPosition::TrimHorizon)
        .await
        .unwrap();
    loop {
        let page = kinesis.get_records(&it, 1).await.unwrap();
        if let Some(r) = page.records.first() {
            return r.sequence_number.as_str().to_owned();
        }
        it = page.next_iterator.expect("records in the shard");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reset_to_a_sequence_number_of_another_shard_is_refused_and_describe_fails_on_an_unreadable_shard(
) {
    if !emulators_enabled() {
        return;
    }
    let aws = Aws::from_env().await;
    let kinesis = aws.admin().unwrap();
    let (stream, group) = (unique("cli-seq"), unique("cli-seq-g"));
    kinesis.create_stream(&stream, 2).await.unwrap();
    produce(kinesis.as_ref(), &stream, 0..40).await;
    let recorder = Recorder::default();
    let running = start(group_consumer(&aws, &stream, &group), &recorder);
    recorder.wait_for(40, LIMIT).await;
    let described = described_caught_up(&["--stream", &stream, "--group", &group]).await;
    assert!(
        described["leader"]
            .as_str()
            .is_some_and(|l| l.starts_with("w1#")),
        "the group's leader is shown: {described}"
    );
    let store = aws.lease_store(&group);
    let before = committed_checkpoints(store.as_ref()).await;
    let (shard0, shard1) = ("shardId-000000000000", "shardId-000000000001");
    let seq0 = first_sequence(kinesis.as_ref(), &stream, shard0).await;

    // Every shard to shard 0's sequence number, or shard 1 alone: refused, naming both
    // shards, nothing written.
    let reset = [
        "group", "reset", "--stream", &stream, "--group", &group, "--to", "sequence", &seq0,
    ];
    for extra in [&["--yes"][..], &["--shard", shard1, "--yes"], &[]] {
        let mut args = reset.to_vec();
        args.extend_from_slice(extra);
        let out = run(&args).await;
        assert_eq!(out.code, 2, "{extra:?}: {}\n{}", out.stdout, out.stderr);
        assert!(
            out.stderr.contains(shard0) && out.stderr.contains(shard1),
            "{}",
            out.stderr
        );
    }
    let rows = store.list().await.unwrap();
    assert!(rows.iter().all(|r| r.reset_to.is_none()), "{rows:?}");
    assert_eq!(checkpoints(&rows), before);
    // Shard 0 alone: its own sequence number is fine.
    let mut args = reset.to_vec();
    args.extend(["--shard", shard0, "--yes"]);
    let out = run(&args).await;
    assert_eq!(out.code, 0, "{}", out.stderr);
    running.stop().await;

    // A row holding a checkpoint its shard cannot be read from (as a reset without the
    // check could write): describe says so and exits 1.
    let bad = shardflow::lease::Checkpoint::At(shardflow::Position::new(seq0.parse().unwrap(), 0));
    let outcome = within(LIMIT, "the bad checkpoint stored", async {
        loop {
            match shardflow::admin::reset_checkpoint(store.as_ref(), shard1, &bad).await {
                Ok(shardflow::admin::ResetOutcome::Applied(_)) => return,
                _ => tokio::time::sleep(Duration::from_millis(200)).await,
            }
        }
    });
    outcome.await;
    let describe = [
        "group",
        "describe",
        "--stream",
        &stream,
        "--group",
        &group,
        "--sample-ms",
        "0",
    ];
    let out = run(&describe).await;
    assert_eq!(out.code, 1, "{}\n{}", out.stdout, out.stderr);
    assert!(out.stdout.contains("1 in error"), "{}", out.stdout);
    assert!(out.stderr.contains(shard1), "{}", out.stderr);
    let mut json = describe.to_vec();
    json.push("--json");
    let out = run(&json).await;
    assert_eq!(out.code, 1, "{}", out.stderr);
    assert_eq!(out.json()["shards_in_error"], 1);
}

/// Writes `payloads` to `stream`, one PutRecords call, keys `pk-<payload>`.
async fn put_texts(kinesis: &dyn KinesisApi, stream: &str, payloads: &[String]) {
    let records: Vec<PutRecord> = payloads
        .iter()
        .map(|p| PutRecord {
            data: Bytes::from(p.clone()),
            partition_key: format!("pk-{p}"),
            explicit_hash_key: None,
        })
        .collect();
    kinesis.put_records(stream, &records).await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tail_from_a_time_or_latest_starts_the_children_of_a_split_there_too() {
    if !emulators_enabled() {
        return;
    }
    use tokio::io::{AsyncBufReadExt, BufReader};
    // kinesis-local: kinesalite never answers GetShardIterator AT_TIMESTAMP on a shard
    // without a record at or after the time (the parent here), where Kinesis gives an
    // iterator that reads nothing.
    let Ok(endpoint) = std::env::var("SHARDFLOW_FANOUT_KINESIS_ENDPOINT") else {
        eprintln!("skipped: SHARDFLOW_FANOUT_KINESIS_ENDPOINT not set (run scripts/test.sh)");
        return;
    };
    let env = [("AWS_ENDPOINT_URL_KINESIS", endpoint.as_str())];
    let default = Aws::from_env().await;
    let aws = Aws::from_clients(
        aws_sdk_kinesis::Client::from_conf(
            default
                .kinesis_client()
                .config()
                .to_builder()
                .endpoint_url(&endpoint)
                .build(),
        ),
        default.dynamodb_client().clone(),
    );
    let kinesis = aws.admin().unwrap();
    let stream = unique("cli-tail-from");
    kinesis.create_stream(&stream, 1).await.unwrap();
    let texts = |what: &str| (0..10).map(|i| format!("{what}-{i}")).collect::<Vec<_>>();
    put_texts(kinesis.as_ref(), &stream, &texts("parent")).await;
    let parent = kinesis.list_shards(&stream).await.unwrap()[0].clone();
    kinesis
        .split_shard(&stream, &parent.shard_id, u128::MAX / 2)
        .await
        .unwrap();
    wait_until_active(kinesis.as_ref(), &stream).await;
    put_texts(kinesis.as_ref(), &stream, &texts("child-before")).await;
    // T strictly after the records before it, and before the records after it (the
    // emulator stamps arrivals with this machine's clock, to the millisecond).
    tokio::time::sleep(Duration::from_millis(20)).await;
    let t = SystemTime::now()
        .duration_since(SystemTime::UNIX_EPOCH)
        .unwrap()
        .as_millis()
        .to_string();
    tokio::time::sleep(Duration::from_millis(20)).await;
    put_texts(kinesis.as_ref(), &stream, &texts("after")).await;

    let out = run_with(
        &[
            "stream",
            "tail",
            &stream,
            "--from",
            "timestamp",
            &t,
            "--format",
            "json",
            "--limit",
            "10",
        ],
        &env,
    )
    .await;
    assert_eq!(out.code, 0, "{}", out.stderr);
    let mut printed: Vec<String> = out
        .stdout
        .lines()
        .map(|l| {
            serde_json::from_str::<Value>(l).unwrap()["data"]
                .as_str()
                .unwrap()
                .to_owned()
        })
        .collect();
    printed.sort();
    let mut want = texts("after");
    want.sort();
    assert_eq!(
        printed, want,
        "only the records at or after T, children included"
    );

    // From LATEST on the ended parent: the children's records from then on, none of
    // those already there.
    let mut child = tokio::process::Command::new(env!("CARGO_BIN_EXE_shardflow"))
        .args([
            "stream",
            "tail",
            &stream,
            "--from",
            "latest",
            "--shard",
            &parent.shard_id,
        ])
        .args(["--limit", "1"])
        .envs(env)
        .stdout(Stdio::piped())
        .stdin(Stdio::null())
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
    // Tail gives no sign that it started reading: new records go in until one is shown.
    let first = within(RUN_LIMIT, "a new record shown", async {
        let mut n = 0;
        loop {
            tokio::select! {
                line = lines.next_line() => return line.unwrap().expect("a line"),
                _ = tokio::time::sleep(Duration::from_millis(300)) => {
                    put_texts(kinesis.as_ref(), &stream, &[format!("late-{n}")]).await;
                    n += 1;
                }
            }
        }
    })
    .await;
    assert!(
        first.contains(" late-"),
        "a record written after tail started: {first}"
    );
    within(RUN_LIMIT, "tail ends at its limit", child.wait())
        .await
        .unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dlq_replay_says_what_it_skipped_and_why() {
    if !emulators_enabled() {
        return;
    }
    let aws = Aws::from_env().await;
    let kinesis = aws.admin().unwrap();
    let (orders, dlq) = (unique("cli-orders"), unique("cli-dlq"));
    kinesis.create_stream(&orders, 1).await.unwrap();
    kinesis.create_stream(&dlq, 1).await.unwrap();
    let (letters, _) = many_letters(5, 2);
    put_dead_letters(kinesis.as_ref(), &dlq, &orders, &letters).await;
    // A dead letter too large for one record, of which only the first part is there,
    // and a record that is no envelope at all.
    let big = DeadLetterRecord {
        metadata: Metadata::builder()
            .stream(orders.as_str())
            .partition_key("customer-big")
            .sequence_number(7u64)
            .build(),
        payload: Bytes::from(vec![b'x'; 1_500_000]),
        error: "refused".into(),
        attempts: Some(1),
        headers: Headers::new(),
    };
    let parts = DeadLetterEnvelope::from_record(&big).to_records().unwrap();
    assert!(parts.len() > 1);
    for data in [parts[0].clone(), Bytes::from_static(b"not an envelope")] {
        let put = PutRecord {
            data,
            partition_key: "customer-big".into(),
            explicit_hash_key: None,
        };
        kinesis.put_records(&dlq, &[put]).await.unwrap();
    }
    let out = run(&["dlq", "replay", "--from", &dlq, "--to", &orders, "--yes"]).await;
    assert_eq!(out.code, 0, "{}", out.stderr);
    assert!(
        out.stdout.contains("re-published 5 dead letters"),
        "{}",
        out.stdout
    );
    assert!(
        out.stdout
            .contains("1 record is not a dead-letter envelope and 1 dead letter misses parts"),
        "{}",
        out.stdout
    );
    assert!(
        out.stdout.contains("not a shardflow dead-letter envelope"),
        "says why: {}",
        out.stdout
    );
    // JSON too: counts, and where each record that is no envelope is.
    let out = run(&[
        "dlq",
        "replay",
        "--from",
        &dlq,
        "--to",
        &orders,
        "--yes",
        "--json",
        "--restart",
    ])
    .await;
    assert_eq!(out.code, 0, "{}", out.stderr);
    let summary = out.json();
    assert_eq!(summary["published"], 5, "{summary}");
    assert_eq!(summary["incomplete"], 1, "{summary}");
    assert_eq!(summary["not_envelopes"], 1, "{summary}");
    assert_eq!(
        summary["skipped"][0]["shard"], "shardId-000000000000",
        "{summary}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn timestamps_are_read_as_written_and_a_replay_into_no_stream_fails() {
    if !emulators_enabled() {
        return;
    }
    let aws = Aws::from_env().await;
    let kinesis = aws.admin().unwrap();
    let stream = unique("cli-times");
    kinesis.create_stream(&stream, 1).await.unwrap();
    // Epoch seconds where milliseconds are expected: refused, saying what they would be.
    let out = run(&[
        "group",
        "reset",
        "--stream",
        &stream,
        "--group",
        "g",
        "--to",
        "timestamp",
        "1700000000",
    ])
    .await;
    assert_eq!(out.code, 2, "{}", out.stderr);
    assert!(
        out.stderr.contains("epoch seconds (2023-11-14T22:13:20Z)"),
        "{}",
        out.stderr
    );
    let out = run(&[
        "stream",
        "tail",
        &stream,
        "--from",
        "timestamp",
        "1700000000",
    ])
    .await;
    assert_eq!(out.code, 2, "{}", out.stderr);
    assert!(out.stderr.contains("epoch seconds"), "{}", out.stderr);

    // RFC 3339 with an offset: now's UTC clock reading at +01:00 is an hour ago, before
    // both records.
    let with_offset = aws_smithy_types::DateTime::from(SystemTime::now())
        .fmt(aws_smithy_types::date_time::Format::DateTime)
        .unwrap()
        .replace('Z', "+01:00");
    put_texts(
        kinesis.as_ref(),
        &stream,
        &["one".to_owned(), "two".to_owned()],
    )
    .await;
    let out = run(&[
        "stream",
        "tail",
        &stream,
        "--from",
        "timestamp",
        &with_offset,
        "--limit",
        "2",
    ])
    .await;
    assert_eq!(out.code, 0, "{with_offset}: {}", out.stderr);
    assert_eq!(out.stdout.lines().count(), 2, "{}", out.stdout);

    // A time in the future: a warning.
    let ahead = SystemTime::now() + Duration::from_secs(3600);
    let ahead = aws_smithy_types::DateTime::from(ahead)
        .fmt(aws_smithy_types::date_time::Format::DateTime)
        .unwrap();
    let out = run(&[
        "group",
        "reset",
        "--stream",
        &stream,
        "--group",
        &unique("no-group"),
        "--to",
        "timestamp",
        &ahead,
    ])
    .await;
    assert!(out.stderr.contains("is in the future"), "{}", out.stderr);

    // A replay into a stream that does not exist fails, even with nothing to replay.
    let dlq = unique("cli-dlq");
    kinesis.create_stream(&dlq, 1).await.unwrap();
    let out = run(&[
        "dlq",
        "replay",
        "--from",
        &dlq,
        "--to",
        &unique("no-such-stream"),
        "--yes",
    ])
    .await;
    assert_eq!(out.code, 1, "{}", out.stdout);
    assert!(out.stderr.contains("does not exist"), "{}", out.stderr);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reset_to_a_sequence_number_with_a_stream_that_does_not_exist_writes_nothing() {
    if !emulators_enabled() {
        return;
    }
    let aws = Aws::from_env().await;
    let kinesis = aws.admin().unwrap();
    let (stream, group) = (unique("cli-seq-typo"), unique("cli-seq-typo-g"));
    kinesis.create_stream(&stream, 2).await.unwrap();
    produce(kinesis.as_ref(), &stream, 0..20).await;
    let (shard0, shard1) = ("shardId-000000000000", "shardId-000000000001");
    let store = aws.lease_store(&group);
    store.ensure_table().await.unwrap();
    for shard in [shard0, shard1] {
        let row = shardflow::lease::Lease::new(shard, Vec::new(), Checkpoint::TrimHorizon);
        assert!(store.create(&row).await.unwrap());
    }
    let before = checkpoints(&store.list().await.unwrap());
    let seq0 = first_sequence(kinesis.as_ref(), &stream, shard0).await;
    // The group's table, but --stream misspelt (or a stale SHARDFLOW_STREAM): no shard
    // can be checked, so shard 0's sequence number must not be stored in every row.
    let out = run(&[
        "group",
        "reset",
        "--stream",
        &format!("{stream}-typo"),
        "--group",
        &group,
        "--to",
        "sequence",
        &seq0,
        "--yes",
    ])
    .await;
    assert_ne!(out.code, 0, "{}\n{}", out.stdout, out.stderr);
    assert!(
        out.stderr.contains("-typo"),
        "names the stream: {}",
        out.stderr
    );
    let rows = store.list().await.unwrap();
    assert!(rows.iter().all(|r| r.reset_to.is_none()), "{rows:?}");
    assert_eq!(checkpoints(&rows), before, "nothing written");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dlq_replay_restart_replaces_a_progress_item_that_does_not_parse() {
    if !emulators_enabled() {
        return;
    }
    use aws_sdk_dynamodb::types::AttributeValue;
    let aws = Aws::from_env().await;
    let kinesis = aws.admin().unwrap();
    let (orders, dlq, table) = (
        unique("cli-orders"),
        unique("cli-dlq"),
        unique("cli-progress"),
    );
    kinesis.create_stream(&orders, 1).await.unwrap();
    kinesis.create_stream(&dlq, 1).await.unwrap();
    let (letters, expected) = many_letters(6, 2);
    put_dead_letters(kinesis.as_ref(), &dlq, &orders, &letters).await;
    let replay = [
        "dlq",
        "replay",
        "--from",
        &dlq,
        "--to",
        &orders,
        "--progress-table",
        &table,
        "--yes",
    ];
    let out = run(&replay).await;
    assert_eq!(out.code, 0, "{}\n{}", out.stdout, out.stderr);
    // The progress attribute damaged (by hand, or by another tool).
    aws.dynamodb_client()
        .update_item()
        .table_name(&table)
        .key("replay", AttributeValue::S(format!("{dlq} -> {orders}")))
        .update_expression("SET progress = :p")
        .expression_attribute_values(":p", AttributeValue::S("not json".into()))
        .send()
        .await
        .unwrap();
    let out = run(&replay).await;
    assert_eq!(out.code, 1, "{}\n{}", out.stdout, out.stderr);
    assert!(
        out.stderr.contains("--restart"),
        "the error offers --restart: {}",
        out.stderr
    );
    assert_eq!(
        read_all(kinesis.as_ref(), &orders).await.len(),
        letters.len(),
        "the refused run wrote nothing"
    );
    // What the error offers works: everything replayed from the start, once more.
    let mut restart = replay.to_vec();
    restart.push("--restart");
    let out = run(&restart).await;
    assert_eq!(out.code, 0, "{}\n{}", out.stdout, out.stderr);
    let got = payloads_by_key(kinesis.as_ref(), &orders).await;
    assert_eq!(
        repeats_in_key_order(&got, &expected, true),
        letters.len(),
        "every dead letter twice: {got:?}"
    );
    // And the item parses again: a rerun publishes nothing.
    let out = run(&replay).await;
    assert_eq!(out.code, 0, "{}\n{}", out.stdout, out.stderr);
    assert_eq!(
        read_all(kinesis.as_ref(), &orders).await.len(),
        2 * letters.len()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn describe_names_the_open_shards_that_have_no_lease() {
    if !emulators_enabled() {
        return;
    }
    let aws = Aws::from_env().await;
    let kinesis = aws.admin().unwrap();
    let (stream, group) = (unique("cli-nolease"), unique("cli-nolease-g"));
    kinesis.create_stream(&stream, 2).await.unwrap();
    let store = aws.lease_store(&group);
    store.ensure_table().await.unwrap();
    let describe = [
        "group",
        "describe",
        "--stream",
        &stream,
        "--group",
        &group,
        "--sample-ms",
        "0",
    ];
    let (shard0, shard1) = ("shardId-000000000000", "shardId-000000000001");
    // No row at all (no worker ever started, or the rows were deleted): nothing of the
    // stream is read, and the summary must say so rather than "max lag 0 ms" alone.
    let out = run(&describe).await;
    assert!(
        out.stdout
            .contains("2 open shards of the stream without a lease")
            && out.stdout.contains(shard0)
            && out.stdout.contains(shard1),
        "{}",
        out.stdout
    );
    // One row: the other shard is named.
    let row = shardflow::lease::Lease::new(shard0, Vec::new(), Checkpoint::TrimHorizon);
    assert!(store.create(&row).await.unwrap());
    let mut json = describe.to_vec();
    json.push("--json");
    let out = run(&json).await;
    assert_eq!(
        out.json()["shards_without_lease"],
        serde_json::json!([shard1]),
        "{}",
        out.stdout
    );
}

/// Every record of the one-shard `stream`, in order, read until a page comes back empty
/// after `expected` records (bounded by the test's limit).
async fn read_records(
    kinesis: &dyn KinesisApi,
    stream: &str,
    expected: usize,
) -> Vec<shardflow::kinesis::Record> {
    let shard = kinesis.list_shards(stream).await.unwrap()[0]
        .shard_id
        .clone();
    let mut it = kinesis
        .shard_iterator(stream, &shard, &StartingPosition::TrimHorizon)
        .await
        .unwrap();
    within(LIMIT, &format!("{expected} records of {stream}"), async {
        let mut records = Vec::new();
        loop {
            let page = kinesis.get_records(&it, 100).await.unwrap();
            let empty = page.records.is_empty();
            records.extend(page.records);
            if empty && records.len() >= expected {
                return records;
            }
            it = page.next_iterator.expect("an open shard");
            if empty {
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        }
    })
    .await
}

/// A dead letter of several MiB, from a stream set for large records (Kinesis'
/// `UpdateMaxRecordSize`), replayed by the binary byte for byte: dead-lettered whole into
/// a dead-letter stream set for 10 MiB records, and in parts into one of 1 MiB records,
/// then re-published by `dlq replay` into a stream set for 10 MiB records. It runs on
/// kinesis-local, which models a stream's maximum record size; kinesalite refuses every
/// record over 1 MiB.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dlq_replay_republishes_a_dead_letter_of_several_mib_byte_exact() {
    use rand::{Rng, SeedableRng};
    if !emulators_enabled() {
        return;
    }
    let Ok(endpoint) = std::env::var("SHARDFLOW_FANOUT_KINESIS_ENDPOINT") else {
        eprintln!("skipped: SHARDFLOW_FANOUT_KINESIS_ENDPOINT not set (run scripts/test.sh)");
        return;
    };
    let env = [("AWS_ENDPOINT_URL_KINESIS", endpoint.as_str())];
    let default = Aws::from_env().await;
    let client = aws_sdk_kinesis::Client::from_conf(
        default
            .kinesis_client()
            .config()
            .to_builder()
            .endpoint_url(&endpoint)
            .build(),
    );
    let aws = Aws::from_clients(client.clone(), default.dynamodb_client().clone());
    let kinesis = aws.admin().unwrap();
    let set_max_record_size = |stream: String, kib: i32| {
        let (client, kinesis) = (client.clone(), kinesis.clone());
        async move {
            wait_until_active(kinesis.as_ref(), &stream).await;
            let summary = client
                .describe_stream_summary()
                .stream_name(&stream)
                .send()
                .await
                .unwrap();
            let arn = summary
                .stream_description_summary()
                .unwrap()
                .stream_arn()
                .to_owned();
            client
                .update_max_record_size()
                .stream_arn(arn)
                .max_record_size_in_kib(kib)
                .send()
                .await
                .unwrap();
            wait_until_active(kinesis.as_ref(), &stream).await;
        }
    };
    // 3 MiB of seeded bytes: more than Kinesis' default 1 MiB, and its envelope (base64
    // inside JSON) still goes in one HTTP request to kinesis-local, which hangs up on
    // request bodies of about 8 MB and more.
    let mut big = vec![0u8; 3 * 1024 * 1024];
    rand::rngs::SmallRng::seed_from_u64(11).fill(big.as_mut_slice());
    let big = Bytes::from(big);

    for (dlq_kib, whole) in [(10_240, true), (1_024, false)] {
        let (scans, dlq) = (unique("cli-big-scans"), unique("cli-big-dlq"));
        kinesis.create_stream(&scans, 1).await.unwrap();
        kinesis.create_stream(&dlq, 1).await.unwrap();
        set_max_record_size(scans.clone(), 10_240).await;
        set_max_record_size(dlq.clone(), dlq_kib).await;

        let producer = Producer::builder()
            .stream(&dlq)
            .backend(aws.clone())
            .build()
            .unwrap();
        let record = DeadLetterRecord {
            metadata: Metadata::builder()
                .stream(scans.as_str())
                .partition_key("scan-1")
                .sequence_number(42u64)
                .build(),
            payload: big.clone(),
            error: "refused".into(),
            attempts: Some(3),
            headers: Headers::new(),
        };
        ProducerSink::new(producer.clone())
            .oneshot(record)
            .await
            .unwrap();
        producer.close().await;
        let stored = read_records(kinesis.as_ref(), &dlq, 1).await;
        if whole {
            assert_eq!(stored.len(), 1, "one record of a stream set for 10 MiB");
        } else {
            assert!(
                stored.len() > 1 && stored.iter().all(|r| r.data.len() <= 1024 * 1024),
                "parts of at most 1 MiB: {:?}",
                stored.iter().map(|r| r.data.len()).collect::<Vec<_>>()
            );
        }

        let out = run_with(
            &["dlq", "replay", "--from", &dlq, "--to", &scans, "--yes"],
            &env,
        )
        .await;
        assert_eq!(out.code, 0, "{}\n{}", out.stdout, out.stderr);
        let replayed = read_records(kinesis.as_ref(), &scans, 1).await;
        assert_eq!(replayed.len(), 1, "the dead letter published once");
        assert_eq!(replayed[0].partition_key, "scan-1");
        let data = &replayed[0].data;
        let payload = HeaderFormat::Auto
            .read(data)
            .map_or_else(|| data.clone(), |(_, payload)| payload);
        assert!(
            payload == big,
            "the replayed payload is the {} bytes that were dead-lettered (got {} bytes)",
            big.len(),
            payload.len()
        );
    }
}

/// A table on moto's server (DynamoDB with DynamoDB Streams) with a stream of new and old
/// images, `writes` items put into it; the client and the table's stream ARN.
async fn table_with_changes(
    table: &str,
    writes: usize,
) -> Option<(aws_sdk_dynamodb::Client, String)> {
    use aws_sdk_dynamodb::types::{
        AttributeDefinition, AttributeValue, BillingMode, KeySchemaElement, KeyType,
        ScalarAttributeType, StreamSpecification, StreamViewType,
    };
    let endpoint = table_streams_endpoint()?;
    let sdk = aws_config::load_defaults(aws_config::BehaviorVersion::latest()).await;
    let dynamodb = aws_sdk_dynamodb::Client::from_conf(
        aws_sdk_dynamodb::config::Builder::from(&sdk)
            .endpoint_url(&endpoint)
            .build(),
    );
    let created = dynamodb
        .create_table()
        .table_name(table)
        .key_schema(
            KeySchemaElement::builder()
                .attribute_name("pk")
                .key_type(KeyType::Hash)
                .build()
                .unwrap(),
        )
        .attribute_definitions(
            AttributeDefinition::builder()
                .attribute_name("pk")
                .attribute_type(ScalarAttributeType::S)
                .build()
                .unwrap(),
        )
        .billing_mode(BillingMode::PayPerRequest)
        .stream_specification(
            StreamSpecification::builder()
                .stream_enabled(true)
                .stream_view_type(StreamViewType::NewAndOldImages)
                .build()
                .unwrap(),
        )
        .send()
        .await
        .expect("CreateTable");
    let arn = created
        .table_description
        .and_then(|t| t.latest_stream_arn)
        .expect("LatestStreamArn");
    for i in 0..writes {
        dynamodb
            .put_item()
            .table_name(table)
            .item("pk", AttributeValue::S(format!("order-{i}")))
            .item("n", AttributeValue::N(i.to_string()))
            .send()
            .await
            .expect("PutItem");
    }
    Some((dynamodb, arn))
}

#[tokio::test]
async fn a_table_stream_is_tailed_described_and_reset() {
    use aws_sdk_dynamodb::types::AttributeValue;
    let table = unique("cli-orders");
    let Some((dynamodb, arn)) = table_with_changes(&table, 5).await else {
        return;
    };
    let endpoint = table_streams_endpoint().unwrap_or_default();
    // The CLI talks to moto for DynamoDB (the lease table too) and DynamoDB Streams.
    let env = [
        ("AWS_ENDPOINT_URL_DYNAMODB", endpoint.as_str()),
        ("AWS_ENDPOINT_URL_DYNAMODB_STREAMS", endpoint.as_str()),
    ];

    // tail by table name: the changes' JSON, one per write, keyed by the item.
    let out = run_with(
        &[
            "stream",
            "tail",
            "--table-stream",
            &table,
            "--from",
            "trim-horizon",
            "--limit",
            "5",
            "--format",
            "json",
        ],
        &env,
    )
    .await;
    assert_eq!(out.code, 0, "{}", out.stderr);
    let lines: Vec<Value> = out
        .stdout
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(lines.len(), 5, "{}", out.stdout);
    let mut sequences = Vec::new();
    for (i, line) in lines.iter().enumerate() {
        let change: Value = serde_json::from_str(line["data"].as_str().unwrap()).unwrap();
        assert_eq!(change["eventName"], "INSERT", "{line}");
        assert_eq!(
            change["dynamodb"]["Keys"]["pk"]["S"],
            format!("order-{i}"),
            "{line}"
        );
        assert_eq!(line["aggregated"], false);
        sequences.push(line["sequence_number"].as_str().unwrap().to_owned());
    }
    let shard = lines[0]["shard"].as_str().unwrap().to_owned();

    // An adapter application's lease table, checkpointed after the second change.
    let leases = unique("cli-orders-app");
    let store = shardflow::lease::dynamo::DynamoLeaseStore::new(dynamodb.clone(), &leases);
    store.ensure_table().await.unwrap();
    let row = std::collections::HashMap::from([
        ("leaseKey".to_owned(), AttributeValue::S(shard.clone())),
        ("leaseCounter".to_owned(), AttributeValue::N("12".into())),
        (
            "ownerSwitchesSinceCheckpoint".to_owned(),
            AttributeValue::N("0".into()),
        ),
        (
            "checkpoint".to_owned(),
            AttributeValue::S(sequences[1].clone()),
        ),
        (
            "checkpointSubSequenceNumber".to_owned(),
            AttributeValue::N("0".into()),
        ),
        ("startingHashKey".to_owned(), AttributeValue::S("0".into())),
        ("endingHashKey".to_owned(), AttributeValue::S("1".into())),
    ]);
    dynamodb
        .put_item()
        .table_name(&leases)
        .set_item(Some(row))
        .send()
        .await
        .unwrap();

    // describe by stream ARN: the shard, its checkpoint and the 3 changes behind it.
    let out = run_with(
        &[
            "group",
            "describe",
            "--table-stream",
            &arn,
            "--table",
            &leases,
            "--json",
            "--count",
            "--sample-ms",
            "0",
        ],
        &env,
    )
    .await;
    assert_eq!(out.code, 0, "{}", out.stderr);
    let described = out.json();
    assert_eq!(described["stream"], arn.as_str(), "{described}");
    assert_eq!(
        described["shards"][0]["shard"],
        shard.as_str(),
        "{described}"
    );
    assert_eq!(described["records_behind"], 3, "{described}");

    // reset to trim-horizon: the adapter's row, moved, its range kept.
    let out = run_with(
        &[
            "group",
            "reset",
            "--table-stream",
            &table,
            "--table",
            &leases,
            "--to",
            "trim-horizon",
            "--yes",
        ],
        &env,
    )
    .await;
    assert_eq!(out.code, 0, "{}\n{}", out.stdout, out.stderr);
    let item = dynamodb
        .get_item()
        .table_name(&leases)
        .key("leaseKey", AttributeValue::S(shard.clone()))
        .consistent_read(true)
        .send()
        .await
        .unwrap()
        .item
        .unwrap();
    assert_eq!(item["checkpoint"], AttributeValue::S("TRIM_HORIZON".into()));
    assert_eq!(item["endingHashKey"], AttributeValue::S("1".into()));
}

/// `group delete --table-stream` deletes the lease table of that table's stream only: a
/// table without a stream, or a lease table whose rows name another stream, is an error
/// and nothing is deleted; the group's own table (rows naming its stream, or an adapter
/// application's rows naming none) is deleted.
#[tokio::test]
async fn group_delete_by_table_stream_deletes_only_that_streams_lease_table() {
    use aws_sdk_dynamodb::types::AttributeValue;
    let table = unique("cli-del-orders");
    let Some((dynamodb, arn)) = table_with_changes(&table, 1).await else {
        return;
    };
    let endpoint = table_streams_endpoint().unwrap_or_default();
    let env = [
        ("AWS_ENDPOINT_URL_DYNAMODB", endpoint.as_str()),
        ("AWS_ENDPOINT_URL_DYNAMODB_STREAMS", endpoint.as_str()),
    ];
    let other =
        "arn:aws:dynamodb:us-east-1:123456789012:table/other/stream/2026-01-01T00:00:00.000";
    let lease_table = |stream: Option<&str>| {
        let dynamodb = dynamodb.clone();
        let stream = stream.map(str::to_owned);
        async move {
            let name = unique("cli-del-leases");
            let store = shardflow::lease::dynamo::DynamoLeaseStore::new(dynamodb.clone(), &name);
            store.ensure_table().await.unwrap();
            let mut row = std::collections::HashMap::from([
                (
                    "leaseKey".to_owned(),
                    AttributeValue::S("shardId-00000001700000000000-0000aaaa".into()),
                ),
                ("leaseCounter".to_owned(), AttributeValue::N("3".into())),
                (
                    "checkpoint".to_owned(),
                    AttributeValue::S("TRIM_HORIZON".into()),
                ),
                (
                    "ownerSwitchesSinceCheckpoint".to_owned(),
                    AttributeValue::N("0".into()),
                ),
            ]);
            if let Some(stream) = stream {
                row.insert("streamName".to_owned(), AttributeValue::S(stream));
            }
            dynamodb
                .put_item()
                .table_name(&name)
                .set_item(Some(row))
                .send()
                .await
                .unwrap();
            name
        }
    };
    let exists = |name: String| {
        let dynamodb = dynamodb.clone();
        async move {
            dynamodb
                .describe_table()
                .table_name(name)
                .send()
                .await
                .is_ok()
        }
    };
    let delete = |given: String, leases: String| async move {
        run_with(
            &[
                "group",
                "delete",
                "--table-stream",
                &given,
                "--table",
                &leases,
                "--yes",
                "--sample-ms",
                "0",
            ],
            &env,
        )
        .await
    };

    // Another stream's lease table, named through this table or its stream's ARN: kept.
    let others = lease_table(Some(other)).await;
    for given in [table.clone(), arn.clone()] {
        let out = delete(given.clone(), others.clone()).await;
        assert_eq!(out.code, 1, "{given}: {}{}", out.stdout, out.stderr);
        assert!(out.stderr.contains(other), "{}", out.stderr);
        assert!(
            exists(others.clone()).await,
            "{given}: the lease table of another stream is kept"
        );
    }
    // A table that has no stream (here: no table at all): kept.
    let out = delete(unique("cli-del-missing"), others.clone()).await;
    assert_eq!(out.code, 1, "{}{}", out.stdout, out.stderr);
    assert!(
        exists(others).await,
        "nothing deleted for a table without a stream"
    );

    // The group's own table (its rows name the stream), and an adapter's (rows name
    // none): deleted.
    for rows_name in [Some(arn.as_str()), None] {
        let own = lease_table(rows_name).await;
        let out = delete(table.clone(), own.clone()).await;
        assert_eq!(out.code, 0, "{rows_name:?}: {}{}", out.stdout, out.stderr);
        assert!(
            !exists(own).await,
            "{rows_name:?}: the group's table is deleted"
        );
    }
}
