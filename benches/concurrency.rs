//! Per-key concurrency inside a shard: records/s of `run` with a handler that
//! sleeps 10 ms, sequential against `Concurrency::PerKey(n)`, and what the concurrent
//! path costs per record.
//!
//! ```text
//! cargo test --bench concurrency -- --bench      # debug build, paused clock: fine here
//! ```
//!
//! Part 1, simulated time (tokio's paused clock, so the figures do not depend on the
//! machine): a 4-shard stream on the embedded backend holding `BENCH_RECORDS` records
//! (default 8,000) over 1,000 partition keys, a handler that sleeps 10 ms. For
//! `Sequential`, `PerKey(1)`, `PerKey(16)`, `PerKey(64)`, `PerKey(256)` (the worker-wide
//! limit raised to 4 x 256 so it does not bind), records/s from the first call's start
//! to the last call's end, and the ratio to sequential. Then the same with one hot key
//! holding 50 % of the records (the other half over 999 keys).
//!
//! Part 2, wall time: the same stream with `BENCH_NOOP_RECORDS` records (default
//! 100,000) and a no-op handler, on a current-thread runtime with the real clock:
//! `(t_mode - t_sequential) / records` is the concurrent path's cost per record.
//! Median of `BENCH_ITERS` (default 3) runs.
//!
//! Without `--bench` it makes a smoke run (400 records, PerKey(16) and the no-op path
//! once) so `cargo test --all-targets` proves the bench works.

mod common;

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use common::*;
use shardflow::kinesis::{KinesisApi, PutRecord, StreamAdmin};
use shardflow::{Concurrency, Consumer, Memory, Message};
use tokio::sync::Notify;

const STREAM: &str = "bench";

/// Counts handled records; remembers the first start and the last end.
struct Done {
    expected: u64,
    count: AtomicU64,
    first_start: Mutex<Option<(tokio::time::Instant, Duration)>>,
    last_end: Mutex<Option<(tokio::time::Instant, Duration)>>,
    notify: Notify,
}

/// The CPU time of the calling thread so far (Linux: `/proc/thread-self/schedstat`);
/// zero where that is not available. With a current-thread runtime every task runs on
/// this thread, so the difference is the consumer's CPU time, whatever else the machine
/// runs.
fn thread_cpu() -> Duration {
    std::fs::read_to_string("/proc/thread-self/schedstat")
        .ok()
        .and_then(|s| s.split_whitespace().next()?.parse().ok())
        .map(Duration::from_nanos)
        .unwrap_or_default()
}

impl Done {
    fn started(&self) {
        let mut first = self.first_start.lock().unwrap();
        first.get_or_insert_with(|| (tokio::time::Instant::now(), thread_cpu()));
    }

    fn ended(&self) {
        if self.count.fetch_add(1, Ordering::SeqCst) + 1 == self.expected {
            *self.last_end.lock().unwrap() = Some((tokio::time::Instant::now(), thread_cpu()));
            self.notify.notify_one();
        }
    }

    /// From the first call's start to the last call's end: the runtime's clock, and
    /// the CPU time of the runtime's thread.
    fn elapsed(&self) -> (Duration, Duration) {
        let first = self.first_start.lock().unwrap().unwrap();
        let last = self.last_end.lock().unwrap().unwrap();
        (last.0 - first.0, last.1.saturating_sub(first.1))
    }
}

/// Writes `records` records; `key(i)` is record i's partition key.
async fn fill_keyed(memory: &Memory, records: usize, key: impl Fn(usize) -> String) {
    let kinesis = memory.streams().clone();
    kinesis.create_stream(STREAM, SHARDS).await.unwrap();
    let data = Bytes::from(vec![b'x'; RECORD_BYTES]);
    let all: Vec<PutRecord> = (0..records)
        .map(|i| PutRecord {
            data: data.clone(),
            partition_key: key(i),
            explicit_hash_key: None,
        })
        .collect();
    for chunk in all.chunks(500) {
        let out = kinesis.put_records(STREAM, chunk).await.unwrap();
        assert!(out
            .iter()
            .all(|o| matches!(o, shardflow::kinesis::PutOutcome::Stored { .. })));
    }
}

