//! Links libtrainops with `-z nodelete` on Linux: ONNX Runtime keeps pointers to the op
//! descriptors and domains the library registers (kept in statics for the whole process),
//! and unloading the library when the last session holding it closes would orphan them
//! (about 1.9 KB per load/unload cycle, seen with valgrind) and leave the runtime pointing
//! into unmapped memory if it ever touched them again.
fn main() {
    if std::env::var("CARGO_CFG_TARGET_OS").as_deref() == Ok("linux") {
        println!("cargo:rustc-cdylib-link-arg=-Wl,-z,nodelete");
    }
}
