//! A hand-off request left on a shard that ended before its owner handed it over (memory
//! backend, paused clock, default timings): the request is cleared when the shard ends,
//! and the worker that asked goes back to its usual pace instead of planning around a
//! hand-off that can never come.

use testkit::hooks;

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;
use hooks::{Hooked, Hooks};
use shardflow::kinesis::StreamAdmin;
use shardflow::lease::{Lease, LeaseError};
use shardflow::{Consumer, Memory};
use testkit::*;

const LIMIT: Duration = Duration::from_secs(300);
const GROUP: &str = "ended-group";

/// What both workers' hooks share: the shard asked for, once a hand-off was requested.
#[derive(Default)]
struct Shared {
    asked: Mutex<Option<String>>,
    split: AtomicBool,
    /// Listings of the table by the worker that asked.
    listings: AtomicU64,
}

/// The owner's view: its renewals of the shard asked for wait 3 s once it was split, so
/// the shard reaches its end before the owner sees the request.
struct Owner(Arc<Shared>);

#[async_trait]
impl Hooks for Owner {
    async fn before_lease(&self, op: &'static str, key: Option<&str>) -> Result<(), LeaseError> {
        let asked = self.0.asked.lock().unwrap().clone();
        if op == "renew" && key.is_some() && key.map(str::to_owned) == asked {
            tokio::time::sleep(Duration::from_secs(3)).await;
        }
        Ok(())
    }
}

/// The requester's view: the shard it asked for is split right after the request
/// landed; its listings are counted.
struct Requester {
    shared: Arc<Shared>,
    memory: Memory,
}

#[async_trait]
impl Hooks for Requester {
    async fn before_lease(&self, op: &'static str, _: Option<&str>) -> Result<(), LeaseError> {
        if op == "list" {
            self.shared.listings.fetch_add(1, Ordering::SeqCst);
        }
        Ok(())
    }

    async fn after_lease(&self, op: &'static str, key: Option<&str>, row: Option<&Lease>) {
        let (Some(key), Some(row)) = (key, row) else {
            return;
        };
        if op != "request_handoff" || self.shared.split.swap(true, Ordering::SeqCst) {
            return;
        }
        *self.shared.asked.lock().unwrap() = Some(key.to_owned());
        let (low, high) = row.hash_range.expect("rows carry their hash range");
        self.memory
            .streams()
            .split_shard("ended", key, low + (high - low) / 2 + 1)
            .await
            .unwrap_or_else(|e| panic!("split {key}: {e}"));
    }
}

fn worker(backend: impl shardflow::Backend, name: &str) -> Consumer {
    Consumer::builder()
        .stream("ended")
        .group(GROUP)
        .worker_id(name)
        .backend(backend)
        .seed(11)
        .build()
        .unwrap()
}

/// Regression: a request left on a shard that ended kept its worker in quick rounds
/// (a listing every renew interval instead of every take interval) until the row was
/// deleted past retention.
#[tokio::test(start_paused = true)]
async fn a_request_on_a_shard_that_ended_is_cleared_and_its_worker_lists_at_its_pace() {
    let memory = Memory::new();
    memory.streams().create_stream("ended", 2).await.unwrap();
    let shared = Arc::new(Shared::default());
    let recorder = Recorder::default();
    let owner = start(
        worker(Hooked::new(memory.clone(), Owner(shared.clone())), "w1"),
        &recorder,
    );
    let table = memory.table(GROUP);
    within(LIMIT, "the first worker holds both shards", async {
        while table.rows().iter().filter(|r| r.owner.is_some()).count() < 2 {
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    })
    .await;
    let requester = start(
        worker(
            Hooked::new(
                memory.clone(),
                Requester {
                    shared: shared.clone(),
                    memory: memory.clone(),
                },
            ),
            "w2",
        ),
        &recorder,
    );
    within(LIMIT, "the second worker asks for a shard", async {
        while shared.asked.lock().unwrap().is_none() {
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    })
    .await;
    let asked = shared.asked.lock().unwrap().clone().unwrap();
    within(LIMIT, "the asked-for shard ends", async {
        while !table
            .rows()
            .iter()
            .any(|r| r.key == asked && r.checkpoint == shardflow::lease::Checkpoint::ShardEnd)
        {
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    })
    .await;
    // Let the fleet settle on the children, then count the requester's listings over
    // 600 s of an idle stream: about one per take round (10 s).
    tokio::time::sleep(Duration::from_secs(60)).await;
    let before = shared.listings.load(Ordering::SeqCst);
    tokio::time::sleep(Duration::from_secs(600)).await;
    let listings = shared.listings.load(Ordering::SeqCst) - before;
    let row = table.rows().into_iter().find(|r| r.key == asked).unwrap();
    requester.stop().await;
    owner.stop().await;
    eprintln!("listings by the requester in 600 s idle: {listings}");
    assert_eq!(row.pending_owner, None, "the request on the ended shard");
    assert!(
        listings <= 75,
        "{listings} listings in 600 s idle (one per 10 s take round is 60)"
    );
}
