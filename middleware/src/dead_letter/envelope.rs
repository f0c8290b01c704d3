//! The dead-letter envelope: how a dead letter is written to a Kinesis stream and read
//! back, so that every record Kinesis accepted can be dead-lettered into a stream.
//!
//! # Format (version 2)
//!
//! One dead letter is one Kinesis record, or several when the original record was close
//! to the dead-letter stream's record limit or above it (see *Parts* below). Each
//! record's data is:
//!
//! | bytes | what |
//! |---|---|
//! | 4 | the magic `SFDL` |
//! | 1 | the format version, `2` |
//! | 4 | the header's length `n`, unsigned big-endian |
//! | `n` | the header: a JSON object (below) |
//! | the rest | the payload's bytes, raw (for a part: its slice of the payload) |
//!
//! The header holds `stream`, `shard`, `sequence_number` (decimal string),
//! `sub_sequence`, `partition_key`, `error`, `attempts` (or `null`), `failed_at_ms`
//! (epoch milliseconds), `payload_len` (the whole payload's length), `part` (0-based),
//! `parts` and `offset` (where this part's bytes start in the payload). The dead
//! letter's partition key is the original one, so a dead-letter stream is partitioned
//! like its source.
//!
//! The overhead is small and bounded: the error text is cut to [`MAX_ERROR_BYTES`]
//! (at a character boundary, marked with `…`), and every other field is bounded by
//! Kinesis itself (a stream name of at most 128 characters, a sequence number of at
//! most 129 digits, a partition key of at most 256 characters).
//!
//! # Parts
//!
//! Kinesis counts a record's data *and* its partition key against a stream's maximum
//! record size (1 MiB unless the stream was set for up to 10 MiB), so a record at its
//! stream's limit leaves no room for any header: such a payload cannot fit in one
//! record with its metadata. When the payload, the header and the partition key do not
//! fit in the dead-letter stream's limit ([`MAX_RECORD_BYTES`] with
//! [`to_records`](DeadLetterEnvelope::to_records), any other with
//! [`to_records_within`](DeadLetterEnvelope::to_records_within)), the payload is split
//! into parts whose headers are equal (every field the same except `part` and
//! `offset`), each a full record of the layout above. A record from a stream with the
//! same limit as the dead-letter stream takes at most two parts; a 10 MiB record
//! dead-lettered into a stream of 1 MiB records takes eleven.
//!
//! Reassembly: collect the parts of one dead letter — the same `stream`, `shard`,
//! `sequence_number`, `sub_sequence`, `failed_at_ms`, `payload_len` and `parts` — in any
//! order, and concatenate their payload bytes by `part` (or place them at `offset`);
//! the result is `payload_len` bytes long. [`Reassembly`] does that; the parts of one
//! dead letter share a partition key, so they land in the same shard of the
//! dead-letter stream.
//!
//! # Headers (version 3)
//!
//! A dead letter of a record that had [`Headers`] is written as version `3`: the same
//! layout, with the byte `3` and a header field `headers_len`. The bytes after the
//! header (the *body*, which parts split as above) are then `headers_len` bytes of the
//! headers as JSON — a list of `{"name":...,"value":...}`, with `"class":...` for a value
//! that carries a Java type — followed by the payload's bytes; `payload_len` and
//! `offset` count in the body. Headers travel in the body rather than in the header so
//! that a record whose headers are large still fits: they are split into parts like the
//! payload. A dead letter without headers is written as version 2, byte for byte as
//! before; a reader that knows only version 2 skips version 3 records as not envelopes
//! instead of taking the headers for payload.
//!
//! # Version 1
//!
//! Version 1, written before, is one JSON object with the payload in base64
//! (`{"shardflow_dead_letter":1, ..., "payload_base64":"..."}`).
//! [`DeadLetterEnvelope::from_bytes`] reads it as well, as a complete envelope.

use std::collections::HashMap;
use std::fmt;

use bytes::{BufMut, Bytes, BytesMut};
use shardflow::headers::HeaderValue;
use shardflow::producer::MAX_RECORD_BYTES;
use shardflow::Headers;

use super::DeadLetterRecord;

/// The first bytes of every version 2 envelope.
pub const MAGIC: &[u8; 4] = b"SFDL";

/// The longest error text an envelope keeps, in bytes (UTF-8); longer texts are cut at
/// a character boundary and end with `…`.
pub const MAX_ERROR_BYTES: usize = 4096;

