//! Spring Cloud Stream's ways of carrying headers inside a Kinesis record, read and
//! written byte for byte as Spring's own code does.
//!
//! - **JSON headers** (Spring Integration's `EmbeddedJsonHeadersMessageMapper`, used by
//!   the Kinesis binders since 4.0): a 4-byte big-endian length, the headers as one JSON
//!   object written by Jackson with default typing (`{"@class":"java.util.HashMap",...}`,
//!   values whose type JSON cannot say wrapped as `["java.lang.Long",1700000000000]`), a
//!   4-byte big-endian payload length, the raw payload. The same mapper writes a payload
//!   that is not bytes as a whole JSON `Message` document
//!   (`{"@class":"org.springframework.messaging.support.GenericMessage","payload":...,"headers":{...}}`):
//!   [`read_json`] reads both.
//! - **Legacy headers** (Spring Cloud Stream's `EmbeddedHeaderUtils`, binders 1.x to
//!   3.x): `0xff`, a header count, then per header a 1-byte name length, the name, a
//!   4-byte big-endian value length and the value as JSON text; then the raw payload.
//!
//! A record is taken for an envelope only when its framing adds up exactly and its JSON
//! parses; anything else is a plain payload and is left alone, as Spring leaves it.

use bytes::{BufMut, Bytes};
use serde_json::Value;

use super::{HeaderValue, Headers};

/// Which header framings a consumer recognises in the records it reads.
///
/// A record that is not an envelope in one of the chosen formats is delivered as it was
/// read, with no headers.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub enum HeaderFormat {
    /// Both Spring formats (the default): the legacy one first when the record starts
    /// with `0xff`, then the JSON one, as Spring's Kinesis binder 4.x reads.
    #[default]
    Auto,
    /// No recognition: every record's data is its payload, byte for byte.
    None,
    /// Only Spring Integration's JSON headers (and its whole-message JSON document).
    SpringJson,
    /// Only Spring Cloud Stream's legacy `0xff` framing.
    SpringLegacy,
}

impl HeaderFormat {
    /// The headers and the payload of `data` when it is an envelope in this format;
    /// `None` when it is a plain payload.
    pub fn read(self, data: &Bytes) -> Option<(Headers, Bytes)> {
        match self {
            HeaderFormat::None => None,
            HeaderFormat::SpringJson => read_json(data),
            HeaderFormat::SpringLegacy => read_legacy(data),
            HeaderFormat::Auto => read_legacy(data).or_else(|| read_json(data)),
        }
    }
}

/// The Java class Spring writes for the header map.
const HEADER_MAP_CLASS: &str = "java.util.HashMap";
/// The Java class this writer gives nested JSON objects (it keeps their order).
const OBJECT_CLASS: &str = "java.util.LinkedHashMap";
/// The Java class this writer gives JSON arrays.
const ARRAY_CLASS: &str = "java.util.ArrayList";
/// The Java class Jackson's default typing wraps a `Long` in; integers that fit `i32`
/// stay plain (Jackson reads them as `Integer`, a natural type).
const LONG_CLASS: &str = "java.lang.Long";
/// How a whole-message JSON document starts: Jackson writes the type id first.
const DOCUMENT_PREFIX: &[u8] = b"{\"@class\":\"org.springframework.";
/// The message classes whose JSON documents are read.
const MESSAGE_CLASSES: [&str; 2] = [
    "org.springframework.messaging.support.GenericMessage",
    "org.springframework.integration.support.MutableMessage",
];

/// Reads Spring Integration's JSON-headers framing, or its whole-message JSON document.
///
/// The framing is accepted only when the header length leaves room for the payload
/// length, the payload length is exactly what remains, and the headers are one JSON
/// object. Spring's reader also refuses an envelope whose payload is empty; this one
/// accepts it (the lengths still add up exactly), so an empty payload with headers that
/// shardflow wrote round-trips.
pub fn read_json(data: &Bytes) -> Option<(Headers, Bytes)> {
    read_json_framing(data).or_else(|| read_document(data))
}

fn read_json_framing(data: &Bytes) -> Option<(Headers, Bytes)> {
    let len = data.len();
    if len <= 8 {
        return None;
    }
    let headers_len = usize::try_from(be_u32(data, 0)?).ok()?;
    // Room for the 4-byte payload length after the headers.
    if headers_len > len - 8 {
        return None;
    }
    let payload_len = usize::try_from(be_u32(data, 4 + headers_len)?).ok()?;
    if payload_len != len - 8 - headers_len || data.get(4) != Some(&b'{') {
        return None;
    }
    let headers = parse_header_map(data.get(4..4 + headers_len)?)?;
    Some((headers, data.slice(8 + headers_len..)))
}

