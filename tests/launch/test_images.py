"""`python -m launch.images unpack` (rl/sandbox/oci.py): OCI layouts and `docker save` tarballs made here
from the test's own files unpack into the expected tree, file by file with modes (two layers, a
whiteout, an opaque directory, a hard link, symlinks kept verbatim), a second unpack is free, and
each hostile archive is refused with one line, leaving nothing behind."""

import os

import pytest

from launch.images import main
from rl.sandbox.oci import ImageError, safe_name, unpack
from tests.rl.image_helpers import layer, tree, write_docker_save, write_oci

BOTTOM = layer([
    ("etc", "dir", None, 0o755),
    ("etc/hosts", "file", b"127.0.0.1 old\n", 0o644),
    ("etc/alternatives", "dir", None, 0o755),
    ("etc/alternatives/tool", "sym", "/usr/bin/tool", 0o777),  # absolute: kept verbatim
    ("usr", "dir", None, 0o755),
    ("usr/bin", "dir", None, 0o755),
    ("usr/bin/tool", "file", b"#!/bin/sh\necho tool\n", 0o4755),  # setuid: dropped
    ("bin", "sym", "usr/bin", 0o777),
    ("opt", "dir", None, 0o755),
    ("opt/old", "dir", None, 0o750),
    ("opt/old/a", "file", b"a", 0o644),
    ("opt/old/sub", "dir", None, 0o755),
    ("opt/old/sub/b", "file", b"b", 0o644),
    ("rm", "dir", None, 0o755),
    ("rm/me.txt", "file", b"gone", 0o644),
    ("rm/stay.txt", "file", b"stay", 0o640),
    ("dev", "dir", None, 0o755),
    ("dev/null", "chr", None, 0o666),  # a device node: skipped
    ("ro", "dir", None, 0o555),  # read-only, yet filled by the next layer
    ("was_file", "file", b"lower", 0o644),  # the next layer's device node replaces it
    ("dir2file", "dir", None, 0o755),  # the next layer: a file here
    ("dir2file/child", "file", b"c", 0o644),
    ("file2dir", "file", b"f", 0o644),  # the next layer: a directory here
], compress=True)  # fmt: skip
_TOP_ENTRIES = [
    ("opt/old/.wh..wh..opq", "file", b"", 0o644),  # opaque: a and sub/ of the layer below gone
    ("opt/old/new", "file", b"new", 0o600),
    ("rm/.wh.me.txt", "file", b"", 0o644),  # whiteout
    ("etc/hosts", "file", b"127.0.0.1 new\n", 0o600),  # replaces the lower file
    ("usr/bin/tool2", "link", "usr/bin/tool", 0o755),  # a hard link
    ("ro/inside", "file", b"in", 0o444),
    ("fifo", "fifo", None, 0o644),
    ("was_file", "chr", None, 0o644),
    ("dir2file", "file", b"now a file", 0o644),
    ("file2dir", "dir", None, 0o711),
    ("file2dir/inside", "file", b"i", 0o644),
    ("same", "file", b"kept", 0o644),  # a whiteout hides the layers below, not its own layer's
    (".wh.same", "file", b"", 0o644),
    (".wh..wh.plnk", "dir", None, 0o700),  # aufs metadata: skipped
    (".wh..wh.plnk/1.2", "file", b"x", 0o644),
]
TOP = layer(_TOP_ENTRIES)
EXPECTED = {
    "etc": ("dir", 0o755, None),
    "etc/hosts": ("file", 0o600, b"127.0.0.1 new\n"),
    "etc/alternatives": ("dir", 0o755, None),
    "etc/alternatives/tool": ("sym", None, "/usr/bin/tool"),
    "usr": ("dir", 0o755, None),
    "usr/bin": ("dir", 0o755, None),
    "usr/bin/tool": ("file", 0o755, b"#!/bin/sh\necho tool\n"),
    "usr/bin/tool2": ("file", 0o755, b"#!/bin/sh\necho tool\n"),
    "bin": ("sym", None, "usr/bin"),
    "opt": ("dir", 0o755, None),
    "opt/old": ("dir", 0o750, None),
    "opt/old/new": ("file", 0o600, b"new"),
    "rm": ("dir", 0o755, None),
    "rm/stay.txt": ("file", 0o640, b"stay"),
    "dev": ("dir", 0o755, None),
    "ro": ("dir", 0o555, None),
    "ro/inside": ("file", 0o444, b"in"),
    "fifo": ("other", 0o644, None),
    "same": ("file", 0o644, b"kept"),
    "dir2file": ("file", 0o644, b"now a file"),
    "file2dir": ("dir", 0o711, None),
    "file2dir/inside": ("file", 0o644, b"i"),
}


