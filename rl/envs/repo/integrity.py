"""What keeps the graded run of the `repo` environment honest: two parts of the GRADE program
(`rl/envs/repo/programs.py`), as Python source it splices in. RESTORE puts the pristine test
files back, with every file of their test directories, and the conftest.py and pytest
configuration files; GUARD is the tamper check, defined (and its snapshot taken) after GRADE has
imported its harness (pytest, its built-in plugins, unittest) and before it writes READY, so before
any of the model's code can run in its process.

Restoring: `files` maps each pristine file's path to [mode, base64 bytes] (data files need not be
text), `dirs` are the test directories and `keep` their pristine subdirectories. Everything else
in a test directory is deleted, a file the model added too: the graded node ids are fixed, so an
extra file there can only change how the listed tests run (a `tests/__init__.py` that patches
unittest), never add one (fail-closed). What RESTORE changed is reported (`episode.restored`) but
is no tamper: a scratch reproduction test or an edited test is an ordinary thing to leave behind.

Guarding: grading runs the model's code in the process that runs the tests (the tests import it),
and that code can rebind what decides a test's outcome: `unittest.TestCase.assertEqual = lambda *a,
**k: None` appended to the package's own `__init__.py` (which the model may edit, so grading cannot
put it back) passed an unfixed task. `snapshot()` records, at the program's start, every function
and class of the modules that run the tests and make their reports (`pytest`, `_pytest.*`: the
runner, `TestReport`, `CallInfo`, the terminal, skipping, outcomes...; `pluggy`, which dispatches
the hooks; `unittest.*`: `TestCase`'s `assert*` / `fail*` methods, `_Outcome`; the GRADE program
itself), with their code objects, every function of their classes, those modules themselves in
`sys.modules`, and every callable of `builtins` (`__build_class__`, `__import__`, `isinstance`,
the exceptions: replacing `__build_class__` gave the test classes a no-op assertEqual).
`tampered(config)` lists what differs: an object rebound, a code object swapped (`f.__code__ =
...`), a method added to or removed from one of those classes; a hook implementation, an import
finder (`sys.meta_path`, `sys.path_importer_cache`: one of the model's could serve forged test
modules) or an assertion of a collected TestCase (its `assert*` / `fail*` through the MRO) that is
not trusted; the plugin manager's hook dispatch replaced. Trusted (`trusted()`): a function of the
snapshot, by identity, or one whose code object is one compiled from a pristine file (the
trainer's site-packages, or a repository .py file as it was: its sha256; compiled plain and as
pytest's assertion rewriting compiles it) and which runs in that file's module. A function's
claimed `co_filename` proves nothing (`code.replace(co_filename=...)` forged pytest's), so a
plugin the model registered (found through `gc`), wrote into a plugin module or forged is not
trusted, nor is an assertEqual set on the test class. A finder's class must be the harness's, the
standard library's (`zipimporter`, `FileFinder`, importlib's bases) or have only trusted methods:
a pristine test may import from a zip or install its own hook. The builtins are not checked right
after a test's call, only after its teardown: a pristine test's `monkeypatch` lends one out until
then. GRADE checks after collection, after each test's call (before its report is made), after
its teardown and after pytest returns; a run that fails the check ends at once and scores 0
(`episode.tamper`, counted in `episode/tamper`). The one change allowed is pytest's own: its
legacypath plugin adds py.path properties to its classes when it configures. Checking costs about
a millisecond (identities; a class's methods are listed again only when its attribute count
changed; a file is compiled once, the first check about 0.1 s).

False positives, by design: a fix that edits the repository's own pytest plugin module (which
the pristine conftest.py names), the module of a finder class a pristine test installs, or of a
TestCase base class that defines an assertion, scores as tamper (that file is no longer pristine,
so what it defines is not trusted); so does a
pristine test that monkeypatches the harness itself (unittest's asserts, pytest's internals) or
a builtin through a fixture wider than one test (checked at the next teardown).

What it cannot see (docs/repo_env.md's caveats): the check runs in the process the model's code
runs in, at those points only. A patch undone between two checks, a module forged into
`sys.modules` ahead of its import, or code that targets the grading program itself (its globals:
`__main__.tampered = ...`; its `__main__.result(...)`; a RESULT line written to its file
descriptors) escape it. In-process grading stays bypassable so; closing that needs the outcomes
observed from outside the process.
"""

