"""cupaged as an attention backend of Hugging Face transformers.

Importing this module imports torch and transformers and registers two attention
implementations (and the mask function of the first):

- ``"cupaged"``: a standard implementation, used by ``model.generate`` and plain forwards.
  Prefill queries ``[batch, num_q_heads, q_len, head_dim]`` and the keys/values of the
  model's cache ``[batch, num_kv_heads, kv_len, head_dim]`` are packed into a ragged batch
  (padding removed through the 2-D padding mask, as for flash attention; the layout is read
  once per forward) and run by ``cupaged.varlen_prefill`` with bottom-right causal
  alignment. Decode steps (one query a sequence) run ``cupaged.paged_decode`` on the cache
  as it is: without padding ``[batch, num_kv_heads, kv_len, head_dim]`` is an HND cache of
  one block a sequence; with left padding the keys are laid token-major once a layer and a
  token-granular block table (built on the device once a step) skips the padded ones.
- ``"paged|cupaged"``: the paged implementation of transformers' continuous batching
  (``model.generate_batch``). For full-attention layers it writes the new keys and values
  into the ``PagedAttentionCache`` through ``write_index`` and attends on the cache itself:
  the block tables are read off ``read_index`` on the device, decode-only batches run
  ``cupaged.paged_decode`` (split-KV), others ``cupaged.paged_attention``; no gather of the
  history, no host sync, so it runs under the continuous-batching CUDA graphs. Sliding-window
  layer groups read through ``cache.update`` and run ``cupaged.varlen_prefill``; a given
  ``block_table`` (transformers' decode fast path) runs ``cupaged.paged_decode`` with the
  append in place.

Both take ``scaling``, ``sliding_window`` (``window_left = sliding_window - 1``), ``softcap``
and ``s_aux`` (per-head sink logits, gpt-oss) and return ``(out, None)`` with ``out`` in the
layout transformers expects. CUDA tensors are shared with CuPy through DLPack (no copies
besides packing heads) and the kernels run on torch's current stream; CPU tensors run the
NumPy reference backend (float64 math, for tests). Inference only: no autograd.

Examples
--------
>>> import cupaged.integrations.transformers                     # registers
>>> model = LlamaForCausalLM(config).cuda().half().eval()
>>> model.set_attn_implementation("cupaged")
>>> model.generate(input_ids, max_new_tokens=16, do_sample=False)
>>> model.generate_batch(prompts, GenerationConfig(max_new_tokens=16, do_sample=False))
"""
from __future__ import annotations

import numpy as np
import torch
from transformers import AttentionInterface, AttentionMaskInterface
from transformers.masking_utils import flash_attention_mask

import weakref

from ..core.arrays import bfloat16
from ..cache_ops.api import write_kv_cache
from ..decode.api import paged_decode
from ..prefill.api import paged_attention, varlen_prefill

NAME = "cupaged"
PAGED_NAME = "paged|cupaged"

__all__ = ["NAME", "PAGED_NAME", "register", "attention_forward", "paged_attention_forward"]


# ----------------------------------------------------------------------------- tensors
def _array(t):
    """What cupaged takes of ``t``: the CUDA tensor itself (read on torch's current stream)
    or a NumPy array sharing a CPU tensor's memory."""
    if t.device.type == "cuda":
        return t
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(bfloat16)
    return t.numpy()


# ----------------------------------------------------------------------------- options
def _check_inference(query, key, value, dropout):
    if dropout:
        raise ValueError(f"dropout: expected 0.0 (cupaged attention is inference-only), "
                         f"got {dropout}")
    if torch.is_grad_enabled() and any(t.requires_grad for t in (query, key, value)):
        raise ValueError("query: expected tensors without autograd history (cupaged attention "
                         "is inference-only: run under torch.no_grad() or "
                         "torch.inference_mode()), got requires_grad=True")


def _window(module, sliding_window):
    """The layer's sliding window (keyword first, then the module's attribute) or None."""
    window = sliding_window if sliding_window is not None else getattr(module, "sliding_window", None)
    return int(window) if window else None


