//! [`LeaseStore`] over `aws-sdk-dynamodb`.
//!
//! # Table schema
//!
//! One table per consumer group, one item per shard, under the Java KCL's attribute
//! names where they mean the same thing, so a KCL application's lease table can be taken
//! over (and read by KCL tooling) without losing positions: the [`codec`] module lists
//! every attribute. The group's leader item is a row of the same table, marked as no
//! lease, or (a table taken over from a KCL older than 3.5) an item of a
//! coordinator-state table beside it: see [`LeaderPlacement`] and the `leader` module.
//!
//! A row whose `entityType` is present and is not `LEASE` (a KCL 3.5 single-table
//! application's leader lock, worker metrics, stream metadata, migration states) is not
//! a lease: [`list`](LeaseStore::list) and [`get`](LeaseStore::get) leave it out, no
//! write reaches it, and [`DynamoLeaseStore::rows`] lists it apart (see
//! [`crate::lease::entity`]). `list` refuses a table in the middle of a KCL migration
//! ([`LeaseError::KclMigrationInProgress`]). Once a row read carried `entityType`,
//! [`create`](LeaseStore::create) writes `entityType = LEASE` too.
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

use async_trait::async_trait;
use aws_sdk_dynamodb::error::{DisplayErrorContext, ProvideErrorMetadata, SdkError};
use aws_sdk_dynamodb::types::{AttributeValue, ReturnValue};

use super::{checkpoint_time, owner_switch, Checkpoint, Lease, LeaseError, LeaseStore};
use crate::error::ErrorDetail;
use crate::kinesis::aws::{aws_error_of, describe_sdk_error};

pub mod codec;
mod leader;
mod table;

use super::entity::{
    EntityKind, EntityRow, RowKind, ENTITY_TYPE, LEASE_ENTITY, TABLE_MIGRATION_DONE,
    TABLE_MIGRATION_KEY,
};
use codec::{
    entity_from_item, epoch_millis, has_entity_type, item_from_lease, lease_from_item, row_kind,
    CHECKPOINT, CHECKPOINTED_AT, CHECKPOINT_OWNER, CHILDREN, COUNTER, KEY, OWNER, OWNER_SWITCHES,
    PENDING_CHECKPOINT, PENDING_OWNER, PENDING_STATE, PENDING_SUB_SEQUENCE, RESET,
    RESET_SUB_SEQUENCE, RESET_TIMESTAMP, STREAM, SUB_SEQUENCE, TIMESTAMP,
};
pub use leader::{
    coordinator_table, DynamoCoordinatorState, LeaderPlacement, LEADER_ENTITY_TYPE, LEADER_ROW_KEY,
};
use table::IndexState;
pub use table::OWNER_INDEX;

/// Leases in a DynamoDB table; see the [module docs](self) for the schema.
#[derive(Clone, Debug)]
pub struct DynamoLeaseStore {
    client: aws_sdk_dynamodb::Client,
    table: String,
    index: std::sync::Arc<std::sync::Mutex<IndexState>>,
    /// Whether a row read from the table carried `entityType` (the KCL 3.5
    /// single-table format): then the rows this store creates carry `entityType =
    /// LEASE`, so a KCL 3.5 reading the table back finds them.
    single_table: std::sync::Arc<std::sync::atomic::AtomicBool>,
    /// Whether the KCL's coordinator-state table was found without a table migration
    /// in progress (looked at once, see [`DynamoLeaseStore::kcl_table_migration`]).
    kcl_migration_checked: std::sync::Arc<std::sync::atomic::AtomicBool>,
    /// Where the group's leader item lives.
    placement: LeaderPlacement,
    /// Whether this store created the table (a new group).
    created: std::sync::Arc<std::sync::atomic::AtomicBool>,
}

