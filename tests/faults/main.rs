//! Faults: nothing hangs (hung calls, a deleted lease table, faults on the wire) and a
//! lease row that does not parse is reported, never written.

mod denied;
mod hangs;
mod unreadable_rows;
