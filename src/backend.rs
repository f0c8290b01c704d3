//! The two backends behind the same traits: [`Aws`] (Kinesis and DynamoDB through the
//! official SDK) and [`Memory`](crate::memory::Memory) (embedded, in-process).

use std::sync::Arc;

use crate::kinesis::KinesisApi;
use crate::lease::LeaseStore;

/// What a consumer or producer is built on: a Kinesis API and lease tables.
pub trait Backend: Send + Sync + 'static {
    /// The Kinesis API.
    fn kinesis(&self) -> Arc<dyn KinesisApi>;
    /// The lease store backed by table `table` (one table per consumer group).
    fn lease_store(&self, table: &str) -> Arc<dyn LeaseStore>;
}

/// Kinesis and DynamoDB through `aws-sdk-kinesis` and `aws-sdk-dynamodb`, configured by
/// `aws-config`: regions, credentials and endpoints (`AWS_ENDPOINT_URL`,
/// `AWS_ENDPOINT_URL_KINESIS`, `AWS_ENDPOINT_URL_DYNAMODB`) work the standard way.
#[derive(Clone, Debug)]
pub struct Aws {
    kinesis: aws_sdk_kinesis::Client,
    dynamodb: aws_sdk_dynamodb::Client,
}

impl Aws {
    /// Loads the standard AWS configuration from the environment and profile files.
    pub async fn from_env() -> Self {
        let config = aws_config::load_defaults(aws_config::BehaviorVersion::latest()).await;
        Self::from_config(&config)
    }

    /// Builds the clients from an already loaded configuration.
    pub fn from_config(config: &aws_config::SdkConfig) -> Self {
        Aws {
            kinesis: aws_sdk_kinesis::Client::new(config),
            dynamodb: aws_sdk_dynamodb::Client::new(config),
        }
    }

    /// Uses clients the caller built (custom retry, timeouts, interceptors).
    pub fn from_clients(
        kinesis: aws_sdk_kinesis::Client,
        dynamodb: aws_sdk_dynamodb::Client,
    ) -> Self {
        Aws { kinesis, dynamodb }
    }

    /// The Kinesis client.
    pub fn kinesis_client(&self) -> &aws_sdk_kinesis::Client {
        &self.kinesis
    }

    /// The DynamoDB client (for the dedup store and users' own tables).
    pub fn dynamodb_client(&self) -> &aws_sdk_dynamodb::Client {
        &self.dynamodb
    }
}

impl Backend for Aws {
    fn kinesis(&self) -> Arc<dyn KinesisApi> {
        Arc::new(crate::kinesis::aws::AwsKinesis::new(self.kinesis.clone()))
    }

    fn lease_store(&self, table: &str) -> Arc<dyn LeaseStore> {
        Arc::new(crate::lease::dynamo::DynamoLeaseStore::new(
            self.dynamodb.clone(),
            table,
        ))
    }
}
