//! One change of a table, as a message read from its stream carries it: the record's JSON
//! form (the DynamoDB Streams API's, which Lambda and the KCL's DynamoDB Streams adapter
//! also hand to their handlers), read into [`ChangeRecord`], with the item images decoded
//! into the application's types through `serde_dynamo`.

use std::collections::{BTreeMap, HashMap};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use bytes::Bytes;
use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};

/// What happened to the item.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "UPPERCASE")]
pub enum EventName {
    /// A new item was written.
    Insert,
    /// An existing item was changed.
    Modify,
    /// An item was deleted (by a user or by TTL).
    Remove,
}

/// Which images the table's stream records (its `StreamViewType`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "SCREAMING_SNAKE_CASE")]
pub enum StreamViewType {
    /// Only the item's key attributes.
    KeysOnly,
    /// The item as it is after the change.
    NewImage,
    /// The item as it was before the change.
    OldImage,
    /// Both.
    NewAndOldImages,
}

impl StreamViewType {
    /// Whether records of this view carry the new image.
    pub fn has_new_image(self) -> bool {
        matches!(
            self,
            StreamViewType::NewImage | StreamViewType::NewAndOldImages
        )
    }

    /// Whether records of this view carry the old image.
    pub fn has_old_image(self) -> bool {
        matches!(
            self,
            StreamViewType::OldImage | StreamViewType::NewAndOldImages
        )
    }
}

/// An attribute value in DynamoDB's JSON form (`{"S": "text"}`, `{"N": "12.5"}`, binary
/// as base64, ...).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum AttributeValue {
    /// A string.
    S(String),
    /// A number, as its decimal text.
    N(String),
    /// Binary data (base64 in the JSON form).
    B(#[serde(with = "base64_bytes")] Vec<u8>),
    /// A boolean.
    #[serde(rename = "BOOL")]
    Bool(bool),
    /// Null (always `true`).
    #[serde(rename = "NULL")]
    Null(bool),
    /// A map of attributes.
    M(BTreeMap<String, AttributeValue>),
    /// A list of attributes.
    L(Vec<AttributeValue>),
    /// A set of strings.
    #[serde(rename = "SS")]
    Ss(Vec<String>),
    /// A set of numbers.
    #[serde(rename = "NS")]
    Ns(Vec<String>),
    /// A set of binary values (each base64 in the JSON form).
    #[serde(rename = "BS")]
    Bs(#[serde(with = "base64_list")] Vec<Vec<u8>>),
}

/// An item or its keys: attribute name to value, in name order (so the JSON form and the
/// partition key derived from keys do not depend on the order the service listed them).
pub type Image = BTreeMap<String, AttributeValue>;

/// The change itself: the `dynamodb` part of a stream record.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "PascalCase")]
pub struct StreamRecord {
    /// When the change was made, in seconds since the Unix epoch (approximate; the
    /// service rounds it down to the second or the millisecond).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub approximate_creation_date_time: Option<f64>,
    /// The item's key attributes (partition key, and sort key if the table has one).
    pub keys: Image,
    /// The item after the change, if the view records it (not on `REMOVE`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub new_image: Option<Image>,
    /// The item before the change, if the view records it (not on `INSERT`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub old_image: Option<Image>,
    /// The record's sequence number in its shard (decimal).
    pub sequence_number: String,
    /// The size of the record's stream data, in bytes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub size_bytes: Option<u64>,
    /// Which images the stream records.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stream_view_type: Option<StreamViewType>,
}

/// Who made the change, when it was not an application's write: DynamoDB's TTL deletes
/// carry `{"type": "Service", "principalId": "dynamodb.amazonaws.com"}`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct UserIdentity {
    /// `Service`.
    #[serde(rename = "type")]
    pub kind: String,
    /// `dynamodb.amazonaws.com`.
    #[serde(rename = "principalId")]
    pub principal_id: String,
}

