"""The tiny Llama-style model: paged steps vs a dense float64 forward, CuPy vs NumPy tokens."""
import numpy as np
import pytest

from cupaged.engine.demo import CHECK_TOLERANCE, DemoConfig, run_demo
from dataclasses import replace

from cupaged.core.fp8 import FP8_FORMATS
from cupaged.core.layouts import cache_shapes
from cupaged.engine.model import (TinyLlama, TinyLlamaConfig, check_generation, generate,
    init_weights, kv_scales, score)

SMALL = dict(num_q_heads=4, num_kv_heads=2, head_dim=64, intermediate_size=512)
# ||logits(fp8 cache) - logits(16-bit cache)|| / ||logits(16-bit cache)||: a quantised element
# is off by up to 2^-4 (e4m3) or 2^-3 (e5m2) of itself, and attention averages the errors of
# many keys and values; these bounds leave about three times the error seen at SMALL sizes
FP8_TOLERANCE = {"fp8_e4m3": 3e-2, "fp8_e5m2": 6e-2}


def small(**kw):
    return TinyLlamaConfig(**{**SMALL, **kw})


def prompts_of(lengths, seed=1, vocab=512):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, vocab, n).tolist() for n in lengths]


# ----------------------------------------------------------------------------- dense oracle
def _rms(x, w, eps):
    return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * w


