"""Container images without a daemon: an OCI image layout directory, or a `docker save` tarball,
unpacked into a root filesystem that the `repo` environment's sandbox uses as an episode's root
(rl/envs/repo/images.py). No network, no Docker.

    info = unpack(src, out)     # {"digest", "rootfs", "env", "names", ...}; a second call is free
    safe_name("org/img:tag")    # "org_img_tag": out/org_img_tag links to out/sha256-<hex>

Layout of `out`: `sha256-<hex>/rootfs/` (the image's files) and `sha256-<hex>/image.json` (the
digest, the image config's Env / WorkingDir / User / Cmd, the names), written last: a directory
without it is an unpack that did not finish and is redone. `<hex>` is the manifest's digest (an
OCI layout, or a `docker save` of Docker 25+, which carries one), or for a legacy `docker save`
(manifest.json only) the image id, the config's digest (it lists every layer's diff_id). Each
name of the image (OCI `org.opencontainers.image.ref.name` or `io.containerd.image.name` when a
full reference, not a bare tag such as skopeo's `latest`; docker `RepoTags`; `--name`) gets a
symlink `out/<name with / and : replaced by _>` to it. An unpack works in `out/.tmp-*` and is
renamed into place: two processes unpacking the same image at once both succeed. A source that
holds several images (an OCI layout of several tags, `docker save A B`) needs `ref` (a ref name
or tag; refused in one line listing them otherwise); of an index of platforms, this machine's
linux one is taken (refused, naming those there, when it has none).

Layers are applied in order (gzip or uncompressed tar; a zstd layer is refused), as the OCI image
spec's changeset rules say: `.wh.<name>` deletes `<name>` from the layers below (not its own
layer's), `.wh..wh..opq` empties its directory of what the layers below put there, aufs metadata
(`.wh..wh.plnk/...`) is skipped; a file replaces whatever was at its path. Hard links and symlinks
are kept, symlinks verbatim, absolute ones included (they resolve inside the sandbox's root, where
the rootfs is `/`); device nodes are skipped (what was below them removed all the same), FIFOs
made, setuid/setgid bits dropped (the sandbox's programs never gain privileges; image.json's
`setuid_dropped` lists the files), ownership kept when we are root and left to us otherwise,
modification times kept (the image's .pyc files stay valid). Directory modes are applied at the
end, so a read-only directory can still be filled as non-root. A layer tar is read as Go's
archive/tar (Docker's, containerd's) reads it: one that ends right after its last member's data,
without that member's padding to 512 bytes or the end-of-archive blocks (Debian's umoci 0.4.7
`insert` writes such layers), is whole.

Refused, with one line (`ImageError`: the source, the layer, the member), and nothing left in
`out` (not made when it was not there): a missing source, a member path that is absolute or has a
`..` component, a whiteout naming `.` or `..`, a hard link whose target is outside the root or
missing, a member whose data is cut short (the archive ends inside it) or a header cut short,
any member whose parent path goes through a symlink (an extracted symlink, pointing
anywhere, is never written through: every parent is checked with lstat, files are created with
O_NOFOLLOW|O_EXCL), a blob whose sha256 is not its digest (manifest, config, layers; a legacy
layer against the config's diff_ids), a missing or malformed manifest, config or blob, a loop of
symlinks in a `docker save` tarball.

Why the standard library's tarfile and checks of our own rather than a library: no maintained
Python package applies OCI layers into a runnable root filesystem (umoci, crane and undocker are
Go programs; container-inspector, the one Python candidate, rebuilds layers for software
composition analysis through extractcode, with native archive libraries, and does not keep links,
modes and owners for running the result), and tarfile's `data` filter refuses every absolute
symlink, which real images are full of (/etc/alternatives).
"""

from __future__ import annotations

import contextlib
import dataclasses
import gzip
import hashlib
import io
import json
import os
import platform
import shutil
import stat
import tarfile
import tempfile
import zlib

INFO = "image.json"
ROOTFS = "rootfs"
WHITEOUT, OPAQUE = ".wh.", ".wh..wh..opq"
_INDEX_TYPES = (
    "application/vnd.oci.image.index.v1+json",
    "application/vnd.docker.distribution.manifest.list.v2+json",
)