/// Magic, version byte and header length.
const PREFIX_LEN: usize = MAGIC.len() + 1 + 4;

/// The most parts a dead letter read back may have. Any record Kinesis accepted takes
/// at most eleven (a 10 MiB record in 1 MiB parts); a header that claims more is
/// refused, so that a corrupt or hostile record cannot make a reader reserve room for
/// millions of parts.
pub const MAX_PARTS: u32 = 16;

/// A dead letter as written to a stream (see the [module docs](self)): where the record
/// came from, why it failed, and its payload — whole, or one part of it.
#[derive(Clone, PartialEq)]
#[non_exhaustive]
pub struct DeadLetterEnvelope {
    /// The stream the record was read from.
    pub stream: String,
    /// The shard it was read from.
    pub shard: String,
    /// Its sequence number (decimal digits).
    pub sequence_number: String,
    /// Its sub-sequence number (the user record within a KPL aggregate; 0 otherwise).
    pub sub_sequence: u64,
    /// Its partition key (the dead letter's partition key too).
    pub partition_key: String,
    /// The error and its causes, joined with `": "`, at most [`MAX_ERROR_BYTES`].
    pub error: String,
    /// How many calls of the handler failed, where known: reported by a
    /// [`retry`](crate::retry) layer below the dead-letter layer, `None` without one.
    pub attempts: Option<u32>,
    /// When the record was dead-lettered, epoch milliseconds.
    pub failed_at_ms: u64,
    /// The whole payload's length in bytes.
    pub payload_len: u64,
    /// Which part this is, from 0.
    pub part: u32,
    /// How many parts the dead letter has (1: this envelope is complete).
    pub parts: u32,
    /// Where this part's bytes start in the payload.
    pub offset: u64,
    /// The payload exactly as read: the whole of it in a complete envelope, this part's
    /// slice otherwise.
    pub payload: Bytes,
    /// The record's own headers (empty when it had none, and in a part of a dead letter
    /// with headers until [`Reassembly`] puts it together).
    pub headers: Headers,
    /// In a part read back: how many bytes at the start of the body are the headers
    /// (0 once they are parsed out).
    headers_len: u64,
}

// Every field's equality is total: the headers' values are strings and JSON values
// (whose numbers are never NaN).
impl Eq for DeadLetterEnvelope {}

/// A record that is not a [`DeadLetterEnvelope`].
#[derive(Debug, thiserror::Error)]
#[error("not a shardflow dead-letter envelope: {0}")]
pub struct NotAnEnvelope(String);

/// A dead letter that cannot be written to a stream.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum EnvelopeError {
    /// The header (the record's metadata) with the partition key leaves no room for the
    /// payload in a record. Metadata Kinesis gave cannot be this large.
    #[error(
        "the dead letter's header ({header} bytes) and partition key ({partition_key} bytes) \
         leave no room for the payload in a {limit}-byte record"
    )]
    HeaderTooLarge {
        /// The header's size in bytes, with the format's prefix.
        header: usize,
        /// The partition key's size in bytes.
        partition_key: usize,
        /// The dead-letter stream's record limit the parts were cut for.
        limit: usize,
    },
}

/// The header of a version 2 envelope, as JSON.
#[derive(serde::Serialize, serde::Deserialize)]
struct Header {
    stream: String,
    shard: String,
    sequence_number: String,
    sub_sequence: u64,
    partition_key: String,
    error: String,
    attempts: Option<u32>,
    failed_at_ms: u64,
    payload_len: u64,
    part: u32,
    parts: u32,
    offset: u64,
    #[serde(default, skip_serializing_if = "is_zero")]
    headers_len: u64,
}

fn is_zero(n: &u64) -> bool {
    *n == 0
}

/// The headers as the JSON of a version 3 body.
fn headers_to_json(headers: &Headers) -> Vec<u8> {
    let list: Vec<serde_json::Value> = headers
        .iter()
        .map(|(name, value)| match value {
            HeaderValue::Typed { class, value } => {
                serde_json::json!({"name": name, "value": value, "class": class})
            }
            other => serde_json::json!({"name": name, "value": other.to_json()}),
        })
        .collect();
    // A list of JSON values serializes without fail.
    serde_json::to_vec(&list).unwrap_or_default()
}

