"""The reference of every config key, generated from `jrl/config/defaults.py` and `configs/*.py`.

A key's documentation is the comment directly above the line that sets its
default. The source is read with `ast` and `tokenize`, following the helper
functions that set keys on a section passed to them (`_add_update_keys(c.actor,
...)` documents `actor.grad_clip`, `actor.optim.lr`, ...), and the keys are taken
from the config that `base_config()` really builds, so every key it holds must
be found with a comment: one without is an error, and cannot reach the docs.

    python -m jrl.config.docs            # writes docs/configs.md
    python -m jrl.config.docs --check    # exits 1 when docs/configs.md is stale
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import importlib
import io
import json
import os
import sys
import tokenize
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import ml_collections

from jrl.config import defaults

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
OUTPUT = os.path.join(ROOT, "docs", "configs.md")
CONFIGS_DIR = os.path.join(ROOT, "configs")
TOP_LEVEL = "(top level)"
_SOURCE_NAME = "jrl/config/defaults.py"
# Deeper helper nesting than this is taken for recursion.
_MAX_DEPTH = 16


class UndocumentedKeyError(ValueError):
    """A key of the config has no comment above the line that sets its default."""


@dataclasses.dataclass(frozen=True)
class KeyDoc:
    key: str  # dotted name, e.g. "actor.optim.lr"
    default: Any
    meaning: str


@dataclasses.dataclass
class SourceDocs:
    """What the source says: the comment above each key and above each section."""

    keys: dict[str, str] = dataclasses.field(default_factory=dict)  # in source order
    sections: dict[str, str] = dataclasses.field(default_factory=dict)


# ----------------------------------------------------------------------------- reading the source


def _comment_lines(source: str) -> dict[int, str]:
    """Line number -> text of each line that holds only a comment."""
    out = {}
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type == tokenize.COMMENT and token.line.strip().startswith("#"):
            out[token.start[0]] = token.string.lstrip("#").strip()
    return out


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def _is_config_dict(node: ast.expr) -> bool:
    """`ml_collections.ConfigDict()` or `ConfigDict()` with no contents."""
    if not isinstance(node, ast.Call) or node.args or node.keywords:
        return False
    func = node.func
    name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
    return name == "ConfigDict"


class _SourceWalker:
    """Follows `base_config()` through the helpers it calls, resolving dotted key names.

    Inside each function, a name is bound to the config section it stands for:
    the returned variable to the key the caller assigns the result to, and the
    parameters to the sections the caller passes.
    """

    def __init__(self, source: str):
        self.comments = _comment_lines(source)
        tree = ast.parse(source)
        self.functions = {n.name: n for n in tree.body if isinstance(n, ast.FunctionDef)}
        self.docs = SourceDocs()

    def comment_above(self, node: ast.stmt) -> str:
        line, lines = node.lineno - 1, []
        while line in self.comments:
            lines.append(self.comments[line])
            line -= 1
        return " ".join(reversed([text for text in lines if text]))

    def walk(self, name: str, env: dict[str, str], returns_to: str | None, depth: int = 0):
        if depth > _MAX_DEPTH:
            raise RecursionError(f"helpers of {_SOURCE_NAME} nest deeper than {_MAX_DEPTH}")
        fn = self.functions[name]
        env = dict(env)
        if returns_to is not None:
            for node in ast.walk(fn):
                if isinstance(node, ast.Return) and isinstance(node.value, ast.Name):
                    env[node.value.id] = returns_to
        self._statements(fn.body, env, depth)

    def _statements(self, body: Sequence[ast.stmt], env: dict[str, str], depth: int):
        for stmt in body:
            if isinstance(stmt, (ast.Assign, ast.AnnAssign)):
                targets = stmt.targets if isinstance(stmt, ast.Assign) else [stmt.target]
                for target in targets:
                    self._assign(stmt, target, stmt.value, env, depth)
            elif isinstance(stmt, ast.Expr):
                self._call(stmt.value, env, None, depth)
            elif isinstance(stmt, (ast.If, ast.For, ast.While, ast.With, ast.Try)):
                for field in ("body", "orelse", "finalbody"):
                    self._statements(getattr(stmt, field, []), env, depth)

    def _resolve(self, node: ast.expr, env: Mapping[str, str]) -> str | None:
        if isinstance(node, ast.Name):
            return env.get(node.id)
        if isinstance(node, ast.Attribute):
            base = self._resolve(node.value, env)
            return None if base is None else _join(base, node.attr)
        if isinstance(node, ast.Subscript) and isinstance(node.slice, ast.Constant):
            base = self._resolve(node.value, env)
            if base is not None and isinstance(node.slice.value, str):
                return _join(base, node.slice.value)
        return None

    def _call(self, node, env, returns_to: str | None, depth: int) -> bool:
        """Follows a call of a helper of the module; False when `node` is none."""
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                and node.func.id in self.functions):
            return False
        fn = self.functions[node.func.id]
        params = [a.arg for a in fn.args.posonlyargs + fn.args.args + fn.args.kwonlyargs]
        bound = list(zip(params, node.args, strict=False))
        bound += [(k.arg, k.value) for k in node.keywords if k.arg is not None]
        callee_env = {}
        for param, arg in bound:
            section = self._resolve(arg, env)
            if section is not None:
                callee_env[param] = section
        self.walk(node.func.id, callee_env, returns_to, depth + 1)
        return True

    def _assign(self, stmt, target, value, env, depth):
        if value is None:
            return
        if isinstance(target, ast.Name):
            return
        key = self._resolve(target, env)
        if key is None:
            return
        if self._call(value, env, key, depth):
            self.docs.sections.setdefault(key, self.comment_above(stmt))
        elif _is_config_dict(value):
            self.docs.sections.setdefault(key, self.comment_above(stmt))
        elif not (isinstance(value, ast.Name) and value.id in env):
            comment = self.comment_above(stmt)
            if comment or key not in self.docs.keys:
                self.docs.keys.setdefault(key, "")
                self.docs.keys[key] = self.docs.keys[key] or comment


def source_docs(source: str, entry: str = "base_config") -> SourceDocs:
    """The comment above every key that `entry` (and the helpers it calls) sets.

    Args:
      source: Python source of the module that defines `entry`.
      entry: the function that builds the config and returns it.

    Returns:
      `SourceDocs`: dotted key -> comment, in source order ("" for a key set
      without one), and dotted section -> comment.
    """
    walker = _SourceWalker(source)
    if entry not in walker.functions:
        raise ValueError(f"{entry}() is not defined in the source")
    walker.walk(entry, {}, returns_to="")
    return walker.docs


# ----------------------------------------------------------------------------- the config itself


def flatten(config: ml_collections.ConfigDict, prefix: str = "") -> dict[str, Any]:
    """Dotted key -> value of every leaf of `config` (sections are not leaves)."""
    out = {}
    for name, value in config.items():
        key = _join(prefix, name)
        if isinstance(value, ml_collections.ConfigDict):
            out.update(flatten(value, key))
        else:
            out[key] = value
    return out


def document(config: ml_collections.ConfigDict, source: str, entry: str = "base_config",
             source_name: str = _SOURCE_NAME) -> list[KeyDoc]:
    """Every key of `config` with its default and the comment that documents it.

    Raises:
      UndocumentedKeyError: naming each key of `config` that the source sets
        without a comment directly above it (or that the source reading could not
        find, e.g. one set in a loop).
    """
    docs = source_docs(source, entry)
    values = flatten(config)
    missing = sorted(k for k in values if not docs.keys.get(k))
    if missing:
        raise UndocumentedKeyError(
            f"{len(missing)} config key(s) of {source_name} have no comment directly above "
            f"the line that sets their default: {', '.join(missing)}. Write one '# ...' line "
            "(or more) right above each assignment; it becomes the key's documentation in "
            "docs/configs.md.")
    order = [k for k in docs.keys if k in values]
    return [KeyDoc(k, values[k], docs.keys[k]) for k in order]


def config_overrides(configs_dir: str = CONFIGS_DIR, order: Sequence[str] = ()
                     ) -> dict[str, tuple[str, list[tuple[str, Any, Any]], dict[str, Any]]]:
    """What each `configs/<name>.py` changes: `{path: (summary, [(key, value, default)],
    variants)}`.

    A key that the base config lacks has the default `KeyError`; one that the
    experiment config removes has the value `KeyError`. Keys come in `order`
    (the source order of the defaults), unknown ones last, by name. `variants` is the
    module's `ARG_DEFAULTS` (the `path.py:name=value` args `get_config` takes, with
    their defaults), `{}` when it has none.
    """
    root = os.path.dirname(os.path.abspath(configs_dir))
    package = os.path.basename(os.path.abspath(configs_dir))
    if root not in sys.path:
        sys.path.insert(0, root)
    base = flatten(defaults.base_config())
    out = {}
    for filename in sorted(os.listdir(configs_dir)):
        if not filename.endswith(".py") or filename.startswith("_"):
            continue
        name = f"{package}/{filename}"
        try:
            module = importlib.import_module(f"{package}.{filename[:-3]}")
            values = flatten(module.get_config())
        except Exception as err:
            raise RuntimeError(f"{name}: get_config() failed: {type(err).__name__}: {err}") from err
        changed = [(k, v, base.get(k, KeyError)) for k, v in values.items()
                   if k not in base or base[k] != v]
        changed += [(k, KeyError, v) for k, v in base.items() if k not in values]
        rank = {k: i for i, k in enumerate(order)}
        changed.sort(key=lambda item: (rank.get(item[0], len(rank)), item[0]))
        out[name] = (_first_line(module.__doc__), changed,
                     dict(getattr(module, "ARG_DEFAULTS", None) or {}))
    return out


# ----------------------------------------------------------------------------- markdown


def format_value(value: Any) -> str:
    """A default as it would be written in a config file."""
    if isinstance(value, str):
        return json.dumps(value)
    if isinstance(value, (tuple, list)):
        items = ", ".join(format_value(v) for v in value)
        if isinstance(value, list):
            return f"[{items}]"
        return f"({items},)" if len(value) == 1 else f"({items})"
    return repr(value)


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def _code(value: Any) -> str:
    if value is KeyError:
        return "—"
    return f"`{_cell(format_value(value))}`"


def _first_line(doc: str | None) -> str:
    return (doc or "").strip().split("\n\n")[0].replace("\n", " ")


def _sections(keys: Sequence[KeyDoc]) -> Iterator[tuple[str, list[KeyDoc]]]:
    groups: dict[str, list[KeyDoc]] = {}
    for doc in keys:
        groups.setdefault(doc.key.split(".")[0] if "." in doc.key else TOP_LEVEL, []).append(doc)
    yield from groups.items()


def render(keys: Sequence[KeyDoc], sections: Mapping[str, str],
           overrides: Mapping[str, tuple[str, list, dict]]) -> str:
    """docs/configs.md: a table of keys per section, then each experiment config's overrides."""
    lines = [
        "<!-- Generated by `python -m jrl.config.docs` from jrl/config/defaults.py and "
        "configs/*.py. Do not edit: change the comment above the key and regenerate. -->",
        "",
        "# Configuration reference",
        "",
        "Every key of the experiment config, with its default (`jrl/config/defaults.py`) and",
        "its meaning (the comment above the default). An experiment config in `configs/`",
        "starts from these defaults and changes some of them; any key can also be set on",
        "the command line:",
        "",
        "```bash",
        "python -m jrl.train --config=configs/grpo_arith.py --config.rollout.n=16 \\",
        "    --config.actor.optim.lr=1e-4 --workdir=runs/n16",
        "```",
        "",
        "A config file may also take variants after a colon, such as",
        "`--config=configs/grpo_arith.py:n=16,lr=3e-4`; each file's are listed below with",
        "its overrides.",
        "",
        "The config is checked before anything is built or compiled; a bad value stops",
        "the run with the key named. See [guide.md](guide.md) for how the keys fit together.",
        "",
        "Sections: " + ", ".join(f"[`{name}`](#{_anchor(name)})" for name, _ in _sections(keys))
        + ". Experiment configs: [overrides](#experiment-configs).",
    ]
    for name, docs in _sections(keys):
        lines += ["", f"## {'`' + name + '`' if name != TOP_LEVEL else name}", ""]
        if sections.get(name):
            lines += [sections[name], ""]
        lines += ["| key | default | meaning |", "|---|---|---|"]
        lines += [f"| `{d.key}` | {_code(d.default)} | {_cell(d.meaning)} |" for d in docs]
    lines += ["", "## Experiment configs", "",
              "The keys each file in `configs/` sets to something other than the default "
              "(— marks a key the defaults do not have).", ""]
    for name, (summary, changed, variants) in overrides.items():
        lines += [f"### `{name}`", ""]
        if summary:
            lines += [summary, ""]
        lines += [f"`python -m jrl.train --config={name}`", ""]
        if variants:
            lines += [f"Variants (`--config={name}:name=value,...`; the file's docstring says "
                      "what each sets), with their defaults: "
                      + ", ".join(f"`{k}={v}`" for k, v in variants.items())
                      + ".", ""]
        if not changed:
            lines += ["The defaults, unchanged.", ""]
            continue
        lines += ["| key | value | default |", "|---|---|---|"]
        lines += [f"| `{k}` | {_code(v)} | {_code(d)} |" for k, v, d in changed]
        lines.append("")
    return "\n".join(lines).rstrip("\n") + "\n"