class ImageError(ValueError):
    """An image that is malformed, hostile or unsupported: one line saying why."""


def safe_name(name: str) -> str:
    """The directory name of an image reference: `/` and `:` replaced by `_`."""
    return name.replace("/", "_").replace(":", "_")


# ----- reading the source: an OCI layout (directory or inside a tar) or a docker save tar -----


class _Source:
    """Blobs of an image source by path: a directory, or the members of a tar."""

    def __init__(self, src: str):
        self.src, self.tar = src, None
        if not os.path.exists(src):
            raise ImageError(f"{src}: no such file or directory")
        if not os.path.isdir(src):
            try:
                self.tar = tarfile.open(src)
            except (OSError, tarfile.TarError) as err:
                raise ImageError(
                    f"{src}: neither an OCI layout directory nor a tar: {err}"
                ) from err
            self.members = {m.name.removeprefix("./"): m for m in self.tar.getmembers()}

    def exists(self, path: str) -> bool:
        if self.tar is None:
            return os.path.isfile(os.path.join(self.src, path))
        return path in self.members

    def open(self, path: str):
        if ".." in path.split("/") or path.startswith("/"):
            raise ImageError(f"{self.src}: blob path {path!r} escapes the image")
        if self.tar is None:
            try:
                return open(os.path.join(self.src, path), "rb")
            except OSError as err:
                raise ImageError(f"{self.src}: {path}: {err.strerror}") from err
        m, hops = self.members.get(path), 0
        while m is not None and m.issym():  # docker save links identical layers
            hops += 1
            if hops > 8:
                raise ImageError(f"{self.src}: {path}: a loop of symlinks")
            m = self.members.get(posixpath_join(posixpath_dir(m.name), m.linkname))
        f = self.tar.extractfile(m) if m is not None else None
        if f is None:
            raise ImageError(f"{self.src}: {path} is missing")
        return f

    def read(self, path: str) -> bytes:
        with self.open(path) as f:
            return f.read()

    def json(self, path: str, digest: str | None = None):
        data = self.read(path)
        if digest is not None:
            _check_digest(data, digest, path)
        try:
            return json.loads(data)
        except ValueError as err:
            raise ImageError(f"{self.src}: {path} is not JSON: {err}") from err

    def close(self) -> None:
        if self.tar is not None:
            self.tar.close()


def posixpath_dir(p: str) -> str:
    return p.rpartition("/")[0]


def posixpath_join(a: str, b: str) -> str:
    return os.path.normpath(os.path.join(a, b)).removeprefix("./") if a else os.path.normpath(b)


def _check_digest(data: bytes, digest: str, what: str) -> None:
    algo, _, want = digest.partition(":")
    if algo != "sha256":
        raise ImageError(f"{what}: digest {digest!r} is not sha256")
    got = hashlib.sha256(data).hexdigest()
    if got != want:
        raise ImageError(f"{what}: digest mismatch (sha256:{got[:16]}... != {digest[:23]}...)")


def _blob(digest: str) -> str:
    algo, _, hexd = digest.partition(":")
    if algo != "sha256" or len(hexd) != 64 or any(c not in "0123456789abcdef" for c in hexd):
        raise ImageError(f"bad digest {digest!r}")
    return f"blobs/sha256/{hexd}"


@dataclasses.dataclass
class _Plan:
    digest: str  # sha256:<hex> naming the result
    config: dict
    layers: list  # [(blob path, expected sha256 digest)], bottom first
    names: list


def host_arch() -> str:
    """This machine's architecture as OCI platforms name it (amd64, arm64, ...)."""
    m = platform.machine().lower()
    return {"x86_64": "amd64", "aarch64": "arm64", "armv7l": "arm", "i686": "386"}.get(m, m)


def _refs(desc: dict) -> list[str]:
    """The names a descriptor of an index gives its image (skopeo: the tag; containerd and
    Docker 25+: the full name too)."""
    a = desc.get("annotations") or {}
    names = [a.get("org.opencontainers.image.ref.name"), a.get("io.containerd.image.name")]
    return [n for n in names if isinstance(n, str) and n]


