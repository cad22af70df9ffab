"""One source for every setting: a field of a frozen config dataclass, made with ``setting``.

Everything else is derived from the field (name, type, default, doc line), never written
beside it:

- the flag ``--<name-with-dashes>`` (``add_flags``): argparse type from the annotation,
  ``--x / --no-x`` for a bool, choices, default;
- its variable ``LORAPLEX_<NAME>``, which sets the flag's default (``apply_env``);
- its help line: what it is, its unit, its default and its variable;
- its Helm value ``<nameInCamelCase>`` in the component's values map (the chart renders it
  as the variable: ``helm/loraplex/templates/configmap.yaml``);
- its row in docs/service.md's table (``flag_table``; ``scripts/flag_table.py`` rewrites it).

A config is built back from parsed flags by ``from_args``. Adding a setting is one line:

    max_queue: int = setting(256, "requests admitted but not running, at most",
                             unit="requests")

A field whose type is itself a config dataclass (``EngineConfig.scheduler``) contributes its
settings flattened: ``SchedulerConfig.page_size`` is ``--page-size``.
"""

from __future__ import annotations

import argparse
import dataclasses
import typing
import weakref
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

from loraplex.server import env

_KEY = "loraplex.setting"
_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off", "")
_SCALARS = (bool, int, float, str)
_FIELD_DEFAULT = object()  # ``flag_default`` unset: the flag's default is the field's


@dataclasses.dataclass(frozen=True)
class Setting:
    """What a field's flag needs beyond its name, type and default.

    Attributes:
        doc: what the setting is, in a few words (the help line, the docs table).
        unit: ``seconds``, ``bytes``, ``tokens``, ... ("" for none).
        choices: the values allowed (the flag refuses others).
        parse: flag value -> field value, for a field the command line spells differently
            (``"a=2,b=1"`` -> pairs; ``-1`` -> None). Applied by ``from_args``.
        flag_default: the command's default when it is not the field's (a server started
            by hand serves metrics; one built in code does not unless asked).
        default_text: how help shows a default its value says little about (``the model's``).
        metavar: the value's name in usage lines.
    """

    doc: str
    unit: str = ""
    choices: tuple[str, ...] | None = None
    parse: Callable[[Any], Any] | None = None
    flag_default: Any = _FIELD_DEFAULT
    default_text: str = ""
    metavar: str | None = None


def setting(default: Any, doc: str, **kwargs: Any) -> Any:
    """A dataclass field that is a setting: ``default``, its doc line and ``Setting``'s other
    attributes (``unit=``, ``choices=``, ``parse=``, ...)."""
    return dataclasses.field(default=default, metadata={_KEY: Setting(doc, **kwargs)})


class SettingField(NamedTuple):
    """One setting of a config class, as its flag sees it."""

    name: str
    setting: Setting
    type: Any  # the flag's argparse type: bool, int, float or str
    default: Any  # the flag's default (the field's unless ``flag_default``)
    owner: type  # the config class that declares it

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")

    @property
    def variable(self) -> str:
        return f"LORAPLEX_{self.name.upper()}"

    @property
    def helm_key(self) -> str:
        head, *rest = self.name.split("_")
        return head + "".join(part.capitalize() for part in rest)

    def default_text(self) -> str:
        return self.setting.default_text or format_value(self.default, self.setting.unit)

    def help(self) -> str:
        """The ``--help`` line: what it is, its unit, its default, its variable."""
        meta = [f"unit: {self.setting.unit}"] if self.setting.unit else []
        meta += [f"default: {self.default_text()}", f"env {self.variable}"]
        return f"{self.setting.doc} ({'; '.join(meta)})".replace("%", "%%")


def _nested(tp: Any) -> type | None:
    """The config class a field's type names, if it is one."""
    return tp if isinstance(tp, type) and dataclasses.is_dataclass(tp) else None


def _flag_type(tp: Any) -> Any:
    """bool / int / float / str from ``int``, ``int | None``, ...; str for anything else (a
    field of another type needs ``parse``)."""
    args = [a for a in typing.get_args(tp) if a is not type(None)] or [tp]
    return args[0] if len(args) == 1 and args[0] in _SCALARS else str


def settings_of(cls: type) -> Iterator[SettingField]:
    """Every setting of config class ``cls``, nested config fields flattened, in order."""
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        s = f.metadata.get(_KEY)
        if s is None:
            nested = _nested(hints[f.name])
            if nested is not None:
                yield from settings_of(nested)
            continue
        default = f.default if s.flag_default is _FIELD_DEFAULT else s.flag_default
        yield SettingField(f.name, s, _flag_type(hints[f.name]), default, cls)


def format_value(value: Any, unit: str = "") -> str:
    """A default as help and the docs show it."""
    if value is None or value == "" or value == ():
        return "none"
    if isinstance(value, bool):
        return str(value).lower()
    if unit == "bytes" and isinstance(value, int) and value >= 1024:
        size, units = value / 1024, ["KiB", "MiB", "GiB", "TiB"]
        while size >= 1024 and len(units) > 1:
            size /= 1024
            units.pop(0)
        return f"{value} ({size:g} {units[0]})"
    return str(value)


