"""Every field of every config dataclass is a setting whose flag, ``LORAPLEX_*`` variable and
Helm value exist and round-trip to the field: a value given as a flag, as a variable, or as the
chart's value (rendered into the variable the chart sets) comes back as the field's value of
the config the command builds. And the chart sets nothing the dataclasses do not know."""

from __future__ import annotations

import argparse
import dataclasses
import os
from typing import Any

import pytest

from loraplex.server.cli import build_parser
from loraplex.server.commands import SERVE_GATEWAY_EXCLUDES, SERVE_WORKER_EXCLUDES
from loraplex.server.config import EngineConfig, GatewayConfig, StoreConfig, WorkerConfig
from loraplex.server.settings import SettingField, from_args, setting_of, settings_of
from tests.deploy.chart import VALUE_SETS, chart, render
from tests.deploy.pods import resolve
from tests.deploy.test_chart_flags import (
    CHART_MANAGED,
    ENV_SETTINGS,
    NOT_MAPPED,
    VALUE_MAPS,
    _snake,
)

# The configs each server command builds from its flags, with the fields it has no flag of
# its own for (serve's in-process worker listens where serve puts it).
CONFIGS: dict[str, dict[type, tuple[str, ...]]] = {
    "serve": {EngineConfig: (), GatewayConfig: SERVE_GATEWAY_EXCLUDES, StoreConfig: (),
              WorkerConfig: SERVE_WORKER_EXCLUDES},
    "gateway": {GatewayConfig: (), StoreConfig: ()},
    "worker": {WorkerConfig: (), StoreConfig: (), EngineConfig: ()},
}
# Settings the chart sets from its own structure that a values key still names.
CHART_PATHS = {
    "gateway": {"host": ("listenHost",), "port": ("gateway", "port"),
                "metrics_port": ("gateway", "metricsPort"),
                "max_rank": ("worker", "engine", "maxRank")},
    "worker": {"host": ("listenHost",), "port": ("worker", "port"),
               "metrics_port": ("worker", "metricsPort")},
}
# Fields whose generic sample (below) their config would refuse.
SAMPLES: dict[str, Any] = {"device": "cuda:1", "tenant_weights": "a=2,b=0.5"}


def _settings(command: str) -> list[SettingField]:
    return [sf for cls, skipped in CONFIGS[command].items() for sf in settings_of(cls)
            if sf.name not in skipped]


def _sample(sf: SettingField) -> Any:
    """A value of ``sf``'s flag that is not its default."""
    if sf.name in SAMPLES:
        return SAMPLES[sf.name]
    if sf.type is bool:
        return not sf.default
    if sf.setting.choices:
        return next(c for c in sf.setting.choices if c != sf.default)
    if sf.type is int:
        return (sf.default or 2) + 1
    if sf.type is float:
        return round(sf.default * 0.8, 6)
    return f"{sf.name}-sample"


def _expected(sf: SettingField) -> Any:
    value = _sample(sf)
    return sf.setting.parse(value) if sf.setting.parse is not None else value


def _field(configs: dict[type, Any], sf: SettingField) -> Any:
    """``sf``'s value in the configs the command built (nested configs included)."""
    for config in configs.values():
        for obj in (config, *(getattr(config, f.name) for f in dataclasses.fields(config))):
            if type(obj) is sf.owner:
                return getattr(obj, sf.name)
    raise AssertionError(f"{sf.owner.__name__} is built by no config of the command")


def _build(command: str, args: argparse.Namespace) -> dict[type, Any]:
    return {cls: from_args(cls, args) for cls in CONFIGS[command]}


def _check(command: str, args: argparse.Namespace, settings: list[SettingField],
           how: str) -> None:
    configs = _build(command, args)
    wrong = {sf.name: (_field(configs, sf), _expected(sf)) for sf in settings
             if _field(configs, sf) != _expected(sf)}
    assert not wrong, f"{how} of `loraplex {command}` that miss their field (got, want): {wrong}"


def _clear_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for key in [k for k in os.environ if k.startswith("LORAPLEX_")]:
        monkeypatch.delenv(key)


def _subparser(command: str) -> argparse.ArgumentParser:
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices[command]


@pytest.mark.parametrize("command", sorted(CONFIGS))
def test_every_field_has_its_flag(command: str, monkeypatch: pytest.MonkeyPatch) -> None:
    _clear_env(monkeypatch)
    flags = {a.dest: a for a in _subparser(command)._actions if a.option_strings}
    missing = [sf.name for sf in _settings(command) if sf.name not in flags
               or sf.flag not in flags[sf.name].option_strings]
    assert not missing, f"fields with no flag of `loraplex {command}`: {missing}"
    # With no flag and no variable, each field has its flag's default: the field's own, or
    # the setting's (``flag_default``) or this command's (``set_flag_default``) through
    # ``parse``.
    configs = _build(command, build_parser().parse_args([command]))
    wrong = {}
    for sf in _settings(command):
        default = (setting_of(flags[sf.name]) or sf).default
        want = sf.setting.parse(default) if sf.setting.parse is not None else default
        if _field(configs, sf) != want:
            wrong[sf.name] = (_field(configs, sf), want)
    assert not wrong, f"defaults of `loraplex {command}` (got, want): {wrong}"


