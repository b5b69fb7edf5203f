"""Selection by the environment alone: with ``VMMALLOC_CONF`` set (an empty
value means the defaults), vmmalloc becomes PyTorch's CUDA allocator as soon as
``torch`` is imported, in every process that inherits the environment
(torchrun, accelerate, DeepSpeed, srun, multiprocessing spawn, ...).

How it gets into a process:

- ``pip install ./python`` installs ``vmmalloc-autostart.pth`` in
  site-packages. Its one line costs an ``in os.environ`` test when the
  variable is absent; when it is present it loads *this file only* (not the
  ``vmmalloc`` package: no ctypes, no library, no torch) through
  ``_vmmalloc_autostart.py`` and calls :func:`install`.
- Without an install (a source checkout, the GPU check's bundle): put
  ``python/vmmalloc/_site`` before ``python`` on ``PYTHONPATH``; its
  ``sitecustomize.py`` does the same, then runs any other ``sitecustomize``
  it shadows. Or call ``import vmmalloc._autostart; vmmalloc._autostart.install()``
  before ``import torch`` (this process only).

:func:`install` puts a finder at the front of ``sys.meta_path`` that answers
for ``torch`` only: it lets the normal finders locate torch, wraps the loader,
and once torch's ``__init__`` has run (torch imported, CUDA not initialised:
PyTorch initialises CUDA lazily, on the first CUDA call) calls
``vmmalloc.enable()``. The hook never imports torch itself; a process that
never imports torch pays nothing more than loading this file.

It never breaks a program for a reason of the environment: the library cannot
be loaded, a PyTorch without ``CUDAPluggableAllocator``, CUDA already
initialised (torch imported before the hook was installed), PyTorch refusing
the swap. Each gives one line on stderr naming the cause, PyTorch's allocator
stays and the program runs; ``VMMALLOC_STRICT=1`` turns it into an error
raised from ``import torch``. A bad ``VMMALLOC_CONF`` is the user's input, not
the environment: it is always an error (the same message in every process),
never a silent fall-back (DESIGN: configuration errors name the key). When
``vmmalloc.enable()`` itself imports torch (``python -m vmmalloc``, an explicit
``enable(conf)``), the hook leaves the job to it.

``state`` records what happened (``status``: ``None`` before torch was
imported, then ``"enabled"``, ``"fallback"`` (PyTorch's allocator stays,
``reason`` says why), ``"deferred"`` (an explicit ``enable()`` was running) or
``"error"`` (a bad configuration; raised, except when ``vmmalloc.check()``
imported torch: a diagnosis reports it rather than dying of it, and
``VMMALLOC_STRICT`` does not apply there either)).
"""

import os
import sys

ENV = "VMMALLOC_CONF"
STRICT_ENV = "VMMALLOC_STRICT"

# What the hook did in this process (see the module's doc).
state = {"installed": False, "status": None, "reason": None, "warnings": []}


def _strict():
    return os.environ.get(STRICT_ENV, "").strip().lower() in ("1", "true", "yes", "on")


def _say(line):
    """One line on stderr (the hook's only output)."""
    try:
        sys.stderr.write(line.rstrip("\n").replace("\n", " ") + "\n")
        sys.stderr.flush()
    except Exception:  # a closed stderr must not break the import
        pass


def _on_stack(module, *functions):
    """Whether one of ``functions`` of vmmalloc module ``module`` is on this thread's stack."""
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code.co_name in functions and frame.f_globals.get("__name__") == module:
            return True
        frame = frame.f_back
    return False


def _enable_running():
    """Whether ``vmmalloc.enable()`` is on this thread's stack (it imports
    torch itself: ``python -m vmmalloc``, an explicit ``enable(conf)``)."""
    return _on_stack("vmmalloc", "enable")


def _check_running():
    """Whether ``vmmalloc.check()`` (``python -m vmmalloc --check``) imported
    torch: a diagnosis reports a bad configuration, it must not die of it."""
    return _on_stack("vmmalloc._check", "check", "_check_torch")


class StrictError(RuntimeError):
    """Raised from ``import torch`` when vmmalloc was requested but cannot be
    enabled and ``VMMALLOC_STRICT=1`` (or the configuration is invalid)."""


def _fallback(reason, diagnosing=False):
    state.update(status="fallback", reason=reason)
    if _strict() and not diagnosing:
        raise StrictError(f"vmmalloc: VMMALLOC_CONF is set but vmmalloc cannot be PyTorch's allocator: {reason} "
                          f"(VMMALLOC_STRICT=1 makes this an error)")
    _say(f"vmmalloc: warning: VMMALLOC_CONF is set but vmmalloc is not enabled: {reason}; PyTorch's own "
         f"allocator stays (VMMALLOC_STRICT=1 makes this an error)")


