"""Image tasks of the `repo` environment: an episode whose record names a container image (unpacked
by `python -m launch.images unpack`, rl/sandbox/oci.py) runs its tools and its graded run with the image as
the sandbox's root, in the image's `workdir` (default /testbed), with the image's PATH, env and
python; the trainer's site-packages are not bound.

A record's fields: `image` (a rootfs directory, an unpacked image directory holding rootfs/ and
image.json, or a name resolved as `env.images_dir/<name with / and : replaced by _>`, `:latest`
tried too), `workdir`, `python`. The python is the first of: the record's `python`, the testbed
env (/opt/miniconda3/envs/testbed/bin/python, SWE-bench's), `<workdir>/.venv/bin/python`,
`python3` on the image's PATH, each looked up inside the image (symlinks resolved within it).
Once per image and process, a probe run in the image finds that python's site-packages (where
GRADE imports pytest from, and what the tamper check trusts as pristine) and imports pytest
there, reporting the pytest and pluggy versions: any pytest from 6.2 (MIN_PYTEST) to 9 grades,
on any pluggy it runs with (0.13 to 1.x: GRADE's hook wrappers are old-style). An image that
cannot (no pytest, an older one) is an infrastructure error (masked), with the reason and the
versions in the line; `launch.train` probes each image once at start-up and refuses such an
image before the run starts (`rl.envs.repo.check_record`).

Each episode gets a private writable view of the image; the image's files are never copied or
written. The first of these that works here (`view_mode()`, reported in `episode.view` and
`RepoEnv.image_view`):
- "bwrap-overlay": the image bound read-only as the root and bubblewrap's own overlay over the
  workdir (`--overlay-src IMAGE/WORKDIR --overlay UPPER WORK WORKDIR`, bubblewrap >= 0.9) and a
  private /tmp, when not root (a user namespace shows the image's files as ours: a writable
  root would let the model replace the libraries the graded run loads); untested here
  (bubblewrap 0.8.0);
- "overlayfs": as root, a kernel overlayfs (lower: the image, upper and work: the episode's
  workspace, a tmpfs of `env.workspace_bytes`) mounted at the first tool call and unmounted at the
  end. Mounted with metacopy=on: giving the episode's uid its workdir (chown) copies up metadata
  only. The sandbox binds the merged tree as its root;
- "copy": the image bound read-only as the root and a copy of the workdir alone (plus a private
  /tmp) bound over it: the image's system files are not copied.
In every mode the python's prefixes and site dirs (the probe's sys.prefix, sys.base_prefix and
site dirs; a venv in the workdir from the start) are bound read-only from the image over the
view: the graded run imports pytest and runs .pth files from there before the tamper check's
snapshot, and an image whose env the episode may write (a conda env made world-writable) would
otherwise let the model plant code there.
Programs see the sandbox's helpers (the program, `python`/`python3` links to the image's python)
under /dev/.sandbox, inside the new /dev bubblewrap makes: nothing is created in the image.
"""

from __future__ import annotations

import ctypes
import dataclasses
import hashlib
import json
import os
import posixpath
import shutil
import stat
import subprocess
import threading

from rl.sandbox import boot_command, oci

TESTBED_PYTHON = "/opt/miniconda3/envs/testbed/bin/python"
DEFAULT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
CTL = "/dev/.sandbox"  # the sandbox's helpers inside the view
MODES = ("bwrap-overlay", "overlayfs", "copy")
MIN_PYTEST = (6, 2)  # the oldest pytest grading supports (old-style hook wrappers: any pluggy)
_PROBE = r"""
import json, os, re, sys
import site  # run as the python runs without -S: its venv, its site dirs, their .pth files
site.main()
sites = [p for p in getattr(site, "getsitepackages", lambda: [])() if os.path.isdir(p)]
try:
    import pluggy
    found = "pluggy " + getattr(pluggy, "__version__", "?")
except BaseException:
    found = "no pluggy"
try:
    import pytest
    found = "pytest %s, %s" % (pytest.__version__, found)
    if tuple(int(x) for x in re.findall(r"\d+", pytest.__version__)[:2]) < MIN_PYTEST:
        raise ImportError("grading needs pytest >= %d.%d" % MIN_PYTEST)
    pytest.hookimpl(hookwrapper=True, tryfirst=True)  # the graded run's hook wrappers
except BaseException as e:
    found = found if found.startswith("pytest") else "no pytest, " + found
    print("\npytest cannot be used from %s: %s: %s (found %s, python %s)" % (
        sites, type(e).__name__, e, found, sys.version.split()[0]))
    sys.exit(1)
where = os.path.dirname(os.path.dirname(pytest.__file__))
print("ok " + json.dumps({"site": where, "sites": sites, "prefixes": [sys.prefix, sys.base_prefix],
                          "versions": found}))
""".replace("MIN_PYTEST", repr(MIN_PYTEST))
_libc = ctypes.CDLL(None, use_errno=True)
_MS_NOSUID, _MS_NODEV = 2, 4
_lock = threading.Lock()
_modes: dict[tuple, str] = {}
_sites: dict[tuple, str] = {}  # (rootfs, python, mode) -> "ok <site>" or why the probe failed


