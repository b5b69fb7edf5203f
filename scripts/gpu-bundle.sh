#!/usr/bin/env bash
# gpu-bundle.sh — build, on a CPU machine with Rust, everything the GPU check
# needs into one folder that travels to a GPU box with no Rust and no network
# (issue 16). Then, on the GPU box: scripts/gpu-check.sh (it finds the bundle).
#
#   usage: scripts/gpu-bundle.sh [DIR]        (default: gpu-bundle/, git-ignored)
#
# DIR/ holds:
#   bin/vmmalloc            the CLI (vmm-check, info, calibrate)
#   lib/libvmmalloc.so      the C ABI plug-in (PyTorch's CUDAPluggableAllocator)
#   tests/<crate>.<suite>   the executable of every test suite with #[ignore]d
#                           GPU tests (from `cargo test --release --no-run
#                           --message-format=json`; run with `-- --ignored`)
#   python/vmmalloc/        the Python package
#   scripts/                gpu-check.sh, gpu-check-pytorch.sh, torch_*.py
#   manifest.txt            format, versions, git commit, the newest glibc
#                           symbol version the executables need, the scripts' hash
#                           (scripts_sha256, which gpu-check.sh compares), and
#                           one "file SHA256 SIZE PATH" line per file
#
# Debug info is stripped from the copies (`strip --strip-debug`; the release
# profile keeps debug = 1 for profiling, so the build itself reuses target/).
# Without `strip`, the build runs with CARGO_PROFILE_RELEASE_DEBUG=0 and
# CARGO_PROFILE_RELEASE_STRIP=debuginfo instead (a second release build).
# Prints the bundle's size and fails above MAX_MIB (default 60: at most 64 MiB
# travel with a working tree to the GPU box).
#
# BUNDLE_PROFILE=dev builds with cargo's dev profile instead of release (the
# manifest says `profile: dev`): the CI dry run's bundle (gpu-dry-run.sh), which
# reuses what `cargo test --workspace` built instead of building the whole
# workspace a second time; gpu-check.sh refuses such a bundle on a real GPU
# (its timings would be a debug build's).
#
# Environment: CARGO_FLAGS (e.g. "--offline"), MAX_MIB (default 60),
# BUNDLE_PROFILE (release, the default, or dev).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
root=$PWD
dest="${1:-gpu-bundle}"
# Relative to the repository root, or absolute (issue 25: an absolute DIR).
case $dest in /*) ;; *) dest="$root/$dest" ;; esac
max_mib="${MAX_MIB:-60}"
profile="${BUNDLE_PROFILE:-release}"
case $profile in
    release) profile_args=(--release) ;;
    dev) profile_args=() ;;
    *) echo "gpu-bundle: BUNDLE_PROFILE is '$profile': release or dev" >&2; exit 2 ;;
esac
read -r -a cargo_flags <<<"${CARGO_FLAGS:-}"

die() {
    echo "gpu-bundle: $*" >&2
    exit 1
}
command -v cargo >/dev/null 2>&1 || die "cargo is not installed (build the bundle on a machine with Rust)"
command -v python3 >/dev/null 2>&1 || die "python3 is needed to read cargo's JSON messages"
command -v sha256sum >/dev/null 2>&1 || die "sha256sum is not installed"

if command -v strip >/dev/null 2>&1; then
    strip_cmd=(strip --strip-debug)
else
    echo "gpu-bundle: no strip here: building with debug info off instead" >&2
    export CARGO_PROFILE_RELEASE_DEBUG=0 CARGO_PROFILE_RELEASE_STRIP=debuginfo
    strip_cmd=(true)
fi

# ---------------------------------------------------------------------------
# Build: the CLI, the plug-in, and every test executable (one cargo call each;
# the JSON messages name the artifacts, whatever the target directory).
# ---------------------------------------------------------------------------
messages="$(mktemp)"
manifest_tmp="$(mktemp)"
trap 'rm -f "$messages" "$manifest_tmp"' EXIT
: >"$messages"
if [[ $profile == release ]]; then
    echo "gpu-bundle: cargo build --release (vmmalloc, libvmmalloc.so)"
    # Two calls: `--bin` selects targets in every package named, so one call
    # with both packages would build the CLI only.
    cargo build --release ${cargo_flags[@]+"${cargo_flags[@]}"} --message-format=json \
        -p vmmalloc --bin vmmalloc >>"$messages"
    cargo build --release ${cargo_flags[@]+"${cargo_flags[@]}"} --message-format=json \
        -p vmmalloc-capi --lib >>"$messages"
fi
# The dev profile takes the CLI and the plug-in from the test build below
# (`cargo test` builds both: the CLI for the integration tests, the cdylib
# with the library): the whole workspace's features, so nothing that
# `cargo test --workspace` built is built again.
echo "gpu-bundle: cargo test --no-run, $profile profile (the GPU test suites)"
cargo test ${profile_args[@]+"${profile_args[@]}"} ${cargo_flags[@]+"${cargo_flags[@]}"} \
    --workspace --no-run --message-format=json >>"$messages"

# artifacts: "KIND NAME PATH" lines. A test executable is a GPU suite when its
# sources hold an #[ignore] attribute: the test file itself, or for a unit-test
# (lib) executable, any file under the crate's src/.
artifacts="$(python3 - "$messages" <<'PY'
import json, os, re, sys
ignore = re.compile(r"^\s*#\[ignore\b", re.M)
def has_ignore(paths):
    for p in paths:
        try:
            if ignore.search(open(p, encoding="utf-8").read()):
                return True
        except OSError:
            pass
    return False
seen = set()
for line in open(sys.argv[1]):
    if not line.startswith("{"):
        continue
    m = json.loads(line)
    if m.get("reason") != "compiler-artifact":
        continue
    t, exe = m["target"], m.get("executable")
    if m["profile"].get("test") and exe:
        src = t["src_path"]
        if "test" in t["kind"]:
            files = [src]
        else:
            top = os.path.dirname(src)
            files = [os.path.join(d, f) for d, _, fs in os.walk(top) for f in fs if f.endswith(".rs")]
        if has_ignore(files):
            crate = m["package_id"].split("#")[-1].split("@")[0].split("/")[-1]
            name = "%s.%s" % (crate, t["name"])
            if name not in seen:
                seen.add(name)
                print("test", name, exe)
    elif exe and t["name"] == "vmmalloc" and "bin" in t["kind"]:
        print("bin", "vmmalloc", exe)
    elif t["name"] == "vmmalloc" and "cdylib" in t["kind"]:
        for f in m["filenames"]:
            if f.endswith("libvmmalloc.so"):
                print("lib", "libvmmalloc.so", f)
PY
)"
grep -q '^bin vmmalloc ' <<<"$artifacts" || die "cargo built no vmmalloc binary"
grep -q '^lib libvmmalloc.so ' <<<"$artifacts" || die "cargo built no libvmmalloc.so"
grep -q '^test ' <<<"$artifacts" || die "no test suite with #[ignore] GPU tests was found"

# ---------------------------------------------------------------------------
# Collect
# ---------------------------------------------------------------------------
rm -rf "$dest"
mkdir -p "$dest/bin" "$dest/lib" "$dest/tests" "$dest/python" "$dest/scripts"
while read -r kind name path; do
    case $kind in
        bin) out="$dest/bin/$name" ;;
        lib) out="$dest/lib/$name" ;;
        test) out="$dest/tests/$name" ;;
    esac
    cp "$path" "$out"
    "${strip_cmd[@]}" "$out"
done <<<"$artifacts"
# The Python package (its modules, the companion's C++ sources, the start-up
# hook), without caches.
(cd python && find vmmalloc -type f ! -name '*.pyc' ! -path '*/__pycache__/*' -print0 |
    xargs -0 -I{} cp --parents {} "$dest/python/")
# The start-up hook's .pth and the examples, where they exist.
for f in python/*.pth; do [[ -f $f ]] && cp "$f" "$dest/python/"; done
if [[ -d examples ]]; then
    mkdir -p "$dest/examples"
    find examples -maxdepth 1 -type f -name '*.py' -exec cp {} "$dest/examples/" \;
fi
# The check scripts.
check_scripts=(scripts/gpu-check.sh scripts/gpu-check-pytorch.sh scripts/gpu_report.py scripts/torch_*.py)
cp "${check_scripts[@]}" "$dest/scripts/"

# ---------------------------------------------------------------------------
# Manifest
# ---------------------------------------------------------------------------
# The scripts' hash: sha256 over "SHA256  NAME" of each check script, sorted by
# name. gpu-check.sh computes the same over the scripts it runs with.
scripts_sha="$(cd scripts && sha256sum gpu-check.sh gpu-check-pytorch.sh gpu_report.py torch_*.py | LC_ALL=C sort -k2 | sha256sum | cut -d' ' -f1)"
commit="$(git rev-parse HEAD 2>/dev/null || echo unknown)"
dirty=no
[[ -n "$(git status --porcelain --untracked-files=no 2>/dev/null)" ]] && dirty=yes
# The newest glibc symbol version the executables need: a GPU box with an
# older glibc cannot run them (gpu-check.sh compares, one line).
glibc="$( (cd "$dest" && for f in bin/* lib/* tests/*; do objdump -T "$f" 2>/dev/null; done) |
    grep -o 'GLIBC_[0-9][0-9.]*' | sed 's/GLIBC_//' | sort -uV | tail -n 1)"
{
    echo "format: vmmalloc-gpu-bundle/1"
    echo "profile: $profile"
    echo "glibc_required: ${glibc:-unknown}"
    echo "scripts_sha256: $scripts_sha"
    echo "git_commit: $commit"
    echo "git_dirty: $dirty"
    echo "vmmalloc: $(sed -n 's/^version = "\(.*\)"/\1/p' Cargo.toml | head -n 1)"
    echo "rustc: $(rustc --version 2>/dev/null || echo unknown)"
    echo "built_on: $(uname -srm)"
    echo "built_at: $(date -u +%Y-%m-%dT%H:%M:%SZ)"
    (cd "$dest" && find . -type f ! -name manifest.txt | sed 's|^\./||' | LC_ALL=C sort |
        while read -r f; do
            echo "file: $(sha256sum "$f" | cut -d' ' -f1) $(stat -c %s "$f") $f"
        done)
} >"$manifest_tmp"
cp "$manifest_tmp" "$dest/manifest.txt"

bytes="$(du -sb "$dest" | cut -f1)"
mib=$(((bytes + 1048575) / 1048576))
echo "gpu-bundle: $dest: $(grep -c '^file: ' "$dest/manifest.txt") files, $bytes bytes ($mib MiB; limit $max_mib MiB)"
sed -n 's/^file: [0-9a-f]* \([0-9]*\) \(tests\/.*\)/  \2 (\1 bytes)/p' "$dest/manifest.txt"
if ((bytes > max_mib * 1048576)); then
    die "$dest is $mib MiB, over the $max_mib MiB limit"
fi
