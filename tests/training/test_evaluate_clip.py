"""examples/evaluate_clip.py: the shipped metrics on a saved checkpoint without training give the numbers the
training run's final evaluation gave (same model, same eval set, same code), saved as evaluate.save writes."""

import json

import pytest
from train_helpers import helpers, load_script, read_results, run_in_process, write_tiny_model_config

KEYS = ("zero_shot_top1", "zero_shot_top5", "image_to_text_R@1", "image_to_text_R@5", "text_to_image_R@1")


def test_eval_only_reproduces_the_final_eval_of_a_run(tmp_path):
    out = tmp_path / "run"
    argv = ["--model_config", write_tiny_model_config(str(tmp_path / "c.json")), "--max_train_steps", "2",
            "--batch_size", "8", "--eval_steps", "0", "--max_eval_samples", "32", "--output_dir", str(out)]  # fmt: skip
    run_in_process(load_script(), argv)
    trained = read_results(out)
    saved = json.loads((out / "eval_results.json").read_text())
    assert "_evaluate_version" in saved  # evaluate.save's metadata beside the values

    script = helpers.load_script("examples/evaluate_clip.py")
    results_file = tmp_path / "eval.json"
    got = script.main(
        ["--model_name_or_path", str(out), "--max_eval_samples", "32", "--output_file", str(results_file)]
    )
    for key in KEYS:
        # fractions of 32 samples: the same model and data must give the same count
        assert got[key] == pytest.approx(trained[key], abs=1e-9), key
        assert saved[key] == pytest.approx(trained[key], abs=1e-9), key
    assert json.loads(results_file.read_text())["zero_shot_top1"] == got["zero_shot_top1"]