@dataclasses.dataclass(frozen=True)
class Image:
    rootfs: str  # host path of the image's root
    name: str
    env: tuple  # the image config's Env, ("K=V", ...), PATH included
    workdir: str  # the repository inside the image (/testbed)
    python: str  # inside the image

    @property
    def env_root(self) -> str:
        """The python's own environment when it lies inside the workdir (a `/testbed/.venv`, as
        R2E-Gym's images have), "" otherwise. Views bind it read-only from the image: the model
        edits the workdir, and a venv it could write (a .pth file, pytest's own modules, the
        interpreter) would run its code in the graded run before the tamper check's snapshot."""
        d = posixpath.dirname(posixpath.dirname(posixpath.normpath(self.python)))
        top = posixpath.normpath(self.workdir)
        return d if d.startswith(top.rstrip("/") + "/") else ""

    @property
    def path(self) -> str:
        return dict(e.split("=", 1) for e in self.env if "=" in e).get("PATH", DEFAULT_PATH)

    def host(self, path: str) -> str | None:
        return in_root(self.rootfs, path)


def in_root(rootfs: str, path: str) -> str | None:
    """The host path of `path` as seen inside the root `rootfs` (symlinks resolved within it, as
    a chroot would); None when it does not exist."""
    parts, done, hops = [p for p in path.split("/") if p], "", 0
    while parts:
        p = parts.pop(0)
        if p == ".":
            continue
        if p == "..":
            done = done.rpartition("/")[0]
            continue
        full = rootfs + done + "/" + p
        try:
            st = os.lstat(full)
        except OSError:
            return None
        if stat.S_ISLNK(st.st_mode):
            hops += 1
            if hops > 40:
                return None
            target = os.readlink(full)
            done = "" if target.startswith("/") else done
            parts = [x for x in target.split("/") if x] + parts
            continue
        done += "/" + p
    return rootfs + done


def resolve(image: str, images_dir: str | None) -> tuple[str, dict]:
    """(rootfs, image.json) of a record's `image`; ValueError when it is not there."""
    cands = [image] if image.startswith(("/", "./", "~")) else []
    if images_dir:
        d = os.path.expanduser(images_dir)
        cands += [os.path.join(d, oci.safe_name(image))]
        cands += [os.path.join(d, oci.safe_name(image + ":latest"))] if ":" not in image else []
    cands += [] if cands and image.startswith("/") else [image]
    for c in cands:
        c = os.path.expanduser(c)
        if os.path.isdir(os.path.join(c, oci.ROOTFS)) and (info := oci.read_info(c)) is not None:
            return os.path.realpath(os.path.join(c, oci.ROOTFS)), info
        if os.path.isdir(c) and os.path.isabs(c):
            return os.path.realpath(c), {}
    raise ValueError(
        f"image {image!r} not found (env.images_dir={images_dir!r}; unpack it with "
        "python -m launch.images unpack SRC --out IMAGES_DIR)"
    )


def find_python(rootfs: str, path: str, workdir: str, python: str = "") -> str:
    """The image's python (module docstring's order); ValueError when it has none."""
    cands = [python] if python else []
    cands += [TESTBED_PYTHON, f"{workdir.rstrip('/')}/.venv/bin/python"]
    cands += [f"{d.rstrip('/')}/python3" for d in path.split(":") if d.startswith("/")]
    for c in cands:
        h = in_root(rootfs, c)
        if h and os.path.isfile(h) and os.stat(h).st_mode & 0o111:
            return c
    raise ValueError(f"no python in image {rootfs} (looked for {', '.join(cands)})")


