//! Where [`DynamoLeaseStore`](super::DynamoLeaseStore) keeps the leader items of its
//! group (see [`crate::lease::leader`]): a row of the lease table itself, or the table
//! `<lease table>-coordinator`, chosen per table by [`LeaderPlacement`].
//!
//! In the lease table the leader item is a row keyed `shardflow-leader` (per stream in
//! a multi-stream table: `shardflow-leader/<stream identity>`) whose `entityType` is
//! [`LEADER_ENTITY_TYPE`]: the KCL 3.5 reads as leases only rows whose `entityType` is
//! absent or `LEASE`, and its own leader lock is the row `Leader` (`entityType`
//! `LEADER`), so a KCL 3.5 worker on the same table neither parses this row as a shard
//! nor takes it for its own coordinator state. Its attributes are not the lease ones
//! (`leaderOwner`, not `leaseOwner`), so the owner index never lists it either.
//! A table taken over from a KCL older than 3.5 (whose readers parse every row as a
//! lease) keeps the item in `<lease table>-coordinator` instead, created on demand
//! (on-demand capacity, hash key `key`) as the KCL 3.0 to 3.4 keep their leader
//! election in a `-CoordinatorState` table.
//!
//! | call | write (condition: the item as last seen) |
//! |---|---|
//! | `claim` | `SET leaderOwner = me, leaderCounter = seen + 1` if `leaderCounter = seen` (and `leaderOwner` as seen), or if the item does not exist |
//! | `renew` | `SET leaderCounter = counter + 1` if `leaderOwner = me AND leaderCounter = counter` |
//! | `release` | `SET leaderCounter = counter + 1 REMOVE leaderOwner`, same condition |
//!
//! `get` is eventually consistent (half a read unit): a stale answer can only delay
//! seeing the counter move, and a take-over decided on it fails its condition.
//!
//! While a group moves between the two places (a rolling deploy, see docs/kcl.md),
//! [`LeaderPlacement::Both`] leads only while holding both items, taken in a fixed
//! order (the coordinator table's first): a worker that knows only one of the two
//! places then never leads beside one that holds both.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

use async_trait::async_trait;
use aws_sdk_dynamodb::error::ProvideErrorMetadata;
use aws_sdk_dynamodb::types::{
    AttributeDefinition, AttributeValue, ScalarAttributeType, TableDescription,
};
use tokio::sync::OnceCell;

use super::classify;
use super::codec::KEY as LEASE_KEY;
use super::codec::{entity_from_item, row_kind};
use super::refuse_unfinished_kcl_migration;
use super::table::{build_error, create_table, ensure_table};
use crate::lease::entity::{EntityRow, RowKind, ENTITY_TYPE};
use crate::lease::leader::{CoordinatorState, LeaderItem, LEADER_KEY};
use crate::lease::LeaseError;

/// The hash key of the coordinator-state table.
const KEY: &str = "key";
/// The leader's owner string (absent once released).
const OWNER: &str = "leaderOwner";
/// The fencing token.
const COUNTER: &str = "leaderCounter";
/// The `entityType` of shardflow's leader row in the lease table: not one the KCL 3.5
/// knows, so its lease readers skip the row and its coordinator-state readers do not
/// take it for theirs; under [`SHARDFLOW_ENTITY_PREFIX`](crate::lease::entity::SHARDFLOW_ENTITY_PREFIX), so `group delete` knows it for
/// the group's own.
pub const LEADER_ENTITY_TYPE: &str = "SHARDFLOW_LEADER";
/// The key of the leader row in the lease table (single-stream groups); a multi-stream
/// stream's row is `shardflow-leader/<stream identity>`.
pub const LEADER_ROW_KEY: &str = "shardflow-leader";

/// The name of the coordinator-state table beside the lease table `lease_table`.
pub fn coordinator_table(lease_table: &str) -> String {
    format!("{lease_table}-coordinator")
}

