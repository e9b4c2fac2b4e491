"""Container images made by the tests, from files they write: layer tars, OCI image layouts and
`docker save` tarballs (the formats rl/oci.py unpacks)."""

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
