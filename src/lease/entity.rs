//! Rows of a lease table that are not leases: the KCL 3.5 single-table format keeps its
//! leader lock, worker metrics, stream metadata and migration states beside the leases,
//! each row tagged with an `entityType`.
//!
//! The rule, applied by [`RowKind::of`] wherever a row is read: a row whose
//! `entityType` is present and is not `LEASE` is not a lease. It is never parsed as
//! one, never counted as unreadable, never written or deleted, and does not make a
//! worker not ready. A row without `entityType` (every KCL before 3.5, and shardflow
//! before it knew the format) and a `LEASE` row are leases. shardflow's own non-lease
//! rows fall under the same rule by carrying an `entityType` of their own.

use std::fmt;

/// The attribute that tags every row of a KCL 3.5 lease table with what it is.
pub const ENTITY_TYPE: &str = "entityType";

/// The `entityType` of a lease row, as KCL 3.5 writes it.
pub const LEASE_ENTITY: &str = "LEASE";

/// The prefix of the `entityType` of the non-lease rows shardflow itself writes: such
/// rows belong to the group and go with it (`group delete`); any other non-lease row
/// is another application's and is left alone.
pub const SHARDFLOW_ENTITY_PREFIX: &str = "SHARDFLOW_";

/// What a row of the lease table is, from its `entityType` alone (before anything
/// else of the row is read).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum RowKind {
    /// A lease: no `entityType`, or `LEASE`.
    Lease,
    /// Anything else, by its `entityType`.
    Other(EntityKind),
}

impl RowKind {
    /// The kind of a row whose `entityType` is `entity_type` (`None`: absent). An
    /// `entityType` that is not a string is not `LEASE` either: such a row is not a
    /// lease (pass `Some` of its text form).
    pub fn of(entity_type: Option<&str>) -> RowKind {
        match entity_type {
            None | Some(LEASE_ENTITY) => RowKind::Lease,
            Some(other) => RowKind::Other(EntityKind::from_attribute(other)),
        }
    }
}

/// The kinds of non-lease row, by `entityType` (the KCL 3.5's `EntityType` values).
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord)]
#[non_exhaustive]
pub enum EntityKind {
    /// `LEADER`: the KCL's leader lock (key `Leader`, written through the DynamoDB lock
    /// client: `ownerName`, `leaseDuration`, `recordVersionNumber`).
    KclLeader,
    /// `WORKER_METRIC_STATS`: one KCL worker's resource metrics (keyed by worker id).
    KclWorkerMetrics,
    /// `STREAM`: the KCL's stream metadata (keyed by stream identifier, `streamId`).
    KclStream,
    /// `CLIENT_VERSION_MIGRATION`: the KCL 2.x to 3.x migration state (key
    /// `Migration3.0`, state in `cv`).
    KclClientVersionMigration,
    /// `TABLE_MIGRATION`: the KCL 3.4 to 3.5 single-table migration state (key
    /// `TableMigration3.5`, state in `tm`).
    KclTableMigration,
    /// A row shardflow writes itself (an `entityType` starting with
    /// [`SHARDFLOW_ENTITY_PREFIX`]), with its `entityType`.
    Shardflow(String),
    /// Another `entityType` (a later KCL's, or another tool's), as written.
    Unknown(String),
}

impl EntityKind {
    /// The kind of `entityType` `value`.
    pub fn from_attribute(value: &str) -> EntityKind {
        match value {
            "LEADER" => EntityKind::KclLeader,
            "WORKER_METRIC_STATS" => EntityKind::KclWorkerMetrics,
            "STREAM" => EntityKind::KclStream,
            "CLIENT_VERSION_MIGRATION" => EntityKind::KclClientVersionMigration,
            "TABLE_MIGRATION" => EntityKind::KclTableMigration,
            other if other.starts_with(SHARDFLOW_ENTITY_PREFIX) => {
                EntityKind::Shardflow(other.to_owned())
            }
            other => EntityKind::Unknown(other.to_owned()),
        }
    }

    /// Whether the row is shardflow's own (it goes with the group).
    pub fn is_shardflow(&self) -> bool {
        matches!(self, EntityKind::Shardflow(_))
    }
}

impl fmt::Display for EntityKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            EntityKind::KclLeader => f.write_str("KCL leader"),
            EntityKind::KclWorkerMetrics => f.write_str("KCL worker metrics"),
            EntityKind::KclStream => f.write_str("KCL stream metadata"),
            EntityKind::KclClientVersionMigration => f.write_str("KCL client-version migration"),
            EntityKind::KclTableMigration => f.write_str("KCL table migration"),
            EntityKind::Shardflow(entity) => write!(f, "shardflow {entity}"),
            EntityKind::Unknown(entity) => write!(f, "other ({entity})"),
        }
    }
}

/// A non-lease row of the lease table, as far as shardflow reads it (to show it and to
/// refuse a table in the middle of a KCL migration); the row itself is never written.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct EntityRow {
    /// The row's `leaseKey`.
    pub key: String,
    /// What it is.
    pub kind: EntityKind,
    /// The KCL leader's `ownerName`, if this is its lock.
    pub owner: Option<String>,
    /// A migration row's state: `cv` (client version) or `tm` (table migration status).
    pub state: Option<String>,
}

/// The key of the KCL's table-migration state (`TableMigrationState`).
pub const TABLE_MIGRATION_KEY: &str = "TableMigration3.5";

/// The client version that ends the KCL's 2.x to 3.x migration (`ClientVersion`).
pub const CLIENT_VERSION_DONE: &str = "CLIENT_VERSION_3X";

/// The table-migration status that ends the KCL's single-table migration
/// (`TableMigrationStatus`).
pub const TABLE_MIGRATION_DONE: &str = "TABLE_MIGRATION_STATUS_COMPLETE";

