//! KPL de-aggregation (`shardflow::aggregation`) against records written by an
//! independent implementation, and property tests of the decoder and the aggregator.
//!
//! The fixtures in `tests/fixtures/kpl/` were written by `scripts/kpl_fixtures.py` with
//! awslabs' Python aggregation library (`aws-kinesis-agg` 1.2.3 from PyPI) and the
//! protobuf classes it ships; `manifest.json` lists, for each file, the user records
//! given to that library (the writer's intent, not a decoder's reading) or the error a
//! corrupt file must be reported with. The files are committed, so these tests need no
//! Python; the script's doc says how to make them again.
//!
//! Property tests run with fixed seeds: the same cases on every run and machine.

use std::cell::{Cell, RefCell};
use std::collections::BTreeSet;
use std::path::PathBuf;

use bytes::Bytes;
use proptest::prelude::*;
use proptest::test_runner::{Config, RngAlgorithm, TestRng, TestRunner};
use serde::Deserialize;
use shardflow::aggregation::{
    belongs_to_shard, deaggregate, AggregationError, Aggregator, AggregatorError, Deaggregated,
    UserRecord, MAGIC,
};
use shardflow::kinesis::{partition_hash, PutRecord, Record, MAX_RECORD_BYTES};
use shardflow::{Position, SequenceNumber};

const SEQUENCE: &str = "49590338271490256608559692538361571095921575989136588898";

#[derive(Deserialize)]
struct Manifest {
    fixtures: Vec<Fixture>,
}

#[derive(Deserialize)]
struct Fixture {
    file: String,
    expect: String,
    reason: Option<String>,
    #[serde(default)]
    user_records: Vec<ExpectedUser>,
}

#[derive(Deserialize)]
struct ExpectedUser {
    sub_sequence: u64,
    partition_key: String,
    explicit_hash_key: Option<String>,
    data_hex: String,
}

fn fixtures_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/kpl")
}

fn manifest() -> Manifest {
    let text = std::fs::read_to_string(fixtures_dir().join("manifest.json")).unwrap();
    serde_json::from_str(&text).unwrap()
}

fn fixture_bytes(file: &str) -> Bytes {
    std::fs::read(fixtures_dir().join(file)).unwrap().into()
}

fn unhex(s: &str) -> Vec<u8> {
    (0..s.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&s[i..i + 2], 16).unwrap())
        .collect()
}

fn record(data: Bytes) -> Record {
    Record {
        sequence_number: SequenceNumber::new(SEQUENCE).unwrap(),
        partition_key: "outer-key".into(),
        data,
        approximate_arrival: None,
    }
}

/// The `AggregationError` variant's name as the manifest writes it.
fn reason_name(e: &AggregationError) -> &'static str {
    match e {
        AggregationError::TooShort { .. } => "too_short",
        AggregationError::DigestMismatch => "digest_mismatch",
        AggregationError::Malformed(_) => "malformed",
        AggregationError::MissingField { .. } => "missing_field",
        AggregationError::PartitionKeyIndexOutOfRange { .. } => "partition_key_index_out_of_range",
        AggregationError::ExplicitHashKeyIndexOutOfRange { .. } => {
            "explicit_hash_key_index_out_of_range"
        }
        AggregationError::InvalidExplicitHashKey { .. } => "invalid_explicit_hash_key",
        AggregationError::NoRecords => "no_records",
        other => panic!("give the new variant a name here: {other:?}"),
    }
}

fn assert_untouched(got: &Record, data: &Bytes) {
    assert_eq!(got.data, *data);
    assert_eq!(
        got.data.as_ptr(),
        data.as_ptr(),
        "the record's data was copied"
    );
    assert_eq!(got.partition_key, "outer-key");
    assert_eq!(got.sequence_number.as_str(), SEQUENCE);
}

