//! What `dlq replay` already re-published, kept in a DynamoDB item so that a rerun (after
//! a refused write, a crash or a `--limit`) continues where the last run stopped instead
//! of publishing the same dead letters again.
//!
//! A dead letter is named by where it is in the dead-letter stream: its shard and the
//! position of the record that completed it (its last part). Per shard the item keeps a
//! *through* position (every dead letter of the shard up to it was re-published) and the
//! few positions beyond it that were re-published out of order (other keys went ahead
//! of a slow or failed one); a replay admits at most [`WINDOW`] dead letters beyond the
//! oldest unfinished one, so that set stays small and the item far below DynamoDB's
//! 400 KB.

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use aws_sdk_dynamodb::error::{DisplayErrorContext, ProvideErrorMetadata};
use aws_sdk_dynamodb::types::{
    AttributeDefinition, AttributeValue, BillingMode, KeySchemaElement, KeyType,
    ScalarAttributeType, TableStatus,
};
use serde_json::{json, Value};
use shardflow::{Position, SequenceNumber};

use crate::CliError;

/// The most dead letters a replay has handed over beyond the oldest one not yet
/// re-published.
pub const WINDOW: usize = 1000;

/// The table's key attribute: `<dead-letter stream> -> <target stream>`.
const KEY: &str = "replay";
/// The attribute holding the progress (JSON).
const STATE: &str = "progress";
/// The attribute counting writes (each write is conditional on the one read).
const REVISION: &str = "revision";

/// How long a new table may take to become active.
const TABLE_ACTIVE_LIMIT: Duration = Duration::from_secs(60);

/// A dead letter's name: the dead-letter stream's shard and the position of the record
/// that completed it.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct LetterId {
    /// The dead-letter stream's shard.
    pub shard: String,
    /// The position of the dead letter's last part.
    pub position: Position,
}

/// The dead letters a replay of one stream into another has re-published.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Replayed {
    /// Per shard: every dead letter up to this position was re-published.
    through: BTreeMap<String, Position>,
    /// Re-published dead letters beyond their shard's `through`.
    beyond: BTreeSet<LetterId>,
}

impl Replayed {
    /// Whether the dead letter was re-published already.
    pub fn covers(&self, id: &LetterId) -> bool {
        self.through
            .get(&id.shard)
            .is_some_and(|through| id.position <= *through)
            || self.beyond.contains(id)
    }

    /// Notes that the dead letter was re-published.
    pub fn mark(&mut self, id: LetterId) {
        if !self.covers(&id) {
            self.beyond.insert(id);
        }
    }

    /// Moves each shard's `through` over the re-published dead letters at its front.
    /// `read` lists every dead letter this run read, per shard in stream order, covered
    /// ones included.
    pub fn compact(&mut self, read: &[LetterId]) {
        let mut blocked: BTreeSet<&str> = BTreeSet::new();
        for id in read {
            if blocked.contains(id.shard.as_str()) {
                continue;
            }
            if self.covers(id) {
                self.beyond.remove(id);
                let through = self
                    .through
                    .entry(id.shard.clone())
                    .or_insert_with(|| id.position.clone());
                if *through < id.position {
                    *through = id.position.clone();
                }
            } else {
                blocked.insert(id.shard.as_str());
            }
        }
    }

    /// Re-published dead letters beyond their shard's front (what compaction could not
    /// fold in).
    #[cfg(test)]
    pub fn beyond(&self) -> usize {
        self.beyond.len()
    }

    fn to_json(&self) -> Value {
        let position = |p: &Position| json!([p.sequence.as_str(), p.sub_sequence]);
        json!({
            "through": self
                .through
                .iter()
                .map(|(shard, p)| (shard.clone(), position(p)))
                .collect::<serde_json::Map<_, _>>(),
            "beyond": self
                .beyond
                .iter()
                .map(|id| json!([id.shard, id.position.sequence.as_str(), id.position.sub_sequence]))
                .collect::<Vec<_>>(),
        })
    }

