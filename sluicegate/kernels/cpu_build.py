"""The CPU kernels' C++ extension (``csrc/``), built once per machine with torch's C++
extension loader on first use (about a minute; cached under ``TORCH_EXTENSIONS_DIR``, by
default ``~/.cache/torch_extensions``). Without a C++ compiler it cannot be built:
``extension()`` returns None and every caller keeps its torch path.

Torch's loader guards a build with a ``lock`` file that it waits on forever; a build killed
midway (a CI job cut off, a pod evicted) leaves that file behind and hangs every later load.
So each build here also holds an ``flock`` on a file beside it, which the kernel releases
when its holder dies: whoever holds it knows any torch ``lock`` file left is stale.
"""

from __future__ import annotations

import fcntl
import functools
import hashlib
import logging
import os
import platform
from pathlib import Path
from types import ModuleType

logger = logging.getLogger(__name__)

_SOURCES = (
    "module.cpp",
    "layer_ops.cpp",
    "attention/paged_decode.cpp",
    "attention/paged_prefill.cpp",
    "linear/packed_linear.cpp",
    "linear/pair_linear.cpp",
    "linear/quant_dequant.cpp",
    "linear/split_mlp.cpp",
)
"""Relative to ``csrc/``: the shared headers at its top, each stage's kernels in a folder."""
_CSRC = Path(__file__).parent / "csrc"


def _cpu_flags() -> tuple[str, list[str]]:
    """A name suffix and the vector flags this CPU takes. Not ``-march=native``: a build cache
    shared with another machine (a home directory, an image layer) must not load code its CPU
    lacks, so the flags are part of the extension's name."""
    if platform.machine() in ("x86_64", "AMD64"):
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            cpuinfo = ""
        if " avx2 " in cpuinfo and " fma " in cpuinfo:
            # F16C: float16 caches and weights widened eight at a time (csrc/convert.h).
            if " f16c " in cpuinfo:
                return "avx2_f16c", ["-mavx2", "-mfma", "-mf16c"]
            return "avx2", ["-mavx2", "-mfma"]
    return "generic", []


def _sources_digest() -> str:
    """Of every file under csrc/: torch's loader rebuilds when a source changes but not when
    only a header does, so the digest names the build."""
    digest = hashlib.sha256()
    for path in sorted(p for p in _CSRC.rglob("*") if p.is_file()):
        digest.update(path.relative_to(_CSRC).as_posix().encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()[:10]


def build_directory(name: str) -> Path:
    """Where ``name`` is built: under the root torch's loader uses, one folder per torch
    install. An extension built against one torch release does not load in another; and torch's
    loader writes the install's include paths into the folder's ``build.ninja``, so two
    installs of one release (two checkouts' virtual environments) sharing a folder would each
    rebuild it for their own paths in turn, a minute each, past an engine worker's start
    timeout."""
    import torch
    from torch.utils.cpp_extension import get_default_build_root

    root = Path(os.environ.get("TORCH_EXTENSIONS_DIR") or get_default_build_root())
    return root / f"{name}-torch{torch.__version__}-{install_tag(Path(torch.__file__))}"


def install_tag(torch_init: Path) -> str:
    """A short digest of where this torch is installed."""
    return hashlib.sha256(str(torch_init.resolve().parent).encode()).hexdigest()[:8]


def clear_stale_lock(directory: Path) -> None:
    """Remove torch's ``lock`` file in ``directory``; call only while holding its flock."""
    stale = directory / "lock"
    if stale.exists():
        logger.warning("removing %s, left by a CPU-kernel build that did not finish", stale)
        stale.unlink(missing_ok=True)


def extension_name() -> str:
    return f"sluicegate_cpu_kernels_{_cpu_flags()[0]}_{_sources_digest()}"


@functools.cache
def extension() -> ModuleType | None:
    from torch.utils.cpp_extension import load

    flags = _cpu_flags()[1]
    name = extension_name()
    logger.info("loading the CPU kernels (compiled on first use: about a minute)")
    try:
        directory = build_directory(name)
        directory.mkdir(parents=True, exist_ok=True)
        with open(directory.with_name(directory.name + ".flock"), "w") as guard:
            fcntl.flock(guard, fcntl.LOCK_EX)
            clear_stale_lock(directory)
            return load(
                name=name,
                sources=[str(_CSRC / source) for source in _SOURCES],
                # -fopenmp: at::parallel_for is inline OpenMP, serial in code built without it.
                extra_cflags=["-O3", "-ffast-math", "-fopenmp", *flags],
                extra_ldflags=["-fopenmp"],
                # The shared headers (convert.h, dispatch.h, ...) from every stage's folder.
                extra_include_paths=[str(_CSRC)],
                build_directory=str(directory),
            )
    except Exception as exc:  # no compiler, no headers: the torch paths serve instead
        logger.warning("CPU kernels unavailable (%s); using the torch paths", exc)
        return None
