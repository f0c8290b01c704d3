//! Room per shard: how many records of each shard the producer holds at once, and the
//! line of records waiting for their shard's room, so that a shard with a backlog never
//! holds back the records of another.
//!
//! Every record enters through the gate. It is predicted to land in a shard (by the
//! shard map the background task last listed; before there is one, or when the producer
//! does not list shards, every record shares one line). While its shard holds fewer than
//! `room` records and none waits before it, the record goes straight to the background
//! task; otherwise it waits in its shard's line, in the order it was handed over, and
//! goes on when a record of that shard is answered. A record of another shard never
//! waits behind it. A flush or close waits until every record handed over before it
//! has gone on, so it still covers them.

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::task::Waker;

use tokio::sync::{mpsc, oneshot};

use crate::kinesis::PutRecord;

use super::record::{ProduceError, Stored};
use super::shards::{hash_key, ShardMap};

/// The line a record is counted in: the shard it is predicted to land in, or `None`
/// while the shards are not known.
pub(crate) type Line = Option<Arc<str>>;

/// A record handed over, with what the background task needs of it.
pub(crate) struct Handed {
    pub(crate) record: PutRecord,
    pub(crate) size: usize,
    pub(crate) reply: Reply,
    /// The hash of its partition key (ordered mode; 0 otherwise).
    pub(crate) key: u64,
}

struct Waiting {
    /// When it was handed over, among every record and flush.
    seq: u64,
    handed: Handed,
}

#[derive(Default)]
struct LineState {
    /// Records of this line the background task holds (taken, not yet answered).
    held: usize,
    waiting: VecDeque<Waiting>,
    /// Handles whose `poll_ready` waits for room in this line.
    wakers: Vec<Waker>,
}

impl LineState {
    fn has_room(&self, room: usize) -> bool {
        self.held < room && self.waiting.is_empty()
    }
}

#[derive(Default)]
struct State {
    map: Option<Arc<ShardMap>>,
    lines: HashMap<Line, LineState>,
    next_seq: u64,
    /// Flushes and the close, each waiting for the records handed over before it
    /// (sequence numbers below its own) to go on.
    parked: VecDeque<(u64, Command)>,
    closed: bool,
}

pub(crate) struct Gate {
    state: Mutex<State>,
    tx: mpsc::UnboundedSender<Command>,
    room: usize,
    ordered: bool,
}

