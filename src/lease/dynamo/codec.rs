//! The lease row codec: how a [`Lease`] is stored as a DynamoDB item, attribute by
//! attribute, and read back.
//!
//! One table per consumer group, one item per shard. Attribute names are the Java KCL's
//! where they mean the same thing, so a KCL application's lease table can be taken over
//! (and read by KCL tooling) without losing positions:
//!
//! | attribute | type | meaning |
//! |---|---|---|
//! | `leaseKey` | S, **hash key** | the shard id; in multi-stream mode `account:stream:creationEpoch:shardId`, the KCL's multi-stream key |
//! | `shardId` | S, multi-stream rows only | the shard id, as the KCL's multi-stream serializer writes it |
//! | `leaseOwner` | S, absent when unowned | the worker incarnation holding the lease: `<worker id>#<nonce>` (see [`worker_of`](crate::lease::worker_of)) |
//! | `leaseCounter` | N | bumped by every take, renewal and release: the fencing token |
//! | `checkpoint` | S | the sequence number's digits (at least 21, zero-padded: DynamoDB Streams refuses shorter ones), or `TRIM_HORIZON`, `LATEST`, `AT_TIMESTAMP`, `SHARD_END` |
//! | `checkpointSubSequenceNumber` | N | the user record within a KPL aggregate (0 for plain records) |
//! | `checkpointTimestamp` | N, optional | shardflow's: with `AT_TIMESTAMP`, the start in epoch milliseconds (a LATEST or AT_TIMESTAMP start resolved by the first owner); without it, the consumer's configured timestamp, as in the KCL |
//! | `parentShardId` | SS, absent when the shard has no parent (DynamoDB refuses empty sets) | the shard's parents (read back sorted: a set has no order) |
//! | `pendingOwner` | S, optional | shardflow's hand-off request: the worker that asks the owner to release to it |
//! | `streamName` | S | in multi-stream mode the KCL's: the stream identifier `account:stream:creationEpoch`; in single-stream mode shardflow's: the stream of the shard, on every row shardflow creates, and added (`claim_for_stream`) to a KCL row of the stream's shards; the consumer refuses a table whose rows name another stream (rows without it, the KCL's, are accepted) |
//! | `ownerSwitchesSinceCheckpoint` | N | the KCL's: a take from another owner adds one, a checkpoint resets it; always written (the KCL's reader requires it) |
//! | `childShardIds` | SS, optional | the KCL's: an ended shard's children, written after it reached `SHARD_END` (`record_children`) |
//! | `startingHashKey`, `endingHashKey` | S (decimal) | the KCL's: the shard's hash-key range, written on creation |
//! | `checkpointOwner` | S, optional | KCL 3: the worker still processing during its graceful hand-off; removed by a take or release |
//! | `pendingCheckpoint`, `pendingCheckpointSubSequenceNumber`, `pendingCheckpointState` | S, N, B | the KCL's two-phase checkpoint: ignored (the committed `checkpoint` counts) and removed by every checkpoint shardflow stores |
//! | `throughputKBps` | N, optional | the KCL 3's: the shard's recent throughput in KiB/s (record data bytes ÷ 1,024 per second, smoothed), written by the owner's renewals; read back as [`Lease::throughput_kbps`], kept by every other write; a negative or non-finite value makes the row unreadable |
//! | `checkpointedAt` | N, optional | shardflow's: when the checkpoint was last written (epoch milliseconds of the writer's clock), set by every checkpoint write and reset in the same UpdateItem; absent until the first one and in rows the KCL wrote (the KCL neither reads nor updates it) |
//! | `resetCheckpoint`, `resetCheckpointSubSequenceNumber`, `resetCheckpointTimestamp` | S, N, N, optional | shardflow's: an operator's reset request on an owned row (`request_reset`, see [`crate::admin`]), in the form of `checkpoint` and its sub-sequence and timestamp; the owner applies it (`reset`), which removes it |
//!
//! | `entityType` | S, optional | KCL 3.5: what the row is. Absent or `LEASE`: a lease; anything else is not a lease and is never parsed, written or deleted as one ([`crate::lease::entity`]). Written as `LEASE` on the rows shardflow creates in a table in the single-table format (one where a row carries `entityType`) |
//!
//! Sequence numbers are stored as strings: they have up to 129 digits, more than a
//! DynamoDB Number holds. No condition compares them; fencing is on the counter.

use std::collections::HashMap;

use aws_sdk_dynamodb::types::AttributeValue;

use crate::kinesis::StreamIdentity;
use crate::lease::entity::{EntityKind, EntityRow, RowKind, ENTITY_TYPE};
use crate::lease::{Checkpoint, Lease, LeaseError};

