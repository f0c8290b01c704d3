//! Typed payloads: `Message<Bytes>` in, `Message<T>` to the inner service, through a
//! pluggable [`Format`] (JSON via `serde_json` by default).
//!
//! A payload that does not decode never reaches the inner service and never panics: the
//! call fails with a [`DecodeError`] that carries the record's metadata, headers and raw
//! bytes, so a [`dead_letter`](crate::dead_letter) layer above can send the record on as
//! it was.
//!
//! # The record's `contentType`
//!
//! When the record carries a `contentType` header (Spring Cloud Stream writes one on
//! every message, see [`shardflow::headers`]), the layer first asks the format whether it
//! reads that type ([`Format::accepts`]), as Spring's content-type negotiation picks a
//! converter by it. [`Json`] reads `application/json` and every `application/*+json`,
//! parameters such as `;charset=UTF-8` aside; any other type fails the call with a
//! [`DecodeError`] whose [`kind`](DecodeError::kind) is
//! [`DecodeErrorKind::UnsupportedContentType`], naming the type, without trying to
//! parse. A record without the header is decoded with the layer's format, as before.

use std::fmt;
use std::future::Future;
use std::marker::PhantomData;
use std::pin::Pin;
use std::task::{Context, Poll};

use bytes::Bytes;
use pin_project_lite::pin_project;
use serde::de::DeserializeOwned;
use shardflow::{Headers, Message, Metadata};
use tower::{Layer, Service};

use crate::observe::message_span;
use crate::BoxError;

/// How raw payload bytes become a `T`.
///
/// Implement it for other encodings (Avro, protobuf, CSV...). The error's `Display` ends
/// up in logs and dead-letter records: it should say where and why the input broke, not
/// repeat the input.
pub trait Format<T> {
    /// Why a payload could not be decoded.
    type Error: std::error::Error + Send + Sync + 'static;

    /// A short name for errors and logs, e.g. `"JSON"`.
    fn name(&self) -> &'static str;

    /// Decodes one payload.
    fn decode(&self, payload: &Bytes) -> Result<T, Self::Error>;

    /// Whether this format reads payloads of the record's `contentType` (a MIME type,
    /// perhaps with parameters, as the producer wrote it). The default reads every type.
    fn accepts(&self, content_type: &str) -> bool {
        let _ = content_type;
        true
    }

    /// The [`DecodeErrorKind`] a decode error of this format is reported with (the
    /// dead-letter policy and metrics read it). The default is
    /// [`DecodeErrorKind::InvalidPayload`]; schema formats report
    /// [`DecodeErrorKind::SchemaMismatch`] for a payload that does not match its schema.
    fn error_kind(&self, error: &Self::Error) -> DecodeErrorKind {
        let _ = error;
        DecodeErrorKind::InvalidPayload
    }
}

/// The `contentType` header's name, as Spring's `MessageHeaders.CONTENT_TYPE`.
pub const CONTENT_TYPE: &str = "contentType";

/// Whether `content_type` is JSON: `application/json` or `application/<anything>+json`,
/// case-insensitively, parameters (`;charset=UTF-8`) aside.
pub fn is_json_content_type(content_type: &str) -> bool {
    let essence = content_type
        .split(';')
        .next()
        .unwrap_or_default()
        .trim()
        .to_ascii_lowercase();
    match essence.split_once('/') {
        Some(("application", sub)) => sub == "json" || (sub.len() > 5 && sub.ends_with("+json")),
        _ => false,
    }
}

/// JSON through `serde_json`.
#[derive(Clone, Copy, Debug, Default)]
pub struct Json;

impl<T: DeserializeOwned> Format<T> for Json {
    type Error = JsonError;

    fn name(&self) -> &'static str {
        "JSON"
    }

    fn decode(&self, payload: &Bytes) -> Result<T, JsonError> {
        serde_json::from_slice(payload).map_err(JsonError)
    }

    fn accepts(&self, content_type: &str) -> bool {
        is_json_content_type(content_type)
    }
}

