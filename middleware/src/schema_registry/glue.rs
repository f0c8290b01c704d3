//! [`GlueRegistry`]: the AWS Glue Schema Registry through `aws-sdk-glue` (feature `glue`).

use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use aws_sdk_glue::error::{DisplayErrorContext, SdkError};
use aws_sdk_glue::types::{SchemaId, SchemaVersionStatus};
use aws_smithy_types::timeout::TimeoutConfig;
use shardflow::{AwsTimeouts, ConfigError};
use uuid::Uuid;

use super::registry::{RegistryError, SchemaRegistry};
use crate::codec::{DataFormat, WriterSchema};

/// The registry the reference serializer uses when none is configured.
pub const DEFAULT_REGISTRY_NAME: &str = "default-registry";

/// How many times a freshly registered version is checked for `AVAILABLE` (every
/// [`REGISTRATION_POLL`]) before its id is used anyway.
const REGISTRATION_CHECKS: u32 = 10;
const REGISTRATION_POLL: Duration = Duration::from_millis(500);

/// The AWS Glue Schema Registry: `GetSchemaVersion` for the decode layer,
/// `GetSchemaByDefinition` and (with auto-registration) `RegisterSchemaVersion` for the
/// encoder, all in one registry (`registry_name`).
///
/// Built from `aws-config` with [`AwsTimeouts`] like shardflow's other AWS clients, so no
/// call waits for ever; [`CachedRegistry`](super::CachedRegistry) puts its own deadline
/// on top. A missing version or definition is permanent
/// ([`RegistryError::UnknownVersion`], [`RegistryError::NotRegistered`]); every other
/// failure (throttling, access denied, a network error) is
/// [`RegistryError::Unavailable`], transient. Auto-registration adds versions to an
/// existing schema; it does not create the schema.
#[derive(Clone, Debug)]
pub struct GlueRegistry {
    client: aws_sdk_glue::Client,
    registry_name: Arc<str>,
}

impl GlueRegistry {
    /// Uses `client` as it is (give it timeouts of your own), in registry `registry_name`.
    pub fn from_client(client: aws_sdk_glue::Client, registry_name: impl Into<Arc<str>>) -> Self {
        GlueRegistry {
            client,
            registry_name: registry_name.into(),
        }
    }

    /// Loads the standard AWS configuration (environment, profiles, `AWS_ENDPOINT_URL_GLUE`)
    /// with the default [`AwsTimeouts`].
    pub async fn from_env(registry_name: impl Into<Arc<str>>) -> Self {
        let config = aws_config::load_defaults(aws_config::BehaviorVersion::latest()).await;
        Self::build(&config, &AwsTimeouts::default(), registry_name.into())
    }

    /// Builds the client from a loaded configuration with these timeouts; refuses invalid
    /// ones with an error naming the field.
    pub fn from_config_with(
        config: &aws_config::SdkConfig,
        timeouts: AwsTimeouts,
        registry_name: impl Into<Arc<str>>,
    ) -> Result<Self, ConfigError> {
        timeouts.validate()?;
        Ok(Self::build(config, &timeouts, registry_name.into()))
    }

    fn build(config: &aws_config::SdkConfig, t: &AwsTimeouts, registry_name: Arc<str>) -> Self {
        let timeouts = TimeoutConfig::builder()
            .connect_timeout(t.connect)
            .read_timeout(t.read)
            .operation_attempt_timeout(t.attempt)
            .operation_timeout(t.operation)
            .build();
        let client = aws_sdk_glue::Client::from_conf(
            aws_sdk_glue::config::Builder::from(config)
                .timeout_config(timeouts)
                .build(),
        );
        GlueRegistry {
            client,
            registry_name,
        }
    }

    /// The client.
    pub fn client(&self) -> &aws_sdk_glue::Client {
        &self.client
    }

    fn schema_id(&self, schema_name: &str) -> SchemaId {
        SchemaId::builder()
            .registry_name(self.registry_name.as_ref())
            .schema_name(schema_name)
            .build()
    }
}

fn unavailable<E, R>(e: SdkError<E, R>) -> RegistryError
where
    E: std::error::Error + Send + Sync + 'static,
    R: std::fmt::Debug + Send + Sync + 'static,
{
    // The context's text names the service's error code and message, never record data.
    RegistryError::Unavailable(DisplayErrorContext(e).to_string().into())
}

fn data_format(format: Option<&aws_sdk_glue::types::DataFormat>) -> Option<DataFormat> {
    use aws_sdk_glue::types::DataFormat as Glue;
    match format? {
        Glue::Avro => Some(DataFormat::Avro),
        Glue::Json => Some(DataFormat::JsonSchema),
        Glue::Protobuf => Some(DataFormat::Protobuf),
        _ => None,
    }
}

fn parse_id(id: Option<&str>) -> Result<Uuid, RegistryError> {
    id.and_then(|s| Uuid::parse_str(s).ok()).ok_or_else(|| {
        RegistryError::Unavailable("the registry answered without a valid schema version id".into())
    })
}

#[async_trait]
impl SchemaRegistry for GlueRegistry {
    async fn schema_version(&self, id: Uuid) -> Result<WriterSchema, RegistryError> {
        use aws_sdk_glue::operation::get_schema_version::GetSchemaVersionError as E;
        let out = self
            .client
            .get_schema_version()
            .schema_version_id(id.to_string())
            .send()
            .await
            .map_err(|e| match e.as_service_error() {
                Some(E::EntityNotFoundException(_)) => RegistryError::UnknownVersion(id),
                _ => unavailable(e),
            })?;
        let (Some(definition), Some(format)) =
            (out.schema_definition(), data_format(out.data_format()))
        else {
            return Err(RegistryError::UnknownVersion(id));
        };
        Ok(WriterSchema {
            format,
            definition: Arc::from(definition),
        })
    }

    async fn version_id(
        &self,
        schema_name: &str,
        schema: &WriterSchema,
        register: bool,
    ) -> Result<Uuid, RegistryError> {
        use aws_sdk_glue::operation::get_schema_by_definition::GetSchemaByDefinitionError as E;
        let found = self
            .client
            .get_schema_by_definition()
            .schema_id(self.schema_id(schema_name))
            .schema_definition(schema.definition.as_ref())
            .send()
            .await;
        match found {
            Ok(out) => return parse_id(out.schema_version_id()),
            Err(e) if matches!(e.as_service_error(), Some(E::EntityNotFoundException(_))) => {}
            Err(e) => return Err(unavailable(e)),
        }
        if !register {
            return Err(RegistryError::NotRegistered {
                schema_name: schema_name.to_owned(),
            });
        }
        let out = self
            .client
            .register_schema_version()
            .schema_id(self.schema_id(schema_name))
            .schema_definition(schema.definition.as_ref())
            .send()
            .await
            .map_err(unavailable)?;
        let id = parse_id(out.schema_version_id())?;
        // A new version is PENDING until Glue has checked its compatibility.
        let mut status = out.status().cloned();
        for _ in 0..REGISTRATION_CHECKS {
            match status {
                Some(SchemaVersionStatus::Pending) => {}
                Some(SchemaVersionStatus::Failure) | Some(SchemaVersionStatus::Deleting) => {
                    return Err(RegistryError::Rejected(format!(
                        "version {id} of {schema_name:?} failed its compatibility check"
                    )))
                }
                _ => return Ok(id),
            }
            tokio::time::sleep(REGISTRATION_POLL).await;
            status = self
                .client
                .get_schema_version()
                .schema_version_id(id.to_string())
                .send()
                .await
                .map_err(unavailable)?
                .status()
                .cloned();
        }
        Ok(id)
    }
}
