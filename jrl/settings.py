"""Turns an experiment `ConfigDict` into validated, static settings.

Everything is checked here, before any model is built or anything compiles; each
error names the config key and what would be valid. The jitted steps then take
the frozen dataclasses below as static arguments, never the `ConfigDict`.
"""

from __future__ import annotations

import dataclasses
import os

import ml_collections

from jrl import advantages, kl_control, losses, masks, optim, rollout
from jrl.errors import ConfigError
from jrl.models import config as model_config
from jrl.rewards import custom, reward_model, scoring
from jrl.rollout import SamplingConfig

# The lists of valid values below are the ones this module owns; every other choice key
# is checked against the list of the module that implements it (losses.POLICY_LOSSES,
# kl_control.KL_CONTROLLERS, model_config.DTYPES, ...), never a copy.
NAN_POLICIES = ("skip", "raise")
LOGGERS = ("console", "jsonl", "tensorboard", "wandb")


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


@dataclasses.dataclass(frozen=True)
class UpdateSettings:
    """How one model is updated from a batch of `B·n` sequences."""

    ppo_epochs: int
    mini_batch: int  # sequences per optimizer step
    micro_batch: int  # sequences per forward/backward
    shuffle: bool
    nan_policy: str


@dataclasses.dataclass(frozen=True)
class ActorSettings:
    update: UpdateSettings
    loss: losses.PolicyLossConfig
    entropy_coeff: float
    use_kl_loss: bool
    kl_loss_coef: float
    kl_loss_type: str
    optim: OptimSettings


@dataclasses.dataclass(frozen=True)
class CriticSettings:
    update: UpdateSettings
    cliprange_value: float
    loss_agg_mode: str
    optim: OptimSettings


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


@dataclasses.dataclass(frozen=True)
class FilterGroupsSettings:
    """DAPO dynamic sampling (`algorithm.filter_groups.*`); None in Settings when off."""

    metric: str
    max_num_gen_batches: int  # 0: no limit
    gen_batch_size: int  # prompts per generation round


@dataclasses.dataclass(frozen=True)
class TrainerSettings:
    """The loop's schedule: validation, checkpoints, the critic's warm-up."""

    test_freq: int  # validate every this many steps (0: never; always after the last)
    save_freq: int  # checkpoint every this many steps (0: never; also after the last)
    val_before_train: bool
    critic_warmup: int  # verl's: the actor first updates at step critic_warmup (from 1)
    max_ckpt_to_keep: int | None


@dataclasses.dataclass(frozen=True)
class Settings:
    """Everything static about a run, derived once from the config."""

    actor: ActorSettings
    critic: CriticSettings | None  # None: the estimator needs no critic
    algorithm: AlgorithmSettings
    rollout: SamplingConfig
    validation: SamplingConfig
    train_batch_size: int  # prompts per step
    max_prompt_length: int
    total_steps: int
    logprob_chunk_size: int
    reward: RewardSettings
    filter_groups: FilterGroupsSettings | None
    log_prob_micro_batch: int | None  # sequences per log-prob/value forward; None: all
    trainer: TrainerSettings = TrainerSettings(0, 0, True, 0, None)

    @property
    def needs_reference(self) -> bool:
        return self.actor.use_kl_loss or self.algorithm.use_kl_in_reward


def _fail(key: str, message: str):
    raise ConfigError(f"{key}: {message}")


def _positive(config, key: str, allow_zero: bool = False):
    value = _get(config, key)
    if not isinstance(value, (int, float)) or isinstance(value, bool) or value < 0 or (
        value == 0 and not allow_zero
    ):
        kind = "non-negative" if allow_zero else "positive"
        _fail(key, f"must be a {kind} number, got {value!r}")
    return value


def _choice(config, key: str, choices) -> str:
    value = _get(config, key)
    if value not in choices:
        _fail(key, f"{value!r} is not valid; choose one of {list(choices)}")
    return value


