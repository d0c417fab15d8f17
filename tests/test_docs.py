"""The documentation stays true to the code: every message quoted on the troubleshooting page is
still printed by the code, and the generated references hold every config key and CLI option."""

from __future__ import annotations

import ast
import importlib.util
import re
from pathlib import Path

import pytest

import vitflow
from vitflow.config import all_keys

ROOT = Path(__file__).resolve().parents[1]
SRC = Path(vitflow.__file__).parent
DOCS = ROOT / "docs"
MIN_LITERAL = 16  # characters of fixed text a format string must share with a quoted message


def _hooks():
    spec = importlib.util.spec_from_file_location("vitflow_docs_hooks", DOCS / "hooks.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def quoted_messages(page: Path) -> list[str]:
    """Every line of the page's ``text`` code blocks, without the CLI's ``error: `` / ``refused: ``
    prefix and the log record's ``LEVEL logger: `` prefix."""
    blocks = re.findall(r"```text\n(.*?)```", page.read_text(), flags=re.S)
    lines = [line.strip() for block in blocks for line in block.splitlines() if line.strip()]
    return [re.sub(r"^(error: |refused: |(WARNING|INFO) [\w.]+: )", "", line) for line in lines]


def message_templates(root: Path) -> list[tuple[re.Pattern, int]]:
    """Every string and f-string of the package as a pattern (each ``{...}`` matches any text)
    with the length of its fixed text; the %-style log formats too (``%s``, ``%d``, ``%.3g``, ...)."""
    out = []
    for path in root.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.JoinedStr):
                parts = [v.value if isinstance(v, ast.Constant) else None for v in node.values]
            elif isinstance(node, ast.Constant) and isinstance(node.value, str):
                parts = re.split(r"(%[-+ #0]*\d*(?:\.\d+)?[sdfgrx%])", node.value)
                parts = [None if i % 2 else p for i, p in enumerate(parts)]
            else:
                continue
            fixed = [p for p in parts if p]
            if sum(map(len, fixed)) < MIN_LITERAL:
                continue
            regex = "".join(re.escape(p) if p is not None else ".+?" for p in parts if p != "")
            out.append((re.compile(regex, re.S), sum(map(len, fixed))))
    return out


def test_troubleshooting_quotes_at_least_15_messages_the_code_still_prints():
    messages = quoted_messages(DOCS / "troubleshooting.md")
    assert len(messages) >= 15
    templates = message_templates(SRC)
    missing = [m for m in messages if not any(p.search(m) for p, _ in templates)]
    assert missing == [], "quoted on the troubleshooting page but printed nowhere in the code"


def test_the_message_check_would_notice_a_changed_message():
    templates = message_templates(SRC)
    assert any(p.search("data.path pets does not exist") for p, _ in templates)
    assert not any(p.search("data folder pets is missing") for p, _ in templates)


def test_config_reference_lists_every_key():
    page = _hooks().config_reference()
    missing = [k for k in all_keys() if f"`{k}`" not in page]
    assert missing == []
    assert "| `model.img_size` | int or null | null | input resolution in pixels" in page


def test_cli_reference_lists_every_command_and_option():
    from vitflow.cli import build_parser

    page = _hooks().cli_reference()
    commands = ["train", "eval", "embed", "predict", "export", "quantize", "prune", "attention", "prepare", "bench data",
                "bench infer", "bench resolution", "lr-schedule", "report", "presets", "models"]
    assert [c for c in commands if f"## `vitflow {c}`" not in page] == []
    options = {o for a in build_parser()._actions for o in a.option_strings} - {"-h", "--help"}
    sub = build_parser()._subparsers._group_actions[0].choices
    options |= {o for p in sub.values() for a in p._actions for o in a.option_strings} - {"-h", "--help"}
    assert [o for o in sorted(options) if f"`{o}" not in page and f", {o}" not in page] == []


@pytest.mark.parametrize("page", sorted(p.relative_to(DOCS).as_posix() for p in DOCS.rglob("*.md")))
def test_docs_use_the_current_config_key_names(page):
    text = (DOCS / page).read_text()
    old = [k for k in ("model.image_size", "model.layer_scale=", "model.distill_token") if k in text]
    assert page == "troubleshooting.md" or old == []


def _canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def test_constraints_pin_every_dependency_the_install_command_names():
    """README's install command is ``pip install -e ".[dev]" -c constraints.txt``: every package that
    pyproject.toml names (the core and each extra) has an exact pin there, or pip falls back to
    backtracking through releases (a CI run once spent its 90 minutes doing that)."""
    import tomllib

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    named = list(project["dependencies"]) + [req for extra in project["optional-dependencies"].values()
                                             for req in extra]
    wanted = {_canonical(re.match(r"[A-Za-z0-9_.-]+", req).group()) for req in named} - {"vitflow"}
    pins = dict(line.split("==", 1) for line in (ROOT / "constraints.txt").read_text().splitlines()
                if "==" in line and not line.startswith("#"))
    pinned = {_canonical(name) for name in pins}
    assert len(wanted) > 20
    assert wanted - pinned == set()
    assert pins["torch"] == "2.14.1" and pins["torchvision"] == "0.29.1"  # the wheels on this machine's disk
    for path in (ROOT / "README.md", ROOT / ".ci" / "run"):
        assert 'pip install -e ".[dev]" -c constraints.txt' in path.read_text(), path