def _rope(x, base):
    """Neox-style rotation of ``[T, H, d]`` by positions 0..T-1, written from the formula."""
    t, _, d = x.shape
    angles = np.arange(t)[:, None] * base ** (-np.arange(0, d, 2) / d)[None, :]
    cos, sin = np.cos(angles)[:, None, :], np.sin(angles)[:, None, :]
    x1, x2 = x[..., :d // 2], x[..., d // 2:]
    return np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


def dense_logits(cfg, tokens):
    """float64 logits ``[T, vocab]`` of one sequence: full causal attention, no cache."""
    w = init_weights(cfg)
    t, d, hq, hk = len(tokens), cfg.head_dim, cfg.num_q_heads, cfg.num_kv_heads
    x = w["embed"][np.asarray(tokens)].astype(np.float64)
    causal = np.tril(np.ones((t, t), bool))
    for layer in w["layers"]:
        qkv = _rms(x, layer["attn_norm"], cfg.rms_eps) @ layer["wqkv"]
        q = _rope(qkv[:, :hq * d].reshape(t, hq, d), cfg.rope_base)
        k = _rope(qkv[:, hq * d:(hq + hk) * d].reshape(t, hk, d), cfg.rope_base)
        v = qkv[:, (hq + hk) * d:].reshape(t, hk, d)
        kv_head = np.arange(hq) // (hq // hk)
        s = np.einsum("qhd,khd->hqk", q, k[:, kv_head]) * d ** -0.5
        s = np.where(causal, s, -np.inf)
        p = np.exp(s - s.max(-1, keepdims=True))
        out = np.einsum("hqk,khd->qhd", p / p.sum(-1, keepdims=True), v[:, kv_head])
        x = x + out.reshape(t, hq * d) @ layer["wo"]
        gu = _rms(x, layer["mlp_norm"], cfg.rms_eps) @ layer["w_gate_up"]
        g, u = gu[:, :cfg.intermediate_size], gu[:, cfg.intermediate_size:]
        x = x + (g / (1 + np.exp(-g)) * u) @ layer["w_down"]
    return _rms(x, w["final_norm"], cfg.rms_eps) @ w["lm_head"]


def _rel(a, b):
    return np.linalg.norm(np.asarray(a, np.float64) - b) / np.linalg.norm(b)


# ----------------------------------------------------------------------------- CPU
@pytest.mark.parametrize("layout", ["NHD", "vllm"])
def test_numpy_generate_matches_dense_forward(layout):
    cfg = small(dtype="float32", layout=layout)
    prompts = prompts_of((5, 17, 1))
    tokens, logits = generate(TinyLlama(cfg, np), prompts, 6, block_size=8)
    for p, toks, lg in zip(prompts, tokens, logits):
        ref = dense_logits(cfg, p + toks[:-1].tolist())[len(p) - 1:]
        np.testing.assert_array_equal(toks, ref.argmax(-1))
        assert _rel(lg, ref) < 1e-5


def test_half_precision_caches_stay_close_to_dense():
    cfg = small(dtype="float16", layout="HND")
    p = prompts_of((20,))[0]
    got = score(TinyLlama(cfg, np), p, block_size=16)
    assert _rel(got, dense_logits(cfg, p)) < 2e-3


def test_score_equals_generate_logits():
    model = TinyLlama(small(dtype="float32"), np)
    p = prompts_of((9,))[0]
    tokens, logits = generate(model, [p], 4)
    s = score(model, p + tokens[0, :-1].tolist(), block_size=4)[len(p) - 1:]
    np.testing.assert_allclose(s, logits[0], rtol=1e-5, atol=1e-5)


def test_check_generation_flags_wrong_tokens_and_logits():
    cfg = small(dtype="float32")
    p = prompts_of((7,))[0]
    tokens, logits = generate(TinyLlama(cfg, np), [p], 5)
    c = check_generation(cfg, [(p, tokens[0], logits[0])])
    assert c.max_rel_error < 1e-5 and c.max_abs_error < 1e-4 and c.matches == c.total == 5
    bad = tokens[0].copy()
    bad[-1] = (bad[-1] + 1) % cfg.vocab_size     # the last token feeds nothing: logits unchanged
    c = check_generation(cfg, [(p, bad, logits[0] * 1.01)])
    assert c.matches == 4 and 5e-3 < c.max_rel_error < 2e-2
    assert np.isclose(c.max_abs_error, 0.01 * np.abs(logits[0]).max(), rtol=1e-3)


def test_weights_depend_on_seed_only():
    a, b, c = (init_weights(small(seed=s)) for s in (3, 3, 4))
    np.testing.assert_array_equal(a["layers"][1]["wqkv"], b["layers"][1]["wqkv"])
    assert not np.array_equal(a["embed"], c["embed"])


@pytest.mark.parametrize("bad, field", [
    (dict(num_kv_heads=3), "num_kv_heads"), (dict(head_dim=48), "head_dim"),
    (dict(dtype="int8"), "dtype"), (dict(layout="NDH"), "layout"),
    (dict(num_layers=0), "num_layers"), (dict(vocab_size=0), "vocab_size"),
    (dict(rms_eps=0.0), "rms_eps"), (dict(kv_dtype="fp8"), "kv_dtype: expected one of")])
def test_config_errors_name_the_field(bad, field):
    with pytest.raises((ValueError, TypeError), match=field):
        TinyLlama(small(**bad), np)


def test_bad_inputs_raise_before_running():
    model = TinyLlama(small(dtype="float32"), np)
    with pytest.raises(ValueError, match="token_ids"):
        generate(model, [[1, 2, 600]], 2)
    with pytest.raises(ValueError, match="max_new_tokens"):
        generate(model, [[1, 2]], 0)
    with pytest.raises(ValueError, match="tokens"):
        score(model, [])


def test_demo_engine_tokens_follow_the_dense_model():
    """Chunked prompts mixed with decodes (token budget 24) give the dense model's argmax."""
    cfg = DemoConfig(requests=3, max_prompt=40, max_output=6, max_batch_tokens=24, max_seqs=3,
                     model="tiny", dtype="float32", layout="HND", num_q_heads=4,
                     num_kv_heads=2, block_size=8, num_blocks=24, seed=2)
    stats = run_demo(cfg, np)
    from cupaged.engine.demo import make_requests, model_config, prompt_tokens
    mcfg = model_config(cfg)
    for r in make_requests(cfg, np.random.default_rng(cfg.seed)):
        out = stats.tokens[r.rid]
        assert len(out) == r.output_len
        seq = prompt_tokens(cfg, r).tolist() + out[:-1]
        np.testing.assert_array_equal(out, dense_logits(mcfg, seq)[r.prompt_len - 1:].argmax(-1))


# ----------------------------------------------------------------------------- fp8 caches
@pytest.mark.parametrize("layout", ["NHD", "vllm"])
def test_fp8_caches_are_one_byte(layout):
    cfg = small(kv_dtype="fp8_e5m2", layout=layout)
    k, v = TinyLlama(cfg, np).allocate_cache(6, 16)
    plain_k, plain_v = TinyLlama(replace(cfg, kv_dtype=None), np).allocate_cache(6, 16)
    assert k.dtype == v.dtype == FP8_FORMATS["fp8_e5m2"].dtype
    assert k.shape == (cfg.num_layers, *cache_shapes(layout, 6, 16, 2, 64, "fp8_e5m2")[0])
    assert 2 * (k.nbytes + v.nbytes) == plain_k.nbytes + plain_v.nbytes


@pytest.mark.parametrize("kv_dtype", ["fp8_e4m3", "fp8_e5m2"])
def test_kv_scales_bound_every_key_and_value(kv_dtype):
    """Whatever the residual stream holds, a layer's rotated keys and values over their
    head's scale stay inside the format's range."""
    cfg = small(kv_dtype=kv_dtype)
    w = init_weights(cfg)
    rng = np.random.default_rng(5)
    t, d, hq, hk = 64, cfg.head_dim, cfg.num_q_heads, cfg.num_kv_heads
    for layer, (ks, vs) in zip(w["layers"], kv_scales(cfg, w)):
        assert ks.dtype == vs.dtype == np.float32 and ks.shape == vs.shape == (hk,)
        x = rng.standard_normal((t, cfg.hidden_size)) * rng.uniform(1e-3, 1e3, (t, 1))
        x[0] = np.sign(layer["wqkv"][:, hq * d]) * 1e4   # aligned with one key column
        qkv = _rms(x, layer["attn_norm"], cfg.rms_eps) @ layer["wqkv"]
        k = _rope(qkv[:, hq * d:(hq + hk) * d].reshape(t, hk, d), cfg.rope_base)
        v = qkv[:, (hq + hk) * d:].reshape(t, hk, d)
        fmax = FP8_FORMATS[kv_dtype].max
        assert np.abs(k / ks[:, None]).max() <= fmax and np.abs(v / vs[:, None]).max() <= fmax
        assert np.abs(k / ks[:, None]).max() > fmax / 4      # the aligned row nears the bound


@pytest.mark.parametrize("kv_dtype", ["fp8_e4m3", "fp8_e5m2"])
@pytest.mark.parametrize("layout, dtype", [("NHD", "float16"), ("vllm", "bfloat16"),
                                           ("HND", "float32")])
def test_fp8_cache_logits_stay_close_to_16bit_cache(kv_dtype, layout, dtype):
    """The NumPy model on an fp8 cache against the same model on a cache of its dtype, teacher
    forced on the fp8 run's tokens: logits within FP8_TOLERANCE, greedy choices agreeing."""
    cfg = small(dtype=dtype, layout=layout, kv_dtype=kv_dtype)
    prompts = prompts_of((5, 17, 33))
    tokens, logits = generate(TinyLlama(cfg, np), prompts, 8, block_size=8)
    c = check_generation(replace(cfg, kv_dtype=None), list(zip(prompts, tokens, logits)))
    assert 1e-4 < c.max_rel_error < FP8_TOLERANCE[kv_dtype]   # quantised, but close
    assert c.matches >= c.total - 1


def test_demo_engine_compares_fp8_with_16bit_cache():
    cfg = DemoConfig(requests=3, max_prompt=40, max_output=6, max_batch_tokens=24, max_seqs=3,
                     model="tiny", num_q_heads=4, num_kv_heads=2, seed=12, kv_dtype="fp8_e4m3")
    stats = run_demo(cfg, np)
    check, dtype = stats.fp8_vs_plain
    assert dtype == "float16" and check.total == sum(map(len, stats.tokens.values()))
    assert check.max_rel_error < FP8_TOLERANCE["fp8_e4m3"] and check.matches >= check.total - 1
    assert "fp8_e4m3 (1 byte" in stats.kv_cache
    assert run_demo(replace(cfg, kv_dtype="none"), np).fp8_vs_plain is None


# ----------------------------------------------------------------------------- GPU
@pytest.mark.gpu
@pytest.mark.parametrize("layout", ["NHD", "HND", "vllm"])
@pytest.mark.parametrize("dtype, head_dim", [("float32", 64), ("float16", 64),
                                             ("bfloat16", 128), ("float16", 128)])
def test_gpu_greedy_tokens_match_numpy(cp, dtype, head_dim, layout):
    cfg = small(dtype=dtype, head_dim=head_dim, layout=layout)
    prompts = prompts_of((5, 17, 33))
    ref_tokens, ref_logits = generate(TinyLlama(cfg, np), prompts, 8)
    top2 = np.sort(ref_logits, -1)[..., -2:]
    assert (top2[..., 1] - top2[..., 0]).min() > 0.05, "near tie in the reference: change seed"
    tokens, logits = generate(TinyLlama(cfg, cp), prompts, 8)
    np.testing.assert_array_equal(tokens, ref_tokens)
    assert _rel(logits, ref_logits) < CHECK_TOLERANCE[dtype]


@pytest.mark.gpu
@pytest.mark.parametrize("layout", ["NHD", "HND", "vllm"])
@pytest.mark.parametrize("kv_dtype, dtype, head_dim, seed", [
    ("fp8_e4m3", "float16", 64, 1), ("fp8_e4m3", "bfloat16", 64, 1),
    ("fp8_e5m2", "float16", 64, 1), ("fp8_e5m2", "bfloat16", 64, 1),
    ("fp8_e4m3", "float16", 128, 4), ("fp8_e4m3", "bfloat16", 128, 3),
    ("fp8_e5m2", "float16", 128, 4), ("fp8_e5m2", "bfloat16", 128, 4)])
def test_gpu_fp8_greedy_tokens_match_numpy(cp, kv_dtype, dtype, head_dim, seed, layout):
    """The CuPy model on uint8 fp8 caches (device per-head scales) against the NumPy model
    on float8 caches of the same format and scales: the same tokens, logits within the
    16-bit tolerance (both sides quantise the same 16-bit rows bit for bit). Prompt seeds
    chosen where the reference's closest top-2 logits differ by more than 0.05."""
    cfg = small(dtype=dtype, head_dim=head_dim, layout=layout, kv_dtype=kv_dtype)
    prompts = prompts_of((5, 17, 33), seed=seed)
    ref_tokens, ref_logits = generate(TinyLlama(cfg, np), prompts, 8)
    top2 = np.sort(ref_logits, -1)[..., -2:]
    assert (top2[..., 1] - top2[..., 0]).min() > 0.05, "near tie in the reference: change seed"
    model = TinyLlama(cfg, cp)
    assert model.allocate_cache(2, 16)[0].dtype == np.uint8
    tokens, logits = generate(model, prompts, 8)
    np.testing.assert_array_equal(tokens, ref_tokens)
    assert _rel(logits, ref_logits) < CHECK_TOLERANCE[dtype]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_gpu_fp8_demo_engine_matches_numpy(cp, dtype):
    """The demo's mixed steps and decodes on an e4m3 cache: the NumPy engine's
    tokens (seed 12: the reference's closest top-2 logits differ by >= 0.3), the check
    within tolerance, and the comparison with the 16-bit cache made on the GPU."""
    cfg = DemoConfig(requests=3, max_prompt=40, max_output=8, max_batch_tokens=24, max_seqs=3,
                     model="tiny", dtype=dtype, num_q_heads=4, num_kv_heads=2, check=True,
                     seed=12, kv_dtype="fp8_e4m3")
    gpu, ref = run_demo(cfg, cp), run_demo(cfg, np)
    assert gpu.tokens == ref.tokens and len(gpu.tokens) == 3
    assert gpu.max_rel_error < CHECK_TOLERANCE[dtype]
    assert gpu.argmax_matches[0] == gpu.argmax_matches[1] == sum(map(len, ref.tokens.values()))
    plain, ref_plain = gpu.fp8_vs_plain[0], ref.fp8_vs_plain[0]
    assert plain.max_rel_error < FP8_TOLERANCE["fp8_e4m3"] and plain.total == ref_plain.total
    # each side's 16-bit and fp8 runs differ from the NumPy ones within the tolerance
    assert abs(plain.max_rel_error - ref_plain.max_rel_error) < 2 * CHECK_TOLERANCE[dtype]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_gpu_demo_engine_matches_numpy(cp, dtype):
    # seed 12: the reference's closest top-2 logits differ by >= 0.3 (fp32 and bf16)
    cfg = DemoConfig(requests=3, max_prompt=40, max_output=8, max_batch_tokens=24, max_seqs=3,
                     model="tiny", dtype=dtype, num_q_heads=4, num_kv_heads=2, check=True,
                     seed=12)
    gpu, ref = run_demo(cfg, cp), run_demo(cfg, np)
    assert gpu.tokens == ref.tokens and len(gpu.tokens) == 3
    assert gpu.max_rel_error < CHECK_TOLERANCE[dtype]
    assert gpu.argmax_matches[0] == gpu.argmax_matches[1] == sum(map(len, ref.tokens.values()))


@pytest.mark.gpu
@pytest.mark.parametrize("graphs", [True, False])
def test_gpu_demo_steps_wait_for_the_caches_zeroing(cp, monkeypatch, graphs):
    """The engine steps on a non-blocking stream, which does not wait for the current
    stream where the weights and the zeroed caches were made: with that stream held up
    (a spinning kernel before the zeroing, as a busy GPU does), a step that did not wait
    wrote K/V the zeroing then erased (the demo's tokens went wrong in the GPU suite)."""
    import cupaged.engine.model as model_
    cfg = DemoConfig(requests=3, max_prompt=40, max_output=8, max_batch_tokens=24, max_seqs=3,
                     model="tiny", dtype="float32", num_q_heads=4, num_kv_heads=2, seed=12,
                     cuda_graphs=graphs)
    ref = run_demo(cfg, np)
    spin = cp.RawKernel(r"""extern "C" __global__ void spin(long long cycles) {
        long long t0 = clock64(); while (clock64() - t0 < cycles) {} }""", "spin")
    allocate = model_.TinyLlama.allocate_cache

    def held_up(self, *args, **kwargs):  # about 0.2 s of the current stream before the zeroing
        spin((1,), (1,), (np.int64(400_000_000),))
        return allocate(self, *args, **kwargs)

    monkeypatch.setattr(model_.TinyLlama, "allocate_cache", held_up)
    gpu = run_demo(cfg, cp)
    assert gpu.tokens == ref.tokens


@pytest.mark.gpu
def test_gpu_demo_in_strict_mode_runs_eagerly(cp, monkeypatch):
    """Strict mode's host checks read device arrays, which a CUDA graph capture refuses: the
    demo then runs every step eagerly, with the same tokens."""
    cfg = DemoConfig(requests=3, max_prompt=40, max_output=8, max_batch_tokens=24, max_seqs=3,
                     model="tiny", dtype="float32", num_q_heads=4, num_kv_heads=2, seed=12)
    ref = run_demo(cfg, np)
    monkeypatch.setenv("CUPAGED_STRICT", "1")
    gpu = run_demo(cfg, cp)
    assert gpu.graph_steps == 0 < gpu.steps
    assert gpu.tokens == ref.tokens


@pytest.mark.gpu
@pytest.mark.parametrize("layout, kv_dtype", [("NHD", None), ("vllm", None),
                                              ("NHD", "fp8_e4m3"), ("vllm", "fp8_e5m2")])
def test_gpu_decode_graphs_match_eager_steps(cp, layout, kv_dtype):
    """Decode steps replayed from CUDA graphs (captured per power-of-two batch, replayed with
    other sequences, lengths and tokens) give the eager step's logits and cache writes
    (an fp8 cache: its values compared, within one step of the format)."""
    from cupaged.engine.layers import AttentionMetadata
    from cupaged.engine.model import DecodeGraphs
    from cupaged.reference.fp8 import quantize
    cfg = small(layout=layout, kv_dtype=kv_dtype)
    model = TinyLlama(cfg, cp)
    rng = np.random.default_rng(3)
    bs, width, num_seqs = 16, 8, 6
    k, v = model.allocate_cache(num_seqs * width, bs)
    for c in (k, v):
        past = rng.standard_normal(c.shape)
        c[...] = cp.asarray(past if kv_dtype is None else quantize(past, np.float32(1), kv_dtype),
                            c.dtype)
    k_eager, v_eager = k.copy(), v.copy()
    tables = rng.permutation(num_seqs * width).astype(np.int32).reshape(num_seqs, width)
    lens = rng.integers(5, 90, num_seqs).astype(np.int32)
    stream = cp.cuda.Stream(non_blocking=True)
    graphs = DecodeGraphs(model, k, v, width, stream)
    for batch in (5, 3, 5, 4, 1, 2, 6):  # buckets 8, 4, 8 (replay), 4 (replay), 1, 2, 8 (replay)
        seqs = np.sort(rng.choice(num_seqs, batch, replace=False))
        lens[seqs] += 1
        sl, bt = lens[seqs], tables[seqs]
        slots = (bt[np.arange(batch), (sl - 1) // bs].astype(np.int64) * bs + (sl - 1) % bs)
        ids = rng.integers(0, cfg.vocab_size, batch).astype(np.int32)
        with stream:
            got = graphs.step(ids, sl, bt, slots).get()
            md = AttentionMetadata(np.arange(batch + 1, dtype=np.int32), sl, bt, slots, xp=cp)
            want = model.forward(ids, md, k_eager, v_eager).get()
        assert got.shape == want.shape == (batch, cfg.vocab_size)
        assert np.linalg.norm(got - want) <= 1e-2 * np.linalg.norm(want), batch
    assert graphs.replays == 3
    fmt = None if kv_dtype is None else FP8_FORMATS[kv_dtype]
    for got, want in ((k, k_eager), (v, v_eager)):
        got, want = (c.get() if fmt is None else c.get().view(fmt.dtype) for c in (got, want))
        tol = 1e-2 if fmt is None else 2.0 ** -fmt.mantissa_bits
        np.testing.assert_allclose(got.astype(np.float32), want.astype(np.float32), rtol=tol,
                                   atol=1e-2 if fmt is None else fmt.min_subnormal)


@pytest.mark.gpu
def test_gpu_demo_replays_decode_steps(cp):
    """The demo's decode-only steps come from CUDA graphs and its tokens still match the
    NumPy model."""
    cfg = DemoConfig(requests=12, max_prompt=40, max_output=24, check=True)
    stats = run_demo(cfg, cp)
    assert stats.graph_steps > 0
    assert stats.max_rel_error <= CHECK_TOLERANCE[cfg.dtype]
    matches, total = stats.argmax_matches
    assert matches == total


@pytest.mark.gpu
@pytest.mark.parametrize("m, k, n", [(1, 512, 512), (37, 64, 19), (16, 17, 33), (0, 8, 8)])
def test_gpu_gemm_matches_numpy(cp, m, k, n):
    """The captured steps' GEMM against float64 NumPy, a strided (column-sliced) operand too;
    every output element written (poisoned pool memory is overwritten)."""
    from cupaged.engine.model import gemm
    rng = np.random.default_rng(m * 7 + n)
    a_full = rng.standard_normal((m, 2 * k), dtype=np.float32)
    b = rng.standard_normal((k, n), dtype=np.float32)
    a_dev, b_dev = cp.asarray(a_full)[:, :k], cp.asarray(b)  # a: rows 2k apart
    poison = cp.full(m * n, np.nan, np.float32)  # its pool block is the output's
    del poison
    got = gemm(a_dev, b_dev).get()
    want = a_full[:, :k].astype(np.float64) @ b.astype(np.float64)
    assert got.shape == (m, n)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4 * np.sqrt(k))
