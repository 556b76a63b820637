"""A continuous-batching engine over the paged KV cache (``cupaged demo``).

Requests with random prompt and output lengths arrive over time; a scheduler admits them
while the block pool can hold them (reserving each request's final size, so appends never
run out of blocks and nothing is preempted). Every step runs one mixed batch, a decode
token per request past its prompt plus prompt chunks up to a token budget: its tokens are
appended to the block tables, their K/V written by ``cupaged.write_kv_cache`` and
``cupaged.paged_attention`` runs over the whole batch; finished requests free their blocks.

Engines: ``--model tiny`` (default on a GPU) runs ``cupaged.engine.model.TinyLlama``, a
random-weight Llama-style model (RoPE by ``cupaged.apply_rope``, one paged cache per
layer) that reads each prompt and generates greedily; ``--model none`` (default on the
CPU) attends random queries, keys and values, measuring the cache and attention path only.
NumPy runs the reference backend, CuPy the CUDA kernels. ``--check`` compares a GPU run with
the reference: each attention step (``none``) or each chosen token's logits against the
NumPy model scoring the same tokens (``tiny``).

``--kv-dtype fp8_e4m3|fp8_e5m2`` keeps the cache in fp8 (1-byte elements). The tiny model's
scales are fixed per layer and kv head from its weights (``cupaged.engine.model.kv_scales``:
the bound every key and value of an RMS-normalised input obeys); random q/k/v, drawn from
N(0, 1), take ``FP8_SCALE``. After a tiny-model run the same model with a cache of ``dtype``
scores the generated tokens on the same backend, and the demo prints how far the fp8 run's
logits and greedy choices are from it.
"""
from __future__ import annotations

import os
import time
from collections import deque
from dataclasses import dataclass, field, replace

import numpy as np

from ..core.arrays import (HEAD_DIMS, as_dtype, check_choice, check_head_dim, cupy_module,
    gpu_available, host)
from ..core.checks import check_int
from ..core.errors import strict
from ..core.fp8 import KV_DTYPES
from ..core.layouts import LAYOUTS
from ..decode.plan import FP8_HEAD_DIMS

# relative tolerance ||out - ref|| / ||ref|| of the --check comparison, per dtype: of each
# step's attention output (--model none), of the chosen tokens' logits (--model tiny)
CHECK_TOLERANCE = {"float16": 2e-3, "bfloat16": 1e-2, "float32": 1e-4}
MODELS = ("auto", "tiny", "none")
FP8_SCALE = 1 / 32  # the demo's fp8 k_scale and v_scale: N(0, 1) keys and values well inside both ranges
NUMPY_BACKEND = "numpy (reference)"


def _opt(default, help, choices=None):
    """A DemoConfig field whose metadata becomes the ``cupaged demo`` option's help."""
    return field(default=default, metadata={"help": help, "choices": choices})


