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
//!
//! # Which records a default consumer unwraps
//!
//! Neither framing says "this is a frame": the legacy one has no payload length at all,
//! and any payload can start with four bytes that happen to count the JSON after them.
//! So the default, [`HeaderFormat::Auto`], unwraps only what Spring's own reader unwraps
//! in its default configuration, and only with the evidence that reader needs:
//!
//! - Spring Cloud AWS's Kinesis binder (the maintained one) embeds headers by default
//!   (`embedHeaders`, default `true`) and reads them with Spring Integration's
//!   `EmbeddedJsonHeadersMessageMapper`: the JSON framing, or else the whole-message
//!   document. Its mapper reads the header map with Jackson's default typing, which
//!   needs the map's Java type: a header object without `"@class"` fails and the record
//!   is delivered whole. `Auto` likewise takes a JSON frame only when its header object
//!   carries a Java map type (`"@class":"java.util.HashMap"` or another `java.util` map),
//!   and a document only when it is typed as one of Spring's message classes.
//! - The legacy `0xff` framing is read only by the retired binders (1.x to 3.x with their
//!   default `headerMode` `embeddedHeaders`, and 4.0.x before its JSON attempt); the
//!   maintained binder never reads it and delivers such a record whole. `Auto` does not
//!   read it either: a stream still written by an old binder says
//!   [`HeaderFormat::SpringJsonAndLegacy`] (what binder 4.0.x reads) or
//!   [`HeaderFormat::SpringLegacy`].
//!
//! A stream of binary or foreign records (protobuf, Avro, length-prefixed messages) that
//! no Spring application writes should say [`HeaderFormat::None`]: then no record is ever
//! taken for a frame. A shardflow producer that embeds headers makes its own records
//! safe for every format: a payload without headers that any of these readers could take
//! for a frame is written inside a frame with an empty header map (see
//! [`may_be_taken_for_a_frame`]).

use bytes::{BufMut, Bytes};
use serde_json::Value;

use super::{HeaderValue, Headers};

/// Which header framings a consumer recognises in the records it reads (see the
/// [module docs](self) for which records each one unwraps, and why).
///
/// A record that is not an envelope in one of the chosen formats is delivered as it was
/// read, with no headers.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub enum HeaderFormat {
    /// What Spring's maintained Kinesis binder reads by default (the default): Spring
    /// Integration's JSON headers whose header object carries its Java map type, and its
    /// whole-message JSON document. Not the legacy `0xff` framing, which that binder
    /// never reads.
    #[default]
    Auto,
    /// No recognition: every record's data is its payload, byte for byte. The choice
    /// for a stream of binary or foreign records that no Spring application writes.
    None,
    /// Only Spring Integration's JSON headers (and its whole-message JSON document), as
    /// `Auto` reads them.
    SpringJson,
    /// Only Spring Cloud Stream's legacy `0xff` framing (binders 1.x to 3.x).
    SpringLegacy,
    /// Both, as Spring Cloud Stream's Kinesis binder 4.0.x reads by default: the legacy
    /// framing first when the record starts with `0xff`, then the JSON one. For a stream
    /// that old and new binders write.
    SpringJsonAndLegacy,
}

impl HeaderFormat {
    /// The headers and the payload of `data` when it is an envelope in this format;
    /// `None` when it is a plain payload.
    pub fn read(self, data: &Bytes) -> Option<(Headers, Bytes)> {
        match self {
            HeaderFormat::None => None,
            HeaderFormat::Auto | HeaderFormat::SpringJson => read_json(data),
            HeaderFormat::SpringLegacy => read_legacy(data),
            HeaderFormat::SpringJsonAndLegacy => read_legacy(data).or_else(|| read_json(data)),
        }
    }
}

