"""Reading a spec: YAML → validated `SweepConfig`, `--set dotted.key=value` overrides, and every bad input as one
`UserError` line naming the file, the dotted key, the value and the fix. Also the resolved spec as YAML and the
schema's keys (docs/reference/spec.md)."""

from __future__ import annotations

import difflib
import re
import shlex
from pathlib import Path
from typing import Any, get_args

import yaml
from pydantic import BaseModel, ValidationError

from raysweep.config.knobs import DISTRIBUTIONS
from raysweep.config.sections import SearchConfig
from raysweep.config.spec import SweepConfig
from raysweep.errors import UserError


class _Loader(yaml.SafeLoader):
    """SafeLoader that reads `1e-4` as a float (YAML 1.1, which PyYAML follows, needs `1.0e-4`)."""


_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:[0-9][0-9_]*(?:\.[0-9_]*)?|\.[0-9_]+)[eE][-+]?[0-9]+$"),
    list("-+0123456789."),
)


def parse_yaml(text: str, source: str) -> Any:
    try:
        return yaml.load(text, Loader=_Loader)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" line {mark.line + 1} column {mark.column + 1}" if mark else ""
        problem = getattr(e, "problem", None) or str(e).splitlines()[0]
        raise UserError(f"{source}:{where}: invalid YAML: {problem}") from None


def load_config(path: str | Path, overrides: list[str] = (), sweep: bool = True, trial: bool = True) -> SweepConfig:
    """Read a spec file, apply `--set dotted.key=value` overrides, validate what the command runs (`sweep`: `tune`,
    the whole search; else `trial`: `train`, one trial at the defaults; neither: `probe`, which trains none)."""
    path = Path(path)
    if not path.is_file():
        raise UserError(f"{path}: no such spec file (see search_spaces/ for examples)")
    raw = parse_yaml(path.read_text(), str(path))
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise UserError(f"{path}: expected a mapping of sections (name, data, train, ...), got {type(raw).__name__}")
    if "name" not in raw:  # named after its file, not the default's `quickstart`: its results stay its own
        raw["name"] = re.sub(r"[^A-Za-z0-9_.-]", "-", path.stem).lstrip("_.-") or "sweep"
    overridden = {}
    for item in overrides:
        key, value = _apply_override(raw, item)
        overridden[key] = item
    try:
        config = SweepConfig.model_validate(raw)
    except ValidationError as e:
        raise UserError(_describe(e, str(path), overridden)) from None
    config._source = str(path) + "".join(f" (--set {item})" for item in overrides)
    config._spec_dir = str(path.resolve().parent)
    config._args = command_args(str(path), overrides)
    _check_paths(config, str(path))
    problem = config.sweep_problem() if sweep else config.trial_problem(searched=False) if trial else None
    if problem:
        raise UserError(f"{_source(str(path), problem.split(':', 1)[0], overridden)}: {problem}")
    return config


STORE_KEY = "mlflow.tracking_uri"  # the key --tracking-uri sets (cli._with_store)


def command_args(path: str, overrides: list[str], store_flag: bool = True) -> str:
    """The spec and its --set overrides as a command line takes them. `store_flag`: the store as --tracking-uri
    (last: the flag overrides the spec and every --set), as the commands an answer prints take it (confirm, answer,
    report); without it (`tune`, which has no such flag) every override stays a --set."""
    stores = [item for item in overrides if item.split("=", 1)[0].strip() == STORE_KEY] if store_flag else []
    words = [path, *(w for item in overrides if item not in stores for w in ("--set", item))]
    if stores:
        words += ["--tracking-uri", stores[-1].split("=", 1)[1]]
    return " ".join(shlex.quote(word) for word in words)


def _apply_override(raw: dict, item: str) -> tuple[str, Any]:
    key, sep, text = item.partition("=")
    key = key.strip()
    if not sep or not key:
        raise UserError(f"--set {item!r}: expected dotted.key=value, e.g. --set train.epochs=2")
    value = parse_yaml(text, f"--set {key}")
    node = raw
    parts = key.split(".")
    for i, part in enumerate(parts[:-1]):
        child = node.get(part)
        if child is None:
            child = node[part] = {}
        if not isinstance(child, dict):
            raise UserError(f"--set {item}: '{'.'.join(parts[: i + 1])}' is a value, not a section")
        node = child
    node[parts[-1]] = value
    return key, value


def _check_paths(config: SweepConfig, source: str) -> None:
    for key in ("train_dir", "val_dir"):
        folder = getattr(config.data, key)
        if folder is not None and not folder.is_dir():
            raise UserError(
                f"{source}: data.{key}: no such folder {str(folder)!r} (relative paths start from the "
                f"working directory; set data.{key}: null for the synthetic set)"
            )


