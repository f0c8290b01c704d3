//! The README's main example, the multi-stream example, the pipeline, the processor and CDC
//! run to completion on the embedded backend, and their rules are checked here from what
//! they print (the examples only show, they do not check themselves): the quickstart's
//! records per shard, split and checkpoints; each stream of the multi-stream example read
//! once, its rows kept; the pipeline charging each good order once and dead-lettering each
//! bad one; the processor shipping each order once and in order per customer; the CDC
//! example publishing each order inserted into its outbox table once.
//!
//! Each test builds its example first (`common::build_example`: a no-op when the suite
//! already built the examples), so it always runs the current code and never skips. A run
//! that does not end within [`RUN_LIMIT`] is killed and fails the test.

use testkit as common;

use std::collections::BTreeMap;
use std::io::Read;
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::sync::mpsc;
use std::time::Duration;

/// How long one example may run.
const RUN_LIMIT: Duration = Duration::from_secs(120);

/// Removes the test's private directory (and its link to the example binary) at the end,
/// passed or failed.
struct TempDir(PathBuf);

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// Runs example `name` to its end (at most [`RUN_LIMIT`]) and returns its stdout; fails
/// the test when it exits non-zero or does not end in time.
fn run(name: &str) -> String {
    // One directory per example and process: the two tests run in parallel, and several
    // runs of this binary may too.
    let dir = TempDir(
        PathBuf::from(env!("CARGO_TARGET_TMPDIR"))
            .join("examples")
            .join(format!("{name}-{}", std::process::id())),
    );
    let path = common::build_example(name, &dir.0);
    let mut child = Command::new(&path)
        .env_remove("AWS_ENDPOINT_URL_KINESIS")
        .env_remove("SHARDFLOW_BACKEND")
        .env("RUST_LOG", "error")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("the example starts");
    // Readers on threads: each sends what it read once its pipe closes (the example
    // ended), so the wait below has a deadline without polling.
    let (tx, rx) = mpsc::channel();
    for (which, mut pipe) in [
        (
            "stdout",
            Box::new(child.stdout.take().unwrap()) as Box<dyn Read + Send>,
        ),
        ("stderr", Box::new(child.stderr.take().unwrap())),
    ] {
        let tx = tx.clone();
        std::thread::spawn(move || {
            let mut text = Vec::new();
            let _ = pipe.read_to_end(&mut text);
            let _ = tx.send((which, String::from_utf8_lossy(&text).into_owned()));
        });
    }
    let mut output = BTreeMap::new();
    for _ in 0..2 {
        match rx.recv_timeout(RUN_LIMIT) {
            Ok((which, text)) => {
                output.insert(which, text);
            }
            Err(_) => {
                let _ = child.kill();
                let _ = child.wait();
                panic!("{name} did not end within {RUN_LIMIT:?} (killed)");
            }
        }
    }
    let status = child.wait().expect("the example's exit status");
    let (stdout, stderr) = (output["stdout"].clone(), output["stderr"].clone());
    assert!(
        status.success(),
        "{name} failed ({status}): {stdout}\n{stderr}"
    );
    stdout
}

