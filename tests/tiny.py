"""A tiny experiment config shared by the trainer tests."""

from jrl.config.defaults import base_config


def tiny_config(**overrides):
    c = base_config()
    c.model.preset = "tiny"
    c.model.hidden_size = 32
    c.model.intermediate_size = 64
    c.model.num_layers = 1
    c.model.head_dim = 8
    c.data.digits = 1
    c.data.num_val = 8
    c.data.train_batch_size = 4
    c.data.val_batch_size = 8
    c.data.max_prompt_length = 4
    c.rollout.n = 2
    c.rollout.response_length = 3
    # One decode program, not four (compile time); the mesh tests turn compaction on.
    c.rollout.decode_buckets = 1
    c.actor.optim.lr = 1e-3
    c.actor.ppo_mini_batch_size = 2
    c.actor.ppo_micro_batch_size = 2
    c.critic.ppo_mini_batch_size = 2
    c.critic.ppo_micro_batch_size = 2
    c.trainer.total_training_steps = 2
    c.trainer.logger = ("jsonl",)
    c.trainer.val_before_train = False
    return apply_overrides(c, overrides)


def tiny_trainer(workdir, overrides: dict, reward_fn=None):
    """An `RLTrainer` of `tiny_config(**overrides)` in `workdir` (see `trainer_of`)."""
    return trainer_of(tiny_config(**overrides), workdir, reward_fn)


def trainer_parts(config):
    """What an `RLTrainer` of `config` is built from: `(settings, model, params,
    tokenizer, train rows, validation rows, sharder)`, on the mesh `config.mesh` makes;
    a bad key raises here, before any trainer exists."""
    from jrl.app import experiment
    from jrl.config import settings as settings_lib

    settings = settings_lib.from_config(config)
    tokenizer = experiment.build_tokenizer(settings.experiment)
    rows, val_rows = experiment.build_data(settings.experiment, tokenizer)
    settings = settings.with_data(stop_token_ids=tokenizer.eos_token_ids,
                                  pad_token_id=tokenizer.pad_token_id, num_train_rows=len(rows))
    sharder = experiment.build_sharder(settings)
    model, params = experiment.build_model(settings.experiment, tokenizer, sharder)
    return settings, model, params, tokenizer, rows, val_rows, sharder


def trainer_of(config, workdir, reward_fn=None):
    """An `RLTrainer` of `config` in `workdir`, on the mesh `config.mesh` makes (the
    config's reward unless `reward_fn` is given)."""
    from jrl.app import experiment
    from jrl.rl.trainer import RLTrainer

    settings, model, params, tokenizer, rows, val_rows, sharder = trainer_parts(config)
    scorer = reward_fn or experiment.build_reward(settings)[0]
    return RLTrainer(settings, model, params, tokenizer, rows, val_rows, scorer, str(workdir),
                     0, sharder=sharder)


def tiny_hf_checkpoint(path):
    """A random tiny model of the char tokenizer's vocabulary saved in HF format at
    `path`; returns `(model config, params)`."""
    import jax

    from jrl.data.tokenizers import CharTokenizer
    from jrl.models import hf
    from jrl.models.config import ModelConfig
    from jrl.models.transformer import init_params

    tok = CharTokenizer()
    model = ModelConfig.preset("tiny", vocab_size=tok.vocab_size, hidden_size=32,
                               intermediate_size=64, num_layers=1, head_dim=8,
                               pad_token_id=tok.pad_token_id, eos_token_ids=tok.eos_token_ids)
    params = init_params(model, jax.random.key(3))
    hf.save_pretrained(path, model, params)
    return model, params


def apply_overrides(c, overrides: dict):
    """Sets dotted keys (`"actor.optim.lr": 1e-3`) on a config; returns it."""
    for key, value in overrides.items():
        node = c
        *parents, leaf = key.split(".")
        for part in parents:
            node = node[part]
        node[leaf] = value
    return c
