"""GRPO with a calculator tool: three-digit multiplication in two turns, on a laptop CPU.

A small decoder (the built-in character tokenizer and its chat template) gets `a*b`
for two three-digit numbers: too hard to answer in its head, easy with the
calculator. A multi-turn rollout lets the model write a call
`<tool_call>{"name":"calculator","arguments":{"expression":"a*b"}}</tool_call>`,
ends its turn at the newline, runs the calculator on the host and appends its answer
("Tool: ...") and the next assistant opening to the kept cache; the model then writes
its final answer. Only the model's tokens are trained; the reward is the exact match
of the last turn.

The warm start imitates a teacher that calls the calculator for 40% of the problems
and guesses the rest ("The answer is 123456."), so the warm-started model mostly
guesses when decoding greedily (held-out accuracy near 0) while sampling a tool call
now and then; GRPO turns those into its policy. docs/guide.md ("Multi-turn rollouts
with tools") explains the keys.

    python -m jrl.train --config=configs/grpo_tool_calc.py

Variants: `--config=configs/grpo_tool_calc.py:seed=1,steps=30` (n, lr, steps, seed).
"""

from jrl.config.defaults import base_config, parse_arg
from jrl.data.tokenizers import CharTokenizer

ARG_DEFAULTS = dict(n=8, lr=2e-4, steps=20, seed=0)


def get_config(arg: str | None = None):
    a = parse_arg(arg, **ARG_DEFAULTS)
    c = base_config()
    c.seed = a.seed
    c.model.preset = "tiny"
    c.model.hidden_size = 128
    c.model.intermediate_size = 256
    c.model.num_layers = 2
    c.model.num_heads = 4
    c.model.num_kv_heads = 2
    c.model.head_dim = 32
    c.data.task = "tool_multiplication"
    c.data.digits = 3
    c.data.tool_rate = 0.4
    c.data.num_train = 4096
    c.data.num_val = 256
    c.data.apply_chat_template = True
    c.data.train_batch_size = 16
    c.data.max_prompt_length = 26  # "User: 123*456\nAssistant: "
    c.rollout.n = a.n
    # The whole two-turn response: an 81-token call, its newline, the 24-token tool
    # block and the answer.
    c.rollout.response_length = 116
    c.rollout.multi_turn.enable = True
    c.rollout.multi_turn.tool_config_path = "configs/tools/calculator.yaml"
    c.rollout.multi_turn.max_assistant_turns = 2
    c.rollout.multi_turn.max_user_turns = 1
    c.rollout.multi_turn.max_tool_response_tokens = 32
    # The character chat template ends every turn with a newline.
    c.rollout.multi_turn.turn_stop_ids = tuple(CharTokenizer().encode("\n"))
    c.sft.steps = 600
    c.sft.batch_size = 64
    c.sft.lr = 1e-3
    c.sft.lr_warmup_steps = 50
    c.actor.optim.lr = a.lr
    c.actor.ppo_mini_batch_size = 16
    c.actor.ppo_micro_batch_size = 128
    c.algorithm.adv_estimator = "grpo"
    c.trainer.total_training_steps = a.steps
    c.trainer.test_freq = 10
    c.trainer.save_freq = 0
    return c
