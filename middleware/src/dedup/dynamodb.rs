//! [`DynamoDedupStore`]: the dedup keys in a DynamoDB table, shared by every consumer
//! of one group.
//!
//! Use one table per consumer group. A key done by one group reads as done to every
//! other user of the table, so a second group sharing it would skip records it never
//! handled; to share a table anyway, give each group's
//! [`DedupLayer`](super::DedupLayer) its own [`namespace`](super::DedupLayer::namespace).
//!
//! Table layout (one item per key):
//!
//! | attribute | type | meaning |
//! |---|---|---|
//! | `dedupKey` | S (hash key) | the dedup key |
//! | `status` | S | `in_progress` or `done` |
//! | `token` | S | the reservation's token (in progress only) |
//! | `expiresAt` | N | epoch seconds after which the item counts as absent; also the table's TTL attribute |
//!
//! Every write is conditional, so two consumers racing on one key cannot both reserve
//! it. DynamoDB's TTL deletes expired items lazily (within days); the conditions treat
//! an expired item as absent right away, so the TTL only bounds storage.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use async_trait::async_trait;
use aws_sdk_dynamodb::error::{DisplayErrorContext, ProvideErrorMetadata};
use aws_sdk_dynamodb::operation::put_item::PutItemError;
use aws_sdk_dynamodb::types::{
    AttributeDefinition, AttributeValue, BillingMode, KeySchemaElement, KeyType, ReturnValue,
    ReturnValuesOnConditionCheckFailure, ScalarAttributeType, TableStatus, TimeToLiveSpecification,
};
use aws_sdk_dynamodb::Client;

use super::store::{Commit, DedupStore, Reservation, StoreError};

const KEY: &str = "dedupKey";
const STATUS: &str = "status";
const TOKEN: &str = "token";
const EXPIRES_AT: &str = "expiresAt";
const IN_PROGRESS: &str = "in_progress";
const DONE: &str = "done";

/// A [`DedupStore`] in a DynamoDB table (see the module docs for the layout).
///
/// Create the table with [`ensure_table`](DynamoDedupStore::ensure_table) or your own
/// infrastructure code (hash key `dedupKey` of type S, TTL on `expiresAt`). One table
/// per consumer group, unless each group's layer has its own
/// [`namespace`](super::DedupLayer::namespace).
#[derive(Clone, Debug)]
pub struct DynamoDedupStore {
    client: Client,
    table: Arc<str>,
}

impl DynamoDedupStore {
    /// A store in `table`, through the DynamoDB client of `aws`.
    pub fn new(aws: &shardflow::Aws, table: impl Into<Arc<str>>) -> Self {
        Self::from_client(aws.dynamodb_client().clone(), table)
    }

    /// A store in `table`, through `client`.
    pub fn from_client(client: Client, table: impl Into<Arc<str>>) -> Self {
        DynamoDedupStore {
            client,
            table: table.into(),
        }
    }

    /// The table's name.
    pub fn table(&self) -> &str {
        &self.table
    }

    /// Creates the table if it does not exist (on-demand capacity), waits until it is
    /// active, and turns on TTL for `expiresAt`.
    ///
    /// A backend that does not implement `UpdateTimeToLive` (dynalite answers
    /// `UnknownOperationException`) gets a warning, not an error: expired items are still
    /// treated as absent, they are just not deleted.
    pub async fn ensure_table(&self) -> Result<(), StoreError> {
        let created = self
            .client
            .create_table()
            .table_name(&*self.table)
            .attribute_definitions(
                AttributeDefinition::builder()
                    .attribute_name(KEY)
                    .attribute_type(ScalarAttributeType::S)
                    .build()
                    .map_err(|e| backend("create the table", e))?,
            )
            .key_schema(
                KeySchemaElement::builder()
                    .attribute_name(KEY)
                    .key_type(KeyType::Hash)
                    .build()
                    .map_err(|e| backend("create the table", e))?,
            )
            .billing_mode(BillingMode::PayPerRequest)
            .send()
            .await;
        match created {
            Ok(_) => tracing::info!(table = %self.table, "created the dedup table"),
            Err(e)
                if e.as_service_error()
                    .is_some_and(|s| s.is_resource_in_use_exception()) => {}
            Err(e) => return Err(sdk("create the table", e)),
        }
        self.wait_until_active().await?;
        self.enable_ttl().await
    }

