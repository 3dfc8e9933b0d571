"""The multi-turn agent loop: trajectories of model turns and environment observations, as token ids.

For a batch of prompts (each answered n times) the loop starts one episode per trajectory
(rlflow/agents: `reset(row)`), then, turn by turn, generates the next model turn of every live
trajectory with the rollout group (prompt + everything so far as the context), hands each turn's
text to its environment (`step`), and appends the observation's token ids. An episode ends when
its environment says done, after rollout.agent.max_turns model turns, or when the trajectory
reaches data.max_response_length tokens.

The trajectory is assembled from ids only: the model's tokens exactly as generated (up to and
including its EOS), the observations encoded once (`encode(text, add_special_tokens=False)`).
Nothing the model produced is decoded and re-encoded, so the ids trained on are the ids sampled.

The batch layout (docs/CONVENTIONS.md) is the single-turn one with holes:
- `responses`: the whole trajectory after the prompt (model and observation tokens), right-padded;
- `response_mask`: 1 on model tokens only; observation tokens and padding are 0, so they enter no
  loss, no count (batch_num_tokens, global_batch_size), no metric and no advantage target;
- `attention_mask`: 1 on every prompt and trajectory token, so the log-prob, value and reference
  forwards see the whole trajectory, observations included;
- `rollout_log_probs`: the engine's log-probs of the model tokens, 0 elsewhere;
- the scores: each step's reward on the last token of the model turn it answers.
The advantage estimators skip mask holes (rlflow/algos/advantages.py: GAE bootstraps from the next
model token, the outcome estimators sum the rewards of the model tokens).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from tensordict import TensorDict

from rlflow.protocol import left_pad, pad_rows, position_ids_from_mask, right_pad


@dataclass
class _Trajectory:
    prompt: list[int]
    row: dict
    ids: list[int]
    mask: list[int]  # 1: a model token
    log_probs: list[float]
    rewards: list[tuple[int, float]]  # (position in ids, reward)
    turns: int = 0
    done: bool = False
    acc: float | None = None
    error: str | None = None

    def room(self, max_response_length: int) -> int:
        return max_response_length - len(self.ids)


class AgentLoop:
    def __init__(self, cfg, rollout_group, env_pool, tokenizer):
        self.cfg = cfg
        self.rollout = rollout_group
        self.envs = env_pool
        self.tokenizer = tokenizer
        self.max_response_length = cfg.data.max_response_length

    def run(self, prompts: TensorDict, rows: dict, n: int, do_sample: bool, seed: int,
            return_log_probs: bool = True, temperature: float | None = None, top_p: float | None = None,
            ) -> tuple[TensorDict, torch.Tensor, dict]:
        """(batch, token_level_scores [B*n, R], extras) for the prompts [B, P] (left-padded), each
        answered n times in repeat_interleave order; rows: {key: [B values]} (the dataset's row data)."""
        trajectories = self._reset(prompts, rows, n)
        agent = self.cfg.rollout.agent
        for turn in range(agent.max_turns):
            live = [i for i, t in enumerate(trajectories) if not t.done]
            if not live:
                break
            self._model_turn(trajectories, live, do_sample, seed + turn * 7_777_777, return_log_probs, temperature,
                             top_p)
            last_turn = turn + 1 == agent.max_turns
            self._env_step(trajectories, live, last_turn)
        return self._assemble(prompts, trajectories, n, return_log_probs)

    # -- the episode ---------------------------------------------------------------------------------
    def _reset(self, prompts: TensorDict, rows: dict, n: int) -> list[_Trajectory]:
        trajectories = []
        for i in range(prompts.batch_size[0]):
            prompt = prompts["input_ids"][i][prompts["attention_mask"][i].bool()].tolist()
            row = {key: values[i] for key, values in rows.items()}
            trajectories += [_Trajectory(prompt, row, [], [], [], []) for _ in range(n)]
        outcomes = self.envs.reset([t.row for t in trajectories])
        for trajectory, outcome in zip(trajectories, outcomes, strict=True):
            if outcome.error is not None or outcome.done:
                self._end(trajectory, outcome)
            else:
                self._observe(trajectory, outcome.observation)
        return trajectories

    def _model_turn(self, trajectories: list[_Trajectory], live: list[int], do_sample: bool, seed: int,
                    return_log_probs: bool, temperature, top_p) -> None:
        contexts = [trajectories[i].prompt + trajectories[i].ids for i in live]
        budget = max(trajectories[i].room(self.max_response_length) for i in live)
        out = self._generate(contexts, do_sample, seed, return_log_probs, temperature, top_p, budget)
        for row, i in enumerate(live):
            trajectory = trajectories[i]
            mask = out["response_mask"][row].bool()
            ids = out["responses"][row][mask].tolist()[: trajectory.room(self.max_response_length)]
            log_probs = out["rollout_log_probs"][row][mask].tolist()[: len(ids)] if return_log_probs else [0.0] * len(ids)
            trajectory.ids += ids
            trajectory.mask += [1] * len(ids)
            trajectory.log_probs += log_probs
            trajectory.turns += 1

    def _generate(self, contexts: list[list[int]], do_sample: bool, seed: int, return_log_probs: bool,
                  temperature, top_p, max_new_tokens: int) -> TensorDict:
        input_ids, attention_mask = left_pad(contexts, self.tokenizer.pad_token_id)
        batch = TensorDict({"input_ids": input_ids, "attention_mask": attention_mask,
                            "position_ids": position_ids_from_mask(attention_mask)}, batch_size=[len(contexts)])
        out = self.rollout.dispatch_dp("generate", pad_rows(batch, self.rollout.world_size), 1, do_sample, seed, return_log_probs, temperature, top_p,
                                       max_new_tokens)
        return out[: len(contexts)]

    def _env_step(self, trajectories: list[_Trajectory], live: list[int], last_turn: bool) -> None:
        texts = []
        for i in live:
            trajectory = trajectories[i]
            turn_ids = trajectory.ids[len(trajectory.ids) - self._last_turn_length(trajectory):]
            texts.append(self.tokenizer.decode(turn_ids, skip_special_tokens=True))
        outcomes = self.envs.step(live, texts)
        for i, outcome in zip(live, outcomes, strict=True):
            trajectory = trajectories[i]
            if trajectory.ids and trajectory.mask[-1] == 1:
                trajectory.rewards.append((len(trajectory.ids) - 1, float(outcome.reward)))
            if outcome.done or outcome.error is not None or last_turn:
                self._end(trajectory, outcome)
            else:
                self._observe(trajectory, outcome.observation)

    @staticmethod
    def _last_turn_length(trajectory: _Trajectory) -> int:
        length = 0
        for flag in reversed(trajectory.mask):
            if not flag:
                break
            length += 1
        return length

    def _observe(self, trajectory: _Trajectory, observation: str) -> None:
        ids = self.tokenizer.encode(observation, add_special_tokens=False) if observation else []
        ids = ids[: trajectory.room(self.max_response_length)]
        trajectory.ids += ids
        trajectory.mask += [0] * len(ids)
        trajectory.log_probs += [0.0] * len(ids)
        if trajectory.room(self.max_response_length) <= 0:
            trajectory.done = True  # no room left for another model turn

    @staticmethod
    def _end(trajectory: _Trajectory, outcome) -> None:
        trajectory.done = True
        if "acc" in outcome.info:
            trajectory.acc = float(outcome.info["acc"])
        if outcome.error is not None:
            trajectory.error = outcome.error

    # -- the batch -----------------------------------------------------------------------------------
    def _assemble(self, prompts: TensorDict, trajectories: list[_Trajectory], n: int, return_log_probs: bool
                  ) -> tuple[TensorDict, torch.Tensor, dict]:
        width = self.max_response_length
        prompt_ids = prompts["input_ids"].repeat_interleave(n, dim=0)
        prompt_mask = prompts["attention_mask"].repeat_interleave(n, dim=0).long()
        responses, trajectory_mask = right_pad([t.ids for t in trajectories], self.tokenizer.pad_token_id, width)
        response_mask = torch.zeros_like(responses)
        log_probs = torch.zeros(responses.shape, dtype=torch.float32)
        scores = torch.zeros(responses.shape, dtype=torch.float32)
        for row, trajectory in enumerate(trajectories):
            length = len(trajectory.ids)
            response_mask[row, :length] = torch.tensor(trajectory.mask, dtype=torch.long)
            log_probs[row, :length] = torch.tensor(trajectory.log_probs, dtype=torch.float32)
            for position, reward in trajectory.rewards:
                scores[row, position] += reward
        attention_mask = torch.cat([prompt_mask, trajectory_mask], dim=1)
        batch = TensorDict({
            "prompts": prompt_ids, "responses": responses, "response_mask": response_mask,
            "input_ids": torch.cat([prompt_ids, responses], dim=1), "attention_mask": attention_mask,
            "position_ids": position_ids_from_mask(attention_mask),
        }, batch_size=[len(trajectories)])
        if return_log_probs:
            batch["rollout_log_probs"] = log_probs
        extras = {"num_env_errors": sum(t.error is not None for t in trajectories),
                  "metrics": {"agent/turns_mean": sum(t.turns for t in trajectories) / len(trajectories),
                              "agent/observation_tokens_mean":
                                  sum(len(t.mask) - sum(t.mask) for t in trajectories) / len(trajectories)}}
        accs = [t.acc for t in trajectories]
        if any(acc is not None for acc in accs):
            extras["acc"] = [0.0 if acc is None else acc for acc in accs]
        return batch, scores, extras
