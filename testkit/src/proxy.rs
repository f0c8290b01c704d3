//! A TCP proxy in front of the DynamoDB emulator that counts requests by operation
//! (the `X-Amz-Target` header), so the test measures what the workers really send,
//! retries included, without any hook in the code under test.

use std::collections::BTreeMap;
use std::io::{Read, Write};
use std::net::{Shutdown, TcpListener, TcpStream};
use std::sync::{Arc, Mutex};

/// Requests seen so far, by operation (`UpdateItem`, `Scan`, ...).
#[derive(Clone, Default)]
pub struct Counts(Arc<Mutex<BTreeMap<String, u64>>>);

impl Counts {
    /// The calls counted so far, by operation.
    pub fn snapshot(&self) -> BTreeMap<String, u64> {
        self.0.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }

    fn add(&self, op: String) {
        *self
            .0
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .entry(op)
            .or_default() += 1;
    }
}

/// The difference `after - before`, by operation.
pub fn delta(
    before: &BTreeMap<String, u64>,
    after: &BTreeMap<String, u64>,
) -> BTreeMap<String, u64> {
    after
        .iter()
        .map(|(op, n)| (op.clone(), n - before.get(op).copied().unwrap_or(0)))
        .filter(|(_, n)| *n > 0)
        .collect()
}

/// A local HTTP proxy in front of DynamoDB that counts the calls by operation (the
/// `X-Amz-Target` header), so a test can see what a fleet of processes costs.
pub struct CountingProxy {
    /// `http://127.0.0.1:<port>`: what the workers use as their DynamoDB endpoint.
    pub url: String,
    /// The counts of the calls that went through.
    pub counts: Counts,
}

impl CountingProxy {
    /// Listens on a free loopback port and forwards every connection to `upstream`
    /// (`http://host:port`; plain HTTP only, which is what the emulators speak).
    pub fn start(upstream: &str) -> Option<CountingProxy> {
        let upstream = upstream
            .strip_prefix("http://")?
            .trim_end_matches('/')
            .to_owned();
        let listener = TcpListener::bind("127.0.0.1:0").ok()?;
        let url = format!("http://{}", listener.local_addr().ok()?);
        let counts = Counts::default();
        let counting = counts.clone();
        std::thread::Builder::new()
            .name("dynamodb-proxy".into())
            .spawn(move || {
                for client in listener.incoming().flatten() {
                    let Ok(server) = TcpStream::connect(&upstream) else {
                        continue; // the client sees a closed connection and retries
                    };
                    let _ = client.set_nodelay(true);
                    let _ = server.set_nodelay(true);
                    let (Ok(client2), Ok(server2)) = (client.try_clone(), server.try_clone())
                    else {
                        continue;
                    };
                    let counts = counting.clone();
                    std::thread::spawn(move || forward_counting(client, server, counts));
                    std::thread::spawn(move || forward(server2, client2));
                }
            })
            .ok()?;
        Some(CountingProxy { url, counts })
    }
}

/// Copies requests upstream, counting one per `X-Amz-Target` header line.
fn forward_counting(mut from: TcpStream, mut to: TcpStream, counts: Counts) {
    const HEADER: &[u8] = b"x-amz-target:";
    let mut buf = [0u8; 16 * 1024];
    // The start of the current line (header lines are short; bodies are not looked at).
    let mut line: Vec<u8> = Vec::with_capacity(128);
    loop {
        let n = match from.read(&mut buf) {
            Ok(0) | Err(_) => break,
            Ok(n) => n,
        };
        for &b in &buf[..n] {
            if b == b'\n' {
                if line.len() > HEADER.len() && line[..HEADER.len()].eq_ignore_ascii_case(HEADER) {
                    let value = String::from_utf8_lossy(&line[HEADER.len()..]);
                    let value = value.trim();
                    // "DynamoDB_20120810.UpdateItem" -> "UpdateItem"
                    let op = value.rsplit('.').next().unwrap_or(value).to_owned();
                    counts.add(op);
                }
                line.clear();
            } else if line.len() < 128 {
                line.push(b);
            }
        }
        if to.write_all(&buf[..n]).is_err() {
            break;
        }
    }
    let _ = to.shutdown(Shutdown::Write);
    let _ = from.shutdown(Shutdown::Read);
}

fn forward(mut from: TcpStream, mut to: TcpStream) {
    let _ = std::io::copy(&mut from, &mut to);
    let _ = to.shutdown(Shutdown::Write);
    let _ = from.shutdown(Shutdown::Read);
}
