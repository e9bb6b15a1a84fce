//! Call-protocol frames: encoding and checked decoding.
//!
//! Implements `docs/wire-protocol.md` §1.2–§1.4. Every decoder here reads
//! bytes that came from the network: it checks each length before reading,
//! never panics, and turns anything malformed into a [`FrameError`].

use crate::arena;
use bytes::{Buf, BufMut, Bytes, BytesMut};
use http::{HeaderMap, HeaderName, HeaderValue};
use std::time::Duration;

/// Protocol version carried in HELLO (§1.1). A peer with another major version is refused.
pub const PROTOCOL_VERSION: u16 = 1;
/// Size of the fixed frame header: type (1), flags (1), stream id (4).
pub const HEADER_LEN: usize = 6;

/// Frame types (§1.2). Unknown types are ignored by the receiver.
pub mod kind {
    /// Connection preface: version, features, limits.
    pub const HELLO: u8 = 0x01;
    /// Opens a call: method path, deadline, request metadata.
    pub const OPEN: u8 = 0x02;
    /// Response headers (initial metadata).
    pub const HEADERS: u8 = 0x03;
    /// gRPC body bytes (5-byte prefixed messages, possibly split across frames).
    pub const DATA: u8 = 0x04;
    /// Response trailers: ends the call (grpc-status, grpc-message, ...).
    pub const TRAILERS: u8 = 0x05;
    /// Abandons a call, either direction.
    pub const RESET: u8 = 0x06;
    /// Returns flow-control credit for a call's DATA bytes.
    pub const WINDOW_UPDATE: u8 = 0x07;
    /// The sender takes no new calls; calls up to `last_stream_id` finish.
    pub const GOAWAY: u8 = 0x08;
    /// Several frames in one connection message (§1.7).
    pub const BATCH: u8 = 0x09;
}

/// HELLO feature bit: the sender understands BATCH frames (§1.7).
pub const FEATURE_BATCH: u32 = 0x1;

/// DATA flag: the sender half-closes its side of the call after this frame.
pub const FLAG_END_STREAM: u8 = 0x01;

/// Limits applied while decoding (§1.5).
#[derive(Debug, Clone, Copy)]
pub struct DecodeLimits {
    /// Largest total of metadata names + values in one OPEN/HEADERS/TRAILERS, bytes.
    pub max_metadata_bytes: usize,
}

/// Why a frame could not be decoded: one variant per rule of §1.2–§1.5, with
/// the values that broke it. The connection is closed with it (see
/// [`PeerMisbehaved::Malformed`](crate::PeerMisbehaved::Malformed)).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum FrameError {
    /// The frame ended before a field it announces (the frame type is named).
    #[error("truncated {0} frame")]
    Truncated(&'static str),
    /// A frame that belongs to a call carries stream id 0 (§1.2).
    #[error("{0} frame on stream id 0")]
    StreamZero(&'static str),
    /// A string field is not UTF-8 (§1.2).
    #[error("{0} is not UTF-8")]
    NotUtf8(&'static str),
    /// OPEN's method path does not start with `/` (§1.3).
    #[error("method path {0:?} does not start with '/'")]
    BadMethodPath(String),
    /// A metadata name is not a valid lower-case HTTP header name (§1.3).
    #[error("invalid metadata name {0:?}")]
    BadMetadataName(String),
    /// A metadata value has bytes an HTTP header value cannot hold (§1.3).
    #[error("invalid metadata value for {0}")]
    BadMetadataValue(String),
    /// WINDOW_UPDATE with an increment of 0 (§1.4).
    #[error("WINDOW_UPDATE with increment 0")]
    ZeroWindowIncrement,
    /// A BATCH inside a BATCH (§1.7).
    #[error("nested BATCH")]
    NestedBatch,
    /// The metadata of one frame exceeds the receiver's limit (§1.5).
    #[error("metadata of {got} bytes exceeds the limit of {limit} bytes")]
    MetadataTooLarge {
        /// Bytes the frame carries (or so far).
        got: usize,
        /// The receiver's limit.
        limit: usize,
    },
}

/// Why a metadata block cannot be sent to the peer (checked before encoding, §1.5).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum MetadataError {
    /// Names + values exceed the limit the peer advertised in its HELLO.
    #[error("metadata of {got} bytes exceeds the peer's limit of {limit} bytes")]
    TooLarge {
        /// Bytes of names + values.
        got: usize,
        /// The peer's `max_metadata_bytes`.
        limit: usize,
    },
    /// More entries than the 16-bit count of §1.3 can carry.
    #[error("{count} metadata entries, more than the {max} one frame can carry")]
    TooManyEntries {
        /// Entries (values) in the map.
        count: usize,
        /// [`MAX_METADATA_ENTRIES`].
        max: usize,
    },
}

/// Most metadata entries one OPEN/HEADERS/TRAILERS carries (a u16 count, §1.3).
pub const MAX_METADATA_ENTRIES: usize = u16::MAX as usize;

/// Checks `md` against the peer's `limit` (names + values, §1.5) and the
/// entry count the frame can carry; returns the bytes it counts.
pub fn check_metadata(md: &HeaderMap, limit: usize) -> Result<usize, MetadataError> {
    if md.len() > MAX_METADATA_ENTRIES {
        return Err(MetadataError::TooManyEntries {
            count: md.len(),
            max: MAX_METADATA_ENTRIES,
        });
    }
    let got = metadata_bytes(md);
    if got > limit {
        return Err(MetadataError::TooLarge { got, limit });
    }
    Ok(got)
}

/// HELLO settings (§1.1).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Hello {
    /// [`PROTOCOL_VERSION`] of the sender.
    pub version: u16,
    /// Feature bits the sender supports; the connection uses the intersection.
    pub features: u32,
    /// Calls the sender accepts at once (server) / will open at once (client).
    pub max_concurrent_calls: u32,
    /// DATA bytes per call the sender accepts before it returns credit.
    pub initial_window: u32,
    /// Largest metadata block the sender accepts.
    pub max_metadata_bytes: u32,
    /// DATA bytes the sender accepts on the whole connection before it returns credit.
    pub connection_window: u32,
}

/// How a decoded OPEN holds its method path: a `String` ([`decode`]), or
/// the frame's own bytes (the session's decoder, no copy).
pub trait MethodPath: Sized {
    /// `b` is UTF-8 and starts with `/` (checked by the decoder).
    fn from_checked(b: Bytes) -> Self;
}

impl MethodPath for String {
    fn from_checked(b: Bytes) -> String {
        String::from_utf8_lossy(&b).into_owned()
    }
}

