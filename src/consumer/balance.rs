//! The balancing decision of a lease round, as a pure function: from one listing of the
//! lease table, every worker derives the same plan of who should hold how many leases
//! and which leases move to whom, and carries out its own part of it. The group's
//! leader also carries out the part of the workers that do not list the table every
//! round: it hands its own surplus to them (`give`) and asks other owners on their
//! behalf (`arrange`).
//!
//! Workers that start together all list the table at about the same moment. If each
//! asked for "what it lacks" from whoever looks most loaded, many would ask the same
//! owner at once and drain it below its share, and the drained owner would then ask
//! back. Here every worker computes the same quotas and the same matching of spare
//! leases to workers below their quota, so two workers with the same view never ask for
//! the same lease, and an owner is never asked for more than it holds above its quota.
//! Views differ only by what changed between two listings (and by workers that hold
//! nothing and asked for nothing yet, which only they themselves know of); such a
//! difference costs a refused request, made again at the next round.

use std::collections::BTreeMap;

/// One lease that may be balanced, as the listing showed it.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Candidate<'a> {
    /// The lease key.
    pub key: &'a str,
    /// The live owner; `None` when unowned or expired (free to take).
    pub owner: Option<&'a str>,
    /// A worker that asked the owner for a hand-off (only meaningful with an owner).
    pub pending: Option<&'a str>,
}

/// This worker's part of the plan.
#[derive(Debug, Default, PartialEq, Eq)]
pub(crate) struct Plan<'a> {
    /// How many leases this worker should hold.
    pub quota: usize,
    /// How many it holds or has asked for already.
    pub holds: usize,
    /// Free leases (unowned or expired) to take.
    pub take: Vec<&'a str>,
    /// Leases of other owners to ask for (planned hand-offs).
    pub ask: Vec<&'a str>,
    /// Every lease of an owner above its quota (no request pending on it), whoever
    /// the plan deals it to.
    pub surplus: Vec<&'a str>,
    /// This worker's own leases the plan deals to other workers, with the worker: what
    /// a leader hands over on its own initiative to workers that do not list the table
    /// every round (see the coordinator's roles).
    pub give: Vec<(&'a str, &'a str)>,
    /// Other owners' leases the plan deals to other workers, with the worker: the
    /// hand-offs a leader asks for on behalf of workers that do not list every round.
    pub arrange: Vec<(&'a str, &'a str)>,
}

