"""recipes/cpu/tiny_distill.yaml as a user runs it, and on-policy distillation's other ways: a teacher on an engine
of its own, several teachers by data source mixed with the task reward, and the asynchronous modes. In every run the
task reward is computed and logged; where use_task_rewards is false it is never trained on, so a rising reward is
the teacher's doing."""
from __future__ import annotations

import shutil

import pytest

from megappo.testing import golden
from megappo.testing.recipes import learned, run_recipe
from megappo.trainer.metrics import read_rows

pytestmark = pytest.mark.e2e
RECIPE = "recipes/cpu/tiny_distill.yaml"
VAL = "val/megappo/digit_max/reward_mean"


def _mean(rows, key, steps):
    values = [r[key] for r in rows if r["step"] in steps]
    return sum(values) / len(values)


def _out(tmp_path, name, distill_task_dir):
    out = tmp_path / name
    shutil.copytree(distill_task_dir, out / "synthetic")  # the student and teacher, made once (tests/conftest.py)
    return out


def test_distill_recipe_learns_from_the_teacher_alone_and_repeats_its_golden(tmp_path, distill_task_dir):
    out = _out(tmp_path, "distill", distill_task_dir)
    rows = run_recipe(RECIPE, out, env=golden.GOLDEN_ENV)
    assert [r["step"] for r in read_rows(str(out))] == list(range(21))
    assert learned(rows) >= 0.3, [r.get("reward/mean") for r in rows]  # measured: 0.34 -> 0.88
    first, last = _mean(rows, "distill/reverse_kl", range(1, 6)), _mean(rows, "distill/reverse_kl", range(16, 21))
    assert last < first / 4, (first, last)  # measured: 1.47 -> 0.08
    val = [r[VAL] for r in rows if VAL in r]
    assert len(val) == 3 and val[-1] >= val[0] + 0.3
    for r in rows[1:]:
        assert r["distill/teacher/reverse_kl"] == r["distill/reverse_kl"] and r["distill/untaught_fraction"] == 0
        assert r["timing/teacher_s"] > 0
    header, want = golden.read("tiny_distill")
    diff = golden.differences(golden.strip_machine_keys(read_rows(str(out))), want)
    if diff and header["cpu"] != golden.cpu_signature():
        pytest.skip(f"the golden was recorded on {header['cpu']!r}, whose floats differ from this CPU's: {diff[:2]}")
    assert not diff, "\n".join(diff)


def test_a_teacher_on_an_engine_of_its_own_scores_what_the_megatron_teacher_does(tmp_path, distill_task_dir):
    """The teacher served by the hf engine in a process of its own: the first step's samples are the recorded
    run's (same seeds), so its reverse KL is the megatron teacher's to float precision."""
    out = _out(tmp_path, "engine", distill_task_dir)
    rows = run_recipe(RECIPE, out, "distillation.teacher_model.backend=engine",
                      "distillation.teacher_model.inference.hybrid_engine=false", "trainer.total_training_steps=3",
                      "trainer.val_before_train=false", "trainer.test_freq=-1", "trainer.save_freq=-1")
    _, want = golden.read("tiny_distill")
    got, recorded = {r["step"]: r for r in rows}, {r["step"]: r for r in want}
    assert sorted(got) == [1, 2, 3]
    for key in ("distill/reverse_kl", "distill/teacher_log_prob_mean"):
        assert abs(got[1][key] - recorded[1][key]) <= 1e-5, key


REWARD = """from megappo.tasks.synthetic import synthetic_reward


def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    return synthetic_reward(data_source, solution_str, ground_truth, extra_info)
"""


def _two_sources(tmp_path, distill_task_dir):
    """The task's files with every other training prompt relabelled `megappo/digit_max_b` (one reward for both)."""
    import pyarrow.compute as pc
    import pyarrow.parquet as pq

    from megappo.tasks import read_task_files

    task = read_task_files(f"{distill_task_dir}/digit_max")
    teacher = f"{distill_task_dir}/digit_max-teacher/model"
    table = pq.read_table(task.train_files)
    labels = ["megappo/digit_max" if i % 2 else "megappo/digit_max_b" for i in range(table.num_rows)]
    table = table.set_column(table.schema.get_field_index("data_source"), "data_source", pc.cast(labels, "string"))
    pq.write_table(table, tmp_path / "train.parquet")
    (tmp_path / "reward.py").write_text(REWARD)
    return task, teacher


