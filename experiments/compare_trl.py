"""jrl's GRPO beside TRL's `GRPOTrainer`, from the same warm start, on the CPU.

The main job's task (`configs/grpo_arith.py`, read when the comparison starts): a tiny
decoder learns two-digit addition with the character tokenizer. Per seed:

1. `warm`: jrl's supervised warm start (`jrl.sft.warm_start`, exactly as `python -m
   jrl.train` runs it), exported as a Hugging Face checkpoint (`jrl.models.hf.
   save_pretrained`) with a `tokenizers` character-level tokenizer whose ids equal
   `CharTokenizer`'s. Checked: every held-out and training prompt and answer encodes
   to the same ids, and transformers' logits match jrl's forward.
2. `jrl`: jrl's GRPO (`RLTrainer.train_step`, the loop of `RLTrainer.fit`) from that
   checkpoint, loaded with `jrl.models.hf.load_pretrained`.
3. `trl`: TRL's `GRPOTrainer` from the same checkpoint, on the same prompts in the same
   order, with the same exact-match reward and the settings of the config mapped to
   TRL's arguments (`trl_args`; docs/learning.md has the table).

Both are evaluated by one evaluator: jrl's greedy decoder (`rollout.val_kwargs`) on the
config's held-out problems, every `trainer.test_freq` RL steps; TRL's weights are
copied out of its model at those steps and evaluated after training. Training
seconds exclude evaluation (and setup); they include jrl's compilation. The final
weights of every run are also scored with transformers' greedy `generate`, as a check
of the evaluator. Results: one JSON per run in experiments/results/learning/.

TRL is an optional extra (not a jrl dependency): `pip install trl==1.16.0
torch==2.13.0`. Run everything (3 seeds, then the plot) with

    python experiments/compare_trl.py all --seeds 0 1 2
    python experiments/plot_learning.py

or one stage: `python experiments/compare_trl.py {warm,jrl,trl} --seed 0`. Diagnostics
(after `warm`): `gradcheck` (jrl's actor loss and gradient vs TRL's `compute_loss` on one
mini-batch) and `profile` (forward + backward of the policy loss, jrl vs torch).
`--rl_seed N` runs RL seed N from `--seed`'s warm start; `--set key=value` overrides
a config key. docs/learning.md has the results and the exact commands.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import functools
import hashlib
import importlib.metadata
import importlib.util
import json
import os
import platform
import shutil
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

import jax  # noqa: E402
import numpy as np  # noqa: E402

from jrl import sft, sharding  # noqa: E402
from jrl.app import experiment, rundir  # noqa: E402
from jrl.config import settings  # noqa: E402
from jrl.data.dataset import BatchIterator, encode_prompts, ground_truth  # noqa: E402
from jrl.data.tokenizers import CHAR_ALPHABET, CHAR_SPECIAL_TOKENS, CharTokenizer  # noqa: E402
from jrl.models import forward_logits, hf, positions_from_mask  # noqa: E402
from jrl.models.config import ModelConfig  # noqa: E402
from jrl.rewards import default_compute_score  # noqa: E402
from jrl.rewards.responses import decode_responses, place_scores  # noqa: E402
from jrl.rl.trainer import RLTrainer  # noqa: E402
from jrl.rollout import sampler  # noqa: E402

RESULTS = os.path.join(REPO, "experiments", "results", "learning")
WORK = os.path.join(REPO, "runs", "compare_trl")
CONFIG_FILE = os.path.join(REPO, "configs", "grpo_arith.py")
PACKAGES = ("jax", "jaxlib", "flax", "optax", "torch", "transformers", "trl", "accelerate",
            "tokenizers", "datasets", "numpy")


# ----------------------------------------------------------------------------- config, files


def load_config(path: str | None = None):
    """`get_config()` of configs/grpo_arith.py, or of a snapshot of it at `path`."""
    if path is None:
        from configs import grpo_arith

        return grpo_arith.get_config()
    spec = importlib.util.spec_from_file_location("grpo_arith_snapshot", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.get_config()


def seed_config(args):
    """The config with this run's seed and `--set` overrides."""
    config = load_config(args.config_file)
    config.seed = args.seed if args.rl_seed is None else args.rl_seed
    for item in args.set:
        key, _, text = item.partition("=")
        try:
            value = ast.literal_eval(text)
        except (ValueError, SyntaxError):
            value = text
        node, *path = [config, *key.split(".")]
        for name in path[:-1]:
            node = node[name]
        node[path[-1]] = value
    return config


def seed_dir(args) -> str:
    return os.path.join(args.work, f"seed{args.seed}")


def hf_dir(args) -> str:
    return os.path.join(seed_dir(args), "hf_warm_start")


def run_name(args, framework: str) -> str:
    """`jrl_seed0`, or `jrl_seed0_rl5` for RL seed 5 from seed 0's warm start."""
    suffix = "" if args.rl_seed is None else f"_rl{args.rl_seed}"
    return f"{framework}_seed{args.seed}{suffix}"