impl Gate {
    pub(crate) fn new(tx: mpsc::UnboundedSender<Command>, room: usize, ordered: bool) -> Self {
        Gate {
            state: Mutex::default(),
            tx,
            room: room.max(1),
            ordered,
        }
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        // The state stays consistent at every unlock: a panic elsewhere cannot leave
        // it half-changed, so a poisoned lock is still usable.
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// The hash of a partition key that orders its records (ordered mode).
    pub(crate) fn key_of(&self, record: &PutRecord) -> u64 {
        if !self.ordered {
            return 0;
        }
        use std::hash::{Hash, Hasher};
        let mut hasher = std::collections::hash_map::DefaultHasher::new();
        record.partition_key.hash(&mut hasher);
        hasher.finish()
    }

    /// The background task listed the shards: later records are counted per shard.
    pub(crate) fn set_map(&self, map: Arc<ShardMap>) {
        self.lock().map = Some(map);
    }

    pub(crate) fn is_closed(&self) -> bool {
        self.lock().closed
    }

    /// Hands records over, in order: each goes on at once or waits in its shard's
    /// line. Returns the line of the last one; [`ProduceError::Closed`] (nothing
    /// taken) once the producer is closed.
    pub(crate) fn submit(&self, records: Vec<Handed>) -> Result<Line, ProduceError> {
        let mut state = self.lock();
        if state.closed {
            return Err(ProduceError::Closed);
        }
        let mut straight = Vec::new();
        let mut last = None;
        for handed in records {
            let line = match (&state.map, hash_key(&handed.record)) {
                (Some(map), Some(hash)) => map.shard_of(hash).map(|(_, shard)| shard.clone()),
                _ => None,
            };
            let seq = state.next_seq;
            state.next_seq += 1;
            let room = self.room;
            let slot = state.lines.entry(line.clone()).or_default();
            if slot.has_room(room) {
                slot.held += 1;
                straight.push((handed.record, handed.size, handed.reply, line.clone()));
            } else {
                slot.waiting.push_back(Waiting { seq, handed });
            }
            last = line;
        }
        // One command: records handed over together enter the task in one step.
        let sent = match straight.len() {
            0 => Ok(()),
            1 => {
                let (record, size, reply, line) = straight.remove(0);
                self.tx.send(Command::Record {
                    record,
                    size,
                    reply,
                    line,
                })
            }
            _ => self.tx.send(Command::Records(straight)),
        };
        drop(state);
        // The task is gone (the runtime stopped): the replies dropped with the
        // command tell the callers `Closed`.
        drop(sent);
        Ok(last)
    }

    /// Whether a record of `line` would go on at once; if not, `waker` is woken when
    /// it would (or the producer closes).
    pub(crate) fn has_room(&self, line: &Line, waker: &Waker) -> bool {
        let mut state = self.lock();
        if state.closed {
            return true;
        }
        let room = self.room;
        match state.lines.get_mut(line) {
            None => true,
            Some(slot) if slot.has_room(room) => true,
            Some(slot) => {
                if !slot.wakers.iter().any(|w| w.will_wake(waker)) {
                    slot.wakers.push(waker.clone());
                }
                false
            }
        }
    }

    /// A record of `line` the task held was answered: the next waiting one of that
    /// line goes on.
    pub(crate) fn release(&self, line: &Line) {
        let mut wake = Vec::new();
        let mut state = self.lock();
        let room = self.room;
        let mut admitted = Vec::new();
        if let Some(slot) = state.lines.get_mut(line) {
            slot.held = slot.held.saturating_sub(1);
            while slot.held < room {
                let Some(next) = slot.waiting.pop_front() else {
                    break;
                };
                slot.held += 1;
                admitted.push(next.handed);
            }
            if slot.has_room(room) {
                wake = std::mem::take(&mut slot.wakers);
            }
            if slot.held == 0 && slot.waiting.is_empty() && slot.wakers.is_empty() {
                state.lines.remove(line);
            }
        }
        for handed in admitted {
            // Sent under the lock: two releases of one line keep its order.
            let _ = self.tx.send(Command::Record {
                record: handed.record,
                size: handed.size,
                reply: handed.reply,
                line: line.clone(),
            });
        }
        self.unpark(&mut state);
        drop(state);
        wake.into_iter().for_each(Waker::wake);
    }

    /// Ordered mode: a record of `key` finally failed. The records of that key still
    /// waiting for room fail too, unsent (the task fails those it holds), so that
    /// nothing of the key is stored after it.
    pub(crate) fn fail_key(&self, key: u64, cause: &ProduceError) {
        let mut state = self.lock();
        let mut failed = Vec::new();
        let mut wake = Vec::new();
        let room = self.room;
        for slot in state.lines.values_mut() {
            if slot.waiting.iter().all(|w| w.handed.key != key) {
                continue;
            }
            let mut kept = VecDeque::with_capacity(slot.waiting.len());
            for w in slot.waiting.drain(..) {
                if w.handed.key == key {
                    failed.push(w.handed.reply);
                } else {
                    kept.push_back(w);
                }
            }
            slot.waiting = kept;
            if slot.has_room(room) {
                wake.append(&mut slot.wakers);
            }
        }
        self.unpark(&mut state);
        drop(state);
        for reply in failed {
            let _ = reply.send(Err(ProduceError::AfterFailure(Box::new(cause.clone()))));
        }
        wake.into_iter().for_each(Waker::wake);
    }

    /// Sends `Flush` once every record handed over before it has gone on.
    pub(crate) fn flush(&self, command: Command) -> Result<(), ProduceError> {
        let mut state = self.lock();
        if state.closed {
            return Err(ProduceError::Closed);
        }
        self.park(&mut state, command);
        Ok(())
    }

    /// Accepts nothing more, and sends `Close` once every record handed over has gone
    /// on. A second close changes nothing.
    pub(crate) fn close(&self) {
        let mut state = self.lock();
        if state.closed {
            return;
        }
        state.closed = true;
        let wake: Vec<Waker> = state
            .lines
            .values_mut()
            .flat_map(|slot| std::mem::take(&mut slot.wakers))
            .collect();
        self.park(&mut state, Command::Close);
        drop(state);
        wake.into_iter().for_each(Waker::wake);
    }

    fn park(&self, state: &mut State, command: Command) {
        let seq = state.next_seq;
        state.next_seq += 1;
        state.parked.push_back((seq, command));
        self.unpark(state);
    }

    /// Sends the parked commands that no waiting record came before.
    fn unpark(&self, state: &mut State) {
        if state.parked.is_empty() {
            return;
        }
        let first_waiting = state
            .lines
            .values()
            .filter_map(|slot| slot.waiting.front().map(|w| w.seq))
            .min()
            .unwrap_or(u64::MAX);
        while state
            .parked
            .front()
            .is_some_and(|(seq, _)| *seq < first_waiting)
        {
            if let Some((_, command)) = state.parked.pop_front() {
                let _ = self.tx.send(command);
            }
        }
    }
}

/// Where a caller waits for its record's fate.
pub(crate) type Reply = oneshot::Sender<Result<Stored, ProduceError>>;

/// What the handles send to the task.
pub(crate) enum Command {
    /// A validated record to write.
    Record {
        record: PutRecord,
        size: usize,
        reply: Reply,
        /// The gate's line it is counted in, given back when it is answered.
        line: Line,
    },
    /// Validated records handed over together ([`Producer::send_all`]): taken in one
    /// step, so that in ordered mode each is queued behind the one before it of its key
    /// before any of them can fail.
    ///
    /// [`Producer::send_all`]: super::Producer::send_all
    Records(Vec<(PutRecord, usize, Reply, Line)>),
    /// Answer when every record sent before this command has been answered.
    Flush(oneshot::Sender<()>),
    /// Accept nothing more, write everything held, then stop.
    Close,
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kinesis::ShardInfo;
    use bytes::Bytes;
    use tokio::sync::oneshot;

