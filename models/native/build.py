"""Compiles `kernels.cc` into a shared library, once per (source, compiler, jaxlib, platform).

    python -m models.native.build            # build if needed; print the path, the ISA chosen, the compile time
    python -m models.native.build --force    # compile again

The library lands in a cache folder, named by a hash of the source text, the compiler's version, the
jaxlib version (its FFI headers) and the platform: `MOESCOPE_NATIVE_DIR` if set, else `_build/` next to
this file when that is writable, else `~/.cache/moescope/native/`. The compiler is `$CXX` or `g++`.
Compilation writes a temporary file and renames it into place (`os.replace`), so concurrent processes
never load a half-written library; two of them may both compile, the last rename wins. Libraries of
other source versions are removed once they are a day old.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional

HERE = Path(__file__).resolve().parent
SOURCE = HERE / "kernels.cc"
FLAGS = ["-O3", "-std=c++17", "-ffp-contract=off", "-shared", "-fPIC", "-pthread"]
LIB_PREFIX = "moescope_native-"


class BuildError(RuntimeError):
    """The native library could not be built; the message is one line naming the cause."""


def compiler() -> str:
    """The C++ compiler command: `$CXX`, else `g++`."""
    return os.environ.get("CXX") or "g++"


def include_dir() -> str:
    """jaxlib's folder of XLA FFI headers (`xla/ffi/api/ffi.h`)."""
    import jax.ffi

    return jax.ffi.include_dir()


def _jaxlib_version() -> str:
    try:
        from importlib.metadata import version

        return version("jaxlib")
    except Exception:  # noqa: BLE001 - an unknown version only weakens the cache key
        return "unknown"


def _compiler_version(cxx: str) -> str:
    try:
        done = subprocess.run([cxx, "--version"], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.SubprocessError) as e:
        raise BuildError(f"no C++ compiler ({cxx}: {e.__class__.__name__}: {e})") from None
    if done.returncode != 0:
        raise BuildError(f"C++ compiler {cxx} --version failed (exit {done.returncode})")
    return done.stdout.strip()


def _writable(folder: Path) -> bool:
    try:
        folder.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=folder, prefix=".probe-"):
            pass
        return True
    except OSError:
        return False


def cache_dir() -> Path:
    """Where built libraries live (created if missing)."""
    env = os.environ.get("MOESCOPE_NATIVE_DIR")
    if env:
        folder = Path(env).expanduser()
        folder.mkdir(parents=True, exist_ok=True)
        return folder
    local = HERE / "_build"
    if _writable(local):
        return local
    folder = Path.home() / ".cache" / "moescope" / "native"
    folder.mkdir(parents=True, exist_ok=True)
    return folder


def cache_key(cxx: Optional[str] = None) -> str:
    """Hash of what the library depends on: source text, compiler version, jaxlib version, platform, flags."""
    cxx = cxx or compiler()
    h = hashlib.sha256()
    for part in (SOURCE.read_text(), _compiler_version(cxx), _jaxlib_version(), sys.platform, platform.machine(),
                 " ".join(FLAGS)):
        h.update(part.encode())
        h.update(b"\0")
    return h.hexdigest()[:16]


def library_path(cxx: Optional[str] = None) -> Path:
    """The path the library for the current source and toolchain has (built or not)."""
    return cache_dir() / f"{LIB_PREFIX}{cache_key(cxx)}.so"


def _prune(keep: Path, age_s: float = 86400.0) -> None:
    """Removes libraries of other source versions untouched for `age_s` (a process may still load a recent one)."""
    now = time.time()
    for old in keep.parent.glob(f"{LIB_PREFIX}*.so"):
        try:
            if old != keep and now - old.stat().st_mtime > age_s:
                old.unlink()
        except OSError:
            pass


def build(force: bool = False) -> tuple[Path, float]:
    """Builds the library if it is missing (or `force`); returns (path, seconds spent compiling: 0 if cached).
    Raises BuildError (one-line message) when there is no compiler or the compilation fails."""
    cxx = compiler()
    if shutil.which(cxx) is None:
        raise BuildError(f"no C++ compiler found ({cxx!r} is not on PATH; set CXX)")
    target = library_path(cxx)
    if target.exists() and not force:
        return target, 0.0
    try:
        inc = include_dir()
    except Exception as e:  # noqa: BLE001
        raise BuildError(f"jax FFI headers unavailable ({e.__class__.__name__}: {e})") from None
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{target.stem}-", suffix=".so.tmp")
    os.close(fd)
    cmd = [cxx, *FLAGS, f"-I{inc}", str(SOURCE), "-o", tmp]
    start = time.perf_counter()
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
        if done.returncode != 0:
            errors = [ln for ln in done.stderr.splitlines() if "error" in ln] or done.stderr.splitlines() or ["?"]
            raise BuildError(f"{cxx} failed (exit {done.returncode}): {errors[0].strip()}")
        os.chmod(tmp, 0o755)
        os.replace(tmp, target)
        _prune(target)
    except subprocess.TimeoutExpired:
        raise BuildError(f"{cxx} took over 900 s") from None
    except OSError as e:
        raise BuildError(f"{cxx} could not run or its output could not be stored ({e})") from None
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target, time.perf_counter() - start


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--force", action="store_true", help="compile even when the cached library exists")
    args = ap.parse_args(argv)
    try:
        path, seconds = build(force=args.force)
    except BuildError as e:
        print(f"build failed: {e}", file=sys.stderr)
        return 1
    from models import native

    lib = native.load()
    print(f"library: {path}")
    print(f"isa: {native.isa() if lib is not None else 'unavailable: ' + str(native.build_error())}"
          f" (best on this CPU: {native.best_isa() if lib is not None else '-'})")
    print(f"compile: {seconds:.1f} s" if seconds else "compile: cached (no compilation this run)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
