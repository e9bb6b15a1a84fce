//! Build-time helper: compiles `.proto` files into prost messages and tonic
//! client/server code, **without an external `protoc`** (the `.proto` files are
//! parsed by [`protox`], a protobuf compiler written in Rust).
//!
//! In a crate's `build.rs`:
//!
//! ```no_run
//! // build.rs: fn main() {
//! rpc_codegen::compile_protos(&["proto/helloworld.proto"], &["proto"]).unwrap();
//! // }
//! ```
//!
//! then in the crate: `pub mod helloworld { tonic::include_proto!("helloworld"); }`.
//! The generated code needs `tonic` (feature `codegen`), `tonic-prost`, `prost`
//! and `rpc-core` (for the clients' `connect`, below).
//!
//! # Clients connect through rpc-core
//!
//! Every generated client gets a `connect(dst)` that goes through rpc-core's
//! channel, RDMA where there is RDMA and TCP otherwise, exactly as
//! `rpc_core::Endpoint::connect` chooses:
//!
//! ```ignore
//! // GreeterClient<rpc_core::Channel>
//! let mut client = GreeterClient::connect("http://10.0.0.2:50051").await?;
//! ```
//!
//! `dst` is anything that converts into an `rpc_core::Endpoint` (`&'static str`,
//! `String`, `http::Uri`...), and errors are `rpc_core::Error`. Stock
//! tonic-build (and tonic-prost-build) instead gives
//! `GreeterClient<tonic::transport::Channel>` a `connect` that compiles and
//! works but always goes over tonic's own TCP transport, never RDMA: rpc-codegen
//! turns that one off (tonic-prost-build's `build_transport(false)`) and puts
//! its own in the same place, inside the generated `greeter_client` module.
//! `GreeterClient::new(channel)` takes an `rpc_core::Channel` as before, and so
//! does `with_interceptor`.
//!
//! [`compile_with_options`] and [`Options`] name rpc-core by another path (a
//! renamed dependency, a re-export) or keep tonic's transport `connect` instead.
//!
//! # The direct path
//!
//! Generated clients and servers also take rpc-core's direct path
//! (`rpc_core::direct`, [`Options::direct_path`]): on an RDMA or in-memory
//! connection, a unary or server-streaming call from a generated client over
//! an `rpc_core::Channel` to a generated service added to an
//! `rpc_core::Server` goes from the client's method to the service's trait
//! method without tonic's client and server machinery. Nothing changes in
//! the code that uses them, with two bounds tonic's code does not have: a
//! client's transport must be `'static` (every channel is), and a server's
//! constructors (`GreeterServer::new`...) need the service trait (`T:
//! Greeter`). Where the direct path does not apply (TCP, client or
//! bidirectional streaming, interceptors, compression, layers), calls take
//! tonic's path as before, with the same bytes on the wire.
//!
//! # Large payloads
//!
//! Generated clients and servers use `rpc_core::codec::ProstCodec`
//! ([`Options::lean_codec`]): tonic-prost's codec, except that a message is
//! encoded into one buffer of its encoded length instead of a buffer that
//! doubles from 8 KiB (a 1 MiB message: one 1 MiB allocation, not eight
//! reallocations ending at 2 MiB), and whose encode and decode buffers
//! start at 1 KiB rather than 8 KiB (a small call's message fits). For
//! payload fields, declare `bytes` and ask prost for
//! [`bytes::Bytes`](https://docs.rs/bytes) instead of
//! `Vec<u8>`: the decoded field is then a slice of the received buffer, not
//! a copy of it. On the direct path, a unary request's or reply's `bytes`
//! field of 16 KiB or more at the message's top level is sent without a
//! copy of its own, whichever type it has: the generated code takes it out
//! of the message and hands it to the transport after the other fields
//! (`rpc_core::direct::take_large`).
//!
//! ```no_run
//! // build.rs: fn main() {
//! rpc_codegen::compile_with(
//!     rpc_codegen::configure().bytes("."), // every `bytes` field as `Bytes`
//!     &["proto/blobs.proto"],
//!     &["proto"],
//! )
//! .unwrap();
//! // }
//! ```
//!
//! # Options
//!
//! Options go through tonic-prost-build's [`Builder`](tonic_prost_build::Builder),
//! re-exported here so no extra build-dependency is needed. A
//! `file_descriptor_set_path` is honoured as with tonic-prost-build, so
//! `tonic::include_file_descriptor_set!` works (e.g. for tonic-reflection):
//!
//! ```no_run
//! // build.rs: fn main() {
//! let out = std::path::PathBuf::from(std::env::var("OUT_DIR").unwrap());
//! rpc_codegen::compile_with(
//!     rpc_codegen::configure().file_descriptor_set_path(out.join("helloworld_descriptor.bin")),
//!     &["proto/helloworld.proto"],
//!     &["proto"],
//! )
//! .unwrap();
//! // }
//! ```

/// tonic-prost-build, re-exported: `rpc_codegen::tonic_prost_build::configure()`.
pub use tonic_prost_build;

mod direct;

use miette::Diagnostic;
use std::collections::BTreeMap;
use std::fmt;
use std::path::{Path, PathBuf};

/// A `.proto` file failed to compile, or code could not be generated.
#[derive(Debug)]
pub struct Error {
    /// File the problem is in, when known.
    pub file: Option<String>,
    /// 1-based line and column of the problem, when known.
    pub line_col: Option<(usize, usize)>,
    /// What is wrong.
    pub message: String,
}

impl Error {
    fn msg(message: impl Into<String>) -> Error {
        Error {
            file: None,
            line_col: None,
            message: message.into(),
        }
    }
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match (&self.file, self.line_col) {
            (Some(file), Some((l, c))) => write!(f, "{file}:{l}:{c}: {}", self.message),
            (Some(file), None) => write!(f, "{file}: {}", self.message),
            _ => f.write_str(&self.message),
        }
    }
}

impl std::error::Error for Error {}

impl From<protox::Error> for Error {
    fn from(e: protox::Error) -> Self {
        let mut message = e.to_string();
        if let Some(help) = e.help() {
            message.push_str(&format!(" (help: {help})"));
        }
        let mut line_col = None;
        if let (Some(src), Some(label)) = (e.source_code(), e.labels().and_then(|mut l| l.next())) {
            if let Ok(contents) = src.read_span(label.inner(), 0, 0) {
                line_col = Some((contents.line() + 1, contents.column() + 1));
            }
            if let Some(l) = label.label() {
                message.push_str(&format!(" ({l})"));
            }
        }
        Error {
            file: e.file().map(str::to_string),
            line_col,
            message,
        }
    }
}

