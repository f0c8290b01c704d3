//! [`LeaseStore`] over `aws-sdk-dynamodb`.
//!
//! # Table schema
//!
//! One table per consumer group, one item per shard. Attribute names are the Java KCL's
//! where they mean the same thing, so a KCL application's lease table can be taken over
//! (and read by KCL tooling) without losing positions:
//!
//! | attribute | type | meaning |
//! |---|---|---|
//! | `leaseKey` | S, **hash key** | the shard id; in multi-stream mode `account:stream:creationEpoch:shardId`, the KCL's multi-stream key |
//! | `shardId` | S, multi-stream rows only | the shard id, as the KCL's multi-stream serializer writes it |
//! | `leaseOwner` | S, absent when unowned | the worker incarnation holding the lease: `<worker id>#<nonce>` (see [`worker_of`](super::worker_of)) |
//! | `leaseCounter` | N | bumped by every take, renewal and release: the fencing token |
//! | `checkpoint` | S | the sequence number's digits, or `TRIM_HORIZON`, `LATEST`, `AT_TIMESTAMP`, `SHARD_END` |
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
//! | `throughputKBps` | N | KCL 3: not used, kept |
//! | `resetCheckpoint`, `resetCheckpointSubSequenceNumber`, `resetCheckpointTimestamp` | S, N, N, optional | shardflow's: an operator's reset request on an owned row (`request_reset`, see [`crate::admin`]), in the form of `checkpoint` and its sub-sequence and timestamp; the owner applies it (`reset`), which removes it |
//!
//! Sequence numbers are stored as strings: they have up to 129 digits, more than a
//! DynamoDB Number holds. No condition compares them; fencing is on the counter.
//!
//! # Writes
//!
//! Every write except [`create`](LeaseStore::create) is a conditional UpdateItem or
//! DeleteItem whose condition is
//! `leaseCounter = <expected counter> AND leaseOwner = <expected owner>`
//! (or `attribute_not_exists(leaseOwner)` when the caller saw the lease unowned). All
//! attribute names go through `ExpressionAttributeNames` (`owner` and friends are reserved
//! words). Updates ask for `ReturnValues=ALL_NEW`, so the row handed back is the one now
//! stored. A failed condition is [`LeaseError::Conflict`]: the caller no longer holds what
//! it thought it held.
//!
//! | call | update |
//! |---|---|
//! | `take` | `SET leaseOwner = new, leaseCounter = counter + 1, ownerSwitchesSinceCheckpoint += (1 if the owner changes) REMOVE pendingOwner, checkpointOwner` |
//! | `renew` | `SET leaseCounter = counter + 1` |
//! | `checkpoint` | `SET checkpoint, checkpointSubSequenceNumber, ownerSwitchesSinceCheckpoint = 0` and `SET` or `REMOVE checkpointTimestamp`, `REMOVE pendingCheckpoint*` (counter kept) |
//! | `release` | `SET leaseCounter = counter + 1 REMOVE leaseOwner, checkpointOwner` (a pending hand-off request is kept, so the requester can take it) |
//! | `request_handoff` | `SET pendingOwner` (counter kept, so the owner's token stays valid) |
//! | `claim_for_stream` | `SET streamName = if_not_exists(streamName, stream)` (counter kept) |
//! | `record_children` | `SET childShardIds` of a row at `SHARD_END` (counter kept) |
//! | `request_reset` | `SET resetCheckpoint, resetCheckpointSubSequenceNumber` and `SET` or `REMOVE resetCheckpointTimestamp` (counter kept) |
//! | `reset` | as `checkpoint` (the checkpoint may move backwards), and `REMOVE resetCheckpoint*` (counter kept) |
//! | `delete` | DeleteItem under the same condition |
//!
//! Reads (`get`, `list`) are strongly consistent.
//!
//! # The owner index
//!
//! The table has the KCL 3's global secondary index `LeaseOwnerToLeaseKeyIndex` (hash key
//! `leaseOwner`, range key `leaseKey`, projection `KEYS_ONLY`), through which
//! [`owned_keys`](LeaseStore::owned_keys) queries the keys a worker owns instead of
//! scanning the table. Keys only, as the KCL creates it: the same index serves a KCL 3
//! application on the same table, a renewal (which changes only `leaseCounter`) writes
//! nothing to it, and a Query of a worker's keys costs a fraction of a read unit,
//! where the rows themselves would cost one read unit each, every round. The worker
//! fetches the few rows it needs (handed to it, not yet run) with `get`.
//!
//! A table created by shardflow has the index from the start; an existing table without
//! it (created by an earlier shardflow or a KCL 1/2 application) is upgraded in place
//! at start-up (UpdateTable adding the index; DynamoDB fills it in the background).
//! Until the index is ACTIVE (checked again at most once a minute), or where it cannot
//! be added (no `UpdateTable` permission), `owned_keys` lists the table and filters it.
//! The index is eventually consistent: a key handed over a moment ago shows at the next
//! round, and a key that moved on a moment ago is read and found to be another's.

