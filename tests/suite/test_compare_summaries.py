"""experiments/common/compare_summaries.py: numbers compared, timings and provenance left out."""
import json

from experiments.common import compare_summaries


def test_timings_and_provenance_are_not_compared():
    summary = {"train_loss": 0.5, "wall_time_s": 3.0, "git_revision": "abc",
               "evals": [{"success": 0.5, "env_s_1": 2.0, "env_steps_per_s_1": 100.0, "policy_s_1": 1.0}]}
    assert compare_summaries.leaves(summary) == {"train_loss": 0.5, "evals.0.success": 0.5}
