//! `shardflow`: the command line of a shardflow consumer group. It describes a group and
//! its lag, resets checkpoints safely while the group runs, tails a stream and replays
//! dead letters (a group or a tail may read a DynamoDB table's stream, `--table-stream`), talking to AWS through `aws-config` (regions, profiles, credentials and
//! `AWS_ENDPOINT_URL`, `AWS_ENDPOINT_URL_KINESIS`, `AWS_ENDPOINT_URL_DYNAMODB` work the
//! standard way).
//!
//! Exit codes: 0 done; 1 an error (AWS, a missing table or stream, a refused delete);
//! 2 a usage error (among them a shard id that names rows of several streams, and a
//! sequence number given for a shard that does not hold it); 3 a plan printed and nothing changed (a reset, delete or replay
//! without `--yes`); 130 a replay stopped by ctrl-c (its progress saved).

mod describe;
mod dlq;
mod position;
mod read;
mod replayed;
mod reset;
mod tail;

use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

use clap::{Args, Parser, Subcommand};
use shardflow::admin::AdminError;
use shardflow::kinesis::KinesisApi;
use shardflow::lease::dynamo::DynamoLeaseStore;
use shardflow::{Aws, Backend};

/// Exit code: a plan was printed and nothing changed (no `--yes`).
pub const EXIT_PLAN_ONLY: u8 = 3;

/// Operate shardflow consumer groups and Kinesis streams.
#[derive(Parser, Debug)]
#[command(name = "shardflow", version, about, long_about = None)]
#[command(
    after_help = "Exit codes: 0 done, 1 error, 2 usage error, 3 plan printed and nothing changed (no --yes), 130 replay stopped by ctrl-c (progress saved)."
)]
struct Cli {
    /// Print JSON instead of tables (one object; `stream tail` prints one per line).
    #[arg(long, global = true, env = "SHARDFLOW_JSON")]
    json: bool,
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Consumer groups: describe, reset checkpoints, delete.
    #[command(subcommand)]
    Group(GroupCommand),
    /// Streams: tail.
    #[command(subcommand)]
    Stream(StreamCommand),
    /// Dead-letter streams: replay.
    #[command(subcommand)]
    Dlq(DlqCommand),
}

#[derive(Subcommand, Debug)]
enum GroupCommand {
    /// One row per shard: state, owner, lease activity, checkpoint and lag. Changes nothing.
    Describe(describe::DescribeArgs),
    /// Moves checkpoints; prints the plan only, unless --yes.
    Reset(reset::ResetArgs),
    /// Deletes the group's lease table (refused while leases are live, unless --force).
    Delete(describe::DeleteArgs),
}

#[derive(Subcommand, Debug)]
enum StreamCommand {
    /// Prints a stream's records, KPL aggregates split, following new shards.
    Tail(tail::TailArgs),
}

#[derive(Subcommand, Debug)]
enum DlqCommand {
    /// Re-publishes dead letters to their stream with their partition keys.
    Replay(dlq::ReplayArgs),
}

/// The group a command works on: its stream and lease table.
#[derive(Args, Debug, Clone)]
pub struct GroupArgs {
    /// The stream the group consumes. Required for a single-stream table; on a
    /// multi-stream table (keys `account:stream:creationEpoch:shardId`) it selects that
    /// stream's rows, and without it `describe` shows every stream.
    #[arg(long, env = "SHARDFLOW_STREAM")]
    pub stream: Option<String>,
    /// The DynamoDB table (its current stream) or the table stream's ARN the group reads,
    /// instead of --stream (a single-stream table keyed by the stream's shard ids, as
    /// shardflow and the KCL's DynamoDB Streams adapter write it).
    #[arg(
        long,
        env = "SHARDFLOW_TABLE_STREAM",
        value_name = "TABLE_OR_ARN",
        conflicts_with = "stream"
    )]
    pub table_stream: Option<String>,
    /// The consumer group (its lease table has the group's name unless --table).
    #[arg(long, env = "SHARDFLOW_GROUP", required_unless_present = "table")]
    pub group: Option<String>,
    /// The lease table, when it is not named after the group.
    #[arg(long, env = "SHARDFLOW_LEASE_TABLE")]
    pub table: Option<String>,
}

impl GroupArgs {
    /// The lease table's name.
    pub fn table(&self) -> &str {
        // `group` is required unless `table` is given (clap enforces it).
        self.table
            .as_deref()
            .or(self.group.as_deref())
            .unwrap_or_default()
    }

    /// The stream of a single-stream table (`--stream`, required there).
    pub fn single_stream(&self) -> Result<&str, CliError> {
        self.stream.as_deref().ok_or_else(|| {
            format!(
                "{} is a single-stream table: name its stream with --stream",
                self.table()
            )
            .into()
        })
    }

    /// Where the group reads: `--table-stream` resolved to its ARN through the DynamoDB
    /// Streams API (then `stream` names it), or the Kinesis API and `--stream` as given.
    pub async fn resolve(mut self, aws: &Aws) -> Result<(Self, Source), CliError> {
        let source = match self.table_stream.as_deref() {
            Some(given) => {
                let source = Source::table_stream(aws, given).await?;
                self.stream = Some(source.stream.clone());
                source
            }
            None => Source {
                kinesis: aws.kinesis(),
                stream: self.stream.clone().unwrap_or_default(),
            },
        };
        Ok((self, source))
    }

    /// The lease store over the group's table.
    pub fn store(&self, aws: &Aws) -> Arc<DynamoLeaseStore> {
        Arc::new(DynamoLeaseStore::new(
            aws.dynamodb_client().clone(),
            self.table(),
        ))
    }
}

