"""`python -m launch.images unpack` (rl/oci.py): OCI layouts and `docker save` tarballs made here
from the test's own files unpack into the expected tree, file by file with modes (two layers, a
whiteout, an opaque directory, a hard link, symlinks kept verbatim), a second unpack is free, and
each hostile archive is refused with one line, leaving nothing behind."""

import os

import pytest

from launch.images import main
from rl.oci import ImageError, safe_name, unpack
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
], compress=True)  # fmt: skip
TOP = layer([
    ("opt/old/.wh..wh..opq", "file", b"", 0o644),  # opaque: a and sub/ of the layer below gone
    ("opt/old/new", "file", b"new", 0o600),
    ("rm/.wh.me.txt", "file", b"", 0o644),  # whiteout
    ("etc/hosts", "file", b"127.0.0.1 new\n", 0o600),  # replaces the lower file
    ("usr/bin/tool2", "link", "usr/bin/tool", 0o755),  # a hard link
    ("ro/inside", "file", b"in", 0o444),
    ("fifo", "fifo", None, 0o644),
])  # fmt: skip
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
    info = unpack(str(src), str(out))
    assert info["cached"] and info["digest"] == digest
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
    }  # fmt: skip


@pytest.mark.parametrize("fmt", ["oci", "docker"])
def test_hostile_archives_are_refused_with_one_line(tmp_path, capsys, fmt):
    cases = _hostile()
    good = layer([("ok", "file", b"x", 0o644)])
    canary = tmp_path / "canary"
    canary.write_text("host")
    for i, (why, layers) in enumerate(cases.items()):
        src, out = tmp_path / f"src{i}", tmp_path / f"out{i}"
        (write_oci if fmt == "oci" else write_docker_save)(str(src), layers)
        with pytest.raises(ImageError):
            unpack(str(src), str(out))
        assert os.listdir(out) == [], why  # nothing half-unpacked is left
        assert main(["unpack", str(src), "--out", str(out)]) == 1
        err = capsys.readouterr().err
        assert err.startswith("refused: ") and err.count("\n") == 1, (why, err)
    assert canary.read_text() == "host" and not os.path.exists("/tmp/evil")
    # A layer whose bytes are not its digest: the manifest's (OCI) or the config's diff_id.
    src, out = tmp_path / "mismatch", tmp_path / "out-mismatch"
    if fmt == "oci":
        write_oci(str(src), [good], layer_digests={0: "sha256:" + "0" * 64})
    else:
        write_docker_save(str(src), [good], config={"rootfs": {"diff_ids": ["sha256:" + "1" * 64]}})
    assert main(["unpack", str(src), "--out", str(out)]) == 1
    err = capsys.readouterr().err
    assert "digest mismatch" in err and err.count("\n") == 1, err
    assert os.listdir(out) == []