use std::collections::HashMap;
use std::time::Duration;

use async_trait::async_trait;
use aws_sdk_dynamodb::error::{DisplayErrorContext, ProvideErrorMetadata, SdkError};
use aws_sdk_dynamodb::types::{
    AttributeDefinition, AttributeValue, BillingMode, CreateGlobalSecondaryIndexAction,
    GlobalSecondaryIndex, GlobalSecondaryIndexUpdate, IndexStatus, KeySchemaElement, KeyType,
    Projection, ProjectionType, ProvisionedThroughput, ReturnValue, ScalarAttributeType,
    TableDescription, TableStatus,
};

use super::{owner_switch, Checkpoint, Lease, LeaseError, LeaseStore};
use crate::backoff::DeadlinePoll;
use crate::error::ErrorDetail;
use crate::kinesis::aws::{aws_error_of, describe_sdk_error};
use crate::kinesis::StreamIdentity;

/// The hash key: the shard id.
const KEY: &str = "leaseKey";
/// The owning worker.
const OWNER: &str = "leaseOwner";
/// The fencing token.
const COUNTER: &str = "leaseCounter";
/// The checkpoint's sequence number or sentinel.
const CHECKPOINT: &str = "checkpoint";
/// The checkpoint's sub-sequence number.
const SUB_SEQUENCE: &str = "checkpointSubSequenceNumber";
/// The start time of an `AT_TIMESTAMP` checkpoint, epoch milliseconds.
const TIMESTAMP: &str = "checkpointTimestamp";
/// The parent shards.
const PARENTS: &str = "parentShardId";
/// The worker asking for a hand-off.
const PENDING_OWNER: &str = "pendingOwner";
/// The stream the row belongs to (shardflow's).
const STREAM: &str = "streamName";
/// The shard id of a multi-stream row (the KCL's multi-stream serializer writes it).
const SHARD_ID: &str = "shardId";
/// Owner changes since the last checkpoint (the KCL's).
const OWNER_SWITCHES: &str = "ownerSwitchesSinceCheckpoint";
/// The child shards of an ended shard (the KCL's).
const CHILDREN: &str = "childShardIds";
/// The lowest hash key of the shard (the KCL's, a decimal string).
const STARTING_HASH: &str = "startingHashKey";
/// The highest hash key of the shard (the KCL's, a decimal string).
const ENDING_HASH: &str = "endingHashKey";
/// KCL 3: the worker still processing during a graceful hand-off to `leaseOwner`.
const CHECKPOINT_OWNER: &str = "checkpointOwner";
/// The KCL's two-phase checkpoint: shardflow never writes it and removes it with
/// every checkpoint it stores, as the KCL does when it checkpoints.
const PENDING_CHECKPOINT: &str = "pendingCheckpoint";
/// The pending checkpoint's sub-sequence number.
const PENDING_SUB_SEQUENCE: &str = "pendingCheckpointSubSequenceNumber";
/// The application state saved with a pending checkpoint (B; some KCL 3 versions write N).
const PENDING_STATE: &str = "pendingCheckpointState";
/// An operator's reset request: the checkpoint to move to (shardflow's).
const RESET: &str = "resetCheckpoint";
/// The reset request's sub-sequence number.
const RESET_SUB_SEQUENCE: &str = "resetCheckpointSubSequenceNumber";
/// The reset request's `AT_TIMESTAMP` time, epoch milliseconds.
const RESET_TIMESTAMP: &str = "resetCheckpointTimestamp";

/// How long [`DynamoLeaseStore::ensure_table`] waits for the table to become ACTIVE.
pub(super) const ACTIVE_WAIT: Duration = Duration::from_secs(60);

/// The KCL 3's index of the keys by owner (see the [module docs](self)).
pub const OWNER_INDEX: &str = "LeaseOwnerToLeaseKeyIndex";

/// How often `owned_keys` asks again whether an index being added is ACTIVE yet.
const INDEX_RECHECK: Duration = Duration::from_secs(60);

/// What the store knows of the owner index.
#[derive(Debug, Default)]
struct IndexState {
    /// The index is ACTIVE: `owned_keys` queries it.
    active: bool,
    /// When the table was last described (not at all yet: `None`).
    checked: Option<tokio::time::Instant>,
}

/// Leases in a DynamoDB table; see the [module docs](self) for the schema.
#[derive(Clone, Debug)]
pub struct DynamoLeaseStore {
    client: aws_sdk_dynamodb::Client,
    table: String,
    index: std::sync::Arc<std::sync::Mutex<IndexState>>,
}

impl DynamoLeaseStore {
    /// A store over `table`.
    pub fn new(client: aws_sdk_dynamodb::Client, table: &str) -> Self {
        DynamoLeaseStore {
            client,
            table: table.to_owned(),
            index: Default::default(),
        }
    }

