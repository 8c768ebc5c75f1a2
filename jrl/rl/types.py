"""The data of one RL step, as pytrees: what the rollout produces, what the update
learns from, and the state the update carries from step to step.

Every array of a `Rollout` or an `Experience` has the batch (`N` sequences) as its
leading axis, so one sharding (the batch split over the mesh's data axes) is a
prefix of the whole structure. Optional fields are None when the run does not need
them (no reference without a KL term, no values without a critic).
"""

from __future__ import annotations

import jax
from flax import struct

from jrl.algos.kl_control import KLControlState
from jrl.rl.update import ModelState

Array = jax.Array


@struct.dataclass
class Rollout:
    """Sampled responses to a batch of prompts (`N` = prompts x samples per prompt).

    The samples of a prompt are consecutive rows, each holding the same prompt (ids and
    mask): the log-prob, value and update passes run a prompt once for its samples
    (`actor.share_prompts`, `jrl.rl.logprobs`).
    """

    prompt_ids: Array  # [N, P] int32, left-padded
    prompt_mask: Array  # [N, P] int32, 1 on prompt tokens
    responses: Array  # [N, R] int32, right-padded
    response_mask: Array  # [N, R] int32, 1 on the tokens the model wrote (the loss mask)
    # [N, R] int32, 1 on every response token, the tools' outputs of a multi-turn rollout
    # too (what the model attends to); None: `response_mask`.
    response_attention_mask: Array | None = None
    # [N, R] float32, the sampler's log-prob of each token it drew (0 off the model's
    # tokens); None for greedy rollouts.
    rollout_log_probs: Array | None = None
    # [N, P, L, k] and [N, R, L, k] int32, an MoE model's experts for each prompt and
    # response token in every layer, as the rollout routed them (`actor.router_replay`);
    # else None.
    prompt_routing: Array | None = None
    response_routing: Array | None = None
    # [N] int32, the paged cache's preemptions of each row (`rollout/preemptions`); else
    # None.
    preemptions: Array | None = None
    # [N] float32, the most pages the paged cache's rows held at once, as a fraction of
    # its pool, the same for every row of a rollout call (`rollout/page_usage`); else None.
    page_usage: Array | None = None

    def attention_mask(self) -> Array:
        return self.response_mask if self.response_attention_mask is None else \
            self.response_attention_mask

    def routing(self) -> tuple[Array, Array] | tuple[()]:
        """The recorded routing to replay, `(prompt_routing, response_routing)`, or ()."""
        return () if self.prompt_routing is None else (self.prompt_routing,
                                                       self.response_routing)


@struct.dataclass
class Experience:
    """A rollout with what the update needs: log-probs and values from `step.forward`,
    then rewards and group ids from the host."""

    prompt_ids: Array  # [N, P]
    prompt_mask: Array  # [N, P]
    responses: Array  # [N, R]
    response_mask: Array  # [N, R]
    # [N, R] float32, the actor's before the update, and the entropy of its token
    # distributions; None when the update is on-policy and computes both itself
    # (`ActorSettings.on_policy`).
    old_log_probs: Array | None = None
    entropy: Array | None = None
    ref_log_probs: Array | None = None  # [N, R] float32, the reference's (a KL term)
    values: Array | None = None  # [N, R] float32, the critic's (GAE)
    token_level_scores: Array | None = None  # [N, R] float32, each score at the last token
    uid: Array | None = None  # [N] int32, the prompt (group) of each sequence
    reward_baselines: Array | None = None  # [N] float32, greedy rewards (ReMax)
    response_attention_mask: Array | None = None  # [N, R] (`Rollout`'s)
    rollout_log_probs: Array | None = None  # [N, R] (`Rollout`'s)
    prompt_routing: Array | None = None  # [N, P, L, k] (`Rollout`'s)
    response_routing: Array | None = None  # [N, R, L, k] (`Rollout`'s)

    attention_mask = Rollout.attention_mask
    routing = Rollout.routing

    @classmethod
    def of(cls, rollout: Rollout, **fields) -> Experience:
        return cls(prompt_ids=rollout.prompt_ids, prompt_mask=rollout.prompt_mask,
                   responses=rollout.responses, response_mask=rollout.response_mask,
                   response_attention_mask=rollout.response_attention_mask,
                   rollout_log_probs=rollout.rollout_log_probs,
                   prompt_routing=rollout.prompt_routing,
                   response_routing=rollout.response_routing, **fields)


@struct.dataclass
class TrainState:
    """What `step.learn` carries from one RL step to the next (all on the devices)."""

    step: Array  # [] int32, RL steps done
    actor: ModelState
    critic: ModelState | None
    kl: KLControlState  # the in-reward KL coefficient
