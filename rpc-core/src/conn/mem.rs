//! In-memory [`Connection`]: two bounded queues.

use super::{Connection, FrameReceiver, FrameSender};
use bytes::Bytes;
use std::io;
use tokio::sync::mpsc;

/// Frames the queue of each direction holds before `send` waits.
pub const MEM_QUEUE_FRAMES: usize = 64;
/// Largest frame the in-memory connection carries (16 MiB).
pub const MEM_MAX_FRAME_LEN: usize = 16 << 20;

/// One end of an in-memory connection pair.
#[derive(Debug)]
pub struct MemConnection {
    tx: MemSender,
    rx: MemReceiver,
}

/// Sending half of a [`MemConnection`].
#[derive(Debug)]
pub struct MemSender(Option<mpsc::Sender<Bytes>>);

/// Receiving half of a [`MemConnection`].
#[derive(Debug)]
pub struct MemReceiver(mpsc::Receiver<Bytes>);

/// Creates a connected pair of in-memory connections.
pub fn pair() -> (MemConnection, MemConnection) {
    let (a_tx, b_rx) = mpsc::channel(MEM_QUEUE_FRAMES);
    let (b_tx, a_rx) = mpsc::channel(MEM_QUEUE_FRAMES);
    (
        MemConnection {
            tx: MemSender(Some(a_tx)),
            rx: MemReceiver(a_rx),
        },
        MemConnection {
            tx: MemSender(Some(b_tx)),
            rx: MemReceiver(b_rx),
        },
    )
}

impl Connection for MemConnection {
    type Sender = MemSender;
    type Receiver = MemReceiver;
    fn split(self) -> (MemSender, MemReceiver) {
        (self.tx, self.rx)
    }
}

impl FrameSender for MemSender {
    fn max_frame_len(&self) -> usize {
        MEM_MAX_FRAME_LEN
    }

    async fn send(&mut self, frame: Bytes) -> io::Result<()> {
        if frame.len() > MEM_MAX_FRAME_LEN {
            return Err(too_large(frame.len()));
        }
        let tx = self.0.as_ref().ok_or_else(not_connected)?;
        tx.send(frame).await.map_err(|_| peer_gone())
    }

    fn try_send(&mut self, frame: Bytes) -> Result<io::Result<()>, Bytes> {
        if frame.len() > MEM_MAX_FRAME_LEN {
            return Ok(Err(too_large(frame.len())));
        }
        let Some(tx) = self.0.as_ref() else {
            return Ok(Err(not_connected()));
        };
        match tx.try_send(frame) {
            Ok(()) => Ok(Ok(())),
            Err(mpsc::error::TrySendError::Full(f)) => Err(f),
            Err(mpsc::error::TrySendError::Closed(_)) => Ok(Err(peer_gone())),
        }
    }

    async fn close(&mut self) {
        self.0 = None;
    }
}

fn too_large(len: usize) -> io::Error {
    io::Error::new(
        io::ErrorKind::InvalidInput,
        format!("frame of {len} bytes exceeds {MEM_MAX_FRAME_LEN}"),
    )
}

fn not_connected() -> io::Error {
    io::Error::new(io::ErrorKind::BrokenPipe, "connection closed")
}

fn peer_gone() -> io::Error {
    io::Error::new(
        io::ErrorKind::ConnectionReset,
        "peer dropped the connection",
    )
}

impl FrameReceiver for MemReceiver {
    async fn recv(&mut self) -> io::Result<Option<Bytes>> {
        Ok(self.0.recv().await)
    }
}
