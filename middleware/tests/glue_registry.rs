//! `GlueRegistry` against a Glue emulator over real HTTP (moto's server serves the schema
//! registry calls): look up, refuse without auto-registration, register, fetch by id,
//! unknown ids.
//!
//! Runs only when `SHARDFLOW_GLUE_ENDPOINT` names the emulator (e.g.
//! `moto_server -H 127.0.0.1 -p 5000` and `SHARDFLOW_GLUE_ENDPOINT=http://127.0.0.1:5000`);
//! otherwise it prints "skipped". The refusals no emulator gives (access denied,
//! throttling, a call that never answers) come from a scripted endpoint and always run.
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

/// A registry on `url` without the SDK's own retries (each scripted answer is one call).
async fn scripted(url: &str, timeouts: shardflow::AwsTimeouts) -> GlueRegistry {
    let config = aws_config::defaults(aws_config::BehaviorVersion::latest())
        .endpoint_url(url)
        .region(aws_config::Region::new("us-east-1"))
        .credentials_provider(aws_sdk_glue::config::Credentials::new(
            "test", "test", None, None, "test",
        ))
        .retry_config(aws_config::retry::RetryConfig::disabled())
        .load()
        .await;
    GlueRegistry::from_config_with(&config, timeouts, "orders").expect("valid timeouts")
}

/// Access denied and throttling say nothing about the record: transient (the record is
/// delivered again, never dead-lettered), as a missing permission must not send a whole
/// stream to the dead-letter path; a version Glue does not have is permanent.
#[tokio::test]
async fn refusals_are_transient_and_a_missing_version_is_permanent() {
    use serde_json::json;
    let fake = shardflow_testkit::fake_endpoint::Fake::start(vec![
        (
            400,
            json!({"__type": "AccessDeniedException", "Message": "not authorized to perform glue:GetSchemaVersion"}),
        ),
        (
            400,
            json!({"__type": "ThrottlingException", "Message": "Rate exceeded"}),
        ),
        (
            400,
            json!({"__type": "EntityNotFoundException", "Message": "Schema version is not found."}),
        ),
    ]);
    let registry = scripted(&fake.url, shardflow::AwsTimeouts::default()).await;
    let id = Uuid::from_u128(0x5eed);
    let denied = registry.schema_version(id).await.unwrap_err();
    assert!(
        matches!(denied, RegistryError::Unavailable(_)) && denied.is_transient(),
        "{denied:?}"
    );
    let throttled = registry.schema_version(id).await.unwrap_err();
    assert!(throttled.is_transient(), "{throttled:?}");
    let missing = registry.schema_version(id).await.unwrap_err();
    assert!(
        matches!(missing, RegistryError::UnknownVersion(u) if u == id),
        "{missing:?}"
    );
    assert!(!missing.is_transient());
    assert_eq!(fake.ops(), ["GetSchemaVersion"; 3]);
}

/// A GetSchemaVersion that never answers ends at the client's deadline, transient.
#[tokio::test]
async fn a_call_that_never_answers_ends_at_the_deadline_as_transient() {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    let url = format!("http://{}", listener.local_addr().expect("address"));
    // Accepts and holds connections without ever answering.
    std::thread::spawn(move || {
        let mut held = Vec::new();
        for stream in listener.incoming().flatten() {
            held.push(stream);
        }
    });
    let timeouts = shardflow::AwsTimeouts {
        connect: std::time::Duration::from_secs(1),
        read: std::time::Duration::from_secs(1),
        attempt: std::time::Duration::from_secs(1),
        operation: std::time::Duration::from_secs(2),
    };
    let registry = scripted(&url, timeouts).await;
    let err = tokio::time::timeout(
        std::time::Duration::from_secs(30),
        registry.schema_version(Uuid::from_u128(1)),
    )
    .await
    .expect("the client's own deadline ends the call")
    .unwrap_err();
    assert!(err.is_transient(), "{err:?}");
}