/// The hash key: the shard id.
pub(super) const KEY: &str = "leaseKey";
/// The owning worker.
pub(super) const OWNER: &str = "leaseOwner";
/// The fencing token.
pub(super) const COUNTER: &str = "leaseCounter";
/// The checkpoint's sequence number or sentinel.
pub(super) const CHECKPOINT: &str = "checkpoint";
/// The checkpoint's sub-sequence number.
pub(super) const SUB_SEQUENCE: &str = "checkpointSubSequenceNumber";
/// The start time of an `AT_TIMESTAMP` checkpoint, epoch milliseconds.
pub(super) const TIMESTAMP: &str = "checkpointTimestamp";
/// The parent shards.
pub(super) const PARENTS: &str = "parentShardId";
/// The worker asking for a hand-off.
pub(super) const PENDING_OWNER: &str = "pendingOwner";
/// The stream the row belongs to (shardflow's).
pub(super) const STREAM: &str = "streamName";
/// The shard id of a multi-stream row (the KCL's multi-stream serializer writes it).
pub(super) const SHARD_ID: &str = "shardId";
/// Owner changes since the last checkpoint (the KCL's).
pub(super) const OWNER_SWITCHES: &str = "ownerSwitchesSinceCheckpoint";
/// The child shards of an ended shard (the KCL's).
pub(super) const CHILDREN: &str = "childShardIds";
/// The lowest hash key of the shard (the KCL's, a decimal string).
pub(super) const STARTING_HASH: &str = "startingHashKey";
/// The highest hash key of the shard (the KCL's, a decimal string).
pub(super) const ENDING_HASH: &str = "endingHashKey";
/// KCL 3: the worker still processing during a graceful hand-off to `leaseOwner`.
pub(super) const CHECKPOINT_OWNER: &str = "checkpointOwner";
/// The KCL's two-phase checkpoint: shardflow never writes it and removes it with
/// every checkpoint it stores, as the KCL does when it checkpoints.
pub(super) const PENDING_CHECKPOINT: &str = "pendingCheckpoint";
/// The pending checkpoint's sub-sequence number.
pub(super) const PENDING_SUB_SEQUENCE: &str = "pendingCheckpointSubSequenceNumber";
/// The application state saved with a pending checkpoint (B; some KCL 3 versions write N).
pub(super) const PENDING_STATE: &str = "pendingCheckpointState";
/// When the checkpoint was last written, epoch milliseconds (shardflow's).
pub(super) const CHECKPOINTED_AT: &str = "checkpointedAt";
/// An operator's reset request: the checkpoint to move to (shardflow's).
pub(super) const RESET: &str = "resetCheckpoint";
/// The reset request's sub-sequence number.
pub(super) const RESET_SUB_SEQUENCE: &str = "resetCheckpointSubSequenceNumber";
/// The reset request's `AT_TIMESTAMP` time, epoch milliseconds.
pub(super) const RESET_TIMESTAMP: &str = "resetCheckpointTimestamp";
/// The shard's recent throughput in KiB/s (the KCL 3's).
pub(super) const THROUGHPUT: &str = "throughputKBps";

/// What `item` is, from its `entityType` (see [`crate::lease::entity`]): a lease unless
/// the attribute is present and not `LEASE`. An `entityType` that is not a string is
/// not `LEASE` either.
pub(super) fn row_kind(item: &HashMap<String, AttributeValue>) -> RowKind {
    match item.get(ENTITY_TYPE) {
        None => RowKind::Lease,
        Some(AttributeValue::S(value)) => RowKind::of(Some(value)),
        Some(other) => RowKind::of(Some(&format!("{other:?}"))),
    }
}

/// Whether `item` carries an `entityType` (the KCL 3.5 single-table format).
pub(super) fn has_entity_type(item: &HashMap<String, AttributeValue>) -> bool {
    item.contains_key(ENTITY_TYPE)
}

/// What shardflow reads of a non-lease row of kind `kind`: its key, the KCL leader's
/// owner, a migration's state. Nothing else of it is read, and a missing or odd
/// attribute is not an error (the row is not ours).
pub(super) fn entity_from_item(
    item: &HashMap<String, AttributeValue>,
    kind: EntityKind,
) -> EntityRow {
    let text = |name: &str| match item.get(name) {
        Some(AttributeValue::S(s)) => Some(s.clone()),
        _ => None,
    };
    let (owner, state) = match kind {
        EntityKind::KclLeader => (text("ownerName"), None),
        EntityKind::KclClientVersionMigration => (None, text("cv")),
        EntityKind::KclTableMigration => (None, text("tm")),
        _ => (None, None),
    };
    EntityRow {
        key: text(KEY).unwrap_or_else(|| "?".to_owned()),
        kind,
        owner,
        state,
    }
}

/// The item that stores `lease`.
pub(super) fn item_from_lease(lease: &Lease) -> HashMap<String, AttributeValue> {
    let (checkpoint, sub_sequence) = lease.checkpoint.as_attribute();
    let mut item = HashMap::from([
        (KEY.to_owned(), AttributeValue::S(lease.key.clone())),
        (
            COUNTER.to_owned(),
            AttributeValue::N(lease.counter.to_string()),
        ),
        (CHECKPOINT.to_owned(), AttributeValue::S(checkpoint)),
        (
            SUB_SEQUENCE.to_owned(),
            AttributeValue::N(sub_sequence.to_string()),
        ),
    ]);
    if let Some(millis) = lease.checkpoint.timestamp_millis() {
        item.insert(TIMESTAMP.to_owned(), AttributeValue::N(millis.to_string()));
    }
    if let Some(owner) = &lease.owner {
        item.insert(OWNER.to_owned(), AttributeValue::S(owner.clone()));
    }
    if !lease.parents.is_empty() {
        item.insert(
            PARENTS.to_owned(),
            AttributeValue::Ss(lease.parents.clone()),
        );
    }
    if let Some(pending) = &lease.pending_owner {
        item.insert(PENDING_OWNER.to_owned(), AttributeValue::S(pending.clone()));
    }
    // The KCL's reader refuses a row without it (it is a non-null field there).
    item.insert(
        OWNER_SWITCHES.to_owned(),
        AttributeValue::N(lease.owner_switches.to_string()),
    );
    if let Some(stream) = &lease.stream {
        item.insert(STREAM.to_owned(), AttributeValue::S(stream.clone()));
    }
    // A multi-stream row (`account:stream:creationEpoch:shardId`) also carries its shard
    // id, as the KCL's multi-stream serializer writes it.
    if let Some((_, shard_id)) = StreamIdentity::split_lease_key(&lease.key) {
        item.insert(SHARD_ID.to_owned(), AttributeValue::S(shard_id.to_owned()));
    }
    if !lease.children.is_empty() {
        item.insert(
            CHILDREN.to_owned(),
            AttributeValue::Ss(lease.children.clone()),
        );
    }
    if let Some((start, end)) = lease.hash_range {
        item.insert(
            STARTING_HASH.to_owned(),
            AttributeValue::S(start.to_string()),
        );
        item.insert(ENDING_HASH.to_owned(), AttributeValue::S(end.to_string()));
    }
    if let Some(checkpoint_owner) = &lease.checkpoint_owner {
        item.insert(
            CHECKPOINT_OWNER.to_owned(),
            AttributeValue::S(checkpoint_owner.clone()),
        );
    }
    if let Some(at) = lease.checkpointed_at {
        item.insert(
            CHECKPOINTED_AT.to_owned(),
            AttributeValue::N(epoch_millis(at).to_string()),
        );
    }
    if let Some(kbps) = lease.throughput_kbps {
        item.insert(THROUGHPUT.to_owned(), throughput_attribute(kbps));
    }
    if let Some(reset) = &lease.reset_to {
        let (value, sub_sequence) = reset.as_attribute();
        item.insert(RESET.to_owned(), AttributeValue::S(value));
        item.insert(
            RESET_SUB_SEQUENCE.to_owned(),
            AttributeValue::N(sub_sequence.to_string()),
        );
        if let Some(millis) = reset.timestamp_millis() {
            item.insert(
                RESET_TIMESTAMP.to_owned(),
                AttributeValue::N(millis.to_string()),
            );
        }
    }
    item
}

