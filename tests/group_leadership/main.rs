//! Leadership held like a lease: the leader, its successor and the watchers, and how
//! fast every shard is read again whichever workers crash or stop together.

mod coordinator;
mod failover;
mod roles;
