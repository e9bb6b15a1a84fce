//! gRPC's length-prefixed messages (a flag byte and a 4-byte big-endian
//! length before each protobuf message) as the generated direct path
//! encodes and reads them, without tonic's codec buffers. The bytes on
//! the wire are the ones tonic's codec writes and reads, with the same
//! errors for the same faults (an oversized message, a compressed flag
//! without an encoding, a truncated message).

use crate::protocol::body::{Part, RecvBody};
use bytes::{Buf, BufMut, Bytes, BytesMut};
use rdma_transport::kept::{self, KeptBuffers};
use tonic::Status;

/// tonic's default limit on a decoded message (4 MiB), which applies when
/// the generated code sets none.
pub(crate) const DEFAULT_MAX_DECODE: usize = 4 * 1024 * 1024;

/// The 5-byte prefix of every message.
pub(crate) const PREFIX_LEN: usize = 5;

/// Messages up to this size (prefix included) are encoded into the
/// thread's frame buffer: they are copied into a DATA frame at once.
const ARENA_MAX: usize = crate::arena::MAX_PIECE;

/// The metadata names tonic's client and server drop from a user's
/// metadata before sending it (tonic's `GRPC_RESERVED_HEADERS`): the
/// protocol sets them itself.
const RESERVED: [http::HeaderName; 5] = [
    http::HeaderName::from_static("te"),
    http::HeaderName::from_static("content-type"),
    http::HeaderName::from_static("grpc-message"),
    http::HeaderName::from_static("grpc-message-type"),
    http::HeaderName::from_static("grpc-status"),
];

/// A user's metadata as tonic sends it: without [`RESERVED`] names.
pub(crate) fn sanitized(md: tonic::metadata::MetadataMap) -> http::HeaderMap {
    let mut h = md.into_headers();
    if !h.is_empty() {
        for n in &RESERVED {
            h.remove(n);
        }
    }
    h
}

/// A message's encoded length as its prefix carries it, or tonic's
/// OUT_OF_RANGE error when it is larger than `limit`
/// (`max_encoding_message_size`).
fn checked_len(len: usize, limit: Option<usize>) -> Result<u32, Status> {
    let limit = limit.unwrap_or(usize::MAX);
    if len > limit {
        return Err(Status::out_of_range(format!(
            "Error, encoded message length too large: found {len} bytes, the limit is: {limit} bytes"
        )));
    }
    u32::try_from(len).map_err(|_| {
        Status::resource_exhausted(format!(
            "a message of {len} bytes does not fit gRPC's 4-byte length"
        ))
    })
}

/// `msg` behind its prefix, or tonic's OUT_OF_RANGE error when it is larger
/// than `limit` (`max_encoding_message_size`).
pub(crate) fn encode<M: prost::Message>(msg: &M, limit: Option<usize>) -> Result<Bytes, Status> {
    let len = msg.encoded_len();
    let len32 = checked_len(len, limit)?;
    let write = |b: &mut BytesMut| {
        b.put_u8(0);
        b.put_u32(len32);
        // The buffer has room for the encoded length: prost cannot fail.
        msg.encode(b)
            .map_err(|e| Status::internal(format!("encoding a message: {e}")))
    };
    if PREFIX_LEN + len <= ARENA_MAX {
        crate::arena::build(PREFIX_LEN + len, write)
    } else {
        // A larger message goes into a buffer this thread kept from an
        // earlier one that is gone (the transport drops a sent message
        // once it copied it out): no allocation and no page faults per
        // message in steady state.
        let mut b = kept::take(&ENCODE_BUFFERS, PREFIX_LEN + len);
        write(&mut b)?;
        Ok(kept::finish(&ENCODE_BUFFERS, b))
    }
}

thread_local! {
    /// The thread's handles of the buffers its large messages were encoded
    /// in (`rdma_transport::kept`: at most 2 of at most 4 MiB).
    static ENCODE_BUFFERS: KeptBuffers = const { KeptBuffers::new() };
}

