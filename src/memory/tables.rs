//! The embedded backend's DynamoDB tables: items written with put, update and delete,
//! each change appended to the table's change stream as DynamoDB Streams records it
//! (INSERT / MODIFY / REMOVE with the images of the table's view type), served by the
//! same [`MemoryKinesis`] under the stream's ARN. Shards roll over as DynamoDB Streams'
//! do: on demand ([`MemoryTable::rollover`]), on a schedule
//! ([`MemoryTableBuilder::rollover_every`]) and on partition splits
//! ([`MemoryTable::split`]); the stream keeps records 24 hours and its iterators
//! expire after 15 minutes.

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex, Weak};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use serde::de::DeserializeOwned;
use serde::Serialize;

use crate::dynamodb_streams::record::{image_of, partition_key_of, StreamRecord};
use crate::dynamodb_streams::{AttributeValue, ChangeRecord, EventName, Image, StreamViewType};
use crate::kinesis::{partition_hash, KinesisError};

use super::kinesis::{MemoryKinesis, TableStreamSettings, MEMORY_ACCOUNT};
use super::lock;

/// How long a table's stream keeps records (DynamoDB Streams: 24 hours).
pub const TABLE_STREAM_RETENTION: Duration = Duration::from_secs(24 * 3600);
/// How long an iterator of a table's stream stays valid (DynamoDB Streams: 15 minutes).
pub const TABLE_STREAM_ITERATOR_TTL: Duration = Duration::from_secs(15 * 60);
/// The most records one GetRecords call of a table's stream returns (DynamoDB Streams).
pub const TABLE_STREAM_MAX_RECORDS_PER_READ: u32 = 1_000;

/// Why a table operation was refused. Nothing is written when one is returned.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum TableError {
    /// No table of that name.
    #[error("no table {0}")]
    NotFound(String),
    /// A table of that name exists already.
    #[error("table {0} exists already")]
    Exists(String),
    /// The table's settings are invalid; names the setting.
    #[error("invalid table setting `{field}`: {reason}")]
    Invalid {
        /// The builder method whose value is refused.
        field: &'static str,
        /// Why.
        reason: String,
    },
    /// The item (or the keys) lacks a key attribute of the table, or has one of a type
    /// a key cannot have (only strings, numbers and binary can be keys).
    #[error("key attribute `{attribute}` of table {table}: {reason}")]
    Key {
        /// The table.
        table: String,
        /// The key attribute.
        attribute: String,
        /// Missing, or of the wrong type.
        reason: &'static str,
    },
    /// An update tried to change a key attribute.
    #[error("an update of table {table} cannot change key attribute `{attribute}`")]
    KeyChanged {
        /// The table.
        table: String,
        /// The key attribute.
        attribute: String,
    },
    /// The value does not serialize as an item (it must be a struct or a map).
    #[error("not an item: {0}")]
    Encode(#[from] serde_dynamo::Error),
    /// The stream service refused (should not happen; names what it said).
    #[error("the table's stream: {0}")]
    Stream(#[from] KinesisError),
}

/// The tables of an embedded backend ([`crate::Memory::tables`]).
pub struct MemoryTables {
    kinesis: Arc<MemoryKinesis>,
    tables: Mutex<HashMap<String, Arc<Mutex<TableState>>>>,
}

/// One table: a handle to write its items and drive its stream's shards. Clones share
/// the table.
#[derive(Clone)]
pub struct MemoryTable {
    kinesis: Arc<MemoryKinesis>,
    state: Arc<Mutex<TableState>>,
}

/// The settings of a new table (see [`MemoryTables::create`]).
#[must_use = "a table builder does nothing until `build` is called"]
pub struct MemoryTableBuilder<'a> {
    tables: &'a MemoryTables,
    name: String,
    partition_key: String,
    sort_key: Option<String>,
    view: StreamViewType,
    partitions: usize,
    rollover_every: Option<Duration>,
}

/// A shard of the table's stream that takes writes, and the part of the partition-key
/// hash space (MD5 of the partition key's value) whose items it takes.
struct OpenShard {
    shard_id: String,
    range: (u128, u128),
}

