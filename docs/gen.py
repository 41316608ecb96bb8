"""Writes the reference pages, docs/reference/spec.md and commands.md, from the schema (raysweep/config/) and the
argument parser (raysweep/cli.py), and the README's table of commands from the parser too: `python docs/gen.py`.
tests/test_docs.py fails when the committed files differ from what `pages()` makes."""

from __future__ import annotations

import argparse
import inspect
import re
import shlex
import sys
from pathlib import Path
from typing import Annotated, Any, get_args, get_origin

from pydantic import BaseModel
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # `python docs/gen.py` from a checkout that is not installed
    sys.path.insert(0, str(ROOT))

from raysweep.cli import build_parser  # noqa: E402
from raysweep.config import SearchConfig, SweepConfig, iter_keys, load_config, parse_yaml  # noqa: E402
from raysweep.config.knobs import DISTRIBUTIONS, Choice  # noqa: E402
from raysweep.config.load import _model_in  # noqa: E402  (the section model an annotation holds)

# what the spec page shows for the nesting of dotted keys; validated whenever the page is made
EXAMPLE_SPEC = """\
name: my_sweep
train:
  epochs: 20
search:
  base_lr: {loguniform: [1.0e-4, 3.0e-3]}
"""
# and the `--set` example on it, loaded whenever the page is made (a spec's own checks refuse some overrides)
EXAMPLE_OVERRIDES = ("train.epochs=4", "search.base_lr={loguniform: [1.0e-4, 3.0e-3]}")


# the README's table of commands lies between these lines (the rest of the README is written by hand)
README_BEGIN = "<!-- commands: made by `python docs/gen.py` from the argument parser -->"
README_END = "<!-- end of commands -->"


def pages() -> dict[str, str]:
    """The generated files, by path under the repository's root."""
    return {"docs/reference/spec.md": spec_page(), "docs/reference/commands.md": commands_page(),
            "README.md": readme((ROOT / "README.md").read_text())}


def readme(text: str) -> str:
    """`text` (the README) with its table of commands made again: each command's help line from the parser."""
    if text.count(README_BEGIN) != 1 or text.count(README_END) != 1:
        raise ValueError(f"README.md must hold the line {README_BEGIN!r} once, then {README_END!r} once")
    head, rest = text.split(README_BEGIN)
    _, tail = rest.split(README_END)
    commands = _subcommands(build_parser())
    width = max(len(name) for name, _, _ in commands)
    table = "\n".join(f"python -m raysweep {name:<{width}} {_metavar_of(sub)}  {help_}"
                      for name, help_, sub in commands)
    return f"{head}{README_BEGIN}\n```text\n{table}\n```\n{README_END}{tail}"


def _metavar_of(sub: argparse.ArgumentParser) -> str:
    """The command's positional argument as the README writes it: SPEC, or [SPEC] where it may be left out."""
    (spec,) = [a for a in sub._actions if not a.option_strings]
    return "[SPEC]" if spec.nargs == "?" else "SPEC  "


# ---------------------------------------------------------------------------------------------- the spec


def _section(prefix: str) -> tuple[type[BaseModel], FieldInfo | None]:
    """The model of the section at a dotted prefix ('' is the whole spec) and the field that holds it (None for the
    whole spec): iter_keys lists the keys inside a section, not the section's own description and default."""
    cls, field = SweepConfig, None
    for part in filter(None, prefix.split(".")):
        field = cls.model_fields[part]
        cls = _model_in(field.annotation)
    return cls, field


def _doc(cls: type) -> str:
    """A class's own docstring on one line ('' when it has none: pydantic does not inherit one)."""
    return " ".join(inspect.cleandoc(cls.__dict__.get("__doc__") or "").split())


def _value(value: Any) -> str:
    """A default as it would be written in a spec."""
    if value is PydanticUndefined:
        return "*required*"
    if value is None:
        return "`null`"
    if isinstance(value, bool):
        return f"`{str(value).lower()}`"
    if isinstance(value, (list, tuple)):
        return "`[" + ", ".join(_value(v).strip("`") for v in value) + "]`"
    if isinstance(value, BaseModel):
        return _value(value.model_dump(mode="json"))
    if isinstance(value, dict):
        return "`{" + ", ".join(f"{k}: {_value(v).strip('`')}" for k, v in value.items()) + "}`"
    return f"`{value}`" if str(value) else '`""`'


def _cell(text: str) -> str:
    """Text safe inside a Markdown table cell: `<` would open an HTML tag, `|` a new cell (but not in a code span,
    which shows both as written)."""
    parts = text.split("`")
    return "`".join(part if i % 2 else part.replace("<", "&lt;").replace("|", "\\|") for i, part in enumerate(parts))


