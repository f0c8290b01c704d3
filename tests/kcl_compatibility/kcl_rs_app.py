"""A KCL 3 application on kcl-rs, for tests/kcl_compatibility/kcl_rs.rs.

    python kcl_rs_app.py STREAM APPLICATION OUT STOP

Consumes STREAM as the KCL application APPLICATION (its lease table has that name),
from TRIM_HORIZON where a shard has no checkpoint, by polling. Each record's payload is
appended to OUT (one line each) before the batch is checkpointed. Once the file STOP
exists it shuts down gracefully (a final checkpoint per shard) and exits.
"""

import os
import sys
import threading
import time

from kcl_rs import RecordProcessorBase, Scheduler

stream, application, out_path, stop_path = sys.argv[1:5]
out = open(out_path, "a", buffering=1)
lock = threading.Lock()


class Processor(RecordProcessorBase):
    def initialize(self, initialize_input):
        pass

    def process_records(self, process_records_input):
        with lock:
            for record in process_records_input.records:
                out.write(record.binary_data.decode() + "\n")
            out.flush()
        process_records_input.checkpointer.checkpoint()

    def lease_lost(self, lease_lost_input):
        pass

    def shard_ended(self, shard_ended_input):
        shard_ended_input.checkpointer.checkpoint()

    def shutdown_requested(self, shutdown_requested_input):
        shutdown_requested_input.checkpointer.checkpoint()


scheduler = Scheduler(
    stream_name=stream,
    application_name=application,
    record_processor_factory=Processor,
    worker_identifier="kcl-rs-worker",
    region=os.environ.get("AWS_REGION", "us-east-1"),
    initial_position="TRIM_HORIZON",
    retrieval_mode="POLLING",
    idle_time_between_reads_millis=200,
    shard_sync_interval_millis=1000,
)
scheduler.start()
while not os.path.exists(stop_path):
    time.sleep(0.1)
scheduler.shutdown()
out.close()
