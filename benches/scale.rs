//! Start-up of a consumer group at scale, in simulated time: every worker of the group
//! starts at the same moment (workers as tasks in one process, the embedded backend with
//! 8 ms per lease-store call and 25 ms per Kinesis call, tokio's paused clock so 2 cores
//! cannot distort the figures), one record waits in every shard.
//!
//! ```text
//! cargo bench --bench scale
//! ```
//!
//! Prints, for 100, 500 and 2,000 shards × 4, 10 and 40 workers: the simulated time until
//! every shard delivered its record, until the leases are balanced (every worker within
//! one of the fair share), the leases per worker then, and the lease-store requests
//! until balanced. `BENCH_SIZES=shards:workers,...` picks other sizes. Without `--bench`
//! (under `cargo test`) it makes one smoke run of 100 shards × 4 workers.

mod common;
#[path = "../tests/fleet/mod.rs"]
mod fleet;

use std::time::Duration;

use fleet::{leases_per_owner, Fleet};

/// Give up on balance after this much simulated time.
const LIMIT: Duration = Duration::from_secs(300);

fn sizes() -> Vec<(u32, usize)> {
    if !common::measuring() {
        return vec![(100, 4)];
    }
    if let Ok(list) = std::env::var("BENCH_SIZES") {
        return list
            .split(',')
            .filter_map(|pair| {
                let (s, w) = pair.split_once(':')?;
                Some((s.trim().parse().ok()?, w.trim().parse().ok()?))
            })
            .collect();
    }
    let mut all = Vec::new();
    for shards in [100, 500, 2_000] {
        for workers in [4, 10, 40] {
            all.push((shards, workers));
        }
    }
    all
}

fn main() {
    println!("| shards | workers | every shard delivered | balanced | leases per worker (min-max) | store requests until balanced | wall time |");
    println!("|---|---|---|---|---|---|---|");
    for (shards, workers) in sizes() {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .start_paused(true)
            .build()
            .expect("a tokio runtime");
        let wall = std::time::Instant::now();
        runtime.block_on(async {
            let running = fleet::start(Fleet::new(shards, workers)).await;
            let delivered = running.until(LIMIT, |r| r.all_delivered()).await;
            let balanced = running.until(LIMIT, |r| r.balanced()).await;
            let requests = running.memory.table(fleet::GROUP).requests();
            let counts = leases_per_owner(&running.memory);
            let min = counts.values().min().copied().unwrap_or(0);
            let max = counts.values().max().copied().unwrap_or(0);
            let show = |d: Option<Duration>| match d {
                Some(d) => format!("{:.2} s", d.as_secs_f64()),
                None => format!("not within {} s", LIMIT.as_secs()),
            };
            println!(
                "| {shards} | {workers} | {} | {} | {min}-{max} | {requests} | {:.1} s |",
                show(delivered),
                show(balanced),
                wall.elapsed().as_secs_f64()
            );
            assert!(
                common::measuring() || balanced.is_some(),
                "the smoke run did not balance"
            );
            running.stop().await;
        });
    }
}
