//! Shard discovery and shard end never lose or re-read records: closed
//! parents at AT_TIMESTAMP, reads cut short on a closed shard, a stale ListShards answer
//! with a NotFound, and reshard trees of several generations whose finished rows stay
//! until their shards are past retention. On the embedded backend under tokio's paused clock; the reshard tree also
//! against the emulators.

use std::collections::{BTreeSet, HashSet};
use std::time::{Duration, SystemTime};

use shardflow::kinesis::{KinesisApi, ShardInfo, StreamAdmin};
use shardflow::lease::{Checkpoint, Lease, LeaseStore};
use shardflow::{Backend, InitialPosition, Memory};
use testkit::*;

const LIMIT: Duration = Duration::from_secs(60);

/// Every value in `expected` handled exactly once, and nothing else.
fn assert_each_once(handled: &[Handled], expected: &BTreeSet<usize>) {
    let mut seen = HashSet::new();
    for h in handled {
        assert!(seen.insert(h.value), "value {} handled twice", h.value);
        assert!(
            expected.contains(&h.value),
            "value {} not expected",
            h.value
        );
    }
    let missing: Vec<_> = expected.iter().filter(|v| !seen.contains(v)).collect();
    assert!(
        missing.is_empty(),
        "{} lost, e.g. {:?}",
        missing.len(),
        &missing[..missing.len().min(5)]
    );
}

