use std::convert::Infallible;
use std::sync::Mutex;

use shardflow::kinesis::StreamAdmin;
use shardflow::producer::InvalidRecord;
use shardflow::Memory;
use tower::{service_fn, ServiceBuilder, ServiceExt};

use super::*;
use crate::dead_letter::{DeadLetterLayer, DeadLetterPolicy, DeadLetterRecord, PermanentFailures};
use crate::test_support::{message, metadata};

async fn memory_producer() -> (Memory, Producer) {
    let memory = Memory::new();
    memory.streams().create_stream("out", 1).await.unwrap();
    let producer = Producer::builder()
        .stream("out")
        .backend(memory.clone())
        .build()
        .unwrap();
    (memory, producer)
}

/// (partition key, payload) of every record in the one-shard stream `out`.
fn stored(memory: &Memory) -> Vec<(String, String)> {
    memory
        .streams()
        .records("out", "shardId-000000000000")
        .into_iter()
        .map(|r| {
            (
                r.partition_key,
                String::from_utf8_lossy(&r.data).into_owned(),
            )
        })
        .collect()
}

#[tokio::test(start_paused = true)]
async fn outputs_keep_the_input_key_unless_the_function_chooses_one() {
    let (memory, producer) = memory_producer().await;
    let svc = ProduceToLayer::new(producer).layer(service_fn(|_m: Message<Bytes>| async {
        Ok::<_, Infallible>([
            Output::new("a"),
            Output::new("b").partition_key("chosen"),
            Output::from(ProducerRecord::new("c", "record-key")),
        ])
    }));
    let answers = svc.oneshot(message(1, b"in")).await.unwrap();
    assert_eq!(answers.len(), 3);
    assert_eq!(
        stored(&memory),
        [("pk-1", "a"), ("chosen", "b"), ("record-key", "c")]
            .map(|(k, p)| (k.to_owned(), p.to_owned()))
    );
}

#[tokio::test(start_paused = true)]
async fn zero_outputs_resolve_at_once_and_store_nothing() {
    let (memory, producer) = memory_producer().await;
    let svc = ProduceToLayer::new(producer).layer(service_fn(|_m: Message<Bytes>| async {
        Ok::<_, Infallible>(None::<Output>)
    }));
    assert!(svc.oneshot(message(1, b"in")).await.unwrap().is_empty());
    assert!(stored(&memory).is_empty());
}

#[tokio::test(start_paused = true)]
async fn an_output_the_producer_refuses_fails_the_call_and_names_it() {
    let (_memory, producer) = memory_producer().await;
    let svc = ProduceToLayer::new(producer).layer(service_fn(|_m: Message<Bytes>| async {
        Ok::<_, Infallible>(vec![
            Output::new("ok"),
            Output::new("bad").partition_key(""),
        ])
    }));
    let error = svc.oneshot(message(1, b"in")).await.unwrap_err();
    let error = error.downcast_ref::<ProduceToError>().unwrap();
    assert!(matches!(
        error,
        ProduceToError::NotStored {
            index: 1,
            outputs: 2,
            source: ProduceError::InvalidRecord(InvalidRecord::EmptyPartitionKey),
            ..
        }
    ));
    assert_eq!(
        error.to_string(),
        "output 1 of 2 was not stored in stream out"
    );
    assert!(!error.is_transient());
}

#[tokio::test(start_paused = true)]
async fn the_handler_error_passes_through_and_nothing_is_produced() {
    let (memory, producer) = memory_producer().await;
    let svc = ProduceToLayer::new(producer).layer(service_fn(|_m: Message<Bytes>| async {
        Err::<Vec<Output>, _>(std::io::Error::other("enrich failed"))
    }));
    let error = svc.oneshot(message(1, b"in")).await.unwrap_err();
    assert_eq!(error.to_string(), "enrich failed");
    assert!(stored(&memory).is_empty());
}

#[test]
fn only_permanent_produce_failures_are_dead_lettered() {
    let not_stored = |source| -> BoxError {
        Box::new(ProduceToError::NotStored {
            stream: "out".into(),
            index: 0,
            outputs: 1,
            source,
        })
    };
    let failed = |code: &str| ProduceError::Failed {
        code: code.into(),
        message: String::new(),
        attempts: 10,
    };
    let policy = PermanentFailures;
    for transient in [
        failed("ProvisionedThroughputExceededException"),
        failed("ServiceError"),
        ProduceError::Closed,
    ] {
        let error = not_stored(transient.clone());
        assert!(
            !policy.should_dead_letter(error.as_ref(), &metadata(1)),
            "{transient:?} comes back instead"
        );
    }
    for permanent in [
        failed("NotFound"),
        ProduceError::InvalidRecord(InvalidRecord::EmptyPartitionKey),
    ] {
        let error = not_stored(permanent.clone());
        assert!(
            policy.should_dead_letter(error.as_ref(), &metadata(1)),
            "{permanent:?} is dead-lettered"
        );
    }
}

#[tokio::test(start_paused = true)]
async fn a_refused_output_goes_to_the_dead_letter_layer_above() {
    let (memory, producer) = memory_producer().await;
    let letters = Arc::new(Mutex::new(Vec::new()));
    let sink = {
        let letters = letters.clone();
        service_fn(move |r: DeadLetterRecord| {
            letters.lock().unwrap().push(r.error);
            async { Ok::<_, Infallible>(()) }
        })
    };
    let svc = ServiceBuilder::new()
        .layer(DeadLetterLayer::new(sink))
        .layer(ProduceToLayer::new(producer))
        .service_fn(|_m: Message<Bytes>| async {
            Ok::<_, Infallible>(Output::new("x").partition_key(""))
        });
    let outcome = svc.oneshot(message(1, b"in")).await.unwrap();
    assert!(outcome.is_dead_lettered(), "the input counts as handled");
    let letters = letters.lock().unwrap().clone();
    assert_eq!(letters.len(), 1);
    assert!(
        letters[0].starts_with("output 0 of 1 was not stored in stream out"),
        "{letters:?}"
    );
    assert!(stored(&memory).is_empty());
}

/// Regression: an output refused before sending failed the call, but the outputs after
/// it were stored anyway.
#[tokio::test(start_paused = true)]
async fn nothing_after_a_refused_output_is_stored() {
    for ordered in [true, false] {
        let memory = Memory::new();
        memory.streams().create_stream("out", 1).await.unwrap();
        let producer = Producer::builder()
            .stream("out")
            .backend(memory.clone())
            .ordered_per_key(ordered)
            .build()
            .unwrap();
        let svc = ProduceToLayer::new(producer).layer(service_fn(|_m: Message<Bytes>| async {
            Ok::<_, Infallible>(vec![
                Output::new("x0"),
                Output::new(vec![0u8; shardflow::producer::MAX_RECORD_BYTES + 1]),
                Output::new("x2"),
            ])
        }));
        let error = svc.oneshot(message(1, b"in")).await.unwrap_err();
        let error = error.downcast_ref::<ProduceToError>().unwrap();
        assert!(
            matches!(
                error,
                ProduceToError::NotStored {
                    index: 1,
                    outputs: 3,
                    source: ProduceError::TooLarge { .. },
                    ..
                }
            ),
            "{error:?}"
        );
        assert!(!error.is_transient());
        assert_eq!(
            stored(&memory),
            [("pk-1".to_owned(), "x0".to_owned())],
            "ordered: {ordered}"
        );
    }
}