def versions() -> dict[str, str]:
    found = {}
    for name in PACKAGES:
        try:
            found[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            found[name] = "not installed"
    found["python"] = platform.python_version()
    return found


def provenance(args, config) -> dict:
    """What a result was made with: the config file's text and hash, its values, the host."""
    path = args.config_file or CONFIG_FILE
    text = open(path).read()
    return {
        "config_file": os.path.relpath(path, REPO),
        "config_sha256": hashlib.sha256(text.encode()).hexdigest(),
        "config_text": text,
        "overrides": list(args.set),
        "config": json.loads(config.to_json_best_effort()),
        "versions": versions(),
        "host": {"platform": platform.platform(), "cpus": os.cpu_count(),
                 "jax_devices": [str(d) for d in jax.devices()]},
    }


def write_json(path: str, data: dict) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        json.dump(data, f, indent=1, default=str)
    print(f"wrote {os.path.relpath(path, REPO)}", flush=True)


def machine_busy_seconds() -> float:
    """CPU seconds all processes of the machine have used (all cores), from /proc/stat."""
    with open("/proc/stat") as f:
        fields = [int(x) for x in f.readline().split()[1:]]
    user, nice, system, _idle, _iowait, irq, softirq, steal = fields[:8]
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


class TrainClock:
    """Training time, paused while evaluating: wall seconds, this process's CPU seconds
    (all its threads) and the CPU seconds other processes used meanwhile, which say
    whether the wall-clock figures were taken on a shared, busy machine."""

    def __init__(self):
        self.wall = self.cpu = self.others = 0.0
        self._marks = None

    def start(self) -> None:
        self._marks = (time.perf_counter(), time.process_time(), machine_busy_seconds())

    def stop(self) -> float:
        """Stops the clock; returns the wall seconds since `start`."""
        wall, cpu, busy = self._marks
        wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
        self.wall, self.cpu = self.wall + wall, self.cpu + cpu
        self.others += max(machine_busy_seconds() - busy - cpu, 0.0)
        return wall

    def record(self) -> dict[str, float]:
        return {"train_seconds": self.wall, "cpu_seconds": self.cpu,
                "other_processes_cores": self.others / max(self.wall, 1e-9)}


def wait_for_quiet(max_cores: float, timeout: float, window: float = 5.0) -> float:
    """Waits until other processes use under `max_cores` cores over a `window`; returns
    the last measurement (the wait gives up after `timeout` seconds)."""
    deadline = time.monotonic() + timeout
    while True:
        busy, own = machine_busy_seconds(), time.process_time()
        time.sleep(window)
        cores = (machine_busy_seconds() - busy - (time.process_time() - own)) / window
        if cores < max_cores or time.monotonic() > deadline:
            return cores
        print(f"waiting: other processes use {cores:.2f} cores", flush=True)


# ----------------------------------------------------------------------------- tokenizer export


def save_char_tokenizer(path: str) -> None:
    """A `tokenizers` tokenizer whose ids are CharTokenizer's: a BPE model with one token
    per character and no merges, `<pad>`, `<bos>`, `<eos>` as special tokens 0, 1, 2,
    no added BOS, and a decoder that joins characters without spaces."""
    from tokenizers import AddedToken, Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    chars = CharTokenizer()
    vocab = {token: i for i, token in enumerate(CHAR_SPECIAL_TOKENS + tuple(CHAR_ALPHABET))}
    assert [vocab["<pad>"], vocab["<bos>"], vocab["<eos>"]] == [
        chars.pad_token_id, chars.bos_token_id, chars.eos_token_id]
    core = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token=None))
    core.add_special_tokens([AddedToken(t, special=True, normalized=False)
                             for t in CHAR_SPECIAL_TOKENS])
    core.decoder = decoders.Fuse()
    fast = PreTrainedTokenizerFast(tokenizer_object=core, pad_token="<pad>", bos_token="<bos>",
                                   eos_token="<eos>", padding_side="left",
                                   clean_up_tokenization_spaces=False)
    fast.save_pretrained(path)


def load_hf_tokenizer(path: str):
    """The exported tokenizer as transformers' generic fast tokenizer.

    Not `AutoTokenizer`: for a `qwen2` config.json, transformers 5 substitutes its
    Qwen2Tokenizer, which replaces the pre-tokenizer with a byte-level one (spaces and
    newlines then map to other ids) and adds an `<|endoftext|>` token.
    """
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast.from_pretrained(path)


def check_tokenizer(path: str, texts: list[str]) -> dict:
    """Every text encodes to CharTokenizer's ids (with transformers' default special-token
    handling, as TRL calls it) and decodes back; jrl's HFTokenizer agrees too."""
    from jrl.data.tokenizers import HFTokenizer

    chars, fast, ours = CharTokenizer(), load_hf_tokenizer(path), HFTokenizer.from_pretrained(path)
    texts = [*texts, " \n" + CHAR_ALPHABET]
    for text in texts:
        expected = chars.encode(text)
        got = fast(text)["input_ids"]
        if got != expected or ours.encode(text) != expected:
            raise AssertionError(f"{text!r}: transformers {got}, jrl-hf {ours.encode(text)}, "
                                 f"CharTokenizer {expected}")
        decoded = fast.decode(expected + [chars.eos_token_id], skip_special_tokens=True)
        if decoded != text:
            raise AssertionError(f"{text!r} decodes to {decoded!r}")
    assert (fast.pad_token_id, fast.eos_token_id) == (chars.pad_token_id, chars.eos_token_id)
    assert len(fast) == chars.vocab_size
    return {"texts_checked": len(texts), "vocab_size": len(fast),
            "pad_eos_bos": [fast.pad_token_id, fast.eos_token_id, fast.bos_token_id]}