/// What rpc-codegen adds to tonic-prost-build's output, for
/// [`compile_with_options`]. [`Options::default()`] is what [`compile_protos`]
/// and [`compile_with`] use.
///
/// ```no_run
/// // build.rs of a crate that renamed the dependency: `core_rpc = { package = "rpc-core", .. }`
/// rpc_codegen::compile_with_options(
///     rpc_codegen::configure(),
///     rpc_codegen::Options::default().rpc_core_path("::core_rpc"),
///     &["proto/helloworld.proto"],
///     &["proto"],
/// )
/// .unwrap();
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Options {
    /// How the generated code names the rpc-core crate: `::rpc_core` by
    /// default, `::other_name` for a renamed dependency, `crate::path` for a
    /// re-export. It is used inside the generated client modules, so it must be
    /// absolute (start with `::` or `crate::`).
    pub rpc_core_path: String,
    /// `true` (the default): every generated client gets a `connect(dst)` on
    /// `Client<rpc_core::Channel>` that connects through rpc-core (RDMA where
    /// there is RDMA), and tonic's transport `connect` is not generated.
    /// `false`: the builder's own `build_transport` setting applies (on by
    /// default: tonic's `connect` on `Client<tonic::transport::Channel>`, which
    /// always uses tonic's TCP transport, never RDMA).
    pub rdma_connect: bool,
    /// `true` (the default): generated clients and servers use
    /// `rpc_core::codec::ProstCodec`, tonic-prost's codec with an encoder
    /// that reserves each message's encoded length first (a large message
    /// is encoded into one allocation, not a buffer doubling from 8 KiB)
    /// and buffers that start at 1 KiB, not 8 KiB. The bytes on the wire
    /// are the same. Applies only while the builder's `codec_path` is
    /// tonic-prost-build's default; `false` keeps that default.
    pub lean_codec: bool,
    /// `true` (the default): generated clients and servers take the direct
    /// path on message connections (`rpc_core::direct`): a unary or
    /// server-streaming call from a generated client over an
    /// `rpc_core::Channel` to a generated service served by an
    /// `rpc_core::Server` goes from the client's method to the service's
    /// trait method without tonic's client and server machinery. The
    /// generated API is tonic's, except that a client's transport must be
    /// `'static` (every channel is) and a server's constructors need the
    /// service trait. `false` generates tonic-prost-build's code as it is.
    pub direct_path: bool,
}

impl Default for Options {
    fn default() -> Self {
        Options {
            rpc_core_path: "::rpc_core".to_string(),
            rdma_connect: true,
            lean_codec: true,
            direct_path: true,
        }
    }
}

impl Options {
    /// Sets [`rpc_core_path`](Options::rpc_core_path).
    pub fn rpc_core_path(mut self, path: impl Into<String>) -> Self {
        self.rpc_core_path = path.into();
        self
    }

    /// Sets [`rdma_connect`](Options::rdma_connect).
    pub fn rdma_connect(mut self, enable: bool) -> Self {
        self.rdma_connect = enable;
        self
    }

    /// Sets [`direct_path`](Options::direct_path).
    pub fn direct_path(mut self, enable: bool) -> Self {
        self.direct_path = enable;
        self
    }

    /// Sets [`lean_codec`](Options::lean_codec).
    pub fn lean_codec(mut self, enable: bool) -> Self {
        self.lean_codec = enable;
        self
    }
}

/// tonic-prost-build's builder with its defaults (client and server code), for
/// [`compile_with`].
pub fn configure() -> tonic_prost_build::Builder {
    tonic_prost_build::configure()
}

/// Compiles `protos` (searched in `includes`) into `$OUT_DIR`, client and
/// server code both, and tells cargo to rerun when any of them changes.
///
/// Clients' `connect(dst)` goes through rpc-core ([`Options::default()`]).
pub fn compile_protos(
    protos: &[impl AsRef<Path>],
    includes: &[impl AsRef<Path>],
) -> Result<(), Error> {
    compile_with(tonic_prost_build::configure(), protos, includes)
}

/// As [`compile_protos`], with a tonic-prost-build [`Builder`](tonic_prost_build::Builder)
/// for options (`build_client(false)`, `type_attribute(..)`, `out_dir(..)`,
/// `file_descriptor_set_path(..)`...).
///
/// The encoded `FileDescriptorSet` (with imports and source info, as `protoc
/// --include_imports --include_source_info` writes it) goes to the builder's
/// `file_descriptor_set_path` when one is set.
///
/// Clients' `connect(dst)` goes through rpc-core ([`Options::default()`]; the
/// builder's `build_transport` is overridden).
pub fn compile_with(
    builder: tonic_prost_build::Builder,
    protos: &[impl AsRef<Path>],
    includes: &[impl AsRef<Path>],
) -> Result<(), Error> {
    compile_with_options(builder, Options::default(), protos, includes)
}

/// `rdma_grpc/remote.proto`, the descriptor of rpc-core's remote memory
/// (`rpc_core::remote`), for protos that import it.
pub const REMOTE_PROTO: &str = include_str!("../../proto/rdma_grpc/remote.proto");