def _get(config, key: str):
    node = config
    for part in key.split("."):
        if part not in node:
            _fail(key, "is missing from the config")
        node = node[part]
    return node


def _optim(config, prefix: str, total_steps: int) -> OptimSettings:
    lr = _positive(config, f"{prefix}.optim.lr", allow_zero=True)
    betas = tuple(_get(config, f"{prefix}.optim.betas"))
    if len(betas) != 2 or not all(0 <= b < 1 for b in betas):
        _fail(f"{prefix}.optim.betas", f"must be two numbers in [0, 1), got {betas}")
    ratio = _get(config, f"{prefix}.optim.min_lr_ratio")
    if not 0 <= ratio <= 1:
        _fail(f"{prefix}.optim.min_lr_ratio", f"must be in [0, 1], got {ratio}")
    return OptimSettings(
        lr=lr,
        weight_decay=_positive(config, f"{prefix}.optim.weight_decay", allow_zero=True),
        betas=betas,
        warmup_steps=int(_positive(config, f"{prefix}.optim.lr_warmup_steps", allow_zero=True)),
        lr_scheduler_type=_choice(config, f"{prefix}.optim.lr_scheduler_type",
                                  optim.LR_SCHEDULERS),
        min_lr_ratio=ratio,
        grad_clip=_positive(config, f"{prefix}.grad_clip", allow_zero=True),
        total_steps=total_steps,
    )


def _update(config, prefix: str, batch_sequences: int, n: int, nan_policy: str) -> UpdateSettings:
    mini_prompts = int(_positive(config, f"{prefix}.ppo_mini_batch_size"))
    mini = mini_prompts * n  # verl: mini-batch size is in prompts, times rollout.n
    if batch_sequences % mini:
        _fail(
            f"{prefix}.ppo_mini_batch_size",
            f"{mini_prompts} prompts x rollout.n={n} = {mini} sequences must divide the batch "
            f"of {batch_sequences} sequences (data.train_batch_size x rollout.n)",
        )
    micro = int(_positive(config, f"{prefix}.ppo_micro_batch_size"))
    if mini % micro:
        _fail(
            f"{prefix}.ppo_micro_batch_size",
            f"{micro} sequences must divide the mini-batch of {mini} sequences",
        )
    return UpdateSettings(
        ppo_epochs=int(_positive(config, f"{prefix}.ppo_epochs")),
        mini_batch=mini,
        micro_batch=micro,
        shuffle=bool(_get(config, f"{prefix}.shuffle")),
        nan_policy=nan_policy,
    )


def _sampling(config, key: str, stop_ids, pad_id) -> SamplingConfig:
    """`rollout.*` or `rollout.val_kwargs.*`: the keys of `rollout.VAL_KWARGS` under `key`."""
    overrides = {name: _get(config, f"{key}.{name}") for name in rollout.VAL_KWARGS}
    sampling = SamplingConfig(
        n=int(overrides["n"]),
        max_new_tokens=int(_get(config, "rollout.response_length")),
        temperature=float(overrides["temperature"]),
        top_k=int(overrides["top_k"]),
        top_p=float(overrides["top_p"]),
        do_sample=bool(overrides["do_sample"]),
        stop_token_ids=tuple(stop_ids),
        pad_token_id=int(pad_id),
        ignore_stop=key == "rollout" and bool(_get(config, "rollout.ignore_eos")),
    )
    try:
        return sampling.validate(prefix=key)
    except ValueError as err:  # the sampler's own ValueError; the CLI prints a ConfigError
        raise ConfigError(str(err)) from None  # as one line