    fn from_json(value: &Value) -> Option<Replayed> {
        let position = |sequence: &Value, sub: &Value| {
            Some(Position::new(
                SequenceNumber::new(sequence.as_str()?).ok()?,
                sub.as_u64()?,
            ))
        };
        let mut replayed = Replayed::default();
        for (shard, p) in value.get("through")?.as_object()? {
            let p = p.as_array()?;
            replayed
                .through
                .insert(shard.clone(), position(p.first()?, p.get(1)?)?);
        }
        for id in value.get("beyond")?.as_array()? {
            let id = id.as_array()?;
            replayed.beyond.insert(LetterId {
                shard: id.first()?.as_str()?.to_owned(),
                position: position(id.get(1)?, id.get(2)?)?,
            });
        }
        Some(replayed)
    }
}

/// The item of one replay (a dead-letter stream into a target stream) in the progress
/// table. Writes are conditional on the revision read, so two replays of the same pair
/// running at once cannot both record progress: the second one's write is refused.
pub struct ProgressItem {
    client: aws_sdk_dynamodb::Client,
    table: String,
    key: String,
    /// The revision read (`None`: no item).
    revision: Option<u64>,
}

impl ProgressItem {
    /// The item of the replay of `from` into `to` in `table`.
    pub fn new(client: aws_sdk_dynamodb::Client, table: &str, from: &str, to: &str) -> Self {
        ProgressItem {
            client,
            table: table.to_owned(),
            key: format!("{from} -> {to}"),
            revision: None,
        }
    }

    /// Reads the progress (nothing re-published when the table or the item is missing).
    pub async fn load(&mut self) -> Result<Replayed, CliError> {
        let out = match self
            .client
            .get_item()
            .table_name(&self.table)
            .key(KEY, AttributeValue::S(self.key.clone()))
            .consistent_read(true)
            .send()
            .await
        {
            Ok(out) => out,
            Err(e) if e.code() == Some("ResourceNotFoundException") => {
                self.revision = None;
                return Ok(Replayed::default());
            }
            Err(e) => return Err(self.error("GetItem", e)),
        };
        let Some(item) = out.item else {
            self.revision = None;
            return Ok(Replayed::default());
        };
        let revision = item
            .get(REVISION)
            .and_then(|v| v.as_n().ok())
            .and_then(|n| n.parse::<u64>().ok());
        let state = item
            .get(STATE)
            .and_then(|v| v.as_s().ok())
            .and_then(|s| serde_json::from_str::<Value>(s).ok())
            .and_then(|v| Replayed::from_json(&v));
        match (revision, state) {
            (Some(revision), Some(state)) => {
                self.revision = Some(revision);
                Ok(state)
            }
            _ => Err(format!(
                "the replay progress item {:?} in table {} does not parse; delete it (or run with --restart) to replay from the start",
                self.key, self.table
            )
            .into()),
        }
    }

    /// Writes the progress, creating the table on first use. Refused when another run
    /// wrote the item since it was read.
    pub async fn save(&mut self, state: &Replayed) -> Result<(), CliError> {
        match self.put(state).await {
            Err(e) if e.code() == Some("ResourceNotFoundException") => {
                self.create_table().await?;
                self.put(state).await.map_err(|e| self.put_error(e))?;
            }
            Err(e) => return Err(self.put_error(e)),
            Ok(_) => {}
        }
        self.revision = Some(self.revision.map_or(1, |r| r + 1));
        Ok(())
    }

    /// Deletes the item (`--restart`), whatever its revision.
    pub async fn clear(&mut self) -> Result<(), CliError> {
        match self
            .client
            .delete_item()
            .table_name(&self.table)
            .key(KEY, AttributeValue::S(self.key.clone()))
            .send()
            .await
        {
            Ok(_) => {}
            Err(e) if e.code() == Some("ResourceNotFoundException") => {}
            Err(e) => return Err(self.error("DeleteItem", e)),
        }
        self.revision = None;
        Ok(())
    }

