"""`tf32lab check` on decoders against an encoder of the same size: a decoder's check must cost no more per token.

GPT-2 and Llama (grouped-query attention, rotary angles, RMSNorm) beside BERT (its masked-LM head: every model
ends in a vocabulary projection), all of one width and depth
(random weights, built from configs), fed the same number of tokens as ``check hf:FOLDER`` feeds them (decoders
with ``use_cache=False``). Printed: each model's check time, as a multiple of its own native forward pass and per
token, and each decoder's check time per token as a multiple of BERT's (goal <= 1.0, within the noise of a shared
machine). Times are interleaved medians (torch.utils.benchmark, one thread).

    .venv/bin/python benchmarks/check_decoders.py [--rounds 3] [--width 128] [--layers 4] [--tokens 8x64]
"""

from __future__ import annotations

import argparse
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch
import transformers
from _common import header, interleaved

import tf32lab


def models(width: int, layers: int, vocab: int) -> dict[str, tuple[torch.nn.Module, bool]]:
    """name -> (model, decoder): one width, depth, head count, language-model head and feed-forward work for all
    (Llama's gated feed-forward has three matrices: 2/3 the inner size gives it the others' FLOPs)."""
    heads, ffn = max(1, width // 32), 4 * width
    torch.manual_seed(0)
    return {
        "bert": (transformers.BertForMaskedLM(transformers.BertConfig(
            vocab_size=vocab, hidden_size=width, num_hidden_layers=layers, num_attention_heads=heads,
            intermediate_size=ffn, max_position_embeddings=1024)), False),
        "gpt2": (transformers.GPT2LMHeadModel(transformers.GPT2Config(
            vocab_size=vocab, n_embd=width, n_layer=layers, n_head=heads, n_inner=ffn, n_positions=1024,
            bos_token_id=0, eos_token_id=0)), True),
        "llama": (transformers.LlamaForCausalLM(transformers.LlamaConfig(
            vocab_size=vocab, hidden_size=width, num_hidden_layers=layers, num_attention_heads=heads,
            num_key_value_heads=max(1, heads // 2), intermediate_size=2 * ffn // 3,
            max_position_embeddings=1024)), True),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--width", type=int, default=128)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--tokens", default="8x64", help="BATCHxLENGTH")
    args = parser.parse_args()
    batch, length = map(int, args.tokens.split("x"))
    vocab = 1000
    ids = torch.randint(0, vocab, (batch, length), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[batch // 2:, length - length // 4:] = 0  # padded rows, as the sample sentences are
    header(f"check on decoders vs an encoder: width {args.width}, {args.layers} layers, {batch}x{length} tokens")
    workloads = {}
    for name, (model, decoder) in models(args.width, args.layers, vocab).items():
        inputs = {"input_ids": ids, "attention_mask": mask, **({"use_cache": False} if decoder else {})}
        workloads[name] = tf32lab.Workload(model.eval(), inputs, name=name)

    def forward(w):
        def run():
            with torch.no_grad():
                w.run()
        return run

    def check(w):
        return lambda: tf32lab.check(w)

    variants = {f"{name} forward": forward(w) for name, w in workloads.items()}
    variants.update({f"{name} check": check(w) for name, w in workloads.items()})
    times = interleaved(variants, rounds=args.rounds, number=1)
    tokens = batch * length
    base = times["bert check"] / tokens
    for name in workloads:
        per_token = times[f"{name} check"] / tokens
        multiple = times[f"{name} check"] / times[f"{name} forward"]
        print(f"{name:6s} check {times[f'{name} check']:7.3f} s = {multiple:6.1f}x its forward, "
              f"{per_token * 1e3:7.3f} ms/token, {per_token / base:5.2f}x bert's per token")
    overhead = times["bert check"] / times["bert forward"]
    for name in workloads.keys() - {"bert"}:
        ratio = times[f"{name} check"] / times["bert check"]
        own = times[f"{name} check"] / times[f"{name} forward"] / overhead
        print(f"ratio {name} / bert check per token: {ratio:.2f} ({'<= 1.0' if ratio <= 1.0 else '> 1.0'}); "
              f"check's multiple of the forward, {name} / bert: {own:.2f}")


if __name__ == "__main__":
    main()