def check_logits(path: str, model: ModelConfig, params, prompts: list[str]) -> dict:
    """transformers' float32 logits on `prompts` (equal lengths, no padding) vs jrl's."""
    import torch
    from transformers import AutoModelForCausalLM

    chars = CharTokenizer()
    ids = np.asarray([chars.encode(p) for p in prompts], np.int32)
    mask = np.ones_like(ids)
    ours, _ = forward_logits(params, ids, positions_from_mask(mask), mask, config=model)
    theirs = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        theirs = theirs(torch.as_tensor(ids, dtype=torch.long)).logits.numpy()
    diff = float(np.max(np.abs(np.asarray(ours) - theirs)))
    if diff > 1e-4:
        raise AssertionError(f"transformers and jrl logits differ by {diff}")
    return {"max_abs_logit_diff": diff, "prompts": prompts}


# ----------------------------------------------------------------------------- evaluation


class Evaluator:
    """Greedy exact-match accuracy on the held-out rows, by jrl's sampler and scorer.

    The same object scores jrl's parameters and TRL's (converted by
    `params_from_torch`), so the two frameworks are measured by one ruler.
    """

    def __init__(self, s: settings.Settings, model: ModelConfig, tokenizer, rows, chat: bool):
        if s.validation.do_sample or s.validation.n != 1:
            raise ValueError("the comparison reports greedy accuracy: rollout.val_kwargs must "
                             "have do_sample=False and n=1")
        self.rows, self.tokenizer, self.sampling = rows, tokenizer, s.validation
        self.prompt_ids, self.prompt_mask = encode_prompts(tokenizer, rows, s.max_prompt_length,
                                                           chat)
        sampler.check_inputs(self.prompt_ids, self.prompt_mask, s.validation, model)
        self._generate = jax.jit(
            functools.partial(sampler.generate_program, sampling=s.validation, config=model),
            compiler_options=sampler.compiler_options(s.validation))

    def texts(self, params) -> list[str]:
        out = self._generate(params, self.prompt_ids, self.prompt_mask, jax.random.key(0))
        return decode_responses(self.tokenizer, np.asarray(out.responses),
                                np.asarray(out.response_mask))

    def __call__(self, params) -> float:
        scores = [default_compute_score(row["data_source"], text, ground_truth(row),
                                        row.get("extra_info"))["acc"]
                  for row, text in zip(self.rows, self.texts(params), strict=True)]
        return float(np.mean(scores))


def params_from_torch(model: ModelConfig, state_dict: dict[str, np.ndarray]) -> dict:
    """jrl parameters from a transformers state dict (numpy), by jrl's own tensor map."""
    params: dict = {}
    for spec in hf.tensor_specs(model):
        if spec.per_layer:
            leaf = np.stack([spec.to_jrl(state_dict[spec.hf_name.format(i=i)])
                             for i in range(model.num_layers)])
        else:
            leaf = spec.to_jrl(state_dict[spec.hf_name])
        node = params
        for key in spec.path[:-1]:
            node = node.setdefault(key, {})
        node[spec.path[-1]] = jax.numpy.asarray(leaf)
    return params


def hf_generate_accuracy(torch_model, rows, response_length: int) -> float:
    """Greedy accuracy by transformers' `generate` (the cross-check of `Evaluator`)."""
    import torch

    chars = CharTokenizer()
    ids = [chars.encode(row["prompt"]) for row in rows]
    width = max(map(len, ids))
    input_ids = torch.tensor([[chars.pad_token_id] * (width - len(x)) + x for x in ids])
    mask = torch.tensor([[0] * (width - len(x)) + [1] * len(x) for x in ids])
    torch_model.eval()
    with torch.no_grad():
        out = torch_model.generate(input_ids=input_ids, attention_mask=mask, do_sample=False,
                                   max_new_tokens=response_length,
                                   eos_token_id=chars.eos_token_id,
                                   pad_token_id=chars.pad_token_id)
    scores = []
    for row, seq in zip(rows, out[:, width:].tolist(), strict=True):
        stop = seq.index(chars.eos_token_id) + 1 if chars.eos_token_id in seq else len(seq)
        text = chars.decode(seq[:stop])
        scores.append(default_compute_score(row["data_source"], text, ground_truth(row))["acc"])
    return float(np.mean(scores))


# ----------------------------------------------------------------------------- shared setup


@dataclasses.dataclass
class Setup:
    config: object
    s: settings.Settings
    model: ModelConfig
    params: dict
    tokenizer: CharTokenizer
    train_rows: list
    val_rows: list
    evaluator: Evaluator
    steps: int
    eval_every: int


def setup(args) -> Setup:
    """The config, the exported warm start and the evaluator of one seed."""
    config = seed_config(args)
    if config.tokenizer.name != "char" or config.model.path:
        raise ValueError("the comparison exports the char-tokenizer warm start of the config")
    tokenizer = CharTokenizer()
    s = settings.from_config(config)
    train_rows, val_rows = experiment.build_data(s.experiment, tokenizer)
    s = s.with_data(stop_token_ids=tokenizer.eos_token_ids, pad_token_id=tokenizer.pad_token_id,
                    num_train_rows=len(train_rows))
    model, params = hf.load_pretrained(hf_dir(args), dtype=config.model.param_dtype,
                                       config_overrides={"dtype": config.model.dtype})
    evaluator = Evaluator(s, model, tokenizer, val_rows, config.data.apply_chat_template)
    steps = args.steps or s.total_steps
    eval_every = args.eval_every or config.trainer.test_freq or steps
    return Setup(config, s, model, params, tokenizer, train_rows, val_rows, evaluator, steps,
                 eval_every)


