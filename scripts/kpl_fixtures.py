#!/usr/bin/env python3
"""Writes the KPL aggregation fixtures under tests/fixtures/kpl/.

The fixtures are made by an implementation independent of shardflow's: the
`aws-kinesis-agg` package from PyPI (awslabs' Python aggregation library) and the
protobuf classes it ships (`aws_kinesis_agg.messages_pb2`). tests/aggregation.rs
decodes every file with shardflow's decoder and compares the user records with
`manifest.json`, which lists what was given to the Python aggregator (not what any
decoder read back), so the test checks shardflow against the writer's intent.

The generated files are committed: the Rust tests do not need Python. To make them
again (the output is deterministic):

    python3 -m venv .cache/kpl-venv
    .cache/kpl-venv/bin/pip install aws-kinesis-agg==1.2.3 six
    .cache/kpl-venv/bin/python scripts/kpl_fixtures.py

Manifest entries:
  file           the fixture, raw Kinesis record data (what GetRecords returns, decoded)
  expect         "aggregated" (decodes into user_records), "corrupt" (carries the
                 magic but must be delivered whole as a plain record, with `reason`)
                 or "plain" (not an aggregate at all)
  reason         for "corrupt": the AggregationError variant expected, snake_case
  partition_key  the partition key the aggregator chose for the Kinesis record
  explicit_hash_key  likewise (null when none)
  user_records   [{sub_sequence, partition_key, explicit_hash_key, data_hex}]
"""

import hashlib
import json
import os
import sys

import aws_kinesis_agg

# The aggregator module puts its own folder on sys.path, which the generated
# messages_pb2 needs (it imports `config_pb2` as a top-level module): import it first.
from aws_kinesis_agg.aggregator import RecordAggregator
from aws_kinesis_agg import messages_pb2

OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "fixtures", "kpl")
MAX_HASH_KEY = str(2**128 - 1)

manifest = []


def write(name, data):
    with open(os.path.join(OUT, name), "wb") as f:
        f.write(data)


def aggregate(name, records, max_size=aws_kinesis_agg.MAX_BYTES_PER_RECORD):
    """Packs (partition_key, data, explicit_hash_key) tuples with the library's
    RecordAggregator. Records that overflow an aggregate start the next one; each
    aggregate is written as NAME.bin or, when there are several, NAME_<i>.bin."""
    agg = RecordAggregator(max_size=max_size)
    finished = []  # (AggRecord, the inputs in it)
    current = []
    for pk, data, ehk in records:
        full = agg.add_user_record(pk, data, ehk)
        if full is not None:
            finished.append((full, current))
            current = []
        current.append((pk, data, ehk))
    last = agg.clear_and_get()
    if last is not None:
        finished.append((last, current))
    outputs = []
    for i, (rec, inputs) in enumerate(finished):
        pk, ehk, blob = rec.get_contents()
        fname = f"{name}.bin" if len(finished) == 1 else f"{name}_{i}.bin"
        write(fname, blob)
        entry = {
            "file": fname,
            "expect": "aggregated",
            "partition_key": pk,
            "explicit_hash_key": ehk,
            "user_records": [
                {
                    "sub_sequence": n,
                    "partition_key": upk,
                    "explicit_hash_key": uehk,
                    "data_hex": udata.hex(),
                }
                for n, (upk, udata, uehk) in enumerate(inputs)
            ],
        }
        manifest.append(entry)
        outputs.append((fname, blob))
    return outputs


def corrupt(name, blob, reason, note):
    write(name, blob)
    manifest.append({"file": name, "expect": "corrupt", "reason": reason, "note": note})


def framed(message):
    """MAGIC + protobuf bytes + MD5(protobuf bytes): a well-framed aggregate around
    whatever protobuf bytes are given (used for the malformed-content fixtures)."""
    return aws_kinesis_agg.MAGIC + message + hashlib.md5(message).digest()


