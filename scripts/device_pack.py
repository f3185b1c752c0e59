"""The wheels a GPU machine without network needs to execute the book (`make device-pack`).

    python scripts/device_pack.py                 # download scripts/device/packages.yml's `carried` into .whl/, check
    python scripts/device_pack.py --check-only    # check what .whl/ holds, download nothing
    python3 scripts/device_pack.py --installed /tmp/cb-site   # there: check the installed set against the image

Checks, all before anything travels: one wheel per carried package at its pinned version and nothing
else in .whl/; every requirement every wheel declares (markers evaluated for CPython 3.12 on Linux
x86_64, no extras) is met by a carried wheel or by the image's version of the package (where
packages.yml knows it; else it is listed as assumed, and checked there with --installed), or is listed
under not_carried; pip itself accepts the set for that interpreter and platform
(`pip install --dry-run --no-index --no-deps --target ...`); the total stays under max_mib.
Uses only the standard library, PyYAML and packaging, so it runs under the device image's python3 too.
"""
from __future__ import annotations

import argparse
import email.parser
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

import yaml
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name, parse_wheel_filename
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[1]
SPEC = ROOT / "scripts" / "device" / "packages.yml"
MIB = 1024 * 1024


class PackError(RuntimeError):
    """The pack cannot be used; the message says which package and why."""


def load_spec(path: Path = SPEC) -> dict:
    spec = yaml.safe_load(path.read_text())
    for section in ("carried", "image", "not_carried", "absent_there"):
        spec[section] = {canonicalize_name(k): v for k, v in (spec.get(section) or {}).items()}
    overlap = set(spec["carried"]) & set(spec["image"])
    if overlap:
        raise PackError(f"{path}: {sorted(overlap)} are both carried and in the image; keep one")
    return spec


def target_environment(python: str) -> dict[str, str]:
    """PEP 508 marker values of CPython `python` on Linux x86_64 (the device)."""
    return {"python_version": python, "python_full_version": f"{python}.0", "os_name": "posix",
            "sys_platform": "linux", "platform_system": "Linux", "platform_machine": "x86_64",
            "platform_python_implementation": "CPython", "implementation_name": "cpython",
            "platform_release": "", "platform_version": "", "implementation_version": f"{python}.0", "extra": ""}


def wheel_metadata(path: Path) -> tuple[str, str, list[str]]:
    """(canonical name, version, Requires-Dist lines) of a wheel file."""
    with zipfile.ZipFile(path) as z:
        meta = next((n for n in z.namelist() if n.endswith(".dist-info/METADATA") and n.count("/") == 1), None)
        if meta is None:
            raise PackError(f"{path.name}: not a wheel (no *.dist-info/METADATA)")
        msg = email.parser.Parser().parsestr(z.read(meta).decode())
    return canonicalize_name(msg["Name"]), msg["Version"], msg.get_all("Requires-Dist") or []


def check_requirements(carried: dict[str, tuple[str, list[str]]], image: dict[str, str | None],
                       not_carried: dict[str, str], env: dict[str, str]) -> tuple[list[str], list[str]]:
    """(problems, assumptions) of a set of packages installed without dependency resolution.

    carried: name -> (version, Requires-Dist); image: name -> version, or None where unknown. A
    requirement is met by a carried package or the image's in range; an image package of unknown
    version, or one named in not_carried, is an assumption (returned, not a problem).
    """
    problems, assumptions = [], []
    for name, (version, requires) in sorted(carried.items()):
        for line in requires:
            req = Requirement(line)
            if req.marker is not None and not req.marker.evaluate(env):
                continue
            dep = canonicalize_name(req.name)
            have = carried.get(dep, (None,))[0] if dep in carried else image.get(dep, "") if dep in image else None
            if dep in carried or (dep in image and have is not None):
                if have and not req.specifier.contains(Version(have), prereleases=True):
                    where = "carried" if dep in carried else "in the image"
                    problems.append(f"{name} {version} needs {req} but {dep} {have} is {where}")
            elif dep in image:
                if str(req.specifier):
                    assumptions.append(f"{name} needs {req}: the image's {dep} version is not known here")
            elif dep in not_carried:
                assumptions.append(f"{name} needs {req}: not carried ({not_carried[dep]})")
            else:
                problems.append(f"{name} {version} needs {req}, which is neither carried nor in the image "
                                "(add it to carried, or to not_carried with the reason it is never imported)")
    return problems, assumptions


def pip_platform_args(spec: dict) -> list[str]:
    out = ["--only-binary=:all:", "--python-version", spec["python"], "--implementation", "cp"]
    for p in spec["platforms"]:
        out += ["--platform", p]
    return out


def download(spec: dict, dest: Path) -> None:
    """Fetch every carried wheel (pinned, no dependencies) into dest; drop wheels of other packages or versions."""
    dest.mkdir(exist_ok=True)
    wanted = {n: v for n, v in spec["carried"].items()}
    for wheel in dest.glob("*.whl"):
        name, version = _wheel_name(wheel)
        if wanted.get(name) != version:
            print(f"device-pack: removing {wheel.name} (not in {SPEC.relative_to(ROOT)})")
            wheel.unlink()
    have = {_wheel_name(w)[0] for w in dest.glob("*.whl")}
    todo = [f"{n}=={v}" for n, v in wanted.items() if n not in have]
    if todo:
        print(f"device-pack: downloading {len(todo)} wheels into {dest}")
        cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", *pip_platform_args(spec), "-d", str(dest), *todo]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            raise PackError("pip download failed:\n" + (proc.stdout + proc.stderr)[-3000:])


