//! Balancing a consumer group: a fleet started together shares the leases at once,
//! hand-off requests end with their shards, and late lease answers hand nothing out twice.

mod ended_requests;
mod late_answers;
mod started_together;
