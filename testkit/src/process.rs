//! Example programs as processes: building one ([`build_example`]), spawning workers of
//! the `consumer_group` example with their stdout parsed line by line, signalling them, and waiting
//! for their exit.
//!
//! Plain threads, not tokio: the crate's tokio has neither `process` nor `net` enabled,
//! and a blocking reader per pipe never lets a busy test runtime hold a worker back (a
//! full pipe would block the worker's handler).

use std::collections::BTreeMap;
use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Command, ExitStatus, Stdio};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use serde::Deserialize;
use tokio::sync::watch;

/// Microseconds since the Unix epoch: the clock the workers' `ts_us` uses.
pub fn now_us() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_micros() as u64
}

/// One stdout line of a worker (run with `--timestamps`). Unknown fields are refused:
/// stdout is an interface.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct Line {
    worker: String,
    shard: String,
    seq: String,
    sub: u64,
    pk: String,
    data: String,
    ts_us: u64,
}

/// A handled record, as a worker printed it.
#[derive(Clone, Debug)]
pub struct Printed {
    /// The worker that printed it.
    pub worker: Arc<str>,
    /// The shard the record came from.
    pub shard: Arc<str>,
    /// Its partition key.
    pub pk: String,
    /// Its value (the payload as a number).
    pub value: u64,
    /// When it was handled, in microseconds since the epoch.
    pub ts_us: u64,
}

/// Everything every worker printed, in arrival order per worker, plus lines that broke
/// the interface.
#[derive(Default)]
pub struct Output {
    printed: Mutex<Vec<Printed>>,
    bad_lines: Mutex<Vec<String>>,
}

impl Output {
    /// Every handled record printed so far.
    pub fn printed(&self) -> MutexGuard<'_, Vec<Printed>> {
        self.printed.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Lines that did not parse as a handled record, each with its worker and why.
    pub fn bad_lines(&self) -> Vec<String> {
        self.bad_lines
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    fn accept(&self, worker: &str, shards: &mut BTreeMap<String, Arc<str>>, raw: &str) {
        let parsed = serde_json::from_str::<Line>(raw)
            .map_err(|e| e.to_string())
            .and_then(|l| {
                let value = l.data.parse::<u64>().map_err(|e| e.to_string())?;
                shardflow::SequenceNumber::new(l.seq.as_str()).map_err(|e| e.to_string())?;
                if l.worker != worker {
                    return Err(format!("worker {:?} printed as {:?}", worker, l.worker));
                }
                if l.sub != 0 {
                    return Err(format!("sub {} for a plain record", l.sub));
                }
                Ok((l, value))
            });
        match parsed {
            Ok((l, value)) => {
                let shard = shards
                    .entry(l.shard.clone())
                    .or_insert_with(|| l.shard.as_str().into())
                    .clone();
                self.printed().push(Printed {
                    worker: worker.into(),
                    shard,
                    pk: l.pk,
                    value,
                    ts_us: l.ts_us,
                });
            }
            Err(e) => self
                .bad_lines
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .push(format!("{worker}: {e}: {raw:?}")),
        }
    }
}

/// A running (or finished) worker process.
pub struct Worker {
    /// The worker's id (its `--worker-id`).
    pub id: String,
    /// Its process id.
    pub pid: u32,
    /// Where its stderr is logged.
    pub log: PathBuf,
    exit: watch::Receiver<Option<ExitStatus>>,
}

const SIGKILL: i32 = 9;
const SIGTERM: i32 = 15;

extern "C" {
    // libc's kill(2); std has no way to send SIGTERM and libc is not a dependency.
    fn kill(pid: i32, sig: i32) -> i32;
}

impl Worker {
    /// Starts `bin args...` with stdout parsed into `output` and stderr (the logs)
    /// written to `log`. `env` overrides the inherited environment.
    pub fn spawn(
        bin: &Path,
        id: &str,
        args: &[String],
        env: &[(&str, String)],
        log: PathBuf,
        output: Arc<Output>,
    ) -> Worker {
        let stderr = std::fs::File::create(&log).expect("create the worker's log file");
        let mut cmd = Command::new(bin);
        cmd.args(args)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(stderr);
        for (k, v) in env {
            cmd.env(k, v);
        }
        let mut child = cmd.spawn().expect("spawn a worker");
        let pid = child.id();
        let stdout = child.stdout.take().expect("piped stdout");
        let (exit_tx, exit) = watch::channel(None);
        let worker = id.to_owned();
        std::thread::Builder::new()
            .name(format!("{id}-stdout"))
            .spawn(move || {
                let mut shards = BTreeMap::new();
                for line in BufReader::new(stdout).lines() {
                    match line {
                        Ok(line) => output.accept(&worker, &mut shards, &line),
                        Err(_) => break,
                    }
                }
                // stdout closes when the process ends; reap it and report.
                let status = child.wait().expect("wait for a worker");
                let _ = exit_tx.send(Some(status));
            })
            .expect("spawn a reader thread");
        Worker {
            id: id.to_owned(),
            pid,
            log,
            exit,
        }
    }