/// Refuses (`LeaseError::KclMigrationInProgress`) a lease table in the middle of a KCL
/// migration, from its rows that are not leases (`others`): a client-version or table
/// migration row not finished; or, with `look_beside` (once per store), the KCL's rows
/// but no table-migration row while the KCL's coordinator-state table holds a 3.5 table
/// migration not finished (the KCL keeps it there until it completes).
pub(super) async fn refuse_unfinished_kcl_migration(
    client: &aws_sdk_dynamodb::Client,
    table: &str,
    others: &[EntityRow],
    look_beside: bool,
) -> Result<(), LeaseError> {
    if let Some((row, (migration, state))) = others
        .iter()
        .find_map(|row| row.unfinished_migration().map(|m| (row, m)))
    {
        return Err(LeaseError::KclMigrationInProgress {
            table: table.to_owned(),
            migration: migration.to_owned(),
            state,
            row: format!("{table}/{}", row.key),
        });
    }
    let kcl_rows = others.iter().any(|r| {
        matches!(
            r.kind,
            EntityKind::KclLeader
                | EntityKind::KclWorkerMetrics
                | EntityKind::KclStream
                | EntityKind::KclClientVersionMigration
        )
    });
    let migrated = others
        .iter()
        .any(|r| r.kind == EntityKind::KclTableMigration);
    if kcl_rows && !migrated && look_beside {
        if let Some((row, state)) = kcl_table_migration(client, table).await? {
            if state != TABLE_MIGRATION_DONE {
                return Err(LeaseError::KclMigrationInProgress {
                    table: table.to_owned(),
                    migration: "the KCL 3.5 single-table migration".to_owned(),
                    state,
                    row,
                });
            }
        }
    }
    Ok(())
}

/// The state of the KCL's 3.4 to 3.5 table migration as its coordinator-state table
/// holds it (`TableMigration3.5`, attribute `tm`, under the hash key `key`), where
/// the KCL keeps it until the migration completes: `None` when there is no such
/// table or item (or it may not be read: the consumer's policy need not grant it,
/// and a warning says the check was skipped).
async fn kcl_table_migration(
    client: &aws_sdk_dynamodb::Client,
    lease_table: &str,
) -> Result<Option<(String, String)>, LeaseError> {
    let table = kcl_coordinator_table(lease_table);
    let out = client
        .get_item()
        .table_name(&table)
        .key("key", AttributeValue::S(TABLE_MIGRATION_KEY.to_owned()))
        .consistent_read(true)
        .send()
        .await;
    match out {
        Ok(out) => Ok(out.item.filter(|i| !i.is_empty()).map(|item| {
            let state = match item.get("tm") {
                Some(AttributeValue::S(state)) => state.clone(),
                _ => "no state".to_owned(),
            };
            (format!("{table}/{TABLE_MIGRATION_KEY}"), state)
        })),
        Err(e) if e.code() == Some("ResourceNotFoundException") => Ok(None),
        Err(e) if e.code() == Some("AccessDeniedException") => {
            tracing::warn!(table = %table, error = %DisplayErrorContext(&e), "the KCL's coordinator-state table cannot be read; a KCL table migration in progress would not be seen");
            Ok(None)
        }
        Err(e) => Err(classify(&table, "GetItem", None, e)),
    }
}

/// The KCL's coordinator-state table beside a lease table named after its application
/// (the KCL's default name, `<application>-CoordinatorState`).
pub fn kcl_coordinator_table(lease_table: &str) -> String {
    format!("{lease_table}-CoordinatorState")
}

impl DynamoLeaseStore {
    /// A store over `table`.
    pub fn new(client: aws_sdk_dynamodb::Client, table: &str) -> Self {
        DynamoLeaseStore {
            client,
            table: table.to_owned(),
            index: Default::default(),
            single_table: Default::default(),
            kcl_migration_checked: Default::default(),
            placement: LeaderPlacement::default(),
            created: Default::default(),
        }
    }