    async fn wait_until_active(&self) -> Result<(), StoreError> {
        // Tables take a moment to create; 60 s covers DynamoDB and the emulators.
        for _ in 0..300 {
            let described = self
                .client
                .describe_table()
                .table_name(&*self.table)
                .send()
                .await
                .map_err(|e| sdk("describe the table", e))?;
            if described.table().and_then(|t| t.table_status()) == Some(&TableStatus::Active) {
                return Ok(());
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
        Err(backend(
            "wait for the table",
            format!("table {} did not become active within 60 s", self.table),
        ))
    }

    async fn enable_ttl(&self) -> Result<(), StoreError> {
        let spec = TimeToLiveSpecification::builder()
            .enabled(true)
            .attribute_name(EXPIRES_AT)
            .build()
            .map_err(|e| backend("enable TTL", e))?;
        let result = self
            .client
            .update_time_to_live()
            .table_name(&*self.table)
            .time_to_live_specification(spec)
            .send()
            .await;
        match result {
            Ok(_) => Ok(()),
            Err(e)
                if e.code().is_some_and(|c| {
                    c == "UnknownOperation" || c == "UnknownOperationException"
                }) =>
            {
                tracing::warn!(
                    table = %self.table,
                    "the backend does not support UpdateTimeToLive: expired dedup keys are \
                     ignored but not deleted",
                );
                Ok(())
            }
            Err(e)
                if e.code() == Some("ValidationException")
                    && e.message().is_some_and(|m| m.contains("already enabled")) =>
            {
                Ok(())
            }
            Err(e) => Err(sdk("enable TTL", e)),
        }
    }

    fn key(&self, key: &str) -> (String, AttributeValue) {
        (KEY.to_owned(), AttributeValue::S(key.to_owned()))
    }

    /// The state of `key` for the reservation `token`, as a consistent read sees it;
    /// `None` when absent or expired.
    async fn read(&self, key: &str, token: &str) -> Result<Option<Reservation>, StoreError> {
        let (name, value) = self.key(key);
        let out = self
            .client
            .get_item()
            .table_name(&*self.table)
            .key(name, value)
            .consistent_read(true)
            .send()
            .await
            .map_err(|e| sdk("reserve", e))?;
        Ok(out
            .item()
            .and_then(|item| state_of(item, now_secs(), token)))
    }
}

/// What an item says to the reservation `token`, at `now` (epoch seconds); `None` when
/// it has expired.
///
/// An item in progress under our own `token` is our reservation: the SDK retried a
/// put whose first reply was lost, and the retry's condition failed against what the
/// first attempt wrote. Reading it as in progress would stall the record until the
/// reservation expired.
fn state_of(item: &HashMap<String, AttributeValue>, now: u64, token: &str) -> Option<Reservation> {
    let expires = item
        .get(EXPIRES_AT)
        .and_then(|v| v.as_n().ok())
        .and_then(|n| n.parse::<u64>().ok())?;
    if expires < now {
        return None;
    }
    match item
        .get(STATUS)
        .and_then(|v| v.as_s().ok())
        .map(String::as_str)
    {
        Some(DONE) => Some(Reservation::Done),
        Some(_)
            if item
                .get(TOKEN)
                .and_then(|v| v.as_s().ok())
                .map(String::as_str)
                == Some(token) =>
        {
            Some(Reservation::Reserved)
        }
        Some(_) => Some(Reservation::InProgress),
        None => None,
    }
}

#[async_trait]
impl DedupStore for DynamoDedupStore {
    async fn reserve(
        &self,
        key: &str,
        token: &str,
        ttl: Duration,
    ) -> Result<Reservation, StoreError> {
        // A key released between our failed put and our read is free again: try again,
        // a few times, then report it as in progress (the caller waits and re-checks).
        for _ in 0..3 {
            let now = now_secs();
            let (name, value) = self.key(key);
            let put = self
                .client
                .put_item()
                .table_name(&*self.table)
                .item(name, value)
                .item(STATUS, AttributeValue::S(IN_PROGRESS.to_owned()))
                .item(TOKEN, AttributeValue::S(token.to_owned()))
                .item(EXPIRES_AT, number(expiry_secs(ttl)))
                .condition_expression("attribute_not_exists(#k) OR #e < :now")
                .expression_attribute_names("#k", KEY)
                .expression_attribute_names("#e", EXPIRES_AT)
                .expression_attribute_values(":now", number(now))
                .return_values_on_condition_check_failure(
                    ReturnValuesOnConditionCheckFailure::AllOld,
                )
                .send()
                .await;
            let failure = match put {
                Ok(_) => return Ok(Reservation::Reserved),
                Err(e) => e,
            };
            let Some(held) = failure
                .as_service_error()
                .filter(|s| s.is_conditional_check_failed_exception())
            else {
                return Err(sdk("reserve", failure));
            };
            // DynamoDB returns the item that failed the condition; emulators may not.
            let returned = match held {
                PutItemError::ConditionalCheckFailedException(c) => c.item(),
                _ => None,
            };
            let state = match returned {
                Some(item) => state_of(item, now, token),
                None => self.read(key, token).await?,
            };
            if let Some(state) = state {
                return Ok(state);
            }
        }
        Ok(Reservation::InProgress)
    }

    async fn commit(&self, key: &str, token: &str, ttl: Duration) -> Result<Commit, StoreError> {
        let (name, value) = self.key(key);
        let out = self
            .client
            .update_item()
            .table_name(&*self.table)
            .key(name, value)
            .update_expression("SET #s = :done, #e = :exp REMOVE #t")
            .expression_attribute_names("#s", STATUS)
            .expression_attribute_names("#e", EXPIRES_AT)
            .expression_attribute_names("#t", TOKEN)
            .expression_attribute_values(":done", AttributeValue::S(DONE.to_owned()))
            .expression_attribute_values(":exp", number(expiry_secs(ttl)))
            .return_values(ReturnValue::AllOld)
            .send()
            .await
            .map_err(|e| sdk("commit", e))?;
        let ours = out.attributes().is_some_and(|old| {
            old.get(TOKEN)
                .and_then(|v| v.as_s().ok())
                .map(String::as_str)
                == Some(token)
        });
        Ok(if ours {
            Commit::Committed
        } else {
            Commit::Overtaken
        })
    }

    async fn release(&self, key: &str, token: &str) -> Result<(), StoreError> {
        let (name, value) = self.key(key);
        let deleted = self
            .client
            .delete_item()
            .table_name(&*self.table)
            .key(name, value)
            .condition_expression("#t = :t")
            .expression_attribute_names("#t", TOKEN)
            .expression_attribute_values(":t", AttributeValue::S(token.to_owned()))
            .send()
            .await;
        match deleted {
            Ok(_) => Ok(()),
            // Not our reservation any more (expired and taken, or already done).
            Err(e)
                if e.as_service_error()
                    .is_some_and(|s| s.is_conditional_check_failed_exception()) =>
            {
                Ok(())
            }
            Err(e) => Err(sdk("release", e)),
        }
    }
}

fn now_secs() -> u64 {
    // A clock before 1970 reads as 0: every item then looks unexpired, which can only
    // make the store more careful (wait instead of re-handle).
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

/// Epoch seconds at which an entry written now with `ttl` expires, rounded up so an
/// entry never expires early.
fn expiry_secs(ttl: Duration) -> u64 {
    let now = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap_or(Duration::ZERO);
    let at = now.saturating_add(ttl);
    at.as_secs() + u64::from(at.subsec_nanos() > 0)
}

fn number(n: u64) -> AttributeValue {
    AttributeValue::N(n.to_string())
}

fn backend(operation: &'static str, error: impl Into<crate::BoxError>) -> StoreError {
    StoreError::Backend {
        operation,
        source: error.into(),
    }
}

/// SDK errors print as "service error" alone; keep the whole context in the message.
fn sdk<E>(operation: &'static str, error: E) -> StoreError
where
    E: std::error::Error + Send + Sync + 'static,
{
    backend(operation, DisplayErrorContext(error).to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn item(status: &str, expires: u64) -> HashMap<String, AttributeValue> {
        HashMap::from([
            (STATUS.to_owned(), AttributeValue::S(status.to_owned())),
            (TOKEN.to_owned(), AttributeValue::S("theirs".to_owned())),
            (EXPIRES_AT.to_owned(), number(expires)),
        ])
    }

    #[test]
    fn items_read_as_states_until_they_expire() {
        assert_eq!(
            state_of(&item(DONE, 100), 100, "ours"),
            Some(Reservation::Done)
        );
        assert_eq!(
            state_of(&item(IN_PROGRESS, 100), 99, "ours"),
            Some(Reservation::InProgress)
        );
        assert_eq!(state_of(&item(DONE, 100), 101, "ours"), None);
        assert_eq!(state_of(&HashMap::new(), 1, "ours"), None);
    }

    #[test]
    fn our_own_reservation_reads_as_reserved() {
        // What a retried put finds when the first attempt's reply was lost.
        assert_eq!(
            state_of(&item(IN_PROGRESS, 100), 99, "theirs"),
            Some(Reservation::Reserved)
        );
        // Done is done, whoever's token it was.
        assert_eq!(
            state_of(&item(DONE, 100), 99, "theirs"),
            Some(Reservation::Done)
        );
        assert_eq!(state_of(&item(IN_PROGRESS, 100), 101, "theirs"), None);
    }

    #[test]
    fn expiry_rounds_up() {
        let now = now_secs();
        let at = expiry_secs(Duration::from_millis(1500));
        assert!(at >= now + 2 && at <= now + 3, "{at} vs {now}");
    }
}