fn read_document(data: &Bytes) -> Option<(Headers, Bytes)> {
    if !data.starts_with(DOCUMENT_PREFIX) {
        return None;
    }
    let document: Document = serde_json::from_slice(data).ok()?;
    if !MESSAGE_CLASSES.contains(&document.class.as_str()) {
        return None;
    }
    let payload = match untyped(document.payload) {
        // A `String` payload reaches Spring as the string: its UTF-8 bytes here. (A
        // `byte[]` written this way is base64 text, and Spring reads it as that text too.)
        Value::String(text) => Bytes::from(text.into_bytes()),
        other => Bytes::from(serde_json::to_vec(&other).ok()?),
    };
    Some((header_map(document.headers), payload))
}

/// A whole `Message` as Jackson writes it: its class, payload and headers.
#[derive(serde::Deserialize)]
struct Document {
    #[serde(rename = "@class")]
    class: String,
    payload: Value,
    headers: Ordered,
}

/// Reads Spring Cloud Stream's legacy framing: `0xff`, a count of at least one header,
/// each header's name and JSON value with their lengths, then the payload.
///
/// Spring's own check is "longer than 8 bytes and starts with `0xff`", and then "no
/// exception while reading"; this reader asks the same and also that every name is
/// UTF-8 and every value parses as JSON. A frame with zero headers (`0xff 0x00`) is not
/// taken for an envelope: it would say nothing, and binary payloads starting with these
/// two bytes are common.
pub fn read_legacy(data: &Bytes) -> Option<(Headers, Bytes)> {
    if data.len() <= 8 || data[0] != 0xff || data[1] == 0 {
        return None;
    }
    let count = usize::from(data[1]);
    let mut at = 2;
    let mut headers = Headers::new();
    for _ in 0..count {
        let name_len = usize::from(*data.get(at)?);
        let name = std::str::from_utf8(data.get(at + 1..at + 1 + name_len)?).ok()?;
        at += 1 + name_len;
        let value_len = usize::try_from(i32::try_from(be_u32(data, at)?).ok()?).ok()?;
        at += 4;
        let value = serde_json::from_slice::<Value>(data.get(at..at + value_len)?).ok()?;
        at += value_len;
        headers.insert(name, from_spring(value));
    }
    Some((headers, data.slice(at..)))
}

/// Writes `payload` with `headers` in Spring Integration's JSON-headers framing, which
/// Spring's Kinesis binders read by default.
///
/// The header map is written as Jackson writes it for Spring: `"@class":"java.util.HashMap"`
/// first, strings, booleans, `null`, doubles and `i32` integers plain, larger integers
/// as `["java.lang.Long",n]`, nested objects and arrays with their Java class, and
/// [`HeaderValue::Typed`] values with theirs. Names keep their order (Spring's
/// `HashMap` has none). Fails only when a length does not fit the 4-byte fields.
pub fn write_json(headers: &Headers, payload: &[u8]) -> Option<Bytes> {
    let mut map = Vec::with_capacity(64);
    map.extend_from_slice(b"{\"@class\":\"");
    map.extend_from_slice(HEADER_MAP_CLASS.as_bytes());
    map.push(b'"');
    for (name, value) in headers.iter() {
        map.push(b',');
        write_string(&mut map, name);
        map.push(b':');
        write_header_value(&mut map, value);
    }
    map.push(b'}');
    let headers_len = u32::try_from(map.len()).ok()?;
    let payload_len = u32::try_from(payload.len()).ok()?;
    let mut out = Vec::with_capacity(8 + map.len() + payload.len());
    out.put_u32(headers_len);
    out.extend_from_slice(&map);
    out.put_u32(payload_len);
    out.extend_from_slice(payload);
    Some(Bytes::from(out))
}

/// Writes `payload` with `headers` in Spring Cloud Stream's legacy framing (for
/// consumers on binders older than 4.0). Values are written as plain JSON, as the
/// legacy writer's untyped Jackson mapper does. Fails when there are more than 255
/// headers, a name is longer than 255 bytes, or a value does not fit its length field.
pub fn write_legacy(headers: &Headers, payload: &[u8]) -> Option<Bytes> {
    let count = u8::try_from(headers.len()).ok()?;
    let mut out = Vec::with_capacity(2 + payload.len() + 32 * headers.len());
    out.push(0xff);
    out.push(count);
    for (name, value) in headers.iter() {
        out.push(u8::try_from(name.len()).ok()?);
        out.extend_from_slice(name.as_bytes());
        let json = serde_json::to_vec(&value.to_json()).ok()?;
        out.put_u32(u32::try_from(json.len()).ok()?);
        out.extend_from_slice(&json);
    }
    out.extend_from_slice(payload);
    Some(Bytes::from(out))
}

