//! The invariants checked after every history.
//!
//! - every required record is handled: at or after the start point (TRIM_HORIZON: all;
//!   LATEST: written after the first take of its shard's lease as observed in the store;
//!   AT_TIMESTAMP: arrived at or after the timestamp);
//! - per partition key, each incarnation receives a shard's records in sequence order
//!   within one lease tenure (a record delivered again is fine, a new one behind a later
//!   one is not);
//! - no checkpoint ever moves back;
//! - no two owners (process incarnations) commit under one lease counter, and only the
//!   worker that took a lease last commits it;
//! - every checkpoint covers only required records some handler finished before it
//!   was written;
//! - no handler call on a lease another worker has taken since: the last take of a
//!   shard's lease that landed before a call was by the calling incarnation;
//! - in batch mode with a poison record, each delivery's records are each handled or
//!   dead-lettered exactly once (a failed delivery: a prefix of them), none skipped.
//!
//! With feature `table-stream`, the records the 24 h trim removed before any handler
//! finished them (see [`Trim`]) are the only ones not required; every other record of
//! every shard, shards the stream dropped after the trim included, is. And two more
//! ([`check_table_stream`]):
//! - parent-first: no record of a child shard is handled before every required record
//!   of each of its parents (and their parents, up the lineage) was;
//! - per-item order: each incarnation receives the changes of one item (its partition
//!   key, the item's keys) in the order they were written, across shards and rollovers
//!   (a change received again is fine, a new one behind a later one is not; after a
//!   checkpoint reset, behind one received since).

use std::collections::{HashMap, HashSet};

use futures_util::FutureExt;
use shardflow::kinesis::{KinesisApi, Record};
use shardflow::lease::Checkpoint;
use shardflow::{Memory, SequenceNumber};

use super::log::{Log, Trim};
use super::Start;

/// Every record of every shard of `stream`, in shard then sequence order.
pub fn all_records(memory: &Memory, stream: &str) -> Vec<(String, Record)> {
    // The memory backend answers ListShards without faults and without awaiting.
    let shards = memory
        .streams()
        .list_shards(stream)
        .now_or_never()
        .and_then(Result::ok)
        .unwrap_or_default();
    shards
        .into_iter()
        .flat_map(|s| {
            memory
                .streams()
                .records(stream, &s.shard_id)
                .into_iter()
                .map(move |r| (s.shard_id.clone(), r))
        })
        .collect()
}

/// Every record the history wrote: those of the stream's shards now, and those of
/// shards it dropped since the trim (from the trim's snapshot). (shard, sequence,
/// arrival).
pub fn written(
    memory: &Memory,
    log: &Log,
) -> Vec<(String, SequenceNumber, Option<std::time::SystemTime>)> {
    let mut records: Vec<_> = all_records(memory, log.stream())
        .into_iter()
        .map(|(shard, r)| (shard, r.sequence_number, r.approximate_arrival))
        .collect();
    if let Some(trim) = log.trim.lock().unwrap().as_ref() {
        let present: HashSet<String> = records.iter().map(|r| r.0.clone()).collect();
        records.extend(
            trim.records
                .iter()
                .filter(|r| !present.contains(&r.0))
                .cloned(),
        );
    }
    records
}

/// Whether the trim removed the record before any handler finished it.
fn trimmed_unread(trim: Option<&Trim>, shard: &str, sequence: &SequenceNumber) -> bool {
    trim.is_some_and(|t| t.unread.contains(&(shard.to_owned(), sequence.clone())))
}

/// The records the group must handle, given where it started.
fn required(memory: &Memory, log: &Log, start: &Start) -> Vec<(String, SequenceNumber)> {
    let first_take: HashMap<String, std::time::SystemTime> =
        log.takes
            .lock()
            .unwrap()
            .iter()
            .fold(HashMap::new(), |mut m, t| {
                m.entry(t.key.clone()).or_insert(t.time);
                m
            });
    let trim = log.trim.lock().unwrap().clone();
    written(memory, log)
        .into_iter()
        .filter(|(shard, sequence, _)| !trimmed_unread(trim.as_ref(), shard, sequence))
        .filter(|(shard, _, arrival)| {
            let arrival = *arrival;
            match start {
                Start::TrimHorizon => true,
                Start::AtTimestamp(t) => arrival.is_some_and(|a| a >= *t),
                Start::Latest => match first_take.get(shard) {
                    Some(taken) => arrival.is_some_and(|a| a > *taken),
                    // Not taken yet: wait for the take before judging.
                    None => true,
                },
            }
        })
        .map(|(shard, sequence, _)| (shard, sequence))
        .collect()
}

