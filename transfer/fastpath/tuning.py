"""How the same-host fast path copies and calls: frozen values, passed down, never set globally.

The defaults are what the daemons serve with (BENCHMARKS.md records the runs
that chose them); ``bench/fastpath_probe.py`` passes others to compare.
``CopyTuning`` reaches the copies (``rangecopy``, ``poolcopy``, ``devcopy``);
``FastPathTuning`` is what ``FastPath.fetch`` uses, its copies included.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class CopyTuning:
    # Layers per copy of a range between GPUs: each group's digest runs while the next groups copy.
    group_layers: int = 8
    # The last group is cut in halves down to this many layers (what is left after the
    # last copy is the digest of the last group and its trip to the host).
    last_group_min_layers: int = 2
    # Between two GPUs, run the copies on the source's stream (True) or the destination's.
    push: bool = True
    # Call the CUDA runtime holding the GIL (the calls only queue work, microseconds
    # each): a thread that lets the GIL go for each one may wait to get it back.
    keep_gil: bool = True

    def __post_init__(self) -> None:
        for name in ("group_layers", "last_group_min_layers"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {name}={value!r}")
        for name in ("push", "keep_gil"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"{name} must be a bool, got {name}={getattr(self, name)!r}")


@dataclass(frozen=True)
class FastPathTuning:
    # Descriptors on a channel of their own, read by the fetching thread (``KVClient.channel(direct=True)``).
    direct_descriptors: bool = True
    # Ranks on other GPUs prepare first (``CopyOrder.may_prepare``); False: any rank prepares at once.
    prepare_in_order: bool = True
    # With ``FastPath.copy_at_end``, a fetch that begins while the prefill runs calls the
    # rank once the prefill has answered (``FetchJob.written``), then copies every layer
    # at once from where the owner-lane rule puts it. False: it calls at once, and the
    # rank wakes and sends a descriptor pair per layer while its prefill runs; on one
    # H200 that slowed a 1k-token prefill (BENCHMARKS.md).
    wait_for_answer: bool = True
    copy: CopyTuning = field(default_factory=CopyTuning)

    def __post_init__(self) -> None:
        for name in ("direct_descriptors", "prepare_in_order", "wait_for_answer"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"{name} must be a bool, got {name}={getattr(self, name)!r}")
        if not isinstance(self.copy, CopyTuning):
            raise TypeError(f"copy must be a CopyTuning, got copy={self.copy!r}")


# The defaults as values (frozen, so sharing them is safe).
DEFAULT_COPY = CopyTuning()
DEFAULT_FAST_PATH = FastPathTuning()
