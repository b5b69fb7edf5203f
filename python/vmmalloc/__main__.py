"""``python -m vmmalloc [options] (script.py | -m module) [args...]``

Enables vmmalloc as PyTorch's CUDA allocator (configured by ``VMMALLOC_CONF``
or ``--conf``), then runs the script (or module) as ``__main__`` with the
remaining arguments, as ``python script.py args...`` would. A missing script
or module is an error (exit 2) before anything is enabled; a configuration
error is printed once, labelled ``--conf`` or ``VMMALLOC_CONF`` by its origin.

Options (before the script):
  --conf CONF        configuration, replacing $VMMALLOC_CONF
  --summary          print vmmalloc's memory summary of device 0 to stderr at exit
  --snapshot PATH    write a snapshot pickle (PyTorch's schema) to PATH at exit
  --check            say whether this machine and this PyTorch can use vmmalloc
                     (driver, GPUs, PyTorch integrations, VMMALLOC_CONF) and
                     exit: 0 usable (perhaps with limits), 1 not usable
  --version          print the library version and exit
  -h, --help         this help
"""

import atexit
import os
import runpy
import sys
import warnings


def _usage(code):
    # The docstring's reST literals (``x``) read as plain text in a terminal.
    (sys.stdout if code == 0 else sys.stderr).write(__doc__.replace("``", ""))
    return code


def parse(argv):
    """Splits argv into (options dict, target kind, target, script args)."""
    opts = {"conf": None, "summary": False, "snapshot": None, "version": False, "help": False,
            "check": False}
    i = 0
    while i < len(argv):
        a = argv[i]
        if a in ("-h", "--help"):
            opts["help"] = True
            return opts, None, None, []
        if a == "--version":
            opts["version"] = True
            return opts, None, None, []
        if a == "--check":
            opts["check"] = True
            return opts, None, None, []
        if a == "--summary":
            opts["summary"] = True
        elif a in ("--conf", "--snapshot"):
            if i + 1 >= len(argv):
                raise ValueError(f"{a} needs a value")
            opts[a[2:]] = argv[i + 1]
            i += 1
        elif a.startswith("--conf=") or a.startswith("--snapshot="):
            k, v = a[2:].split("=", 1)
            opts[k] = v
        elif a == "-m":
            if i + 1 >= len(argv):
                raise ValueError("-m needs a module name")
            return opts, "module", argv[i + 1], argv[i + 2:]
        elif a.startswith("-"):
            raise ValueError(f"unknown option {a}")
        else:
            return opts, "script", a, argv[i + 1:]
        i += 1
    raise ValueError("no script or -m module given")


def _labelled(message, conf):
    """Labels a configuration error by its origin: ``--conf`` when the text
    came from the command line (the library says ``vmmalloc_configure``),
    ``VMMALLOC_CONF`` when it came from the environment."""
    if conf is not None:
        for prefix in ("vmmalloc_configure: ", "VMMALLOC_CONF: "):
            if message.startswith(prefix):
                return "--conf: " + message[len(prefix):]
    return message


def main(argv=None):
    """Entry point; returns an exit status (the script's own SystemExit propagates)."""
    import vmmalloc

    argv = sys.argv[1:] if argv is None else argv
    try:
        opts, kind, target, args = parse(argv)
    except ValueError as e:
        sys.stderr.write(f"vmmalloc: {e}\n")
        return _usage(2)
    if opts["help"]:
        return _usage(0)
    if opts["check"]:
        report = vmmalloc.check()
        sys.stdout.write(str(report))
        return 1 if report.verdict == "not usable" else 0
    if opts["version"]:
        try:
            print(vmmalloc.version())
        except (vmmalloc.VmmallocError, FileNotFoundError, OSError) as e:
            sys.stderr.write(f"vmmalloc: python package {vmmalloc.__version__}; library: {e}\n")
            return 2
        return 0
    # A missing target is a clear error before anything is enabled (not a
    # runpy traceback).
    if kind == "script" and not os.path.isfile(target):
        sys.stderr.write(f"vmmalloc: no such script: {target}"
                         f"{' (a directory)' if os.path.isdir(target) else ''}\n")
        return 2
    if kind == "module":
        import importlib.util
        try:
            found = importlib.util.find_spec(target) is not None
        except (ImportError, ValueError):
            found = False
        if not found:
            sys.stderr.write(f"vmmalloc: no module named {target!r} (for -m {target})\n")
            return 2
    try:
        # enable()'s warnings (no GPU, PYTORCH_CUDA_ALLOC_CONF ignored) as one
        # clean line each, as the VMMALLOC_CONF path (_autostart) prints them,
        # not Python's two-line `file:line: UserWarning` form.
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            vmmalloc.enable(opts["conf"])
        for w in caught:
            sys.stderr.write(" ".join(str(w.message).split("\n")).rstrip() + "\n")
    except (vmmalloc.VmmallocError, FileNotFoundError) as e:
        sys.stderr.write(f"vmmalloc: cannot enable: {_labelled(str(e), opts['conf'])}\n")
        return 2
    if opts["summary"]:
        atexit.register(lambda: sys.stderr.write(vmmalloc.memory_summary(0)))
    if opts["snapshot"]:
        atexit.register(vmmalloc.dump_snapshot, opts["snapshot"])
    if kind == "module":
        sys.argv = [target] + list(args)
        runpy.run_module(target, run_name="__main__", alter_sys=True)
    else:
        sys.argv = [target] + list(args)
        sys.path.insert(0, os.path.dirname(os.path.abspath(target)))
        runpy.run_path(target, run_name="__main__")
    return 0


if __name__ == "__main__":
    sys.exit(main())
