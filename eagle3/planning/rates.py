"""The rates the planner turns token counts into seconds with, and the data facts it estimates tokens from.

CPU rates are SmolLM2-135M's, measured on a 2-core host and scaled by the target's size and by this host's
measured speed (eagle3/probe.py); GPU rates are FLOP/s per GPU of measured runs. Each was measured with the
command beside it in benchmarks/RESULTS.md, "Planning rates of the preflight": re-measure there, change here.
"""
from __future__ import annotations

# the bundled ShareGPT file (where prepare has not run and no sample of the source was timed)
SHAREGPT_RECORDS = 17_671     # complete records of the bundled (truncated) file
SHAREGPT_KEPT = 0.95          # share that survives normalization (measured on the first 2,000)
SHAREGPT_MEAN_TOKENS = 1_360  # mean tokens of a kept conversation, SmolLM2 template, before truncation
SAMPLE_RECORDS = 1000  # prepare's stream on a 2-core host: ~7 s for 1,000 ShareGPT records, ~2 s for the demo's 400
MTBENCH_QUESTIONS = 80  # two turns each
EVAL_PROMPT_TOKENS = 400  # the longest second-turn prompt of MT-Bench without its first answer (SmolLM2 template)

HEADROOM = 1.10               # 10% slack on every disk estimate

# GPU: FLOPs / (devices x FLOP/s per GPU), the FLOP/s those of measured runs (a datasheet peak overstated
# extraction 22x: Kimi-K2.5 planned at 7m36s, measured at 2h47m).
# GPU extraction (vLLM), 2 x active parameters x tok/s / GPUs of a measured run: MoE from Kimi-K2.5 (INT4, 32B
# active) at TP 8 on an 8 x H200 host, ~2,280 tok/s (18.2 TFLOP/s per GPU); dense from the hf extraction stage
# on a Llama-3.2-1B-shaped model on one H200, 22,576 tok/s (`benchmarks.gpu_check`, 56 TFLOP/s per GPU).
GPU_EXTRACT_FLOPS = {"moe": 18.2e12, "dense": 56e12}
# GPU training: `benchmarks.gpu_check`'s trainer on one H200 at Llama-3.1-8B draft shapes (k=7, draft vocab 32k,
# 8192-token packs, bf16): 8,204 tok/s, i.e. the planner's FLOPs per trained token x 8,204 = 138 TFLOP/s.
GPU_TRAIN_FLOPS = 138e12
VLLM_START_S = 120                # vLLM (planning assumptions): an engine's start
VLLM_DECODE_TOK_PER_S = 2000      # batched decoding per engine

# CPU, SmolLM2-135M on 2 threads
SMOLLM2_PARAMS = 135e6
PREPARE_CONV_PER_S = 490          # prepare, conversations/s (where no sample of the source was timed)
EXTRACT_CPU_TOK_PER_S = 570       # hf extraction, 2 threads, packed linears
# ... computing in bf16 on a CPU with bf16 units (extract.dtype: fast): the whole stage ran 1.48x its fp32 rate on
# the reference kind (2-core AMD EPYC, avx512_bf16; both in one process, benchmarks/speed/extract.py --dtypes)
EXTRACT_CPU_BF16_TOK_PER_S = 840
# training, k=3, 2048-token packs, 2 threads: the first epoch (it computes the target's full-vocab argmax where a
# loss reads it) and later ones (the argmax cached per sample); plus torchrun's start and each validation's
# forward over the val split (half a training step's cost per token: 7 s for the demo's 8.3k val tokens)
TRAIN_CPU_TOK_PER_S = (550, 600)
# ... under bf16 autocast on a CPU with bf16 units: the whole trainer at demo length on the reference kind (2-core
# AMD EPYC, avx512_bf16) ran the first epoch 1.34x and later ones 1.43x its fp32 rate (AdamW, each run alone)
TRAIN_CPU_BF16_TOK_PER_S = (737, 858)
# Muon's step against AdamW's (Newton-Schulz on each matrix): 1.04x on the reference kind, 1.17x on a 2-core Xeon
MUON_STEP_COST = 1.1
TRAIN_CPU_START_S = 15
EVAL_CPU_TOK_PER_S = 13.5         # live eval (hf, one thread, k=3), generated tok/s counting both passes
EVAL_CPU_START_S = 16             # the eval's fixed part: the target and the draft loaded, the replay itself
REPLAY_CPU_DECODE_TOK_PER_S = 137  # replay: the target's greedy answers, batched (turns x max_new per s)
REPLAY_CPU_FORWARD_TOK_PER_S = 715  # replay: their aux states, one forward on packed linears (2 x turns x max_new)
# the trainer's small replay set (val prompts answered greedily, batched): a fixed start (a process, the weights), each
# prompt's prefill and aux states, and decoding bound by its steps (~10 rows at once in the demo)
REPLAY_SET_CPU_START_S = 10
REPLAY_SET_CPU_S_PER_PROMPT = 1.2
REPLAY_SET_CPU_STEPS_PER_S = 16
REGEN_CPU_TOK_PER_S = 33          # regenerate (hf, batch 32, 2 threads), generated tok/s with the prompts' prefill

PROBE_OVER_S = 120  # runs estimated shorter than this at the reference rates are not worth a probe's seconds
