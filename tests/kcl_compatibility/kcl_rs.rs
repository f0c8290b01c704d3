//! A real KCL 3.5 application (kcl-rs, a Rust port of the Java KCL 3 with a Python API:
//! `kcl_rs_app.py` beside this file) moves to shardflow in place and back, on the
//! emulators: kcl-rs creates its single-table lease table and reads the first records,
//! shardflow takes the table over and reads the next ones, then kcl-rs takes it back and
//! reads the last ones. Each reads exactly its own records: 0 lost, 0 re-read.
//!
//! `scripts/test.sh` installs kcl-rs into `.cache/kpl-venv` (from
//! `scripts/kpl-requirements.txt`) and names its Python in `SHARDFLOW_KPL_PYTHON`; run
//! without the emulators the test is skipped.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::Duration;

use aws_sdk_dynamodb::types::AttributeValue;
use shardflow::consumer::InitialPosition;
use shardflow::Backend;
use testkit::*;

use super::migration::{assert_kcl_reads, read_shard};

const TEST_LIMIT: Duration = Duration::from_secs(900);
/// How long a kcl-rs worker may take to read what is waiting (its start-up runs on
/// timers: about 40 s here).
const KCL_LIMIT: Duration = Duration::from_secs(240);

/// The Python with kcl-rs installed, under `scripts/test.sh`.
fn kcl_rs_python() -> PathBuf {
    std::env::var_os("SHARDFLOW_KPL_PYTHON")
        .expect("scripts/test.sh runs this test but SHARDFLOW_KPL_PYTHON is not set")
        .into()
}

/// The values a kcl-rs run wrote to `out`, one per line, with how often each came.
fn values_in(out: &Path) -> BTreeMap<usize, usize> {
    let mut seen = BTreeMap::new();
    for line in std::fs::read_to_string(out).unwrap_or_default().lines() {
        *seen.entry(line.parse().unwrap()).or_default() += 1;
    }
    seen
}

