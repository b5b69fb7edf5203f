#!/usr/bin/env python3
"""Issue 24 on a real GPU: vmmalloc selected by VMMALLOC_CONF alone in every
process of a job, and region mode beside PyTorch's allocator. Under a minute
on an H100/H200.

    python3 scripts/torch_activation_checks.py [CHECK...]

Each check runs in fresh interpreters and prints, as soon as it is done,
``CHECK <name>: ok <details>``, ``CHECK <name>: FAIL <reason>`` or
``CHECK <name>: SKIP <reason>``. Exit status 1 if any failed, 3 when none
can run here (no vmmalloc package, no PyTorch, no CUDA device), else 0.
Every child's timeout stays inside the GPU check's step ($STEP_DEADLINE).

- ``env-only``: ``VMMALLOC_CONF=`` (the defaults) and a plain ``python -c``
  (no ``-m vmmalloc``, no ``enable()``): after ``import torch`` vmmalloc is
  PyTorch's current allocator (backend ``vmmalloc``, the torch companion,
  or ``pluggable`` where the companion cannot be built: both accepted, the
  line says which) and a 256 MiB CUDA tensor is counted in vmmalloc's
  ``memory_stats``;
- ``torchrun``: ``torchrun --standalone --nproc_per_node=2`` (both ranks on
  GPU 0 when there is one GPU) with the variable: every rank reports the same;
- ``spawn``: a ``torch.multiprocessing.spawn`` child, likewise;
- ``fallback``: CUDA initialised first, then the hook installed: one warning
  line, PyTorch's allocator stays, the tensor still allocates;
- ``bad-conf``: ``VMMALLOC_CONF=colour:blue``: ``import torch`` fails with
  the key named;
- ``region``: no ``VMMALLOC_CONF`` (PyTorch's allocator current, CUDA already
  initialised): tensors in ``vmmalloc.region("weights")`` and
  ``region("kv_cache")`` come from vmmalloc (tag stats), one outside does not;
  pausing gives back >= 90 % of the tagged bytes (``cuMemGetInfo``), PyTorch
  can use the memory meanwhile, resume restores the weights at the same
  addresses;
- ``region-graph``: the same with a CUDA graph captured into the region's
  pool (``torch.cuda.graph(g, pool=region.pool.id)``), replayed after resume;
- ``rl-colocate``: examples/rl_colocate.py on the GPU.

Finding the package: an installed one (``pip install ./python``, whose .pth
is the hook) or, as in the GPU check's bundle, the ``vmmalloc`` package on
PYTHONPATH (with VMMALLOC_LIBRARY naming the library): the children then get
``<package>/_site`` first on PYTHONPATH, whose sitecustomize.py installs the
hook without an install (docs/pytorch.md, "Selected by the environment").
"""

import os
import re
import subprocess
import sys
import tempfile
import textwrap
import time

MIB = 1 << 20
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import torch_common  # noqa: E402
failures = []

REPORT = '''
def report(label):
    import sys, torch, vmmalloc
    from vmmalloc import _autostart
    st = vmmalloc.memory_stats(0) if vmmalloc.is_enabled() else {}
    print(label, "status=%s current=%s backend=%s vmmalloc_allocated=%d" % (_autostart.state["status"],
          _autostart.is_current(), torch.cuda.get_allocator_backend(),
          st.get("allocated_bytes.all.current", -1)), flush=True)
'''


def say(name, verdict):
    print(f"CHECK {name}: {verdict}", flush=True)
    if verdict.startswith("FAIL"):
        failures.append(name)