def load(record: dict, images_dir: str | None) -> Image:
    rootfs, info = resolve(record["image"], images_dir)
    env = tuple(info.get("env") or ())
    env += () if any(e.startswith("PATH=") for e in env) else (f"PATH={DEFAULT_PATH}",)
    workdir = record.get("workdir") or "/testbed"
    probe = Image(rootfs, record["image"], env, workdir, "")
    if not probe.host(workdir) or not os.path.isdir(probe.host(workdir)):
        raise ValueError(f"image {record['image']!r} has no {workdir} (the record's workdir)")
    python = find_python(rootfs, probe.path, workdir, record.get("python") or "")
    image = dataclasses.replace(probe, python=python)
    top = posixpath.normpath(workdir).rstrip("/") + "/"
    if posixpath.normpath(python).startswith(top) and not image.env_root:
        raise ValueError(
            f"image {record['image']!r}: its python {python} lies in the workdir "
            "outside an environment (<workdir>/<env>/bin/python) that the sandbox "
            "keeps read-only: the model could replace it"
        )
    return image


def check(record: dict, mode: str, images_dir: str | None) -> Image:
    """The record's Image, or a ValueError (one line) when it cannot run here: an image needs
    bubblewrap's namespaces (the sandbox mode `mode`), and the image must resolve."""
    if mode != "bwrap":
        raise ValueError(
            f"repo record {record.get('instance_id', '')!r} names image {record['image']!r}: image "
            f"tasks need bubblewrap's namespaces and the sandbox runs in mode {mode!r} "
            "(env.isolation=rlimits); use env.isolation=auto or bwrap"
        )
    return load(record, images_dir)


# ----- the view modes -----


