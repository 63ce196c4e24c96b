"""Weight copies inside loops, read from compiled HLO text (issue 8, item 1).

A dynamic-slice / slice / gather / copy of a weight-shaped value inside a loop body is a
weight copy per iteration (docs/h200.md); tests/test_no_weight_copy.py runs this on the CPU
HLO of the engine's decode step, bench/matmul.py's decode step on the GPU's.
"""

from __future__ import annotations

import re

import jax

SUSPECT_OPS = ("dynamic-slice", "slice", "gather", "copy")
_HEADER = re.compile(r"^(?:ENTRY )?%?([^\s(]+) \(.*\{\s*$")
_ARRAY_OP = re.compile(r"^\s*(?:ROOT )?%?(\S+) = \w+\[([\d,]*)\]\S* ([a-z][a-z0-9-]*)\(")
_CALLS = re.compile(r"\b(?:calls|to_apply|body|condition)=%([^\s,)}]+)")
_CALL_SETS = re.compile(r"\b(?:branch_computations|called_computations)=\{([^}]*)\}")
_BODY = re.compile(r"\bwhile\(.*\bbody=%([^\s,)}]+)")


def _computations(hlo: str) -> dict[str, list[str]]:
    comps, name = {}, None
    for line in hlo.splitlines():
        if name is None:
            if m := _HEADER.match(line):
                name = m.group(1)
                comps[name] = []
        elif line.startswith("}"):
            name = None
        else:
            comps[name].append(line)
    return comps


def _callees(line: str) -> list[str]:
    out = _CALLS.findall(line)
    for group in _CALL_SETS.findall(line):
        out += [c.strip().lstrip("%") for c in group.split(",") if c.strip()]
    return out


def weight_copies_in_loops(hlo: str, weight_shapes) -> list[str]:
    """Instructions inside any while body (fusions and calls included) that dynamic-slice,
    slice, gather or copy a value whose shape, size-1 dims dropped, is a weight's shape."""
    comps = _computations(hlo)
    shapes = {tuple(d for d in s if d != 1) for s in weight_shapes}
    todo = [b for lines in comps.values() for line in lines for b in _BODY.findall(line)]
    if not todo:
        raise AssertionError("no while loop in the HLO: is this the decode step?")
    seen, found = set(), []
    while todo:
        name = todo.pop()
        if name in seen or name not in comps:
            continue
        seen.add(name)
        for line in comps[name]:
            todo += _callees(line)
            m = _ARRAY_OP.match(line)
            if m and m.group(3) in SUSPECT_OPS:
                dims = tuple(int(d) for d in m.group(2).split(",") if d and int(d) != 1)
                if dims in shapes:
                    found.append(f"{name}: {line.strip()[:160]}")
    return found


def weight_shapes(params) -> set[tuple[int, ...]]:
    """Shapes of the 2-D-or-more leaves of a params pytree (size-1 dims excluded)."""
    return {a.shape for a in jax.tree.leaves(params) if a.ndim >= 2 and min(a.shape) > 1}