/// Why a payload is not the expected JSON.
///
/// Its `Display` names the kind of problem and where it is (line, column), but not the
/// offending value: `serde_json`'s own messages can quote payload data
/// (`invalid type: string "..."`), which must stay out of logs. The full message is
/// still available through [`JsonError::inner`] for code that may see the payload.
pub struct JsonError(serde_json::Error);

impl JsonError {
    /// The `serde_json` error. Its `Display` may quote parts of the payload.
    pub fn inner(&self) -> &serde_json::Error {
        &self.0
    }
}

impl fmt::Display for JsonError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        use serde_json::error::Category;
        let kind = match self.0.classify() {
            Category::Syntax => "syntax error",
            Category::Data => "data does not match the expected type",
            Category::Eof => "unexpected end of input",
            Category::Io => "I/O error",
        };
        write!(
            f,
            "{kind} at line {} column {}",
            self.0.line(),
            self.0.column()
        )
    }
}

impl fmt::Debug for JsonError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // Debug ends up in logs as easily as Display: same redaction.
        write!(f, "JsonError({self})")
    }
}

impl std::error::Error for JsonError {}

/// Why a payload did not decode.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum DecodeErrorKind {
    /// The payload is not valid in the format (the error's `source` says where).
    InvalidPayload,
    /// The record's `contentType` header names a type the format does not read.
    UnsupportedContentType {
        /// The header's value, as the producer wrote it.
        content_type: String,
    },
    /// The record is not in the schema registry framing it claims (an unknown header
    /// version or compression byte, a truncated header, a zlib payload that does not
    /// inflate, a missing Protobuf message index), or is unframed where framing is
    /// required (see [`schema_registry`](crate::schema_registry)).
    InvalidFraming,
    /// The record names a schema version the registry does not know.
    UnknownSchemaVersion {
        /// The schema version id the record carries.
        schema_version: uuid::Uuid,
    },
    /// The schema registry refused the lookup, failed or did not answer in time.
    /// Transient ([`DecodeError::is_transient`]): says nothing about the record, so the
    /// default dead-letter policy never dead-letters it; the consumer delivers the record
    /// again.
    RegistryUnavailable,
    /// The payload is well-formed for its format but does not match its schema (a JSON
    /// Schema validation failed, an Avro datum does not resolve to the reader's schema,
    /// a value has the wrong shape for the user's type).
    SchemaMismatch,
}

/// A payload that did not decode: the record's metadata, headers, raw bytes and the
/// reason.
pub struct DecodeError {
    metadata: Metadata,
    headers: Headers,
    raw: Bytes,
    format: &'static str,
    kind: DecodeErrorKind,
    source: Option<BoxError>,
}

impl fmt::Display for DecodeError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let (position, shard) = (self.metadata.position(), &self.metadata.shard_id);
        match &self.kind {
            DecodeErrorKind::UnsupportedContentType { content_type } => write!(
                f,
                "record {position} in shard {shard} has contentType {content_type:?}, which the {} format does not decode",
                self.format
            ),
            DecodeErrorKind::InvalidFraming => write!(
                f,
                "record {position} in shard {shard} is not in the schema registry framing"
            ),
            DecodeErrorKind::UnknownSchemaVersion { schema_version } => write!(
                f,
                "record {position} in shard {shard} names schema version {schema_version}, which the registry does not know"
            ),
            DecodeErrorKind::RegistryUnavailable => write!(
                f,
                "the writer schema of record {position} in shard {shard} could not be fetched from the registry"
            ),
            DecodeErrorKind::SchemaMismatch => write!(
                f,
                "payload of record {position} in shard {shard} does not match its {} schema",
                self.format
            ),
            _ => write!(
                f,
                "payload of record {position} in shard {shard} is not valid {}",
                self.format
            ),
        }
    }
}

impl std::error::Error for DecodeError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        self.source
            .as_deref()
            .map(|e| e as &(dyn std::error::Error + 'static))
    }
}