struct TableState {
    name: String,
    partition_key: String,
    sort_key: Option<String>,
    view: StreamViewType,
    arn: String,
    /// Items by their keys' JSON form.
    items: HashMap<String, Image>,
    open: Vec<OpenShard>,
    /// Closed shards and when they closed, oldest first: removed once past retention,
    /// as DynamoDB Streams drops them.
    closed: VecDeque<(String, SystemTime)>,
    next_event: u64,
}

impl MemoryTables {
    pub(super) fn new(kinesis: Arc<MemoryKinesis>) -> Self {
        MemoryTables {
            kinesis,
            tables: Mutex::new(HashMap::new()),
        }
    }

    /// A new table named `name`, with a string, number or binary partition key
    /// attribute `partition_key`; set its other settings, then
    /// [`build`](MemoryTableBuilder::build) it.
    pub fn create(
        &self,
        name: impl Into<String>,
        partition_key: impl Into<String>,
    ) -> MemoryTableBuilder<'_> {
        MemoryTableBuilder {
            tables: self,
            name: name.into(),
            partition_key: partition_key.into(),
            sort_key: None,
            view: StreamViewType::NewAndOldImages,
            partitions: 1,
            rollover_every: None,
        }
    }

    /// The table `name`, if it exists.
    pub fn table(&self, name: &str) -> Option<MemoryTable> {
        lock(&self.tables).get(name).map(|state| MemoryTable {
            kinesis: self.kinesis.clone(),
            state: state.clone(),
        })
    }

    /// Rolls the stream of table `name` over: see [`MemoryTable::rollover`].
    pub fn rollover(&self, name: &str) -> Result<Vec<String>, TableError> {
        self.table(name)
            .ok_or_else(|| TableError::NotFound(name.to_owned()))?
            .rollover()
    }
}

