//! Unit tests of the lease module's parts that the consumer drives (a held lease, a
//! stream's view of a multi-stream table, the shared listing), on the embedded backend:
//! they sit here because the lease module is below the memory backend.

mod held {
    use std::sync::Arc;

    use tokio::time::Instant;

    use crate::backend::Backend;
    use crate::lease::{Checkpoint, HeldLease, Lease, LeaseStore};
    use crate::memory::Memory;
    use crate::sequence::{Position, SequenceNumber};

    /// A held lease never writes a checkpoint behind the row it last read or wrote.
    #[tokio::test(start_paused = true)]
    async fn a_held_lease_never_moves_its_checkpoint_back() {
        let memory = Memory::new();
        let store = memory.lease_store("held");
        let at = |n: u64| {
            Checkpoint::At(Position::new(
                SequenceNumber::new(n.to_string()).unwrap(),
                0,
            ))
        };
        let row = Lease::new("s", Vec::new(), at(10));
        assert!(store.create(&row).await.unwrap());
        let taken = store.take(&row, "w#a").await.unwrap();
        let held = HeldLease::taken_at(taken, store.clone(), "w#a", Instant::now());
        held.checkpoint(&at(5)).await.unwrap();
        held.checkpoint(&Checkpoint::TrimHorizon).await.unwrap();
        assert_eq!(store.get("s").await.unwrap().unwrap().checkpoint, at(10));
        held.checkpoint(&at(12)).await.unwrap();
        assert_eq!(store.get("s").await.unwrap().unwrap().checkpoint, at(12));
    }

    /// A lease renewed a moment ago is not fresh past the deadline of a standing hand-off
    /// request (the requester may take it then), and fresh again once the request is
    /// withdrawn.
    #[tokio::test(start_paused = true)]
    async fn a_standing_handoff_request_ends_freshness_at_its_deadline() {
        let memory = Memory::new();
        let store = memory.lease_store("held-handoff");
        let row = Lease::new("s", Vec::new(), Checkpoint::TrimHorizon);
        assert!(store.create(&row).await.unwrap());
        let taken = store.take(&row, "w#a").await.unwrap();
        let held = HeldLease::taken_at(taken, store.clone(), "w#a", Instant::now());
        let max_age = std::time::Duration::from_secs(10);
        held.note_handoff_request(Some(Instant::now() + std::time::Duration::from_secs(2)));
        // A later deadline does not push the first one back.
        held.note_handoff_request(Some(Instant::now() + std::time::Duration::from_secs(9)));
        assert!(held.is_fresh(max_age));
        tokio::time::advance(std::time::Duration::from_secs(2)).await;
        held.renew().await.unwrap();
        assert!(
            !held.is_fresh(max_age),
            "renewed, but past the request's deadline"
        );
        held.note_handoff_request(None);
        assert!(held.is_fresh(max_age), "the request was withdrawn");
    }

    /// A release that fails transiently is tried again: the lease is released, not left
    /// owned until it expires. (Seed 3 fails the first release attempt.)
    #[tokio::test(start_paused = true)]
    async fn a_release_that_fails_transiently_is_tried_again() {
        use crate::memory::LeaseFaults;
        let memory = Memory::new();
        let table = memory.table("held-release");
        let store: Arc<dyn LeaseStore> = table.clone();
        let row = Lease::new("s", Vec::new(), Checkpoint::TrimHorizon);
        assert!(store.create(&row).await.unwrap());
        let taken = store.take(&row, "w#a").await.unwrap();
        let held = HeldLease::taken_at(taken, store.clone(), "w#a", Instant::now());
        table.set_faults(LeaseFaults {
            fail_before_write: 0.5,
            seed: 3,
            ..LeaseFaults::default()
        });
        let before = table.requests();
        let released = held.release().await;
        let attempts = table.requests() - before;
        table.set_faults(LeaseFaults::default());
        assert!(
            attempts >= 2,
            "the first attempt failed ({attempts} requests)"
        );
        assert!(released.is_ok(), "{released:?}");
        assert_eq!(store.get("s").await.unwrap().unwrap().owner, None);
    }
}

mod scoped {
    use std::sync::atomic::Ordering;
    use std::sync::Arc;
    use std::time::Duration;

    use async_trait::async_trait;
    use tokio::time::Instant;

    use crate::kinesis::StreamIdentity;
    use crate::lease::{
        Checkpoint, Lease, LeaseError, LeaseStore, SharedListing, StreamScopedStore,
    };
    use crate::memory::MemoryLeaseStore;

    fn identity(name: &str, epoch: u64) -> StreamIdentity {
        StreamIdentity {
            account: "123456789012".into(),
            name: name.into(),
            creation_epoch: epoch,
        }
    }

