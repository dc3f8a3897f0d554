"""JAX's persistent compilation cache, kept away from the programs one jaxlib reads back wrong.

jaxlib 0.10's XLA:CPU runs some executables read back from the persistent cache
(`JAX_COMPILATION_CACHE_DIR`) with a race: a pipelined step (collective-permutes inside the
schedule's switch, in a scan) on a mesh with "data" and a second axis beside "pipe" returns a
different, wrong loss and gradients on most runs once its executable comes from the cache,
while the freshly compiled one is right every time. jaxlib 0.11 and later run it right
(tests/test_xla_cache.py reads a pipelined step back from a cache and compares it with a fresh
compile). The same jaxlib aborts the process running a mixture of experts' train step on an
expert mesh (all-to-alls) read back from the cache. On the affected versions megajax keeps every
CPU program with a collective-permute or an all-to-all out of the cache, read and write: those
compile each run, every other program is cached as usual.
"""

from __future__ import annotations

from importlib import metadata

AFFECTED = ((0, 10), (0, 11))  # jaxlib versions [from, to)
# the collectives whose programs it reads back wrong: a pipeline's sends, an expert axis's
# all-to-alls (a mixture of experts' step aborts the process once read back)
UNCACHED = ("collective_permute", "all_to_all")
_MARK = "_megajax_cache_guard"


def affected(version: str | None = None) -> bool:
    """Whether this jaxlib's XLA:CPU reads collective-permute and all-to-all programs back
    wrong."""
    version = version or metadata.version("jaxlib")
    major_minor = tuple(int(part) for part in version.split(".")[:2])
    return AFFECTED[0] <= major_minor < AFFECTED[1]


def install() -> None:
    """On an affected jaxlib, compile CPU programs with a collective-permute or an all-to-all
    without the cache.

    jax 0.10 asks `compiler._get_cache_key` for each compile's key; no key means compile
    and do not store. Nothing changes on other versions (where that function may differ)."""
    if not affected():
        return
    from jax._src import compiler

    original = compiler._get_cache_key
    if getattr(original, _MARK, False):
        return

    def cache_key(options, backend, computation, devices, override_fdo_profile=None):
        if backend.platform == "cpu" and any(
            op in computation.operation.get_asm(large_elements_limit=16) for op in UNCACHED
        ):
            return None
        return original(options, backend, computation, devices, override_fdo_profile)

    setattr(cache_key, _MARK, True)
    compiler._get_cache_key = cache_key