/// A `bytes` field of a message that the generated direct path may send
/// apart from the rest of the message ([`take_large`]), whatever Rust type
/// prost gave it.
pub trait LargeField {
    /// The field's bytes, taken out of the message (the field left empty or
    /// unset) when they are at least [`LARGE_FIELD_MIN`] long; without a copy.
    fn take_large(&mut self) -> Option<Bytes>;
}

/// The smallest `bytes` field sent apart from its message: below it the
/// copy into the encoded message costs less than a part of its own.
pub const LARGE_FIELD_MIN: usize = 16 << 10;

impl LargeField for Bytes {
    fn take_large(&mut self) -> Option<Bytes> {
        (self.len() >= LARGE_FIELD_MIN).then(|| std::mem::take(self))
    }
}

impl LargeField for Vec<u8> {
    fn take_large(&mut self) -> Option<Bytes> {
        // `Bytes::from(Vec)` takes the allocation over: no copy.
        (self.len() >= LARGE_FIELD_MIN).then(|| Bytes::from(std::mem::take(self)))
    }
}

impl<T: LargeField> LargeField for Option<T> {
    fn take_large(&mut self) -> Option<Bytes> {
        let b = self.as_mut()?.take_large()?;
        *self = None;
        Some(b)
    }
}

/// Takes a large `bytes` field (field number `tag`) out of a message, for
/// the direct path's encoder; what rpc-codegen's generated code calls.
pub fn take_large(field: &mut impl LargeField, tag: u32) -> Option<(u32, Bytes)> {
    field.take_large().map(|b| (tag, b))
}

/// A message encoded for sending: `head` (the prefix and the encoded
/// fields), then `tail`, a large `bytes` field's value that was not copied
/// (empty when there is none).
#[derive(Debug, Default)]
pub(crate) struct Encoded {
    pub(crate) head: Bytes,
    pub(crate) tail: Bytes,
}

/// As [`encode`], with the large `bytes` field `take` takes out of `msg`
/// (if any) sent after the others, as `tail`: its bytes are not copied
/// here, and the transport copies them once. Protobuf lets fields come in
/// any order (and for a field that occurs twice the last one wins), so
/// the bytes decode to the same message wherever the field was declared.
pub(crate) fn encode_split<M: prost::Message>(
    mut msg: M,
    limit: Option<usize>,
    take: impl FnOnce(&mut M) -> Option<(u32, Bytes)>,
) -> Result<Encoded, Status> {
    use prost::encoding::{encode_key, encode_varint, encoded_len_varint, key_len, WireType};
    let Some((tag, tail)) = take(&mut msg) else {
        return encode(&msg, limit).map(|head| Encoded {
            head,
            tail: Bytes::new(),
        });
    };
    let rest = msg.encoded_len();
    let field_head = key_len(tag) + encoded_len_varint(tail.len() as u64);
    let len = rest + field_head + tail.len();
    let len32 = checked_len(len, limit)?;
    let head = crate::arena::build(PREFIX_LEN + rest + field_head, |b| {
        b.put_u8(0);
        b.put_u32(len32);
        msg.encode(b)
            .map_err(|e| Status::internal(format!("encoding a message: {e}")))?;
        encode_key(tag, WireType::LengthDelimited, b);
        encode_varint(tail.len() as u64, b);
        Ok::<(), Status>(())
    })?;
    Ok(Encoded { head, tail })
}

/// Reads whole messages from a call's body: a message that came in one
/// DATA frame is a slice of it (no copy), one spread over several frames
/// is gathered once. `what` names the direction in errors (`"request"` or
/// `"response"`), as tonic's decoder does.
pub(crate) struct Reader {
    limit: usize,
    /// Bytes received and not yet part of a returned message.
    buf: BytesMut,
    /// The first frame of the pending bytes, kept as it came while nothing
    /// else arrived (so that a message inside it is a slice, not a copy).
    whole: Option<Bytes>,
}

/// What the body held after the last message.
pub(crate) enum End {
    /// The trailers that ended it (client side: the call's status).
    Trailers(http::HeaderMap),
    /// Trailers of only `grpc-status: 0`.
    TrailersOk,
    /// The end of the request stream (server side).
    Eof,
}

