//! One worker process of a consumer group: run several with the same `--group` and they
//! share the stream's shards through leases in DynamoDB.
//!
//! The rule it shows: a record's line is written and flushed to stdout before its handler
//! returns `Ok`, so no checkpoint passes a record whose line is not out. SIGTERM or SIGINT
//! drains, commits the checkpoints and releases the leases (exit 0): the others take the
//! shards over without repeats; after a crash a record may be printed again (at least
//! once). Always on AWS, configured by the standard AWS environment (`AWS_ENDPOINT_URL*`
//! for an emulator). The flags and the output format: `common/group_cli.rs` or `--help`.
//!
//! ```text
//! cargo run --release --example consumer_group -- \
//!     --stream NAME --group NAME --worker ID [--create-stream SHARDS] [OPTIONS]
//! ```

mod common;
#[path = "common/group_cli.rs"]
mod group_cli;

use std::io::Write;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

use clap::Parser;
use common::Until;
use group_cli::{Args, Line};
use shardflow::{Aws, Consumer, Message};

#[tokio::main]
async fn main() -> ExitCode {
    let args = Args::parse();
    common::init_tracing("warn,shardflow=info,consumer_group=info");
    let result = match common::shutdown_signal() {
        Ok(shutdown) => run(args, shutdown).await,
        Err(e) => Err(format!("cannot listen for SIGTERM/SIGINT: {e}").into()),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            tracing::error!(error = %e, "the worker stopped with an error");
            ExitCode::FAILURE
        }
    }
}

async fn run(args: Args, shutdown: Until) -> common::Result {
    if let Some(addr) = args.metrics_addr {
        metrics_exporter_prometheus::PrometheusBuilder::new()
            .with_http_listener(addr)
            .install()?;
    }
    let aws = Aws::from_env().await;
    if let Some(shards) = args.create_stream {
        let admin = common::admin(&aws)?;
        admin.create_stream(&args.stream, shards).await?; // waits until it is active
    }
    let builder = Consumer::builder()
        .stream(&args.stream)
        .group(&args.group)
        .worker_id(&args.worker) // unique within the group
        .backend(aws);
    let consumer = args.options(builder).build()?; // timings, position, fan-out, ...
    let lease_table = consumer.config().lease_table();
    tracing::info!(worker = %args.worker, lease_table, "worker starting");

    // The line is written and flushed inside `call`, before the (already finished) future
    // reports `Ok`: only then may the checkpoint pass the record. A failed write (stdout
    // closed) is a handler error: the shard reads again from its checkpoint after a backoff.
    let (worker, timestamps): (Arc<str>, _) = (args.worker.into(), args.timestamps);
    let handler = tower::service_fn(move |msg: Message| {
        let printed = print_line(&worker, &msg, timestamps);
        async move { printed }
    });
    let mut running = consumer.run(handler).until(shutdown).spawn();
    // The health signal as gauges, for a probe that scrapes the metrics.
    let mut tick = tokio::time::interval(Duration::from_secs(1));
    loop {
        tokio::select! {
            result = &mut running => break result?,
            _ = tick.tick() => {
                let health = running.health();
                metrics::gauge!("consumer_group_live").set(f64::from(u8::from(health.is_live())));
                metrics::gauge!("consumer_group_ready").set(f64::from(u8::from(health.is_ready())));
            }
        }
    }
    tracing::info!("worker stopped");
    Ok(())
}

fn print_line(worker: &str, msg: &Message, timestamps: bool) -> std::io::Result<()> {
    let mut out = std::io::stdout().lock();
    // Made under the lock: within one process, line order is timestamp order.
    serde_json::to_writer(&mut out, &Line::new(worker, msg, timestamps))?;
    out.write_all(b"\n")?;
    out.flush()
}
