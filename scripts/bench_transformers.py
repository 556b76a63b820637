"""transformers with cupaged against its own attention, on a ~1B Llama-shaped model.

Random bf16 weights (hidden 2048, 16 layers, 32 query / 8 kv heads of 64, MLP 8192, vocab
32000), built on the GPU without downloads. Two measurements, each implementation in turn:

- ``generate``: a left-padded batch (``--batch``, prompts of 200-1000 tokens, ``--new``
  tokens greedy), "cupaged" vs "sdpa"; tokens/s, the tokens that agree, and the attention
  share of the run (the time with attention replaced by a no-op, subtracted: what no
  backend can gain beyond);
- ``generate_batch``: continuous batching (``--requests``, prompts of 100-1500 tokens),
  "paged|cupaged" (CUDA graphs on) vs "paged|sdpa"; tokens/s and agreement.

Run on a CUDA machine: ``PYTHONPATH=. python3 scripts/bench_transformers.py [--quick]``.
"""
from __future__ import annotations

import json
import time

import click


def _model(torch):
    from transformers import AutoModelForCausalLM, LlamaConfig
    cfg = LlamaConfig(vocab_size=32000, hidden_size=2048, intermediate_size=8192,
                      num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8,
                      head_dim=64, max_position_embeddings=4096, tie_word_embeddings=True,
                      bos_token_id=None, eos_token_id=None, pad_token_id=None)
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(4.0)  # logits spread over a few units: fewer near-ties
    return model


def _prompts(torch, n, lo, hi, seed):
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(lo, hi + 1, (n,), generator=g).tolist()
    return [torch.randint(0, 32000, (m,), generator=g).tolist() for m in lens]


def _timed(torch, fn):
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    out = fn()
    torch.cuda.synchronize()
    return out, time.perf_counter() - t0


def _no_attention(module, query, key, value, attention_mask, **kwargs):
    b, _, s, _ = query.shape
    return query.new_zeros(b, s, query.shape[1], query.shape[3]), None


def bench_generate(torch, model, batch, new, seed=1):
    from transformers import AttentionInterface
    AttentionInterface.register("noattn", _no_attention)
    ps = _prompts(torch, batch, 200, 1000, seed)
    width = max(map(len, ps))
    ids = torch.zeros(batch, width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(ps):
        ids[i, width - len(p):] = torch.tensor(p)
        mask[i, width - len(p):] = 1
    ids, mask = ids.cuda(), mask.cuda()
    rows, tokens = [], {}
    for impl in ("sdpa", "cupaged", "noattn"):
        model.set_attn_implementation(impl)
        run = lambda n=new: model.generate(ids, attention_mask=mask, max_new_tokens=n,  # noqa
                                           min_new_tokens=n, do_sample=False, pad_token_id=0)
        with torch.no_grad():
            run(4)  # warm up
            out, secs = _timed(torch, run)
        tokens[impl] = out[:, width:].cpu()
        rows.append({"bench": "generate", "impl": impl, "seconds": secs,
                     "tokens_per_s": batch * new / secs})
    t = {r["impl"]: r["seconds"] for r in rows}
    same = (tokens["cupaged"] == tokens["sdpa"]).float().mean().item()
    for r in rows:
        r["vs_sdpa"] = t["sdpa"] / r["seconds"]
    rows[1]["tokens_agree"] = same
    rows[0]["attention_share"] = (t["sdpa"] - t["noattn"]) / t["sdpa"]
    return rows


def bench_generate_batch(torch, model, requests, new, seed=2):
    from transformers import ContinuousBatchingConfig, GenerationConfig
    ps = _prompts(torch, requests, 100, 1500, seed)
    gen = GenerationConfig(max_new_tokens=new, do_sample=False, eos_token_id=None,
                           pad_token_id=0)
    rows, got = [], {}
    for impl, graphs in (("paged|sdpa", False), ("paged|cupaged", True)):
        model.set_attn_implementation(impl)
        cb = ContinuousBatchingConfig(block_size=256, num_blocks=512, max_batch_tokens=2048,
                                      use_cuda_graph=graphs, allow_block_sharing=False)
        call = lambda inputs: model.generate_batch(  # noqa: E731
            inputs, generation_config=gen, continuous_batching_config=cb, progress_bar=False)
        with torch.no_grad():
            call(ps[:4])  # warm up
            out, secs = _timed(torch, lambda: call(ps))
        done = {tuple(o.prompt_ids): list(o.generated_tokens) for o in out.values()}
        got[impl] = done
        rows.append({"bench": "generate_batch", "impl": impl, "seconds": secs,
                     "tokens_per_s": sum(len(t) for t in done.values()) / secs,
                     "complete": sum(len(t) == new for t in done.values()) / requests})
    ref, ours = got["paged|sdpa"], got["paged|cupaged"]
    agree = [sum(a == b for a, b in zip(ref[p], ours.get(p, []))) / new for p in ref]
    rows[1]["tokens_agree"] = sum(agree) / len(agree)
    rows[1]["vs_paged_sdpa"] = rows[0]["seconds"] / rows[1]["seconds"]
    return rows


@click.command()
@click.option("--batch", default=8, show_default=True, help="generate: sequences.")
@click.option("--requests", default=48, show_default=True, help="generate_batch: requests.")
@click.option("--new", default=64, show_default=True, help="New tokens per sequence.")
@click.option("--quick", is_flag=True, help="A quarter of the requests and tokens.")
@click.option("--json", "json_path", type=click.Path(dir_okay=False), help="Write the rows.")
def main(batch, requests, new, quick, json_path):
    """Time transformers' generate and generate_batch with and without cupaged."""
    import torch
    import cupaged.integrations.transformers  # noqa: F401  (registers the backends)
    if quick:
        requests, new = max(4, requests // 4), max(8, new // 4)
    model = _model(torch)
    rows = bench_generate(torch, model, batch, new) + bench_generate_batch(torch, model,
                                                                           requests, new)
    cupaged.check_errors()
    for r in rows:
        click.echo("  ".join(f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}"
                             for k, v in r.items()))
    if json_path:
        with open(json_path, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
