//! [`SchemaRegistryLayer`]: decodes records in the schema registry framing with the
//! writer schema they name.

use std::fmt;
use std::future::Future;
use std::marker::PhantomData;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use bytes::Bytes;
use shardflow::Message;
use tower::{Layer, Service};

use super::framing;
use super::registry::{CachedRegistry, RegistryError, SchemaRegistry};
use crate::codec::{DataFormat, SchemaFormat};
use crate::decode::{DecodeError, DecodeErrorKind, CONTENT_TYPE};
use crate::observe::message_span;
use crate::BoxError;

/// Decodes each `Message<Bytes>` into a `Message<T>`: a framed record with the writer
/// schema its version id names (fetched through the registry's cache), an unframed one
/// with the plain format, or refused when framing is required
/// ([`SchemaRegistryLayer::require_framing`]).
pub struct SchemaRegistryDecode<S, T, F, R> {
    inner: S,
    shared: Shared<F, R>,
    _payload: PhantomData<fn() -> T>,
}

struct Shared<F, R> {
    format: Arc<F>,
    registry: CachedRegistry<R>,
    require_framing: bool,
}

impl<F, R> Clone for Shared<F, R> {
    fn clone(&self) -> Self {
        Shared {
            format: self.format.clone(),
            registry: self.registry.clone(),
            require_framing: self.require_framing,
        }
    }
}

impl<S: Clone, T, F, R> Clone for SchemaRegistryDecode<S, T, F, R> {
    fn clone(&self) -> Self {
        SchemaRegistryDecode {
            inner: self.inner.clone(),
            shared: self.shared.clone(),
            _payload: PhantomData,
        }
    }
}

impl<S: fmt::Debug, T, F: fmt::Debug, R> fmt::Debug for SchemaRegistryDecode<S, T, F, R> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SchemaRegistryDecode")
            .field("inner", &self.inner)
            .field("format", &self.shared.format)
            .field("registry", &self.shared.registry)
            .field("require_framing", &self.shared.require_framing)
            .finish()
    }
}

impl<S, T, F, R> SchemaRegistryDecode<S, T, F, R> {
    /// The inner service.
    pub fn get_ref(&self) -> &S {
        &self.inner
    }

    /// Unwraps the inner service.
    pub fn into_inner(self) -> S {
        self.inner
    }
}

impl<S, T, F, R> Service<Message<Bytes>> for SchemaRegistryDecode<S, T, F, R>
where
    S: Service<Message<T>> + Clone + Send + 'static,
    S::Future: Send + 'static,
    S::Response: Send + 'static,
    S::Error: Into<BoxError>,
    T: Send + 'static,
    F: SchemaFormat<T> + Send + Sync + 'static,
    R: SchemaRegistry,
{
    type Response = S::Response;
    type Error = BoxError;
    type Future = ResponseFuture<S::Response>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx).map_err(Into::into)
    }

    fn call(&mut self, message: Message<Bytes>) -> Self::Future {
        // The ready service answers this call; the clone waits for the next poll_ready.
        let clone = self.inner.clone();
        let mut inner = std::mem::replace(&mut self.inner, clone);
        let shared = self.shared.clone();
        ResponseFuture {
            future: Box::pin(async move {
                // The error is unsized as it is, not boxed again: callers downcast it.
                let message = decode(&shared, message).await.map_err(|e| e as BoxError)?;
                inner.call(message).await.map_err(Into::into)
            }),
        }
    }
}

async fn decode<T, F, R>(
    shared: &Shared<F, R>,
    message: Message<Bytes>,
) -> Result<Message<T>, Box<DecodeError>>
where
    F: SchemaFormat<T>,
    R: SchemaRegistry,
{
    let format = &*shared.format;
    let content_type = message.headers.get_str(CONTENT_TYPE);
    // A record labelled with a type the format reads (Spring's converters label every
    // record; the registry's framing carries no label) is that format's plain payload,
    // even when its first bytes look like the framing's header (a plain Avro datum whose
    // first field is the long -2 starts with 0x03).
    let labelled_plain = content_type.is_some_and(|ct| format.accepts(ct));
    if !shared.require_framing && (labelled_plain || !framing::is_framed(&message.payload)) {
        if let Some(content_type) = content_type {
            if !format.accepts(content_type) {
                let kind = DecodeErrorKind::UnsupportedContentType {
                    content_type: content_type.to_owned(),
                };
                return Err(failed(format.name(), message, kind, None));
            }
        }
        return match format.decode(&message.payload) {
            Ok(value) => Ok(message.map(|_| value)),
            Err(e) => {
                let kind = format.error_kind(&e);
                Err(failed(format.name(), message, kind, Some(Box::new(e))))
            }
        };
    }
    let frame = match framing::parse(&message.payload) {
        Ok(frame) => frame,
        Err(e) => {
            let kind = DecodeErrorKind::InvalidFraming;
            return Err(failed(format.name(), message, kind, Some(Box::new(e))));
        }
    };
    let writer = match shared.registry.schema_version(frame.schema_version).await {
        Ok(writer) => writer,
        Err(e) => {
            let kind = match &e {
                RegistryError::UnknownVersion(_) | RegistryError::NotRegistered { .. } => {
                    DecodeErrorKind::UnknownSchemaVersion {
                        schema_version: frame.schema_version,
                    }
                }
                _ => DecodeErrorKind::RegistryUnavailable,
            };
            return Err(failed(format.name(), message, kind, Some(Box::new(e))));
        }
    };
    if writer.format != format.data_format() {
        let e = WrongDataFormat {
            writer: writer.format,
            reader: format.data_format(),
        };
        let kind = DecodeErrorKind::InvalidPayload;
        return Err(failed(format.name(), message, kind, Some(Box::new(e))));
    }
    let body = if writer.format == DataFormat::Protobuf {
        match framing::read_message_index(&frame.payload) {
            Ok((index, body)) => {
                if let Err(e) = format.check_message_index(index, &writer) {
                    let kind = DecodeErrorKind::SchemaMismatch;
                    return Err(failed(format.name(), message, kind, Some(Box::new(e))));
                }
                body
            }
            Err(e) => {
                let kind = DecodeErrorKind::InvalidFraming;
                return Err(failed(format.name(), message, kind, Some(Box::new(e))));
            }
        }
    } else {
        frame.payload
    };
    match format.decode_with_schema(&body, &writer) {
        Ok(value) => Ok(message.map(|_| value)),
        Err(e) => Err(failed(
            format.name(),
            message,
            format.error_kind(&e),
            Some(Box::new(e)),
        )),
    }
}

