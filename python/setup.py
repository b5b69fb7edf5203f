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
from setuptools.command.build_py import build_py as _build_py
from setuptools_rust import Binding, RustExtension
from setuptools_rust.build import build_rust as _build_rust

LIBRARY_NAME = "libvmmalloc.so"
# The start-up hook's .pth (vmmalloc/_autostart.py): installed at the root of
# site-packages, where the site module runs its `import` line at start-up.
PTH_NAME = "vmmalloc-autostart.pth"
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


class build_py(_build_py):
    """setuptools' build_py, plus vmmalloc-autostart.pth at the root of the
    build (hence of the wheel, hence of site-packages)."""

    def run(self):
        super().run()
        here = Path(__file__).resolve().parent
        self.copy_file(str(here / PTH_NAME), os.path.join(self.build_lib, PTH_NAME), preserve_mode=False)

    def get_outputs(self, include_bytecode=1):
        return super().get_outputs(include_bytecode) + [os.path.join(self.build_lib, PTH_NAME)]


setup(
    rust_extensions=[
        RustExtension(
            "vmmalloc.libvmmalloc",
            path=MANIFEST,
            binding=Binding.NoBinding,
            debug=False,
        )
    ],
    cmdclass={"build_rust": build_rust, "build_py": build_py},
    zip_safe=False,
)