impl DecodeError {
    /// A failure of `message` (as it was read) in `format`.
    pub(crate) fn for_message(
        message: Message<Bytes>,
        format: &'static str,
        kind: DecodeErrorKind,
        source: Option<BoxError>,
    ) -> Self {
        DecodeError {
            metadata: message.metadata,
            headers: message.headers,
            raw: message.payload,
            format,
            kind,
            source,
        }
    }

    /// Whether the failure says nothing about the record and the same record may decode
    /// later: [`DecodeErrorKind::RegistryUnavailable`].
    pub fn is_transient(&self) -> bool {
        matches!(self.kind, DecodeErrorKind::RegistryUnavailable)
    }

    /// The record's metadata.
    pub fn metadata(&self) -> &Metadata {
        &self.metadata
    }

    /// The record's headers (see [`Message::headers`]).
    pub fn headers(&self) -> &Headers {
        &self.headers
    }

    /// The payload exactly as it was read.
    pub fn raw(&self) -> &Bytes {
        &self.raw
    }

    /// The format's name, e.g. `"JSON"`.
    pub fn format(&self) -> &'static str {
        self.format
    }

    /// Why the payload did not decode.
    pub fn kind(&self) -> &DecodeErrorKind {
        &self.kind
    }

    /// Metadata and raw payload (see [`DecodeError::into_message`] to keep the headers).
    pub fn into_parts(self) -> (Metadata, Bytes) {
        (self.metadata, self.raw)
    }

    /// The record as it reached the decode layer: metadata, headers and raw payload.
    pub fn into_message(self) -> Message<Bytes> {
        Message::new(self.metadata, self.raw).with_headers(self.headers)
    }
}

impl fmt::Debug for DecodeError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // Never the bytes.
        f.debug_struct("DecodeError")
            .field("metadata", &self.metadata)
            .field("headers", &self.headers)
            .field("raw_len", &self.raw.len())
            .field("format", &self.format)
            .field("kind", &self.kind)
            .field("source", &self.source)
            .finish()
    }
}

/// Decodes each `Message<Bytes>` into a `Message<T>` before the inner service sees it.
pub struct Decode<S, T, F = Json> {
    inner: S,
    format: F,
    _payload: PhantomData<fn() -> T>,
}

impl<S, T, F> Decode<S, T, F> {
    /// Wraps `inner`, decoding with `format`.
    pub fn new(inner: S, format: F) -> Self {
        Decode {
            inner,
            format,
            _payload: PhantomData,
        }
    }

    /// The inner service.
    pub fn get_ref(&self) -> &S {
        &self.inner
    }

    /// The inner service, mutably.
    pub fn get_mut(&mut self) -> &mut S {
        &mut self.inner
    }

    /// Unwraps the inner service.
    pub fn into_inner(self) -> S {
        self.inner
    }
}

impl<S: Clone, T, F: Clone> Clone for Decode<S, T, F> {
    fn clone(&self) -> Self {
        Decode::new(self.inner.clone(), self.format.clone())
    }
}

impl<S: fmt::Debug, T, F: fmt::Debug> fmt::Debug for Decode<S, T, F> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Decode")
            .field("inner", &self.inner)
            .field("format", &self.format)
            .field("payload", &std::any::type_name::<T>())
            .finish()
    }
}