#[test]
fn quickstart_handles_every_record_and_says_so() {
    let stdout = run("quickstart");
    eprintln!("{stdout}");
    let line = |prefix: &str| {
        stdout
            .lines()
            .find(|l| l.starts_with(prefix))
            .unwrap_or_else(|| panic!("no line starting {prefix:?} in:\n{stdout}"))
    };
    // "Split shardId-000000000000 → shardId-000000000004 + shardId-000000000005."
    let split = line("Split ").trim_end_matches('.');
    let (parent, children) = split["Split ".len()..]
        .split_once(" → ")
        .expect("Split PARENT → CHILDREN");
    let children: Vec<&str> = children.split(" + ").collect();
    assert_eq!(children.len(), 2, "a split has two children: {split}");
    // "Handled 4000 records in 0.1 s:"
    let handled = line("Handled ");
    assert!(
        handled.starts_with("Handled 4000 records in ") && handled.ends_with(" s:"),
        "{handled}"
    );
    // "  shardId-...: N records, checkpoint SHARD_END (...)" or "... checkpoint at record N".
    let mut shards = BTreeMap::new();
    for l in stdout.lines().filter(|l| l.starts_with("  shardId-")) {
        let (shard, rest) = l.trim().split_once(": ").expect("shard: ...");
        let (count, checkpoint) = rest
            .split_once(" records, checkpoint ")
            .expect("N records, checkpoint ...");
        let count: usize = count.parse().expect("a record count");
        shards.insert(shard.to_owned(), (count, checkpoint.to_owned()));
    }
    assert_eq!(shards.len(), 6, "four shards and two children: {shards:?}");
    assert_eq!(shards.values().map(|(n, _)| n).sum::<usize>(), 4_000);
    for (shard, (count, checkpoint)) in &shards {
        if shard == parent {
            assert!(checkpoint.starts_with("SHARD_END"), "{shard}: {checkpoint}");
        } else {
            // Every record handled: the checkpoint is at the shard's last one.
            assert_eq!(checkpoint, &format!("at record {count}"), "{shard}");
        }
    }
    for child in &children {
        assert!(
            shards[*child].0 > 0,
            "the child {child} was read after the split"
        );
    }
}

#[test]
fn multi_stream_reads_every_stream_and_follows_the_list() {
    let stdout = run("multi_stream");
    eprintln!("{stdout}");
    // "  orders-1764547200: 500": every record of the four streams, each once.
    let per_stream: BTreeMap<&str, usize> = stdout
        .lines()
        .filter_map(|l| l.strip_prefix("  ")?.split_once(": "))
        .filter(|(stream, _)| !stream.contains(':'))
        .map(|(stream, n)| {
            (
                stream.split('-').next().unwrap_or(stream),
                n.parse().unwrap_or(0),
            )
        })
        .collect();
    let expected = ["audit", "orders", "refunds", "returns"].map(|s| (s, 500));
    assert_eq!(per_stream, BTreeMap::from(expected), "{stdout}");
    // "  000000000000:orders-1764547200:1764547200:shardId-000000000001: 4900...": the
    // KCL's multi-stream key form, one row per shard (2 + 1 + 1 + 2), the removed
    // stream's kept, each with a checkpoint at a record.
    let rows: Vec<(&str, &str)> = stdout
        .lines()
        .filter_map(|l| l.strip_prefix("  ")?.rsplit_once(": "))
        .filter(|(key, _)| key.contains(":shardId-"))
        .collect();
    assert_eq!(
        rows.len(),
        6,
        "a row per shard of the four streams: {stdout}"
    );
    let audit_rows = rows
        .iter()
        .filter(|(key, _)| key.contains(":audit-"))
        .count();
    assert_eq!(audit_rows, 1, "the removed stream's row is kept: {stdout}");
    for (key, checkpoint) in rows {
        assert_eq!(
            key.split(':').count(),
            4,
            "account:stream:epoch:shard: {key}"
        );
        assert!(
            checkpoint.bytes().all(|b| b.is_ascii_digit()),
            "{key} is checkpointed at a record: {checkpoint}"
        );
    }
}

#[test]
fn pipeline_charges_each_good_order_once_and_dead_letters_the_rest() {
    let stdout = run("pipeline");
    // The example's orders 0..1000: every 50th is bad JSON, every 40th is declined.
    let bad = |id: u64| id % 50 == 0 || id % 40 == 0;
    let mut charges: BTreeMap<u64, u32> = BTreeMap::new();
    for line in stdout.lines() {
        if let Some(id) = line.strip_prefix("charged order ") {
            let id: u64 = id.parse().expect("an order id");
            *charges.entry(id).or_default() += 1;
        }
    }
    let twice: Vec<(u64, u32)> = charges
        .iter()
        .filter(|(_, n)| **n > 1)
        .map(|(id, n)| (*id, *n))
        .collect();
    assert!(twice.is_empty(), "orders charged more than once: {twice:?}");
    let wrongly: Vec<u64> = charges.keys().copied().filter(|id| bad(*id)).collect();
    assert!(wrongly.is_empty(), "bad orders charged: {wrongly:?}");
    let missing: Vec<u64> = (0..1_000)
        .filter(|id| !bad(*id) && !charges.contains_key(id))
        .collect();
    assert!(missing.is_empty(), "good orders never charged: {missing:?}");
    let bad_count = (0..1_000).filter(|id| bad(*id)).count();
    let dead_letters = stdout
        .lines()
        .filter(|l| *l == "dead-lettered a bad order")
        .count();
    assert_eq!(
        dead_letters, bad_count,
        "each of the {bad_count} bad orders dead-lettered once"
    );
    assert!(
        stdout.contains("1000 orders finished; the dead letters are in orders-dlq-"),
        "{}",
        stdout.lines().last().unwrap_or_default()
    );
}

