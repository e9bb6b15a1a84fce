//! Direct dispatch of a message connection's calls to the services added
//! with `add_service`, by service name, without axum's router.
//!
//! tonic's [`Routes`](tonic::service::Routes) is an axum `Router`: per call it
//! matches the path against its route table, stores the URL parameters in
//! the request's extensions (a percent-decoding and three allocations the
//! gRPC handlers never read), and boxes the route's future. On the HTTP/2
//! side that is tonic's own cost; on a message connection it was about
//! 4 k of a small call's 67 k instructions, client and server together
//! (`docs/benchmarks.md`, "Run in place, dispatch by name, cooperative
//! spin"). A gRPC path is `/package.Service/Method` and tonic routes it by the service
//! name alone (`/{NAME}/{*rest}`), so a hash lookup on the name finds the
//! same service the router would. Everything else (unknown services,
//! `add_routes`, the user's layers) still goes through the router.

use std::collections::HashMap;
use std::convert::Infallible;
use std::sync::Arc;

use tonic::body::Body;
use tower::{Service, ServiceExt};

use super::call::{start_call, CallSvc};
use super::generated::{methods_of, Methods, ServerCall};
use crate::hash::FastState;
use crate::protocol::session::{CallFuture, OpenCall, Shared};

/// Starts the calls of one service added by name.
///
/// Each call's future is built for the service's own type: the service is
/// cloned (tonic's generated services clone an `Arc`), called in place, and
/// its response read in the body it comes in, so the call's one box is the
/// session's ([`CallFuture`]): no boxed service, no boxed service future, no
/// second body wrapper per call.
pub(crate) trait StartCall: Send + Sync {
    /// `generated`: a call the direct path can serve goes there
    /// ([`Generated`]); `false` sends every call through tonic's.
    fn start(
        &self,
        shared: Arc<Shared>,
        call: OpenCall,
        span: Option<tracing::Span>,
        generated: bool,
    ) -> CallFuture;
}

/// A service added with `add_service`, as a [`StartCall`].
struct Named<S>(S);

impl<S> StartCall for Named<S>
where
    S: Service<http::Request<Body>, Error = Infallible> + Clone + Send + Sync + 'static,
    S::Response: axum::response::IntoResponse,
    S::Future: Send + 'static,
{
    fn start(
        &self,
        shared: Arc<Shared>,
        call: OpenCall,
        span: Option<tracing::Span>,
        _generated: bool,
    ) -> CallFuture {
        start_call(ByName(self.0.clone()), shared, call, span)
    }
}

/// A service compiled with `rpc_codegen` (its type registered its
/// [`Methods`]): the calls the direct path serves go straight to the
/// generated methods (`super::generated`), the others to tonic's path.
struct Generated<S> {
    methods: Arc<dyn Methods>,
    named: Named<S>,
}

impl<S> StartCall for Generated<S>
where
    Named<S>: StartCall,
{
    fn start(
        &self,
        shared: Arc<Shared>,
        call: OpenCall,
        span: Option<tracing::Span>,
        generated: bool,
    ) -> CallFuture {
        // A compressed request is decoded by tonic's codec.
        if generated && !has_name(&call.metadata, &GRPC_ENCODING) {
            if let Some(index) = method_name(&call.path).and_then(|m| self.methods.method(m)) {
                return self
                    .methods
                    .call(index, ServerCall { shared, call, span })
                    .0;
            }
        }
        self.named.start(shared, call, span, false)
    }
}

const GRPC_ENCODING: http::HeaderName = http::HeaderName::from_static("grpc-encoding");

/// Whether `map` has an entry named `name`, by a look at each entry's name
/// rather than a hash of `name`: a call's request carries a handful of
/// entries (bounded by the metadata limit), and hashing a name `http` does
/// not know costs more than comparing it with each of them.
fn has_name(map: &http::HeaderMap, name: &http::HeaderName) -> bool {
    map.keys().any(|k| k == name)
}

/// `Method` of `/package.Service/Method`.
fn method_name(path: &[u8]) -> Option<&[u8]> {
    let rest = path.strip_prefix(b"/")?;
    let slash = rest.iter().position(|&b| b == b'/')?;
    Some(&rest[slash + 1..])
}

/// One call's copy of a service added by name.
struct ByName<S>(S);

impl<S> CallSvc for ByName<S>
where
    S: Service<http::Request<Body>, Error = Infallible> + Clone + Send + Sync + 'static,
    S::Response: axum::response::IntoResponse,
    S::Future: Send + 'static,
{
    type Body = axum::body::Body;

    /// The conversion tonic's router makes (`IntoResponse`), so a handler's
    /// response reaches the call exactly as it does through the router; the
    /// router's further wrapping in tonic's body type only boxes it again.
    async fn call(&mut self, req: http::Request<Body>) -> http::Response<axum::body::Body> {
        let svc = match self.0.ready().await {
            Ok(svc) => svc,
            Err(never) => match never {},
        };
        match svc.call(req).await {
            Ok(r) => axum::response::IntoResponse::into_response(r),
            Err(never) => match never {},
        }
    }
}