/// A directory holding `rdma_grpc/remote.proto` (under `$OUT_DIR`, else the
/// system's temporary directory), added last to the include path.
fn remote_proto_include() -> Result<PathBuf, Error> {
    let base = std::env::var_os("OUT_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(std::env::temp_dir);
    let dir = base.join("rpc_codegen_include");
    let file = dir.join("rdma_grpc").join("remote.proto");
    let write = || -> std::io::Result<()> {
        if std::fs::read_to_string(&file).ok().as_deref() != Some(REMOTE_PROTO) {
            std::fs::create_dir_all(file.parent().expect("has a parent"))?;
            std::fs::write(&file, REMOTE_PROTO)?;
        }
        Ok(())
    };
    write().map_err(|e| Error::msg(format!("writing {}: {e}", file.display())))?;
    Ok(dir)
}

/// As [`compile_with`], with [`Options`] for what rpc-codegen adds.
pub fn compile_with_options(
    builder: tonic_prost_build::Builder,
    options: Options,
    protos: &[impl AsRef<Path>],
    includes: &[impl AsRef<Path>],
) -> Result<(), Error> {
    if options.rdma_connect || options.lean_codec || options.direct_path {
        check_crate_path(&options.rpc_core_path)?;
    }
    let settings = BuilderSettings::read(&builder)?;
    let builder = if options.lean_codec && settings.default_codec {
        builder.codec_path(format!("{}::codec::ProstCodec", options.rpc_core_path))
    } else {
        builder
    };
    // `import "rdma_grpc/remote.proto"` finds the file rpc-core's remote
    // memory speaks, and its package is rpc-core's (`remote::proto`).
    let remote_dir = remote_proto_include()?;
    let builder = builder.extern_path(
        ".rdma_grpc",
        format!("{}::remote::proto", options.rpc_core_path),
    );
    let mut includes: Vec<PathBuf> = includes.iter().map(|i| i.as_ref().to_path_buf()).collect();
    includes.push(remote_dir);
    // protox::compile keeps imports and source info.
    let fds = protox::compile(protos, &includes)?;
    if let Some(path) = &settings.file_descriptor_set_path {
        use prost::Message;
        std::fs::write(path, fds.encode_to_vec()).map_err(|e| {
            Error::msg(format!(
                "writing file_descriptor_set_path {}: {e}",
                path.display()
            ))
        })?;
    }
    for p in protos {
        println!("cargo:rerun-if-changed={}", p.as_ref().display());
    }
    for i in &includes[..includes.len() - 1] {
        println!("cargo:rerun-if-changed={}", i.display());
    }
    let clients = (options.rdma_connect && settings.build_client).then(|| clients_by_file(&fds));
    let direct = options.direct_path.then(|| services_by_file(&fds));
    let builder = if options.rdma_connect {
        builder.build_transport(false)
    } else {
        builder
    };
    builder
        .compile_fds(fds)
        .map_err(|e| Error::msg(format!("generating code: {e}")))?;

    if clients.is_none() && direct.is_none() {
        return Ok(());
    }
    let out_dir = match settings.out_dir {
        Some(dir) => dir,
        None => std::env::var_os("OUT_DIR")
            .map(PathBuf::from)
            .ok_or_else(|| Error::msg("OUT_DIR is not set and the builder has no out_dir"))?,
    };
    let mut files: BTreeMap<String, ()> = BTreeMap::new();
    for f in clients.iter().flat_map(|c| c.keys()) {
        files.insert(f.clone(), ());
    }
    for f in direct.iter().flat_map(|d| d.keys()) {
        files.insert(f.clone(), ());
    }
    for file in files.keys() {
        let path = out_dir.join(file);
        let fail = |message: String| Error {
            file: Some(path.display().to_string()),
            line_col: None,
            message,
        };
        let code = std::fs::read_to_string(&path)
            .map_err(|e| fail(format!("reading generated code: {e}")))?;
        let mut edited = code.clone();
        if let Some(services) = direct.as_ref().and_then(|d| d.get(file)) {
            let core = &options.rpc_core_path;
            let hint = |m: String| {
                fail(format!(
                    "{m} (Options::direct_path(false) keeps tonic-build's code as it is)"
                ))
            };
            if settings.build_client {
                edited = direct::add_to_clients(&edited, services, core).map_err(hint)?;
            }
            if settings.build_server {
                edited = direct::add_to_servers(&edited, services, core).map_err(hint)?;
            }
        }
        if let Some(clients) = clients.as_ref().and_then(|c| c.get(file)) {
            edited = add_connects(&edited, clients, &options.rpc_core_path).map_err(|m| {
                fail(format!(
                    "{m} (Options::rdma_connect(false) keeps tonic-build's own connect instead)"
                ))
            })?;
        }
        if edited != code {
            std::fs::write(&path, edited)
                .map_err(|e| fail(format!("writing generated code: {e}")))?;
        }
    }
    Ok(())
}

/// A crate path usable from inside a generated module: `::name(::seg)*` or
/// `crate(::seg)*`.
fn check_crate_path(path: &str) -> Result<(), Error> {
    let bad = |why: &str| {
        Err(Error::msg(format!(
            "Options::rpc_core_path {path:?}: {why} (e.g. \"::rpc_core\")"
        )))
    };
    let segments: Vec<&str> = match path.strip_prefix("::") {
        Some(rest) => rest.split("::").collect(),
        None if path == "crate" || path.starts_with("crate::") => path.split("::").collect(),
        None => return bad("must start with `::` or `crate::`"),
    };
    let ident = |s: &str| {
        let s = s.strip_prefix("r#").unwrap_or(s);
        let mut chars = s.chars();
        matches!(chars.next(), Some(c) if c.is_alphabetic() || c == '_')
            && chars.all(|c| c.is_alphanumeric() || c == '_')
            && s != "_"
    };
    if segments.iter().all(|s| ident(s)) {
        Ok(())
    } else {
        bad("not a Rust path")
    }
}

/// The settings of a tonic-prost-build builder that rpc-codegen needs.
#[derive(Debug, PartialEq, Eq)]
struct BuilderSettings {
    build_client: bool,
    build_server: bool,
    file_descriptor_set_path: Option<PathBuf>,
    out_dir: Option<PathBuf>,
    /// `codec_path` is tonic-prost-build's default (`tonic_prost::ProstCodec`).
    default_codec: bool,
}

impl BuilderSettings {
    /// Reads them from `builder`.
    ///
    /// The fields are private: they are read from the builder's `Debug` form,
    /// whose fields come in declaration order (`build_client`, `build_server`,
    /// `build_transport`, `file_descriptor_set_path`, `skip_protoc_run`,
    /// `out_dir`, ...) and whose `Option<PathBuf>`s are printed as Rust string
    /// literals. Fields are read in that order, each string consumed whole, so
    /// a path cannot pass for a field name. A form that cannot be read is an
    /// error, never a silently missing file (the tests guard the format).
    ///
    /// tonic-prost-build writes `file_descriptor_set_path` only when it runs
    /// `protoc` itself (its `compile_fds` does not), so rpc-codegen writes it.
    fn read(builder: &tonic_prost_build::Builder) -> Result<BuilderSettings, Error> {
        let dbg = format!("{builder:?}");
        let mut fields = DebugFields { rest: &dbg };
        let settings = (|| {
            Ok(BuilderSettings {
                build_client: fields.bool("build_client")?,
                build_server: fields.bool("build_server")?,
                file_descriptor_set_path: fields.path("file_descriptor_set_path")?,
                out_dir: fields.path("out_dir")?,
                default_codec: dbg.contains("codec_path: \"tonic_prost::ProstCodec\""),
            })
        })();
        settings.map_err(|what: String| {
            Error::msg(format!(
                "cannot read the settings of tonic-prost-build's Builder: {what}"
            ))
        })
    }
}

/// A cursor over a `#[derive(Debug)]` struct's printed fields.
struct DebugFields<'a> {
    rest: &'a str,
}

