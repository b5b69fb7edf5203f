#!/usr/bin/env python3
"""Usage: python3 scripts/long_functions.py [N [ROOT...]] (from the repository root).

Lists functions longer than N lines (default 150) (signature line to closing brace) in the
non-test library code of the workspace: crates/*/src and src/, excluding
`#[cfg(test)]` modules, tests/, benches/, examples/ and the dev-only testkit.
Brace depth counted with strings, chars and comments skipped."""
import re, sys, os, glob
N = int(sys.argv[1]) if len(sys.argv) > 1 else 150
roots = sys.argv[2:] or sorted(glob.glob('crates/*/src')) + ['src', 'vmm-sys/src']
FN = re.compile(r'^\s*(pub(\([^)]*\))?\s+)?(const\s+)?(async\s+)?(unsafe\s+)?(extern\s+"[^"]*"\s+)?fn\s+(\w+)')
def strip(line, state):
    # remove strings/comments; state: in block comment / in raw string
    out = []; i = 0
    while i < len(line):
        if state['block']:
            j = line.find('*/', i)
            if j < 0: return ''.join(out)
            state['block'] = False; i = j + 2; continue
        if state['str']:
            c = line[i]
            if c == '\\': i += 2; continue
            if c == '"': state['str'] = False
            i += 1; continue
        if state['raw'] is not None:
            end = '"' + '#' * state['raw']
            j = line.find(end, i)
            if j < 0: return ''.join(out)
            state['raw'] = None; i = j + len(end); continue
        c = line[i]
        if line.startswith('//', i): break
        if line.startswith('/*', i): state['block'] = True; i += 2; continue
        m = re.match(r'b?r(#*)"', line[i:])
        if m and (i == 0 or not (line[i-1].isalnum() or line[i-1] == '_')):
            state['raw'] = len(m.group(1)); i += len(m.group(0)); continue
        if c == '"': state['str'] = True; i += 1; continue
        if c == "'":
            m = re.match(r"'(\\.[^']*|[^\\'])'", line[i:])
            if m: i += len(m.group(0)); continue
        out.append(c); i += 1
    return ''.join(out)
res = []
for root in roots:
    if 'trace-testkit' in root: continue
    for path in sorted(glob.glob(root + '/**/*.rs', recursive=True)):
        if '/tests/' in path or '/benches/' in path or '/examples/' in path: continue
        lines = open(path).read().split('\n')
        state = {'block': False, 'str': False, 'raw': None}
        depth = 0; stack = []  # (name, start, depth_at_open)
        skip_test_depth = None; pending_cfg_test = False; pending_fn = None
        for ln, raw in enumerate(lines, 1):
            s = strip(raw, state)
            if re.match(r'\s*#\[cfg\(test\)\]', raw): pending_cfg_test = True
            m = FN.match(raw) if not state['str'] else None
            if m and skip_test_depth is None and pending_fn is None:
                pending_fn = (m.group(7), ln)
            for c in s:
                if c == '{':
                    if pending_cfg_test and skip_test_depth is None:
                        skip_test_depth = depth
                    pending_cfg_test = False
                    if pending_fn is not None:
                        stack.append((pending_fn[0], pending_fn[1], depth)); pending_fn = None
                    depth += 1
                elif c == '}':
                    depth -= 1
                    if stack and stack[-1][2] == depth:
                        name, start, _ = stack.pop()
                        n = ln - start + 1
                        if n > N and skip_test_depth is None: res.append((n, path, start, name))
                    if skip_test_depth is not None and depth == skip_test_depth:
                        skip_test_depth = None
                elif c == ';':
                    if pending_fn is not None and '{' not in s: pending_fn = None  # trait fn decl
                    if pending_cfg_test and skip_test_depth is None and depth >= 0: pending_cfg_test = False
for n, p, l, name in sorted(res, reverse=True):
    print(f'{n:5} {p}:{l} {name}')
print(f'{len(res)} functions over {N} lines')