@dataclass(frozen=True)
class DemoConfig:
    """Sizes of a simulation; every field is a ``cupaged demo`` option of the same name."""
    requests: int = _opt(64, "Requests in the run.")
    seed: int = _opt(0, "Random seed (lengths, arrivals, q/k/v or model weights and prompts).")
    num_blocks: int = _opt(192, "Blocks in the KV cache pool.")
    block_size: int = _opt(16, "Tokens per cache block.")
    num_q_heads: int = _opt(8, "Query heads.")
    num_kv_heads: int = _opt(2, "Key/value heads (GQA group = num_q_heads / num_kv_heads).")
    head_dim: int = _opt(64, f"Head size, one of {HEAD_DIMS}.")
    dtype: str = _opt("float16", "Cache and activation dtype.",
                      ["float16", "bfloat16", "float32"])
    layout: str = _opt("NHD", "KV cache layout.", list(LAYOUTS))
    kv_dtype: str = _opt("none", "KV cache elements: none (the dtype) or an fp8 format (tiny: "
                         "per-head scales from the weights, logits compared with a --dtype "
                         f"cache; none: scales {FP8_SCALE:g}; on the GPU float16/bfloat16 "
                         f"and head dim {' or '.join(map(str, FP8_HEAD_DIMS))}).",
                         ["none", *KV_DTYPES])
    max_seqs: int = _opt(16, "Requests running at once.")
    max_batch_tokens: int = _opt(256, "Token budget of a step (decode tokens + prefill chunks).")
    min_prompt: int = _opt(8, "Shortest prompt.")
    max_prompt: int = _opt(300, "Longest prompt.")
    min_output: int = _opt(4, "Fewest generated tokens.")
    max_output: int = _opt(64, "Most generated tokens.")
    arrival_rate: float = _opt(1.5, "Mean requests arriving per step (Poisson).")
    model: str = _opt("auto", "tiny: a random-weight Llama-style model generates the tokens; "
                      "none: random q/k/v (attention only); auto: tiny on the GPU, none on "
                      "the CPU.", list(MODELS))
    layers: int = _opt(2, "Decoder layers of the tiny model.")
    vocab_size: int = _opt(512, "Vocabulary of the tiny model.")
    check: bool = _opt(False, "Compare a GPU run with the NumPy reference (slow).")
    cuda_graphs: bool = _opt(True, "Replay the tiny model's decode-only steps from CUDA graphs "
                             "(GPU), one per batch size rounded up to a power of two; off in "
                             "strict mode (CUPAGED_STRICT=1), whose host checks cannot be "
                             "captured.")

    @property
    def max_seq_len(self) -> int:
        """Tokens of the longest possible request (prompt + output - 1 in the cache)."""
        return self.max_prompt + self.max_output - 1

    def validate(self):
        """Raise ValueError/TypeError naming the first bad field."""
        for name in ("requests", "num_blocks", "block_size", "num_q_heads", "num_kv_heads",
                     "max_seqs", "max_batch_tokens", "min_prompt", "min_output", "layers",
                     "vocab_size"):
            check_int(name, getattr(self, name))
        for lo, hi in (("min_prompt", "max_prompt"), ("min_output", "max_output")):
            if getattr(self, hi) < getattr(self, lo):
                raise ValueError(f"{hi}: expected >= {lo} = {getattr(self, lo)}, "
                                 f"got {getattr(self, hi)}")
        check_head_dim("head_dim", self.head_dim)
        as_dtype(self.dtype)
        check_choice("layout", self.layout, LAYOUTS)
        check_choice("model", self.model, MODELS)
        check_choice("kv_dtype", self.kv_dtype, ("none", *KV_DTYPES))
        if self.num_q_heads % self.num_kv_heads:
            raise ValueError(f"num_kv_heads: expected a divisor of num_q_heads = "
                             f"{self.num_q_heads}, got {self.num_kv_heads}")
        if self.max_seqs > self.max_batch_tokens:
            raise ValueError(f"max_seqs: expected <= max_batch_tokens = {self.max_batch_tokens} "
                             f"(one decode token each), got {self.max_seqs}")
        if blocks_for(self.max_seq_len, self.block_size) > self.num_blocks:
            raise ValueError(f"num_blocks: the longest request needs "
                             f"{blocks_for(self.max_seq_len, self.block_size)} blocks of "
                             f"{self.block_size} tokens, got {self.num_blocks}")
        if not self.arrival_rate > 0:
            raise ValueError(f"arrival_rate: expected > 0, got {self.arrival_rate}")


