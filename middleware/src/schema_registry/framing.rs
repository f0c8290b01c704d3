//! The AWS Glue Schema Registry's wire format: an 18-byte header, then the payload.
//!
//! | bytes | what |
//! |---|---|
//! | 0 | header version, always [`HEADER_VERSION`] (`0x03`) |
//! | 1 | compression: [`COMPRESSION_NONE`] (`0x00`) or [`COMPRESSION_ZLIB`] (`0x05`) |
//! | 2..18 | the schema version id, a UUID, most significant byte first |
//! | 18.. | the payload, zlib-compressed (RFC 1950, a zlib header and checksum) when byte 1 says so |
//!
//! For Protobuf the (decompressed) payload starts with the message index: which message of
//! the schema's `.proto` the record holds, as an unsigned varint (protobuf's `uint32`
//! wire encoding), then the message's own bytes. The index counts every message of the
//! file, nested ones included, sorted by full name (see [`read_message_index`]).

use std::io::{Read, Write};

use bytes::{BufMut, Bytes, BytesMut};
use uuid::Uuid;

/// The header version byte the framing starts with.
pub const HEADER_VERSION: u8 = 3;
/// The compression byte of an uncompressed payload.
pub const COMPRESSION_NONE: u8 = 0;
/// The compression byte of a zlib-compressed payload.
pub const COMPRESSION_ZLIB: u8 = 5;
/// The header's length: version, compression, 16-byte schema version id.
pub const HEADER_LEN: usize = 18;
/// The largest payload a zlib payload may inflate to (64 MiB, far above a Kinesis
/// record's size): a larger one is refused as [`FramingError::TooLarge`] instead of
/// filling memory.
pub const MAX_INFLATED_LEN: usize = 64 * 1024 * 1024;

/// How the payload after the header is compressed.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Compression {
    /// As written ([`COMPRESSION_NONE`]).
    #[default]
    None,
    /// zlib ([`COMPRESSION_ZLIB`]).
    Zlib,
}

impl Compression {
    /// The header byte.
    pub fn byte(self) -> u8 {
        match self {
            Compression::None => COMPRESSION_NONE,
            Compression::Zlib => COMPRESSION_ZLIB,
        }
    }
}

/// A framed record: the schema version it names and its payload, decompressed.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Frame {
    /// The schema version id (Glue's `SchemaVersionId`).
    pub schema_version: Uuid,
    /// How the payload was compressed on the wire.
    pub compression: Compression,
    /// The payload, decompressed.
    pub payload: Bytes,
}

/// Why bytes are not a valid framed record, or could not be framed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum FramingError {
    /// The first byte is not [`HEADER_VERSION`].
    #[error("header version byte is {0:#04x}, expected 0x03")]
    UnknownVersion(u8),
    /// The compression byte is neither [`COMPRESSION_NONE`] nor [`COMPRESSION_ZLIB`].
    #[error("compression byte is {0:#04x}, expected 0x00 (none) or 0x05 (zlib)")]
    UnknownCompression(u8),
    /// Fewer bytes than the 18-byte header.
    #[error("{0} bytes are shorter than the 18-byte header")]
    Truncated(usize),
    /// The zlib payload did not inflate (or, when writing, deflate).
    #[error("zlib payload is invalid: {0}")]
    Zlib(#[source] std::io::Error),
    /// The zlib payload inflates past [`MAX_INFLATED_LEN`].
    #[error("zlib payload inflates past {MAX_INFLATED_LEN} bytes")]
    TooLarge,
    /// The Protobuf message index is missing or not a valid varint.
    #[error("Protobuf message index is missing or not a valid varint")]
    MessageIndex,
}

/// Whether `bytes` start like a framed record: at least a header's length, starting with
/// [`HEADER_VERSION`]. Other bytes are not framed (plain JSON starts with `{`, `[` or a
/// space; plain Avro or Protobuf may start with `0x03` too, which is why a stream should
/// not mix unframed binary records with framed ones).
pub fn is_framed(bytes: &[u8]) -> bool {
    bytes.len() >= HEADER_LEN && bytes[0] == HEADER_VERSION
}

/// Reads a framed record, inflating a zlib payload.
pub fn parse(bytes: &Bytes) -> Result<Frame, FramingError> {
    if bytes.len() < HEADER_LEN {
        // The version byte is the more useful complaint when there is one and it is wrong.
        return match bytes.first() {
            Some(&v) if v != HEADER_VERSION => Err(FramingError::UnknownVersion(v)),
            _ => Err(FramingError::Truncated(bytes.len())),
        };
    }
    if bytes[0] != HEADER_VERSION {
        return Err(FramingError::UnknownVersion(bytes[0]));
    }
    let compression = match bytes[1] {
        COMPRESSION_NONE => Compression::None,
        COMPRESSION_ZLIB => Compression::Zlib,
        other => return Err(FramingError::UnknownCompression(other)),
    };
    let mut id = [0u8; 16];
    id.copy_from_slice(&bytes[2..HEADER_LEN]);
    let body = bytes.slice(HEADER_LEN..);
    let payload = match compression {
        Compression::None => body,
        Compression::Zlib => inflate(&body)?,
    };
    Ok(Frame {
        schema_version: Uuid::from_bytes(id),
        compression,
        payload,
    })
}