/// Parses a stored item.
pub(super) fn lease_from_item(item: &HashMap<String, AttributeValue>) -> Result<Lease, LeaseError> {
    let key = string(item, KEY, "?")?
        .ok_or_else(|| LeaseError::Corrupt(format!("an item without {KEY}")))?;
    let required = |value: Option<String>, name: &str| {
        value.ok_or_else(|| LeaseError::Corrupt(format!("lease {key}: no {name}")))
    };
    let counter = parse_number(
        &key,
        COUNTER,
        &required(number(item, COUNTER, &key)?, COUNTER)?,
    )?;
    let checkpoint = required(string(item, CHECKPOINT, &key)?, CHECKPOINT)?;
    let sub_sequence = match number(item, SUB_SEQUENCE, &key)? {
        Some(n) => parse_number(&key, SUB_SEQUENCE, &n)?,
        None => 0,
    };
    let timestamp = match number(item, TIMESTAMP, &key)? {
        Some(n) => Some(parse_number(&key, TIMESTAMP, &n)?),
        None => None,
    };
    let owner_switches = match number(item, OWNER_SWITCHES, &key)? {
        Some(n) => parse_number(&key, OWNER_SWITCHES, &n)?,
        None => 0,
    };
    let hash_range = match (
        string(item, STARTING_HASH, &key)?,
        string(item, ENDING_HASH, &key)?,
    ) {
        (Some(start), Some(end)) => Some((
            parse_hash_key(&key, STARTING_HASH, &start)?,
            parse_hash_key(&key, ENDING_HASH, &end)?,
        )),
        _ => None,
    };
    let reset_to = match string(item, RESET, &key)? {
        Some(value) => {
            let sub_sequence = match number(item, RESET_SUB_SEQUENCE, &key)? {
                Some(n) => parse_number(&key, RESET_SUB_SEQUENCE, &n)?,
                None => 0,
            };
            let timestamp = match number(item, RESET_TIMESTAMP, &key)? {
                Some(n) => Some(parse_number(&key, RESET_TIMESTAMP, &n)?),
                None => None,
            };
            Some(Checkpoint::from_attribute(&value, sub_sequence)?.with_timestamp_millis(timestamp))
        }
        None => None,
    };
    let checkpointed_at = match number(item, CHECKPOINTED_AT, &key)? {
        Some(n) => Some(
            std::time::SystemTime::UNIX_EPOCH
                + std::time::Duration::from_millis(parse_number(&key, CHECKPOINTED_AT, &n)?),
        ),
        None => None,
    };
    let throughput_kbps = match number(item, THROUGHPUT, &key)? {
        Some(n) => Some(parse_throughput(&key, &n)?),
        None => None,
    };
    Ok(Lease {
        reset_to,
        checkpointed_at,
        throughput_kbps,
        parents: string_set(item, PARENTS, &key)?,
        children: string_set(item, CHILDREN, &key)?,
        stream: string(item, STREAM, &key)?,
        checkpoint_owner: string(item, CHECKPOINT_OWNER, &key)?,
        owner_switches,
        hash_range,
        owner: string(item, OWNER, &key)?,
        counter,
        checkpoint: Checkpoint::from_attribute(&checkpoint, sub_sequence)?
            .with_timestamp_millis(timestamp),
        pending_owner: string(item, PENDING_OWNER, &key)?,
        unreadable: None,
        key,
    })
}