def training_prompts(st: Setup) -> list:
    """The rows jrl's trainer reads, in its order: `steps` batches of its BatchIterator."""
    iterator = BatchIterator(st.train_rows, st.s.train_batch_size, st.config.data.seed,
                             shuffle=True)
    return [row for _ in range(st.steps) for row in iterator.next_batch()]


def is_eval_step(step: int, st: Setup) -> bool:
    return step % st.eval_every == 0 or step == st.steps


# ----------------------------------------------------------------------------- stage: warm


def run_warm(args) -> None:
    """jrl's warm start of this seed, exported as an HF checkpoint and checked."""
    config = seed_config(args)
    config.seed = args.seed
    # warm_start would restore an earlier checkpoint, perhaps of another config.
    shutil.rmtree(seed_dir(args), ignore_errors=True)
    run_settings = settings.from_config(config)
    tokenizer = experiment.build_tokenizer(run_settings.experiment)
    train_rows, val_rows = experiment.build_data(run_settings.experiment, tokenizer)
    sharder = experiment.build_sharder(run_settings)
    model, params = experiment.build_model(run_settings.experiment, tokenizer, sharder)
    start = time.perf_counter()
    params = sft.warm_start(run_settings.experiment, seed_dir(args), model, params, tokenizer,
                            train_rows, sharder, config_keys=rundir.warm_start_settings(config))
    seconds = time.perf_counter() - start
    params = jax.tree.map(sharding.host_array, params)
    hf.save_pretrained(hf_dir(args), model, params)
    save_char_tokenizer(hf_dir(args))
    texts = [r["prompt"] for r in val_rows + train_rows]
    texts += [str(ground_truth(r)) for r in val_rows + train_rows]
    checks = {"tokenizer": check_tokenizer(hf_dir(args), texts),
              "logits": check_logits(hf_dir(args), model, params,
                                     [r["prompt"] for r in val_rows[:8]])}
    print(json.dumps(checks), flush=True)
    write_json(os.path.join(seed_dir(args), "warm.json"),
               {"seed": args.seed, "sft_seconds": seconds, "checks": checks,
                **provenance(args, config)})


# ----------------------------------------------------------------------------- stage: jrl


def run_jrl(args) -> None:
    """jrl's GRPO from the exported warm start: `RLTrainer.fit`'s loop, with the clock
    stopped while the evaluator runs."""
    st = setup(args)
    config = st.config
    workdir = os.path.join(seed_dir(args), run_name(args, "jrl"))
    shutil.rmtree(workdir, ignore_errors=True)
    scorer, _ = experiment.build_reward(st.s)
    trainer = RLTrainer(st.s, st.model, st.params, st.tokenizer, st.train_rows, st.val_rows,
                        scorer, workdir, config.seed,
                        apply_chat_template=config.data.apply_chat_template,
                        data_seed=config.data.seed, sharder=experiment.build_sharder(st.s))
    iterator = BatchIterator(st.train_rows, st.s.train_batch_size, config.data.seed,
                             shuffle=True, state=trainer.data)
    clock, step_seconds, per_step = TrainClock(), [], []
    evals = [{"step": 0, **clock.record(), "acc": st.evaluator(trainer.state.actor.params)}]
    print(f"jrl seed {args.seed}: step 0 acc {evals[0]['acc']:.3f}", flush=True)
    try:
        for step in range(1, st.steps + 1):
            clock.start()
            metrics = trainer.train_step(iterator)
            step_seconds.append(clock.stop())
            per_step.append({k: v for k, v in metrics.items()
                             if k.startswith(("critic/score", "response_length/mean", "actor/",
                                              "timing_s/"))})
            if is_eval_step(step, st):
                evals.append({"step": step, **clock.record(),
                              "acc": st.evaluator(trainer.state.actor.params)})
                print(f"jrl seed {args.seed}: step {step} acc {evals[-1]['acc']:.3f} "
                      f"train {clock.wall:.1f}s (others {evals[-1]['other_processes_cores']:.2f} "
                      "cores)", flush=True)
        params = jax.tree.map(sharding.host_array, trainer.state.actor.params)
    finally:
        trainer.close()
    export = os.path.join(workdir, "hf_final")
    hf.save_pretrained(export, st.model, params)
    from transformers import AutoModelForCausalLM

    final_hf = hf_generate_accuracy(AutoModelForCausalLM.from_pretrained(export), st.val_rows,
                                    config.rollout.response_length)
    write_json(os.path.join(args.results, f"{run_name(args, 'jrl')}.json"), {
        "framework": "jrl", "seed": args.seed, "rl_seed": st.config.seed, "steps": st.steps,
        "eval_every": st.eval_every,
        "evals": evals, "step_seconds": step_seconds, "step_metrics": per_step,
        "final_acc_hf_generate": final_hf, **provenance(args, config)})


# ----------------------------------------------------------------------------- stage: trl