impl<'a> DebugFields<'a> {
    /// Moves past `name: ` and returns what follows.
    fn value(&mut self, name: &str) -> Result<&'a str, String> {
        let key = format!("{name}: ");
        let at = self
            .rest
            .find(&key)
            .ok_or_else(|| format!("field {name} not found"))?;
        self.rest = &self.rest[at + key.len()..];
        Ok(self.rest)
    }

    fn bool(&mut self, name: &str) -> Result<bool, String> {
        let v = self.value(name)?;
        for (text, b) in [("true", true), ("false", false)] {
            if let Some(rest) = v.strip_prefix(text) {
                self.rest = rest;
                return Ok(b);
            }
        }
        Err(format!("field {name}: unexpected form"))
    }

    fn path(&mut self, name: &str) -> Result<Option<PathBuf>, String> {
        let v = self.value(name)?;
        if let Some(rest) = v.strip_prefix("None") {
            self.rest = rest;
            return Ok(None);
        }
        let lit = v
            .strip_prefix("Some(\"")
            .ok_or_else(|| format!("field {name}: unexpected form"))?;
        let (s, used) = parse_debug_str(lit)
            .ok_or_else(|| format!("field {name}: unterminated string or unknown escape"))?;
        self.rest = &lit[used..];
        Ok(Some(PathBuf::from(s)))
    }
}

/// Reads a string printed by `{:?}` (after its opening quote) up to its
/// closing quote, undoing the escapes `str::escape_debug` produces. Returns the
/// string and the bytes read, closing quote included.
fn parse_debug_str(s: &str) -> Option<(String, usize)> {
    let mut out = String::new();
    let mut chars = s.char_indices();
    loop {
        match chars.next()? {
            (i, '"') => return Some((out, i + 1)),
            (_, '\\') => match chars.next()?.1 {
                'n' => out.push('\n'),
                'r' => out.push('\r'),
                't' => out.push('\t'),
                '0' => out.push('\0'),
                c @ ('\\' | '"' | '\'') => out.push(c),
                'u' => {
                    if chars.next()?.1 != '{' {
                        return None;
                    }
                    let mut hex = String::new();
                    loop {
                        match chars.next()?.1 {
                            '}' => break,
                            c => hex.push(c),
                        }
                    }
                    out.push(char::from_u32(u32::from_str_radix(&hex, 16).ok()?)?);
                }
                // `\xNN`: a byte that is not UTF-8 (OsStr); such paths are not supported.
                _ => return None,
            },
            (_, c) => out.push(c),
        }
    }
}

/// The names tonic-prost-build gives a service's client.
#[derive(Debug, Clone, PartialEq, Eq)]
struct ClientNames {
    /// `helloworld.Greeter`, for messages.
    proto: String,
    /// `greeter_client`
    module: String,
    /// `GreeterClient`
    client: String,
}

/// The clients tonic-prost-build generates for `fds`, by generated file name
/// (prost-build writes one `<package>.rs` per package, `_.rs` without one).
fn clients_by_file(fds: &prost_types::FileDescriptorSet) -> BTreeMap<String, Vec<ClientNames>> {
    let mut files: BTreeMap<String, Vec<ClientNames>> = BTreeMap::new();
    for file in &fds.file {
        if file.service.is_empty() {
            continue;
        }
        let package = file.package();
        let clients = files.entry(package_file_name(package)).or_default();
        for service in &file.service {
            // prost-build's `Service::name`, then tonic-build's names from it.
            let name = to_upper_camel(service.name());
            clients.push(ClientNames {
                proto: if package.is_empty() {
                    service.name().to_string()
                } else {
                    format!("{package}.{}", service.name())
                },
                module: format!("{}_client", naive_snake_case(&name)),
                client: format!("{name}Client"),
            });
        }
    }
    files
}

/// The services in `fds` with their methods, by generated file name.
fn services_by_file(
    fds: &prost_types::FileDescriptorSet,
) -> BTreeMap<String, Vec<direct::Service>> {
    let mut files: BTreeMap<String, Vec<direct::Service>> = BTreeMap::new();
    for file in &fds.file {
        if file.service.is_empty() {
            continue;
        }
        let package = file.package();
        let services = files.entry(package_file_name(package)).or_default();
        // This file's messages by full name (`.pkg.Outer.Inner`), for the
        // large `bytes` fields of the requests and replies of its methods.
        let mut messages = BTreeMap::new();
        collect_messages(
            &format!(".{package}").replace("..", "."),
            &file.message_type,
            &mut messages,
        );
        let large = |ty: &str| {
            messages
                .get(ty)
                .map(|m| large_fields(m))
                .unwrap_or_default()
        };
        for service in &file.service {
            let name = to_upper_camel(service.name());
            services.push(direct::Service {
                proto: if package.is_empty() {
                    service.name().to_string()
                } else {
                    format!("{package}.{}", service.name())
                },
                snake: naive_snake_case(&name),
                name,
                methods: service
                    .method
                    .iter()
                    .map(|m| direct::Method {
                        proto: m.name().to_string(),
                        kind: match (m.client_streaming(), m.server_streaming()) {
                            (false, false) => direct::Kind::Unary,
                            (false, true) => direct::Kind::ServerStreaming,
                            _ => direct::Kind::Other,
                        },
                        take_request: large(m.input_type()),
                        take_reply: large(m.output_type()),
                    })
                    .collect(),
            });
        }
    }
    files
}

/// The messages declared in `messages` (and nested in them), by full name
/// under `prefix` (`.pkg` or `.pkg.Outer`; `.` for no package).
fn collect_messages<'a>(
    prefix: &str,
    messages: &'a [prost_types::DescriptorProto],
    out: &mut BTreeMap<String, &'a prost_types::DescriptorProto>,
) {
    for m in messages {
        let name = if prefix == "." {
            format!(".{}", m.name())
        } else {
            format!("{prefix}.{}", m.name())
        };
        collect_messages(&name, &m.nested_type, out);
        out.insert(name, m);
    }
}

/// A message's singular `bytes` fields at its top level (Rust field name,
/// field number): the direct path sends a large one apart from the rest
/// (`rpc_core::direct::take_large`).
fn large_fields(m: &prost_types::DescriptorProto) -> Vec<(String, i32)> {
    use prost_types::field_descriptor_proto::{Label, Type};
    m.field
        .iter()
        .filter(|f| {
            f.r#type() == Type::Bytes
                && f.label() != Label::Repeated
                && (f.oneof_index.is_none() || f.proto3_optional())
        })
        .map(|f| (to_snake(f.name()), f.number()))
        .collect()
}

/// prost-build's file name for a package (`Module::to_file_name_or("_")`).
fn package_file_name(package: &str) -> String {
    let parts: Vec<String> = package
        .split('.')
        .filter(|s| !s.is_empty())
        .map(to_snake)
        .collect();
    if parts.is_empty() {
        "_.rs".to_string()
    } else {
        format!("{}.rs", parts.join("."))
    }
}

