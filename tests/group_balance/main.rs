//! Balancing a consumer group: a fleet started together shares the leases at once,
//! hand-off requests end with their shards, late lease answers hand nothing out twice, and
//! skewed shards are spread by throughput.

mod by_throughput;
mod chaos;
mod ended_requests;
mod late_answers;
mod started_together;