/// One change of a table, as the payload of a message read from its stream.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ChangeRecord {
    /// A unique id of the change.
    #[serde(rename = "eventID")]
    pub event_id: String,
    /// What happened to the item.
    #[serde(rename = "eventName")]
    pub event_name: EventName,
    /// The record format's version (`1.1`).
    #[serde(
        rename = "eventVersion",
        default,
        skip_serializing_if = "Option::is_none"
    )]
    pub event_version: Option<String>,
    /// `aws:dynamodb`.
    #[serde(
        rename = "eventSource",
        default,
        skip_serializing_if = "Option::is_none"
    )]
    pub event_source: Option<String>,
    /// The table's region.
    #[serde(rename = "awsRegion", default, skip_serializing_if = "Option::is_none")]
    pub aws_region: Option<String>,
    /// The change.
    pub dynamodb: StreamRecord,
    /// Set when the service made the change (a TTL delete).
    #[serde(
        rename = "userIdentity",
        default,
        skip_serializing_if = "Option::is_none"
    )]
    pub user_identity: Option<UserIdentity>,
}

/// Why a payload is not a change record, or an image does not decode into a type.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ChangeRecordError {
    /// The payload is not a change record's JSON form.
    #[error("not a DynamoDB Streams change record: {0}")]
    Json(#[from] serde_json::Error),
    /// An image (or the keys) did not decode into the requested type.
    #[error("the {part} of the change does not decode: {source}")]
    Image {
        /// `keys`, `new image` or `old image`.
        part: &'static str,
        /// What serde_dynamo said.
        source: serde_dynamo::Error,
    },
}

impl ChangeRecord {
    /// Reads a change from a message's payload.
    pub fn from_payload(payload: &[u8]) -> Result<Self, ChangeRecordError> {
        Ok(serde_json::from_slice(payload)?)
    }

    /// The change's JSON form, as a message read from a table's stream carries it.
    pub fn to_payload(&self) -> Bytes {
        // Serializing plain data (strings, numbers, maps with string keys) cannot fail.
        Bytes::from(serde_json::to_vec(self).expect("a change record always serializes"))
    }

    /// The partition key a message of this change carries: derived from the item's keys
    /// (see [`partition_key_of`]).
    pub fn partition_key(&self) -> String {
        partition_key_of(&self.dynamodb.keys)
    }

    /// When the change was made (approximate), if the record says.
    pub fn approximate_creation_time(&self) -> Option<SystemTime> {
        let secs = self.dynamodb.approximate_creation_date_time?;
        if !secs.is_finite() || secs < 0.0 {
            return None;
        }
        UNIX_EPOCH.checked_add(Duration::from_secs_f64(secs))
    }

    /// The item's keys decoded into `T`.
    pub fn keys_as<T: DeserializeOwned>(&self) -> Result<T, ChangeRecordError> {
        decode_image("keys", &self.dynamodb.keys)
    }

    /// The item after the change decoded into `T`; `None` when the record has no new
    /// image (a `REMOVE`, or a view without new images).
    pub fn new_image_as<T: DeserializeOwned>(&self) -> Result<Option<T>, ChangeRecordError> {
        self.dynamodb
            .new_image
            .as_ref()
            .map(|image| decode_image("new image", image))
            .transpose()
    }

    /// The item before the change decoded into `T`; `None` when the record has no old
    /// image (an `INSERT`, or a view without old images).
    pub fn old_image_as<T: DeserializeOwned>(&self) -> Result<Option<T>, ChangeRecordError> {
        self.dynamodb
            .old_image
            .as_ref()
            .map(|image| decode_image("old image", image))
            .transpose()
    }
}

/// The partition key of a change: the item's key attributes in DynamoDB's JSON form,
/// attribute names in order, e.g. `{"pk":{"S":"order-7"},"sk":{"N":"3"}}`. Two changes of
/// the same item have the same key, whatever their shard.
///
/// A number is written in its canonical form (see [`canonical_number`]), as DynamoDB
/// stores it: `{"N":"1.0"}` and `{"N":"1"}` are the same key, so they are the same
/// partition key.
pub fn partition_key_of(keys: &Image) -> String {
    let canonical: Image = keys
        .iter()
        .map(|(name, value)| {
            let value = match value {
                AttributeValue::N(n) => AttributeValue::N(canonical_number(n)),
                other => other.clone(),
            };
            (name.clone(), value)
        })
        .collect();
    // A map of strings to plain values always serializes.
    serde_json::to_string(&canonical).expect("keys always serialize")
}

