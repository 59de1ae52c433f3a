"""experiments/studies/bf16_outcome.py: the table of the bf16-against-float32 sweep and its verdict per optimizer."""
import json

import pytest

from experiments.studies import bf16_outcome


def _job(root, i, optim, seed, bf16, quality, loss):
    d = root / str(i)
    (d / ".hydra").mkdir(parents=True)
    (d / ".hydra" / "overrides.yaml").write_text(f"- seed={seed}\n- task.bf16={bf16}\n")
    (d / "summary.json").write_text(json.dumps({"optim": optim, "seed": seed, "quality": quality,
                                                "train_loss": loss, "git_revision": "abc1234"}))


def test_the_verdict_compares_the_seed_ranges(tmp_path):
    jobs = [("dopr_adamw", 0, "False", 4.0, 0.40), ("dopr_adamw", 1, "False", 5.0, 0.41),
            ("dopr_adamw", 0, "any_device", 6.0, 0.405), ("dopr_adamw", 1, "any_device", 7.0, 0.42),
            ("adamw", 0, "False", 3.0, 0.5), ("adamw", 1, "False", 4.0, 0.5),
            ("adamw", 0, "any_device", 2.5, 0.45), ("adamw", 1, "any_device", 3.5, 0.49)]
    for i, j in enumerate(jobs):
        _job(tmp_path, i, *j)
    out = tmp_path / "table.md"
    bf16_outcome.main([str(tmp_path), "--out", str(out)])
    text = out.read_text()
    assert "abc1234" in text
    assert "| dopr_adamw | FD-digits | 4-5 | 6-7 | +2 | worse beyond the seed spread |" in text
    assert "| dopr_adamw | training loss | 0.4-0.41 | 0.405-0.42 | +0.0075 | within the seed spread |" in text
    assert "| adamw | FD-digits | 3-4 | 2.5-3.5 | -0.5 | within the seed spread |" in text
    assert "| adamw | training loss | 0.5-0.5 | 0.45-0.49 | -0.03 | better beyond the seed spread |" in text


def test_a_folder_without_jobs_is_refused_in_one_line(tmp_path):
    with pytest.raises(SystemExit, match="no finished job"):
        bf16_outcome.main([str(tmp_path)])
    with pytest.raises(SystemExit, match="no sweep folder"):
        bf16_outcome.main([str(tmp_path / "missing")])
