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
//! The generated code needs `tonic` (feature `codegen`), `tonic-prost` and `prost`.
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

use miette::Diagnostic;
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

/// tonic-prost-build's builder with its defaults (client and server code), for
/// [`compile_with`].
pub fn configure() -> tonic_prost_build::Builder {
    tonic_prost_build::configure()
}

/// Compiles `protos` (searched in `includes`) into `$OUT_DIR`, client and
/// server code both, and tells cargo to rerun when any of them changes.
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
pub fn compile_with(
    builder: tonic_prost_build::Builder,
    protos: &[impl AsRef<Path>],
    includes: &[impl AsRef<Path>],
) -> Result<(), Error> {
    // protox::compile keeps imports and source info.
    let fds = protox::compile(protos, includes)?;
    if let Some(path) = descriptor_set_path(&builder)? {
        use prost::Message;
        std::fs::write(&path, fds.encode_to_vec()).map_err(|e| Error {
            file: None,
            line_col: None,
            message: format!("writing file_descriptor_set_path {}: {e}", path.display()),
        })?;
    }
    for p in protos {
        println!("cargo:rerun-if-changed={}", p.as_ref().display());
    }
    for i in includes {
        println!("cargo:rerun-if-changed={}", i.as_ref().display());
    }
    builder.compile_fds(fds).map_err(|e| Error {
        file: None,
        line_col: None,
        message: format!("generating code: {e}"),
    })
}

/// The `file_descriptor_set_path` set on `builder`, if any.
///
/// tonic-prost-build writes that file only when it runs `protoc` itself (its
/// `compile_fds` does not), and the field is private: it is read from the
/// builder's `Debug` form, whose `Option<PathBuf>` is printed as a Rust string
/// literal. A form that cannot be read is an error, never a silently missing
/// file (`tests::descriptor_set_path_is_honoured` guards the format).
fn descriptor_set_path(builder: &tonic_prost_build::Builder) -> Result<Option<PathBuf>, Error> {
    let dbg = format!("{builder:?}");
    let fail = |what: &str| Error {
        file: None,
        line_col: None,
        message: format!(
            "cannot read file_descriptor_set_path from tonic-prost-build's Builder: {what}"
        ),
    };
    let Some(at) = dbg.find("file_descriptor_set_path: ") else {
        return Err(fail("field not found"));
    };
    let rest = &dbg[at + "file_descriptor_set_path: ".len()..];
    if rest.starts_with("None") {
        return Ok(None);
    }
    let lit = rest
        .strip_prefix("Some(\"")
        .ok_or_else(|| fail("unexpected form"))?;
    parse_debug_str(lit)
        .map(|s| Some(PathBuf::from(s)))
        .ok_or_else(|| fail("unterminated or unknown escape"))
}

/// Reads a string printed by `{:?}` (after its opening quote) up to its
/// closing quote, undoing the escapes `str::escape_debug` produces.
fn parse_debug_str(s: &str) -> Option<String> {
    let mut out = String::new();
    let mut chars = s.chars();
    loop {
        match chars.next()? {
            '"' => return Some(out),
            '\\' => match chars.next()? {
                'n' => out.push('\n'),
                'r' => out.push('\r'),
                't' => out.push('\t'),
                '0' => out.push('\0'),
                c @ ('\\' | '"' | '\'') => out.push(c),
                'u' => {
                    if chars.next()? != '{' {
                        return None;
                    }
                    let mut hex = String::new();
                    loop {
                        match chars.next()? {
                            '}' => break,
                            c => hex.push(c),
                        }
                    }
                    out.push(char::from_u32(u32::from_str_radix(&hex, 16).ok()?)?);
                }
                // `\xNN`: a byte that is not UTF-8 (OsStr); such paths are not supported.
                _ => return None,
            },
            c => out.push(c),
        }
    }
}

/// Parses and checks `protos` without generating code (for tests and tools).
pub fn check(
    protos: &[impl AsRef<Path>],
    includes: &[impl AsRef<Path>],
) -> Result<Vec<PathBuf>, Error> {
    let fds = protox::compile(protos, includes)?;
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

    #[test]
    fn bad_proto_names_file_and_line() {
        let dir = std::env::temp_dir().join(format!("rpc-codegen-test-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
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
            let printed = format!("{s:?}");
            assert_eq!(
                parse_debug_str(&printed[1..]).as_deref(),
                Some(s),
                "{printed}"
            );
        }
        assert_eq!(parse_debug_str("no end"), None);
    }

    #[test]
    fn descriptor_set_path_is_honoured() {
        use prost::Message;
        let dir = std::env::temp_dir().join(format!("rpc-codegen-fds-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let fds_path = dir.join("a \"dir\"/descriptor.bin");
        std::fs::create_dir_all(fds_path.parent().unwrap()).unwrap();
        assert_eq!(descriptor_set_path(&configure()).unwrap(), None);
        let builder = configure()
            .out_dir(&dir)
            .file_descriptor_set_path(&fds_path);
        assert_eq!(
            descriptor_set_path(&builder).unwrap(),
            Some(fds_path.clone())
        );

        let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../proto");
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
    fn good_proto_compiles() {
        let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../proto");
        let files = check(&[root.join("helloworld.proto")], &[&root]).unwrap();
        assert_eq!(files, vec![PathBuf::from("helloworld.proto")]);
    }
}