/// A DynamoDB number in the form DynamoDB stores and returns it: no sign for a positive
/// value, no leading zeros, no trailing zeros after the decimal point, no exponent
/// (`"+01.50"`, `"1.5E0"` and `"15e-1"` are all `"1.5"`; `"-0.0"` is `"0"`). Text that is
/// not a number is returned as it is.
pub fn canonical_number(text: &str) -> String {
    canonical(text.trim()).unwrap_or_else(|| text.to_owned())
}

fn canonical(text: &str) -> Option<String> {
    let (negative, unsigned) = match text.as_bytes().first()? {
        b'-' => (true, &text[1..]),
        b'+' => (false, &text[1..]),
        _ => (false, text),
    };
    let (mantissa, exponent) = match unsigned.find(['e', 'E']) {
        Some(at) => (&unsigned[..at], unsigned[at + 1..].parse::<i64>().ok()?),
        None => (unsigned, 0),
    };
    let (whole, fraction) = mantissa.split_once('.').unwrap_or((mantissa, ""));
    if (whole.is_empty() && fraction.is_empty())
        || !whole.bytes().chain(fraction.bytes()).all(|b| b.is_ascii_digit())
        // DynamoDB's numbers stay within 10^-130..10^126: anything far beyond is not one.
        || exponent.unsigned_abs() > 1_000
    {
        return None;
    }
    // All the digits, and where the decimal point goes among them.
    let digits: String = format!("{whole}{fraction}");
    let point = whole.len() as i64 + exponent;
    let first = digits.find(|c| c != '0');
    let Some(first) = first else {
        return Some("0".to_owned());
    };
    let last = digits.rfind(|c| c != '0').unwrap_or(first);
    let significant = &digits[first..=last];
    // The position of the point relative to the first significant digit.
    let point = point - first as i64;
    let len = significant.len() as i64;
    let mut out = String::with_capacity(significant.len() + 8);
    if negative {
        out.push('-');
    }
    if point <= 0 {
        out.push_str("0.");
        out.extend(std::iter::repeat_n('0', point.unsigned_abs() as usize));
        out.push_str(significant);
    } else if point >= len {
        out.push_str(significant);
        out.extend(std::iter::repeat_n('0', (point - len) as usize));
    } else {
        out.push_str(&significant[..point as usize]);
        out.push('.');
        out.push_str(&significant[point as usize..]);
    }
    Some(out)
}

/// `value` as an image, through `serde_dynamo` (for writing items in tests and the
/// embedded backend).
pub fn image_of<T: Serialize>(value: &T) -> Result<Image, serde_dynamo::Error> {
    let item: serde_dynamo::Item = serde_dynamo::to_item(value)?;
    Ok(item
        .into_inner()
        .into_iter()
        .map(|(name, value)| (name, AttributeValue::from(value)))
        .collect())
}

fn decode_image<T: DeserializeOwned>(
    part: &'static str,
    image: &Image,
) -> Result<T, ChangeRecordError> {
    let item: HashMap<String, serde_dynamo::AttributeValue> = image
        .iter()
        .map(|(name, value)| (name.clone(), value.clone().into()))
        .collect();
    serde_dynamo::from_item(item).map_err(|source| ChangeRecordError::Image { part, source })
}

impl From<AttributeValue> for serde_dynamo::AttributeValue {
    fn from(value: AttributeValue) -> Self {
        use serde_dynamo::AttributeValue as D;
        match value {
            AttributeValue::S(s) => D::S(s),
            AttributeValue::N(n) => D::N(n),
            AttributeValue::B(b) => D::B(b),
            AttributeValue::Bool(b) => D::Bool(b),
            AttributeValue::Null(b) => D::Null(b),
            AttributeValue::M(m) => D::M(m.into_iter().map(|(k, v)| (k, v.into())).collect()),
            AttributeValue::L(l) => D::L(l.into_iter().map(Into::into).collect()),
            AttributeValue::Ss(s) => D::Ss(s),
            AttributeValue::Ns(n) => D::Ns(n),
            AttributeValue::Bs(b) => D::Bs(b),
        }
    }
}