def _matches(want: str, names: list[str]) -> bool:
    """Whether image reference `want` is one of `names` (`:latest` and docker.io/library/
    implied, as Docker reads them)."""
    full = lambda n: n if ":" in n.rpartition("/")[2] else n + ":latest"  # noqa: E731
    short = lambda n: n.removeprefix("docker.io/").removeprefix("library/")  # noqa: E731
    return any(want == n or full(short(want)) == full(short(n)) for n in names)


def _pick(src: str, ms: list, ref: str, what: str) -> dict:
    """The manifest of `ms` (an index's list) for `ref` (or the only image) and this machine's
    platform; an ImageError naming the choices when it is not one."""
    if ref:
        ms = [m for m in ms if _matches(ref, _refs(m))]
        if not ms:
            raise ImageError(f"{src}: no image named {ref!r} in {what}")
    images = {tuple(_refs(m)) for m in ms if _refs(m)}
    if len(images) > 1:
        names = ", ".join(sorted(r[0] for r in images)[:5]) + (", ..." if len(images) > 5 else "")
        raise ImageError(f"{src}: {what} holds {len(images)} images ({names}): name one with --ref")
    arch, plat = host_arch(), lambda m: m.get("platform") or {}  # noqa: E731
    ok = [
        m
        for m in ms
        if plat(m).get("os", "linux") == "linux" and plat(m).get("architecture", arch) == arch
    ]
    if not ok:
        have = sorted({f"{plat(m).get('os')}/{plat(m).get('architecture')}" for m in ms})
        raise ImageError(f"{src}: {what} has no linux/{arch} image (it has {', '.join(have)})")
    return ok[0]


def _oci_plan(s: _Source, ref: str = "") -> _Plan:
    index = s.json("index.json")
    names, desc = [], None
    seen = 0
    while True:
        ms = index.get("manifests") if isinstance(index, dict) else None
        if not ms or not all(isinstance(m, dict) and "digest" in m for m in ms):
            raise ImageError(
                f"{s.src}: {'index.json' if not seen else 'an index'} lists no manifest"
            )
        desc = _pick(s.src, ms, ref if not seen else "", "index.json" if not seen else "its index")
        # names to link: a full reference; not a bare tag (skopeo's oci:DIR:latest names its
        # image "latest": every image copied so would claim DIR/latest)
        names += [n for n in _refs(desc) if "/" in n or ":" in n][:1]
        if desc.get("mediaType") not in _INDEX_TYPES:
            break
        index, seen = s.json(_blob(desc["digest"]), desc["digest"]), seen + 1
        if seen > 4:
            raise ImageError(f"{s.src}: nested indexes too deep")
    manifest = s.json(_blob(desc["digest"]), desc["digest"])
    try:
        cdesc, layers = manifest["config"], manifest["layers"]
        config = s.json(_blob(cdesc["digest"]), cdesc["digest"])
        layers = [(_blob(d["digest"]), d["digest"]) for d in layers]
    except (KeyError, TypeError) as err:
        raise ImageError(f"{s.src}: malformed manifest {desc['digest']}: {err!r}") from err
    return _Plan(desc["digest"], config, layers, names)