/// The required records no handler finished (yet).
pub fn missing(memory: &Memory, log: &Log, start: &Start) -> Vec<(String, SequenceNumber)> {
    let handled: HashSet<(String, SequenceNumber)> = log
        .handled
        .lock()
        .unwrap()
        .iter()
        .map(|e| (e.shard.clone(), e.sequence.clone()))
        .collect();
    required(memory, log, start)
        .into_iter()
        .filter(|k| !handled.contains(k))
        .collect()
}

pub fn check(memory: &Memory, log: &Log, start: &Start) -> Result<(), String> {
    // A zombie's calls first: the order and checkpoint invariants it breaks follow.
    check_calls_on_held_leases(log)?;
    // The checkpoint invariants next: when records are lost, they usually say how.
    check_commits(memory, log, start)?;
    check_order(log)?;
    for (incarnation, by) in log.dropped_runs.lock().unwrap().iter() {
        if let Some(late) = log
            .delivered
            .lock()
            .unwrap()
            .iter()
            .find(|e| e.incarnation == *incarnation && e.at > *by)
        {
            return Err(format!(
                "invariant dropped-run-stops: {incarnation} still received record {} of {} well after its Run was dropped",
                late.sequence, late.shard
            ));
        }
    }
    if let Some(v) = log.poison_violations.lock().unwrap().first() {
        return Err(format!("invariant handled-or-dead-lettered-once: {v}"));
    }
    let lost = missing(memory, log, start);
    if !lost.is_empty() {
        return Err(format!(
            "invariant no-loss: {} required records never handled, e.g. {:?}",
            lost.len(),
            &lost[..lost.len().min(5)]
        ));
    }
    Ok(())
}

/// No handler call on a lease another worker has taken since: for every call, the last
/// take of its shard's lease that landed before it was by the calling incarnation. (A
/// take is logged once its call answered, a little after it landed: a call in between
/// is not caught, never wrongly blamed.)
fn check_calls_on_held_leases(log: &Log) -> Result<(), String> {
    let owners = log.owners.lock().unwrap().clone();
    let takes = log.takes.lock().unwrap().clone();
    let mut by_shard: HashMap<&str, Vec<(u64, &str)>> = HashMap::new();
    for t in &takes {
        by_shard
            .entry(t.key.as_str())
            .or_default()
            .push((t.at, t.owner.as_str()));
    }
    for list in by_shard.values_mut() {
        list.sort();
    }
    for call in log.calls.lock().unwrap().iter() {
        let Some(list) = by_shard.get(call.shard.as_str()) else {
            continue;
        };
        let before = list.partition_point(|(at, _)| *at < call.at);
        let Some((taken_at, owner)) = before.checked_sub(1).and_then(|i| list.get(i)) else {
            continue;
        };
        let taker = owners.get(*owner).map_or(*owner, String::as_str);
        if taker != call.incarnation {
            return Err(format!(
                "invariant no-call-on-a-lost-lease: {} started a handler call on {} {} at tick {} although {taker} took the lease at tick {taken_at}",
                call.incarnation, call.shard, call.sequence, call.at
            ));
        }
    }
    Ok(())
}

fn check_order(log: &Log) -> Result<(), String> {
    let takes = log.takes.lock().unwrap();
    let tenure =
        |shard: &str, at: u64| takes.iter().filter(|t| t.key == shard && t.at < at).count();
    type Seen = (SequenceNumber, HashSet<SequenceNumber>);
    let mut seen: HashMap<(String, String, usize, String), Seen> = HashMap::new();
    for e in log.delivered.lock().unwrap().iter() {
        // The tenure in which the library handed the record over.
        let key = (
            e.incarnation.clone(),
            e.shard.clone(),
            tenure(&e.shard, e.handed),
            e.partition_key.clone(),
        );
        match seen.get_mut(&key) {
            None => {
                seen.insert(
                    key,
                    (e.sequence.clone(), HashSet::from([e.sequence.clone()])),
                );
            }
            Some((max, set)) => {
                if set.insert(e.sequence.clone()) {
                    if e.sequence < *max {
                        return Err(format!(
                            "invariant order: {} got record {} of {} (key {}) after {} within one tenure",
                            e.incarnation, e.sequence, e.shard, e.partition_key, max
                        ));
                    }
                    *max = e.sequence.clone();
                }
            }
        }
    }
    Ok(())
}

