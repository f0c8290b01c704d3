//! The single-instance consumer over real HTTP against the Kinesis and DynamoDB
//! emulators that `scripts/test.sh` starts (skipped when `SHARDFLOW_EMULATORS` is unset).

use std::time::Duration;

use testkit::*;

/// A whole test, remote calls included: an emulator that stops answering fails it.
const TEST_LIMIT: Duration = Duration::from_secs(600);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reshard_while_consuming_on_emulators() {
    if !emulators_enabled() {
        return;
    }
    let aws = shardflow::Aws::from_env().await;
    let stream = unique("reshard");
    let scenario = reshard_while_consuming(aws, &stream, 10_000, Duration::from_secs(120));
    within(
        TEST_LIMIT,
        "the reshard scenario on the emulators",
        scenario,
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kpl_aggregates_resume_inside_an_aggregate_on_emulators() {
    if !emulators_enabled() {
        return;
    }
    let aws = shardflow::Aws::from_env().await;
    let stream = unique("kpl");
    let scenario =
        kpl_aggregates_resume_inside_an_aggregate(aws, &stream, Duration::from_secs(120));
    within(TEST_LIMIT, "the KPL scenario on the emulators", scenario).await;
}