    fn index_state(&self) -> std::sync::MutexGuard<'_, IndexState> {
        // Poisoning means a panic elsewhere while holding the lock; the state is whole.
        self.index.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Records what `table` says of the owner index; returns its status (`None`: the
    /// table has no such index).
    fn note_index(&self, table: &TableDescription) -> Option<IndexStatus> {
        let status = table
            .global_secondary_indexes()
            .iter()
            .find(|i| i.index_name() == Some(OWNER_INDEX))
            .map(|i| i.index_status().cloned().unwrap_or(IndexStatus::Creating));
        let mut state = self.index_state();
        state.active = status == Some(IndexStatus::Active);
        state.checked = Some(tokio::time::Instant::now());
        status
    }

    /// Adds the owner index to a table that has none (an upgrade in place). Not being
    /// allowed to, or another worker adding it at the same moment, is not an error:
    /// `owned_keys` lists the table meanwhile.
    async fn add_index(&self, table: &TableDescription) {
        let action = CreateGlobalSecondaryIndexAction::builder()
            .index_name(OWNER_INDEX)
            .set_key_schema(Some(owner_index_keys()))
            .projection(owner_index_projection())
            .set_provisioned_throughput(index_capacity(table))
            .build();
        let action = match action {
            Ok(action) => action,
            Err(e) => {
                tracing::warn!(table = %self.table, error = %DisplayErrorContext(&e), "could not build the owner index");
                return;
            }
        };
        let result = self
            .client
            .update_table()
            .table_name(&self.table)
            .set_attribute_definitions(Some(owner_index_attributes()))
            .global_secondary_index_updates(
                GlobalSecondaryIndexUpdate::builder().create(action).build(),
            )
            .send()
            .await;
        match result {
            Ok(_) => {
                tracing::info!(table = %self.table, index = OWNER_INDEX, "adding the owner index to the lease table; workers list the table until it is ACTIVE")
            }
            Err(e) => {
                tracing::warn!(table = %self.table, index = OWNER_INDEX, error = %DisplayErrorContext(&e), "could not add the owner index; workers list the table instead")
            }
        }
    }

    /// Whether `owned_keys` can query the owner index: it is known ACTIVE, or a new
    /// look at the table (at most once per [`INDEX_RECHECK`]) finds it ACTIVE.
    async fn index_ready(&self) -> bool {
        {
            let state = self.index_state();
            if state.active {
                return true;
            }
            if state.checked.is_some_and(|t| t.elapsed() < INDEX_RECHECK) {
                return false;
            }
        }
        match self.describe().await {
            Ok(Some(table)) => self.note_index(&table) == Some(IndexStatus::Active),
            _ => {
                self.index_state().checked = Some(tokio::time::Instant::now());
                false
            }
        }
    }

    /// The keys the owner index names for `owner`, every page.
    async fn query_owner_index(
        &self,
        owner: &str,
    ) -> Result<Vec<String>, SdkError<aws_sdk_dynamodb::operation::query::QueryError>> {
        let mut keys = Vec::new();
        let mut start: Option<HashMap<String, AttributeValue>> = None;
        loop {
            let out = self
                .client
                .query()
                .table_name(&self.table)
                .index_name(OWNER_INDEX)
                .key_condition_expression("#owner = :owner")
                .expression_attribute_names("#owner", OWNER)
                .expression_attribute_values(":owner", AttributeValue::S(owner.to_owned()))
                .set_exclusive_start_key(start.take())
                .send()
                .await?;
            keys.extend(out.items().iter().filter_map(|item| match item.get(KEY) {
                Some(AttributeValue::S(key)) => Some(key.clone()),
                _ => None,
            }));
            match out.last_evaluated_key {
                Some(key) if !key.is_empty() => start = Some(key),
                _ => return Ok(keys),
            }
        }
    }

    /// The table's name.
    pub fn table(&self) -> &str {
        &self.table
    }

    /// The table, or `None` when it does not exist. Fails when the table exists with
    /// another key than `leaseKey` (it is some other table).
    async fn describe(&self) -> Result<Option<TableDescription>, LeaseError> {
        let out = match self
            .client
            .describe_table()
            .table_name(&self.table)
            .send()
            .await
        {
            Ok(out) => out,
            Err(e) if e.code() == Some("ResourceNotFoundException") => return Ok(None),
            Err(e) => return Err(classify(&self.table, "DescribeTable", None, e)),
        };
        let Some(table) = out.table else {
            return Ok(None);
        };
        let keys = table.key_schema();
        let is_lease_table = !keys.is_empty()
            && keys
                .iter()
                .all(|k| k.attribute_name() == KEY && *k.key_type() == KeyType::Hash);
        if !is_lease_table {
            return Err(LeaseError::Other(
                format!(
                "table {} exists but its key is not the hash key {KEY}: it is not a lease table",
                self.table
            )
                .into(),
            ));
        }
        Ok(Some(table))
    }

    /// Creates the table (on-demand capacity); a concurrent creation is not an error.
    async fn create_table(&self) -> Result<(), LeaseError> {
        let build_error = |e: aws_sdk_dynamodb::error::BuildError| {
            LeaseError::Other(format!("CreateTable: {}", DisplayErrorContext(&e)).into())
        };
        let result = self
            .client
            .create_table()
            .table_name(&self.table)
            .set_attribute_definitions(Some(owner_index_attributes()))
            .global_secondary_indexes(
                GlobalSecondaryIndex::builder()
                    .index_name(OWNER_INDEX)
                    .set_key_schema(Some(owner_index_keys()))
                    .projection(owner_index_projection())
                    .build()
                    .map_err(build_error)?,
            )
            .key_schema(
                KeySchemaElement::builder()
                    .attribute_name(KEY)
                    .key_type(KeyType::Hash)
                    .build()
                    .map_err(build_error)?,
            )
            .billing_mode(BillingMode::PayPerRequest)
            .send()
            .await;
        match result {
            Ok(_) => {
                tracing::info!(table = %self.table, "created the lease table");
                Ok(())
            }
            Err(e) if e.code() == Some("ResourceInUseException") => Ok(()),
            Err(e) => Err(classify(&self.table, "CreateTable", None, e)),
        }
    }

    /// Writes `to` as the checkpoint the way the KCL's checkpoint does: the owner
    /// switches reset and a pending (two-phase) checkpoint dropped, which this one
    /// supersedes. `clear_reset` also removes a reset request (the write that applies
    /// it).
    async fn write_checkpoint(
        &self,
        op: &str,
        expected: &Lease,
        to: &Checkpoint,
        clear_reset: bool,
    ) -> Result<Lease, LeaseError> {
        let (value, sub_sequence) = to.as_attribute();
        let mut values = vec![
            (":checkpoint", AttributeValue::S(value)),
            (":sub", AttributeValue::N(sub_sequence.to_string())),
            (":zero", AttributeValue::N("0".into())),
        ];
        let mut set = "SET #checkpoint = :checkpoint, #sub = :sub, #switches = :zero".to_owned();
        let mut remove = vec!["#pcp", "#pcp_sub", "#pcp_state"];
        match to.timestamp_millis() {
            Some(millis) => {
                values.push((":timestamp", AttributeValue::N(millis.to_string())));
                set.push_str(", #timestamp = :timestamp");
            }
            None => remove.push("#timestamp"),
        }
        let mut names = vec![
            ("#checkpoint", CHECKPOINT),
            ("#sub", SUB_SEQUENCE),
            ("#timestamp", TIMESTAMP),
            ("#switches", OWNER_SWITCHES),
            ("#pcp", PENDING_CHECKPOINT),
            ("#pcp_sub", PENDING_SUB_SEQUENCE),
            ("#pcp_state", PENDING_STATE),
        ];
        // Applying a reset is conditional on the request it applies too: a second request
        // that landed since `expected` was read is not removed unapplied.
        let mut applies = None;
        if clear_reset {
            remove.extend(["#reset", "#reset_sub", "#reset_ts"]);
            names.extend([
                ("#reset", RESET),
                ("#reset_sub", RESET_SUB_SEQUENCE),
                ("#reset_ts", RESET_TIMESTAMP),
            ]);
            applies = Some(match &expected.reset_to {
                None => "attribute_not_exists(#reset)".to_owned(),
                Some(request) => {
                    let (value, sub_sequence) = request.as_attribute();
                    values.push((":asked", AttributeValue::S(value)));
                    values.push((":asked_sub", AttributeValue::N(sub_sequence.to_string())));
                    let timestamp = match request.timestamp_millis() {
                        Some(millis) => {
                            values.push((":asked_ts", AttributeValue::N(millis.to_string())));
                            "#reset_ts = :asked_ts"
                        }
                        None => "attribute_not_exists(#reset_ts)",
                    };
                    format!("#reset = :asked AND #reset_sub = :asked_sub AND {timestamp}")
                }
            });
        }
        let update = format!("{set} REMOVE {}", remove.join(", "));
        self.fenced_update_if(
            op,
            expected,
            applies.as_deref(),
            &update,
            &names,
            values,
            || Lease {
                checkpoint: to.clone(),
                owner_switches: 0,
                reset_to: if clear_reset {
                    None
                } else {
                    expected.reset_to.clone()
                },
                ..expected.clone()
            },
        )
        .await
    }

    /// A conditional UpdateItem of `expected`'s row: `update` (with its own `names` and
    /// `values`) applies only if the row still has `expected`'s owner and counter.
    /// `after` is what the row is expected to become; it is returned only if the store
    /// does not hand back the new row (ALL_NEW), which DynamoDB and dynalite always do.
    async fn fenced_update(
        &self,
        op: &str,
        expected: &Lease,
        update: &str,
        names: &[(&str, &str)],
        values: Vec<(&str, AttributeValue)>,
        after: impl FnOnce() -> Lease,
    ) -> Result<Lease, LeaseError> {
        self.fenced_update_if(op, expected, None, update, names, values, after)
            .await
    }

    /// [`Self::fenced_update`] with `extra`, a further condition (over the update's
    /// own placeholders) the row must meet.
    #[allow(clippy::too_many_arguments)]
    async fn fenced_update_if(
        &self,
        op: &str,
        expected: &Lease,
        extra: Option<&str>,
        update: &str,
        names: &[(&str, &str)],
        values: Vec<(&str, AttributeValue)>,
        after: impl FnOnce() -> Lease,
    ) -> Result<Lease, LeaseError> {
        expected.refuse_if_unreadable()?;
        let fence = fence(expected);
        let condition = match extra {
            Some(extra) => format!("{} AND ({extra})", fence.condition),
            None => fence.condition.to_owned(),
        };
        let mut request = self
            .client
            .update_item()
            .table_name(&self.table)
            .key(KEY, AttributeValue::S(expected.key.clone()))
            .update_expression(update)
            .condition_expression(condition)
            .return_values(ReturnValue::AllNew);
        for (placeholder, name) in names.iter().chain(fence.names.iter()) {
            request = request.expression_attribute_names(*placeholder, *name);
        }
        for (placeholder, value) in values.into_iter().chain(fence.values) {
            request = request.expression_attribute_values(placeholder, value);
        }
        let out = request
            .send()
            .await
            .map_err(|e| classify(&self.table, op, Some(&expected.key), e))?;
        match out.attributes {
            Some(item) if !item.is_empty() => lease_from_item(&item),
            _ => Ok(after()),
        }
    }
}

/// The attributes the table and its owner index are keyed on: `leaseKey` and
/// `leaseOwner`, strings.
/// The capacity the owner index gets on a table with provisioned capacity (a KCL 1.x
/// table, say), where DynamoDB refuses an index without one: the table's own. `None` on
/// an on-demand table.
fn index_capacity(table: &TableDescription) -> Option<ProvisionedThroughput> {
    let on_demand = table
        .billing_mode_summary()
        .and_then(|b| b.billing_mode())
        .is_some_and(|m| *m == BillingMode::PayPerRequest);
    let provisioned = table.provisioned_throughput()?;
    let (read, write) = (
        provisioned.read_capacity_units()?,
        provisioned.write_capacity_units()?,
    );
    if on_demand || read == 0 || write == 0 {
        return None;
    }
    ProvisionedThroughput::builder()
        .read_capacity_units(read)
        .write_capacity_units(write)
        .build()
        .ok()
}

fn owner_index_attributes() -> Vec<AttributeDefinition> {
    [KEY, OWNER]
        .into_iter()
        .filter_map(|name| {
            // Cannot fail: the name and type, the builder's only required fields, are set.
            AttributeDefinition::builder()
                .attribute_name(name)
                .attribute_type(ScalarAttributeType::S)
                .build()
                .ok()
        })
        .collect()
}

/// The owner index's projection: keys only, as the KCL 3 makes it.
fn owner_index_projection() -> Projection {
    Projection::builder()
        .projection_type(ProjectionType::KeysOnly)
        .build()
}

/// The owner index's key: hash `leaseOwner`, range `leaseKey` (the KCL 3's).
fn owner_index_keys() -> Vec<KeySchemaElement> {
    [(OWNER, KeyType::Hash), (KEY, KeyType::Range)]
        .into_iter()
        .filter_map(|(name, key_type)| {
            // Cannot fail: the name and key type, the builder's only required fields,
            // are set.
            KeySchemaElement::builder()
                .attribute_name(name)
                .key_type(key_type)
                .build()
                .ok()
        })
        .collect()
}

/// The fencing condition of a conditional write, with its placeholders.
struct Fence {
    /// The condition expression.
    condition: &'static str,
    /// `ExpressionAttributeNames` entries the condition uses.
    names: [(&'static str, &'static str); 2],
    /// `ExpressionAttributeValues` entries the condition uses.
    values: Vec<(&'static str, AttributeValue)>,
}

/// The condition that the row still has `expected`'s owner and counter.
fn fence(expected: &Lease) -> Fence {
    let mut values = vec![(
        ":expected_counter",
        AttributeValue::N(expected.counter.to_string()),
    )];
    let condition = match &expected.owner {
        Some(owner) => {
            values.push((":expected_owner", AttributeValue::S(owner.clone())));
            "#counter = :expected_counter AND #owner = :expected_owner"
        }
        None => "#counter = :expected_counter AND attribute_not_exists(#owner)",
    };
    Fence {
        condition,
        names: [("#counter", COUNTER), ("#owner", OWNER)],
        values,
    }
}

/// `counter + 1`, refusing to wrap.
fn next_counter(expected: &Lease) -> Result<u64, LeaseError> {
    expected.counter.checked_add(1).ok_or_else(|| {
        LeaseError::Corrupt(format!("lease {}: the counter cannot grow", expected.key))
    })
}

/// Classifies an SDK error: a failed condition is a conflict on `key`, throttling is
/// throttling, a missing table (ResourceNotFoundException) is
/// [`LeaseError::TableMissing`] naming `table`, everything else is [`LeaseError::Other`]
/// with the whole cause chain.
pub(super) fn classify<E>(table: &str, op: &str, key: Option<&str>, err: SdkError<E>) -> LeaseError
where
    E: ProvideErrorMetadata + std::error::Error + 'static,
{
    match (err.code(), key) {
        (Some("ResourceNotFoundException"), _) => LeaseError::TableMissing {
            table: table.to_owned(),
        },
        (Some("ConditionalCheckFailedException"), Some(key)) => {
            LeaseError::Conflict(key.to_owned())
        }
        (
            Some(
                "ProvisionedThroughputExceededException"
                | "RequestLimitExceeded"
                | "ThrottlingException",
            ),
            _,
        ) => LeaseError::Throttled(ErrorDetail::from_aws(
            describe_sdk_error(op, &err),
            aws_error_of(op, &err),
        )),
        _ => LeaseError::Other(ErrorDetail::from_aws(
            describe_sdk_error(op, &err),
            aws_error_of(op, &err),
        )),
    }
}

/// The item that stores `lease`.
fn item_from_lease(lease: &Lease) -> HashMap<String, AttributeValue> {
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
fn lease_from_item(item: &HashMap<String, AttributeValue>) -> Result<Lease, LeaseError> {
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
    Ok(Lease {
        reset_to,
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

/// Parses a non-negative integer attribute.
fn parse_number(key: &str, name: &str, digits: &str) -> Result<u64, LeaseError> {
    digits
        .parse::<u64>()
        .map_err(|e| LeaseError::Corrupt(format!("lease {key}: {name} {digits:?}: {e}")))
}

#[async_trait]
impl LeaseStore for DynamoLeaseStore {
    fn coordinator_state(&self) -> Option<std::sync::Arc<dyn super::CoordinatorState>> {
        Some(std::sync::Arc::new(
            super::dynamo_state::DynamoCoordinatorState::new(self.client.clone(), &self.table),
        ))
    }

    async fn ensure_table(&self) -> Result<(), LeaseError> {
        let mut poll = DeadlinePoll::new(
            ACTIVE_WAIT,
            Duration::from_millis(25),
            Duration::from_millis(250),
        );
        let mut created = false;
        loop {
            match self.describe().await {
                // UPDATING (an index being added, by a peer's upgrade): usable for data
                // all along, as DynamoDB documents it; waiting would hold this worker's
                // start-up for as long as the index takes to build.
                Ok(Some(t))
                    if matches!(
                        t.table_status(),
                        Some(&TableStatus::Active | &TableStatus::Updating)
                    ) =>
                {
                    // A table without the owner index is upgraded in place.
                    if self.note_index(&t).is_none() {
                        self.add_index(&t).await;
                    }
                    return Ok(());
                }
                Ok(None) if !created => {
                    self.create_table().await?;
                    created = true;
                    continue;
                }
                // Being created (by us or a peer), or not visible yet right after creation.
                Ok(_) | Err(LeaseError::Throttled(_)) => {}
                Err(e) => return Err(e),
            }
            if !poll.pause().await {
                return Err(LeaseError::Other(
                    format!(
                        "lease table {} not ACTIVE after {} s",
                        self.table,
                        ACTIVE_WAIT.as_secs()
                    )
                    .into(),
                ));
            }
        }
    }

    async fn list(&self) -> Result<Vec<Lease>, LeaseError> {
        let mut leases = Vec::new();
        let mut start: Option<HashMap<String, AttributeValue>> = None;
        loop {
            let out = self
                .client
                .scan()
                .table_name(&self.table)
                .consistent_read(true)
                .set_exclusive_start_key(start.take())
                .send()
                .await
                .map_err(|e| classify(&self.table, "Scan", None, e))?;
            for item in out.items.unwrap_or_default() {
                // One row that does not parse must not stop balancing for the whole
                // group, nor vanish from it: it is listed as unreadable (see
                // `Lease::unreadable`), so its shard and its children wait for a repair
                // and workers report it.
                match lease_from_item(&item) {
                    Ok(lease) => leases.push(lease),
                    Err(e) => {
                        let key = match item.get(KEY) {
                            Some(AttributeValue::S(k)) => k.as_str(),
                            _ => "?",
                        };
                        tracing::warn!(table = %self.table, lease = %key, error = %e, "a lease row does not parse; it is left alone until repaired");
                        leases.push(Lease::unreadable(key, e.to_string()));
                    }
                }
            }
            match out.last_evaluated_key {
                Some(key) if !key.is_empty() => start = Some(key),
                _ => return Ok(leases),
            }
        }
    }

    async fn owned_keys(&self, owner: &str) -> Result<Vec<String>, LeaseError> {
        if self.index_ready().await {
            match self.query_owner_index(owner).await {
                Ok(keys) => return Ok(keys),
                // A missing table, throttling or a failed connection is the caller's to
                // retry, as for any call.
                Err(e)
                    if e.code().is_none_or(|code| {
                        matches!(
                            code,
                            "ResourceNotFoundException"
                                | "ProvisionedThroughputExceededException"
                                | "RequestLimitExceeded"
                                | "ThrottlingException"
                        )
                    }) =>
                {
                    return Err(classify(&self.table, "Query", None, e))
                }
                // The index cannot be queried (deleted by hand, no `dynamodb:Query`
                // permission on it): list, and look at the index again later. A worker
                // that could not read its own keys would never adopt a lease handed to it.
                Err(e) => {
                    tracing::warn!(table = %self.table, index = OWNER_INDEX, error = %DisplayErrorContext(&e), "the owner index cannot be queried; listing the table instead");
                    let mut state = self.index_state();
                    state.active = false;
                    state.checked = Some(tokio::time::Instant::now());
                }
            }
        }
        Ok(super::owned_by(self.list().await?, owner))
    }

    async fn get(&self, key: &str) -> Result<Option<Lease>, LeaseError> {
        let out = self
            .client
            .get_item()
            .table_name(&self.table)
            .key(KEY, AttributeValue::S(key.to_owned()))
            .consistent_read(true)
            .send()
            .await
            .map_err(|e| classify(&self.table, "GetItem", None, e))?;
        match out.item {
            Some(item) if !item.is_empty() => Ok(Some(
                lease_from_item(&item).unwrap_or_else(|e| Lease::unreadable(key, e.to_string())),
            )),
            _ => Ok(None),
        }
    }

    async fn create(&self, lease: &Lease) -> Result<bool, LeaseError> {
        let result = self
            .client
            .put_item()
            .table_name(&self.table)
            .set_item(Some(item_from_lease(lease)))
            .condition_expression("attribute_not_exists(#key)")
            .expression_attribute_names("#key", KEY)
            .send()
            .await;
        match result {
            Ok(_) => Ok(true),
            Err(e) if e.code() == Some("ConditionalCheckFailedException") => Ok(false),
            Err(e) => Err(classify(&self.table, "PutItem", Some(&lease.key), e)),
        }
    }

    async fn take(&self, expected: &Lease, new_owner: &str) -> Result<Lease, LeaseError> {
        let next = next_counter(expected)?;
        let switch = owner_switch(expected, new_owner);
        // A hand-over needs the new owner's request to still stand.
        let handover = expected.pending_owner.as_deref() == Some(new_owner);
        self.fenced_update_if(
            "take",
            expected,
            handover.then_some("#pending = :new_owner"),
            "SET #owner = :new_owner, #counter = :next, \
             #switches = if_not_exists(#switches, :zero) + :switch \
             REMOVE #pending, #checkpoint_owner",
            &[
                ("#pending", PENDING_OWNER),
                ("#switches", OWNER_SWITCHES),
                ("#checkpoint_owner", CHECKPOINT_OWNER),
            ],
            vec![
                (":new_owner", AttributeValue::S(new_owner.to_owned())),
                (":next", AttributeValue::N(next.to_string())),
                (":zero", AttributeValue::N("0".into())),
                (":switch", AttributeValue::N(switch.to_string())),
            ],
            || Lease {
                owner: Some(new_owner.to_owned()),
                counter: next,
                pending_owner: None,
                owner_switches: expected.owner_switches.saturating_add(switch),
                checkpoint_owner: None,
                ..expected.clone()
            },
        )
        .await
    }

    async fn renew(&self, expected: &Lease) -> Result<Lease, LeaseError> {
        let next = next_counter(expected)?;
        self.fenced_update(
            "renew",
            expected,
            "SET #counter = :next",
            &[],
            vec![(":next", AttributeValue::N(next.to_string()))],
            || Lease {
                counter: next,
                ..expected.clone()
            },
        )
        .await
    }

    async fn checkpoint(
        &self,
        expected: &Lease,
        checkpoint: &Checkpoint,
    ) -> Result<Lease, LeaseError> {
        self.write_checkpoint("checkpoint", expected, checkpoint, false)
            .await
    }

    async fn release(&self, expected: &Lease) -> Result<Lease, LeaseError> {
        let next = next_counter(expected)?;
        self.fenced_update(
            "release",
            expected,
            "SET #counter = :next REMOVE #owner, #checkpoint_owner",
            &[("#checkpoint_owner", CHECKPOINT_OWNER)],
            vec![(":next", AttributeValue::N(next.to_string()))],
            || Lease {
                owner: None,
                counter: next,
                checkpoint_owner: None,
                ..expected.clone()
            },
        )
        .await
    }

    async fn withdraw_handoff(&self, expected: &Lease, worker: &str) -> Result<Lease, LeaseError> {
        expected.refuse_if_unreadable()?;
        let out = self
            .client
            .update_item()
            .table_name(&self.table)
            .key(KEY, AttributeValue::S(expected.key.clone()))
            .update_expression("REMOVE #pending")
            .condition_expression("#pending = :worker")
            .expression_attribute_names("#pending", PENDING_OWNER)
            .expression_attribute_values(":worker", AttributeValue::S(worker.to_owned()))
            .return_values(ReturnValue::AllNew)
            .send()
            .await
            .map_err(|e| classify(&self.table, "withdraw_handoff", Some(&expected.key), e))?;
        match out.attributes {
            Some(item) if !item.is_empty() => lease_from_item(&item),
            _ => Ok(Lease {
                pending_owner: None,
                ..expected.clone()
            }),
        }
    }

    async fn request_handoff(&self, expected: &Lease, worker: &str) -> Result<Lease, LeaseError> {
        self.fenced_update_if(
            "request_handoff",
            expected,
            // The first request wins: workers asking at once do not overwrite each
            // other (each then asks for another lease instead).
            Some("attribute_not_exists(#pending) OR #pending = :pending"),
            "SET #pending = :pending",
            &[("#pending", PENDING_OWNER)],
            vec![(":pending", AttributeValue::S(worker.to_owned()))],
            || Lease {
                pending_owner: Some(worker.to_owned()),
                ..expected.clone()
            },
        )
        .await
    }

    async fn request_reset(&self, expected: &Lease, to: &Checkpoint) -> Result<Lease, LeaseError> {
        let (value, sub_sequence) = to.as_attribute();
        let mut values = vec![
            (":reset", AttributeValue::S(value)),
            (":reset_sub", AttributeValue::N(sub_sequence.to_string())),
        ];
        let update = match to.timestamp_millis() {
            Some(millis) => {
                values.push((":reset_ts", AttributeValue::N(millis.to_string())));
                "SET #reset = :reset, #reset_sub = :reset_sub, #reset_ts = :reset_ts"
            }
            None => "SET #reset = :reset, #reset_sub = :reset_sub REMOVE #reset_ts",
        };
        self.fenced_update(
            "request_reset",
            expected,
            update,
            &[
                ("#reset", RESET),
                ("#reset_sub", RESET_SUB_SEQUENCE),
                ("#reset_ts", RESET_TIMESTAMP),
            ],
            values,
            || Lease {
                reset_to: Some(to.clone()),
                ..expected.clone()
            },
        )
        .await
    }

    async fn reset(&self, expected: &Lease, to: &Checkpoint) -> Result<Lease, LeaseError> {
        self.write_checkpoint("reset", expected, to, true).await
    }

    async fn claim_for_stream(&self, expected: &Lease, stream: &str) -> Result<Lease, LeaseError> {
        self.fenced_update(
            "claim_for_stream",
            expected,
            "SET #stream = if_not_exists(#stream, :stream)",
            &[("#stream", STREAM)],
            vec![(":stream", AttributeValue::S(stream.to_owned()))],
            || Lease {
                stream: Some(expected.stream.clone().unwrap_or_else(|| stream.to_owned())),
                ..expected.clone()
            },
        )
        .await
    }

    async fn record_children(
        &self,
        expected: &Lease,
        children: &[String],
    ) -> Result<Lease, LeaseError> {
        if children.is_empty() {
            return Ok(expected.clone()); // DynamoDB refuses an empty set
        }
        self.fenced_update(
            "record_children",
            expected,
            "SET #children = :children",
            &[("#children", CHILDREN)],
            vec![(":children", AttributeValue::Ss(children.to_vec()))],
            || Lease {
                children: children.to_vec(),
                ..expected.clone()
            },
        )
        .await
    }

    async fn delete(&self, expected: &Lease) -> Result<(), LeaseError> {
        expected.refuse_if_unreadable()?;
        let fence = fence(expected);
        let mut request = self
            .client
            .delete_item()
            .table_name(&self.table)
            .key(KEY, AttributeValue::S(expected.key.clone()))
            .condition_expression(fence.condition);
        for (placeholder, name) in fence.names {
            request = request.expression_attribute_names(placeholder, name);
        }
        for (placeholder, value) in fence.values {
            request = request.expression_attribute_values(placeholder, value);
        }
        request
            .send()
            .await
            .map_err(|e| classify(&self.table, "DeleteItem", Some(&expected.key), e))?;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
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
        let item = item_from_lease(&lease);
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
                    other => panic!("type {other} is not in the KCL's rows"),
                };
                (name.clone(), attribute)
            })
            .collect()
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
                | "throughputKBps" => {
                    matches!(value, AttributeValue::N(n) if n.parse::<f64>().is_ok())
                }
                PARENTS | CHILDREN => matches!(value, AttributeValue::Ss(set) if !set.is_empty()),
                PENDING_STATE => matches!(value, AttributeValue::B(_) | AttributeValue::N(_)),
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
}
