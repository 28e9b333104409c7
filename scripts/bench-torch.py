#!/usr/bin/env python3
"""PyTorch's figure for `kvreplay bench capture`: HF transformers running the
same GGUF model in float32 on the CPU, a prompt of the same length prefilled
in one forward call, then greedy decode with its KV cache.

    .venv-hf/bin/python scripts/bench-torch.py --prompt-tokens 2048 --decode 64 --reps 3

(.venv-hf/ is made by scripts/test-python-hf.sh.) Prints the median prefill
and decode tokens per second over the repetitions, like `kvreplay bench
capture`, so the two can run one after the other. The prompt's ids are
fixed filler (throughput does not depend on the text); the model is the
README's default unless --model names another GGUF file. No trace is
written: this is the bar, the model alone.
"""

import argparse
import pathlib
import statistics
import time

import torch
import transformers


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="models/SmolLM2-135M-Instruct.Q4_1.gguf")
    ap.add_argument("--prompt-tokens", type=int, default=2048)
    ap.add_argument("--decode", type=int, default=64)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    path = pathlib.Path(a.model)
    if not path.is_file():
        raise SystemExit(f"{path}: no such model file (scripts/fetch-model.sh fetches the defaults)")
    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32
    ).eval()
    vocab = model.config.vocab_size
    ids = torch.tensor([[(1000 + 7 * i) % vocab for i in range(a.prompt_tokens)]])
    pre, dec = [], []
    with torch.inference_mode():
        for rep in range(a.reps):
            t0 = time.perf_counter()
            out = model(input_ids=ids, use_cache=True, logits_to_keep=1)
            t1 = time.perf_counter()
            cache = out.past_key_values
            tok = out.logits[:, -1].argmax(-1, keepdim=True)
            for _ in range(a.decode):
                out = model(input_ids=tok, past_key_values=cache, use_cache=True)
                cache = out.past_key_values
                tok = out.logits[:, -1].argmax(-1, keepdim=True)
            t2 = time.perf_counter()
            pre.append(a.prompt_tokens / (t1 - t0))
            dec.append(a.decode / (t2 - t1))
            print(f"  rep {rep}: prefill {pre[-1]:8.1f} tok/s ({t1 - t0:.2f} s)   "
                  f"decode {dec[-1]:6.1f} tok/s ({t2 - t1:.2f} s)")
    print(f"torch {torch.__version__}, {a.threads} threads, float32: "
          f"median prefill {statistics.median(pre):.1f} tok/s, decode {statistics.median(dec):.1f} tok/s")


if __name__ == "__main__":
    main()
