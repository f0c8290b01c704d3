//! The README's main example and the pipeline example run to completion on the embedded
//! backend and verify their own totals (they exit non-zero otherwise).
//!
//! Each test builds its example first (`common::build_example`: a no-op when the suite
//! already built the examples), so it always runs the current code and never skips.

mod common;

use std::path::PathBuf;
use std::process::Command;

/// Removes the test's private directory (and its link to the example binary) at the end,
/// passed or failed.
struct TempDir(PathBuf);

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn run(name: &str) {
    // One directory per example and process: the two tests run in parallel, and several
    // runs of this binary may too.
    let dir = TempDir(
        PathBuf::from(env!("CARGO_TARGET_TMPDIR"))
            .join("examples")
            .join(format!("{name}-{}", std::process::id())),
    );
    let path = common::build_example(name, &dir.0);
    let out = Command::new(&path)
        .env_remove("AWS_ENDPOINT_URL_KINESIS")
        .env_remove("SHARDFLOW_BACKEND")
        .env("RUST_LOG", "error")
        .output()
        .expect("the example starts");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{name} failed: {stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    eprintln!("{stdout}");
}

#[test]
fn quickstart_handles_every_record() {
    run("quickstart");
}

#[test]
fn pipeline_charges_good_orders_and_dead_letters_the_rest() {
    run("pipeline");
}
