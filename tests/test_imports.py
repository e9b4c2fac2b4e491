"""The project's import graph has no cycle, and its packages depend on each other one way only.

The graph is built from the source (ast, nothing imported, no JAX): one node per module of
models/, sampling/, rl/, launch/ and configs/, one edge per project import in it, module-level or
inside a function (a lazy import that closes a cycle is still a cycle: the two modules still
cannot be understood, or tested, one without the other). `from pkg import name` depends on the
submodule pkg.name when there is one, else on pkg/__init__.py.

DESIGN.md's direction: launch -> rl -> sampling -> models, rl -> models; configs import none of
them. Inside rl/, three layers: the environments (rl.envs.*) may import the learning modules (the
rest of rl/) and the sandbox (rl.sandbox.*), never the other way: a learning module imports nothing
of rl.envs or rl.sandbox (the environments, their rewards and data sources register themselves
from above into rl.environment, rl.rewards and rl.sources), and the sandbox imports no
other module of rl/. `python -m tests.test_imports` prints the cycles and the arrows against
these directions.
"""

from __future__ import annotations

import ast
import functools
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGES = ("models", "sampling", "rl", "launch", "configs")
# What each package may import of the others (its own modules aside).
ALLOWED = {
    "models": set(),
    "sampling": {"models"},
    "rl": {"sampling", "models"},
    "launch": {"rl", "sampling", "models", "configs"},
    "configs": set(),
}


def modules() -> dict[str, str]:
    """{dotted module name: file path} of every module of PACKAGES."""
    out = {}
    for pkg in PACKAGES:
        for root, dirs, files in os.walk(os.path.join(ROOT, pkg)):
            dirs[:] = sorted(d for d in dirs if not d.startswith((".", "__")))
            for name in sorted(files):
                if not name.endswith(".py"):
                    continue
                rel = os.path.relpath(os.path.join(root, name), ROOT)[: -len(".py")]
                parts = rel.split(os.sep)
                if parts[-1] == "__init__":
                    parts = parts[:-1]
                out[".".join(parts)] = os.path.join(root, name)
    return out


def imports(source: str, mod: str, mods, is_pkg: bool = False) -> set[str]:
    """The modules of `mods` that module `mod` (a package's __init__ when is_pkg) imports."""
    out = set()
    for node in ast.walk(ast.parse(source)):
        targets = []
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from the module's package, `level` - 1 steps up
                here = mod.split(".") if is_pkg else mod.split(".")[:-1]
                here = here[: len(here) - (node.level - 1)]
                base = ".".join(here + ([base] if base else []))
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in mods else base
                       for a in node.names]  # fmt: skip
        for t in targets:
            while t and t not in mods:  # `import a.b.c` or `from a.b import name`
                t = t.rpartition(".")[0]
            if t and t != mod:
                out.add(t)
    return out


@functools.cache
def graph() -> dict[str, set[str]]:
    """{module: the project modules it imports, anywhere in its body} (parsed once per process;
    callers do not mutate it)."""
    mods = modules()
    edges = {}
    for mod, path in mods.items():
        with open(path) as f:
            edges[mod] = imports(f.read(), mod, mods, path.endswith("__init__.py"))
    return edges


def components(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan): each is a set of
    modules that import each other, directly or not."""
    index, low, stack, on, comps = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(edges[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                comps.append(set(comp))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return sorted(sorted(c) for c in comps)


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """A shortest cycle through the first module of each component() (breadth-first)."""
    out = []
    for comp in components(edges):
        start, prev, frontier = comp[0], {comp[0]: None}, [comp[0]]
        while not any(start in edges[v] for v in frontier):
            nxt = []
            for v in frontier:
                for w in sorted(set(edges[v]) & set(comp) - set(prev)):
                    prev[w] = v
                    nxt.append(w)
            frontier = nxt
        path = [next(v for v in frontier if start in edges[v])]
        while prev[path[-1]] is not None:
            path.append(prev[path[-1]])
        out.append(path[::-1] + [start])
    return out


def wrong_way(edges: dict[str, set[str]]) -> list[str]:
    """Imports from one package into another that DESIGN.md's direction does not allow."""
    out = []
    for mod, targets in sorted(edges.items()):
        pkg = mod.split(".")[0]
        for t in sorted(targets):
            other = t.split(".")[0]
            if other != pkg and other not in ALLOWED[pkg]:
                out.append(f"{mod} -> {t}")
    return out


def rl_layer(mod: str) -> str | None:
    """The layer of an rl/ module: "envs", "sandbox" or "learning" (None outside rl/)."""
    parts = mod.split(".")
    if parts[0] != "rl":
        return None
    return parts[1] if len(parts) > 1 and parts[1] in ("envs", "sandbox") else "learning"


RL_LAYERS_ALLOWED = {("envs", "learning"), ("envs", "sandbox")}  # (importer, imported)


