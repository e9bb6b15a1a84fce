//! Remote memory (`rpc_core::remote`) with the example blob store: a region
//! the server exposes is read by the client, regions the client exposes are
//! read and written by the server, and every bad descriptor gets its own
//! status without failing other calls on the channel. The same code and
//! the same statuses on every path.
use bytes::{Bytes, BytesMut};
use rpc_core::remote::{Access, Remote, RemoteRegion};
use rpc_examples::blobstore::Blobs;
use rpc_examples::echo::EchoStats;
use rpc_examples::pb::blobstore::blob_store_client::BlobStoreClient;
use rpc_examples::pb::blobstore::blob_store_server::BlobStoreServer;
use rpc_examples::pb::blobstore::{FetchRequest, GetRequest, PutRequest, ReleaseRequest};
use rpc_examples::pb::helloworld::{greeter_client::GreeterClient, HelloRequest};
use rpc_tests::Fixture;
use std::sync::Arc;
use tonic::Code;

const BIG: usize = 1 << 20;

fn pattern(len: usize, seed: u8) -> Bytes {
    (0..len)
        .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed))
        .collect::<Vec<u8>>()
        .into()
}

fn blob_router(stats: Arc<EchoStats>) -> rpc_core::Router {
    let blobs = Blobs::default();
    blobs.insert("small", pattern(64, 1));
    blobs.insert("big", pattern(BIG, 2));
    rpc_tests::router(stats).add_service(BlobStoreServer::new(blobs))
}

async fn get(client: &mut BlobStoreClient<rpc_core::Channel>, name: &str) -> (RemoteRegion, u64) {
    let r = client
        .get(GetRequest { name: name.into() })
        .await
        .expect("Get")
        .into_inner();
    (r.blob.expect("a region"), r.lease)
}

/// Calls on the channel still work.
async fn still_works(ch: &rpc_core::Channel) {
    let r = GreeterClient::new(ch.clone())
        .say_hello(HelloRequest { name: "x".into() })
        .await
        .expect("a call after the remote-memory errors");
    assert_eq!(r.into_inner().message, "Hello x!");
}

async fn server_region_read_by_the_client(fx: Fixture) {
    let mut store = BlobStoreClient::new(fx.channel.clone());
    let remote = Remote::of_channel(&fx.channel).await.expect("remote");
    for (name, len, seed) in [("small", 64, 1), ("big", BIG, 2)] {
        let (region, lease) = get(&mut store, name).await;
        assert_eq!(region.length, len as u64);
        assert_eq!(region.access, Access::Read as i32);
        let whole = remote.read(&region, 0, region.length).await.expect("read");
        assert_eq!(whole, pattern(len, seed), "{name} read whole");
        let part = remote.read(&region, 10, 20).await.expect("read part");
        assert_eq!(part, pattern(len, seed).slice(10..30), "{name} read part");
        // Out of range, and a write to a region exposed for reading.
        let e = remote
            .read(&region, region.length - 4, 8)
            .await
            .unwrap_err();
        assert_eq!(e.code(), Code::OutOfRange, "{e:?}");
        let e = remote.write(&region, 0, vec![0u8; 4]).await.unwrap_err();
        assert_eq!(e.code(), Code::PermissionDenied, "{e:?}");
        store
            .release(ReleaseRequest { lease })
            .await
            .expect("Release");
        // Revoked: the region is gone.
        let e = remote.read(&region, 0, 8).await.unwrap_err();
        assert_eq!(e.code(), Code::NotFound, "{name} after release: {e:?}");
    }
    still_works(&fx.channel).await;
}

async fn client_regions_read_and_written_by_the_server(fx: Fixture) {
    let mut store = BlobStoreClient::new(fx.channel.clone());
    let remote = Remote::of_channel(&fx.channel).await.expect("remote");
    for len in [64, BIG] {
        let data = pattern(len, 9);
        // Put: the server reads a region of ours.
        let source = remote
            .expose(data.clone(), Access::Read)
            .await
            .expect("expose for reading");
        let put = store
            .put(PutRequest {
                name: format!("put-{len}"),
                source: Some(source.region()),
            })
            .await
            .expect("Put")
            .into_inner();
        assert_eq!(put.length, len as u64);
        let back = source.revoke().await.expect("revoke source");
        assert_eq!(
            back.into_bytes(),
            data,
            "a read-only region comes back as it was"
        );

        // Fetch: the server writes into a region of ours; we see it after revoking.
        let mut buf = BytesMut::zeroed(len + 16);
        buf[len..].copy_from_slice(&[0xEE; 16]);
        let destination = remote
            .expose(buf, Access::Write)
            .await
            .expect("expose for writing");
        let fetched = store
            .fetch(FetchRequest {
                name: format!("put-{len}"),
                destination: Some(destination.region()),
            })
            .await
            .expect("Fetch")
            .into_inner();
        assert_eq!(fetched.length, len as u64);
        let buf = destination
            .revoke()
            .await
            .expect("revoke destination")
            .into_bytes_mut()
            .expect("an owned buffer comes back");
        assert_eq!(&buf[..len], &data[..], "the server's write landed");
        assert_eq!(
            &buf[len..],
            &[0xEE; 16],
            "bytes past the write are untouched"
        );
    }
    still_works(&fx.channel).await;
}

