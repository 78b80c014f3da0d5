"""The configuration reference (docs/configuration.md), generated from the config itself.

``python -m ps_train.config.reference`` rewrites docs/configuration.md; ``--check`` only
compares (exit status 1 when the file is stale), ``--print`` writes to stdout instead.

What it reads, so that the reference cannot drift from the code:

- the Hydra groups and their choices: ``ps_train/conf/<group>/*.yaml``; the default choice
  from the ``defaults`` list of ``conf/config.yaml``; a choice's description from the comment
  lines that open its file;
- every key: the fields of the dataclasses in ``ps_train/config/`` (the root ``Config``, each
  group's schema, one per choice for ``model`` and ``data``), with its type annotation;
- defaults: what the choice's file sets, else the dataclass default (``config.yaml`` for the
  top-level keys and ``checkpoint``); interpolations stay as written (``${data.name}``);
- what each key means: the field's comments in the dataclass source (``field_docs``).
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import json
import re
import sys
import typing
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from omegaconf import MISSING, OmegaConf

from ps_train.config.data import DATA_SCHEMAS
from ps_train.config.field_docs import field_docs, undocumented_fields
from ps_train.config.model import MODEL_SCHEMAS
from ps_train.config.root import Config

__all__ = ["CONF_DIR", "DOC_PATH", "REGENERATE", "Choice", "render", "schema_classes", "undocumented_keys", "main"]

CONF_DIR = Path(__file__).resolve().parent.parent / "conf"
# Where the reference lives in a source checkout (the package sits at the repository's root).
DOC_PATH = Path(__file__).resolve().parent.parent.parent / "docs" / "configuration.md"
REGENERATE = "python -m ps_train.config.reference"
# Groups whose choices each have their own schema (a table per choice); the others share one.
DOC_LINK = re.compile(r"docs/([\w-]+\.md)(#[\w-]+)?")
PER_CHOICE_SCHEMAS: dict[str, dict[str, type]] = {"model": dict(MODEL_SCHEMAS), "data": dict(DATA_SCHEMAS)}


@dataclass(frozen=True)
class Choice:
    """One file of a Hydra group: ``values`` its own group's keys, ``elsewhere`` the keys it sets
    in other groups (``# @package _global_`` files), both flattened to dotted keys."""

    group: str
    name: str
    description: str
    values: dict[str, Any]
    elsewhere: dict[str, Any]


def _flatten(node: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(node, dict) and node:
        out: dict[str, Any] = {}
        for key, value in node.items():
            out.update(_flatten(value, f"{prefix}{key}."))
        return out
    return {prefix[:-1]: node}


def _read_choice(group: str, path: Path) -> Choice:
    text = path.read_text(encoding="utf-8")
    header: list[str] = []
    for line in text.splitlines():
        if not line.startswith("#"):
            break
        if not line.startswith("# @package"):
            header.append(line.lstrip("#").strip())
    raw = OmegaConf.to_container(OmegaConf.create(text), resolve=False)
    content: dict[str, Any] = (
        {str(k): v for k, v in (raw or {}).items() if k != "defaults"} if isinstance(raw, dict) else {}
    )
    if "@package _global_" in text.split("\n", 1)[0]:
        own = content.pop(group, {})
        return Choice(group, path.stem, " ".join(header), _flatten(own), _flatten(content))
    return Choice(group, path.stem, " ".join(header), _flatten(content), {})


def hydra_groups() -> dict[str, list[Choice]]:
    """Every group folder of ``conf/`` and its choices, by name."""
    return {
        folder.name: [_read_choice(folder.name, f) for f in sorted(folder.glob("*.yaml"))]
        for folder in sorted(p for p in CONF_DIR.iterdir() if p.is_dir())
    }


def _root_yaml() -> dict[str, Any]:
    raw = OmegaConf.to_container(OmegaConf.load(CONF_DIR / "config.yaml"), resolve=False)
    return {str(k): v for k, v in raw.items()} if isinstance(raw, dict) else {}


def default_choices() -> dict[str, str | None]:
    """Group -> the choice ``config.yaml`` selects (None: no choice unless given)."""
    chosen: dict[str, str | None] = {}
    for entry in _root_yaml().get("defaults", []):
        if isinstance(entry, dict):
            chosen.update({str(k): v for k, v in entry.items()})
    return chosen


def _value(value: Any) -> str:
    """A value as it is written in YAML or on the command line."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return "(required)" if value == MISSING else value if value else '""'
    if isinstance(value, list | tuple):
        return "[" + ", ".join(_value(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k}: {_value(v)}" for k, v in value.items()) + "}"
    return json.dumps(value) if isinstance(value, float) else str(value)


def _code(value: Any) -> str:
    return f"`{_value(value)}`"


def _prose(text: str) -> str:
    """Comment text as Markdown: ``<name>`` stays text (not an HTML tag), and a
    ``docs/<page>.md`` it names becomes a link (the reference is itself in docs/)."""
    parts = text.split("`")  # odd parts are code spans, where a backslash would show
    text = "`".join(part if i % 2 else part.replace("<", "\\<") for i, part in enumerate(parts))
    return DOC_LINK.sub(lambda m: f"[{m[1]}]({m[1]}{m[2] or ''})", text)


def _cell(text: str) -> str:
    """Text for a Markdown table cell (as ``_prose``, and ``|`` not ending the cell)."""
    return _prose(text.replace("|", "\\|"))


def _choice_schema(choice: Choice) -> type:
    schemas = PER_CHOICE_SCHEMAS[choice.group]
    if choice.name not in schemas:
        raise ValueError(
            f"ps_train/conf/{choice.group}/{choice.name}.yaml has no schema: add {choice.name!r} to "
            f"ps_train.config's {choice.group.upper()}_SCHEMAS (or register it)"
        )
    schema: type = schemas[choice.name]
    return schema


def _default(f: dataclasses.Field[Any]) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return MISSING


def _type(f: dataclasses.Field[Any]) -> str:
    return f.type if isinstance(f.type, str) else getattr(f.type, "__name__", str(f.type))


def _nested_schema(cls: type, name: str) -> type | None:
    """The dataclass of a ``list[X]`` field's items (``model.tables``), if it is one."""
    hint = typing.get_type_hints(cls).get(name)
    args = typing.get_args(hint)
    if typing.get_origin(hint) is list and args and dataclasses.is_dataclass(args[0]):
        return typing.cast(type, args[0])
    return None


def _field_table(cls: type, prefix: str, columns: list[tuple[str, dict[str, Any]]]) -> Iterator[str]:
    """One row per field of ``cls``: key, type, then a column per (title, values set), then meaning."""
    docs = field_docs(cls)
    titles = " | ".join(title for title, _ in columns)
    yield f"| key | type | {titles} | meaning |"
    yield "|---|---|" + "---|" * len(columns) + "---|"
    for f in dataclasses.fields(cls):
        key = prefix + f.name
        cells = []
        for title, values in columns:
            if f.name in values:
                cells.append(_code(values[f.name]))
            elif title == "default":
                cells.append(_code(_default(f)))
            else:
                cells.append("")
        yield f"| `{key}` | `{_cell(_type(f))}` | " + " | ".join(cells) + f" | {_cell(docs[f.name].text)} |"


def _choice_heading(choice: Choice, is_default: bool) -> Iterator[str]:
    yield f"### `{choice.group}={choice.name}`"
    yield ""
    if is_default:
        yield "The default choice."
        yield ""
    if choice.description:
        yield _prose(choice.description)
        yield ""
    if choice.elsewhere:
        sets = ", ".join(f"`{k}={_value(v)}`" for k, v in choice.elsewhere.items())
        yield f"Also sets: {sets}."
        yield ""


def _group_section(
    name: str, cls: type, choices: list[Choice], default: str | None, root: dict[str, Any]
) -> Iterator[str]:
    yield f"## `{name}`"
    yield ""
    if name in PER_CHOICE_SCHEMAS:
        for choice in choices:
            schema = _choice_schema(choice)
            yield from _choice_heading(choice, choice.name == default)
            yield from _field_table(schema, f"{name}.", [("default", choice.values)])
            yield ""
            for f in dataclasses.fields(schema):
                item = _nested_schema(schema, f.name)
                if item is not None:
                    yield f"Each entry of `{name}.{f.name}` (`{item.__name__}`):"
                    yield ""
                    yield from _field_table(item, "", [("default", {})])
                    yield ""
        return
    if choices:
        listed = ", ".join(f"`{name}={c.name}`" + (" (default)" if c.name == default else "") for c in choices)
        yield f"Choices: {listed}. A choice's column shows what its file sets (blank: not set there)."
        yield ""
        described = [f"- `{name}={c.name}`: {_prose(c.description)}" for c in choices if c.description]
        if described:
            yield from described + [""]
    else:
        yield f"No choices: set its keys directly (`{name}.<key>=<value>`)."
        yield ""
    columns = [("default", root.get(name) or {})] + [(f"`{c.name}`", c.values) for c in choices]
    yield from _field_table(cls, f"{name}.", columns)
    yield ""


HEADER = f"""# Configuration reference

Every key `python -m ps_train` takes, generated from the typed config (`ps_train/config/`) and
the Hydra config files (`ps_train/conf/`) by `{REGENERATE}`. Do not edit it by hand: change a
field's comment or default in `ps_train/config/`, or a file in `ps_train/conf/`, and run that
command; `tests/ps_train/test_config_reference.py` fails while this file differs from its output.

Set a group's choice with `group=choice` and any key with `group.key=value`
(`python -m ps_train model=cnn cluster.num_servers=3 optim.lr=0.02`); a misspelt key, a wrong
type or a bad combination fails before any process starts, naming the key.
`python -m ps_train --cfg job` prints the composed config without running, `--help` lists the
groups. Hydra's own keys work as usual: `hydra.run.dir=<folder>` (the run folder, default
`runs/<experiment>/<date>_<time>`), `-m` for a sweep (one sub-folder per job). How the settings
play together: [training.md](training.md), [ctr.md](ctr.md) for `model=dlrm`.
"""


def schema_classes() -> list[type]:
    """Every dataclass the reference documents."""
    classes: list[type] = [Config]
    for f in dataclasses.fields(Config):
        if f.name in PER_CHOICE_SCHEMAS:
            classes += [_choice_schema(c) for c in hydra_groups().get(f.name, [])]
        elif dataclasses.is_dataclass(_default(f)):
            classes.append(type(_default(f)))
    for cls in list(classes):
        classes += [s for f in dataclasses.fields(cls) if (s := _nested_schema(cls, f.name)) is not None]
    return list(dict.fromkeys(classes))


def undocumented_keys() -> list[str]:
    """``Class.field`` for each key the reference lists without a doc (the groups themselves,
    fields of ``Config`` that hold a schema, are documented by their sections)."""
    groups = {f"Config.{f.name}" for f in dataclasses.fields(Config) if f.name in PER_CHOICE_SCHEMAS}
    groups |= {f"Config.{f.name}" for f in dataclasses.fields(Config) if dataclasses.is_dataclass(_default(f))}
    return [key for key in undocumented_fields(schema_classes()) if key not in groups]


def render() -> str:
    """docs/configuration.md as it should read."""
    groups, chosen, root = hydra_groups(), default_choices(), _root_yaml()
    out = [HEADER, "## Groups and their choices", "", "| group | default choice | choices |", "|---|---|---|"]
    for name, choices in groups.items():
        names = ", ".join(
            f"[`{c.name}`](#{name}{c.name})" if name in PER_CHOICE_SCHEMAS else f"`{c.name}`" for c in choices
        )
        out.append(f"| `{name}` | `{_value(chosen.get(name))}` | {names} |")
    out += ["", "## Top-level keys", ""]
    top = [f for f in dataclasses.fields(Config) if not dataclasses.is_dataclass(_default(f))]
    docs = field_docs(Config)
    out += ["| key | type | default | meaning |", "|---|---|---|---|"]
    for f in top:
        value = root.get(f.name, _default(f))
        out.append(f"| `{f.name}` | `{_cell(_type(f))}` | {_code(value)} | {_cell(docs[f.name].text)} |")
    out.append("")
    for f in dataclasses.fields(Config):
        if f.name in PER_CHOICE_SCHEMAS or dataclasses.is_dataclass(_default(f)):
            cls = type(_default(f))
            out += list(_group_section(f.name, cls, groups.get(f.name, []), chosen.get(f.name), root))
    for name, choices in groups.items():
        if not any(f.name == name for f in dataclasses.fields(Config)):  # preset: settings over several groups
            out += [f"## `{name}`", "", f"A named setup over several groups (`{name}=<name>`).", ""]
            for choice in choices:
                out += list(_choice_heading(choice, choice.name == chosen.get(name)))
    return "\n".join(out).rstrip("\n") + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog=REGENERATE, description="Generate docs/configuration.md.")
    parser.add_argument("--check", action="store_true", help="exit 1 if the file differs from the output")
    parser.add_argument("--print", action="store_true", help="write to stdout instead of the file")
    parser.add_argument("--output", type=Path, default=DOC_PATH, help=f"default: {DOC_PATH}")
    args = parser.parse_args(argv)
    missing = undocumented_keys()
    if missing:
        print("fields without a doc (add a comment above or beside each): " + ", ".join(missing), file=sys.stderr)
        return 1
    text = render()
    if args.print:
        sys.stdout.write(text)
        return 0
    if args.check:
        current = args.output.read_text(encoding="utf-8") if args.output.exists() else ""
        if current == text:
            return 0
        sys.stdout.writelines(
            difflib.unified_diff(current.splitlines(True), text.splitlines(True), str(args.output), "generated")
        )
        print(f"{args.output} is stale; regenerate it: {REGENERATE}", file=sys.stderr)
        return 1
    args.output.write_text(text, encoding="utf-8")
    print(f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