/// Where a command reads records: the API that serves the stream, and the stream's name
/// in it (a Kinesis stream's name or ARN, or a DynamoDB table stream's ARN).
pub struct Source {
    /// Kinesis, or the DynamoDB Streams API for a table's stream.
    pub kinesis: Arc<dyn KinesisApi>,
    /// The stream (for a table's stream, its ARN).
    pub stream: String,
}

impl Source {
    /// The stream of `given`, a DynamoDB table (its current stream, DescribeTable's
    /// `LatestStreamArn`) or a table stream's ARN, served by the backend's DynamoDB
    /// Streams API.
    pub async fn table_stream(aws: &Aws, given: &str) -> Result<Source, CliError> {
        let kinesis = aws
            .table_streams()
            .ok_or("this backend serves no DynamoDB table streams")?;
        let stream = if is_table_stream_arn(given) {
            given.to_owned()
        } else {
            kinesis
                .resolve_table_stream(given)
                .await
                .map_err(|e| format!("the stream of table {given}: {e}"))?
        };
        Ok(Source { kinesis, stream })
    }
}

/// Whether `given` is a DynamoDB table stream's ARN,
/// `arn:<partition>:dynamodb:<region>:<account>:table/<table>/stream/<label>` (a table
/// name has no colon, so anything else is a table name).
fn is_table_stream_arn(given: &str) -> bool {
    let mut parts = given.splitn(6, ':');
    let (Some("arn"), Some(_), Some("dynamodb"), Some(_), Some(_), Some(resource)) = (
        parts.next(),
        parts.next(),
        parts.next(),
        parts.next(),
        parts.next(),
        parts.next(),
    ) else {
        return false;
    };
    resource
        .strip_prefix("table/")
        .and_then(|rest| rest.split_once("/stream/"))
        .is_some_and(|(table, label)| !table.is_empty() && !label.is_empty())
}

/// What every command gets: the AWS clients and the output mode.
pub struct Context {
    /// Kinesis and DynamoDB clients configured by `aws-config`.
    pub aws: Aws,
    /// `--json`.
    pub json: bool,
}

/// A failed command: its message is printed, the exit code is 1.
pub type CliError = Box<dyn std::error::Error + Send + Sync>;

/// What a command returns: the exit code.
pub type CliResult = Result<ExitCode, CliError>;

#[tokio::main]
async fn main() -> ExitCode {
    let cli = Cli::parse();
    // `dlq replay` stops cleanly on ctrl-c: its handler is installed before anything else.
    let mut interrupt = matches!(cli.command, Command::Dlq(_)).then(dlq::interrupt);
    let context = Context {
        aws: Aws::from_env().await,
        json: cli.json,
    };
    let result = match cli.command {
        Command::Group(GroupCommand::Describe(args)) => describe::describe(&context, args).await,
        Command::Group(GroupCommand::Reset(args)) => reset::reset(&context, args).await,
        Command::Group(GroupCommand::Delete(args)) => describe::delete(&context, args).await,
        Command::Stream(StreamCommand::Tail(args)) => tail::tail(&context, args).await,
        Command::Dlq(DlqCommand::Replay(args)) => match interrupt.as_mut() {
            Some(ctrl_c) => dlq::replay(&context, args, ctrl_c).await,
            None => Ok(ExitCode::FAILURE),
        },
    };
    match result {
        Ok(code) => code,
        // Input that could name rows of several streams, or a sequence number for a shard
        // that does not hold it, is a usage error.
        Err(e)
            if e.downcast_ref::<AdminError>().is_some_and(|e| {
                matches!(
                    e,
                    AdminError::AmbiguousShard { .. }
                        | AdminError::AmbiguousStream { .. }
                        | AdminError::StreamRequired(_)
                        | AdminError::SequenceOfAnotherShard { .. }
                        | AdminError::SequenceNotInStream { .. }
                )
            }) =>
        {
            eprintln!("shardflow: error: {e}");
            ExitCode::from(2)
        }
        Err(e) => {
            eprintln!("shardflow: error: {e}");
            ExitCode::FAILURE
        }
    }
}

/// A table that fits the terminal; not a terminal (a pipe, a file, a script), one line
/// per row however wide, so a shard id or a sequence number is never cut for `grep`.
pub fn table(header: &[&str]) -> comfy_table::Table {
    let mut table = comfy_table::Table::new();
    table
        .load_preset(comfy_table::presets::UTF8_BORDERS_ONLY)
        .set_header(header.to_vec());
    let arrangement = if table.is_tty() {
        comfy_table::ContentArrangement::Dynamic
    } else {
        comfy_table::ContentArrangement::Disabled
    };
    table.set_content_arrangement(arrangement);
    table
}

/// A progress bar on stderr (hidden when stderr is not a terminal).
pub fn progress(len: Option<u64>, what: &str) -> indicatif::ProgressBar {
    let bar = match len {
        Some(n) => indicatif::ProgressBar::new(n),
        None => indicatif::ProgressBar::new_spinner(),
    };
    let template = match len {
        Some(_) => "{msg} {bar:30} {pos}/{len} ({per_sec})",
        None => "{spinner} {msg} {pos} ({per_sec})",
    };
    if let Ok(style) = indicatif::ProgressStyle::with_template(template) {
        bar.set_style(style);
    }
    bar.set_message(what.to_owned());
    bar.enable_steady_tick(Duration::from_millis(200));
    bar
}

/// Prints `value` as pretty JSON on stdout.
pub fn print_json(value: &serde_json::Value) {
    println!(
        "{}",
        serde_json::to_string_pretty(value).unwrap_or_else(|_| value.to_string())
    );
}
