"""Where flag defaults come from besides config.py: a `--config FILE` (YAML or JSON) and
`ADASERVE_<FIELD>` environment variables. Precedence, as vLLM has it: the command line, then
the environment, then the config file, then config.py.

Both are applied by running the flag's own argparse action on the value, so a file or a
variable is parsed and checked exactly as the same flag on the command line is; what they
set becomes the parser's defaults, which the command line then overrides.
"""

from __future__ import annotations

import argparse
import difflib
import json
import os
import sys
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from adaserve.config import CacheConfig, ModelConfig, SchedulerConfig, ServerConfig
from adaserve.config_flags import ExtendList, argument_group, config_fields, parse_bool

ENV_PREFIX = "ADASERVE_"
CONFIG_FLAG = "--config"
# Fields that read ADASERVE_<FIELD>: every config field a command has a flag for.
ENV_FIELDS = frozenset(config_fields((ModelConfig, CacheConfig, SchedulerConfig, ServerConfig)))


def env_var(field_name: str) -> str:
    return ENV_PREFIX + field_name.upper()


def add_config_file_argument(p: argparse.ArgumentParser) -> None:
    argument_group(p, "config sources").add_argument(
        CONFIG_FLAG,
        metavar="FILE",
        help="YAML (needs pyyaml) or JSON file of flag values, keys spelled as the flags "
        "without '--' (max-num-seqs or max_num_seqs); ADASERVE_CONFIG names one too",
    )


class LayeredParser(argparse.ArgumentParser):
    """An ArgumentParser that, when it has a --config flag, takes its defaults from the config
    file and then the ADASERVE_* variables before it parses the command line."""

    # Each flag's default before any layer, so a second parse starts from config.py again.
    _base_defaults: list[tuple[argparse.Action, Any]] | None = None

    def parse_known_args(  # type: ignore[override]
        self, args: Iterable[str] | None = None, namespace: argparse.Namespace | None = None
    ) -> tuple[argparse.Namespace, list[str]]:
        argv = list(sys.argv[1:] if args is None else args)
        if CONFIG_FLAG in self._option_string_actions:
            if self._base_defaults is None:
                self._base_defaults = [(action, action.default) for action in self._actions]
            for action, default in self._base_defaults:
                action.default = default
                self._defaults.pop(action.dest, None)
            self.set_defaults(**layered_defaults(self, argv, os.environ))
        return super().parse_known_args(argv, namespace)


def layered_defaults(
    p: argparse.ArgumentParser, argv: list[str], environ: Mapping[str, str]
) -> dict[str, Any]:
    """dest -> value from the config file, then the environment over it."""
    out = argparse.Namespace()
    path = config_path(p, argv) or environ.get(env_var("config"))
    if path:
        for key, value in read_config_file(p, path).items():
            option, action = config_key_action(p, path, key)
            run_action(p, action, option, value, out, f"{path}: {key}")
    seen: set[str] = set()  # a field's own flag, not an alias sharing its dest (vLLM's)
    for action in p._actions:
        var = env_var(action.dest)
        if action.dest in ENV_FIELDS and action.dest not in seen and var in environ:
            seen.add(action.dest)
            if hasattr(out, action.dest):  # the variable replaces the file's value
                delattr(out, action.dest)
            flag = action.option_strings[0] if action.option_strings else None
            run_action(p, action, flag, environ[var], out, var)
    return vars(out)


def config_path(p: argparse.ArgumentParser, argv: list[str]) -> str | None:
    """The --config value on the command line (argparse's abbreviations included)."""
    for i, arg in enumerate(argv):
        option, eq, value = arg.partition("=")
        spelled = [s for s in p._option_string_actions if s.startswith(option)]
        if option.startswith("--") and (option == CONFIG_FLAG or spelled == [CONFIG_FLAG]):
            if eq:
                return value
            if i + 1 < len(argv):
                return argv[i + 1]
            p.error(f"{CONFIG_FLAG} needs a FILE")
    return None


def read_config_file(p: argparse.ArgumentParser, path: str) -> dict[str, Any]:
    file = Path(path).expanduser()
    try:
        text = file.read_text()
    except OSError as e:
        p.error(f"--config {path}: {e.strerror or e}")
    if file.suffix == ".json":
        try:
            data = json.loads(text)
        except ValueError as e:
            p.error(f"--config {path}: not JSON: {e}")
    else:
        try:
            import yaml
        except ImportError:
            p.error(f"--config {path}: YAML needs pyyaml (pip install pyyaml), or give a .json")
        try:
            data = yaml.safe_load(text)
        except yaml.YAMLError as e:
            p.error(f"--config {path}: not YAML: {e}")
    if data is None:
        return {}
    if not isinstance(data, dict):
        p.error(f"--config {path}: expected a mapping of flag names to values")
    return data


def config_key_action(
    p: argparse.ArgumentParser, path: str, key: str
) -> tuple[str | None, argparse.Action]:
    """The option string (None: a positional such as model) and action a config file key
    names; an unknown key is an error."""
    option = "--" + str(key).replace("_", "-")
    for action in p._actions:
        if not action.option_strings and action.dest == str(key).replace("-", "_"):
            return None, action
    flag = p._option_string_actions.get(option)
    if flag is None or option in (CONFIG_FLAG, "--help"):
        known = [s[2:] for s in p._option_string_actions if s.startswith("--")]
        close = difflib.get_close_matches(option[2:], known, n=3)
        hint = f"; did you mean {', '.join(close)}?" if close else ""
        p.error(f"--config {path}: unknown key {key!r}{hint}")
    return option, flag


def run_action(
    p: argparse.ArgumentParser,
    action: argparse.Action,
    option: str | None,
    value: Any,
    out: argparse.Namespace,
    source: str,
) -> None:
    """Apply `value` (a file's value or a variable's text) as if `option value` were given."""
    try:
        if action.nargs == 0:  # a switch: --x / --no-x, or a store_const such as vLLM's
            on = value if isinstance(value, bool) else parse_bool(str(value))
            if isinstance(action, argparse.BooleanOptionalAction):
                action(p, out, None, option if on else negated(option))
            elif on:
                action(p, out, None, option)
            return
        if isinstance(action, ExtendList) and isinstance(value, list | tuple):
            parsed = sum((convert(action, as_text(v)) for v in value), ())
        else:
            parsed = convert(action, as_text(value))
        action(p, out, parsed, option)
    except (argparse.ArgumentError, argparse.ArgumentTypeError, ValueError, TypeError) as exc:
        p.error(f"{source}: {exc}")


def convert(action: argparse.Action, text: str) -> Any:
    value = action.type(text) if callable(action.type) else text
    if action.choices is not None and value not in action.choices:
        choices = ", ".join(map(str, action.choices))
        raise ValueError(f"invalid choice {value!r} (choose from {choices})")
    return value


def negated(option: str | None) -> str:
    assert option is not None
    return "--" + option[5:] if option.startswith("--no-") else "--no-" + option[2:]


def as_text(value: Any) -> str:
    """A YAML/JSON value as the flag's text: lists comma-separated, mappings as JSON."""
    if isinstance(value, bool):
        return str(value).lower()
    if value is None:
        return "none"
    if isinstance(value, list | tuple):
        return ",".join(as_text(v) for v in value)
    if isinstance(value, dict):
        return json.dumps(value)
    return str(value)
