use std::io::Cursor;

use super::*;
use crate::testing::{gguf_bytes, set_metadata, tiny_gguf_metadata, tiny_tokens, write_gguf};

fn parse(bytes: &[u8]) -> Result<GgufHeader> {
    GgufHeader::from_reader(Path::new("/m.gguf"), &mut Cursor::new(bytes))
}

fn is_malformed(r: Result<GgufHeader>) -> bool {
    matches!(r, Err(TokenizerError::Malformed { ref path, .. }) if path == Path::new("/m.gguf"))
}

#[test]
fn metadata_reads_back_in_every_version() {
    for version in [1, 2, 3] {
        let bytes = gguf_bytes(version, &tiny_gguf_metadata());
        let h = parse(&bytes).unwrap_or_else(|e| panic!("v{version}: {e}"));
        assert_eq!(h.version(), version);
        assert_eq!(h.path(), Path::new("/m.gguf"));
        assert_eq!(
            h.opt_str("general.architecture").ok().flatten(),
            Some("llama")
        );
        assert_eq!(h.req_usize("llama.context_length").ok(), Some(128));
        assert_eq!(
            h.opt_u32("tokenizer.ggml.bos_token_id").ok().flatten(),
            Some(260)
        );
        assert_eq!(
            h.opt_f32("llama.rope.freq_base").ok().flatten(),
            Some(10000.0)
        );
        assert_eq!(
            h.opt_bool("tokenizer.ggml.add_bos_token").ok().flatten(),
            Some(false)
        );
        let tokens = h
            .opt_str_array("tokenizer.ggml.tokens")
            .ok()
            .flatten()
            .unwrap_or_default();
        assert_eq!(
            tokens,
            tiny_tokens().iter().map(String::as_str).collect::<Vec<_>>()
        );
        assert_eq!(h.array_len("tokenizer.ggml.token_type"), Some(tokens.len()));
        let types = h
            .opt_int_array("tokenizer.ggml.token_type")
            .ok()
            .flatten()
            .unwrap_or_default();
        assert_eq!((types[0], types[260]), (1, 3));
        assert_eq!(h.tensor_count(), 0);
        assert_eq!(h.file_len(), bytes.len() as u64);
        assert_eq!(
            h.tensor_data_offset(),
            (bytes.len() as u64).div_ceil(32) * 32
        );
    }
}

#[test]
fn typed_access_names_the_key_and_value() {
    let mut md = tiny_gguf_metadata();
    set_metadata(&mut md, "llama.block_count", GgufValue::String("2".into()));
    set_metadata(&mut md, "big", GgufValue::U64(u64::from(u32::MAX) + 1));
    set_metadata(&mut md, "neg", GgufValue::I32(-1));
    let h = parse(&gguf_bytes(3, &md)).expect("parse");
    match h.req_usize("llama.block_count") {
        Err(TokenizerError::InvalidField { field, value, .. }) => {
            assert_eq!(
                (field.as_str(), value.as_str()),
                ("llama.block_count", "\"2\"")
            )
        }
        other => panic!("expected InvalidField, got {other:?}"),
    }
    assert!(
        matches!(h.opt_u32("big"), Err(TokenizerError::InvalidField { ref reason, .. }) if reason == "too large")
    );
    assert!(
        matches!(h.opt_u64("neg"), Err(TokenizerError::InvalidField { ref value, .. }) if value == "-1")
    );
    assert!(
        matches!(h.req_usize("nope"), Err(TokenizerError::MissingField { ref field, .. }) if field == "nope")
    );
    assert!(matches!(
        h.opt_str_array("llama.context_length"),
        Err(TokenizerError::InvalidField { .. })
    ));
    assert!(matches!(h.opt_str("nope"), Ok(None)));
}

#[test]
fn number_arrays_read_as_f32_and_keys_list_every_entry() {
    let mut md = tiny_gguf_metadata();
    let floats = [0.0, -1.5, -1000.0].map(GgufValue::F32).to_vec();
    set_metadata(&mut md, "f", GgufValue::Array(floats));
    let ints = [0, -3, 7].map(GgufValue::I32).to_vec();
    set_metadata(&mut md, "i", GgufValue::Array(ints));
    let nan = [1.0, f32::NAN].map(GgufValue::F32).to_vec();
    set_metadata(&mut md, "nan", GgufValue::Array(nan));
    let h = parse(&gguf_bytes(3, &md)).expect("parse");
    assert_eq!(
        h.opt_f32_array("f").ok().flatten(),
        Some(vec![0.0, -1.5, -1000.0])
    );
    assert_eq!(
        h.opt_f32_array("i").ok().flatten(),
        Some(vec![0.0, -3.0, 7.0])
    );
    assert!(matches!(h.opt_f32_array("nope"), Ok(None)));
    for bad in ["nan", "tokenizer.ggml.tokens", "llama.context_length"] {
        assert!(
            matches!(h.opt_f32_array(bad), Err(TokenizerError::InvalidField { ref field, .. }) if field == bad),
            "{bad}"
        );
    }
    let mut keys: Vec<&str> = h.keys().collect();
    keys.sort_unstable();
    let mut want: Vec<&str> = md.iter().map(|(k, _)| k.as_str()).collect();
    want.sort_unstable();
    assert_eq!(keys, want);
}