/// The services added with `add_service`, by [`NamedService::NAME`](tonic::server::NamedService::NAME).
#[derive(Clone, Default)]
pub(crate) struct Direct {
    by_name: Arc<HashMap<&'static [u8], Arc<dyn StartCall>, FastState>>,
}

impl std::fmt::Debug for Direct {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_set()
            .entries(self.by_name.keys().map(|k| String::from_utf8_lossy(k)))
            .finish()
    }
}

impl Direct {
    /// Adds `svc` under `name` (its [`NamedService::NAME`](tonic::server::NamedService::NAME)). The caller
    /// adds the same service to the router, which refuses (panics on) a
    /// second service of one name, so the two never disagree.
    pub(crate) fn add<S>(&mut self, name: &'static str, svc: S)
    where
        S: Service<http::Request<Body>, Error = Infallible> + Clone + Send + Sync + 'static,
        S::Response: axum::response::IntoResponse,
        S::Future: Send + 'static,
    {
        let start: Arc<dyn StartCall> = match methods_of(&svc) {
            Some(methods) => Arc::new(Generated {
                methods,
                named: Named(svc),
            }),
            None => Arc::new(Named(svc)),
        };
        Arc::make_mut(&mut self.by_name).insert(name.as_bytes(), start);
    }

    /// The service a call to `path` (`/package.Service/Method`) goes to, if
    /// it was added by name; `None` sends the call through the router
    /// (unknown service → UNIMPLEMENTED there, as before).
    pub(crate) fn get(&self, path: &[u8]) -> Option<&dyn StartCall> {
        if self.by_name.is_empty() {
            return None;
        }
        let rest = path.strip_prefix(b"/")?;
        let slash = rest.iter().position(|&b| b == b'/')?;
        let (name, method) = (&rest[..slash], &rest[slash + 1..]);
        if method.is_empty() {
            return None;
        }
        self.by_name.get(name).map(|s| &**s)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::task::{Context, Poll};
    use tonic::server::NamedService;

    #[derive(Clone)]
    struct Named(&'static str);

    impl NamedService for Named {
        const NAME: &'static str = "pkg.Svc";
    }

    impl Service<http::Request<Body>> for Named {
        type Response = http::Response<Body>;
        type Error = Infallible;
        type Future = std::future::Ready<Result<Self::Response, Infallible>>;
        fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
            Poll::Ready(Ok(()))
        }
        fn call(&mut self, _: http::Request<Body>) -> Self::Future {
            let mut r = http::Response::new(Body::empty());
            r.headers_mut()
                .insert("x-served-by", http::HeaderValue::from_static(self.0));
            std::future::ready(Ok(r))
        }
    }

    #[test]
    fn a_request_names_its_encoding_whatever_else_it_carries() {
        let mut md = http::HeaderMap::new();
        assert!(!has_name(&md, &GRPC_ENCODING));
        md.insert("user-agent", http::HeaderValue::from_static("t"));
        md.insert("grpc-encodings", http::HeaderValue::from_static("gzip"));
        md.insert("x-grpc-encoding", http::HeaderValue::from_static("gzip"));
        assert!(!has_name(&md, &GRPC_ENCODING));
        md.append("grpc-encoding", http::HeaderValue::from_static("gzip"));
        assert!(has_name(&md, &GRPC_ENCODING));
        assert!(has_name(&md, &http::header::USER_AGENT));
    }

    #[tokio::test]
    async fn finds_a_service_by_the_name_in_the_path_only() {
        let mut d = Direct::default();
        assert!(d.get(b"/pkg.Svc/Method").is_none(), "nothing added yet");
        d.add(Named::NAME, Named("first"));
        d.add("pkg.Second", Named("second"));
        let is = |p: &str, name: &str| {
            d.get(p.as_bytes())
                .is_some_and(|s| std::ptr::addr_eq(s, &*d.by_name[name.as_bytes()]))
        };
        assert!(is("/pkg.Svc/Method", "pkg.Svc"));
        assert!(is("/pkg.Second/Method", "pkg.Second"));
        // Anything that is not `/NAME/method` goes to the router.
        for p in [
            "/pkg.Other/Method",
            "/pkg.Svc",
            "/pkg.Svc/",
            "pkg.Svc/Method",
            "/pkg.Sv/Method",
            "/",
            "",
        ] {
            assert!(d.get(p.as_bytes()).is_none(), "{p:?}");
        }
    }

    #[tokio::test]
    async fn a_call_by_name_gets_the_services_response() {
        let r = ByName(Named("first"))
            .call(http::Request::new(Body::empty()))
            .await;
        assert_eq!(r.headers()["x-served-by"], "first");
    }
}
