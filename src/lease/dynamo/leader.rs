//! The coordinator-state table in DynamoDB: where [`DynamoLeaseStore`](super::DynamoLeaseStore)
//! keeps the leader items of its lease table (see [`crate::lease::leader`]), in a table of its
//! own named `<lease table>-coordinator` (as the KCL 3 keeps its leader election in a
//! `-CoordinatorState` table), so that no KCL worker sharing the lease table lists a
//! leader item as a shard. Created on demand (on-demand capacity, hash key `key`) like
//! the lease table.
//!
//! | call | write (condition: the item as last seen) |
//! |---|---|
//! | `claim` | `SET leaderOwner = me, leaderCounter = seen + 1` if `leaderCounter = seen` (and `leaderOwner` as seen), or if the item does not exist |
//! | `renew` | `SET leaderCounter = counter + 1` if `leaderOwner = me AND leaderCounter = counter` |
//! | `release` | `SET leaderCounter = counter + 1 REMOVE leaderOwner`, same condition |
//!
//! `get` is eventually consistent (half a read unit): a stale answer can only delay
//! seeing the counter move, and a take-over decided on it fails its condition.

use std::collections::HashMap;

use async_trait::async_trait;
use aws_sdk_dynamodb::error::ProvideErrorMetadata;
use aws_sdk_dynamodb::types::{
    AttributeDefinition, AttributeValue, ScalarAttributeType, TableDescription,
};

use super::classify;
use super::table::{build_error, create_table, ensure_table};
use crate::lease::leader::{CoordinatorState, LeaderItem};
use crate::lease::LeaseError;

/// The hash key of the coordinator-state table.
const KEY: &str = "key";
/// The leader's owner string (absent once released).
const OWNER: &str = "leaderOwner";
/// The fencing token.
const COUNTER: &str = "leaderCounter";

/// The name of the coordinator-state table beside the lease table `lease_table`.
pub fn coordinator_table(lease_table: &str) -> String {
    format!("{lease_table}-coordinator")
}

/// Leader items in the DynamoDB table `<lease table>-coordinator`.
pub struct DynamoCoordinatorState {
    client: aws_sdk_dynamodb::Client,
    table: String,
}

impl DynamoCoordinatorState {
    /// The coordinator-state table beside the lease table `lease_table`.
    pub fn new(client: aws_sdk_dynamodb::Client, lease_table: &str) -> Self {
        DynamoCoordinatorState {
            client,
            table: coordinator_table(lease_table),
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

    /// A conditional UpdateItem of the item `key`, returning the item as written.
    async fn update(
        &self,
        op: &str,
        key: &str,
        update: &str,
        condition: &str,
        values: Vec<(&str, AttributeValue)>,
    ) -> Result<LeaderItem, LeaseError> {
        let mut request = self
            .client
            .update_item()
            .table_name(&self.table)
            .key(KEY, AttributeValue::S(key.to_owned()))
            .update_expression(update)
            .condition_expression(condition)
            .expression_attribute_names("#owner", OWNER)
            .expression_attribute_names("#counter", COUNTER)
            .return_values(aws_sdk_dynamodb::types::ReturnValue::AllNew);
        if condition.contains("#key") {
            request = request.expression_attribute_names("#key", KEY);
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
            .key(KEY, AttributeValue::S(key.to_owned()))
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