def activate():
    """Enables vmmalloc now (torch is imported). Called by the import hook
    right after torch's import, or by :func:`install` when torch was
    already imported. Returns ``state``."""
    if state["status"] is not None:
        return state
    if _enable_running():
        state.update(status="deferred", reason="vmmalloc.enable() imported torch itself")
        return state
    diagnosing = _check_running()
    try:
        import vmmalloc
        from vmmalloc import _lib
        # The package sees this module under its own name (see install()).
        setattr(vmmalloc, "_autostart", sys.modules[__name__])
    except Exception as e:  # a broken install: the environment, not the user
        _fallback(f"the vmmalloc package cannot be imported ({type(e).__name__}: {e})", diagnosing)
        return state
    try:
        _lib.load()
    except Exception as e:  # FileNotFoundError, OSError (dlopen), VmmallocError (already loaded elsewhere)
        _fallback(f"libvmmalloc.so cannot be loaded ({e})".replace("\n", " "), diagnosing)
        return state
    try:
        _lib.check_config()
    except _lib.VmmallocError as e:
        # The user's input: an error in every process, never a fall-back (vmmalloc.check() reports it).
        state.update(status="error", reason=str(e))
        if diagnosing:
            return state
        raise _lib.VmmallocError(f"vmmalloc: {e}") from None
    import warnings

    # torch.cuda.is_available() (enable()'s no-GPU warning) calls cudaGetDeviceCount, i.e. cuInit, unless
    # PYTORCH_NVML_BASED_CUDA_CHECK=1 (torch/cuda/__init__.py, is_available and _nvml_based_avail): a cuInit
    # in a process that only imported torch would break its fork()ed children that use CUDA (PyTorch's
    # "poison fork" note). The hook must not change what a program can do, so it asks NVML instead.
    nvml_key = "PYTORCH_NVML_BASED_CUDA_CHECK"
    saved = os.environ.get(nvml_key)
    os.environ[nvml_key] = "1"
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            vmmalloc.enable()
    except Exception as e:
        _fallback(str(e), diagnosing)
        return state
    finally:
        if saved is None:
            os.environ.pop(nvml_key, None)
        else:
            os.environ[nvml_key] = saved
    # enable()'s warnings (PYTORCH_CUDA_ALLOC_CONF ignored, with the VMMALLOC_CONF that asks for the same;
    # no GPU; no torch companion), one line each.
    for w in caught:
        text = str(w.message)
        state["warnings"].append(text)
        _say(text if text.startswith("vmmalloc:") else f"vmmalloc: {text}")
    state.update(status="enabled", reason=None)
    return state


def _activate_safely():
    """:func:`activate`, where only the intended errors (a bad configuration,
    ``VMMALLOC_STRICT``) escape: anything else, a bug of the hook included, is
    a fall-back with its one line."""
    try:
        activate()
    except Exception as e:
        if isinstance(e, StrictError) or state["status"] == "error":
            raise
        _fallback(f"the start-up hook failed ({type(e).__name__}: {e})")
    return state


class _Loader:
    """torch's own loader, which calls :func:`activate` once torch's module
    has executed. Everything else is the real loader's."""

    def __init__(self, loader):
        self._loader = loader

    def __getattr__(self, name):
        return getattr(self._loader, name)

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module):
        # torch sees its own loader, as without the hook.
        spec = getattr(module, "__spec__", None)
        if spec is not None and spec.loader is self:
            spec.loader = self._loader
        if getattr(module, "__loader__", None) is self:
            module.__loader__ = self._loader
        self._loader.exec_module(module)
        _uninstall_finder()
        _activate_safely()


class _TorchFinder:
    """A meta-path finder for ``torch`` alone: the other finders locate it,
    the hook wraps the loader (the post-import-hook pattern)."""

    _busy = False

    def find_spec(self, fullname, path=None, target=None):
        if fullname != "torch" or self._busy:
            return None
        self._busy = True
        try:
            spec = None
            for finder in list(sys.meta_path):
                if finder is self:
                    continue
                find = getattr(finder, "find_spec", None)
                if find is None:
                    continue
                spec = find(fullname, path, target)
                if spec is not None:
                    break
        finally:
            self._busy = False
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return None  # no torch here: the import fails as it would have
        spec.loader = _Loader(spec.loader)
        return spec

    def invalidate_caches(self):
        pass


_finder = None


def _uninstall_finder():
    global _finder
    if _finder is not None:
        try:
            sys.meta_path.remove(_finder)
        except ValueError:
            pass
        _finder = None


def install():
    """Installs the hook if ``VMMALLOC_CONF`` is set (else does nothing);
    idempotent. With torch already imported, enables vmmalloc at once (which
    falls back, with a warning, when CUDA is initialised already). Returns ``state``."""
    global _finder
    if state["installed"] or ENV not in os.environ:
        return state
    state["installed"] = True
    # Loaded by file (the .pth, sitecustomize) this module is `vmmalloc._autostart` in sys.modules
    # already; make `import vmmalloc._autostart` find this very module, whichever way it came.
    sys.modules.setdefault("vmmalloc._autostart", sys.modules[__name__])
    if "torch" in sys.modules:
        return _activate_safely()
    _finder = _TorchFinder()
    sys.meta_path.insert(0, _finder)
    return state


def is_current():
    """Whether vmmalloc is PyTorch's current CUDA allocator, as PyTorch sees
    it: ``torch._C._cuda_getAllocator()`` is the allocator object ``enable()``
    installed. False when torch is not imported."""
    torch = sys.modules.get("torch")
    vm = sys.modules.get("vmmalloc")
    if torch is None or vm is None or not vm.is_enabled():
        return False
    try:
        return torch._C._cuda_getAllocator() is vm.enable().allocator()
    except Exception:
        return False
