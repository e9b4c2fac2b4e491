"""Container images for the `repo` environment, without a Docker daemon or network.

    python -m launch.images unpack SRC --out DIR [--name NAME ...]

SRC is an OCI image layout directory (`skopeo copy docker://IMG oci:DIR:TAG`, `crane pull
--format=oci`) or a `docker save` tarball (`docker save IMG -o img.tar`), made on another
machine. The image's root filesystem lands in DIR/sha256-<digest>/rootfs (rl/oci.py), and each of
its names (the archive's tags, `--name`) gets a link DIR/<name with / and : replaced by _>: point
`env.images_dir` at DIR and a record's `image` at the name. Unpacking the same image again costs
nothing. A malformed or hostile archive is refused with one line (exit status 1).
"""

from __future__ import annotations

import argparse
import sys
import time

from rl.oci import ImageError, unpack


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m launch.images", description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    u = sub.add_parser("unpack", help="an OCI layout or docker save tarball -> a root filesystem")
    u.add_argument("src", help="OCI image layout directory, or docker save tarball")
    u.add_argument("--out", required=True, help="images directory (env.images_dir)")
    u.add_argument("--name", action="append", default=[], help="a name to link (repeatable)")
    a = p.parse_args(argv)
    t0 = time.monotonic()
    try:
        info = unpack(a.src, a.out, tuple(a.name))
    except ImageError as err:
        print(f"refused: {err}", file=sys.stderr)
        return 1
    how = "already unpacked" if info["cached"] else f"{len(info['layers'])} layers"
    names = ", ".join(info["names"]) or "no name"
    print(f"{info['digest']} -> {info['rootfs']} ({how}, {time.monotonic() - t0:.2f} s; {names})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