def _options(module, query, scaling, sliding_window, softcap, s_aux):
    """cupaged keyword options (all but ``sinks``) and the float32 sink tensor or None."""
    window = _window(module, sliding_window)
    if scaling is None:
        scaling = getattr(module, "scaling", None)
    sinks = None if s_aux is None else s_aux.detach().to(query.device, torch.float32).contiguous()
    opts = dict(sm_scale=None if scaling is None else float(scaling),
                window_left=-1 if window is None else window - 1,
                logits_soft_cap=float(softcap) if softcap else 0.0)
    return opts, sinks


def _sinks(sinks):
    return None if sinks is None else _array(sinks)


def _heads_last(x):
    """``[batch, heads, seq, d]`` -> contiguous ``[batch * seq, heads, d]``."""
    b, h, s, d = x.shape
    return x.transpose(1, 2).reshape(b * s, h, d).contiguous()


def _varlen(q, k, v, cu_q, cu_k, out, causal, opts, sinks):
    """``cupaged.varlen_prefill`` on torch tensors (``cu_q``/``cu_k`` int32) into ``out``,
    on torch's current stream."""
    varlen_prefill(_array(q), _array(k), _array(v), _array(cu_q), _array(cu_k),
                   causal=causal, out=_array(out), sinks=_sinks(sinks), **opts)
    return out


# ----------------------------------------------------------------------------- per-step caches
class _PerTensor:
    """Values derived from a tensor, kept while that very tensor lives unchanged (its
    identity and version), so that the layers of one forward compute them once."""

    def __init__(self):
        self._entries = {}

    def get(self, t, extra, make):
        key = (id(t), extra)
        e = self._entries.get(key)
        if e is not None and e[0]() is t and e[1] == t._version:
            return e[2]
        value = make()
        if len(self._entries) > 64:
            self._entries.clear()
        self._entries[key] = (weakref.ref(t), t._version, value)
        return value


_LAYOUTS = _PerTensor()  # padding mask -> packed layout (standard prefill)
_TABLES = _PerTensor()   # padding mask or read index -> block tables and lengths


def _capturing():
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


# ----------------------------------------------------------------------------- standard
def _padding_layout(mask, b, sq, sk):
    """Rows kept and cumulative lengths of a padded batch, from a 2-D padding mask (read on
    the host: once per forward, the layers share it).

    Returns
    -------
    q_rows, k_rows : torch.Tensor or None
        int64 indices (on the mask's device) of the kept query rows (of ``b * sq``) and key
        rows (of ``b * sk``); None when nothing is padded.
    cu_q, cu_k : torch.Tensor
        int32 ``[b + 1]`` prefix sums of the kept query and key counts, on that device.
    """
    if mask is None:
        return (None, None, torch.arange(b + 1, dtype=torch.int32) * sq,
                torch.arange(b + 1, dtype=torch.int32) * sk)
    if mask.ndim != 2 or tuple(mask.shape) != (b, sk):
        raise ValueError(f"attention_mask: expected a 2-D padding mask [{b}, {sk}] or None "
                         f"(cupaged supports causal and padding masks only), got shape "
                         f"{tuple(mask.shape)}")

    def make():
        keep_k = mask.detach().to("cpu").numpy().astype(bool)
        keep_q = keep_k[:, sk - sq:]
        cu_q = np.concatenate([[0], np.cumsum(keep_q.sum(1))]).astype(np.int32)
        cu_k = np.concatenate([[0], np.cumsum(keep_k.sum(1))]).astype(np.int32)
        device = mask.device
        return (torch.from_numpy(np.flatnonzero(keep_q)).to(device),
                torch.from_numpy(np.flatnonzero(keep_k)).to(device),
                torch.from_numpy(cu_q).to(device), torch.from_numpy(cu_k).to(device))
    return _LAYOUTS.get(mask, (sq, sk), make)


def _token_tables(mask, b, sk):
    """Block tables of one token a block over ``[b * sk]`` token-major rows: row ``i``
    lists the kept positions of sequence ``i`` (``i * sk + j``) in order; and the kept
    counts. On the device, no host read; once per step (the layers share the mask)."""
    def make():
        keep = mask.to(torch.bool)
        order = torch.sort((~keep).to(torch.int8), dim=1, stable=True).indices
        base = torch.arange(b, device=mask.device, dtype=torch.int64)[:, None] * sk
        return (order + base).to(torch.int32), keep.sum(1, dtype=torch.int32)
    return make() if _capturing() else _TABLES.get(mask, ("tokens", sk), make)


