//! The embedded backend: an in-process, Kinesis-like stream service ([`MemoryKinesis`])
//! and lease store ([`MemoryLeaseStore`]), for local development and for tests of
//! users' own handlers. It behaves like the real services where shardflow relies on
//! them: sequence numbers, hash-key routing (MD5 of the partition key), splits and
//! merges that close shards, iterators that expire, retention, and conditional writes.
//! Its clock is this host's wall clock unless one is given ([`MemoryBuilder::wall_clock`]):
//! it stamps arrival times with it, and refuses an `AT_TIMESTAMP` later than it
//! ([`crate::kinesis::KinesisError::FutureTimestamp`]) as Kinesis does.
//! Faults can be switched on with a fixed seed ([`KinesisFaults`], [`LeaseFaults`]) so
//! throttling, expired iterators and failed writes are reproducible.
//!
//! Enhanced fan-out works too: [`KinesisApi::register_consumer`] hands out a fake ARN and
//! [`KinesisApi::subscribe_to_shard`] pushes a shard's records as they arrive, in events
//! of at most [`MemoryKinesis::set_max_records_per_event`] records, sends an empty event
//! (a heartbeat) when the shard is idle, ends after
//! [`MemoryKinesis::set_subscription_lifetime`] (5 minutes, like Kinesis; on tokio's
//! clock, so paused-time tests renew quickly), and ends with `continuation: None` and the
//! child shards once a closed shard is delivered to its end.
//!
//! Kinesis' per-shard throughput limits (1,000 records and 1 MiB written, 5 GetRecords
//! calls and 2 MiB read per second, 2 MiB per second per fan-out consumer) are off by
//! default and switched on with [`Memory::builder`]`().limits(`[`KinesisLimits::aws()`]`)`
//! or [`MemoryKinesis::set_limits`], so that throughput measured here is what a real
//! shard would allow. A [`Producer`](crate::Producer) paces itself whether they are on or
//! not: its per-shard rate limit (on by default, 1,500 records/s per shard) holds here
//! too, so a test writing many records quickly turns it off
//! ([`no_rate_limit`](crate::ProducerBuilder::no_rate_limit)) or runs on tokio's paused
//! clock.
//!
//! DynamoDB tables with change streams live here too ([`Memory::tables`]): a table's
//! put, update and delete appear in its stream as DynamoDB Streams records them, and a
//! consumer reads it with [`ConsumerBuilder::table_stream`](crate::ConsumerBuilder::table_stream)
//! as it would on AWS. Its shards roll over as DynamoDB's do, on demand
//! ([`MemoryTable::rollover`]), on a schedule ([`MemoryTableBuilder::rollover_every`])
//! and on partition splits ([`MemoryTable::split`]); the stream keeps records 24 hours,
//! its iterators expire after 15 minutes and a read returns at most 1,000 records, so a
//! CDC pipeline's tests run without a server. Wait for a group with
//! [`Memory::wait_caught_up`] on the stream's ARN ([`MemoryTable::stream_arn`]).
//!
//! `kinesis.rs` holds the stream service, `fan_out.rs` its SubscribeToShard
//! subscriptions, `limits.rs` the throughput meters, `leases.rs` the lease store,
//! `caught_up.rs` the stream set-up and progress checks a test of one's own needs,
//! `tables.rs` the DynamoDB tables and their streams; this file the backend that bundles
//! them.
//!
//! # In a test of your own
//!
//! ```
//! use std::time::Duration;
//! use shardflow::{Consumer, Memory, Message, ProducerRecord, Producer};
//!
//! # #[tokio::main(flavor = "current_thread", start_paused = true)]
//! # async fn main() -> Result<(), Box<dyn std::error::Error>> {
//! let memory = Memory::new();
//! memory.create_stream("orders", 2).await?;
//! let producer = Producer::builder().stream("orders").backend(memory.clone()).build()?;
//! for i in 0..100 {
//!     producer.send(ProducerRecord::new(format!("order-{i}"), format!("customer-{i}"))).await?;
//! }
//! // Resharding is a call away too: the two children of the first shard.
//! let children = memory.split_shard_in_half("orders", "shardId-000000000000").await?;
//! assert_eq!(children.len(), 2);
//!
//! let consumer = Consumer::builder()
//!     .stream("orders")
//!     .group("billing") // its lease table is named after the group
//!     .backend(memory.clone())
//!     .build()?;
//! let running = consumer
//!     .run(tower::service_fn(|_msg: Message| async { Ok::<_, std::io::Error>(()) }))
//!     .spawn();
//! // Every record of the stream handled and checkpointed, or a minute on tokio's clock.
//! tokio::time::timeout(Duration::from_secs(60), memory.wait_caught_up("orders", "billing"))
//!     .await?;
//! running.shutdown().await?;
//! # Ok(())
//! # }
//! ```

mod caught_up;
mod fan_out;
mod faults;
mod kinesis;
mod leader;
mod leases;
mod limits;
mod state;
mod tables;

pub use faults::{KinesisFaults, LeaseFaults};
pub use kinesis::{MemoryKinesis, MEMORY_ACCOUNT};
pub use leader::MemoryCoordinatorState;
pub use leases::{MemoryLeaseStore, RowsRead};
pub use limits::KinesisLimits;
pub use tables::{
    MemoryTable, MemoryTableBuilder, MemoryTables, TableError, MAX_ITEM_BYTES,
    TABLE_STREAM_ITERATOR_TTL, TABLE_STREAM_MAX_RECORDS_PER_READ, TABLE_STREAM_RETENTION,
};

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::SystemTime;

