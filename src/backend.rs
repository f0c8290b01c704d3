//! The two backends behind the same traits: [`Aws`] (Kinesis and DynamoDB through the
//! official SDK) and [`Memory`](crate::memory::Memory) (embedded, in-process).

use std::sync::Arc;
use std::time::Duration;

use aws_smithy_types::timeout::TimeoutConfig;

use crate::error::ConfigError;
use crate::kinesis::{KinesisApi, StreamAdmin};
use crate::lease::LeaseStore;

/// What a consumer or producer is built on: a Kinesis API and lease tables.
pub trait Backend: Send + Sync + 'static {
    /// The Kinesis API.
    fn kinesis(&self) -> Arc<dyn KinesisApi>;
    /// The lease store backed by table `table` (one table per consumer group).
    fn lease_store(&self, table: &str) -> Arc<dyn LeaseStore>;
    /// Stream administration (create, split, merge), when the backend offers it: [`Aws`]
    /// and [`Memory`](crate::Memory) do; a wrapper written for tests need not.
    fn admin(&self) -> Option<Arc<dyn StreamAdmin>> {
        None
    }
    /// The DynamoDB Streams API of this backend: tables' change streams served through the
    /// same trait as Kinesis streams (the `stream` argument of every call is the stream ARN).
    /// `None` (the default) for a backend without table streams: a consumer of a table's
    /// stream is then refused by `build`.
    fn table_streams(&self) -> Option<Arc<dyn KinesisApi>> {
        None
    }
}

/// The timeouts of the SDK clients [`Aws`] builds. The SDK has none by default (a hung
/// connection waits for ever), so every client `Aws` builds gets these.
///
/// * `connect`: establishing a connection (default 3 s);
/// * `read`: from sending a request to the first byte of its answer (default 10 s);
/// * `attempt`: one HTTP attempt, answer read whole (default 10 s);
/// * `operation`: a whole call, all retries included (default 30 s).
///
/// A long-lived SubscribeToShard (enhanced fan-out) is not cut by them: they end when the
/// call has returned its initial answer, and its events then stream without a deadline.
/// GetRecords answers within a few seconds on AWS (at most 10 MB); a `read` or `attempt`
/// much below 5 s risks timing out healthy large reads.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct AwsTimeouts {
    /// Establishing a TCP (and TLS) connection.
    pub connect: Duration,
    /// From a sent request to the first byte of its answer.
    pub read: Duration,
    /// One attempt, including reading the answer.
    pub attempt: Duration,
    /// One call, across all of its retries.
    pub operation: Duration,
}

/// The longest timeout [`AwsTimeouts`] accepts (15 minutes): beyond it the worker's
/// leases would long have expired.
const MAX_AWS_TIMEOUT: Duration = Duration::from_secs(15 * 60);

impl Default for AwsTimeouts {
    fn default() -> Self {
        AwsTimeouts {
            connect: Duration::from_secs(3),
            read: Duration::from_secs(10),
            attempt: Duration::from_secs(10),
            operation: Duration::from_secs(30),
        }
    }
}

impl AwsTimeouts {
    /// Checks the values: each greater than zero and at most 15 minutes, and no attempt
    /// longer than the operation it is part of. The error names the field
    /// (`timeouts.connect`, `timeouts.read`, `timeouts.attempt`, `timeouts.operation`).
    pub fn validate(&self) -> Result<(), ConfigError> {
        for (field, d) in [
            ("timeouts.connect", self.connect),
            ("timeouts.read", self.read),
            ("timeouts.attempt", self.attempt),
            ("timeouts.operation", self.operation),
        ] {
            if d.is_zero() {
                return Err(ConfigError::Invalid {
                    field,
                    reason: "must be greater than zero".into(),
                });
            }
            if d > MAX_AWS_TIMEOUT {
                return Err(ConfigError::Invalid {
                    field,
                    reason: format!("{d:?} is longer than the limit of {MAX_AWS_TIMEOUT:?}"),
                });
            }
        }
        if self.attempt > self.operation {
            return Err(ConfigError::Invalid {
                field: "timeouts.attempt",
                reason: format!(
                    "{:?} is longer than the operation timeout {:?}",
                    self.attempt, self.operation
                ),
            });
        }
        Ok(())
    }

    fn timeout_config(&self) -> TimeoutConfig {
        TimeoutConfig::builder()
            .connect_timeout(self.connect)
            .read_timeout(self.read)
            .operation_attempt_timeout(self.attempt)
            .operation_timeout(self.operation)
            .build()
    }
}

/// Kinesis and DynamoDB through `aws-sdk-kinesis` and `aws-sdk-dynamodb`, configured by
/// `aws-config`: regions, credentials and endpoints (`AWS_ENDPOINT_URL`,
/// `AWS_ENDPOINT_URL_KINESIS`, `AWS_ENDPOINT_URL_DYNAMODB`) work the standard way.
/// The clients get [`AwsTimeouts`] (the defaults, or those given to the `_with`
/// constructors); [`Aws::from_clients`] uses the caller's clients as they are.
#[derive(Clone, Debug)]
pub struct Aws {
    kinesis: aws_sdk_kinesis::Client,
    dynamodb: aws_sdk_dynamodb::Client,
    /// `None` for [`Aws::from_clients`] until [`Aws::with_streams_client`].
    streams: Option<aws_sdk_dynamodbstreams::Client>,
    leader: crate::lease::dynamo::LeaderPlacement,
}

