//! Feeds arbitrary bytes to `shardflow::aggregation::deaggregate`: as they are, and
//! framed as an aggregate (magic + bytes + their MD5) so that the input reaches the
//! protobuf decoder and the index checks instead of stopping at the digest. The decoder
//! must never panic, must return the record untouched, and must number user records
//! 0, 1, 2, … with data inside the record's.
#![no_main]

use bytes::Bytes;
use libfuzzer_sys::fuzz_target;
use shardflow::aggregation::{deaggregate, Deaggregated, MAGIC};
use shardflow::kinesis::Record;
use shardflow::SequenceNumber;

fn check(data: Bytes) {
    let record = Record {
        sequence_number: SequenceNumber::new("1").expect("a valid sequence number"),
        partition_key: "fuzz".into(),
        data: data.clone(),
        approximate_arrival: None,
    };
    match deaggregate(record) {
        Deaggregated::Plain(r) | Deaggregated::Corrupt { record: r, .. } => {
            assert_eq!(r.data, data);
        }
        Deaggregated::Aggregated {
            record,
            user_records,
        } => {
            assert_eq!(record.data, data);
            let start = data.as_ptr() as usize;
            for (i, u) in user_records.iter().enumerate() {
                assert_eq!(u.sub_sequence, i as u64);
                let at = u.data.as_ptr() as usize;
                assert!(
                    u.data.is_empty() || (start <= at && at + u.data.len() <= start + data.len())
                );
            }
        }
    }
}

fuzz_target!(|input: &[u8]| {
    check(Bytes::copy_from_slice(input));
    let mut framed = MAGIC.to_vec();
    framed.extend_from_slice(input);
    framed.extend_from_slice(&md5::compute(input).0);
    check(Bytes::from(framed));
});