impl MethodPath for Bytes {
    fn from_checked(b: Bytes) -> Bytes {
        b
    }
}

/// A decoded frame; `P` holds OPEN's method path (see [`MethodPath`]).
#[derive(Debug, Clone, PartialEq)]
pub enum Frame<P = String> {
    /// §1.1
    Hello(Hello),
    /// §1.3
    Open {
        /// Call id.
        stream: u32,
        /// `/package.Service/Method`.
        path: P,
        /// Time the caller allows, from when it sent OPEN.
        timeout: Option<Duration>,
        /// Request metadata.
        metadata: HeaderMap,
        /// No request body follows.
        end_stream: bool,
    },
    /// §1.3
    Headers {
        /// Call id.
        stream: u32,
        /// Response metadata.
        metadata: HeaderMap,
    },
    /// §1.3
    Data {
        /// Call id.
        stream: u32,
        /// Body bytes.
        data: Bytes,
        /// Sender half-closes.
        end_stream: bool,
    },
    /// §1.3
    Trailers {
        /// Call id.
        stream: u32,
        /// Trailing metadata, including `grpc-status`.
        metadata: HeaderMap,
    },
    /// §1.3
    Reset {
        /// Call id.
        stream: u32,
        /// gRPC status code.
        code: u32,
        /// Human-readable reason.
        message: String,
    },
    /// §1.4
    WindowUpdate {
        /// Call id; 0 = the connection's window.
        stream: u32,
        /// Bytes of credit returned.
        increment: u32,
    },
    /// §1.6
    GoAway {
        /// Highest call id that will still be processed.
        last_stream: u32,
        /// gRPC status code explaining why (0 = graceful shutdown).
        code: u32,
        /// Reason.
        message: String,
    },
    /// §1.7: frames carried in one connection message, each still encoded
    /// (their boundaries checked; iterate to take them, no list is built).
    Batch(BatchParts),
    /// A frame type this version does not know; ignored (§1.2).
    Unknown(u8),
}

fn header(buf: &mut BytesMut, kind: u8, flags: u8, stream: u32) {
    buf.put_u8(kind);
    buf.put_u8(flags);
    buf.put_u32(stream);
}

/// What [`OK_TRAILERS`] counts against `max_metadata_bytes` (name and value).
const OK_TRAILERS_COUNTED: usize = "grpc-status".len() + "0".len();

/// The metadata block of the TRAILERS that end most calls: one entry,
/// `grpc-status: 0` (§1.3).
const OK_TRAILERS: &[u8] = b"\x00\x01\x00\x0bgrpc-status\x00\x00\x00\x010";

/// The stream of `f` if it is exactly a TRAILERS frame whose only entry is
/// `grpc-status: 0` and [`decode`] would accept it under `limits` (a call's
/// usual end, recognized without building a map); `None` for anything
/// else, which goes through [`decode`].
pub fn ok_trailers_stream(f: &[u8], limits: &DecodeLimits) -> Option<u32> {
    let stream = u32::from_be_bytes(f.get(2..HEADER_LEN)?.try_into().ok()?);
    let ok = f.len() == HEADER_LEN + OK_TRAILERS.len()
        && f[0] == kind::TRAILERS
        && f[1] == 0
        && stream != 0
        && &f[HEADER_LEN..] == OK_TRAILERS
        && limits.max_metadata_bytes >= OK_TRAILERS_COUNTED;
    ok.then_some(stream)
}

/// Encodes HELLO.
pub fn encode_hello(h: &Hello) -> Bytes {
    let mut b = BytesMut::with_capacity(HEADER_LEN + 22);
    header(&mut b, kind::HELLO, 0, 0);
    b.put_u16(h.version);
    b.put_u32(h.features);
    b.put_u32(h.max_concurrent_calls);
    b.put_u32(h.initial_window);
    b.put_u32(h.max_metadata_bytes);
    b.put_u32(h.connection_window);
    b.freeze()
}

/// Size a metadata block takes on the wire, and the bytes that count against the limit.
fn metadata_size(md: &HeaderMap) -> (usize, usize) {
    metadata_size_with(md, &[])
}

/// [`metadata_size`] of `md` followed by the `extra` entries.
fn metadata_size_with(md: &HeaderMap, extra: &[(&str, &[u8])]) -> (usize, usize) {
    let mut wire = 2;
    let mut counted = 0;
    let entries = md
        .iter()
        .map(|(k, v)| (k.as_str(), v.as_bytes()))
        .chain(extra.iter().copied());
    for (k, v) in entries {
        wire += 2 + k.len() + 4 + v.len();
        counted += k.len() + v.len();
    }
    (wire, counted)
}

/// [`check_metadata`] of `md` followed by the `extra` entries; returns
/// the size the block takes on the wire.
pub fn check_metadata_with(
    md: &HeaderMap,
    extra: &[(&str, &[u8])],
    limit: usize,
) -> Result<usize, MetadataError> {
    let count = md.len() + extra.len();
    if count > MAX_METADATA_ENTRIES {
        return Err(MetadataError::TooManyEntries {
            count,
            max: MAX_METADATA_ENTRIES,
        });
    }
    let (wire, got) = metadata_size_with(md, extra);
    if got > limit {
        return Err(MetadataError::TooLarge { got, limit });
    }
    Ok(wire)
}

/// Bytes a metadata map counts against `max_metadata_bytes` (names + values).
pub fn metadata_bytes(md: &HeaderMap) -> usize {
    metadata_size(md).1
}

/// Writes a metadata block (§1.3). `md` has passed [`check_metadata`], so the
/// count fits in u16; a header name is at most 64 KiB - 1 (`http`'s limit) and
/// a value's length fits in u32 (checked all the same, never truncated).
fn put_metadata(
    b: &mut BytesMut,
    md: &HeaderMap,
    extra: &[(&str, &[u8])],
) -> Result<(), MetadataError> {
    let count = md.len() + extra.len();
    let too_many = || MetadataError::TooManyEntries {
        count,
        max: MAX_METADATA_ENTRIES,
    };
    b.put_u16(u16::try_from(count).map_err(|_| too_many())?);
    let entries = md
        .iter()
        .map(|(k, v)| (k.as_str(), v.as_bytes()))
        .chain(extra.iter().copied());
    for (k, v) in entries {
        let too_large = || MetadataError::TooLarge {
            got: metadata_size_with(md, extra).1,
            limit: u32::MAX as usize,
        };
        b.put_u16(u16::try_from(k.len()).map_err(|_| too_large())?);
        b.put_slice(k.as_bytes());
        b.put_u32(u32::try_from(v.len()).map_err(|_| too_large())?);
        b.put_slice(v);
    }
    Ok(())
}

