"""The three programs of the `repo` environment, as Python source run inside its sandbox: a
shell command (`BASH`), a file edit (`EDITOR`, OpenHands' str_replace_editor) and the graded test
run (`GRADE`). `rl.envs.repo.sandbox.RepoSandbox.program` runs them in an episode's workspace.

Each reads its arguments as JSON on stdin, writes `READY` before it does anything the model
controls and its result (`RESULT` + JSON) last; a run without `READY` means the sandbox could not
start (an infrastructure error), a run that died after it was the model's doing. GRADE imports its
own harness (pytest) before READY, so a sandbox that cannot import it counts as one that did not
start.
"""

from __future__ import annotations

from rl.envs.repo.integrity import GUARD, RESTORE

READY, RESULT = "\x00READY\n", "\x00RESULT "

# The start of every program: its arguments read with the workspace off sys.path, and `result`.
_START = r"""
import os, sys  # frozen and built in: nothing in the workspace can stand in for them
sys.path[:] = [p for p in sys.path if p not in os.environ.get("PYTHONPATH", "").split(":")]
import json  # from the standard library, not a json.py of the model's (the workspace is off)
A = json.loads(sys.stdin.read())
sys.stdin = open(os.devnull)


def result(_fd=1, **kw):
    sys.stdout.flush()
    os.write(_fd, ("\x00RESULT " + json.dumps(kw) + "\n").encode())
    os._exit(0)
"""
# READY: from here on the program touches what the model controls (the workspace, its code).
_GO = r"""
os.write(1, b"\x00READY\n")
os.environ.clear(); os.environ.update(A["env"])
"""
_HEAD = _START + _GO

# A shell command with its own deadline; output is kept as head and tail, the middle counted.
BASH = (
    _HEAD
    + r"""
import collections, selectors, signal, subprocess, time
p = subprocess.Popen(["/bin/bash", "-c", A["command"]], stdin=subprocess.DEVNULL,
                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, cwd=A["root"],
                     start_new_session=True)
head, tail, total, cap = bytearray(), collections.deque(), 0, A["keep"]
deadline, timed_out, ended = time.monotonic() + A["timeout"], False, None
sel = selectors.DefaultSelector()
sel.register(p.stdout, selectors.EVENT_READ)
while True:
    now = time.monotonic()
    if now > deadline:
        timed_out = True
        break
    if ended is None and p.poll() is not None:
        ended = now  # a background job may hold the pipe open: read what is there, then stop
    if ended is not None and now - ended > 0.2:
        break
    if not sel.select(0.05):
        continue
    chunk = os.read(p.stdout.fileno(), 1 << 16)
    if not chunk:
        break
    total += len(chunk)
    room = max(0, cap - len(head))
    head += chunk[:room]
    if chunk[room:]:
        tail.append(chunk[room:])
        size = sum(map(len, tail))
        while tail and size - len(tail[0]) >= cap:
            size -= len(tail.popleft())
if not timed_out:  # EOF can come before bash has quite exited
    try:
        p.wait(max(0.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        timed_out = True
try:
    os.killpg(p.pid, signal.SIGKILL)
except OSError:
    pass
rc = p.wait()
t = b"".join(tail)[-cap:]
result(rc=None if timed_out else rc, head=head.decode("utf-8", "replace"),
       tail=t.decode("utf-8", "replace"), total=total, shown=len(head) + len(t))
"""
)

