//! [`KinesisApi`](super::KinesisApi) over `aws-sdk-kinesis`.

/// Kinesis through the official SDK.
#[derive(Clone, Debug)]
pub struct AwsKinesis {
    client: aws_sdk_kinesis::Client,
}

impl AwsKinesis {
    /// Wraps a client.
    pub fn new(client: aws_sdk_kinesis::Client) -> Self {
        AwsKinesis { client }
    }
}