def check_tree(rootfs):
    got, links = tree(rootfs)
    assert got == EXPECTED
    assert links == [["usr/bin/tool", "usr/bin/tool2"]]
    assert os.stat(os.path.join(rootfs, "etc/hosts")).st_mtime == 1_700_000_000


def test_oci_layout_unpacks_to_the_expected_tree_and_a_second_unpack_is_free(tmp_path, capsys):
    src, out = tmp_path / "oci", tmp_path / "images"
    digest = write_oci(str(src), [BOTTOM, TOP], ref="org/task:v1")
    assert main(["unpack", str(src), "--out", str(out), "--name", "sweb.eval.x86_64.t-1"]) == 0
    line = capsys.readouterr().out.strip()
    assert line.startswith(digest) and "2 layers" in line, line
    rootfs = out / ("sha256-" + digest[7:]) / "rootfs"
    check_tree(rootfs)
    for name in ("org/task:v1", "sweb.eval.x86_64.t-1"):  # the ref annotation and --name
        assert os.path.realpath(out / safe_name(name)) == str(rootfs.parent)
    assert safe_name("org/task:v1") == "org_task_v1"
    before = os.stat(rootfs / "etc/hosts").st_ino
    assert "setuid/setgid dropped on 1 files (usr/bin/tool, ...)" in line, line
    info = unpack(str(src), str(out))
    assert (
        info["cached"] and info["digest"] == digest and info["setuid_dropped"] == ["usr/bin/tool"]
    )
    assert info["workdir"] == "/testbed" and "PATH=/usr/local/bin:/usr/bin:/bin" in info["env"]
    assert os.stat(rootfs / "etc/hosts").st_ino == before  # not unpacked again
    assert sorted(os.listdir(out)) == sorted(["sha256-" + digest[7:], "org_task_v1",
                                              "sweb.eval.x86_64.t-1"])  # fmt: skip


def test_docker_save_tarball_unpacks_to_the_same_tree(tmp_path, capsys):
    src, out = tmp_path / "img.tar", tmp_path / "images"
    image_id = write_docker_save(str(src), [BOTTOM, TOP], tags=("xingyaoww/sweb.eval:t1",))
    assert main(["unpack", str(src), "--out", str(out)]) == 0
    assert capsys.readouterr().out.startswith(image_id)
    check_tree(out / ("sha256-" + image_id[7:]) / "rootfs")
    assert (out / "xingyaoww_sweb.eval_t1").is_symlink()


def _hostile():
    ok = ("ok", "file", b"x", 0o644)
    return {
        "path escaping the root": [layer([ok, ("../evil", "file", b"x", 0o644)])],
        "absolute member path": [layer([("/evil", "file", b"x", 0o644)])],
        "write through an absolute symlink": [
            layer([("out", "sym", "/tmp", 0o777)]), layer([("out/evil", "file", b"x", 0o644)])],
        "write through a relative symlink": [
            layer([("up", "sym", "../../..", 0o777), ("up/evil", "file", b"x", 0o644)])],
        "whiteout through a symlink": [
            layer([("out", "sym", "/etc", 0o777)]), layer([("out/.wh.passwd", "file", b"", 0o644)])],
        "hard link pointing outside": [layer([ok, ("h", "link", "../../etc/passwd", 0o644)])],
        "absolute hard link": [layer([ok, ("h", "link", "/etc/passwd", 0o644)])],
        "hard link to nothing": [layer([ok, ("h", "link", "missing", 0o644)])],
        "hard link through a symlink": [
            layer([("out", "sym", "/etc", 0o777), ("h", "link", "out/passwd", 0o644)])],
        "whiteout of '..'": [layer([ok]), layer([(".wh..", "file", b"", 0o644)])],
        "whiteout of the root": [layer([ok]), layer([("d/.wh.", "file", b"", 0o644)])],
    }  # fmt: skip


NAMED = {"path escaping the root": "../evil", "absolute member path": "/evil",
         "write through an absolute symlink": "out/evil", "write through a relative symlink":
         "up/evil", "whiteout through a symlink": "out/.wh.passwd", "hard link pointing outside":
         "../../etc/passwd", "absolute hard link": "/etc/passwd", "hard link to nothing": "missing",
         "hard link through a symlink": "h", "whiteout of '..'": ".wh..",
         "whiteout of the root": "d/.wh."}  # fmt: skip


