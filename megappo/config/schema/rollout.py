"""The configuration tree's `actor_rollout_ref.rollout` section (importable from `megappo.config.schema`)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal, Optional

from megappo.config.fields import DType


@dataclass
class ValKwargsConfig:
    """Sampling used for validation generations: greedy by default, so validation scores are repeatable."""

    n: int = 1
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = -1
    do_sample: bool = False


@dataclass
class AgentConfig:
    """Episodes (verl's `rollout.agent`; megappo/envs/): each sample is an episode of its row's agent, named by the
    row's `agent_name` column, else default_agent_loop. An agent is an environment (`megappo.envs.base.Environment`:
    the model's turns and the environment's answers) or an agent program (a function that talks to megappo's
    OpenAI-compatible endpoint). Built in: tool_agent (multi_turn's tool loop) and guess_number; others are named in
    agent_loop_config_path. Episodes continue across a weight sync with async_training.partial_rollout."""

    default_agent_loop: Optional[str] = None  # None: tool_agent with multi_turn.enable, else single-turn sampling
    agent_loop_config_path: Optional[str] = None  # YAML list of {name, environment | agent, kwargs, ...}
    num_workers: int = 64  # environment steps or agent programs run at once
    step_timeout_s: Optional[float] = 60.0  # an environment step's deadline (past it the episode ends; None: none)
    # agent programs: an episode's deadline (past it its key is revoked and its sample made of what it recorded), and
    # where the OpenAI-compatible endpoint listens (loopback; port 0: a free one per holder)
    deadline_s: float = 300.0
    # agent programs run in threads of the holder, or each episode in a spawned process of its own (killed at its
    # deadline; an interpreter start per episode)
    backend: Literal["thread", "process"] = "thread"
    endpoint_host: str = "127.0.0.1"
    endpoint_port: int = 0
    # a failed episode (its agent program raised, passed deadline_s, returned something other than a reward or never
    # called; its environment's start or step raised or passed step_timeout_s) is the user's code failing, not
    # evidence about the policy. drop: left out of the loss, its group's statistics made without it (counted in
    # episodes/failed_fraction); zero_reward: trained on with reward 0 (the old behaviour); keep: trained on as it is
    on_failure: Literal["drop", "zero_reward", "keep"] = "drop"
    # stop the run when more than this fraction of a step's episodes fail for max_failure_steps steps in a row: a
    # broken agent or environment (null: never stop)
    max_failure_fraction: Optional[float] = 0.5
    max_failure_steps: int = 3
    # whose reward an episode gets when its agent program returned one and its data source also has a rule reward:
    # agent (the program's; the rule reward only where the program returned None) or rule (the rule reward always)
    reward_source: Literal["agent", "rule"] = "agent"


@dataclass
class MultiTurnConfig:
    """Multi-turn tool-calling rollouts (verl 0.9.1's `rollout.multi_turn`; megappo/multi_turn/env.py): the model
    writes a tool call (`format`), the trainer runs the tool and appends its answer as the chat template renders it,
    and the model goes on, until it answers without a call, response_length tokens are spent over all turns, or a
    turn limit is reached. Only the model's tokens are trained on (the tool answers' tokens are masked)."""

    enable: bool = False
    max_assistant_turns: Optional[int] = None  # None: no limit but response_length
    max_user_turns: Optional[int] = None  # tool rounds; None: no limit but response_length
    tool_config_path: Optional[str] = None  # YAML of verl's shape (megappo/multi_turn/tools.py)
    max_parallel_calls: int = 1  # tool calls of one assistant turn that are run (later ones are dropped)
    max_tool_response_length: int = 256  # characters of a tool answer the model reads
    tool_response_truncate_side: Literal["left", "middle", "right"] = "middle"
    format: Literal["hermes"] = "hermes"  # <tool_call>{"name": ..., "arguments": {...}}</tool_call> (Qwen2.5/3)
    # strict: check each trajectory's tokens against the chat template applied to its final messages
    # (multi_turn/template_mismatch_fraction); disable: skip the check
    tokenization_sanity_check_mode: Literal["strict", "disable"] = "strict"
    # the pool the tool calls run in (megappo/multi_turn/pool.py): thread, or ray (actors holding copies of the
    # tools; one past a deadline is replaced); calls at once; a call's deadline (None: the tool's own timeout_s
    # plus 5 s, or 60 s)
    tool_backend: Literal["thread", "ray"] = "thread"
    tool_workers: int = 32
    tool_timeout_s: Optional[float] = None
    # stop the run when the tool itself fails (raises, is not configured, its sandbox fails: tool/failure_fraction)
    # on more than this fraction of the calls for max_tool_failure_steps steps in a row: a broken tool or tool
    # config. The policy's own mistakes (failing code, bad arguments) never count: a model still learning makes
    # them (null: never stop)
    max_tool_failure_fraction: Optional[float] = 0.5
    max_tool_failure_steps: int = 3


@dataclass
class RolloutConfig:
    # The engine (megappo/rollout/registry.py): hf, megappo's in-process engine (works on CPU); sglang, SGLang
    # servers the trainer starts (or server_urls), shared by every data-parallel replica; vllm, vLLM servers or
    # vLLM's engine in the trainer's ranks (mode).
    name: str = "hf"
    # How the engine is deployed (verl's key): async, servers the trainer starts or reaches (sglang, vllm); sync,
    # inside the trainer's ranks (hf; vllm: its engine colocated, asleep between rollouts). None: the engine's own
    # (hf sync, sglang async, vllm async)
    mode: Optional[Literal["async", "sync"]] = None
    n: int = 1  # responses sampled per prompt
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1 (or 0): no top-k filtering
    do_sample: bool = True  # false: greedy decoding
    ignore_eos: bool = False  # keep generating past EOS up to response_length (throughput benchmarks)
    prompt_length: Optional[int] = None  # resolved: data.max_prompt_length
    response_length: Optional[int] = None  # resolved: data.max_response_length
    dtype: Optional[DType] = None  # resolved: actor_rollout_ref.model.dtype
    gpu_memory_utilization: float = 0.5  # fraction of GPU memory the engine may take (weights + KV cache)
    tensor_model_parallel_size: int = 1  # inference tensor parallel size of one engine replica
    max_num_batched_tokens: int = 8192  # engine's per-step token budget
    max_num_seqs: int = 1024  # engine's concurrent sequence limit
    max_model_len: Optional[int] = None  # None: prompt_length + response_length
    enforce_eager: bool = False  # vllm: no CUDA graphs (verl's default: graphs on)
    # release the KV cache while training, re-allocate before generating; the in-process hybrid engine (hf) of a
    # full-parameter actor also frees its weights from each step's rollout to its weight sync (sync mode)
    free_cache_engine: bool = True
    log_prob_micro_batch_size_per_gpu: Optional[int] = None  # old-log-prob recompute micro batch
    log_prob_use_dynamic_bsz: Optional[bool] = None  # resolved: actor.use_dynamic_bsz
    log_prob_max_token_len_per_gpu: Optional[int] = None  # resolved: actor.ppo_max_token_len_per_gpu
    engine_kwargs: dict[str, Any] = field(default_factory=dict)  # passed to the engine as-is (e.g. SGLang args)
    # servers (sglang, vllm mode async): URLs of running ones (http://host:port); empty: the trainer starts
    # servers_per_node per node
    server_urls: list[str] = field(default_factory=list)
    # sglang, started servers: how many each node's first rank starts (server i on GPUs i*tp .. i*tp+tp-1);
    # None: one per tensor_model_parallel_size GPUs of the node, one on a CPU node
    servers_per_node: Optional[int] = None
    # sglang: every health_check_interval_s the client has each server generate one token (`is_healthy`, timeout
    # health_check_timeout_s); a server that fails it, or a request, is restarted or dropped. The first wait is
    # server_start_timeout_s.
    health_check_interval_s: float = 30.0
    health_check_timeout_s: float = 5.0
    # sglang, started servers: a dead one is restarted before the next weight sync, which gives it the current
    # weights before it serves again; false: it is dropped (the others take its share)
    restart_failed_servers: bool = True
    # sglang: none: megappo spreads requests over the servers itself; sglang: through a real sglang-router that
    # the trainer starts in front of them (installed beside SGLang; router_python, default server_python)
    router: Literal["none", "sglang"] = "none"
    router_policy: Literal["round_robin", "cache_aware", "power_of_two", "random"] = "round_robin"
    router_python: Optional[str] = None
    server_python: Optional[str] = None  # servers: the python that has the engine (SGLang, vLLM); None: this one
    # sglang: the address a started server binds and is reached at; multi-node: this node's cluster address
    server_host: str = "127.0.0.1"
    api_key: Optional[str] = None  # servers: their API key; None: a random one per started server
    # sglang: a file whose first line is that key, read at start (keeps it off command lines and out of
    # --print-config); for servers started elsewhere (megappo rollout-server --api-key-file)
    api_key_file: Optional[str] = None
    server_start_timeout_s: float = 600.0  # sglang: longest wait for a started server (cold start, model load)
    request_timeout_s: float = 600.0  # sglang: HTTP timeout of one generation request
    sync_timeout_s: float = 60.0  # sglang: timeout of a weight-control call and of the weight group's collectives
    # sglang, distributed sync: the address the trainer's rendezvous store listens on (only there); None:
    # server_host (127.0.0.1 for local servers). Multi-node: an address of this node that the servers reach.
    weight_sync_master_address: Optional[str] = None
    # How the actor's weights reach the engine after each update. auto: in-process for hf, distributed for sglang.
    # distributed: one broadcast per bucket over a group of the trainer and every server's ranks (NCCL on GPU, gloo
    # on CPU); tensor: colocated servers take the tensors by handle (CUDA IPC; shared memory on CPU); disk: a
    # Hugging Face directory in weight_sync_dir that the servers reload (the directory must be visible to them).
    weight_sync: Literal["auto", "distributed", "tensor", "disk"] = "auto"
    # Tensors exported and sent at a time. The trainer keeps send buffers across syncs: distributed one bucket
    # (flattened, one broadcast each); tensor on CPU two buckets of shared memory (/dev/shm; in Docker use
    # --ipc=host or --shm-size).
    weight_sync_bucket_mb: int = 512
    weight_sync_dir: Optional[str] = None  # disk: where the export goes; None: <trainer.default_local_dir>/weight_sync
    # A LoRA actor's sync (megappo's key). merged: the adapted layers' merged weights (W + alpha/r * B A) through
    # weight_sync. adapter (sglang on GPU): a PEFT adapter directory in weight_sync_dir (visible to the servers) that
    # each server loads (/load_lora_adapter, the previous one unloaded) and every request names: rank-r tensors
    # instead of whole layers, the base stays as loaded. SGLang 0.5's CPU backend cannot serve LoRA (refused).
    lora_sync: Literal["merged", "adapter"] = "merged"
    # After every sync, compare each server's log-probs of fixed tokens with the trainer's and stop the run on a
    # mismatch larger than verify_sync_atol (None: 1e-3 in float32, 5e-2 in 16-bit dtypes). Costs one forward.
    verify_sync: bool = False
    verify_sync_atol: Optional[float] = None
    # MoE router replay (verl's name): the engine returns each token's routed experts with its samples (hf: the
    # in-process engine's record; sglang: `return_routed_experts`, servers started with
    # --enable-return-routed-experts); actor.megatron.router_replay.mode=R3 replays them in the trainer
    enable_rollout_routing_replay: bool = False
    val_kwargs: ValKwargsConfig = field(default_factory=ValKwargsConfig)
    multi_turn: MultiTurnConfig = field(default_factory=MultiTurnConfig)
    agent: AgentConfig = field(default_factory=AgentConfig)


@dataclass
class InferenceConfig:
    """An engine that serves a fixed model beside the policy's (a distillation teacher, a generative judge): the
    rollout engines' machinery (`megappo.rollout.fixed`), a fleet of its own whose weights no sync touches. Every
    unset key is the policy's rollout's (actor_rollout_ref.rollout); the server keys not named here (server_python,
    timeouts, health checks, router) are always the policy's."""

    name: Optional[str] = None  # a rollout engine (hf, sglang, vllm); None: actor_rollout_ref.rollout.name
    # sglang: URLs of running servers that serve this model; empty: the trainer starts its own (servers_per_node)
    server_urls: list[str] = field(default_factory=list)
    servers_per_node: Optional[int] = None  # None: one per tensor_model_parallel_size GPUs (one on a CPU node)
    tensor_model_parallel_size: Optional[int] = None  # None: the rollout's
    max_num_seqs: Optional[int] = None  # sequences per forward batch; None: the rollout's
    engine_kwargs: dict[str, Any] = field(default_factory=dict)  # the engine's own arguments, as the rollout's
    # hf: run the model in the trainer's process (true) or in a process of its own that works while the trainer
    # does (false: async modes overlap it with training); None: actor_rollout_ref.hybrid_engine
    hybrid_engine: Optional[bool] = None