def trl_args(st: Setup, seed: int, output_dir: str) -> dict:
    """GRPOConfig arguments matching the jrl config (raises where TRL has no equivalent).

    One jrl RL step = one TRL generation batch of `train_batch_size` prompts x n; each of
    its `train_batch_size / ppo_mini_batch_size` mini-batches is one TRL optimizer step
    (`per_device_train_batch_size` = mini-batch sequences, no accumulation,
    `steps_per_generation` = mini-batches), so TRL's `max_steps` counts optimizer steps.
    """
    c, s = st.config, st.s
    actor = s.actor
    if actor.use_kl_loss or s.algorithm.use_kl_in_reward or actor.entropy_coeff:
        raise ValueError("the comparison runs GRPO with beta = 0 and no entropy bonus")
    if s.algorithm.adv_estimator != "grpo" or actor.loss.loss_mode != "vanilla":
        raise ValueError("the comparison maps adv_estimator='grpo' with the vanilla PPO loss")
    loss_types = {"token-mean": "bnpo", "seq-mean-token-mean": "grpo",
                  "seq-mean-token-sum-norm": "dr_grpo"}
    if actor.loss.loss_agg_mode not in loss_types:
        raise ValueError(f"actor.loss_agg_mode={actor.loss.loss_agg_mode!r} has no TRL loss_type")
    updates = s.train_batch_size * s.rollout.n // actor.update.mini_batch
    optim = actor.optim
    schedule = {"constant": "constant_with_warmup" if optim.warmup_steps else "constant",
                "cosine": "cosine_with_min_lr"}[optim.lr_scheduler_type]
    return dict(
        output_dir=output_dir, seed=seed, max_steps=st.steps * updates,
        per_device_train_batch_size=actor.update.mini_batch, gradient_accumulation_steps=1,
        steps_per_generation=updates, num_iterations=actor.update.ppo_epochs,
        num_generations=s.rollout.n, max_completion_length=s.rollout.max_new_tokens,
        temperature=s.rollout.temperature, top_p=s.rollout.top_p,
        top_k=max(s.rollout.top_k, 0), shuffle_dataset=False,
        beta=0.0, epsilon=actor.loss.low, epsilon_high=actor.loss.high,
        # INTELLECT-2's cap on the ratio: for negative advantages it is verl's dual clip
        # (the loss stops growing at ratio c); for positive ones the clip already binds.
        delta=actor.loss.clip_ratio_c,
        loss_type=loss_types[actor.loss.loss_agg_mode],
        scale_rewards="group" if s.algorithm.norm_adv_by_std_in_grpo else "none",
        mask_truncated_completions=False,
        learning_rate=optim.lr, lr_scheduler_type=schedule,
        lr_scheduler_kwargs=({"min_lr_rate": optim.min_lr_ratio}
                             if optim.lr_scheduler_type == "cosine" else None),
        warmup_steps=optim.warmup_steps * updates, weight_decay=optim.weight_decay,
        adam_beta1=optim.betas[0], adam_beta2=optim.betas[1], adam_epsilon=1e-8,
        optim="adamw_torch", max_grad_norm=optim.grad_clip,
        gradient_checkpointing=c.model.remat != "none", bf16=False, fp16=False, use_cpu=True,
        model_init_kwargs={"dtype": c.model.param_dtype},
        report_to="none", logging_steps=1, save_strategy="no", disable_tqdm=True,
        dataloader_num_workers=0,
    )


def make_trl_callback(st: Setup, updates: int):
    """A TrainerCallback that keeps the training clock (paused while weights are copied
    for evaluation), copies the weights at evaluation steps and keeps TRL's logs."""
    from transformers import TrainerCallback

    class Clock(TrainerCallback):
        def __init__(self):
            self.clock, self.step_seconds, self.snapshots, self.logs = TrainClock(), [], [], []

        def on_train_begin(self, args, state, control, model=None, **kwargs):
            self.snapshots.append((0, self.clock.record(), _numpy_state(model)))
            self.clock.start()

        def on_step_end(self, args, state, control, model=None, **kwargs):
            self.step_seconds.append(self.clock.stop())
            step = state.global_step // updates
            if state.global_step % updates == 0 and is_eval_step(step, st):
                self.snapshots.append((step, self.clock.record(), _numpy_state(model)))
            # TRL logs after on_step_end: that time counts as training (the next step's).
            self.clock.start()

        def on_log(self, args, state, control, logs=None, **kwargs):
            self.logs.append(dict(logs or {}))

    return Clock()


def _numpy_state(model) -> dict[str, np.ndarray]:
    return {k: v.detach().cpu().numpy().copy() for k, v in model.state_dict().items()}


def make_trl_trainer_class():
    """GRPOTrainer with wall-clock timers around generation and scoring (per call)."""
    from trl import GRPOTrainer

    class TimedGRPOTrainer(GRPOTrainer):
        phase_seconds: dict[str, list[float]]

        def _timed(self, name, fn, *args, **kwargs):
            start = time.perf_counter()
            out = fn(*args, **kwargs)
            self.phase_seconds.setdefault(name, []).append(time.perf_counter() - start)
            return out

        def _generate_single_turn(self, *args, **kwargs):
            return self._timed("generate", super()._generate_single_turn, *args, **kwargs)

        def _generate_and_score_completions(self, *args, **kwargs):
            return self._timed("generate_score_logprobs",
                               super()._generate_and_score_completions, *args, **kwargs)

    return TimedGRPOTrainer