    #[tokio::test]
    async fn each_stream_sees_its_own_rows_under_bare_shard_ids() {
        let table: Arc<dyn LeaseStore> = Arc::new(MemoryLeaseStore::default());
        let orders = StreamScopedStore::new(table.clone(), identity("orders", 1));
        let refunds = StreamScopedStore::new(table.clone(), identity("refunds", 1));
        // The same stream re-created: another identity, none of the old rows.
        let orders_again = StreamScopedStore::new(table.clone(), identity("orders", 2));
        let mut lease = Lease::new(
            "shardId-000000000002",
            vec!["shardId-000000000000".into()],
            Checkpoint::TrimHorizon,
        );
        lease.stream = Some("orders".into());
        assert!(orders.create(&lease).await.unwrap());
        assert!(refunds.create(&lease).await.unwrap());

        let stored: Vec<String> = table
            .list()
            .await
            .unwrap()
            .into_iter()
            .map(|r| r.key)
            .collect();
        assert!(stored.contains(&"123456789012:orders:1:shardId-000000000002".to_owned()));
        assert!(stored.contains(&"123456789012:refunds:1:shardId-000000000002".to_owned()));
        let raw = table
            .get("123456789012:orders:1:shardId-000000000002")
            .await
            .unwrap()
            .unwrap();
        assert_eq!(raw.stream.as_deref(), Some("123456789012:orders:1"));
        assert_eq!(raw.parents, vec!["shardId-000000000000".to_owned()]);

        let seen = orders.list().await.unwrap();
        assert_eq!(seen, vec![lease.clone()]);
        assert!(orders_again.list().await.unwrap().is_empty());

        let taken = orders.take(&seen[0], "w#1").await.unwrap();
        assert_eq!(taken.key, "shardId-000000000002");
        assert_eq!(taken.stream.as_deref(), Some("orders"));
        let refunds_row = &refunds.list().await.unwrap()[0];
        assert_eq!(
            refunds_row.owner, None,
            "the other stream's row is untouched"
        );

        // The owner's keys, as a filtered listing of the stream's rows gives them: bare
        // shard ids of this stream only (the same owner's row of another stream and of
        // the stream created again are left out).
        refunds.take(refunds_row, "w#1").await.unwrap();
        assert_eq!(
            orders.owned_keys("w#1").await.unwrap(),
            crate::lease::owned_by(orders.list().await.unwrap(), "w#1")
        );
        assert_eq!(
            orders.owned_keys("w#1").await.unwrap(),
            vec!["shardId-000000000002".to_owned()]
        );
        assert!(orders_again.owned_keys("w#1").await.unwrap().is_empty());
        assert_eq!(table.owned_keys("w#1").await.unwrap().len(), 2);

        // A hand-off request and its withdrawal go to the stream's row.
        let asked = orders.request_handoff(&taken, "w#2").await.unwrap();
        assert_eq!(asked.pending_owner.as_deref(), Some("w#2"));
        let withdrawn = orders.withdraw_handoff(&asked, "w#2").await.unwrap();
        assert_eq!(withdrawn.key, "shardId-000000000002");
        assert_eq!(withdrawn.pending_owner, None);
    }

    /// Counts the Scans (`list` calls) that reach the table.
    struct CountingScans {
        inner: Arc<MemoryLeaseStore>,
        scans: Arc<std::sync::atomic::AtomicUsize>,
    }

    #[async_trait]
    impl LeaseStore for CountingScans {
        async fn ensure_table(&self) -> Result<(), LeaseError> {
            self.inner.ensure_table().await
        }
        async fn list(&self) -> Result<Vec<Lease>, LeaseError> {
            self.scans.fetch_add(1, Ordering::SeqCst);
            self.inner.list().await
        }
        async fn get(&self, key: &str) -> Result<Option<Lease>, LeaseError> {
            self.inner.get(key).await
        }
        async fn create(&self, lease: &Lease) -> Result<bool, LeaseError> {
            self.inner.create(lease).await
        }
        async fn take(&self, expected: &Lease, owner: &str) -> Result<Lease, LeaseError> {
            self.inner.take(expected, owner).await
        }
        async fn renew(&self, expected: &Lease) -> Result<Lease, LeaseError> {
            self.inner.renew(expected).await
        }
        async fn checkpoint(&self, expected: &Lease, to: &Checkpoint) -> Result<Lease, LeaseError> {
            self.inner.checkpoint(expected, to).await
        }
        async fn release(&self, expected: &Lease) -> Result<Lease, LeaseError> {
            self.inner.release(expected).await
        }
        async fn request_handoff(&self, expected: &Lease, w: &str) -> Result<Lease, LeaseError> {
            self.inner.request_handoff(expected, w).await
        }
        async fn withdraw_handoff(&self, expected: &Lease, w: &str) -> Result<Lease, LeaseError> {
            self.inner.withdraw_handoff(expected, w).await
        }
        async fn request_reset(
            &self,
            expected: &Lease,
            to: &Checkpoint,
        ) -> Result<Lease, LeaseError> {
            self.inner.request_reset(expected, to).await
        }
        async fn reset(&self, expected: &Lease, to: &Checkpoint) -> Result<Lease, LeaseError> {
            self.inner.reset(expected, to).await
        }
        async fn delete(&self, expected: &Lease) -> Result<(), LeaseError> {
            self.inner.delete(expected).await
        }
        async fn claim_for_stream(&self, expected: &Lease, s: &str) -> Result<Lease, LeaseError> {
            self.inner.claim_for_stream(expected, s).await
        }
        async fn record_children(
            &self,
            expected: &Lease,
            c: &[String],
        ) -> Result<Lease, LeaseError> {
            self.inner.record_children(expected, c).await
        }
    }

