"""Kernel argument records (core.launch): the bytes a launch hands cuLaunchKernel, checked
against ctypes' layout of the same C struct, and the packing paths that ops use (a plan's
Bound, the per-call pack) against each other. CPU only: nothing is launched."""
import ctypes

import numpy as np
import pytest

from cupaged.core import abi
from cupaged.core.launch import TENSOR_MAP, ArgBuffer, Record, pack

_CTYPES = {"i64": ctypes.c_int64, "long long": ctypes.c_int64, "u64": ctypes.c_uint64,
           "int": ctypes.c_int32, "unsigned": ctypes.c_uint32, "float": ctypes.c_float,
           "double": ctypes.c_double}


def _ctypes_struct(record):
    """The C struct of ``record`` as ctypes lays it out (natural alignment)."""
    fields = [(f.name, ctypes.c_uint64 if "*" in f.ctype else _CTYPES[f.ctype])
              for f in record.fields]
    return type(record.name, (ctypes.Structure,), {"_fields_": fields})


def _values(record, rng):
    out = {}
    for f in record.fields:
        if "*" in f.ctype:
            out[f.name] = int(rng.integers(1, 2**47)) * 16
        elif f.ctype == "float":
            out[f.name] = float(np.float32(rng.standard_normal()))
        elif f.ctype == "double":
            out[f.name] = float(rng.standard_normal())
        elif f.ctype in ("unsigned", "u64"):
            out[f.name] = int(rng.integers(0, 2**31))
        else:
            out[f.name] = int(rng.integers(-2**31, 2**31))
    return out


STRUCT_RECORDS = [r for r in abi.RECORDS if r.has_struct]


@pytest.mark.parametrize("record", STRUCT_RECORDS, ids=lambda r: r.name)
def test_record_bytes_match_the_c_struct(record):
    rng = np.random.default_rng(len(record.name))
    values = _values(record, rng)
    want = _ctypes_struct(record)(**values)
    buf = pack(record, **values)
    assert record.size == -(-ctypes.sizeof(want) // 8) * 8
    assert bytes(buf.data[:ctypes.sizeof(want)]) == bytes(want)
    # one pointer per field into those bytes, at the field's offset
    params = (ctypes.c_void_p * len(record.fields)).from_address(buf.params)
    base = ctypes.addressof(ctypes.c_char.from_buffer(buf.data))
    for f, p in zip(record.fields, params):
        assert p - base == getattr(type(want), f.name).offset


@pytest.mark.parametrize("record", STRUCT_RECORDS, ids=lambda r: r.name)
def test_bound_fields_and_call_fields_pack_alike(record):
    rng = np.random.default_rng(7 + len(record.fields))
    values = _values(record, rng)
    names = [f.name for f in record.fields]
    fixed = {n: values[n] for n in names[::2]}
    given = {n: values[n] for n in names[1::2]}
    bound = record.bind(**fixed)
    first = bytes(bound.pack(**given).data)
    assert first == bytes(pack(record, **values).data)
    given2 = {n: v + 16 if isinstance(v, int) else v for n, v in given.items()}
    again = bytes(bound.pack(**given2).data)  # the cached packer, new values
    assert again == bytes(pack(record, **{**values, **given2}).data)
    # more fields fixed later (a call's strides), the rest positional, in any order
    late = dict(list(given.items())[::2])
    rest = [n for n in reversed(list(given)) if n not in late]
    positional = bound.bind(**late).packer(*rest)
    got = bytes(positional(*(given2[n] for n in rest)).data)
    assert got == bytes(pack(record, **{**values, **{n: given2[n] for n in rest}}).data)


def test_records_refuse_unknown_and_missing_fields():
    rec = Record("Probe", [("int", "a"), ("float", "b", 0.0), ("const T*", "p", 0)])
    with pytest.raises(TypeError, match="unknown fields"):
        rec.bind(c=1)
    with pytest.raises(TypeError, match="'a' not given"):
        rec.bind(b=1.0).pack(p=16)
    with pytest.raises(ValueError, match="duplicate"):
        Record("Twice", [("int", "a"), ("int", "a")])
    assert isinstance(ArgBuffer(rec).params, int)


def test_tensor_map_fields_are_64_byte_aligned_parameters():
    """ProblemTma: Problem's bytes, then each 128-byte map at a 64-byte-aligned offset (its
    kernelParams pointer there); a record declaring parameters only."""
    rec = abi.PREFILL_TMA
    rng = np.random.default_rng(3)
    values = _values(abi.PREFILL, rng)
    maps = {"k_map": bytes(rng.integers(0, 256, 128, np.uint8)),
            "v_map": bytes(rng.integers(0, 256, 128, np.uint8))}
    buf = pack(rec, **values, **maps)
    assert bytes(buf.data[:abi.PREFILL.size - 8]) == bytes(pack(abi.PREFILL, **values).data)[:-8]
    params = (ctypes.c_void_p * len(rec.fields)).from_address(buf.params)
    base = ctypes.addressof(ctypes.c_char.from_buffer(buf.data))
    for name, want in maps.items():
        at = rec.offsets[rec.index[name]]
        assert at % 64 == 0 and params[rec.index[name]] - base == at
        assert bytes(buf.data[at:at + 128]) == want
    assert rec.size % 64 == 0 and rec.size >= rec.offsets[-1] + 128
    # a plan's bound packer, the maps given per call as the addresses are
    bound = rec.bind(**{n: v for n, v in values.items() if n not in ("q", "k")})
    again = bound.packer("q", "k", "k_map", "v_map")(values["q"], values["k"], maps["k_map"],
                                                       maps["v_map"])
    assert bytes(again.data) == bytes(buf.data)
    cpp = rec.cpp()
    assert "struct" not in cpp and f"{TENSOR_MAP} k_map, {TENSOR_MAP} v_map\n" in cpp
    with pytest.raises(ValueError, match="parameters only"):
        Record("Bad", [("int", "a"), (TENSOR_MAP, "m")])
