//! [`GlueRegistry`]: the AWS Glue Schema Registry through `aws-sdk-glue` (feature `glue`).

use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use aws_sdk_glue::error::{DisplayErrorContext, SdkError};
use aws_sdk_glue::types::{Compatibility, RegistryId, SchemaId, SchemaVersionStatus};
use aws_smithy_types::timeout::TimeoutConfig;
use shardflow::{AwsTimeouts, ConfigError};
use uuid::Uuid;

use super::registry::{RegistryError, SchemaRegistry};
use crate::codec::{DataFormat, WriterSchema};

/// The registry the reference serializer uses when none is configured.
pub const DEFAULT_REGISTRY_NAME: &str = "default-registry";

/// The compatibility mode of the schemas auto-registration creates, as the reference
/// serializer's default.
pub const DEFAULT_COMPATIBILITY: Compatibility = Compatibility::Backward;

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
/// [`RegistryError::Unavailable`], transient; a definition the registry refuses (invalid
/// for its data format, or failing the compatibility check) is
/// [`RegistryError::Rejected`].
///
/// Auto-registration does what the reference serializer does: a definition that
/// `GetSchemaByDefinition` does not find is added as a new version
/// (`RegisterSchemaVersion`) when the schema exists, and when it does not the schema is
/// created with it as its first version (`CreateSchema`, with the definition's data
/// format, the [`compatibility`](Self::compatibility) setting, `BACKWARD` by default,
/// and the [`description`](Self::description)). Two producers creating the same schema
/// at once both succeed: the one that loses the race registers its version instead.
#[derive(Clone, Debug)]
pub struct GlueRegistry {
    client: aws_sdk_glue::Client,
    registry_name: Arc<str>,
    compatibility: Compatibility,
    description: Option<Arc<str>>,
}

impl GlueRegistry {
    /// Uses `client` as it is (give it timeouts of your own), in registry `registry_name`.
    pub fn from_client(client: aws_sdk_glue::Client, registry_name: impl Into<Arc<str>>) -> Self {
        GlueRegistry {
            client,
            registry_name: registry_name.into(),
            compatibility: DEFAULT_COMPATIBILITY,
            description: None,
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
            compatibility: DEFAULT_COMPATIBILITY,
            description: None,
        }
    }

    /// The compatibility mode of schemas that auto-registration creates (default
    /// `BACKWARD`, the reference serializer's default). Schemas that exist keep theirs.
    pub fn compatibility(mut self, compatibility: Compatibility) -> Self {
        self.compatibility = compatibility;
        self
    }

    /// The description of schemas that auto-registration creates (none by default).
    pub fn description(mut self, description: impl Into<Arc<str>>) -> Self {
        self.description = Some(description.into());
        self
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

fn rejected<E, R>(e: SdkError<E, R>) -> RegistryError
where
    E: std::error::Error + Send + Sync + 'static,
    R: std::fmt::Debug + Send + Sync + 'static,
{
    // The service's message names the problem with the definition, not record data.
    RegistryError::Rejected(DisplayErrorContext(e).to_string())
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
        let missing = match found {
            Ok(out) => return parse_id(out.schema_version_id()),
            Err(e) => match e.as_service_error() {
                Some(E::EntityNotFoundException(not_found)) => {
                    not_found.message().unwrap_or_default().to_owned()
                }
                _ => return Err(unavailable(e)),
            },
        };
        if !register {
            return Err(RegistryError::NotRegistered {
                schema_name: schema_name.to_owned(),
            });
        }
        // Glue says which is missing only in the message ("Schema version is not found."
        // or "Schema is not found."), as the reference serializer reads it; each path
        // falls back to the other when the guess was wrong (an emulator's wording, or
        // another producer creating the schema meanwhile).
        let (id, status) = if missing.starts_with(SCHEMA_VERSION_NOT_FOUND) {
            match self.register_version(schema_name, schema).await? {
                Some(registered) => registered,
                None => self.create_schema(schema_name, schema).await?,
            }
        } else {
            self.create_schema(schema_name, schema).await?
        };
        self.until_available(schema_name, id, status).await
    }
}

/// The start of Glue's message when the schema exists but not the definition.
const SCHEMA_VERSION_NOT_FOUND: &str = "Schema version is not found";

impl GlueRegistry {
    /// `RegisterSchemaVersion`; `None` when the schema does not exist.
    async fn register_version(
        &self,
        schema_name: &str,
        schema: &WriterSchema,
    ) -> Result<Option<(Uuid, Option<SchemaVersionStatus>)>, RegistryError> {
        use aws_sdk_glue::operation::register_schema_version::RegisterSchemaVersionError as E;
        let out = self
            .client
            .register_schema_version()
            .schema_id(self.schema_id(schema_name))
            .schema_definition(schema.definition.as_ref())
            .send()
            .await;
        match out {
            Ok(out) => Ok(Some((
                parse_id(out.schema_version_id())?,
                out.status().cloned(),
            ))),
            Err(e) => match e.as_service_error() {
                Some(E::EntityNotFoundException(_)) => Ok(None),
                Some(E::InvalidInputException(_)) => Err(rejected(e)),
                _ => Err(unavailable(e)),
            },
        }
    }

    /// `CreateSchema` with the definition as its first version; `None` when the schema
    /// exists already.
    async fn create_schema_or_register(
        &self,
        schema_name: &str,
        schema: &WriterSchema,
    ) -> Result<Option<(Uuid, Option<SchemaVersionStatus>)>, RegistryError> {
        use aws_sdk_glue::operation::create_schema::CreateSchemaError as E;
        use aws_sdk_glue::types::DataFormat as Glue;
        let data_format = match schema.format {
            DataFormat::Avro => Glue::Avro,
            DataFormat::JsonSchema => Glue::Json,
            DataFormat::Protobuf => Glue::Protobuf,
        };
        let out = self
            .client
            .create_schema()
            .registry_id(
                RegistryId::builder()
                    .registry_name(self.registry_name.as_ref())
                    .build(),
            )
            .schema_name(schema_name)
            .data_format(data_format)
            .compatibility(self.compatibility.clone())
            .set_description(self.description.as_deref().map(str::to_owned))
            .schema_definition(schema.definition.as_ref())
            .send()
            .await;
        match out {
            Ok(out) => Ok(Some((
                parse_id(out.schema_version_id())?,
                out.schema_version_status().cloned(),
            ))),
            Err(e) => match e.as_service_error() {
                Some(E::AlreadyExistsException(_)) => Ok(None),
                Some(E::InvalidInputException(_)) => Err(rejected(e)),
                _ => Err(unavailable(e)),
            },
        }
    }

    /// `CreateSchema`, or `RegisterSchemaVersion` when another producer created it.
    async fn create_schema(
        &self,
        schema_name: &str,
        schema: &WriterSchema,
    ) -> Result<(Uuid, Option<SchemaVersionStatus>), RegistryError> {
        match self.create_schema_or_register(schema_name, schema).await? {
            Some(created) => Ok(created),
            None => self
                .register_version(schema_name, schema)
                .await?
                .ok_or_else(|| {
                    RegistryError::Unavailable("the schema was neither created nor found".into())
                }),
        }
    }

    /// Waits while a new version is `PENDING` (Glue checks its compatibility first).
    async fn until_available(
        &self,
        schema_name: &str,
        id: Uuid,
        mut status: Option<SchemaVersionStatus>,
    ) -> Result<Uuid, RegistryError> {
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