/// The longest prefix of `s` that fits a u16 length and ends on a character
/// boundary, so that a truncated string is still UTF-8 for the peer (§1.2).
fn truncate_utf8(s: &str) -> &str {
    let mut n = s.len().min(u16::MAX as usize);
    while !s.is_char_boundary(n) {
        n -= 1;
    }
    &s[..n]
}

fn put_string(b: &mut BytesMut, s: &str) {
    let s = truncate_utf8(s);
    // Cannot fail: `truncate_utf8` returns at most u16::MAX bytes.
    b.put_u16(u16::try_from(s.len()).unwrap_or(u16::MAX));
    b.put_slice(s.as_bytes());
}

/// Encodes OPEN, after checking the metadata against the peer's limit
/// (`max_metadata_bytes` of its HELLO, §1.5). A method path longer than 64 KiB
/// is truncated (at a character boundary): the server then answers UNIMPLEMENTED.
pub fn encode_open(
    stream: u32,
    path: &str,
    timeout: Option<Duration>,
    md: &HeaderMap,
    end_stream: bool,
    limit: usize,
) -> Result<Bytes, MetadataError> {
    encode_open_with(stream, path, timeout, md, &[], end_stream, limit)
}

/// [`encode_open`] with `extra` metadata entries after `md`'s (valid
/// lowercase names and values, e.g. a default `user-agent`), without
/// adding them to a map.
pub fn encode_open_with(
    stream: u32,
    path: &str,
    timeout: Option<Duration>,
    md: &HeaderMap,
    extra: &[(&str, &[u8])],
    end_stream: bool,
    limit: usize,
) -> Result<Bytes, MetadataError> {
    let mdlen = check_metadata_with(md, extra, limit)?;
    arena::build(HEADER_LEN + 8 + 2 + path.len() + mdlen, |b| {
        header(
            b,
            kind::OPEN,
            if end_stream { FLAG_END_STREAM } else { 0 },
            stream,
        );
        put_open_payload(b, path, timeout, md, extra)
    })
}

/// OPEN's payload (§1.3): the timeout, the method path (truncated as
/// [`put_string`] does) and the metadata block.
fn put_open_payload(
    b: &mut BytesMut,
    path: &str,
    timeout: Option<Duration>,
    md: &HeaderMap,
    extra: &[(&str, &[u8])],
) -> Result<(), MetadataError> {
    let micros = timeout.map_or(0, |t| t.as_micros().clamp(1, u64::MAX as u128) as u64);
    b.put_u64(micros);
    put_string(b, path);
    put_metadata(b, md, extra)
}

/// Encodes HEADERS or TRAILERS, after checking the metadata against the
/// peer's limit (`max_metadata_bytes` of its HELLO, §1.5): a block the peer
/// would refuse is an error here, for the caller to fail only that call.
pub fn encode_metadata_frame(
    kind: u8,
    stream: u32,
    md: &HeaderMap,
    limit: usize,
) -> Result<Bytes, MetadataError> {
    encode_metadata_frame_with(kind, stream, md, &[], limit)
}

/// [`encode_metadata_frame`] with `extra` entries after `md`'s (valid
/// lowercase names and values, e.g. `grpc-status: 0`), without adding
/// them to a map.
pub fn encode_metadata_frame_with(
    kind: u8,
    stream: u32,
    md: &HeaderMap,
    extra: &[(&str, &[u8])],
    limit: usize,
) -> Result<Bytes, MetadataError> {
    let mdlen = check_metadata_with(md, extra, limit)?;
    arena::build(HEADER_LEN + mdlen, |b| {
        header(b, kind, 0, stream);
        put_metadata(b, md, extra)
    })
}

/// Encodes DATA (copies `data` behind the header).
pub fn encode_data(stream: u32, data: &[u8], end_stream: bool) -> Bytes {
    encode_data_joined(stream, data, &[], end_stream)
}

/// Encodes DATA whose payload is `a` then `b`.
pub fn encode_data_joined(stream: u32, a: &[u8], b: &[u8], end_stream: bool) -> Bytes {
    arena::fill(HEADER_LEN + a.len() + b.len(), |buf| {
        header(
            buf,
            kind::DATA,
            if end_stream { FLAG_END_STREAM } else { 0 },
            stream,
        );
        buf.put_slice(a);
        buf.put_slice(b);
    })
}

/// The 6-byte header of a DATA frame whose payload is sent after it as a
/// separate part (a gather, [`FrameSender::send_parts`](crate::conn::FrameSender::send_parts)):
/// `encode_data_head(s, e) ++ data == encode_data(s, data, e)`.
pub fn encode_data_head(stream: u32, end_stream: bool) -> Bytes {
    arena::fill(HEADER_LEN, |b| {
        header(
            b,
            kind::DATA,
            if end_stream { FLAG_END_STREAM } else { 0 },
            stream,
        )
    })
}

/// Encodes RESET.
pub fn encode_reset(stream: u32, code: u32, message: &str) -> Bytes {
    let mut b = BytesMut::with_capacity(HEADER_LEN + 6 + message.len());
    header(&mut b, kind::RESET, 0, stream);
    b.put_u32(code);
    put_string(&mut b, message);
    b.freeze()
}

/// Encodes WINDOW_UPDATE.
pub fn encode_window_update(stream: u32, increment: u32) -> Bytes {
    let mut b = BytesMut::with_capacity(HEADER_LEN + 4);
    header(&mut b, kind::WINDOW_UPDATE, 0, stream);
    b.put_u32(increment);
    b.freeze()
}

/// Encodes GOAWAY.
pub fn encode_goaway(last_stream: u32, code: u32, message: &str) -> Bytes {
    let mut b = BytesMut::with_capacity(HEADER_LEN + 10 + message.len());
    header(&mut b, kind::GOAWAY, 0, 0);
    b.put_u32(last_stream);
    b.put_u32(code);
    put_string(&mut b, message);
    b.freeze()
}

/// Encodes BATCH: each frame behind its u32 length (§1.7).
pub fn encode_batch(frames: &[Bytes]) -> Bytes {
    let len = HEADER_LEN + frames.iter().map(|f| 4 + f.len()).sum::<usize>();
    batch_with(len, |b| {
        for f in frames {
            put_batch_part(b, f);
        }
    })
}

