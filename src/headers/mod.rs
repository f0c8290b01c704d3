//! The application's own key-values on a record ([`Headers`]), as Spring's
//! `MessageHeaders` and Kafka's record headers carry them, next to what Kinesis says
//! about the record ([`Metadata`](crate::Metadata)).
//!
//! Kinesis records have no attributes of their own: headers travel inside the record's
//! data, framed the way Spring Cloud Stream's Kinesis binders frame them, so a Spring
//! service and a shardflow service read each other's headers.

use std::fmt;

pub mod spring;

pub use spring::HeaderFormat;

/// One header value: a string (the common case, e.g. `contentType`), any JSON value, or
/// a value that carries the Java type a Spring application gave it.
///
/// Two values are equal when they say the same to a reader: a JSON string equals the
/// same [`String`](HeaderValue::String), and a [`Typed`](HeaderValue::Typed) value whose
/// class is the one its plain value is written with anyway (`java.lang.Long` for an
/// integer beyond `i32`, `java.util.ArrayList` for an array, `java.util.LinkedHashMap`
/// for an object) equals the plain value; the two are the same bytes in a record.
#[derive(Clone, Debug)]
#[non_exhaustive]
pub enum HeaderValue {
    /// A string, e.g. `application/json` or a W3C `traceparent`.
    String(String),
    /// Any other JSON value: a number, a boolean, an object...
    Json(serde_json::Value),
    /// A value with its Java class, as Spring's JSON header mapper writes the values
    /// whose type JSON does not say (`["java.util.UUID","..."]` for a message `id`,
    /// `["java.lang.Long",1700000000000]` for a `timestamp`). Kept so that a record read
    /// from Spring and written again gives Spring back the same types.
    Typed {
        /// The Java class name, e.g. `java.util.UUID` or `com.example.Money`: dot-separated
        /// identifiers ([`spring::is_class_name`]); a producer refuses a record whose
        /// typed header has another.
        class: String,
        /// The value without its type.
        value: serde_json::Value,
    },
}

impl HeaderValue {
    /// The value as a string, when it is one (also a typed string such as a UUID).
    pub fn as_str(&self) -> Option<&str> {
        match self {
            HeaderValue::String(s) => Some(s),
            HeaderValue::Json(serde_json::Value::String(s)) => Some(s),
            HeaderValue::Typed {
                value: serde_json::Value::String(s),
                ..
            } => Some(s),
            HeaderValue::Json(_) | HeaderValue::Typed { .. } => None,
        }
    }

    /// The value as JSON, without any Java type (a string value becomes a JSON string).
    pub fn to_json(&self) -> serde_json::Value {
        match self {
            HeaderValue::String(s) => serde_json::Value::String(s.clone()),
            HeaderValue::Json(v) | HeaderValue::Typed { value: v, .. } => v.clone(),
        }
    }
}

/// What a header value says, for equality: its type when it is not implied by the value,
/// and the value, a string whichever way it was given.
#[derive(PartialEq)]
enum Meaning<'a> {
    Text(Option<&'a str>, &'a str),
    Json(Option<&'a str>, &'a serde_json::Value),
}

impl HeaderValue {
    fn meaning(&self) -> Meaning<'_> {
        match self {
            HeaderValue::String(s) | HeaderValue::Json(serde_json::Value::String(s)) => {
                Meaning::Text(None, s)
            }
            HeaderValue::Json(value) => Meaning::Json(None, value),
            HeaderValue::Typed { class, value } => {
                let class = (spring::implied_class(value) != Some(class.as_str()))
                    .then_some(class.as_str());
                match value {
                    serde_json::Value::String(s) => Meaning::Text(class, s),
                    value => Meaning::Json(class, value),
                }
            }
        }
    }
}

impl PartialEq for HeaderValue {
    fn eq(&self, other: &Self) -> bool {
        self.meaning() == other.meaning()
    }
}

impl From<&str> for HeaderValue {
    fn from(value: &str) -> Self {
        HeaderValue::String(value.to_owned())
    }
}

impl From<String> for HeaderValue {
    fn from(value: String) -> Self {
        HeaderValue::String(value)
    }
}

impl From<serde_json::Value> for HeaderValue {
    /// A JSON string becomes [`HeaderValue::String`]; anything else stays JSON.
    fn from(value: serde_json::Value) -> Self {
        match value {
            serde_json::Value::String(s) => HeaderValue::String(s),
            other => HeaderValue::Json(other),
        }
    }
}

impl From<i64> for HeaderValue {
    fn from(value: i64) -> Self {
        HeaderValue::Json(value.into())
    }
}

impl From<bool> for HeaderValue {
    fn from(value: bool) -> Self {
        HeaderValue::Json(value.into())
    }
}

/// The application's headers of a record: an ordered map from name to [`HeaderValue`].
///
/// Names are case-sensitive (as in Spring's `MessageHeaders`: `contentType` and
/// `ContentType` are two headers) and keep the order they were first inserted in;
/// inserting a name again replaces its value in place. A record without headers costs
/// nothing: an empty `Headers` holds no allocation.
///
/// ```
/// use shardflow::Headers;
///
/// let mut headers = Headers::new();
/// headers.insert("contentType", "application/json");
/// headers.insert("attempt", 2);
/// assert_eq!(headers.get_str("contentType"), Some("application/json"));
/// assert_eq!(headers.get("attempt").and_then(|v| v.to_json().as_i64()), Some(2));
/// assert_eq!(headers.names().collect::<Vec<_>>(), ["contentType", "attempt"]);
/// ```
#[derive(Clone, Default, PartialEq)]
pub struct Headers {
    // A Vec, not a hash map: a record has a handful of headers at most, order matters,
    // and an empty Vec does not allocate.
    entries: Vec<(String, HeaderValue)>,
}