/// Adds, inside each client's module in `code` (one generated file), a
/// `connect(dst)` on `Client<{core}::Channel>`, where tonic-build puts its
/// transport `connect`. `#[cfg(..)]` attributes on the client struct are
/// copied onto the impl (those on the module hold for it already).
///
/// `code` is prettyplease's output: a module at the file's top level opens
/// with the line `pub mod name {` and ends at the next line that is `}`, its
/// items are indented by 4 spaces.
fn add_connects(code: &str, clients: &[ClientNames], core: &str) -> Result<String, String> {
    let mut code = code.to_string();
    for c in clients {
        let (at, imp) = {
            let lines = lines_at(&code);
            let open = format!("pub mod {} {{", c.module);
            let not_found = |what: &str| {
                format!(
                    "cannot find {what} of service {}'s generated client",
                    c.proto
                )
            };
            let start = lines
                .iter()
                .position(|(_, l)| *l == open)
                .ok_or_else(|| not_found(&format!("`{open}`")))?;
            let end = lines[start + 1..]
                .iter()
                .position(|(_, l)| *l == "}")
                .map(|i| start + 1 + i)
                .ok_or_else(|| not_found("the end of the module"))?;
            let body: Vec<&str> = lines[start + 1..end].iter().map(|(_, l)| *l).collect();
            let decl = format!("    pub struct {}<T> {{", c.client);
            let decl_at = body
                .iter()
                .position(|l| *l == decl)
                .ok_or_else(|| not_found(&format!("`{}`", decl.trim())))?;
            let head = format!("impl {}<{core}::Channel> {{", c.client);
            if body.iter().any(|l| l.trim() == head) {
                continue;
            }
            let mut cfgs: Vec<&str> = body[..decl_at]
                .iter()
                .rev()
                .take_while(|l| l.starts_with("    #[") || l.starts_with("    ///"))
                .filter(|l| l.starts_with("    #[cfg("))
                .copied()
                .collect();
            cfgs.reverse();
            (lines[end].0, connect_impl(&c.client, core, &cfgs))
        };
        code.insert_str(at, &imp);
    }
    Ok(code)
}

/// `s`'s lines (without line ending), each with its byte offset.
fn lines_at(s: &str) -> Vec<(usize, &str)> {
    let mut at = 0;
    s.split_inclusive('\n')
        .map(|l| {
            let line = (at, l.trim_end_matches(['\n', '\r']));
            at += l.len();
            line
        })
        .collect()
}

/// The generated `connect`: tonic-build's transport `connect`, with rpc-core's
/// types, indented as an item of the client module.
fn connect_impl(client: &str, core: &str, cfgs: &[&str]) -> String {
    let shown = core.trim_start_matches("::");
    let mut s = String::new();
    for cfg in cfgs {
        s.push_str(cfg);
        s.push('\n');
    }
    s.push_str(&format!(
        r#"    impl {client}<{core}::Channel> {{
        /// Connects through rpc-core's channel: RDMA where there is RDMA, TCP
        /// otherwise (as `{shown}::Endpoint::connect`).
        pub async fn connect<D>(dst: D) -> ::core::result::Result<Self, {core}::Error>
        where
            D: ::core::convert::TryInto<{core}::Endpoint>,
            D::Error: ::core::convert::Into<
                ::std::boxed::Box<
                    dyn ::std::error::Error + ::core::marker::Send + ::core::marker::Sync + 'static,
                >,
            >,
        {{
            let conn = {core}::Endpoint::new(dst)?.connect().await?;
            ::core::result::Result::Ok(Self::new(conn))
        }}
    }}
"#
    ));
    s
}

// prost-build's identifier conversions (its `ident` module, over heck 0.5),
// which name the generated files and types.

/// prost-build's `to_upper_camel`.
fn to_upper_camel(s: &str) -> String {
    let camel: String = heck_words(s).into_iter().map(capitalize).collect();
    sanitize_identifier(camel)
}

/// prost-build's `to_snake`.
fn to_snake(s: &str) -> String {
    let words: Vec<String> = heck_words(s).into_iter().map(lowercase).collect();
    sanitize_identifier(words.join("_"))
}

/// prost-build's `sanitize_identifier`: keywords become raw identifiers (or
/// get a `_` suffix when they cannot be raw), leading digits a `_` prefix.
fn sanitize_identifier(ident: String) -> String {
    match ident.as_str() {
        "as" | "break" | "const" | "continue" | "else" | "enum" | "false" | "fn" | "for" | "if"
        | "impl" | "in" | "let" | "loop" | "match" | "mod" | "move" | "mut" | "pub" | "ref"
        | "return" | "static" | "struct" | "trait" | "true" | "type" | "unsafe" | "use"
        | "where" | "while" | "dyn" | "abstract" | "become" | "box" | "do" | "final" | "macro"
        | "override" | "priv" | "typeof" | "unsized" | "virtual" | "yield" | "async" | "await"
        | "try" | "gen" => format!("r#{ident}"),
        "_" | "super" | "self" | "Self" | "extern" | "crate" => format!("{ident}_"),
        s if s.starts_with(|c: char| c.is_numeric()) => format!("_{ident}"),
        _ => ident,
    }
}

/// heck's word split: on non-alphanumeric characters, before an uppercase
/// letter that follows a lowercase one, and before the last of a run of
/// uppercase letters followed by a lowercase one (`HTTPServer`: `HTTP`, `Server`).
fn heck_words(s: &str) -> Vec<&str> {
    #[derive(Clone, Copy, PartialEq)]
    enum Mode {
        Boundary,
        Lowercase,
        Uppercase,
    }
    let mut words = Vec::new();
    for word in s.split(|c: char| !c.is_alphanumeric()) {
        let mut chars = word.char_indices().peekable();
        let mut init = 0;
        let mut mode = Mode::Boundary;
        while let Some((i, c)) = chars.next() {
            let Some(&(next_i, next)) = chars.peek() else {
                words.push(&word[init..]);
                break;
            };
            let next_mode = if c.is_lowercase() {
                Mode::Lowercase
            } else if c.is_uppercase() {
                Mode::Uppercase
            } else {
                mode
            };
            if next_mode == Mode::Lowercase && next.is_uppercase() {
                words.push(&word[init..next_i]);
                init = next_i;
                mode = Mode::Boundary;
            } else if mode == Mode::Uppercase && c.is_uppercase() && next.is_lowercase() {
                words.push(&word[init..i]);
                init = i;
                mode = Mode::Boundary;
            } else {
                mode = next_mode;
            }
        }
    }
    words
}

/// heck's `lowercase` (a final `Σ` becomes `ς`).
fn lowercase(s: &str) -> String {
    let mut out = String::new();
    let mut chars = s.chars().peekable();
    while let Some(c) = chars.next() {
        if c == 'Σ' && chars.peek().is_none() {
            out.push('ς');
        } else {
            out.extend(c.to_lowercase());
        }
    }
    out
}

