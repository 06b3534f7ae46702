"""capsctl.memory: freed tensor memory is reused without page faults (glibc), and the command
applies it unless CAPSCTL_KEEP_MEMORY=0."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.skipif(
    not sys.platform.startswith("linux") or os.confstr("CS_GNU_LIBC_VERSION") is None,
    reason="the setting applies to glibc only",
)

# A child process allocates and frees a 64 MiB tensor (above glibc's largest mmap threshold,
# 32 MiB) again and again, as a training step does, and counts the minor page faults of five
# rounds once the heap has settled (it grows for a few rounds: memalign's slack).
_PROBE = """
import json, resource, sys, torch
applied = None
if sys.argv[1] == "apply":
    from capsctl.memory import keep_freed_memory
    applied = keep_freed_memory()
n = 16 * 2**20  # floats: 64 MiB
for _ in range(20):
    torch.ones(n)
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(5):
    torch.ones(n)
faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
print(json.dumps({"applied": applied, "faults": faults}))
"""

_PAGES = 5 * 64 * 2**20 // 4096  # pages of 4 KiB in five rounds of 64 MiB


def _thp_always() -> bool:
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            return "[always]" in f.read()
    except OSError:
        return False


# With transparent huge pages always on, fresh memory faults in 2 MiB at a time: the counts
# below assume 4 KiB pages.
needs_small_pages = pytest.mark.skipif(_thp_always(), reason="transparent huge pages: always")


def _probe(mode: str, env_value: str | None = None) -> dict[str, object]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
    env.pop("CAPSCTL_KEEP_MEMORY", None)
    if env_value is not None:
        env["CAPSCTL_KEEP_MEMORY"] = env_value
    out = subprocess.run(
        [sys.executable, "-c", _PROBE, mode], env=env, capture_output=True, text=True, check=True
    )
    return json.loads(out.stdout)


@needs_small_pages
def test_freed_memory_is_reused_without_page_faults() -> None:
    plain = _probe("plain")
    kept = _probe("apply")
    # Without the setting the block comes back from the OS and every page faults in again.
    assert plain["faults"] > _PAGES // 2, plain
    assert kept["applied"] is True
    assert kept["faults"] < _PAGES // 20, kept


@needs_small_pages
def test_env_var_zero_leaves_the_allocator_alone() -> None:
    off = _probe("apply", "0")
    assert off["applied"] is False
    assert off["faults"] > _PAGES // 2, off


def test_the_command_applies_it(monkeypatch: pytest.MonkeyPatch) -> None:
    import capsctl.memory
    from capsctl.cli import main

    calls: list[bool] = []
    monkeypatch.setattr(capsctl.memory, "keep_freed_memory", lambda: calls.append(True) or True)
    main(["models", "--json"])
    assert calls == [True]