@pytest.mark.parametrize("fmt", ["oci", "docker"])
def test_hostile_archives_are_refused_with_one_line(tmp_path, capsys, fmt):
    cases = _hostile()
    assert set(cases) == set(NAMED)
    good = layer([("ok", "file", b"x", 0o644)])
    canary = tmp_path / "canary"
    canary.write_text("host")
    for i, (why, layers) in enumerate(cases.items()):
        src, out = tmp_path / f"src{i}", tmp_path / f"out{i}"
        (write_oci if fmt == "oci" else write_docker_save)(str(src), layers)
        with pytest.raises(ImageError):
            unpack(str(src), str(out))
        assert not os.path.exists(out), why  # nothing half-unpacked is left, not even out
        assert main(["unpack", str(src), "--out", str(out)]) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"error: {src}: layer ") and err.count("\n") == 1, (why, err)
        assert f"'{NAMED[why]}'" in err, (why, err)  # the member, quoted
    assert canary.read_text() == "host" and not os.path.exists("/tmp/evil")
    # A layer whose bytes are not its digest: the manifest's (OCI) or the config's diff_id.
    src, out = tmp_path / "mismatch", tmp_path / "out-mismatch"
    if fmt == "oci":
        write_oci(str(src), [good], layer_digests={0: "sha256:" + "0" * 64})
    else:
        write_docker_save(str(src), [good], config={"rootfs": {"diff_ids": ["sha256:" + "1" * 64]}})
    assert main(["unpack", str(src), "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert "digest mismatch" in err and err.count("\n") == 1, err
    assert not os.path.exists(out)  # not even made


def test_sources_of_several_images_platforms_and_broken_sources(tmp_path, capsys):
    """An OCI layout of two tags or a `docker save A B` needs --ref (refused in one line naming
    them); an index of platforms gives this machine's (or refuses); a missing source, a tar that
    is not an image, a missing layer blob and a symlink loop in a docker save: one line, exit 2."""
    import json

    import tests.rl.image_helpers as h
    from rl.sandbox.oci import host_arch

    one, two = layer([("f", "file", b"one", 0o644)]), layer([("f", "file", b"two", 0o644)])
    src = tmp_path / "oci"
    d1 = write_oci(str(src), [one], ref="org/a:v1")
    first = json.loads((src / "index.json").read_text())["manifests"]
    d2 = write_oci(str(src), [two], ref="org/b:v2")  # skopeo copy ... oci:src:<tag>, twice
    index = json.loads((src / "index.json").read_text())
    index["manifests"] += first
    (src / "index.json").write_text(json.dumps(index))
    save = tmp_path / "two.tar"
    h.write_docker_save(str(save), [one], tags=("a:latest",))
    import io
    import tarfile

    with tarfile.open(save) as t:  # a second image in the same tarball: docker save a b
        files = {m.name: t.extractfile(m).read() for m in t.getmembers()}
    entry = json.loads(files["manifest.json"])[0]
    files["manifest.json"] = json.dumps([entry, {**entry, "RepoTags": ["b:latest"]}]).encode()
    with tarfile.open(save, "w") as t:
        for name, data in files.items():
            m = tarfile.TarInfo(name)
            m.size = len(data)
            t.addfile(m, io.BytesIO(data))
    for source, names in ((src, "org/a:v1, org/b:v2"), (save, "a:latest, b:latest")):
        assert main(["unpack", str(source), "--out", str(tmp_path / "x")]) == 2
        err = capsys.readouterr().err
        assert f"holds 2 images ({names}): name one with --ref" in err and err.count("\n") == 1
    info = unpack(str(src), str(tmp_path / "out"), ref="org/a:v1")
    assert info["digest"] == d1 and open(info["rootfs"] + "/f", "rb").read() == b"one"
    assert unpack(str(src), str(tmp_path / "out"), ref="org/b:v2")["digest"] == d2
    assert unpack(str(save), str(tmp_path / "out"), ref="b")["names"] == ["b:latest"]
    with pytest.raises(ImageError, match="no image named 'org/c:v3'"):
        unpack(str(src), str(tmp_path / "out"), ref="org/c:v3")

    # An index of platforms (as a registry serves it): this machine's manifest, else refused.
    plat = tmp_path / "plat"
    mine = write_oci(str(plat), [one])
    other = "arm64" if host_arch() != "arm64" else "amd64"
    ms = [{"mediaType": "application/vnd.oci.image.manifest.v1+json", "digest": "sha256:" +
           "e" * 64, "size": 1, "platform": {"os": "linux", "architecture": other}},
          {"mediaType": "application/vnd.oci.image.manifest.v1+json", "digest": mine, "size": 1,
           "platform": {"os": "linux", "architecture": host_arch()}}]  # fmt: skip
    for name, entries in (("both", ms), ("other", ms[:1])):
        data = json.dumps({"schemaVersion": 2, "manifests": entries}).encode()
        digest = h._put(str(plat / "blobs" / "sha256"), data)
        (plat / "index.json").write_text(json.dumps({"schemaVersion": 2, "manifests": [
            {"mediaType": "application/vnd.oci.image.index.v1+json", "digest": digest,
             "size": len(data), "annotations": {"org.opencontainers.image.ref.name": "p"}}]}))  # fmt: skip
        if name == "both":
            assert unpack(str(plat), str(tmp_path / "out"))["digest"] == mine
            # a bare tag (skopeo's oci:DIR:latest) names no image: no out/p, no out/latest
            assert not {"p", "latest"} & set(os.listdir(tmp_path / "out"))
        else:
            with pytest.raises(ImageError, match=f"no linux/{host_arch()} image .*linux/{other}"):
                unpack(str(plat), str(tmp_path / "out"))

    # Broken sources: one line each, exit 2, nothing made.
    notimg = tmp_path / "notimg.tar"
    with tarfile.open(notimg, "w") as t:
        t.addfile(tarfile.TarInfo("readme"), io.BytesIO(b""))
    nolayer = tmp_path / "nolayer"
    write_oci(str(nolayer), [one])
    os.unlink(nolayer / "blobs" / "sha256" / h._sha(one)[7:])
    loop = tmp_path / "loop.tar"
    h.write_docker_save(str(loop), [one])
    with tarfile.open(loop) as t:
        files = {m.name: t.extractfile(m).read() for m in t.getmembers()}
    with tarfile.open(loop, "w") as t:  # the layer a symlink to a symlink to it
        for name, data in files.items():
            m = tarfile.TarInfo(name)
            if name.endswith("layer.tar"):
                m.type, m.linkname = tarfile.SYMTYPE, "x"
                t.addfile(m)
                m = tarfile.TarInfo(name.rpartition("/")[0] + "/x")
                m.type, m.linkname = tarfile.SYMTYPE, "layer.tar"
                t.addfile(m)
                continue
            m.size = len(data)
            t.addfile(m, io.BytesIO(data))
    for source, why in ((tmp_path / "nope", "no such file or directory"),
                        (notimg, "no index.json + oci-layout (OCI layout) or manifest.json"),
                        (nolayer, "No such file or directory"),
                        (loop, "a loop of symlinks")):  # fmt: skip
        assert main(["unpack", str(source), "--out", str(tmp_path / "none")]) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"error: {source}") and why in err and err.count("\n") == 1, err
        assert not os.path.exists(tmp_path / "none")


def _cut(raw: bytes, at: str, delta: int = 0) -> bytes:
    """A layer tar cut after its last member: at "pad" (its padding kept, no end-of-archive
    blocks), at "data" (its data's end: no padding either), plus `delta` bytes."""
    import io
    import tarfile

    with tarfile.open(fileobj=io.BytesIO(raw)) as t:
        last = t.getmembers()[-1]
    end = last.offset_data + last.size
    return raw[: (end + -end % 512 if at == "pad" else end) + delta]


def test_a_layer_without_end_blocks_or_last_padding_reads_as_go_reads_it(tmp_path, capsys):
    """Debian's umoci 0.4.7 `insert` writes layers whose last member is not padded to 512 bytes
    and that have no end-of-archive blocks; Go's archive/tar (Docker's, containerd's) reads them
    and so do we, to the same tree, plain or gzipped. A last member whose data is cut short (in
    its last block, or blocks earlier) and a header cut short after it are still refused, in one
    line naming the member."""
    import gzip

    top = layer([*_TOP_ENTRIES, ("last.txt", "file", b"y" * 700, 0o640)])
    want = {**EXPECTED, "last.txt": ("file", 0o640, b"y" * 700)}
    variants = {"whole": top, "no end blocks": _cut(top, "pad"), "no padding": _cut(top, "data")}
    assert len(variants["no padding"]) % 512 == 700 % 512  # what umoci 0.4.7 wrote
    variants["no padding, gzip"] = gzip.compress(variants["no padding"], mtime=0)
    for i, (name, top_layer) in enumerate(variants.items()):
        src = tmp_path / f"src{i}"
        digest = write_oci(str(src), [BOTTOM, top_layer])
        info = unpack(str(src), str(tmp_path / "out"))
        assert info["digest"] == digest, name
        got, links = tree(info["rootfs"])
        assert got == want and links == [["usr/bin/tool", "usr/bin/tool2"]], name
    cut = {
        "last block": (_cut(top, "data", -10), "'last.txt': its data is cut short (690 of 700"),
        "earlier blocks": (_cut(top, "data", -600), "'last.txt': its data is cut short"),
        "a header cut short": (_cut(top, "pad", 100), "a partial block after member 'last.txt'"),
    }
    for i, (name, (top_layer, why)) in enumerate(cut.items()):
        src, out = tmp_path / f"cut{i}", tmp_path / f"none{i}"
        write_oci(str(src), [BOTTOM, top_layer])
        assert main(["unpack", str(src), "--out", str(out)]) == 2, name
        err = capsys.readouterr().err
        assert err.startswith(f"error: {src}: layer 1 ") and why in err, (name, err)
        assert err.count("\n") == 1 and not os.path.exists(out), name