impl<S, T, F> Service<Message<Bytes>> for Decode<S, T, F>
where
    S: Service<Message<T>>,
    S::Error: Into<BoxError>,
    F: Format<T>,
{
    type Response = S::Response;
    type Error = BoxError;
    type Future = ResponseFuture<S::Future>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx).map_err(Into::into)
    }

    fn call(&mut self, message: Message<Bytes>) -> Self::Future {
        let format = &self.format;
        if let Some(content_type) = message.headers.get_str(CONTENT_TYPE) {
            if !format.accepts(content_type) {
                let content_type = content_type.to_owned();
                message_span("decode", &message.metadata).in_scope(|| {
                    tracing::debug!(
                        monotonic_counter.shardflow.decode_failed = 1u64,
                        format = format.name(),
                        content_type = %content_type,
                        "content type not decoded by this format",
                    );
                });
                return ResponseFuture::failed(DecodeError {
                    metadata: message.metadata,
                    headers: message.headers,
                    raw: message.payload,
                    format: format.name(),
                    kind: DecodeErrorKind::UnsupportedContentType { content_type },
                    source: None,
                });
            }
        }
        let decoded = message.try_map(|raw| match format.decode(&raw) {
            Ok(payload) => Ok(payload),
            Err(error) => Err((raw, error)),
        });
        match decoded {
            Ok(message) => ResponseFuture::called(self.inner.call(message)),
            Err((metadata, headers, (raw, error))) => {
                let kind = format.error_kind(&error);
                // Decoding is synchronous: the span exists only around this event, so
                // the counter carries the same context as every other layer's.
                message_span("decode", &metadata).in_scope(|| {
                    tracing::debug!(
                        monotonic_counter.shardflow.decode_failed = 1u64,
                        format = format.name(),
                        %error,
                        "payload did not decode",
                    );
                });
                ResponseFuture::failed(DecodeError {
                    metadata,
                    headers,
                    raw,
                    format: format.name(),
                    kind,
                    source: Some(Box::new(error)),
                })
            }
        }
    }
}

/// Applies [`Decode`] to services.
pub struct DecodeLayer<T, F = Json> {
    format: F,
    _payload: PhantomData<fn() -> T>,
}

impl<T> DecodeLayer<T, Json> {
    /// Decodes JSON into `T`.
    pub fn json() -> Self {
        DecodeLayer::with_format(Json)
    }
}

impl<T, F> DecodeLayer<T, F> {
    /// Decodes with any [`Format`].
    pub fn with_format(format: F) -> Self {
        DecodeLayer {
            format,
            _payload: PhantomData,
        }
    }
}

impl<T, F: Clone> Clone for DecodeLayer<T, F> {
    fn clone(&self) -> Self {
        DecodeLayer::with_format(self.format.clone())
    }
}

impl<T, F: fmt::Debug> fmt::Debug for DecodeLayer<T, F> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("DecodeLayer")
            .field("format", &self.format)
            .field("payload", &std::any::type_name::<T>())
            .finish()
    }
}

impl<S, T, F: Clone> Layer<S> for DecodeLayer<T, F> {
    type Service = Decode<S, T, F>;

    fn layer(&self, inner: S) -> Self::Service {
        Decode::new(inner, self.format.clone())
    }
}

pin_project! {
    /// The response future of [`Decode`].
    pub struct ResponseFuture<Fut> {
        #[pin]
        kind: Kind<Fut>,
    }
}

