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
//! leases and how many hand-off requests are pending.
//!
//! `BENCH_SCENARIO=failover` instead kills one worker of each fleet once it is balanced
//! (a crash: no release) while a record goes into every shard every second, and prints
//! how long until each of its shards delivered again (p50 / max) and until the fleet is
//! balanced again; `BENCH_SCENARIO=scale-out` starts 30 workers, adds 10 once balanced
//! and prints how long until balanced again and the records handled twice (planned
//! hand-offs: none expected). Both default to 100 and 500 shards x 40 workers;
//! `BENCH_KILL=i` kills worker `i` (0: the first by name) instead of the middle one,
//! `BENCH_KILL=leader` the holder of the group's leader item;
//! `BENCH_CRASH=first:4|last:4|random:4|stop-first:4` runs the failover scenario once per
//! crash set instead: the first, last or random (seeded by `BENCH_SEED`) k workers by
//! name crash together, or (`stop-`) stop gracefully together.
//! `BENCH_SCENARIO=steady` lets balanced idle fleets of 500 shards x 4, 10 and 40
//! workers run for 10 simulated minutes and prints the lease-store calls per shard per
//! hour by kind, and the table rows the reads handed out (a `list` reads every row, an
//! `owned_keys` query one key per row the worker owns, a `get` one row).
//! `BENCH_SCENARIO=throughput` runs 100 shards x 10 workers whose record sizes (a
//! record into every shard every second) are Zipf draws (exponent 1.2, 1 to 100 units
//! of 100 bytes, seeded by `BENCH_ZIPF_SEED`, default 1), once balancing by count and
//! once by throughput, and prints per round (the take interval, 10 s) the most loaded
//! worker's load over the mean and the leases moved; then, once even, whether 30
//! rounds pass with no move, and how often the hottest shard moves in 10 rounds after
//! it cooled down to 1 unit.
//! `BENCH_SEED=n` changes the workers' seeds (default 11). Without `--bench`
//! (under `cargo test`) it makes one smoke run of 100 shards × 4 workers.

mod common;
use testkit::fleet;

use std::time::Duration;

use fleet::{leases_per_owner, zipf_record_sizes, Fleet};
use shardflow::BalanceBy;

