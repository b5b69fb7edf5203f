"""The VMMALLOC_CONF start-up hook without an install (a source checkout, the
GPU check's bundle): put this directory first on PYTHONPATH, the one holding
the ``vmmalloc`` package after it::

    PYTHONPATH=python/vmmalloc/_site:python VMMALLOC_CONF=... torchrun ...

Python imports ``sitecustomize`` at start-up (the ``site`` module); when
``VMMALLOC_CONF`` is set this one does what the installed
``vmmalloc-autostart.pth`` does: it loads ``../_autostart.py`` by file (not the
``vmmalloc`` package) and installs the hook. Then it runs the
``sitecustomize`` it shadows, if there is one further on sys.path."""

import os
import sys

_here = os.path.dirname(os.path.abspath(__file__))


def _install():
    name = "vmmalloc._autostart"
    try:
        module = sys.modules.get(name)
        if module is None:
            import importlib.util

            spec = importlib.util.spec_from_file_location(name, os.path.join(os.path.dirname(_here), "_autostart.py"))
            module = importlib.util.module_from_spec(spec)
            sys.modules[name] = module
            try:
                spec.loader.exec_module(module)
            except BaseException:
                del sys.modules[name]
                raise
        module.install()
    except Exception as e:
        sys.stderr.write(f"vmmalloc: warning: VMMALLOC_CONF is set but the start-up hook cannot be installed "
                         f"({type(e).__name__}: {e}); PyTorch's own allocator stays\n")


def _chain():
    import importlib.machinery
    import importlib.util

    rest = [p for p in sys.path if os.path.abspath(p or os.curdir) != _here]
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", rest)
    if spec is None or spec.loader is None:
        return
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)


if "VMMALLOC_CONF" in os.environ:
    _install()
_chain()