/// A BATCH of about `len` bytes (§1.7): its header, then `parts` appends
/// each frame with [`put_batch_part`].
pub fn batch_with(len: usize, parts: impl FnOnce(&mut BytesMut)) -> Bytes {
    arena::fill(len, |b| {
        header(b, kind::BATCH, 0, 0);
        parts(b);
    })
}

/// As [`batch_with`], in a buffer of its own (for a message that may wait:
/// not a piece of the thread's frame buffer, which it would keep alive).
pub fn batch_owned(len: usize, parts: impl FnOnce(&mut BytesMut)) -> Bytes {
    let mut b = BytesMut::with_capacity(len);
    header(&mut b, kind::BATCH, 0, 0);
    parts(&mut b);
    b.freeze()
}

/// Appends one frame to a BATCH behind its u32 length (§1.7). The caller
/// keeps the message under the connection's frame limit, far below 4 GiB.
pub fn put_batch_part(b: &mut BytesMut, f: &[u8]) {
    b.put_u32(f.len() as u32);
    b.put_slice(f);
}

/// The length a BATCH part of a frame with `n` payload bytes carries. The
/// callers keep the whole message within `max_batch_bytes`: it fits.
fn part_len(n: usize) -> u32 {
    u32::try_from(HEADER_LEN + n).unwrap_or(u32::MAX)
}

/// Appends to a BATCH a DATA frame carrying `a ++ b`, behind its length.
fn put_data_part(buf: &mut BytesMut, stream: u32, end_stream: bool, a: &[u8], b: &[u8]) {
    buf.put_u32(part_len(a.len() + b.len()));
    let flags = if end_stream { FLAG_END_STREAM } else { 0 };
    header(buf, kind::DATA, flags, stream);
    buf.put_slice(a);
    buf.put_slice(b);
}

/// Checks a unary reply's metadata against the peer's `limit` as
/// [`encode_metadata_frame`] does, the HEADERS' (`md` then `extra`) and
/// the TRAILERS `grpc-status: 0`; returns the HEADERS block's size on the
/// wire, for [`unary_reply_len`] and [`encode_unary_reply`].
pub fn check_unary_reply(
    md: &HeaderMap,
    extra: &[(&str, &[u8])],
    limit: usize,
) -> Result<usize, MetadataError> {
    let md_wire = check_metadata_with(md, extra, limit)?;
    if OK_TRAILERS_COUNTED > limit {
        return Err(MetadataError::TooLarge {
            got: OK_TRAILERS_COUNTED,
            limit,
        });
    }
    Ok(md_wire)
}

/// Bytes [`encode_unary_reply`] makes for a HEADERS metadata block of
/// `md_wire` bytes ([`check_unary_reply`]) and a DATA payload of `data`.
pub fn unary_reply_len(md_wire: usize, data: usize) -> usize {
    HEADER_LEN
        + (4 + HEADER_LEN + md_wire)
        + (4 + HEADER_LEN + data)
        + (4 + HEADER_LEN + OK_TRAILERS.len())
}

/// A unary call's whole reply as one BATCH (§1.3, §1.7): HEADERS with
/// `md` then `extra`, one DATA carrying `a ++ b` (without END_STREAM: the
/// TRAILERS end the call) and the TRAILERS `grpc-status: 0`, written
/// straight into one message instead of three frames batched afterwards.
/// The peer reads exactly the three frames in order (§1.7). `md_wire` is
/// what [`check_unary_reply`] returned for this metadata, which is not
/// walked again to check it; the caller keeps the message within
/// `max_batch_bytes` ([`unary_reply_len`]).
pub fn encode_unary_reply(
    stream: u32,
    md: &HeaderMap,
    extra: &[(&str, &[u8])],
    md_wire: usize,
    a: &[u8],
    b: &[u8],
) -> Result<Bytes, MetadataError> {
    arena::build(unary_reply_len(md_wire, a.len() + b.len()), |buf| {
        header(buf, kind::BATCH, 0, 0);
        buf.put_u32(part_len(md_wire));
        header(buf, kind::HEADERS, 0, stream);
        put_metadata(buf, md, extra)?;
        put_data_part(buf, stream, false, a, b);
        buf.put_u32(part_len(OK_TRAILERS.len()));
        header(buf, kind::TRAILERS, 0, stream);
        buf.put_slice(OK_TRAILERS);
        Ok(())
    })
}

/// Bytes [`encode_open_request`] makes for a metadata block of `md_wire`
/// bytes ([`check_metadata_with`]) and a request of `data` bytes.
pub fn open_request_len(path: &str, md_wire: usize, data: usize) -> usize {
    HEADER_LEN
        + (4 + HEADER_LEN + 8 + 2 + truncate_utf8(path).len() + md_wire)
        + (4 + HEADER_LEN + data)
}

/// A call's OPEN (without END_STREAM) and its whole request, one DATA
/// carrying `a ++ b` with END_STREAM, as one BATCH (§1.3, §1.7), written
/// straight into one message instead of two frames batched afterwards.
/// `md_wire` is what [`check_metadata_with`] returned for `md` and
/// `extra` against the peer's limit (not checked again here); the caller
/// keeps the message within `max_batch_bytes` ([`open_request_len`]).
#[allow(clippy::too_many_arguments)]
pub fn encode_open_request(
    stream: u32,
    path: &str,
    timeout: Option<Duration>,
    md: &HeaderMap,
    extra: &[(&str, &[u8])],
    md_wire: usize,
    a: &[u8],
    b: &[u8],
) -> Result<Bytes, MetadataError> {
    let path = truncate_utf8(path);
    arena::build(open_request_len(path, md_wire, a.len() + b.len()), |buf| {
        header(buf, kind::BATCH, 0, 0);
        buf.put_u32(part_len(8 + 2 + path.len() + md_wire));
        header(buf, kind::OPEN, 0, stream);
        put_open_payload(buf, path, timeout, md, extra)?;
        put_data_part(buf, stream, true, a, b);
        Ok(())
    })
}

/// The frames of a BATCH (§1.7), in order, each still encoded. Made by
/// [`decode`], which checked every boundary, so iterating cannot fail.
#[derive(Debug, Clone, PartialEq)]
pub struct BatchParts(Bytes);

impl Iterator for BatchParts {
    type Item = Bytes;
    fn next(&mut self) -> Option<Bytes> {
        if self.0.len() < 4 {
            return None;
        }
        let n = self.0.get_u32() as usize;
        // Checked by `decode`; `min` keeps a hand-made value from panicking.
        Some(self.0.split_to(n.min(self.0.len())))
    }
}

