"""Which grammar library constrains forced tool calls in the embedded engine (CPU).

    python -m bench.grammar_backends            # embedded SmolLM2's tokenizer (49k tokens)
    pip install outlines-core xgrammar          # optional: the other two candidates

For each of llguidance (nextstate's choice, a dependency), outlines-core and xgrammar, when
installed: the disk its install takes (with what it pulls in), one-time tokenizer indexing,
compiling a tool call's JSON schema, and the per-token cost of masking the logits, measured
while decoding a real call and inside a string argument (where nearly every token is allowed,
the worst case for list-based masks). Writes bench/results/grammar_backends-<model>.json.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

from bench.models import bench_model
from bench.report import pyplot, save

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"const": "read"},
        "arguments": {
            "type": "object",
            "properties": {"path": {"type": "string"}, "offset": {"type": "integer"}, "limit": {"type": "integer"}},
            "required": ["path"],
        },
    },
    "required": ["name", "arguments"],
    "additionalProperties": False,
}
CALL = '{"name": "read", "arguments": {"path": "notes.txt"}}'
IN_STRING = '{"name": "read", "arguments": {"path": "no'
# What each candidate installs beside itself (import names of its dependencies that nextstate
# does not already need).
EXTRA_PACKAGES = {"llguidance": [], "outlines_core": [], "xgrammar": ["triton", "tvm_ffi"]}


def _size_mb(module: str) -> float | None:
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        return None
    out = subprocess.run(["du", "-sm", *spec.submodule_search_locations], capture_output=True, text=True)
    return float(sum(int(line.split()[0]) for line in out.stdout.splitlines()))


def _llguidance(tok):
    import llguidance
    import llguidance.hf
    import llguidance.torch as llt

    started = time.perf_counter()
    lltok = llguidance.hf.from_tokenizer(tok)
    bitmask = llt.allocate_token_bitmask(1, lltok.vocab_size)
    schema = {**SCHEMA, "x-guidance": {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}}
    grammar = llguidance.LLMatcher.grammar_from_json_schema(json.dumps(schema))
    index_s = time.perf_counter() - started

    def new():
        return llguidance.LLMatcher(lltok, grammar)

    from nextstate.engine.constraints import masked_logits

    def mask(m, logits):  # as the embedded engine masks: unpacked in eager torch, no torch.compile
        llt.fill_next_token_bitmask(m, bitmask, 0)
        logits[0] = masked_logits(logits[0], bitmask[0], lltok.vocab_size)

    return index_s, new, mask, lambda m, t: m.consume_token(t)


def _outlines_core(tok):
    from outlines_core import Guide, Index, Vocabulary
    from outlines_core.json_schema import build_regex_from_schema

    started = time.perf_counter()
    vocab: dict[str, list[int]] = {}
    for token, i in tok.get_vocab().items():
        if i != tok.eos_token_id:
            vocab.setdefault(tok.convert_tokens_to_string([token]), []).append(i)
    vocabulary = Vocabulary(tok.eos_token_id, vocab)
    index_s = time.perf_counter() - started
    index = Index(build_regex_from_schema(json.dumps(SCHEMA), r"[ ]?"), vocabulary)

    def mask(guide, logits):
        keep = torch.full_like(logits, float("-inf"))
        keep[0, torch.tensor(guide.get_tokens())] = 0
        logits += keep

    return index_s, lambda: Guide(index), mask, lambda g, t: g.advance(t) is not None or True


def _xgrammar(tok):
    import xgrammar as xgr

    started = time.perf_counter()
    info = xgr.TokenizerInfo.from_huggingface(tok, vocab_size=len(tok))
    compiler = xgr.GrammarCompiler(info)
    index_s = time.perf_counter() - started
    compiled = compiler.compile_json_schema(json.dumps(SCHEMA), any_whitespace=False)
    bitmask = xgr.allocate_token_bitmask(1, info.vocab_size)

    def mask(m, logits):
        m.fill_next_token_bitmask(bitmask)
        xgr.apply_token_bitmask_inplace(logits, bitmask)

    return index_s, lambda: xgr.GrammarMatcher(compiled), mask, lambda m, t: m.accept_token(t)


CANDIDATES = {"llguidance": _llguidance, "outlines_core": _outlines_core, "xgrammar": _xgrammar}


def measure(name: str, tok) -> dict:
    index_s, new, mask, advance = CANDIDATES[name](tok)
    started = time.perf_counter()
    matcher = new()
    compile_ms = 1000 * (time.perf_counter() - started)
    logits = torch.randn(1, len(tok))
    call_ids = tok(CALL, add_special_tokens=False)["input_ids"]
    per_token = []
    for token in call_ids:
        started = time.perf_counter()
        masked = logits.clone()
        mask(matcher, masked)
        per_token.append(time.perf_counter() - started)
        if masked[0, token] == float("-inf"):
            raise AssertionError(f"{name} forbade {tok.decode([token])!r} in a valid call")
        advance(matcher, token)
    matcher = new()
    for token in tok(IN_STRING, add_special_tokens=False)["input_ids"]:
        advance(matcher, token)
    in_string = []
    for _ in range(30):
        started = time.perf_counter()
        mask(matcher, logits.clone())
        in_string.append(time.perf_counter() - started)
    return {
        "installed_mb": sum(filter(None, [_size_mb(name), *map(_size_mb, EXTRA_PACKAGES[name])])),
        "tokenizer_index_s": round(index_s, 3),
        "compile_ms": round(compile_ms, 3),
        "first_mask_ms": round(1000 * per_token[0], 3),
        "mask_ms_per_token_median": round(1000 * statistics.median(per_token), 4),
        "mask_ms_inside_a_string": round(1000 * statistics.median(in_string), 4),
    }


def main() -> None:
    from transformers import AutoTokenizer

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="a model directory (default: the embedded SmolLM2)")
    args = parser.parse_args()
    model_dir = bench_model(args.model, smol=not args.model)
    tok = AutoTokenizer.from_pretrained(model_dir)
    results = {}
    for name in CANDIDATES:
        if importlib.util.find_spec(name) is None:
            print(f"{name}: not installed, skipped", file=sys.stderr)
            continue
        results[name] = measure(name, tok)
        print(name, results[name], flush=True)
    save({"benchmark": "grammar_backends", "model": Path(model_dir).name, "vocab": len(tok), "schema": SCHEMA, "results": results})


def headline(result: dict) -> str:
    return "; ".join(
        f"{name}: mask {r['mask_ms_per_token_median']:.2f} ms/token ({r['mask_ms_inside_a_string']:.2f} in a string, "
        f"first {r['first_mask_ms']:.0f}), {r['installed_mb']:.0f} MB installed"
        for name, r in result["results"].items()
    )


def plot(result: dict):
    plt = pyplot()
    names = list(result["results"])
    fig, axes = plt.subplots(1, 2, figsize=(9, 3.2))
    axes[0].barh(names, [result["results"][n]["mask_ms_inside_a_string"] for n in names])
    axes[0].set_xscale("log")
    axes[0].set_xlabel("ms per token, masking inside a string")
    axes[1].barh(names, [result["results"][n]["installed_mb"] for n in names])
    axes[1].set_xscale("log")
    axes[1].set_xlabel("MB installed (with its dependencies)")
    fig.suptitle(f"Grammar libraries for forced tool calls — {result['model']} ({result['vocab']} tokens), CPU")
    return fig


if __name__ == "__main__":
    main()
