use super::*;

const PATH: &str = "/kvmesh.internal.v1.Decode/Reserve";
const NODE: &str = "decode-0";
const NOW: u64 = 1_700_000_000_000;

fn secret() -> MeshSecret {
    MeshSecret::generate().expect("rng")
}

fn call<'a>(path: &'a str, recipient: &'a str, body: &'a BodyDigest) -> Call<'a> {
    Call {
        path,
        recipient,
        body,
    }
}

fn sign(s: &MeshSecret, path: &str, to: &str, body: &[u8], now: u64) -> SignedCall {
    sign_call(s, &call(path, to, &body_digest(body)), now).expect("sign")
}

#[test]
fn a_fresh_token_passes_once_and_its_answer_proves_the_node() {
    let s = secret();
    let v = CallVerifier::new(s.clone(), NODE);
    let t = sign(&s, PATH, NODE, b"body", NOW);
    assert_eq!(t.token.len(), 13 + 1 + 32 + 1 + 64);
    let digest = body_digest(b"body");
    let admitted = v
        .check(Some(t.token.as_bytes()), PATH, &digest, NOW + 5)
        .expect("admitted");
    let proof = v.reply_proof(&admitted);
    assert_eq!(check_reply(&s, NODE, &t, Some(proof.as_bytes())), Ok(()));
    assert_eq!(
        v.check(Some(t.token.as_bytes()), PATH, &digest, NOW + 6)
            .expect_err("replay"),
        CallRefusal::Replayed
    );
    // A second token for the same call is fresh.
    let t2 = sign(&s, PATH, NODE, b"body", NOW);
    assert!(v
        .check(Some(t2.token.as_bytes()), PATH, &digest, NOW)
        .is_ok());
    assert_eq!(v.refused_of("replayed"), 1);
}

#[test]
fn a_call_binds_its_recipient_and_body() {
    let s = secret();
    let decode0 = CallVerifier::new(s.clone(), "decode-0");
    let decode1 = CallVerifier::new(s.clone(), "decode-1");
    let t = sign(&s, PATH, "decode-0", b"prompt", NOW);
    // Replayed (or relayed) to a sibling: refused there.
    assert_eq!(
        decode1
            .check(Some(t.token.as_bytes()), PATH, &body_digest(b"prompt"), NOW)
            .expect_err("other node"),
        CallRefusal::BadMac
    );
    // Another body under the same proof: refused.
    assert_eq!(
        decode0
            .check(Some(t.token.as_bytes()), PATH, &body_digest(b"prompT"), NOW)
            .expect_err("other body"),
        CallRefusal::BadMac
    );
    // The honest delivery still passes (refusals did not consume it).
    assert!(decode0
        .check(Some(t.token.as_bytes()), PATH, &body_digest(b"prompt"), NOW)
        .is_ok());
}

#[test]
fn an_answer_without_the_nodes_proof_is_refused() {
    let s = secret();
    let t = sign(&s, PATH, NODE, b"x", NOW);
    let other = CallVerifier::new(s.clone(), "decode-1");
    let u = sign(&s, PATH, "decode-1", b"x", NOW);
    let sibling = other
        .check(Some(u.token.as_bytes()), PATH, &body_digest(b"x"), NOW)
        .expect("admitted");
    let stranger = CallVerifier::new(secret(), NODE);
    let forged = stranger
        .check(
            Some(
                sign(&stranger.secret, PATH, NODE, b"x", NOW)
                    .token
                    .as_bytes(),
            ),
            PATH,
            &body_digest(b"x"),
            NOW,
        )
        .expect("its own");
    let cases: [(Option<Vec<u8>>, ReplyRefusal); 5] = [
        (None, ReplyRefusal::Missing),
        (Some(b"zz".to_vec()), ReplyRefusal::Malformed),
        (Some(vec![0xff; 64]), ReplyRefusal::Malformed),
        // A sibling's proof over its own call, and a node of another
        // mesh: neither proves this node for this call.
        (
            Some(other.reply_proof(&sibling).into_bytes()),
            ReplyRefusal::BadMac,
        ),
        (
            Some(stranger.reply_proof(&forged).into_bytes()),
            ReplyRefusal::BadMac,
        ),
    ];
    for (i, (h, want)) in cases.into_iter().enumerate() {
        assert_eq!(
            check_reply(&s, NODE, &t, h.as_deref()),
            Err(want),
            "case {i}"
        );
    }
    // The sibling's proof is good for the sibling's call only.
    assert_eq!(
        check_reply(
            &s,
            "decode-1",
            &u,
            Some(other.reply_proof(&sibling).as_bytes())
        ),
        Ok(())
    );
}