    fn shard(id: &str, start: u128, end: u128) -> ShardInfo {
        ShardInfo {
            shard_id: id.into(),
            parent_shard_id: None,
            adjacent_parent_shard_id: None,
            starting_hash_key: start,
            ending_hash_key: end,
            starting_sequence_number: "1".parse().unwrap(),
            ending_sequence_number: None,
        }
    }

    /// A record of `key` for the shard owning hash `hash`.
    fn handed(
        gate: &Gate,
        key: &str,
        hash: u128,
    ) -> (
        Handed,
        oneshot::Receiver<Result<super::super::Stored, ProduceError>>,
    ) {
        let record = PutRecord {
            data: Bytes::from_static(b"x"),
            partition_key: key.into(),
            explicit_hash_key: Some(hash.to_string()),
        };
        let (reply, answer) = oneshot::channel();
        let key = gate.key_of(&record);
        (
            Handed {
                record,
                size: 1,
                reply,
                key,
            },
            answer,
        )
    }

    /// The partition keys of the records the channel holds, and whether a flush or a
    /// close came, in order.
    fn taken(rx: &mut mpsc::UnboundedReceiver<Command>) -> Vec<String> {
        let mut out = Vec::new();
        while let Ok(command) = rx.try_recv() {
            match command {
                Command::Record { record, .. } => out.push(record.partition_key),
                Command::Records(records) => {
                    out.extend(records.into_iter().map(|r| r.0.partition_key))
                }
                Command::Flush(_) => out.push("flush".into()),
                Command::Close => out.push("close".into()),
            }
        }
        out
    }

    #[test]
    fn a_full_shard_makes_only_its_own_records_wait_in_order() {
        let (tx, mut rx) = mpsc::unbounded_channel();
        let gate = Gate::new(tx, 2, true);
        let map = ShardMap::new(
            &[shard("a", 0, 99), shard("b", 100, 199)],
            tokio::time::Instant::now(),
        );
        gate.set_map(Arc::new(map));
        let mut answers = Vec::new();
        for key in ["a1", "a2", "a3", "a4"] {
            let (h, answer) = handed(&gate, key, 5);
            answers.push(answer);
            assert_eq!(gate.submit(vec![h]).unwrap().as_deref(), Some("a"));
        }
        let (b, _b_answer) = handed(&gate, "b1", 150);
        gate.submit(vec![b]).unwrap();
        gate.flush(Command::Flush(oneshot::channel().0)).unwrap();
        // Room for two of "a"; "b" is not held back; the flush waits for a3 and a4.
        assert_eq!(taken(&mut rx), ["a1", "a2", "b1"]);
        let line_a: Line = Some(Arc::from("a"));
        let waker = Waker::noop().clone();
        assert!(!gate.has_room(&line_a, &waker));
        assert!(gate.has_room(&Some(Arc::from("b")), &waker));
        gate.release(&line_a);
        assert_eq!(taken(&mut rx), ["a3"]);
        gate.release(&line_a);
        assert_eq!(taken(&mut rx), ["a4", "flush"]);
        gate.release(&line_a);
        assert!(gate.has_room(&line_a, &waker));
        gate.close();
        assert_eq!(taken(&mut rx), ["close"]);
        assert!(matches!(
            gate.submit(vec![handed(&gate, "late", 5).0]),
            Err(ProduceError::Closed)
        ));
    }

    #[test]
    fn a_final_failure_fails_the_waiting_records_of_its_key() {
        let (tx, mut rx) = mpsc::unbounded_channel();
        let gate = Gate::new(tx, 1, true);
        let (first, _) = handed(&gate, "k", 5);
        let (second, mut second_answer) = handed(&gate, "k", 5);
        let (other, mut other_answer) = handed(&gate, "j", 5);
        gate.submit(vec![first, second, other]).unwrap();
        assert_eq!(taken(&mut rx), ["k"]);
        let cause = ProduceError::Closed;
        gate.fail_key(gate.key_of(&handed(&gate, "k", 5).0.record), &cause);
        assert!(matches!(
            second_answer.try_recv(),
            Ok(Err(ProduceError::AfterFailure(_)))
        ));
        assert!(other_answer.try_recv().is_err(), "another key still waits");
        gate.release(&None);
        assert_eq!(taken(&mut rx), ["j"]);
    }
}
