//! `stream tail`: prints a stream's records (KPL aggregates split, dead-letter envelopes
//! decoded, the headers of dead letters and of Spring-framed records shown), following
//! the children of shards that end (read from the asked position too), until `--limit`
//! or ctrl-c.

use std::collections::{BTreeMap, BTreeSet};
use std::process::ExitCode;
use std::time::{Duration, SystemTime};

use clap::{Args, ValueEnum};
use serde_json::json;
use shardflow::headers::HeaderFormat;
use shardflow::kinesis::{KinesisApi, ShardInfo, StartingPosition};
use shardflow::{Backend, Headers};
use shardflow_middleware::DeadLetterEnvelope;

use crate::position::{future_warning, parse, rfc3339, Spot};
use crate::read::{user_records, UserRecord, PAGE};
use crate::{CliResult, Context, Source};

/// How long tail waits before reading again when every shard is at its tip.
const IDLE: Duration = Duration::from_millis(500);

/// How a record's data is printed.
#[derive(Clone, Copy, Debug, ValueEnum, PartialEq, Eq)]
pub enum TailFormat {
    /// One JSON object per line: metadata, and the data as text (if UTF-8) or base64.
    Json,
    /// Metadata, then the data as text (invalid UTF-8 replaced).
    Text,
    /// Metadata, then the data in hex.
    Hex,
}

/// `stream tail`.
#[derive(Args, Debug)]
pub struct TailArgs {
    /// The stream (a name or ARN).
    #[arg(required_unless_present = "table_stream")]
    stream: Option<String>,
    /// A DynamoDB table's stream instead: the table (its current stream) or the stream's
    /// ARN. Its records are the changes' JSON.
    #[arg(long, value_name = "TABLE_OR_ARN", conflicts_with = "stream")]
    table_stream: Option<String>,
    /// Where to start, in every shard read (children included): trim-horizon, latest,
    /// timestamp T (RFC 3339 with any UTC offset, or epoch ms).
    #[arg(long, num_args = 1..=2, default_values_t = ["latest".to_owned()], value_names = ["POSITION", "VALUE"])]
    from: Vec<String>,
    /// Only these shards (their children are followed too); all by default.
    #[arg(long = "shard", value_name = "ID")]
    shards: Vec<String>,
    /// How to print each record (`--json` means `--format json`).
    #[arg(long, value_enum, default_value_t = TailFormat::Text)]
    format: TailFormat,
    /// Stop after this many records.
    #[arg(long)]
    limit: Option<u64>,
}