def _forms(annotation) -> list[str]:
    """The forms a search knob takes, from the discriminator tags of its annotation: 'value' (fixed) and the
    distribution names."""
    found = []
    if get_origin(annotation) is Annotated:
        found += [m.tag for m in annotation.__metadata__ if type(m).__name__ == "Tag"]
    for arg in get_args(annotation):
        found += [tag for tag in _forms(arg) if tag not in found]
    return found


def _form_fields(cls: type[BaseModel]) -> list[tuple[str, bool, str]]:
    """(key, required, description) of a distribution form; a key the form leaves undescribed reads as Choice's key
    of the same name (`default`, `max` mean the same in every form)."""
    shared = {name: field.description for name, field in Choice.model_fields.items()}
    rows = []
    for name, field in cls.model_fields.items():
        description = field.description or shared.get(name) or ""
        if not description and get_origin(field.annotation) is tuple:
            description = "`[low, high]`"
        rows.append((name, field.is_required(), description))
    return rows


def spec_page() -> str:
    SweepConfig.model_validate(parse_yaml(EXAMPLE_SPEC, "docs/gen.py EXAMPLE_SPEC"))
    load_config(ROOT / "search_spaces" / "quickstart.yaml", list(EXAMPLE_OVERRIDES))
    keys = list(iter_keys())
    prefixes = list(dict.fromkeys(key.rpartition(".")[0] for key, _, _ in keys))
    out = [
        "# The spec",
        "",
        "This page is generated by `python docs/gen.py` from the schema (the pydantic models in `raysweep/config/`): "
        "change a key's description there and run it again, never edit this page by hand.",
        "",
        "A spec is a YAML file of sections. A key left out takes its default (below; a key marked *required* must "
        "be given once its section is), and an unknown key is an error that names the closest valid one. A dotted "
        "key is a key inside its section: `train.epochs` is `epochs:` under `train:`, as in",
        "",
        "```yaml",
        EXAMPLE_SPEC.rstrip("\n"),
        "```",
        "",
        "`--set KEY=VALUE` on the command line overrides one key of the file for that run; the value is read as "
        "YAML, and `--set` may be repeated:",
        "",
        "```bash",
        _wrap(["python -m raysweep check search_spaces/quickstart.yaml"] + [
            f"--set {shlex.quote(item)}" for item in EXAMPLE_OVERRIDES], width=80),
        "```",
        "",
        "`check` prints the spec with every default filled in, as a sweep would run it.",
        "",
        "## Example specs",
        "",
        "`search_spaces/` holds these (each file's first sentence):",
        "",
    ]
    for path in sorted((ROOT / "search_spaces").glob("*.yaml")):
        out.append(f"- `search_spaces/{path.name}`: {_first_sentence(path)}")
    for prefix in prefixes:
        cls, field = _section(prefix)
        out += ["", f"## {prefix or 'Top-level keys'}", ""]
        about = [_doc(cls)] if _doc(cls) else []
        if field is not None and field.description:
            about.append(f"`{prefix}`: {field.description}.")
        if field is not None and field.default is None:
            about.append(f"The section is off unless a spec sets it (`{prefix}: null` by default).")
        if about:
            out += [_cell(" ".join(about)), ""]
        knobs = cls is SearchConfig
        out += ["| Key | Default | Forms | Description |", "|---|---|---|---|"] if knobs else \
               ["| Key | Default | Description |", "|---|---|---|"]
        for key, value, description in keys:
            if key.rpartition(".")[0] != prefix:
                continue
            forms = ""
            if knobs:
                tags = _forms(cls.model_fields[key.rpartition(".")[2]].annotation)
                forms = ", ".join(f"[{t}](#{t})" if t in DISTRIBUTIONS else "fixed" for t in tags) + " | "
            out.append(f"| `{key}` | {_value(value)} | {forms}{_cell(description)} |")
        if knobs:
            out += _form_sections()
    return "\n".join(out) + "\n"


def _first_sentence(path: Path) -> str:
    """The first sentence of the comment a spec file opens with (a sentence may wrap onto the next comment line)."""
    lines = []
    for line in path.read_text().splitlines():
        if not line.startswith("#"):
            break
        lines.append(line.lstrip("#").strip())
    return re.split(r"(?<=[.!?])\s+(?=[A-Z])", " ".join(lines), maxsplit=1)[0]


