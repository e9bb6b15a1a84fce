//! The direct path in generated code (`rpc_core::direct`): what rpc-codegen
//! adds to tonic-prost-build's clients and servers so that, on a message
//! connection, a call goes from the client's method to the service's trait
//! method without tonic's client and server machinery.
//!
//! tonic-prost-build's output is edited in place, at lines whose form its
//! code generator fixes (prettyplease's formatting); a form that is not
//! found is an error naming it, never a silently unedited client.
//!
//! * Client: the struct keeps an `rpc_core::direct::Client` beside tonic's
//!   `Grpc`, made from the transport in `new`/`with_origin` (the client's
//!   transport must then be `'static`, as every channel is); the
//!   compression and size-limit setters tell it too; each unary and
//!   server-streaming method first asks it for a direct call.
//! * Server: the service type registers its direct methods when a value is
//!   made (`from_arc`, which `new` calls), so that rpc-core's `add_service`
//!   finds them by type; the methods call the user's trait methods.

use std::fmt::Write as _;

/// How a method's request and reply travel.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Kind {
    Unary,
    ServerStreaming,
    /// Client or bidirectional streaming: tonic's path.
    Other,
}

/// One method of a service, as the proto names it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Method {
    /// `SayHello`.
    pub(crate) proto: String,
    pub(crate) kind: Kind,
    /// The request's singular `bytes` fields at its top level (Rust name,
    /// field number), when it is a message of the service's file.
    pub(crate) take_request: Vec<(String, i32)>,
    /// The same for the reply.
    pub(crate) take_reply: Vec<(String, i32)>,
}

/// The closure that takes a large one of `fields` out of a message, for
/// `{core}::direct::take_large` (the first that is large), or none.
fn take_closure(fields: &[(String, i32)], core: &str) -> Option<String> {
    let takes: Vec<String> = fields
        .iter()
        .map(|(name, number)| format!("{core}::direct::take_large(&mut m.{name}, {number})"))
        .collect();
    let (first, rest) = takes.split_first()?;
    let mut code = format!("|m| {first}");
    for t in rest {
        code.push_str(&format!(".or_else(|| {t})"));
    }
    Some(code)
}

/// One service, with the names tonic-prost-build gives its code.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Service {
    /// `helloworld.Greeter`
    pub(crate) proto: String,
    /// `Greeter`: the server trait; `GreeterClient`, `GreeterServer`.
    pub(crate) name: String,
    /// `greeter`: `greeter_client`, `greeter_server`.
    pub(crate) snake: String,
    pub(crate) methods: Vec<Method>,
}

impl Service {
    fn path(&self, m: &Method) -> String {
        format!("/{}/{}", self.proto, m.proto)
    }
}

/// The span of the top-level module `pub mod {name} {` in `code`: the byte
/// offsets of its first body line and of its closing `}` line.
fn module(code: &str, name: &str) -> Option<(usize, usize)> {
    let open = format!("pub mod {name} {{\n");
    let start = if code.starts_with(&open) {
        open.len()
    } else {
        code.find(&format!("\n{open}"))? + 1 + open.len()
    };
    let end = start + code[start..].find("\n}\n").map(|i| i + 1)?;
    Some((start, end))
}

/// Replaces the one `from` in `text` with `to`; an error names `what`
/// when it is missing.
fn replace_once(text: &mut String, from: &str, to: &str, what: &str) -> Result<(), String> {
    let at = text
        .find(from)
        .ok_or_else(|| format!("cannot find {what} (`{}`)", from.trim()))?;
    text.replace_range(at..at + from.len(), to);
    Ok(())
}

