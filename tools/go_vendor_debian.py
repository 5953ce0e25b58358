"""Build a Go module offline from Debian's Go sources: write its vendor/ folder from /usr/share/gocode.

Debian's golang-*-dev packages install Go modules' sources under /usr/share/gocode/src, without the module cache
that `go mod vendor` reads, and the Go module proxy is not used here. This writes what `go mod vendor` would:
vendor/<module path> for every module found there (a symlink to its sources), local `replace` targets linked the
same way, and vendor/modules.txt marking the go.mod's requirements and replacements, so that
`GOFLAGS=-mod=vendor GOPROXY=off go build` builds the module in module mode (its imports resolved by module
path, as on any machine with the proxy) from those sources alone.

Usage: python tools/go_vendor_debian.py interop/go   (then `cd interop/go && GOFLAGS=-mod=vendor go build`)
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path

GOPATH_SYSTEM = Path("/usr/share/gocode")
PLACEHOLDER_VERSION = "v0.0.0"  # Debian does not record the version of a module that nobody requires directly
_REQUIRE = re.compile(r"^\s*(?:require\s+)?(\S+)\s+(v\S+)\s*(?://.*)?$")
_REPLACE = re.compile(r"^\s*replace\s+(\S+)(?:\s+v\S+)?\s+=>\s+(\S+)\s*$")
_MODULE = re.compile(r"^\s*module\s+(\S+)\s*$", re.MULTILINE)


@dataclass(frozen=True)
class GoMod:
    requirements: dict[str, str]  # module path -> version
    replacements: dict[str, str]  # module path -> local directory, as written in go.mod


def read_go_mod(path: Path) -> GoMod:
    """The requirements and local replacements of a go.mod (one `require (...)` block or single lines)."""
    requirements: dict[str, str] = {}
    replacements: dict[str, str] = {}
    in_require = False
    for raw in path.read_text(encoding="utf-8").splitlines():
        line = raw.split("//", 1)[0].rstrip()
        if line.strip() == "require (":
            in_require = True
        elif in_require and line.strip() == ")":
            in_require = False
        elif (in_require or line.lstrip().startswith("require ")) and (match := _REQUIRE.match(line)):
            requirements[match[1]] = match[2]
        elif match := _REPLACE.match(line):
            if not match[2].startswith((".", "/")):
                raise SystemExit(f"{path}: only local replacements can be vendored offline: {raw.strip()}")
            replacements[match[1]] = match[2]
    return GoMod(requirements, replacements)


def system_modules(gopath: Path) -> dict[str, Path]:
    """Module path -> source folder, for every outermost folder under gopath/src with a go.mod."""
    found: dict[str, Path] = {}
    for go_mod in sorted((gopath / "src").glob("*/*/*/go.mod")) + sorted((gopath / "src").glob("*/*/go.mod")):
        folder = go_mod.parent
        if any(folder.is_relative_to(known) for known in found.values()):
            continue
        if match := _MODULE.search(go_mod.read_text(encoding="utf-8")):
            found[match[1]] = folder
    return found


def packages(module_path: str, root: Path) -> list[str]:
    """The import paths of the module's packages: folders with Go files, without nested modules and testdata
    (modules.txt lists them so that the go command knows which module a vendored package comes from)."""
    found: list[str] = []
    for folder, subfolders, files in os.walk(root, followlinks=True):
        here = Path(folder)
        subfolders[:] = sorted(
            name
            for name in subfolders
            if name not in ("testdata", "vendor")
            and not name.startswith((".", "_"))
            and not (here / name / "go.mod").exists()
        )
        if any(name.endswith(".go") and not name.endswith("_test.go") for name in files):
            relative = here.relative_to(root).as_posix()
            found.append(module_path if relative == "." else f"{module_path}/{relative}")
    return found


def vendor(module_dir: Path, gopath: Path = GOPATH_SYSTEM) -> Path:
    """Write module_dir/vendor (replacing an old one) and return it."""
    go_mod = read_go_mod(module_dir / "go.mod")
    available = system_modules(gopath)
    missing = sorted(set(go_mod.requirements) - set(available) - set(go_mod.replacements))
    if missing:
        raise SystemExit(
            f"not under {gopath}/src: {', '.join(missing)} (apt-get install the golang-*-dev package)"
        )
    vendor_dir = module_dir / "vendor"
    shutil.rmtree(vendor_dir, ignore_errors=True)
    sources = dict(available)
    for path, target in go_mod.replacements.items():
        sources[path] = (module_dir / target).resolve()
        if not (sources[path] / "go.mod").is_file():
            raise SystemExit(f"{module_dir / 'go.mod'} replaces {path} with {target}, which has no go.mod")
    lines: list[str] = []
    for path in sorted(sources):
        link = vendor_dir / path
        link.parent.mkdir(parents=True, exist_ok=True)
        os.symlink(sources[path], link, target_is_directory=True)
        version = go_mod.requirements.get(path, PLACEHOLDER_VERSION)
        replaced = f" => {go_mod.replacements[path]}" if path in go_mod.replacements else ""
        lines.append(f"# {path} {version}{replaced}")
        if path in go_mod.requirements:
            # Packages listed only for the modules go.mod requires: a listed package of a module that go.mod
            # does not name would have to be required too (go >= 1.17), with a version Debian does not record.
            lines += ["## explicit", *packages(path, sources[path])]
    lines += [f"# {path} => {target}" for path, target in sorted(go_mod.replacements.items())]
    (vendor_dir / "modules.txt").write_text("\n".join(lines) + "\n", encoding="utf-8")
    return vendor_dir


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("module_dir", type=Path, help="a folder with a go.mod (e.g. interop/go)")
    parser.add_argument("--gopath", type=Path, default=GOPATH_SYSTEM)
    args = parser.parse_args()
    print(f"wrote {vendor(args.module_dir, args.gopath)}")


if __name__ == "__main__":
    main()
