#!/usr/bin/env bash
# A tour of megappo's stages around training, on real data and a real model. Training itself:
# `megappo train --config recipes/cpu/tiny_ppo.yaml` (the main CPU job), or step 3's command without --dry-run.
#   1. GSM8K jsonl -> train/test Parquet in verl's schema
#   2. a tiny random-weight Qwen2 model with a trained tokenizer, as a Hugging Face directory
#   3. validate the tiny PPO recipe against that data and model (config, layout, batch sizes, files)
#   4. Hugging Face -> megatron dist_checkpoint
#   5. verify the megatron model against transformers at TP1, and at TP2 over 2 gloo ranks with torchrun
#   6. megatron -> Hugging Face, and verify the exported directory against the megatron checkpoint
# GSM8K comes from $GSM8K_DIR when it is set (jsonl or the Hugging Face layout), else from the 64 + 16 problem
# sample in megappo/data/samples/gsm8k (its README says where the full set is).
# Outputs go to $OUT (default outputs/quickstart).
set -euo pipefail
if [ -n "${GSM8K_DIR:-}" ] && [ "${GSM8K_DIR#/}" = "$GSM8K_DIR" ]; then
  GSM8K_DIR=$PWD/$GSM8K_DIR  # relative to where the script was started, before the cd below
fi
cd "$(dirname "$0")/.."
OUT=${OUT:-outputs/quickstart}
GSM8K_DIR=${GSM8K_DIR:-megappo/data/samples/gsm8k}
export OMP_NUM_THREADS=1 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1 TRANSFORMERS_VERBOSITY=error
step() { printf '\n== %s\n' "$*"; }

if [ ! -f "$GSM8K_DIR/train.jsonl" ] && [ ! -d "$GSM8K_DIR/main" ]; then
  echo "GSM8K not found in $GSM8K_DIR: set GSM8K_DIR to a folder with train.jsonl/test.jsonl" \
       "(openai/grade-school-math) or the Hugging Face layout (main/train-*.parquet)" >&2
  exit 2
fi
rm -rf "$OUT" && mkdir -p "$OUT"

step "1/6 GSM8K -> Parquet"
megappo data gsm8k --input "$GSM8K_DIR" --out "$OUT/data"

step "2/6 tiny Qwen2 (random weights, trained tokenizer)"
python -m megappo.testing model --family qwen2 --out "$OUT/hf"

step "3/6 validate the tiny PPO recipe against this data and model"
megappo train --config recipes/gsm8k/tiny_cpu.yaml --dry-run \
  actor_rollout_ref.model.path="$OUT/hf" data.train_files="$OUT/data/train.parquet" \
  data.val_files="$OUT/data/test.parquet" trainer.default_local_dir="$OUT/ckpt"

step "4/6 Hugging Face -> megatron"
megappo convert hf-to-mcore --hf "$OUT/hf" --out "$OUT/mcore"

step "5/6 verify against transformers: TP1, then TP2 on 2 gloo ranks"
megappo convert verify --hf "$OUT/hf" --mcore "$OUT/mcore"
launch/torchrun.sh --nproc-per-node 2 convert verify --hf "$OUT/hf" --mcore "$OUT/mcore" --tp 2

step "6/6 megatron -> Hugging Face, verified against the megatron checkpoint"
megappo convert mcore-to-hf --mcore "$OUT/mcore" --out "$OUT/hf_export"
megappo convert verify --hf "$OUT/hf_export" --mcore "$OUT/mcore"

printf '\nquickstart finished: outputs in %s\n' "$OUT"