#[test]
fn every_fixture_decodes_as_its_manifest_says() {
    let manifest = manifest();
    assert!(manifest.fixtures.len() >= 15, "fixture set shrank");
    for fixture in &manifest.fixtures {
        let file = fixture.file.as_str();
        let data = fixture_bytes(file);
        match (fixture.expect.as_str(), deaggregate(record(data.clone()))) {
            (
                "aggregated",
                Deaggregated::Aggregated {
                    record,
                    user_records,
                },
            ) => {
                assert_untouched(&record, &data);
                assert_eq!(user_records.len(), fixture.user_records.len(), "{file}");
                for (i, (got, want)) in user_records.iter().zip(&fixture.user_records).enumerate() {
                    assert_eq!(got.sub_sequence, i as u64, "{file}");
                    assert_eq!(got.sub_sequence, want.sub_sequence, "{file}");
                    assert_eq!(got.partition_key, want.partition_key, "{file} #{i}");
                    assert_eq!(got.explicit_hash_key, want.explicit_hash_key, "{file} #{i}");
                    assert_eq!(got.data, unhex(&want.data_hex), "{file} #{i}");
                }
            }
            ("corrupt", Deaggregated::Corrupt { record, reason }) => {
                assert_untouched(&record, &data);
                assert_eq!(
                    Some(reason_name(&reason)),
                    fixture.reason.as_deref(),
                    "{file}"
                );
                // Safe to log: the message names no key and no payload byte.
                assert!(!reason.to_string().is_empty());
            }
            ("plain", Deaggregated::Plain(record)) => assert_untouched(&record, &data),
            (expect, got) => panic!("{file}: expected {expect}, got {got:?}"),
        }
    }
}

#[test]
fn every_fixture_file_is_in_the_manifest() {
    let listed: BTreeSet<String> = manifest().fixtures.into_iter().map(|f| f.file).collect();
    let on_disk: BTreeSet<String> = std::fs::read_dir(fixtures_dir())
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .filter(|name| name.ends_with(".bin"))
        .collect();
    assert_eq!(listed, on_disk);
}

#[test]
fn large_fixtures_hold_what_they_claim() {
    let count = |file: &str| match deaggregate(record(fixture_bytes(file))) {
        Deaggregated::Aggregated { user_records, .. } => user_records.len(),
        other => panic!("{file}: {other:?}"),
    };
    assert_eq!(count("five_hundred.bin"), 500);
    // 40 records over several aggregates whose sub-sequence numbers each start at 0.
    let split: usize = (0..4).map(|i| count(&format!("split_{i}.bin"))).sum();
    assert_eq!(split, 40);
}

/// Our aggregator writes, byte for byte, the data the awslabs Python library wrote for
/// the same user records: the encoding is the same, not just mutually readable.
#[test]
fn aggregator_writes_the_same_bytes_as_aws_kinesis_agg() {
    for fixture in manifest().fixtures {
        if fixture.expect != "aggregated" || fixture.file.starts_with("split") {
            continue; // the split files depend on the Python library's size accounting
        }
        let mut aggregator = Aggregator::new();
        for user in &fixture.user_records {
            let put = PutRecord {
                data: unhex(&user.data_hex).into(),
                partition_key: user.partition_key.clone(),
                explicit_hash_key: user.explicit_hash_key.clone(),
            };
            assert!(aggregator.add(put).unwrap().is_none(), "{}", fixture.file);
        }
        let put = aggregator.flush().unwrap();
        assert_eq!(put.data, fixture_bytes(&fixture.file), "{}", fixture.file);
        assert_eq!(put.partition_key, fixture.user_records[0].partition_key);
    }
}

#[test]
fn a_restart_inside_an_aggregate_resumes_after_the_checkpoint() {
    let Deaggregated::Aggregated {
        record,
        user_records,
    } = deaggregate(record(fixture_bytes("five_hundred.bin")))
    else {
        panic!("not aggregated")
    };
    let position = |u: &UserRecord| Position::new(record.sequence_number.clone(), u.sub_sequence);
    for handled in [0u64, 1, 250, 498, 499] {
        let checkpoint = Position::new(record.sequence_number.clone(), handled);
        // What the reader delivers after a restart: only positions past the checkpoint.
        // Decoding again gives the same numbering, so nothing is skipped or repeated.
        let again = match deaggregate(record.clone()) {
            Deaggregated::Aggregated { user_records, .. } => user_records,
            other => panic!("{other:?}"),
        };
        let resumed: Vec<u64> = again
            .iter()
            .filter(|u| position(u) > checkpoint)
            .map(|u| u.sub_sequence)
            .collect();
        let expected: Vec<u64> = (handled + 1..500).collect();
        assert_eq!(resumed, expected);
        let handled_before: Vec<_> = user_records
            .iter()
            .filter(|u| position(u) <= checkpoint)
            .collect();
        assert_eq!(handled_before.len() as u64 + resumed.len() as u64, 500);
    }
}