impl From<serde_dynamo::AttributeValue> for AttributeValue {
    fn from(value: serde_dynamo::AttributeValue) -> Self {
        use serde_dynamo::AttributeValue as D;
        match value {
            D::S(s) => AttributeValue::S(s),
            D::N(n) => AttributeValue::N(n),
            D::B(b) => AttributeValue::B(b),
            D::Bool(b) => AttributeValue::Bool(b),
            D::Null(b) => AttributeValue::Null(b),
            D::M(m) => AttributeValue::M(m.into_iter().map(|(k, v)| (k, v.into())).collect()),
            D::L(l) => AttributeValue::L(l.into_iter().map(Into::into).collect()),
            D::Ss(s) => AttributeValue::Ss(s),
            D::Ns(n) => AttributeValue::Ns(n),
            D::Bs(b) => AttributeValue::Bs(b),
        }
    }
}

const BASE64: base64::engine::GeneralPurpose = base64::engine::general_purpose::STANDARD;

mod base64_bytes {
    use super::BASE64;
    use base64::Engine;
    use serde::{Deserialize, Deserializer, Serializer};

    pub fn serialize<S: Serializer>(bytes: &[u8], s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&BASE64.encode(bytes))
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Vec<u8>, D::Error> {
        let text = String::deserialize(d)?;
        BASE64.decode(text).map_err(serde::de::Error::custom)
    }
}

mod base64_list {
    use super::BASE64;
    use base64::Engine;
    use serde::ser::SerializeSeq;
    use serde::{Deserialize, Deserializer, Serializer};