/// Adds the direct path to the clients of `services` in `code`.
pub(crate) fn add_to_clients(
    code: &str,
    services: &[Service],
    core: &str,
) -> Result<String, String> {
    let mut code = code.to_string();
    for s in services {
        let module_name = format!("{}_client", s.snake);
        let Some((start, end)) = module(&code, &module_name) else {
            return Err(format!(
                "cannot find `pub mod {module_name}` of service {}'s generated client",
                s.proto
            ));
        };
        let mut body = code[start..end].to_string();
        if body.contains("::direct::Client") {
            continue;
        }
        let client = format!("{}Client", s.name);
        let ctx = |what: &str| format!("{what} of {client}");
        replace_once(
            &mut body,
            "        inner: tonic::client::Grpc<T>,\n    }\n",
            &format!("        inner: tonic::client::Grpc<T>,\n        direct: {core}::direct::Client,\n    }}\n"),
            &ctx("the struct's fields"),
        )?;
        replace_once(
            &mut body,
            "        T: tonic::client::GrpcService<tonic::body::Body>,\n",
            "        T: tonic::client::GrpcService<tonic::body::Body> + 'static,\n",
            &ctx("the impl's bound on T"),
        )?;
        for ctor in [
            "tonic::client::Grpc::new(inner)",
            "tonic::client::Grpc::with_origin(inner, origin)",
        ] {
            replace_once(
                &mut body,
                &format!("            let inner = {ctor};\n            Self {{ inner }}\n"),
                &format!(
                    "            let mut inner = inner;\n            let direct = {core}::direct::Client::of(&mut inner);\n            let inner = {ctor};\n            Self {{ inner, direct }}\n"
                ),
                &ctx(&format!("the constructor with `{ctor}`")),
            )?;
        }
        replace_once(
            &mut body,
            "            F: tonic::service::Interceptor,\n",
            "            F: tonic::service::Interceptor + 'static,\n",
            &ctx("with_interceptor's bound on F"),
        )?;
        for (setter, arg) in [
            ("send_compressed", "encoding"),
            ("accept_compressed", "encoding"),
            ("max_decoding_message_size", "limit"),
            ("max_encoding_message_size", "limit"),
        ] {
            let line = format!("            self.inner = self.inner.{setter}({arg});\n");
            replace_once(
                &mut body,
                &line,
                &format!("{line}            self.direct = self.direct.{setter}({arg});\n"),
                &ctx(setter),
            )?;
        }
        for m in &s.methods {
            let call = match m.kind {
                Kind::Unary => "unary",
                Kind::ServerStreaming => "server_streaming",
                Kind::Other => continue,
            };
            let path = s.path(m);
            let lit = format!("\"{path}\"");
            let what = || ctx(&format!("the method for {path}"));
            let at = body
                .find(&lit)
                .ok_or_else(|| format!("cannot find {}", what()))?;
            let fn_at = body[..at]
                .rfind("pub async fn ")
                .ok_or_else(|| format!("cannot find the signature of {}", what()))?;
            // The body opens at the first `{` after the return type's
            // arrow (a return type has no braces).
            let body_at = body[fn_at..at]
                .find(") -> ")
                .and_then(|r| body[fn_at + r..at].find("{\n").map(|i| fn_at + r + i + 2))
                .ok_or_else(|| format!("cannot find the body of {}", what()))?;
            // A unary request's large `bytes` field goes uncopied.
            let (call, take) = match (m.kind, take_closure(&m.take_request, core)) {
                (Kind::Unary, Some(t)) => ("unary_large", format!(", {t}")),
                _ => (call, String::new()),
            };
            body.insert_str(
                body_at,
                &format!(
                    "            if let ::core::option::Option::Some(direct) = self.direct.get() {{\n                return direct.{call}({lit}, request.into_request(){take}).await;\n            }}\n"
                ),
            );
        }
        code.replace_range(start..end, &body);
    }
    Ok(code)
}