#[test]
fn processor_ships_each_order_once_and_in_order_per_customer() {
    let stdout = run("processor");
    // "shipped customer-7 #3 (order 118) from lyon": a line per shipment the warehouse
    // handled, in handling order. The example's orders 0..1000 of 37 customers: order `id`
    // is customer `id % 37`'s number `id / 37`.
    let mut shipped: BTreeMap<u64, u32> = BTreeMap::new();
    let mut per_customer: BTreeMap<String, Vec<u64>> = BTreeMap::new();
    for line in stdout.lines().filter_map(|l| l.strip_prefix("shipped ")) {
        let parse = || -> Option<(&str, u64, u64)> {
            let (customer, rest) = line.split_once(" #")?;
            let (n, rest) = rest.split_once(" (order ")?;
            let (id, _) = rest.split_once(") from ")?;
            Some((customer, n.parse().ok()?, id.parse().ok()?))
        };
        let (customer, n, id) = parse().unwrap_or_else(|| panic!("a shipment line: {line}"));
        assert_eq!(
            (customer, n),
            (format!("customer-{}", id % 37).as_str(), id / 37),
            "{line}"
        );
        *shipped.entry(id).or_default() += 1;
        per_customer.entry(customer.to_owned()).or_default().push(n);
    }
    let twice: Vec<_> = shipped.iter().filter(|(_, n)| **n > 1).collect();
    assert!(twice.is_empty(), "orders shipped more than once: {twice:?}");
    let missing: Vec<u64> = (0..1_000).filter(|id| !shipped.contains_key(id)).collect();
    assert!(missing.is_empty(), "orders never shipped: {missing:?}");
    for (customer, ns) in &per_customer {
        assert!(
            ns.windows(2).all(|w| w[0] < w[1]),
            "{customer}'s shipments out of order: {ns:?}"
        );
    }
    assert_eq!(
        stdout.lines().last(),
        Some("1000 orders shipped"),
        "the demo ends when every order was shipped"
    );
}

#[test]
fn cdc_publishes_each_inserted_order_once() {
    let stdout = run("cdc");
    // "published order order-7 of customer-7 (259)": a line per event the subscriber
    // handled. The example writes orders 0..500 (inserts, then updates that must not be
    // published) while the table's stream rolls over.
    let mut published: BTreeMap<u64, u32> = BTreeMap::new();
    for line in stdout
        .lines()
        .filter_map(|l| l.strip_prefix("published order order-"))
    {
        let (id, rest) = line
            .split_once(" of customer-")
            .unwrap_or_else(|| panic!("an event line: {line}"));
        let id: u64 = id.parse().unwrap();
        let (customer, _) = rest.split_once(' ').unwrap();
        assert_eq!(customer.parse::<u64>().unwrap(), id % 23, "{line}");
        *published.entry(id).or_default() += 1;
    }
    let twice: Vec<_> = published.iter().filter(|(_, n)| **n > 1).collect();
    assert!(
        twice.is_empty(),
        "orders published more than once: {twice:?}"
    );
    let missing: Vec<u64> = (0..500).filter(|i| !published.contains_key(i)).collect();
    assert!(missing.is_empty(), "orders never published: {missing:?}");
}
