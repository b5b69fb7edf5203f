//! `VMMALLOC_CUDA_LIBRARY` overrides the default library. A test binary of its
//! own: it sets an environment variable, which must not race with other tests.

use vmm_sys::{Driver, LoadError, LIBRARY_ENV};

#[test]
fn env_override_is_loaded_and_cached() {
    std::env::set_var(LIBRARY_ENV, "/nonexistent/override/libcuda.so.1");
    let err = Driver::load().unwrap_err();
    assert!(
        matches!(&err, LoadError::Library { path, .. } if path == "/nonexistent/override/libcuda.so.1"),
        "{err:?}"
    );
    // The global driver caches the first result, error included.
    let first = Driver::global().unwrap_err();
    assert_eq!(first, err);
    std::env::set_var(LIBRARY_ENV, "libc.so.6");
    assert_eq!(Driver::global().unwrap_err(), first);
    // An empty override means "the default library".
    std::env::set_var(LIBRARY_ENV, "");
    match Driver::load() {
        Ok(d) => assert_eq!(d.path(), vmm_sys::DEFAULT_LIBRARY),
        Err(e) => assert_eq!(e.path(), vmm_sys::DEFAULT_LIBRARY),
    }
}