impl Aws {
    /// Loads the standard AWS configuration from the environment and profile files, with
    /// the default [`AwsTimeouts`].
    pub async fn from_env() -> Self {
        let config = aws_config::load_defaults(aws_config::BehaviorVersion::latest()).await;
        Self::build(&config, &AwsTimeouts::default())
    }

    /// Like [`Aws::from_env`], with these timeouts; refuses invalid ones with an error
    /// naming the field.
    pub async fn from_env_with(timeouts: AwsTimeouts) -> Result<Self, ConfigError> {
        timeouts.validate()?;
        let config = aws_config::load_defaults(aws_config::BehaviorVersion::latest()).await;
        Ok(Self::build(&config, &timeouts))
    }

    /// Builds the clients from an already loaded configuration (its HTTP client, retry
    /// settings and interceptors are kept), with the default [`AwsTimeouts`].
    pub fn from_config(config: &aws_config::SdkConfig) -> Self {
        Self::build(config, &AwsTimeouts::default())
    }

    /// Like [`Aws::from_config`], with these timeouts; refuses invalid ones with an
    /// error naming the field.
    pub fn from_config_with(
        config: &aws_config::SdkConfig,
        timeouts: AwsTimeouts,
    ) -> Result<Self, ConfigError> {
        timeouts.validate()?;
        Ok(Self::build(config, &timeouts))
    }

    fn build(config: &aws_config::SdkConfig, timeouts: &AwsTimeouts) -> Self {
        let timeouts = timeouts.timeout_config();
        Aws {
            kinesis: aws_sdk_kinesis::Client::from_conf(
                aws_sdk_kinesis::config::Builder::from(config)
                    .timeout_config(timeouts.clone())
                    .build(),
            ),
            dynamodb: aws_sdk_dynamodb::Client::from_conf(
                aws_sdk_dynamodb::config::Builder::from(config)
                    .timeout_config(timeouts.clone())
                    .build(),
            ),
            streams: Some(aws_sdk_dynamodbstreams::Client::from_conf(
                aws_sdk_dynamodbstreams::config::Builder::from(config)
                    .timeout_config(timeouts)
                    .build(),
            )),
            leader: Default::default(),
        }
    }

    /// Where the lease stores this backend makes keep their group's leader item
    /// ([`LeaderPlacement::Auto`](crate::lease::dynamo::LeaderPlacement::Auto) unless
    /// set): set it only to move a group between the lease table and its
    /// coordinator-state table with a rolling deploy (docs/kcl.md).
    pub fn with_leader_placement(
        mut self,
        placement: crate::lease::dynamo::LeaderPlacement,
    ) -> Self {
        self.leader = placement;
        self
    }

    /// Uses clients the caller built (custom retry, timeouts, interceptors) as they are:
    /// no [`AwsTimeouts`] are added, so give them timeouts of your own.
    /// Tables' change streams ([`Backend::table_streams`]) need a DynamoDB Streams
    /// client too: add it with [`Aws::with_streams_client`].
    pub fn from_clients(
        kinesis: aws_sdk_kinesis::Client,
        dynamodb: aws_sdk_dynamodb::Client,
    ) -> Self {
        Aws {
            kinesis,
            dynamodb,
            streams: None,
            leader: Default::default(),
        }
    }

    /// Uses this DynamoDB Streams client for tables' change streams
    /// ([`Backend::table_streams`]), as it is.
    pub fn with_streams_client(mut self, streams: aws_sdk_dynamodbstreams::Client) -> Self {
        self.streams = Some(streams);
        self
    }

    /// The DynamoDB Streams client (tables' change streams), if there is one.
    pub fn streams_client(&self) -> Option<&aws_sdk_dynamodbstreams::Client> {
        self.streams.as_ref()
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
        Arc::new(
            crate::lease::dynamo::DynamoLeaseStore::new(self.dynamodb.clone(), table)
                .with_leader_placement(self.leader),
        )
    }

    fn admin(&self) -> Option<Arc<dyn StreamAdmin>> {
        Some(Arc::new(crate::kinesis::aws::AwsKinesis::new(
            self.kinesis.clone(),
        )))
    }

    fn table_streams(&self) -> Option<Arc<dyn KinesisApi>> {
        let streams = self.streams.clone()?;
        Some(Arc::new(crate::dynamodb_streams::AwsTableStreams::new(
            streams,
            self.dynamodb.clone(),
        )))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn refuses_bad_timeouts_naming_the_field() {
        let field = |t: AwsTimeouts| match t.validate() {
            Err(ConfigError::Invalid { field, .. }) | Err(ConfigError::Missing { field }) => field,
            Ok(()) => "accepted",
        };
        let ok = AwsTimeouts::default();
        assert_eq!(field(ok), "accepted");
        let zero = Duration::ZERO;
        let absurd = Duration::from_secs(24 * 3600);
        assert_eq!(
            field(AwsTimeouts {
                connect: zero,
                ..ok
            }),
            "timeouts.connect"
        );
        assert_eq!(field(AwsTimeouts { read: absurd, ..ok }), "timeouts.read");
        assert_eq!(
            field(AwsTimeouts {
                attempt: zero,
                ..ok
            }),
            "timeouts.attempt"
        );
        assert_eq!(
            field(AwsTimeouts {
                operation: absurd,
                ..ok
            }),
            "timeouts.operation"
        );
        assert_eq!(
            field(AwsTimeouts {
                attempt: Duration::from_secs(60),
                ..ok
            }),
            "timeouts.attempt"
        );
    }
}
