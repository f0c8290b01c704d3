//! A failed record is retried before anything after it reaches the handler (embedded
//! backend, paused clock).

use std::future::IntoFuture;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use shardflow::kinesis::StreamAdmin;
use shardflow::{Memory, Message};
use testkit::*;

const LIMIT: Duration = Duration::from_secs(60);

/// Regression: records after a failed one reached the handler before its retry.
///
/// After a
/// handler error the dispatch task goes straight on to the next queued batch of the same
/// generation; until the shard task wakes up and stops accepting, `wait_start` still
/// says yes, so records after the failed one reach the handler before the failed one is
/// retried (and then come again after it).
#[tokio::test(start_paused = true)]
async fn nothing_after_a_failed_record_is_handled_before_its_retry() {
    let memory = Memory::new();
    let kinesis = memory.streams().clone();
    kinesis.create_stream("f4", 1).await.unwrap();
    produce(kinesis.as_ref(), "f4", 0..40).await;
    let calls: Arc<Mutex<Vec<usize>>> = Arc::default();
    let recorder = Recorder::default();
    let handler = {
        let (calls, recorder) = (calls.clone(), recorder.clone());
        let failed = Arc::new(AtomicBool::new(false));
        tower::service_fn(move |msg: Message| {
            let value: usize = std::str::from_utf8(&msg.payload).unwrap().parse().unwrap();
            calls.lock().unwrap().push(value);
            let fail = value == 7 && !failed.swap(true, Ordering::SeqCst);
            if !fail {
                recorder.record(&msg);
            }
            async move {
                // A handler that does real (async) work: other tasks run meanwhile.
                tokio::task::yield_now().await;
                if fail {
                    Err("injected failure")
                } else {
                    Ok(())
                }
            }
        })
    };
    let consumer = test_consumer(memory.clone(), "f4", "f4-group", "w1")
        .max_records_per_read(5)
        .build()
        .unwrap();
    let stop = consumer.shutdown_handle();
    let run = tokio::spawn(consumer.run(handler).into_future());
    recorder
        .wait_for_values(&(0..40).collect::<Vec<_>>(), LIMIT)
        .await;
    stop.shutdown();
    within(LIMIT, "the consumer stops", run)
        .await
        .unwrap()
        .unwrap();
    let calls = calls.lock().unwrap().clone();
    let failed_at = calls.iter().position(|v| *v == 7).unwrap();
    assert_eq!(
        calls.get(failed_at + 1),
        Some(&7),
        "the call after the failed record 7 is its retry; calls: {calls:?}"
    );
}
