fn main() {
    // One call: .proto -> prost messages + tonic client/server, no protoc needed.
    // The descriptor set feeds tonic-reflection in helloworld-server.
    let out = std::path::PathBuf::from(std::env::var("OUT_DIR").expect("OUT_DIR"));
    if let Err(e) = rpc_codegen::compile_with(
        rpc_codegen::configure()
            .file_descriptor_set_path(out.join("examples_descriptor.bin"))
            // The echo service's payloads are `Bytes`: decoded as slices of
            // the received buffer, not copies (rpc_codegen's docs).
            .bytes(".echo")
            .bytes(".blobstore"),
        &[
            "../proto/helloworld.proto",
            "../proto/routeguide.proto",
            "../proto/echo.proto",
            "../proto/blobstore.proto",
        ],
        &["../proto"],
    ) {
        panic!("{e}");
    }
}
