//! The single-instance consumer over real HTTP against the Kinesis and DynamoDB
//! emulators that `scripts/test.sh` starts (skipped when `SHARDFLOW_EMULATORS` is unset).

mod common;

use std::time::Duration;

use common::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reshard_while_consuming_on_emulators() {
    if !emulators_enabled() {
        return;
    }
    let aws = shardflow::Aws::from_env().await;
    reshard_while_consuming(aws, &unique("reshard"), 10_000, Duration::from_secs(120)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kpl_aggregates_resume_inside_an_aggregate_on_emulators() {
    if !emulators_enabled() {
        return;
    }
    let aws = shardflow::Aws::from_env().await;
    kpl_aggregates_resume_inside_an_aggregate(aws, &unique("kpl"), Duration::from_secs(120)).await;
}