impl MemoryTableBuilder<'_> {
    /// The sort key attribute (default: none, items are identified by the partition key
    /// alone).
    pub fn sort_key(mut self, attribute: impl Into<String>) -> Self {
        self.sort_key = Some(attribute.into());
        self
    }

    /// Which images the stream's records carry (default: both, `NEW_AND_OLD_IMAGES`).
    pub fn view(mut self, view: StreamViewType) -> Self {
        self.view = view;
        self
    }

    /// How many partitions the table has, each with one open shard in its stream
    /// (1..=1000, default 1). Items go to a partition by the MD5 of their partition
    /// key's value.
    pub fn partitions(mut self, partitions: usize) -> Self {
        self.partitions = partitions;
        self
    }

    /// Rolls the stream over every `interval` (DynamoDB Streams does about every four
    /// hours per partition): every open shard closes and one child opens in its place.
    /// The schedule runs on tokio's clock, in a task of the runtime `build` is called
    /// in, until the backend is dropped.
    pub fn rollover_every(mut self, interval: Duration) -> Self {
        self.rollover_every = Some(interval);
        self
    }

    /// Creates the table and its stream, ARN
    /// `arn:aws:dynamodb:memory:000000000000:table/<name>/stream/<label>`.
    pub fn build(self) -> Result<MemoryTable, TableError> {
        let invalid = |field, reason: &str| TableError::Invalid {
            field,
            reason: reason.to_owned(),
        };
        let table_name = |name: &str| {
            (3..=255).contains(&name.len())
                && name
                    .chars()
                    .all(|c| c.is_ascii_alphanumeric() || "_.-".contains(c))
        };
        if !table_name(&self.name) {
            return Err(invalid("name", "3-255 of a-z A-Z 0-9 _ . -"));
        }
        if self.partition_key.is_empty() {
            return Err(invalid("partition_key", "an attribute name is not empty"));
        }
        if self.sort_key.as_deref() == Some("") || self.sort_key == Some(self.partition_key.clone())
        {
            return Err(invalid(
                "sort_key",
                "not empty, and not the partition key attribute",
            ));
        }
        if !(1..=1000).contains(&self.partitions) {
            return Err(invalid("partitions", "1..=1000"));
        }
        if self.rollover_every.is_some_and(|d| d.is_zero()) {
            return Err(invalid("rollover_every", "an interval longer than zero"));
        }
        let runtime = match self.rollover_every {
            Some(_) => Some(tokio::runtime::Handle::try_current().map_err(|_| {
                invalid(
                    "rollover_every",
                    "a schedule needs a tokio runtime: build the table inside one",
                )
            })?),
            None => None,
        };
        let mut tables = lock(&self.tables.tables);
        if tables.contains_key(&self.name) {
            return Err(TableError::Exists(self.name));
        }
        let kinesis = &self.tables.kinesis;
        let created = kinesis
            .wall_clock()
            .now()
            .duration_since(UNIX_EPOCH)
            .unwrap_or_default();
        let arn = format!(
            "arn:aws:dynamodb:memory:{MEMORY_ACCOUNT}:table/{}/stream/{}.{:03}",
            self.name,
            created.as_secs(),
            created.subsec_millis()
        );
        let shards = kinesis.create_table_stream(
            &self.name,
            &arn,
            self.partitions,
            TableStreamSettings {
                retention: TABLE_STREAM_RETENTION,
                iterator_ttl: TABLE_STREAM_ITERATOR_TTL,
                max_records_per_read: TABLE_STREAM_MAX_RECORDS_PER_READ,
            },
        )?;
        let n = self.partitions as u128;
        let width = u128::MAX / n;
        let open = shards
            .into_iter()
            .zip(0..)
            .map(|(shard_id, i): (String, u128)| OpenShard {
                shard_id,
                range: (
                    i * width,
                    if i + 1 == n {
                        u128::MAX
                    } else {
                        (i + 1) * width - 1
                    },
                ),
            })
            .collect();
        let state = Arc::new(Mutex::new(TableState {
            name: self.name.clone(),
            partition_key: self.partition_key,
            sort_key: self.sort_key,
            view: self.view,
            arn,
            items: HashMap::new(),
            open,
            closed: VecDeque::new(),
            next_event: 0,
        }));
        tables.insert(self.name, state.clone());
        let table = MemoryTable {
            kinesis: kinesis.clone(),
            state,
        };
        if let (Some(interval), Some(runtime)) = (self.rollover_every, runtime) {
            runtime.spawn(scheduled_rollover(
                Arc::downgrade(&table.kinesis),
                Arc::downgrade(&table.state),
                interval,
            ));
        }
        Ok(table)
    }
}

/// Rolls a table's stream over every `interval` until the table or the service is gone.
async fn scheduled_rollover(
    kinesis: Weak<MemoryKinesis>,
    state: Weak<Mutex<TableState>>,
    interval: Duration,
) {
    let mut ticks = tokio::time::interval_at(tokio::time::Instant::now() + interval, interval);
    loop {
        ticks.tick().await;
        let (Some(kinesis), Some(state)) = (kinesis.upgrade(), state.upgrade()) else {
            return;
        };
        let table = MemoryTable { kinesis, state };
        if let Err(error) = table.rollover() {
            tracing::warn!(%error, "scheduled rollover of an embedded table failed");
        }
    }
}

impl std::fmt::Debug for MemoryTable {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let state = lock(&self.state);
        f.debug_struct("MemoryTable")
            .field("name", &state.name)
            .field("stream_arn", &state.arn)
            .field("items", &state.items.len())
            .finish()
    }
}

impl MemoryTable {
    /// The table's name.
    pub fn name(&self) -> String {
        lock(&self.state).name.clone()
    }

    /// The ARN of the table's stream (its `LatestStreamArn`).
    pub fn stream_arn(&self) -> String {
        lock(&self.state).arn.clone()
    }

    /// The shards of the stream that take writes now, one per partition.
    pub fn open_shards(&self) -> Vec<String> {
        lock(&self.state)
            .open
            .iter()
            .map(|shard| shard.shard_id.clone())
            .collect()
    }