async fn bad_descriptors_get_their_own_status(fx: Fixture) {
    let mut store = BlobStoreClient::new(fx.channel.clone());
    let remote = Remote::of_channel(&fx.channel).await.expect("remote");
    let (region, _lease) = get(&mut store, "small").await;

    // Used on another connection to the same server.
    let other = fx.new_channel().await;
    let e = Remote::of_channel(&other)
        .await
        .expect("remote")
        .read(&region, 0, 8)
        .await
        .unwrap_err();
    assert!(
        matches!(e.code(), Code::PermissionDenied | Code::NotFound),
        "a descriptor from another connection: {e:?}"
    );

    // Forged: another key (the token of the service path, the rkey of the
    // one-sided path), another region (number, address), a longer length.
    let key = RemoteRegion {
        token: region.token ^ 0x5a5a,
        rkey: region.rkey ^ 0x5a5a_0000,
        ..region
    };
    assert_forged(remote.read(&key, 0, 8).await, "another key");
    let elsewhere = RemoteRegion {
        id: region.id.wrapping_add(1 << 40),
        addr: region.addr.wrapping_add(1 << 40),
        ..region
    };
    assert_forged(remote.read(&elsewhere, 0, 8).await, "another region");
    let e = remote
        .read(
            &RemoteRegion {
                length: 1 << 30,
                ..region
            },
            0,
            1 << 20,
        )
        .await;
    assert!(e.is_err(), "a forged length reads nothing past the region");

    // Malformed: unset fields; and our own region.
    let e = remote
        .read(&RemoteRegion { path: 0, ..region }, 0, 8)
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::InvalidArgument, "{e:?}");
    let mine = remote
        .expose(Bytes::from_static(b"mine"), Access::Read)
        .await
        .expect("expose");
    let e = remote.read(&mine.region(), 0, 4).await.unwrap_err();
    assert_eq!(e.code(), Code::FailedPrecondition, "{e:?}");
    // Shared bytes cannot be exposed for writing.
    let e = remote
        .expose(Bytes::from_static(b"shared"), Access::Write)
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::InvalidArgument, "{e:?}");

    // The server's side: a Put whose source region is not readable, a
    // Fetch into a region too small.
    let wo = remote
        .expose(BytesMut::zeroed(8), Access::Write)
        .await
        .expect("expose");
    let e = store
        .put(PutRequest {
            name: "x".into(),
            source: Some(wo.region()),
        })
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::PermissionDenied, "{e:?}");
    let small = remote
        .expose(BytesMut::zeroed(8), Access::Write)
        .await
        .expect("expose");
    let e = store
        .fetch(FetchRequest {
            name: "small".into(),
            destination: Some(small.region()),
        })
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::OutOfRange, "{e:?}");

    // None of it failed the connection.
    let again = remote
        .read(&region, 0, 64)
        .await
        .expect("a valid read after all that");
    assert_eq!(again, pattern(64, 1));
    still_works(&fx.channel).await;
    still_works(&other).await;
}

/// A forged descriptor reads nothing: NOT_FOUND (or PERMISSION_DENIED where
/// the NIC refuses it).
fn assert_forged(r: Result<Bytes, tonic::Status>, what: &str) {
    let e = r.expect_err(what);
    assert!(
        matches!(e.code(), Code::NotFound | Code::PermissionDenied),
        "{what}: {e:?}"
    );
}

rpc_tests::on_every_path!(
    server_region_read_by_the_client => super::blob_router,
    client_regions_read_and_written_by_the_server => super::blob_router,
    bad_descriptors_get_their_own_status => super::blob_router,
);

/// `rpc_core::remote::RemoteRegion` (written out in rpc-core) is the
/// message `proto/rdma_grpc/remote.proto` declares: every field of the
/// compiled `.proto` is on the wire with its number and wire type, and
/// nothing else is.
#[test]
fn the_descriptor_matches_its_proto() {
    use prost::Message;
    let fds = prost_types::FileDescriptorSet::decode(rpc_examples::pb::FILE_DESCRIPTOR_SET)
        .expect("descriptor set");
    let file = fds
        .file
        .iter()
        .find(|f| f.name() == "rdma_grpc/remote.proto")
        .expect("blobstore.proto imports rdma_grpc/remote.proto");
    let msg = file
        .message_type
        .iter()
        .find(|m| m.name() == "RemoteRegion")
        .expect("RemoteRegion");
    use prost_types::field_descriptor_proto::Type;
    let mut expected: Vec<(u32, u8)> = msg
        .field
        .iter()
        .map(|f| {
            let wire = match f.r#type() {
                Type::Fixed64 => 1,
                Type::Uint64 | Type::Uint32 | Type::Enum => 0,
                t => panic!("unexpected field type {t:?} in RemoteRegion"),
            };
            (f.number() as u32, wire)
        })
        .collect();
    expected.sort();
    let all_set = RemoteRegion {
        length: 1,
        access: 1,
        path: 1,
        exposed_by: 1,
        addr: 1,
        rkey: 1,
        id: 1,
        token: 1,
    };
    let bytes = all_set.encode_to_vec();
    let mut seen = Vec::new();
    let mut buf = &bytes[..];
    while !buf.is_empty() {
        let key = prost::encoding::decode_varint(&mut buf).expect("key");
        let (tag, wire) = ((key >> 3) as u32, (key & 7) as u8);
        match wire {
            0 => {
                prost::encoding::decode_varint(&mut buf).expect("varint");
            }
            1 => buf = &buf[8..],
            w => panic!("wire type {w}"),
        }
        seen.push((tag, wire));
    }
    seen.sort();
    assert_eq!(seen, expected);
}
