//! Call-protocol frame decoder (`rpc_core::__private::frame::decode`): any bytes from the
//! network decode to a frame or an error, never a panic, and nothing decoded
//! exceeds the limits it was decoded under.
#![no_main]
use libfuzzer_sys::fuzz_target;
use rpc_core::__private::frame::{decode, metadata_bytes, DecodeLimits, Frame};

const LIMIT: usize = 4096;

fuzz_target!(|data: &[u8]| {
    let limits = DecodeLimits {
        max_metadata_bytes: LIMIT,
    };
    if let Ok(f) = decode(bytes::Bytes::copy_from_slice(data), &limits) {
        match f {
            Frame::Open {
                metadata,
                stream,
                path,
                ..
            } => {
                assert!(metadata_bytes(&metadata) <= LIMIT);
                assert_ne!(stream, 0);
                assert!(path.starts_with('/'));
            }
            Frame::Headers { metadata, stream } | Frame::Trailers { metadata, stream } => {
                assert!(metadata_bytes(&metadata) <= LIMIT);
                assert_ne!(stream, 0);
            }
            Frame::Data {
                data: d, stream, ..
            } => {
                assert_ne!(stream, 0);
                assert!(d.len() <= data.len());
            }
            Frame::WindowUpdate { increment, .. } => assert!(increment > 0),
            _ => {}
        }
    }
});
