"""A tiny Llama-style decoder over the paged KV cache, in NumPy or CuPy (no torch).

``TinyLlama`` runs, per layer, RMSNorm -> grouped-query attention with rotary embedding
(``cupaged.layers.PagedAttentionWithRoPE``: ``apply_rope``, ``write_kv_cache``,
``paged_attention`` over the layer's paged cache) -> RMSNorm -> SwiGLU MLP, then a final
RMSNorm and an LM head; tokens are chosen greedily. One ``forward`` call runs one batch step
of a continuous-batching engine: any mix of prompt chunks and decode tokens.

Weights come from a seeded NumPy generator, so the NumPy model (reference backend) and the
CuPy model (CUDA kernels) hold identical weights and their greedy tokens can be compared.
The residual stream and the matmuls are float32; queries, keys, values and the caches are
in the configured dtype, as in an engine whose attention runs in half precision. The LM
head is scaled so that logits spread over a few units and greedy choices are not near-ties.

With ``kv_dtype`` the caches are fp8 (1-byte elements, docs/design.md "fp8 caches"), and
each layer's ``k_scale`` / ``v_scale`` are float32 ``[num_kv_heads]`` fixed from the weights
(:func:`kv_scales`): an attention input is RMS-normalised, so the weights bound every key
and value it can produce, and a scale of that bound over the format's largest value keeps
every write inside the format's range without a calibration pass (the same scales on
NumPy and CuPy, and in a captured CUDA graph).

``generate`` (prefill every prompt in one step, then decode) and ``score`` (teacher-forced
logits of one sequence) drive a model without a scheduler; ``cupaged demo`` drives it with
one (``cupaged.engine.demo``).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from ..core.arrays import as_dtype, check_choice, check_head_dim, cupy_module, gpu_available, host
from ..core.checks import check_int
from ..core.fp8 import cache_element_dtype, fp8_format
from ..core.layouts import LAYOUTS, cache_shapes

__all__ = ["TinyLlamaConfig", "TinyLlama", "kv_scales", "generate", "score",
           "check_generation", "GenerationCheck"]


@dataclass(frozen=True)
class TinyLlamaConfig:
    """Sizes of a ``TinyLlama``; the defaults make a 2-layer, 512-wide model.

    ``hidden_size = num_q_heads * head_dim``. ``dtype`` is the dtype of queries, keys,
    values and caches (float16, bfloat16 or float32); ``layout`` the cache layout;
    ``kv_dtype`` None (caches of ``dtype``) or an fp8 format, "fp8_e4m3" or "fp8_e5m2", of
    the caches (the kernels take them under float16 / bfloat16 and head_dim 64 or 128).
    """
    vocab_size: int = 512
    num_layers: int = 2
    num_q_heads: int = 8
    num_kv_heads: int = 2
    head_dim: int = 64
    intermediate_size: int = 1024
    rope_base: float = 10000.0
    max_position: int = 8192
    rms_eps: float = 1e-5
    logit_scale: float = 4.0
    dtype: str = "float16"
    layout: str = "NHD"
    seed: int = 0
    kv_dtype: str | None = None

    @property
    def hidden_size(self) -> int:
        """Width of the residual stream, ``num_q_heads * head_dim``."""
        return self.num_q_heads * self.head_dim

    def validate(self):
        """Raise ValueError/TypeError naming the first bad field."""
        for name in ("vocab_size", "num_layers", "num_q_heads", "num_kv_heads",
                     "intermediate_size", "max_position"):
            check_int(name, getattr(self, name))
        check_head_dim("head_dim", self.head_dim)
        if self.num_q_heads % self.num_kv_heads:
            raise ValueError(f"num_kv_heads: expected a divisor of num_q_heads = "
                             f"{self.num_q_heads}, got {self.num_kv_heads}")
        as_dtype(self.dtype)
        check_choice("layout", self.layout, LAYOUTS)
        if self.kv_dtype is not None:
            fp8_format(self.kv_dtype)
        for name in ("rope_base", "rms_eps", "logit_scale"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name}: expected a float > 0, got {getattr(self, name)!r}")


def init_weights(config):
    """float32 NumPy weights drawn from ``config.seed``.

    Returns
    -------
    dict
        ``embed [vocab, hidden]``, ``final_norm [hidden]``, ``lm_head [hidden, vocab]`` and
        ``layers``: one dict per layer with ``attn_norm [hidden]``,
        ``wqkv [hidden, (num_q_heads + 2 num_kv_heads) head_dim]``, ``wo [hidden, hidden]``,
        ``mlp_norm [hidden]``, ``w_gate_up [hidden, 2 intermediate]``,
        ``w_down [intermediate, hidden]``.
    """
    rng = np.random.default_rng(config.seed)
    h, d, inter = config.hidden_size, config.head_dim, config.intermediate_size
    qkv = (config.num_q_heads + 2 * config.num_kv_heads) * d

    def normal(shape, std):
        return (rng.standard_normal(shape, dtype=np.float32) * np.float32(std))

    def norm_weight():
        return 1.0 + normal(h, 0.1)

    layers = [dict(attn_norm=norm_weight(), wqkv=normal((h, qkv), h ** -0.5),
                   wo=normal((h, h), 0.5 * h ** -0.5), mlp_norm=norm_weight(),
                   w_gate_up=normal((h, 2 * inter), h ** -0.5),
                   w_down=normal((inter, h), 0.5 * inter ** -0.5))
              for _ in range(config.num_layers)]
    return dict(embed=normal((config.vocab_size, h), 1.0), layers=layers,
                final_norm=norm_weight(),
                lm_head=normal((h, config.vocab_size), config.logit_scale * h ** -0.5))


def kv_scales(config, weights=None):
    """Per-layer fp8 scales that no key or value of the model exceeds.

    A layer's attention input ``rms_norm(x) * attn_norm`` has Euclidean norm at most
    ``sqrt(hidden) * max|attn_norm|`` whatever ``x`` is, so output column ``j`` of ``wqkv``
    is at most that times ``||wqkv[:, j]||`` in magnitude (Cauchy-Schwarz). RoPE turns the
    key pair ``(j, j + head_dim / 2)`` in its plane: a rotated key is bounded by the pair's
    joint bound. A head's scale is its largest bound over the format's largest finite value,
    so writes saturate only by the rounding of the 16-bit rows, and typical keys and values
    (about ``sqrt(hidden)`` times smaller than the bound) stay in the format's normal range.

    Parameters
    ----------
    config : TinyLlamaConfig
        A configuration with ``kv_dtype`` set.
    weights : dict, optional
        :func:`init_weights` of ``config`` (drawn here when not given).

    Returns
    -------
    list of (numpy.ndarray, numpy.ndarray)
        Per layer ``(k_scale, v_scale)``, each float32 ``[num_kv_heads]``.
    """
    fmt = fp8_format(config.kv_dtype)
    w = init_weights(config) if weights is None else weights
    hq, hk, d = config.num_q_heads, config.num_kv_heads, config.head_dim
    scales = []
    for layer in w["layers"]:
        reach = np.sqrt(config.hidden_size) * np.abs(layer["attn_norm"].astype(np.float64)).max()
        cols = reach * np.linalg.norm(layer["wqkv"].astype(np.float64), axis=0)
        k = cols[hq * d:(hq + hk) * d].reshape(hk, 2, d // 2)
        v = cols[(hq + hk) * d:].reshape(hk, d)
        k_bound = np.sqrt((k * k).sum(axis=1)).max(axis=1)   # neox pairs (j, j + d/2)
        scales.append(((k_bound / fmt.max).astype(np.float32),
                       (v.max(axis=1) / fmt.max).astype(np.float32)))
    return scales


def _default_module():
    return cupy_module() if gpu_available() else np


class TinyLlama:
    """A random-weight Llama-style decoder whose attention runs on cupaged's paged cache.

    Parameters
    ----------
    config : TinyLlamaConfig
    xp : module, optional
        ``numpy`` (reference backend) or ``cupy`` (kernels); default cupy when a GPU is
        usable.

    Attributes
    ----------
    kv_scales : list of dict
        Per layer ``{"k_scale": ..., "v_scale": ...}``, float32 ``[num_kv_heads]`` in ``xp``
        (:func:`kv_scales`) for an fp8 ``config.kv_dtype``; empty dicts otherwise.
    """

    def __init__(self, config=TinyLlamaConfig(), xp=None):
        from .layers import PagedAttentionWithRoPE
        config.validate()
        self.config = config
        self.xp = _default_module() if xp is None else xp
        self.dtype = as_dtype(config.dtype)
        w = init_weights(config)
        up = self.xp.asarray
        self.embed, self.final_norm, self.lm_head = up(w["embed"]), up(w["final_norm"]), up(w["lm_head"])
        self.layers = [{k: up(v) for k, v in layer.items()} for layer in w["layers"]]
        d = config.head_dim
        self.attention = PagedAttentionWithRoPE(
            config.num_q_heads, d, d ** -0.5, rotary_dim=d, max_position=config.max_position,
            base=config.rope_base, num_kv_heads=config.num_kv_heads, is_neox_style=True,
            layout=config.layout, kv_dtype=config.kv_dtype)
        self.kv_scales = ([dict(k_scale=up(k), v_scale=up(v)) for k, v in kv_scales(config, w)]
                          if config.kv_dtype is not None else [{}] * config.num_layers)

    def allocate_cache(self, num_blocks, block_size):
        """Zeroed key and value caches of every layer.

        Returns
        -------
        k_cache, v_cache : array
            ``[num_layers, *cache_shape]`` in the model's array module, where
            ``cache_shape`` is ``cupaged.layouts.cache_shapes(layout, num_blocks, block_size,
            num_kv_heads, head_dim, kv_dtype or dtype)``; ``k_cache[l]`` is layer ``l``'s
            cache. Elements are the model's dtype, or with ``kv_dtype`` 1 byte (the
            format's float8 dtype in NumPy, uint8 in CuPy).
        """
        config = self.config
        if config.kv_dtype is None:
            elements, shape_dtype = self.dtype, self.dtype
        else:
            elements = cache_element_dtype(fp8_format(config.kv_dtype), self.xp)
            shape_dtype = config.kv_dtype
        k_shape, v_shape = cache_shapes(config.layout, num_blocks, block_size, config.num_kv_heads,
                                        config.head_dim, shape_dtype)
        return (self.xp.zeros((config.num_layers, *k_shape), elements),
                self.xp.zeros((config.num_layers, *v_shape), elements))

    def _rms_norm(self, x, weight):
        xp = self.xp
        scale = 1.0 / xp.sqrt(xp.mean(x * x, axis=-1, keepdims=True) + np.float32(self.config.rms_eps))
        return x * scale * weight

    def _attention(self, layer, l, x, metadata, positions, k_cache, v_cache, mm):
        config = self.config
        qd, kd = config.num_q_heads * config.head_dim, config.num_kv_heads * config.head_dim
        qkv = mm(self._rms_norm(x, layer["attn_norm"]), layer["wqkv"]).astype(self.dtype)
        q, k, v = qkv[:, :qd], qkv[:, qd:qd + kd], qkv[:, qd + kd:]
        out = self.attention.forward(positions, q, k, v, k_cache[l], v_cache[l], metadata,
                                     **self.kv_scales[l])
        return mm(out.astype(np.float32), layer["wo"])

    def _mlp(self, layer, x, mm):
        gate_up = mm(self._rms_norm(x, layer["mlp_norm"]), layer["w_gate_up"])
        gate, up = gate_up[:, :self.config.intermediate_size], gate_up[:, self.config.intermediate_size:]
        return mm(gate / (1.0 + self.xp.exp(-gate)) * up, layer["w_down"])

    def forward(self, token_ids, metadata, k_cache, v_cache, logits_rows=None, *, matmul=None):
        """One batch step: write the tokens' keys and values, return logits.

        Parameters
        ----------
        token_ids : array
            int32 ``[num_tokens]`` (NumPy or the model's module): the step's tokens in
            ``metadata`` row order (sequence ``i`` owns rows ``[cu_seqlens_q[i],
            cu_seqlens_q[i + 1])``, the last ``q_len_i`` of its ``seq_lens[i]`` positions).
        metadata : cupaged.layers.AttentionMetadata
            The step's lengths, block tables and slot mapping, in the model's module.
        k_cache, v_cache : array
            ``allocate_cache``'s caches, updated in place.
        logits_rows : array, optional
            int ``[num_rows]`` rows whose logits are wanted (default: every row).
        matmul : callable, optional
            ``matmul(a, b)`` of two float32 matrices (default ``a @ b``); :func:`gemm`
            where a CUDA graph is captured.

        Returns
        -------
        array
            float32 ``[num_rows, vocab_size]`` logits, in the model's module.
        """
        xp = self.xp
        n = metadata.num_valid_tokens
        if isinstance(token_ids, np.ndarray):  # host ids: checked before the upload
            ids = np.asarray(token_ids, dtype=np.int32)
            if ids.size and (ids.min() < 0 or ids.max() >= self.config.vocab_size):
                raise ValueError(f"token_ids: expected ids in [0, {self.config.vocab_size}), "
                                 f"got range [{ids.min()}, {ids.max()}]")
        ids = xp.asarray(token_ids, dtype=np.int32)
        if ids.ndim != 1 or (n is not None and ids.shape[0] < n):
            raise ValueError(f"token_ids: expected int32 [num_tokens >= {n}], got shape "
                             f"{tuple(ids.shape)}")
        n = ids.shape[0] if n is None else n
        mm = _matmul if matmul is None else matmul
        positions = metadata.positions[:n]
        x = self.embed[ids[:n]]
        for l, layer in enumerate(self.layers):
            x = x + self._attention(layer, l, x, metadata, positions, k_cache, v_cache, mm)
            x = x + self._mlp(layer, x, mm)
        if logits_rows is not None:
            x = x[xp.asarray(logits_rows, dtype=np.int64)]
        return mm(self._rms_norm(x, self.final_norm), self.lm_head)


# ----------------------------------------------------------------------------- CUDA graphs
GEMM_TILE = 16


def _matmul(a, b):
    return a @ b


def _gemm_expr():
    return f"cupaged::gemm_f32<{GEMM_TILE}>"


def kernel_specializations():
    """The model's one kernel: the float32 GEMM of its captured steps."""
    from ..core.compile import Spec
    return [Spec("gemm", _gemm_expr())]


def gemm(a, b):
    """``a @ b`` of float32 CuPy matrices by ``kernels_cu/gemm.cu``, on the current stream
    (capturable where CuPy's own matmul, through cuBLAS, is refused).

    Parameters
    ----------
    a : cupy.ndarray
        float32 ``[m, k]``, last dimension contiguous.
    b : cupy.ndarray
        float32 ``[k, n]``, last dimension contiguous.

    Returns
    -------
    cupy.ndarray
        float32 ``[m, n]``.
    """
    import cupy
    from ..core import abi
    from ..core.compile import launcher
    a, b = (x if x.strides[1] == 4 else cupy.ascontiguousarray(x) for x in (a, b))
    (m, k), n = a.shape, b.shape[1]
    c = cupy.empty((m, n), np.float32)
    launcher("gemm", _gemm_expr(), abi.GEMM)(
        (-(-n // GEMM_TILE), -(-m // GEMM_TILE)), (GEMM_TILE, GEMM_TILE), a=a.data.ptr,
        b=b.data.ptr, c=c.data.ptr, lda=a.strides[0] // 4, ldb=b.strides[0] // 4, ldc=n, m=m,
        n=n, k=k)
    return c

def _bucket(batch):
    """Batch size a decode graph is captured for: ``batch`` rounded up to a power of two."""
    return 1 << max(batch - 1, 0).bit_length()


def _begin_capture(stream):
    """Capture in relaxed mode where CuPy offers it (a graph's pool may still allocate)."""
    import cupy
    relaxed = getattr(cupy.cuda.runtime, "streamCaptureModeRelaxed", None)
    try:
        stream.begin_capture(mode=relaxed) if relaxed is not None else stream.begin_capture()
    except TypeError:  # a CuPy without the mode argument
        stream.begin_capture()


class DecodeGraphs:
    """Decode steps of a CuPy :class:`TinyLlama` replayed from CUDA graphs.

    One graph per batch size rounded up to a power of two holds a whole decode step: every
    layer's rotation, cache write, decode plan and decode, and the MLPs and LM head. A step
    copies its metadata into the graph's fixed device buffers (one asynchronous upload)
    and replays the graph on ``stream``; padding sequences have no keys and skip the cache
    write. The first step of a size runs eagerly (kernels loaded, memory pooled), then the
    graph is captured with its own memory pool (freed intermediates stay the graph's).

    Parameters
    ----------
    model : TinyLlama
        A CuPy model.
    k_cache, v_cache : array
        ``model.allocate_cache`` caches.
    width : int
        Block-table width of every step.
    stream : cupy.cuda.Stream
        A non-default stream every step of the engine runs on (graphs replay there).
    """

    def __init__(self, model, k_cache, v_cache, width, stream):
        from ..core.device import Uploader
        self.model, self.k, self.v, self.width, self.stream = model, k_cache, v_cache, width, stream
        self._graphs = {}
        self._uploader = Uploader(slots=8)
        self.replays = 0

    def _layout(self, bucket):
        """(name, dtype, shape, byte offset) of each input of a graph, and the total bytes."""
        parts, at = [], 0
        for name, dtype, shape in (("slots", np.int64, (bucket,)),
                                   ("ids", np.int32, (bucket,)),
                                   ("cu", np.int32, (bucket + 1,)),
                                   ("seq_lens", np.int32, (bucket,)),
                                   ("positions", np.int32, (bucket,)),
                                   ("tables", np.int32, (bucket, self.width))):
            parts.append((name, np.dtype(dtype), shape, at))
            at += int(np.prod(shape)) * np.dtype(dtype).itemsize
        return parts, at

    def _image(self, parts, size, ids, seq_lens, block_tables, slots):
        image = np.zeros(size, np.uint8)
        b = len(ids)
        for name, dtype, shape, at in parts:
            a = image[at:at + int(np.prod(shape)) * dtype.itemsize].view(dtype).reshape(shape)
            if name == "slots":
                a[:] = -1
                a[:b] = slots
            elif name == "ids":
                a[:b] = ids
            elif name == "cu":
                a[:] = np.arange(shape[0])
            elif name == "seq_lens":
                a[:b] = seq_lens
            elif name == "positions":
                a[:b] = np.asarray(seq_lens) - 1
            else:
                a[:] = -1
                a[:b, :block_tables.shape[1]] = block_tables
        return image

    def step(self, ids, seq_lens, block_tables, slots):
        """Logits of one decode step.

        Parameters
        ----------
        ids : numpy.ndarray
            int32 ``[batch]``: each sequence's new token.
        seq_lens : numpy.ndarray
            int32 ``[batch]`` keys including the new token.
        block_tables : numpy.ndarray
            int32 ``[batch, <= width]``.
        slots : numpy.ndarray
            int64 ``[batch]`` cache slot of each new token.

        Returns
        -------
        cupy.ndarray
            float32 ``[batch, vocab_size]``, valid until the next step of its batch size.
        """
        batch = len(ids)
        bucket = _bucket(batch)
        entry = self._graphs.get(bucket)
        with self.stream:
            if entry is None:
                entry, logits = self._capture(bucket, ids, seq_lens, block_tables, slots)
                self._graphs[bucket] = entry
                return logits[:batch]
            buf, parts, size, graph, logits = entry[:5]
            self._uploader.upload(buf, self._image(parts, size, ids, seq_lens, block_tables,
                                                   slots))
            graph.launch(self.stream)
            self.replays += 1
            return logits[:batch]

    def _capture(self, bucket, ids, seq_lens, block_tables, slots):
        """A graph for ``bucket`` sequences, and the logits of this step (run eagerly)."""
        import cupy
        from .layers import AttentionMetadata
        parts, size = self._layout(bucket)
        pool = cupy.cuda.MemoryPool()
        with cupy.cuda.using_allocator(pool.malloc):
            buf = cupy.empty(size, np.uint8)
            v = {name: buf[at:at + int(np.prod(shape)) * dtype.itemsize].view(dtype).reshape(shape)
                 for name, dtype, shape, at in parts}
            self._uploader.upload(buf, self._image(parts, size, ids, seq_lens, block_tables,
                                                   slots))

            def forward():
                md = AttentionMetadata(v["cu"], v["seq_lens"], v["tables"], v["slots"],
                                       v["positions"], max_query_len=1, xp=cupy)
                return md, self.model.forward(v["ids"], md, self.k, self.v, matmul=gemm)

            _, eager = forward()  # this step; kernels loaded, the pool holds its sizes
            _begin_capture(self.stream)
            try:
                md, logits = forward()  # a fresh step object: its plan copies are captured
            finally:
                graph = self.stream.end_capture()
        return (buf, parts, size, graph, logits, md, pool), eager


# ----------------------------------------------------------------------------- drivers
def _blocks(tokens, block_size):
    return -(-tokens // block_size)


class _Session:
    """A block table and per-layer caches for a fixed set of sequences (no scheduler)."""

    def __init__(self, model, max_tokens, num_seqs, block_size):
        from .blocks import BlockPool, BlockTable
        max_blocks = _blocks(max_tokens, block_size)
        self.model, self.xp = model, model.xp
        self.table = BlockTable(BlockPool(num_seqs * max_blocks, block_size), num_seqs, max_blocks)
        self.k, self.v = model.allocate_cache(num_seqs * max_blocks, block_size)

    def step(self, rows, logits_rows):
        """Run ``rows`` (one ``(seq_id, tokens)`` per sequence) as one batch step."""
        from .layers import AttentionMetadata
        xp = self.xp
        slots = np.concatenate([self.table.append(i, len(t)) for i, t in rows])
        ids = [i for i, _ in rows]
        cu = np.zeros(len(rows) + 1, np.int32)
        cu[1:] = np.cumsum([len(t) for _, t in rows])
        md = AttentionMetadata(cu, self.table.seq_lens[ids], self.table.block_tables[ids],
                               slots, xp=xp)
        tokens = np.concatenate([np.asarray(t, np.int32) for _, t in rows])
        return self.model.forward(tokens, md, self.k, self.v, logits_rows(cu))


def generate(model, prompts, max_new_tokens, *, block_size=16):
    """Greedy continuation of each prompt: one step prefills every prompt, then one decode
    step per new token for all sequences together.

    Parameters
    ----------
    model : TinyLlama
    prompts : sequence of sequence of int
        Token ids, each prompt at least one token.
    max_new_tokens : int
        Tokens generated per prompt (>= 1).
    block_size : int
        Cache block size.

    Returns
    -------
    tokens : numpy.ndarray
        int64 ``[num_prompts, max_new_tokens]`` greedy tokens.
    logits : numpy.ndarray
        float32 ``[num_prompts, max_new_tokens, vocab_size]``: the logits each token was
        chosen from.
    """
    if max_new_tokens < 1 or not prompts or min(len(p) for p in prompts) < 1:
        raise ValueError(f"prompts, max_new_tokens: expected non-empty prompts and >= 1 new "
                         f"token, got {len(prompts)} prompts and {max_new_tokens}")
    longest = max(len(p) for p in prompts) + max_new_tokens
    session = _Session(model, longest, len(prompts), block_size)
    rows = [(i, list(p)) for i, p in enumerate(prompts)]
    tokens, logits = [], []
    for _ in range(max_new_tokens):
        step_logits = host(session.step(rows, lambda cu: cu[1:] - 1))
        chosen = step_logits.argmax(axis=-1)
        tokens.append(chosen)
        logits.append(step_logits)
        rows = [(i, [int(t)]) for i, t in enumerate(chosen)]
    return np.stack(tokens, axis=1), np.stack(logits, axis=1)


def score(model, tokens, *, block_size=16):
    """Teacher-forced logits of one sequence, run as a single prompt step.

    Parameters
    ----------
    model : TinyLlama
    tokens : sequence of int
        ``[n]`` token ids, ``n >= 1``.

    Returns
    -------
    numpy.ndarray
        float32 ``[n, vocab_size]``: row ``i`` predicts token ``i + 1``.
    """
    tokens = list(tokens)
    if not tokens:
        raise ValueError("tokens: expected at least one token, got none")
    session = _Session(model, len(tokens), 1, block_size)
    return host(session.step([(0, tokens)], lambda cu: np.arange(cu[-1])))


class GenerationCheck(NamedTuple):
    """How generated logits compare with a reference model's (:func:`check_generation`).

    ``max_rel_error`` is the largest ``||logits - ref|| / ||ref||`` over the requests,
    ``max_abs_error`` the largest ``|logits - ref|`` of any element, ``matches`` the generated
    tokens equal to the reference's argmax, ``total`` all generated tokens.
    """
    max_rel_error: float
    max_abs_error: float
    matches: int
    total: int


def check_generation(config, runs, *, block_size=16, xp=np):
    """Compare generated tokens and their logits with a reference model (teacher forcing).

    Parameters
    ----------
    config : TinyLlamaConfig
        The reference's configuration (the weights, dtype, cache format): the generating
        model's to check a backend, or the same with another ``kv_dtype`` to measure a cache
        format.
    runs : sequence of (prompt, tokens, logits)
        Per request: int ``[p]`` prompt ids, int ``[n]`` generated ids and float32
        ``[n, vocab_size]`` logits each token was chosen from (host arrays).
    block_size : int
        Cache block size of the reference runs.
    xp : module
        Array module of the reference model (default ``numpy``, the reference backend).

    Returns
    -------
    GenerationCheck
        Errors of the logits against the reference model's logits of the same sequence
        (prompt + tokens[:-1]), and the tokens that equal the reference argmax.
    """
    ref_model = TinyLlama(config, xp)
    worst, worst_abs, matches, total = 0.0, 0.0, 0, 0
    for prompt, tokens, logits in runs:
        tokens = np.asarray(tokens)
        seq = np.concatenate([np.asarray(prompt), tokens[:-1]])
        ref = score(ref_model, seq, block_size=block_size)[len(prompt) - 1:]
        diff = np.asarray(logits, np.float64) - ref
        worst = max(worst, float(np.linalg.norm(diff) / max(np.linalg.norm(ref), 1e-30)))
        worst_abs = max(worst_abs, float(np.abs(diff).max(initial=0.0)))
        matches += int((ref.argmax(axis=-1) == tokens).sum())
        total += len(tokens)
    return GenerationCheck(worst, worst_abs, matches, total)
