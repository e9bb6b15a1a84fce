//! The Greeter service of tonic's helloworld example, unchanged.

use crate::pb::helloworld::greeter_server::Greeter;
use crate::pb::helloworld::{HelloReply, HelloRequest};
use tonic::{Request, Response, Status};

/// Replies `Hello <name>!`.
#[derive(Debug, Default)]
pub struct MyGreeter {}

#[tonic::async_trait]
impl Greeter for MyGreeter {
    async fn say_hello(
        &self,
        request: Request<HelloRequest>,
    ) -> Result<Response<HelloReply>, Status> {
        tracing::debug!("Got a request from {:?}", request.remote_addr());

        let reply = HelloReply {
            message: format!("Hello {}!", request.into_inner().name),
        };
        Ok(Response::new(reply))
    }
}
