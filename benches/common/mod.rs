//! Helpers shared by the bench binaries.
#![allow(dead_code)]

use std::time::Duration;

use bytes::Bytes;
use shardflow::kinesis::{PutOutcome, PutRecord, StreamAdmin};

/// Shards of every bench stream.
pub const SHARDS: u32 = 4;
/// Payload size of every bench record.
pub const RECORD_BYTES: usize = 100;

/// An environment knob, or its default.
pub fn env_or<T: std::str::FromStr>(name: &str, default: T) -> T {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

/// Whether `cargo bench` started this binary (it passes `--bench`), rather than `cargo
/// test` (which only checks that the bench runs).
pub fn measuring() -> bool {
    std::env::args().skip(1).any(|a| a == "--bench")
}

/// The median of some timings.
pub fn median(v: &mut [Duration]) -> Duration {
    v.sort();
    v[v.len() / 2]
}

/// Creates `stream` with [`SHARDS`] shards and writes `records` records of
/// [`RECORD_BYTES`], retrying the entries a backend refused (kinesalite can throttle).
/// On the memory backend every record's data is the same buffer (see [`fill_with`]).
pub async fn fill(kinesis: &dyn StreamAdmin, stream: &str, records: usize) {
    let data = Bytes::from(vec![b'x'; RECORD_BYTES]);
    fill_with(kinesis, stream, records, |_| data.clone()).await
}

/// [`fill`] with the data of record `k` made by `payload(k)`: e.g. a buffer of its own
/// per record, as records read from a real service have (the memory backend keeps the
/// `Bytes` it was given, so records made from one buffer share it when read).
pub async fn fill_with(
    kinesis: &dyn StreamAdmin,
    stream: &str,
    records: usize,
    payload: impl Fn(usize) -> Bytes,
) {
    kinesis
        .create_stream(stream, SHARDS)
        .await
        .expect("create stream");
    let mut i = 0usize;
    while i < records {
        let n = 500.min(records - i);
        let mut chunk: Vec<PutRecord> = (i..i + n)
            .map(|k| PutRecord {
                data: payload(k),
                partition_key: format!("pk-{k}"),
                explicit_hash_key: None,
            })
            .collect();
        for _ in 0..20 {
            let out = kinesis
                .put_records(stream, &chunk)
                .await
                .expect("put records");
            chunk = chunk
                .into_iter()
                .zip(out)
                .filter(|(_, o)| !matches!(o, PutOutcome::Stored { .. }))
                .map(|(r, _)| r)
                .collect();
            if chunk.is_empty() {
                break;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        assert!(chunk.is_empty(), "could not put every record");
        i += n;
    }
}