def rl_back_edges(edges: dict[str, set[str]]) -> list[str]:
    """Imports between rl/'s layers other than envs -> learning modules and envs -> sandbox."""
    out = []
    for mod, targets in sorted(edges.items()):
        for t in sorted(targets):
            a, b = rl_layer(mod), rl_layer(t)
            if a and b and a != b and (a, b) not in RL_LAYERS_ALLOWED:
                out.append(f"{mod} -> {t}  ({a} -> {b})")
    return out


def cycle_lines(edges: dict[str, set[str]]) -> list[str]:
    """One line per component(): its modules and a cycle through them."""
    return [f"{{{', '.join(comp)}}}, e.g. " + " -> ".join(c)
            for comp, c in zip(components(edges), cycles(edges))]  # fmt: skip


def test_no_import_cycle():
    found = cycle_lines(graph())
    assert not found, "import cycles:\n" + "\n".join(found)


def test_packages_depend_one_way():
    bad = wrong_way(graph())
    assert not bad, "imports against launch -> rl -> sampling -> models:\n" + "\n".join(bad)


def test_rl_learning_modules_import_no_environment_or_sandbox():
    bad = rl_back_edges(graph())
    assert not bad, "imports against rl/'s envs -> learning, envs -> sandbox:\n" + "\n".join(bad)


def test_the_rl_layer_rule_catches_a_planted_back_edge():
    edges = graph()
    assert rl_layer("rl.envs.repo.env") == "envs" and rl_layer("rl.sandbox") == "sandbox"
    assert rl_layer("rl.environment") == rl_layer("rl") == "learning" and not rl_layer("launch.x")
    assert {"rl.envs.repo.env", "rl.sandbox.process", "rl.rewards"} <= set(edges)
    planted = {  # today's graph, plus one back edge of each kind
        **edges,
        "rl.rewards": edges["rl.rewards"] | {"rl.envs.code_rewards"},
        "rl.multiturn": edges["rl.multiturn"] | {"rl.sandbox"},
        "rl.sandbox.oci": edges["rl.sandbox.oci"] | {"rl.envs.repo.images", "rl.data"},
    }
    assert rl_back_edges(planted) == [
        "rl.multiturn -> rl.sandbox  (learning -> sandbox)",
        "rl.rewards -> rl.envs.code_rewards  (learning -> envs)",
        "rl.sandbox.oci -> rl.data  (sandbox -> learning)",
        "rl.sandbox.oci -> rl.envs.repo.images  (sandbox -> envs)",
    ]
    lazy = "def f():\n    from rl.envs.repo import images\n"  # a lazy import counts too
    mods = set(edges)
    assert rl_back_edges({"rl.sources": imports(lazy, "rl.sources", mods)}) == [
        "rl.sources -> rl.envs.repo.images  (learning -> envs)"
    ]


def test_the_checker_sees_lazy_and_relative_imports():
    mods = {"rl", "rl.a", "rl.b", "rl.envs", "rl.envs.c", "models.m"}
    lazy = "import os\n\ndef f():\n    from rl import b\n    import models.m\n"
    assert imports(lazy, "rl.a", mods) == {"rl.b", "models.m"}
    relative = "from . import c\nfrom .. import a\nfrom ..b import name\n"
    assert imports(relative, "rl.envs", mods, is_pkg=True) == {"rl.envs.c", "rl.a", "rl.b"}
    assert imports("from rl.envs import NAME\n", "rl.a", mods) == {"rl.envs"}
    toy = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": {"e2"}, "e2": set()}
    assert components(toy) == [["a", "b", "c"]] and cycles(toy) == [["a", "b", "c", "a"]]
    assert wrong_way({"rl.a": {"launch.b", "models.m"}, "models.m": {"rl.a"}}) == [
        "models.m -> rl.a", "rl.a -> launch.b"]  # fmt: skip
    edges = graph()
    assert len(edges) > 50 and {m.split(".")[0] for m in edges} == set(PACKAGES)


if __name__ == "__main__":
    g = graph()
    found, bad, back = cycle_lines(g), wrong_way(g), rl_back_edges(g)
    print(f"{len(g)} modules, {sum(map(len, g.values()))} project imports")
    print(f"{len(found)} import cycle(s)" + (":" if found else ""))
    for line in found:
        print("  " + line)
    print(f"{len(bad)} import(s) against the package direction" + (":" if bad else ""))
    for b in bad:
        print("  " + b)
    layers = {}
    for mod in g:
        layers.setdefault(rl_layer(mod), []).append(mod)
    sizes = ", ".join(f"{k} {len(layers.get(k, []))}" for k in ("learning", "envs", "sandbox"))
    print(f"rl/ modules by layer: {sizes}")
    print(
        f"{len(back)} import(s) against rl/'s envs -> learning, envs -> sandbox"
        + (":" if back else "")
    )
    for b in back:
        print("  " + b)
    sys.exit(1 if found or bad or back else 0)