    /// How it exited, once it has.
    pub fn exited(&self) -> Option<ExitStatus> {
        *self.exit.borrow()
    }

    fn signal(&self, sig: i32) {
        if self.exited().is_none() {
            // SAFETY: kill(2) with a pid we spawned and have not reaped yet.
            unsafe {
                kill(self.pid as i32, sig);
            }
        }
    }

    /// SIGKILL: the crash.
    pub fn kill(&self) {
        self.signal(SIGKILL);
    }

    /// SIGTERM: the graceful shutdown.
    pub fn terminate(&self) {
        self.signal(SIGTERM);
    }

    /// Waits for the process to end, at most `limit`.
    pub async fn wait_exit(&self, limit: Duration) -> Option<ExitStatus> {
        let mut exit = self.exit.clone();
        tokio::time::timeout(limit, exit.wait_for(|s| s.is_some()))
            .await
            .ok()
            .and_then(|r| r.ok().and_then(|s| *s))
    }

    /// The last `n` lines of the worker's log.
    pub fn log_tail(&self, n: usize) -> String {
        let text = std::fs::read_to_string(&self.log).unwrap_or_default();
        let lines: Vec<&str> = text.lines().collect();
        lines[lines.len().saturating_sub(n)..].join("\n")
    }
}

impl Drop for Worker {
    /// A failing test leaves no process behind.
    fn drop(&mut self) {
        self.kill();
    }
}

/// Builds example `name` with the profile this test was built with (debug unless the
/// suite runs with `--release`) into the same target directory, and returns the
/// binary. Always built, never skipped: a test runs neither a binary left over from an
/// earlier build nor nothing. `--workspace` gives the dependencies the same features as
/// the `cargo test --workspace` of `scripts/test.sh` (without it the AWS SDK is compiled a
/// second time), so the build is fresh (a no-op) when the suite already built the
/// examples.
///
/// The binary is hard-linked (or copied) into `dir` and run from there: a build of the
/// same example elsewhere (another checkout sharing the target directory, a concurrent
/// `cargo build`) replaces `target/debug/examples/<name>` but not this link.
pub fn build_example(name: &str, dir: &std::path::Path) -> std::path::PathBuf {
    use std::path::PathBuf;
    use std::process::{Command, Stdio};

    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    // The target directory holding the running test binary (`<target-dir>/debug/deps/..`):
    // also right when the suite was started with `--target-dir`. Cargo tags it with
    // `CACHEDIR.TAG`.
    let exe = std::env::current_exe().expect("the test binary's path");
    let target_dir = exe
        .ancestors()
        .find(|dir| dir.join("CACHEDIR.TAG").is_file())
        .expect("the test binary lies in a cargo target directory")
        .to_owned();
    let mut cmd = Command::new(cargo);
    cmd.args(["build", "--workspace", "--example", name])
        .arg("--message-format=json-render-diagnostics")
        .arg("--target-dir")
        .arg(&target_dir)
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit());
    if !cfg!(debug_assertions) {
        cmd.arg("--release");
    }
    // `cargo test` gives this process the package's CARGO_MANIFEST_DIR, CARGO_PKG_NAME,
    // CARGO_PKG_VERSION_*, ...; build scripts (ring's) watch some of them, so passing
    // them on would make the inner cargo rebuild the TLS and AWS SDK crates, and the
    // next ordinary build rebuild them back.
    const SET_FOR_THIS_CRATE: [&str; 5] = [
        "CARGO_CRATE_NAME",
        "CARGO_BIN_NAME",
        "CARGO_PRIMARY_PACKAGE",
        "CARGO_TARGET_TMPDIR",
        "OUT_DIR",
    ];
    for (key, _) in std::env::vars_os() {
        let key = key.to_string_lossy();
        if key.starts_with("CARGO_PKG_")
            || key.starts_with("CARGO_MANIFEST_")
            || SET_FOR_THIS_CRATE.contains(&&*key)
        {
            cmd.env_remove(&*key);
        }
    }
    let out = cmd.output().expect("cargo runs");
    assert!(out.status.success(), "cargo build --example {name} failed");
    let mut executable = None;
    for line in String::from_utf8_lossy(&out.stdout).lines() {
        let Ok(msg) = serde_json::from_str::<serde_json::Value>(line) else {
            continue;
        };
        if msg["reason"] == "compiler-artifact" && msg["target"]["name"] == name {
            if let Some(path) = msg["executable"].as_str() {
                executable = Some(PathBuf::from(path));
            }
        }
    }
    let built = executable.unwrap_or_else(|| panic!("cargo did not report the {name} executable"));
    std::fs::create_dir_all(dir).expect("create the directory for the example binary");
    let private = dir.join(name);
    let _ = std::fs::remove_file(&private);
    if std::fs::hard_link(&built, &private).is_err() {
        std::fs::copy(&built, &private).expect("copy the example binary");
    }
    private
}
