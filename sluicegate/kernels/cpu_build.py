"""The CPU kernels' C++ extension (``csrc/``), built once per machine with torch's C++
extension loader on first use (about a minute; cached under ``TORCH_EXTENSIONS_DIR``, by
default ``~/.cache/torch_extensions``). Without a C++ compiler it cannot be built:
``extension()`` returns None and every caller keeps its torch path.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import platform
from pathlib import Path
from types import ModuleType

logger = logging.getLogger(__name__)

_SOURCES = (
    "module.cpp",
    "paged_decode.cpp",
    "paged_prefill.cpp",
    "packed_linear.cpp",
    "layer_ops.cpp",
)
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
    """Of every file in csrc/: torch's loader rebuilds when a source changes but not when
    only a header does, so the digest names the build."""
    digest = hashlib.sha256()
    for path in sorted(_CSRC.iterdir()):
        digest.update(path.name.encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()[:10]


@functools.cache
def extension() -> ModuleType | None:
    from torch.utils.cpp_extension import load

    suffix, flags = _cpu_flags()
    logger.info("loading the CPU kernels (compiled on first use: about a minute)")
    try:
        return load(
            name=f"sluicegate_cpu_kernels_{suffix}_{_sources_digest()}",
            sources=[str(_CSRC / name) for name in _SOURCES],
            # -fopenmp: at::parallel_for is inline OpenMP, serial in code built without it.
            extra_cflags=["-O3", "-ffast-math", "-fopenmp", *flags],
            extra_ldflags=["-fopenmp"],
        )
    except Exception as exc:  # no compiler, no headers: the torch paths serve instead
        logger.warning("CPU kernels unavailable (%s); using the torch paths", exc)
        return None