    pub fn serialize<S: Serializer>(values: &[Vec<u8>], s: S) -> Result<S::Ok, S::Error> {
        let mut seq = s.serialize_seq(Some(values.len()))?;
        for value in values {
            seq.serialize_element(&BASE64.encode(value))?;
        }
        seq.end()
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Vec<Vec<u8>>, D::Error> {
        Vec::<String>::deserialize(d)?
            .into_iter()
            .map(|text| BASE64.decode(text).map_err(serde::de::Error::custom))
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A MODIFY record as the DynamoDB Streams API's documentation shows one (and Lambda
    /// delivers it), with a binary attribute and a set added.
    const MODIFY: &str = r#"{
        "eventID": "c81e728d9d4c2f636f067f89cc14862c",
        "eventName": "MODIFY",
        "eventVersion": "1.1",
        "eventSource": "aws:dynamodb",
        "awsRegion": "us-east-1",
        "dynamodb": {
            "ApproximateCreationDateTime": 1479499740,
            "Keys": {"Id": {"N": "101"}, "Sort": {"S": "a"}},
            "NewImage": {"Id": {"N": "101"}, "Sort": {"S": "a"}, "Message": {"S": "This item has changed"},
                         "Blob": {"B": "AAEC"}, "Tags": {"SS": ["x", "y"]}},
            "OldImage": {"Id": {"N": "101"}, "Sort": {"S": "a"}, "Message": {"S": "New item!"}},
            "SequenceNumber": "222",
            "SizeBytes": 59,
            "StreamViewType": "NEW_AND_OLD_IMAGES"
        }
    }"#;

    #[derive(Debug, PartialEq, Deserialize, Serialize)]
    struct Item {
        #[serde(rename = "Id")]
        id: u64,
        #[serde(rename = "Sort")]
        sort: String,
        #[serde(rename = "Message")]
        message: String,
    }

    #[test]
    fn a_documented_record_reads_and_its_images_decode_into_a_type() {
        let record = ChangeRecord::from_payload(MODIFY.as_bytes()).unwrap();
        assert_eq!(record.event_name, EventName::Modify);
        assert_eq!(record.dynamodb.sequence_number, "222");
        assert_eq!(
            record.dynamodb.stream_view_type,
            Some(StreamViewType::NewAndOldImages)
        );
        let new: Item = record.new_image_as().unwrap().unwrap();
        assert_eq!(new.message, "This item has changed");
        let old: Item = record.old_image_as().unwrap().unwrap();
        assert_eq!((old.id, old.message.as_str()), (101, "New item!"));
        let image = record.dynamodb.new_image.as_ref().unwrap();
        assert_eq!(image["Blob"], AttributeValue::B(vec![0, 1, 2]));
        assert_eq!(
            image["Tags"],
            AttributeValue::Ss(vec!["x".into(), "y".into()])
        );
        assert_eq!(
            record.approximate_creation_time(),
            Some(UNIX_EPOCH + Duration::from_secs(1_479_499_740))
        );
    }

    #[test]
    fn the_json_form_reads_back_to_the_same_record() {
        let record = ChangeRecord::from_payload(MODIFY.as_bytes()).unwrap();
        let again = ChangeRecord::from_payload(&record.to_payload()).unwrap();
        assert_eq!(again, record);
    }

    #[test]
    fn the_partition_key_depends_on_the_keys_only_not_their_order() {
        let record = ChangeRecord::from_payload(MODIFY.as_bytes()).unwrap();
        assert_eq!(
            record.partition_key(),
            r#"{"Id":{"N":"101"},"Sort":{"S":"a"}}"#
        );
        let reordered = MODIFY.replace(
            r#""Keys": {"Id": {"N": "101"}, "Sort": {"S": "a"}}"#,
            r#""Keys": {"Sort": {"S": "a"}, "Id": {"N": "101"}}"#,
        );
        assert_ne!(reordered, MODIFY);
        let other = ChangeRecord::from_payload(reordered.as_bytes()).unwrap();
        assert_eq!(other.partition_key(), record.partition_key());
    }

    #[test]
    fn a_number_key_written_in_two_forms_is_one_partition_key() {
        let key = |n: &str| {
            let mut keys = Image::new();
            keys.insert("Id".to_owned(), AttributeValue::N(n.to_owned()));
            keys.insert("Sort".to_owned(), AttributeValue::S("a".to_owned()));
            partition_key_of(&keys)
        };
        for same in ["1.0", "01", "+1", "1E0", "10e-1", "1.000", "0.1e1"] {
            assert_eq!(key(same), key("1"), "{same} is the number 1");
        }
        assert_eq!(key("1"), r#"{"Id":{"N":"1"},"Sort":{"S":"a"}}"#);
        assert_ne!(key("1.5"), key("1"));
        assert_ne!(key("-1"), key("1"));
        assert_eq!(key("-0.0"), key("0"));
    }

    #[test]
    fn numbers_take_the_form_dynamodb_stores() {
        for (given, stored) in [
            ("1", "1"),
            ("-12.50", "-12.5"),
            ("0.000", "0"),
            ("1.5e3", "1500"),
            ("1.5E-3", "0.0015"),
            (
                "00012345678901234567890123456789012345678",
                "12345678901234567890123456789012345678",
            ),
            ("0.0100", "0.01"),
            ("100", "100"),
            ("-0", "0"),
            ("abc", "abc"),
            ("1e99999999999", "1e99999999999"),
            ("", ""),
            (".", "."),
            (".5", "0.5"),
        ] {
            assert_eq!(canonical_number(given), stored, "{given}");
        }
    }

    #[test]
    fn an_image_that_does_not_fit_the_type_is_an_error_naming_the_part() {
        #[derive(Debug, Deserialize)]
        #[allow(dead_code)]
        struct Wrong {
            #[serde(rename = "Message")]
            message: u64,
        }
        let record = ChangeRecord::from_payload(MODIFY.as_bytes()).unwrap();
        let err = record.new_image_as::<Wrong>().unwrap_err();
        assert!(
            err.to_string().starts_with("the new image of the change"),
            "{err}"
        );
        assert!(ChangeRecord::from_payload(b"{\"eventName\":\"UPSERT\"}").is_err());
    }

    #[test]
    fn a_value_becomes_an_image_and_back() {
        let item = Item {
            id: 7,
            sort: "b".into(),
            message: "hi".into(),
        };
        let image = image_of(&item).unwrap();
        assert_eq!(image["Id"], AttributeValue::N("7".into()));
        let record = ChangeRecord {
            event_id: "1".into(),
            event_name: EventName::Insert,
            event_version: None,
            event_source: None,
            aws_region: None,
            dynamodb: StreamRecord {
                approximate_creation_date_time: None,
                keys: image.clone(),
                new_image: Some(image),
                old_image: None,
                sequence_number: "1".into(),
                size_bytes: None,
                stream_view_type: Some(StreamViewType::NewImage),
            },
            user_identity: None,
        };
        assert_eq!(record.new_image_as::<Item>().unwrap(), Some(item));
        assert_eq!(record.old_image_as::<Item>().unwrap(), None);
    }
}
