//! Builds the C++ shim (src/shim.cpp: the entry points that throw or take C++
//! types, see its header) and exports its functions from the cdylib.

fn main() {
    println!("cargo:rerun-if-changed=src/shim.cpp");
    println!("cargo:rerun-if-changed=exports.map");
    cc::Build::new()
        .cpp(true)
        .std("c++17")
        .file("src/shim.cpp")
        .warnings(true)
        .flag_if_supported("-Wextra")
        .compile("vmmalloc_shim");
    // rustc's version script for a cdylib lists only Rust's #[no_mangle]
    // functions; a second one adds the shim's (static-library symbols are
    // otherwise local).
    let dir = std::env::var("CARGO_MANIFEST_DIR").expect("cargo sets CARGO_MANIFEST_DIR");
    println!("cargo:rustc-cdylib-link-arg=-Wl,--version-script={dir}/exports.map");
}
