"""Cost of the images in vision-language RL: the Qwen2.5-VL actor against the text-only model of the same LM size.

Random-weight models (no download), fp32, CPU, one torch thread. A batch of --batch rows, each one image of
--image x --image pixels (through the real Qwen2-VL image processor) between --prompt text tokens, plus --response
tokens; the text-only run has the same token count with text in place of the image tokens.

1. Actor forward + backward (megatron-core, TP1, `megappo.kinds.build.build_model` as the trainer builds it):
   the VLMModel with its vision tower frozen (the recipe's default: backward stops before the tower) and unfrozen,
   against a GPTModel of the same LM (a Qwen2 config with the VL model's text dims). Images/s and tokens/s.
2. Where the vision tower's forward time goes: patch embedding, window-attention blocks, full-attention blocks,
   patch merger, and the rest (2-D rotary angles, window order, segment boundaries), by timers around each module.
   The blocks attend per segment (megatron's packed THD format: per window, or per image in full-attention blocks),
   so a window block's attention costs sum(L^2) over its windows, not N^2 over the batch's N patches; windows of
   equal length run as one batched SDPA call (--sdpa-per-segment: one call per window, to compare).
3. Generation: transformers' Qwen2_5_VLForConditionalGeneration.generate against Qwen2ForCausalLM.generate of the
   same LM, greedy, exactly --response new tokens. megappo's in-process engine (rollout.name=hf) runs these same
   transformers models with its own KV-cached sampling loop, so this is its cost per image and per token.

    python tools/bench/bench_vlm.py                  # tiny (< 2 min on one thread)
    python tools/bench/bench_vlm.py --size small     # LM hidden 512 x 8 layers, ViT 256 x 8 blocks, 448 px images
    python tools/bench/bench_vlm.py --size 3b-shape  # Qwen2.5-VL-3B's ViT and LM widths, 4 layers each (slow on CPU)
"""
from __future__ import annotations

import argparse
import time
import warnings
from collections import defaultdict

import torch

# (LM text dims, ViT dims, image pixels): window 112 px and full attention every 4th block as in Qwen2.5-VL
SIZES = {
    "tiny": (dict(hidden_size=128, intermediate_size=256, num_hidden_layers=4, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=4096),
             dict(depth=4, hidden_size=64, intermediate_size=128, num_heads=2, fullatt_block_indexes=[1, 3]), 224),
    "small": (dict(hidden_size=512, intermediate_size=1536, num_hidden_layers=8, num_attention_heads=8,
                   num_key_value_heads=2, vocab_size=16384),
              dict(depth=8, hidden_size=256, intermediate_size=768, num_heads=4, fullatt_block_indexes=[3, 7]), 448),
    "3b-shape": (dict(hidden_size=2048, intermediate_size=11008, num_hidden_layers=4, num_attention_heads=16,
                      num_key_value_heads=2, vocab_size=32768),
                 dict(depth=4, hidden_size=1280, intermediate_size=3420, num_heads=16, fullatt_block_indexes=[3]),
                 448),
}
IMAGE_TOKEN, VIDEO_TOKEN, VISION_START, VISION_END = 3, 4, 5, 6  # low ids, valid in every size's vocabulary
warnings.filterwarnings("ignore", message=".*(Apex (is|are) not installed|full scope is deprecated).*")