/// Whether `item`, a row of a lease table, is one of shardflow's leader rows (not a
/// lease).
pub(super) fn is_leader_row(item: &HashMap<String, AttributeValue>) -> bool {
    matches!(item.get(ENTITY_TYPE), Some(AttributeValue::S(t)) if t == LEADER_ENTITY_TYPE)
}

/// Where a group's leader item lives (see the [store's docs](super::DynamoLeaseStore) and docs/kcl.md).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub enum LeaderPlacement {
    /// Chosen from the table at start-up: a table this worker creates, or one whose
    /// rows carry an `entityType` (KCL 3.5), gets [`Self::LeaseTable`]; a table whose
    /// leader row exists follows it ([`Self::Both`] while a coordinator table is
    /// there too); any other table that already has rows (taken over from a KCL
    /// older than 3.5, or a group of an earlier shardflow) keeps
    /// [`Self::CoordinatorTable`].
    #[default]
    Auto,
    /// A row of the lease table only: one table, one IAM resource.
    LeaseTable,
    /// Both places, for a rolling move between them: a worker leads only while it
    /// holds the item in each.
    Both,
    /// The table `<lease table>-coordinator` only, as earlier versions did: what a
    /// roll-back to a KCL older than 3.5 needs.
    CoordinatorTable,
}

/// Which table a [`DynamoCoordinatorState`] writes to.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Place {
    /// `<lease table>-coordinator`, hash key `key`.
    CoordinatorTable,
    /// The lease table, hash key `leaseKey`, rows marked [`LEADER_ENTITY_TYPE`].
    LeaseTable,
}

/// Leader items in one DynamoDB table: `<lease table>-coordinator`, or the lease
/// table itself.
pub struct DynamoCoordinatorState {
    client: aws_sdk_dynamodb::Client,
    table: String,
    place: Place,
}

impl DynamoCoordinatorState {
    /// The coordinator-state table beside the lease table `lease_table`.
    pub fn new(client: aws_sdk_dynamodb::Client, lease_table: &str) -> Self {
        DynamoCoordinatorState {
            client,
            table: coordinator_table(lease_table),
            place: Place::CoordinatorTable,
        }
    }

    /// Leader rows in the lease table `lease_table` itself.
    pub fn in_lease_table(client: aws_sdk_dynamodb::Client, lease_table: &str) -> Self {
        DynamoCoordinatorState {
            client,
            table: lease_table.to_owned(),
            place: Place::LeaseTable,
        }
    }

    /// The table the items are in.
    pub fn table(&self) -> &str {
        &self.table
    }

