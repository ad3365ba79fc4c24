"""``python -m forkbuild {tree,export,tree-standalone,wheel,standalone-tests,series-check}``: the developer's commands
(see devtree, assemble, standalone_tests and series_check)."""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
from pathlib import Path

from forkbuild import assemble, devtree, series_check, standalone_tests, upstream
from forkbuild.pin import STANDALONE, BuildError


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m forkbuild", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    tree = commands.add_parser("tree", help="materialise the patched tree in .tree/ as a git history")
    tree.add_argument("--force", action="store_true", help="replace an existing .tree/")
    commands.add_parser("export", help="write .tree/'s commits back into patches/ and src/")
    from_tree = commands.add_parser(
        "tree-standalone", help="the standalone pytorch-lightning wheel from .tree/'s working files (edits included)"
    )
    from_tree.add_argument("-o", "--outdir", type=Path, default=Path("build/tree-standalone"))
    from_tree.add_argument("--install", action="store_true",
                           help="and install it (pip install --no-deps --force-reinstall) into this interpreter")
    wheel = commands.add_parser("wheel", help="build the fork's wheels (lightning and pytorch-lightning by default)")
    wheel.add_argument("-o", "--outdir", type=Path, default=Path("dist"))
    wheel.add_argument("--flavour", action="append", choices=sorted(assemble.FLAVOURS),
                       help="which wheel (repeatable); stock-pytorch-lightning is the tests' unpatched, renamed copy")
    renamed = commands.add_parser(
        "standalone-tests", help="the behaviour tests, renamed for pytorch_lightning / lightning_fabric"
    )
    renamed.add_argument("-o", "--outdir", type=Path, default=Path("build/standalone-tests"))
    series_check.add_arguments(commands.add_parser(
        "series-check", help="the series reviewable one concern at a time (claims, churn, citations, every prefix)",
        description=series_check.__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
    ))
    args = parser.parse_args(argv)
    try:
        if args.command == "tree":
            print(f"materialised {devtree.materialise(force=args.force)}")
        elif args.command == "export":
            print("series:", *devtree.export(), sep="\n  ")
        elif args.command == "tree-standalone":
            for old in args.outdir.glob("*.whl"):
                old.unlink()
            wheel = devtree.standalone_wheel(args.outdir)
            print(wheel)
            if args.install:
                pip = [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--force-reinstall", str(wheel)]
                return subprocess.run(pip).returncode
        elif args.command == "series-check":
            return series_check.run(args)
        elif args.command == "standalone-tests":
            root = Path(__file__).resolve().parent.parent
            files = standalone_tests.generate(root / "tests", args.outdir, root / "pyproject.toml")
            print(f"{args.outdir}: {len(files)} files")
        else:
            args.outdir.mkdir(parents=True, exist_ok=True)
            for name in args.flavour or ["lightning", STANDALONE]:
                flv = assemble.flavour(name)
                pin = assemble.flavour_pin(flv)
                with tempfile.TemporaryDirectory() as tmp:
                    print(assemble.write_wheel(pin, upstream.obtain(pin, Path(tmp)), args.outdir, flv))
    except BuildError as err:
        print(f"forkbuild: {err}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
