//! Enhanced fan-out (SubscribeToShard): the memory subscription and the consumer built
//! with `.fan_out(...)`, on the embedded backend and on kinesis-local.

mod emulator;
mod memory;
