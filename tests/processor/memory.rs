//! Processors (`produce_to`) on the embedded backend under the paused clock: the input's
//! checkpoint never passes an input whose outputs are not all stored (a stalled output
//! holds it, the call waits for the producer instead of dropping anything), a failed
//! produce redelivers the input, zero outputs acknowledge it, and many outputs per input
//! keep each key's order through a producer that fails entries (ordered or not).

use std::collections::{BTreeMap, HashMap, HashSet};
use std::convert::Infallible;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;
use shardflow::kinesis::{KinesisApi, KinesisError, PutOutcome, PutRecord, StreamAdmin};
use shardflow::lease::Checkpoint;
use shardflow::memory::KinesisFaults;
use shardflow::producer::{Producer, ProducerBuilder};
use shardflow::{Backend, Concurrency, Memory, Message, Position};
use shardflow_middleware::produce::Output;
use shardflow_middleware::ServiceBuilderExt;
use testkit::hooks::{Forward, ForwardKinesis};
use testkit::*;
use tokio::sync::{Notify, Semaphore};
use tower::ServiceBuilder;

const ORDERS: &str = "orders";
const SHIPMENTS: &str = "shipments";
const GROUP: &str = "shipping";

/// The output stream's Kinesis for the producer: stores through the memory backend,
/// except that an output whose payload is in `fail_once` is refused once (a partial
/// failure) and one whose payload is `stall` waits until `release` has a permit.
struct OutputKinesis {
    memory: Memory,
    fail_once: Mutex<HashSet<String>>,
    stall: Option<String>,
    release: Semaphore,
    stored: Notify,
}

impl OutputKinesis {
    fn new(memory: &Memory) -> Self {
        OutputKinesis {
            memory: memory.clone(),
            fail_once: Mutex::default(),
            stall: None,
            release: Semaphore::new(0),
            stored: Notify::new(),
        }
    }
}

#[async_trait]
impl ForwardKinesis for OutputKinesis {
    fn inner(&self) -> &dyn KinesisApi {
        self.memory.streams().as_ref()
    }
    async fn put_records(
        &self,
        stream: &str,
        records: &[PutRecord],
    ) -> Result<Vec<PutOutcome>, KinesisError> {
        let text = |r: &PutRecord| String::from_utf8_lossy(&r.data).into_owned();
        if let Some(stall) = &self.stall {
            if records.iter().any(|r| &text(r) == stall) {
                self.release.acquire().await.unwrap().forget();
            }
        }
        let refuse: Vec<bool> = {
            let mut fail = self.fail_once.lock().unwrap();
            records.iter().map(|r| fail.remove(&text(r))).collect()
        };
        let pass: Vec<PutRecord> = records
            .iter()
            .zip(&refuse)
            .filter(|(_, refused)| !**refused)
            .map(|(r, _)| r.clone())
            .collect();
        let mut stored = self
            .memory
            .streams()
            .put_records(stream, &pass)
            .await?
            .into_iter();
        let outcomes = refuse
            .iter()
            .map(|refused| match refused {
                true => PutOutcome::Failed {
                    code: "InternalFailure".into(),
                    message: "injected".into(),
                },
                // One outcome per record passed on, in order.
                false => stored.next().unwrap(),
            })
            .collect();
        self.stored.notify_waiters();
        Ok(outcomes)
    }
}

/// Streams `orders` (one shard, values `0..n` with keys `pk-{v % 64}`) and `shipments`.
async fn setup(n: usize, shards: u32) -> Memory {
    let memory = Memory::new();
    memory
        .streams()
        .create_stream(ORDERS, shards)
        .await
        .unwrap();
    memory.streams().create_stream(SHIPMENTS, 2).await.unwrap();
    produce(memory.streams().as_ref(), ORDERS, 0..n).await;
    memory
}

fn producer(kinesis: Arc<Forward<OutputKinesis>>) -> ProducerBuilder {
    Producer::builder()
        .stream(SHIPMENTS)
        .kinesis(kinesis)
        .linger(Duration::from_millis(5))
        .retry_backoff(Duration::from_millis(10), Duration::from_millis(100))
}

fn value(msg: &Message) -> usize {
    std::str::from_utf8(&msg.payload).unwrap().parse().unwrap()
}

/// Every record of `stream` as (partition key, payload), shard by shard in order.
async fn records(memory: &Memory, stream: &str) -> Vec<(String, String)> {
    let mut shards: Vec<String> = open_shards(memory.streams().as_ref(), stream)
        .await
        .into_iter()
        .map(|s| s.shard_id)
        .collect();
    shards.sort();
    shards
        .iter()
        .flat_map(|shard| memory.streams().records(stream, shard))
        .map(|r| {
            (
                r.partition_key,
                String::from_utf8_lossy(&r.data).into_owned(),
            )
        })
        .collect()
}

