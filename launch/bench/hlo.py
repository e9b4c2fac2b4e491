"""Reading a compiled program's HLO text (`compiled.as_text()`): its while loops and its
collectives, each with the loops around it. `launch.bench mesh` counts a decode step's
collectives with it; tests use it to assert where collectives are (or are not).

The text is XLA's scheduled, SPMD-partitioned module, so every shape in it is one device's.
- `parse(text)`: the computations, their instructions, and which computations each calls.
- `while_loops(text)`: every `while` instruction, reached from ENTRY, with its nesting (the
  whiles around it), its body and condition, its op_name metadata and the shapes of its state.
- `collectives(text)`: every collective instruction reached from ENTRY, with its kind, its result
  shapes and bytes per device, and the whiles around it (outermost first).
- `summarize(items)`: count and bytes by kind.

A computation called from several places (XLA mostly clones them, so rarely) is counted once
per call site. Collectives in a while's condition count as inside that while, as its body's do:
both run once per trip. Bytes are the result's bytes on one device: an all-gather's gathered
output, an all-reduce's reduced array, a reduce-scatter's scattered piece. The async forms
(`all-reduce-start`, `all-gather-start`, `collective-permute-start`; XLA:GPU's) are counted
once, by their result (the last element of an all-gather-start's or collective-permute-start's
tuple, which holds operands then results); their `-done` halves are not counted.
"""

from __future__ import annotations

import dataclasses
import re

KINDS = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")

BYTES = {
    "pred": 1,
    "s8": 1,
    "u8": 1,
    "s16": 2,
    "u16": 2,
    "f16": 2,
    "bf16": 2,
    "s32": 4,
    "u32": 4,
    "f32": 4,
    "s64": 8,
    "u64": 8,
    "f64": 8,
    "c64": 8,
    "c128": 16,
    "f8e4m3fn": 1,
    "f8e5m2": 1,
    "f8e4m3": 1,
    "f8e4m3b11fnuz": 1,
    "f8e4m3fnuz": 1,
    "f8e5m2fnuz": 1,
    "s4": 1,
    "u4": 1,
}
_SHAPE = re.compile(r"\b(" + "|".join(sorted(BYTES, key=len, reverse=True)) + r")\[([\d,]*)\]")
_HEADER = re.compile(r"^(ENTRY )?%([^\s(]+) \(")
_INSTR = re.compile(r"^\s*(ROOT )?%([^\s=]+) = ")
_CALLED = re.compile(
    r"\b(condition|body|to_apply|calls|true_computation|false_computation)"
    r"=%([^\s,}]+)"
)
_BRANCHES = re.compile(r"branch_computations=\{([^}]*)\}")
_OP_NAME = re.compile(r'op_name="([^"]*)"')


@dataclasses.dataclass
class Instruction:
    name: str
    opcode: str
    type: str  # the result type as written: "f32[8,128]{1,0}" or a tuple "(s32[], f32[2])"
    line: str
    calls: list[tuple[str, str]]  # (role, computation): body, condition, calls, to_apply, ...

    @property
    def shapes(self) -> list[tuple[str, tuple[int, ...]]]:
        """(dtype, dims) of every array in the result type, in order."""
        return [(d, tuple(int(x) for x in s.split(",") if x)) for d, s in _SHAPE.findall(self.type)]

    @property
    def op_name(self) -> str:
        m = _OP_NAME.search(self.line)
        return m.group(1) if m else ""


@dataclasses.dataclass
class Module:
    computations: dict[str, list[Instruction]]
    entry: str


def nbytes(shapes) -> int:
    """Bytes of (dtype, dims) arrays."""
    total = 0
    for dtype, dims in shapes:
        n = 1
        for d in dims:
            n *= d
        total += n * BYTES[dtype]
    return total


def _split_type(rest: str) -> tuple[str, str]:
    """(result type, the text after it) of an instruction's right-hand side."""
    if not rest.startswith("("):
        t, _, after = rest.partition(" ")
        return t, after
    depth = 0
    for i, ch in enumerate(rest):
        depth += ch == "("
        depth -= ch == ")"
        if depth == 0:
            return rest[: i + 1], rest[i + 1 :].lstrip()
    return rest, ""


