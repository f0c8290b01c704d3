//! Memory of one worker, counted by a global allocator that tracks the bytes
//! allocated now and at most (VmRSS from /proc/self/status is printed beside it, but
//! the allocator's figure is the one that does not depend on what the allocator keeps
//! cached). Memory backend under tokio's paused clock, one worker, default settings.
//!
//! - idle: the worker's memory per idle shard, as the difference between 1,000 and 200
//!   held shards (so fixed costs cancel out); it includes each shard's lease row in the
//!   embedded table, which with DynamoDB would live elsewhere.
//! - backlog: every shard has a 10 MB backlog (10,000 records of 1 KB) and a slow
//!   handler (1 ms per record): the peak of what the worker allocated on top of the
//!   stored backlog, with the default read-ahead budget and with an unbounded one
//!   (before the budget existed). Reads go through a wrapper that copies every payload,
//!   as decoding a GetRecords answer off the wire does (the embedded stream would
//!   otherwise hand out shared references to what it stores).
//!
//! ```text
//! cargo test --bench memory -- --bench     # 1,000 idle shards; 16 shards with a backlog
//! ```
//!
//! Without `--bench` (under `cargo test`) the cases are small.

mod common;

use std::alloc::{GlobalAlloc, Layout, System};
use std::convert::Infallible;
use std::future::IntoFuture;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use bytes::Bytes;
use shardflow::kinesis::{KinesisApi, KinesisError, PutRecord, RecordsPage, StreamAdmin};
use shardflow::lease::LeaseStore;
use shardflow::{Backend, Consumer, Memory, Message};
use testkit::hooks::{Forward, ForwardKinesis};

/// Counts the bytes allocated now and the most at any time since the last reset.
struct Counting;

static NOW: AtomicUsize = AtomicUsize::new(0);
static PEAK: AtomicUsize = AtomicUsize::new(0);

// SAFETY: every call is passed on to the system allocator unchanged; only counters are
// added.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        let p = unsafe { System.alloc(layout) };
        if !p.is_null() {
            let now = NOW.fetch_add(layout.size(), Ordering::Relaxed) + layout.size();
            PEAK.fetch_max(now, Ordering::Relaxed);
        }
        p
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        unsafe { System.dealloc(ptr, layout) };
        NOW.fetch_sub(layout.size(), Ordering::Relaxed);
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        let p = unsafe { System.realloc(ptr, layout, new_size) };
        if !p.is_null() {
            if new_size >= layout.size() {
                let now = NOW.fetch_add(new_size - layout.size(), Ordering::Relaxed)
                    + (new_size - layout.size());
                PEAK.fetch_max(now, Ordering::Relaxed);
            } else {
                NOW.fetch_sub(layout.size() - new_size, Ordering::Relaxed);
            }
        }
        p
    }
}

#[global_allocator]
static ALLOC: Counting = Counting;

fn allocated() -> usize {
    NOW.load(Ordering::Relaxed)
}

fn reset_peak() {
    PEAK.store(NOW.load(Ordering::Relaxed), Ordering::Relaxed);
}

fn peak() -> usize {
    PEAK.load(Ordering::Relaxed)
}

fn rss_kib() -> u64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find_map(|l| l.strip_prefix("VmRSS:"))
                .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        })
        .unwrap_or(0)
}

const MIB: f64 = 1024.0 * 1024.0;

/// The embedded stream, with every read payload copied (as off the wire).
struct Copying(Arc<dyn KinesisApi>);

#[async_trait]
impl ForwardKinesis for Copying {
    fn inner(&self) -> &dyn KinesisApi {
        self.0.as_ref()
    }
    async fn get_records(&self, iterator: &str, limit: u32) -> Result<RecordsPage, KinesisError> {
        let mut page = self.0.get_records(iterator, limit).await?;
        for r in &mut page.records {
            r.data = Bytes::copy_from_slice(&r.data);
        }
        Ok(page)
    }
}

struct CopyingBackend(Memory);

impl Backend for CopyingBackend {
    fn kinesis(&self) -> Arc<dyn KinesisApi> {
        Arc::new(Forward(Copying(self.0.kinesis())))
    }
    fn lease_store(&self, table: &str) -> Arc<dyn LeaseStore> {
        self.0.lease_store(table)
    }
}

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .start_paused(true)
        .build()
        .expect("a runtime")
}