fn be_u32(data: &[u8], at: usize) -> Option<u32> {
    let bytes: [u8; 4] = data.get(at..at.checked_add(4)?)?.try_into().ok()?;
    Some(u32::from_be_bytes(bytes))
}

/// A JSON object's members in the order they were written.
struct Ordered(Vec<(String, Value)>);

impl<'de> serde::Deserialize<'de> for Ordered {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct Visit;
        impl<'de> serde::de::Visitor<'de> for Visit {
            type Value = Ordered;
            fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("a JSON object")
            }
            fn visit_map<A: serde::de::MapAccess<'de>>(
                self,
                mut map: A,
            ) -> Result<Ordered, A::Error> {
                let mut members = Vec::new();
                while let Some(member) = map.next_entry::<String, Value>()? {
                    members.push(member);
                }
                Ok(Ordered(members))
            }
        }
        deserializer.deserialize_map(Visit)
    }
}

/// The header map of Spring's JSON: one object, its `@class` dropped, values untyped.
fn parse_header_map(json: &[u8]) -> Option<Headers> {
    serde_json::from_slice(json).ok().map(header_map)
}

fn header_map(Ordered(members): Ordered) -> Headers {
    let mut headers = Headers::new();
    for (name, value) in members {
        if name != "@class" {
            headers.insert(name, from_spring(value));
        }
    }
    headers
}

/// A header value as Spring wrote it, typed or not, as ours. A typed value stays
/// [`HeaderValue::Typed`] unless writing the plain value gives Spring the same type
/// back, so that reading and writing again keeps every type Spring gave.
fn from_spring(value: Value) -> HeaderValue {
    match value {
        Value::String(s) => HeaderValue::String(s),
        Value::Array(items) if is_type_wrapper(&items) => {
            let original = Value::Array(items);
            let plain = HeaderValue::from(untyped(original.clone()));
            let mut rewritten = Vec::new();
            write_header_value(&mut rewritten, &plain);
            // Compared as values: member order aside.
            if serde_json::from_slice::<Value>(&rewritten).ok().as_ref() == Some(&original) {
                return plain;
            }
            let Value::Array(items) = original else {
                return plain;
            };
            let mut items = items.into_iter();
            match (items.next(), items.next()) {
                (Some(Value::String(class)), Some(inner)) => HeaderValue::Typed {
                    class,
                    value: wrapped_content(inner),
                },
                // `is_type_wrapper` checked the shape: not reached.
                _ => plain,
            }
        }
        other => HeaderValue::from(untyped(other)),
    }
}

/// `[ "a.java.Class", value ]`: how Jackson's default typing wraps a scalar or a list.
fn is_type_wrapper(items: &[Value]) -> bool {
    matches!(items, [Value::String(class), _] if looks_like_class(class))
}

fn looks_like_class(name: &str) -> bool {
    name.contains('.')
        && !name.starts_with('.')
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'$'))
}

/// JSON without Jackson's type information: `@class` members dropped, wrappers opened.
fn untyped(value: Value) -> Value {
    match value {
        Value::Object(members) => Value::Object(
            members
                .into_iter()
                .filter(|(name, _)| name != "@class")
                .map(|(name, v)| (name, untyped(v)))
                .collect(),
        ),
        Value::Array(items) if is_type_wrapper(&items) => {
            wrapped_content(items.into_iter().nth(1).unwrap_or(Value::Null))
        }
        Value::Array(items) => Value::Array(items.into_iter().map(untyped).collect()),
        scalar => scalar,
    }
}

/// What a type wrapper holds, without type information: a typed collection's elements
/// are an array that is never itself a wrapper (`["java.util.ArrayList", ["a.b", 1]]`
/// holds the list `["a.b", 1]`), each element untyped in turn.
fn wrapped_content(value: Value) -> Value {
    match value {
        Value::Array(items) => Value::Array(items.into_iter().map(untyped).collect()),
        other => untyped(other),
    }
}

fn write_header_value(out: &mut Vec<u8>, value: &HeaderValue) {
    match value {
        HeaderValue::String(s) => write_string(out, s),
        HeaderValue::Json(v) => write_typed(out, v),
        HeaderValue::Typed { class, value } => match value {
            Value::Object(members) => write_object(out, class, members),
            other => {
                out.push(b'[');
                write_string(out, class);
                out.push(b',');
                match other {
                    Value::Array(items) => write_array(out, items),
                    scalar => write_json_text(out, scalar),
                }
                out.push(b']');
            }
        },
    }
}

