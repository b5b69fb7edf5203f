"""Loads vmmalloc/_autostart.py (the VMMALLOC_CONF start-up hook) by file,
without importing the ``vmmalloc`` package (its ctypes bindings and library
cost tens of milliseconds, which a process that never imports torch must not
pay), and installs the hook. Run by ``vmmalloc-autostart.pth`` (installed in
site-packages by ``pip install ./python``) and by ``vmmalloc/_site/sitecustomize.py``
only when ``VMMALLOC_CONF`` is set. See vmmalloc/_autostart.py."""

import os
import sys


def install():
    """Installs the hook; never raises (a broken install says so in one line)."""
    name = "vmmalloc._autostart"
    try:
        module = sys.modules.get(name)
        if module is None:
            import importlib.util

            spec = importlib.util.find_spec("vmmalloc")  # locates the package without running it
            if spec is None or not spec.submodule_search_locations:
                raise ImportError("no vmmalloc package on sys.path")
            path = os.path.join(list(spec.submodule_search_locations)[0], "_autostart.py")
            spec = importlib.util.spec_from_file_location(name, path)
            module = importlib.util.module_from_spec(spec)
            sys.modules[name] = module
            try:
                spec.loader.exec_module(module)
            except BaseException:
                del sys.modules[name]
                raise
        return module.install()
    except Exception as e:
        sys.stderr.write(f"vmmalloc: warning: VMMALLOC_CONF is set but the start-up hook cannot be installed "
                         f"({type(e).__name__}: {e}); PyTorch's own allocator stays\n")
        return None