    /// The hash key attribute of the table.
    fn key_attribute(&self) -> &'static str {
        match self.place {
            Place::CoordinatorTable => KEY,
            Place::LeaseTable => LEASE_KEY,
        }
    }

    /// The stored key of the leader item `key`.
    fn row_key(&self, key: &str) -> String {
        match self.place {
            Place::CoordinatorTable => key.to_owned(),
            Place::LeaseTable if key == LEADER_KEY => LEADER_ROW_KEY.to_owned(),
            Place::LeaseTable => format!("{LEADER_ROW_KEY}/{key}"),
        }
    }

    /// The table, or `None` when it does not exist (or has no status yet).
    async fn describe(&self) -> Result<Option<TableDescription>, LeaseError> {
        match self
            .client
            .describe_table()
            .table_name(&self.table)
            .send()
            .await
        {
            Ok(out) => Ok(out.table.filter(|t| t.table_status().is_some())),
            Err(e) if e.code() == Some("ResourceNotFoundException") => Ok(None),
            Err(e) => Err(classify(&self.table, "DescribeTable", None, e)),
        }
    }

    /// Creates the table (on-demand capacity); a concurrent creation is not an error.
    async fn create_table(&self) -> Result<(), LeaseError> {
        let key = AttributeDefinition::builder()
            .attribute_name(KEY)
            .attribute_type(ScalarAttributeType::S)
            .build()
            .map_err(build_error)?;
        create_table(
            &self.client,
            &self.table,
            "coordinator-state table",
            KEY,
            vec![key],
            None,
        )
        .await
    }

    /// Writes a released leader item `key` (counter 0, no owner) unless one exists:
    /// marks a lease table as keeping its leader state in itself.
    pub(super) async fn mark(&self, key: &str) -> Result<(), LeaseError> {
        let mut request = self
            .client
            .put_item()
            .table_name(&self.table)
            .item(self.key_attribute(), AttributeValue::S(self.row_key(key)))
            .item(COUNTER, AttributeValue::N("0".into()))
            .condition_expression("attribute_not_exists(#key)")
            .expression_attribute_names("#key", self.key_attribute());
        if self.place == Place::LeaseTable {
            request = request.item(ENTITY_TYPE, AttributeValue::S(LEADER_ENTITY_TYPE.into()));
        }
        match request.send().await {
            Ok(_) => Ok(()),
            Err(e) if e.code() == Some("ConditionalCheckFailedException") => Ok(()),
            Err(e) => Err(classify(&self.table, "PutItem", Some(key), e)),
        }
    }

    /// A conditional UpdateItem of the item `key`, returning the item as written.
    async fn update(
        &self,
        op: &str,
        key: &str,
        update: &str,
        condition: &str,
        values: Vec<(&str, AttributeValue)>,
    ) -> Result<LeaderItem, LeaseError> {
        // A row of the lease table says what it is on every write.
        let update = match self.place {
            Place::LeaseTable => update.replacen("SET ", "SET #entity = :entity, ", 1),
            Place::CoordinatorTable => update.to_owned(),
        };
        let mut request = self
            .client
            .update_item()
            .table_name(&self.table)
            .key(self.key_attribute(), AttributeValue::S(self.row_key(key)))
            .update_expression(&update)
            .condition_expression(condition)
            .expression_attribute_names("#owner", OWNER)
            .expression_attribute_names("#counter", COUNTER)
            .return_values(aws_sdk_dynamodb::types::ReturnValue::AllNew);
        if condition.contains("#key") {
            request = request.expression_attribute_names("#key", self.key_attribute());
        }
        if self.place == Place::LeaseTable {
            request = request
                .expression_attribute_names("#entity", ENTITY_TYPE)
                .expression_attribute_values(
                    ":entity",
                    AttributeValue::S(LEADER_ENTITY_TYPE.into()),
                );
        }
        for (name, value) in values {
            request = request.expression_attribute_values(name, value);
        }
        let out = request
            .send()
            .await
            .map_err(|e| classify(&self.table, op, Some(key), e))?;
        item_of(key, &out.attributes.unwrap_or_default())
    }
}

impl DynamoCoordinatorState {
    /// A leader item whose counter is missing or does not parse (written by hand) would
    /// fail every read and every take: nobody could lead again. It is reset to a
    /// released item (counter 1, no owner), conditional on the counter still being what
    /// was read, so the next worker that reads it takes it over; a leader that held it
    /// before can no longer renew it (its renewal names itself as the owner).
    async fn repair(
        &self,
        key: &str,
        item: &HashMap<String, AttributeValue>,
        why: &str,
    ) -> Result<LeaderItem, LeaseError> {
        tracing::warn!(table = %self.table, %key, %why, "the leader item does not parse; resetting it to released");
        let (condition, values) = match item.get(COUNTER) {
            Some(raw) => ("#counter = :raw", vec![(":raw", raw.clone())]),
            None => ("attribute_not_exists(#counter)", Vec::new()),
        };
        let mut values = values;
        values.push((":one", AttributeValue::N("1".into())));
        self.update(
            "UpdateItem",
            key,
            "SET #counter = :one REMOVE #owner",
            condition,
            values,
        )
        .await
    }
}