/// The payloads stored in `stream`.
async fn payloads(memory: &Memory, stream: &str) -> Vec<String> {
    records(memory, stream)
        .await
        .into_iter()
        .map(|(_, p)| p)
        .collect()
}

/// Waits until `kinesis` stored every payload of `wanted` in the output stream.
async fn until_stored(memory: &Memory, kinesis: &OutputKinesis, wanted: &[String]) {
    loop {
        let notified = kinesis.stored.notified();
        let have: HashSet<String> = payloads(memory, SHIPMENTS).await.into_iter().collect();
        if wanted.iter().all(|w| have.contains(w)) {
            return;
        }
        notified.await;
    }
}

/// The stored checkpoint of the orders stream's shards.
async fn stored_checkpoints(memory: &Memory) -> BTreeMap<String, Checkpoint> {
    let rows = memory.lease_store(GROUP).list().await.unwrap();
    checkpoints(&rows)
}

/// The position of input `index` of `shard` of the orders stream.
fn position(memory: &Memory, shard: &str, index: usize) -> Position {
    let sequence = memory.streams().records(ORDERS, shard)[index]
        .sequence_number
        .clone();
    Position::new(sequence, 0)
}

fn at(memory: &Memory, shard: &str, index: usize) -> Checkpoint {
    Checkpoint::At(position(memory, shard, index))
}

const SHARD: &str = "shardId-000000000000";

#[tokio::test(start_paused = true)]
async fn the_checkpoint_never_passes_an_input_whose_output_is_not_stored() {
    let memory = setup(20, 1).await;
    let mut kinesis = OutputKinesis::new(&memory);
    kinesis.stall = Some("shipped 10".into());
    let kinesis = Arc::new(Forward(kinesis));
    // A producer with room for one record: while output 10 is stalled, the calls wait
    // for the producer (backpressure) instead of dropping anything.
    let shipments = producer(kinesis.clone())
        .buffer(1)
        .max_in_flight(1)
        .build()
        .unwrap();
    let processor = ServiceBuilder::new()
        .produce_to(shipments.clone())
        .service_fn(|msg: Message| async move {
            Ok::<_, Infallible>(Output::new(format!("shipped {}", value(&msg))))
        });
    // Reads of five records: the sequential dispatcher acknowledges a read once all of
    // it is handled, so the watermark can stop right after input 9.
    let consumer = test_consumer(memory.clone(), ORDERS, GROUP, "w1")
        .max_records_per_read(5)
        .build()
        .unwrap();
    let running = start_service(consumer, processor);

    let first: Vec<String> = (0..10).map(|v| format!("shipped {v}")).collect();
    until_stored(&memory, &kinesis, &first).limited().await;
    // Output 10 is not stored: however long we wait (many checkpoint intervals), the
    // checkpoint stays at input 9 at most.
    for _ in 0..20 {
        tokio::time::sleep(Duration::from_millis(500)).await;
        let stored = stored_checkpoints(&memory).await;
        let checkpoint = stored.get(SHARD).cloned().unwrap();
        let passed = match &checkpoint {
            Checkpoint::At(p) => p > &position(&memory, SHARD, 9),
            _ => false,
        };
        assert!(
            !passed,
            "checkpoint {checkpoint:?} passed input 10, whose output is not stored"
        );
    }
    assert_eq!(
        stored_checkpoints(&memory).await.get(SHARD),
        Some(&at(&memory, SHARD, 9)),
        "the checkpoint is at the last input whose output is stored"
    );

    kinesis.release.add_permits(1);
    let all: Vec<String> = (0..20).map(|v| format!("shipped {v}")).collect();
    until_stored(&memory, &kinesis, &all).limited().await;
    running.stop().await;
    assert_eq!(
        stored_checkpoints(&memory).await.get(SHARD),
        Some(&at(&memory, SHARD, 19))
    );
    assert_eq!(
        payloads(&memory, SHIPMENTS).await.len(),
        20,
        "nothing dropped or doubled"
    );
    shipments.close().await;
}

/// Calls of the processor function per input value.
#[derive(Clone, Default)]
struct Calls(Arc<Mutex<HashMap<usize, usize>>>, Arc<Notify>);

impl Calls {
    fn call(&self, v: usize) {
        *self.0.lock().unwrap().entry(v).or_default() += 1;
        self.1.notify_waiters();
    }

    /// Waits until `n` different inputs were called.
    async fn until(&self, n: usize) {
        loop {
            let notified = self.1.notified();
            if self.0.lock().unwrap().len() >= n {
                return;
            }
            notified.await;
        }
    }

