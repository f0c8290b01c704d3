//! The single-instance consumer, `run(service)` and `stream()`: reshards, faults,
//! handler failures and restarts, on the embedded backend and on the emulators.

mod caught_up;
mod emulator;
mod memory;
mod retry_order;
