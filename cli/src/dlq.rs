//! `dlq replay`: reads a dead-letter stream from its oldest record to its tip and
//! re-publishes each [`DeadLetterEnvelope`]'s payload to a stream with its original
//! partition key, through the library's producer. Dead letters written in parts are
//! put back together first; one whose parts are not all in the stream is not replayed
//! (counted as incomplete). A dead letter that kept its record's headers is written
//! back with them, framed as Spring's JSON header mapper frames them (what a consumer
//! reads by default); one without headers is written back as its bare payload.
//!
//! Order: the dead letters of one partition key are written one after the other, in the
//! order they are in the dead-letter stream, each only once the one before it was
//! stored; many keys go at once. The first dead letter that finally fails stops the
//! replay: nothing after it of its key is written, no further dead letter is started,
//! and what was already under way is finished.
//!
//! Resuming: what was re-published is recorded in a DynamoDB item (table
//! `--progress-table`, one item per dead-letter stream and target stream; see
//! [`crate::replayed`]), written every [`SAVE_EVERY`] dead letters or [`SAVE_INTERVAL`],
//! whichever comes first, and at the end, also when the run failed or was interrupted.
//! A rerun skips what the item covers, so a refused write, ctrl-c or `--limit` runs
//! one after the other publish every dead letter once. Why an item rather than a
//! position printed for the next run: a rerun is then the same command, nothing to copy
//! by hand, and it works with dead letters of many keys finishing out of order. Why not
//! a dedup key for the consumer: the duplicates would still be in the stream for every
//! other reader.
//!
//! One run at a time: before it publishes anything a run claims the item (an owner and
//! an expiry, `--claim-ms`, renewed by every progress write), and a second run of the
//! same replay is refused while the claim lasts, saying who holds it and until when. A
//! crashed run's claim can be taken over once it expired. A run stops sending when its
//! claim is about to expire without a renewal.
//!
//! Stopping: ctrl-c stops admitting dead letters, waits for the writes in
//! flight (at most [`DRAIN_LIMIT`]), saves the progress, gives the claim up and exits
//! with 130 and a summary. A crash (SIGKILL, power loss) can publish again what was
//! written since the last progress write: at most [`SAVE_EVERY`] stored dead letters
//! plus the [`IN_FLIGHT`] being written (at least once, as every Kinesis producer).

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::future::Future;
use std::pin::Pin;
use std::process::ExitCode;
use std::time::{Duration, SystemTime};

use clap::Args;
use futures_util::stream::{FuturesUnordered, StreamExt};
use futures_util::FutureExt;
use serde_json::json;
use shardflow::headers::spring;
use shardflow::kinesis::{KinesisError, StartingPosition};
use shardflow::producer::{ProduceError, Producer, ProducerRecord};
use shardflow::{Backend, Position, SequenceNumber};
use shardflow_middleware::dead_letter::envelope::Reassembly;
use shardflow_middleware::DeadLetterEnvelope;

use crate::position::rfc3339;
use crate::read::read_to_tip;
use crate::replayed::{LetterId, ProgressItem, Replayed, WINDOW};
use crate::{print_json, progress, CliError, CliResult, Context, EXIT_PLAN_ONLY};

/// Progress is written after this many dead letters re-published since the last write
/// (and every [`SAVE_INTERVAL`], and at the end).
pub const SAVE_EVERY: u64 = 50;
/// Progress is written at least this often while a run publishes (more often with a
/// `--claim-ms` under 3 s: a third of it), which renews the run's claim.
pub const SAVE_INTERVAL: Duration = Duration::from_secs(1);
/// The most dead letters being written at once (sent and not yet acknowledged).
pub const IN_FLIGHT: usize = 50;
/// How long a run stopped by ctrl-c waits for the writes in flight.
pub const DRAIN_LIMIT: Duration = Duration::from_secs(30);
/// Exit code of a run stopped by ctrl-c (128 + SIGINT, as a shell reports it).
pub const EXIT_INTERRUPTED: u8 = 130;
/// How many skipped records a run names one by one (it counts them all).
const SKIPPED_SHOWN: usize = 10;

