"""A container image made on this machine, for the tests that run hpclaunch inside a real runtime.

Charliecloud runs a directory tree as an image (``ch-run IMAGE -- CMD``), so the image is one: this
machine's Python (its standard library, at ``/opt/python``), this project's virtual environment's
packages (torch, mmdit, ...) in ``/opt/venv``, hpclaunch copied in from this checkout (not the
editable install: the image holds the code it was made from), and the shared libraries all of
that links against (``ldd``), nothing else of the host. The large trees are hard links into the
host's files, so a build takes seconds and next to no disk.

One image per content of ``src/hpclaunch`` (a hash in its name): built once, by whichever test
process asks first (a file lock), and reused by every later test, worker and session until the
code changes.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "src" / "hpclaunch"
IMAGES = Path(os.environ.get("HPCLAUNCH_TEST_IMAGES", "/tmp/hpclaunch-test-images"))
IMAGE_PYTHON = "/opt/venv/bin/python"  # the image's Python (container.python in the tests)
_LIBDIR = "usr/lib/x86_64-linux-gnu"


def charliecloud_available() -> str | None:
    """None when ch-run can run an image here, else why not (a test skips with it)."""
    if shutil.which("ch-run") is None:
        return "ch-run is not installed (apt-get install charliecloud-runtime)"
    return None


def charliecloud_image() -> Path:
    """The image directory for this checkout's code (built on first use)."""
    key = _code_key()
    image = IMAGES / f"charliecloud-{key}"
    if (image / "opt" / "venv" / "ok").exists():
        return image
    IMAGES.mkdir(parents=True, exist_ok=True)
    with open(IMAGES / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (image / "opt" / "venv" / "ok").exists():
            building = IMAGES / f".building-{key}-{os.getpid()}"
            shutil.rmtree(building, ignore_errors=True)
            _build(building)
            shutil.rmtree(image, ignore_errors=True)
            building.rename(image)
            _prune(keep=image)
    return image


def _code_key() -> str:
    digest = hashlib.sha256(sys.version.encode())
    for path in sorted(SRC.rglob("*")):
        if path.is_file() and "__pycache__" not in path.parts:
            digest.update(str(path.relative_to(SRC)).encode())
            digest.update(path.read_bytes())
    return digest.hexdigest()[:12]


def _prune(keep: Path) -> None:
    """Images of older code are removed (each is mostly hard links, but thousands of them)."""
    for other in IMAGES.glob("charliecloud-*"):
        if other != keep:
            shutil.rmtree(other, ignore_errors=True)


def _link_tree(src: Path, dst: Path, *, skip: tuple[str, ...] = ()) -> None:
    """``dst`` as a tree of hard links to ``src``'s files (copies where the filesystem differs)."""
    for root, dirs, files in os.walk(src):
        rel = Path(root).relative_to(src)
        dirs[:] = [d for d in dirs if d not in skip]
        (dst / rel).mkdir(parents=True, exist_ok=True)
        for name in [*files, *(d for d in dirs if (Path(root) / d).is_symlink())]:
            s, d = Path(root) / name, dst / rel / name
            if s.is_symlink():
                d.symlink_to(os.readlink(s))
            else:
                try:
                    os.link(s, d)
                except OSError:
                    shutil.copy2(s, d)


def _build(img: Path) -> None:
    base = Path(sys.base_prefix)
    version = f"python{sys.version_info.major}.{sys.version_info.minor}"
    venv_site = Path(sysconfig.get_paths()["purelib"])
    # The interpreter and its standard library (relocatable: it finds lib/ next to bin/).
    (img / "opt/python/bin").mkdir(parents=True)
    shutil.copy2(Path(sys.executable).resolve(), img / "opt/python/bin" / version)
    _link_tree(base / "lib" / version, img / "opt/python/lib" / version, skip=("site-packages", "test"))
    (img / "opt/python/lib" / version / "site-packages").mkdir()
    # The virtual environment: the project's packages, and hpclaunch itself as a plain copy.
    site = img / "opt/venv/lib" / version / "site-packages"
    _link_tree(venv_site, site, skip=("hpclaunch",))
    for editable in site.glob("__editable__*hpclaunch*"):
        editable.unlink()
    shutil.copytree(SRC, site / "hpclaunch", ignore=shutil.ignore_patterns("__pycache__"))
    # Compiled now, named by their paths in the image: the image is mounted read-only.
    subprocess.run(
        [sys.executable, "-m", "compileall", "-q", "-s", str(img), "-p", "/", str(site / "hpclaunch")],
        check=True,
    )
    (img / "opt/venv/bin").mkdir(parents=True)
    (img / "opt/venv/bin/python").symlink_to(f"/opt/python/bin/{version}")
    (img / "opt/venv/pyvenv.cfg").write_text(
        f"home = /opt/python/bin\ninclude-system-site-packages = false\nversion = {sys.version.split()[0]}\n"
    )
    # Shared libraries: whatever the interpreter and the packages' extensions link against.
    libdir = img / _LIBDIR
    libdir.mkdir(parents=True)
    for name, target in (("lib", "usr/lib"), ("lib64", "usr/lib64"), ("bin", "usr/bin")):
        (img / target).mkdir(parents=True, exist_ok=True)
        (img / name).symlink_to(target)
    binaries = [Path(sys.executable).resolve(), Path("/bin/sh").resolve()]
    binaries += [p for p in img.joinpath("opt").rglob("*.so*") if p.is_file() and "tkinter" not in p.name]
    for lib in _needed(binaries):
        if not lib.is_relative_to(img):  # (copied under the name the loader asks for)
            dest = img / lib.relative_to("/") if lib.name.startswith("ld-linux") else libdir / lib.name
            if not dest.exists():
                shutil.copy2(lib.resolve(), dest)
    shutil.copy2(Path("/bin/sh").resolve(), img / "usr/bin/sh")
    # What ch-run mounts over (it needs the mount points) and the files it binds from the host.
    for d in ("dev", "proc", "sys", "tmp", "home", "root", "run", "mnt", "etc"):
        (img / d).mkdir(exist_ok=True)
    for f in ("passwd", "group", "hosts", "resolv.conf", "machine-id"):
        (img / "etc" / f).touch()
    (img / "opt/venv/ok").touch()


def _needed(binaries: list[Path]) -> set[Path]:
    """The resolved paths of every library ``binaries`` load (``ldd``), the loader included."""
    found: set[Path] = set()
    for chunk in range(0, len(binaries), 50):
        out = subprocess.run(
            ["ldd", *map(str, binaries[chunk : chunk + 50])], capture_output=True, text=True, check=False
        ).stdout
        for line in out.splitlines():
            parts = line.split()
            if len(parts) >= 3 and parts[1] == "=>" and parts[2].startswith("/"):
                found.add(Path(parts[2]))
            elif parts and "ld-linux" in parts[0] and parts[0].startswith("/"):
                found.add(Path(parts[0]))
    return found