#[test]
fn every_refusal_kind_is_typed_and_counted() {
    let s = secret();
    let v = CallVerifier::new(s.clone(), NODE);
    let d = body_digest(b"b");
    let good = sign(&s, PATH, NODE, b"b", NOW).token;
    let cases: Vec<(Option<Vec<u8>>, &str, u64, &str)> = vec![
        (None, PATH, NOW, "missing"),
        (Some(b"".to_vec()), PATH, NOW, "malformed"),
        (Some(b"1.2".to_vec()), PATH, NOW, "malformed"),
        (Some(b"1.2.3.4".to_vec()), PATH, NOW, "malformed"),
        (
            Some(good.replace('.', ",").into_bytes()),
            PATH,
            NOW,
            "malformed",
        ),
        (
            Some(good.to_uppercase().into_bytes()),
            PATH,
            NOW,
            "malformed",
        ),
        (
            Some(format!("-{good}").into_bytes()),
            PATH,
            NOW,
            "malformed",
        ),
        (
            Some(format!("{good}0").into_bytes()),
            PATH,
            NOW,
            "malformed",
        ),
        (Some(vec![0xff; 40]), PATH, NOW, "malformed"),
        (
            Some(format!("99999999999999999999999.{}", &good[14..]).into_bytes()),
            PATH,
            NOW,
            "malformed",
        ),
        // Another method, another secret, a changed time.
        (
            Some(good.clone().into_bytes()),
            "/kvmesh.internal.v1.Decode/Abort",
            NOW,
            "bad_mac",
        ),
        (
            Some(sign(&secret(), PATH, NODE, b"b", NOW).token.into_bytes()),
            PATH,
            NOW,
            "bad_mac",
        ),
        (
            Some(
                good.replacen(&NOW.to_string(), &(NOW + 1).to_string(), 1)
                    .into_bytes(),
            ),
            PATH,
            NOW,
            "bad_mac",
        ),
        (
            Some(
                sign(&MeshSecret::insecure(), PATH, NODE, b"b", NOW)
                    .token
                    .into_bytes(),
            ),
            PATH,
            NOW,
            "bad_mac",
        ),
        // Honest but outside the window, either way.
        (Some(good.clone().into_bytes()), PATH, NOW + 60_001, "stale"),
        (Some(good.clone().into_bytes()), PATH, NOW - 60_001, "stale"),
    ];
    for (i, (token, path, now, kind)) in cases.iter().enumerate() {
        let e = v
            .check(token.as_deref(), path, &d, *now)
            .expect_err("refused");
        assert_eq!(e.kind(), *kind, "case {i}: {e}");
    }
    let counts = v.refused();
    assert_eq!(
        counts,
        [
            ("missing", 1),
            ("malformed", 9),
            ("bad_mac", 4),
            ("stale", 2),
            ("replayed", 0)
        ]
    );
    // The window's edges are inside it.
    assert!(v
        .check(Some(good.as_bytes()), PATH, &d, NOW + 60_000)
        .is_ok());
}

#[test]
fn a_full_replay_cache_stays_bounded_and_never_admits_a_replay() {
    let s = secret();
    let v = CallVerifier::with_capacity(s.clone(), NODE, 4);
    let d = body_digest(b"");
    let tokens: Vec<String> = (0..8)
        .map(|i| sign(&s, PATH, NODE, b"", NOW + i).token)
        .collect();
    for t in &tokens {
        assert!(v.check(Some(t.as_bytes()), PATH, &d, NOW + 10).is_ok());
    }
    assert!(v.replay.lock().expect("lock").seen.len() <= 4);
    // Every earlier token is refused: the evicted ones as stale, the
    // remembered ones as replays.
    for (i, t) in tokens.iter().enumerate() {
        let e = v
            .check(Some(t.as_bytes()), PATH, &d, NOW + 10)
            .expect_err("replay");
        let want = if i < 4 { "stale" } else { "replayed" };
        assert_eq!(e.kind(), want, "token {i}");
    }
    // Fresh tokens still pass.
    let fresh = sign(&s, PATH, NODE, b"", NOW + 20).token;
    assert!(v.check(Some(fresh.as_bytes()), PATH, &d, NOW + 20).is_ok());
    // Entries past the window are dropped as time moves on.
    let later = sign(&s, PATH, NODE, b"", NOW + 200_000).token;
    assert!(v
        .check(Some(later.as_bytes()), PATH, &d, NOW + 200_000)
        .is_ok());
    assert_eq!(v.replay.lock().expect("lock").seen.len(), 1);
}