def _decode_step(query, key, value, mask, opts, sinks):
    """One query a sequence over the model's cache ``[b, hk, sk, d]``: HND blocks of one
    sequence (no padding), else token-major rows with a token-granular table."""
    b, hq, _, d = query.shape
    hk, sk = key.shape[1], key.shape[2]
    q = query[:, :, 0]
    if q.stride(-1) != 1 or q.stride(1) != d:
        q = q.contiguous()
    out = torch.empty((b, hq, d), dtype=query.dtype, device=query.device)
    if mask is None and key.is_contiguous() and value.is_contiguous():
        tables = torch.arange(b, dtype=torch.int32, device=query.device)[:, None]
        lens = torch.full((b,), sk, dtype=torch.int32, device=query.device)
        k_cache, v_cache, layout = key, value, "HND"
    else:
        if mask is None:
            mask = torch.ones((b, sk), dtype=torch.bool, device=query.device)
        tables, lens = _token_tables(mask, b, sk)
        k_cache = key.transpose(1, 2).reshape(b * sk, 1, hk, d)
        v_cache = value.transpose(1, 2).reshape(b * sk, 1, hk, d)
        layout = "NHD"
    paged_decode(_array(q), _array(k_cache), _array(v_cache), _array(tables), _array(lens),
                 layout=layout, out=_array(out), sinks=_sinks(sinks), **opts)
    return out.view(b, 1, hq, d)


def attention_forward(module, query, key, value, attention_mask, dropout=0.0, scaling=None,
                      sliding_window=None, softcap=None, is_causal=None, s_aux=None, **kwargs):
    """The ``"cupaged"`` attention implementation.

    Parameters
    ----------
    module : torch.nn.Module
        The attention layer (``scaling``, ``is_causal``, ``sliding_window`` read from it
        when not given).
    query : torch.Tensor
        ``[batch, num_q_heads, q_len, head_dim]`` float16, bfloat16 or float32.
    key, value : torch.Tensor
        ``[batch, num_kv_heads, kv_len, head_dim]`` (cached and new tokens), query's dtype.
    attention_mask : torch.Tensor or None
        bool ``[batch, kv_len]`` padding mask (True: a real token), as transformers' flash
        mask function makes it, or None (no padding).
    dropout : float
        Must be 0.
    scaling : float, optional
        Score scale (default ``head_dim ** -0.5``).
    sliding_window : int, optional
        ``W``: a query sees its last ``W`` positions.
    softcap : float, optional
        Logit soft cap.
    is_causal : bool, optional
        Default: the module's ``is_causal`` (else True).
    s_aux : torch.Tensor, optional
        ``[num_q_heads]`` attention-sink logits.

    Returns
    -------
    out : torch.Tensor
        ``[batch, q_len, num_q_heads, head_dim]`` in query's dtype; padded query rows zero.
    None
        No attention weights.
    """
    _check_inference(query, key, value, dropout)
    b, hq, sq, d = query.shape
    sk = key.shape[2]
    causal = getattr(module, "is_causal", True) if is_causal is None else bool(is_causal)
    opts, sinks = _options(module, query, scaling, sliding_window, softcap, s_aux)
    if attention_mask is not None and (attention_mask.ndim != 2
                                       or tuple(attention_mask.shape) != (b, sk)):
        _padding_layout(attention_mask, b, sq, sk)  # raises the shape error
    if sq == 1 and query.is_cuda and causal:
        return _decode_step(query, key, value, attention_mask, opts, sinks), None
    q, k, v = _heads_last(query), _heads_last(key), _heads_last(value)
    q_rows, k_rows, cu_q, cu_k = _padding_layout(attention_mask, b, sq, sk)
    device = query.device
    if q_rows is not None:
        q, k, v = q[q_rows], k[k_rows], v[k_rows]
    packed = _varlen(q, k, v, cu_q.to(device), cu_k.to(device), torch.empty_like(q), causal,
                     opts, sinks)
    if q_rows is None:
        return packed.view(b, sq, hq, d), None
    out = torch.zeros((b * sq, hq, d), dtype=query.dtype, device=device)
    out[q_rows] = packed
    return out.view(b, sq, hq, d), None


