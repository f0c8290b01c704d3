//! What the header readers must do with any bytes, checked by the `read_headers` fuzz
//! target and, with generated inputs and a fixed seed, by `tests/headers.rs`:
//!
//! 1. no reader panics, and what a reader hands out as the payload is the record's own
//!    bytes: the tail after the frame (or, for a Spring message document, its payload);
//! 2. the default reader unwraps only what Spring's maintained reader unwraps in its
//!    default configuration: never the legacy `0xff` framing, and a JSON frame only when
//!    its header object carries a Java type (`@class`);
//! 3. any bytes sent as a payload come back exactly from every reader of the JSON
//!    framing, without headers and with headers that look like Jackson's types.

use bytes::Bytes;
use shardflow::headers::spring::{may_be_taken_for_a_frame, write_embedded};
use shardflow::{HeaderFormat, HeaderValue, Headers};

/// Every format a consumer can be set to.
const FORMATS: [HeaderFormat; 5] = [
    HeaderFormat::Auto,
    HeaderFormat::None,
    HeaderFormat::SpringJson,
    HeaderFormat::SpringLegacy,
    HeaderFormat::SpringJsonAndLegacy,
];

/// The formats that read the JSON framing, which is how a producer writes headers.
const JSON_READERS: [HeaderFormat; 3] = [
    HeaderFormat::Auto,
    HeaderFormat::SpringJson,
    HeaderFormat::SpringJsonAndLegacy,
];

/// How a Spring message document starts.
const DOCUMENT: &[u8] = b"{\"@class\":\"org.springframework.";

/// Headers whose names and values look like Jackson's type information.
fn type_like_headers() -> Headers {
    let mut headers = Headers::new();
    headers.insert("@class", "java.util.HashMap");
    headers.insert("", serde_json::json!({"@class": "x", "n": 0.1}));
    headers.insert(
        "price",
        HeaderValue::Typed {
            class: "com.example.Money".into(),
            value: serde_json::json!({"amount": 1.5}),
        },
    );
    headers
}

/// Whether the JSON framing's header section of `data` is an object with an `@class`
/// member (parsed independently of the readers).
fn typed_header_section(data: &[u8]) -> bool {
    let Some(len) = data.get(..4) else {
        return false;
    };
    let len = u32::from_be_bytes([len[0], len[1], len[2], len[3]]) as usize;
    data.get(4..4usize.saturating_add(len))
        .and_then(|section| serde_json::from_slice::<serde_json::Value>(section).ok())
        .is_some_and(|section| section.get("@class").is_some())
}

/// Checks the three rules above on `input`; panics with the rule broken.
pub fn check(input: &[u8]) {
    let data = Bytes::copy_from_slice(input);
    for format in FORMATS {
        if let Some((_, payload)) = format.read(&data) {
            assert_ne!(format, HeaderFormat::None, "None unwrapped a record");
            assert!(
                data.ends_with(&payload) || data.starts_with(DOCUMENT),
                "{format:?} handed out bytes that are not the record's"
            );
        }
    }
    if HeaderFormat::Auto.read(&data).is_some() {
        assert_ne!(data.first(), Some(&0xff), "Auto unwrapped a legacy frame");
        assert!(
            data.starts_with(DOCUMENT) || typed_header_section(&data),
            "Auto unwrapped a JSON frame without a typed header object"
        );
    }
    let _ = may_be_taken_for_a_frame(&data);
    for headers in [Headers::new(), type_like_headers()] {
        let written = write_embedded(&headers, &data).expect("any payload can be written");
        for format in JSON_READERS {
            let (read, payload) = format
                .read(&written)
                .unwrap_or_else(|| (Headers::new(), written.clone()));
            assert_eq!(payload, data, "{format:?} lost payload bytes");
            assert!(read == headers, "{format:?} changed the headers: {read:?}");
        }
    }
}
