//! The emulators `scripts/test.sh` starts, and names no other run against them uses.

use std::sync::atomic::{AtomicUsize, Ordering};

/// Whether the emulators `scripts/test.sh` starts are there (`SHARDFLOW_EMULATORS` set);
/// says so on stderr when not, so a skipped emulator test shows in `--nocapture` output.
pub fn emulators_enabled() -> bool {
    let on = std::env::var_os("SHARDFLOW_EMULATORS").is_some();
    if !on {
        eprintln!("skipped: SHARDFLOW_EMULATORS not set (run scripts/test.sh)");
    }
    on
}

/// A stream, table or group name no other test of this process, no concurrent run and no
/// earlier run against the same long-lived emulator uses: the prefix, the process id, the
/// wall clock (milliseconds, modulo 10^9) and a counter.
pub fn unique(prefix: &str) -> String {
    static NEXT: AtomicUsize = AtomicUsize::new(0);
    let millis = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_millis() % 1_000_000_000)
        .unwrap_or(0);
    format!(
        "{prefix}-{}-{millis}-{}",
        std::process::id(),
        NEXT.fetch_add(1, Ordering::Relaxed)
    )
}

/// The endpoint of the DynamoDB emulator that also serves DynamoDB Streams (moto's
/// server), from `SHARDFLOW_TABLE_STREAMS_ENDPOINT`; `None` (said on stderr) when
/// `scripts/test.sh` did not start it. dynalite, the `AWS_ENDPOINT_URL_DYNAMODB` of the
/// other tests, has no streams.
pub fn table_streams_endpoint() -> Option<String> {
    let endpoint = std::env::var("SHARDFLOW_TABLE_STREAMS_ENDPOINT").ok();
    if endpoint.is_none() {
        eprintln!("skipped: SHARDFLOW_TABLE_STREAMS_ENDPOINT not set (run scripts/test.sh)");
    }
    endpoint
}
