"""``server/settings.py``: a field declared with ``setting`` gets its flag, its variable and its
help line; ``from_args`` builds the config back; docs/service.md's table is the fields'."""

from __future__ import annotations

import argparse
import importlib.util
from dataclasses import dataclass
from pathlib import Path

import pytest

from loraplex.server.settings import (
    add_flags,
    apply_env,
    check_env,
    from_args,
    setting,
    setting_of,
)

REPO = Path(__file__).resolve().parents[2]


def _parse_pairs(text: str) -> tuple[str, ...]:
    return tuple(text.split(",")) if text else ()


@dataclass(frozen=True)
class Inner:
    page_size: int = setting(16, "tokens per page", unit="tokens")


@dataclass(frozen=True)
class Toy:
    name: str = setting("a", "a name")
    inner: Inner = Inner()
    limit: int | None = setting(None, "a limit", unit="bytes", default_text="the model's")
    fast: bool = setting(False, "go fast")
    mode: str = setting("x", "the mode", choices=("x", "y"))
    items: tuple[str, ...] = setting((), "items, comma-separated", parse=_parse_pairs,
                                     flag_default="")
    grace: float = setting(30.0, "how long to wait", unit="seconds", flag_default=5.0)


@dataclass(frozen=True)
class Other:
    grace: float = setting(1.0, "another grace")
    port: int = setting(7, "a port")


def _parser(*classes: type) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser()
    for cls in classes:
        add_flags(parser, cls)
    apply_env(parser)
    return parser


def test_flags_come_from_the_fields() -> None:
    args = _parser(Toy).parse_args(["--name", "b", "--page-size", "32", "--limit", "9",
                                    "--fast", "--mode", "y", "--items", "p,q", "--grace", "2"])
    assert from_args(Toy, args) == Toy(name="b", inner=Inner(32), limit=9, fast=True, mode="y",
                                       items=("p", "q"), grace=2.0)
    # No flags: the fields' defaults, or the command's own where the field declares one.
    assert from_args(Toy, _parser(Toy).parse_args([])) == Toy(grace=5.0)
    assert from_args(Toy, _parser(Toy).parse_args([]), name="c").name == "c"
    with pytest.raises(SystemExit):
        _parser(Toy).parse_args(["--mode", "z"])


def test_variables_set_the_defaults(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LORAPLEX_PAGE_SIZE", "8")
    monkeypatch.setenv("LORAPLEX_FAST", "yes")
    monkeypatch.setenv("LORAPLEX_ITEMS", "r")
    args = _parser(Toy).parse_args(["--page-size", "4"])
    assert (args.page_size, args.fast) == (4, True)
    assert from_args(Toy, args).items == ("r",)
    monkeypatch.setenv("LORAPLEX_MODE", "z")
    monkeypatch.setenv("LORAPLEX_FAST", "maybe")
    with pytest.raises(ValueError, match="LORAPLEX_FAST: 'maybe' is not true or false"):
        check_env(_parser(Toy).parse_args([]))


def test_a_shared_name_is_one_flag_the_first_configs() -> None:
    parser = _parser(Toy, Other)
    assert [a.dest for a in parser._actions].count("grace") == 1
    args = parser.parse_args(["--grace", "3", "--port", "8"])
    assert from_args(Other, args) == Other(grace=3.0, port=8)
    assert from_args(Toy, args).grace == 3.0


def test_help_says_what_unit_default_and_variable() -> None:
    help_text = " ".join(_parser(Toy).format_help().split())
    assert "--limit BYTES a limit (unit: bytes; default: the model's; env LORAPLEX_LIMIT)" in (
        help_text)
    assert "--grace SECONDS how long to wait (unit: seconds; default: 5.0; env " in help_text
    assert "--fast, --no-fast go fast (default: false; env LORAPLEX_FAST)" in help_text


def _subparsers() -> dict[str, argparse.ArgumentParser]:
    from loraplex.server.cli import build_parser

    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return {name: sub.choices[name] for name in ("serve", "gateway", "worker")}


@pytest.mark.parametrize("command", ["serve", "gateway", "worker"])
def test_every_server_flag_has_a_help_line_from_its_field(command: str) -> None:
    parser = _subparsers()[command]
    for action in parser._actions:
        if not action.option_strings or action.dest == "help":
            continue
        sf = setting_of(action)
        assert sf is not None, f"--{action.dest} of `loraplex {command}` is not a setting"
        assert action.help is not None and action.help.startswith(sf.setting.doc)
        assert f"default: {sf.default_text()}" in action.help
        assert sf.variable in action.help
        if sf.setting.unit:
            assert f"unit: {sf.setting.unit}" in action.help


def test_the_docs_flag_table_is_generated_from_the_fields() -> None:
    spec = importlib.util.spec_from_file_location("flag_table", REPO / "scripts/flag_table.py")
    assert spec is not None and spec.loader is not None
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    doc = (REPO / "docs" / "service.md").read_text()
    assert script.render(doc) == doc, "docs/service.md is stale: run scripts/flag_table.py"
    assert "| `--max-tokens-limit` | `LORAPLEX_MAX_TOKENS_LIMIT` | `32768` | tokens |" in doc
    assert "| `--port` | `LORAPLEX_PORT` | `50051` (worker `50061`) |  | serve, gateway, " in doc


def test_only_settings_read_variables(monkeypatch: pytest.MonkeyPatch) -> None:
    from loraplex.server.cli import build_parser

    monkeypatch.setenv("LORAPLEX_MAX_NUM_SEQS", "3")
    monkeypatch.setenv("LORAPLEX_MAX_TOKENS", "5")  # `run --max-tokens` is no setting
    args = build_parser().parse_args(["run"])
    assert (args.max_num_seqs, args.max_tokens) == (3, 32)
