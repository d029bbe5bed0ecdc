//! The KV wire decoder on arbitrary bytes: it must never panic, never read
//! out of bounds, and everything it accepts must re-encode to the very
//! bytes it came from (so no two encodings mean the same message, and
//! nothing it accepts is lost on the way back).

#![no_main]

mod common;

use kvmesh_kvwire::{decode_message, peek_header, DecodeLimits};
use libfuzzer_sys::fuzz_target;

fn check(data: &[u8]) {
    let _ = peek_header(data, &DecodeLimits::default());
    if let Ok((msg, used)) = decode_message(data) {
        assert!(used <= data.len());
        let mut out = Vec::new();
        let n = msg.encode(&mut out).expect("an accepted message encodes");
        assert_eq!(n, used);
        assert_eq!(out.as_slice(), &data[..used]);
    }
}

fuzz_target!(|data: &[u8]| {
    // As it arrives (almost all refused at the checksum) ...
    check(data);
    // ... and with a right envelope, so the body parsers are explored.
    if let Some(m) = common::reseal(data) {
        check(&m);
    }
});
