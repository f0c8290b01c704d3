//! A LATEST start resolved by one owner and never written is not resolved again by the
//! next (embedded backend, paused clock, wall-clock arrival times).

use std::time::Duration;

use shardflow::kinesis::{KinesisApi, StreamAdmin};
use shardflow::lease::LeaseError;
use shardflow::{InitialPosition, Memory};
use testkit::hooks::{Hooked, Hooks};
use testkit::*;

const LIMIT: Duration = Duration::from_secs(60);

/// A lease table whose checkpoint writes all fail (throttled), as for a worker cut off
/// from its table's write capacity; everything else goes through.
struct NoCheckpoints;

#[async_trait::async_trait]
impl Hooks for NoCheckpoints {
    async fn before_lease(&self, op: &'static str, _: Option<&str>) -> Result<(), LeaseError> {
        if op == "checkpoint" {
            return Err(LeaseError::Throttled(
                "injected: no checkpoint writes".into(),
            ));
        }
        Ok(())
    }
}

/// Regression: a LATEST start never written was resolved again by the next owner, skipping records.
///
/// LATEST is resolved into a time only by
/// the task that took the lease, in a separate write after the take. If that write
/// never lands before the owner leaves (here: its checkpoint writes are throttled, and
/// it stops), the next owner resolves "now" again: records written after the group
/// first took the shard, and older than the clock margin, are never handled — against
/// the promise of `InitialPosition::Latest` ("nothing written in between is skipped").
///
/// Arrival times and the margin are wall-clock (`SystemTime`), which tokio's paused
/// clock does not move: the test blocks 2.5 s of real time to age the records.
#[tokio::test(start_paused = true)]

async fn a_latest_start_not_yet_written_is_not_resolved_again_later() {
    let memory = Memory::new();
    let kinesis = memory.streams().clone();
    kinesis.create_stream("f5", 1).await.unwrap();
    let table = memory.table("f5-group");
    let a = test_consumer(
        Hooked::new(memory.clone(), NoCheckpoints),
        "f5",
        "f5-group",
        "a",
    )
    .initial_position(InitialPosition::Latest)
    .build()
    .unwrap();
    let recorder = Recorder::default();
    let a_run = start(a, &recorder);
    within(LIMIT, "A took the lease", async {
        while table.rows().first().and_then(|r| r.owner.clone()).is_none() {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    })
    .await;
    // Written after the group took the shard.
    produce(kinesis.as_ref(), "f5", 0..20).await;
    a_run.stop().await;
    std::thread::sleep(Duration::from_millis(2_500));
    let b = test_consumer(memory.clone(), "f5", "f5-group", "b")
        .initial_position(InitialPosition::Latest)
        .build()
        .unwrap();
    let b_run = start(b, &recorder);
    let shards = kinesis.list_shards("f5").await.unwrap();
    let sentinels = produce_sentinels(kinesis.as_ref(), "f5", &shards, 20).await;
    recorder.wait_for_values(&sentinels, LIMIT).await;
    b_run.stop().await;
    assert_exactly_once_in_order(&recorder.snapshot(), 21, &shards);
}
