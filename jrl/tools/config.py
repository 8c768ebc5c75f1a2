"""Tool config files, in verl's format (YAML, or JSON):

    tools:
      - class_name: jrl.tools.Calculator
        config: {type: native, max_digits: 4000}
      - class_name: my_tools/search.py:SearchTool   # or my_package.search.SearchTool
        config: {type: native}
        tool_schema:
          type: function
          function:
            name: search
            description: Searches the corpus.
            parameters:
              type: object
              properties: {query: {type: string, description: What to look for.}}
              required: [query]

`class_name` is a dotted import path (the module importable: an installed package,
or its directory on PYTHONPATH) or, as `reward.custom_fn` names a function,
`path/to/file.py:ClassName` (a relative path from the current directory).
`tool_schema` may be left out for tools with a default schema (the built-ins).
"""

from __future__ import annotations

import importlib
import json
import os
from typing import Any

import yaml

from jrl import pyfile
from jrl.errors import ConfigError
from jrl.tools.base import Tool, schema_problems

_CLASS_FORMS = ("a dotted import path (e.g. jrl.tools.Calculator) or "
                "'path/to/file.py:ClassName'")


def load_tools(path: str | os.PathLike) -> dict[str, Tool]:
    """The tools a tool config file lists, constructed, by name.

    Args:
      path: a YAML file (or JSON, by a ".json" suffix) with a `tools` list of
        `{class_name, config, tool_schema}` entries.

    Returns:
      The tools by their schema's function name, in file order.

    Raises:
      ConfigError: naming the file, the entry index and the problem: a missing or
        unparsable file, no `tools` list, a class that does not import or is not a
        `Tool`, a schema without name or parameters, a constructor that refuses its
        config, or two tools with one name.
    """
    path = os.fspath(path)
    tools: dict[str, Tool] = {}
    first_index: dict[str, int] = {}
    for i, entry in enumerate(_read_entries(path)):
        where = f"tool config {path}: tools[{i}]"
        tool = _build(entry, where)
        where = f"{where} ({entry['class_name']})"
        if tool.name in tools:
            raise ConfigError(f"{where}: tool name {tool.name!r} is already used by "
                              f"tools[{first_index[tool.name]}]; names must be unique")
        tools[tool.name] = tool
        first_index[tool.name] = i
    return tools


def _read_entries(path: str) -> list:
    if not os.path.isfile(path):
        raise ConfigError(f"tool config {path}: file not found")
    try:
        with open(path, encoding="utf-8") as f:
            document = json.load(f) if path.endswith(".json") else yaml.safe_load(f)
    except (json.JSONDecodeError, yaml.YAMLError) as err:
        raise ConfigError(f"tool config {path}: cannot parse it: {err}") from None
    if document is None:
        return []  # an empty file lists no tools
    if not isinstance(document, dict) or not isinstance(document.get("tools", []), list):
        raise ConfigError(f"tool config {path}: expected a mapping with a 'tools' list of "
                          "{class_name, config, tool_schema} entries")
    return document.get("tools") or []


def _build(entry: Any, where: str) -> Tool:
    if not isinstance(entry, dict) or not isinstance(entry.get("class_name"), str):
        raise ConfigError(f"{where}: expected a mapping with 'class_name' ({_CLASS_FORMS}), "
                          "'config' and optionally 'tool_schema'")
    if unknown := sorted(set(entry) - {"class_name", "config", "tool_schema"}):
        raise ConfigError(f"{where}: unknown key(s) {unknown}; expected class_name, config, "
                          "tool_schema")
    cls = _import_class(entry["class_name"], where)
    where = f"{where} ({entry['class_name']})"
    config = entry.get("config") or {}
    if not isinstance(config, dict):
        raise ConfigError(f"{where}: config must be a mapping, got {type(config).__name__}")
    schema = entry.get("tool_schema")
    if schema is None and cls.default_schema is None:
        raise ConfigError(f"{where}: no tool_schema, and the class has no default schema")
    if problems := schema_problems(schema if schema is not None else cls.default_schema):
        raise ConfigError(f"{where}: {'; '.join(problems)}")
    try:
        return cls(config=config, tool_schema=schema)
    except Exception as err:  # the tool's own check of its config
        raise ConfigError(f"{where}: constructing the tool failed: "
                          f"{type(err).__name__}: {err}") from err


def _import_class(class_name: str, where: str) -> type[Tool]:
    """The class a `class_name` names: `package.module.Class` (importable from
    PYTHONPATH) or `path/to/file.py:Class` (loaded as `reward.custom_fn` is, by
    `jrl.pyfile`; a relative path is taken from the current directory)."""
    if pyfile.is_file_spec(class_name):
        try:
            cls = pyfile.load(class_name, f"{where}: class_name", _CLASS_FORMS, kind=type)
        except (ConfigError, FileNotFoundError, ImportError) as err:
            raise ConfigError(str(err)) from None
    else:
        module_name, _, attribute = class_name.rpartition(".")
        if not module_name:
            raise ConfigError(f"{where}: class_name {class_name!r} must be {_CLASS_FORMS}")
        try:
            cls = getattr(importlib.import_module(module_name), attribute)
        except Exception as err:  # importing runs the module: anything may fail
            raise ConfigError(f"{where}: class_name {class_name!r} cannot be imported: "
                              f"{type(err).__name__}: {err}; a module outside an installed "
                              "package needs its directory on PYTHONPATH, or name the file: "
                              "'path/to/file.py:ClassName'") from None
    if not (isinstance(cls, type) and issubclass(cls, Tool)):
        raise ConfigError(f"{where}: class_name {class_name!r} is not a subclass of "
                          "jrl.tools.Tool")
    return cls