# ----------------------------------------------------------------------------- paged
def _rows(x):
    """``[1, heads, tokens, d]`` -> ``[tokens, heads, d]`` (a view when the heads are
    dense, as the projections leave them)."""
    t = x[0].transpose(0, 1)
    return t if t.stride(1) == t.shape[2] and t.stride(2) == 1 else t.contiguous()


def _slot_tables(read_index, cu_k, block_size, width):
    """Block tables ``[batch, width]`` and lengths of a paged batch from its read index:
    token ``t`` of sequence ``i`` is slot ``read_index[cu_k[i] + t]``, so block ``j`` is
    ``read_index[cu_k[i] + j * block_size] // block_size``. On the device; once per step
    (the layers of a group share the index)."""
    def make():
        lens = (cu_k[1:] - cu_k[:-1]).to(torch.int32)
        j = torch.arange(width, device=cu_k.device, dtype=torch.int64) * block_size
        idx = (cu_k[:-1, None].to(torch.int64) + j[None, :]).clamp(
            max=max(read_index.numel() - 1, 0))
        blocks = torch.div(read_index[idx], block_size, rounding_mode="floor")
        tables = torch.where(j[None, :] < lens[:, None], blocks, -1).to(torch.int32)
        return tables, lens
    if _capturing():
        return make()
    return _TABLES.get(read_index, (cu_k.data_ptr(), cu_k._version, block_size, width), make)