    /// Whether the table is in the KCL 3.5 single-table format, as far as this store
    /// has read it: some row it listed or fetched carried `entityType`.
    pub fn is_single_table(&self) -> bool {
        self.single_table.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Notes the format `item` shows.
    fn note_format(&self, item: &HashMap<String, AttributeValue>) {
        if has_entity_type(item) {
            self.single_table
                .store(true, std::sync::atomic::Ordering::Relaxed);
        }
    }

    /// Every row of the table (a strongly consistent Scan), split by the rule of
    /// [`crate::lease::entity`]: the leases (a row that does not parse listed as
    /// [`Lease::unreadable`]) and the rows that are not leases. Unlike
    /// [`LeaseStore::list`] it does not refuse a table in the middle of a KCL migration,
    /// so tools can show such a table.
    pub async fn rows(&self) -> Result<(Vec<Lease>, Vec<EntityRow>), LeaseError> {
        let mut leases = Vec::new();
        let mut others = Vec::new();
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
                self.note_format(&item);
                if let RowKind::Other(kind) = row_kind(&item) {
                    others.push(entity_from_item(&item, kind));
                    continue;
                }
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
                _ => return Ok((leases, others)),
            }
        }
    }

    /// Where the group's leader item lives ([`LeaderPlacement::Auto`] unless set):
    /// see docs/kcl.md for when to set it (a rolling move between the places).
    pub fn with_leader_placement(mut self, placement: LeaderPlacement) -> Self {
        self.placement = placement;
        self
    }

    /// The table's name.
    pub fn table(&self) -> &str {
        &self.table
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
        // The time of the write rides on the write itself: no extra call.
        let at = checkpoint_time(std::time::SystemTime::now());
        let mut values = vec![
            (":checkpoint", AttributeValue::S(value)),
            (":sub", AttributeValue::N(sub_sequence.to_string())),
            (":zero", AttributeValue::N("0".into())),
            (":at", AttributeValue::N(epoch_millis(at).to_string())),
        ];
        let mut set =
            "SET #checkpoint = :checkpoint, #sub = :sub, #switches = :zero, #at = :at".to_owned();
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
            ("#at", CHECKPOINTED_AT),
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
                checkpointed_at: Some(at),
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
fn classify<E>(table: &str, op: &str, key: Option<&str>, err: SdkError<E>) -> LeaseError
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
        (Some("AccessDeniedException"), _) => LeaseError::AccessDenied(ErrorDetail::from_aws(
            describe_sdk_error(op, &err),
            aws_error_of(op, &err),
        )),
        _ => LeaseError::Other(ErrorDetail::from_aws(
            describe_sdk_error(op, &err),
            aws_error_of(op, &err),
        )),
    }
}

#[async_trait]
impl LeaseStore for DynamoLeaseStore {
    fn coordinator_state(&self) -> Option<std::sync::Arc<dyn super::CoordinatorState>> {
        Some(std::sync::Arc::new(leader::PlacedState::new(
            self.client.clone(),
            &self.table,
            self.placement,
            self.created.clone(),
        )))
    }

    async fn ensure_table(&self) -> Result<(), LeaseError> {
        let table = table::ensure_table(
            "lease table",
            &self.table,
            || self.describe(),
            || self.create_table(),
        )
        .await?;
        // A table without the owner index is upgraded in place.
        if self.note_index(&table).is_none() {
            self.add_index(&table).await;
        }
        Ok(())
    }

    async fn list(&self) -> Result<Vec<Lease>, LeaseError> {
        let (leases, others) = self.rows().await?;
        // A table in the middle of a KCL migration is the KCL's to finish. The KCL's
        // coordinator-state table is looked at once.
        let checked = &self.kcl_migration_checked;
        refuse_unfinished_kcl_migration(
            &self.client,
            &self.table,
            &others,
            !checked.load(std::sync::atomic::Ordering::Relaxed),
        )
        .await?;
        checked.store(true, std::sync::atomic::Ordering::Relaxed);
        Ok(leases)
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
                    self.index_unusable();
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
            Some(item) if !item.is_empty() => {
                self.note_format(&item);
                // A row that is not a lease is no lease under this key.
                if let RowKind::Other(_) = row_kind(&item) {
                    return Ok(None);
                }
                Ok(Some(
                    lease_from_item(&item)
                        .unwrap_or_else(|e| Lease::unreadable(key, e.to_string())),
                ))
            }
            _ => Ok(None),
        }
    }

    async fn create(&self, lease: &Lease) -> Result<bool, LeaseError> {
        let mut item = item_from_lease(lease);
        if self.is_single_table() {
            item.insert(
                ENTITY_TYPE.to_owned(),
                AttributeValue::S(LEASE_ENTITY.to_owned()),
            );
        }
        let result = self
            .client
            .put_item()
            .table_name(&self.table)
            .set_item(Some(item))
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
        let mut values = vec![(":next", AttributeValue::N(next.to_string()))];
        // The owner's measurement rides on the heartbeat: no call of its own.
        let update = match expected.throughput_kbps {
            Some(kbps) => {
                values.push((":throughput", codec::throughput_attribute(kbps)));
                "SET #counter = :next, #throughput = :throughput"
            }
            None => "SET #counter = :next",
        };
        let names: &[(&str, &str)] = match expected.throughput_kbps {
            Some(_) => &[("#throughput", codec::THROUGHPUT)],
            None => &[],
        };
        self.fenced_update("renew", expected, update, names, values, || Lease {
            counter: next,
            ..expected.clone()
        })
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