def _docker_plan(s: _Source, ref: str = "") -> _Plan:
    try:
        entries = s.json("manifest.json")
        tags = [list(e.get("RepoTags") or []) for e in entries]
        if ref:
            entries = [e for e, t in zip(entries, tags) if _matches(ref, t)]
            if not entries:
                raise ImageError(f"{s.src}: no image named {ref!r} in manifest.json")
        elif len(entries) > 1:
            names = ", ".join((t or ["<untagged>"])[0] for t in tags[:5])
            raise ImageError(
                f"{s.src}: manifest.json holds {len(entries)} images ({names}"
                f"{', ...' if len(tags) > 5 else ''}): name one with --ref"
            )
        entry = entries[0]
        cpath, lpaths = entry["Config"], entry["Layers"]
    except (KeyError, IndexError, TypeError, AttributeError) as err:
        raise ImageError(f"{s.src}: malformed docker manifest.json: {err!r}") from err
    cdata = s.read(cpath)
    image_id = "sha256:" + hashlib.sha256(cdata).hexdigest()
    stem = os.path.basename(cpath).removesuffix(".json")
    if len(stem) == 64 and stem != image_id[7:]:  # the file is named by its digest
        raise ImageError(f"{s.src}: {cpath}: digest mismatch (sha256:{image_id[7:23]}...)")
    try:
        config = json.loads(cdata)
    except ValueError as err:
        raise ImageError(f"{s.src}: {cpath} is not JSON: {err}") from err
    diff_ids = (config.get("rootfs") or {}).get("diff_ids") or []
    if len(diff_ids) != len(lpaths):
        raise ImageError(f"{s.src}: {len(lpaths)} layers but {len(diff_ids)} diff_ids")
    return _Plan(image_id, config, list(zip(lpaths, diff_ids)), list(entry.get("RepoTags") or []))


def _plan(s: _Source, ref: str = "") -> _Plan:
    if s.exists("index.json") and s.exists("oci-layout"):
        return _oci_plan(s, ref)
    if s.exists("manifest.json"):
        return _docker_plan(s, ref)
    raise ImageError(
        f"{s.src}: no index.json + oci-layout (OCI layout) or manifest.json (docker save)"
    )


# ----- applying layers -----


class _Hashing(io.RawIOBase):
    """A reader that hashes what passes through it (the layer's compressed bytes)."""

    def __init__(self, f):
        self.f, self.h = f, hashlib.sha256()

    def readable(self) -> bool:
        return True

    def readinto(self, b) -> int:
        data = self.f.read(len(b))
        self.h.update(data)
        b[: len(data)] = data
        return len(data)

    def drain(self) -> str:
        while chunk := self.f.read(1 << 20):
            self.h.update(chunk)
        return "sha256:" + self.h.hexdigest()


class _Tail(io.RawIOBase):
    """The layer's tar as tarfile reads it, with zeros after its end up to the next 512-byte
    block (`padded`: the tar was `size` bytes, off a block): tarfile reads a member's padding
    before the next header and refuses an archive without it, which Debian's umoci 0.4.7
    `insert` writes and Go's archive/tar (Docker's, containerd's) reads. Whether the zeros only
    stood in for padding is checked afterwards (`_Layers.check_tail`)."""

    def __init__(self, f):
        self.f, self.size, self.padded, self.left = f, 0, False, 0

    def readable(self) -> bool:
        return True

    def readinto(self, b) -> int:
        if not self.padded:
            data = self.f.read(len(b))
            if data:
                self.size += len(data)
                b[: len(data)] = data
                return len(data)
            self.left = -self.size % tarfile.BLOCKSIZE
            self.padded = self.left > 0
        n = min(self.left, len(b))
        b[:n] = bytes(n)
        self.left -= n
        return n