/// Completes on ctrl-c; polled once as the command starts (which installs the handler)
/// and then whenever the replay can stop. Never polled again once it completed.
pub type Interrupt = Pin<Box<dyn Future<Output = std::io::Result<()>> + Send>>;

/// The ctrl-c listener of `dlq replay`, installed at once.
pub fn interrupt() -> Interrupt {
    let mut ctrl_c: Interrupt = Box::pin(tokio::signal::ctrl_c());
    // The first poll registers the handler; a ctrl-c cannot have come before it.
    let _ = ctrl_c.as_mut().now_or_never();
    ctrl_c
}

/// `dlq replay`.
#[derive(Args, Debug)]
pub struct ReplayArgs {
    /// The dead-letter stream.
    #[arg(long)]
    from: String,
    /// The stream to write the payloads to (normally the original stream).
    #[arg(long)]
    to: String,
    /// Replay at most this many dead letters not replayed before (the oldest first).
    #[arg(long)]
    limit: Option<u64>,
    /// The DynamoDB table that records what was replayed, so that a rerun (after a
    /// failed write, ctrl-c, or another --limit run) continues instead of repeating:
    /// one item per dead-letter stream and target stream. Created on first use.
    #[arg(
        long,
        env = "SHARDFLOW_REPLAY_TABLE",
        default_value = "shardflow-dlq-replay"
    )]
    progress_table: String,
    /// Forget what earlier runs replayed and replay everything again.
    #[arg(long)]
    restart: bool,
    /// How long this run's claim on the progress item lasts without a renewal (renewed
    /// by every progress write, at least every second; given up when the run ends): a
    /// second run is refused while it lasts, and after a crash the same replay can run
    /// again this long after the crashed run's last renewal.
    #[arg(long, value_name = "MS", default_value_t = 30_000,
          value_parser = clap::value_parser!(u64).range(1000..=3_600_000))]
    claim_ms: u64,
    /// Publish; without it only the plan is printed (exit code 3).
    #[arg(long)]
    yes: bool,
}

/// One dead letter read, and its name in the progress item.
struct Letter {
    id: LetterId,
    envelope: DeadLetterEnvelope,
}

/// A record of the dead-letter stream that is not replayed: where it is and why.
struct Skipped {
    shard: String,
    sequence: String,
    why: String,
}

/// The run's incarnation, the owner written into the claim: host, process id and a
/// nonce (a restarted process with a reused id is another owner).
fn incarnation() -> String {
    let host = std::env::var("HOSTNAME")
        .ok()
        .or_else(|| std::fs::read_to_string("/etc/hostname").ok())
        .map(|h| h.trim().to_owned())
        .filter(|h| !h.is_empty())
        .unwrap_or_else(|| "localhost".to_owned());
    let nonce = SystemTime::now()
        .duration_since(SystemTime::UNIX_EPOCH)
        .map_or(0, |d| d.subsec_nanos());
    format!("{host}#{}-{nonce:08x}", std::process::id())
}