def parse(text: str) -> Module:
    """The module's computations (name -> instructions) and its ENTRY's name."""
    comps: dict[str, list[Instruction]] = {}
    entry, current = "", None
    for line in text.splitlines():
        h = _HEADER.match(line)
        if h and line.rstrip().endswith("{"):
            current = comps.setdefault(h.group(2), [])
            if h.group(1):
                entry = h.group(2)
            continue
        if line.startswith("}"):
            current = None
            continue
        m = _INSTR.match(line) if current is not None else None
        if m is None:
            continue
        typ, after = _split_type(line[m.end() :])
        opcode = after.partition("(")[0].strip()
        calls = _CALLED.findall(line)
        for group in _BRANCHES.findall(line):
            calls += [("branch", c.strip().lstrip("%")) for c in group.split(",") if c.strip()]
        current.append(Instruction(m.group(2), opcode, typ, line, calls))
    if not entry:
        raise ValueError("no ENTRY computation in the HLO text")
    return Module(comps, entry)


def _kind(opcode: str) -> str | None:
    base = opcode[: -len("-start")] if opcode.endswith("-start") else opcode
    return base if base in KINDS else None


@dataclasses.dataclass
class Collective:
    kind: str  # one of KINDS
    name: str
    computation: str
    shapes: list[tuple[str, tuple[int, ...]]]  # its result arrays (one device's)
    loops: tuple[str, ...]  # the while instructions around it, outermost first
    op_name: str
    groups: list[list[int]] | None = None  # its replica groups (device / partition ids)

    @property
    def bytes(self) -> int:
        return nbytes(self.shapes)

    def spans(self, owner) -> bool:
        """Whether one of its groups holds devices of two hosts: owner(id) -> the process of
        device id. A collective without groups spans every device (so two hosts, if any)."""
        if not self.groups:
            return True
        return any(len({owner(d) for d in g}) > 1 for g in self.groups)


def replica_groups(line: str) -> list[list[int]] | None:
    """The groups of an instruction's `replica_groups=` (or, for a collective-permute, the
    pairs of its `source_target_pairs=`): explicit `{{0,1},{2,3}}`, XLA's iota form
    `[G,N]<=[d...]` with an optional transpose `T(...)`, or its mesh form
    `mesh['a'=4,'b'=2] {'b'}` (the devices along the named axes; `device_ids=(...)` an iota
    order of them); None when it names none."""
    m = re.search(r"source_target_pairs=\{((?:\{[\d,]+\},?)*)\}", line)
    if m:
        return [[int(x) for x in p.split(",")] for p in re.findall(r"\{([\d,]+)\}", m.group(1))]
    m = re.search(
        r"replica_groups=mesh\[([^\]]*)\](?:, device_ids=\(\[([\d,]+)\](?:T\(([\d,]+)\))?\))?"
        r" \{([^}]*)\}",
        line,
    )
    if m:  # a mesh of named axes (device ids an iota, maybe transposed), reduced over some
        import numpy as np

        axes = [(n, int(k)) for n, k in re.findall(r"'([^']+)'=(\d+)", m.group(1))]
        shape = [k for _, k in axes]
        ids = np.arange(int(np.prod(shape)))
        if m.group(2):
            ids = ids.reshape([int(x) for x in m.group(2).split(",")])
            if m.group(3):
                ids = ids.transpose([int(x) for x in m.group(3).split(",")])
        ids = ids.reshape(shape)
        over = [i for i, (n, _) in enumerate(axes) if f"'{n}'" in m.group(4)]
        rest = [i for i in range(len(axes)) if i not in over]
        size = int(np.prod([shape[i] for i in over])) if over else 1
        return ids.transpose(rest + over).reshape(-1, size).tolist()
    m = re.search(r"replica_groups=\[([\d,]+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?", line)
    if m:
        import numpy as np

        shape = [int(x) for x in m.group(1).split(",")]
        ids = np.arange(int(np.prod([int(x) for x in m.group(2).split(",")])))
        ids = ids.reshape([int(x) for x in m.group(2).split(",")])
        if m.group(3):
            ids = ids.transpose([int(x) for x in m.group(3).split(",")])
        return ids.reshape(shape).tolist()
    m = re.search(r"replica_groups=\{((?:\{[\d,]*\},?)*)\}", line)
    if m:
        groups = [
            [int(x) for x in g.split(",") if x] for g in re.findall(r"\{([\d,]*)\}", m.group(1))
        ]
        return [g for g in groups if g] or None
    return None