#[test]
fn the_tensor_directory_is_read_in_hugging_face_order() {
    let mut md = tiny_gguf_metadata();
    set_metadata(&mut md, "general.alignment", GgufValue::U32(64));
    let mut bytes = gguf_bytes(3, &md);
    bytes[8..16].copy_from_slice(&1u64.to_le_bytes());
    let name = "blk.0.attn_q.weight";
    bytes.extend_from_slice(&(name.len() as u64).to_le_bytes());
    bytes.extend_from_slice(name.as_bytes());
    bytes.extend_from_slice(&2u32.to_le_bytes());
    bytes.extend_from_slice(&32u64.to_le_bytes()); // innermost (columns)
    bytes.extend_from_slice(&4u64.to_le_bytes()); // rows
    bytes.extend_from_slice(&8u32.to_le_bytes()); // Q8_0
    bytes.extend_from_slice(&0u64.to_le_bytes());
    let end = bytes.len() as u64;
    bytes.resize(bytes.len() + 200, 0);
    let h = parse(&bytes).expect("parse");
    assert_eq!(
        h.tensor(name),
        Some(&TensorInfo {
            dims: vec![4, 32],
            ggml_type: 8,
            offset: 0
        })
    );
    assert!(h.has_tensor(name) && !h.has_tensor("output.weight"));
    assert_eq!(h.tensor_data_offset(), end.div_ceil(64) * 64);

    // More dimensions than ggml has: refused.
    let at = bytes.len() - 200 - 8 - 4 - 16 - 4;
    bytes[at..at + 4].copy_from_slice(&5u32.to_le_bytes());
    assert!(is_malformed(parse(&bytes)));
}

#[test]
fn truncated_or_corrupt_headers_are_malformed_never_a_panic() {
    let bytes = gguf_bytes(3, &tiny_gguf_metadata());
    for cut in 0..bytes.len() {
        assert!(
            is_malformed(parse(&bytes[..cut])),
            "cut at {cut} of {}",
            bytes.len()
        );
    }
    let patched = |at: usize, with: &[u8]| {
        let mut b = bytes.clone();
        b[at..at + with.len()].copy_from_slice(with);
        b
    };
    // Absurd tensor and metadata counts.
    assert!(is_malformed(parse(&patched(8, &u64::MAX.to_le_bytes()))));
    assert!(is_malformed(parse(&patched(16, &u64::MAX.to_le_bytes()))));
    // The first key's length, then a version nobody wrote, then the magic.
    assert!(is_malformed(parse(&patched(
        24,
        &(1u64 << 40).to_le_bytes()
    ))));
    assert!(is_malformed(parse(&patched(4, &7u32.to_le_bytes()))));
    assert!(is_malformed(parse(&patched(0, b"GGUG"))));

    let bad_value = |v: GgufValue| {
        let mut md = tiny_gguf_metadata();
        set_metadata(&mut md, "x", v);
        parse(&gguf_bytes(3, &md))
    };
    // An alignment of 0 would divide by zero.
    let mut md = tiny_gguf_metadata();
    set_metadata(&mut md, "general.alignment", GgufValue::U32(0));
    assert!(is_malformed(parse(&gguf_bytes(3, &md))));
    // Arrays nested past the bound.
    let mut deep = GgufValue::U8(1);
    for _ in 0..70 {
        deep = GgufValue::Array(vec![deep]);
    }
    assert!(is_malformed(bad_value(deep)));
    let mut shallow = GgufValue::U8(1);
    for _ in 0..10 {
        shallow = GgufValue::Array(vec![shallow]);
    }
    assert!(bad_value(shallow).is_ok());

    // A boolean other than 0 or 1, and an unknown value type.
    let mut md = vec![("b".to_owned(), GgufValue::Bool(true))];
    let mut b = gguf_bytes(3, &md);
    let last = b.len() - 1;
    b[last] = 2;
    assert!(is_malformed(parse(&b)));
    md[0].1 = GgufValue::U8(0);
    let mut b = gguf_bytes(3, &md);
    let ty = b.len() - 5;
    b[ty..ty + 4].copy_from_slice(&13u32.to_le_bytes());
    assert!(is_malformed(parse(&b)));
}

#[test]
fn files_are_recognised_by_their_magic_and_a_missing_one_is_named() {
    let dir = tempfile::tempdir().expect("tempdir");
    let good = dir.path().join("model.bin");
    write_gguf(&good, &tiny_gguf_metadata());
    assert!(starts_with_gguf_magic(&good).expect("read"));
    assert!(GgufHeader::read(&good).is_ok());
    for (name, content) in [
        ("empty", &b""[..]),
        ("short", &b"GG"[..]),
        ("text", &b"hello"[..]),
    ] {
        let p = dir.path().join(name);
        std::fs::write(&p, content).expect("write");
        assert!(!starts_with_gguf_magic(&p).expect("read"), "{name}");
    }
    let missing = dir.path().join("nope.gguf");
    assert!(
        matches!(GgufHeader::read(&missing), Err(TokenizerError::MissingFile { ref path, .. }) if path == &missing)
    );
}
