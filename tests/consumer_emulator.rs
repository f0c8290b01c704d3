//! The single-instance consumer over real HTTP against the Kinesis and DynamoDB
//! emulators that `scripts/test.sh` starts (skipped when `SHARDFLOW_EMULATORS` is unset).

mod common;

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use common::*;

fn enabled() -> bool {
    let on = std::env::var_os("SHARDFLOW_EMULATORS").is_some();
    if !on {
        eprintln!("skipped: SHARDFLOW_EMULATORS not set (run scripts/test.sh)");
    }
    on
}

fn unique(prefix: &str) -> String {
    let nanos = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .subsec_nanos();
    format!("{prefix}-{}-{nanos}", std::process::id())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reshard_while_consuming_on_emulators() {
    if !enabled() {
        return;
    }
    let aws = shardflow::Aws::from_env().await;
    reshard_while_consuming(aws, &unique("reshard"), 10_000, Duration::from_secs(120)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kpl_aggregates_resume_inside_an_aggregate_on_emulators() {
    if !enabled() {
        return;
    }
    let aws = shardflow::Aws::from_env().await;
    kpl_aggregates_resume_inside_an_aggregate(aws, &unique("kpl"), Duration::from_secs(120)).await;
}