    async fn put(
        &self,
        state: &Replayed,
    ) -> Result<
        aws_sdk_dynamodb::operation::put_item::PutItemOutput,
        aws_sdk_dynamodb::error::SdkError<aws_sdk_dynamodb::operation::put_item::PutItemError>,
    > {
        let next = self.revision.map_or(1, |r| r + 1);
        let request = self
            .client
            .put_item()
            .table_name(&self.table)
            .item(KEY, AttributeValue::S(self.key.clone()))
            .item(STATE, AttributeValue::S(state.to_json().to_string()))
            .item(REVISION, AttributeValue::N(next.to_string()));
        let request = match self.revision {
            None => request
                .condition_expression("attribute_not_exists(#key)")
                .expression_attribute_names("#key", KEY),
            Some(read) => request
                .condition_expression("#rev = :read")
                .expression_attribute_names("#rev", REVISION)
                .expression_attribute_values(":read", AttributeValue::N(read.to_string())),
        };
        request.send().await
    }

    fn put_error(
        &self,
        e: aws_sdk_dynamodb::error::SdkError<aws_sdk_dynamodb::operation::put_item::PutItemError>,
    ) -> CliError {
        if e.code() == Some("ConditionalCheckFailedException") {
            format!(
                "another replay of {} recorded progress meanwhile (table {}): only one replay of a stream into another may run at once",
                self.key, self.table
            )
            .into()
        } else {
            self.error("PutItem", e)
        }
    }

    fn error<E: std::error::Error + Send + Sync + 'static>(&self, op: &str, e: E) -> CliError {
        format!("{op} {}: {}", self.table, DisplayErrorContext(e)).into()
    }

    /// Creates the table (on-demand capacity; a concurrent creation is fine) and waits
    /// until it is active.
    async fn create_table(&self) -> Result<(), CliError> {
        let build = |e: aws_sdk_dynamodb::error::BuildError| -> CliError {
            format!("CreateTable: {}", DisplayErrorContext(e)).into()
        };
        let created = self
            .client
            .create_table()
            .table_name(&self.table)
            .attribute_definitions(
                AttributeDefinition::builder()
                    .attribute_name(KEY)
                    .attribute_type(ScalarAttributeType::S)
                    .build()
                    .map_err(build)?,
            )
            .key_schema(
                KeySchemaElement::builder()
                    .attribute_name(KEY)
                    .key_type(KeyType::Hash)
                    .build()
                    .map_err(build)?,
            )
            .billing_mode(BillingMode::PayPerRequest)
            .send()
            .await;
        match created {
            Ok(_) => {}
            Err(e) if e.code() == Some("ResourceInUseException") => {}
            Err(e) => return Err(self.error("CreateTable", e)),
        }
        let active = async {
            loop {
                let out = self
                    .client
                    .describe_table()
                    .table_name(&self.table)
                    .send()
                    .await
                    .map_err(|e| self.error("DescribeTable", e))?;
                if out.table.and_then(|t| t.table_status) == Some(TableStatus::Active) {
                    return Ok::<(), CliError>(());
                }
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
        };
        tokio::time::timeout(TABLE_ACTIVE_LIMIT, active)
            .await
            .map_err(|_| -> CliError {
                format!(
                    "table {} did not become active within {} s",
                    self.table,
                    TABLE_ACTIVE_LIMIT.as_secs()
                )
                .into()
            })?
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn id(shard: &str, seq: u64) -> LetterId {
        LetterId {
            shard: shard.into(),
            position: Position::new(SequenceNumber::from(seq), 0),
        }
    }

    #[test]
    fn compaction_folds_the_front_and_keeps_what_is_beyond_a_gap() {
        let read = [id("a", 1), id("a", 2), id("a", 3), id("b", 5), id("b", 6)];
        let mut replayed = Replayed::default();
        for done in [id("a", 1), id("a", 3), id("b", 5), id("b", 6)] {
            replayed.mark(done);
        }
        replayed.compact(&read);
        assert!(replayed.covers(&id("a", 1)) && replayed.covers(&id("a", 3)));
        assert!(!replayed.covers(&id("a", 2)), "the gap stays open");
        assert_eq!(replayed.beyond(), 1, "only a/3 waits beyond the gap");
        let back = Replayed::from_json(&replayed.to_json()).expect("parses");
        assert_eq!(back, replayed);
        replayed.mark(id("a", 2));
        replayed.compact(&read);
        assert_eq!(replayed.beyond(), 0);
        assert!(!replayed.covers(&id("a", 4)), "a later dead letter is new");
    }
}