/// The leader item stored as `item` under `key`.
fn item_of(key: &str, item: &HashMap<String, AttributeValue>) -> Result<LeaderItem, LeaseError> {
    let counter = match item.get(COUNTER) {
        Some(AttributeValue::N(n)) => n
            .parse()
            .map_err(|e| LeaseError::Corrupt(format!("leader item {key}: {COUNTER} {n:?}: {e}")))?,
        _ => {
            return Err(LeaseError::Corrupt(format!(
                "leader item {key}: no {COUNTER}"
            )))
        }
    };
    let owner = match item.get(OWNER) {
        Some(AttributeValue::S(o)) if !o.is_empty() => Some(o.clone()),
        _ => None,
    };
    Ok(LeaderItem {
        key: key.to_owned(),
        owner,
        counter,
    })
}

#[async_trait]
impl CoordinatorState for DynamoCoordinatorState {
    async fn ensure_table(&self) -> Result<(), LeaseError> {
        // The lease table is the store's own, ensured before.
        if self.place == Place::LeaseTable {
            return Ok(());
        }
        ensure_table(
            "coordinator-state table",
            &self.table,
            || self.describe(),
            || self.create_table(),
        )
        .await?;
        Ok(())
    }

    async fn get(&self, key: &str) -> Result<Option<LeaderItem>, LeaseError> {
        let out = self
            .client
            .get_item()
            .table_name(&self.table)
            .key(self.key_attribute(), AttributeValue::S(self.row_key(key)))
            .send()
            .await
            .map_err(|e| classify(&self.table, "GetItem", Some(key), e))?;
        let Some(item) = out.item else {
            return Ok(None);
        };
        match item_of(key, &item) {
            Err(LeaseError::Corrupt(why)) => self.repair(key, &item, &why).await.map(Some),
            read => read.map(Some),
        }
    }

    async fn claim(
        &self,
        key: &str,
        seen: Option<&LeaderItem>,
        owner: &str,
    ) -> Result<LeaderItem, LeaseError> {
        let me = AttributeValue::S(owner.to_owned());
        match seen {
            None => {
                self.update(
                    "UpdateItem",
                    key,
                    "SET #owner = :me, #counter = :one",
                    "attribute_not_exists(#key)",
                    vec![(":me", me), (":one", AttributeValue::N("1".into()))],
                )
                .await
            }
            Some(seen) => {
                let counter = AttributeValue::N(seen.counter.to_string());
                let next = AttributeValue::N(seen.counter.saturating_add(1).to_string());
                let (condition, mut values) = match &seen.owner {
                    Some(old) => (
                        "#counter = :seen AND #owner = :old",
                        vec![(":old", AttributeValue::S(old.clone()))],
                    ),
                    // Released, as `item_of` reads it: no owner, or one that is not a
                    // non-empty string (cleared by hand).
                    None => (
                        "#counter = :seen AND (attribute_not_exists(#owner) \
                         OR NOT attribute_type(#owner, :string) OR size(#owner) = :zero)",
                        vec![
                            (":string", AttributeValue::S("S".into())),
                            (":zero", AttributeValue::N("0".into())),
                        ],
                    ),
                };
                values.extend([(":me", me), (":seen", counter), (":next", next)]);
                self.update(
                    "UpdateItem",
                    key,
                    "SET #owner = :me, #counter = :next",
                    condition,
                    values,
                )
                .await
            }
        }
    }

    async fn renew(&self, held: &LeaderItem) -> Result<LeaderItem, LeaseError> {
        let Some(owner) = &held.owner else {
            return Err(LeaseError::Conflict(held.key.clone()));
        };
        self.update(
            "UpdateItem",
            &held.key,
            "SET #counter = :next",
            "#owner = :me AND #counter = :seen",
            vec![
                (":me", AttributeValue::S(owner.clone())),
                (":seen", AttributeValue::N(held.counter.to_string())),
                (
                    ":next",
                    AttributeValue::N(held.counter.saturating_add(1).to_string()),
                ),
            ],
        )
        .await
    }