/// The fleet of a size, with the seed `BENCH_SEED` names.
fn fleet_of(shards: u32, workers: usize) -> Fleet {
    let mut fleet = Fleet::new(shards, workers);
    if let Some(seed) = std::env::var("BENCH_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
    {
        fleet.seed = seed;
    }
    fleet
}

/// `fleet_of` with a record put into every shard every second.
fn fed(shards: u32, workers: usize) -> Fleet {
    Fleet {
        feed_every: Some(Duration::from_secs(1)),
        ..fleet_of(shards, workers)
    }
}

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
    match std::env::var("BENCH_SCENARIO").as_deref() {
        Ok("failover") => return failover(),
        Ok("scale-out") => return scale_out(),
        Ok("steady") => return steady(),
        Ok("throughput") => return throughput(),
        _ => {}
    }
    println!("| shards | workers | every shard delivered | balanced | leases per worker (min-max) | store requests until balanced | of which creates / lists / takes | wall time |");
    println!("|---|---|---|---|---|---|---|---|");
    for (shards, workers) in sizes() {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .start_paused(true)
            .build()
            .expect("a tokio runtime");
        let wall = std::time::Instant::now();
        runtime.block_on(async {
            let running = fleet::start(fleet_of(shards, workers)).await;
            let delivered = running.until(LIMIT, |r| r.all_delivered()).await;
            let balanced = if std::env::var_os("BENCH_TIMELINE").is_some() {
                timeline(&running).await
            } else {
                running.until(LIMIT, |r| r.balanced()).await
            };
            let requests = running.memory.table(fleet::GROUP).requests();
            let (creates, lists, takes) = {
                let calls = running.calls.lock().expect("the call log");
                let count = |op: &str| calls.iter().filter(|c| c.op == op).count();
                (count("create"), count("list"), count("take"))
            };
            let counts = leases_per_owner(&running.memory);
            let min = counts.values().min().copied().unwrap_or(0);
            let max = counts.values().max().copied().unwrap_or(0);
            let show = |d: Option<Duration>| match d {
                Some(d) => format!("{:.2} s", d.as_secs_f64()),
                None => format!("not within {} s", LIMIT.as_secs()),
            };
            println!(
                "| {shards} | {workers} | {} | {} | {min}-{max} | {requests} | {creates} / {lists} / {takes} | {:.1} s |",
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
                let n = r.fleet.shards as usize / r.fleet.workers;
                let short: Vec<String> = counts
                    .iter()
                    .filter(|(_, c)| **c < n)
                    .map(|(w, c)| {
                        let asked = rows
                            .iter()
                            .filter(|l| l.pending_owner.as_deref() == Some(w.as_str()))
                            .count();
                        format!("{}:{c}+{asked}", &w[..4])
                    })
                    .collect();
                let shown: Vec<String> = std::iter::once(format!("0x{idle}"))
                    .chain(histogram.iter().map(|(c, n)| format!("{c}x{n}")))
                    .collect();
                eprintln!(
                    "  {:6.2} s: {} | pending {pending} free {free} | short {}",
                    at.as_secs_f64(),
                    shown.join(" "),
                    short.join(" ")
                );
            }
            r.balanced()
        })
        .await
}

/// The sizes of the failover and scale-out scenarios.
fn fleet_sizes() -> Vec<(u32, usize)> {
    match std::env::var("BENCH_SIZES") {
        Ok(_) => sizes(),
        Err(_) => vec![(100, 40), (500, 40)],
    }
}

fn paused_runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .start_paused(true)
        .build()
        .expect("a tokio runtime")
}

fn show(d: Option<Duration>) -> String {
    match d {
        Some(d) => format!("{:.2} s", d.as_secs_f64()),
        None => "never".to_owned(),
    }
}

/// A set of workers that go together: `first:k`, `last:k`, `random:k`, each with a
/// `stop-` prefix for a graceful stop; the workers' indices and whether they stop.
fn crash_set(spec: &str, workers: usize, seed: u64) -> Option<(Vec<usize>, bool)> {
    use rand::seq::SliceRandom;
    use rand::SeedableRng;
    let (stop, spec) = match spec.strip_prefix("stop-") {
        Some(rest) => (true, rest),
        None => (false, spec),
    };
    let (kind, k) = spec.split_once(':')?;
    let k: usize = k.parse().ok()?;
    let k = k.min(workers.saturating_sub(1));
    let which = match kind {
        "first" => (0..k).collect(),
        "last" => (workers - k..workers).collect(),
        "random" => {
            let mut all: Vec<usize> = (0..workers).collect();
            all.shuffle(&mut rand::rngs::SmallRng::seed_from_u64(seed));
            all.truncate(k);
            all
        }
        _ => return None,
    };
    Some((which, stop))
}

