"""megappo.rewards.registry: the data_source registry and user reward functions loaded from files."""
import pickle

import pytest

from megappo.rewards import (
    RewardFunctionError,
    default_compute_score,
    get_reward_fn,
    load_custom_reward_fn,
    register_reward,
    registered_data_sources,
)
from megappo.rewards import registry


def test_gsm8k_is_registered():
    assert "openai/gsm8k" in registered_data_sources()
    assert default_compute_score("openai/gsm8k", "so #### 1,234", "1234", {}) == 1.0
    assert default_compute_score("openai/gsm8k", "so #### 12", "1234", None) == 0.0


def test_register_reward_and_unknown_source(monkeypatch):
    monkeypatch.setattr(registry, "_REGISTRY", dict(registry._REGISTRY))

    @register_reward("test/len")
    def length_reward(data_source, solution_str, ground_truth, extra_info=None):
        return {"score": float(len(solution_str) == ground_truth), "length": len(solution_str)}

    assert get_reward_fn("test/len") is length_reward
    assert default_compute_score("test/len", "abc", 3) == {"score": 1.0, "length": 3}
    with pytest.raises(ValueError, match="already has reward function"):
        register_reward("test/len")(lambda *a: 0.0)
    with pytest.raises(RewardFunctionError, match="no reward function is registered for data_source 'nope'.*"
                       "custom_reward_function.path"):
        default_compute_score("nope", "x", "y")




def _write(tmp_path, body, name="my_reward.py"):
    path = tmp_path / name
    path.write_text(body)
    return str(path)


def test_load_custom_reward_fn_and_pickle_by_path(tmp_path):
    path = _write(tmp_path, "LIMIT = 3\n\ndef compute_score(data_source, solution_str, ground_truth, extra_info):\n"
                            "    return float(solution_str == ground_truth) * LIMIT\n\n"
                            "def other(data_source, solution_str, ground_truth, extra_info):\n    return -1.0\n")
    fn = load_custom_reward_fn(path)
    assert fn("any", "a", "a", None) == 3.0
    assert load_custom_reward_fn(path, "other")("any", "a", "a", None) == -1.0
    assert load_custom_reward_fn(None) is None
    clone = pickle.loads(pickle.dumps(fn))  # what a worker receives: the path and the name, not the code
    assert clone._fn is None and clone.path == path and clone.name == "compute_score"
    assert clone("any", "b", "a", None) == 0.0


def test_custom_reward_fn_errors(tmp_path):
    with pytest.raises(RewardFunctionError, match="does not exist"):
        load_custom_reward_fn(str(tmp_path / "missing.py"))
    path = _write(tmp_path, "def score_fn(*a):\n    return 1.0\n\nhelper = 3\n")
    with pytest.raises(RewardFunctionError, match=r"defines no 'compute_score'.*score_fn"):
        load_custom_reward_fn(path)
    with pytest.raises(RewardFunctionError, match="'helper' is a int, not a function"):
        load_custom_reward_fn(path, "helper")
    broken = _write(tmp_path, "def compute_score(:\n", name="broken.py")
    with pytest.raises(RewardFunctionError, match="importing .*broken.py.* failed with SyntaxError"):
        load_custom_reward_fn(broken)
    raising = _write(tmp_path, "raise RuntimeError('needs an API key')\n", name="raising.py")
    with pytest.raises(RewardFunctionError, match="RuntimeError: needs an API key"):
        load_custom_reward_fn(raising)