# long (CI's 45 minutes): routing rows to teachers by data source is tests/unit/test_distill.py's, an engine
# teacher in a trainer run the test above's, one-step-off the trainer's own tests'
@pytest.mark.long
def test_two_teachers_by_data_source_beside_the_task_reward_one_step_off(tmp_path, distill_task_dir):
    """digit_max scored by a megatron teacher, digit_max_b by the same model on an engine; the teachers' signal
    added to GRPO's task advantages (use_task_rewards) while rollouts run a step ahead (one_step_off). Each teacher
    reports its own reverse KL, and both fall."""
    task, teacher = _two_sources(tmp_path, distill_task_dir)
    rows = run_recipe(
        RECIPE, tmp_path / "run", "data.synthetic.name=null", "data.synthetic.teacher_smoothing=null",
        f"actor_rollout_ref.model.path={task.model_dir}", f"critic.model.path={task.model_dir}",
        f"data.train_files={tmp_path / 'train.parquet'}", f"data.val_files={task.val_files}",
        f"custom_reward_function.path={tmp_path / 'reward.py'}",
        f"distillation.teacher_model.model_path={teacher}",
        "distillation.teacher_model.data_sources=[megappo/digit_max]",
        "distillation.teacher_models={b: {model_path: " + teacher + ", backend: engine, "
        "data_sources: [megappo/digit_max_b]}}",
        "distillation.distillation_loss.use_task_rewards=true",
        "distillation.distillation_loss.distillation_loss_coef=0.5",
        "async_training.mode=one_step_off", "actor_rollout_ref.hybrid_engine=false")
    assert learned(rows) >= 0.3, [r.get("reward/mean") for r in rows]
    for name in ("teacher", "b"):
        key = f"distill/{name}/reverse_kl"
        assert _mean(rows, key, range(16, 21)) < _mean(rows, key, range(1, 6)) / 3, [r[key] for r in rows[1:]]
    assert all(r["distill/untaught_fraction"] == 0 for r in rows[1:])
    assert rows[-1]["async/staleness_max"] >= 1  # the rollouts did run a step ahead


@pytest.mark.long
def test_distill_recipe_fully_async_with_partial_rollouts(tmp_path, distill_task_dir):
    """The recipe in fully_async mode (a sync every two mini-batches, rollouts a batch ahead, partial rollouts): the
    teacher scores samples some of whose tokens an older student drew, and the student still learns."""
    rows = run_recipe(RECIPE, _out(tmp_path, "async", distill_task_dir), "async_training.mode=fully_async",
                      "async_training.require_batches=2", "async_training.trigger_parameter_sync_step=2",
                      "async_training.staleness_threshold=0.5", "async_training.partial_rollout=true",
                      "actor_rollout_ref.hybrid_engine=false", "trainer.total_training_steps=30")
    assert learned(rows) >= 0.3, [r.get("reward/mean") for r in rows]


# long (about a minute, most of it the server's start): an engine teacher's scoring is the test above's (the hf
# engine in its own process), an SGLang fleet's deployment the trainer's SGLang tests' (CI's 45 minutes)
@pytest.mark.sglang
@pytest.mark.long
def test_a_teacher_on_sglang_servers_of_its_own(tmp_path, distill_task_dir, sglang_python):
    """The teacher served by an SGLang server the run starts for it (the policy stays on the in-process engine):
    batched prompt log-probs of the student's tokens, the first step's reverse KL the megatron teacher's (SGLang's
    CPU kernels sum in another order: 1e-4), and the server gone with the run."""
    out = _out(tmp_path, "sglang", distill_task_dir)
    rows = run_recipe(RECIPE, out, "distillation.teacher_model.backend=engine",
                      "distillation.teacher_model.inference.name=sglang",
                      f"actor_rollout_ref.rollout.server_python={sglang_python}", "trainer.total_training_steps=2",
                      "trainer.val_before_train=false", "trainer.test_freq=-1", "trainer.save_freq=-1")
    _, want = golden.read("tiny_distill")
    got, recorded = {r["step"]: r for r in rows}, {r["step"]: r for r in want}
    assert abs(got[1]["distill/reverse_kl"] - recorded[1]["distill/reverse_kl"]) <= 1e-4
    assert got[2]["distill/teacher_log_prob_mean"] < 0
    assert not _processes_naming(str(out)), "a process of the run outlived it"


def _processes_naming(text: str) -> list[int]:
    import os

    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if text.encode() in f.read():
                    found.append(int(pid))
        except OSError:
            pass
    return found