GUARD = r"""
import ast, builtins, hashlib, importlib.abc, importlib.machinery, stat, types, zipimport
from _pytest.assertion import rewrite
ROOTS = ("pytest", "_pytest", "pluggy", "unittest", "__main__")
SITE_REAL = tuple(os.path.join(os.path.realpath(d), "") for d in [SITE] + A.get("sites", []))
LEGACY = os.path.join(SITE, "_pytest", "legacypath.py")
FUNC = (types.FunctionType, classmethod, staticmethod, property)
TESTCASE, CONFIG, CLASSES, VERIFIED = unittest.TestCase, [], [], {}
# what a collected TestCase's assertions resolve to (its own methods, through the MRO)
ASSERTS = sorted({k for k in dir(TESTCASE) if k.startswith(("assert", "fail", "_baseAssert",
                  "_getAssert"))} | {"__getattribute__", "__getattr__"})
# the standard library's import finders (a pristine test that imports from a zip adds one)
# and the bases of a finder of one's own (importlib.abc's)
STDLIB = {zipimport.zipimporter} | {
    v for m in (importlib.machinery, importlib.abc) for v in vars(m).values()
    if isinstance(v, type) and (m is importlib.abc or v.__name__.endswith(("Finder", "Importer")))}


def parts(v):  # the functions behind a function, classmethod, staticmethod or property
    if isinstance(v, property):
        return [f for f in (v.fget, v.fset, v.fdel) if isinstance(f, types.FunctionType)]
    f = getattr(v, "__func__", v)
    return [f] if isinstance(f, types.FunctionType) else []


def snapshot():
    objs, classes, seen, mods = [], [], set(), []
    for mname, m in sorted(sys.modules.items()):
        if mname.split(".")[0] not in ROOTS:
            continue
        ns = vars(m)
        mods.append((mname, m))
        for k, v in list(ns.items()):
            if not isinstance(v, (types.FunctionType, type)):
                continue
            objs.append((mname + "." + k, ns, k, v))
            home = str(getattr(v, "__module__", "")).split(".")[0]
            if isinstance(v, type) and home in ROOTS + ("builtins",) and id(v) not in seen:
                seen.add(id(v))  # pytest's own outcome exceptions say they are builtins'
                classes.append(("%s.%s" % (v.__module__, v.__qualname__), v))
    methods = []
    for cname, c in classes:
        ns = vars(c)
        names = frozenset(k for k, v in ns.items() if isinstance(v, FUNC))
        methods.append((cname, ns, len(ns), names))
        objs += [(cname + "." + k, ns, k, ns[k]) for k in names]
    funcs = {id(f): (n, f, f.__code__) for n, _, _, v in reversed(objs) for f in parts(v)}
    # every callable of builtins (__build_class__, __import__, isinstance, the exceptions...):
    # apart, since a pristine test's monkeypatch fixture may lend one out until its teardown
    lent = [("builtins." + k, vars(builtins), k, v) for k, v in vars(builtins).items()
            if callable(v)]
    kept = list(sys.meta_path) + [f for f in sys.path_importer_cache.values() if f is not None]
    types_ = STDLIB | {c for _, c in classes} | {type(f) for f in kept if not isinstance(f, type)}
    types_ = {b for c in types_ for b in c.__mro__}  # with their bases (importlib's frozen ones)
    return dict(objs=objs, methods=methods, funcs=funcs, lent=lent, mods=mods,
                finders={id(f) for f in kept}, kept=kept, types=types_)  # kept: ids stay theirs


def compiled(where, seen={}):
    # the code objects compiled from file `where` when it is pristine: in the trainer's
    # site-packages, or a file of the repository as it was (its sha256 in A["hashes"], the
    # pristine .py files: a conftest.py put back, a test module, a plugin module the tests name);
    # plain and as pytest's assertion rewriting compiles it; read once. Empty: not pristine
    if where not in seen:
        seen[where], real, codes = set(), os.path.realpath(where), []
        rel = real[len(ROOT_AS[1]) + 1:] if real.startswith(ROOT_AS[1] + "/") else None
        if not real.startswith(SITE_REAL) and rel not in A["hashes"]:
            return seen[where]
        try:
            if stat.S_ISREG(os.stat(real).st_mode):  # not a FIFO
                with open(real, "rb") as f:
                    src = f.read()
                if rel is None or hashlib.sha256(src).hexdigest() == A["hashes"][rel]:
                    codes.append(compile(src, where, "exec", dont_inherit=True))
                    tree = ast.parse(src, filename=where)
                    rewrite.rewrite_asserts(tree, src, where, CONFIG[0] if CONFIG else None)
                    codes.append(compile(tree, where, "exec", dont_inherit=True))
        except Exception:  # unreadable or not Python: not trusted
            pass
        while codes:
            c = codes.pop()
            seen[where].add(c)
            codes += [k for k in c.co_consts if isinstance(k, types.CodeType)]
    return seen[where]


def trusted(f):
    # whether function f may decide outcomes: one of the harness's own, as snapshotted (by
    # identity), or code compiled from a pristine file and running in that file's module. What
    # its code claims (co_filename, which code.replace forges) proves nothing alone
    known = SNAP["funcs"].get(id(f)) or VERIFIED.get(id(f))
    code = getattr(f, "__code__", None)
    if known and known[1] is f and known[2] is code:
        return True
    g = getattr(f, "__globals__", None)
    m = sys.modules.get(g.get("__name__")) if isinstance(g, dict) else None
    where = getattr(m, "__file__", None)
    if code is None or m is None or vars(m) is not g or where != code.co_filename:
        return False
    if code in compiled(where):
        VERIFIED[id(f)] = (None, f, code)
        return True
    return False


def trusted_class(t):  # a finder's class: the harness's, the standard library's, or pristine
    for k in t.__mro__:
        if k in SNAP["types"]:
            continue
        for v in vars(k).values():
            if isinstance(v, FUNC) and not all(trusted(f) for f in parts(v)):
                return False
            if callable(v) and not isinstance(v, (FUNC, type)):
                return False
    return True


def finder_ok(f):  # an import finder that could serve forged test modules: one of the above
    if id(f) in SNAP["finders"]:
        return True
    own = getattr(f, "__dict__", {})
    return trusted_class(f if isinstance(f, type) else type(f)) and (
        isinstance(f, type) or not any(callable(v) for v in own.values()))


def patched(v):
    # pytest's own legacypath plugin adds and replaces methods of Config, Node, Session... when it
    # configures (py.path properties): nothing else may
    fs = parts(v)
    return bool(fs) and all(f.__code__ in compiled(LEGACY) for f in fs)


def asserts(classes):  # a collected TestCase's assertions: unittest's, or a pristine file's
    bad = []
    for c in classes:
        for k in ASSERTS:
            home = next((b for b in c.__mro__ if k in vars(b)), object)
            if home in SNAP["types"]:
                continue  # unittest's own: in the snapshot
            fs = parts(vars(home)[k])
            if not fs or not all(trusted(f) for f in fs):
                bad.append("%s.%s.%s" % (c.__module__, c.__qualname__, k))
    return bad


def tampered(config=None, classes=(), lent=True):
    # what differs from SNAP (empty: nothing); lent: builtins too (not right after a test's call)
    bad = [n for n, ns, k, v in SNAP["objs"] if ns.get(k) is not v and not patched(ns.get(k))]
    bad += [n for n, ns, k, v in SNAP["lent"] if lent and ns.get(k) is not v]
    bad += [n for n, f, c in SNAP["funcs"].values() if f.__code__ is not c]
    bad += ["sys.modules[%r]" % n for n, m in SNAP["mods"] if sys.modules.get(n) is not m]
    for n, ns, size, names in SNAP["methods"]:
        if len(ns) != size:  # an attribute added or removed: a method?
            now = {k for k, v in ns.items() if isinstance(v, FUNC)}
            if names - now or not all(patched(ns[k]) for k in now - names):
                bad.append(n + " (methods)")
    if bad:  # what follows calls into the harness (pytest's rewrite): only when it is intact
        return bad
    bad += ["sys.meta_path: %r" % (f,) for f in sys.meta_path if not finder_ok(f)]
    bad += ["sys.path_importer_cache[%r]" % (p,) for p, f in sys.path_importer_cache.items()
            if f is not None and not finder_ok(f)]
    bad += asserts(classes)
    if config is not None:
        pm = config.pluginmanager
        bad += ["pluginmanager." + k for k, v in PM.items() if vars(pm).get(k) is not v]
        for name, hook in list(vars(pm.hook).items()):
            if getattr(hook, "_hookexec", None) != getattr(pm, "_hookexec", None):
                bad.append("hook %s dispatch" % name)
            for impl in hook.get_hookimpls():
                f = getattr(impl.function, "__func__", impl.function)
                if not trusted(f):
                    code = getattr(f, "__code__", None)
                    bad.append("hook %s from %s" % (name, getattr(code, "co_filename", "?")))
    return bad
"""