def _paged_varlen(module, query, key, value, cache, cu_seq_lens_q, cu_seq_lens_k, max_seqlen_q,
                  max_seqlen_k, opts, sinks, kwargs):
    """Continuous batching's varlen path (see the module notes)."""
    group, index = cache.layer_index_to_group_indices[module.layer_idx]
    read, write = kwargs["read_index"][group], kwargs["write_index"][group]
    q = _rows(query)
    cu_q, cu_k = cu_seq_lens_q.to(torch.int32), cu_seq_lens_k.to(torch.int32)
    out = torch.empty_like(q)
    if _window(module, None) is not None:  # sliding groups: sentinel slots, read through update
        k_all, v_all = cache.update(key_states=key, value_states=value,
                                    layer_idx=module.layer_idx, read_index=kwargs["read_index"],
                                    write_index=kwargs["write_index"])
        return _varlen(q, k_all, v_all, cu_q, cu_k, out, True, opts, sinks)
    bs = cache.block_size
    shape = (-1, bs, cache.num_key_value_heads, cache.head_dim)
    k_cache, v_cache = cache.key_cache[index].view(shape), cache.value_cache[index].view(shape)
    k, v = _rows(key), _rows(value)
    write_kv_cache(_array(k), _array(v), _array(k_cache), _array(v_cache),
                   _array(write[:k.shape[0]]))
    if read.numel() == 0:  # fresh prompts: their own keys only
        return _varlen(q, k, v, cu_q, cu_k, out, True, opts, sinks)
    longest = max_seqlen_k if isinstance(max_seqlen_k, int) and max_seqlen_k > 0 else read.numel()
    tables, lens = _slot_tables(read, cu_k, bs, -(-longest // bs))
    if max_seqlen_q == 1:
        n = cu_q.shape[0] - 1
        if n < q.shape[0]:
            out[n:].zero_()
        paged_decode(_array(q[:n]), _array(k_cache), _array(v_cache), _array(tables),
                     _array(lens), layout="NHD", out=_array(out[:n]), sinks=_sinks(sinks),
                     **opts)
    else:
        paged_attention(_array(q), _array(k_cache), _array(v_cache), _array(cu_q),
                        _array(tables), _array(lens), layout="NHD", out=_array(out),
                        sinks=_sinks(sinks), **opts)
    return out


def _paged_decode(module, query, key, value, cache, cu_seq_lens_k, block_table, opts, sinks):
    """The decode path given a ``block_table``: the new tokens written at their slots
    (padding rows, of no keys, skipped), then attention on the paged cache itself."""
    group, index = cache.layer_index_to_group_indices[module.layer_idx]
    bs = cache.block_size
    shape = (-1, bs, cache.num_key_value_heads, cache.head_dim)
    k_cache, v_cache = cache.key_cache[index].view(shape), cache.value_cache[index].view(shape)
    q, k_new, v_new = _rows(query), _rows(key), _rows(value)    # [batch, heads, d]
    n = q.shape[0]
    cu_k = cu_seq_lens_k[:n + 1].to(torch.int32)
    lens = cu_k[1:] - cu_k[:-1]
    tables = block_table[group][:n].to(torch.int32)
    pos = (lens - 1).clamp(min=0).to(torch.int64)
    blocks = tables.gather(1, torch.div(pos, bs, rounding_mode="floor")[:, None])[:, 0]
    slots = torch.where(lens > 0, blocks.to(torch.int64) * bs + pos % bs, -1)
    out = torch.empty_like(q)
    write_kv_cache(_array(k_new), _array(v_new), _array(k_cache), _array(v_cache),
                   _array(slots))
    paged_decode(_array(q), _array(k_cache), _array(v_cache), _array(tables), _array(lens),
                 layout="NHD", out=_array(out), sinks=_sinks(sinks), **opts)
    return out


def paged_attention_forward(module, query, key, value, attention_mask, cache=None,
                            cu_seq_lens_q=None, cu_seq_lens_k=None, max_seqlen_q=None,
                            max_seqlen_k=None, block_table=None, dropout=0.0, scaling=None,
                            sliding_window=None, softcap=None, s_aux=None, **kwargs):
    """The ``"paged|cupaged"`` attention implementation (continuous batching).

    Parameters
    ----------
    module : torch.nn.Module
        The attention layer (``layer_idx``; ``scaling``, ``sliding_window`` when not given).
    query : torch.Tensor
        ``[1, num_q_heads, num_q_tokens, head_dim]``: the step's tokens, packed (rows past
        ``cu_seq_lens_q[-1]`` are padding).
    key, value : torch.Tensor
        ``[1, num_kv_heads, num_q_tokens, head_dim]``: their keys and values.
    attention_mask : None
        Unused (causality comes from the lengths).
    cache : PagedAttentionCache
        transformers' paged cache: its NHD block tensors, written through ``write_index``
        and read in place through tables built from ``read_index``.
    cu_seq_lens_q : torch.Tensor
        int32 ``[batch + 1]`` query prefix sums (a plateau for padding sequences).
    cu_seq_lens_k : torch.Tensor or dict of torch.Tensor
        int32 ``[batch + 1]`` key prefix sums including the new tokens; per layer type
        (``"full_attention"``, ``"sliding_attention"``) for hybrid models.
    max_seqlen_q, max_seqlen_k : int or dict
        The longest query (1: a decode-only batch) and key counts (bounds the tables).
    block_table : torch.Tensor, optional
        int32 ``[groups, batch, max_blocks_per_seq]``, -1 padded: selects the decode path.
    dropout, scaling, sliding_window, softcap, s_aux
        As :func:`attention_forward`.
    **kwargs
        ``read_index``, ``write_index`` (varlen path) and other ignored model arguments.

    Returns
    -------
    out : torch.Tensor
        ``[num_q_tokens, num_q_heads, head_dim]`` in query's dtype; padding rows zero.
    None
        No attention weights.
    """
    if cache is None:
        raise ValueError(f"cache: {PAGED_NAME!r} needs transformers' paged attention cache "
                         f"(continuous batching); got None: use {NAME!r} for a standard forward")
    _check_inference(query, key, value, dropout)
    opts, sinks = _options(module, query, scaling, sliding_window, softcap, s_aux)
    windowed = _window(module, sliding_window) is not None
    layer_type = "sliding_attention" if windowed else "full_attention"
    if isinstance(cu_seq_lens_k, dict):
        cu_seq_lens_k = cu_seq_lens_k[layer_type]
    if isinstance(max_seqlen_k, dict):
        max_seqlen_k = max_seqlen_k.get(layer_type)
    if block_table is None:
        return _paged_varlen(module, query, key, value, cache, cu_seq_lens_q, cu_seq_lens_k,
                             max_seqlen_q, max_seqlen_k, opts, sinks, kwargs), None
    return _paged_decode(module, query, key, value, cache, cu_seq_lens_k, block_table,
                         opts, sinks), None


# ----------------------------------------------------------------------------- registry
def register():
    """Register ``"cupaged"`` (with flash attention's padding-mask function) and
    ``"paged|cupaged"`` with transformers' attention interfaces (done on import)."""
    AttentionInterface.register(NAME, attention_forward)
    AttentionInterface.register(PAGED_NAME, paged_attention_forward)
    AttentionMaskInterface.register(NAME, flash_attention_mask)


register()