def _anchor(section: str) -> str:
    return "top-level" if section == TOP_LEVEL else section.lower().replace(".", "")


def generate(configs_dir: str = CONFIGS_DIR) -> str:
    """The text of docs/configs.md for the code as it is now."""
    with open(defaults.__file__, encoding="utf-8") as f:
        source = f.read()
    keys = document(defaults.base_config(), source)
    overrides = config_overrides(configs_dir, [d.key for d in keys])
    return render(keys, source_docs(source).sections, overrides)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m jrl.config.docs", description=__doc__.split(
        "\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true",
                        help="exit 1 if the output file differs from a fresh generation")
    parser.add_argument("--output", default=OUTPUT, help="where to write (default: %(default)s)")
    parser.add_argument("--configs", default=CONFIGS_DIR, help="experiment configs directory")
    args = parser.parse_args(argv)
    try:
        text = generate(args.configs)
    except (UndocumentedKeyError, RuntimeError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    if args.check:
        current = ""
        if os.path.exists(args.output):
            with open(args.output, encoding="utf-8") as f:
                current = f.read()
        if current != text:
            print(f"{args.output} is stale: regenerate it with `python -m jrl.config.docs`",
                  file=sys.stderr)
            return 1
        print(f"{args.output} is up to date")
        return 0
    with open(args.output, "w", encoding="utf-8") as f:
        f.write(text)
    print(f"wrote {args.output} ({len(text.splitlines())} lines)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