def _form_sections() -> list[str]:
    out = ["", "### Knob forms", "",
           f"A knob under `search:` is a plain value (fixed: every trial uses it) or a mapping with exactly one of "
           f"{', '.join(f'`{t}`' for t in DISTRIBUTIONS)} (searched). `train` runs the searched knob's `default`, "
           f"else its first choice or lower bound. The Forms column above says which forms each knob takes."]
    for tag, cls in DISTRIBUTIONS.items():
        out += ["", f"#### {tag}", ""]
        if _doc(cls):
            out += [_cell(_doc(cls)), ""]
        out += ["| Key | Required | Description |", "|---|---|---|"]
        for name, required, description in _form_fields(cls):
            out.append(f"| `{name}` | {'yes' if required else 'no'} | {_cell(description)} |")
    return out


# ---------------------------------------------------------------------------------------------- the commands


def _subcommands(parser: argparse.ArgumentParser) -> list[tuple[str, str, argparse.ArgumentParser]]:
    """(name, one-line help, parser) of every subcommand, in the parser's order."""
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    helps = {choice.dest: choice.help for choice in action._choices_actions}
    return [(name, helps.get(name) or "", sub) for name, sub in action.choices.items()]


def _arguments(parser: argparse.ArgumentParser) -> list[argparse.Action]:
    """Its arguments, positionals first (the order a command line reads best in); -h/--help is left out."""
    actions = [a for a in parser._actions if not isinstance(a, argparse._HelpAction)]
    return [a for a in actions if not a.option_strings] + [a for a in actions if a.option_strings]


def _metavar(action: argparse.Action) -> str:
    if action.nargs == 0:
        return ""
    return action.metavar or action.dest.upper()


def _usage(action: argparse.Action, first: bool = False) -> str:
    """How an argument is written on a command line: `SPEC`, `[SPEC]`, `--set KEY=VALUE` (`first`: `-v`, not
    `--verbose`, as argparse's usage line has it)."""
    if not action.option_strings:
        name = _metavar(action)
        return f"[{name}]" if action.nargs == "?" else name
    metavar = _metavar(action)
    return action.option_strings[0 if first else -1] + (f" {metavar}" if metavar else "")


def _wrap(words: list[str], width: int = 100) -> str:
    """A command line wrapped between its arguments, continued with `\\` (a page's code block scrolls past 100)."""
    lines = [words[0]]
    for word in words[1:]:
        if len(lines[-1]) + 1 + len(word) + 2 > width:
            lines[-1] += " \\"
            lines.append("    " + word)
        else:
            lines[-1] += " " + word
    return "\n".join(lines)


def _help(action: argparse.Action, prog: str) -> str:
    text = action.help or ""
    # argparse expands these in help strings the same way
    return text % {**vars(action), "prog": prog} if "%" in text else text


def _default(action: argparse.Action) -> str:
    default = action.default
    if default is None or default is False or default == [] or default is argparse.SUPPRESS:
        return "—"
    return f"`{default}`"


def commands_page() -> str:
    parser = build_parser()
    out = [
        "# Commands",
        "",
        "This page is generated by `python docs/gen.py` from the argument parser (`build_parser` in "
        "`raysweep/cli.py`): change a help string there and run it again, never edit this page by hand.",
        "",
        f"{parser.description} Every command is `python -m raysweep COMMAND ...` (or the `{parser.prog}` script "
        f"that installing the package puts on the PATH), and `python -m raysweep COMMAND --help` prints its options.",
        "",
        "| Command | What it does |",
        "|---|---|",
    ]
    commands = _subcommands(parser)
    out += [f"| [`{name}`](#{name}) | {_cell(help_)} |" for name, help_, _ in commands]
    for name, help_, sub in commands:
        arguments = _arguments(sub)
        synopsis = _wrap([f"python -m raysweep {name}"] + [
            _usage(a) if not a.option_strings else f"[{_usage(a, first=True)}]" for a in arguments])
        out += ["", f"## {name}", "", f"{help_[:1].upper()}{help_[1:]}.", "", "```text", synopsis, "```", "",
                "| Argument | Default | Description |", "|---|---|---|"]
        for action in arguments:
            names = ", ".join(f"`{o}`" for o in action.option_strings[:-1])
            written = f"{names}, `{_usage(action)}`" if names else f"`{_usage(action)}`"
            out.append(f"| {written} | {_default(action)} | {_cell(_help(action, sub.prog))} |")
    return "\n".join(out) + "\n"


def main() -> int:
    for relative, text in pages().items():
        path = ROOT / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        if not path.is_file() or path.read_text() != text:
            path.write_text(text)
            print(f"wrote {relative}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
