//! The server's request layers: its default deadline (tonic's
//! `Server::timeout`) and the type-erased user layers of
//! [`Server::layer`](crate::Server::layer).

use crate::error::BoxError;
use crate::protocol::timeout::cap_grpc_timeout;
use std::sync::Arc;
use std::time::Duration;
use tonic::body::Body;

/// The service every request of a [`Server`](crate::Server) goes through
/// once it has layers: what a [`Server::layer`](crate::Server::layer) layer
/// wraps and must return (e.g. `tower::timeout::TimeoutLayer`,
/// `tonic::service::InterceptorLayer`, a `tower::layer::layer_fn`).
pub type HttpService =
    tower::util::BoxCloneSyncService<http::Request<Body>, http::Response<Body>, BoxError>;

/// The user's layers, composed, applied to a type-erased service.
pub(crate) type LayerFn = Arc<dyn Fn(HttpService) -> HttpService + Send + Sync>;

/// Adapts the composed [`LayerFn`] to tonic's server (whose layer sees its
/// own service type) by erasing that type first (also without layers: the
/// layer's type cannot depend on whether there are any).
#[derive(Clone)]
pub(crate) struct DynLayer(pub(crate) Option<LayerFn>);

impl<S> tower::Layer<S> for DynLayer
where
    S: tower::Service<http::Request<Body>, Response = http::Response<Body>>
        + Clone
        + Send
        + Sync
        + 'static,
    S::Error: Into<BoxError>,
    S::Future: Send + 'static,
{
    type Service = HttpService;
    fn layer(&self, inner: S) -> HttpService {
        use tower::ServiceExt;
        let svc = HttpService::new(inner.map_err(Into::into));
        match &self.0 {
            Some(f) => f(svc),
            None => svc,
        }
    }
}

/// Sets a server's default deadline on each request (see
/// [`Server::timeout`](crate::Server::timeout)) before the deadline layer.
#[derive(Clone, Copy)]
pub(crate) struct DefaultTimeoutLayer(pub(crate) Option<Duration>);

impl<S> tower::Layer<S> for DefaultTimeoutLayer {
    type Service = DefaultTimeout<S>;
    fn layer(&self, inner: S) -> DefaultTimeout<S> {
        DefaultTimeout {
            inner,
            timeout: self.0,
        }
    }
}

/// See [`DefaultTimeoutLayer`].
#[derive(Clone)]
pub(crate) struct DefaultTimeout<S> {
    inner: S,
    timeout: Option<Duration>,
}

impl<S> tower::Service<http::Request<Body>> for DefaultTimeout<S>
where
    S: tower::Service<http::Request<Body>>,
{
    type Response = S::Response;
    type Error = S::Error;
    type Future = S::Future;

    fn poll_ready(
        &mut self,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Result<(), S::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, mut req: http::Request<Body>) -> S::Future {
        if let Some(t) = self.timeout {
            cap_grpc_timeout(req.headers_mut(), t);
        }
        self.inner.call(req)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn default_timeout_only_shortens() {
        let mut h = http::HeaderMap::new();
        cap_grpc_timeout(&mut h, Duration::from_millis(300));
        assert_eq!(h["grpc-timeout"], "300000u");
        // A shorter deadline of the call stays.
        h.insert("grpc-timeout", http::HeaderValue::from_static("100m"));
        cap_grpc_timeout(&mut h, Duration::from_millis(300));
        assert_eq!(h["grpc-timeout"], "100m");
        // A longer one is capped.
        h.insert("grpc-timeout", http::HeaderValue::from_static("10S"));
        cap_grpc_timeout(&mut h, Duration::from_millis(300));
        assert_eq!(
            crate::protocol::timeout::parse(h["grpc-timeout"].to_str().unwrap()),
            Some(Duration::from_millis(300))
        );
    }
}
