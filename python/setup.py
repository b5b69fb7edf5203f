"""Build script: compiles libvmmalloc.so (crates/capi, a C-ABI cdylib loaded
through ctypes, not a Python extension module) with setuptools-rust and puts it
inside the package as ``vmmalloc/libvmmalloc.so``, where
vmmalloc.library_path() finds it. Everything else is in pyproject.toml.

The Rust sources are outside this directory (../crates, ../Cargo.toml), so
build from a checkout: ``pip install ./python`` or ``pip wheel ./python``
(an sdist of python/ alone cannot be built)."""

import os
import shutil
from pathlib import Path

from setuptools import setup
from setuptools_rust import Binding, RustExtension
from setuptools_rust.build import build_rust as _build_rust

LIBRARY_NAME = "libvmmalloc.so"
MANIFEST = "../crates/capi/Cargo.toml"
NO_CARGO = ("vmmalloc: building libvmmalloc.so needs the Rust toolchain (cargo), which is not on PATH: "
            "install it with `curl https://sh.rustup.rs -sSf | sh` (https://rustup.rs) or your "
            "distribution's cargo package, then rerun pip")


class build_rust(_build_rust):
    """setuptools-rust's build_rust, with one clear line when cargo is
    missing, and the library under its own name (``libvmmalloc.so``, as
    ctypes and CUDAPluggableAllocator load it) instead of a Python
    extension's ``libvmmalloc.cpython-3XX-<platform>.so``."""

    def run(self):
        if shutil.which(os.environ.get("CARGO", "cargo")) is None:
            raise SystemExit(NO_CARGO)
        if not (Path(__file__).resolve().parent / MANIFEST).is_file():
            raise SystemExit(f"vmmalloc: {MANIFEST} not found: build from a checkout of the repository "
                             f"(`pip install ./python` with pip >= 21.3, which builds in place)")
        super().run()

    def get_dylib_ext_path(self, ext, target_fname):
        path = super().get_dylib_ext_path(ext, target_fname)
        return os.path.join(os.path.dirname(path), LIBRARY_NAME)


setup(
    rust_extensions=[
        RustExtension(
            "vmmalloc.libvmmalloc",
            path=MANIFEST,
            binding=Binding.NoBinding,
            debug=False,
        )
    ],
    cmdclass={"build_rust": build_rust},
    zip_safe=False,
)
