//! A scripted AWS JSON endpoint over plain HTTP: answers the n-th request with the n-th
//! canned answer and records what each request asked (its `X-Amz-Target` and JSON body),
//! for wire tests of what no emulator shows (paging, throttling, HTTP 500 answers).

use std::collections::VecDeque;
use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::sync::{Arc, Mutex};

/// One request as the fake saw it.
#[derive(Debug, Clone)]
pub struct Seen {
    /// The operation, e.g. `Kinesis_20131202.ListShards`.
    pub target: String,
    /// The request's JSON body.
    pub body: serde_json::Value,
}

/// A running fake endpoint.
pub struct Fake {
    /// Its URL.
    pub url: String,
    seen: Arc<Mutex<Vec<Seen>>>,
}

impl Fake {
    /// Starts a fake answering with `answers` (HTTP status, JSON body), in order; once
    /// they run out it answers HTTP 500.
    pub fn start(answers: Vec<(u16, serde_json::Value)>) -> Fake {
        let listener = TcpListener::bind("127.0.0.1:0").expect("bind");
        let url = format!("http://{}", listener.local_addr().expect("address"));
        let seen = Arc::new(Mutex::new(Vec::new()));
        let answers = Arc::new(Mutex::new(VecDeque::from(answers)));
        let recorder = seen.clone();
        // A plain thread with blocking I/O: it lives until the test process ends.
        std::thread::spawn(move || {
            for stream in listener.incoming().flatten() {
                let (answers, recorder) = (answers.clone(), recorder.clone());
                std::thread::spawn(move || serve(stream, &answers, &recorder));
            }
        });
        Fake { url, seen }
    }

    /// The requests so far.
    pub fn seen(&self) -> Vec<Seen> {
        self.seen.lock().expect("lock").clone()
    }

    /// The operations of the requests so far (`DescribeTable`, `Scan`, ...).
    pub fn ops(&self) -> Vec<String> {
        self.seen()
            .iter()
            .map(|s| s.target.rsplit('.').next().unwrap_or("").to_owned())
            .collect()
    }
}

type Answers = Mutex<VecDeque<(u16, serde_json::Value)>>;

fn serve(mut stream: TcpStream, answers: &Answers, seen: &Mutex<Vec<Seen>>) {
    let mut buffer = Vec::new();
    let mut chunk = [0u8; 8192];
    loop {
        // Metadata, then a body of Content-Length bytes (the SDK does not chunk here).
        let header_end = loop {
            if let Some(at) = buffer.windows(4).position(|w| w == b"\r\n\r\n") {
                break at + 4;
            }
            match stream.read(&mut chunk) {
                Ok(0) | Err(_) => return,
                Ok(n) => buffer.extend_from_slice(&chunk[..n]),
            }
        };
        let head = String::from_utf8_lossy(&buffer[..header_end]).to_string();
        let header = |name: &str| {
            head.lines().find_map(|line| {
                let (key, value) = line.split_once(':')?;
                key.trim()
                    .eq_ignore_ascii_case(name)
                    .then(|| value.trim().to_owned())
            })
        };
        let length: usize = header("content-length")
            .and_then(|v| v.parse().ok())
            .unwrap_or(0);
        let target = header("x-amz-target").unwrap_or_default();
        while buffer.len() < header_end + length {
            match stream.read(&mut chunk) {
                Ok(0) | Err(_) => return,
                Ok(n) => buffer.extend_from_slice(&chunk[..n]),
            }
        }
        let body = serde_json::from_slice(&buffer[header_end..header_end + length])
            .unwrap_or(serde_json::Value::Null);
        buffer.drain(..header_end + length);
        seen.lock().expect("lock").push(Seen { target, body });

        let (status, answer) = answers
            .lock()
            .expect("lock")
            .pop_front()
            .unwrap_or((500, serde_json::json!({"message": "no more answers"})));
        let answer = answer.to_string();
        let response = format!(
            "HTTP/1.1 {status} Scripted\r\ncontent-type: application/x-amz-json-1.1\r\n\
             content-length: {}\r\n\r\n{answer}",
            answer.len()
        );
        if stream.write_all(response.as_bytes()).is_err() {
            return;
        }
    }
}
