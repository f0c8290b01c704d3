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
//! until balanced. `BENCH_SIZES=shards:workers,...` picks other sizes; `BENCH_TIMELINE=1`
//! also prints, every simulated second until balanced, how many workers hold how many
//! leases and how many hand-off requests are pending. Without `--bench`
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
            let balanced = if std::env::var_os("BENCH_TIMELINE").is_some() {
                timeline(&running).await
            } else {
                running.until(LIMIT, |r| r.balanced()).await
            };
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

/// Waits for balance like `Running::until`, printing every simulated second how many
/// workers hold how many leases (`leases x workers`) and the pending hand-off requests.
async fn timeline(running: &fleet::Running) -> Option<Duration> {
    let mut next = Duration::ZERO;
    running
        .until(LIMIT, |r| {
            let at = r.started.elapsed();
            if at >= next {
                next = at + Duration::from_secs(1);
                let rows = r.memory.table(fleet::GROUP).rows();
                let pending = rows.iter().filter(|l| l.pending_owner.is_some()).count();
                let free = rows.iter().filter(|l| l.owner.is_none()).count();
                let counts = leases_per_owner(&r.memory);
                let idle = r.fleet.workers - counts.len();
                let mut histogram = std::collections::BTreeMap::new();
                for c in counts.values() {
                    *histogram.entry(*c).or_insert(0) += 1;
                }
                let shown: Vec<String> = std::iter::once(format!("0x{idle}"))
                    .chain(histogram.iter().map(|(c, n)| format!("{c}x{n}")))
                    .collect();
                eprintln!(
                    "  {:6.2} s: {} | pending {pending} free {free}",
                    at.as_secs_f64(),
                    shown.join(" ")
                );
            }
            r.balanced()
        })
        .await
}
