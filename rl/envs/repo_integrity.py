"""What keeps the graded run of the `repo` environment honest: two parts of the GRADE program
(`rl/envs/repo_programs.py`), as Python source it splices in. RESTORE puts the pristine test
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
itself), with their code objects, every function of their classes, and the built-in exception
classes (`AssertionError`). `tampered(config)` lists what differs: an object rebound, a code object
swapped (`f.__code__ = ...`), a method added to or removed from one of those classes, a hook
implementation whose code is not from the trainer's site-packages, the GRADE program or a file of
the repository as it was (sha256 of the pristine .py files: a conftest.py, a plugin module that
the tests name; a plugin the model registered, e.g. found through `gc`, or wrote into one is not),
the plugin manager's hook dispatch replaced, or an import finder of the model's (`sys.meta_path`,
`sys.path_importer_cache`) that could serve forged test modules. GRADE checks after collection,
after each test's call (before its report is made) and after pytest returns; a run that fails the
check ends at once and scores 0 (`episode.tamper`, counted in `episode/tamper`). The one change
allowed is pytest's own: its legacypath plugin adds py.path properties to its classes when it
configures. Checking costs about a millisecond (identities; a class's methods are listed again only
when its attribute count changed).

What it cannot see (docs/repo_env.md's caveats): the check runs in the process the model's code
runs in, at those points only. A patch undone between two checks, a module forged into
`sys.modules` ahead of its import, or code that disables the check itself (the GRADE program's
own globals) escape it; closing that needs the outcomes observed from outside the process.
"""

GUARD = r"""
import builtins, hashlib, stat, types
ROOTS = ("pytest", "_pytest", "pluggy", "unittest", "__main__")
LEGACY = os.path.join(SITE, "_pytest", "legacypath.py")
FUNC = (types.FunctionType, classmethod, staticmethod, property)


def parts(v):  # the functions behind a function, classmethod, staticmethod or property
    if isinstance(v, property):
        return [f for f in (v.fget, v.fset, v.fdel) if isinstance(f, types.FunctionType)]
    f = getattr(v, "__func__", v)
    return [f] if isinstance(f, types.FunctionType) else []


def snapshot():
    objs, classes, seen = [], [], set()
    for mname, m in sorted(sys.modules.items()):
        if mname.split(".")[0] not in ROOTS:
            continue
        ns = vars(m)
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
    objs += [("builtins." + k, vars(builtins), k, v) for k, v in vars(builtins).items()
             if isinstance(v, type) and issubclass(v, BaseException)]
    funcs = {id(f): (n, f, f.__code__) for n, _, _, v in reversed(objs) for f in parts(v)}
    finders = {id(f) for f in sys.meta_path} | {type(f) for f in sys.meta_path}
    finders |= {type(f) for f in sys.path_importer_cache.values() if f is not None}
    return objs, methods, list(funcs.values()), finders


def from_site(obj):
    f = getattr(sys.modules.get(getattr(obj, "__module__", None) or ""), "__file__", "") or ""
    return f.startswith(SITE)


def patched(v):
    # pytest's own legacypath plugin adds and replaces methods of Config, Node, Session... when it
    # configures (py.path properties): nothing else may
    fs = parts(v)
    return bool(fs) and all(f.__code__.co_filename == LEGACY for f in fs)


def pristine_code(where, seen={}):
    # whether code from file `where` may implement hooks: the trainer's site-packages, this
    # program, or a file of the repository as it was (its sha256 in A["hashes"], the pristine
    # .py files: a conftest.py put back, a plugin module the tests name), read once
    if where.startswith(SITE) or where == MAIN:
        return True
    if where not in seen:
        rel, h = None, None
        for r in ROOT_AS:
            if where.startswith(r + "/"):
                rel = where[len(r) + 1:]
        try:
            if rel in A["hashes"] and stat.S_ISREG(os.lstat(where).st_mode):  # not a FIFO
                with open(where, "rb") as f:
                    h = hashlib.sha256(f.read()).hexdigest()
        except OSError:
            pass
        seen[where] = h is not None and h == A["hashes"][rel]
    return seen[where]


def tampered(config=None):
    # what differs from SNAP (empty: nothing)
    objs, methods, funcs, finders = SNAP
    bad = [n for n, ns, k, v in objs if ns.get(k) is not v and not patched(ns.get(k))]
    bad += [n for n, f, c in funcs if f.__code__ is not c]
    for n, ns, size, names in methods:
        if len(ns) != size:  # an attribute added or removed: a method?
            now = {k for k, v in ns.items() if isinstance(v, FUNC)}
            if names - now or not all(patched(ns[k]) for k in now - names):
                bad.append(n + " (methods)")
    bad += ["sys.meta_path: %r" % (f,) for f in sys.meta_path
            if id(f) not in finders and type(f) not in finders and not from_site(type(f))]
    bad += ["sys.path_importer_cache[%r]" % (p,) for p, f in sys.path_importer_cache.items()
            if f is not None and type(f) not in finders and not from_site(type(f))]
    if config is not None:
        pm = config.pluginmanager
        bad += ["pluginmanager." + k for k, v in PM.items() if vars(pm).get(k) is not v]
        for name, hook in list(vars(pm.hook).items()):
            if getattr(hook, "_hookexec", None) != getattr(pm, "_hookexec", None):
                bad.append("hook %s dispatch" % name)
            for impl in hook.get_hookimpls():
                code = getattr(getattr(impl.function, "__func__", impl.function), "__code__", None)
                where = getattr(code, "co_filename", "?")
                if not pristine_code(where):
                    bad.append("hook %s from %s" % (name, where))
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
