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
use tower::util::BoxCloneSyncService;

/// One service, its response already in tonic's body type.
pub(crate) type DirectService =
    BoxCloneSyncService<http::Request<Body>, http::Response<Body>, Infallible>;

/// The services added with `add_service`, by [`NamedService::NAME`](tonic::server::NamedService::NAME).
#[derive(Clone, Default)]
pub(crate) struct Direct {
    by_name: Arc<HashMap<&'static str, DirectService>>,
}

impl std::fmt::Debug for Direct {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_set().entries(self.by_name.keys()).finish()
    }
}

impl Direct {
    /// Adds `svc` under `name` (its [`NamedService::NAME`](tonic::server::NamedService::NAME)). The caller
    /// adds the same service to the router, which refuses (panics on) a
    /// second service of one name, so the two never disagree.
    pub(crate) fn add(&mut self, name: &'static str, svc: DirectService) {
        Arc::make_mut(&mut self.by_name).insert(name, svc);
    }

    /// The service a call to `path` (`/package.Service/Method`) goes to, if
    /// it was added by name; `None` sends the call through the router
    /// (unknown service → UNIMPLEMENTED there, as before).
    pub(crate) fn get(&self, path: &str) -> Option<DirectService> {
        if self.by_name.is_empty() {
            return None;
        }
        let (name, method) = path.strip_prefix('/')?.split_once('/')?;
        if method.is_empty() {
            return None;
        }
        self.by_name.get(name).cloned()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::task::{Context, Poll};
    use tonic::server::NamedService;
    use tower::{Service, ServiceExt};

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

    #[tokio::test]
    async fn finds_a_service_by_the_name_in_the_path_only() {
        let mut d = Direct::default();
        assert!(d.get("/pkg.Svc/Method").is_none(), "nothing added yet");
        d.add(Named::NAME, BoxCloneSyncService::new(Named("first")));
        let mut svc = d.get("/pkg.Svc/Method").expect("by name");
        let r = svc
            .ready()
            .await
            .unwrap()
            .call(http::Request::new(Body::empty()))
            .await
            .unwrap();
        assert_eq!(r.headers()["x-served-by"], "first");
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
            assert!(d.get(p).is_none(), "{p:?}");
        }
    }
}
