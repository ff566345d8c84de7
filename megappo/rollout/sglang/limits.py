"""What SGLang cannot do, as measured, for the config's checks and the servers' start (standard library only)."""

# measured with SGLang 0.5.23's CPU backend (--enable-lora, any --lora-backend): the server dies loading the LoRA
# layers, whose wrappers allocate pinned host buffers (torch.tensor(..., pin_memory=True) in sglang/srt/lora/layers.py)
SGLANG_CPU_LORA = ("SGLang's CPU backend cannot serve LoRA adapters (SGLang 0.5.23 dies at start with --enable-lora: "
                   "'pin_memory=True requires a CUDA or other accelerator backend'); use "
                   "actor_rollout_ref.rollout.lora_sync=merged (the default) on CPU")
