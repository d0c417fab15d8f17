"""MkDocs hook: the configuration and CLI reference pages, generated at build time from the code
(the config dataclasses with their field comments, and the ``vitflow`` argument parser), so that
neither can go stale. ``tests/test_docs.py`` checks that every key and option is on them."""

from __future__ import annotations

import argparse
import ast
import dataclasses
import inspect
import io
import re
import tokenize
import typing

CONFIG_PAGE = "reference/config.md"
CLI_PAGE = "reference/cli.md"


def _field_comments(cls: type) -> dict[str, str]:
    """``field name -> its comment`` in the class's source: the comment lines right above the field
    and the comment at the end of its line."""
    source = inspect.getsource(inspect.getmodule(cls))
    tokens = [t for t in tokenize.generate_tokens(io.StringIO(source).readline) if t.type == tokenize.COMMENT]
    trailing = {t.start[0]: t.string.lstrip("# ").strip() for t in tokens if not t.line.lstrip().startswith("#")}
    own_line = {t.start[0]: t.string.lstrip("# ").strip() for t in tokens if t.line.lstrip().startswith("#")}

    def above(line: int) -> str:  # the comment lines right above a field, joined in order
        parts = []
        while line - 1 in own_line:
            line -= 1
            parts.insert(0, own_line[line])
        return " ".join(parts)

    out: dict[str, str] = {}
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ClassDef) and node.name == cls.__name__:
            for stmt in node.body:
                if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name):
                    # the comment lines above the field, then the comment at the end of its line
                    out[stmt.target.id] = " ".join(filter(None, (above(stmt.lineno), trailing.get(stmt.lineno))))
    return out


def _type_name(tp) -> str:
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is typing.Literal:
        return " | ".join(f"`{a}`" for a in args)
    if origin is tuple:
        return "tuple of " + (f"{_type_name(args[0])}" if len(args) == 2 and args[1] is Ellipsis else
                               ", ".join(_type_name(a) for a in args))
    if args:  # a union
        return " or ".join("null" if a is type(None) else _type_name(a) for a in args)
    return getattr(tp, "__name__", str(tp))


def _source_kinds() -> tuple[str, str]:
    """``data.source``'s type cell and the list of its kinds, from the table of source kinds (in
    detection order), so that a new kind appears without an edit here."""
    from vitflow.data.sources.table import KINDS

    kinds = "; ".join(f"`{k.name}`: {k.about}" + (" (by name only)" if k.detect is None else "") for k in KINDS)
    choices = " \\| ".join(f"`{n}`" for n in ("auto", *(k.name for k in KINDS)))
    return choices, f". The kinds, in the order auto tries them: {kinds}"


GENERATED = {"data.source": _source_kinds}  # keys whose choices are a table of the code, not a Literal


def _cell(text: str) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ").replace("<", "&lt;").replace(">", "&gt;")


def _key_rows(section: str, cls: type, own: bool = False) -> list[str]:
    """The table of a section class's keys (``own``: only those declared in its own body)."""
    hints, comments, value = typing.get_type_hints(cls), _field_comments(cls), cls()
    rows = ["| key | type | default | meaning |", "| --- | --- | --- | --- |"]
    for f in dataclasses.fields(cls):
        if own and f.name not in comments:
            continue
        default = getattr(value, f.name)
        default = "null" if default is None else f"`{list(default) if isinstance(default, tuple) else default}`"
        key = f"{section}.{f.name}"
        kind, more = GENERATED[key]() if key in GENERATED else (_cell(_type_name(hints[f.name])), "")
        rows.append(f"| `{key}` | {kind} | {_cell(default)} | {_cell(comments.get(f.name, '') + more)} |")
    return rows + [""]


def _model_sections() -> list[str]:
    """The ``model`` section: the keys every family takes, then one part per family's class with
    the keys it adds (or narrows), naming the families and the class it extends."""
    from vitflow.config import ModelConfig, model_config_classes
    from vitflow.models import FAMILIES

    lines = ["## `model`", "", inspect.cleandoc(ModelConfig.__doc__ or ""), "",
             "A run's `model` section is its family's (the one `model.name` belongs to): the keys below, which "
             "every family takes, plus the family's own. `vitflow train --print-config` shows the chosen family's "
             "keys; a key of another family is refused with one line that lists the family's keys.", "",
             *_key_rows("model", ModelConfig)]
    for cls in model_config_classes()[1:]:
        families = ", ".join(f"`{f.name}`" for f in FAMILIES if f.config is cls) or "none registered"
        parent = cls.__mro__[1]
        base = "the keys every family takes" if parent is ModelConfig else f"the keys of {parent.label} models"
        lines += [f"### {cls.label} models (`{cls.__name__}`)", "", inspect.cleandoc(cls.__doc__ or ""), "",
                  f"Families: {families}. Their keys: {base}, and (added or with narrower values):", "",
                  *_key_rows("model", cls, own=True)]
    return lines