    async fn release(&self, held: &LeaderItem) -> Result<LeaderItem, LeaseError> {
        let Some(owner) = &held.owner else {
            return Err(LeaseError::Conflict(held.key.clone()));
        };
        self.update(
            "UpdateItem",
            &held.key,
            "SET #counter = :next REMOVE #owner",
            "#owner = :me AND #counter = :seen",
            vec![
                (":me", AttributeValue::S(owner.clone())),
                (":seen", AttributeValue::N(held.counter.to_string())),
                (
                    ":next",
                    AttributeValue::N(held.counter.saturating_add(1).to_string()),
                ),
            ],
        )
        .await
    }
}

/// The leader item kept in both places at once ([`LeaderPlacement::Both`]), shown to
/// the coordinator as one item: owned by a worker only when both parts are (its
/// counter the sum of theirs, so it moves when either moves). Claims take the
/// coordinator table's part first, then the lease table's; a worker that loses either
/// part gives the other up.
struct BothPlaces {
    /// The part in `<lease table>-coordinator` (all that earlier versions know).
    legacy: DynamoCoordinatorState,
    /// The part in the lease table.
    row: DynamoCoordinatorState,
    /// The parts as this worker last read or wrote them, per key.
    parts: Mutex<HashMap<String, Parts>>,
}

/// The two parts of one leader item: (coordinator table, lease table).
type Parts = (Option<LeaderItem>, Option<LeaderItem>);

/// The one item the coordinator sees for `parts`: absent when both are; owned by a
/// worker when both parts name it; released when neither has an owner; otherwise an
/// owner made of both (which is nobody's, so nobody leads on it and a take waits for
/// it to stand still).
fn combine(key: &str, parts: &Parts) -> Option<LeaderItem> {
    let (legacy, row) = parts;
    if legacy.is_none() && row.is_none() {
        return None;
    }
    let owner_of = |part: &Option<LeaderItem>| part.as_ref().and_then(|p| p.owner.clone());
    let (a, b) = (owner_of(legacy), owner_of(row));
    let owner = if a == b {
        a
    } else {
        Some(format!(
            "{}+{}",
            a.as_deref().unwrap_or("-"),
            b.as_deref().unwrap_or("-")
        ))
    };
    let counter_of = |part: &Option<LeaderItem>| part.as_ref().map_or(0, |p| p.counter);
    Some(LeaderItem {
        key: key.to_owned(),
        owner,
        counter: counter_of(legacy).saturating_add(counter_of(row)),
    })
}

impl BothPlaces {
    fn parts(&self) -> std::sync::MutexGuard<'_, HashMap<String, Parts>> {
        // Poisoning means a panic elsewhere while holding the lock; the map is whole.
        self.parts.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The parts last seen for `key`, if they still make `item` (same owner).
    fn parts_of(&self, item: &LeaderItem) -> Option<Parts> {
        let parts = self.parts().get(&item.key).cloned()?;
        let combined = combine(&item.key, &parts)?;
        (combined.owner == item.owner).then_some(parts)
    }

    /// Releases `part` if this worker holds it, ignoring the outcome: what is left
    /// behind stands still and is taken over a lease duration later.
    async fn let_go(state: &DynamoCoordinatorState, part: Option<&LeaderItem>) {
        if let Some(part) = part.filter(|p| p.owner.is_some()) {
            if let Err(e) = state.release(part).await {
                tracing::debug!(table = %state.table(), error = %e, "could not release one part of the leader item");
            }
        }
    }
}

#[async_trait]
impl CoordinatorState for BothPlaces {
    async fn ensure_table(&self) -> Result<(), LeaseError> {
        self.legacy.ensure_table().await
    }

    async fn get(&self, key: &str) -> Result<Option<LeaderItem>, LeaseError> {
        let parts = (self.legacy.get(key).await?, self.row.get(key).await?);
        let combined = combine(key, &parts);
        self.parts().insert(key.to_owned(), parts);
        Ok(combined)
    }

