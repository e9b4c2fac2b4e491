"""Container images made by the tests, from files they write: layer tars, OCI image layouts and
`docker save` tarballs (the formats rl/sandbox/oci.py unpacks)."""

import gzip
import hashlib
import io
import json
import os
import tarfile

MTIME = 1_700_000_000


def layer(entries, compress=False) -> bytes:
    """A layer tar of `entries`: (name, kind, payload, mode) with kind file (payload bytes), dir,
    sym (payload the target), link (a hard link, payload the target member), fifo, chr."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for name, kind, payload, mode in entries:
            m = tarfile.TarInfo(name)
            m.mode, m.mtime, m.uid, m.gid = mode, MTIME, 0, 0
            data = None
            if kind == "file":
                m.size, data = len(payload), io.BytesIO(payload)
            else:
                m.type = {"dir": tarfile.DIRTYPE, "sym": tarfile.SYMTYPE, "fifo": tarfile.FIFOTYPE,
                          "link": tarfile.LNKTYPE, "chr": tarfile.CHRTYPE}[kind]  # fmt: skip
                m.linkname = payload if kind in ("sym", "link") else ""
            tar.addfile(m, data)
    raw = buf.getvalue()
    return gzip.compress(raw, mtime=0) if compress else raw


def _sha(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


def _put(blobs: str, data: bytes) -> str:
    digest = _sha(data)
    with open(os.path.join(blobs, digest[7:]), "wb") as f:
        f.write(data)
    return digest


def image_config(layers, env=("PATH=/usr/local/bin:/usr/bin:/bin",), workdir="/testbed") -> dict:
    diff_ids = [_sha(gzip.decompress(x) if x[:2] == b"\x1f\x8b" else x) for x in layers]
    return {"architecture": "amd64", "os": "linux",
            "config": {"Env": list(env), "WorkingDir": workdir, "Cmd": ["/bin/bash"]},
            "rootfs": {"type": "layers", "diff_ids": diff_ids}}  # fmt: skip


def write_oci(path, layers, config=None, ref="latest", layer_digests=None) -> str:
    """An OCI image layout at `path`; its manifest digest. `layer_digests` overrides the digests
    the manifest gives the layers (a mismatch)."""
    blobs = os.path.join(path, "blobs", "sha256")
    os.makedirs(blobs, exist_ok=True)
    config = config or image_config(layers)
    cdata = json.dumps(config).encode()
    descs = []
    for i, x in enumerate(layers):
        d = _put(blobs, x)
        if i in (layer_digests or {}):  # the bytes stored under another digest
            os.rename(os.path.join(blobs, d[7:]), os.path.join(blobs, layer_digests[i][7:]))
        gz = x[:2] == b"\x1f\x8b"
        descs.append({"mediaType": "application/vnd.oci.image.layer.v1.tar" + ("+gzip" if gz else ""),
                      "digest": (layer_digests or {}).get(i, d), "size": len(x)})  # fmt: skip
    manifest = {"schemaVersion": 2, "mediaType": "application/vnd.oci.image.manifest.v1+json",
                "config": {"mediaType": "application/vnd.oci.image.config.v1+json",
                           "digest": _put(blobs, cdata), "size": len(cdata)},
                "layers": descs}  # fmt: skip
    mdata = json.dumps(manifest).encode()
    mdigest = _put(blobs, mdata)
    index = {"schemaVersion": 2, "manifests": [{
        "mediaType": "application/vnd.oci.image.manifest.v1+json", "digest": mdigest,
        "size": len(mdata), "annotations": {"org.opencontainers.image.ref.name": ref}}]}  # fmt: skip
    with open(os.path.join(path, "index.json"), "w") as f:
        json.dump(index, f)
    with open(os.path.join(path, "oci-layout"), "w") as f:
        json.dump({"imageLayoutVersion": "1.0.0"}, f)
    return mdigest


def write_docker_save(path, layers, tags=("img:latest",), config=None) -> str:
    """A legacy `docker save` tarball (manifest.json, <id>/layer.tar, <config id>.json); its image
    id (the config's digest)."""
    config = config or image_config(layers)
    cdata = json.dumps(config).encode()
    image_id = _sha(cdata)
    files = {f"{image_id[7:]}.json": cdata}
    paths = []
    for x in layers:
        raw = gzip.decompress(x) if x[:2] == b"\x1f\x8b" else x
        lid = _sha(raw)[7:]
        files[f"{lid}/layer.tar"], files[f"{lid}/VERSION"] = raw, b"1.0"
        paths.append(f"{lid}/layer.tar")
    files["manifest.json"] = json.dumps(
        [{"Config": f"{image_id[7:]}.json", "RepoTags": list(tags), "Layers": paths}]
    ).encode()
    with tarfile.open(path, "w") as tar:
        for name, data in files.items():
            m = tarfile.TarInfo(name)
            m.size, m.mtime = len(data), MTIME
            tar.addfile(m, io.BytesIO(data))
    return image_id


def tree(root) -> dict:
    """{relative path: (kind, mode, payload)} of a directory tree (lstat; payload: bytes of a
    file, target of a symlink), and the hard-link groups as ("inode", sorted paths)."""
    out, inodes = {}, {}
    for d, dirs, files in os.walk(root):
        for n in dirs + files:
            p = os.path.join(d, n)
            rel, st = os.path.relpath(p, root), os.lstat(p)
            mode = st.st_mode & 0o7777
            if os.path.islink(p):
                out[rel] = ("sym", None, os.readlink(p))
            elif os.path.isdir(p):
                out[rel] = ("dir", mode, None)
            elif os.path.isfile(p):
                out[rel] = ("file", mode, open(p, "rb").read())
                inodes.setdefault(st.st_ino, []).append(rel)
            else:
                out[rel] = ("other", mode, None)
    links = sorted(sorted(v) for v in inodes.values() if len(v) > 1)
    return out, links


# ----- a runnable test image: the host's interpreter and standard library, its own pytest -----

PREFIX = "/opt/miniconda3/envs/testbed"  # SWE-bench's testbed env: the python the env probes
_SKIP = {"test", "site-packages", "idlelib", "tkinter", "turtledemo", "ensurepip", "lib2to3"}
_TOOLS = ("bash", "sh", "cat", "ls", "head", "rm", "sleep", "seq", "env", "mkdir", "cp", "nohup",
          "grep", "true", "echo", "sed", "du", "id", "tail", "wc", "mv")  # fmt: skip
SITE_PACKAGES = ("_pytest", "pytest", "pluggy", "iniconfig", "packaging", "pygments")


def _add(tar, host, name, mode=None):
    m = tar.gettarinfo(host, name)
    m.uid = m.gid = 0
    m.uname = m.gname = "root"
    if mode is not None:
        m.mode = mode
    if m.isreg():
        with open(host, "rb") as f:
            tar.addfile(m, f)
    else:
        tar.addfile(m)


def _add_dir(tar, name, mode=0o755):
    m = tarfile.TarInfo(name)
    m.type, m.mode, m.mtime = tarfile.DIRTYPE, mode, MTIME
    tar.addfile(m)


def _file(tar, name, data: bytes, mode=0o644):
    m = tarfile.TarInfo(name)
    m.size, m.mode, m.mtime = len(data), mode, MTIME
    tar.addfile(m, io.BytesIO(data))


def _add_tree(tar, host, name, skip=(), keep=lambda n: True):
    _add_dir(tar, name)
    for d, dirs, files in os.walk(host):
        dirs[:] = sorted(x for x in dirs if x not in skip)
        rel = os.path.relpath(d, host)
        base = name if rel == "." else f"{name}/{rel}"
        for x in dirs:
            _add_dir(tar, f"{base}/{x}")
        for x in sorted(files):
            if keep(x):
                _add(tar, os.path.join(d, x), f"{base}/{x}")


def python_image(path, testbed: dict, marker: bytes, workdir="/testbed", site=None) -> str:
    """An OCI layout at `path` of a runnable image: layer 1 the host's interpreter (at PREFIX),
    its standard library (no site-packages, no tests) and the shared libraries it and a few
    shell tools need; layer 2 the image's own site-packages (pytest and its dependencies copied
    from the trainer's venv, or every file of the directory `site`: wheels unpacked there,
    tests/rl/pytest_wheels.py; `imagemark`, a module only the image has, and a .pth file naming
    /opt/pthlib, which holds `pthmark`), the repository `testbed` ({path: bytes}) at `workdir`
    and a venv at `<workdir>/.venv` over the base python, whose own `imagemark` says "venv". Its
    manifest digest. Layer 1 is made once per process."""
    import sys

    import pytest as _pytest_mod

    ver = f"python{sys.version_info.major}.{sys.version_info.minor}"
    system = _system_layer()
    here = os.path.dirname(os.path.dirname(_pytest_mod.__file__))
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        sp = f"{PREFIX[1:]}/lib/{ver}/site-packages"
        _add_dir(tar, sp, 0o777)  # world-writable, as some conda images are: the view keeps it
        if site is not None:
            for x in sorted(x for x in os.listdir(site) if not x.startswith(".")):
                if os.path.isdir(os.path.join(site, x)):
                    _add_tree(tar, os.path.join(site, x), f"{sp}/{x}", {"__pycache__"})
                else:
                    _add(tar, os.path.join(site, x), f"{sp}/{x}")
        for pkg in SITE_PACKAGES if site is None else ():
            _add_tree(tar, os.path.join(here, pkg), f"{sp}/{pkg}", {"__pycache__"})
            for x in os.listdir(here):
                if x.startswith(pkg + "-") and x.endswith(".dist-info"):
                    _add_tree(tar, os.path.join(here, x), f"{sp}/{x}")
        if site is None:
            _add(tar, os.path.join(here, "py.py"), f"{sp}/py.py")  # pytest's shim of py
        _file(tar, f"{sp}/imagemark.py", marker)
        _file(tar, f"{sp}/imagepth.pth", b"/opt/pthlib\n")  # a .pth file: graded runs read it
        _add_dir(tar, "opt/pthlib")
        _file(tar, "opt/pthlib/pthmark.py", b'WHERE = "pth"\n')
        _add_dir(tar, workdir[1:])
        # a venv in the workdir, as R2E-Gym's images have (a record names its python): the base
        # python's site-packages included, its own imagemark first
        venv = f"{workdir[1:]}/.venv"
        for d in ("", "/bin", "/lib", f"/lib/{ver}", f"/lib/{ver}/site-packages"):
            _add_dir(tar, venv + d)
        cfg = f"home = {PREFIX}/bin\ninclude-system-site-packages = true\n"
        _file(tar, f"{venv}/pyvenv.cfg", cfg.encode())
        m = tarfile.TarInfo(f"{venv}/bin/python")
        m.type, m.linkname, m.mode, m.mtime = tarfile.SYMTYPE, f"{PREFIX}/bin/{ver}", 0o777, MTIME
        tar.addfile(m)
        _file(tar, f"{venv}/lib/{ver}/site-packages/imagemark.py", b'WHERE = "venv"\n')
        for rel, data in sorted(testbed.items()):
            parts = rel.split("/")
            for i in range(1, len(parts)):
                _add_dir(tar, f"{workdir[1:]}/{'/'.join(parts[:i])}")
            _file(tar, f"{workdir[1:]}/{rel}", data)
    top = buf.getvalue()
    env = ("PATH=/usr/local/bin:/usr/bin:/bin", "LANG=C.UTF-8", "IMAGE_ENV=from-the-image")
    return write_oci(path, [system, top], image_config([system, top], env, workdir))


_SYSTEM: list[bytes] = []


def _system_layer() -> bytes:
    """Layer 1 of python_image: the host's interpreter, standard library and shared libraries."""
    import subprocess
    import sys
    import sysconfig

    if _SYSTEM:
        return _SYSTEM[0]
    base = sys.base_prefix
    ver = f"python{sys.version_info.major}.{sys.version_info.minor}"
    stdlib, exe = sysconfig.get_paths()["stdlib"], os.path.realpath(sys.executable)
    dynload = os.path.join(stdlib, "lib-dynload")
    tools = [os.path.realpath(subprocess.check_output(["bash", "-c", f"type -P {t}"],
                                                      text=True).strip()) for t in _TOOLS]  # fmt: skip
    objs = [exe, *tools] + [os.path.join(dynload, x) for x in os.listdir(dynload)]
    out = subprocess.run(["ldd", *objs], capture_output=True, text=True).stdout
    libs = sorted(
        {
            w
            for line in out.splitlines()
            if "=>" in line or line.startswith("\t/")
            for w in line.split()
            if w.startswith("/") and os.path.exists(w)
        }
    )
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for d in ("usr", "usr/bin", "usr/lib", "usr/lib/x86_64-linux-gnu", "usr/lib64", "etc",
                  "opt", "opt/miniconda3", "opt/miniconda3/envs", PREFIX[1:], PREFIX[1:] + "/bin",
                  PREFIX[1:] + "/lib", "proc", "dev", "root"):  # fmt: skip
            _add_dir(tar, d, 0o700 if d == "root" else 0o755)
        _add_dir(tar, "tmp", 0o1777)
        for link, target in (("bin", "usr/bin"), ("lib", "usr/lib"), ("lib64", "usr/lib64")):
            m = tarfile.TarInfo(link)
            m.type, m.linkname, m.mode, m.mtime = tarfile.SYMTYPE, target, 0o777, MTIME
            tar.addfile(m)
        for name, t in zip(_TOOLS, tools):
            _add(tar, t, "usr/bin/" + name)
        for lib in libs:
            real = os.path.realpath(lib)
            where = lib.replace("/lib64/", "/usr/lib64/", 1) if lib.startswith("/lib64/") else lib
            where = where.replace("/lib/", "/usr/lib/", 1) if where.startswith("/lib/") else where
            _add(tar, real, where[1:])
        libpy = os.path.join(base, "lib", f"lib{ver}.so.1.0")
        if os.path.exists(libpy):
            _add(tar, os.path.realpath(libpy), f"usr/lib/x86_64-linux-gnu/lib{ver}.so.1.0")
        _add(tar, exe, f"{PREFIX[1:]}/bin/{ver}")
        for link in ("python", "python3"):
            m = tarfile.TarInfo(f"{PREFIX[1:]}/bin/{link}")
            m.type, m.linkname, m.mode, m.mtime = tarfile.SYMTYPE, ver, 0o777, MTIME
            tar.addfile(m)
        m = tarfile.TarInfo("usr/bin/python3")  # an absolute link, as /etc/alternatives has
        m.type, m.linkname, m.mode, m.mtime = tarfile.SYMTYPE, f"{PREFIX}/bin/{ver}", 0o777, MTIME
        tar.addfile(m)
        keep_pyc = lambda n: not n.endswith(".pyc") or ".opt-" not in n
        _add_tree(tar, stdlib, f"{PREFIX[1:]}/lib/{ver}", _SKIP, keep_pyc)
    _SYSTEM.append(buf.getvalue())
    return _SYSTEM[0]
