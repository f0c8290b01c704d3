//! The message names a `.proto` file declares, in the order of the schema registry's
//! Protobuf message index: enough of the language to check which message a framed
//! record holds, not a `.proto` compiler.

/// Why the message names of a `.proto` text could not be read.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum ProtoFileError {
    /// A `}` closes nothing, or a block is not closed at the end of the text.
    #[error("unbalanced braces in the .proto text")]
    Unbalanced,
    /// A string literal or a block comment is not closed.
    #[error("unterminated string or comment in the .proto text")]
    Unterminated,
}

#[derive(Debug, PartialEq, Eq)]
enum Token<'a> {
    Word(&'a str),
    Punct(char),
    Str,
}

fn tokens(text: &str) -> Result<Vec<Token<'_>>, ProtoFileError> {
    let bytes = text.as_bytes();
    let mut out = Vec::new();
    let mut i = 0;
    while i < bytes.len() {
        let c = bytes[i];
        if c.is_ascii_whitespace() {
            i += 1;
        } else if bytes[i..].starts_with(b"//") {
            while i < bytes.len() && bytes[i] != b'\n' {
                i += 1;
            }
        } else if bytes[i..].starts_with(b"/*") {
            let end = text[i + 2..]
                .find("*/")
                .ok_or(ProtoFileError::Unterminated)?;
            i += 2 + end + 2;
        } else if c == b'"' || c == b'\'' {
            i += 1;
            loop {
                match bytes.get(i) {
                    None => return Err(ProtoFileError::Unterminated),
                    Some(b'\\') => i += 2,
                    Some(&q) if q == c => {
                        i += 1;
                        break;
                    }
                    Some(_) => i += 1,
                }
            }
            out.push(Token::Str);
        } else if c.is_ascii_alphanumeric() || c == b'_' || c == b'.' {
            let start = i;
            while i < bytes.len()
                && (bytes[i].is_ascii_alphanumeric() || bytes[i] == b'_' || bytes[i] == b'.')
            {
                i += 1;
            }
            out.push(Token::Word(&text[start..i]));
        } else {
            // Any other character (UTF-8 included) stands alone; only ASCII ones matter.
            let ch = text[i..].chars().next().unwrap_or('\u{fffd}');
            out.push(Token::Punct(ch));
            i += ch.len_utf8();
        }
    }
    Ok(out)
}

/// The name protoc gives the nested message of a `map` field: the field's name in
/// CamelCase, then `Entry` (`tags_by_id` → `TagsByIdEntry`).
fn map_entry_name(field: &str) -> String {
    let mut out = String::with_capacity(field.len() + 5);
    let mut upper = true;
    for c in field.chars() {
        if c == '_' {
            upper = true;
        } else if upper {
            out.push(c.to_ascii_uppercase());
            upper = false;
        } else {
            out.push(c);
        }
    }
    out.push_str("Entry");
    out
}