def exact_match(completions, ground_truth, data_source, **kwargs) -> list[float]:
    """jrl's reward of the row's data_source (exact match of the stripped completion)."""
    del kwargs
    return [float(default_compute_score(source, text, truth)["score"])
            for text, truth, source in zip(completions, ground_truth, data_source, strict=True)]


def run_trl(args) -> None:
    """TRL's GRPOTrainer from the exported warm start, on jrl's prompt order."""
    import datasets
    import torch
    from trl import GRPOConfig

    st = setup(args)
    rows = training_prompts(st)
    dataset = datasets.Dataset.from_dict({
        "prompt": [r["prompt"] for r in rows],
        "ground_truth": [str(ground_truth(r)) for r in rows],
        "data_source": [r["data_source"] for r in rows]})
    output_dir = os.path.join(seed_dir(args), run_name(args, "trl"))
    shutil.rmtree(output_dir, ignore_errors=True)
    kwargs = trl_args(st, st.config.seed, output_dir)
    updates = kwargs["steps_per_generation"]
    clock = make_trl_callback(st, updates)
    trainer = make_trl_trainer_class()(
        model=hf_dir(args), reward_funcs=exact_match, args=GRPOConfig(**kwargs),
        train_dataset=dataset, processing_class=load_hf_tokenizer(hf_dir(args)),
        callbacks=[clock])
    trainer.phase_seconds = {}
    print(f"trl seed {args.seed}: torch threads {torch.get_num_threads()}, "
          f"{kwargs['max_steps']} optimizer steps", flush=True)
    trainer.train()
    final_hf = hf_generate_accuracy(trainer.model, st.val_rows, st.config.rollout.response_length)
    evals = []
    for step, times, state in clock.snapshots:
        evals.append({"step": step, **times,
                      "acc": st.evaluator(params_from_torch(st.model, state))})
        print(f"trl seed {args.seed}: step {step} acc {evals[-1]['acc']:.3f} "
              f"train {times['train_seconds']:.1f}s (others "
              f"{times['other_processes_cores']:.2f} cores)", flush=True)
    start = params_from_torch(st.model, clock.snapshots[0][2])
    same_start = all(jax.tree.leaves(jax.tree.map(lambda a, b: bool(np.array_equal(a, b)),
                                                  start, st.params)))
    write_json(os.path.join(args.results, f"{run_name(args, 'trl')}.json"), {
        "framework": "trl", "seed": args.seed, "rl_seed": st.config.seed, "steps": st.steps,
        "eval_every": st.eval_every,
        "evals": evals, "optimizer_step_seconds": clock.step_seconds,
        "step_seconds": [sum(clock.step_seconds[i:i + updates])
                         for i in range(0, len(clock.step_seconds), updates)],
        "phase_seconds": trainer.phase_seconds, "logs": clock.logs,
        "final_acc_hf_generate": final_hf, "start_weights_equal_jrl": same_start,
        "trl_args": {k: v for k, v in kwargs.items() if k != "output_dir"},
        "trl_resolved": {"generation_batch_size": trainer.args.generation_batch_size,
                         "steps_per_generation": trainer.args.steps_per_generation,
                         "torch_threads": torch.get_num_threads()},
        **provenance(args, st.config)})


# ----------------------------------------------------------------------------- stage: profile


def _median_seconds(fn, repeats: int) -> float:
    fn(), fn()  # compile / warm up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return float(np.median(times))


def _profile_layout(st: Setup, torch_model, rows, prompt_len: int, repeats: int) -> dict:
    """Seconds of one forward + backward, jrl vs torch, with prompts padded to prompt_len."""
    import torch

    from jrl.algos import masks
    from jrl.rl.logprobs import response_log_probs

    ids, mask = encode_prompts(st.tokenizer, rows, prompt_len, False)
    out = sampler.generate(st.params, ids, mask, jax.random.key(0), st.s.rollout, config=st.model)
    batch = tuple(np.asarray(x) for x in (out.prompt_ids, out.prompt_mask, out.responses,
                                          out.response_mask))
    adv = np.random.default_rng(0).standard_normal((len(batch[0]), 1)).astype(np.float32)

    def jrl_loss(params, model=st.model):
        log_probs, _ = response_log_probs(params, *batch, config=model)
        return -masks.masked_mean(log_probs * adv, batch[3])

    grad_fn = jax.jit(jax.value_and_grad(jrl_loss))
    unrolled = jax.jit(jax.value_and_grad(functools.partial(
        jrl_loss, model=dataclasses.replace(st.model, scan_unroll=True))))
    forward = jax.jit(jrl_loss)
    tokens = torch.as_tensor(np.concatenate([batch[0], batch[2]], 1), dtype=torch.long)
    attention = torch.as_tensor(np.concatenate([batch[1], batch[3]], 1), dtype=torch.long)
    targets, weights = tokens[:, prompt_len:], torch.as_tensor(batch[3] * adv)

    def torch_loss():
        logits = torch_model(input_ids=tokens, attention_mask=attention).logits
        logp = torch.log_softmax(logits[:, prompt_len - 1:-1], -1)
        logp = logp.gather(-1, targets[..., None])[..., 0]
        return -(logp * weights).sum() / weights.ne(0).sum()

    def torch_step():
        torch_model.zero_grad(set_to_none=True)
        torch_loss().backward()

    def torch_forward():
        with torch.no_grad():
            torch_loss()

    run = lambda fn: _median_seconds(lambda: jax.block_until_ready(fn(st.params)), repeats)
    return {"sequences": len(tokens), "prompt_len": prompt_len, "length": int(tokens.shape[1]),
            "jrl_seconds": run(grad_fn), "jrl_scan_unrolled_seconds": run(unrolled),
            "jrl_forward_seconds": run(forward),
            "torch_seconds": _median_seconds(torch_step, repeats),
            "torch_forward_seconds": _median_seconds(torch_forward, repeats)}