def _wheel_name(path: Path) -> tuple[str, str]:
    name, version, _, _ = parse_wheel_filename(path.name)
    return canonicalize_name(name), str(version)


def check_pack(spec: dict, dest: Path) -> tuple[list[str], int]:
    """Check the wheels in dest; return (assumptions, total bytes). Raises PackError naming every problem."""
    wheels = sorted(dest.glob("*.whl"))
    by_name: dict[str, list[Path]] = {}
    for w in wheels:
        by_name.setdefault(_wheel_name(w)[0], []).append(w)
    problems = [f"{n}: {len(ws)} wheels ({', '.join(w.name for w in ws)}); keep one" for n, ws in by_name.items()
                if len(ws) > 1]
    problems += [f"{n}: no wheel in {dest}" for n in spec["carried"] if n not in by_name]
    problems += [f"{n}: {ws[0].name} is not in carried" for n, ws in by_name.items() if n not in spec["carried"]]
    problems += [f"{n}: {ws[0].name} is not the pinned {spec['carried'][n]}" for n, ws in by_name.items()
                 if n in spec["carried"] and _wheel_name(ws[0])[1] != spec["carried"][n]]
    carried = {}
    for w in wheels:
        name, version, requires = wheel_metadata(w)
        carried[name] = (version, requires)
    found, assumptions = check_requirements(carried, spec["image"], spec["not_carried"],
                                            target_environment(spec["python"]))
    problems += found
    if wheels:
        with tempfile.TemporaryDirectory(prefix="cb-pack-") as tmp:
            cmd = [sys.executable, "-m", "pip", "install", "--dry-run", "-q", "--no-index", "--no-deps",
                   "--ignore-installed", "--target", tmp, *pip_platform_args(spec), *map(str, wheels)]
            proc = subprocess.run(cmd, capture_output=True, text=True)
            if proc.returncode != 0:
                problems.append("pip install --dry-run refused the set:\n" + (proc.stdout + proc.stderr)[-2000:])
    size = sum(w.stat().st_size for w in wheels)
    if size > spec["max_mib"] * MIB:
        problems.append(f"the wheels take {size / MIB:.1f} MiB, over max_mib = {spec['max_mib']}")
    if problems:
        raise PackError(f"{dest}: {len(problems)} problem(s):\n  " + "\n  ".join(problems))
    return assumptions, size


def check_installed(spec: dict, target: Path) -> list[str]:
    """On the device: the packages installed in `target` against the interpreter's own (the image's, real
    versions). Returns the assumptions left (not_carried only); raises PackError on any problem."""
    import importlib.metadata as md

    def dists(paths):
        return {canonicalize_name(d.metadata["Name"]): d for d in md.distributions(path=paths)}

    carried_dists = dists([str(target)])
    image = {n: d.version for n, d in dists([p for p in sys.path if Path(p or ".").resolve() != target.resolve()]).items()}
    missing = [n for n in spec["carried"] if n not in carried_dists]
    carried = {n: (d.version, d.requires or []) for n, d in carried_dists.items()}
    major, minor = sys.version_info[:2]
    env = {**target_environment(f"{major}.{minor}"), "python_full_version": sys.version.split()[0]}
    problems, assumptions = check_requirements(carried, {n: v for n, v in image.items() if n not in carried},
                                               spec["not_carried"], env)
    problems += [f"{n} is not installed in {target}" for n in missing]
    if problems:
        raise PackError(f"installed packages in {target}: {len(problems)} problem(s):\n  " + "\n  ".join(problems))
    return assumptions


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dest", type=Path, default=ROOT / ".whl", help="where the wheels go (default: .whl)")
    ap.add_argument("--check-only", action="store_true", help="check the wheels in --dest; download nothing")
    ap.add_argument("--installed", type=Path, default=None, metavar="TARGET",
                    help="on the device: check the packages installed in TARGET against this interpreter's")
    ap.add_argument("--spec", type=Path, default=SPEC)
    a = ap.parse_args(argv)
    try:
        spec = load_spec(a.spec)
        if a.installed:
            notes = check_installed(spec, a.installed)
            print(f"device-pack: {len(spec['carried'])} carried packages installed in {a.installed} meet every "
                  f"requirement against this interpreter's packages ({len(notes)} not carried by design)")
            return 0
        if not a.check_only:
            download(spec, a.dest)
        notes, size = check_pack(spec, a.dest)
    except PackError as e:
        print(f"device-pack: error: {e}", file=sys.stderr)
        return 1
    unknown = [n for n in notes if "version is not known here" in n]
    for note in notes:
        if note not in unknown:
            print(f"  assumed: {note}")
    if unknown:
        print(f"  assumed: {len(unknown)} requirements on image packages whose version packages.yml does not know "
              "(scripts/device-run.sh checks them there with --installed): "
              + ", ".join(n.split(" needs ")[1].split(":")[0] for n in unknown))
    print(f"device-pack: {len(spec['carried'])} wheels in {a.dest}, {size / MIB:.1f} MiB (limit {spec['max_mib']} MiB); "
          f"every declared requirement met or assumed as listed; pip accepts the set for CPython {spec['python']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