    /// The memory backend with a lease table that counts its Scans.
    #[derive(Clone)]
    struct Counted {
        memory: crate::memory::Memory,
        scans: Arc<std::sync::atomic::AtomicUsize>,
    }

    impl crate::backend::Backend for Counted {
        fn kinesis(&self) -> Arc<dyn crate::kinesis::KinesisApi> {
            self.memory.kinesis()
        }
        fn lease_store(&self, table: &str) -> Arc<dyn LeaseStore> {
            Arc::new(CountingScans {
                inner: self.memory.table(table),
                scans: self.scans.clone(),
            })
        }
    }

    /// A worker reading four streams Scans its table once per lease round, not once per
    /// stream and round, and still reads every stream.
    #[tokio::test(start_paused = true)]
    async fn a_four_stream_worker_scans_once_per_round() {
        use crate::kinesis::{KinesisApi, PutRecord, StreamAdmin};
        use std::sync::atomic::AtomicUsize;
        let backend = Counted {
            memory: crate::memory::Memory::new(),
            scans: Arc::new(AtomicUsize::new(0)),
        };
        let streams: Vec<String> = (0..4).map(|i| format!("s{i}")).collect();
        for stream in &streams {
            backend
                .memory
                .streams()
                .create_stream(stream, 1)
                .await
                .unwrap();
            backend
                .memory
                .streams()
                .put_records(
                    stream,
                    &[PutRecord {
                        data: bytes::Bytes::from_static(b"x"),
                        partition_key: "k".into(),
                        explicit_hash_key: None,
                    }],
                )
                .await
                .unwrap();
        }
        backend
            .memory
            .table("scans")
            .set_faults(crate::memory::LeaseFaults {
                latency: Duration::from_millis(8),
                ..Default::default()
            });
        let (seen, mut handled) = tokio::sync::mpsc::unbounded_channel::<()>();
        let running = crate::consumer::Consumer::builder()
            .streams(streams)
            .group("scans")
            .worker_id("w1")
            .seed(3)
            .backend(backend.clone())
            .build()
            .unwrap()
            .run(tower::service_fn(move |_m: crate::message::Message| {
                let _ = seen.send(());
                async { Ok::<_, std::convert::Infallible>(()) }
            }))
            .spawn();
        // Every stream's record is handled (a shared listing hides no stream's rows).
        tokio::time::timeout(Duration::from_secs(60), async {
            for _ in 0..4 {
                handled.recv().await;
            }
        })
        .await
        .expect("a record of each stream handled");
        // Steady state: 10 minutes of lease rounds, one every take interval (the lease
        // duration, 10 s), plus a shard sync a minute. A Scan per stream would be 4 a
        // round (240 and more).
        tokio::time::sleep(Duration::from_secs(30)).await;
        let before = backend.scans.load(Ordering::SeqCst);
        tokio::time::sleep(Duration::from_secs(600)).await;
        let scans = backend.scans.load(Ordering::SeqCst) - before;
        assert!(
            (58..=66).contains(&scans),
            "{scans} Scans in 60 lease rounds of a 4-stream worker"
        );
        tokio::time::timeout(Duration::from_secs(60), running.shutdown())
            .await
            .expect("shutdown ends")
            .unwrap();
    }

    /// Calls that waited for a Scan get its rows even when the Scan took longer than the
    /// window: a slow table must not make one worker's coordinators Scan one after
    /// another (six 600 ms Scans in a row would miss the lease-call deadline). A call
    /// after this worker's own write, or after the window, Scans again.
    #[tokio::test(start_paused = true)]
    async fn callers_that_waited_for_a_slow_scan_share_it() {
        let table = Arc::new(MemoryLeaseStore::default());
        table.set_faults(crate::memory::LeaseFaults {
            latency: Duration::from_millis(600),
            ..Default::default()
        });
        let row = Lease::new("a", Vec::new(), Checkpoint::TrimHorizon);
        assert!(table.create(&row).await.unwrap());
        let shared = Arc::new(SharedListing::new(
            table.clone(),
            Duration::from_millis(400),
            crate::metrics::Labels::test(),
        ));
        let started = Instant::now();
        let calls: Vec<_> = (0..6)
            .map(|_| {
                let shared = shared.clone();
                tokio::spawn(async move { shared.list().await })
            })
            .collect();
        for call in calls {
            assert_eq!(call.await.unwrap().unwrap().len(), 1);
        }
        assert!(
            started.elapsed() < Duration::from_millis(700),
            "six callers took {:?}: they Scanned one after another",
            started.elapsed()
        );
        assert_eq!(shared.scans(), 1);
        // An own write (even one answered after a Scan started) makes the next call Scan.
        shared.take(&row, "w#a").await.unwrap();
        let rows = shared.list().await.unwrap();
        assert_eq!(rows[0].owner.as_deref(), Some("w#a"));
        assert_eq!(shared.scans(), 2);
    }
}