fn check_commits(memory: &Memory, log: &Log, start: &Start) -> Result<(), String> {
    let commits = log.commits.lock().unwrap().clone();
    let takes = log.takes.lock().unwrap().clone();
    let mut first_handled: HashMap<(String, SequenceNumber), u64> = HashMap::new();
    for e in log.handled.lock().unwrap().iter() {
        first_handled
            .entry((e.shard.clone(), e.sequence.clone()))
            .or_insert(e.at);
    }
    // Per shard: required sequence numbers in order, with the latest tick at which all
    // of them up to there had been handled (u64::MAX: one never was).
    let mut per_shard: HashMap<String, Vec<(SequenceNumber, u64)>> = HashMap::new();
    for (shard, seq) in required(memory, log, start) {
        let at = first_handled
            .get(&(shard.clone(), seq.clone()))
            .copied()
            .unwrap_or(u64::MAX);
        per_shard.entry(shard).or_default().push((seq, at));
    }
    for list in per_shard.values_mut() {
        list.sort();
        let mut max = 0;
        for item in list.iter_mut() {
            max = max.max(item.1);
            item.1 = max;
        }
    }
    let mut owners: HashMap<(String, u64), String> = HashMap::new();
    let mut last: HashMap<String, Checkpoint> = HashMap::new();
    let mut last_at: HashMap<String, u64> = HashMap::new();
    for c in &commits {
        if let Some(other) = owners.insert((c.key.clone(), c.counter), c.incarnation.clone()) {
            if other != c.incarnation {
                return Err(format!(
                    "invariant fencing: {other} and {} both committed {} at counter {}",
                    c.incarnation, c.key, c.counter
                ));
            }
        }
        let taker = takes
            .iter()
            .filter(|t| t.at < c.at && t.key == c.key)
            .map(|t| t.owner.as_str())
            .next_back();
        if taker != Some(c.worker.as_str()) {
            return Err(format!(
                "invariant fencing: {} committed {} at {} although the lease was last taken by {taker:?}",
                c.incarnation, c.key, c.checkpoint
            ));
        }
        let empty = Vec::new();
        let list = per_shard.get(&c.key).unwrap_or(&empty);
        let covered = match &c.checkpoint {
            Checkpoint::At(p) => list.partition_point(|(s, _)| *s <= p.sequence),
            Checkpoint::ShardEnd => list.len(),
            _ => 0,
        };
        if covered > 0 && list[covered - 1].1 >= c.at {
            let unhandled = list[..covered]
                .iter()
                .find(|(s, _)| {
                    first_handled
                        .get(&(c.key.clone(), s.clone()))
                        .is_none_or(|at| *at >= c.at)
                })
                .map(|(s, _)| s.to_string());
            let earlier: Vec<String> = commits
                .iter()
                .filter(|e| e.key == c.key && e.at < c.at)
                .map(|e| format!("{} {} (counter {})", e.incarnation, e.checkpoint, e.counter))
                .collect();
            let readers: Vec<String> = log
                .delivered
                .lock()
                .unwrap()
                .iter()
                .filter(|e| e.shard == c.key)
                .fold(Vec::<(String, String, String)>::new(), |mut runs, e| {
                    match runs.last_mut() {
                        Some(r) if r.0 == e.incarnation => r.2 = e.sequence.to_string(),
                        _ => runs.push((
                            e.incarnation.clone(),
                            e.sequence.to_string(),
                            e.sequence.to_string(),
                        )),
                    }
                    runs
                })
                .into_iter()
                .map(|(i, a, b)| format!("{i} {}..{}", &a[a.len() - 4..], &b[b.len() - 4..]))
                .collect();
            return Err(format!(
                "invariant checkpoint-after-handling: {} checkpointed {} at {} before record {unhandled:?} was handled{}; earlier commits of the lease: {earlier:?}; deliveries (incarnation first..last, last 4 digits): {readers:?}",
                c.incarnation,
                c.key,
                c.checkpoint,
                if c.ambiguous { " (ambiguous write)" } else { "" }
            ));
        }
        // A reset landed since the lease's previous commit: it may start lower.
        let reset_since = |from: u64| {
            log.resets
                .lock()
                .unwrap()
                .iter()
                .any(|(at, key)| *key == c.key && *at > from && *at < c.at)
        };
        if let Some(prev) = last
            .get(&c.key)
            .filter(|_| !last_at.get(&c.key).is_some_and(|from| reset_since(*from)))
        {
            let backwards = match (prev, &c.checkpoint) {
                (Checkpoint::ShardEnd, cp) => *cp != Checkpoint::ShardEnd,
                (Checkpoint::At(a), Checkpoint::At(b)) => b < a,
                (Checkpoint::At(_), _) => c.checkpoint != Checkpoint::ShardEnd,
                _ => false,
            };
            if backwards {
                return Err(format!(
                    "invariant monotonic-checkpoint: {} moved {} back from {prev} to {}",
                    c.incarnation, c.key, c.checkpoint
                ));
            }
        }
        last.insert(c.key.clone(), c.checkpoint.clone());
        last_at.insert(c.key.clone(), c.at);
    }
    Ok(())
}

