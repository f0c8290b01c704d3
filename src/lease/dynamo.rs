//! [`LeaseStore`](super::LeaseStore) over `aws-sdk-dynamodb`.

/// Leases in a DynamoDB table.
#[derive(Clone, Debug)]
pub struct DynamoLeaseStore {
    client: aws_sdk_dynamodb::Client,
    table: String,
}

impl DynamoLeaseStore {
    /// A store over `table`.
    pub fn new(client: aws_sdk_dynamodb::Client, table: &str) -> Self {
        DynamoLeaseStore { client, table: table.to_owned() }
    }
}