def config_reference() -> str:
    """The configuration reference page (Markdown)."""
    from vitflow.config import Config

    lines = ["# Configuration reference", "",
             "Every key of a run's configuration, generated from the dataclasses in "
             "`vitflow/config/schema.py` (the `model` section: `model_schema.py`, one class per kind of model; the "
             "`data` section: `data_schema.py`) when the documentation is built. Set a key on the command line "
             "(`vitflow train train.batch_size=64`), in a `--config` YAML file (the same sections) or in a "
             "preset. `null` means unset; the type column is what the value is coerced to.", ""]
    root = Config()
    for section in dataclasses.fields(Config):
        value = getattr(root, section.name)
        if not dataclasses.is_dataclass(value):
            lines += [f"- `{section.name}`: default `{value!r}`", ""]
            continue
        if section.name == "model":
            lines += _model_sections()
            continue
        cls = type(value)
        doc = inspect.cleandoc(cls.__doc__ or "")
        lines += [f"## `{section.name}`", "", doc, "", *_key_rows(section.name, cls)]
    return "\n".join(lines)


def _actions(parser: argparse.ArgumentParser) -> list[argparse.Action]:
    return [a for a in parser._actions if not isinstance(a, (argparse._HelpAction, argparse._SubParsersAction))]


def _option_rows(parser: argparse.ArgumentParser) -> list[str]:
    rows = ["| argument | default | meaning |", "| --- | --- | --- |"]
    for a in _actions(parser):
        name = ", ".join(a.option_strings) or a.metavar or a.dest
        if a.choices:
            name += " {" + ",".join(map(str, a.choices)) + "}"
        hidden = a.default in (None, False, argparse.SUPPRESS) or not a.option_strings or a.nargs == 0
        default = "" if hidden else f"`{a.default}`"
        rows.append(f"| `{_cell(name)}` | {_cell(default)} | {_cell(a.help or '')} |")
    return rows


def _commands(parser: argparse.ArgumentParser, prefix: str = "vitflow"):
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            helps = {c.dest: c.help for c in action._choices_actions}
            for name, sub in action.choices.items():
                yield f"{prefix} {name}", helps.get(name, ""), sub
                yield from _commands(sub, f"{prefix} {name}")


def cli_reference() -> str:
    """The CLI reference page (Markdown)."""
    from vitflow.cli import build_parser

    parser = build_parser()
    lines = ["# CLI reference", "",
             "Every `vitflow` command and option, generated from the argument parser when the documentation "
             "is built (`vitflow COMMAND --help` prints the same). Commands that take `key=value` overrides "
             "accept any key of the [configuration](config.md).", "",
             "## `vitflow`", "", "```text", parser.format_usage().strip(), "```", "", *_option_rows(parser), ""]
    for name, help_text, sub in _commands(parser):
        lines += [f"## `{name}`", "", _cell(help_text), "", "```text", sub.format_usage().strip(), "```", ""]
        if _actions(sub):
            lines += [*_option_rows(sub), ""]
    return "\n".join(lines)


_ROLE = re.compile(r":(?:func|class|mod|meth|data|attr|exc|obj):(?=<code>)")


def on_page_content(html: str, page, config, files) -> str:
    """Drop the Sphinx roles (``:func:``, ``:class:``, ...) the docstrings use before code spans
    (MkDocs ``on_page_content`` event): the API pages then read as plain code references."""
    return _ROLE.sub("", html)


def on_files(files, config):
    """Add the generated pages to the site (MkDocs ``on_files`` event)."""
    from mkdocs.structure.files import File

    for path, make in ((CONFIG_PAGE, config_reference), (CLI_PAGE, cli_reference)):
        files.append(File.generated(config, path, content=make()))
    return files
