"""The agent loop for rollout.agent.fn: agent functions that call an OpenAI-compatible endpoint.

For a batch of prompts (each answered n times) the loop opens one endpoint session per trajectory
(controllers/openai_endpoint.py), runs the agent function of every episode in the environment
pool's processes (rlflow/agents/fn.py: reset keeps the row with its base_url, the one step runs the
function under rollout.agent.timeout_s and on_error), and assembles the batch from the sessions'
records: the first call's prompt ids as the prompt, then the sampled ids (response_mask 1, with
their log-probs) and the ids between calls (mask 0), exactly the layout of AgentLoop._assemble.
Nothing is re-tokenised: the ids trained on are the ids sampled. The episode's reward lands on the
last sampled token of its trajectory; a dict's "acc" feeds reward/acc_mean and validation.

A trajectory whose function made no call (or failed before one) keeps the dataset's prompt and
has no response tokens: it enters no loss and no count.
"""

from __future__ import annotations

import ray
import torch
from tensordict import TensorDict

from controllers.agent_loop import AgentLoop, _Trajectory
from controllers.openai_endpoint import OpenAIEndpoint
from rlflow.agents.fn import BASE_URL_KEY
from rlflow.protocol import left_pad, position_ids_from_mask


def endpoint_host() -> str:
    """127.0.0.1 on one node; the driver node's address when the Ray cluster has more (the pool's
    processes may run elsewhere)."""
    try:
        if ray.is_initialized() and len([n for n in ray.nodes() if n.get("Alive")]) > 1:
            return ray.util.get_node_ip_address()
    except Exception:  # noqa: BLE001 - no cluster view: stay local
        pass
    return "127.0.0.1"


class EndpointAgentLoop(AgentLoop):
    def __init__(self, cfg, rollout_group, env_pool, tokenizer, weight_version=None):
        super().__init__(cfg, rollout_group, env_pool, tokenizer)
        agent = cfg.rollout.agent
        self.endpoint = OpenAIEndpoint(tokenizer, self._engine, cfg.data.max_prompt_length, cfg.data.max_response_length,
                                       tool_parser=agent.tool_parser, weight_version=weight_version,
                                       host=endpoint_host(), concurrency=max(agent.num_workers, 1))
        self._sampling = (True, 0, True, None, None)
        self._engine_seed = 0
        self.last_sessions: dict = {}

    def close(self) -> None:
        self.endpoint.stop()

    def _engine(self, contexts: list[list[int]], max_new_tokens: int) -> list[tuple[list[int], list[float]]]:
        """One generate call of the rollout group for the endpoint's batch of requests."""
        do_sample, seed, return_log_probs, temperature, top_p = self._sampling
        self._engine_seed += 1
        out = self._generate(contexts, do_sample, seed + self._engine_seed * 7_777_777, return_log_probs,
                             temperature, top_p, max_new_tokens)
        answers = []
        for row in range(len(contexts)):
            mask = out["response_mask"][row].bool()
            ids = out["responses"][row][mask].tolist()
            log_probs = out["rollout_log_probs"][row][mask].tolist() if return_log_probs else [0.0] * len(ids)
            answers.append((ids, log_probs))
        return answers

    def run(self, prompts: TensorDict, rows: dict, n: int, do_sample: bool, seed: int,
            return_log_probs: bool = True, temperature: float | None = None, top_p: float | None = None,
            ) -> tuple[TensorDict, torch.Tensor, dict]:
        self.endpoint.start()
        self._sampling = (do_sample, seed, return_log_probs, temperature, top_p)
        self._engine_seed = 0
        count = prompts.batch_size[0] * n
        urls = self.endpoint.open(count)
        episode_rows = []
        for i in range(count):
            row = {key: values[i // n] for key, values in rows.items()}
            row[BASE_URL_KEY] = urls[i]
            episode_rows.append(row)
        try:
            started = self.envs.reset(episode_rows)
            live = [i for i, outcome in enumerate(started) if outcome.error is None and not outcome.done]
            outcomes = dict(zip(live, self.envs.step(live, [""] * len(live)), strict=True))
        finally:
            sessions = self.endpoint.close_rollout()
        if self.endpoint.engine_error is not None:
            raise RuntimeError("the rollout engine failed answering the OpenAI endpoint's calls") from self.endpoint.engine_error
        self.last_sessions = sessions
        trajectories = []
        for i in range(count):
            session = sessions[i]
            dataset_prompt = prompts["input_ids"][i // n][prompts["attention_mask"][i // n].bool()].tolist()
            prompt = session.prompt if session.prompt else dataset_prompt
            trajectory = _Trajectory(prompt, episode_rows[i], list(session.ids), list(session.mask),
                                     list(session.log_probs), [], turns=session.segment_calls, done=True)
            outcome = outcomes.get(i, started[i])
            sampled = [p for p, flag in enumerate(trajectory.mask) if flag]
            if sampled:
                trajectory.rewards.append((sampled[-1], float(outcome.reward)))
            self._end(trajectory, outcome)
            trajectories.append(trajectory)
        input_ids, attention_mask = left_pad([t.prompt for t in trajectories], self.tokenizer.pad_token_id)
        first_prompts = TensorDict({"input_ids": input_ids, "attention_mask": attention_mask,
                                    "position_ids": position_ids_from_mask(attention_mask)}, batch_size=[count])
        batch, scores, extras = self._assemble(first_prompts, trajectories, 1, return_log_probs)
        calls = [len(s.calls) for s in sessions.values()]
        engine_calls = self.endpoint.engine_calls
        extras["metrics"].update({
            "agent/endpoint_calls_mean": sum(calls) / max(len(calls), 1),
            "agent/dropped_calls": float(sum(s.dropped_calls for s in sessions.values())),
            "agent/engine_batch_mean": sum(engine_calls) / max(len(engine_calls), 1),
        })
        return batch, scores, extras