    fn of(&self, v: usize) -> usize {
        self.0.lock().unwrap().get(&v).copied().unwrap_or(0)
    }
}

#[tokio::test(start_paused = true)]
async fn a_failed_produce_fails_the_input_and_redelivers_it() {
    let memory = setup(20, 1).await;
    let kinesis = Arc::new(Forward(OutputKinesis::new(&memory)));
    kinesis.fail_once.lock().unwrap().insert("shipped 5".into());
    // One attempt: the refused entry fails the call instead of being resent.
    let shipments = producer(kinesis.clone()).max_attempts(1).build().unwrap();
    let calls = Calls::default();
    let processor = ServiceBuilder::new()
        .produce_to(shipments.clone())
        .service_fn({
            let calls = calls.clone();
            move |msg: Message| {
                calls.call(value(&msg));
                async move { Ok::<_, Infallible>(Output::new(format!("shipped {}", value(&msg)))) }
            }
        });
    let consumer = test_consumer(memory.clone(), ORDERS, GROUP, "w1")
        .build()
        .unwrap();
    let running = start_service(consumer, processor);
    let all: Vec<String> = (0..20).map(|v| format!("shipped {v}")).collect();
    until_stored(&memory, &kinesis, &all).limited().await;
    running.stop().await;

    assert_eq!(
        calls.of(5),
        2,
        "input 5 delivered again after its output failed"
    );
    for v in (0..20).filter(|v| *v != 5) {
        assert_eq!(
            calls.of(v),
            1,
            "input {v}: handled once, nothing else redelivered"
        );
    }
    assert_eq!(
        payloads(&memory, SHIPMENTS).await.len(),
        20,
        "each output stored once (the refused one was not stored)"
    );
    assert_eq!(
        stored_checkpoints(&memory).await.get(SHARD),
        Some(&at(&memory, SHARD, 19))
    );
    shipments.close().await;
}

#[tokio::test(start_paused = true)]
async fn zero_outputs_acknowledge_the_input() {
    let memory = setup(20, 1).await;
    let kinesis = Arc::new(Forward(OutputKinesis::new(&memory)));
    let shipments = producer(kinesis.clone()).build().unwrap();
    let calls = Calls::default();
    // Odd orders ship nothing; the last input (19) is one of them.
    let processor = ServiceBuilder::new()
        .produce_to(shipments.clone())
        .service_fn({
            let calls = calls.clone();
            move |msg: Message| {
                let v = value(&msg);
                calls.call(v);
                async move {
                    Ok::<_, Infallible>((v % 2 == 0).then(|| Output::new(format!("shipped {v}"))))
                }
            }
        });
    let consumer = test_consumer(memory.clone(), ORDERS, GROUP, "w1")
        .build()
        .unwrap();
    let running = start_service(consumer, processor);
    calls.until(20).limited().await;
    // A graceful stop commits the watermark of what was acknowledged: with input 19
    // (no outputs) acknowledged, that is input 19.
    running.stop().await;
    assert_eq!(
        stored_checkpoints(&memory).await.get(SHARD),
        Some(&at(&memory, SHARD, 19)),
        "an input with zero outputs counts as handled"
    );
    let mut shipped = payloads(&memory, SHIPMENTS).await;
    shipped.sort();
    let mut expected: Vec<String> = (0..20).step_by(2).map(|v| format!("shipped {v}")).collect();
    expected.sort();
    assert_eq!(shipped, expected);
    for v in 0..20 {
        assert_eq!(calls.of(v), 1, "input {v}");
    }
    shipments.close().await;
}

#[tokio::test(start_paused = true)]
async fn many_outputs_per_input_keep_each_keys_order_with_per_key_concurrency() {
    many_outputs_keep_each_keys_order(true).await;
}

/// An unordered producer may swap two records of a key on a resend: the outputs of one
/// input then go one at a time, and the order holds all the same.
#[tokio::test(start_paused = true)]
async fn many_outputs_keep_each_keys_order_through_an_unordered_producer() {
    many_outputs_keep_each_keys_order(false).await;
}