    async fn claim(
        &self,
        key: &str,
        seen: Option<&LeaderItem>,
        owner: &str,
    ) -> Result<LeaderItem, LeaseError> {
        let parts = self.parts().get(key).cloned().unwrap_or_default();
        // A claim decided on another view than the last read fails as a write would.
        if combine(key, &parts).as_ref() != seen {
            return Err(LeaseError::Conflict(key.to_owned()));
        }
        let legacy = self.legacy.claim(key, parts.0.as_ref(), owner).await?;
        let row = match self.row.claim(key, parts.1.as_ref(), owner).await {
            Ok(row) => row,
            Err(e) => {
                Self::let_go(&self.legacy, Some(&legacy)).await;
                self.parts().remove(key);
                return Err(e);
            }
        };
        let parts = (Some(legacy), Some(row));
        let combined = combine(key, &parts);
        self.parts().insert(key.to_owned(), parts);
        combined.ok_or_else(|| LeaseError::Conflict(key.to_owned()))
    }

    async fn renew(&self, held: &LeaderItem) -> Result<LeaderItem, LeaseError> {
        let Some((Some(legacy), Some(row))) = self.parts_of(held) else {
            return Err(LeaseError::Conflict(held.key.clone()));
        };
        let legacy_renewed = self.legacy.renew(&legacy).await;
        let row_renewed = self.row.renew(&row).await;
        match (legacy_renewed, row_renewed) {
            (Ok(legacy), Ok(row)) => {
                let parts = (Some(legacy), Some(row));
                let combined = combine(&held.key, &parts);
                self.parts().insert(held.key.clone(), parts);
                combined.ok_or_else(|| LeaseError::Conflict(held.key.clone()))
            }
            // One part taken over: the other is given up, this worker no longer leads.
            (Err(e @ LeaseError::Conflict(_)), row) => {
                if let Ok(row) = row {
                    Self::let_go(&self.row, Some(&row)).await;
                }
                self.parts().remove(&held.key);
                Err(e)
            }
            (legacy, Err(e @ LeaseError::Conflict(_))) => {
                if let Ok(legacy) = legacy {
                    Self::let_go(&self.legacy, Some(&legacy)).await;
                }
                self.parts().remove(&held.key);
                Err(e)
            }
            // Outcome unknown for one part: the landed one is kept, both retried next
            // time (the unknown one on the counter as last seen).
            (Ok(legacy), Err(e)) => {
                self.parts()
                    .insert(held.key.clone(), (Some(legacy), Some(row)));
                Err(e)
            }
            (Err(e), Ok(row)) => {
                self.parts()
                    .insert(held.key.clone(), (Some(legacy), Some(row)));
                Err(e)
            }
            (Err(e), Err(_)) => Err(e),
        }
    }

    async fn release(&self, held: &LeaderItem) -> Result<LeaderItem, LeaseError> {
        let Some((legacy, row)) = self.parts_of(held) else {
            return Err(LeaseError::Conflict(held.key.clone()));
        };
        self.parts().remove(&held.key);
        let legacy = match legacy {
            Some(part) if part.owner.is_some() => self.legacy.release(&part).await.map(Some),
            other => Ok(other),
        };
        let row = match row {
            Some(part) if part.owner.is_some() => self.row.release(&part).await.map(Some),
            other => Ok(other),
        };
        let parts = (legacy?, row?);
        combine(&held.key, &parts).ok_or_else(|| LeaseError::Conflict(held.key.clone()))
    }
}

/// The leader state of a [`DynamoLeaseStore`](super::DynamoLeaseStore): placed on first
/// use (the worker's start-up, right after the lease table is ensured) as its
/// [`LeaderPlacement`] says.
pub(super) struct PlacedState {
    client: aws_sdk_dynamodb::Client,
    lease_table: String,
    placement: LeaderPlacement,
    /// Whether the store created the lease table (a new group).
    created: Arc<AtomicBool>,
    placed: OnceCell<Arc<dyn CoordinatorState>>,
}