/// Epoch milliseconds of `at` (0 before the epoch).
pub(super) fn epoch_millis(at: std::time::SystemTime) -> u64 {
    at.duration_since(std::time::SystemTime::UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
}

/// A string attribute, if present.
fn string(
    item: &HashMap<String, AttributeValue>,
    name: &str,
    key: &str,
) -> Result<Option<String>, LeaseError> {
    match item.get(name) {
        None => Ok(None),
        Some(AttributeValue::S(s)) => Ok(Some(s.clone())),
        Some(_) => Err(LeaseError::Corrupt(format!(
            "lease {key}: {name} is not a string"
        ))),
    }
}

/// A string set attribute, sorted (a set has no order); empty when absent.
fn string_set(
    item: &HashMap<String, AttributeValue>,
    name: &str,
    key: &str,
) -> Result<Vec<String>, LeaseError> {
    match item.get(name) {
        None => Ok(Vec::new()),
        Some(AttributeValue::Ss(set)) => {
            let mut values = set.clone();
            values.sort();
            Ok(values)
        }
        Some(_) => Err(LeaseError::Corrupt(format!(
            "lease {key}: {name} is not a string set"
        ))),
    }
}

/// Parses a hash key (a decimal string of up to 2^128 - 1).
fn parse_hash_key(key: &str, name: &str, digits: &str) -> Result<u128, LeaseError> {
    digits
        .parse::<u128>()
        .map_err(|e| LeaseError::Corrupt(format!("lease {key}: {name} {digits:?}: {e}")))
}

/// A number attribute's digits, if present.
fn number(
    item: &HashMap<String, AttributeValue>,
    name: &str,
    key: &str,
) -> Result<Option<String>, LeaseError> {
    match item.get(name) {
        None => Ok(None),
        Some(AttributeValue::N(n)) => Ok(Some(n.clone())),
        Some(_) => Err(LeaseError::Corrupt(format!(
            "lease {key}: {name} is not a number"
        ))),
    }
}

/// The `throughputKBps` value as DynamoDB stores it: a Number, written as a decimal
/// (Rust's shortest form that reads back to the same `f64`).
pub(super) fn throughput_attribute(kbps: f64) -> AttributeValue {
    AttributeValue::N(kbps.to_string())
}

/// Parses `throughputKBps`: a finite, non-negative number (the KCL writes a `Double`).
fn parse_throughput(key: &str, digits: &str) -> Result<f64, LeaseError> {
    match digits.parse::<f64>() {
        Ok(v) if v.is_finite() && v >= 0.0 => Ok(v),
        Ok(v) => Err(LeaseError::Corrupt(format!(
            "lease {key}: {THROUGHPUT} {v} is not a throughput"
        ))),
        Err(e) => Err(LeaseError::Corrupt(format!(
            "lease {key}: {THROUGHPUT} {digits:?}: {e}"
        ))),
    }
}

/// Parses a non-negative integer attribute.
fn parse_number(key: &str, name: &str, digits: &str) -> Result<u64, LeaseError> {
    digits
        .parse::<u64>()
        .map_err(|e| LeaseError::Corrupt(format!("lease {key}: {name} {digits:?}: {e}")))
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;
    use crate::sequence::{Position, SequenceNumber};

    #[test]
    fn a_lease_round_trips_through_an_item() {
        let mut lease = Lease::new(
            "shardId-000000000002",
            vec!["shardId-000000000001".into(), "shardId-000000000000".into()],
            Checkpoint::TrimHorizon,
        );
        lease.parents.sort();
        lease.owner = Some("w1".into());
        lease.counter = 7;
        lease.pending_owner = Some("w2".into());
        lease.checkpoint = Checkpoint::At(Position::new(
            SequenceNumber::new("9".repeat(129)).unwrap(),
            3,
        ));
        lease.checkpointed_at =
            Some(std::time::SystemTime::UNIX_EPOCH + Duration::from_millis(1_764_720_000_123));
        let item = item_from_lease(&lease);
        assert_eq!(
            item.get(CHECKPOINTED_AT),
            Some(&AttributeValue::N("1764720000123".into()))
        );
        assert_kcl_reads(&item);
        assert_eq!(lease_from_item(&item).unwrap(), lease);
    }

    #[test]
    fn a_reset_request_round_trips_through_an_item() {
        let mut lease = Lease::new("shardId-000000000002", Vec::new(), Checkpoint::ShardEnd);
        lease.owner = Some("w1#abc123".into());
        for reset in [
            Checkpoint::TrimHorizon,
            Checkpoint::AtTimestamp(Some(
                std::time::SystemTime::UNIX_EPOCH + Duration::from_millis(1_764_530_000_123),
            )),
            Checkpoint::At(Position::new(
                SequenceNumber::new("4".repeat(60)).unwrap(),
                2,
            )),
        ] {
            lease.reset_to = Some(reset);
            let item = item_from_lease(&lease);
            assert_eq!(lease_from_item(&item).unwrap(), lease);
        }
    }

    #[test]
    fn an_incarnation_owner_and_a_timestamp_start_round_trip() {
        let mut lease = Lease::new(
            "shardId-000000000003",
            Vec::new(),
            Checkpoint::AtTimestamp(Some(
                std::time::SystemTime::UNIX_EPOCH + Duration::from_millis(1_764_518_400_123),
            )),
        );
        lease.owner = Some(crate::lease::incarnation("billing-7"));
        lease.counter = 3;
        let item = item_from_lease(&lease);
        assert_eq!(
            item.get(TIMESTAMP),
            Some(&AttributeValue::N("1764518400123".into()))
        );
        assert_eq!(
            item.get(CHECKPOINT),
            Some(&AttributeValue::S("AT_TIMESTAMP".into()))
        );
        let back = lease_from_item(&item).unwrap();
        assert_eq!(back, lease);
        let owner = back.owner.unwrap();
        assert!(owner.starts_with("billing-7#"), "{owner}");
        assert_eq!(crate::lease::worker_of(&owner), "billing-7");
    }

    #[test]
    fn a_kcl_at_timestamp_row_has_no_timestamp_and_a_plain_owner() {
        let mut item = item_from_lease(&Lease::new("s", Vec::new(), Checkpoint::TrimHorizon));
        item.insert(CHECKPOINT.into(), AttributeValue::S("AT_TIMESTAMP".into()));
        item.insert(OWNER.into(), AttributeValue::S("kcl-worker".into()));
        let lease = lease_from_item(&item).unwrap();
        assert_eq!(lease.checkpoint, Checkpoint::AtTimestamp(None));
        assert_eq!(crate::lease::worker_of("kcl-worker"), "kcl-worker");
        assert!(!item_from_lease(&lease).contains_key(TIMESTAMP));
    }

    #[test]
    fn an_unowned_lease_without_parents_has_no_owner_or_set_attribute() {
        let lease = Lease::new("s", Vec::new(), Checkpoint::Latest);
        let item = item_from_lease(&lease);
        assert!(!item.contains_key(OWNER));
        assert!(!item.contains_key(PARENTS));
        assert!(!item.contains_key(PENDING_OWNER));
        assert_eq!(lease_from_item(&item).unwrap(), lease);
    }

    /// An item in DynamoDB JSON (`{"name": {"S": "..."}}`), as in `tests/fixtures/kcl/`.
    fn item_from_json(json: &str) -> HashMap<String, AttributeValue> {
        let value: serde_json::Value = serde_json::from_str(json).unwrap();
        let strings = |v: &serde_json::Value| -> Vec<String> {
            v.as_array()
                .unwrap()
                .iter()
                .map(|s| s.as_str().unwrap().to_owned())
                .collect()
        };
        value
            .as_object()
            .unwrap()
            .iter()
            .map(|(name, typed)| {
                let (kind, v) = typed.as_object().unwrap().iter().next().unwrap();
                let attribute = match kind.as_str() {
                    "S" => AttributeValue::S(v.as_str().unwrap().to_owned()),
                    "N" => AttributeValue::N(v.as_str().unwrap().to_owned()),
                    "B" => AttributeValue::B(aws_sdk_dynamodb::primitives::Blob::new(
                        v.as_str().unwrap().as_bytes(),
                    )),
                    "SS" => AttributeValue::Ss(strings(v)),
                    "M" | "L" => value_from_json(typed),
                    other => panic!("type {other} is not in the KCL's rows"),
                };
                (name.clone(), attribute)
            })
            .collect()
    }

    /// A nested attribute value (`M`, `L` and the scalars within them).
    fn value_from_json(typed: &serde_json::Value) -> AttributeValue {
        let (kind, v) = typed.as_object().unwrap().iter().next().unwrap();
        match kind.as_str() {
            "S" => AttributeValue::S(v.as_str().unwrap().to_owned()),
            "N" => AttributeValue::N(v.as_str().unwrap().to_owned()),
            "L" => AttributeValue::L(v.as_array().unwrap().iter().map(value_from_json).collect()),
            "M" => AttributeValue::M(
                v.as_object()
                    .unwrap()
                    .iter()
                    .map(|(k, x)| (k.clone(), value_from_json(x)))
                    .collect(),
            ),
            other => panic!("type {other} is not in the KCL's rows"),
        }
    }

    fn fixture(name: &str) -> HashMap<String, AttributeValue> {
        let path = format!("{}/tests/fixtures/kcl/{name}", env!("CARGO_MANIFEST_DIR"));
        item_from_json(&std::fs::read_to_string(&path).unwrap())
    }

    /// Reads `item` the way the KCL's `fromDynamoRecord` does (2.x and 3.x): the same
    /// names with the same types, and the attributes it requires present (its `Lease`
    /// refuses a null counter, owner switches or checkpoint).
    fn assert_kcl_reads(item: &HashMap<String, AttributeValue>) {
        let key = format!("{item:?}");
        for required in [KEY, COUNTER, OWNER_SWITCHES, CHECKPOINT, SUB_SEQUENCE] {
            assert!(item.contains_key(required), "{required} missing: {key}");
        }
        for (name, value) in item {
            let ok = match name.as_str() {
                KEY | OWNER | CHECKPOINT | PENDING_CHECKPOINT | STARTING_HASH | ENDING_HASH
                | CHECKPOINT_OWNER | STREAM | PENDING_OWNER | SHARD_ID => {
                    matches!(value, AttributeValue::S(_))
                }
                COUNTER | OWNER_SWITCHES | SUB_SEQUENCE | PENDING_SUB_SEQUENCE | TIMESTAMP
                | CHECKPOINTED_AT | THROUGHPUT => {
                    matches!(value, AttributeValue::N(n) if n.parse::<f64>().is_ok())
                }
                PARENTS | CHILDREN => matches!(value, AttributeValue::Ss(set) if !set.is_empty()),
                PENDING_STATE => matches!(value, AttributeValue::B(_) | AttributeValue::N(_)),
                ENTITY_TYPE => matches!(value, AttributeValue::S(e) if e == "LEASE"),
                other => panic!("{other} is neither the KCL's nor shardflow's: {key}"),
            };
            assert!(ok, "{name} has the wrong type for the KCL: {key}");
        }
        if let Some(AttributeValue::S(checkpoint)) = item.get(CHECKPOINT) {
            assert!(
                ["TRIM_HORIZON", "LATEST", "SHARD_END", "AT_TIMESTAMP"]
                    .contains(&checkpoint.as_str())
                    || checkpoint.bytes().all(|b| b.is_ascii_digit()),
                "{checkpoint}"
            );
        }
    }

    #[test]
    fn kcl_rows_parse_with_every_attribute() {
        let lease = lease_from_item(&fixture("kcl2_checkpointed.json")).unwrap();
        assert_eq!(lease.key, "shardId-000000000002");
        assert_eq!(
            lease.owner.as_deref(),
            Some("7f3c2a10-5b1e-4f7a-9a51-2d6c0e8f4b21")
        );
        assert!(lease.has_foreign_owner());
        assert_eq!(lease.counter, 4187);
        assert_eq!(lease.owner_switches, 1);
        assert_eq!(lease.parents, vec!["shardId-000000000000".to_owned()]);
        assert_eq!(
            lease.hash_range,
            Some((0, 85_070_591_730_234_615_865_843_651_857_942_052_863))
        );
        assert_eq!(lease.stream, None);
        assert_eq!(
            lease.checkpoint.to_string(),
            "49654231871269856788003409185127350380960574536328806434"
        );

        let end = lease_from_item(&fixture("kcl2_shard_end.json")).unwrap();
        assert_eq!(end.checkpoint, Checkpoint::ShardEnd);
        assert_eq!(end.owner, None);
        assert_eq!(
            end.children,
            vec![
                "shardId-000000000002".to_owned(),
                "shardId-000000000003".to_owned()
            ]
        );
        assert_eq!(end.hash_range.map(|r| r.1), Some(u128::MAX >> 1));

        // A pending checkpoint is not ours to act on: the committed one counts.
        let pending = lease_from_item(&fixture("kcl2_pending_checkpoint.json")).unwrap();
        assert_eq!(
            pending.checkpoint,
            Checkpoint::At(Position::new(
                SequenceNumber::new("49654231871269856788003409185127350380960574536328806001")
                    .unwrap(),
                3
            ))
        );
        assert_eq!(pending.hash_range.map(|r| r.1), Some(u128::MAX));

        let unowned = lease_from_item(&fixture("kcl2_trim_horizon_unowned.json")).unwrap();
        assert_eq!(unowned.checkpoint, Checkpoint::TrimHorizon);
        assert_eq!((unowned.owner.as_deref(), unowned.hash_range), (None, None));
        assert!(!unowned.has_foreign_owner());

        let handoff = lease_from_item(&fixture("kcl3_handoff.json")).unwrap();
        assert_eq!(handoff.owner.as_deref(), Some("worker-next"));
        assert_eq!(handoff.checkpoint_owner.as_deref(), Some("worker-current"));
        assert_eq!(handoff.checkpoint, Checkpoint::Latest);
        assert!(handoff.has_foreign_owner());

        let merged = lease_from_item(&fixture("kcl3_at_timestamp.json")).unwrap();
        assert_eq!(merged.checkpoint, Checkpoint::AtTimestamp(None));
        assert_eq!(
            merged.parents,
            vec![
                "shardId-000000000002".to_owned(),
                "shardId-000000000003".to_owned()
            ]
        );
    }

    #[test]
    fn the_fixtures_and_what_shardflow_writes_read_as_the_kcl_reads_them() {
        for name in [
            "kcl2_checkpointed.json",
            "kcl2_shard_end.json",
            "kcl2_pending_checkpoint.json",
            "kcl2_trim_horizon_unowned.json",
            "kcl3_handoff.json",
            "kcl3_at_timestamp.json",
            "kcl2_multi_stream.json",
            "kcl3_multi_stream_shard_end.json",
        ] {
            let item = fixture(name);
            assert_kcl_reads(&item);
            let lease = lease_from_item(&item).unwrap();
            // A row shardflow creates from it keeps every attribute the lease holds.
            let written = item_from_lease(&lease);
            assert_kcl_reads(&written);
            assert_eq!(lease_from_item(&written).unwrap(), lease, "{name}");
            for kept in [
                KEY,
                OWNER,
                COUNTER,
                OWNER_SWITCHES,
                CHECKPOINT,
                SUB_SEQUENCE,
                PARENTS,
                CHILDREN,
                STARTING_HASH,
                ENDING_HASH,
                CHECKPOINT_OWNER,
                STREAM,
                SHARD_ID,
            ] {
                let sorted = |v: Option<&AttributeValue>| match v {
                    Some(AttributeValue::Ss(set)) => {
                        let mut set = set.clone();
                        set.sort();
                        Some(AttributeValue::Ss(set))
                    }
                    other => other.cloned(),
                };
                assert_eq!(
                    sorted(written.get(kept)),
                    sorted(item.get(kept)),
                    "{name}: {kept}"
                );
            }
        }
        // A row shardflow creates for a new shard.
        let mut fresh = Lease::new("shardId-000000000009", Vec::new(), Checkpoint::TrimHorizon);
        fresh.stream = Some("orders".into());
        fresh.hash_range = Some((0, u128::MAX));
        let item = item_from_lease(&fresh);
        assert_kcl_reads(&item);
        assert_eq!(item.get(STREAM), Some(&AttributeValue::S("orders".into())));
        assert_eq!(
            item.get(ENDING_HASH),
            Some(&AttributeValue::S(u128::MAX.to_string()))
        );
        assert_eq!(lease_from_item(&item).unwrap(), fresh);
    }

    #[test]
    fn kcl35_lease_rows_are_leases_and_every_other_entity_is_not() {
        // LEASE rows (single- and multi-stream) parse as the 3.x rows do.
        let lease_row = fixture("kcl35_lease.json");
        assert_eq!(row_kind(&lease_row), RowKind::Lease);
        assert!(has_entity_type(&lease_row));
        assert_kcl_reads(&lease_row);
        let lease = lease_from_item(&lease_row).unwrap();
        assert_eq!(lease.key, "shardId-000000000001");
        assert_eq!(lease.owner.as_deref(), Some("worker-2"));
        assert_eq!(lease.counter, 5120);
        assert_eq!(
            lease.checkpoint.to_string(),
            "49654231871269856788003409185127350380960574536328806434"
        );
        let multi_row = fixture("kcl35_multi_stream_lease.json");
        assert_eq!(row_kind(&multi_row), RowKind::Lease);
        assert_kcl_reads(&multi_row);
        let multi = lease_from_item(&multi_row).unwrap();
        assert_eq!(
            multi.stream.as_deref(),
            Some("123456789012:orders:1700000000")
        );
        assert_eq!(multi.checkpoint, Checkpoint::TrimHorizon);
        // Rows of older KCLs, without entityType, stay leases.
        for name in ["kcl2_checkpointed.json", "kcl3_handoff.json"] {
            let item = fixture(name);
            assert_eq!(row_kind(&item), RowKind::Lease, "{name}");
            assert!(!has_entity_type(&item), "{name}");
        }
        // Every other entity is told apart before anything else is read: most of them
        // have none of a lease's attributes and would not parse as one.
        let entities = [
            (
                "kcl35_leader.json",
                EntityKind::KclLeader,
                "Leader",
                Some("worker-2"),
                None,
            ),
            (
                "kcl35_worker_metrics.json",
                EntityKind::KclWorkerMetrics,
                "worker-2",
                None,
                None,
            ),
            (
                "kcl35_stream.json",
                EntityKind::KclStream,
                "123456789012:orders:1700000000",
                None,
                None,
            ),
            (
                "kcl35_client_version_migration.json",
                EntityKind::KclClientVersionMigration,
                "Migration3.0",
                None,
                Some("CLIENT_VERSION_3X"),
            ),
            (
                "kcl35_table_migration_complete.json",
                EntityKind::KclTableMigration,
                "TableMigration3.5",
                None,
                Some("TABLE_MIGRATION_STATUS_COMPLETE"),
            ),
        ];
        for (name, kind, key, owner, state) in entities {
            let item = fixture(name);
            assert!(lease_from_item(&item).is_err(), "{name} is no lease");
            let RowKind::Other(found) = row_kind(&item) else {
                panic!("{name} read as a lease");
            };
            assert_eq!(found, kind, "{name}");
            let row = entity_from_item(&item, found);
            assert_eq!(row.key, key, "{name}");
            assert_eq!(row.owner.as_deref(), owner, "{name}");
            assert_eq!(row.state.as_deref(), state, "{name}");
            assert_eq!(row.unfinished_migration(), None, "{name}");
        }
        // A migration in the middle: the KCL's state names say so.
        for (name, state) in [
            (
                "kcl35_client_version_upgrade_from_2x.json",
                "CLIENT_VERSION_UPGRADE_FROM_2X",
            ),
            (
                "kcl35_table_migration_pending.json",
                "TABLE_MIGRATION_STATUS_PENDING",
            ),
        ] {
            let item = fixture(name);
            let RowKind::Other(kind) = row_kind(&item) else {
                panic!("{name} read as a lease");
            };
            let row = entity_from_item(&item, kind);
            assert_eq!(
                row.unfinished_migration().map(|m| m.1),
                Some(state.to_owned()),
                "{name}"
            );
        }
    }

    #[test]
    fn kcl_multi_stream_rows_parse_and_round_trip() {
        let lease = lease_from_item(&fixture("kcl2_multi_stream.json")).unwrap();
        assert_eq!(
            lease.key,
            "123456789012:orders:1700000000:shardId-000000000002"
        );
        let (identity, shard) = StreamIdentity::split_lease_key(&lease.key).unwrap();
        assert_eq!(
            (
                identity.account.as_str(),
                identity.name.as_str(),
                identity.creation_epoch,
                shard
            ),
            (
                "123456789012",
                "orders",
                1_700_000_000,
                "shardId-000000000002"
            )
        );
        assert_eq!(
            lease.stream.as_deref(),
            Some("123456789012:orders:1700000000")
        );
        assert_eq!(lease.parents, vec!["shardId-000000000000".to_owned()]);
        assert_eq!(lease.counter, 912);
        assert_eq!(
            lease.checkpoint,
            Checkpoint::At(Position::new(
                SequenceNumber::new("49654231871269856788003409185127350380960574536328806434")
                    .unwrap(),
                2
            ))
        );
        let end = lease_from_item(&fixture("kcl3_multi_stream_shard_end.json")).unwrap();
        assert_eq!(end.checkpoint, Checkpoint::ShardEnd);
        assert_eq!(end.owner, None);
        assert_eq!(
            end.children,
            vec![
                "shardId-000000000001".to_owned(),
                "shardId-000000000002".to_owned()
            ]
        );
        // A row shardflow creates in multi-stream mode has the KCL's shardId too.
        let mut fresh = Lease::new(
            identity.lease_key("shardId-000000000007"),
            vec!["shardId-000000000002".into()],
            Checkpoint::TrimHorizon,
        );
        fresh.stream = Some(identity.to_string());
        let item = item_from_lease(&fresh);
        assert_kcl_reads(&item);
        assert_eq!(
            item.get(SHARD_ID),
            Some(&AttributeValue::S("shardId-000000000007".into()))
        );
        assert_eq!(
            item.get(STREAM),
            Some(&AttributeValue::S("123456789012:orders:1700000000".into()))
        );
        assert_eq!(lease_from_item(&item).unwrap(), fresh);
        // Single-stream rows carry no shardId.
        let single = item_from_lease(&Lease::new(
            "shardId-000000000007",
            Vec::new(),
            Checkpoint::TrimHorizon,
        ));
        assert!(!single.contains_key(SHARD_ID));
    }

    #[test]
    fn a_malformed_item_is_corrupt_not_a_panic() {
        let mut item = item_from_lease(&Lease::new("s", Vec::new(), Checkpoint::Latest));
        item.insert(COUNTER.into(), AttributeValue::S("x".into()));
        assert!(matches!(
            lease_from_item(&item),
            Err(LeaseError::Corrupt(_))
        ));
        item.insert(COUNTER.into(), AttributeValue::N("-1".into()));
        assert!(matches!(
            lease_from_item(&item),
            Err(LeaseError::Corrupt(_))
        ));
        item.insert(COUNTER.into(), AttributeValue::N("1".into()));
        item.insert(CHECKPOINT.into(), AttributeValue::S("12a".into()));
        assert!(matches!(
            lease_from_item(&item),
            Err(LeaseError::Corrupt(_))
        ));
        item.remove(CHECKPOINT);
        assert!(matches!(
            lease_from_item(&item),
            Err(LeaseError::Corrupt(_))
        ));
    }

    #[test]
    fn the_kcl_throughput_attribute_is_read_and_written() {
        let lease = lease_from_item(&fixture("kcl3_handoff.json")).unwrap();
        assert_eq!(lease.throughput_kbps, Some(12.75));
        let item = item_from_lease(&lease);
        assert_eq!(
            item.get(THROUGHPUT),
            Some(&AttributeValue::N("12.75".into()))
        );
        assert_kcl_reads(&item);
        assert_eq!(lease_from_item(&item).unwrap(), lease);
        // Not measured yet: no attribute at all, as the KCL writes it.
        let fresh = Lease::new("s", Vec::new(), Checkpoint::Latest);
        assert!(!item_from_lease(&fresh).contains_key(THROUGHPUT));
        let mut item = item_from_lease(&fresh);
        for bad in ["-1", "NaN", "inf", "fast"] {
            item.insert(THROUGHPUT.into(), AttributeValue::N(bad.into()));
            assert!(
                matches!(lease_from_item(&item), Err(LeaseError::Corrupt(_))),
                "{bad}"
            );
        }
    }

    fn adapter_fixture(name: &str) -> HashMap<String, AttributeValue> {
        let path = format!(
            "{}/tests/fixtures/dynamodb_streams_adapter/{name}",
            env!("CARGO_MANIFEST_DIR")
        );
        item_from_json(&std::fs::read_to_string(&path).unwrap())
    }

    /// `item` with its string sets sorted (DynamoDB keeps no order in a set).
    fn sorted_sets(item: &HashMap<String, AttributeValue>) -> HashMap<String, AttributeValue> {
        item.iter()
            .map(|(k, v)| {
                let v = match v {
                    AttributeValue::Ss(set) => {
                        let mut set = set.clone();
                        set.sort();
                        AttributeValue::Ss(set)
                    }
                    other => other.clone(),
                };
                (k.clone(), v)
            })
            .collect()
    }

    #[test]
    fn dynamodb_streams_adapter_rows_parse_and_are_written_back_attribute_for_attribute() {
        for name in [
            "v1_checkpointed.json",
            "v1_shard_end.json",
            "v2_checkpointed.json",
            "v2_shard_end.json",
            "v2_trim_horizon.json",
            "v2_multi_stream.json",
        ] {
            let item = adapter_fixture(name);
            assert_kcl_reads(&item);
            let lease = lease_from_item(&item).unwrap();
            // The row shardflow writes from it is the adapter's, to the digit: a
            // sequence number keeps its leading zeros, the range stays 0..1.
            let written = item_from_lease(&lease);
            assert_eq!(sorted_sets(&written), sorted_sets(&item), "{name}");
            assert_eq!(lease_from_item(&written).unwrap(), lease, "{name}");
        }

        let v1 = lease_from_item(&adapter_fixture("v1_checkpointed.json")).unwrap();
        assert_eq!(v1.key, "shardId-00000001764835200000-3f9c2a1b");
        assert_eq!(
            v1.checkpoint,
            Checkpoint::At(Position::new(SequenceNumber::from(317), 0))
        );
        assert_eq!(v1.parents, vec!["shardId-00000001764820800000-9e1d7c42"]);
        assert_eq!(v1.hash_range, None);
        let v1_end = lease_from_item(&adapter_fixture("v1_shard_end.json")).unwrap();
        assert_eq!(v1_end.checkpoint, Checkpoint::ShardEnd);
        assert!(v1_end.children.is_empty());

        let v2 = lease_from_item(&adapter_fixture("v2_checkpointed.json")).unwrap();
        assert_eq!(
            v2.checkpoint,
            Checkpoint::At(Position::new(
                SequenceNumber::new("4421584500000000017450439091").unwrap(),
                0
            ))
        );
        assert_eq!(v2.hash_range, Some((0, 1)));
        assert_eq!(v2.owner_switches, 1);
        assert_eq!(v2.throughput_kbps, Some(0.8125));
        let end = lease_from_item(&adapter_fixture("v2_shard_end.json")).unwrap();
        assert_eq!(end.checkpoint, Checkpoint::ShardEnd);
        assert_eq!(end.owner, None);
        assert_eq!(end.children, vec!["shardId-00000001764835200000-3f9c2a1b"]);
        let child = lease_from_item(&adapter_fixture("v2_trim_horizon.json")).unwrap();
        assert_eq!(
            (child.checkpoint, child.owner, child.counter),
            (Checkpoint::TrimHorizon, None, 0)
        );

        // Multi-stream: the stream name is `region$account$table$label`.
        let multi = lease_from_item(&adapter_fixture("v2_multi_stream.json")).unwrap();
        let (identity, shard) = StreamIdentity::split_lease_key(&multi.key).unwrap();
        assert_eq!(
            (
                identity.account.as_str(),
                identity.name.as_str(),
                identity.creation_epoch,
                shard
            ),
            (
                "123456789012",
                "us-east-1$123456789012$orders$2026-12-04T08_00_00.000",
                1,
                "shardId-00000001764835200000-3f9c2a1b"
            )
        );
    }

    #[test]
    fn checkpoints_are_stored_with_at_least_the_digits_dynamodb_streams_accepts() {
        let stored = |digits: &str| {
            Checkpoint::At(Position::new(SequenceNumber::new(digits).unwrap(), 0))
                .as_attribute()
                .0
        };
        // DynamoDB Local's padded form goes back as it came.
        assert_eq!(stored("000000000000000000318"), "000000000000000000318");
        assert_eq!(stored("318"), "000000000000000000318");
        // DynamoDB's and Kinesis' numbers are longer: stored as they are.
        assert_eq!(
            stored("4421584500000000017450439091"),
            "4421584500000000017450439091"
        );
        let kinesis = "49654231871269856788003409185127350380960574536328806434";
        assert_eq!(stored(kinesis), kinesis);
    }
}
