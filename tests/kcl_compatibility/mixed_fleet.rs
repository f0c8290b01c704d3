//! A mixed fleet (KCL workers and shardflow workers on one lease table) is not
//! supported, and shardflow must not make it worse: a lease held by a live KCL worker
//! (an owner without shardflow's incarnation separator, whose counter keeps moving) is
//! never asked for nor stolen, since the KCL would never answer a hand-off request and
//! both would read the shard. Once the KCL worker stops renewing, its leases expire and
//! are taken (that is the migration path). Memory backend, paused clock.

use std::time::Duration;

use shardflow::kinesis::{KinesisApi, StreamAdmin};
use shardflow::lease::{Checkpoint, Lease, LeaseStore};
use shardflow::{Backend, Memory};
use testkit::*;
use tokio_util::sync::CancellationToken;

/// Renews every lease `owner` holds once a second, as a live KCL worker does.
async fn kcl_worker(store: std::sync::Arc<dyn LeaseStore>, owner: &str, stop: CancellationToken) {
    while !stop.is_cancelled() {
        for row in store.list().await.unwrap() {
            if row.owner.as_deref() == Some(owner) {
                let _ = store.renew(&row).await;
            }
        }
        tokio::select! {
            _ = stop.cancelled() => return,
            _ = tokio::time::sleep(Duration::from_secs(1)) => {}
        }
    }
}

#[tokio::test(start_paused = true)]
async fn a_live_kcl_owner_is_never_stolen_from_and_an_expired_one_is_taken_over() {
    let memory = Memory::new();
    let kinesis = memory.streams().clone();
    kinesis.create_stream("orders", 4).await.unwrap();
    produce(kinesis.as_ref(), "orders", 0..100).await;
    let consumer = test_consumer(memory.clone(), "orders", "billing", "w1")
        .build()
        .unwrap();
    let store = memory.lease_store(consumer.config().lease_table());
    store.ensure_table().await.unwrap();
    // The KCL application's rows: every shard held by one live KCL worker.
    for shard in kinesis.list_shards("orders").await.unwrap() {
        let mut row = Lease::new(shard.shard_id, Vec::new(), Checkpoint::TrimHorizon);
        row.owner = Some("kcl-worker-1".into());
        assert!(store.create(&row).await.unwrap());
    }
    let stop_kcl = CancellationToken::new();
    let kcl = tokio::spawn(kcl_worker(store.clone(), "kcl-worker-1", stop_kcl.clone()));

    let recorder = Recorder::default();
    let running = start(consumer, &recorder);
    // Nothing to await for something that must not happen: let virtual time pass far
    // beyond the default hand-off timeout (the shutdown timeout plus a renewal, about
    // 31 s), after which an unanswered request is taken anyway, and many lease rounds.
    tokio::time::sleep(Duration::from_secs(300)).await;
    for row in store.list().await.unwrap() {
        assert_eq!(row.owner.as_deref(), Some("kcl-worker-1"), "{row:?}");
        assert_eq!(
            row.pending_owner, None,
            "no hand-off asked of the KCL: {row:?}"
        );
    }
    assert_eq!(
        recorder.count(),
        0,
        "no shard of the live KCL worker was read"
    );

    // The KCL fleet stops: its leases expire and shardflow continues, losing nothing.
    stop_kcl.cancel();
    kcl.await.unwrap();
    recorder.wait_for(100, Duration::from_secs(120)).await;
    running.stop().await;
    let mut values: Vec<usize> = recorder.snapshot().iter().map(|h| h.value).collect();
    values.sort_unstable();
    assert_eq!(values, (0..100).collect::<Vec<_>>());
}
