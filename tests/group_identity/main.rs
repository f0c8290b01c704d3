//! Who a lease belongs to and where it starts: one owner per process incarnation, a
//! durable start for LATEST and AT_TIMESTAMP, and a lease table that knows its stream.

mod incarnation;
mod latest_start;
mod table_stream;