use crate::backend::Backend;
use crate::clock::WallClock;
use crate::kinesis::{KinesisApi, StreamAdmin};
use crate::lease::LeaseStore;

/// The embedded backend: one [`MemoryKinesis`], a [`MemoryLeaseStore`] per lease table
/// name, and DynamoDB tables with change streams ([`MemoryTables`]). Clones share the
/// same streams and tables, so several consumers (workers of a group) in one process see
/// each other.
#[derive(Clone)]
pub struct Memory {
    kinesis: Arc<MemoryKinesis>,
    lease_tables: Arc<Mutex<HashMap<String, Arc<MemoryLeaseStore>>>>,
    dynamodb: Arc<MemoryTables>,
}

impl Default for Memory {
    fn default() -> Self {
        let kinesis = Arc::new(MemoryKinesis::default());
        Memory {
            dynamodb: Arc::new(MemoryTables::new(kinesis.clone())),
            kinesis,
            lease_tables: Arc::default(),
        }
    }
}

impl Memory {
    /// An empty backend: no streams, no tables, no throughput limits.
    pub fn new() -> Self {
        Self::default()
    }

    /// DynamoDB tables whose writes appear in their change streams, which consumers
    /// read with [`ConsumerBuilder::table_stream`](crate::ConsumerBuilder::table_stream):
    ///
    /// ```
    /// # use shardflow::Memory;
    /// # #[derive(serde::Serialize)] struct Order { id: String, total: u32 }
    /// # #[tokio::main(flavor = "current_thread", start_paused = true)]
    /// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// let memory = Memory::new();
    /// let orders = memory.tables().create("orders", "id").partitions(4).build()?;
    /// orders.put(&Order { id: "order-1".into(), total: 30 })?; // an INSERT in the stream
    /// orders.rollover()?; // every open shard closes, one child each
    /// # Ok(())
    /// # }
    /// ```
    pub fn tables(&self) -> &Arc<MemoryTables> {
        &self.dynamodb
    }

    /// A backend with settings: `Memory::builder().limits(KinesisLimits::aws()).build()`.
    pub fn builder() -> MemoryBuilder {
        MemoryBuilder::default()
    }

    /// The stream service, to create streams, write records, reshard or inject faults.
    pub fn streams(&self) -> &Arc<MemoryKinesis> {
        &self.kinesis
    }

    /// The lease table `table` (created empty on first use).
    pub fn table(&self, table: &str) -> Arc<MemoryLeaseStore> {
        lock(&self.lease_tables)
            .entry(table.to_owned())
            .or_insert_with(|| Arc::new(MemoryLeaseStore::with_clock(self.kinesis.wall_clock())))
            .clone()
    }
}

/// Settings of a new [`Memory`] backend (see [`Memory::builder`]).
#[derive(Clone, Debug, Default)]
pub struct MemoryBuilder {
    limits: KinesisLimits,
    wall_clock: Option<WallClock>,
}

impl MemoryBuilder {
    /// Kinesis' per-shard throughput limits to enforce (default: none). See
    /// [`KinesisLimits`]; they can be changed later with [`MemoryKinesis::set_limits`].
    pub fn limits(mut self, limits: KinesisLimits) -> Self {
        self.limits = limits;
        self
    }

    /// The stream service's clock for the time of day (default: this host's wall clock;
    /// see [`MemoryKinesis::set_wall_clock`]). A simulation that must replay exactly
    /// gives it, and its workers, a clock on tokio's paused time:
    ///
    /// ```
    /// # use std::time::{Duration, SystemTime};
    /// # use shardflow::Memory;
    /// # #[tokio::main(flavor = "current_thread", start_paused = true)]
    /// # async fn main() {
    /// let origin = tokio::time::Instant::now();
    /// let date = SystemTime::UNIX_EPOCH + Duration::from_secs(1_780_000_000);
    /// let memory = Memory::builder()
    ///     .wall_clock(move || date + origin.elapsed())
    ///     .build();
    /// # let _ = memory;
    /// # }
    /// ```
    pub fn wall_clock(mut self, clock: impl Fn() -> SystemTime + Send + Sync + 'static) -> Self {
        self.wall_clock = Some(WallClock::new(clock));
        self
    }

    /// The backend: no streams, no tables yet.
    pub fn build(self) -> Memory {
        let memory = Memory::new();
        memory.kinesis.set_limits(self.limits);
        if let Some(clock) = self.wall_clock {
            memory.kinesis.set_wall_clock(move || clock.now());
        }
        memory
    }
}

impl Backend for Memory {
    fn kinesis(&self) -> Arc<dyn KinesisApi> {
        self.kinesis.clone()
    }

    fn lease_store(&self, table: &str) -> Arc<dyn LeaseStore> {
        self.table(table)
    }

    fn admin(&self) -> Option<Arc<dyn StreamAdmin>> {
        Some(self.kinesis.clone())
    }

    /// The tables' streams ([`Memory::tables`]) are served by the same stream service,
    /// under their ARNs.
    fn table_streams(&self) -> Option<Arc<dyn KinesisApi>> {
        Some(self.kinesis.clone())
    }
}

/// Locks a mutex, recovering the data if a panicking thread poisoned it: every critical
/// section here leaves the state consistent before anything that could panic.
fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}