/// The headers of a version 3 body; `None` when they do not parse.
fn headers_from_json(json: &[u8]) -> Option<Headers> {
    let list: Vec<serde_json::Value> = serde_json::from_slice(json).ok()?;
    let mut headers = Headers::new();
    for entry in list {
        let name = entry.get("name")?.as_str()?;
        let value = entry.get("value")?.clone();
        let value = match entry.get("class").and_then(|c| c.as_str()) {
            Some(class) => HeaderValue::Typed {
                class: class.to_owned(),
                value,
            },
            None => HeaderValue::from(value),
        };
        headers.insert(name, value);
    }
    Some(headers)
}

/// Version 1: one JSON object, the payload in base64.
#[derive(serde::Deserialize)]
struct V1 {
    shardflow_dead_letter: u32,
    stream: String,
    shard: String,
    sequence_number: String,
    sub_sequence: u64,
    partition_key: String,
    error: String,
    attempts: Option<u32>,
    failed_at_ms: u64,
    payload_base64: String,
}

/// `text` cut to at most `max` bytes at a character boundary, ending with `…` when cut.
fn bounded(text: &str, max: usize) -> String {
    if text.len() <= max {
        return text.to_owned();
    }
    const MARK: &str = "…";
    let mut end = max.saturating_sub(MARK.len());
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    format!("{}{MARK}", &text[..end])
}

impl DeadLetterEnvelope {
    /// The version this crate writes for a dead letter without headers.
    pub const VERSION: u8 = 2;

    /// The version this crate writes for a dead letter with headers (module docs).
    pub const VERSION_WITH_HEADERS: u8 = 3;

