#!/usr/bin/env python3
"""Turn a root filesystem directory into a single-layer image tar.

The output is a docker-archive (``docker save`` layout: manifest.json, the
image config and one uncompressed layer), which both ``ctr images import`` and
``buildah pull docker-archive:PATH`` accept. No registry, no daemon.

The layer is written by GNU tar with numeric owners, so file modes,
ownership, mtimes, symlinks, hard links and device nodes survive as
debootstrap made them.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def build(args: argparse.Namespace) -> None:
    rootfs = Path(args.rootfs)
    if not rootfs.is_dir():
        sys.exit(f"mkimage: {rootfs} is not a directory")
    with tempfile.TemporaryDirectory(dir=os.path.dirname(os.path.abspath(args.output))) as tmp:
        work = Path(tmp)
        layer = work / "layer.tar"
        subprocess.run(
            [
                "tar",
                "--create",
                "--file",
                str(layer),
                "--directory",
                str(rootfs),
                # mtimes are kept: Python checks them against its .pyc files.
                "--numeric-owner",
                "--xattrs",
                "--sort=name",
                ".",
            ],
            check=True,
        )
        layer_digest = sha256_file(layer)
        layer_name = f"{layer_digest}.tar"
        layer.rename(work / layer_name)

        config: dict[str, object] = {
            "Env": args.env or ["PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"]
        }
        if args.entrypoint:
            config["Entrypoint"] = args.entrypoint
        if args.cmd:
            config["Cmd"] = args.cmd
        if args.user:
            config["User"] = args.user
        config["WorkingDir"] = args.workdir
        image_config = {
            "architecture": "amd64",
            "os": "linux",
            "created": "1970-01-01T00:00:00Z",
            "config": config,
            "rootfs": {"type": "layers", "diff_ids": [f"sha256:{layer_digest}"]},
            "history": [{"created": "1970-01-01T00:00:00Z", "created_by": "hack/image/mkimage.py"}],
        }
        config_bytes = json.dumps(image_config, sort_keys=True, separators=(",", ":")).encode()
        config_name = f"{hashlib.sha256(config_bytes).hexdigest()}.json"
        (work / config_name).write_bytes(config_bytes)
        manifest = [{"Config": config_name, "RepoTags": [args.tag], "Layers": [layer_name]}]
        (work / "manifest.json").write_text(json.dumps(manifest))
        (work / "repositories").write_text("{}")

        out_tmp = Path(args.output + ".part")
        subprocess.run(
            [
                "tar",
                "--create",
                "--file",
                str(out_tmp),
                "--directory",
                str(work),
                "--owner=0",
                "--group=0",
                "--numeric-owner",
                "manifest.json",
                "repositories",
                config_name,
                layer_name,
            ],
            check=True,
        )
        shutil.move(str(out_tmp), args.output)
    print(
        f"mkimage: {args.tag} -> {args.output} (layer sha256:{layer_digest[:12]})", file=sys.stderr
    )


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rootfs", required=True, help="directory to become the image's only layer")
    p.add_argument(
        "--tag", required=True, help="image reference, e.g. localhost/understudy-base:bookworm"
    )
    p.add_argument("--output", required=True, help="docker-archive tar to write")
    p.add_argument("--entrypoint", action="append", help="entrypoint argv element (repeat)")
    p.add_argument("--cmd", action="append", help="cmd argv element (repeat)")
    p.add_argument("--env", action="append", help="KEY=VALUE (repeat); default: a standard PATH")
    p.add_argument("--user", help="user[:group]")
    p.add_argument("--workdir", default="/")
    build(p.parse_args(argv))


if __name__ == "__main__":
    main()
