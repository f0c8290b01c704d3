//! Errors every part shares: a refused configuration (consumer, producer, backend
//! builders), and what a failed remote call carries besides its text (the AWS error
//! code, message and HTTP status, kept as the error's `source()` so callers can match
//! AWS error codes).

use std::fmt;

/// A configuration value a builder refused (consumer, producer, backend), naming the
/// builder method that sets it.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum ConfigError {
    /// A required field was not set.
    #[error("`{field}` is required")]
    Missing {
        /// The builder method that sets it.
        field: &'static str,
    },
    /// A field has a value that cannot work.
    #[error("`{field}` is invalid: {reason}")]
    Invalid {
        /// The builder method that sets it.
        field: &'static str,
        /// Why the value was refused.
        reason: String,
    },
}

/// What AWS answered to a failed call: the `source()` of a
/// [`KinesisError`](crate::kinesis::KinesisError) or [`LeaseError`](crate::lease::LeaseError)
/// that came from the AWS SDK.
///
/// It keeps what identifies the failure and never a response body (a GetRecords answer
/// that failed to parse holds record payloads, which must not reach a log), so it is
/// not the SDK's own error type.
///
/// ```
/// # use shardflow::kinesis::KinesisError;
/// # use shardflow::AwsError;
/// fn is_kms_denied(e: &KinesisError) -> bool {
///     std::error::Error::source(e)
///         .and_then(|s| s.downcast_ref::<AwsError>())
///         .is_some_and(|aws| aws.code.as_deref() == Some("KMSAccessDeniedException"))
/// }
/// # assert!(!is_kms_denied(&KinesisError::Other("no".into())));
/// ```
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct AwsError {
    /// The call (`GetRecords`, `UpdateItem`, ...).
    pub operation: String,
    /// The AWS error code (`ProvisionedThroughputExceededException`, ...), when the
    /// service answered with one.
    pub code: Option<String>,
    /// The service's message, when it sent one.
    pub message: Option<String>,
    /// The HTTP status, when an answer came.
    pub status: Option<u16>,
}

impl AwsError {
    /// What AWS answered to `operation`.
    pub fn new(
        operation: impl Into<String>,
        code: Option<String>,
        message: Option<String>,
        status: Option<u16>,
    ) -> Self {
        AwsError {
            operation: operation.into(),
            code,
            message,
            status,
        }
    }
}

impl fmt::Display for AwsError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.operation)?;
        if let Some(code) = &self.code {
            write!(f, ": {code}")?;
        }
        if let Some(message) = &self.message {
            write!(f, ": {message}")?;
        }
        if let Some(status) = self.status {
            write!(f, " (HTTP {status})")?;
        }
        Ok(())
    }
}

impl std::error::Error for AwsError {}

/// The text of a failure and, when it came from AWS, what AWS answered (see
/// [`AwsError`]). Displays as its text.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ErrorDetail {
    text: String,
    aws: Option<AwsError>,
}

impl ErrorDetail {
    /// A failure described by `text` alone.
    pub fn new(text: impl Into<String>) -> Self {
        ErrorDetail {
            text: text.into(),
            aws: None,
        }
    }

    /// `text`, and what AWS answered.
    pub fn from_aws(text: impl Into<String>, aws: AwsError) -> Self {
        ErrorDetail {
            text: text.into(),
            aws: Some(aws),
        }
    }

    /// The text.
    pub fn as_str(&self) -> &str {
        &self.text
    }

    /// What AWS answered, when the failure came from an AWS call.
    pub fn aws(&self) -> Option<&AwsError> {
        self.aws.as_ref()
    }

    /// The source an error holding this detail reports.
    pub(crate) fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        self.aws
            .as_ref()
            .map(|a| a as &(dyn std::error::Error + 'static))
    }
}

impl fmt::Display for ErrorDetail {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.text)
    }
}

impl From<String> for ErrorDetail {
    fn from(text: String) -> Self {
        ErrorDetail::new(text)
    }
}

impl From<&str> for ErrorDetail {
    fn from(text: &str) -> Self {
        ErrorDetail::new(text)
    }
}