impl Reader {
    pub(crate) fn new(limit: Option<usize>) -> Reader {
        Reader {
            limit: limit.unwrap_or(DEFAULT_MAX_DECODE),
            buf: BytesMut::new(),
            whole: None,
        }
    }

    fn pending(&self) -> usize {
        self.whole.as_ref().map_or(0, Bytes::len) + self.buf.len()
    }

    /// The prefix the pending bytes begin with (flag byte, then the
    /// message's length), once all of it is in.
    fn prefix(&self) -> Option<(u8, usize)> {
        let src: &[u8] = match &self.whole {
            Some(w) => w,
            None => &self.buf,
        };
        let h = src.get(..PREFIX_LEN)?;
        Some((h[0], u32::from_be_bytes([h[1], h[2], h[3], h[4]]) as usize))
    }

    /// The length (prefix included) of the message the pending bytes
    /// begin with, once its prefix is in and within the limit.
    fn expected(&self) -> Option<usize> {
        let (_, len) = self.prefix()?;
        (len <= self.limit).then_some(PREFIX_LEN + len)
    }

    /// Moves `whole` into `buf` before more bytes are appended. Room for the
    /// whole message is reserved once its prefix is in (as tonic's decoder
    /// does; at most the decode limit), so a message arriving in several
    /// frames is copied once, not again at every growth.
    fn gather(&mut self, more: &[u8]) {
        let want = self.pending() + more.len();
        let room = self.expected().map_or(want, |m| m.max(want));
        // `whole` is only ever set over an empty `buf`.
        let whole = self.whole.take();
        self.buf.reserve(room.saturating_sub(self.buf.len()));
        if let Some(w) = whole {
            self.buf.extend_from_slice(&w);
        }
        self.buf.extend_from_slice(more);
    }

    /// The next whole message's bytes (prefix removed), if the pending
    /// bytes hold one; a prefix that breaks the rules is an error.
    fn take(&mut self) -> Result<Option<Bytes>, Status> {
        let Some((flag, len)) = self.prefix() else {
            return Ok(None);
        };
        match flag {
            0 => {}
            1 => {
                return Err(Status::internal(
                    "protocol error: received message with compressed-flag but no grpc-encoding was specified",
                ))
            }
            f => {
                return Err(Status::internal(format!(
                    "protocol error: received message with invalid compression flag: {f} (valid flags are 0 and 1)"
                )))
            }
        }
        if len > self.limit {
            return Err(Status::out_of_range(format!(
                "Error, decoded message length too large: found {len} bytes, the limit is: {} bytes",
                self.limit
            )));
        }
        if self.pending() < PREFIX_LEN + len {
            return Ok(None);
        }
        let msg = match &mut self.whole {
            Some(w) => {
                w.advance(PREFIX_LEN);
                let m = w.split_to(len);
                if w.is_empty() {
                    self.whole = None;
                }
                m
            }
            None => {
                self.buf.advance(PREFIX_LEN);
                self.buf.split_to(len).freeze()
            }
        };
        Ok(Some(msg))
    }

    /// The next message from `body`, decoded; `Ok(Err(end))` when the body
    /// ended instead (its trailers, or the end of the request stream).
    pub(crate) async fn next<M: prost::Message + Default>(
        &mut self,
        body: &mut RecvBody,
    ) -> Result<Result<M, End>, Status> {
        loop {
            if let Some(bytes) = self.take()? {
                return M::decode(bytes).map(Ok).map_err(|e| {
                    // As tonic-prost's decoder reports it.
                    Status::internal(e.to_string())
                });
            }
            match body.part().await {
                Some(Ok(Part::Data(d))) => {
                    if self.whole.is_none() && self.buf.is_empty() {
                        self.whole = Some(d);
                    } else {
                        self.gather(&d);
                    }
                }
                Some(Ok(Part::Trailers(t))) => {
                    self.check_empty()?;
                    return Ok(Err(End::Trailers(t)));
                }
                Some(Ok(Part::TrailersOk)) => {
                    self.check_empty()?;
                    return Ok(Err(End::TrailersOk));
                }
                Some(Err(status)) => return Err(status),
                None => {
                    self.check_empty()?;
                    return Ok(Err(End::Eof));
                }
            }
        }
    }