#[test]
fn shard_membership_uses_the_explicit_hash_key_else_the_partition_key_md5() {
    let Deaggregated::Aggregated { user_records, .. } =
        deaggregate(record(fixture_bytes("three_keys.bin")))
    else {
        panic!("not aggregated")
    };
    let [alpha, beta, gamma] = &user_records[..] else {
        panic!("three records expected")
    };
    let half = 1u128 << 127;
    // beta: EHK 2^128-1; gamma: EHK 0; alpha: MD5("alpha").
    assert!(belongs_to_shard(beta, half, u128::MAX));
    assert!(!belongs_to_shard(beta, 0, half - 1));
    assert!(belongs_to_shard(gamma, 0, 0));
    assert!(!belongs_to_shard(gamma, 1, u128::MAX));
    let h = partition_hash("alpha");
    assert_eq!(alpha.hash_key(), Some(h));
    assert!(belongs_to_shard(alpha, h, h));
    assert!(!belongs_to_shard(alpha, h.wrapping_add(1), u128::MAX) || h == u128::MAX);

    // A hand-built record whose hash key cannot be computed is never called misplaced.
    let odd = UserRecord {
        explicit_hash_key: Some("not a number".into()),
        ..alpha.clone()
    };
    assert_eq!(odd.hash_key(), None);
    assert!(belongs_to_shard(&odd, 0, 0));
}

#[test]
fn aggregator_refuses_what_consumers_could_not_read_and_gives_it_back() {
    let mut aggregator = Aggregator::new();
    aggregator
        .add(PutRecord {
            data: Bytes::from_static(b"pending"),
            partition_key: "p".into(),
            explicit_hash_key: None,
        })
        .unwrap();
    let bad = PutRecord {
        data: Bytes::from_static(b"x"),
        partition_key: "k".into(),
        explicit_hash_key: Some("2e10".into()),
    };
    let err = aggregator.add(bad).unwrap_err();
    assert!(matches!(
        err,
        AggregatorError::InvalidExplicitHashKey { .. }
    ));
    assert_eq!(err.into_record().data, "x");

    let huge = PutRecord {
        data: vec![0u8; MAX_RECORD_BYTES].into(),
        partition_key: "k".into(),
        explicit_hash_key: None,
    };
    match aggregator.add(huge) {
        Err(AggregatorError::TooLarge {
            record,
            size,
            max_size,
        }) => {
            assert_eq!(max_size, MAX_RECORD_BYTES);
            assert!(size > MAX_RECORD_BYTES);
            assert_eq!(record.data.len(), MAX_RECORD_BYTES);
        }
        other => panic!("{other:?}"),
    }
    // The pending record is still there, alone, so it goes out plain.
    assert_eq!(aggregator.len(), 1);
    let out = aggregator.flush().unwrap();
    assert_eq!(out.data, "pending");
    assert_eq!(out.explicit_hash_key, None);
    assert!(aggregator.flush().is_none());
}

#[test]
fn a_lone_record_that_looks_aggregated_is_still_framed() {
    let mut data = MAGIC.to_vec();
    data.extend_from_slice(b"user bytes that happen to start with the magic");
    let mut aggregator = Aggregator::new();
    aggregator
        .add(PutRecord {
            data: data.clone().into(),
            partition_key: "k".into(),
            explicit_hash_key: None,
        })
        .unwrap();
    let put = aggregator.flush().unwrap();
    assert_ne!(put.data, data);
    assert_eq!(put.explicit_hash_key, Some(partition_hash("k").to_string()));
    match deaggregate(record(put.data)) {
        Deaggregated::Aggregated { user_records, .. } => {
            assert_eq!(user_records.len(), 1);
            assert_eq!(user_records[0].data, data);
        }
        other => panic!("{other:?}"),
    }
}

// ---------------------------------------------------------------------------------------
// Properties (fixed seeds)

fn runner(seed: u8, cases: u32) -> TestRunner {
    TestRunner::new_with_rng(
        Config::with_cases(cases),
        TestRng::from_seed(RngAlgorithm::ChaCha, &[seed; 32]),
    )
}