@dataclasses.dataclass
class While:
    name: str
    computation: str  # where the while instruction is
    body: str
    condition: str
    loops: tuple[str, ...]  # the whiles around this one, outermost first
    shapes: list[tuple[str, tuple[int, ...]]]  # its loop state's arrays
    op_name: str

    @property
    def depth(self) -> int:
        """1 for a while at ENTRY level (or in a computation it calls outside any loop)."""
        return len(self.loops) + 1


def _walk(module: Module):
    """(computation, loops around it) for every call site reached from ENTRY, each computation
    entered only if it holds (transitively) a while or a collective."""
    comps = module.computations
    interesting: dict[str, bool] = {}

    def holds(name: str, seen=()) -> bool:
        if name not in interesting:
            if name in seen or name not in comps:
                return False
            interesting[name] = any(
                i.opcode == "while"
                or _kind(i.opcode)
                or any(holds(c, (*seen, name)) for _, c in i.calls)
                for i in comps[name]
            )
        return interesting[name]

    stack = [(module.entry, ())]
    while stack:
        name, loops = stack.pop()
        yield name, loops
        for ins in comps.get(name, []):
            for _, callee in ins.calls:
                if not holds(callee):
                    continue
                inner = (*loops, ins.name) if ins.opcode == "while" else loops
                stack.append((callee, inner))


def _result_shapes(ins: Instruction) -> list[tuple[str, tuple[int, ...]]]:
    shapes = ins.shapes
    if ins.opcode in ("all-gather-start", "collective-permute-start") and len(shapes) > 1:
        # (operands..., results..., [contexts]): the results are the larger half's last arrays;
        # the common single-operand form is (operand, result[, u32[], u32[]]).
        arrays = [s for s in shapes if s[1]] or shapes
        return arrays[len(arrays) // 2 :]
    return shapes


def collectives(text_or_module) -> list[Collective]:
    """Every collective reached from ENTRY (one per call site), with the whiles around it."""
    module = parse(text_or_module) if isinstance(text_or_module, str) else text_or_module
    out = []
    for comp, loops in _walk(module):
        for ins in module.computations.get(comp, []):
            kind = _kind(ins.opcode)
            if kind:
                out.append(
                    Collective(
                        kind,
                        ins.name,
                        comp,
                        _result_shapes(ins),
                        loops,
                        ins.op_name,
                        replica_groups(ins.line),
                    )
                )
    return out


def while_loops(text_or_module) -> list[While]:
    """Every while instruction reached from ENTRY, with the whiles around it."""
    module = parse(text_or_module) if isinstance(text_or_module, str) else text_or_module
    out = []
    for comp, loops in _walk(module):
        for ins in module.computations.get(comp, []):
            if ins.opcode == "while":
                role = dict(ins.calls)
                out.append(
                    While(
                        ins.name,
                        comp,
                        role.get("body", ""),
                        role.get("condition", ""),
                        loops,
                        ins.shapes,
                        ins.op_name,
                    )
                )
    return out


def summarize(items) -> dict:
    """{kind: {"count", "bytes"}} over every kind in KINDS (zeros included), and "total"."""
    out = {k: {"count": 0, "bytes": 0} for k in (*KINDS, "total")}
    for c in items:
        for k in (c.kind, "total"):
            out[k]["count"] += 1
            out[k]["bytes"] += c.bytes
    return out
