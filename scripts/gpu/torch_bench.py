#!/usr/bin/env python3
"""PyTorch/transformers on the same GPU, for the table kvmesh's bench-engine
prints next to it (scripts/gpu/run.sh): a Llama of the shape a config.json
gives (scripts/gpu/shapes/), weights drawn at random in the given dtype,
eager transformers as a user runs it (no compile, the default attention).

Measures, with CUDA events after a warm-up, the median of --repeats runs:
  - prefill: one sequence of --prompt-tokens tokens, tokens per second;
  - decode: for each batch size, a --context-tokens prompt per sequence,
    then --decode-tokens steps of one token each with the KV cache,
    aggregate tokens per second.
Prints one JSON object (the last line) and a table before it.

Runs on the GPU machine's own python3 (torch and transformers are there);
nothing is installed.
"""
import argparse
import json
import statistics

import torch
from transformers import LlamaConfig, LlamaForCausalLM


def timed(fn, repeats):
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", required=True)
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    ap.add_argument("--prompt-tokens", type=int, default=512)
    ap.add_argument("--context-tokens", type=int, default=32)
    ap.add_argument("--decode-tokens", type=int, default=32)
    ap.add_argument("--batch", default="1,16,64")
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()

    with open(args.config) as f:
        raw = json.load(f)
    dtype = getattr(torch, args.dtype)
    if "rope_scaling" in raw and "rope_parameters" not in raw:
        # transformers 5 reads RoPE settings from rope_parameters.
        raw["rope_parameters"] = {**raw["rope_scaling"], "rope_theta": raw.get("rope_theta", 10000.0)}
    elif "rope_parameters" not in raw:
        raw["rope_parameters"] = {"rope_type": "default", "rope_theta": raw.get("rope_theta", 10000.0)}
    config = LlamaConfig(**{k: v for k, v in raw.items() if k not in ("architectures", "torch_dtype")})
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = LlamaForCausalLM(config).to(dtype).eval()
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    vocab = config.vocab_size
    gen = torch.Generator(device="cuda").manual_seed(1)

    def ids(batch, n):
        return torch.randint(3, min(vocab, 30000), (batch, n), device="cuda", generator=gen)

    with torch.inference_mode():
        prompt = ids(1, args.prompt_tokens)
        model(prompt)  # warm-up
        t = timed(lambda: model(prompt), args.repeats)
        prefill = args.prompt_tokens / t

        decode = []
        for b in [int(x) for x in args.batch.split(",")]:
            def run():
                out = model(ids(b, args.context_tokens), use_cache=True)
                past = out.past_key_values
                nxt = out.logits[:, -1:].argmax(-1)
                for _ in range(args.decode_tokens):
                    out = model(nxt, past_key_values=past, use_cache=True)
                    past = out.past_key_values
                    nxt = out.logits[:, -1:].argmax(-1)

            run()  # warm-up
            # The context's prefill is timed separately and taken out.
            ctx = timed(lambda: model(ids(b, args.context_tokens), use_cache=True), args.repeats)
            total = timed(run, args.repeats)
            decode.append({"batch": b, "tokens_per_s": b * args.decode_tokens / max(total - ctx, 1e-9)})

    print(f"transformers {torch.__version__} / {args.dtype} on {torch.cuda.get_device_name()}: {args.config}")
    print(f"{'measurement':<28} {'tokens/s':>12}")
    print(f"{'prefill ' + str(args.prompt_tokens) + ' tokens':<28} {prefill:>12.1f}")
    for d in decode:
        print(f"{'decode batch ' + str(d['batch']) + ' (aggregate)':<28} {d['tokens_per_s']:>12.1f}")
    print(json.dumps({
        "engine": "transformers",
        "dtype": args.dtype,
        "weight_bytes": weight_bytes,
        "prefill_tokens": args.prompt_tokens,
        "prefill_tokens_per_s": round(prefill, 1),
        "decode": [{"batch": d["batch"], "tokens_per_s": round(d["tokens_per_s"], 1)} for d in decode],
    }))


if __name__ == "__main__":
    main()