# str_replace_editor: OpenHands' / R2E-Gym's commands, messages and refusals.
EDITOR = (
    _HEAD
    + r"""
root, cmd, path = os.path.realpath(A["root"]), A.get("command"), A.get("path")


def fail(msg):
    result(ok=False, output=msg)


def numbered(text, start=1):
    return "\n".join("%6d\t%s" % (i, line) for i, line in enumerate(text.split("\n"), start))


def snippet(text, line, extra):
    lines = text.split("\n")
    lo, hi = max(0, line - 4), min(len(lines), line + extra + 4)
    return numbered("\n".join(lines[lo:hi]), lo + 1)


def read(p):
    with open(p, encoding="utf-8") as f:
        return f.read()


def write(p, text):
    with open(p, "w", encoding="utf-8") as f:
        f.write(text)


def need_str(name, required=True):
    v = A.get(name)
    if v is None and not required:
        return None
    if not isinstance(v, str):
        fail("Parameter `%s` is required for command: %s (a string)." % (name, cmd))
    return v


if cmd not in ("view", "create", "str_replace", "insert", "undo_edit"):
    fail("Unrecognized command %r. The allowed commands for the str_replace_editor tool are: "
         "view, create, str_replace, insert, undo_edit" % (cmd,))
if not isinstance(path, str) or not path:
    fail("Parameter `path` is required for command: %s." % cmd)
full = os.path.realpath(path if os.path.isabs(path) else os.path.join(root, path))
if full != root and not full.startswith(root + "/"):
    fail("The path %s is outside the repository at %s; only paths inside it are allowed."
         % (path, root))
try:
    if cmd == "create":
        text = need_str("file_text")
        if os.path.exists(full):
            fail("File already exists at: %s. Cannot overwrite files using command `create`."
                 % path)
        os.makedirs(os.path.dirname(full), exist_ok=True)
        write(full, text)
        result(ok=True, output="File created successfully at: %s" % path, undo=[full, None])
    if cmd != "view" and not os.path.isfile(full):
        fail("The path %s does not exist or is not a file." % path)
    if cmd == "view":
        if os.path.isdir(full):
            if A.get("view_range") is not None:
                fail("The `view_range` parameter is not allowed when `path` points to a "
                     "directory.")
            items = []
            for d, dirs, files in os.walk(full):
                depth = d[len(full):].count("/")
                dirs[:] = sorted(x for x in dirs if not x.startswith(".")) if depth < 2 else []
                items += [os.path.join(d, x) for x in sorted(dirs + files)
                          if not x.startswith(".")]
            intro = "Here's the files and directories up to 2 levels deep in %s, excluding "
            result(ok=True, output=intro % path + "hidden items:\n" + "\n".join(
                sorted(items)))
        if not os.path.isfile(full):
            fail("The path %s does not exist." % path)
        text, vr, start = read(full), A.get("view_range"), 1
        if vr is not None:
            lines = text.split("\n")
            if (not isinstance(vr, list) or len(vr) != 2
                    or not all(isinstance(x, int) for x in vr)):
                fail("Invalid `view_range`: it should be a list of two integers.")
            a, b = vr
            if not 1 <= a <= len(lines):
                fail("Invalid `view_range`: %s. Its first element `%d` should be within the "
                     "range of lines of the file: [1, %d]" % (vr, a, len(lines)))
            if b != -1 and not a <= b <= len(lines):
                fail("Invalid `view_range`: %s. Its second element `%d` should be -1 or "
                     "within [%d, %d]" % (vr, b, a, len(lines)))
            text, start = "\n".join(lines[a - 1:] if b == -1 else lines[a - 1:b]), a
        result(ok=True, output="Here's the result of running `cat -n` on %s:\n%s\n"
               % (path, numbered(text, start)))
    old = read(full)
    if cmd == "str_replace":
        old_str, new_str = need_str("old_str"), need_str("new_str", False) or ""
        n = old.count(old_str)
        if n == 0:
            fail("No replacement was performed, old_str `%s` did not appear verbatim in %s."
                 % (old_str, path))
        if n > 1:
            at, i = [], old.find(old_str)
            while i >= 0:
                at.append(old.count("\n", 0, i) + 1)
                i = old.find(old_str, i + 1)
            fail("No replacement was performed. Multiple occurrences of old_str `%s` in lines "
                 "%s. Please ensure it is unique." % (old_str, at))
        new = old.replace(old_str, new_str)
        write(full, new)
        line = old.split(old_str)[0].count("\n")
        result(ok=True, undo=[full, old], output="The file %s has been edited. Here's the "
               "result of running `cat -n` on a snippet of %s:\n%s\nReview the changes and "
               "make sure they are as expected. Edit the file again if necessary."
               % (path, path, snippet(new, line, new_str.count("\n"))))
    if cmd == "insert":
        new_str, at = need_str("new_str"), A.get("insert_line")
        lines = old.split("\n")
        if not isinstance(at, int) or not 0 <= at <= len(lines):
            fail("Invalid `insert_line` parameter: %r. It should be within the range of lines "
                 "of the file: [0, %d]" % (at, len(lines)))
        new = "\n".join(lines[:at] + new_str.split("\n") + lines[at:])
        write(full, new)
        result(ok=True, undo=[full, old], output="The file %s has been edited. Here's the "
               "result of running `cat -n` on a snippet of the edited file:\n%s\nReview the "
               "changes and make sure they are as expected (correct indentation, no duplicate "
               "lines, etc). Edit the file again if necessary."
               % (path, snippet(new, at, new_str.count("\n"))))
    if cmd == "undo_edit":
        if A.get("restore") is None:
            fail("No edit history found for %s." % path)
        restore = A["restore"][1]
        if restore is None:
            os.unlink(full)
            result(ok=True, output="Last edit to %s undone successfully (the file was created "
                   "by it and is removed)." % path)
        write(full, restore)
        result(ok=True, output="Last edit to %s undone successfully. Here's the result of "
               "running `cat -n` on %s:\n%s\n" % (path, path, numbered(restore)))
except (OSError, UnicodeError) as e:
    fail("%s: %s" % (type(e).__name__, e))
"""
)