/// Runs a consumer with `concurrency` until `records` records were handled by a handler
/// that sleeps `sleep` (none: a no-op); returns the time from the first call's start to
/// the last call's end (on the clock of the runtime) and the CPU time meanwhile.
async fn consume(
    records: usize,
    key: impl Fn(usize) -> String,
    concurrency: Concurrency,
    sleep: Option<Duration>,
) -> (Duration, Duration) {
    let memory = Memory::new();
    fill_keyed(&memory, records, key).await;
    let done = Arc::new(Done {
        expected: records as u64,
        count: AtomicU64::new(0),
        first_start: Mutex::new(None),
        last_end: Mutex::new(None),
        notify: Notify::new(),
    });
    let consumer = Consumer::builder()
        .stream(STREAM)
        .group("bench-group")
        .worker_id("bench")
        .backend(memory.clone())
        .concurrency(concurrency)
        .max_concurrent_calls(4 * 256)
        .seed(1)
        .build()
        .unwrap();
    let handler = {
        let done = done.clone();
        tower::service_fn(move |_msg: Message| {
            let done = done.clone();
            done.started();
            async move {
                if let Some(d) = sleep {
                    tokio::time::sleep(d).await;
                }
                done.ended();
                Ok::<_, std::convert::Infallible>(())
            }
        })
    };
    let finished = done.notify.notified();
    let running = consumer.run(handler).spawn();
    tokio::time::timeout(Duration::from_secs(3_600), finished)
        .await
        .expect("every record handled within an hour of the runtime's clock");
    running.shutdown().await.unwrap();
    done.elapsed()
}

fn modes() -> Vec<(&'static str, Concurrency)> {
    vec![
        ("Sequential", Concurrency::Sequential),
        ("PerKey(1)", Concurrency::PerKey(1)),
        ("PerKey(16)", Concurrency::PerKey(16)),
        ("PerKey(64)", Concurrency::PerKey(64)),
        ("PerKey(256)", Concurrency::PerKey(256)),
    ]
}

fn paused_runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .start_paused(true)
        .build()
        .unwrap()
}

fn main() {
    let measuring = measuring();
    let records = if measuring {
        env_or("BENCH_RECORDS", 8_000)
    } else {
        400
    };
    let modes: Vec<_> = if measuring {
        modes()
    } else {
        vec![("PerKey(16)", Concurrency::PerKey(16))]
    };
    let sleep = Some(Duration::from_millis(10));
    type KeyFn = fn(usize) -> String;
    let uniform: KeyFn = |i| format!("key-{}", i % 1_000);
    // Every other record is the hot key's; the rest spread over 999 keys.
    let hot: KeyFn = |i| {
        if i % 2 == 0 {
            "hot".to_owned()
        } else {
            format!("key-{}", (i / 2) % 999)
        }
    };
    for (title, key) in [("1,000 keys", uniform), ("hot key 50 %", hot)] {
        println!("\n{records} records, 4 shards, {title}, handler sleeps 10 ms (simulated time)");
        println!(
            "{:<12} {:>12} {:>12} {:>10}",
            "mode", "time", "records/s", "x seq"
        );
        let mut sequential = None;
        for (name, mode) in &modes {
            let (t, _) = paused_runtime().block_on(consume(records, key, *mode, sleep));
            let rate = records as f64 / t.as_secs_f64();
            let base = *sequential.get_or_insert(rate);
            println!("{name:<12} {:>12.2?} {rate:>12.0} {:>10.1}", t, rate / base);
        }
    }

    let noop_records = if measuring {
        env_or("BENCH_NOOP_RECORDS", 100_000)
    } else {
        2_000
    };
    let iters = if measuring {
        env_or("BENCH_ITERS", 3)
    } else {
        1
    };
    println!("\n{noop_records} records, 4 shards, 1,000 keys, no-op handler (current-thread runtime, real clock; medians)");
    println!(
        "{:<14} {:>10} {:>10} {:>14} {:>14} {:>16}",
        "mode", "wall", "CPU", "wall/record", "CPU/record", "CPU vs seq"
    );
    let mut sequential = None;
    for (name, mode) in [
        ("Sequential", Concurrency::Sequential),
        ("PerKey(64)", Concurrency::PerKey(64)),
        ("Unordered(64)", Concurrency::Unordered(64)),
    ] {
        let runs: Vec<(Duration, Duration)> = (0..iters)
            .map(|_| {
                let rt = tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build()
                    .unwrap();
                // The real clock: from the first call's start to the last call's end
                // (the fill, start-up and shutdown are not counted).
                rt.block_on(consume(noop_records, uniform, mode, None))
            })
            .collect();
        let wall = median(&mut runs.iter().map(|r| r.0).collect::<Vec<_>>());
        let cpu = median(&mut runs.iter().map(|r| r.1).collect::<Vec<_>>());
        let n = noop_records as u32;
        let base = *sequential.get_or_insert(cpu);
        let extra = (cpu.as_secs_f64() - base.as_secs_f64()) / noop_records as f64 * 1e9;
        println!(
            "{name:<14} {wall:>10.2?} {cpu:>10.2?} {:>14.2?} {:>14.2?} {extra:>+13.0} ns",
            wall / n,
            cpu / n
        );
    }
}
