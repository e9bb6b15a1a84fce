//! Services written as tonic's own examples write them (helloworld's
//! greeter that reads `remote_addr()`; streaming's handlers that spawn a
//! task and send on an mpsc channel until `tx.send` fails, and look for
//! `BrokenPipe` in a request stream's error), recording what they saw.

use futures::StreamExt;
use rpc_examples::pb::echo::echo_server::Echo;
use rpc_examples::pb::echo::{EchoRequest, EchoResponse};
use rpc_examples::pb::helloworld::greeter_server::Greeter;
use rpc_examples::pb::helloworld::{HelloReply, HelloRequest};
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering::SeqCst};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tonic::{Request, Response, Status};

/// What the example handlers saw.
#[derive(Default, Debug)]
pub struct Seen {
    pub remote: Mutex<Option<SocketAddr>>,
    pub local: Mutex<Option<SocketAddr>>,
    pub user_agent: Mutex<Option<String>>,
    /// The server-stream handler's `tx.send` failed.
    pub stream_client_gone: AtomicBool,
    /// The bidi handler saw `BrokenPipe` in its request stream's error.
    pub broken_pipe: AtomicBool,
    /// The bidi handler saw its request stream fail.
    pub bidi_error: Mutex<Option<Status>>,
    /// The bidi handler's reading loop ended (stream end or error).
    pub bidi_done: AtomicBool,
}

#[derive(Clone, Default)]
pub struct Example {
    /// What the handlers saw.
    pub seen: Arc<Seen>,
}

#[tonic::async_trait]
impl Greeter for Example {
    async fn say_hello(
        &self,
        request: Request<HelloRequest>,
    ) -> Result<Response<HelloReply>, Status> {
        // tonic's helloworld server prints exactly this.
        println!("Got a request from {:?}", request.remote_addr());
        *self.seen.remote.lock().unwrap() = request.remote_addr();
        *self.seen.local.lock().unwrap() = request.local_addr();
        *self.seen.user_agent.lock().unwrap() = request
            .metadata()
            .get("user-agent")
            .and_then(|v| v.to_str().ok())
            .map(str::to_string);
        Ok(Response::new(HelloReply {
            message: format!("Hello {}!", request.into_inner().name),
        }))
    }
}

type EchoStream = Pin<Box<dyn futures::Stream<Item = Result<EchoResponse, Status>> + Send>>;

/// tonic's `std::io::Error` search of its streaming example.
pub fn match_for_io_error(err_status: &Status) -> Option<&std::io::Error> {
    let mut err: &(dyn std::error::Error + 'static) = err_status;
    loop {
        if let Some(io_err) = err.downcast_ref::<std::io::Error>() {
            return Some(io_err);
        }
        if let Some(h2_err) = err.downcast_ref::<h2::Error>() {
            if let Some(io_err) = h2_err.get_io() {
                return Some(io_err);
            }
        }
        err = err.source()?;
    }
}

#[tonic::async_trait]
impl Echo for Example {
    async fn unary_echo(&self, r: Request<EchoRequest>) -> Result<Response<EchoResponse>, Status> {
        Ok(Response::new(EchoResponse {
            message: r.into_inner().message,
            ..Default::default()
        }))
    }

    type ServerStreamingEchoStream = EchoStream;

    async fn server_streaming_echo(
        &self,
        req: Request<EchoRequest>,
    ) -> Result<Response<EchoStream>, Status> {
        let message = req.into_inner().message;
        let (tx, rx) = mpsc::channel(128);
        let seen = self.seen.clone();
        tokio::spawn(async move {
            let mut seq = 0;
            loop {
                let item = EchoResponse {
                    message: message.clone(),
                    seq,
                    ..Default::default()
                };
                seq += 1;
                if tx.send(Ok(item)).await.is_err() {
                    break;
                }
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
            println!("\tclient disconnected");
            seen.stream_client_gone.store(true, SeqCst);
        });
        Ok(Response::new(Box::pin(ReceiverStream::new(rx))))
    }

    async fn client_streaming_echo(
        &self,
        _: Request<tonic::Streaming<EchoRequest>>,
    ) -> Result<Response<EchoResponse>, Status> {
        Err(Status::unimplemented("not in this example"))
    }

    type BidirectionalStreamingEchoStream = EchoStream;

    async fn bidirectional_streaming_echo(
        &self,
        req: Request<tonic::Streaming<EchoRequest>>,
    ) -> Result<Response<EchoStream>, Status> {
        let mut in_stream = req.into_inner();
        let (tx, rx) = mpsc::channel(128);
        let seen = self.seen.clone();
        tokio::spawn(async move {
            while let Some(result) = in_stream.next().await {
                match result {
                    Ok(v) => {
                        let r = EchoResponse {
                            message: v.message,
                            ..Default::default()
                        };
                        if tx.send(Ok(r)).await.is_err() {
                            break;
                        }
                    }
                    Err(err) => {
                        if let Some(io_err) = match_for_io_error(&err) {
                            if io_err.kind() == std::io::ErrorKind::BrokenPipe {
                                eprintln!("\tclient disconnected: broken pipe");
                                seen.broken_pipe.store(true, SeqCst);
                            }
                        }
                        *seen.bidi_error.lock().unwrap() = Some(err);
                        break;
                    }
                }
            }
            seen.bidi_done.store(true, SeqCst);
        });
        Ok(Response::new(Box::pin(ReceiverStream::new(rx))))
    }
}