/// A framed record whose writer schema is in another schema language than the layer's
/// format reads.
#[derive(Debug, thiserror::Error)]
#[error("the writer schema is {writer:?}, the format reads {reader:?}")]
pub struct WrongDataFormat {
    /// The writer schema's language.
    pub writer: DataFormat,
    /// The format's language.
    pub reader: DataFormat,
}

fn failed(
    format: &'static str,
    message: Message<Bytes>,
    kind: DecodeErrorKind,
    source: Option<BoxError>,
) -> Box<DecodeError> {
    message_span("schema_registry", &message.metadata).in_scope(|| {
        tracing::debug!(
            monotonic_counter.shardflow.decode_failed = 1u64,
            format,
            kind = ?kind,
            "framed payload did not decode",
        );
    });
    Box::new(DecodeError::for_message(message, format, kind, source))
}

/// Applies [`SchemaRegistryDecode`] to services: records in the AWS Glue Schema
/// Registry framing are decoded with the writer schema they name.
///
/// ```no_run
/// # use shardflow_middleware::schema_registry::{MemoryRegistry, SchemaRegistryLayer};
/// # fn demo<F: Clone>(format: F) {
/// let registry = MemoryRegistry::new(); // or GlueRegistry (feature `glue`)
/// let layer = SchemaRegistryLayer::<(), F, _>::new(format, registry);
/// # let _ = layer;
/// # }
/// ```
pub struct SchemaRegistryLayer<T, F, R> {
    shared: Shared<F, R>,
    _payload: PhantomData<fn() -> T>,
}

impl<T, F, R: SchemaRegistry> SchemaRegistryLayer<T, F, R> {
    /// Decodes with `format`, writer schemas from `registry` behind a default
    /// [`CachedRegistry`] (1000 versions, 10 s per call).
    pub fn new(format: F, registry: R) -> Self {
        Self::with_cache(format, CachedRegistry::new(registry))
    }

    /// Decodes with `format`, writer schemas from `registry` (share one `CachedRegistry`
    /// between layers and encoders to look each version up once per process).
    pub fn with_cache(format: F, registry: CachedRegistry<R>) -> Self {
        SchemaRegistryLayer {
            shared: Shared {
                format: Arc::new(format),
                registry,
                require_framing: false,
            },
            _payload: PhantomData,
        }
    }

    /// Refuses unframed records ([`DecodeErrorKind::InvalidFraming`], dead-lettered by the
    /// default policy) instead of decoding them with the plain format.
    pub fn require_framing(mut self) -> Self {
        self.shared.require_framing = true;
        self
    }
}

impl<T, F, R> Clone for SchemaRegistryLayer<T, F, R> {
    fn clone(&self) -> Self {
        SchemaRegistryLayer {
            shared: self.shared.clone(),
            _payload: PhantomData,
        }
    }
}

impl<T, F: fmt::Debug, R> fmt::Debug for SchemaRegistryLayer<T, F, R> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SchemaRegistryLayer")
            .field("format", &self.shared.format)
            .field("registry", &self.shared.registry)
            .field("require_framing", &self.shared.require_framing)
            .field("payload", &std::any::type_name::<T>())
            .finish()
    }
}

impl<S, T, F, R> Layer<S> for SchemaRegistryLayer<T, F, R> {
    type Service = SchemaRegistryDecode<S, T, F, R>;

    fn layer(&self, inner: S) -> Self::Service {
        SchemaRegistryDecode {
            inner,
            shared: self.shared.clone(),
            _payload: PhantomData,
        }
    }
}

/// The response future of [`SchemaRegistryDecode`]: the registry lookup (when the record
/// is framed and its version not cached yet), then the inner service's call.
pub struct ResponseFuture<R> {
    future: Pin<Box<dyn Future<Output = Result<R, BoxError>> + Send>>,
}

impl<R> fmt::Debug for ResponseFuture<R> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("schema_registry::ResponseFuture")
    }
}

impl<R> Future for ResponseFuture<R> {
    type Output = Result<R, BoxError>;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        self.future.as_mut().poll(cx)
    }
}
