"""transformers attention backends ``"cupaged"`` / ``"paged|cupaged"``.

Tests that need torch and transformers skip without them. On the CPU the adapter runs the
NumPy reference backend (torch CPU tensors), so the plumbing is tested there too; the GPU
tests compare a small random Llama model against transformers' SDPA paths.
"""
import subprocess
import sys
import types
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_import_cupaged_imports_neither_torch_nor_transformers():
    code = ("import sys, cupaged, cupaged.integrations, cupaged.engine.model, cupaged.engine.demo; "
            "bad = [m for m in ('torch', 'transformers', 'cupy') if m in sys.modules]; "
            "assert not bad, bad")
    res = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert res.returncode == 0, res.stderr


torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402

import cupaged.integrations.transformers as hf  # noqa: E402

TOL = {torch.float32: 1e-4, torch.float16: 5e-3, torch.bfloat16: 2e-2}


# ----------------------------------------------------------------------------- oracle
def eager(q, k, v, keep=None, causal=True, scale=None, window=None, softcap=None, sinks=None):
    """float64 attention of ``[b, hq, sq, d]`` queries over ``[b, hk, sk, d]`` keys with a
    ``[b, sk]`` padding mask: bottom-right causal alignment among the kept tokens; returns
    ``[b, sq, hq, d]`` (padded query rows zero)."""
    b, hq, sq, d = q.shape
    sk, group = k.shape[2], hq // k.shape[1]
    keep = torch.ones(b, sk, dtype=torch.bool) if keep is None else keep.cpu().bool()
    scale = d ** -0.5 if scale is None else scale
    out = torch.zeros(b, sq, hq, d, dtype=torch.float64)
    for i in range(b):
        kk = k[i].double().cpu()[:, keep[i]].repeat_interleave(group, 0)
        vv = v[i].double().cpu()[:, keep[i]].repeat_interleave(group, 0)
        qrows = keep[i, sk - sq:]
        qq = q[i].double().cpu()[:, qrows]
        s = qq @ kk.transpose(1, 2) * scale
        if softcap:
            s = softcap * torch.tanh(s / softcap)
        nq, nk = qq.shape[1], kk.shape[1]
        p = torch.arange(nk - nq, nk)[:, None]
        j = torch.arange(nk)[None, :]
        visible = (j <= p) if causal else torch.ones(nq, nk, dtype=torch.bool)
        if window:
            visible &= j > p - window
        s = s.masked_fill(~visible, float("-inf"))
        if sinks is not None:
            s = torch.cat([s, sinks.double().cpu()[:, None, None].expand(hq, nq, 1)], -1)
        w = torch.softmax(s, -1).nan_to_num(0.0)[..., :nk]
        out[i, qrows] = (w @ vv).transpose(0, 1)
    return out


def rel(a, b):
    a = a.double().cpu()
    return float((a - b).norm() / b.norm())


def layer(**attrs):
    """A stand-in attention module with the attributes the adapter reads."""
    return types.SimpleNamespace(**{"is_causal": True, "layer_idx": 0, **attrs})


def qkv(b, hq, hk, sq, sk, d, dtype=torch.float32, device="cpu", seed=0):
    g = torch.Generator().manual_seed(seed)
    mk = lambda h, s: torch.randn(b, h, s, d, generator=g).to(device, dtype)  # noqa: E731
    return mk(hq, sq), mk(hk, sk), mk(hk, sk)


# ----------------------------------------------------------------------------- registry, errors
def test_names_are_registered():
    from transformers import AttentionInterface, AttentionMaskInterface
    assert AttentionInterface._global_mapping["cupaged"] is hf.attention_forward
    assert AttentionInterface._global_mapping["paged|cupaged"] is hf.paged_attention_forward
    assert "cupaged" in AttentionMaskInterface._global_mapping