    /// How many items the table holds.
    pub fn len(&self) -> usize {
        lock(&self.state).items.len()
    }

    /// Whether the table holds no item.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Writes `item` whole (PutItem): an INSERT if no item had its keys, a MODIFY if it
    /// replaces one that differs. The change written to the stream, or `None` when the
    /// item was already stored as it is (DynamoDB Streams records nothing then).
    pub fn put(&self, item: &impl Serialize) -> Result<Option<ChangeRecord>, TableError> {
        let image = image_of(item)?;
        let mut state = lock(&self.state);
        let keys = state.keys_of(&image)?;
        let old = state.items.get(&partition_key_of(&keys)).cloned();
        self.write(&mut state, keys, old, Some(image))
    }

    /// Sets the attributes of `changes` on the item with `keys` (UpdateItem with SET):
    /// a MODIFY of the stored item, or an INSERT of a new one made of the keys and the
    /// changes. `None` when nothing changed. `changes` may repeat the key attributes
    /// with their values, not change them.
    pub fn update(
        &self,
        keys: &impl Serialize,
        changes: &impl Serialize,
    ) -> Result<Option<ChangeRecord>, TableError> {
        let keys = image_of(keys)?;
        let changes = image_of(changes)?;
        let mut state = lock(&self.state);
        let keys = state.keys_of(&keys)?;
        for (attribute, value) in &keys {
            if changes.get(attribute).is_some_and(|v| v != value) {
                return Err(TableError::KeyChanged {
                    table: state.name.clone(),
                    attribute: attribute.clone(),
                });
            }
        }
        let old = state.items.get(&partition_key_of(&keys)).cloned();
        let mut new = old.clone().unwrap_or_else(|| keys.clone());
        new.extend(changes);
        self.write(&mut state, keys, old, Some(new))
    }

    /// Deletes the item with `keys` (DeleteItem): a REMOVE, or `None` when no item had
    /// those keys (DynamoDB Streams records nothing then).
    pub fn delete(&self, keys: &impl Serialize) -> Result<Option<ChangeRecord>, TableError> {
        let keys = image_of(keys)?;
        let mut state = lock(&self.state);
        let keys = state.keys_of(&keys)?;
        let old = state.items.get(&partition_key_of(&keys)).cloned();
        self.write(&mut state, keys, old, None)
    }

    /// The item with `keys`, decoded into `T`.
    pub fn get<T: DeserializeOwned>(&self, keys: &impl Serialize) -> Result<Option<T>, TableError> {
        let keys = image_of(keys)?;
        let state = lock(&self.state);
        let keys = state.keys_of(&keys)?;
        let Some(item) = state.items.get(&partition_key_of(&keys)) else {
            return Ok(None);
        };
        let item: HashMap<String, serde_dynamo::AttributeValue> = item
            .iter()
            .map(|(name, value)| (name.clone(), value.clone().into()))
            .collect();
        Ok(Some(serde_dynamo::from_item(item)?))
    }

    /// Closes every open shard of the stream and opens one child of each in its place,
    /// taking the same items, as DynamoDB Streams does every few hours. The children's
    /// ids. Closed shards past the stream's 24 h retention are removed.
    pub fn rollover(&self) -> Result<Vec<String>, TableError> {
        let mut guard = lock(&self.state);
        let state = &mut *guard;
        let now = self.kinesis.wall_clock().now();
        let mut children = Vec::with_capacity(state.open.len());
        let arn = state.arn.clone();
        for shard in &mut state.open {
            let child = self
                .kinesis
                .close_into(&arn, &shard.shard_id, 1)?
                .pop()
                .ok_or_else(|| KinesisError::Other("rollover opened no shard".into()))?;
            let parent = std::mem::replace(&mut shard.shard_id, child.clone());
            children.push(child);
            state.closed.push_back((parent, now));
        }
        self.trim(state, now);
        Ok(children)
    }

