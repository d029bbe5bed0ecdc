//! The opening of a transport connection, both sides: the decode node's
//! Challenge, the writer's Hello with its proof, the decode node's Welcome
//! with its own (the protocol and its reasons: [`kvmesh_meshauth::kv`]).

use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};

use kvmesh_kvwire::control::HELLO_LEN;
use kvmesh_kvwire::{
    decode, peek_header, Challenge, DecodeLimits, Hello, Message, MessageType, Welcome, WriterId,
    HEADER_LEN, NONCE_LEN, TRAILER_LEN,
};
use kvmesh_meshauth::kv::{hello_ok, hello_proof, mint_nonce, welcome_ok};
use kvmesh_meshauth::{KvAuthRefusal, MeshSecret};

use super::stream::read_message;
use super::TransportError;

/// Decode side: sends the Challenge, then reads the first message, which
/// must be a Hello whose proof verifies. Nothing else is read: anything
/// but a Hello of the Hello's size is refused from its header, before its
/// body, so an unauthenticated peer makes this node read and hold nothing
/// beyond one header and one Hello.
pub(crate) async fn authenticate<R, W>(
    rd: &mut R,
    wr: &mut W,
    buf: &mut Vec<u8>,
    limits: &DecodeLimits,
    secret: &MeshSecret,
    challenge: [u8; NONCE_LEN],
) -> Result<Hello, KvAuthRefusal>
where
    R: AsyncRead + Unpin,
    W: AsyncWrite + Unpin,
{
    let mut bytes = Vec::new();
    Challenge { nonce: challenge }
        .encode(&mut bytes)
        .map_err(|_| KvAuthRefusal::Malformed)?;
    wr.write_all(&bytes)
        .await
        .map_err(|_| KvAuthRefusal::Closed)?;
    buf.clear();
    buf.resize(HEADER_LEN, 0);
    rd.read_exact(buf)
        .await
        .map_err(|_| KvAuthRefusal::Closed)?;
    let header = peek_header(buf, limits).map_err(|_| KvAuthRefusal::Malformed)?;
    match MessageType::from_tag(header.tag) {
        Ok(MessageType::Hello) => {}
        Ok(other) => return Err(KvAuthRefusal::BeforeHello(other)),
        Err(_) => return Err(KvAuthRefusal::Malformed),
    }
    let len = header.message_len();
    if len != HEADER_LEN + HELLO_LEN + TRAILER_LEN {
        return Err(KvAuthRefusal::Malformed);
    }
    buf.resize(len, 0);
    rd.read_exact(&mut buf[HEADER_LEN..])
        .await
        .map_err(|_| KvAuthRefusal::Closed)?;
    match decode(buf, limits) {
        Ok((Message::Hello(h), _)) if hello_ok(secret, &challenge, &h) => Ok(h),
        Ok((Message::Hello(_), _)) => Err(KvAuthRefusal::BadProof),
        Ok((other, _)) => Err(KvAuthRefusal::BeforeHello(other.message_type())),
        Err(_) => Err(KvAuthRefusal::Malformed),
    }
}

/// Writer side: answers the Challenge with a Hello as `writer`, and
/// accepts the Welcome only if its proof verifies: the decode node is of
/// this mesh. The caller bounds the time.
pub(crate) async fn greet<R, W>(
    rd: &mut R,
    wr: &mut W,
    writer: WriterId,
    secret: &MeshSecret,
) -> Result<Welcome, TransportError>
where
    R: AsyncRead + Unpin,
    W: AsyncWrite + Unpin,
{
    let limits = DecodeLimits::default();
    let mut buf = Vec::new();
    if !read_message(rd, &mut buf, &limits).await? {
        return Err(TransportError::Closed);
    }
    let challenge = match decode(&buf, &limits)?.0 {
        Message::Challenge(c) => c.nonce,
        other => return Err(unexpected("challenge", &other)),
    };
    let nonce = mint_nonce()?;
    let hello = Hello {
        writer,
        nonce,
        proof: hello_proof(secret, &challenge, &nonce, writer),
    };
    let mut bytes = Vec::new();
    hello.encode(&mut bytes)?;
    wr.write_all(&bytes)
        .await
        .map_err(|source| TransportError::Io {
            op: "send hello",
            source,
        })?;
    // The decode node hangs up on a Hello it does not accept.
    if !read_message(rd, &mut buf, &limits).await? {
        return Err(TransportError::Unauthenticated(
            "the decode node closed the connection after Hello: it holds another mesh secret",
        ));
    }
    let welcome = match decode(&buf, &limits)?.0 {
        Message::Welcome(w) => w,
        other => return Err(unexpected("welcome", &other)),
    };
    if !welcome_ok(secret, &challenge, &hello, &welcome) {
        return Err(TransportError::Unauthenticated(
            "the decode node's Welcome does not prove this mesh's secret",
        ));
    }
    Ok(welcome)
}

fn unexpected(want: &str, got: &Message<'_>) -> TransportError {
    TransportError::Protocol(format!("expected {want}, got {:?}", got.message_type()))
}