impl EntityRow {
    /// If this row says a KCL migration is under way (a client-version migration not at
    /// `CLIENT_VERSION_3X`, a table migration not at `TABLE_MIGRATION_STATUS_COMPLETE`,
    /// or either without a readable state), what it is and its state.
    pub fn unfinished_migration(&self) -> Option<(&'static str, String)> {
        let (what, done) = match self.kind {
            EntityKind::KclClientVersionMigration => (
                "the KCL 2.x to 3.x client-version migration",
                CLIENT_VERSION_DONE,
            ),
            EntityKind::KclTableMigration => {
                ("the KCL 3.5 single-table migration", TABLE_MIGRATION_DONE)
            }
            _ => return None,
        };
        match self.state.as_deref() {
            Some(state) if state == done => None,
            Some(state) => Some((what, state.to_owned())),
            None => Some((what, "no state".to_owned())),
        }
    }
}

/// What the non-lease rows of a table are, for people: kinds with their counts, the
/// leader's owner and the migration states, e.g. `KCL leader (worker-2), KCL worker
/// metrics (3 rows), KCL table migration: TABLE_MIGRATION_STATUS_COMPLETE`.
pub fn summarize(rows: &[EntityRow]) -> Vec<String> {
    let mut kinds: Vec<&EntityKind> = rows.iter().map(|r| &r.kind).collect();
    kinds.sort();
    kinds.dedup();
    kinds
        .into_iter()
        .map(|kind| {
            let of_kind: Vec<&EntityRow> = rows.iter().filter(|r| &r.kind == kind).collect();
            let states: Vec<String> = of_kind
                .iter()
                .filter_map(|r| r.state.clone().or_else(|| r.owner.clone()))
                .collect();
            match (of_kind.len(), kind) {
                (1, EntityKind::KclClientVersionMigration | EntityKind::KclTableMigration) => {
                    format!("{kind}: {}", states.first().map_or("no state", |s| s))
                }
                (1, _) if !states.is_empty() => format!("{kind} ({})", states[0]),
                (1, _) => format!("{kind} (1 row)"),
                (n, _) => format!("{kind} ({n} rows)"),
            }
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_rows_without_an_entity_type_or_with_lease_are_leases() {
        assert_eq!(RowKind::of(None), RowKind::Lease);
        assert_eq!(RowKind::of(Some("LEASE")), RowKind::Lease);
        for (value, kind) in [
            ("LEADER", EntityKind::KclLeader),
            ("WORKER_METRIC_STATS", EntityKind::KclWorkerMetrics),
            ("STREAM", EntityKind::KclStream),
            (
                "CLIENT_VERSION_MIGRATION",
                EntityKind::KclClientVersionMigration,
            ),
            ("TABLE_MIGRATION", EntityKind::KclTableMigration),
            (
                "SHARDFLOW_LEADER",
                EntityKind::Shardflow("SHARDFLOW_LEADER".into()),
            ),
            ("lease", EntityKind::Unknown("lease".into())),
            ("", EntityKind::Unknown(String::new())),
        ] {
            assert_eq!(RowKind::of(Some(value)), RowKind::Other(kind), "{value}");
        }
    }

    fn row(kind: EntityKind, state: Option<&str>) -> EntityRow {
        EntityRow {
            key: "k".into(),
            kind,
            owner: None,
            state: state.map(str::to_owned),
        }
    }

    #[test]
    fn a_migration_is_unfinished_until_the_kcl_says_it_is_done() {
        for state in [
            "TABLE_MIGRATION_STATUS_INIT",
            "TABLE_MIGRATION_STATUS_DEPLOYED",
            "TABLE_MIGRATION_STATUS_PENDING",
        ] {
            let r = row(EntityKind::KclTableMigration, Some(state));
            assert_eq!(r.unfinished_migration().map(|m| m.1), Some(state.into()));
        }
        assert_eq!(
            row(EntityKind::KclTableMigration, Some(TABLE_MIGRATION_DONE)).unfinished_migration(),
            None
        );
        for state in [
            "CLIENT_VERSION_INIT",
            "CLIENT_VERSION_UPGRADE_FROM_2X",
            "CLIENT_VERSION_2X",
            "CLIENT_VERSION_3X_WITH_ROLLBACK",
        ] {
            let r = row(EntityKind::KclClientVersionMigration, Some(state));
            assert!(r.unfinished_migration().is_some(), "{state}");
        }
        assert_eq!(
            row(
                EntityKind::KclClientVersionMigration,
                Some(CLIENT_VERSION_DONE)
            )
            .unfinished_migration(),
            None
        );
        assert!(row(EntityKind::KclTableMigration, None)
            .unfinished_migration()
            .is_some());
        assert_eq!(
            row(EntityKind::KclLeader, None).unfinished_migration(),
            None
        );
    }

    #[test]
    fn the_summary_names_each_kind_once() {
        let mut leader = row(EntityKind::KclLeader, None);
        leader.owner = Some("worker-2".into());
        let rows = vec![
            row(EntityKind::KclWorkerMetrics, None),
            leader,
            row(EntityKind::KclWorkerMetrics, None),
            row(EntityKind::KclTableMigration, Some(TABLE_MIGRATION_DONE)),
            row(EntityKind::KclStream, None),
        ];
        assert_eq!(
            summarize(&rows),
            vec![
                "KCL leader (worker-2)".to_owned(),
                "KCL worker metrics (2 rows)".to_owned(),
                "KCL stream metadata (1 row)".to_owned(),
                "KCL table migration: TABLE_MIGRATION_STATUS_COMPLETE".to_owned(),
            ]
        );
    }
}
