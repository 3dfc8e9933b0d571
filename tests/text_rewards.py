"""Reward functions the tests' runs load by path (reward.custom_function.path) in every reward
process: nothing is imported here, so a process loads this file in milliseconds (a file that
imports torch and the test helpers costs each of a run's reward processes seconds)."""

REWARD_FILE = __file__  # for reward.custom_function.path


def exactness_score(data_source, solution_str, ground_truth, extra_info=None) -> float:
    """A deterministic reward that varies with the text (a random model never solves the task)."""
    return (sum(map(ord, solution_str)) % 7) / 3.0 - 1.0
