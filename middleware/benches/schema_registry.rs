//! The schema registry's costs: the framing (write and parse, plain and zlib, a ~200-byte
//! payload), the decode layer per record against the plain decode of the same format,
//! and how many registry calls 100k framed records of a few versions make.
//!
//! `cargo bench -p shardflow-middleware --bench schema_registry` (add `-- <records>` to
//! change the count, 100,000 by default). Best of five runs, one record at a time on a
//! current-thread runtime. Without `--bench` among its arguments (`cargo test
//! --all-targets`) it makes a smoke run over 300 records.

use std::convert::Infallible;
use std::hint::black_box;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use async_trait::async_trait;
use bytes::Bytes;
use shardflow::{Message, Metadata};
use shardflow_middleware::codec::{DataFormat, SchemaFormat, WriterSchema};
use shardflow_middleware::decode::{DecodeLayer, Format};
use shardflow_middleware::schema_registry::{
    framing, Compression, MemoryRegistry, RegistryError, SchemaRegistry, SchemaRegistryLayer,
};
use tower::{service_fn, Layer, Service, ServiceExt};
use uuid::Uuid;

const RUNS: usize = 5;
/// Schema versions the records are spread over.
const VERSIONS: u64 = 4;

/// A format that only checks the payload is there: the figures are the framing's and the
/// registry's, not a codec's.
#[derive(Clone, Debug)]
struct Raw;

impl Format<usize> for Raw {
    type Error = Infallible;
    fn name(&self) -> &'static str {
        "raw"
    }
    fn decode(&self, payload: &Bytes) -> Result<usize, Infallible> {
        Ok(black_box(payload.len()))
    }
}

impl SchemaFormat<usize> for Raw {
    fn data_format(&self) -> DataFormat {
        DataFormat::Avro
    }
    fn decode_with_schema(&self, payload: &[u8], _: &WriterSchema) -> Result<usize, Infallible> {
        Ok(black_box(payload.len()))
    }
}

/// The embedded registry, counting the version lookups that reach it.
#[derive(Clone)]
struct Counting(MemoryRegistry, Arc<AtomicUsize>);

#[async_trait]
impl SchemaRegistry for Counting {
    async fn schema_version(&self, id: Uuid) -> Result<WriterSchema, RegistryError> {
        self.1.fetch_add(1, Ordering::Relaxed);
        self.0.schema_version(id).await
    }
    async fn version_id(&self, n: &str, s: &WriterSchema, r: bool) -> Result<Uuid, RegistryError> {
        self.0.version_id(n, s, r).await
    }
}

fn payload(i: u64) -> Vec<u8> {
    // ~200 bytes, like a small business record.
    format!(
        r#"{{"id":{i},"customer":"customer-{c:06}","amount":4200,"currency":"EUR","lines":[{{"sku":"SKU-{s:08}","qty":2}},{{"sku":"SKU-{t:08}","qty":1}}],"note":"deliver to the back door"}}"#,
        c = i % 1000,
        s = i * 7,
        t = i * 13
    )
    .into_bytes()
}

fn best(runs: usize, count: usize, mut f: impl FnMut()) -> f64 {
    let mut best = Duration::MAX;
    for _ in 0..runs {
        let start = Instant::now();
        f();
        best = best.min(start.elapsed());
    }
    best.as_nanos() as f64 / count as f64
}

fn main() {
    let (count, runs): (u64, usize) = if std::env::args().skip(1).any(|a| a == "--bench") {
        let count = std::env::args()
            .skip(1)
            .find_map(|a| a.parse().ok())
            .unwrap_or(100_000);
        (count, RUNS)
    } else {
        println!("schema_registry: smoke run (not a measurement: run `cargo bench -p shardflow-middleware --bench schema_registry`)");
        (300, 1)
    };
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_time()
        .build()
        .expect("a runtime");

    let registry = MemoryRegistry::new();
    let ids: Vec<Uuid> = (0..VERSIONS)
        .map(|v| {
            registry.register(
                "orders",
                WriterSchema {
                    format: DataFormat::Avro,
                    definition: Arc::from(format!(
                        r#"{{"type":"record","name":"Order{v}","fields":[]}}"#
                    )),
                },
            )
        })
        .collect();
    let payloads: Vec<Vec<u8>> = (0..count).map(payload).collect();
    let avg_len = payloads.iter().map(Vec::len).sum::<usize>() / payloads.len();
    let n = payloads.len();

    println!("| step ({avg_len}-byte payload) | ns/record |");
    println!("|---|---|");
    for compression in [Compression::None, Compression::Zlib] {
        let framed: Vec<Bytes> = payloads
            .iter()
            .enumerate()
            .map(|(i, p)| framing::write(ids[i % ids.len()], compression, p).expect("framed"))
            .collect();
        let write = best(runs, n, || {
            for (i, p) in payloads.iter().enumerate() {
                black_box(framing::write(ids[i % ids.len()], compression, p).expect("framed"));
            }
        });
        let parse = best(runs, n, || {
            for f in &framed {
                black_box(framing::parse(f).expect("parsed"));
            }
        });
        println!("| write, {compression:?} | {write:.0} |");
        println!("| parse, {compression:?} | {parse:.0} |");
    }

    let metadata = Metadata::builder()
        .stream("orders")
        .shard_id("shardId-000000000000")
        .build();
    let plain: Vec<Message<Bytes>> = payloads
        .iter()
        .map(|p| Message::new(metadata.clone(), Bytes::from(p.clone())))
        .collect();
    let framed: Vec<Message<Bytes>> = payloads
        .iter()
        .enumerate()
        .map(|(i, p)| {
            let data = framing::write(ids[i % ids.len()], Compression::None, p).expect("framed");
            Message::new(metadata.clone(), data)
        })
        .collect();
    let handler =
        || service_fn(|m: Message<usize>| async move { Ok::<_, Infallible>(black_box(m.payload)) });
    let calls = Arc::new(AtomicUsize::new(0));
    runtime.block_on(async {
        let mut plain_best = Duration::MAX;
        let mut layer_best = Duration::MAX;
        for _ in 0..runs {
            let mut svc = DecodeLayer::<usize, Raw>::with_format(Raw).layer(handler());
            let batch = plain.clone();
            let start = Instant::now();
            for m in batch {
                black_box(
                    svc.ready()
                        .await
                        .expect("ready")
                        .call(m)
                        .await
                        .expect("decoded"),
                );
            }
            plain_best = plain_best.min(start.elapsed());

            // A new layer per run: each run starts with a cold cache.
            let mut svc = SchemaRegistryLayer::new(Raw, Counting(registry.clone(), calls.clone()))
                .layer(handler());
            let batch = framed.clone();
            let start = Instant::now();
            for m in batch {
                black_box(
                    svc.ready()
                        .await
                        .expect("ready")
                        .call(m)
                        .await
                        .expect("decoded"),
                );
            }
            layer_best = layer_best.min(start.elapsed());
        }
        let per = |d: Duration| d.as_nanos() as f64 / n as f64;
        println!(
            "| decode layer, unframed (plain format) | {:.0} |",
            per(plain_best)
        );
        println!("| schema registry layer, framed | {:.0} |", per(layer_best));
    });
    let calls = calls.load(Ordering::Relaxed);
    println!(
        "\nregistry calls: {calls} over {runs} run(s) of {n} framed records of {VERSIONS} versions ({} per run)",
        calls / runs
    );
    assert_eq!(
        calls,
        runs * VERSIONS as usize,
        "one lookup per version per cache"
    );
}
