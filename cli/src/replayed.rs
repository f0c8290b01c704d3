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
//!
//! The item is also the replay's claim: a run publishes only while it holds it (an owner
//! and an expiry, renewed by each progress write; see [`ProgressItem`]), so two runs of
//! the same replay never publish at once.

use std::collections::{BTreeMap, BTreeSet};
use std::time::{Duration, Instant, SystemTime};

use aws_sdk_dynamodb::error::{DisplayErrorContext, ProvideErrorMetadata};
use aws_sdk_dynamodb::types::{
    AttributeDefinition, AttributeValue, BillingMode, KeySchemaElement, KeyType,
    ScalarAttributeType, TableStatus,
};
use serde_json::{json, Value};
use shardflow::{Position, SequenceNumber};

use crate::position::{millis, rfc3339};
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

/// The attribute naming the run that holds the claim (absent: released).
const OWNER: &str = "owner";
/// The attribute holding until when (epoch ms) the claim lasts.
const UNTIL: &str = "claimed_until";

/// How many times a claim is tried when other runs keep writing the item.
const CLAIM_ATTEMPTS: usize = 5;
/// A run stops sending new writes this long before its claim would expire by its own
/// clock, so that what it sent lands before another run may take the item over.
const CLAIM_MARGIN: Duration = Duration::from_millis(250);

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

/// Who holds the claim on a progress item, as read from it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Claim {
    /// The holding run's incarnation (`host#pid-nonce`).
    pub owner: String,
    /// Until when (epoch ms, on the holder's clock) the claim lasts unless renewed.
    pub until_ms: u64,
}

impl Claim {
    /// Whether the claim still holds at `now_ms`.
    pub fn live_at(&self, now_ms: u64) -> bool {
        self.until_ms > now_ms
    }
}

/// The item of one replay (a dead-letter stream into a target stream) in the progress
/// table. A run publishes only while it holds the item's *claim*: an owner (the run's
/// incarnation) and an expiry, taken with a write conditional on the item as read and
/// renewed by every progress write, like a lease. Every write is conditional on the
/// revision read, so a second run cannot take a live claim, a crashed run's claim can be
/// taken over once it expired, and a run whose claim was taken over can no longer
/// record progress.
pub struct ProgressItem {
    client: aws_sdk_dynamodb::Client,
    table: String,
    key: String,
    /// This run's incarnation, written as the claim's owner.
    owner: String,
    /// How long a claim lasts after its last write.
    claim_for: Duration,
    /// The revision read (`None`: no item).
    revision: Option<u64>,
    /// On this process's clock, until when the claim written last holds (`None`: this
    /// run holds no claim).
    held_until: Option<Instant>,
}

impl ProgressItem {
    /// The item of the replay of `from` into `to` in `table`, claimed (when claimed) by
    /// `owner` for `claim_for` after each write.
    pub fn new(
        client: aws_sdk_dynamodb::Client,
        table: &str,
        from: &str,
        to: &str,
        owner: String,
        claim_for: Duration,
    ) -> Self {
        ProgressItem {
            client,
            table: table.to_owned(),
            key: format!("{from} -> {to}"),
            owner,
            claim_for,
            revision: None,
            held_until: None,
        }
    }