def _reward(config, response_length: int) -> RewardSettings:
    on_error = _choice(config, "reward.on_error", scoring.ON_ERROR)
    num_workers = int(_positive(config, "reward.num_workers", allow_zero=True))
    custom_fn = _get(config, "reward.custom_fn")
    if custom_fn is not None:
        # The loader's own parser, so `~` and the spec rules are the same here and there.
        try:
            path, _ = custom.parse_spec(custom_fn)
        except ValueError as err:
            _fail("reward.custom_fn", str(err))
        if not path.is_file():
            _fail("reward.custom_fn", f"file {str(path)!r} does not exist")
    model_path = None
    if _get(config, "reward_model.enable"):
        model_path = _get(config, "reward_model.model.path")
        model_path = model_path and os.path.expanduser(model_path)
        if not model_path or not os.path.isdir(model_path):
            _fail("reward_model.model.path", f"{model_path!r} is not a directory; "
                  "reward_model.enable=True needs a local HF sequence-classification checkpoint")
    micro = _get(config, "reward_model.micro_batch_size")
    if micro is not None:
        micro = int(_positive(config, "reward_model.micro_batch_size"))
    buffer_len, factor = 0, 0.0
    if _get(config, "reward_model.overlong_buffer.enable"):
        buffer_len = int(_positive(config, "reward_model.overlong_buffer.len"))
        if buffer_len > response_length:
            _fail("reward_model.overlong_buffer.len", f"{buffer_len} exceeds "
                  f"rollout.response_length={response_length}")
        factor = float(_positive(config, "reward_model.overlong_buffer.penalty_factor",
                                 allow_zero=True))
    return RewardSettings(
        custom_fn=custom_fn, num_workers=num_workers, on_error=on_error,
        error_score=float(_get(config, "reward.error_score")), model_path=model_path,
        model_max_length=int(_positive(config, "reward_model.max_length")),
        model_truncation=_choice(config, "reward_model.truncation", reward_model.TRUNCATION),
        model_micro_batch_size=micro, overlong_buffer_len=buffer_len,
        overlong_penalty_factor=factor)


def _filter_groups(config, batch: int, n: int, estimator,
                   num_train_rows: int) -> FilterGroupsSettings | None:
    if not _get(config, "algorithm.filter_groups.enable"):
        return None
    if n < 2:
        _fail("algorithm.filter_groups.enable", f"drops groups whose samples all score the "
              f"same, which needs rollout.n >= 2, got {n}")
    if estimator.needs_baseline:
        _fail("algorithm.filter_groups.enable", "cannot be combined with an estimator that "
              "needs a greedy baseline rollout (remax)")
    gen_batch = _get(config, "data.gen_batch_size")
    gen_batch = batch if gen_batch is None else int(_positive(config, "data.gen_batch_size"))
    metric = _get(config, "algorithm.filter_groups.metric")
    if not isinstance(metric, str) or not metric:
        _fail("algorithm.filter_groups.metric", f"{metric!r} must name a reward field, e.g. "
              "'acc' or 'score'")
    if metric == "seq_final_reward" and _get(config, "algorithm.use_kl_in_reward"):
        _fail("algorithm.filter_groups.metric", "'seq_final_reward' with "
              "algorithm.use_kl_in_reward=True is not supported (the groups are filtered "
              "before the KL penalty); use 'seq_reward'")
    if gen_batch > num_train_rows:
        _fail("data.gen_batch_size" if _get(config, "data.gen_batch_size") is not None
              else "data.train_batch_size",
              f"{gen_batch} prompts per generation round is more than the {num_train_rows} "
              "training rows")
    if metric not in ("score", "seq_reward", "seq_final_reward") and _get(
            config, "reward_model.enable"):
        _fail("algorithm.filter_groups.metric", f"{metric!r}: a reward model gives only "
              "'score'")
    return FilterGroupsSettings(
        metric=metric, gen_batch_size=gen_batch,
        max_num_gen_batches=int(_positive(config, "algorithm.filter_groups.max_num_gen_batches",
                                          allow_zero=True)))