def _dotted(loc: tuple) -> str:
    """`('search', 'base_lr', 'loguniform', 'loguniform', 0)` → `search.base_lr.loguniform[0]`."""
    out = ""
    previous = None
    for part in loc:
        knob_tag = part == "value" and previous in SearchConfig.model_fields  # a fixed knob's tag, not a key
        if knob_tag or part == previous or (isinstance(part, str) and "[" in part):
            previous = part
            continue  # discriminator tags and generic class names, not keys the user wrote
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
        previous = part
    return out


def _fields_at(loc: tuple) -> list[str]:
    """Valid key names of the section at `loc` (for 'did you mean')."""
    cls: Any = SweepConfig
    for part in loc:
        if cls is SearchConfig and part in SearchConfig.model_fields:
            cls = "knob"  # next comes the discriminator tag naming the distribution
            continue
        if cls == "knob":
            cls = DISTRIBUTIONS.get(part)
            continue
        if not (isinstance(cls, type) and issubclass(cls, BaseModel)) or part not in cls.model_fields:
            return []
        cls = _model_in(cls.model_fields[part].annotation)
    return list(cls.model_fields) if isinstance(cls, type) and issubclass(cls, BaseModel) else []


def _model_in(annotation) -> Any:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    for arg in get_args(annotation):
        found = _model_in(arg)
        if found is not None:
            return found
    return None


def _source(source: str, key: str, overridden: dict[str, str]) -> str:
    """The file, plus the `--set` that wrote `key` (or a section above it), if one did."""
    for dotted, item in overridden.items():
        if key == dotted or key.startswith(dotted + ".") or key.startswith(dotted + "["):
            source = f"{source} (--set {item})"
    return source


def _describe(error: ValidationError, source: str, overridden: dict[str, str]) -> str:
    """One line for the first validation error: where, what, the value, the fix."""
    errors = error.errors()
    err = errors[0]
    loc, value, kind = err["loc"], err.get("input"), err["type"]
    key = _dotted(loc)
    source = _source(source, key, overridden)
    if kind == "extra_forbidden":
        name = loc[-1]
        valid = _fields_at(loc[:-1])
        close = difflib.get_close_matches(str(name), valid, n=1, cutoff=0.5)
        hint = f"did you mean '{close[0]}'?" if close else ("valid keys: " + ", ".join(valid) if valid else "remove it")
        message = f"unknown key '{name}' ({hint})"
    elif kind in ("float_type", "int_type", "float_parsing", "int_parsing") and isinstance(value, str):
        message = f"expected a number, got {value!r}"
        if re.fullmatch(r"\s*[-+]?[0-9.]+[eE][-+]?[0-9]+\s*", value):
            message += f" (write it unquoted, e.g. {float(value)!r})"
    elif kind in ("float_type", "int_type") and isinstance(value, bool):
        message = f"expected a number, got {value!r}"
    elif kind == "int_type" and isinstance(value, float):
        message = f"expected a whole number, got {value!r}"
    elif kind in ("greater_than", "greater_than_equal", "less_than", "less_than_equal"):
        bound = next(iter(err["ctx"].values()))
        words = {"greater_than": "above", "greater_than_equal": "at least", "less_than": "below",
                 "less_than_equal": "at most"}
        message = f"must be {words[kind]} {bound}, got {value!r}"
    elif kind == "union_tag_invalid":
        allowed = err["ctx"]["expected_tags"].replace("'value'", "a plain value")
        message = f"'{err['ctx']['tag']}' is not allowed here; use {allowed}"
    elif kind == "union_tag_not_found":
        message = f"expected a plain value or exactly one of {', '.join(DISTRIBUTIONS)}, got {value!r}"
    elif kind == "literal_error":
        message = f"got {value!r}, expected {err['ctx']['expected']}"
    elif kind == "value_error":
        message = str(err["ctx"]["error"])
    elif kind == "missing":
        message = "missing required key"
    else:
        message = f"{err['msg'][0].lower()}{err['msg'][1:]}, got {value!r}"
    more = f" (and {len(errors) - 1} more)" if len(errors) > 1 else ""
    where = f"{key}: " if key else ""
    return f"{source}: {where}{message}{more}"


def spec_yaml(config: SweepConfig) -> str:
    """The resolved spec as YAML (every default filled in): logged with each sweep."""
    return yaml.safe_dump(config.model_dump(mode="json", exclude_none=False), sort_keys=False)


def iter_keys(cls: type[BaseModel] = None, prefix: str = ""):
    """(dotted key, default, description) for every key of the schema (docs/gen.py's spec reference)."""
    cls = cls or SweepConfig
    for name, field in cls.model_fields.items():
        sub = _model_in(field.annotation)
        if sub is not None and cls is not SearchConfig:  # a section, not a knob
            yield from iter_keys(sub, f"{prefix}{name}.")
        else:
            yield f"{prefix}{name}", field.default, field.description or ""
