//! The KCL's lease-table rows of `tests/fixtures/kcl/`, in DynamoDB JSON, as the SDK's
//! items.

use std::collections::HashMap;

use aws_sdk_dynamodb::types::AttributeValue;

/// A DynamoDB-JSON value (`{"S": ".."}`, `{"N": ".."}`, `{"SS": [..]}`, `{"L": [..]}`,
/// `{"M": {..}}`).
pub fn attribute_from_json(typed: &serde_json::Value) -> AttributeValue {
    let (kind, v) = typed
        .as_object()
        .and_then(|o| o.iter().next())
        .unwrap_or_else(|| panic!("not a typed value: {typed}"));
    match kind.as_str() {
        "S" => AttributeValue::S(v.as_str().unwrap().to_owned()),
        "N" => AttributeValue::N(v.as_str().unwrap().to_owned()),
        "SS" => AttributeValue::Ss(
            v.as_array()
                .unwrap()
                .iter()
                .map(|s| s.as_str().unwrap().to_owned())
                .collect(),
        ),
        "L" => AttributeValue::L(
            v.as_array()
                .unwrap()
                .iter()
                .map(attribute_from_json)
                .collect(),
        ),
        "M" => AttributeValue::M(
            v.as_object()
                .unwrap()
                .iter()
                .map(|(k, x)| (k.clone(), attribute_from_json(x)))
                .collect(),
        ),
        other => panic!("type {other} is not in the fixtures"),
    }
}

/// The row of `tests/fixtures/kcl/<name>`.
pub fn kcl_fixture(name: &str) -> HashMap<String, AttributeValue> {
    let path = format!(
        "{}/../tests/fixtures/kcl/{name}",
        env!("CARGO_MANIFEST_DIR")
    );
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{path}: {e}"));
    let json: serde_json::Value = serde_json::from_str(&text).unwrap();
    json.as_object()
        .unwrap()
        .iter()
        .map(|(k, v)| (k.clone(), attribute_from_json(v)))
        .collect()
}