fn line(format: TailFormat, r: &UserRecord) -> String {
    let arrival = r.arrival.map(rfc3339).unwrap_or_else(|| "-".into());
    match format {
        TailFormat::Json => {
            let mut v = json!({
                "shard": r.shard,
                "sequence_number": r.sequence_number,
                "sub_sequence": r.sub_sequence,
                "partition_key": r.partition_key,
                "arrival": arrival,
                "aggregated": r.aggregated,
            });
            match std::str::from_utf8(&r.data) {
                Ok(text) => v["data"] = json!(text),
                Err(_) => v["data_base64"] = json!(aws_smithy_types::base64::encode(&r.data)),
            }
            if let Ok(envelope) = DeadLetterEnvelope::from_bytes(&r.data) {
                let payload = &envelope.payload;
                v["dead_letter"] = json!({
                    "stream": envelope.stream,
                    "shard": envelope.shard,
                    "sequence_number": envelope.sequence_number,
                    "sub_sequence": envelope.sub_sequence,
                    "partition_key": envelope.partition_key,
                    "error": envelope.error,
                    "attempts": envelope.attempts,
                    "failed_at_ms": envelope.failed_at_ms,
                    "part": envelope.part,
                    "parts": envelope.parts,
                    "payload_len": envelope.payload_len,
                    "payload": String::from_utf8_lossy(payload),
                    "headers": headers_json(&envelope.headers),
                });
            } else if let Some((headers, payload)) = HeaderFormat::Auto.read(&r.data) {
                v["headers"] = headers_json(&headers);
                v["payload"] = json!(String::from_utf8_lossy(&payload));
            }
            v.to_string()
        }
        TailFormat::Text | TailFormat::Hex => {
            let head = format!(
                "{} {}/{} key={} at={}",
                r.shard, r.sequence_number, r.sub_sequence, r.partition_key, arrival
            );
            let body = |data: &[u8]| match format {
                TailFormat::Hex => data.iter().map(|b| format!("{b:02x}")).collect::<String>(),
                _ => String::from_utf8_lossy(data).into_owned(),
            };
            match DeadLetterEnvelope::from_bytes(&r.data) {
                Ok(e) => format!(
                    "{head} dead-letter{} from {} {} {}/{} key={} error={:?}{}: {}",
                    if e.parts > 1 {
                        format!(" part {}/{}", e.part + 1, e.parts)
                    } else {
                        String::new()
                    },
                    e.stream,
                    e.shard,
                    e.sequence_number,
                    e.sub_sequence,
                    e.partition_key,
                    e.error,
                    headers_text(&e.headers),
                    body(&e.payload)
                ),
                Err(_) => match HeaderFormat::Auto.read(&r.data) {
                    Some((headers, payload)) => {
                        format!("{head}{}: {}", headers_text(&headers), body(&payload))
                    }
                    None => format!("{head} {}", body(&r.data)),
                },
            }
        }
    }
}

/// Headers as a JSON object (name → value, in order).
fn headers_json(headers: &Headers) -> serde_json::Value {
    headers
        .iter()
        .map(|(name, value)| (name.to_owned(), value.to_json()))
        .collect::<serde_json::Map<_, _>>()
        .into()
}

/// Headers for a text line: ` headers={"name":value,...}`, or nothing when there are
/// none.
fn headers_text(headers: &Headers) -> String {
    if headers.is_empty() {
        String::new()
    } else {
        format!(" headers={}", headers_json(headers))
    }
}

/// The shards to start with: those asked for, else (from LATEST) the open ones, else
/// the roots (shards whose parents are gone), whose descendants are followed.
fn first_shards(all: &[ShardInfo], wanted: &[String], spot: &Spot) -> Vec<String> {
    if !wanted.is_empty() {
        return wanted.to_vec();
    }
    let ids: BTreeSet<&str> = all.iter().map(|s| s.shard_id.as_str()).collect();
    all.iter()
        .filter(|s| match spot {
            Spot::Latest => !s.is_closed(),
            _ => s.parents().iter().all(|p| !ids.contains(p.as_str())),
        })
        .map(|s| s.shard_id.clone())
        .collect()
}