# The graded run. Before READY it imports its harness (pytest and its built-in plugins, from the
# trainer's site-packages: a sandbox that cannot is an infrastructure error, masked) and the
# guard (rl/envs/repo/integrity.py) snapshots it. Then it puts back the pristine test files, every
# file of their test directories, conftest.py and pytest configuration files, deleting any other
# there or of those names, and runs pytest on the node ids in this process under alarms over the
# parts of collection that import the model's code and over each test, the guard checking the
# harness after collection, each test's call and teardown, and the run. Its phase goes to a copy
# of the real stdout: `PHASE <restore|start|collect|configure|test|run> <time.monotonic()>`
# (the host's clock too: the host tells the model's code outliving its alarm, its fault, from a
# slow harness, masked).
GRADE = (
    _START
    + r"""
import base64, shutil, signal, tempfile, time
# pytest from the site, now; the workspace joins once pytest has started
if A.get("sites"):  # an image's python: its site dirs in its order and their .pth files, as its
    import site as _site  # site module adds them; what those add in the workspace joins later
    _had = list(sys.path)
    for _d in A["sites"]:
        _site.addsitedir(_d)
    LATER = [p for p in sys.path if p not in _had and p not in A["sites"]
             and (p + "/").startswith(A["root"] + "/")]
    sys.path[:] = [p for p in sys.path if p not in LATER]
else:
    sys.path[:0], LATER = [A["site"]], []
import unittest, pytest, _pytest.config
for name in _pytest.config.default_plugins:
    __import__("_pytest." + name)  # what pytest.main imports, before the model's code can run
OUT, SITE, PM, root = os.dup(1), os.path.join(A["site"], ""), {}, A["root"]
"""
    + GUARD
    + RESTORE
    + r"""


def phase(name):
    os.write(OUT, ("\x00PHASE %s %.3f\n" % (name, time.monotonic())).encode())


def unreadable(err):
    raise err  # a directory the model made unreadable: no file of it escapes the walk


reports, broken, internal, collected, changed = {}, [], [], set(), []


def guard(config=None, classes=(), lent=True):  # the run ends here, scored 0, when the harness
    try:  # was changed (see tampered)
        bad = tampered(config, classes, lent)
    except Exception as e:  # what it reads was made unreadable: changed too
        bad = ["the check: %s: %s" % (type(e).__name__, e)]
    if bad:
        result(OUT, exit=-1, passed={}, broken=broken, internal=internal, missing=[],
               restored=changed[:20], tamper=bad[:10])


def alarm(*_):
    raise TimeoutError("the test ran longer than %s s" % A["per_test"])


def collect_alarm(*_):
    raise TimeoutError("importing and collecting the tests took longer than %s s" % A["per_test"])


class Collect:
    # Old-style hook wrappers (hookwrapper=True: pluggy 0.x to 1.x, so pytest 6.2 to 9): the
    # wrapper gets the outcome, never the exception, and cannot change it.
    # Collection's alarms time the code that imports the model's: the root conftest.py's import
    # (once pytest itself has started: its imports, installed plugins), then collection proper.
    @pytest.hookimpl(hookwrapper=True, tryfirst=True)
    def pytest_load_initial_conftests(self, early_config):
        PM.update((k, v) for k, v in vars(early_config.pluginmanager).items() if "hookexec" in k)
        CONFIG.append(early_config)  # how pytest rewrites asserts (the guard compiles so too)
        phase("collect")
        sys.path.insert(0, root)
        sys.path += [p for p in LATER if p not in sys.path]
        signal.signal(signal.SIGALRM, collect_alarm)
        signal.alarm(A["per_test"])
        try:
            outcome = yield
        finally:
            signal.alarm(0)
            phase("configure")
        e = outcome.excinfo[1] if outcome.excinfo else None
        if isinstance(e, Exception):  # the root conftest.py failed or hung at import: exit 4
            broken.append(os.path.relpath(str(getattr(e, "path", "conftest.py")), root))

    @pytest.hookimpl(tryfirst=True)
    def pytest_collection(self, session):
        phase("collect")
        signal.alarm(A["per_test"])

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_call(self, item):
        phase("test")
        signal.signal(signal.SIGALRM, alarm)
        signal.alarm(A["per_test"])
        try:
            yield
        finally:
            signal.alarm(0)  # checked before the call's report is made; builtins (which a
            own = [item.cls] if getattr(item, "cls", None) in CLASSES else []
            guard(item.config, own, lent=False)  # monkeypatch may lend) after its teardown
            phase("run")

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_teardown(self, item, nextitem):
        try:
            yield
        finally:
            guard(item.config)

    def pytest_collection_finish(self, session):
        signal.alarm(0)
        guard(session.config, CLASSES)
        phase("run")

    def pytest_runtest_logreport(self, report):
        reports.setdefault(report.nodeid, []).append((report.when, report.outcome))

    def pytest_collection_modifyitems(self, config, items):
        keep = [i for i in items if i.nodeid in wanted]
        collected.update(i.nodeid for i in keep)
        CLASSES[:] = {i.cls for i in keep if isinstance(getattr(i, "cls", None), type)
                      and issubclass(i.cls, TESTCASE)}  # their assertions are checked too
        config.hook.pytest_deselected(items=[i for i in items if i.nodeid not in wanted])
        items[:] = keep

    def pytest_collectreport(self, report):
        if not report.passed:  # e.g. the model broke an import (or it skips): its fault
            broken.append(report.nodeid)

    def pytest_internalerror(self, excrepr, excinfo):
        internal.append(excinfo.typename)  # TimeoutError: an alarm inside pytest


SNAP = snapshot()  # the harness as imported, before the model's code: what guard() compares to
"""
    + _GO
    + r"""
phase("restore")
restore(A["files"], A["dirs"], set(A["keep"]))
ROOT_AS = (root, os.path.realpath(root))  # after the restore: no symlink of the model's in it
os.chdir(root)
sys.pycache_prefix = tempfile.mkdtemp()  # no bytecode of the model's stands in for a source
# Whole files, deselecting the other tests: with node ids, one file that fails to import would
# stop the run before the other files' tests ran ("not found").
wanted = set(A["nodes"])
files = sorted({n.split("::")[0] for n in wanted})
phase("start")
code = pytest.main(["-q", "--tb=short", "-p", "no:cacheprovider", "--rootdir", root,
                    "--continue-on-collection-errors", *files], plugins=[Collect()])
guard()
passed = {n: ("call", "passed") in r and not any(o == "failed" for _, o in r)
          for n, r in reports.items()}
result(exit=int(code), passed=passed, broken=broken, internal=internal,
       missing=sorted(wanted - collected), restored=changed[:20])
"""
)