impl PlacedState {
    pub(super) fn new(
        client: aws_sdk_dynamodb::Client,
        lease_table: &str,
        placement: LeaderPlacement,
        created: Arc<AtomicBool>,
    ) -> Self {
        PlacedState {
            client,
            lease_table: lease_table.to_owned(),
            placement,
            created,
            placed: OnceCell::new(),
        }
    }

    /// The state, placed on the first call.
    async fn placed(&self) -> Result<&Arc<dyn CoordinatorState>, LeaseError> {
        self.placed.get_or_try_init(|| self.place()).await
    }

    async fn place(&self) -> Result<Arc<dyn CoordinatorState>, LeaseError> {
        let placement = match self.placement {
            LeaderPlacement::Auto => self.choose().await?,
            chosen => chosen,
        };
        let legacy = DynamoCoordinatorState::new(self.client.clone(), &self.lease_table);
        let row = DynamoCoordinatorState::in_lease_table(self.client.clone(), &self.lease_table);
        tracing::info!(table = %self.lease_table, ?placement, "where the group's leader item lives");
        Ok(match placement {
            LeaderPlacement::LeaseTable => {
                row.mark(LEADER_KEY).await?;
                Arc::new(row)
            }
            LeaderPlacement::Both => {
                row.mark(LEADER_KEY).await?;
                Arc::new(BothPlaces {
                    legacy,
                    row,
                    parts: Mutex::new(HashMap::new()),
                })
            }
            LeaderPlacement::CoordinatorTable | LeaderPlacement::Auto => Arc::new(legacy),
        })
    }

    /// [`LeaderPlacement::Auto`]'s choice (see there). A worker that created the table
    /// marks it (the leader row, released) before it writes any lease row, so a peer
    /// that finds lease rows and no leader row knows no worker of this version chose
    /// the lease table for it.
    async fn choose(&self) -> Result<LeaderPlacement, LeaseError> {
        if self.created.load(Ordering::Acquire) {
            return Ok(LeaderPlacement::LeaseTable);
        }
        let table = &self.lease_table;
        let marker = self
            .client
            .get_item()
            .table_name(table)
            .key(LEASE_KEY, AttributeValue::S(LEADER_ROW_KEY.to_owned()))
            .consistent_read(true)
            .send()
            .await
            .map_err(|e| classify(table, "GetItem", None, e))?;
        if marker.item.is_some_and(|item| is_leader_row(&item)) {
            let legacy = DynamoCoordinatorState::new(self.client.clone(), table);
            return Ok(match legacy.describe().await? {
                Some(_) => LeaderPlacement::Both,
                None => LeaderPlacement::LeaseTable,
            });
        }
        // One page of keys is enough to tell a KCL 3.5 table (its rows say what they
        // are) from an older one.
        let page = self
            .client
            .scan()
            .table_name(table)
            .consistent_read(true)
            .projection_expression("#key, #entity, #tm, #cv")
            .expression_attribute_names("#key", LEASE_KEY)
            .expression_attribute_names("#entity", ENTITY_TYPE)
            .expression_attribute_names("#tm", "tm")
            .expression_attribute_names("#cv", "cv")
            .send()
            .await
            .map_err(|e| classify(table, "Scan", None, e))?;
        let rows = page.items();
        // A table in the middle of a KCL migration is refused before anything is
        // written to it (the leader row included): a KCL rolled back to an older
        // version would read every row as a lease. The listing refuses it too, from
        // every page.
        let others: Vec<EntityRow> = rows
            .iter()
            .filter_map(|row| match row_kind(row) {
                RowKind::Other(kind) => Some(entity_from_item(row, kind)),
                RowKind::Lease => None,
            })
            .collect();
        refuse_unfinished_kcl_migration(&self.client, table, &others, true).await?;
        Ok(
            if rows.is_empty() || rows.iter().any(|row| row.contains_key(ENTITY_TYPE)) {
                LeaderPlacement::LeaseTable
            } else {
                LeaderPlacement::CoordinatorTable
            },
        )
    }
}

