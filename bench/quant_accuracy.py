"""What ``--quantization int8`` and ``int4`` cost in accuracy, against the model in bf16 (and fp32).

    .venv/bin/python bench/quant_accuracy.py [--model PATH] [--out FILE] [--json FILE]

One fresh server at a time (default flags otherwise), the default model:

* **Top-1 agreement on the parity prompts** (``QUESTIONS``, the eight chat
  questions ``tests/e2e/test_server_parity.py`` also asks): each bf16 server's greedy output (24
  tokens, ``ignore_eos``) is fed back to every server as a prompt with
  ``prompt_logprobs``; at every output position, does that server's most
  likely token equal bf16's greedy token? Teacher forcing compares every
  position, not only those before a first difference. Also counted: whole
  greedy outputs identical to bf16's.
* **Perplexity** of a fixed English text (``TEXT`` below, ~330 tokens), from
  the prompt log-probabilities of each server.

fp32 is measured too, as the scale: it shows how far bf16 itself is from
full precision.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tests.support.server_harness import running_server  # noqa: E402
from jitney.client.client import Sampling, make_params  # noqa: E402
from jitney.common.model_files import cache_root, load_tokenizer, resolve_model  # noqa: E402
from jitney.v1 import generation_pb2 as pb  # noqa: E402

QUESTIONS = [
    "What is the capital of France?",
    "Name three primary colors.",
    "Write a haiku about the sea.",
    "What is 12 times 12?",
    "Explain photosynthesis in one sentence.",
    "Give me a synonym for happy.",
    "Who wrote Romeo and Juliet?",
    "List the planets of the solar system.",
]
MAX_TOKENS = 24

# A fixed text for perplexity (written for this benchmark; plain encyclopaedic English).
TEXT = (
    "The river rises in the hills to the north of the town and flows south for about forty miles before it "
    "reaches the sea. For most of its length it runs through farmland, where wheat, barley and potatoes are "
    "grown, and through small villages whose stone bridges date from the eighteenth century. In the winter "
    "months the river often floods the low fields on either bank, and the farmers move their cattle to higher "
    "ground until the water goes down. The town itself grew up around a mill that was built at the point where "
    "the river is narrowest. The mill ground grain for the whole valley, and later it was turned into a factory "
    "that made paper. The factory closed many years ago, but the building still stands, and it is now a museum "
    "that tells the story of the valley and the people who lived and worked there. Visitors can see the old "
    "machines, read letters written by the workers, and walk along a path that follows the river to the coast. "
    "Birds such as herons and kingfishers are common along the banks, and in the spring the meadows are full of "
    "wild flowers. Many people come to the valley to walk, to fish, or simply to enjoy the quiet. The railway "
    "that once carried paper to the port was closed as well, and its line has become a cycle route that runs "
    "for twelve miles between the town and the harbour."
)

CASES: dict[str, list[str]] = {
    "bf16": ["--dtype", "bfloat16"],
    "int8": ["--dtype", "bfloat16", "--quantization", "int8"],
    "int4": ["--dtype", "bfloat16", "--quantization", "int4"],
    "fp32": ["--dtype", "float32"],
}


def prompt_ids(tokenizer: Any) -> list[list[int]]:
    """``QUESTIONS`` as chat prompts (one user message each, the generation prompt added), token ids."""
    texts = [tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True,
                                           tokenize=False) for q in QUESTIONS]
    return [tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts]


def greedy(stub: Any, ids: list[int]) -> list[int]:
    params = make_params(ids, sampling=Sampling(max_tokens=MAX_TOKENS, ignore_eos=True))
    return list(stub.Generate(pb.GenerateRequest(params=params), timeout=600).token_ids)


def prompt_scores(stub: Any, ids: list[int]) -> list[pb.PromptTokenLogprob]:
    """Per prompt token: its log-probability and the most likely token, given what precedes it."""
    params = make_params(ids, sampling=Sampling(max_tokens=1, prompt_logprobs=1))
    return list(stub.Generate(pb.GenerateRequest(params=params), timeout=600).prompt_logprobs)


def measure(case: str, args: list[str], prompts: list[list[int]], reference: list[list[int]] | None,
            text_ids: list[int], log_dir: Path) -> dict[str, Any]:
    with running_server(args, log_dir) as server:
        stub = server.stub()
        with ThreadPoolExecutor(len(prompts)) as pool:
            outputs = list(pool.map(lambda ids: greedy(stub, ids), prompts))
        ref = reference if reference is not None else outputs
        agree = total = 0
        for ids, out in zip(prompts, ref):
            scores = prompt_scores(stub, ids + out)[len(ids):]
            agree += sum(s.top.token_ids[0] == tok for s, tok in zip(scores, out))
            total += len(out)
        text = prompt_scores(stub, text_ids)[1:]
        nll = -sum(s.logprob for s in text) / len(text)
    return {"case": case, "flags": " ".join(args), "outputs": outputs,
            "top1_agreement": agree / total, "positions": total,
            "identical_outputs": sum(o == r for o, r in zip(outputs, ref)),
            "text_tokens": len(text), "perplexity": math.exp(nll)}


def report(rows: list[dict[str, Any]]) -> str:
    lines = ["| case | flags | top-1 = bf16's greedy token | greedy outputs identical to bf16's | "
             f"perplexity ({rows[0]['text_tokens']} tokens) |", "|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['case']} | `{r['flags']}` | {100 * r['top1_agreement']:.1f}% of {r['positions']} | "
                     f"{r['identical_outputs']} of {len(r['outputs'])} | {r['perplexity']:.3f} |")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="model folder or .gguf (default: the bundled model)")
    parser.add_argument("--cases", nargs="+", choices=sorted(CASES), default=list(CASES))
    parser.add_argument("--out", type=Path, default=None, help="also write the markdown table here")
    parser.add_argument("--json", type=Path, default=None, help="also write the raw results here")
    args = parser.parse_args()
    tokenizer = load_tokenizer(resolve_model(args.model), cache_root())
    prompts = prompt_ids(tokenizer)
    text_ids = tokenizer(TEXT, add_special_tokens=False)["input_ids"]
    model_args = ["--model", args.model] if args.model else []
    cases = ["bf16"] + [c for c in args.cases if c != "bf16"]   # bf16 first: the reference
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="quant-accuracy-") as tmp:
        for case in cases:
            reference = rows[0]["outputs"] if rows else None
            rows.append(measure(case, CASES[case] + model_args, prompts, reference, text_ids, Path(tmp)))
            print(f"{case}: done", file=sys.stderr, flush=True)
    table = report(rows)
    print(table)
    if args.out:
        args.out.write_text(table + "\n")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
