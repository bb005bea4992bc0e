"""``max_batch``'s fresh-process probes, run in this process: a fake pool shared by the
bench and CLI tests."""

from __future__ import annotations

from typing import Any


def fake_pool(monkeypatch: Any, mb_per_sample: float) -> None:
    """Probes in this process, where a step peaks at ``mb_per_sample`` MB a sample."""
    from mixprec.bench import memory

    class Pool:
        def __init__(self, processes: int) -> None: ...

        def __enter__(self) -> Pool:
            return self

        def __exit__(self, *exc: object) -> None: ...

        def apply(self, fn: Any, args: Any) -> Any:
            return fn(*args)

    class Context:
        def Pool(self, processes: int) -> Pool:  # noqa: N802 (multiprocessing's name)
            return Pool(processes)

    monkeypatch.setattr(memory.multiprocessing, "get_context", lambda method: Context())
    monkeypatch.setattr(memory, "_peak_memory", lambda args: mb_per_sample * args[5])