    /// The complete envelope of a dead letter, failed now.
    pub fn from_record(record: &DeadLetterRecord) -> Self {
        let h = &record.metadata;
        DeadLetterEnvelope {
            stream: h.stream.to_string(),
            shard: h.shard_id.to_string(),
            sequence_number: h.sequence_number.as_str().to_owned(),
            sub_sequence: h.sub_sequence_number,
            partition_key: h.partition_key.clone(),
            error: bounded(&record.error, MAX_ERROR_BYTES),
            attempts: record.attempts,
            failed_at_ms: std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX)),
            payload_len: record.payload.len() as u64,
            part: 0,
            parts: 1,
            offset: 0,
            payload: record.payload.clone(),
            headers: record.headers.clone(),
            headers_len: 0,
        }
    }

    /// Whether this envelope holds the whole payload (one part).
    pub fn is_complete(&self) -> bool {
        self.parts == 1 && self.payload.len() as u64 == self.payload_len
    }

    /// The body: the headers' JSON (when there are headers) and the payload, and how
    /// long the headers' part is.
    fn body(&self) -> (Bytes, u64) {
        if self.headers.is_empty() {
            return (self.payload.clone(), 0);
        }
        let json = headers_to_json(&self.headers);
        let mut body = BytesMut::with_capacity(json.len() + self.payload.len());
        body.put_slice(&json);
        body.put_slice(&self.payload);
        (body.freeze(), json.len() as u64)
    }

    /// Splits a complete body into headers and payload; `false` when the headers do not
    /// parse.
    fn split_headers(&mut self) -> bool {
        if self.headers_len == 0 {
            return true;
        }
        let Ok(at) = usize::try_from(self.headers_len) else {
            return false;
        };
        if at > self.payload.len() {
            return false;
        }
        let Some(headers) = headers_from_json(&self.payload[..at]) else {
            return false;
        };
        self.headers = headers;
        self.payload = self.payload.slice(at..);
        self.payload_len = self.payload.len() as u64;
        self.headers_len = 0;
        true
    }

    fn header(
        &self,
        body_len: u64,
        headers_len: u64,
        part: u32,
        parts: u32,
        offset: u64,
    ) -> Header {
        Header {
            stream: self.stream.clone(),
            shard: self.shard.clone(),
            sequence_number: self.sequence_number.clone(),
            sub_sequence: self.sub_sequence,
            partition_key: self.partition_key.clone(),
            error: bounded(&self.error, MAX_ERROR_BYTES),
            attempts: self.attempts,
            failed_at_ms: self.failed_at_ms,
            payload_len: body_len,
            part,
            parts,
            offset,
            headers_len,
        }
    }

    fn encode(header: &Header, payload: &[u8]) -> Bytes {
        // Serializing a struct of strings and integers cannot fail.
        let json = serde_json::to_vec(header).unwrap_or_default();
        let mut out = BytesMut::with_capacity(PREFIX_LEN + json.len() + payload.len());
        out.put_slice(MAGIC);
        out.put_u8(if header.headers_len > 0 {
            Self::VERSION_WITH_HEADERS
        } else {
            Self::VERSION
        });
        // A header is far below 4 GiB: its fields are bounded (module docs).
        out.put_u32(u32::try_from(json.len()).unwrap_or(u32::MAX));
        out.put_slice(&json);
        out.put_slice(payload);
        out.freeze()
    }

    /// The data of the record(s) that carry this dead letter, each of which fits in
    /// [`MAX_RECORD_BYTES`] (the record limit of every stream) together with the
    /// partition key: one record when it fits, else the payload split into parts
    /// (module docs). Written in the current version, with the payload of this envelope
    /// taken as the whole payload.
    pub fn to_records(&self) -> Result<Vec<Bytes>, EnvelopeError> {
        self.to_records_within(MAX_RECORD_BYTES)
    }

    /// As [`to_records`](Self::to_records), for a dead-letter stream whose maximum
    /// record size is `limit` bytes of data plus partition key (a stream set for large
    /// records takes up to 10 MiB; see
    /// [`Producer::max_record_size`](shardflow::Producer::max_record_size)): each record
    /// fits in `limit`, so fewer parts are needed.
    pub fn to_records_within(&self, limit: usize) -> Result<Vec<Bytes>, EnvelopeError> {
        let key = self.partition_key.len();
        let (body, headers_len) = self.body();
        let body_len = body.len() as u64;
        let whole = self.header(body_len, headers_len, 0, 1, 0);
        let json_len = serde_json::to_vec(&whole).map_or(0, |j| j.len());
        if PREFIX_LEN + json_len + body.len() + key <= limit {
            return Ok(vec![Self::encode(&whole, &body)]);
        }
        // The largest header any part can have: the widest part numbers and offset.
        let widest = self.header(body_len, headers_len, u32::MAX, u32::MAX, body_len);
        let widest_len = PREFIX_LEN + serde_json::to_vec(&widest).map_or(0, |j| j.len());
        let room = limit.saturating_sub(widest_len + key);
        let too_large = EnvelopeError::HeaderTooLarge {
            header: widest_len,
            partition_key: key,
            limit,
        };
        if room == 0 {
            return Err(too_large);
        }
        let chunks: Vec<&[u8]> = body.chunks(room).collect();
        let parts = u32::try_from(chunks.len()).map_err(|_| too_large)?;
        let mut offset = 0u64;
        let mut records = Vec::with_capacity(chunks.len());
        for (part, chunk) in (0u32..).zip(chunks) {
            records.push(Self::encode(
                &self.header(body_len, headers_len, part, parts, offset),
                chunk,
            ));
            offset += chunk.len() as u64;
        }
        Ok(records)
    }

    /// Reads an envelope (or one part of one) from a record's data, in either version;
    /// an error for anything else.
    pub fn from_bytes(data: &[u8]) -> Result<Self, NotAnEnvelope> {
        match data.strip_prefix(MAGIC.as_slice()) {
            Some(rest) => Self::from_v2(rest),
            None => Self::from_v1(data),
        }
    }

    fn from_v2(rest: &[u8]) -> Result<Self, NotAnEnvelope> {
        let bad = |what: &str| NotAnEnvelope(what.to_owned());
        let (&version, rest) = rest.split_first().ok_or_else(|| bad("truncated"))?;
        if version != Self::VERSION && version != Self::VERSION_WITH_HEADERS {
            return Err(NotAnEnvelope(format!("version {version}")));
        }
        let (len, rest) = rest
            .split_first_chunk::<4>()
            .ok_or_else(|| bad("truncated"))?;
        let len = usize::try_from(u32::from_be_bytes(*len)).map_err(|_| bad("header length"))?;
        if rest.len() < len {
            return Err(bad("truncated header"));
        }
        let (json, payload) = rest.split_at(len);
        let h: Header = serde_json::from_slice(json).map_err(|e| NotAnEnvelope(e.to_string()))?;
        let fits = (1..=MAX_PARTS).contains(&h.parts)
            && h.part < h.parts
            && h.offset
                .checked_add(payload.len() as u64)
                .is_some_and(|end| end <= h.payload_len);
        let headers_fit = (version == Self::VERSION_WITH_HEADERS) == (h.headers_len > 0)
            && h.headers_len <= h.payload_len;
        if !fits || !headers_fit {
            return Err(bad("part numbers or lengths do not fit"));
        }
        let mut envelope = DeadLetterEnvelope {
            stream: h.stream,
            shard: h.shard,
            sequence_number: h.sequence_number,
            sub_sequence: h.sub_sequence,
            partition_key: h.partition_key,
            error: h.error,
            attempts: h.attempts,
            failed_at_ms: h.failed_at_ms,
            payload_len: h.payload_len,
            part: h.part,
            parts: h.parts,
            offset: h.offset,
            payload: Bytes::copy_from_slice(payload),
            headers: Headers::new(),
            headers_len: h.headers_len,
        };
        // A whole dead letter has its headers parsed out now; a part keeps its slice of
        // the body until reassembly.
        if envelope.parts == 1 && !envelope.split_headers() {
            return Err(bad("headers"));
        }
        Ok(envelope)
    }

    fn from_v1(data: &[u8]) -> Result<Self, NotAnEnvelope> {
        let v1: V1 = serde_json::from_slice(data).map_err(|e| NotAnEnvelope(e.to_string()))?;
        if v1.shardflow_dead_letter != 1 {
            return Err(NotAnEnvelope(format!(
                "version {}",
                v1.shardflow_dead_letter
            )));
        }
        let payload = aws_smithy_types::base64::decode(&v1.payload_base64)
            .map(Bytes::from)
            .map_err(|e| NotAnEnvelope(format!("payload_base64: {e}")))?;
        Ok(DeadLetterEnvelope {
            stream: v1.stream,
            shard: v1.shard,
            sequence_number: v1.sequence_number,
            sub_sequence: v1.sub_sequence,
            partition_key: v1.partition_key,
            error: v1.error,
            attempts: v1.attempts,
            failed_at_ms: v1.failed_at_ms,
            payload_len: payload.len() as u64,
            part: 0,
            parts: 1,
            offset: 0,
            payload,
            headers: Headers::new(),
            headers_len: 0,
        })
    }
}