/// `dlq replay`.
pub async fn replay(cx: &Context, args: ReplayArgs, ctrl_c: &mut Interrupt) -> CliResult {
    let kinesis = cx.aws.kinesis();
    let limit = args.limit.unwrap_or(u64::MAX);
    // The target first: a replay into a stream that is not there is an error even when
    // there is nothing to replay.
    match kinesis.list_shards(&args.to).await {
        Ok(_) => {}
        Err(KinesisError::NotFound(_)) => {
            return Err(format!(
                "the target stream {} does not exist (--to): nothing was published",
                args.to
            )
            .into())
        }
        Err(e) => return Err(format!("the target stream {}: {e}", args.to).into()),
    }
    let claim_for = Duration::from_millis(args.claim_ms);
    let mut item = ProgressItem::new(
        cx.aws.dynamodb_client().clone(),
        &args.progress_table,
        &args.from,
        &args.to,
        incarnation(),
        claim_for,
    );
    let (loaded, claim) = item.load(args.restart).await?;
    let mut replayed = if args.restart {
        Replayed::default()
    } else {
        loaded
    };
    // Every dead letter read, in stream order (for the progress item), and those to
    // replay.
    let mut read: Vec<LetterId> = Vec::new();
    let mut letters: Vec<Letter> = Vec::new();
    let mut skipped: Vec<Skipped> = Vec::new();
    let mut parts = Reassembly::new();
    let reading = progress(None, "reading dead letters");
    let read_all = async {
        // Oldest shards first (ListShards lists parents before children).
        for shard in kinesis.list_shards(&args.from).await? {
            if letters.len() as u64 >= limit {
                break;
            }
            read_to_tip(
                kinesis.as_ref(),
                &args.from,
                &shard.shard_id,
                &StartingPosition::TrimHorizon,
                |record| {
                    match DeadLetterEnvelope::from_bytes(&record.data) {
                        Ok(envelope) => {
                            if let Some(letter) = parts.push(envelope) {
                                // A sequence number Kinesis gave is decimal digits.
                                let Ok(sequence) = SequenceNumber::new(&record.sequence_number)
                                else {
                                    skipped.push(Skipped {
                                        shard: record.shard,
                                        sequence: record.sequence_number,
                                        why: "its sequence number is not decimal digits".into(),
                                    });
                                    return (letters.len() as u64) < limit;
                                };
                                let id = LetterId {
                                    shard: record.shard,
                                    position: Position::new(sequence, record.sub_sequence),
                                };
                                read.push(id.clone());
                                if !replayed.covers(&id) {
                                    letters.push(Letter {
                                        id,
                                        envelope: letter,
                                    });
                                    reading.inc(1);
                                }
                            }
                        }
                        Err(e) => skipped.push(Skipped {
                            shard: record.shard,
                            sequence: format!("{}/{}", record.sequence_number, record.sub_sequence),
                            why: e.to_string(),
                        }),
                    }
                    (letters.len() as u64) < limit
                },
            )
            .await?;
        }
        Ok::<(), KinesisError>(())
    };
    tokio::select! {
        biased;
        _ = ctrl_c.as_mut() => {
            reading.finish_and_clear();
            if cx.json {
                print_json(&json!({"from": args.from, "to": args.to, "published": 0, "interrupted": true}));
            }
            eprintln!("shardflow: interrupted while reading the dead letters: nothing was published");
            return Ok(ExitCode::from(EXIT_INTERRUPTED));
        }
        done = read_all => done?,
    }
    reading.finish_and_clear();
    let plan = Plan {
        args: &args,
        skipped: &skipped,
        incomplete: parts.incomplete(),
    };
    if !args.yes {
        let already = read.len() - letters.len();
        let mut summary = plan.summary(&letters, already, 0);
        let held = claim
            .filter(|c| c.live_at(crate::position::millis(SystemTime::now())))
            .map(|c| {
                (
                    c.owner,
                    rfc3339(SystemTime::UNIX_EPOCH + Duration::from_millis(c.until_ms)),
                )
            });
        summary["claimed_by"] = json!(held
            .as_ref()
            .map(|(owner, until)| json!({"owner": owner, "until": until})));
        if cx.json {
            print_json(&summary);
        } else {
            println!(
                "would re-publish {} dead letters from {} to {} (originally from: {}); {} were replayed by earlier runs; {}; run again with --yes",
                letters.len(),
                args.from,
                args.to,
                originally_from(&letters),
                already,
                plan.skipped_text("would be skipped"),
            );
            if let Some((owner, until)) = held {
                println!("another replay ({owner}) holds the progress item until {until}: a run now would be refused");
            }
        }
        return Ok(ExitCode::from(EXIT_PLAN_ONLY));
    }
    // The claim, before anything is written: refused while another run holds it. What
    // other runs recorded meanwhile is not published again.
    let claimed = item.claim(args.restart).await?;
    letters.retain(|l| !claimed.covers(&l.id));
    replayed = claimed;
    let already = read.len() - letters.len();
    let producer = Producer::builder()
        .stream(&args.to)
        .backend(cx.aws.clone())
        .ordered_per_key(true)
        // One key's dead letters go one per round trip: do not wait to fill batches.
        .linger(Duration::from_millis(5))
        .build()?
        .raw();
    let bar = progress(Some(letters.len() as u64), "re-publishing");
    let save_interval = SAVE_INTERVAL.min(claim_for / 3);
    let outcome = publish(
        &producer,
        &letters,
        &mut replayed,
        &read,
        &mut item,
        &bar,
        ctrl_c,
        save_interval,
    )
    .await;
    producer.close().await;
    bar.finish_and_clear();
    replayed.compact(&read);
    let released = item.release(&replayed).await;
    let published = outcome.published;
    let mut summary = plan.summary(&letters, already, published);
    summary["interrupted"] = json!(outcome.interrupted);
    let progress_note = match &released {
        Ok(()) => format!(
            "what was re-published is recorded in table {}",
            args.progress_table
        ),
        Err(e) => format!("recording the progress failed too: {e}"),
    };
    if let Some(e) = outcome.failed {
        eprintln!("shardflow: {}", plan.skipped_text("were skipped"));
        return Err(format!(
            "{published} of {} dead letters re-published; a write failed: {e}; nothing after it of its partition key was written and no other dead letter was started; run the same command again to continue ({progress_note})",
            letters.len(),
        )
        .into());
    }
    if let Some(e) = outcome.stopped {
        return Err(format!(
            "{published} of {} dead letters re-published, then: {e} ({progress_note})",
            letters.len(),
        )
        .into());
    }
    released?;
    if cx.json {
        print_json(&summary);
    } else if outcome.interrupted {
        println!(
            "interrupted: re-published {published} of {} dead letters from {} to {} ({already} replayed by earlier runs), the writes in flight finished; {}; run the same command again to continue ({progress_note})",
            letters.len(),
            args.from,
            args.to,
            plan.skipped_text("were skipped"),
        );
    } else {
        println!(
            "re-published {published} dead letters from {} to {} ({already} replayed by earlier runs); {}",
            args.from,
            args.to,
            plan.skipped_text("were skipped"),
        );
    }
    if outcome.interrupted {
        return Ok(ExitCode::from(EXIT_INTERRUPTED));
    }
    Ok(ExitCode::SUCCESS)
}

