#!/usr/bin/env python
"""Check that a Hugging Face directory (e.g. one written by `megappo convert mcore-to-hf`) loads into a real
SGLang server as-is and generates the same greedy tokens as `transformers`.

What it does: starts `python -m sglang.launch_server` on --hf (fp32), waits for GET /health, sends a batch of
a few fixed prompts (random token ids from a seeded generator, within the vocab) to POST /generate with
temperature 0, ignore_eos and return_logprob, runs `transformers` greedy generation (model.generate,
do_sample=False, fp32, each prompt unpadded, EOS disabled) on the same ids in this process, and compares the
output token ids and the chosen-token logprobs. Prints one line per prompt and
`sglang_check: N/N prompts identical, max |logprob diff| = X`; exits 1 on any token mismatch (or a logprob
difference above --logprob-tol), 2 if the server did not come up. The server is always stopped.

On a CUDA machine it uses SGLang's default GPU backends; otherwise the CPU flags
(SGLANG_USE_CPU_ENGINE=1 --device cpu --attention-backend torch_native).

Run it with the python of a venv that has SGLang (plain `pip install sglang` on a GPU machine). On a CPU-only
machine without AMX, SGLang needs: torch 2.13.0+cpu, `pip install --no-deps sglang==0.5.23` plus its pure-Python
dependencies and triton, a stand-in `sgl_kernel` package and a torchvision import patch; see
tools/sglang/install_cpu.sh, which builds such a venv.

    python tools/sglang/check.py --hf /tmp/export [--port 30111] [--max-new-tokens 16]
"""
import argparse
import os
import sys
import threading
import time

# megappo's server launcher (standard library only): importable from SGLang's environment without installing megappo
sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..")))
from megappo.rollout.serving.http_client import http_json  # noqa: E402
from megappo.rollout.sglang.server import SGLangServer  # noqa: E402

PROMPT_LENGTHS = (5, 8, 13, 3)


def reference(hf_dir, prompts, max_new_tokens):
    """transformers greedy ids and chosen-token logprobs, per prompt, unpadded, fp32 on CPU."""
    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig

    torch.set_num_threads(1)
    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None  # None in gen_cfg alone falls back to the model's EOS
    gen_cfg = GenerationConfig(do_sample=False, max_new_tokens=max_new_tokens, min_new_tokens=0,
                               eos_token_id=None, pad_token_id=model.config.pad_token_id or 0,
                               bos_token_id=None, return_dict_in_generate=True, output_logits=True)
    out = []
    with torch.no_grad():
        for ids in prompts:
            res = model.generate(torch.tensor([ids]), generation_config=gen_cfg)
            new = res.sequences[0, len(ids):].tolist()
            assert len(new) == max_new_tokens, f"transformers stopped early: {new}"
            logps = [torch.log_softmax(lg[0].float(), -1)[t].item() for lg, t in zip(res.logits, new)]
            out.append((new, logps))
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--hf", required=True, help="Hugging Face model directory")
    ap.add_argument("--port", type=int, default=0, help="server port (default: a free one)")
    ap.add_argument("--max-new-tokens", type=int, default=16)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--startup-timeout", type=float, default=600)
    ap.add_argument("--logprob-tol", type=float, default=1e-3, help="fail above this |logprob diff|")
    ap.add_argument("--skip-tokenizer-init", action="store_true", help="pass --skip-tokenizer-init")
    args = ap.parse_args()
    args.hf = os.path.abspath(args.hf)

    import torch
    from transformers import AutoConfig

    vocab = AutoConfig.from_pretrained(args.hf).vocab_size
    gen = torch.Generator().manual_seed(args.seed)
    prompts = [torch.randint(0, vocab, (n,), generator=gen).tolist() for n in PROMPT_LENGTHS]
    extra = ["--skip-tokenizer-init"] if args.skip_tokenizer_init else []
    server = SGLangServer(args.hf, python=sys.executable, port=args.port or None, cuda=torch.cuda.is_available(),
                          extra_args=extra)
    print("starting:", " ".join(server.cmd), flush=True)
    t0 = time.time()
    try:
        started: dict = {}
        # the server starts while transformers computes the reference
        thread = threading.Thread(target=lambda: started.update(up=_start(server, args.startup_timeout)))
        thread.start()
        ref = reference(args.hf, prompts, args.max_new_tokens)
        print(f"transformers reference: {time.time() - t0:.1f} s", flush=True)
        thread.join()
        if isinstance(started.get("up"), Exception):
            print(started["up"], file=sys.stderr)
            print("sglang_check: server did not become healthy", file=sys.stderr)
            return 2
        print(f"server healthy after {started['up']:.1f} s", flush=True)
        sp = {"max_new_tokens": args.max_new_tokens, "temperature": 0, "ignore_eos": True}
        t1 = time.time()
        got = http_json(server.url + "/generate", {"input_ids": prompts, "sampling_params": sp,
                                                    "return_logprob": True})
        print(f"sglang generate: {time.time() - t1:.2f} s", flush=True)
    finally:
        server.stop(keep_log=True)  # deleted below if the check passes

    same, max_diff = 0, 0.0
    for i, (ids, (ref_ids, ref_lp), item) in enumerate(zip(prompts, ref, got)):
        out_ids = item["output_ids"]
        lps = item["meta_info"]["output_token_logprobs"]
        ok = out_ids == ref_ids
        same += ok
        n = min(len(ref_lp), len(lps))
        diff = max((abs(lps[k][0] - ref_lp[k]) for k in range(n) if lps[k][1] == ref_ids[k]), default=0.0)
        max_diff = max(max_diff, diff)
        print(f"prompt {i} (len {len(ids)}): {'identical' if ok else 'MISMATCH'} "
              f"max |logprob diff| = {diff:.3g}")
        if not ok:
            print(f"  sglang:       {out_ids}\n  transformers: {ref_ids}")
    print(f"sglang_check: {same}/{len(prompts)} prompts identical, max |logprob diff| = {max_diff:.3g}")
    ok = same == len(prompts) and max_diff <= args.logprob_tol
    if ok:
        os.unlink(server.log.name)
    else:
        print(f"server log: {server.log.name}")
    return 0 if ok else 1


def _start(server, timeout):
    try:
        return server.start(timeout)
    except RuntimeError as e:
        return e


if __name__ == "__main__":
    sys.exit(main())