/// Whether some reader could take `payload`, sent without headers, for a frame and turn
/// part of it into headers: it reads as a legacy frame, its first four bytes count a
/// JSON-looking header section whose payload length adds up (whatever that JSON holds: a
/// Spring reader with other settings may accept what [`read_json`] refuses), or it is a
/// Spring message document. A producer that embeds headers writes such a payload inside
/// a frame with an empty header map, which every reader unwraps to the payload exactly.
pub fn may_be_taken_for_a_frame(payload: &Bytes) -> bool {
    json_lengths_add_up(payload).is_some()
        || read_legacy(payload).is_some()
        || read_document(payload).is_some()
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
/// The member that carries an object's Java type in Jackson's default typing.
const CLASS_MEMBER: &str = "@class";
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
/// object typed as a Java map (its first `"@class"` member names a `java.util` map
/// class), as Spring's reader needs. Spring's reader also refuses an envelope whose
/// payload is empty; this one accepts it (the lengths still add up exactly), so an empty
/// payload with headers that shardflow wrote round-trips.
///
/// The first `"@class"` member of an object is its Java type, as Jackson reads it; a
/// later member of that name is data (a header or a JSON member named `@class`).
pub fn read_json(data: &Bytes) -> Option<(Headers, Bytes)> {
    read_json_framing(data).or_else(|| read_document(data))
}

/// The header length when `data` has the JSON framing's shape: a 4-byte length, room
/// for the payload length after that many bytes, a payload length that is exactly the
/// rest, and a header section that starts like a JSON object.
fn json_lengths_add_up(data: &[u8]) -> Option<usize> {
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
    (payload_len == len - 8 - headers_len && data.get(4) == Some(&b'{')).then_some(headers_len)
}

fn read_json_framing(data: &Bytes) -> Option<(Headers, Bytes)> {
    let headers_len = json_lengths_add_up(data)?;
    let headers = parse_header_map(data.get(4..4 + headers_len)?)?;
    Some((headers, data.slice(8 + headers_len..)))
}

fn read_document(data: &Bytes) -> Option<(Headers, Bytes)> {
    if !data.starts_with(DOCUMENT_PREFIX) {
        return None;
    }
    let Node::Object {
        class: Some(class),
        members,
    } = serde_json::from_slice::<Node>(data).ok()?
    else {
        return None;
    };
    if !MESSAGE_CLASSES.contains(&class.as_str()) {
        return None;
    }
    let mut payload = None;
    let mut headers = None;
    for (name, value) in members {
        match name.as_str() {
            "payload" => payload = Some(value),
            "headers" => headers = Some(header_map(value)?),
            _ => {}
        }
    }
    let payload = match payload?.untyped() {
        // A `String` payload reaches Spring as the string: its UTF-8 bytes here. (A
        // `byte[]` written this way is base64 text, and Spring reads it as that text too.)
        Value::String(text) => Bytes::from(text.into_bytes()),
        other => Bytes::from(serde_json::to_vec(&other).ok()?),
    };
    Some((headers?, payload))
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
        let value = serde_json::from_slice::<Node>(data.get(at..at + value_len)?).ok()?;
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
/// `HashMap` has none). A header or JSON member named `@class` is written after the
/// type and read back as data. Fails when a length does not fit the 4-byte fields, or a
/// typed value's class is not a Java class name (see [`is_class_name`]).
pub fn write_json(headers: &Headers, payload: &[u8]) -> Option<Bytes> {
    if headers.iter().any(
        |(_, value)| matches!(value, HeaderValue::Typed { class, .. } if !is_class_name(class)),
    ) {
        return None;
    }
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

/// What a producer that embeds headers writes for `payload` with `headers`: the
/// JSON-headers framing ([`write_json`]) when there are headers, or when a reader could
/// take the bare payload for a frame ([`may_be_taken_for_a_frame`]; it is then framed
/// with an empty header map); otherwise the bare payload. Every reader of the JSON
/// framing ([`HeaderFormat::Auto`], [`HeaderFormat::SpringJson`],
/// [`HeaderFormat::SpringJsonAndLegacy`]) reads back exactly `headers` and `payload`.
/// Fails as [`write_json`] does.
pub fn write_embedded(headers: &Headers, payload: &Bytes) -> Option<Bytes> {
    if headers.is_empty() && !may_be_taken_for_a_frame(payload) {
        return Some(payload.clone());
    }
    write_json(headers, payload)
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

/// JSON as Jackson's default typing writes it: every object with its Java type (its
/// first `"@class"` member, when that is a string) apart from its members, members in
/// the order written. Later `"@class"` members are members like any other.
enum Node {
    /// `null`, a boolean, a number or a string.
    Scalar(Value),
    Array(Vec<Node>),
    Object {
        class: Option<String>,
        members: Vec<(String, Node)>,
    },
}

impl<'de> serde::Deserialize<'de> for Node {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct Visit;
        impl<'de> serde::de::Visitor<'de> for Visit {
            type Value = Node;
            fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("JSON")
            }
            fn visit_bool<E>(self, v: bool) -> Result<Node, E> {
                Ok(Node::Scalar(Value::Bool(v)))
            }
            fn visit_i64<E>(self, v: i64) -> Result<Node, E> {
                Ok(Node::Scalar(Value::from(v)))
            }
            fn visit_u64<E>(self, v: u64) -> Result<Node, E> {
                Ok(Node::Scalar(Value::from(v)))
            }
            fn visit_f64<E>(self, v: f64) -> Result<Node, E> {
                // JSON text has no NaN or infinity, so `from` never makes a `null` here.
                Ok(Node::Scalar(Value::from(v)))
            }
            fn visit_str<E>(self, v: &str) -> Result<Node, E> {
                Ok(Node::Scalar(Value::String(v.to_owned())))
            }
            fn visit_string<E>(self, v: String) -> Result<Node, E> {
                Ok(Node::Scalar(Value::String(v)))
            }
            fn visit_unit<E>(self) -> Result<Node, E> {
                Ok(Node::Scalar(Value::Null))
            }
            fn visit_seq<A: serde::de::SeqAccess<'de>>(self, mut seq: A) -> Result<Node, A::Error> {
                let mut items = Vec::new();
                while let Some(item) = seq.next_element()? {
                    items.push(item);
                }
                Ok(Node::Array(items))
            }
            fn visit_map<A: serde::de::MapAccess<'de>>(self, mut map: A) -> Result<Node, A::Error> {
                let mut class = None;
                let mut members = Vec::new();
                while let Some((name, value)) = map.next_entry::<String, Node>()? {
                    match value {
                        Node::Scalar(Value::String(type_id))
                            if class.is_none() && name == CLASS_MEMBER =>
                        {
                            class = Some(type_id)
                        }
                        value => members.push((name, value)),
                    }
                }
                Ok(Node::Object { class, members })
            }
        }
        deserializer.deserialize_any(Visit)
    }
}

