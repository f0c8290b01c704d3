//! The README's main example and the pipeline example run to completion on the embedded
//! backend and verify their own totals (they exit non-zero otherwise).

use std::path::PathBuf;
use std::process::Command;

/// The example binary built beside this test (`cargo test --all-targets` builds examples).
fn example(name: &str) -> Option<PathBuf> {
    let exe = std::env::current_exe().ok()?;
    let path = exe.parent()?.parent()?.join("examples").join(name);
    path.exists().then_some(path)
}

fn run(name: &str) {
    let Some(path) = example(name) else {
        eprintln!("skipped: example {name} not built (run with --all-targets)");
        return;
    };
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