def test_bad_calls_raise_value_errors():
    q, k, v = qkv(1, 4, 2, 3, 3, 64)
    with pytest.raises(ValueError, match="dropout"):
        hf.attention_forward(layer(), q, k, v, None, dropout=0.1)
    with pytest.raises(ValueError, match="attention_mask"):
        hf.attention_forward(layer(), q, k, v, torch.zeros(1, 1, 3, 3))
    with pytest.raises(ValueError, match="cache"):
        hf.paged_attention_forward(layer(), q, k, v, None)
    with pytest.raises(ValueError, match="inference-only"):
        hf.attention_forward(layer(), q.requires_grad_(), k, v, None)


# ----------------------------------------------------------------------------- standard (CPU)
@pytest.mark.parametrize("features", [
    dict(), dict(window=5), dict(softcap=3.0), dict(sinks=True), dict(causal=False),
    dict(window=4, sinks=True, softcap=5.0)], ids=str)
def test_attention_forward_matches_eager(features):
    b, hq, hk, sq, sk, d = 3, 8, 2, 6, 11, 64
    q, k, v = qkv(b, hq, hk, sq, sk, d)
    keep = torch.ones(b, sk, dtype=torch.bool)
    keep[1, :4] = keep[2, :9] = False                  # left padding, row 2 keeps 2 queries
    sinks = torch.randn(hq) if features.get("sinks") else None
    causal = features.get("causal", True)
    out, weights = hf.attention_forward(
        layer(is_causal=causal), q, k, v, keep, scaling=0.2,
        sliding_window=features.get("window"), softcap=features.get("softcap"), s_aux=sinks)
    ref = eager(q, k, v, keep, causal, 0.2, features.get("window"), features.get("softcap"), sinks)
    assert weights is None and out.shape == (b, sq, hq, d) and out.dtype == q.dtype
    assert rel(out, ref) < 1e-5
    assert not out[2, :4].any()                        # padded query rows are zero


def test_attention_forward_without_mask_and_bf16():
    q, k, v = qkv(2, 4, 4, 1, 9, 128, dtype=torch.bfloat16)
    out, _ = hf.attention_forward(layer(sliding_window=4), q, k, v, None)
    assert out.dtype == torch.bfloat16
    assert rel(out, eager(q, k, v, window=4)) < 1e-2


# ----------------------------------------------------------------------------- paged (fake cache)
class FakePagedCache:
    """What the adapter uses of transformers' ``PagedAttentionCache``: flat per-layer K/V
    ``[num_blocks * block_size, hk, d]`` and ``update`` (write the new tokens through
    ``write_index``, read each sequence back through ``read_index``)."""

    def __init__(self, num_blocks, block_size, hk, d, dtype, device, seed=1):
        g = torch.Generator().manual_seed(seed)
        shape = (num_blocks * block_size, hk, d)
        self.key_cache = [torch.randn(shape, generator=g).to(device, dtype)]
        self.value_cache = [torch.randn(shape, generator=g).to(device, dtype)]
        self.block_size, self.num_key_value_heads, self.head_dim = block_size, hk, d
        self.layer_index_to_group_indices = {0: (0, 0)}

    def update(self, key_states, value_states, layer_idx, read_index, write_index):
        k, v = key_states.transpose(1, 2).squeeze(0), value_states.transpose(1, 2).squeeze(0)
        kc, vc = self.key_cache[layer_idx], self.value_cache[layer_idx]
        kc.index_copy_(0, write_index[0], k)
        vc.index_copy_(0, write_index[0], v)
        return kc.index_select(0, read_index[0]), vc.index_select(0, read_index[0])