/// Runs the kcl-rs application on `stream` with the lease table `application` until it
/// wrote every value of `expected`, then stops it gracefully; what it wrote.
async fn run_kcl_rs(
    python: &Path,
    dir: &Path,
    stream: &str,
    application: &str,
    expected: &BTreeSet<usize>,
) -> BTreeMap<usize, usize> {
    let run = unique("run");
    let (out, stop, log) = (
        dir.join(format!("{run}.out")),
        dir.join(format!("{run}.stop")),
        dir.join(format!("{run}.log")),
    );
    let mut child = tokio::process::Command::new(python)
        .arg(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/tests/kcl_compatibility/kcl_rs_app.py"
        ))
        .args([stream, application])
        .arg(&out)
        .arg(&stop)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(&log).unwrap())
        .kill_on_drop(true)
        .spawn()
        .expect("start kcl-rs");
    let done = async {
        loop {
            let seen = values_in(&out);
            if expected.iter().all(|v| seen.contains_key(v)) {
                return;
            }
            if let Ok(Some(status)) = child.try_wait() {
                panic!(
                    "kcl-rs exited ({status}): {}",
                    std::fs::read_to_string(&log).unwrap_or_default()
                );
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    };
    if tokio::time::timeout(KCL_LIMIT, done).await.is_err() {
        panic!(
            "kcl-rs did not read {} records within {KCL_LIMIT:?} (read {:?}); its log: {}",
            expected.len(),
            values_in(&out).len(),
            std::fs::read_to_string(&log).unwrap_or_default()
        );
    }
    std::fs::write(&stop, b"").unwrap();
    let status = within(Duration::from_secs(120), "kcl-rs stops", child.wait())
        .await
        .unwrap();
    assert!(status.success(), "kcl-rs: {status}");
    values_in(&out)
}

/// Exactly `expected`, each once.
fn assert_exactly(seen: &BTreeMap<usize, usize>, expected: &BTreeSet<usize>, who: &str) {
    let got: BTreeSet<usize> = seen.keys().copied().collect();
    let lost: Vec<&usize> = expected.difference(&got).collect();
    let re_read: Vec<&usize> = got.difference(expected).collect();
    let twice: Vec<&usize> = seen
        .iter()
        .filter(|(_, c)| **c > 1)
        .map(|(v, _)| v)
        .collect();
    assert!(
        lost.is_empty(),
        "{who} lost {} records: {lost:?}",
        lost.len()
    );
    assert!(
        re_read.is_empty(),
        "{who} re-read {} records: {re_read:?}",
        re_read.len()
    );
    assert!(twice.is_empty(), "{who} delivered twice: {twice:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_kcl_rs_application_moves_to_shardflow_and_back() {
    if !emulators_enabled() {
        return;
    }
    within(
        TEST_LIMIT,
        "kcl-rs to shardflow and back",
        kcl_rs_round_trip(),
    )
    .await;
}

async fn kcl_rs_round_trip() {
    let python = kcl_rs_python();
    let dir = std::env::temp_dir().join(unique("kcl-rs"));
    std::fs::create_dir_all(&dir).unwrap();
    let aws = shardflow::Aws::from_env().await;
    let kinesis = aws.admin().unwrap();
    let stream = unique("kclrs");
    let application = unique("kclrs-app");
    kinesis.create_stream(&stream, 2).await.unwrap();
    wait_until_active(kinesis.as_ref(), &stream).await;
    let shards = open_shards(kinesis.as_ref(), &stream).await;

    // 1. kcl-rs: a new application, its table in the single-table format.
    produce(kinesis.as_ref(), &stream, 0..100).await;
    let first: BTreeSet<usize> = (0..100).collect();
    let seen = run_kcl_rs(&python, &dir, &stream, &application, &first).await;
    assert_exactly(&seen, &first, "kcl-rs");
    let rows = aws
        .dynamodb_client()
        .scan()
        .table_name(&application)
        .consistent_read(true)
        .send()
        .await
        .unwrap()
        .items
        .unwrap_or_default();
    let leases: Vec<_> = rows
        .iter()
        .filter(|r| r.get("entityType") == Some(&AttributeValue::S("LEASE".into())))
        .collect();
    assert_eq!(leases.len(), shards.len(), "kcl-rs's leases: {rows:?}");

    // 2. shardflow takes the table over: exactly the records after kcl-rs's checkpoints.
    produce(kinesis.as_ref(), &stream, 100..200).await;
    let second: BTreeSet<usize> = (100..200).collect();
    let recorder = Recorder::default();
    let running = start(
        test_consumer(aws.clone(), &stream, &unique("billing"), "w1")
            .lease_table(&application)
            .initial_position(InitialPosition::TrimHorizon)
            .build()
            .unwrap(),
        &recorder,
    );
    recorder
        .wait_for(second.len(), Duration::from_secs(120))
        .await;
    running.stop().await;
    let mut handled: BTreeMap<usize, usize> = BTreeMap::new();
    for h in recorder.snapshot() {
        *handled.entry(h.value).or_default() += 1;
    }
    assert_exactly(&handled, &second, "shardflow");
    // What it leaves reads as the KCL reads it, every lease still tagged.
    let rows = aws
        .dynamodb_client()
        .scan()
        .table_name(&application)
        .consistent_read(true)
        .send()
        .await
        .unwrap()
        .items
        .unwrap_or_default();
    for shard in &shards {
        let row = rows
            .iter()
            .find(|r| r.get("leaseKey") == Some(&AttributeValue::S(shard.shard_id.clone())))
            .unwrap();
        assert_kcl_reads(row);
        assert_eq!(
            row.get("entityType"),
            Some(&AttributeValue::S("LEASE".into()))
        );
        let last = read_shard(kinesis.as_ref(), &stream, &shard.shard_id)
            .await
            .pop()
            .unwrap();
        assert_eq!(row["checkpoint"], AttributeValue::S(last.1), "{row:?}");
    }

    // 3. kcl-rs takes it back: exactly the records after shardflow's checkpoints.
    produce(kinesis.as_ref(), &stream, 200..300).await;
    let third: BTreeSet<usize> = (200..300).collect();
    let seen = run_kcl_rs(&python, &dir, &stream, &application, &third).await;
    assert_exactly(&seen, &third, "kcl-rs after shardflow");
    let _ = std::fs::remove_dir_all(&dir);
}