class _Layers:
    """Applies layer tars onto `root`, refusing what could write outside it."""

    def __init__(self, root: str, what: str):
        self.root, self.what, self.as_root, self.label = root, what, os.geteuid() == 0, ""
        self.name = ""  # the member being applied
        self.setuid: list[str] = []  # files whose setuid / setgid bits were dropped
        self.real_dirs: set[str] = {""}  # relative dirs known to be real directories
        self.dir_modes: dict[str, tuple] = {}  # rel -> (mode, mtime), applied at the end

    def refuse(self, why: str):
        raise ImageError(f"{self.what}: {self.label + ': ' if self.label else ''}{why}")

    def rel(self, name: str, what: str = "member") -> str:
        n = name.removeprefix("./")
        if n.startswith("/") or ".." in n.split("/"):
            self.refuse(f"{what} {name!r} escapes the root")
        n = os.path.normpath(n) if n else "."
        return "" if n == "." else n

    def parent_ok(self, rel: str, make: bool) -> str:
        """The host path of `rel`, after checking that every parent is a real directory (not a
        symlink: nothing is written through one); missing parents are made when `make`."""
        parts = rel.split("/")[:-1]
        cur = ""
        for p in parts:
            cur = f"{cur}/{p}" if cur else p
            if cur in self.real_dirs:
                continue
            full = os.path.join(self.root, cur)
            try:
                st = os.lstat(full)
            except FileNotFoundError:
                if not make:
                    return ""
                os.mkdir(full, 0o755)
                self.real_dirs.add(cur)
                continue
            if stat.S_ISLNK(st.st_mode):  # `rel` is the member's path, or a link's target
                self.refuse(f"member {self.name!r} goes through the symlink {cur!r}")
            if not stat.S_ISDIR(st.st_mode):
                self.refuse(f"member {self.name!r}: parent {cur!r} is not a directory")
            self.real_dirs.add(cur)
        return os.path.join(self.root, rel)

    def remove(self, rel: str) -> None:
        full = os.path.join(self.root, rel)
        with contextlib.suppress(FileNotFoundError):
            if stat.S_ISDIR(os.lstat(full).st_mode):
                _make_writable(full)
                shutil.rmtree(full)
                self.real_dirs = {
                    d for d in self.real_dirs if d != rel and not d.startswith(rel + "/")
                }
                self.dir_modes = {
                    d: m
                    for d, m in self.dir_modes.items()
                    if d != rel and not d.startswith(rel + "/")
                }
            else:
                os.unlink(full)

    def apply(self, fileobj, digest: str, label: str) -> None:
        self.label = ""
        hashing = _Hashing(fileobj)
        reader = io.BufferedReader(hashing, 1 << 20)
        head = reader.peek(4)[:4]
        if head[:4] == b"\x28\xb5\x2f\xfd":
            self.refuse(f"{label}: zstd layers are not supported (gzip or uncompressed tar)")
        stream = gzip.GzipFile(fileobj=reader) if head[:2] == b"\x1f\x8b" else reader
        made: set[str] = set()  # paths this layer wrote: an opaque dir keeps them
        self.label, tail, last = label, _Tail(stream), None
        try:
            with tarfile.open(fileobj=tail, mode="r|") as tar:
                for last in tar:
                    self.member(tar, last, made)
                stream.read()  # to the end of the compressed stream
        except (tarfile.TarError, EOFError, OSError, gzip.BadGzipFile) as err:
            if isinstance(err, ImageError):
                raise
            self.refuse(f"unreadable layer: {type(err).__name__}: {err}")
        if tail.padded:
            self.check_tail(last, tail.size)
        reader.read()
        got = hashing.drain()
        self.label = ""
        if got != digest:
            self.refuse(f"{label}: layer digest mismatch ({got[:23]}... != {digest[:23]}...)")

    def check_tail(self, last: tarfile.TarInfo | None, size: int) -> None:
        """A tar that ends off a 512-byte block (`size` bytes): read as Go's archive/tar reads
        it when its last member is whole and only that member's padding and the end-of-archive
        blocks are missing; refused when the member's data is cut short (the zeros `_Tail` gave
        stood in for it) or a partial block follows it (a header cut short)."""
        if last is None:
            self.refuse(f"the layer is {size} bytes, not a tar")
        stored = last.size if last.isreg() and not last.issparse() else 0
        end = last.offset_data + stored
        if size < end:
            self.refuse(
                f"member {last.name!r}: its data is cut short ({size - last.offset_data} "
                f"of {stored} bytes)"
            )
        if size > end + (-end % tarfile.BLOCKSIZE):
            self.refuse(f"a partial block after member {last.name!r} (the archive is cut short)")

    def member(self, tar, m: tarfile.TarInfo, made: set) -> None:
        self.name = m.name
        rel = self.rel(m.name)
        base = rel.rpartition("/")[2]
        if any(p.startswith(WHITEOUT + WHITEOUT) and p != OPAQUE for p in rel.split("/")):
            return  # aufs metadata (.wh..wh.plnk, .wh..wh.aufs): not the image's files
        if base == OPAQUE:
            d = rel.rpartition("/")[0]
            if self.parent_ok(rel, make=False):
                self.opaque(d, made)
            return
        if base.startswith(WHITEOUT):
            name = base[len(WHITEOUT) :]
            if name in ("", ".", "..") or "/" in name:
                self.refuse(f"whiteout {m.name!r} names no file")
            target = posixpath_join(rel.rpartition("/")[0], name)
            # a whiteout hides what the layers below have, not this layer's own (OCI changesets)
            if target not in made and self.parent_ok(target, make=False):
                self.remove(target)
            return
        if rel == "":  # the root itself: its mode only
            if m.isdir():
                self.dir_modes[""] = (m.mode, m.mtime, m.uid, m.gid)
            return
        full = self.parent_ok(rel, make=True)
        if m.ischr() or m.isblk():  # device nodes: skipped (the sandbox makes its own /dev), but
            self.remove(rel)  # what the layers below had there is replaced all the same
            return
        made.add(rel)
        if m.isdir():
            try:
                st = os.lstat(full)
                if not stat.S_ISDIR(st.st_mode):
                    self.remove(rel)
                    raise FileNotFoundError
            except FileNotFoundError:
                os.mkdir(full, 0o700)
            os.chmod(full, 0o700 | (m.mode & 0o1777))  # writable by us until the end
            self.real_dirs.add(rel)
            self.dir_modes[rel] = (m.mode, m.mtime, m.uid, m.gid)
            return
        self.remove(rel)  # a file, link or FIFO replaces what was there (never follows it)
        if m.issym():
            os.symlink(m.linkname, full)
        elif m.islnk():
            target = self.rel(m.linkname, f"hard link {m.name!r} -> target")
            src = self.parent_ok(target, make=False) if target else ""
            if (
                not src
                or not os.path.lexists(src)
                or os.path.isdir(src)
                and not os.path.islink(src)
            ):
                self.refuse(f"hard link {rel!r} -> {m.linkname!r}: no such file in the image")
            os.link(src, full, follow_symlinks=False)
            return  # shares the target's inode: its mode and owner
        elif m.isfifo():
            os.mkfifo(full, 0o600)
        elif m.isreg():
            fd = os.open(full, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
            with os.fdopen(fd, "wb") as out:
                try:
                    shutil.copyfileobj(tar.extractfile(m), out, 1 << 20)
                except (tarfile.TarError, EOFError, gzip.BadGzipFile, zlib.error) as err:
                    cut = "unexpected end of data" in str(err) or isinstance(err, EOFError)
                    why = "its data is cut short" if cut else "its data is unreadable"
                    self.refuse(f"member {m.name!r}: {why} ({type(err).__name__}: {err})")
        else:
            return  # other types (a GNU sparse or contiguous file is read as a file above)
        self.finish(full, m)

    def finish(self, full: str, m: tarfile.TarInfo, mode: bool = True) -> None:
        if self.as_root:
            os.lchown(full, m.uid, m.gid)
        if not m.issym():
            os.chmod(full, m.mode & 0o1777)  # setuid / setgid dropped (reported)
            if m.mode & 0o6000 and m.isreg():
                self.setuid.append(os.path.relpath(full, self.root))
        os.utime(full, (m.mtime, m.mtime), follow_symlinks=False)

    def opaque(self, d: str, made: set) -> None:
        """Empties directory `d` of what the layers below put there (what this layer made stays)."""
        full = os.path.join(self.root, d)
        if not os.path.isdir(full) or os.path.islink(full):
            return
        for name in os.listdir(full):
            rel = f"{d}/{name}" if d else name
            if rel in made:
                if os.path.isdir(os.path.join(self.root, rel)) and not os.path.islink(
                    os.path.join(self.root, rel)
                ):
                    self.opaque(rel, made)
            elif not any(p.startswith(rel + "/") for p in made):
                self.remove(rel)
            else:
                self.opaque(rel, made)

    def finish_dirs(self) -> None:
        for rel in sorted(self.dir_modes, key=lambda r: -r.count("/") - (r != "")):
            mode, mtime, uid, gid = self.dir_modes[rel]
            full = os.path.join(self.root, rel)
            if self.as_root:
                os.lchown(full, uid, gid)
            os.chmod(full, mode & 0o1777)
            os.utime(full, (mtime, mtime))


def _make_writable(path: str) -> None:
    """u+rwx on every directory under `path` (as non-root, rmtree needs it)."""
    if os.geteuid() == 0:
        return
    for d, dirs, _ in os.walk(path):
        for n in dirs:
            p = os.path.join(d, n)
            if not os.path.islink(p):
                os.chmod(p, os.lstat(p).st_mode | 0o700)


def _digest_dir(out: str, digest: str) -> str:
    return os.path.join(out, digest.replace(":", "-"))


def read_info(image_dir: str) -> dict | None:
    """image.json of an unpacked image directory, None when it has none (not finished)."""
    try:
        with open(os.path.join(image_dir, INFO)) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def unpack(src: str, out: str, names: tuple[str, ...] = (), ref: str = "") -> dict:
    """Unpacks the image at `src` (an OCI layout directory, or a tar: docker save, or an OCI
    layout archived) under `out` (module docstring); its image.json as a dict, with `cached`
    True when it was already there. `ref` picks the image of a source that holds several (an
    OCI index's `org.opencontainers.image.ref.name`, a docker save's RepoTags). Raises
    ImageError, leaving `out` as it was (not made when it was not there)."""
    new_out = not os.path.lexists(out)
    try:
        s = _Source(src)
        os.makedirs(out, exist_ok=True)
    except OSError as err:
        raise ImageError(f"--out {out}: {err.strerror or err}") from err
    except ImageError:
        raise
    try:
        return _unpack(s, src, out, names, ref)
    except ImageError:
        if new_out:
            with contextlib.suppress(OSError):
                os.rmdir(out)
        raise


def _unpack(s: _Source, src: str, out: str, names: tuple, ref: str) -> dict:
    try:
        plan = _plan(s, ref)
        final = _digest_dir(out, plan.digest)
        info = read_info(final)
        cached = info is not None
        if not cached:
            if os.path.lexists(final):  # an unpack that did not finish
                _make_writable(final)
                shutil.rmtree(final)
            tmp = tempfile.mkdtemp(prefix=".tmp-", dir=out)
            try:
                root = os.path.join(tmp, ROOTFS)
                os.mkdir(root, 0o755)
                layers = _Layers(root, src)
                for i, (path, digest) in enumerate(plan.layers):
                    with s.open(path) as f:
                        layers.apply(f, digest, f"layer {i} ({path})")
                layers.finish_dirs()
                cfg = plan.config.get("config") or {}
                info = {
                    "digest": plan.digest,
                    "source": os.path.abspath(src),
                    "setuid_dropped": layers.setuid,
                    "env": list(cfg.get("Env") or []),
                    "workdir": cfg.get("WorkingDir") or "",
                    "user": cfg.get("User") or "",
                    "cmd": cfg.get("Cmd") or [],
                    "architecture": plan.config.get("architecture", ""),
                    "layers": [d for _, d in plan.layers],
                    "names": [],
                }
                with open(os.path.join(tmp, INFO), "w") as f:
                    json.dump(info, f, indent=1)
                try:
                    os.rename(tmp, final)
                except OSError:  # another process finished the same image first
                    if read_info(final) is None:
                        raise
            finally:
                if os.path.lexists(tmp):
                    _make_writable(tmp)
                    shutil.rmtree(tmp, ignore_errors=True)
            info = read_info(final)
    finally:
        s.close()
    all_names = [n for n in (*plan.names, *names) if n]
    for n in all_names:
        link = os.path.join(out, safe_name(n))
        if os.path.realpath(link) != os.path.realpath(final):
            tmp_link = f"{link}.tmp-{os.getpid()}"
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp_link)
            os.symlink(os.path.basename(final), tmp_link)
            os.replace(tmp_link, link)
    if set(all_names) - set(info["names"]):
        info["names"] = sorted(set(info["names"]) | set(all_names))
        fd, tmp_info = tempfile.mkstemp(dir=final, prefix=".info-")
        with os.fdopen(fd, "w") as f:
            json.dump(info, f, indent=1)
        os.replace(tmp_info, os.path.join(final, INFO))
    return {**info, "path": final, "rootfs": os.path.join(final, ROOTFS), "cached": cached}