impl fmt::Debug for DeadLetterEnvelope {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // Never the payload.
        f.debug_struct("DeadLetterEnvelope")
            .field("stream", &self.stream)
            .field("shard", &self.shard)
            .field("sequence_number", &self.sequence_number)
            .field("sub_sequence", &self.sub_sequence)
            .field("error", &self.error)
            .field("attempts", &self.attempts)
            .field("failed_at_ms", &self.failed_at_ms)
            .field("payload_len", &self.payload_len)
            .field("part", &self.part)
            .field("parts", &self.parts)
            .field("headers", &self.headers)
            .finish()
    }
}

/// What identifies one dead letter among the parts of many.
#[derive(Clone, PartialEq, Eq, Hash)]
struct LetterId {
    stream: String,
    shard: String,
    sequence_number: String,
    sub_sequence: u64,
    failed_at_ms: u64,
    payload_len: u64,
    parts: u32,
}

/// Puts dead letters split into parts back together (see the [module docs](self)):
/// feed it every envelope read, in any order; it returns each dead letter once it is
/// complete. It keeps the parts of incomplete letters in memory until their last part
/// comes; a letter whose parts do not add up to its `payload_len` is dropped and counted
/// in [`Reassembly::incomplete`].
#[derive(Default)]
pub struct Reassembly {
    waiting: HashMap<LetterId, (DeadLetterEnvelope, Vec<Option<Bytes>>)>,
    /// Letters dropped because their parts do not add up to their length.
    broken: usize,
}

impl Reassembly {
    /// An empty reassembly.
    pub fn new() -> Self {
        Self::default()
    }