@pytest.mark.parametrize("command", sorted(CONFIGS))
def test_flags_round_trip(command: str, monkeypatch: pytest.MonkeyPatch) -> None:
    _clear_env(monkeypatch)
    settings = _settings(command)
    argv = [command]
    for sf in settings:
        value = _sample(sf)
        if sf.type is bool:
            argv.append(sf.flag if value else f"--no-{sf.flag[2:]}")
        else:
            argv += [sf.flag, str(value)]
    _check(command, build_parser().parse_args(argv), settings, "flags")


def _env_text(value: Any) -> str:
    return str(value).lower() if isinstance(value, bool) else str(value)


@pytest.mark.parametrize("command", sorted(CONFIGS))
def test_variables_round_trip(command: str, monkeypatch: pytest.MonkeyPatch) -> None:
    _clear_env(monkeypatch)
    settings = _settings(command)
    for sf in settings:
        monkeypatch.setenv(sf.variable, _env_text(_sample(sf)))
    args = build_parser().parse_args([command])
    assert not args.env_errors
    _check(command, args, settings, "variables")


def _values_keys(command: str) -> dict[str, tuple[str, ...]]:
    """snake_case field name -> path of its key in values.yaml."""
    keys = {}
    for path in VALUE_MAPS[command]:
        node: Any = chart().values
        for part in path:
            node = node[part]
        keys.update({_snake(key): (*path, key) for key in node})
    return keys


@pytest.mark.parametrize("command", ["gateway", "worker"])
def test_every_field_has_a_helm_value(command: str) -> None:
    names = {sf.name for sf in _settings(command)}
    keys = set(_values_keys(command))
    unknown = keys - names
    assert not unknown, f"values.yaml keys that are no field of `loraplex {command}`: {unknown}"
    spelled = {sf.name: sf.helm_key for sf in _settings(command) if sf.name in keys}
    assert all(_values_keys(command)[name][-1] == key for name, key in spelled.items())
    missing = names - keys - CHART_MANAGED[command] - set(NOT_MAPPED[command])
    assert not missing, (f"fields of `loraplex {command}` with no Helm value: {missing}; add "
                         "them to values.yaml, values.schema.json and the chart's README")


def _set(values: dict[str, Any], path: tuple[str, ...], value: Any) -> None:
    for part in path[:-1]:
        values = values.setdefault(part, {})
    values[path[-1]] = value


@pytest.mark.parametrize("command", ["gateway", "worker"])
def test_helm_values_round_trip(command: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """values.yaml key -> the variable the chart renders -> the flag -> the field."""
    _clear_env(monkeypatch)
    paths = {**_values_keys(command), **CHART_PATHS[command]}
    settings = [sf for sf in _settings(command) if sf.name in paths]
    values: dict[str, Any] = {}
    for sf in settings:
        _set(values, paths[sf.name], _sample(sf))
    manifests = render(values)
    kind = "Deployment" if command == "gateway" else "StatefulSet"
    workload = next(m for m in manifests if m["kind"] == kind
                    and m["metadata"]["name"].endswith(f"-{command}"))
    secrets = {"loraplex-redis-password": {"redis-password": "x" * 32}}
    run = resolve(manifests, workload, command, secrets)
    for key, value in run.env.items():
        monkeypatch.setenv(key, value)
    args = build_parser().parse_args(run.argv[1:])
    assert args.command == command and not args.env_errors
    _check(command, args, settings, "Helm values")


@pytest.mark.parametrize("name", sorted(VALUE_SETS))
@pytest.mark.parametrize("command", ["gateway", "worker"])
def test_the_chart_sets_only_fields(name: str, command: str) -> None:
    manifests = render(VALUE_SETS[name])
    kind = "Deployment" if command == "gateway" else "StatefulSet"
    workload = next(m for m in manifests if m["kind"] == kind
                    and m["metadata"]["name"].endswith(f"-{command}"))
    secrets = {n: {"url": "redis://:x@redis.example:6379/0", "redis-password": "x" * 32}
               for n in ("loraplex-store", "loraplex-redis-password")}
    env = resolve(manifests, workload, command, secrets).env
    variables = {sf.variable for sf in _settings(command)} | ENV_SETTINGS
    unknown = {k for k in env if k.startswith("LORAPLEX_")} - variables
    assert not unknown, f"the chart sets {unknown}, which no config field of {command} reads"