def _paged_batch(past, q_lens, block_size, blocks, pad_rows):
    """Slots of each sequence's tokens (scattered blocks) and the padded index tensors."""
    tables = [blocks[i::len(past)] for i in range(len(past))]
    slots = [[t[j // block_size] * block_size + j % block_size for j in range(p + n)]
             for t, p, n in zip(tables, past, q_lens)]
    write = [s for sl, p in zip(slots, past) for s in sl[p:]] + [0] * pad_rows
    read = [s for sl in slots for s in sl]
    cu_q = np.concatenate([[0], np.cumsum(q_lens), [sum(q_lens)] * 2])   # two padding seqs
    cu_k = np.concatenate([[0], np.cumsum(np.add(past, q_lens)), [sum(past) + sum(q_lens)] * 2])
    as_t = lambda x, dt: torch.tensor(np.asarray(x), dtype=dt)  # noqa: E731
    return (tables, slots, as_t(write, torch.int64), as_t(read, torch.int64),
            as_t(cu_q, torch.int32), as_t(cu_k, torch.int32))


def _reference_paged(cache_k, cache_v, slots, q, q_lens, hk, d, **opts):
    """Per-sequence eager attention over the keys at ``slots`` (after the step's writes)."""
    outs, row = [], 0
    for sl, n in zip(slots, q_lens):
        k = cache_k[sl].transpose(0, 1)[None]
        v = cache_v[sl].transpose(0, 1)[None]
        outs.append(eager(q[:, :, row:row + n], k, v, **opts)[0])
        row += n
    return torch.cat(outs)


def run_paged_varlen(device, dtype, sinks=False):
    hq, hk, d, bs = 8, 2, 64, 4
    past, q_lens, pad = [0, 5, 12], [4, 3, 1], 2
    cache = FakePagedCache(40, bs, hk, d, dtype, device)
    tables, slots, write, read, cu_q, cu_k = _paged_batch(
        past, q_lens, bs, torch.randperm(40, generator=torch.Generator().manual_seed(3)).tolist(),
        pad)
    t = sum(q_lens) + pad
    q, k, v = qkv(1, hq, hk, t, t, d, dtype, device, seed=4)
    s_aux = torch.randn(hq).to(device) if sinks else None
    before = [c.clone() for c in (cache.key_cache[0], cache.value_cache[0])]
    out, _ = hf.paged_attention_forward(
        layer(scaling=0.1), q, k, v, None, cache=cache, cu_seq_lens_q=cu_q.to(device),
        cu_seq_lens_k={"full_attention": cu_k.to(device)}, max_seqlen_q=4, max_seqlen_k=13,
        block_table=None, read_index=[read.to(device)], write_index=[write.to(device)],
        s_aux=s_aux)
    after_k, after_v = cache.key_cache[0].cpu(), cache.value_cache[0].cpu()
    new_slots = write[:sum(q_lens)]
    assert torch.equal(after_k[new_slots], k[0, :, :sum(q_lens)].transpose(0, 1).cpu())
    ref = _reference_paged(after_k, after_v, slots, q[:, :, :sum(q_lens)], q_lens, hk, d,
                           scale=0.1, sinks=s_aux)
    assert out.shape == (t, hq, d) and not out[sum(q_lens):].any()
    assert before[0].shape == after_k.shape
    return rel(out[:sum(q_lens)], ref)


def run_paged_decode(device, dtype, sinks=False):
    hq, hk, d, bs = 8, 2, 64, 4
    past = [3, 8, 0]
    cache = FakePagedCache(40, bs, hk, d, dtype, device)
    blocks = torch.randperm(40, generator=torch.Generator().manual_seed(5)).tolist()
    tables, slots, *_ = _paged_batch(past, [1, 1, 1], bs, blocks, 0)
    table = torch.full((1, 4, 6), -1, dtype=torch.int32)            # one padding sequence
    for i, p in enumerate(past):
        used = -(-(p + 1) // bs)
        table[0, i, :used] = torch.tensor(tables[i][:used])
    cu_k = torch.tensor([0, 4, 13, 14, 14], dtype=torch.int32)
    q, k, v = qkv(1, hq, hk, 4, 4, d, dtype, device, seed=6)
    s_aux = torch.randn(hq).to(device) if sinks else None
    out, _ = hf.paged_attention_forward(
        layer(), q, k, v, None, cache=cache, cu_seq_lens_q=torch.arange(5, dtype=torch.int32).to(device),
        cu_seq_lens_k=cu_k.to(device), max_seqlen_q=1, max_seqlen_k=1,
        block_table=table.to(device), s_aux=s_aux)
    after_k, after_v = cache.key_cache[0].cpu(), cache.value_cache[0].cpu()
    last = [sl[-1] for sl in slots]
    assert torch.equal(after_k[last], k[0, :, :3].transpose(0, 1).cpu())   # appended in place
    assert torch.equal(after_v[last], v[0, :, :3].transpose(0, 1).cpu())
    ref = _reference_paged(after_k, after_v, slots, q[:, :, :3], [1, 1, 1], hk, d, sinks=s_aux)
    assert out.shape == (4, hq, d) and not out[3].any()
    return rel(out[:3], ref)


@pytest.mark.parametrize("sinks", [False, True])
def test_paged_varlen_path(sinks):
    assert run_paged_varlen("cpu", torch.float32, sinks) < 1e-5


@pytest.mark.parametrize("sinks", [False, True])
def test_paged_decode_path(sinks):
    assert run_paged_decode("cpu", torch.float32, sinks) < 1e-5


# ----------------------------------------------------------------------------- model helpers
LENS = (7, 19, 30)
SEED = 15  # the SDPA run's closest top-2 logits differ by >= 0.13 in fp32 and fp16 (CPU)


def tiny_llama(dtype, device, seed=SEED):
    torch.manual_seed(seed)
    cfg = LlamaConfig(hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                      vocab_size=512, max_position_embeddings=256)
    model = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(8.0)          # logits spread over a few units: fewer near-ties
    return model.to(device, dtype)


def prompts(seed=SEED):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 512, (n,), generator=g) for n in LENS]


def left_padded(device):
    ps = prompts()
    ids = torch.zeros(len(ps), max(LENS), dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(ps):
        ids[i, -len(p):], mask[i, -len(p):] = p, 1
    return ids.to(device), mask.to(device)


@pytest.fixture
def spy(monkeypatch):
    """Count the adapter's kernel calls (so a silent fallback to SDPA fails the test)."""
    calls = {"varlen": 0, "decode": 0, "paged": 0}

    def wrap(name, fn):
        def counted(*a, **kw):
            calls[name] += 1
            return fn(*a, **kw)
        return counted
    monkeypatch.setattr(hf, "varlen_prefill", wrap("varlen", hf.varlen_prefill))
    monkeypatch.setattr(hf, "paged_decode", wrap("decode", hf.paged_decode))
    monkeypatch.setattr(hf, "paged_attention", wrap("paged", hf.paged_attention))
    return calls


def generate(model, impl, ids, mask, new_tokens=10):
    model.set_attn_implementation(impl)
    with torch.no_grad():
        out = model.generate(ids, attention_mask=mask, max_new_tokens=new_tokens,
                             do_sample=False, output_logits=True, return_dict_in_generate=True,
                             pad_token_id=0)
    return out.sequences[:, ids.shape[1]:].cpu(), torch.stack(out.logits, 1).float().cpu()


def test_generate_matches_sdpa_on_cpu(spy):
    model = tiny_llama(torch.float32, "cpu")
    ids, mask = left_padded("cpu")
    ref_tokens, ref_logits = generate(model, "sdpa", ids, mask, 6)
    tokens, logits = generate(model, "cupaged", ids, mask, 6)
    assert spy["varlen"] == 2 * 6                      # 2 layers x (prefill + 5 decodes)
    assert torch.equal(tokens, ref_tokens)
    assert rel(logits, ref_logits.double()) < 1e-5


# ----------------------------------------------------------------------------- GPU
def greedy_within(model, prompt, tokens, rel_tol=0.02):
    """Teacher forcing with SDPA: each generated token's logit is within ``rel_tol`` times
    the largest logit magnitude of the row's maximum (a few bf16 ulps)."""
    model.set_attn_implementation("sdpa")
    seq = torch.cat([prompt.cpu(), torch.as_tensor(tokens[:-1]).cpu()])[None].to(model.device)
    with torch.no_grad():
        logits = model(seq).logits[0, len(prompt) - 1:].float().cpu()
    chosen = logits.gather(1, torch.as_tensor(tokens).long()[:, None])[:, 0]
    return bool((chosen >= logits.max(1).values - rel_tol * logits.abs().max()).all())


DTYPES = [torch.float32, torch.float16, torch.bfloat16]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_gpu_generate_matches_sdpa(spy, dtype):
    """Left-padded batch through ``generate``: same greedy tokens, close logits. bf16 logits
    are too coarse for exact ties, so there the tokens are checked by teacher forcing."""
    model = tiny_llama(dtype, "cuda")
    ids, mask = left_padded("cuda")
    ref_tokens, ref_logits = generate(model, "sdpa", ids, mask)
    tokens, logits = generate(model, "cupaged", ids, mask)
    assert spy["varlen"] == 2 and spy["decode"] == 2 * 9  # prefill, then decode steps
    assert rel(logits, ref_logits.double()) < TOL[dtype]
    if dtype == torch.bfloat16:
        for p, t in zip(prompts(), tokens):
            assert greedy_within(model, p, t.tolist())
    else:
        assert torch.equal(tokens, ref_tokens)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_gpu_generate_batch_matches_paged_sdpa(spy, dtype):
    """Continuous batching (chunked prompts mixed with decodes: 24-token steps)."""
    from transformers import ContinuousBatchingConfig, GenerationConfig
    model = tiny_llama(dtype, "cuda")
    gen = GenerationConfig(max_new_tokens=10, do_sample=False, eos_token_id=None, pad_token_id=0)
    cb = ContinuousBatchingConfig(block_size=16, num_blocks=32, max_batch_tokens=24)
    inputs = [p.tolist() for p in prompts()]
    results = {}
    for impl in ("paged|sdpa", "paged|cupaged"):
        model.set_attn_implementation(impl)
        out = model.generate_batch(inputs, generation_config=gen, continuous_batching_config=cb,
                                   progress_bar=False)
        results[impl] = {tuple(o.prompt_ids): o.generated_tokens for o in out.values()}
    assert spy["varlen"] + spy["paged"] + spy["decode"] > 2 * 10
    ref, got = results["paged|sdpa"], results["paged|cupaged"]
    assert sorted(got) == sorted(ref) and all(len(t) == 10 for t in got.values())
    if dtype == torch.bfloat16:
        for p in prompts():
            assert greedy_within(model, p, got[tuple(p.tolist())])
    else:
        assert got == ref


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("sinks", [False, True])
def test_gpu_paged_paths(dtype, sinks):
    assert run_paged_varlen("cuda", dtype, sinks) < TOL[dtype]
    assert run_paged_decode("cuda", dtype, sinks) < TOL[dtype]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_gpu_attention_features_on_a_side_stream(dtype):
    """Padding, window, soft cap and sinks on a non-default torch stream."""
    b, hq, hk, sq, sk, d = 3, 8, 2, 6, 300, 128
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        q, k, v = qkv(b, hq, hk, sq, sk, d, dtype, "cuda", seed=7)
        keep = torch.ones(b, sk, dtype=torch.bool, device="cuda")
        keep[1, :100] = False
        sinks = torch.randn(hq, device="cuda")
        out, _ = hf.attention_forward(layer(), q, k, v, keep, sliding_window=64, softcap=20.0,
                                      s_aux=sinks)
    stream.synchronize()
    assert out.is_cuda and out.dtype == dtype
    assert rel(out, eager(q, k, v, keep, True, None, 64, 20.0, sinks)) < TOL[dtype]
