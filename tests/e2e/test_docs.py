"""Every fenced code block of README.md and docs/*.md runs, or says why it cannot run here.

- A ```python block is executed on its own, in a fresh namespace, in a temporary working
  directory, under a time limit: each block is self-contained (its imports and its tiny data).
- A block preceded by ``<!-- not-run: REASON -->`` is not executed; the reason is required.
  One whose reason says it needs torchrun runs under torchrun on 2 processes (gloo, CPU).
- Shell blocks (```bash, ```sh, ```console) are not executed, but each ``mixprec SUBCOMMAND``
  they use must exist: ``mixprec SUBCOMMAND --help`` exits 0, once per subcommand.
- Other blocks (program output, untagged) are text.
- Relative links between the pages, to their headings and to the files beside them resolve.
"""

from __future__ import annotations

import re
import signal
import subprocess
import sys
import threading
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

import mixprec as mp
from mixprec.cli import main as cli_main
from tests.conftest import ROOT, subprocess_env

PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

PYTHON = {"python", "py"}
SHELL = {"bash", "sh", "shell", "console"}
FENCE = re.compile(r"^(?P<indent> {0,3})(?P<fence>`{3,}|~{3,})\s*(?P<lang>[\w+-]*)")
MARKER = re.compile(r"^\s*<!--\s*not-run\s*:?(?P<reason>.*?)-->\s*$")
# `mixprec SUB`, also as `python -m mixprec SUB` or `torchrun ... -m mixprec SUB`; not
# `mixprec[float8]` nor a path such as `src/mixprec`.
COMMAND = re.compile(r"(?<![\w./\[\]-])mixprec\s+(?P<sub>[a-z][a-z0-9-]*)")
# A doc block trains for a handful of steps; this only stops one that hangs.
BLOCK_TIMEOUT_S = 30


@dataclass(frozen=True)
class Block:
    page: Path
    line: int  # of the opening fence, 1-based
    lang: str
    code: str
    not_run: str | None  # the marker's reason; None when there is no marker

    @property
    def id(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}"


@dataclass(frozen=True)
class Marker:
    page: Path
    line: int
    reason: str
    before_block: bool


def parse(page: Path) -> tuple[list[Block], list[Marker]]:
    """The fenced blocks of one page, and every not-run marker with what follows it."""
    lines = page.read_text(encoding="utf-8").splitlines()
    blocks: list[Block] = []
    markers: list[Marker] = []
    pending: Marker | None = None  # a marker waiting for its block
    i = 0
    while i < len(lines):
        line = lines[i]
        marker = MARKER.match(line)
        fence = FENCE.match(line)
        if marker:
            if pending is not None:
                markers.append(pending)
            pending = Marker(page, i + 1, marker["reason"].strip(), before_block=False)
        elif fence:
            end = i + 1
            while end < len(lines) and not lines[end].lstrip().startswith(fence["fence"]):
                end += 1
            code = "\n".join(lines[i + 1 : end]) + "\n"
            reason = None
            if pending is not None:
                markers.append(Marker(page, pending.line, pending.reason, before_block=True))
                reason, pending = pending.reason, None
            blocks.append(Block(page, i + 1, fence["lang"].lower(), code, reason))
            i = end
        elif line.strip() and pending is not None:
            markers.append(pending)  # text between a marker and its block: not attached
            pending = None
        i += 1
    if pending is not None:
        markers.append(pending)
    return blocks, markers


BLOCKS: list[Block] = []
MARKERS: list[Marker] = []
for _page in PAGES:
    _blocks, _markers = parse(_page)
    BLOCKS += _blocks
    MARKERS += _markers

RUN = [b for b in BLOCKS if b.lang in PYTHON and b.not_run is None]
TORCHRUN = [b for b in BLOCKS if b.lang in PYTHON and b.not_run and "torchrun" in b.not_run]


def subcommands() -> list[str]:
    found: set[str] = set()
    for block in BLOCKS:
        if block.lang in SHELL:
            for line in block.code.splitlines():
                line = line.split("#", 1)[0]  # a comment is prose
                found.update(m["sub"] for m in COMMAND.finditer(line))
    return sorted(found)


@contextmanager
def time_limit(seconds: int, what: str) -> Iterator[None]:
    if threading.current_thread() is not threading.main_thread():  # signals: main thread only
        yield
        return

    def expire(signum: int, frame: object) -> None:
        raise TimeoutError(f"{what} ran for more than {seconds} s")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


