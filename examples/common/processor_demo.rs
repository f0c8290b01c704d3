//! The `processor` example's command line and demo. Without flags it runs the demo:
//! fresh streams, the orders written, the example's `process` and `warehouse` until every
//! order was shipped. With `--orders`, `--shipments` and `--group` it is one processor
//! worker on AWS (`tests/processor/processes.rs` starts it so, kills it, starts another).

use clap::Parser;
use tokio::sync::watch;

use crate::common::{self, AnyBackend};
use crate::{process, warehouse, ORDERS};

/// orders → enrich → shipments, the checkpoint after the shipment is stored. Without
/// `--orders`: the demo (both streams created, 1,000 orders, a warehouse behind).
#[derive(Parser, Debug)]
#[command(name = "processor")]
pub struct Args {
    /// Run as one processor worker on AWS, reading this (existing) orders stream.
    #[arg(long, requires_all = ["shipments", "group"])]
    orders: Option<String>,
    /// The (existing) stream the shipments go to (worker mode).
    #[arg(long)]
    shipments: Option<String>,
    /// The processors' consumer group (worker mode).
    #[arg(long)]
    group: Option<String>,
    /// This worker's id (worker mode).
    #[arg(long, default_value = "processor")]
    worker: String,
}

impl Args {
    /// `[orders, shipments, group, worker]` in worker mode; `None` for the demo.
    pub fn worker(&self) -> Option<[&str; 4]> {
        match (&self.orders, &self.shipments, &self.group) {
            (Some(orders), Some(shipments), Some(group)) => {
                Some([orders, shipments, group, &self.worker])
            }
            _ => None,
        }
    }
}

/// The demo on the backend the environment chooses (see [`AnyBackend`]).
pub async fn run() -> common::Result {
    let backend = AnyBackend::from_env().await;
    let [orders, shipments, group] = ["orders", "shipments", "shipping"].map(common::unique);
    let orders_data = (0..ORDERS).map(customer_order);
    common::create_stream_with(&backend, &orders, 2, orders_data).await?;
    common::create_stream_with(&backend, &shipments, 2, []).await?;
    let (shipped, _) = watch::channel(0);
    let all_shipped = common::at_least(shipped.subscribe(), ORDERS);
    let names = [orders.as_str(), &shipments, &group, "p1"];
    tokio::try_join!(
        process(backend.clone(), names, all_shipped),
        warehouse(backend, &shipments, shipped),
    )?;
    println!("{ORDERS} orders shipped");
    Ok(())
}

/// Order `i` of 37 customers as `(partition key, JSON)`; `n` counts each customer's
/// orders (0, 1, 2, ...).
fn customer_order(i: usize) -> (String, String) {
    let customer = format!("customer-{}", i % 37);
    let json = format!(r#"{{"id":{i},"customer":"{customer}","n":{}}}"#, i / 37);
    (customer, json)
}
