"""The tool interface: a named function the policy can call during a multi-turn rollout.

A tool is described to the model by an OpenAI-style function schema,

    {"type": "function",
     "function": {"name": "calculator", "description": "...",
                  "parameters": {"type": "object", "properties": {...}, "required": [...]}}}

which the chat template renders into the system prompt. Each rollout row gets its own
instance of every tool (`create`, with the row's `extra_info.tools_kwargs[name]
["create_kwargs"]`), the model's calls run against that instance (`execute`), the
instance may add to the row's reward at the end (`calc_reward`), and `release` frees it.
"""

from __future__ import annotations

import copy
import uuid
from typing import Any, ClassVar

from jrl.errors import ConfigError

# Keys every tool config may carry without the tool reading them: verl's tool configs
# mark native tools with `type: native`.
PASSTHROUGH_CONFIG_KEYS = frozenset({"type"})

_JSON_TYPES: dict[str, tuple[type, ...]] = {
    "string": (str,),
    "integer": (int,),
    "number": (int, float),
    "boolean": (bool,),
    "array": (list,),
    "object": (dict,),
    "null": (type(None),),
}


class ToolError(Exception):
    """A failure the model caused (bad input to the tool): shown to it as `Error: <message>`.

    Any other exception a tool raises is shown as `Error: <ExceptionType>: <message>`.
    """


def schema_problems(tool_schema: Any) -> list[str]:
    """What is wrong with an OpenAI-style function schema; empty when it is usable.

    Args:
      tool_schema: `{"type": "function", "function": {"name", "description",
        "parameters"}}`; `parameters` is a JSON schema of type "object".

    Returns:
      One line per problem, naming the field.
    """
    if not isinstance(tool_schema, dict):
        return [f"tool_schema must be a mapping, got {type(tool_schema).__name__}"]
    problems = []
    if tool_schema.get("type", "function") != "function":
        problems.append(f"tool_schema.type must be 'function', got {tool_schema['type']!r}")
    function = tool_schema.get("function")
    if not isinstance(function, dict):
        return problems + ["tool_schema.function is missing (it holds name, description "
                           "and parameters)"]
    name = function.get("name")
    if not isinstance(name, str) or not name.strip():
        problems.append("tool_schema.function.name is missing or empty")
    parameters = function.get("parameters")
    if not isinstance(parameters, dict):
        problems.append("tool_schema.function.parameters is missing (a JSON schema of "
                        "type 'object'; use {'type': 'object', 'properties': {}} for none)")
    elif parameters.get("type", "object") != "object":
        problems.append(f"tool_schema.function.parameters.type must be 'object', got "
                        f"{parameters['type']!r}")
    elif not isinstance(parameters.get("required", []), list):
        problems.append("tool_schema.function.parameters.required must be a list of names")
    return problems


def argument_problems(tool_schema: dict, arguments: Any) -> list[str]:
    """Checks a call's arguments against the schema's `required` list and declared types.

    Only the top level is checked: required names, the JSON type of each declared
    property, and unknown names when the schema sets `additionalProperties: false`.

    Returns:
      One line per problem; empty when the call may run.
    """
    if not isinstance(arguments, dict):
        return [f"arguments must be a JSON object, got {type(arguments).__name__}"]
    parameters = tool_schema["function"].get("parameters") or {}
    properties = parameters.get("properties") or {}
    problems = [f"missing required argument {name!r}"
                for name in parameters.get("required", []) if name not in arguments]
    for name, value in arguments.items():
        if name not in properties:
            if parameters.get("additionalProperties", True) is False:
                problems.append(f"unknown argument {name!r}; expected one of "
                                f"{sorted(properties)}")
            continue
        expected = properties[name].get("type") if isinstance(properties[name], dict) else None
        if isinstance(expected, str) and not _has_json_type(value, expected):
            problems.append(f"argument {name!r} must be of type {expected}, got "
                            f"{type(value).__name__} {value!r:.60}")
    return problems


def _has_json_type(value: Any, json_type: str) -> bool:
    if json_type not in _JSON_TYPES:
        return True  # a type this check does not know: the tool decides
    if isinstance(value, bool) and json_type in ("integer", "number"):
        return False
    return isinstance(value, _JSON_TYPES[json_type])


class Tool:
    """Base class of tools; a subclass need only define `execute`.

    Subclasses may set `default_schema` (used when a config gives no `tool_schema`) and
    `config_defaults` (then `config` may hold only those keys, and missing ones get the
    defaults).

    Attributes:
      config: the tool's settings, from the `config` entry of the tool config file.
      schema: the OpenAI-style function schema, as given to the chat template.
      instances: per-row state by instance id: the `create` keyword arguments.
    """

    default_schema: ClassVar[dict | None] = None
    config_defaults: ClassVar[dict | None] = None

    def __init__(self, config: dict | None = None, tool_schema: dict | None = None):
        """Raises ConfigError: no schema, a malformed one, or an unknown config key."""
        tool_schema = tool_schema if tool_schema is not None else type(self).default_schema
        if tool_schema is None:
            raise ConfigError(f"{type(self).__name__} has no default schema; give a "
                              "tool_schema")
        if problems := schema_problems(tool_schema):
            raise ConfigError("; ".join(problems))
        self.schema = copy.deepcopy(tool_schema)
        self.config = self._checked_config(dict(config or {}))
        self.instances: dict[str, dict] = {}

    def _checked_config(self, config: dict) -> dict:
        defaults = type(self).config_defaults
        if defaults is None:
            return config
        unknown = sorted(set(config) - set(defaults) - PASSTHROUGH_CONFIG_KEYS)
        if unknown:
            raise ConfigError(f"{type(self).__name__} config has unknown key(s) {unknown}; "
                              f"known: {sorted(defaults)}")
        return {**defaults, **config}

    @property
    def name(self) -> str:
        """The function name the model calls the tool by."""
        return self.schema["function"]["name"]

    def create(self, instance_id: str | None = None, **kwargs) -> str:
        """Starts the state of one rollout row.

        Args:
          instance_id: the row's id; a fresh one is made when None.
          **kwargs: the row's `extra_info.tools_kwargs[name]["create_kwargs"]`.

        Returns:
          The instance id to pass to `execute`, `calc_reward` and `release`.
        """
        instance_id = instance_id if instance_id is not None else uuid.uuid4().hex
        self.instances[instance_id] = dict(kwargs)
        return instance_id

    def execute(self, instance_id: str, arguments: dict) -> tuple[str, float, dict]:
        """Runs one call.

        Args:
          instance_id: from `create`.
          arguments: the call's arguments, already checked against the schema's
            required names and property types.

        Returns:
          (text shown to the model as the tool's message, a step reward, metrics: a
          flat dict of scalars).

        Raises:
          ToolError: the model's input was bad; the message is shown to it.
        """
        raise NotImplementedError(f"{type(self).__name__} does not define execute")

    def calc_reward(self, instance_id: str) -> float:
        """The instance's reward at the end of the rollout; 0 by default."""
        del instance_id
        return 0.0

    def release(self, instance_id: str) -> None:
        """Frees the instance's state; releasing an unknown instance does nothing."""
        self.instances.pop(instance_id, None)
