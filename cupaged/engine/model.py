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

``generate`` (prefill every prompt in one step, then decode) and ``score`` (teacher-forced
logits of one sequence) drive a model without a scheduler; ``cupaged demo`` drives it with
one (``cupaged.engine.demo``).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..core.arrays import as_dtype, check_choice, check_head_dim, cupy_module, gpu_available, host
from ..core.checks import check_int
from ..core.layouts import LAYOUTS, cache_shapes

__all__ = ["TinyLlamaConfig", "TinyLlama", "generate", "score", "check_generation"]


@dataclass(frozen=True)
class TinyLlamaConfig:
    """Sizes of a ``TinyLlama``; the defaults make a 2-layer, 512-wide model.

    ``hidden_size = num_q_heads * head_dim``. ``dtype`` is the dtype of queries, keys,
    values and caches (float16, bfloat16 or float32); ``layout`` the cache layout.
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
            layout=config.layout)

    def allocate_cache(self, num_blocks, block_size):
        """Zeroed key and value caches of every layer.

        Returns
        -------
        k_cache, v_cache : array
            ``[num_layers, *cache_shape]`` in the model's dtype and array module, where
            ``cache_shape`` is ``cupaged.layouts.cache_shapes(layout, num_blocks, block_size,
            num_kv_heads, head_dim, dtype)``; ``k_cache[l]`` is layer ``l``'s cache.
        """
        config = self.config
        k_shape, v_shape = cache_shapes(config.layout, num_blocks, block_size, config.num_kv_heads,
                                        config.head_dim, self.dtype)
        return (self.xp.zeros((config.num_layers, *k_shape), self.dtype),
                self.xp.zeros((config.num_layers, *v_shape), self.dtype))

    def _rms_norm(self, x, weight):
        xp = self.xp
        scale = 1.0 / xp.sqrt(xp.mean(x * x, axis=-1, keepdims=True) + np.float32(self.config.rms_eps))
        return x * scale * weight

    def _attention(self, layer, l, x, metadata, positions, k_cache, v_cache):
        config = self.config
        qd, kd = config.num_q_heads * config.head_dim, config.num_kv_heads * config.head_dim
        qkv = (self._rms_norm(x, layer["attn_norm"]) @ layer["wqkv"]).astype(self.dtype)
        q, k, v = qkv[:, :qd], qkv[:, qd:qd + kd], qkv[:, qd + kd:]
        out = self.attention.forward(positions, q, k, v,
                                     k_cache[l], v_cache[l], metadata)
        return out.astype(np.float32) @ layer["wo"]

    def _mlp(self, layer, x):
        gate_up = self._rms_norm(x, layer["mlp_norm"]) @ layer["w_gate_up"]
        gate, up = gate_up[:, :self.config.intermediate_size], gate_up[:, self.config.intermediate_size:]
        return (gate / (1.0 + self.xp.exp(-gate)) * up) @ layer["w_down"]

    def forward(self, token_ids, metadata, k_cache, v_cache, logits_rows=None):
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
        positions = metadata.positions[:n]
        x = self.embed[ids[:n]]
        for l, layer in enumerate(self.layers):
            x = x + self._attention(layer, l, x, metadata, positions, k_cache, v_cache)
            x = x + self._mlp(layer, x)
        if logits_rows is not None:
            x = x[xp.asarray(logits_rows, dtype=np.int64)]
        return self._rms_norm(x, self.final_norm) @ self.lm_head


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


def check_generation(config, runs, *, block_size=16):
    """Compare generated tokens and their logits with the NumPy model (teacher forcing).

    Parameters
    ----------
    config : TinyLlamaConfig
        The configuration (and so the weights) of the model that generated.
    runs : sequence of (prompt, tokens, logits)
        Per request: int ``[p]`` prompt ids, int ``[n]`` generated ids and float32
        ``[n, vocab_size]`` logits each token was chosen from (host arrays).
    block_size : int
        Cache block size of the reference runs.

    Returns
    -------
    max_rel_error : float
        Largest ``||logits - ref|| / ||ref||`` over the requests, where ``ref`` are the
        reference model's logits of the same sequence (prompt + tokens[:-1]).
    matches, total : int
        Generated tokens that equal the reference argmax, and all generated tokens.
    """
    ref_model = TinyLlama(config, np)
    worst, matches, total = 0.0, 0, 0
    for prompt, tokens, logits in runs:
        tokens = np.asarray(tokens)
        seq = np.concatenate([np.asarray(prompt), tokens[:-1]])
        ref = score(ref_model, seq, block_size=block_size)[len(prompt) - 1:]
        diff = np.linalg.norm(np.asarray(logits, np.float64) - ref)
        worst = max(worst, float(diff / max(np.linalg.norm(ref), 1e-30)))
        matches += int((ref.argmax(axis=-1) == tokens).sum())
        total += len(tokens)
    return worst, matches, total