/// Workers of a balanced fleet crash (or stop); how long until their shards deliver
/// again.
fn failover() {
    println!("| shards | workers | crash set | leases of those workers | read again p50 | read again max | balanced again | records handled twice (of them on their shards) | wall time |");
    println!("|---|---|---|---|---|---|---|---|---|");
    let sets: Vec<String> = match std::env::var("BENCH_CRASH") {
        Ok(sets) => sets.split('|').map(str::to_owned).collect(),
        Err(_) => vec![String::new()],
    };
    for (shards, workers) in fleet_sizes() {
        for set in &sets {
            let wall = std::time::Instant::now();
            paused_runtime().block_on(async {
            let mut running = fleet::start(fed(shards, workers)).await;
            let balanced = running.until(LIMIT, |r| r.balanced()).await;
            assert!(balanced.is_some(), "{shards}x{workers} did not balance");
            let killed_at = tokio::time::Instant::now();
            let orphans = if set.is_empty() {
                // BENCH_KILL=0 kills the first by name instead, BENCH_KILL=leader the leader.
                let victim = match std::env::var("BENCH_KILL").as_deref() {
                    Ok("leader") => running.leader().expect("a balanced fleet has a leader"),
                    _ => common::env_or("BENCH_KILL", workers / 2),
                };
                running.kill(victim.min(workers - 1))
            } else {
                let seed = common::env_or("BENCH_SEED", 11);
                let (which, stop) = crash_set(set, workers, seed)
                    .unwrap_or_else(|| panic!("BENCH_CRASH: {set:?} is not first:k, last:k or random:k (stop- before for a graceful stop)"));
                if stop {
                    running.stop_workers(&which).await
                } else {
                    which.iter().flat_map(|&i| running.kill(i)).collect()
                }
            };
            let mut again: Vec<Option<Duration>> = vec![None; orphans.len()];
            running
                .until(LIMIT * 2, |r| {
                    for (key, at) in orphans.iter().zip(again.iter_mut()) {
                        if at.is_none() && r.delivered_after(key, killed_at) {
                            *at = Some(killed_at.elapsed());
                        }
                    }
                    again.iter().all(Option::is_some)
                })
                .await;
            let rebalanced = running
                .until(LIMIT * 2, |r| r.balanced())
                .await
                .map(|_| killed_at.elapsed());
            let mut times: Vec<Duration> = again.iter().flatten().copied().collect();
            let (p50, max) = if times.len() == orphans.len() && !times.is_empty() {
                (
                    Some(common::median(&mut times)),
                    times.iter().max().copied(),
                )
            } else {
                (None, None)
            };
            let twice = running.duplicates();
            let on_orphans = twice.iter().filter(|(s, ..)| orphans.contains(s)).count();
            println!(
                "| {shards} | {workers} | {} | {} | {} | {} | {} | {} ({on_orphans}) | {:.1} s |",
                if set.is_empty() { "one" } else { set.as_str() },
                orphans.len(),
                show(p50),
                show(max),
                show(rebalanced),
                twice.len(),
                wall.elapsed().as_secs_f64()
            );
            running.stop().await;
        });
        }
    }
}

/// 10 workers join a balanced fleet of 30: balanced again, with no record twice.
fn scale_out() {
    println!("| shards | workers | balanced at the start | balanced again after 10 joined | records handled twice | every record handled | wall time |");
    println!("|---|---|---|---|---|---|---|");
    for (shards, workers) in fleet_sizes() {
        let wall = std::time::Instant::now();
        let first = workers.saturating_sub(10).max(1);
        paused_runtime().block_on(async {
            let mut running = fleet::start(fed(shards, first)).await;
            let balanced = running.until(LIMIT, |r| r.balanced()).await;
            let joined_at = tokio::time::Instant::now();
            running.add_workers(workers - first);
            let again = running
                .until(LIMIT * 2, |r| r.balanced())
                .await
                .map(|_| joined_at.elapsed());
            running.stop_feed();
            let handled = running.until(LIMIT * 3, |r| r.all_handled()).await;
            println!(
                "| {shards} | {first} + {} | {} | {} | {} | {} | {:.1} s |",
                workers - first,
                show(balanced),
                show(again),
                running.duplicates().len(),
                if handled.is_some() { "yes" } else { "no" },
                wall.elapsed().as_secs_f64()
            );
            running.stop().await;
        });
    }
}