def _algorithm(config) -> AlgorithmSettings:
    estimator = _choice(config, "algorithm.adv_estimator", advantages.ESTIMATORS)
    for key in ("algorithm.gamma", "algorithm.lam"):
        if not 0 <= _get(config, key) <= 1:
            _fail(key, f"must be in [0, 1], got {_get(config, key)}")
    kl_ctrl = _choice(config, "algorithm.kl_ctrl.type", kl_control.KL_CONTROLLERS)
    if kl_ctrl == "adaptive":
        _positive(config, "algorithm.kl_ctrl.horizon")
        _positive(config, "algorithm.kl_ctrl.target_kl")
    return AlgorithmSettings(
        adv_estimator=estimator,
        gamma=float(_get(config, "algorithm.gamma")),
        lam=float(_get(config, "algorithm.lam")),
        norm_adv_by_std_in_grpo=bool(_get(config, "algorithm.norm_adv_by_std_in_grpo")),
        use_kl_in_reward=bool(_get(config, "algorithm.use_kl_in_reward")),
        kl_penalty=_choice(config, "algorithm.kl_penalty", losses.KL_PENALTIES),
        kl_ctrl_type=kl_ctrl,
        kl_coef=float(_positive(config, "algorithm.kl_ctrl.kl_coef", allow_zero=True)),
        target_kl=float(_get(config, "algorithm.kl_ctrl.target_kl")),
        horizon=float(_get(config, "algorithm.kl_ctrl.horizon")),
    )


def _policy_loss(config) -> losses.PolicyLossConfig:
    pl = _get(config, "actor.policy_loss")
    cfg = losses.PolicyLossConfig(
        loss_mode=_choice(config, "actor.policy_loss.loss_mode", losses.POLICY_LOSSES),
        loss_agg_mode=_choice(config, "actor.loss_agg_mode", masks.LOSS_AGG_MODES),
        clip_ratio=float(_get(config, "actor.clip_ratio")),
        clip_ratio_low=_get(config, "actor.clip_ratio_low"),
        clip_ratio_high=_get(config, "actor.clip_ratio_high"),
        clip_ratio_c=float(_get(config, "actor.clip_ratio_c")),
        loss_scale_factor=_get(config, "actor.loss_scale_factor"),
        clip_cov_ratio=pl.clip_cov_ratio, clip_cov_lb=pl.clip_cov_lb, clip_cov_ub=pl.clip_cov_ub,
        kl_cov_ratio=pl.kl_cov_ratio, ppo_kl_coef=pl.ppo_kl_coef,
        tau_pos=pl.tau_pos, tau_neg=pl.tau_neg,
    )
    cfg.validate("actor")
    return cfg