/// `stream n, ...`: how many of `letters` came from each original stream.
fn originally_from(letters: &[Letter]) -> String {
    let mut by_stream: BTreeMap<&str, u64> = BTreeMap::new();
    for letter in letters {
        *by_stream
            .entry(letter.envelope.stream.as_str())
            .or_default() += 1;
    }
    by_stream
        .iter()
        .map(|(s, n)| format!("{s} {n}"))
        .collect::<Vec<_>>()
        .join(", ")
}

/// What a run reports besides what it published: what it read and skipped.
struct Plan<'a> {
    args: &'a ReplayArgs,
    skipped: &'a [Skipped],
    incomplete: usize,
}

impl Plan<'_> {
    /// The run's summary as JSON.
    fn summary(&self, letters: &[Letter], already: usize, published: u64) -> serde_json::Value {
        let mut by_stream: BTreeMap<&str, u64> = BTreeMap::new();
        for letter in letters {
            *by_stream
                .entry(letter.envelope.stream.as_str())
                .or_default() += 1;
        }
        json!({
            "from": self.args.from,
            "to": self.args.to,
            "dead_letters": letters.len(),
            "replayed_before": already,
            "not_envelopes": self.skipped.len(),
            "skipped": self.skipped.iter().map(|s| json!({"shard": s.shard, "sequence_number": s.sequence, "why": s.why})).collect::<Vec<_>>(),
            "incomplete": self.incomplete,
            "original_streams": by_stream,
            "published": published,
        })
    }

    /// What was (or would be) skipped and why, in words.
    fn skipped_text(&self, verb: &str) -> String {
        if self.skipped.is_empty() && self.incomplete == 0 {
            return format!("nothing {}", verb.replace("were ", "was "));
        }
        let (records, letters, their) = match (self.skipped.len(), self.incomplete) {
            (1, 1) => (
                "record is not a dead-letter envelope",
                "dead letter misses",
                "its",
            ),
            (1, _) => (
                "record is not a dead-letter envelope",
                "dead letters miss",
                "their",
            ),
            (_, 1) => (
                "records are not dead-letter envelopes",
                "dead letter misses",
                "its",
            ),
            _ => (
                "records are not dead-letter envelopes",
                "dead letters miss",
                "their",
            ),
        };
        let mut text = format!(
            "{} {records} and {} {letters} parts (or {their} parts do not add up) {verb}",
            self.skipped.len(),
            self.incomplete,
        );
        if !self.skipped.is_empty() {
            let shown: Vec<String> = self
                .skipped
                .iter()
                .take(SKIPPED_SHOWN)
                .map(|s| format!("{} {}: {}", s.shard, s.sequence, s.why))
                .collect();
            text.push_str(&format!(
                " (not envelopes: {}{})",
                shown.join("; "),
                if self.skipped.len() > SKIPPED_SHOWN {
                    format!("; and {} more", self.skipped.len() - SKIPPED_SHOWN)
                } else {
                    String::new()
                }
            ));
        }
        text
    }
}

