#!/usr/bin/env python3
"""The GPU check's side-by-side tables (scripts/gpu-check.sh, issue 25).

    gpu_report.py table SCRIPT RESULTS.jsonl
        prints the table of one workload's runs (a terminal table)
    gpu_report.py markdown OUT.md --results RESULTS.jsonl --summary SUMMARY.txt
                  --log LOG [--manifest MANIFEST] [--env KEY=VALUE ...]
        writes results-gpu.md: the GPU, driver, PyTorch and commit, the
        step verdicts, then one table per workload, the CHECK lines of
        the feature checks (a check whose detail starts "report-only" has
        the verdict "report-only": it measures, it does not judge), and
        every other RESULT line (the check scripts' figures)

RESULTS.jsonl holds the ``RESULT {json}`` lines of scripts/torch_*.py (one
JSON object a line, with a "script" and an "allocator" key). Needs no
PyTorch.
"""

import json
import re
import sys

MIB = 1 << 20

ALLOCATOR_NOTE = {
    "pytorch": "PyTorch's default caching allocator",
    "pytorch-es": "PyTorch, PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True",
}


def _mib(b):
    return f"{b / MIB:.1f}"


# Per workload: title, then (column header, function of a row) pairs.
COLUMNS = {
    "torch_fragmentation": (
        "Fragmentation: fill 90 % of the cap with 4 MiB tensors, free four of five, ask for large tensors",
        [
            ("outcome", lambda r: r["outcome"]),
            ("large tensors served", lambda r: str(len(r.get("large_done", [])))),
            ("peak reserved MiB", lambda r: _mib(r["peak_reserved_bytes"])),
            ("cap MiB", lambda r: _mib(r["limit_bytes"])),
            ("seconds", lambda r: str(r["seconds"])),
        ],
    ),
    "torch_serving": (
        "Serving loop: growing KV caches of odd sizes and 1.5-3 GiB prefill transients under a cap",
        [
            ("out-of-memory errors", lambda r: str(r["ooms"])),
            ("served", lambda r: str(r["served"])),
            ("dropped", lambda r: str(r["dropped"])),
            ("lost contents", lambda r: str(r["lost_contents"])),
            ("peak reserved MiB", lambda r: str(r["peak_reserved_mib"])),
            ("cap MiB", lambda r: _mib(r["limit_bytes"])),
            ("seconds", lambda r: str(r["seconds"])),
        ],
    ),
    "torch_train_varlen": (
        "Training with variable sequence lengths (torch_train_varlen.py)",
        [
            ("steps", lambda r: str(r["steps"])),
            ("peak reserved MiB", lambda r: str(r["peak_reserved_mib"])),
            ("peak allocated MiB", lambda r: str(r["peak_allocated_mib"])),
            ("mean step ms", lambda r: str(r["step_ms_mean"])),
            ("max step ms", lambda r: str(r["step_ms_max"])),
            ("final loss", lambda r: str(r["final_loss"])),
        ],
    ),
    "torch_hot_path": (
        "torch.empty + free from Python (512 B - 3 MiB, cache hits)",
        [
            ("pairs", lambda r: str(r["pairs"])),
            ("median µs per pair", lambda r: str(r["us_per_pair_median"])),
            ("min µs per pair", lambda r: str(r["us_per_pair_min"])),
        ],
    ),
}


def load(path):
    rows = []
    with open(path) as f:
        for line in f:
            line = line.strip()
            if not line:
                continue
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:
                continue
    return rows


def rows_of(rows, script):
    return [r for r in rows if r.get("script") == script]


def cell(fn, r):
    try:
        return fn(r)
    except (KeyError, TypeError, ValueError):
        return "?"


def text_table(script, rows):
    title, cols = COLUMNS.get(script, (script, []))
    if not cols:
        return f"{title}: {len(rows)} result(s)"
    header = ["allocator"] + [c for c, _ in cols]
    body = [[r.get("allocator", "?")] + [cell(fn, r) for _, fn in cols] for r in rows]
    widths = [max(len(x) for x in col) for col in zip(header, *body)]
    out = [title]
    for line in [header] + body:
        out.append("  ".join(x.ljust(w) if i == 0 else x.rjust(w) for i, (x, w) in enumerate(zip(line, widths))))
    return "\n".join(out)