/// No record handled again across a planned hand-off (feature `skewed-load`): for each
/// take written by the lease's previous owner handing it over, no record that owner
/// handled in its tenure before the hand-over is handled again by the new owner in the
/// tenure that starts with it, unless a checkpoint reset of the shard landed between
/// the two. A take written by the new owner (a crash, a freeze, a lost lease or an
/// overdue hand-off) allows records handled again; those are not checked here.
pub fn check_planned_moves(log: &Log) -> Result<(), String> {
    let owners = log.owners.lock().unwrap().clone();
    let takes = log.takes.lock().unwrap().clone();
    let handled = log.handled.lock().unwrap().clone();
    let resets = log.resets.lock().unwrap().clone();
    let incarnation = |owner: &str| owners.get(owner).cloned().unwrap_or(owner.to_owned());
    for (i, t) in takes.iter().enumerate() {
        let Some(from) = &t.handed_over_by else {
            continue;
        };
        let to = incarnation(&t.owner);
        // The previous owner's tenure: since its last take of the shard before this one.
        let since = takes[..i]
            .iter()
            .rev()
            .find(|p| p.key == t.key && incarnation(&p.owner) == *from)
            .map_or(0, |p| p.at);
        // The new owner's tenure: until another owner takes the shard (the new owner's
        // own take of a lease handed to it, which follows at once, continues it).
        let until = takes[i + 1..]
            .iter()
            .find(|n| n.key == t.key && incarnation(&n.owner) != to)
            .map_or(u64::MAX, |n| n.at);
        let before: HashMap<&SequenceNumber, u64> = handled
            .iter()
            .filter(|e| e.shard == t.key && e.incarnation == *from && e.at > since && e.at < t.at)
            .map(|e| (&e.sequence, e.at))
            .collect();
        for e in handled
            .iter()
            .filter(|e| e.shard == t.key && e.incarnation == to && e.at > t.at && e.at < until)
        {
            let Some(first) = before.get(&e.sequence) else {
                continue;
            };
            if resets
                .iter()
                .any(|(at, key)| *key == t.key && at > first && *at < e.at)
            {
                continue;
            }
            return Err(format!(
                "invariant no-duplicate-from-a-planned-move: record {} of {} handled by {from} at tick {first} and again by {to} at tick {}, after {from} handed the lease over to {to} at tick {} (a planned hand-off)",
                e.sequence, t.key, e.at, t.at
            ));
        }
    }
    Ok(())
}

