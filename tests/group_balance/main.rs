//! Balancing a consumer group: a fleet started together shares the leases at once,
//! hand-off requests end with their shards, late lease answers hand nothing out twice,
//! skewed shards are spread by throughput, and throughput balancing under kills, restarts
//! and freezes loses nothing and hands off without duplicates.

mod by_throughput;
mod chaos;
mod ended_requests;
mod late_answers;
mod started_together;
