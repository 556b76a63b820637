"""cupaged as an attention backend of Hugging Face transformers.

Importing this module imports torch and transformers and registers two attention
implementations (and the mask function of the first):

- ``"cupaged"``: a standard implementation, used by ``model.generate`` and plain forwards.
  Queries ``[batch, num_q_heads, q_len, head_dim]`` and the keys/values of the model's
  cache ``[batch, num_kv_heads, kv_len, head_dim]`` are packed into a ragged batch (padding
  removed through the 2-D padding mask, as for flash attention) and run by
  ``cupaged.varlen_prefill`` with bottom-right causal alignment.
- ``"paged|cupaged"``: the paged implementation of transformers' continuous batching
  (``model.generate_batch``). Its varlen path writes and reads the ``PagedAttentionCache``
  through ``cache.update`` and runs ``cupaged.varlen_prefill`` over ``cu_seq_lens_q/k``; its
  decode path (given ``block_table``: one token per sequence) runs ``cupaged.paged_decode``
  on the cache itself (NHD layout), appending the new keys and values in place.

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

import contextlib

import numpy as np
import torch
from transformers import AttentionInterface, AttentionMaskInterface
from transformers.masking_utils import flash_attention_mask

from .. import interop
from .._arrays import bfloat16
from ..decode import paged_decode
from ..prefill import varlen_prefill

NAME = "cupaged"
PAGED_NAME = "paged|cupaged"

__all__ = ["NAME", "PAGED_NAME", "register", "attention_forward", "paged_attention_forward"]


# ----------------------------------------------------------------------------- tensors
def _array(t):
    """A CuPy (CUDA) or NumPy (CPU) array sharing ``t``'s memory."""
    if t.device.type == "cuda":
        return interop.as_cupy(t)
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(bfloat16)
    return t.numpy()


def _module_of(t):
    """The array module of ``_array(t)``."""
    if t.device.type == "cuda":
        import cupy
        return cupy
    return np


def _stream(t):
    """Run CuPy work on torch's current stream of ``t``'s device (nothing for CPU)."""
    return interop.caller_stream(t) if t.device.type == "cuda" else contextlib.nullcontext()


def _host_ints(t):
    """Host int64 copy of an integer tensor (one small device-to-host copy)."""
    return np.asarray(t.detach().to("cpu", torch.int64).numpy())


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
    with _stream(q):
        varlen_prefill(_array(q), _array(k), _array(v), _array(cu_q), _array(cu_k),
                       causal=causal, out=_array(out), sinks=_sinks(sinks), **opts)
    return out


# ----------------------------------------------------------------------------- standard
def _padding_layout(mask, b, sq, sk):
    """Rows kept and cumulative lengths of a padded batch, from a 2-D padding mask.

    Returns
    -------
    q_rows, k_rows : numpy.ndarray or None
        int64 indices of the kept query rows (of ``b * sq``) and key rows (of ``b * sk``);
        None when nothing is padded.
    cu_q, cu_k : numpy.ndarray
        int32 ``[b + 1]`` prefix sums of the kept query and key counts.
    """
    if mask is None:
        return None, None, np.arange(b + 1, dtype=np.int32) * sq, np.arange(b + 1, dtype=np.int32) * sk
    if mask.ndim != 2 or tuple(mask.shape) != (b, sk):
        raise ValueError(f"attention_mask: expected a 2-D padding mask [{b}, {sk}] or None "
                         f"(cupaged supports causal and padding masks only), got shape "
                         f"{tuple(mask.shape)}")
    keep_k = mask.detach().to("cpu").numpy().astype(bool)
    keep_q = keep_k[:, sk - sq:]
    cu_q = np.concatenate([[0], np.cumsum(keep_q.sum(1))]).astype(np.int32)
    cu_k = np.concatenate([[0], np.cumsum(keep_k.sum(1))]).astype(np.int32)
    return np.flatnonzero(keep_q), np.flatnonzero(keep_k), cu_q, cu_k


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
    q, k, v = _heads_last(query), _heads_last(key), _heads_last(value)
    q_rows, k_rows, cu_q, cu_k = _padding_layout(attention_mask, b, sq, sk)
    if q_rows is not None:
        q_idx = torch.from_numpy(q_rows).to(q.device)
        k_idx = torch.from_numpy(k_rows).to(k.device)
        q, k, v = q[q_idx], k[k_idx], v[k_idx]
    device = query.device
    packed = _varlen(q, k, v, torch.from_numpy(cu_q).to(device), torch.from_numpy(cu_k).to(device),
                     torch.empty_like(q), causal, opts, sinks)
    if q_rows is None:
        return packed.view(b, sq, hq, d), None
    out = torch.zeros((b * sq, hq, d), dtype=query.dtype, device=device)
    out[q_idx] = packed
    return out.view(b, sq, hq, d), None