    /// Adds an envelope; returns the complete dead letter when `envelope` was complete
    /// already or was its last missing part. A part seen twice is ignored.
    pub fn push(&mut self, envelope: DeadLetterEnvelope) -> Option<DeadLetterEnvelope> {
        if envelope.parts == 1 {
            if !envelope.is_complete() {
                self.broken += 1;
                return None;
            }
            return Some(envelope);
        }
        let id = LetterId {
            stream: envelope.stream.clone(),
            shard: envelope.shard.clone(),
            sequence_number: envelope.sequence_number.clone(),
            sub_sequence: envelope.sub_sequence,
            failed_at_ms: envelope.failed_at_ms,
            payload_len: envelope.payload_len,
            parts: envelope.parts,
        };
        let parts = usize::try_from(envelope.parts).ok()?;
        let part = usize::try_from(envelope.part).ok()?;
        let entry = self.waiting.entry(id.clone()).or_insert_with(|| {
            let first = DeadLetterEnvelope {
                payload: Bytes::new(),
                ..envelope.clone()
            };
            (first, vec![None; parts])
        });
        if let Some(slot) = entry.1.get_mut(part) {
            slot.get_or_insert(envelope.payload);
        }
        if entry.1.iter().any(Option::is_none) {
            return None;
        }
        let (mut letter, chunks) = self.waiting.remove(&id)?;
        let mut payload = BytesMut::new();
        for chunk in chunks.into_iter().flatten() {
            payload.put_slice(&chunk);
        }
        if payload.len() as u64 != letter.payload_len {
            self.broken += 1;
            return None;
        }
        letter.payload = payload.freeze();
        letter.part = 0;
        letter.parts = 1;
        letter.offset = 0;
        if !letter.split_headers() {
            self.broken += 1;
            return None;
        }
        Some(letter)
    }

    /// How many dead letters have parts missing so far, or were dropped because their
    /// parts do not add up to their length.
    pub fn incomplete(&self) -> usize {
        self.waiting.len() + self.broken
    }
}

impl fmt::Debug for Reassembly {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Reassembly")
            .field("incomplete", &self.waiting.len())
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;
    use proptest::test_runner::{Config, RngAlgorithm, TestRng, TestRunner};

    use super::*;

    fn letter(payload: Bytes, partition_key: &str, error: &str) -> DeadLetterEnvelope {
        DeadLetterEnvelope {
            stream: "orders".into(),
            shard: "shardId-000000000003".into(),
            sequence_number: "4".repeat(129),
            sub_sequence: 7,
            partition_key: partition_key.into(),
            error: error.into(),
            attempts: Some(5),
            failed_at_ms: 1_764_530_000_000,
            payload_len: payload.len() as u64,
            part: 0,
            parts: 1,
            offset: 0,
            payload,
            headers: Headers::new(),
            headers_len: 0,
        }
    }

    /// Every record's data, the parts read back, and the reassembled letter.
    fn round_trip(envelope: &DeadLetterEnvelope, reverse: bool) -> (usize, DeadLetterEnvelope) {
        let mut records = envelope.to_records().expect("encodes");
        for data in &records {
            assert!(
                data.len() + envelope.partition_key.len() <= MAX_RECORD_BYTES,
                "a record of {} bytes with its key",
                data.len() + envelope.partition_key.len()
            );
        }
        if reverse {
            records.reverse();
        }
        let mut reassembly = Reassembly::new();
        let mut done = None;
        for data in &records {
            let part = DeadLetterEnvelope::from_bytes(data).expect("reads back");
            assert!(done.is_none(), "complete before its last part");
            done = reassembly.push(part);
        }
        assert_eq!(reassembly.incomplete(), 0);
        (records.len(), done.expect("complete after the last part"))
    }

    #[test]
    fn a_small_dead_letter_is_one_record_with_the_payload_raw() {
        let envelope = letter(Bytes::from_static(b"\x00raw\xff"), "customer-7", "boom");
        let records = envelope.to_records().unwrap();
        assert_eq!(records.len(), 1);
        assert!(records[0].starts_with(b"SFDL\x02"));
        assert!(
            records[0].ends_with(b"\x00raw\xff"),
            "the payload raw, last"
        );
        let read = DeadLetterEnvelope::from_bytes(&records[0]).unwrap();
        assert_eq!(read, envelope);
        assert!(read.is_complete());
    }

    /// The largest record Kinesis accepts (data and a 256-character key, 1 MiB together)
    /// does not fit with any header: it is written in two parts and put back together.
    #[test]
    fn a_record_at_the_limit_is_split_in_two_parts_and_reassembled() {
        let key = "é".repeat(128) + &"k".repeat(128);
        let payload: Vec<u8> = (0..MAX_RECORD_BYTES - key.len())
            .map(|i| (i % 251) as u8)
            .collect();
        let envelope = letter(Bytes::from(payload), &key, "poison");
        for reverse in [false, true] {
            let (parts, back) = round_trip(&envelope, reverse);
            assert_eq!(parts, 2);
            assert_eq!(back, envelope, "byte-exact, with its metadata");
        }
    }

