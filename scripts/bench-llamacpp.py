#!/usr/bin/env python3
"""llama.cpp on the same model and prompt length: a yardstick for capture speed.

llama.cpp is the usual engine for GGUF models on CPUs. It differs from
`kvreplay capture` in what it computes: it quantises activations to 8 bits
for the products with quantised weights (integer dot products), keeps the KV
cache in f16, and writes no trace. Its rates are therefore a yardstick from
the usual engine at lower precision, not a like-for-like figure.

Needs the llama-cpp-python package (a source build of llama.cpp, several
minutes on 2 cores), in a virtual environment of its own:

    python3 -m venv .venv-llamacpp
    CMAKE_ARGS="-DGGML_NATIVE=ON" .venv-llamacpp/bin/pip install llama-cpp-python
    .venv-llamacpp/bin/python scripts/bench-llamacpp.py --prompt-tokens 2048 --decode 64 --reps 3
"""
import argparse
import time


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="models/SmolLM2-135M-Instruct.Q4_1.gguf")
    ap.add_argument("--prompt-tokens", type=int, default=2048)
    ap.add_argument("--decode", type=int, default=64)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--batch", type=int, default=256, help="prompt positions per step (as capture's --prefill-chunk)")
    ap.add_argument("--flash-attn", action="store_true", help="llama.cpp's fused attention kernel")
    a = ap.parse_args()
    from llama_cpp import Llama

    llm = Llama(
        model_path=a.model,
        n_ctx=a.prompt_tokens + a.decode + 16,
        n_threads=a.threads,
        n_threads_batch=a.threads,
        n_batch=a.batch,
        n_ubatch=a.batch,
        flash_attn=a.flash_attn,
        verbose=False,
    )
    # A prompt of ordinary text, cut to the length asked for.
    text = " ".join(f"Line {i}: the quick brown fox jumps over the lazy dog." for i in range(a.prompt_tokens))
    prompt = llm.tokenize(text.encode())[: a.prompt_tokens]
    assert len(prompt) == a.prompt_tokens, "the prompt text is too short"
    runs = []
    for _ in range(a.reps):
        llm.reset()
        t0 = time.perf_counter()
        llm.eval(prompt)
        t1 = time.perf_counter()
        # Decode feeds the prompt's tokens again, one per step: a step's cost
        # does not depend on which token it is.
        for i in range(a.decode):
            llm.eval([prompt[i]])
        t2 = time.perf_counter()
        runs.append((a.prompt_tokens / (t1 - t0), a.decode / (t2 - t1)))
        print(f"prefill {runs[-1][0]:.1f} tok/s, decode {runs[-1][1]:.1f} tok/s")
    pre = sorted(r[0] for r in runs)[len(runs) // 2]
    dec = sorted(r[1] for r in runs)[len(runs) // 2]
    print(f"median: prefill {pre:.1f} tok/s, decode {dec:.1f} tok/s "
          f"({a.threads} threads, batch {a.batch}, flash attention {'on' if a.flash_attn else 'off'}, "
          f"{a.prompt_tokens} + {a.decode} tokens)")


if __name__ == "__main__":
    main()
