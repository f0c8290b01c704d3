//! Shard discovery and resharding: parents before children, stale listings, reads cut
//! short on closed shards, first syncs cut short, and rows kept until past retention.

mod first_sync;
mod paths;
mod stale_listings;