/// Checked reads over a frame's payload.
struct Reader<'a> {
    buf: &'a mut Bytes,
    what: &'static str,
}

impl Reader<'_> {
    fn need(&self, n: usize) -> Result<(), FrameError> {
        if self.buf.remaining() < n {
            Err(FrameError::Truncated(self.what))
        } else {
            Ok(())
        }
    }
    fn u16(&mut self) -> Result<u16, FrameError> {
        self.need(2)?;
        Ok(self.buf.get_u16())
    }
    fn u32(&mut self) -> Result<u32, FrameError> {
        self.need(4)?;
        Ok(self.buf.get_u32())
    }
    fn u64(&mut self) -> Result<u64, FrameError> {
        self.need(8)?;
        Ok(self.buf.get_u64())
    }
    fn bytes(&mut self, n: usize) -> Result<Bytes, FrameError> {
        self.need(n)?;
        Ok(self.buf.split_to(n))
    }
    fn string(&mut self, what: &'static str) -> Result<String, FrameError> {
        let n = self.u16()? as usize;
        let b = self.bytes(n)?;
        String::from_utf8(b.to_vec()).map_err(|_| FrameError::NotUtf8(what))
    }
    /// `spare`: room for entries the receiver adds (the server adds up to
    /// three to a call's request metadata), so the map does not grow.
    fn metadata(&mut self, limits: &DecodeLimits, spare: usize) -> Result<HeaderMap, FrameError> {
        let count = self.u16()? as usize;
        let mut md = HeaderMap::with_capacity(count.min(64) + spare);
        let mut total = 0usize;
        for _ in 0..count {
            let klen = self.u16()? as usize;
            total += klen;
            if total > limits.max_metadata_bytes {
                return Err(FrameError::MetadataTooLarge {
                    got: total,
                    limit: limits.max_metadata_bytes,
                });
            }
            self.need(klen)?;
            // The name is read in place (a known one needs no bytes of its
            // own); a bad one is reported after the value's checks, as
            // when it was read after the value.
            let k = &self.buf[..klen];
            let name = known_name(k).map_or_else(
                || {
                    HeaderName::from_bytes(k).map_err(|_| {
                        FrameError::BadMetadataName(String::from_utf8_lossy(k).into_owned())
                    })
                },
                Ok,
            );
            self.buf.advance(klen);
            let vlen = self.u32()? as usize;
            total = total.saturating_add(vlen);
            if total > limits.max_metadata_bytes {
                return Err(FrameError::MetadataTooLarge {
                    got: total,
                    limit: limits.max_metadata_bytes,
                });
            }
            let v = self.bytes(vlen)?;
            let name = name?;
            let value = HeaderValue::from_maybe_shared(v)
                .map_err(|_| FrameError::BadMetadataValue(name.to_string()))?;
            md.append(name, value);
        }
        Ok(md)
    }
}

/// The metadata names that calls carry most, without parsing them:
/// `HeaderName::from_bytes` copies every name `http` does not know into a
/// new allocation, and finds the ones it knows (`content-type`, `te`,
/// `user-agent`) through its whole table of standard names.
fn known_name(k: &[u8]) -> Option<HeaderName> {
    Some(match k {
        b"content-type" => http::header::CONTENT_TYPE,
        b"te" => http::header::TE,
        b"user-agent" => http::header::USER_AGENT,
        b"grpc-status" => const { HeaderName::from_static("grpc-status") },
        b"grpc-message" => const { HeaderName::from_static("grpc-message") },
        b"grpc-status-details-bin" => const { HeaderName::from_static("grpc-status-details-bin") },
        b"grpc-encoding" => const { HeaderName::from_static("grpc-encoding") },
        b"grpc-accept-encoding" => const { HeaderName::from_static("grpc-accept-encoding") },
        b"grpc-timeout" => const { HeaderName::from_static("grpc-timeout") },
        _ => return None,
    })
}

/// Decodes one frame. Never panics; see [`FrameError`].
pub fn decode(frame: Bytes, limits: &DecodeLimits) -> Result<Frame, FrameError> {
    decode_as(frame, limits)
}

