//! The lease table itself: created on demand with the owner index, upgraded in place
//! when it has none, and the helpers the coordinator-state table shares (create, wait
//! until ACTIVE).

use std::collections::HashMap;
use std::future::Future;
use std::time::Duration;

use aws_sdk_dynamodb::error::{BuildError, DisplayErrorContext, ProvideErrorMetadata, SdkError};
use aws_sdk_dynamodb::types::{
    AttributeDefinition, AttributeValue, BillingMode, CreateGlobalSecondaryIndexAction,
    GlobalSecondaryIndex, GlobalSecondaryIndexUpdate, IndexStatus, KeySchemaElement, KeyType,
    Projection, ProjectionType, ProvisionedThroughput, ScalarAttributeType, TableDescription,
    TableStatus,
};

use super::codec::{KEY, OWNER};
use super::{classify, DynamoLeaseStore};
use crate::backoff::DeadlinePoll;
use crate::lease::LeaseError;

/// How long [`ensure_table`] waits for a table (the lease table, the coordinator-state
/// table) to become ACTIVE.
pub(super) const ACTIVE_WAIT: Duration = Duration::from_secs(60);

/// The KCL 3's index of the keys by owner (see the [module docs](super)).
pub const OWNER_INDEX: &str = "LeaseOwnerToLeaseKeyIndex";

/// How often `owned_keys` asks again whether an index being added is ACTIVE yet.
const INDEX_RECHECK: Duration = Duration::from_secs(60);

/// What the store knows of the owner index.
#[derive(Debug, Default)]
pub(super) struct IndexState {
    /// The index is ACTIVE: `owned_keys` queries it.
    active: bool,
    /// When the table was last described (not at all yet: `None`).
    checked: Option<tokio::time::Instant>,
}

impl DynamoLeaseStore {
    fn index_state(&self) -> std::sync::MutexGuard<'_, IndexState> {
        // Poisoning means a panic elsewhere while holding the lock; the state is whole.
        self.index.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Records what `table` says of the owner index; returns its status (`None`: the
    /// table has no such index).
    pub(super) fn note_index(&self, table: &TableDescription) -> Option<IndexStatus> {
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
    pub(super) async fn add_index(&self, table: &TableDescription) {
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
    pub(super) async fn index_ready(&self) -> bool {
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
    pub(super) async fn query_owner_index(
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

    /// The table, or `None` when it does not exist. Fails when the table exists with
    /// another key than `leaseKey` (it is some other table).
    pub(super) async fn describe(&self) -> Result<Option<TableDescription>, LeaseError> {
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

    /// Creates the table with the owner index (on-demand capacity); a concurrent
    /// creation is not an error.
    pub(super) async fn create_table(&self) -> Result<(), LeaseError> {
        let index = GlobalSecondaryIndex::builder()
            .index_name(OWNER_INDEX)
            .set_key_schema(Some(owner_index_keys()))
            .projection(owner_index_projection())
            .build()
            .map_err(build_error)?;
        create_table(
            &self.client,
            &self.table,
            "lease table",
            KEY,
            owner_index_attributes(),
            Some(index),
        )
        .await?;
        self.created
            .store(true, std::sync::atomic::Ordering::Release);
        Ok(())
    }

    /// The owner index could not be queried: `owned_keys` lists the table, and looks at
    /// the index again after [`INDEX_RECHECK`].
    pub(super) fn index_unusable(&self) {
        let mut state = self.index_state();
        state.active = false;
        state.checked = Some(tokio::time::Instant::now());
    }
}

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

/// The attributes the table and its owner index are keyed on: `leaseKey` and
/// `leaseOwner`, strings.
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

/// Waits until `table` (the `what`, for errors: "lease table") is usable, for
/// [`ACTIVE_WAIT`] at most: ACTIVE, or UPDATING (an index being added, by a peer's
/// upgrade: usable for data all along, as DynamoDB documents it; waiting would hold the
/// worker's start-up for as long as the index takes to build). `describe` looks at the
/// table (`None`: it does not exist); `create` creates it, once. Returns the table as
/// described then.
pub(super) async fn ensure_table<D, C>(
    what: &str,
    table: &str,
    describe: impl Fn() -> D,
    create: impl Fn() -> C,
) -> Result<TableDescription, LeaseError>
where
    D: Future<Output = Result<Option<TableDescription>, LeaseError>>,
    C: Future<Output = Result<(), LeaseError>>,
{
    let mut poll = DeadlinePoll::new(
        ACTIVE_WAIT,
        Duration::from_millis(25),
        Duration::from_millis(250),
    );
    let mut created = false;
    loop {
        match describe().await {
            Ok(Some(t))
                if matches!(
                    t.table_status(),
                    Some(&TableStatus::Active | &TableStatus::Updating)
                ) =>
            {
                return Ok(t)
            }
            Ok(None) if !created => {
                create().await?;
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
                    "{what} {table} not ACTIVE after {} s",
                    ACTIVE_WAIT.as_secs()
                )
                .into(),
            ));
        }
    }
}

/// Creates `table` (the `what`, for the log: "lease table") with on-demand capacity,
/// the string hash key `key`, the `attributes` the key and the index are on, and
/// `index` if any; a concurrent creation is not an error.
pub(super) async fn create_table(
    client: &aws_sdk_dynamodb::Client,
    table: &str,
    what: &str,
    key: &str,
    attributes: Vec<AttributeDefinition>,
    index: Option<GlobalSecondaryIndex>,
) -> Result<(), LeaseError> {
    let result = client
        .create_table()
        .table_name(table)
        .set_attribute_definitions(Some(attributes))
        .set_global_secondary_indexes(index.map(|index| vec![index]))
        .key_schema(
            KeySchemaElement::builder()
                .attribute_name(key)
                .key_type(KeyType::Hash)
                .build()
                .map_err(build_error)?,
        )
        .billing_mode(BillingMode::PayPerRequest)
        .send()
        .await;
    match result {
        Ok(_) => {
            tracing::info!(%table, "created the {what}");
            Ok(())
        }
        Err(e) if e.code() == Some("ResourceInUseException") => Ok(()),
        Err(e) => Err(classify(table, "CreateTable", None, e)),
    }
}

/// A request that could not be built, as the error of a `CreateTable`.
pub(super) fn build_error(e: BuildError) -> LeaseError {
    LeaseError::Other(format!("CreateTable: {}", DisplayErrorContext(&e)).into())
}