def main():
    os.makedirs(OUT, exist_ok=True)
    for old in os.listdir(OUT):
        if old.endswith(".bin") or old == "manifest.json":
            os.remove(os.path.join(OUT, old))

    # Three records: distinct partition keys, explicit hash keys at both ends of the
    # range and one record without, binary data and an empty payload.
    [(_, three)] = aggregate(
        "three_keys",
        [
            ("alpha", b"first user record", None),
            ("beta", bytes(range(256)), MAX_HASH_KEY),
            ("gamma", b"", "0"),
        ],
    )

    # Keys shared between records: the tables hold each key once and records refer
    # to them by index.
    aggregate(
        "shared_keys",
        [
            (f"pk-{i % 3}", f"shared {i}".encode(), None if i % 2 else str(10**30 + i % 2))
            for i in range(10)
        ],
    )

    # Non-ASCII partition keys and explicit hash key with leading zeros.
    aggregate(
        "unicode_keys",
        [
            ("ключ-🔑", "données".encode(), None),
            ("キー", b"\x00\xff\x00", "000123"),
        ],
    )

    # 500 small records in one aggregate.
    aggregate(
        "five_hundred",
        [(f"key-{i % 7}", f"record {i:03}".encode(), None) for i in range(500)],
    )

    # A size limit small enough to split the input into several aggregates; each one's
    # sub-sequence numbers start at 0 again.
    aggregate(
        "split",
        [(f"split-{i}", bytes([i]) * 100, None) for i in range(40)],
        max_size=1500,
    )

    # Not an aggregate: no magic bytes.
    write("plain.bin", b'{"not": "aggregated"}')
    manifest.append({"file": "plain.bin", "expect": "plain"})

    # The MD5 trailer does not match (one bit of the trailer flipped).
    bad = bytearray(three)
    bad[-1] ^= 0x01
    corrupt("bad_md5.bin", bytes(bad), "digest_mismatch", "three_keys with its last MD5 byte changed")

    # One byte of the protobuf body changed, trailer kept: the digest no longer matches.
    bad = bytearray(three)
    bad[10] ^= 0x40
    corrupt("bad_body.bin", bytes(bad), "digest_mismatch", "three_keys with a body byte changed")

    # Truncated in the middle (as a broken copy would be).
    corrupt("truncated.bin", three[: len(three) // 2], "digest_mismatch", "first half of three_keys")

    # Magic bytes and fewer than 17 bytes after them: no room for body and digest.
    corrupt("magic_only.bin", aws_kinesis_agg.MAGIC + b"\x00" * 16, "too_short", "magic + 16 zero bytes")

    # Correct framing and MD5 around bytes that are not an AggregatedRecord.
    corrupt(
        "not_protobuf.bin",
        framed(b"\xff\xff\xff\xff this is not protobuf"),
        "malformed",
        "garbage body with a matching MD5",
    )

    # A record whose partition key index points past the table.
    ar = messages_pb2.AggregatedRecord()
    ar.partition_key_table.append("only")
    r = ar.records.add()
    r.partition_key_index = 0
    r.data = b"fine"
    r = ar.records.add()
    r.partition_key_index = 5
    r.data = b"dangling"
    corrupt(
        "pk_index_out_of_range.bin",
        framed(ar.SerializeToString()),
        "partition_key_index_out_of_range",
        "second record's partition_key_index is 5, table has 1",
    )

    # A record whose explicit hash key index points past the table.
    ar = messages_pb2.AggregatedRecord()
    ar.partition_key_table.append("pk")
    ar.explicit_hash_key_table.append("42")
    r = ar.records.add()
    r.partition_key_index = 0
    r.explicit_hash_key_index = 1
    r.data = b"x"
    corrupt(
        "ehk_index_out_of_range.bin",
        framed(ar.SerializeToString()),
        "explicit_hash_key_index_out_of_range",
        "explicit_hash_key_index 1, table has 1",
    )

    # An explicit hash key that is not a decimal number in 0..2^128.
    ar = messages_pb2.AggregatedRecord()
    ar.partition_key_table.append("pk")
    ar.explicit_hash_key_table.append(str(2**128))
    r = ar.records.add()
    r.partition_key_index = 0
    r.explicit_hash_key_index = 0
    r.data = b"x"
    corrupt(
        "ehk_too_large.bin",
        framed(ar.SerializeToString()),
        "invalid_explicit_hash_key",
        "explicit hash key 2^128",
    )

    # A record without its required `data` field (proto2 parsers refuse it).
    ar = messages_pb2.AggregatedRecord()
    ar.partition_key_table.append("pk")
    r = ar.records.add()
    r.partition_key_index = 0
    corrupt(
        "missing_data.bin",
        framed(ar.SerializePartialToString()),
        "missing_field",
        "record without data (required in proto2)",
    )

    # A well-formed aggregate with key tables but no records.
    ar = messages_pb2.AggregatedRecord()
    ar.partition_key_table.append("lonely")
    corrupt("no_records.bin", framed(ar.SerializeToString()), "no_records", "tables but no records")

    from importlib.metadata import version

    header = {
        "generator": "scripts/kpl_fixtures.py",
        "library": f"aws-kinesis-agg {version('aws-kinesis-agg')}, protobuf {version('protobuf')}",
    }
    # One fixture per block and one user record per line: small, and diffs stay readable.
    lines = ["{"]
    for key, value in header.items():
        lines.append(f" {json.dumps(key)}: {json.dumps(value)},")
    lines.append(' "fixtures": [')
    for i, entry in enumerate(manifest):
        users = entry.pop("user_records", None)
        head = json.dumps(entry, ensure_ascii=False)
        if users is None:
            lines.append(f"  {head}" + ("," if i + 1 < len(manifest) else ""))
            continue
        lines.append(f'  {head[:-1]}, "user_records": [')
        for j, user in enumerate(users):
            lines.append("   " + json.dumps(user, ensure_ascii=False) + ("," if j + 1 < len(users) else ""))
        lines.append("  ]}" + ("," if i + 1 < len(manifest) else ""))
    lines.append(" ]")
    lines.append("}")
    with open(os.path.join(OUT, "manifest.json"), "w", encoding="utf-8") as f:
        f.write("\n".join(lines) + "\n")
    print(f"wrote {len(manifest)} fixtures to {os.path.normpath(OUT)}", file=sys.stderr)


if __name__ == "__main__":
    main()