def blocks_for(tokens, block_size) -> int:
    """Blocks of ``block_size`` slots that hold ``tokens`` tokens."""
    return -(-tokens // block_size)


@dataclass
class Request:
    """One request: lengths fixed on arrival, progress counted by the scheduler."""
    rid: int
    arrival: int
    prompt_len: int
    output_len: int
    seq_id: int = -1
    prefilled: int = 0
    generated: int = 0

    @property
    def final_len(self) -> int:
        """Tokens in the cache when done (the last generated token is never appended)."""
        return self.prompt_len + self.output_len - 1

    @property
    def done(self) -> bool:
        """All output tokens generated."""
        return self.generated >= self.output_len


def make_requests(cfg, rng):
    """Requests with Poisson arrivals (the first at step 0) and uniform lengths."""
    times = np.cumsum(rng.exponential(1.0 / cfg.arrival_rate, cfg.requests))
    arrivals = (times - times[0]).astype(np.int64)
    prompts = rng.integers(cfg.min_prompt, cfg.max_prompt + 1, cfg.requests)
    outputs = rng.integers(cfg.min_output, cfg.max_output + 1, cfg.requests)
    return [Request(i, int(a), int(p), int(o))
            for i, (a, p, o) in enumerate(zip(arrivals, prompts, outputs))]


@dataclass
class StepPlan:
    """Host arrays of one step's batch, rows in ``rows`` order."""
    rows: list                   # [(Request, num_tokens)]
    slot_mapping: np.ndarray     # int64 [num_tokens]
    cu_seqlens_q: np.ndarray     # int32 [batch + 1]
    block_tables: np.ndarray     # int32 [batch, max_blocks_per_seq]
    seq_lens: np.ndarray         # int32 [batch], kv lengths including the new tokens
    num_decode: int              # leading rows that decode one token

    @property
    def num_tokens(self) -> int:
        """Query tokens in the batch (``cu_seqlens_q[-1]``)."""
        return int(self.cu_seqlens_q[-1])


class Scheduler:
    """Admission, batch building and retirement over one ``BlockTable`` (host side only)."""

    def __init__(self, cfg, requests, table):
        self.cfg = cfg
        self.table = table
        self.pending = deque(sorted(requests, key=lambda r: r.arrival))
        self.waiting = deque()
        self.running = []
        self.free_ids = list(range(cfg.max_seqs - 1, -1, -1))

    @property
    def finished(self) -> bool:
        """No request is pending, waiting or running."""
        return not (self.pending or self.waiting or self.running)

    def arrive(self, step):
        """Move requests that arrived by ``step`` to the waiting queue; return the step,
        advanced to the next arrival when nothing else is left to run."""
        if not (self.waiting or self.running) and self.pending:
            step = max(step, self.pending[0].arrival)
        while self.pending and self.pending[0].arrival <= step:
            self.waiting.append(self.pending.popleft())
        return step

    def admit(self):
        """Start waiting requests, first come first served, while their final sizes fit."""
        bs = self.cfg.block_size
        reserved = sum(blocks_for(r.final_len, bs) for r in self.running)
        while self.waiting and self.free_ids:
            need = blocks_for(self.waiting[0].final_len, bs)
            if reserved + need > self.cfg.num_blocks:
                break
            r = self.waiting.popleft()
            r.seq_id = self.free_ids.pop()
            self.running.append(r)
            reserved += need

    def plan(self) -> StepPlan:
        """Choose this step's rows (decode tokens first, then prefill chunks) and append them.

        Never empty after ``arrive`` and ``admit`` while requests remain: the budget always
        leaves room for a prefill chunk or a decode token (``max_seqs <= max_batch_tokens``).
        """
        rows = [(r, 1) for r in self.running if r.prefilled == r.prompt_len]
        num_decode = len(rows)
        budget = self.cfg.max_batch_tokens - num_decode
        for r in self.running:
            if r.prefilled < r.prompt_len and budget > 0:
                n = min(r.prompt_len - r.prefilled, budget)
                rows.append((r, n))
                budget -= n
        slots = [self.table.append(r.seq_id, n) for r, n in rows]
        ids = [r.seq_id for r, _ in rows]
        cu = np.zeros(len(rows) + 1, np.int32)
        cu[1:] = np.cumsum([n for _, n in rows])
        return StepPlan(rows, np.concatenate(slots), cu, self.table.block_tables[ids],
                        self.table.seq_lens[ids], num_decode)

    def complete(self, plan) -> int:
        """Account for a step's tokens, free finished requests; return how many finished."""
        for r, n in plan.rows:
            if r.prefilled < r.prompt_len:
                r.prefilled += n
                r.generated += r.prefilled == r.prompt_len  # last prompt chunk emits a token
            else:
                r.generated += 1
        done = [r for r in self.running if r.done]
        for r in done:
            self.table.free(r.seq_id)
            self.free_ids.append(r.seq_id)
            self.running.remove(r)
        return len(done)


@dataclass
class DemoStats:
    """What a run did and how fast.

    Throughput leaves out the first step, which on the GPU compiles (or loads) the kernels.
    """
    backend: str
    model: str = "none"
    kv_cache: str = ""
    steps: int = 0
    finished: int = 0
    prefill_tokens: int = 0
    decode_tokens: int = 0
    seconds: float = 0.0           # wall time after the first step
    first_step_seconds: float = 0.0
    first_step_tokens: int = 0
    occupancy: list = field(default_factory=list)   # used fraction of the pool per step
    batch_fill: list = field(default_factory=list)  # (tokens / budget, running requests) per step
    max_rel_error: float | None = None               # with check: worst step vs reference
    tokens: dict = field(default_factory=dict)       # tiny model: request id -> generated ids
    argmax_matches: tuple | None = None              # tiny model, check: (matching, tokens)
    graph_steps: int = 0                             # decode steps replayed from CUDA graphs
    fp8_vs_plain: tuple | None = None                # tiny model, fp8: (GenerationCheck, dtype)

    @property
    def tokens_per_s(self) -> float:
        timed = self.prefill_tokens + self.decode_tokens - self.first_step_tokens
        return timed / max(self.seconds, 1e-9)

    def summary(self, cfg=None):
        """Rows ``(label, value)`` for printing (``cfg`` adds the batch limits)."""
        occ = np.asarray(self.occupancy or [0.0])
        fill = np.asarray(self.batch_fill or [(0.0, 0)], dtype=np.float64)
        limits = f" of {cfg.max_batch_tokens} tokens" if cfg is not None else ""
        rows = [("backend", self.backend), ("model", self.model), ("kv cache", self.kv_cache),
                ("requests finished", self.finished),
                ("steps", self.steps), ("prefill tokens", self.prefill_tokens),
                ("decode tokens", self.decode_tokens),
                ("first step" if self.backend == NUMPY_BACKEND else
                 "first step (kernel build/load)", f"{self.first_step_seconds:.2f} s"),
                ("later steps", f"{self.seconds:.2f} s"),
                ("tokens/s", f"{self.tokens_per_s:,.0f}"),
                ("batch occupancy", f"mean {fill[:, 0].mean():.0%}{limits}, "
                                    f"{fill[:, 1].mean():.1f} requests running"),
                ("pool occupancy", f"mean {occ.mean():.0%}, peak {occ.max():.0%}")]
        if self.graph_steps:
            rows.append(("decode steps from CUDA graphs", f"{self.graph_steps} of {self.steps}"))
        if self.max_rel_error is not None:
            rows.append(("max rel. error vs reference", f"{self.max_rel_error:.2e}"))
        if self.argmax_matches is not None:
            rows.append(("reference argmax matches", "{} of {} tokens".format(*self.argmax_matches)))
        if self.fp8_vs_plain is not None:
            c, dtype = self.fp8_vs_plain
            rows.append((f"logits vs {dtype} cache", f"max |diff| {c.max_abs_error:.3g}, rel. "
                                                      f"{c.max_rel_error:.2e}"))
            rows.append((f"argmax vs {dtype} cache", f"{c.matches} of {c.total} tokens agree"))
        return rows


def array_module_for(device):
    """``numpy`` for ``"cpu"``, ``cupy`` for ``"gpu"``; ``"auto"`` picks the GPU if usable."""
    check_choice("device", device, ("auto", "cpu", "gpu"))
    if device == "cpu" or (device == "auto" and not gpu_available()):
        return np
    if not gpu_available():
        raise ValueError("device: 'gpu' asked for, but CuPy sees no CUDA device")
    return cupy_module()


def _randn(gen, shape, dtype):
    return gen.standard_normal(shape, dtype=np.float32).astype(dtype)


def launch_step(plan, cache, xp, gen, cfg):
    """Write the batch's random K/V into the cache and attend.

    Returns
    -------
    q : array
        The step's random queries ``[num_tokens, num_q_heads, head_dim]``.
    out : array
        ``paged_attention`` output, same shape and dtype as ``q``.
    """
    import cupaged
    dtype = as_dtype(cfg.dtype)
    t = plan.num_tokens
    q = _randn(gen, (t, cfg.num_q_heads, cfg.head_dim), dtype)
    k = _randn(gen, (t, cfg.num_kv_heads, cfg.head_dim), dtype)
    v = _randn(gen, (t, cfg.num_kv_heads, cfg.head_dim), dtype)
    cupaged.write_kv_cache(k, v, cache, xp.asarray(plan.slot_mapping))  # layout, fp8 scales
    return q, cupaged.paged_attention(q, cache, xp.asarray(plan.cu_seqlens_q),
                                      xp.asarray(plan.block_tables),
                                      xp.asarray(plan.seq_lens), causal=True)


def reference_error(plan, q, out, cache, cfg) -> float:
    """Relative error ``||out - ref|| / ||ref||`` of a step against the NumPy reference."""
    from ..reference.attention import paged_attention
    fp8 = ({} if cache.kv_dtype is None else
           dict(kv_dtype=cache.kv_dtype, k_scale=cache.k_scale, v_scale=cache.v_scale))
    ref = paged_attention(host(q), host(cache.k), host(cache.v), plan.cu_seqlens_q,
                          plan.block_tables, plan.seq_lens, causal=True, layout=cfg.layout,
                          **fp8)
    ref = np.asarray(ref, np.float64)
    diff = host(out).astype(np.float64) - ref
    return float(np.linalg.norm(diff) / max(np.linalg.norm(ref), 1e-30))


class AttentionOnly:
    """Steps with random queries, keys and values (``--model none``)."""
    label = "none (random q/k/v, attention only)"

    def __init__(self, cfg, xp):
        from .kv_cache import PagedKVCache
        self.cfg, self.xp = cfg, xp
        self.gen = xp.random.default_rng(cfg.seed + 1)
        fp8 = ({} if cfg.kv_dtype == "none" else
               dict(kv_dtype=cfg.kv_dtype, k_scale=FP8_SCALE, v_scale=FP8_SCALE))
        self.cache = PagedKVCache(cfg.num_blocks, cfg.block_size, cfg.num_kv_heads,
                                  cfg.head_dim, dtype=cfg.dtype, layout=cfg.layout, xp=xp, **fp8)
        self.pool = self.cache.pool

    def run(self, plan, stats):
        """One step; with ``check`` on the GPU, compare it with the reference."""
        q, out = launch_step(plan, self.cache, self.xp, self.gen, self.cfg)
        if self.cfg.check and self.xp is not np:
            err = reference_error(plan, q, out, self.cache, self.cfg)
            stats.max_rel_error = max(err, stats.max_rel_error or 0.0)

    def finish(self, requests, stats):
        """Nothing to do after the last step."""


def model_config(cfg):
    """The ``TinyLlamaConfig`` of a demo: its heads, dtype and layout, MLP 2x hidden."""
    from .model import TinyLlamaConfig
    return TinyLlamaConfig(vocab_size=cfg.vocab_size, num_layers=cfg.layers,
                           num_q_heads=cfg.num_q_heads, num_kv_heads=cfg.num_kv_heads,
                           head_dim=cfg.head_dim,
                           intermediate_size=2 * cfg.num_q_heads * cfg.head_dim,
                           dtype=cfg.dtype, layout=cfg.layout, seed=cfg.seed,
                           kv_dtype=None if cfg.kv_dtype == "none" else cfg.kv_dtype)


def prompt_tokens(cfg, request):
    """int32 ``[prompt_len]`` token ids of a request, drawn from ``(seed, rid)``."""
    rng = np.random.default_rng([cfg.seed, 1, request.rid])
    return rng.integers(0, cfg.vocab_size, request.prompt_len).astype(np.int32)


class ModelSteps:
    """Steps of the tiny model (``--model tiny``): prompts in, greedy tokens out."""

    def __init__(self, cfg, xp):
        from .blocks import BlockPool
        from .model import TinyLlama
        self.cfg, self.xp = cfg, xp
        self.model = TinyLlama(model_config(cfg), xp)
        config = self.model.config
        self.label = (f"tiny llama ({config.num_layers} layers, hidden {config.hidden_size}, "
                      f"vocab {config.vocab_size}, greedy)")
        self.pool = BlockPool(cfg.num_blocks, cfg.block_size)
        self.k, self.v = self.model.allocate_cache(cfg.num_blocks, cfg.block_size)
        self.prompts, self.logits = {}, {}
        # chosen tokens' logits, for the reference check and the comparison with a dtype cache
        self.keep_logits = (cfg.check and xp is not np) or cfg.kv_dtype != "none"
        self.stream = self.graphs = None
        if xp is not np:  # every step on one stream: eager steps and graph replays in order
            from .model import DecodeGraphs
            self.stream = xp.cuda.Stream(non_blocking=True)
            # the weights and the zeroed caches were made on the current stream, which a
            # non-blocking stream does not wait for: the steps start after that work
            self.stream.wait_event(xp.cuda.get_current_stream().record())
            if cfg.cuda_graphs and not strict():  # strict checks read device arrays
                self.graphs = DecodeGraphs(self.model, self.k, self.v,
                                           blocks_for(cfg.max_seq_len, cfg.block_size),
                                           self.stream)

    def _inputs(self, plan, tokens):
        """Token ids of the step's rows and the rows that emit a token (prompt ends, decodes)."""
        ids, emit = [], []
        for i, (r, n) in enumerate(plan.rows):
            if r.prefilled < r.prompt_len:
                if r.rid not in self.prompts:
                    self.prompts[r.rid] = prompt_tokens(self.cfg, r)
                ids.append(self.prompts[r.rid][r.prefilled:r.prefilled + n])
                if r.prefilled + n == r.prompt_len:
                    emit.append(i)
            else:
                ids.append(np.asarray(tokens[r.rid][-1:], np.int32))
                emit.append(i)
        return np.concatenate(ids), emit

    def run(self, plan, stats):
        """One step: forward every row, append each emitting row's greedy token."""
        xp = self.xp
        ids, emit = self._inputs(plan, stats.tokens)
        if self.stream is None:
            logits = self._forward(plan, ids, emit)
        else:
            with self.stream:
                if self.graphs is not None and plan.num_decode == len(plan.rows):
                    logits = host(self.graphs.step(ids, plan.seq_lens, plan.block_tables,
                                                   plan.slot_mapping))
                    stats.graph_steps += 1
                else:
                    logits = self._forward(plan, ids, emit)
        for i, row_logits in zip(emit, logits):
            rid = plan.rows[i][0].rid
            stats.tokens.setdefault(rid, []).append(int(row_logits.argmax()))
            if self.keep_logits:
                self.logits.setdefault(rid, []).append(row_logits)

    def _forward(self, plan, ids, emit):
        """Host logits of the emitting rows of one step, run eagerly."""
        from .layers import AttentionMetadata
        md = AttentionMetadata(plan.cu_seqlens_q, plan.seq_lens, plan.block_tables,
                               plan.slot_mapping, xp=self.xp)
        rows = plan.cu_seqlens_q[1:][emit] - 1
        return host(self.model.forward(ids, md, self.k, self.v, logits_rows=rows))

    def finish(self, requests, stats):
        """With ``check`` on the GPU: the NumPy model scores every request's tokens. With an
        fp8 cache: the model with a cache of ``dtype`` scores them on the same backend."""
        if not self.keep_logits:
            return
        from .model import check_generation
        runs = [(self.prompts[r.rid], stats.tokens[r.rid], np.stack(self.logits[r.rid]))
                for r in requests]
        config, bs = self.model.config, self.cfg.block_size
        if self.cfg.check and self.xp is not np:
            check = check_generation(config, runs, block_size=bs)
            stats.max_rel_error = check.max_rel_error
            stats.argmax_matches = (check.matches, check.total)
        if config.kv_dtype is not None:
            plain = check_generation(replace(config, kv_dtype=None), runs, block_size=bs,
                                     xp=self.xp)
            stats.fp8_vs_plain = (plain, self.cfg.dtype)


def resolve_model(cfg, xp):
    """``"tiny"`` or ``"none"``: ``cfg.model`` with ``"auto"`` decided by the backend."""
    if cfg.model == "auto":
        return "none" if xp is np else "tiny"
    return cfg.model


def cache_bytes(cfg, model) -> int:
    """Bytes of a run's K and V caches: one cache (``model="none"``), one a layer (``"tiny"``)."""
    layers = cfg.layers if model == "tiny" else 1
    itemsize = as_dtype(cfg.dtype).itemsize if cfg.kv_dtype == "none" else 1
    return (2 * cfg.num_blocks * cfg.block_size * cfg.num_kv_heads * cfg.head_dim
            * itemsize * layers)


def kv_cache_label(cfg, model) -> str:
    """What a run's K/V caches hold and their bytes (:func:`cache_bytes`)."""
    if cfg.kv_dtype == "none":
        held = cfg.dtype
    elif model == "tiny":
        held = f"{cfg.kv_dtype} (1 byte; scales per layer and kv head, from the weights)"
    else:
        held = f"{cfg.kv_dtype} (1 byte; k_scale = v_scale = {FP8_SCALE:g})"
    return f"{held}, {cache_bytes(cfg, model) / 2**20:,.1f} MiB"


def free_memory(xp) -> tuple[int | None, str]:
    """Bytes a new array may take and where: the device's free memory and CuPy's pooled
    free blocks (CuPy), else the host's available memory (Linux ``MemAvailable``; the
    physical memory where ``/proc/meminfo`` is absent; None where neither is known)."""
    if xp is not np:
        free, _ = xp.cuda.runtime.memGetInfo()
        return free + xp.get_default_memory_pool().free_bytes(), "free device memory"
    try:
        with open("/proc/meminfo") as f:
            kib = next(int(line.split()[1]) for line in f if line.startswith("MemAvailable:"))
        return kib * 1024, "available host memory"
    except (OSError, StopIteration):
        pass
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"), "host memory"
    except (AttributeError, ValueError, OSError):  # no sysconf (Windows)
        return None, "host memory"


def check_run(cfg, xp):
    """Raise ValueError before anything is allocated: a bad field of ``cfg``
    (``DemoConfig.validate``), or caches larger than the memory ``xp`` has free."""
    cfg.validate()
    if cfg.kv_dtype != "none" and xp is not np:
        if as_dtype(cfg.dtype).itemsize != 2:
            raise ValueError(f"dtype: expected float16 or bfloat16 with kv_dtype "
                             f"{cfg.kv_dtype!r} on the GPU, got {cfg.dtype!r}")
        if cfg.head_dim not in FP8_HEAD_DIMS:
            raise ValueError(f"head_dim: expected one of {FP8_HEAD_DIMS} with kv_dtype "
                             f"{cfg.kv_dtype!r} on the GPU, got {cfg.head_dim}")
    need = cache_bytes(cfg, resolve_model(cfg, xp))
    free, where = free_memory(xp)
    if free is not None and need > free:
        fit = free // (need // cfg.num_blocks)
        raise ValueError(f"num_blocks: {cfg.num_blocks} blocks need {need / 2**30:,.1f} GiB of "
                         f"K/V cache, but {where} is {free / 2**30:,.1f} GiB: at most {fit:,} "
                         f"blocks of {cfg.block_size} tokens fit")


def run_demo(cfg=DemoConfig(), xp=None, progress=None) -> DemoStats:
    """Run the simulation to the last request.

    Parameters
    ----------
    cfg : DemoConfig
    xp : module, optional
        ``numpy`` (reference backend) or ``cupy`` (kernels); default: cupy if a GPU is usable.
    progress : callable, optional
        Called after every step with the number of requests that finished in it.

    Returns
    -------
    DemoStats

    Raises
    ------
    ValueError
        From :func:`check_run`, before anything is allocated.
    """
    from .blocks import BlockTable
    xp = array_module_for("auto") if xp is None else xp
    check_run(cfg, xp)
    model = resolve_model(cfg, xp)
    engine = (ModelSteps if model == "tiny" else AttentionOnly)(cfg, xp)
    table = BlockTable(engine.pool, cfg.max_seqs, blocks_for(cfg.max_seq_len, cfg.block_size))
    requests = make_requests(cfg, np.random.default_rng(cfg.seed))
    sched = Scheduler(cfg, requests, table)
    stats = DemoStats(backend=NUMPY_BACKEND if xp is np else "cupy (CUDA kernels)",
                      model=engine.label, kv_cache=kv_cache_label(cfg, model))
    start, step = time.perf_counter(), 0
    while not sched.finished:
        step = sched.arrive(step) + 1
        sched.admit()
        plan = sched.plan()
        engine.run(plan, stats)
        stats.decode_tokens += plan.num_decode
        stats.prefill_tokens += plan.num_tokens - plan.num_decode
        stats.occupancy.append(1.0 - engine.pool.num_free / cfg.num_blocks)
        stats.batch_fill.append((plan.num_tokens / cfg.max_batch_tokens, len(plan.rows)))
        done = sched.complete(plan)
        stats.finished += done
        stats.steps += 1
        if stats.steps == 1:
            _sync(xp)
            stats.first_step_seconds = time.perf_counter() - start
            stats.first_step_tokens = plan.num_tokens
            start = time.perf_counter()
        if progress is not None:
            progress(done)
    _sync(xp)
    stats.seconds = time.perf_counter() - start
    engine.finish(requests, stats)
    return stats


def _sync(xp):
    """Wait for queued GPU work so wall times cover it."""
    if xp is not np:
        xp.cuda.Device().synchronize()