/// Balanced idle fleets: lease-store calls per shard-hour by kind, and the rows the reads
/// handed out (a `list` reads every row, `owned_keys` one key per row the worker owns, a
/// `get` one row), which must not grow with the number of workers.
fn steady() {
    println!("per shard-hour:");
    println!(
        "| shards | workers | renew | checkpoint | list | owned_keys | get | take | leader get | leader renew | other | rows read: lists | owner index | gets | all | read units |"
    );
    println!("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|");
    let minutes: u64 = common::env_or("BENCH_MINUTES", if common::measuring() { 10 } else { 1 });
    let sizes = match std::env::var("BENCH_SIZES") {
        Ok(_) => sizes(),
        Err(_) => vec![(500, 4), (500, 10), (500, 40)],
    };
    for (shards, workers) in sizes {
        paused_runtime().block_on(async {
            let running = fleet::start(fleet_of(shards, workers)).await;
            let balanced = running.until(LIMIT, |r| r.balanced()).await;
            assert!(balanced.is_some(), "{shards}x{workers} did not balance");
            // A minute to settle, then the measured window.
            tokio::time::sleep(Duration::from_secs(60)).await;
            let from = tokio::time::Instant::now();
            let read_before = running.memory.table(fleet::GROUP).rows_read();
            tokio::time::sleep(Duration::from_secs(60 * minutes)).await;
            let read = running.memory.table(fleet::GROUP).rows_read();
            let calls = running.calls.lock().expect("the call log").clone();
            let window: Vec<&fleet::Call> = calls.iter().filter(|c| c.at >= from).collect();
            let hours = minutes as f64 / 60.0;
            let per = |n: u64| n as f64 / f64::from(shards) / hours;
            let count = |op: &str| window.iter().filter(|c| c.op == op).count() as u64;
            let kinds = [
                "renew",
                "checkpoint",
                "list",
                "owned_keys",
                "get",
                "take",
                "leader_get",
                "leader_renew",
            ];
            let counted: Vec<u64> = kinds.iter().map(|op| count(op)).collect();
            let other = window.len() as u64 - counted.iter().sum::<u64>();
            let listed = read.listed - read_before.listed;
            let owned = read.owned - read_before.owned;
            let fetched = read.fetched - read_before.fetched;
            // Read units as DynamoDB bills them, eventually consistent: a Scan half a
            // unit per 4 KB of rows (about 300 bytes each), a Query or GetItem at least
            // half a unit (the keys of one worker's Query fit in 4 KB), the leader item's
            // GetItem half a unit.
            let units = listed as f64 * 300.0 / 4096.0 * 0.5
                + 0.5 * (counted[3] + counted[4] + counted[6]) as f64;
            println!(
                "| {shards} | {workers} | {:.0} | {:.0} | {:.1} | {:.1} | {:.1} | {:.1} | {:.1} | {:.1} | {:.1} | {:.0} | {:.0} | {:.0} | {:.0} | {:.0} |",
                per(counted[0]),
                per(counted[1]),
                per(counted[2]),
                per(counted[3]),
                per(counted[4]),
                per(counted[5]),
                per(counted[6]),
                per(counted[7]),
                per(other),
                per(listed),
                per(owned),
                per(fetched),
                per(listed + owned + fetched),
                units / f64::from(shards) / hours,
            );
            running.stop().await;
        });
    }
}

/// One balancing round: the default take interval (the lease duration).
const ROUND: Duration = Duration::from_secs(10);

/// Leases whose owner changed between two listings of the table.
fn moved(
    before: &std::collections::BTreeMap<String, Option<String>>,
    after: &std::collections::BTreeMap<String, Option<String>>,
) -> Vec<String> {
    after
        .iter()
        .filter(|(k, o)| o.is_some() && before.get(*k).is_some_and(|b| b.is_some() && b != *o))
        .map(|(k, _)| k.clone())
        .collect()
}