@pytest.fixture
def isolated(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """A block's files go to a temporary folder; the global state it may touch comes back."""
    monkeypatch.chdir(tmp_path)
    policy = mp.global_policy()
    threads = torch.get_num_threads()
    dtype = torch.get_default_dtype()
    # A block's warnings are what the page shows a user (GradScaler("cuda") without CUDA
    # warns), not failures of the page: recorded and dropped.
    with torch.random.fork_rng(), warnings.catch_warnings(record=True):
        warnings.simplefilter("always")
        yield
    mp.set_global_policy(policy)
    torch.set_num_threads(threads)
    torch.set_default_dtype(dtype)


def test_pages_have_runnable_blocks() -> None:
    # The parser found the pages' code: a broken fence pattern would make every test vacuous.
    assert (ROOT / "README.md") in {b.page for b in RUN}
    assert len(RUN) >= 10
    assert subcommands()


def test_not_run_markers_say_why() -> None:
    problems = [
        f"{m.page.relative_to(ROOT)}:{m.line}: "
        + ("no reason given" if not m.reason else "not followed by a fenced code block")
        for m in MARKERS
        if not m.reason or not m.before_block
    ]
    assert not problems, "\n".join(problems)


LINK = re.compile(r"\]\((?!https?://|mailto:)(?P<path>[^)#\s]*)(?:#(?P<anchor>[^)\s]*))?\)")


def anchors(page: Path) -> set[str]:
    """GitHub's anchors of a page's headings: lower case, punctuation dropped, spaces to -."""
    found = set()
    fenced = False
    for line in page.read_text(encoding="utf-8").splitlines():
        if FENCE.match(line):
            fenced = not fenced
        elif not fenced and line.startswith("#"):
            title = line.lstrip("#").strip().lower()
            found.add(re.sub(r"[^\w\- ]", "", title).replace(" ", "-"))
    return found


def test_relative_links_resolve() -> None:
    # Pages link to each other, to their headings, and to the charts and JSON beside them.
    problems = []
    for page in PAGES:
        text = page.read_text(encoding="utf-8")
        for link in LINK.finditer(text):
            target = (page.parent / link["path"]).resolve() if link["path"] else page
            line = text[: link.start()].count("\n") + 1
            where = f"{page.relative_to(ROOT)}:{line}: {link.group(0)}"
            if not target.exists():
                problems.append(f"{where}: no such file")
            elif (
                link["anchor"] and target.suffix == ".md" and link["anchor"] not in anchors(target)
            ):
                problems.append(f"{where}: no such heading")
    assert not problems, "\n".join(problems)


def test_not_run_blocks_parse() -> None:
    # A block that is not run is still read by users: it must at least be valid Python.
    for block in BLOCKS:
        if block.lang in PYTHON and block.not_run is not None:
            compile("\n" * block.line + block.code, str(block.page), "exec")


@pytest.mark.parametrize(
    "block",
    # A block that uses a float8 policy runs float8 matmuls: skipped where the CPU has none.
    [pytest.param(b, marks=[pytest.mark.float8] if "mixed_float8" in b.code else []) for b in RUN],
    ids=[b.id for b in RUN],
)
def test_python_block_runs(block: Block, isolated: None) -> None:
    # Padded so that a traceback's line numbers are the page's own.
    compiled = compile("\n" * block.line + block.code, str(block.page), "exec")
    namespace: dict[str, object] = {"__name__": "__docs__"}
    with time_limit(BLOCK_TIMEOUT_S, block.id):
        exec(compiled, namespace)


@pytest.mark.parametrize("sub", subcommands())
def test_cli_subcommand_exists(sub: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        cli_main([sub, "--help"])
    assert exit_.value.code == 0, f"`mixprec {sub} --help` exited {exit_.value.code}"
    assert "usage: mixprec" in capsys.readouterr().out


def test_torchrun_blocks_are_found() -> None:
    # The distributed and FSDP2 examples: a renamed marker must not make the test below empty.
    assert len(TORCHRUN) >= 2


@pytest.mark.parametrize("block", TORCHRUN, ids=[b.id for b in TORCHRUN])
def test_torchrun_block_runs_on_two_processes(block: Block, tmp_path: Path) -> None:
    script = tmp_path / "block.py"
    script.write_text("\n" * block.line + block.code, encoding="utf-8")
    env = subprocess_env(torchrun=True)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           str(script)]  # fmt: skip
    done = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, f"{block.id}:\n{done.stdout[-2000:]}\n{done.stderr[-3000:]}"
