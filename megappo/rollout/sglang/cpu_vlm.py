"""Launch SGLang's server for a Qwen2-VL / Qwen2.5-VL model on CPU (run in the server's own python, not megappo's):

    python sglang/cpu_vlm.py --model-path DIR ...   (the arguments of `python -m sglang.launch_server`)

On CPU, SGLang's Qwen-VL image processor module (`sglang.srt.multimodal.processors.qwen_vl`) also imports the
Qwen3.5 model, which at import time looks up `torch.ops.sgl_kernel.fused_sigmoid_mul_cpu` and other `*_cpu` kernels
of the real sgl_kernel package; the CPU environment has only megappo's stand-in package (tools/sglang/
sgl_kernel_stub.py), so the lookup fails, the processor module is skipped, and the server refuses every
Qwen2(.5)-VL model ("No processor registered for architecture"). Here such a lookup answers a stand-in that raises
NotImplementedError when called: Qwen2(.5)-VL never calls them (its layers fall back to native torch), so the
server serves it, with the same tokens and log-probs as the in-process engine (tests/e2e/test_sglang_vlm.py).
Only vision-language models are launched this way, so text models keep SGLang's own import behaviour.

Standard library and torch only; its directory is not put on sys.path (megappo's module names must not shadow the
server's).
"""
import runpy
import sys


def install_cpu_op_standins() -> None:
    import torch._ops

    namespace = torch._ops._OpNamespace
    if getattr(namespace.__getattr__, "_megappo_standin", False):
        return
    real = namespace.__getattr__

    def lookup(self, name):
        try:
            return real(self, name)
        except AttributeError:
            if self.name != "sgl_kernel" or not name.endswith("_cpu"):
                raise

            def standin(*args, **kwargs):
                raise NotImplementedError(f"torch.ops.sgl_kernel.{name} is a stand-in (no sgl_kernel CPU kernels "
                                          "in this environment)")
            return standin

    lookup._megappo_standin = True
    namespace.__getattr__ = lookup


if __name__ == "__main__":
    install_cpu_op_standins()
    sys.argv = ["sglang.launch_server", *sys.argv[1:]]
    # alter_sys=False: sys.modules["__main__"] stays the launcher, which SGLang's spawned children run first
    runpy.run_module("sglang.launch_server", run_name="__main__", alter_sys=False)