    /// The body ended: bytes of an unfinished message are an error.
    fn check_empty(&self) -> Result<(), Status> {
        if self.pending() == 0 {
            Ok(())
        } else {
            Err(Status::internal(format!(
                "protocol error: the stream ended inside a message ({} bytes of it received)",
                self.pending()
            )))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Clone, PartialEq, prost::Message)]
    struct Pair {
        #[prost(int64, tag = "1")]
        seconds: i64,
        #[prost(int32, tag = "2")]
        nanos: i32,
    }

    #[derive(Clone, PartialEq, prost::Message)]
    struct Blob {
        #[prost(string, tag = "1")]
        name: String,
        #[prost(bytes = "bytes", tag = "2")]
        data: Bytes,
        #[prost(uint32, tag = "3")]
        seq: u32,
        #[prost(bytes = "vec", optional, tag = "4")]
        extra: Option<Vec<u8>>,
    }

    fn joined(e: &Encoded) -> Vec<u8> {
        [&e.head[..], &e.tail[..]].concat()
    }

    #[test]
    fn a_large_field_goes_last_uncopied_and_decodes_to_the_same_message() {
        let data = Bytes::from(vec![7u8; LARGE_FIELD_MIN + 3]);
        let msg = Blob {
            name: "n".into(),
            data: data.clone(),
            seq: 9,
            extra: Some(vec![1, 2, 3]),
        };
        let whole = encode(&msg, None).unwrap();
        let e = encode_split(msg.clone(), None, |m| take_large(&mut m.data, 2)).unwrap();
        // The field's bytes are the message's own, not a copy.
        assert_eq!(e.tail.as_ptr(), data.as_ptr());
        assert_eq!(e.tail.len(), data.len());
        let bytes = joined(&e);
        assert_eq!(bytes.len(), whole.len(), "same length, prefix included");
        assert_eq!(bytes[..PREFIX_LEN], whole[..PREFIX_LEN]);
        let back = <Blob as prost::Message>::decode(&bytes[PREFIX_LEN..]).unwrap();
        assert_eq!(back, msg);
        // The limit counts the whole message.
        let st = encode_split(msg.clone(), Some(whole.len() - PREFIX_LEN - 1), |m| {
            take_large(&mut m.data, 2)
        })
        .unwrap_err();
        assert_eq!(st.code(), tonic::Code::OutOfRange);
        // An optional `Vec<u8>` field is taken without a copy too.
        let big = vec![5u8; LARGE_FIELD_MIN];
        let at = big.as_ptr();
        let msg = Blob {
            extra: Some(big),
            ..Blob::default()
        };
        let e = encode_split(msg.clone(), None, |m| take_large(&mut m.extra, 4)).unwrap();
        let back = <Blob as prost::Message>::decode(&joined(&e)[PREFIX_LEN..]).unwrap();
        assert_eq!(back, msg);
        let e = encode_split(msg, None, |m| take_large(&mut m.extra, 4)).unwrap();
        assert_eq!(e.tail.as_ptr(), at);
        let msg = Blob {
            extra: Some(vec![5u8; LARGE_FIELD_MIN]),
            ..Blob::default()
        };
        let back = <Blob as prost::Message>::decode(&joined(&e)[PREFIX_LEN..]).unwrap();
        assert_eq!(back, msg);
    }

    #[test]
    fn a_small_field_stays_in_place() {
        let msg = Blob {
            data: Bytes::from(vec![1u8; LARGE_FIELD_MIN - 1]),
            seq: 1,
            ..Blob::default()
        };
        let e = encode_split(msg.clone(), None, |m| take_large(&mut m.data, 2)).unwrap();
        assert!(e.tail.is_empty());
        assert_eq!(e.head, encode(&msg, None).unwrap());
    }