    #[test]
    fn a_long_error_is_cut_at_a_character_boundary() {
        let error = "ü".repeat(MAX_ERROR_BYTES);
        let envelope = letter(Bytes::from_static(b"x"), "k", &error);
        let records = envelope.to_records().unwrap();
        let read = DeadLetterEnvelope::from_bytes(&records[0]).unwrap();
        assert!(read.error.len() <= MAX_ERROR_BYTES);
        assert!(read.error.ends_with('…'), "marked as cut");
        assert!(error.starts_with(read.error.trim_end_matches('…')));
    }

    #[test]
    fn the_earlier_json_envelope_is_still_read() {
        let v1 = br#"{"shardflow_dead_letter":1,"stream":"orders","shard":"shardId-000000000001","sequence_number":"4959","sub_sequence":0,"partition_key":"customer-7","error":"decode: expected value","attempts":4,"failed_at_ms":1764530000000,"payload_base64":"bm90IGpzb24="}"#;
        let read = DeadLetterEnvelope::from_bytes(v1).unwrap();
        assert_eq!(&read.payload[..], b"not json");
        assert_eq!(
            (
                read.stream.as_str(),
                read.partition_key.as_str(),
                read.attempts,
                read.error.as_str()
            ),
            ("orders", "customer-7", Some(4), "decode: expected value")
        );
        assert!(read.is_complete());
    }

    /// Regression: a dead letter whose parts did not add up to its length vanished from a
    /// replay, counted neither as read nor as incomplete.
    #[test]
    fn a_letter_whose_parts_do_not_add_up_is_counted_as_incomplete() {
        let envelope = letter(Bytes::from_static(b"payload"), "k", "e");
        // One record that claims more payload than it carries.
        let mut header = envelope.header(envelope.payload.len() as u64, 0, 0, 1, 0);
        header.payload_len = 100;
        let short =
            DeadLetterEnvelope::from_bytes(&DeadLetterEnvelope::encode(&header, b"payload"))
                .expect("an envelope");
        let mut reassembly = Reassembly::new();
        assert!(reassembly.push(short).is_none());
        assert_eq!(
            reassembly.incomplete(),
            1,
            "the short letter is not counted"
        );
        // Two parts, both there, that add up to less than the length they claim.
        let mut reassembly = Reassembly::new();
        for (part, offset) in [(0, 0), (1, 3)] {
            let mut header = envelope.header(envelope.payload.len() as u64, 0, part, 2, offset);
            header.payload_len = 10;
            let data = DeadLetterEnvelope::encode(&header, b"abc");
            let read = DeadLetterEnvelope::from_bytes(&data).expect("an envelope");
            assert!(reassembly.push(read).is_none());
        }
        assert_eq!(
            reassembly.incomplete(),
            1,
            "the broken letter is not counted"
        );
    }

    #[test]
    fn anything_else_is_not_an_envelope() {
        let good = letter(Bytes::from_static(b"payload"), "k", "e")
            .to_records()
            .unwrap()
            .remove(0);
        let mut other_version = good.to_vec();
        other_version[4] = 3;
        for data in [
            &b"{\"id\":1}"[..],
            b"not json",
            b"SFDL",
            b"SFDL\x02\x00\x00\xff\xff{}",
            &other_version,
            &good[..20],
            &letter(Bytes::from_static(b"x"), "k", "e").header_claiming(u32::MAX),
        ] {
            assert!(DeadLetterEnvelope::from_bytes(data).is_err(), "{data:?}");
        }
    }

    impl DeadLetterEnvelope {
        /// A record whose header claims `parts` parts.
        fn header_claiming(&self, parts: u32) -> Bytes {
            Self::encode(
                &self.header(self.payload.len() as u64, 0, 0, parts, 0),
                &self.payload,
            )
        }
    }