/// The invariants of a table's stream (feature `table-stream`), after [`check`]:
/// parent-first on the handled log, per-item order on the delivered log.
pub fn check_table_stream(memory: &Memory, log: &Log, start: &Start) -> Result<(), String> {
    // The records excused as trimmed unread are exactly those: past retention at the
    // trim, and handled by nobody before it.
    if let Some(trim) = log.trim.lock().unwrap().as_ref() {
        for (shard, sequence, arrival) in &trim.records {
            if !trim.unread.contains(&(shard.clone(), sequence.clone())) {
                continue;
            }
            let early = log
                .handled
                .lock()
                .unwrap()
                .iter()
                .any(|e| e.at < trim.at && e.shard == *shard && e.sequence == *sequence);
            if early || !arrival.is_some_and(|a| a < trim.cutoff) {
                return Err(format!(
                    "the trim excused record {sequence} of {shard}, which {}",
                    if early {
                        "was handled before it"
                    } else {
                        "arrived after its cutoff"
                    }
                ));
            }
        }
    }
    let parents = log.parents.lock().unwrap().clone();
    let mut first_handled: HashMap<(&str, &SequenceNumber), u64> = HashMap::new();
    let mut shard_started: HashMap<&str, (u64, &SequenceNumber, &str)> = HashMap::new();
    let handled = log.handled.lock().unwrap().clone();
    for e in &handled {
        first_handled
            .entry((e.shard.as_str(), &e.sequence))
            .or_insert(e.at);
        shard_started.entry(e.shard.as_str()).or_insert((
            e.at,
            &e.sequence,
            e.incarnation.as_str(),
        ));
    }
    // Per shard, when its last required record was first handled.
    let mut finished: HashMap<String, (u64, Option<SequenceNumber>)> = HashMap::new();
    for (shard, sequence) in required(memory, log, start) {
        let at = first_handled
            .get(&(shard.as_str(), &sequence))
            .copied()
            .unwrap_or(u64::MAX);
        let entry = finished.entry(shard).or_insert((0, None));
        if at >= entry.0 {
            *entry = (at, Some(sequence));
        }
    }
    for (child, (started, first, by)) in &shard_started {
        // Every ancestor, not only the parents: a parent without records between them
        // says nothing about its own parents.
        let mut ancestors: Vec<&String> = parents.get(*child).into_iter().flatten().collect();
        let mut i = 0;
        while i < ancestors.len() {
            let next = parents.get(ancestors[i].as_str()).into_iter().flatten();
            ancestors.extend(next);
            i += 1;
        }
        for parent in ancestors {
            if let Some((done, last)) = finished.get(parent) {
                if done > started {
                    return Err(format!(
                        "invariant parent-first: {by} handled record {first} of {child} at tick {started}, \
                         before record {} of its ancestor {parent} was handled (tick {})",
                        last.as_ref().map_or("?".to_owned(), |s| s.to_string()),
                        if *done == u64::MAX { "never".to_owned() } else { done.to_string() }
                    ));
                }
            }
        }
    }
    // Per incarnation and item: the changes received, and the newest one since the
    // last checkpoint reset that landed (an operator's request to read again, which
    // may bring back changes another worker handled). Only required changes: a reset
    // also brings those from before the group's start.
    let resets: Vec<u64> = log.resets.lock().unwrap().iter().map(|r| r.0).collect();
    let required: HashSet<(String, SequenceNumber)> =
        required(memory, log, start).into_iter().collect();
    let mut received: HashMap<(&str, &str), HashSet<&SequenceNumber>> = HashMap::new();
    let mut newest: HashMap<(&str, &str, usize), (&SequenceNumber, &str)> = HashMap::new();
    let delivered = log.delivered.lock().unwrap().clone();
    for e in &delivered {
        if !required.contains(&(e.shard.clone(), e.sequence.clone())) {
            continue;
        }
        let item = (e.incarnation.as_str(), e.partition_key.as_str());
        if !received.entry(item).or_default().insert(&e.sequence) {
            continue; // received again
        }
        let epoch = resets.iter().filter(|at| **at < e.handed).count();
        match newest.get_mut(&(item.0, item.1, epoch)) {
            Some((max, max_shard)) if e.sequence < **max => {
                return Err(format!(
                    "invariant per-item-order: {} received change {} of {} (item {}) after \
                     the later change {max} of {max_shard}",
                    e.incarnation, e.sequence, e.shard, e.partition_key
                ));
            }
            Some(newest) => *newest = (&e.sequence, e.shard.as_str()),
            None => {
                newest.insert((item.0, item.1, epoch), (&e.sequence, e.shard.as_str()));
            }
        }
    }
    Ok(())
}