/// `stream tail`.
pub async fn tail(cx: &Context, args: TailArgs) -> CliResult {
    let spot = match parse(&args.from) {
        Ok(Spot::Sequence(_)) => {
            eprintln!(
                "shardflow: error: --from {:?}: expected trim-horizon, latest or timestamp T",
                args.from.join(" ")
            );
            return Ok(ExitCode::from(2));
        }
        Err(e) => {
            eprintln!("shardflow: error: --from {e}");
            return Ok(ExitCode::from(2));
        }
        Ok(spot) => spot,
    };
    if let Some(warning) = future_warning(&spot) {
        eprintln!("shardflow: warning: --from {warning}");
    }
    let format = if cx.json {
        TailFormat::Json
    } else {
        args.format
    };
    let source = match args.table_stream.as_deref() {
        Some(given) => Source::table_stream(&cx.aws, given).await?,
        None => Source {
            kinesis: cx.aws.kinesis(),
            // clap requires the stream unless --table-stream is given.
            stream: args.stream.clone().unwrap_or_default(),
        },
    };
    let kinesis = source.kinesis.clone();
    let stream = source.stream.as_str();
    // Installed before the first read: from here on ctrl-c stops tail cleanly.
    let ctrl_c = tokio::signal::ctrl_c();
    tokio::pin!(ctrl_c);
    // `ctrl_c` registers its handler when first polled.
    if futures_util::FutureExt::now_or_never(ctrl_c.as_mut()).is_some() {
        return Ok(ExitCode::SUCCESS);
    }
    // Where the children of shards that end start: at the asked position too (a child
    // of a stream resharded before T holds records older than T); from LATEST, at the
    // time tail started, so that a child's records from then on are all shown.
    let started = SystemTime::now();
    let children_from = match &spot {
        Spot::Latest => StartingPosition::AtTimestamp(started),
        other => other.starting(),
    };
    let all = kinesis.list_shards(stream).await?;
    // Shard id -> its iterator; ended shards are remembered to start their children.
    let mut reading: BTreeMap<String, String> = BTreeMap::new();
    for shard in first_shards(&all, &args.shards, &spot) {
        let it = kinesis
            .shard_iterator(stream, &shard, &spot.starting())
            .await?;
        reading.insert(shard, it);
    }
    let mut ended: BTreeSet<String> = BTreeSet::new();
    let mut printed = 0u64;
    let limit = args.limit.unwrap_or(u64::MAX);
    while printed < limit && !reading.is_empty() {
        let mut idle = true;
        let keys: Vec<String> = reading.keys().cloned().collect();
        for shard in keys {
            let Some(iterator) = reading.get(&shard).cloned() else {
                continue;
            };
            let page = tokio::select! {
                _ = &mut ctrl_c => return Ok(ExitCode::SUCCESS),
                page = kinesis.get_records(&iterator, PAGE) => page?,
            };
            let last = page.records.last().map(|r| r.sequence_number.clone());
            for record in page.records.iter().cloned() {
                for user in user_records(&shard, record, kinesis.records_may_be_aggregated()) {
                    if printed >= limit {
                        break;
                    }
                    println!("{}", line(format, &user));
                    printed += 1;
                    idle = false;
                }
            }
            match (page.next_iterator, last) {
                (Some(next), _) => {
                    reading.insert(shard, next);
                }
                // The end is a read that brings nothing: a page with records but no
                // next iterator is read again after its last record.
                (None, Some(last)) => {
                    let from = StartingPosition::AfterSequenceNumber(last);
                    let it = kinesis.shard_iterator(stream, &shard, &from).await?;
                    reading.insert(shard, it);
                }
                (None, None) => {
                    reading.remove(&shard);
                    ended.insert(shard);
                    idle = false;
                    start_children(
                        kinesis.as_ref(),
                        stream,
                        &children_from,
                        &mut reading,
                        &ended,
                    )
                    .await?;
                }
            }
        }
        if idle && printed < limit {
            tokio::select! {
                _ = &mut ctrl_c => return Ok(ExitCode::SUCCESS),
                _ = tokio::time::sleep(IDLE) => {}
            }
        }
    }
    Ok(ExitCode::SUCCESS)
}

/// Starts reading, at `from`, the children whose parents all ended.
async fn start_children(
    kinesis: &dyn KinesisApi,
    stream: &str,
    from: &StartingPosition,
    reading: &mut BTreeMap<String, String>,
    ended: &BTreeSet<String>,
) -> Result<(), crate::CliError> {
    for shard in kinesis.list_shards(stream).await? {
        let parents = shard.parents();
        if parents.is_empty()
            || !parents.iter().any(|p| ended.contains(p))
            || !parents.iter().all(|p| ended.contains(p))
            || reading.contains_key(&shard.shard_id)
            || ended.contains(&shard.shard_id)
        {
            continue;
        }
        let it = kinesis
            .shard_iterator(stream, &shard.shard_id, from)
            .await?;
        reading.insert(shard.shard_id, it);
    }
    Ok(())
}