/// Every message `proto` declares, nested ones and `map` fields' entry messages included,
/// by full name (`package.Outer.Inner`), sorted as the schema registry's Protobuf message
/// index numbers them: message index `i` is element `i`.
///
/// Reads messages, nested messages, proto2 groups and map fields; skips enums, services,
/// `oneof`, `extend` and option blocks. Messages of imported files are not counted (the
/// registry's index does not count them either).
///
/// ```
/// # use shardflow_middleware::codec::protobuf::message_names;
/// let proto = "package shop; message Order { message Line {} map<string, int32> tags = 1; } message Ack {}";
/// assert_eq!(
///     message_names(proto)?,
///     ["shop.Ack", "shop.Order", "shop.Order.Line", "shop.Order.TagsEntry"],
/// );
/// # Ok::<_, shardflow_middleware::codec::protobuf::ProtoFileError>(())
/// ```
pub fn message_names(proto: &str) -> Result<Vec<String>, ProtoFileError> {
    let tokens = tokens(proto)?;
    let mut package = String::new();
    // Each open block: the message it declares, or None (enum, oneof, service, option...).
    let mut scopes: Vec<Option<String>> = Vec::new();
    let mut names = Vec::new();
    let mut pending: Option<String> = None;
    let full = |scopes: &[Option<String>], package: &str, name: &str| {
        let mut full = String::from(package);
        for scope in scopes.iter().flatten() {
            if !full.is_empty() {
                full.push('.');
            }
            full.push_str(scope);
        }
        if !full.is_empty() {
            full.push('.');
        }
        full.push_str(name);
        full
    };
    let mut i = 0;
    while i < tokens.len() {
        match (&tokens[i], tokens.get(i + 1)) {
            (Token::Word("package"), Some(Token::Word(name))) if scopes.is_empty() => {
                package = (*name).to_owned();
                i += 2;
                continue;
            }
            (Token::Word("message"), Some(Token::Word(name)))
                if tokens.get(i + 2) == Some(&Token::Punct('{')) =>
            {
                pending = Some((*name).to_owned());
                i += 2;
                continue;
            }
            // proto2: `optional group Result = 1 { ... }` declares message `Result`.
            (Token::Word("group"), Some(Token::Word(name)))
                if tokens.get(i + 2) == Some(&Token::Punct('=')) =>
            {
                pending = Some((*name).to_owned());
                i += 2;
                continue;
            }
            // `map<K, V> field = N;` declares message `FieldEntry` in the current one.
            (Token::Word("map"), Some(Token::Punct('<')))
                if scopes.iter().flatten().next().is_some() =>
            {
                let close = tokens[i..].iter().position(|t| *t == Token::Punct('>'));
                if let Some(close) = close {
                    if let Some(Token::Word(field)) = tokens.get(i + close + 1) {
                        let entry = map_entry_name(field);
                        names.push(full(&scopes, &package, &entry));
                    }
                    i += close + 1;
                    continue;
                }
            }
            (Token::Punct('{'), _) => {
                let scope = pending.take();
                if let Some(name) = &scope {
                    names.push(full(&scopes, &package, name));
                }
                scopes.push(scope);
            }
            (Token::Punct('}'), _) => {
                scopes.pop().ok_or(ProtoFileError::Unbalanced)?;
            }
            (Token::Punct(';'), _) => pending = None,
            _ => {}
        }
        i += 1;
    }
    if !scopes.is_empty() {
        return Err(ProtoFileError::Unbalanced);
    }
    names.sort();
    Ok(names)
}

/// The message index of message `full_name` (`package.Message`) in `proto`: where the
/// schema registry's Protobuf framing numbers it ([`message_names`]); `None` when the file
/// does not declare it. What to give
/// [`SchemaRegistryEncoder::message_index`](crate::schema_registry::SchemaRegistryEncoder::message_index).
pub fn message_index(proto: &str, full_name: &str) -> Result<Option<u32>, ProtoFileError> {
    let names = message_names(proto)?;
    Ok(names
        .iter()
        .position(|n| n == full_name)
        .and_then(|i| u32::try_from(i).ok()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nested_messages_sorted_by_full_name_as_the_reference_numbers_them() {
        // The framing module's example: B 0, B.A 1, B.A.D 2, B.C 3.
        let proto = "syntax = \"proto3\";\nmessage B { message C {} message A { message D {} } }";
        assert_eq!(message_names(proto).unwrap(), ["B", "B.A", "B.A.D", "B.C"]);
        assert_eq!(message_index(proto, "B.A.D").unwrap(), Some(2));
        assert_eq!(message_index(proto, "Z").unwrap(), None);
    }

    #[test]
    fn packages_maps_groups_and_other_blocks() {
        let proto = r#"
            syntax = "proto2";
            package acme.shop; // the shop
            import "google/protobuf/timestamp.proto";
            option java_package = "com.acme { not a block }";
            /* message Commented { } */
            enum Kind { KIND_UNSPECIFIED = 0; }
            service Orders { rpc Get (Order) returns (Order) { option deprecated = true; } }
            message Order {
              optional string message = 1;
              map<string, Line> lines_by_sku = 2;
              oneof payment { string card = 3; string iban = 4; }
              optional group Extra = 5 { optional int32 n = 1; }
              message Line { optional int64 qty = 1 [default = 1]; }
              enum State { NEW = 0; }
            }
            extend Order { optional string note = 100; }
        "#;
        assert_eq!(
            message_names(proto).unwrap(),
            [
                "acme.shop.Order",
                "acme.shop.Order.Extra",
                "acme.shop.Order.Line",
                "acme.shop.Order.LinesBySkuEntry",
            ]
        );
    }

    #[test]
    fn broken_text_is_a_typed_error() {
        assert_eq!(
            message_names("message A {"),
            Err(ProtoFileError::Unbalanced)
        );
        assert_eq!(message_names("}"), Err(ProtoFileError::Unbalanced));
        assert_eq!(
            message_names("message A { string s = 1 [default = \"x]; }"),
            Err(ProtoFileError::Unterminated)
        );
        assert_eq!(message_names("/* open"), Err(ProtoFileError::Unterminated));
        assert_eq!(message_names("").unwrap(), Vec::<String>::new());
    }
}