#[async_trait]
impl CoordinatorState for PlacedState {
    async fn ensure_table(&self) -> Result<(), LeaseError> {
        self.placed().await?.ensure_table().await
    }

    async fn get(&self, key: &str) -> Result<Option<LeaderItem>, LeaseError> {
        self.placed().await?.get(key).await
    }

    async fn claim(
        &self,
        key: &str,
        seen: Option<&LeaderItem>,
        owner: &str,
    ) -> Result<LeaderItem, LeaseError> {
        self.placed().await?.claim(key, seen, owner).await
    }

    async fn renew(&self, held: &LeaderItem) -> Result<LeaderItem, LeaseError> {
        self.placed().await?.renew(held).await
    }

    async fn release(&self, held: &LeaderItem) -> Result<LeaderItem, LeaseError> {
        self.placed().await?.release(held).await
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn part(owner: Option<&str>, counter: u64) -> Option<LeaderItem> {
        Some(LeaderItem {
            key: LEADER_KEY.to_owned(),
            owner: owner.map(str::to_owned),
            counter,
        })
    }

    #[test]
    fn both_places_lead_only_when_both_parts_name_the_same_worker() {
        let owner = |parts: Parts| combine(LEADER_KEY, &parts).and_then(|i| i.owner);
        assert_eq!(combine(LEADER_KEY, &(None, None)), None);
        assert_eq!(
            owner((part(Some("a#1"), 3), part(Some("a#1"), 2))),
            Some("a#1".into())
        );
        // One part of another worker, released or absent: nobody leads on it, and it is
        // not released either (a take waits for it to stand still).
        for parts in [
            (part(Some("a#1"), 3), part(Some("b#1"), 2)),
            (part(Some("a#1"), 3), part(None, 2)),
            (part(Some("a#1"), 3), None),
            (None, part(Some("a#1"), 3)),
        ] {
            let combined = owner(parts.clone());
            assert!(combined.is_some(), "{parts:?}");
            assert_ne!(combined.as_deref(), Some("a#1"), "{parts:?}");
        }
        assert_eq!(owner((part(None, 3), None)), None);
        assert_eq!(owner((part(None, 3), part(None, 0))), None);
    }

    #[test]
    fn both_places_move_when_either_part_moves() {
        let counter = |parts: Parts| combine(LEADER_KEY, &parts).map(|i| i.counter);
        let before = counter((part(Some("a#1"), 3), part(Some("a#1"), 2)));
        assert_ne!(
            before,
            counter((part(Some("a#1"), 4), part(Some("a#1"), 2)))
        );
        assert_ne!(
            before,
            counter((part(Some("a#1"), 3), part(Some("a#1"), 3)))
        );
    }

    #[test]
    fn only_shardflow_leader_rows_are_leader_rows() {
        let row = |entity: Option<&str>| {
            let mut item = HashMap::from([(
                LEASE_KEY.to_owned(),
                AttributeValue::S(LEADER_ROW_KEY.to_owned()),
            )]);
            if let Some(entity) = entity {
                item.insert(ENTITY_TYPE.to_owned(), AttributeValue::S(entity.to_owned()));
            }
            item
        };
        assert!(is_leader_row(&row(Some(LEADER_ENTITY_TYPE))));
        assert!(!is_leader_row(&row(None)));
        assert!(!is_leader_row(&row(Some("LEASE"))));
        assert!(!is_leader_row(&row(Some("LEADER"))));
        // `group delete` deletes the group's own rows with it.
        assert!(LEADER_ENTITY_TYPE.starts_with(crate::lease::entity::SHARDFLOW_ENTITY_PREFIX));
    }
}
