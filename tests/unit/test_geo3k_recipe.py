"""recipes/geo3k/qwen2.5-vl-7b_grpo.yaml carries verl's example values (run_qwen2_5_vl-7b-megatron.sh) and reads
what `megappo data geo3k` writes, scored by the geo3k reward."""
from megappo.config.loader import load_config
from megappo.data.geo3k import DATA_SOURCE
from megappo.rewards import get_reward_fn


def test_geo3k_recipe_has_verls_values():
    cfg = load_config("geo3k/qwen2.5-vl-7b_grpo")
    d, a, r = cfg.data, cfg.actor_rollout_ref.actor, cfg.actor_rollout_ref.rollout
    assert (d.train_batch_size, d.max_prompt_length, d.max_response_length) == (512, 1024, 2048)
    assert d.filter_overlong_prompts and d.train_files == "~/data/geo3k/train.parquet"
    assert (a.optim.lr, a.ppo_mini_batch_size, a.ppo_micro_batch_size_per_gpu) == (1e-6, 128, 4)
    assert (a.use_kl_loss, a.kl_loss_coef, a.kl_loss_type, a.entropy_coeff) == (True, 0.01, "low_var_kl", 0)
    assert a.use_dynamic_bsz and a.ppo_max_token_len_per_gpu == 5120 and a.freeze_vision_tower
    assert a.megatron.tensor_model_parallel_size == cfg.actor_rollout_ref.ref.megatron.tensor_model_parallel_size == 2
    assert (r.n, r.tensor_model_parallel_size, r.gpu_memory_utilization) == (5, 1, 0.8)
    assert cfg.algorithm.adv_estimator == "grpo" and not cfg.algorithm.use_kl_in_reward and not cfg.critic.enable
    assert (cfg.trainer.total_epochs, cfg.trainer.test_freq, cfg.trainer.save_freq) == (15, 5, 20)
    assert get_reward_fn(DATA_SOURCE).__name__ == "geo3k_reward"
