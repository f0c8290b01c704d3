#!/usr/bin/env python3
"""Reads and writes KPL aggregates with awslabs' `aws-kinesis-agg`, for
tests/kpl_interop.rs: an aggregation implementation independent of shardflow's.

    kpl_interop.py read  IN.json   Kinesis records -> the user records in each
    kpl_interop.py write IN.json   user records -> Kinesis records (aggregates of at
                                   most 51,200 bytes, the KPL's default)

Records in and out are JSON objects {"partition_key", "explicit_hash_key" (or null),
"data_hex"}; `read` answers one list per Kinesis record, each user record with its
"sub_sequence" and whether it came out of an aggregate ("aggregated"). The answer goes
to stdout as JSON.
"""

import base64
import json
import sys

# The aggregator module puts its own folder on sys.path, which the generated
# messages_pb2 needs: import it before the deaggregator.
from aws_kinesis_agg.aggregator import RecordAggregator
from aws_kinesis_agg.deaggregator import iter_deaggregate_records


def read(records):
    out = []
    for i, r in enumerate(records):
        event = {
            "kinesis": {
                "kinesisSchemaVersion": "1.0",
                "sequenceNumber": str(i),
                "approximateArrivalTimestamp": 0,
                "partitionKey": r["partition_key"],
                "explicitHashKey": r["explicit_hash_key"],
                "data": base64.b64encode(bytes.fromhex(r["data_hex"])),
            }
        }
        users = []
        for n, u in enumerate(iter_deaggregate_records([event])):
            k = u["kinesis"]
            users.append(
                {
                    "partition_key": k["partitionKey"],
                    "explicit_hash_key": k.get("explicitHashKey"),
                    "sub_sequence": k.get("subSequenceNumber", n),
                    "aggregated": bool(k.get("aggregated", False)),
                    "data_hex": base64.b64decode(k["data"]).hex(),
                }
            )
        out.append(users)
    return out


def write(users):
    agg = RecordAggregator(max_size=51200)
    finished = []
    for u in users:
        full = agg.add_user_record(
            u["partition_key"], bytes.fromhex(u["data_hex"]), u["explicit_hash_key"]
        )
        if full is not None:
            finished.append(full)
    last = agg.clear_and_get()
    if last is not None:
        finished.append(last)
    out = []
    for rec in finished:
        pk, ehk, blob = rec.get_contents()
        out.append({"partition_key": pk, "explicit_hash_key": ehk, "data_hex": blob.hex()})
    return out


def main():
    mode, path = sys.argv[1], sys.argv[2]
    with open(path) as f:
        records = json.load(f)
    answer = read(records) if mode == "read" else write(records)
    json.dump(answer, sys.stdout)


if __name__ == "__main__":
    main()