/// heck's `capitalize`.
fn capitalize(s: &str) -> String {
    let mut chars = s.char_indices();
    let mut out = String::new();
    if let Some((_, c)) = chars.next() {
        out.extend(c.to_uppercase());
        if let Some((i, _)) = chars.next() {
            out.push_str(&lowercase(&s[i..]));
        }
    }
    out
}

/// tonic-build's `naive_snake_case`, which names the client module.
fn naive_snake_case(name: &str) -> String {
    let mut s = String::new();
    let mut it = name.chars().peekable();
    while let Some(x) = it.next() {
        s.push(x.to_ascii_lowercase());
        if let Some(y) = it.peek() {
            if y.is_uppercase() {
                s.push('_');
            }
        }
    }
    s
}

/// Parses and checks `protos` without generating code (for tests and tools).
pub fn check(
    protos: &[impl AsRef<Path>],
    includes: &[impl AsRef<Path>],
) -> Result<Vec<PathBuf>, Error> {
    let mut includes: Vec<PathBuf> = includes.iter().map(|i| i.as_ref().to_path_buf()).collect();
    includes.push(remote_proto_include()?);
    let fds = protox::compile(protos, &includes)?;
    Ok(fds
        .file
        .iter()
        .filter_map(|f| f.name.clone())
        .map(PathBuf::from)
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A fresh directory for one test.
    fn temp_dir(name: &str) -> PathBuf {
        let dir = std::env::temp_dir().join(format!("rpc-codegen-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        dir
    }

    fn proto_root() -> PathBuf {
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../proto")
    }

    /// Compiles the workspace's protos into a fresh directory and returns it.
    fn generate(
        name: &str,
        builder: tonic_prost_build::Builder,
        options: Options,
    ) -> Result<PathBuf, Error> {
        let dir = temp_dir(name);
        let root = proto_root();
        let protos = ["helloworld.proto", "routeguide.proto", "echo.proto"].map(|p| root.join(p));
        compile_with_options(builder.out_dir(&dir), options, &protos, &[&root])?;
        Ok(dir)
    }

    fn read(dir: &Path, file: &str) -> String {
        std::fs::read_to_string(dir.join(file)).unwrap()
    }

    #[test]
    fn bad_proto_names_file_and_line() {
        let dir = temp_dir("bad");
        std::fs::write(
            dir.join("bad.proto"),
            "syntax = \"proto3\";\npackage bad;\n\nmessage M {\n  strin name = 1;\n}\n",
        )
        .unwrap();
        let err = check(&[dir.join("bad.proto")], &[&dir]).unwrap_err();
        let text = err.to_string();
        assert_eq!(err.file.as_deref(), Some("bad.proto"), "{text}");
        assert_eq!(err.line_col.map(|(l, _)| l), Some(5), "{text}");
        assert!(text.starts_with("bad.proto:5:"), "{text}");
    }

    #[test]
    fn debug_strings_round_trip() {
        for s in ["/tmp/a b/x.bin", "q\"uo\\te", "tab\tnl\n", "é✓\u{7}", ""] {
            let printed = format!("{s:?} rest");
            let (parsed, used) = parse_debug_str(&printed[1..]).unwrap();
            assert_eq!(parsed, s, "{printed}");
            assert_eq!(&printed[1 + used..], " rest", "{printed}");
        }
        assert_eq!(parse_debug_str("no end"), None);
    }

    #[test]
    fn builder_settings_are_read() {
        assert_eq!(
            BuilderSettings::read(&configure()).unwrap(),
            BuilderSettings {
                build_client: true,
                build_server: true,
                file_descriptor_set_path: None,
                out_dir: None,
                default_codec: true,
            }
        );
        // A path that looks like the next field does not pass for it.
        let tricky = PathBuf::from("/tmp/x, skip_protoc_run: false, out_dir: Some(\"/y\")");
        let builder = configure()
            .build_client(false)
            .build_server(false)
            .file_descriptor_set_path(&tricky)
            .out_dir("/z \"q\"");
        assert_eq!(
            BuilderSettings::read(&builder).unwrap(),
            BuilderSettings {
                build_client: false,
                build_server: false,
                file_descriptor_set_path: Some(tricky),
                out_dir: Some(PathBuf::from("/z \"q\"")),
                default_codec: true,
            }
        );
        // A codec of the user's own is kept.
        let own = configure().codec_path("crate::MyCodec");
        assert!(!BuilderSettings::read(&own).unwrap().default_codec);
    }

    #[test]
    fn generated_code_uses_the_lean_codec_unless_told_otherwise() {
        let root = proto_root();
        for (options, builder, want) in [
            (
                Options::default(),
                configure(),
                "::rpc_core::codec::ProstCodec",
            ),
            (
                Options::default().rpc_core_path("::core_rpc"),
                configure(),
                "::core_rpc::codec::ProstCodec",
            ),
            (
                Options::default().lean_codec(false),
                configure(),
                "tonic_prost::ProstCodec",
            ),
            (
                Options::default(),
                configure().codec_path("crate::MyCodec"),
                "crate::MyCodec",
            ),
        ] {
            let dir = temp_dir("codec");
            compile_with_options(
                builder.out_dir(&dir),
                options.clone(),
                &[root.join("helloworld.proto")],
                &[&root],
            )
            .unwrap();
            let code = std::fs::read_to_string(dir.join("helloworld.rs")).unwrap();
            assert!(
                code.contains(&format!("{want}::default()")),
                "{options:?}: expected {want} in the generated code"
            );
        }
    }

    #[test]
    fn descriptor_set_path_is_honoured() {
        use prost::Message;
        let dir = temp_dir("fds");
        let fds_path = dir.join("a \"dir\"/descriptor.bin");
        std::fs::create_dir_all(fds_path.parent().unwrap()).unwrap();
        let builder = configure()
            .out_dir(&dir)
            .file_descriptor_set_path(&fds_path);

        let root = proto_root();
        compile_with(builder, &[root.join("helloworld.proto")], &[&root]).unwrap();
        let fds =
            prost_types::FileDescriptorSet::decode(&*std::fs::read(&fds_path).unwrap()).unwrap();
        let names: Vec<_> = fds.file.iter().filter_map(|f| f.name.as_deref()).collect();
        assert_eq!(names, ["helloworld.proto"]);
        let svc = &fds.file[0].service[0];
        assert_eq!(svc.name.as_deref(), Some("Greeter"));
        assert!(fds.file[0].source_code_info.is_some(), "source info kept");
        assert!(dir.join("helloworld.rs").exists(), "code generated too");
    }

    #[test]
    fn generated_clients_connect_through_rpc_core() {
        let dir = generate("connect", configure(), Options::default()).unwrap();
        for (file, module, client) in [
            ("helloworld.rs", "greeter_client", "GreeterClient"),
            ("routeguide.rs", "route_guide_client", "RouteGuideClient"),
            ("echo.rs", "echo_client", "EchoClient"),
        ] {
            let code = read(&dir, file);
            assert!(!code.contains("tonic::transport"), "{file}:\n{code}");
            assert_eq!(code.matches("pub async fn connect<D>").count(), 1, "{file}");
            let imp = format!("    impl {client}<::rpc_core::Channel> {{");
            let at = code.find(&imp).unwrap_or_else(|| panic!("{file}:\n{code}"));
            // Inside the client module, after the struct.
            let module_at = code.find(&format!("\npub mod {module} {{\n")).unwrap();
            let struct_at = code
                .find(&format!("    pub struct {client}<T> {{"))
                .unwrap();
            let module_end = module_at + code[module_at..].find("\n}\n").unwrap();
            assert!(
                module_at < struct_at && struct_at < at && at < module_end,
                "{file}"
            );
            for line in [
                "pub async fn connect<D>(dst: D) -> ::core::result::Result<Self, ::rpc_core::Error>",
                "D: ::core::convert::TryInto<::rpc_core::Endpoint>,",
                "let conn = ::rpc_core::Endpoint::new(dst)?.connect().await?;",
                "::core::result::Result::Ok(Self::new(conn))",
            ] {
                assert!(code[at..module_end].contains(line), "{file}: {line}");
            }
        }
        // The server side is untouched.
        assert!(read(&dir, "helloworld.rs").contains("pub mod greeter_server {"));
    }

    #[test]
    fn generating_twice_adds_connect_once() {
        let dir = generate("twice", configure(), Options::default()).unwrap();
        let first = read(&dir, "helloworld.rs");
        let root = proto_root();
        compile_with(
            configure().out_dir(&dir),
            &[root.join("helloworld.proto")],
            &[&root],
        )
        .unwrap();
        assert_eq!(read(&dir, "helloworld.rs"), first);
        let clients = &clients_by_file(&protox::compile(["helloworld.proto"], [&root]).unwrap())
            ["helloworld.rs"];
        assert_eq!(
            add_connects(&first, clients, "::rpc_core").unwrap(),
            first,
            "already there"
        );
    }

    #[test]
    fn no_client_no_connect() {
        let dir = generate(
            "noclient",
            configure().build_client(false),
            Options::default().lean_codec(false).direct_path(false),
        )
        .unwrap();
        let code = read(&dir, "helloworld.rs");
        assert!(code.contains("pub mod greeter_server {"), "{code}");
        assert!(!code.contains("greeter_client"), "{code}");
        assert!(!code.contains("connect"), "{code}");
        assert!(!code.contains("rpc_core"), "{code}");
    }

    #[test]
    fn clients_and_servers_get_the_direct_path() {
        let dir = generate("direct", configure(), Options::default()).unwrap();
        let code = read(&dir, "helloworld.rs");
        for part in [
            "direct: ::rpc_core::direct::Client,",
            "let direct = ::rpc_core::direct::Client::of(&mut inner);",
            "self.direct = self.direct.max_decoding_message_size(limit);",
            "return direct.unary(\"/helloworld.Greeter/SayHello\", request.into_request()).await;",
            "impl<T: Greeter> GreeterServer<T> {",
            "::rpc_core::direct::register::<Self>(Self::direct_methods);",
            "b\"SayHello\" => ::core::option::Option::Some(0usize),",
            "<T as Greeter>::say_hello(&inner, request).await",
        ] {
            assert!(code.contains(part), "{part} in {code}");
        }
        // Edited once: a second pass changes nothing.
        let services =
            &services_by_file(&protox::compile(["helloworld.proto"], [proto_root()]).unwrap())
                ["helloworld.rs"];
        assert_eq!(
            direct::add_to_clients(&code, services, "::rpc_core").unwrap(),
            code
        );
        assert_eq!(
            direct::add_to_servers(&code, services, "::rpc_core").unwrap(),
            code
        );
        // A form that is not found is an error naming it, not an unedited client.
        let plain = generate(
            "direct-off",
            configure(),
            Options::default().direct_path(false),
        )
        .unwrap();
        let plain = read(&plain, "helloworld.rs");
        assert!(!plain.contains("::direct::"), "{plain}");
        let changed = plain.replace("Self { inner }", "Self { inner: inner }");
        let e = direct::add_to_clients(&changed, services, "::rpc_core").unwrap_err();
        assert!(e.contains("the constructor"), "{e}");
    }

    #[test]
    fn a_unary_message_s_bytes_field_is_sent_apart() {
        let dir = generate("large", configure(), Options::default()).unwrap();
        let code = read(&dir, "echo.rs");
        // Request and reply of the unary method: their `payload` (field 2).
        let take = "|m| ::rpc_core::direct::take_large(&mut m.payload, 2)";
        let client = format!(
            "return direct.unary_large(\"/echo.Echo/UnaryEcho\", request.into_request(), {take}).await;"
        );
        assert!(code.contains(&client), "{client} in {code}");
        assert!(code.contains("0usize => call.unary_large(self.limits, move |request|"));
        assert!(code.contains(&format!("}}, {take}),")), "{code}");
        // Streaming methods keep the plain calls.
        assert!(code.contains("direct.server_streaming(\"/echo.Echo/ServerStreamingEcho\""));
        // A message without `bytes` fields: the plain unary call.
        let hello = read(&dir, "helloworld.rs");
        assert!(!hello.contains("unary_large"), "{hello}");
        // Nested messages are found by their full names; repeated and
        // oneof `bytes` fields are not taken, proto3 optional ones are.
        let fds = protox::compile(["echo.proto"], [proto_root()]).unwrap();
        let mut all = BTreeMap::new();
        collect_messages(".echo", &fds.file[0].message_type, &mut all);
        assert!(all.contains_key(".echo.EchoRequest"), "{:?}", all.keys());
        use prost_types::field_descriptor_proto::{Label, Type};
        let field = |name: &str, n: i32, label: Label, oneof: Option<i32>, opt: bool| {
            prost_types::FieldDescriptorProto {
                name: Some(name.into()),
                number: Some(n),
                label: Some(label as i32),
                r#type: Some(Type::Bytes as i32),
                oneof_index: oneof,
                proto3_optional: opt.then_some(true),
                ..Default::default()
            }
        };
        let m = prost_types::DescriptorProto {
            field: vec![
                field("many", 1, Label::Repeated, None, false),
                field("choice", 2, Label::Optional, Some(0), false),
                field("maybe", 3, Label::Optional, Some(1), true),
                field("type", 4, Label::Optional, None, false),
            ],
            ..Default::default()
        };
        assert_eq!(
            large_fields(&m),
            [("maybe".to_string(), 3), ("r#type".to_string(), 4)]
        );
    }

    #[test]
    fn rdma_connect_off_keeps_tonic_connect() {
        let dir = generate(
            "tonicconnect",
            configure(),
            Options::default()
                .rdma_connect(false)
                .lean_codec(false)
                .direct_path(false),
        )
        .unwrap();
        let code = read(&dir, "helloworld.rs");
        assert!(
            code.contains("impl GreeterClient<tonic::transport::Channel> {"),
            "{code}"
        );
        assert!(!code.contains("rpc_core"), "{code}");
    }

    #[test]
    fn rpc_core_path_is_configurable() {
        let dir = generate(
            "renamed",
            configure(),
            Options::default().rpc_core_path("::core_rpc"),
        )
        .unwrap();
        let code = read(&dir, "helloworld.rs");
        assert!(
            code.contains("impl GreeterClient<::core_rpc::Channel> {"),
            "{code}"
        );
        assert!(code.contains("::core_rpc::Endpoint::new(dst)?"), "{code}");
        assert!(
            code.contains("(as `core_rpc::Endpoint::connect`)"),
            "{code}"
        );
        assert!(!code.contains("rpc_core"), "{code}");

        for ok in ["::rpc_core", "crate::rdma::rpc", "crate", "::r#async::x_2"] {
            check_crate_path(ok).unwrap();
        }
        for bad in [
            "rpc_core",
            "super::rpc_core",
            "::",
            "::a::",
            "::a b",
            "::1a",
            "::_",
            "",
        ] {
            let err = generate(
                "badpath",
                configure(),
                Options::default().rpc_core_path(bad),
            )
            .unwrap_err();
            assert!(err.message.contains("rpc_core_path"), "{bad}: {err}");
        }
    }

    #[test]
    fn cfg_on_the_client_struct_holds_for_connect() {
        let dir = generate(
            "cfg",
            configure()
                .client_attribute("helloworld.Greeter", "#[cfg(feature = \"greeter\")]")
                .client_mod_attribute("echo", "#[cfg(feature = \"echo\")]"),
            Options::default(),
        )
        .unwrap();
        let code = read(&dir, "helloworld.rs");
        assert!(
            code.contains(
                "    #[cfg(feature = \"greeter\")]\n    impl GreeterClient<::rpc_core::Channel> {"
            ),
            "{code}"
        );
        let code = read(&dir, "echo.rs");
        assert!(
            code.contains("#[cfg(feature = \"echo\")]\npub mod echo_client {"),
            "{code}"
        );
        assert!(
            code.contains("    impl EchoClient<::rpc_core::Channel> {"),
            "{code}"
        );
    }

    /// Names that prost-build and tonic-build convert: the generated file and
    /// client must be where rpc-codegen looks (it fails when they are not).
    #[test]
    fn converted_names_are_found() {
        let dir = temp_dir("names");
        std::fs::write(
            dir.join("names.proto"),
            "syntax = \"proto3\";\npackage My.HTTPPkg_v2.type;\n\
             message M {}\n\
             service HTTPService { rpc Get(M) returns (M); }\n\
             service lower_case_svc { rpc Get(M) returns (M); }\n\
             service Self { rpc Get(M) returns (M); }\n\
             service Svc2Go { }\n",
        )
        .unwrap();
        std::fs::write(
            dir.join("nopkg.proto"),
            "syntax = \"proto3\";\nmessage N {}\nservice Plain { rpc Get(N) returns (N); }\n",
        )
        .unwrap();
        let out = dir.join("out");
        std::fs::create_dir_all(&out).unwrap();
        compile_with(
            configure().out_dir(&out),
            &[dir.join("names.proto"), dir.join("nopkg.proto")],
            &[&dir],
        )
        .unwrap();
        let code = read(&out, "my.http_pkg_v2.r#type.rs");
        for (module, client) in [
            ("http_service_client", "HttpServiceClient"),
            ("lower_case_svc_client", "LowerCaseSvcClient"),
            ("self__client", "Self_Client"),
            ("svc2_go_client", "Svc2GoClient"),
        ] {
            assert!(
                code.contains(&format!("pub mod {module} {{")),
                "{module}:\n{code}"
            );
            assert!(
                code.contains(&format!("impl {client}<::rpc_core::Channel> {{")),
                "{client}:\n{code}"
            );
        }
        assert!(read(&out, "_.rs").contains("impl PlainClient<::rpc_core::Channel> {"));
    }

    #[test]
    fn identifier_conversions_match_prost_build() {
        for (s, camel, snake) in [
            ("Greeter", "Greeter", "greeter"),
            ("RouteGuide", "RouteGuide", "route_guide"),
            ("HTTPServer", "HttpServer", "http_server"),
            ("route_guide", "RouteGuide", "route_guide"),
            ("v2Api", "V2Api", "v2_api"),
            ("ABC", "Abc", "abc"),
            ("type", "Type", "r#type"),
            ("self", "Self_", "self_"),
            ("2fa", "_2fa", "_2fa"),
            ("ΣΑΣ", "Σας", "σας"),
        ] {
            assert_eq!(to_upper_camel(s), camel, "{s}");
            assert_eq!(to_snake(s), snake, "{s}");
        }
        assert_eq!(naive_snake_case("RouteGuide"), "route_guide");
        assert_eq!(package_file_name(""), "_.rs");
        assert_eq!(package_file_name("a.B.type"), "a.b.r#type.rs");
    }

    #[test]
    fn missing_client_is_an_error() {
        let c = ClientNames {
            proto: "x.Greeter".into(),
            module: "greeter_client".into(),
            client: "GreeterClient".into(),
        };
        let err = add_connects(
            "pub mod other {\n}\n",
            std::slice::from_ref(&c),
            "::rpc_core",
        )
        .unwrap_err();
        assert!(err.contains("x.Greeter"), "{err}");
        let err = add_connects(
            "pub mod greeter_client {\n    pub struct Other<T> {\n    }\n}\n",
            &[c],
            "::rpc_core",
        )
        .unwrap_err();
        assert!(err.contains("pub struct GreeterClient<T>"), "{err}");
    }

    #[test]
    fn good_proto_compiles() {
        let root = proto_root();
        let files = check(&[root.join("helloworld.proto")], &[&root]).unwrap();
        assert_eq!(files, vec![PathBuf::from("helloworld.proto")]);
    }
}