fn user_input() -> impl Strategy<Value = PutRecord> {
    let partition_key = prop_oneof!["[a-c]", "\\PC{1,12}"]; // shared keys and unicode ones
    let explicit_hash_key = proptest::option::weighted(
        0.3,
        prop_oneof![Just(0u128), Just(u128::MAX), any::<u128>(), 0u128..3],
    );
    let data = prop_oneof![
        4 => proptest::collection::vec(any::<u8>(), 0..300),
        1 => proptest::collection::vec(any::<u8>(), 0..40).prop_map(|tail| {
            let mut v = MAGIC.to_vec(); // data that looks like an aggregate itself
            v.extend(tail);
            v
        }),
    ];
    (partition_key, explicit_hash_key, data).prop_map(|(pk, ehk, data)| PutRecord {
        data: data.into(),
        partition_key: pk,
        explicit_hash_key: ehk.map(|h| h.to_string()),
    })
}

/// What a consumer gets back from one Kinesis record: (pk, ehk, data) per message.
fn read_back(put: &PutRecord) -> Vec<(String, Option<String>, Bytes)> {
    let record = Record {
        sequence_number: SequenceNumber::new(SEQUENCE).unwrap(),
        partition_key: put.partition_key.clone(),
        data: put.data.clone(),
        approximate_arrival: None,
    };
    match deaggregate(record) {
        Deaggregated::Aggregated { user_records, .. } => {
            for (i, u) in user_records.iter().enumerate() {
                assert_eq!(u.sub_sequence, i as u64);
            }
            // Routed like its first user record.
            let first = &user_records[0];
            assert_eq!(put.partition_key, first.partition_key);
            assert_eq!(
                put.explicit_hash_key,
                first.hash_key().map(|h| h.to_string())
            );
            user_records
                .into_iter()
                .map(|u| (u.partition_key, u.explicit_hash_key, u.data))
                .collect()
        }
        Deaggregated::Plain(r) => {
            // A lone user record goes out as itself.
            assert!(!r.data.starts_with(&MAGIC));
            vec![(r.partition_key, put.explicit_hash_key.clone(), r.data)]
        }
        Deaggregated::Corrupt { reason, .. } => {
            panic!("aggregator wrote a corrupt record: {reason}")
        }
    }
}

#[test]
fn aggregator_then_deaggregate_returns_every_user_record_in_order() {
    let inputs = proptest::collection::vec(user_input(), 1..60);
    let max_size = prop_oneof![64usize..2_048, Just(MAX_RECORD_BYTES)];
    runner(11, 256)
        .run(&(inputs, max_size), |(inputs, max_size)| {
            let mut aggregator = Aggregator::with_max_size(max_size);
            let mut puts = Vec::new();
            let mut accepted = Vec::new();
            for input in inputs {
                match aggregator.add(input.clone()) {
                    Ok(finished) => puts.extend(finished),
                    Err(AggregatorError::TooLarge { size, max_size, .. }) => {
                        prop_assert!(size > max_size);
                        continue;
                    }
                    Err(e) => return Err(TestCaseError::fail(format!("refused: {e}"))),
                }
                prop_assert!(aggregator.size() <= max_size);
                accepted.push((input.partition_key, input.explicit_hash_key, input.data));
            }
            puts.extend(aggregator.flush());
            prop_assert!(aggregator.is_empty());

            let mut got = Vec::new();
            for put in &puts {
                prop_assert!(put.data.len() + put.partition_key.len() <= max_size);
                got.extend(read_back(put));
            }
            prop_assert_eq!(got, accepted);
            Ok(())
        })
        .unwrap();
}

#[test]
fn arbitrary_bytes_never_panic() {
    // Raw bytes, bytes behind the magic, and bodies framed with a correct MD5 (the only
    // way random input reaches the protobuf decoder and the index checks).
    let body = proptest::collection::vec(any::<u8>(), 0..512);
    let input = prop_oneof![
        body.clone(),
        body.clone().prop_map(|b| [&MAGIC[..], &b].concat()),
        body.prop_map(|b| [&MAGIC[..], &b, &md5::compute(&b).0].concat()),
    ];
    let outcomes = Outcomes::default();
    runner(23, 2_048)
        .run(&input, |data| {
            check_decoded(Bytes::from(data), &outcomes);
            Ok(())
        })
        .unwrap();
    assert!(outcomes.plain.get() > 0);
    let corrupt = outcomes.corrupt.into_inner();
    for reason in ["too_short", "digest_mismatch", "malformed"] {
        assert!(corrupt.contains(reason), "never {reason}: {corrupt:?}");
    }
}

