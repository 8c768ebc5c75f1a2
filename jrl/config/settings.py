"""Turns an experiment `ConfigDict` into validated, static settings.

Everything is checked here, before anything is loaded, built or compiled; each error
names the config key and what would be valid. Below the entry points (`jrl.train`,
`jrl.sft`) only these frozen dataclasses travel, never the `ConfigDict`: the
experiment's builders take `ExperimentSettings`, the trainers and the jitted steps
`Settings`.

A run's settings come in two steps: `from_config` reads and checks every key; what
the tokenizer and the training rows decide (the rollouts' stop and pad ids, the step
count of `trainer.total_epochs`) is added by `Settings.with_data` once they are built.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import math
import os

import ml_collections

from jrl import optim, sharding, tools
from jrl.algos import advantages, kl_control, losses, masks
from jrl.algos import rollout_correction as rollout_correction
from jrl.app import distributed
from jrl.config import defaults
from jrl.data import synthetic
from jrl.errors import ConfigError
from jrl.kernels import mosaic_backend
from jrl.models import config as model_config
from jrl.models import hf
from jrl.rewards import custom, in_graph, reward_model, scoring
from jrl.rl import buckets
from jrl.rollout import multi_turn, paged, sampler
from jrl.rollout.sampler import SamplingConfig

# The lists of valid values below are the ones this module owns; every other choice key
# is checked against the list of the module that implements it (losses.POLICY_LOSSES,
# kl_control.KL_CONTROLLERS, model_config.DTYPES, ...), never a copy.
NAN_POLICIES = ("skip", "raise")
LOGGERS = ("console", "jsonl", "tensorboard", "wandb")
_LOGGER_PACKAGES = {"tensorboard": "tensorboardX", "wandb": "wandb"}


def _fail(key: str, message: str):
    raise ConfigError(f"{key}: {message}")


def _fail_in_graph(spec: str, key: str, what: str):
    """Stops a run that sets `reward.in_graph_fn` beside `key`, which needs host scores."""
    _fail(in_graph.KEY, f"{spec!r} scores on the device and cannot be combined with "
          f"{key}{what}; unset one of them")


def _number(key: str, value, *, allow_zero: bool = False, integer: bool = False):
    """`value` if it is a positive (or, `allow_zero`, non-negative) number."""
    if not isinstance(value, (int, float)) or isinstance(value, bool) or value < 0 or (
        value == 0 and not allow_zero
    ):
        kind = "non-negative" if allow_zero else "positive"
        _fail(key, f"must be a {kind} number, got {value!r}")
    return int(value) if integer else value


def _flag(key: str, value, automatic: bool = False) -> bool | None:
    """`value`, a bool (or, with `automatic`, None: the key's automatic choice)."""
    if automatic and value is None:
        return value
    if not isinstance(value, bool):
        valid = "True, False or None (automatic)" if automatic else "True or False"
        _fail(key, f"must be {valid}, got {value!r}")
    return value


def _choice(key: str, value, choices) -> str:
    if value not in choices:
        _fail(key, f"{value!r} is not valid; choose one of {list(choices)}")
    return value


def _set(settings, **values) -> None:
    """Normalised field values (e.g. ints) on a frozen dataclass, in `__post_init__`."""
    for name, value in values.items():
        object.__setattr__(settings, name, value)


# Each settings dataclass checks its own fields in `__post_init__`, naming the config key
# (`prefix` says whose keys they are: "actor" or "critic"); checks across sections are
# `Settings`'. `from_config` only reads the keys.


@dataclasses.dataclass(frozen=True)
class OptimSettings:
    lr: float
    weight_decay: float
    betas: tuple[float, float]
    warmup_steps: int
    lr_scheduler_type: str
    min_lr_ratio: float
    grad_clip: float
    total_steps: int
    prefix: str = dataclasses.field(default="actor", compare=False, repr=False)

    def __post_init__(self):
        p = f"{self.prefix}.optim"
        _number(f"{p}.lr", self.lr, allow_zero=True)
        betas = tuple(self.betas)
        if len(betas) != 2 or not all(0 <= b < 1 for b in betas):
            _fail(f"{p}.betas", f"must be two numbers in [0, 1), got {betas}")
        if not 0 <= self.min_lr_ratio <= 1:
            _fail(f"{p}.min_lr_ratio", f"must be in [0, 1], got {self.min_lr_ratio}")
        _set(self, betas=betas,
             weight_decay=_number(f"{p}.weight_decay", self.weight_decay, allow_zero=True),
             warmup_steps=_number(f"{p}.lr_warmup_steps", self.warmup_steps, allow_zero=True,
                                  integer=True),
             grad_clip=_number(f"{self.prefix}.grad_clip", self.grad_clip, allow_zero=True))
        _choice(f"{p}.lr_scheduler_type", self.lr_scheduler_type, optim.LR_SCHEDULERS)


@dataclasses.dataclass(frozen=True)
class UpdateSettings:
    """How one model is updated from a batch of `B·n` sequences."""

    ppo_epochs: int
    mini_batch: int  # sequences per optimizer step
    micro_batch: int  # sequences per forward/backward
    shuffle: bool
    nan_policy: str
    prefix: str = dataclasses.field(default="actor", compare=False, repr=False)
    # Token-budget micro-batches (`jrl.rl.packing`): slots per device per micro-batch
    # (`<prefix>.ppo_max_token_len_per_gpu` with `use_dynamic_bsz`); None: micro-batches
    # of `micro_batch` padded sequences.
    max_token_len: int | None = None

    def __post_init__(self):
        p = self.prefix
        _set(self, ppo_epochs=_number(f"{p}.ppo_epochs", self.ppo_epochs, integer=True),
             mini_batch=_number(f"{p}.ppo_mini_batch_size", self.mini_batch, integer=True),
             micro_batch=_number(f"{p}.ppo_micro_batch_size", self.micro_batch, integer=True),
             shuffle=bool(self.shuffle))
        if self.mini_batch % self.micro_batch:
            self._fail_micro_batch()
        _choice("trainer.nan_policy", self.nan_policy, NAN_POLICIES)
        if self.max_token_len is not None:
            _set(self, max_token_len=_number(f"{p}.ppo_max_token_len_per_gpu",
                                             self.max_token_len, integer=True))


    def _fail_micro_batch(self):
        """Names the key that is off: the mini-batch when it is smaller than one
        micro-batch (e.g. `ppo_mini_batch_size=7` under a preset micro-batch of 128),
        else the micro-batch that does not divide it; the other key is named as well."""
        p, mini, micro = self.prefix, self.mini_batch, self.micro_batch
        mini_key, micro_key = f"{p}.ppo_mini_batch_size", f"{p}.ppo_micro_batch_size"
        if micro > mini:
            _fail(mini_key, f"its mini-batch of {mini} sequences ({mini_key} x rollout.n) "
                  f"is smaller than one micro-batch of {micro_key}={micro} sequences; make "
                  f"{mini_key} x rollout.n a multiple of {micro}, or set {micro_key} to a "
                  f"divisor of {mini}")
        _fail(micro_key, f"{micro} sequences must divide the mini-batch of {mini} sequences "
              f"({mini_key} x rollout.n); set {micro_key} to a divisor of {mini}, or change "
              f"{mini_key}")


@dataclasses.dataclass(frozen=True)
class ActorSettings:
    update: UpdateSettings
    loss: losses.PolicyLossConfig
    entropy_coeff: float
    use_kl_loss: bool
    kl_loss_coef: float
    kl_loss_type: str
    optim: OptimSettings
    # The MoE router's load-balancing loss coefficient (None: the checkpoint's).
    router_aux_loss_coef: float | None = None
    # "rollout": the actor's passes route each token to the rollout's experts.
    router_replay: str = "disabled"
    # The update is on-policy and reads its old log-probs from its own forward pass
    # (`actor.reuse_update_log_probs` where it applies; `Settings` checks it does).
    on_policy: bool = False
    # `algorithm.rollout_correction.*`: the rollout/training mismatch's correction.
    correction: rollout_correction.RolloutCorrectionConfig = (
        rollout_correction.RolloutCorrectionConfig())

    @property
    def skips_old_pass(self) -> bool:
        """No separate old-log-prob pass: the update's own log-probs (on-policy) or the
        rollout's (bypass mode) are the old ones; the update reports the entropy."""
        return self.on_policy or self.correction.bypass_mode

    def __post_init__(self):
        self.loss.validate("actor")
        self.correction.validate()
        if self.correction.rollout_is is not None and self.loss.loss_mode == "geo_mean":
            _fail("algorithm.rollout_correction.rollout_is", "per-token IS weights do not "
                  "apply to actor.policy_loss.loss_mode='geo_mean' (one ratio per sequence); "
                  "use rollout_rs, or another loss_mode")
        _set(self, entropy_coeff=float(self.entropy_coeff), use_kl_loss=bool(self.use_kl_loss),
             kl_loss_coef=float(_number("actor.kl_loss_coef", self.kl_loss_coef,
                                        allow_zero=True)))
        _choice("actor.kl_loss_type", self.kl_loss_type, losses.KL_PENALTIES)
        _choice("actor.router_replay", self.router_replay, ROUTER_REPLAY_MODES)
        if self.router_aux_loss_coef is not None:
            _set(self, router_aux_loss_coef=float(_number(
                "actor.router_aux_loss_coef", self.router_aux_loss_coef, allow_zero=True)))


@dataclasses.dataclass(frozen=True)
class CriticSettings:
    update: UpdateSettings
    cliprange_value: float
    loss_agg_mode: str
    optim: OptimSettings
    # LoRA on the critic (`critic.model.*`): its own adapters on the actor's frozen base.
    lora_rank: int = 0
    lora_alpha: float = 16.0
    lora_targets: tuple[str, ...] = ()
    # The update is on-policy and reads its values from its own forward pass
    # (`critic.reuse_update_values` where it applies; `Settings` checks it does).
    on_policy: bool = False

    def __post_init__(self):
        _set(self, cliprange_value=float(_number("critic.cliprange_value",
                                                 self.cliprange_value)))
        _choice("critic.loss_agg_mode", self.loss_agg_mode, masks.LOSS_AGG_MODES)


@dataclasses.dataclass(frozen=True)
class AlgorithmSettings:
    adv_estimator: str
    gamma: float
    lam: float
    norm_adv_by_std_in_grpo: bool
    use_kl_in_reward: bool
    kl_penalty: str
    kl_ctrl_type: str
    kl_coef: float
    target_kl: float
    horizon: float

    def __post_init__(self):
        _choice("algorithm.adv_estimator", self.adv_estimator, advantages.ESTIMATORS)
        for key in ("gamma", "lam"):
            if not 0 <= getattr(self, key) <= 1:
                _fail(f"algorithm.{key}", f"must be in [0, 1], got {getattr(self, key)}")
        _choice("algorithm.kl_ctrl.type", self.kl_ctrl_type, kl_control.KL_CONTROLLERS)
        if self.kl_ctrl_type == "adaptive":
            _number("algorithm.kl_ctrl.horizon", self.horizon)
            _number("algorithm.kl_ctrl.target_kl", self.target_kl)
        _choice("algorithm.kl_penalty", self.kl_penalty, losses.KL_PENALTIES)
        _set(self, gamma=float(self.gamma), lam=float(self.lam),
             norm_adv_by_std_in_grpo=bool(self.norm_adv_by_std_in_grpo),
             use_kl_in_reward=bool(self.use_kl_in_reward),
             kl_coef=float(_number("algorithm.kl_ctrl.kl_coef", self.kl_coef, allow_zero=True)),
             target_kl=float(self.target_kl), horizon=float(self.horizon))


@dataclasses.dataclass(frozen=True)
class RewardSettings:
    """How responses are scored (`reward.*`, `reward_model.*`)."""

    custom_fn: str | None  # "path.py:name"; None: the scorer of each data_source
    num_workers: int
    on_error: str  # one of scoring.ON_ERROR
    error_score: float
    model_path: str | None  # reward model checkpoint; None: rule scoring
    model_max_length: int
    model_truncation: str
    model_micro_batch_size: int | None
    overlong_buffer_len: int  # 0: no overlong shaping
    overlong_penalty_factor: float
    # A reward computed on the device (`jrl.rewards.in_graph`); None: host rewards.
    in_graph_fn: str | None = None

    def __post_init__(self):
        _choice("reward.on_error", self.on_error, scoring.ON_ERROR)
        if self.in_graph_fn is not None:
            self._check_in_graph()
        if self.custom_fn is not None:
            # The loader's own parser, so `~` and the spec rules are the same here and there.
            try:
                path, _ = custom.parse_spec(self.custom_fn)
            except ValueError as err:
                _fail("reward.custom_fn", str(err))
            if not path.is_file():
                _fail("reward.custom_fn", f"file {str(path)!r} does not exist")
        if self.model_path is not None and not os.path.isdir(self.model_path):
            _fail("reward_model.model.path", f"{self.model_path!r} is not a directory; "
                  "reward_model.enable=True needs a local HF sequence-classification checkpoint")
        micro = self.model_micro_batch_size
        _set(self, num_workers=_number("reward.num_workers", self.num_workers, allow_zero=True,
                                       integer=True),
             error_score=float(self.error_score),
             model_max_length=_number("reward_model.max_length", self.model_max_length,
                                      integer=True),
             model_micro_batch_size=None if micro is None else _number(
                 "reward_model.micro_batch_size", micro, integer=True),
             overlong_penalty_factor=float(_number(
                 "reward_model.overlong_buffer.penalty_factor", self.overlong_penalty_factor,
                 allow_zero=True)))
        _choice("reward_model.truncation", self.model_truncation, reward_model.TRUNCATION)

    def _check_in_graph(self) -> None:
        """`reward.in_graph_fn` is well formed and no host-only reward is set beside it."""
        in_graph.check_spec(self.in_graph_fn)
        conflicts = {
            "reward.custom_fn": (self.custom_fn is not None,
                                 f"={self.custom_fn!r}, a reward function run on the host"),
            "reward_model.enable": (self.model_path is not None,
                                    "=True, a reward model scored on the host"),
            "reward_model.overlong_buffer.enable": (
                self.overlong_buffer_len > 0, "=True, overlong shaping added on the host")}
        for key, (conflict, what) in conflicts.items():
            if conflict:
                _fail_in_graph(self.in_graph_fn, key, what)


@dataclasses.dataclass(frozen=True)
class FilterGroupsSettings:
    """DAPO dynamic sampling (`algorithm.filter_groups.*`); None in Settings when off."""

    metric: str
    max_num_gen_batches: int  # 0: no limit
    gen_batch_size: int  # prompts per generation round
    # The key `gen_batch_size` comes from: data.train_batch_size where data.gen_batch_size
    # is unset.
    gen_batch_key: str = dataclasses.field(default="data.gen_batch_size", compare=False,
                                           repr=False)

    def __post_init__(self):
        if not isinstance(self.metric, str) or not self.metric:
            _fail("algorithm.filter_groups.metric", f"{self.metric!r} must name a reward "
                  "field, e.g. 'acc' or 'score'")
        _set(self, max_num_gen_batches=_number("algorithm.filter_groups.max_num_gen_batches",
                                               self.max_num_gen_batches, allow_zero=True,
                                               integer=True),
             gen_batch_size=_number("data.gen_batch_size", self.gen_batch_size, integer=True))


@dataclasses.dataclass(frozen=True)
class TrainerSettings:
    """The loop's schedule: its length, validation, checkpoints, the critic's warm-up,
    what it logs and exports."""

    test_freq: int  # validate every this many steps (0: never; always after the last)
    save_freq: int  # checkpoint every this many steps (0: never; also after the last)
    val_before_train: bool
    critic_warmup: int  # verl's: the actor first updates at step critic_warmup (from 1)
    max_ckpt_to_keep: int | None
    # Where each step's / validation's samples are written (`<dir>/<step>.jsonl`); None: not.
    rollout_data_dir: str | None = None
    validation_data_dir: str | None = None
    log_val_generations: int = 0  # validation samples printed on the console
    # Runs in one program (`jrl.rl.runs`): seeds per setting, the sweep, steps per call.
    runs: int = 1
    sweep: str | None = None
    steps_per_call: int = 1
    # Compile the first step's programs at once (`RLTrainer.compile_programs`); None: on
    # a GPU or TPU, off on a CPU.
    parallel_compile: bool | None = None
    # RL steps (0: `total_epochs` passes over the training rows, counted by
    # `Settings.with_data`); `total_epochs` is checked only then.
    total_training_steps: int = 0
    total_epochs: int = 1
    logger: tuple[str, ...] = ("console", "jsonl", "tensorboard")  # each one of LOGGERS
    export_hf: bool = True  # a `model.path` run's last step exported in HF format

    @property
    def multi_run(self) -> bool:
        """Whether the run is `jrl.rl.runs`' device program rather than the host loop."""
        return self.runs > 1 or bool(self.sweep) or self.steps_per_call > 1

    def __post_init__(self):
        for logger in self.logger:
            if logger not in LOGGERS:
                _fail("trainer.logger", f"{logger!r} is not valid; choose from {list(LOGGERS)}")
            # A logger asked for by name writes nothing without its package: stop here
            # rather than warn once and run without it.
            package = _LOGGER_PACKAGES.get(logger)
            if package and importlib.util.find_spec(package) is None:
                _fail("trainer.logger", f"{logger!r} needs the {package} package, which is not "
                      f"installed: pip install {package}, or leave {logger!r} out")
        _set(self, logger=tuple(self.logger))
        if self.total_training_steps:
            _set(self, total_training_steps=_number(
                "trainer.total_training_steps", self.total_training_steps, integer=True))
        else:
            _set(self, total_training_steps=0, total_epochs=_number(
                "trainer.total_epochs", self.total_epochs, integer=True))
        for name in ("runs", "steps_per_call"):
            _set(self, **{name: _number(f"trainer.{name}", getattr(self, name), integer=True)})
        if self.sweep is not None and not isinstance(self.sweep, str):
            _fail("trainer.sweep", f"must be a string key=v1,v2,... (or None), got "
                  f"{self.sweep!r}")
        for name in ("rollout_data_dir", "validation_data_dir"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                _fail(f"trainer.{name}", f"must be a directory path (or None: off), got "
                      f"{value!r}")
            if value is not None and os.path.isfile(os.path.expanduser(value)):
                _fail(f"trainer.{name}", f"{value!r} is a file; expected a directory")
        keep = self.max_ckpt_to_keep
        if keep is not None and keep < 1:
            _fail("trainer.max_actor_ckpt_to_keep", f"must be >= 1 (or None: keep all), got "
                  f"{keep}")
        _set(self, **{name: _number(f"trainer.{name}", getattr(self, name), allow_zero=True,
                                    integer=True)
                      for name in ("test_freq", "save_freq", "critic_warmup",
                                   "log_val_generations")},
             val_before_train=bool(self.val_before_train))


@dataclasses.dataclass(frozen=True)
class MultiTurnSettings:
    """`rollout.multi_turn.*` with tools: the loop's settings and the tool config file."""

    config: multi_turn.MultiTurnConfig
    tool_config_path: str
    add_tool_rewards: bool = False  # the tools' rewards added to the score (verl: not)
    # The tools' schemas, in file order: every prompt renders them through the chat
    # template's `tools` variable (`jrl.data.dataset.prompt_text`), as verl's agent loop.
    tool_schemas: tuple[dict, ...] = ()


def _multi_turn(config) -> MultiTurnSettings | None:
    key = "rollout.multi_turn"
    if "multi_turn" not in config.rollout or not _get(config, f"{key}.enable"):
        return None
    get = lambda name: _get(config, f"{key}.{name}")
    path = get("tool_config_path")
    if not path:
        _fail(f"{key}.tool_config_path", "is needed with rollout.multi_turn.enable=True: a "
              "YAML or JSON file listing the tools")
    if not os.path.isfile(os.path.expanduser(path)):
        _fail(f"{key}.tool_config_path", f"{path!r} is not a file")
    # Each class is found, is a Tool and takes its config now, before any model is built
    # (the tools made here are dropped, their schemas kept: the trainer makes its own).
    try:
        schemas = tuple(t.schema for t in tools.load_tools(os.path.expanduser(path)).values())
    except ConfigError as err:
        _fail(f"{key}.tool_config_path", str(err))
    ints = {name: int(_number(f"{key}.{name}", get(name), integer=True)) for name in (
        "max_assistant_turns", "max_user_turns", "max_parallel_calls",
        "max_tool_response_length", "max_tool_response_tokens")}
    stops = get("turn_stop_ids")
    stops = (stops,) if isinstance(stops, int) else tuple(stops)
    if not all(isinstance(t, int) and t >= 0 for t in stops):
        _fail(f"{key}.turn_stop_ids", f"must be token ids (integers >= 0), got {stops!r}")
    fraction = get("segment_end_fraction")
    if not isinstance(fraction, (int, float)) or isinstance(fraction, bool) or not (
            0 < fraction <= 1):
        _fail(f"{key}.segment_end_fraction", f"must be in (0, 1], got {fraction!r}")
    mt = multi_turn.MultiTurnConfig(
        **ints, format=_choice(f"{key}.format", get("format"), tools.FORMATS),
        tool_response_truncate_side=_choice(f"{key}.tool_response_truncate_side",
                                            get("tool_response_truncate_side"),
                                            multi_turn.TRUNCATE_SIDES),
        tool_timeout_s=float(_number(f"{key}.tool_timeout_s", get("tool_timeout_s"))),
        turn_stop_ids=stops, segment_end_fraction=float(fraction))
    return MultiTurnSettings(mt, os.path.expanduser(path), _flag(
        f"{key}.add_tool_rewards", get("add_tool_rewards")), schemas)


# ----------------------------------------------------------------------------- the experiment
# What builds the tokenizer, the rows and the model (`jrl.app.experiment`) and runs the
# warm start (`jrl.sft`): all that `python -m jrl.sft` reads of a config, and the part of a
# run's `Settings` that builds it. These check only what building needs; what training
# needs of the same keys `from_config` checks besides (`_check_model`).

TOKENIZERS = ("char", "hf")


@dataclasses.dataclass(frozen=True)
class TokenizerSettings:
    """`tokenizer.*`: what encodes the prompts and decodes the responses.

    Attributes:
      name: "char" (the built-in character tokenizer) or "hf" (Hugging Face tokenizer
        files).
      path: the Hugging Face tokenizer's directory as the config gives it (`~` allowed);
        None: `model.path`'s.
    """

    name: str
    path: str | None = None

    def __post_init__(self):
        if self.name not in TOKENIZERS:
            raise ConfigError(f"tokenizer.name: {self.name!r} is not valid; choose 'char' or "
                              "'hf'")


@dataclasses.dataclass(frozen=True)
class ModelSettings:
    """`model.*`: the actor's architecture, where its weights come from and how it computes
    (the `jrl.models.ModelConfig` fields a config sets; the vocabulary and special ids are
    the tokenizer's or the checkpoint's).

    Attributes:
      path: a local Hugging Face checkpoint directory as the config gives it (`~`
        allowed); None or "": `preset`, freshly initialised.
      preset: the architecture of a fresh model (`jrl.models.PRESETS`).
      param_dtype: the parameters' dtype.
      dtype: the compute dtype.
      remat: the training passes' rematerialisation policy.
      decode_attention_impl: the decode steps' cache write and attention.
      logprob_impl: the log-prob and update passes' unembedding and log-softmax.
      decode_head_impl: the sampler's unembedding and draw at each decode step.
      fuse_decode_projections: decode with q/k/v and gate/up joined into one matmul each.
      scan_unroll: unroll the update passes' scan over layers (`model.scan_unroll`, its
        default resolved: unrolled with token-budget micro-batches, `use_dynamic_bsz`).
      lora_rank: the LoRA adapters' rank (0: none, full fine-tuning).
      lora_alpha: the adapters' scale numerator (the scale is alpha / rank).
      lora_targets: `model.target_modules` as the config gives it: the projections with
        adapters.
      lora_rollout: how rollouts apply the adapters ("merged" or "unmerged").
      hidden_size, intermediate_size, num_layers, num_heads, num_kv_heads, head_dim,
        num_experts, num_experts_per_tok, moe_intermediate_size: the preset's overrides;
        None keeps the preset's value.
      attention_impl: the training passes' attention.
    """

    path: str | None
    preset: str
    param_dtype: str
    dtype: str
    remat: str
    decode_attention_impl: str = "auto"
    logprob_impl: str = "auto"
    decode_head_impl: str = "auto"
    fuse_decode_projections: bool = True
    scan_unroll: bool = False
    lora_rank: int = 0
    lora_alpha: float = 16.0
    lora_targets: str | tuple[str, ...] = "all-linear"
    lora_rollout: str = "merged"
    hidden_size: int | None = None
    intermediate_size: int | None = None
    num_layers: int | None = None
    num_heads: int | None = None
    num_kv_heads: int | None = None
    head_dim: int | None = None
    num_experts: int | None = None
    num_experts_per_tok: int | None = None
    moe_intermediate_size: int | None = None
    attention_impl: str = "auto"

    def __post_init__(self):
        if self.path and os.path.isfile(os.path.expanduser(self.path)):
            raise ConfigError(f"model.path: {self.path!r} is a file; model.path is the "
                              "checkpoint's directory (the one holding config.json)")
        if self.path and not os.path.isdir(os.path.expanduser(self.path)):
            raise ConfigError(f"model.path: {self.path!r} does not exist; expected a "
                              "checkpoint directory with config.json and safetensors weights")

    def preset_overrides(self) -> dict:
        """The preset's overrides the config sets (`hidden_size`, ...)."""
        return {name: getattr(self, name) for name in PRESET_OVERRIDES
                if getattr(self, name) is not None}

    def config_fields(self) -> dict:
        """The `ModelConfig` fields the config sets besides the architecture and the
        parameters' dtype."""
        return {"dtype": self.dtype, "remat": self.remat,
                "attention_impl": self.attention_impl,
                "decode_attention_impl": self.decode_attention_impl,
                "logprob_impl": self.logprob_impl,
                "decode_head_impl": self.decode_head_impl,
                "fuse_decode_projections": self.fuse_decode_projections,
                "scan_unroll": self.scan_unroll, "lora_rank": self.lora_rank,
                "lora_alpha": self.lora_alpha, "lora_targets": self.lora_targets,
                "lora_rollout": self.lora_rollout}


# The `model.*` keys that override a preset's shape.
PRESET_OVERRIDES = ("hidden_size", "intermediate_size", "num_layers", "num_heads",
                    "num_kv_heads", "head_dim", "num_experts", "num_experts_per_tok",
                    "moe_intermediate_size")


@dataclasses.dataclass(frozen=True)
class DataSettings:
    """`data.*` as the rows are built: which rows, and how their prompts are encoded.

    Attributes:
      train_files: training rows in verl's schema (a .parquet/.jsonl path or a list of
        them); None: the synthetic `task`.
      val_files: validation rows (same formats); None: none (or the task's held-out part).
      prompt_key: the rows' prompt column.
      filter_overlong_prompts: drop rows whose prompt is over `max_prompt_length` tokens
        (else such a row is an error).
      max_prompt_length: prompt tokens (as the config gives it; `Settings` checks it).
      apply_chat_template: encode prompts through the tokenizer's chat template.
      seed: the seed of the per-epoch shuffle of the training prompts.
      val_batch_size: prompts per validation generate call.
      task: the synthetic task (`jrl.data.synthetic.TASKS`).
      digits, ops, reverse_answer, carry_slip_rate, num_val, num_train: the synthetic
        arithmetic's (`jrl.data.synthetic.arithmetic`).
      tool_rate: the synthetic tool multiplication's share of demonstrations that call
        the calculator.
    """

    train_files: str | list | None
    val_files: str | list | None
    prompt_key: str
    filter_overlong_prompts: bool
    max_prompt_length: int
    apply_chat_template: bool
    seed: int
    val_batch_size: int
    task: str
    digits: int
    ops: str
    reverse_answer: bool
    carry_slip_rate: float
    tool_rate: float
    num_val: int
    num_train: int | None

    def __post_init__(self):
        _set(self, val_batch_size=_number("data.val_batch_size", self.val_batch_size,
                                          integer=True),
             seed=_number("data.seed", self.seed, allow_zero=True, integer=True))
        if self.train_files:
            return
        _set(self, digits=_number("data.digits", self.digits, integer=True),
             num_val=_number("data.num_val", self.num_val, allow_zero=True, integer=True))
        if self.num_train is not None:
            _set(self, num_train=_number("data.num_train", self.num_train, integer=True))
        if self.val_files:
            raise ConfigError("data.val_files is set without data.train_files; give both, or "
                              "neither for the synthetic data.task")
        if self.task not in synthetic.TASKS:
            raise ConfigError(f"data.task: {self.task!r} is not valid; choose one of "
                              f"{list(synthetic.TASKS)}")


@dataclasses.dataclass(frozen=True)
class SftSettings:
    """`sft.*`: the supervised warm start before RL.

    Attributes:
      steps: AdamW steps (0: no warm start).
      batch_size: examples per step.
      lr: the learning rate, constant after the warmup.
      lr_warmup_steps: steps over which the rate rises linearly from 0 to `lr`.
      max_response_length: `rollout.response_length`, the demonstrations' token budget
        (the rollout's).
    """

    steps: int = 0
    batch_size: int = 64
    lr: float = 1e-3
    lr_warmup_steps: int = 0
    max_response_length: int = 8

    def __post_init__(self):
        _set(self, steps=_number("sft.steps", self.steps, allow_zero=True, integer=True),
             batch_size=_number("sft.batch_size", self.batch_size, integer=True),
             lr=_number("sft.lr", self.lr, allow_zero=True),
             lr_warmup_steps=_number("sft.lr_warmup_steps", self.lr_warmup_steps,
                                     allow_zero=True, integer=True))

    def check_steps(self) -> None:
        """`python -m jrl.sft` trains: it needs steps."""
        if self.steps <= 0:
            raise ConfigError(f"sft.steps must be > 0 to run SFT, got {self.steps}")


@dataclasses.dataclass(frozen=True)
class ExperimentSettings:
    """What builds an experiment (`jrl.app.experiment`: tokenizer, rows, model) and its
    warm start (`jrl.sft`).

    Attributes:
      seed: the root seed (model init; the warm start's batches).
      tokenizer: `tokenizer.*`.
      model: `model.*`.
      data: `data.*`.
      sft: `sft.*`.
      multi_turn: `rollout.multi_turn.*` with tools, whose schemas every prompt renders
        (`prompt_tools`); None: single-turn rollouts.
      rule_reward: whether the built-in rule rewards score the rows (none of
        `reward.custom_fn`, `reward.in_graph_fn` and `reward_model.enable` is set), so
        each row's `data_source` and ground truth are checked.
    """

    seed: int
    tokenizer: TokenizerSettings
    model: ModelSettings
    data: DataSettings
    sft: SftSettings = SftSettings()
    multi_turn: MultiTurnSettings | None = None
    rule_reward: bool = True

    def __post_init__(self):
        _set(self, seed=_number("seed", self.seed, allow_zero=True, integer=True))
        if self.tokenizer.name == "hf" and not (self.tokenizer.path or self.model.path):
            raise ConfigError("tokenizer.name='hf' needs tokenizer.path or model.path")

    @property
    def prompt_tools(self) -> list[dict] | None:
        """The tool schemas every prompt renders (`MultiTurnSettings.tool_schemas`); None
        without multi-turn rollouts or tools."""
        mt = self.multi_turn
        return list(mt.tool_schemas) if mt is not None and mt.tool_schemas else None


@dataclasses.dataclass(frozen=True)
class DeviceSettings:
    """`mesh.*` and `rollout.tensor_model_parallel_size`: how a run lays out its devices
    (the sampling group's size is `Settings.sampling_devices`).

    Attributes:
      mesh: the training mesh's axis sizes (`mesh.data`, `fsdp`, `context`, `tensor`; one
        may be -1: the remaining devices).
      rules: `(logical axis name, mesh axes)` pairs (`mesh.rules`).
      runs: devices the runs of one program are split over (`mesh.runs`; -1: all).
      rollout_tensor: the sampling group's tensor-parallel size.
    """

    mesh: sharding.MeshSettings
    rules: tuple[tuple[str, tuple[str, ...]], ...]
    runs: int = 1
    rollout_tensor: int = 1


@dataclasses.dataclass(frozen=True)
class DistributedSettings:
    """`distributed.*`: how a process joins a multi-process job (`jrl.app.distributed`).

    Attributes:
      initialize: "auto" (join where a coordinator is given or the environment describes
        a job), "yes" or "no".
      coordinator_address: the coordinator's host:port; None: JAX finds it (TPU pods,
        SLURM).
      num_processes: the job's processes; None: JAX finds them.
      process_id: this process' index; None: JAX finds it.
      local_device_ids: this process' devices, comma-separated ids; None: all it sees.
    """

    initialize: str = "auto"
    coordinator_address: str | None = None
    num_processes: int | None = None
    process_id: int | None = None
    local_device_ids: str | None = None

    def __post_init__(self):
        if self.initialize not in distributed.INITIALIZE_CHOICES:
            raise ConfigError(f"distributed.initialize={self.initialize!r} is not valid; "
                              f"choose one of {list(distributed.INITIALIZE_CHOICES)}")


@dataclasses.dataclass(frozen=True)
class Settings:
    """Everything static about a run, derived once from the config (`from_config`, then
    `with_data`)."""

    experiment: ExperimentSettings  # what builds the tokenizer, the rows and the model
    devices: DeviceSettings  # the meshes
    actor: ActorSettings
    critic: CriticSettings | None  # None: the estimator needs no critic
    algorithm: AlgorithmSettings
    # The rollouts' and validation's sampling; their stop and pad ids are the
    # tokenizer's from `with_data` (before it: none, and 0).
    rollout: SamplingConfig
    validation: SamplingConfig
    train_batch_size: int  # prompts per step
    max_prompt_length: int
    # RL steps: `trainer.total_training_steps`, else `trainer.total_epochs` passes over
    # the training rows (None until `with_data` counts them).
    total_steps: int | None
    logprob_chunk_size: int
    reward: RewardSettings
    filter_groups: FilterGroupsSettings | None
    log_prob_micro_batch: int | None  # sequences per log-prob/value forward; None: all
    trainer: TrainerSettings = TrainerSettings(0, 0, True, 0, None)
    # None: single-turn rollouts (`from_config` sets `experiment.multi_turn`, one object).
    multi_turn: MultiTurnSettings | None = None
    # One-step asynchronous training: devices of the sampling group (`rollout.devices`;
    # 0: none) and how many steps its weights lag the update (`rollout.staleness`).
    sampling_devices: int = 0
    staleness: int = 1
    # Response-length buckets of the log-prob, value and update passes (`jrl.rl.buckets`;
    # `actor.response_buckets`, 1: every pass runs all response columns).
    response_buckets: int = 1
    # Whether the log-prob, value and update passes run each prompt once for its
    # samples (`actor.share_prompts`; `jrl.rl.logprobs`).
    share_prompts: bool = False
    # Token-budget micro-batches of the old/reference log-prob and value passes
    # (`rollout.log_prob_max_token_len_per_gpu`, `jrl.rl.packing`); None: micro-batches of
    # `log_prob_micro_batch` padded sequences.
    log_prob_max_token_len: int | None = None
    # Partial rollouts (`rollout.partial`): the most response tokens a row draws in one
    # generation round (`rollout.partial_max_tokens`); None: off, each step's rollout
    # runs its rows to the end.
    partial_tokens: int | None = None
    # Partial rollouts: a round's cache handed to the step's next round
    # (`rollout.partial_keep_cache`).
    partial_keep_cache: bool = False

    def bucket_sizes(self, response_length: int) -> tuple[int, ...]:
        """The passes' bucket lengths for responses of `response_length` columns."""
        return buckets.sizes(response_length, self.response_buckets)

    @property
    def max_sequence_length(self) -> int:
        """The longest sequence: `data.max_prompt_length + rollout.response_length`."""
        return self.max_prompt_length + self.rollout.max_new_tokens

    def token_budgets(self) -> list[tuple[str, int, int]]:
        """`(config key, budget, sequences)` of each pass with token-budget micro-batches:
        the log-prob and value passes over the batch, each update over a mini-batch."""
        budgets = [("rollout.log_prob_max_token_len_per_gpu", self.log_prob_max_token_len,
                    self.train_batch_size * self.rollout.n)]
        for role in ("actor", "critic"):
            if getattr(self, role) is not None:
                update = getattr(self, role).update
                budgets.append((f"{role}.ppo_max_token_len_per_gpu", update.max_token_len,
                                update.mini_batch))
        return [b for b in budgets if b[1] is not None]

    def _check_token_budgets(self) -> None:
        """Every sequence must fit one packed row of a token-budget micro-batch."""
        longest = self.max_sequence_length
        for key, budget, _ in self.token_budgets():
            if _number(key, budget, integer=True) < longest:
                _fail(key, f"{budget} tokens cannot hold one sequence of up to {longest} "
                      f"(data.max_prompt_length + rollout.response_length); use at least "
                      f"{longest}")
        if self.log_prob_max_token_len is not None:
            _set(self, log_prob_max_token_len=int(self.log_prob_max_token_len))

    @property
    def needs_reference(self) -> bool:
        return self.actor.use_kl_loss or self.algorithm.use_kl_in_reward

    def __post_init__(self):
        _set(self, train_batch_size=_number("data.train_batch_size", self.train_batch_size,
                                            integer=True),
             max_prompt_length=_number("data.max_prompt_length", self.max_prompt_length,
                                       integer=True),
             logprob_chunk_size=_number("actor.logprob_chunk_size", self.logprob_chunk_size,
                                        integer=True),
             response_buckets=_number("actor.response_buckets", self.response_buckets,
                                      integer=True))
        estimator = advantages.get_estimator(self.algorithm.adv_estimator)
        self._check_batches(estimator)
        self._check_token_budgets()
        if self.reward.overlong_buffer_len > self.rollout.max_new_tokens:
            _fail("reward_model.overlong_buffer.len", f"{self.reward.overlong_buffer_len} "
                  f"exceeds rollout.response_length={self.rollout.max_new_tokens}")
        if self.filter_groups is not None:
            self._check_filter_groups()
        if self.rollout.cache_segments > 1:
            self._check_cache_segments()
        if self.partial_tokens is not None:
            self._check_partial()
        if self.rollout.kv_cache == "paged":
            self._check_paged()
        if self.reward.in_graph_fn is not None:
            self._check_in_graph()
        elif self.trainer.multi_run:
            t = self.trainer
            key = next(f"trainer.{k}={getattr(t, k)!r}" for k in ("runs", "sweep", "steps_per_call")
                       if getattr(t, k) not in (1, None))
            _fail("reward.in_graph_fn", f"is needed by {key}: runs and steps in one device "
                  "program score their responses on the device (e.g. "
                  "reward.in_graph_fn=exact_match, or a JAX function as path/to/file.py:name)")
        self._check_sampling_group(estimator)
        if self.actor.correction.enabled and not self.rollout.do_sample:
            _fail("algorithm.rollout_correction", "needs the sampler's log-probs, which a "
                  "greedy rollout (rollout.do_sample=False) does not have")
        if self.critic is not None and self.critic.on_policy and not critic_on_policy(self):
            _fail("critic.reuse_update_values", "applies only to a critic whose update is "
                  "on-policy (one mini-batch of the whole batch, one epoch) with "
                  "algorithm.adv_estimator='gae'")
        if self.actor.on_policy and not on_policy(self):
            _fail("actor.reuse_update_log_probs", "applies only to an on-policy update (one "
                  "mini-batch, one epoch) without algorithm.use_kl_in_reward or a critic "
                  "warm-up")

    def _check_batches(self, estimator) -> None:
        """Groups of `rollout.n` samples where the estimator compares them; mini- and
        micro-batches that divide the batch of `data.train_batch_size x rollout.n`."""
        n, batch = self.rollout.n, self.train_batch_size * self.rollout.n
        if estimator.needs_groups and n < max(2, estimator.min_group_size):
            _fail("rollout.n", f"algorithm.adv_estimator={self.algorithm.adv_estimator!r} "
                  f"compares the samples of a prompt and needs rollout.n >= 2, got {n}")
        for role in ("actor", "critic"):
            update = getattr(self, role) and getattr(self, role).update
            if update is not None and batch % update.mini_batch:
                _fail(f"{role}.ppo_mini_batch_size",
                      f"{update.mini_batch // n} prompts x rollout.n={n} = {update.mini_batch} "
                      f"sequences must divide the batch of {batch} sequences "
                      "(data.train_batch_size x rollout.n)")
        micro = self.log_prob_micro_batch
        if micro is not None and batch % _number("rollout.log_prob_micro_batch_size", micro):
            _fail("rollout.log_prob_micro_batch_size", f"{micro} must divide the batch of "
                  f"{batch} sequences (data.train_batch_size x rollout.n)")

    def _check_sampling_group(self, estimator) -> None:
        """`rollout.devices` and `rollout.staleness`: one-step asynchronous training."""
        devices = self.sampling_devices
        _set(self, sampling_devices=_number("rollout.devices", devices, allow_zero=True,
                                            integer=True))
        if self.staleness not in (0, 1):
            _fail("rollout.staleness", f"must be 0 or 1 (steps the sampling group's weights "
                  f"lag the update), got {self.staleness!r}")
        if self.sampling_devices and estimator.needs_baseline:
            _fail("rollout.devices", f"algorithm.adv_estimator={self.algorithm.adv_estimator!r} "
                  "decodes a greedy baseline with the current weights, which one-step "
                  "asynchronous training does not support; use rollout.devices=0")
        if not isinstance(devices, int):  # a count of devices, not a number rounded to one
            raise ConfigError(f"rollout.devices={devices!r} must be an integer >= 0 (0: no "
                              "sampling group)")

    def with_data(self, *, stop_token_ids, pad_token_id, num_train_rows: int) -> Settings:
        """These settings completed with what the tokenizer and the training rows decide:
        the rollouts' stop and pad ids, the step count of `trainer.total_epochs` (and the
        optimizers' schedules over it), and dynamic sampling's generation round checked
        against the rows."""
        groups = self.filter_groups
        if groups is not None and groups.gen_batch_size > num_train_rows:
            _fail(groups.gen_batch_key, f"{groups.gen_batch_size} prompts per generation "
                  f"round is more than the {num_train_rows} training rows")
        # With dynamic sampling a step reads at least one round of gen_batch_size prompts.
        per_step = self.train_batch_size if groups is None else groups.gen_batch_size
        steps = self.trainer.total_training_steps or (
            self.trainer.total_epochs * (num_train_rows // per_step))
        ids = {"stop_token_ids": tuple(stop_token_ids), "pad_token_id": int(pad_token_id)}
        with_steps = lambda role: role and dataclasses.replace(
            role, optim=dataclasses.replace(role.optim, total_steps=steps))
        return dataclasses.replace(
            self, total_steps=steps, actor=with_steps(self.actor), critic=with_steps(self.critic),
            rollout=_checked_sampling(dataclasses.replace(self.rollout, **ids), "rollout"),
            validation=_checked_sampling(dataclasses.replace(self.validation, **ids),
                                         "rollout.val_kwargs"))

    def _check_cache_segments(self) -> None:
        """Segments need the host between them: not in a program that holds the whole
        step, nor in the multi-turn loop (which decodes each turn in one program)."""
        segments = self.rollout.cache_segments
        if self.multi_turn is not None:
            _fail("rollout.cache_segments", f"={segments} cannot be combined with "
                  "rollout.multi_turn.enable=True (each turn decodes in one program); "
                  "set rollout.cache_segments=1")
        if self.reward.in_graph_fn is not None:
            _fail_in_graph(self.reward.in_graph_fn, "rollout.cache_segments",
                           f"={segments}, whose segments return to the host; set it to 1")

    def _check_partial(self) -> None:
        """Partial rollouts: a token budget below the response length, and a rollout of
        one program per round with the host between rounds."""
        budget, length = self.partial_tokens, self.rollout.max_new_tokens
        if not isinstance(budget, int) or isinstance(budget, bool) or not 1 <= budget < length:
            _fail("rollout.partial_max_tokens", f"must be an integer from 1 to "
                  f"rollout.response_length - 1 = {length - 1} (the most tokens a row draws "
                  f"in one generation round) with rollout.partial=True, got {budget!r}")
        others = {"rollout.multi_turn.enable=True": self.multi_turn is not None,
                  f"rollout.devices={self.sampling_devices}": bool(self.sampling_devices),
                  "algorithm.filter_groups.enable=True": self.filter_groups is not None,
                  f"rollout.cache_segments={self.rollout.cache_segments}":
                      self.rollout.cache_segments > 1}
        clash = [name for name, on in others.items() if on]
        if clash:
            _fail("rollout.partial", f"=True is not supported with {', '.join(clash)} (its "
                  "rounds continue single-turn rows in one program each, on the training "
                  "devices); set rollout.partial=False or change those keys")
        if self.reward.in_graph_fn is not None:
            _fail_in_graph(self.reward.in_graph_fn, "rollout.partial",
                           "=True, whose rounds return to the host to refill the batch")
        if self.partial_keep_cache and self.rollout.kv_cache == "paged":
            _fail("rollout.partial_keep_cache", "=True hands a contiguous cache between "
                  "rounds, which rollout.kv_cache='paged' does not keep (a continued row is "
                  "prefilled into pages); set it to False or rollout.kv_cache='contiguous'")
        if self.partial_keep_cache and self.devices.mesh.tensor > 1:
            _fail("rollout.partial_keep_cache", f"=True is not supported with "
                  f"mesh.tensor={self.devices.mesh.tensor} (the cache, split over heads, "
                  "would leave each round gathered); set it to False or mesh.tensor to 1")

    def _check_paged(self) -> None:
        """The paged cache: a pool that holds one row at full length (`paged.check_pages`),
        and for multi-turn rollouts every row decoded at once (`multi_turn.check_paged`)."""
        try:
            if self.multi_turn is not None:
                multi_turn.check_paged(self.rollout)
            paged.check_pages(self.rollout, self.max_prompt_length)
        except ValueError as err:
            raise ConfigError(str(err)) from None

    def _check_in_graph(self) -> None:
        """The features beyond `reward.*` that need host scores (see `RewardSettings`)."""
        spec, estimator = self.reward.in_graph_fn, self.algorithm.adv_estimator
        if self.multi_turn is not None:
            _fail_in_graph(spec, "rollout.multi_turn.enable", "=True, tool calls run on the host")
        if self.sampling_devices:
            _fail_in_graph(spec, "rollout.devices", f"={self.sampling_devices}, one-step "
                          "asynchronous training, which runs its rollouts on the host's thread")
        if self.filter_groups is not None:
            _fail_in_graph(spec, "algorithm.filter_groups.enable",
                          "=True, dynamic sampling that filters groups by host scores")
        if advantages.get_estimator(estimator).needs_baseline:
            _fail_in_graph(spec, "algorithm.adv_estimator", f"={estimator!r}, whose greedy "
                          "baseline rollout is scored on the host")

    def _check_filter_groups(self) -> None:
        metric = self.filter_groups.metric
        if self.rollout.n < 2:
            _fail("algorithm.filter_groups.enable", "drops groups whose samples all score the "
                  f"same, which needs rollout.n >= 2, got {self.rollout.n}")
        if advantages.get_estimator(self.algorithm.adv_estimator).needs_baseline:
            _fail("algorithm.filter_groups.enable", "cannot be combined with an estimator "
                  "that needs a greedy baseline rollout (remax)")
        if metric == "seq_final_reward" and self.algorithm.use_kl_in_reward:
            _fail("algorithm.filter_groups.metric", "'seq_final_reward' with "
                  "algorithm.use_kl_in_reward=True is not supported (the groups are filtered "
                  "before the KL penalty); use 'seq_reward'")
        if metric not in ("score", "seq_reward", "seq_final_reward") and self.reward.model_path:
            _fail("algorithm.filter_groups.metric", f"{metric!r}: a reward model gives only "
                  "'score'")


def on_policy(settings: Settings) -> bool:
    """Whether the actor's update is on-policy: one optimizer step from the state that
    sampled (one mini-batch, one epoch), so its own log-probs are the old ones; and
    nothing needs those before the update (no KL in the reward, no critic warm-up, no
    rollout correction that rejects or normalises over the whole batch, not bypass mode,
    whose old log-probs are the rollout's)."""
    update, correction = settings.actor.update, settings.actor.correction
    return (update.mini_batch == settings.train_batch_size * settings.rollout.n
            and update.ppo_epochs == 1 and not settings.algorithm.use_kl_in_reward
            and settings.trainer.critic_warmup == 0
            and not (correction.bypass_mode or correction.rejects
                     or correction.rollout_is_batch_normalize))


def critic_on_policy(settings: Settings) -> bool:
    """Whether the critic's update is on-policy: one optimizer step from the state that
    valued the batch (one mini-batch, one epoch), so the values its forward pass computes
    are the batch's, and GAE (row by row) gives each micro-batch its returns from them."""
    update = settings.critic.update
    return (settings.algorithm.adv_estimator == "gae" and update.ppo_epochs == 1
            and update.mini_batch == settings.train_batch_size * settings.rollout.n)


def _get(config, key: str):
    node = config
    for part in key.split("."):
        if part not in node:
            _fail(key, "is missing from the config")
        node = node[part]
    return node


def _optim(config, prefix: str, total_steps: int | None) -> OptimSettings:
    o = _get(config, f"{prefix}.optim")
    return OptimSettings(
        lr=_get(config, f"{prefix}.optim.lr"), weight_decay=o.weight_decay, betas=o.betas,
        warmup_steps=o.lr_warmup_steps, lr_scheduler_type=o.lr_scheduler_type,
        min_lr_ratio=o.min_lr_ratio, grad_clip=_get(config, f"{prefix}.grad_clip"),
        total_steps=total_steps, prefix=prefix)


def _update(config, prefix: str, n: int) -> UpdateSettings:
    # verl's mini-batch size is in prompts: times rollout.n sequences.
    mini = _number(f"{prefix}.ppo_mini_batch_size",
                   _get(config, f"{prefix}.ppo_mini_batch_size"), integer=True)
    dynamic = _flag(f"{prefix}.use_dynamic_bsz", _get(config, f"{prefix}.use_dynamic_bsz"))
    return UpdateSettings(
        ppo_epochs=_get(config, f"{prefix}.ppo_epochs"), mini_batch=mini * n,
        micro_batch=_get(config, f"{prefix}.ppo_micro_batch_size"),
        shuffle=_get(config, f"{prefix}.shuffle"), nan_policy=_get(config, "trainer.nan_policy"),
        prefix=prefix,
        max_token_len=_get(config, f"{prefix}.ppo_max_token_len_per_gpu") if dynamic else None)


def _log_prob_max_token_len(config) -> int | None:
    """`rollout.log_prob_max_token_len_per_gpu` when the log-prob and value passes pack
    (`rollout.log_prob_use_dynamic_bsz`, by default `actor.use_dynamic_bsz`)."""
    dynamic = _get(config, "rollout.log_prob_use_dynamic_bsz")
    if dynamic is None:
        dynamic = _get(config, "actor.use_dynamic_bsz")
    if not _flag("rollout.log_prob_use_dynamic_bsz", dynamic):
        return None
    return _get(config, "rollout.log_prob_max_token_len_per_gpu")


def _partial_tokens(config) -> int | None:
    """`rollout.partial_max_tokens` with `rollout.partial` on (None: off)."""
    if not _flag("rollout.partial", _get(config, "rollout.partial")):
        return None
    budget = _get(config, "rollout.partial_max_tokens")
    if budget is None:
        _fail("rollout.partial_max_tokens", "must be set with rollout.partial=True: the most "
              "tokens a row draws in one generation round (from 1 to "
              "rollout.response_length - 1)")
    return budget


def _partial_keep_cache(config) -> bool:
    """`rollout.partial_keep_cache`, only with `rollout.partial` on."""
    keep = _flag("rollout.partial_keep_cache", _get(config, "rollout.partial_keep_cache"))
    if keep and not _get(config, "rollout.partial"):
        _fail("rollout.partial_keep_cache", "=True needs rollout.partial=True (it hands a "
              "partial rollout round's cache to the next round)")
    return keep


def _decode_buckets(config):
    """`rollout.decode_buckets`, its default (None) resolved from the response length."""
    return defaults.decode_buckets(_get(config, "rollout.decode_buckets"),
                                          _get(config, "rollout.response_length"))


def _sampling(config, key: str) -> SamplingConfig:
    """`rollout.*` or `rollout.val_kwargs.*`: the keys of `sampler.VAL_KWARGS` under `key`
    (the stop and pad ids: `Settings.with_data`'s)."""
    overrides = {name: _get(config, f"{key}.{name}") for name in sampler.VAL_KWARGS}
    return _checked_sampling(SamplingConfig(
        n=int(overrides["n"]),
        max_new_tokens=int(_number("rollout.response_length",
                                   _get(config, "rollout.response_length"))),
        temperature=float(overrides["temperature"]),
        top_k=int(overrides["top_k"]),
        top_p=float(overrides["top_p"]),
        do_sample=bool(overrides["do_sample"]),
        ignore_stop=key == "rollout" and bool(_get(config, "rollout.ignore_eos")),
        decode_buckets=_decode_buckets(config),
        cache_segments=_get(config, "rollout.cache_segments"),
        gemm=_get(config, "rollout.gemm"),
        **{name: _get(config, f"rollout.{name}") for name in (
            "kv_cache", "page_size", "num_pages", "max_num_seqs", "refill_rows")},
        record_routing=key == "rollout" and config.actor.get("router_replay") == "rollout",
    ), key)


def _checked_sampling(sampling: SamplingConfig, key: str) -> SamplingConfig:
    """`sampling`, checked by the sampler (`key`: the config section it came from)."""
    try:
        return sampling.validate(prefix=key)
    except ValueError as err:  # the sampler's own ValueError; the CLI prints a ConfigError
        raise ConfigError(str(err)) from None  # as one line


def _reward(config) -> RewardSettings:
    model_path = None
    if _get(config, "reward_model.enable"):
        model_path = _get(config, "reward_model.model.path")
        if not model_path:
            _fail("reward_model.model.path", f"{model_path!r} is not a directory; "
                  "reward_model.enable=True needs a local HF sequence-classification checkpoint")
        model_path = os.path.expanduser(model_path)
    overlong = _get(config, "reward_model.overlong_buffer")
    on = bool(overlong.enable)
    return RewardSettings(
        custom_fn=_get(config, "reward.custom_fn"),
        in_graph_fn=_get(config, "reward.in_graph_fn"),
        num_workers=_get(config, "reward.num_workers"), on_error=_get(config, "reward.on_error"),
        error_score=_get(config, "reward.error_score"), model_path=model_path,
        model_max_length=_get(config, "reward_model.max_length"),
        model_truncation=_get(config, "reward_model.truncation"),
        model_micro_batch_size=_get(config, "reward_model.micro_batch_size"),
        overlong_buffer_len=(_number("reward_model.overlong_buffer.len", overlong.len,
                                     integer=True) if on else 0),
        overlong_penalty_factor=overlong.penalty_factor if on else 0.0)


def _filter_groups(config) -> FilterGroupsSettings | None:
    if not _get(config, "algorithm.filter_groups.enable"):
        return None
    gen_batch, key = _get(config, "data.gen_batch_size"), "data.gen_batch_size"
    if gen_batch is None:
        gen_batch, key = _get(config, "data.train_batch_size"), "data.train_batch_size"
    return FilterGroupsSettings(
        metric=_get(config, "algorithm.filter_groups.metric"), gen_batch_size=gen_batch,
        max_num_gen_batches=_get(config, "algorithm.filter_groups.max_num_gen_batches"),
        gen_batch_key=key)


def _algorithm(config) -> AlgorithmSettings:
    a = _get(config, "algorithm")
    return AlgorithmSettings(
        adv_estimator=a.adv_estimator, gamma=a.gamma, lam=a.lam,
        norm_adv_by_std_in_grpo=a.norm_adv_by_std_in_grpo, use_kl_in_reward=a.use_kl_in_reward,
        kl_penalty=a.kl_penalty, kl_ctrl_type=_get(config, "algorithm.kl_ctrl.type"),
        kl_coef=a.kl_ctrl.kl_coef, target_kl=a.kl_ctrl.target_kl, horizon=a.kl_ctrl.horizon)


def _rollout_correction(config) -> rollout_correction.RolloutCorrectionConfig:
    """`algorithm.rollout_correction.*` (checked by `ActorSettings`)."""
    key = "algorithm.rollout_correction"
    fields = dataclasses.fields(rollout_correction.RolloutCorrectionConfig)
    return rollout_correction.RolloutCorrectionConfig.from_preset(
        _get(config, f"{key}.preset"), key,
        **{f.name: _get(config, f"{key}.{f.name}") for f in fields})


def _policy_loss(config) -> losses.PolicyLossConfig:
    """`actor.*` policy-loss keys (checked by `ActorSettings`, with `PolicyLossConfig.validate`)."""
    pl = _get(config, "actor.policy_loss")
    return losses.PolicyLossConfig(
        loss_mode=_choice("actor.policy_loss.loss_mode", pl.loss_mode, losses.POLICY_LOSSES),
        loss_agg_mode=_choice("actor.loss_agg_mode", _get(config, "actor.loss_agg_mode"),
                              masks.LOSS_AGG_MODES),
        clip_ratio=float(_get(config, "actor.clip_ratio")),
        clip_ratio_low=_get(config, "actor.clip_ratio_low"),
        clip_ratio_high=_get(config, "actor.clip_ratio_high"),
        clip_ratio_c=float(_get(config, "actor.clip_ratio_c")),
        loss_scale_factor=_get(config, "actor.loss_scale_factor"),
        clip_cov_ratio=pl.clip_cov_ratio, clip_cov_lb=pl.clip_cov_lb, clip_cov_ub=pl.clip_cov_ub,
        kl_cov_ratio=pl.kl_cov_ratio, ppo_kl_coef=pl.ppo_kl_coef,
        tau_pos=pl.tau_pos, tau_neg=pl.tau_neg,
    )


def _trainer(config) -> TrainerSettings:
    t = _get(config, "trainer")
    return TrainerSettings(test_freq=t.test_freq, save_freq=t.save_freq,
                           val_before_train=t.val_before_train, critic_warmup=t.critic_warmup,
                           max_ckpt_to_keep=t.max_actor_ckpt_to_keep,
                           rollout_data_dir=t.rollout_data_dir,
                           validation_data_dir=t.validation_data_dir,
                           log_val_generations=t.get("log_val_generations", 0),
                           parallel_compile=_flag("trainer.parallel_compile",
                                                  t.get("parallel_compile"), automatic=True),
                           total_training_steps=_get(config, "trainer.total_training_steps"),
                           total_epochs=_get(config, "trainer.total_epochs"),
                           logger=_get(config, "trainer.logger"),
                           export_hf=_get(config, "trainer.export_hf"),
                           **{k: t[k] for k in ("runs", "sweep", "steps_per_call") if k in t})


def _lora(config, prefix: str) -> dict:
    """`<prefix>.lora_rank`, `lora_alpha` and `target_modules`, checked, as `lora_*` fields."""
    rank = _get(config, f"{prefix}.lora_rank")
    if not isinstance(rank, int) or isinstance(rank, bool) or rank < 0:
        _fail(f"{prefix}.lora_rank", f"must be an integer >= 0 (0: no LoRA), got {rank!r}")
    if not rank:
        return {}
    alpha = _get(config, f"{prefix}.lora_alpha")
    if not (isinstance(alpha, (int, float)) and alpha > 0):
        _fail(f"{prefix}.lora_alpha", f"must be > 0 (the adapters' scale is alpha / rank), "
              f"got {alpha!r}")
    try:
        targets = model_config.lora_targets(_get(config, f"{prefix}.target_modules"))
    except ValueError as err:
        _fail(f"{prefix}.target_modules", str(err).removeprefix("lora_targets: "))
    return {"lora_rank": rank, "lora_alpha": float(alpha), "lora_targets": targets}


def _critic_lora(config) -> dict:
    """The critic's LoRA keys; adapters on the critic apply to the actor's frozen base,
    so they need LoRA on the actor."""
    if "model" not in config.critic or "lora_rank" not in config.critic.model:
        return {}
    fields = _lora(config, "critic.model")
    if fields and not _get(config, "model.lora_rank"):
        _fail("critic.model.lora_rank", f"is {fields['lora_rank']} but model.lora_rank is 0: "
              "the critic's adapters apply to the actor's frozen base, so they need LoRA on "
              "the actor (set model.lora_rank > 0, or critic.model.lora_rank=0 for a fully "
              "trained critic)")
    return fields


# verl's router_replay modes R3 ("rollout") and R2 ("old_log_prob").
ROUTER_REPLAY_MODES = ("disabled", "rollout", "old_log_prob")


def _check_router_replay(config, settings: Settings) -> None:
    """Routing replay needs an MoE model and padded micro-batches, and "rollout" a
    rollout that records its routing in one program."""
    mode = settings.actor.router_replay
    if mode == "disabled":
        return
    key = "actor.router_replay"
    family = _model_family(config)
    if family not in model_config.MOE_FAMILIES:
        _fail(key, f"{mode!r} replays the experts of a mixture-of-experts model "
              f"({', '.join(model_config.MOE_FAMILIES)}); the model is {family!r}")
    others = {"actor.use_dynamic_bsz=True": settings.actor.update.max_token_len is not None,
              "rollout.log_prob_use_dynamic_bsz=True": settings.log_prob_max_token_len
                  is not None}
    if mode == "rollout":
        others = {"rollout.multi_turn.enable=True": settings.multi_turn is not None,
                  f"rollout.cache_segments={settings.rollout.cache_segments}":
                      settings.rollout.cache_segments > 1,
                  "rollout.partial=True": settings.partial_tokens is not None, **others}
    else:  # bypass mode takes the rollout's log-probs: no old-log-prob pass records
        others["algorithm.rollout_correction.bypass_mode=True"] = \
            settings.actor.correction.bypass_mode
    clash = [name for name, on in others.items() if on]
    if clash:
        where = ("the rollout records its routing in one program, replayed on padded "
                 "micro-batches" if mode == "rollout" else
                 "the old-log-prob pass records its routing on padded micro-batches")
        _fail(key, f"{mode!r} is not supported with {', '.join(clash)} ({where}); set "
              f"{key}='disabled' or change those keys")


def _model_family(config) -> str:
    """The model's family, from the checkpoint's config.json or the preset."""
    path = _get(config, "model.path")
    if path:
        return model_config.hf_family_and_head(
            hf.read_supported_config(os.path.expanduser(path), "model.path"))[0]
    return model_config.ModelConfig.preset(_get(config, "model.preset")).family


def _check_model(config) -> None:
    """The `model` keys the trainer reads: float32 parameters, a compute dtype, remat."""
    if _get(config, "model.param_dtype") != "float32":
        _fail("model.param_dtype", "must be float32 for training: bfloat16 parameters would round "
              "most updates away; keep float32 parameters and set model.dtype='bfloat16' for "
              "bfloat16 compute")
    _choice("model.remat", _get(config, "model.remat"), model_config.REMAT_POLICIES)
    if "lora_rank" in config.model:
        _lora(config, "model")
        _choice("model.lora_rollout", _get(config, "model.lora_rollout"),
                model_config.LORA_ROLLOUTS)
    if "attention_impl" in config.model:
        _choice("model.attention_impl", config.model.attention_impl,
                model_config.ATTENTION_IMPLS)
    if config.model.get("decode_attention_impl") == "pallas":
        _fail("model.decode_attention_impl", "'pallas' (the decode attention's Triton kernel) "
              "was replaced by its port to Pallas' Mosaic GPU backend, 'mosaic' (Hopper GPUs): "
              f"choose one of {list(model_config.DECODE_ATTENTION_IMPLS)}")
    if "decode_attention_impl" in config.model:
        _choice("model.decode_attention_impl", config.model.decode_attention_impl,
                model_config.DECODE_ATTENTION_IMPLS)
    if config.model.get("logprob_impl") == "pallas":
        _fail("model.logprob_impl", "'pallas' (the log-prob head's Triton kernel) was replaced "
              "by the same kernel on Pallas' Mosaic GPU backend: use 'mosaic', 'auto' or 'xla'")
    if "logprob_impl" in config.model:
        _choice("model.logprob_impl", config.model.logprob_impl, model_config.LOGPROB_IMPLS)
    if "decode_head_impl" in config.model:
        _choice("model.decode_head_impl", config.model.decode_head_impl,
                model_config.DECODE_HEAD_IMPLS)
        lacks = (config.model.decode_head_impl == "mosaic"
                 and sampler.head_kernel_lacks(_sampling(config, "rollout")))
        if lacks:
            _fail("model.decode_head_impl", f"'mosaic' draws with temperature alone, not with "
                  f"{' or '.join(lacks)}; use 'auto' or 'xla'")
    for key in ("decode_attention_impl", "logprob_impl", "decode_head_impl"):
        if config.model.get(key) == "mosaic":
            mosaic_backend.require(f"model.{key}")
    if _get(config, "model.dtype") == "float16":
        _fail("model.dtype", "float16 compute needs loss scaling, which jrl does not do; use "
              "'bfloat16'")
    _choice("model.dtype", _get(config, "model.dtype"), model_config.DTYPES)


def _actor(config, n: int, steps: int | None) -> ActorSettings:
    return ActorSettings(
        update=_update(config, "actor", n), loss=_policy_loss(config),
        entropy_coeff=_get(config, "actor.entropy_coeff"),
        use_kl_loss=_get(config, "actor.use_kl_loss"),
        kl_loss_coef=_get(config, "actor.kl_loss_coef"),
        kl_loss_type=_get(config, "actor.kl_loss_type"), optim=_optim(config, "actor", steps),
        router_aux_loss_coef=config.actor.get("router_aux_loss_coef"),
        router_replay=config.actor.get("router_replay", "disabled"),
        correction=_rollout_correction(config))


def _critic(config, algorithm: AlgorithmSettings, n: int,
            steps: int | None) -> CriticSettings | None:
    """The critic's settings; None where the estimator needs no values."""
    if not advantages.get_estimator(algorithm.adv_estimator).needs_values:
        return None
    return CriticSettings(
        update=_update(config, "critic", n),
        cliprange_value=_get(config, "critic.cliprange_value"),
        loss_agg_mode=_get(config, "critic.loss_agg_mode"),
        optim=_optim(config, "critic", steps), **_critic_lora(config))


def _reuse_update_passes(config, settings: Settings) -> Settings:
    """`actor.reuse_update_log_probs` and `critic.reuse_update_values` turned on where the
    update is on-policy."""
    if _flag("actor.reuse_update_log_probs", _get(config, "actor.reuse_update_log_probs")) \
            and on_policy(settings):
        settings = dataclasses.replace(
            settings, actor=dataclasses.replace(settings.actor, on_policy=True))
    reuse_values = _flag("critic.reuse_update_values", _get(config, "critic.reuse_update_values"))
    if settings.critic is not None and reuse_values and critic_on_policy(settings):
        settings = dataclasses.replace(
            settings, critic=dataclasses.replace(settings.critic, on_policy=True))
    return settings


def _check_multi_run(config, settings: Settings) -> None:
    """What runs in one device program (`jrl.rl.runs`: `trainer.runs`, `sweep` or
    `steps_per_call` over 1, or `reward.in_graph_fn`) do not do (yet); `mesh.runs` splits
    only those; the sweep's values (`check_sweep`). (`mesh.runs` is checked against the
    devices there are when the run starts.)"""
    devices, model = settings.devices, settings.experiment.model
    if not (settings.reward.in_graph_fn or settings.trainer.multi_run):
        if devices.runs != 1:
            raise ConfigError(f"mesh.runs={devices.runs}: splits runs in one program "
                              "(trainer.runs with reward.in_graph_fn) over devices; a single "
                              "run with host rewards uses mesh.data/fsdp/context/tensor, leave "
                              "it 1")
        return
    if devices.mesh.context != 1:
        raise ConfigError(f"mesh.context={devices.mesh.context}: runs in one program "
                          "(trainer.runs, reward.in_graph_fn) split over mesh.runs, not "
                          "over the sequence; use mesh.context=1, or rewards on the host")
    if model.attention_impl == "cudnn":
        raise ConfigError("model.attention_impl='cudnn': runs in one program "
                          "(trainer.runs, reward.in_graph_fn) are vmapped, and JAX's cuDNN "
                          "attention cannot be; use 'auto' (XLA there) or 'xla'")
    if model.decode_head_impl == "mosaic":
        raise ConfigError("model.decode_head_impl='mosaic': runs in one program "
                          "(trainer.runs, reward.in_graph_fn) are vmapped, and the decode "
                          "head's kernel has not run vmapped (its interpret mode cannot be, "
                          "and a sweep's temperature is traced); use 'auto' (XLA there) or "
                          "'xla'")
    # The critic's key as the config has it: the estimator may need no critic.
    critic = config.get("critic", {}).get("model", {})
    for key, rank in (("model.lora_rank", model.lora_rank),
                      ("critic.model.lora_rank", critic.get("lora_rank", 0))):
        if rank:
            raise ConfigError(f"{key}={rank}: LoRA is not supported with "
                              "reward.in_graph_fn (runs in one device program); use "
                              f"{key}=0, or rewards on the host")
    for key in ("rollout_data_dir", "validation_data_dir"):
        if getattr(settings.trainer, key):
            raise ConfigError(f"trainer.{key}={getattr(settings.trainer, key)!r}: runs in one "
                              "program (reward.in_graph_fn) do not write samples; unset it, "
                              "or use rewards on the host")
    check_sweep(settings)


# Hyperparameters a sweep (`trainer.sweep`) may give per run: the `Run` field of each.
SWEEPABLE = {"actor.optim.lr": "lr", "algorithm.kl_ctrl.kl_coef": "kl_coef",
             "actor.clip_ratio": "clip_ratio", "rollout.temperature": "temperature"}


def parse_sweep(spec: str | None) -> dict[str, list[float]]:
    """`trainer.sweep`, e.g. "actor.optim.lr=1e-4,3e-4": {key: values}."""
    out = {}
    for part in filter(None, (spec or "").split(";")):
        key, _, values = part.partition("=")
        key = key.strip()
        if key in out:
            raise ConfigError(f"trainer.sweep: {key!r} is given twice; give its values once "
                              "(key=v1,v2,...)")
        if key not in SWEEPABLE:
            raise ConfigError(f"trainer.sweep: {key!r} cannot vary per run; sweepable keys: "
                              f"{', '.join(SWEEPABLE)} (as key=v1,v2,...; several joined "
                              "by ';')")
        try:
            out[key] = [float(v) for v in values.split(",") if v.strip()]
        except ValueError:
            raise ConfigError(f"trainer.sweep: {part!r} must be key=v1,v2,... with numbers") \
                from None
        if not out[key] or any(not math.isfinite(v) or v < 0 for v in out[key]):
            raise ConfigError(f"trainer.sweep: {part!r} needs at least one finite value >= 0")
    return out


def check_sweep(settings: Settings) -> None:
    """`trainer.sweep` against the settings it varies: each key's values must apply."""
    sweep = parse_sweep(settings.trainer.sweep)
    if "algorithm.kl_ctrl.kl_coef" in sweep and not settings.algorithm.use_kl_in_reward:
        raise ConfigError("trainer.sweep: algorithm.kl_ctrl.kl_coef is the KL penalty in the "
                          "reward, which algorithm.use_kl_in_reward=False leaves out; set it "
                          "True or sweep another key")
    loss = settings.actor.loss
    if "actor.clip_ratio" in sweep:
        for key in ("clip_ratio_low", "clip_ratio_high"):
            if getattr(loss, key) is not None:
                raise ConfigError(f"trainer.sweep: actor.clip_ratio is overridden by "
                                  f"actor.{key}={getattr(loss, key)}, so its values would not "
                                  f"apply; unset actor.{key} or sweep another key")
    if any(v <= 0 for v in sweep.get("rollout.temperature", [])):
        raise ConfigError("trainer.sweep: rollout.temperature values must be > 0")


def _model(config) -> ModelSettings:
    model = _get(config, "model")
    get = model.get
    unroll = get("scan_unroll")
    if unroll is None:  # unrolled with token-budget micro-batches in the update
        unroll = any(config[role].get("use_dynamic_bsz", False) for role in ("actor", "critic"))
    overrides = PRESET_OVERRIDES
    return ModelSettings(
        path=model.path, preset=model.preset, param_dtype=model.param_dtype,
        dtype=model.dtype, remat=model.remat,
        decode_attention_impl=get("decode_attention_impl", "auto"),
        logprob_impl=get("logprob_impl", "auto"),
        decode_head_impl=get("decode_head_impl", "auto"),
        fuse_decode_projections=bool(get("fuse_decode_projections", True)),
        scan_unroll=bool(unroll), lora_rank=int(get("lora_rank", 0)),
        lora_alpha=float(get("lora_alpha", 16.0)),
        lora_targets=get("target_modules", "all-linear"),
        lora_rollout=get("lora_rollout", "merged"),
        attention_impl=get("attention_impl", "auto"), **{name: model[name] for name in overrides})


def _data(config) -> DataSettings:
    return DataSettings(**{field.name: _get(config, f"data.{field.name}")
                           for field in dataclasses.fields(DataSettings)})


def _sft(config) -> SftSettings:
    if "sft" not in config:
        return SftSettings()
    return SftSettings(steps=_get(config, "sft.steps"), batch_size=_get(config, "sft.batch_size"),
                       lr=_get(config, "sft.lr"),
                       lr_warmup_steps=_get(config, "sft.lr_warmup_steps"),
                       max_response_length=_get(config, "rollout.response_length"))


def devices_from_config(config: ml_collections.ConfigDict) -> DeviceSettings:
    """`mesh.*`: the meshes' sizes and rules, checked."""
    return _devices(config)


def _devices(config) -> DeviceSettings:
    mesh = _get(config, "mesh")
    sizes = {axis: int(mesh.get(axis, getattr(sharding.MeshSettings, axis)))
             for axis in sharding.MESH_AXES}
    return DeviceSettings(mesh=sharding.MeshSettings(**sizes),
                          rules=sharding.rules_from_config(_get(config, "mesh.rules")),
                          runs=mesh.get("runs", 1),
                          rollout_tensor=_get(config, "rollout.tensor_model_parallel_size"))


def experiment_from_config(config: ml_collections.ConfigDict) -> ExperimentSettings:
    """The sections that build the experiment (tokenizer, rows, model) and its warm start,
    read from `config` and checked, each error naming its key: all that `python -m
    jrl.sft` reads."""
    rule_reward = not (_get(config, "reward.custom_fn") or _get(config, "reward.in_graph_fn")
                       or _get(config, "reward_model.enable"))
    return ExperimentSettings(
        seed=_get(config, "seed"), model=_model(config),
        tokenizer=TokenizerSettings(name=_get(config, "tokenizer.name"),
                                    path=_get(config, "tokenizer.path")),
        multi_turn=_multi_turn(config) if "rollout" in config else None,
        data=_data(config), sft=_sft(config), rule_reward=rule_reward)


def distributed_from_config(config: ml_collections.ConfigDict) -> DistributedSettings:
    """`distributed.*`, checked: read before anything touches the devices."""
    return DistributedSettings(**{field.name: _get(config, f"distributed.{field.name}")
                                  for field in dataclasses.fields(DistributedSettings)})


def from_config(config: ml_collections.ConfigDict, *, stop_token_ids=None, pad_token_id=None,
                num_train_rows: int | None = None) -> Settings:
    """Reads the run's settings from `config`; each part checks itself (each error names
    its key) before anything is loaded or built, the experiment's sections first
    (`experiment_from_config`).

    What the tokenizer and the training rows decide is added by `Settings.with_data`;
    given them here (`stop_token_ids`, `pad_token_id`, `num_train_rows`), the settings
    come complete.
    """
    experiment = experiment_from_config(config)
    trainer = _trainer(config)
    algorithm = _algorithm(config)
    n = _number("rollout.n", _get(config, "rollout.n"), integer=True)
    steps = trainer.total_training_steps or None  # else counted by `with_data`
    actor, critic = _actor(config, n, steps), _critic(config, algorithm, n, steps)
    _check_model(config)
    settings = Settings(
        experiment=experiment, devices=_devices(config), actor=actor, critic=critic,
        algorithm=algorithm, rollout=_sampling(config, "rollout"),
        validation=_sampling(config, "rollout.val_kwargs"),
        train_batch_size=_get(config, "data.train_batch_size"),
        max_prompt_length=_get(config, "data.max_prompt_length"), total_steps=steps,
        logprob_chunk_size=_get(config, "actor.logprob_chunk_size"),
        reward=_reward(config), filter_groups=_filter_groups(config),
        log_prob_micro_batch=_get(config, "rollout.log_prob_micro_batch_size"),
        trainer=trainer, multi_turn=experiment.multi_turn,
        sampling_devices=_get(config, "rollout.devices"),
        staleness=_get(config, "rollout.staleness"),
        response_buckets=_get(config, "actor.response_buckets"),
        share_prompts=_flag("actor.share_prompts", _get(config, "actor.share_prompts")),
        log_prob_max_token_len=_log_prob_max_token_len(config),
        partial_tokens=_partial_tokens(config),
        partial_keep_cache=_partial_keep_cache(config))
    settings = _reuse_update_passes(config, settings)
    _check_multi_run(config, settings)
    _check_router_replay(config, settings)
    if stop_token_ids is None:
        return settings
    return settings.with_data(stop_token_ids=stop_token_ids, pad_token_id=pad_token_id,
                              num_train_rows=num_train_rows)