impl Node {
    /// The JSON without Jackson's type information: objects without their type, type
    /// wrappers opened.
    fn untyped(self) -> Value {
        match self {
            Node::Scalar(value) => value,
            Node::Object { members, .. } => Value::Object(
                members
                    .into_iter()
                    .map(|(name, value)| (name, value.untyped()))
                    .collect(),
            ),
            Node::Array(items) => match type_wrapper(items) {
                Ok((_, content)) => content.wrapped_content(),
                Err(items) => Value::Array(items.into_iter().map(Node::untyped).collect()),
            },
        }
    }

    /// What a type wrapper holds, without type information: a typed collection's
    /// elements are an array that is never itself a wrapper (`["java.util.ArrayList",
    /// ["a.b", 1]]` holds the list `["a.b", 1]`), each element untyped in turn.
    fn wrapped_content(self) -> Value {
        match self {
            Node::Array(items) => Value::Array(items.into_iter().map(Node::untyped).collect()),
            other => other.untyped(),
        }
    }
}

/// `[ "a.java.Class", value ]`, how Jackson's default typing wraps a scalar or a list:
/// the class and the value; the items unchanged when they are not a wrapper.
fn type_wrapper(items: Vec<Node>) -> Result<(String, Node), Vec<Node>> {
    if !matches!(&items[..], [Node::Scalar(Value::String(class)), _] if is_class_name(class)) {
        return Err(items);
    }
    let mut items = items.into_iter();
    match (items.next(), items.next()) {
        (Some(Node::Scalar(Value::String(class))), Some(content)) => Ok((class, content)),
        // The shape was checked above: not reached.
        (first, second) => Err(first.into_iter().chain(second).collect()),
    }
}