#[test]
fn mutated_aggregates_never_panic() {
    // Valid aggregates with bytes of the body changed, inserted or removed, then framed
    // again with a matching MD5: deep, almost-valid input for the decoder.
    let mutation = (any::<prop::sample::Index>(), any::<u8>(), 0u8..3);
    let input = (
        proptest::collection::vec(user_input(), 2..12),
        proptest::collection::vec(mutation, 1..6),
    );
    let outcomes = Outcomes::default();
    runner(37, 1_024)
        .run(&input, |(users, mutations)| {
            let mut aggregator = Aggregator::new();
            for u in users {
                let _ = aggregator.add(u);
            }
            let Some(put) = aggregator.flush() else {
                return Ok(());
            };
            if !put.data.starts_with(&MAGIC) {
                return Ok(());
            }
            let mut body = put.data[MAGIC.len()..put.data.len() - 16].to_vec();
            for (at, byte, kind) in mutations {
                if body.is_empty() {
                    break;
                }
                let i = at.index(body.len());
                match kind {
                    0 => body[i] = byte,
                    1 => body.insert(i, byte),
                    _ => {
                        body.remove(i);
                    }
                }
            }
            let framed = [&MAGIC[..], &body, &md5::compute(&body).0].concat();
            check_decoded(Bytes::from(framed), &outcomes);
            Ok(())
        })
        .unwrap();
    // Some mutations keep the aggregate valid, most break it in some way.
    assert!(outcomes.aggregated.get() > 0);
    let corrupt = outcomes.corrupt.into_inner();
    eprintln!(
        "mutated: {} still valid, corrupt as {corrupt:?}",
        outcomes.aggregated.get()
    );
    assert!(corrupt.contains("malformed"), "{corrupt:?}");
    assert!(corrupt.len() >= 3, "{corrupt:?}");
}

/// What a generated input turned into, to show the properties reach every branch.
#[derive(Default)]
struct Outcomes {
    plain: Cell<u32>,
    corrupt: RefCell<BTreeSet<&'static str>>,
    aggregated: Cell<u32>,
}

impl Outcomes {
    fn note(&self, d: &Deaggregated) {
        match d {
            Deaggregated::Plain(_) => self.plain.set(self.plain.get() + 1),
            Deaggregated::Corrupt { reason, .. } => {
                self.corrupt.borrow_mut().insert(reason_name(reason));
            }
            Deaggregated::Aggregated { .. } => self.aggregated.set(self.aggregated.get() + 1),
        }
    }
}

/// Decodes and checks what must hold whatever the input: the record comes back
/// untouched, user records are numbered 0.. and their data lie inside the record's.
fn check_decoded(data: Bytes, outcomes: &Outcomes) {
    let decoded = deaggregate(record(data.clone()));
    outcomes.note(&decoded);
    match decoded {
        Deaggregated::Plain(r) => {
            assert!(!data.starts_with(&MAGIC));
            assert_untouched(&r, &data);
        }
        Deaggregated::Corrupt { record, .. } => {
            assert!(data.starts_with(&MAGIC));
            assert_untouched(&record, &data);
        }
        Deaggregated::Aggregated {
            record,
            user_records,
        } => {
            assert_untouched(&record, &data);
            assert!(!user_records.is_empty());
            let range = data.as_ptr() as usize..=data.as_ptr() as usize + data.len();
            for (i, u) in user_records.iter().enumerate() {
                assert_eq!(u.sub_sequence, i as u64);
                assert!(u.hash_key().is_some());
                assert!(range.contains(&(u.data.as_ptr() as usize)) || u.data.is_empty());
            }
        }
    }
}

#[test]
fn plain_records_pass_through_untouched() {
    let data = proptest::collection::vec(any::<u8>(), 0..256)
        .prop_filter("not the magic", |d| !d.starts_with(&MAGIC));
    runner(5, 512)
        .run(&data, |data| {
            let data = Bytes::from(data);
            match deaggregate(record(data.clone())) {
                Deaggregated::Plain(r) => assert_untouched(&r, &data),
                other => return Err(TestCaseError::fail(format!("{other:?}"))),
            }
            Ok(())
        })
        .unwrap();
}