/// JSON with the type information Jackson's default typing expects for an `Object`.
fn write_typed(out: &mut Vec<u8>, value: &Value) {
    match value {
        Value::Number(n) if n.as_i64().is_some_and(|i| i32::try_from(i).is_err()) => {
            out.push(b'[');
            write_string(out, LONG_CLASS);
            out.push(b',');
            write_json_text(out, value);
            out.push(b']');
        }
        Value::Array(items) => {
            out.push(b'[');
            write_string(out, ARRAY_CLASS);
            out.push(b',');
            write_array(out, items);
            out.push(b']');
        }
        Value::Object(members) => write_object(out, OBJECT_CLASS, members),
        scalar => write_json_text(out, scalar),
    }
}

fn write_array(out: &mut Vec<u8>, items: &[Value]) {
    out.push(b'[');
    for (i, item) in items.iter().enumerate() {
        if i > 0 {
            out.push(b',');
        }
        write_typed(out, item);
    }
    out.push(b']');
}

fn write_object(out: &mut Vec<u8>, class: &str, members: &serde_json::Map<String, Value>) {
    out.extend_from_slice(b"{\"@class\":");
    write_string(out, class);
    for (name, v) in members {
        if name == "@class" {
            continue;
        }
        out.push(b',');
        write_string(out, name);
        out.push(b':');
        write_typed(out, v);
    }
    out.push(b'}');
}

fn write_string(out: &mut Vec<u8>, s: &str) {
    // Writing a `str` to a `Vec` cannot fail.
    let _ = serde_json::to_writer(&mut *out, s);
}

fn write_json_text(out: &mut Vec<u8>, value: &Value) {
    // Writing a `Value` to a `Vec` cannot fail (its map keys are strings).
    let _ = serde_json::to_writer(&mut *out, value);
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Regression: the elements of a typed list were taken for a type wrapper when the
    /// first looked like a class name, so `["example.com", 443]` came back as `443`.
    #[test]
    fn a_typed_list_keeps_its_elements() {
        let spring = serde_json::json!(["java.util.ArrayList", ["example.com", 443]]);
        assert_eq!(
            untyped(spring.clone()),
            serde_json::json!(["example.com", 443])
        );
        match from_spring(spring) {
            HeaderValue::Typed { class, value } => {
                assert_eq!(class, "java.util.ArrayList");
                assert_eq!(value, serde_json::json!(["example.com", 443]));
            }
            HeaderValue::Json(value) => {
                assert_eq!(value, serde_json::json!(["example.com", 443]))
            }
            other => panic!("{other:?}"),
        }
    }

    fn headers() -> Headers {
        let mut h = Headers::new();
        h.insert("contentType", "application/json");
        h.insert("sequenceNumber", 3);
        h.insert("big", 5_000_000_000i64);
        h.insert("flags", serde_json::json!({"a": [1, 2], "b": true}));
        h.insert(
            "id",
            HeaderValue::Typed {
                class: "java.util.UUID".into(),
                value: "0b3a94d6-33b4-4bd6-a8e7-4c0d2d8c4c41".into(),
            },
        );
        h
    }

    #[test]
    fn json_framing_round_trips() {
        let bytes = write_json(&headers(), br#"{"id":1}"#).unwrap();
        let (read, payload) = read_json(&bytes).unwrap();
        assert_eq!(read, headers());
        assert_eq!(payload.as_ref(), br#"{"id":1}"#);
        let (read, _) = HeaderFormat::Auto.read(&bytes).unwrap();
        assert_eq!(read, headers());
    }

    #[test]
    fn legacy_framing_round_trips_plain_values() {
        let mut h = Headers::new();
        h.insert("contentType", "text/plain");
        h.insert("n", 7);
        let bytes = write_legacy(&h, b"hello").unwrap();
        let (read, payload) = read_legacy(&bytes).unwrap();
        assert_eq!(read, h);
        assert_eq!(payload.as_ref(), b"hello");
    }

    #[test]
    fn empty_payload_with_headers_round_trips() {
        let bytes = write_json(&headers(), b"").unwrap();
        let (read, payload) = read_json(&bytes).unwrap();
        assert_eq!(read, headers());
        assert!(payload.is_empty());
    }

    #[test]
    fn none_reads_nothing() {
        let bytes = write_json(&headers(), b"x").unwrap();
        assert!(HeaderFormat::None.read(&bytes).is_none());
        assert!(HeaderFormat::SpringLegacy.read(&bytes).is_none());
    }
}