/// Frames `payload` (the format's bytes, a Protobuf message index included) for
/// `schema_version`, compressing it when asked.
pub fn write(
    schema_version: Uuid,
    compression: Compression,
    payload: &[u8],
) -> Result<Bytes, FramingError> {
    let mut out = BytesMut::with_capacity(HEADER_LEN + payload.len());
    out.put_u8(HEADER_VERSION);
    out.put_u8(compression.byte());
    out.put_slice(schema_version.as_bytes());
    match compression {
        Compression::None => out.put_slice(payload),
        Compression::Zlib => {
            let mut encoder = flate2::write::ZlibEncoder::new(
                (&mut out).writer(),
                flate2::Compression::default(),
            );
            encoder.write_all(payload).map_err(FramingError::Zlib)?;
            encoder.finish().map_err(FramingError::Zlib)?;
        }
    }
    Ok(out.freeze())
}

fn inflate(body: &[u8]) -> Result<Bytes, FramingError> {
    let limit = MAX_INFLATED_LEN as u64 + 1;
    let mut out = Vec::with_capacity(body.len().saturating_mul(4).min(MAX_INFLATED_LEN));
    flate2::read::ZlibDecoder::new(body)
        .take(limit)
        .read_to_end(&mut out)
        .map_err(FramingError::Zlib)?;
    if out.len() > MAX_INFLATED_LEN {
        return Err(FramingError::TooLarge);
    }
    Ok(Bytes::from(out))
}

/// Splits a Protobuf payload into its message index and the message's bytes.
///
/// The index says which message of the writer's `.proto` file the record holds: all the
/// file's messages, nested ones included, sorted by full name, numbered from 0 (for
/// `message B { message C {} message A { message D {} } }`: `B` 0, `B.A` 1, `B.A.D` 2,
/// `B.C` 3). A file with one message writes 0.
pub fn read_message_index(payload: &Bytes) -> Result<(u32, Bytes), FramingError> {
    let mut value: u64 = 0;
    for (i, &byte) in payload.iter().enumerate().take(10) {
        value |= u64::from(byte & 0x7f) << (7 * i);
        if byte & 0x80 == 0 {
            // protobuf's readUInt32 keeps the low 32 bits of a longer varint.
            return Ok((value as u32, payload.slice(i + 1..)));
        }
    }
    Err(FramingError::MessageIndex)
}

