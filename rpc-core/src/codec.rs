//! The protobuf codec that `rpc_codegen` puts in generated clients and
//! servers: tonic-prost's [`ProstCodec`](tonic_prost::ProstCodec), except
//! that the encoder reserves a message's encoded length before encoding it.
//!
//! tonic encodes into a buffer that starts at 8 KiB and grows as prost
//! writes into it, so a 1 MiB message reallocates (and copies what it has
//! written so far) up to eight times and ends in a 2 MiB buffer. Reserving
//! [`Message::encoded_len`] first makes it one allocation of the message's
//! size, with no copy. Both start from a buffer of [`BUFFER_BYTES`], not
//! tonic's 8 KiB: a small call's message fits it, and a large one reserves
//! its own length anyway. Decoding is tonic-prost's: a `bytes` field compiled
//! with `.bytes(..)` is a slice of the received buffer (see the
//! `rpc_codegen` crate docs). Messages on the wire are the same either way.

use prost::Message;
use std::marker::PhantomData;
use tonic::codec::{BufferSettings, Codec, EncodeBuf, Encoder};
use tonic::Status;

/// The encoder's and the decoder's first buffer (tonic's default: 8 KiB,
/// four of which a small unary call allocated, client and server).
pub const BUFFER_BYTES: usize = 1024;

/// tonic's default: a streaming body yields once this much is encoded.
const YIELD_THRESHOLD: usize = 32 * 1024;

fn buffer_settings() -> BufferSettings {
    BufferSettings::new(BUFFER_BYTES, YIELD_THRESHOLD)
}

/// A [`Codec`] for `application/grpc+proto` messages (prost), whose encoder
/// reserves each message's encoded length before writing it. A drop-in for
/// `tonic_prost::ProstCodec` (the same type parameters and `Default`).
#[derive(Debug, Clone)]
pub struct ProstCodec<T, U> {
    _pd: PhantomData<(T, U)>,
}

impl<T, U> Default for ProstCodec<T, U> {
    fn default() -> Self {
        ProstCodec { _pd: PhantomData }
    }
}

impl<T, U> Codec for ProstCodec<T, U>
where
    T: Message + Send + 'static,
    U: Message + Default + Send + 'static,
{
    type Encode = T;
    type Decode = U;
    type Encoder = ProstEncoder<T>;
    type Decoder = tonic_prost::ProstDecoder<U>;

    fn encoder(&mut self) -> Self::Encoder {
        ProstEncoder { _pd: PhantomData }
    }

    fn decoder(&mut self) -> Self::Decoder {
        tonic_prost::ProstCodec::<T, U>::raw_decoder(buffer_settings())
    }
}

/// The [`Encoder`] of [`ProstCodec`]: reserves the encoded length, then
/// encodes.
#[derive(Debug, Clone)]
pub struct ProstEncoder<T> {
    _pd: PhantomData<T>,
}

impl<T: Message> Encoder for ProstEncoder<T> {
    type Item = T;
    type Error = Status;

    fn encode(&mut self, item: Self::Item, buf: &mut EncodeBuf<'_>) -> Result<(), Self::Error> {
        buf.reserve(item.encoded_len());
        // With the length reserved the buffer has room: prost's encode
        // fails only when it has not.
        item.encode(buf)
            .map_err(|e| Status::internal(format!("encoding a message: {e}")))
    }

    fn buffer_settings(&self) -> BufferSettings {
        buffer_settings()
    }
}