impl Headers {
    /// No headers (no allocation).
    pub const fn new() -> Self {
        Headers {
            entries: Vec::new(),
        }
    }

    /// The number of headers.
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    /// Whether there are none.
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// Sets `name` to `value`; returns the value it replaced. A new name goes last; a
    /// name already present keeps its place.
    pub fn insert(
        &mut self,
        name: impl Into<String>,
        value: impl Into<HeaderValue>,
    ) -> Option<HeaderValue> {
        let name = name.into();
        let value = value.into();
        match self.entries.iter_mut().find(|(n, _)| *n == name) {
            Some((_, old)) => Some(std::mem::replace(old, value)),
            None => {
                self.entries.push((name, value));
                None
            }
        }
    }

    /// The value of `name` (exact case).
    pub fn get(&self, name: &str) -> Option<&HeaderValue> {
        self.entries.iter().find(|(n, _)| n == name).map(|(_, v)| v)
    }

    /// The value of `name` when it is a string.
    pub fn get_str(&self, name: &str) -> Option<&str> {
        self.get(name).and_then(HeaderValue::as_str)
    }

    /// Whether `name` is present.
    pub fn contains(&self, name: &str) -> bool {
        self.get(name).is_some()
    }

    /// Removes `name`; returns its value.
    pub fn remove(&mut self, name: &str) -> Option<HeaderValue> {
        let index = self.entries.iter().position(|(n, _)| n == name)?;
        Some(self.entries.remove(index).1)
    }

    /// The headers in order.
    pub fn iter(&self) -> impl Iterator<Item = (&str, &HeaderValue)> {
        self.entries.iter().map(|(n, v)| (n.as_str(), v))
    }

    /// The names in order.
    pub fn names(&self) -> impl Iterator<Item = &str> {
        self.entries.iter().map(|(n, _)| n.as_str())
    }

    /// Adds the current trace context, as a producer that embeds headers does to every
    /// record: with the `opentelemetry` feature, through the globally installed
    /// propagator, unless one of its fields is present already (a record's own context is
    /// kept); without the feature, nothing. For a writer of its own format that carries
    /// headers inside (the dead-letter envelope), whose records a [raw](crate::Producer::raw)
    /// producer writes. (With the feature, the method is the `trace` module's.)
    #[cfg(not(feature = "opentelemetry"))]
    pub fn insert_current_trace_context(&mut self) {}
}

impl<N: Into<String>, V: Into<HeaderValue>> FromIterator<(N, V)> for Headers {
    fn from_iter<I: IntoIterator<Item = (N, V)>>(iter: I) -> Self {
        let mut headers = Headers::new();
        headers.extend(iter);
        headers
    }
}

impl<N: Into<String>, V: Into<HeaderValue>> Extend<(N, V)> for Headers {
    fn extend<I: IntoIterator<Item = (N, V)>>(&mut self, iter: I) {
        for (name, value) in iter {
            self.insert(name, value);
        }
    }
}

impl IntoIterator for Headers {
    type Item = (String, HeaderValue);
    type IntoIter = std::vec::IntoIter<(String, HeaderValue)>;

    fn into_iter(self) -> Self::IntoIter {
        self.entries.into_iter()
    }
}

/// Longest value shown whole by `Debug`; longer ones show their length only.
const DEBUG_VALUE_CHARS: usize = 64;

impl fmt::Debug for Headers {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // Names, and values only when short: a header can carry a token or a document.
        struct Short<'a>(&'a HeaderValue);
        impl fmt::Debug for Short<'_> {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                let text = match self.0 {
                    HeaderValue::String(s) => format!("{s:?}"),
                    HeaderValue::Json(v) | HeaderValue::Typed { value: v, .. } => v.to_string(),
                };
                if text.chars().count() <= DEBUG_VALUE_CHARS {
                    f.write_str(&text)
                } else {
                    write!(f, "<{} bytes>", text.len())
                }
            }
        }
        f.debug_map()
            .entries(self.entries.iter().map(|(n, v)| (n, Short(v))))
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keeps_insertion_order_and_case() {
        let mut h = Headers::new();
        h.insert("b", "1");
        h.insert("a", "2");
        h.insert("B", "3");
        assert_eq!(h.insert("b", "4"), Some(HeaderValue::from("1")));
        assert_eq!(h.names().collect::<Vec<_>>(), ["b", "a", "B"]);
        assert_eq!(h.get_str("b"), Some("4"));
        assert_eq!(h.get_str("B"), Some("3"));
        assert_eq!(h.remove("a"), Some(HeaderValue::from("2")));
        assert_eq!(h.len(), 2);
    }

    #[test]
    fn empty_headers_do_not_allocate() {
        let h = Headers::new();
        assert_eq!(h.entries.capacity(), 0);
        assert_eq!(Headers::default().entries.capacity(), 0);
    }

    #[test]
    fn debug_shows_names_and_short_values_only() {
        let mut h = Headers::new();
        h.insert("contentType", "application/json");
        h.insert("token", "x".repeat(200));
        let shown = format!("{h:?}");
        assert!(
            shown.contains("\"contentType\": \"application/json\""),
            "{shown}"
        );
        assert!(shown.contains("\"token\": <202 bytes>"), "{shown}");
    }
}
