"""Native CPU kernels built on first use: the system C compiler, a per-user cache, ctypes.

A kernel's C source is compiled once with ``$CC`` (else ``cc`` / ``gcc`` / ``clang``) into
``$XDG_CACHE_HOME/splitmoe`` (``~/.cache/splitmoe``), named by the hash of the source and the
headers beside it, the compiler, the flags and (for flags that target this CPU) the CPU model,
and loaded with ctypes: no build step at install time, no torch headers, and ranks that start
together build it once (a rank that finds the library loads it; concurrent builds write to
private names and rename atomically). `balance_cpu`, `moe_cpu`, `attention_cpu` and
`linear_cpu` are the kernels.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

from splitmoe.kernels.cpu_choice import cpu_model, cpuinfo


class NativeUnavailable(RuntimeError):
    """No C compiler, or the build failed (the message says which and what to do)."""


def cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "splitmoe"


def compiler(what: str) -> str:
    for name in filter(None, (os.environ.get("CC"), "cc", "gcc", "clang")):
        path = shutil.which(name)
        if path:
            return path
    raise NativeUnavailable(
        f"{what} needs a C compiler (cc, gcc or clang on PATH, or $CC): install one "
        "(e.g. apt-get install gcc)"
    )


def build(
    source: Path, flags: list[str], what: str, key: str = "", cache: Path | None = None
) -> Path:
    """The compiled library of ``source``, building it if this source (with the headers beside
    it), compiler, ``flags`` and ``key`` (e.g. the CPU model, for ``-march=native``) have none
    yet. ``what`` names the
    kernel in errors."""
    cc = compiler(what)
    src = b"".join(p.read_bytes() for p in [source, *sorted(source.parent.glob("*.h"))])
    digest = hashlib.sha256(src + cc.encode() + " ".join(flags).encode() + key.encode())
    cache = cache or cache_dir()
    lib = cache / f"{source.stem}-{digest.hexdigest()[:16]}.so"
    if lib.exists():
        return lib
    try:
        cache.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=lib.name + ".", dir=cache)
    except OSError as e:
        raise NativeUnavailable(
            f"{what} is built into {cache}, which is not writable ({e}): point "
            "$XDG_CACHE_HOME at a writable directory"
        ) from e
    os.close(fd)
    try:
        run = subprocess.run([cc, *flags, "-o", tmp, str(source)], capture_output=True, text=True)
        if run.returncode != 0:
            raise NativeUnavailable(f"building {what} with {cc} failed:\n{run.stderr}")
        os.replace(tmp, lib)  # atomic: a concurrent rank sees no half-written library
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return lib


def load(
    source: Path,
    flags: list[str],
    what: str,
    signatures: dict[str, list],
    log: logging.Logger,
    without: str,
) -> ctypes.CDLL | None:
    """``source`` built for this CPU (`build`, keyed by the CPU's model and flags: what
    ``-march=native`` compiles for, which a VM can narrow) and loaded, each function of
    ``signatures`` (name -> argtypes; those the library lacks are skipped) returning an int;
    None where it cannot be built, with one warning ending in ``without`` (what runs instead)."""
    try:
        lib = ctypes.CDLL(str(build(source, flags, what, cpu_model() + cpuinfo("flags"))))
    except (NativeUnavailable, OSError) as e:
        log.warning("%s; %s", e, without)
        return None
    for name, argtypes in signatures.items():
        fn = getattr(lib, name, None)
        if fn is not None:
            fn.argtypes, fn.restype = argtypes, ctypes.c_int
    return lib


# How the tensor kernels (`moe_cpu`, `attention_cpu`, `linear_cpu`) are compiled: for this CPU,
# OpenMP (sharing torch's libgomp, which the process has loaded), GCC's vector extensions.
KERNEL_FLAGS = ["-O3", "-march=native", "-fopenmp", "-std=gnu11", "-shared", "-fPIC", "-lm"]


class Kernel:
    """A tensor kernel's library, built and loaded on its first call (`load` with
    `KERNEL_FLAGS`), then kept; None where it cannot be built, warned once on ``log``.
    ``signatures``: name -> argtypes (those the library lacks, e.g. an AVX512-BF16 variant
    on a CPU without it, are skipped); ``without``: what runs instead."""

    def __init__(
        self, source: Path, what: str, signatures: dict[str, list], log: logging.Logger,
        without: str,
    ):  # fmt: skip
        self.source, self.what, self.signatures = source, what, signatures
        self.log, self.without = log, without
        self._lib: ctypes.CDLL | None | bool = None  # False: unavailable here (warned once)

    def __call__(self) -> ctypes.CDLL | None:
        if self._lib is None:
            lib = load(self.source, KERNEL_FLAGS, self.what, self.signatures, self.log,
                       self.without)  # fmt: skip
            self._lib = lib or False
        return self._lib or None
