"""``--help`` of every command but ``bench``: a description for each option and argument,
and each option's default (issue 33 item 8), read from the help text as a user reads it."""

from __future__ import annotations

import re

import pytest

from mixprec import cli


def help_of(command: str, capsys: pytest.CaptureFixture[str]) -> str:
    with pytest.raises(SystemExit) as done:
        cli.main([command, "--help"])
    assert done.value.code == 0
    return capsys.readouterr().out


def described(text: str) -> dict[str, str]:
    """Each option's (``--model``) or argument's (``checkpoint``) help, its wrapped lines
    joined: the entries of the ``options:`` and ``positional arguments:`` sections."""
    entries: dict[str, str] = {}
    key = None
    section = False
    for line in text.splitlines():
        if line in ("options:", "positional arguments:"):
            section = True
        elif not line.strip():
            section, key = False, None
        elif section and re.match(r"^  \S", line):  # an entry: its invocation, maybe help
            invocation, _, helptext = line.strip().partition("  ")
            key = invocation.split(", ")[-1].split(" ")[0]
            entries[key] = helptext.strip()
        elif section and key is not None:  # a wrapped line of the entry's help
            entries[key] = f"{entries[key]} {line.strip()}".strip()
    return entries


DEFAULTS = {
    "train": {
        "--model": "mlp", "--data": "digits", "--policy": "auto", "--level": "auto",
        "--batch-size": "256", "--seed": "0", "--hidden": "2048", "--epochs": "20",
        "--lr": "0.001", "--compare": "float32",
    },
    "doctor": {
        "--model": "mlp", "--data": "digits", "--policy": "mixed_float16", "--level": "auto",
        "--batch-size": "256", "--seed": "0",
    },
    "convert": {"--dtype": "float32", "--on-range": "error"},
    "inspect": {},
    "info": {},
}  # fmt: skip


@pytest.mark.parametrize("command", list(DEFAULTS))
def test_help_describes_every_option_and_shows_its_default(command, capsys):
    text = help_of(command, capsys)
    entries = described(text)
    assert f"mixprec {command}: " in text  # the command's description
    usage = text.split("\n\n")[0]
    named = set(re.findall(r"(?<![\w-])(--[\w-]+)", usage))
    assert named <= set(entries), f"{sorted(named - set(entries))} missing from the help"
    for name, helptext in entries.items():
        assert helptext, f"{command} {name} has no description"
    for name, default in DEFAULTS[command].items():
        assert entries[name].endswith(f"(default: {default})"), entries[name]
    # Flags and options without a default do not show a meaningless one.
    assert not any(h.endswith(("(default: None)", "(default: False)")) for h in entries.values()), (
        entries
    )


def test_train_help_explains_a_user_model_and_data(capsys):
    entries = described(text := help_of("train", capsys))
    assert "mlp or cnn" in entries["--model"] and "module:function" in entries["--model"]
    assert "mnist:DIR" in entries["--data"] and "module:function" in entries["--data"]
    assert "Adam's learning rate" in entries["--lr"]
    flat = " ".join(text.split())
    assert (
        "--model module:function: a function that takes no arguments and returns a "
        "torch.nn.Module" in flat
    )
    assert "((x_train, y_train), (x_test, y_test))" in flat and "PYTHONPATH" in flat


def test_the_docs_count_and_list_every_subcommand():
    """docs/cli.md said "six subcommands" beside a table of seven."""
    from pathlib import Path

    from mixprec.cli.parser import COMMANDS

    text = (Path(__file__).parents[2] / "docs" / "cli.md").read_text()
    count = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine"]
    assert f"has {count[len(COMMANDS)]} subcommands:" in text
    table = [line for line in text.splitlines() if line.startswith("| `mixprec ")]
    assert sorted(line.split("`")[1] for line in table) == sorted(f"mixprec {n}" for n in COMMANDS)