def configs(size: str):
    """(Qwen2_5_VLConfig, Qwen2Config of the same LM)."""
    import transformers

    text, vision, _ = SIZES[size]
    rope = dict(rope_type="default", rope_theta=1000000.0)
    head_dim = text["hidden_size"] // text["num_attention_heads"]
    t = dict(text, max_position_embeddings=4096, rms_norm_eps=1e-6, initializer_range=0.02, bos_token_id=1,
             eos_token_id=2)  # Qwen's own ids lie outside the small vocabularies
    # mrope splits the head_dim/2 rotary frequencies over (t, h, w) as Qwen2.5-VL does: 16/24/24 of 64
    mrope = [head_dim // 8, (head_dim // 2 - head_dim // 8) // 2, (head_dim // 2 - head_dim // 8) // 2]
    vl = transformers.Qwen2_5_VLConfig(
        text_config=dict(t, rope_parameters=dict(rope, mrope_section=mrope)),
        vision_config=dict(vision, out_hidden_size=text["hidden_size"], patch_size=14, spatial_merge_size=2,
                           temporal_patch_size=2, window_size=112, initializer_range=0.02),
        image_token_id=IMAGE_TOKEN, video_token_id=VIDEO_TOKEN, vision_start_token_id=VISION_START,
        vision_end_token_id=VISION_END, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)
    lm = transformers.Qwen2Config(**t, rope_parameters=rope, tie_word_embeddings=False)
    return vl, lm


def batch(vl_config, args) -> dict[str, torch.Tensor]:
    """B rows of [prompt/2 text, vision_start, image tokens, vision_end, prompt/2 text, response], no padding."""
    import numpy as np
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    rng = np.random.default_rng(0)
    side = args.image
    proc = Qwen2VLImageProcessorPil(patch_size=14, merge_size=2, temporal_patch_size=2, min_pixels=56 * 56,
                                    max_pixels=side * side)
    out = proc(images=[rng.integers(0, 256, (side, side, 3), dtype=np.uint8) for _ in range(args.batch)],
               return_tensors="pt")
    grid = out["image_grid_thw"]
    n_img = int(grid[0].prod()) // 4
    vocab = vl_config.text_config.vocab_size
    g = torch.Generator().manual_seed(0)
    text = lambda n: torch.randint(16, vocab, (args.batch, n), generator=g)  # noqa: E731
    half = args.prompt // 2
    ids = torch.cat([text(half), torch.full((args.batch, 1), VISION_START),
                     torch.full((args.batch, n_img), IMAGE_TOKEN), torch.full((args.batch, 1), VISION_END),
                     text(args.prompt - half), text(args.response)], dim=1)
    return {"input_ids": ids, "text_ids": torch.where(ids < 16, text(ids.shape[1]), ids),
            "pixel_values": out["pixel_values"], "image_grid_thw": grid, "image_tokens": n_img,
            "prompt_len": ids.shape[1] - args.response}


def _timed(fn, repeats: int) -> float:
    """The fastest of `repeats` runs after a warm-up: on a shared machine the minimum is the least noisy."""
    fn()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def _vision_breakdown(vision, pixel_values, grid, repeats: int) -> dict[str, float]:
    """Seconds per forward of each part of the tower, by perf_counter hooks around its modules."""
    spent: dict[str, float] = defaultdict(float)
    start: dict[str, float] = {}
    a = vision.args
    parts = [("patch embed", vision.patch_embed.proj), ("merger", vision.merger.ln_q),
             ("merger", vision.merger.projection)]
    parts += [("full-attention blocks" if i in a.fullatt_block_indexes or not a.window_size
               else "window-attention blocks", b) for i, b in enumerate(vision.blocks)]
    handles = []
    for name, module in parts:
        key = f"{name}#{id(module)}"
        handles.append(module.register_forward_pre_hook(lambda m, i, k=key: start.__setitem__(k, time.perf_counter())))
        handles.append(module.register_forward_hook(
            lambda m, i, o, k=key, n=name: spent.__setitem__(n, spent[n] + time.perf_counter() - start[k])))
    with torch.no_grad():
        vision(pixel_values, grid)  # warm-up
        spent.clear()
        t0 = time.perf_counter()
        for _ in range(repeats):
            vision(pixel_values, grid)
        total = (time.perf_counter() - t0) / repeats
    for h in handles:
        h.remove()
    out = {k: v / repeats for k, v in spent.items()}
    out["other (rotary, window order, bounds)"] = total - sum(out.values())
    out["total"] = total
    return out


def _train_job(rank: int, world_size: int, args) -> dict:
    from megappo.kinds.build import build_model
    from megappo.parallel import destroy_parallel, init_parallel
    from megappo.platform import detect_platform
    from megappo.platform.layout import ParallelLayout

    torch.set_num_threads(1)
    if args.sdpa_per_segment:
        from megappo.models.attention import SDPAttention

        SDPAttention.group_equal_lengths = False
    plat = detect_platform()
    ps = init_parallel(ParallelLayout(), plat, seed=0)
    vl_cfg, lm_cfg = configs(args.size)
    b = batch(vl_cfg, args)
    ids, text_ids = b["input_ids"], b["text_ids"]
    positions = torch.arange(ids.shape[1]).expand_as(ids)
    res = {"tokens": ids.numel(), "image_tokens": b["image_tokens"], "patches": int(b["pixel_values"].shape[0])}

    def step(model, **kw):
        def run():
            model.zero_grad(set_to_none=True)
            logits = model(**kw)  # [B, T, V] (megatron's GPTModel returns batch-first logits)
            logits.float().logsumexp(-1).mean().backward()
        return run

    for name, freeze in (("vlm frozen ViT", True), ("vlm trained ViT", False)):
        m = build_model(vl_cfg.to_dict(), "actor", ps, plat, freeze_vision_tower=freeze)[0].train()
        res[name] = _timed(step(m, input_ids=ids, position_ids=None, attention_mask=None,
                                pixel_values=b["pixel_values"], image_grid_thw=b["image_grid_thw"]), args.steps)
        if freeze:
            res["breakdown"] = _vision_breakdown(m.vision_model, b["pixel_values"], b["image_grid_thw"], args.steps)
            res["params_vision"] = sum(p.numel() for p in m.vision_model.parameters())
            res["params_lm"] = sum(p.numel() for p in m.language_model.parameters())
        del m
    gpt = build_model(lm_cfg.to_dict(), "actor", ps, plat)[0].train()
    res["text-only GPTModel"] = _timed(step(gpt, input_ids=text_ids, position_ids=positions, attention_mask=None),
                                       args.steps)
    destroy_parallel()
    return res


def generation(args) -> dict:
    import transformers

    torch.set_num_threads(1)
    vl_cfg, lm_cfg = configs(args.size)
    b = batch(vl_cfg, args)
    prompt = b["input_ids"][:, :b["prompt_len"]]
    text_prompt = b["text_ids"][:, :b["prompt_len"]]
    torch.manual_seed(0)
    vl = transformers.Qwen2_5_VLForConditionalGeneration(vl_cfg).eval()
    lm = transformers.Qwen2ForCausalLM(lm_cfg).eval()
    kw = dict(max_new_tokens=args.response, min_new_tokens=args.response, do_sample=False, pad_token_id=0)
    mask = torch.ones_like(prompt)
    with torch.no_grad():
        t_vl = _timed(lambda: vl.generate(input_ids=prompt, attention_mask=mask, pixel_values=b["pixel_values"],
                                          image_grid_thw=b["image_grid_thw"], **kw), args.steps)
        t_lm = _timed(lambda: lm.generate(input_ids=text_prompt, attention_mask=mask, **kw), args.steps)
    return {"Qwen2_5_VLForConditionalGeneration": t_vl, "Qwen2ForCausalLM (text)": t_lm}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", choices=sorted(SIZES), default="tiny")
    ap.add_argument("--batch", type=int, default=4, help="rows, one image each")
    ap.add_argument("--image", type=int, default=None, help="image side in pixels (default: the size's)")
    ap.add_argument("--prompt", type=int, default=64, help="text tokens of a prompt besides the image")
    ap.add_argument("--response", type=int, default=64, help="response tokens (trained on / generated)")
    ap.add_argument("--steps", type=int, default=3, help="timed repeats after one warm-up (the fastest counts)")
    ap.add_argument("--sdpa-per-segment", action="store_true",
                    help="one SDPA call per window / image instead of batching those of equal length")
    args = ap.parse_args()
    args.image = args.image or SIZES[args.size][2]
    torch.set_num_threads(1)
    from megappo.testing.dist import run_distributed

    res = run_distributed(_train_job, 1, args, timeout=1800)[0]
    per_image = res["image_tokens"]
    print(f"size {args.size}: batch {args.batch} x ({args.prompt} text + {per_image + 2} image tokens "
          f"[{args.image}x{args.image} px, {res['patches'] // args.batch} patches] + {args.response} response) = "
          f"{res['tokens']} tokens; LM {res['params_lm']:,} params, ViT {res['params_vision']:,}; fp32 CPU, 1 thread")
    print(f"\nactor forward + backward (TP1 megatron-core)\n{'model':<22}{'s/step':>9}{'images/s':>10}{'tokens/s':>10}"
          f"{'vs text':>9}")
    base = res["text-only GPTModel"]
    for name in ("text-only GPTModel", "vlm frozen ViT", "vlm trained ViT"):
        t = res[name]
        images = f"{args.batch / t:>10.1f}" if name != "text-only GPTModel" else f"{'-':>10}"
        print(f"{name:<22}{t:>9.3f}{images}{res['tokens'] / t:>10.0f}{t / base:>8.2f}x")
    print(f"\nvision tower forward, {args.batch} images ({res['patches']} patches)\n{'part':<38}{'ms':>9}{'share':>8}")
    bd = res["breakdown"]
    for name, t in sorted(bd.items(), key=lambda kv: (kv[0] == "total", -kv[1])):
        print(f"{name:<38}{t * 1e3:>9.1f}{t / bd['total']:>8.0%}")
    gen = generation(args)
    print(f"\ngeneration (transformers generate, greedy, {args.response} new tokens/row; the hf engine's models)\n"
          f"{'model':<36}{'s':>8}{'images/s':>10}{'tokens/s':>10}")
    for name, t in gen.items():
        images = f"{args.batch / t:>10.2f}" if "VL" in name else f"{'-':>10}"
        print(f"{name:<36}{t:>8.2f}{images}{args.batch * args.response / t:>10.0f}")


if __name__ == "__main__":
    main()