/// Bytes the worker allocated, on top of the stream and table, while holding `shards`
/// idle shards after a minute.
fn idle(shards: u32) -> usize {
    runtime().block_on(async {
        let memory = Memory::new();
        memory
            .streams()
            .create_stream("idle", shards)
            .await
            .expect("stream");
        let before = allocated();
        let consumer = Consumer::builder()
            .stream("idle")
            .group("idle")
            .worker_id("w1")
            .backend(memory.clone())
            .seed(1)
            .build()
            .expect("config");
        let shutdown = consumer.shutdown_handle();
        let handler = tower::service_fn(|_m: Message| async { Ok::<_, Infallible>(()) });
        let task = tokio::spawn(consumer.run(handler).into_future());
        let table = memory.table("idle");
        let held = async {
            while table.rows().iter().filter(|r| r.owner.is_some()).count() < shards as usize {
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        };
        tokio::time::timeout(Duration::from_secs(600), held)
            .await
            .expect("every shard leased");
        // A minute of idle reads, renewals and syncs: the steady state.
        tokio::time::sleep(Duration::from_secs(60)).await;
        let used = allocated().saturating_sub(before);
        shutdown.shutdown();
        let _ = tokio::time::timeout(Duration::from_secs(120), task).await;
        used
    })
}

/// The worker's peak allocation on top of the stored backlog while `shards` shards with
/// `per_shard` records of 1 KB each are handled at 1 ms per record, with a read-ahead
/// budget of `budget` bytes.
fn backlog(shards: u32, per_shard: usize, budget: u64) -> (usize, u64, usize) {
    runtime().block_on(async {
        let memory = Memory::new();
        let kinesis = memory.streams().clone();
        kinesis
            .create_stream("backlog", shards)
            .await
            .expect("stream");
        let open = kinesis.list_shards("backlog").await.expect("shards");
        let data = Bytes::from(vec![b'x'; 1_000]);
        for shard in &open {
            let records: Vec<PutRecord> = (0..per_shard)
                .map(|i| PutRecord {
                    data: data.clone(),
                    partition_key: format!("pk-{i}"),
                    explicit_hash_key: Some(shard.starting_hash_key.to_string()),
                })
                .collect();
            for chunk in records.chunks(500) {
                // Stored as copies, so the backlog is real memory before the worker starts.
                let chunk: Vec<PutRecord> = chunk
                    .iter()
                    .map(|r| PutRecord {
                        data: Bytes::copy_from_slice(&r.data),
                        ..r.clone()
                    })
                    .collect();
                kinesis.put_records("backlog", &chunk).await.expect("put");
            }
        }
        let before = allocated();
        reset_peak();
        let consumer = Consumer::builder()
            .stream("backlog")
            .group("backlog")
            .worker_id("w1")
            .backend(CopyingBackend(memory.clone()))
            .read_ahead_bytes(budget)
            .seed(1)
            .build()
            .expect("config");
        let shutdown = consumer.shutdown_handle();
        let handled = Arc::new(AtomicUsize::new(0));
        let count = handled.clone();
        let handler = tower::service_fn(move |_m: Message| {
            let count = count.clone();
            async move {
                tokio::time::sleep(Duration::from_millis(1)).await;
                count.fetch_add(1, Ordering::Relaxed);
                Ok::<_, Infallible>(())
            }
        });
        let task = tokio::spawn(consumer.run(handler).into_future());
        let total = shards as usize * per_shard;
        let mut rss_max = 0;
        let done = async {
            while handled.load(Ordering::Relaxed) < total {
                tokio::time::sleep(Duration::from_millis(500)).await;
                rss_max = rss_max.max(rss_kib());
            }
        };
        tokio::time::timeout(Duration::from_secs(3_600), done)
            .await
            .expect("every record handled");
        let top = peak().saturating_sub(before);
        shutdown.shutdown();
        let _ = tokio::time::timeout(Duration::from_secs(120), task).await;
        (top, rss_max, handled.load(Ordering::Relaxed))
    })
}

fn main() {
    let full = common::measuring();
    let (small, large) = if full { (200, 1_000) } else { (20, 60) };
    let a = idle(small);
    let b = idle(large);
    println!(
        "idle: {small} shards {:.2} MiB, {large} shards {:.2} MiB over the stream and table; \
         {:.1} KiB per idle shard (difference / {})",
        a as f64 / MIB,
        b as f64 / MIB,
        (b.saturating_sub(a)) as f64 / 1024.0 / (large - small) as f64,
        large - small
    );
    let (shards, per_shard) = if full { (16, 10_000) } else { (4, 1_000) };
    for (name, budget) in [
        (
            "default budget (64 MiB)",
            shardflow::consumer::DEFAULT_READ_AHEAD_BYTES,
        ),
        ("no budget (1 TiB, as before)", 1 << 40),
    ] {
        let (top, rss, handled) = backlog(shards, per_shard, budget);
        println!(
            "backlog: {shards} shards x {:.1} MB, {name}: worker peak {:.1} MiB over the \
             stored backlog; process VmRSS max {:.0} MiB; {handled} records handled",
            per_shard as f64 * 1_000.0 / 1e6,
            top as f64 / MIB,
            rss as f64 / 1024.0,
        );
    }
}
