"""Container images for the `repo` environment, without a Docker daemon or network.

    python -m launch.images unpack SRC --out DIR [--name NAME ...]

SRC is an OCI image layout directory (`skopeo copy docker://IMG oci:DIR:TAG`, `crane pull
--format=oci`) or a `docker save` tarball (`docker save IMG -o img.tar`), made on another
machine. The image's root filesystem lands in DIR/sha256-<digest>/rootfs (rl/sandbox/oci.py), and each of
its names (the archive's tags, `--name`) gets a link DIR/<name with / and : replaced by _>: point
`env.images_dir` at DIR and a record's `image` at the name. Unpacking the same image again costs
nothing. A source holding several images (an OCI layout of several tags, `docker save A B`)
needs `--ref NAME`; of an index of several platforms, this machine's is taken. A missing source,
a malformed or hostile archive is refused with one `error: ` line naming the archive (and the
layer and member), exit status 2, and nothing left under DIR. Setuid / setgid bits are dropped
(the sandbox never gains privileges): the line says on how many files.
"""

from __future__ import annotations

import sys
import time

from launch.cli import ArgumentParser
from rl.sandbox.oci import ImageError, unpack


def main(argv=None) -> int:
    p = ArgumentParser(prog="python -m launch.images", description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    u = sub.add_parser("unpack", help="an OCI layout or docker save tarball -> a root filesystem")
    u.add_argument("src", help="OCI image layout directory, or docker save tarball")
    u.add_argument("--out", required=True, help="images directory (env.images_dir)")
    u.add_argument("--name", action="append", default=[], help="a name to link (repeatable)")
    u.add_argument("--ref", default="", help="the image to take from a source holding several")
    a = p.parse_args(argv)
    t0 = time.monotonic()
    try:
        info = unpack(a.src, a.out, tuple(a.name), a.ref)
    except ImageError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    how = "already unpacked" if info["cached"] else f"{len(info['layers'])} layers"
    if dropped := info.get("setuid_dropped"):
        how += f", setuid/setgid dropped on {len(dropped)} files ({dropped[0]}, ...)"
    names = ", ".join(info["names"]) or "no name"
    print(f"{info['digest']} -> {info['rootfs']} ({how}, {time.monotonic() - t0:.2f} s; {names})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