/// Whether `name` is a Java class name as a type id carries it: dot-separated
/// identifiers (letters, digits, `_`, `$`; not starting with a digit), at least one dot.
pub fn is_class_name(name: &str) -> bool {
    name.contains('.')
        && name.split('.').all(|part| {
            part.chars().next().is_some_and(|c| !c.is_ascii_digit())
                && part
                    .chars()
                    .all(|c| c.is_alphanumeric() || c == '_' || c == '$')
        })
}

/// Whether `class` is a Java map type a Spring header map is written with.
fn is_map_class(class: &str) -> bool {
    class.starts_with("java.util.") && class.ends_with("Map") && is_class_name(class)
}

/// The header map of Spring's JSON: one object typed as a Java map, its values
/// untyped where the plain value gives Spring the same type back.
fn parse_header_map(json: &[u8]) -> Option<Headers> {
    header_map(serde_json::from_slice(json).ok()?)
}

fn header_map(node: Node) -> Option<Headers> {
    let Node::Object {
        class: Some(class),
        members,
    } = node
    else {
        return None;
    };
    if !is_map_class(&class) {
        return None;
    }
    let mut headers = Headers::new();
    for (name, value) in members {
        headers.insert(name, from_spring(value));
    }
    Some(headers)
}

/// A header value as Spring wrote it, typed or not, as ours. A typed value stays
/// [`HeaderValue::Typed`] unless its class is the one the plain value is written with
/// anyway (a `java.lang.Long` beyond `i32`, a `java.util.ArrayList`, a
/// `java.util.LinkedHashMap`), so that reading and writing again keeps every type Spring
/// gave.
fn from_spring(value: Node) -> HeaderValue {
    match value {
        Node::Scalar(value) => HeaderValue::from(value),
        Node::Object { class, members } => {
            let value = Node::Object {
                class: None,
                members,
            }
            .untyped();
            typed(class, value)
        }
        Node::Array(items) => match type_wrapper(items) {
            Ok((class, content)) => typed(Some(class), content.wrapped_content()),
            Err(items) => HeaderValue::from(Node::Array(items).untyped()),
        },
    }
}

fn typed(class: Option<String>, value: Value) -> HeaderValue {
    match class {
        Some(class) if implied_class(&value) != Some(class.as_str()) => {
            HeaderValue::Typed { class, value }
        }
        _ => HeaderValue::from(value),
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

/// The Java class this writer gives a plain JSON value, as Jackson's default typing
/// does for an `Object`; `None` for the values written plain (strings, booleans, `null`,
/// doubles and `i32` integers, which Jackson reads back as their natural types).
pub(super) fn implied_class(value: &Value) -> Option<&'static str> {
    match value {
        Value::Number(n) if n.as_i64().is_some_and(|i| i32::try_from(i).is_err()) => {
            Some(LONG_CLASS)
        }
        Value::Array(_) => Some(ARRAY_CLASS),
        Value::Object(_) => Some(OBJECT_CLASS),
        _ => None,
    }
}

/// JSON with the type information Jackson's default typing expects for an `Object`.
fn write_typed(out: &mut Vec<u8>, value: &Value) {
    match (value, implied_class(value)) {
        (Value::Object(members), _) => write_object(out, OBJECT_CLASS, members),
        (Value::Array(items), Some(class)) => {
            out.push(b'[');
            write_string(out, class);
            out.push(b',');
            write_array(out, items);
            out.push(b']');
        }
        (scalar, Some(class)) => {
            out.push(b'[');
            write_string(out, class);
            out.push(b',');
            write_json_text(out, scalar);
            out.push(b']');
        }
        (scalar, None) => write_json_text(out, scalar),
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
    // A member named `@class` is data: written after the type, it is read back as a
    // member (Jackson, too, takes only the first for the type).
    for (name, v) in members {
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
        let spring = || -> Node {
            serde_json::from_value(serde_json::json!([
                "java.util.ArrayList",
                ["example.com", 443]
            ]))
            .unwrap()
        };
        assert_eq!(spring().untyped(), serde_json::json!(["example.com", 443]));
        match from_spring(spring()) {
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