/// `BENCH_SCENARIO=throughput`: see the module docs.
fn throughput() {
    let measuring = common::measuring();
    let (shards, workers) = if measuring { (100, 10) } else { (20, 4) };
    let unit = 100;
    let sizes = zipf_record_sizes(shards, common::env_or("BENCH_ZIPF_SEED", 1), unit);
    let hottest = (0..shards).max_by_key(|i| sizes[*i]).unwrap_or(0);
    let total: usize = sizes.iter().sum();
    println!(
        "{shards} shards x {workers} workers; loads (units of {unit} B/s): total {}, hottest {} ({:.2}x the mean per worker)",
        total / unit,
        sizes[hottest] / unit,
        sizes[hottest] as f64 * workers as f64 / total as f64
    );
    for by in [BalanceBy::Count, BalanceBy::Throughput] {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .start_paused(true)
            .build()
            .expect("a tokio runtime");
        let wall = std::time::Instant::now();
        runtime.block_on(async {
            let mut running = fleet::start(Fleet {
                feed_every: Some(Duration::from_secs(1)),
                record_sizes: Some(sizes.clone()),
                balance_by: by,
                ..fleet_of(shards as u32, workers)
            })
            .await;
            running
                .until(LIMIT, |r| r.load_ratio().is_some())
                .await
                .expect("every shard leased");
            let mut owners = running.owners();
            let mut ratios = Vec::new();
            let mut moves = Vec::new();
            let mut even_at = None;
            let mut quiet = 0;
            // Until even and then 30 rounds with no move, 60 rounds at most (and 8 by
            // count, which never moves once balanced).
            let rounds = if by == BalanceBy::Count { 8 } else { 60 };
            for round in 1..=rounds {
                tokio::time::sleep(ROUND).await;
                let now = running.owners();
                let n = moved(&owners, &now).len();
                owners = now;
                let ratio = running.load_ratio().unwrap_or(f64::NAN);
                ratios.push(ratio);
                moves.push(n);
                if even_at.is_none() && ratio <= 1.15 {
                    even_at = Some(round);
                }
                if even_at.is_some() {
                    quiet = if n == 0 { quiet + 1 } else { 0 };
                }
                if quiet >= 30 {
                    break;
                }
            }
            let most = moves.iter().max().copied().unwrap_or(0);
            println!(
                "{by:?}: max/mean per round {:?}; moved per round {:?}; even (<= 1.15) at round {even_at:?}; most moved in a round {most} ({:.0} % of the leases); rounds with no move at the end {quiet}; wall {:.1} s",
                ratios.iter().map(|r| format!("{r:.3}")).collect::<Vec<_>>(),
                moves,
                most as f64 * 100.0 / shards as f64,
                wall.elapsed().as_secs_f64()
            );
            if by == BalanceBy::Throughput {
                // The hottest shard cools down to one unit: it is not chased.
                let mut cooled = sizes.clone();
                cooled[hottest] = unit;
                running.set_record_sizes(cooled);
                let key = format!("shardId-{hottest:012}");
                let mut shard_moves = 0;
                let mut all = Vec::new();
                for _ in 0..10 {
                    tokio::time::sleep(ROUND).await;
                    let now = running.owners();
                    let m = moved(&owners, &now);
                    shard_moves += m.iter().filter(|k| **k == key).count();
                    all.push(m.len());
                    owners = now;
                }
                println!(
                    "after the hottest shard cooled down: it moved {shard_moves} times in 10 rounds; moved per round {all:?}; max/mean {:.2}",
                    running.load_ratio().unwrap_or(f64::NAN)
                );
                assert!(measuring || even_at.is_some(), "the smoke run did not even out");
            }
            running.stop_feed();
            // From now: the rounds above may have run past LIMIT since the start.
            let handled = running.within(LIMIT, |r| r.all_handled()).await;
            let handled_records = running.handled.lock().expect("the handled log").len();
            let put = *running.put.lock().expect("the put count");
            let duplicates = running.duplicates().len();
            println!(
                "{by:?}: every record handled: {} ({handled_records} of {put}); duplicates {duplicates}",
                handled.is_some(),
            );
            running.stop().await;
        });
    }
}