def total_steps(config, num_train_rows: int) -> int:
    """`trainer.total_training_steps` if set, else epochs x batches per epoch."""
    steps = _get(config, "trainer.total_training_steps")
    if steps:
        return int(_positive(config, "trainer.total_training_steps"))
    epochs = int(_positive(config, "trainer.total_epochs"))
    # With dynamic sampling a step reads at least one round of gen_batch_size prompts.
    per_step = _get(config, "data.train_batch_size")
    if _get(config, "algorithm.filter_groups.enable") and _get(config, "data.gen_batch_size"):
        per_step = _get(config, "data.gen_batch_size")
    return epochs * (num_train_rows // int(per_step))


def _trainer(config) -> TrainerSettings:
    keep = _get(config, "trainer.max_actor_ckpt_to_keep")
    if keep is not None and keep < 1:
        _fail("trainer.max_actor_ckpt_to_keep", f"must be >= 1 (or None: keep all), got {keep}")
    return TrainerSettings(
        test_freq=int(_positive(config, "trainer.test_freq", allow_zero=True)),
        save_freq=int(_positive(config, "trainer.save_freq", allow_zero=True)),
        val_before_train=bool(_get(config, "trainer.val_before_train")),
        critic_warmup=int(_positive(config, "trainer.critic_warmup", allow_zero=True)),
        max_ckpt_to_keep=keep)


def _check_model(config) -> None:
    """The `model` keys the trainer reads: float32 parameters, a compute dtype, remat."""
    if _get(config, "model.param_dtype") != "float32":
        _fail("model.param_dtype", "must be float32 for training: bfloat16 parameters would round "
              "most updates away; keep float32 parameters and set model.dtype='bfloat16' for "
              "bfloat16 compute")
    _choice(config, "model.remat", model_config.REMAT_POLICIES)
    if _get(config, "model.dtype") == "float16":
        _fail("model.dtype", "float16 compute needs loss scaling, which jrl does not do; use "
              "'bfloat16'")
    _choice(config, "model.dtype", model_config.DTYPES)
    model_path = _get(config, "model.path")
    if model_path and not os.path.isdir(os.path.expanduser(model_path)):
        _fail("model.path", f"{model_path!r} is not a directory")


def from_config(config: ml_collections.ConfigDict, *, stop_token_ids, pad_token_id,
                num_train_rows: int) -> Settings:
    """Validates `config` and derives the static settings of the run."""
    batch = int(_positive(config, "data.train_batch_size"))
    _positive(config, "data.max_prompt_length")
    _positive(config, "rollout.response_length")
    algorithm = _algorithm(config)
    estimator = advantages.get_estimator(algorithm.adv_estimator)
    n = int(_positive(config, "rollout.n"))
    if estimator.needs_groups and n < max(2, estimator.min_group_size):
        _fail("rollout.n", f"algorithm.adv_estimator={algorithm.adv_estimator!r} compares the "
              f"samples of a prompt and needs rollout.n >= 2, got {n}")
    nan_policy = _choice(config, "trainer.nan_policy", NAN_POLICIES)
    for logger in _get(config, "trainer.logger"):
        if logger not in LOGGERS:
            _fail("trainer.logger", f"{logger!r} is not valid; choose from {list(LOGGERS)}")
    steps = total_steps(config, num_train_rows)
    trainer = _trainer(config)
    actor = ActorSettings(
        update=_update(config, "actor", batch * n, n, nan_policy),
        loss=_policy_loss(config),
        entropy_coeff=float(_get(config, "actor.entropy_coeff")),
        use_kl_loss=bool(_get(config, "actor.use_kl_loss")),
        kl_loss_coef=float(_positive(config, "actor.kl_loss_coef", allow_zero=True)),
        kl_loss_type=_choice(config, "actor.kl_loss_type", losses.KL_PENALTIES),
        optim=_optim(config, "actor", steps),
    )
    critic = None
    if estimator.needs_values:
        critic = CriticSettings(
            update=_update(config, "critic", batch * n, n, nan_policy),
            cliprange_value=float(_positive(config, "critic.cliprange_value")),
            loss_agg_mode=_choice(config, "critic.loss_agg_mode", masks.LOSS_AGG_MODES),
            optim=_optim(config, "critic", steps),
        )
    _check_model(config)
    return Settings(
        actor=actor,
        critic=critic,
        algorithm=algorithm,
        rollout=_sampling(config, "rollout", stop_token_ids, pad_token_id),
        validation=_sampling(config, "rollout.val_kwargs", stop_token_ids, pad_token_id),
        train_batch_size=batch,
        max_prompt_length=int(_get(config, "data.max_prompt_length")),
        total_steps=steps,
        logprob_chunk_size=int(_positive(config, "actor.logprob_chunk_size")),
        reward=_reward(config, int(_get(config, "rollout.response_length"))),
        filter_groups=_filter_groups(config, batch, n, estimator, num_train_rows),
        log_prob_micro_batch=_log_prob_micro_batch(config, batch * n),
        trainer=trainer,
    )


def _log_prob_micro_batch(config, batch_sequences: int) -> int | None:
    key = "rollout.log_prob_micro_batch_size"
    micro = _get(config, key)
    if micro is None:
        return None
    micro = int(_positive(config, key))
    if batch_sequences % micro:
        _fail(key, f"{micro} must divide the batch of {batch_sequences} sequences "
              "(data.train_batch_size x rollout.n)")
    return micro