pin_project! {
    #[project = KindProj]
    enum Kind<Fut> {
        Called { #[pin] future: Fut },
        // Boxed already: keeps the common path's future small.
        Failed { error: Option<BoxError> },
    }
}

impl<Fut> ResponseFuture<Fut> {
    fn called(future: Fut) -> Self {
        ResponseFuture {
            kind: Kind::Called { future },
        }
    }

    fn failed(error: DecodeError) -> Self {
        ResponseFuture {
            kind: Kind::Failed {
                error: Some(Box::new(error)),
            },
        }
    }
}

impl<Fut, R, E> Future for ResponseFuture<Fut>
where
    Fut: Future<Output = Result<R, E>>,
    E: Into<BoxError>,
{
    type Output = Result<R, BoxError>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        match self.project().kind.project() {
            KindProj::Called { future } => future.poll(cx).map_err(Into::into),
            KindProj::Failed { error } => match error.take() {
                Some(error) => Poll::Ready(Err(error)),
                // Polled again after it completed: tower futures may say so with an error.
                None => Poll::Ready(Err("decode::ResponseFuture polled after completion".into())),
            },
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::test_support::message;
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::Arc;
    use tower::{service_fn, ServiceExt};

    #[derive(serde::Deserialize, Debug, PartialEq)]
    struct Order {
        id: u64,
    }

    #[tokio::test]
    async fn decodes_json_for_the_inner_service() {
        let svc = DecodeLayer::<Order>::json().layer(service_fn(|m: Message<Order>| async move {
            Ok::<_, std::convert::Infallible>(m.payload.id)
        }));
        let id = svc.oneshot(message(1, br#"{"id":42}"#)).await.unwrap();
        assert_eq!(id, 42);
    }

    #[tokio::test]
    async fn bad_payload_is_a_typed_error_with_headers_and_raw_bytes() {
        let calls = Arc::new(AtomicUsize::new(0));
        let seen = calls.clone();
        let svc = DecodeLayer::<Order>::json().layer(service_fn(move |_m: Message<Order>| {
            seen.fetch_add(1, Ordering::SeqCst);
            async { Ok::<_, std::convert::Infallible>(()) }
        }));
        let raw: &[u8] = br#"{"id":"secret-value"}"#;
        let err = svc.oneshot(message(7, raw)).await.unwrap_err();
        let err = err.downcast_ref::<DecodeError>().expect("a DecodeError");
        assert_eq!(err.raw().as_ref(), raw);
        assert_eq!(err.metadata().sequence_number.as_str(), "7");
        assert_eq!(err.format(), "JSON");
        assert_eq!(calls.load(Ordering::SeqCst), 0, "the handler never sees it");
        // Neither Display, the error chain nor Debug repeats the payload.
        let shown = format!("{} / {:?}", crate::observe::error_chain(err), err);
        assert!(!shown.contains("secret-value"), "{shown}");
        assert!(shown.contains("line 1 column"), "{shown}");
    }

    #[tokio::test]
    async fn json_content_types_are_decoded_whatever_their_parameters() {
        for content_type in [
            "application/json",
            "application/json;charset=UTF-8",
            "Application/JSON ; charset=utf-8",
            "application/vnd.orders.v1+json",
            "application/cloudevents+json; charset=UTF-8",
        ] {
            let svc =
                DecodeLayer::<Order>::json().layer(service_fn(|m: Message<Order>| async move {
                    Ok::<_, std::convert::Infallible>(m.payload.id)
                }));
            let msg = message(1, br#"{"id":7}"#).with_header(CONTENT_TYPE, content_type);
            assert_eq!(svc.oneshot(msg).await.unwrap(), 7, "{content_type}");
        }
    }

    #[tokio::test]
    async fn another_content_type_is_an_error_naming_it() {
        for content_type in ["text/plain", "application/xml", "application/+json", "json"] {
            let calls = Arc::new(AtomicUsize::new(0));
            let seen = calls.clone();
            let svc = DecodeLayer::<Order>::json().layer(service_fn(move |_m: Message<Order>| {
                seen.fetch_add(1, Ordering::SeqCst);
                async { Ok::<_, std::convert::Infallible>(()) }
            }));
            // Valid JSON: the content type alone decides.
            let msg = message(3, br#"{"id":7}"#).with_header(CONTENT_TYPE, content_type);
            let err = svc.oneshot(msg).await.unwrap_err();
            let err = err.downcast_ref::<DecodeError>().expect("a DecodeError");
            assert_eq!(
                err.kind(),
                &DecodeErrorKind::UnsupportedContentType {
                    content_type: content_type.to_owned()
                }
            );
            assert_eq!(err.headers().get_str(CONTENT_TYPE), Some(content_type));
            assert!(err.to_string().contains(content_type), "{err}");
            assert_eq!(calls.load(Ordering::SeqCst), 0, "the handler never sees it");
        }
    }

    #[tokio::test]
    async fn garbage_and_empty_payloads_do_not_panic() {
        for raw in [&b""[..], b"\xff\xfe", b"{", b"null", b"[1,2]"] {
            let svc = DecodeLayer::<Order>::json().layer(service_fn(|_m: Message<Order>| async {
                Ok::<_, std::convert::Infallible>(())
            }));
            let err = svc.oneshot(message(1, raw)).await.unwrap_err();
            assert!(err.is::<DecodeError>());
        }
    }
}