# The pristine files and directories back (see above); conftest.py and pytest configuration files
# (HARNESS names) that are not pristine deleted anywhere; what it changed goes to `changed`.
RESTORE = r"""


def clear(p):  # whatever is at p unless it is a directory (a file, a symlink, a FIFO): True
    if os.path.islink(p) or (os.path.lexists(p) and not os.path.isdir(p)):
        os.unlink(p)
        return True


def make_dirs(rel):  # the directories of rel, each replacing a symlink or file put in its place
    d = root
    for part in [p for p in rel.split("/") if p]:
        d = os.path.join(d, part)
        clear(d)
        os.makedirs(d, exist_ok=True)
    return d


def drop(p):
    changed.append(os.path.relpath(p, root))
    if not clear(p):
        shutil.rmtree(p)


def restore(files, dirs, keep):
    for top in dirs:  # a test directory holds the pristine files and directories, nothing else
        for d, subdirs, names in os.walk(make_dirs(top), onerror=unreadable):
            for name in names + subdirs:
                p = os.path.join(d, name)
                rel = os.path.relpath(p, root)
                if not (rel in keep and not os.path.islink(p) if name in subdirs else rel in files):
                    drop(p)
            subdirs[:] = [n for n in subdirs if os.path.lexists(os.path.join(d, n))]
    for rel, (mode, data) in files.items():
        p = os.path.join(make_dirs(os.path.dirname(rel)), os.path.basename(rel))
        data = base64.b64decode(data)
        same = False
        if os.path.isfile(p) and not os.path.islink(p):  # a regular file: read (a FIFO is not)
            try:
                with open(p, "rb") as f:
                    same = f.read() == data
            except OSError:  # unreadable: replaced
                pass
        if not same:
            changed.append(rel)
        if os.path.isdir(p) and not os.path.islink(p):
            shutil.rmtree(p)
        clear(p)  # a new file, not written through a hard link the model made
        with open(p, "wb") as f:
            f.write(data)
        os.chmod(p, mode)
    for rel in keep:
        make_dirs(rel)
    for d, _, names in os.walk(root, onerror=unreadable):  # pytest's configuration, conftest.py
        for name in set(names) & set(A["harness"]):  # files: the pristine ones only
            if os.path.relpath(os.path.join(d, name), root) not in files:
                drop(os.path.join(d, name))
"""