    /// Reads the progress (nothing re-published when the table or the item is missing)
    /// and the claim on it, if any. With `restart` the progress is not needed: an item
    /// whose progress does not parse reads as nothing re-published (its claim and
    /// revision still count), so that `--restart` can replace it.
    pub async fn load(&mut self, restart: bool) -> Result<(Replayed, Option<Claim>), CliError> {
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
                return Ok((Replayed::default(), None));
            }
            Err(e) => return Err(self.error("GetItem", e)),
        };
        let Some(item) = out.item else {
            self.revision = None;
            return Ok((Replayed::default(), None));
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
        let owner = item.get(OWNER).and_then(|v| v.as_s().ok()).cloned();
        let until = item
            .get(UNTIL)
            .and_then(|v| v.as_n().ok())
            .and_then(|n| n.parse::<u64>().ok());
        let claim = match (owner, until) {
            (Some(owner), Some(until_ms)) => Some(Claim { owner, until_ms }),
            // A claim that does not parse is treated as expired: taking it over is
            // still a write conditional on the revision read.
            _ => None,
        };
        match (revision, state) {
            (Some(revision), Some(state)) => {
                self.revision = Some(revision);
                Ok((state, claim))
            }
            (Some(revision), None) if restart => {
                self.revision = Some(revision);
                Ok((Replayed::default(), claim))
            }
            (Some(_), None) => Err(format!(
                "the replay progress item {:?} in table {} does not parse; run with --restart (or delete it) to replay from the start",
                self.key, self.table
            )
            .into()),
            (None, _) => Err(format!(
                "the replay progress item {:?} in table {} has no revision that parses; delete it to replay from the start",
                self.key, self.table
            )
            .into()),
        }
    }

    /// Takes the claim, before anything is published, and returns the progress as it
    /// is now (what other runs recorded until then; nothing with `restart`, which
    /// records that). Refused, with who holds it and until when, while another run's
    /// claim lasts. Creates the table on first use.
    pub async fn claim(&mut self, restart: bool) -> Result<Replayed, CliError> {
        for _ in 0..CLAIM_ATTEMPTS {
            let (mut state, claim) = self.load(restart).await?;
            if let Some(claim) = claim.filter(|c| c.owner != self.owner) {
                if claim.live_at(now_ms()) {
                    return Err(self.busy(&claim));
                }
            }
            if restart {
                state = Replayed::default();
            }
            match self.write(&state, true).await {
                Ok(()) => return Ok(state),
                // Another run wrote the item between the read and the write: read again.
                Err(WriteError::Lost) => continue,
                Err(WriteError::Failed(e)) => return Err(e),
            }
        }
        Err(format!(
            "the replay progress item {:?} in table {} kept changing while this run tried to claim it: another replay is starting; only one replay of a stream into another runs at once",
            self.key, self.table
        )
        .into())
    }

    /// Whether the claim this run wrote last still holds by this process's clock, with
    /// a margin: a run stops sending new writes once it does not.
    pub fn holds(&self) -> bool {
        self.held_until
            .is_some_and(|until| Instant::now() + CLAIM_MARGIN < until)
    }

    /// Writes the progress and renews the claim. Refused when another run took the
    /// item over.
    pub async fn save(&mut self, state: &Replayed) -> Result<(), CliError> {
        self.write(state, true).await.map_err(|e| self.lost(e))
    }

    /// Writes the progress and gives the claim up: the next run may start at once.
    pub async fn release(&mut self, state: &Replayed) -> Result<(), CliError> {
        let written = self.write(state, false).await.map_err(|e| self.lost(e));
        self.held_until = None;
        written
    }

    /// One conditional write of the item (claimed by this run, or released), creating
    /// the table on first use.
    async fn write(&mut self, state: &Replayed, claimed: bool) -> Result<(), WriteError> {
        let started = Instant::now();
        let claim_ms = u64::try_from(self.claim_for.as_millis()).unwrap_or(u64::MAX);
        let until = claimed.then(|| now_ms().saturating_add(claim_ms));
        match self.put(state, until).await {
            Err(e) if e.code() == Some("ResourceNotFoundException") => {
                self.create_table().await.map_err(WriteError::Failed)?;
                self.put(state, until)
                    .await
                    .map_err(|e| self.put_error(e))?;
            }
            Err(e) => return Err(self.put_error(e)),
            Ok(_) => {}
        }
        self.revision = Some(self.revision.map_or(1, |r| r + 1));
        self.held_until = claimed.then(|| started + self.claim_for);
        Ok(())
    }

    fn busy(&self, claim: &Claim) -> CliError {
        let left = claim.until_ms.saturating_sub(now_ms());
        format!(
            "another replay of {} holds its progress item in table {}: {} until {} ({:.1} s from now); only one replay of a stream into another runs at once, so nothing was published. Wait for it to end, or, if it crashed, run the same command again after that time",
            self.key,
            self.table,
            claim.owner,
            rfc3339(SystemTime::UNIX_EPOCH + Duration::from_millis(claim.until_ms)),
            left as f64 / 1000.0
        )
        .into()
    }

    fn lost(&self, e: WriteError) -> CliError {
        match e {
            WriteError::Lost => format!(
                "this replay lost its claim on the progress item {} in table {}: another run took it over (this run's claim had expired); it stopped publishing",
                self.key, self.table
            )
            .into(),
            WriteError::Failed(e) => e,
        }
    }

    async fn put(
        &self,
        state: &Replayed,
        until_ms: Option<u64>,
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
        let request = match until_ms {
            Some(until) => request
                .item(OWNER, AttributeValue::S(self.owner.clone()))
                .item(UNTIL, AttributeValue::N(until.to_string())),
            None => request,
        };
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
    ) -> WriteError {
        if e.code() == Some("ConditionalCheckFailedException") {
            WriteError::Lost
        } else {
            WriteError::Failed(self.error("PutItem", e))
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

/// Why a conditional write of the item did not land.
enum WriteError {
    /// Another run wrote the item since this run read it.
    Lost,
    /// DynamoDB failed (or the table could not be created).
    Failed(CliError),
}

/// Now, in epoch milliseconds.
fn now_ms() -> u64 {
    millis(SystemTime::now())
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
