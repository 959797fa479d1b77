"""Build a complete wheelhouse: engine, its plugins (plugins/*/ and contrib/*/) and every
dependency, all as wheels, so that on a machine with no package index

    pip install --no-index --find-links wheelhouse 'engine[galore,liger]' engine-lion

installs the core, those plugins and their libraries.

    python scripts/wheelhouse.py [--out DIR] [PLUGIN ...]

Without PLUGIN names every plugin folder goes in. Dependencies are resolved by pip with this
machine's pip configuration (its indexes and find-links) under constraints.txt, which pins torch:
the wheelhouse gets the torch build that `pip install -c constraints.txt torch` installs here.
Sdists are built into wheels; those that build against torch (deepspeed) are built first, without
build isolation, like ./dev.sh installs them.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PLUGIN_FOLDERS = ("plugins", "contrib")
# dependencies whose sdist imports torch while it builds, with the environment of their build
BUILT_AGAINST_TORCH = {"deepspeed": {"DS_BUILD_OPS": "0"}}  # no ops compiled now: JIT on first use


def plugin_projects() -> dict[str, Path]:
    """Every plugin folder (one distribution each) by its name."""
    projects: dict[str, Path] = {}
    for folder in sorted(path.parent for parent in PLUGIN_FOLDERS for path in (ROOT / parent).glob("*/pyproject.toml")):
        if folder.name in projects:
            raise SystemExit(f"wheelhouse: error: two plugin folders named {folder.name}: {projects[folder.name]}, {folder}")
        projects[folder.name] = folder
    return projects


def project_metadata(folder: Path) -> dict:
    return tomllib.loads((folder / "pyproject.toml").read_text())["project"]


def normalized(name: str) -> str:
    """A distribution name as wheel file names spell it (PEP 427)."""
    return re.sub(r"[-_.]+", "_", name).lower()


def requirement_name(requirement: str) -> str:
    return normalized(re.match(r"[A-Za-z0-9._-]+", requirement.strip()).group())


def copy_source(folder: Path, destination: Path) -> Path:
    """A clean copy of a project to build from: setuptools builds in the source tree and packs
    whatever an earlier build left in its build/ folder, even files deleted since."""
    nested = set(PLUGIN_FOLDERS) if folder == ROOT else set()  # projects of their own

    def ignore(directory: str, names: list[str]) -> set[str]:
        skipped = {name for name in names if name.startswith(".") or name.endswith(".egg-info")
                   or name in {"__pycache__", "build", "dist", "output", "wheelhouse"}}
        return skipped | (nested & set(names) if Path(directory) == folder else set())

    shutil.copytree(folder, destination, ignore=ignore)
    return destination


def pip(*args: str | Path, env: dict[str, str] | None = None) -> None:
    subprocess.run([sys.executable, "-m", "pip", *map(str, args)], check=True, env=env)


def build(out: Path, plugins: list[Path], constraints: list[Path]) -> list[Path]:
    """Fill ``out`` with wheels of engine, the ``plugins`` folders' distributions and all their
    dependencies; returns the wheels in ``out``. Earlier wheels of engine and these plugins are
    replaced, other wheels already there are kept (pip installs the newest that fits)."""
    projects = [ROOT, *plugins]
    metadata = [project_metadata(folder) for folder in projects]
    out.mkdir(parents=True, exist_ok=True)
    ours = {normalized(project["name"]) for project in metadata}
    for stale in out.glob("*.whl"):
        if stale.name.split("-")[0].lower() in ours:
            stale.unlink()

    pins = [arg for path in constraints for arg in ("-c", path)]
    with tempfile.TemporaryDirectory(prefix="wheelhouse-") as tmp:
        local = Path(tmp) / "local"  # wheels built here, then saved to out with their dependencies
        sources = [copy_source(folder, Path(tmp) / "src" / project["name"])
                   for folder, project in zip(projects, metadata)]
        print(f"wheelhouse: building {', '.join(project['name'] for project in metadata)}", file=sys.stderr)
        # setuptools comes with the build environment (.venv): no isolated one to set up per project
        pip("wheel", "-q", "--no-deps", "--no-build-isolation", "--wheel-dir", local, *sources)
        for requirement in sorted({dep for project in metadata for dep in project.get("dependencies", [])
                                   if requirement_name(dep) in BUILT_AGAINST_TORCH}):
            print(f"wheelhouse: building {requirement} against the installed torch", file=sys.stderr)
            pip("wheel", "-q", "--no-deps", "--no-build-isolation", *pins, "--wheel-dir", local,
                requirement, env={**os.environ, **BUILT_AGAINST_TORCH[requirement_name(requirement)]})
        print(f"wheelhouse: collecting the dependencies into {out}", file=sys.stderr)
        # the wheels built above are the requirements, so no index's distribution of the same
        # name is taken in their place; sdists among the dependencies are built into wheels here
        pip("wheel", "-q", *pins, "--wheel-dir", out, *sorted(local.glob("*.whl")))
    return sorted(out.glob("*.whl"))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("plugins", nargs="*", metavar="PLUGIN",
                        help="plugin folder names (plugins/NAME, contrib/NAME); default: all")
    parser.add_argument("--out", type=Path, default=ROOT / "wheelhouse", help="default: wheelhouse/")
    parser.add_argument("-c", "--constraint", type=Path, action="append", default=[],
                        help="more pip constraints for the dependencies, besides constraints.txt (repeatable)")
    args = parser.parse_args(argv)
    available = plugin_projects()
    unknown = [name for name in args.plugins if name not in available]
    if unknown:
        parser.error(f"no plugin folder {', '.join(unknown)}; available: {', '.join(sorted(available))}")
    constraints = [ROOT / "constraints.txt", *(path.resolve() for path in args.constraint)]
    try:
        wheels = build(args.out.resolve(), [available[name] for name in args.plugins or available], constraints)
    except subprocess.CalledProcessError as error:  # pip has said why
        raise SystemExit(f"wheelhouse: error: pip {error.cmd[3]} failed (exit status {error.returncode})")
    size = sum(wheel.stat().st_size for wheel in wheels)
    print(f"wheelhouse: {len(wheels)} wheels, {size / 2**20:.0f} MiB in {args.out}", file=sys.stderr)


if __name__ == "__main__":
    main()