async fn many_outputs_keep_each_keys_order(ordered_producer: bool) {
    let memory = setup(600, 2).await;
    // One entry in five refused at random, resent by the producer (ordered per key).
    memory.streams().set_faults(KinesisFaults {
        put_entry_failure: 0.2,
        seed: 11,
        ..KinesisFaults::default()
    });
    let kinesis = Arc::new(Forward(OutputKinesis::new(&memory)));
    let shipments = producer(kinesis.clone())
        .ordered_per_key(ordered_producer)
        .max_attempts(50)
        .build()
        .unwrap();
    // Three outputs per input: two keep the input's key, one chooses `all-{key}`.
    let processor = ServiceBuilder::new()
        .produce_to(shipments.clone())
        .service_fn(|msg: Message| async move {
            let v = value(&msg);
            let key = &msg.metadata.partition_key;
            Ok::<_, Infallible>(vec![
                Output::new(format!("{v}.0")),
                Output::new(format!("{v}.1")),
                Output::new(format!("{v}.2")).partition_key(format!("all-{key}")),
            ])
        });
    let consumer = test_consumer(memory.clone(), ORDERS, GROUP, "w1")
        .concurrency(Concurrency::PerKey(16))
        .build()
        .unwrap();
    let running = start_service(consumer, processor);
    let all: Vec<String> = (0..600)
        .flat_map(|v| (0..3).map(move |i| format!("{v}.{i}")))
        .collect();
    until_stored(&memory, &kinesis, &all).limited().await;
    running.stop().await;

    // Per output key, the outputs in stream order follow the inputs' order (values of
    // one input key grow with the sequence number: `produce` writes them in order).
    let mut per_key: BTreeMap<String, Vec<(usize, usize)>> = BTreeMap::new();
    for (key, payload) in records(&memory, SHIPMENTS).await {
        let (v, i) = payload.split_once('.').unwrap();
        per_key
            .entry(key)
            .or_default()
            .push((v.parse().unwrap(), i.parse().unwrap()));
    }
    for (key, outputs) in &per_key {
        assert!(
            outputs.windows(2).all(|w| w[0] < w[1]),
            "outputs of {key} out of order: {outputs:?}"
        );
    }
    assert_eq!(per_key.values().map(Vec::len).sum::<usize>(), 1800);
    shipments.close().await;
}

/// Regression: when an output finally failed, the outputs of its key queued behind it
/// were still stored, ahead of the failed one's later write (`b, a, b` after the input
/// came again).
#[tokio::test(start_paused = true)]
async fn an_output_that_finally_fails_lets_no_later_output_of_its_key_ahead() {
    let memory = setup(600, 2).await;
    memory.streams().set_faults(KinesisFaults {
        put_entry_failure: 0.2,
        seed: 11,
        ..KinesisFaults::default()
    });
    let kinesis = Arc::new(Forward(OutputKinesis::new(&memory)));
    // Two attempts: about one output in 25 runs out of them, failing its input, which
    // the consumer delivers again.
    let shipments = producer(kinesis.clone())
        .ordered_per_key(true)
        .max_attempts(2)
        .build()
        .unwrap();
    let processor = ServiceBuilder::new()
        .produce_to(shipments.clone())
        .service_fn(|msg: Message| async move {
            let v = value(&msg);
            let key = &msg.metadata.partition_key;
            Ok::<_, Infallible>(vec![
                Output::new(format!("{v}.0")),
                Output::new(format!("{v}.1")),
                Output::new(format!("{v}.2")).partition_key(format!("all-{key}")),
            ])
        });
    let consumer = test_consumer(memory.clone(), ORDERS, GROUP, "w1")
        .concurrency(Concurrency::PerKey(16))
        .build()
        .unwrap();
    let running = start_service(consumer, processor);
    let all: Vec<String> = (0..600)
        .flat_map(|v| (0..3).map(move |i| format!("{v}.{i}")))
        .collect();
    until_stored(&memory, &kinesis, &all).limited().await;
    running.stop().await;

    // Writing an input's outputs again repeats records already stored (at least once),
    // but the first copy of each output of a key must come in the inputs' order: an
    // output stored before an earlier one of its key was ever stored is a violation.
    let mut firsts: BTreeMap<String, Vec<(usize, usize)>> = BTreeMap::new();
    let mut seen = HashSet::new();
    let mut copies = 0;
    for (key, payload) in records(&memory, SHIPMENTS).await {
        copies += 1;
        let (v, i) = payload.split_once('.').unwrap();
        let output: (usize, usize) = (v.parse().unwrap(), i.parse().unwrap());
        if seen.insert(output) {
            firsts.entry(key).or_default().push(output);
        }
    }
    let violations: Vec<_> = firsts
        .iter()
        .flat_map(|(key, outputs)| {
            outputs
                .windows(2)
                .filter(|w| w[0] > w[1])
                .map(move |w| (key.clone(), w[0], w[1]))
        })
        .collect();
    assert!(violations.is_empty(), "{violations:?}");
    assert_eq!(seen.len(), 1800, "every output stored");
    assert!(
        copies > 1800,
        "some inputs came again (the test exercises failures)"
    );
    shipments.close().await;
}