/// Computes the plan every worker derives from the same listing, and returns `me`'s part.
///
/// - The workers are the owners of live leases, the workers asking for a hand-off on a
///   live lease, and `known` (the coordinator passes itself: a worker that holds
///   nothing and asked for nothing yet is known only to itself).
/// - A lease with a pending hand-off request counts as the requester's already (the
///   owner hands it over after draining): nobody asks the owner for it again, and the
///   requester does not ask for more elsewhere.
/// - With `n` leases over `w` workers, `n % w` workers get a quota of `n / w + 1`, the
///   rest `n / w`: those that hold most keep the larger quota (ties by worker name), so a
///   balanced table moves nothing.
/// - The spare leases (free ones first, then each owner's leases above its quota, owners
///   in name order, each owner's in key order from the end) are dealt out to the workers
///   below their quota in name order.
pub(crate) fn plan<'a>(me: &'a str, known: &[&'a str], leases: &[Candidate<'a>]) -> Plan<'a> {
    // Per worker: the leases it keeps (sorted by key) and how many it holds in all.
    let mut keeps: BTreeMap<&str, Vec<&str>> = BTreeMap::new();
    let mut holds: BTreeMap<&str, usize> = BTreeMap::new();
    let mut free: Vec<&str> = Vec::new();
    holds.insert(me, 0);
    for worker in known {
        holds.insert(worker, 0);
    }
    for lease in leases {
        match (lease.owner, lease.pending) {
            (None, _) => free.push(lease.key),
            (Some(owner), Some(pending)) if pending != owner => {
                holds.entry(owner).or_default();
                *holds.entry(pending).or_default() += 1;
            }
            (Some(owner), _) => {
                keeps.entry(owner).or_default().push(lease.key);
                *holds.entry(owner).or_default() += 1;
            }
        }
    }
    free.sort_unstable();
    for list in keeps.values_mut() {
        list.sort_unstable();
    }

    let n = leases.len();
    let w = holds.len(); // at least one: `me`
    let (base, extra) = (n / w, n % w);
    let mut ranked: Vec<(&str, usize)> = holds.iter().map(|(k, v)| (*k, *v)).collect();
    ranked.sort_by(|a, b| b.1.cmp(&a.1).then(a.0.cmp(b.0)));
    let quota: BTreeMap<&str, usize> = ranked
        .iter()
        .enumerate()
        .map(|(i, (worker, _))| (*worker, base + usize::from(i < extra)))
        .collect();

    // Spare leases in a fixed order: free ones, then surpluses by owner name.
    let mut spare: Vec<&str> = free;
    let mut surplus_of_all: Vec<&str> = Vec::new();
    for (worker, held) in &holds {
        let surplus = held.saturating_sub(quota[worker]);
        if let Some(list) = keeps.get(worker) {
            if surplus > 0 {
                surplus_of_all.extend(list);
            }
            let give = surplus.min(list.len());
            spare.extend(list[list.len() - give..].iter().rev());
        }
    }
    let mut spare = spare.into_iter();
    let mut mine = Plan {
        quota: quota[me],
        holds: holds[me],
        surplus: surplus_of_all,
        ..Plan::default()
    };
    let owners: BTreeMap<&str, Option<&str>> = leases.iter().map(|l| (l.key, l.owner)).collect();
    for (worker, held) in &holds {
        let deficit = quota[worker].saturating_sub(*held);
        for key in spare.by_ref().take(deficit) {
            let owner = owners.get(key).copied().flatten();
            match owner {
                _ if *worker != me => match owner {
                    Some(o) if o == me => mine.give.push((key, *worker)),
                    Some(_) => mine.arrange.push((key, *worker)),
                    None => {}
                },
                None => mine.take.push(key),
                Some(_) => mine.ask.push(key),
            }
        }
    }
    mine
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn owned<'a>(key: &'a str, owner: &'a str) -> Candidate<'a> {
        Candidate {
            key,
            owner: Some(owner),
            pending: None,
        }
    }

    #[test]
    fn a_balanced_table_moves_nothing() {
        let leases = [
            owned("s0", "a"),
            owned("s1", "a"),
            owned("s2", "b"),
            owned("s3", "c"),
            owned("s4", "c"),
        ];
        for me in ["a", "b", "c"] {
            let p = plan(me, &[me], &leases);
            assert!(p.take.is_empty() && p.ask.is_empty(), "{me}: {p:?}");
            assert_eq!(p.quota, p.holds);
        }
    }

    #[test]
    fn a_newcomer_gets_its_share_from_the_most_loaded() {
        let leases = [
            owned("s0", "a"),
            owned("s1", "a"),
            owned("s2", "a"),
            owned("s3", "b"),
            owned("s4", "b"),
        ];
        let p = plan("c", &["c"], &leases);
        assert_eq!(p.quota, 1);
        assert_eq!(p.ask, vec!["s2"]);
        // The owners, not knowing of `c` yet, plan no move.
        assert!(plan("a", &["a"], &leases).ask.is_empty());
    }

    #[test]
    fn a_pending_request_counts_for_the_requester() {
        let mut leases = vec![
            owned("s0", "a"),
            owned("s1", "a"),
            owned("s2", "a"),
            owned("s3", "a"),
        ];
        leases[3].pending = Some("b");
        // `b` holds one (asked for), `a` three: one more moves from `a` to `b`.
        let p = plan("b", &["b"], &leases);
        assert_eq!((p.quota, p.holds), (2, 1));
        assert_eq!(p.ask, vec!["s2"]);
        // A third worker seeing that gets one too, but not the lease `b` asked for.
        let p = plan("c", &["c"], &leases);
        assert_eq!(p.ask.len(), 1);
        assert_ne!(p.ask, vec!["s3"]);
    }

    #[test]
    fn free_leases_go_first() {
        let leases = [
            owned("s0", "a"),
            owned("s1", "a"),
            owned("s2", "a"),
            Candidate {
                key: "s3",
                owner: None,
                pending: None,
            },
        ];
        let p = plan("b", &["b"], &leases);
        assert_eq!(p.take, vec!["s3"]);
        assert_eq!(p.ask, vec!["s2"]);
    }

    #[test]
    fn an_owner_above_its_quota_knows_whom_the_plan_deals_its_surplus_to() {
        let leases = [
            owned("s0", "a"),
            owned("s1", "a"),
            owned("s2", "a"),
            owned("s3", "a"),
            owned("s4", "b"),
            owned("s5", "b"),
        ];
        let p = plan("a", &["a", "c"], &leases);
        assert_eq!(p.quota, 2);
        assert_eq!(p.give, vec![("s3", "c"), ("s2", "c")]);
        // What `c` would ask for itself, were it listing the table.
        assert_eq!(plan("c", &["a", "c"], &leases).ask, vec!["s3", "s2"]);
        assert!(plan("b", &["a", "b", "c"], &leases).give.is_empty());
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: 500, rng_algorithm: proptest::test_runner::RngAlgorithm::ChaCha, ..ProptestConfig::default() })]

        /// With one view shared by every worker: no lease is dealt twice, no owner is
        /// asked for more than it holds above its quota, and carrying out every
        /// worker's part balances the table within one.
        #[test]
        fn every_worker_computing_the_same_plan_balances_at_once(
            owners in proptest::collection::vec(proptest::option::of(0usize..6), 1..60),
            extra_workers in 0usize..4,
        ) {
            let names: Vec<String> = (0..10).map(|i| format!("w{i}")).collect();
            let keys: Vec<String> = (0..owners.len()).map(|i| format!("s{i:03}")).collect();
            let leases: Vec<Candidate> = owners
                .iter()
                .zip(&keys)
                .map(|(o, k)| Candidate { key: k, owner: o.map(|o| names[o].as_str()), pending: None })
                .collect();
            let mut workers: Vec<&str> = leases.iter().filter_map(|l| l.owner).collect();
            workers.extend(names[6..6 + extra_workers].iter().map(String::as_str));
            workers.sort_unstable();
            workers.dedup();
            if workers.is_empty() {
                workers.push("w9");
            }
            let mut after: BTreeMap<&str, usize> = workers.iter().map(|w| (*w, 0)).collect();
            let mut dealt = std::collections::BTreeSet::new();
            let mut owner_of: BTreeMap<&str, Option<&str>> =
                leases.iter().map(|l| (l.key, l.owner)).collect();
            for me in &workers {
                let p = plan(me, &workers, &leases);
                for key in p.take.iter().chain(&p.ask) {
                    prop_assert!(dealt.insert(*key), "{} dealt twice", key);
                    owner_of.insert(key, Some(me));
                }
            }
            for owner in owner_of.values().flatten() {
                *after.entry(owner).or_default() += 1;
            }
            let n = leases.len();
            let (low, high) = (n / workers.len(), n.div_ceil(workers.len()));
            prop_assert_eq!(after.values().sum::<usize>(), n);
            prop_assert!(after.values().all(|c| (low..=high).contains(c)), "{:?}", after);
        }
    }
}