def package_env():
    """(environment for the children, how the hook gets in)."""
    import importlib.util
    import site

    spec = importlib.util.find_spec("vmmalloc")
    if spec is None:
        return None, "the vmmalloc package is neither installed nor on PYTHONPATH"
    pkg = os.path.abspath(list(spec.submodule_search_locations)[0])
    parent = os.path.dirname(pkg)
    env = {k: v for k, v in os.environ.items() if k not in ("VMMALLOC_CONF", "VMMALLOC_STRICT")}
    env["PYTHONUNBUFFERED"] = "1"
    # Installed: the package sits in a directory `site` processes, with the .pth beside it.
    site_dirs = [os.path.abspath(d) for d in site.getsitepackages() + [site.getusersitepackages()]]
    if parent in site_dirs and os.path.isfile(os.path.join(parent, "vmmalloc-autostart.pth")):
        return env, f"installed package ({parent}, vmmalloc-autostart.pth)"
    rest = [os.path.abspath(p) for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    env["PYTHONPATH"] = os.pathsep.join([os.path.join(pkg, "_site"), parent] + rest)
    if env.get("VMMALLOC_LIBRARY"):
        env["VMMALLOC_LIBRARY"] = os.path.abspath(env["VMMALLOC_LIBRARY"])
    return env, f"PYTHONPATH package ({parent}), hook through {os.path.join(pkg, '_site')}/sitecustomize.py"


def run(args, env, cwd, timeout=60, **extra):
    e = dict(env)
    e.update(extra)
    timeout = torch_common.child_timeout(timeout)
    t0 = time.time()
    try:
        out = subprocess.run(args, env=e, cwd=cwd, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return None, f"timed out after {timeout:.0f} s"
    return out, f"{time.time() - t0:.1f} s"


def py(code, env, cwd, **extra):
    code = REPORT + textwrap.dedent(code[len(REPORT):]) if code.startswith(REPORT) else textwrap.dedent(code)
    return run([sys.executable, "-c", code], env, cwd, **extra)


def tail(out):
    text = (out.stdout + out.stderr).strip().splitlines()
    return " | ".join(text[-3:])


# vmmalloc current in a process: through the torch companion (backend
# vmmalloc) or PyTorch's pluggable allocator (no C++ compiler to build it).
ENABLED = re.compile(r"status=enabled current=True backend=(vmmalloc|pluggable) ")


def expect_lines(name, out, took, labels, want=ENABLED):
    if out is None:
        return say(name, f"FAIL {took}")
    found = {ln.split(" ")[0]: ln for ln in out.stdout.splitlines()}
    missing = [lb for lb in labels if lb not in found or not want.search(found[lb] + " ")]
    if out.returncode != 0 or missing:
        return say(name, f"FAIL rc={out.returncode}, missing {missing}: {tail(out)}")
    lines = [ln for ln in out.stdout.splitlines() if ln.split(" ")[0] in labels]
    say(name, f"ok ({took}) " + "; ".join(lines))


def check_env_only(env, cwd):
    out, took = py(REPORT + '''
        import torch
        import vmmalloc
        x = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
        x.fill_(1)
        torch.cuda.synchronize()
        assert vmmalloc.memory_stats(0)["allocated_bytes.all.current"] >= 256 << 20  # the tensor is vmmalloc's
        assert torch.cuda.memory_allocated() == vmmalloc.memory_stats(0)["allocated_bytes.all.current"]
        report("MAIN")
    ''', env, cwd, VMMALLOC_CONF="")
    expect_lines("env-only", out, took, ["MAIN"], ENABLED)


RANK = REPORT + '''
import os, torch
torch.cuda.set_device(int(os.environ["LOCAL_RANK"]) % torch.cuda.device_count())
x = torch.ones(64 << 20, dtype=torch.uint8, device="cuda")
assert x.sum().item() == 64 << 20
report("RANK" + os.environ["RANK"])
'''


def check_torchrun(env, cwd):
    with open(os.path.join(cwd, "rank.py"), "w") as f:
        f.write(RANK)
    # `torchrun` is torch.distributed.run:main; through this interpreter, whatever PATH holds.
    out, took = run([sys.executable, "-m", "torch.distributed.run"] + ["--standalone", "--nproc_per_node=2", "rank.py"], env, cwd, VMMALLOC_CONF="")
    expect_lines("torchrun", out, took, ["RANK0", "RANK1"], ENABLED)


SPAWN = REPORT + '''
import torch, torch.multiprocessing as mp

def child(i):
    x = torch.ones(32 << 20, dtype=torch.uint8, device="cuda")
    assert x.sum().item() == 32 << 20
    report("CHILD%d" % i)

if __name__ == "__main__":
    mp.spawn(child, nprocs=1)
'''


def check_spawn(env, cwd):
    with open(os.path.join(cwd, "spawn.py"), "w") as f:
        f.write(SPAWN)
    out, took = run([sys.executable, "spawn.py"], env, cwd, VMMALLOC_CONF="")
    expect_lines("spawn", out, took, ["CHILD0"], ENABLED)


def check_fallback(env, cwd):
    out, took = py(REPORT + '''
        import os, torch
        torch.zeros(1, device="cuda")          # CUDA initialised, PyTorch's allocator used
        os.environ["VMMALLOC_CONF"] = ""
        import vmmalloc._autostart as hook
        hook.install()
        x = torch.ones(16 << 20, device="cuda")
        assert x.sum().item() == 16 << 20
        report("LATE")
    ''', env, cwd)
    if out is None:
        return say("fallback", f"FAIL {took}")
    warn = [ln for ln in out.stderr.splitlines() if ln.startswith("vmmalloc: warning:")]
    if out.returncode != 0 or "LATE status=fallback current=False backend=native" not in out.stdout or len(warn) != 1:
        return say("fallback", f"FAIL rc={out.returncode}: {tail(out)}")
    say("fallback", f"ok ({took}) {warn[0][:120]}...")


def check_bad_conf(env, cwd):
    out, took = py("import torch", env, cwd, VMMALLOC_CONF="colour:blue")
    if out is None:
        return say("bad-conf", f"FAIL {took}")
    last = out.stderr.strip().splitlines()[-1] if out.stderr.strip() else ""
    if out.returncode == 0 or "unknown key `colour`" not in last:
        return say("bad-conf", f"FAIL rc={out.returncode}: {tail(out)}")
    say("bad-conf", f"ok ({took}) {last[:110]}...")


REGION = '''
import sys, torch, vmmalloc
MIB = 1 << 20
torch.zeros(1, device="cuda")                  # CUDA initialised first: region mode does not care
assert not vmmalloc.is_enabled() and torch.cuda.get_allocator_backend() == "native"
torch.manual_seed(0)
with vmmalloc.region("weights") as r:
    w1 = torch.randn(4096, 4096, device="cuda")     # 64 MiB
    w2 = torch.randn(4096, 1024, device="cuda")     # 16 MiB
with vmmalloc.region("kv_cache"):
    kv = torch.empty(512 * MIB, dtype=torch.uint8, device="cuda")
outside = torch.empty(64 * MIB, dtype=torch.uint8, device="cuda")
GRAPH = ("graph" in sys.argv)
if GRAPH:
    static_x = torch.randn(64, 4096, device="cuda")
    f = lambda x: torch.relu(x @ w1) @ w2
    s = torch.cuda.Stream(); s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3): f(static_x)
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g, pool=r.pool.id):          # captured into the region's pool
        static_y = f(static_x)
    g.replay(); torch.cuda.synchronize()
    expected = static_y.clone()
tags = {t["tag"]: t for t in vmmalloc.tag_stats(0)}
tagged = tags["weights"]["mapped_bytes"] + tags["kv_cache"]["mapped_bytes"]
assert tags["weights"]["live_bytes"] >= 80 * MIB and tags["kv_cache"]["live_bytes"] >= 512 * MIB, tags
vm_total = vmmalloc.memory_stats(0)["allocated_bytes.all.current"]
assert vm_total == sum(t["live_bytes"] for t in tags.values()), (vm_total, tags)  # `outside` is not vmmalloc's
sums, ptrs = (w1.sum().item(), w2.sum().item()), (w1.data_ptr(), w2.data_ptr(), kv.data_ptr())
torch.cuda.synchronize()
free0 = torch.cuda.mem_get_info()[0]
n = vmmalloc.pause("weights", backup=True) + vmmalloc.pause("kv_cache")
gained = torch.cuda.mem_get_info()[0] - free0
assert gained >= 0.9 * tagged, (gained, tagged)
st = vmmalloc.memory_stats(0)
assert st["vmmalloc.paused_bytes"] >= 0.9 * tagged, st["vmmalloc.paused_bytes"]
other = torch.full((256 * MIB,), 7, dtype=torch.uint8, device="cuda")   # PyTorch's allocator uses the memory
assert other.sum().item() == 7 * 256 * MIB
del other; torch.cuda.empty_cache()
try:
    with vmmalloc.region("weights"): pass
    raise SystemExit("entering a paused region was allowed")
except vmmalloc.VmmallocError:
    pass
vmmalloc.resume("weights"); vmmalloc.resume("kv_cache")
assert (w1.data_ptr(), w2.data_ptr(), kv.data_ptr()) == ptrs
assert (w1.sum().item(), w2.sum().item()) == sums
kv.fill_(3); assert kv[:MIB].sum().item() == 3 * MIB
if GRAPH:
    g.replay(); torch.cuda.synchronize()
    assert torch.allclose(static_y, expected, atol=1e-3, rtol=1e-3)
print("REGION tagged %d MiB, paused %d MiB, cuMemGetInfo free +%d MiB, restored in place%s"
      % (tagged // MIB, n // MIB, gained // MIB, ", graph captured into the region replays" if GRAPH else ""),
      flush=True)
'''


def check_region(env, cwd, name="region", graph=False):
    out, took = run([sys.executable, "-c", REGION] + (["graph"] if graph else []), env, cwd)
    if out is None:
        return say(name, f"FAIL {took}")
    line = [ln for ln in out.stdout.splitlines() if ln.startswith("REGION")]
    if out.returncode != 0 or not line:
        return say(name, f"FAIL rc={out.returncode}: {tail(out)}")
    say(name, f"ok ({took}) {line[0][7:]}")


def check_region_graph(env, cwd):
    check_region(env, cwd, "region-graph", graph=True)


def check_rl_colocate(env, cwd):
    example = os.path.join(os.path.dirname(HERE), "examples", "rl_colocate.py")
    if not os.path.isfile(example):
        return say("rl-colocate", f"SKIP {example} is not here")
    out, took = run([sys.executable, example, "--rounds", "2"], env, cwd)
    if out is None:
        return say("rl-colocate", f"FAIL {took}")
    if out.returncode != 0 or "rl_colocate: ok" not in out.stdout or "GPU:" not in out.stdout:
        return say("rl-colocate", f"FAIL rc={out.returncode}: {tail(out)}")
    phases = [ln for ln in out.stdout.splitlines() if ln.startswith("phase")]
    say("rl-colocate", f"ok ({took}) " + " || ".join(" ".join(p.split()) for p in phases[1:3]))


CHECKS = {
    "env-only": check_env_only,
    "torchrun": check_torchrun,
    "spawn": check_spawn,
    "fallback": check_fallback,
    "bad-conf": check_bad_conf,
    "region": check_region,
    "region-graph": check_region_graph,
    "rl-colocate": check_rl_colocate,
}


def main():
    names = sys.argv[1:] or list(CHECKS)
    unknown = [n for n in names if n not in CHECKS]
    if unknown:
        print(f"usage: torch_activation_checks.py [{'|'.join(CHECKS)}]...", file=sys.stderr)
        return 2
    env, how = package_env()
    probe = None
    if env is not None:
        probe, _ = run([sys.executable, "-c", "import torch; print(torch.__version__, torch.cuda.is_available())"],
                       env, HERE, timeout=120)
    why = (how if env is None else
           "PyTorch cannot be imported" if probe is None or probe.returncode != 0 else
           "no CUDA device" if not probe.stdout.strip().endswith("True") else None)
    if why:
        print(f"torch_activation_checks: cannot run: {why}", flush=True)
        return 3
    print(f"PyTorch {probe.stdout.strip()}; {how}", flush=True)
    with tempfile.TemporaryDirectory(prefix="vmmalloc-activation-") as cwd:
        for n in names:
            try:
                CHECKS[n](env, cwd)
            except Exception as e:  # a bug here is a failure, not a crash of the other checks
                say(n, f"FAIL {type(e).__name__}: {e}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
