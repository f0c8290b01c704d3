//! `GlueRegistry` against a Glue emulator over real HTTP (moto's server serves the schema
//! registry calls): look up, refuse without auto-registration, register, fetch by id,
//! unknown ids.
//!
//! Runs only when `SHARDFLOW_GLUE_ENDPOINT` names the emulator (e.g.
//! `moto_server -H 127.0.0.1 -p 5000` and `SHARDFLOW_GLUE_ENDPOINT=http://127.0.0.1:5000`);
//! otherwise it prints "skipped".
#![cfg(feature = "glue")]

use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};

use shardflow_middleware::codec::{DataFormat, WriterSchema};
use shardflow_middleware::schema_registry::{GlueRegistry, RegistryError, SchemaRegistry};
use uuid::Uuid;

const V1: &str = r#"{"type":"record","name":"Order","fields":[{"name":"id","type":"long"}]}"#;
const V2: &str = r#"{"type":"record","name":"Order","fields":[{"name":"id","type":"long"},{"name":"note","type":["null","string"],"default":null}]}"#;

fn avro(definition: &str) -> WriterSchema {
    WriterSchema {
        format: DataFormat::Avro,
        definition: Arc::from(definition),
    }
}

/// The emulator's configuration, or `None` (the test is skipped) when there is none.
async fn emulator() -> Option<aws_config::SdkConfig> {
    let Some(endpoint) = std::env::var_os("SHARDFLOW_GLUE_ENDPOINT") else {
        eprintln!("skipped: SHARDFLOW_GLUE_ENDPOINT is not set");
        return None;
    };
    let config = aws_config::defaults(aws_config::BehaviorVersion::latest())
        .endpoint_url(endpoint.to_string_lossy())
        .region(aws_config::Region::new("us-east-1"))
        .credentials_provider(aws_sdk_glue::config::Credentials::new(
            "test", "test", None, None, "test",
        ))
        .load()
        .await;
    Some(config)
}

#[tokio::test]
async fn looks_up_registers_and_fetches_schema_versions() {
    let Some(config) = emulator().await else {
        return;
    };
    let nanos = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_nanos())
        .unwrap_or_default();
    let registry_name = format!("orders-{nanos}");
    let registry = GlueRegistry::from_config_with(
        &config,
        shardflow::AwsTimeouts::default(),
        registry_name.as_str(),
    )
    .expect("valid timeouts");
    let client = registry.client();
    client
        .create_registry()
        .registry_name(&registry_name)
        .send()
        .await
        .expect("create the registry");
    client
        .create_schema()
        .registry_id(
            aws_sdk_glue::types::RegistryId::builder()
                .registry_name(&registry_name)
                .build(),
        )
        .schema_name("orders")
        .data_format(aws_sdk_glue::types::DataFormat::Avro)
        .compatibility(aws_sdk_glue::types::Compatibility::Backward)
        .schema_definition(V1)
        .send()
        .await
        .expect("create the schema");

    let v1 = registry
        .version_id("orders", &avro(V1), false)
        .await
        .expect("v1 is there");
    assert_eq!(
        registry.schema_version(v1).await.expect("fetched"),
        avro(V1)
    );

    let err = registry
        .version_id("orders", &avro(V2), false)
        .await
        .unwrap_err();
    assert!(matches!(err, RegistryError::NotRegistered { .. }), "{err}");

    let v2 = registry
        .version_id("orders", &avro(V2), true)
        .await
        .expect("registered");
    assert_ne!(v1, v2);
    assert_eq!(
        registry
            .version_id("orders", &avro(V2), false)
            .await
            .unwrap(),
        v2
    );
    assert_eq!(registry.schema_version(v2).await.unwrap(), avro(V2));

    let unknown = Uuid::from_u128(0x5eed);
    let err = registry.schema_version(unknown).await.unwrap_err();
    assert!(
        matches!(err, RegistryError::UnknownVersion(u) if u == unknown),
        "{err}"
    );
    assert!(!err.is_transient());
}

/// Auto-registration creates a schema that does not exist, as the reference serializer
/// does (`CreateSchema` with the definition's data format and the compatibility setting),
/// then adds versions to it; with auto-registration off nothing is created.
#[tokio::test]
async fn auto_registration_creates_a_missing_schema_then_adds_versions() {
    let Some(config) = emulator().await else {
        return;
    };
    let nanos = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_nanos())
        .unwrap_or_default();
    let registry_name = format!("people-{nanos}");
    let registry = GlueRegistry::from_config_with(
        &config,
        shardflow::AwsTimeouts::default(),
        registry_name.as_str(),
    )
    .expect("valid timeouts")
    .compatibility(aws_sdk_glue::types::Compatibility::Full)
    .description("created by auto-registration");
    let client = registry.client().clone();
    client
        .create_registry()
        .registry_name(&registry_name)
        .send()
        .await
        .expect("create the registry");
    let schema_id = || {
        aws_sdk_glue::types::SchemaId::builder()
            .registry_name(&registry_name)
            .schema_name("people")
            .build()
    };

    let err = registry
        .version_id("people", &avro(V1), false)
        .await
        .unwrap_err();
    assert!(matches!(err, RegistryError::NotRegistered { .. }), "{err}");
    assert!(
        client
            .get_schema()
            .schema_id(schema_id())
            .send()
            .await
            .is_err(),
        "auto-registration off: no schema created"
    );

    let v1 = registry
        .version_id("people", &avro(V1), true)
        .await
        .expect("schema created");
    let created = client
        .get_schema()
        .schema_id(schema_id())
        .send()
        .await
        .expect("the schema exists");
    assert_eq!(
        created.data_format(),
        Some(&aws_sdk_glue::types::DataFormat::Avro)
    );
    assert_eq!(
        created.compatibility(),
        Some(&aws_sdk_glue::types::Compatibility::Full)
    );
    assert_eq!(created.description(), Some("created by auto-registration"));
    assert_eq!(registry.schema_version(v1).await.unwrap(), avro(V1));

    let v2 = registry
        .version_id("people", &avro(V2), true)
        .await
        .expect("a second version");
    assert_ne!(v1, v2);
    assert_eq!(registry.schema_version(v2).await.unwrap(), avro(V2));
    assert_eq!(
        registry
            .version_id("people", &avro(V1), true)
            .await
            .unwrap(),
        v1,
        "a known definition is found, not registered again"
    );
}