    #[test]
    fn encodes_behind_the_prefix_and_enforces_the_limit() {
        let msg = Pair {
            seconds: 7,
            nanos: 9,
        };
        let b = encode(&msg, None).unwrap();
        assert_eq!(b[0], 0);
        let len = u32::from_be_bytes([b[1], b[2], b[3], b[4]]) as usize;
        assert_eq!(len, prost::Message::encoded_len(&msg));
        assert_eq!(b.len(), PREFIX_LEN + len);
        let back: Pair = prost::Message::decode(&b[PREFIX_LEN..]).unwrap();
        assert_eq!(back, msg);
        let e = encode(&msg, Some(1)).unwrap_err();
        assert_eq!(e.code(), tonic::Code::OutOfRange);
        assert!(e.message().contains("the limit is: 1 bytes"), "{e}");
    }

    #[test]
    fn takes_messages_whole_split_or_several_per_frame() {
        let mut framed = BytesMut::new();
        for n in [3usize, 0, 10] {
            framed.put_u8(0);
            framed.put_u32(n as u32);
            framed.put_bytes(n as u8, n);
        }
        let framed = framed.freeze();
        // All in one frame: three slices of it.
        let mut r = Reader::new(None);
        r.whole = Some(framed.clone());
        let got: Vec<Bytes> = std::iter::from_fn(|| r.take().unwrap()).collect();
        assert_eq!(got.iter().map(Bytes::len).collect::<Vec<_>>(), [3, 0, 10]);
        assert_eq!(r.pending(), 0);
        // Byte by byte: the same messages, each once complete.
        let mut r = Reader::new(None);
        let mut got = vec![];
        for i in 0..framed.len() {
            r.gather(&framed[i..i + 1]);
            while let Some(m) = r.take().unwrap() {
                got.push(m);
            }
        }
        assert_eq!(got.iter().map(Bytes::len).collect::<Vec<_>>(), [3, 0, 10]);
        assert!(got[2].iter().all(|&b| b == 10));
        // A large message in several frames: room for all of it is made
        // once its prefix is in, and the buffer never moves after that.
        let mut big = BytesMut::new();
        big.put_u8(0);
        big.put_u32(100_000);
        big.put_bytes(7, 100_000);
        let big = big.freeze();
        let mut r = Reader::new(None);
        r.whole = Some(big.slice(..1000));
        r.gather(&big[1000..2000]);
        assert!(r.buf.capacity() >= big.len(), "{}", r.buf.capacity());
        let at = r.buf.as_ptr();
        for part in big[2000..].chunks(16 << 10) {
            assert!(r.take().unwrap().is_none());
            r.gather(part);
            assert_eq!(r.buf.as_ptr(), at, "gathered in place");
        }
        let m = r.take().unwrap().expect("the whole message");
        assert!(m.len() == 100_000 && m.iter().all(|&b| b == 7));
        // A prefix over the limit reserves nothing for it (take refuses it).
        let mut r = Reader::new(Some(10));
        r.whole = Some(big.slice(..100));
        r.gather(&big[100..200]);
        assert!(r.buf.capacity() < 1000, "{}", r.buf.capacity());
    }

    #[test]
    fn refuses_what_tonic_refuses() {
        let mut r = Reader::new(Some(4));
        r.whole = Some(Bytes::from_static(&[0, 0, 0, 0, 5, 1, 2, 3, 4, 5]));
        assert_eq!(r.take().unwrap_err().code(), tonic::Code::OutOfRange);
        let mut r = Reader::new(None);
        r.whole = Some(Bytes::from_static(&[1, 0, 0, 0, 0]));
        assert_eq!(r.take().unwrap_err().code(), tonic::Code::Internal);
        let mut r = Reader::new(None);
        r.whole = Some(Bytes::from_static(&[7, 0, 0, 0, 0]));
        assert!(r.take().unwrap_err().message().contains("flag: 7"));
        let mut r = Reader::new(None);
        r.whole = Some(Bytes::from_static(&[0, 0, 0, 0, 9, 1]));
        assert!(r.take().unwrap().is_none());
        assert_eq!(r.check_empty().unwrap_err().code(), tonic::Code::Internal);
    }
}
