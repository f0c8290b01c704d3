//! A worker whose whole process stops past its lease (a stop signal, a long GC-like
//! pause) while it handles a shard, and another worker takes the lease over meanwhile:
//! once it resumes it starts no handler call on that shard (sequential, per key, batch
//! handlers), and no record is lost. Each worker runs on a thread of its own with a
//! current-thread runtime on the real clock, so blocking that thread stops everything
//! of it (its tasks, timers and renewals) as a stopped process would; the memory
//! backend is shared.

use std::collections::BTreeSet;
use std::convert::Infallible;
use std::future::IntoFuture;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{mpsc, Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use shardflow::kinesis::StreamAdmin;
use shardflow::{Batch, Concurrency, ConsumerBuilder, Memory, Message, ShardEvent, ShutdownHandle};
use testkit::hooks::{Hooked, Hooks};
use testkit::*;

/// The lease duration: short, so the other worker takes the lease well within the freeze.
const LEASE: Duration = Duration::from_secs(2);
/// How long the process stops: a lease duration, a take round and a wide margin for a
/// loaded machine.
const FREEZE: Duration = Duration::from_secs(8);
const RECORDS: usize = 400;
/// The record whose handler call stops the process.
const FROZEN_AT: usize = 30;
/// How long a concurrent call of the worker that freezes takes.
const CALL: Duration = Duration::from_millis(5);
/// Real time: generous bounds for a shared machine, never waited out on success.
const LIMIT: Duration = Duration::from_secs(60);

/// What the test watches: every handler call's start, by worker, and when the second
/// worker took the lease.
#[derive(Default)]
struct Watch {
    /// (worker, value, when its call started).
    calls: Mutex<Vec<(&'static str, usize, Instant)>>,
    b_took: Mutex<Option<Instant>>,
    b_running: AtomicBool,
    resumed: Mutex<Option<Instant>>,
    /// Notified at every call start and at the resume.
    changed: Condvar,
}

impl Watch {
    fn started(&self, worker: &'static str, value: usize) {
        self.calls
            .lock()
            .unwrap()
            .push((worker, value, Instant::now()));
        self.changed.notify_all();
    }

    /// Waits (at most `LIMIT`) until `done` holds of the calls started and the resume.
    fn wait(&self, what: &str, done: impl Fn(&[(&'static str, usize, Instant)], bool) -> bool) {
        let calls = self.calls.lock().unwrap();
        let (calls, timeout) = self
            .changed
            .wait_timeout_while(calls, LIMIT, |calls| {
                !done(calls, self.resumed.lock().unwrap().is_some())
            })
            .unwrap();
        let handled = calls.iter().map(|c| c.1).collect::<BTreeSet<_>>().len();
        assert!(!timeout.timed_out(), "{what}: {handled} handled");
    }
}

fn value(msg: &Message) -> usize {
    std::str::from_utf8(&msg.payload).unwrap().parse().unwrap()
}

/// Stops the calling thread (the worker's whole runtime) for `FREEZE` the first time
/// record `FROZEN_AT` is handled, once the other worker runs.
async fn maybe_freeze(watch: &Watch, frozen: &AtomicBool, v: usize) {
    if v != FROZEN_AT || frozen.swap(true, Ordering::SeqCst) {
        return;
    }
    // The other worker must be there to take the lease over.
    while !watch.b_running.load(Ordering::SeqCst) {
        tokio::task::yield_now().await;
        std::thread::yield_now();
    }
    std::thread::sleep(FREEZE);
    *watch.resumed.lock().unwrap() = Some(Instant::now());
    // Taken (and dropped) so that the notification cannot fall between a waiter's
    // check and its wait.
    drop(watch.calls.lock().unwrap());
    watch.changed.notify_all();
}

/// Where the process stops.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum FreezeAt {
    /// In the handler call of record `FROZEN_AT`.
    Handler,
    /// Right after a renewal landed, before its answer reaches the worker.
    RenewalAnswer,
    /// With a checkpoint write sent, before it reaches the table.
    CheckpointSent,
}

/// Stops the worker's process at a lease call (see [`FreezeAt`]) once it handled
/// `FROZEN_AT` records and the other worker runs.
struct Freezer {
    watch: Arc<Watch>,
    frozen: Arc<AtomicBool>,
    at: FreezeAt,
}

impl Freezer {
    fn maybe_freeze(&self, at: FreezeAt) {
        let armed = self.at == at
            && self.watch.b_running.load(Ordering::SeqCst)
            && self.watch.calls.lock().unwrap().len() >= FROZEN_AT;
        if !armed || self.frozen.swap(true, Ordering::SeqCst) {
            return;
        }
        std::thread::sleep(FREEZE);
        *self.watch.resumed.lock().unwrap() = Some(Instant::now());
        drop(self.watch.calls.lock().unwrap());
        self.watch.changed.notify_all();
    }
}

#[async_trait::async_trait]
impl Hooks for Freezer {
    async fn before_lease(
        &self,
        op: &'static str,
        _key: Option<&str>,
    ) -> Result<(), shardflow::lease::LeaseError> {
        if op == "checkpoint" {
            self.maybe_freeze(FreezeAt::CheckpointSent);
        }
        Ok(())
    }

    async fn after_lease(
        &self,
        op: &'static str,
        _key: Option<&str>,
        _row: Option<&shardflow::lease::Lease>,
    ) {
        if op == "renew" {
            self.maybe_freeze(FreezeAt::RenewalAnswer);
        }
    }
}

/// How the worker that freezes hands records to its handler.
#[derive(Clone, Copy, Debug)]
enum Mode {
    Records(Concurrency),
    Batches,
}

fn builder(backend: impl shardflow::Backend, worker: &str) -> ConsumerBuilder {
    test_consumer(backend, "orders", "freeze", worker)
        .lease_duration(LEASE)
        .max_records_per_read(50)
}

/// Runs `run` on a thread of its own with a current-thread runtime on the real clock;
/// the receiver answers once it ended.
fn spawn_worker<F>(
    run: impl FnOnce() -> F + Send + 'static,
) -> mpsc::Receiver<Result<(), shardflow::ConsumerError>>
where
    F: std::future::Future<Output = Result<(), shardflow::ConsumerError>>,
{
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        let _ = tx.send(runtime.block_on(async move { run().await }));
    });
    rx
}

fn frozen_worker_starts_no_call_on_the_taken_lease(mode: Mode, at: FreezeAt) {
    let memory = Memory::new();
    let setup = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    setup.block_on(async {
        memory.streams().create_stream("orders", 1).await.unwrap();
        produce(memory.streams().as_ref(), "orders", 0..RECORDS).await;
    });
    let watch = Arc::new(Watch::default());
    let frozen = Arc::new(AtomicBool::new(false));

    let a = builder(
        Hooked::new(
            memory.clone(),
            Freezer {
                watch: watch.clone(),
                frozen: frozen.clone(),
                at,
            },
        ),
        "a",
    );
    let (a_stop, a_done): (ShutdownHandle, _) = match mode {
        Mode::Records(concurrency) => {
            let consumer = a.concurrency(concurrency).build().unwrap();
            // With concurrency, calls take a little while: some are in flight when the
            // process stops, and finish (making room for new ones) as soon as it resumes.
            // Sequential calls return at once: the next one is due right after the resume.
            let call = match (concurrency, at) {
                (Concurrency::Sequential, FreezeAt::Handler) => Duration::ZERO,
                _ => CALL,
            };
            let (watch, frozen) = (watch.clone(), frozen.clone());
            let handler = tower::service_fn(move |msg: Message| {
                let (watch, frozen) = (watch.clone(), frozen.clone());
                async move {
                    let v = value(&msg);
                    watch.started("a", v);
                    if at == FreezeAt::Handler {
                        maybe_freeze(&watch, &frozen, v).await;
                    }
                    if !call.is_zero() {
                        tokio::time::sleep(call).await;
                    }
                    Ok::<_, Infallible>(())
                }
            });
            (
                consumer.shutdown_handle(),
                spawn_worker(move || consumer.run(handler).into_future()),
            )
        }
        Mode::Batches => {
            let consumer = a.build().unwrap();
            let (watch, frozen) = (watch.clone(), frozen.clone());
            let handler = tower::service_fn(move |batch: Batch| {
                let (watch, frozen) = (watch.clone(), frozen.clone());
                async move {
                    // The call is the unit of a batch handler: its records start with it.
                    let values: Vec<usize> = batch.messages.iter().map(value).collect();
                    for v in &values {
                        watch.started("a", *v);
                    }
                    for v in values {
                        if at == FreezeAt::Handler {
                            maybe_freeze(&watch, &frozen, v).await;
                        }
                    }
                    Ok::<_, Infallible>(())
                }
            });
            (
                consumer.shutdown_handle(),
                spawn_worker(move || consumer.run_batches(handler).into_future()),
            )
        }
    };
    // b starts once a reads (so a holds the shard), then watches a's lease.
    watch.wait("a reads", |calls, _| !calls.is_empty());
    let b_watch = watch.clone();
    let b_events = watch.clone();
    let b = builder(memory.clone(), "b")
        .on_event(move |e| {
            if let ShardEvent::LeaseTaken { .. } = e {
                b_events
                    .b_took
                    .lock()
                    .unwrap()
                    .get_or_insert(Instant::now());
            }
        })
        .build()
        .unwrap();
    let b_stop = b.shutdown_handle();
    let b_handler = tower::service_fn(move |msg: Message| {
        b_watch.started("b", value(&msg));
        async { Ok::<_, Infallible>(()) }
    });
    let b_done = spawn_worker(move || b.run(b_handler).into_future());
    watch.b_running.store(true, Ordering::SeqCst);

    // Every record is handled by someone, and a resumed.
    watch.wait("every record handled and a resumed", |calls, resumed| {
        resumed && calls.iter().map(|c| c.1).collect::<BTreeSet<_>>().len() == RECORDS
    });
    // What is checked is an absence (no call of a after b took the lease): a is given
    // a lease duration after its resume to start whatever it would start.
    std::thread::sleep(LEASE);
    a_stop.shutdown();
    b_stop.shutdown();
    for done in [a_done, b_done] {
        done.recv_timeout(LIMIT)
            .expect("the worker stops")
            .expect("the worker ends without error");
    }

    let took = watch.b_took.lock().unwrap().expect("b took the lease");
    let resumed = watch.resumed.lock().unwrap().expect("a resumed");
    assert!(
        took < resumed,
        "{mode:?}: b took the lease only after a resumed"
    );
    let late: Vec<usize> = watch
        .calls
        .lock()
        .unwrap()
        .iter()
        .filter(|(w, _, at)| *w == "a" && *at > took)
        .map(|c| c.1)
        .collect();
    assert_eq!(
        late,
        Vec::<usize>::new(),
        "{mode:?}: a started calls on b's lease after it resumed"
    );
}

#[test]
fn sequential() {
    frozen_worker_starts_no_call_on_the_taken_lease(
        Mode::Records(Concurrency::Sequential),
        FreezeAt::Handler,
    );
}

#[test]
fn per_key() {
    frozen_worker_starts_no_call_on_the_taken_lease(
        Mode::Records(Concurrency::PerKey(8)),
        FreezeAt::Handler,
    );
}

#[test]
fn batch_handler() {
    frozen_worker_starts_no_call_on_the_taken_lease(Mode::Batches, FreezeAt::Handler);
}

#[test]
fn per_key_frozen_after_a_renewal_landed_before_its_answer() {
    frozen_worker_starts_no_call_on_the_taken_lease(
        Mode::Records(Concurrency::PerKey(8)),
        FreezeAt::RenewalAnswer,
    );
}

#[test]
fn sequential_frozen_with_a_checkpoint_sent() {
    frozen_worker_starts_no_call_on_the_taken_lease(
        Mode::Records(Concurrency::Sequential),
        FreezeAt::CheckpointSent,
    );
}
