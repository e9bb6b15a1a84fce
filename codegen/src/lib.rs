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

/// Compiles `protos` (searched in `includes`) into `$OUT_DIR`, client and
/// server code both, and tells cargo to rerun when any of them changes.
pub fn compile_protos(
    protos: &[impl AsRef<Path>],
    includes: &[impl AsRef<Path>],
) -> Result<(), Error> {
    compile_with(tonic_prost_build::configure(), protos, includes)
}

/// As [`compile_protos`], with a tonic-prost-build [`Builder`](tonic_prost_build::Builder)
/// for options (`build_client(false)`, `type_attribute(..)`, `out_dir(..)`...).
pub fn compile_with(
    builder: tonic_prost_build::Builder,
    protos: &[impl AsRef<Path>],
    includes: &[impl AsRef<Path>],
) -> Result<(), Error> {
    let fds = protox::compile(protos, includes)?;
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
    fn good_proto_compiles() {
        let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../proto");
        let files = check(&[root.join("helloworld.proto")], &[&root]).unwrap();
        assert_eq!(files, vec![PathBuf::from("helloworld.proto")]);
    }
}