/// How a publishing run ended.
struct Outcome {
    /// Dead letters stored.
    published: u64,
    /// The first write that finally failed.
    failed: Option<ProduceError>,
    /// Stopped by ctrl-c.
    interrupted: bool,
    /// Stopped because the progress could not be recorded (the claim was lost, or
    /// DynamoDB failed) or the writes in flight did not finish after ctrl-c.
    stopped: Option<CliError>,
}

/// Writes `letters` in per-key order (see the module docs), at most [`IN_FLIGHT`] at a
/// time, marking each one stored in `replayed` and saving it (which renews the claim)
/// every [`SAVE_EVERY`] dead letters or `save_interval`. Stops admitting dead letters on
/// the first failed write, on ctrl-c, when a save fails or the claim is about to
/// expire; always waits for what is in flight (after ctrl-c at most [`DRAIN_LIMIT`]).
#[allow(clippy::too_many_arguments)]
async fn publish(
    producer: &Producer,
    letters: &[Letter],
    replayed: &mut Replayed,
    read: &[LetterId],
    item: &mut ProgressItem,
    bar: &indicatif::ProgressBar,
    ctrl_c: &mut Interrupt,
    save_interval: Duration,
) -> Outcome {
    let send = |index: usize| {
        let letter = &letters[index].envelope;
        // Framed here as a producer that embeds headers frames (a payload without
        // headers that a reader could take for a frame gets an empty header map), and
        // written through the raw handle so nothing frames it a second time.
        let data = spring::write_embedded(&letter.headers, &letter.payload);
        let key = letter.partition_key.clone();
        async move {
            let result = match data {
                Some(data) => producer.send(ProducerRecord::new(data, key)).await,
                // Headers or payload beyond the framing's 4 GiB length fields: far more
                // than any record Kinesis takes.
                None => Err(ProduceError::TooLarge {
                    size: usize::MAX,
                    limit: shardflow::producer::MAX_RECORD_BYTES,
                }),
            };
            (index, result)
        }
    };
    let mut done = vec![false; letters.len()];
    // The oldest dead letter not yet stored, and the next one to admit.
    let (mut oldest, mut admitted) = (0usize, 0usize);
    // Per key with a dead letter in flight: its admitted dead letters waiting for it.
    let mut waiting: HashMap<&str, VecDeque<usize>> = HashMap::new();
    let mut in_flight = FuturesUnordered::new();
    let mut out = Outcome {
        published: 0,
        failed: None,
        interrupted: false,
        stopped: None,
    };
    let mut unsaved = 0u64;
    let mut ticker = tokio::time::interval(save_interval);
    ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    ticker.reset();
    let mut drain_until: Option<tokio::time::Instant> = None;
    loop {
        if !out.interrupted && ctrl_c.as_mut().now_or_never().is_some() {
            out.interrupted = true;
            drain_until = Some(tokio::time::Instant::now() + DRAIN_LIMIT);
        }
        if out.stopped.is_none() && admitted < letters.len() && !item.holds() {
            out.stopped = Some(
                "this run's claim on the progress item was about to expire without a renewal (DynamoDB too slow?): it stopped publishing"
                    .into(),
            );
        }
        let admitting = out.failed.is_none() && !out.interrupted && out.stopped.is_none();
        while admitting
            && admitted < letters.len()
            && admitted < oldest + WINDOW
            && in_flight.len() < IN_FLIGHT
        {
            let key = letters[admitted].envelope.partition_key.as_str();
            match waiting.get_mut(key) {
                Some(queue) => queue.push_back(admitted),
                None => {
                    waiting.insert(key, VecDeque::new());
                    in_flight.push(send(admitted));
                }
            }
            admitted += 1;
        }
        if in_flight.is_empty() {
            break;
        }
        let drained = async {
            match drain_until {
                Some(at) => tokio::time::sleep_until(at).await,
                None => std::future::pending().await,
            }
        };
        let stored = tokio::select! {
            biased;
            _ = ctrl_c.as_mut(), if !out.interrupted => {
                out.interrupted = true;
                drain_until = Some(tokio::time::Instant::now() + DRAIN_LIMIT);
                continue;
            }
            _ = drained => {
                out.stopped.get_or_insert_with(|| format!(
                    "{} writes in flight did not finish within {} s of ctrl-c; the next run may publish them again",
                    in_flight.len(),
                    DRAIN_LIMIT.as_secs()
                ).into());
                break;
            }
            _ = ticker.tick(), if out.stopped.is_none() => None,
            next = in_flight.next() => next,
        };
        if let Some((index, result)) = stored {
            let key = letters[index].envelope.partition_key.as_str();
            match result {
                Ok(_) => {
                    done[index] = true;
                    out.published += 1;
                    unsaved += 1;
                    bar.inc(1);
                    replayed.mark(letters[index].id.clone());
                    while oldest < done.len() && done[oldest] {
                        oldest += 1;
                    }
                    let more = out.failed.is_none() && !out.interrupted && out.stopped.is_none();
                    let next = match waiting.get_mut(key) {
                        Some(queue) if more => queue.pop_front(),
                        _ => None,
                    };
                    match next {
                        Some(next) => in_flight.push(send(next)),
                        None => {
                            waiting.remove(key);
                        }
                    }
                    if unsaved < SAVE_EVERY {
                        continue;
                    }
                }
                Err(e) => {
                    // Nothing after it of its key goes; the first failure is the one
                    // reported.
                    waiting.remove(key);
                    out.failed.get_or_insert(e);
                    continue;
                }
            }
        }
        // SAVE_EVERY stored, or the interval passed: record them and renew the claim.
        if out.stopped.is_none() {
            replayed.compact(read);
            match item.save(replayed).await {
                Ok(()) => {
                    unsaved = 0;
                    ticker.reset();
                }
                Err(e) => out.stopped = Some(e),
            }
        }
    }
    out
}