/// Adds the direct path to the servers of `services` in `code`.
pub(crate) fn add_to_servers(
    code: &str,
    services: &[Service],
    core: &str,
) -> Result<String, String> {
    let mut code = code.to_string();
    for s in services {
        let module_name = format!("{}_server", s.snake);
        let Some((start, end)) = module(&code, &module_name) else {
            return Err(format!(
                "cannot find `pub mod {module_name}` of service {}'s generated server",
                s.proto
            ));
        };
        let mut body = code[start..end].to_string();
        if body.contains("::direct::register") {
            continue;
        }
        let (name, server) = (&s.name, format!("{}Server", s.name));
        let ctx = |what: &str| format!("{what} of {server}");
        replace_once(
            &mut body,
            &format!("    impl<T> {server}<T> {{\n"),
            &format!("    impl<T: {name}> {server}<T> {{\n"),
            &ctx("the constructors' impl"),
        )?;
        let from_arc = "        pub fn from_arc(inner: Arc<T>) -> Self {\n";
        replace_once(
            &mut body,
            from_arc,
            &format!(
                "{from_arc}            {core}::direct::register::<Self>(Self::direct_methods);\n"
            ),
            &ctx("from_arc"),
        )?;
        // The methods the direct path serves, with the trait method each calls.
        let mut arms = String::new();
        let mut calls = String::new();
        let mut index = 0usize;
        for m in &s.methods {
            let call = match m.kind {
                Kind::Unary => "unary",
                Kind::ServerStreaming => "server_streaming",
                Kind::Other => continue,
            };
            let path = s.path(m);
            let what = || ctx(&format!("the method for {path}"));
            let at = body
                .find(&format!("\"{path}\" => {{"))
                .ok_or_else(|| format!("cannot find {}", what()))?;
            let prefix = format!("<T as {name}>::");
            let f = body[at..]
                .find(&prefix)
                .map(|i| at + i + prefix.len())
                .ok_or_else(|| format!("cannot find the trait method called by {}", what()))?;
            let ident: String = body[f..]
                .chars()
                .take_while(|c| c.is_alphanumeric() || *c == '_' || *c == '#')
                .collect();
            if ident.is_empty() {
                return Err(format!("cannot read the trait method called by {}", what()));
            }
            let _ = writeln!(
                arms,
                "                b\"{}\" => ::core::option::Option::Some({index}usize),",
                m.proto
            );
            // A unary reply's large `bytes` field goes uncopied.
            let (call, take) = match (m.kind, take_closure(&m.take_reply, core)) {
                (Kind::Unary, Some(t)) => ("unary_large", format!(", {t}")),
                _ => (call, String::new()),
            };
            let _ = writeln!(
                calls,
                "                {index}usize => call.{call}(self.limits, move |request| async move {{\n                    <T as {name}>::{ident}(&inner, request).await\n                }}{take}),"
            );
            index += 1;
        }
        let methods = format!("{name}DirectMethods");
        let item = format!(
            r#"    impl<T: {name}> {server}<T> {{
        /// This service's methods on the direct path (`{shown}::direct`),
        /// unless compression is enabled on it.
        fn direct_methods(
            &self,
        ) -> ::core::option::Option<::std::sync::Arc<dyn {core}::direct::Methods>> {{
            if !self.accept_compression_encodings.is_empty()
                || !self.send_compression_encodings.is_empty()
            {{
                return ::core::option::Option::None;
            }}
            ::core::option::Option::Some(
                ::std::sync::Arc::new({methods} {{
                    inner: ::std::sync::Arc::clone(&self.inner),
                    limits: {core}::direct::Limits {{
                        max_decoding_message_size: self.max_decoding_message_size,
                        max_encoding_message_size: self.max_encoding_message_size,
                    }},
                }}),
            )
        }}
    }}
    /// {server}'s methods on the direct path.
    struct {methods}<T> {{
        inner: ::std::sync::Arc<T>,
        limits: {core}::direct::Limits,
    }}
    impl<T: {name}> {core}::direct::Methods for {methods}<T> {{
        fn method(&self, name: &[u8]) -> ::core::option::Option<usize> {{
            match name {{
{arms}                _ => ::core::option::Option::None,
            }}
        }}
        fn call(
            &self,
            index: usize,
            call: {core}::direct::ServerCall,
        ) -> {core}::direct::DirectFuture {{
            let inner = ::std::sync::Arc::clone(&self.inner);
            match index {{
{calls}                _ => call.unimplemented(),
            }}
        }}
    }}
"#,
            shown = core.trim_start_matches("::"),
        );
        body.push_str(&item);
        code.replace_range(start..end, &body);
    }
    Ok(code)
}