/// Writes `index` as the varint that [`read_message_index`] reads, then `message`.
pub fn write_message_index(index: u32, message: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(5 + message.len());
    let mut v = index;
    while v >= 0x80 {
        out.push((v as u8 & 0x7f) | 0x80);
        v >>= 7;
    }
    out.push(v as u8);
    out.extend_from_slice(message);
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    const ID: &str = "b7b4a7f0-9c96-4e4b-a687-f5e4a9bd1a23";

    /// The layout spelled out byte by byte, as the reference's encoder writes it: version
    /// 3, compression 0, the UUID's most then least significant 64 bits big-endian, data.
    fn hand_framed(compression: u8, data: &[u8]) -> Vec<u8> {
        let id = Uuid::parse_str(ID).unwrap();
        let (msb, lsb) = id.as_u64_pair();
        let mut v = vec![3, compression];
        v.extend_from_slice(&msb.to_be_bytes());
        v.extend_from_slice(&lsb.to_be_bytes());
        v.extend_from_slice(data);
        v
    }

    #[test]
    fn reads_and_writes_the_documented_layout() {
        let expected = [
            0x03, 0x00, 0xb7, 0xb4, 0xa7, 0xf0, 0x9c, 0x96, 0x4e, 0x4b, 0xa6, 0x87, 0xf5, 0xe4,
            0xa9, 0xbd, 0x1a, 0x23, b'h', b'i',
        ];
        assert_eq!(hand_framed(0, b"hi"), expected);
        let id = Uuid::parse_str(ID).unwrap();
        let written = write(id, Compression::None, b"hi").unwrap();
        assert_eq!(written.as_ref(), expected);
        let frame = parse(&Bytes::copy_from_slice(&expected)).unwrap();
        assert_eq!(frame.schema_version, id);
        assert_eq!(frame.compression, Compression::None);
        assert_eq!(frame.payload.as_ref(), b"hi");
    }

    #[test]
    fn reads_zlib_as_java_deflater_writes_it() {
        // `new Deflater()` output (zlib header 0x78 0x9c, adler32 trailer) of "hello".
        let deflated = [
            0x78, 0x9c, 0xcb, 0x48, 0xcd, 0xc9, 0xc9, 0x07, 0x00, 0x06, 0x2c, 0x02, 0x15,
        ];
        let frame = parse(&Bytes::from(hand_framed(5, &deflated))).unwrap();
        assert_eq!(frame.compression, Compression::Zlib);
        assert_eq!(frame.payload.as_ref(), b"hello");
        // And what we deflate, a zlib reader inflates.
        let written = write(frame.schema_version, Compression::Zlib, b"hello").unwrap();
        assert_eq!(&written[..2], &[3, 5]);
        assert_eq!(&written[18..20], &[0x78, 0x9c], "a zlib stream");
        let mut back = Vec::new();
        flate2::read::ZlibDecoder::new(&written[18..])
            .read_to_end(&mut back)
            .unwrap();
        assert_eq!(back, b"hello");
    }

    #[test]
    fn typed_errors_for_each_broken_header() {
        let err = |b: Vec<u8>| parse(&Bytes::from(b)).unwrap_err();
        assert!(matches!(
            err(hand_framed(0, b"x")[..10].to_vec()),
            FramingError::Truncated(10)
        ));
        assert!(matches!(err(vec![]), FramingError::Truncated(0)));
        let mut v = hand_framed(0, b"x");
        v[0] = 2;
        assert!(matches!(err(v), FramingError::UnknownVersion(2)));
        assert!(matches!(
            err(hand_framed(1, b"x")),
            FramingError::UnknownCompression(1)
        ));
        assert!(matches!(
            err(hand_framed(5, b"not zlib")),
            FramingError::Zlib(_)
        ));
    }

    #[test]
    fn protobuf_message_index_is_a_plain_varint() {
        assert_eq!(write_message_index(0, b"m"), [0, b'm']);
        assert_eq!(write_message_index(3, b""), [3]);
        assert_eq!(write_message_index(300, b""), [0xac, 0x02]);
        let (i, rest) = read_message_index(&Bytes::from_static(&[0xac, 0x02, 9])).unwrap();
        assert_eq!((i, rest.as_ref()), (300, &[9][..]));
        assert!(matches!(
            read_message_index(&Bytes::new()),
            Err(FramingError::MessageIndex)
        ));
        assert!(read_message_index(&Bytes::from_static(&[0x80; 11])).is_err());
    }

    /// A zlib payload of a few tens of KB that inflates past the cap (64 MiB and one
    /// more of zeros) is refused as too large, not inflated into memory.
    #[test]
    fn a_zlib_bomb_is_refused_at_the_cap() {
        let mut encoder = flate2::write::ZlibEncoder::new(Vec::new(), flate2::Compression::best());
        let zeros = vec![0u8; 1 << 20];
        for _ in 0..(MAX_INFLATED_LEN >> 20) {
            encoder.write_all(&zeros).unwrap();
        }
        encoder.write_all(&[0]).unwrap();
        let bomb = encoder.finish().unwrap();
        assert!(bomb.len() < 128 * 1024, "{} bytes", bomb.len());
        let framed = Bytes::from(hand_framed(COMPRESSION_ZLIB, &bomb));
        assert!(matches!(parse(&framed), Err(FramingError::TooLarge)));
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: 256, rng_seed: proptest::test_runner::RngSeed::Fixed(32), ..ProptestConfig::default() })]

        #[test]
        fn write_then_parse_gives_everything_back(
            id in any::<u128>(),
            zlib in any::<bool>(),
            payload in proptest::collection::vec(any::<u8>(), 0..2048),
            index in any::<u32>(),
        ) {
            let compression = if zlib { Compression::Zlib } else { Compression::None };
            let id = Uuid::from_u128(id);
            let framed = write(id, compression, &write_message_index(index, &payload)).unwrap();
            prop_assert!(is_framed(&framed));
            let frame = parse(&framed).unwrap();
            prop_assert_eq!(frame.schema_version, id);
            prop_assert_eq!(frame.compression, compression);
            let (i, message) = read_message_index(&frame.payload).unwrap();
            prop_assert_eq!(i, index);
            prop_assert_eq!(message.as_ref(), &payload[..]);
        }

        #[test]
        fn random_bytes_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..64), zlib in any::<bool>()) {
            let mut b = bytes;
            if b.len() >= 2 { b[0] = 3; b[1] = if zlib { 5 } else { b[1] }; }
            let b = Bytes::from(b);
            let _ = parse(&b);
            let _ = read_message_index(&b);
        }
    }
}