    /// Splits the partition whose open shard is `shard_id`: it closes and two children
    /// open, each taking half of its items (by the MD5 of their partition key), as on a
    /// DynamoDB partition split. The children's ids.
    pub fn split(&self, shard_id: &str) -> Result<Vec<String>, TableError> {
        let mut state = lock(&self.state);
        let index = state
            .open
            .iter()
            .position(|shard| shard.shard_id == shard_id)
            .ok_or_else(|| {
                KinesisError::Invalid(format!("{shard_id} is not an open shard").into())
            })?;
        let (low, high) = state.open[index].range;
        if low == high {
            return Err(KinesisError::Invalid(
                format!("{shard_id} cannot be split further").into(),
            )
            .into());
        }
        let children = self.kinesis.close_into(&state.arn, shard_id, 2)?;
        let middle = low + (high - low) / 2;
        let [first, second] = [children[0].clone(), children[1].clone()];
        state.open[index] = OpenShard {
            shard_id: first,
            range: (low, middle),
        };
        state.open.insert(
            index + 1,
            OpenShard {
                shard_id: second,
                range: (middle + 1, high),
            },
        );
        let now = self.kinesis.wall_clock().now();
        state.closed.push_back((shard_id.to_owned(), now));
        self.trim(&mut state, now);
        Ok(children)
    }

    /// Removes closed shards that closed longer ago than the stream's retention: their
    /// records are all past it.
    fn trim(&self, state: &mut TableState, now: SystemTime) {
        while let Some((shard_id, closed)) = state.closed.front() {
            if now.duration_since(*closed).unwrap_or_default() <= TABLE_STREAM_RETENTION {
                break;
            }
            self.kinesis.remove_shard(&state.arn, shard_id);
            state.closed.pop_front();
        }
    }

    /// Stores `new` (or deletes the item when `None`) and appends the change to the
    /// stream, when there is one.
    fn write(
        &self,
        state: &mut TableState,
        keys: Image,
        old: Option<Image>,
        new: Option<Image>,
    ) -> Result<Option<ChangeRecord>, TableError> {
        let event_name = match (&old, &new) {
            (None, None) => return Ok(None),
            (Some(old), Some(new)) if old == new => return Ok(None),
            (None, Some(_)) => EventName::Insert,
            (Some(_), Some(_)) => EventName::Modify,
            (Some(_), None) => EventName::Remove,
        };
        let hash = partition_hash(
            &keys
                .get(&state.partition_key)
                .map(key_text)
                .unwrap_or_default(),
        );
        let shard_id = state
            .open
            .iter()
            .find(|shard| shard.range.0 <= hash && hash <= shard.range.1)
            .map(|shard| shard.shard_id.clone())
            .ok_or_else(|| KinesisError::Other("no open shard takes the item".into()))?;
        state.next_event += 1;
        let event_id = format!("{:032x}", partition_hash(&format!("{}", state.next_event)));
        let view = state.view;
        let key = partition_key_of(&keys);
        let mut record = ChangeRecord {
            event_id,
            event_name,
            event_version: Some("1.1".into()),
            event_source: Some("aws:dynamodb".into()),
            aws_region: Some("memory".into()),
            dynamodb: StreamRecord {
                approximate_creation_date_time: None,
                keys,
                new_image: new.clone().filter(|_| view.has_new_image()),
                old_image: old.filter(|_| view.has_old_image()),
                sequence_number: String::new(),
                size_bytes: None,
                stream_view_type: Some(view),
            },
            user_identity: None,
        };
        let mut written = None;
        self.kinesis
            .append(&state.arn, &shard_id, |sequence, arrival| {
                record.dynamodb.sequence_number = sequence.as_str().to_owned();
                record.dynamodb.approximate_creation_date_time = Some(
                    arrival
                        .duration_since(UNIX_EPOCH)
                        .map_or(0, |d| d.as_secs()) as f64,
                );
                record.dynamodb.size_bytes = Some(stream_data_size(&record.dynamodb));
                let payload = record.to_payload();
                written = Some(record);
                (key.clone(), payload)
            })?;
        match new {
            Some(new) => state.items.insert(key, new),
            None => state.items.remove(&key),
        };
        Ok(written)
    }
}

