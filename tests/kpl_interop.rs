//! KPL aggregates against an independent implementation: awslabs' `aws-kinesis-agg`
//! (Python, from PyPI), run by `scripts/kpl_interop.py`. What [`Aggregator`] writes,
//! its de-aggregator reads back (partition keys, explicit hash keys, data, order); what
//! its aggregator writes, [`deaggregate`] reads back. The same user records, drawn from
//! a fixed seed, go both ways.
//!
//! `scripts/test.sh` installs the package into `.cache/kpl-venv` and names its Python in
//! `SHARDFLOW_KPL_PYTHON`. Run on its own (`cargo test`), this file's tests say they are
//! skipped and pass; under `scripts/test.sh` a missing interpreter fails them.

use std::path::PathBuf;
use std::process::Command;

use bytes::Bytes;
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};
use serde_json::{json, Value};
use shardflow::aggregation::{deaggregate, Aggregator, Deaggregated};
use shardflow::kinesis::{PutRecord, Record};

/// The Python with `aws-kinesis-agg`, or `None` (after saying so) outside
/// `scripts/test.sh`.
fn kpl_python() -> Option<PathBuf> {
    match std::env::var_os("SHARDFLOW_KPL_PYTHON") {
        Some(python) => Some(python.into()),
        None if std::env::var_os("SHARDFLOW_EMULATORS").is_some() => {
            panic!("scripts/test.sh runs this test but SHARDFLOW_KPL_PYTHON is not set")
        }
        None => {
            eprintln!(
                "skipped: aws-kinesis-agg is not installed (run scripts/test.sh, which \
                 installs it into .cache/kpl-venv and sets SHARDFLOW_KPL_PYTHON)"
            );
            None
        }
    }
}

/// Runs `scripts/kpl_interop.py MODE` on `records`; its JSON answer.
fn interop(python: &PathBuf, mode: &str, records: &[Value]) -> Value {
    let dir = std::env::temp_dir().join(format!("shardflow-kpl-{}-{mode}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let input = dir.join("in.json");
    std::fs::write(&input, serde_json::to_vec(records).unwrap()).unwrap();
    let script = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("scripts/kpl_interop.py");
    let out = Command::new(python)
        .arg(script)
        .arg(mode)
        .arg(&input)
        .output()
        .unwrap();
    let _ = std::fs::remove_dir_all(&dir);
    assert!(
        out.status.success() && out.stderr.is_empty(),
        "kpl_interop.py {mode}: {}\n{}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).unwrap()
}

fn hex(data: &[u8]) -> String {
    data.iter().map(|b| format!("{b:02x}")).collect()
}

fn unhex(s: &str) -> Vec<u8> {
    (0..s.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&s[i..i + 2], 16).unwrap())
        .collect()
}

fn to_json(r: &PutRecord) -> Value {
    json!({
        "partition_key": r.partition_key,
        "explicit_hash_key": r.explicit_hash_key,
        "data_hex": hex(&r.data),
    })
}

/// 600 user records from a fixed seed: shared, non-ASCII and 256-character partition
/// keys; explicit hash keys on a third of them (both ends of the range among them);
/// empty, small and multi-KiB payloads. About 30 aggregates of the KPL's 50 KiB.
fn user_records() -> Vec<PutRecord> {
    let mut rng = SmallRng::seed_from_u64(19);
    let mut keys: Vec<String> = (0..10).map(|i| format!("pk-{i}")).collect();
    keys.extend(["ключ-🔑".into(), "キー".into(), "k".repeat(256)]);
    (0..600)
        .map(|_| {
            let partition_key = keys[rng.gen_range(0..keys.len())].clone();
            let explicit_hash_key = match rng.gen_range(0..30) {
                0 => Some("0".to_owned()),
                1 => Some(u128::MAX.to_string()),
                2..=9 => Some(rng.gen::<u128>().to_string()),
                _ => None,
            };
            let len = match rng.gen_range(0..10) {
                0 => 0,
                1..=6 => rng.gen_range(1..200),
                _ => rng.gen_range(1_000..6_000),
            };
            let data: Vec<u8> = (0..len).map(|_| rng.gen()).collect();
            PutRecord {
                data: Bytes::from(data),
                partition_key,
                explicit_hash_key,
            }
        })
        .collect()
}

#[test]
fn aws_kinesis_agg_reads_what_the_aggregator_writes() {
    let Some(python) = kpl_python() else { return };
    let users = user_records();
    let mut aggregator = Aggregator::with_max_size(51_200);
    let mut written = Vec::new();
    for user in &users {
        if let Some(full) = aggregator.add(user.clone()).unwrap() {
            written.push(full);
        }
    }
    written.extend(aggregator.flush());
    assert!(written.len() > 10, "only {} aggregates", written.len());

    let json: Vec<Value> = written.iter().map(to_json).collect();
    let read = interop(&python, "read", &json);
    let read = read.as_array().unwrap();
    assert_eq!(read.len(), written.len());
    let mut got = Vec::new();
    for users_read in read {
        for (n, u) in users_read.as_array().unwrap().iter().enumerate() {
            // Each one came out of an aggregate (the reader checked the magic and the
            // MD5, and parsed the protobuf), at its place in it.
            assert_eq!(u["aggregated"], json!(true));
            assert_eq!(u["sub_sequence"], json!(n));
            got.push(u);
        }
    }
    assert_eq!(got.len(), users.len(), "every user record, once");
    for (i, (user, u)) in users.iter().zip(&got).enumerate() {
        assert_eq!(u["partition_key"], json!(user.partition_key), "record {i}");
        assert_eq!(
            unhex(u["data_hex"].as_str().unwrap()),
            user.data,
            "record {i}"
        );
        // aws-kinesis-agg's reader gives a user record without an explicit hash key the
        // first one of its aggregate's table (it does not look whether the field is
        // set), so only the ones given are compared.
        if let Some(ehk) = &user.explicit_hash_key {
            assert_eq!(u["explicit_hash_key"], json!(ehk), "record {i}");
        }
    }
}

#[test]
fn deaggregate_reads_what_aws_kinesis_agg_writes() {
    let Some(python) = kpl_python() else { return };
    let users = user_records();
    let json: Vec<Value> = users.iter().map(to_json).collect();
    let written = interop(&python, "write", &json);
    let written = written.as_array().unwrap();
    assert!(written.len() > 10, "only {} aggregates", written.len());

    let mut got = Vec::new();
    for (i, w) in written.iter().enumerate() {
        let record = Record {
            sequence_number: format!("{}", i + 1).parse().unwrap(),
            partition_key: w["partition_key"].as_str().unwrap().to_owned(),
            data: Bytes::from(unhex(w["data_hex"].as_str().unwrap())),
            approximate_arrival: None,
        };
        match deaggregate(record) {
            Deaggregated::Aggregated { user_records, .. } => {
                for (n, u) in user_records.iter().enumerate() {
                    assert_eq!(u.sub_sequence, n as u64);
                }
                got.extend(
                    user_records
                        .into_iter()
                        .map(|u| (u.partition_key, u.explicit_hash_key, u.data)),
                );
            }
            other => panic!("aggregate {i} did not decode: {other:?}"),
        }
    }
    let expected: Vec<_> = users
        .into_iter()
        .map(|u| (u.partition_key, u.explicit_hash_key, u.data))
        .collect();
    assert_eq!(got.len(), expected.len(), "every user record, once");
    for (i, (g, e)) in got.iter().zip(&expected).enumerate() {
        assert_eq!(g, e, "user record {i}");
    }
}
