//! Feeds arbitrary bytes to the header readers (`HeaderFormat::read` in every format) and
//! to the producer's header writer: no reader may panic, hand out bytes that are not the
//! record's, or unwrap by default what Spring's maintained reader delivers whole; and
//! any bytes sent as a payload must come back exactly. The rules live in
//! `read_headers_check.rs`, which `tests/headers.rs` runs on generated inputs too.
#![no_main]

use libfuzzer_sys::fuzz_target;

#[path = "read_headers_check.rs"]
mod read_headers_check;

fuzz_target!(|input: &[u8]| {
    read_headers_check::check(input);
});