# Each flag's setting, for the docs table (actions are hashable by identity).
_ACTIONS: weakref.WeakKeyDictionary[argparse.Action, SettingField] = (
    weakref.WeakKeyDictionary())


def add_flags(parser: argparse.ArgumentParser, cls: type, *, only: tuple[str, ...] = (),
              exclude: tuple[str, ...] = ()) -> None:
    """Add a flag for each setting of ``cls`` (those in ``only`` when given, less
    ``exclude``). A setting whose flag the parser already has is skipped: two configs that
    share a name (``drain_grace`` of the gateway and the worker of ``serve``) share the flag,
    the first one's."""
    taken = {a.dest for a in parser._actions}
    for sf in settings_of(cls):
        if sf.name in taken or sf.name in exclude or (only and sf.name not in only):
            continue
        kwargs: dict[str, Any] = {"dest": sf.name, "default": sf.default, "help": sf.help()}
        if sf.type is bool:
            kwargs["action"] = argparse.BooleanOptionalAction
        else:
            unit = sf.setting.unit
            metavar = sf.setting.metavar or (unit.upper() if unit.isalpha() else None)
            kwargs.update(type=sf.type, choices=sf.setting.choices, metavar=metavar)
        _ACTIONS[parser.add_argument(sf.flag, **kwargs)] = sf


def set_flag_default(parser: argparse.ArgumentParser, name: str, value: Any) -> None:
    """Give one command's flag of setting ``name`` another default than its field's (its help
    line and the docs table follow). Raises KeyError when the parser has no such flag."""
    for action in parser._actions:
        sf = setting_of(action)
        if sf is not None and sf.name == name:
            sf = sf._replace(default=value)
            action.default = value
            action.help = sf.help()
            _ACTIONS[action] = sf
            return
    raise KeyError(name)


def setting_of(action: argparse.Action) -> SettingField | None:
    """The setting an ``add_flags`` flag was made from (None for other flags)."""
    return _ACTIONS.get(action)


def from_args(cls: type, args: argparse.Namespace, **overrides: Any) -> Any:
    """A ``cls`` from parsed flags: each field from its flag (through ``parse``), nested
    configs likewise, ``overrides`` over both; a field the command has no flag for keeps its
    default. Raises ValueError (the config's validation, naming the field)."""
    hints = typing.get_type_hints(cls)
    values: dict[str, Any] = {}
    for f in dataclasses.fields(cls):
        if f.name in overrides:
            values[f.name] = overrides[f.name]
            continue
        s = f.metadata.get(_KEY)
        nested = _nested(hints[f.name])
        if s is None and nested is not None:
            values[f.name] = from_args(nested, args)
        elif s is not None and hasattr(args, f.name):
            value = getattr(args, f.name)
            values[f.name] = s.parse(value) if s.parse is not None else value
    return cls(**values)


def apply_env(parser: argparse.ArgumentParser) -> None:
    """``LORAPLEX_<NAME>`` sets the default of each setting's flag (other flags read no
    variable). Typed values are converted by argparse (so a bad number is a usage error); bad
    booleans and choices are collected in ``args.env_errors`` and reported by ``check_env``
    when the command runs."""
    errors = []
    for action in parser._actions:
        if setting_of(action) is None:
            continue
        value = env.get(action.dest)
        if value is None:
            continue
        name = f"LORAPLEX_{action.dest.upper()}"
        if action.nargs == 0:
            if value.lower() in _TRUE + _FALSE:
                action.default = value.lower() in _TRUE
            else:
                errors.append(f"{name}: {value!r} is not true or false")
        elif action.choices is not None and value not in action.choices:
            errors.append(f"{name}: {value!r} is not one of {sorted(action.choices)}")
        else:
            action.default = value
    parser.set_defaults(env_errors=errors)


def check_env(args: argparse.Namespace) -> None:
    """Raise the ``ValueError`` naming every bad variable ``apply_env`` found."""
    if getattr(args, "env_errors", None):
        raise ValueError("; ".join(args.env_errors))


def _doc_default(sf: SettingField) -> str:
    text = sf.default_text()
    return text if sf.setting.default_text or text == "none" else f"`{text}`"


def flag_table(parsers: dict[str, argparse.ArgumentParser]) -> str:
    """docs/service.md's table of the settings' flags of ``parsers`` (command -> parser): one
    row per setting, its default per command where they differ."""
    rows: dict[str, tuple[SettingField, dict[str, str]]] = {}
    for command, parser in parsers.items():
        for action in parser._actions:
            sf = setting_of(action)
            if sf is not None:
                rows.setdefault(sf.name, (sf, {}))[1][command] = _doc_default(sf)
    lines = ["| flag | variable | default | unit | commands | meaning |",
             "|---|---|---|---|---|---|"]
    for sf, defaults in rows.values():
        flag = f"`{sf.flag}`"
        if sf.type is bool:
            flag += f" / `--no-{sf.flag[2:]}`"
        first = next(iter(defaults.values()))
        default = first + "".join(
            f" ({command} {text})" for command, text in defaults.items() if text != first)
        lines.append(f"| {flag} | `{sf.variable}` | {default} | {sf.setting.unit} | "
                     f"{', '.join(defaults)} | {sf.setting.doc} |")
    return "\n".join(lines) + "\n"
