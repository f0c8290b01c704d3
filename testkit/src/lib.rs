//! Test support for shardflow, as `tower-test` is for tower: what the workspace's own
//! integration tests, benches and the CLI's tests share.
//!
//! # What a user's tests may rely on
//!
//! These parts are meant for an application's own tests and change only with a note in
//! the changelog of the release that changes them:
//!
//! - [`Recorder`] and [`recording_handler`]: a handler that records every message it
//!   saw and wakes a test waiting for a count; [`start`] / [`start_service`] run a
//!   consumer in a task and [`Running::stop`] shuts it down gracefully within a bound.
//! - [`Limited::limited`] and [`within`]: waits that fail the test with a message
//!   instead of hanging it.
//! - The assertions ([`assert_exactly_once_in_order`], [`assert_order`],
//!   [`assert_partition_key_order`]) over what a [`Recorder`] saw.
//! - [`fleet`]: a consumer group of many workers as tasks of one process on the
//!   embedded backend, under tokio's paused clock.
//! - [`hooks`]: a backend wrapper calling a test's [`hooks::Hooks`] around every
//!   Kinesis and lease-store call, the one base for frozen, slow, failing or counting
//!   backends.
//!
//! # Internal
//!
//! The rest serves this workspace's own suite and may change with it at any time: the
//! shared scenarios ([`reshard_while_consuming`] and its kin), the emulator and
//! process helpers ([`emulators_enabled`], [`unique`], [`process`], [`proxy`]), the
//! fault-injecting HTTP client and hanging memory backend of [`wire`].

#![warn(missing_docs)]

mod assert;
mod emulator;
pub mod fake_endpoint;
pub mod fleet;
pub mod hooks;
pub mod kcl;
pub mod process;
pub mod proxy;
mod recorder;
mod scenario;
mod setup;
mod wait;
pub mod wire;

pub use assert::*;
pub use emulator::*;
pub use process::build_example;
pub use recorder::*;
pub use scenario::*;
pub use setup::*;
pub use wait::*;
