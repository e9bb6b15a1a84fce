fn main() {
    // One call: .proto -> prost messages + tonic client/server, no protoc needed.
    if let Err(e) = rpc_codegen::compile_protos(
        &[
            "../proto/helloworld.proto",
            "../proto/routeguide.proto",
            "../proto/echo.proto",
        ],
        &["../proto"],
    ) {
        panic!("{e}");
    }
}