impl TableState {
    /// The key attributes of `image`, checked.
    fn keys_of(&self, image: &Image) -> Result<Image, TableError> {
        let mut keys = Image::new();
        for attribute in std::iter::once(&self.partition_key).chain(self.sort_key.as_ref()) {
            let error = |reason| TableError::Key {
                table: self.name.clone(),
                attribute: attribute.clone(),
                reason,
            };
            let value = image.get(attribute).ok_or_else(|| error("missing"))?;
            if !matches!(
                value,
                AttributeValue::S(_) | AttributeValue::N(_) | AttributeValue::B(_)
            ) {
                return Err(error("a key is a string, a number or binary"));
            }
            keys.insert(attribute.clone(), value.clone());
        }
        Ok(keys)
    }
}

/// The text whose MD5 places an item in a partition: its partition key's value.
fn key_text(value: &AttributeValue) -> String {
    match value {
        AttributeValue::S(s) | AttributeValue::N(s) => s.clone(),
        other => serde_json::to_string(other).unwrap_or_default(),
    }
}

/// The size of a record's stream data as DynamoDB Streams counts it, approximately: its
/// keys and images in their JSON form.
fn stream_data_size(record: &StreamRecord) -> u64 {
    let size = |image: &Option<Image>| {
        image
            .as_ref()
            .map_or(0, |i| serde_json::to_vec(i).map_or(0, |v| v.len()))
    };
    (serde_json::to_vec(&record.keys).map_or(0, |v| v.len())
        + size(&record.new_image)
        + size(&record.old_image)) as u64
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kinesis::{KinesisApi, StartingPosition};
    use crate::memory::Memory;
    use serde::Deserialize;

    #[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
    struct Order {
        id: String,
        total: u32,
    }

    #[derive(Serialize)]
    struct Key<'a> {
        id: &'a str,
    }

    fn order(id: &str, total: u32) -> Order {
        Order {
            id: id.into(),
            total,
        }
    }

    /// Every record of every shard of the stream, in shard order.
    async fn changes(memory: &Memory, arn: &str) -> Vec<(String, ChangeRecord)> {
        let kinesis = memory.streams();
        let mut all = Vec::new();
        for shard in kinesis.list_shards(arn).await.unwrap() {
            let iterator = kinesis
                .shard_iterator(arn, &shard.shard_id, &StartingPosition::TrimHorizon)
                .await
                .unwrap();
            let page = kinesis.get_records(&iterator, 10_000).await.unwrap();
            for record in page.records {
                let change = ChangeRecord::from_payload(&record.data).unwrap();
                assert_eq!(
                    change.dynamodb.sequence_number,
                    record.sequence_number.as_str()
                );
                assert_eq!(change.partition_key(), record.partition_key);
                all.push((shard.shard_id.clone(), change));
            }
        }
        all
    }

    #[tokio::test]
    async fn writes_become_changes_with_the_images_of_the_view() {
        let memory = Memory::new();
        let table = memory
            .tables()
            .create("orders", "id")
            .view(StreamViewType::NewAndOldImages)
            .build()
            .unwrap();
        assert!(table.put(&order("a", 1)).unwrap().is_some());
        // The same item again changes nothing: no record.
        assert!(table.put(&order("a", 1)).unwrap().is_none());
        table
            .update(&Key { id: "a" }, &serde_json::json!({"total": 2}))
            .unwrap();
        assert!(table.delete(&Key { id: "a" }).unwrap().is_some());
        assert!(table.delete(&Key { id: "a" }).unwrap().is_none());
        let changes = changes(&memory, &table.stream_arn()).await;
        let names: Vec<_> = changes.iter().map(|(_, c)| c.event_name).collect();
        assert_eq!(
            names,
            [EventName::Insert, EventName::Modify, EventName::Remove]
        );
        let modify = &changes[1].1;
        assert_eq!(modify.old_image_as::<Order>().unwrap(), Some(order("a", 1)));
        assert_eq!(modify.new_image_as::<Order>().unwrap(), Some(order("a", 2)));
        assert_eq!(changes[2].1.new_image_as::<Order>().unwrap(), None);
        assert_eq!(
            changes[2].1.old_image_as::<Order>().unwrap(),
            Some(order("a", 2))
        );
        assert!(table.is_empty());
    }

    #[tokio::test]
    async fn a_keys_only_view_carries_no_image_and_keys_are_checked() {
        let memory = Memory::new();
        let table = memory
            .tables()
            .create("orders", "id")
            .view(StreamViewType::KeysOnly)
            .build()
            .unwrap();
        let change = table.put(&order("a", 1)).unwrap().unwrap();
        assert_eq!(change.dynamodb.new_image, None);
        assert_eq!(change.partition_key(), r#"{"id":{"S":"a"}}"#);
        let err = table.put(&serde_json::json!({"total": 1})).unwrap_err();
        assert!(matches!(err, TableError::Key { .. }), "{err}");
        let err = table
            .update(&Key { id: "a" }, &serde_json::json!({"id": "b"}))
            .unwrap_err();
        assert!(matches!(err, TableError::KeyChanged { .. }), "{err}");
        let err = memory.tables().create("other", "id").partitions(0).build();
        assert!(err.unwrap_err().to_string().contains("`partitions`"));
        assert!(matches!(
            memory.tables().create("orders", "id").build(),
            Err(TableError::Exists(_))
        ));
    }

    #[tokio::test]
    async fn rollover_gives_each_shard_one_child_and_a_split_two() {
        let memory = Memory::new();
        let table = memory
            .tables()
            .create("orders", "id")
            .partitions(3)
            .build()
            .unwrap();
        let arn = table.stream_arn();
        let first = table.open_shards();
        for i in 0..30 {
            table.put(&order(&format!("o{i}"), i)).unwrap();
        }
        let children = memory.tables().rollover("orders").unwrap();
        assert_eq!(children.len(), 3);
        let split = table.split(&children[0]).unwrap();
        assert_eq!(split.len(), 2);
        for i in 0..30 {
            table.put(&order(&format!("o{i}"), i + 100)).unwrap();
        }
        let shards = memory.streams().list_shards(&arn).await.unwrap();
        assert_eq!(shards.len(), 3 + 3 + 2);
        for shard in &shards {
            assert_eq!(
                (shard.starting_hash_key, shard.ending_hash_key),
                (0, u128::MAX)
            );
        }
        let parent_of = |id: &str| {
            shards
                .iter()
                .find(|s| s.shard_id == id)
                .and_then(|s| s.parent_shard_id.clone())
        };
        for (parent, child) in first.iter().zip(&children) {
            assert_eq!(parent_of(child).as_deref(), Some(parent.as_str()));
        }
        assert_eq!(parent_of(&split[1]).as_deref(), Some(children[0].as_str()));
        // Each item's changes sit in one lineage: its MODIFY in a child of the shard of
        // its INSERT, and both split children take some items.
        let changes = changes(&memory, &arn).await;
        assert_eq!(changes.len(), 60);
        let mut used = std::collections::HashSet::new();
        for (shard, change) in &changes {
            used.insert(shard.clone());
            if change.event_name == EventName::Modify {
                let insert = changes
                    .iter()
                    .find(|(_, c)| {
                        c.event_name == EventName::Insert
                            && c.partition_key() == change.partition_key()
                    })
                    .unwrap();
                let parent = parent_of(shard).unwrap();
                assert!(parent == insert.0 || parent_of(&parent).as_deref() == Some(&insert.0));
            }
        }
        assert!(
            used.contains(&split[0]) && used.contains(&split[1]),
            "{used:?}"
        );
        // The parent's reader is told its children at the end.
        let iterator = memory
            .streams()
            .shard_iterator(&arn, &first[0], &StartingPosition::TrimHorizon)
            .await
            .unwrap();
        let page = memory
            .streams()
            .get_records(&iterator, 10_000)
            .await
            .unwrap();
        assert_eq!(page.next_iterator, None);
        assert_eq!(page.child_shards, vec![children[0].clone()]);
    }

    /// A shard id is never given twice: once the trim drops shards that closed more than
    /// a day ago, the next rollovers' children get new ids, not those of the dropped
    /// shards (whose finished lease rows a group may still hold at SHARD_END).
    #[tokio::test(start_paused = true)]
    async fn shard_ids_stay_unique_after_the_trim_drops_shards() {
        let origin = tokio::time::Instant::now();
        let date = UNIX_EPOCH + Duration::from_secs(1_780_000_000);
        let memory = Memory::builder()
            .wall_clock(move || date + origin.elapsed())
            .build();
        let table = memory
            .tables()
            .create("orders", "id")
            .partitions(2)
            .build()
            .unwrap();
        let arn = table.stream_arn();
        let mut given: Vec<String> = table.open_shards();
        for _ in 0..3 {
            given.extend(table.rollover().unwrap());
        }
        tokio::time::sleep(TABLE_STREAM_RETENTION + Duration::from_secs(60)).await;
        // This rollover drops the six shards that closed a day ago.
        given.extend(table.rollover().unwrap());
        given.extend(table.split(&table.open_shards()[0]).unwrap());
        given.extend(table.rollover().unwrap());
        let listed = memory.streams().list_shards(&arn).await.unwrap();
        assert_eq!(listed.len(), given.len() - 6, "{listed:?}");
        let unique: std::collections::HashSet<&String> = given.iter().collect();
        assert_eq!(
            unique.len(),
            given.len(),
            "a shard id given twice: {given:?}"
        );
        table.put(&order("a", 1)).unwrap();
        let changes = changes(&memory, &arn).await;
        assert_eq!(changes.len(), 1);
        assert!(!given[..6].contains(&changes[0].0), "{changes:?}");
    }

    #[tokio::test(start_paused = true)]
    async fn iterators_expire_after_15_minutes_records_after_24_hours_and_rollover_runs_on_schedule(
    ) {
        let origin = tokio::time::Instant::now();
        let date = UNIX_EPOCH + Duration::from_secs(1_780_000_000);
        let memory = Memory::builder()
            .wall_clock(move || date + origin.elapsed())
            .build();
        let table = memory
            .tables()
            .create("orders", "id")
            .rollover_every(Duration::from_secs(4 * 3600))
            .build()
            .unwrap();
        let arn = table.stream_arn();
        table.put(&order("a", 1)).unwrap();
        let shard = table.open_shards().remove(0);
        let kinesis = memory.streams();
        let iterator = kinesis
            .shard_iterator(&arn, &shard, &StartingPosition::TrimHorizon)
            .await
            .unwrap();
        tokio::time::sleep(Duration::from_secs(14 * 60)).await;
        assert!(kinesis.get_records(&iterator, 1).await.is_ok());
        tokio::time::sleep(Duration::from_secs(2 * 60)).await;
        assert!(matches!(
            kinesis.get_records(&iterator, 1).await,
            Err(KinesisError::ExpiredIterator(_))
        ));
        // Four hours in, the schedule rolled the shard over.
        tokio::time::sleep(Duration::from_secs(4 * 3600)).await;
        assert_ne!(table.open_shards(), vec![shard.clone()]);
        // A day in, the first record is past retention, and its shard is removed at the
        // first rollover more than a day after it closed.
        tokio::time::sleep(Duration::from_secs(20 * 3600)).await;
        let iterator = kinesis
            .shard_iterator(&arn, &shard, &StartingPosition::TrimHorizon)
            .await
            .unwrap();
        assert!(kinesis
            .get_records(&iterator, 10)
            .await
            .unwrap()
            .records
            .is_empty());
        tokio::time::sleep(Duration::from_secs(8 * 3600)).await;
        let shards = kinesis.list_shards(&arn).await.unwrap();
        assert!(shards.iter().all(|s| s.shard_id != shard), "{shards:?}");
    }
}