def run_profile(args) -> None:
    """Forward + backward of a policy-gradient loss on one mini-batch (the bulk of the
    actor update), jrl's jitted `value_and_grad` (layers scanned, as in training, and
    unrolled) vs torch autograd on the HF model, and each forward alone; same weights
    and tokens, with prompts padded to data.max_prompt_length (jrl's layout) and
    unpadded (TRL's layout when all prompts have one length)."""
    import torch
    from transformers import AutoModelForCausalLM

    st = setup(args)
    rows = st.train_rows[: st.s.actor.update.mini_batch // st.s.rollout.n]
    natural = max(len(st.tokenizer.encode(r["prompt"])) for r in rows)
    torch_model = AutoModelForCausalLM.from_pretrained(hf_dir(args), dtype=torch.float32).train()
    results = []
    for prompt_len in sorted({st.s.max_prompt_length, natural}, reverse=True):
        results.append(_profile_layout(st, torch_model, rows, prompt_len, args.repeats))
        print(json.dumps(results[-1]), flush=True)
    write_json(os.path.join(args.results, f"profile_seed{args.seed}.json"),
               {"what": run_profile.__doc__, "results": results,
                "torch_threads": torch.get_num_threads(), **provenance(args, st.config)})


# ----------------------------------------------------------------------------- stage: gradcheck


def _gradcheck_batch(st: Setup, noise: float) -> dict[str, np.ndarray]:
    """One mini-batch as the update sees it: jrl's samples of the first training prompts
    (unpadded: they share one length), GRPO advantages over the whole step's groups, and
    old log-probs = current ones + Gaussian `noise` (so that some ratios are clipped)."""
    from jrl.algos import advantages
    from jrl.rl.logprobs import response_log_probs


    s = st.s
    rows = st.train_rows[: s.train_batch_size]
    width = max(len(st.tokenizer.encode(r["prompt"])) for r in rows)
    ids, mask = encode_prompts(st.tokenizer, rows, width, False)
    out = sampler.generate(st.params, ids, mask, jax.random.key(1), s.rollout, config=st.model)
    batch = {k: np.asarray(getattr(out, k))
             for k in ("prompt_ids", "prompt_mask", "responses", "response_mask")}
    texts = decode_responses(st.tokenizer, batch["responses"], batch["response_mask"])
    scores = np.asarray([default_compute_score(rows[i // s.rollout.n]["data_source"], text,
                                               ground_truth(rows[i // s.rollout.n]))["score"]
                         for i, text in enumerate(texts)], np.float32)
    adv, _ = advantages.compute_advantages(
        "grpo", place_scores(scores, batch["response_mask"]), batch["response_mask"],
        group_ids=np.repeat(np.arange(len(rows)), s.rollout.n),
        norm_adv_by_std_in_grpo=s.algorithm.norm_adv_by_std_in_grpo)
    log_probs, _ = response_log_probs(st.params, *batch.values(), config=st.model)
    rng = np.random.default_rng(0)
    batch["old_log_probs"] = np.asarray(log_probs) + noise * rng.standard_normal(log_probs.shape)
    batch["advantages"] = np.asarray(adv)
    pick = rng.permutation(len(texts))[: s.actor.update.mini_batch]
    return {k: v[pick].astype(np.float32 if v.dtype.kind == "f" else np.int32)
            for k, v in batch.items()}


def run_gradcheck(args) -> None:
    """jrl's actor loss and gradient vs TRL's `compute_loss` (the trainer built by
    `trl_args`) on one mini-batch: the same objective, to float precision?"""
    import datasets
    import torch
    from trl import GRPOConfig

    from jrl.algos import masks
    from jrl.rl import update

    st = setup(args)
    results = []
    for noise in (0.0, args.gradcheck_noise):
        batch = _gradcheck_batch(st, noise)
        loss_fn = functools.partial(update.actor_loss, model_config=st.model, actor=st.s.actor,
                                    temperature=st.s.rollout.temperature,
                                    chunk_size=st.s.logprob_chunk_size)
        normalizer = masks.loss_normalizer(batch["response_mask"])
        (jrl_loss, _), jrl_grads = jax.value_and_grad(loss_fn, has_aux=True)(
            st.params, batch, normalizer, jax.random.key(0))
        dataset = datasets.Dataset.from_dict({"prompt": ["0+0="], "ground_truth": ["0"],
                                              "data_source": [st.train_rows[0]["data_source"]]})
        trainer = make_trl_trainer_class()(
            model=hf_dir(args), reward_funcs=exact_match,
            args=GRPOConfig(**trl_args(st, args.seed, os.path.join(seed_dir(args), "gradcheck"))),
            train_dataset=dataset, processing_class=load_hf_tokenizer(hf_dir(args)))
        trainer.current_gradient_accumulation_steps = 1
        t = {k: torch.as_tensor(v) for k, v in batch.items()}
        inputs = {"prompt_ids": t["prompt_ids"].long(), "prompt_mask": t["prompt_mask"],
                  "completion_ids": t["responses"].long(), "completion_mask": t["response_mask"],
                  "advantages": t["advantages"][:, 0], "old_per_token_logps": t["old_log_probs"],
                  "num_items_in_batch": t["response_mask"].sum()}
        trainer.model.train()
        trl_loss = trainer.compute_loss(trainer.model, inputs)
        trl_loss.backward()
        grads = {name: p.grad.numpy() for name, p in trainer.model.named_parameters()}
        trl_grads = params_from_torch(st.model, grads)
        flat = lambda tree: np.concatenate([np.ravel(x) for x in jax.tree.leaves(tree)])
        a, b = flat(jrl_grads), flat(trl_grads)
        results.append({"old_log_prob_noise": noise, "jrl_loss": float(jrl_loss),
                        "trl_loss": trl_loss.item(), "jrl_grad_norm": float(np.linalg.norm(a)),
                        "trl_grad_norm": float(np.linalg.norm(b)),
                        "grad_rel_diff": float(np.linalg.norm(a - b) / np.linalg.norm(a)),
                        "grad_cosine": float(a @ b / np.linalg.norm(a) / np.linalg.norm(b))})
        print(json.dumps(results[-1]), flush=True)
    write_json(os.path.join(args.results, f"gradcheck_seed{args.seed}.json"),
               {"what": run_gradcheck.__doc__, "results": results, **provenance(args, st.config)})


# ----------------------------------------------------------------------------- stage: all


def run_all(args) -> None:
    """Snapshots the config, then runs warm, jrl and trl for each seed, one process each
    (one at a time: the frameworks never share the CPU)."""
    os.makedirs(args.work, exist_ok=True)
    snapshot = args.config_file or os.path.join(args.work, "grpo_arith_snapshot.py")
    if args.config_file is None:
        shutil.copyfile(CONFIG_FILE, snapshot)
    common = ["--config_file", snapshot, "--work", args.work, "--results", args.results]
    common += ["--steps", str(args.steps)] if args.steps else []
    common += ["--eval_every", str(args.eval_every)] if args.eval_every else []
    common += [f"--set={item}" for item in args.set]
    for seed in args.seeds:
        runs = [(stage, None) for stage in args.stages if stage == "warm"]
        runs += [(stage, rl_seed) for rl_seed in args.rl_seeds or [None]
                 for stage in args.stages if stage != "warm"]
        for stage, rl_seed in runs:
            if stage != "warm" and args.quiet_cores is not None:
                wait_for_quiet(args.quiet_cores, args.quiet_timeout)
            command = [sys.executable, os.path.abspath(__file__), stage, "--seed", str(seed),
                       *common, *(["--rl_seed", str(rl_seed)] if rl_seed is not None else [])]
            print("+", " ".join(command), flush=True)
            subprocess.run(command, check=True)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("stage", choices=("warm", "jrl", "trl", "profile", "gradcheck", "all"))
    p.add_argument("--seed", type=int, default=0, help="config.seed of this run")
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2], help="with `all`")
    p.add_argument("--rl_seeds", type=int, nargs="+", default=None,
                   help="with `all`: RL seeds to run from each warm start (default: its own)")
    p.add_argument("--rl_seed", type=int, default=None,
                   help="jrl/trl: seed of the RL run (sampling, shuffling) from --seed's warm "
                        "start (default: --seed)")
    p.add_argument("--stages", nargs="+", default=["warm", "jrl", "trl"], help="with `all`")
    p.add_argument("--steps", type=int, default=0,
                   help="RL steps (0: the config's trainer.total_training_steps)")
    p.add_argument("--eval_every", type=int, default=0,
                   help="RL steps between evaluations (0: the config's trainer.test_freq)")
    p.add_argument("--repeats", type=int, default=20, help="with `profile`: timed calls")
    p.add_argument("--gradcheck_noise", type=float, default=0.3,
                   help="with `gradcheck`: std of the noise added to the old log-probs")
    p.add_argument("--config_file", default=None,
                   help="a copy of configs/grpo_arith.py to use (default: import it)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config key (repeatable), e.g. data.max_prompt_length=6")
    p.add_argument("--work", default=WORK, help="warm starts, checkpoints, TRL output")
    p.add_argument("--quiet_cores", type=float, default=0.3,
                   help="with `all`: before each jrl/trl run, wait until other processes use "
                        "fewer cores than this (timings on a busy CPU mean little)")
    p.add_argument("--quiet_timeout", type=float, default=900.0,
                   help="with `all`: the longest wait for a quiet CPU, in seconds")
    p.add_argument("--results", default=RESULTS, help="where the per-run JSON goes")
    args = p.parse_args(argv)
    stages = {"warm": run_warm, "jrl": run_jrl, "trl": run_trl, "profile": run_profile,
              "gradcheck": run_gradcheck, "all": run_all}
    stages[args.stage](args)


if __name__ == "__main__":
    main()