def _bwrap_has_overlay(bwrap: str) -> bool:
    try:
        r = subprocess.run([bwrap, "--help"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return False
    return "--overlay-src" in r.stdout + r.stderr


def _mount_overlay(lower: str, upper: str, work: str, merged: str) -> str:
    """Mounts an overlayfs; "" or why it failed."""
    for extra in (",metacopy=on", ""):
        opts = f"lowerdir={lower},upperdir={upper},workdir={work}{extra}".encode()
        if _libc.mount(b"overlay", merged.encode(), b"overlay", _MS_NOSUID | _MS_NODEV, opts) == 0:
            return ""
        err = os.strerror(ctypes.get_errno())
    return err


def _overlay_works(tmp: str) -> bool:
    d = os.path.join(tmp, ".overlay-probe")
    os.makedirs(d, exist_ok=True)
    try:
        for n in ("lower", "upper", "work", "merged"):
            os.makedirs(os.path.join(d, n), exist_ok=True)
        why = _mount_overlay(*(os.path.join(d, n) for n in ("lower", "upper", "work", "merged")))
        if not why:
            _libc.umount2(os.path.join(d, "merged").encode(), 2)
        return not why
    finally:
        shutil.rmtree(d, ignore_errors=True)


def view_mode(bwrap: str, as_root: bool, tmp: str) -> str:
    """The first view mode that works here (module docstring), probed once per process."""
    key = (bwrap, as_root)
    with _lock:
        if key not in _modes:
            if not as_root and _bwrap_has_overlay(bwrap):
                _modes[key] = "bwrap-overlay"
            elif as_root and _overlay_works(tmp):
                _modes[key] = "overlayfs"
            else:
                _modes[key] = "copy"
        return _modes[key]


def _chown_tree(top: str, uid: int, skip: str = "") -> None:
    """lchown of every entry under `top`, but not under host path `skip` (left as it was)."""
    os.lchown(top, uid, uid)
    for d, dirs, files in os.walk(top):
        dirs[:] = [n for n in dirs if os.path.join(d, n) != skip]
        for n in dirs + files:
            os.lchown(os.path.join(d, n), uid, uid)


class View:
    """An episode's private writable view of `image` in workspace `ws` (its directory: a tmpfs
    when mounted), as sandbox mode `mode` makes it; `command` builds its bubblewrap line."""

    def __init__(self, image: Image, ws, mode: str):
        self.image, self.ws, self.mode, self.mounted, self.site = image, ws, mode, False, ""
        self.versions = ""  # what the probe found: "pytest 7.2.1, pluggy 1.0.0"
        self.sites: list[str] = []  # the python's site dirs (their .pth files run when graded)
        self.keep: list[str] = []  # its prefixes and site dirs: bound read-only (probe)
        self.workdir, p = image.workdir, ws.path
        self.upper, self.work, self.merged = (os.path.join(p, n) for n in ("upper", "work", "root"))
        self.bin = os.path.join(p, "bin")  # python, python3 -> the image's python (CTL/bin)
        os.mkdir(self.bin, 0o755)
        for name in ("python", "python3"):
            os.symlink(image.python, os.path.join(self.bin, name))
        uid = ws.uid
        if mode == "copy":
            self.testbed, self.tmp = os.path.join(p, "testbed"), os.path.join(p, "tmp")
            env_rel = image.env_root[len(self.workdir.rstrip("/")) + 1 :]
            skip = os.path.join(image.host(self.workdir), env_rel) if env_rel else ""
            shutil.copytree(
                image.host(self.workdir),
                self.testbed,
                symlinks=True,
                ignore=lambda d, ns: [n for n in ns if os.path.join(d, n) == skip],
            )
            if env_rel:  # bound read-only from the image (root_args): not copied
                os.makedirs(os.path.join(self.testbed, env_rel))
            os.mkdir(self.tmp, 0o700)
            if uid >= 0:
                _chown_tree(self.testbed, uid)
                os.chown(self.tmp, uid, uid)
            self.host_workdir = self.testbed
            return
        for d in (self.upper, self.work):
            os.mkdir(d, 0o755)
        if mode == "bwrap-overlay":  # bubblewrap mounts it, per run; no host path to read
            self.tmp, self.host_workdir = os.path.join(p, "tmp"), ""
            os.mkdir(self.tmp, 0o700)
            return
        os.mkdir(self.merged, 0o755)
        if why := _mount_overlay(image.rootfs, self.upper, self.work, self.merged):
            raise OSError(f"overlayfs mount failed: {why}")
        self.mounted = True
        self.host_workdir = in_root(self.merged, self.workdir)
        if uid >= 0:  # the episode's uid owns its workdir (metacopy: no data copied up)
            env_rel = image.env_root[len(self.workdir.rstrip("/")) + 1 :]
            skip = os.path.join(self.host_workdir, env_rel) if env_rel else ""
            _chown_tree(self.host_workdir, uid, skip)

    def root_args(self) -> list[str]:
        env = self.image.env_root  # the python's venv inside the workdir: the image's, read-only
        keep = ["--ro-bind", self.image.host(env), env] if env and self.image.host(env) else []
        for d in self.keep:  # and its prefixes and site dirs (probe)
            keep += [] if d == env else ["--ro-bind", self.image.host(d), d]
        if self.mode == "overlayfs":
            return ["--bind", self.merged, "/", *keep]
        if self.mode == "bwrap-overlay":  # the image read-only (in a user namespace the model
            # owns every file of it: /usr/lib's too), the overlay over the workdir alone
            args = [
                "--ro-bind",
                self.image.rootfs,
                "/",
                "--overlay-src",
                self.image.host(self.workdir),
                "--overlay",
                self.upper,
                self.work,
                self.workdir,
                *keep,
            ]
        else:
            args = ["--ro-bind", self.image.rootfs, "/", "--bind", self.testbed, self.workdir]
            args += keep
        tmp = self.image.host("/tmp")
        return args + (["--bind", self.tmp, "/tmp"] if tmp and os.path.isdir(tmp) else [])

    def command(self, sb, main: str) -> list[str]:
        boot = boot_command(self.image.python, self.ws.uid, sb.limits, f"{CTL}/main.py")
        cmd = [sb.bwrap, "--die-with-parent", "--new-session", "--unshare-pid", "--unshare-net"]
        cmd += ["--unshare-ipc", "--unshare-uts", "--unshare-cgroup-try"]
        cmd += [] if sb.as_root else ["--unshare-user"]
        cmd += self.root_args() + ["--proc", "/proc", "--dev", "/dev", "--dir", CTL]
        cmd += ["--ro-bind", main, f"{CTL}/main.py", "--ro-bind", self.bin, f"{CTL}/bin"]
        return cmd + ["--chdir", self.workdir, "--"] + boot

    def env(self, base: dict) -> dict:
        """The programs' environment: the image's, then the sandbox's (HOME, PYTHONPATH...),
        with the helpers' bin first on the image's PATH."""
        own = dict(e.split("=", 1) for e in self.image.env if "=" in e)
        root = self.workdir
        return {
            **own,
            **base,
            "PATH": f"{CTL}/bin:{self.image.path}",
            "PYTHONPATH": f"{root}:{self.site}" if self.site else root,
        }

    def probe(self, sb) -> str:
        """The site-packages the image python imports pytest from (once per image, python and
        mode; the probe runs in this view before the model acts, with the python's `site`
        module as it starts without -S: its venv and site dirs), and all its site dirs
        (`sites`: the graded run processes their .pth files as that python would), and the
        pytest and pluggy versions (`versions`); raises RuntimeError saying why pytest cannot
        load (none, or older than MIN_PYTEST), with the versions found."""
        key = (self.image.rootfs, self.image.python, self.mode)
        with _lock:
            known = _sites.get(key)
        if known is None:
            r = sb.run(_PROBE, self.ws)
            line = r.stdout.rpartition("\npytest cannot be used")[2]  # its versions end it
            out = " ".join(
                (
                    "pytest cannot be used" + line if line != r.stdout else r.stdout + r.stderr
                ).split()
            )[-400:]
            silent = f"the probe ended ({r.reason}, exit status {r.returncode}) without a word"
            known = r.stdout.strip() if r.stdout.startswith("ok ") else out or silent
            with _lock:
                _sites[key] = known
        if not known.startswith("ok "):
            raise RuntimeError(_refusal(self.image, known))
        found, top, env = json.loads(known[3:]), self.workdir.rstrip("/") + "/", self.image.env_root
        mine = [
            d
            for d in found["sites"] + [found["site"]]  # the model's files: never the
            if (d + "/").startswith(top)  # harness's, nor trusted
            and not (env and (d + "/").startswith(env + "/"))
        ]
        if found["site"] in mine:
            raise RuntimeError(
                f"image {self.image.name!r} ({self.image.python}): pytest is "
                f"imported from {found['site']}, in the workdir the model edits"
            )
        self.site, self.sites = found["site"], [d for d in found["sites"] if d not in mine]
        self.versions = found["versions"]
        # The python's prefixes and site dirs are the image's, read-only, in every later run: an
        # image whose env the episode's uid may write (conda envs made world-writable) would let
        # the model plant a .pth file or a pytest that runs before the tamper check.
        dirs = {posixpath.normpath(d) for d in found["prefixes"] + self.sites if d}
        dirs = {d for d in dirs if not top.startswith(d.rstrip("/") + "/") and self.image.host(d)}
        self.keep = sorted(d for d in dirs if not any(d.startswith(k + "/") for k in dirs))
        return self.site

    def disk(self) -> int:
        """Bytes this episode's view holds on its own: the overlay's upper dir, or the copy."""
        from rl.envs.repo.sandbox import disk_usage

        if self.mode == "copy":
            return disk_usage(self.testbed) + disk_usage(self.tmp)
        if self.mode == "bwrap-overlay":
            return disk_usage(self.upper) + disk_usage(self.tmp)
        return disk_usage(self.upper)

    def close(self) -> None:
        if self.mounted:
            from rl.sandbox.sweep import unmount

            unmount(self.merged)
            self.mounted = False


def _refusal(image: Image, why: str) -> str:
    return f"image {image.name!r} ({image.python}): {why}"


def check_grading(image: Image, sb) -> None:
    """Probes `image` (View.probe) in sandbox `sb` (a RepoSandbox of bubblewrap's mode), once per
    image, python and view mode in this process; raises RuntimeError, the probe's line, when its
    python or pytest cannot grade. `launch.train` calls it for every image record at start-up
    (rl.envs.repo.check_record): a run whose images cannot grade would mask every episode."""
    ws = sb.workspace()
    try:
        mode = view_mode(sb.bwrap, sb.as_root, ws.path)
        with _lock:
            known = _sites.get((image.rootfs, image.python, mode))
        if known is not None:
            if not known.startswith("ok "):
                raise RuntimeError(_refusal(image, known))
            return
        view = ws.view = View(image, ws, mode)  # the sandbox runs in the view (RepoSandbox)
        try:
            view.probe(sb)
        finally:
            view.close()
    finally:
        ws.close()


def tree_hash(rootfs: str) -> str:
    """A digest of a tree: every path, its type, mode, owner and content (a link's target)."""
    h = hashlib.sha256()
    for d, dirs, files in os.walk(rootfs):
        dirs.sort()
        for n in sorted(dirs + files):
            p = os.path.join(d, n)
            st = os.lstat(p)
            h.update(f"{os.path.relpath(p, rootfs)}\0{st.st_mode}\0{st.st_uid}\0".encode())
            if stat.S_ISLNK(st.st_mode):
                h.update(os.readlink(p).encode())
            elif stat.S_ISREG(st.st_mode):
                with open(p, "rb") as f:
                    h.update(hashlib.sha256(f.read()).digest())
    return h.hexdigest()