/// Waits until every closed shard's row is at SHARD_END or was cleaned up.
async fn wait_closed_ended(kinesis: &dyn KinesisApi, store: &dyn LeaseStore, stream: &str) {
    let ended = async {
        loop {
            let shards = kinesis.list_shards(stream).await.unwrap();
            let cps = checkpoints(&store.list().await.unwrap());
            if shards.iter().filter(|s| s.is_closed()).all(|s| {
                cps.get(&s.shard_id)
                    .is_none_or(|cp| *cp == Checkpoint::ShardEnd)
            }) {
                return;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    };
    tokio::time::timeout(LIMIT, ended)
        .await
        .expect("closed shards reach SHARD_END");
}

fn value_of(data: &[u8]) -> usize {
    std::str::from_utf8(data).unwrap().parse().unwrap()
}

/// Path 1: at AT_TIMESTAMP, a parent closed by a split after the timestamp still holds
/// the records between the timestamp and its close; the first sync must give it a lease
/// (and its children must wait for it).
#[tokio::test(start_paused = true)]
async fn at_timestamp_reads_a_parent_closed_after_the_timestamp() {
    let memory = Memory::new();
    let kinesis = memory.streams().clone();
    kinesis.create_stream("ts", 1).await.unwrap();
    let parent = open_shards(kinesis.as_ref(), "ts").await.remove(0);
    produce(kinesis.as_ref(), "ts", 0..40).await;
    // The timestamp: the arrival of the 21st record (values 20.. at or after it).
    let since: SystemTime = kinesis.records("ts", &parent.shard_id)[20]
        .approximate_arrival
        .unwrap();
    produce(kinesis.as_ref(), "ts", 40..60).await;
    kinesis
        .split_shard("ts", &parent.shard_id, u128::MAX / 2)
        .await
        .unwrap();
    produce(kinesis.as_ref(), "ts", 60..160).await;
    let shards = kinesis.list_shards("ts").await.unwrap();
    let expected: BTreeSet<usize> = shards
        .iter()
        .flat_map(|s| kinesis.records("ts", &s.shard_id))
        .filter(|r| r.approximate_arrival.unwrap() >= since)
        .map(|r| value_of(&r.data))
        .collect();
    assert!(expected.contains(&20) && expected.contains(&59) && expected.contains(&60));

    let recorder = Recorder::default();
    let consumer = test_consumer(memory.clone(), "ts", "ts-group", "w1")
        .initial_position(InitialPosition::AtTimestamp(since))
        .build()
        .unwrap();
    let run = start(consumer, &recorder);
    recorder.wait_for(expected.len(), LIMIT).await;
    wait_closed_ended(kinesis.as_ref(), memory.table("ts-group").as_ref(), "ts").await;
    run.stop().await;
    let handled = recorder.snapshot();
    assert_each_once(&handled, &expected);
    assert_order(&handled, &shards);
    assert_partition_key_order(&handled);
}

/// At LATEST, the start is the moment the worker started, not its first successful
/// shard sync: a first sync delayed (here: ListShards answers that leave the only shard
/// out) while a split closes the shard must still read the parent's records written
/// since the start, then its children's.
#[tokio::test(start_paused = true)]
async fn latest_reads_a_parent_closed_before_the_first_sync() {
    let memory = Memory::new();
    let kinesis = memory.streams().clone();
    kinesis.create_stream("late", 1).await.unwrap();
    let parent = open_shards(kinesis.as_ref(), "late").await.remove(0);
    // Written before the start, within the clock margin (arrival times are the wall
    // clock): they may be delivered too.
    produce(kinesis.as_ref(), "late", 0..20).await;
    kinesis.omit_from_list_shards(&parent.shard_id, 1_000);
    let recorder = Recorder::default();
    let consumer = test_consumer(memory.clone(), "late", "late-group", "w1")
        .initial_position(InitialPosition::Latest)
        .build()
        .unwrap();
    let run = start(consumer, &recorder);
    tokio::time::sleep(Duration::from_secs(2)).await; // syncs that find no shard
    produce(kinesis.as_ref(), "late", 20..60).await;
    kinesis
        .split_shard("late", &parent.shard_id, u128::MAX / 2)
        .await
        .unwrap();
    kinesis.omit_from_list_shards(&parent.shard_id, 0);
    produce(kinesis.as_ref(), "late", 60..160).await;
    let expected: BTreeSet<usize> = (20..160).collect();
    recorder
        .wait_for_values(&expected.iter().copied().collect::<Vec<_>>(), LIMIT)
        .await;
    run.stop().await;
    let handled: Vec<Handled> = recorder
        .snapshot()
        .into_iter()
        .filter(|h| h.value >= 20)
        .collect();
    assert_each_once(&handled, &expected);
    assert_order(&handled, &kinesis.list_shards("late").await.unwrap());
}

/// Path 3: reads of a closed shard that come without a next iterator (without a
/// continuation) before its end, while records remain, must not end the shard.
async fn cut_short_reads_do_not_end_a_closed_shard(fan_out: bool) {
    let memory = Memory::new();
    let kinesis = memory.streams().clone();
    kinesis.create_stream("cut", 1).await.unwrap();
    let parent = open_shards(kinesis.as_ref(), "cut").await.remove(0);
    produce(kinesis.as_ref(), "cut", 0..300).await;
    kinesis
        .split_shard("cut", &parent.shard_id, u128::MAX / 2)
        .await
        .unwrap();
    produce(kinesis.as_ref(), "cut", 300..400).await;
    kinesis.set_max_records_per_event(50);
    kinesis.set_cut_short_reads(1.0);
    let recorder = Recorder::default();
    let mut builder =
        test_consumer(memory.clone(), "cut", "cut-group", "w1").max_records_per_read(50);
    if fan_out {
        builder = builder.fan_out("cut-app");
    }
    let run = start(builder.build().unwrap(), &recorder);
    recorder.wait_for(400, LIMIT).await;
    wait_closed_ended(kinesis.as_ref(), memory.table("cut-group").as_ref(), "cut").await;
    run.stop().await;
    let shards = kinesis.list_shards("cut").await.unwrap();
    let handled = recorder.snapshot();
    assert_exactly_once_in_order(&handled, 400, &shards);
}

#[tokio::test(start_paused = true)]
async fn a_page_cut_short_does_not_end_a_closed_shard() {
    cut_short_reads_do_not_end_a_closed_shard(false).await;
}

#[tokio::test(start_paused = true)]
async fn a_fan_out_event_cut_short_does_not_end_a_closed_shard() {
    cut_short_reads_do_not_end_a_closed_shard(true).await;
}

/// Path 4: one NotFound from GetShardIterator (SubscribeToShard) while ListShards
/// (stale) leaves the shard out must not end a shard that exists and holds records.
async fn stale_list_shards_and_one_not_found(fan_out: bool) {
    let memory = Memory::new();
    let kinesis = memory.streams().clone();
    kinesis.create_stream("stale", 1).await.unwrap();
    let shard = open_shards(kinesis.as_ref(), "stale").await.remove(0);
    produce(kinesis.as_ref(), "stale", 0..100).await;
    let table = memory.table("stale-group");
    table
        .create(&Lease::new(
            shard.shard_id.clone(),
            Vec::new(),
            Checkpoint::TrimHorizon,
        ))
        .await
        .unwrap();
    // The start-up sync and the reader's check each get the stale answer.
    kinesis.omit_from_list_shards(&shard.shard_id, 2);
    kinesis.shard_not_found(&shard.shard_id, 1);
    let recorder = Recorder::default();
    let mut builder = test_consumer(memory.clone(), "stale", "stale-group", "w1");
    if fan_out {
        builder = builder.fan_out("stale-app");
    }
    let run = start(builder.build().unwrap(), &recorder);
    recorder.wait_for(100, LIMIT).await;
    run.stop().await;
    assert_exactly_once_in_order(&recorder.snapshot(), 100, &[]);
    let row = table.rows().remove(0);
    assert!(
        matches!(row.checkpoint, Checkpoint::At(_)),
        "the open shard is not ended: {}",
        row.checkpoint
    );
}

#[tokio::test(start_paused = true)]
async fn a_stale_list_shards_and_one_not_found_do_not_end_a_shard() {
    stale_list_shards_and_one_not_found(false).await;
}

#[tokio::test(start_paused = true)]
async fn a_stale_list_shards_and_one_not_found_do_not_end_a_fan_out_shard() {
    stale_list_shards_and_one_not_found(true).await;
}

/// The open shard whose hash range starts at `from`.
async fn open_at(kinesis: &dyn KinesisApi, stream: &str, from: u128) -> ShardInfo {
    open_shards(kinesis, stream)
        .await
        .into_iter()
        .find(|s| s.starting_hash_key == from)
        .unwrap()
}

fn middle(s: &ShardInfo) -> u128 {
    s.starting_hash_key + (s.ending_hash_key - s.starting_hash_key) / 2 + 1
}

/// Path 5: 1 → 2 → 4 → 3 → 2 → 1 (split, split both children, merge two grandchildren,
/// merge twice more), records written in every generation, the consumer restarted
/// between reshards: every record handled exactly once, in order per partition key,
/// parents before children; finished rows stay while their shard is listed and go
/// once it is past retention.
pub async fn reshard_generations<B: Backend + Clone>(
    backend: B,
    stream: &str,
    per_gen: usize,
    past_retention: Option<&dyn Fn(&str)>,
) {
    let kinesis = backend.admin().unwrap();
    let kinesis = kinesis.as_ref();
    let group = format!("{stream}-group");
    let store = backend.lease_store(&group);
    kinesis.create_stream(stream, 1).await.unwrap();
    let recorder = Recorder::default();
    let mut written = 0;
    let mut gen = 0;
    let mut workers = 0;
    let mut next_run = || {
        workers += 1;
        start(
            test_consumer(backend.clone(), stream, &group, &format!("w{workers}"))
                .build()
                .unwrap(),
            &recorder,
        )
    };
    // Writes a generation's records and waits until they are handled.
    macro_rules! generation {
        () => {
            produce(kinesis, stream, written..written + per_gen).await;
            written += per_gen;
            gen += 1;
            eprintln!("generation {gen}: {written} records written");
            recorder.wait_for(written, LIMIT).await;
        };
    }
    let run = next_run();
    generation!();
    let root = open_shards(kinesis, stream).await.remove(0);
    kinesis
        .split_shard(stream, &root.shard_id, middle(&root))
        .await
        .unwrap();
    wait_until_active(kinesis, stream).await;
    generation!();
    run.stop().await;
    let run = next_run();
    for half in open_shards(kinesis, stream).await {
        kinesis
            .split_shard(stream, &half.shard_id, middle(&half))
            .await
            .unwrap();
        wait_until_active(kinesis, stream).await;
    }
    generation!();
    // The two middle quarters (grandchildren of different children) merge.
    let quarters = open_shards(kinesis, stream).await;
    assert_eq!(quarters.len(), 4);
    kinesis
        .merge_shards(stream, &quarters[1].shard_id, &quarters[2].shard_id)
        .await
        .unwrap();
    wait_until_active(kinesis, stream).await;
    generation!();
    run.stop().await;
    let run = next_run();
    let low = open_at(kinesis, stream, 0).await;
    let mid = open_at(kinesis, stream, low.ending_hash_key + 1).await;
    kinesis
        .merge_shards(stream, &low.shard_id, &mid.shard_id)
        .await
        .unwrap();
    wait_until_active(kinesis, stream).await;
    generation!();
    let open = open_shards(kinesis, stream).await;
    kinesis
        .merge_shards(stream, &open[0].shard_id, &open[1].shard_id)
        .await
        .unwrap();
    wait_until_active(kinesis, stream).await;
    generation!();
    assert_eq!(
        open_shards(kinesis, stream).await.len(),
        1,
        "back to one shard"
    );

    // Every closed shard finished; while Kinesis lists it, its row stays at SHARD_END
    // (a tombstone no delayed create can bring back), and several sync rounds later
    // nothing was read again.
    wait_closed_ended(kinesis, store.as_ref(), stream).await;
    tokio::time::sleep(Duration::from_secs(3)).await; // six shard syncs
    run.stop().await;
    // A restart reads nothing again either.
    let run = next_run();
    wait_owned_by(store.as_ref(), "w4").await;
    tokio::time::sleep(Duration::from_secs(3)).await;
    run.stop().await;

    let shards = kinesis.list_shards(stream).await.unwrap();
    assert!(shards.len() >= 10, "all generations still listed");
    let handled = recorder.snapshot();
    assert_exactly_once_in_order(&handled, written, &shards);
    assert_partition_key_order(&handled);
    let rows = checkpoints(&store.list().await.unwrap());
    for shard in shards.iter().filter(|s| s.is_closed()) {
        assert_eq!(
            rows.get(&shard.shard_id),
            Some(&Checkpoint::ShardEnd),
            "a listed finished shard keeps its row: {rows:?}"
        );
    }

    // Past retention (Kinesis no longer lists the closed shards) the rows go, and
    // nothing is read again.
    if let Some(trim) = past_retention {
        for shard in shards.iter().filter(|s| s.is_closed()) {
            trim(&shard.shard_id);
        }
        let run = next_run();
        let cleaned = async {
            while store.list().await.unwrap().len() > 1 {
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        };
        tokio::time::timeout(LIMIT, cleaned)
            .await
            .expect("rows of shards past retention are cleaned up");
        tokio::time::sleep(Duration::from_secs(3)).await;
        run.stop().await;
        assert_eq!(
            recorder.snapshot().len(),
            handled.len(),
            "nothing read again"
        );
    }
}

/// Waits until some row is owned by `worker`.
async fn wait_owned_by(store: &dyn LeaseStore, worker: &str) {
    let taken = async {
        while !store
            .list()
            .await
            .unwrap()
            .iter()
            .any(|r| r.owner.as_deref().map(shardflow::lease::worker_of) == Some(worker))
        {
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    };
    tokio::time::timeout(LIMIT, taken)
        .await
        .expect("the last worker takes the shard");
}

#[tokio::test(start_paused = true)]
async fn three_generations_of_reshards_read_every_record_once() {
    let memory = Memory::new();
    let streams = memory.streams().clone();
    let trim = |shard: &str| streams.remove_shard("gens", shard);
    reshard_generations(memory, "gens", 200, Some(&trim)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_generations_of_reshards_on_emulators() {
    if !emulators_enabled() {
        return;
    }
    let aws = shardflow::Aws::from_env().await;
    reshard_generations(aws, &unique("gens"), 200, None).await;
}

/// Regression: a finished shard whose row was cleaned up (on ListShards answers that
/// both left it out, stale) came back when a later stale answer listed it without its
/// child: its own parent still had a row, so a sync created its row again at
/// TRIM_HORIZON and the shard was read a second time, by an owner fenced on a counter
/// its first row had already used. Its child's row names it as a parent: it stays gone.
#[tokio::test(start_paused = true)]
async fn a_finished_shard_whose_row_is_gone_stays_gone_while_its_child_has_a_row() {
    let memory = Memory::new();
    let kinesis = memory.streams().clone();
    let stream = "row-gone";
    kinesis.create_stream(stream, 1).await.unwrap();
    let root = open_shards(kinesis.as_ref(), stream).await.remove(0);
    produce(kinesis.as_ref(), stream, 0..30).await;
    kinesis
        .split_shard(stream, &root.shard_id, u128::MAX / 2)
        .await
        .unwrap();
    produce(kinesis.as_ref(), stream, 30..60).await;
    let halves = open_shards(kinesis.as_ref(), stream).await;
    kinesis
        .merge_shards(stream, &halves[0].shard_id, &halves[1].shard_id)
        .await
        .unwrap();
    produce(kinesis.as_ref(), stream, 60..90).await;
    let merged = open_shards(kinesis.as_ref(), stream).await.remove(0);
    let table = memory.table("row-gone-group");
    let recorder = Recorder::default();
    let run = start(
        test_consumer(memory.clone(), stream, "row-gone-group", "w1")
            .build()
            .unwrap(),
        &recorder,
    );
    recorder.wait_for(90, LIMIT).await;
    let gone = halves[1].shard_id.clone();
    within(
        LIMIT,
        "the half finishes and the merged shard starts",
        async {
            loop {
                let rows = table.rows();
                let at = |key: &str| {
                    rows.iter()
                        .find(|r| r.key == key)
                        .map(|r| r.checkpoint.clone())
                };
                if at(&gone) == Some(Checkpoint::ShardEnd)
                    && matches!(at(&merged.shard_id), Some(Checkpoint::At(_)))
                {
                    return;
                }
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        },
    )
    .await;
    // The half's row goes, as a clean-up misled by stale answers removes it; the
    // next answers list the half without its child.
    let row = table.rows().into_iter().find(|r| r.key == gone).unwrap();
    table.delete(&row).await.unwrap();
    kinesis.omit_from_list_shards(&merged.shard_id, 5);
    tokio::time::sleep(Duration::from_secs(10)).await;
    let back = table.rows().iter().any(|r| r.key == gone);
    run.stop().await;
    assert!(!back, "the finished half's row was created again");
    let mut seen = HashSet::new();
    let twice: Vec<usize> = recorder
        .snapshot()
        .iter()
        .filter(|h| !seen.insert(h.value))
        .map(|h| h.value)
        .collect();
    assert!(twice.is_empty(), "handled twice: {twice:?}");
}