    fn any_letter() -> impl Strategy<Value = DeadLetterEnvelope> {
        let key = prop_oneof![
            "[a-z0-9-]{1,40}",
            proptest::collection::vec(any::<char>(), 1..=256)
                .prop_map(|chars| chars.into_iter().collect::<String>()),
        ];
        let error = prop_oneof![".{0,200}", ".{3000,6000}"];
        // Sizes near the limit are the interesting ones; small ones are cheap.
        let size = prop_oneof![0usize..2_000, 900_000usize..=MAX_RECORD_BYTES];
        (
            key,
            error,
            size,
            any::<u8>(),
            0u64..u64::MAX,
            any::<Option<u32>>(),
        )
            .prop_map(|(key, error, size, fill, sub_sequence, attempts)| {
                let size = size.min(MAX_RECORD_BYTES - key.len());
                let mut envelope = letter(Bytes::from(vec![fill; size]), &key, &error);
                envelope.sub_sequence = sub_sequence;
                envelope.attempts = attempts;
                envelope
            })
    }

    /// Any record Kinesis accepts (payload and key within 1 MiB, a key of 1 to 256
    /// characters), with any error text, is written in records within the limit, in at
    /// most two parts, and read back exactly (the error bounded).
    #[test]
    fn every_accepted_record_round_trips_within_the_limit() {
        let config = Config {
            cases: 200,
            failure_persistence: None,
            ..Config::default()
        };
        let rng = TestRng::from_seed(RngAlgorithm::ChaCha, &[7; 32]);
        let mut runner = TestRunner::new_with_rng(config, rng);
        runner
            .run(&any_letter(), |envelope| {
                let (parts, back) = round_trip(&envelope, envelope.sub_sequence % 2 == 1);
                prop_assert!(parts <= 2, "{parts} parts");
                let expected = DeadLetterEnvelope {
                    error: bounded(&envelope.error, MAX_ERROR_BYTES),
                    ..envelope
                };
                prop_assert_eq!(back, expected);
                Ok(())
            })
            .unwrap();
    }

    fn with_headers(mut envelope: DeadLetterEnvelope, headers: Headers) -> DeadLetterEnvelope {
        envelope.headers = headers;
        envelope
    }

    #[test]
    fn headers_come_back_with_their_order_and_java_types() {
        let mut headers = Headers::new();
        headers.insert("contentType", "application/json");
        headers.insert("attempt", 2);
        headers.insert(
            "id",
            HeaderValue::Typed {
                class: "java.util.UUID".into(),
                value: "5f1c0c4e-2b8e-4a57-9d0e-6a1f3c2b9e10".into(),
            },
        );
        let envelope = with_headers(
            letter(Bytes::from_static(b"{\"id\":1}"), "k", "boom"),
            headers,
        );
        let records = envelope.to_records().unwrap();
        assert_eq!(records.len(), 1);
        assert!(
            records[0].starts_with(b"SFDL\x03"),
            "version 3 with headers"
        );
        let back = DeadLetterEnvelope::from_bytes(&records[0]).unwrap();
        assert_eq!(back, envelope, "headers, payload and metadata as written");
        assert!(back.is_complete());
    }

    #[test]
    fn a_dead_letter_without_headers_is_written_as_before() {
        let envelope = letter(Bytes::from_static(b"raw"), "k", "boom");
        let records = envelope.to_records().unwrap();
        assert!(records[0].starts_with(b"SFDL\x02"));
        assert!(!String::from_utf8_lossy(&records[0]).contains("headers_len"));
    }

    #[test]
    fn huge_headers_split_into_parts_that_each_fit() {
        // A record Kinesis accepted: headers and payload together near the 1 MiB limit,
        // with values that JSON must escape (each control byte takes six).
        let mut headers = Headers::new();
        headers.insert("big", "\u{1}".repeat(300_000));
        headers.insert(
            "traceparent",
            "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",
        );
        let payload = Bytes::from(vec![b'p'; 600_000]);
        let envelope = with_headers(letter(payload, "customer-7", "boom"), headers);
        for reverse in [false, true] {
            let (parts, back) = round_trip(&envelope, reverse);
            assert!(parts >= 3, "{parts} parts");
            assert_eq!(back, envelope);
        }
    }

    #[test]
    fn a_part_with_headers_that_do_not_parse_is_not_a_dead_letter() {
        let envelope = with_headers(
            letter(Bytes::from_static(b"raw"), "k", "boom"),
            [("a", "b")].into_iter().collect(),
        );
        let mut data = envelope.to_records().unwrap().remove(0).to_vec();
        // The headers' JSON starts right after the header: break its first byte.
        let len = u32::from_be_bytes([data[5], data[6], data[7], data[8]]) as usize;
        data[PREFIX_LEN + len] = b'}';
        assert!(DeadLetterEnvelope::from_bytes(&data).is_err());
    }
}
