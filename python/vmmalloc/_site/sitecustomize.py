"""The VMMALLOC_CONF start-up hook without an install (a source checkout, a
bundle): put this directory first on PYTHONPATH, the one holding the
``vmmalloc`` package after it::

    PYTHONPATH=python/vmmalloc/_site:python VMMALLOC_CONF=... torchrun ...

Python imports ``sitecustomize`` at start-up (the ``site`` module); this one
does what the installed ``vmmalloc-autostart.pth`` does, then runs the
``sitecustomize`` it shadows, if there is one further on sys.path."""

import os
import sys


def _chain():
    here = os.path.dirname(os.path.abspath(__file__))
    rest = [p for p in sys.path if os.path.abspath(p or os.curdir) != here]
    import importlib.machinery
    import importlib.util

    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", rest)
    if spec is None or spec.loader is None:
        return
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)


if "VMMALLOC_CONF" in os.environ:
    import _vmmalloc_autostart

    _vmmalloc_autostart.install()
_chain()