# ----------------------------------------------------------------------------- paged
def _paged_varlen(module, query, key, value, cache, cu_seq_lens_q, cu_seq_lens_k, opts, sinks,
                  kwargs):
    """Continuous batching's varlen path: ``cache.update`` then ``varlen_prefill``."""
    k_all, v_all = cache.update(key_states=key, value_states=value, layer_idx=module.layer_idx,
                                read_index=kwargs["read_index"], write_index=kwargs["write_index"])
    q = query.transpose(1, 2).squeeze(0).contiguous()        # [num_q_tokens, hq, d]
    cu_q, cu_k = cu_seq_lens_q.to(torch.int32), cu_seq_lens_k.to(torch.int32)
    tq, tk = (int(x) for x in _host_ints(torch.stack([cu_q[-1], cu_k[-1]])))
    out = torch.zeros_like(q)                                # padding rows stay zero
    _varlen(q[:tq], k_all[:tk].contiguous(), v_all[:tk].contiguous(), cu_q, cu_k, out[:tq],
            True, opts, sinks)
    return out


def _paged_decode(module, query, key, value, cache, cu_seq_lens_k, block_table, opts, sinks):
    """Continuous batching's decode path: append and attend on the paged cache itself."""
    group, index = cache.layer_index_to_group_indices[module.layer_idx]
    shape = (-1, cache.block_size, cache.num_key_value_heads, cache.head_dim)
    k_cache, v_cache = cache.key_cache[index].view(shape), cache.value_cache[index].view(shape)
    q = query.permute(2, 0, 1, 3).flatten(1, 2).contiguous()   # [batch, hq, d]
    k_new = key.permute(2, 0, 1, 3).flatten(1, 2).contiguous()
    v_new = value.permute(2, 0, 1, 3).flatten(1, 2).contiguous()
    lens = np.diff(_host_ints(cu_seq_lens_k[:q.shape[0] + 1]))
    n = int(np.argmin(lens > 0)) if (lens <= 0).any() else len(lens)  # padding rows at the end
    tables = block_table[group][:n].to(torch.int32).contiguous()
    out = torch.zeros_like(q)
    if n == 0:
        return out
    with _stream(q):
        cache_lens = _module_of(q).asarray((lens[:n] - 1).astype(np.int32))
        paged_decode(_array(q[:n]), _array(k_cache), _array(v_cache), _array(tables), cache_lens,
                     k_new=_array(k_new[:n]), v_new=_array(v_new[:n]), layout="NHD",
                     out=_array(out[:n]), sinks=_sinks(sinks), **opts)
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
        ``[1, num_q_heads, num_q_tokens, head_dim]``: the step's tokens, packed.
    key, value : torch.Tensor
        ``[1, num_kv_heads, num_q_tokens, head_dim]``: their keys and values.
    attention_mask : None
        Unused (causality comes from the lengths).
    cache : PagedAttentionCache
        transformers' paged cache: ``update`` (varlen path) or its NHD block tensors
        (decode path).
    cu_seq_lens_q : torch.Tensor
        int32 ``[batch + 1]`` query prefix sums (a plateau for padding sequences).
    cu_seq_lens_k : torch.Tensor or dict of torch.Tensor
        int32 ``[batch + 1]`` key prefix sums including the new tokens; per layer type
        (``"full_attention"``, ``"sliding_attention"``) for hybrid models.
    max_seqlen_q, max_seqlen_k : int or dict
        Unused (lengths are read from the prefix sums).
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
    if isinstance(cu_seq_lens_k, dict):
        layer_type = "full_attention" if _window(module, sliding_window) is None else "sliding_attention"
        cu_seq_lens_k = cu_seq_lens_k[layer_type]
    if block_table is None:
        return _paged_varlen(module, query, key, value, cache, cu_seq_lens_q, cu_seq_lens_k,
                             opts, sinks, kwargs), None
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