/// As [`decode`], with OPEN's method path as `P` (e.g. the frame's own bytes).
pub fn decode_as<P: MethodPath>(
    mut frame: Bytes,
    limits: &DecodeLimits,
) -> Result<Frame<P>, FrameError> {
    if frame.len() < HEADER_LEN {
        return Err(FrameError::Truncated("frame header"));
    }
    let kind = frame.get_u8();
    let flags = frame.get_u8();
    let stream = frame.get_u32();
    let end_stream = flags & FLAG_END_STREAM != 0;
    let nonzero = |what: &'static str| -> Result<(), FrameError> {
        if stream == 0 {
            Err(FrameError::StreamZero(what))
        } else {
            Ok(())
        }
    };
    let mut r = Reader {
        buf: &mut frame,
        what: "",
    };
    let f = match kind {
        kind::HELLO => {
            r.what = "HELLO";
            Frame::Hello(Hello {
                version: r.u16()?,
                features: r.u32()?,
                max_concurrent_calls: r.u32()?,
                initial_window: r.u32()?,
                max_metadata_bytes: r.u32()?,
                connection_window: r.u32()?,
            })
        }
        kind::OPEN => {
            r.what = "OPEN";
            nonzero("OPEN")?;
            let micros = r.u64()?;
            let n = r.u16()? as usize;
            let path = r.bytes(n)?;
            if std::str::from_utf8(&path).is_err() {
                return Err(FrameError::NotUtf8("method path"));
            }
            if !path.starts_with(b"/") {
                return Err(FrameError::BadMethodPath(
                    String::from_utf8_lossy(&path).into_owned(),
                ));
            }
            let path = P::from_checked(path);
            // Room for what the server adds to a call's request metadata
            // (`content-type`, `te`, and `grpc-timeout` when there is a
            // deadline): the map does not grow, and is no larger.
            let metadata = r.metadata(limits, 2 + usize::from(micros != 0))?;
            Frame::Open {
                stream,
                path,
                timeout: (micros != 0).then(|| Duration::from_micros(micros)),
                metadata,
                end_stream,
            }
        }
        kind::HEADERS | kind::TRAILERS => {
            r.what = if kind == kind::HEADERS {
                "HEADERS"
            } else {
                "TRAILERS"
            };
            nonzero(r.what)?;
            // A response's HEADERS keep room for the `grpc-status` its
            // trailers add to them (a unary response's metadata).
            let metadata = r.metadata(limits, usize::from(kind == kind::HEADERS))?;
            if kind == kind::HEADERS {
                Frame::Headers { stream, metadata }
            } else {
                Frame::Trailers { stream, metadata }
            }
        }
        kind::DATA => {
            nonzero("DATA")?;
            Frame::Data {
                stream,
                data: std::mem::take(r.buf),
                end_stream,
            }
        }
        kind::RESET => {
            r.what = "RESET";
            nonzero("RESET")?;
            Frame::Reset {
                stream,
                code: r.u32()?,
                message: r.string("reset message")?,
            }
        }
        kind::WINDOW_UPDATE => {
            r.what = "WINDOW_UPDATE";
            let increment = r.u32()?;
            if increment == 0 {
                return Err(FrameError::ZeroWindowIncrement);
            }
            Frame::WindowUpdate { stream, increment }
        }
        kind::GOAWAY => {
            r.what = "GOAWAY";
            Frame::GoAway {
                last_stream: r.u32()?,
                code: r.u32()?,
                message: r.string("goaway message")?,
            }
        }
        kind::BATCH => {
            // Every boundary is checked here, before any part is used: a
            // malformed BATCH is refused whole (§1.7).
            let mut rest: &[u8] = r.buf;
            while !rest.is_empty() {
                if rest.len() < 4 {
                    return Err(FrameError::Truncated("BATCH"));
                }
                let n = u32::from_be_bytes([rest[0], rest[1], rest[2], rest[3]]) as usize;
                rest = &rest[4..];
                if rest.len() < n {
                    return Err(FrameError::Truncated("BATCH"));
                }
                if rest.first() == Some(&kind::BATCH) && n > 0 {
                    return Err(FrameError::NestedBatch);
                }
                rest = &rest[n..];
            }
            Frame::Batch(BatchParts(std::mem::take(r.buf)))
        }
        other => Frame::Unknown(other),
    };
    Ok(f)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// The reply written as one message is, byte for byte, the BATCH of its
    /// three frames encoded one by one; its size is what `unary_reply_len`
    /// says; a block over the peer's limit is refused, as for HEADERS alone.
    #[test]
    fn a_unary_reply_is_the_batch_of_its_three_frames() {
        let mut md = HeaderMap::new();
        md.insert("x-reply", HeaderValue::from_static("yes"));
        let extra: &[(&str, &[u8])] = &[("content-type", b"application/grpc")];
        let w = check_unary_reply(&md, extra, 1 << 20).unwrap();
        let one = encode_unary_reply(9, &md, extra, w, b"\0\0\0\0\x02", b"hi").unwrap();
        let mut ok = HeaderMap::new();
        ok.insert("grpc-status", HeaderValue::from_static("0"));
        let three = encode_batch(&[
            encode_metadata_frame_with(kind::HEADERS, 9, &md, extra, 1 << 20).unwrap(),
            encode_data(9, b"\0\0\0\0\x02hi", false),
            encode_metadata_frame(kind::TRAILERS, 9, &ok, 1 << 20).unwrap(),
        ]);
        assert_eq!(one, three);
        assert_eq!(one.len(), unary_reply_len(w, 7));
        let parts = match decode(one, &LIM).unwrap() {
            Frame::Batch(p) => p.collect::<Vec<_>>(),
            other => panic!("not a BATCH: {other:?}"),
        };
        assert_eq!(parts.len(), 3);
        assert_eq!(ok_trailers_stream(&parts[2], &LIM), Some(9));
        // "x-reply" + "yes" + "content-type" + "application/grpc" = 38 bytes.
        assert!(matches!(
            check_unary_reply(&md, extra, 37),
            Err(MetadataError::TooLarge { got: 38, limit: 37 })
        ));
        assert!(matches!(
            check_unary_reply(&HeaderMap::new(), &[], 11),
            Err(MetadataError::TooLarge { got: 12, limit: 11 })
        ));
    }

    /// OPEN and the request written as one message are, byte for byte, the
    /// BATCH of the two frames encoded one by one, of the size
    /// `open_request_len` says; metadata over the limit is refused.
    #[test]
    fn an_open_with_its_request_is_the_batch_of_its_two_frames() {
        let mut md = HeaderMap::new();
        md.insert("x-req", HeaderValue::from_static("1"));
        let extra: &[(&str, &[u8])] = &[("user-agent", b"t")];
        let t = Some(Duration::from_millis(1500));
        let w = check_metadata_with(&md, extra, 99).unwrap();
        let one = encode_open_request(5, "/p.S/M", t, &md, extra, w, b"\0\0\0\0\x01", b"z");
        let two = encode_batch(&[
            encode_open_with(5, "/p.S/M", t, &md, extra, false, 99).unwrap(),
            encode_data(5, b"\0\0\0\0\x01z", true),
        ]);
        assert_eq!(one.unwrap(), two);
        assert_eq!(open_request_len("/p.S/M", w, 6), two.len());
        // "x-req" + "1" + "user-agent" + "t" = 17 bytes.
        assert!(matches!(
            check_metadata_with(&md, extra, 16),
            Err(MetadataError::TooLarge { got: 17, limit: 16 })
        ));
    }

    #[test]
    fn ok_trailers_are_recognized_only_when_decode_would_give_the_same() {
        let ok = |stream, md: &HeaderMap, extra: &[(&str, &[u8])]| {
            encode_metadata_frame_with(kind::TRAILERS, stream, md, extra, 1 << 20).unwrap()
        };
        let empty = HeaderMap::new();
        let f = ok(7, &empty, &[("grpc-status", b"0")]);
        assert_eq!(ok_trailers_stream(&f, &LIM), Some(7));
        // What decode makes of the same bytes.
        match decode(f.clone(), &LIM).unwrap() {
            Frame::Trailers { stream, metadata } => {
                assert_eq!(stream, 7);
                assert_eq!(metadata.len(), 1);
                assert_eq!(metadata["grpc-status"], "0");
            }
            other => panic!("{other:?}"),
        }
        // Anything else goes to the decoder.
        let mut two = HeaderMap::new();
        two.insert("x-a", HeaderValue::from_static("b"));
        for f in [
            ok(0, &empty, &[("grpc-status", b"0")]),
            ok(7, &empty, &[("grpc-status", b"1")]),
            ok(7, &two, &[("grpc-status", b"0")]),
            encode_metadata_frame_with(kind::HEADERS, 7, &empty, &[("grpc-status", b"0")], 99)
                .unwrap(),
            f.slice(..f.len() - 1),
        ] {
            assert_eq!(ok_trailers_stream(&f, &LIM), None, "{f:?}");
        }
        let mut flagged = BytesMut::from(&f[..]);
        flagged[1] = FLAG_END_STREAM;
        assert_eq!(ok_trailers_stream(&flagged, &LIM), None);
        // Under a limit the decoder would refuse, so does this.
        let tiny = DecodeLimits {
            max_metadata_bytes: 11,
        };
        assert_eq!(ok_trailers_stream(&f, &tiny), None);
        assert!(decode(f, &tiny).is_err());
    }

    const LIM: DecodeLimits = DecodeLimits {
        max_metadata_bytes: 16 * 1024,
    };

    #[test]
    fn a_data_head_and_its_payload_make_the_data_frame() {
        for end in [false, true] {
            let mut v = encode_data_head(7, end).to_vec();
            v.extend_from_slice(b"payload");
            assert_eq!(v, encode_data(7, b"payload", end).to_vec());
        }
    }

    #[test]
    fn open_round_trip() {
        let mut md = HeaderMap::new();
        md.insert("x-user", "alice".parse().unwrap());
        md.append("x-user", "bob".parse().unwrap());
        md.insert("trace-bin", HeaderValue::from_static("AAE="));
        let b = encode_open(
            7,
            "/helloworld.Greeter/SayHello",
            Some(Duration::from_millis(1500)),
            &md,
            false,
            LIM.max_metadata_bytes,
        )
        .unwrap();
        match decode(b, &LIM).unwrap() {
            Frame::Open {
                stream,
                path,
                timeout,
                metadata,
                end_stream,
            } => {
                assert_eq!(stream, 7);
                assert_eq!(path, "/helloworld.Greeter/SayHello");
                assert_eq!(timeout, Some(Duration::from_millis(1500)));
                assert_eq!(metadata, md);
                assert!(!end_stream);
            }
            f => panic!("decoded {f:?}"),
        }
    }

    #[test]
    fn known_names_decode_to_the_names_http_parses() {
        let names = [
            "content-type",
            "te",
            "user-agent",
            "grpc-status",
            "grpc-message",
            "grpc-status-details-bin",
            "grpc-encoding",
            "grpc-accept-encoding",
            "grpc-timeout",
        ];
        for n in names {
            assert_eq!(
                known_name(n.as_bytes()),
                Some(HeaderName::from_bytes(n.as_bytes()).unwrap())
            );
        }
        assert_eq!(known_name(b"grpc-statu"), None);
        assert_eq!(
            known_name(b"Grpc-Status"),
            None,
            "left to HeaderName::from_bytes"
        );
        let mut md = HeaderMap::new();
        for (i, n) in names.iter().enumerate() {
            md.insert(*n, HeaderValue::from(i));
        }
        md.insert("x-other", HeaderValue::from_static("v"));
        let b = encode_metadata_frame(kind::TRAILERS, 3, &md, LIM.max_metadata_bytes).unwrap();
        match decode(b, &LIM).unwrap() {
            Frame::Trailers { metadata, .. } => assert_eq!(metadata, md),
            f => panic!("decoded {f:?}"),
        }
        // Names outside the table are still checked by `http`.
        let mut raw = BytesMut::new();
        header(&mut raw, kind::TRAILERS, 0, 3);
        raw.put_u16(1);
        raw.put_u16(11);
        raw.put_slice(b"grpc status");
        raw.put_u32(1);
        raw.put_slice(b"0");
        assert!(matches!(
            decode(raw.freeze(), &LIM),
            Err(FrameError::BadMetadataName(_))
        ));
    }

    #[test]
    fn control_frames_round_trip() {
        let h = Hello {
            version: 1,
            features: 3,
            max_concurrent_calls: 100,
            initial_window: 1 << 20,
            max_metadata_bytes: 8192,
            connection_window: 1 << 24,
        };
        assert_eq!(decode(encode_hello(&h), &LIM).unwrap(), Frame::Hello(h));
        assert_eq!(
            decode(encode_reset(5, 1, "cancelled by client"), &LIM).unwrap(),
            Frame::Reset {
                stream: 5,
                code: 1,
                message: "cancelled by client".into()
            }
        );
        assert_eq!(
            decode(encode_window_update(9, 4096), &LIM).unwrap(),
            Frame::WindowUpdate {
                stream: 9,
                increment: 4096
            }
        );
        assert_eq!(
            decode(encode_goaway(11, 0, "shutdown"), &LIM).unwrap(),
            Frame::GoAway {
                last_stream: 11,
                code: 0,
                message: "shutdown".into()
            }
        );
        assert_eq!(
            decode(encode_data(3, b"abc", true), &LIM).unwrap(),
            Frame::Data {
                stream: 3,
                data: Bytes::from_static(b"abc"),
                end_stream: true
            }
        );
    }

    #[test]
    fn metadata_over_limit_is_rejected() {
        let mut md = HeaderMap::new();
        md.insert("x-big", HeaderValue::from_str(&"a".repeat(20_000)).unwrap());
        // The sender refuses to encode it for a peer with a 16 KiB limit...
        assert_eq!(
            encode_metadata_frame(kind::HEADERS, 1, &md, LIM.max_metadata_bytes),
            Err(MetadataError::TooLarge {
                got: 20_005,
                limit: 16 * 1024
            })
        );
        // ...and a receiver with that limit refuses it.
        let b = encode_metadata_frame(kind::HEADERS, 1, &md, usize::MAX).unwrap();
        assert_eq!(
            decode(b, &LIM),
            Err(FrameError::MetadataTooLarge {
                got: 20_005,
                limit: 16 * 1024
            })
        );
    }

    #[test]
    fn metadata_entry_count_is_checked_not_wrapped() {
        // 65536 entries: `as u16` would have written a count of 0 and the
        // entries after it as garbage frames.
        let mut md = HeaderMap::new();
        for i in 0..=MAX_METADATA_ENTRIES {
            md.append("k", HeaderValue::from(i));
        }
        let err = Err(MetadataError::TooManyEntries {
            count: MAX_METADATA_ENTRIES + 1,
            max: MAX_METADATA_ENTRIES,
        });
        assert_eq!(check_metadata(&md, usize::MAX).map(|_| ()), err.clone());
        assert_eq!(
            encode_metadata_frame(kind::TRAILERS, 1, &md, usize::MAX).map(|_| ()),
            err
        );
        assert_eq!(
            encode_open(1, "/a.B/C", None, &md, false, usize::MAX).map(|_| ()),
            err
        );
        // The largest count that fits still round-trips.
        md.remove("k");
        for i in 0..MAX_METADATA_ENTRIES {
            md.append("k", HeaderValue::from(i % 10));
        }
        let b = encode_metadata_frame(kind::TRAILERS, 1, &md, usize::MAX).unwrap();
        let lim = DecodeLimits {
            max_metadata_bytes: usize::MAX,
        };
        match decode(b, &lim).unwrap() {
            Frame::Trailers { metadata, .. } => assert_eq!(metadata.len(), MAX_METADATA_ENTRIES),
            f => panic!("decoded {f:?}"),
        }
    }

    #[test]
    fn long_strings_are_truncated_at_a_char_boundary() {
        // 'é' is 2 bytes: 65535 bytes of it would end in the middle of one.
        let msg = "é".repeat(40_000);
        let b = encode_reset(1, 13, &msg);
        match decode(b, &LIM).unwrap() {
            Frame::Reset { message, .. } => {
                assert_eq!(message.len(), 65_534);
                assert!(msg.starts_with(&message));
            }
            f => panic!("decoded {f:?}"),
        }
        // 4-byte characters, and a path: every cut point decodes.
        for extra in 0..4 {
            let path = format!("/{}{}", "x".repeat(extra), "🦀".repeat(20_000));
            let b = encode_open(3, &path, None, &HeaderMap::new(), false, 0).unwrap();
            match decode(b, &LIM).unwrap() {
                Frame::Open { path: p, .. } => {
                    assert!(p.len() <= u16::MAX as usize && p.len() > u16::MAX as usize - 4);
                    assert!(path.starts_with(&p));
                }
                f => panic!("decoded {f:?}"),
            }
        }
        let b = encode_goaway(0, 0, &"ü".repeat(40_000));
        assert!(matches!(decode(b, &LIM), Ok(Frame::GoAway { .. })));
    }

    #[test]
    fn stream_zero_and_bad_path_rejected() {
        assert_eq!(
            decode(encode_data(0, b"x", false), &LIM),
            Err(FrameError::StreamZero("DATA"))
        );
        let b = encode_open(1, "no-slash", None, &HeaderMap::new(), false, 0).unwrap();
        assert_eq!(
            decode(b, &LIM),
            Err(FrameError::BadMethodPath("no-slash".into()))
        );
        assert_eq!(
            decode(encode_window_update(1, 0), &LIM),
            Err(FrameError::ZeroWindowIncrement)
        );
        assert_eq!(
            decode(Bytes::from_static(&[kind::OPEN, 0, 0]), &LIM),
            Err(FrameError::Truncated("frame header"))
        );
    }

    #[test]
    fn batch_round_trip_and_no_nesting() {
        let a = encode_window_update(1, 5);
        let b = encode_data(3, b"xyz", true);
        let batch = encode_batch(&[a.clone(), b.clone()]);
        match decode(batch.clone(), &LIM).unwrap() {
            Frame::Batch(parts) => assert_eq!(parts.collect::<Vec<_>>(), vec![a, b]),
            f => panic!("decoded {f:?}"),
        }
        assert_eq!(
            decode(encode_batch(&[batch]), &LIM),
            Err(FrameError::NestedBatch)
        );
        // A length running past the end is an error, not a panic.
        let mut bad = BytesMut::from(&encode_batch(&[encode_window_update(1, 5)])[..]);
        bad[HEADER_LEN + 3] = 200;
        assert_eq!(
            decode(bad.freeze(), &LIM),
            Err(FrameError::Truncated("BATCH"))
        );
    }

    proptest! {
        /// Any byte string decodes to a frame or an error, never a panic,
        /// and every truncation of a valid frame is handled.
        #[test]
        fn decode_never_panics(data in proptest::collection::vec(any::<u8>(), 0..256)) {
            let _ = decode(Bytes::from(data), &LIM);
        }

        /// A unary call written whole, request or reply, is the BATCH of its
        /// frames encoded one by one, for any metadata, path, deadline and
        /// payload split, and is the size its `_len` function says.
        #[test]
        fn a_call_written_whole_is_its_frames_batched(
            entries in proptest::collection::vec(("x-[a-z]{1,8}", "[ -~]{0,24}"), 0..5),
            path in "/[a-zA-Z.]{1,20}/[a-zA-Z]{1,12}",
            micros in proptest::option::of(1u64..10_000_000),
            payload in proptest::collection::vec(any::<u8>(), 0..300),
            split in 0usize..300,
            stream in 1u32..1000,
        ) {
            let mut md = HeaderMap::new();
            for (k, v) in &entries {
                md.append(
                    HeaderName::from_bytes(k.as_bytes()).unwrap(),
                    HeaderValue::from_str(v).unwrap(),
                );
            }
            let extra: &[(&str, &[u8])] = &[("user-agent", b"p")];
            let (a, b) = payload.split_at(split.min(payload.len()));
            let t = micros.map(Duration::from_micros);
            let w = check_metadata_with(&md, extra, 1 << 16).unwrap();
            let one = encode_open_request(stream, &path, t, &md, extra, w, a, b).unwrap();
            let two = encode_batch(&[
                encode_open_with(stream, &path, t, &md, extra, false, 1 << 16).unwrap(),
                encode_data(stream, &payload, true),
            ]);
            prop_assert_eq!(&one, &two);
            prop_assert_eq!(
                open_request_len(&path, w, payload.len()),
                one.len()
            );
            let w = check_unary_reply(&md, extra, 1 << 16).unwrap();
            let reply = encode_unary_reply(stream, &md, extra, w, a, b).unwrap();
            let mut ok = HeaderMap::new();
            ok.insert("grpc-status", HeaderValue::from_static("0"));
            let three = encode_batch(&[
                encode_metadata_frame_with(kind::HEADERS, stream, &md, extra, 1 << 16).unwrap(),
                encode_data(stream, &payload, false),
                encode_metadata_frame(kind::TRAILERS, stream, &ok, 1 << 16).unwrap(),
            ]);
            prop_assert_eq!(&reply, &three);
            prop_assert_eq!(unary_reply_len(w, payload.len()), reply.len());
            prop_assert!(matches!(decode(reply, &LIM), Ok(Frame::Batch(_))));
        }

        #[test]
        fn truncated_open_is_an_error(cut in 0usize..60) {
            let mut md = HeaderMap::new();
            md.insert("x-k", "v".parse().unwrap());
            let full = encode_open(1, "/a.B/C", None, &md, false, 1024).unwrap();
            if cut < full.len() {
                let _ = decode(full.slice(..cut), &LIM);
            }
        }
    }
}