def md_table(script, rows):
    title, cols = COLUMNS[script]
    out = [f"### {title}", "", "| allocator | " + " | ".join(c for c, _ in cols) + " |",
           "|---|" + "---:|" * len(cols)]
    for r in rows:
        name = r.get("allocator", "?")
        out.append(f"| {name} | " + " | ".join(cell(fn, r) for _, fn in cols) + " |")
    return "\n".join(out)


def checks_from_log(log_text):
    """The feature checks' ``CHECK name: verdict`` lines, by step."""
    found = []
    for line in log_text.splitlines():
        m = re.search(r"\[([\w-]+)\] CHECK (.+?): (ok|FAIL|SKIP)\b ?(.*)$", line)
        if m:
            found.append((m.group(1), m.group(2), m.group(3), m.group(4).strip()))
    return found


def markdown(args):
    out_path = args[0]
    opts = {"--env": []}
    i = 1
    while i < len(args):
        if args[i] == "--env":
            opts["--env"].append(args[i + 1])
        else:
            opts[args[i]] = args[i + 1]
        i += 2
    rows = load(opts["--results"]) if "--results" in opts else []
    summary = open(opts["--summary"]).read().strip().splitlines() if "--summary" in opts else []
    log_text = open(opts["--log"], errors="replace").read() if "--log" in opts else ""
    manifest = {}
    if opts.get("--manifest"):
        for line in open(opts["--manifest"]):
            k, _, v = line.partition(": ")
            if k in ("git_commit", "git_dirty", "vmmalloc", "built_at"):
                manifest[k] = v.strip()
    env = dict(e.split("=", 1) for e in opts["--env"])
    lines = ["# vmmalloc on a real GPU", "",
             "Generated by `scripts/gpu-check.sh` (do not edit by hand: the check writes `results-gpu.md` into its "
             "output folder; this file is a copy of the last run on a real GPU).", ""]
    facts = [
        ("date", env.get("date")),
        ("GPU", env.get("gpu")),
        ("driver", env.get("driver")),
        ("PyTorch", env.get("torch")),
        ("Python", env.get("python")),
        ("commit", manifest.get("git_commit", "?") + (" (with uncommitted changes)" if manifest.get("git_dirty") == "yes" else "")),
    ]
    for k, v in facts:
        if v:
            lines.append(f"- {k}: {v}")
    lines += ["", "Allocators: `pytorch` is " + ALLOCATOR_NOTE["pytorch"] + "; `pytorch-es` is "
              + ALLOCATOR_NOTE["pytorch-es"] + "; `vmmalloc:NAME` is vmmalloc's plug-in "
              "(`python -m vmmalloc`, VMMALLOC_CONF=backend:NAME): `expandable` is vmmalloc's own policy, "
              "`torch-es` and `caching` its replicas of PyTorch's two allocators.", "",
              "## Steps", "", "```"] + summary + ["```", ""]
    for script in COLUMNS:
        rs = rows_of(rows, script)
        if rs:
            lines += [md_table(script, rs), ""]
    checks = checks_from_log(log_text)
    if checks:
        lines += ["## Feature checks", "",
                  "A `report-only` check measures and prints; it passes whatever the figure.", "",
                  "| step | check | verdict | detail |", "|---|---|---|---|"]
        for step, name, verdict, detail in checks:
            if verdict == "ok" and re.match(r"(\([^)]*\) )?report-only", detail):
                verdict = "report-only"
            detail = detail.replace("|", "\\|")
            lines.append(f"| {step} | {name} | {verdict} | {detail} |")
        lines.append("")
    others = [r for r in rows if r.get("script") not in COLUMNS]
    if others:
        lines += ["## Figures of the feature checks (RESULT lines)", "", "```"]
        lines += [json.dumps(r, sort_keys=True) for r in others]
        lines += ["```", ""]
    with open(out_path, "w") as f:
        f.write("\n".join(lines))
    print(f"gpu_report: wrote {out_path} ({len(rows)} results, {len(checks)} checks)")


def main(argv):
    if len(argv) >= 3 and argv[0] == "table":
        rs = rows_of(load(argv[2]), argv[1])
        if rs:
            print(text_table(argv[1], rs))
        return 0
    if len(argv) >= 1 and argv[0] == "markdown":
        markdown(argv[1:])
        return 0
    print(__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
